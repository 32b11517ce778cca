"""A clause failure reads as its verdict (session/failure_repr.py); --tb=long as pytest's."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

import pytest_kvconform.suite
from pytest_kvconform.contract import clauses
from tests.conftest import needs_omni
from tests.test_suite_table import NEW_ROWS

TABLE = "pytest_kvconform.suite.test_table"


@pytest.fixture
def seeded_rows(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The table with test_suite_table's seeded rows, for this test only."""
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
@pytest.mark.parametrize("tb", [None, "long"], ids=["default", "tb_long"])
def test_a_clause_failure_reads_as_its_verdict_unless_a_traceback_is_asked_for(
        seeded_rows: None, kv_run, tb: str | None) -> None:
    result = kv_run("--kv-backend", "TORCH_SDPA", "--kv-device", "cpu", "-k", "kv_n6",
                    "-rf", *(["--tb", tb] if tb else []))
    result.assert_outcomes(passed=7, failed=1)
    verdict = "KV-N6 violated ?case=padded?: padded pages are not planned"
    summary = "FAILED test_table.py::test_kv_n6?padded? - *"
    if tb is None:
        result.stdout.fnmatch_lines([
            "_*_ test_kv_n6?padded? _*_", verdict, "  expected: 15", "  actual:   16",
            "*test_suite_table.py:*: in check_kv_n6 (--tb=long shows the traceback)",
            summary])
        result.stdout.no_fnmatch_line("*run_check(*")
    else:
        result.stdout.fnmatch_lines(["*run_check(*", f"E * {verdict}", summary])
        result.stdout.no_fnmatch_line("*--tb=long shows the traceback*")
