"""The production control plane, run for one layout need, case and world size.

Shared by the KV-A checks and the public ``kv_control_plane`` fixture, so a
backend repository's own tests get exactly the configs the suite checks.
vLLM and vllm-omni are reached only through ``compat``, lazily.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pytest_kvconform import compat
from pytest_kvconform.model import Case


@dataclass
class ControlPlane:
    """What the control plane produced: rank-local configs, scheduler config, pinned name.

    ``sized_with`` lists the layout name that was pinned on the control plane's
    config each time it sized (empty when sizing could not be observed).
    """

    need: bool
    case: Case
    world_size: int
    device: str
    vllm_config: Any
    rank_configs: list[Any]
    scheduler_config: Any
    available_memory: list[int]
    sized_with: list[str | None] = field(default_factory=list)

    @property
    def pinned(self) -> str | None:
        """The name on the control plane's own ``CacheConfig`` after it ran."""
        return self.vllm_config.cache_config.kv_cache_layout

    @property
    def max_model_len(self) -> int:
        """The (possibly auto-fitted) length the executor forwards to every worker."""
        return int(self.vllm_config.model_config.max_model_len)

    def rpc_message(self) -> dict[str, Any]:
        """The executor's ``set_kv_cache_configs`` envelope for these configs."""
        return compat.executor_rpc_message(self.rank_configs, self.max_model_len)


def default_memory(case: Case) -> int:
    """Bytes per rank that give ``case.num_pages`` physical pages."""
    spec = compat.attention_spec(case)
    return compat.page_bytes(spec) * case.num_layers * case.num_pages


def build_control_plane(need: bool, case: Case, *, world_size: int | None = None,
                        device: str = "cpu",
                        available_memory: list[int] | None = None) -> ControlPlane:
    """Run vllm-omni's ``build_native_kv_cache_configs`` through its explicit seam.

    A fresh production config (``create_diffusion_vllm_config``) is built each
    time, so nothing is pinned before the control plane runs.
    """
    n = case.world_size if world_size is None else world_size
    specs = compat.worker_specs(case)
    specs = [dict(specs[0]) for _ in range(n)]
    memory = list(available_memory) if available_memory is not None else [default_memory(case)] * n
    vllm_config = compat.production_vllm_config(device, world_size=n)
    with compat.sizing_spy() as sized_with:
        rank_configs, scheduler_config = compat.build_native_kv_cache_configs(
            vllm_config, specs, memory, indexes_kv_by_block_stride=need)
    return ControlPlane(need=need, case=case, world_size=n, device=device,
                        vllm_config=vllm_config, rank_configs=list(rank_configs),
                        scheduler_config=scheduler_config, available_memory=memory,
                        sized_with=list(sized_with))
