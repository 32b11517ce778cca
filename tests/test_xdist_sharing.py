"""Under xdist the controller imports none of the serving stack: its workers discover
(issue 12).  Subprocess runs: the controller must be a fresh process."""

from __future__ import annotations

import pytest

from tests.conftest import needs_omni

ARGS = ("--kv-conformance", "-p", "no:cacheprovider", "-p", "no:randomly", "-n", "2",
        "--kv-backend", "TORCH_SDPA")


@needs_omni
def test_a_usage_error_found_by_xdist_workers_is_one_usage_error(
        pytester: pytest.Pytester) -> None:
    """Raised in a worker it would crash it, and xdist would restart it (an import each)."""
    result = pytester.runpytest_subprocess(*ARGS, "--kv-backend", "NO_SUCH_ATTN", timeout=600)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    out = result.stdout.str()
    assert out.count("ERROR: --kv-backend: unknown backend NO_SUCH_ATTN; available backends: "
                     ) == 1, out[-3000:]
    assert "crashed" not in out and "replacing" not in out, out[-3000:]
