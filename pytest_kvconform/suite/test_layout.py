"""KV-L: the layout contract, per backend."""

from __future__ import annotations

from typing import Any

import pytest

from pytest_kvconform.checks import layout
from pytest_kvconform.contract.records import BackendUnderTest
from pytest_kvconform.suite.check_call import run_check

# user_properties key: which layouts x cases KV-L7 covered, and which did not apply.
L7_COVERAGE_PROPERTY = "kv_l7_coverage"


def test_kv_l1(request: pytest.FixtureRequest, kv_backend: BackendUnderTest) -> None:
    """KV-L1 declaration."""
    run_check(request, layout.check_kv_l1, kv_backend)


def test_kv_l2(request: pytest.FixtureRequest, kv_backend: BackendUnderTest) -> None:
    """KV-L2 resolution."""
    run_check(request, layout.check_kv_l2, kv_backend)


def test_kv_l3(request: pytest.FixtureRequest, kv_backend: BackendUnderTest) -> None:
    """KV-L3 precedence: every consistent layout, pinned or connector-required."""
    run_check(request, layout.check_kv_l3, kv_backend)


def test_kv_l4(request: pytest.FixtureRequest, kv_backend: BackendUnderTest) -> None:
    """KV-L4 contradiction: every contradictory layout, pinned or connector-required."""
    run_check(request, layout.check_kv_l4, kv_backend)


def test_kv_l5_unresolved(request: pytest.FixtureRequest, kv_backend: BackendUnderTest) -> None:
    """KV-L5 assert_backend_layout_supported is silent while the layout is unresolved."""
    run_check(request, layout.check_kv_l5_unresolved, kv_backend)


def test_kv_l5_consistent(request: pytest.FixtureRequest, kv_backend: BackendUnderTest) -> None:
    """KV-L5 assert_backend_layout_supported passes every consistent layout."""
    run_check(request, layout.check_kv_l5_consistent, kv_backend)


def test_kv_l5_contradiction(request: pytest.FixtureRequest,
                             kv_backend: BackendUnderTest) -> None:
    """KV-L5 assert_backend_layout_supported raises for every contradicting layout."""
    run_check(request, layout.check_kv_l5_contradiction, kv_backend)


def test_kv_l6(request: pytest.FixtureRequest, kv_backend: BackendUnderTest,
               kv_workers: Any) -> None:
    """KV-L6 production wiring: what production's engine pins, and its worker allocates."""
    run_check(request, layout.check_kv_l6, kv_backend, kv_workers.for_world_size(1))


def test_kv_l6_seam(request: pytest.FixtureRequest, kv_need: bool, kv_workers: Any) -> None:
    """KV-L6 for each need (False/True), through a stand-in backend declaring it."""
    run_check(request, layout.check_kv_l6, layout.seam_backend(kv_need),
              kv_workers.for_world_size(1))


def test_kv_l7(request: pytest.FixtureRequest, kv_backend: BackendUnderTest,
               kv_device: str) -> None:
    """KV-L7 paged read path against a dense reference, on the backend's kernel device."""

    def check(backend: BackendUnderTest, device: str) -> None:
        covered = layout.check_kv_l7(backend, device)
        request.node.user_properties.append((L7_COVERAGE_PROPERTY, covered))

    run_check(request, check, kv_backend, kv_device)


def test_kv_l8_canonical_honoured(request: pytest.FixtureRequest,
                                  kv_backend: BackendUnderTest) -> None:
    """KV-L8 consistent canonical layout names pinned by the user are honoured."""
    run_check(request, layout.check_kv_l8_canonical_honoured, kv_backend)


def test_kv_l8_canonical_refused(request: pytest.FixtureRequest,
                                 kv_backend: BackendUnderTest) -> None:
    """KV-L8 contradicting canonical layout names pinned by the user are refused."""
    run_check(request, layout.check_kv_l8_canonical_refused, kv_backend)


def test_kv_l8_alias(request: pytest.FixtureRequest, kv_backend: BackendUnderTest) -> None:
    """KV-L8 legacy aliases (NHD, HND) pinned on the control plane."""
    run_check(request, layout.check_kv_l8_alias, kv_backend)


def test_kv_l8_worker_disagreement(request: pytest.FixtureRequest,
                                   kv_backend: BackendUnderTest) -> None:
    """KV-L8 a worker pinned to another layout than the control plane's refuses it."""
    run_check(request, layout.check_kv_l8_worker_disagreement, kv_backend)


def test_kv_l8_worker_alias(request: pytest.FixtureRequest,
                            kv_backend: BackendUnderTest) -> None:
    """KV-L8 a worker pinned to an alias of the control plane's layout."""
    run_check(request, layout.check_kv_l8_worker_alias, kv_backend)


def test_kv_l8_env_honoured(request: pytest.FixtureRequest, kv_backend: BackendUnderTest,
                            kv_device: str) -> None:
    """KV-L8 VLLM_KV_CACHE_LAYOUT consistent with the backend is honoured."""
    run_check(request, layout.check_kv_l8_env_honoured, kv_backend, kv_device)


def test_kv_l8_env_refused(request: pytest.FixtureRequest, kv_backend: BackendUnderTest,
                           kv_device: str) -> None:
    """KV-L8 VLLM_KV_CACHE_LAYOUT contradicting the backend is refused."""
    run_check(request, layout.check_kv_l8_env_refused, kv_backend, kv_device)
