"""Each self-test run in a child forked from the process that imported the stack.

multiprocessing's ``fork``: a copy of a process that imported everything and seeded
nothing, so a run starts in well under a second instead of importing vLLM / vllm-omni
again (20-45 s).  The child seeds its fault (or, for a clean baseline, only the corrections
its group runs beside), runs the checks through :func:`~pytest_kvconform.api.check_backend`
on the CPU, and sends the results back.  Its KV-A workers fork from the fork server its
parent started (``forkserver.attach_after_fork``).  It never outlives its parent
(parent-death signal and lifeline, ``workers/lifetime.py``), ignores Ctrl-C (the parent
stops it), is killed past its time limit, and writes its output to a log whose tail an
error quotes; the logs go when the runs are done.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pytest_kvconform.api import CheckResult, check_backend
from pytest_kvconform.contract.records import BackendUnderTest
from pytest_kvconform.faults import registry as fault_registry
from pytest_kvconform.faults.registry import Fault
from pytest_kvconform.selftest.catches import first_line
from pytest_kvconform.workers import forkserver, lifetime, tempdirs

DEVICE = "cpu"  # where the checks (and the KV-A workers) run
_LOG_TAIL_CHARS = 3000


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


def selection(fault: Fault) -> Selection:
    """What a fault's run checks."""
    return Selection(fault.backend, fault.cases, fault.clauses, fault.beside)


@dataclass(frozen=True)
class Task:
    """One run: a fault's, or (``fault`` None) the clean baseline of a group."""

    label: str
    selection: Selection
    fault: Fault | None  # None: the clean baseline of the selection's group

    def seeded(self) -> contextlib.AbstractContextManager[None]:
        if self.fault is None:
            return fault_registry.worker_faults(self.selection.beside)
        return self.fault.seeded()


def run_checks(task: Task, backends: Mapping[str | None, BackendUnderTest]) -> list[CheckResult]:
    """The task's checks, with its fault (or its baseline's corrections) in place."""
    chosen = task.selection
    with task.seeded():
        return check_backend(backends[chosen.backend], cases=list(chosen.cases),
                             clauses=list(chosen.clauses), device=DEVICE)


def child_main(task: Task, backends: Mapping[str | None, BackendUnderTest], conn: Any,
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
        reply: tuple[str, Any] = ("ok", run_checks(task, backends))
    except BaseException:  # reported by the parent as this run's error
        traceback.print_exc()
        reply = ("error", traceback.format_exc())
    finally:
        tempdirs.remove()
    conn.send(reply)


@dataclass
class Output:
    """What a run sent back: its results, or why there are none."""

    results: list[CheckResult] | None
    error: str | None
    duration_s: float


class Child:
    """The parent's end of one run."""

    def __init__(self, task: Task, backends: Mapping[str | None, BackendUnderTest],
                 shared: Mapping[str, Any] | None, logdir: str) -> None:
        context: Any = multiprocessing.get_context("fork")
        self.task = task
        name = f"{'clean' if task.fault is None else 'seeded'}-{task.label.replace('/', '_')}"
        self.log_path = os.path.join(logdir, f"{name}.log")
        self.conn, child_conn = context.Pipe(duplex=False)
        lifeline, self._lifeline = context.Pipe(duplex=False)
        self.process = context.Process(
            target=child_main, name=f"kvconform-selftest-{task.label}",  # not daemonic:
            # a child starts KV-A workers of its own; the parent kills it when it is done
            args=(task, backends, child_conn, lifeline, os.getpid(), shared, self.log_path))
        self.started = time.monotonic()
        self.process.start()
        child_conn.close()
        lifeline.close()

    def poll(self, timeout: float) -> Output | None:
        """The run's output once it is done (or failed, or over ``timeout``), else None."""
        elapsed = round(time.monotonic() - self.started, 2)
        if self.conn.poll():
            try:
                status, value = self.conn.recv()
            except (EOFError, OSError):
                return self._finish(Output(None, self._died(), elapsed))
            if status == "ok":
                return self._finish(Output(list(value), None, elapsed))
            return self._finish(Output(None, str(value), elapsed))
        if not self.process.is_alive():
            return self._finish(Output(None, self._died(), elapsed))
        if elapsed > timeout:
            self.kill()
            return self._finish(Output(None, f"did not finish within {timeout:.0f}s and was "
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

    def _finish(self, output: Output) -> Output:
        self.process.join(10)
        self.kill()
        self.conn.close()
        self._lifeline.close()
        return output

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


def run_all(tasks: Sequence[Task], backends: Mapping[str | None, BackendUnderTest],
            shared: Mapping[str, Any] | None, jobs: int, timeout: float,
            progress: Callable[[str], None]) -> dict[Task, Output]:
    """Every task in a child of its own, ``jobs`` at a time; their outputs."""
    logdir = tempdirs.make("selftest")  # its logs' tails are in the outputs: removed after
    pending = list(tasks)
    running: list[Child] = []
    outputs: dict[Task, Output] = {}
    try:
        while pending or running:
            while pending and len(running) < jobs:
                running.append(Child(pending.pop(0), backends, shared, logdir))
            multiprocessing.connection.wait(
                [c.conn for c in running] + [c.process.sentinel for c in running], 1.0)
            for child in list(running):
                output = child.poll(timeout)
                if output is None:
                    continue
                running.remove(child)
                outputs[child.task] = output
                progress(progress_line(child.task, output, len(outputs), len(tasks)))
    finally:
        for child in running:
            child.kill()
        shutil.rmtree(logdir, ignore_errors=True)
    return outputs


def progress_line(task: Task, output: Output, done: int, total: int) -> str:
    """One line as each run ends: what its results were, and how long it took."""
    what = "clean" if task.fault is None else "seeded"
    if output.results is None:
        ran = f"error: {first_line(output.error or '')}"
    else:
        statuses: dict[str, int] = {}
        for r in output.results:
            statuses[r.status] = statuses.get(r.status, 0) + 1
        ran = ", ".join(f"{n} {s}" for s, n in statuses.items()) or "no results"
    return f"[{done}/{total}] {what} {task.label}: {ran} ({output.duration_s:.1f}s)"
