"""KV-N: null-block sizing, per spec case of a single cache group."""

from __future__ import annotations

import pytest

from pytest_kvconform.checks import nullblock
from pytest_kvconform.contract import clauses
from pytest_kvconform.contract.records import Case
from pytest_kvconform.suite.check_call import run_check

# ``with_args``: a named function as the only argument would be taken as the decorated test.
_one_rank_one_group = clauses.one_rank_one_group
_one_group = clauses.one_group


@pytest.mark.kv_cases.with_args(_one_rank_one_group)
def test_kv_n1(request: pytest.FixtureRequest, kv_case: Case) -> None:
    """KV-N1 the pool never hands out the null block."""
    run_check(request, nullblock.check_kv_n1, kv_case)


@pytest.mark.kv_cases.with_args(_one_rank_one_group)
def test_kv_n2(request: pytest.FixtureRequest, kv_case: Case) -> None:
    """KV-N2 P pages of memory: P blocks, P-1 planned."""
    run_check(request, nullblock.check_kv_n2, kv_case)


@pytest.mark.kv_cases.with_args(_one_rank_one_group)
def test_kv_n3(request: pytest.FixtureRequest, kv_case: Case) -> None:
    """KV-N3 num_gpu_blocks_override = P: the same numbers."""
    run_check(request, nullblock.check_kv_n3, kv_case)


@pytest.mark.kv_cases.with_args(_one_rank_one_group)
def test_kv_n4(request: pytest.FixtureRequest, kv_case: Case) -> None:
    """KV-N4 fewer than two pages refused."""
    run_check(request, nullblock.check_kv_n4, kv_case)


@pytest.mark.kv_cases.with_args(_one_group)
def test_kv_n5(request: pytest.FixtureRequest, kv_case: Case) -> None:
    """KV-N5 several ranks take the smallest num_blocks (at least three ranks)."""
    run_check(request, nullblock.check_kv_n5, kv_case)
