"""KV-A check helpers that need no worker: page selection for the probes."""

from __future__ import annotations

import pytest

from pytest_kvconform import oracle
from pytest_kvconform.checks import adoption
from pytest_kvconform.model import Case


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
