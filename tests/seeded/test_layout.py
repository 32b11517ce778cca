"""Seeded faults for the KV-L clauses: each must turn its clause red, and only then.

Every fault is planted with ``seed`` (``tests/seeding.py``) where production looks the
name up (a module attribute read at call time): the package's own faults
(``faults/plants.py``, which ``kvconform selftest`` seeds too), or this file's; or it is
a stand-in backend registered through the plugin's own hook.  The unpatched selection is
run too, so no clause fails by construction.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from pytest_kvconform.adapters import seam_backends
from pytest_kvconform.faults import plants
from tests import standin_backends as sb
from tests.conftest import needs_omni
from tests.seeding import Seeder, backend_args, expect_run, register_backends

pytestmark = needs_omni

SDPA = ("--kv-backend", "TORCH_SDPA")
RESOLVER = "vllm_omni.diffusion.diffusion_kv.layout.resolve_diffusion_kv_cache_layout"

L1_FAULTS = {"INT_FLAG": sb.IntFlag, "FLIPPING": sb.Flipping, "TOUCHES_CUDA": sb.TouchesCuda,
             "TOUCHES_CUDA_RAW": sb.TouchesCudaRaw, "RAISES": sb.Raises}


def test_l1_faults_fail_and_registry_passes(kv_run, pytester: pytest.Pytester) -> None:
    """The need's faults fail test_kv_l1; each names itself as registered (test_kv_l1_name)."""
    register_backends(pytester, L1_FAULTS)
    result = kv_run("-k", "kv_l1", *backend_args(*L1_FAULTS), *SDPA)
    expect_run(result, failed=5, passed=7, clauses=["KV-L1"] * 5, in_order=False, lines=[
        "*KV-L1 violated*INT_FLAG*returned 1 of type int; a real bool is required*",
        "*KV-L1 violated*FLIPPING*changes its answer between calls*",
        "*KV-L1 violated*TOUCHES_CUDA[]]*initialised a CUDA context*",
        "*KV-L1 violated*TOUCHES_CUDA_RAW*initialised a CUDA context*",
        "*KV-L1 violated*RAISES*raised: RuntimeError('registry not ready')*",
    ])


class ClaimsARegistryName(sb.Good):
    """Registered as MY_ATTN, answers to a registry member's name: production would serve
    it as TORCH_SDPA (its backend preference, its implementation overrides)."""

    @classmethod
    def get_name(cls) -> str:
        return "TORCH_SDPA"


class NamesItselfAnInt(sb.Good):
    @classmethod
    def get_name(cls) -> int:  # type: ignore[override]
        return 42


class Nameless:
    """No get_name() at all: production cannot name the backend."""

    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        return False


NAME_FAULTS = {"MY_ATTN": ClaimsARegistryName, "INT_NAME": NamesItselfAnInt,
               "NAMELESS": Nameless}


def test_a_backend_that_answers_to_another_name_fails_kv_l1_first(
        kv_run, pytester: pytest.Pytester) -> None:
    """KV-L1's name control fails, naming both names; the backend's other failures depend
    on it (the root cause), while its layout need (test_kv_l1) still passes on its own."""
    register_backends(pytester, NAME_FAULTS)
    result = kv_run("-k", "kv_l1 or kv_l2", *backend_args(*NAME_FAULTS), "-rf")
    expect_run(result, failed=3, passed=6, clauses=["KV-L1"] * 3, in_order=False, lines=[
        "*KV-L1 violated*MY_ATTN*get_name() returned 'TORCH_SDPA', but the backend is "
        "registered as 'MY_ATTN': production would serve it as 'TORCH_SDPA'*",
        "*KV-L1 violated*INT_NAME*get_name() returned 42 of type int, but the backend is "
        "registered as 'INT_NAME'; a str is required*",
        "*KV-L1 violated*NAMELESS*the backend class has no callable get_name()*",
    ])
    verdict = next(line for line in result.stdout.lines if line.startswith("kvconform: verdict"))
    assert "MY_ATTN: KV-L1 failed (root cause): KV-L1 test_kv_l1_name[MY_ATTN]" in verdict


def test_every_registry_member_answers_to_its_name(kv_run) -> None:
    """No false failure in-tree: TORCH_SDPA's class answers to "SDPA", production's own name
    for it; every other member to its member name."""
    result = kv_run("-k", "kv_l1_name", "-rs")
    expect_run(result, passed=10, skipped=1)  # SAGE_ATTN_3 does not import here


def test_l2_wrong_pin_fails(kv_run, seed: Seeder) -> None:
    seed.plant(plants.WRONG_PIN)
    result = kv_run("-k", "kv_l2", *SDPA)
    expect_run(result, failed=1, clauses=["KV-L2"], lines=[
        "*KV-L2 violated*TORCH_SDPA*default layer-outermost*", "*expected: 'LBNHC'*",
        "*actual:   'LBHNC'*"])


def test_l3_overwriting_a_consistent_pin_fails(kv_run, seed: Seeder) -> None:
    seed.plant(plants.OVERWRITES_CONSISTENT_PIN)
    result = kv_run("-k", "kv_l3", *SDPA)
    expect_run(result, failed=1, clauses=["KV-L3"], lines=[
        "*KV-L3 violated*TORCH_SDPA*layout=LBHNC*pinned layout LBHNC (consistent with the "
        "backend), but resolution returned another layout*",
        "*expected: 'LBHNC'*", "*actual:   'LBNHC'*"])


def test_l4_overwriting_a_contradictory_pin_fails(kv_run, seed: Seeder) -> None:
    seed.plant(plants.ACCEPTS_CONTRADICTORY_PIN)
    result = kv_run("-k", "kv_l4 or kv_l3", *SDPA)
    expect_run(result, failed=1, passed=1, clauses=["KV-L4"], lines=[
        "*KV-L4 violated*TORCH_SDPA*layout=BLHNC*pinned layout BLHNC contradicts "
        "indexes_kv_by_block_stride()=False, but resolution accepted it: returned LBNHC*"])


def test_l5_silent_assertion_fails_the_contradiction_control(kv_run, seed: Seeder) -> None:
    seed.plant(plants.SILENT_ASSERTION)
    result = kv_run("-k", "kv_l5", *SDPA)
    expect_run(result, failed=1, passed=2, clauses=["KV-L5"],
               lines=["*_ test_kv_l5_contradiction?TORCH_SDPA? _*",
                      "*KV-L5 violated*TORCH_SDPA*stayed silent for layout BLHNC*"])


def test_l5_assertion_raising_unresolved_fails_only_that_control(kv_run, seed: Seeder) -> None:
    """A worker not yet told the layout must not crash; the other two controls hold."""
    seed.plant(plants.ASSERTION_RAISES_UNRESOLVED)
    result = kv_run("-k", "kv_l5", *SDPA)
    expect_run(result, failed=1, passed=2, clauses=["KV-L5"], lines=[
        "*_ test_kv_l5_unresolved?TORCH_SDPA? _*",
        "*KV-L5 violated*TORCH_SDPA*raised while the layout is unresolved*"])


def test_l5_assertion_refusing_everything_fails_only_the_consistent_control(
        kv_run, seed: Seeder) -> None:
    seed.plant(plants.ASSERTION_REFUSES_ALL)
    result = kv_run("-k", "kv_l5", *SDPA)
    expect_run(result, failed=1, passed=2, clauses=["KV-L5"], lines=[
        "*_ test_kv_l5_consistent?TORCH_SDPA? _*",
        "*KV-L5 violated*TORCH_SDPA*raised for layout LBHNC, which is consistent*"])


def test_l6_block_stride_backend_fails_on_the_control_plane(kv_run,
                                                            pytester: pytest.Pytester) -> None:
    """The True branches of L3-L5 hold; only the production wiring drops the flag."""
    register_backends(pytester, {"FAKE_BS": seam_backends.NeedTrue})  # paged, needs True
    result = kv_run("-k", "(kv_l3 or kv_l4 or kv_l5 or kv_l6) and not seam",
                    "--kv-backend", "FAKE_BS")
    expect_run(result, failed=1, passed=5, clauses=["KV-L6"], lines=[
        "*KV-L6 violated*FAKE_BS*the control plane never receives indexes_kv_by_block_stride;"
        " pinned LBNHC for a backend that needs a block-outermost layout*; production's worker"
        " then allocated LBNHC without complaint*",
        "*expected: 'a block-outermost layout'*", "*actual:   'LBNHC'*"])


def test_l3_to_l6_pass_unpatched(kv_run) -> None:
    result = kv_run("-k", "(kv_l3 or kv_l4 or kv_l5 or kv_l6) and not seam",
                    "--kv-backend", "FLASH_ATTN")
    result.assert_outcomes(passed=6)


def test_l6_does_not_apply_to_a_backend_production_serves_no_paged_kv_with(kv_run) -> None:
    result = kv_run("-rs", "-k", "kv_l6 and not seam", *SDPA)
    expect_run(result, skipped=1, lines=[
        "*KV-L6: TORCH_SDPA has no paged KV support (supports_paged_kv is not True): "
        "production serves no paged model with it*register_kv_cache_layers*"])


def test_l6_seam_reports_the_wiring_gap_for_need_true_only(kv_run) -> None:
    """vllm-omni 0.30's control plane drops the flag: need_True fails, need_False passes."""
    result = kv_run("-k", "kv_l6_seam")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["*KV-L6 violated [[]backend=need_True, layout=LBNHC[]]: the "
                                 "control plane never receives indexes_kv_by_block_stride*"])


def test_l7_skips_with_reason(kv_run, pytester: pytest.Pytester) -> None:
    register_backends(pytester, {"FAKE_BS": sb.NeedsBlockStride})
    result = kv_run("-rs", "-k", "kv_l7", "--kv-device", "cpu", "--kv-backend", "FAKE_BS",
                    "--kv-backend", "FLASH_ATTN")
    expect_run(result, skipped=2, in_order=False, lines=[
        "*KV-L7: the backend does not declare supports_paged_kv*",
        "*KV-L7: needs the backend's kernel device (CUDA)*"])


def _plant_conforming_l8(seed: Seeder) -> None:
    """Aliases mapped, the variable honoured, workers compare layouts rather than
    spellings: what the contract asks of vllm-omni."""
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm_omni.diffusion.diffusion_kv import layout as omni_layout

    aliases = {"NHD": "LBNHC", "HND": "LBHNC"}
    original = omni_layout.resolve_diffusion_kv_cache_layout

    def member(name: str) -> Any:
        try:
            return KVCacheLayout[aliases.get(name, name)]
        except KeyError:
            raise ValueError(f"unknown KV cache layout {name!r}") from None

    def resolve(vllm_config: Any, *, indexes_kv_by_block_stride: bool = False,
                required_layout: Any = None) -> Any:
        need = bool(indexes_kv_by_block_stride)
        cache_config = vllm_config.cache_config
        current = cache_config.kv_cache_layout
        source = "CacheConfig.kv_cache_layout"
        if current is None and os.environ.get("VLLM_KV_CACHE_LAYOUT"):
            current, source = os.environ["VLLM_KV_CACHE_LAYOUT"], "VLLM_KV_CACHE_LAYOUT"
        if current is None or required_layout is not None:
            return original(vllm_config, indexes_kv_by_block_stride=need,
                            required_layout=required_layout)
        layout = member(current)
        if layout.is_block_outermost != need:
            raise ValueError(f"{source}={current} ({layout.name}) contradicts the backend")
        if cache_config.kv_cache_layout is None:
            cache_config.kv_cache_layout = layout.name
        return layout

    def adopt(vllm_config: Any, kv_cache_config: Any) -> Any:
        name = kv_cache_config.kv_cache_layout
        current = vllm_config.cache_config.kv_cache_layout
        if current is None:
            vllm_config.cache_config.kv_cache_layout = name
        elif member(current) is not member(name):
            raise ValueError(f"worker layout {current!r} disagrees with {name!r}")
        return member(name)

    seed.replace(RESOLVER, resolve)
    seed.replace("vllm_omni.diffusion.diffusion_kv.layout.adopt_kv_cache_layout", adopt)


def test_l8_fails_unpatched_with_named_aliases_and_variable(kv_run) -> None:
    before = os.environ.get("VLLM_KV_CACHE_LAYOUT")
    result = kv_run("-k", "kv_l8", *SDPA)
    expect_run(result, failed=4, passed=3, clauses=["KV-L8"] * 4, in_order=False, lines=[
        "*KV-L8 violated*'HND' (upstream's legacy alias for LBHNC) must be honoured as LBHNC, "
        "but it refused it and raised a bare KeyError('HND')*",
        "*KV-L8 violated*worker whose CacheConfig.kv_cache_layout='NHD' (alias of LBNHC) must "
        "adopt*disagrees*",
        "*KV-L8 violated*VLLM_KV_CACHE_LAYOUT=LBHNC*must be honoured, but it was silently "
        "ignored: diffusion resolution pinned LBNHC*",
        "*KV-L8 violated*VLLM_KV_CACHE_LAYOUT=BLNHC*must be refused with a ValueError, but it "
        "was silently ignored: diffusion resolution pinned LBNHC*",
    ])
    assert os.environ.get("VLLM_KV_CACHE_LAYOUT") == before  # the check restored it


def test_l8_passes_when_resolution_conforms(kv_run, seed: Seeder) -> None:
    _plant_conforming_l8(seed)
    result = kv_run("-k", "kv_l8", *SDPA)
    expect_run(result, passed=7)


def test_l8_an_adoption_that_accepts_every_layout_fails_the_worker_disagreement(
        kv_run, seed: Seeder) -> None:
    """The worker alias "passes" when adoption accepts anything: its neighbouring control
    is what tells that from a fix."""
    seed.plant(plants.ADOPTS_ANY_LAYOUT)
    result = kv_run("-k", "kv_l8_worker", *SDPA)
    expect_run(result, failed=1, passed=1, clauses=["KV-L8"], lines=[
        "*_ test_kv_l8_worker_disagreement?TORCH_SDPA? _*",
        "*KV-L8 violated*TORCH_SDPA*a worker whose CacheConfig.kv_cache_layout='LHBNC' must "
        "refuse the control plane's 'LBHNC' (another layout, not an alias of it), but adoption "
        "accepted it*"])


def test_l6_stand_in_override_is_restored(kv_run) -> None:
    """The seam's stand-in is plugged in as a registry override only for the call."""
    from vllm_omni.diffusion.attention.backends.registry import DiffusionAttentionBackendEnum

    kv_run("-k", "kv_l6_seam")
    assert not DiffusionAttentionBackendEnum.TORCH_SDPA.is_overridden()
