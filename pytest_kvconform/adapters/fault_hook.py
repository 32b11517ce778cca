"""The one hook through which seeded faults and a check's own controls reach production.

The mechanism layers (``workers/``, ``adapters/``) never import the seeded-fault package
(``faults/``).  They call the functions here, which do nothing unless something is asked:

- a check's negative control, a :class:`~pytest_kvconform.adapters.source_rewrite.Regression`
  named by reference (``module:name``, e.g. KV-A4's ``checks/adoption_controls.py``), is
  applied here;
- a seeded fault (``$KVCONFORM_WORKER_FAULT``) or a PID directory
  (``$KVCONFORM_WORKER_PIDDIR``) is handed to the module ``$KVCONFORM_FAULT_HOOK`` names,
  imported by name, as the fork server imports its preload list.  ``pytest_kvconform.faults``
  installs itself there when it is imported (:func:`install`), and the variable goes with
  the environment to every process that hosts production (a forked KV-A worker gets the
  test process's environment; production's spawned workers inherit theirs).

A fault named with no hook installed is refused (:class:`NoFaultHook`): never a silent
no-fault run.  Stdlib only.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from typing import Any, Protocol, cast

from pytest_kvconform.adapters import run_env, source_rewrite
from pytest_kvconform.adapters.source_rewrite import Regression

FAULT_ENV = "KVCONFORM_WORKER_FAULT"
# A check's own negative control, for worker processes production spawns while it runs.
CONTROL_ENV = "KVCONFORM_WORKER_CONTROL"
PIDDIR_ENV = "KVCONFORM_WORKER_PIDDIR"
HOOK_ENV = "KVCONFORM_FAULT_HOOK"


class FaultHook(Protocol):
    """What the seeded-fault package offers the mechanism layers."""

    def validate(self, fault: str) -> None:
        """ValueError (one line naming the variable) for a name that is no fault."""

    def regressions(self, fault: str) -> list[Regression]:
        """The production functions the fault rewrites."""

    def seeded(self, fault: str) -> contextlib.AbstractContextManager[None]:
        """Everything else the fault changes, for the duration."""

    def process_fault(self, fault: str) -> None:
        """``hang`` / ``die``, in the process about to adopt."""

    def mark_pid(self, suffix: str) -> bool:
        """``$KVCONFORM_WORKER_PIDDIR/<pid>.<suffix>``; False when nothing was written."""


class NoFaultHook(RuntimeError):
    """A fault or a PID directory is named, and no seeded-fault package is installed."""


def install(module: str) -> None:
    """Name the hook module for this process and those it starts from now on."""
    os.environ[HOOK_ENV] = module


def hook(what: str) -> FaultHook:
    """The installed hook module; :class:`NoFaultHook` naming ``what`` asked for it."""
    name = os.environ.get(HOOK_ENV)
    if not name:
        raise NoFaultHook(f"{what}, but no seeded-fault hook is installed (${HOOK_ENV} is "
                          "unset: import pytest_kvconform.faults first)")
    return cast(FaultHook, importlib.import_module(name))


def names(fault: str | None) -> tuple[str, ...]:
    """The faults a ``$KVCONFORM_WORKER_FAULT`` value seeds (comma-separated)."""
    return tuple(n.strip() for n in (fault or "").split(",") if n.strip())


def active() -> str | None:
    """The fault(s) ``$KVCONFORM_WORKER_FAULT`` names, or None; an unknown name raises
    ValueError (a typo is an error, never a silent no-fault run)."""
    value = os.environ.get(FAULT_ENV) or None
    if value is not None:
        hook(f"${FAULT_ENV}={value!r} is set").validate(value)
    return value


def control(reference: str) -> Regression:
    """The regression a control reference (``module:name``) names."""
    module, _, name = reference.partition(":")
    regression = getattr(importlib.import_module(module), name)
    if not isinstance(regression, Regression):
        raise TypeError(f"control {reference!r} is not a Regression")
    return regression


_SEEDED_HERE: list[str | None] = []  # the controls this process applies now (a fork inherits)


@contextlib.contextmanager
def seeded(fault: str | None, control_ref: str | None = None) -> Iterator[None]:
    """Everything a process hosting production applies: the run's seeded ``fault`` and a
    check's own negative control.  The control is also exported (:data:`CONTROL_ENV`) to
    worker processes production spawns meanwhile, which apply both through
    :func:`inherited`."""
    regressions = [control(control_ref)] if control_ref else []
    rest: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if fault:
        faults = hook(f"seeded fault {fault!r}")
        regressions += faults.regressions(fault)
        rest = faults.seeded(fault)
    exported = (run_env.variable_set(CONTROL_ENV, control_ref) if control_ref
                else contextlib.nullcontext())
    with source_rewrite.applied(regressions), rest, exported:
        _SEEDED_HERE.append(control_ref)
        try:
            yield
        finally:
            _SEEDED_HERE.pop()


def inherited() -> contextlib.AbstractContextManager[None]:
    """In a worker process production started: what its engine process applies, unless
    this process already has it (the engine's own, or a fork of it)."""
    if _SEEDED_HERE:
        return contextlib.nullcontext()
    return seeded(active(), os.environ.get(CONTROL_ENV) or None)


def process_fault(fault: str | None) -> None:
    """The seeded ``hang`` / ``die``, if ``fault`` names one, in the process about to adopt."""
    if fault:
        hook(f"seeded fault {fault!r}").process_fault(fault)


def mark_pid(suffix: str) -> bool:
    """Mark this process in ``$KVCONFORM_WORKER_PIDDIR`` for a test to find (unset: no-op).

    Without a hook it is one line on stderr and the process carries on, as any refusal."""
    if not os.environ.get(PIDDIR_ENV):
        return False
    try:
        faults = hook(f"${PIDDIR_ENV} is set")
    except NoFaultHook as exc:
        with contextlib.suppress(OSError):
            os.write(2, f"kvconform: not writing a PID file: {exc}\n".encode())
        return False
    return faults.mark_pid(suffix)
