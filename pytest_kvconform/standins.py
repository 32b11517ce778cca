"""Stand-in backends for the control plane's explicit seam: a class per declared need.

Stdlib only, importable by path (``pytest_kvconform.standins.DeclaresBlockStride``),
so the checks, the control plane and the spawned workers can all resolve them.
"""

from __future__ import annotations


class DeclaresLayerStride:
    """A stand-in backend that needs LBNHC, for the control plane's explicit seam."""

    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        return False


class DeclaresBlockStride:
    """A stand-in backend that needs a block-outermost layout; no in-tree backend does yet."""

    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        return True


def declaring(need: bool) -> type:
    """The stand-in backend class declaring ``need`` (importable by its path)."""
    return DeclaresBlockStride if need else DeclaresLayerStride
