"""KV-V5: a customised page on real vLLM backends, clean and with its fault."""

from __future__ import annotations

import pytest

from pytest_kvconform.checks import vllm_spec
from pytest_kvconform.checks.errors import ClauseFailure, ClauseSkip, SkipKind
from pytest_kvconform.faults import vllm_plants
from tests.checks.vllm_backends import vllm_backend
from tests.seeding import Seeder


@pytest.mark.parametrize("name", ["ROCM_ATTN", "B12X"])
def test_repacked_pages_are_sized_and_addressed_as_the_oracle_says(name: str) -> None:
    vllm_spec.check_kv_v5(vllm_backend(name))


def test_an_unchanged_page_is_a_skip_with_a_reason() -> None:
    with pytest.raises(ClauseSkip) as caught:
        vllm_spec.check_kv_v5(vllm_backend("CPU_ATTN"))
    assert caught.value.kind is SkipKind.NOT_APPLICABLE
    assert "customize_spec leaves a plain bfloat16 attention page unchanged" in str(caught.value)


def test_a_missized_page_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = vllm_backend(vllm_plants.REPACKING)
    Seeder(monkeypatch).plant(vllm_plants.CUSTOMIZE_MISSIZES_PAGE.patches)
    with pytest.raises(ClauseFailure) as caught:
        vllm_spec.check_kv_v5(backend)
    assert str(caught.value).startswith(
        "KV-V5 violated [backend=ROCM_ATTN]: customize_spec (num_head_slots=2, "
        "state_content_bytes=511) repacks an unquantised page into 32704 bytes, but its K "
        "and V data are 32768 bytes"), str(caught.value)
