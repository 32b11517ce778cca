"""Cold set-up of README's Tests command, and the environment's disk size.

Run from the repository:  python3 benchmarks/bench_setup.py [--rev REV] [--tox SPEC ...]
For each revision it clones the repository, makes a fresh HOME (so every cache is cold:
uv's, pip's, and any environment directory kept under ~/.cache), installs the given tox
(and tox-uv) into a venv of its own, and times ``tox -e ENV --notest``: what README's Tests
command does before its first test.  A second clone then builds the same environment with
the caches the first left (a user's second clone, or CI's next run).  Disk is counted with
``du`` over the clones and HOME together, so a file hardlinked from uv's cache into an
environment counts once.  Results are appended to benchmarks/raw.md (untracked).  No timed
assertions: this only measures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results import append_table  # benchmarks/, the script's own directory

REPO = Path(__file__).resolve().parents[1]


def du_mib(*paths: Path) -> float:
    """Apparent disk use of ``paths`` together, hardlinks counted once."""
    out = subprocess.run(["du", "-s", "-c", "-B1M", *map(str, paths)], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    return float(out[-1].split()[0])


def build(rev: str, tox_specs: list[str], env: str, work: Path) -> list[str]:
    home = work / "home"
    home.mkdir()
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith(("VIRTUAL_ENV", "TOX_", "UV_", "KVCONFORM_"))}
    environ["HOME"] = str(home)
    environ.pop("XDG_CACHE_HOME", None)
    tools = work / "tools"
    subprocess.run([sys.executable, "-m", "venv", str(tools)], check=True)
    subprocess.run([str(tools / "bin" / "python"), "-m", "pip", "install", "-q", *tox_specs],
                   check=True, env=environ)
    environ["PATH"] = f"{tools / 'bin'}{os.pathsep}{environ['PATH']}"
    rows = []
    clones = []
    for n, label in enumerate(("cold caches", "second clone, warm caches")):
        clone = work / f"clone{n}"
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        subprocess.run(["git", "-C", str(clone), "checkout", "-q", rev], check=True)
        started = time.perf_counter()
        done = subprocess.run(["tox", "-e", env, "--notest"], cwd=clone, env=environ,
                              capture_output=True, text=True)
        wall = time.perf_counter() - started
        clones.append(clone)
        tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or [""]
        rows.append(f"| {rev} | {' '.join(tox_specs)} | {label} | {wall:.1f} | "
                    f"{done.returncode} | {du_mib(*clones, home):.0f} | "
                    f"{du_mib(clone / '.tox'):.0f} | {tail[0][:80]} |")
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rev", default="HEAD")
    parser.add_argument("--tox", action="append", default=None,
                        help="pip requirement for the tox venv (repeatable); "
                             "default: tox==4.67.17 tox-uv==1.37.1")
    parser.add_argument("--env", default="py311-vllm030")
    parser.add_argument("--note", default="")
    parser.add_argument("-o", "--output", default=str(Path(__file__).with_name("raw.md")))
    args = parser.parse_args()
    specs = args.tox or ["tox==4.67.17", "tox-uv==1.37.1"]
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", args.rev],
                         capture_output=True, text=True, check=True).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="kvconform-bench-setup-"))
    try:
        rows = build(rev, specs, args.env, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    append_table(args.output, f"cold set-up of `tox -e {args.env} --notest`",
                 ["rev", "tox", "run", "wall s", "exit", "disk MiB (clones + HOME)",
                  "disk MiB (this clone's .tox)", "last line"], rows, notes=args.note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
