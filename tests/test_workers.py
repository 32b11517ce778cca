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
    for handle in (first, second):  # as the child itself sees it: a spawned child of ours
        for info in (handle.info, handle.ping()):
            assert info["pid"] == handle.pid != os.getpid()
            assert info["ppid"] == os.getpid()
            assert info["has_parent_process"] is True
            assert info["start_method"] == "spawn"
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


def test_broadcast_drains_every_reply_before_raising(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 dies; rank 1's reply is read anyway, so its next request is not off by one."""
    own = workers.WorkerPool(preload=())
    try:
        dying, living = own.get(["cpu", "cpu"])
        monkeypatch.setattr(dying, "send_adopt",
                            lambda frames, rank, **o: dying.send({"cmd": "crash", "code": 5}))
        monkeypatch.setattr(living, "send_adopt",  # answers None, unlike the ping that follows
                            lambda frames, rank, **o: living.send({"cmd": "release"}))
        with pytest.raises(workers.WorkerDied, match="exit code 5"):
            workers.broadcast_adopt([dying, living], [b""])
        assert living.ping()["pid"] == living.pid
    finally:
        own.close()


def test_active_fault_is_validated_and_names_the_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(workers.FAULT_ENV, raising=False)
    assert workers.active_fault() is None
    monkeypatch.setenv(workers.FAULT_ENV, "")
    assert workers.active_fault() is None
    for fault in workers.FAULTS:
        monkeypatch.setenv(workers.FAULT_ENV, fault)
        assert workers.active_fault() == fault
    monkeypatch.setenv(workers.FAULT_ENV, "wrong_ofset")
    with pytest.raises(ValueError, match=r"\$KVCONFORM_WORKER_FAULT='wrong_ofset'.*wrong_offset"):
        workers.active_fault()


def test_rank_placements_give_each_cuda_rank_its_own_gpu_id() -> None:
    ids = ["0", "1", "2", "3"]
    assert workers.rank_placements(2, "cpu", ids, {}) == ["cpu", "cpu"]
    # no xdist: every GPU visible here, this process on cuda:2
    assert workers.rank_placements(2, "cuda:2", ids, {}) == ["gpu:2", "gpu:0"]
    # an xdist worker narrowed to GPU 1 (a world-size-2 case must not ask for cuda:1)
    narrowed = {"CUDA_VISIBLE_DEVICES": "1"}
    assert workers.rank_placements(2, "cuda:0", ids, narrowed) == ["gpu:1", "gpu:0"]
    assert workers.rank_placements(1, "cuda:0", ids, narrowed) == ["gpu:1"]
    outer = {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}
    assert workers.rank_placements(2, "cuda:0", ["GPU-a", "GPU-b"], outer) == [
        "gpu:GPU-a", "gpu:GPU-b"]
    assert "needs 3 CUDA devices" in str(workers.rank_placements(3, "cuda:0", ids[:2], {}))
    assert workers.child_device("gpu:3") == ("cuda:0", "3")
    assert workers.child_device("cpu") == ("cpu", None)


def test_a_gpu_placed_worker_sees_only_its_gpu() -> None:
    """The child pins CUDA_VISIBLE_DEVICES itself (no torch here: nothing touches CUDA)."""
    own = workers.WorkerPool(preload=())
    try:
        (handle,) = own.get(["gpu:7"])
        info = handle.ping()
        assert info["cuda_visible_devices"] == "7" and info["device"] == "cuda:0"
        assert handle.device == "cuda:0" and handle.gpu_id == "7"
    finally:
        own.close()
