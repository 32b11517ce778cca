"""What a report page shows, read from the JSON: the one place the pages read its fields.

The HTML pages (:mod:`~pytest_kvconform.report.html`) and the job summary
(:mod:`~pytest_kvconform.report.job_summary`) render what this module builds: plain
dicts and dataclasses, no markup.  Everything comes from a saved report, a combined matrix
or a diff, so any of them renders again later; the verdict and its notes come from
:mod:`~pytest_kvconform.report.verdict`, the grid's axes from the results (no list of
clauses or backends is written here).

A result has one *state* (:data:`STATES`): its status, with a skip split into "not
checked" (something was left unchecked: hardware, environment, an unimportable backend)
and "n/a" (the clause does not apply); a known finding's result has a *finding state*
(persists, fixed: its entry is stale, or new).  Stdlib only.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from pytest_kvconform.contract import clauses
from pytest_kvconform.report.diff import MatrixDiff, describe_report, summary_line
from pytest_kvconform.report.matrix import leg_outcome, verdict_line
from pytest_kvconform.report.matrix import stack_label as matrix_stack_label
from pytest_kvconform.report.merge import host_labels, merged_uncovered, merged_verdict
from pytest_kvconform.report.render import UPSTREAM_ROW, device_text, matrix_rows, row_name
from pytest_kvconform.report.result_notes import test_function
from pytest_kvconform.report.verdict import (
    STATUSES,
    describe_startup_failure,
    describe_uncovered,
    in_scope,
    interruption_of,
    scope_of,
    stack_record,
    verdict_notes,
)


@dataclass(frozen=True)
class State:
    """How a result (or a grid cell: its worst result) reads: a glyph, a word, a meaning."""

    key: str
    glyph: str
    word: str
    meaning: str


# Worst first: a cell shows the worst state of its results.  A pass outranks "n/a" (a
# clause checked where it applies passed), and "not checked" outranks a known finding.
STATES: tuple[State, ...] = (
    State("fail", "✗", "fail", "the clause does not hold"),
    State("error", "⚠", "error", "the harness failed here, not the backend"),
    State("fixed", "↑", "fixed", "a known finding no longer fails: its entry is stale"),
    State("unchecked", "?", "not checked", "skipped: hardware, environment or an "
          "unimportable backend left it unchecked"),
    State("known", "◆", "known", "a known finding that persists (listed, not failed)"),
    State("pass", "✓", "pass", "the clause holds"),
    State("na", "\u2013", "n/a", "the clause does not apply here"),
)
STATE = {s.key: s for s in STATES}
# The verdicts, each with its glyph (the verdict word always beside it).
VERDICT_GLYPHS = {"qualified": "✓", "not qualified": "✗", "partial": "◐",
                  "interrupted": "■", "not checked": "?"}
LEG_GLYPHS = {"not built": "✗", "not importable": "✗", "no report": "✗",
              "interrupted": "■", "not run": "\u2013"}
FINDING_STATES = ("new", "persists", "fixed")
FINDING_WORDS = {"new": "new: no known finding describes it",
                 "persists": "persists: its known finding still holds",
                 "fixed": "fixed: no longer fails, its entry is stale"}
# The stack's printed messages shown per log (distinct texts, each bounded); the JSON keeps
# every one, whole.
SHOWN_MESSAGES = 60
MESSAGE_CHARS = 1500

_EXPECTED = re.compile(r"\n\s*expected: (?P<expected>.*)\n\s*actual:\s*(?P<actual>.*)", re.S)


def result_state(result: Mapping[str, Any]) -> str:
    """The state of one result (a key of :data:`STATE`)."""
    status = result.get("status")
    if status == "skipped":
        return "na" if result.get("skip_kind") == "not-applicable" else "unchecked"
    return {"failed": "fail", "error": "error", "xpassed": "fixed", "xfailed": "known",
            "passed": "pass"}.get(str(status), "unchecked")


def worst_state(states: Iterable[str]) -> str:
    order = [s.key for s in STATES]
    return min(states, key=order.index)


def finding_states(report: Mapping[str, Any]) -> dict[str, str]:
    """nodeid -> persists, fixed or new, as the report's stack record has them
    (``stack.findings``, :func:`~pytest_kvconform.report.verdict.finding_lifetimes`): a
    result of a known finding that persists, of one whose every result now passes (its
    entry stale), or a stack failure no finding describes.  A passing result of a finding
    that persists elsewhere reads as fixed: strict mode refuses it as an xpass."""
    record = report.get("stack") or stack_record(report["results"])
    lives = record.get("findings") or {}
    persists, new = set(lives.get("persists", ())), set(lives.get("new", ()))
    out = {}
    for r in report["results"]:
        nodeid, entry = str(r["nodeid"]), str(r.get("xfail") or "")
        if nodeid in new:
            out[nodeid] = "new"
        elif r.get("status") == "xpassed":
            out[nodeid] = "fixed"
        elif entry in persists and r.get("status") in ("xfailed", "skipped"):
            out[nodeid] = "persists"
    return out


def subject(result: Mapping[str, Any]) -> str:
    """Whom a result speaks for: ``backend`` or ``stack`` (the clause table's, per test)."""
    found = result.get("subject") or clauses.subject_of(test_function(str(result["nodeid"])))
    return str(found or "stack")


def family(record: Mapping[str, Any]) -> str | None:
    """The backend family a backend or result names, where the report records one."""
    value = record.get("family")
    return str(value) if value else None


def anchor(text: str) -> str:
    """A fragment for ``href`` (the id itself stays readable: ``test_kv_l1[FLASH_ATTN]``)."""
    return "#" + quote(text, safe="")


def test_id(nodeid: str) -> str:
    """``kvconform/test_layout.py::test_kv_l1[FLASH_ATTN]`` -> ``test_kv_l1[FLASH_ATTN]``:
    a result's permalink (the same in every run and leg)."""
    return nodeid.rsplit("::", 1)[-1]


def group_id(band: str, row: str, clause: str) -> str:
    """The id of one grid cell's results: ``backend:FLASH_ATTN:KV-A1``."""
    return f"{band}:{row}:{clause}"


# --------------------------------------------------------------------------- the grid


@dataclass
class Cell:
    state: str
    count: int  # results in the worst state
    total: int
    counts: dict[str, int]  # status -> results
    href: str | None
    title: str
    rest: list[tuple[str, int]] = field(default_factory=list)  # the other states, worst first

    @property
    def text(self) -> str:
        """``✗ fail 2/6``."""
        s = STATE[self.state]
        return f"{s.glyph} {s.word} {self.count}/{self.total}"

    @property
    def rest_text(self) -> str:
        """``✓ 4 · ◆ 1``: how many of the cell's other results are in each other state."""
        return " · ".join(f"{STATE[k].glyph} {n}" for k, n in self.rest)


@dataclass
class GridRow:
    name: str
    group: str | None  # the heading of the rows it starts or continues (a family, a backend)
    cells: list[Cell | None]
    href: str | None = None  # a page of its own (a matrix leg)
    note: str | None = None  # a row with no cells says why (a leg that did not run)
    detail: str | None = None  # under the name (a leg's stack)


@dataclass
class Grid:
    key: str  # "backend", "stack", or a backend's name on the matrix page
    title: str
    meaning: str
    columns: list[str]
    rows: list[GridRow]
    row_header: str = "backend"


def clause_title(clause: str) -> str:
    try:
        return clauses.clause(clause).title
    except ValueError:  # a clause this kvconform does not know (a newer report)
        return ""


def _cell(results: Sequence[Mapping[str, Any]], href: str | None, where: str) -> Cell:
    states = [result_state(r) for r in results]
    worst = worst_state(states)
    statuses = Counter(str(r["status"]) for r in results)
    counts = {s: statuses[s] for s in STATUSES if statuses[s]}
    title = f"{where}: " + ", ".join(f"{n} {s}" for s, n in counts.items())
    rest = [(s.key, states.count(s.key)) for s in STATES
            if s.key != worst and s.key in states]
    return Cell(worst, states.count(worst), len(results), counts, href, title, rest)


def _family_order(rows: list[str], families: Mapping[str, str | None]) -> list[str]:
    """Rows grouped by family (in order of first appearance), the upstream row last."""
    order = list(dict.fromkeys(families.get(r) for r in rows))
    return sorted(rows, key=lambda r: (r == UPSTREAM_ROW, order.index(families.get(r))))


def report_grids(report: Mapping[str, Any], page: str = "") -> list[Grid]:
    """The backend x clause grid of one report, one band per subject: the backends' own
    results, then the stack's (on each backend's deployment, and per layout / case)."""
    results = report["results"]
    families = {str(b["name"]): family(b) for b in report["backends"]}
    families.update({row_name(r): family(r) for r in results if family(r)})
    order = _family_order(matrix_rows(results, report["backends"]), families)
    grids = []
    for band, title, meaning in (
            ("backend", "The backends' own results",
             "they speak for the backend: what its author fixes"),
            ("stack", "The serving stack's results",
             "they speak for the installed vLLM / vllm-omni, on each backend's deployment "
             "and per layout and case")):
        mine = [r for r in results if subject(r) == band]
        if not mine:
            continue
        columns = sorted({str(r["clause"]) for r in mine}, key=clauses.clause_sort_key)
        by_cell: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
        for r in mine:
            by_cell.setdefault((row_name(r), str(r["clause"])), []).append(r)
        rows = []
        for name in order:
            if not any((name, c) in by_cell for c in columns):
                continue
            cells: list[Cell | None] = [
                _cell(by_cell[name, c], page + anchor(group_id(band, name, c)),
                      f"{name} x {c}") if (name, c) in by_cell else None for c in columns]
            group = families.get(name)
            rows.append(GridRow(name, f"{group} backends" if group else None, cells))
        grids.append(Grid(band, title, meaning, columns, rows))
    return grids


# --------------------------------------------------------------------------- results


@dataclass
class ResultView:
    id: str  # the permalink: the test id, ``~2`` for a second row of one test
    nodeid: str
    state: str
    status: str
    subject: str
    clause: str
    backend: str | None
    case: str | None
    layout: str | None
    device: str | None
    message: str
    expected: str | None
    actual: str | None
    duration_s: float
    via: str | None  # the entry points, without the explanation (see ``via_note``)
    via_note: int | None  # index into the page's list of explanations
    skip_kind: str | None
    error_kind: str | None
    xfail: str | None
    finding: str | None
    depends_on: str | None
    seeded_fault: str | None
    open: bool  # shown open (a failure, an error, a fixed finding)


@dataclass
class ResultGroup:
    id: str
    band: str
    row: str
    clause: str
    title: str
    text: str
    results: list[ResultView]
    row_anchor: str | None = None  # ``FLASH_ATTN:KV-A1``, once per row and clause


def split_message(reason: str) -> tuple[str, str | None, str | None]:
    """A clause failure's message, and its ``expected`` / ``actual`` lines where it has them
    (``ClauseFailure`` writes them so)."""
    m = _EXPECTED.search(reason)
    if m is None:
        return reason, None, None
    return reason[:m.start()].rstrip(), m["expected"].strip(), m["actual"].strip()


def split_via(via: str) -> tuple[str, str | None]:
    """``A -> B -> C (why a deeper one did not run)`` -> the path and the explanation."""
    path, sep, rest = via.partition(" (")
    return (path, rest[:-1] if rest.endswith(")") else rest) if sep else (via, None)


def result_groups(report: Mapping[str, Any], vias: list[str]) -> list[ResultGroup]:
    """The results, one group per grid cell (band, row, clause), in the grid's order; each
    result's ``via`` explanation is added to ``vias`` once and named by its index."""
    texts = clauses.contract_texts()
    results = report["results"]
    states = finding_states(report)
    rows = matrix_rows(results, report["backends"])
    seen: Counter[str] = Counter()
    groups: dict[tuple[str, str, str], ResultGroup] = {}
    for r in results:
        band, row, clause = subject(r), row_name(r), str(r["clause"])
        key = (band, row, clause)
        if key not in groups:
            groups[key] = ResultGroup(group_id(band, row, clause), band, row, clause,
                                      clause_title(clause), texts.get(clause, ""), [])
        tid = test_id(str(r["nodeid"]))
        seen[tid] += 1
        message, expected, actual = split_message(str(r.get("reason") or ""))
        via, why = split_via(str(r["via"])) if r.get("via") else (None, None)
        if why is not None and why not in vias:
            vias.append(why)
        state = result_state(r)
        groups[key].results.append(ResultView(
            id=tid if seen[tid] == 1 else f"{tid}~{seen[tid]}", nodeid=str(r["nodeid"]),
            state=state, status=str(r["status"]), subject=band, clause=clause,
            backend=r.get("backend"), case=r.get("case"), layout=r.get("layout"),
            device=r.get("device"), message=message, expected=expected, actual=actual,
            duration_s=float(r.get("duration_s") or 0.0), via=via,
            via_note=vias.index(why) + 1 if why is not None else None,
            skip_kind=r.get("skip_kind"), error_kind=r.get("error_kind"),
            xfail=r.get("xfail"), finding=states.get(str(r["nodeid"])),
            depends_on=r.get("depends_on"),
            seeded_fault=r.get("seeded_fault"), open=state in ("fail", "error", "fixed")))
    band_order: dict[str, int] = {b: i for i, b in enumerate(clauses.SUBJECTS)}
    ordered = sorted(groups.values(), key=lambda g: (
        band_order.get(g.band, len(band_order)), rows.index(g.row) if g.row in rows else
        len(rows), clauses.clause_sort_key(g.clause)))
    placed = set()
    for g in ordered:
        if (g.row, g.clause) not in placed:
            placed.add((g.row, g.clause))
            g.row_anchor = f"{g.row}:{g.clause}"
    return ordered


# --------------------------------------------------------------------------- verdict


@dataclass
class Link:
    text: str
    href: str


@dataclass
class RootCause:
    backend: str
    root: Link
    dependents: list[Link]


@dataclass
class Note:
    """One note of the verdict; a list of entries (what was unchecked) shown one a line."""

    head: str
    items: list[str]


@dataclass
class Verdict:
    verdict: str
    glyph: str
    mode: str
    scope: list[str] | None
    notes: list[Note]
    roots: list[RootCause]
    blocking: list[Link]
    line: str  # the verdict and its notes, as the run printed it


def verdict_view(report: Mapping[str, Any]) -> Verdict:
    """The verdict, its notes (root causes first, as the run printed them) and links to the
    results they name."""
    results = report["results"]
    notes = verdict_notes(report["verdict"], report["uncovered"], report["selection"],
                          report["run"], results, report["startup_failures"],
                          report.get("integrity", []))
    judged = in_scope(results, scope_of(report["selection"]))
    roots = []
    root = clauses.ROOT_CLAUSE
    for r in judged:
        if r.get("clause") == root and r.get("status") == "failed" and r.get("backend"):
            deps = [d for d in judged if d.get("depends_on") == root
                    and d.get("backend") == r["backend"]]
            roots.append(RootCause(str(r["backend"]), _link(r), [_link(d) for d in deps]))
    blocking = [_link(r) for r in results if r["nodeid"] in set(report["summary"]["blocking"])]
    line = report["verdict"] + (f" ({'; '.join(notes)})" if notes else "")
    entries = [describe_uncovered(e) for e in report["uncovered"]]
    shown = [Note("unchecked", entries) if entries and n == "unchecked: " + "; ".join(entries)
             else Note(n, []) for n in notes]
    return Verdict(report["verdict"], VERDICT_GLYPHS.get(report["verdict"], "?"),
                   "strict" if report["summary"]["strict"] else "non-strict",
                   scope_of(report["selection"]), shown, roots, blocking, line)


def _link(result: Mapping[str, Any]) -> Link:
    tid = test_id(str(result["nodeid"]))
    return Link(tid, anchor(tid))


# --------------------------------------------------------------------------- sections


@dataclass
class Finding:
    state: str  # persists, fixed, new
    entry: str | None  # the known finding (its file, line and pattern); None for a new one
    clause: str
    results: list[Link]
    reason: str


def findings(report: Mapping[str, Any]) -> list[Finding]:
    """The stack's known findings and the failures none describes: new, then persists,
    then fixed; one line per entry (a new one: per test)."""
    states = finding_states(report)
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for r in report["results"]:
        state = states.get(str(r["nodeid"]))
        if state is None:
            continue
        key = str(r.get("xfail") or "") or test_function(str(r["nodeid"]))
        groups.setdefault((state, key), []).append(r)
    out = []
    for (state, key), rows in groups.items():
        reason = str(rows[0].get("reason") or "")
        reason = re.sub(r"^known: ", "", reason).split(" [", 1)[0] if state != "new" else \
            split_message(reason)[0]
        out.append(Finding(state, key if rows[0].get("xfail") else None,
                           str(rows[0]["clause"]), [_link(r) for r in rows], reason))
    return sorted(out, key=lambda f: (FINDING_STATES.index(f.state),
                                      clauses.clause_sort_key(f.clause), f.entry or ""))


@dataclass
class Skips:
    text: str
    count: int
    results: list[Link]


def unchecked(report: Mapping[str, Any]) -> list[Skips]:
    """What the run left unchecked, one entry per backend or clause (the report's
    ``uncovered``), each with its reason and results."""
    out = []
    for entry in report["uncovered"]:
        mine = [r for r in report["results"] if result_state(r) == "unchecked"
                and str(r["clause"]) in entry["clauses"]
                and (entry["backend"] is None or r.get("backend") == entry["backend"])]
        out.append(Skips(describe_uncovered(entry), entry["results"], [_link(r) for r in mine]))
    return out


def not_applicable(report: Mapping[str, Any]) -> list[Skips]:
    """The clauses that do not apply, one entry per clause and reason."""
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for r in report["results"]:
        if result_state(r) == "na":
            reason = re.sub(r"^KV-[A-Z]+\d+: ", "", str(r.get("reason") or ""))
            reason = re.sub(r"\b" + re.escape(str(r.get("backend") or "\0")) + r"\b",
                            "the backend", reason)
            groups.setdefault((str(r["clause"]), reason), []).append(r)
    return [Skips(f"{clause}: {reason}", len(rows), [_link(r) for r in rows])
            for (clause, reason), rows in sorted(
                groups.items(), key=lambda kv: clauses.clause_sort_key(kv[0][0]))]


@dataclass
class Harness:
    interruption: str | None
    startup: list[str]
    errors: list[tuple[str, Link, str]]  # kind, result, message


def harness(report: Mapping[str, Any]) -> Harness:
    """What stopped production or the harness, apart from the clauses' results."""
    errors = [(str(r.get("error_kind") or "harness"), _link(r),
               split_message(str(r.get("reason") or ""))[0])
              for r in report["results"] if r["status"] == "error"]
    return Harness(interruption_of(report["run"], report["selection"], report["results"]),
                   [describe_startup_failure(f) for f in report["startup_failures"]], errors)


@dataclass
class Message:
    level: str
    text: str
    count: int
    sources: list[str]
    cut: int  # characters left out of a long message


@dataclass
class Log:
    key: str
    title: str
    total: int
    by_level: list[tuple[str, int]]
    by_source: list[tuple[str, int]]
    messages: list[Message]
    left_out: int  # distinct messages not shown


def logs(report: Mapping[str, Any]) -> list[Log]:
    """What the stack printed, counted by level and process; distinct messages, each once
    with its count, the first :data:`SHOWN_MESSAGES`, bounded (the JSON has every one)."""
    env = report["environment"]
    out = []
    for key, title in (("import_log", "While vLLM / vllm-omni were imported for discovery"),
                       ("worker_log", "Production's KV-A worker processes")):
        messages = env.get(key) or []
        if not messages:
            continue
        distinct: dict[tuple[str, str], Message] = {}
        for m in messages:
            level, text = str(m.get("level") or "-"), str(m["text"])
            found = distinct.get((level, text))
            if found is None:
                cut = max(0, len(text) - MESSAGE_CHARS)
                found = distinct[level, text] = Message(level, text[:MESSAGE_CHARS], 0, [], cut)
            found.count += 1
            source = m.get("source")
            if source and source not in found.sources:
                found.sources.append(str(source))
        ranked = sorted(distinct.values(), key=lambda m: -m.count)
        out.append(Log(key, title, len(messages),
                       Counter(str(m.get("level") or "-") for m in messages).most_common(),
                       Counter(str(m.get("source")) for m in messages
                               if m.get("source")).most_common(),
                       ranked[:SHOWN_MESSAGES], max(0, len(ranked) - SHOWN_MESSAGES)))
    return out


@dataclass
class Environment:
    stack: str
    rows: list[tuple[str, str]]
    backends: list[dict[str, Any]]
    plugins: list[dict[str, Any]]


def environment(report: Mapping[str, Any]) -> Environment:
    env = report["environment"]
    rows = [(k, str(env[k] or "not installed")) for k in ("vllm", "vllm_omni", "torch", "python")]
    rows += [("platform", str(env["platform"])), ("host", str(env["host"])),
             ("seed", str(env["seed"]))]
    rows += [(f"device {i}", device_text(d)) for i, d in enumerate(env["devices"])]
    if env.get("seeded_faults"):
        rows.append(("seeded worker fault", ", ".join(env["seeded_faults"])))
    rows += [(f"option {k}", str(v)) for k, v in sorted(env["options"].items())
             if v not in (None, False, "", [], {})]
    plugins = env.get("plugins") or {}
    return Environment(stack_label(env), rows, [dict(b) for b in report["backends"]],
                       list(plugins.get("plugins", [])) if isinstance(plugins, dict) else [])


def stack_label(env: Mapping[str, Any]) -> str:
    return (f"vLLM {env.get('vllm') or '-'} · vllm-omni {env.get('vllm_omni') or '-'} · "
            f"torch {env.get('torch') or '-'}")


@dataclass
class ReportPage:
    title: str
    run_id: str
    started: str
    duration_s: float
    host: str
    contract: str
    schema: str
    env: Environment
    verdict: Verdict
    counts: list[tuple[str, int]]
    grids: list[Grid]
    harness: Harness
    findings: list[Finding]
    unchecked: list[Skips]
    not_applicable: list[Skips]
    groups: list[ResultGroup]
    vias: list[str]
    logs: list[Log]
    stack: dict[str, Any]
    # clause, title, text, and its results' groups (a matrix links a leg's clause here)
    clause_texts: list[tuple[str, str, str, list[Link]]] = field(default_factory=list)
    json_name: str | None = None


def report_page(report: Mapping[str, Any], json_name: str | None = None) -> ReportPage:
    """Everything one report's page shows."""
    vias: list[str] = []
    groups = result_groups(report, vias)
    texts = clauses.contract_texts()
    shown = sorted({g.clause for g in groups}, key=clauses.clause_sort_key)
    env = report["environment"]
    return ReportPage(
        title="kvconform qualification report", run_id=report["run"]["id"],
        started=report["run"]["started"], duration_s=report["run"]["duration_s"],
        host=str(env["host"]), contract=report["contract"], schema=report["schema"],
        env=environment(report), verdict=verdict_view(report),
        counts=[(s, n) for s, n in report["summary"]["by_status"].items() if n],
        grids=report_grids(report), harness=harness(report), findings=findings(report),
        unchecked=unchecked(report), not_applicable=not_applicable(report), groups=groups,
        vias=vias, logs=logs(report), stack=dict(report.get("stack") or
                                                  stack_record(report["results"])),
        clause_texts=[(c, clause_title(c), texts.get(c, ""),
                       [Link(f"{g.row} ({g.band})", anchor(g.id)) for g in groups
                        if g.clause == c]) for c in shown],
        json_name=json_name)


# --------------------------------------------------------------------------- a matrix


@dataclass
class LegView:
    name: str
    description: str
    outcome: str  # its verdict where it ran, else its state
    glyph: str
    stack: str
    counts: list[tuple[str, int]]
    reason: str | None
    href: str | None  # its page, or its log where it did not run
    link_text: str


@dataclass
class MatrixPage:
    run_id: str
    started: str
    duration_s: float
    contract: str
    schema: str
    verdict: str
    glyph: str
    line: str
    interruption: str | None
    legs: list[LegView]
    grids: list[Grid]


def page_of(report_name: str | None) -> str | None:
    """A report file's page, next to it: ``py311-vllm030.json`` -> ``py311-vllm030.html``."""
    if not report_name:
        return None
    stem, dot, _ = report_name.rpartition(".")
    return f"{stem}.html" if dot else f"{report_name}.html"


def _matrix_stack(leg: Mapping[str, Any]) -> str:
    return matrix_stack_label(leg["stack"], leg["stack_source"])


def matrix_page(matrix: Mapping[str, Any],
                reports: Mapping[str, Mapping[str, Any]] | None = None) -> MatrixPage:
    """A release matrix: its legs, the version x clause grid (one row per leg, each linking
    to the leg's own page) and, per backend, its rows across the legs.  With the legs'
    reports, cells tell "not checked" from "n/a"; without, a skip reads "not checked"."""
    legs = []
    for leg in matrix["legs"]:
        outcome = leg_outcome(leg)
        page = page_of(leg["report"])
        legs.append(LegView(
            str(leg["name"]), str(leg["description"]), outcome,
            VERDICT_GLYPHS.get(outcome) or LEG_GLYPHS.get(outcome, "?"), _matrix_stack(leg),
            [(s, n) for s, n in (leg["counts"] or {}).items() if n], leg["reason"],
            page or leg["log"], "page" if page else ("log" if leg["log"] else "")))
    ran = [leg for leg in matrix["legs"] if leg["state"] == "ran"]
    results = {leg["name"]: (reports or {}).get(leg["name"], {}).get("results") for leg in ran}
    grids = [_leg_grid(matrix, results, None, "stack", "Stack \u00d7 clause",
                       "one row per leg: every backend's results and the stack's, per clause")]
    backends = list(dict.fromkeys(c["backend"] for c in matrix["by_backend"]))
    backends = [b for b in backends if b != UPSTREAM_ROW] + [b for b in backends
                                                             if b == UPSTREAM_ROW]
    if backends:
        per = _leg_grid(matrix, results, backends, "backends",
                        "Each backend \u00d7 stack \u00d7 clause",
                        "each backend's row on every leg that ran")
        grids.append(per)
    return MatrixPage(matrix["run"]["id"], matrix["run"]["started"], matrix["run"]["duration_s"],
                      matrix["contract"], matrix["schema"], matrix["verdict"],
                      VERDICT_GLYPHS.get(matrix["verdict"], "?"), verdict_line(matrix),
                      matrix["run"]["interruption"], legs, grids)


def _status_cell(counts: Mapping[str, int], href: str | None, where: str) -> Cell:
    """A cell from status counts alone (a matrix cell without its leg's results)."""
    rows = [{"status": s, "skip_kind": None} for s, n in counts.items() for _ in range(n)]
    return _cell(rows, href, where)


def _leg_grid(matrix: Mapping[str, Any], results: Mapping[str, Any], backends: list[str] | None,
              key: str, title: str, meaning: str) -> Grid:
    cells_key = "by_stack" if backends is None else "by_backend"
    cells = matrix[cells_key]
    columns = sorted({str(c["clause"]) for c in cells}, key=clauses.clause_sort_key)
    by: dict[tuple[str | None, str, str], Mapping[str, Any]] = {
        (c["backend"], c["leg"], c["clause"]): c for c in cells}
    rows: list[GridRow] = []
    keys: list[str | None] = list(backends) if backends is not None else [None]
    for backend in keys:
        for leg in matrix["legs"]:
            name = str(leg["name"])
            page = page_of(leg["report"])
            stack = _matrix_stack(leg)
            if leg["state"] != "ran":
                if backend is None:
                    rows.append(GridRow(name, None, [], page or leg["log"],
                                        f"{leg_outcome_text(leg)}", stack))
                continue
            if backend is not None and not any((backend, name, c) in by for c in columns):
                continue
            mine = results.get(name)
            row_cells: list[Cell | None] = []
            for clause in columns:
                found = by.get((backend, name, clause))
                if found is None:
                    row_cells.append(None)
                    continue
                where = f"{backend + ' x ' if backend else ''}{name} x {clause}"
                href = None
                if page:
                    href = page + (anchor(f"{backend}:{clause}") if backend else
                                   anchor(clause))
                if mine is not None:
                    picked = [r for r in mine if r["clause"] == clause and
                              (backend is None or row_name(r) == backend)]
                    row_cells.append(_cell(picked, href, where) if picked else
                                     _status_cell(found["counts"], href, where))
                else:
                    row_cells.append(_status_cell(found["counts"], href, where))
            rows.append(GridRow(name, backend, row_cells, page, detail=stack))
    return Grid(key, title, meaning, columns, rows, row_header="leg (stack)")


def leg_outcome_text(leg: Mapping[str, Any]) -> str:
    return f"{leg_outcome(leg)}: {leg['reason']}" if leg["reason"] else leg_outcome(leg)


# --------------------------------------------------------------------------- a merge


@dataclass
class HostView:
    label: str
    file: str
    verdict: str
    glyph: str
    mode: str
    stack: str
    devices: str
    href: str | None


@dataclass
class MergedPage:
    verdict: str
    glyph: str
    contract: str
    hosts: list[HostView]
    grids: list[Grid]
    unchecked: list[str]
    startup: list[str]


def merged_page(named: Sequence[tuple[str, Mapping[str, Any]]],
                pages: Mapping[str, str]) -> MergedPage:
    """Several hosts' reports: their verdicts, and per band each backend's row on each host
    (each cell linking into that host's page, where it has one)."""
    labels = host_labels(named)
    reports = [r for _, r in named]
    hosts = []
    for label, (name, rep) in zip(labels, named, strict=True):
        env = rep["environment"]
        hosts.append(HostView(label, name, rep["verdict"], VERDICT_GLYPHS.get(rep["verdict"], "?"),
                              "strict" if rep["summary"]["strict"] else "non-strict",
                              stack_label(env), "; ".join(device_text(d) for d in env["devices"]),
                              pages.get(name)))
    all_results = [r for rep in reports for r in rep["results"]]
    order = matrix_rows(all_results, [b for rep in reports for b in rep["backends"]])
    grids = []
    for band, title, meaning in (("backend", "The backends' own results", "per host"),
                                 ("stack", "The serving stack's results", "per host")):
        mine = [r for r in all_results if subject(r) == band]
        if not mine:
            continue
        columns = sorted({str(r["clause"]) for r in mine}, key=clauses.clause_sort_key)
        rows = []
        for name in order:
            for label, (file, rep) in zip(labels, named, strict=True):
                here = [r for r in rep["results"] if subject(r) == band and row_name(r) == name]
                if not here:
                    continue
                page = pages.get(file)
                cells: list[Cell | None] = []
                for clause in columns:
                    picked = [r for r in here if r["clause"] == clause]
                    cells.append(_cell(picked, page + anchor(group_id(band, name, clause))
                                       if page else None, f"{name} x {label} x {clause}")
                                 if picked else None)
                rows.append(GridRow(label, name, cells, page))
        grids.append(Grid(band, title, meaning, columns, rows, row_header="host"))
    uncovered = [describe_uncovered(e) for e in merged_uncovered(reports)]
    startup = [f"{label}: {describe_startup_failure(f)}" for label, rep in
               zip(labels, reports, strict=True) for f in rep["startup_failures"]]
    verdict = merged_verdict(reports)
    return MergedPage(verdict, VERDICT_GLYPHS.get(verdict, "?"), reports[0]["contract"], hosts,
                      grids, uncovered, startup)


# --------------------------------------------------------------------------- a diff


@dataclass
class ChangeView:
    what: str  # a test id, or a clause with the rows it covers (a grouped change)
    href: str | None
    clause: str
    row: str
    before: str | None  # a state key (None: no result)
    after: str | None
    note: str
    reason: str
    count: int = 1


@dataclass
class DiffSection:
    key: str
    title: str
    meaning: str
    changes: list[ChangeView]


@dataclass
class DiffPart:
    """One report's diff (or one leg's, in a matrix diff)."""

    title: str | None
    summary: str
    new_failures: int
    environment: list[str]
    sections: list[DiffSection]


@dataclass
class DiffPage:
    a: str
    b: str
    gate: str
    parts: list[DiffPart]
    legs: list[str]


def _status_state(status: str | None) -> str | None:
    return None if status is None else result_state({"status": status})


def _change(change: Any, b_page: str | None) -> ChangeView:
    return ChangeView(change.test, (b_page or "") + anchor(change.test) if b_page else None,
                      change.clause, change.backend or UPSTREAM_ROW,
                      _status_state(change.before), _status_state(change.after), change.note,
                      change.reason)


def _grouped_changes(changes: Sequence[Any]) -> list[ChangeView]:
    groups: dict[tuple[str, str | None, str | None, str, str], list[Any]] = {}
    for c in changes:
        groups.setdefault((c.clause, c.before, c.after, c.note, c.reason), []).append(c)
    out = []
    for (clause, before, after, note, reason), group in sorted(
            groups.items(), key=lambda kv: (clauses.clause_sort_key(kv[0][0]), str(kv[0][1:]))):
        rows = sorted({c.backend or UPSTREAM_ROW for c in group})
        shown = ", ".join(rows[:6]) + (f", … ({len(rows)} rows)" if len(rows) > 6 else "")
        out.append(ChangeView(shown, None, clause, shown, _status_state(before),
                              _status_state(after), note, reason, len(group)))
    return out


def diff_part(diff: Any, title: str | None, b_page: str | None) -> DiffPart:
    individual = (
        ("new", "New failures", "failing in B, not in A: the gate fails on these",
         diff.new_failures),
        ("fixed", "Fixed", "failing or known in A, passing in B (a known finding fixed: its "
         "entry is stale)", diff.fixed),
        ("declared", "Newly declared known findings", "known in B, not in A", diff.declared))
    grouped = (
        ("unchecked", "Newly unchecked", "checked in A, not in B (with B's reason)",
         diff.newly_unchecked),
        ("checked", "Newly checked", "unchecked in A, checked in B", diff.newly_checked),
        ("rerouted", "Checked through another entry point", "both checked, through another "
         "production entry point", diff.rerouted))
    sections = [DiffSection(k, t, m, [_change(c, b_page) for c in cs])
                for k, t, m, cs in individual if cs]
    sections += [DiffSection(k, t, m, _grouped_changes(cs)) for k, t, m, cs in grouped if cs]
    return DiffPart(title, summary_line(diff), len(diff.new_failures), list(diff.environment),
                    sections)


def diff_page(diff: Any, a_name: str, b_name: str, *, a: Mapping[str, Any] | None,
              b: Mapping[str, Any] | None, b_page: str | None) -> DiffPage:
    """B against A: one part for two reports, one per leg that ran in both for two matrices
    (the legs' changes listed first)."""
    if isinstance(diff, MatrixDiff):
        parts = [diff_part(d, name, None) for name, d in diff.legs.items()]
        gate = f"{diff.new_failures} new failure(s) over {len(diff.legs)} leg(s) that ran in both"
        return DiffPage(a_name, b_name, gate, parts, list(diff.changes))
    part = diff_part(diff, None, b_page)
    a_text = describe_report(a_name, a).replace("`", "") if a is not None else a_name
    b_text = describe_report(b_name, b).replace("`", "") if b is not None else b_name
    return DiffPage(a_text, b_text, f"{part.new_failures} new failure(s)", [part], [])
