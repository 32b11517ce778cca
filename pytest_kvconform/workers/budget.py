"""The per-test time budget (``--kv-timeout``) and waits bounded by it.

Stdlib only.  A front-end opens a budget around one clause check
(:func:`per_test`); every wait inside the check (a worker's answer, a backend's
declaration call) is bounded by what is left of it (:func:`bound`).  Outside a
budget (a check called directly), each wait falls back to its own default, so no
wait is ever unbounded.  A wait that runs out raises a
:class:`~pytest_kvconform.contract.outcomes.HarnessError` of kind ``timeout``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from pytest_kvconform.contract.outcomes import ErrorKind, HarnessError

DEFAULT_TIMEOUT_S = 300.0  # --kv-timeout's default, per test
DECLARATION_TIMEOUT_S = 60.0  # a declaration call outside a budget
T = TypeVar("T")

_deadline: float | None = None
_seconds: float | None = None


@contextlib.contextmanager
def per_test(seconds: float | None) -> Iterator[None]:
    """Bound every wait inside the block by ``seconds`` in all (None: no budget)."""
    global _deadline, _seconds
    saved = _deadline, _seconds
    _deadline = None if seconds is None else time.monotonic() + seconds
    _seconds = seconds
    try:
        yield
    finally:
        _deadline, _seconds = saved


def remaining() -> float | None:
    """Seconds left of the current budget, or None outside one."""
    if _deadline is None:
        return None
    return max(0.0, _deadline - time.monotonic())


def bound(default: float) -> float:
    """How long the next wait may take: what is left of the budget, else ``default``."""
    left = remaining()
    return default if left is None else left


def describe(timeout: float) -> str:
    """Which limit a wait of ``timeout`` seconds ran into, for messages."""
    if _seconds is None:
        return f"{timeout:.1f}s"
    return f"{timeout:.1f}s (what was left of the per-test budget, --kv-timeout={_seconds:g})"


class WaitTimeout(HarnessError):
    """A bounded wait in the test process ran out (kind ``timeout``)."""

    kind = ErrorKind.TIMEOUT


class _Outcome:
    value: Any = None
    error: BaseException | None = None


@dataclass(frozen=True)
class _Hang:
    """A call that timed out and has not returned since: where, and after how long."""

    first: str
    waited: str
    done: threading.Event


# Calls that hung, by the caller's key (a declaration that never returns would otherwise
# cost the whole --kv-timeout in every test that asks it).  Per process: under
# xdist each worker process that asks pays one timeout, then remembers it too.
_hung: dict[Hashable, _Hang] = {}
_hung_lock = threading.Lock()


def _current_test() -> str | None:
    """The running pytest test's id (pytest sets ``PYTEST_CURRENT_TEST``), if any."""
    current = os.environ.get("PYTEST_CURRENT_TEST")
    return current.rsplit(" (", 1)[0] if current else None


def forget_hangs() -> None:
    """Forget every remembered hang (for tests)."""
    with _hung_lock:
        _hung.clear()


def call(fn: Callable[[], T], what: str, *, default: float = DECLARATION_TIMEOUT_S,
         key: Hashable | None = None, label: str | None = None) -> T:
    """``fn()`` in a daemon thread, waited for within the budget; a timeout if it blocks.

    The thread cannot be stopped: a call that blocks forever keeps blocking in the
    background (a daemon thread never holds up the process's exit), but the check
    and the run go on.  ``what`` names what was waited for in the error.

    With ``key``, a call that timed out is remembered while its thread has not
    returned: a later call with the same key is not made, and fails at once with a
    timeout citing the first (the running test's id and ``label``, and how long it
    waited), so a hung callee costs one budget per process, not one per test.
    """
    try:
        hash(key)
    except TypeError:  # an unhashable callee: not remembered
        key = None
    if key is not None:
        with _hung_lock:
            hang = _hung.get(key)
            if hang is not None and hang.done.is_set():  # it returned after all: ask again
                del _hung[key]
                hang = None
        if hang is not None:
            raise WaitTimeout(f"{what} was not called again: it hung in {hang.first}, timing "
                              f"out after {hang.waited}, and has not returned since (this "
                              "process remembers it)")
    timeout = bound(default)
    outcome = _Outcome()
    done = threading.Event()

    def run() -> None:
        try:
            outcome.value = fn()
        except BaseException as exc:  # handed back to the caller
            outcome.error = exc
        finally:
            done.set()

    threading.Thread(target=run, name=f"kvconform-bounded-call: {what}", daemon=True).start()
    if not done.wait(timeout):
        if key is not None:
            test = _current_test()
            first = (f"{test} ({label})" if label else test) if test else (label or "a call")
            with _hung_lock:
                _hung.setdefault(key, _Hang(first, describe(timeout), done))
        raise WaitTimeout(f"timed out after {describe(timeout)} waiting for {what} to return")
    if outcome.error is not None:
        raise outcome.error
    return outcome.value
