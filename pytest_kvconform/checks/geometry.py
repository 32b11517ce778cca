"""A spec case's numbers as the oracle sees them: one place for Case -> sizes.

The checks must agree on what a case's page and geometry are, so each is derived
here once, from the case's own numbers (``cases.page_bytes``) and the oracle.
"""

from __future__ import annotations

from pytest_kvconform.contract import cases, oracle
from pytest_kvconform.contract.records import Case


def page_stride(case: Case) -> int:
    """Bytes one (layer, block) page occupies, padding included."""
    return cases.page_stride(case)


def geometry_for(case: Case, num_blocks: int | None = None, num_layers: int | None = None,
                 kernel: bool = True) -> oracle.Geometry:
    """The oracle geometry of the case's cache group (``kernel=False``: manager-block grain).

    ``num_blocks`` / ``num_layers`` default to the case's ``num_pages`` / ``num_layers``.
    """
    return oracle.Geometry.for_attention(
        num_layers=num_layers if num_layers is not None else case.num_layers,
        num_blocks=num_blocks if num_blocks is not None else case.num_pages,
        num_kv_heads=case.num_kv_heads,
        block_size=case.block_size,
        head_size=case.head_size,
        dtype=case.dtype,
        page_size_padded=case.page_size_padded,
        kernel_block_size=case.kernel_block_size if kernel else None,
    )
