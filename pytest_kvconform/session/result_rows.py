"""A suite test's report as a result row, and a crashed test's properties read back from
its id.

Apart from :mod:`~pytest_kvconform.session.results` (the plugin that collects the rows and
concludes the run) because this is what a row is: the status a report's phase and xfail
state make, its reason from the crash line (:func:`prefix_crash` puts a note before it),
its properties.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import pytest

from pytest_kvconform.contract.clauses import clause_from_test_name, subject_of
from pytest_kvconform.contract.outcome_rule import ERROR_KIND_PROPERTY
from pytest_kvconform.contract.records import (
    CAUSED_BY_PROPERTY,
    SEEDED_FAULT_PROPERTY,
    SKIP_KIND_PROPERTY,
    VIA_PROPERTY,
    ResultRow,
)
from pytest_kvconform.session.failure_repr import FAILURE_PREFIX
from pytest_kvconform.session.selection import XFAIL_PROPERTY

# How pytest words a strict xfail's pass (its longrepr).
XPASS_STRICT = "[XPASS(strict)] "


def result_row(report: pytest.TestReport) -> ResultRow | None:
    """One result row, from the report of a suite test's phase; None for other tests
    and for phases that add nothing (a passing setup or teardown)."""
    props: dict[str, Any] = dict(report.user_properties)
    if "kv_clause" not in props:
        return None
    wasxfail = getattr(report, "wasxfail", None)
    error_kind = props.get(ERROR_KIND_PROPERTY)
    if report.when == "call":
        if wasxfail is not None:
            status = "xfailed" if report.skipped else "xpassed"
        elif report.failed and str(report.longrepr).startswith(XPASS_STRICT):
            status = "xpassed"  # strict: pytest fails it; the report keeps what it is
        elif report.failed and error_kind is not None:
            status = "error"  # the harness failed here, not the backend
        else:
            status = report.outcome
    elif report.failed:
        status = "error"
    elif report.skipped and report.when == "setup":
        status = "xfailed" if wasxfail is not None else "skipped"
    else:
        return None
    reason = ""
    if status == "skipped" and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
    elif status == "xpassed" and wasxfail is None:
        reason = str(report.longrepr)
    elif status in ("failed", "error"):
        crash = getattr(report.longrepr, "reprcrash", None)
        reason = crash.message if crash is not None else str(report.longrepr)
        reason = reason.removeprefix(FAILURE_PREFIX)
    elif wasxfail is not None:
        reason = str(wasxfail).removeprefix("reason: ")
    caused_by = props.get(CAUSED_BY_PROPERTY) if status in ("error", "xfailed") else None
    return ResultRow(
        nodeid=report.nodeid,
        backend=props.get("kv_backend"),
        clause=props["kv_clause"],
        case=props.get("kv_case"),
        layout=props.get("kv_layout"),
        device=props.get("kv_device"),
        status=status,
        reason=reason,
        duration_s=round(report.duration, 4),
        skip_kind=props.get(SKIP_KIND_PROPERTY),
        xfail=props.get(XFAIL_PROPERTY),
        error_kind=error_kind if status in ("error", "xfailed") else None,
        via=props.get(VIA_PROPERTY),
        seeded_fault=props.get(SEEDED_FAULT_PROPERTY),
        subject="backend" if caused_by else subject_of(test_function_of(report.nodeid)),
        caused_by=caused_by,
    )


def test_function_of(nodeid: str) -> str:
    """``.../test_layout.py::test_kv_l8_alias[TORCH_SDPA]`` -> ``test_kv_l8_alias``."""
    return nodeid.rpartition("::")[2].partition("[")[0]


def properties_from_id(nodeid: str, *, backends: Iterable[str], layouts: Iterable[str],
                       cases: Iterable[str], device: str) -> list[tuple[str, Any]] | None:
    """A suite test's properties read back from its id (``test_kv_a2[B-bf16_h8]``): the
    clause from its name, then its parameters in the suite's order (backend or need,
    layout, case), each matched against the known values.  None for other tests."""
    name = nodeid.rpartition("::")[2]
    clause = clause_from_test_name(name)
    if clause is None:
        return None
    params = name.partition("[")[2].removesuffix("]")
    found: dict[str, str | None] = {"kv_backend": None, "kv_layout": None, "kv_case": None}
    known = (("kv_backend", {*backends, "need_False", "need_True"}), ("kv_layout", set(layouts)),
             ("kv_case", set(cases)))
    for key, values in known:
        for value in sorted(values, key=len, reverse=True):  # the longest of two prefixes
            if params == value or params.startswith(value + "-"):
                found[key] = value
                params = params[len(value) + 1:]
                break
    return [("kv_clause", clause), *found.items(), ("kv_device", device)]


def prefix_crash(report: pytest.TestReport, note: str) -> None:
    """``note`` before a failure's crash line (the short summary, the report's reason)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        report.longrepr.reprcrash = dataclasses.replace(  # type: ignore[union-attr]
            crash, message=f"{note}: {crash.message.removeprefix(FAILURE_PREFIX)}")
    else:
        report.longrepr = f"{note}: {report.longrepr}"
