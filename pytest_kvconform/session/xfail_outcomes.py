"""Which expected-failure entry declares a suite test's outcome, and how its report says so.

A known finding absorbs only the outcome it describes: a harness error of a kind it
absorbs, a failure whose problems it matches, a skip of its kind and reason.  This is the
one place that decides, for the session's ``pytest_runtest_makereport``
(:mod:`~pytest_kvconform.session.results`); the entries themselves, how they are loaded
and which tests they name, are :mod:`~pytest_kvconform.session.xfails`'.  A failure no
entry describes stays a failure, naming the entry it differs from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pytest

from pytest_kvconform.contract.outcomes import ClauseFailure, describe_error
from pytest_kvconform.contract.records import SKIP_KIND_PROPERTY
from pytest_kvconform.session.result_rows import prefix_crash
from pytest_kvconform.session.selection import XFAIL_PROPERTY

if TYPE_CHECKING:
    from pytest_kvconform.session.xfails import XfailEntry


def known_error(report: pytest.TestReport, entries: Sequence[XfailEntry], kind: str) -> None:
    """A harness error stays xfailed only when an entry naming the test absorbs its kind;
    else the test fails."""
    found = next((e for e in entries if e.absorbs_error(kind)), None)
    if found is None:
        report.outcome = "failed"
        del report.wasxfail
    else:
        _declared_by(report, found)


def known_failure(report: pytest.TestReport, entries: Sequence[XfailEntry],
                  problems: tuple[str, ...]) -> None:
    """An xfail stands only when an entry naming the test describes this failure;
    else the test fails, naming the entry it differs from."""
    found = next((e for e in entries if e.describes_failure(problems)), None)
    if found is not None:
        _declared_by(report, found)
        return
    report.outcome = "failed"
    del report.wasxfail
    _differs(report, entries[0] if entries else None)


def known_skip(report: pytest.TestReport, entries: Sequence[XfailEntry]) -> None:
    """A skip is declared only by an entry that describes it (its kind and reason):
    any other stays a plain skip, which strict mode judges by the clause table."""
    props: dict[str, Any] = dict(report.user_properties)
    kind = props.get(SKIP_KIND_PROPERTY)
    found = next((e for e in entries if e.describes_skip(kind, _skip_reason(report))), None)
    if found is not None:
        _declared_by(report, found)
    else:
        report.user_properties = [(k, v) for k, v in report.user_properties
                                  if k != XFAIL_PROPERTY]


def failure_problems(exc: BaseException) -> tuple[str, ...]:
    """What a failure reports, one problem each: a clause failure's, or the escaped
    exception's ``Type: message``."""
    if isinstance(exc, ClauseFailure):
        return tuple(exc.problems)
    return (describe_error(exc),)


def _skip_reason(report: pytest.TestReport) -> str:
    if isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    return str(report.longrepr or "")


def _declared_by(report: pytest.TestReport, entry: XfailEntry) -> None:
    """The report names the entry that describes its outcome (not only the first)."""
    from pytest_kvconform.session.xfails import xfail_reason

    report.user_properties = [(k, v) for k, v in report.user_properties if k != XFAIL_PROPERTY]
    report.user_properties.append((XFAIL_PROPERTY, entry.describe()))
    if getattr(report, "wasxfail", None) is not None:
        report.wasxfail = xfail_reason(entry)


def _differs(report: pytest.TestReport, entry: XfailEntry | None) -> None:
    """Name, on a failed report, the known finding its failure is not: in the crash line
    (the short summary, the report's reason) and in a section of its own."""
    if entry is None:
        return
    note = (f"differs from known finding {entry.describe()} (it expects "
            f"{entry.expectation()})")
    report.sections.append(("kvconform: known finding", f"{note}: {entry.reason}"))
    prefix_crash(report, note)
