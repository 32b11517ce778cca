"""Environments are uv's: each clone owns complete ones, the default is what users install.

tox-uv builds every environment in the clone's own ``.tox`` (its packages hardlinked from
uv's cache), so two clones never run each other's code and deleting one leaves the other
working.  The default environment takes torch the way a user's ``pip install vllm`` or
``uv pip install vllm`` does, from the registry at its default build; only the
``-cputorch`` environment swaps in the CPU build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.paths import ROOT as REPO

COPIED = ("README.md", "pyproject.toml", "tox.ini", "requirements", "pytest_kvconform",
          "conformance_cases")
IGNORE = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
DEFAULT = "py311-vllm030"

# Written into each clone: what the clone's tox run tests, from the clone's own plugin.
WHICH = '''
from pathlib import Path

import pytest_kvconform


def test_this_clone_is_what_runs(request):
    root = Path(str(request.config.rootpath)).resolve()
    plugin = request.config.pluginmanager.get_plugin("kvconform")
    assert Path(pytest_kvconform.__file__).resolve().is_relative_to(root)
    assert plugin is not None and Path(plugin.__file__).resolve().is_relative_to(root)
'''


def _tox() -> str:
    tox = shutil.which("tox", path=_user_env()["PATH"])
    if tox is None:
        pytest.skip("tox is not on PATH (README: python3 -m pip install tox tox-uv)")
    return tox


def _user_env() -> dict[str, str]:
    """A user's shell: none of the tox run's or venv's variables around this test."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TOX_", "KVCONFORM_", "PYTEST_", "VIRTUAL_ENV", "PYTHON",
                                "UV_"))}
    inner = os.environ.get("VIRTUAL_ENV")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not inner or not p.startswith(inner))
    return env


def _tox_config(env_name: str, key: str) -> str:
    done = subprocess.run([_tox(), "config", "-e", env_name, "-k", key], cwd=REPO,
                          env=_user_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_default_environment_takes_torch_from_the_registry() -> None:
    set_env = _tox_config(DEFAULT, "set_env")
    assert "UV_OVERRIDE" not in set_env and "UV_FIND_LINKS" not in set_env, set_env
    deps = (REPO / "requirements" / "vllm030.txt").read_text()
    assert "torch==2.13.0\n" in deps and "torchvision==" in deps, deps
    assert "find-links" not in deps and "+cpu" not in deps


def test_the_cputorch_environment_swaps_in_the_cpu_build() -> None:
    set_env = _tox_config(f"{DEFAULT}-cputorch", "set_env")
    override = REPO / "requirements" / "cputorch-override.txt"
    assert f"UV_OVERRIDE={override}" in set_env, set_env
    assert "torch==2.13.0+cpu" in override.read_text()
    excluded = (REPO / "requirements" / "cputorch-exclude.txt").read_text().split()
    assert {"torchvision", "torchaudio", "torchcodec"} <= set(excluded)


def test_ci_environments_install_the_wheel_not_the_clone() -> None:
    """CI's tests and main jobs run what users install: the package's wheel, not editable
    (tests/end_to_end/test_wheel.py checks what such an environment imports)."""
    for env_name in (DEFAULT, f"{DEFAULT}-cputorch"):
        assert "package = wheel" in _tox_config(env_name, "package").splitlines(), env_name


def _clone(where: Path) -> Path:
    where.mkdir()
    for name in COPIED:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, where / name, ignore=IGNORE)
        else:
            shutil.copy2(source, where / name)
    (where / "tests").mkdir()
    (where / "tests" / "test_which.py").write_text(WHICH)
    return where


def test_two_clones_each_own_their_environment_and_survive_each_other(
        tmp_path: Path) -> None:
    tox = _tox()
    clones = [_clone(tmp_path / "a"), _clone(tmp_path / "b")]
    argv = [tox, "-e", DEFAULT, "--", "tests/test_which.py", "-q", "-p", "no:cacheprovider"]
    runs = [subprocess.Popen(argv, cwd=clone, env=_user_env(), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            for clone in clones]  # at the same time
    for run in runs:
        out, _ = run.communicate(timeout=600)
        assert run.returncode == 0, out[-4000:]
        assert "1 passed" in out, out[-4000:]
    for clone in clones:
        site = next((clone / ".tox" / DEFAULT).glob("lib/python3*/site-packages"))
        assert (site / "torch").is_dir(), "each clone's environment is complete"
        assert not list(clone.rglob("{homedir}")) and not (clone / ".venv").exists()
    shutil.rmtree(clones[1])
    again = subprocess.run(argv, cwd=clones[0], env=_user_env(), text=True,
                           capture_output=True, timeout=600)
    assert again.returncode == 0 and "1 passed" in again.stdout, again.stdout[-4000:]
