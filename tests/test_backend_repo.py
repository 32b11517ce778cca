"""The backend-repository path: the built wheel, installed with uv, run from the repo.

A backend repository adds pytest-kvconform as a dev dependency and runs
``pytest --kv-conformance`` in its own environment, under its own strict pytest
settings.  This installs such a repository into the session's venv, which holds the
wheel built from a copy of the source tree (``wheel_env``: uv, at this environment's
versions, without this checkout), and runs the suite from a scratch directory
shaped like a backend repository: its own pyproject.toml, tests, a backend from its
conftest hook and one from the ``pytest_kvconform.backends`` entry-point group.
"""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest

from tests.conftest import needs_omni
from tests.wheel_env import REPO, WheelEnv, run

BACKEND_REPO = {
    "pyproject.toml": '''
        [build-system]
        requires = ["setuptools>=77"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "my-backends"
        version = "0.1"

        [project.entry-points."pytest_kvconform.backends"]
        MY_EP_ATTN = "my_backends.attention:EntryPointBackend"

        [tool.setuptools]
        packages = ["my_backends"]

        [tool.pytest.ini_options]
        addopts = "--strict-markers --import-mode=importlib"
        filterwarnings = ["error"]
        testpaths = ["tests"]
    ''',
    "my_backends/__init__.py": "",
    "my_backends/attention.py": '''
        """Two backends of a backend repository: one per registration route."""

        from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend


        class HookBackend(SDPABackend):
            supports_paged_kv = True  # production's worker serves paged KV with it

            @classmethod
            def get_name(cls) -> str:
                return "MY_HOOK_ATTN"


        class EntryPointBackend(SDPABackend):
            supports_paged_kv = True

            @classmethod
            def get_name(cls) -> str:
                return "MY_EP_ATTN"
    ''',
    "conftest.py": '''
        def pytest_kvconform_backends(config):
            return {"MY_HOOK_ATTN": "my_backends.attention:HookBackend"}
    ''',
    "tests/test_own.py": '''
        def test_own_tests_run_beside_the_suite():
            assert True
    ''',
}


@pytest.fixture(scope="module")
def backend_repo(wheel_env: WheelEnv, tmp_path_factory: pytest.TempPathFactory
                 ) -> tuple[Path, Path]:
    """(venv python, backend repository): the repo installed beside the session's wheel."""
    repo = tmp_path_factory.mktemp("backend-repo") / "my-backends"
    for name, text in BACKEND_REPO.items():
        path = repo / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    wheel_env.install(str(repo))
    shutil.rmtree(repo / "build", ignore_errors=True)
    return wheel_env.python, repo


@needs_omni
def test_packaged_data_comes_from_the_wheel(backend_repo: tuple[Path, Path]) -> None:
    python, repo = backend_repo
    probe = run([str(python), "-c", textwrap.dedent('''
        import pathlib, pytest_kvconform, conformance_cases
        from pytest_kvconform.contract import cases
        pkg = pathlib.Path(pytest_kvconform.__file__).parent
        print(pkg)
        print(pathlib.Path(conformance_cases.__file__).parent)
        assert (pkg / "contract.md").read_text().startswith("# The KV-cache layout")
        assert (pkg / "known" / "vllm_omni_0_30.toml").is_file()
        assert (pkg / "py.typed").is_file()
        print(len(cases.load_cases(())))
    ''')], cwd=repo)
    assert probe.returncode == 0, probe.stdout + probe.stderr
    package_dir, cases_dir, n_cases = probe.stdout.split()
    venv = python.parent.parent
    assert Path(package_dir).is_relative_to(venv), package_dir
    assert Path(cases_dir).is_relative_to(venv), cases_dir
    assert not Path(package_dir).is_relative_to(REPO)
    assert int(n_cases) > 5


@needs_omni
def test_suite_runs_against_the_repos_backends(backend_repo: tuple[Path, Path]) -> None:
    """Both registration routes, under the repo's strict settings, beside its own tests."""
    python, repo = backend_repo
    result = run([str(python), "-m", "pytest", "--kv-conformance", "-p", "no:cacheprovider",
                  "--kv-backend", "MY_HOOK_ATTN", "--kv-backend", "MY_EP_ATTN",
                  "-k", "(kv_l1 or kv_l2 or kv_l6 or own) and not seam", "-v", "-rs", "tests"],
                 cwd=repo)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    for test_id in ("test_kv_l1[MY_HOOK_ATTN] PASSED", "test_kv_l2[MY_EP_ATTN] PASSED",
                    "test_kv_l6[MY_HOOK_ATTN] PASSED", "test_kv_l6[MY_EP_ATTN] PASSED"):
        assert test_id.split()[0] in out, out
    assert "test_own_tests_run_beside_the_suite" in out or "test_own.py" in out, out
    assert "7 passed" in out, out
    # The suite came from the installed wheel, not this checkout.
    assert str(REPO / "pytest_kvconform") not in out


@needs_omni
def test_gpu_check_ships_in_the_wheel(backend_repo: tuple[Path, Path]) -> None:
    """The installed ``kvconform gpu-check`` loads its modules and the stand-ins' plugin
    from the wheel; on a host without CUDA it refuses in one line and writes nothing."""
    python, repo = backend_repo
    probe = run([str(python), "-c", textwrap.dedent('''
        import importlib.util
        from pathlib import Path
        from pytest_kvconform.gpu import check
        argv = [*check.suite_step(Path("out"), 0.5).argv, *check.pinning_step(Path("out")).argv]
        for i, arg in enumerate(argv):
            if arg == "-p" and not argv[i + 1].startswith("no:"):
                print(importlib.util.find_spec(argv[i + 1]).origin)
    ''')], cwd=repo)
    assert probe.returncode == 0, probe.stdout + probe.stderr
    origins = probe.stdout.split()
    assert [Path(o).name for o in origins] == ["paged_standins.py", "pinning.py"]
    assert all(Path(o).is_relative_to(python.parent.parent) for o in origins), origins
    result = run([str(python.parent / "kvconform"), "gpu-check", "gpu-out"], cwd=repo)
    if "sees no CUDA device" not in result.stderr:
        pytest.skip(f"this host has CUDA: {result.stderr.strip()}")
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert not (repo / "gpu-out").exists()
