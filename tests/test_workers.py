"""The KV-A worker harness: spawned processes, pool reuse, death, clean shutdown.

Pools here preload nothing, so a worker starts in about a second; the suite's
pool preloads vLLM / vllm-omni instead.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from pytest_kvconform import workers


@pytest.fixture(scope="module")
def pool():
    p = workers.WorkerPool(preload=())
    yield p
    p.close()


def test_workers_are_spawned_processes_reused_per_slot(pool: workers.WorkerPool) -> None:
    first, second = pool.get(["cpu", "cpu"])
    assert first.start_method == "spawn"
    pids = {first.ping()["pid"], second.ping()["pid"]}
    assert len(pids) == 2 and os.getpid() not in pids
    again = pool.get(["cpu"])[0]
    assert again is first and again.ping()["pid"] == first.pid
    assert workers.WorkerPool.keys(["cpu", "cuda:0", "cpu"]) == [
        ("cpu", 0), ("cuda:0", 0), ("cpu", 1)]


def test_a_dead_worker_fails_its_request_with_stderr_and_is_replaced(
        pool: workers.WorkerPool) -> None:
    handle = pool.get(["cpu"])[0]
    old_pid = handle.pid
    with pytest.raises(workers.WorkerDied) as info:
        handle.request("crash", code=7, text="kvconform-test: segfault stand-in")
    message = str(info.value)
    assert "exit code 7" in message
    assert "kvconform-test: segfault stand-in" in message
    replacement = pool.get(["cpu"])[0]
    assert replacement is not handle and replacement.ping()["pid"] != old_pid
    assert pool.replaced == 1


def test_a_command_that_raises_reports_the_worker_traceback(pool: workers.WorkerPool) -> None:
    handle = pool.get(["cpu"])[0]
    with pytest.raises(workers.WorkerCommandError, match="unknown worker command 'nope'"):
        handle.request("nope")
    with pytest.raises(workers.WorkerCommandError, match="write_pattern before"):
        handle.write_pattern([(0, 0)])
    assert handle.ping()["pid"] == handle.pid  # still serving


def test_close_leaves_no_process_behind() -> None:
    own = workers.WorkerPool(preload=())
    handles = own.get(["cpu", "cpu"])
    own.close()
    assert not any(h.alive for h in handles)
    assert not os.path.exists(own.workdir)


def test_shared_pool_closes_with_the_last_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    closed: list[bool] = []
    monkeypatch.setattr(workers, "_holds", 0)
    monkeypatch.setattr(workers, "close_pool", lambda: closed.append(True))
    workers.hold()
    workers.hold()
    workers.release()
    assert closed == []
    workers.release()
    assert closed == [True]


def test_page_pattern_tells_pages_ranks_and_cells_apart() -> None:
    shape = (2, 16, 32)
    a = workers.page_pattern(0, 0, 0, shape)
    assert a.dtype == np.uint8 and a.shape == shape and a.min() >= 1
    others = [workers.page_pattern(1, 0, 0, shape), workers.page_pattern(0, 1, 0, shape),
              workers.page_pattern(0, 0, 1, shape)]
    assert all(not np.array_equal(a, o) for o in others)
    assert not np.array_equal(a[0], a[1])  # heads differ within a page
    assert len(np.unique(a[0, :, 0])) == 16  # tokens differ within a page
