"""A clause failure reads as its verdict (session/failure_repr.py); --tb=long as pytest's."""

from __future__ import annotations

import pytest

from tests.conftest import needs_omni
from tests.seeding import register_backends
from tests.suite.test_generate import seeded_rows  # noqa: F401  (the fixture, used by name)


@needs_omni
@pytest.mark.usefixtures("seeded_rows")
@pytest.mark.parametrize("tb", [None, "long"], ids=["default", "tb_long"])
def test_a_clause_failure_reads_as_its_verdict_unless_a_traceback_is_asked_for(
        kv_run, tb: str | None) -> None:
    result = kv_run("--kv-backend", "TORCH_SDPA", "--kv-device", "cpu", "-k", "kv_n6",
                    "-rf", *(["--tb", tb] if tb else []))
    result.assert_outcomes(passed=7, failed=1)
    verdict = "KV-N6 violated ?case=padded?: padded pages are not planned"
    summary = "FAILED kvconform/test_nullblock.py::test_kv_n6?padded? - *"
    if tb is None:
        result.stdout.fnmatch_lines([
            "_*_ test_kv_n6?padded? _*_", verdict, "  expected: 15", "  actual:   16",
            "*test_generate.py:*: in check_kv_n6 (--tb=long shows the traceback)",
            summary])
        result.stdout.no_fnmatch_line("*run_check(*")
    else:
        result.stdout.fnmatch_lines(["*run_check(*", f"E * {verdict}", summary])
        result.stdout.no_fnmatch_line("*--tb=long shows the traceback*")


ESCAPES = "\x1b[2J\x1b]0;pwned\x07"  # clear the screen, set the title


class EscapingDeclaration:
    """A backend whose declaration raises a message that would rewrite the terminal."""

    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        print(f"printed {ESCAPES}")
        raise RuntimeError(f"raised {ESCAPES}")


@pytest.mark.parametrize("tb", [None, "long"], ids=["default", "tb_long"])
def test_what_a_backend_raises_prints_or_fails_with_reaches_the_terminal_inert(
        pytester: pytest.Pytester, kv_run, tb: str | None) -> None:
    """A failure, its captured output and a skip's reason (an import error) quote the
    backend: escape sequences show as text, and none reaches the terminal or the report's
    files."""
    register_backends(pytester, {"ESC": EscapingDeclaration,
                                 "ESC_IMPORT": f"no_such_module_kvc{ESCAPES}:X"})
    result = kv_run("-k", "test_kv_l1 and not name", "--kv-backend", "ESC", "--kv-backend",
                    "ESC_IMPORT", "-rA", "--kv-report", "r.json",
                    *(["--tb", tb] if tb else []))
    result.assert_outcomes(failed=1, skipped=1)
    out = result.stdout.str() + result.stderr.str()
    assert "\x1b" not in out and "\x07" not in out
    assert "raised \\x1b[2J\\x1b]0;pwned\\x07" in out
    assert "printed \\x1b[2J" in out  # the captured output section
    assert "no_such_module_kvc\\x1b[2J" in out  # the skip's reason
    for written in ("r.json", "r.md"):
        assert "\x1b" not in (pytester.path / written).read_text(encoding="utf-8"), written
