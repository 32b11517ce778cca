"""KV-A clauses: the control plane's layout reaches real worker processes intact.

Each check runs the production control plane (``control_plane.py``) for a
backend's declared need, or for an explicit need through the seam, sends the
rank-local configs to spawned workers (``workers.py``) serialised the way the
executor sends them, and compares what the workers did with the oracle.

A worker that dies, times out or runs out of memory is the harness's fault, not
the backend's: it stays a :class:`HarnessError` (with the clause, backend and case
added to its message), never a ClauseFailure.  Only a command that raised inside
the worker (the code under test refused) fails the clause.
"""

from __future__ import annotations

import os
import random
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pytest_kvconform import compat, executor_wire, forkserver, oracle
from pytest_kvconform.checks.common import Where, declared_need, unsupported_as_skip
from pytest_kvconform.checks.errors import (
    ClauseFailure,
    ClauseSkip,
    HarnessError,
    SkipKind,
    Unsupported,
)
from pytest_kvconform.checks.geometry import geometry_for
from pytest_kvconform.control_plane import ControlPlane, build_control_plane
from pytest_kvconform.devices import Unplaceable
from pytest_kvconform.model import BackendUnderTest, Case
from pytest_kvconform.workers import (
    AdoptReport,
    WorkerError,
    WorkerHandle,
    broadcast_adopt,
    config_summary,
    page_pattern,
)

Source = BackendUnderTest | bool  # a backend (its declared need) or an explicit need
Workers = Sequence[WorkerHandle] | Unplaceable  # one worker per rank, or why there are none
SAMPLED_PAGES = 4
_FULL_READ_LIMIT = 1 << 26  # read the whole allocation back below this many bytes
_GUARD_BYTES = 256  # bytes checked (must stay zero) on either side of a probed page
_TABLE_CELLS = 1 << 22


@dataclass(frozen=True)
class _Run(Where):
    """A KV-A check's failure context plus the need it runs the control plane for."""

    need: bool = False


def _run(clause: str, source: Source, case: Case) -> _Run:
    compat.require_omni(clause)
    if isinstance(source, bool):
        return _Run(clause, f"need={source}", case, need=source)
    return _Run(clause, source.name, case, need=declared_need(clause, source))


# The public ``kv_control_plane`` fixture reads a backend's need as KV-A1 does.
FIXTURE_CLAUSE = "KV-A1"


def fixture_control_plane(source: Source, case: Case, *, world_size: int | None = None,
                          device: str = "cpu") -> ControlPlane:
    """The ``kv_control_plane`` fixture's work: the production control plane for a need.

    A failure or skip names :data:`FIXTURE_CLAUSE`, the clause whose reading of
    the need it shares; the plugin names none.
    """
    need = source if isinstance(source, bool) else declared_need(FIXTURE_CLAUSE, source)
    with unsupported_as_skip(FIXTURE_CLAUSE):
        return build_control_plane(need, case, world_size=world_size, device=device)


def _control_plane(run: _Run, device: str, **kwargs: Any) -> ControlPlane:
    try:
        return build_control_plane(run.need, run.the_case, device=device, **kwargs)
    except (ClauseFailure, ClauseSkip):
        raise
    except Unsupported as exc:
        raise exc.skip(run.clause) from None
    except Exception as exc:
        raise run.fail(f"the control plane raised {type(exc).__name__}: {exc}") from exc


def _ranks(run: _Run, workers: Workers) -> list[WorkerHandle]:
    if isinstance(workers, Unplaceable):
        raise run.skip(workers.reason, SkipKind.HARDWARE)
    if len(workers) != run.the_case.world_size:
        raise ValueError(f"{len(workers)} workers for world size {run.the_case.world_size}")
    return list(workers)


def _adopt(run: _Run, cp: ControlPlane, handles: Sequence[WorkerHandle],
           **options: Any) -> list[AdoptReport]:
    """Send the executor's frames to every rank; a worker that dies fails the clause."""
    frames, _wire = executor_wire.encode(cp.rpc_message())
    try:
        return broadcast_adopt(handles, frames, need=run.need, **options)
    except HarnessError as exc:
        raise run.harness(exc, "waiting for the workers to adopt and allocate") from exc
    except WorkerError as exc:
        raise run.fail(f"worker process failed: {exc}", layout=cp.pinned) from exc


def _adopted_ok(run: _Run, cp: ControlPlane, reports: Sequence[AdoptReport]) -> None:
    for rank, report in enumerate(reports):
        for stage in ("adopt_error", "init_error"):
            error = getattr(report, stage)
            if error:
                raise run.fail(f"rank {rank}: {stage.split('_')[0]} raised {error['type']}: "
                               f"{error['message']}", layout=cp.pinned)


# --- KV-A1 --------------------------------------------------------------------------


def check_kv_a1(source: Source, case: Case, device: str = "cpu") -> None:
    """KV-A1: the control plane pins before sizing and stamps every config with the name."""
    run = _run("KV-A1", source, case)
    cp = _control_plane(run, device)
    pinned = cp.pinned
    if pinned is None:
        raise run.fail("the control plane left its own CacheConfig unpinned",
                       expected="a layout name", actual=None)
    if not cp.sized_with:
        raise run.fail("sizing (get_kv_cache_configs) was not observed; cannot tell whether "
                       "the layout was pinned before it", layout=pinned)
    if any(name != pinned for name in cp.sized_with):
        raise run.fail("the layout was not pinned when the control plane sized the cache",
                       layout=pinned, expected=pinned, actual=cp.sized_with)
    if oracle.is_block_outermost(pinned) != run.need:
        raise run.fail("the pinned layout contradicts the declared need "
                       f"(indexes_kv_by_block_stride={run.need})", layout=pinned,
                       expected=f"is_block_outermost={run.need}", actual=pinned)
    if len(cp.rank_configs) != cp.world_size:
        raise run.fail("one rank-local config per rank", layout=pinned,
                       expected=cp.world_size, actual=len(cp.rank_configs))
    stamped = [(f"rank {r}", c) for r, c in enumerate(cp.rank_configs)]
    for who, config in [*stamped, ("scheduler", cp.scheduler_config)]:
        name = getattr(config, "kv_cache_layout", None)
        if name != pinned:
            raise run.fail(f"the {who} KVCacheConfig is not stamped with the pinned layout",
                           layout=pinned, expected=pinned, actual=name)
    for who, config in stamped:
        _sized_for(run, who, config, pinned)


def _geometry(case: Case, config: Any, layers: int) -> oracle.Geometry:
    """Manager-block grain, as ``KVCacheTensor`` strides are."""
    return geometry_for(case, num_blocks=config.num_blocks, num_layers=layers, kernel=False)


def _expected_offset(run: _Run, who: str, tensor: Any, layout: str | None) -> int:
    """The byte offset of a single-group tensor's first page: 0, from first principles.

    One group owns the whole allocation, so its first page starts at byte 0;
    production's ``offset`` is asserted against that, never fed to the oracle.
    """
    case = run.the_case
    if case.num_groups != 1:
        raise run.skip(f"case {case.id} has {case.num_groups} KV cache "
                       "groups; the expected tensor offset is derived for one group only",
                       SkipKind.NOT_APPLICABLE)
    if tensor.offset != 0:
        raise run.fail(f"the {who} KVCacheTensor.offset is not 0, although its one KV cache "
                       "group owns the whole allocation", layout=layout, expected=0,
                       actual=tensor.offset)
    return 0


def _sized_for(run: _Run, who: str, config: Any, layout: str) -> None:
    """The sizing agrees with the pinned layout: strides are the oracle's for it."""
    for tensor in config.kv_cache_tensors:
        geom = _geometry(run.the_case, config, len(tensor.layers))
        want = oracle.expected_tensor(layout, geom, _expected_offset(run, who, tensor, layout))
        got = oracle.OracleTensor(tensor.size, tensor.layer_stride, tensor.block_stride,
                                  tensor.offset)
        if got != want:
            raise run.fail(f"the {who} KVCacheTensor was not sized for the pinned layout",
                           layout=layout, expected=want, actual=got)


# --- KV-A2 --------------------------------------------------------------------------


def check_kv_a2(source: Source, case: Case, workers: Workers) -> None:
    """KV-A2: each rank-local config reaches an unpinned worker process intact."""
    run = _run("KV-A2", source, case)
    handles = _ranks(run, workers)
    _same_backend_class(run, source, handles)
    cp = _control_plane(run, handles[0].device)
    _frames, wire = executor_wire.encode(cp.rpc_message())
    reports = _adopt(run, cp, handles)
    for rank, report in enumerate(reports):
        _crossed_process_boundary(run, rank, report, cp.pinned)
        if report.fresh_layout is not None:
            raise run.fail(f"rank {rank}: the worker's own config started pinned",
                           layout=cp.pinned, expected=None, actual=report.fresh_layout)
        if report.num_configs != cp.world_size or report.rank != rank:
            raise run.fail(f"rank {rank} received the wrong set of rank-local configs",
                           layout=cp.pinned, expected=(cp.world_size, rank),
                           actual=(report.num_configs, report.rank))
        _first_field_difference(run, cp, rank, config_summary(cp.rank_configs[rank]),
                                report.received)
    if wire != "vllm MessageQueue.enqueue":
        raise run.skip(f"the executor's serialiser could not be driven; the "
                       f"configs crossed as {wire}", SkipKind.ENVIRONMENT)


def _same_backend_class(run: _Run, source: Source, handles: Sequence[WorkerHandle]) -> None:
    """Each worker, having loaded its plugins as production workers do, resolves the
    backend to the class the test process checked; else production would run another."""
    if isinstance(source, bool) or source.source not in ("registry", "platform"):
        return  # a stand-in need, or a hook / entry-point backend production never resolves
    for rank, handle in enumerate(handles):
        seen = handle.resolve_backend(source.name, source.source)
        if seen.get("path") != source.path:
            plugins = seen.get("plugins") or {}
            failed = "; ".join(plugins.get("failed") or []) or "none"
            why = f" ({seen['error']})" if seen.get("error") else ""
            raise run.fail(
                f"rank {rank}: the worker process resolves backend {source.name} to "
                f"{seen.get('path')}{why}, the test process to {source.path} (origin: "
                f"{source.origin or source.source}); production's workers would run a class "
                f"other than the one checked (worker overrides: {plugins.get('overrides')}, "
                f"failed plugins: {failed})", expected=source.path, actual=seen.get("path"))


def _crossed_process_boundary(run: _Run, rank: int, report: AdoptReport,
                              layout: str | None) -> None:
    """The worker says, from inside, that it is a child process this process started.

    Spawned: its OS parent is this process.  Forked from this process's fork server
    (``forkserver.py``): its OS parent is that server; either way multiprocessing
    names this process as its parent.
    """
    me = os.getpid()
    seen = {key: getattr(report, key) for key in ("pid", "ppid", "parent_pid",
                                             "has_parent_process", "start_method")}
    forked = seen["start_method"] == "forkserver"
    want = {"pid": f"not {me}", "ppid": forkserver.pid() if forked else me, "parent_pid": me,
            "has_parent_process": True,
            "start_method": seen["start_method"] if forked else "spawn"}
    if seen["pid"] == me:
        raise run.fail(f"rank {rank}: the worker ran in the test process (pid)",
                       layout=layout, expected=want, actual=seen)
    for key in ("start_method", "ppid", "parent_pid", "has_parent_process"):
        if seen[key] != want[key] or seen[key] is None:
            raise run.fail(f"rank {rank}: the worker is not a spawned child of the test "
                           f"process ({key})", layout=layout, expected=want, actual=seen)


def _first_field_difference(run: _Run, cp: ControlPlane, rank: int, sent: Any,
                            received: Any, path: str = "") -> None:
    if isinstance(sent, dict) and isinstance(received, dict):
        for key in sent:
            _first_field_difference(run, cp, rank, sent[key], received.get(key),
                                    f"{path}.{key}" if path else key)
        return
    if isinstance(sent, list) and isinstance(received, list) and len(sent) == len(received):
        for i, (a, b) in enumerate(zip(sent, received, strict=True)):
            _first_field_difference(run, cp, rank, a, b, f"{path}[{i}]")
        return
    if sent != received:
        raise run.fail(f"rank {rank}: the config the worker received differs at {path}",
                       layout=cp.pinned, expected=sent, actual=received)


# --- KV-A3 / KV-A5 --------------------------------------------------------------------


def check_kv_a3(source: Source, case: Case, workers: Workers) -> None:
    """KV-A3: workers adopt, allocate on their device, and bytes land at oracle offsets."""
    run = _run("KV-A3", source, case)
    handles = _ranks(run, workers)
    _same_backend_class(run, source, handles)
    _adopt_write_verify(run, handles)


def check_kv_a5(source: Source, case: Case, workers: Workers) -> None:
    """KV-A5: N > 1 ranks, one process per device, each adopting its own config."""
    run = _run("KV-A5", source, case)
    if case.world_size < 2:
        raise run.skip(f"case {case.id} has world size {case.world_size}",
                       SkipKind.NOT_APPLICABLE)
    handles = _ranks(run, workers)
    pids = [h.pid for h in handles]
    if len(set(pids)) != len(pids):
        raise run.fail("ranks share a worker process", expected="distinct pids", actual=pids)
    devices = [h.placement for h in handles]
    if devices[0] != "cpu" and len(set(devices)) != len(devices):
        raise run.fail("ranks share a device", expected="one device per rank", actual=devices)
    cp, reports = _adopt_write_verify(run, handles)
    for rank, report in enumerate(reports):
        if report.rank != rank or report.pid != pids[rank]:
            raise run.fail(f"rank {rank} adopted another rank's config", layout=cp.pinned,
                           expected=(rank, pids[rank]), actual=(report.rank, report.pid))
        _first_field_difference(run, cp, rank, config_summary(cp.rank_configs[rank]),
                                report.received)


def _adopt_write_verify(run: _Run, handles: Sequence[WorkerHandle],
                        ) -> tuple[ControlPlane, list[AdoptReport]]:
    cp = _control_plane(run, handles[0].device)
    reports = _adopt(run, cp, handles)
    _adopted_ok(run, cp, reports)
    for rank, (handle, report) in enumerate(zip(handles, reports, strict=True)):
        stamped = cp.rank_configs[rank].kv_cache_layout
        if report.adopted != stamped or report.layout_after != stamped:
            raise run.fail(f"rank {rank} did not adopt the control plane's layout",
                           layout=cp.pinned, expected=stamped,
                           actual=(report.adopted, report.layout_after))
        _on_device(run, cp, rank, handle.device, report)
        _verify_pattern(run, cp, rank, handle, report)
    return cp, reports


def _on_device(run: _Run, cp: ControlPlane, rank: int, device: str,
               report: AdoptReport) -> None:
    want = device if ":" in device or device == "cpu" else f"{device}:0"
    config = cp.rank_configs[rank]
    layers = [name for t in config.kv_cache_tensors for name in t.layers]
    if sorted(report.views) != sorted(layers):
        raise run.fail(f"rank {rank}: init_kv_cache returned views for other layers",
                       layout=cp.pinned, expected=sorted(layers), actual=sorted(report.views))
    for name, view in report.views.items():
        if view["device"] != want:
            raise run.fail(f"rank {rank}: layer {name} was allocated off the worker's device",
                           layout=cp.pinned, expected=want, actual=view["device"])
    if report.num_storages != 1:
        raise run.fail(f"rank {rank}: layers are not views of one backing allocation",
                       layout=cp.pinned, expected=1, actual=report.num_storages)


def _pages(case: Case, num_layers: int, num_blocks: int) -> list[tuple[int, int]]:
    """Boundary pages (first/last layer x first/last block) plus seeded interior samples."""
    last_l, last_b = num_layers - 1, num_blocks - 1
    pages = {(0, 0), (0, last_b), (last_l, 0), (last_l, last_b)}
    rng = random.Random(zlib.crc32(case.id.encode()))
    for _ in range(SAMPLED_PAGES):
        pages.add((rng.randrange(num_layers), rng.randrange(num_blocks)))
    return sorted(pages)


class _Addresses:
    """Oracle byte addresses of whole pages: the table when small, cell by cell when not."""

    def __init__(self, layout: str, geom: oracle.Geometry, offset: int) -> None:
        import math

        self.layout, self.geom, self.offset = layout, geom, offset
        cells = math.prod(geom.table_shape)
        self.table = (oracle.address_table(layout, geom, offset)
                      if cells <= _TABLE_CELLS else None)

    def page(self, layer: int, block: int) -> Any:
        import numpy as np

        if self.table is not None:
            return self.table[layer, block]
        _, _, h, n, c = self.geom.table_shape
        out = np.empty((h, n, c), dtype=np.int64)
        for index in np.ndindex(h, n, c):
            out[index] = oracle.cell_address(self.layout, self.geom, (layer, block, *index),
                                             self.offset)
        return out


def _verify_pattern(run: _Run, cp: ControlPlane, rank: int, handle: WorkerHandle,
                    report: AdoptReport, pages: Sequence[tuple[int, int]] | None = None,
                    ) -> None:
    """Have the worker write the pattern through its views; find it where the oracle says."""
    import numpy as np

    config = cp.rank_configs[rank]
    layout = cp.pinned or config.kv_cache_layout
    tensor = config.kv_cache_tensors[0]
    geom = _geometry(run.the_case, config, len(tensor.layers))
    pages = list(pages) if pages is not None else _pages(run.the_case, geom.num_layers,
                                                         geom.num_blocks)
    addresses = _Addresses(layout, geom, _expected_offset(run, f"rank {rank}", tensor, layout))
    page_addrs = {p: addresses.page(*p) for p in pages}
    if report.storage_nbytes is None:  # no view came back: nothing to read
        raise run.fail(f"rank {rank}: init_kv_cache returned no views", layout=layout)
    nbytes = report.storage_nbytes
    if nbytes <= _FULL_READ_LIMIT:
        regions = [(0, nbytes)]
    else:
        regions = []
        for addrs in page_addrs.values():
            lo = max(0, int(addrs.min()) - _GUARD_BYTES)
            hi = min(nbytes, int(addrs.max()) + 1 + _GUARD_BYTES)
            regions.append((lo, hi - lo))
    try:
        handle.write_pattern(pages, rank=rank)
        blobs = handle.read_back(regions)
    except HarnessError as exc:
        raise run.harness(exc, f"waiting for rank {rank} to write and read back the "
                          "pattern") from exc
    except WorkerError as exc:
        raise run.fail(f"rank {rank}: worker process failed: {exc}", layout=layout) from exc
    for (start, length), blob in zip(regions, blobs, strict=True):
        actual = np.frombuffer(blob, dtype=np.uint8)
        expected = np.zeros(length, dtype=np.uint8)
        for (layer, block), addrs in page_addrs.items():
            pattern = page_pattern(layer, block, rank, addrs.shape)
            inside = (addrs >= start) & (addrs < start + length)
            expected[addrs[inside] - start] = pattern[inside]
        if actual.shape != expected.shape:
            raise run.fail(f"rank {rank}: read back {actual.size} bytes at {start}",
                           layout=layout, expected=length, actual=actual.size)
        diff = np.flatnonzero(actual != expected)
        if diff.size:
            address = start + int(diff[0])
            where = _locate(address, page_addrs)
            raise run.fail(
                f"rank {rank}: the byte the worker wrote through its view is not at the oracle "
                f"offset; first difference at address {address} ({where}); {diff.size} bytes "
                f"differ", layout=layout, expected=hex(int(expected[diff[0]])),
                actual=hex(int(actual[diff[0]])))


def _locate(address: int, page_addrs: dict[tuple[int, int], Any]) -> str:
    import numpy as np

    for (layer, block), addrs in page_addrs.items():
        hit = np.argwhere(addrs == address)
        if hit.size:
            h, n, c = (int(i) for i in hit[0])
            return f"layer {layer}, block {block}, head {h}, token {n}, byte {c}"
    return "in no written page: must stay zero"


# --- KV-A4 --------------------------------------------------------------------------


def check_kv_a4(source: Source, case: Case, workers: Workers) -> None:
    """KV-A4: skipping adoption, or a worker pinned elsewhere, raises the right error."""
    run = _run("KV-A4", source, case)
    handles = _ranks(run, workers)
    cp = _control_plane(run, handles[0].device)
    unresolved = compat.unresolved_layout_error_text()
    reports = _adopt(run, cp, handles, skip_adoption=True)
    for rank, report in enumerate(reports):
        error = report.init_error
        if error is None:
            raise run.fail(f"rank {rank}: init_kv_cache allocated although the worker skipped "
                           "adoption", layout=cp.pinned,
                           expected=f"ValueError: {unresolved or 'unresolved layout'}",
                           actual=f"an allocation laid out as {report.layout_after}")
        if not unresolved or unresolved not in error["message"]:
            raise run.fail(f"rank {rank}: skipping adoption raised another error than the "
                           "unresolved-layout error", layout=cp.pinned,
                           expected=unresolved, actual=f"{error['type']}: {error['message']}")
    stamped = cp.rank_configs[0].kv_cache_layout
    other = next(name for name in compat.LAYOUT_NAMES if name != stamped)
    reports = _adopt(run, cp, handles, prepin=other)
    for rank, report in enumerate(reports):
        error = report.adopt_error
        if error is None:
            raise run.fail(f"rank {rank}: a worker already pinned to {other} adopted "
                           f"{stamped} without the disagreement error", layout=cp.pinned,
                           expected="ValueError naming both layouts",
                           actual=f"adopted {report.adopted}, allocated as "
                                  f"{report.layout_after}")
        text = error["message"]
        if error["type"] != "ValueError" or other not in text or str(stamped) not in text:
            raise run.fail(f"rank {rank}: the disagreement error does not name both layouts",
                           layout=cp.pinned,
                           expected=f"ValueError naming {other} and {stamped}",
                           actual=f"{error['type']}: {text}")


# --- KV-A6 --------------------------------------------------------------------------

PROBES = (1 << 31, 1 << 32)


def check_kv_a6(source: Source, case: Case, device: str, workers: Callable[[], Workers],
                memory_fraction: float = 0.5) -> None:
    """KV-A6: a free-memory-sized allocation holds its bytes past 2^31 and 2^32.

    ``workers`` is called only on CUDA: no worker is started to learn there is none.
    """
    run = _run("KV-A6", source, case)
    if not device.startswith("cuda"):
        raise run.skip(f"needs CUDA (this process's device is {device})",
                       SkipKind.HARDWARE)
    handles = _ranks(run, workers())
    try:
        free = [h.free_memory() or 0 for h in handles]
    except HarnessError as exc:
        raise run.harness(exc, "waiting for the workers' free memory") from exc
    except WorkerError as exc:
        raise run.fail(f"worker process failed: {exc}") from exc
    budget = [int(f * memory_fraction) for f in free]
    cp = _control_plane(run, device, available_memory=budget)
    config = cp.rank_configs[0]
    size = max(t.size for t in config.kv_cache_tensors)
    if size <= PROBES[-1]:
        raise run.skip(f"needs CUDA memory: {memory_fraction} of {free[0]} free "
                       f"bytes gives a {size}-byte allocation, not past 2^32",
                       SkipKind.HARDWARE)
    try:
        reports = _adopt(run, cp, handles)
        _adopted_ok(run, cp, reports)
        for rank, (handle, report) in enumerate(zip(handles, reports, strict=True)):
            _on_device(run, cp, rank, handle.device, report)
            tensor = cp.rank_configs[rank].kv_cache_tensors[0]
            layout = cp.pinned or config.kv_cache_layout
            geom = _geometry(case, cp.rank_configs[rank], len(tensor.layers))
            pages = _far_pages(layout, geom, _expected_offset(run, f"rank {rank}", tensor,
                                                              layout))
            _verify_pattern(run, cp, rank, handle, report, pages)
    except BaseException:
        for handle in handles:  # must not mask the error; a dead worker holds nothing
            if handle.alive:
                try:
                    handle.release()
                except HarnessError:
                    pass
        raise
    for handle in handles:
        handle.release()


def _far_pages(layout: str, geom: oracle.Geometry, offset: int) -> list[tuple[int, int]]:
    """Per layer at the ends: the first page past each probe, and the far-end page."""
    last_b = geom.num_blocks - 1
    pages = {(0, 0), (geom.num_layers - 1, last_b)}
    for layer in {0, geom.num_layers - 1}:
        for probe in PROBES:
            lo, hi = 0, last_b
            if oracle.page_start(layout, geom, layer, hi, offset) < probe:
                continue
            while lo < hi:  # page starts grow with the block id within a layer
                mid = (lo + hi) // 2
                if oracle.page_start(layout, geom, layer, mid, offset) >= probe:
                    hi = mid
                else:
                    lo = mid + 1
            pages.update({(layer, lo), (layer, max(0, lo - 1))})
    return sorted(pages)
