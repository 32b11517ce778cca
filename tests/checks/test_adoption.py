"""KV-A check helpers that need no worker: page selection, offsets, process identity."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from pytest_kvconform.checks import adoption, adoption_bytes
from pytest_kvconform.checks.errors import ClauseFailure, ClauseSkip
from pytest_kvconform.contract import oracle
from pytest_kvconform.contract.records import Case

RUN = adoption.Run("KV-A3", "need=True", Case(id="x", file="f"), need=True)


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC", "LBHNC"])
def test_far_pages_straddle_2_31_and_2_32(layout: str) -> None:
    geom = oracle.Geometry.for_attention(num_layers=2, num_blocks=3_000_000, num_kv_heads=2,
                                         block_size=16, head_size=8, dtype="bfloat16")
    pages = adoption_bytes._far_pages(layout, geom, 0)
    starts = {p: oracle.page_start(layout, geom, *p) for p in pages}
    assert (1, geom.num_blocks - 1) in pages and (0, 0) in pages
    for probe in adoption_bytes.PROBES:
        past = [p for p, s in starts.items() if s >= probe]
        before = [p for p, s in starts.items() if s < probe]
        assert past and before
        # the first page past the probe sits right after one that is not
        first = min(past, key=lambda p: starts[p])
        assert (first[0], first[1] - 1) in pages and starts[(first[0], first[1] - 1)] < probe


def test_far_pages_skip_probes_an_allocation_does_not_reach() -> None:
    geom = oracle.Geometry.for_attention(num_layers=2, num_blocks=16, num_kv_heads=2,
                                         block_size=16, head_size=8, dtype="bfloat16")
    assert adoption_bytes._far_pages("LBNHC", geom, 0) == [(0, 0), (1, 15)]


def test_pages_cover_the_boundaries_and_are_seeded() -> None:
    case = Case(id="x", file="f")
    pages = adoption_bytes._pages(case, 2, 16)
    assert {(0, 0), (0, 15), (1, 0), (1, 15)} <= set(pages)
    assert len(pages) > 4 and pages == adoption_bytes._pages(case, 2, 16)
    assert all(0 <= layer < 2 and 0 <= block < 16 for layer, block in pages)


def test_expected_offset_is_zero_and_production_offset_is_asserted() -> None:
    tensor = SimpleNamespace(offset=0, layers=["l0", "l1"])
    assert adoption._expected_offset(RUN, "rank 0", tensor, "LBNHC") == 0
    with pytest.raises(ClauseFailure, match=r"KV-A3 violated.*rank 0 KVCacheTensor\.offset") as e:
        adoption._expected_offset(RUN, "rank 0", SimpleNamespace(offset=64, layers=["l0"]),
                                  "LBNHC")
    assert (e.value.expected, e.value.actual) == (0, 64)
    two_groups = adoption.Run("KV-A1", "x", Case(id="g2", file="f", num_groups=2), need=True)
    with pytest.raises(ClauseSkip, match="2 KV cache groups"):
        adoption._expected_offset(two_groups, "rank 0", tensor, "LBNHC")


def test_sized_for_fails_on_a_shifted_offset_with_otherwise_oracle_strides() -> None:
    """The oracle gets 0, not production's offset: a shifted tensor cannot pass KV-A1."""
    case = Case(id="x", file="f")
    spec = SimpleNamespace(block_size=16, num_kv_heads=2, head_size=64, dtype="torch.bfloat16")
    config = SimpleNamespace(num_blocks=16, kv_cache_tensors=[],
                             kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)])
    geom = adoption._geometry(config, 2)
    good = oracle.expected_tensor("LBNHC", geom, 0)
    shifted = oracle.expected_tensor("LBNHC", geom, 512)  # self-consistent, but not at 0
    run = adoption.Run("KV-A1", "need=False", case, need=False)
    for want, tensor in ((None, good), ("offset", shifted)):
        config.kv_cache_tensors = [SimpleNamespace(layers=["a", "b"], **vars(tensor))]
        if want is None:
            adoption._sized_for(run, "rank 0", config, "LBNHC")
        else:
            with pytest.raises(ClauseFailure, match=r"KVCacheTensor\.offset is not 0"):
                adoption._sized_for(run, "rank 0", config, "LBNHC")


@pytest.mark.parametrize(("field", "value"), [
    ("pid", "the control plane's"), ("has_parent_process", False), ("parent_pid", 1),
    ("parent_pid", None)])
@pytest.mark.parametrize("control_plane", ["here", "engine"])
def test_process_boundary_is_checked_from_the_workers_own_report(
        field: str, value: object, control_plane: str) -> None:
    """A rank is another process than the control plane's, started on its behalf; where the
    control plane runs in an engine process, that process is also the rank's OS parent."""
    engine = os.getpid() if control_plane == "here" else 100
    seen = {"pid": 200, "ppid": 300 if control_plane == "here" else engine,
            "parent_pid": engine, "has_parent_process": True, "start_method": "forkserver"}
    adoption._crossed_process_boundary(RUN, 0, seen, engine, "LBNHC")
    wrong = engine if value == "the control plane's" else value
    with pytest.raises(ClauseFailure, match=r"rank 0: the worker "):
        adoption._crossed_process_boundary(RUN, 0, {**seen, field: wrong}, engine, "LBNHC")
    if control_plane == "engine":  # forked by some other process
        with pytest.raises(ClauseFailure, match=r"OS parent is not the engine process"):
            adoption._crossed_process_boundary(RUN, 0, {**seen, "ppid": 1}, engine, "LBNHC")
