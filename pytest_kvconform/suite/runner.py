"""Run one clause check under pytest: a ClauseSkip becomes a reported skip."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pytest_kvconform.checks.errors import ClauseSkip
from pytest_kvconform.model import SKIP_KIND_PROPERTY


def run_check(request: pytest.FixtureRequest, check: Callable[..., None], *args: Any,
              **kwargs: Any) -> None:
    """Call ``check``; skips keep their kind on user_properties for strict mode."""
    try:
        check(*args, **kwargs)
    except ClauseSkip as skip:
        request.node.user_properties.append((SKIP_KIND_PROPERTY, skip.kind.value))
        # Reported at the test, not at this helper.
        raise pytest.skip.Exception(f"{skip.clause}: {skip.reason}", _use_item_location=True)\
            from None
