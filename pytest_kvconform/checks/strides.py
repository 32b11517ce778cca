"""KV-S clauses: production stride derivation and real views against the oracle.

Expected numbers come only from :mod:`pytest_kvconform.contract.oracle` or from arithmetic on the
case's own numbers, never from ``compute_layout_strides``.  Two production sources are
checked: vllm-omni's ``build_kv_cache_tensor`` and the control plane's planner
(``get_kv_cache_configs`` on vllm-omni's production config, with the layout pinned).
Where vllm-omni is not installed, the planner runs on vLLM's own config
(:func:`~pytest_kvconform.adapters.kv_planner.control_plane_config`) and vllm-omni's source is
left out; the result's ``via`` says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pytest_kvconform.adapters import compat, kv_allocation, kv_planner
from pytest_kvconform.checks import bytemap
from pytest_kvconform.checks.common import Where, allocating, note_via
from pytest_kvconform.checks.errors import ClauseFailure, ClauseSkip, HarnessError, Unsupported
from pytest_kvconform.checks.geometry import geometry_for, page_stride
from pytest_kvconform.contract import cases, oracle
from pytest_kvconform.contract.records import Case

OMNI_SOURCE = "vllm-omni build_kv_cache_tensor"
PLANNER_SOURCE = "control plane get_kv_cache_configs"
VIEWS_SOURCE = "create_kv_cache_views"
ALLOCATE_SOURCE = "allocate_kv_cache"
# What a result's ``via`` says where vllm-omni is not installed.
UPSTREAM_PLANNER = ("vLLM alone (vllm-omni not installed): get_kv_cache_configs on vLLM's own "
                    "VllmConfig for a weightless model config")
OMNI_ABSENT = "vllm-omni's build_kv_cache_tensor not checked (not installed)"
TENSOR_FIELDS = ("size", "layer_stride", "block_stride", "offset")
# The documented errors for geometries the oracle cannot lay out, as (type, a stable
# substring of vLLM's message in kv_cache_interface): create_kv_cache_views refuses to split
# a block that is not one dense page; compute_layout_strides asserts that padding has only
# L, B or singleton axes outside the page tail.  Any other error is a violation.
SPLIT_ERROR: tuple[type[Exception], str] = (
    ValueError, "does not store blocks as dense, unpadded pages")
PADDING_ERROR: tuple[type[Exception], str] = (AssertionError, "Page padding requires")


# --- expected values ------------------------------------------------------------------


def documented_errors(geom: oracle.Geometry) -> tuple[tuple[type[Exception], str], ...]:
    """The errors documented for the features this geometry uses (split, padding)."""
    return ((SPLIT_ERROR,) if geom.kernel_ratio > 1 else ()) + \
        ((PADDING_ERROR,) if geom.is_padded else ())


# --- production sources ----------------------------------------------------------------


def omni_tensor(case: Case, layout: str, layers: Sequence[str] | None = None,
                spec: Any = None) -> Any:
    """vllm-omni's ``KVCacheTensor`` for the case's layers over ``num_pages`` blocks."""
    names = list(layers) if layers is not None else compat.layer_names(case)
    spec = spec if spec is not None else compat.attention_spec(case)
    return kv_allocation.build_kv_cache_tensor(spec, case.num_pages, names, compat.layout(layout))


def omni_sources() -> bool:
    """Whether vllm-omni's ``build_kv_cache_tensor`` is a source here; where it is not
    (vLLM alone), the result's ``via`` names what ran instead."""
    if compat.omni_installed():
        return True
    note_via(UPSTREAM_PLANNER)
    note_via(OMNI_ABSENT)
    return False


def planned_config(case: Case, layout: str, *, hybrid: bool = False) -> Any:
    """Rank 0's ``KVCacheConfig`` from the planner, sized for ``num_pages`` pages.

    The layout is pinned on the control plane's config (vllm-omni's production one, or
    vLLM's own where vllm-omni is absent); memory is exactly ``num_pages`` blocks of the
    largest group (arithmetic on the case).
    """
    if not compat.omni_installed():
        note_via(UPSTREAM_PLANNER)
    vllm_config = kv_planner.control_plane_config()
    if hybrid and not kv_planner.enable_hybrid_kv_cache_manager(vllm_config):
        raise RuntimeError("the installed SchedulerConfig has no "
                           "disable_hybrid_kv_cache_manager switch")
    vllm_config.cache_config.kv_cache_layout = layout
    layers_per_group = math.ceil(case.num_layers / case.num_groups)
    memory = page_stride(case) * layers_per_group * case.num_pages
    specs = compat.worker_specs(case)
    return kv_planner.get_kv_cache_configs(vllm_config, specs, [memory] * len(specs))[0]


def _check_num_blocks(where: Where, config: Any) -> None:
    pages = where.the_case.num_pages
    if config.num_blocks != pages:
        raise where.fail_at(PLANNER_SOURCE, f"memory for {pages} pages per layer "
                            "was planned as a different number of blocks",
                            expected=pages, actual=config.num_blocks)


def _single_tensor(where: Where, config: Any) -> Any:
    _check_num_blocks(where, config)
    tensors = list(config.kv_cache_tensors)
    names = compat.layer_names(where.the_case)
    if len(tensors) != 1 or list(tensors[0].layers) != names:
        raise where.fail_at(PLANNER_SOURCE, "one group of identical layers should be placed by "
                            "one KVCacheTensor over all layers in order", expected=[names],
                            actual=[list(t.layers) for t in tensors])
    return tensors[0]


# --- comparisons -------------------------------------------------------------------------


def compare_tensor(where: Where, source: str, tensor: Any, expected: oracle.OracleTensor,
                   layers: Sequence[str], fields: Sequence[str] = TENSOR_FIELDS) -> None:
    """The first field of ``tensor`` that differs from the oracle fails the clause."""
    if list(tensor.layers) != list(layers):
        raise where.fail_at(source, "KVCacheTensor.layers differ", expected=list(layers),
                            actual=list(tensor.layers))
    for name in fields:
        want, got = getattr(expected, name), getattr(tensor, name)
        if want != got:
            raise where.fail_at(source, f"KVCacheTensor.{name} differs from the oracle",
                                expected={name: want}, actual={name: got})


def compare_bytes(where: Where, source: str, found: bytemap.ByteMap,
                  table: np.ndarray | None, size: int, *, dense: bool) -> None:
    """Written-back addresses against the oracle table; the first difference fails.

    Order: in bounds, no shared byte, the oracle's address, exact cover (dense only).
    ``table=None``: no oracle for this group, only bounds and disjointness.
    """
    if table is not None and found.shape != table.shape:
        raise where.fail_at(source, "the views' logical [L, B, H, N, C(bytes)] shape differs",
                            expected=table.shape, actual=found.shape)
    outside = (found.written < 0) | (found.written >= size)
    if outside.any():
        at = int(np.argmax(outside))
        cell = found.cell(int(found.owner[at]))
        raise where.fail_at(source, f"cell {bytemap.describe(cell)} lies outside the allocation "
                            f"[0, {size})", expected="inside" if table is None else
                         f"byte {int(table[cell])}",
                         actual=f"byte {int(found.written[at])}")
    lost = found.actual < 0
    if lost.any():
        cell = found.cell(int(np.argmax(lost.ravel())))
        address = found.metadata_address(cell)
        other = found.owner_at(address)
        named = bytemap.describe(other) if other else "(unknown)"
        raise where.fail_at(source, f"cells {bytemap.describe(cell)} and {named} of one group "
                            f"share byte {address}", expected="distinct bytes",
                            actual=f"both at byte {address}")
    wrong = np.zeros(found.shape, dtype=bool) if table is None else found.actual != table
    if table is not None and wrong.any():
        cell = found.cell(int(np.argmax(wrong.ravel())))
        raise where.fail_at(source, f"cell {bytemap.describe(cell)} is not at the oracle's byte",
                            expected=f"byte {int(table[cell])}",
                            actual=f"byte {int(found.actual[cell])}")
    if dense and found.written.size != size:
        covered = np.zeros(size, dtype=bool)
        covered[found.written] = True
        gap = int(np.argmin(covered))
        raise where.fail_at(source, f"a dense group must cover its allocation exactly, but byte "
                            f"{gap} of [0, {size}) is addressed by no cell",
                         expected=f"{size} bytes covered", actual=f"{found.written.size}")


def _views_in_order(where: Where, source: str, views: dict[str, Any] | Sequence[Any],
                    layers: Sequence[str]) -> list[Any]:
    if isinstance(views, dict):
        missing = [name for name in layers if name not in views]
        if missing:
            raise where.fail_at(source, "no view for some layers", expected=list(layers),
                                actual=sorted(views))
        return [views[name] for name in layers]
    if len(views) != len(layers):
        raise where.fail_at(source, "one view per layer expected", expected=len(layers),
                            actual=len(views))
    return list(views)


def check_views(where: Where, source: str, views: Sequence[Any], whole: Any, base: int,
                table: np.ndarray | None, size: int, *, dense: bool) -> None:
    """Write the pattern through one group's views and compare with the oracle."""
    try:
        with allocating(where, f"writing back the byte map of a {size}-byte KV cache",
                        size * cases.HOST_BYTES_PER_KV_BYTE):
            found = bytemap.read_back(views, whole, base)
    except bytemap.InternalOverlap as exc:
        raise where.fail_at(source, f"cells of one view share a byte: {exc}") from exc
    except ValueError as exc:
        raise where.fail_at(source, str(exc)) from exc
    compare_bytes(where, source, found, table, size, dense=dense)


def _allocate(where: Where, config: Any, device: str, member: Any,
              kernel_sizes: list[int] | None = None) -> dict[str, Any]:
    """``allocate_kv_cache`` on the planner's config: bounded, or an ``oom`` error."""
    asked = sum(int(t.size) for t in config.kv_cache_tensors)
    with allocating(where, f"allocating the planned {asked}-byte KV cache on {device}", asked):
        return kv_allocation.allocate_kv_cache(config, device, member, kernel_sizes)


def _created_views(where: Where, case: Case, layout: str, tensor: Any, size: int,
                   device: str, kernel_block_size: int | None = None
                   ) -> tuple[list[Any], Any, int]:
    """``create_kv_cache_views`` over a guarded buffer of ``size`` bytes."""
    with allocating(where, f"allocating a guarded {size}-byte KV cache on {device}",
                    size * (1 + 2 * bytemap.GUARD_FACTOR)):
        raw, whole, base = bytemap.guarded_buffer(size, device)
    views = kv_allocation.create_kv_cache_views(raw, compat.attention_spec(case), case.num_pages,
                                         compat.layout(layout), tensor, kernel_block_size)
    return _views_in_order(where, VIEWS_SOURCE, views, list(tensor.layers)), whole, base


# --- clauses ------------------------------------------------------------------------------


def check_kv_s1(layout: str, case: Case) -> None:
    """KV-S1: production KVCacheTensor fields equal the oracle's, from both sources."""
    where = Where("KV-S1", case=case, layout=layout)
    layers = compat.layer_names(case)
    # A KVCacheTensor is per manager block: kernel splitting does not change it.
    expected = oracle.expected_tensor(layout, geometry_for(case, kernel=False))
    if omni_sources():
        tensor = where.call(OMNI_SOURCE, omni_tensor, case, layout)
        compare_tensor(where, OMNI_SOURCE, tensor, expected, layers)
    config = where.call(PLANNER_SOURCE, planned_config, case, layout)
    compare_tensor(where, PLANNER_SOURCE, _single_tensor(where, config), expected, layers)


def check_kv_s2(layout: str, case: Case, device: str) -> None:
    """KV-S2: every byte of ``create_kv_cache_views``' views is where the oracle says.

    The views get the oracle's tensor, so a wrong tensor (KV-S1) cannot hide or cause
    a view defect here.  Upstream only: runs without vllm-omni too.
    """
    where = Where("KV-S2", case=case, layout=layout)
    geom = geometry_for(case)
    table = oracle.address_table(layout, geom)
    expected = oracle.expected_tensor(layout, geom)
    layers = compat.layer_names(case)
    tensor = kv_allocation.kv_cache_tensor(expected.size, layers, expected.layer_stride,
                                    expected.block_stride, expected.offset)
    views, whole, base = where.call(VIEWS_SOURCE, _created_views, where, case, layout, tensor,
                                    expected.size, device)
    check_views(where, VIEWS_SOURCE, views, whole, base, table, expected.size,
                dense=not geom.is_padded)


def check_kv_s2_allocate(layout: str, case: Case, device: str) -> None:
    """KV-S2 end to end: ``allocate_kv_cache`` on the planner's config, byte for byte.

    The planner is driven through vllm-omni's production config builder.
    """
    where = Where("KV-S2", case=case, layout=layout)
    geom = geometry_for(case)
    table = oracle.address_table(layout, geom)
    layers = compat.layer_names(case)
    config = where.call(PLANNER_SOURCE, planned_config, case, layout)
    planned = _single_tensor(where, config)
    allocated = where.call(ALLOCATE_SOURCE, _allocate, where, config, device,
                           compat.layout(layout))
    views = _views_in_order(where, ALLOCATE_SOURCE, allocated, layers)
    whole, base = bytemap.storage_bytes(views[0])
    check_views(where, ALLOCATE_SOURCE, views, whole, base, table, planned.size,
                dense=not geom.is_padded)


def check_kv_s3(layout: str, case: Case) -> None:
    """KV-S3: block-outermost packs all layers per block; layer-outermost, a run per layer."""
    where = Where("KV-S3", case=case, layout=layout)
    member = compat.layout(layout)
    block_outer = oracle.is_block_outermost(layout)
    production_flag = where.call("KVCacheLayout.is_block_outermost",
                                 lambda: member.is_block_outermost)
    if production_flag is not block_outer:
        raise where.fail_at("KVCacheLayout.is_block_outermost", "disagrees with the layout's "
                            "physical axis order", expected=block_outer, actual=production_flag)
    page = page_stride(case)
    if block_outer:
        name, want = "block_stride", page * case.num_layers
        rule = f"page_size * num_layers = {page} * {case.num_layers}"
    elif oracle.is_layer_outermost(layout):
        name, want = "layer_stride", page * case.num_pages
        rule = f"page_size * num_blocks = {page} * {case.num_pages}"
    else:  # every layout is one or the other today; a new one would need a rule
        raise where.fail_at("KV-S3", f"layout {layout} is neither block- nor layer-outermost")
    sources = []
    if omni_sources():
        sources.append((OMNI_SOURCE, where.call(OMNI_SOURCE, omni_tensor, case, layout)))
    config = where.call(PLANNER_SOURCE, planned_config, case, layout)
    sources.append((PLANNER_SOURCE, _single_tensor(where, config)))
    for source, got in sources:
        if getattr(got, name) != want:
            raise where.fail_at(source, f"{name} must be {rule}", expected={name: want},
                                actual={name: getattr(got, name)})


def _documented_or_fail(where: Where, source: str, run: Callable[[], Any],
                        unsupported: oracle.OracleUnsupported,
                        documented: Sequence[tuple[type[Exception], str]]) -> None:
    """The oracle cannot lay this out: production must raise one of ``documented``.

    Type and message both count, so an unrelated ValueError is not mistaken for it.
    """
    expected = " or ".join(f"{kind.__name__} containing {text!r}" for kind, text in documented)
    try:
        run()
    except (ClauseFailure, ClauseSkip, HarnessError):
        raise
    except Unsupported as exc:
        raise exc.skip(where.clause) from None
    except Exception as exc:
        if any(isinstance(exc, kind) and text in str(exc) for kind, text in documented):
            return
        raise where.fail_at(source, f"raised {type(exc).__name__}: {exc}, not the documented "
                            f"error, for a geometry that cannot be laid out ({unsupported})",
                            expected=expected, actual=f"{type(exc).__name__}: {exc}") from exc
    raise where.fail_at(source, f"silently produced views for a geometry that cannot be laid out "
                        f"({unsupported})", expected=expected, actual="views, no error")


def check_kv_s4(layout: str, case: Case, device: str) -> None:
    """KV-S4: kernel-block splitting and padded pages: oracle views or the documented error."""
    where = Where("KV-S4", case=case, layout=layout)
    with_omni = omni_sources()
    geom = geometry_for(case)
    kernel = case.kernel_block_size
    kernel_sizes = [kernel] if kernel is not None else None
    member = compat.layout(layout)
    layers = compat.layer_names(case)

    def via_views() -> tuple[Any, list[Any], Any, int]:
        tensor = omni_tensor(case, layout)
        views, whole, base = _created_views(where, case, layout, tensor, tensor.size,
                                            device, kernel)
        return tensor, views, whole, base

    def via_allocate() -> tuple[Any, dict[str, Any]]:
        config = planned_config(case, layout)
        views = _allocate(where, config, device, member, kernel_sizes)
        return config, views

    try:
        table = oracle.address_table(layout, geom)
    except oracle.OracleUnsupported as unsupported:
        documented = documented_errors(geom)
        if with_omni:
            _documented_or_fail(where, f"{OMNI_SOURCE} + {VIEWS_SOURCE}", via_views,
                                unsupported, documented)
        _documented_or_fail(where, f"{PLANNER_SOURCE} + {ALLOCATE_SOURCE}", via_allocate,
                            unsupported, documented)
        return
    expected = oracle.expected_tensor(layout, geom)
    dense = not geom.is_padded
    if with_omni:
        tensor, views, whole, base = where.call(f"{OMNI_SOURCE} + {VIEWS_SOURCE}", via_views)
        compare_tensor(where, OMNI_SOURCE, tensor, expected, layers)
        check_views(where, VIEWS_SOURCE, views, whole, base, table, expected.size, dense=dense)
    config, allocated = where.call(f"{PLANNER_SOURCE} + {ALLOCATE_SOURCE}", via_allocate)
    planned = _single_tensor(where, config)
    compare_tensor(where, PLANNER_SOURCE, planned, expected, layers)
    views = _views_in_order(where, ALLOCATE_SOURCE, allocated, layers)
    whole, base = bytemap.storage_bytes(views[0])
    check_views(where, ALLOCATE_SOURCE, views, whole, base, table, planned.size, dense=dense)


def _check_groups(where: Where, source: str, config: Any, device: str) -> None:
    """Per group: strides and every byte per the oracle, in bounds, layers disjoint.

    Groups alias each other by design, so each is written and read back on its own.
    """
    case, layout = where.the_case, where.layout or ""
    groups = list(config.kv_cache_groups)
    tensors = list(config.kv_cache_tensors)
    allocated = where.call(ALLOCATE_SOURCE, _allocate, where, config, device,
                           compat.layout(layout))
    sizes = {len(g.layer_names) for g in groups}
    for index, group in enumerate(groups):
        names = list(group.layer_names)
        mine = [t for t in tensors if set(t.layers) <= set(names)]
        if len(mine) != 1 or list(mine[0].layers) != names:
            raise where.fail_at(source, f"group {index} should be placed by one KVCacheTensor "
                                "over its layers in order", expected=[names],
                                actual=[list(t.layers) for t in tensors])
        tensor = mine[0]
        geom = geometry_for(case, num_layers=len(names))
        # Unequal groups pad each block to the largest group's pages: no oracle table.
        uniform = len(sizes) == 1
        table = oracle.address_table(layout, geom, offset=tensor.offset) if uniform else None
        views = _views_in_order(where, ALLOCATE_SOURCE, allocated, names)
        whole, base = bytemap.storage_bytes(views[0])
        check_views(where, f"{source} -> {ALLOCATE_SOURCE}, group {index}", views, whole, base,
                    table, tensor.size, dense=False)
        if uniform:
            expected = oracle.expected_tensor(layout, geom, offset=tensor.offset)
            compare_tensor(where, f"{source}, group {index}", tensor, expected, names,
                           fields=("layer_stride", "block_stride"))


def check_kv_s5(layout: str, case: Case, device: str) -> None:
    """KV-S5: several cache groups; layers of one group never share a byte.

    Two sources: the planner with the hybrid KV cache manager on (so a sliding-window
    group stays separate), and a two-group config built by hand from vllm-omni's
    ``build_kv_cache_tensor`` per group (where vllm-omni is installed).
    """
    where = Where("KV-S5", case=case, layout=layout)
    with_omni = omni_sources()
    config = where.call(PLANNER_SOURCE, planned_config, case, layout, hybrid=True)
    _check_num_blocks(where, config)
    if len(config.kv_cache_groups) != case.num_groups:
        raise where.fail_at(PLANNER_SOURCE, "the planner did not keep the attention types in "
                            "separate cache groups", expected=case.num_groups,
                            actual=len(config.kv_cache_groups))
    _check_groups(where, PLANNER_SOURCE, config, device)
    if not with_omni:
        return
    specs = compat.worker_specs(case)[0]
    groups = [(compat.layer_names(case, g), specs[compat.layer_names(case, g)[0]])
              for g in range(case.num_groups)]
    tensors = [where.call(OMNI_SOURCE, omni_tensor, case, layout, names, spec)
               for names, spec in groups]
    by_hand = kv_allocation.kv_cache_config(case.num_pages, tensors, groups, layout)
    _check_groups(where, f"{OMNI_SOURCE} per group", by_hand, device)
