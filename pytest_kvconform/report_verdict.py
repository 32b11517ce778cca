"""The verdict: which results block qualification, and whether the run covered the matrix.

Kept apart from the schema and the renderings so the strict rule is read in one place:
the session prints it, :func:`~pytest_kvconform.report.build_report` records it,
validation recomputes it, and the Markdown explains it.  Stdlib only.

Results alone (:func:`compute_verdict`):

* non-strict: qualified iff at least one result ran and none failed or errored
  (an xpass or a skip does not disqualify);
* strict (``--kv-strict``): additionally every xpass disqualifies, and every
  skip unless the clause table forgives its kind for its clause
  (:func:`pytest_kvconform.clauses.skip_forgiven`) or an xfails entry declares it
  (``xfail`` on the result).

The report's verdict (:func:`judge`) also needs the whole matrix to have run: the
``selection`` record (``-k``, ``-m``, narrowed paths, backends left out by
``--kv-backend``, suite tests collected / selected / deselected) and the ``run``
record (``interruption``).  A run that was interrupted, or in which a selected
test has no result, is ``interrupted``; a run that left any part of the matrix
out is ``partial``; a failure or error makes it ``not qualified`` (interrupted
still wins: nothing about an unfinished run is certified).

Clauses with a hardware skip are listed as ``uncovered`` in both modes.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pytest_kvconform import clauses
from pytest_kvconform.clauses import clause_sort_key, skip_forgiven

STATUSES = ("passed", "failed", "skipped", "xfailed", "xpassed", "error")
VERDICTS = ("qualified", "not qualified", "partial", "interrupted")

# Every kind some clause forgives (the table says which clause forgives which).
FORGIVEN_SKIP_KINDS = tuple(sorted(k.value for k in clauses.FORGIVEN_SKIP_KINDS))


def _blocks(result: Mapping[str, Any], strict: bool) -> bool:
    status = result.get("status")
    if status in ("failed", "error"):
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
) -> tuple[str, list[str]]:
    """``("qualified" | "not qualified", uncovered clauses)``; see the module docstring.

    An empty run is never qualified: nothing was checked.
    """
    results = list(results)
    qualified = bool(results) and not any(_blocks(r, strict) for r in results)
    uncovered = {
        r["clause"]
        for r in results
        if r.get("status") == "skipped" and r.get("skip_kind") == "hardware"
    }
    return ("qualified" if qualified else "not qualified"), sorted(uncovered, key=clause_sort_key)


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


def judge(
    results: Sequence[Mapping[str, Any]], strict: bool, selection: Mapping[str, Any] | None,
    run: Mapping[str, Any],
) -> tuple[str, list[str]]:
    """The report's verdict and uncovered clauses: results, completeness, interruption.

    ``interrupted`` > ``not qualified`` > ``partial`` > ``qualified``.
    """
    verdict, uncovered = compute_verdict(results, strict)
    if interruption_of(run, selection, results):
        verdict = "interrupted"
    elif verdict == "qualified" and left_out(selection):
        verdict = "partial"
    return verdict, uncovered


def verdict_text(verdict: str, uncovered: Sequence[str], selection: Mapping[str, Any] | None,
                 run: Mapping[str, Any], results: Sequence[Mapping[str, Any]]) -> str:
    """One line: the verdict and what it rests on (what was left out, why it stopped)."""
    notes = []
    if verdict == "interrupted":
        notes.append(f"interrupted: {interruption_of(run, selection, results)}")
    missing = left_out(selection)
    if missing and verdict != "qualified":
        notes.append("left out: " + "; ".join(missing))
    if uncovered:
        notes.append(f"hardware could not cover: {', '.join(uncovered)}")
    errors = sorted({r.get("error_kind") or "harness" for r in results
                     if r.get("status") == "error"})
    if errors:
        notes.append(f"harness errors ({', '.join(errors)}), not blamed on any backend")
    return verdict + (f" ({'; '.join(notes)})" if notes else "")

