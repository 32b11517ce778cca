"""Worker processes for the adoption clauses (KV-A): the pool and its handles (parent side).

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
  before collection (``KvWorkers.speculate``), so its imports overlap discovery.
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
closes it while the next deployment runs on another, ``SPARE_SETS``); a dead worker is
replaced on the next request, and the request that saw it die raises :class:`WorkerDied` carrying
the tail of its stderr.  A worker's stdout and stderr go to its log in the pool's
directory, never to the terminal; the run reports what is in them (``worker_log.py``).

Stdlib only at import (numpy, torch, pytest and ``compat`` are imported where used).

The pipe protocol, placement and process faults: ``protocol.py``; the child: ``child.py``.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import re
import shutil
import signal
import sys
import threading
import time
import types
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from pytest_kvconform.adapters import seeds
from pytest_kvconform.workers import budget, forkserver, lifetime, tempdirs, worker_log
from pytest_kvconform.workers.child import _worker_main
from pytest_kvconform.workers.devices import Unplaceable
from pytest_kvconform.workers.protocol import (
    COMMAND_TIMEOUT_S,
    GPU_PREFIX,
    LOAD_PLUGINS,
    PRELOAD,
    STARTUP_TIMEOUT_S,
    WorkerCommandError,
    WorkerDied,
    WorkerError,
    WorkerOOM,
    WorkerTimeout,
    child_device,
)

_STDERR_TAIL_CHARS = 4000
# Forked CPU workers per rank a placement may hold: one set runs a deployment while the
# others tear their last ones down (``WorkerHandle.release_later``).  A teardown is mostly
# waiting, and takes longer than a deployment, so with fewer sets the test process waits for
# teardowns.  A set is started only once every other is busy; each forked worker holds some
# memory of its own.
SPARE_SETS = 4


def active_fault() -> str | None:
    """The seeded worker fault ``$KVCONFORM_WORKER_FAULT`` names, or None; unknown ones raise.

    Validated here, not in the child, so a typo never runs as a silent no-fault
    run and a session can print (or refuse) the fault before any worker starts.
    """
    return seeds.active()


_faulted_commands: dict[str, int] = {}


def count_faulted(fault: str | None, commands: int = 1) -> None:
    """Count ``commands`` sent under ``fault`` (none: nothing to count)."""
    if fault is not None:
        _faulted_commands[fault] = _faulted_commands.get(fault, 0) + commands


def faulted_commands() -> dict[str, int]:
    """How many commands this process has sent its KV-A workers under each seeded fault.

    A check (a suite test, a ``check_backend`` run) whose counts moved drove its
    workers under that fault, and its result says so: it speaks for the fault.
    """
    return dict(_faulted_commands)


def faults_since(before: dict[str, int]) -> list[str]:
    """The seeded faults commands were sent under since ``before`` (a
    :func:`faulted_commands`), sorted."""
    return sorted(f for f, n in _faulted_commands.items() if n > before.get(f, 0))


def start_method(placement: str) -> str:
    """``forkserver`` for a CPU worker where a fork server can run; ``spawn`` otherwise.

    GPU workers are spawned: forking one from a process that imported torch and vLLM
    is only safe if nothing there initialised CUDA or cached a device count, which no
    host here can show (see the module docstring).
    """
    return "forkserver" if placement == "cpu" and forkserver.usable() else "spawn"


def server_preload(preload: Sequence[str]) -> tuple[str, ...]:
    """What the fork server imports for a pool preloading ``preload``: modules only."""
    return tuple(name for name in preload if name != LOAD_PLUGINS)


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


# --- parent side ---------------------------------------------------------------------


class WorkerHandle:
    """The parent's end of one worker process."""

    def __init__(self, key: tuple[str, int], *, preload: Sequence[str], workdir: str) -> None:
        self.key = key
        self.placement = key[0]
        self.device, self.gpu_id = child_device(self.placement)
        self.label = f"{re.sub(r'[^A-Za-z0-9_.-]', '_', self.placement)}-{key[1]}"
        self.stderr_path = os.path.join(workdir, f"worker-{self.label}.log")
        worker_log.watch(self.stderr_path, worker_log.worker_source(self.label))
        self.preload = tuple(preload)
        self.method = start_method(self.placement)
        if self.method == "forkserver" and not forkserver.start(server_preload(preload)):
            self.method = "spawn"  # no server here (another thread): spawn
        self.conn, child_conn = multiprocessing.Pipe(duplex=True)
        # The parent holds the lifeline's only write end: EOF in the child = parent gone.
        lifeline, self._lifeline = multiprocessing.Pipe(duplex=False)
        self._child_ends = (child_conn, lifeline)
        self.started = False
        self._server_log_at = 0  # the fork server's log size when this worker was forked
        self.killed = False
        self.ready = False
        self.info: dict[str, Any] = {}
        self._owed: list[str] = []  # commands sent whose replies are still to be read
        self._exit_asked = False
        self.process = self._make_process()
        if self.method == "spawn" or forkserver.is_ready():
            self._start()
        # else: forked at wait_ready, once the server's imports are done (bounded there)

    def _make_process(self) -> Any:
        """The worker's process object, for ``self.method``; not started."""
        child_conn, lifeline = self._child_ends
        environ: dict[str, str] | None = None
        if self.method == "forkserver":
            # The child's parent is the server (forked from its main thread): the death
            # signal always fires; the server's environment is replaced by this one.
            parent = (forkserver.pid() or -1, lifeline, True)
            environ = dict(os.environ)
        else:
            # A parent-death signal fires when the spawning *thread* exits: arm it only
            # for workers started from the main thread (the watchdog covers the rest).
            on_main = threading.current_thread() is threading.main_thread()
            parent = (os.getpid(), lifeline, on_main)
        context: Any = multiprocessing.get_context(self.method)
        return context.Process(
            target=_worker_main,
            args=(child_conn, self.device, self.stderr_path, self.preload, self.gpu_id,
                  parent, environ),
            name=f"kvconform-worker-{self.label}", daemon=True)

    def _start(self) -> None:
        if self.method == "forkserver":  # where its output goes until it opens its own log
            self._server_log_at = forkserver.log_size()
        with _caller_main_hidden():
            self.process.start()
        self.started = True
        for end in self._child_ends:
            end.close()

    def _start_forked(self, timeout: float) -> None:
        """Fork the worker once the server is ready (within ``timeout``); spawn if it died."""
        ready = forkserver.wait_ready(timeout)
        if ready is None:
            self.kill()
            forkserver.stop()  # stuck importing: every worker waiting on it would time out
            raise WorkerTimeout(
                f"{self!r} did not answer 'start-up' within {timeout:.1f}s and was killed "
                f"(the pool replaces it; the fork server was still importing)\n"
                f"--- fork server output (tail) ---\n{forkserver.log_tail()}")
        if not ready:  # the server died importing: spawn, so the worker reports why itself
            self.method = "spawn"
        self.process = self._make_process()  # now: the server it names is the one that forks
        self._start()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def alive(self) -> bool:
        """Running, or waiting for the fork server to fork it (not yet killed)."""
        if not self.started:
            return not self.killed
        return self.process.is_alive()

    def __repr__(self) -> str:
        return f"<worker {self.placement} slot {self.key[1]} pid {self.pid}>"

    # -- messaging --

    def launch(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Fork a worker still waiting for the fork server (bounded by ``timeout``)."""
        if not self.started:
            if self.killed:
                raise WorkerDied(f"{self!r} was closed before it started")
            self._start_forked(timeout)

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> dict[str, Any]:
        if not self.ready:
            self.launch(timeout)  # the fork server's imports, then the worker's own: each bounded
            self.info = self._receive("start-up", timeout, budgeted=False)
            self.ready = True
        return self.info

    def send(self, message: dict[str, Any]) -> None:
        """Send a command (counted in :func:`faulted_commands` under its seeded fault)."""
        self.wait_ready()
        self._settle(block=True)
        message = {**message, "fault": active_fault()}
        count_faulted(message["fault"])
        try:
            self.conn.send(message)
        except (BrokenPipeError, EOFError, OSError):
            raise self._died(f"while sending {message['cmd']!r}") from None

    def receive(self, what: str, timeout: float | None = None) -> Any:
        """The answer to ``what``, within ``timeout`` (default: the budget, else
        ``COMMAND_TIMEOUT_S``)."""
        return self._receive(what, budget.bound(COMMAND_TIMEOUT_S) if timeout is None
                             else timeout)

    def request(self, cmd: str, timeout: float | None = None, **fields: Any) -> Any:
        self.send({"cmd": cmd, **fields})
        return self.receive(cmd, timeout)

    def _receive(self, what: str, timeout: float, budgeted: bool = True) -> Any:
        try:
            ready = multiprocessing.connection.wait([self.conn, self.process.sentinel], timeout)
            reply = self.conn.recv() if self.conn in ready else None
        except (EOFError, OSError):
            raise self._died(f"during {what!r}") from None
        except BaseException:  # interrupted (Ctrl-C): its reply would come to the next request
            self.kill()
            raise
        if reply is not None:
            if reply.get("oom"):
                oom = reply["oom"]
                raise WorkerOOM(f"{self!r}: {what!r} ran out of memory on {self.device}: asked "
                                f"for {oom['asked']} bytes, {oom['free']} bytes free "
                                f"({reply.get('error')}); the worker dropped its allocation")
            if not reply.get("ok"):
                raise WorkerCommandError(
                    f"{self!r}: {what!r} raised {reply.get('error')}\n"
                    f"--- worker traceback ---\n{reply.get('traceback', '')}",
                    reply.get("record"))
            return reply.get("result")
        if not ready:
            self.kill()
            limit = budget.describe(timeout) if budgeted else f"{timeout:.1f}s"
            raise WorkerTimeout(f"{self!r} did not answer {what!r} within {limit} and was "
                                f"killed (the pool replaces "
                                f"it)\n--- worker stderr (tail) ---\n{self.stderr_tail()}")
        raise self._died(f"during {what!r}")

    def _died(self, when: str) -> WorkerDied:
        self.process.join(5)
        code = self.process.exitcode
        how = f"exit code {code}"
        if code is not None and code < 0:
            how += f", killed by {signal.Signals(-code).name}"
            if code == -signal.SIGKILL:
                how += " (the kernel's OOM killer, or someone else)"
        return WorkerDied(f"{self!r} died {when} ({how})\n"
                          f"--- worker stderr (tail) ---\n{self.stderr_tail()}")

    def stderr_tail(self, chars: int = _STDERR_TAIL_CHARS) -> str:
        """The end of the worker's log; before the worker opened it, what it printed first.

        Until ``_worker_main`` opens the log, a forked worker writes to the fork server's
        log (from where it was forked on) and a spawned one to this process's stderr.
        """
        try:
            with open(self.stderr_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - chars))
                return f.read().decode("utf-8", "replace")
        except OSError:
            pass
        if not self.started:
            return "(the worker never started)"
        early = "the worker died before it opened its own log (while multiprocessing " \
                "prepared it, or in its first steps)"
        if self.method == "forkserver":
            return f"({early}; what it printed, from the fork server's log:)\n" + \
                (forkserver.log_since(self._server_log_at, chars) or "(nothing)")
        return f"({early}; a spawned worker prints that on this process's stderr)"

    # -- commands --

    def ping(self) -> dict[str, Any]:
        return dict(self.request("ping"))

    def engine_run(self, spec: Any, *, control: str | None = None, prepin: str | None = None,
                   visible_devices: str | None = None) -> Any:
        """Run a whole deployment in this worker (``engine.Engine``); its report."""
        return self.request("engine_run", spec=spec, control=control, prepin=prepin,
                            visible_devices=visible_devices)

    def engine_call(self, method: str, rank: int, *args: Any) -> Any:
        """An observation of rank ``rank`` of the deployment this worker runs."""
        return self.request("engine_call", method=method, rank=rank, args=list(args))

    def send_rpc(self, frames: Sequence[bytes]) -> None:
        """Hand this rank the executor's RPC frames (the reply: :meth:`receive`)."""
        self.send({"cmd": "rank_rpc", "frames": list(frames)})

    def free_memory(self) -> int | None:
        return self.request("free_memory")

    def release(self) -> None:
        """Close what the worker ran (and, on CUDA, return its memory to the driver)."""
        self.request("release")

    @property
    def defers_release(self) -> bool:
        """Whether :meth:`release_later` applies: a forked CPU worker.

        Its release is production's deployment teardown (``DiffusionWorker.shutdown``),
        mostly gloo process groups waiting on their own transport's clock; nothing a later
        check measures depends on it.  A GPU worker's release
        returns device memory the next check may measure, so it is waited for.
        """
        return self.method == "forkserver" and not self.device.startswith("cuda")

    def release_later(self) -> None:
        """Start :meth:`release` without waiting: its reply is read before this worker's
        next command, and meanwhile the pool hands the next deployment other workers
        (:meth:`WorkerPool.get`).  Its teardown's own failure is not the next check's."""
        self.send({"cmd": "release"})
        self._owed.append("release")

    @property
    def busy(self) -> bool:
        """Still closing a deployment released with :meth:`release_later`."""
        self._settle(block=False)
        return bool(self._owed)

    def _settle(self, *, block: bool) -> None:
        """Read the replies owed to :meth:`release_later` (those already there, or all).

        A teardown that raised is left at that (the next deployment starts with its own
        release); a worker that died or hung in it is killed and replaced on the pool's
        next request, as any dead or hung worker is.
        """
        while self._owed and (block or self.conn.poll()):
            what = self._owed.pop(0)
            with contextlib.suppress(WorkerCommandError, WorkerDied, WorkerTimeout):
                self._receive(what, budget.bound(COMMAND_TIMEOUT_S))
            if not self.alive:
                self._owed.clear()

    def settle(self, deadline: float) -> None:
        """Read the replies owed to :meth:`release_later` that come before ``deadline`` (a
        ``time.monotonic()``); never kills: one still due is read before the next command."""
        while self._owed and self.alive and self.started and \
                self.conn.poll(max(0.0, deadline - time.monotonic())):
            self._settle(block=False)

    def ask_to_exit(self) -> None:
        """Tell the worker to exit, without waiting (:meth:`close` waits)."""
        if self.alive and self.ready and not self._exit_asked:
            self._exit_asked = True
            with contextlib.suppress(Exception):
                self.conn.send({"cmd": "shutdown"})

    def close(self, timeout: float = 5.0) -> None:
        """Ask the worker to exit; terminate, then kill, if it does not."""
        if not self.started:
            for end in self._child_ends:
                end.close()
        if self.alive and self.ready:
            self.ask_to_exit()
            self.process.join(timeout)
        self.kill()
        self.conn.close()
        self._lifeline.close()

    def kill(self) -> None:
        self.killed = True
        if not self.started:
            return
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(2)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(2)


@contextlib.contextmanager
def _caller_main_hidden() -> Iterator[None]:
    """Start a worker without multiprocessing re-running the caller's main module in it.

    A spawned or forkserver child imports its parent's ``__main__`` (as ``__mp_main__``)
    before its target runs, so a script calling ``check_backend`` at module level,
    without an ``if __name__ == "__main__":`` guard, would call it again in every
    worker, and the worker would die at start-up.  A worker's target and arguments all
    come from this package: its child never needs the caller's main module.
    """
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")  # no __file__, no __spec__
    try:
        yield
    finally:
        if main is None:
            sys.modules.pop("__main__", None)
        else:
            sys.modules["__main__"] = main


class WorkerPool:
    """Workers keyed by (placement, slot): slot i is the i-th rank placed there.

    A placement is ``"cpu"``, ``"gpu:<CUDA_VISIBLE_DEVICES id>"`` or a torch
    device string (see :func:`child_device`).
    """

    def __init__(self, preload: Sequence[str] = PRELOAD) -> None:
        self.preload = tuple(preload)
        self.workdir = tempdirs.make("workers")  # in the run's directory (tempdirs.py)
        self.workers: dict[tuple[str, int], WorkerHandle] = {}
        self.replaced = 0
        self._widest: dict[str, int] = {}  # the most ranks a deployment placed there
        self._server_held = False  # this pool counts as a user of the fork server

    @staticmethod
    def keys(devices: Sequence[str]) -> list[tuple[str, int]]:
        seen: dict[str, int] = {}
        keys = []
        for device in devices:
            keys.append((device, seen.get(device, 0)))
            seen[device] = seen.get(device, 0) + 1
        return keys

    def prestart(self, devices: Sequence[str]) -> None:
        """Start the workers for ``devices`` without waiting (their imports overlap), and
        forked ones a spare set for the deployment after."""
        keys = self.keys(devices)
        self._prestart(keys)
        self._start_spare(devices, keys)

    def _prestart(self, keys: Sequence[tuple[str, int]]) -> None:
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
        return handles

    def _start_spare(self, devices: Sequence[str], taken: Sequence[tuple[str, int]]) -> None:
        """Start one more set of forked workers for ``devices`` if the next deployment would
        find none idle (each other set still tears a deployment down, or there is none).

        It starts up while the deployment on ``taken`` runs, so the next one does not wait
        for a worker's start; at most ``SPARE_SETS`` sets (:meth:`_idle_keys`)."""
        if not all(start_method(d) == "forkserver" for d in devices):
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

    def _idle_keys(self, devices: Sequence[str],
                   exclude: Sequence[tuple[str, int]] = ()) -> list[tuple[str, int]]:
        """:meth:`keys`, except that where a worker is still closing its last deployment
        (:attr:`WorkerHandle.busy`) another takes its rank: up to ``SPARE_SETS`` workers
        per rank of a placement whose workers defer their release, so some sets tear
        deployments down while the next deployment runs on another.  Idle workers that
        have started come first, then idle ones still starting, then slots not yet used;
        ``exclude`` are taken already."""
        keys = self.keys(devices)
        chosen: list[tuple[str, int]] = []
        for placement, slot in keys:
            count = sum(1 for d in devices if d == placement)
            self._widest[placement] = max(count, self._widest.get(placement, 0))
            slots = range(SPARE_SETS * self._widest[placement]) \
                if start_method(placement) == "forkserver" else range(slot, slot + 1)
            free = [(placement, s) for s in slots
                    if (placement, s) not in chosen and (placement, s) not in exclude]
            idle = [k for k in free if k not in self.workers or not self.workers[k].busy]
            idle.sort(key=lambda k: (k not in self.workers, not self._is_ready(k)))
            chosen.append((idle or free)[0])
        return chosen

    def _is_ready(self, key: tuple[str, int]) -> bool:
        handle = self.workers.get(key)
        return handle is not None and handle.ready

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


# Workers started before collection on the guess that KV-A tests will be selected.
_speculative: set[tuple[str, int]] = set()


def drop_speculative(keep: Iterable[tuple[str, int]] = ()) -> int:
    """After collection: close the speculatively started workers not in ``keep``.

    Returns how many were closed.  Only workers this module started on speculation
    are touched, never ones a pytester-hosting session is using.
    """
    keys = set(_speculative) - set(keep)
    _speculative.clear()
    closed = 0
    workers = _pool.workers if _pool is not None else {}
    for key in keys:
        handle = workers.pop(key, None)
        if handle is not None:
            handle.close()
            closed += 1
    return closed


class KvWorkers:
    """``kv_workers(n)``: n pooled worker processes, one per device, rank order.

    Each deployment starts from its workers' own fresh, unpinned configs.
    ``for_world_size(n)`` returns :class:`Unplaceable` (the reason) instead of skipping.
    """

    def __init__(self, device: str, gpu_ids: list[str]) -> None:
        self.device = device
        self.gpu_ids = gpu_ids

    def for_world_size(self, n: int) -> list[WorkerHandle] | Unplaceable:
        placements = rank_placements(n, self.device, self.gpu_ids)
        return placements if isinstance(placements, Unplaceable) else pool().get(placements)

    def prestart(self, n: int) -> None:
        """Start up to n workers now, so their imports overlap other work."""
        for size in range(n, 0, -1):
            placements = rank_placements(size, self.device, self.gpu_ids)
            if not isinstance(placements, Unplaceable):
                pool().prestart(placements)
                return

    def speculate(self, n: int) -> None:
        """Before collection: start what n ranks' workers need, while this process imports
        and discovers.

        For CPU workers that is the fork server alone (its imports are the cost; the
        workers fork from it after collection, in under a second each).  GPU workers are
        spawned now, and dropped again by :func:`drop_speculative` if no selected test
        uses them.  On a host with a spare core this costs no wall time.
        """
        placements = rank_placements(n, self.device, self.gpu_ids)
        if not isinstance(placements, Unplaceable) and pool().warm(placements):
            return
        before = set(pool().workers)
        self.prestart(n)
        _speculative.update(set(pool().workers) - before)

    def settle(self, n: int) -> int:
        """After collection: the selected tests need up to n ranks (0: none).

        Keeps the speculative workers those ranks use, closes the others, and
        starts the rest now (their imports overlap the tests before KV-A; forked
        workers fork once the fork server is ready, at the latest when first used).
        With none needed, a fork server started on speculation is stopped.  Returns
        how many speculative workers were closed.
        """
        placements = rank_placements(n, self.device, self.gpu_ids) if n else []
        keep = pool().keys(placements) if not isinstance(placements, Unplaceable) else []
        closed = drop_speculative(keep)
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


