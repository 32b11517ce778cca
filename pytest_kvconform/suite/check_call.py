"""Run one clause check under pytest: a ClauseSkip becomes a reported skip, a harness
fault an error of its kind (see ``contract/outcome_rule.py``).

The check runs inside the per-test budget (``--kv-timeout``): every wait in it is
bounded by what is left (``workers/budget.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pytest_kvconform.checks.arguments import FIXTURE
from pytest_kvconform.checks.common import via_recorded
from pytest_kvconform.checks.errors import ClauseSkip, Unsupported
from pytest_kvconform.contract.records import SKIP_KIND_PROPERTY, VIA_PROPERTY
from pytest_kvconform.workers import budget

__all__ = ["FIXTURE", "run_check"]  # FIXTURE: the fixture each check argument comes from


def run_check(request: pytest.FixtureRequest, check: Callable[..., None], *args: Any,
              **kwargs: Any) -> None:
    """Call ``check``; skips keep their kind on user_properties for strict mode.

    Harness faults escaping the test body are classified by the session's
    ``pytest_runtest_makereport`` (status ``error`` with their kind, never a failure).
    """
    from pytest_kvconform.contract.clauses import clause_from_test_name
    from pytest_kvconform.plugin import kv_session

    try:
        try:
            with budget.per_test(kv_session(request.config).options.timeout), \
                    via_recorded() as via:
                try:
                    check(*args, **kwargs)
                finally:
                    if via:
                        request.node.user_properties.append((VIA_PROPERTY, "; ".join(via)))
        except Unsupported as exc:  # an adapter's absence the check did not claim: the test's
            raise exc.skip(clause_from_test_name(request.node.name) or "KV-?") from None
    except ClauseSkip as skip:
        request.node.user_properties.append((SKIP_KIND_PROPERTY, skip.kind.value))
        # Reported at the test, not at this helper.
        raise pytest.skip.Exception(f"{skip.clause}: {skip.reason}", _use_item_location=True)\
            from None
