"""The built wheel, installed non-editable in a venv of its own: what users install.

A wheel built from main once lacked ``pytest_kvconform.selftest`` while every test ran an
editable install, which imports from the checkout.  The tests that check what users get
(``tests/end_to_end/test_wheel.py``, ``tests/end_to_end/test_backend_repo.py``) share
one build and one venv per session (the ``wheel_env`` fixture in ``tests/conftest.py``):
the build and the venv take tens of seconds.  Stdlib only: imported by conftest.py before
anything heavy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The top-level packages the wheel ships: every file under them is the package's.
PACKAGES = ("pytest_kvconform", "conformance_cases")
# What a build never ships and no one means to: bytecode caches and hidden litter.
NOT_SHIPPED_DIRS = ("__pycache__",)
NOT_SHIPPED_SUFFIXES = (".pyc", ".pyo")
# Left out of the copy the wheel is built from: a stale build/ would ship its leftovers.
SOURCE_IGNORE = shutil.ignore_patterns(".git", ".tox", "__pycache__", "build", "dist",
                                       "*.egg-info", ".pytest_cache", ".ruff_cache",
                                       ".mypy_cache", "report.json", "report.md", "report.html",
                                       "artifacts", "tests")


def clean_env() -> dict[str, str]:
    """This environment without PYTHONPATH: a checkout on it would shadow (or fake-install)
    the wheel; without PYTEST_ADDOPTS, which is this run's, not the venv's."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def run(argv: list[str], cwd: Path, timeout: float = 600,
        extra: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``argv`` in :func:`clean_env`, with ``extra`` variables added."""
    return subprocess.run(argv, cwd=cwd, env={**clean_env(), **(extra or {})},
                          capture_output=True, text=True, timeout=timeout, check=False)


def uv(*args: str, cwd: Path) -> str:
    """Run uv; its output (stdout and stderr), or an AssertionError carrying it."""
    done = run(["uv", *args], cwd=cwd)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def shipped_files(root: Path, packages: Iterable[str] = PACKAGES) -> set[str]:
    """Every file of ``packages`` under ``root`` (a source tree or a site-packages), as a
    wheel names it, relative and with ``/``: modules and data files alike."""
    found = set()
    for package in packages:
        for path in (root / package).rglob("*"):
            rel = path.relative_to(root)
            if (path.is_file() and not path.name.startswith(".")
                    and not path.name.endswith(NOT_SHIPPED_SUFFIXES)
                    and not set(rel.parts) & set(NOT_SHIPPED_DIRS)):
                found.add(rel.as_posix())
    return found


def wheel_files(wheel: Path) -> set[str]:
    """The files a wheel installs into site-packages, without its ``.dist-info``."""
    with zipfile.ZipFile(wheel) as archive:
        return {name for name in archive.namelist()
                if not name.endswith("/") and ".dist-info/" not in name}


def describe(name: str) -> str:
    """A file as a reader looks for it: a module by its dotted name too."""
    if not name.endswith(".py"):
        return name
    module = name.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    return f"{name} (module {module})"


def missing(expected: Iterable[str], present: Iterable[str]) -> list[str]:
    """Each expected file absent from ``present``, named by :func:`describe`, sorted."""
    return [describe(name) for name in sorted(set(expected) - set(present))]


@dataclass(frozen=True)
class WheelEnv:
    """The wheel built from a copy of this checkout, and a venv with it installed."""

    root: Path
    wheel: Path
    build_output: str
    python: Path
    constraints: Path

    @property
    def venv(self) -> Path:
        return self.python.parent.parent

    def script(self, name: str) -> Path:
        """A console script the venv's packages installed (``kvconform``)."""
        return self.python.parent / name

    def another(self, venv: Path, *extra: str) -> WheelEnv:
        """The same wheel in a venv of its own (with pip), for a repository that must not
        see another test's packages."""
        return venv_with(venv, self.wheel, self.build_output, self.constraints, *extra,
                         seed=True)

    def install(self, *targets: str) -> None:
        """Add packages at this environment's versions (a test's own, e.g. a backend repo)."""
        uv("pip", "install", "-q", "--python", str(self.python), "-c", str(self.constraints),
           *targets, cwd=self.root)

    def install_repo(self, repo: Path, files: Mapping[str, str]) -> tuple[Path, Path]:
        """(venv python, ``repo``): a repository written from ``files`` (dedented) and
        installed here, as a backend repository installs itself beside the wheel."""
        for name, text in files.items():
            path = repo / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(text).lstrip())
        self.install(str(repo))
        shutil.rmtree(repo / "build", ignore_errors=True)
        return self.python, repo


def build_wheel(root: Path) -> tuple[Path, str]:
    """Build the wheel from a copy of this checkout's source under ``root``, as a user's
    ``uv build --wheel`` would; (the wheel, uv's and the backend's output)."""
    source = root / "src"
    shutil.copytree(REPO, source, ignore=SOURCE_IGNORE)
    dist = root / "dist"
    output = uv("build", "--wheel", "-o", str(dist), str(source), cwd=root)
    (wheel,) = dist.glob("pytest_kvconform-*.whl")
    return wheel, output


def make(root: Path, *extra: str) -> WheelEnv:
    """Build the wheel and install it, with ``extra`` packages, into a new venv at this
    environment's versions (uv, hardlinked from its cache: seconds), without this checkout:
    as a backend repository's CI installs it."""
    wheel, output = build_wheel(root)
    frozen = run(["uv", "pip", "freeze", "--python", sys.executable], cwd=root)
    assert frozen.returncode == 0, frozen.stderr
    pins = [line for line in frozen.stdout.splitlines()
            if line and not line.startswith(("-e ", "pytest-kvconform"))]
    constraints = root / "constraints.txt"
    constraints.write_text("\n".join(pins) + "\n")
    return venv_with(root / "venv", wheel, output, constraints, *extra)


def venv_with(venv: Path, wheel: Path, output: str, constraints: Path, *extra: str,
              seed: bool = False) -> WheelEnv:
    """A new venv holding ``wheel`` and ``extra`` at the constrained versions (``seed``:
    with pip, as setup-python's interpreter has it)."""
    uv("venv", "-q", *(["--seed"] if seed else []), "--python", sys.executable, str(venv),
       cwd=venv.parent)
    env = WheelEnv(venv.parent, wheel, output, venv / "bin" / "python", constraints)
    env.install(str(wheel), *extra)
    return env
