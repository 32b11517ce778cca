"""``kvconform selftest``: does the suite still catch the known production faults here?

For each fault of the registry (``adapters/fault_registry.py``), one at a time and in a
fresh process: seed it into the installed stack, run the checks of the clauses that guard
it (:func:`~pytest_kvconform.api.check_backend`: the suite's checks and its one outcome
rule), and call it **caught** when one of their results fails that passes on the clean
install.  The clean baseline runs once per selection (backend, cases, the clauses of every
fault that runs there), in a process of its own too.  A fault the installed version cannot
take (its module does not import, the statement it rewrites is gone, the backend its checks
run on does not import) is **unseedable**, with the reason; it is never counted caught.

Processes: importing vLLM / vllm-omni costs 20-45 s, so this process imports the stack,
loads the plugins and discovers the backends once, and every run (a fault's, a baseline's)
is a child forked from it afterwards (multiprocessing's ``fork``: a copy of a process that
imported everything and seeded nothing).  The KV-A workers those children drive are forked
from one fork server this process starts (``workers/forkserver.py``), which every child
attaches to.  A child never outlives this process (parent-death signal and lifeline,
``workers/lifetime.py``), is killed at its time limit, and writes its output to a log whose
tail an error quotes.  The checks run on the CPU.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pytest_kvconform.adapters import fault_registry, run_env
from pytest_kvconform.adapters.fault_registry import Fault
from pytest_kvconform.api import CheckResult, check_backend
from pytest_kvconform.contract import clauses as clauses_mod
from pytest_kvconform.contract.records import BackendUnderTest
from pytest_kvconform.workers import forkserver, lifetime, tempdirs

Outcome = Literal["caught", "missed", "unseedable", "error"]
DEVICE = "cpu"
DEFAULT_TIMEOUT_S = 600.0  # one fault's (or baseline's) run, seeding to last result
DEFAULT_JOBS = 2  # runs at once: a KV-A run mostly waits on its workers
EXIT_ALL_CAUGHT = 0
EXIT_NOT_ALL_CAUGHT = 1
SCHEMA = "kvconform-selftest/1"
_LOG_TAIL_CHARS = 3000
_SOURCE = "selftest"


@dataclass(frozen=True)
class Selection:
    """What one run checks: a backend (None: the clauses check none), cases, clauses; with
    the worker corrections ``beside`` in place."""

    backend: str | None
    cases: tuple[str, ...]
    clauses: tuple[str, ...]
    beside: tuple[str, ...] = ()

    @property
    def group(self) -> tuple[tuple[str, ...], str | None, tuple[str, ...]]:
        """The baseline it is compared with: same corrections, backend and cases."""
        return self.beside, self.backend, self.cases

    def describe(self) -> str:
        parts = [self.backend or "no backend", "/".join(self.cases), ", ".join(self.clauses)]
        if self.beside:
            parts.append(f"beside {', '.join(self.beside)}")
        return "; ".join(parts)


def selection(fault: Fault) -> Selection:
    return Selection(fault.backend, fault.cases, fault.clauses, fault.beside)


@dataclass(frozen=True)
class FaultResult:
    """One fault's verdict: ``detail`` is the result that caught it, why it was missed, or
    why it cannot be seeded here."""

    fault: Fault
    outcome: Outcome
    detail: str
    results: tuple[CheckResult, ...] = ()
    duration_s: float = 0.0


@dataclass
class SelftestRun:
    """Everything one ``kvconform selftest`` found."""

    versions: dict[str, str | None]
    faults: list[FaultResult]
    baseline: list[CheckResult] = field(default_factory=list)
    baseline_errors: list[str] = field(default_factory=list)
    import_messages: int = 0
    prepare_s: float = 0.0
    duration_s: float = 0.0
    jobs: int = 1

    @property
    def seedable(self) -> list[FaultResult]:
        return [r for r in self.faults if r.outcome != "unseedable"]

    @property
    def caught(self) -> list[FaultResult]:
        return [r for r in self.faults if r.outcome == "caught"]

    @property
    def exit_code(self) -> int:
        """0 when every seedable fault was caught, else 1."""
        return EXIT_ALL_CAUGHT if len(self.caught) == len(self.seedable) else EXIT_NOT_ALL_CAUGHT


# --- the verdict --------------------------------------------------------------------------------


def judge(seeded: Sequence[CheckResult], clean: Mapping[str, CheckResult]) -> tuple[Outcome, str]:
    """Caught when a guarding result fails under the fault and passes clean (by test id);
    otherwise missed, saying what the guarding results did instead."""
    caught = [r for r in seeded if r.status == "failed"
              and clean.get(r.test) is not None and clean[r.test].status == "passed"]
    if caught:
        first = caught[0]
        return "caught", (f"{len(caught)} of {len(seeded)} guarding results fail that pass "
                          f"clean; first {first.test}: {_first_line(first.message)}")
    if not seeded:
        return "missed", "no guarding check ran (the clauses select nothing for this backend " \
                         "and these cases)"
    counts: dict[str, int] = {}
    notes: list[str] = []
    for r in seeded:
        before = clean.get(r.test)
        if r.status == "failed" and before is None:
            key = "failed with no clean result to compare"
        elif r.status == "failed":
            key = f"failed on the clean install too ({before.status if before else '?'})"
            if len(notes) < 1:
                notes.append(f"{r.test} clean: {_first_line(before.message if before else '')}")
        elif r.status == "error":
            key = f"error ({r.error_kind.value if r.error_kind else 'harness'})"
            if len(notes) < 1:
                notes.append(f"{r.test}: {_first_line(r.message)}")
        else:
            key = r.status
        counts[key] = counts.get(key, 0) + 1
    summary = ", ".join(f"{n} {key}" for key, n in counts.items())
    detail = f"none of its {len(seeded)} guarding results fails where the clean install " \
             f"passes: {summary}"
    return "missed", detail + (f"; {notes[0]}" if notes else "")


def _first_line(text: str, limit: int = 400) -> str:
    line = text.strip().splitlines()[0] if text.strip() else "(no message)"
    return line if len(line) <= limit else line[:limit - 3] + "..."


# --- one run, in a forked child -------------------------------------------------------------------


@dataclass(frozen=True)
class _Task:
    label: str
    selection: Selection
    fault: Fault | None  # None: the clean baseline of the selection's group

    def seeded(self) -> contextlib.AbstractContextManager[None]:
        if self.fault is None:
            return fault_registry.worker_faults(self.selection.beside)
        return self.fault.seeded()


def _run_checks(task: _Task, backends: Mapping[str | None, BackendUnderTest]) -> list[CheckResult]:
    """The task's checks, with its fault (or its baseline's corrections) in place."""
    chosen = task.selection
    with task.seeded():
        return check_backend(backends[chosen.backend], cases=list(chosen.cases),
                             clauses=list(chosen.clauses), device=DEVICE)


def _child_main(task: _Task, backends: Mapping[str | None, BackendUnderTest], conn: Any,
                lifeline: Any, parent_pid: int, shared: Mapping[str, Any] | None,
                log_path: str) -> None:
    """A forked child: tie to the parent, log to a file, run, send the results back."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when a child stops
    lifetime.tie_to_parent(parent_pid, lifeline)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Python's streams onto those descriptors too (a caller's may write elsewhere: pytest's).
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    forkserver.attach_after_fork(shared)
    try:
        reply: tuple[str, Any] = ("ok", _run_checks(task, backends))
    except BaseException:  # reported by the parent as this run's error
        traceback.print_exc()
        reply = ("error", traceback.format_exc())
    finally:
        tempdirs.remove()
    conn.send(reply)


@dataclass
class _Output:
    results: list[CheckResult] | None
    error: str | None
    duration_s: float


class _Child:
    """The parent's end of one run."""

    def __init__(self, task: _Task, backends: Mapping[str | None, BackendUnderTest],
                 shared: Mapping[str, Any] | None, logdir: str) -> None:
        context: Any = multiprocessing.get_context("fork")
        self.task = task
        name = f"{'clean' if task.fault is None else 'seeded'}-{task.label.replace('/', '_')}"
        self.log_path = os.path.join(logdir, f"{name}.log")
        self.conn, child_conn = context.Pipe(duplex=False)
        lifeline, self._lifeline = context.Pipe(duplex=False)
        self.process = context.Process(
            target=_child_main, name=f"kvconform-selftest-{task.label}",  # not daemonic:
            # a child starts KV-A workers of its own; the parent kills it when it is done
            args=(task, backends, child_conn, lifeline, os.getpid(), shared, self.log_path))
        self.started = time.monotonic()
        self.process.start()
        child_conn.close()
        lifeline.close()

    def poll(self, timeout: float) -> _Output | None:
        """The run's output once it is done (or failed, or over ``timeout``), else None."""
        elapsed = round(time.monotonic() - self.started, 2)
        if self.conn.poll():
            try:
                status, value = self.conn.recv()
            except (EOFError, OSError):
                return self._finish(_Output(None, self._died(), elapsed))
            if status == "ok":
                return self._finish(_Output(list(value), None, elapsed))
            return self._finish(_Output(None, str(value), elapsed))
        if not self.process.is_alive():
            return self._finish(_Output(None, self._died(), elapsed))
        if elapsed > timeout:
            self.kill()
            return self._finish(_Output(None, f"did not finish within {timeout:.0f}s and was "
                                              f"killed\n{self._log_tail()}", elapsed))
        return None

    def _died(self) -> str:
        self.process.join(5)
        code = self.process.exitcode
        how = f"exit code {code}" if code is None or code >= 0 else \
            f"killed by {signal.Signals(-code).name}"
        return f"its process ended without a result ({how})\n{self._log_tail()}"

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - _LOG_TAIL_CHARS))
                return "--- its output (tail) ---\n" + f.read().decode("utf-8", "replace")
        except OSError:
            return "(no output)"

    def _finish(self, output: _Output) -> _Output:
        self.process.join(10)
        self.kill()
        self.conn.close()
        self._lifeline.close()
        return output

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


def _run_all(tasks: Sequence[_Task], backends: Mapping[str | None, BackendUnderTest],
             shared: Mapping[str, Any] | None, jobs: int, timeout: float,
             progress: Callable[[str], None]) -> dict[_Task, _Output]:
    """Every task in a child of its own, ``jobs`` at a time; their outputs."""
    logdir = tempdirs.make("selftest")  # its logs' tails are in the outputs: removed after
    pending = list(tasks)
    running: list[_Child] = []
    outputs: dict[_Task, _Output] = {}
    try:
        while pending or running:
            while pending and len(running) < jobs:
                running.append(_Child(pending.pop(0), backends, shared, logdir))
            multiprocessing.connection.wait(
                [c.conn for c in running] + [c.process.sentinel for c in running], 1.0)
            for child in list(running):
                output = child.poll(timeout)
                if output is None:
                    continue
                running.remove(child)
                outputs[child.task] = output
                progress(_progress_line(child.task, output, len(outputs), len(tasks)))
    finally:
        for child in running:
            child.kill()
        shutil.rmtree(logdir, ignore_errors=True)
    return outputs


def _progress_line(task: _Task, output: _Output, done: int, total: int) -> str:
    what = "clean" if task.fault is None else "seeded"
    if output.results is None:
        ran = f"error: {_first_line(output.error or '')}"
    else:
        statuses: dict[str, int] = {}
        for r in output.results:
            statuses[r.status] = statuses.get(r.status, 0) + 1
        ran = ", ".join(f"{n} {s}" for s, n in statuses.items()) or "no results"
    return f"[{done}/{total}] {what} {task.label}: {ran} ({output.duration_s:.1f}s)"


# --- this process: the stack, once ------------------------------------------------------------


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
    import importlib

    from pytest_kvconform.adapters import discovery, omni_plugins
    from pytest_kvconform.workers import pool, protocol

    started_server = _needs_workers(faults) and forkserver.start(
        pool.server_preload(protocol.PRELOAD))  # its imports overlap ours
    if started_server:
        forkserver.acquire()
    try:
        with run_env.captured_output() as messages:
            for name in pool.server_preload(protocol.PRELOAD):
                with contextlib.suppress(ImportError):
                    importlib.import_module(name)
            omni_plugins.load_plugins("production")
            registry, _ = discovery.registry_backends()
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


def _baselines(seedable: Sequence[Fault]) -> list[_Task]:
    """One clean run per group (corrections, backend, cases), over its faults' clauses."""
    groups: dict[tuple[Any, ...], set[str]] = {}
    for fault in seedable:
        groups.setdefault(selection(fault).group, set()).update(fault.clauses)
    tasks = []
    for (beside, backend, cases), wanted in groups.items():
        ordered = tuple(c.id for c in clauses_mod.select(sorted(wanted)))
        chosen = Selection(backend, cases, ordered, beside)
        label = "/".join([*beside, backend or "no-backend", *cases])
        tasks.append(_Task(label, chosen, None))
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
    seeded = {f.name: _Task(f.name, selection(f), f) for f in seedable}
    outputs = _run_all([*baselines, *seeded.values()], backends, stack.server, jobs,
                       timeout, progress)
    found = SelftestRun(compat.versions(), [], import_messages=stack.printed,
                        prepare_s=prepare_s, jobs=jobs)
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


# --- what it prints and writes ---------------------------------------------------------------


def summary_line(found: SelftestRun) -> str:
    seedable, caught = found.seedable, found.caught
    line = f"kvconform selftest: caught {len(caught)}/{len(seedable)} seedable faults"
    missed = [r.fault.name for r in seedable if r.outcome != "caught"]
    if missed:
        line += f"; not caught: {', '.join(missed)}"
    unseedable = [r.fault.name for r in found.faults if r.outcome == "unseedable"]
    if unseedable:
        line += f"; {len(unseedable)} not seedable here: {', '.join(unseedable)}"
    return f"{line} ({found.duration_s:.0f}s)"


def render(found: SelftestRun) -> str:
    """The terminal account: the stack, one line per fault, the verdict."""
    v = found.versions
    lines = [f"kvconform selftest: vllm {v.get('vllm')}, vllm-omni {v.get('vllm-omni')}, torch "
             f"{v.get('torch')}; {len(found.faults)} faults, each seeded in a fresh process "
             f"({found.jobs} at a time), its guarding clauses checked on {DEVICE} against the "
             "clean baseline"]
    lines += [f"kvconform selftest: clean baseline error: {_first_line(e)}"
              for e in found.baseline_errors]
    width = max((len(r.fault.name) for r in found.faults), default=0)
    for r in found.faults:
        lines.append(f"{r.outcome:<10} {r.fault.name:<{width}}  "
                     f"[{', '.join(r.fault.clauses)}]  {_first_line(r.detail, 240)}")
    lines.append(summary_line(found))
    return "\n".join(lines) + "\n"


def as_json(found: SelftestRun) -> dict[str, Any]:
    """The run as plain JSON values."""
    def result(r: CheckResult) -> dict[str, Any]:
        return {"test": r.test, "clause": r.clause, "status": r.status, "message": r.message,
                "skip_kind": r.skip_kind.value if r.skip_kind else None,
                "error_kind": r.error_kind.value if r.error_kind else None,
                "via": r.via}

    return {
        "schema": SCHEMA,
        "environment": {"versions": found.versions, "device": DEVICE,
                        "import_messages": found.import_messages},
        "summary": {"faults": len(found.faults), "seedable": len(found.seedable),
                    "caught": len(found.caught), "exit_code": found.exit_code,
                    "prepare_s": found.prepare_s, "duration_s": found.duration_s,
                    "jobs": found.jobs},
        "faults": [{"name": r.fault.name, "family": r.fault.family, "seeded": r.fault.how,
                    "what": r.fault.what, "clauses": list(r.fault.clauses),
                    "backend": r.fault.backend, "cases": list(r.fault.cases),
                    "beside": list(r.fault.beside), "outcome": r.outcome, "detail": r.detail,
                    "duration_s": r.duration_s, "results": [result(x) for x in r.results]}
                   for r in found.faults],
        "baseline": [result(r) for r in found.baseline],
        "baseline_errors": found.baseline_errors,
    }
