"""check_backend: the clauses without pytest, as results; seeded faults show up in them."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pytest_kvconform
from pytest_kvconform import api
from pytest_kvconform.contract import clauses
from pytest_kvconform.contract.outcomes import ClauseSkip, ErrorKind, HarnessError, SkipKind
from pytest_kvconform.contract.records import BackendUnderTest, Case
from pytest_kvconform.workers import pool as workers
from tests.conftest import needs_omni
from tests.paths import ROOT
from tests.seeding import Seeder
from tests.standin_backends import Good, IntFlag

COLLECTED = ROOT / "tests" / "data" / "collected_ids.txt"


def test_the_package_exports_it_lazily() -> None:
    assert pytest_kvconform.check_backend is api.check_backend
    assert pytest_kvconform.CheckResult is api.CheckResult
    assert pytest_kvconform.CheckResults is api.CheckResults
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        pytest_kvconform.nope  # noqa: B018


def test_seeded_non_bool_declaration_fails_kv_l1_with_the_details() -> None:
    result, name = api.check_backend(IntFlag, clauses=["KV-L1"], device="cpu")
    assert (name.test, name.status) == ("test_kv_l1_name[IntFlag]", "passed")  # its own name
    assert (result.clause, result.status, result.backend) == ("KV-L1", "failed", "IntFlag")
    assert result.test == "test_kv_l1[IntFlag]"
    assert "KV-L1 violated [backend=IntFlag]" in result.message
    assert "expected: 'bool'" in result.message and "actual:   'int'" in result.message
    assert not result.ok


def test_a_clean_declaration_passes_kv_l1() -> None:
    result, name = api.check_backend(Good, clauses=["KV-L1"], device="cpu")
    assert (result.status, result.message, result.skip_kind) == ("passed", "", None)
    assert result.ok and name.ok


def test_an_unimportable_backend_is_a_backend_skip() -> None:
    results = api.check_backend("no_such_pkg.backends:Missing", clauses=["KV-L1", "KV-L7"],
                                device="cpu")
    assert [(r.clause, r.status, r.skip_kind) for r in results] == [
        ("KV-L1", "skipped", SkipKind.BACKEND), ("KV-L1", "skipped", SkipKind.BACKEND),
        ("KV-L7", "skipped", SkipKind.BACKEND)]
    assert "ModuleNotFoundError: No module named 'no_such_pkg'" in results[0].message
    assert not results[0].ok
    # Nothing ran, nothing qualified: as a run's verdict says it.
    assert not results.qualified
    assert results.not_checked is not None
    assert results.not_checked.startswith(
        "no_such_pkg.backends:Missing: not checked (every clause skipped, 3 results; backend "
        "skip: backend no_such_pkg.backends:Missing is not importable: ModuleNotFoundError")


def test_a_backend_checked_and_passing_qualifies() -> None:
    results = api.check_backend(Good, clauses=["KV-L1"], device="cpu")
    assert isinstance(results, api.CheckResults) and isinstance(results, list)
    assert results.qualified and results.not_checked is None


@pytest.mark.parametrize(("raised", "status", "kind"), [
    # Raised from here, outside the plugin: the installed code's failure, as under pytest
    # (the harness's own bug is an error: test_both_front_ends_give_a_raising_check_one_status).
    (RuntimeError("boom"), "failed", None),
    (HarnessError("worker 3 timed out", kind=ErrorKind.TIMEOUT), "error", ErrorKind.TIMEOUT),
    (MemoryError("cannot allocate 10^12 blocks"), "error", ErrorKind.OOM),
    (ClauseSkip("KV-L1", "no CUDA here", SkipKind.HARDWARE), "skipped", None),
])
def test_every_outcome_of_a_check_is_a_result(seed: Seeder, raised: Exception, status: str,
                                              kind: ErrorKind | None) -> None:
    def check(backend: BackendUnderTest) -> None:
        raise raised

    seed.replace("pytest_kvconform.checks.layout.check_kv_l1", check)
    result, _name = api.check_backend(Good, clauses=["KV-L1"], device="cpu")
    assert (result.status, result.error_kind) == (status, kind)
    assert str(raised) in result.message
    if status == "skipped":
        assert result.skip_kind is SkipKind.HARDWARE
        assert not result.ok  # KV-L1 needs no device: a hardware skip is not forgiven


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"clauses": ["KV-L9"]}, "unknown clause 'KV-L9'"),
    ({"clauses": ["L1"]}, "not a clause id: 'L1'"),
    ({"cases": ["bf16_h8", "nope"]}, "unknown case 'nope'; shipped cases: .*bf16_h8"),
    ({"device": "tpu"}, "invalid value 'tpu'"),
    # KV-L1 allocates nothing: without the bound the call would just pass, never OOM.
    ({"cases": [Case(id="huge", file="mine", num_pages=10**12)], "clauses": ["KV-L1"]},
     "^check_backend: mine, case 'huge', key 'num_pages': 1000000000000 exceeds the limit "
     "65536"),
])
def test_bad_input_is_one_clear_error(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        api.check_backend(Good, **kwargs)  # type: ignore[arg-type]


def test_a_clause_left_without_cases_is_reported_not_dropped() -> None:
    results = api.check_backend(Good, cases=["bf16_h8"], clauses=["KV-S5", "KV-L1"],
                                device="cpu")
    assert [(r.clause, r.status) for r in results] == [("KV-L1", "passed"), ("KV-L1", "passed"),
                                                       ("KV-S5", "skipped")]
    s5 = results[2]
    assert s5.message == "KV-S5: none of the selected cases (bf16_h8) is one it runs on"
    assert s5.skip_kind is None and not s5.ok  # strict qualification would not forgive it


def test_not_a_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="expected a backend class"):
        api.check_backend(42, clauses=["KV-L1"])


def _collected() -> list[str]:
    return [line.split("::", 1)[1] for line in COLLECTED.read_text().splitlines()
            if line and not line.startswith("#")]


@needs_omni
def test_the_plan_is_the_suites_collection_for_one_backend() -> None:
    """Parametrised from the clause table, check_backend runs what the suite collects."""
    from pytest_kvconform.contract import cases

    backend = api.backend_under_test("TORCH_SDPA")
    plan = api._plan(clauses.select(None), backend, cases.load_cases(), seams=True)
    planned = [run.test_id for run in plan]
    others = {"CUDNN_ATTN", "FASTVIDEO_VSA", "FLASHINFER_ATTN", "FLASH_ATTN", "FLASH_ATTN_3_HUB",
              "FLASH_ATTN_HUB", "RAINFUSION_ATTN", "SAGE_ATTN", "SAGE_ATTN_3", "TRTLLM_ATTN"}
    # The V family's ids run on vLLM's own backends (vllm.*), never on TORCH_SDPA.
    suite = [i for i in _collected() if i.split("[")[1].split("-")[0].rstrip("]") not in others
             and not i.split("[")[1].startswith("vllm.")]
    # The clauses the stored ids name (a clause added since has its ids derived, not stored:
    # tests/end_to_end/test_collected_ids.py).
    stored = {clauses.clause_from_test_name(i) for i in suite}
    assert sorted(p for p in planned if clauses.clause_from_test_name(p) in stored) == \
        sorted(suite)
    assert len(planned) == len(set(planned))


# --- the real thing, in a plain interpreter ----------------------------------------------------

PLAIN = textwrap.dedent("""
    import json, sys
    from vllm_omni.diffusion.attention.backends.registry import DiffusionAttentionBackendEnum
    from pytest_kvconform import check_backend

    cls = DiffusionAttentionBackendEnum.TORCH_SDPA.get_class()
    results = check_backend(cls, cases=["bf16_h8", "fp16_h64", "split_k8", "groups2"],
                            clauses=[c for c in sys.argv[1:]], device="cpu")
    print(json.dumps({"pytest": "pytest" in sys.modules,
                      "results": [[r.clause, r.backend, r.case, r.layout, r.status,
                                   r.message[:200]] for r in results]}))
""")
# Every clause but the adoption ones (which start worker processes) and vLLM's own
# backends' (which a diffusion backend does not run), from the table.
NON_A = [c.id for c in clauses.CLAUSES if c.family not in ("A", "V")]


@needs_omni
def test_check_backend_in_a_plain_interpreter() -> None:
    """TORCH_SDPA, without pytest: results for every clause but KV-A's, pytest never
    imported."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", PLAIN, *NON_A], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["pytest"] is False
    rows = out["results"]
    assert {r[0] for r in rows} == set(NON_A)
    status = {(r[0], r[4]) for r in rows}
    # KV-L1..L5, S and N hold for TORCH_SDPA; KV-L6 and KV-L7 do not apply (production
    # serves no paged KV with it); KV-L8's legacy aliases and VLLM_KV_CACHE_LAYOUT are known
    # findings against vllm-omni 0.30.
    assert {s for c, s in status if c not in ("KV-L6", "KV-L7", "KV-L8")} == {"passed"}, rows
    assert {("KV-L6", "skipped"), ("KV-L7", "skipped"), ("KV-L8", "failed")} <= status
    assert all(r[1] == "TORCH_SDPA" for r in rows if r[0].startswith("KV-L"))
    assert all(r[1] is None for r in rows if not r[0].startswith("KV-L"))


@needs_omni
def test_adoption_clauses_run_in_workers_and_see_a_seeded_fault(seed: Seeder) -> None:
    """KV-A3 passes through production's worker path, which the result names; with the
    worker writing at a wrong offset it fails; no worker is left."""
    [clean] = api.check_backend("FLASH_ATTN", cases=["bf16_h8"], clauses=["KV-A3"],
                                device="cpu")
    assert (clean.status, clean.test) == ("passed", "test_kv_a3[FLASH_ATTN-bf16_h8]"), clean
    assert clean.via and "DiffusionKVModelRunnerBackend.initialize_kv_cache" in clean.via
    assert clean.seeded_fault is None and clean.ok
    assert multiprocessing.active_children() == [] and workers._pool is None
    seed.worker_fault("wrong_offset")
    l1, _name, faulty = api.check_backend("FLASH_ATTN", cases=["bf16_h8"],
                                          clauses=["KV-L1", "KV-A3"], device="cpu")
    assert faulty.status == "failed", faulty
    assert "KV-A3 violated" in faulty.message and "FLASH_ATTN" in faulty.message
    # The result says it ran under the seeded fault; KV-L1 drove no worker, so it did not.
    assert faulty.seeded_fault == "wrong_offset" and not faulty.ok
    assert faulty.message.endswith("(ran under the seeded worker fault 'wrong_offset', "
                                   "$KVCONFORM_WORKER_FAULT: this result speaks for the fault, "
                                   "not the backend)")
    assert (l1.clause, l1.status, l1.seeded_fault) == ("KV-L1", "passed", None)
    assert multiprocessing.active_children() == [] and workers._pool is None


UNGUARDED_SCRIPT = textwrap.dedent("""
    import json
    from vllm_omni.diffusion.attention.backends.registry import DiffusionAttentionBackendEnum as E
    from pytest_kvconform import check_backend

    print("=== check_backend starts", flush=True)
    # At module level, no `if __name__ == "__main__":` guard: the KV-A workers must not
    # run this again.
    results = check_backend(E.FLASH_ATTN.get_class(), cases=["bf16_h8"],
                            clauses=["KV-L2", "KV-A2"], device="cpu")
    print(json.dumps([[r.test, r.status, r.message[:300]] for r in results]), flush=True)
""")


@needs_omni
def test_check_backend_from_a_plain_script_without_a_main_guard(tmp_path: Path) -> None:
    """KV-A runs (its workers do not re-run the script), and vLLM, imported by the script
    before the call, logs no INFO line during it."""
    script = tmp_path / "check.py"
    script.write_text(UNGUARDED_SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVCONFORM_", "VLLM_LOGGING", "VLLM_CONFIGURE"))}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:]
    during = proc.stdout.partition("=== check_backend starts\n")[2].splitlines()
    rows = json.loads(during[-1])
    assert {status for _, status, _ in rows} == {"passed"}, rows
    assert any(test == "test_kv_a2[FLASH_ATTN-bf16_h8]" for test, _, _ in rows), rows
    assert not [line for line in during if line.startswith("INFO")], during[:20]


# --- one outcome rule: a check that raises is judged alike by both front-ends ----------


def _backend_bug(backend: BackendUnderTest) -> None:
    """Raised outside the plugin (this module stands for the installed code)."""
    raise RuntimeError(f"{backend.name}: the installed code's own bug")


def _harness_bug(backend: BackendUnderTest) -> None:
    """Raised inside the plugin's own code: the harness's bug, not the backend's."""
    from pytest_kvconform.adapters.discovery import import_object

    import_object("")


@pytest.mark.parametrize(("bug", "status"), [(_backend_bug, "failed"), (_harness_bug, "error")],
                         ids=["installed-code", "harness"])
def test_both_front_ends_give_a_raising_check_one_status(
        pytester: pytest.Pytester, seed: Seeder, bug: object, status: str) -> None:
    """The same exception escaping a check is the same status from ``check_backend`` and
    from the pytest suite (a failure of the installed code; an error of the harness)."""
    from tests.conftest import KV_ARGS
    from tests.seeding import backends_conftest

    seed.replace("pytest_kvconform.checks.layout.check_kv_l1", bug)
    direct, _name = api.check_backend(Good, clauses=["KV-L1"])
    pytester.makeconftest(backends_conftest({"Good": Good}))
    pytester.runpytest(*KV_ARGS, "-k", "kv_l1 and not name", "--kv-backend", "Good",
                       "--kv-report", "r.json")
    rows = json.loads((pytester.path / "r.json").read_text())["results"]
    [suite] = [r for r in rows if r["backend"] == "Good"]
    assert (direct.status, suite["status"]) == (status, status), (direct, suite)
    if status == "error":
        assert direct.error_kind == suite["error_kind"] == "harness", (direct, suite)
