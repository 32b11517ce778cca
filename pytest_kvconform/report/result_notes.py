"""The results that speak against qualification, in words, by control (suite test).

A backend whose declaration (:data:`~pytest_kvconform.contract.clauses.ROOT_CLAUSE`)
failed is named first, with the failures that follow from it (:func:`dependents`); then
failures (a known finding's test failing another way named so), xpasses that are no fix
because a neighbouring control failed (:func:`not_a_fix`), and xpasses.  Apart from
:mod:`~pytest_kvconform.report.verdict`, which judges: this only words the results for
the verdict line and the Markdown, and tells which failures follow from a failed
declaration.  Stdlib only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pytest_kvconform.contract import clauses

_SHOWN_PARAMS = 3  # parametrisations named per test before "+N more"
_SHOWN_TESTS = 6  # tests named per kind of note before "and N more tests"


def test_function(nodeid: str) -> str:
    """``.../test_layout.py::test_kv_l8_alias[TORCH_SDPA]`` -> ``test_kv_l8_alias``."""
    return nodeid.rpartition("::")[2].partition("[")[0]


def _params(nodeid: str) -> str:
    return nodeid.rpartition("::")[2].partition("[")[2].removesuffix("]")


def not_a_fix(results: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
    """Each xpass (a known finding's test that passed) whose neighbouring control failed,
    with those controls' nodeids: a pass is a fix only while its controls hold.

    The controls come from the clause table (``Check.controls``); a control's result
    counts for the same backend (or need), case and layout, and a test that is its own
    control counts its other parametrisations (KV-L6's other need).
    """
    names = clauses.check_names()
    by_test: dict[str, list[Mapping[str, Any]]] = {}
    for r in results:
        by_test.setdefault(test_function(str(r["nodeid"])), []).append(r)
    found: dict[str, list[str]] = {}
    for r in results:
        if r.get("status") != "xpassed":
            continue
        test = test_function(str(r["nodeid"]))
        check = names.get(test)
        for control in check[1].controls if check is not None else ():
            for other in by_test.get(control, []):
                if (other["nodeid"] == r["nodeid"] or other.get("status") not in
                        ("failed", "error") or other.get("case") != r.get("case")
                        or other.get("layout") != r.get("layout")
                        or (control != test and other.get("backend") != r.get("backend"))):
                    continue
                found.setdefault(str(r["nodeid"]), []).append(str(other["nodeid"]))
    return found


def named_tests(results: Sequence[Mapping[str, Any]], *,
                why: Mapping[str, str] | None = None) -> str:
    """``KV-L8 test_kv_l8_alias[TORCH_SDPA, FLASH_ATTN, +8 more]``, one per test."""
    tests: dict[str, list[Mapping[str, Any]]] = {}
    for r in results:
        tests.setdefault(test_function(str(r["nodeid"])), []).append(r)
    parts = []
    for test, rows in list(tests.items())[:_SHOWN_TESTS]:
        params = [_params(str(r["nodeid"])) for r in rows]
        shown = ", ".join(p for p in params[:_SHOWN_PARAMS] if p)
        if len(params) > _SHOWN_PARAMS:
            shown += f", +{len(params) - _SHOWN_PARAMS} more"
        text = f"{rows[0].get('clause')} {test}" + (f"[{shown}]" if shown else "")
        if why is not None and why.get(str(rows[0]["nodeid"])):
            text += f" ({why[str(rows[0]['nodeid'])]})"
        parts.append(text)
    if len(tests) > _SHOWN_TESTS:
        parts.append(f"and {len(tests) - _SHOWN_TESTS} more tests")
    return ", ".join(parts)


def dependents(results: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """nodeid -> the root clause it depends on, for each failure of a backend whose
    declaration (:data:`~pytest_kvconform.contract.clauses.ROOT_CLAUSE`) failed.

    Every other result of a backend uses its declaration, so those failures follow from
    it: reported under it, not beside it.
    """
    results = list(results)
    root = clauses.ROOT_CLAUSE
    broken = {r.get("backend") for r in results if _declaration_failed(r)}
    return {str(r["nodeid"]): root for r in results
            if r.get("backend") in broken and r.get("clause") != root
            and r.get("status") == "failed"}


def _declaration_failed(result: Mapping[str, Any]) -> bool:
    """A backend's declaration failed (a harness error there is the harness's, not it)."""
    return (result.get("clause") == clauses.ROOT_CLAUSE and result.get("status") == "failed"
            and bool(result.get("backend")))


def with_dependencies(results: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The results, each failure that follows from a failed declaration naming it
    (``depends_on``)."""
    results = list(results)
    found = dependents(results)
    return [{**r, "depends_on": found.get(str(r["nodeid"]))} for r in results]


def _root_notes(results: Sequence[Mapping[str, Any]], found: Mapping[str, str]) -> list[str]:
    """``MY_ATTN: KV-L1 failed (root cause): test_kv_l1[MY_ATTN]; 28 results depend on it:
    ...``, one per backend whose declaration failed."""
    notes = []
    root = clauses.ROOT_CLAUSE
    for backend in sorted({str(r["backend"]) for r in results if _declaration_failed(r)}):
        mine = [r for r in results if r.get("backend") == backend]
        roots = [r for r in mine if _declaration_failed(r)]
        deps = [r for r in mine if r["nodeid"] in found]
        text = f"{backend}: {root} failed (root cause): {named_tests(roots)}"
        if deps:
            text += (f"; {len(deps)} result{'s' if len(deps) != 1 else ''} depend on it: "
                     + named_tests(deps))
        notes.append(text)
    return notes


def result_notes(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """The results that speak against qualification, by control (suite test): a failed
    declaration with what depends on it first, then failures (a known finding's test
    failing another way named so), xpasses that are no fix because a neighbouring control
    failed, and xpasses (a known finding now passes)."""
    found = dependents(results)
    notes = _root_notes(results, found)
    rest = [r for r in results if r["nodeid"] not in found and not _declaration_failed(r)]
    notes += _plain_notes(results, rest)
    return notes


def _plain_notes(results: Sequence[Mapping[str, Any]],
                 rest: Sequence[Mapping[str, Any]]) -> list[str]:
    notes = []
    differs = [r for r in rest if r.get("status") == "failed" and r.get("xfail")]
    for entry in sorted({str(r["xfail"]) for r in differs}):
        notes.append(f"differs from known finding {entry}: "
                     + named_tests([r for r in differs if r["xfail"] == entry]))
    failed = [r for r in rest if r.get("status") == "failed" and not r.get("xfail")
              and not r.get("seeded_fault")]
    if failed:
        notes.append("failed: " + named_tests(failed))
    broken = not_a_fix(results)
    if broken:
        why = {n: "its control " + ", ".join(f"{test_function(c)}[{_params(c)}]" for c in cs)
               + " failed" for n, cs in broken.items()}
        notes.append("passes, but no fix of its known finding: " +
                     named_tests([r for r in rest if r["nodeid"] in broken], why=why))
    fixed = [r for r in rest if r.get("status") == "xpassed" and r["nodeid"] not in broken]
    if fixed:
        notes.append("xpassed (a known finding no longer fails: remove its entry): "
                     + named_tests(fixed))
    return notes
