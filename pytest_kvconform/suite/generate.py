"""The suite's tests, generated from the clause table: one test function per table check.

Each family's suite module (``clauses.FAMILY_MODULES``: ``test_layout.py``,
``test_strides.py``, ``test_nullblock.py``, ``test_adoption.py``) ends with
``GENERATED = generate(globals())``, which adds a ``test_kv_<x><n>[_<variant>][_seam]``
function for every check of its family's rows, in table order, so the test ids and node ids
(``kvconform/test_layout.py::test_kv_l1[FLASH_ATTN]``) are the table's.  Each takes the
fixtures of its check's arguments (``checks/arguments.FIXTURE``) and carries its row's case
predicate as its ``kv_cases`` marker; the session parametrises those fixtures
(``session/selection.py``, through ``checks/arguments.expand``).

A module may still define a test by hand, for a check whose test does more than call it
(``test_kv_l7`` records what KV-L7 covered on the test's user properties); ``generate``
keeps it, in its table place.  Not a test module itself (no ``test_`` prefix).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

from pytest_kvconform.checks.arguments import FIXTURE, Sources, arguments
from pytest_kvconform.contract import clauses
from pytest_kvconform.suite.check_call import run_check

# The attribute a generated test carries: the table check it runs.
CHECK_ATTR = "kv_check"


def _sources(request: pytest.FixtureRequest, fixtures: dict[str, Any]) -> Sources:
    """The check's arguments' sources, from the test's fixtures."""
    from pytest_kvconform.plugin import kv_session

    return Sources.of(fixtures,
                      memory_fraction=kv_session(request.config).options.memory_fraction)


def generated_test(row: clauses.Clause, check: clauses.Check,
                   module: str = __name__) -> Callable[..., None]:
    """A suite test for one check of a row: its fixtures, its case marker, its name."""
    fixtures = ["request", *dict.fromkeys(FIXTURE[a] for a in check.args if a != "memory_fraction")]

    def test(request: pytest.FixtureRequest, **kwargs: Any) -> None:
        run_check(request, check.resolve(), *arguments(check.args, _sources(request, kwargs)))

    test.__name__ = test.__qualname__ = row.test_name(check)
    test.__module__ = module
    test.__doc__ = f"{row.id} {row.title} (generated from the clause table)."
    test.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in fixtures])
    setattr(test, CHECK_ATTR, check)
    if row.cases is not None:
        return pytest.mark.kv_cases.with_args(row.cases)(test)
    return test


def generate(namespace: dict[str, Any]) -> list[str]:
    """Put a test in ``namespace`` (a suite module's globals) for every table check of the
    rows collected from that module, in table order; a test the module defines by hand is
    kept (moved to its table place).  Returns the names generated."""
    module = namespace["__name__"].rpartition(".")[2]
    added = []
    for name, (row, check) in clauses.check_names().items():
        if row.suite_module != module:
            continue
        if name in namespace:  # hand-written: kept, in table order
            namespace[name] = namespace.pop(name)
        else:
            namespace[name] = generated_test(row, check, namespace["__name__"])
            added.append(name)
        namespace[name] = family_marker(row)(namespace[name])
    return added


# The marker of each side of the contract (``-m kv_vllm`` selects vLLM's own backends'
# clauses, ``-m kv_diffusion`` every other suite test); the plugin registers both.
FAMILY_MARKERS = {"vllm": "kv_vllm", "diffusion": "kv_diffusion"}


def family_marker(row: clauses.Clause) -> pytest.MarkDecorator:
    """The family marker of a row's tests: the V family's ``kv_vllm``, else ``kv_diffusion``."""
    family = "vllm" if row.family == "V" else "diffusion"
    return getattr(pytest.mark, FAMILY_MARKERS[family])
