"""tox's install command: pip, then the two steps pip cannot express in one resolve.

1. ``KVCONFORM_NODEPS``: a requirements file installed with ``--no-deps`` afterwards
   (vllm-omni declares CUDA-only kernels it does not need for what we import).
2. ``KVCONFORM_STRIP``: packages removed afterwards (torchvision, torchaudio and
   torchcodec break ``import vllm.config`` beside a CPU build of torch).

Both run on every install call, so ``tox --notest`` leaves a complete environment.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def main(argv: list[str]) -> int:
    pip("install", *argv)
    nodeps = os.environ.get("KVCONFORM_NODEPS", "")
    if nodeps:
        pip("install", "--no-deps", "-r", nodeps)
    strip = [n for n in os.environ.get("KVCONFORM_STRIP", "").split(",") if n and installed(n)]
    if strip:
        pip("uninstall", "-y", *strip)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
