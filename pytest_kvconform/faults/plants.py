"""Faults planted in this process's installed vLLM / vllm-omni: layout, strides, null block.

Each fault is a few :class:`Patch` records: an attribute of the installed stack (a
function where production looks it up at call time) replaced by ``make(original)``,
the function a regression would leave there, which mostly delegates to the original.
The checks and the oracle are never touched.  ``tests/seeding.py`` plants them for one
test (with pytest's ``monkeypatch``), ``kvconform selftest`` in a fresh process
(:func:`planted`).

Each fault is declared once, here, with :func:`declare`: its name, the clauses whose
checks must catch it, what it does wrong, its patches and what the guarding checks run
on.  ``faults/registry.py`` registers every declaration (:data:`PLANTED`) for
``kvconform selftest``; a new clause's seeded fault is one ``declare`` (and its ``make``
function) in this file.

A fault that cannot be planted on the installed version (its module does not import,
the attribute it replaces is gone, or what the replacement needs is missing) raises
:class:`Unplantable` naming why, before anything is replaced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

_LAYOUT = "vllm_omni.diffusion.diffusion_kv.layout"
RESOLVER = f"{_LAYOUT}:resolve_diffusion_kv_cache_layout"
BUILD_TENSOR = f"{_LAYOUT}:build_kv_cache_tensor"
# create_kv_cache_views where the checks and where allocate_kv_cache look it up.
VIEWS = "vllm.v1.kv_cache_interface:create_kv_cache_views"
VIEWS_IN_ALLOCATE = "vllm.v1.worker.utils:create_kv_cache_views"
KV_CACHE_UTILS = "vllm.v1.core.kv_cache_utils"
GET_NEW_BLOCKS = "vllm.v1.core.block_pool:BlockPool.get_new_blocks"
# get_kv_cache_configs where vllm-omni's control plane looks it up.
RANK_SIZING = "vllm_omni.diffusion.diffusion_kv.initialization:get_kv_cache_configs"


# The backends the guarding checks of a layout fault run against: a plain registry backend
# (the paged read faults name a stand-in of ``adapters/paged_standins.py``).
PLAIN = "TORCH_SDPA"


class Unplantable(RuntimeError):
    """The installed version lacks what a planted fault replaces or needs."""


@dataclass(frozen=True)
class Patch:
    """``target`` (``module:attr`` or ``module:Class.attr``) replaced by ``make(original)``."""

    target: str
    make: Callable[[Any], Any]


@dataclass(frozen=True)
class Planted:
    """A planted fault as :func:`declare` declared it (``faults/registry.py`` registers it)."""

    name: str
    clauses: tuple[str, ...]  # the clauses whose checks must catch it
    what: str  # what the planted code does wrong, in words
    patches: tuple[Patch, ...]
    backend: str | None = None  # what the guarding checks run against (None: no backend)
    cases: tuple[str, ...] = ("bf16_h8",)  # the spec cases they run on
    family: str | None = None  # the registry's family; None: its first clause's


# Every planted fault, in declaration order: the selftest's order.
PLANTED: dict[str, Planted] = {}


def declare(name: str, clauses: tuple[str, ...], what: str, *patches: Patch,
            backend: str | None = None, cases: tuple[str, ...] = ("bf16_h8",),
            family: str | None = None) -> tuple[Patch, ...]:
    """Declare a planted fault (the one place it is declared); its patches, for the tests
    that plant it by hand (``seed.plant(plants.HAND_STRIDES)``)."""
    if name in PLANTED:
        raise ValueError(f"planted fault {name!r} is declared twice")
    PLANTED[name] = Planted(name, tuple(clauses), what, patches, backend, tuple(cases), family)
    return patches


def owner(target: str) -> tuple[Any, str]:
    """(the module or class holding ``target``, its attribute name); :class:`Unplantable`
    if the module does not import or the attribute is gone."""
    module, _, path = target.partition(":")
    try:
        holder: Any = importlib.import_module(module)
    except Exception as exc:
        raise Unplantable(f"{module} does not import ({type(exc).__name__}: {exc})") from None
    *classes, name = path.split(".")
    for part in [*classes, name]:
        if not hasattr(holder, part):
            raise Unplantable(f"{target.replace(':', '.')} is gone on this version "
                              f"({getattr(holder, '__name__', holder)!s} has no {part!r})")
        if part != name:
            holder = getattr(holder, part)
    return holder, name


def replacements(patches: Sequence[Patch]) -> list[tuple[Any, str, Any]]:
    """(owner, name, replacement) for each patch, every one resolved before any is applied."""
    out = []
    for patch in patches:
        holder, name = owner(patch.target)
        try:
            out.append((holder, name, patch.make(getattr(holder, name))))
        except Unplantable:
            raise
        except Exception as exc:  # what the replacement needs is missing here
            raise Unplantable(f"{patch.target.replace(':', '.')}: the fault cannot be built on "
                              f"this version ({type(exc).__name__}: {exc})") from None
    return out


@contextlib.contextmanager
def planted(patches: Sequence[Patch]) -> Iterator[None]:
    """For the duration: every patch applied; the originals put back afterwards."""
    applied = replacements(patches)
    undo = [(holder, name, vars(holder).get(name, _ABSENT)) for holder, name, _ in applied]
    try:
        for holder, name, value in applied:
            setattr(holder, name, value)
        yield
    finally:
        for holder, name, original in reversed(undo):
            if original is _ABSENT:
                delattr(holder, name)
            else:
                setattr(holder, name, original)


_ABSENT = object()


# --- KV-L: layout resolution --------------------------------------------------------------


def _layout_enum() -> Any:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return KVCacheLayout


def _wrong_pin(original: Any) -> Any:
    """Resolution pins LBHNC whatever the backend needs (KV-L2)."""
    layouts = _layout_enum()

    def resolve(vllm_config: Any, **_: Any) -> Any:
        vllm_config.cache_config.kv_cache_layout = "LBHNC"
        return layouts.LBHNC
    return resolve


def _overwrites_consistent_pin(original: Any) -> Any:
    """A pinned layout consistent with the backend is replaced by the default (KV-L3)."""
    layouts = _layout_enum()

    def resolve(vllm_config: Any, *, indexes_kv_by_block_stride: bool = False,
                required_layout: Any = None) -> Any:
        cache_config = vllm_config.cache_config
        if cache_config.kv_cache_layout is not None and required_layout is None:
            cache_config.kv_cache_layout = "LBNHC"
            return layouts.LBNHC
        return original(vllm_config, indexes_kv_by_block_stride=indexes_kv_by_block_stride,
                        required_layout=required_layout)
    return resolve


def _accepts_contradictory_pin(original: Any) -> Any:
    """A pinned layout that contradicts the backend is silently replaced (KV-L4)."""
    layouts = _layout_enum()

    def resolve(vllm_config: Any, *, indexes_kv_by_block_stride: bool = False,
                required_layout: Any = None) -> Any:
        cache_config = vllm_config.cache_config
        current = cache_config.kv_cache_layout
        need = bool(indexes_kv_by_block_stride)
        if current is not None and layouts[current].is_block_outermost != need:
            layout = layouts.BLNHC if need else layouts.LBNHC
            cache_config.kv_cache_layout = layout.name
            return layout
        return original(vllm_config, indexes_kv_by_block_stride=indexes_kv_by_block_stride,
                        required_layout=required_layout)
    return resolve


def _silent_assertion(original: Any) -> Any:
    """The layout assertion never raises (KV-L5)."""
    def assert_backend_layout_supported(vllm_config: Any, attn_backend: Any) -> None:
        return None
    return assert_backend_layout_supported


def _raises_unresolved(original: Any) -> Any:
    """The layout assertion raises while the layout is still unresolved (KV-L5)."""
    def assert_backend_layout_supported(vllm_config: Any, attn_backend: Any) -> None:
        if vllm_config.cache_config.kv_cache_layout is None:
            raise ValueError("KV cache layout has not been resolved yet")
        original(vllm_config, attn_backend)
    return assert_backend_layout_supported


def _refuses_all(original: Any) -> Any:
    """The layout assertion refuses every pinned layout, consistent ones too (KV-L5)."""
    def assert_backend_layout_supported(vllm_config: Any, attn_backend: Any) -> None:
        if vllm_config.cache_config.kv_cache_layout is not None:
            raise ValueError(f"refused {vllm_config.cache_config.kv_cache_layout}")
    return assert_backend_layout_supported


def _adopts_any(original: Any) -> Any:
    """A worker adopts whatever layout the control plane sends, over its own pin (KV-L8)."""
    layouts = _layout_enum()

    def adopt_kv_cache_layout(vllm_config: Any, kv_cache_config: Any) -> Any:
        vllm_config.cache_config.kv_cache_layout = kv_cache_config.kv_cache_layout
        return layouts[kv_cache_config.kv_cache_layout]
    return adopt_kv_cache_layout


_ASSERTION = f"{_LAYOUT}:assert_backend_layout_supported"
WRONG_PIN = declare(
    "wrong_pin", ("KV-L2",), "resolve_diffusion_kv_cache_layout pins LBHNC whatever the "
    "backend needs", Patch(RESOLVER, _wrong_pin), backend=PLAIN)
OVERWRITES_CONSISTENT_PIN = declare(
    "overwrites_consistent_pin", ("KV-L3",), "resolve_diffusion_kv_cache_layout replaces a "
    "pinned layout consistent with the backend by the default",
    Patch(RESOLVER, _overwrites_consistent_pin), backend=PLAIN)
ACCEPTS_CONTRADICTORY_PIN = declare(
    "accepts_contradictory_pin", ("KV-L4",), "resolve_diffusion_kv_cache_layout silently "
    "replaces a pinned layout that contradicts the backend",
    Patch(RESOLVER, _accepts_contradictory_pin), backend=PLAIN)
SILENT_ASSERTION = declare(
    "silent_layout_assertion", ("KV-L5",), "assert_backend_layout_supported never raises",
    Patch(_ASSERTION, _silent_assertion), backend=PLAIN)
ASSERTION_RAISES_UNRESOLVED = declare(
    "assertion_raises_unresolved", ("KV-L5",), "assert_backend_layout_supported raises while "
    "the layout is still unresolved", Patch(_ASSERTION, _raises_unresolved), backend=PLAIN)
ASSERTION_REFUSES_ALL = declare(
    "assertion_refuses_all", ("KV-L5",), "assert_backend_layout_supported refuses every "
    "pinned layout, consistent ones too", Patch(_ASSERTION, _refuses_all), backend=PLAIN)
ADOPTS_ANY_LAYOUT = declare(
    "adoption_accepts_any_layout", ("KV-L8",), "adopt_kv_cache_layout takes whatever layout "
    "the control plane sends over the worker's own pin",
    Patch(f"{_LAYOUT}:adopt_kv_cache_layout", _adopts_any), backend=PLAIN)


# --- KV-S: strides ----------------------------------------------------------------------


def _hand_strides(original: Any) -> Any:
    """Strides written by hand for layer-outermost layouts, whatever the layout (KV-S1/S3)."""
    from vllm.v1.kv_cache_interface import KVCacheTensor

    def build_kv_cache_tensor(spec: Any, num_blocks: int, layers: Any, *, layout: Any = None,
                              offset: int = 0) -> Any:
        page = spec.page_size_bytes
        return KVCacheTensor(size=page * len(layers) * num_blocks, layers=list(layers),
                             layer_stride=page * num_blocks, block_stride=page, offset=offset)
    return build_kv_cache_tensor


def _one_page_late(original: Any) -> Any:
    """Every view starts one page late (KV-S2)."""
    def create_kv_cache_views(raw: Any, spec: Any, num_blocks: int, layout: Any, tensor: Any,
                              kernel_block_size: int | None = None) -> Any:
        moved = dataclasses.replace(tensor, offset=tensor.offset + spec.page_size_bytes)
        return original(raw, spec, num_blocks, layout, moved, kernel_block_size)
    return create_kv_cache_views


def _padded_as_dense(original: Any) -> Any:
    """The padding of a padded page is dropped when the tensor is derived (KV-S4)."""
    def build_kv_cache_tensor(spec: Any, num_blocks: int, layers: Any, *, layout: Any = None,
                              offset: int = 0) -> Any:
        dense = dataclasses.replace(spec, page_size_padded=None)
        return original(dense, num_blocks, layers, layout=layout, offset=offset)
    return build_kv_cache_tensor


def _unrelated_padded(original: Any) -> Any:
    """Padded pages raise an unrelated ValueError where the documented error is due (KV-S4)."""
    def build_kv_cache_tensor(spec: Any, num_blocks: int, layers: Any, *, layout: Any = None,
                              offset: int = 0) -> Any:
        if spec.page_size_padded is not None:
            raise ValueError("unrelated bug")
        return original(spec, num_blocks, layers, layout=layout, offset=offset)
    return build_kv_cache_tensor


def _unrelated_split(original: Any) -> Any:
    """Kernel-block splitting raises an unrelated ValueError where the documented error is
    due (KV-S4)."""
    def create_kv_cache_views(raw: Any, spec: Any, num_blocks: int, layout: Any, tensor: Any,
                              kernel_block_size: int | None = None) -> Any:
        if kernel_block_size is not None and kernel_block_size < spec.block_size:
            raise ValueError("unrelated bug")
        return original(raw, spec, num_blocks, layout, tensor, kernel_block_size)
    return create_kv_cache_views


def _alias_in_group(original: Any) -> Any:
    """With several groups, layer l+1 starts one block after layer l (KV-S5)."""
    def get_kv_cache_config_from_groups(vllm_config: Any, groups: Any,
                                        available_memory: Any) -> Any:
        config = original(vllm_config, groups, available_memory)
        if len(groups) > 1:
            for tensor in config.kv_cache_tensors:
                tensor.layer_stride = tensor.block_stride
        return config
    return get_kv_cache_config_from_groups


HAND_STRIDES = declare(
    "hand_strides", ("KV-S1", "KV-S3"), "build_kv_cache_tensor writes layer-outermost strides "
    "whatever the layout", Patch(BUILD_TENSOR, _hand_strides))
VIEW_OFFSET = declare(
    "view_offset", ("KV-S2",), "create_kv_cache_views starts every view one page late",
    Patch(VIEWS, _one_page_late), Patch(VIEWS_IN_ALLOCATE, _one_page_late))
VIEW_OFFSET_ALLOCATE = declare(
    "view_offset_allocate", ("KV-S2",), "the views allocate_kv_cache makes start one page "
    "late", Patch(VIEWS_IN_ALLOCATE, _one_page_late))
PADDED_AS_DENSE = declare(
    "padded_as_dense", ("KV-S4",), "build_kv_cache_tensor drops a padded page's padding",
    Patch(BUILD_TENSOR, _padded_as_dense), cases=("padded",))
UNRELATED_PADDED = declare(
    "unrelated_padded", ("KV-S4",), "padded pages raise an unrelated ValueError where the "
    "documented error is due", Patch(BUILD_TENSOR, _unrelated_padded), cases=("padded",))
UNRELATED_SPLIT = declare(
    "unrelated_split", ("KV-S4",), "kernel-block splitting raises an unrelated ValueError "
    "where the documented error is due",
    Patch(VIEWS, _unrelated_split), Patch(VIEWS_IN_ALLOCATE, _unrelated_split),
    cases=("split_k8",))
ALIAS_IN_GROUP = declare(
    "alias_in_group", ("KV-S5",), "with several cache groups, layer l+1 starts one block "
    "after layer l",
    Patch(f"{KV_CACHE_UTILS}:get_kv_cache_config_from_groups", _alias_in_group),
    cases=("groups2",))


# --- KV-N: the null block -----------------------------------------------------------------


def _hands_out_null_block(original: Any) -> Any:
    """The pool counts the null block as free: one block more than it may hand out (KV-N1)."""
    def get_new_blocks(self: Any, num_blocks: int) -> list[Any]:
        if num_blocks == self.get_num_free_blocks() + 1:
            return [*original(self, num_blocks - 1), self.null_block]
        return original(self, num_blocks)
    return get_new_blocks


def _crashes_when_exhausted(original: Any) -> Any:
    """An exhausted pool crashes with a RuntimeError, not a refusal's ValueError (KV-N1)."""
    def get_new_blocks(self: Any, num_blocks: int) -> list[Any]:
        if num_blocks > self.get_num_free_blocks():
            raise RuntimeError("free list corrupted")
        return original(self, num_blocks)
    return get_new_blocks


def _per_block() -> Any:
    module: Any = importlib.import_module(KV_CACHE_UTILS)
    return module._pool_bytes_per_block


def _forgetful_fit(fit: Any) -> Any:
    """Auto-fit counts the null block's memory as usable (the pre-0.29 sizing)."""
    per_block = _per_block()

    def auto_fit(vllm_config: Any, groups: list[Any], memory: list[int]) -> None:
        memory = [m + per_block(g) if g else m for g, m in zip(groups, memory, strict=True)]
        fit(vllm_config, groups, memory)
    return auto_fit


def _forgetful_check(check: Any) -> Any:
    """Admission counts the null block's memory as usable (the pre-0.29 sizing)."""
    per_block = _per_block()

    def check_enough(available: int, needed: Any, max_model_len: int, estimate: Any) -> None:
        groups = needed.args[1]  # partial(_max_memory_usage_bytes_from_groups, cfg, groups)
        check(available + per_block(groups), needed, max_model_len, estimate)
    return check_enough


def _override_ignored(original: Any) -> Any:
    """Ranks are sized from profiled memory; num_gpu_blocks_override is dropped (KV-N3)."""
    def get_kv_cache_configs(vllm_config: Any, specs: Any, memory: list[int]) -> Any:
        cache_config = vllm_config.cache_config
        saved = cache_config.num_gpu_blocks_override
        cache_config.num_gpu_blocks_override = None
        try:
            return original(vllm_config, specs, memory)
        finally:
            cache_config.num_gpu_blocks_override = saved
    return get_kv_cache_configs


def _lax_check(check: Any) -> Any:
    """No memory left after the null block is waved through (KV-N4)."""
    def check_enough(available: int, *args: Any) -> None:
        if available > 0:
            check(available, *args)
    return check_enough


def _lax_fit(fit: Any) -> Any:
    """Auto-fit settles for one token instead of refusing (KV-N4)."""
    def auto_fit(vllm_config: Any, *args: Any) -> None:
        try:
            fit(vllm_config, *args)
        except ValueError:
            vllm_config.model_config.max_model_len = 1
    return auto_fit


def _sized_for_largest(original: Any) -> Any:
    """Every rank gets the largest rank's memory instead of the smallest's (KV-N5)."""
    def get_kv_cache_configs(vllm_config: Any, specs: Any, memory: list[int]) -> Any:
        return original(vllm_config, specs, [max(memory)] * len(memory))
    return get_kv_cache_configs


def _tensors_not_shrunk(original: Any) -> Any:
    """Ranks take the smallest count but keep tensors sized for their own memory (KV-N5)."""
    def get_kv_cache_configs(vllm_config: Any, specs: Any, memory: list[int]) -> Any:
        configs = [original(vllm_config, [s], [m])[0] for s, m in zip(specs, memory, strict=True)]
        smallest = min(c.num_blocks for c in configs)
        for config in configs:
            config.num_blocks = smallest
        return configs
    return get_kv_cache_configs


_FIT = f"{KV_CACHE_UTILS}:_auto_fit_max_model_len"
_CHECK = f"{KV_CACHE_UTILS}:_check_enough_kv_cache_memory"
HANDS_OUT_NULL_BLOCK = declare(
    "pool_hands_out_null_block", ("KV-N1",), "BlockPool.get_new_blocks hands out the null "
    "block as the last free block", Patch(GET_NEW_BLOCKS, _hands_out_null_block))
CRASHES_WHEN_EXHAUSTED = declare(
    "pool_crashes_when_exhausted", ("KV-N1",), "an exhausted BlockPool raises RuntimeError "
    "instead of refusing", Patch(GET_NEW_BLOCKS, _crashes_when_exhausted))
FORGETS_NULL_BLOCK = declare(
    "sizing_forgets_null_block", ("KV-N2", "KV-N3", "KV-N4"), "auto-fit and admission count "
    "the null block as usable (the pre-0.29 sizing)",
    Patch(_FIT, _forgetful_fit), Patch(_CHECK, _forgetful_check))
OVERRIDE_IGNORED = declare(
    "override_ignored", ("KV-N3",), "the control plane sizes ranks from profiled memory and "
    "drops num_gpu_blocks_override", Patch(RANK_SIZING, _override_ignored))
NO_REFUSAL = declare(
    "no_refusal_below_two_pages", ("KV-N4",), "memory left for no usable block is accepted "
    "instead of refused", Patch(_CHECK, _lax_check), Patch(_FIT, _lax_fit))
SIZED_FOR_LARGEST = declare(
    "ranks_sized_for_largest", ("KV-N5",), "every rank is sized from the largest rank's "
    "memory", Patch(RANK_SIZING, _sized_for_largest))
TENSORS_NOT_SHRUNK = declare(
    "rank_tensors_not_shrunk", ("KV-N5",), "ranks take the smallest num_blocks but keep "
    "tensors sized for their own memory", Patch(RANK_SIZING, _tensors_not_shrunk))


# --- KV-L7: the paged stand-ins' reads -------------------------------------------------------

_STANDINS = "pytest_kvconform.adapters.paged_standins"


def _read(name: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        module: Any = importlib.import_module(_STANDINS)
        return getattr(module, name)
    return make


# A conforming stand-in's kernel swapped for one that misreads the cache.
PAGED_READ = "paged read"
IGNORES_TABLE = declare(
    "paged_ignores_block_table", ("KV-L7",), "PAGED_OK's kernel reads physical block j for "
    "logical block j", Patch(f"{_STANDINS}:PagedOk.IMPL", _read("IgnoresTable")),
    backend="PAGED_OK", family=PAGED_READ)
WRONG_BLOCK_STRIDE = declare(
    "paged_wrong_block_stride", ("KV-L7",), "PAGED_OK_BS's kernel steps blocks by one page in "
    "a block-outermost layout",
    Patch(f"{_STANDINS}:PagedOkBlockStride.IMPL", _read("WrongBlockStride")),
    backend="PAGED_OK_BS", family=PAGED_READ)
TRUNCATES_PARTIAL_BLOCK = declare(
    "paged_truncates_partial_block", ("KV-L7",), "PAGED_OK's kernel reads a request's partial "
    "last block from the null block",
    Patch(f"{_STANDINS}:PagedOk.IMPL", _read("TruncatesPartialBlock")),
    backend="PAGED_OK", family=PAGED_READ)


# --- KV-V: vLLM's own attention backends ------------------------------------------------------

# The in-tree backend the V faults are planted in (CPU_ATTN: it imports on a CPU host), by
# its discovery name and where production looks its class up.
VLLM_PLAIN = "vllm.CPU_ATTN"
_CPU_ATTN = "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend"
_VLLM_REGISTRY = "vllm.v1.attention.backends.registry:AttentionBackendEnum.get_path"


def _layouts_as_names(original: Any) -> Any:
    """The declaration names its layouts (``"LBHNC"``) instead of giving the members."""
    def supported_kv_cache_layouts(cls: Any) -> Any:
        return tuple(layout.name for layout in original())
    return classmethod(supported_kv_cache_layouts)


def _no_layouts(original: Any) -> Any:
    """The declaration gives an empty tuple: no layout at all."""
    def supported_kv_cache_layouts(cls: Any) -> Any:
        return ()
    return classmethod(supported_kv_cache_layouts)


def _mis_sized_page(original: Any) -> Any:
    """``customize_spec`` gives every page twice the head slots it holds (K and V counted
    twice), so the allocator sizes twice the page the kernels read."""
    def customize_spec(cls: Any, spec: Any) -> Any:
        out = original(spec)
        return dataclasses.replace(out, num_head_slots=2 * out.num_kv_heads)
    return classmethod(customize_spec)


def _misnamed(original: Any) -> Any:
    """``get_name`` answers to a name that is no member of the registry."""
    def get_name() -> str:
        return "CPU_ATTENTION"
    return staticmethod(get_name)


def _missing_module(original: Any) -> Any:
    """The registry points CPU_ATTN at a module the installed vLLM does not have."""
    def get_path(self: Any, include_classname: bool = True) -> str:
        if self.name == "CPU_ATTN":
            path = "vllm.v1.attention.backends.cpu_attention.CPUAttentionBackend"
            return path if include_classname else path.rpartition(".")[0]
        return str(original(self, include_classname))
    return get_path


LAYOUTS_AS_NAMES = declare(
    "vllm_layouts_as_names", ("KV-V2",), "CPU_ATTN's supported_kv_cache_layouts() returns "
    "layout names (str), not KVCacheLayout members",
    Patch(f"{_CPU_ATTN}.supported_kv_cache_layouts", _layouts_as_names), backend=VLLM_PLAIN)
NO_LAYOUTS = declare(
    "vllm_no_layouts", ("KV-V2",), "CPU_ATTN's supported_kv_cache_layouts() returns an empty "
    "tuple", Patch(f"{_CPU_ATTN}.supported_kv_cache_layouts", _no_layouts), backend=VLLM_PLAIN)
MIS_SIZED_PAGE = declare(
    "vllm_mis_sized_page", ("KV-V2",), "CPU_ATTN's customize_spec() doubles the head slots of "
    "an unquantized page", Patch(f"{_CPU_ATTN}.customize_spec", _mis_sized_page),
    backend=VLLM_PLAIN)
MISNAMED_VLLM_BACKEND = declare(
    "vllm_misnamed_backend", ("KV-V1",), "CPU_ATTN's get_name() answers to no registry "
    "member's name", Patch(f"{_CPU_ATTN}.get_name", _misnamed), backend=VLLM_PLAIN)
MISSING_MODULE = declare(
    "vllm_registry_missing_module", ("KV-V1",), "AttentionBackendEnum.CPU_ATTN points at a "
    "module the installed vLLM does not have", Patch(_VLLM_REGISTRY, _missing_module),
    backend=VLLM_PLAIN)
