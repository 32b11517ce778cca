"""Where the cells of real KV-cache views land, read back from the raw bytes.

The stride clauses must not trust a view's own metadata: each logical cell's index is
written *through* the views (as bytes, several passes of one base-256 digit each), the
raw buffer is read back, and every byte says which cell wrote it last.  torch is
imported lazily, so importing the checks costs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

AXES = ("layer", "block", "head", "token", "byte")
# Bytes either side of an allocation we build ourselves: a view that strays past its
# end lands here (and is reported) instead of in unrelated memory.
GUARD_FACTOR = 1


class InternalOverlap(RuntimeError):
    """torch refuses to write a view some of whose elements share a memory location."""


@dataclass(frozen=True)
class ByteMap:
    """The write-back of one group of per-layer views.

    ``actual`` has the logical ``[L, B', H, N', C]`` shape: the byte address (relative
    to the allocation start) where each cell's index was found, or -1 when another
    cell overwrote it.  ``written``/``owner``: every written address and the flat
    index of the cell found there.  ``metadata_address`` recomputes one cell's address
    from view metadata, only to name the cell that overwrote a lost one.
    """

    actual: np.ndarray
    written: np.ndarray
    owner: np.ndarray
    metadata_address: Any  # Callable[[tuple[int, ...]], int]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.actual.shape)

    def cell(self, flat: int) -> tuple[int, ...]:
        return tuple(int(i) for i in np.unravel_index(int(flat), self.shape))

    def owner_at(self, address: int) -> tuple[int, ...] | None:
        at = np.searchsorted(self.written, address)
        if at < self.written.size and self.written[at] == address:
            return self.cell(int(self.owner[at]))
        return None


def describe(cell: Sequence[int]) -> str:
    """``(layer=0, block=3, head=1, token=2, byte=5)``."""
    return "(" + ", ".join(f"{a}={int(i)}" for a, i in zip(AXES, cell, strict=True)) + ")"


def guarded_buffer(size: int, device: str) -> tuple[Any, Any, int]:
    """``(raw, whole, base)``: an int8 allocation of ``size`` bytes inside guard bytes.

    ``raw`` is what production code receives; ``whole`` is the uint8 storage around it,
    read back after writing; ``base`` is where ``raw`` starts in ``whole``.
    """
    import torch

    guard = max(size * GUARD_FACTOR, 1)
    whole = torch.zeros(guard + size + guard, dtype=torch.uint8, device=device)
    raw = whole[guard:guard + size].view(torch.int8)
    return raw, whole, guard


def storage_bytes(view: Any) -> tuple[Any, int]:
    """``(whole, base)`` for views into an allocation made by production code."""
    import torch

    storage = view.untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8, device=view.device)
    whole.set_(storage, 0, (storage.nbytes(),))
    return whole, 0


def read_back(views: Sequence[Any], whole: Any, base: int) -> ByteMap:
    """Write every cell's index through ``views`` (one group's layers, in L order)."""
    import torch

    if not views:
        raise ValueError("no views to read back")
    layers = [v.view(torch.uint8) for v in views]
    shapes = {tuple(v.shape) for v in layers}
    if len(shapes) != 1:
        raise ValueError(f"the layers' views differ in shape: {sorted(shapes)}")
    shape = (len(layers), *shapes.pop())
    cells = math.prod(shape)
    # Each cell's id (0 marks "not written"), as its 8 little-endian bytes: byte plane
    # ``digit`` is written through the views, and read back into that byte of ``found``.
    ids = np.arange(1, cells + 1, dtype="<i8").view(np.uint8).reshape(*shape, 8)
    digits = max(1, math.ceil(math.log2(cells + 1) / 8))
    found_bytes = np.zeros((whole.numel(), 8), dtype=np.uint8)
    for digit in range(digits):
        whole.zero_()
        for index, view in enumerate(layers):
            plane = np.ascontiguousarray(ids[index, ..., digit])
            source = torch.from_numpy(plane).to(view.device)
            try:
                view.copy_(source)
            except RuntimeError as exc:
                if "memory location" in str(exc):
                    raise InternalOverlap(f"layer {index}'s view: {exc}") from exc
                raise
        found_bytes[:, digit] = whole.cpu().numpy()
    whole.zero_()
    found = found_bytes.view("<i8").reshape(-1)
    written = np.flatnonzero(found)
    owner = found[written] - 1
    actual = np.full(cells, -1, dtype=np.int64)
    actual[owner] = written - base
    strides = [(v.storage_offset(), v.stride()) for v in layers]

    def metadata_address(cell: tuple[int, ...]) -> int:
        start, stride = strides[cell[0]]
        return start + sum(i * s for i, s in zip(cell[1:], stride, strict=True)) - base

    return ByteMap(actual.reshape(shape), written - base, owner, metadata_address)
