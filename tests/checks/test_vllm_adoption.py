"""KV-V4: the layout crosses to production's worker in a pooled worker process, clean and
with the worker-side fault (a regression applied in that process)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pytest_kvconform.adapters import vllm_layout
from pytest_kvconform.checks import vllm_adoption
from pytest_kvconform.checks.common import via_recorded
from pytest_kvconform.checks.errors import ClauseFailure
from pytest_kvconform.faults import vllm_plants
from pytest_kvconform.workers import pool
from pytest_kvconform.workers.kv_workers import KvWorkers
from tests.checks.vllm_backends import vllm_backend


@pytest.fixture(scope="module")
def workers() -> Iterator[KvWorkers]:
    """The shared pool, held for this module and closed after it (no orphan workers)."""
    pool.hold()
    try:
        yield KvWorkers("cpu", [])
    finally:
        pool.release()


@pytest.mark.parametrize("name", ["CPU_ATTN", "ROCM_ATTN", "FLEX_ATTENTION"])
def test_the_worker_allocates_at_the_oracles_bytes(name: str, workers: KvWorkers) -> None:
    """One layout each (LBHNC, LHBNC with a repacked page, LBNHC); the result says what ran."""
    with via_recorded() as via:
        vllm_adoption.check_kv_v4(vllm_backend(name), workers.for_world_size(1))
    assert via == [vllm_adoption.VIA]


def test_the_rpc_is_the_executors_own_frames() -> None:
    """In this process: the frames decode and run on production's worker wrapper."""
    frames, how = vllm_layout.executor_frames("LBHNC")
    assert how == "vllm MessageQueue.enqueue" and frames
    wrapper = vllm_layout.production_worker_proc()
    vllm_layout.worker_proc_receives(wrapper, frames)
    assert wrapper.worker.vllm_config.cache_config.kv_cache_layout == "LBHNC"


def test_a_worker_ignoring_the_rpc_fails(workers: KvWorkers) -> None:
    with pytest.raises(ClauseFailure) as caught:
        vllm_adoption.check_kv_v4(vllm_backend(vllm_plants.BACKEND), workers.for_world_size(1),
                                  control=vllm_plants.WORKER_IGNORES_RPC_REF)
    assert str(caught.value).startswith(
        "KV-V4 violated [backend=CPU_ATTN, layout=LBHNC]: production's worker (another "
        "process) raised during allocate_kv_cache after the RPC: ValueError: KV cache layout "
        "has not been resolved yet"), str(caught.value)


def test_a_worker_pinned_elsewhere_refuses_the_rpc(workers: KvWorkers) -> None:
    """The negative control passes on production: record_kv_cache_layout refuses a change."""
    with via_recorded() as via:
        vllm_adoption.check_kv_v4_disagreement(vllm_backend("CPU_ATTN"),
                                               workers.for_world_size(1))
    assert via == [vllm_adoption.VIA]


def test_a_worker_accepting_any_rpc_fails_the_control(workers: KvWorkers) -> None:
    """The worker-side fault (nothing recorded) makes the control fail: no refusal."""
    backend = vllm_backend("CPU_ATTN")
    with pytest.raises(ClauseFailure, match=r"KV-V4 violated \[backend=CPU_ATTN, "
                       r"layout=LBHNC\]: a worker already pinned to LBNHC accepted "
                       r"set_kv_cache_layout\(LBHNC\) silently"):
        vllm_adoption.check_kv_v4_disagreement(backend, workers.for_world_size(1),
                                               control=vllm_plants.WORKER_IGNORES_RPC_REF)
