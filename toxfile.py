"""tox's inline plugin: each clone tests its own code, the heavy packages are shared.

Two levels, so that a clone never runs another clone's code, while torch, vLLM and
vllm-omni (several GB) are installed once per set of pins, not once per clone:

- **shared environments**, outside the clone, in ``~/.cache/pytest-kvconform/tox-<hash of
  requirements/*.txt and tools/envinstall.py>`` (``$XDG_CACHE_HOME`` is honoured, and
  ``KVCONFORM_SHARED_ENV_DIR`` moves it): for each tox environment that names a
  ``shared_deps`` requirements file, an environment of that name holding those packages
  (built here by ``tools/envinstall.py``, under a lock, the first time a clone needs it),
  and never this project; ``lint``, which does not install the project either.
- **each clone's environment**, in the clone's own ``.tox/<env>`` (tox's default work
  dir, gitignored): a light virtualenv holding the clone's editable install and nothing
  heavy.  It sees the shared environment's site-packages through a ``.pth`` file
  (``kvconform-shared-env.pth``): a venv made from a venv's interpreter would not see
  them.  Written before each install, so it follows the pins: after a pin changes, the
  next run points it at the new shared environment.

tox.ini cannot compute the shared directory itself: tox does not expand ``{homedir}``
inside an ``{env:VAR:default}`` default (a fresh clone got a literal ``{homedir}`` folder).
So it is computed here, once, and exported as ``KVCONFORM_SHARED_ENV_DIR`` before tox
reads its configuration.  ``python3 toxfile.py`` prints it; ``--prune`` first removes the
shared environments built for other pins.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
ENV_VAR = "KVCONFORM_SHARED_ENV_DIR"
# Set to 1: a missing or incomplete shared environment is an error naming what it lacks,
# never a build (a test's two clones must not rebuild several GB).
NO_BUILD_VAR = "KVCONFORM_SHARED_ENV_NO_BUILD"
OLD_ENV_VAR = "KVCONFORM_TOX_WORK_DIR"  # what ENV_VAR was called while it held every env
LINK_PTH = "kvconform-shared-env.pth"
# The variables tools/envinstall.py reads; taken from the tox environment's set_env.
INSTALL_VARS = ("KVCONFORM_NODEPS", "KVCONFORM_STRIP")


def pins_key(root: Path = ROOT) -> str:
    """A short hash of everything that decides what the shared environments contain."""
    digest = hashlib.sha256()
    for path in [root / "tools" / "envinstall.py", *sorted((root / "requirements").glob("*.txt"))]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pytest-kvconform"


def default_shared_dir(root: Path = ROOT) -> Path:
    return cache_root() / f"tox-{pins_key(root)}"


def shared_dir() -> Path:
    """Where this clone's shared environments are: ``$KVCONFORM_SHARED_ENV_DIR``."""
    return Path(os.environ[ENV_VAR])


def _export_shared_dir() -> None:
    """Set ``KVCONFORM_SHARED_ENV_DIR`` for tox.ini (``env_dir`` of lint) and this plugin."""
    if os.environ.get(OLD_ENV_VAR):
        raise SystemExit(
            f"toxfile.py: ${OLD_ENV_VAR} is set ({os.environ[OLD_ENV_VAR]}), but tox's work "
            f"dir is now each clone's own .tox; only the shared environments live outside the "
            f"clone. Set ${ENV_VAR} to move those instead, and unset ${OLD_ENV_VAR}.")
    os.environ.setdefault(ENV_VAR, str(default_shared_dir()))


_export_shared_dir()


def prune(keep: Path) -> list[Path]:
    """Remove shared environments built for other pins (several GB each); return what went.

    A clone whose pins changed points its light environment at the new shared one on its
    next run, so nothing else refers to what goes here.
    """
    import shutil

    gone = []
    for old in sorted(cache_root().glob("tox-*")):
        if old.is_dir() and old != keep:
            shutil.rmtree(old, ignore_errors=True)
            gone.append(old)
    return gone


# --- the shared environment of one tox environment ----------------------------------------


def requirement_lines(path: Path, seen: set[Path] | None = None) -> list[str]:
    """The requirements of a pip requirements file, ``-r`` includes followed; pip's other
    options (``--index-url``, ``-c`` ...) are not requirements and are left out."""
    seen = set() if seen is None else seen
    path = path.resolve()
    if path in seen:
        return []
    seen.add(path)
    lines: list[str] = []
    for raw in path.read_text().splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith(("-r ", "--requirement ")):
            lines += requirement_lines(path.parent / line.split(None, 1)[1], seen)
        elif not line.startswith("-"):
            lines.append(line)
    return lines


def _probe(python: Path) -> dict[str, Any]:
    """An environment's interpreter: its version, site-packages and installed distributions."""
    code = ("import importlib.metadata as m, json, sys, sysconfig\n"
            "print(json.dumps({'version': list(sys.version_info[:2]),"
            " 'purelib': sysconfig.get_paths()['purelib'],"
            " 'dists': {d.metadata['Name']: d.version for d in m.distributions()"
            " if d.metadata['Name']}}))\n")
    done = subprocess.run([str(python), "-I", "-c", code], capture_output=True, text=True,
                          check=True)
    return dict(json.loads(done.stdout))


def unmet(installed: Mapping[str, str], requirements: list[str], strip: list[str]) -> list[str]:
    """The requirements an environment with ``installed`` ({name: version}) does not meet,
    and the ``strip`` packages it still has: empty when it is complete."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    versions = {canonicalize_name(name): version for name, version in installed.items()}
    missing = []
    for line in requirements:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue
        have = versions.get(canonicalize_name(req.name))
        if have is None or not req.specifier.contains(have, prereleases=True):
            missing.append(f"{line} (installed: {have or 'none'})")
    missing += [f"{name} (must be absent)" for name in strip
                if canonicalize_name(name) in versions]
    return missing


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path``: two clones never build the same environment at once."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_shared_env(name: str, requirements: Path, base_python: str,
                      install_env: Mapping[str, str], where: Path | None = None) -> Path:
    """The shared environment ``name`` with ``requirements`` installed, built if it is
    missing or incomplete; returns its interpreter.

    Complete means every requirement (and ``KVCONFORM_NODEPS``'s) is met at its pinned
    version and no ``KVCONFORM_STRIP`` package is present, as read from the environment
    itself, so an interrupted build is finished by the next run rather than trusted.
    """
    env_dir = (where or shared_dir()) / name
    python = env_dir / "bin" / "python"
    wanted = requirement_lines(requirements)
    nodeps = install_env.get("KVCONFORM_NODEPS")
    if nodeps:
        wanted += requirement_lines(Path(nodeps))
    strip = [n for n in install_env.get("KVCONFORM_STRIP", "").split(",") if n]

    def missing() -> list[str]:
        if not python.exists():
            return ["(no environment yet)"]
        return unmet(_probe(python)["dists"], wanted, strip)

    if not missing():
        return python
    with _locked(env_dir.parent / f".{name}.lock"):
        todo = missing()  # another clone may have built it while this one waited
        if not todo:
            return python
        if os.environ.get(NO_BUILD_VAR) == "1":
            raise RuntimeError(f"toxfile: the shared environment {env_dir} is missing or "
                               f"incomplete ({'; '.join(todo)}), and ${NO_BUILD_VAR}=1 "
                               f"forbids building it")
        what = "new" if not python.exists() else f"to finish: {'; '.join(todo)}"
        print(f"toxfile: building the shared environment {env_dir} (once per set of pins; "
              f"{what})", flush=True)
        if not python.exists():
            subprocess.run([sys.executable, "-m", "virtualenv", "--quiet", "-p", base_python,
                            str(env_dir)], check=True)
        subprocess.run([str(python), str(ROOT / "tools" / "envinstall.py"), "-r",
                        str(requirements)], check=True, env={**os.environ, **install_env})
        still = missing()
        if still:
            raise RuntimeError(f"toxfile: the shared environment {env_dir} is still missing, "
                               f"after its build: {'; '.join(still)}")
    return python


def project_dependencies(root: Path = ROOT) -> list[str]:
    """``[project] dependencies`` of pyproject.toml: what the light environment's editable
    install needs from the shared one (it is installed without dependencies)."""
    import tomllib

    with open(root / "pyproject.toml", "rb") as f:
        return list(tomllib.load(f)["project"].get("dependencies", []))


def link(light_site: Path, light_version: tuple[int, int], heavy_python: Path) -> Path:
    """Make the light environment see the shared one's site-packages; returns the .pth.

    ``site.addsitedir`` (not a bare path line), so the shared site-packages' own ``.pth``
    files run too.  The file sorts after the light environment's editable install, so
    this clone's code is found first.  The shared environment must meet the project's
    dependencies: the pins in requirements/ are where they are installed.
    """
    heavy = _probe(heavy_python)
    lacking = unmet(heavy["dists"], project_dependencies(), [])
    if lacking:
        raise RuntimeError(
            f"toxfile: the shared environment {heavy_python.parent.parent} does not meet "
            f"pyproject.toml's dependencies: {'; '.join(lacking)}; pin them in requirements/")
    if tuple(heavy["version"]) != tuple(light_version):
        raise RuntimeError(
            f"toxfile: the shared environment {heavy_python.parent.parent} runs Python "
            f"{'.'.join(map(str, heavy['version']))}, this environment "
            f"{'.'.join(map(str, light_version))}; delete it to have it rebuilt")
    pth = light_site / LINK_PTH
    text = f"import site; site.addsitedir({heavy['purelib']!r})\n"
    if not pth.exists() or pth.read_text() != text:
        tmp = pth.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(pth)
    return pth


# --- tox hooks (absent when this file runs as a script without tox) -----------------------

try:
    from tox.plugin import impl
except ImportError:  # `python3 toxfile.py --prune` on a machine without tox yet
    impl = None

if impl is not None:

    @impl
    def tox_add_env_config(env_conf: Any, state: Any) -> None:
        env_conf.add_config(
            keys=["shared_deps"], of_type=str, default="",
            desc="requirements file of the shared environment whose packages this one sees "
                 "(toxfile.py)")

    @impl
    def tox_on_install(tox_env: Any, arguments: Any, section: str, of_type: str) -> None:
        """Before the first install into a light environment: its shared one, then the link."""
        if of_type != "deps" or not tox_env.conf["shared_deps"]:
            return
        from tox.tox_env.errors import Fail

        values = tox_env.environment_variables
        install_env = {key: values[key] for key in INSTALL_VARS if key in values}
        base = tox_env.base_python
        try:
            heavy = ensure_shared_env(tox_env.name, ROOT / tox_env.conf["shared_deps"],
                                      str(base.extra["executable"]), install_env)
            link(tox_env.env_site_package_dir(), tuple(base.version_info[:2]), heavy)
        except (RuntimeError, subprocess.CalledProcessError, OSError) as exc:
            raise Fail(str(exc)) from exc


if __name__ == "__main__":
    if sys.argv[1:] == ["--prune"]:
        for path in prune(default_shared_dir()):
            print(f"toxfile: removed {path} (built for other pins)")
    print(os.environ[ENV_VAR])
