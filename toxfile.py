"""tox's inline plugin: put the heavy environments outside the clone, keyed on the pins.

tox.ini cannot say this itself: tox does not expand ``{homedir}`` inside an
``{env:VAR:default}`` default, so a fresh clone got a literal ``{homedir}`` folder.  Here
the default is computed once, in Python, for every user: ``~/.cache/pytest-kvconform/
tox-<hash of requirements/*.txt and tools/envinstall.py>``.  ``KVCONFORM_TOX_WORK_DIR``
still moves it when set.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent
ENV_VAR = "KVCONFORM_TOX_WORK_DIR"


def pins_key(root: Path = ROOT) -> str:
    """A short hash of everything that decides what the environments contain."""
    digest = hashlib.sha256()
    for path in [root / "tools" / "envinstall.py", *sorted((root / "requirements").glob("*.txt"))]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pytest-kvconform"


def default_work_dir(root: Path = ROOT) -> Path:
    return cache_root() / f"tox-{pins_key(root)}"


# Evaluated lazily by tox.ini's ``work_dir = {env:KVCONFORM_TOX_WORK_DIR:...}``, after this
# module is loaded as the project's inline plugin.
os.environ.setdefault(ENV_VAR, str(default_work_dir()))


def prune(keep: Path) -> list[Path]:
    """Remove environments built for other pins (several GB each); return what went."""
    import shutil

    gone = []
    for old in sorted(cache_root().glob("tox-*")):
        if old.is_dir() and old != keep:
            shutil.rmtree(old, ignore_errors=True)
            gone.append(old)
    return gone


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--prune"]:
        for path in prune(default_work_dir()):
            print(f"toxfile: removed {path} (built for other pins)")
    print(os.environ[ENV_VAR])
