"""Seeded faults for the KV-A clauses: each must turn its clause red, and only then.

Control-plane faults patch vllm-omni where the control plane is looked up at
call time; worker faults travel to the spawned workers through
``$KVCONFORM_WORKER_FAULT`` (monkeypatching the test process never reaches a
spawned child).  The module holds the shared worker pool, so the inline runs
reuse the same workers instead of paying vllm-omni's import in each.
"""

from __future__ import annotations

import textwrap

import pytest

from pytest_kvconform import workers
from tests.conftest import needs_omni

pytestmark = needs_omni

SDPA = ("--kv-backend", "TORCH_SDPA")

WORKER_FAULT = '''
import pytest


@pytest.fixture(autouse=True)
def _fault(monkeypatch):
    monkeypatch.setenv("KVCONFORM_WORKER_FAULT", "{fault}")
'''

CONTROL_PLANE_FAULT = '''
import pytest

import vllm_omni.diffusion.diffusion_kv.initialization as init

ORIGINAL = init.build_native_kv_cache_configs


def faulty(*args, **kwargs):
    rank_configs, scheduler_config = ORIGINAL(*args, **kwargs)
    {body}
    return rank_configs, scheduler_config


@pytest.fixture(autouse=True)
def _fault(monkeypatch):
    monkeypatch.setattr(init, "build_native_kv_cache_configs", faulty)
'''

FORGETS_TO_STAMP = "for c in (*rank_configs, scheduler_config): c.kv_cache_layout = None"
# The rank-local configs carry a name the control plane did not pin (LBHNC / BLHNC).
OTHER_NAME = ("for c in rank_configs: "
              "c.kv_cache_layout = c.kv_cache_layout[:2] + 'HN' + c.kv_cache_layout[4:]")

# Self-consistent (size grows with it), so only an expected offset of 0 can catch it.
SHIFTED_OFFSET = ("for t in (c.kv_cache_tensors[0] for c in rank_configs): "
                  "t.offset += 512; t.size += 512")


@pytest.fixture(scope="module", autouse=True)
def _shared_workers():
    workers.hold()
    yield
    workers.release()


def _conftest(pytester: pytest.Pytester, text: str) -> None:
    pytester.makeconftest(textwrap.dedent(text))


def test_unpatched_selection_passes(kv_run) -> None:
    result = kv_run(*SDPA, "-k", "(kv_a1 or kv_a3 or kv_a4) and bf16_h8")
    result.assert_outcomes(passed=9)


def test_worker_that_skips_adoption_fails_kv_a3(pytester: pytest.Pytester, kv_run) -> None:
    _conftest(pytester, WORKER_FAULT.format(fault="skip_adoption"))
    result = kv_run(*SDPA, "-k", "kv_a3 and bf16_h8")
    result.assert_outcomes(failed=3)
    result.stdout.fnmatch_lines(["*KV-A3 violated*rank 0: init raised ValueError*"])


def test_pattern_at_a_wrong_offset_fails_kv_a3(pytester: pytest.Pytester, kv_run) -> None:
    _conftest(pytester, WORKER_FAULT.format(fault="wrong_offset"))
    result = kv_run(*SDPA, "-k", "kv_a3")
    result.assert_outcomes(failed=6)
    result.stdout.fnmatch_lines([
        "*KV-A3 violated*first difference at address*(layer 0, block 0, head 0, token 0, "
        "byte 0)*", "*expected: '0x*", "*actual:   '0x0'*"])


def test_control_plane_that_forgets_to_stamp_fails_kv_a1(pytester: pytest.Pytester,
                                                          kv_run) -> None:
    _conftest(pytester, CONTROL_PLANE_FAULT.format(body=FORGETS_TO_STAMP))
    result = kv_run(*SDPA, "-k", "kv_a1")
    result.assert_outcomes(failed=6)
    result.stdout.fnmatch_lines(["*KV-A1 violated*rank 0 KVCacheConfig is not stamped*",
                                 "*expected: 'LBNHC'*", "*actual:   None*"])


def test_config_named_other_than_pinned_fails_kv_a1_and_a3(pytester: pytest.Pytester,
                                                           kv_run) -> None:
    _conftest(pytester, CONTROL_PLANE_FAULT.format(body=OTHER_NAME))
    result = kv_run(*SDPA, "-k", "(kv_a1 or kv_a3) and bf16_h8")
    result.assert_outcomes(failed=6)
    result.stdout.fnmatch_lines(["*KV-A1 violated*not stamped with the pinned layout*",
                                 "*expected: 'LBNHC'*", "*actual:   'LBHNC'*"])
    result.stdout.fnmatch_lines(["*KV-A3 violated*layout=BLNHC*first difference*"])


def test_shifted_tensor_offset_fails_kv_a1_and_a3(pytester: pytest.Pytester, kv_run) -> None:
    """The oracle is not fed production's offset: a single group starts at byte 0."""
    _conftest(pytester, CONTROL_PLANE_FAULT.format(body=SHIFTED_OFFSET))
    result = kv_run(*SDPA, "-k", "(kv_a1 or kv_a3) and bf16_h8")
    result.assert_outcomes(failed=6)
    result.stdout.fnmatch_lines(["*KV-A1 violated*rank 0 KVCacheTensor.offset is not 0*",
                                 "*expected: 0*", "*actual:   512*"])
    result.stdout.fnmatch_lines(["*KV-A3 violated*rank 0 KVCacheTensor.offset is not 0*"])


def test_worker_that_skips_adoption_fails_kv_a4_disagreement_control(
        pytester: pytest.Pytester, kv_run) -> None:
    """Pinned elsewhere, a worker that never adopts never raises the disagreement error."""
    _conftest(pytester, WORKER_FAULT.format(fault="skip_adoption"))
    result = kv_run(*SDPA, "-k", "kv_a4 and bf16_h8")
    result.assert_outcomes(failed=3)
    result.stdout.fnmatch_lines(["*KV-A4 violated*disagreement error*"])


@pytest.mark.parametrize("fault", [None, "wrong_offset"])
def test_probed_regions_path_used_by_kv_a6(monkeypatch: pytest.MonkeyPatch,
                                           fault: str | None) -> None:
    """KV-A6 reads back guarded page regions, not the whole allocation: same verdicts."""
    from pytest_kvconform.cases import load_cases
    from pytest_kvconform.checks import adoption
    from pytest_kvconform.checks.errors import ClauseFailure

    case = next(c for c in load_cases(()) if c.id == "bf16_h8")
    monkeypatch.setattr(adoption, "_FULL_READ_LIMIT", 0)
    if fault:
        monkeypatch.setenv(workers.FAULT_ENV, fault)
    handles = workers.pool().get(["cpu"])
    if fault is None:
        adoption.check_kv_a3(True, case, handles)
        return
    with pytest.raises(ClauseFailure, match=r"KV-A3 violated.*first difference at address"):
        adoption.check_kv_a3(True, case, handles)
