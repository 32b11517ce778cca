"""Whom a result speaks for: a backend-scoped run's verdict and exit status are its backends'.

A backend repository runs ``pytest --kv-conformance --kv-backend NAME``.  Its verdict is
judged on the backend's own results (KV-L1..L7, KV-A1..A3, A5, A6 on its class); the
serving stack's (seam controls, KV-S, KV-N, and its guards KV-L8 / KV-A4 on the backend)
are reported apart: the shipped known findings listed, anything else the stack's regression
(exit 6).  A backend whose declaration (KV-L1) fails has that named first, with what
depends on it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from pytest_kvconform.faults import plants
from pytest_kvconform.report.verdict import EXIT_STACK_REGRESSED
from tests.backend_repo_files import SDPA_BACKENDS
from tests.conftest import needs_omni
from tests.seeding import Seeder, literal

pytestmark = needs_omni

CONFTEST = '''
def pytest_kvconform_backends(config):
    return {"MY_HOOK_ATTN": "my_backends:HookBackend", "MY_SLIP": "my_backends:SlipBackend"}
'''
STRIDES = "(kv_s1 and bf16_h8 and BLNHC)"


@pytest.fixture
def repo(pytester: pytest.Pytester) -> pytest.Pytester:
    """A pytester directory registering a conforming backend and a slipped one."""
    pytester.makepyfile(my_backends=SDPA_BACKENDS)
    pytester.makeconftest(CONFTEST)
    pytester.syspathinsert()
    return pytester


def _report(pytester: pytest.Pytester) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((pytester.path / "r.json").read_text())
    return data


def test_the_shipped_findings_apply_without_naming_a_file(repo: pytest.Pytester,
                                                          kv_run: Any) -> None:
    """--kv-xfails auto: the stack's known finding on the backend is an xfail, listed under
    the stack and as biting the backend; the backend's own results decide the exit."""
    result = kv_run("--kv-backend", "MY_HOOK_ATTN", "-k", "kv_l1 or kv_l2 or kv_l8_alias",
                    "--kv-xfails", "auto", "--kv-report", "r.json")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-3000:]
    result.assert_outcomes(passed=3, xfailed=1)
    result.stdout.fnmatch_lines([
        # the registry's backends are listed, not imported (a broken one cannot touch this)
        "kvconform: 1 backends (1 importable) discovered in *s: MY_HOOK_ATTN; * left out by "
        "--kv-backend (not imported): *FLASH_ATTN*MY_SLIP*",
        "kvconform: known findings: pytest_kvconform/known/vllm_0_30.toml, "
        "pytest_kvconform/known/vllm_omni_0_30.toml (shipped; vllm_0_30.toml known on vllm "
        ">=0.29,<0.34; vllm_omni_0_30.toml known on vllm >=0.30,<0.33 and vllm-omni >=0.30,"
        "<0.33: the installed vllm 0.30.0, vllm-omni 0.30.0)",
        "kvconform: verdict for MY_HOOK_ATTN: partial (left out: -k *",
        "kvconform: stack (vllm 0.30.0, vllm-omni 0.30.0): 1 known finding persists (1 result), "
        "0 fixed, 0 new",
        "kvconform: MY_HOOK_ATTN is bitten in production by the stack's findings: KV-L8 "
        "test_kv_l8_alias (known: vllm_omni_0_30.toml:1 */KV-L8/test_kv_l8_alias)"])
    data = _report(repo)
    subjects = {r["nodeid"].rpartition("::")[2]: r["subject"] for r in data["results"]}
    assert subjects == {"test_kv_l1[MY_HOOK_ATTN]": "backend",
                        "test_kv_l1_name[MY_HOOK_ATTN]": "backend",
                        "test_kv_l2[MY_HOOK_ATTN]": "backend",
                        "test_kv_l8_alias[MY_HOOK_ATTN]": "stack"}
    assert data["stack"]["known"] == ["kvconform/test_layout.py::test_kv_l8_alias[MY_HOOK_ATTN]"]
    assert data["environment"]["options"]["xfails"].endswith("known/vllm_omni_0_30.toml")


def test_none_switches_the_shipped_findings_off(repo: pytest.Pytester, kv_run: Any) -> None:
    result = kv_run("--kv-backend", "MY_HOOK_ATTN", "-k", "kv_l1 or kv_l8_alias",
                    "--kv-xfails", "none")
    result.stdout.fnmatch_lines(["kvconform: known findings: none (--kv-xfails none)"])
    result.assert_outcomes(passed=2, failed=1)
    # The stack's failure, not the backend's.
    assert result.ret == EXIT_STACK_REGRESSED, result.stdout.str()[-3000:]


def test_a_scoped_run_without_the_backends_results_says_so(repo: pytest.Pytester,
                                                            kv_run: Any) -> None:
    result = kv_run("--kv-backend", "MY_HOOK_ATTN", "-k", STRIDES)
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.OK  # nothing failed; strict refuses a partial run
    result.stdout.fnmatch_lines(["kvconform: verdict for MY_HOOK_ATTN: partial (no result of "
                                 "MY_HOOK_ATTN's own ran; left out: *"])


@pytest.mark.parametrize("seeded", [False, True], ids=["clean", "hand_strides"])
def test_a_stack_regression_is_the_stacks(repo: pytest.Pytester, kv_run: Any, seed: Seeder,
                                          seeded: bool) -> None:
    """A stride derivation the stack gets wrong, which no shipped finding describes: the
    stack's regression (exit 6), never the backend's failure."""
    if seeded:
        seed.plant(plants.HAND_STRIDES)
    result = kv_run("--kv-backend", "MY_HOOK_ATTN", "-k", f"kv_l1 or {STRIDES}",
                    "--kv-xfails", "auto", "--kv-report", "r.json")
    data = _report(repo)
    assert data["verdict"] == "partial"  # -k: the backend's results all passed
    if not seeded:
        assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-3000:]
        assert data["stack"]["regressions"] == []
        return
    assert result.ret == EXIT_STACK_REGRESSED, result.stdout.str()[-3000:]
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines([
        "kvconform: verdict for MY_HOOK_ATTN: partial (left out: -k *",
        literal("kvconform: stack (vllm 0.30.0, vllm-omni 0.30.0): 0 known findings persist "
                "(0 results), 0 fixed, 1 new (no known finding describes them): KV-S1 "
                "test_kv_s1[BLNHC-bf16_h8]")])
    assert data["stack"]["regressions"] == [
        "kvconform/test_strides.py::test_kv_s1[BLNHC-bf16_h8]"]


def test_a_failed_declaration_is_the_root_cause(repo: pytest.Pytester, kv_run: Any) -> None:
    """KV-L1 fails for the slipped backend; its other failures, the stack's guards on it
    included, are reported as depending on it, KV-L1 first, and the stack is not blamed."""
    result = kv_run("--kv-backend", "MY_SLIP", "-k", "kv_l1 or kv_l2 or kv_l5 or kv_l8_alias",
                    "--kv-xfails", "auto", "--kv-report", "r.json")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()[-3000:]
    data = _report(repo)
    failed = [r for r in data["results"] if r["status"] == "failed"]
    assert {r["clause"] for r in failed} == {"KV-L1", "KV-L2", "KV-L5", "KV-L8"}, failed
    assert {r["nodeid"].rpartition("::")[2]: r["depends_on"] for r in failed} == {
        "test_kv_l1[MY_SLIP]": None, "test_kv_l2[MY_SLIP]": "KV-L1",
        "test_kv_l5_unresolved[MY_SLIP]": "KV-L1", "test_kv_l5_consistent[MY_SLIP]": "KV-L1",
        "test_kv_l5_contradiction[MY_SLIP]": "KV-L1", "test_kv_l8_alias[MY_SLIP]": "KV-L1"}
    assert data["verdict"] == "not qualified"
    assert data["stack"]["regressions"] == []
    result.stdout.fnmatch_lines([
        "*- kvconform: root cause -*",
        "depends on KV-L1, which failed for MY_SLIP: its other results use the declaration, so "
        "fix that first",
        literal("FAILED kvconform/test_layout.py::test_kv_l2[MY_SLIP] - depends on KV-L1") + "*"])
    assert "depends_on" not in result.stdout.str()
    result.stdout.fnmatch_lines([literal(
        "kvconform: verdict for MY_SLIP: not qualified (MY_SLIP: KV-L1 failed (root cause): "
        "KV-L1 test_kv_l1[MY_SLIP]; 5 results depend on it: KV-L2 test_kv_l2[MY_SLIP], KV-L5 "
        "test_kv_l5_unresolved[MY_SLIP], ") + "*"])


HANGING = '''
import time

from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend


class HangingBackend(SDPABackend):
    supports_paged_kv = True

    @classmethod
    def get_name(cls):
        return "HANGING"

    @classmethod
    def indexes_kv_by_block_stride(cls):
        time.sleep(600)
        return False
'''


def test_a_fault_of_the_backends_own_code_counts_for_it_not_the_stack(
        pytester: pytest.Pytester, kv_run: Any) -> None:
    """The stack's guards run on a backend whose declaration hangs: their timeouts are the
    backend's (caused_by, subject backend), never the stack's regression; the one budget
    is paid once."""
    pytester.makepyfile(hanging_backends=HANGING)
    pytester.makeconftest('def pytest_kvconform_backends(config):\n'
                          '    return {"HANGING": "hanging_backends:HangingBackend"}\n')
    pytester.syspathinsert()
    result = kv_run("--kv-backend", "HANGING", "-k", "kv_l1 or kv_l8_canonical",
                    "--kv-timeout", "2", "--kv-report", "r.json")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()[-3000:]
    data = _report(pytester)
    rows = {r["nodeid"].rpartition("::")[2]: r for r in data["results"]}
    call = "HANGING.indexes_kv_by_block_stride() (the backend's layout declaration)"
    for test in ("test_kv_l1[HANGING]", "test_kv_l8_canonical_honoured[HANGING]",
                 "test_kv_l8_canonical_refused[HANGING]"):
        row = rows[test]
        assert (row["status"], row["error_kind"], row["subject"], row["caused_by"]) == \
            ("error", "timeout", "backend", call), row
    guard = rows["test_kv_l8_canonical_honoured[HANGING]"]["reason"]
    assert guard.startswith(f"caused by HANGING's own code ({call}): it counts for the backend, "
                            "not the stack: "), guard
    assert data["stack"]["regressions"] == []
    text = result.stdout.str()
    assert "regression" not in text and "harness error" not in text, text[-3000:]
    own = f"3 errors the backend's own code caused (timeout in HANGING: {call})"
    result.stdout.fnmatch_lines([f"kvconform: {own}: they count for the backend, never for "
                                 "the stack",
                                 f"kvconform: verdict for HANGING: not qualified (*{own}*"])
