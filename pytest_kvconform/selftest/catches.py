"""The verdict on each seeded fault, and the account of a self-test (text and JSON).

A fault is **caught** when a result of its guarding checks fails under the fault and passes
on the clean install (matched by test id); **missed** when none does; **unseedable** when
the installed version cannot take it; **error** when its run crashed or timed out.  Only
seedable faults count, and the command exits non-zero unless every one was caught.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pytest_kvconform.api import CheckResult
from pytest_kvconform.faults.registry import Fault

Outcome = Literal["caught", "missed", "unseedable", "error"]
EXIT_ALL_CAUGHT = 0
EXIT_NOT_ALL_CAUGHT = 1
SCHEMA = "kvconform-selftest/1"


@dataclass(frozen=True)
class FaultResult:
    """One fault's verdict: ``detail`` is the result that caught it, why it was missed, or
    why it cannot be seeded here."""

    fault: Fault
    outcome: Outcome
    detail: str
    results: tuple[CheckResult, ...] = ()
    duration_s: float = 0.0


@dataclass
class SelftestRun:
    """Everything one ``kvconform selftest`` found."""

    versions: dict[str, str | None]
    faults: list[FaultResult]
    baseline: list[CheckResult] = field(default_factory=list)
    baseline_errors: list[str] = field(default_factory=list)
    import_messages: int = 0
    prepare_s: float = 0.0
    duration_s: float = 0.0
    jobs: int = 1
    device: str = "cpu"  # where the checks ran

    @property
    def seedable(self) -> list[FaultResult]:
        return [r for r in self.faults if r.outcome != "unseedable"]

    @property
    def caught(self) -> list[FaultResult]:
        return [r for r in self.faults if r.outcome == "caught"]

    @property
    def exit_code(self) -> int:
        """0 when every seedable fault was caught, else 1."""
        return EXIT_ALL_CAUGHT if len(self.caught) == len(self.seedable) else EXIT_NOT_ALL_CAUGHT


# --- the verdict --------------------------------------------------------------------------------


def judge(seeded: Sequence[CheckResult], clean: Mapping[str, CheckResult]) -> tuple[Outcome, str]:
    """Caught when a guarding result fails under the fault and passes clean (by test id);
    otherwise missed, saying what the guarding results did instead."""
    caught = [r for r in seeded if r.status == "failed"
              and clean.get(r.test) is not None and clean[r.test].status == "passed"]
    if caught:
        first = caught[0]
        return "caught", (f"{len(caught)} of {len(seeded)} guarding results fail that pass "
                          f"clean; first {first.test}: {first_line(first.message)}")
    if not seeded:
        return "missed", "no guarding check ran (the clauses select nothing for this backend " \
                         "and these cases)"
    counts: dict[str, int] = {}
    notes: list[str] = []
    for r in seeded:
        before = clean.get(r.test)
        if r.status == "failed" and before is None:
            key = "failed with no clean result to compare"
        elif r.status == "failed":
            key = f"failed on the clean install too ({before.status if before else '?'})"
            if len(notes) < 1:
                notes.append(f"{r.test} clean: {first_line(before.message if before else '')}")
        elif r.status == "error":
            key = f"error ({r.error_kind.value if r.error_kind else 'harness'})"
            if len(notes) < 1:
                notes.append(f"{r.test}: {first_line(r.message)}")
        else:
            key = r.status
        counts[key] = counts.get(key, 0) + 1
    summary = ", ".join(f"{n} {key}" for key, n in counts.items())
    detail = f"none of its {len(seeded)} guarding results fails where the clean install " \
             f"passes: {summary}"
    return "missed", detail + (f"; {notes[0]}" if notes else "")


def first_line(text: str, limit: int = 400) -> str:
    line = text.strip().splitlines()[0] if text.strip() else "(no message)"
    return line if len(line) <= limit else line[:limit - 3] + "..."


# --- the account ----------------------------------------------------------------------------


def summary_line(found: SelftestRun) -> str:
    seedable, caught = found.seedable, found.caught
    line = f"kvconform selftest: caught {len(caught)}/{len(seedable)} seedable faults"
    missed = [r.fault.name for r in seedable if r.outcome != "caught"]
    if missed:
        line += f"; not caught: {', '.join(missed)}"
    unseedable = [r.fault.name for r in found.faults if r.outcome == "unseedable"]
    if unseedable:
        line += f"; {len(unseedable)} not seedable here: {', '.join(unseedable)}"
    return f"{line} ({found.duration_s:.0f}s)"


def render(found: SelftestRun) -> str:
    """The terminal account: the stack, one line per fault, the verdict."""
    v = found.versions
    lines = [f"kvconform selftest: vllm {v.get('vllm')}, vllm-omni {v.get('vllm-omni')}, torch "
             f"{v.get('torch')}; {len(found.faults)} faults, each seeded in a fresh process "
             f"({found.jobs} at a time), its guarding clauses checked on {found.device} "
             "against the clean baseline"]
    lines += [f"kvconform selftest: clean baseline error: {first_line(e)}"
              for e in found.baseline_errors]
    width = max((len(r.fault.name) for r in found.faults), default=0)
    for r in found.faults:
        lines.append(f"{r.outcome:<10} {r.fault.name:<{width}}  "
                     f"[{', '.join(r.fault.clauses)}]  {first_line(r.detail, 240)}")
    lines.append(summary_line(found))
    return "\n".join(lines) + "\n"


def as_json(found: SelftestRun) -> dict[str, Any]:
    """The run as plain JSON values."""
    def result(r: CheckResult) -> dict[str, Any]:
        return {"test": r.test, "clause": r.clause, "status": r.status, "message": r.message,
                "skip_kind": r.skip_kind.value if r.skip_kind else None,
                "error_kind": r.error_kind.value if r.error_kind else None,
                "via": r.via}

    return {
        "schema": SCHEMA,
        "environment": {"versions": found.versions, "device": found.device,
                        "import_messages": found.import_messages},
        "summary": {"faults": len(found.faults), "seedable": len(found.seedable),
                    "caught": len(found.caught), "exit_code": found.exit_code,
                    "prepare_s": found.prepare_s, "duration_s": found.duration_s,
                    "jobs": found.jobs},
        "faults": [{"name": r.fault.name, "family": r.fault.family, "seeded": r.fault.how,
                    "what": r.fault.what, "clauses": list(r.fault.clauses),
                    "backend": r.fault.backend, "cases": list(r.fault.cases),
                    "beside": list(r.fault.beside), "outcome": r.outcome, "detail": r.detail,
                    "duration_s": r.duration_s, "results": [result(x) for x in r.results]}
                   for r in found.faults],
        "baseline": [result(r) for r in found.baseline],
        "baseline_errors": found.baseline_errors,
    }
