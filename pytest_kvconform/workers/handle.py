"""The parent's end of one KV-A worker process: start it, message it, read its log, end it.

How a worker starts (forked from the fork server on CPU, spawned on a GPU) and why: the
pool's docstring (``pool.py``).  The pipe protocol and the child: ``protocol.py``,
``child.py``.  Each command carries the seeded fault it was sent under, counted in
``fault_tally.py``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import re
import signal
import sys
import threading
import time
import types
from collections.abc import Iterator, Sequence
from typing import Any

from pytest_kvconform.adapters import backend_calls
from pytest_kvconform.workers import budget, forkserver, worker_log
from pytest_kvconform.workers.child import _worker_main
from pytest_kvconform.workers.fault_tally import active_fault, count_faulted
from pytest_kvconform.workers.protocol import (
    COMMAND_TIMEOUT_S,
    LOAD_PLUGINS,
    STARTUP_TIMEOUT_S,
    WorkerCommandError,
    WorkerDied,
    WorkerOOM,
    WorkerTimeout,
    backend_note,
    child_device,
)

_STDERR_TAIL_CHARS = 4000


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
                asked = "an unknown number of bytes" if oom.get("asked") is None else \
                    f"{oom['asked']} bytes"
                caused_by = oom.get("caused_by")
                raise WorkerOOM(f"{self!r}: {what!r} ran out of memory on {self.device}"
                                f"{backend_note(caused_by)}: asked for {asked}, {oom['free']} "
                                f"bytes free ({reply.get('error')}); the worker dropped its "
                                "allocation", caused_by=caused_by)
            if not reply.get("ok"):
                raise WorkerCommandError(
                    f"{self!r}: {what!r} raised {reply.get('error')}\n"
                    f"--- worker traceback ---\n{reply.get('traceback', '')}",
                    reply.get("record"))
            return reply.get("result")
        if not ready:
            caused_by = self.backend_call()  # read before the kill: what it was doing
            self.kill()
            limit = budget.describe(timeout) if budgeted else f"{timeout:.1f}s"
            raise WorkerTimeout(f"{self!r} did not answer {what!r} within {limit}"
                                f"{backend_note(caused_by)} and was killed (the pool replaces "
                                f"it)\n--- worker stderr (tail) ---\n{self.stderr_tail()}",
                                caused_by=caused_by)
        raise self._died(f"during {what!r}")

    def backend_call(self) -> str | None:
        """The call into the backend's own code the worker was making, by its marker."""
        return backend_calls.read_marker(backend_calls.marker_path(self.stderr_path))

    def _died(self, when: str) -> WorkerDied:
        self.process.join(5)
        code = self.process.exitcode
        how = f"exit code {code}"
        if code is not None and code < 0:
            how += f", killed by {signal.Signals(-code).name}"
            if code == -signal.SIGKILL:
                how += " (the kernel's OOM killer, or someone else)"
        caused_by = self.backend_call()
        return WorkerDied(f"{self!r} died {when}{backend_note(caused_by)} ({how})\n"
                          f"--- worker stderr (tail) ---\n{self.stderr_tail()}",
                          caused_by=caused_by)

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
