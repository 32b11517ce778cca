"""The results of one ``--kv-conformance`` run: rows, verdict, summary and report.

Registered as a plugin by :class:`~pytest_kvconform.session.KvSession`.  Each suite
test's reports become typed :class:`~pytest_kvconform.model.ResultRow` rows (a
harness fault classified on the way, so no xfail entry absorbs it uninvited); at
the end of the run they are judged against the selection and, as mappings, handed
to ``report.py`` for the terminal matrix, the verdict and the report files.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Generator
from typing import Any

import pytest

from pytest_kvconform import run_env
from pytest_kvconform.faults import ERROR_KIND_PROPERTY, harness_kind
from pytest_kvconform.model import SKIP_KIND_PROPERTY, ResultRow
from pytest_kvconform.options import Options
from pytest_kvconform.outcomes import ClauseFailure, ErrorKind
from pytest_kvconform.session_selection import XFAIL_PROPERTY, KvSelection

# How pytest prefixes a ClauseFailure's message in a crash line.
_FAILURE_PREFIX = f"{ClauseFailure.__module__}.{ClauseFailure.__qualname__}: "


class KvResults:
    """Result rows as the suite runs, then the verdict and the report (controller only)."""

    report_wanted = False  # `kvconform run` sets it: build the report even without a path
    built_report: dict[str, Any] | None = None

    def __init__(self, config: pytest.Config, options: Options,
                 selection: KvSelection) -> None:
        from pytest_kvconform.report import now_iso

        self.config = config
        self.options = options
        self.selection = selection
        self.rows: list[ResultRow] = []
        self.run_id = uuid.uuid4().hex
        self.started = time.monotonic()
        self.started_iso = now_iso()
        self.interruption: str | None = None
        self.verdict_line = ""
        self.report_error: str | None = None
        self.report_line = ""

    def row_dicts(self) -> list[dict[str, Any]]:
        """The rows as ``report.py`` takes them (it also reads reports from files)."""
        return [row.as_dict() for row in self.rows]

    # -- during the run ---------------------------------------------------------

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
            entry = self.selection.xfail_entry(dict(report.user_properties).get(XFAIL_PROPERTY))
            if entry is None or not entry.absorbs_error(kind):
                report.outcome = "failed"
                del report.wasxfail
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        row = result_row(report)
        if row is not None:
            self.rows.append(row)

    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        self.interruption = str(excinfo.value).strip() or excinfo.typename

    # -- at the end -------------------------------------------------------------

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        from pytest_kvconform import report as report_mod

        if getattr(self.config, "workerinput", None) is not None:
            return
        tr = terminalreporter
        if self.selection.usage_error:  # an xdist worker's; pytest prints its own like this
            tr.write_line(f"ERROR: {self.selection.usage_error}", red=True, bold=True)
            return
        tr.section("kvconform: backend x clause")
        for line in self.selection.discovery_lines():
            tr.write_line(line)
        for line in report_mod.render_terminal_matrix(self.row_dicts(),
                                                      self.selection.backend_dicts()):
            tr.write_line(line)
        errors = [r for r in self.rows if r.status == "error"]
        if errors:
            kinds = sorted({r.error_kind or "harness" for r in errors})
            tr.write_line(f"kvconform: {len(errors)} harness error(s) ({', '.join(kinds)}): the "
                          "harness failed, not the backend", red=True)
        for entry in self.selection.stale_xfails():
            tr.write_line(f"kvconform: warning: stale xfail entry {entry.describe()} matched no "
                          "test", yellow=True)
        if self.verdict_line:
            tr.write_line(f"kvconform: verdict: {self.verdict_line}")
        if self.report_line:
            tr.write_line(self.report_line)
        if self.report_error:
            tr.write_line(f"kvconform: ERROR: {self.report_error}", red=True, bold=True)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if getattr(self.config, "workeroutput", None) is not None:
            return  # an xdist worker: its controller judges (KvSelection hands over counts)
        if self.selection.usage_error:
            session.exitstatus = pytest.ExitCode.USAGE_ERROR
            return
        from pytest_kvconform import report as report_mod

        strict = self.options.strict
        selection = self.selection.record()
        results = self.row_dicts()
        run = report_mod.run_record(
            run_id=self.run_id, started=self.started_iso,
            duration_s=time.monotonic() - self.started,
            interruption=self._interruption(session, exitstatus))
        verdict, uncovered = report_mod.judge(results, strict, selection, run)
        self.verdict_line = report_mod.verdict_text(verdict, uncovered, selection, run, results)
        if strict and verdict != "qualified" and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if self.options.report is None and not self.report_wanted:
            return
        environment = report_mod.environment_info(self.options.raw, seed=None)
        plugins = self.selection.plugins_record()
        if plugins is not None:
            environment["plugins"] = plugins
        import_log = self.selection.import_log_record()
        if import_log is not None:
            environment[run_env.IMPORT_LOG_KEY] = import_log
        self.built_report = report_mod.build_report(
            environment=environment, backends=self.selection.backend_dicts(), results=results,
            options=self.options.raw, strict=strict, selection=selection, run=run)
        if self.options.report is None:
            return
        try:
            json_path, md_path = report_mod.write_report(self.options.report, self.built_report)
        except (OSError, report_mod.ReportError) as exc:
            detail: Any = exc
            if isinstance(exc, OSError) and exc.strerror:
                detail = exc.strerror + (f": {exc.filename}" if exc.filename else "")
            self.report_error = (f"the report could not be written to "
                                 f"{self.options.report}: {detail}")
            if session.exitstatus == 0:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
            return
        self.report_line = f"kvconform: report written to {json_path} and {md_path}"

    def _interruption(self, session: pytest.Session, exitstatus: int) -> str | None:
        if self.interruption:
            return self.interruption
        if self.config.option.collectonly:
            return "--collect-only: no test ran"
        if exitstatus == pytest.ExitCode.INTERRUPTED:
            return str(session.shouldstop or "interrupted")
        selected = self.selection.counts.selected_or_none()
        ran = len({r.nodeid for r in self.rows})
        stop = session.shouldstop or session.shouldfail
        if stop and selected is not None and ran < selected:
            return str(stop)
        return None


def result_row(report: pytest.TestReport) -> ResultRow | None:
    """One result row, from the report of a suite test's phase; None for other tests
    and for phases that add nothing (a passing setup or teardown)."""
    props: dict[str, Any] = dict(report.user_properties)
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
    return ResultRow(
        nodeid=report.nodeid,
        backend=props.get("kv_backend"),
        clause=props["kv_clause"],
        case=props.get("kv_case"),
        layout=props.get("kv_layout"),
        device=props.get("kv_device"),
        status=status,
        reason=reason,
        duration_s=round(report.duration, 4),
        skip_kind=props.get(SKIP_KIND_PROPERTY),
        xfail=props.get(XFAIL_PROPERTY),
        error_kind=error_kind if status in ("error", "xfailed") else None,
    )

