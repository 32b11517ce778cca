"""The per-test time budget (``--kv-timeout``) and waits bounded by it.

Stdlib only.  A front-end opens a budget around one clause check
(:func:`per_test`); every wait inside the check (a worker's answer, a call into a
backend's class made in a child process, ``isolated.py``) is bounded by what is left of
it (:func:`bound`).  Outside a
budget (a check called directly), each wait falls back to its own default, so no
wait is ever unbounded.  A wait that runs out raises a
:class:`~pytest_kvconform.contract.outcomes.HarnessError` of kind ``timeout``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Hashable, Iterator
from dataclasses import dataclass

from pytest_kvconform.contract.outcomes import ErrorKind, HarnessError

DEFAULT_TIMEOUT_S = 300.0  # --kv-timeout's default, per test
DECLARATION_TIMEOUT_S = 60.0  # a call into a backend's class outside a budget

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


@dataclass(frozen=True)
class Hang:
    """A call that timed out and was given up on: where, and after how long."""

    first: str
    waited: str


# Calls that hung, by the caller's key (a declaration that never returns would otherwise
# cost the whole --kv-timeout in every test that asks it).  A hung call is killed with the
# child process that made it (``workers/isolated.py``), so it never returns: remembered
# for the rest of the process.  Per process: under xdist each worker process that asks
# pays one timeout, then remembers it too; a child forked to make a call is forked with
# the memory.
_hung: dict[Hashable, Hang] = {}


def current_test() -> str | None:
    """The running pytest test's id (pytest sets ``PYTEST_CURRENT_TEST``), if any."""
    current = os.environ.get("PYTEST_CURRENT_TEST")
    return current.rsplit(" (", 1)[0] if current else None


def forget_hangs() -> None:
    """Forget every remembered hang (for tests)."""
    _hung.clear()


def _hashable(key: Hashable | None) -> Hashable | None:
    try:
        hash(key)
    except TypeError:  # an unhashable key: not remembered
        return None
    return key


def remember_hang(key: Hashable | None, timeout: float, label: str | None = None) -> None:
    """``key``'s call timed out after ``timeout`` seconds in the running test (``label``
    says which of its steps): every later call with the same key is refused at once."""
    key = _hashable(key)
    if key is None:
        return
    test = current_test()
    first = (f"{test} ({label})" if label else test) if test else (label or "a call")
    _hung.setdefault(key, Hang(first, describe(timeout)))


def hang_of(key: Hashable | None) -> Hang | None:
    """The remembered hang of ``key``'s call, if it hung before in this process."""
    key = _hashable(key)
    return None if key is None else _hung.get(key)


def refuse_if_hung(key: Hashable | None, what: str) -> None:
    """A :class:`WaitTimeout` citing the first hang when ``key``'s call hung before."""
    hang = hang_of(key)
    if hang is not None:
        raise WaitTimeout(f"{what} was not called again: it hung in {hang.first}, timing "
                          f"out after {hang.waited}, and was killed (this process "
                          "remembers it)")
