"""The pool's policies, handed to it as one object: where ranks go and which slots they take.

Placement (:func:`rank_placements`: this process's GPU first, a distinct CUDA id per rank)
and spare sets (:attr:`PoolPolicy.spare_sets`: how many forked worker sets a rank may
hold, so one set runs a deployment while others tear theirs down) are decisions; the pool
(``pool.py``) only keeps the processes they choose.  As xdist hands its ``Scheduling`` to
the session, the pool is handed its policy, so a test or a GPU host may hand another.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pytest_kvconform.workers.devices import Unplaceable
from pytest_kvconform.workers.handle import start_method
from pytest_kvconform.workers.protocol import GPU_PREFIX

Key = tuple[str, int]  # (placement, slot)

# Forked CPU workers per rank a placement may hold: one set runs a deployment while the
# others tear their last ones down (``WorkerHandle.release_later``).  A teardown is mostly
# waiting, and takes longer than a deployment, so with fewer sets the test process waits for
# teardowns.  A set is started only once every other is busy; each forked worker holds some
# memory of its own.
SPARE_SETS = 4


def rank_placements(n: int, device: str, gpu_ids: Sequence[str],
                    environ: dict[str, str] | None = None) -> list[str] | Unplaceable:
    """Where each of ``n`` ranks runs, this process's GPU first; or why they cannot be placed.

    ``gpu_ids`` are the ids the session may use (``CUDA_VISIBLE_DEVICES`` entries
    as the controller sees them); this process's own GPU is read from its
    (possibly xdist-narrowed) ``CUDA_VISIBLE_DEVICES``.  Each CUDA rank gets a
    distinct id; when this process's id cannot be told, the devices fall back to
    torch device strings that inherit this environment.
    """
    from pytest_kvconform.workers import devices

    chosen = devices.devices_for_world_size(n, device, list(gpu_ids))
    if isinstance(chosen, Unplaceable) or device == "cpu":
        return chosen
    env = os.environ if environ is None else environ
    visible = devices.visible_gpu_ids(env, lambda: len(gpu_ids))
    index = int(device.partition(":")[2] or 0)
    if index >= len(visible):
        return chosen
    own = visible[index]
    ids = [own, *(g for g in gpu_ids if g != own)][:n]
    if len(ids) < n:
        return Unplaceable(f"needs {n} CUDA devices, {len(ids)} distinct visible")
    return [f"{GPU_PREFIX}{g}" for g in ids]


class _Slot(Protocol):
    """What the policy reads of a pooled worker."""

    @property
    def busy(self) -> bool: ...

    @property
    def ready(self) -> bool: ...


def keys(devices: Sequence[str]) -> list[Key]:
    """Slot i of a placement for its i-th rank there: the keys ``devices`` name first."""
    seen: dict[str, int] = {}
    out = []
    for device in devices:
        out.append((device, seen.get(device, 0)))
        seen[device] = seen.get(device, 0) + 1
    return out


@dataclass
class PoolPolicy:
    """Placement and spare sets, for one pool (it remembers each placement's widest use)."""

    spare_sets: int = SPARE_SETS
    widest: dict[str, int] = field(default_factory=dict)  # the most ranks placed there

    def placements(self, n: int, device: str, gpu_ids: Sequence[str],
                   environ: dict[str, str] | None = None) -> list[str] | Unplaceable:
        """Where each of ``n`` ranks runs (:func:`rank_placements`)."""
        return rank_placements(n, device, gpu_ids, environ)

    def spares(self, devices: Sequence[str]) -> bool:
        """Whether ``devices`` get spare sets: forked workers defer their teardown, a
        spawned set is the only one of its placement."""
        return all(start_method(d) == "forkserver" for d in devices)

    def choose(self, devices: Sequence[str], workers: Mapping[Key, _Slot],
               exclude: Sequence[Key] = ()) -> list[Key]:
        """The slot each rank of ``devices`` takes: :func:`keys`, except that where a worker
        is still closing its last deployment (``busy``) another takes its rank, up to
        :attr:`spare_sets` workers per rank of a placement whose workers defer their
        release.  Idle workers that have started come first, then idle ones still
        starting, then slots not yet used; ``exclude`` are taken already."""
        chosen: list[Key] = []
        for placement, slot in keys(devices):
            count = sum(1 for d in devices if d == placement)
            self.widest[placement] = max(count, self.widest.get(placement, 0))
            slots = range(self.spare_sets * self.widest[placement]) \
                if start_method(placement) == "forkserver" else range(slot, slot + 1)
            free = [(placement, s) for s in slots
                    if (placement, s) not in chosen and (placement, s) not in exclude]
            idle = [k for k in free if k not in workers or not workers[k].busy]
            idle.sort(key=lambda k: (k not in workers, not (k in workers and workers[k].ready)))
            chosen.append((idle or free)[0])
        return chosen
