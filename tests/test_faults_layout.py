"""Seeded faults for the KV-L clauses: each must turn its clause red, and only then.

Every fault is planted where production looks the name up (a module
attribute read at call time) or as a fake backend through the plugin's own
hook; the unpatched selection is run too, so no clause fails by construction.
"""

from __future__ import annotations

import os
import textwrap

import pytest

from tests.conftest import needs_omni

pytestmark = needs_omni

SDPA = ("--kv-backend", "TORCH_SDPA")

FAKE_L1 = '''
import torch


class IntFlag:
    @classmethod
    def indexes_kv_by_block_stride(cls):
        return 1


class Flipping:
    calls = 0

    @classmethod
    def indexes_kv_by_block_stride(cls):
        cls.calls += 1
        return cls.calls % 2 == 0


class TouchesCuda:
    @classmethod
    def indexes_kv_by_block_stride(cls):
        try:
            torch.cuda._lazy_init()
        except Exception:  # a CPU-only build refuses; the attempt is what counts
            pass
        return False


class TouchesCudaRaw:
    @classmethod
    def indexes_kv_by_block_stride(cls):
        return torch.cuda.current_device() >= 0  # raises on a CPU-only build


class Raises:
    @classmethod
    def indexes_kv_by_block_stride(cls):
        raise RuntimeError("registry not ready")


def pytest_kvconform_backends(config):
    return {"INT_FLAG": IntFlag, "FLIPPING": Flipping, "TOUCHES_CUDA": TouchesCuda,
            "TOUCHES_CUDA_RAW": TouchesCudaRaw, "RAISES": Raises}
'''

FAKE_BLOCK_STRIDE = '''
class NeedsBlockStride:
    supports_paged_kv = False

    @classmethod
    def indexes_kv_by_block_stride(cls):
        return True


def pytest_kvconform_backends(config):
    return {"FAKE_BS": NeedsBlockStride}
'''

# A resolver patched into the production module; BODY decides what it does.
RESOLVER_PATCH = '''
import pytest
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm_omni.diffusion.diffusion_kv import layout as omni_layout

ORIGINAL = omni_layout.resolve_diffusion_kv_cache_layout


def faulty(vllm_config, *, indexes_kv_by_block_stride=False, required_layout=None):
    cache_config = vllm_config.cache_config
    current = cache_config.kv_cache_layout
{body}


@pytest.fixture(autouse=True)
def _plant(monkeypatch):
    monkeypatch.setattr(omni_layout, "resolve_diffusion_kv_cache_layout", faulty)
'''


def _resolver(pytester: pytest.Pytester, body: str) -> None:
    pytester.makeconftest(RESOLVER_PATCH.format(body=textwrap.indent(textwrap.dedent(body),
                                                                      "    ")))


def test_l1_faults_fail_and_registry_passes(kv_run, pytester: pytest.Pytester) -> None:
    pytester.makeconftest(FAKE_L1)
    result = kv_run("-k", "kv_l1", "--kv-backend", "INT_FLAG", "--kv-backend", "FLIPPING",
                    "--kv-backend", "TOUCHES_CUDA", "--kv-backend", "TOUCHES_CUDA_RAW",
                    "--kv-backend", "RAISES", *SDPA)
    result.assert_outcomes(failed=5, passed=1)
    result.stdout.fnmatch_lines_random([
        "*KV-L1 violated*INT_FLAG*returned 1 of type int; a real bool is required*",
        "*KV-L1 violated*FLIPPING*changes its answer between calls*",
        "*KV-L1 violated*TOUCHES_CUDA[]]*initialised a CUDA context*",
        "*KV-L1 violated*TOUCHES_CUDA_RAW*initialised a CUDA context*",
        "*KV-L1 violated*RAISES*raised: RuntimeError('registry not ready')*",
    ])


def test_l2_wrong_pin_fails(kv_run, pytester: pytest.Pytester) -> None:
    _resolver(pytester, '''
        cache_config.kv_cache_layout = "LBHNC"
        return KVCacheLayout.LBHNC
    ''')
    result = kv_run("-k", "kv_l2", *SDPA)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*KV-L2 violated*TORCH_SDPA*default layer-outermost*",
                                 "*expected: 'LBNHC'*", "*actual:   'LBHNC'*"])


def test_l3_overwriting_a_consistent_pin_fails(kv_run, pytester: pytest.Pytester) -> None:
    _resolver(pytester, '''
        if current is not None and required_layout is None:
            cache_config.kv_cache_layout = "LBNHC"
            return KVCacheLayout.LBNHC
        return ORIGINAL(vllm_config, indexes_kv_by_block_stride=indexes_kv_by_block_stride,
                        required_layout=required_layout)
    ''')
    result = kv_run("-k", "kv_l3", *SDPA)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*KV-L3 violated*TORCH_SDPA*layout=LBHNC*pinned layout LBHNC (consistent with the "
        "backend), but resolution returned another layout*",
        "*expected: 'LBHNC'*", "*actual:   'LBNHC'*"])


def test_l4_overwriting_a_contradictory_pin_fails(kv_run, pytester: pytest.Pytester) -> None:
    _resolver(pytester, '''
        need = bool(indexes_kv_by_block_stride)
        if current is not None and KVCacheLayout[current].is_block_outermost != need:
            layout = KVCacheLayout.BLNHC if need else KVCacheLayout.LBNHC
            cache_config.kv_cache_layout = layout.name
            return layout
        return ORIGINAL(vllm_config, indexes_kv_by_block_stride=indexes_kv_by_block_stride,
                        required_layout=required_layout)
    ''')
    result = kv_run("-k", "kv_l4 or kv_l3", *SDPA)
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines([
        "*KV-L4 violated*TORCH_SDPA*layout=BLHNC*pinned layout BLHNC contradicts "
        "indexes_kv_by_block_stride()=False, but resolution accepted it: returned LBNHC*"])


def test_l5_silent_assertion_fails(kv_run, pytester: pytest.Pytester) -> None:
    pytester.makeconftest('''
        import pytest
        from vllm_omni.diffusion.diffusion_kv import layout as omni_layout

        @pytest.fixture(autouse=True)
        def _plant(monkeypatch):
            monkeypatch.setattr(omni_layout, "assert_backend_layout_supported",
                                lambda vllm_config, attn_backend: None)
    ''')
    result = kv_run("-k", "kv_l5", *SDPA)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*KV-L5 violated*TORCH_SDPA*stayed silent for layout BLHNC*"])


def test_l6_block_stride_backend_fails_on_the_control_plane(kv_run,
                                                            pytester: pytest.Pytester) -> None:
    """The True branches of L3-L5 hold; only the production wiring drops the flag."""
    pytester.makeconftest(FAKE_BLOCK_STRIDE)
    result = kv_run("-k", "(kv_l3 or kv_l4 or kv_l5 or kv_l6) and not seam",
                    "--kv-backend", "FAKE_BS")
    result.assert_outcomes(failed=1, passed=3)
    result.stdout.fnmatch_lines([
        "*KV-L6 violated*FAKE_BS*the control plane never receives indexes_kv_by_block_stride;"
        " pinned LBNHC for a backend that needs a block-outermost layout*",
        "*expected: 'a block-outermost layout'*", "*actual:   'LBNHC'*"])


def test_l3_to_l6_pass_unpatched(kv_run) -> None:
    result = kv_run("-k", "(kv_l3 or kv_l4 or kv_l5 or kv_l6) and not seam", *SDPA)
    result.assert_outcomes(passed=4)


def test_l6_seam_reports_the_wiring_gap_for_need_true_only(kv_run) -> None:
    """vllm-omni 0.30's control plane drops the flag: need_True fails, need_False passes."""
    result = kv_run("-k", "kv_l6_seam")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["*KV-L6 violated [[]backend=need_True, layout=LBNHC[]]: the "
                                 "control plane never receives indexes_kv_by_block_stride*"])


def test_l7_skips_with_reason(kv_run, pytester: pytest.Pytester) -> None:
    pytester.makeconftest(FAKE_BLOCK_STRIDE)
    result = kv_run("-rs", "-k", "kv_l7", "--kv-device", "cpu", "--kv-backend", "FAKE_BS",
                    "--kv-backend", "FLASH_ATTN")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines_random([
        "*KV-L7: the backend does not declare supports_paged_kv*",
        "*KV-L7: needs the backend's kernel device (CUDA)*"])


# Aliases mapped, the variable honoured, workers compare layouts rather than
# spellings: what the contract asks of vllm-omni.
CONFORMING_L8 = '''
import os

import pytest
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm_omni.diffusion.diffusion_kv import layout as omni_layout

ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}
ORIGINAL = omni_layout.resolve_diffusion_kv_cache_layout


def member(name):
    try:
        return KVCacheLayout[ALIASES.get(name, name)]
    except KeyError:
        raise ValueError(f"unknown KV cache layout {name!r}") from None


def resolve(vllm_config, *, indexes_kv_by_block_stride=False, required_layout=None):
    need = bool(indexes_kv_by_block_stride)
    cache_config = vllm_config.cache_config
    current = cache_config.kv_cache_layout
    source = "CacheConfig.kv_cache_layout"
    if current is None and os.environ.get("VLLM_KV_CACHE_LAYOUT"):
        current, source = os.environ["VLLM_KV_CACHE_LAYOUT"], "VLLM_KV_CACHE_LAYOUT"
    if current is None or required_layout is not None:
        return ORIGINAL(vllm_config, indexes_kv_by_block_stride=need,
                        required_layout=required_layout)
    layout = member(current)
    if layout.is_block_outermost != need:
        raise ValueError(f"{source}={current} ({layout.name}) contradicts the backend")
    if cache_config.kv_cache_layout is None:
        cache_config.kv_cache_layout = layout.name
    return layout


def adopt(vllm_config, kv_cache_config):
    name = kv_cache_config.kv_cache_layout
    current = vllm_config.cache_config.kv_cache_layout
    if current is None:
        vllm_config.cache_config.kv_cache_layout = name
    elif member(current) is not member(name):
        raise ValueError(f"worker layout {current!r} disagrees with {name!r}")
    return member(name)


@pytest.fixture(autouse=True)
def _plant(monkeypatch):
    monkeypatch.setattr(omni_layout, "resolve_diffusion_kv_cache_layout", resolve)
    monkeypatch.setattr(omni_layout, "adopt_kv_cache_layout", adopt)
'''


def test_l8_fails_unpatched_with_named_aliases_and_variable(kv_run) -> None:
    before = os.environ.get("VLLM_KV_CACHE_LAYOUT")
    result = kv_run("-k", "kv_l8", *SDPA)
    result.assert_outcomes(failed=3, passed=1)
    result.stdout.fnmatch_lines_random([
        "*KV-L8 violated*'HND' (upstream's legacy alias for LBHNC) must be honoured as LBHNC, "
        "but it refused it and raised a bare KeyError('HND')*",
        "*KV-L8 violated*worker whose CacheConfig.kv_cache_layout='NHD' (alias of LBNHC) must "
        "adopt*disagrees*",
        "*KV-L8 violated*VLLM_KV_CACHE_LAYOUT=LBHNC*must be honoured, but it was silently "
        "ignored: diffusion resolution pinned LBNHC*",
    ])
    assert os.environ.get("VLLM_KV_CACHE_LAYOUT") == before  # the check restored it


def test_l8_passes_when_resolution_conforms(kv_run, pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFORMING_L8)
    result = kv_run("-k", "kv_l8", *SDPA)
    result.assert_outcomes(passed=4)


def test_l6_stand_in_override_is_restored(kv_run) -> None:
    """The seam's stand-in is plugged in as a registry override only for the call."""
    from vllm_omni.diffusion.attention.backends.registry import DiffusionAttentionBackendEnum

    kv_run("-k", "kv_l6_seam")
    assert not DiffusionAttentionBackendEnum.TORCH_SDPA.is_overridden()
