"""Tie a child process's life to its parent's: no process outlives the run that started it.

Stdlib only.  Two mechanisms, because each alone has a gap:

- ``PR_SET_PDEATHSIG`` (Linux, through ``prctl``): the kernel sends the child a signal
  when its parent dies, however it dies (SIGKILL included).  It fires when the parent
  *thread* that created the child exits, so it is only armed for children started
  from the parent's main thread; and a parent that died before the child armed it
  is caught by comparing ``getppid()`` with the expected parent right after.
- a watchdog thread that notices the parent is gone: EOF on a lifeline pipe whose
  only write end the parent holds, or a changed ``getppid()`` (the child was
  re-parented).  It works on any POSIX host and covers the thread caveat above.

``atexit`` alone is not enough: it never runs when the parent is killed.

SIGTERM's default ends a process without ``atexit`` or ``finally`` either, so a
``--kv-conformance`` run turns it into Ctrl-C's unwinding, and keeps a signal during its
end from ending it with another status than its report's (:class:`RunSignals`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

PR_SET_PDEATHSIG = 1
EXIT_ORPHANED = 70  # the exit code of a child whose parent went away
POLL_S = 0.25


_libc: list[Any] = []  # the C library, opened once


def c_library() -> Any:
    """The C library, opened once per process (a parent opens it before it forks, so its
    child never takes the dynamic loader's lock another thread may have held); None where
    it cannot be opened."""
    if not _libc:
        try:
            _libc.append(ctypes.CDLL(None, use_errno=True))
        except OSError:
            _libc.append(None)
    return _libc[0]


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` when the parent dies; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return int(c_library().prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _orphaned(on_orphan: Callable[[], None] | None) -> None:
    if on_orphan is not None:
        try:
            on_orphan()
        except BaseException:  # exiting regardless is the point
            pass
    os._exit(EXIT_ORPHANED)


def watch_parent(parent_pid: int, lifeline: Any = None,
                 on_orphan: Callable[[], None] | None = None) -> threading.Thread:
    """Start a daemon thread that exits this process once ``parent_pid`` is gone.

    ``lifeline`` is an optional read end of a ``multiprocessing`` pipe (the parent
    keeps the only write end and never writes): EOF on it means the parent died.
    ``on_orphan`` runs first (e.g. to kill this process's own children).
    """

    def watch() -> None:
        while True:
            if lifeline is not None:
                try:
                    if lifeline.poll(POLL_S):
                        lifeline.recv_bytes()
                except (EOFError, OSError):
                    _orphaned(on_orphan)
            else:
                threading.Event().wait(POLL_S)
            if os.getppid() != parent_pid:
                _orphaned(on_orphan)

    thread = threading.Thread(target=watch, name="kvconform-parent-watchdog", daemon=True)
    thread.start()
    return thread


def tie_to_parent(parent_pid: int, lifeline: Any = None, *, death_signal: bool = True,
                  on_orphan: Callable[[], None] | None = None) -> None:
    """Both mechanisms, armed now; exits at once if the parent is already gone."""
    if death_signal:
        set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:  # died before the death signal was armed
        _orphaned(on_orphan)
    watch_parent(parent_pid, lifeline, on_orphan)


class Terminated(KeyboardInterrupt):
    """SIGTERM, unwound as Ctrl-C is: pytest ends the run as interrupted (summary, verdict,
    report), the pools and the fork server close, ``atexit`` removes the temporary files."""


EXIT_INTERRUPTED = 2  # pytest's own status for an interrupted run


class RunSignals:
    """SIGTERM and SIGINT across one run, from the plugin's first hook to the exit.

    - **Running**: the first signal unwinds the run as Ctrl-C does (SIGTERM raises
      :class:`Terminated`): the summary, the ``interrupted`` verdict and its report, exit
      status 2.  Another signal while that unwinds ends the process at once with status 2
      (the report of the unfinished run is not written; no traceback is printed).
    - **Finishing** (:meth:`finishing`, from the first ``pytest_sessionfinish`` hook on):
      the run is concluding with what ran, so a first signal is noted on stderr and the
      run ends with its own status, agreeing with its report; another one ends the process
      at once, with that status once it is :meth:`settle`-d (the report is on disk), else 2.
    - **Ended** (:meth:`undo`): the handlers before the run come back, when the run is
      embedded (pytester's inline runs, ``pytest.main`` in a program that goes on); a run
      that owns its process (``pytest`` on the command line) keeps them up to its exit, so
      nothing from the summary to the interpreter's last step ends with another status.

    Only over the default dispositions (SIGTERM's default, Python's SIGINT handler): a signal
    ignored by whoever started us (``cmd &`` starts its command with SIGINT ignored), or
    handled by the program that embeds pytest, stays theirs.  Installed from the main thread
    only (a signal handler can be set nowhere else).
    """

    def __init__(self, *, sigint: bool = True) -> None:
        self.sigint = sigint  # take SIGINT too (else SIGTERM alone)
        self.phase = "running"
        self.seen = 0  # signals received so far
        self.settled: int | None = None  # the exit status the report agrees with
        self.previous: dict[int, Any] = {}

    def install(self) -> bool:
        """Take SIGTERM and SIGINT where they have their defaults; whether any was taken."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig, default in ((signal.SIGTERM, signal.SIG_DFL),
                             (signal.SIGINT, signal.default_int_handler)):
            if (sig == signal.SIGTERM or self.sigint) and signal.getsignal(sig) is default:
                self.previous[sig] = default
                signal.signal(sig, self._handle)
        return bool(self.previous)

    def finishing(self) -> None:
        """The run concludes from here on (its verdict, report, summary, clean-up)."""
        self.phase = "finishing"

    def settle(self, status: int) -> None:
        """The exit status the run ends with, and its report (if any) agrees with."""
        self.settled = int(status)

    def undo(self) -> None:
        """The handlers before the run, for those still ours."""
        for sig, previous in self.previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous)
        self.previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        self.seen += 1
        if self.phase == "running":
            self.phase = "unwinding"
            if signum == signal.SIGTERM:
                raise Terminated("SIGTERM: the run was terminated")
            raise KeyboardInterrupt
        if self.phase == "finishing" and self.seen == 1:
            _say(f"kvconform: {name} while the run was finishing: it ends with its own exit "
                 "status, which its report agrees with (another signal ends it at once)")
            return
        status = self.settled if self.phase == "finishing" and self.settled is not None \
            else EXIT_INTERRUPTED
        _say(f"kvconform: {name} again: exiting at once with status {status}"
             + ("" if status != EXIT_INTERRUPTED or self.settled is not None else
                ", without this run's report"))
        os._exit(status)


def _say(line: str) -> None:
    """One line on stderr, safe in a signal handler (no buffered stream, no lock)."""
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode())


def terminate_as_interrupt() -> Callable[[], None] | None:
    """SIGTERM unwound as Ctrl-C is (:class:`RunSignals`' running phase; SIGINT left to
    Python); returns the undo (None where SIGTERM did not have its default)."""
    signals = RunSignals(sigint=False)
    return signals.undo if signals.install() else None


def owns_process(args: Any) -> bool:
    """Whether a pytest run with these arguments is the process's own (``pytest ARGS`` or
    ``python -m pytest ARGS``), not one embedded in a program that goes on after it."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    entry = getattr(spec, "name", None) == "pytest.__main__" or \
        getattr(getattr(main, "console_main", None), "__module__", "").startswith(
            ("pytest", "_pytest"))
    return entry and tuple(str(a) for a in args) == tuple(sys.argv[1:])


class Holders:
    """Users of a shared resource (the worker pool, the fork server): the last release closes it.

    A count, not a set: pytester's inline sessions hold the pool inside the outer session.
    """

    def __init__(self, close: Callable[[], None]) -> None:
        self.count = 0
        self._close = close

    def hold(self) -> None:
        self.count += 1

    def release(self) -> None:
        self.count = max(0, self.count - 1)
        if self.count == 0:
            self._close()
