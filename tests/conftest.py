"""Shared fixtures for the plugin's own tests."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import pkgutil
import warnings
from collections.abc import Callable, Iterator

import pytest

from pytest_kvconform.adapters import run_env
from pytest_kvconform.workers import devices
from tests.paths import ROOT
from tests.seeding import Seeder
from tests.wheel_env import WheelEnv
from tests.wheel_env import make as make_wheel_env

# This process hosts inline --kv-conformance runs, so it selects the platforms such a run
# does on a CPU host, before anything imports vLLM (run_env.CPU_DEFAULTS): a run's own
# setting would come after this process imported vLLM, too late for its platform.
if not devices.visible_gpu_ids(os.environ, devices.count_gpus_without_cuda_init):
    run_env.apply(run_env.CPU_DEFAULTS)

# A run appends its verdict to the CI job's summary where $GITHUB_STEP_SUMMARY names one; the
# runs these tests make (inline and in subprocesses) are not the job's, so none sees it (the
# summary's own tests set it: tests/report/test_job_summary.py).
os.environ.pop("GITHUB_STEP_SUMMARY", None)

HAVE_OMNI = importlib.util.find_spec("vllm_omni") is not None
needs_omni = pytest.mark.skipif(not HAVE_OMNI, reason="vllm-omni not installed")

# Inline pytester runs of the conformance suite: quiet, no cache, no xdist, and no known
# findings unless a test names them (a later --kv-xfails wins; the default, auto, has tests of
# its own in tests/end_to_end/test_known_findings.py).
KV_ARGS = ("--kv-conformance", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly",
           "--kv-xfails", "none")

PACKAGE = ROOT / "pytest_kvconform"
_SERVING_STACK = ("torch", "vllm", "vllm_omni")
# Imported inside the serving stack's functions when a check calls them (and by the
# hypothesis plugin an inline run loads): found with
# tests/end_to_end/test_inline_runs.py, which names any module a run still imports anew.
LAZY_IMPORTS = (
    "hypothesis", "torch.distributed._tensor", "vllm.distributed.ec_transfer.ec_connector.utils",
    "vllm.v1.executor", "vllm_omni.diffusion.distributed", "vllm_omni.diffusion.hooks",
    "vllm_omni.diffusion.model_loader.checkpoint_adapters",
    "vllm_omni.diffusion.model_loader.host_weight_plan", "vllm_omni.diffusion.models.interface",
    "vllm_omni.diffusion.offloader",
)


def _production_modules_named_in_the_package() -> set[str]:
    """Every torch / vLLM / vllm-omni module the package imports, lazy imports included."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
    return {n for n in names if n.partition(".")[0] in _SERVING_STACK}


def import_what_runs_import() -> None:
    """Import up front what an inline ``--kv-conformance`` run would import.

    pytester drops every module an inline run imported once the run is over, so
    without this each run re-imports vLLM and vllm-omni (tens of seconds), and
    re-running their registrations in one process may crash it.  What is imported
    before pytester takes its snapshot stays: the package's own modules, every
    production module it names (lazy imports too), every registry backend, vLLM's
    general plugins (vllm-omni's), and :data:`LAZY_IMPORTS`.
    """
    for info in pkgutil.walk_packages([str(PACKAGE)], "pytest_kvconform."):
        if info.name.rpartition(".")[2].startswith("test_"):  # the suite's test modules
            continue                                           # are the run's to collect
        try:
            importlib.import_module(info.name)
        except ImportError:  # a module that needs the serving stack, absent here
            pass
    if not HAVE_OMNI:
        return
    with warnings.catch_warnings():  # the serving stack's import-time deprecations
        warnings.simplefilter("ignore")
        for name in [*sorted(_production_modules_named_in_the_package()), *LAZY_IMPORTS]:
            try:
                importlib.import_module(name)
            except ImportError:  # an optional module the package feature-detects
                pass
        from vllm.plugins import load_general_plugins

        from pytest_kvconform.adapters import discovery

        discovery.registry_backends()  # imports each member's class (and what it imports)
        load_general_plugins()  # vllm-omni's model registrations, once per process


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "delivers_signal: the test needs a signal delivered to a process "
        "(tests/end_to_end/test_signal_dispositions.py runs these with SIGINT inherited ignored)")


@pytest.fixture(scope="session")
def wheel_env(tmp_path_factory: pytest.TempPathFactory) -> WheelEnv:
    """The wheel built from this checkout once per session and installed non-editable in a
    venv of its own, with vllm-omni where this environment has it (tests/wheel_env.py).
    A test may add its own packages to the venv (tests/end_to_end/test_backend_repo.py adds
    a repo)."""
    return make_wheel_env(tmp_path_factory.mktemp("wheel"), *(["vllm-omni"] if HAVE_OMNI else []))


@pytest.fixture(scope="session")
def _run_imports_done() -> None:
    import_what_runs_import()


@pytest.fixture
def pytester(_run_imports_done: None, pytester: pytest.Pytester) -> pytest.Pytester:
    """pytester, its module snapshot taken after the serving stack is imported."""
    return pytester


@pytest.fixture(scope="module")
def shared_workers() -> Iterator[None]:
    """The module's tests (and their in-process runs) share the process's KV-A worker pool:
    held open between tests, closed after the module."""
    from pytest_kvconform.workers import pool as workers

    workers.hold()
    yield
    workers.release()


@pytest.fixture
def kv_run(pytester: pytest.Pytester) -> Callable[..., pytest.RunResult]:
    """Run the conformance suite inline in the pytester directory."""

    def run(*args: str) -> pytest.RunResult:
        return pytester.runpytest(*KV_ARGS, *args)

    return run


@pytest.fixture
def seed(monkeypatch: pytest.MonkeyPatch) -> Iterator[Seeder]:
    """Plants faults in production code for this test (undone after it)."""
    yield Seeder(monkeypatch)
