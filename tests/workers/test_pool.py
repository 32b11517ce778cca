"""The KV-A worker harness: child processes, pool reuse, death, clean shutdown.

CPU workers fork from a preloaded fork server (``workers/forkserver.py``); GPU workers are
spawned.  Pools here preload nothing, so a worker starts in well under a second; the
suite's pool preloads vLLM / vllm-omni instead (in the fork server, once).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pytest_kvconform.adapters import fault_hook
from pytest_kvconform.adapters.worker_extension import page_pattern
from pytest_kvconform.faults import pid_marking, worker_faults
from pytest_kvconform.workers import fault_tally, forkserver, policy, protocol
from pytest_kvconform.workers import handle as handle_mod
from pytest_kvconform.workers import pool as workers

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pool():
    p = workers.WorkerPool(preload=())
    yield p
    p.close()


@pytest.fixture
def own() -> Iterator[workers.WorkerPool]:
    """A pool of this test's own, closed after it."""
    p = workers.WorkerPool(preload=())
    yield p
    p.close()


def _ppid_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[1])


def test_workers_are_forked_processes_reused_per_slot(pool: workers.WorkerPool) -> None:
    first, second = pool.get(["cpu", "cpu"])
    server = forkserver.pid()
    assert server is not None and server != os.getpid()
    if os.path.exists(f"/proc/{server}/stat"):  # the server is our own child
        assert _ppid_of(server) == os.getpid()
    for handle in (first, second):  # as the child itself sees it: forked by our fork server
        for info in (handle.info, handle.ping()):
            assert info["pid"] == handle.pid != os.getpid()
            assert info["ppid"] == server
            assert info["parent_pid"] == os.getpid()
            assert info["has_parent_process"] is True
            assert info["start_method"] == "forkserver"
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
    with pytest.raises(protocol.WorkerDied) as info:
        handle.request("crash", code=7, text="kvconform-test: segfault stand-in")
    message = str(info.value)
    assert "exit code 7" in message
    assert "kvconform-test: segfault stand-in" in message
    replacement = pool.get(["cpu"])[0]
    assert replacement is not handle and replacement.ping()["pid"] != old_pid
    assert pool.replaced == 1


def test_a_command_that_raises_reports_the_worker_traceback(pool: workers.WorkerPool) -> None:
    handle = pool.get(["cpu"])[0]
    with pytest.raises(protocol.WorkerCommandError, match="unknown worker command 'nope'"):
        handle.request("nope")
    with pytest.raises(protocol.WorkerCommandError, match="engine_call before engine_run"):
        handle.engine_call("kvconform_report", 0)
    assert handle.ping()["pid"] == handle.pid  # still serving


def test_a_release_later_reply_is_read_before_the_next_command(own: workers.WorkerPool) -> None:
    handle = own.get(["cpu"])[0]
    assert handle.defers_release  # a forked CPU worker
    handle.release_later()
    assert handle.ping()["pid"] == handle.pid  # the ping's reply, not the release's
    assert not handle.busy


def test_a_worker_still_closing_its_deployment_is_not_handed_out(
        own: workers.WorkerPool, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a forked worker tears a deployment down, the next deployment gets others."""
    first = own.get(["cpu"])[0]
    monkeypatch.setattr(handle_mod.WorkerHandle, "busy", property(lambda h: h is first))
    other = own.get(["cpu"])[0]
    assert other is not first and other.alive
    pair = own.get(["cpu", "cpu"])
    assert first not in pair and len({h.pid for h in pair}) == 2
    monkeypatch.setattr(handle_mod.WorkerHandle, "busy", property(lambda h: True))
    every = own.get(["cpu", "cpu"])  # all busy: at most SPARE_SETS per rank, wait on one
    assert len(own.workers) <= policy.SPARE_SETS * 2 and len(set(every)) == 2


def test_a_spare_set_starts_while_a_deployment_runs(
        own: workers.WorkerPool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next deployment finds forked workers already started, until SPARE_SETS are."""
    first = own.get(["cpu", "cpu"])
    spare = [h for h in own.workers.values() if h not in first]
    assert len(spare) == 2 and all(h.started and h.alive for h in spare)
    assert own.get(["cpu", "cpu"]) == first  # idle and started: no third set
    assert len(own.workers) == 4
    monkeypatch.setattr(handle_mod.WorkerHandle, "busy", property(lambda h: h in first))
    second = own.get(["cpu", "cpu"])
    assert set(second) == set(spare) and len(own.workers) == 6  # all others busy
    monkeypatch.setattr(handle_mod.WorkerHandle, "busy", property(lambda h: True))
    for _ in range(3):
        own.get(["cpu", "cpu"])
    assert len(own.workers) == policy.SPARE_SETS * 2


def test_workers_made_before_the_fork_server_was_ready_fork_between_tests(
        own: workers.WorkerPool, monkeypatch: pytest.MonkeyPatch) -> None:
    assert own.warm(["cpu"]) and forkserver.wait_ready(60)
    monkeypatch.setattr(forkserver, "is_ready", lambda: False)
    own.prestart(["cpu"])  # its worker and a spare one, waiting for the server
    pending = list(own.workers.values())
    assert len(pending) == 2 and not any(h.started for h in pending)
    assert own.launch_pending() == 0
    monkeypatch.undo()
    assert own.launch_pending() == 2
    assert all(h.started and h.ping()["pid"] == h.pid for h in pending)
    assert own.launch_pending() == 0


def test_close_leaves_no_process_behind() -> None:
    own = workers.WorkerPool(preload=())
    handles = own.get(["cpu", "cpu"])
    own.close()
    assert not any(h.alive for h in handles)
    assert not os.path.exists(own.workdir)


def test_shared_pool_closes_with_the_last_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    closed: list[bool] = []
    monkeypatch.setattr(workers._holders, "count", 0)
    monkeypatch.setattr(workers, "close_pool", lambda: closed.append(True))
    workers.hold()
    workers.hold()
    workers.release()
    assert closed == []
    workers.release()
    assert closed == [True]


def test_page_pattern_tells_pages_ranks_and_cells_apart() -> None:
    shape = (2, 16, 32)
    a = page_pattern(0, 0, 0, shape)
    assert a.dtype == np.uint8 and a.shape == shape and a.min() >= 1
    others = [page_pattern(1, 0, 0, shape), page_pattern(0, 1, 0, shape),
              page_pattern(0, 0, 1, shape)]
    assert all(not np.array_equal(a, o) for o in others)
    assert not np.array_equal(a[0], a[1])  # heads differ within a page
    assert len(np.unique(a[0, :, 0])) == 16  # tokens differ within a page


def test_an_rpc_drains_every_reply_before_raising(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 dies; rank 1's reply is read anyway, so its next request is not off by one."""
    from pytest_kvconform.workers import deployment

    own = workers.WorkerPool(preload=())
    try:
        dying, living = own.get(["cpu", "cpu"])
        monkeypatch.setattr(dying, "send_rpc",
                            lambda frames: dying.send({"cmd": "crash", "code": 5}))
        monkeypatch.setattr(living, "send_rpc",  # answers None, unlike the ping that follows
                            lambda frames: living.send({"cmd": "release"}))
        with pytest.raises(protocol.WorkerDied, match="exit code 5"):
            deployment._exchange([dying, living], [b""], "set_kv_cache_configs")
        assert living.ping()["pid"] == living.pid
    finally:
        own.close()


def test_active_fault_is_validated_and_names_the_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(protocol.FAULT_ENV, raising=False)
    assert fault_tally.active_fault() is None
    monkeypatch.setenv(protocol.FAULT_ENV, "")
    assert fault_tally.active_fault() is None
    for fault in worker_faults.FAULTS:
        monkeypatch.setenv(protocol.FAULT_ENV, fault)
        assert fault_tally.active_fault() == fault
    monkeypatch.setenv(protocol.FAULT_ENV, "wrong_ofset")
    with pytest.raises(ValueError, match=r"\$KVCONFORM_WORKER_FAULT='wrong_ofset'.*wrong_offset"):
        fault_tally.active_fault()


def test_a_fault_named_without_the_fault_package_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The mechanism layers only hand a fault to the hook the seeded-fault package installs:
    without it, a named fault is an error, never a silent no-fault run."""
    monkeypatch.delenv(fault_hook.HOOK_ENV)
    monkeypatch.setenv(protocol.FAULT_ENV, "die")
    with pytest.raises(fault_hook.NoFaultHook, match=r"seeded-fault hook.*KVCONFORM_FAULT_HOOK"):
        fault_tally.active_fault()
    with pytest.raises(fault_hook.NoFaultHook):
        fault_hook.process_fault("die")
    with fault_hook.seeded(None):  # nothing asked: nothing needed
        pass


def test_rank_placements_give_each_cuda_rank_its_own_gpu_id() -> None:
    ids = ["0", "1", "2", "3"]
    assert policy.rank_placements(2, "cpu", ids, {}) == ["cpu", "cpu"]
    # no xdist: every GPU visible here, this process on cuda:2
    assert policy.rank_placements(2, "cuda:2", ids, {}) == ["gpu:2", "gpu:0"]
    # an xdist worker narrowed to GPU 1 (a world-size-2 case must not ask for cuda:1)
    narrowed = {"CUDA_VISIBLE_DEVICES": "1"}
    assert policy.rank_placements(2, "cuda:0", ids, narrowed) == ["gpu:1", "gpu:0"]
    assert policy.rank_placements(1, "cuda:0", ids, narrowed) == ["gpu:1"]
    outer = {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}
    assert policy.rank_placements(2, "cuda:0", ["GPU-a", "GPU-b"], outer) == [
        "gpu:GPU-a", "gpu:GPU-b"]
    assert "needs 3 CUDA devices" in str(policy.rank_placements(3, "cuda:0", ids[:2], {}))
    assert protocol.child_device("gpu:3") == ("cuda:0", "3")
    assert protocol.child_device("cpu") == ("cpu", None)


def test_a_gpu_placed_worker_sees_only_its_gpu() -> None:
    """The child pins CUDA_VISIBLE_DEVICES itself (no torch here: nothing touches CUDA)."""
    own = workers.WorkerPool(preload=())
    try:
        (handle,) = own.get(["gpu:7"])
        info = handle.ping()
        assert info["start_method"] == "spawn" and info["ppid"] == os.getpid()  # never forked
        assert info["cuda_visible_devices"] == "7" and info["device"] == "cuda:0"
        assert handle.device == "cuda:0" and handle.gpu_id == "7"
    finally:
        own.close()


def test_a_forked_worker_gets_its_parents_environment_at_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not the fork server's (started earlier): as a spawned worker would."""
    own = workers.WorkerPool(preload=())
    try:
        assert own.warm(["cpu"]) and forkserver.wait_ready(60)
        monkeypatch.setenv(protocol.PIDDIR_ENV, str(tmp_path))
        (handle,) = own.get(["cpu"])
        assert handle.info["start_method"] == "forkserver"
        assert os.path.exists(os.path.join(tmp_path, f"{handle.pid}.worker"))
    finally:
        own.close()



def test_another_copy_put_first_on_the_path_is_not_what_the_server_imports(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A conftest's ``sys.path.insert(0, clone)`` after this process imported the package:
    the server still imports this process's copy (the guard refuses any other), and forks."""
    copy = tmp_path / "pytest_kvconform"
    copy.mkdir()
    (copy / "__init__.py").write_text("raise ImportError('the other copy was imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    forkserver.stop()  # a server started earlier would be reused
    own = workers.WorkerPool(preload=())
    try:
        assert own.warm(["cpu"]) and forkserver.wait_ready(60), forkserver.log_tail()
        (handle,) = own.get(["cpu"])
        assert handle.method == "forkserver" and handle.info["start_method"] == "forkserver"
    finally:
        own.close()


STOPS = """
import os
from pytest_kvconform.workers import forkserver
from pytest_kvconform.workers import pool as workers
from pytest_kvconform.adapters.worker_extension import page_pattern

if __name__ == "__main__":
    first, second = workers.WorkerPool(preload=()), workers.WorkerPool(preload=())
    first.get(["cpu"])
    server = forkserver.pid()
    assert second.get(["cpu"])[0].info["ppid"] == server
    first.close()
    assert forkserver.running() and forkserver.pid() == server
    assert second.get(["cpu"])[0].ping()["ppid"] == server  # still serving the other pool
    second.close()
    assert forkserver.pid() is None and not os.path.exists(f"/proc/{server}")
    print("stopped", server)
"""


def test_the_fork_server_stops_with_its_last_pool(tmp_path: Path) -> None:
    """Pools count as its users: the last one closed stops it (no process left behind).

    In a fresh process: this module's own pool holds this process's server.
    """
    script = tmp_path / "stops.py"
    script.write_text(STOPS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "stopped" in done.stdout, done.stdout + done.stderr


def test_server_preload_is_imports_only() -> None:
    assert protocol.LOAD_PLUGINS not in handle_mod.server_preload(protocol.PRELOAD)
    assert handle_mod.server_preload(("a", protocol.LOAD_PLUGINS, "b")) == ("a", "b")
    assert handle_mod.start_method("cpu") == "forkserver"
    assert handle_mod.start_method("gpu:0") == handle_mod.start_method("cuda:1") == "spawn"


UNGUARDED = """
from pytest_kvconform.workers import pool as workers

# At module level, with no `if __name__ == "__main__":` guard, as a quick script is written.
pool = workers.WorkerPool(preload=())
(forked,) = pool.get(["cpu"])
(spawned,) = pool.get(["cuda:9"])  # a torch device string: spawned, never touches CUDA here
print("served", forked.info["start_method"], forked.ping()["pid"] == forked.pid,
      spawned.info["start_method"], spawned.ping()["pid"] == spawned.pid)
pool.close()
"""


def test_a_script_without_a_main_guard_gets_working_workers(tmp_path: Path) -> None:
    """multiprocessing would re-run the caller's main module in each worker: not ours."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["served", "forkserver", "True", "spawn", "True"], \
        done.stdout + done.stderr


def _fail_in_child(text: str) -> None:
    raise RuntimeError(text)


class _FailsToUnpickle:
    """An argument whose unpickling, in the worker, raises before the worker's code runs."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return _fail_in_child, ("kvconform-test: failed while the worker was being prepared",)


@pytest.mark.parametrize("placement", ["cpu", "cuda:9"], ids=["forked", "spawned"])
def test_a_worker_that_dies_before_its_own_code_runs_says_why(
        placement: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
) -> None:
    """Its own error, not '(no stderr captured)': a forked worker's is in the fork server's
    log, a spawned one's on this process's stderr (the message says where)."""
    own = workers.WorkerPool(preload=())
    try:
        monkeypatch.setattr(handle_mod, "child_device", lambda p: (_FailsToUnpickle(), None))
        own.prestart([placement])
        monkeypatch.undo()
        with pytest.raises(protocol.WorkerDied) as info:
            own.workers[(placement, 0)].wait_ready(timeout=60)
        message = str(info.value)
        assert "died during 'start-up'" in message
        assert "no stderr captured" not in message
        assert "died before it opened its own log" in message, message
        if placement == "cpu":
            assert "kvconform-test: failed while the worker was being prepared" in message
        else:
            assert "on this process's stderr" in message
            assert "kvconform-test: failed while the worker was being prepared" in \
                capfd.readouterr().err
    finally:
        own.close()


# --- $KVCONFORM_WORKER_PIDDIR: PID files never written through a planted link ----------


def test_a_planted_symlink_under_the_pid_files_name_gets_nothing_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
) -> None:
    """The target stays as it was; the refusal is one line naming the file, and the process
    carries on (the worker's result does not depend on its PID file)."""
    piddir = tmp_path / "pids"
    piddir.mkdir()
    target = tmp_path / "precious"
    target.write_text("keep\n")
    (piddir / f"{os.getpid()}.worker").symlink_to(target)
    (piddir / f"{os.getpid()}.hang").symlink_to(tmp_path / "dangling")  # would be created
    monkeypatch.setenv(protocol.PIDDIR_ENV, str(piddir))

    assert not pid_marking.mark_pid("worker")
    assert not pid_marking.mark_pid("hang")

    assert target.read_text() == "keep\n" and not (tmp_path / "dangling").exists()
    err = capfd.readouterr().err
    assert f"kvconform: $KVCONFORM_WORKER_PIDDIR: not writing {os.getpid()}.worker: " \
           f"{piddir / f'{os.getpid()}.worker'} already exists (a file or a symbolic link " \
           "put there before this process): left as it is" in err
    assert err.count("not writing") == 2


def test_a_pid_file_is_created_for_this_user_only(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(protocol.PIDDIR_ENV, str(tmp_path))
    assert pid_marking.mark_pid("worker")
    made = tmp_path / f"{os.getpid()}.worker"
    assert made.is_file() and not made.is_symlink() and made.stat().st_mode & 0o777 == 0o600
    assert not pid_marking.mark_pid("worker")  # never over what is there, even our own


@pytest.mark.parametrize("mode", [0o777, 0o1777])
def test_a_pid_dir_anyone_may_plant_files_in_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int) -> None:
    """World-writable without the sticky bit: refused whole.  With it (as /tmp), only a
    file or link already there is (O_EXCL | O_NOFOLLOW)."""
    piddir = tmp_path / "shared"
    piddir.mkdir()
    piddir.chmod(mode)
    monkeypatch.setenv(protocol.PIDDIR_ENV, str(piddir))
    if mode & 0o1000:
        pid_marking.check_piddir()
        assert pid_marking.mark_pid("worker")
        return
    with pytest.raises(ValueError) as info:
        pid_marking.check_piddir()
    assert str(info.value) == (f"$KVCONFORM_WORKER_PIDDIR={piddir}: refusing to write PID "
                               "files there: anyone may write to it (world-writable, no "
                               "sticky bit)")
    assert not pid_marking.mark_pid("worker") and not list(piddir.iterdir())


def test_a_pid_dir_that_is_not_a_directory_is_refused(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(protocol.PIDDIR_ENV, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"PIDDIR=.*missing: not a directory this run can use "
                                         r"\(No such file or directory\)"):
        pid_marking.check_piddir()


def test_a_run_with_an_unsafe_pid_dir_is_a_usage_error_and_leaves_sigterm_as_it_was(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    import signal

    from tests.conftest import KV_ARGS

    piddir = pytester.path / "shared"
    piddir.mkdir()
    piddir.chmod(0o777)
    monkeypatch.setenv(protocol.PIDDIR_ENV, str(piddir))
    result = pytester.runpytest(*KV_ARGS, "-k", "kv_l1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*$KVCONFORM_WORKER_PIDDIR={piddir}: refusing to write PID "
                                 "files there: anyone may write to it*"])
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the run's handler undone
