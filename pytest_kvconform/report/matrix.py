"""The combined report of a release matrix: one leg per environment, the stack as an axis.

``kvconform matrix`` runs the strict suite in every supported environment (a *leg*); each
leg that ran wrote its own report, and this one puts them side by side: per leg its stack
(vLLM / vllm-omni / torch), state and verdict with the reason, and the tables stack x
clause and backend x stack x clause.  A leg that could not be built, imported or run is a
leg with its reason, never a gap.  The combined verdict is ``qualified`` only when every
leg ran and qualified.  Stdlib only; the leg reports are the single report's schema.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from pytest_kvconform.contract import CONTRACT_VERSION, inert
from pytest_kvconform.contract.clauses import clause_sort_key
from pytest_kvconform.report.render import (
    UPSTREAM_ROW,
    Footnotes,
    cell_text,
    markdown_table,
    matrix_rows,
    md_escape,
    row_name,
    worst_status,
)
from pytest_kvconform.report.schema import (
    KNOWN_CONTRACTS,
    ReportError,
    expect_finite,
    expect_keys,
    expect_number,
    expect_shallow,
    expect_type,
    validate_run,
)
from pytest_kvconform.report.verdict import (
    FINDINGS_KEYS,
    STATUSES,
    VERDICTS,
    finding_lifetimes,
    interruption_of,
    left_out,
)

MATRIX_SCHEMA = "pytest-kvconform/matrix/1"
MATRIX_VERDICTS = ("qualified", "not qualified", "interrupted")
# ran: the suite ran and wrote the leg's report; the others say what stopped the leg.
LEG_STATES = ("ran", "not built", "not importable", "no report", "interrupted", "not run")
STACK_KEYS = ("vllm", "vllm_omni", "torch")
# installed: read from the leg's environment; requested: its pins (it was never built).
STACK_SOURCES = ("installed", "requested")
MATRIX_KEYS = ("schema", "contract", "run", "verdict", "qualified_legs", "legs", "by_stack",
               "by_backend")
LEG_KEYS = ("name", "description", "state", "verdict", "reason", "notes", "stack",
            "stack_source", "report", "run_id", "exit_code", "duration_s", "counts", "log")
# findings: what became of the known findings in the leg's whole deployment, from its
# report's results (verdict.finding_lifetimes: "persists" and "fixed", entry ids; "new",
# nodeids of failures no finding describes); a leg that ran has it.
LEG_OPTIONAL_KEYS = ("findings",)
# One cell of a table: a leg's results of one clause (by_stack: backend None; by_backend:
# one backend's row, "(upstream)" for the per-layout clauses), their worst status, the
# count of each status, and the most common reason among the worst ones.
CELL_KEYS = ("leg", "backend", "clause", "status", "counts", "reason")
_CLAUSE_PREFIX = re.compile(r"^KV-[A-Z]+\d+: ")
_CONTEXT = re.compile(r"^(KV-[A-Z]+\d+ violated) \[[^\]]*\]")
_REASON_CHARS = 300


# --------------------------------------------------------------------------- building


def build_matrix(legs: Sequence[Mapping[str, Any]], reports: Mapping[str, Mapping[str, Any]],
                 run: Mapping[str, Any]) -> dict[str, Any]:
    """The combined report from the runner's leg records and the reports of the legs that ran.

    A leg record has :data:`LEG_KEYS` but ``verdict``, ``run_id`` and ``counts``, which
    come from its report (``reports[name]``, validated by the caller); so does the stack
    where there is one, and the reason is the runner's notes plus the report's.
    """
    records = [_leg_record(leg, reports.get(str(leg["name"]))) for leg in legs]
    ran = {leg["name"]: reports[leg["name"]] for leg in records if leg["state"] == "ran"}
    matrix = {
        "schema": MATRIX_SCHEMA,
        "contract": CONTRACT_VERSION,
        "run": dict(run),
        "verdict": matrix_verdict(records, run),
        "qualified_legs": [leg["name"] for leg in records if leg["verdict"] == "qualified"],
        "legs": records,
        "by_stack": stack_cells(ran),
        "by_backend": backend_cells(ran),
    }
    validate_matrix(matrix, ran)
    return matrix


def _leg_record(leg: Mapping[str, Any], report: Mapping[str, Any] | None) -> dict[str, Any]:
    record = {key: leg.get(key) for key in LEG_KEYS}
    record["notes"] = list(leg.get("notes") or [])
    record["stack"] = {key: (leg.get("stack") or {}).get(key) for key in STACK_KEYS}
    if report is None or record["state"] != "ran":
        record.update(verdict=None, run_id=None, counts=None)
        return record
    env = report["environment"]
    record.update(
        verdict=report["verdict"], run_id=report["run"]["id"],
        counts=dict(report["summary"]["by_status"]),
        findings=finding_lifetimes(report["results"]),
        stack={"vllm": env["vllm"], "vllm_omni": env["vllm_omni"], "torch": env["torch"]},
        stack_source="installed",
        reason=leg_reason(report, list(leg.get("notes") or [])),
    )
    return record


def matrix_verdict(legs: Sequence[Mapping[str, Any]], run: Mapping[str, Any]) -> str:
    """Every leg must have run and qualified; an interrupted matrix certifies nothing."""
    if run.get("interruption"):
        return "interrupted"
    if legs and all(leg["verdict"] == "qualified" for leg in legs):
        return "qualified"
    return "not qualified"


def short_reason(text: Any) -> str:
    """A result's reason for a table: without the clause prefix, on one line, bounded."""
    reason = " ".join(_CLAUSE_PREFIX.sub("", str(text or "")).split()) or "(no reason given)"
    return reason if len(reason) <= _REASON_CHARS else reason[:_REASON_CHARS - 3] + "..."


def _top_reason(results: Sequence[Mapping[str, Any]]) -> str:
    """The most common reason, the failure context (``[backend=..., case=...]``) left out so
    that one cause over many parameters counts once."""
    reasons = Counter(_CONTEXT.sub(r"\1", short_reason(r.get("reason"))) for r in results)
    reason, _ = reasons.most_common(1)[0]
    others = len(reasons) - 1
    return reason + (f" (and {others} other reason{'s' if others > 1 else ''})" if others else "")


def leg_reason(report: Mapping[str, Any], notes: Sequence[str] = ()) -> str | None:
    """Why a leg that ran is not qualified, in one line (None when it is, and has no notes):
    the runner's notes, an interruption or a partial selection, production failing to start,
    then the blocking results by status, each with its clauses and most common reason."""
    parts = list(notes)
    interruption = interruption_of(report["run"], report["selection"], report["results"])
    if interruption:
        parts.append(f"interrupted: {interruption}")
    parts += [f"left out: {phrase}" for phrase in left_out(report["selection"])]
    if report["startup_failures"]:
        parts.append(f"production would not start ({len(report['startup_failures'])} plugin "
                     "hook(s) raised)")
    blocking = set(report["summary"]["blocking"])
    rows = [r for r in report["results"] if r["nodeid"] in blocking]
    for status in STATUSES:
        group = [r for r in rows if r["status"] == status]
        if not group:
            continue
        clauses = sorted({r["clause"] for r in group}, key=clause_sort_key)
        what = f"{len(group)} {status}" + (" and not forgiven" if status == "skipped" else "")
        parts.append(f"{what} in {', '.join(clauses)} ({_top_reason(group)})")
    if report["verdict"] == "qualified" and not notes:
        return None
    return "; ".join(parts) or None


def _cells(results: Sequence[Mapping[str, Any]], leg: str, backend: str | None
           ) -> list[dict[str, Any]]:
    by_clause: dict[str, list[Mapping[str, Any]]] = {}
    for r in results:
        by_clause.setdefault(r["clause"], []).append(r)
    cells = []
    for clause in sorted(by_clause, key=clause_sort_key):
        group = by_clause[clause]
        counts = Counter(r["status"] for r in group)
        worst = worst_status(counts)
        worst_rows = [r for r in group if r["status"] == worst]
        cells.append({"leg": leg, "backend": backend, "clause": clause, "status": worst,
                      "counts": {s: counts[s] for s in STATUSES if counts[s]},
                      "reason": None if worst == "passed" else _top_reason(worst_rows)})
    return cells


def stack_cells(reports: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The stack x clause table: per leg that ran, one cell per clause over all backends."""
    return [cell for leg, report in reports.items()
            for cell in _cells(report["results"], leg, None)]


def backend_cells(reports: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The backend x stack x clause table: per leg, one cell per backend row and clause."""
    cells = []
    for leg, report in reports.items():
        results = report["results"]
        for row in matrix_rows(results, report["backends"]):
            cells += _cells([r for r in results if row_name(r) == row], leg, row)
    return cells


# --------------------------------------------------------------------------- validation


def is_matrix(obj: Any) -> bool:
    """Whether a loaded JSON object claims to be a combined matrix report."""
    return isinstance(obj, Mapping) and str(obj.get("schema", "")).startswith(
        "pytest-kvconform/matrix/")


def validate_matrix(obj: Any, reports: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """Raise :class:`ReportError` at the first problem of a combined report.

    Shapes, then agreement: each cell's status is the worst of its counts, the verdict
    and ``qualified_legs`` follow from the legs.  With ``reports`` (each leg that ran,
    by name, already validated) the legs' verdicts, run ids and counts and both tables
    must be what those reports give.
    """
    expect_shallow(obj)
    expect_keys(obj, "$", MATRIX_KEYS)
    if obj["schema"] != MATRIX_SCHEMA:
        raise ReportError("$.schema", f"expected {MATRIX_SCHEMA!r}, got {obj['schema']!r}")
    expect_finite(obj, "$")
    if obj["contract"] not in KNOWN_CONTRACTS:
        raise ReportError("$.contract", f"unknown contract version {obj['contract']!r}")
    validate_run(obj["run"])
    expect_type(obj["legs"], "$.legs", list)
    names = []
    for i, leg in enumerate(obj["legs"]):
        _validate_leg(leg, f"$.legs[{i}]")
        if leg["name"] in names:
            raise ReportError(f"$.legs[{i}].name", f"leg {leg['name']!r} appears twice")
        names.append(leg["name"])
    for key in ("by_stack", "by_backend"):
        expect_type(obj[key], f"$.{key}", list)
        for i, cell in enumerate(obj[key]):
            _validate_cell(cell, f"$.{key}[{i}]", names, per_backend=key == "by_backend")
    qualified = [leg["name"] for leg in obj["legs"] if leg["verdict"] == "qualified"]
    if obj["qualified_legs"] != qualified:
        raise ReportError("$.qualified_legs", f"expected {qualified} (the legs whose verdict is "
                          f"qualified), got {obj['qualified_legs']!r}")
    verdict = matrix_verdict(obj["legs"], obj["run"])
    if obj["verdict"] != verdict:
        raise ReportError("$.verdict", f"{obj['verdict']!r} but the legs give {verdict!r}")
    if reports is not None:
        _validate_against(obj, reports)


def _validate_leg(leg: Any, where: str) -> None:
    expect_keys(leg, where, LEG_KEYS, LEG_OPTIONAL_KEYS)
    if "findings" in leg:
        expect_keys(leg["findings"], f"{where}.findings", FINDINGS_KEYS)
        for key in FINDINGS_KEYS:
            expect_type(leg["findings"][key], f"{where}.findings.{key}", list)
            for j, item in enumerate(leg["findings"][key]):
                expect_type(item, f"{where}.findings.{key}[{j}]", str)
    for key in ("name", "description", "state", "stack_source"):
        expect_type(leg[key], f"{where}.{key}", str)
    if leg["state"] not in LEG_STATES:
        raise ReportError(f"{where}.state", f"expected one of {', '.join(LEG_STATES)}, "
                          f"got {leg['state']!r}")
    if leg["stack_source"] not in STACK_SOURCES:
        raise ReportError(f"{where}.stack_source", f"expected one of {', '.join(STACK_SOURCES)}")
    expect_keys(leg["stack"], f"{where}.stack", STACK_KEYS)
    for key in STACK_KEYS:
        expect_type(leg["stack"][key], f"{where}.stack.{key}", str, none=True)
    for key in ("verdict", "reason", "report", "run_id", "log"):
        expect_type(leg[key], f"{where}.{key}", str, none=True)
    expect_type(leg["notes"], f"{where}.notes", list)
    for j, note in enumerate(leg["notes"]):
        expect_type(note, f"{where}.notes[{j}]", str)
    expect_type(leg["exit_code"], f"{where}.exit_code", int, none=True)
    expect_number(leg["duration_s"], f"{where}.duration_s")
    ran = leg["state"] == "ran"
    for key in ("verdict", "report", "run_id", "counts"):
        if (leg[key] is None) == ran:
            raise ReportError(f"{where}.{key}", "set exactly when the leg ran (state 'ran')")
    if ran:
        if leg["verdict"] not in VERDICTS:
            raise ReportError(f"{where}.verdict", f"expected one of {', '.join(VERDICTS)}")
        _validate_counts(leg["counts"], f"{where}.counts", zeros=True)
    elif not leg["reason"]:
        raise ReportError(f"{where}.reason", f"a leg in state {leg['state']!r} must say why")


def _validate_counts(counts: Any, where: str, *, zeros: bool) -> None:
    expect_type(counts, where, dict)
    for status, n in counts.items():
        if status not in STATUSES:
            raise ReportError(f"{where}.{status}", f"not a status (expected one of "
                              f"{', '.join(STATUSES)})")
        expect_type(n, f"{where}.{status}", int)
        if n < 0 or (n == 0 and not zeros):
            raise ReportError(f"{where}.{status}", f"expected a count > 0, got {n}")


def _validate_cell(cell: Any, where: str, legs: Sequence[str], *, per_backend: bool) -> None:
    expect_keys(cell, where, CELL_KEYS)
    if cell["leg"] not in legs:
        raise ReportError(f"{where}.leg", f"names no leg of $.legs: {cell['leg']!r}")
    expect_type(cell["backend"], f"{where}.backend", str, none=not per_backend)
    if not per_backend and cell["backend"] is not None:
        raise ReportError(f"{where}.backend", "the stack x clause table names no backend")
    expect_type(cell["clause"], f"{where}.clause", str)
    expect_type(cell["reason"], f"{where}.reason", str, none=True)
    _validate_counts(cell["counts"], f"{where}.counts", zeros=False)
    if not cell["counts"] or cell["status"] != worst_status(cell["counts"]):
        raise ReportError(f"{where}.status", f"{cell['status']!r} is not the worst status of "
                          f"the counts {cell['counts']}")


def _validate_against(obj: Mapping[str, Any], reports: Mapping[str, Mapping[str, Any]]) -> None:
    for i, leg in enumerate(obj["legs"]):
        if leg["state"] != "ran":
            continue
        report = reports.get(leg["name"])
        if report is None:
            raise ReportError(f"$.legs[{i}].report", f"no report of leg {leg['name']!r} given")
        expected = _leg_record(leg, report)
        for key in ("verdict", "run_id", "counts", "stack", "findings"):
            if key == "findings" and key not in leg:
                continue  # written before findings had a lifetime
            if leg[key] != expected[key]:
                raise ReportError(f"$.legs[{i}].{key}", f"{leg[key]!r} but the leg's report "
                                  f"{leg['report']} gives {expected[key]!r}")
    ran = {leg["name"]: reports[leg["name"]] for leg in obj["legs"] if leg["state"] == "ran"}
    for key, cells in (("by_stack", stack_cells(ran)), ("by_backend", backend_cells(ran))):
        if obj[key] != cells:
            raise ReportError(f"$.{key}", "does not match the legs' reports")


# --------------------------------------------------------------------------- rendering


def stack_label(stack: Mapping[str, Any], source: str = "installed") -> str:
    """``vLLM 0.30.0 / vllm-omni 0.30.0 / torch 2.13.0`` (``-`` for a package not there)."""
    label = (f"vLLM {stack.get('vllm') or '-'} / vllm-omni {stack.get('vllm_omni') or '-'} / "
             f"torch {stack.get('torch') or '-'}")
    return label + (" (requested)" if source == "requested" else "")


def leg_outcome(leg: Mapping[str, Any]) -> str:
    """The leg's verdict where it ran, else its state (``not built``, ...)."""
    return str(leg["verdict"] if leg["state"] == "ran" else leg["state"])


def describe_leg(leg: Mapping[str, Any]) -> str:
    """One leg in a line: name, stack, verdict or state, its known findings, reason."""
    text = f"{leg['name']} ({stack_label(leg['stack'], leg['stack_source'])}): {leg_outcome(leg)}"
    if leg.get("findings") is not None:
        text += f" ({findings_text(leg['findings'])})"
    return text + (f": {leg['reason']}" if leg["reason"] else "")


def findings_text(findings: Mapping[str, Sequence[str]]) -> str:
    """``7 known findings persist, 0 fixed, 0 new``."""
    n = len(findings["persists"])
    return (f"{n} known finding{' persists' if n == 1 else 's persist'}, "
            f"{len(findings['fixed'])} fixed, {len(findings['new'])} new")


def verdict_line(matrix: Mapping[str, Any]) -> str:
    """``not qualified (qualified: A; not qualified: B; not built: C)``."""
    groups: dict[str, list[str]] = {}
    for leg in matrix["legs"]:
        groups.setdefault(leg_outcome(leg), []).append(leg["name"])
    detail = "; ".join(f"{outcome}: {', '.join(names)}" for outcome, names in groups.items())
    return f"{matrix['verdict']}" + (f" ({detail})" if detail else "")


def _table(cells: Sequence[Mapping[str, Any]], keys: Sequence[tuple[str, ...]],
           key_of: Any, header: Sequence[str], notes: Footnotes) -> list[str]:
    columns = sorted({c["clause"] for c in cells}, key=clause_sort_key)
    by_key: dict[tuple[str, ...], dict[str, Mapping[str, Any]]] = {}
    for cell in cells:
        by_key.setdefault(key_of(cell), {})[cell["clause"]] = cell
    rows = []
    for key in keys:
        row = by_key.get(key, {})
        texts = []
        for clause in columns:
            found = row.get(clause)
            if found is None:
                texts.append("")
                continue
            total = sum(found["counts"].values())
            ref = notes.ref(found["status"], found["reason"]) if found["reason"] else ""
            texts.append(cell_text(found["status"], found["counts"][found["status"]], total)
                         + ref)
        rows.append([*key, *texts])
    return markdown_table([*header, *columns], rows)


def render_matrix_markdown(matrix: Mapping[str, Any]) -> str:
    """The legs, the stack x clause table and the per-backend table, with footnoted reasons."""
    run = matrix["run"]
    legs = matrix["legs"]
    labels = {leg["name"]: stack_label(leg["stack"], leg["stack_source"]) for leg in legs}
    lines = [
        "# pytest-kvconform release matrix",
        "",
        f"**Verdict: {md_escape(verdict_line(matrix))}** (every leg must qualify)",
        "",
        f"Contract {md_escape(matrix['contract'])}, schema {inert.code_span(matrix['schema'])}, "
        f"run {inert.code_span(run['id'])} started {md_escape(run['started'])}, "
        f"{run['duration_s']:.0f} s."
        + (f" Interrupted: {md_escape(run['interruption'])}." if run["interruption"] else ""),
        "",
        "## Legs",
        "",
    ]
    lines += markdown_table(
        ["leg", "vLLM", "vllm-omni", "torch", "outcome", "results", "known findings", "reason",
         "report"],
        [[leg["name"], leg["stack"]["vllm"] or "-", leg["stack"]["vllm_omni"] or "-",
          (leg["stack"]["torch"] or "-") + (" (requested)" if leg["stack_source"] ==
                                            "requested" else ""),
          leg_outcome(leg),
          ", ".join(f"{n} {s}" for s, n in (leg["counts"] or {}).items() if n) or "-",
          findings_text(leg["findings"]) if leg.get("findings") is not None else "-",
          leg["reason"] or "-", leg["report"] or leg["log"] or "-"] for leg in legs])
    notes = Footnotes()
    ran = [leg["name"] for leg in legs if leg["state"] == "ran"]
    lines += ["", "## Stack x clause", ""]
    if matrix["by_stack"]:
        lines += _table(matrix["by_stack"], [(labels[n], n) for n in ran],
                        lambda c: (labels[c["leg"]], c["leg"]), ["stack", "leg"], notes)
    else:
        lines.append("No leg ran.")
    if matrix["by_backend"]:
        rows = list(dict.fromkeys(c["backend"] for c in matrix["by_backend"]))
        rows = [r for r in rows if r != UPSTREAM_ROW] + ([UPSTREAM_ROW] if UPSTREAM_ROW in rows
                                                         else [])
        keys = [(row, labels[n]) for row in rows for n in ran
                if any(c["backend"] == row and c["leg"] == n for c in matrix["by_backend"])]
        lines += ["", "## Per backend", ""]
        lines += _table(matrix["by_backend"], keys,
                        lambda c: (c["backend"], labels[c["leg"]]), ["backend", "stack"], notes)
    footnotes = notes.lines()
    if footnotes:
        lines += ["", *footnotes]
    return "\n".join(lines) + "\n"

