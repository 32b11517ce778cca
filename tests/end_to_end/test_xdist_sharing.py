"""Under xdist the serving stack is imported once per xdist worker plus once for the
CPU KV-A workers' fork server, which all xdist workers share; the controller imports
none of it.  Subprocess runs: the controller must be a fresh process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import needs_omni
from tests.seeding import register_backends
from tests.standin_backends import Good

# Each process says what it imported and which fork server it forks from, while the
# session still holds the server (pytest_unconfigure releases it).
RECORD = '''
import json
import os
import sys
from pathlib import Path

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    from pytest_kvconform.workers import forkserver

    who = os.environ.get("PYTEST_XDIST_WORKER", "controller")
    Path(f"proc-{who}.json").write_text(json.dumps({
        "heavy": sorted(m for m in ("torch", "vllm", "vllm_omni") if m in sys.modules),
        "server": forkserver.pid(), "attached": forkserver.attached()}))
'''
ARGS = ("--kv-conformance", "-p", "no:cacheprovider", "-p", "no:randomly", "-n", "2",
        "--kv-backend", "FLASH_ATTN")


def _seen(pytester: pytest.Pytester, who: str) -> dict[str, object]:
    return json.loads(Path(pytester.path, f"proc-{who}.json").read_text())


@needs_omni
def test_xdist_workers_share_one_fork_server_and_the_controller_imports_nothing(
        pytester: pytest.Pytester) -> None:
    pytester.makeconftest(RECORD)
    result = pytester.runpytest_subprocess(*ARGS, "-k", "test_kv_a2 and bf16_h8", "-rs",
                                           timeout=600)
    result.assert_outcomes(passed=3)  # KV-A2 (+ 2 stand-ins): the OS parent is the shared server
    controller = _seen(pytester, "controller")
    assert controller["heavy"] == [] and controller["attached"] is False
    assert controller["server"] is not None
    for worker in ("gw0", "gw1"):
        assert _seen(pytester, worker) == {"heavy": ["torch", "vllm", "vllm_omni"],
                                           "server": controller["server"], "attached": True}
    # discovery happened in the workers; the controller reports theirs
    result.stdout.fnmatch_lines(["kvconform: backends: discovered by each xdist worker*",
                                 "kvconform: 1 backends (1 importable) discovered by the "
                                 "xdist workers in *s: FLASH_ATTN; * left out by "
                                 "--kv-backend (not imported): *"])


@needs_omni
def test_a_usage_error_found_by_xdist_workers_is_one_usage_error(
        pytester: pytest.Pytester) -> None:
    """Raised in a worker it would crash it, and xdist would restart it (an import each).

    A conftest hook leaves the name to discovery (it names its backends only when called):
    a name no source has is otherwise refused at start-up, before any worker starts."""
    register_backends(pytester, {"GOOD": Good})
    result = pytester.runpytest_subprocess(*ARGS, "--kv-backend", "NO_SUCH_ATTN", timeout=600)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    out = result.stdout.str()
    assert out.count("ERROR: --kv-backend: unknown backend 'NO_SUCH_ATTN'; available backends: "
                     ) == 1, out[-3000:]
    assert "crashed" not in out and "replacing" not in out, out[-3000:]
