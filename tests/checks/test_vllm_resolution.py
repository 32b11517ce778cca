"""KV-V3: the oracle's rules, and the check on real vLLM backends, clean and with its fault."""

from __future__ import annotations

import pytest

from pytest_kvconform.checks import vllm_resolution
from pytest_kvconform.checks.errors import ClauseFailure
from pytest_kvconform.contract import vllm_oracle
from pytest_kvconform.contract.vllm_oracle import Expected
from pytest_kvconform.faults import vllm_plants
from tests.checks.vllm_backends import vllm_backend
from tests.seeding import Seeder

ALL = vllm_oracle.DEFAULT_PREFERENCE


def test_worker_layouts_intersect_in_preference_order() -> None:
    w = vllm_oracle.worker_layouts
    assert w([None]) == Expected(ALL)  # nothing declares: the default preference
    assert w([("LBHNC",), None]) == Expected(("LBHNC",))  # None contributes nothing
    assert w([("LHBNC", "LBHNC")] * 2) == Expected(("LHBNC", "LBHNC"))  # identical: kept
    # More first places first; ties in the enum's order (LBHNC before BLHNC).
    assert w([("BLHNC", "LBHNC"), ("LBNHC", "LBHNC", "BLHNC")]) == \
        Expected(("BLHNC", "LBHNC"))
    assert w([("LHBNC", "BLHNC", "LBHNC"), ("BHLNC", "BLHNC", "LBHNC")]) == \
        Expected(("LBHNC", "BLHNC"))
    assert w([("LBHNC",), ("LBNHC",)]).refused


def test_resolution_rules() -> None:
    r = vllm_oracle.resolve
    ranks = [("LHBNC", "LBHNC")]
    assert r(ranks) == Expected("LHBNC")
    assert r(ranks, mixed_pages=True) == Expected("LBHNC")  # LHBNC is not block-compact
    assert r([("LHBNC",)], mixed_pages=True).refused
    assert r(ranks, env="HND") == Expected("LBHNC")  # the alias
    assert r(ranks, env="NHD").refused  # hard
    assert r(ranks, connector="NHD") == Expected("LHBNC")  # soft
    assert r(ranks, connector="LBHNC") == Expected("LBHNC")
    assert r(ranks, env="LHBNC", connector="LBHNC") == Expected("LHBNC")  # env over connector
    assert r(ranks, pinned="BHLNC", env="LBHNC") == Expected("BHLNC")  # pinned wins outright
    assert r([("LBHNC",), ("LBNHC",)]).refused
    assert r([("LBHNC",), ("LBHNC",)]) == Expected("LBHNC")
    with pytest.raises(ValueError, match="unknown"):
        vllm_oracle.canonical("XYZ")


def test_scenarios_cover_every_rule() -> None:
    labels = [label for label, _, _ in vllm_resolution.resolve_scenarios(
        "X", ("LBHNC",), {"Y": ("LBNHC",), "Z": None})]
    text = "\n".join(labels)
    for needle in ("one rank", "identical", "disagree", "mixed page shapes",
                   "VLLM_KV_CACHE_LAYOUT=NHD", "VLLM_KV_CACHE_LAYOUT=HND", "connector preferring",
                   "already pinned to HND", "with a connector preferring"):
        assert needle in text, needle


@pytest.mark.parametrize("name", ["CPU_ATTN", "FLEX_ATTENTION", "ROCM_ATTN", "TRITON_ATTN",
                                  "TRITON_FLASH_ATTN"])
def test_real_backends_resolve_as_the_contract_says(name: str) -> None:
    """Declarations of each kind: one layout, two, all six, and None (TRITON_ATTN)."""
    vllm_resolution.check_kv_v3(vllm_backend(name))


def test_resolution_ignoring_the_env_var_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = vllm_backend(vllm_plants.BACKEND)
    Seeder(monkeypatch).plant(vllm_plants.RESOLUTION_IGNORES_ENV.patches)
    with pytest.raises(ClauseFailure) as caught:
        vllm_resolution.check_kv_v3(backend)
    message = str(caught.value)
    assert message.startswith("KV-V3 violated [backend=CPU_ATTN]: CPU_ATTN: "
                              "VLLM_KV_CACHE_LAYOUT=LBNHC: expected refused"), message
    assert "production's resolve_kv_cache_layout gave LBHNC" in message
    assert "more differences" in message


def _declaring(*names: str) -> type:
    """A class declaring ``names`` (as production reads a backend's declaration)."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layouts = tuple(KVCacheLayout[n] for n in names)

    class Declares:
        @classmethod
        def supported_kv_cache_layouts(cls) -> tuple[object, ...]:
            return layouts

    return Declares


def test_production_breaks_ties_as_the_oracle_does() -> None:
    """Both prefer BLHNC to LBHNC, yet only first places count: the enum's order decides
    the rest (vLLM's documented rule; the oracle follows it)."""
    from pytest_kvconform.adapters import vllm_layout

    pytest.importorskip("vllm.v1.kv_cache_layout")
    first, second = ("LHBNC", "BLHNC", "LBHNC"), ("BHLNC", "BLHNC", "LBHNC")
    got = vllm_layout.worker_layouts([_declaring(*first), _declaring(*second)])
    assert got.value == vllm_oracle.worker_layouts([first, second]).value == ("LBHNC", "BLHNC")


class _Raises:
    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[object, ...]:
        raise RuntimeError("not ready")


class _NamesNoLayout:
    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[object, ...]:
        return ("NHD",)


@pytest.mark.parametrize(("cls", "says"), [
    (_Raises, "supported_kv_cache_layouts() raised RuntimeError: not ready (see KV-V2)"),
    (_NamesNoLayout, "supported_kv_cache_layouts() names ['NHD'], no KVCacheLayout member"),
])
def test_a_declaration_that_cannot_be_resolved_fails_naming_it(cls: type, says: str) -> None:
    from pytest_kvconform.contract.records import BackendUnderTest

    pytest.importorskip("vllm.v1.attention.backends.utils")
    backend = BackendUnderTest(name="ODD", path=f"{__name__}:{cls.__qualname__}",
                               source="registry", cls=cls)
    with pytest.raises(ClauseFailure) as caught:
        vllm_resolution.check_kv_v3(backend)
    assert str(caught.value).startswith(f"KV-V3 violated [backend=ODD]: {says}"), \
        str(caught.value)
