"""Seeded faults in production stride code: each fails exactly its KV-S clause.

Each fault is planted with ``seed`` (``tests/seeding.py``) where production code looks
the function up; the same selection without the fault must pass, so no clause fails by
construction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import needs_omni
from tests.seeding import Seeder, expect_run

pytestmark = needs_omni

BUILD_TENSOR = "vllm_omni.diffusion.diffusion_kv.layout.build_kv_cache_tensor"
# create_kv_cache_views where tests and where allocate_kv_cache look it up.
VIEWS = "vllm.v1.kv_cache_interface.create_kv_cache_views"
VIEWS_IN_ALLOCATE = "vllm.v1.worker.utils.create_kv_cache_views"


def hand_strides(seed: Seeder) -> None:
    """S1/S3: strides written by hand for layer-outermost layouts, whatever the layout."""
    from vllm.v1.kv_cache_interface import KVCacheTensor

    def strides(spec: Any, num_blocks: int, layers: Any, *, layout: Any = None,
                offset: int = 0) -> Any:
        page = spec.page_size_bytes
        return KVCacheTensor(size=page * len(layers) * num_blocks, layers=list(layers),
                             layer_stride=page * num_blocks, block_stride=page, offset=offset)

    seed.replace(BUILD_TENSOR, strides)


def _one_page_late(original: Any) -> Any:
    def views(raw: Any, spec: Any, num_blocks: int, layout: Any, tensor: Any,
              kernel_block_size: int | None = None) -> Any:
        moved = dataclasses.replace(tensor, offset=tensor.offset + spec.page_size_bytes)
        return original(raw, spec, num_blocks, layout, moved, kernel_block_size)
    return views


def view_offset(seed: Seeder) -> None:
    """S2: every view starts one page late."""
    for where in (VIEWS, VIEWS_IN_ALLOCATE):
        seed.wrap(where, _one_page_late)


def view_offset_allocate(seed: Seeder) -> None:
    """S2: the views allocate_kv_cache makes start one page late."""
    seed.wrap(VIEWS_IN_ALLOCATE, _one_page_late)


def padded_as_dense(seed: Seeder) -> None:
    """S4: the padding of a padded page is dropped when the tensor is derived."""
    def make(original: Any) -> Any:
        def as_dense(spec: Any, num_blocks: int, layers: Any, *, layout: Any = None,
                     offset: int = 0) -> Any:
            dense = dataclasses.replace(spec, page_size_padded=None)
            return original(dense, num_blocks, layers, layout=layout, offset=offset)
        return as_dense

    seed.wrap(BUILD_TENSOR, make)


def alias_in_group(seed: Seeder) -> None:
    """S5: with several groups, layer l+1 starts one block after layer l: one group
    aliases itself."""
    def make(original: Any) -> Any:
        def aliasing(vllm_config: Any, groups: Any, available_memory: Any) -> Any:
            config = original(vllm_config, groups, available_memory)
            if len(groups) > 1:
                for tensor in config.kv_cache_tensors:
                    tensor.layer_stride = tensor.block_stride
            return config
        return aliasing

    seed.wrap("vllm.v1.core.kv_cache_utils.get_kv_cache_config_from_groups", make)


# S4: an unrelated ValueError where the documented error is due must not count as it:
# for padded pages in the tensor derivation, for kernel splitting in the views.
def unrelated_padded(seed: Seeder) -> None:
    def make(original: Any) -> Any:
        def buggy(spec: Any, num_blocks: int, layers: Any, *, layout: Any = None,
                  offset: int = 0) -> Any:
            if spec.page_size_padded is not None:
                raise ValueError("unrelated bug")
            return original(spec, num_blocks, layers, layout=layout, offset=offset)
        return buggy

    seed.wrap(BUILD_TENSOR, make)


def unrelated_split(seed: Seeder) -> None:
    def make(original: Any) -> Any:
        def buggy(raw: Any, spec: Any, num_blocks: int, layout: Any, tensor: Any,
                  kernel_block_size: int | None = None) -> Any:
            if kernel_block_size is not None and kernel_block_size < spec.block_size:
                raise ValueError("unrelated bug")
            return original(raw, spec, num_blocks, layout, tensor, kernel_block_size)
        return buggy

    for where in (VIEWS, VIEWS_IN_ALLOCATE):
        seed.wrap(where, make)


@dataclasses.dataclass(frozen=True)
class Fault:
    plant: Callable[[Seeder], None]
    select: str
    failed: int
    passed: int
    lines: tuple[str, ...]


FAULTS = {
    "hand_strides": Fault(
        hand_strides, "(kv_s1 or kv_s2 or kv_s3) and bf16_h8 and (LBNHC or BLNHC)", 2, 6,
        ("*KV-S1 violated [[]case=bf16_h8, layout=BLNHC[]]: vllm-omni build_kv_cache_tensor: "
         "KVCacheTensor.layer_stride differs from the oracle*",
         "*expected: {'layer_stride': 1024}*", "*actual:   {'layer_stride': 16384}*",
         "*KV-S3 violated [[]case=bf16_h8, layout=BLNHC[]]: vllm-omni build_kv_cache_tensor: "
         "block_stride must be page_size * num_layers = 1024 * 2*")),
    "view_offset": Fault(
        view_offset,
        "(kv_s1 or kv_s2 or kv_s3) and bf16_h8 and LBNHC", 2, 2,
        ("*KV-S2 violated [[]case=bf16_h8, layout=LBNHC[]]: create_kv_cache_views: cell "
         "(layer=1, block=15, head=0, token=0, byte=0) lies outside the allocation [[]0, 32768)*",
         "*expected: 'byte 31744'*", "*actual:   'byte 32768'*")),
    "view_offset_allocate": Fault(
        view_offset_allocate,
        "kv_s2 and bf16_h8 and LBNHC", 1, 1,
        ("*KV-S2 violated [[]case=bf16_h8, layout=LBNHC[]]: allocate_kv_cache: raised*",)),
    "padded_as_dense": Fault(
        padded_as_dense, "(kv_s1 or kv_s3 or kv_s4) and (bf16_h8 or padded) and LBNHC", 1, 2,
        ("*KV-S4 violated [[]case=padded, layout=LBNHC[]]: vllm-omni build_kv_cache_tensor: "
         "KVCacheTensor.size differs from the oracle*",
         "*expected: {'size': 49152}*", "*actual:   {'size': 32768}*")),
    "unrelated_padded": Fault(
        unrelated_padded, "kv_s4 and padded and (LHBNC or BHLNC)", 2, 0,
        ("*KV-S4 violated [[]case=padded, layout=BHLNC[]]: vllm-omni build_kv_cache_tensor + "
         "create_kv_cache_views: raised ValueError: unrelated bug, not the documented error*",
         "*expected: \"AssertionError containing 'Page padding requires'\"*",
         "*actual:   'ValueError: unrelated bug'*")),
    "unrelated_split": Fault(
        unrelated_split, "kv_s4 and split_k8 and (LHBNC or BLNHC)", 2, 0,
        ("*KV-S4 violated [[]case=split_k8, layout=BLNHC[]]: vllm-omni build_kv_cache_tensor + "
         "create_kv_cache_views: raised ValueError: unrelated bug, not the documented error*",
         "*expected: \"ValueError containing 'does not store blocks as dense, unpadded "
         "pages'\"*", "*actual:   'ValueError: unrelated bug'*")),
    "alias_in_group": Fault(
        alias_in_group, "(kv_s1 or kv_s5) and (bf16_h8 or groups2) and LBNHC", 1, 1,
        ("*KV-S5 violated [[]case=groups2, layout=LBNHC[]]: control plane get_kv_cache_configs "
         "-> allocate_kv_cache, group 0: cells (layer=0, block=1, head=0, token=0, byte=0) and "
         "(layer=1, block=0, head=0, token=0, byte=0) of one group share byte 1024*",)),
}


@pytest.mark.parametrize("name", list(FAULTS))
def test_fault_fails_its_clause(seed: Seeder, kv_run, name: str) -> None:
    fault = FAULTS[name]
    fault.plant(seed)
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

    seed.replace("pytest_kvconform.adapters.compat.allocate_kv_cache", exhausted)
    result = kv_run("-k", "kv_s2_allocate and LBNHC and bf16_h8", "--kv-report", "r.json")
    result.assert_outcomes(failed=1)  # pytest's outcome; the report says error
    [row] = json.loads((pytester.path / "r.json").read_text())["results"]
    assert (row["status"], row["error_kind"]) == ("error", "oom"), row["reason"]
    assert ("KV-S2 [case=bf16_h8, layout=LBNHC]: harness error (oom) while allocating the "
            "planned 32768-byte KV cache on cpu: it ran out of memory asking for about 32768 "
            "bytes") in row["reason"]
    assert "violated" not in row["reason"]
