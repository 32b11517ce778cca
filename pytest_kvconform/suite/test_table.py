"""Suite tests generated from the clause table for a family without a suite module of its own.

Every family in ``clauses.FAMILY_MODULES`` has its module (``test_layout.py``, ...), which
generates its tests; a row of any other family has its ``test_kv_<x><n>[...]`` generated
here, the same way (``suite/generate.py``).
"""

from __future__ import annotations

from pytest_kvconform.suite.generate import generate, generated_test

__all__ = ["GENERATED", "generate", "generated_test"]

GENERATED = generate(globals())
