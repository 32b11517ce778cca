"""The results of one ``--kv-conformance`` run: rows, verdict, summary and report.

Registered as a plugin by :class:`~pytest_kvconform.session.run.KvSession`.  Each suite
test's reports become typed :class:`~pytest_kvconform.contract.records.ResultRow` rows (a
harness fault classified on the way, so no xfail entry absorbs it uninvited; a failure
no known finding describes stays a failure, naming the entry it differs from; a test
whose xdist worker died becomes a ``worker-died`` error; a test that drove its KV-A
workers under a seeded fault says so); at the end of the run they are judged against
the selection and, as mappings, handed to ``report/build.py`` for the terminal matrix, the
verdict and the report files.  A run interrupted before its session started (Ctrl-C
while plugins and vllm-omni load) is judged there and then: pytest calls no
``pytest_sessionfinish`` for it.

What a row is lives in :mod:`~pytest_kvconform.session.result_rows`; which known finding
declares an outcome, in :mod:`~pytest_kvconform.session.xfail_outcomes`.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any

import pytest

from pytest_kvconform.adapters import run_env
from pytest_kvconform.contract import inert
from pytest_kvconform.contract.clauses import ROOT_CLAUSE, subject_of
from pytest_kvconform.contract.outcome_rule import ERROR_KIND_PROPERTY, harness_kind
from pytest_kvconform.contract.outcomes import ErrorKind, bracketed
from pytest_kvconform.contract.records import (
    CAUSED_BY_PROPERTY,
    SEEDED_FAULT_PROPERTY,
    ResultRow,
)
from pytest_kvconform.session import failure_repr
from pytest_kvconform.session.options import Options
from pytest_kvconform.session.result_rows import (
    prefix_crash,
    properties_from_id,
    result_row,
    test_function_of,
)
from pytest_kvconform.session.selection import SUITE_DIR, KvSelection
from pytest_kvconform.session.worker_output import KvWorkerOutput
from pytest_kvconform.session.xfail_outcomes import (
    failure_problems,
    known_error,
    known_failure,
    known_skip,
)
from pytest_kvconform.workers.lifetime import RunSignals
from pytest_kvconform.workers.worker_log import WORKER_LOG_KEY


class KvResults:
    """Result rows as the suite runs, then the verdict and the report (controller only)."""

    report_wanted = False  # `kvconform run` sets it: build the report even without a path
    built_report: dict[str, Any] | None = None

    def __init__(self, config: pytest.Config, options: Options,
                 selection: KvSelection, worker_output: KvWorkerOutput | None = None,
                 signals: RunSignals | None = None) -> None:
        from pytest_kvconform.report.build import now_iso

        self.config = config
        self.signals = signals  # the run's SIGTERM / SIGINT (lifetime.RunSignals)
        self.options = options
        self.selection = selection
        self.worker_output = worker_output  # what the KV-A workers printed
        self.rows: list[ResultRow] = []
        self.run_id = uuid.uuid4().hex
        self.started = time.monotonic()
        self.started_iso = now_iso()
        self.interruption: str | None = None
        self.verdict_line = ""
        self.stack_lines: list[str] = []  # the stack's line, and what bites each backend
        self.other_failures = 0  # failed reports of tests beside the suite (a repo's own)
        self._declaration_failed: set[str] = set()  # backends whose KV-L1 failed here
        self.report_error: str | None = None
        self.report_line = ""
        # pytest_sessionstart finished, so pytest_sessionfinish will come; until then an
        # interrupt is judged in pytest_keyboard_interrupt.
        self.session_started = False
        self.concluded = False
        self._faults_before: dict[str, int] | None = None  # fault_tally.faulted_commands()
        # xdist controller: each suite test's properties, from the first report of it
        # (a crashed worker's test gets no report of its own with them).
        self._properties: dict[str, list[tuple[str, Any]]] = {}

    def row_dicts(self) -> list[dict[str, Any]]:
        """The rows as ``report/build.py`` takes them (it also reads reports from files)."""
        return [row.as_dict() for row in self.rows]

    # -- during the run ---------------------------------------------------------

    @pytest.hookimpl(wrapper=True)
    def pytest_sessionstart(self, session: pytest.Session) -> Generator[None, None, None]:
        yield  # raises when a hook was interrupted (or failed): then no sessionfinish comes
        self.session_started = True

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        from pytest_kvconform.workers import fault_tally

        self._faults_before = fault_tally.faulted_commands()

    @pytest.hookimpl(wrapper=True, tryfirst=True)  # outermost: after skipping.py's xfail
    def pytest_runtest_makereport(self, item: pytest.Item,
                                  call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
        """A harness fault carries its kind, and no xfail entry absorbs it uninvited; a
        known finding absorbs only the failure (or declares only the skip) it describes;
        a test that drove its KV-A workers under a seeded fault names it."""
        report = yield
        if not any(k == "kv_clause" for k, _ in item.user_properties):
            return report
        self._classify(item, call, report)
        failure_repr.make_inert(report)
        return report

    def _classify(self, item: pytest.Item, call: pytest.CallInfo[None],
                  report: pytest.TestReport) -> None:
        self._mark_seeded_fault(item, report)
        if report.skipped and getattr(report, "wasxfail", None) is None:
            known_skip(report, self.selection.item_entries.get(item.nodeid, []))
            _skip_at_suite_id(report)
            return
        if call.excinfo is None:
            return
        if call.when == "call":
            # Anything in the test body, not only the check run_check wraps: a worker
            # that cannot start for the test is the harness too.
            kind: Any = dict(report.user_properties).get(ERROR_KIND_PROPERTY)
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
        if kind is not None:
            self._caused_by_backend(item, report, call.excinfo.value)
        entries = self.selection.item_entries.get(item.nodeid, [])
        if kind is not None and getattr(report, "wasxfail", None) is not None:
            known_error(report, entries, kind)
        elif getattr(report, "wasxfail", None) is not None and call.excinfo is not None:
            known_failure(report, entries, failure_problems(call.excinfo.value))
        if report.failed:
            self._depends_on_declaration(item, report)

    def _caused_by_backend(self, item: pytest.Item, report: pytest.TestReport,
                           exc: BaseException) -> None:
        """A harness error the backend's own code caused (``HarnessError.caused_by``: a call
        into its class that hung, ended its process or asked for the memory) says so, and
        counts for the backend: a guard of the stack run on it (KV-L8, KV-A4) never shows
        it as the stack's regression."""
        caused_by = getattr(exc, "caused_by", None)
        if not isinstance(caused_by, str) or any(k == CAUSED_BY_PROPERTY
                                                 for k, _ in report.user_properties):
            return
        report.user_properties.append((CAUSED_BY_PROPERTY, caused_by))
        if not any(k == CAUSED_BY_PROPERTY for k, _ in item.user_properties):
            item.user_properties.append((CAUSED_BY_PROPERTY, caused_by))
        props = dict(item.user_properties)
        if subject_of(test_function_of(item.nodeid)) == "stack":
            prefix_crash(report, f"caused by {props.get('kv_backend')}'s own code "
                                 f"({caused_by}): it counts for the backend, not the stack")

    def _depends_on_declaration(self, item: pytest.Item, report: pytest.TestReport) -> None:
        """A failure of a backend whose declaration (KV-L1) already failed in this process
        says it depends on it (the verdict groups them whatever the order)."""
        props = dict(item.user_properties)
        backend, clause = props.get("kv_backend"), props.get("kv_clause")
        if backend not in self._declaration_failed or clause == ROOT_CLAUSE:
            return
        note = f"depends on {ROOT_CLAUSE}, which failed for {backend}"
        report.sections.append(("kvconform: root cause", f"{note}: its other results use the "
                                "declaration, so fix that first"))
        prefix_crash(report, note)

    def _mark_seeded_fault(self, item: pytest.Item, report: pytest.TestReport) -> None:
        """Commands went to the KV-A workers under a seeded fault during this test: its
        reports (this one, and through the item the ones after it) name the fault."""
        from pytest_kvconform.workers import fault_tally

        if self._faults_before is None:
            return
        faults = fault_tally.faults_since(self._faults_before)
        if not faults or any(k == SEEDED_FAULT_PROPERTY for k, _ in item.user_properties):
            return
        item.user_properties.append((SEEDED_FAULT_PROPERTY, faults[-1]))
        if not any(k == SEEDED_FAULT_PROPERTY for k, _ in report.user_properties):
            report.user_properties.append((SEEDED_FAULT_PROPERTY, faults[-1]))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "teardown":  # finished: a crash from now on is another test's
            self._properties.pop(report.nodeid, None)
        elif report.nodeid not in self._properties and any(
                k == "kv_clause" for k, _ in report.user_properties):
            self._properties[report.nodeid] = list(report.user_properties)
        row = result_row(report)
        if row is not None:
            self.rows.append(row)
            if row.clause == ROOT_CLAUSE and row.status == "failed" and row.backend:
                self._declaration_failed.add(row.backend)
        elif report.failed:
            self.other_failures += 1

    @pytest.hookimpl(optionalhook=True)
    def pytest_handlecrashitem(self, crashitem: str, report: pytest.TestReport,
                               sched: Any) -> None:
        """xdist: the worker running ``crashitem`` died (SIGKILL, a segfault, an exit).

        xdist reports the test as failed with no properties; it becomes an ``error`` row
        of kind ``worker-died`` naming the test, as a dead KV-A worker's test is.
        """
        props = self._properties.get(crashitem) or self._guess_properties(crashitem)
        if props is None:
            return
        props = [(k, v) for k, v in props if k != ERROR_KIND_PROPERTY]
        props.append((ERROR_KIND_PROPERTY, ErrorKind.WORKER_DIED.value))
        report.user_properties = props
        values = dict(props)
        where = bracketed(backend=values.get("kv_backend"), case=values.get("kv_case"),
                          layout=values.get("kv_layout"))
        report.longrepr = (f"{values['kv_clause']}{where}: harness error (worker-died): "
                           f"{report.longrepr}: the xdist worker process died (a signal such "
                           "as SIGKILL from the kernel's OOM killer, a crash, or an exit); "
                           "xdist replaces it and the run goes on")

    def _guess_properties(self, nodeid: str) -> list[tuple[str, Any]] | None:
        """A crashed test's properties when no report of it arrived (its worker died in
        set-up): guessed from its id with the backends, layouts and cases this run knows."""
        from pytest_kvconform.adapters import compat

        backends = set(self.selection.all_backend_names) | {
            str(r.backend) for r in self.rows if r.backend is not None}
        return properties_from_id(nodeid, backends=backends, layouts=compat.LAYOUT_NAMES,
                                  cases=[c.id for c in self.selection.cases],
                                  device=self.selection.device)

    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        self.interruption = str(excinfo.value).strip() or excinfo.typename
        if not self.session_started:  # no pytest_sessionfinish will come: judge now
            self.interruption = (f"{excinfo.typename} during start-up, before any test was "
                                 "collected")
            self.conclude_interrupted_start()

    def conclude_interrupted_start(self) -> None:
        """Ctrl-C while the run was starting (configure, plugins, discovery): the verdict
        line and, with ``--kv-report``, the report, as a finished run gets them."""
        if self.concluded or getattr(self.config, "workerinput", None) is not None:
            return
        if self.signals is not None:
            self.signals.finishing()
        self._conclude(pytest.ExitCode.INTERRUPTED)
        if self.signals is not None:
            self.signals.settle(pytest.ExitCode.INTERRUPTED)
        lines = [f"kvconform: verdict{self.verdict_line}", self.report_line]
        if self.report_error:
            lines.append(f"kvconform: ERROR: {self.report_error}")
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        for line in filter(None, lines):
            if tr is not None:
                tr.write_line(inert.terminal(line))
            else:  # interrupted before the terminal reporter was configured
                print(inert.terminal(line), file=sys.stdout, flush=True)

    # -- at the end -------------------------------------------------------------

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        from pytest_kvconform.report import build as report_mod

        if getattr(self.config, "workerinput", None) is not None:
            return
        tr = _InertWriter(terminalreporter)
        if self.selection.usage_error:  # an xdist worker's; pytest prints its own like this
            tr.write_line(f"ERROR: {self.selection.usage_error}", red=True, bold=True)
            return
        tr.section("kvconform: backend x clause")
        for line in self.selection.discovery_lines():
            tr.write_line(line)
        for line in report_mod.render_terminal_matrix(self.row_dicts(),
                                                      self.selection.backend_dicts()):
            tr.write_line(line)
        for line in self.worker_output.summary_lines() if self.worker_output else ():
            tr.write_line(line)
        errors = [r for r in self.rows if r.status == "error" and not r.caused_by]
        if errors:
            kinds = sorted({r.error_kind or "harness" for r in errors})
            tr.write_line(f"kvconform: {len(errors)} harness error(s) ({', '.join(kinds)}): the "
                          "harness failed, not the backend", red=True)
        own = [r.as_dict() for r in self.rows if r.status == "error" and r.caused_by]
        if own:
            tr.write_line(f"kvconform: {report_mod.backend_faults_text(own)}: they count for "
                          "the backend, never for the stack", red=True)
        # Only once collection finished: a run stopped before it matched nothing yet.
        from pytest_kvconform.session import xfails

        stale = xfails.stale_summary(self.selection.stale_xfails()
                                     if self.selection.counts.counted else [])
        if stale:
            tr.write_line(f"kvconform: warning: {stale}", yellow=True)
        if self.verdict_line:
            tr.write_line(f"kvconform: verdict{self.verdict_line}")
        for line in self.stack_lines:
            tr.write_line(line)
        if self.report_line:
            tr.write_line(self.report_line)
        if self.report_error:
            tr.write_line(f"kvconform: ERROR: {self.report_error}", red=True, bold=True)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> Generator[None, None, None]:
        """From the first end-of-run hook on, a signal no longer interrupts: the run ends
        with the status its report agrees with (``lifetime.RunSignals``)."""
        if self.signals is not None:
            self.signals.finishing()
        return (yield)

    @pytest.hookimpl(trylast=True, specname="pytest_sessionfinish")  # the verdict, last
    def pytest_sessionfinish_verdict(self, session: pytest.Session, exitstatus: int) -> None:
        if getattr(self.config, "workeroutput", None) is not None:
            return  # an xdist worker: its controller judges (KvSelection hands over counts)
        if self.selection.usage_error:
            session.exitstatus = pytest.ExitCode.USAGE_ERROR
        else:
            status = self._conclude(exitstatus, session)
            if status is not None and session.exitstatus in (pytest.ExitCode.OK,
                                                             pytest.ExitCode.TESTS_FAILED):
                session.exitstatus = status
        if self.signals is not None:  # the report, if any, is on disk: this status is final
            self.signals.settle(int(session.exitstatus))

    def _conclude(self, exitstatus: int, session: pytest.Session | None = None) -> int | None:
        """The verdict lines and (when wanted) the report; the exit status the run must end
        with for them (None: pytest's own stands), see :meth:`_exit_status`."""
        from pytest_kvconform.report import build as report_mod

        self.concluded = True
        strict = self.options.strict
        selection = self.selection.record()
        results = self.row_dicts()
        run = report_mod.run_record(
            run_id=self.run_id, started=self.started_iso,
            duration_s=time.monotonic() - self.started,
            interruption=self._interruption(session, exitstatus))
        plugins = self.selection.plugins_record()
        startup = report_mod.startup_failures(plugins)
        altered = self.selection.judge_altered()  # before the verdict: the code that judges
        verdict, uncovered = report_mod.judge(results, strict, selection, run, startup, altered)
        scope = report_mod.scope_of(selection)
        self.verdict_line = (f" for {', '.join(scope)}" if scope else "") + ": " + \
            report_mod.verdict_text(verdict, uncovered, selection, run, results, startup,
                                    altered)
        self.stack_lines = self._stack_lines(results, scope)
        failed = self._exit_status(verdict, scope, results, startup, selection, run, altered)
        from pytest_kvconform.report import job_summary

        summary = job_summary.wanted()
        if self.options.report is None and not self.report_wanted and not summary:
            return failed
        environment = report_mod.environment_info(self.options.raw, seed=None)
        if plugins is not None:
            environment["plugins"] = plugins
        faults = _seeded_faults(results)
        if faults:
            environment["seeded_faults"] = faults
        import_log = self.selection.import_log_record()
        if import_log is not None:
            environment[run_env.IMPORT_LOG_KEY] = import_log
        worker_log = self.worker_output.record() if self.worker_output else None
        if worker_log is not None:
            environment[WORKER_LOG_KEY] = worker_log
        self.built_report = report_mod.build_report(
            environment=environment, backends=self.selection.backend_dicts(), results=results,
            options=self.options.raw, strict=strict, selection=selection, run=run,
            altered=altered)
        if self.options.report is None:
            self._append_summary(None)
            return failed
        try:
            json_path, md_path, page = report_mod.write_report(self.options.report,
                                                                self.built_report)
        except (OSError, report_mod.ReportError) as exc:
            detail: Any = exc
            if isinstance(exc, OSError) and exc.strerror:
                detail = exc.strerror + (f": {exc.filename}" if exc.filename else "")
            self.report_error = (f"the report could not be written to "
                                 f"{self.options.report}: {detail}")
            return pytest.ExitCode.TESTS_FAILED
        self.report_line = f"kvconform: report written to {json_path}, {md_path} and {page}"
        self._append_summary(page)
        return failed

    def _append_summary(self, page: Path | None) -> None:
        """The verdict and grid in the CI job's summary, where ``$GITHUB_STEP_SUMMARY`` asks."""
        from pytest_kvconform.report import job_summary

        if self.built_report is None or not job_summary.wanted():
            return
        error = job_summary.append(self.built_report, page)
        line = f"kvconform: verdict and grid appended to the job summary (${job_summary.VARIABLE})"
        if error is not None:
            line = f"kvconform: warning: the job summary could not be written: {error}"
        self.report_line = "\n".join(filter(None, (self.report_line, line)))

    def _exit_status(self, verdict: str, scope: list[str] | None,
                     results: Sequence[dict[str, Any]], startup: Sequence[dict[str, Any]],
                     selection: dict[str, Any], run: dict[str, Any],
                     altered: Sequence[str]) -> int | None:
        """1 for a judge altered after start-up, a plugin that stops production, or strict
        and not qualified;
        :data:`~pytest_kvconform.report.verdict.EXIT_NOT_CHECKED` when a backend was not
        checked and nothing else keeps the run from qualifying, strict or not; in a
        backend-scoped run, 1 when its backends fail, else
        :data:`~pytest_kvconform.report.verdict.EXIT_STACK_REGRESSED` when only the stack
        shows something new, else 0 (unless the repository's own tests failed)."""
        from pytest_kvconform.report import build as report_mod

        strict = self.options.strict
        if startup or (altered and verdict != "interrupted"):
            return pytest.ExitCode.TESTS_FAILED
        if not self.other_failures and report_mod.only_not_checked(results, strict, selection,
                                                                   run, startup):
            return report_mod.EXIT_NOT_CHECKED
        if scope is None or verdict == "interrupted":
            return pytest.ExitCode.TESTS_FAILED if strict and verdict != "qualified" else None
        if verdict == "not qualified" or (strict and verdict != "qualified"):
            return pytest.ExitCode.TESTS_FAILED
        if self.other_failures:
            return None
        if report_mod.stack_differs(results, strict):
            return report_mod.EXIT_STACK_REGRESSED
        return pytest.ExitCode.OK

    def _stack_lines(self, results: Sequence[dict[str, Any]],
                     scope: list[str] | None) -> list[str]:
        """The stack's line (its versions and what its results show), and for a
        backend-scoped run what of it bites each named backend in production."""
        from pytest_kvconform.adapters import compat
        from pytest_kvconform.report import build as report_mod

        if not any(r.get("subject") == "stack" for r in results):
            return []
        v = compat.versions()
        lines = [f"kvconform: stack (vllm {v['vllm'] or '-'}, vllm-omni "
                 f"{v['vllm-omni'] or 'not installed'}): {report_mod.stack_text(results)}"]
        for backend in scope or ():
            found = report_mod.bites(results, backend)
            if found:
                lines.append(f"kvconform: {backend} is bitten in production by the stack's "
                             f"findings: {'; '.join(found)}")
        return lines

    def _interruption(self, session: pytest.Session | None, exitstatus: int) -> str | None:
        if self.interruption:
            return self.interruption
        if self.config.option.collectonly:
            return "--collect-only: no test ran"
        if exitstatus == pytest.ExitCode.INTERRUPTED or session is None:
            return str(getattr(session, "shouldstop", None) or "interrupted")
        selected = self.selection.counts.selected_or_none()
        ran = len({r.nodeid for r in self.rows})
        stop = session.shouldstop or session.shouldfail
        if stop and selected is not None and ran < selected:
            return str(stop)
        return None


def _seeded_faults(results: Sequence[dict[str, Any]]) -> list[str]:
    """The seeded worker faults of this run: set for the whole run, or by a test."""
    from pytest_kvconform.workers import fault_tally

    try:
        faults = {fault_tally.active_fault()}
    except ValueError:  # refused at start-up already
        faults = set()
    faults |= {r["seeded_fault"] for r in results}
    return sorted(f for f in faults if f)


def _skip_at_suite_id(report: pytest.TestReport) -> None:
    """A suite test's skip is located by its id's file (``kvconform/test_layout.py:65``),
    as its id reads, not by the installed file's path (a site-packages one in ``-rs``)."""
    if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        path, line, reason = report.longrepr
        if Path(path).parent == SUITE_DIR:
            report.longrepr = (report.nodeid.partition("::")[0], line, reason)




class _InertWriter:
    """The terminal reporter, writing each line of the run's summary inert: the lines name
    backends, quote their errors and read the known-findings file."""

    def __init__(self, terminalreporter: Any) -> None:
        self._tr = terminalreporter

    def section(self, title: str, **markup: Any) -> None:
        self._tr.section(inert.terminal(title), **markup)

    def write_line(self, line: str, **markup: Any) -> None:
        self._tr.write_line(inert.terminal(line), **markup)
