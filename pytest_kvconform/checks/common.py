"""Helpers every clause check uses: the backend's class and its declared need."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from pytest_kvconform import budget
from pytest_kvconform.checks.errors import (
    ClauseFailure,
    ClauseSkip,
    HarnessError,
    SkipKind,
    Unsupported,
)
from pytest_kvconform.model import BackendUnderTest


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


def call_declaration(clause: str, backend: str, method: Any) -> Any:
    """``method()`` (a backend's layout declaration) bounded by the per-test budget.

    A declaration that blocks becomes a timeout error naming the clause, the
    backend and the call, not a hung run.
    """
    try:
        return budget.call(method, f"{backend}.indexes_kv_by_block_stride() (the backend's "
                           "layout declaration)")
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
