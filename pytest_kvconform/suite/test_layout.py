"""KV-L: the layout contract, per backend.

The tests are generated from the clause table (``suite/generate.py``), but for
``test_kv_l7``, which also records what KV-L7 covered.
"""

from __future__ import annotations

import pytest

from pytest_kvconform.checks import layout
from pytest_kvconform.contract.records import BackendUnderTest
from pytest_kvconform.suite.check_call import run_check
from pytest_kvconform.suite.generate import generate

# user_properties key: which layouts x cases KV-L7 covered, and which did not apply.
L7_COVERAGE_PROPERTY = "kv_l7_coverage"


def test_kv_l7(request: pytest.FixtureRequest, kv_backend: BackendUnderTest,
               kv_device: str) -> None:
    """KV-L7 paged read path against a dense reference, on the backend's kernel device."""
    covered = run_check(request, layout.check_kv_l7, kv_backend, kv_device)
    request.node.user_properties.append((L7_COVERAGE_PROPERTY, covered))


GENERATED = generate(globals())
