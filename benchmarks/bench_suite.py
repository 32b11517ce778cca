"""Wall time and peak memory of conformance runs, per clause family.

Run in the default environment:  python benchmarks/bench_suite.py [--xdist N] [-o FILE]
Each selection runs in a fresh ``pytest --kv-conformance`` process (imports included), so
the numbers are what a user sees.  Results are appended as a Markdown table to
benchmarks/raw.md (untracked; or -o FILE).  No timed assertions: this only measures.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results import append_table  # benchmarks/, the script's own directory

SELECTIONS = {
    "import+discovery only": ["--collect-only", "-q", "-k", "kv_l1"],
    "KV-L (layout)": ["-k", "kv_l"],
    "KV-S (strides)": ["-k", "kv_s"],
    "KV-N (null block)": ["-k", "kv_n"],
    "KV-A (adoption, spawned workers)": ["-k", "kv_a"],
    "full suite": [],
}


def run(args: list[str], xdist: int) -> tuple[float, int, int, str]:
    """(seconds, peak RSS of the largest child in MiB, exit code, last line)."""
    cmd = [sys.executable, "-m", "pytest", "--kv-conformance", "-p", "no:cacheprovider", "-q",
           *(["-n", str(xdist)] if xdist else []), *args]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True,
                              env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    seconds = time.perf_counter() - started
    peak = max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) // 1024
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return seconds, peak, proc.returncode, lines[-1] if lines else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--xdist", type=int, default=0, help="also pass -n N")
    parser.add_argument("-o", "--output", default=str(Path(__file__).with_name("raw.md")))
    parser.add_argument("--only", action="append", help="run only these selection names")
    args = parser.parse_args()
    rows = []
    for name, selection in SELECTIONS.items():
        if args.only and name not in args.only:
            continue
        seconds, peak, code, last = run(selection, args.xdist)
        rows.append(f"| {name} | {seconds:.1f} | {peak} | {code} | {last} |")
        print(rows[-1], flush=True)
    append_table(args.output, f"xdist={args.xdist or 'off'}",
                 ("selection", "wall s", "peak RSS MiB (largest process)", "exit", "summary"),
                 rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
