"""How a suite test's clause failure reads: the verdict, and the line that reached it; and
every text its report shows, inert.

A :class:`ClauseFailure` is the contract's verdict, not a bug in the code that raised it:
its message names the clause, the backend, the case, what was expected and what happened.
pytest's long traceback would run through the suite's test function and ``run_check`` into
the check, quoting each frame's source, and building it is most of what a failing (or
xfailed: pytest renders it before the xfail marker decides) test costs beyond its check.
Under pytest's default
``--tb=auto`` a suite test's clause failure reads as ``pytest.fail(..., pytrace=False)``
does, plus one line naming where the check raised it.  ``--tb=long`` (or any other
style) and ``--full-trace`` get pytest's own rendering, and every other exception (a
harness error, a plugin bug) keeps its traceback.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from pytest_kvconform.contract import inert
from pytest_kvconform.contract.outcomes import ClauseFailure
from pytest_kvconform.workers.isolated import RAISED_AT_ATTR

# How pytest words a clause failure's crash line: the short summary and a result's reason
# start with the clause instead.
FAILURE_PREFIX = f"{ClauseFailure.__module__}.{ClauseFailure.__qualname__}: "


def concise(item: pytest.Item) -> None:
    """Render ``item``'s clause failures concisely (see the module docstring)."""
    default = item.repr_failure

    def repr_failure(excinfo: pytest.ExceptionInfo[BaseException],
                     style: Any = None) -> Any:
        config = item.config
        if style is not None:  # a caller's explicit choice (pytest's own pass none)
            return default(excinfo, style)
        if not excinfo.errisinstance(ClauseFailure) or \
                config.getoption("tbstyle", "auto") != "auto" or \
                config.getoption("fulltrace", False):
            return default(excinfo)
        rendered = excinfo.getrepr(style="value", funcargs=False)
        # The short summary's line starts with the clause, not the exception's import path.
        crash = rendered.reprcrash
        if crash is not None:
            rendered.reprcrash = dataclasses.replace(
                crash, message=crash.message.removeprefix(FAILURE_PREFIX))
        # A failure carried back from the child that ran the check (workers/isolated.py)
        # names where it was raised there; any other, its innermost shown frame here.
        raised_at = getattr(excinfo.value, RAISED_AT_ATTR, None)
        entries = excinfo.traceback.filter(excinfo)  # without __tracebackhide__ frames
        if raised_at is not None:
            path, line, name = raised_at
        elif entries:
            path, line, name = entries[-1].path, entries[-1].lineno + 1, entries[-1].name
        else:
            return rendered
        try:
            where = Path(path).relative_to(config.invocation_params.dir)
        except ValueError:
            where = Path(path)
        rendered.reprtraceback.extraline = (
            f"{where}:{line}: in {name} (--tb=long shows the traceback)")
        return rendered

    item.repr_failure = repr_failure  # type: ignore[method-assign]  # this item's own


def make_inert(report: pytest.TestReport) -> None:
    """Every text of a suite test's report (its failure or skip, the output it captured, its
    known finding's reason) inert (:func:`inert.terminal`), before the terminal, JUnit XML,
    xdist or the report's rows read it: a message quotes what a backend returned, raised or
    printed.  pytest's failure representation is a tree of dataclasses holding strings;
    colour is added when it is written, so it survives."""
    report.longrepr = _inert(report.longrepr, 0)
    report.sections = [(inert.terminal(title), inert.terminal(text))
                       for title, text in report.sections]
    wasxfail = getattr(report, "wasxfail", None)
    if isinstance(wasxfail, str):
        report.wasxfail = inert.terminal(wasxfail)


def _inert(value: Any, depth: int) -> Any:
    if isinstance(value, str):
        return inert.terminal(value)
    if depth > 32:
        return value
    if isinstance(value, tuple):
        return tuple(_inert(item, depth + 1) for item in value)
    if isinstance(value, list):
        return [_inert(item, depth + 1) for item in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            try:
                object.__setattr__(value, field.name,
                                   _inert(getattr(value, field.name), depth + 1))
            except (AttributeError, TypeError):  # a field that is not an attribute
                continue
    return value
