"""Worker processes for the adoption clauses (KV-A): the pool of them (parent side).

A KV-A worker process hosts production's side of a deployment (``adapters/engine.py``):
either the whole engine (control plane, executor, diffusion worker: production's
uniproc topology, or a multiproc executor that spawns its own worker processes),
or one rank's worker when the control plane runs in the test process
(``workers/deployment.py``).  Nothing pinned in the test process leaks into it: its configs
start unpinned, and a rank's configs cross the process boundary as the executor's
frames.  Importing vLLM / vllm-omni takes seconds (benchmarks/RESULTS.md, "KV-A
workers"), so:

- a CPU worker is forked from a fork server (``workers/forkserver.py``, multiprocessing's
  ``forkserver`` method) that imported the preload once: a worker starts with a fork, not
  an import.  The server only imports; each worker still loads the
  plugins, sets its stderr and ties itself to the test process itself, and gets the
  test process's environment at start (not the server's).  The server is started
  before collection (``kv_workers.KvWorkers.speculate``), so its imports overlap discovery.
  Under xdist the controller starts that server and its workers attach to it
  (``forkserver.share`` / ``attach``): one import for the server of the whole run.
  Both the server and a spawned worker freeze the imports' objects out of the
  garbage collector's reach (``gc.freeze``): production's model loading collects
  several times per deployment, which would otherwise walk ~900,000 objects each.
- a GPU worker (``gpu:<id>`` or a torch device string) is spawned, as vllm-omni's
  multiproc executor starts its workers: it pins ``CUDA_VISIBLE_DEVICES`` before
  anything imports torch.  Forking it from a server that imported torch and vLLM
  would only be safe if those imports never initialised CUDA nor cached a device
  count, which no GPU-less host can show; a forked worker refuses to run if torch's
  CUDA is already initialised in it.

Workers are pooled per (device, slot) and reused for the whole session (each
deployment is closed before the next starts on the same worker; a forked CPU worker
closes it while the next deployment runs on another: the spare sets of ``policy.py``); a
dead worker is replaced on the next request, and the request that saw it die raises
:class:`WorkerDied` carrying the tail of its stderr.  A worker's stdout and stderr go to
its log in the pool's directory, never to the terminal; the run reports what is in them
(``worker_log.py``).

Stdlib only at import (numpy, torch, pytest and ``compat`` are imported where used).

The pool keeps processes; what it decides (where ranks go, which slot each takes, when a
spare set starts) is the :class:`~pytest_kvconform.workers.policy.PoolPolicy` it is handed.
One process: ``handle.py``; the pipe protocol: ``protocol.py``; the child: ``child.py``;
the fixture the checks get: ``kv_workers.py``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import time
from collections.abc import Iterable, Sequence
from typing import Any

from pytest_kvconform.workers import forkserver, lifetime, tempdirs
from pytest_kvconform.workers.handle import WorkerHandle, server_preload, start_method
from pytest_kvconform.workers.policy import Key, PoolPolicy, keys
from pytest_kvconform.workers.protocol import PRELOAD, WorkerError


class WorkerPool:
    """Workers keyed by (placement, slot): slot i is the i-th rank placed there.

    A placement is ``"cpu"``, ``"gpu:<CUDA_VISIBLE_DEVICES id>"`` or a torch
    device string (see :func:`child_device`).
    """

    def __init__(self, preload: Sequence[str] = PRELOAD, policy: PoolPolicy | None = None) -> None:
        self.preload = tuple(preload)
        self.policy = policy or PoolPolicy()
        self.workdir = tempdirs.make("workers")  # in the run's directory (tempdirs.py)
        self.workers: dict[Key, WorkerHandle] = {}
        self.replaced = 0
        # Started before collection on the guess that KV-A tests will be selected.
        self.speculative: set[Key] = set()
        self._server_held = False  # this pool counts as a user of the fork server
        # Workers handed to checks, and the production entry point the last of them said
        # it runs (their start-up report): a run's account of the path KV-A took.
        self.handed_out = 0
        self.entry_point: dict[str, Any] | None = None

    @staticmethod
    def keys(devices: Sequence[str]) -> list[Key]:
        return keys(devices)

    def prestart(self, devices: Sequence[str]) -> None:
        """Start the workers for ``devices`` without waiting (their imports overlap), and
        forked ones a spare set for the deployment after."""
        keys = self.keys(devices)
        self._prestart(keys)
        self._start_spare(devices, keys)

    def _prestart(self, keys: Sequence[Key]) -> None:
        for key in keys:
            handle = self.workers.get(key)
            if handle is None or not handle.alive:
                if handle is not None:
                    handle.close()
                    self.replaced += 1
                self.workers[key] = WorkerHandle(key, preload=self.preload, workdir=self.workdir)
                if self.workers[key].method == "forkserver":
                    self._hold_server()

    def warm(self, devices: Sequence[str]) -> bool:
        """Start the fork server the workers for ``devices`` would fork from, none of them.

        Its imports then overlap whatever this process does next; False when those
        workers would be spawned (or no server can start here).
        """
        if not all(start_method(device) == "forkserver" for device in devices) or \
                not forkserver.start(server_preload(self.preload)):
            return False
        self._hold_server()
        return True

    def cool(self) -> None:
        """Stop using the fork server if no worker of this pool is left (it may stop)."""
        if self._server_held and not self.workers:
            self._server_held = False
            forkserver.release()

    def _hold_server(self) -> None:
        if not self._server_held:
            self._server_held = True
            forkserver.acquire()

    def get(self, devices: Sequence[str]) -> list[WorkerHandle]:
        """One ready worker per entry of ``devices`` (rank order); dead ones are replaced."""
        keys = self._idle_keys(devices)
        self._prestart(keys)
        handles = [self.workers[key] for key in keys]
        for handle in handles:  # all forked before any is waited for: they start together
            handle.launch()
        self._start_spare(devices, keys)
        for handle in handles:
            handle.wait_ready()
        self.handed_out += len(handles)
        self.entry_point = handles[0].info.get("entry_point") or self.entry_point
        return handles

    def _start_spare(self, devices: Sequence[str], taken: Sequence[Key]) -> None:
        """Start one more set of forked workers for ``devices`` if the next deployment would
        find none idle (each other set still tears a deployment down, or there is none).

        It starts up while the deployment on ``taken`` runs, so the next one does not wait
        for a worker's start; at most the policy's ``spare_sets``."""
        if not self.policy.spares(devices):
            return
        spare = self._idle_keys(devices, exclude=taken)
        if any(key in self.workers for key in spare):
            return  # an existing set is idle, or the placement is at SPARE_SETS
        self._prestart(spare)

    def launch_pending(self) -> int:
        """Fork the workers started before the fork server was ready, now that it is
        (without waiting); how many.  Called between tests, so their start-up overlaps
        the tests that need no worker."""
        if not forkserver.is_ready():
            return 0
        pending = [h for h in self.workers.values() if not h.started and not h.killed]
        for handle in pending:
            # One that cannot start now fails again when a test asks for it, in that test.
            with contextlib.suppress(WorkerError, OSError):
                handle.launch()
        return len(pending)

    def _idle_keys(self, devices: Sequence[str], exclude: Sequence[Key] = ()) -> list[Key]:
        """The slots the policy picks for ``devices`` (:meth:`PoolPolicy.choose`)."""
        return self.policy.choose(devices, self.workers, exclude)

    def drop_speculative(self, keep: Iterable[Key] = ()) -> int:
        """After collection: close the speculatively started workers not in ``keep``.

        Returns how many were closed.  Only workers started on speculation are touched,
        never ones a pytester-hosting session is using.
        """
        dropped = self.speculative - set(keep)
        self.speculative.clear()
        closed = 0
        for key in dropped:
            handle = self.workers.pop(key, None)
            if handle is not None:
                handle.close()
                closed += 1
        return closed

    def settle(self, timeout: float) -> None:
        """Wait up to ``timeout`` in all for the deployments the workers still tear down: what
        they print doing so is then in their logs when the run reads them (``worker_log.py``)."""
        deadline = time.monotonic() + timeout
        for handle in list(self.workers.values()):
            handle.settle(deadline)

    def close(self) -> None:
        handles = list(self.workers.values())
        for handle in handles:  # all at once: each tears its last deployment down
            handle.ask_to_exit()
        for handle in handles:
            handle.close()
        self.workers.clear()
        self.cool()  # after its workers: they die with the server
        shutil.rmtree(self.workdir, ignore_errors=True)


# A session-wide pool shared by every --kv-conformance session in this process (pytester
# runs them inline); closed when the last holder releases it, or at exit.
_pool: WorkerPool | None = None
_holders = lifetime.Holders(lambda: close_pool())


def pool() -> WorkerPool:
    global _pool
    if _pool is None:
        _pool = WorkerPool()
    return _pool


def hold() -> None:
    """Keep the shared pool open until the matching :func:`release`."""
    _holders.hold()


def release() -> None:
    """Drop one hold; the last one closes the shared pool (no orphan workers)."""
    _holders.release()


def settle(timeout: float) -> None:
    """:meth:`WorkerPool.settle` of the shared pool, if there is one."""
    if _pool is not None:
        _pool.settle(timeout)


def handed_out() -> tuple[int, dict[str, Any] | None]:
    """How many workers the shared pool handed to checks, and the entry point the last of
    them reported (``child.py``'s start-up reply; None where no stack is preloaded)."""
    return (_pool.handed_out, _pool.entry_point) if _pool is not None else (0, None)


def launch_pending() -> int:
    """:meth:`WorkerPool.launch_pending` of the shared pool, if there is one."""
    return _pool.launch_pending() if _pool is not None else 0


def close_pool() -> None:
    global _pool
    if _pool is not None:
        _pool.close()
        _pool = None


atexit.register(close_pool)


def kill_all() -> None:
    """SIGKILL every pooled worker at once, without waiting: for a process about to vanish."""
    for handle in list(_pool.workers.values()) if _pool is not None else []:
        if handle.pid is not None:
            with contextlib.suppress(OSError):
                os.kill(handle.pid, signal.SIGKILL)
    server = forkserver.pid()  # its own death signal would follow us anyway
    if server is not None and not forkserver.attached():  # an attached one is not ours
        with contextlib.suppress(OSError):
            os.kill(server, signal.SIGKILL)


def exit_with_parent() -> None:
    """In an xdist worker: exit (killing our workers) once the controller is gone.

    An xdist worker busy in a test does not notice its controller's death by
    itself; this watchdog does, within ``lifetime.POLL_S``.
    """
    lifetime.watch_parent(os.getppid(), on_orphan=kill_all)
