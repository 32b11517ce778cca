"""One way to seed a fault, shared by the ``tests/seeded/test_*.py`` files.

A fault is planted in this process, for one test, where production looks the name up
at call time (a module or class attribute), with the test's ``monkeypatch``: one of the
package's own (``pytest_kvconform/faults/plants.py``, which ``kvconform selftest``
seeds too), or one a test writes for itself; inline
pytester runs (``kv_run``) and in-process checks share the process, so the fault is
live for them and undone after the test.  Worker faults travel to spawned KV-A workers
through ``$KVCONFORM_WORKER_FAULT``, which every command carries.  Stand-in backends
(``tests/standin_backends.py``) are registered through the plugin's own hook by a
one-import conftest, which subprocess and xdist runs load as well.

:func:`expect_run` then asserts a run's outcome: the counts, which clauses failed, and
the message lines (fnmatch patterns, as pytest's own ``fnmatch_lines`` takes them).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from pytest_kvconform.contract.clauses import clause_from_test_name
from pytest_kvconform.faults import plants
from pytest_kvconform.workers import protocol
from tests.standin_backends import StandIn


def _owner(target: str) -> tuple[Any, str]:
    """(object, attribute name) for a dotted ``module[.Class].attribute`` path."""
    parts = target.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            owner: Any = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for part in parts[split:-1]:
            owner = getattr(owner, part)
        return owner, parts[-1]
    raise ValueError(f"{target!r} names no importable module")


class Seeder:
    """Plants faults for one test; its ``monkeypatch`` undoes them afterwards."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._monkeypatch = monkeypatch

    def replace(self, target: str, value: object) -> None:
        """Replace ``target`` (``package.module[.Class].name``) with ``value``."""
        owner, name = _owner(target)
        getattr(owner, name)  # a typo is an AttributeError here, not a silent no-op
        self._monkeypatch.setattr(owner, name, value)

    def wrap(self, target: str, make: Callable[[Any], object]) -> None:
        """Replace ``target`` with ``make(original)``: a fault that delegates to production."""
        owner, name = _owner(target)
        self._monkeypatch.setattr(owner, name, make(getattr(owner, name)))

    def plant(self, patches: Sequence[plants.Patch]) -> None:
        """Plant one of the package's faults (``faults/plants.py``) for this test."""
        for holder, name, value in plants.replacements(patches):
            self._monkeypatch.setattr(holder, name, value)

    def worker_fault(self, fault: str) -> None:
        """Seed a fault in the KV-A workers (``hang``, ``die``, ``oom``, ...)."""
        self._monkeypatch.setenv(protocol.FAULT_ENV, fault)


def backends_conftest(backends: Mapping[str, type | str]) -> str:
    """Conftest text registering ``backends`` through the plugin's hook: importable classes,
    or ``"module:Class"`` specs (the hook's other form, which may name a missing module).
    A stand-in (``tests.standin_backends.StandIn``) is registered as a subclass whose
    ``get_name()`` answers the name it is registered under; any other class as it is."""
    lines, values = [], []
    for i, (name, backend) in enumerate(backends.items()):
        if isinstance(backend, str):
            values.append(repr(backend))
        else:
            lines.append(f"from {backend.__module__} import {backend.__qualname__} as _b{i}")
            values.append(f"_named(_b{i}, {name!r})" if issubclass(backend, StandIn)
                          else f"_b{i}")
    if lines:  # xdist workers and subprocess runs lack this process's sys.path entry for tests/
        root = str(Path(__file__).resolve().parents[1])
        lines[:0] = ["import sys", "", f"if {root!r} not in sys.path:",
                     f"    sys.path.insert(0, {root!r})", "",
                     "from tests.standin_backends import named as _named", ""]
    mapping = ", ".join(f"{name!r}: {value}" for name, value in zip(backends, values, strict=True))
    return "\n".join([*lines, "", "", "def pytest_kvconform_backends(config):",
                      f"    return {{{mapping}}}", ""])


def register_backends(pytester: pytest.Pytester, backends: Mapping[str, type | str]) -> None:
    """Register stand-in backends for the pytester runs of this test."""
    pytester.makeconftest(backends_conftest(backends))


def backend_args(*names: str) -> list[str]:
    """``--kv-backend NAME`` for each name."""
    return [arg for name in names for arg in ("--kv-backend", name)]


def failed_clauses(result: pytest.RunResult) -> list[str]:
    """The clause of every failed test in an inline run, sorted."""
    _passed, _skipped, failed = result.reprec.listoutcomes()  # type: ignore[attr-defined]
    return sorted(str(clause_from_test_name(r.nodeid.rsplit("::", 1)[-1])) for r in failed)


def expect_run(result: pytest.RunResult, *, failed: int = 0, passed: int = 0,
               skipped: int = 0, clauses: Iterable[str] | None = None,
               lines: Sequence[str] = (), in_order: bool = True) -> None:
    """The run's outcome counts; with ``clauses``, exactly those clauses' tests failed (a
    clause once per failed test); ``lines`` must appear in stdout (in order unless not)."""
    result.assert_outcomes(failed=failed, passed=passed, skipped=skipped)
    if clauses is not None:
        assert failed_clauses(result) == sorted(clauses), result.stdout.str()[-3000:]
    if lines and in_order:
        result.stdout.fnmatch_lines(list(lines), consecutive=False)
    elif lines:
        result.stdout.fnmatch_lines_random(list(lines))


def literal(text: str) -> str:
    """An fnmatch pattern: ``*`` stays a wildcard, ``[`` and ``?`` are literal."""
    return text.replace("[", "[[]").replace("?", "[?]")
