"""Helpers every clause check uses: its failure context, the backend's class and need."""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pytest_kvconform.checks.errors import (
    ClauseFailure,
    ClauseSkip,
    HarnessError,
    SkipKind,
    Unsupported,
)
from pytest_kvconform.contract import memory
from pytest_kvconform.contract.outcomes import bracketed
from pytest_kvconform.contract.records import BackendUnderTest, Case
from pytest_kvconform.workers import budget


@dataclass(frozen=True)
class Where:
    """What one check is checking: the clause and the parametrisation every
    failure, skip and harness error it raises names (one shape for all checks)."""

    clause: str
    backend: str | None = None
    case: Case | None = None
    layout: str | None = None

    @property
    def the_case(self) -> Case:
        """The case, for checks that always run one (a missing case is a harness bug)."""
        if self.case is None:
            raise TypeError(f"{self.clause}: this check has no case")
        return self.case

    def at(self, **changes: Any) -> Where:
        """This context with some fields changed (e.g. the layout a loop is on)."""
        return dataclasses.replace(self, **changes)

    def fail(self, detail: str, *, layout: str | None = None, expected: object = None,
             actual: object = None, problems: tuple[str, ...] | None = None) -> ClauseFailure:
        return ClauseFailure(self.clause, detail, backend=self.backend,
                             case=None if self.case is None else self.case.id,
                             layout=layout if layout is not None else self.layout,
                             expected=expected, actual=actual, problems=problems)

    def fail_at(self, source: str, detail: str, *, expected: object = None,
                actual: object = None) -> ClauseFailure:
        """A failure found in ``source`` (the production code that produced it)."""
        return self.fail(f"{source}: {detail}", expected=expected, actual=actual)

    def skip(self, reason: str, kind: SkipKind = SkipKind.ENVIRONMENT) -> ClauseSkip:
        return ClauseSkip(self.clause, reason, kind)

    def call(self, source: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run production code; an exception is a violation here, not a crash (a harness
        error raised inside, e.g. an allocation of ours that would not fit, stays one)."""
        try:
            return fn(*args, **kwargs)
        except (ClauseFailure, ClauseSkip, HarnessError):
            raise
        except Unsupported as exc:
            raise exc.skip(self.clause) from None
        except Exception as exc:
            raise self.fail_at(source, f"raised {type(exc).__name__}: {exc}") from exc

    def harness(self, exc: HarnessError, doing: str) -> HarnessError:
        """``exc`` (same class and kind) with the clause, parametrisation and step named."""
        named = bracketed(backend=self.backend, case=None if self.case is None else self.case.id,
                          layout=self.layout)
        error = copy.copy(exc)
        error.args = (f"{self.clause}{named}: harness error ({exc.kind.value}) while {doing}: "
                      f"{exc}",)
        return error


@dataclass(frozen=True)
class Problem:
    """One thing that went wrong in a sub-scenario of a check."""

    detail: str
    layout: str | None = None
    expected: object = None
    actual: object = None


@dataclass
class Problems:
    """Every sub-scenario that went wrong, reported as one failure.

    The detail lists each problem (``; ``-joined); expected / actual and the
    layout are the first one's, so a single problem reads as a plain failure.
    """

    where: Where
    found: list[Problem] = field(default_factory=list)

    def add(self, detail: str, *, layout: str | None = None, expected: object = None,
            actual: object = None) -> None:
        self.found.append(Problem(detail, layout, expected, actual))

    def raise_any(self) -> None:
        if not self.found:
            return
        first = self.found[0]
        details = tuple(p.detail for p in self.found)
        raise self.where.fail("; ".join(details), layout=first.layout,
                              expected=first.expected, actual=first.actual, problems=details)


@contextlib.contextmanager
def unsupported_as_skip(clause: str) -> Iterator[None]:
    """Attach ``clause`` to what the adapters found missing: ``Unsupported`` -> its skip.

    The adapters (compat, control_plane) serve several clauses and name none;
    the check running them knows which clause it is checking.
    """
    try:
        yield
    except Unsupported as exc:
        raise exc.skip(clause) from None


@contextlib.contextmanager
def allocating(where: Where, what: str, asked: int) -> Iterator[None]:
    """An allocation of about ``asked`` bytes in the test process, bounded by the host's
    available memory: one it cannot hold (refused up front, or failing with MemoryError /
    torch's allocator error) is an ``oom`` error naming the clause, the case and the bytes,
    never a host OOM (the case files are bounded too; a Case made in code may not be)."""
    try:
        with memory.bounded(asked):
            yield
    except memory.OutOfMemory as exc:
        raise where.harness(exc, what) from exc


def backend_class(clause: str, backend: BackendUnderTest) -> Any:
    """The backend's class, or the skip that reports why it cannot be imported."""
    if backend.source == "none":  # nothing was discovered; the reason says why
        raise ClauseSkip(clause, backend.error or "no backend discovered", SkipKind.ENVIRONMENT)
    if backend.cls is None:
        raise ClauseSkip(clause, f"backend {backend.name} is not importable: {backend.error} "
                         f"(from {backend.source} {backend.path})", SkipKind.BACKEND)
    return backend.cls


def declared_need(clause: str, backend: BackendUnderTest) -> bool:
    """``indexes_kv_by_block_stride()`` as a bool; a non-bool answer fails the clause.

    Clauses other than KV-L1 need the answer to know what to expect; they
    refuse to guess from a truthy non-bool, which KV-L1 reports on its own.
    """
    cls = backend_class(clause, backend)
    method = getattr(cls, "indexes_kv_by_block_stride", None)
    if method is None or not callable(method):
        raise ClauseFailure(clause, "backend declares no callable indexes_kv_by_block_stride(); "
                            "its layout need is unknown (see KV-L1)", backend=backend.name)
    try:
        value = call_declaration(clause, backend.name, method)
    except HarnessError:
        raise
    except Exception as exc:
        raise ClauseFailure(clause, f"indexes_kv_by_block_stride() raised {exc!r} (see KV-L1)",
                            backend=backend.name) from exc
    if type(value) is not bool:
        raise ClauseFailure(clause, f"indexes_kv_by_block_stride() returned {value!r} of type "
                            f"{type(value).__name__}, not bool (see KV-L1)", backend=backend.name)
    return value


# What each declaration a backend makes is, for the messages that name a call into it.
_DECLARATIONS = {"indexes_kv_by_block_stride": "the backend's layout declaration",
                 "get_name": "the name the backend declares"}


def call_declaration(clause: str, backend: str, method: Any,
                     call: str = "indexes_kv_by_block_stride") -> Any:
    """``method()`` (a backend's declaration: its layout need, or its name, ``call``)
    bounded by the per-test budget.

    A declaration that blocks becomes a timeout error naming the clause, the
    backend and the call, not a hung run.  Once it has timed out, every later test
    asking the same backend's declaration errors at once, citing the first, while the
    call still has not returned (``budget.call``'s ``key``): one budget per hung
    backend, not one per test.
    """
    what = _DECLARATIONS.get(call, "the backend's declaration")
    try:
        return budget.call(method, f"{backend}.{call}() ({what})",
                           key=("declaration", backend, method), label=clause)
    except budget.WaitTimeout as exc:
        raise budget.WaitTimeout(f"{clause} [backend={backend}]: {exc}") from None


@contextlib.contextmanager
def cuda_init_recorder() -> Iterator[list[str]]:
    """Record attempts to initialise a CUDA context while the block runs.

    Patches ``torch.cuda._lazy_init`` (every CUDA context starts there) so the
    check works on a CPU-only build too, where nothing would be initialised.
    """
    calls: list[str] = []
    try:
        import torch.cuda
    except ImportError:  # no torch: nothing can initialise CUDA
        yield calls
        return
    original = torch.cuda._lazy_init
    was_initialized = torch.cuda.is_initialized()

    def recorder() -> None:
        calls.append("torch.cuda._lazy_init")
        original()

    torch.cuda._lazy_init = recorder
    try:
        yield calls
    finally:
        torch.cuda._lazy_init = original
        if not was_initialized and torch.cuda.is_initialized():
            calls.append("torch.cuda.is_initialized() became True")


# --- what a check reports besides its outcome ----------------------------------------

_VIA: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("kv_via", default=None)


@contextlib.contextmanager
def via_recorded() -> Iterator[list[str]]:
    """For a front-end: collect the production entry points the check says it drove."""
    seen: list[str] = []
    token = _VIA.set(seen)
    try:
        yield seen
    finally:
        _VIA.reset(token)


def note_via(via: str) -> None:
    """For a check: which production entry point received the configs (its result says so)."""
    seen = _VIA.get()
    if seen is not None and via not in seen:
        seen.append(via)
