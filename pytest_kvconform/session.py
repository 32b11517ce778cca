"""The state of one ``--kv-conformance`` run, registered as a plugin by ``plugin.py``.

Discovery, cases, parametrisation, expected failures, the results and the
report all live here, so that ``plugin.py`` stays free of heavy imports.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from pytest_kvconform import cases as cases_mod
from pytest_kvconform import compat
from pytest_kvconform.discovery import Discovery, DiscoveryError, describe_error, discover
from pytest_kvconform.faults import ERROR_KIND_PROPERTY, harness_kind
from pytest_kvconform.model import (
    SKIP_KIND_PROPERTY,
    BackendUnderTest,
    Case,
    clause_from_test_name,
)
from pytest_kvconform.omni_plugins import load_plugins, restore_plugins_env, set_plugins_env
from pytest_kvconform.options import Options
from pytest_kvconform.outcomes import ClauseFailure, ErrorKind

NO_BACKEND_ID = "no-backend"
# How pytest prefixes a ClauseFailure's message in a crash line.
_FAILURE_PREFIX = f"{ClauseFailure.__module__}.{ClauseFailure.__qualname__}: "
XFAIL_PROPERTY = "kv_xfail"
SUITE_DIR = Path(__file__).resolve().parent / "suite"
HOOK_NAME = "pytest_kvconform_backends"


class KvSession:
    """Per-run state; pytest hooks on the instance run only with --kv-conformance."""

    def __init__(self, config: pytest.Config, options: Options,
                 xfails: list[Any] | None = None) -> None:
        self.config = config
        self.options = options
        self.discovery = Discovery()
        self.cases: list[Case] = []
        self.results: list[dict[str, Any]] = []
        self.xfails: list[Any] = list(xfails or [])  # parsed at start-up (plugin.py)
        self.completion = _Completion()
        # describe() ids of xfail entries that named a collected test (any process).
        self.xfail_matched: set[str] = set()
        self.discovery_seconds = 0.0
        self.all_backend_names: set[str] = set()
        self.fault: str | None = None
        self.device = "cpu"
        self.gpu_ids: list[str] = []
        self.plugins: Any = None  # omni_plugins.PluginLoad, after pytest_sessionstart
        self._plugins_env = set_plugins_env(options.plugins)
        self._setup_device()
        from pytest_kvconform import workers

        workers.hold()  # the KV-A worker pool lives until pytest_unconfigure

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        """Close the KV-A worker pool (unless a pytester-hosting test still holds it)."""
        from pytest_kvconform import workers

        workers.release()
        if self._logging_level_set:
            os.environ.pop("VLLM_LOGGING_LEVEL", None)
        restore_plugins_env(self._plugins_env)

    @property
    def device_kind(self) -> str:
        """``cpu`` or ``cuda``, what xfail entries condition on."""
        return self.device.split(":")[0]

    # -- set-up -----------------------------------------------------------------

    def _setup_device(self) -> None:
        # vLLM logs every config it builds at INFO; the suite builds hundreds.
        # Restored in pytest_unconfigure.
        self._logging_level_set = "VLLM_LOGGING_LEVEL" not in os.environ
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from pytest_kvconform import devices

        try:
            request = devices.parse_device_option(self.options.device)
        except devices.DeviceError as exc:
            raise pytest.UsageError(str(exc)) from None
        workerinput = getattr(self.config, "workerinput", None)
        if workerinput is not None and "kvconform_device" in workerinput:
            self.device = devices.apply_worker_device(workerinput)
            self.gpu_ids = list(workerinput.get("kvconform_gpu_ids") or [])
        else:
            self.gpu_ids = devices.visible_gpu_ids(os.environ,
                                                   devices.count_gpus_without_cuda_init)
            try:
                self.device = devices.torch_device_for(request, self.gpu_ids)
            except devices.DeviceError as exc:
                raise pytest.UsageError(str(exc)) from None
        from pytest_kvconform import xdist_hooks

        xdist_hooks.register_xdist_hooks(self.config)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        from pytest_kvconform import workers

        try:
            self.fault = workers.active_fault()
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
        if self.fault and self.options.strict:
            raise pytest.UsageError(f"--kv-strict: refusing to qualify with the seeded worker "
                                    f"fault ${workers.FAULT_ENV}={self.fault} set")
        try:
            self.cases = cases_mod.load_cases(self.options.cases)
        except cases_mod.CaseFileError as exc:
            raise pytest.UsageError(f"--kv-cases: {exc}") from None
        started = time.monotonic()
        hook_results = self._hook_backends()
        try:
            with warnings.catch_warnings():
                # Importing backends imports torch and vLLM, whose own deprecation
                # warnings would otherwise print before the session starts.
                warnings.simplefilter("ignore", DeprecationWarning)
                self.plugins = load_plugins(self.options.plugins)
                self.discovery = discover(hook_results, origins=self.plugins)
        except DiscoveryError as exc:
            raise pytest.UsageError(f"kvconform: {exc}") from None
        self.discovery_seconds = time.monotonic() - started
        self._select_backends()

    def _hook_backends(self) -> list[Any]:
        """Every ``pytest_kvconform_backends`` result; one that raises is a usage error
        naming the implementation and its module, not an INTERNALERROR."""
        hook = self.config.hook.pytest_kvconform_backends
        try:
            return list(hook(config=self.config))
        except Exception as exc:
            raise pytest.UsageError(_hook_failure(hook.get_hookimpls(), exc)) from None

    def _select_backends(self) -> None:
        self.all_backend_names = set(self.discovery.names)
        wanted = self.options.backends
        if not wanted:
            return
        available = self.discovery.names
        unknown = [name for name in wanted if name not in available]
        if unknown:
            listing = ", ".join(available) or "(none: " + "; ".join(self.discovery.notes) + ")"
            raise pytest.UsageError(f"--kv-backend: unknown backend {', '.join(unknown)}; "
                                    f"available backends: {listing}")
        self.discovery.backends = [b for b in self.discovery.backends if b.name in wanted]

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        v = compat.versions()
        backends = self.discovery.backends
        importable = sum(b.importable for b in backends)
        lines = [
            f"kvconform: vllm {v['vllm']}, vllm-omni {v['vllm-omni'] or 'not installed'}, "
            f"torch {v['torch']}; device {self.device}",
            f"kvconform: {len(backends)} backends ({importable} importable) discovered in "
            f"{self.discovery_seconds:.1f}s: {', '.join(b.name for b in backends) or '-'}",
            f"kvconform: {len(self.cases)} cases: {', '.join(c.id for c in self.cases)}",
        ]
        lines += [f"kvconform: note: {note}" for note in self.discovery.notes]
        lines += self.plugins.header_lines() if self.plugins is not None else []
        broken = compat.production_import_error()
        if broken:
            lines.append(f"kvconform: WARNING: vllm-omni's production control plane does not "
                         f"import; clauses that drive it will fail: {broken}")
        if self.fault:
            lines.append(f"kvconform: WARNING: seeded worker fault {self.fault!r} is active "
                         "(KVCONFORM_WORKER_FAULT); results do not qualify anything")
        return lines

    # -- collection -------------------------------------------------------------

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        names = metafunc.fixturenames
        if "kv_backend" in names:
            backends: list[Any] = list(self.discovery.backends)
            ids = [b.name for b in backends]
            if not backends:
                reason = "; ".join(self.discovery.notes) or "no backend discovered"
                backends, ids = [_NoBackend(reason)], [NO_BACKEND_ID]
            metafunc.parametrize("kv_backend", backends, ids=ids)
        if "kv_layout" in names:
            metafunc.parametrize("kv_layout", compat.LAYOUT_NAMES, ids=compat.LAYOUT_NAMES)
        if "kv_need" in names:
            metafunc.parametrize("kv_need", [False, True], ids=["need_False", "need_True"])
        if "kv_case" in names:
            marker = metafunc.definition.get_closest_marker("kv_cases")
            selected = [c for c in self.cases if marker is None or marker.args[0](c)]
            metafunc.parametrize("kv_case", selected, ids=[c.id for c in selected])

    # tryfirst: every collected test counts for stale-entry detection, also those
    # that -k or -m deselect afterwards.
    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        versions = _versions_for_xfails()  # once, not per item
        for item in items:
            props = item_properties(item, self.device)
            if props is None:
                continue
            self.completion.collected += 1  # before -k / -m / --deselect
            item.user_properties.extend(props.items())
            if not self.xfails:
                continue
            from pytest_kvconform.xfails import first_match

            entry = first_match(self.xfails, backend=props["kv_backend"],
                                clause=props["kv_clause"], case=props["kv_case"],
                                layout=props["kv_layout"], versions=versions,
                                device_kind=self.device_kind,
                                test=getattr(item, "originalname", item.name))
            if entry is not None:
                self.xfail_matched.add(entry.describe())
                # Kept on the item too: a declared test that skips still names its entry.
                item.user_properties.append((XFAIL_PROPERTY, entry.describe()))
                item.add_marker(pytest.mark.xfail(reason=f"known: {entry.reason} "
                                                  f"[{entry.describe()}]",
                                                  strict=self.options.strict))

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.completion.selected = sum(1 for item in session.items
                                       if any(k == "kv_clause" for k, _ in item.user_properties))
        self.completion.counted = True

    # -- results ----------------------------------------------------------------

    @pytest.hookimpl(wrapper=True, tryfirst=True)  # outermost: after skipping.py's xfail
    def pytest_runtest_makereport(self, item: pytest.Item,
                                  call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
        """A harness fault carries its kind, and no xfail entry absorbs it uninvited."""
        report = yield
        if call.excinfo is None or not any(k == "kv_clause" for k, _ in item.user_properties):
            return report
        if call.when == "call":
            # Anything in the test body, not only the check run_check wraps: a worker
            # that cannot start for the test is the harness too.
            kind = dict(report.user_properties).get(ERROR_KIND_PROPERTY)
            if kind is None and (found := harness_kind(call.excinfo.value)) is not None:
                kind = found.value
                # On the item too: the teardown report (JUnit XML's properties) copies it.
                item.user_properties.append((ERROR_KIND_PROPERTY, kind))
                report.user_properties.append((ERROR_KIND_PROPERTY, kind))
        else:  # a fixture of the suite's failed: always the harness, never the backend
            kind = (harness_kind(call.excinfo.value) or ErrorKind.HARNESS).value
            report.user_properties = [(k, v) for k, v in report.user_properties
                                      if k != ERROR_KIND_PROPERTY]
            if not report.skipped or getattr(report, "wasxfail", None) is not None:
                report.user_properties.append((ERROR_KIND_PROPERTY, kind))
            else:
                kind = None  # a skip raised by a fixture is a skip
        if kind is not None and getattr(report, "wasxfail", None) is not None:
            entry = self._xfail_entry(dict(report.user_properties).get(XFAIL_PROPERTY))
            if entry is None or not entry.absorbs_error(kind):
                report.outcome = "failed"
                del report.wasxfail
        return report

    def _xfail_entry(self, described: str | None) -> Any:
        return next((e for e in self.xfails if e.describe() == described), None)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        record = result_record(report)
        if record is not None:
            self.results.append(record)

    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        self.completion.interruption = str(excinfo.value).strip() or excinfo.typename

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        from pytest_kvconform import report as report_mod

        if getattr(self.config, "workerinput", None) is not None:
            return
        tr = terminalreporter
        tr.section("kvconform: backend x clause")
        for line in report_mod.render_terminal_matrix(self.results, self.backend_dicts()):
            tr.write_line(line)
        errors = [r for r in self.results if r["status"] == "error"]
        if errors:
            kinds = sorted({r.get("error_kind") or "harness" for r in errors})
            tr.write_line(f"kvconform: {len(errors)} harness error(s) ({', '.join(kinds)}): the "
                          "harness failed, not the backend", red=True)
        for entry in self.stale_xfails():
            tr.write_line(f"kvconform: warning: stale xfail entry {entry.describe()} matched no "
                          "test", yellow=True)
        if self.completion.verdict_line:
            tr.write_line(f"kvconform: verdict: {self.completion.verdict_line}")
        if self.completion.report_line:
            tr.write_line(self.completion.report_line)
        if self.completion.report_error:
            tr.write_line(f"kvconform: ERROR: {self.completion.report_error}", red=True,
                          bold=True)

    def stale_xfails(self) -> list[Any]:
        if not self.xfails:
            return []
        from pytest_kvconform import xfails

        selected = set(self.discovery.names)
        # An entry for a backend left out by --kv-backend is not stale, just unselected.
        candidates = [e for e in self.xfails if e.backend == "*" or e.backend in selected
                      or e.backend not in self.all_backend_names]
        return xfails.stale_entries(candidates, self.xfail_matched,
                                    versions=_versions_for_xfails(),
                                    device_kind=self.device_kind)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """xdist controller: collect the entries each worker matched at collection, and
        the suite's collected / selected counts (every worker collects the same tests)."""
        output = getattr(node, "workeroutput", None) or {}
        self.xfail_matched.update(output.get("kvconform_xfail_matched", ()))
        counts = output.get("kvconform_counts")
        if counts:
            self.completion.collected, self.completion.selected = counts
            self.completion.counted = True

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        workeroutput = getattr(self.config, "workeroutput", None)
        if workeroutput is not None:  # an xdist worker: hand matches to the controller
            workeroutput["kvconform_xfail_matched"] = sorted(self.xfail_matched)
            workeroutput["kvconform_counts"] = [self.completion.collected,
                                                self.completion.selected]
            return
        from pytest_kvconform import report as report_mod

        strict = self.options.strict
        selection = self.selection()
        run = report_mod.run_record(
            run_id=self.completion.run_id, started=self.completion.started_iso,
            duration_s=time.monotonic() - self.completion.started,
            interruption=self._interruption(session, exitstatus))
        verdict, uncovered = report_mod.judge(self.results, strict, selection, run)
        self.completion.verdict_line = report_mod.verdict_text(verdict, uncovered, selection,
                                                               run, self.results)
        if strict and verdict != "qualified" and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if self.options.report is None and not self.report_wanted:
            return
        environment = report_mod.environment_info(self.options.raw, seed=None)
        if self.plugins is not None:
            environment["plugins"] = self.plugins.as_dict()
        self.built_report = report_mod.build_report(
            environment=environment, backends=self.backend_dicts(), results=self.results,
            options=self.options.raw, strict=strict, selection=selection, run=run)
        if self.options.report is None:
            return
        try:
            json_path, md_path = report_mod.write_report(self.options.report, self.built_report)
        except (OSError, report_mod.ReportError) as exc:
            detail: Any = exc
            if isinstance(exc, OSError) and exc.strerror:
                detail = exc.strerror + (f": {exc.filename}" if exc.filename else "")
            self.completion.report_error = (f"the report could not be written to "
                                            f"{self.options.report}: {detail}")
            if session.exitstatus == 0:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
            return
        self.completion.report_line = f"kvconform: report written to {json_path} and {md_path}"

    report_wanted = False  # `kvconform run` sets it: build the report even without a path
    built_report: dict[str, Any] | None = None

    def selection(self) -> dict[str, Any]:
        """What part of the matrix this run selected (see ``report.selection_record``)."""
        from pytest_kvconform import report as report_mod

        option = self.config.option
        names = set(self.discovery.names)
        return report_mod.selection_record(
            keyword=getattr(option, "keyword", None), markexpr=getattr(option, "markexpr", None),
            paths=_narrowing_args(self.config), backends=self.discovery.names,
            excluded_backends=sorted(self.all_backend_names - names),
            collected=self.completion.collected_or_none(),
            selected=self.completion.selected_or_none())

    def _interruption(self, session: pytest.Session, exitstatus: int) -> str | None:
        done = self.completion
        if done.interruption:
            return done.interruption
        if self.config.option.collectonly:
            return "--collect-only: no test ran"
        if exitstatus == pytest.ExitCode.INTERRUPTED:
            return str(session.shouldstop or "interrupted")
        selected = done.selected_or_none()
        ran = len({r["nodeid"] for r in self.results})
        stop = session.shouldstop or session.shouldfail
        if stop and selected is not None and ran < selected:
            return str(stop)
        return None

    def backend_dicts(self) -> list[dict[str, Any]]:
        return [b.record() for b in self.discovery.backends]


class _Completion:
    """Whether the whole matrix ran: counts, interruption, and the verdict once known."""

    def __init__(self) -> None:
        import uuid

        from pytest_kvconform.report import now_iso

        self.run_id = uuid.uuid4().hex
        self.started = time.monotonic()
        self.started_iso = now_iso()
        self.collected = 0  # suite tests, before -k / -m / --deselect
        self.selected = 0  # suite tests, after
        self.counted = False  # collection finished here (or an xdist worker reported)
        self.interruption: str | None = None
        self.verdict_line = ""
        self.report_error: str | None = None
        self.report_line = ""

    def collected_or_none(self) -> int | None:
        return self.collected if self.counted else None

    def selected_or_none(self) -> int | None:
        return self.selected if self.counted else None


def _narrowing_args(config: pytest.Config) -> list[str]:
    """Arguments that collect only part of the suite (a file, a node id, an --ignore)."""
    whole, narrowing = False, []
    base = config.invocation_params.dir
    for arg in config.args:
        path = (base / arg.split("::")[0]).resolve()
        if (path == SUITE_DIR and "::" not in arg) or path in SUITE_DIR.parents:
            whole = True
        elif path == SUITE_DIR or SUITE_DIR in path.parents:
            narrowing.append(arg)
    if not whole and not narrowing:
        narrowing.append("(the suite was not collected)")
    option = config.option
    for flag, values in (("--ignore", getattr(option, "ignore", None)),
                         ("--ignore-glob", getattr(option, "ignore_glob", None))):
        for value in values or ():
            path = (base / value).resolve()
            if "*" in value or path == SUITE_DIR or SUITE_DIR in path.parents:
                narrowing.append(f"{flag} {value}")
    return [] if whole and not narrowing else narrowing


def _hook_failure(impls: list[Any], exc: BaseException) -> str:
    """``pytest_kvconform_backends hook in conftest.py (line 4) raised ValueError: x``."""
    by_code = {getattr(impl.function, "__code__", None): impl for impl in impls}
    impl, where = None, ""
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        impl = impl or by_code.get(code)
        if impl is not None:
            where = f"{code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    if impl is None:
        return f"kvconform: a {HOOK_NAME} hook raised {describe_error(exc)}"
    module = getattr(impl.plugin, "__file__", None) or impl.plugin_name
    name = impl.function.__qualname__
    what = f"the {HOOK_NAME} hook" + (f" {name}" if name != HOOK_NAME else "")
    return f"kvconform: {what} in {module} raised {describe_error(exc)} (at {where})"


class _NoBackend(BackendUnderTest):
    """Stands in when no backend could be discovered, so the reason is reported."""

    def __init__(self, reason: str) -> None:
        super().__init__(NO_BACKEND_ID, "", "none", error=reason)


def _versions_for_xfails() -> dict[str, str | None]:
    v = compat.versions()
    return {"vllm": v["vllm"], "vllm_omni": v["vllm-omni"]}


def item_properties(item: pytest.Item, device: str) -> dict[str, Any] | None:
    """Clause, backend, case and layout of a suite test; None for other tests."""
    clause = clause_from_test_name(item.name)
    if clause is None or not hasattr(item, "callspec"):
        return None
    params = item.callspec.params
    backend = params.get("kv_backend")
    case = params.get("kv_case")
    if backend is not None:
        backend_name = backend.name
    elif "kv_need" in params:  # the control plane's explicit seam, per declared need
        backend_name = f"need_{params['kv_need']}"
    else:
        backend_name = None
    return {
        "kv_clause": clause,
        "kv_backend": backend_name,
        "kv_case": case.id if case is not None else None,
        "kv_layout": params.get("kv_layout"),
        "kv_device": device,
    }


def result_record(report: pytest.TestReport) -> dict[str, Any] | None:
    """One result row for the report, from the report of a suite test's phase."""
    props = dict(report.user_properties)
    if "kv_clause" not in props:
        return None
    wasxfail = getattr(report, "wasxfail", None)
    error_kind = props.get(ERROR_KIND_PROPERTY)
    if report.when == "call":
        if wasxfail is not None:
            status = "xfailed" if report.skipped else "xpassed"
        elif report.failed and error_kind is not None:
            status = "error"  # the harness failed here, not the backend
        else:
            status = report.outcome
    elif report.failed:
        status = "error"
    elif report.skipped and report.when == "setup":
        status = "xfailed" if wasxfail is not None else "skipped"
    else:
        return None
    reason = ""
    if status == "skipped" and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
    elif status in ("failed", "error"):
        crash = getattr(report.longrepr, "reprcrash", None)
        reason = crash.message if crash is not None else str(report.longrepr)
        reason = reason.removeprefix(_FAILURE_PREFIX)
    elif wasxfail is not None:
        reason = str(wasxfail).removeprefix("reason: ")
    return {
        "nodeid": report.nodeid,
        "backend": props.get("kv_backend"),
        "clause": props["kv_clause"],
        "case": props.get("kv_case"),
        "layout": props.get("kv_layout"),
        "device": props.get("kv_device"),
        "status": status,
        "reason": reason,
        "duration_s": round(report.duration, 4),
        "skip_kind": props.get(SKIP_KIND_PROPERTY),
        "xfail": props.get(XFAIL_PROPERTY),
        "error_kind": error_kind if status in ("error", "xfailed") else None,
    }
