"""Seeded faults for the KV-N clauses: each turns exactly its clauses red.

The suite runs inline, in this process, so a fault planted with ``seed``
(``tests/seeding.py``; on the module attribute production reads at call time) is
live for the run and undone after it.  The unpatched selection runs too, so
no clause fails by construction.  KV-N3 restates KV-N2's numbers under an
override, so a fault in the shared sizing path fails both, on purpose.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import needs_omni
from tests.seeding import Seeder, expect_run, literal

pytestmark = needs_omni

SELECT = ("-k", "kv_n and bf16_h8")
CLAUSES = ("KV-N1", "KV-N2", "KV-N3", "KV-N4", "KV-N5")
GET_NEW_BLOCKS = "vllm.v1.core.block_pool.BlockPool.get_new_blocks"
KV_CACHE_UTILS = "vllm.v1.core.kv_cache_utils"
# get_kv_cache_configs where vllm-omni's control plane looks it up.
RANK_SIZING = "vllm_omni.diffusion.diffusion_kv.initialization.get_kv_cache_configs"


def _run(kv_run: Callable[..., pytest.RunResult], failing: dict[str, tuple[str, ...]]) -> None:
    """Run KV-N1..N5 on bf16_h8; exactly ``failing`` fail, each with its message lines.

    The first line of a message follows ``KV-Nx violated [case=bf16_h8...]``; later
    ones (``expected:``/``actual:``) are matched in order below it.
    """
    result = kv_run(*SELECT)
    lines: list[str] = []
    for clause, (first, *rest) in sorted(failing.items()):
        lines.append(literal(f"*{clause} violated [case=bf16_h8*{first}*"))
        lines.extend(literal(f"*{line}*") for line in rest)
    expect_run(result, failed=len(failing), passed=len(CLAUSES) - len(failing),
               clauses=failing, lines=lines)


def test_unpatched_selection_passes(kv_run: Callable[..., pytest.RunResult]) -> None:
    _run(kv_run, {})


def test_n1_pool_handing_out_the_null_block(kv_run: Callable[..., pytest.RunResult],
                                             seed: Seeder) -> None:
    """The pool counts the null block as free: one block more than it may hand out."""

    def make(original: Any) -> Any:
        def leaky(self: Any, num_blocks: int) -> list[Any]:
            if num_blocks == self.get_num_free_blocks() + 1:
                return [*original(self, num_blocks - 1), self.null_block]
            return original(self, num_blocks)
        return leaky

    seed.wrap(GET_NEW_BLOCKS, make)
    _run(kv_run, {"KV-N1": ("did not raise: it handed out block ids [0] (the null block)",)})


def test_n1_pool_crashing_when_exhausted(kv_run: Callable[..., pytest.RunResult],
                                         seed: Seeder) -> None:
    """An exhausted pool crashes with a RuntimeError: not the ValueError of a refusal."""

    def make(original: Any) -> Any:
        def crashing(self: Any, num_blocks: int) -> list[Any]:
            if num_blocks > self.get_num_free_blocks():
                raise RuntimeError("free list corrupted")
            return original(self, num_blocks)
        return crashing

    seed.wrap(GET_NEW_BLOCKS, make)
    _run(kv_run, {"KV-N1": ("raised RuntimeError: free list corrupted, not the ValueError of "
                            "an exhausted pool", "expected: 'ValueError'",
                            "actual:   'RuntimeError: free list corrupted'")})


def test_sizing_forgetting_the_null_block(kv_run: Callable[..., pytest.RunResult],
                                          seed: Seeder) -> None:
    """The pre-0.29 sizing: auto-fit and admission both count the null block as usable.

    Planted in the two helpers ``get_kv_cache_configs`` hands its null-block
    reserve to, by handing one block back; KV-N5 compares ranks only and passes.
    """
    from vllm.v1.core import kv_cache_utils

    fit, check = kv_cache_utils._auto_fit_max_model_len, \
        kv_cache_utils._check_enough_kv_cache_memory
    per_block = kv_cache_utils._pool_bytes_per_block

    def forgetful_fit(vllm_config: Any, groups: list[Any], memory: list[int]) -> None:
        memory = [m + per_block(g) if g else m for g, m in zip(groups, memory, strict=True)]
        fit(vllm_config, groups, memory)

    def forgetful_check(available: int, needed: Any, max_model_len: int, estimate: Any) -> None:
        groups = needed.args[1]  # partial(_max_memory_usage_bytes_from_groups, cfg, groups)
        check(available + per_block(groups), needed, max_model_len, estimate)

    seed.replace(f"{KV_CACHE_UTILS}._auto_fit_max_model_len", forgetful_fit)
    seed.replace(f"{KV_CACHE_UTILS}._check_enough_kv_cache_memory", forgetful_check)
    _run(kv_run, {"KV-N2": ("auto-fit max_model_len must plan for the 15 usable", "expected: 240",
                            "actual:   256"),
                  "KV-N3": ("num_gpu_blocks_override=16: auto-fit", "expected: 240",
                            "actual:   256"),
                  "KV-N4": ("memory for 1 page was accepted", "actual:   'num_blocks=1")})


def test_n3_override_ignored(kv_run: Callable[..., pytest.RunResult], seed: Seeder) -> None:
    """The control plane sizes from profiled memory and drops num_gpu_blocks_override."""

    def make(original: Any) -> Any:
        def ignoring(vllm_config: Any, specs: Any, memory: list[int]) -> Any:
            cache_config = vllm_config.cache_config
            saved = cache_config.num_gpu_blocks_override
            cache_config.num_gpu_blocks_override = None
            try:
                return original(vllm_config, specs, memory)
            finally:
                cache_config.num_gpu_blocks_override = saved
        return ignoring

    seed.wrap(RANK_SIZING, make)
    _run(kv_run, {"KV-N3": ("memory for 37 pages with num_gpu_blocks_override=16: rank 0's "
                            "KVCacheConfig.num_blocks", "expected: 16", "actual:   37")})


def test_n4_missing_refusal(kv_run: Callable[..., pytest.RunResult], seed: Seeder) -> None:
    """No memory left after the null block is waved through instead of refused."""
    from vllm.v1.core import kv_cache_utils

    check, fit = kv_cache_utils._check_enough_kv_cache_memory, \
        kv_cache_utils._auto_fit_max_model_len

    def lax_check(available: int, *args: Any) -> None:
        if available > 0:
            check(available, *args)

    def lax_fit(vllm_config: Any, *args: Any) -> None:
        try:
            fit(vllm_config, *args)
        except ValueError:
            vllm_config.model_config.max_model_len = 1

    seed.replace(f"{KV_CACHE_UTILS}._check_enough_kv_cache_memory", lax_check)
    seed.replace(f"{KV_CACHE_UTILS}._auto_fit_max_model_len", lax_fit)
    _run(kv_run, {"KV-N4": ("memory for 1 page was accepted: a config with no usable block",)})


def _patch_rank_sizing(seed: Seeder,
                       resize: Callable[[Any, Any, list[int], Any], list[Any]]) -> None:
    def make(original: Any) -> Any:
        def faulty(vllm_config: Any, specs: Any, memory: list[int]) -> list[Any]:
            return resize(vllm_config, specs, memory, original)
        return faulty

    seed.wrap(RANK_SIZING, make)


def test_n5_ranks_sized_for_the_largest(kv_run: Callable[..., pytest.RunResult],
                                        seed: Seeder) -> None:
    """Every rank gets the largest rank's memory instead of the smallest's."""

    def largest(vllm_config: Any, specs: Any, memory: list[int], original: Any) -> list[Any]:
        return original(vllm_config, specs, [max(memory)] * len(memory))

    _patch_rank_sizing(seed, largest)
    _run(kv_run, {"KV-N5": ("every rank must get the smallest num_blocks; rank 0", "expected: 16",
                            "actual:   23")})


def test_n5_ranks_not_shrinking_tensors(kv_run: Callable[..., pytest.RunResult],
                                        seed: Seeder) -> None:
    """Ranks take the minimum count but keep tensors sized for their own memory."""

    def unshrunk(vllm_config: Any, specs: Any, memory: list[int], original: Any) -> list[Any]:
        configs = [original(vllm_config, [s], [m])[0] for s, m in zip(specs, memory, strict=True)]
        smallest = min(c.num_blocks for c in configs)
        for config in configs:
            config.num_blocks = smallest
        return configs

    _patch_rank_sizing(seed, unshrunk)
    _run(kv_run, {"KV-N5": ("rank 0 (memory for 19 pages) kv_cache_tensors[0].size must shrink "
                            "to 16", "expected: 32768", "actual:   38912")})


def test_n1_pool_out_of_memory_is_an_oom_error(kv_run: Callable[..., pytest.RunResult],
                                               seed: Seeder, pytester: pytest.Pytester) -> None:
    """An allocation that fails in the test process is the harness's ``oom``
    error naming the case and the bytes asked, never a crash or the backend's failure."""
    import json

    def exhausted(num_blocks: int) -> Any:
        raise MemoryError(f"cannot allocate a pool of {num_blocks} blocks")

    seed.replace("pytest_kvconform.adapters.compat.block_pool", exhausted)
    result = kv_run("-k", "kv_n1 and bf16_h8", "--kv-report", "r.json")
    result.assert_outcomes(failed=1)  # pytest's outcome; the report says error
    [row] = json.loads((pytester.path / "r.json").read_text())["results"]
    assert (row["status"], row["error_kind"]) == ("error", "oom")
    assert ("KV-N1 [case=bf16_h8]: harness error (oom) while building a BlockPool of 16 "
            "blocks: it ran out of memory asking for about 4096 bytes") in row["reason"]
    assert "MemoryError: cannot allocate a pool of 16 blocks" in row["reason"]
    assert "violated" not in row["reason"]


def test_n1_pool_past_the_hosts_memory_is_refused_unallocated(seed: Seeder) -> None:
    """A case made in code (no file limits) asking for more than the host has: refused
    before vLLM allocates anything, as an ``oom`` error."""
    from pytest_kvconform.checks import nullblock
    from pytest_kvconform.contract import cases, memory

    case = next(c for c in cases.load_cases() if c.id == "bf16_h8")
    built: list[int] = []
    seed.replace("pytest_kvconform.adapters.compat.block_pool", built.append)
    seed.replace("pytest_kvconform.contract.memory.host_available_bytes", lambda: 1000)
    with pytest.raises(memory.OutOfMemory) as info:
        nullblock.check_kv_n1(case)
    assert info.value.kind.value == "oom" and built == []
    assert str(info.value) == (
        "KV-N1 [case=bf16_h8]: harness error (oom) while building a BlockPool of 16 blocks: "
        "it would take about 4096 bytes, more than 0.5 of the 1000 bytes this host has "
        "available; not attempted")
