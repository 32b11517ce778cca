"""The outcomes a check can have besides passing: the bottom of the package.

Stdlib only, and it imports nothing of ours: adapters (compat, control_plane),
the worker harness, the checks and the front-ends all raise or read these.

- :class:`ClauseFailure`: the contract does not hold (the backend or the installed
  code is wrong).
- :class:`ClauseSkip`: the clause cannot be checked here; :class:`SkipKind` says why.
- :class:`Unsupported`: the installed vLLM / vllm-omni lacks what a check needs.  The
  adapters (compat, control_plane) raise it without naming a clause; the check
  that called them attaches its own clause and reports a :class:`ClauseSkip`.
- :class:`HarnessError`: the harness itself failed (a worker died or timed out, an
  allocation ran out of memory, the plugin raised).  Never blamed on a backend: the
  report shows it as status ``error`` with its :class:`ErrorKind`.
"""

from __future__ import annotations

from enum import StrEnum


class SkipKind(StrEnum):
    """Why a clause could not run; strict qualification forgives only some kinds."""

    HARDWARE = "hardware"  # no CUDA, fewer devices than the world size, kernel device absent
    ENVIRONMENT = "environment"  # a package (vllm-omni) not installed
    BACKEND = "backend"  # the backend failed to import
    NOT_APPLICABLE = "not-applicable"  # the clause does not apply to this backend/case


class ErrorKind(StrEnum):
    """What kind of harness fault turned a test into an error."""

    WORKER_DIED = "worker-died"
    TIMEOUT = "timeout"
    OOM = "oom"
    HARNESS = "harness"


def bracketed(*, backend: str | None, case: str | None, layout: str | None) -> str:
    """`` [backend=B, case=C, layout=L]`` (the parts that are set), or ``""``: how every
    clause failure and harness error names what it was checking."""
    where = ", ".join(
        f"{k}={v}" for k, v in (("backend", backend), ("case", case), ("layout", layout)) if v
    )
    return f" [{where}]" if where else ""


class ClauseFailure(AssertionError):
    """A contract clause does not hold.

    The message names the clause, the backend or case, and the first
    difference (expected vs actual), so a reader needs no debugger.  ``problems``
    holds each thing that went wrong on its own (one, unless a check reports several
    sub-scenarios at once), so a known finding can be matched against every one of
    them, not against their sum.
    """

    def __init__(
        self,
        clause: str,
        detail: str,
        *,
        backend: str | None = None,
        case: str | None = None,
        layout: str | None = None,
        expected: object = None,
        actual: object = None,
        problems: tuple[str, ...] | None = None,
    ) -> None:
        self.clause = clause
        self.detail = detail
        self.problems = problems if problems else (detail,)
        self.backend = backend
        self.case = case
        self.layout = layout
        self.expected = expected
        self.actual = actual
        msg = f"{clause} violated{bracketed(backend=backend, case=case, layout=layout)}: {detail}"
        if expected is not None or actual is not None:
            msg += f"\n  expected: {expected!r}\n  actual:   {actual!r}"
        super().__init__(msg)


class ClauseSkip(Exception):
    """A clause cannot be checked here; the reason is reported, never dropped."""

    def __init__(self, clause: str, reason: str, kind: SkipKind = SkipKind.ENVIRONMENT) -> None:
        self.clause = clause
        self.reason = reason
        self.kind = kind
        super().__init__(f"{clause}: {reason}")


class Unsupported(Exception):
    """Unsupported by the installed version: a feature a check needs is absent.

    Raised by the adapters, which serve several clauses and so name none; the
    check (or the front-end running it) turns it into ``ClauseSkip(clause, ...)``
    with :meth:`skip`.
    """

    def __init__(self, reason: str, kind: SkipKind = SkipKind.ENVIRONMENT) -> None:
        self.reason = reason
        self.kind = kind
        super().__init__(reason)

    def skip(self, clause: str) -> ClauseSkip:
        """The skip of ``clause`` this absence means."""
        return ClauseSkip(clause, self.reason, self.kind)


class HarnessError(RuntimeError):
    """The harness failed, not the backend: reported as an error of ``kind``.

    Subclasses (the worker harness's ``WorkerDied``, ``WorkerTimeout``, ...) set
    ``kind``; the front-ends turn any of them into status ``error``.
    """

    kind: ErrorKind = ErrorKind.HARNESS
    # The backend's own code that caused the fault, when it did (a call into its class that
    # hung, ended its process or asked for the memory): such a fault counts for that
    # backend, never for the serving stack, whatever the clause's subject.
    caused_by: str | None = None

    def __init__(self, message: str, *, kind: ErrorKind | None = None,
                 caused_by: str | None = None) -> None:
        if kind is not None:
            self.kind = kind
        if caused_by is not None:
            self.caused_by = caused_by
        super().__init__(message)


def describe_error(exc: BaseException) -> str:
    """``ImportError: No module named 'x'`` - never an empty string.

    A bare re-raise (``raise ImportError`` inside ``except``) says nothing itself;
    the exception it replaced does, so that one is named too.
    """
    text = str(exc).strip()
    if text:
        return f"{type(exc).__name__}: {text}"
    inner = exc.__cause__ or exc.__context__
    if inner is not None and inner is not exc:
        return f"{type(exc).__name__} (caused by {describe_error(inner)})"
    return f"{type(exc).__name__} (no message)"
