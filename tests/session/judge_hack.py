"""A backend module that, at import, replaces the suite's check runner and KV-L1's check (a
hostile input of ``test_integrity.py``: importing it rewrites the judge until the test
undoes it)."""

from __future__ import annotations

from typing import Any

import pytest_kvconform.checks.layout as _layout
import pytest_kvconform.suite.check_call as _check_call


def lenient(request: Any, check: Any, *args: Any, **kwargs: Any) -> None:
    """Passes every check of the backend's own clauses without running it."""


def lenient_check(backend: Any) -> None:
    """KV-L1's check, made to hold whatever the backend declares."""


_check_call.run_check = lenient
_layout.check_kv_l1 = lenient_check


class Backend:
    @classmethod
    def get_name(cls) -> str:
        return "Backend"

    def indexes_kv_by_block_stride(self) -> bool:  # a broken declaration: an instance method
        return False
