"""The installed vLLM / vllm-omni API, adapted by feature detection.

Everything the checks call in production code goes through here or its two neighbours
(:mod:`~pytest_kvconform.adapters.kv_planner`, the KV-cache planner that sizes;
:mod:`~pytest_kvconform.adapters.kv_allocation`, the worker side's tensors and views), so
API drift between vLLM 0.29 and 0.34 is handled in one place: ``inspect.signature`` and
``hasattr``, never version strings.  vLLM and vllm-omni are imported lazily, inside
functions: importing this module costs nothing.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
from collections.abc import Iterator
from functools import cache
from typing import Any

from pytest_kvconform.contract.oracle import PHYSICAL_LAYOUTS
from pytest_kvconform.contract.outcomes import SkipKind, Unsupported
from pytest_kvconform.contract.records import Case, installed_version

# The six physical layouts of the contract (the oracle parses them from their letters).
LAYOUT_NAMES: tuple[str, ...] = PHYSICAL_LAYOUTS
# The layout vLLM's control plane runs with when none is pinned: the contract's default
# (vllm-omni pins it for a backend declaring False).  The harness's stamp
# (kv_planner.control_plane), kept apart from the check's own expectation
# (checks/layout.py) on purpose.
DEFAULT_LAYOUT = "LBNHC"
# A placeholder model type: init_kv_cache reads hf_config.model_type.
_MODEL_TYPE = "kvconform"
# The sequence limit the synthetic "model" declares; auto-fit may lower it.
MODEL_SEQ_LIMIT = 4096


def parameters(fn: Any) -> Any:
    """``inspect.signature(fn).parameters``: feature detection of an installed signature.

    Computed once per callable (and, for a class, per ``__init__``): a serial run asked ~490
    times (every KV-A deployment and many in-process checks build an ``OmniDiffusionConfig``),
    0.13 s of its test phase.
    """
    return _parameters(fn, getattr(fn, "__init__", None) if isinstance(fn, type) else None)


@cache
def _parameters(fn: Any, init: Any) -> Any:
    return inspect.signature(fn).parameters


def first_attribute(name: str, modules: tuple[str, ...]) -> Any:
    """``name`` from the first of ``modules`` that imports and has it (vLLM moves its
    functions between modules across versions); ImportError naming it if none does."""
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, name):
            return getattr(module, name)
    raise ImportError(f"installed vLLM has no {name}")


def versions() -> dict[str, str | None]:
    return {name: installed_version(name) for name in ("torch", "vllm", "vllm-omni", "pytest")}


def omni_installed() -> bool:
    return importlib.util.find_spec("vllm_omni") is not None


# The vllm-omni modules the control-plane clauses drive, beyond the registry.
PRODUCTION_MODULES = ("vllm_omni.diffusion.diffusion_kv.layout",
                      "vllm_omni.diffusion.vllm_config",
                      "vllm_omni.diffusion.diffusion_kv.initialization")


@cache
def production_import_error() -> str | None:
    """Why vllm-omni's production control plane cannot be imported here, or None.

    A vllm-omni release built for another vLLM can import its registry yet not
    its control plane; saying so once, up front, explains the clause failures.
    """
    if not omni_installed():
        return None
    for name in PRODUCTION_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:
            return (f"importing {name} fails on vllm {installed_version('vllm')} with vllm-omni "
                    f"{installed_version('vllm-omni')}: {type(exc).__name__}: {exc}")
    return None


def require_omni(clause: str) -> None:
    """Raise the standard skip of ``clause`` (the caller's) when vllm-omni is absent."""
    if not omni_installed():
        raise Unsupported("vllm-omni not installed", SkipKind.ENVIRONMENT).skip(clause)


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


def unresolved_layout_error_text() -> str:
    """The message ``get_resolved_kv_cache_layout`` raises while nothing is pinned."""
    from vllm.config import CacheConfig

    try:
        CacheConfig().get_resolved_kv_cache_layout()
    except ValueError as exc:
        return str(exc)
    return ""


# --- configs -----------------------------------------------------------------


def plain_vllm_config(device: str = "cpu") -> Any:
    """A bare ``VllmConfig`` with an unpinned ``CacheConfig`` (no device inference)."""
    from vllm.config import DeviceConfig, VllmConfig

    return VllmConfig(device_config=DeviceConfig(device=device_type(device)))


def device_type(device: str) -> str:
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
    from vllm_omni.diffusion.vllm_config import create_diffusion_vllm_config

    od_config = production_od_config(world_size=world_size, max_model_len=max_model_len)
    vllm_config = create_diffusion_vllm_config(torch.device(device_type(device)), od_config)
    if num_gpu_blocks_override is not None:
        vllm_config.cache_config.num_gpu_blocks_override = num_gpu_blocks_override
    return vllm_config


@contextlib.contextmanager
def current_vllm_config(vllm_config: Any) -> Iterator[None]:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        yield


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
            raise Unsupported("installed vLLM's AttentionSpec has no page_size_padded",
                              SkipKind.NOT_APPLICABLE)
        kwargs["page_size_padded"] = case.page_size_padded
    return FullAttentionSpec(**kwargs)


def layer_names(case: Case, group: int | None = None) -> list[str]:
    """Layer names of the case; with ``num_groups`` > 1 the layers are dealt to groups."""
    names = [f"model.layers.{i}.attn" for i in range(case.num_layers)]
    if group is None:
        return names
    return names[group::case.num_groups]


def sliding_window_spec(base: Any, window: int) -> Any:
    """A ``SlidingWindowSpec`` with ``base``'s geometry: a second cache group's spec."""
    import dataclasses

    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    kwargs = {f.name: getattr(base, f.name) for f in dataclasses.fields(SlidingWindowSpec)
              if f.init and f.name != "sliding_window" and hasattr(base, f.name)}
    return SlidingWindowSpec(**kwargs, sliding_window=window)


def worker_specs(case: Case) -> list[dict[str, Any]]:
    """One ``{layer name: spec}`` dict per rank, as each worker reports it.

    Several groups are made by giving the layers of group ``g > 0`` a
    ``SlidingWindowSpec`` (window ``block_size * (g + 1)``): a different spec
    *type*, which vLLM groups separately when the hybrid KV cache manager is on (see
    :func:`~pytest_kvconform.adapters.kv_planner.enable_hybrid_kv_cache_manager`).  A
    ``FullAttentionSpec`` with a ``sliding_window`` merges into the full-attention group and
    gives one group.
    """
    specs: dict[str, Any] = {}
    for group in range(case.num_groups):
        spec = attention_spec(case)
        if group:
            spec = sliding_window_spec(spec, case.block_size * (group + 1))
        for name in layer_names(case, group):
            specs[name] = spec
    ordered = {name: specs[name] for name in layer_names(case)}
    return [dict(ordered) for _ in range(case.world_size)]


# --- layout clauses (KV-L3..KV-L8) ------------------------------------------------

LAYOUT_ENV_VAR = "VLLM_KV_CACHE_LAYOUT"


def layout_aliases() -> dict[str, str]:
    """The legacy layout names upstream's ``CacheConfig`` accepts, alias -> canonical.

    Read from vLLM itself (``vllm.config.cache._LAYOUT_COMPAT_ALIASES``), so the
    suite asks vllm-omni for exactly what upstream promises users; empty when the
    installed vLLM accepts no alias.
    """
    module = importlib.import_module("vllm.config.cache")
    return dict(getattr(module, "_LAYOUT_COMPAT_ALIASES", {}) or {})


def kv_cache_config_with_layout(name: str) -> Any:
    """An empty ``KVCacheConfig`` stamped with a layout name, as the control plane sends it."""
    from vllm.v1.kv_cache_interface import KVCacheConfig

    config = KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=[])
    config.kv_cache_layout = name
    return config


@contextlib.contextmanager
def backend_selected(name: str, path: str) -> Iterator[str]:
    """The name under which production selects this backend, for the duration.

    A registry member is selected by its own name.  Any other backend (a
    stand-in, a hook or entry-point backend) is plugged in the way a backend
    repository does it, as a ``register_diffusion_backend`` override of a
    registry member, so a control plane that resolves the selected name through
    the registry finds it; the previous override is restored afterwards.  The
    layer selector's cache of resolved classes is cleared both ways: production
    re-points a member once, before any layer exists, where this process re-points
    it per check.
    """
    from vllm_omni.diffusion.attention.backends.registry import (
        DiffusionAttentionBackendEnum,
        register_diffusion_backend,
    )

    members = DiffusionAttentionBackendEnum.__members__
    if name in members:
        yield name
        return
    member = members.get("TORCH_SDPA") or next(iter(DiffusionAttentionBackendEnum))
    previous = member.get_path() if member.is_overridden() else None
    register_diffusion_backend(member, path)
    _clear_selector_cache()
    try:
        yield member.name
    finally:
        if previous is None:
            member.clear_override()
        else:
            register_diffusion_backend(member, previous)
        _clear_selector_cache()


def _clear_selector_cache() -> None:
    """Forget the classes vllm-omni's layer selector resolved (where it caches them)."""
    try:
        selector = importlib.import_module("vllm_omni.diffusion.attention.selector")
    except ImportError:
        return
    clear = getattr(getattr(selector, "_cached_get_backend_cls", None), "cache_clear", None)
    if clear is not None:
        clear()


def production_od_config(*, attention_backend: str | None = None, world_size: int = 1,
                         max_model_len: int = -1, extra: dict[str, Any] | None = None) -> Any:
    """The ``OmniDiffusionConfig`` of a paged diffusion model served with ``attention_backend``.

    The backend is selected the way a user selects it
    (``diffusion_attention_config.default.backend``), so a control plane that
    consults the selected backend sees it.  ``extra``: further fields, each passed
    only where the installed ``OmniDiffusionConfig`` has it (feature detection).
    """
    from vllm_omni.diffusion.data import OmniDiffusionConfig, TransformerConfig
    from vllm_omni.diffusion.diffusion_kv.config import DiffusionKVCacheMode

    kwargs: dict[str, Any] = {
        "diffusion_kv_mode": DiffusionKVCacheMode.PAGED_SCHEDULER,
        "max_model_len": max_model_len,
        "diffusion_kv_max_rows_per_request": 1,
        "tf_model_config": TransformerConfig(params={
            "max_position_embeddings": MODEL_SEQ_LIMIT, "model_type": _MODEL_TYPE}),
    }
    params = parameters(OmniDiffusionConfig)
    if "num_gpus" in params:
        kwargs["num_gpus"] = world_size
    if attention_backend is not None and "diffusion_attention_config" in params:
        kwargs["diffusion_attention_config"] = {"default": {"backend": attention_backend}}
    kwargs.update({k: v for k, v in (extra or {}).items() if k in params})
    return OmniDiffusionConfig(**kwargs)


def device_free_memory(device: str) -> int | None:
    """Free bytes on a CUDA device (None on CPU), for KV-A6's sizing."""
    import torch

    if not device.startswith("cuda"):
        return None
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


# --- KV-L7: the paged read path ------------------------------------------------------


def paged_attention_context(*, layer: Any, query: Any, key_write: Any, value_write: Any,
                            slot_mapping: Any, native_metadata: Any,
                            query_token_shape: tuple[int, ...]) -> Any:
    """vllm-omni's ``DiffusionPagedAttentionContext`` for one layer, without a piecewise plan.

    The backend's ``forward_paged`` receives the production type; fields the
    installed version adds beyond these are left at their defaults.
    """
    from vllm_omni.diffusion.diffusion_kv.paged_attention_adapter import (
        DiffusionPagedAttentionContext,
    )

    values: dict[str, Any] = {
        "layer": layer, "query": query, "key_write": key_write, "value_write": value_write,
        "slot_mapping": slot_mapping, "native_metadata": native_metadata,
        "piecewise_plan": None, "piecewise_native_metadata": (),
        "query_token_shape": query_token_shape, "query_has_head_dims": True,
    }
    params = parameters(DiffusionPagedAttentionContext)
    return DiffusionPagedAttentionContext(**{k: v for k, v in values.items() if k in params})
