"""``kvconform gpu-check``: run the GPU checks against the installed stack, judge, report.

Two pytest runs of the installed suite, each in its own process with its log in OUT
(this process creates no CUDA context while they run):

1. KV-A6 for every discovered backend and seam, and KV-L7 for every backend plus the
   paged stand-ins (``adapters/paged_standins.py``), serially on GPU 0;
2. ``pytest --kv-conformance -n auto`` with the pinning plugin (``gpu/pinning.py``):
   what each xdist worker was pinned to.

Then KV-A6's sizing for GPU 0's free memory, computed here by the control plane
(``gpu/sizing.py``), and the verdicts (``gpu/check_verdicts.py``) into OUT/REPORT.md and JSON.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from pytest_kvconform.adapters import paged_standins, run_env
from pytest_kvconform.gpu import check_verdicts, pinning, report
from pytest_kvconform.gpu import host as gpu_host
from pytest_kvconform.gpu.check_verdicts import CheckVerdict, Verdict
from pytest_kvconform.gpu.sizing import A6Sizing, a6_sizing
from pytest_kvconform.report.build import ReportError, load_report
from pytest_kvconform.report.env import environment_info

# The suite's tests each step selects (``-k``): KV-A6 but the stand-ins' (they test KV-L7),
# every KV-L7; KV-L1 is the pinning step's (quick, one test per backend).
SUITE_SELECTION = "(kv_a6 and not PAGED_) or kv_l7"
PINNING_SELECTION = "kv_l1"
SUITE_REPORT = "suite.json"
PINNING_FILE = "pinning.json"
NORMAL_EXITS = (0, 1)  # pytest: all passed / some tests failed (the misreads must)


@dataclass(frozen=True)
class Step:
    """One pytest run of the gpu-check, in its own process."""

    name: str
    argv: tuple[str, ...]

    @property
    def log(self) -> str:
        return f"{self.name}.log"


def suite_step(out: Path, memory_fraction: float, python: str = sys.executable) -> Step:
    return Step("suite", (
        python, "-m", "pytest", "--kv-conformance", "-p", paged_standins.__name__,
        "-p", "no:cacheprovider", "-p", "no:xdist", "-rs", "-k", SUITE_SELECTION,
        "--kv-memory-fraction", str(memory_fraction), "--kv-report", str(out / SUITE_REPORT)))


def pinning_step(out: Path, python: str = sys.executable) -> Step:
    return Step("pinning", (
        python, "-m", "pytest", "--kv-conformance", "-n", "auto", "-p", pinning.__name__,
        "--kv-gpu-pinning", str(out / PINNING_FILE), "-p", "no:cacheprovider",
        "-k", PINNING_SELECTION))


def run_step(step: Step, out: Path) -> dict[str, Any]:
    """Run ``step`` in ``out`` with its output in its log; what happened, as a record."""
    started = time.monotonic()
    with (out / step.log).open("w", encoding="utf-8") as log:
        code = subprocess.run(step.argv, cwd=out, stdin=subprocess.DEVNULL, stdout=log,
                              stderr=subprocess.STDOUT, check=False).returncode
    done: dict[str, Any] = {"name": step.name, "argv": list(step.argv), "returncode": code,
                            "seconds": round(time.monotonic() - started, 1), "log": step.log}
    if code not in NORMAL_EXITS:
        text = (out / step.log).read_text(encoding="utf-8", errors="replace")
        done["log_tail"] = text.splitlines()[-report.LOG_TAIL_LINES:]
    return done


def _suite_results(out: Path) -> tuple[list[dict[str, Any]], str | None]:
    try:
        results = load_report(out / SUITE_REPORT).get("results")
    except ReportError as exc:
        return [], exc.message
    return (results, None) if isinstance(results, list) else ([], "no results in the report")


def _unreadable(name: str, why: str, step_log: str) -> CheckVerdict:
    return CheckVerdict(name, Verdict.NOT_CHECKED, f"{why} (see {step_log})")


def _sizings(free: int, fraction: float, device: str) -> list[A6Sizing]:
    return [a6_sizing(free, fraction=fraction, need=need, device=device)
            for need in (False, True)]


def run(out: Path, *, memory_fraction: float, gpus: gpu_host.GpuHost,
        sizing_device: str = "cuda:0",
        free_memory: Callable[[int], int] = gpu_host.free_memory,
        echo: TextIO | None = None) -> dict[str, Any]:
    """Every step, judged; writes OUT/REPORT.md and OUT/gpu-check.json, returns the record.

    ``gpus`` is :func:`gpu_host.probe`'s answer; the tests pass their own (and
    ``sizing_device="cpu"``) to run all of it on CPU.  ``echo`` defaults to the
    ``sys.stdout`` of the call, not of the import (pytest's capture swaps it).
    """
    echo = sys.stdout if echo is None else echo
    started = time.monotonic()
    steps = []
    for step in (suite_step(out, memory_fraction), pinning_step(out)):
        print(f"kvconform gpu-check: {step.name}: {shlex.join(step.argv)} (log: "
              f"{out / step.log})", file=echo, flush=True)
        steps.append(run_step(step, out))
        print(f"kvconform gpu-check: {step.name}: exit {steps[-1]['returncode']} in "
              f"{steps[-1]['seconds']} s", file=echo, flush=True)

    results, problem = _suite_results(out)
    checks = [_unreadable("KV-A6", problem, "suite.log"),
              _unreadable("KV-L7", problem, "suite.log")] if problem else \
        [check_verdicts.judge_a6(results), check_verdicts.judge_l7(results)]
    try:
        records = pinning.read_records(out / PINNING_FILE)
        checks.append(check_verdicts.judge_pinning(records, len(gpus.devices)))
    except pinning.PinningError as exc:
        records = []
        checks.append(_unreadable("xdist pinning", str(exc), "pinning.log"))
    sizings: list[A6Sizing] = []
    environment = environment_info({"memory_fraction": memory_fraction}, None)
    # Last: this process's CUDA context on GPU 0 is made once the steps are done.  What
    # importing the stack prints here is kept as a run keeps it (the environment's log).
    with run_env.applied(), run_env.captured_output() as printed:
        try:
            sizings = _sizings(free_memory(0), memory_fraction, sizing_device)
            checks.append(check_verdicts.judge_sizing(sizings))
        except Exception as exc:  # the control plane's own failure, reported as such
            checks.append(CheckVerdict("KV-A6 sizing", Verdict.FAILED, "the control plane "
                                       f"raised {type(exc).__name__}: {exc}"))
    environment[run_env.IMPORT_LOG_KEY] = printed

    record = report.record(
        checks=checks, host=gpus.as_dict(), environment=environment,
        steps=steps, sizing=[s.as_dict() for s in sizings],
        pinning=[r.as_dict() for r in records], seconds=time.monotonic() - started)
    markdown = report.write(out, record)
    print(_summary(checks, markdown), file=echo, flush=True)
    return record


def _summary(checks: Sequence[CheckVerdict], markdown: Path) -> str:
    lines = [f"kvconform gpu-check: {c.name}: {c.verdict.value} ({c.summary})" for c in checks]
    final = report.final_verdict(checks)
    return "\n".join([*lines, f"kvconform gpu-check: {final.value}; report in {markdown}"])
