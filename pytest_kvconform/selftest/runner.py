"""The ``kvconform selftest`` process: the stack prepared once, the runs, the verdicts.

This process imports the stack, loads the plugins and discovers the backends once (what
that prints is captured), starts the KV-A workers' fork server when a fault needs workers,
decides which faults the installed version can take, and hands every run (each seedable
fault's, and one clean baseline per group) to ``forked.py``; then judges each fault
(``verdict.py``).  SIGTERM unwinds as Ctrl-C does, so the children and the server stop.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pytest_kvconform.adapters import run_env
from pytest_kvconform.api import CheckResult
from pytest_kvconform.contract import clauses as clauses_mod
from pytest_kvconform.contract.records import BackendUnderTest
from pytest_kvconform.faults import registry as fault_registry
from pytest_kvconform.faults.registry import Fault
from pytest_kvconform.selftest.catches import FaultResult, SelftestRun, judge
from pytest_kvconform.selftest.forked import DEVICE, Selection, Task, run_all, selection
from pytest_kvconform.workers import forkserver, lifetime

DEFAULT_TIMEOUT_S = 600.0  # one fault's (or baseline's) run, seeding to last result
DEFAULT_JOBS = 2  # runs at once: a KV-A run mostly waits on its workers
_SOURCE = "selftest"


def _needs_workers(faults: Sequence[Fault]) -> bool:
    return any(check.needs_workers for fault in faults
               for clause in clauses_mod.select(fault.clauses) for check in clause.checks)


@dataclass(frozen=True)
class _Stack:
    """What this process prepared before forking: the fork server as a child attaches to
    it, how many messages the imports printed, the registry's backends."""

    server: Mapping[str, Any] | None
    printed: int
    registry: tuple[BackendUnderTest, ...]


@contextlib.contextmanager
def _prepared(faults: Sequence[Fault]) -> Iterator[_Stack]:
    """The stack imported, plugins loaded, backends discovered here (once, before any child
    is forked; what that prints is captured); the KV-A workers' fork server started if a
    fault's checks need workers."""
    from pytest_kvconform.adapters import discovery, omni_plugins, vllm_registry
    from pytest_kvconform.workers import handle, protocol

    started_server = _needs_workers(faults) and forkserver.start(
        handle.server_preload(protocol.PRELOAD))  # its imports overlap ours
    if started_server:
        forkserver.acquire()
    try:
        with run_env.captured_output() as messages:
            for name in handle.server_preload(protocol.PRELOAD):
                with contextlib.suppress(ImportError):
                    importlib.import_module(name)
            omni_plugins.load_plugins("production")
            named = {f.backend for f in faults if f.backend is not None}
            registry, _ = discovery.registry_backends(named)  # only those the checks run on
            registry += vllm_registry.registry_backends(named)[0]
            for fault in faults:
                for clause in clauses_mod.select(fault.clauses):
                    for check in clause.checks:
                        check.resolve()
        if started_server:
            forkserver.wait_ready(protocol.STARTUP_TIMEOUT_S)
        gc.freeze()  # the children share these pages: no collection copies them
        try:
            yield _Stack(forkserver.share() if started_server else None, len(messages),
                         tuple(registry))
        finally:
            gc.unfreeze()
    finally:
        if started_server:
            forkserver.release()


def _backend_records(names: set[str | None], registry: Sequence[BackendUnderTest]) -> tuple[
        dict[str | None, BackendUnderTest], dict[str, str]]:
    """Each backend a fault's checks run on, and why one cannot be used here."""
    records: dict[str | None, BackendUnderTest] = {}
    unusable: dict[str, str] = {}
    by_name = {b.name: b for b in registry}
    for name in names:
        if name is None:  # the clauses take no backend: a placeholder nothing reads
            records[None] = BackendUnderTest("(none)", "", _SOURCE)
            continue
        found = _standin(name) or by_name.get(name)
        if found is None:
            unusable[name] = f"its checks run on {name}, which is not in the registry here"
        elif not found.importable:
            unusable[name] = f"its checks run on {name}, which does not import here: " \
                             f"{found.error}"
        else:
            records[name] = found
    return records, unusable


def _standin(name: str) -> BackendUnderTest | None:
    from pytest_kvconform.adapters import paged_standins

    cls = paged_standins.STANDINS.get(name)
    if cls is None:
        return None
    return BackendUnderTest(name, f"{cls.__module__}:{cls.__qualname__}", _SOURCE, cls=cls)


def _baselines(seedable: Sequence[Fault]) -> list[Task]:
    """One clean run per group (corrections, backend, cases), over its faults' clauses."""
    groups: dict[tuple[Any, ...], set[str]] = {}
    for fault in seedable:
        groups.setdefault(selection(fault).group, set()).update(fault.clauses)
    tasks = []
    for (beside, backend, cases), wanted in groups.items():
        ordered = tuple(c.id for c in clauses_mod.select(sorted(wanted)))
        chosen = Selection(backend, cases, ordered, beside)
        label = "/".join([*beside, backend or "no-backend", *cases])
        tasks.append(Task(label, chosen, None))
    return tasks


def _chosen(faults: Sequence[str | Fault] | None) -> list[Fault]:
    """Registry names looked up (none: the whole registry), records taken as they are."""
    if not faults:
        return fault_registry.select(None)
    names = [f for f in faults if isinstance(f, str)]
    known = {f.name: f for f in fault_registry.select(names)} if names else {}
    chosen = [known[f] if isinstance(f, str) else f for f in faults]
    twice = sorted({f.name for f in chosen if [g.name for g in chosen].count(f.name) > 1})
    if twice:
        raise ValueError(f"selftest: fault {', '.join(twice)} given more than once")
    return chosen


def run(faults: Sequence[str | Fault] | None = None, *, jobs: int = DEFAULT_JOBS,
        timeout: float = DEFAULT_TIMEOUT_S,
        progress: Callable[[str], None] = lambda line: None) -> SelftestRun:
    """Seed each fault (a registry name or a :class:`Fault`; all of the registry when None)
    in a child of its own; judge each against the clean baseline.  An unknown name raises
    ValueError before anything is imported."""
    chosen = _chosen(faults)
    if jobs < 1:
        raise ValueError(f"selftest: jobs={jobs}; expected 1 or more")
    started = time.monotonic()
    undo_sigterm = lifetime.terminate_as_interrupt()  # SIGTERM unwinds as Ctrl-C does:
    try:                                              # the children and the server stop
        with run_env.applied(), run_env.applied(run_env.CPU_DEFAULTS), \
                _prepared(chosen) as stack:
            return _run_prepared(chosen, stack, jobs, timeout, progress, started)
    finally:
        if undo_sigterm is not None:
            undo_sigterm()


def _run_prepared(chosen: Sequence[Fault], stack: _Stack, jobs: int, timeout: float,
                  progress: Callable[[str], None], started: float) -> SelftestRun:
    """The runs, forked from this prepared process, and their verdicts."""
    from pytest_kvconform.adapters import compat

    prepare_s = round(time.monotonic() - started, 2)
    progress(f"stack imported, plugins loaded, backends discovered in {prepare_s:.1f}s "
             f"({stack.printed} import messages)")
    backends, unusable = _backend_records({f.backend for f in chosen}, stack.registry)
    why_not = {f.name: unusable.get(f.backend or "") or f.unseedable() for f in chosen}
    seedable = [f for f in chosen if why_not[f.name] is None]
    baselines = _baselines(seedable)
    seeded = {f.name: Task(f.name, selection(f), f) for f in seedable}
    outputs = run_all([*baselines, *seeded.values()], backends, stack.server, jobs, timeout,
                      progress)
    found = SelftestRun(compat.versions(), [], import_messages=stack.printed,
                        prepare_s=prepare_s, jobs=jobs, device=DEVICE)
    clean: dict[tuple[Any, ...], dict[str, CheckResult]] = {}
    for task in baselines:
        output = outputs[task]
        if output.results is None:
            found.baseline_errors.append(f"{task.label}: {output.error}")
        found.baseline.extend(output.results or [])
        clean[task.selection.group] = {r.test: r for r in output.results or []}
    for fault in chosen:
        reason = why_not[fault.name]
        if reason is not None:
            found.faults.append(FaultResult(fault, "unseedable", reason))
            continue
        output = outputs[seeded[fault.name]]
        if output.results is None:
            found.faults.append(FaultResult(fault, "error", f"its run failed: {output.error}",
                                            duration_s=output.duration_s))
        else:
            outcome, detail = judge(output.results, clean.get(selection(fault).group, {}))
            found.faults.append(FaultResult(fault, outcome, detail, tuple(output.results),
                                            output.duration_s))
    found.duration_s = round(time.monotonic() - started, 2)
    return found
