"""What one ``--kv-conformance`` run selected: backends, cases, parametrisation, xfails.

Registered as a plugin by :class:`~pytest_kvconform.session.run.KvSession`.  Discovery
(hook backends, plugins, ``--kv-backend``), the spec cases, the parametrisation of
the suite, expected-failure marking at collection, the collected / selected counts
(merged from xdist workers) and the stale-entry check all live here, beside the
selection record the verdict needs to tell a whole run from a part of one.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pytest_kvconform.adapters import compat, run_env
from pytest_kvconform.adapters.discovery import Discovery, DiscoveryError, discover
from pytest_kvconform.adapters.omni_plugins import load_plugins
from pytest_kvconform.checks.arguments import FIXTURE, expand
from pytest_kvconform.contract import cases as cases_mod
from pytest_kvconform.contract import inert
from pytest_kvconform.contract.clauses import AXES, check_names, clause_from_test_name
from pytest_kvconform.contract.outcomes import describe_error
from pytest_kvconform.contract.records import NOT_SELECTED, BackendUnderTest, Case
from pytest_kvconform.report.verdict import describe_altered
from pytest_kvconform.session import failure_repr, integrity
from pytest_kvconform.session import xdist as xdist_hooks
from pytest_kvconform.session.options import Options
from pytest_kvconform.workers import isolated

NO_BACKEND_ID = "no-backend"
XFAIL_PROPERTY = "kv_xfail"
DISCOVERY_OUTPUT = "kvconform_discovery"  # workeroutput key: a worker's discovery
ALTERED_OUTPUT = "kvconform_altered"  # workeroutput key: what of the judge a worker saw change
USAGE_ERROR_OUTPUT = "kvconform_usage_error"  # workeroutput key: why a worker ran nothing
SUITE_DIR = Path(__file__).resolve().parents[1] / "suite"
HOOK_NAME = "pytest_kvconform_backends"


@dataclass
class Counts:
    """Suite tests collected (before -k / -m / --deselect) and selected (after)."""

    collected: int = 0
    selected: int = 0
    counted: bool = False  # collection finished here (or an xdist worker reported)
    # Collection got as far as pytest_collection_modifyitems: pytest calls
    # pytest_collection_finish even when a Ctrl-C stopped collecting half-way.
    modified: bool = False

    def collected_or_none(self) -> int | None:
        return self.collected if self.counted else None

    def selected_or_none(self) -> int | None:
        return self.selected if self.counted else None


class KvSelection:
    """The run's backends and cases, and which suite tests (and xfail entries) they hit."""

    def __init__(self, config: pytest.Config, options: Options, device: str,
                 known: Any) -> None:
        self.config = config
        self.options = options
        self.device = device
        self.discovery = Discovery()
        self.cases: list[Case] = []
        # The known findings (xfails.KnownFindings), resolved at start-up (plugin.py).
        self.known = known
        self.xfails: list[Any] = list(known.entries) if known is not None else []
        if known is not None:  # the report's options name the file that applied
            options.raw["xfails"] = known.option
        self.counts = Counts()
        # describe() ids of xfail entries that named a collected test (any process).
        self.xfail_matched: set[str] = set()
        # Every entry naming a collected test, in file order (the first one marks it): the
        # one that describes how it fails or skips absorbs it (KvResults).
        self.item_entries: dict[str, list[Any]] = {}
        self.discovery_seconds = 0.0
        self.all_backend_names: set[str] = set()
        self.plugins: Any = None  # omni_plugins.PluginLoad, after start()
        # What discovery's imports printed (run_env.import_messages); None until it ran.
        self.import_log: list[dict[str, Any]] | None = None
        # An xdist controller discovers nothing itself (that import would come before
        # any worker starts); its workers hand theirs over (pytest_testnodedown).
        self.remote = False
        self.remote_discovery: dict[str, Any] | None = None
        self.remote_notes: list[str] = []
        # A usage error found by discovery in an xdist worker: raising it there would
        # crash the worker and have xdist restart it (an import each); the worker runs
        # nothing instead and its controller reports the error (KvResults).
        self.usage_error: str | None = None
        # The judge's fingerprint, taken before discovery imports a backend, and what of it
        # changed since (here, and in each xdist worker: session/integrity.py).
        self.fingerprint: integrity.Fingerprint | None = None
        self.altered: list[str] = []
        self.remote_altered: set[str] = set()

    @property
    def device_kind(self) -> str:
        """``cpu`` or ``cuda``, what xfail entries condition on."""
        return self.device.split(":")[0]

    # -- set-up (called by the session's pytest_sessionstart) -------------------

    def start(self) -> None:
        """Load the cases, discover the backends and apply ``--kv-backend``."""
        try:
            self._start()
        except pytest.UsageError as exc:
            if getattr(self.config, "workerinput", None) is None:
                raise
            self.usage_error = str(exc)

    def _start(self) -> None:
        try:
            self.cases = cases_mod.load_cases(self.options.cases)
        except cases_mod.CaseFileError as exc:
            raise pytest.UsageError(f"--kv-cases: {exc}") from None
        if xdist_hooks.is_controller(self.config):
            self.remote = True
            return
        started = time.monotonic()
        self.fingerprint = integrity.take()  # before any backend of discovery's is imported
        hook_results = self._hook_backends()
        try:
            # What the serving stack's imports print is kept for the header and the report
            # (run_env.captured_output), not printed before the session header.
            with warnings.catch_warnings(), run_env.captured_output() as self.import_log:
                # Importing backends imports torch and vLLM, whose own deprecation
                # warnings would otherwise print before the session starts.
                warnings.simplefilter("ignore", DeprecationWarning)
                self.plugins = load_plugins(self.options.plugins)
                self.discovery = discover(hook_results, origins=self.plugins,
                                          only=self.options.backends or None,
                                          guard=isolated.probe(self.options.timeout))
        except DiscoveryError as exc:
            raise pytest.UsageError(inert.terminal(f"kvconform: {exc}")) from None
        self.discovery_seconds = time.monotonic() - started
        self.judge_altered()
        self._select_backends()

    def _hook_backends(self) -> list[Any]:
        """Every ``pytest_kvconform_backends`` result; one that raises is a usage error
        naming the implementation and its module, not an INTERNALERROR."""
        hook = self.config.hook.pytest_kvconform_backends
        try:
            return list(hook(config=self.config))
        except Exception as exc:
            raise pytest.UsageError(inert.terminal(_hook_failure(hook.get_hookimpls(), exc))
                                    ) from None

    def _select_backends(self) -> None:
        self.all_backend_names = set(self.discovery.names) | set(self.discovery.left_out)
        wanted = self.options.backends
        if not wanted:
            return
        unknown = [name for name in wanted if name not in self.discovery.names]
        if unknown:
            from pytest_kvconform.session.startup import unknown_backends

            message = unknown_backends(unknown, self.all_backend_names)
            if not self.all_backend_names:
                message += " (" + "; ".join(self.discovery.notes) + ")"
            raise pytest.UsageError(f"--kv-backend: {message}")
        self.discovery.backends = [b for b in self.discovery.backends if b.name in wanted]

    def judge_altered(self) -> list[str]:
        """What of the judge changed since its fingerprint (this process's, and what the
        xdist workers reported), as phrases; empty when nothing did."""
        if self.fingerprint is not None:
            self.altered += [c for c in self.fingerprint.changes() if c not in self.altered]
        return [*self.altered, *sorted(self.remote_altered - set(self.altered))]

    def header_lines(self) -> list[str]:
        """The header's backends, cases, discovery notes and plugins."""
        cases = f"kvconform: {len(self.cases)} cases: {', '.join(c.id for c in self.cases)}"
        known = [self.known.header_line()] if self.known is not None else []
        if self.remote:
            return ["kvconform: backends: discovered by each xdist worker, listed after the run",
                    cases, *known]
        plugin_lines = self.plugins.header_lines() if self.plugins is not None else []
        altered = [f"kvconform: WARNING: {describe_altered(self.altered)}; this run qualifies "
                   "nothing"] if self.altered else []
        return [self._backends_line(self.backend_dicts(), "", self.discovery_seconds,
                                    sorted(self.all_backend_names)), cases,
                *known, *altered, *self._detail_lines(self.discovery.notes, plugin_lines),
                *self._import_log_lines(self.import_log)]

    def _import_log_lines(self, messages: list[dict[str, Any]] | None) -> list[str]:
        return run_env.import_log_lines(messages or [],
                                        verbose=self.config.getoption("verbose", 0) > 0,
                                        report=self.options.report is not None)

    def discovery_lines(self) -> list[str]:
        """An xdist controller's account of its workers' discovery (the summary's header)."""
        if not self.remote:
            return []
        found = self.remote_discovery
        if found is None:
            return ["kvconform: no xdist worker reported its discovery (see the errors above)",
                    *self.remote_notes]
        lines = [self._backends_line(found["backends"], " by the xdist workers",
                                     found["seconds"], found["all_names"]),
                 *self._detail_lines(found["notes"], found["plugin_lines"]),
                 *self._import_log_lines(found.get(run_env.IMPORT_LOG_KEY)),
                 *self.remote_notes]
        if found["import_error"]:
            lines.append(import_error_line(found["import_error"]))
        return lines

    @staticmethod
    def _backends_line(backends: list[dict[str, Any]], where: str, seconds: float,
                       all_names: list[str]) -> str:
        """The backends under test; with --kv-backend, also those left out (not imported)."""
        importable = sum(bool(b["importable"]) for b in backends)
        names = [b["name"] for b in backends]
        others = [name for name in all_names if name not in names]
        left = (f"; {len(others)} left out by --kv-backend (not imported): {', '.join(others)}"
                if others else "")
        return (f"kvconform: {len(backends)} backends ({importable} importable) discovered"
                f"{where} in {seconds:.1f}s: {', '.join(names) or '-'}{left}")

    @staticmethod
    def _detail_lines(notes: list[str], plugin_lines: list[str]) -> list[str]:
        return [f"kvconform: note: {note}" for note in notes] + plugin_lines

    def worker_discovery(self) -> dict[str, Any]:
        """What this xdist worker discovered, as JSON values for its controller."""
        return {"backends": self.backend_dicts(), "all_names": sorted(self.all_backend_names),
                "notes": list(self.discovery.notes), "seconds": self.discovery_seconds,
                "plugins": self.plugins.as_dict() if self.plugins is not None else None,
                "plugin_lines": self.plugins.header_lines() if self.plugins is not None else [],
                "import_error": compat.production_import_error(),
                run_env.IMPORT_LOG_KEY: self.import_log}

    def adopt_worker_discovery(self, node: str, found: dict[str, Any]) -> None:
        """xdist controller: the first worker's discovery is the run's; a worker that
        found other backends is named (every worker must collect the same tests)."""
        if self.remote_discovery is None:
            self.remote_discovery = found
            self.all_backend_names = set(found["all_names"])
            return
        theirs = [b["name"] for b in found["backends"]]
        if theirs != self.backend_names():
            self.remote_notes.append(f"kvconform: WARNING: xdist worker {node} discovered "
                                     f"other backends: {', '.join(theirs) or '-'}")

    # -- collection -------------------------------------------------------------

    def pytest_ignore_collect(self, collection_path: Path, config: pytest.Config) -> bool | None:
        """An xdist worker with a usage error collects nothing (see ``usage_error``)."""
        return True if self.usage_error else None

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """The suite's axes (backend, need, layout, case: those its fixtures name), expanded
        as ``check_backend`` expands them (``checks/arguments.expand``); the cases are those
        its ``kv_cases`` marker's predicate selects."""
        names = metafunc.fixturenames
        axes = [axis for axis in AXES if FIXTURE[axis] in names]
        if not axes:
            return
        row = check_names().get(metafunc.function.__name__)
        family = row[1].backend_family if row is not None else "diffusion"
        backends: list[Any] = [b for b in self.discovery.backends if b.family == family]
        if not backends:
            reason = "; ".join(self.discovery.notes) or f"no {family} backend discovered"
            if self.options.backends:
                reason = f"--kv-backend names no {family} backend"
            backends = [_NoBackend(reason, family, selected=bool(self.options.backends))]
        marker = metafunc.definition.get_closest_marker("kv_cases")
        for axis in expand(axes, backends=backends, cases=self.cases,
                           predicate=marker.args[0] if marker is not None else None,
                           family=family):
            metafunc.parametrize(axis.fixture, list(axis.values), ids=list(axis.ids))

    # tryfirst: every collected test counts for stale-entry detection, also those
    # that -k or -m deselect afterwards.
    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        self.counts.modified = True
        versions = _versions_for_xfails()  # once, not per item
        for item in items:
            props = item_properties(item, self.device)
            if props is None:
                continue
            self.counts.collected += 1  # before -k / -m / --deselect
            item.user_properties.extend(props.items())
            failure_repr.concise(item)
            if not self.xfails:
                continue
            from pytest_kvconform.session.xfails import matching, xfail_reason

            entries = matching(self.xfails, backend=props["kv_backend"],
                               clause=props["kv_clause"], case=props["kv_case"],
                               layout=props["kv_layout"], versions=versions,
                               device_kind=self.device_kind,
                               test=getattr(item, "originalname", item.name))
            if entries:
                entry = entries[0]
                self.xfail_matched.add(entry.describe())
                self.item_entries[item.nodeid] = entries
                # Kept on the item too: a declared test that skips still names its entry.
                item.user_properties.append((XFAIL_PROPERTY, entry.describe()))
                item.add_marker(pytest.mark.xfail(reason=xfail_reason(entry),
                                                  strict=self.options.strict))

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.counts.selected = sum(1 for item in session.items
                                   if any(k == "kv_clause" for k, _ in item.user_properties))
        self.counts.counted = self.counts.modified

    # -- across xdist processes -------------------------------------------------

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """xdist controller: collect the entries each worker matched at collection, and
        the suite's collected / selected counts (every worker collects the same tests)."""
        output = getattr(node, "workeroutput", None) or {}
        if output.get(USAGE_ERROR_OUTPUT) and self.usage_error is None:
            self.usage_error = output[USAGE_ERROR_OUTPUT]
        if self.remote and output.get(DISCOVERY_OUTPUT):
            worker = (getattr(node, "workerinput", None) or {}).get("workerid", "?")
            self.adopt_worker_discovery(str(worker), output[DISCOVERY_OUTPUT])
        self.xfail_matched.update(output.get("kvconform_xfail_matched", ()))
        self.remote_altered.update(output.get(ALTERED_OUTPUT, ()))
        counts = output.get("kvconform_counts")
        if counts:
            self.counts.collected, self.counts.selected = counts
            self.counts.counted = True

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        """xdist worker: hand the matches and counts to the controller."""
        workeroutput = getattr(self.config, "workeroutput", None)
        if workeroutput is not None:
            workeroutput["kvconform_xfail_matched"] = sorted(self.xfail_matched)
            workeroutput["kvconform_counts"] = [self.counts.collected, self.counts.selected]
            workeroutput[ALTERED_OUTPUT] = self.judge_altered()
            if self.usage_error:
                workeroutput[USAGE_ERROR_OUTPUT] = self.usage_error
            else:
                workeroutput[DISCOVERY_OUTPUT] = self.worker_discovery()

    # -- what the results and the verdict read ----------------------------------

    def stale_xfails(self) -> list[Any]:
        if not self.xfails:
            return []
        from pytest_kvconform.session import xfails

        selected = set(self.backend_names())
        # An entry for a backend left out by --kv-backend is not stale, just unselected.
        candidates = [e for e in self.xfails if e.backend == "*" or e.backend in selected
                      or e.backend not in self.all_backend_names]
        return xfails.stale_entries(candidates, self.xfail_matched,
                                    versions=_versions_for_xfails(),
                                    device_kind=self.device_kind)

    def record(self) -> dict[str, Any]:
        """What part of the matrix this run selected (see ``report.selection_record``)."""
        from pytest_kvconform.report import build as report_mod

        option = self.config.option
        names = set(self.backend_names())
        return report_mod.selection_record(
            keyword=getattr(option, "keyword", None), markexpr=getattr(option, "markexpr", None),
            paths=_narrowing_args(self.config), backends=self.backend_names(),
            excluded_backends=sorted(self.all_backend_names - names),
            collected=self.counts.collected_or_none(),
            selected=self.counts.selected_or_none())

    def backend_dicts(self) -> list[dict[str, Any]]:
        if self.remote:
            return list(self.remote_discovery["backends"]) if self.remote_discovery else []
        return [b.record() for b in self.discovery.backends]

    def backend_names(self) -> list[str]:
        return [b["name"] for b in self.backend_dicts()]

    def import_log_record(self) -> list[dict[str, Any]] | None:
        """What the serving stack's imports printed during this run's discovery (an xdist
        worker's, for its controller); None when no discovery ran here."""
        if self.remote:
            found = self.remote_discovery or {}
            return found.get(run_env.IMPORT_LOG_KEY)
        return self.import_log

    def plugins_record(self) -> dict[str, Any] | None:
        """The plugin load (omni_plugins.PluginLoad.as_dict) this run's tests saw."""
        if self.remote:
            return self.remote_discovery["plugins"] if self.remote_discovery else None
        return self.plugins.as_dict() if self.plugins is not None else None


def import_error_line(error: str) -> str:
    return (f"kvconform: WARNING: vllm-omni's production control plane does not import; "
            f"clauses that drive it will fail: {error}")


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

    def __init__(self, reason: str, family: str = "diffusion", selected: bool = False) -> None:
        # ``selected``: --kv-backend named backends of the other family only; this family's
        # clauses then do not apply to the run (a not-applicable skip).
        super().__init__(NO_BACKEND_ID, "", "none", error=reason, family=family,
                         unusable=NOT_SELECTED if selected else None)


def _versions_for_xfails() -> dict[str, str | None]:
    v = compat.versions()
    return {"vllm": v["vllm"], "vllm_omni": v["vllm-omni"], "torch": v["torch"]}


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
