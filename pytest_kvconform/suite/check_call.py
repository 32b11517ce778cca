"""Run one clause check under pytest: a ClauseSkip becomes a reported skip, a harness
fault an error of its kind (see ``contract/outcome_rule.py``).

The check runs inside the per-test budget (``--kv-timeout``): every wait in it is
bounded by what is left (``workers/budget.py``).  A check that calls into a backend's
class from this process runs whole in a child forked for it (``workers/isolated.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pytest_kvconform.checks.arguments import FIXTURE
from pytest_kvconform.checks.common import run_in_child, via_recorded
from pytest_kvconform.checks.errors import ClauseSkip, Unsupported
from pytest_kvconform.contract.records import SKIP_KIND_PROPERTY, VIA_PROPERTY, BackendUnderTest
from pytest_kvconform.workers import budget

__all__ = ["FIXTURE", "run_check"]  # FIXTURE: the fixture each check argument comes from


def run_check(request: pytest.FixtureRequest, check: Callable[..., Any], *args: Any) -> Any:
    """Call ``check`` (in a child process of its own when its table row says so:
    ``clauses.Check.isolated``); its value.  Skips keep their kind on user_properties for
    strict mode.

    Harness faults escaping the test body are classified by the session's
    ``pytest_runtest_makereport`` (status ``error`` with their kind, never a failure).
    """
    from pytest_kvconform.contract import clauses
    from pytest_kvconform.plugin import kv_session

    clause = clauses.clause_from_test_name(request.node.name)
    row = clauses.check_names().get(getattr(request.node, "originalname", request.node.name))
    try:
        try:
            with budget.per_test(kv_session(request.config).options.timeout), \
                    via_recorded() as via:
                try:
                    if row is not None and row[1].isolated:
                        return run_in_child(check, args, clause=clause or row[0].id,
                                            backend=_backend_name(args))
                    return check(*args)
                finally:
                    if via:
                        request.node.user_properties.append((VIA_PROPERTY, "; ".join(via)))
        except Unsupported as exc:  # an adapter's absence the check did not claim: the test's
            raise exc.skip(clause or "KV-?") from None
    except ClauseSkip as skip:
        request.node.user_properties.append((SKIP_KIND_PROPERTY, skip.kind.value))
        # Reported at the test, not at this helper.
        raise pytest.skip.Exception(f"{skip.clause}: {skip.reason}", _use_item_location=True)\
            from None


def _backend_name(args: tuple[Any, ...]) -> str | None:
    return next((a.name for a in args if isinstance(a, BackendUnderTest)), None)
