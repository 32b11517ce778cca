"""Expected KV-cache byte addresses from first principles (contract, "Oracle rule").

Nothing here calls or mirrors vLLM's stride derivation. An address is the position of a
cell in a contiguous byte array allocated in the layout's *physical* axis order (outermost
first), read back in *logical* ``[L, B, H, N, C]`` order; strides are differences of such
addresses. Two independent readings are offered and cross-checked by the tests: a
materialised table (``np.arange`` + transpose) for small geometries, and per-cell C-order
linearisation (``np.ravel_multi_index``) that scales to real allocations.

numpy + stdlib only, so checks and the report can use it without vLLM installed.
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass, replace
from typing import NamedTuple, Protocol

import numpy as np

# Our own table (stdlib, in model.py), keyed by name: the oracle never asks torch or vLLM
# for a size.
from pytest_kvconform.contract.records import DTYPE_SIZES as DTYPE_SIZES

LOGICAL_AXES: tuple[str, ...] = ("L", "B", "H", "N", "C")
PHYSICAL_LAYOUTS: tuple[str, ...] = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")

# A materialised table beyond this many cells is refused: use page_start / cell_address.
MAX_TABLE_CELLS = 1 << 26


class _Named(Protocol):
    @property
    def name(self) -> str: ...


LayoutLike = str | _Named  # a name, or anything (e.g. an enum member) with that .name


class OracleUnsupported(ValueError):
    """The geometry cannot be laid out in this layout (vLLM documents an error for it)."""


class Duplicate(NamedTuple):
    """Two logical cells that share one byte: why a stride clause failed."""

    address: int
    first: tuple[int, ...]
    second: tuple[int, ...]


class OutOfRange(NamedTuple):
    """A logical cell whose address falls outside the allocation."""

    address: int
    index: tuple[int, ...]  # type: ignore[assignment]  # shadows tuple.index, by design


def physical_order(layout: LayoutLike) -> tuple[str, ...]:
    """The logical axes in physical order, outermost first, parsed from the layout's name."""
    name = layout if isinstance(layout, str) else getattr(layout, "name", None)
    if name not in PHYSICAL_LAYOUTS:
        raise ValueError(
            f"unknown KV-cache layout {layout!r}; expected one of {', '.join(PHYSICAL_LAYOUTS)}"
        )
    return tuple(name)


def is_block_outermost(layout: LayoutLike) -> bool:
    """Each block holds all layers' pages together (the successor of the old stride flag)."""
    return physical_order(layout)[0] == "B"


def is_layer_outermost(layout: LayoutLike) -> bool:
    """Each layer owns one contiguous run of the allocation."""
    return physical_order(layout)[0] == "L"


def is_block_compact(layout: LayoutLike) -> bool:
    """L and B are the two outermost axes, so every (layer, block) page is one byte run."""
    return set(physical_order(layout)[:2]) == {"L", "B"}


def dtype_size(dtype: object) -> int:
    """Bytes per element, by name; accepts ``"bf16"``, ``torch.bfloat16``, ``np.float16``..."""
    name = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", None) or str(dtype)
    key = name.lower().removeprefix("torch.")
    try:
        return DTYPE_SIZES[key]
    except KeyError:
        raise ValueError(
            f"unknown dtype {dtype!r}; known names: {', '.join(sorted(DTYPE_SIZES))}"
        ) from None


def _positive(name: str, value: object) -> int:
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if isinstance(value, bool) or number < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return number


@dataclass(frozen=True)
class Geometry:
    """Sizes of the logical axes of one cache group; C is in bytes.

    ``page_size_padded`` pads every (layer, block) page at its end; ``kernel_block_size``
    splits each manager block into ``block_size // kernel_block_size`` kernel blocks.
    """

    num_layers: int
    num_blocks: int
    num_heads: int
    block_size: int
    content_bytes: int
    page_size_padded: int | None = None
    kernel_block_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "num_heads", "block_size", "content_bytes"):
            object.__setattr__(self, name, _positive(name, getattr(self, name)))
        if self.page_size_padded is not None:
            padded = _positive("page_size_padded", self.page_size_padded)
            if padded < self.page_bytes:
                raise ValueError(
                    f"page_size_padded={padded} is smaller than the page ({self.page_bytes} "
                    f"bytes = {self.num_heads} heads x {self.block_size} tokens x "
                    f"{self.content_bytes} bytes)"
                )
            object.__setattr__(self, "page_size_padded", padded)
        if self.kernel_block_size is not None:
            k = _positive("kernel_block_size", self.kernel_block_size)
            if self.block_size % k:
                raise ValueError(
                    f"kernel_block_size={k} does not divide block_size={self.block_size}"
                )
            object.__setattr__(self, "kernel_block_size", k)

    @classmethod
    def for_attention(
        cls,
        num_layers: int,
        num_blocks: int,
        num_kv_heads: int,
        block_size: int,
        head_size: int,
        dtype: object,
        head_size_v: int | None = None,
        page_size_padded: int | None = None,
        kernel_block_size: int | None = None,
    ) -> Geometry:
        """An attention group: one cell holds K and V of one (head, token) together."""
        v = head_size if head_size_v is None else head_size_v
        head_size = _positive("head_size", head_size)
        v = _positive("head_size_v", v)
        return cls(
            num_layers=num_layers,
            num_blocks=num_blocks,
            num_heads=num_kv_heads,
            block_size=block_size,
            content_bytes=(head_size + v) * dtype_size(dtype),
            page_size_padded=page_size_padded,
            kernel_block_size=kernel_block_size,
        )

    @property
    def page_bytes(self) -> int:
        """Bytes of one dense (layer, block) page: H * N * C."""
        return self.num_heads * self.block_size * self.content_bytes

    @property
    def page_stride_bytes(self) -> int:
        """Bytes a page occupies, padding included."""
        return self.page_size_padded if self.page_size_padded is not None else self.page_bytes

    @property
    def is_padded(self) -> bool:
        return self.page_stride_bytes > self.page_bytes

    @property
    def kernel_ratio(self) -> int:
        """Kernel blocks per manager block (1 without splitting)."""
        k = self.kernel_block_size
        return 1 if k is None else self.block_size // k

    @property
    def table_shape(self) -> tuple[int, int, int, int, int]:
        """Logical ``[L, B', H, N', C]`` shape of the address table (B', N' at kernel grain)."""
        r = self.kernel_ratio
        return (
            self.num_layers,
            self.num_blocks * r,
            self.num_heads,
            self.block_size // r,
            self.content_bytes,
        )


@dataclass(frozen=True)
class OracleTensor:
    """What a ``KVCacheTensor`` of this group must say, minus its layer names.

    ``size`` is the end of the group's region (``offset`` + its bytes, padding included),
    so every address lies in ``[0, size)``; strides are per manager block.
    """

    size: int
    layer_stride: int
    block_stride: int
    offset: int


@dataclass(frozen=True)
class _Allocation:
    """The physical array: a grid of pages (the axes outside the page tail), then the tail."""

    order: tuple[str, ...]
    grid_shape: tuple[int, ...]
    tail_shape: tuple[int, ...]
    page_stride: int  # bytes per grid cell, padding included

    @property
    def nbytes(self) -> int:
        return math.prod(self.grid_shape) * self.page_stride


def _extents(geom: Geometry) -> dict[str, int]:
    """Each logical axis's extent (B and N at kernel grain)."""
    return dict(zip(LOGICAL_AXES, geom.table_shape, strict=True))


def page_tail(layout: LayoutLike) -> tuple[str, ...]:
    """The physical axes inside one (layer, block) page: the innermost run of H, N and C."""
    order = physical_order(layout)
    inner_first = itertools.takewhile(lambda axis: axis not in ("L", "B"), reversed(order))
    return tuple(inner_first)[::-1]


def _allocation(layout: LayoutLike, geom: Geometry) -> _Allocation:
    """Lay the geometry out physically, or say why it cannot be (OracleUnsupported).

    A (layer, block) page is the layout's H/N/C tail and padding is added per page (the
    contract's definition, not vLLM's stride code), so a padded page can only be placed
    when every axis outside the tail is L, B or of extent 1: any other axis would repeat
    the padding inside a page or spread one page over several runs.
    """
    order = physical_order(layout)
    name = "".join(order)
    extent = _extents(geom)
    tail = page_tail(layout)
    outside = order[: len(order) - len(tail)]
    grid_shape = tuple(extent[axis] for axis in outside)
    tail_shape = tuple(extent[axis] for axis in tail)
    page_stride = math.prod(tail_shape)
    if geom.is_padded:
        if geom.kernel_ratio > 1:
            raise OracleUnsupported(
                f"{name}: padded pages (page_size_padded={geom.page_size_padded}) cannot be "
                f"split into kernel blocks of {geom.kernel_block_size} tokens"
            )
        stray = [axis for axis in outside if axis not in ("L", "B") and extent[axis] != 1]
        if stray:
            raise OracleUnsupported(
                f"{name}: page padding needs the axes outside the page tail to be L, B or "
                f"singleton, but {'/'.join(stray)} has size > 1 ({geom})"
            )
        page_stride = geom.page_stride_bytes
    if geom.kernel_ratio > 1:
        manager = replace(geom, kernel_block_size=None)
        step = _axis_step(layout, manager, "B")
        if step != geom.page_bytes:
            raise OracleUnsupported(
                f"{name}: a manager block is not one dense page (block step {step} != page "
                f"{geom.page_bytes} bytes), so it cannot be split into {geom.kernel_ratio} "
                f"kernel blocks of {geom.kernel_block_size} tokens"
            )
    return _Allocation(order, grid_shape, tail_shape, page_stride)


def address_table(
    layout: LayoutLike, geom: Geometry, offset: int = 0, *, max_cells: int = MAX_TABLE_CELLS
) -> np.ndarray:
    """int64 ``[L, B', H, N', C]`` array: the byte address of every logical cell.

    Allocated as ``np.arange`` over the physical array (each page padded at its end),
    then transposed back to logical order.
    """
    cells = math.prod(geom.table_shape)
    if cells > max_cells:
        raise ValueError(
            f"address table of {cells} cells exceeds max_cells={max_cells}; "
            "use page_start/cell_address for large geometries"
        )
    alloc = _allocation(layout, geom)
    pages = math.prod(alloc.grid_shape)
    tail = math.prod(alloc.tail_shape)
    flat = np.arange(alloc.nbytes, dtype=np.int64) + offset
    used = flat.reshape(pages, alloc.page_stride)[:, :tail]
    physical = used.reshape(alloc.grid_shape + alloc.tail_shape)
    to_logical = [alloc.order.index(axis) for axis in LOGICAL_AXES]
    return np.ascontiguousarray(physical.transpose(to_logical))


def cell_address(
    layout: LayoutLike,
    geom: Geometry,
    index: tuple[int, int, int, int, int],
    offset: int = 0,
) -> int:
    """Byte address of one logical ``(l, b', h, n', c)`` cell, without building the table."""
    alloc = _allocation(layout, geom)
    shape = geom.table_shape
    if len(index) != 5 or not all(0 <= i < n for i, n in zip(index, shape, strict=True)):
        raise IndexError(f"cell {index!r} outside the table shape {shape}")
    at = dict(zip(LOGICAL_AXES, index, strict=True))
    physical = [at[axis] for axis in alloc.order]
    g = len(alloc.grid_shape)
    page = np.ravel_multi_index(tuple(physical[:g]), alloc.grid_shape)
    within = np.ravel_multi_index(tuple(physical[g:]), alloc.tail_shape)
    return offset + int(page) * alloc.page_stride + int(within)


def _axis_step(layout: LayoutLike, geom: Geometry, axis: str) -> int:
    """Address difference between index 1 and 0 of L or B (a singleton axis is grown to 2:
    an axis's own step depends only on the axes inside it, so growing it changes nothing)."""
    if axis == "L" and geom.num_layers == 1:
        geom = replace(geom, num_layers=2)
    if axis == "B" and geom.num_blocks == 1:
        geom = replace(geom, num_blocks=2)
    one = (1, 0, 0, 0, 0) if axis == "L" else (0, geom.kernel_ratio, 0, 0, 0)
    return cell_address(layout, geom, one) - cell_address(layout, geom, (0, 0, 0, 0, 0))


def expected_tensor(layout: LayoutLike, geom: Geometry, offset: int = 0) -> OracleTensor:
    """The ``KVCacheTensor`` numbers implied by the addresses (strides per manager block)."""
    alloc = _allocation(layout, geom)  # raises for unrepresentable geometries
    manager = replace(geom, kernel_block_size=None)
    return OracleTensor(
        size=offset + alloc.nbytes,
        layer_stride=_axis_step(layout, manager, "L"),
        block_stride=_axis_step(layout, manager, "B"),
        offset=offset,
    )


def page_start(layout: LayoutLike, geom: Geometry, layer: int, block: int, offset: int = 0) -> int:
    """Address of cell ``[layer, block, 0, 0, 0]``; ``block`` is a manager block id."""
    if not (0 <= layer < geom.num_layers and 0 <= block < geom.num_blocks):
        raise IndexError(
            f"(layer={layer}, block={block}) outside {geom.num_layers} layers x "
            f"{geom.num_blocks} blocks"
        )
    return cell_address(layout, geom, (layer, block * geom.kernel_ratio, 0, 0, 0), offset)


def assert_unique(table: np.ndarray) -> Duplicate | None:
    """The first cell (logical C order) sharing its byte with an earlier one; None if none."""
    flat = np.asarray(table).ravel()
    _, first_seen = np.unique(flat, return_index=True)
    repeats = np.ones(flat.size, dtype=bool)
    repeats[first_seen] = False
    if not repeats.any():
        return None
    second = int(np.argmax(repeats))
    address = flat[second]
    first = int(np.argmax(flat == address))
    shape = np.shape(table)
    return Duplicate(
        int(address),
        tuple(int(i) for i in np.unravel_index(first, shape)),
        tuple(int(i) for i in np.unravel_index(second, shape)),
    )


def first_out_of_range(table: np.ndarray, lo: int, hi: int) -> OutOfRange | None:
    """The first cell whose address is outside ``[lo, hi)``; None if all are inside."""
    arr = np.asarray(table)
    bad = (arr < lo) | (arr >= hi)
    if not bad.any():
        return None
    at = np.unravel_index(int(np.argmax(bad.ravel())), arr.shape)
    return OutOfRange(int(arr[at]), tuple(int(i) for i in at))


def covers_exactly(table: np.ndarray, size: int, start: int = 0) -> bool:
    """Every byte of ``[start, size)`` is addressed by exactly one cell."""
    flat = np.asarray(table).ravel()
    if flat.size != size - start:
        return False
    return bool(np.array_equal(np.sort(flat), np.arange(start, size, dtype=flat.dtype)))
