"""Process-level faults: no run hangs, no process outlives its run, every result is kept.

Fast tests drive the worker harness directly (workers that preload nothing start
in about a second).  The scenario tests run ``pytest --kv-conformance`` in a fresh
process per fault (``tests/faultkit.py``, shared with benchmarks/fault_catalogue.py)
and assert the message, the exit status, the report and, by PID, that no process
is left.  Faults are seeded through ``$KVCONFORM_WORKER_FAULT`` (hang, die, oom),
a stand-in backend whose declaration blocks, and real signals.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_kvconform.checks.common import declared_need, run_in_child
from pytest_kvconform.checks.layout import check_kv_l1
from pytest_kvconform.contract import cases, memory
from pytest_kvconform.contract.outcomes import ErrorKind, HarnessError
from pytest_kvconform.contract.records import BackendUnderTest
from pytest_kvconform.workers import budget, child, isolated, policy, protocol
from pytest_kvconform.workers import pool as workers
from tests import faultkit
from tests.conftest import needs_omni
from tests.seeding import register_backends
from tests.standin_backends import GOOD_AND_INT_FLAG

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(),
                                reason="PID checks read /proc (Linux)")
ROOT = Path(__file__).resolve().parents[2]


# --- the worker harness, directly ---------------------------------------------------


@pytest.fixture
def pool() -> Iterator[workers.WorkerPool]:
    p = workers.WorkerPool(preload=())
    yield p
    p.close()


PARENT = '''
import os, sys, threading, time
from pytest_kvconform.workers import pool as workers
from pytest_kvconform.workers import protocol

if __name__ == "__main__":
    pool = workers.WorkerPool(preload=())
    if sys.argv[1] == "other-thread":  # no parent-death signal: the watchdog must act
        thread = threading.Thread(target=pool.get, args=(["cpu"],))
        thread.start()
        thread.join()
    else:
        pool.get(["cpu"])
    os.environ[protocol.FAULT_ENV] = "hang"
    next(iter(pool.workers.values())).send({"cmd": "engine_run"})
    time.sleep(600)
'''


@pytest.mark.parametrize("spawned_from", ["main-thread", "other-thread"])
def test_worker_exits_when_its_parent_is_sigkilled(tmp_path: Path, spawned_from: str) -> None:
    """SIGKILL leaves no atexit hook to run; the worker must notice on its own."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    piddir = tmp_path / "pids"
    piddir.mkdir()
    env = {**os.environ, protocol.PIDDIR_ENV: str(piddir),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, str(script), spawned_from], env=env)
    try:
        deadline = time.monotonic() + 60
        while not list(piddir.glob("*.hang")) and time.monotonic() < deadline:
            assert parent.poll() is None, "the parent exited early"
            time.sleep(0.1)
        started = faultkit.worker_pids(piddir)  # the hung one, and the pool's spare set
        assert started and all(faultkit.alive(w) for w in started)
        assert started <= set(faultkit.descendants(parent.pid))
        parent.kill()
        parent.wait()
        every = started | faultkit.worker_pids(piddir)
        assert faultkit.wait_gone(every) == set(), f"workers {every} outlived their parent"
    finally:
        parent.kill()
        faultkit.kill_leftovers(faultkit.worker_pids(piddir))


IMPORTING = '''
import sys, time
from pytest_kvconform.workers import forkserver
from pytest_kvconform.workers import pool as workers

if __name__ == "__main__":
    pool = workers.WorkerPool(preload=("kvconform_slow_import",))
    assert pool.warm(["cpu"])
    with open(sys.argv[1], "w") as f:
        f.write(str(forkserver.pid()))
    time.sleep(600)
'''


def test_fork_server_still_importing_exits_when_its_parent_is_sigkilled(
        tmp_path: Path) -> None:
    """multiprocessing's server would notice only after its preload: ours is tied before it."""
    (tmp_path / "kvconform_slow_import.py").write_text(
        f"import pathlib, time\npathlib.Path({str(tmp_path / 'importing')!r}).touch()\n"
        "time.sleep(600)\n")
    script = tmp_path / "parent.py"
    script.write_text(IMPORTING)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    pidfile = tmp_path / "server.pid"
    parent = subprocess.Popen([sys.executable, str(script), str(pidfile)], env=env)
    server = None
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "importing").exists() and time.monotonic() < deadline:
            assert parent.poll() is None, "the parent exited early"
            time.sleep(0.1)
        server = int(pidfile.read_text())
        assert faultkit.alive(server) and server in faultkit.descendants(parent.pid)
        parent.kill()
        parent.wait()
        assert faultkit.wait_gone([server]) == set(), f"fork server {server} outlived its parent"
    finally:
        parent.kill()
        faultkit.kill_leftovers([server] if server else [])


def test_hung_command_times_out_within_the_budget_and_is_replaced(
        pool: workers.WorkerPool, monkeypatch: pytest.MonkeyPatch) -> None:
    handle = pool.get(["cpu"])[0]
    monkeypatch.setenv(protocol.FAULT_ENV, "hang")
    started = time.monotonic()
    with budget.per_test(1.0), pytest.raises(protocol.WorkerTimeout) as info:
        handle.request("engine_run")
    assert time.monotonic() - started < 10
    error = info.value
    assert isinstance(error, HarnessError) and error.kind is ErrorKind.TIMEOUT
    assert re.search(r"did not answer 'engine_run' within 1\.0s \(what was left of the "
                     r"per-test budget, --kv-timeout=1\) and was killed", str(error))
    assert not handle.alive
    monkeypatch.delenv(protocol.FAULT_ENV)
    replacement = pool.get(["cpu"])[0]
    assert replacement is not handle and replacement.ping()["pid"] != handle.pid
    assert pool.replaced == 1


def test_worker_start_up_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker stuck importing (a preload that blocks) is killed at the start-up limit."""
    (tmp_path / "kvconform_stuck_import.py").write_text("import time\ntime.sleep(600)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the spawned child gets this sys.path
    own = workers.WorkerPool(preload=("kvconform_stuck_import",))
    try:
        own.prestart(["cpu"])
        handle = own.workers[("cpu", 0)]
        with pytest.raises(protocol.WorkerTimeout,
                           match=r"did not answer 'start-up' within 2\.0s and was killed"):
            handle.wait_ready(timeout=2.0)
        assert not handle.alive
    finally:
        own.close()


def test_worker_killed_mid_command_is_worker_died(pool: workers.WorkerPool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    handle = pool.get(["cpu"])[0]
    monkeypatch.setenv(protocol.FAULT_ENV, "die")
    with pytest.raises(protocol.WorkerDied) as info:
        handle.request("engine_run")
    assert info.value.kind is ErrorKind.WORKER_DIED
    message = str(info.value)
    assert "died during 'engine_run' (exit code -9, killed by SIGKILL" in message
    assert "seeded fault 'die'" in message  # the worker's stderr tail
    monkeypatch.delenv(protocol.FAULT_ENV)
    assert pool.get(["cpu"])[0].ping()["pid"] != handle.pid


@pytest.mark.delivers_signal
def test_interrupted_wait_kills_the_worker(pool: workers.WorkerPool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while waiting: the worker is killed, so no stale reply meets the next request."""
    handle = pool.get(["cpu"])[0]
    monkeypatch.setenv(protocol.FAULT_ENV, "hang")
    handle.send({"cmd": "engine_run"})
    timer = threading.Timer(0.5, lambda: signal.pthread_kill(threading.main_thread().ident or 0,
                                                             signal.SIGINT))
    with faultkit.sigint_raises(), pytest.raises(KeyboardInterrupt):
        timer.start()
        try:
            handle.receive("engine_run", timeout=30)
        finally:
            timer.cancel()
    assert not handle.alive


def test_budget_bounds_waits_and_falls_back_outside_a_test() -> None:
    assert budget.remaining() is None and budget.bound(7.0) == 7.0
    with budget.per_test(3.0):
        assert 0 < budget.bound(100.0) <= 3.0
    assert budget.remaining() is None


class _Slow:
    """A declaration that blocks (and so lets go of the GIL)."""

    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        time.sleep(120)
        return False


class _Hog:
    """A declaration that loops in C and never lets go of the GIL."""

    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        return sum(range(10**13)) < 0


class _Exits:
    """A declaration that ends its process."""

    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        os._exit(0)


@pytest.fixture
def forget() -> Iterator[None]:
    isolated.forget()
    yield
    isolated.forget()


@pytest.fixture
def slow_backend(forget: None) -> BackendUnderTest:
    return BackendUnderTest("SLOW", "tests:_Slow", "hook", cls=_Slow)


def test_blocking_declaration_is_a_timeout_naming_clause_and_backend(
        slow_backend: BackendUnderTest) -> None:
    """The first call pays the budget; the next errors at once citing it, for the rest of
    the process (the call was killed with its process)."""
    this_test = os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0]
    call = r"SLOW\.indexes_kv_by_block_stride\(\) \(the backend's layout declaration\)"
    for ask, pattern in (
            (lambda: declared_need("KV-L2", slow_backend),
             r"KV-L2 \[backend=SLOW\]: timed out after [\d.]+s \(what was left of the per-test "
             rf"budget, --kv-timeout=0\.3\) waiting for {call} to return \(its process was "
             r"killed\)$"),
            (lambda: check_kv_l1(slow_backend),
             rf"KV-L1 \[backend=SLOW\]: {call} was not called again: it hung in "
             rf"{re.escape(this_test)} \(KV-L2\), timing out after [\d.]+s \(what was left of "
             r"the per-test budget, --kv-timeout=0\.3\), and was killed \(this process "
             r"remembers it\)$")):
        started = time.monotonic()
        with budget.per_test(0.3), pytest.raises(budget.WaitTimeout) as info:
            ask()
        assert time.monotonic() - started < 30  # not the 120 s it blocks (torch's import)
        assert info.value.kind is ErrorKind.TIMEOUT
        assert info.value.caused_by == "SLOW.indexes_kv_by_block_stride() (the backend's " \
                                       "layout declaration)"
        assert re.match(pattern, str(info.value)), info.value
    isolated.forget()  # forgotten: asked again, and hangs again
    with budget.per_test(0.3), pytest.raises(budget.WaitTimeout, match="timed out after"):
        declared_need("KV-L2", slow_backend)


@pytest.mark.parametrize("how", ["in its own child", "inside a forked check"])
def test_a_declaration_holding_the_gil_is_bounded_and_leaves_no_process(
        forget: None, how: str) -> None:
    """A thread cannot stop a loop that never lets go of the GIL: the child making the call
    is killed, with the budget, and no process of it is left."""
    hog = BackendUnderTest("HOG", "tests:_Hog", "hook", cls=_Hog)
    before = set(faultkit.descendants(os.getpid()))
    started = time.monotonic()
    with budget.per_test(1.0), pytest.raises(budget.WaitTimeout) as info:
        if how == "in its own child":
            declared_need("KV-A1", hog)
        else:
            run_in_child(check_kv_l1, [hog], clause="KV-L1", backend="HOG")
    assert time.monotonic() - started < 10
    assert str(info.value).startswith(
        "KV-L1 [backend=HOG]: timed out after" if how != "in its own child" else
        "KV-A1 [backend=HOG]: timed out after"), info.value
    assert "waiting for HOG.indexes_kv_by_block_stride() (the backend's layout declaration) " \
           "to return" in str(info.value)
    assert info.value.caused_by is not None
    assert faultkit.wait_gone(faultkit.descendants(os.getpid()) - before) == set()


def test_a_declaration_that_ends_its_process_is_an_error_naming_the_call(forget: None) -> None:
    exits = BackendUnderTest("EXITS", "tests:_Exits", "hook", cls=_Exits)
    for ask in (lambda: declared_need("KV-L2", exits),
                lambda: run_in_child(check_kv_l1, [exits], clause="KV-L1", backend="EXITS")):
        with budget.per_test(30), pytest.raises(HarnessError) as info:
            ask()
        assert info.value.kind is ErrorKind.WORKER_DIED
        assert re.match(r"KV-L\d \[backend=EXITS\]: the process calling EXITS\."
                        r"indexes_kv_by_block_stride\(\) \(the backend's layout declaration\) "
                        r"died \(exit code 0\): the backend's own code ended it", str(info.value))
        assert info.value.caused_by is not None


def test_check_backend_reports_a_blocking_declaration_as_a_timeout_error(
        slow_backend: BackendUnderTest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain API bounds each check by the default budget, as pytest's --kv-timeout does."""
    from pytest_kvconform import api

    monkeypatch.setattr(budget, "DEFAULT_TIMEOUT_S", 0.3)
    result, _name = api.check_backend(slow_backend, clauses=["KV-L1"], device="cpu")
    assert (result.status, result.error_kind) == ("error", ErrorKind.TIMEOUT)
    assert "KV-L1 [backend=SLOW]: timed out after" in result.message


def test_out_of_memory_is_told_apart_and_free_memory_is_known() -> None:
    assert memory.is_out_of_memory(MemoryError())
    assert memory.is_out_of_memory(RuntimeError(
        "DefaultCPUAllocator: can't allocate memory: you tried to allocate 99 bytes"))
    assert memory.is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert not memory.is_out_of_memory(ValueError("layout disagrees"))
    free = child.free_bytes("cpu")
    assert free is not None and free > 0


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf"])
def test_kv_timeout_is_validated(pytester: pytest.Pytester, value: str) -> None:
    result = pytester.runpytest("-p", "no:cacheprovider", "--kv-timeout", value)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--kv-timeout: *{value.lstrip('-')}*"])


def test_case_with_fewer_than_two_pages_is_a_case_file_error(tmp_path: Path) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text('[[case]]\nid = "one_page"\nnum_pages = 1\n')
    with pytest.raises(cases.CaseFileError) as info:
        cases.load_case_file(path)
    message = str(info.value)
    assert message.startswith(f"{path}, case 'one_page', key 'num_pages': 1 page cannot be "
                              "served: a case needs at least 2")
    assert "KV-N4" in message


@needs_omni
def test_case_with_one_page_stops_the_run_with_a_usage_error(pytester: pytest.Pytester,
                                                             kv_run: Any) -> None:
    pytester.makefile(".toml", tiny='[[case]]\nid = "one_page"\nnum_pages = 1\n')
    result = kv_run("--kv-cases", "tiny.toml", "-k", "kv_n2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kv-cases: *tiny.toml, case 'one_page', key 'num_pages'*"])


def test_huge_case_stops_the_run_with_a_usage_error_naming_the_limit(
        pytester: pytest.Pytester, kv_run: Any) -> None:
    """A BlockPool of 10^12 blocks once grew pytest until the kernel killed it.
    The case is refused when the file is loaded (before discovery imports anything, so
    ``--collect-only`` keeps the unbounded code from allocating if the bound is gone)."""
    pytester.makefile(".toml", huge='[[case]]\nid = "huge"\nnum_pages = 1000000000000\n')
    result = kv_run("--kv-cases", "huge.toml", "-k", "kv_n1", "--collect-only",
                    "--kv-report", "r.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([
        "*--kv-cases: *huge.toml, case 'huge', key 'num_pages': 1000000000000 exceeds the "
        "limit 65536 (KV-N1 builds BlockPools of this many blocks in the test process*"])
    assert not (pytester.path / "r.json").exists()


# --- whole runs, one fresh pytest process per fault ---------------------------------


def _error_kinds(junit: Path) -> dict[str, str | None]:
    """test name -> its ``kv_error_kind`` property (None when it has none)."""
    kinds = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        kinds[case.get("name", "")] = props.get("kv_error_kind")
    return kinds


def _no_process_left(outcome: faultkit.Outcome) -> None:
    assert outcome.leaked == set(), (f"{outcome.name}: still alive {faultkit.LEAK_GRACE_S}s "
                                     f"after the run: {sorted(outcome.leaked)}")


def _report_ok(outcome: faultkit.Outcome) -> dict[str, dict[str, Any]]:
    assert outcome.report_error is None, outcome.report_error
    assert outcome.report is not None
    return outcome.results()


@pytest.fixture(scope="module")
def worker_fault_run(tmp_path_factory: pytest.TempPathFactory) -> faultkit.Outcome:
    return faultkit.worker_faults(tmp_path_factory.mktemp("worker-faults"))


# Each fault's test, its error kind, the message, and the test after it (must pass).
WORKER_FAULT_EXPECTATIONS = {
    "hang": ("test_kv_a2[FLASH_ATTN-bf16_h8]", "timeout",
             r"KV-A2 \[backend=FLASH_ATTN, case=bf16_h8\]: harness error "
             r"\(timeout\) while running production's deployment \(mp\): <worker cpu "
             r"slot 0 pid \d+> did not answer 'set_kv_cache_configs' within [\d.]+s \(what "
             r"was left of the per-test budget, --kv-timeout=15\) and was killed",
             "test_kv_a2_seam[need_False-bf16_h8]"),
    "die": ("test_kv_a2_seam[need_True-bf16_h8]", "worker-died",
            r"KV-A2 \[backend=need=True, case=bf16_h8\]: harness error \(worker-died\) .*"
            r"died during 'set_kv_cache_configs' \(exit code -9, killed by SIGKILL",
            "test_kv_a3[FLASH_ATTN-bf16_h8]"),
    "oom": ("test_kv_a3_seam[need_False-bf16_h8]", "oom",
            r"KV-A3 \[backend=need=False, case=bf16_h8\]: harness error \(oom\) .*"
            r"'engine_run' ran out of memory on cpu: asked for \d+ bytes, \d+ bytes free",
            "test_kv_a3_seam[need_True-bf16_h8]"),
}


@needs_omni
@pytest.mark.parametrize("fault", sorted(WORKER_FAULT_EXPECTATIONS))
def test_worker_fault_is_an_error_and_the_run_goes_on(worker_fault_run: faultkit.Outcome,
                                                      fault: str) -> None:
    test, kind, message, after = WORKER_FAULT_EXPECTATIONS[fault]
    assert faultkit.WORKER_FAULTS[test] == fault
    rows = _report_ok(worker_fault_run)
    assert (rows[test]["status"], rows[test]["error_kind"]) == ("error", kind)
    assert re.search(message, rows[test]["reason"]), rows[test]["reason"]
    assert "violated" not in rows[test]["reason"]  # never blamed on the backend
    kinds = _error_kinds(worker_fault_run.workdir / "j.xml")
    assert kinds[test] == kind
    assert rows[after]["status"] == "passed" and kinds[after] is None


@needs_omni
def test_worker_fault_run_exits_1_with_a_valid_report_and_no_process_left(
        worker_fault_run: faultkit.Outcome) -> None:
    outcome = worker_fault_run
    assert outcome.returncode == pytest.ExitCode.TESTS_FAILED, outcome.output[-3000:]
    assert len(_report_ok(outcome)) == 6
    # hang and die each cost a worker (replaced); after the OOM the same worker served on
    # (its next test passes: test_worker_fault_is_an_error_and_the_run_goes_on).  Beside
    # them, the forked CPU workers a deployment takes while others close theirs: at most
    # SPARE_SETS per rank of the widest deployment (world size 2).
    assert 3 <= len(outcome.workers) <= 2 + policy.SPARE_SETS * 2, outcome.workers
    _no_process_left(outcome)


@needs_omni
def test_blocking_declaration_is_an_error_paid_for_once_and_the_run_goes_on(
        tmp_path: Path) -> None:
    """The first test asking a declaration that never returns pays the budget;
    every later one errors at once (kind timeout), citing that test and the timeout."""
    outcome = faultkit.blocking_declaration(tmp_path)
    assert outcome.returncode == pytest.ExitCode.TESTS_FAILED, outcome.output[-3000:]
    assert outcome.seconds < 240  # not the 300 s the declaration blocks for
    rows = _report_ok(outcome)
    kinds = _error_kinds(tmp_path / "j.xml")
    blocking = sorted(t for t in rows if "[BLOCKING" in t)
    assert blocking == sorted(faultkit.BLOCKING_TESTS)
    first, *later = faultkit.BLOCKING_TESTS
    for test in faultkit.BLOCKING_TESTS:
        assert (rows[test]["status"], rows[test]["error_kind"], kinds[test]) == \
            ("error", "timeout", "timeout"), rows[test]
    assert ("KV-L1 [backend=BLOCKING]: timed out after 2.0s (what was left of the per-test "
            "budget, --kv-timeout=2) waiting for BLOCKING.indexes_kv_by_block_stride() (the "
            "backend's layout declaration) to return") in rows[first]["reason"]
    for test in later:
        clause = rows[test]["clause"]
        reason = rows[test]["reason"]
        assert (f"{clause} [backend=BLOCKING]: BLOCKING.indexes_kv_by_block_stride() (the "
                "backend's layout declaration) was not called again: it hung in ") in reason
        assert (f"::{first} (KV-L1), timing out after 2.0s (what was left of the per-test "
                "budget, --kv-timeout=2), and was killed") in reason, reason
        assert rows[test]["duration_s"] < 1.0  # not another budget
    good = {t: r["status"] for t, r in rows.items() if "[GOOD" in t}  # the run went on
    assert set(good) == {t.replace("BLOCKING", "GOOD") for t in faultkit.BLOCKING_TESTS}
    assert "error" not in good.values()  # (KV-L8 fails on vllm-omni 0.30: known findings)
    assert [good[f"test_kv_l{n}[GOOD]"] for n in (1, 2, 3)] == ["passed"] * 3
    _no_process_left(outcome)


def _no_temp_dir_left(outcome: faultkit.Outcome) -> None:
    """Nothing of the run's in its $TMPDIR once it ended (a SIGKILLed run's go at the next
    run's start: :func:`_no_temp_dir_after_the_next_start`)."""
    assert outcome.temp_left == [], f"{outcome.name}: left in $TMPDIR: {outcome.temp_left}"


def _no_temp_dir_after_the_next_start(outcome: faultkit.Outcome) -> None:
    assert outcome.leaked_dirs == [], (f"{outcome.name}: left in $TMPDIR after the next "
                                       f"run's sweep: {outcome.leaked_dirs}")


@needs_omni
@pytest.mark.delivers_signal
@pytest.mark.parametrize("xdist", [False, True], ids=["serial", "xdist"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL],
                         ids=["sigint", "sigterm", "sigkill"])
def test_killed_run_leaves_no_process(tmp_path: Path, xdist: bool, sig: int) -> None:
    """KV-A workers hang mid-command (and xdist workers live) when pytest gets the signal.

    SIGTERM (to pytest alone) ends the run as Ctrl-C does: exit status 2, the report, and
    no process nor temporary directory left.  SIGKILL leaves its directories to the next
    run, whose start-up removes them (its owner is gone).
    """
    outcome = faultkit.killed(tmp_path, xdist=xdist, sig=sig)
    # one KV-A worker per pytest process (per xdist worker), or another beside it that the
    # next test took while the first closed its deployment (SPARE_SETS; world size 1 here)
    processes = 2 if xdist else 1
    assert processes <= len(outcome.workers) <= processes * policy.SPARE_SETS, \
        outcome.output[-3000:]
    assert outcome.watched > outcome.workers  # the xdist workers, resource trackers, ...
    _no_process_left(outcome)
    _no_temp_dir_after_the_next_start(outcome)
    if sig == signal.SIGKILL:
        assert outcome.returncode == -signal.SIGKILL
        assert any(n.startswith("kvconform-run-") for n in outcome.temp_left), outcome.temp_left
        return
    _no_temp_dir_left(outcome)
    assert outcome.returncode == pytest.ExitCode.INTERRUPTED, outcome.output[-3000:]
    assert ("KeyboardInterrupt" if sig == signal.SIGINT else
            "Terminated: SIGTERM: the run was terminated") in outcome.output
    rows = _report_ok(outcome)  # written with what finished before the interrupt
    assert outcome.report is not None and outcome.report["verdict"] == "interrupted"
    assert rows["test_kv_a2[FLASH_ATTN-bf16_h8]"]["status"] == "passed"
    assert not any(r["status"] == "passed" and "need_True" in name for name, r in rows.items())


@pytest.fixture(scope="module")
def unsignalled_run(tmp_path_factory: pytest.TempPathFactory) -> faultkit.Outcome:
    """The late-signal scenarios' run with no signal: its exit status and verdict."""
    return faultkit.signalled_late(tmp_path_factory.mktemp("unsignalled"), None)


@needs_omni
@pytest.mark.delivers_signal
@pytest.mark.parametrize(("moment", "sig", "times"), [
    ("sessionfinish", signal.SIGTERM, 1), ("unconfigure", signal.SIGTERM, 1),
    ("unconfigure", signal.SIGINT, 1), ("atexit", signal.SIGINT, 1),
    ("atexit", signal.SIGTERM, 2)], ids=["sigterm-sessionfinish", "sigterm-after-summary",
                                         "sigint-after-summary", "sigint-at-exit",
                                         "sigterm-twice-at-exit"])
def test_a_signal_as_the_run_ends_keeps_its_own_exit_status_and_prints_no_traceback(
        tmp_path: Path, unsignalled_run: faultkit.Outcome, moment: str, sig: int,
        times: int) -> None:
    """From its end-of-run hooks to the interpreter's exit, SIGTERM or SIGINT (once, or
    twice) leaves the run's own exit status, which its report on disk agrees with."""
    baseline = unsignalled_run
    assert baseline.report is not None and baseline.returncode == 0, baseline.output[-3000:]
    outcome = faultkit.signalled_late(tmp_path, moment, sig, times)
    assert outcome.returncode == baseline.returncode, outcome.output[-3000:]
    assert "Traceback" not in outcome.output, outcome.output[-3000:]
    assert outcome.report is not None and outcome.report_error is None, outcome.report_error
    assert outcome.report["verdict"] == baseline.report["verdict"]
    name = signal.Signals(sig).name
    assert (f"kvconform: {name} while the run was finishing: it ends with its own exit "
            "status") in outcome.output, outcome.output[-3000:]
    if times == 2:
        assert f"kvconform: {name} again: exiting at once with status 0" in outcome.output
    _no_process_left(outcome)


@needs_omni
@pytest.mark.delivers_signal
def test_sigterm_ends_a_run_held_by_a_gil_holding_declaration_within_seconds(
        tmp_path: Path) -> None:
    """A declaration looping in C never lets a handler of the process it runs in run; it
    runs in a child, so SIGTERM to pytest ends the run in seconds, with a report whose
    interruption names the call, and no process left (the child with the loop included)."""
    outcome = faultkit.terminated_in_a_gil_holding_declaration(tmp_path)
    assert outcome.returncode == pytest.ExitCode.INTERRUPTED, outcome.output[-3000:]
    assert outcome.seconds < 10, outcome.seconds
    assert "Traceback" not in outcome.output, outcome.output[-3000:]
    assert outcome.report is not None and outcome.report["verdict"] == "interrupted"
    interruption = outcome.report["run"]["interruption"]
    assert re.match(r"SIGTERM: the run was terminated while KV-L1 \[backend=HOG\] had waited "
                    r"[\d.]+s for HOG\.indexes_kv_by_block_stride\(\) \(the backend's layout "
                    r"declaration\), in kvconform/test_layout\.py::test_kv_l1\[HOG\]$",
                    interruption), interruption
    assert len(outcome.watched) >= 2  # pytest and the child running the check
    _no_process_left(outcome)


@pytest.mark.parametrize("where", ["configure", "sessionstart"])
def test_ctrl_c_during_start_up_leaves_a_verdict_and_a_report(tmp_path: Path,
                                                              where: str) -> None:
    """SIGINT while the run is still starting (before anything was collected): the
    verdict line, a valid report that says ``interrupted``, and no stale-entry warnings
    for entries that nothing was matched against yet."""
    outcome = faultkit.interrupted_at_startup(tmp_path, where)
    assert outcome.returncode == pytest.ExitCode.INTERRUPTED, outcome.output[-3000:]
    assert ("kvconform: verdict: interrupted (interrupted: KeyboardInterrupt during start-up, "
            "before any test was collected") in outcome.output, outcome.output[-3000:]
    assert "kvconform: report written to r.json, r.md and r.html" in outcome.output
    assert "stale known-finding entr" not in outcome.output
    assert outcome.report_error is None, outcome.report_error
    assert outcome.report is not None
    assert outcome.report["verdict"] == "interrupted"
    assert outcome.report["results"] == []
    assert outcome.report["run"]["interruption"].startswith("KeyboardInterrupt during start-up")
    _no_process_left(outcome)


@needs_omni
def test_a_killed_xdist_worker_is_an_error_naming_its_test(tmp_path: Path) -> None:
    """SIGKILL of the xdist worker running a test: a worker-died error row for that test
    (and an E in the matrix), the run goes on, and the verdict is not qualified."""
    outcome = faultkit.xdist_worker_killed(tmp_path)
    assert outcome.returncode == pytest.ExitCode.TESTS_FAILED, outcome.output[-3000:]
    rows = _report_ok(outcome)
    killed = rows[faultkit.KILLED_TEST]
    assert (killed["status"], killed["error_kind"], killed["clause"], killed["backend"]) == (
        "error", "worker-died", "KV-L1", "GOOD"), killed
    assert re.match(r"KV-L1 \[backend=GOOD\]: harness error \(worker-died\): worker 'gw\d' "
                    r"crashed while running '.*test_kv_l1\[GOOD\]': the xdist worker process "
                    r"died", killed["reason"]), killed["reason"]
    assert rows["test_kv_l2[GOOD]"]["status"] == "passed"  # the run went on
    assert outcome.report is not None
    assert outcome.report["verdict"] == "not qualified"
    assert outcome.report["run"]["interruption"] is None
    assert re.search(r"^GOOD +E +\.", outcome.output, re.MULTILINE), outcome.output[-3000:]
    assert re.search(r"^kvconform: verdict(?: for [^:]*)?: not qualified \(.*harness errors "
                     r"\(worker-died\)",
                     outcome.output, re.MULTILINE), outcome.output[-3000:]
    _no_process_left(outcome)


# --- determinism --------------------------------------------------------------------

DETERMINISM_SELECT = ("--kv-backend", "GOOD", "--kv-backend", "INT_FLAG", "--kv-backend",
                      "FLASH_ATTN", "-k",
                      "kv_l1 or kv_l2 or (kv_a2 and bf16_h8 and not seam) or (kv_n2 and bf16)")
# worker_log: what production's processes printed, which depends on which of them started
# in this run (the first run here starts the fork server, the second reuses it): kept, not
# a result.
_VOLATILE = re.compile(r"duration|seconds|time|_at$|started|finished|date|^worker_log$", re.I)


def _scrub(value: Any) -> Any:
    """The report without durations and timestamps (and, above, the run's unique id)."""
    if isinstance(value, dict):
        return {k: _scrub(v) for k, v in value.items() if not _VOLATILE.search(k)}
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    return value



@needs_omni
@pytest.mark.usefixtures("shared_workers")
@pytest.mark.parametrize("xdist", [False, True], ids=["serial", "xdist"])
def test_same_inputs_give_the_same_report(pytester: pytest.Pytester, xdist: bool) -> None:
    register_backends(pytester, GOOD_AND_INT_FLAG)
    extra = ("-n", "2") if xdist else ("-p", "no:xdist")
    reports = []
    for run in (1, 2):
        result = pytester.runpytest("--kv-conformance", "-p", "no:cacheprovider", "-p",
                                    "no:randomly", *extra, *DETERMINISM_SELECT,
                                    "--kv-report", "r.json")
        assert result.ret == pytest.ExitCode.TESTS_FAILED, f"run {run}"  # INT_FLAG fails
        reports.append(json.loads((pytester.path / "r.json").read_text()))
    for data in reports:  # a run's id is unique by design, like its start time
        data.get("run", {}).pop("id", None)
    first, second = (_scrub(r) for r in reports)
    assert len(first["results"]) >= 6
    # GOOD serves no paged KV: its KV-A2 does not apply; FLASH_ATTN's runs production's worker
    assert {r["status"] for r in first["results"]} == {"passed", "failed", "skipped"}
    statuses = {r["nodeid"].rpartition("::")[2]: r["status"] for r in first["results"]}
    assert statuses["test_kv_a2[FLASH_ATTN-bf16_h8]"] == "passed"
    assert first == second



@needs_omni
def test_sigterm_in_start_up_leaves_no_process_nor_temp_dir(tmp_path: Path) -> None:
    """SIGTERM once the run made its temporary directory (its fork server importing vLLM,
    pytest discovering): the start-up's interrupted verdict and report, nothing left."""
    outcome = faultkit.terminated_at_startup(tmp_path)
    assert outcome.returncode == pytest.ExitCode.INTERRUPTED, outcome.output[-3000:]
    assert "kvconform: verdict: interrupted" in outcome.output, outcome.output[-3000:]
    assert outcome.report is not None and outcome.report["verdict"] == "interrupted", \
        outcome.report_error
    assert outcome.report["run"]["interruption"].startswith(("Terminated during start-up",
                                                             "SIGTERM")), outcome.report["run"]
    assert len(outcome.watched) > 1  # pytest and its fork server at least
    _no_process_left(outcome)
    _no_temp_dir_left(outcome)
