"""The suite's cost goals, measured side by side in one run, as ratios.

Run in the default environment:  python benchmarks/bench_goals.py [--label L] [--repeat N]
[--suite-repeat N] [--skip NAME ...] [-o FILE].  Each measurement is a fresh process
(imports included):

- ``floor``: a fresh interpreter importing ``vllm_omni.diffusion.diffusion_kv.layout``;
  ``floor_quiet``: the same with ``HUMMING_DISABLE_PARALLEL_BUILD=1`` (that import starts two
  background kernel builds, each a Python process of its own, which the suite turns off);
  ``floor_frozen``: the same import with the garbage collector paused for it and the heap
  frozen after it (``adapters/heap.py``'s treatment, which a run gives the stack: what the
  floor would cost if it did the same);
- ``serial`` / ``xdist2``: the full ``pytest --kv-conformance`` suite, serial and ``-n 2``;
  ``scoped``: a backend repository's run, ``--kv-backend FLASH_ATTN`` (the in-tree backend
  production serves paged KV with), serial;
  ``vllm_floor``: a fresh interpreter importing vLLM's attention registry (no vllm-omni);
  ``scoped_vllm``: a run scoped to one of vLLM's own backends, ``--kv-backend vllm.CPU_ATTN``;
  ``serial_baseline`` / ``scoped_baseline``: with ``--baseline DIR``, the serial suite and
  the scoped run again with the plugin another checkout holds (say, main), in the same
  rounds, for a before / after under the same load;
- ``worker_start``: one pooled KV-A worker, from nothing to ready (``WorkerPool.get``: a
  spawned worker's imports, or the fork server's imports and a fork); ``worker_next``: a
  second one once the first is ready (another spawn's imports, or just a fork);
- ``adopt_1`` / ``adopt_40``: ``-k "test_kv_a3 and FLASH_ATTN and perf_..."`` with a case file
  of 40 world-size-1 cases (``perf_cases_plugin`` adds them to KV-A's cases), selecting 1
  and all 40; the marginal case is their difference / 39;
- ``off`` / ``no_plugin``: collecting 200 trivial tests with the plugin installed but off, and
  with ``-p no:kvconform`` (alternated, median of ``--repeat``; wall and CPU seconds, the
  latter less disturbed by whatever else the machine runs).

The load average is recorded with every row (the machine is shared).  No timed assertions:
this only measures and appends a table to benchmarks/raw.md (untracked).
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLOOR = "import vllm_omni.diffusion.diffusion_kv.layout"
FLOOR_FROZEN = f"import gc; gc.disable(); {FLOOR}; gc.freeze(); gc.enable()"
# vLLM's own attention registry, without vllm-omni: the floor of a run scoped to one of
# vLLM's backends (the V family).
VLLM_FLOOR = "import vllm.v1.attention.backends.registry"
VLLM_BACKEND = "vllm.CPU_ATTN"
WORKER = ("import time; from pytest_kvconform.workers import pool as workers; "
          "t = time.perf_counter(); "
          "workers.pool().get(['cpu']); print(time.perf_counter() - t); "
          "t = time.perf_counter(); workers.pool().get(['cpu', 'cpu']); "
          "print(time.perf_counter() - t); workers.close_pool()")


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "benchmarks"),
                                       os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "PYTHONPATH": path}


def timed(cmd: list[str], cwd: str, **extra: str) -> tuple[float, int, int, str]:
    """(seconds, peak RSS MiB of the largest descendant, exit code, last stdout line)."""
    return timed_cpu(cmd, cwd, **extra)[:4]


def timed_cpu(cmd: list[str], cwd: str, **extra: str) -> tuple[float, int, int, str, float]:
    """:func:`timed`, plus the CPU seconds (user + system) of the command's processes."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True,
                          env={**_env(), **extra})
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    peak = max(before.ru_maxrss, after.ru_maxrss) // 1024
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    lines = [line for line in proc.stdout.splitlines() if line.strip()] or \
        [line for line in proc.stderr.splitlines() if line.strip()][-1:]  # one line, for a table
    return seconds, peak, proc.returncode, lines[-1][-200:] if lines else "", cpu


def _wall_cpu(result: tuple[float, int, int, str, float]) -> tuple[float, float]:
    return result[0], result[4]


def _quartiles(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return f"{q[0]:.3f}/{q[1]:.3f}/{q[2]:.3f}"


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def cases_file(tmp: str) -> str:
    path = os.path.join(tmp, "perf_cases.toml")
    body = ["[defaults]", "block_size = 16", "num_kv_heads = 2", "num_layers = 2",
            "world_size = 1", 'dtype = "bfloat16"', "head_size = 8", ""]
    for i in range(40):
        body += ["[[case]]", f'id = "perf_{i:02d}"', f"num_pages = {16 + i}",
                 'description = "one more world-size-1 adoption case"', ""]
    Path(path).write_text("\n".join(body), encoding="utf-8")
    return path


def trivial_tests(tmp: str) -> str:
    path = os.path.join(tmp, "trivial")
    os.makedirs(path, exist_ok=True)
    Path(path, "test_trivial.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('i', range(200))\n"
        "def test_t(i):\n    assert i >= 0\n", encoding="utf-8")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--label", default="", help="e.g. before / after")
    parser.add_argument("--repeat", type=int, default=7, help="plugin-off pairs")
    parser.add_argument("--suite-repeat", type=int, default=1,
                        help="rounds of floor / floor_quiet / serial / xdist2, alternated; "
                        "the goals use each one's median")
    parser.add_argument("--skip", action="append", default=[], help="skip a measurement")
    parser.add_argument("--baseline", default=None, metavar="DIR",
                        help="a checkout of this repository whose plugin each round also "
                        "runs the serial suite with (serial_baseline)")
    parser.add_argument("-o", "--output", default=str(Path(__file__).with_name("raw.md")))
    args = parser.parse_args()
    py = sys.executable
    pytest = [py, "-m", "pytest", "-p", "no:cacheprovider", "-q"]
    suite = [*pytest, "--kv-conformance"]
    rows: list[tuple[str, float, int, int, str, str]] = []

    def measure(name: str, cmd: list[str], cwd: str, **extra: str) -> float:
        if name.partition(" #")[0] in args.skip:  # "serial #2" is skipped as "serial"
            return float("nan")
        seconds, peak, code, last = timed(cmd, cwd, **extra)
        rows.append((name, seconds, peak, code, load(), last))
        print(f"{name}: {seconds:.1f}s peak {peak} MiB exit {code} load {load()} | {last}",
              flush=True)
        return seconds

    with tempfile.TemporaryDirectory() as tmp:
        rounds: dict[str, list[float]] = {"floor": [], "floor_quiet": [], "floor_frozen": [],
                                          "serial": [],
                                          "xdist2": [], "serial_baseline": [], "scoped": [],
                                          "scoped_baseline": [], "vllm_floor": [],
                                          "scoped_vllm": []}
        base = os.path.abspath(args.baseline) if args.baseline else None
        for i in range(args.suite_repeat):
            tag = f" #{i + 1}" if args.suite_repeat > 1 else ""
            rounds["floor"].append(measure("floor" + tag, [py, "-c", FLOOR], tmp))
            rounds["floor_quiet"].append(measure("floor_quiet" + tag, [py, "-c", FLOOR], tmp,
                                                 HUMMING_DISABLE_PARALLEL_BUILD="1"))
            rounds["floor_frozen"].append(measure("floor_frozen" + tag,
                                                  [py, "-c", FLOOR_FROZEN], tmp))
            rounds["vllm_floor"].append(measure("vllm_floor" + tag, [py, "-c", VLLM_FLOOR], tmp))
            rounds["scoped_vllm"].append(measure("scoped_vllm" + tag,
                                                 [*suite, "--kv-backend", VLLM_BACKEND], tmp))
            scoped_run = [*suite, "--kv-backend", "FLASH_ATTN"]
            for kind, cmd in (("serial", suite), ("scoped", scoped_run)):
                variants: list[tuple[str, dict[str, str]]] = [(kind, {})]
                if base is not None:  # each first in every other round
                    variants.insert(i % 2, (f"{kind}_baseline", {"PYTHONPATH": os.pathsep.join(
                        (base, os.path.join(base, "benchmarks")))}))
                for name, extra in variants:
                    rounds[name].append(measure(name + tag, cmd, tmp, **extra))
                if kind == "serial":
                    rounds["xdist2"].append(measure("xdist2" + tag, [*suite, "-n", "2"], tmp))
        floor, quiet, frozen, serial, xdist2, scoped = (
            statistics.median(rounds[k]) if rounds[k] else float("nan")
            for k in ("floor", "floor_quiet", "floor_frozen", "serial", "xdist2", "scoped"))
        vllm_floor, scoped_vllm = (statistics.median(rounds[k]) if rounds[k] else float("nan")
                                   for k in ("vllm_floor", "scoped_vllm"))
        baseline, scoped_base = (statistics.median(rounds[k]) if base else float("nan")
                                 for k in ("serial_baseline", "scoped_baseline"))
        if args.suite_repeat > 1:
            for name, values in rounds.items():
                if not values:
                    continue
                rows.append((f"{name} (median)", statistics.median(values), 0, 0, load(),
                             " / ".join(f"{v:.2f}" for v in values)))
        start_s = float("nan")
        if "worker_start" not in args.skip:
            proc = subprocess.run([py, "-c", WORKER], cwd=tmp, capture_output=True, text=True,
                                  env=_env())
            times = [float(x) for x in proc.stdout.split()[-2:]] if proc.returncode == 0 \
                else [float("nan")] * 2
            start_s = times[0]
            rows.append(("worker_start", start_s, 0, proc.returncode, load(), "pool().get"))
            rows.append(("worker_next", times[1], 0, proc.returncode, load(), "a second"))
            print(f"worker_start: {start_s:.1f}s, next {times[1]:.1f}s load {load()}",
                  flush=True)
        cases = cases_file(tmp)
        adopt = [*suite, "-p", "perf_cases_plugin", "--kv-cases", cases, "-k"]
        a1 = measure("adopt_1", [*adopt, "test_kv_a3 and FLASH_ATTN and perf_00"], tmp)
        a40 = measure("adopt_40", [*adopt, "test_kv_a3 and FLASH_ATTN and perf_"], tmp)
        trivial = trivial_tests(tmp)
        off_t: list[tuple[float, float]] = []
        none_t: list[tuple[float, float]] = []
        off = none = off_cpu = none_cpu = float("nan")
        if "off" not in args.skip:
            for _ in range(args.repeat):
                off_t.append(_wall_cpu(timed_cpu([*pytest, "--co", trivial], tmp)))
                none_t.append(_wall_cpu(timed_cpu([*pytest, "--co", "-p", "no:kvconform",
                                                   trivial], tmp)))
            off, off_cpu = (statistics.median(v) for v in zip(*off_t, strict=True))
            none, none_cpu = (statistics.median(v) for v in zip(*none_t, strict=True))
            for name, wall, cpu, runs in (("off", off, off_cpu, off_t),
                                          ("no_plugin", none, none_cpu, none_t)):
                walls = sorted(w for w, _ in runs)
                rows.append((f"{name} (median)", wall, 0, 0, load(),
                             f"{len(runs)} runs; wall quartiles {_quartiles(walls)}; "
                             f"CPU median {cpu:.3f}s"))
            print(f"off {off:.3f}s vs no plugin {none:.3f}s (CPU {off_cpu:.3f}s vs "
                  f"{none_cpu:.3f}s)", flush=True)

    per_case = (a40 - a1) / 39
    goals = [
        ("serial / import floor", serial / floor, "<= 1.6"),
        ("serial / quiet import floor", serial / quiet, "(<= 1.6)"),
        (f"baseline serial / import floor ({args.baseline})", baseline / floor, "(<= 1.6)"),
        ("-n 2 / serial", xdist2 / serial, "<= 1.0"),
        ("backend-scoped (--kv-backend FLASH_ATTN) / import floor", scoped / floor, "<= 1.3"),
        (f"baseline backend-scoped / import floor ({args.baseline})", scoped_base / floor,
         "(<= 1.3)"),
        ("backend-scoped / frozen import floor", scoped / frozen, "(<= 1.3)"),
        (f"vLLM-backend-scoped (--kv-backend {VLLM_BACKEND}) / vLLM registry import floor",
         scoped_vllm / vllm_floor, "<= 1.3"),
        (f"vLLM-backend-scoped (--kv-backend {VLLM_BACKEND}) / import floor",
         scoped_vllm / floor, "(<= 1.3)"),
        ("serial / frozen import floor", serial / frozen, "(<= 1.6)"),
        ("extra adoption case / worker start", per_case / start_s, "<= 0.02"),
        ("plugin off / -p no:kvconform", off / none, "<= 1.02"),
        ("plugin off / -p no:kvconform, CPU seconds", off_cpu / none_cpu, "(<= 1.02)"),
        ("peak RSS per process, MiB", max((r[2] for r in rows), default=0), "< 1024"),
    ]
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    out = [f"\n## {stamp} — cost goals{', ' + args.label if args.label else ''} "
           f"({os.cpu_count()} cores)\n",
           "| measurement | wall s | peak RSS MiB | exit | load 1/5/15 | last line |",
           "|---|---|---|---|---|---|"]
    out += [f"| {n} | {s:.2f} | {p or '-'} | {c} | {ld} | {last.replace('|', '/')} |"
            for n, s, p, c, ld, last in rows]
    out += ["", f"Marginal adoption case: ({a40:.1f} - {a1:.1f}) / 39 = {per_case:.3f} s.", "",
            "| goal | measured | target |", "|---|---|---|"]
    out += [f"| {g} | {v:.3f} | {t} |" for g, v, t in goals]
    text = "\n".join(out) + "\n"
    print(text)
    with open(args.output, "a", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
