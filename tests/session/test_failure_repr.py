"""A clause failure reads as its verdict (session/failure_repr.py); --tb=long as pytest's."""

from __future__ import annotations

import pytest

from tests.conftest import needs_omni
from tests.suite.test_generate import seeded_rows  # noqa: F401  (the fixture, used by name)


@needs_omni
@pytest.mark.usefixtures("seeded_rows")
@pytest.mark.parametrize("tb", [None, "long"], ids=["default", "tb_long"])
def test_a_clause_failure_reads_as_its_verdict_unless_a_traceback_is_asked_for(
        kv_run, tb: str | None) -> None:
    result = kv_run("--kv-backend", "TORCH_SDPA", "--kv-device", "cpu", "-k", "kv_n6",
                    "-rf", *(["--tb", tb] if tb else []))
    result.assert_outcomes(passed=7, failed=1)
    verdict = "KV-N6 violated ?case=padded?: padded pages are not planned"
    summary = "FAILED kvconform/test_nullblock.py::test_kv_n6?padded? - *"
    if tb is None:
        result.stdout.fnmatch_lines([
            "_*_ test_kv_n6?padded? _*_", verdict, "  expected: 15", "  actual:   16",
            "*test_generate.py:*: in check_kv_n6 (--tb=long shows the traceback)",
            summary])
        result.stdout.no_fnmatch_line("*run_check(*")
    else:
        result.stdout.fnmatch_lines(["*run_check(*", f"E * {verdict}", summary])
        result.stdout.no_fnmatch_line("*--tb=long shows the traceback*")
