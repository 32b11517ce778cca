"""Stand-in backends for tests, defined once.

Tests that call the checks use the classes directly; pytester and subprocess runs
register them through the plugin's hook (``tests.seeding.backends_conftest``).  The
paged stand-ins of KV-L7 ship in ``pytest_kvconform/adapters/paged_standins.py``.
Nothing heavy is imported here: torch only inside the declarations that touch CUDA.
"""

from __future__ import annotations

import time


class Good:
    """Declares False, as every in-tree backend does."""

    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        return False


class GoodBlockStride:
    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        return True


class IntFlag:
    """Declares the int 1: truthy, not a bool, which KV-L1 must report."""

    @classmethod
    def indexes_kv_by_block_stride(cls) -> int:
        return 1


class Flipping:
    calls = 0

    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        cls.calls += 1
        return cls.calls % 2 == 0


class TouchesCuda:
    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        import torch

        try:
            torch.cuda._lazy_init()
        except Exception:  # a CPU-only build refuses; the attempt is what counts
            pass
        return False


class TouchesCudaRaw:
    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        import torch

        return torch.cuda.current_device() >= 0  # raises on a CPU-only build


class Raises:
    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        raise RuntimeError("registry not ready")


class NeedsBlockStride:
    """Needs a block-outermost layout and has no paged path."""

    supports_paged_kv = False

    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        return True


class Blocking:
    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        time.sleep(300)  # a declaration that blocks for minutes
        return False


# GOOD passes KV-L1, INT_FLAG fails it: the smallest run with both outcomes.
GOOD_AND_INT_FLAG: dict[str, type] = {"GOOD": Good, "INT_FLAG": IntFlag}
