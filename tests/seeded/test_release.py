"""The release run against regressions seeded in the installed code: never read as a fix.

Each test deletes one of production's safety checks from the installed vllm-omni / vLLM
(``tests/installed_regressions.py``: every process of the run imports it rewritten, the
KV-A workers included), runs the release qualification (``--kv-strict`` with the shipped
known findings) in a subprocess, restricted with ``-k`` / ``--kv-backend``, and reads the
verdict: ``not qualified``, naming the clause and the control that failed, and never a
known finding as fixed.  (A restricted run is ``partial`` at best; a failure makes it
``not qualified`` whatever was left out, and the line still says what was.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import KV_ARGS, needs_omni
from tests.installed_regressions import overlay

pytestmark = needs_omni

KNOWN = str(resources.files("pytest_kvconform.known") / "vllm_omni_0_30.toml")
FIXED = "xpassed (a known finding no longer fails"
# The release run is a whole deployment's (its verdict covers the stack); these select
# FLASH_ATTN's row and the seam's with -k, not --kv-backend, which would scope the verdict.
WHO = "((FLASH_ATTN and not HUB) or need_)"


def release_run(tmp_path: Path, regression: str, *selection: str) -> tuple[str, dict[str, Any]]:
    """The strict release run under ``regression`` (a subprocess: this process imports no
    serving stack for it): its verdict line and its report."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("KVCONFORM_WORKER_FAULT", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = overlay(tmp_path / "overlay", regression)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *KV_ARGS, "--kv-strict", "-rA", "--kv-xfails", KNOWN,
         "--kv-report", "r.json", *selection], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=900, check=False)
    out = proc.stdout
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, out[-4000:] + proc.stderr[-2000:]
    (line,) = re.findall(r"^kvconform: verdict: (.*)$", out, re.MULTILINE)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["verdict"] == "not qualified"
    assert line.startswith("not qualified (")
    assert FIXED not in line and "XPASS" not in line, line
    return line, report


def statuses(report: dict[str, Any]) -> dict[str, str]:
    return {r["nodeid"].rpartition("::")[2]: r["status"] for r in report["results"]}


def test_adoption_without_the_disagreement_check(tmp_path: Path) -> None:
    """The worker alias "passes" only because every disagreement is now accepted: its
    control fails, so no fix is claimed; KV-A4's disagreement control fails on its own
    beside the known contradiction."""
    line, report = release_run(tmp_path, "no_disagreement_check",
                               "-k", f"((kv_a4 and bf16_h8) or kv_l8_worker) and {WHO}")
    assert statuses(report) == {
        "test_kv_a4_unadopted[FLASH_ATTN-bf16_h8]": "passed",
        "test_kv_a4_unadopted_seam[need_False-bf16_h8]": "passed",
        "test_kv_a4_unadopted_seam[need_True-bf16_h8]": "passed",
        "test_kv_a4_disagreement[FLASH_ATTN-bf16_h8]": "failed",
        "test_kv_a4_disagreement_seam[need_False-bf16_h8]": "failed",
        "test_kv_a4_disagreement_seam[need_True-bf16_h8]": "failed",
        "test_kv_a4_contradiction[FLASH_ATTN-bf16_h8]": "xfailed",
        "test_kv_a4_contradiction_seam[need_False-bf16_h8]": "xfailed",
        "test_kv_a4_contradiction_seam[need_True-bf16_h8]": "xfailed",
        "test_kv_l8_worker_disagreement[FLASH_ATTN]": "failed",
        "test_kv_l8_worker_alias[FLASH_ATTN]": "xpassed",
    }
    assert line.startswith(
        "not qualified (failed: KV-L8 test_kv_l8_worker_disagreement[FLASH_ATTN], KV-A4 "
        "test_kv_a4_disagreement[FLASH_ATTN-bf16_h8], KV-A4 "
        "test_kv_a4_disagreement_seam[need_False-bf16_h8, need_True-bf16_h8]; passes, but no "
        "fix of its known finding: "
        "KV-L8 test_kv_l8_worker_alias[FLASH_ATTN] (its control "
        "test_kv_l8_worker_disagreement[FLASH_ATTN] failed); left out: "), line
    reasons = {r["nodeid"].rpartition("::")[2]: r["reason"] for r in report["results"]}
    assert "without the disagreement error" in \
        reasons["test_kv_a4_disagreement[FLASH_ATTN-bf16_h8]"]
    assert "must refuse the control plane's 'LBHNC'" in \
        reasons["test_kv_l8_worker_disagreement[FLASH_ATTN]"]


def test_a_worker_path_without_the_unresolved_layout_check(tmp_path: Path) -> None:
    """init_kv_cache allocating a default layout nobody resolved: the unadopted control
    fails on its own, whatever the contradiction control's known finding does."""
    line, report = release_run(tmp_path, "no_unresolved_check",
                               "-k", f"kv_a4 and bf16_h8 and {WHO}")
    got = statuses(report)
    assert {t: s for t, s in got.items() if "unadopted" in t} == {
        "test_kv_a4_unadopted[FLASH_ATTN-bf16_h8]": "failed",
        "test_kv_a4_unadopted_seam[need_False-bf16_h8]": "failed",
        "test_kv_a4_unadopted_seam[need_True-bf16_h8]": "failed"}
    assert {s for t, s in got.items() if "disagreement" in t} == {"passed"}
    assert {s for t, s in got.items() if "contradiction" in t} == {"xfailed"}
    assert line.startswith(
        "not qualified (failed: KV-A4 test_kv_a4_unadopted[FLASH_ATTN-bf16_h8], KV-A4 "
        "test_kv_a4_unadopted_seam[need_False-bf16_h8, need_True-bf16_h8]; left out: "), line
    assert all("with adoption skipped" in r["reason"] for r in report["results"]
               if r["status"] == "failed")


def test_resolution_without_the_contradiction_check(tmp_path: Path) -> None:
    """A contradicting pinned layout accepted: the refusal controls of KV-L4, KV-L5 and
    KV-L8 fail, their neighbours pass, the known KV-L8 findings stay absorbed as they
    describe themselves, and no finding reads as fixed.  (KV-A4's contradiction control
    fails as its known finding says either way: the tests above show it absorbed.)"""
    line, report = release_run(tmp_path, "no_contradiction_check",
                               "-k", f"(kv_l4 or kv_l5 or kv_l8) and {WHO}")
    got = statuses(report)
    failed = sorted(t for t, s in got.items() if s == "failed")
    assert failed == ["test_kv_l4[FLASH_ATTN]", "test_kv_l5_contradiction[FLASH_ATTN]",
                      "test_kv_l8_canonical_refused[FLASH_ATTN]"], got
    assert {t for t, s in got.items() if s == "xfailed"} == {
        "test_kv_l8_alias[FLASH_ATTN]", "test_kv_l8_worker_alias[FLASH_ATTN]",
        "test_kv_l8_env_honoured[FLASH_ATTN]", "test_kv_l8_env_refused[FLASH_ATTN]"}
    assert got["test_kv_l5_unresolved[FLASH_ATTN]"] == got["test_kv_l5_consistent[FLASH_ATTN]"] \
        == got["test_kv_l8_canonical_honoured[FLASH_ATTN]"] == "passed"
    assert line.startswith(
        "not qualified (failed: KV-L4 test_kv_l4[FLASH_ATTN], KV-L5 "
        "test_kv_l5_contradiction[FLASH_ATTN], KV-L8 test_kv_l8_canonical_refused[FLASH_ATTN]; "
        "left out: "), line


def test_the_regressions_are_seeded_only_with_the_overlay(tmp_path: Path) -> None:
    """The overlay names a known regression, and seeds nothing in this process."""
    from tests import installed_regressions

    with pytest.raises(KeyError):
        overlay(tmp_path, "no_such_regression")
    path = overlay(tmp_path / "o", "no_contradiction_check")
    assert path.split(":")[0] == str(tmp_path / "o")
    assert not any(isinstance(f, installed_regressions._Finder) for f in sys.meta_path)
