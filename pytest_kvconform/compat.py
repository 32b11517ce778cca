"""The installed vLLM / vllm-omni API, adapted by feature detection.

Everything the checks call in production code goes through here, so API drift
between vLLM 0.29 and 0.34 is handled in one place: ``inspect.signature`` and
``hasattr``, never version strings.  vLLM and vllm-omni are imported lazily,
inside functions: importing this module costs nothing.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
from collections.abc import Iterator, Sequence
from functools import cache
from typing import Any

from pytest_kvconform.checks.errors import ClauseSkip, SkipKind
from pytest_kvconform.model import Case

LAYOUT_NAMES: tuple[str, ...] = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
# A placeholder model type: init_kv_cache reads hf_config.model_type.
_MODEL_TYPE = "kvconform"
# The sequence limit the synthetic "model" declares; auto-fit may lower it.
MODEL_SEQ_LIMIT = 4096


def version_of(dist: str) -> str | None:
    """Installed distribution version, without importing it."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    return {name: version_of(name) for name in ("torch", "vllm", "vllm-omni", "pytest")}


def omni_installed() -> bool:
    return importlib.util.find_spec("vllm_omni") is not None


def require_omni(clause: str) -> None:
    """Raise the standard skip when a clause needs vllm-omni and it is absent."""
    if not omni_installed():
        raise ClauseSkip(clause, "vllm-omni not installed", SkipKind.ENVIRONMENT)


# --- layouts -----------------------------------------------------------------


def layout_enum() -> Any:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return KVCacheLayout


def layout(name: str) -> Any:
    return layout_enum()[name]


def omni_layout_module() -> Any:
    return importlib.import_module("vllm_omni.diffusion.diffusion_kv.layout")


def resolve_diffusion_layout(vllm_config: Any, *, indexes_kv_by_block_stride: bool,
                             required_layout: Any = None) -> Any:
    return omni_layout_module().resolve_diffusion_kv_cache_layout(
        vllm_config,
        indexes_kv_by_block_stride=indexes_kv_by_block_stride,
        required_layout=required_layout,
    )


def adopt_layout(vllm_config: Any, kv_cache_config: Any) -> Any:
    return omni_layout_module().adopt_kv_cache_layout(vllm_config, kv_cache_config)


def assert_backend_layout_supported(vllm_config: Any, backend_cls: Any) -> None:
    omni_layout_module().assert_backend_layout_supported(vllm_config, backend_cls)


# --- configs -----------------------------------------------------------------


def plain_vllm_config(device: str = "cpu") -> Any:
    """A bare ``VllmConfig`` with an unpinned ``CacheConfig`` (no device inference)."""
    from vllm.config import DeviceConfig, VllmConfig

    return VllmConfig(device_config=DeviceConfig(device=_device_type(device)))


def _device_type(device: str) -> str:
    return device.split(":", 1)[0]


def production_vllm_config(
    device: str = "cpu",
    *,
    max_model_len: int = -1,
    num_gpu_blocks_override: int | None = None,
    world_size: int = 1,
) -> Any:
    """The config vllm-omni's production builder makes for a paged diffusion model.

    ``create_diffusion_vllm_config`` is what the engine and every worker call;
    ``max_model_len=-1`` asks for auto-fit against a declared limit of
    ``MODEL_SEQ_LIMIT`` tokens.
    """
    import torch
    from vllm_omni.diffusion.data import OmniDiffusionConfig, TransformerConfig
    from vllm_omni.diffusion.diffusion_kv.config import DiffusionKVCacheMode
    from vllm_omni.diffusion.vllm_config import create_diffusion_vllm_config

    kwargs: dict[str, Any] = {
        "diffusion_kv_mode": DiffusionKVCacheMode.PAGED_SCHEDULER,
        "max_model_len": max_model_len,
        "diffusion_kv_max_rows_per_request": 1,
        "tf_model_config": TransformerConfig(params={
            "max_position_embeddings": MODEL_SEQ_LIMIT, "model_type": _MODEL_TYPE}),
    }
    params = inspect.signature(OmniDiffusionConfig).parameters
    if "num_gpus" in params:
        kwargs["num_gpus"] = world_size
    od_config = OmniDiffusionConfig(**kwargs)
    vllm_config = create_diffusion_vllm_config(torch.device(_device_type(device)), od_config)
    if num_gpu_blocks_override is not None:
        vllm_config.cache_config.num_gpu_blocks_override = num_gpu_blocks_override
    return vllm_config


@contextlib.contextmanager
def current_vllm_config(vllm_config: Any) -> Iterator[None]:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        yield


@contextlib.contextmanager
def env_var(name: str, value: str | None) -> Iterator[None]:
    """Set (or unset) an environment variable and restore it, whatever happens."""
    old = os.environ.get(name)
    try:
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


# --- specs ---------------------------------------------------------------------


def torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def attention_spec(case: Case, *, block_size: int | None = None) -> Any:
    """A ``FullAttentionSpec`` for the case; keyword-only fields by feature detection."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    kwargs: dict[str, Any] = {
        "block_size": block_size or case.block_size,
        "num_kv_heads": case.num_kv_heads,
        "head_size": case.head_size,
        "dtype": torch_dtype(case.dtype),
    }
    if case.page_size_padded is not None:
        fields = getattr(FullAttentionSpec, "__dataclass_fields__", {})
        if "page_size_padded" not in fields:
            raise ClauseSkip("KV-S4", "installed vLLM's AttentionSpec has no page_size_padded",
                             SkipKind.NOT_APPLICABLE)
        kwargs["page_size_padded"] = case.page_size_padded
    return FullAttentionSpec(**kwargs)


def layer_names(case: Case, group: int | None = None) -> list[str]:
    """Layer names of the case; with ``num_groups`` > 1 the layers are dealt to groups."""
    names = [f"model.layers.{i}.attn" for i in range(case.num_layers)]
    if group is None:
        return names
    return names[group::case.num_groups]


def worker_specs(case: Case) -> list[dict[str, Any]]:
    """One ``{layer name: spec}`` dict per rank, as each worker reports it.

    Several groups are made by giving alternate layers specs that differ
    (a sliding window), which vLLM groups separately.
    """
    specs: dict[str, Any] = {}
    for group in range(case.num_groups):
        spec = attention_spec(case)
        if group:
            from dataclasses import replace

            spec = replace(spec, sliding_window=case.block_size * (group + 1))
        for name in layer_names(case, group):
            specs[name] = spec
    ordered = {name: specs[name] for name in layer_names(case)}
    return [dict(ordered) for _ in range(case.world_size)]


# --- control plane -------------------------------------------------------------


def get_kv_cache_configs_fn() -> Any:
    """``get_kv_cache_configs``: moved to ``kv_cache_planning`` in vLLM 0.33."""
    for module_name in ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, "get_kv_cache_configs"):
            return module.get_kv_cache_configs
    raise ImportError("installed vLLM has no get_kv_cache_configs")


def get_kv_cache_configs(vllm_config: Any, specs: list[dict[str, Any]],
                         available_memory: list[int]) -> list[Any]:
    """Upstream's planner; extra parameters (0.33+) are left at their defaults."""
    fn = get_kv_cache_configs_fn()
    return fn(vllm_config, specs, available_memory)


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


def page_bytes(spec: Any) -> int:
    return int(spec.page_size_bytes)


def block_pool(num_blocks: int) -> Any:
    from vllm.v1.core.block_pool import BlockPool

    params = inspect.signature(BlockPool).parameters
    kwargs: dict[str, Any] = {"num_gpu_blocks": num_blocks, "enable_caching": False}
    if "hash_block_size" in params:
        kwargs["hash_block_size"] = 16
    return BlockPool(**kwargs)


# --- worker side -----------------------------------------------------------------


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
    for module_name in ("vllm.v1.worker.gpu.attn_utils", "vllm.v1.worker.utils"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, "init_kv_cache"):
            return module.init_kv_cache
    raise ImportError("installed vLLM has no init_kv_cache")


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
    params = inspect.signature(fn).parameters
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
    with current_vllm_config(vllm_config):
        result = fn(*args, **kwargs)
    if isinstance(result, dict):
        return result
    if result is None and values["runner_kv_caches"]:
        return dict(enumerate(values["runner_kv_caches"]))  # type: ignore[arg-type]
    return dict(result) if result is not None else {}


def unresolved_layout_error_text() -> str:
    """The message ``get_resolved_kv_cache_layout`` raises while nothing is pinned."""
    from vllm.config import CacheConfig

    try:
        CacheConfig().get_resolved_kv_cache_layout()
    except ValueError as exc:
        return str(exc)
    return ""
