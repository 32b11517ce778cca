"""The installed vLLM / vllm-omni API, adapted by feature detection.

Everything the checks call in production code goes through here, so API drift
between vLLM 0.29 and 0.34 is handled in one place: ``inspect.signature`` and
``hasattr``, never version strings.  vLLM and vllm-omni are imported lazily,
inside functions: importing this module costs nothing.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
from collections.abc import Iterator, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from pytest_kvconform.contract.oracle import PHYSICAL_LAYOUTS
from pytest_kvconform.contract.outcomes import SkipKind, Unsupported
from pytest_kvconform.contract.records import Case, installed_version

# The six physical layouts of the contract (the oracle parses them from their letters).
LAYOUT_NAMES: tuple[str, ...] = PHYSICAL_LAYOUTS
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
    from vllm_omni.diffusion.vllm_config import create_diffusion_vllm_config

    od_config = production_od_config(world_size=world_size, max_model_len=max_model_len)
    vllm_config = create_diffusion_vllm_config(torch.device(_device_type(device)), od_config)
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


def worker_specs(case: Case) -> list[dict[str, Any]]:
    """One ``{layer name: spec}`` dict per rank, as each worker reports it.

    Several groups are made by giving the layers of group ``g > 0`` a
    ``SlidingWindowSpec`` (window ``block_size * (g + 1)``): a different spec
    *type*, which vLLM groups separately when the hybrid KV cache manager is on
    (see :func:`enable_hybrid_kv_cache_manager`).  A ``FullAttentionSpec`` with a
    ``sliding_window`` merges into the full-attention group and gives one group.
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
    """Upstream's planner.  Where it takes the model's global cache groups (0.33), they
    come from the same module's ``get_global_kv_cache_groups``, as the engine core's."""
    fn = get_kv_cache_configs_fn()
    if "global_kv_cache_groups" in parameters(fn):
        groups = importlib.import_module(fn.__module__).get_global_kv_cache_groups(
            vllm_config, specs)
        return fn(vllm_config, specs, available_memory, groups)
    return fn(vllm_config, specs, available_memory)


def generate_scheduler_kv_cache_config(worker_configs: list[Any]) -> Any:
    """Upstream's scheduler-side ``KVCacheConfig`` from the ranks' configs."""
    for module_name in ("vllm.v1.core.kv_cache_utils", "vllm.v1.core.kv_cache_planning"):
        module = importlib.import_module(module_name)
        fn = getattr(module, "generate_scheduler_kv_cache_config", None)
        if fn is not None:
            return fn(worker_configs)
    raise ImportError("installed vLLM has no generate_scheduler_kv_cache_config")


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
# The layout vLLM's control plane runs with when none is pinned: the contract's default
# (vllm-omni pins it for a backend declaring False).
DEFAULT_LAYOUT = "LBNHC"


def control_plane_via() -> str | None:
    """What sizes in place of vllm-omni's control plane here (None: vllm-omni's runs)."""
    return None if omni_installed() else UPSTREAM_CONTROL_PLANE


def control_plane_config(device: str = "cpu", *, max_model_len: int = -1,
                         num_gpu_blocks_override: int | None = None,
                         world_size: int = 1) -> Any:
    """The ``VllmConfig`` the installed control plane sizes with.

    vllm-omni's production config where vllm-omni is installed; else vLLM's own for the
    weightless model of :data:`UPSTREAM_MODEL_DIR` (``max_model_len=-1``: auto-fit).
    """
    if omni_installed():
        return production_vllm_config(device, max_model_len=max_model_len,
                                      num_gpu_blocks_override=num_gpu_blocks_override,
                                      world_size=world_size)
    import copy

    from vllm.config import DeviceConfig, VllmConfig

    vllm_config = VllmConfig(model_config=copy.deepcopy(_upstream_model_config(max_model_len)),
                             device_config=DeviceConfig(device=_device_type(device)))
    if num_gpu_blocks_override is not None:
        vllm_config.cache_config.num_gpu_blocks_override = num_gpu_blocks_override
    return vllm_config


@cache
def _upstream_model_config(max_model_len: int) -> Any:
    """vLLM's ``ModelConfig`` of the weightless model (the first call pays vLLM's imports)."""
    from vllm.config import ModelConfig

    wanted = {"model": str(UPSTREAM_MODEL_DIR), "tokenizer": str(UPSTREAM_MODEL_DIR),
              "skip_tokenizer_init": True, "max_model_len": max_model_len, "dtype": "float32"}
    params = parameters(ModelConfig)
    return ModelConfig(**{k: v for k, v in wanted.items() if k in params})


def control_plane(vllm_config: Any, specs: list[dict[str, Any]],
                  available_memory: list[int]) -> tuple[list[Any], Any]:
    """``(rank configs, scheduler config)`` from the installed control plane.

    vllm-omni's ``build_native_kv_cache_configs``, exactly as production calls it; where
    vllm-omni is absent, what vLLM's engine core does (``EngineCore._initialize_kv_caches``):
    register the spec types, size every rank, stamp the layout (:data:`DEFAULT_LAYOUT`
    unless one is pinned) on each config and derive the scheduler's.
    """
    if omni_installed():
        return build_native_kv_cache_configs(vllm_config, specs, available_memory)
    cache_config = vllm_config.cache_config
    if cache_config.kv_cache_layout is None:
        cache_config.kv_cache_layout = DEFAULT_LAYOUT
    managers = importlib.import_module("vllm.v1.core.single_type_kv_cache_manager")
    register = getattr(managers, "register_all_kvcache_specs", None)
    if register is not None:
        register(vllm_config)
    worker_configs = get_kv_cache_configs(vllm_config, specs, available_memory)
    for config in worker_configs:
        config.kv_cache_layout = cache_config.kv_cache_layout
    return worker_configs, generate_scheduler_kv_cache_config(worker_configs)


def page_bytes(spec: Any) -> int:
    return int(spec.page_size_bytes)


def block_pool(num_blocks: int) -> Any:
    from vllm.v1.core.block_pool import BlockPool

    params = parameters(BlockPool)
    kwargs: dict[str, Any] = {"num_gpu_blocks": num_blocks, "enable_caching": False}
    if "hash_block_size" in params:
        kwargs["hash_block_size"] = 16
    return BlockPool(**kwargs)


# --- null-block sizing (KV-N) -----------------------------------------------------


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
    for name, param in parameters(KVCacheManager).items():
        if name in values:
            kwargs[name] = values[name]
        elif param.default is inspect.Parameter.empty and param.kind not in (
                param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"installed KVCacheManager needs unknown argument {name!r}")
    manager = KVCacheManager(**kwargs)
    pool = getattr(manager, "block_pool", None)
    return pool if pool is not None else manager.coordinator.block_pool


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
    params = parameters(fn)
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


# --- KV-S: stride derivation (strides.py) ------------------------------------------


def sliding_window_spec(base: Any, window: int) -> Any:
    """A ``SlidingWindowSpec`` with ``base``'s geometry: a second cache group's spec."""
    import dataclasses

    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    kwargs = {f.name: getattr(base, f.name) for f in dataclasses.fields(SlidingWindowSpec)
              if f.init and f.name != "sliding_window" and hasattr(base, f.name)}
    return SlidingWindowSpec(**kwargs, sliding_window=window)


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
