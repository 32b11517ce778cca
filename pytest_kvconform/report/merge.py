"""Merging several hosts' reports into one backend x host x clause matrix.

A qualification may need several hosts (a GPU host for KV-L7 and KV-A6, a CPU host for
the rest); ``kvconform merge`` refuses reports that cannot be compared (another schema
or contract, the same run twice) and takes the worst host's verdict.  Stdlib only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pytest_kvconform.contract import inert
from pytest_kvconform.contract.clauses import clause_sort_key
from pytest_kvconform.report.render import (
    Footnotes,
    clause_columns,
    device_text,
    markdown_table,
    matrix_lines,
    matrix_rows,
    md_escape,
    row_name,
)
from pytest_kvconform.report.schema import ReportError
from pytest_kvconform.report.verdict import describe_startup_failure, describe_uncovered


def check_mergeable(named: Sequence[tuple[str, Mapping[str, Any]]]) -> None:
    """Refuse reports of different schema or contract, naming both files and values.

    Checked before full validation so that a report of another schema version
    gets this message rather than a confusing schema error.
    """
    if not named:
        raise ReportError("$", "no reports to merge")
    first_name, first = named[0]
    seen: dict[Any, str] = {}
    for name, report in named:
        identity = _run_identity(report)
        if identity in seen:
            raise ReportError(
                "$.run.id",
                f"{seen[identity]} and {name} are the same run (run {identity[0]!r} on host "
                f"{identity[1]!r}, started {identity[2]!r}); merge each host's report once",
            )
        seen[identity] = name
    for key in ("schema", "contract"):
        for name, report in named[1:]:
            if report.get(key) != first.get(key):
                raise ReportError(
                    f"$.{key}",
                    f"{first_name} has {key} {first.get(key)!r} but {name} has "
                    f"{report.get(key)!r}; reports of different {key} versions cannot be merged",
                )


def _run_identity(report: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    """A run is its id; host and start time are named in the message."""
    run: Mapping[str, Any] = report["run"] if isinstance(report.get("run"), Mapping) else {}
    env: Mapping[str, Any] = (report["environment"] if isinstance(report.get("environment"),
                                                                  Mapping) else {})
    run_id = run.get("id") or json.dumps(report, sort_keys=True, default=str)
    return (run_id, env.get("host"), run.get("started"))


def merged_verdict(reports: Sequence[Mapping[str, Any]]) -> str:
    """Every host must qualify; otherwise the worst host's verdict."""
    for verdict in ("not qualified", "interrupted", "partial"):
        if any(rep["verdict"] == verdict for rep in reports):
            return verdict
    return "qualified"


def host_labels(named: Sequence[tuple[str, Mapping[str, Any]]]) -> list[str]:
    """``environment.host`` per report; equal hosts get the file name, then a counter."""
    hosts = [report["environment"]["host"] for _, report in named]
    named_labels = [
        f"{host} ({Path(name).name})" if hosts.count(host) > 1 else host
        for host, (name, _) in zip(hosts, named, strict=True)
    ]
    return [
        f"{label} #{named_labels[:i].count(label) + 1}" if named_labels.count(label) > 1 else label
        for i, label in enumerate(named_labels)
    ]


def merged_uncovered(reports: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """What some host left unchecked (its ``uncovered`` entries) and no host checked.

    An entry that names a backend is covered by a host that ran those clauses for that
    backend; one that does not, by a host that ran those clauses at all.  An entry
    partly covered keeps only the clauses no host ran (and becomes a clause entry).
    """
    ran = {(r.get("backend"), r["clause"]) for rep in reports for r in rep["results"]
           if r["status"] != "skipped"}
    ran_anywhere = {clause for _, clause in ran}
    merged: list[dict[str, Any]] = []
    for rep in reports:
        for entry in rep["uncovered"]:
            backend = entry["backend"]
            left = [c for c in entry["clauses"]
                    if ((backend, c) not in ran if backend else c not in ran_anywhere)]
            if not left:
                continue
            if left != entry["clauses"]:
                entry = {**entry, "scope": "clause", "clauses": left}
            if entry not in merged:
                merged.append(dict(entry))
    return sorted(merged, key=lambda e: (e["scope"] != "backend", e["backend"] or "",
                                         [clause_sort_key(c) for c in e["clauses"]]))


def render_merged_markdown(named: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """One backend x host x clause matrix from several validated, mergeable reports."""
    check_mergeable(named)
    labels = host_labels(named)
    reports = [report for _, report in named]
    all_results = [r for rep in reports for r in rep["results"]]
    rows = matrix_rows(all_results, [b for rep in reports for b in rep["backends"]])
    notes = Footnotes()
    labelled = []
    for row in rows:
        for label, rep in zip(labels, reports, strict=True):
            results = [r for r in rep["results"] if row_name(r) == row]
            labelled.append(((row, label), results))
    overall = merged_verdict(reports)
    lines = [
        "# pytest-kvconform merged qualification matrix",
        "",
        f"**Verdict: {md_escape(overall)}** (every host must qualify)",
        "",
        f"Contract {md_escape(reports[0]['contract'])}, schema "
        f"{inert.code_span(reports[0]['schema'])}.",
        "",
        "## Hosts",
        "",
    ]
    host_rows = []
    for label, (name, rep) in zip(labels, named, strict=True):
        env = rep["environment"]
        devices = "; ".join(device_text(d) for d in env["devices"])
        mode = "strict" if rep["summary"]["strict"] else "non-strict"
        host_rows.append([
            label, name, f"{rep['verdict']} ({mode})", env["vllm"], env["vllm_omni"],
            env["torch"], devices,
        ])
    lines += markdown_table(["host", "file", "verdict", "vllm", "vllm_omni", "torch", "devices"],
                    host_rows)
    lines += ["", "## Matrix", ""]
    if all_results:
        lines += matrix_lines(labelled, ["backend", "host"], clause_columns(all_results), notes)
    else:
        lines.append("No clause results.")
    uncovered = merged_uncovered(reports)
    if uncovered:
        lines += ["", "Not checked by any host:", ""]
        lines += [f"- {md_escape(describe_uncovered(e))}" for e in uncovered]
    startup = [(label, f) for label, rep in zip(labels, reports, strict=True)
               for f in rep["startup_failures"]]
    if startup:
        lines += ["", "Production would not start (a general plugin's hook raised):", ""]
        lines += [f"- {md_escape(label)}: {md_escape(describe_startup_failure(f))}"
                  for label, f in startup]
    footnotes = notes.lines()
    if footnotes:
        lines += ["", *footnotes]
    return "\n".join(lines) + "\n"
