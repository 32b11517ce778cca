"""The KV-cache planner the installed stack sizes with: rank configs, scheduler config,
block pools.

Apart from :mod:`~pytest_kvconform.adapters.compat` because it is the one adapter with a
fallback of its own: vllm-omni's control plane where vllm-omni is installed, else vLLM's
own engine-core calls on a weightless model config (every result says which in ``via``).
Whether vllm-omni is installed is asked of ``compat.omni_installed`` alone, the one place
the checks ask.  vLLM and vllm-omni are imported lazily, inside functions.
"""

from __future__ import annotations

import importlib
import inspect
from functools import cache
from pathlib import Path
from typing import Any

from pytest_kvconform.adapters import compat

# --- vLLM's planner ------------------------------------------------------------------


def get_kv_cache_configs_fn() -> Any:
    """``get_kv_cache_configs``: moved to ``kv_cache_planning`` in vLLM 0.33."""
    return compat.first_attribute("get_kv_cache_configs", ("vllm.v1.core.kv_cache_planning",
                                                           "vllm.v1.core.kv_cache_utils"))


def get_kv_cache_configs(vllm_config: Any, specs: list[dict[str, Any]],
                         available_memory: list[int]) -> list[Any]:
    """Upstream's planner.  Where it takes the model's global cache groups (0.33), they
    come from the same module's ``get_global_kv_cache_groups``, as the engine core's."""
    fn = get_kv_cache_configs_fn()
    if "global_kv_cache_groups" in compat.parameters(fn):
        groups = importlib.import_module(fn.__module__).get_global_kv_cache_groups(
            vllm_config, specs)
        return fn(vllm_config, specs, available_memory, groups)
    return fn(vllm_config, specs, available_memory)


def generate_scheduler_kv_cache_config(worker_configs: list[Any]) -> Any:
    """Upstream's scheduler-side ``KVCacheConfig`` from the ranks' configs."""
    generate = compat.first_attribute("generate_scheduler_kv_cache_config",
                                      ("vllm.v1.core.kv_cache_utils",
                                       "vllm.v1.core.kv_cache_planning"))
    return generate(worker_configs)


def enable_hybrid_kv_cache_manager(vllm_config: Any) -> bool:
    """Let the planner keep different attention types in separate cache groups.

    vllm-omni's diffusion config disables the hybrid manager, which folds every
    layer into one group; False when the installed config has no such switch.
    """
    scheduler_config = getattr(vllm_config, "scheduler_config", None)
    if scheduler_config is None or not hasattr(scheduler_config,
                                               "disable_hybrid_kv_cache_manager"):
        return False
    scheduler_config.disable_hybrid_kv_cache_manager = False
    return True


# --- vllm-omni's control plane ----------------------------------------------------------


def build_native_kv_cache_configs(vllm_config: Any, specs: list[dict[str, Any]],
                                  available_memory: list[int], *,
                                  indexes_kv_by_block_stride: bool | None = None,
                                  ) -> tuple[list[Any], Any]:
    """vllm-omni's control plane: pin the layout, size, stamp the name on every config.

    ``indexes_kv_by_block_stride=None`` calls it exactly as production does
    (``initialize_diffusion_kv_control_plane`` passes nothing).
    """
    from vllm_omni.diffusion.diffusion_kv.initialization import (
        build_native_kv_cache_configs as build,
    )

    kwargs = {}
    if indexes_kv_by_block_stride is not None:
        kwargs["indexes_kv_by_block_stride"] = indexes_kv_by_block_stride
    return build(vllm_config, specs, available_memory, **kwargs)


# --- the control plane that sizes (KV-S's planner, KV-N): vllm-omni's, or vLLM's own ------

# Where vllm-omni is not installed, the sizing clauses run on vLLM alone: its engine core's
# control plane on its own VllmConfig for this weightless model config (a Llama declaring
# MODEL_SEQ_LIMIT positions; no weights, no tokenizer), which every result says in ``via``.
UPSTREAM_MODEL_DIR = Path(__file__).with_name("upstream_model")
UPSTREAM_CONTROL_PLANE = ("vLLM alone (vllm-omni not installed): vLLM's engine-core control "
                          "plane (register_all_kvcache_specs, get_kv_cache_configs, "
                          "generate_scheduler_kv_cache_config) on its own VllmConfig for a "
                          "weightless model config")


def control_plane_via() -> str | None:
    """What sizes in place of vllm-omni's control plane here (None: vllm-omni's runs)."""
    return None if compat.omni_installed() else UPSTREAM_CONTROL_PLANE


def control_plane_config(device: str = "cpu", *, max_model_len: int = -1,
                         num_gpu_blocks_override: int | None = None,
                         world_size: int = 1) -> Any:
    """The ``VllmConfig`` the installed control plane sizes with.

    vllm-omni's production config where vllm-omni is installed; else vLLM's own for the
    weightless model of :data:`UPSTREAM_MODEL_DIR` (``max_model_len=-1``: auto-fit).
    """
    if compat.omni_installed():
        return compat.production_vllm_config(device, max_model_len=max_model_len,
                                             num_gpu_blocks_override=num_gpu_blocks_override,
                                             world_size=world_size)
    import copy

    from vllm.config import DeviceConfig, VllmConfig

    vllm_config = VllmConfig(model_config=copy.deepcopy(_upstream_model_config(max_model_len)),
                             device_config=DeviceConfig(device=compat.device_type(device)))
    if num_gpu_blocks_override is not None:
        vllm_config.cache_config.num_gpu_blocks_override = num_gpu_blocks_override
    return vllm_config


@cache
def _upstream_model_config(max_model_len: int) -> Any:
    """vLLM's ``ModelConfig`` of the weightless model (the first call pays vLLM's imports)."""
    from vllm.config import ModelConfig

    wanted = {"model": str(UPSTREAM_MODEL_DIR), "tokenizer": str(UPSTREAM_MODEL_DIR),
              "skip_tokenizer_init": True, "max_model_len": max_model_len, "dtype": "float32"}
    params = compat.parameters(ModelConfig)
    return ModelConfig(**{k: v for k, v in wanted.items() if k in params})


def control_plane(vllm_config: Any, specs: list[dict[str, Any]],
                  available_memory: list[int]) -> tuple[list[Any], Any]:
    """``(rank configs, scheduler config)`` from the installed control plane.

    vllm-omni's ``build_native_kv_cache_configs``, exactly as production calls it; where
    vllm-omni is absent, what vLLM's engine core does (``EngineCore._initialize_kv_caches``):
    register the spec types, size every rank, stamp the layout
    (:data:`~pytest_kvconform.adapters.compat.DEFAULT_LAYOUT` unless one is pinned) on each
    config and derive the scheduler's.
    """
    if compat.omni_installed():
        return build_native_kv_cache_configs(vllm_config, specs, available_memory)
    cache_config = vllm_config.cache_config
    if cache_config.kv_cache_layout is None:
        cache_config.kv_cache_layout = compat.DEFAULT_LAYOUT
    managers = importlib.import_module("vllm.v1.core.single_type_kv_cache_manager")
    register = getattr(managers, "register_all_kvcache_specs", None)
    if register is not None:
        register(vllm_config)
    worker_configs = get_kv_cache_configs(vllm_config, specs, available_memory)
    for config in worker_configs:
        config.kv_cache_layout = cache_config.kv_cache_layout
    return worker_configs, generate_scheduler_kv_cache_config(worker_configs)


# --- pages and block pools (KV-N) ---------------------------------------------------


def page_bytes(spec: Any) -> int:
    return int(spec.page_size_bytes)


def block_pool(num_blocks: int) -> Any:
    from vllm.v1.core.block_pool import BlockPool

    params = compat.parameters(BlockPool)
    kwargs: dict[str, Any] = {"num_gpu_blocks": num_blocks, "enable_caching": False}
    if "hash_block_size" in params:
        kwargs["hash_block_size"] = 16
    return BlockPool(**kwargs)


def scheduler_block_pool(vllm_config: Any, scheduler_kv_cache_config: Any) -> Any:
    """The ``BlockPool`` the scheduler's ``KVCacheManager`` builds from its config.

    Built the way the engine does (block sizes from ``resolve_kv_cache_block_sizes``),
    so KV-N2 sees what admission sees; arguments are matched by parameter name.
    """
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from_utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    resolve = getattr(from_utils, "resolve_kv_cache_block_sizes", None)
    if resolve is not None:
        scheduler_block_size, hash_block_size = resolve(scheduler_kv_cache_config, vllm_config)
    else:
        groups = scheduler_kv_cache_config.kv_cache_groups
        scheduler_block_size = hash_block_size = groups[0].kv_cache_spec.block_size
    values: dict[str, Any] = {
        "kv_cache_config": scheduler_kv_cache_config,
        "max_model_len": vllm_config.model_config.max_model_len,
        "scheduler_block_size": scheduler_block_size,
        "hash_block_size": hash_block_size,
        "enable_caching": False,
    }
    kwargs: dict[str, Any] = {}
    for name, param in compat.parameters(KVCacheManager).items():
        if name in values:
            kwargs[name] = values[name]
        elif param.default is inspect.Parameter.empty and param.kind not in (
                param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"installed KVCacheManager needs unknown argument {name!r}")
    manager = KVCacheManager(**kwargs)
    pool = getattr(manager, "block_pool", None)
    return pool if pool is not None else manager.coordinator.block_pool
