"""Deployments started ahead (``session/ahead.py``, ``workers/deployment.py``): a check gets
the one started for it, a wrong plan is cancelled and changes no result, and reserved
workers go to no other test.  Real KV-A workers (the shared pool), real deployments."""

from __future__ import annotations

import time
import types
from collections.abc import Iterator
from typing import Any

import pytest

from pytest_kvconform.adapters import seeds
from pytest_kvconform.checks import adoption, adoption_bytes
from pytest_kvconform.contract.cases import load_cases
from pytest_kvconform.contract.outcomes import ClauseFailure
from pytest_kvconform.contract.records import Case
from pytest_kvconform.workers import deployment
from pytest_kvconform.workers import pool as workers
from tests.conftest import needs_omni

pytestmark = [needs_omni, pytest.mark.usefixtures("shared_workers")]



@pytest.fixture
def case() -> Case:
    return next(c for c in load_cases() if c.id == "bf16_h8")


@pytest.fixture
def reserved() -> Iterator[Any]:
    """``reserve(test)``: ready CPU workers set aside for ``test``; nothing left running
    or reserved afterwards."""
    def reserve(test: str) -> list[workers.WorkerHandle]:
        workers.pool().get(["cpu"])  # one ready set at least
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until one has closed its last deployment
            handles = workers.pool().reserve(["cpu"], test)
            if handles is not None:
                return handles
            time.sleep(0.05)
        raise AssertionError("no idle, ready worker to reserve within 30 s")

    yield reserve
    workers.running(None)
    deployment.cancel_ahead()


def _as(test: str) -> list[workers.WorkerHandle]:
    """The workers ``test`` gets from the pool (as its ``kv_workers`` would)."""
    workers.running(test)
    return workers.pool().get(["cpu"])


def test_a_check_gets_the_deployment_started_ahead_for_it(reserved: Any, case: Case) -> None:
    handles = reserved("t1")
    plan = adoption.planned(adoption.check_kv_a1, False, case, handles)
    assert plan is not None and plan.control is None and plan.spec.case == case
    assert plan.start_ahead("t1")
    before = deployment.ahead_counts()
    got = _as("t1")
    assert got == handles
    adoption.check_kv_a1(False, case, got)  # passes on the deployment started ahead
    after = deployment.ahead_counts()
    assert (after["claimed"] - before["claimed"], after["cancelled"] - before["cancelled"]) \
        == (1, 0)
    assert deployment.started_ahead() == 0


def test_a_wrong_plan_is_cancelled_and_changes_no_result(reserved: Any, case: Case) -> None:
    """The skip-adoption control's deployment started for a test that runs KV-A1 instead:
    KV-A1 still passes, on a deployment of its own."""
    handles = reserved("t2")
    plan = adoption.planned(adoption.check_kv_a4_unadopted, False, case, handles)
    assert plan is not None and plan.control == "skip_adoption"
    assert plan.start_ahead("t2")
    before = deployment.ahead_counts()
    adoption.check_kv_a1(False, case, _as("t2"))
    after = deployment.ahead_counts()
    assert (after["claimed"] - before["claimed"], after["cancelled"] - before["cancelled"]) \
        == (0, 1)


def test_reserved_workers_go_to_no_other_test(reserved: Any) -> None:
    handles = reserved("mine")
    assert not set(_as("another")) & set(handles)
    assert _as("mine") == handles  # and the reservation ends there
    assert all(h.reserved_for is None for h in handles)


def test_a_check_that_would_skip_or_fail_plans_nothing(case: Case) -> None:
    """Planning runs the check only up to its first deploy; a skip before it plans none."""
    one_rank = next(c for c in load_cases() if c.world_size == 1)
    assert adoption.planned(adoption_bytes.check_kv_a5, False, one_rank, []) is None  # skips
    assert adoption.planned(adoption.check_kv_a1, False, case, []) is None  # no workers


def test_a_suite_run_claims_every_deployment_it_started(kv_run: Any) -> None:
    """How many start ahead depends on how soon the workers are ready; each one is used."""
    before = deployment.ahead_counts()
    result = kv_run("--kv-backend", "FLASH_ATTN", "-k", "(kv_a1 or kv_a4) and bf16_h8")
    result.assert_outcomes(passed=9, failed=3)  # the contradiction control: a known finding
    after = {k: v - before[k] for k, v in deployment.ahead_counts().items()}
    assert after["started"] >= 1 and after["claimed"] == after["started"], after
    assert after["cancelled"] == 0



def test_off_starts_nothing_ahead_and_changes_no_result(kv_run: Any) -> None:
    """--kv-ahead off: each deployment starts when its check asks; the same outcomes."""
    before = deployment.ahead_counts()
    result = kv_run("--kv-backend", "FLASH_ATTN", "-k", "(kv_a1 or kv_a4) and bf16_h8",
                    "--kv-ahead", "off")
    result.assert_outcomes(passed=9, failed=3)
    assert deployment.ahead_counts() == before


def test_a_bad_ahead_value_is_one_usage_error(kv_run: Any) -> None:
    result = kv_run("--kv-ahead", "sometimes")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kv-ahead: 'sometimes' is not one of on, off*"])


def test_a_seeded_fault_counts_for_the_test_that_uses_the_deployment(
        reserved: Any, case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sent ahead under a seeded fault, the commands are the claiming test's, not the one
    running when they were sent (a result speaks for the faults its own commands ran under)."""
    monkeypatch.setenv(seeds.ENV, "unstamped_configs")
    handles = reserved("t3")
    plan = adoption.planned(adoption.check_kv_a1, False, case, handles)
    before = workers.faulted_commands()
    assert plan is not None and plan.start_ahead("t3")
    assert workers.faults_since(before) == []
    with pytest.raises(ClauseFailure, match="not stamped"):
        adoption.check_kv_a1(False, case, _as("t3"))
    assert workers.faults_since(before) == ["unstamped_configs"]


def test_the_coming_tests_are_the_runs_order_or_xdists_next_one() -> None:
    from pytest_kvconform.session.ahead import LOOKAHEAD, Ahead

    items = [types.SimpleNamespace(nodeid=f"t{i}") for i in range(LOOKAHEAD + 5)]
    ahead = Ahead("cpu", [], items)  # type: ignore[arg-type]
    assert ahead.upcoming(items[0], items[1]) == items[1:LOOKAHEAD + 1]  # type: ignore[arg-type]
    assert ahead.upcoming(items[0], items[7]) == [items[7]]  # type: ignore[arg-type]
    assert ahead.upcoming(items[-1], None) == []  # type: ignore[arg-type]


def test_each_deployment_meets_on_the_port_the_harness_handed_it(case: Case) -> None:
    """Two deployments in turn on one worker: each rank met on a port of the harness's own
    (below the kernel's ephemeral range), the second on its own, not the one the first
    left in the worker's environment (production reads ``$MASTER_PORT`` first)."""
    from pytest_kvconform.adapters import worker_seams

    handles = workers.pool().get(["cpu"])
    plan = adoption.planned(adoption.check_kv_a1, False, case, handles)
    assert plan is not None and plan.spec.topology == "uni"
    met = []
    for _ in range(2):
        deployed = deployment.start(plan.spec, handles, control=plan.control, prepin=plan.prepin)
        try:
            met.append([rank["master_port"] for rank in deployed.report.ranks])
        finally:
            deployed.close()
    ports = worker_seams.rendezvous_ports()
    assert ports is not None and all(port in ports for ranks in met for port in ranks), met
    assert met[0] != met[1], met
