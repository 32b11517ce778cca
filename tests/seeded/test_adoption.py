"""Seeded faults for the KV-A clauses: each must turn its clause red, and only then.

KV-A runs production's engine in KV-A worker processes, so a fault reaches it
through ``$KVCONFORM_WORKER_FAULT`` (``seed.worker_fault``; ``faults/worker_faults.py``), which
every process hosting production applies, never through monkeypatching this
process.  The worker-side faults rewrite production's callers the way a regression
would (``DiffusionKVModelRunnerBackend.initialize_kv_cache``,
``DiffusionWorker.set_kv_cache_configs``, ``UniProcDiffusionExecutor``), never the
layout helpers they call.  FLASH_ATTN is the in-tree backend production serves paged
KV with; the seam variants (``need_False`` / ``need_True``) run beside it.  The
module holds the shared worker pool, so the inline runs reuse the same workers
instead of paying vllm-omni's import in each.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_kvconform.faults import worker_faults
from pytest_kvconform.workers import pool as workers
from tests.conftest import needs_omni
from tests.seeding import Seeder, expect_run

pytestmark = [needs_omni, pytest.mark.usefixtures("shared_workers")]

PAGED = ("--kv-backend", "FLASH_ATTN")
# Production's runner asserts each layer's *native* paged backend against the layout, which
# declares no need: the contradiction control fails on the unpatched code (a known finding).
CONTRADICTION = ("*KV-A4 violated*allocated it: DiffusionKVModelRunnerBackend.initialize_kv_cache"
                 " asserts each registered layer*native paged backend*")



def _runs_here(fault: str) -> None:
    reason = worker_faults.applicable(fault)
    if reason is not None:
        pytest.skip(f"seeded fault {fault!r} cannot run on this host: {reason}")


def test_unpatched_selection(kv_run) -> None:
    """Only the contradiction control fails: production's per-layer assertion is vacuous."""
    result = kv_run(*PAGED, "-k", "(kv_a1 or kv_a2 or kv_a3 or kv_a4) and bf16_h8")
    expect_run(result, passed=15, failed=3, clauses=["KV-A4"] * 3, lines=[CONTRADICTION])


def test_a_runner_that_asserts_each_layers_backend_passes_kv_a4(seed: Seeder, kv_run) -> None:
    """KV-A4's contradiction control can pass: with the runner corrected, it refuses."""
    seed.worker_fault("assert_layer_backends")
    result = kv_run(*PAGED, "-k", "kv_a4")
    expect_run(result, passed=18)


def test_a_runner_that_skips_the_layer_assertion_fails_kv_a4(seed: Seeder, kv_run) -> None:
    """Caught where the runner's assertion can refuse: with it corrected (each layer's own
    backend asserted), removing it turns KV-A4's contradiction control red again."""
    seed.worker_fault("assert_layer_backends,skip_layer_assertion")
    result = kv_run(*PAGED, "-k", "kv_a4")
    expect_run(result, failed=6, passed=12, clauses=["KV-A4"] * 6, lines=[CONTRADICTION])


def test_skipping_productions_own_layer_assertion_is_not_observable(
        seed: Seeder, kv_run) -> None:
    """Not counted as caught on production as it is: its runner asserts each layer's
    *native* paged backend, which declares no need, so production's assertion accepts every
    layout and removing it changes no outcome (KV-A4's contradiction control fails either
    way, as the known finding)."""
    import importlib

    from vllm.utils.import_utils import resolve_obj_by_qualname

    from pytest_kvconform.adapters.compat import LAYOUT_NAMES
    from pytest_kvconform.checks import adoption
    from pytest_kvconform.contract.cases import load_cases

    layout = importlib.import_module("vllm_omni.diffusion.diffusion_kv.layout")
    case = next(c for c in load_cases(()) if c.id == "bf16_h8")
    with adoption.fixture_deployment(True, case, workers.pool().get(["cpu"])) as deployed:
        natives = {path for path in deployed.report.ranks[0]["native_backends"].values()}
        config = deployed.report.rank_configs[0]
    assert natives
    for native in sorted(natives):
        backend = resolve_obj_by_qualname(native)
        assert getattr(backend, "indexes_kv_by_block_stride", None) is None, native
        for name in LAYOUT_NAMES:  # production's assertion passes whatever the layout
            pinned = type("Pinned", (), {"cache_config": type("C", (), {
                "kv_cache_layout": name})()})()
            layout.assert_backend_layout_supported(pinned, backend)
    assert config.kv_cache_layout == "BLNHC"  # the need the layers declare, honoured
    unpatched = kv_run(*PAGED, "-k", "kv_a4 and bf16_h8")
    seed.worker_fault("skip_layer_assertion")
    skipped = kv_run(*PAGED, "-k", "kv_a4 and bf16_h8")
    for result in (unpatched, skipped):
        expect_run(result, failed=3, passed=6, clauses=["KV-A4"] * 3, lines=[CONTRADICTION])
    assert failed_lines(skipped) == failed_lines(unpatched)


def failed_lines(result: Any) -> list[str]:
    """The failure lines of a run's short summary (which test failed, and why)."""
    return sorted(line for line in result.stdout.lines if line.startswith("FAILED "))


@pytest.mark.parametrize("fault", ["skip_adoption", "allocate_before_adopting"])
def test_a_runner_that_does_not_adopt_first_fails_kv_a3(seed: Seeder, kv_run,
                                                       fault: str) -> None:
    seed.worker_fault(fault)
    result = kv_run(*PAGED, "-k", "kv_a3")
    expect_run(result, failed=6, clauses=["KV-A3"] * 6, lines=[
        "*KV-A3 violated*a worker refused its rank-local config: *"
        "DiffusionKVModelRunnerBackend.initialize_kv_cache -> *raised ValueError: KV cache "
        "layout has not been resolved yet*"])


def test_a_runner_that_skips_adoption_fails_kv_a4s_disagreement_control(
        seed: Seeder, kv_run) -> None:
    """Pinned elsewhere, a worker that never adopts never raises the disagreement error."""
    seed.worker_fault("skip_adoption")
    result = kv_run(*PAGED, "-k", "kv_a4 and bf16_h8")
    expect_run(result, failed=3, passed=6, clauses=["KV-A4"] * 3,
               lines=["*KV-A4 violated*without the disagreement error*"])
    _passed, _skipped, failed = result.reprec.listoutcomes()  # type: ignore[attr-defined]
    assert all("test_kv_a4_disagreement" in r.nodeid for r in failed)


def test_a_worker_that_takes_another_ranks_config_fails_kv_a3_and_a5(
        seed: Seeder, kv_run) -> None:
    """Each rank holds its own layers: another rank's config is refused by the runner."""
    _runs_here("other_rank_config")
    seed.worker_fault("other_rank_config")
    result = kv_run(*PAGED, "-k", "(kv_a3 or kv_a5) and ws2")
    expect_run(result, failed=6, lines=[
        "*KV-A*violated*DiffusionWorker.set_kv_cache_configs -> *initialize_kv_cache*"
        "layer mismatch*"], in_order=False)


def test_a_uniproc_executor_sharing_its_cache_config_fails_kv_a4(seed: Seeder, kv_run) -> None:
    """The inline worker handed the control plane's pinned CacheConfig: adoption is masked."""
    _runs_here("shared_cache_config")
    seed.worker_fault("shared_cache_config")
    result = kv_run(*PAGED, "-k", "kv_a4_unadopted and bf16_h8")
    expect_run(result, failed=3, clauses=["KV-A4"] * 3,
               lines=["*KV-A4 violated*with adoption skipped*the worker allocated*"])


def test_an_executor_handoff_that_drops_the_layout_stamp_fails_kv_a2_and_a5(
        seed: Seeder, kv_run) -> None:
    """``DiffusionExecutor.set_kv_cache_configs`` hands the workers configs rebuilt without
    the stamp: what a worker holds differs from what the control plane handed over."""
    seed.worker_fault("handoff_drops_layout")
    result = kv_run(*PAGED, "-k", "kv_a2 or (kv_a5 and ws2)")
    expect_run(result, failed=9, clauses=["KV-A2"] * 6 + ["KV-A5"] * 3, lines=[
        "*KV-A2 violated*rank 0: the config the worker's runner holds differs from the control "
        "plane's rank-0 config at kv_cache_layout*"])


def test_uniproc_never_stamped_configs_fail_kv_a1_a3_and_a4(seed: Seeder, kv_run) -> None:
    """World size 1: control plane and worker share one process (production's uniproc
    topology); a config the control plane never stamped is not masked by the control
    plane's own, already pinned CacheConfig."""
    seed.worker_fault("unstamped_configs")
    result = kv_run(*PAGED, "-k", "(kv_a1 or kv_a3 or kv_a4) and bf16_h8")
    expect_run(result, failed=12, passed=3, lines=[
        "*KV-A1 violated*rank 0 KVCacheConfig is not stamped*", "*expected: 'LBNHC'*",
        "*actual:   None*"])
    result.stdout.fnmatch_lines(["*KV-A3 violated*did not adopt the control plane's layout*",
                                 "*KV-A4 violated*adopted None without the disagreement error*"],
                                consecutive=False)
    result.stdout.fnmatch_lines(["kvconform: KV-A worker path: *UniProcDiffusionExecutor*"
                                 if worker_faults.applicable("other_rank_config") is None else
                                 "kvconform: KV-A worker path: DiffusionModelRunner*"])


def test_config_named_other_than_pinned_fails_kv_a1_and_a3(seed: Seeder, kv_run) -> None:
    seed.worker_fault("misnamed_configs")
    result = kv_run(*PAGED, "-k", "(kv_a1 or kv_a3) and bf16_h8")
    expect_run(result, failed=6, lines=["*KV-A1 violated*not stamped with the pinned layout*",
                                        "*expected: 'LBNHC'*", "*actual:   'LBHNC'*"])
    result.stdout.fnmatch_lines(["*KV-A3 violated*layout=BLNHC*first difference*"])


def test_shifted_tensor_offset_fails_kv_a1_and_a3(seed: Seeder, kv_run) -> None:
    """The oracle is not fed production's offset: a single group starts at byte 0."""
    seed.worker_fault("shifted_offset")
    result = kv_run(*PAGED, "-k", "(kv_a1 or kv_a3) and bf16_h8")
    expect_run(result, failed=6, lines=["*KV-A1 violated*rank 0 KVCacheTensor.offset is not 0*",
                                        "*expected: 0*", "*actual:   512*"])
    result.stdout.fnmatch_lines(["*KV-A3 violated*rank 0 KVCacheTensor.offset is not 0*"])


def test_pattern_at_a_wrong_offset_fails_kv_a3(seed: Seeder, kv_run) -> None:
    seed.worker_fault("wrong_offset")
    result = kv_run(*PAGED, "-k", "kv_a3")
    expect_run(result, failed=6, clauses=["KV-A3"] * 6, lines=[
        "*KV-A3 violated*first difference at address*(layer 0, block 0, head 0, token 0, "
        "byte 0)*", "*expected: '0x*", "*actual:   '0x0'*"])


def test_a_seeded_fault_is_in_the_report_and_in_each_result_it_touched(
        seed: Seeder, kv_run: Any, pytester: pytest.Pytester) -> None:
    """Outside strict mode the run goes on: the report names the fault, and the results
    whose workers ran under it, so KV-A3's failure does not read as FLASH_ATTN's own."""
    import json

    seed.worker_fault("wrong_offset")
    result = kv_run(*PAGED, "-k", "(kv_a3 and bf16_h8 and not seam) or kv_l1", "--kv-report",
                    "r.json")
    expect_run(result, passed=2, failed=1, clauses=["KV-A3"])  # KV-L1: the need and the name
    result.stdout.fnmatch_lines(["*kvconform: verdict*: not qualified (*seeded worker fault "
                                 "wrong_offset in 1 result(s)*"])
    report = json.loads((pytester.path / "r.json").read_text())
    assert report["environment"]["seeded_faults"] == ["wrong_offset"]
    faults = {r["clause"]: (r["status"], r["seeded_fault"]) for r in report["results"]}
    assert faults == {"KV-A3": ("failed", "wrong_offset"), "KV-L1": ("passed", None)}
    markdown = (pytester.path / "r.md").read_text()
    assert "| seeded worker fault | wrong_offset ($KVCONFORM_WORKER_FAULT) |" in markdown
    assert "fail (under the seeded worker fault wrong_offset): KV-A3 violated" in markdown


@pytest.mark.parametrize("fault", [None, "wrong_offset"])
def test_probed_regions_path_used_by_kv_a6(seed: Seeder, fault: str | None) -> None:
    """KV-A6 reads back guarded page regions, not the whole allocation: same verdicts."""
    from pytest_kvconform.checks import adoption_bytes
    from pytest_kvconform.checks.errors import ClauseFailure
    from pytest_kvconform.contract.cases import load_cases

    case = next(c for c in load_cases(()) if c.id == "bf16_h8")
    seed.replace("pytest_kvconform.checks.adoption_bytes._FULL_READ_LIMIT", 0)
    if fault:
        seed.worker_fault(fault)
    handles = workers.pool().get(["cpu"])
    if fault is None:
        adoption_bytes.check_kv_a3(True, case, handles)
        return
    with pytest.raises(ClauseFailure, match=r"KV-A3 violated.*first difference at address"):
        adoption_bytes.check_kv_a3(True, case, handles)
