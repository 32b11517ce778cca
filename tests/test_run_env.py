"""The environment defaults a run sets (run_env.py): only where unset, undone afterwards."""

from __future__ import annotations

import gc
import os

import pytest

from pytest_kvconform import run_env
from tests.conftest import needs_omni

HUMMING = "HUMMING_DISABLE_PARALLEL_BUILD"

# Records what the run's own tests see; the suite's tests are deselected (-k).
SEE_ENV = f'''
import gc
import os
from pathlib import Path


def test_sees_env():
    Path("seen.txt").write_text(os.environ.get("{HUMMING}", "<unset>"))
    Path("frozen.txt").write_text(str(gc.get_freeze_count()))
'''


def test_apply_sets_only_what_is_unset_and_restore_undoes_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVCONFORM_A", raising=False)
    monkeypatch.setenv("KVCONFORM_B", "mine")
    added = run_env.apply({"KVCONFORM_A": "1", "KVCONFORM_B": "2"})
    assert added == ["KVCONFORM_A"]
    assert os.environ["KVCONFORM_A"] == "1" and os.environ["KVCONFORM_B"] == "mine"
    run_env.restore(added)
    assert "KVCONFORM_A" not in os.environ and os.environ["KVCONFORM_B"] == "mine"


def test_header_line_names_what_was_set() -> None:
    assert run_env.header_line([]) is None
    assert run_env.header_line([HUMMING]) == \
        f"kvconform: environment set for this run: {HUMMING}=1"


@needs_omni
@pytest.mark.parametrize("user_value", [None, "0"], ids=["unset", "user_set"])
def test_a_run_turns_humming_builds_off_unless_the_user_chose(
        pytester: pytest.Pytester, kv_run, monkeypatch: pytest.MonkeyPatch,
        user_value: str | None) -> None:
    if user_value is None:
        monkeypatch.delenv(HUMMING, raising=False)
    else:
        monkeypatch.setenv(HUMMING, user_value)
    pytester.makepyfile(test_env=SEE_ENV)
    result = kv_run("-k", "test_sees_env", "--kv-backend", "TORCH_SDPA", "test_env.py")
    result.assert_outcomes(passed=1)
    assert (pytester.path / "seen.txt").read_text() == (user_value or "1")
    header = f"kvconform: environment set for this run: *{HUMMING}=1*"
    if user_value is None:
        result.stdout.fnmatch_lines([header])
    else:
        result.stdout.no_fnmatch_line(header)
    assert os.environ.get(HUMMING) == user_value  # restored after the run
    # the tests ran with the imports' objects frozen, and the run thawed them at its end
    assert int((pytester.path / "frozen.txt").read_text()) > 100_000
    assert gc.get_freeze_count() == 0



def test_freeze_and_thaw_the_heap() -> None:
    try:
        assert run_env.freeze_heap() == gc.get_freeze_count() > 0
    finally:
        run_env.thaw_heap()
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("user_level", [None, "INFO"], ids=["unset", "user_set"])
def test_applied_quiets_a_vllm_imported_before_it(
        monkeypatch: pytest.MonkeyPatch, user_level: str | None) -> None:
    """vLLM reads VLLM_LOGGING_LEVEL at import only: a vLLM already loaded gets the level."""
    import logging
    import sys
    import types

    if user_level is None:
        monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    else:
        monkeypatch.setenv("VLLM_LOGGING_LEVEL", user_level)
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)
    monkeypatch.setitem(sys.modules, "vllm.logger", sys.modules.get("vllm.logger")
                        or types.ModuleType("vllm.logger"))
    vllm_logger = logging.getLogger("vllm")
    config_logger = logging.getLogger("vllm.config.kvconform_test")
    level = vllm_logger.level
    vllm_logger.setLevel(logging.INFO)  # as vLLM configured it, imported with nothing set
    try:
        with run_env.applied():
            assert config_logger.isEnabledFor(logging.INFO) is (user_level == "INFO")
            assert config_logger.isEnabledFor(logging.WARNING)
        assert vllm_logger.level == logging.INFO and config_logger.isEnabledFor(logging.INFO)
    finally:
        vllm_logger.setLevel(level)
