"""Seeded faults for the KV-A clauses: each must turn its clause red, and only then.

Faults are planted with ``seed`` (``tests/seeding.py``): control-plane faults where
vllm-omni's control plane is looked up at call time; worker faults through
``$KVCONFORM_WORKER_FAULT``, which every command to the spawned workers carries
(monkeypatching the test process never reaches a spawned child).  The module holds
the shared worker pool, so the inline runs reuse the same workers instead of paying
vllm-omni's import in each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pytest_kvconform import workers
from tests.conftest import needs_omni
from tests.seeding import Seeder, expect_run

pytestmark = needs_omni

SDPA = ("--kv-backend", "TORCH_SDPA")
CONTROL_PLANE = "vllm_omni.diffusion.diffusion_kv.initialization.build_native_kv_cache_configs"


def _control_plane_fault(seed: Seeder, spoil: Callable[[list[Any], Any], None]) -> None:
    """The control plane's configs (rank-local ones, then the scheduler's), spoiled."""
    def make(original: Any) -> Any:
        def faulty(*args: Any, **kwargs: Any) -> Any:
            rank_configs, scheduler_config = original(*args, **kwargs)
            spoil(rank_configs, scheduler_config)
            return rank_configs, scheduler_config
        return faulty

    seed.wrap(CONTROL_PLANE, make)


def forgets_to_stamp(rank_configs: list[Any], scheduler_config: Any) -> None:
    for c in (*rank_configs, scheduler_config):
        c.kv_cache_layout = None


def other_name(rank_configs: list[Any], scheduler_config: Any) -> None:
    """The rank-local configs carry a name the control plane did not pin (LBHNC / BLHNC)."""
    for c in rank_configs:
        c.kv_cache_layout = c.kv_cache_layout[:2] + "HN" + c.kv_cache_layout[4:]


def shifted_offset(rank_configs: list[Any], scheduler_config: Any) -> None:
    """Self-consistent (size grows with it), so only an expected offset of 0 can catch it."""
    for t in (c.kv_cache_tensors[0] for c in rank_configs):
        t.offset += 512
        t.size += 512


@pytest.fixture(scope="module", autouse=True)
def _shared_workers():
    workers.hold()
    yield
    workers.release()


def test_unpatched_selection_passes(kv_run) -> None:
    result = kv_run(*SDPA, "-k", "(kv_a1 or kv_a3 or kv_a4) and bf16_h8")
    expect_run(result, passed=9)


def test_worker_that_skips_adoption_fails_kv_a3(seed: Seeder, kv_run) -> None:
    seed.worker_fault("skip_adoption")
    result = kv_run(*SDPA, "-k", "kv_a3 and bf16_h8")
    expect_run(result, failed=3, clauses=["KV-A3"] * 3,
               lines=["*KV-A3 violated*rank 0: init raised ValueError*"])


def test_pattern_at_a_wrong_offset_fails_kv_a3(seed: Seeder, kv_run) -> None:
    seed.worker_fault("wrong_offset")
    result = kv_run(*SDPA, "-k", "kv_a3")
    expect_run(result, failed=6, clauses=["KV-A3"] * 6, lines=[
        "*KV-A3 violated*first difference at address*(layer 0, block 0, head 0, token 0, "
        "byte 0)*", "*expected: '0x*", "*actual:   '0x0'*"])


def test_a_seeded_fault_is_in_the_report_and_in_each_result_it_touched(
        seed: Seeder, kv_run: Any, pytester: pytest.Pytester) -> None:
    """Outside strict mode the run goes on: the report names the fault, and the results
    whose workers ran under it, so KV-A3's failure does not read as TORCH_SDPA's own."""
    import json

    seed.worker_fault("wrong_offset")
    result = kv_run(*SDPA, "-k", "(kv_a3 and bf16_h8 and not seam) or kv_l1", "--kv-report",
                    "r.json")
    expect_run(result, passed=1, failed=1, clauses=["KV-A3"])
    result.stdout.fnmatch_lines(["*kvconform: verdict: not qualified (*seeded worker fault "
                                 "wrong_offset in 1 result(s)*"])
    report = json.loads((pytester.path / "r.json").read_text())
    assert report["environment"]["seeded_faults"] == ["wrong_offset"]
    faults = {r["clause"]: (r["status"], r["seeded_fault"]) for r in report["results"]}
    assert faults == {"KV-A3": ("failed", "wrong_offset"), "KV-L1": ("passed", None)}
    markdown = (pytester.path / "r.md").read_text()
    assert "| seeded worker fault | wrong_offset ($KVCONFORM_WORKER_FAULT) |" in markdown
    assert "fail (under the seeded worker fault wrong_offset): KV-A3 violated" in markdown


def test_control_plane_that_forgets_to_stamp_fails_kv_a1(seed: Seeder, kv_run) -> None:
    _control_plane_fault(seed, forgets_to_stamp)
    result = kv_run(*SDPA, "-k", "kv_a1")
    expect_run(result, failed=6, clauses=["KV-A1"] * 6, lines=[
        "*KV-A1 violated*rank 0 KVCacheConfig is not stamped*", "*expected: 'LBNHC'*",
        "*actual:   None*"])


def test_config_named_other_than_pinned_fails_kv_a1_and_a3(seed: Seeder, kv_run) -> None:
    _control_plane_fault(seed, other_name)
    result = kv_run(*SDPA, "-k", "(kv_a1 or kv_a3) and bf16_h8")
    expect_run(result, failed=6, lines=["*KV-A1 violated*not stamped with the pinned layout*",
                                        "*expected: 'LBNHC'*", "*actual:   'LBHNC'*"])
    result.stdout.fnmatch_lines(["*KV-A3 violated*layout=BLNHC*first difference*"])


def test_shifted_tensor_offset_fails_kv_a1_and_a3(seed: Seeder, kv_run) -> None:
    """The oracle is not fed production's offset: a single group starts at byte 0."""
    _control_plane_fault(seed, shifted_offset)
    result = kv_run(*SDPA, "-k", "(kv_a1 or kv_a3) and bf16_h8")
    expect_run(result, failed=6, lines=["*KV-A1 violated*rank 0 KVCacheTensor.offset is not 0*",
                                        "*expected: 0*", "*actual:   512*"])
    result.stdout.fnmatch_lines(["*KV-A3 violated*rank 0 KVCacheTensor.offset is not 0*"])


def test_worker_that_skips_adoption_fails_kv_a4_disagreement_control(
        seed: Seeder, kv_run) -> None:
    """Pinned elsewhere, a worker that never adopts never raises the disagreement error."""
    seed.worker_fault("skip_adoption")
    result = kv_run(*SDPA, "-k", "kv_a4 and bf16_h8")
    expect_run(result, failed=3, clauses=["KV-A4"] * 3,
               lines=["*KV-A4 violated*disagreement error*"])


@pytest.mark.parametrize("fault", [None, "wrong_offset"])
def test_probed_regions_path_used_by_kv_a6(seed: Seeder, fault: str | None) -> None:
    """KV-A6 reads back guarded page regions, not the whole allocation: same verdicts."""
    from pytest_kvconform.cases import load_cases
    from pytest_kvconform.checks import adoption
    from pytest_kvconform.checks.errors import ClauseFailure

    case = next(c for c in load_cases(()) if c.id == "bf16_h8")
    seed.replace("pytest_kvconform.checks.adoption._FULL_READ_LIMIT", 0)
    if fault:
        seed.worker_fault(fault)
    handles = workers.pool().get(["cpu"])
    if fault is None:
        adoption.check_kv_a3(True, case, handles)
        return
    with pytest.raises(ClauseFailure, match=r"KV-A3 violated.*first difference at address"):
        adoption.check_kv_a3(True, case, handles)
