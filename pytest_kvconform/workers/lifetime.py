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
``--kv-conformance`` run turns it into Ctrl-C's unwinding (:func:`terminate_as_interrupt`).
"""

from __future__ import annotations

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


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` when the parent dies; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
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


def _on_sigterm(signum: int, frame: Any) -> None:
    # A second SIGTERM while the first one unwinds kills at once, as it did before.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise Terminated("SIGTERM: the run was terminated")


def terminate_as_interrupt() -> Callable[[], None] | None:
    """Make SIGTERM raise :class:`Terminated` in the main thread; returns the undo.

    Only over the default disposition: a SIGTERM ignored by whoever started us, or
    handled by the program that embeds pytest, stays theirs (None: nothing to undo).
    The undo puts the default back only if the handler is still ours.
    """
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None
    signal.signal(signal.SIGTERM, _on_sigterm)

    def undo() -> None:
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    return undo


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
