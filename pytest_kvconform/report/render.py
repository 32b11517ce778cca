"""The report's renderings: the terminal matrix and the Markdown of one report.

Rendering only reads a built report (or result rows); it decides nothing, so the
verdict and its explanation come from :mod:`pytest_kvconform.report.verdict`.  The
table and footnote helpers are shared with the merged matrix
(:mod:`pytest_kvconform.report.merge`).  Stdlib only.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pytest_kvconform.contract import inert
from pytest_kvconform.contract.clauses import clause_sort_key
from pytest_kvconform.report.result_notes import result_notes
from pytest_kvconform.report.verdict import (
    STATUSES,
    bites,
    describe_startup_failure,
    describe_uncovered,
    in_scope,
    interruption_of,
    left_out,
    scope_of,
    stack_record,
)

UPSTREAM_ROW = "(upstream)"

# Worst first: the status a matrix cell shows when it aggregates several tests.
_SEVERITY = ("failed", "error", "xpassed", "skipped", "xfailed", "passed")
_CELL_WORD = {
    "passed": "pass",
    "failed": "fail",
    "skipped": "skip",
    "xfailed": "xfail",
    "xpassed": "xpass",
    "error": "error",
}
_CELL_CHAR = {
    "passed": ".",
    "failed": "F",
    "skipped": "s",
    "xfailed": "x",
    "xpassed": "X",
    "error": "E",
}


def row_name(result: Mapping[str, Any]) -> str:
    """The matrix row a result sits in: its backend, or the upstream row."""
    return result.get("backend") or UPSTREAM_ROW


def _backend_names(backends: Iterable[Any]) -> list[str]:
    names = []
    for b in backends:
        if isinstance(b, str):
            names.append(b)
        elif isinstance(b, Mapping):
            names.append(b["name"])
        else:
            names.append(b.name)
    return names


def matrix_rows(results: Sequence[Mapping[str, Any]], backends: Iterable[Any]) -> list[str]:
    """Discovered backends in discovery order, then backends only seen in results, then upstream."""
    rows = list(dict.fromkeys(_backend_names(backends)))
    seen = {row_name(r) for r in results}
    rows += sorted(seen - set(rows) - {UPSTREAM_ROW})
    if UPSTREAM_ROW in seen:
        rows.append(UPSTREAM_ROW)
    return rows


def clause_columns(results: Iterable[Mapping[str, Any]]) -> list[str]:
    """The matrix columns: the clauses with results, in clause order."""
    return sorted({r["clause"] for r in results}, key=clause_sort_key)


def worst_status(statuses: Iterable[str]) -> str:
    """The status a cell aggregating these shows (failed > error > xpassed > skipped > ...)."""
    return min(statuses, key=_SEVERITY.index)


def render_terminal_matrix(
    results: Iterable[Mapping[str, Any]], backends: Iterable[Any]
) -> list[str]:
    """Compact backend x clause matrix for the terminal summary, plus a legend line."""
    results = list(results)
    if not results:
        return ["kvconform: no clause results"]
    rows = matrix_rows(results, backends)
    columns = clause_columns(results)
    headers = [c.removeprefix("KV-") for c in columns]
    cells: dict[tuple[str, str], list[str]] = {}
    for r in results:
        cells.setdefault((row_name(r), r["clause"]), []).append(r["status"])
    width = max(len("backend"), *(len(row) for row in rows))
    lines = [" ".join(["backend".ljust(width), *headers]).rstrip()]
    for row in rows:
        marks = []
        for clause, header in zip(columns, headers, strict=True):
            statuses = cells.get((row, clause))
            mark = _CELL_CHAR[worst_status(statuses)] if statuses else " "
            marks.append(mark.center(len(header)))
        lines.append(" ".join([row.ljust(width), *marks]).rstrip())
    legend = "  ".join(f"{_CELL_CHAR[s]} {_CELL_WORD[s]}" for s in STATUSES)
    lines.append(f"legend: {legend}  (blank) not run")
    return lines


class Footnotes:
    """Numbered footnotes, one per distinct (status, reason), shared across cells."""

    def __init__(self) -> None:
        self._numbers: dict[tuple[str, str], int] = {}

    def ref(self, status: str, reason: str, error_kind: str | None = None,
            seeded_fault: str | None = None) -> str:
        word = _CELL_WORD[status] + (f" ({error_kind})" if error_kind else "")
        if seeded_fault:
            word += f" (under the seeded worker fault {seeded_fault})"
        key = (word, " ".join(reason.split()))
        number = self._numbers.setdefault(key, len(self._numbers) + 1)
        return f"[^{number}]"

    def lines(self) -> list[str]:
        return [f"[^{n}]: {md_escape(word)}: {md_escape(reason)}"
                for (word, reason), n in self._numbers.items()]


def _cell(results: Sequence[Mapping[str, Any]], notes: Footnotes) -> str:
    if not results:
        return ""
    worst = worst_status(r["status"] for r in results)
    count = sum(1 for r in results if r["status"] == worst)
    refs = dict.fromkeys(
        notes.ref(r["status"], r["reason"], r.get("error_kind"), r.get("seeded_fault"))
        for r in results
        if (r["status"] != "passed" and (r.get("reason") or r.get("error_kind")))
        or r.get("seeded_fault")
    )
    return cell_text(worst, count, len(results)) + "".join(refs)


def cell_text(status: str, count: int, total: int) -> str:
    """A matrix cell: the worst status and how many of the cell's results have it."""
    return f"{_CELL_WORD[status]} {count}/{total}"


def md_escape(text: Any) -> str:
    """Text safe in a Markdown table cell or list item (:func:`inert.markdown`): control
    characters and markup escaped, one line."""
    return inert.markdown(text)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A Markdown table; a ``|`` or a newline in a cell is escaped."""
    lines = ["| " + " | ".join(md_escape(h) for h in header) + " |"]
    lines.append("|" + "|".join("---" for _ in header) + "|")
    lines += ["| " + " | ".join(md_escape(c) for c in row) + " |" for row in rows]
    return lines


def matrix_lines(
    labelled: Sequence[tuple[tuple[str, ...], Sequence[Mapping[str, Any]]]],
    key_header: Sequence[str],
    columns: Sequence[str],
    notes: Footnotes,
) -> list[str]:
    """A matrix table: one row per key, one cell per clause column (see :func:`_cell`)."""
    rows = []
    for key, results in labelled:
        by_clause: dict[str, list[Mapping[str, Any]]] = {}
        for r in results:
            by_clause.setdefault(r["clause"], []).append(r)
        rows.append([*key, *(_cell(by_clause.get(c, []), notes) for c in columns)])
    return markdown_table([*key_header, *columns], rows)


def _format_bytes(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def device_text(device: Mapping[str, Any]) -> str:
    """One device of ``environment.devices`` in words."""
    parts = [device["name"], _format_bytes(device["memory_bytes"])]
    if device.get("driver"):
        parts.append(f"driver {device['driver']}")
    if device.get("cuda"):
        parts.append(f"CUDA {device['cuda']}")
    return ", ".join(parts)


def _verdict_line(report: Mapping[str, Any]) -> str:
    mode = "strict" if report["summary"]["strict"] else "non-strict"
    scope = scope_of(report["selection"])
    whom = f" for {md_escape(', '.join(scope))}" if scope else ""
    return f"**Verdict{whom}: {md_escape(report['verdict'])}** ({mode})"


def _subject_lines(report: Mapping[str, Any]) -> list[str]:
    """Whom the results speak for: the backends' own and the stack's, counted; the stack's
    known findings, regressions and fixes; what of the stack bites each named backend."""
    results = report["results"]
    env = report["environment"]
    counts: dict[str, dict[str, int]] = {}
    for r in results:
        subject = r.get("subject") or "stack"
        counts.setdefault(subject, {}).setdefault(r["status"], 0)
        counts[subject][r["status"]] += 1
    lines = ["", "## Subjects", ""]
    scope = scope_of(report["selection"])
    lines.append("The verdict speaks for " + (
        f"{md_escape(', '.join(scope))}: its own results (the backend's subject)." if scope else
        "the whole deployment: every result, the backends' and the stack's."))
    lines.append("")
    lines += markdown_table(["subject", "results"], [
        (subject, ", ".join(f"{n} {status}" for status, n in sorted(by.items())))
        for subject, by in sorted(counts.items())])
    stack = report.get("stack") or stack_record(results)
    lives = stack.get("findings") or stack_record(results)["findings"]
    lines += ["", f"The stack (vLLM {md_escape(env['vllm'] or 'not installed')}, vllm-omni "
              f"{md_escape(env['vllm_omni'] or 'not installed')}): {len(lives['persists'])} known "
              f"findings persist ({len(stack['known'])} results), {len(lives['fixed'])} "
              f"fixed, {len(lives['new'])} new (regressions no known finding describes); "
              f"{len(stack['fixed'])} known finding results no longer fail."]
    for title, items in (
            ("Known findings that persist", lives["persists"]),
            ("Known findings fixed (remove their entries, or narrow their versions)",
             lives["fixed"]),
            ("New: regressions no known finding describes", lives["new"]),
            ("Known finding results no longer failing", stack["fixed"])):
        if items:
            lines += ["", f"{title}:", ""] + [f"- {inert.code_span(item)}" for item in items]
    for backend in scope or ():
        found = bites(results, backend)
        if found:
            lines += ["", f"The stack's findings that bite {md_escape(backend)} in production:",
                      ""]
            lines += [f"- {md_escape(f)}" for f in found]
    return lines


def _completeness_lines(report: Mapping[str, Any]) -> list[str]:
    """Why a verdict is not qualified for all the results say, partial or interrupted, and
    the harness errors, as Markdown lines."""
    lines = []
    altered = report.get("integrity") or []
    if altered:
        lines += ["", "The judge was altered after start-up: the suite's own code changed while "
                  "a backend's code ran in the judging process, so nothing here is judged:", ""]
        lines += [f"- {md_escape(change)}" for change in altered]
    interruption = interruption_of(report["run"], report["selection"], report["results"])
    if interruption:
        lines += ["", f"Interrupted: {md_escape(interruption)}."]
    startup = report["startup_failures"]
    if startup:
        lines += ["", "Production would not start: vLLM's and vllm-omni's plugin loaders call "
                  "each general plugin's hook unguarded, so a process with these installed "
                  "fails at start-up (the run checked the deployment without them):", ""]
        lines += [f"- {md_escape(describe_startup_failure(f))}" for f in startup]
    faulted = [r for r in report["results"] if r.get("seeded_fault")]
    faults = report["environment"].get("seeded_faults")
    if faults:
        lines += ["", f"Seeded worker fault {', '.join(inert.code_span(f) for f in faults)} "
                  f"(`$KVCONFORM_WORKER_FAULT`) was active: {len(faulted)} result(s) drove KV-A "
                  "workers under it (marked in the matrix's footnotes); they speak for the "
                  "fault, not the backend, and qualify nothing."]
    missing = left_out(report["selection"])
    if missing:
        lines += ["", "Left out of the matrix: " + md_escape("; ".join(missing)) + "."]
    kinds: dict[str, int] = {}
    for r in report["results"]:
        if r["status"] == "error":
            kind = r.get("error_kind") or "harness"
            kinds[kind] = kinds.get(kind, 0) + 1
    if kinds:
        counts = md_escape(", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items())))
        lines += ["", f"Harness errors (E; the harness failed, not the backend): {counts}."]
    return lines


def render_markdown(report: Mapping[str, Any]) -> str:
    """Matrix (with footnoted reasons), environment, backends and verdict of one report."""
    env = report["environment"]
    results = report["results"]
    notes = Footnotes()
    grouped: dict[str, list[Mapping[str, Any]]] = {}
    for r in results:
        grouped.setdefault(row_name(r), []).append(r)
    rows = matrix_rows(results, report["backends"])
    labelled = [((row,), grouped.get(row, [])) for row in rows]
    lines = [
        "# pytest-kvconform qualification report",
        "",
        _verdict_line(report),
        "",
        f"Contract {md_escape(report['contract'])}, schema {inert.code_span(report['schema'])}, "
        f"host {inert.code_span(env['host'])}, run {inert.code_span(report['run']['id'])} "
        f"started {md_escape(report['run']['started'])}.",
        "",
        "## Matrix",
        "",
    ]
    if results:
        lines += matrix_lines(labelled, ["backend"], clause_columns(results), notes)
    else:
        lines.append("No clause results.")
    lines += ["", "## Verdict", "", _verdict_line(report), ""]
    counts = report["summary"]["by_status"]
    lines.append(", ".join(f"{counts[s]} {s}" for s in STATUSES) + f" of {len(results)}.")
    lines += _completeness_lines(report)
    if report["uncovered"]:
        lines += ["", "Unchecked by this run (skipped, whether forgiven or declared; not "
                  "applicable skips aside):", ""]
        lines += [f"- {md_escape(describe_uncovered(e))}" for e in report["uncovered"]]
    if report["summary"]["blocking"]:
        lines += ["", "Blocking results:", ""]
        lines += [f"- {inert.code_span(nodeid)}" for nodeid in report["summary"]["blocking"]]
    by_control = result_notes(in_scope(report["results"], scope_of(report["selection"])))
    if by_control:
        lines += ["", "By control (one suite test each):", ""]
        lines += [f"- {md_escape(note)}" for note in by_control]
    lines += _subject_lines(report)
    lines += ["", "## Environment", ""]
    env_rows: list[tuple[str, Any]] = [
        (key, env[key] if env[key] is not None else "not installed")
        for key in ("python", "torch", "vllm", "vllm_omni")
    ]
    env_rows += [("platform", env["platform"]), ("host", env["host"]), ("seed", env["seed"])]
    if env.get("seeded_faults"):
        env_rows.append(("seeded worker fault", f"{', '.join(env['seeded_faults'])} "
                                                "($KVCONFORM_WORKER_FAULT)"))
    env_rows += [(f"device {i}", device_text(d)) for i, d in enumerate(env["devices"])]
    env_rows += [("options", json.dumps(env["options"], sort_keys=True))]
    lines += markdown_table(["key", "value"], env_rows)
    lines += _import_log_lines(env.get("import_log"))
    lines += _worker_log_lines(env.get("worker_log"))
    if report["backends"]:
        lines += ["", "## Backends", ""]
        lines += markdown_table(
            ["backend", "source", "path", "overridden", "importable", "reason"],
            [
                [b["name"], b["source"], b["path"], b["overridden"], b["importable"], b["reason"]]
                for b in report["backends"]
            ],
        )
    lines += _plugin_lines(env.get("plugins"), report["backends"])
    footnotes = notes.lines()
    if footnotes:
        lines += ["", *footnotes]
    return "\n".join(lines) + "\n"


def _import_log_lines(messages: Sequence[Mapping[str, Any]] | None) -> list[str]:
    """The Markdown's account of what importing the serving stack printed (kept out of the
    terminal's header): every message, verbatim."""
    if not messages:
        return []
    fence = inert.fence_for(m["text"] for m in messages)  # longer than any run inside
    lines = ["", "### Output of the serving stack's imports", "",
             f"{len(messages)} message{'s' if len(messages) != 1 else ''} printed while "
             f"vLLM / vllm-omni were imported for discovery: the installed stack's own, not "
             f"findings of this run.", "", fence + "text"]
    for message in messages:
        lines += inert.terminal(message["text"]).splitlines()
    return [*lines, fence]


def _worker_log_lines(messages: Sequence[Mapping[str, Any]] | None) -> list[str]:
    """The Markdown's account of what production printed for the KV-A deployments (kept
    out of the terminal): every message, verbatim, after the process that printed it."""
    if not messages:
        return []
    fence = inert.fence_for(f"{m.get('source')} {m['text']}" for m in messages)
    lines = ["", "### Output of production's KV-A workers", "",
             f"{len(messages)} message{'s' if len(messages) != 1 else ''} printed by "
             f"production's KV-A worker processes and the fork server, and by its code the "
             f"harness ran between tests: the installed stack's own, not findings of this "
             f"run.", "", fence + "text"]
    for message in messages:
        source = f"[{message['source']}] " if message.get("source") else ""
        lines += inert.terminal(source + str(message["text"])).splitlines()
    return [*lines, fence]


def _plugin_lines(plugins: Mapping[str, Any] | None,
                  backends: Sequence[Mapping[str, Any]]) -> list[str]:
    """The Markdown's plugin section: mode, platform, each plugin's outcome, who put
    each backend's class there."""
    if not plugins:
        return []
    env = plugins.get("vllm_plugins")
    lines = ["", "## Plugins", "",
             f"Mode {inert.code_span(plugins.get('mode'))} (`VLLM_PLUGINS` "
             f"{'unset' if env is None else md_escape(repr(env))}); Omni platform "
             f"{inert.code_span(plugins.get('platform'))} "
             f"({md_escape(plugins.get('platform_source') or '-')}).", ""]
    lines += markdown_table(["group", "plugin", "distribution", "status", "re-pointed", "error"],
                    [[p["group"], p["name"], p["dist"], p["status"],
                      ", ".join(p["changed"]) or "-", p["error"]]
                     for p in plugins.get("plugins", [])])
    lines += [f"- note: {md_escape(note)}" for note in plugins.get("notes", [])]
    origins = [[b["name"], b["path"], b["overridden"], b["origin"]] for b in backends
               if b.get("origin")]
    if origins:
        lines += ["", *markdown_table(["backend", "path", "overridden", "origin"], origins)]
    return lines
