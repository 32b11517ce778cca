"""Seeded faults in production stride code: each fails exactly its KV-S clause.

Each conftest monkeypatches a production function where production code looks it up;
the same selection without the fault must pass, so no clause fails by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.conftest import needs_omni

pytestmark = needs_omni

# S1/S3: strides written by hand for layer-outermost layouts, whatever the layout.
HAND_STRIDES = '''
import pytest
from vllm.v1.kv_cache_interface import KVCacheTensor

def hand_strides(spec, num_blocks, layers, *, layout=None, offset=0):
    page = spec.page_size_bytes
    return KVCacheTensor(size=page * len(layers) * num_blocks, layers=list(layers),
                         layer_stride=page * num_blocks, block_stride=page, offset=offset)

@pytest.fixture(autouse=True)
def fault(monkeypatch):
    monkeypatch.setattr("vllm_omni.diffusion.diffusion_kv.layout.build_kv_cache_tensor",
                        hand_strides)
'''

# S2: every view starts one page late (both where tests and allocate_kv_cache look it up).
VIEW_OFFSET = '''
import dataclasses
import pytest
import vllm.v1.kv_cache_interface as kvi

ORIGINAL = kvi.create_kv_cache_views

def one_page_late(raw, spec, num_blocks, layout, tensor, kernel_block_size=None):
    moved = dataclasses.replace(tensor, offset=tensor.offset + spec.page_size_bytes)
    return ORIGINAL(raw, spec, num_blocks, layout, moved, kernel_block_size)

@pytest.fixture(autouse=True)
def fault(monkeypatch):
    for where in TARGETS:
        monkeypatch.setattr(where, one_page_late)
'''

# S4: the padding of a padded page is dropped when the tensor is derived.
PADDED_AS_DENSE = '''
import dataclasses
import pytest
import vllm_omni.diffusion.diffusion_kv.layout as omni_layout

ORIGINAL = omni_layout.build_kv_cache_tensor

def as_dense(spec, num_blocks, layers, *, layout=None, offset=0):
    dense = dataclasses.replace(spec, page_size_padded=None)
    return ORIGINAL(dense, num_blocks, layers, layout=layout, offset=offset)

@pytest.fixture(autouse=True)
def fault(monkeypatch):
    monkeypatch.setattr(omni_layout, "build_kv_cache_tensor", as_dense)
'''

# S5: with several groups, layer l+1 starts one block after layer l: one group aliases itself.
ALIAS_IN_GROUP = '''
import pytest
import vllm.v1.core.kv_cache_utils as kcu

ORIGINAL = kcu.get_kv_cache_config_from_groups

def aliasing(vllm_config, groups, available_memory):
    config = ORIGINAL(vllm_config, groups, available_memory)
    if len(groups) > 1:
        for tensor in config.kv_cache_tensors:
            tensor.layer_stride = tensor.block_stride
    return config

@pytest.fixture(autouse=True)
def fault(monkeypatch):
    monkeypatch.setattr(kcu, "get_kv_cache_config_from_groups", aliasing)
'''

# S4: an unrelated ValueError where the documented error is due must not count as it:
# for padded pages in the tensor derivation, for kernel splitting in the views.
UNRELATED_PADDED = '''
import pytest
import vllm_omni.diffusion.diffusion_kv.layout as omni_layout

ORIGINAL = omni_layout.build_kv_cache_tensor

def buggy(spec, num_blocks, layers, *, layout=None, offset=0):
    if spec.page_size_padded is not None:
        raise ValueError("unrelated bug")
    return ORIGINAL(spec, num_blocks, layers, layout=layout, offset=offset)

@pytest.fixture(autouse=True)
def fault(monkeypatch):
    monkeypatch.setattr(omni_layout, "build_kv_cache_tensor", buggy)
'''

UNRELATED_SPLIT = '''
import pytest
import vllm.v1.kv_cache_interface as kvi

ORIGINAL = kvi.create_kv_cache_views

def buggy(raw, spec, num_blocks, layout, tensor, kernel_block_size=None):
    if kernel_block_size is not None and kernel_block_size < spec.block_size:
        raise ValueError("unrelated bug")
    return ORIGINAL(raw, spec, num_blocks, layout, tensor, kernel_block_size)

@pytest.fixture(autouse=True)
def fault(monkeypatch):
    for where in ("vllm.v1.kv_cache_interface.create_kv_cache_views",
                  "vllm.v1.worker.utils.create_kv_cache_views"):
        monkeypatch.setattr(where, buggy)
'''


@dataclass(frozen=True)
class Fault:
    conftest: str
    select: str
    failed: int
    passed: int
    lines: tuple[str, ...]


FAULTS = {
    "hand_strides": Fault(
        HAND_STRIDES, "(kv_s1 or kv_s2 or kv_s3) and bf16_h8 and (LBNHC or BLNHC)", 2, 6,
        ("*KV-S1 violated [[]case=bf16_h8, layout=BLNHC[]]: vllm-omni build_kv_cache_tensor: "
         "KVCacheTensor.layer_stride differs from the oracle*",
         "*expected: {'layer_stride': 1024}*", "*actual:   {'layer_stride': 16384}*",
         "*KV-S3 violated [[]case=bf16_h8, layout=BLNHC[]]: vllm-omni build_kv_cache_tensor: "
         "block_stride must be page_size * num_layers = 1024 * 2*")),
    "view_offset": Fault(
        VIEW_OFFSET.replace("TARGETS", '("vllm.v1.kv_cache_interface.create_kv_cache_views", '
                            '"vllm.v1.worker.utils.create_kv_cache_views")'),
        "(kv_s1 or kv_s2 or kv_s3) and bf16_h8 and LBNHC", 2, 2,
        ("*KV-S2 violated [[]case=bf16_h8, layout=LBNHC[]]: create_kv_cache_views: cell "
         "(layer=1, block=15, head=0, token=0, byte=0) lies outside the allocation [[]0, 32768)*",
         "*expected: 'byte 31744'*", "*actual:   'byte 32768'*")),
    "view_offset_allocate": Fault(
        VIEW_OFFSET.replace("TARGETS", '("vllm.v1.worker.utils.create_kv_cache_views",)'),
        "kv_s2 and bf16_h8 and LBNHC", 1, 1,
        ("*KV-S2 violated [[]case=bf16_h8, layout=LBNHC[]]: allocate_kv_cache: raised*",)),
    "padded_as_dense": Fault(
        PADDED_AS_DENSE, "(kv_s1 or kv_s3 or kv_s4) and (bf16_h8 or padded) and LBNHC", 1, 2,
        ("*KV-S4 violated [[]case=padded, layout=LBNHC[]]: vllm-omni build_kv_cache_tensor: "
         "KVCacheTensor.size differs from the oracle*",
         "*expected: {'size': 49152}*", "*actual:   {'size': 32768}*")),
    "unrelated_padded": Fault(
        UNRELATED_PADDED, "kv_s4 and padded and (LHBNC or BHLNC)", 2, 0,
        ("*KV-S4 violated [[]case=padded, layout=BHLNC[]]: vllm-omni build_kv_cache_tensor + "
         "create_kv_cache_views: raised ValueError: unrelated bug, not the documented error*",
         "*expected: \"AssertionError containing 'Page padding requires'\"*",
         "*actual:   'ValueError: unrelated bug'*")),
    "unrelated_split": Fault(
        UNRELATED_SPLIT, "kv_s4 and split_k8 and (LHBNC or BLNHC)", 2, 0,
        ("*KV-S4 violated [[]case=split_k8, layout=BLNHC[]]: vllm-omni build_kv_cache_tensor + "
         "create_kv_cache_views: raised ValueError: unrelated bug, not the documented error*",
         "*expected: \"ValueError containing 'does not store blocks as dense, unpadded "
         "pages'\"*", "*actual:   'ValueError: unrelated bug'*")),
    "alias_in_group": Fault(
        ALIAS_IN_GROUP, "(kv_s1 or kv_s5) and (bf16_h8 or groups2) and LBNHC", 1, 1,
        ("*KV-S5 violated [[]case=groups2, layout=LBNHC[]]: control plane get_kv_cache_configs "
         "-> allocate_kv_cache, group 0: cells (layer=0, block=1, head=0, token=0, byte=0) and "
         "(layer=1, block=0, head=0, token=0, byte=0) of one group share byte 1024*",)),
}


@pytest.mark.parametrize("name", list(FAULTS))
def test_fault_fails_its_clause(pytester: pytest.Pytester, kv_run, name: str) -> None:
    fault = FAULTS[name]
    pytester.makeconftest(fault.conftest)
    result = kv_run("-k", fault.select)
    result.assert_outcomes(failed=fault.failed, passed=fault.passed)
    result.stdout.fnmatch_lines(list(fault.lines))


@pytest.mark.parametrize("select", sorted({f.select for f in FAULTS.values()}))
def test_unpatched_selection_passes(kv_run, select: str) -> None:
    result = kv_run("-k", select)
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) > 0, result.stdout.str()
    result.assert_outcomes(passed=outcomes["passed"])
