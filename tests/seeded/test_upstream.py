"""vLLM alone: where vllm-omni is not installed, the (upstream) row's KV-S and KV-N clauses run
against vLLM's own control plane, seeded faults there fail them, and what needs vllm-omni
skips with that reason, never errors.

vllm-omni is hidden from the checks (``compat.omni_installed``, the one place they ask), so
this runs in any environment; on a vLLM without vllm-omni (``tox -e py311-vllm033``) the
same suite takes this path for real.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from pytest_kvconform.adapters import compat, kv_planner
from tests.seeding import Seeder, expect_run, literal

KV_CACHE_UTILS = "vllm.v1.core.kv_cache_utils"
CASE = "bf16_h8"
SELECT = f"(kv_s1 or kv_s2 or kv_s3 or kv_n2 or kv_n5) and {CASE} and (LBNHC or not kv_s)"


@pytest.fixture
def without_omni(seed: Seeder) -> None:
    seed.replace("pytest_kvconform.adapters.compat.omni_installed", lambda: False)


def _planner_module() -> str:
    """The module whose ``get_kv_cache_configs`` vLLM's control plane calls (it moved)."""
    return kv_planner.get_kv_cache_configs_fn().__module__


def test_weightless_model_declares_the_sequence_limit() -> None:
    config = json.loads((kv_planner.UPSTREAM_MODEL_DIR / "config.json").read_text())
    assert config["max_position_embeddings"] == compat.MODEL_SEQ_LIMIT


def test_clean_run_passes_on_vllm_alone(without_omni: None, kv_run: Callable[..., Any],
                                        pytester: pytest.Pytester) -> None:
    result = kv_run("-k", SELECT, "--kv-report", "r.json")
    result.assert_outcomes(passed=6)
    rows = json.loads((pytester.path / "r.json").read_text())["results"]
    via = {r["nodeid"].rsplit("::", 1)[-1].split("[")[0]: r.get("via") or "" for r in rows}
    assert via["test_kv_s1"].startswith("vLLM alone (vllm-omni not installed): "
                                        "get_kv_cache_configs")
    assert via["test_kv_s1"].endswith("vllm-omni's build_kv_cache_tensor not checked "
                                      "(not installed)")
    assert via["test_kv_s2_allocate"].startswith("vLLM alone")
    assert via["test_kv_n2"] == kv_planner.UPSTREAM_CONTROL_PLANE
    assert via["test_kv_s2"] == ""  # create_kv_cache_views is vLLM's wherever it runs


def test_planner_strides_fault_fails_kv_s1(without_omni: None, kv_run: Callable[..., Any],
                                           seed: Seeder) -> None:
    """vLLM's planner lays a block-outermost layout out layer by layer."""

    def make(original: Any) -> Any:
        def layer_outer(vllm_config: Any, groups: Any, available_memory: Any) -> Any:
            config = original(vllm_config, groups, available_memory)
            for tensor in config.kv_cache_tensors:
                page = tensor.size // (len(tensor.layers) * config.num_blocks)
                tensor.layer_stride, tensor.block_stride = page * config.num_blocks, page
            return config
        return layer_outer

    seed.wrap(f"{_planner_module()}.get_kv_cache_config_from_groups", make)
    result = kv_run("-k", f"(kv_s1 or kv_s3) and {CASE} and BLNHC")
    expect_run(result, failed=2, clauses=["KV-S1", "KV-S3"], lines=[
        literal(f"*KV-S1 violated [case={CASE}, layout=BLNHC]: control plane "
                "get_kv_cache_configs: KVCacheTensor.layer_stride differs from the oracle*"),
        literal("*KV-S3 violated [case=bf16_h8, layout=BLNHC]: control plane "
                "get_kv_cache_configs: block_stride must be page_size * num_layers*")],
        in_order=False)


def test_ranks_sized_for_the_largest_fails_kv_n5(without_omni: None,
                                                 kv_run: Callable[..., Any],
                                                 seed: Seeder) -> None:
    """vLLM's control plane gives every rank the largest rank's memory."""

    def make(original: Any) -> Any:
        def largest(vllm_config: Any, specs: Any, memory: list[int], *rest: Any) -> Any:
            return original(vllm_config, specs, [max(memory)] * len(memory), *rest)
        return largest

    seed.wrap(f"{_planner_module()}.get_kv_cache_configs", make)
    result = kv_run("-k", f"(kv_n2 or kv_n5) and {CASE}")
    expect_run(result, failed=1, passed=1, clauses=["KV-N5"], lines=[
        literal(f"*KV-N5 violated [case={CASE}]: ranks with memory for [19, 16, 23] pages: "
                "every rank must get the smallest num_blocks; rank 0*")])


def test_null_block_counted_as_usable_fails_kv_n2(without_omni: None,
                                                   kv_run: Callable[..., Any],
                                                   seed: Seeder) -> None:
    """vLLM's scheduler config counts one block more than the ranks hold."""

    def make(original: Any) -> Any:
        def one_more(worker_configs: Any) -> Any:
            config = original(worker_configs)
            config.num_blocks += 1
            return config
        return one_more

    seed.wrap(f"{KV_CACHE_UTILS}.generate_scheduler_kv_cache_config", make)
    result = kv_run("-k", f"kv_n2 and {CASE}")
    expect_run(result, failed=1, clauses=["KV-N2"], lines=[
        literal(f"*KV-N2 violated [case={CASE}]: memory for 16 pages: the scheduler "
                "KVCacheConfig.num_blocks*"), "*expected: 16*", "*actual:   17*"])


def test_what_needs_vllm_omni_skips_naming_it(without_omni: None) -> None:
    """KV-L6's seam variants need vllm-omni's SDPA backend: building their stand-in no longer
    imports it (a ModuleNotFoundError, reported as a harness error, before), and the check
    skips naming the reason before it asks for a worker."""
    from pytest_kvconform.checks import layout
    from pytest_kvconform.contract.outcomes import ClauseSkip, SkipKind

    for need in (False, True):
        backend = layout.seam_backend(need)
        assert (backend.name, backend.cls) == (f"need_{need}", None)
        with pytest.raises(ClauseSkip) as info:
            layout.check_kv_l6(backend, workers=None)
        assert (info.value.clause, info.value.reason, info.value.kind) == \
            ("KV-L6", "vllm-omni not installed", SkipKind.ENVIRONMENT)
