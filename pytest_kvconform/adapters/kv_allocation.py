"""The worker side of the KV cache: tensors, views and their allocation, by the installed
vLLM / vllm-omni.

What a worker does with the configs the planner
(:mod:`~pytest_kvconform.adapters.kv_planner`) made, called with the signature the
installed version has (feature detection, as in :mod:`~pytest_kvconform.adapters.compat`);
and the ``KVCacheTensor`` / ``KVCacheConfig`` records the stride checks build by hand.
vLLM and vllm-omni are imported lazily, inside functions.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from functools import cache
from typing import Any

from pytest_kvconform.adapters import compat

# --- allocation ------------------------------------------------------------------


def build_kv_cache_tensor(spec: Any, num_blocks: int, layers: Sequence[str], layout_member: Any,
                          offset: int = 0) -> Any:
    from vllm_omni.diffusion.diffusion_kv.layout import build_kv_cache_tensor as build

    return build(spec, num_blocks, list(layers), layout=layout_member, offset=offset)


def create_kv_cache_views(raw: Any, spec: Any, num_blocks: int, layout_member: Any,
                          kv_cache_tensor: Any, kernel_block_size: int | None = None) -> list[Any]:
    from vllm.v1.kv_cache_interface import create_kv_cache_views as create

    return create(raw, spec, num_blocks, layout_member, kv_cache_tensor, kernel_block_size)


def allocate_kv_cache(kv_cache_config: Any, device: str, layout_member: Any,
                      kernel_block_sizes: list[int] | None = None) -> dict[str, Any]:
    import torch
    from vllm.v1.worker.utils import allocate_kv_cache as allocate

    return allocate(kv_cache_config, torch.device(device), layout_member, kernel_block_sizes)


@cache
def init_kv_cache_fn() -> Any:
    return compat.first_attribute("init_kv_cache",
                                  ("vllm.v1.worker.gpu.attn_utils", "vllm.v1.worker.utils"))


def init_kv_cache(vllm_config: Any, kv_cache_config: Any, device: str,
                  kernel_block_sizes: list[int] | None = None) -> dict[str, Any]:
    """Call the installed ``init_kv_cache`` with the signature it has.

    0.29: six positional arguments (+ allocation context); 0.30/0.31:
    ``(forward_context, kv_cache_config, device, kernel_block_sizes,
    vllm_config, ..., *, block_tables=None)``; 0.32 adds ``attn_groups``,
    0.34 ``allocate``.  Returns ``{layer name: view}``.
    """
    import torch

    fn = init_kv_cache_fn()
    params = compat.parameters(fn)
    if kernel_block_sizes is None:
        kernel_block_sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
    torch_device = torch.device(device)
    values: dict[str, Any] = {
        "forward_context": {},
        "kv_cache_config": kv_cache_config,
        "device": torch_device,
        "kernel_block_sizes": kernel_block_sizes,
        "vllm_config": vllm_config,
        "kv_cache_allocation_context": None,
        "block_tables": None,
        "attn_groups": None,
        "allocate": True,
        "runner_kv_caches": [],
        "kv_caches": [],
    }
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for name, param in params.items():
        if name not in values:
            if param.default is inspect.Parameter.empty:
                raise TypeError(f"installed init_kv_cache needs unknown argument {name!r}")
            continue
        if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD) and \
                param.default is inspect.Parameter.empty:
            args.append(values[name])
        elif name in ("forward_context", "kv_cache_config", "device", "kernel_block_sizes",
                      "vllm_config"):
            kwargs[name] = values[name]
    with compat.current_vllm_config(vllm_config):
        result = fn(*args, **kwargs)
    if isinstance(result, dict):
        return result
    if result is None and values["runner_kv_caches"]:
        return dict(enumerate(values["runner_kv_caches"]))  # type: ignore[arg-type]
    return dict(result) if result is not None else {}


# --- built by hand (KV-S) ---------------------------------------------------------


def kv_cache_tensor(size: int, layers: Sequence[str], layer_stride: int, block_stride: int,
                    offset: int = 0) -> Any:
    """A ``KVCacheTensor`` with the given placement (e.g. the oracle's numbers)."""
    from vllm.v1.kv_cache_interface import KVCacheTensor

    return KVCacheTensor(size=size, layers=list(layers), layer_stride=layer_stride,
                         block_stride=block_stride, offset=offset)


def kv_cache_config(num_blocks: int, tensors: Sequence[Any],
                    groups: Sequence[tuple[Sequence[str], Any]],
                    layout_name: str | None = None) -> Any:
    """A ``KVCacheConfig`` built by hand from tensors and ``(layer names, spec)`` groups."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=list(tensors),
        kv_cache_groups=[KVCacheGroupSpec(list(names), spec) for names, spec in groups],
    )
    if layout_name is not None and hasattr(config, "kv_cache_layout"):
        config.kv_cache_layout = layout_name
    return config
