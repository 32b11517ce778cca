"""The GPU checks' verdicts: what each result means on a CUDA host with vLLM's kernels.

Three verdicts per check.  ``ok``: it ran and held.  ``failed``: a clause failed, a
harness error, a seeded misread let through, or a worker not pinned to its own GPU.
``not checked``: it could not run here (the step ran nothing, a skip for hardware or
environment, an allocation too small to reach 2^32), which is not a pass.  Results are
the suite's report rows (``report/schema.py``), read as plain mappings.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pytest_kvconform.adapters.paged_standins import CONFORMING, MISREADS
from pytest_kvconform.checks.adoption_bytes import PROBES
from pytest_kvconform.checks.paged import FIRST_WRONG_BLOCK
from pytest_kvconform.contract.outcomes import SkipKind
from pytest_kvconform.gpu.pinning import WorkerRecord
from pytest_kvconform.gpu.sizing import A6Sizing

# Skips that say the clause does not concern this backend: not a gap in the check.
IRRELEVANT = frozenset({SkipKind.NOT_APPLICABLE.value, SkipKind.BACKEND.value})
PINNED_DEVICE = "cuda:0"  # what a pinned worker's kv_device is: its one visible GPU


class Verdict(StrEnum):
    OK = "ok"
    FAILED = "failed"
    NOT_CHECKED = "not checked"


@dataclass(frozen=True)
class Row:
    """One line of a check: what it is about, what happened, what the rule wants."""

    subject: str
    outcome: str
    expected: str
    verdict: Verdict
    detail: str = ""


@dataclass(frozen=True)
class CheckVerdict:
    name: str
    verdict: Verdict
    summary: str
    rows: tuple[Row, ...] = ()


def overall(rows: Iterable[Row], *, gaps: Sequence[str] = ()) -> Verdict:
    """Failed if a row failed; not checked if a row was, or the check has gaps; else ok."""
    verdicts = {r.verdict for r in rows}
    if Verdict.FAILED in verdicts:
        return Verdict.FAILED
    return Verdict.NOT_CHECKED if gaps or Verdict.NOT_CHECKED in verdicts else Verdict.OK


def _reason(result: Mapping[str, Any]) -> str:
    return str(result.get("reason") or "")


def _test(result: Mapping[str, Any]) -> str:
    return str(result.get("nodeid", "?")).rpartition("::")[2]


def _outcome(result: Mapping[str, Any]) -> str:
    kind = result.get("skip_kind") or result.get("error_kind")
    return f"{result.get('status')} ({kind})" if kind else str(result.get("status"))


def _must_pass(result: Mapping[str, Any], expected: str) -> Row:
    """A clause that must hold here: passed is ok, a relevant skip was not checked."""
    status = result.get("status")
    if status == "passed":
        verdict = Verdict.OK
    elif status == "skipped":
        verdict = Verdict.OK if result.get("skip_kind") in IRRELEVANT else Verdict.NOT_CHECKED
    else:
        verdict = Verdict.FAILED
    return Row(_test(result), _outcome(result), expected, verdict, _reason(result))


def _count(rows: Sequence[Row]) -> str:
    counts = Counter(r.verdict.value for r in rows)
    return ", ".join(f"{n} {v}" for v, n in sorted(counts.items()))


def judge_a6(results: Sequence[Mapping[str, Any]]) -> CheckVerdict:
    """KV-A6: every backend's free-memory-sized allocation holds its far pages."""
    rows = tuple(_must_pass(r, "passed (or not applicable)")
                 for r in results if r.get("clause") == "KV-A6")
    ran = any(r.outcome == "passed" for r in rows)
    gaps = [] if ran else ["no KV-A6 test passed"]
    summary = f"{len(rows)} results: {_count(rows)}" if rows else "no KV-A6 result"
    return CheckVerdict("KV-A6", overall(rows, gaps=gaps), summary, rows)


def _standin_row(result: Mapping[str, Any]) -> Row:
    backend, status, reason = str(result.get("backend")), result.get("status"), _reason(result)
    if backend in CONFORMING:
        return _must_pass(result, "passed: a conforming read")
    expected = f"failed, naming the {FIRST_WRONG_BLOCK}: a seeded misread"
    if status == "failed" and FIRST_WRONG_BLOCK in reason:
        verdict = Verdict.OK
    elif status == "skipped":
        verdict = Verdict.NOT_CHECKED
    else:  # passed (the check let it through), or failed without localising it, or an error
        verdict = Verdict.FAILED
    return Row(_test(result), _outcome(result), expected, verdict, reason)


def judge_l7(results: Sequence[Mapping[str, Any]]) -> CheckVerdict:
    """KV-L7 on CUDA: the stand-ins as seeded, and every native paged backend passing."""
    l7 = [r for r in results if r.get("clause") == "KV-L7"]
    standins = CONFORMING | MISREADS
    rows = tuple(_standin_row(r) if r.get("backend") in standins
                 else _must_pass(r, "passed: the native paged path (or not applicable)")
                 for r in l7)
    seen = {str(r.get("backend")) for r in l7}
    gaps = [f"stand-in(s) not run: {', '.join(sorted(standins - seen))}"] \
        if standins - seen else []
    native = [r for r in l7 if r.get("backend") not in standins and r.get("status") == "passed"]
    if not native:
        gaps.append("no native backend's paged path passed (none ran)")
    summary = "; ".join([f"{len(rows)} results: {_count(rows)}" if rows else "no KV-L7 result",
                         *gaps])
    return CheckVerdict("KV-L7", overall(rows, gaps=gaps), summary, rows)


def _pinning_problems(r: WorkerRecord, visible: Counter[str | None]) -> list[str]:
    if r.error:  # the worker's record is lost (a crash): nothing else to judge
        return [r.error]
    problems = []
    if not r.cuda_visible_devices or "," in r.cuda_visible_devices:
        problems.append(f"CUDA_VISIBLE_DEVICES={r.cuda_visible_devices!r} is not one GPU")
    elif visible[r.cuda_visible_devices] > 1:
        problems.append(f"shares GPU {r.cuda_visible_devices} with another worker")
    if r.device_count != 1:
        problems.append(f"torch sees {r.device_count} CUDA devices, not 1")
    if r.kv_device is not None and r.kv_device != PINNED_DEVICE:
        problems.append(f"kv_device is {r.kv_device}, not {PINNED_DEVICE}")
    return problems


def judge_pinning(records: Sequence[WorkerRecord], gpus: int) -> CheckVerdict:
    """``-n auto``: one worker per GPU, each seeing exactly one GPU, no two the same."""
    visible = Counter(r.cuda_visible_devices for r in records)
    rows = []
    for r in records:
        problems = _pinning_problems(r, visible)
        outcome = (f"CUDA_VISIBLE_DEVICES={r.cuda_visible_devices}, {r.device_count} device(s)"
                   f"{f' ({r.device_name})' if r.device_name else ''}, kv_device "
                   f"{r.kv_device or '- (ran no test)'}, {r.tests} test(s)")
        rows.append(Row(r.worker, outcome, f"one GPU of its own, kv_device {PINNED_DEVICE}",
                        Verdict.FAILED if problems else Verdict.OK, "; ".join(problems)))
    summary = f"{len(records)} worker(s) for {gpus} GPU(s)"
    if not records:
        return CheckVerdict("xdist pinning", Verdict.NOT_CHECKED,
                            f"{summary}: no xdist worker reported")
    if len(records) != gpus:
        rows.append(Row("-n auto", f"{len(records)} worker(s)", f"{gpus}: one per GPU",
                        Verdict.FAILED))
    return CheckVerdict("xdist pinning", overall(rows), summary, tuple(rows))


def judge_sizing(sizings: Sequence[A6Sizing]) -> CheckVerdict:
    """KV-A6's allocation on this device reaches past 2^31 and 2^32 bytes, or it cannot
    probe them (the clause then skips for hardware: not checked)."""
    rows = []
    for s in sizings:
        short = [f"2^{b.bit_length() - 1}" for b in PROBES if not s.past(b)]
        rows.append(Row(f"need={s.need} ({s.layout})", f"{s.allocation_bytes} bytes",
                        "a page past " + " and ".join(f"2^{b.bit_length() - 1}" for b in PROBES),
                        Verdict.NOT_CHECKED if short else Verdict.OK,
                        f"no probe page reaches {', '.join(short)}" if short else ""))
    if not rows:
        return CheckVerdict("KV-A6 sizing", Verdict.NOT_CHECKED, "not computed")
    free = sizings[0]
    summary = (f"{free.fraction} of {free.free_bytes} free bytes "
               f"({free.free_bytes / 2**20:.0f} MiB) on GPU 0")
    return CheckVerdict("KV-A6 sizing", overall(rows), summary, tuple(rows))
