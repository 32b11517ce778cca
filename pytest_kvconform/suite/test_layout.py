"""KV-L: the layout contract, per backend."""

from __future__ import annotations

import pytest

from pytest_kvconform.checks import layout
from pytest_kvconform.model import BackendUnderTest
from pytest_kvconform.suite.runner import run_check


def test_kv_l1(request: pytest.FixtureRequest, kv_backend: BackendUnderTest) -> None:
    """KV-L1 declaration."""
    run_check(request, layout.check_kv_l1, kv_backend)


def test_kv_l2(request: pytest.FixtureRequest, kv_backend: BackendUnderTest) -> None:
    """KV-L2 resolution."""
    run_check(request, layout.check_kv_l2, kv_backend)
