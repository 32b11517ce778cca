"""The judge's integrity: what of the suite's own code changed after its fingerprint."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from pytest_kvconform import api
from pytest_kvconform.checks import layout
from pytest_kvconform.session import integrity
from pytest_kvconform.suite import check_call

HACK = "tests.session.judge_hack"


def test_an_untouched_judge_has_no_changes() -> None:
    fingerprint = integrity.take(integrity.WITHOUT_PYTEST)
    assert "pytest_kvconform.checks.layout" in fingerprint.modules
    assert "pytest_kvconform.report.verdict" in fingerprint.modules
    assert fingerprint.changes() == []


def test_each_way_of_replacing_the_judge_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    fingerprint = integrity.take()
    monkeypatch.setattr(check_call, "run_check", lambda *args, **kwargs: None)
    monkeypatch.setattr(layout.check_kv_l2, "__code__", (lambda backend: None).__code__)
    monkeypatch.setattr(layout.Where, "fail", lambda self, *args, **kwargs: None)
    monkeypatch.delattr(layout, "check_kv_l3")
    monkeypatch.setitem(sys.modules, "pytest_kvconform.contract.oracle", type(sys)("fake"))
    here = "tests.session.test_integrity.test_each_way_of_replacing_the_judge_is_named"
    assert set(fingerprint.changes()) == {
        "module pytest_kvconform.contract.oracle replaced in sys.modules",
        f"pytest_kvconform.checks.layout.check_kv_l2 has other code "
        f"({layout.check_kv_l2.__code__!r})",
        "pytest_kvconform.checks.layout.check_kv_l3 removed",
        f"pytest_kvconform.suite.check_call.run_check replaced by {here}.<locals>.<lambda>",
        f"pytest_kvconform.checks.common.Where.fail replaced by {here}.<locals>.<lambda>",
    }


@pytest.fixture
def judge_hack() -> Iterator[None]:
    """Undoes what importing :data:`HACK` does to the judge."""
    originals = check_call.run_check, layout.check_kv_l1
    yield
    check_call.run_check, layout.check_kv_l1 = originals
    sys.modules.pop(HACK, None)


@pytest.mark.usefixtures("judge_hack")
def test_check_backend_refuses_to_qualify_a_backend_whose_import_rewrites_the_judge() -> None:
    results = api.check_backend(f"{HACK}:Backend", clauses=["KV-L1"], device="cpu")
    assert [r.status for r in results] == ["passed", "passed"]  # what the backend arranged
    assert results.altered == [
        f"pytest_kvconform.checks.layout.check_kv_l1 replaced by {HACK}.lenient_check",
        f"pytest_kvconform.suite.check_call.run_check replaced by {HACK}.lenient"]
    assert not results.qualified
