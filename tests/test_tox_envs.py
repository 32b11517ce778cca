"""Each clone tests its own code; the heavy packages are shared (toxfile.py, tox.ini).

Two copies of this checkout run tox at the same time against the shared environment this
test itself runs on (``KVCONFORM_SHARED_ENV_NO_BUILD=1``: a test never builds several GB;
an environment that does not meet this checkout's pins is a skip).  Each must get a light
environment of its own in its ``.tox`` whose interpreter, from any directory, imports that
clone's code and loads that clone's pytest plugin; deleting one clone must leave the other
(and the shared environment) working.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
COPIED = ("README.md", "pyproject.toml", "tox.ini", "toxfile.py", "tools", "requirements",
          "pytest_kvconform", "conformance_cases")
IGNORE = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")

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
WHERE = ("import importlib.metadata as m, pytest_kvconform; print(pytest_kvconform.__file__); "
         "print(m.distribution('pytest-kvconform').locate_file(''))")


def _toxfile() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvconform_toxfile", REPO / "toxfile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _shared_env() -> Path:
    """The shared environment this interpreter gets the heavy packages from."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        pytest.skip("torch is not installed: no shared environment to reuse")
    env = Path(spec.origin).resolve().parents[4]  # <env>/lib/pythonX.Y/site-packages/torch
    if not (env / "pyvenv.cfg").exists() or not env.name.startswith("py3"):
        pytest.skip(f"torch comes from {env}, not from a tox environment")
    return env


def _tox_env(shared: Path) -> dict[str, str]:
    """A user's shell: no tox or venv variables of the run around this test, no
    KVCONFORM_* but the shared directory and the guard against building."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TOX_", "KVCONFORM_", "PYTEST_", "VIRTUAL_ENV", "PYTHON"))}
    inner = os.environ.get("VIRTUAL_ENV")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not inner or not p.startswith(inner))
    env["KVCONFORM_SHARED_ENV_DIR"] = str(shared.parent)
    env["KVCONFORM_SHARED_ENV_NO_BUILD"] = "1"
    return env


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


def _where(python: Path, cwd: Path) -> list[Path]:
    done = subprocess.run([str(python), "-c", WHERE], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    return [Path(line).resolve() for line in done.stdout.split()]


def test_two_clones_each_test_their_own_code_and_survive_each_other(tmp_path: Path) -> None:
    tox = shutil.which("tox")
    if tox is None:
        pytest.skip("tox is not on PATH (README: python3 -m pip install tox)")
    shared = _shared_env()
    name = shared.name
    toxfile = _toxfile()
    wanted = toxfile.requirement_lines(REPO / "requirements" / f"{name.split('-')[1]}.txt")
    lacking = toxfile.unmet(toxfile._probe(shared / "bin" / "python")["dists"], wanted, [])
    if lacking:
        pytest.skip(f"{shared} does not meet this checkout's pins ({'; '.join(lacking)}); "
                    f"this test never builds one")
    clones = [_clone(tmp_path / "a"), _clone(tmp_path / "b")]
    env = _tox_env(shared)
    runs = [subprocess.Popen([tox, "-e", name, "--", "tests/test_which.py", "-q", "-p",
                              "no:randomly", "-p", "no:cacheprovider"], cwd=clone, env=env,
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            for clone in clones]  # at the same time
    for run in runs:
        out, _ = run.communicate(timeout=600)
        assert run.returncode == 0, out[-4000:]
        assert "1 passed" in out, out[-4000:]
    for clone in clones:
        light = clone / ".tox" / name
        python = light / "bin" / "python"
        code, dist = _where(python, cwd=tmp_path)  # from neither clone
        assert code.is_relative_to(clone) and dist.is_relative_to(light), (clone, code, dist)
        site = next(light.glob("lib/python3*/site-packages"))
        assert not (site / "torch").exists(), "the heavy packages must stay shared"
        assert str(shared) in (site / toxfile.LINK_PTH).read_text()
        assert not list(clone.rglob("{homedir}")) and not (clone / ".venv").exists()

    shutil.rmtree(clones[1])
    a = clones[0]
    assert _where(a / ".tox" / name / "bin" / "python", cwd=tmp_path)[0].is_relative_to(a)
    again = subprocess.run([tox, "-e", name, "--", "tests/test_which.py", "-q", "-p",
                            "no:randomly", "-p", "no:cacheprovider"], cwd=a, env=env,
                           text=True, capture_output=True, timeout=600)
    assert again.returncode == 0 and "1 passed" in again.stdout, again.stdout[-4000:]
    assert (shared / "bin" / "python").exists()


# --- toxfile.py's pieces ------------------------------------------------------------------


def test_requirement_lines_follow_includes_and_leave_options_out(tmp_path: Path) -> None:
    (tmp_path / "base.txt").write_text("# shared\npytest==9.2.0  # pinned\n\n")
    (tmp_path / "env.txt").write_text("-r base.txt\n--index-url https://example.invalid\n"
                                      "torch==2.13.0\n-r base.txt\n")
    assert _toxfile().requirement_lines(tmp_path / "env.txt") == ["pytest==9.2.0",
                                                                  "torch==2.13.0"]


def test_unmet_names_what_a_shared_environment_lacks() -> None:
    toxfile = _toxfile()
    installed = {"torch": "2.13.0+cpu", "Pytest": "9.1.0", "torchvision": "0.28.0"}
    assert toxfile.unmet(installed, ["torch==2.13.0"], []) == []  # a local build is that pin
    assert toxfile.unmet(installed, ["pytest==9.2.0", "vllm==0.30.0", "torch"],
                         ["torchvision", "torchaudio"]) == [
        "pytest==9.2.0 (installed: 9.1.0)", "vllm==0.30.0 (installed: none)",
        "torchvision (must be absent)"]


def test_link_points_the_light_environment_at_the_shared_one(tmp_path: Path) -> None:
    """This interpreter stands in for the shared environment (it meets the project's deps)."""
    import sys
    import sysconfig

    toxfile = _toxfile()
    pth = toxfile.link(tmp_path, sys.version_info[:2], Path(sys.executable))
    assert pth == tmp_path / "kvconform-shared-env.pth"
    assert pth.read_text() == (f"import site; site.addsitedir("
                               f"{sysconfig.get_paths()['purelib']!r})\n")
    with pytest.raises(RuntimeError, match=r"runs Python 3\.\d+, this environment 2\.7"):
        toxfile.link(tmp_path, (2, 7), Path(sys.executable))


def test_the_old_work_dir_variable_is_refused_by_name(tmp_path: Path) -> None:
    import sys

    done = subprocess.run([sys.executable, str(REPO / "toxfile.py")], capture_output=True,
                          text=True,
                          env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin",
                               "KVCONFORM_TOX_WORK_DIR": str(tmp_path / "old")}, timeout=60)
    assert done.returncode != 0
    assert "$KVCONFORM_TOX_WORK_DIR is set" in done.stderr
    assert "Set $KVCONFORM_SHARED_ENV_DIR" in done.stderr
