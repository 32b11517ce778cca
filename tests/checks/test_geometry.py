"""Case -> oracle geometry and page size: one derivation, agreeing with the oracle."""

from __future__ import annotations

import dataclasses

import pytest

from pytest_kvconform.checks.geometry import geometry_for, page_stride
from pytest_kvconform.contract import cases, oracle

CASES = {c.id: c for c in cases.load_cases()}


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_page_stride_agrees_with_the_oracle(case_id: str) -> None:
    case = CASES[case_id]
    geom = geometry_for(case)
    assert geom.page_bytes == cases.page_bytes(case)
    assert page_stride(case) == geom.page_stride_bytes


def test_padded_page_stride_is_the_padded_size() -> None:
    assert page_stride(CASES["padded"]) == 1536
    assert page_stride(CASES["bf16_h8"]) == 1024


def test_geometry_for_defaults_and_overrides() -> None:
    case = CASES["split_k8"]
    geom = geometry_for(case)
    assert (geom.num_layers, geom.num_blocks, geom.kernel_block_size) == (2, 16, 8)
    manager = geometry_for(case, num_blocks=5, num_layers=3, kernel=False)
    assert (manager.num_layers, manager.num_blocks, manager.kernel_block_size) == (3, 5, None)
    assert manager == dataclasses.replace(geom, num_layers=3, num_blocks=5,
                                          kernel_block_size=None)


def test_geometry_for_keeps_padding() -> None:
    geom = geometry_for(CASES["padded"])
    assert geom.is_padded and geom.page_size_padded == 1536
    with pytest.raises(oracle.OracleUnsupported, match=r"LHBNC.*H"):
        oracle.expected_tensor("LHBNC", geom)
