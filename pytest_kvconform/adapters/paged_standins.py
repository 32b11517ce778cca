"""Stand-in paged backends for KV-L7: small pure-torch ``forward_paged`` kernels.

Each reads K/V from the allocated view (``ctx.layer.kv_cache``, ``[B, H, N, 2*D]``)
through the block table in ``ctx.native_metadata``, the way a paged kernel does,
so KV-L7 runs on any device.  Three read correctly (one per layout family, and one
that declares CUDA its only paged device); the others carry one seeded mistake each,
and KV-L7 must fail them naming the first wrong block: the evidence that the check can
fail, on CPU in the plugin's own tests and on CUDA in ``kvconform gpu-check``.
``kvconform selftest`` plants each misread into a conforming stand-in
(``faults/plants.py``) and checks that KV-L7 fails it there.

A pytest plugin module: ``-p pytest_kvconform.adapters.paged_standins`` registers them
through the plugin's hook (``pytest_kvconform_backends``).  Shipped in the package so the
installed ``kvconform gpu-check`` can load them.
"""

from __future__ import annotations

from typing import Any

import torch


class ReadsThroughTable:
    """The conforming read: block_table[r][j] is the physical block of logical block j."""

    def __init__(self, num_heads: int, head_size: int, softmax_scale: float,
                 causal: bool = False, num_kv_heads: int | None = None, **_: Any) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = softmax_scale

    def pages(self, cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
        return cache[table[:n].long()]

    def forward_paged(self, ctx: Any) -> torch.Tensor:
        cache, meta, d = ctx.layer.kv_cache, ctx.native_metadata, ctx.layer.head_size
        heads, block = cache.shape[1], cache.shape[2]
        outs = []
        for r in range(meta.seq_lens.shape[0]):
            seq = int(meta.seq_lens[r])
            q0, q1 = int(meta.query_start_loc[r]), int(meta.query_start_loc[r + 1])
            n = -(-seq // block)
            self.seq = seq
            kv = self.pages(cache, meta.block_table[r], n)  # [n, H, N, 2D]
            kv = kv.permute(0, 2, 1, 3).reshape(n * block, heads, 2 * d)[:seq]
            k, v = kv[..., :d], kv[..., d:]
            q = ctx.query[q0:q1]
            group = q.shape[1] // heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
                scale=self.scale)
            outs.append(out.transpose(0, 1).to(q.dtype))
        return ctx.restore_output(torch.cat(outs))


class IgnoresTable(ReadsThroughTable):
    """Reads physical block j for logical block j: the block table is never consulted."""

    def pages(self, cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
        return cache[:n]


class WrongBlockStride(ReadsThroughTable):
    """Steps from block to block by one page, as if the layers were not interleaved
    per block: right for a layer-outermost layout, wrong for a block-outermost one."""

    def pages(self, cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
        page = cache[0].numel()
        packed = torch.as_strided(cache, cache.shape, (page, *cache.stride()[1:]),
                                  cache.storage_offset())
        return packed[table[:n].long()]


class TruncatesPartialBlock(ReadsThroughTable):
    """Counts blocks by floor division: a request's last, partly filled block is read
    from the null block 0 instead of its own."""

    def pages(self, cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
        ids = table[:n].long().clone()
        ids[self.seq // cache.shape[2]:] = 0  # the floor-division bug
        return cache[ids]


class _PagedBackend:
    NAME = ""  # the name it is registered under (STANDINS), which get_name() answers
    supports_paged_kv = True
    paged_kv_devices: tuple[str, ...] = ("cpu", "cuda")
    NEED = False
    IMPL: type = ReadsThroughTable
    MISREADS = False  # KV-L7 must fail it, naming the first wrong block

    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        return cls.NEED

    @classmethod
    def get_name(cls) -> str:
        return cls.NAME

    @classmethod
    def get_impl_cls(cls) -> type:
        return cls.IMPL


class PagedOk(_PagedBackend):
    """Conforming, layer-outermost (LBNHC, LBHNC, LHBNC)."""

    NAME = "PAGED_OK"


class PagedOkBlockStride(_PagedBackend):
    """Conforming, block-outermost (BLNHC, BLHNC, BHLNC)."""

    NAME = "PAGED_OK_BS"
    NEED = True


class PagedIgnoresTable(_PagedBackend):
    NAME = "PAGED_NO_TABLE"
    IMPL = IgnoresTable
    MISREADS = True


class PagedWrongStride(_PagedBackend):
    NAME = "PAGED_BAD_STRIDE"
    NEED = True
    IMPL = WrongBlockStride
    MISREADS = True


class PagedTruncates(_PagedBackend):
    NAME = "PAGED_TRUNCATES"
    IMPL = TruncatesPartialBlock
    MISREADS = True


class PagedCudaOnly(_PagedBackend):
    NAME = "PAGED_CUDA_ONLY"
    paged_kv_devices = ("cuda",)


STANDINS: dict[str, type[_PagedBackend]] = {cls.NAME: cls for cls in (
    PagedOk, PagedOkBlockStride, PagedIgnoresTable, PagedWrongStride, PagedTruncates,
    PagedCudaOnly)}
# What KV-L7 must find for each: a conforming read passes, a seeded misread fails.
MISREADS = frozenset(name for name, cls in STANDINS.items() if cls.MISREADS)
CONFORMING = frozenset(STANDINS) - MISREADS


def pytest_kvconform_backends(config: Any) -> dict[str, type]:
    """The plugin's hook: every stand-in, under its name."""
    return dict(STANDINS)
