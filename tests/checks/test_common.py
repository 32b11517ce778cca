"""The one failure context every check builds its outcomes from (``checks.common``), and
what reads a backend's class where."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from pytest_kvconform.checks.arguments import Sources, arguments
from pytest_kvconform.checks.common import Problems, Where, declared_need, supports_paged_kv
from pytest_kvconform.contract import clauses
from pytest_kvconform.contract.outcomes import (
    ClauseFailure,
    ClauseSkip,
    ErrorKind,
    HarnessError,
    SkipKind,
)
from pytest_kvconform.contract.records import BackendUnderTest, Case
from pytest_kvconform.workers import budget, isolated
from tests.conftest import needs_omni


def test_a_failure_names_the_clause_and_parametrisation() -> None:
    where = Where("KV-S1", case=Case(id="c1", file="f"), layout="LBNHC")
    failure = where.fail_at("vllm-omni build_kv_cache_tensor", "KVCacheTensor.size differs",
                            expected=1, actual=2)
    assert str(failure) == ("KV-S1 violated [case=c1, layout=LBNHC]: vllm-omni "
                            "build_kv_cache_tensor: KVCacheTensor.size differs\n"
                            "  expected: 1\n  actual:   2")
    assert where.fail("x", layout="BLNHC").layout == "BLNHC"
    skip = where.skip("no GPU", SkipKind.HARDWARE)
    assert (skip.clause, skip.reason, skip.kind) == ("KV-S1", "no GPU", SkipKind.HARDWARE)


def test_a_harness_error_keeps_its_class_and_kind_and_gains_the_context() -> None:
    where = Where("KV-A3", backend="TORCH_SDPA", case=Case(id="c1", file="f"))
    error = where.harness(HarnessError("boom"), "adopting")
    assert type(error) is HarnessError and error.kind is ErrorKind.HARNESS
    assert str(error) == ("KV-A3 [backend=TORCH_SDPA, case=c1]: harness error (harness) "
                          "while adopting: boom")


def test_problems_read_as_one_failure_a_single_one_as_a_plain_failure() -> None:
    where = Where("KV-L3", backend="B")
    Problems(where).raise_any()  # none: nothing raised
    one = Problems(where)
    one.add("pinned LBHNC, but resolution returned another layout", layout="LBHNC",
            expected="LBHNC", actual="BLHNC")
    with pytest.raises(ClauseFailure) as single:
        one.raise_any()
    plain = where.fail("pinned LBHNC, but resolution returned another layout",
                       layout="LBHNC", expected="LBHNC", actual="BLHNC")
    assert str(single.value) == str(plain)
    one.add("pinned LBNHC, but resolution changed it", layout="LBNHC", expected=1, actual=2)
    with pytest.raises(ClauseFailure) as several:
        one.raise_any()
    assert several.value.detail == ("pinned LBHNC, but resolution returned another layout; "
                                    "pinned LBNHC, but resolution changed it")
    assert (several.value.layout, several.value.expected) == ("LBHNC", "LBHNC")


# --- what reads the backend's class, and where -----------------------------------------------

_JUDGE = os.getpid()


class _Trapped(type):
    """A class whose every attribute read in the judging process raises: what reads it
    there would run the backend's code (a metaclass is code too)."""

    def __getattribute__(cls, name: str) -> Any:
        if os.getpid() == _JUDGE and not name.startswith("__"):
            raise AssertionError(f"the judging process read {name!r} off the backend's class")
        return super().__getattribute__(name)


class _TrappedBackend(metaclass=_Trapped):
    supports_paged_kv = True

    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        return False


@pytest.fixture
def trapped() -> Iterator[BackendUnderTest]:
    isolated.forget()
    yield BackendUnderTest("TRAPPED", "tests:_TrappedBackend", "hook", cls=_TrappedBackend)
    isolated.forget()


def test_the_declaration_and_paged_support_are_read_in_a_child_once(
        trapped: BackendUnderTest) -> None:
    with budget.per_test(60):
        assert declared_need("KV-A1", trapped) is False
        assert supports_paged_kv("KV-A1", trapped) is True  # the same read, kept


@needs_omni
@pytest.mark.parametrize("name", sorted(n for n, (_, check) in clauses.check_names().items()
                                        if check.declaration_only))
def test_a_declaration_only_check_reads_the_class_only_through_the_declaration(
        trapped: BackendUnderTest, name: str) -> None:
    """The table's ``declaration_only`` checks run in the judging process: they must never
    read the backend's class there themselves (``Check.isolated`` says why)."""
    _, check = clauses.check_names()[name]
    args = arguments(check.args, Sources(who=trapped, device="cpu"))
    with budget.per_test(120):
        try:
            check.resolve()(*args)
        except (ClauseFailure, ClauseSkip):
            pass  # the stack's known findings: the outcome is not the point


def test_every_other_backend_check_that_drives_no_worker_runs_in_a_child() -> None:
    for row in clauses.CLAUSES:
        for check in row.checks:
            if check.takes_backend and not check.needs_workers:
                assert check.isolated != check.declaration_only, (row.id, check.variant)
