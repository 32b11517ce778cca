"""The production control plane, run for one layout need, case and world size.

Shared by the KV-A checks and the public ``kv_control_plane`` fixture, so a
backend repository's own tests get exactly the configs the suite checks; the
whole control plane (``initialize_diffusion_kv_control_plane``, for KV-L6)
runs here too, against a recording executor.  API adaptation stays in
``compat``, ``kv_planner`` and ``kv_allocation`` (none of which imports this module);
vLLM and vllm-omni are imported lazily.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pytest_kvconform.adapters import compat, executor_wire, kv_planner
from pytest_kvconform.contract.outcomes import SkipKind, Unsupported
from pytest_kvconform.contract.records import Case


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
        return executor_wire.rpc_message(self.rank_configs, self.max_model_len)


def default_memory(case: Case) -> int:
    """Bytes per rank that give ``case.num_pages`` physical pages."""
    spec = compat.attention_spec(case)
    return kv_planner.page_bytes(spec) * case.num_layers * case.num_pages


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
    with sizing_spy() as sized_with:
        rank_configs, scheduler_config = kv_planner.build_native_kv_cache_configs(
            vllm_config, specs, memory, indexes_kv_by_block_stride=need)
    return ControlPlane(need=need, case=case, world_size=n, device=device,
                        vllm_config=vllm_config, rank_configs=list(rank_configs),
                        scheduler_config=scheduler_config, available_memory=memory,
                        sized_with=list(sized_with))


@contextlib.contextmanager
def sizing_spy() -> Iterator[list[str | None]]:
    """Record the layout pinned on the config each time the control plane sizes.

    Wraps ``get_kv_cache_configs`` where vllm-omni's control plane looks it up
    (its ``initialization`` module), restoring it on exit.  Empty when the
    installed control plane sizes through another name.
    """
    module: Any = importlib.import_module("vllm_omni.diffusion.diffusion_kv.initialization")
    seen: list[str | None] = []
    original = getattr(module, "get_kv_cache_configs", None)
    if original is None:
        yield seen
        return

    def spy(vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(getattr(getattr(vllm_config, "cache_config", None), "kv_cache_layout", None))
        return original(vllm_config, *args, **kwargs)

    module.get_kv_cache_configs = spy
    try:
        yield seen
    finally:
        module.get_kv_cache_configs = original


class _RecordingExecutor:
    """The three executor calls the control plane makes, answered from fixed specs."""

    def __init__(self, specs: list[dict[str, Any]], memory: list[int]) -> None:
        self.specs = specs
        self.memory = memory
        self.worker_configs: list[Any] | None = None
        self.max_model_len: int | None = None

    def get_kv_cache_specs(self) -> list[dict[str, Any]]:
        return self.specs

    def determine_available_kv_memory(self, profile_requests: Any) -> list[int]:
        return self.memory

    def set_kv_cache_configs(self, worker_configs: list[Any], max_model_len: int) -> None:
        self.worker_configs = list(worker_configs)
        self.max_model_len = max_model_len


def run_production_control_plane(od_config: Any, specs: list[dict[str, Any]],
                                 available_memory: list[int], device: str = "cpu",
                                 ) -> tuple[Any, list[Any], Any]:
    """Run ``initialize_diffusion_kv_control_plane`` against a recording executor.

    Returns ``(vllm_config, worker configs the executor received, scheduler
    config)``.  The profile request is opaque to the control plane (it only
    hands it to the executor), so a placeholder stands in for it.
    """
    import torch

    module = importlib.import_module("vllm_omni.diffusion.diffusion_kv.initialization")
    control_plane = getattr(module, "initialize_diffusion_kv_control_plane", None)
    if control_plane is None:
        raise Unsupported("installed vllm-omni has no initialize_diffusion_kv_control_plane",
                          SkipKind.ENVIRONMENT)
    executor = _RecordingExecutor(specs, available_memory)
    result = control_plane(executor, od_config, profile_requests=[object()],
                           device=torch.device(device.split(":", 1)[0]))
    if result is None:
        raise Unsupported("the control plane declined to run for a paged diffusion "
                          "config (returned None)", SkipKind.ENVIRONMENT)
    scheduler_config, vllm_config = result[0], result[-1]
    return vllm_config, executor.worker_configs or [], scheduler_config


def production_control_plane_call() -> tuple[str, dict[str, Any]]:
    """How the production control plane calls ``build_native_kv_cache_configs``.

    Returns the caller's qualified name and the keyword arguments it passes,
    read from its source, so KV-L6 can tell whether a backend's need can reach
    the control plane at all.
    """
    import ast

    module = importlib.import_module("vllm_omni.diffusion.diffusion_kv.initialization")
    tree = ast.parse(inspect.getsource(module))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == \
                "build_native_kv_cache_configs":
            return "initialize_diffusion_kv_control_plane", {
                kw.arg: ast.unparse(kw.value) for kw in node.keywords if kw.arg}
    return "", {}
