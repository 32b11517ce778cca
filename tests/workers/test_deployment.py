"""Where production's engine runs for KV-A, and the seams the harness adds to it.

The deployments themselves run in ``tests/seeded/test_adoption.py`` (inline suite runs);
here: the multiproc RPC envelope the test-process executor sends, the entry point a
result names, and that every seeded regression still finds the production statement it
rewrites in the installed vllm-omni (a regression that silently changed nothing would
make its test pass vacuously).
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_kvconform.adapters import (
    entry_points,
    executor_wire,
    fault_hook,
    source_rewrite,
)
from pytest_kvconform.faults import worker_faults
from pytest_kvconform.workers import deployment
from tests.conftest import needs_omni

pytestmark = needs_omni


class _Rank:
    """A stand-in for a KV-A worker handle: decodes the executor's frames, answers."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.alive = True
        self.got: list[dict[str, Any]] = []

    def send_rpc(self, frames: list[bytes]) -> None:
        self.got.append(executor_wire.decode(frames))

    def receive(self, what: str) -> Any:
        method = self.got[-1]["method"]
        return [f"{method}@{self.rank}"] if method == "get_kv_cache_specs" else self.rank


def _executor(ranks: list[_Rank]) -> Any:
    from pytest_kvconform.adapters.compat import production_od_config

    return deployment._pipe_executor_class()(production_od_config(world_size=len(ranks)),
                                             ranks)


def test_the_pipe_executor_sends_the_multiproc_envelope_and_gathers_as_its_worker() -> None:
    ranks = [_Rank(0), _Rank(1)]
    executor = _executor(ranks)
    assert executor.get_kv_cache_specs() == ["get_kv_cache_specs@0", "get_kv_cache_specs@1"]
    envelope = ranks[1].got[-1]
    assert {k: envelope[k] for k in ("type", "output_rank", "exec_all_ranks",
                                     "collect_rank_status")} == {
        "type": "rpc", "output_rank": 0, "exec_all_ranks": True, "collect_rank_status": False}
    executor.set_kv_cache_configs(["c0", "c1"], 64)  # every rank runs it, statuses collected
    sent = ranks[0].got[-1]
    assert sent["method"] == "set_kv_cache_configs" and sent["args"] == (["c0", "c1"], 64)
    assert (sent["output_rank"], sent["exec_all_ranks"], sent["collect_rank_status"]) == (
        0, True, True)
    assert executor.wire == "vllm MessageQueue.enqueue"  # the executor's own serialiser
    before = len(ranks[0].got)
    assert executor.collective_rpc("kvconform_report", unique_reply_rank=1) == 1
    assert len(ranks[0].got) == before  # rank 0 was not asked


def test_a_result_names_the_entry_point_that_ran() -> None:
    runner = entry_points.EntryPoint(entry_points.RUNNER, why_not_executor="import x fails")
    assert runner.chain(entry_points.UNI) == (
        "DiffusionModelRunner.set_kv_cache_config -> "
        "DiffusionKVModelRunnerBackend.initialize_kv_cache (DiffusionWorker and the "
        "executors cannot run here: import x fails)")
    assert entry_points.EntryPoint(entry_points.EXECUTOR).chain(entry_points.MP).startswith(
        "MultiprocDiffusionExecutor -> DiffusionWorker.set_kv_cache_configs -> ")
    assert entry_points.EntryPoint(entry_points.EXECUTOR).chain(entry_points.UNI).startswith(
        "UniProcDiffusionExecutor -> ")
    nothing = entry_points.EntryPoint("", why_not_runner="no platform")
    assert "nothing" in nothing.chain(entry_points.UNI)
    limited = entry_points.EntryPoint(entry_points.EXECUTOR, unmeasured="no accelerator for cpu")
    assert limited.chain(entry_points.MP) == (
        "MultiprocDiffusionExecutor -> DiffusionWorker.set_kv_cache_configs -> "
        "DiffusionModelRunner.set_kv_cache_config -> "
        "DiffusionKVModelRunnerBackend.initialize_kv_cache (DiffusionWorker's constructor "
        "cannot complete on this host: no accelerator for cpu; so it runs with that memory "
        "snapshot unmeasured, its one accelerator step, and the configured KV budget)")


@pytest.mark.parametrize("fault", sorted(set(worker_faults.REGRESSIONS) - {"shared_cache_config"}))
def test_each_regression_rewrites_a_statement_of_the_installed_production_code(
        fault: str) -> None:
    reason = worker_faults.applicable(fault)
    if reason is not None:
        pytest.skip(f"{fault}: {reason}")
    regression = worker_faults.REGRESSIONS[fault]
    owner, name = source_rewrite.owner(regression.target)
    original = vars(owner)[name]
    with source_rewrite.applied([regression]):
        rewritten = vars(owner)[name]
        assert rewritten is not original
        assert rewritten.__qualname__ == original.__qualname__
        assert rewritten.__code__.co_qualname == original.__code__.co_qualname
    assert vars(owner)[name] is original  # undone


def test_a_regression_whose_statement_is_gone_says_so() -> None:
    def initialize_kv_cache(self: Any) -> None:
        return None

    with pytest.raises(source_rewrite.SeedError, match="no longer has the statement"):
        source_rewrite.rewritten(initialize_kv_cache, [worker_faults.REGRESSIONS["skip_adoption"]],
                                 "X.initialize_kv_cache")


def test_an_unknown_fault_name_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fault_hook.FAULT_ENV, "skip_adoption,skip_adoptoin")
    with pytest.raises(ValueError, match="'skip_adoption,skip_adoptoin' is not a known"):
        fault_hook.active()
    monkeypatch.setenv(fault_hook.FAULT_ENV, "assert_layer_backends, skip_layer_assertion")
    assert fault_hook.names(fault_hook.active()) == ("assert_layer_backends",
                                                        "skip_layer_assertion")
