"""Before collection: may this run select a KV-A test that needs worker processes?

Used only to start the KV-A workers early, so a wrong "yes" costs one
dropped worker and a wrong "no" costs only the overlap; nothing is decided by it.
"""

from __future__ import annotations

from typing import Any

from pytest_kvconform.contract import clauses

# The suite tests that use ``kv_workers`` (KV-A1..A6 and KV-L6 today), and their modules:
# the clause table's checks that take worker processes.
_WORKER_CHECKS = [(row, check) for row, check in clauses.check_names().values()
                  if check.needs_workers]
ADOPTION_TESTS: tuple[str, ...] = (
    *dict.fromkeys(row.test_name(check) for row, check in _WORKER_CHECKS),
    *dict.fromkeys(name for row, _ in _WORKER_CHECKS
                   for name in (f"{row.suite_module}.py", row.suite_module)))


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
