"""KV-V5: a vLLM backend's customised page is sized and laid out as the oracle says.

``customize_spec`` lets a backend repack the page of its layers (head slots and content per
slot: ``num_head_slots``, ``state_content_bytes``).  Where it changes the page of a plain
attention spec, the customised spec must (1) size its page as its own geometry says
(H' x N x C' bytes, padding aside), (2) keep the bytes of the K and V data it repacks (an
unquantised page neither shrinks nor grows), and through production's planner and worker
allocation, in every layout, (3) plan exactly P blocks for memory of P pages per layer
(KV-N2's sizing, at the customised page) and (4) give a ``KVCacheTensor`` and views whose
every byte is at the oracle's address (KV-S1, KV-S2).  The expected numbers come from
``contract/oracle.py`` on the geometry the backend published, never from vLLM's strides.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

from pytest_kvconform.adapters import compat, kv_planner
from pytest_kvconform.checks import bytemap
from pytest_kvconform.checks.common import Where, backend_class, note_via, production_with_class
from pytest_kvconform.checks.errors import SkipKind
from pytest_kvconform.checks.strides import _allocate, _views_in_order, check_views, compare_tensor
from pytest_kvconform.contract import oracle

CLAUSE = "KV-V5"
# The plain spec the backend customises: what an unquantised decoder layer asks for.
BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, DTYPE = 32, 4, 64, "bfloat16"
NUM_LAYERS, NUM_PAGES = 2, 16
# The fields a backend's customize_spec may change, read back as plain data.
PAGE_FIELDS = ("block_size", "num_kv_heads", "head_size", "head_size_v", "num_head_slots",
               "state_content_bytes", "page_size_padded")
PLANNER = "get_kv_cache_configs"
ALLOCATE = "allocate_kv_cache"
VIA = f"customize_spec + {PLANNER} + vllm.v1.worker.utils.{ALLOCATE}"


def base_spec() -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                             head_size=HEAD_SIZE, dtype=compat.torch_dtype(DTYPE))


def _customised_fields(cls: Any) -> dict[str, Any]:
    """The customised spec's page fields (runs the backend's customize_spec: bound it)."""
    out = cls.customize_spec(base_spec())
    return {"type": type(out).__name__, **{f: getattr(out, f, None) for f in PAGE_FIELDS}}


def layer_names() -> list[str]:
    return [f"model.layers.{i}.attn" for i in range(NUM_LAYERS)]


def check_kv_v5(backend: Any) -> None:
    """The customised page: its size, the data it keeps, sizing and addresses per layout."""
    where = Where(CLAUSE, backend=backend.name)
    cls = backend_class(CLAUSE, backend)
    if not callable(getattr(cls, "customize_spec", None)):
        raise where.skip(f"{backend.name} has no customize_spec", SkipKind.NOT_APPLICABLE)
    base = base_spec()
    fields = production_with_class(CLAUSE, backend.name, "customize_spec",
                                   partial(_customised_fields, cls))
    before = {f: getattr(base, f, None) for f in PAGE_FIELDS}
    after = {f: fields[f] for f in PAGE_FIELDS}
    if after == before:
        raise where.skip(f"{backend.name}.customize_spec leaves a plain {DTYPE} attention "
                         "page unchanged (nothing to check)", SkipKind.NOT_APPLICABLE)
    if fields["type"] != type(base).__name__:
        raise where.fail(f"customize_spec returned a {fields['type']}, not the "
                         f"{type(base).__name__} it was given", expected=type(base).__name__,
                         actual=fields["type"])
    changed = {f: after[f] for f in PAGE_FIELDS if after[f] != before[f]}
    spec = dataclasses.replace(base, **changed)
    geom = _geometry(where, spec)
    _check_page(where, spec, geom, changed)
    for layout in oracle.PHYSICAL_LAYOUTS:
        _check_layout(where.at(layout=layout), spec, geom, layout)
    note_via(VIA)


def _geometry(where: Where, spec: Any) -> oracle.Geometry:
    """The page the customised spec publishes: H' slots x N tokens x C' bytes."""
    try:
        return oracle.Geometry(
            num_layers=NUM_LAYERS, num_blocks=NUM_PAGES, num_heads=spec.num_heads,
            block_size=spec.block_size, content_bytes=spec.state_content_size_bytes,
            page_size_padded=spec.page_size_padded)
    except ValueError as exc:
        raise where.fail(f"customize_spec published a page no layout can hold: {exc}") from exc


def _check_page(where: Where, spec: Any, geom: oracle.Geometry, changed: dict[str, Any]
                ) -> None:
    data = oracle.Geometry.for_attention(NUM_LAYERS, NUM_PAGES, NUM_KV_HEADS, BLOCK_SIZE,
                                         HEAD_SIZE, DTYPE)
    what = ", ".join(f"{k}={v}" for k, v in sorted(changed.items()))
    if spec.page_size_bytes != geom.page_stride_bytes:
        raise where.fail(f"customize_spec ({what}): page_size_bytes is not the page its "
                         f"geometry holds ({geom.num_heads} slots x {geom.block_size} tokens "
                         f"x {geom.content_bytes} bytes)", expected=geom.page_stride_bytes,
                         actual=spec.page_size_bytes)
    if geom.page_bytes != data.page_bytes:
        raise where.fail(f"customize_spec ({what}) repacks an unquantised page into "
                         f"{geom.page_bytes} bytes, but its K and V data are {data.page_bytes} "
                         f"bytes ({NUM_KV_HEADS} heads x {BLOCK_SIZE} tokens x "
                         f"{data.content_bytes} bytes)", expected=data.page_bytes,
                         actual=geom.page_bytes)


def _planned(layout: str, spec: Any, geom: oracle.Geometry) -> Any:
    vllm_config = kv_planner.control_plane_config()
    vllm_config.cache_config.kv_cache_layout = layout
    memory = geom.page_stride_bytes * NUM_LAYERS * NUM_PAGES
    specs = [{name: spec for name in layer_names()}]
    return kv_planner.get_kv_cache_configs(vllm_config, specs, [memory])[0]


def _check_layout(where: Where, spec: Any, geom: oracle.Geometry, layout: str) -> None:
    try:
        expected = oracle.expected_tensor(layout, geom)
        table = oracle.address_table(layout, geom)
    except oracle.OracleUnsupported as exc:  # a padded page in a layout that cannot pad it
        raise where.skip(str(exc), SkipKind.NOT_APPLICABLE) from exc
    config = where.call(PLANNER, _planned, layout, spec, geom)
    if config.num_blocks != NUM_PAGES:
        raise where.fail_at(PLANNER, f"memory for exactly {NUM_PAGES} customised pages per "
                            f"layer ({geom.page_stride_bytes} bytes each) was planned as "
                            "another number of blocks", expected=NUM_PAGES,
                            actual=config.num_blocks)
    tensors = list(config.kv_cache_tensors)
    if len(tensors) != 1:
        raise where.fail_at(PLANNER, "one group of identical layers should be one "
                            "KVCacheTensor", expected=1, actual=len(tensors))
    compare_tensor(where, PLANNER, tensors[0], expected, layer_names())
    allocated = where.call(ALLOCATE, _allocate, where, config, "cpu", compat.layout(layout))
    views = _views_in_order(where, ALLOCATE, allocated, layer_names())
    whole, base = bytemap.storage_bytes(views[0])
    check_views(where, ALLOCATE, views, whole, base, table, expected.size,
                dense=not geom.is_padded)

