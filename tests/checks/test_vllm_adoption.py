"""KV-V4: the layout crosses to production's worker in another process, clean and faulted."""

from __future__ import annotations

import pytest

from pytest_kvconform.adapters import vllm_layout
from pytest_kvconform.checks import vllm_adoption
from pytest_kvconform.checks.common import via_recorded
from pytest_kvconform.checks.errors import ClauseFailure
from pytest_kvconform.faults import vllm_plants
from tests.checks.vllm_backends import vllm_backend
from tests.seeding import Seeder


@pytest.mark.parametrize("name", ["CPU_ATTN", "ROCM_ATTN", "FLEX_ATTENTION"])
def test_the_worker_allocates_at_the_oracles_bytes(name: str) -> None:
    """One layout each (LBHNC, LHBNC with a repacked page, LBNHC); the result says what ran."""
    with via_recorded() as via:
        vllm_adoption.check_kv_v4(vllm_backend(name))
    assert via == [vllm_adoption.VIA]


def test_the_rpc_is_the_executors_own_frames() -> None:
    frames, how = vllm_layout.executor_frames("LBHNC")
    assert how == "vllm MessageQueue.enqueue" and frames
    worker = vllm_layout.production_worker()
    vllm_layout.worker_receives(worker, frames)
    assert worker.vllm_config.cache_config.kv_cache_layout == "LBHNC"


def test_a_worker_ignoring_the_rpc_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = vllm_backend(vllm_plants.BACKEND)
    Seeder(monkeypatch).plant(vllm_plants.WORKER_IGNORES_RPC.patches)
    with pytest.raises(ClauseFailure) as caught:
        vllm_adoption.check_kv_v4(backend)
    assert str(caught.value).startswith(
        "KV-V4 violated [backend=CPU_ATTN, layout=LBHNC]: production's worker (another "
        "process) got set_kv_cache_layout(LBHNC) from the executor, then ValueError: KV cache "
        "layout has not been resolved yet"), str(caught.value)
