"""KV-V5: a customised page on real vLLM backends, clean and with its faults."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from pytest_kvconform.checks import vllm_spec
from pytest_kvconform.checks.errors import ClauseFailure, ClauseSkip, SkipKind
from pytest_kvconform.faults import vllm_plants
from tests.checks.vllm_backends import vllm_backend
from tests.seeding import Seeder


@pytest.mark.parametrize("name", ["ROCM_ATTN", "B12X", "TRITON_ATTN", "TURBOQUANT",
                                  "FLASHINFER"])
def test_repacked_pages_are_sized_and_addressed_as_the_oracle_says(name: str) -> None:
    """A plain page repacked (ROCM_ATTN, B12X) and quantised pages (per-token-head scales,
    TurboQuant's packed slots, NVFP4's head slots)."""
    vllm_spec.check_kv_v5(vllm_backend(name))


def test_an_unchanged_page_is_a_skip_with_a_reason() -> None:
    with pytest.raises(ClauseSkip) as caught:
        vllm_spec.check_kv_v5(vllm_backend("CPU_ATTN"))
    assert caught.value.kind is SkipKind.NOT_APPLICABLE
    assert "customize_spec leaves a plain bfloat16 attention page unchanged, and the page of " \
        "every quantised KV-cache dtype it supports (fp8, fp8_e4m3, fp8_e5m2)" \
        in str(caught.value)


def test_a_missized_page_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = vllm_backend(vllm_plants.REPACKING)
    Seeder(monkeypatch).plant(vllm_plants.CUSTOMIZE_MISSIZES_PAGE.patches)
    with pytest.raises(ClauseFailure) as caught:
        vllm_spec.check_kv_v5(backend)
    assert str(caught.value).startswith(
        "KV-V5 violated [backend=ROCM_ATTN]: customize_spec (num_head_slots=2, "
        "state_content_bytes=511) repacks an unquantised page into 32704 bytes, but its K "
        "and V data are 32768 bytes"), str(caught.value)


def test_a_quantised_page_without_room_for_its_scales_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """TRITON_ATTN's per-token-head page packed as if it had no scales."""
    backend = vllm_backend("TRITON_ATTN")

    def make(original: Any) -> Any:
        def customize_spec(cls: Any, spec: Any) -> Any:
            out = original.__func__(cls, spec)
            if out.state_content_bytes is None:
                return out
            data = (spec.head_size + spec.head_size_v) * spec.dtype.itemsize
            return dataclasses.replace(out, state_content_bytes=data)
        return classmethod(customize_spec)

    Seeder(monkeypatch).wrap(
        "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend.customize_spec", make)
    with pytest.raises(ClauseFailure) as caught:
        vllm_spec.check_kv_v5(backend)
    assert str(caught.value).startswith(
        "KV-V5 violated [backend=TRITON_ATTN]: customize_spec (kv-cache dtype "
        "int8_per_token_head: state_content_bytes=128) packs a page of 16384 bytes, too small "
        "for its data: 4 heads x 32 tokens x (8-bit K + 8-bit V) x 64 = 16384 bytes, plus 256 "
        "bytes of per-token-head scales"), str(caught.value)
