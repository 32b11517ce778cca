"""The one failure context every check builds its outcomes from (``checks.common``)."""

from __future__ import annotations

import pytest

from pytest_kvconform.checks.common import Problems, Where
from pytest_kvconform.contract.outcomes import ClauseFailure, ErrorKind, HarnessError, SkipKind
from pytest_kvconform.contract.records import Case


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
