"""KV-A: control plane to worker adoption, per backend (and per need) x world size.

``test_kv_aN`` runs for every backend's declared need; ``test_kv_aN_seam`` once
per need (False, True) through the control plane's explicit seam, so the
block-outermost path runs end to end even while no backend declares it.  Each
stands up production's engine on the ``kv_workers`` processes (``workers/deployment.py``).
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_kvconform.checks import adoption, adoption_bytes
from pytest_kvconform.contract import clauses
from pytest_kvconform.contract.records import BackendUnderTest, Case
from pytest_kvconform.suite.check_call import run_check

# The case predicates live in the clause table (``with_args``: a lone function would be
# taken as the decorated test).
world_sizes = pytest.mark.kv_cases.with_args(clauses.adoption_case)
multi_rank = pytest.mark.kv_cases.with_args(clauses.adoption_multi_rank)
single_rank = pytest.mark.kv_cases.with_args(clauses.adoption_single_rank)


def _ranks(kv_workers: Any, case: Case) -> Any:
    return kv_workers.for_world_size(case.world_size)


@world_sizes
def test_kv_a1(request: pytest.FixtureRequest, kv_backend: BackendUnderTest, kv_case: Case,
               kv_workers: Any) -> None:
    """KV-A1 pinned before sizing, stamped on every config."""
    run_check(request, adoption.check_kv_a1, kv_backend, kv_case, _ranks(kv_workers, kv_case))


@world_sizes
def test_kv_a1_seam(request: pytest.FixtureRequest, kv_need: bool, kv_case: Case,
                    kv_workers: Any) -> None:
    """KV-A1 through the explicit seam."""
    run_check(request, adoption.check_kv_a1, kv_need, kv_case, _ranks(kv_workers, kv_case))


@world_sizes
def test_kv_a2(request: pytest.FixtureRequest, kv_backend: BackendUnderTest, kv_case: Case,
               kv_workers: Any) -> None:
    """KV-A2 real process boundary, executor serialisation, unpinned worker."""
    run_check(request, adoption.check_kv_a2, kv_backend, kv_case, _ranks(kv_workers, kv_case))


@world_sizes
def test_kv_a2_seam(request: pytest.FixtureRequest, kv_need: bool, kv_case: Case,
                    kv_workers: Any) -> None:
    """KV-A2 through the explicit seam."""
    run_check(request, adoption.check_kv_a2, kv_need, kv_case, _ranks(kv_workers, kv_case))


@world_sizes
def test_kv_a3(request: pytest.FixtureRequest, kv_backend: BackendUnderTest, kv_case: Case,
               kv_workers: Any) -> None:
    """KV-A3 adopt, init_kv_cache on the worker's device, bytes at oracle offsets."""
    run_check(request, adoption_bytes.check_kv_a3, kv_backend, kv_case, _ranks(kv_workers, kv_case))


@world_sizes
def test_kv_a3_seam(request: pytest.FixtureRequest, kv_need: bool, kv_case: Case,
                    kv_workers: Any) -> None:
    """KV-A3 through the explicit seam."""
    run_check(request, adoption_bytes.check_kv_a3, kv_need, kv_case, _ranks(kv_workers, kv_case))


@world_sizes
def test_kv_a4_unadopted(request: pytest.FixtureRequest, kv_backend: BackendUnderTest,
                         kv_case: Case, kv_workers: Any) -> None:
    """KV-A4 negative control: a worker that skips adoption cannot allocate."""
    run_check(request, adoption.check_kv_a4_unadopted, kv_backend, kv_case,
              _ranks(kv_workers, kv_case))


@world_sizes
def test_kv_a4_unadopted_seam(request: pytest.FixtureRequest, kv_need: bool, kv_case: Case,
                              kv_workers: Any) -> None:
    """KV-A4 unadopted control through the explicit seam."""
    run_check(request, adoption.check_kv_a4_unadopted, kv_need, kv_case,
              _ranks(kv_workers, kv_case))


@world_sizes
def test_kv_a4_disagreement(request: pytest.FixtureRequest, kv_backend: BackendUnderTest,
                            kv_case: Case, kv_workers: Any) -> None:
    """KV-A4 negative control: a worker pinned elsewhere raises the disagreement error."""
    run_check(request, adoption.check_kv_a4_disagreement, kv_backend, kv_case,
              _ranks(kv_workers, kv_case))


@world_sizes
def test_kv_a4_disagreement_seam(request: pytest.FixtureRequest, kv_need: bool, kv_case: Case,
                                 kv_workers: Any) -> None:
    """KV-A4 disagreement control through the explicit seam."""
    run_check(request, adoption.check_kv_a4_disagreement, kv_need, kv_case,
              _ranks(kv_workers, kv_case))


@world_sizes
def test_kv_a4_contradiction(request: pytest.FixtureRequest, kv_backend: BackendUnderTest,
                             kv_case: Case, kv_workers: Any) -> None:
    """KV-A4 negative control: a layout contradicting the layers' backend is refused."""
    run_check(request, adoption.check_kv_a4_contradiction, kv_backend, kv_case,
              _ranks(kv_workers, kv_case))


@world_sizes
def test_kv_a4_contradiction_seam(request: pytest.FixtureRequest, kv_need: bool,
                                  kv_case: Case, kv_workers: Any) -> None:
    """KV-A4 contradiction control through the explicit seam."""
    run_check(request, adoption.check_kv_a4_contradiction, kv_need, kv_case,
              _ranks(kv_workers, kv_case))


@multi_rank
def test_kv_a5(request: pytest.FixtureRequest, kv_backend: BackendUnderTest, kv_case: Case,
               kv_workers: Any) -> None:
    """KV-A5 N > 1 ranks, each its own process and config."""
    run_check(request, adoption_bytes.check_kv_a5, kv_backend, kv_case, _ranks(kv_workers, kv_case))


@multi_rank
def test_kv_a5_seam(request: pytest.FixtureRequest, kv_need: bool, kv_case: Case,
                    kv_workers: Any) -> None:
    """KV-A5 through the explicit seam."""
    run_check(request, adoption_bytes.check_kv_a5, kv_need, kv_case, _ranks(kv_workers, kv_case))


def _a6(request: pytest.FixtureRequest, source: Any, case: Case, kv_workers: Any) -> None:
    from pytest_kvconform.plugin import kv_session

    fraction = kv_session(request.config).options.memory_fraction
    run_check(request, adoption_bytes.check_kv_a6, source, case, kv_workers.device,
              lambda: _ranks(kv_workers, case), fraction)


@single_rank
def test_kv_a6(request: pytest.FixtureRequest, kv_backend: BackendUnderTest, kv_case: Case,
               kv_workers: Any) -> None:
    """KV-A6 free-memory-sized allocation probed past 2^31 and 2^32 (CUDA)."""
    _a6(request, kv_backend, kv_case, kv_workers)


@single_rank
def test_kv_a6_seam(request: pytest.FixtureRequest, kv_need: bool, kv_case: Case,
                    kv_workers: Any) -> None:
    """KV-A6 through the explicit seam."""
    _a6(request, kv_need, kv_case, kv_workers)
