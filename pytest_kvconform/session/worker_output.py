"""What production printed for its KV-A deployments, as a run reports it (workers/worker_log.py).

Registered as a plugin by :class:`~pytest_kvconform.session.run.KvSession`.  Production's
worker processes print vLLM's log lines (a warning for every config a deployment builds,
on some hosts), and so does its code the harness runs between tests; none of it is a
finding of the run, and none of it may land between pytest's progress dots.  So it is
read from the files it went to when the run ends: one line in the terminal summary says
how much there was, ``-v`` shows every message, and the report keeps them
(``environment.worker_log``), as the import log's.  Under xdist each worker hands its own
to the controller (``workeroutput``), which reports them all, each source prefixed with
the xdist worker's id.

It also names the production entry point the run's KV-A workers said they run
(``adapters/entry_points.py``; each worker detects it at start-up, where production's
worker is imported anyway), so the test process never imports production's worker
only to name it.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_kvconform.adapters import run_env
from pytest_kvconform.session.options import Options
from pytest_kvconform.workers import pool, worker_log

OUTPUT_KEY = "kvconform_worker_log"  # workeroutput: an xdist worker's messages
ENTRY_POINT_KEY = "kvconform_entry_point"  # workeroutput: what its KV-A workers reported
PLUGIN_NAME = "kvconform-worker-output"
# How long the end of the run waits for the workers' last teardowns (their output with it).
SETTLE_S = 10.0


class KvWorkerOutput:
    """What this run's KV-A workers (and, under xdist, each xdist worker's) printed."""

    def __init__(self, config: pytest.Config, options: Options) -> None:
        self.config = config
        self.options = options
        self.start = worker_log.mark()  # before this run starts any worker
        self.own: list[dict[str, Any]] | None = None  # None until the run ended
        self.remote: dict[str, list[dict[str, Any]]] = {}  # xdist worker id -> its messages
        self._handed_before = pool.handed_out()[0]
        # What this run's KV-A workers reported (``pool.handed_out``); None if none ran.
        self.entry_point: dict[str, Any] | None = None

    def finish(self) -> None:
        """The run ended: read what was printed since it started (an xdist worker hands it
        to its controller)."""
        pool.settle(SETTLE_S)
        self.own = worker_log.since(self.start)
        handed, entry_point = pool.handed_out()
        if handed > self._handed_before:
            self.entry_point = entry_point
        workeroutput = getattr(self.config, "workeroutput", None)
        if workeroutput is not None:
            workeroutput[OUTPUT_KEY] = self.own
            workeroutput[ENTRY_POINT_KEY] = self.entry_point

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """xdist controller: an xdist worker's messages."""
        output = getattr(node, "workeroutput", None) or {}
        self.entry_point = self.entry_point or output.get(ENTRY_POINT_KEY)
        messages = output.get(OUTPUT_KEY)
        if messages is not None:
            worker = str((getattr(node, "workerinput", None) or {}).get("workerid", "?"))
            self.remote[worker] = messages

    def record(self) -> list[dict[str, Any]] | None:
        """Every message, this process's first, then each xdist worker's (its id before
        each source); None before the run ended."""
        if self.own is None and not self.remote:
            return None
        messages = list(self.own or [])
        for worker in sorted(self.remote):
            messages += [{**m, worker_log.SOURCE_KEY: f"{worker} {m.get(worker_log.SOURCE_KEY)}"}
                         for m in self.remote[worker]]
        return messages

    def path_line(self) -> str | None:
        """Which production entry point KV-A (and KV-L6) handed the configs to, as the
        run's KV-A workers reported it; None when no KV-A worker ran."""
        if self.entry_point is None:
            return None
        from pytest_kvconform.adapters import entry_points

        chain = entry_points.reported(self.entry_point).chain(entry_points.UNI)
        return f"kvconform: KV-A worker path: {chain}"

    def summary_lines(self) -> list[str]:
        """The terminal summary's account: the worker path, then one line for what the
        workers printed (every message with ``-v``)."""
        path = self.path_line()
        printed = run_env.printed_lines(self.record() or [], "production's KV-A workers printed",
                                        worker_log.WORKER_LOG_KEY,
                                        verbose=self.config.getoption("verbose", 0) > 0,
                                        report=self.options.report is not None)
        return ([path] if path else []) + printed
