"""Which seeded worker fault each KV-A command was sent under, counted in this process.

A check whose counts moved drove its workers under that fault, and its result says so
(``session/results.py``, ``api.check_backend``).  The fault itself is named by
``$KVCONFORM_WORKER_FAULT`` and read through ``adapters/fault_hook.py``.
"""

from __future__ import annotations

from pytest_kvconform.adapters import fault_hook


def active_fault() -> str | None:
    """The seeded worker fault ``$KVCONFORM_WORKER_FAULT`` names, or None; unknown ones raise.

    Validated here, not in the child, so a typo never runs as a silent no-fault
    run and a session can print (or refuse) the fault before any worker starts.
    """
    return fault_hook.active()


_faulted_commands: dict[str, int] = {}


def count_faulted(fault: str | None, commands: int = 1) -> None:
    """Count ``commands`` sent under ``fault`` (none: nothing to count)."""
    if fault is not None:
        _faulted_commands[fault] = _faulted_commands.get(fault, 0) + commands


def faulted_commands() -> dict[str, int]:
    """How many commands this process has sent its KV-A workers under each seeded fault.

    A check (a suite test, a ``check_backend`` run) whose counts moved drove its
    workers under that fault, and its result says so: it speaks for the fault.
    """
    return dict(_faulted_commands)


def faults_since(before: dict[str, int]) -> list[str]:
    """The seeded faults commands were sent under since ``before`` (a
    :func:`faulted_commands`), sorted."""
    return sorted(f for f, n in _faulted_commands.items() if n > before.get(f, 0))
