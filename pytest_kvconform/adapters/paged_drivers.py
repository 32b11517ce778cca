"""The two ways KV-L7 drives a backend's paged read path, both through production code.

- :class:`PortableDriver` for a backend whose ``forward_paged`` reads the cache
  itself (it declares the devices its kernel runs on, see :func:`declared_devices`):
  the production control plane sizes the cache for the pinned layout, the worker
  adopts the name and the installed ``init_kv_cache`` allocates the views; the
  harness writes K/V through those views at the block ids it chose, and hands the
  backend vllm-omni's own ``DiffusionPagedAttentionContext``.
- :class:`NativeDriver` for a backend that runs vllm-omni's native paged path
  (FLASH_ATTN: vLLM's ``reshape_and_cache_flash`` writer and paged FlashAttention
  kernel): vllm-omni's ``DiffusionKVModelRunnerBackend`` registers the layers,
  allocates (adopt + ``init_kv_cache``), installs the block ids as the scheduler
  would, and its ``DiffusionPagedAttentionAdapter`` prepares each layer's context;
  the backend's native writer puts K/V into the cache.

A driver's set-up failing is the harness's problem (:class:`HarnessError`); only
what the backend's ``forward_paged`` does is judged by the clause.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pytest_kvconform.adapters import compat, kv_allocation, kv_planner
from pytest_kvconform.adapters.control_plane import default_memory
from pytest_kvconform.contract.outcomes import HarnessError
from pytest_kvconform.contract.records import Case

# A backend declares where its paged kernel runs with this class attribute (or a
# classmethod of the same name): a tuple of device types, e.g. ("cpu", "cuda").
# Declaring it also says that its forward_paged reads the cache from the context
# (ctx.layer.kv_cache, ctx.native_metadata) rather than through a native vLLM impl.
DEVICES_ATTR = "paged_kv_devices"
# What an undeclared backend (vllm-omni's own) needs: vLLM's native paged kernels.
NATIVE_DEVICES = ("cuda",)
NATIVE_KERNEL = ("vLLM's native paged kernels (its compiled ops' reshape_and_cache_flash "
                 "writer, vllm_flash_attn paged FlashAttention)")
# vLLM's compiled ops: one extension, named ``_C`` in some releases and
# ``_C_stable_libtorch`` in others (0.30 ships only the latter); whichever is installed.
COMPILED_OPS = ("vllm._C", "vllm._C_stable_libtorch")
FLASH_ATTN_MODULE = "vllm.vllm_flash_attn"


def declared_devices(cls: Any) -> tuple[str, ...] | None:
    """The device types a backend declares for its paged kernel, or None if undeclared."""
    value = getattr(cls, DEVICES_ATTR, None)
    if value is None:
        return None
    if callable(value):
        value = value()
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{DEVICES_ATTR} must be a tuple of device types such as ('cpu', "
                        f"'cuda'), got {value!r}")
    return tuple(value)


def native_kernels_missing() -> str | None:
    """Why vLLM's compiled paged kernels cannot be loaded here (one line), or None.

    Loaded, not just looked up: an extension built for another torch is installed
    but unusable, and its import error says so.
    """
    ops = next((name for name in COMPILED_OPS if _installed(name)), None)
    if ops is None:
        return f"none of {', '.join(COMPILED_OPS)} is installed (vLLM without its compiled ops)"
    for name in (ops, FLASH_ATTN_MODULE):
        try:
            importlib.import_module(name)
        except Exception as exc:  # ImportError, OSError: whatever keeps it from loading
            text = " ".join(f"{type(exc).__name__}: {exc}".split())
            return f"{name} does not load: {text}"
    return None


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that does not import
        return False


@dataclass(frozen=True)
class Row:
    """One request row of a paged call: ``query_len`` tokens ending at ``seq_len``."""

    request: int
    seq_len: int
    query_len: int

    @property
    def kv_start(self) -> int:
        return self.seq_len - self.query_len


@dataclass
class PagedMetadata:
    """What the portable driver's context carries as ``native_metadata``.

    Field names follow vLLM's ``FlashAttentionMetadata``, so a backend reads
    the same names under either driver.
    """

    query_start_loc: Any  # int32 [R + 1]
    seq_lens: Any  # int32 [R]
    block_table: Any  # int32 [R, max blocks]; unused entries hold the null block 0
    slot_mapping: Any  # int64 [T]
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int
    block_size: int
    causal: bool = False


@dataclass
class PagedLayer:
    """The layer a portable context names: geometry, name and the allocated view."""

    layer_name: str
    kv_cache: Any
    num_heads: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    softmax_scale: float
    impl: Any = None


@dataclass
class Allocation:
    """A cache allocated for one layout: views per layer, block ids per request."""

    layout: str
    views: dict[str, Any]
    block_ids: list[list[int]]
    num_blocks: int
    notes: list[str] = field(default_factory=list)


def _spec(case: Case) -> Any:
    return compat.attention_spec(case)


def control_plane_config(layout: str, need: bool, case: Case, device: str,
                         layer_specs: dict[str, Any]) -> tuple[Any, Any]:
    """Size the cache with vllm-omni's control plane, the layout pinned by the user.

    Returns ``(the control plane's vllm_config, rank 0's KVCacheConfig)``.
    """
    vllm_config = compat.production_vllm_config(device)
    vllm_config.cache_config.kv_cache_layout = layout
    memory = default_memory(case)
    rank_configs, _ = kv_planner.build_native_kv_cache_configs(
        vllm_config, [dict(layer_specs)], [memory], indexes_kv_by_block_stride=need)
    stamped = getattr(rank_configs[0], "kv_cache_layout", None)
    if stamped != layout:
        raise HarnessError(f"KV-L7 set-up: the control plane stamped {stamped!r} on the worker "
                           f"config for a user-pinned {layout} (KV-A1/KV-L8 cover this)")
    return vllm_config, rank_configs[0]


class PortableDriver:
    """Production allocation and context; the harness writes K/V through the views."""

    name = "portable"

    def __init__(self, cls: Any, case: Case, device: str, num_heads: int) -> None:
        self.cls = cls
        self.case = case
        self.device = device
        self.num_heads = num_heads
        self.layer_names = compat.layer_names(case)
        self.alloc: Allocation | None = None
        self.impl: Any = None

    def allocate(self, layout: str, need: bool, block_ids: list[list[int]] | None,
                 choose: Any) -> Allocation:
        case = self.case
        specs = {name: _spec(case) for name in self.layer_names}
        _, rank_config = control_plane_config(layout, need, case, self.device, specs)
        worker = compat.production_vllm_config(self.device)
        compat.adopt_layout(worker, rank_config)
        views = kv_allocation.init_kv_cache(worker, rank_config, self.device)
        missing = [n for n in self.layer_names if n not in views]
        if missing:
            raise HarnessError(f"KV-L7 set-up: init_kv_cache returned no view for {missing}")
        num_blocks = int(rank_config.num_blocks)
        ids = block_ids if block_ids is not None else choose(num_blocks)
        self.alloc = Allocation(layout, {n: views[n] for n in self.layer_names}, ids, num_blocks)
        self.impl = make_impl(self.cls, case, self.num_heads)
        return self.alloc

    def write(self, keys: dict[str, list[Any]], values: dict[str, list[Any]]) -> None:
        """Write every request's K/V through the allocated views at its block ids."""
        import torch

        assert self.alloc is not None
        bs, d = self.case.block_size, self.case.head_size
        gen = torch.Generator().manual_seed(7)
        for name, view in self.alloc.views.items():
            # Whatever a misread lands on must differ from the K/V it should have read.
            view.copy_(torch.randn(view.shape, generator=gen).to(view.dtype))
            for request, (k, v) in enumerate(zip(keys[name], values[name], strict=True)):
                blocks, offsets = _slots(self.alloc.block_ids[request], k.shape[0], bs)
                blocks, offsets = blocks.to(view.device), offsets.to(view.device)
                view[blocks, :, offsets, :d] = k.to(view.device, view.dtype)
                view[blocks, :, offsets, d:] = v.to(view.device, view.dtype)
                back_k = view[blocks, :, offsets, :d].cpu()
                if not torch.equal(back_k, k.to(view.dtype).cpu()):
                    raise HarnessError("KV-L7 set-up: K written through the production view "
                                       f"does not read back (layer {name}, request {request})")

    def forward(self, layer: str, rows: list[Row], query: Any, key: Any, value: Any) -> Any:
        import torch

        assert self.alloc is not None
        case, dev = self.case, self.device
        bs = case.block_size
        view = self.alloc.views[layer]
        width = max(len(ids) for ids in self.alloc.block_ids)
        table = torch.zeros((len(rows), width), dtype=torch.int32)
        slots, starts = [], [0]
        for i, row in enumerate(rows):
            ids = self.alloc.block_ids[row.request]
            table[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
            blocks, offsets = _slots(ids, row.seq_len, bs)
            slots.append((blocks * bs + offsets)[row.kv_start:])
            starts.append(starts[-1] + row.query_len)
        metadata = PagedMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([r.seq_len for r in rows], dtype=torch.int32, device=dev),
            block_table=table.to(dev), slot_mapping=torch.cat(slots).to(dev),
            max_query_len=max(r.query_len for r in rows),
            max_seq_len=max(r.seq_len for r in rows), num_actual_tokens=starts[-1],
            block_size=bs)
        paged_layer = PagedLayer(layer, view, self.num_heads, case.num_kv_heads, case.head_size,
                                 case.head_size, case.head_size ** -0.5)
        with _harness("building vllm-omni's paged context"):
            context = compat.paged_attention_context(
                layer=paged_layer, query=query.to(dev), key_write=key.to(dev),
                value_write=value.to(dev), slot_mapping=metadata.slot_mapping,
                native_metadata=metadata, query_token_shape=(int(query.shape[0]),))
        return self.impl.forward_paged(context)


def _slots(block_ids: list[int], n_tokens: int, block_size: int) -> tuple[Any, Any]:
    """(physical block, offset in block) of each of the first ``n_tokens`` positions."""
    import torch

    pos = torch.arange(n_tokens)
    table = torch.tensor(block_ids, dtype=torch.long)
    return table[pos // block_size], pos % block_size


def make_impl(cls: Any, case: Case, num_heads: int) -> Any:
    """The backend's attention impl, built the way vllm-omni's Attention layer builds it."""
    impl_cls = cls.get_impl_cls()
    return impl_cls(num_heads=num_heads, head_size=case.head_size,
                    softmax_scale=case.head_size ** -0.5, causal=False,
                    num_kv_heads=case.num_kv_heads)


class NativeDriver:
    """vllm-omni's worker paged path: runner backend, BlockTables, adapter, native writer."""

    name = "native"

    def __init__(self, cls: Any, case: Case, device: str, num_heads: int,
                 backend_name: str, backend_path: str) -> None:
        self.cls = cls
        self.case = case
        self.device = device
        self.num_heads = num_heads
        self.backend_name = backend_name
        self.backend_path = backend_path
        self.layer_names = compat.layer_names(case)
        self.alloc: Allocation | None = None
        self.runner: Any = None
        self.impl: Any = None
        self._written: set[str] = set()

    def allocate(self, layout: str, need: bool, block_ids: list[list[int]] | None,
                 choose: Any) -> Allocation:
        import torch
        from vllm_omni.diffusion.diffusion_kv.metadata import (
            DiffusionKVMetadata,
            DiffusionKVSequenceMetadata,
        )
        from vllm_omni.diffusion.diffusion_kv.model_runner_backend import (
            DiffusionKVModelRunnerBackend,
        )
        from vllm_omni.diffusion.vllm_config import create_diffusion_vllm_config

        case = self.case
        torch_device = torch.device(self.device)
        with compat.backend_selected(self.backend_name, self.backend_path) as selected:
            od_config = compat.production_od_config(attention_backend=selected)
        worker = create_diffusion_vllm_config(torch.device(torch_device.type), od_config)
        # The adapter requires Q/K/V in the model's activation dtype.
        worker.model_config.dtype = compat.torch_dtype(case.dtype)
        layer = _LayerGeometry(self.cls, self.num_heads, case.head_size ** -0.5)
        spec = _non_causal(_spec(case))
        runner = DiffusionKVModelRunnerBackend(vllm_config=worker, od_config=od_config,
                                               device=torch_device)
        specs = runner.register_kv_cache_layers({n: (layer, spec) for n in self.layer_names})
        control, rank_config = control_plane_config(layout, need, case, self.device, specs)
        worker.model_config.max_model_len = control.model_config.max_model_len
        runner.initialize_kv_cache(rank_config)
        views = runner.kv_caches_by_layer
        num_blocks = int(rank_config.num_blocks)
        ids = block_ids if block_ids is not None else choose(num_blocks)
        for request, blocks in enumerate(ids):
            seq_len = len(blocks) * case.block_size
            runner.install_diffusion_kv_metadata(DiffusionKVMetadata(
                request_id=f"kvl7-{request}", allocation_generation=1,
                sequences=(DiffusionKVSequenceMetadata(
                    sequence_id=0, prefix_len=0, target_len=seq_len, seq_len=seq_len,
                    block_ids=(list(blocks),)),)))
        self.runner = runner
        self.alloc = Allocation(layout, {n: views[n] for n in self.layer_names}, ids, num_blocks)
        self.impl = make_impl(self.cls, case, self.num_heads)
        return self.alloc

    def write(self, keys: dict[str, list[Any]], values: dict[str, list[Any]]) -> None:
        """Fill the cache with noise; the backend's native writer puts K/V in at forward."""
        import torch

        assert self.alloc is not None
        gen = torch.Generator().manual_seed(7)
        for view in self.alloc.views.values():
            view.copy_(torch.randn(view.shape, generator=gen).to(view.dtype))

    def forward(self, layer: str, rows: list[Row], query: Any, key: Any, value: Any) -> Any:
        from vllm_omni.diffusion.diffusion_kv.paged_attention_adapter import (
            DiffusionPagedAttentionRow,
        )

        adapter = self.runner.get_paged_attention_adapter()
        paged_rows = [DiffusionPagedAttentionRow(
            request_id=f"kvl7-{r.request}", query_len=r.query_len, seq_len=r.seq_len,
            kv_start_pos=r.kv_start, sequence_id=0) for r in rows]
        with _harness("vllm-omni's adapter preparing the batch"):
            batch = adapter.prepare_batch(paged_rows)
        with adapter.activate(batch):
            with _harness("vllm-omni's adapter preparing the layer context"):
                context = adapter.prepare_layer_context(
                    layer, query.to(self.device), key.to(self.device), value.to(self.device))
            return self.impl.forward_paged(context)


class _LayerGeometry:
    """What ``register_kv_cache_layers`` reads of vllm-omni's Attention layer."""

    skip_sequence_parallel = False

    def __init__(self, attn_backend: Any, num_heads: int, softmax_scale: float) -> None:
        self.attn_backend = attn_backend
        self.num_heads = num_heads
        self.softmax_scale = softmax_scale


def _non_causal(spec: Any) -> Any:
    """Diffusion attention is bidirectional: the spec says so, as the Attention layer's does."""
    import dataclasses

    if "non_causal" in {f.name for f in dataclasses.fields(spec)}:
        return dataclasses.replace(spec, non_causal=True)
    return spec


@contextlib.contextmanager
def _harness(what: str) -> Iterator[None]:
    """Production set-up around the backend's call: its failure is the harness's."""
    try:
        yield
    except HarnessError:
        raise
    except Exception as exc:
        raise HarnessError(f"KV-L7 set-up: {what} failed: {exc!r}") from exc

