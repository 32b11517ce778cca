"""Calls into a backend's class, made where the judging process can give up on them.

A backend's class is code from another repository, and the process that judges it must
outlive whatever that code does: a loop in C that never lets go of the GIL (no other
thread of the process runs again, signal handlers included, until it returns), a crash
of the interpreter, ``os._exit``.  A thread cannot be stopped; a process can.  So every
call into the class from the checking process is made in a child process forked for it
(:func:`call`), and so is every check that calls into the class from this process and
drives no worker process (``clauses.Check.isolated``: KV-L1, KV-L5, KV-L7; a KV-A check's
workers are processes of their own, and their pipes live here; KV-L2..L4 and KV-L8 touch
the class only through the declaration, itself read in a child).  The outcome, a
value or the exception with its kind judged there by the outcome rule
(``contract/outcome_rule.py``), comes back pickled as plain data.  When the budget
(``--kv-timeout``) runs out, the child is killed with SIGKILL, which needs no GIL.

**Where the child is forked from: this process, at the call.**  The call must see what the
check sees: the backend's class as discovered, the faults planted into production in this
process for this test, the budget, the hangs remembered.  A copy made anywhere else (the
KV-A workers' fork server, a process started before the plants) would check something
else.  Forking a process that imported vLLM costs tens of milliseconds (page tables, and
the pages the child writes, its exit: benchmarks/RESULTS.md), and a child keeps nothing it
imports, so a check whose production code imports much is better run here, reading the
class only through the bounded declaration (``Check.declaration_only``).  Forking it has one hazard,
libgomp: once torch has run an OpenMP parallel region in this process (KV-S and KV-N fill
tensors here), its thread pool exists here only, and a child that enters a parallel region
waits forever for threads it does not have.  So the child sets torch's intra-op threads to
one before anything runs, as torch's DataLoader workers do: ATen then runs its loops inline
and never opens a parallel region.  A deadlock the child still meets is bounded as any hang
is, and named.

**Naming the call.**  Inside a child, :func:`call` makes the call directly, announcing it
to the parent first.  A parent that gives up on the child (the budget ran out, Ctrl-C,
SIGTERM) names the call that was running, not only the check; a call that hung is
remembered (``budget.remember_hang``): one budget per process, not one per test, since
every later child is forked with the memory and refuses the call at once.  A fault inside
an announced call is the backend's own (``HarnessError.caused_by``).

The child ignores SIGINT (its parent decides), dies with its parent (parent-death signal,
armed first), runs with the collector off, and never runs an exit handler (``os._exit``).

Stdlib only.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import io
import os
import pickle
import select
import signal
import sys
import time
import traceback
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, TypeVar

from pytest_kvconform.contract import memory
from pytest_kvconform.contract.outcome_rule import REMOTE_KIND_ATTR, harness_kind
from pytest_kvconform.contract.outcomes import ErrorKind, HarnessError
from pytest_kvconform.workers import budget, lifetime

T = TypeVar("T")
# Set on an exception carried back from a child: (file, line, function) where it was raised,
# for the one line a concise failure shows (``session/failure_repr.py``).
RAISED_AT_ATTR = "kvconform_raised_at"
_HEADER = 4  # bytes of each message's length
_TRACEBACK_CHARS = 8000
_REAP_S = 5.0

_channel: int | None = None  # in a child: the write end of the pipe to its parent
_cache: dict[Hashable, tuple[Any, Any]] = {}  # key -> (the callee, pinned; its value)
_ending: list[int] = []  # children killed, their exits not yet reaped


def reap_ended() -> None:
    """Reap the children killed before whose exit has come (never waits)."""
    for pid in list(_ending):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            _ending.remove(pid)


def inside() -> bool:
    """Whether this process is a child forked by :func:`call`."""
    return _channel is not None


def forget() -> None:
    """Forget remembered hangs and cached answers (for tests)."""
    budget.forget_hangs()
    _cache.clear()


def call(fn: Callable[[], T], what: str, *, where: str = "", key: Hashable | None = None,
         label: str | None = None, cache: bool = False, backend_code: bool = True,
         default: float = budget.DECLARATION_TIMEOUT_S) -> T:
    """``fn()`` in a child process forked for it, waited for within the budget.

    ``what`` names the call (``SLOW.indexes_kv_by_block_stride() (the backend's layout
    declaration)``), ``where`` the clause and parametrisation every message starts with
    (``KV-L2 [backend=SLOW]``).  With ``key``, a call that timed out is remembered: a later
    one fails at once citing the first (the running test's id and ``label``).  With
    ``cache``, a value this process already got for ``key`` is answered again without a
    child (a declaration the KV-A checks read once per process).  ``backend_code``: ``fn``
    is itself a call into the backend's class (False for a whole check, whose calls into
    the class announce themselves).

    Inside a child (a whole check forked by an earlier :func:`call`) the call is made
    directly, announced to the parent first.  Outside a budget the wait is bounded by
    ``default``.  ``fn``'s value must be plain data (str, numbers, None, containers,
    enums).
    """
    prefix = f"{where}: " if where else ""
    try:
        budget.refuse_if_hung(key, what)
    except budget.WaitTimeout as exc:
        raise budget.WaitTimeout(f"{prefix}{exc}", caused_by=what) from None
    if _channel is not None:
        _send(("enter", what, where, _plain(key), label))
        try:
            return fn()
        except Exception as exc:
            oom = _out_of_memory(exc, what, prefix) if backend_code else exc
            if oom is not exc:
                raise oom from exc
            raise
        finally:
            _send(("leave",))
    if cache and key is not None and key in _cache:
        return _cache[key][1]
    reap_ended()
    try:
        value: T = _Child(_Running(what, where, key, label, time.monotonic()),
                          backend_code).run(fn, budget.bound(default))
    except Exception as exc:
        oom = _out_of_memory(exc, what, prefix) if backend_code else exc
        if oom is not exc:
            raise oom from exc
        raise
    if cache and key is not None:
        _cache[key] = (fn, value)
    return value


def _out_of_memory(exc: Exception, what: str, prefix: str) -> Exception:
    """An allocation the backend's code made that failed for want of memory: the ``oom``
    error naming the call and the bytes asked for, however it surfaced (one fault, one
    kind); any other exception as it is."""
    if isinstance(exc, HarnessError) or not memory.is_out_of_memory(exc):
        return exc
    asked = memory.asked_bytes(str(exc))
    return memory.OutOfMemory(
        f"{prefix}{what} ran out of memory asking for "
        f"{'an unknown number of' if asked is None else asked} bytes "
        f"({memory.host_available_bytes()} bytes were available): {type(exc).__name__}: "
        f"{str(exc)[:500]}", asked=asked or 0, available=memory.host_available_bytes(),
        caused_by=what)


# --- the child -------------------------------------------------------------------------


def _send(message: tuple[Any, ...]) -> None:
    """One message to the parent: its length, then its pickle (plain data only)."""
    assert _channel is not None
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(len(data).to_bytes(_HEADER, "big") + data)
    while view:
        written = os.write(_channel, view)
        view = view[written:]


def _child_main(fn: Callable[[], Any], channel: int, parent: int) -> None:
    global _channel
    _channel = channel
    lifetime.set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the death signal was armed
        os._exit(lifetime.EXIT_ORPHANED)
    with contextlib.suppress(ValueError, OSError):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when it stops
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    gc.disable()  # short-lived: nothing to collect, and no page of the parent's to copy
    torch = sys.modules.get("torch")
    if torch is not None:  # libgomp: no parallel region in a forked child (module docstring)
        with contextlib.suppress(Exception):
            torch.set_num_threads(1)
    try:
        message: tuple[Any, ...] = ("value", _plain(fn(), strict=True))
    except BaseException as exc:
        message = ("raised", _carried(exc))
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    try:
        _send(message)
    except Exception as exc:  # a value that would not pickle: the harness's error
        _send(("raised", _carried(HarnessError(f"the child's outcome could not be sent "
                                               f"back: {type(exc).__name__}: {exc}"))))


# --- plain data across the pipe ---------------------------------------------------------


@dataclass(frozen=True)
class Shown:
    """A value that could not cross the pipe, as its ``repr`` (for a message)."""

    text: str

    def __repr__(self) -> str:
        return self.text


class NotPlain(HarnessError):
    """A child's value that is not plain data (a harness bug: checks return plain data)."""


_SCALARS = (str, int, float, bool, bytes, type(None))


def _plain(value: Any, *, strict: bool = False, depth: int = 0) -> Any:
    """``value`` as plain data: scalars and containers as they are, an enum member by name,
    anything else its repr (or :class:`NotPlain` with ``strict``)."""
    if isinstance(value, enum.Enum):
        cls = type(value)
        return {"__enum__": (cls.__module__, cls.__qualname__, value.name)}
    if type(value) in _SCALARS:
        return value
    if depth < 20 and type(value) in (tuple, list):
        return type(value)(_plain(v, strict=strict, depth=depth + 1) for v in value)
    if depth < 20 and type(value) is dict and "__enum__" not in value \
            and "__repr__" not in value:
        return {_plain(k, strict=strict, depth=depth + 1): _plain(v, strict=strict,
                                                                  depth=depth + 1)
                for k, v in value.items()}
    if strict:
        raise NotPlain(f"{type(value).__name__} is not plain data: {value!r}"[:500])
    return {"__repr__": _repr(value)}


def _repr(value: Any) -> str:
    try:
        return repr(value)[:2000]
    except Exception as exc:
        return f"<{type(value).__name__}: repr raised {type(exc).__name__}>"


def _rebuilt(value: Any) -> Any:
    """The parent's value for the child's plain data (enums looked up, never imported)."""
    if type(value) in (tuple, list):
        return type(value)(_rebuilt(v) for v in value)
    if type(value) is dict:
        if set(value) == {"__enum__"}:
            module, qualname, name = value["__enum__"]
            cls = _loaded(module, qualname)
            if isinstance(cls, type) and issubclass(cls, enum.Enum) and name in cls.__members__:
                return cls[name]
            return Shown(f"{qualname}.{name}")
        if set(value) == {"__repr__"}:
            return Shown(value["__repr__"])
        return {_rebuilt(k): _rebuilt(v) for k, v in value.items()}
    return value


def _loaded(module: str, qualname: str) -> Any:
    """``module.qualname`` if that module is already imported here (nothing is imported)."""
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        if obj is None or part == "<locals>":
            return None
        obj = getattr(obj, part, None)
    return obj


class RemoteTraceback(Exception):
    """Where a carried exception was raised, in the child (shown as its cause)."""

    def __str__(self) -> str:
        return f"\n{self.args[0]}" if self.args else ""


class CarriedError(Exception):
    """An exception of a class this process cannot name (defined only in the child)."""


def _carried(exc: BaseException) -> dict[str, Any]:
    """A child's exception as plain data, its kind judged here, by its own traceback."""
    if isinstance(exc, Exception):
        kind = harness_kind(exc)
    else:  # SystemExit, KeyboardInterrupt raised by the code under test: never this run's
        exc = RuntimeError(f"{type(exc).__name__} raised in the child: {exc!r}")
        kind = None
    tb = traceback.extract_tb(exc.__traceback__)
    return {
        "module": type(exc).__module__, "qualname": type(exc).__qualname__,
        "args": _plain(tuple(exc.args)),
        "state": {k: _plain(v) for k, v in vars(exc).items() if not k.startswith("__")},
        "kind": None if kind is None else kind.value,
        "traceback": "".join(traceback.format_exception(exc))[-_TRACEBACK_CHARS:],
        "raised_at": (tb[-1].filename, tb[-1].lineno, tb[-1].name) if tb else None,
    }


def rebuild(carried: dict[str, Any]) -> BaseException:
    """The parent's exception for a child's: the same class with the same fields, its kind
    as the child judged it, the child's traceback as its cause."""
    cls = _loaded(str(carried["module"]), str(carried["qualname"]))
    args = tuple(_rebuilt(carried["args"]))
    exc: BaseException
    if isinstance(cls, type) and issubclass(cls, Exception):
        exc = cls.__new__(cls)
        exc.args = args
        with contextlib.suppress(Exception):
            exc.__dict__.update(_rebuilt(carried["state"]))
    else:
        exc = CarriedError(f"{carried['qualname']}: {', '.join(map(str, args))}")
    setattr(exc, REMOTE_KIND_ATTR, carried["kind"])
    if carried.get("raised_at"):
        setattr(exc, RAISED_AT_ATTR, tuple(carried["raised_at"]))
    exc.__cause__ = RemoteTraceback(str(carried["traceback"]))
    return exc


class _Plain(pickle.Unpickler):
    """Plain data only: a message naming any global is refused, so nothing is imported or
    called here on the child's say-so."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"the child sent a global ({module}.{name})")


# --- the parent's end -------------------------------------------------------------------


class ProcessEnded(HarnessError):
    """The child making the call ended without an outcome (``how``: its exit code or signal)."""

    kind = ErrorKind.WORKER_DIED

    def __init__(self, message: str, how: str, *, caused_by: str | None = None) -> None:
        super().__init__(message, caused_by=caused_by)
        self.how = how


@dataclass
class _Running:
    """A call the child announced and has not finished."""

    what: str
    where: str
    key: Hashable | None
    label: str | None
    since: float


class _Child:
    """One forked call, from the parent's side."""

    def __init__(self, outer: _Running, backend_code: bool) -> None:
        self.outer = outer
        # The calls into the backend's class under way: the outer one itself, unless it is
        # a whole check (whose calls announce themselves).
        self.running: list[_Running] = [outer] if backend_code else []
        self.pid = 0
        self._buffer = b""

    def run(self, fn: Callable[[], T], timeout: float) -> T:
        read_end, write_end = os.pipe()
        parent = os.getpid()
        lifetime.c_library()  # opened here: the child arms its death signal without dlopen
        try:
            self.pid = os.fork()
            if self.pid == 0:  # the child: never returns
                try:
                    os.close(read_end)
                    _child_main(fn, write_end, parent)
                finally:
                    os._exit(0)
            os.close(write_end)
            write_end = -1
            return self._wait(read_end, timeout)
        except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: name what was running
            self._kill()
            raise self._interrupted(exc) from None
        finally:
            for end in (read_end, write_end):
                if end >= 0:
                    os.close(end)
            self._kill()  # done, hung or interrupted: its exit is not waited for

    def _wait(self, read_end: int, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        poller = select.poll()  # not select(): this process may hold descriptors past 1024
        poller.register(read_end, select.POLLIN | select.POLLHUP | select.POLLERR)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._kill()
                raise self._timed_out(timeout)
            if not poller.poll(max(1, int(left * 1000))):
                continue
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                raise self._died()
            self._buffer += chunk
            for message in self._messages():
                if message[0] == "enter":
                    _, what, where, key, label = message
                    self.running.append(_Running(what, where, _rebuilt(key), label,
                                                 time.monotonic()))
                elif message[0] == "leave":
                    if self.running and self.running[-1] is not self.outer:
                        self.running.pop()
                elif message[0] == "value":
                    return _rebuilt(message[1])
                elif message[0] == "raised":
                    raise rebuild(message[1])

    def _messages(self) -> list[tuple[Any, ...]]:
        found = []
        while len(self._buffer) >= _HEADER:
            size = int.from_bytes(self._buffer[:_HEADER], "big")
            if len(self._buffer) < _HEADER + size:
                break
            data, self._buffer = self._buffer[_HEADER:_HEADER + size], \
                self._buffer[_HEADER + size:]
            found.append(_Plain(io.BytesIO(data)).load())
        return found

    @property
    def culprit(self) -> _Running | None:
        """The innermost call into the backend's class the child was making, if any."""
        return self.running[-1] if self.running else None

    def _timed_out(self, timeout: float) -> budget.WaitTimeout:
        hung = self.culprit
        if hung is not None:
            budget.remember_hang(hung.key, timeout, hung.label)
            prefix = f"{hung.where}: " if hung.where else ""
            return budget.WaitTimeout(
                f"{prefix}timed out after {budget.describe(timeout)} waiting for {hung.what} "
                "to return (its process was killed)", caused_by=hung.what)
        prefix = f"{self.outer.where}: " if self.outer.where else ""
        return budget.WaitTimeout(
            f"{prefix}timed out after {budget.describe(timeout)} waiting for {self.outer.what} "
            "(run in a child process, which was killed; no call into the backend's class was "
            "running)")

    def _died(self) -> ProcessEnded:
        how = self._reap()
        crashed = self.culprit
        if crashed is not None:
            prefix = f"{crashed.where}: " if crashed.where else ""
            return ProcessEnded(f"{prefix}the process calling {crashed.what} died ({how}): "
                                "the backend's own code ended it", how, caused_by=crashed.what)
        prefix = f"{self.outer.where}: " if self.outer.where else ""
        return ProcessEnded(f"{prefix}the child process running {self.outer.what} died "
                            f"({how}) outside any call into the backend's class", how)

    def _interrupted(self, exc: KeyboardInterrupt) -> KeyboardInterrupt:
        """The same interruption, naming what ran (the report's interruption says it)."""
        running = self.culprit or self.outer
        text = str(exc).strip() or type(exc).__name__
        note = (f"{text} while {running.where or 'the run'} had waited "
                f"{time.monotonic() - running.since:.1f}s for {running.what}")
        test = budget.current_test()
        if test:
            note += f", in {test}"
        interrupted = type(exc)(note)
        interrupted.__traceback__ = exc.__traceback__
        return interrupted

    def _kill(self) -> None:
        """SIGKILL the child (which needs no GIL of it), and leave its exit to be reaped later:
        a process that imported vLLM takes tens of milliseconds to unmap, which the other
        core spends while this process goes on (:func:`reap_ended`)."""
        if self.pid:
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(self.pid, signal.SIGKILL)
            _ending.append(self.pid)
            self.pid = 0

    def _reap(self) -> str:
        """Wait for the child (killed, or ending on its own): how it ended."""
        if not self.pid:
            return "already reaped"
        deadline = time.monotonic() + _REAP_S
        while True:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.pid = 0
                return "already reaped"
            if pid:
                self.pid = 0
                return _how(status)
            if time.monotonic() > deadline:  # a process that SIGKILL does not end: a zombie
                return "did not end"
            time.sleep(0.005)


def _how(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        text = f"killed by {signal.Signals(sig).name}"
        return text + (" (the kernel's OOM killer, or someone else)"
                       if sig == signal.SIGKILL else "")
    return f"exit code {os.WEXITSTATUS(status)}"


def probe(timeout: float) -> Callable[[str, Callable[[], object]], str | None]:
    """A guard for discovery (``adapters/discovery.Guard``): ``fn`` (an import of backend
    code, named ``what``) made first in a child given ``timeout`` seconds.  None when it
    returned or raised there (this process may make it: a raise it reports itself), else
    why it must not be made here: it hung (a loop holding the GIL included) and was
    killed, or it ended its process."""

    def guard(what: str, fn: Callable[[], object]) -> str | None:
        def made() -> None:
            fn()

        try:
            call(made, what, default=timeout)
        except budget.WaitTimeout:
            return (f"{what} did not finish within {timeout:g}s (--kv-timeout; it blocks, or "
                    "loops holding the GIL) and was killed; it was not imported into the run")
        except ProcessEnded as exc:
            return f"{what} ended its process ({exc.how}); it was not imported into the run"
        except Exception:  # it raised: this process imports it and reports the error itself
            return None
        return None

    return guard
