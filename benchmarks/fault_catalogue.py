"""Run the process-fault catalogue N times; record exit codes, reports and leaked processes.

Run in the default environment, from the repository root:

    PYTHONPATH=. python benchmarks/fault_catalogue.py [--reps 20] [--only NAME ...] [-o FILE]

Each repetition runs every scenario of ``tests/faultkit.py`` (the same ones
tests/seeded/test_process.py asserts on) in a fresh ``pytest --kv-conformance``
process: worker faults (hang, die, oom), a blocking declaration, Ctrl-C,
SIGTERM and SIGKILL of pytest, serially and of an xdist controller, SIGTERM
during start-up, two runs writing one report, a huge case (a usage error in < 5 s)
and a hung declaration over the whole suite (< 60 s at --kv-timeout 20, each later
error citing the first timeout; :data:`CHECKS`).  A leak is any PID of the run (KV-A
workers by their PID files, every descendant of pytest seen before a kill) still
alive 5 s after the run ended; peak RSS is the largest high-water mark of any
of the run's processes (sampled: ``faultkit.PeakRss``); a missing report is a run that
asked for one and has none that loads and validates.  Each run has its own $TMPDIR: the
run's directories there (``kvconform-*``, ``pymp-*``) are counted when it ended and again
after the start-up sweep a next run does (``tempdirs.sweep``: what SIGKILL leaves goes
then).  Results are appended to benchmarks/raw.md (untracked) (or -o FILE).  No timed assertions.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import faultkit  # the repository root, put on the path above

EXPECTED_RC: dict[str, int | tuple[int, ...]] = {
    "worker-faults": 1, "blocking-declaration": 1, "sigint-serial": 2, "sigkill-serial": -9,
    "sigint-xdist": 2, "sigkill-xdist": -9,
    "huge-case": 4, "hung-declaration": 1}
WANTS_REPORT = {"worker-faults", "blocking-declaration", "sigint-serial", "sigint-xdist",
                "hung-declaration"}
# Two runs started together writing one --kv-report path (faultkit.concurrent_writers).
EXPECTED_RC["concurrent-writers"] = 0
WANTS_REPORT.add("concurrent-writers")
# SIGTERM to pytest alone ends the run as Ctrl-C does; "early" (1 s in) may come
# before the plugin's handler is in, when SIGTERM still has its default effect.
EXPECTED_RC.update({"sigterm-early": (2, -15), "sigterm-startup": 2, "sigterm-serial": 2,
                    "sigterm-xdist": 2})
WANTS_REPORT |= {"sigterm-startup", "sigterm-serial", "sigterm-xdist"}


def rc_expected(name: str, returncode: int | None) -> bool:
    expected = EXPECTED_RC[name]
    return returncode in (expected if isinstance(expected, tuple) else (expected,))


def _huge_case(outcome: faultkit.Outcome) -> list[str]:
    """A usage error naming file, case, key and limit, in < 5 s, no report."""
    problems = []
    if ("huge.toml, case 'huge', key 'num_pages': 1000000000000 exceeds the limit"
            not in outcome.output):
        problems.append("no usage error naming the file, case, key and limit")
    if outcome.seconds >= 5:
        problems.append(f"{outcome.seconds:.1f}s, not < 5 s")
    if (outcome.workdir / "r.json").exists():
        problems.append("a report was written")
    return problems


def _hung_declaration(outcome: faultkit.Outcome) -> list[str]:
    """One test pays --kv-timeout, every other one that asks cites it; < 60 s."""
    errors = {t: r for t, r in outcome.results().items() if r["status"] == "error"}
    paid = [t for t, r in errors.items() if "was not called again" not in (r["reason"] or "")]
    problems = [] if len(paid) == 1 else [f"{len(paid)} tests paid the timeout: {paid}"]
    first = paid[0] if len(paid) == 1 else "it hung in "
    uncited = [t for t, r in errors.items() if t not in paid and
               not ("it hung in " in (r["reason"] or "") and first in (r["reason"] or ""))]
    problems += [f"{len(uncited)} errors cite no first timeout"] if uncited else []
    if outcome.seconds >= 60:
        problems.append(f"{outcome.seconds:.1f}s, not < 60 s")
    return problems


# What a scenario must show besides its exit status, report and leaks (a problem fails
# the catalogue, and RESULTS.md lists it).
CHECKS = {"huge-case": _huge_case, "hung-declaration": _hung_declaration}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--only", action="append", choices=sorted(faultkit.SCENARIOS),
                        help="run only this scenario (repeatable)")
    parser.add_argument("-o", "--output", default=str(Path(__file__).with_name("raw.md")))
    args = parser.parse_args()
    names = args.only or list(faultkit.SCENARIOS)
    stats = {n: {"runs": 0, "rc_ok": 0, "missing_reports": 0, "leaked": 0, "seconds": 0.0,
                 "temp_left": 0, "leaked_dirs": 0, "checks_ok": 0, "peak_rss": []}
             for n in names}
    problems: dict[str, list[str]] = {n: [] for n in names}
    started = time.monotonic()
    for rep in range(args.reps):
        for name in names:
            with tempfile.TemporaryDirectory(prefix=f"kvfault-{name}-") as tmp:
                outcome = faultkit.SCENARIOS[name](Path(tmp))
            s = stats[name]
            s["runs"] += 1
            s["rc_ok"] += rc_expected(name, outcome.returncode)
            missing = name in WANTS_REPORT and (outcome.report is None or
                                                outcome.report_error is not None)
            s["missing_reports"] += missing
            s["leaked"] += len(outcome.leaked)
            s["seconds"] += outcome.seconds
            s["temp_left"] += len(outcome.temp_left)
            s["leaked_dirs"] += len(outcome.leaked_dirs)
            s["peak_rss"].append(outcome.peak_rss_mib)
            found = CHECKS[name](outcome) if name in CHECKS else []
            s["checks_ok"] += not found
            problems[name] += [f"rep {rep + 1}: {p}" for p in found]
            print(f"rep {rep + 1}/{args.reps} {name}: rc {outcome.returncode} "
                  f"report {'MISSING' if missing else 'ok'} leaked {sorted(outcome.leaked)} "
                  f"workers {len(outcome.workers)} watched {len(outcome.watched)} "
                  f"temp dirs at exit {outcome.temp_left} after the next start "
                  f"{outcome.leaked_dirs} peak RSS {outcome.peak_rss_mib} MiB "
                  f"{outcome.seconds:.1f}s"
                  + (f" checks {'; '.join(found) or 'ok'}" if name in CHECKS else ""),
                  flush=True)
    total = time.monotonic() - started
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "", f"## {now} — fault catalogue, {args.reps} repetitions, {platform.node()}, "
        f"{os.cpu_count()} cores", "",
        f"`PYTHONPATH=. python benchmarks/fault_catalogue.py --reps {args.reps}"
        + "".join(f" --only {n}" for n in args.only or []) + f"` ({total / 60:.1f} min)", "",
        "| scenario | runs | expected exit status | missing reports | leaked processes "
        "| temp dirs left at exit | temp dirs left after the next start "
        "| peak RSS MiB per run (min / max) | mean s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in stats.items():
        lines.append(f"| {name} | {s['runs']} | {s['rc_ok']}/{s['runs']} "
                     f"(rc {EXPECTED_RC[name]}) | "
                     f"{s['missing_reports'] if name in WANTS_REPORT else 'n/a (none asked)'} "
                     f"| {s['leaked']} | {s['temp_left']} | {s['leaked_dirs']} "
                     f"| {min(s['peak_rss'], default=0)} / {max(s['peak_rss'], default=0)} "
                     f"| {s['seconds'] / max(1, s['runs']):.1f} |")
    lines += [f"\n{name}: {CHECKS[name].__doc__} {stats[name]['checks_ok']}/"
              f"{stats[name]['runs']} ok" + "".join(f"; {p}" for p in problems[name])
              for name in names if name in CHECKS]
    text = "\n".join(lines) + "\n"
    with open(args.output, "a", encoding="utf-8") as f:
        f.write(text)
    print(text)
    bad = any(s["leaked"] or s["missing_reports"] or s["rc_ok"] != s["runs"]
              or s["leaked_dirs"] for s in stats.values()) or any(problems.values())
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
