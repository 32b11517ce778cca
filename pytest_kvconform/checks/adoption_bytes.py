"""KV-A3, KV-A5 and KV-A6: what production's workers allocated, read back byte by byte.

The deployments are ``adoption.py``'s; here the pages a rank wrote and read back are
checked at the oracle's offsets (sampled pages, guard bytes around them, the whole
allocation when small), and KV-A6's far pages past 2^31 and 2^32 bytes.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from pytest_kvconform.adapters import entry_points
from pytest_kvconform.adapters.engine import EngineReport
from pytest_kvconform.adapters.worker_extension import config_summary, page_pattern
from pytest_kvconform.checks.adoption import (
    Run,
    Source,
    Workers,
    _expected_offset,
    _first_field_difference,
    _geometry,
    _ranks,
    _run,
    _served,
    _topology,
    deploy,
    ran,
)
from pytest_kvconform.checks.errors import HarnessError, SkipKind
from pytest_kvconform.contract import oracle
from pytest_kvconform.contract.records import Case
from pytest_kvconform.workers import deployment
from pytest_kvconform.workers.handle import WorkerHandle
from pytest_kvconform.workers.protocol import WorkerError

SAMPLED_PAGES = 4
_FULL_READ_LIMIT = 1 << 26  # read the whole allocation back below this many bytes
_GUARD_BYTES = 256  # bytes checked (must stay zero) on either side of a probed page
_TABLE_CELLS = 1 << 22


# --- KV-A3 / KV-A5 --------------------------------------------------------------------


def check_kv_a3(source: Source, case: Case, workers: Workers) -> None:
    """KV-A3: workers adopt, allocate on their device, and bytes land at oracle offsets."""
    run = _run("KV-A3", source, case)
    handles = _ranks(run, workers)
    with deploy(run, handles, topology=_topology(case)) as deployed:
        _adopted_and_verified(run, handles, deployed)


def check_kv_a5(source: Source, case: Case, workers: Workers) -> None:
    """KV-A5: N > 1 ranks, one process per device, each adopting its own config."""
    run = _run("KV-A5", source, case)
    if case.world_size < 2:
        raise run.skip(f"case {case.id} has world size {case.world_size}",
                       SkipKind.NOT_APPLICABLE)
    handles = _ranks(run, workers)
    devices = [h.placement for h in handles]
    if devices[0] != "cpu" and len(set(devices)) != len(devices):
        raise run.fail("ranks share a device", expected="one device per rank", actual=devices)
    with deploy(run, handles, topology=entry_points.MP) as deployed:
        report = _adopted_and_verified(run, handles, deployed)
    pids = [seen["pid"] for seen in report.ranks]
    if len(set(pids)) != len(pids):
        raise run.fail("ranks share a worker process", expected="distinct pids", actual=pids)
    for rank, seen in enumerate(report.ranks):
        if seen["rank"] != rank:
            raise run.fail(f"rank {rank}'s worker says it is rank {seen['rank']}",
                           layout=report.pinned, expected=rank, actual=seen["rank"])
        _first_field_difference(run, report.pinned, rank,
                                config_summary(report.rank_configs[rank]), seen["received"])


def _adopted_and_verified(run: Run, handles: Sequence[WorkerHandle],
                          deployed: deployment.Deployment) -> EngineReport:
    report = deployed.report
    ran(run, report)
    _served(run, report)
    for rank, seen in enumerate(report.ranks):
        stamped = report.rank_configs[rank].kv_cache_layout
        adopted = (seen["received"] or {}).get("kv_cache_layout")
        if adopted != stamped or seen["layout_after"] != stamped:
            raise run.fail(f"rank {rank} did not adopt the control plane's layout",
                           layout=report.pinned, expected=stamped,
                           actual=(adopted, seen["layout_after"]))
        _on_device(run, report, rank, handles[min(rank, len(handles) - 1)].device, seen)
        _verify_pattern(run, report, rank, deployed)
    return report


def _on_device(run: Run, report: EngineReport, rank: int, device: str,
               seen: dict[str, Any]) -> None:
    want = device if ":" in device or device == "cpu" else f"{device}:0"
    config = report.rank_configs[rank]
    layers = [name for t in config.kv_cache_tensors for name in t.layers]
    if sorted(seen["views"]) != sorted(layers):
        raise run.fail(f"rank {rank}: the runner's layers hold views for other layers than its "
                       "config", layout=report.pinned, expected=sorted(layers),
                       actual=sorted(seen["views"]))
    for name, view in seen["views"].items():
        if view["device"] != want:
            raise run.fail(f"rank {rank}: layer {name} was allocated off the worker's device",
                           layout=report.pinned, expected=want, actual=view["device"])
    if seen["num_storages"] != 1:
        raise run.fail(f"rank {rank}: layers are not views of one backing allocation",
                       layout=report.pinned, expected=1, actual=seen["num_storages"])


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


def _verify_pattern(run: Run, report: EngineReport, rank: int,
                    deployed: deployment.Deployment,
                    pages: Sequence[tuple[int, int]] | None = None) -> None:
    """Have the worker write the pattern through its views; find it where the oracle says."""
    import numpy as np

    config = report.rank_configs[rank]
    layout = report.pinned or config.kv_cache_layout
    tensor = config.kv_cache_tensors[0]
    geom = _geometry(config, len(tensor.layers))
    pages = list(pages) if pages is not None else _pages(run.the_case, geom.num_layers,
                                                         geom.num_blocks)
    addresses = _Addresses(layout, geom, _expected_offset(run, f"rank {rank}", tensor, layout))
    page_addrs = {p: addresses.page(*p) for p in pages}
    nbytes = report.ranks[rank]["storage_nbytes"]
    if nbytes is None:  # no view came back: nothing to read
        raise run.fail(f"rank {rank}: the runner bound no cache view to its layers",
                       layout=layout)
    if nbytes <= _FULL_READ_LIMIT:
        regions = [(0, nbytes)]
    else:
        regions = []
        for addrs in page_addrs.values():
            lo = max(0, int(addrs.min()) - _GUARD_BYTES)
            hi = min(nbytes, int(addrs.max()) + 1 + _GUARD_BYTES)
            regions.append((lo, hi - lo))
    try:
        deployed.call("kvconform_write_pattern", rank, pages)
        blobs = deployed.call("kvconform_read_back", rank, regions)
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
    budget = int(min(free) * memory_fraction)
    with deploy(run, handles, topology=_topology(case), memory=budget) as deployed:
        report = deployed.report
        ran(run, report)
        _served(run, report)
        config = report.rank_configs[0]
        size = max(t.size for t in config.kv_cache_tensors)
        if size <= PROBES[-1]:
            raise run.skip(f"needs CUDA memory: {memory_fraction} of {free[0]} free "
                           f"bytes gives a {size}-byte allocation, not past 2^32",
                           SkipKind.HARDWARE)
        for rank, seen in enumerate(report.ranks):
            _on_device(run, report, rank, handles[min(rank, len(handles) - 1)].device, seen)
            tensor = report.rank_configs[rank].kv_cache_tensors[0]
            layout = report.pinned or config.kv_cache_layout
            geom = _geometry(report.rank_configs[rank], len(tensor.layers))
            pages = _far_pages(layout, geom, _expected_offset(run, f"rank {rank}", tensor,
                                                              layout))
            _verify_pattern(run, report, rank, deployed, pages)


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
