"""Stand-in backends for tests, defined once.

Tests that call the checks use the classes directly; pytester and subprocess runs
register them through the plugin's hook (``tests.seeding.backends_conftest``), each under
the name its test gives it, which its ``get_name()`` then answers (KV-L1's name control):
the hook registers a subclass naming it.  The paged stand-ins of KV-L7 ship in
``pytest_kvconform/adapters/paged_standins.py``.  Nothing heavy is imported here: torch
only inside the declarations that touch CUDA.
"""

from __future__ import annotations

import time
from typing import ClassVar


class StandIn:
    """A stand-in's name: the one it is registered under, else its class name."""

    registered_as: ClassVar[str | None] = None

    @classmethod
    def get_name(cls) -> str:
        return cls.registered_as or cls.__name__


def named(cls: type, name: str) -> type:
    """``cls`` answering to ``name`` (a subclass that says so; the same import path)."""
    return type(cls.__name__, (cls,), {"registered_as": name, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


class Good(StandIn):
    """Declares False, as every in-tree backend does."""

    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        return False


class GoodBlockStride(StandIn):
    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        return True


class IntFlag(StandIn):
    """Declares the int 1: truthy, not a bool, which KV-L1 must report."""

    @classmethod
    def indexes_kv_by_block_stride(cls) -> int:
        return 1


class Flipping(StandIn):
    calls = 0

    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        cls.calls += 1
        return cls.calls % 2 == 0


class TouchesCuda(StandIn):
    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        import torch

        try:
            torch.cuda._lazy_init()
        except Exception:  # a CPU-only build refuses; the attempt is what counts
            pass
        return False


class TouchesCudaRaw(StandIn):
    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        import torch

        return torch.cuda.current_device() >= 0  # raises on a CPU-only build


class Raises(StandIn):
    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        raise RuntimeError("registry not ready")


class NeedsBlockStride(StandIn):
    """Needs a block-outermost layout and has no paged path."""

    supports_paged_kv = False

    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        return True


class Blocking(StandIn):
    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        time.sleep(300)  # a declaration that blocks for minutes
        return False


# GOOD passes KV-L1, INT_FLAG fails it: the smallest run with both outcomes.
GOOD_AND_INT_FLAG: dict[str, type] = {"GOOD": Good, "INT_FLAG": IntFlag}
