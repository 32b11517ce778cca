"""The verdict: which results block qualification, and whether the run covered the matrix.

Kept apart from the schema and the renderings so the strict rule is read in one place:
the session prints it, :func:`~pytest_kvconform.report.build.build_report` records it,
validation recomputes it, and the Markdown explains it.  Stdlib only.

Results alone (:func:`compute_verdict`):

* non-strict: qualified iff at least one result ran and none failed or errored
  (an xpass or a skip does not disqualify);
* strict (``--kv-strict``): additionally every xpass disqualifies, and every
  skip unless the clause table forgives its kind for its clause
  (:func:`pytest_kvconform.contract.clauses.skip_forgiven`) or an xfails entry declares it
  (``xfail`` on the result).

The report's verdict (:func:`judge`) also needs the whole matrix to have run: the
``selection`` record (``-k``, ``-m``, narrowed paths, backends left out by
``--kv-backend``, suite tests collected / selected / deselected) and the ``run``
record (``interruption``).  A run that was interrupted, or in which a selected
test has no result, is ``interrupted``; a run that left any part of the matrix
out is ``partial``; a failure or error makes it ``not qualified`` (interrupted
still wins: nothing about an unfinished run is certified).

What a run left unchecked is listed as ``uncovered`` in both modes
(:func:`uncovered_entries`): a backend whose whole row was skipped (one that does not
import: "not checked"), and each clause skipped for any reason but "not applicable"
(missing hardware, a skip the xfails file declares, a missing package), each with its
kind, the xfails entry that declared it, and its reason.  A qualified verdict thus never
hides what it did not check.

Nothing ran, nothing qualified (:func:`not_checked`): a backend none of whose own results
ran (every one skipped, not all of them as not applicable) is never qualified, strict or
not.  A backend-scoped run naming it is ``not qualified`` and exits
:data:`EXIT_NOT_CHECKED`; so is a whole deployment holding it, unless a known finding
declares each of its skips (the deployment's known findings say it cannot run on this
host: SAGE_ATTN_3 without its kernel package), and its line then still says "not
checked", with the reason.

Each result has a subject (:data:`pytest_kvconform.contract.clauses.Subject`): the backend
under test, or the serving stack.  A backend-scoped run (``--kv-backend`` left backends out)
is judged on its backends' ``backend`` results alone (:func:`scope_of`); the stack's results
are told apart (:func:`stack_record`): known findings listed, anything else the stack's
regression.  When a backend's declaration (KV-L1) fails, the backend's other failures are
reported as depending on it
(:func:`~pytest_kvconform.report.result_notes.dependents`), and the verdict names KV-L1
first; :mod:`~pytest_kvconform.report.result_notes` words what speaks against
qualification.

A run whose judge was altered (``integrity``: the suite's own checks, oracle or verdict
code replaced after start-up, by a backend's code that ran in the judging process) is
``not qualified`` whatever the results, and says what changed.

A deployment that production could not start is ``not qualified`` whatever the
results (:func:`startup_failures`): a general plugin whose hook raises stops every
production process at start-up, since vLLM's and vllm-omni's loaders call the hooks
unguarded.  A result produced under a seeded worker fault (``seeded_fault``) blocks
too: it speaks for the fault, not for the backend.
"""

from __future__ import annotations

import datetime
import re
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pytest_kvconform.contract import clauses
from pytest_kvconform.contract.clauses import clause_sort_key, skip_forgiven
from pytest_kvconform.report.result_notes import (
    dependents,
    named_tests,
    result_notes,
    test_function,
)

STATUSES = ("passed", "failed", "skipped", "xfailed", "xpassed", "error")
VERDICTS = ("qualified", "not qualified", "partial", "interrupted")

# Every kind some clause forgives (the table says which clause forgives which).
FORGIVEN_SKIP_KINDS = tuple(sorted(k.value for k in clauses.FORGIVEN_SKIP_KINDS))


def _blocks(result: Mapping[str, Any], strict: bool) -> bool:
    status = result.get("status")
    if status in ("failed", "error") or result.get("seeded_fault"):
        return True
    if not strict:
        return False
    if status == "xpassed":
        return True
    # Forgiven in strict mode: a skip the clause table forgives for its clause
    # (missing hardware, a clause that does not apply), and a skip the
    # expected-failures file declares (``xfail``).
    return (status == "skipped"
            and not skip_forgiven(str(result.get("clause")), result.get("skip_kind"))
            and not result.get("xfail"))


def compute_verdict(
    results: Iterable[Mapping[str, Any]], strict: bool
) -> tuple[str, list[dict[str, Any]]]:
    """``("qualified" | "not qualified", uncovered entries)``; see the module docstring.

    An empty run is never qualified: nothing was checked.
    """
    results = list(results)
    qualified = bool(results) and not any(_blocks(r, strict) for r in results)
    return ("qualified" if qualified else "not qualified"), uncovered_entries(results)


# The keys of one ``uncovered`` entry, in the order they are written.
UNCOVERED_KEYS = ("scope", "backend", "clauses", "kind", "declared", "reason", "results")
UNCOVERED_SCOPES = ("backend", "clause")
_CLAUSE_PREFIX = re.compile(r"^KV-[A-Z]+\d+: ")


def _unchecked(result: Mapping[str, Any]) -> bool:
    """A skip that leaves something unchecked: any kind but "not applicable" (which
    has nothing to check)."""
    return result.get("status") == "skipped" and result.get("skip_kind") != "not-applicable"


def uncovered_entries(results: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """What the results left unchecked, one entry per backend row or clause.

    A backend whose every result is a skip is one entry of scope ``backend`` (its
    whole row is unchecked: typically it does not import); every other unchecked
    skip is grouped by clause, kind and the xfails entry that declared it (scope
    ``clause``; ``backend`` names the row when all its results are of one row).
    ``declared`` lists the xfails entries that declared its skips (empty: forgiven by
    the clause table, or not forgiven at all).  Backend entries come first, by name;
    then clauses in contract order.
    """
    results = list(results)
    rows: dict[str, list[Mapping[str, Any]]] = {}
    for r in results:
        if r.get("backend"):
            rows.setdefault(str(r["backend"]), []).append(r)
    whole = sorted(name for name, rs in rows.items()
                   if all(r.get("status") == "skipped" for r in rs)
                   and any(_unchecked(r) for r in rs))
    entries = [_uncovered_entry("backend", [r for r in rows[name] if _unchecked(r)])
               for name in whole]
    groups: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
    for r in results:
        if _unchecked(r) and r.get("backend") not in whole:
            key = (str(r["clause"]), str(r.get("skip_kind") or ""), str(r.get("xfail") or ""))
            groups.setdefault(key, []).append(r)
    for key in sorted(groups, key=lambda k: (clause_sort_key(k[0]), k[1], k[2])):
        entries.append(_uncovered_entry("clause", groups[key]))
    return entries


def _uncovered_entry(scope: str, results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    backends = {r.get("backend") for r in results}
    kinds = Counter(r.get("skip_kind") for r in results)
    declared = sorted({str(r["xfail"]) for r in results if r.get("xfail")})
    reasons = Counter(_CLAUSE_PREFIX.sub("", str(r.get("reason") or "")).strip() or
                      "(no reason given)" for r in results)
    reason, _ = reasons.most_common(1)[0]
    if len(reasons) > 1:
        reason += f" (and {len(reasons) - 1} other reason{'s' if len(reasons) > 2 else ''})"
    return {
        "scope": scope,
        "backend": next(iter(backends)) if len(backends) == 1 else None,
        "clauses": sorted({str(r["clause"]) for r in results}, key=clause_sort_key),
        "kind": kinds.most_common(1)[0][0],
        "declared": declared,
        "reason": reason,
        "results": len(results),
    }


def describe_uncovered(entry: Mapping[str, Any]) -> str:
    """One entry in words: ``SAGE_ATTN_3: not checked (every clause skipped, 42 results;
    backend skip, declared: ...)`` or ``KV-L7 for FLASH_ATTN (1 result; hardware skip:
    needs CUDA)``."""
    n = entry["results"]
    how = f"{entry['kind'] or 'unclassified'} skip" + (", declared" if entry["declared"] else "")
    counted = f"{n} result{'s' if n != 1 else ''}"
    if entry["scope"] == "backend":
        return (f"{entry['backend']}: not checked (every clause skipped, {counted}; {how}: "
                f"{entry['reason']})")
    where = ", ".join(entry["clauses"]) + (f" for {entry['backend']}" if entry["backend"] else "")
    return f"{where} ({counted}; {how}: {entry['reason']})"


_FAILED = ("failed", "error")

# The keys of one ``startup_failures`` entry, in the order they are written.
STARTUP_FAILURE_KEYS = ("plugin", "group", "distribution", "error")


def describe_altered(altered: Sequence[str], limit: int = 5) -> str:
    """``the judge was altered after start-up (...): X replaced by y; ... and N more``."""
    shown = "; ".join(altered[:limit])
    more = f"; and {len(altered) - limit} more" if len(altered) > limit else ""
    return ("the judge was altered after start-up, so nothing here is judged (a backend's "
            f"code ran in the judging process): {shown}{more}")


def startup_failures(plugins: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The general plugins whose hook raised (``environment.plugins``), as the report's
    ``startup_failures``: production's loaders call each hook unguarded, so a process
    with such a plugin installed fails at start-up.  A plugin that fails to *import*
    is not one: production logs it and goes on without it."""
    if not plugins:
        return []
    return [{"plugin": p.get("name"), "group": p.get("group"), "distribution": p.get("dist"),
             "error": p.get("error")}
            for p in plugins.get("plugins", []) if p.get("status") == "hook-failed"]


def describe_startup_failure(failure: Mapping[str, Any]) -> str:
    return (f"plugin {failure['plugin']} ({failure['group']}, "
            f"{failure['distribution'] or 'no distribution'}) hook raised {failure['error']}")


def summarize(results: Sequence[Mapping[str, Any]], strict: bool) -> dict[str, Any]:
    """Counts per status and per clause, plus the nodeids that block qualification."""
    by_status = dict.fromkeys(STATUSES, 0)
    by_clause: dict[str, dict[str, int]] = {}
    for r in results:
        by_status[r["status"]] += 1
        by_clause.setdefault(r["clause"], dict.fromkeys(STATUSES, 0))[r["status"]] += 1
    return {
        "strict": strict,
        "total": len(results),
        "by_status": by_status,
        "by_clause": {c: by_clause[c] for c in sorted(by_clause, key=clause_sort_key)},
        "blocking": [r["nodeid"] for r in results if _blocks(r, strict)],
    }


def run_record(
    *, run_id: str | None = None, started: str | None = None, duration_s: float = 0.0,
    interruption: str | None = None,
) -> dict[str, Any]:
    """Identity and end of one run: ``merge`` tells two runs on one host apart by ``id``."""
    return {
        "id": run_id or uuid.uuid4().hex,
        "started": started or now_iso(),
        "duration_s": round(float(duration_s), 3),
        "interruption": interruption,
    }


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def selection_record(
    *, keyword: str | None = None, markexpr: str | None = None, paths: Iterable[str] = (),
    backends: Iterable[str] = (), excluded_backends: Iterable[str] = (),
    collected: int | None = None, selected: int | None = None,
) -> dict[str, Any]:
    """What part of the matrix a run selected; ``collected`` counts suite tests before
    ``-k`` / ``-m`` / ``--deselect``, ``selected`` after (None: not known)."""
    deselected = None if collected is None or selected is None else collected - selected
    return {
        "keyword": keyword or None,
        "markexpr": markexpr or None,
        "paths": [str(p) for p in paths],
        "backends": list(backends),
        "excluded_backends": sorted(excluded_backends),
        "collected": collected,
        "selected": selected,
        "deselected": deselected,
    }


def ran_count(results: Iterable[Mapping[str, Any]]) -> int:
    """Suite tests with at least one result (a test may have a call and a teardown row)."""
    return len({r["nodeid"] for r in results})


def left_out(selection: Mapping[str, Any] | None) -> list[str]:
    """What the selection left out of the full matrix, one phrase each; empty when complete."""
    if selection is None:
        return ["the selection was not recorded"]
    notes = []
    collected, deselected = selection["collected"], selection["deselected"]
    filters = [f"-k {selection['keyword']!r}" if selection["keyword"] else "",
               f"-m {selection['markexpr']!r}" if selection["markexpr"] else ""]
    how = " and ".join(f for f in filters if f) or "deselection (--deselect, --lf or a plugin)"
    if collected is None or selection["selected"] is None:
        notes.append("the number of suite tests collected was not reported")
    elif deselected:
        notes.append(f"{how} deselected {deselected} of {collected} suite tests")
    elif selection["keyword"] or selection["markexpr"]:
        notes.append(f"{how} given (deselected none, but the selection is filtered)")
    if selection["paths"]:
        notes.append("collection narrowed to " + ", ".join(selection["paths"]))
    excluded = selection["excluded_backends"]
    if excluded:
        notes.append(f"--kv-backend left out {len(excluded)} backend(s): {', '.join(excluded)}")
    return notes


def interruption_of(run: Mapping[str, Any], selection: Mapping[str, Any] | None,
                    results: Sequence[Mapping[str, Any]]) -> str | None:
    """Why the run did not finish: recorded, or selected tests without a result."""
    if run.get("interruption"):
        return str(run["interruption"])
    selected = selection.get("selected") if selection is not None else None
    if selected is not None:
        ran = ran_count(results)
        if ran < selected:
            return f"{selected - ran} of {selected} selected suite tests did not run"
    return None


def scope_of(selection: Mapping[str, Any] | None) -> list[str] | None:
    """The backends a backend-scoped run speaks for (``--kv-backend`` left others out);
    None for a whole-deployment run."""
    if selection is None or not selection.get("excluded_backends"):
        return None
    return list(selection["backends"])


def in_scope(results: Sequence[Mapping[str, Any]],
             scope: Sequence[str] | None) -> list[Mapping[str, Any]]:
    """The results a verdict is judged on: all of them for a whole deployment; for a
    backend-scoped run, the named backends' ``backend`` results, and the failures of the
    stack's guards on them that follow from a failed declaration
    (:func:`~pytest_kvconform.report.result_notes.dependents`)."""
    if scope is None:
        return list(results)
    found = dependents(results)
    return [r for r in results if r.get("backend") in scope
            and (_subject(r) == "backend" or r["nodeid"] in found)]


def _subject(result: Mapping[str, Any]) -> str | None:
    return result.get("subject") or clauses.subject_of(test_function(str(result["nodeid"])))


def not_checked(results: Iterable[Mapping[str, Any]], *,
                declared_ok: bool) -> list[dict[str, Any]]:
    """The backends none of whose own results ran, each as an uncovered entry of scope
    ``backend`` (:func:`describe_uncovered` words it: ``X: not checked (...)``).

    A backend's own results are those of its ``backend`` subject; it is not checked when
    every one was skipped, not all of them as not applicable (a selection holding nothing
    applicable to it checked nothing, and claims nothing).  With ``declared_ok`` (a whole
    deployment), a backend whose every skip a known finding declares is left out: the
    deployment's known findings say it cannot run here.
    """
    rows: dict[str, list[Mapping[str, Any]]] = {}
    for r in results:
        if r.get("backend") and _subject(r) == "backend":
            rows.setdefault(str(r["backend"]), []).append(r)
    found = []
    for name in sorted(rows):
        mine = rows[name]
        if not all(r.get("status") == "skipped" for r in mine) or \
                not any(_unchecked(r) for r in mine):
            continue
        if declared_ok and all(r.get("xfail") for r in mine):
            continue
        found.append(_uncovered_entry("backend", [r for r in mine if _unchecked(r)]))
    return found


def only_not_checked(results: Sequence[Mapping[str, Any]], strict: bool,
                     selection: Mapping[str, Any] | None, run: Mapping[str, Any],
                     startup: Sequence[Mapping[str, Any]] = (),
                     altered: Sequence[str] = ()) -> bool:
    """Whether the verdict is ``not qualified`` for backends that were not checked and for
    nothing else (no failure, error, xpass or unforgiven skip of another backend or of
    the stack; no start-up failure, no interruption; in strict mode, nothing left out of
    the matrix): the run exits :data:`EXIT_NOT_CHECKED`."""
    scope = scope_of(selection)
    judged = in_scope(results, scope)
    unchecked = {e["backend"] for e in not_checked(judged, declared_ok=scope is None)}
    if not unchecked or startup or altered or interruption_of(run, selection, results):
        return False
    if strict and left_out(_scoped_selection(selection)):
        return False
    return not any(_blocks(r, strict) for r in judged if r.get("backend") not in unchecked)


def _scoped_selection(selection: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """What a backend-scoped run left out, less the backends it was not asked about."""
    if scope_of(selection) is None or selection is None:
        return selection
    return {**selection, "excluded_backends": []}


def judge(
    results: Sequence[Mapping[str, Any]], strict: bool, selection: Mapping[str, Any] | None,
    run: Mapping[str, Any], startup: Sequence[Mapping[str, Any]] = (),
    altered: Sequence[str] = (),
) -> tuple[str, list[dict[str, Any]]]:
    """The report's verdict and uncovered entries: results, start-up, completeness,
    interruption; for a backend-scoped run, of its backends' own results (:func:`in_scope`).

    ``interrupted`` > ``not qualified`` > ``partial`` > ``qualified``; ``startup``
    (:func:`startup_failures`) makes any finished run ``not qualified``, and so do a
    judge ``altered`` after start-up and a backend that was not checked
    (:func:`not_checked`).
    """
    scope = scope_of(selection)
    judged = in_scope(results, scope)
    verdict, uncovered = compute_verdict(judged, strict)
    if interruption_of(run, selection, results):
        verdict = "interrupted"
    elif startup or altered or not_checked(judged, declared_ok=scope is None):
        verdict = "not qualified"
    elif scope is not None and not judged:  # nothing of the named backends' own was checked
        verdict = "partial"
    elif verdict == "qualified" and left_out(_scoped_selection(selection)):
        verdict = "partial"
    return verdict, uncovered


def stack_record(results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The serving stack's results told apart: its known findings (xfailed), its
    regressions (failed or errored with no known finding describing them), and known
    findings that no longer fail (xpassed), each a list of nodeids; and the same by
    finding (:func:`finding_lifetimes`)."""
    stack = stack_results(results)
    return {
        "results": len(stack),
        "known": sorted(str(r["nodeid"]) for r in stack if r.get("status") == "xfailed"),
        "regressions": sorted(str(r["nodeid"]) for r in stack if r.get("status") in _FAILED),
        "fixed": sorted(str(r["nodeid"]) for r in stack if r.get("status") == "xpassed"),
        "findings": finding_lifetimes(stack),
    }


def stack_results(results: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The stack's results (its subject), less the failures that follow from a backend's
    broken declaration (:func:`~pytest_kvconform.report.result_notes.dependents`)."""
    found = dependents(results)
    return [r for r in results if _subject(r) == "stack" and r["nodeid"] not in found]


# The keys of the stack record's ``findings``, in the order they are written.
FINDINGS_KEYS = ("persists", "fixed", "new")


def finding_lifetimes(results: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
    """What became of each known finding in ``results`` (the stack's, for its record; a
    whole deployment's, for a matrix leg), and what no finding describes:

    * ``persists``: the known findings (their entries' ids, ``vllm_omni_0_30.toml:1
      */KV-L8/test_kv_l8_alias``) that still show as they describe: a result xfailed, or
      a skip the entry declares;
    * ``fixed``: those whose every result here passes (xpassed), none showing as described;
    * ``new``: the failures no known finding describes (nodeids).

    A finding whose results partly fail and partly pass persists; its passing results are
    xpasses, which strict mode refuses."""
    persists = {str(r["xfail"]) for r in results
                if r.get("status") in ("xfailed", "skipped") and r.get("xfail")}
    passing = {str(r["xfail"]) for r in results
               if r.get("status") == "xpassed" and r.get("xfail")}
    return {
        "persists": sorted(persists),
        "fixed": sorted(passing - persists),
        "new": sorted(str(r["nodeid"]) for r in results if r.get("status") in _FAILED),
    }


def stack_text(results: Sequence[Mapping[str, Any]]) -> str:
    """``7 known findings persist (47 results), 0 fixed, 0 new`` or ``..., 1 new: KV-S1
    test_kv_s1[LBNHC-bf16_h8] (no known finding describes it)``: the stack's line, after its
    versions."""
    rec = stack_record(results)
    lives = rec["findings"]
    by_id = {str(r["nodeid"]): r for r in results}
    n = len(lives["persists"])
    known = sum(1 for r in stack_results(results) if r.get("xfail") in lives["persists"]
                and r.get("status") in ("xfailed", "skipped"))
    notes = [f"{n} known finding{' persists' if n == 1 else 's persist'} "
             f"({known} result{'s' if known != 1 else ''})"]
    fixed = len(lives["fixed"])
    notes.append(f"{fixed} fixed" + (" (remove their entries, or narrow their versions): "
                                     + "; ".join(lives["fixed"]) if fixed else ""))
    new = len(lives["new"])
    notes.append(f"{new} new" + (" (no known finding describes them): "
                                 + named_tests([by_id[i] for i in lives["new"]]) if new else ""))
    still = [i for i in rec["fixed"] if str(by_id[i].get("xfail")) in lives["persists"]]
    if still:
        notes.append("known findings that no longer fail on some results (narrow their "
                     "entries): " + named_tests([by_id[i] for i in still]))
    return ", ".join(notes)


# The exit status of a backend-scoped run whose backends conform while the stack shows
# what its known findings do not describe (pytest's own statuses are 0-5).
EXIT_STACK_REGRESSED = 6
# The exit status of a run whose only fault is a backend that was not checked (none of its
# own results ran: it does not import, or every clause was skipped), strict or not.
EXIT_NOT_CHECKED = 7


def stack_differs(results: Sequence[Mapping[str, Any]], strict: bool) -> bool:
    """Whether the stack shows what its known findings do not describe: a regression, or
    (strict) a known finding that no longer fails."""
    rec = stack_record(results)
    return bool(rec["regressions"] or (strict and rec["fixed"]))


def bites(results: Sequence[Mapping[str, Any]], backend: str) -> list[str]:
    """The stack's findings on ``backend``'s own deployment (its guards that failed or are
    known to fail there): a defect production shows whenever this backend serves."""
    mine = [r for r in results if r.get("backend") == backend and _subject(r) == "stack"
            and r.get("status") in ("xfailed", *_FAILED)]
    tests: dict[str, list[Mapping[str, Any]]] = {}
    for r in mine:
        tests.setdefault(test_function(str(r["nodeid"])), []).append(r)
    out = []
    for test, rows in tests.items():
        known = next((str(r["xfail"]) for r in rows if r.get("xfail")), None)
        out.append(f"{rows[0]['clause']} {test}" + (f" (known: {known})" if known else
                                                      " (a regression)"))
    return out


def verdict_text(verdict: str, uncovered: Sequence[Mapping[str, Any]],
                 selection: Mapping[str, Any] | None, run: Mapping[str, Any],
                 results: Sequence[Mapping[str, Any]],
                 startup: Sequence[Mapping[str, Any]] = (),
                 altered: Sequence[str] = ()) -> str:
    """One line: the verdict and what it rests on (a judge altered after start-up, what
    production could not start, what was left out or unchecked, why it stopped)."""
    notes = verdict_notes(verdict, uncovered, selection, run, results, startup, altered)
    return verdict + (f" ({'; '.join(notes)})" if notes else "")


def verdict_notes(verdict: str, uncovered: Sequence[Mapping[str, Any]],
                  selection: Mapping[str, Any] | None, run: Mapping[str, Any],
                  results: Sequence[Mapping[str, Any]],
                  startup: Sequence[Mapping[str, Any]] = (),
                  altered: Sequence[str] = ()) -> list[str]:
    """What the verdict rests on, one note each, root causes first: the verdict line's
    parenthesis (:func:`verdict_text`), and the reasons a report page lists under it."""
    notes = []
    if altered:
        notes.append(describe_altered(altered))
    if verdict == "interrupted":
        notes.append(f"interrupted: {interruption_of(run, selection, results)}")
    if startup:
        notes.append("production would not start: " +
                     "; ".join(describe_startup_failure(f) for f in startup))
    scope = scope_of(selection)
    results = in_scope(results, scope)
    if scope is not None and not results:
        notes.append(f"no result of {', '.join(scope)}'s own ran")
    unchecked = not_checked(results, declared_ok=scope is None)
    notes += [describe_uncovered(e) for e in unchecked]
    named = {e["backend"] for e in unchecked}
    uncovered = [e for e in uncovered if not (e["scope"] == "backend" and e["backend"] in named)]
    notes += result_notes(results)
    missing = left_out(_scoped_selection(selection))
    if missing and verdict != "qualified":
        notes.append("left out: " + "; ".join(missing))
    if uncovered:
        notes.append("unchecked: " + "; ".join(describe_uncovered(e) for e in uncovered))
    faulted = [r for r in results if r.get("seeded_fault")]
    if faulted:
        names = ", ".join(sorted({str(r["seeded_fault"]) for r in faulted}))
        notes.append(f"seeded worker fault {names} in {len(faulted)} result(s), which speak "
                     "for the fault, not the backend")
    errors = sorted({r.get("error_kind") or "harness" for r in results
                     if r.get("status") == "error" and not r.get("caused_by")})
    if errors:
        notes.append(f"harness errors ({', '.join(errors)}), not blamed on any backend")
    own = [r for r in results if r.get("status") == "error" and r.get("caused_by")]
    if own:
        notes.append(backend_faults_text(own))
    return notes


def backend_faults_text(errors: Sequence[Mapping[str, Any]]) -> str:
    """``3 errors the backend's own code caused (timeout in HANGING:
    HANGING.indexes_kv_by_block_stride() ...)``: errors a call into a backend's class
    caused, which count for that backend."""
    by_kind: dict[str, set[str]] = {}
    for r in errors:
        by_kind.setdefault(str(r.get("error_kind") or "harness"), set()).add(
            f"{r.get('backend')}: {r['caused_by']}")
    parts = [f"{kind} in {'; '.join(sorted(calls))}" for kind, calls in sorted(by_kind.items())]
    n = len(errors)
    return (f"{n} error{'s' if n != 1 else ''} the backend's own code caused "
            f"({', '.join(parts)})")
