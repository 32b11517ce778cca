"""A new clause is two edits: a check function and a table row; the suite then runs it."""

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
                   (clauses.Check("tests.test_suite_table:check_kv_l9", ("backend", "device")),)),
    clauses.Clause("KV-N6", "A seeded case clause", "case",
                   (clauses.Check("tests.test_suite_table:check_kv_n6", ("case",)),),
                   cases=clauses.one_rank_one_group),
)


def test_every_row_of_the_real_table_has_a_hand_written_test() -> None:
    from pytest_kvconform.suite import test_table

    assert test_table.GENERATED == []


def test_a_row_becomes_a_test_with_its_fixtures_and_cases(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    from pytest_kvconform.suite import test_table

    monkeypatch.setattr(clauses, "CLAUSES", (*clauses.CLAUSES, *NEW_ROWS))
    namespace: dict[str, object] = {}
    assert test_table.generate(namespace) == ["test_kv_l9", "test_kv_n6"]
    n6 = namespace["test_kv_n6"]
    assert [m.args[0] for m in n6.pytestmark] == [clauses.one_rank_one_group]  # type: ignore[attr-defined]
    from _pytest.compat import getfuncargnames

    assert getfuncargnames(n6) == ("request", "kv_case")
    assert getfuncargnames(namespace["test_kv_l9"]) == ("request", "kv_backend", "kv_device")


TABLE = "pytest_kvconform.suite.test_table"


@pytest.fixture
def seeded_rows(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The clause table with :data:`NEW_ROWS`, and the suite's table module built from it,
    for one test only (the shipped table module is back afterwards)."""
    monkeypatch.setattr(clauses, "CLAUSES", (*clauses.CLAUSES, *NEW_ROWS))
    monkeypatch.setattr(clauses, "BY_ID", {c.id: c for c in clauses.CLAUSES})
    before = sys.modules.pop(TABLE, None)
    yield
    sys.modules.pop(TABLE, None)
    vars(pytest_kvconform.suite).pop("test_table", None)
    if before is not None:
        sys.modules[TABLE] = before
        pytest_kvconform.suite.test_table = before  # type: ignore[attr-defined]


@needs_omni
@pytest.mark.usefixtures("seeded_rows")
def test_the_suite_runs_a_new_row_and_reports_its_failure(kv_run) -> None:
    result = kv_run("--kv-backend", "TORCH_SDPA", "--kv-device", "cpu", "-k", "kv_l9 or kv_n6")
    one_rank_one_group = 8  # shipped cases the predicate selects (one of them padded)
    result.assert_outcomes(passed=1 + one_rank_one_group - 1, failed=1)
    result.stdout.fnmatch_lines([
        "KV-N6 violated ?case=padded?: padded pages are not planned",
        "FAILED kvconform/test_table.py::test_kv_n6?padded? - *",
    ])
    # The matrix has the new clauses as columns: the backend's row and the upstream row.
    result.stdout.fnmatch_lines(["backend*L9 N6", "TORCH_SDPA .", "(upstream)*F"])
