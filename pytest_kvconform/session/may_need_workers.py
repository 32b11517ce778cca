"""Before collection: may this run select a KV-A test that needs worker processes?

Used only to start the KV-A workers early, so a wrong "yes" costs one
dropped worker and a wrong "no" costs only the overlap; nothing is decided by it.
"""

from __future__ import annotations

from typing import Any

# The suite tests that use ``kv_workers``: KV-A1..A6 (suite/test_adoption.py) and KV-L6.
ADOPTION_TESTS = ("test_kv_a1", "test_kv_a2", "test_kv_a3", "test_kv_a4", "test_kv_a5",
                  "test_kv_a6", "test_kv_l6", "test_adoption.py", "test_adoption",
                  "test_layout.py", "test_layout")


def may_select_adoption(config: Any) -> bool:
    """Whether ``-k`` leaves any KV-A test in the run (in whichever process runs it)."""
    keyword = getattr(config.option, "keyword", "") or ""
    if not keyword:
        return True
    return any(_evaluate(keyword, other) for other in (True, False))


def _evaluate(keyword: str, other: bool) -> bool:
    """``-k`` with suite-name words matched against the adoption tests, the rest ``other``."""
    try:
        from _pytest.mark.expression import Expression

        expression = Expression.compile(keyword)
    except Exception:  # pytest reports a bad -k itself
        return True

    def match(word: str, /, **_: Any) -> bool:
        lowered = word.lower()
        if lowered.startswith(("kv_", "test_kv", "test_adoption")):
            return any(lowered in name for name in ADOPTION_TESTS)
        return other

    return bool(expression.evaluate(match))
