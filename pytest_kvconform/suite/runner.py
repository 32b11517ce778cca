"""Run one clause check under pytest: a ClauseSkip becomes a reported skip.

The check runs inside the per-test budget (``--kv-timeout``); a harness fault
(:class:`HarnessError`) keeps its kind on user_properties (``kv_error_kind``) so
the report can show it as an error, never as the backend's failure.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pytest_kvconform import budget
from pytest_kvconform.checks.errors import ClauseSkip, HarnessError
from pytest_kvconform.model import SKIP_KIND_PROPERTY

ERROR_KIND_PROPERTY = "kv_error_kind"


def run_check(request: pytest.FixtureRequest, check: Callable[..., None], *args: Any,
              **kwargs: Any) -> None:
    """Call ``check``; skips keep their kind on user_properties for strict mode."""
    from pytest_kvconform.plugin import kv_session

    try:
        with budget.per_test(kv_session(request.config).options.timeout):
            check(*args, **kwargs)
    except ClauseSkip as skip:
        request.node.user_properties.append((SKIP_KIND_PROPERTY, skip.kind.value))
        # Reported at the test, not at this helper.
        raise pytest.skip.Exception(f"{skip.clause}: {skip.reason}", _use_item_location=True)\
            from None
    except HarnessError as exc:
        request.node.user_properties.append((ERROR_KIND_PROPERTY, exc.kind.value))
        raise
