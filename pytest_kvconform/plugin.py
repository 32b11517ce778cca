"""pytest hooks only: options, collection glue, results, summary.

Off means free: without ``--kv-conformance`` this module registers its options
and hookspecs and nothing else; torch, vllm and vllm_omni stay unimported and
no test is added.  Everything heavy is imported lazily by :class:`KvSession`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_kvconform import hookspecs
from pytest_kvconform.session.options import Options, add_options

if TYPE_CHECKING:
    from pytest_kvconform.session.run import KvSession

SUITE_DIR = Path(__file__).resolve().parent / "suite"
SESSION_PLUGIN = "kvconform-session"
# The suite's test ids read as a repository's own, wherever the package is installed:
# ``kvconform/test_layout.py::test_kv_l1[FLASH_ATTN]``, never a site-packages path.
SUITE_ID_PREFIX = "kvconform"


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspecs)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config,
                                  args: list[str]) -> Generator[None, None, None]:
    """First, before any conftest loads: the rootdir and configfile as if pytest had known
    this plugin's options when it chose them (``session/rootdir.py``: a value written as a
    separate argument, ``--kv-xfails FILE``, is not a test path).  Then the xdist hooks:
    xdist sizes ``-n auto`` before pytest_configure; its hooks must be in by then.

    The xdist hooks only with ``--kv-conformance`` (or its ini key): a run with the plugin
    off imports nothing more than this module and ``options`` (the plugin-off cost,
    bench_goals.py), unless an option of ours is written as two arguments.
    """
    if any(arg.startswith("--kv-") and "=" not in arg for arg in args):
        from pytest_kvconform.session.rootdir import settle

        settle(early_config, args)
    known = getattr(early_config, "known_args_namespace", None)
    enabled = bool(getattr(known, "kv_conformance", None))
    if not enabled:
        try:
            enabled = bool(early_config.getini("kv_conformance"))
        except ValueError:
            enabled = False
    if enabled:
        from pytest_kvconform.session.xdist import register_xdist_hooks

        register_xdist_hooks(early_config)
    return (yield)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    options = Options.from_config(config)
    if not options.enabled:
        return
    config.addinivalue_line("markers", "kv_cases(predicate): select the spec cases a suite "
                            "test is parametrised with (predicate(case) -> bool)")
    config.addinivalue_line("markers", "kv_vllm: a suite test of vLLM's own attention "
                            "backends (the KV-V clauses)")
    config.addinivalue_line("markers", "kv_diffusion: a suite test of the diffusion side "
                            "(KV-L, S, N, A clauses)")
    signals = _run_signals(config)
    try:
        known = _startup_checks(config, options)  # before anything heavy is imported
        _add_suite(config)
        if hasattr(config, "workerinput"):  # an xdist worker never outlives its controller
            from pytest_kvconform.workers.pool import exit_with_parent

            exit_with_parent()
        from pytest_kvconform.session.run import KvSession

        session = KvSession(config, options, known=known, signals=signals)
    except KeyboardInterrupt as exc:
        _interrupted_before_results(config, options, type(exc).__name__, signals)
        raise
    config.pluginmanager.register(session, SESSION_PLUGIN)
    _speculate_workers(config, options, session)


def _run_signals(config: pytest.Config) -> Any:
    """SIGTERM ends the run as Ctrl-C does, and neither ends it with a status its report
    disagrees with (``lifetime.RunSignals``): the summary, the verdict and the report, and
    no process or temporary file left.  Undone when the run is over, unless it owns its
    process (pytester runs sessions inside a longer-lived process)."""
    from pytest_kvconform.workers import lifetime

    signals = lifetime.RunSignals()
    if signals.install():
        owned = not hasattr(config, "workerinput") and \
            lifetime.owns_process(config.invocation_params.args)
        # Last of all (the first cleanup added runs last): an owned run keeps deferring.
        config.add_cleanup(signals.finishing if owned else signals.undo)
    return signals


def _interrupted_before_results(config: pytest.Config, options: Options,
                                what: str = "KeyboardInterrupt", signals: Any = None) -> None:
    """Ctrl-C (or SIGTERM) before the run's results plugin was registered (which judges
    any later interrupt): the verdict and the report all the same, with nothing collected."""
    from pytest_kvconform.session.run import RESULTS_PLUGIN

    if config.pluginmanager.get_plugin(RESULTS_PLUGIN) is not None:
        return
    from pytest_kvconform.session.results import KvResults
    from pytest_kvconform.session.selection import KvSelection

    results = KvResults(config, options, KvSelection(config, options, "cpu", None),
                        signals=signals)
    results.interruption = f"{what} during start-up, before any test was collected"
    results.conclude_interrupted_start()


def _speculate_workers(config: pytest.Config, options: Options, session: KvSession) -> None:
    """Start the KV-A workers now if KV-A tests may be selected, overlapping discovery.

    For CPU workers, their fork server (``workers/forkserver.py``; the workers fork from it
    after collection).  Its import (what it costs: benchmarks/RESULTS.md) then overlaps
    this process's own import and discovery on a second core;
    :func:`pytest_collection_finish` drops them (or stops the server) if no selected test
    needs them.  An xdist controller runs no test: on a CPU host it starts only the
    server, which its workers share (``forkserver.share``).  Nothing for ``--collect-only``.
    """
    from pytest_kvconform.session import may_need_workers

    if (config.option.collectonly or getattr(config.option, "help", False)
            or not may_need_workers.may_select_adoption(config)):
        return
    from pytest_kvconform.session.xdist import is_controller
    from pytest_kvconform.workers import pool as workers
    from pytest_kvconform.workers.kv_workers import KvWorkers

    if is_controller(config):
        if session.device == "cpu":  # so are its workers' KV-A workers: one server for all
            workers.pool().warm(["cpu"])  # shared through workerinput (xdist_hooks.py)
        return
    # One worker: the selection may need no more (a second is started after collection).
    KvWorkers(session.device, list(session.gpu_ids)).speculate(1)


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path: Path,
                                parent: pytest.Collector) -> pytest.Module | None:
    """The suite's modules get ids of their own (``kvconform/test_layout.py``).

    pytest derives a file's id from its path relative to the rootdir, so a suite installed
    in site-packages would read ``../lib/python3.11/site-packages/...``; ``-k``,
    ``--deselect``, ``--lf`` and JUnit XML all key on the id, and the path stays real
    (failures point at the installed file).
    """
    if module_path.parent != SUITE_DIR:
        return None
    return pytest.Module.from_parent(parent, path=module_path,
                                     nodeid=f"{SUITE_ID_PREFIX}/{module_path.name}")


def _uses_workers(item: pytest.Item) -> bool:
    return "kv_workers" in getattr(item, "fixturenames", ())


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests on KV-A's worker processes run after the rest, in their own order.

    Their workers then fork and start while the in-process clauses run (see
    :func:`pytest_runtest_logfinish`), once the fork server's imports are done, instead
    of the first KV-A test waiting for both.  After any reordering plugin (trylast), so a
    shuffle still shuffles within each part.
    """
    if config.pluginmanager.get_plugin(SESSION_PLUGIN) is None:
        return
    items.sort(key=_uses_workers)  # stable


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    """Between tests: fork the KV-A workers waiting for the fork server, once it is ready."""
    pool = sys.modules.get("pytest_kvconform.workers.pool")  # never imported when off
    if pool is not None:
        pool.launch_pending()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Keep, drop or add KV-A workers for the largest world size the selection needs."""
    plugin = session.config.pluginmanager.get_plugin(SESSION_PLUGIN)
    if plugin is None:
        return
    from pytest_kvconform.workers.kv_workers import KvWorkers

    params = [getattr(getattr(item, "callspec", None), "params", {}) for item in session.items
              if _uses_workers(item)]
    sizes = [p["kv_case"].world_size if "kv_case" in p else 1 for p in params]
    KvWorkers(plugin.device, list(plugin.gpu_ids)).settle(max(sizes, default=0))


def _startup_checks(config: pytest.Config, options: Options) -> Any:
    """Output paths, the case files, the backend names and the known findings
    (``KnownFindings``), checked before discovery imports vLLM: a bad or oversized case,
    or a backend name no source has, is refused within a second, before any worker
    starts."""
    from pytest_kvconform.contract import cases
    from pytest_kvconform.session import startup

    if options.report is not None:
        try:
            startup.check_report_path(options.report)
        except startup.StartupError as exc:
            raise pytest.UsageError(f"--kv-report: {exc}") from None
    try:
        cases.load_cases(options.cases)  # loaded again (and kept) when the session starts
    except cases.CaseFileError as exc:
        raise pytest.UsageError(f"--kv-cases: {exc}") from None
    hooks = [str(getattr(impl.plugin, "__file__", None) or impl.plugin_name) for impl in
             config.pluginmanager.hook.pytest_kvconform_backends.get_hookimpls()]
    try:
        startup.check_backend_names(options.backends, hooks)
    except startup.StartupError as exc:
        raise pytest.UsageError(f"--kv-backend: {exc}") from None
    try:
        return startup.known_findings(options.xfails)
    except startup.StartupError as exc:
        raise pytest.UsageError(f"--kv-xfails: {exc}") from None


def _add_suite(config: pytest.Config) -> None:
    """Collect the suite: alone when no paths were given, else beside them."""
    suite = str(SUITE_DIR)
    if config.args_source != pytest.Config.ArgsSource.ARGS:
        config.args[:] = [suite]
    elif not any(Path(a.split("::")[0]).resolve() == SUITE_DIR or
                 SUITE_DIR in Path(a.split("::")[0]).resolve().parents for a in config.args):
        config.args.append(suite)


def kv_session(config: pytest.Config) -> KvSession:
    plugin = config.pluginmanager.get_plugin(SESSION_PLUGIN)
    if plugin is None:
        raise pytest.UsageError("the kvconform fixtures need --kv-conformance")
    return plugin


@pytest.fixture(scope="session")
def kv_device(request: pytest.FixtureRequest) -> str:
    """The torch device this process (or xdist worker) allocates on: "cpu" or "cuda:0"."""
    return kv_session(request.config).device


# --- adoption fixtures (KV-A): thin; the work is in control_plane.py and workers.py -----


@pytest.fixture(scope="session")
def kv_control_plane(request: pytest.FixtureRequest, kv_device: str) -> Any:
    """Factory: ``kv_control_plane(backend_or_need, case, world_size=None)``.

    Runs the production control plane for a backend's declared need (a class, a
    registry name, or a ``BackendUnderTest``, as ``kv_deployment`` takes it) or an
    explicit bool, and returns a ``ControlPlane``: ``.rank_configs`` (rank-local
    ``KVCacheConfig``s), ``.scheduler_config``, ``.pinned`` (the layout name).
    """
    from pytest_kvconform.api import backend_under_test
    from pytest_kvconform.checks.adoption import fixture_control_plane

    def build(source: Any, case: Any, world_size: int | None = None) -> Any:
        who = source if isinstance(source, bool) else backend_under_test(source)
        return fixture_control_plane(who, case, world_size=world_size, device=kv_device)

    return build


@pytest.fixture(scope="session")
def kv_workers(request: pytest.FixtureRequest, kv_device: str) -> Any:
    """Factory of pooled worker processes (see ``workers.KvWorkers``)."""
    from pytest_kvconform.workers.kv_workers import KvWorkers

    return KvWorkers(kv_device, list(kv_session(request.config).gpu_ids))


@pytest.fixture(scope="session")
def kv_deployment(kv_workers: Any) -> Any:
    """Factory: ``with kv_deployment(backend_or_need, case, boundary=False) as deployed:``.

    Production's engine (control plane, executor, diffusion worker) for a backend (a
    class, a registry name, or a ``BackendUnderTest``) or an explicit need, on pooled
    worker processes; ``deployed.report`` is what it did, ``deployed.call(method, rank,
    *args)`` observes a rank.  Closed when the ``with`` block ends.
    """
    from pytest_kvconform.api import backend_under_test
    from pytest_kvconform.checks.adoption import fixture_deployment
    from pytest_kvconform.checks.errors import ClauseSkip

    @contextlib.contextmanager
    def deploy(source: Any, case: Any, boundary: bool = False) -> Iterator[Any]:
        who = source if isinstance(source, bool) else backend_under_test(source)
        try:
            with fixture_deployment(who, case, kv_workers.for_world_size(case.world_size),
                                    boundary=boundary) as deployed:
                yield deployed
        except ClauseSkip as skip:
            pytest.skip(f"{skip.clause}: {skip.reason}")

    return deploy
