"""What changed between two reports (``kvconform diff A.json B.json``): the release gate.

Results are matched by test id (``test_kv_l6_seam[need_True]``, the node id without its
file), so reports of two stacks compare wherever the suite ran them.  Each result is one of:

* failing: failed or error (or produced under a seeded worker fault);
  one the backend's own code caused (``caused_by``: a call into its class hung, ended its
  process or ran out of memory) is listed apart, as the backend's, never as a new failure;
* known: xfailed, a declared known finding that still holds;
* passing: passed, or xpassed (a known finding that no longer holds: its entry is stale);
* unchecked: skipped, or no result at all.

B against A lists new failures (failing in B, not in A), fixed results (failing or known
in A, passing in B; a known finding fixed is stale), the known findings that persist (known
or declared in both, or in B on a result A did not check by a finding A knows; counted by
B's entries), newly unchecked results with B's reason, newly checked
ones, results checked through another production entry point (their ``via``: vLLM alone
where vllm-omni is gone), and the environment changes (versions, backends, the known
findings file).  Two combined matrix reports are compared leg by leg.
Stdlib only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pytest_kvconform.contract import inert
from pytest_kvconform.contract.clauses import clause_sort_key
from pytest_kvconform.report.matrix import describe_leg, leg_outcome, short_reason, stack_label
from pytest_kvconform.report.render import UPSTREAM_ROW, md_escape

ENV_KEYS = ("python", "torch", "vllm", "vllm_omni", "platform", "host")
PERSISTS = "persists: "
_CHECKED = ("failing", "known", "passing")


@dataclass(frozen=True)
class Change:
    """One result that changed class: its test id, clause, row, both statuses, and why."""

    test: str
    clause: str
    backend: str | None
    before: str | None  # status in A (None: no result)
    after: str | None  # status in B
    reason: str  # B's reason ("" for none), or why B has no result
    note: str = ""  # e.g. the stale known finding, a declared one


@dataclass
class ReportDiff:
    """B against A; ``new_failures`` makes the gate fail."""

    new_failures: list[Change] = field(default_factory=list)
    fixed: list[Change] = field(default_factory=list)
    newly_unchecked: list[Change] = field(default_factory=list)
    newly_checked: list[Change] = field(default_factory=list)
    declared: list[Change] = field(default_factory=list)  # failing -> known, passing -> known
    # known (or a declared skip) in both, or on a result A did not check by a finding A knows
    persists: list[Change] = field(default_factory=list)
    # Checked in both, through another production entry point (``via``: vLLM alone, ...).
    rerouted: list[Change] = field(default_factory=list)
    # Failing in B, not in A, because the backend's own code hung, died or ran out of memory
    # (``caused_by``): the backend's, not the stack's, so not a new failure.
    backend_faults: list[Change] = field(default_factory=list)
    still_failing: int = 0
    environment: list[str] = field(default_factory=list)

    @property
    def stale(self) -> list[Change]:
        """Fixed results whose known finding no longer holds (its entry is stale)."""
        return [c for c in self.fixed if c.note]

    @property
    def persisting_findings(self) -> list[str]:
        """The known findings (B's entries) still failing as they describe, known in A too."""
        return sorted({c.note.removeprefix(PERSISTS) for c in self.persists})


def result_key(nodeid: str) -> str:
    """The node id without its file: ``test_kv_l1[FLASH_ATTN]``."""
    return nodeid.rsplit("::", 1)[-1]


def outcome_class(result: Mapping[str, Any] | None) -> str:
    """failing, known, passing or unchecked (see the module docstring)."""
    if result is None:
        return "unchecked"
    status = result["status"]
    if status in ("failed", "error") or result.get("seeded_fault"):
        return "failing"
    if status == "xfailed":
        return "known"
    return "passing" if status in ("passed", "xpassed") else "unchecked"


def _results(report: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """Test id -> its result; a test with several rows (call and teardown) keeps the worst."""
    out: dict[str, Mapping[str, Any]] = {}
    for r in report["results"]:
        key = result_key(r["nodeid"])
        if key not in out or _rank(r) < _rank(out[key]):
            out[key] = r
    return out


def _rank(result: Mapping[str, Any]) -> int:
    cls = outcome_class(result)
    return _CHECKED.index(cls) if cls in _CHECKED else len(_CHECKED)


def diff_reports(a: Mapping[str, Any], b: Mapping[str, Any]) -> ReportDiff:
    """B against A (two validated reports)."""
    diff = ReportDiff(environment=environment_changes(a, b))
    before, after = _results(a), _results(b)
    # The findings A knows: one B declares on a result A never checked (a new backend's)
    # persists there, it is not newly declared.
    known_in_a = {r.get("xfail") for r in before.values() if _declares(r)}
    b_backends = {x["name"] for x in b["backends"]}
    for key in sorted(set(before) | set(after)):
        ra, rb = before.get(key), after.get(key)
        ca, cb = outcome_class(ra), outcome_class(rb)
        some = rb or ra
        assert some is not None
        if rb is not None:
            reason = short_reason(rb["reason"]) if rb.get("reason") else ""
        elif some.get("backend") and some["backend"] not in b_backends:
            reason = "not collected: the backend is not in B"
        else:
            reason = "not collected (deselected, or the test is gone)"
        change = Change(key, some["clause"], some.get("backend"),
                        ra["status"] if ra is not None else None,
                        rb["status"] if rb is not None else None, reason)
        if cb == "failing":
            if ca == "failing":
                diff.still_failing += 1
            elif rb is not None and rb.get("caused_by"):
                diff.backend_faults.append(_noted(change, f"caused by {rb.get('backend')}'s own "
                                                          f"code: {rb['caused_by']}"))
            else:
                fault = (rb or {}).get("seeded_fault")
                diff.new_failures.append(
                    _noted(change, f"under the seeded worker fault {fault}" if fault else ""))
        elif cb == "passing" and ca in ("failing", "known"):
            entry = (ra or {}).get("xfail") if ca == "known" else None
            entry = entry or (rb["xfail"] if rb is not None and rb["status"] == "xpassed"
                              else None)
            diff.fixed.append(_noted(change, f"stale known finding: {entry}" if entry else ""))
        elif rb is not None and _declares(rb) and (
                _declares(ra) or (ca == "unchecked" and rb.get("xfail") in known_in_a)):
            diff.persists.append(_noted(change, f"{PERSISTS}{rb.get('xfail')}"))
        elif cb == "known":
            entry = rb["xfail"] if rb is not None else None
            diff.declared.append(_noted(change, f"declared: {entry}"))
        elif cb == "unchecked" and ca in _CHECKED:
            kind = (rb or {}).get("skip_kind")
            diff.newly_unchecked.append(_noted(change, f"{kind} skip" if kind else ""))
        elif ca == "unchecked" and cb in _CHECKED:
            diff.newly_checked.append(change)
        elif ra is not None and rb is not None and ra.get("via") != rb.get("via"):
            diff.rerouted.append(_noted(change, f"via {rb.get('via') or 'the default path'}"))
    return diff


def _declares(result: Mapping[str, Any] | None) -> bool:
    """A known finding shows on the result: it failed as described (xfailed), or skipped
    the way an entry declares (a backend that does not import)."""
    return (result is not None and bool(result.get("xfail"))
            and result["status"] in ("xfailed", "skipped"))


def _noted(change: Change, note: str) -> Change:
    return Change(change.test, change.clause, change.backend, change.before, change.after,
                  change.reason, note)


def environment_changes(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """Versions, host, devices, the known findings file and the backends, A -> B."""
    ea, eb = a["environment"], b["environment"]
    changes = [f"{key}: {ea[key] or 'not installed'} -> {eb[key] or 'not installed'}"
               for key in ENV_KEYS if ea.get(key) != eb.get(key)]
    da, db = [d["name"] for d in ea["devices"]], [d["name"] for d in eb["devices"]]
    if da != db:
        changes.append(f"devices: {', '.join(da) or '-'} -> {', '.join(db) or '-'}")
    xa, xb = ea["options"].get("xfails"), eb["options"].get("xfails")
    if xa != xb:
        changes.append(f"known findings file: {xa or 'none'} -> {xb or 'none'}")
    if a["summary"]["strict"] != b["summary"]["strict"]:
        changes.append(f"strict: {a['summary']['strict']} -> {b['summary']['strict']}")
    ba = {x["name"]: x for x in a["backends"]}
    bb = {x["name"]: x for x in b["backends"]}
    if set(ba) - set(bb):
        changes.append(f"backends gone: {', '.join(sorted(set(ba) - set(bb)))}")
    if set(bb) - set(ba):
        changes.append(f"backends new: {', '.join(sorted(set(bb) - set(ba)))}")
    for name in sorted(set(ba) & set(bb)):
        if ba[name]["importable"] != bb[name]["importable"]:
            state = "importable" if bb[name]["importable"] else \
                f"not importable ({bb[name]['reason']})"
            changes.append(f"backend {name}: now {state}")
        elif ba[name]["path"] != bb[name]["path"]:
            changes.append(f"backend {name}: {ba[name]['path']} -> {bb[name]['path']}")
    if a["verdict"] != b["verdict"]:
        changes.append(f"verdict: {a['verdict']} -> {b['verdict']}")
    return changes


# --------------------------------------------------------------------------- rendering


def _row(change: Change) -> str:
    return change.backend or UPSTREAM_ROW


def _because(reason: str) -> str:
    return f": {md_escape(reason)}" if reason else ""


def _individual(changes: Sequence[Change]) -> list[str]:
    lines = []
    for c in changes:
        note = f" ({c.note})" if c.note else ""
        lines.append(f"- {inert.code_span(c.test)} ({md_escape(c.clause)}, {md_escape(_row(c))}): "
                     f"{md_escape(c.before or 'no result')} -> "
                     f"{md_escape(c.after or 'no result')}{md_escape(note)}{_because(c.reason)}")
    return lines


def _grouped(changes: Sequence[Change]) -> list[str]:
    """One line per clause, transition and reason (a lost stack unchecks hundreds)."""
    groups: dict[tuple[str, str, str, str], list[Change]] = {}
    for c in changes:
        key = (c.clause, f"{c.before or 'no result'} -> {c.after or 'no result'}", c.note,
               c.reason)
        groups.setdefault(key, []).append(c)
    lines = []
    for (clause, move, note, reason), group in sorted(
            groups.items(), key=lambda kv: (clause_sort_key(kv[0][0]), kv[0][1:])):
        rows = sorted({_row(c) for c in group})
        shown = ", ".join(rows[:6]) + (f", ... ({len(rows)} rows)" if len(rows) > 6 else "")
        n = len(group)
        lines.append(f"- {md_escape(clause)} ({n} result{'s' if n != 1 else ''}; "
                     f"{md_escape(shown)}): {md_escape(move)}"
                     f"{md_escape(f' ({note})') if note else ''}{_because(reason)}")
    return lines


def _by_finding(changes: Sequence[Change]) -> list[tuple[str, int]]:
    counts: dict[str, int] = {}
    for c in changes:
        counts[c.note.removeprefix(PERSISTS)] = counts.get(c.note.removeprefix(PERSISTS), 0) + 1
    return sorted(counts.items())


def summary_line(diff: ReportDiff) -> str:
    faults = (f", {len(diff.backend_faults)} fault(s) of the backends' own code (not the "
              "stack's)" if diff.backend_faults else "")
    return (f"{len(diff.new_failures)} new failure(s), {len(diff.fixed)} fixed "
            f"({len(diff.stale)} stale known finding(s)), {len(diff.persisting_findings)} known "
            f"finding(s) persist ({len(diff.persists)} result(s)), "
            f"{len(diff.newly_unchecked)} newly unchecked, {len(diff.newly_checked)} newly "
            f"checked, {len(diff.declared)} newly declared known, {len(diff.rerouted)} checked "
            f"through another entry point{faults}; "
            f"{diff.still_failing} still failing")


def render_diff_lines(diff: ReportDiff) -> list[str]:
    """The sections of one diff (Markdown), headed by its counts."""
    lines = [f"**{summary_line(diff)}**", ""]
    sections = (
        ("Environment changes", [f"- {md_escape(c)}" for c in diff.environment]),
        ("New failures", _individual(diff.new_failures)),
        ("Faults of the backends' own code (not the stack's)",
         _individual(diff.backend_faults)),
        ("Fixed", _individual(diff.fixed)),
        ("Known findings that persist", [f"- `{f}` ({n} result{'s' if n != 1 else ''})"
                                         for f, n in _by_finding(diff.persists)]),
        ("Newly declared known findings", _individual(diff.declared)),
        ("Newly unchecked", _grouped(diff.newly_unchecked)),
        ("Newly checked", _grouped(diff.newly_checked)),
        ("Checked through another entry point", _grouped(diff.rerouted)),
    )
    for title, body in sections:
        if body:
            lines += [f"### {title}", "", *body, ""]
    return lines


def describe_report(name: str, report: Mapping[str, Any]) -> str:
    env = report["environment"]
    return (f"{name}: {stack_label(env)}, {report['verdict']} (run `{report['run']['id']}`, "
            f"{len(report['results'])} results)")


def render_diff(diff: ReportDiff, a_name: str, a: Mapping[str, Any], b_name: str,
                b: Mapping[str, Any]) -> str:
    lines = ["# kvconform diff", "", f"- A = {md_escape(describe_report(a_name, a))}",
             f"- B = {md_escape(describe_report(b_name, b))}", "", "## B against A", "",
             *render_diff_lines(diff)]
    return "\n".join(lines).rstrip() + "\n"


@dataclass
class MatrixDiff:
    """Two combined reports, leg by leg; ``legs`` holds the diffs of legs that ran in both."""

    legs: dict[str, ReportDiff] = field(default_factory=dict)
    changes: list[str] = field(default_factory=list)  # legs added, gone, state or verdict

    @property
    def new_failures(self) -> int:
        return sum(len(d.new_failures) for d in self.legs.values())


def diff_matrices(a: Mapping[str, Any], b: Mapping[str, Any],
                  reports_a: Mapping[str, Mapping[str, Any]],
                  reports_b: Mapping[str, Mapping[str, Any]]) -> MatrixDiff:
    """B against A, per leg name; the leg reports are given by name (validated)."""
    out = MatrixDiff()
    la = {leg["name"]: leg for leg in a["legs"]}
    lb = {leg["name"]: leg for leg in b["legs"]}
    for name in sorted(set(la) | set(lb)):
        if name not in lb:
            out.changes.append(f"leg gone: {describe_leg(la[name])}")
        elif name not in la:
            out.changes.append(f"leg new: {describe_leg(lb[name])}")
        else:
            before, after = la[name], lb[name]
            if (before["state"], before["verdict"]) != (after["state"], after["verdict"]):
                reason = f": {after['reason']}" if after["reason"] else ""
                out.changes.append(f"leg {name}: {leg_outcome(before)} -> "
                                   f"{leg_outcome(after)}{reason}")
            if name in reports_a and name in reports_b:
                out.legs[name] = diff_reports(reports_a[name], reports_b[name])
    return out


def render_matrix_diff(diff: MatrixDiff, a_name: str, b_name: str) -> str:
    lines = ["# kvconform diff", "", f"- A = {md_escape(a_name)}", f"- B = {md_escape(b_name)}",
             "", f"**{diff.new_failures} new failure(s) over {len(diff.legs)} leg(s) that ran in "
             "both**", ""]
    if diff.changes:
        lines += ["## Legs", "", *[f"- {md_escape(c)}" for c in diff.changes], ""]
    for name, leg_diff in diff.legs.items():
        lines += [f"## {md_escape(name)}", "", *render_diff_lines(leg_diff)]
    return "\n".join(lines).rstrip() + "\n"
