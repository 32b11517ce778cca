"""What the harness observes inside production's diffusion worker, and nothing more.

vllm-omni lets a deployment add methods to its diffusion worker with
``od_config.worker_extension_cls`` (mixed into the worker class by
``WorkerWrapperBase``, reached through the executor's ``collective_rpc``).  KV-A
uses that route to look at what production's worker did: which layout its config
adopted, which allocation each registered layer's cache views, and to write and
read bytes through those views.  The worker's own behaviour is never replaced.

:class:`Observation` holds the methods; they need only ``self.rank``,
``self.vllm_config`` and ``self.model_runner``, which production's
``DiffusionWorker`` has (and so does the engine's stand-in for it on a host where
that worker cannot be imported, ``engine.RankHost``).  :data:`EXTENSION` is the
class production's worker is extended with: the observation plus vllm-omni's
``CustomPipelineWorkerExtension`` (the custom-pipeline route the KV-A pipeline is
loaded through).  Importing this module imports neither torch nor vLLM.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Iterable, Sequence
from typing import Any

EXTENSION = "pytest_kvconform.adapters.worker_extension.KvConformWorkerExtension"
# ``NAME=module.Class``: a backend that is no registry member, selected in production's
# worker processes under registry member NAME (as a backend repository's plugin would).
OVERRIDE_ENV = "KVCONFORM_BACKEND_OVERRIDE"


def process_identity() -> dict[str, Any]:
    """Who this process is, as seen from inside it: the proof of a process boundary."""
    return {"pid": os.getpid(), "ppid": os.getppid(),
            "parent_pid": getattr(multiprocessing.parent_process(), "pid", None),
            "has_parent_process": multiprocessing.parent_process() is not None,
            "start_method": multiprocessing.get_start_method(allow_none=True),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


def page_pattern(layer: int, block: int, rank: int, shape: Sequence[int]) -> Any:
    """uint8 bytes for one (layer, block) page, shaped ``[H, N, C bytes]``.

    Never zero (so a missing write shows), different per page, rank and cell
    position (so a swapped page, rank or axis shows).
    """
    import numpy as np

    h, n, c = np.indices(tuple(shape), dtype=np.int64)
    tag = layer * 1_000_003 + block * 7_919 + rank * 104_729
    return ((tag + h * 131 + n * 37 + c * 7) % 255 + 1).astype(np.uint8)


def target_page(raw: Any, page: Any) -> Any:
    """Where one page's pattern is written: the page production bound (a seeded fault,
    ``wrong_offset``, moves it; ``faults/worker_faults.py``)."""
    return page


def config_summary(config: Any) -> dict[str, Any]:
    """The fields of a ``KVCacheConfig`` that adoption depends on, as plain values."""
    tensors = [
        {"size": t.size, "layers": list(getattr(t, "layers", []) or []),
         "layer_stride": getattr(t, "layer_stride", None),
         "block_stride": getattr(t, "block_stride", None), "offset": getattr(t, "offset", None)}
        for t in config.kv_cache_tensors
    ]
    groups = [{"layer_names": list(g.layer_names), "spec": repr(g.kv_cache_spec)}
              for g in config.kv_cache_groups]
    return {"num_blocks": config.num_blocks,
            "kv_cache_layout": getattr(config, "kv_cache_layout", None),
            "kv_cache_tensors": tensors, "kv_cache_groups": groups}


def _path(cls: Any) -> str | None:
    return None if cls is None else f"{cls.__module__}.{cls.__qualname__}"


class Observation:
    """Read-only views of the worker's paged KV state, and writes through its views."""

    rank: int
    vllm_config: Any
    model_runner: Any

    def _kv_backend(self) -> Any:
        return self.model_runner.diffusion_kv_backend

    def _caches(self) -> dict[str, Any]:
        return dict(self._kv_backend().kv_caches_by_layer)

    def _layer_order(self) -> list[str]:
        config = self._kv_backend().kv_cache_config
        return [name for t in config.kv_cache_tensors for name in t.layers]

    def kvconform_layer_backends(self) -> dict[str, str | None]:
        """The class each paged attention layer of the loaded pipeline selected."""
        from vllm_omni.diffusion.attention.layer import Attention

        pipeline = getattr(self.model_runner, "pipeline", None)
        return {} if pipeline is None else {
            m.prefix: _path(m.attn_backend) for m in pipeline.modules()
            if isinstance(m, Attention) and getattr(m, "paged_kv_cache_role", None)}

    def kvconform_report(self) -> dict[str, Any]:
        """What this rank holds after ``set_kv_cache_configs``, as plain values."""
        backend = self._kv_backend()
        config = backend.kv_cache_config
        layers = self.kvconform_layer_backends()
        report: dict[str, Any] = {
            **process_identity(), "rank": self.rank,
            # Where production's ranks met (its config's, set in the process by init_device).
            "master_port": getattr(getattr(self, "od_config", None), "master_port", None),
            "received": None if config is None else config_summary(config),
            "layout_after": self.vllm_config.cache_config.kv_cache_layout,
            "layer_backends": layers, "views": {}, "storage_nbytes": None,
            "num_storages": None,
            # The class each layer's paged path runs (what the runner asserts layouts with).
            "native_backends": {name: _path(getattr(adapter, "attn_backend", None))
                                for name, adapter in
                                getattr(backend, "_kv_cache_layer_adapters", {}).items()}}
        storages = set()
        for name, view in self._caches().items():
            if view is None:
                continue
            storage = view.untyped_storage()
            storages.add(storage.data_ptr())
            report["views"][name] = {
                "device": str(view.device), "shape": list(view.shape),
                "dtype": str(view.dtype), "byte_offset": view.data_ptr() - storage.data_ptr()}
            report["storage_nbytes"] = storage.nbytes()
        report["num_storages"] = len(storages) if report["views"] else None
        return report

    def kvconform_layout(self) -> str | None:
        """The layout this worker's own config is pinned to right now (None: unpinned)."""
        return self.vllm_config.cache_config.kv_cache_layout

    def kvconform_prepin(self, layout: str) -> None:
        """KV-A4's control: this worker's own config is pinned to ``layout`` beforehand."""
        self.vllm_config.cache_config.kv_cache_layout = layout

    def _raw(self) -> Any:
        import torch

        views = [v for v in self._caches().values() if v is not None]
        if not views:
            raise RuntimeError("no KV cache is allocated on this rank")
        storage = views[0].untyped_storage()
        raw = torch.empty(0, dtype=torch.uint8, device=storage.device)
        return raw.set_(storage, 0, (storage.nbytes(),), (1,))

    def kvconform_write_pattern(self, pages: Iterable[tuple[int, int]]) -> None:
        """Zero the allocation, then write :func:`page_pattern` at each (layer, block) page
        through the view production bound to that layer."""
        import torch

        raw = self._raw()
        raw.zero_()
        caches, order = self._caches(), self._layer_order()
        for layer, block in pages:
            page = target_page(raw, caches[order[layer]][block].view(torch.uint8))
            pattern = page_pattern(layer, block, self.rank, tuple(page.shape))
            page.copy_(torch.from_numpy(pattern).to(page.device))
        if raw.device.type == "cuda":
            torch.cuda.synchronize(raw.device)

    def kvconform_read_back(self, regions: Iterable[tuple[int, int]]) -> list[bytes]:
        """Bytes of the backing allocation at each (start, nbytes) region."""
        raw = self._raw()
        return [raw[start:start + n].cpu().numpy().tobytes() for start, n in regions]


_SEEDED = contextlib.ExitStack()


def apply_override() -> None:
    """Select a non-registry backend under a registry name in this process (from the env)."""
    value = os.environ.get(OVERRIDE_ENV)
    if not value:
        return
    name, _, path = value.partition("=")
    from vllm_omni.diffusion.attention.backends.registry import (
        DiffusionAttentionBackendEnum,
        register_diffusion_backend,
    )

    register_diffusion_backend(DiffusionAttentionBackendEnum[name], path)


def __getattr__(name: str) -> Any:
    """``KvConformWorkerExtension``, built when production's worker resolves it."""
    if name == "KvConformWorkerExtension":
        from vllm_omni.diffusion.worker.diffusion_worker import CustomPipelineWorkerExtension

        from pytest_kvconform.adapters import fault_hook, worker_seams

        apply_override()
        # A seeded regression, and the harness's seams, reach the worker processes
        # production spawns this way (a forked one has them already).
        _SEEDED.enter_context(fault_hook.inherited())
        _SEEDED.enter_context(worker_seams.seams())
        cls = type("KvConformWorkerExtension", (Observation, CustomPipelineWorkerExtension),
                   {"__module__": __name__,
                    "__doc__": "Production's custom-pipeline extension plus the harness's "
                               "observation."})
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
