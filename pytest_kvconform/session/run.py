"""The state of one ``--kv-conformance`` run, registered as a plugin by ``plugin.py``.

The run itself lives here: the device and GPU ids, the plugins' environment, the
KV-A worker pool's lifetime, the seeded-fault policy and the header.  What the run
selected (``selection.py``), what it found (``results.py``) and what its KV-A
workers printed (``worker_output.py``) are collaborators it creates and registers as
plugins of their own, so that each concern's hooks sit with its state and ``plugin.py``
stays free of heavy imports.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from pytest_kvconform.adapters import compat, heap, run_env
from pytest_kvconform.adapters.omni_plugins import restore_plugins_env, set_plugins_env
from pytest_kvconform.contract import inert
from pytest_kvconform.faults import pid_marking
from pytest_kvconform.session.options import Options
from pytest_kvconform.session.results import KvResults
from pytest_kvconform.session.selection import KvSelection, import_error_line
from pytest_kvconform.session.worker_output import PLUGIN_NAME as WORKER_OUTPUT_PLUGIN
from pytest_kvconform.session.worker_output import KvWorkerOutput
from pytest_kvconform.workers import forkserver, protocol, tempdirs

SELECTION_PLUGIN = "kvconform-selection"
RESULTS_PLUGIN = "kvconform-results"


class KvSession:
    """Per-run state; pytest hooks on the instance run only with --kv-conformance."""

    def __init__(self, config: pytest.Config, options: Options,
                 known: Any = None, signals: Any = None) -> None:
        self.config = config
        self.options = options
        # No collections while the stack imports (adapters/heap.py); resumed after
        # discovery.  The cleanup thaws what discovery and pytest_collection_finish froze;
        # added now, during the first configure hooks, so it runs last, after pytest's own
        # end-of-run collections (unraisableexception's, at unconfigure and in its cleanup).
        self._collector_was_on: bool | None = heap.pause()
        config.add_cleanup(self._thaw)
        self.fault: str | None = None
        self.device = "cpu"
        self.gpu_ids: list[str] = []
        # What runs whose processes are gone left in $TMPDIR (SIGKILL): the controller's job.
        self.swept = [] if hasattr(config, "workerinput") else tempdirs.sweep()
        # First: from here on a Ctrl-C still ends with a verdict and a report (KvResults).
        self.selection = KvSelection(config, options, self.device, known)
        self.worker_output = KvWorkerOutput(config, options)  # before any worker starts
        self.results = KvResults(config, options, self.selection, self.worker_output,
                                 signals=signals)
        config.pluginmanager.register(self.selection, SELECTION_PLUGIN)
        config.pluginmanager.register(self.results, RESULTS_PLUGIN)
        config.pluginmanager.register(self.worker_output, WORKER_OUTPUT_PLUGIN)
        self._setup_device()
        self._plugins_env = set_plugins_env(options.plugins)  # after the CPU platform's env
        self.selection.device = self.device
        from pytest_kvconform.workers import pool as workers

        workers.hold()  # the KV-A worker pool lives until pytest_unconfigure

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        """Close the KV-A worker pool (unless a pytester-hosting test still holds it)."""
        from pytest_kvconform.workers import pool as workers

        workers.release()
        run_env.restore(self._env_added)
        restore_plugins_env(self._plugins_env)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """What the KV-A workers printed is read (before the results' report, which keeps it)."""
        self.worker_output.finish()

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """Imports and collection done: keep their objects out of the tests' collections."""
        heap.freeze()

    def _thaw(self) -> None:
        self._resume_collector()  # a run that ended before discovery did
        heap.thaw()

    def _resume_collector(self) -> None:
        if self._collector_was_on is not None:
            heap.resume(self._collector_was_on)
            self._collector_was_on = None

    # `kvconform run` (cli.py) asks for the report through the session plugin.
    @property
    def report_wanted(self) -> bool:
        """Build the report even without ``--kv-report``."""
        return self.results.report_wanted

    @report_wanted.setter
    def report_wanted(self, wanted: bool) -> None:
        self.results.report_wanted = wanted

    @property
    def built_report(self) -> dict[str, Any] | None:
        """The report built at the end of the run, if one was wanted."""
        return self.results.built_report

    # -- set-up -----------------------------------------------------------------

    def _setup_device(self) -> None:
        # Before anything imports vLLM (see run_env); restored in pytest_unconfigure.
        self._env_added = run_env.apply()
        from pytest_kvconform.workers import devices

        try:
            request = devices.parse_device_option(self.options.device)
        except devices.DeviceError as exc:
            raise pytest.UsageError(str(exc)) from None
        workerinput = getattr(self.config, "workerinput", None)
        if workerinput is not None and "kvconform_device" in workerinput:
            self.device = devices.apply_worker_device(workerinput)
            self.gpu_ids = list(workerinput.get("kvconform_gpu_ids") or [])
            shared = workerinput.get(forkserver.SHARE_KEY)
            if shared and self.device == "cpu":  # fork from the controller's server
                forkserver.attach(shared)
        else:
            self.gpu_ids = devices.visible_gpu_ids(os.environ,
                                                   devices.count_gpus_without_cuda_init)
            try:
                self.device = devices.torch_device_for(request, self.gpu_ids)
            except devices.DeviceError as exc:
                raise pytest.UsageError(str(exc)) from None
        if self.device == "cpu":  # production's CPU platforms, before vLLM is imported
            self._env_added += run_env.apply(run_env.CPU_DEFAULTS)
        from pytest_kvconform.session import xdist as xdist_hooks

        xdist_hooks.register_xdist_hooks(self.config)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        """Refuse a strict run under a seeded fault, then discover (before collection)."""
        from pytest_kvconform.workers import fault_tally

        try:
            self.fault = fault_tally.active_fault()
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
        try:
            pid_marking.check_piddir()
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
        if self.fault and self.options.strict:
            raise pytest.UsageError(f"--kv-strict: refusing to qualify with the seeded worker "
                                    f"fault ${protocol.FAULT_ENV}={self.fault} set")
        try:
            self.selection.start()
        finally:
            self._resume_collector()  # the stack is imported: what it made is frozen

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        v = compat.versions()
        lines = [f"kvconform: vllm {v['vllm']}, vllm-omni {v['vllm-omni'] or 'not installed'}, "
                 f"torch {v['torch']}; device {self.device}", release_line(v)]
        lines += self.selection.header_lines()
        env_line = run_env.header_line(self._env_added)
        if env_line:
            lines.append(env_line)
        broken = None if self.selection.remote else compat.production_import_error()
        if broken:
            lines.append(import_error_line(broken))
        if self.swept:
            lines.append(f"kvconform: removed {len(self.swept)} temporary "
                         f"{'directory' if len(self.swept) == 1 else 'directories'} left by "
                         f"ended runs: {', '.join(os.path.basename(p) for p in self.swept)}")
        if self.fault:
            lines.append(f"kvconform: WARNING: seeded worker fault {self.fault!r} is active "
                         "(KVCONFORM_WORKER_FAULT); results do not qualify anything")
        return [inert.terminal(line) for line in lines]  # discovery quotes backends' errors


def release_line(versions: dict[str, str | None]) -> str:
    """Whether the installed stack is one the shipped release table qualifies, and if not
    what to install (the extras this package's metadata pins)."""
    from importlib import metadata

    from pytest_kvconform.report import release_table
    from pytest_kvconform.report.schema import ReportError

    try:
        table = release_table.load()
    except ReportError as exc:
        return f"kvconform: release table: not read ({exc.message})"
    try:
        requires = metadata.requires("pytest-kvconform") or []
    except metadata.PackageNotFoundError:  # run from a checkout, not installed
        requires = []
    return release_table.header_line(table, versions, release_table.extras(requires))
