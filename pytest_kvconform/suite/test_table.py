"""Suite tests generated from the clause table, for the rows no hand-written test covers.

A new clause is a check function plus a row in ``pytest_kvconform.contract.clauses``;
this module turns the row into ``test_kv_<x><n>[...]``, parametrised over the
same fixtures (and case predicate) as the hand-written tests.  Rows that a
hand-written suite module already runs generate nothing here, so their test
ids stay where they are.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

from pytest_kvconform.checks.arguments import Sources, arguments
from pytest_kvconform.contract import clauses
from pytest_kvconform.suite.check_call import FIXTURE, run_check

# The hand-written suite modules; a test function defined there is not generated.
HAND_WRITTEN = ("test_layout", "test_strides", "test_nullblock", "test_adoption")


def _hand_written() -> set[str]:
    import importlib

    names: set[str] = set()
    for module in HAND_WRITTEN:
        names |= {n for n in vars(importlib.import_module(f"pytest_kvconform.suite.{module}"))
                  if n.startswith("test_")}
    return names


def _sources(request: pytest.FixtureRequest, fixtures: dict[str, Any]) -> Sources:
    """The check's arguments' sources, from the test's fixtures."""
    from pytest_kvconform.plugin import kv_session

    return Sources.of(fixtures,
                      memory_fraction=kv_session(request.config).options.memory_fraction)


def generated_test(row: clauses.Clause, check: clauses.Check) -> Callable[..., None]:
    """A suite test for one check of a row: its fixtures, its case marker, its name."""
    fixtures = ["request", *dict.fromkeys(FIXTURE[a] for a in check.args if a != "memory_fraction")]

    def test(request: pytest.FixtureRequest, **kwargs: Any) -> None:
        run_check(request, check.resolve(), *arguments(check.args, _sources(request, kwargs)))

    test.__name__ = test.__qualname__ = row.test_name(check)
    test.__doc__ = f"{row.id} {row.title} (generated from the clause table)."
    test.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in fixtures])
    if row.cases is not None:
        return pytest.mark.kv_cases.with_args(row.cases)(test)
    return test


def generate(namespace: dict[str, Any]) -> list[str]:
    """Add a test to ``namespace`` for every table check without a hand-written one."""
    existing = _hand_written()
    added = []
    for name, (row, check) in clauses.check_names().items():
        if name not in existing:
            namespace[name] = generated_test(row, check)
            added.append(name)
    return added


GENERATED = generate(globals())
