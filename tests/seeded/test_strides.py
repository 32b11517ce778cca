"""Seeded faults in production stride code: each fails exactly its KV-S clause.

Each fault is one of the package's (``faults/plants.py``, which ``kvconform selftest``
seeds too), planted with ``seed`` (``tests/seeding.py``) where production code looks the
function up; the same selection without the fault must pass, so no clause fails by
construction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from pytest_kvconform.faults import plants
from tests.conftest import needs_omni
from tests.seeding import Seeder, expect_run

pytestmark = needs_omni


@dataclasses.dataclass(frozen=True)
class Fault:
    patches: tuple[plants.Patch, ...]
    select: str
    failed: int
    passed: int
    lines: tuple[str, ...]


FAULTS = {
    "hand_strides": Fault(
        plants.HAND_STRIDES, "(kv_s1 or kv_s2 or kv_s3) and bf16_h8 and (LBNHC or BLNHC)", 2, 6,
        ("*KV-S1 violated [[]case=bf16_h8, layout=BLNHC[]]: vllm-omni build_kv_cache_tensor: "
         "KVCacheTensor.layer_stride differs from the oracle*",
         "*expected: {'layer_stride': 1024}*", "*actual:   {'layer_stride': 16384}*",
         "*KV-S3 violated [[]case=bf16_h8, layout=BLNHC[]]: vllm-omni build_kv_cache_tensor: "
         "block_stride must be page_size * num_layers = 1024 * 2*")),
    "view_offset": Fault(
        plants.VIEW_OFFSET,
        "(kv_s1 or kv_s2 or kv_s3) and bf16_h8 and LBNHC", 2, 2,
        ("*KV-S2 violated [[]case=bf16_h8, layout=LBNHC[]]: create_kv_cache_views: cell "
         "(layer=1, block=15, head=0, token=0, byte=0) lies outside the allocation [[]0, 32768)*",
         "*expected: 'byte 31744'*", "*actual:   'byte 32768'*")),
    "view_offset_allocate": Fault(
        plants.VIEW_OFFSET_ALLOCATE,
        "kv_s2 and bf16_h8 and LBNHC", 1, 1,
        ("*KV-S2 violated [[]case=bf16_h8, layout=LBNHC[]]: allocate_kv_cache: raised*",)),
    "padded_as_dense": Fault(
        plants.PADDED_AS_DENSE, "(kv_s1 or kv_s3 or kv_s4) and (bf16_h8 or padded) and LBNHC", 1, 2,
        ("*KV-S4 violated [[]case=padded, layout=LBNHC[]]: vllm-omni build_kv_cache_tensor: "
         "KVCacheTensor.size differs from the oracle*",
         "*expected: {'size': 49152}*", "*actual:   {'size': 32768}*")),
    "unrelated_padded": Fault(
        plants.UNRELATED_PADDED, "kv_s4 and padded and (LHBNC or BHLNC)", 2, 0,
        ("*KV-S4 violated [[]case=padded, layout=BHLNC[]]: vllm-omni build_kv_cache_tensor + "
         "create_kv_cache_views: raised ValueError: unrelated bug, not the documented error*",
         "*expected: \"AssertionError containing 'Page padding requires'\"*",
         "*actual:   'ValueError: unrelated bug'*")),
    "unrelated_split": Fault(
        plants.UNRELATED_SPLIT, "kv_s4 and split_k8 and (LHBNC or BLNHC)", 2, 0,
        ("*KV-S4 violated [[]case=split_k8, layout=BLNHC[]]: vllm-omni build_kv_cache_tensor + "
         "create_kv_cache_views: raised ValueError: unrelated bug, not the documented error*",
         "*expected: \"ValueError containing 'does not store blocks as dense, unpadded "
         "pages'\"*", "*actual:   'ValueError: unrelated bug'*")),
    "alias_in_group": Fault(
        plants.ALIAS_IN_GROUP, "(kv_s1 or kv_s5) and (bf16_h8 or groups2) and LBNHC", 1, 1,
        ("*KV-S5 violated [[]case=groups2, layout=LBNHC[]]: control plane get_kv_cache_configs "
         "-> allocate_kv_cache, group 0: cells (layer=0, block=1, head=0, token=0, byte=0) and "
         "(layer=1, block=0, head=0, token=0, byte=0) of one group share byte 1024*",)),
}


@pytest.mark.parametrize("name", list(FAULTS))
def test_fault_fails_its_clause(seed: Seeder, kv_run, name: str) -> None:
    fault = FAULTS[name]
    seed.plant(fault.patches)
    result = kv_run("-k", fault.select)
    expect_run(result, failed=fault.failed, passed=fault.passed, lines=fault.lines)


@pytest.mark.parametrize("select", sorted({f.select for f in FAULTS.values()}))
def test_unpatched_selection_passes(kv_run, select: str) -> None:
    result = kv_run("-k", select)
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) > 0, result.stdout.str()
    result.assert_outcomes(passed=outcomes["passed"])


def test_allocation_out_of_memory_is_an_oom_error_not_a_failure(
        kv_run: Callable[..., pytest.RunResult], seed: Seeder, pytester: pytest.Pytester) -> None:
    """Torch's CPU allocator failing inside ``allocate_kv_cache`` is the
    harness's ``oom`` error naming the case and bytes, not a violation blamed on vLLM."""
    import json

    def exhausted(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't "
                           "allocate memory: you tried to allocate 32768 bytes")

    seed.replace("pytest_kvconform.adapters.kv_allocation.allocate_kv_cache", exhausted)
    result = kv_run("-k", "kv_s2_allocate and LBNHC and bf16_h8", "--kv-report", "r.json")
    result.assert_outcomes(failed=1)  # pytest's outcome; the report says error
    [row] = json.loads((pytester.path / "r.json").read_text())["results"]
    assert (row["status"], row["error_kind"]) == ("error", "oom"), row["reason"]
    assert ("KV-S2 [case=bf16_h8, layout=LBNHC]: harness error (oom) while allocating the "
            "planned 32768-byte KV cache on cpu: it ran out of memory asking for about 32768 "
            "bytes") in row["reason"]
    assert "violated" not in row["reason"]
