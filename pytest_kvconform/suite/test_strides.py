"""KV-S: stride derivation, per layout x spec case."""

from __future__ import annotations

import pytest

from pytest_kvconform.checks import strides
from pytest_kvconform.contract import clauses
from pytest_kvconform.contract.records import Case
from pytest_kvconform.suite.check_call import run_check

# The case predicates live in the clause table.
_plain = clauses.plain
_dense = clauses.dense
_split_or_padded = clauses.split_or_padded


@pytest.mark.kv_cases.with_args(_plain)
def test_kv_s1(request: pytest.FixtureRequest, kv_layout: str, kv_case: Case) -> None:
    """KV-S1 production KVCacheTensor == oracle."""
    run_check(request, strides.check_kv_s1, kv_layout, kv_case)


@pytest.mark.kv_cases.with_args(_dense)
def test_kv_s2(request: pytest.FixtureRequest, kv_layout: str, kv_case: Case,
               kv_device: str) -> None:
    """KV-S2 every view byte at the oracle address."""
    run_check(request, strides.check_kv_s2, kv_layout, kv_case, kv_device)


@pytest.mark.kv_cases.with_args(_dense)
def test_kv_s2_allocate(request: pytest.FixtureRequest, kv_layout: str, kv_case: Case,
                        kv_device: str) -> None:
    """KV-S2 through the planner and allocate_kv_cache."""
    run_check(request, strides.check_kv_s2_allocate, kv_layout, kv_case, kv_device)


@pytest.mark.kv_cases.with_args(_plain)
def test_kv_s3(request: pytest.FixtureRequest, kv_layout: str, kv_case: Case) -> None:
    """KV-S3 block- vs layer-outermost packing."""
    run_check(request, strides.check_kv_s3, kv_layout, kv_case)


@pytest.mark.kv_cases.with_args(_split_or_padded)
def test_kv_s4(request: pytest.FixtureRequest, kv_layout: str, kv_case: Case,
               kv_device: str) -> None:
    """KV-S4 kernel-block splitting and padded pages."""
    run_check(request, strides.check_kv_s4, kv_layout, kv_case, kv_device)


@pytest.mark.kv_cases.with_args(clauses.several_groups)
def test_kv_s5(request: pytest.FixtureRequest, kv_layout: str, kv_case: Case,
               kv_device: str) -> None:
    """KV-S5 several cache groups: one group's layers never alias."""
    run_check(request, strides.check_kv_s5, kv_layout, kv_case, kv_device)
