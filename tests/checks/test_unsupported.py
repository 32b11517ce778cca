"""Adapters name no clause: they raise ``Unsupported``, and the check that called them
reports the skip under its own clause (never another clause's, never a failure)."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import pytest

from pytest_kvconform.adapters import compat, control_plane
from pytest_kvconform.checks import adoption, nullblock
from pytest_kvconform.checks.common import Where, unsupported_as_skip
from pytest_kvconform.contract.outcomes import ClauseFailure, ClauseSkip, SkipKind, Unsupported
from pytest_kvconform.contract.records import Case

CASE = Case(id="padded", file="f", page_size_padded=4096)


@dataclass
class _SpecWithoutPadding:  # an AttentionSpec from a vLLM without page_size_padded
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: object


def test_attention_spec_without_padding_field_is_unsupported_not_a_clause_skip(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("vllm.v1.kv_cache_interface")
    fake.FullAttentionSpec = _SpecWithoutPadding  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.v1.kv_cache_interface", fake)
    monkeypatch.setattr(compat, "torch_dtype", lambda name: name)
    with pytest.raises(Unsupported) as info:
        compat.attention_spec(CASE)
    assert not isinstance(info.value, ClauseSkip)
    assert info.value.reason == "installed vLLM's AttentionSpec has no page_size_padded"
    assert info.value.kind is SkipKind.NOT_APPLICABLE


def test_the_check_attaches_its_own_clause() -> None:
    with pytest.raises(ClauseSkip) as info, unsupported_as_skip("KV-N2"):
        raise Unsupported("installed vLLM's AttentionSpec has no page_size_padded",
                          SkipKind.NOT_APPLICABLE)
    assert str(info.value) == "KV-N2: installed vLLM's AttentionSpec has no page_size_padded"
    assert info.value.kind is SkipKind.NOT_APPLICABLE


def test_control_plane_absent_is_unsupported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(control_plane.importlib, "import_module",
                        lambda name: types.SimpleNamespace())
    with pytest.raises(Unsupported, match="has no initialize_diffusion_kv_control_plane"):
        control_plane.run_production_control_plane(object(), [], [])


def test_nullblock_plan_reports_a_skip_as_its_clause_skip_not_a_failure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def unsupported(*args: object, **kwargs: object) -> None:
        raise Unsupported("installed vLLM's AttentionSpec has no page_size_padded",
                          SkipKind.NOT_APPLICABLE)

    monkeypatch.setattr(nullblock, "plan", unsupported)
    with pytest.raises(ClauseSkip) as info:
        nullblock._plan_or_fail(Where("KV-N3", case=CASE), [1 << 20], "auto-fit")
    assert info.value.clause == "KV-N3" and info.value.kind is SkipKind.NOT_APPLICABLE

    def skip(*args: object, **kwargs: object) -> None:
        raise ClauseSkip("KV-N3", "vllm-omni not installed")

    monkeypatch.setattr(nullblock, "plan", skip)
    with pytest.raises(ClauseSkip, match="vllm-omni not installed"):
        nullblock._plan_or_fail(Where("KV-N3", case=CASE), [1 << 20], "auto-fit")

    def refuse(*args: object, **kwargs: object) -> None:
        raise ValueError("no room")

    monkeypatch.setattr(nullblock, "plan", refuse)  # a real refusal still fails the clause
    with pytest.raises(ClauseFailure, match=r"KV-N3 violated.*refused auto-fit: ValueError"):
        nullblock._plan_or_fail(Where("KV-N3", case=CASE), [1 << 20], "auto-fit")


def test_kv_control_plane_fixture_skip_names_its_clause(monkeypatch: pytest.MonkeyPatch) -> None:
    def unsupported(*args: object, **kwargs: object) -> None:
        raise Unsupported("installed vllm-omni has no initialize_diffusion_kv_control_plane")

    monkeypatch.setattr(adoption, "build_control_plane", unsupported)
    with pytest.raises(ClauseSkip) as info:
        adoption.fixture_control_plane(True, CASE)
    assert info.value.clause == adoption.FIXTURE_CLAUSE
    assert info.value.kind is SkipKind.ENVIRONMENT
