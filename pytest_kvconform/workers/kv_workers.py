"""``kv_workers(n)``, the fixture the KV-A checks get: n pooled workers, one per rank.

It asks the shared pool (``pool.py``) for workers where the pool's policy places them, and
before collection starts what the run will likely need (``speculate``) while this process
imports and discovers.  pytest is imported only to skip a test that cannot be placed.
"""

from __future__ import annotations

from pytest_kvconform.workers.devices import Unplaceable
from pytest_kvconform.workers.handle import WorkerHandle
from pytest_kvconform.workers.pool import pool


class KvWorkers:
    """``kv_workers(n)``: n pooled worker processes, one per device, rank order.

    Each deployment starts from its workers' own fresh, unpinned configs.
    ``for_world_size(n)`` returns :class:`Unplaceable` (the reason) instead of skipping.
    """

    def __init__(self, device: str, gpu_ids: list[str]) -> None:
        self.device = device
        self.gpu_ids = gpu_ids

    def for_world_size(self, n: int) -> list[WorkerHandle] | Unplaceable:
        placements = pool().policy.placements(n, self.device, self.gpu_ids)
        return placements if isinstance(placements, Unplaceable) else pool().get(placements)

    def prestart(self, n: int) -> None:
        """Start up to n workers now, so their imports overlap other work."""
        for size in range(n, 0, -1):
            placements = pool().policy.placements(size, self.device, self.gpu_ids)
            if not isinstance(placements, Unplaceable):
                pool().prestart(placements)
                return

    def speculate(self, n: int) -> None:
        """Before collection: start what n ranks' workers need, while this process imports
        and discovers.

        For CPU workers that is the fork server alone (its imports are the cost; the
        workers fork from it after collection, in under a second each).  GPU workers are
        spawned now, and dropped again by ``WorkerPool.drop_speculative`` if no selected test
        uses them.  On a host with a spare core this costs no wall time.
        """
        placements = pool().policy.placements(n, self.device, self.gpu_ids)
        if not isinstance(placements, Unplaceable) and pool().warm(placements):
            return
        before = set(pool().workers)
        self.prestart(n)
        pool().speculative.update(set(pool().workers) - before)

    def settle(self, n: int) -> int:
        """After collection: the selected tests need up to n ranks (0: none).

        Keeps the speculative workers those ranks use, closes the others, and
        starts the rest now (their imports overlap the tests before KV-A; forked
        workers fork once the fork server is ready, at the latest when first used).
        With none needed, a fork server started on speculation is stopped.  Returns
        how many speculative workers were closed.
        """
        placements = pool().policy.placements(n, self.device, self.gpu_ids) if n else []
        keep = pool().keys(placements) if not isinstance(placements, Unplaceable) else []
        closed = pool().drop_speculative(keep)
        if n:
            self.prestart(n)
        else:
            pool().cool()
        return closed

    def __call__(self, n: int = 1) -> list[WorkerHandle]:
        import pytest

        handles = self.for_world_size(n)
        if isinstance(handles, Unplaceable):
            pytest.skip(handles.reason)
        return handles
