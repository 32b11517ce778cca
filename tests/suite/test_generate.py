"""A table row is a suite test: each family's module generates its rows' tests, in order.

(A new clause's whole path, its contract text and seeded fault included, is
``tests/end_to_end/test_new_clause.py``'s.)
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

import pytest_kvconform.suite
from pytest_kvconform.contract import clauses
from pytest_kvconform.contract.outcomes import ClauseFailure
from pytest_kvconform.contract.records import BackendUnderTest, Case
from tests.conftest import needs_omni

# The suite modules are imported outside --kv-conformance, where kv_cases is not registered.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnknownMarkWarning")


def check_kv_n6(case: Case) -> None:
    """A seeded clause: holds for every case but ``padded``."""
    if case.page_size_padded is not None:
        raise ClauseFailure("KV-N6", "padded pages are not planned", case=case.id,
                            expected=case.num_pages - 1, actual=case.num_pages)


def check_kv_l9(backend: BackendUnderTest, device: str) -> None:
    if backend.name == "TORCH_SDPA" and device == "cpu":
        return
    raise ClauseFailure("KV-L9", f"unexpected {backend.name} on {device}", backend=backend.name)


NEW_ROWS = (
    clauses.Clause("KV-L9", "A seeded backend clause", "backend",
                   (clauses.Check("tests.suite.test_generate:check_kv_l9",
                                  ("backend", "device")),)),
    clauses.Clause("KV-N6", "A seeded case clause", "case",
                   (clauses.Check("tests.suite.test_generate:check_kv_n6", ("case",)),),
                   cases=clauses.one_rank_one_group),
)


def test_every_family_has_a_suite_module_so_the_fallback_generates_nothing() -> None:
    from pytest_kvconform.suite import test_table

    assert test_table.GENERATED == []
    assert {c.suite_module for c in clauses.CLAUSES} == set(clauses.FAMILY_MODULES.values())


def test_a_row_becomes_a_test_with_its_fixtures_and_cases(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    from pytest_kvconform.suite import generate

    monkeypatch.setattr(clauses, "CLAUSES", (*clauses.CLAUSES, *NEW_ROWS))
    layout: dict[str, object] = {"__name__": "pytest_kvconform.suite.test_layout",
                                 "test_kv_l7": check_kv_l9}
    added = generate.generate(layout)
    assert added[-1] == "test_kv_l9" and "test_kv_l7" not in added
    assert [n for n in layout if n.startswith("test_")] == [
        n for n, (row, _) in clauses.check_names().items() if row.family == "L"]
    assert layout["test_kv_l7"] is check_kv_l9  # a hand-written test is kept, in its place
    nullblock: dict[str, object] = {"__name__": "pytest_kvconform.suite.test_nullblock"}
    assert generate.generate(nullblock)[-1] == "test_kv_n6"
    n6 = nullblock["test_kv_n6"]
    marks = n6.pytestmark  # type: ignore[attr-defined]
    assert [m.args[0] for m in marks if m.name == "kv_cases"] == [clauses.one_rank_one_group]
    from _pytest.compat import getfuncargnames

    assert getfuncargnames(n6) == ("request", "kv_case")
    assert getfuncargnames(layout["test_kv_l9"]) == ("request", "kv_backend", "kv_device")
    assert n6.__module__ == "pytest_kvconform.suite.test_nullblock"  # type: ignore[attr-defined]


SUITE = [f"pytest_kvconform.suite.{m}" for m in (*clauses.FAMILY_MODULES.values(), "test_table")]


@pytest.fixture
def seeded_rows(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The clause table with :data:`NEW_ROWS`, and the suite's modules built from it, for
    one test only (the shipped suite modules are back afterwards)."""
    monkeypatch.setattr(clauses, "CLAUSES", (*clauses.CLAUSES, *NEW_ROWS))
    monkeypatch.setattr(clauses, "BY_ID", {c.id: c for c in clauses.CLAUSES})
    before = {name: sys.modules.pop(name, None) for name in SUITE}
    yield
    for name, module in before.items():
        sys.modules.pop(name, None)
        vars(pytest_kvconform.suite).pop(name.rpartition(".")[2], None)
        if module is not None:
            sys.modules[name] = module
            setattr(pytest_kvconform.suite, name.rpartition(".")[2], module)


@needs_omni
@pytest.mark.usefixtures("seeded_rows")
def test_the_suite_runs_a_new_row_and_reports_its_failure(kv_run) -> None:
    result = kv_run("--kv-backend", "TORCH_SDPA", "--kv-device", "cpu", "-k", "kv_l9 or kv_n6")
    one_rank_one_group = 8  # shipped cases the predicate selects (one of them padded)
    result.assert_outcomes(passed=1 + one_rank_one_group - 1, failed=1)
    result.stdout.fnmatch_lines([
        "KV-N6 violated ?case=padded?: padded pages are not planned",
        "FAILED kvconform/test_nullblock.py::test_kv_n6?padded? - *",
    ])
    # The matrix has the new clauses as columns: the backend's row and the upstream row.
    result.stdout.fnmatch_lines(["backend*L9 N6", "TORCH_SDPA .", "(upstream)*F"])
