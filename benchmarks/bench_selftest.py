"""How long ``kvconform selftest`` takes for one environment (goal: minutes on this machine).

Run with the environment's interpreter, from the repository root:

    .tox/py311-vllm030/bin/python benchmarks/bench_selftest.py [--jobs N ...] [-n REPEATS] [-o FILE]

Each repetition is one fresh ``kvconform selftest --json`` process (every registered fault,
each seeded in a child forked from the process that imported the stack).  The table records
its wall time, the preparation (imports, plugins, discovery, the KV-A workers' fork server),
the seeded runs' time by family (each fault's child, seeding to last result), the verdict,
and the load average when it started (the machine is shared).  For comparison, the notes
give what one fresh interpreter per fault and per baseline would cost at the measured
preparation time.  Results are appended to benchmarks/raw.md (untracked).  No timed assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results import append_table  # benchmarks/, the script's own directory

FAMILIES = ("adoption", "layout", "strides", "null block", "paged read")


def one_run(jobs: int, tmp: Path) -> tuple[float, dict[str, object], float]:
    out = tmp / f"selftest-{jobs}.json"
    load = os.getloadavg()[0]
    kvconform = Path(sys.executable).with_name("kvconform")
    started = time.perf_counter()
    proc = subprocess.run([str(kvconform), "selftest", "--jobs", str(jobs), "--json", str(out)],
                          capture_output=True, text=True)
    wall = time.perf_counter() - started
    if not out.is_file():
        raise SystemExit(f"kvconform selftest wrote no JSON (exit {proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
    return wall, json.loads(out.read_text()), load


def row(jobs: int, wall: float, record: dict[str, object], load: float) -> tuple[str, float]:
    summary: dict[str, float] = record["summary"]  # type: ignore[assignment]
    faults: list[dict[str, object]] = record["faults"]  # type: ignore[assignment]
    by_family = {family: sum(float(f["duration_s"]) for f in faults  # type: ignore[arg-type]
                             if f["family"] == family) for family in FAMILIES}
    outcomes: dict[str, int] = {}
    for fault in faults:
        outcomes[str(fault["outcome"])] = outcomes.get(str(fault["outcome"]), 0) + 1
    verdict = f"caught {summary['caught']}/{summary['seedable']}" + "".join(
        f", {n} {o}" for o, n in sorted(outcomes.items()) if o != "caught")
    cells = [str(jobs), f"{wall:.1f}", f"{summary['prepare_s']:.1f}",
             *(f"{by_family[f]:.1f}" for f in FAMILIES), verdict, str(summary["exit_code"]),
             f"{load:.1f}"]
    return "| " + " | ".join(cells) + " |", float(summary["prepare_s"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, action="append", help="runs at once (repeatable; "
                        "default: 1 and 2)")
    parser.add_argument("-n", "--repeats", type=int, default=1)
    parser.add_argument("-o", "--output", default=str(Path(__file__).with_name("raw.md")))
    args = parser.parse_args()
    rows, prepares, runs = [], [], 0
    versions: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as name:
        for _ in range(args.repeats):
            for jobs in args.jobs or [1, 2]:
                wall, record, load = one_run(jobs, Path(name))
                line, prepare = row(jobs, wall, record, load)
                rows.append(line)
                prepares.append(prepare)
                versions = record["environment"]["versions"]  # type: ignore[index]
                seedable = int(record["summary"]["seedable"])  # type: ignore[index]
                baselines = len({(tuple(f["beside"]), f["backend"], tuple(f["cases"]))
                                 for f in record["faults"]  # type: ignore[attr-defined]
                                 if f["outcome"] != "unseedable"})
                runs = seedable + baselines
                print(line, flush=True)
    fresh = sum(prepares) / len(prepares) * runs
    stack = ", ".join(f"{k} {v}" for k, v in versions.items() if k != "pytest")
    append_table(args.output, f"kvconform selftest ({stack})",
                 ["jobs", "wall s", "prepare s", *(f"{f} s" for f in FAMILIES), "verdict",
                  "exit", "load avg"], rows,
                 notes=f"Family columns: the seeded runs' time (each a forked child, seeding "
                       f"to last result), summed; the clean baselines' runs are in the wall "
                       f"time only.  {runs} runs (seedable faults and baselines): one fresh "
                       f"interpreter each would pay the preparation every time, about "
                       f"{fresh:.0f} s at the mean measured here.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
