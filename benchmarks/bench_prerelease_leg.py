"""What qualifying one pre-release leg costs: its environment from a warm cache, then the
strict run.

Run from the repository:  python3 benchmarks/bench_prerelease_leg.py [--leg NAME] [--rounds N]
Each round clones the repository (at ``--rev``) afresh, so the leg's environment is built
from uv's cache as a release engineer's new clone builds it (``tox -e LEG --notest``: the
*install*), then runs the leg's main job (``tox -e LEG -- --kv-conformance --kv-strict -rs
--kv-report R``: the *strict run*), and records both walls, the run's counts and exit, and
the load average.  The cache must be warm (a first build of the leg anywhere on the host
does that).  Results are appended to benchmarks/raw.md (untracked) or ``-o``.  No timed
assertions: this only measures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from results import append_table  # benchmarks/, the script's own directory

REPO = Path(__file__).resolve().parents[1]


def one_round(rev: str, leg: str, work: Path) -> dict[str, Any]:
    clone = work / "clone"
    shutil.rmtree(clone, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "-q", rev], check=True)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("TOX_", "KVCONFORM_"))}
    load = os.getloadavg()[0]
    started = time.perf_counter()
    built = subprocess.run(["tox", "-e", leg, "--notest"], cwd=clone, env=environ,
                           capture_output=True, text=True)
    install = time.perf_counter() - started
    report = work / "report.json"
    report.unlink(missing_ok=True)
    started = time.perf_counter()
    ran = subprocess.run(["tox", "-e", leg, "--", "--kv-conformance", "--kv-strict", "-rs",
                          "--kv-report", str(report)], cwd=clone, env=environ,
                         capture_output=True, text=True)
    strict = time.perf_counter() - started
    data = json.loads(report.read_text()) if report.is_file() else {}
    counts = {s: n for s, n in (data.get("summary", {}).get("by_status") or {}).items() if n}
    return {"install": install, "built": built.returncode, "strict": strict,
            "exit": ran.returncode, "verdict": data.get("verdict"),
            "counts": ", ".join(f"{n} {s}" for s, n in counts.items()), "load": load}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rev", default="HEAD")
    parser.add_argument("--leg", default="py311-vllm032-omni032rc1")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("-o", "--output", default=str(Path(__file__).with_name("raw.md")))
    args = parser.parse_args()
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", args.rev],
                         capture_output=True, text=True, check=True).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="kvconform-bench-leg-"))
    rows, rounds = [], []
    try:
        for n in range(args.rounds):
            found = one_round(rev, args.leg, work)
            rounds.append(found)
            rows.append(f"| {rev} | {args.leg} | {n + 1} | {found['install']:.1f} | "
                        f"{found['strict']:.1f} | "
                        f"{found['install'] + found['strict']:.1f} | "
                        f"{found['exit']} | {found['verdict']} | {found['counts']} | "
                        f"{found['load']:.2f} |")
            print(rows[-1], flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    totals = [r["install"] + r["strict"] for r in rounds]
    append_table(args.output, f"one pre-release leg, warm-cache install + strict run "
                 f"(median total {statistics.median(totals):.1f} s)",
                 ["rev", "leg", "round", "install s", "strict run s", "total s", "exit",
                  "verdict", "results", "load (1 min)"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
