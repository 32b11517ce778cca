"""KV-V4: the resolved layout crosses a process boundary to production's worker, which
allocates the backend's (customised) KV cache at the oracle's addresses.

The engine core's side runs here, in production's order: the executor's
``get_supported_kv_cache_layouts`` RPC, ``resolve_kv_cache_layout`` over what the worker
reported, the executor's ``set_kv_cache_layout`` RPC (each serialised as vLLM's multiproc
executor does, with vLLM's ``MessageQueue``), and production's planner on the customised
spec, whose config carries no layout name (so the RPC is the only way the layout reaches the
worker).  The worker's side is a pooled worker process (the KV-A pool: forked from the fork
server, never from this process, so it shares no state with the engine side): production's
``WorkerWrapperBase`` around ``WorkerBase`` on its own fresh, unpinned config, with a model
whose attention layers use the backend, receives the frames through
``WorkerProc._execute_worker_rpc``; then a callable RPC runs
``vllm.v1.worker.utils.allocate_kv_cache`` at the layout the worker resolved.  What the
worker reports and what the engine resolves must be the oracle's (``vllm_oracle``); every
layer view's byte address must equal the oracle's.  The model runner's
``initialize_kv_cache`` does not run (no model on this host); the result's ``via`` says so.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import numpy as np

from pytest_kvconform.adapters import kv_planner, vllm_layout
from pytest_kvconform.checks import vllm_spec
from pytest_kvconform.checks.common import (
    Where,
    note_via,
    production_with_class,
)
from pytest_kvconform.checks.errors import HarnessError, SkipKind
from pytest_kvconform.checks.vllm_resolution import declaring_class, read_declaration
from pytest_kvconform.contract import oracle, vllm_oracle
from pytest_kvconform.contract.records import BackendUnderTest
from pytest_kvconform.workers.devices import Unplaceable
from pytest_kvconform.workers.protocol import WorkerCommandError

CLAUSE = "KV-V4"
VIA = ("engine side: vllm.v1.executor.abstract.Executor.get_supported_kv_cache_layouts, "
       "vllm.v1.attention.backends.utils.resolve_kv_cache_layout, Executor.set_kv_cache_layout"
       " (frames from vLLM's MessageQueue) -> pooled worker process: vllm.v1.executor."
       "multiproc_executor.WorkerProc._execute_worker_rpc -> WorkerWrapperBase -> WorkerBase."
       "get_supported_kv_cache_layouts (the model's layers, get_current_attn_backends) and "
       ".set_kv_cache_layout; then vllm.v1.worker.utils.allocate_kv_cache there at the "
       "worker's resolved layout (no model runner: no model on this host)")


def check_kv_v4(backend: BackendUnderTest, worker: Any, *,
                control: str | None = None) -> None:
    """The engine core resolves from what the worker reports, the worker adopts it over the
    RPC and allocates at the oracle's bytes.

    ``worker``: one pooled worker (``kv_workers.for_world_size(1)``: a list of one handle, or
    why there is none).  ``control``: a ``module:NAME`` regression applied in the worker
    process (a negative control, or a seeded fault, as KV-A's controls are)."""
    where = Where(CLAUSE, backend=backend.name)
    cls = declaring_class(CLAUSE, backend)
    if isinstance(worker, Unplaceable):
        raise where.skip(worker.reason, SkipKind.HARDWARE)
    if len(worker) != 1:
        raise ValueError(f"{len(worker)} workers for one rank")
    declared = read_declaration(CLAUSE, backend.name, cls)
    reported = vllm_oracle.worker_layouts([declared])
    expected = vllm_oracle.resolve([reported.value] if isinstance(reported.value, tuple)
                                   else [])
    if not isinstance(reported.value, tuple) or not isinstance(expected.value, str):
        raise where.fail(f"the backend's declaration {declared} resolves to no layout: "
                         f"{expected} (see KV-V3)")
    layout = expected.value
    where = where.at(layout=layout)
    spec = _customised(backend, cls)
    geom = oracle.Geometry(num_layers=vllm_spec.NUM_LAYERS, num_blocks=vllm_spec.NUM_PAGES,
                           num_heads=spec.num_heads, block_size=spec.block_size,
                           content_bytes=spec.state_content_size_bytes,
                           page_size_padded=spec.page_size_padded)
    config = where.call("get_kv_cache_configs", _planned, layout, spec, geom)
    path = f"{cls.__module__}:{cls.__qualname__}"
    run = _Run(where, worker[0], path, control, prepin=None)
    with run:
        ranks = run.step("the executor's get_supported_kv_cache_layouts RPC",
                         vllm_layout.executor_supported, run.wire)
        if [tuple(r) for r in ranks] != [reported.value]:
            raise where.fail("production's worker (another process) reported other layouts "
                             "for a model served with the backend than its declaration gives",
                             expected=[list(reported.value)], actual=ranks)
        resolved = run.step("the engine core's resolve_kv_cache_layout",
                            vllm_layout.engine_resolve, ranks, spec)
        if resolved != layout:
            raise where.fail("the engine core resolved another layout from what the worker "
                             "reported (see KV-V3)", expected=layout, actual=resolved)
        run.step(f"the executor's set_kv_cache_layout({layout}) RPC",
                 vllm_layout.executor_set_layout, run.wire, layout)
        result = run.step("allocate_kv_cache after the RPC", run.wire.collective_rpc,
                          vllm_layout.allocated_views, args=(config, vllm_spec.layer_names()))
    note_via(VIA if run.wire.how == "vllm MessageQueue.enqueue" else
             f"{VIA}; frames: {run.wire.how}")
    if result[0]["adopted"] != layout:
        raise where.fail("production's worker adopted another layout than the engine "
                         "core sent", expected=layout, actual=result[0]["adopted"])
    _compare(where, layout, geom, result[0]["views"])


class _Run:
    """One worker process for the check: started with the backend's model, each step a
    production call whose worker-side failure fails the clause naming the step; the worker
    is released afterwards."""

    def __init__(self, where: Where, handle: Any, backend: str, control: str | None,
                 prepin: str | None) -> None:
        self.where, self.handle = where, handle
        self.start = {"control": control, "prepin": prepin, "backend": backend,
                      "layers": vllm_spec.layer_names()}
        self.wire = vllm_layout.WireExecutor(
            lambda frames: handle.request("vllm_rpc", frames=frames))

    def __enter__(self) -> _Run:
        self.step("starting production's vLLM worker", self.handle.request,
                  "vllm_worker_start", **self.start)
        return self

    def step(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except WorkerCommandError as exc:
            remote = exc.remote or {}
            found = (f"{remote.get('type')}: {remote.get('message')}" if remote.get("type")
                     else str(exc).splitlines()[0])
            raise self.where.fail(f"production's worker (another process) raised during "
                                  f"{what}: {found}", actual=found) from exc
        except HarnessError as exc:
            raise self.where.harness(exc, what) from exc
        except Exception as exc:  # production's engine side, here
            raise self.where.fail(f"{what} raised {type(exc).__name__}: {exc}") from exc

    def __exit__(self, *exc: object) -> None:
        try:
            if self.handle.defers_release:
                self.handle.release_later()
            else:
                self.handle.release()
        except HarnessError:
            pass  # a dead worker holds nothing; the check's own outcome stands


def check_kv_v4_disagreement(backend: BackendUnderTest, worker: Any, *,
                             control: str | None = None) -> None:
    """Negative control (its own result): a worker already pinned to another layout refuses
    the engine core's with a ValueError naming both (``control``: as for
    :func:`check_kv_v4`)."""
    where = Where(CLAUSE, backend=backend.name)
    cls = declaring_class(CLAUSE, backend)
    if isinstance(worker, Unplaceable):
        raise where.skip(worker.reason, SkipKind.HARDWARE)
    declared = read_declaration(CLAUSE, backend.name, cls)
    ranks = vllm_oracle.worker_layouts([declared])
    expected = vllm_oracle.resolve([ranks.value] if isinstance(ranks.value, tuple) else [])
    if not isinstance(expected.value, str):
        raise where.fail(f"the backend's declaration {declared} resolves to no layout: "
                         f"{expected} (see KV-V3)")
    layout = expected.value
    other = next(n for n in oracle.PHYSICAL_LAYOUTS if n != layout)
    where = where.at(layout=layout)
    frames, _how = where.call("Executor.set_kv_cache_layout", vllm_layout.executor_frames,
                              layout)
    handle = worker[0]
    try:
        handle.request("vllm_worker_start", control=control, prepin=other)
        handle.request("vllm_rpc", frames=frames)
    except WorkerCommandError as exc:
        remote = exc.remote or {}
        message = str(remote.get("message") or exc)
        if remote.get("type", "ValueError") == "ValueError" and other in message and \
                layout in message:
            note_via(VIA)
            return
        raise where.fail(f"a worker pinned to {other} refused set_kv_cache_layout({layout}) "
                         "without a ValueError naming both", expected="ValueError naming "
                         f"{other} and {layout}", actual=f"{remote.get('type')}: {message}"
                         ) from exc
    except HarnessError as exc:
        raise where.harness(exc, f"set_kv_cache_layout({layout}) to a worker pinned to "
                            f"{other}") from exc
    finally:
        try:
            if handle.defers_release:
                handle.release_later()
            else:
                handle.release()
        except HarnessError:
            pass
    raise where.fail(f"a worker already pinned to {other} accepted set_kv_cache_layout"
                     f"({layout}) silently", expected=f"ValueError naming {other} and {layout}",
                     actual="accepted")


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



