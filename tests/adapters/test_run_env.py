"""The environment defaults a run sets (run_env.py): only where unset, undone afterwards."""

from __future__ import annotations

import gc
import os

import pytest

from pytest_kvconform.adapters import run_env
from tests.conftest import needs_omni
from tests.paths import ROOT

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


# --- what the serving stack's imports print ----------------------------------------------

STACK_OUTPUT = (
    "\x1b[33mWARNING 12-04 02:46:02 [sage_attn.py:46] SageAttentionBackend is not available."
    "\x1b[0m\n"
    "[ERROR] `past_key_values` is part of X.forward's signature, but not documented.\n"
    "\n"
    "/site/mod.py:3: FutureWarning: old\n"
    "  warnings.warn('old')\n"
    "Traceback (most recent call last):\n"
    "  File \"/site/x.py\", line 1, in <module>\n"
    "ValueError: boom\n"
    "plain line\n"
)


def test_import_messages_split_output_into_messages_with_their_level() -> None:
    assert run_env.import_messages(STACK_OUTPUT) == [
        {"level": "WARNING",
         "text": "WARNING [sage_attn.py:46] SageAttentionBackend is not available."},
        {"level": "ERROR",
         "text": "[ERROR] `past_key_values` is part of X.forward's signature, but not "
                 "documented."},
        {"level": "WARNING", "text": "/site/mod.py:3: FutureWarning: old\n"
                                     "  warnings.warn('old')"},
        {"level": "ERROR", "text": "Traceback (most recent call last):\n"
                                   "  File \"/site/x.py\", line 1, in <module>\n"
                                   "ValueError: boom"},
        {"level": None, "text": "plain line"},
    ]


def test_torchs_prefix_loses_its_time_and_process_id() -> None:
    """The registry's torch warns at import (glog's prefix): the same run, the same report."""
    line = ("W1204 18:44:30.847000 13557 torch/utils/cpp_extension.py:178] No CUDA runtime is "
            "found, using CUDA_HOME='/usr/local'\n")
    assert run_env.import_messages(line) == [
        {"level": "WARNING", "text": "WARNING [torch/utils/cpp_extension.py:178] No CUDA "
                                     "runtime is found, using CUDA_HOME='/usr/local'"}]


def test_vllms_worker_process_prefix_loses_its_process_id() -> None:
    """vLLM prefixes each line of a worker process it starts: the message keeps the name, its
    level is read after it, and a traceback's lines stay one message."""
    text = ("(DiffusionWorker pid=24445) WARNING 12-07 04:25:49 [gpu_memory_utils.py:88] NVML "
            "init failed\n"
            "(DiffusionWorker_DP0 pid=7) Traceback (most recent call last):\n"
            "(DiffusionWorker_DP0 pid=7)   File \"x.py\", line 1, in <module>\n"
            "(DiffusionWorker_DP0 pid=7) ValueError: boom\n")
    assert run_env.import_messages(text) == [
        {"level": "WARNING",
         "text": "(DiffusionWorker) WARNING [gpu_memory_utils.py:88] NVML init failed"},
        {"level": "ERROR", "text": "(DiffusionWorker_DP0) Traceback (most recent call last):\n"
                                   "  File \"x.py\", line 1, in <module>\nValueError: boom"}]


def test_printed_lines_name_who_printed_and_each_messages_source() -> None:
    messages = [{"level": "WARNING", "text": "WARNING [cpu.py:293] Reset SSM cache type",
                 "source": "KV-A worker cpu-0"}, {"level": None, "text": "plain\n  more"}]
    (line,) = run_env.printed_lines(messages, "production's KV-A workers printed", "worker_log",
                                    verbose=False, report=True)
    assert line == ("kvconform: production's KV-A workers printed 2 messages (1 WARNING, "
                    "1 other): the installed stack's own, not findings of this run; -v shows "
                    "them, the report keeps them (environment.worker_log)")
    verbose = run_env.printed_lines(messages, "they printed", "worker_log", verbose=True,
                                    report=False)
    assert verbose[1:] == [
        "kvconform:   | [KV-A worker cpu-0] WARNING [cpu.py:293] Reset SSM cache type",
        "kvconform:   | plain", "kvconform:   |   more"]


def test_import_log_lines_summarise_and_verbose_shows_each_message() -> None:
    messages = run_env.import_messages(STACK_OUTPUT)
    assert run_env.import_log_lines([], verbose=True, report=True) == []
    (line,) = run_env.import_log_lines(messages, verbose=False, report=True)
    assert line == ("kvconform: importing vLLM / vllm-omni printed 5 messages (2 ERROR, "
                    "2 WARNING, 1 other): the installed stack's own, not findings of this run; "
                    "-v shows them, the report keeps them (environment.import_log)")
    (short,) = run_env.import_log_lines(messages[:1], verbose=False, report=False)
    assert short.endswith("printed 1 message (1 WARNING): the installed stack's own, not "
                          "findings of this run; -v shows them")
    verbose = run_env.import_log_lines(messages, verbose=True, report=False)
    assert "shown below" in verbose[0]
    assert verbose[1:] == [f"kvconform:   | {line}" for m in messages
                           for line in m["text"].splitlines()]


CAPTURE = r'''
import logging, os, sys
from pytest_kvconform.adapters import run_env

print("before", flush=True)
with run_env.captured_output() as found:
    print("python-level print")              # buffered: flushed into the capture
    os.write(2, b"C-level write\n")
    handler = logging.StreamHandler(sys.stdout)  # as vLLM's, created at its import
    log = logging.getLogger("kvconform_test")
    log.addHandler(handler)
    log.warning("WARNING logged inside")
log.warning("logged after")                   # the handler still reaches the terminal
# A buffered print reaches the capture when flushed, so the order is not the test's claim.
print("found", sorted(m["text"] for m in found), flush=True)
'''


FAILING_CAPTURE = r'''
from pytest_kvconform.adapters import run_env

try:
    with run_env.captured_output():
        print("why it failed")
        raise ValueError("boom")
except ValueError:
    print("raised", flush=True)
'''


def test_captured_output_of_a_block_that_raises_still_reaches_stderr() -> None:
    import subprocess
    import sys

    root = ROOT
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", FAILING_CAPTURE], env=env,
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "raised\n", "why it failed\n")


def test_captured_output_takes_what_the_block_prints_and_nothing_after() -> None:
    import subprocess
    import sys

    root = ROOT
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", CAPTURE], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "before", "logged after",
        "found ['C-level write', 'WARNING logged inside', 'python-level print']"], done.stdout
    assert done.stderr == ""


NOISY_BACKEND = '''
import logging
import os
import sys

print("[ERROR] kvconform-test: a noisy import")
os.write(2, b"kvconform-test: C-level noise\\n")
logging.getLogger("vllm.kvconform_test").warning("kvconform-test: a vLLM warning")


class NoisyBackend:
    pass
'''


@needs_omni
def test_the_stacks_import_output_stays_out_of_the_terminal_before_the_header(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a fresh process, as a user runs it: nothing before pytest's session header, one
    summary line in it (every message with -v), and every message in the report."""
    pytester.makepyfile(kvconform_noisy=NOISY_BACKEND)
    pytester.makeconftest("def pytest_kvconform_backends(config):\n"
                          "    return {'NOISY': 'kvconform_noisy:NoisyBackend'}\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(pytester.path), os.environ.get("PYTHONPATH")])))
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    result = pytester.runpytest_subprocess(
        "--kv-conformance", "-p", "no:cacheprovider", "-p", "no:randomly", "-p", "no:xdist",
        "--kv-backend", "TORCH_SDPA", "-k", "kv_l1", "--kv-report", "r.json", "-v",
        timeout=600)
    out = result.stdout.lines
    start = next(i for i, line in enumerate(out) if "test session starts" in line)
    assert out[:start] == [], out[:start]
    assert not result.stderr.str().strip(), result.stderr.str()[-2000:]
    summary = [line for line in out if "importing vLLM / vllm-omni printed" in line]
    assert len(summary) == 1 and "shown below" in summary[0], out[:30]
    for text in ("[ERROR] kvconform-test: a noisy import", "kvconform-test: C-level noise",
                 "kvconform-test: a vLLM warning"):
        assert f"kvconform:   | {text}" in out or any(
            line.startswith("kvconform:   | ") and line.endswith(text) for line in out), text
    import json

    report = json.loads((pytester.path / "r.json").read_text())
    texts = [m["text"] for m in report["environment"]["import_log"]]
    assert "[ERROR] kvconform-test: a noisy import" in texts
    assert "kvconform-test: C-level noise" in texts
    assert any(t.endswith("kvconform-test: a vLLM warning") for t in texts), texts


@pytest.mark.parametrize("before", [None, "theirs"], ids=["unset", "set"])
@pytest.mark.parametrize("value", [None, "ours"], ids=["unset_it", "set_it"])
def test_variable_set_holds_for_the_block_and_restores_what_was_there(
        monkeypatch: pytest.MonkeyPatch, before: str | None, value: str | None) -> None:
    name = "KVCONFORM_TEST_VARIABLE"
    if before is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, before)
    with pytest.raises(RuntimeError), run_env.variable_set(name, value):
        assert os.environ.get(name) == value
        raise RuntimeError("restored however the block ends")
    assert os.environ.get(name) == before
