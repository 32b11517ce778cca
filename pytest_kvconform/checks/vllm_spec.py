"""KV-V5: a vLLM backend's customised page is sized and laid out as the oracle says.

``customize_spec`` lets a backend repack the page of its layers (head slots and content per
slot: ``num_head_slots``, ``state_content_bytes``).  For a plain bfloat16 attention spec and
for each quantised KV-cache dtype the backend supports (``supported_kv_cache_dtypes``; the
spec as production's attention layer builds it: the dtype's storage type and quant mode),
where it changes the page, the customised spec must (1) size its page as its own geometry
says (H' x N x C' bytes, padding aside), (2) hold its K and V data: an unquantised page is
neither shrunk nor grown by a repack, a quantised one holds at least the data's bits (the
dtype's bits per K and V element) and, for per-token-head modes, a byte per (token, head)
for each of K's and V's scales; and through production's planner and worker allocation, in
every layout, (3) plan exactly P blocks for memory of P pages per layer (KV-N2's sizing, at
the customised page) and (4) give a ``KVCacheTensor`` and views whose every byte is at the
oracle's address (KV-S1, KV-S2).  Expected numbers come from ``contract/oracle.py`` on the
geometry the backend published and from arithmetic on the spec's own sizes, never from
vLLM's strides.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

from pytest_kvconform.adapters import compat, kv_planner
from pytest_kvconform.checks import bytemap
from pytest_kvconform.checks.common import Where, note_via, production_with_class
from pytest_kvconform.checks.errors import SkipKind
from pytest_kvconform.checks.strides import _allocate, _views_in_order, check_views, compare_tensor
from pytest_kvconform.checks.vllm_backends import vllm_class
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
# Bits per stored K and V element of each quantised KV-cache dtype (the format's own
# numbers, by its name); per-token-head modes also store a scale per (token, head) of each.
DATA_BITS: dict[str, tuple[int, int]] = {
    "fp8": (8, 8), "fp8_e4m3": (8, 8), "fp8_e5m2": (8, 8), "int8": (8, 8),
    "int8_per_token_head": (8, 8), "fp8_per_token_head": (8, 8),
    "int4_per_token_head": (4, 4), "nvfp4": (4, 4),
    "turboquant_k8v4": (8, 4), "turboquant_4bit_nc": (4, 4),
    "turboquant_k3v4_nc": (3, 4), "turboquant_3bit_nc": (3, 3),
}
PER_TOKEN_HEAD = ("int8_per_token_head", "fp8_per_token_head", "int4_per_token_head")


def base_spec(cache_dtype: str | None = None) -> Any:
    """The spec production's attention layer builds: plain (``DTYPE``), or for a KV-cache
    dtype its storage type and quant mode (vLLM's own mappings, by feature detection)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    kwargs: dict[str, Any] = {"block_size": BLOCK_SIZE, "num_kv_heads": NUM_KV_HEADS,
                              "head_size": HEAD_SIZE, "dtype": compat.torch_dtype(DTYPE)}
    if cache_dtype is not None:
        from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
        from vllm.v1.kv_cache_interface import get_kv_quant_mode

        kwargs["dtype"] = STR_DTYPE_TO_TORCH_DTYPE[cache_dtype]
        kwargs["kv_quant_mode"] = get_kv_quant_mode(cache_dtype)
    return FullAttentionSpec(**kwargs)


def _customised_fields(cls: Any, cache_dtype: str | None = None) -> dict[str, Any]:
    """The customised spec's page fields (runs the backend's customize_spec: bound it)."""
    out = cls.customize_spec(base_spec(cache_dtype))
    return {"type": type(out).__name__, **{f: getattr(out, f, None) for f in PAGE_FIELDS}}


def _read_backend(cls: Any) -> dict[str, Any]:
    """The plain page's customisation, the quantised dtypes the backend supports, and each
    one's customisation (or why it raised), as plain data: one bounded call."""
    dtypes = [d for d in (getattr(cls, "supported_kv_cache_dtypes", None) or [])
              if isinstance(d, str) and d in DATA_BITS]
    out: dict[str, Any] = {"plain": _customised_fields(cls), "quantised": {}}
    for name in dtypes:
        try:
            out["quantised"][name] = _customised_fields(cls, name)
        except Exception as exc:
            out["quantised"][name] = {"raised": f"{type(exc).__name__}: {exc}"}
    return out


def layer_names() -> list[str]:
    return [f"model.layers.{i}.attn" for i in range(NUM_LAYERS)]


def check_kv_v5(backend: Any) -> None:
    """The customised page: its size, the data it keeps, sizing and addresses per layout."""
    where = Where(CLAUSE, backend=backend.name)
    cls = vllm_class(CLAUSE, backend)
    if not callable(getattr(cls, "customize_spec", None)):
        raise where.skip(f"{backend.name} has no customize_spec", SkipKind.NOT_APPLICABLE)
    read = production_with_class(CLAUSE, backend.name, "customize_spec",
                                 partial(_read_backend, cls))
    scenarios: list[tuple[str | None, dict[str, Any]]] = [(None, read["plain"])]
    scenarios += list(read["quantised"].items())
    checked = []
    for cache_dtype, fields in scenarios:
        label = f"kv-cache dtype {cache_dtype}" if cache_dtype else f"a plain {DTYPE} page"
        if "raised" in fields:
            raise where.fail(f"{label}: customize_spec raised {fields['raised']}, though the "
                             f"backend lists {cache_dtype} in supported_kv_cache_dtypes")
        base = base_spec(cache_dtype)
        changed = {f: fields[f] for f in PAGE_FIELDS if fields[f] != getattr(base, f, None)}
        if not changed:
            continue
        if fields["type"] != type(base).__name__:
            raise where.fail(f"{label}: customize_spec returned a {fields['type']}, not the "
                             f"{type(base).__name__} it was given",
                             expected=type(base).__name__, actual=fields["type"])
        spec = dataclasses.replace(base, **changed)
        geom = _geometry(where, spec)
        _check_page(where, spec, geom, changed, cache_dtype)
        for layout in oracle.PHYSICAL_LAYOUTS:
            _check_layout(where.at(layout=layout), spec, geom, layout, label)
        checked.append(label)
    if not checked:
        supported = ", ".join(read["quantised"]) or "none"
        raise where.skip(f"{backend.name}.customize_spec leaves a plain {DTYPE} attention "
                         f"page unchanged, and the page of every quantised KV-cache dtype it "
                         f"supports ({supported}) (nothing to check)", SkipKind.NOT_APPLICABLE)
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


def _check_page(where: Where, spec: Any, geom: oracle.Geometry, changed: dict[str, Any],
                cache_dtype: str | None) -> None:
    what = ", ".join(f"{k}={v}" for k, v in sorted(changed.items()))
    if cache_dtype is not None:
        what = f"kv-cache dtype {cache_dtype}: {what}"
    if spec.page_size_bytes != geom.page_stride_bytes:
        raise where.fail(f"customize_spec ({what}): page_size_bytes is not the page its "
                         f"geometry holds ({geom.num_heads} slots x {geom.block_size} tokens "
                         f"x {geom.content_bytes} bytes)", expected=geom.page_stride_bytes,
                         actual=spec.page_size_bytes)
    if cache_dtype is not None:
        _check_quantised(where, geom, what, cache_dtype)
        return
    data = oracle.Geometry.for_attention(NUM_LAYERS, NUM_PAGES, NUM_KV_HEADS, BLOCK_SIZE,
                                         HEAD_SIZE, DTYPE)
    if geom.page_bytes != data.page_bytes:
        raise where.fail(f"customize_spec ({what}) repacks an unquantised page into "
                         f"{geom.page_bytes} bytes, but its K and V data are {data.page_bytes} "
                         f"bytes ({NUM_KV_HEADS} heads x {BLOCK_SIZE} tokens x "
                         f"{data.content_bytes} bytes)", expected=data.page_bytes,
                         actual=geom.page_bytes)


def _check_quantised(where: Where, geom: oracle.Geometry, what: str, cache_dtype: str
                     ) -> None:
    """A quantised page holds at least its data's bits (and per-token-head scales)."""
    k_bits, v_bits = DATA_BITS[cache_dtype]
    data = NUM_KV_HEADS * BLOCK_SIZE * (k_bits * HEAD_SIZE + v_bits * HEAD_SIZE) // 8
    scales = 2 * NUM_KV_HEADS * BLOCK_SIZE if cache_dtype in PER_TOKEN_HEAD else 0
    if geom.page_bytes < data + scales:
        raise where.fail(f"customize_spec ({what}) packs a page of {geom.page_bytes} bytes, "
                         f"too small for its data: {NUM_KV_HEADS} heads x {BLOCK_SIZE} tokens x "
                         f"({k_bits}-bit K + {v_bits}-bit V) x {HEAD_SIZE} = {data} bytes"
                         + (f", plus {scales} bytes of per-token-head scales" if scales else ""),
                         expected=f">= {data + scales}", actual=geom.page_bytes)


def _planned(layout: str, spec: Any, geom: oracle.Geometry) -> Any:
    vllm_config = kv_planner.control_plane_config()
    vllm_config.cache_config.kv_cache_layout = layout
    memory = geom.page_stride_bytes * NUM_LAYERS * NUM_PAGES
    specs = [{name: spec for name in layer_names()}]
    return kv_planner.get_kv_cache_configs(vllm_config, specs, [memory])[0]


def _check_layout(where: Where, spec: Any, geom: oracle.Geometry, layout: str,
                  label: str) -> None:
    try:
        expected = oracle.expected_tensor(layout, geom)
        table = oracle.address_table(layout, geom)
    except oracle.OracleUnsupported as exc:  # a padded page in a layout that cannot pad it
        raise where.skip(str(exc), SkipKind.NOT_APPLICABLE) from exc
    planner, allocate = f"{label}: {PLANNER}", f"{label}: {ALLOCATE}"
    config = where.call(planner, _planned, layout, spec, geom)
    if config.num_blocks != NUM_PAGES:
        raise where.fail_at(planner, f"memory for exactly {NUM_PAGES} customised pages per "
                            f"layer ({geom.page_stride_bytes} bytes each) was planned as "
                            "another number of blocks", expected=NUM_PAGES,
                            actual=config.num_blocks)
    tensors = list(config.kv_cache_tensors)
    if len(tensors) != 1:
        raise where.fail_at(planner, "one group of identical layers should be one "
                            "KVCacheTensor", expected=1, actual=len(tensors))
    compare_tensor(where, planner, tensors[0], expected, layer_names())
    allocated = where.call(allocate, _allocate, where, config, "cpu", compat.layout(layout))
    views = _views_in_order(where, allocate, allocated, layer_names())
    whole, base = bytemap.storage_bytes(views[0])
    check_views(where, allocate, views, whole, base, table, expected.size,
                dense=not geom.is_padded)

