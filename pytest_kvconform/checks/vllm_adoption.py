"""KV-V4: the resolved layout crosses a process boundary to production's worker, which
allocates the backend's (customised) KV cache at the oracle's addresses.

The engine core's side runs here: the layout the oracle resolves for the backend alone
(KV-V3 checks production agrees), production's ``Executor.set_kv_cache_layout`` serialising
its RPC with the executor's own broadcast queue, and production's planner on the customised
spec.  The worker's side runs in a process of its own (forked for the check, as every call
that touches a backend's class is: ``workers/isolated.py``): production's ``WorkerBase``
starts unpinned, receives the frames and runs the RPC as ``WorkerProc`` does, then
``vllm.v1.worker.utils.allocate_kv_cache`` allocates at the layout the worker resolved.
Every layer view's byte address must equal the oracle's.  What ran is the result's ``via``.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import numpy as np

from pytest_kvconform.adapters import kv_allocation, kv_planner, vllm_layout
from pytest_kvconform.checks import vllm_spec
from pytest_kvconform.checks.common import (
    Where,
    backend_class,
    call_declaration,
    note_via,
    production_with_class,
    unsupported_as_skip,
)
from pytest_kvconform.checks.errors import SkipKind
from pytest_kvconform.contract import oracle, vllm_oracle
from pytest_kvconform.contract.records import BackendUnderTest
from pytest_kvconform.workers import isolated

CLAUSE = "KV-V4"
VIA = ("vllm.v1.executor.abstract.Executor.set_kv_cache_layout (frames from vLLM's "
       "MessageQueue) -> worker process: vllm.v1.worker.worker_base.WorkerBase."
       "set_kv_cache_layout via run_method, then vllm.v1.worker.utils.allocate_kv_cache "
       "at the worker's resolved layout (no model runner: no model on this host)")


def check_kv_v4(backend: BackendUnderTest) -> None:
    """The worker adopts the engine core's layout and allocates at the oracle's bytes."""
    where = Where(CLAUSE, backend=backend.name)
    cls = backend_class(CLAUSE, backend)
    with unsupported_as_skip(CLAUSE):
        vllm_layout.production()
    if not vllm_layout.declares_layouts(cls):
        raise where.skip(f"{backend.name} has no supported_kv_cache_layouts (not a vLLM "
                         "attention backend); see KV-V2", SkipKind.NOT_APPLICABLE)
    declared = call_declaration(CLAUSE, backend.name, partial(vllm_layout.declaration, cls))
    ranks = vllm_oracle.worker_layouts([declared])
    expected = vllm_oracle.resolve([ranks.value] if isinstance(ranks.value, tuple) else [])
    if expected.refused is not None or not isinstance(expected.value, str):
        raise where.fail(f"the backend's declaration {declared} resolves to no layout: "
                         f"{expected} (see KV-V3)")
    layout = expected.value
    spec = _customised(backend, cls)
    geom = oracle.Geometry(num_layers=vllm_spec.NUM_LAYERS, num_blocks=vllm_spec.NUM_PAGES,
                           num_heads=spec.num_heads, block_size=spec.block_size,
                           content_bytes=spec.state_content_size_bytes,
                           page_size_padded=spec.page_size_padded)
    config = where.call("get_kv_cache_configs", _planned, layout, spec, geom)
    frames, how = where.call("Executor.set_kv_cache_layout", vllm_layout.executor_frames,
                             layout)
    note_via(VIA if how == "vllm MessageQueue.enqueue" else f"{VIA}; frames: {how}")
    result = isolated.call(partial(_worker_side, frames, config),
                           f"production's worker receiving set_kv_cache_layout({layout})",
                           where=f"{CLAUSE} [backend={backend.name}]", backend_code=False)
    if result["error"] is not None:
        raise where.fail(f"production's worker (another process) got set_kv_cache_layout"
                         f"({layout}) from the executor, then {result['error']}",
                         layout=layout, expected=layout, actual=result["adopted"])
    if result["adopted"] != layout:
        raise where.fail("production's worker adopted another layout than the engine "
                         "core sent", layout=layout, expected=layout, actual=result["adopted"])
    _compare(where.at(layout=layout), layout, geom, result["views"])


def _customised(backend: BackendUnderTest, cls: Any) -> Any:
    """The spec the backend's layers ask for: a plain one, through its customize_spec."""
    base = vllm_spec.base_spec()
    if not callable(getattr(cls, "customize_spec", None)):
        return base
    fields = production_with_class(CLAUSE, backend.name, "customize_spec",
                                   partial(vllm_spec._customised_fields, cls))
    changed = {f: fields[f] for f in vllm_spec.PAGE_FIELDS
               if fields[f] != getattr(base, f, None)}
    return dataclasses.replace(base, **changed)


def _planned(layout: str, spec: Any, geom: oracle.Geometry) -> Any:
    """The engine core's ``KVCacheConfig`` (its planner, the layout resolved), carrying no
    layout name of its own: the RPC is the only way the layout reaches the worker here."""
    vllm_config = kv_planner.control_plane_config()
    vllm_config.cache_config.kv_cache_layout = layout
    memory = geom.page_stride_bytes * vllm_spec.NUM_LAYERS * vllm_spec.NUM_PAGES
    specs = [{name: spec for name in vllm_spec.layer_names()}]
    config = kv_planner.get_kv_cache_configs(vllm_config, specs, [memory])[0]
    if hasattr(config, "kv_cache_layout"):
        config.kv_cache_layout = None
    return config


def _worker_side(frames: list[bytes], config: Any) -> dict[str, Any]:
    """In the worker process: receive the RPC, allocate; plain data back (views' bytes)."""
    worker = vllm_layout.production_worker()
    try:
        vllm_layout.worker_receives(worker, frames)
        member = worker.vllm_config.cache_config.get_resolved_kv_cache_layout()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "adopted":
                worker.vllm_config.cache_config.kv_cache_layout, "views": None}
    views = kv_allocation.allocate_kv_cache(config, "cpu", member, None)
    out = []
    for name in vllm_spec.layer_names():
        view = views[name]
        size = view.element_size()
        base = view.untyped_storage().data_ptr()
        out.append({"shape": list(view.shape), "stride": [s * size for s in view.stride()],
                    "offset": view.data_ptr() - base, "itemsize": size})
    return {"error": None, "adopted": member.name, "views": out}


def _compare(where: Where, layout: str, geom: oracle.Geometry, views: list[dict[str, Any]]
             ) -> None:
    table = oracle.address_table(layout, geom)
    for layer, view in enumerate(views):
        b, h, n, c = view["shape"]
        size = view["itemsize"]
        if (b, h, n, c * size) != table.shape[1:]:
            raise where.fail_at("allocate_kv_cache", f"layer {layer}'s view has another "
                                "[B, H, N, C(bytes)] shape than the customised page",
                                expected=table.shape[1:], actual=(b, h, n, c * size))
        sb, sh, sn, sc = view["stride"]
        grid = np.ix_(np.arange(b), np.arange(h), np.arange(n), np.arange(c * size))
        found = (view["offset"] + grid[0] * sb + grid[1] * sh + grid[2] * sn
                 + (grid[3] // size) * sc + grid[3] % size)
        wrong = found != table[layer]
        if wrong.any():
            cell = tuple(int(i) for i in np.unravel_index(int(np.argmax(wrong)), wrong.shape))
            raise where.fail_at("allocate_kv_cache", f"layer {layer}, cell (block, head, "
                                f"token, byte) {cell} is not at the oracle's byte",
                                expected=int(table[layer][cell]), actual=int(found[cell]))



