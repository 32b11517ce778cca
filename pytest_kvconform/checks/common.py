"""Helpers every clause check uses: its failure context, the backend's class and need."""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
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
from pytest_kvconform.contract.records import NOT_SELECTED, BackendUnderTest, Case
from pytest_kvconform.workers import budget, isolated


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
        kind = SkipKind.NOT_APPLICABLE if backend.unusable == NOT_SELECTED else \
            SkipKind.ENVIRONMENT
        raise ClauseSkip(clause, backend.error or "no backend discovered", kind)
    if backend.cls is None:
        raise ClauseSkip(clause, f"backend {backend.name} is not importable: {backend.error} "
                         f"(from {backend.source} {backend.path})", SkipKind.BACKEND)
    return backend.cls


DECLARATION = "indexes_kv_by_block_stride"


def declared_need(clause: str, backend: BackendUnderTest) -> bool:
    """``indexes_kv_by_block_stride()`` as a bool; a non-bool answer fails the clause.

    Clauses other than KV-L1 need the answer to know what to expect; they
    refuse to guess from a truthy non-bool, which KV-L1 reports on its own.
    """
    facts = _facts(clause, backend)
    found = facts["need"]
    if found[0] in ("missing", "not callable"):
        raise ClauseFailure(clause, "backend declares no callable indexes_kv_by_block_stride(); "
                            "its layout need is unknown (see KV-L1)", backend=backend.name)
    if found[0] == "raised":
        raise ClauseFailure(clause, f"indexes_kv_by_block_stride() raised {found[1]} (see KV-L1)",
                            backend=backend.name)
    if found[0] != "bool":
        raise ClauseFailure(clause, f"indexes_kv_by_block_stride() returned {found[1]} of type "
                            f"{found[2]}, not bool (see KV-L1)", backend=backend.name)
    return bool(found[1])


def supports_paged_kv(clause: str, backend: BackendUnderTest) -> bool:
    """Whether the backend's class says ``supports_paged_kv`` (production serves paged KV
    only with one that does), read as the declaration is (:func:`declared_need`)."""
    return bool(_facts(clause, backend)["paged"])


def _facts(clause: str, backend: BackendUnderTest) -> dict[str, Any]:
    """What the checks read off a backend's class, in one call into it made where this
    process can give up on it (:func:`call_declaration`): its layout need (as plain data:
    the kind of answer and the answer) and ``supports_paged_kv``.  Kept for the process
    outside a child: every KV-A check reads them."""
    cls = backend_class(clause, backend)
    static = inspect.getattr_static(cls, DECLARATION, None)  # runs none of the class's code
    return call_declaration(clause, backend.name, partial(_read_facts, cls),
                            cache=True, key=backend_call_key(backend.name, static, DECLARATION))


def _read_facts(cls: Any) -> dict[str, Any]:
    paged = bool(getattr(cls, "supports_paged_kv", False))
    method = getattr(cls, DECLARATION, None)
    if method is None:
        return {"paged": paged, "need": ("missing",)}
    if not callable(method):
        return {"paged": paged, "need": ("not callable",)}
    try:
        value = method()
    except Exception as exc:
        if memory.is_out_of_memory(exc) or isinstance(exc, HarnessError):
            raise  # an oom error naming the call, however it surfaces (isolated.call)
        return {"paged": paged, "need": ("raised", repr(exc))}
    if type(value) is bool:
        return {"paged": paged, "need": ("bool", value)}
    return {"paged": paged, "need": ("other", repr(value), type(value).__name__)}


def call_declaration(clause: str, backend: str, method: Any, *, cache: bool = False,
                     key: tuple[str, str, int] | None = None) -> Any:
    """``method()`` (a backend's declaration: its layout need, or its name), bounded by the
    per-test budget.

    Made where this process can give up on it (``workers/isolated.py``: in a child process,
    or announced inside the child running the whole check), so a declaration that blocks,
    holds the GIL or ends its process becomes an error naming the clause, the backend and
    the call, not a hung or dead run.  Once it has timed out, every later test asking the
    same backend's declaration errors at once, citing the first: one budget per hung
    backend, not one per test.  With ``cache``, an answer this process already got is
    given again without a child (the KV-A checks each read the need; KV-L1 asks three
    times, uncached, to see that it is stable).  ``key``: the call it stands for, when
    ``method`` reads the declaration among other things (:func:`_facts`).
    """
    key = key or backend_call_key(backend, method)
    name = key[1]
    what = _DECLARATIONS.get(name, "the backend's declaration")
    return isolated.call(method, f"{backend}.{name}() ({what})",
                         where=f"{clause} [backend={backend}]", key=key, label=clause,
                         cache=cache)


def declared(where: Where, backend: str, method: Any, name: str, *args: Any,
             key: tuple[str, str, int] | None = None) -> Any:
    """``method(*args)``, a call into the backend's class bounded as
    :func:`call_declaration` bounds it; what it raised is a violation naming ``name()``
    (a harness error stays one)."""
    call = partial(method, *args) if args else method
    try:
        return call_declaration(where.clause, backend, call, key=key)
    except HarnessError:
        raise
    except Exception as exc:
        how = ("raised" if not isinstance(exc, TypeError) else
               "cannot be called on the class" + ("" if args else " with no arguments"))
        raise where.fail(f"{name}() {how}: {exc!r}") from exc


# What each declaration a backend makes is, for the messages that name a call into it.
_DECLARATIONS = {DECLARATION: "the backend's layout declaration",
                 "get_name": "the name the backend declares"}


def backend_call_key(backend: str, method: Any, name: str | None = None
                     ) -> tuple[str, str, int]:
    """What identifies a call into a backend's class across this process and its children:
    the backend, the method's name and its function (a method replaced is another call)."""
    function = getattr(method, "__func__", method)
    return backend, name or _name_of(method), id(function)


def _name_of(method: Any) -> str:
    return str(getattr(method, "__name__", None) or type(method).__name__)


def production_with_class(clause: str, backend: str, production: str, fn: Callable[[], Any]
                          ) -> Any:
    """``fn()``: production's ``production`` handed the backend's class (it calls into it),
    bounded and named as a call into the class is (:func:`call_declaration`)."""
    return isolated.call(fn, f"production's {production} with {backend}'s class",
                         where=f"{clause} [backend={backend}]",
                         key=(backend, production, 0), label=clause)


def run_in_child(check: Callable[..., Any], args: Sequence[Any], *, clause: str,
                 backend: str | None) -> Any:
    """A whole check that calls into a backend's class from this process, run in a child
    forked for it (``clauses.Check.isolated``; ``workers/isolated.py``): its value and the
    production entry points it noted come back, its outcome as it raised it."""
    if isolated.inside():  # already where this process can give up on it
        return check(*args)

    def body() -> tuple[Any, list[str]]:
        value = check(*args)
        return value, list(_VIA.get() or [])

    where = f"{clause}{bracketed(backend=backend, case=None, layout=None)}"
    value, via = isolated.call(body, f"the {clause} check ({getattr(check, '__name__', '?')})",
                               where=where, backend_code=False,
                               default=budget.DEFAULT_TIMEOUT_S)
    for entry in via:
        note_via(entry)
    return value


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
