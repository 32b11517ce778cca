"""Unpack the GPU bundle's wheels into a target directory: stdlib only, no pip, no network.

A wheel is a zip of its import tree (plus ``*.data/purelib|platlib``), so unpacking is
all an offline host needs for the pure and binary wheels the bundle carries.

    python3 install.py BUNDLE_DIR TARGET_DIR   # TARGET/site: wheels, TARGET/src: sources
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path


def install_wheels(wheels: Path, target: Path) -> list[str]:
    """Unpack every ``*.whl`` in ``wheels`` into ``target``; returns the wheel names."""
    target.mkdir(parents=True, exist_ok=True)
    done = []
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as zf:
            for info in zf.infolist():
                name = info.filename
                parts = name.split("/")
                if parts[0].endswith(".data"):
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                        continue  # scripts, headers, data: not needed to import
                    name = "/".join(parts[2:])
                if not name or name.endswith("/"):
                    continue
                out = target / name
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(zf.read(info))
                mode = (info.external_attr >> 16) & 0o777
                if mode:
                    out.chmod(mode)
        done.append(wheel.name)
    return done


def install_bundle(bundle: Path, target: Path) -> None:
    """``target/site`` gets the wheels, ``target/src`` the vLLM / vllm-omni sources."""
    import tarfile

    names = install_wheels(bundle / "wheels", target / "site")
    with tarfile.open(bundle / "src.tar.gz") as tar:
        tar.extractall(target / "src", filter="data")
    print(f"install: {len(names)} wheels into {target / 'site'}, sources into {target / 'src'}")


if __name__ == "__main__":
    install_bundle(Path(sys.argv[1]), Path(sys.argv[2]))
