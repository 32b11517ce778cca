"""``kvconform matrix``: the strict suite in every supported environment, one report per leg
and a combined one.

The legs are tox.ini's ``matrix`` label, one environment per supported vLLM minor with the
vllm-omni it supports where one does.  They run one after the other: the suite keeps both
cores of a small host busy, so two legs at once would only contend.  Each leg runs the
release qualification (``--kv-strict``) with the known findings shipped for its stack
(``--kv-xfails auto``).  The combined report is rewritten after every leg, so an
interrupted matrix still leaves what finished, marked interrupted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pytest_kvconform.crossversion.tox_leg import Leg, LegOutcome, Tox, ToxError, run_leg
from pytest_kvconform.report.build import (
    ReportError,
    load_report,
    now_iso,
    run_record,
    validate_report,
    write_matrix,
)
from pytest_kvconform.report.matrix import build_matrix, describe_leg
from pytest_kvconform.workers.lifetime import terminate_as_interrupt

LABEL = "matrix"
COMBINED = "matrix.json"


class MatrixUsageError(ValueError):
    """A leg name tox.ini does not know, a bad path: one line naming it."""


def suite_args(report: Path, xfails: Path | str = "auto", extra: Sequence[str] = ()
               ) -> list[str]:
    """The release qualification run of one leg (README's main job), writing ``report``;
    ``xfails`` as ``--kv-xfails`` takes it (auto: the file shipped for the leg's stack)."""
    known = ["--kv-xfails", str(xfails)] if str(xfails) != "auto" else []
    return ["--kv-conformance", "--kv-strict", "-rs", *known, "--kv-report", str(report),
            *extra]


def select_legs(available: Sequence[Leg], wanted: Sequence[str]) -> list[Leg]:
    """The legs named (all without names); an unknown name is a usage error listing them."""
    if not wanted:
        return list(available)
    by_name = {leg.name: leg for leg in available}
    unknown = [name for name in wanted if name not in by_name]
    if unknown:
        raise MatrixUsageError(f"--leg {', '.join(unknown)}: not in tox.ini's {LABEL!r} label "
                               f"(legs: {', '.join(by_name)})")
    return [by_name[name] for name in dict.fromkeys(wanted)]


def run_matrix(*, root: Path, out: Path, legs: Sequence[str] = (), tox: Sequence[str] = ("tox",),
               xfails: Path | str = "auto", extra: Sequence[str] = (),
               timeout: float | None = None,
               echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every selected leg and return the combined report (also written to ``out``).

    Ctrl-C or SIGTERM stops the running leg (its suite ends as interrupted and writes
    what it finished) and leaves the combined report marked interrupted; the
    ``KeyboardInterrupt`` is then re-raised.
    """
    if isinstance(xfails, Path) and not xfails.is_file():
        raise MatrixUsageError(f"--xfails {xfails}: no such file")
    runner = Tox(root, tox, timeout=timeout)
    chosen = select_legs(runner.legs(LABEL), legs)
    out.mkdir(parents=True, exist_ok=True)
    combined = out / COMBINED
    run_id, started, clock = run_record()["id"], now_iso(), time.monotonic()
    outcomes: list[LegOutcome] = [LegOutcome(leg, reason="not run yet") for leg in chosen]
    undo = terminate_as_interrupt()
    interruption = None
    try:
        for i, leg in enumerate(chosen):
            echo(f"kvconform: matrix: leg {i + 1}/{len(chosen)} {leg.name} "
                 f"({leg.description or 'no description'})")
            report = out / f"{leg.name}.json"
            try:
                outcomes[i] = run_leg(runner, leg, report=report, log=out / f"{leg.name}.log",
                                      pytest_args=suite_args(report, xfails, extra))
            except KeyboardInterrupt as exc:
                outcomes[i] = getattr(exc, "outcome", outcomes[i])
                interruption = f"{type(exc).__name__} during leg {leg.name}"
                for later in outcomes[i + 1:]:
                    later.reason = "not run: the matrix was interrupted"
                raise
            finally:
                matrix = _write(combined, outcomes, (run_id, started, clock), interruption)
            echo(f"kvconform: matrix: {describe_leg(_leg(matrix, leg.name))}")
    finally:
        if undo is not None:
            undo()
    return matrix


def _leg(matrix: dict[str, Any], name: str) -> dict[str, Any]:
    return next(leg for leg in matrix["legs"] if leg["name"] == name)


def _write(combined: Path, outcomes: Sequence[LegOutcome], run: tuple[str, str, float],
           interruption: str | None) -> dict[str, Any]:
    """Build and write the combined report from the legs so far."""
    base = combined.parent
    records, reports = [], {}
    for outcome in outcomes:
        if outcome.report is not None:
            try:
                report = load_report(outcome.report)
                validate_report(report)
                reports[outcome.leg.name] = report
            except ReportError as exc:
                outcome.state, outcome.report = "no report", None
                outcome.reason = f"its report is not valid: {exc.message}"
        if outcome.state == "interrupted" and outcome.leg.name in reports:
            outcome.state = "ran"  # what it finished is in its report, verdict interrupted
        records.append(outcome.record(base, base / f"{outcome.leg.name}.log"))
    run_id, started, clock = run
    matrix = build_matrix(records, reports, run_record(
        run_id=run_id, started=started, duration_s=time.monotonic() - clock,
        interruption=interruption))
    write_matrix(combined, matrix, reports)
    return matrix


__all__ = ["COMBINED", "LABEL", "MatrixUsageError", "ToxError", "run_matrix",
           "select_legs", "suite_args"]
