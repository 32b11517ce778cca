"""KV-A check helpers that need no worker: page selection, offsets, process identity."""

from __future__ import annotations

import os
from dataclasses import replace
from types import SimpleNamespace

import pytest

from pytest_kvconform import forkserver, oracle
from pytest_kvconform.checks import adoption
from pytest_kvconform.checks.errors import ClauseFailure, ClauseSkip
from pytest_kvconform.model import Case
from pytest_kvconform.workers import AdoptReport

RUN = adoption._Run("KV-A3", "need=True", Case(id="x", file="f"), need=True)


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC", "LBHNC"])
def test_far_pages_straddle_2_31_and_2_32(layout: str) -> None:
    geom = oracle.Geometry.for_attention(num_layers=2, num_blocks=3_000_000, num_kv_heads=2,
                                         block_size=16, head_size=8, dtype="bfloat16")
    pages = adoption._far_pages(layout, geom, 0)
    starts = {p: oracle.page_start(layout, geom, *p) for p in pages}
    assert (1, geom.num_blocks - 1) in pages and (0, 0) in pages
    for probe in adoption.PROBES:
        past = [p for p, s in starts.items() if s >= probe]
        before = [p for p, s in starts.items() if s < probe]
        assert past and before
        # the first page past the probe sits right after one that is not
        first = min(past, key=lambda p: starts[p])
        assert (first[0], first[1] - 1) in pages and starts[(first[0], first[1] - 1)] < probe


def test_far_pages_skip_probes_an_allocation_does_not_reach() -> None:
    geom = oracle.Geometry.for_attention(num_layers=2, num_blocks=16, num_kv_heads=2,
                                         block_size=16, head_size=8, dtype="bfloat16")
    assert adoption._far_pages("LBNHC", geom, 0) == [(0, 0), (1, 15)]


def test_pages_cover_the_boundaries_and_are_seeded() -> None:
    case = Case(id="x", file="f")
    pages = adoption._pages(case, 2, 16)
    assert {(0, 0), (0, 15), (1, 0), (1, 15)} <= set(pages)
    assert len(pages) > 4 and pages == adoption._pages(case, 2, 16)
    assert all(0 <= layer < 2 and 0 <= block < 16 for layer, block in pages)


def test_expected_offset_is_zero_and_production_offset_is_asserted() -> None:
    tensor = SimpleNamespace(offset=0, layers=["l0", "l1"])
    assert adoption._expected_offset(RUN, "rank 0", tensor, "LBNHC") == 0
    with pytest.raises(ClauseFailure, match=r"KV-A3 violated.*rank 0 KVCacheTensor\.offset") as e:
        adoption._expected_offset(RUN, "rank 0", SimpleNamespace(offset=64, layers=["l0"]),
                                  "LBNHC")
    assert (e.value.expected, e.value.actual) == (0, 64)
    two_groups = adoption._Run("KV-A1", "x", Case(id="g2", file="f", num_groups=2), need=True)
    with pytest.raises(ClauseSkip, match="2 KV cache groups"):
        adoption._expected_offset(two_groups, "rank 0", tensor, "LBNHC")


def test_sized_for_fails_on_a_shifted_offset_with_otherwise_oracle_strides() -> None:
    """The oracle gets 0, not production's offset: a shifted tensor cannot pass KV-A1."""
    case = Case(id="x", file="f")
    config = SimpleNamespace(num_blocks=16, kv_cache_tensors=[])
    geom = adoption._geometry(case, config, 2)
    good = oracle.expected_tensor("LBNHC", geom, 0)
    shifted = oracle.expected_tensor("LBNHC", geom, 512)  # self-consistent, but not at 0
    run = adoption._Run("KV-A1", "need=False", case, need=False)
    for want, tensor in ((None, good), ("offset", shifted)):
        config.kv_cache_tensors = [SimpleNamespace(layers=["a", "b"], **vars(tensor))]
        if want is None:
            adoption._sized_for(run, "rank 0", config, "LBNHC")
        else:
            with pytest.raises(ClauseFailure, match=r"KVCacheTensor\.offset is not 0"):
                adoption._sized_for(run, "rank 0", config, "LBNHC")


@pytest.mark.parametrize(("field", "value"), [
    ("pid", os.getpid()), ("ppid", 1), ("has_parent_process", False), ("start_method", "fork"),
    ("ppid", None), ("parent_pid", 1), ("parent_pid", None)])
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_process_boundary_is_checked_from_the_workers_own_report(
        field: str, value: object, method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Spawned: the OS parent is this process; forked: this process's fork server."""
    server = os.getpid() + 2
    monkeypatch.setattr(forkserver, "pid", lambda: server)
    report = AdoptReport(pid=os.getpid() + 1,
                         ppid=server if method == "forkserver" else os.getpid(),
                         parent_pid=os.getpid(), has_parent_process=True, start_method=method,
                         cuda_visible_devices=None, rank=0, method=None, num_configs=1,
                         fresh_layout=None, received={})
    adoption._crossed_process_boundary(RUN, 0, report, "LBNHC")
    with pytest.raises(ClauseFailure, match=rf"rank 0: the worker .*\({field}\)"):
        adoption._crossed_process_boundary(RUN, 0, replace(report, **{field: value}), "LBNHC")
    if method == "forkserver":  # a worker forked by some other server
        with pytest.raises(ClauseFailure, match=r"\(ppid\)"):
            adoption._crossed_process_boundary(RUN, 0, replace(report, ppid=server + 1), "LBNHC")
