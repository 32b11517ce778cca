"""The oracle against hand-worked layouts, its own invariants, and (if installed) vLLM.

Hand examples use pairwise distinct axis sizes (L=2, B=3, H=5, N=7, C=4) so that a
swapped axis cannot hide behind an equal size. Expected strides below were worked out on
paper from the layout letters, not computed by the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_kvconform.contract.oracle import (
    PHYSICAL_LAYOUTS,
    Duplicate,
    Geometry,
    OracleTensor,
    OracleUnsupported,
    OutOfRange,
    address_table,
    assert_unique,
    cell_address,
    covers_exactly,
    dtype_size,
    expected_tensor,
    first_out_of_range,
    is_block_compact,
    is_block_outermost,
    is_layer_outermost,
    page_start,
    page_tail,
    physical_order,
)

GEOM = Geometry(num_layers=2, num_blocks=3, num_heads=5, block_size=7, content_bytes=4)
PAGE = 5 * 7 * 4  # 140

# Logical [L, B, H, N, C] byte strides for GEOM, worked by hand from the physical order.
HAND_STRIDES: dict[str, tuple[int, int, int, int, int]] = {
    "LBHNC": (3 * PAGE, PAGE, 7 * 4, 4, 1),
    "LBNHC": (3 * PAGE, PAGE, 4, 5 * 4, 1),
    "LHBNC": (5 * 3 * 7 * 4, 7 * 4, 3 * 7 * 4, 4, 1),
    "BLHNC": (PAGE, 2 * PAGE, 7 * 4, 4, 1),
    "BLNHC": (PAGE, 2 * PAGE, 4, 5 * 4, 1),
    "BHLNC": (7 * 4, 5 * 2 * 7 * 4, 2 * 7 * 4, 4, 1),
}

# Address of cell [1, 2, 3, 4, 1], computed by hand.
HAND_CELL: dict[str, int] = {
    "LBHNC": 420 + 280 + 84 + 16 + 1,
    "LBNHC": 420 + 280 + 12 + 80 + 1,
    "LHBNC": 420 + 56 + 252 + 16 + 1,
    "BLHNC": 140 + 560 + 84 + 16 + 1,
    "BLNHC": 140 + 560 + 12 + 80 + 1,
    "BHLNC": 28 + 560 + 168 + 16 + 1,
}


def strided(shape: tuple[int, ...], strides: tuple[int, ...], offset: int = 0) -> np.ndarray:
    """Addresses a strided view with these byte strides would touch."""
    idx = np.indices(shape, sparse=True)
    return offset + sum(i * s for i, s in zip(idx, strides, strict=True))


# --- layout names ---------------------------------------------------------------------


def test_physical_order_parses_names() -> None:
    assert physical_order("LBHNC") == ("L", "B", "H", "N", "C")
    assert physical_order("BHLNC") == ("B", "H", "L", "N", "C")
    assert len(set(PHYSICAL_LAYOUTS)) == 6


@dataclass(frozen=True)
class _Member:
    name: str


def test_physical_order_accepts_enum_like_members() -> None:
    assert physical_order(_Member("BLNHC")) == ("B", "L", "N", "H", "C")


@pytest.mark.parametrize("bad", ["lbhnc", "LBHN", "NHD", "CBLHN", "", 3, None])
def test_physical_order_rejects_unknown_names(bad: object) -> None:
    with pytest.raises(ValueError, match="unknown KV-cache layout") as info:
        physical_order(bad)  # type: ignore[arg-type]
    assert repr(bad) in str(info.value)


def test_layout_predicates() -> None:
    assert [x for x in PHYSICAL_LAYOUTS if is_block_outermost(x)] == ["BLHNC", "BLNHC", "BHLNC"]
    assert [x for x in PHYSICAL_LAYOUTS if is_layer_outermost(x)] == ["LBHNC", "LBNHC", "LHBNC"]
    assert [x for x in PHYSICAL_LAYOUTS if is_block_compact(x)] == [
        "LBHNC",
        "LBNHC",
        "BLHNC",
        "BLNHC",
    ]


# --- geometry -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "size"),
    [("bfloat16", 2), ("bf16", 2), ("fp16", 2), ("half", 2), ("float32", 4), ("fp8", 1),
     ("float8_e4m3fn", 1), ("uint8", 1), ("torch.bfloat16", 2), (np.float16, 2)],
)  # fmt: skip
def test_dtype_size(dtype: object, size: int) -> None:
    assert dtype_size(dtype) == size


def test_dtype_size_unknown() -> None:
    with pytest.raises(ValueError, match="complex64"):
        dtype_size("complex64")


def test_for_attention_counts_k_and_v() -> None:
    g = Geometry.for_attention(2, 3, num_kv_heads=4, block_size=16, head_size=64, dtype="bf16")
    assert g.content_bytes == (64 + 64) * 2
    assert g.page_bytes == 4 * 16 * 256
    assert g.page_stride_bytes == g.page_bytes
    mla = Geometry.for_attention(1, 1, 1, 16, head_size=192, dtype="fp8", head_size_v=128)
    assert mla.content_bytes == 320


def test_geometry_validation() -> None:
    with pytest.raises(ValueError, match="num_heads"):
        Geometry(2, 3, 0, 7, 4)
    with pytest.raises(ValueError, match="smaller than the page"):
        Geometry(2, 3, 5, 7, 4, page_size_padded=PAGE - 1)
    with pytest.raises(ValueError, match="does not divide"):
        Geometry(2, 3, 5, 8, 4, kernel_block_size=3)
    with pytest.raises(ValueError, match="does not divide"):
        Geometry(2, 3, 5, 8, 4, kernel_block_size=16)
    padded = Geometry(2, 3, 5, 7, 4, page_size_padded=150)
    assert (padded.page_bytes, padded.page_stride_bytes) == (140, 150)


# --- hand-worked dense layouts --------------------------------------------------------


@pytest.mark.parametrize("layout", PHYSICAL_LAYOUTS)
def test_dense_table_matches_hand_strides(layout: str) -> None:
    table = address_table(layout, GEOM)
    assert table.dtype == np.int64
    assert table.shape == (2, 3, 5, 7, 4)
    assert int(table[1, 2, 3, 4, 1]) == HAND_CELL[layout]
    assert int(table[0, 0, 0, 0, 0]) == 0
    np.testing.assert_array_equal(table, strided(table.shape, HAND_STRIDES[layout]))
    ls, bs = HAND_STRIDES[layout][:2]
    assert expected_tensor(layout, GEOM) == OracleTensor(840, ls, bs, 0)
    assert covers_exactly(table, 840)


@pytest.mark.parametrize("layout", PHYSICAL_LAYOUTS)
def test_offset_shifts_every_address(layout: str) -> None:
    table = address_table(layout, GEOM, offset=1000)
    np.testing.assert_array_equal(table, address_table(layout, GEOM) + 1000)
    assert expected_tensor(layout, GEOM, offset=1000) == OracleTensor(
        1840, *HAND_STRIDES[layout][:2], 1000
    )
    ls, bs = HAND_STRIDES[layout][:2]
    assert page_start(layout, GEOM, 1, 2, offset=1000) == 1000 + ls + 2 * bs


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "LHBNC"])
def test_layer_outermost_layer_stride_is_all_blocks(layout: str) -> None:
    assert expected_tensor(layout, GEOM).layer_stride == PAGE * GEOM.num_blocks


@pytest.mark.parametrize("layout", ["BLHNC", "BLNHC", "BHLNC"])
def test_block_outermost_block_stride_packs_all_layers(layout: str) -> None:
    assert expected_tensor(layout, GEOM).block_stride == PAGE * GEOM.num_layers


@pytest.mark.parametrize("layout", PHYSICAL_LAYOUTS)
def test_singleton_axes_keep_their_natural_stride(layout: str) -> None:
    """With L == 1 or B == 1 the stride is the one a second entry would have: an axis's own
    stride depends only on the axes inside it, so it equals the hand stride for L=2, B=3."""
    assert expected_tensor(layout, Geometry(1, 3, 5, 7, 4)).layer_stride == HAND_STRIDES[layout][0]
    assert expected_tensor(layout, Geometry(2, 1, 5, 7, 4)).block_stride == HAND_STRIDES[layout][1]


def test_block_compact_pages_are_byte_runs_and_lhbnc_is_not() -> None:
    for layout in PHYSICAL_LAYOUTS:
        table = address_table(layout, GEOM)
        start = page_start(layout, GEOM, 1, 2)
        run = np.array_equal(np.sort(table[1, 2].ravel()), np.arange(start, start + PAGE))
        assert run == is_block_compact(layout), layout


# --- padded pages ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "heads", "padded", "layer_stride", "block_stride", "size"),
    [
        ("LBHNC", 5, 150, 450, 150, 900),
        ("LBNHC", 5, 150, 450, 150, 900),
        ("BLHNC", 5, 150, 150, 300, 900),
        ("BLNHC", 5, 150, 150, 300, 900),
        ("LHBNC", 1, 32, 96, 32, 192),  # page 1*7*4 = 28; H singleton sits in the grid
        ("BHLNC", 1, 32, 32, 64, 192),
    ],
)
def test_padded_pages(
    layout: str, heads: int, padded: int, layer_stride: int, block_stride: int, size: int
) -> None:
    geom = Geometry(2, 3, heads, 7, 4, page_size_padded=padded)
    page = heads * 7 * 4
    table = address_table(layout, geom)
    assert expected_tensor(layout, geom) == OracleTensor(size, layer_stride, block_stride, 0)
    assert assert_unique(table) is None
    assert first_out_of_range(table, 0, size) is None
    assert not covers_exactly(table, size)
    used = set(table.ravel().tolist())
    for lay in range(2):
        for blk in range(3):
            start = lay * layer_stride + blk * block_stride
            assert page_start(layout, geom, lay, blk) == start
            assert set(range(start, start + page)) <= used
            assert not set(range(start + page, start + padded)) & used  # the pad is unused
    assert len(used) == 2 * 3 * page


def test_padded_equal_to_page_is_dense() -> None:
    geom = Geometry(2, 3, 5, 7, 4, page_size_padded=PAGE)
    np.testing.assert_array_equal(address_table("LHBNC", geom), address_table("LHBNC", GEOM))


@pytest.mark.parametrize("layout", ["LHBNC", "BHLNC"])
def test_padding_with_heads_outside_page_tail_is_unsupported(layout: str) -> None:
    geom = Geometry(2, 3, 5, 7, 4, page_size_padded=150)
    with pytest.raises(OracleUnsupported, match=f"{layout}.*H"):
        address_table(layout, geom)
    with pytest.raises(OracleUnsupported):
        expected_tensor(layout, geom)
    with pytest.raises(OracleUnsupported):
        page_start(layout, geom, 0, 0)


@pytest.mark.parametrize(("layout", "tail"), [
    ("LBHNC", "HNC"), ("LBNHC", "NHC"), ("LHBNC", "NC"),
    ("BLHNC", "HNC"), ("BLNHC", "NHC"), ("BHLNC", "NC"),
])
def test_page_tail_is_the_innermost_run_of_h_n_c(layout: str, tail: str) -> None:
    assert page_tail(layout) == tuple(tail)


def test_padding_with_kernel_split_is_unsupported() -> None:
    geom = Geometry(2, 3, 5, 8, 4, page_size_padded=200, kernel_block_size=4)
    with pytest.raises(OracleUnsupported, match="padded"):
        address_table("LBHNC", geom)


# --- kernel block splitting -----------------------------------------------------------

SPLIT = Geometry(2, 3, 5, 8, 4, kernel_block_size=2)  # ratio 4, page 160, kernel page 40


@pytest.mark.parametrize(
    ("layout", "strides"),
    [("LBHNC", (480, 40, 8, 4, 1)), ("LBNHC", (480, 40, 4, 20, 1))],
)
def test_kernel_split_consecutive_dense_kernel_pages(layout: str, strides: tuple[int, ...]) -> None:
    table = address_table(layout, SPLIT)
    assert table.shape == (2, 12, 5, 2, 4)
    np.testing.assert_array_equal(table, strided(table.shape, strides))
    assert expected_tensor(layout, SPLIT) == OracleTensor(960, 480, 160, 0)
    assert page_start(layout, SPLIT, 1, 2) == 800 == int(table[1, 8, 0, 0, 0])
    assert covers_exactly(table, 960)


def test_kernel_split_with_degenerate_axes_is_supported() -> None:
    """One layer (block-outermost) or one head (LHBNC) leaves a block one dense page."""
    one_layer = Geometry(1, 3, 5, 8, 4, kernel_block_size=2)
    table = address_table("BLHNC", one_layer)
    np.testing.assert_array_equal(table, strided((1, 12, 5, 2, 4), (0, 40, 8, 4, 1)))
    assert expected_tensor("BLHNC", one_layer) == OracleTensor(480, 160, 160, 0)
    one_head = Geometry(2, 3, 1, 8, 4, kernel_block_size=2)
    table = address_table("LHBNC", one_head)
    np.testing.assert_array_equal(table, strided((2, 12, 1, 2, 4), (96, 8, 0, 4, 1)))
    assert expected_tensor("LHBNC", one_head) == OracleTensor(192, 96, 32, 0)


@pytest.mark.parametrize("layout", ["LHBNC", "BLHNC", "BLNHC", "BHLNC"])
def test_kernel_split_of_non_dense_blocks_is_unsupported(layout: str) -> None:
    with pytest.raises(OracleUnsupported, match=f"{layout}.*not one dense page"):
        address_table(layout, SPLIT)
    with pytest.raises(OracleUnsupported):
        expected_tensor(layout, SPLIT)


def test_kernel_block_equal_to_block_size_is_no_split() -> None:
    geom = Geometry(2, 3, 5, 7, 4, kernel_block_size=7)
    np.testing.assert_array_equal(address_table("BHLNC", geom), address_table("BHLNC", GEOM))


# --- helpers and guards ---------------------------------------------------------------


def test_assert_unique_reports_first_duplicate() -> None:
    table = np.array([[0, 1, 2], [3, 1, 0]])
    assert assert_unique(table) == Duplicate(address=1, first=(0, 1), second=(1, 1))
    assert assert_unique(np.arange(6).reshape(2, 3)) is None


def test_first_out_of_range() -> None:
    table = np.array([[0, 5], [9, 10]])
    assert first_out_of_range(table, 0, 10) == OutOfRange(10, (1, 1))
    assert first_out_of_range(table, 1, 11) == OutOfRange(0, (0, 0))
    assert first_out_of_range(table, 0, 11) is None


def test_covers_exactly() -> None:
    assert covers_exactly(np.array([2, 0, 1]), 3)
    assert not covers_exactly(np.array([2, 0, 0]), 3)
    assert not covers_exactly(np.array([0, 1, 2]), 4)
    assert not covers_exactly(np.array([1, 2, 3]), 3)
    assert covers_exactly(np.array([5, 3, 4]), 6, start=3)


def test_large_tables_are_refused_but_cells_still_answer() -> None:
    big = Geometry.for_attention(32, 4096, 8, 16, 128, "bf16")
    with pytest.raises(ValueError, match="max_cells"):
        address_table("BLNHC", big)
    last = (31, 4095, 7, 15, 511)
    page = 8 * 16 * 512
    assert (
        cell_address("BLNHC", big, last)
        == 4095 * 32 * page + 31 * page + 15 * 8 * 512 + 7 * 512 + 511
    )
    assert expected_tensor("BLNHC", big) == OracleTensor(32 * 4096 * page, page, 32 * page, 0)


def test_index_errors() -> None:
    with pytest.raises(IndexError):
        page_start("LBHNC", GEOM, 2, 0)
    with pytest.raises(IndexError):
        page_start("LBHNC", SPLIT, 0, 3)  # manager blocks, not kernel blocks
    with pytest.raises(IndexError):
        cell_address("LBHNC", GEOM, (0, 0, 5, 0, 0))


# --- properties -----------------------------------------------------------------------


def _supported(layout: str, geom: Geometry) -> bool:
    """Representability, restated by hand from the letters (not from the oracle)."""
    padded, split = geom.is_padded, geom.kernel_ratio > 1
    if padded and split:
        return False
    if padded:
        return is_block_compact(layout) or geom.num_heads == 1
    if split:
        return (
            layout in ("LBHNC", "LBNHC")
            or (is_block_outermost(layout) and geom.num_layers == 1)
            or (layout == "LHBNC" and geom.num_heads == 1)
        )
    return True


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, Geometry, int]:
    layout = draw(st.sampled_from(PHYSICAL_LAYOUTS))
    kernel = draw(st.integers(1, 3))
    ratio = draw(st.sampled_from([1, 1, 2, 3]))
    heads, content = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    block = kernel * ratio
    pad = draw(st.one_of(st.none(), st.integers(1, 9)))
    geom = Geometry(
        num_layers=draw(st.integers(1, 4)),
        num_blocks=draw(st.integers(1, 4)),
        num_heads=heads,
        block_size=block,
        content_bytes=content,
        page_size_padded=None if pad is None else heads * block * content + pad,
        kernel_block_size=kernel if ratio > 1 else None,
    )
    return layout, geom, draw(st.integers(0, 64))


@settings(max_examples=300, deadline=None)
@given(cases())
def test_property_addresses(case: tuple[str, Geometry, int]) -> None:
    layout, geom, offset = case
    if not _supported(layout, geom):
        with pytest.raises(OracleUnsupported):
            address_table(layout, geom, offset)
        return
    table = address_table(layout, geom, offset)
    t = expected_tensor(layout, geom, offset)
    L, B, r = geom.num_layers, geom.num_blocks, geom.kernel_ratio
    page, stride = geom.page_bytes, geom.page_stride_bytes
    assert table.shape == geom.table_shape
    assert t.size - offset == L * B * stride
    assert assert_unique(table) is None
    assert first_out_of_range(table, offset, t.size) is None
    assert covers_exactly(table, t.size, offset) == (not geom.is_padded)

    # KV-S3 shapes of the strides.
    if is_layer_outermost(layout):
        assert t.layer_stride == stride * B
    if is_block_outermost(layout):
        assert t.block_stride == stride * L
    if is_block_compact(layout):
        assert stride in (t.layer_stride, t.block_stride)

    # Strides are what the table says, wherever the table can say it.
    if L > 1:
        assert int(table[1, 0, 0, 0, 0] - table[0, 0, 0, 0, 0]) == t.layer_stride
    if B > 1:
        assert int(table[0, r, 0, 0, 0] - table[0, 0, 0, 0, 0]) == t.block_stride

    dense_pages = is_block_compact(layout) or geom.num_heads == 1
    for lay in range(L):
        for blk in range(B):
            start = page_start(layout, geom, lay, blk, offset)
            assert start == offset + lay * t.layer_stride + blk * t.block_stride
            assert start == int(table[lay, blk * r, 0, 0, 0])
            cells = np.sort(table[lay, blk * r : (blk + 1) * r].ravel())
            if dense_pages:
                np.testing.assert_array_equal(cells, np.arange(start, start + page))
            for j in range(r):  # kernel block j of the manager block: its own dense sub-page
                assert int(table[lay, blk * r + j, 0, 0, 0]) == start + j * page // r


@settings(max_examples=150, deadline=None)
@given(cases(), st.data())
def test_property_cell_address_agrees_with_table(
    case: tuple[str, Geometry, int], data: st.DataObject
) -> None:
    layout, geom, offset = case
    if not _supported(layout, geom):
        return
    table = address_table(layout, geom, offset)
    index = tuple(data.draw(st.integers(0, n - 1)) for n in geom.table_shape)
    assert cell_address(layout, geom, index, offset) == int(table[index])


# --- cross-check against the installed vLLM (the only place it is touched) -----------


def test_oracle_agrees_with_vllm_compute_layout_strides() -> None:
    kvi = pytest.importorskip("vllm.v1.kv_cache_interface")
    kvl = pytest.importorskip("vllm.v1.kv_cache_layout")
    torch = pytest.importorskip("torch")
    spec = kvi.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    num_layers, num_blocks = 2, 3
    geom = Geometry.for_attention(num_layers, num_blocks, 2, 16, 64, "bfloat16")
    assert geom.page_bytes == spec.page_size_bytes
    for name in PHYSICAL_LAYOUTS:
        member = kvl.KVCacheLayout[name]
        strides = kvi.compute_layout_strides(spec, num_blocks, num_layers, member)
        table = address_table(member, geom)
        np.testing.assert_array_equal(table, strided(table.shape, strides), err_msg=name)
        assert expected_tensor(name, geom).layer_stride == strides[0], name
        assert expected_tensor(name, geom).block_stride == strides[1], name
    for name in ("LBHNC", "LBNHC"):  # kernel split, where it is representable
        split = Geometry.for_attention(
            num_layers, num_blocks, 2, 16, 64, "bfloat16", kernel_block_size=4
        )
        strides = kvi.compute_layout_strides(
            spec, num_blocks, num_layers, kvl.KVCacheLayout[name], kernel_block_size=4
        )
        table = address_table(name, split)
        np.testing.assert_array_equal(table, strided(table.shape, strides), err_msg=name)
