"""Process-level fault scenarios, shared by tests/seeded/test_process.py and
benchmarks/fault_catalogue.py.

Each scenario runs ``pytest --kv-conformance`` in a fresh process (its own
session, so a Ctrl-C reaches its whole process group as a terminal's would),
seeds one fault, and returns a :class:`Outcome`: the exit status, the output,
the report (loaded and validated when one was asked for) and the PIDs that
were still alive afterwards.  PIDs are known two ways: every KV-A worker writes
``<pid>.worker`` into ``$KVCONFORM_WORKER_PIDDIR``, and before a kill the
descendants of the pytest process are read from ``/proc``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_kvconform.report import build as report_mod
from pytest_kvconform.workers import tempdirs
from pytest_kvconform.workers.protocol import PIDDIR_ENV
from tests.seeding import backends_conftest
from tests.standin_backends import Blocking, Good

ROOT = Path(__file__).resolve().parents[1]
LEAK_GRACE_S = 5.0  # the bound: nothing is left 5 s after a kill
# What a run leaves in $TMPDIR that is its own: the run's directory (fork server, worker
# logs) and multiprocessing's (the fork server's socket).
TEMP_PREFIXES = ("kvconform-", "pymp-")
RUN_TIMEOUT_S = 600.0
BASE_ARGS = ("--kv-conformance", "-p", "no:cacheprovider", "-p", "no:randomly", "-rA")

# Seeds a worker fault for the tests whose name contains a key (first match wins).
FAULT_BY_TEST = '''
import pytest

FAULTS = {faults!r}


@pytest.fixture(autouse=True)
def _seeded_fault(request, monkeypatch):
    for part, fault in FAULTS.items():
        if part in request.node.name:
            monkeypatch.setenv("KVCONFORM_WORKER_FAULT", fault)
            break
'''

# A backend whose declaration blocks for minutes, next to one that passes.
BLOCKING_BACKEND = backends_conftest({"BLOCKING": Blocking, "GOOD": Good})


@dataclass
class Outcome:
    """What one scenario left behind."""

    name: str
    workdir: Path
    returncode: int | None
    output: str
    seconds: float
    report: dict[str, Any] | None = None
    report_error: str | None = None
    watched: set[int] = field(default_factory=set)
    leaked: set[int] = field(default_factory=set)
    workers: set[int] = field(default_factory=set)
    # The run's own $TMPDIR: our directories (TEMP_PREFIXES) there once it ended, and
    # those still there after a later run's start-up sweep (``tempdirs.sweep``).
    temp_left: list[str] = field(default_factory=list)
    leaked_dirs: list[str] = field(default_factory=list)
    # The largest peak RSS (VmHWM) of any of the run's processes, sampled while it ran.
    peak_rss_mib: int = 0

    def results(self) -> dict[str, dict[str, Any]]:
        """Report rows by test name (nodeid without the path)."""
        rows = (self.report or {}).get("results", [])
        return {r["nodeid"].rpartition("::")[2]: r for r in rows}


# --- processes ---------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a live PID from /proc, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    """Running or sleeping: a zombie (exited, not yet reaped) holds nothing and counts as gone."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


class PeakRss:
    """The largest peak RSS among a run's processes (pytest and its descendants), sampled
    every ``interval`` seconds: each process's high-water mark (``VmHWM``) only grows, so
    a sample after its peak and before its exit catches it."""

    def __init__(self, root: int, interval: float = 0.25) -> None:
        self.root, self.interval, self.peak_kib = root, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for pid in {self.root} | descendants(self.root):
                self.peak_kib = max(self.peak_kib, _hwm_kib(pid))

    def stop(self) -> int:
        """Stop sampling; the peak in MiB."""
        self._stop.set()
        self._thread.join()
        return self.peak_kib // 1024


def _hwm_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def descendants(root: int) -> set[int]:
    """Every live process below ``root`` (children, grandchildren, ...)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[0] not in ("Z", "X"):
                parents[int(entry)] = stat[1]
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def wait_gone(pids: Iterable[int], timeout: float = LEAK_GRACE_S) -> set[int]:
    """The PIDs still alive after ``timeout`` seconds (polled)."""
    pending = set(pids)
    deadline = time.monotonic() + timeout
    while pending:
        pending = {pid for pid in pending if alive(pid)}
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return pending


def worker_pids(piddir: Path) -> set[int]:
    return {int(p.stem) for p in piddir.glob("*.worker")}


def kill_leftovers(pids: Iterable[int]) -> None:
    """Clean up after a failed scenario so one leak does not poison the next."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


# --- running pytest --------------------------------------------------------------------


# Each run's private $TMPDIR, by pytest PID (short: under the usual temp directory, so the
# paths vLLM derives from it stay as short as they would be).
_tmpdirs: dict[int, Path] = {}
_peaks: dict[int, PeakRss] = {}


def temp_entries(tmpdir: Path) -> list[str]:
    """Our directories in a run's $TMPDIR (:data:`TEMP_PREFIXES`), sorted."""
    return sorted(p.name for p in tmpdir.iterdir() if p.name.startswith(TEMP_PREFIXES))


def _env(piddir: Path, extra: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "KVCONFORM_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env[PIDDIR_ENV] = str(piddir)
    env["TMPDIR"] = tempfile.mkdtemp(prefix="kvtmp-")
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    env.update(extra or {})
    return env


def _start(workdir: Path, args: Sequence[str], extra_env: dict[str, str] | None = None,
           ) -> tuple[subprocess.Popen[str], Path]:
    piddir = workdir / "pids"
    piddir.mkdir(parents=True, exist_ok=True)
    env = _env(piddir, extra_env)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", *BASE_ARGS, *args], cwd=workdir, text=True,
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True, preexec_fn=_interruptible)
    _tmpdirs[proc.pid] = Path(env["TMPDIR"])
    _peaks[proc.pid] = PeakRss(proc.pid)
    return proc, piddir


def _interruptible() -> None:
    """In the child before exec: SIGINT (and SIGTERM) back to the default and unblocked, as
    in a terminal.

    A job started in the background by a non-interactive shell (``cmd &``, as a
    benchmark often is) inherits SIGINT *ignored*; Python then installs no
    KeyboardInterrupt handler, and the scenarios' Ctrl-C would never arrive.  A
    blocked SIGINT (the signal mask survives ``exec``) would hold it back the same way.
    """
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


@contextmanager
def sigint_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt in this thread, whatever this process inherited.

    Python installs its KeyboardInterrupt handler only when SIGINT was not ignored at
    start-up, and a blocked SIGINT is never delivered: a test that sends itself SIGINT
    installs the handler and unblocks the signal for its own duration, then puts back
    what it found.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)


def _finish(name: str, proc: subprocess.Popen[str], piddir: Path, started: float,
            report: Path | None, watched: set[int], timeout: float = RUN_TIMEOUT_S,
            ) -> Outcome:
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # a hung run: the finding; clean up its group
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        output += f"\n[faultkit] run did not finish within {timeout:.0f}s; killed"
    outcome = Outcome(name, piddir.parent, proc.returncode, output, time.monotonic() - started)
    peak = _peaks.pop(proc.pid, None)
    outcome.peak_rss_mib = peak.stop() if peak is not None else 0
    outcome.workers = worker_pids(piddir)
    outcome.watched = watched | outcome.workers
    outcome.leaked = wait_gone(outcome.watched)
    kill_leftovers(outcome.leaked)
    tmpdir = _tmpdirs.pop(proc.pid, None)
    if tmpdir is not None:
        outcome.temp_left = temp_entries(tmpdir)
        wait_gone(outcome.leaked, 2.0)  # what a sweep asks: the owners gone
        tempdirs.sweep(str(tmpdir))  # as the next run's start-up does
        outcome.leaked_dirs = temp_entries(tmpdir)
        shutil.rmtree(tmpdir, ignore_errors=True)
    if report is not None:
        try:
            outcome.report = report_mod.load_report(report)
            report_mod.validate_report(outcome.report)
        except Exception as exc:  # recorded: the scenario's finding, asserted by the caller
            outcome.report_error = f"{type(exc).__name__}: {exc}"
    return outcome


def _wait_for(piddir: Path, pattern: str, count: int, proc: subprocess.Popen[str],
              timeout: float = RUN_TIMEOUT_S) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(list(piddir.glob(pattern))) >= count:
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.2)
    return False


def conftest(workdir: Path, text: str) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "conftest.py").write_text(text)


# --- the scenarios -----------------------------------------------------------------------

# One run, three worker faults, each followed by a test that must pass on the pool.
WORKER_FAULTS = {
    "test_kv_a2[FLASH_ATTN-bf16_h8]": "hang",
    "test_kv_a2_seam[need_True-bf16_h8]": "die",
    "test_kv_a3_seam[need_False-bf16_h8]": "oom",
}
WORKER_FAULTS_SELECT = ("--kv-backend", "FLASH_ATTN", "-k", "(kv_a2 or kv_a3) and bf16_h8")


def worker_faults(workdir: Path, timeout_s: float = 15.0) -> Outcome:
    """hang, die and oom in KV-A workers: errors, and the run goes on."""
    conftest(workdir, FAULT_BY_TEST.format(faults=WORKER_FAULTS))
    started = time.monotonic()
    proc, piddir = _start(workdir, [*WORKER_FAULTS_SELECT, "--kv-timeout", f"{timeout_s:g}",
                                    "--kv-report", "r.json", "--junitxml", "j.xml"])
    return _finish("worker faults (hang, die, oom)", proc, piddir, started,
                   workdir / "r.json", set())


# The tests of BLOCKING_SELECT that ask BLOCKING's declaration, in the order they run.
BLOCKING_TESTS = ("test_kv_l1[BLOCKING]", "test_kv_l2[BLOCKING]", "test_kv_l3[BLOCKING]",
                  "test_kv_l8_canonical_honoured[BLOCKING]",
                  "test_kv_l8_canonical_refused[BLOCKING]", "test_kv_l8_alias[BLOCKING]",
                  "test_kv_l8_worker_disagreement[BLOCKING]",
                  "test_kv_l8_worker_alias[BLOCKING]", "test_kv_l8_env_honoured[BLOCKING]",
                  "test_kv_l8_env_refused[BLOCKING]")
BLOCKING_SELECT = ("--kv-backend", "BLOCKING", "--kv-backend", "GOOD", "-k",
                   "(kv_l1 or kv_l2 or kv_l3 or kv_l8) and not kv_l1_name")


def blocking_declaration(workdir: Path, timeout_s: float = 2.0) -> Outcome:
    """A backend whose indexes_kv_by_block_stride() blocks for minutes, asked by 10 tests:
    the first pays the timeout, the others error at once citing it."""
    conftest(workdir, BLOCKING_BACKEND)
    started = time.monotonic()
    proc, piddir = _start(workdir, [*BLOCKING_SELECT, "--kv-timeout", f"{timeout_s:g}",
                                    "--kv-report", "r.json", "--junitxml", "j.xml"])
    return _finish("blocking declaration", proc, piddir, started, workdir / "r.json", set())


def hung_declaration(workdir: Path, timeout_s: float = 20.0) -> Outcome:
    """The whole suite for one backend whose declaration never
    returns, at ``--kv-timeout 20``; 20 tests ask it, one budget is paid (< 60 s)."""
    conftest(workdir, backends_conftest({"BLOCKING": Blocking}))
    started = time.monotonic()
    proc, piddir = _start(workdir, ["--kv-backend", "BLOCKING", "--kv-timeout", f"{timeout_s:g}",
                                    "--kv-report", "r.json"])
    return _finish("hung declaration", proc, piddir, started, workdir / "r.json", set())


# A case asking for a BlockPool of 10^12 blocks (before case limits: a host OOM).
HUGE_CASE = '[[case]]\nid = "huge"\nnum_pages = 1000000000000\n'


def huge_case(workdir: Path) -> Outcome:
    """``--kv-cases huge.toml``: a usage error naming the file, case, key and limit, before
    anything heavy is imported (< 5 s); no report is written."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "huge.toml").write_text(HUGE_CASE)
    started = time.monotonic()
    proc, piddir = _start(workdir, ["--kv-cases", "huge.toml", "-k", "kv_n1",
                                    "--kv-report", "r.json"])
    return _finish("huge case", proc, piddir, started, None, set(), timeout=120.0)


def killed(workdir: Path, *, xdist: bool, sig: int) -> Outcome:
    """Ctrl-C (SIGINT to the process group), SIGTERM or SIGKILL of pytest / the xdist
    controller, while KV-A workers hang mid-command (and, with ``xdist``, two xdist workers
    live).  SIGTERM goes to pytest alone, as a supervisor (``timeout``, a CI job's
    cancel, ``kill``) sends it.

    Before the hang, ``test_kv_a2[FLASH_ATTN-bf16_h8]`` finishes (serially), so an
    interrupted run has a result to report.
    """
    hang = {"need_True": "hang"} if not xdist else {"seam": "hang"}
    conftest(workdir, FAULT_BY_TEST.format(faults=hang))
    args = ["--kv-backend", "FLASH_ATTN", "-k", "kv_a2 and bf16_h8", "--kv-timeout", "600"]
    if xdist:
        args += ["-n", "2"]
    reported = sig != signal.SIGKILL
    if reported:
        args += ["--kv-report", "r.json"]
    started = time.monotonic()
    proc, piddir = _start(workdir, args)
    watched: set[int] = set()
    if _wait_for(piddir, "*.hang", 2 if xdist else 1, proc):
        time.sleep(0.5)
        watched = descendants(proc.pid)
        if sig == signal.SIGINT:
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        else:
            os.kill(proc.pid, sig)  # pytest alone
    how = "Ctrl-C" if sig == signal.SIGINT else signal.Signals(sig).name
    outcome = _finish(f"{how} {'xdist controller' if xdist else 'pytest'}", proc, piddir,
                      started, workdir / "r.json" if reported else None, watched,
                      timeout=120.0)
    outcome.watched.add(proc.pid)
    return outcome


# Holds the run in one of its start-up hooks (marking that it is there) until a signal
# comes: ``configure`` (a conftest's pytest_configure, after the plugin's) or
# ``sessionstart`` (the backends hook, which discovery calls from pytest_sessionstart).
STARTUP_HOLD = '''
import os
import pathlib
import time


def _hold():
    pathlib.Path(os.environ["KVCONFORM_WORKER_PIDDIR"], "starting.mark").touch()
    time.sleep(300)
'''
STARTUP_HOOKS = {
    "configure": "\n\ndef pytest_configure(config):\n    _hold()\n",
    "sessionstart": "\n\ndef pytest_kvconform_backends(config):\n    _hold()\n    return {}\n",
}
# An entry that matches a collected test: "stale" only if it were checked without one.
STARTUP_XFAILS = '''
[[xfail]]
backend = "*"
clause = "KV-L8"
test = "test_kv_l8_alias"
match = "KeyError"
reason = "known"
'''


def interrupted_at_startup(workdir: Path, where: str) -> Outcome:
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) while the run is held
    in a start-up hook, before anything was collected; with ``--kv-report``."""
    conftest(workdir, STARTUP_HOLD + STARTUP_HOOKS[where])
    (workdir / "known.toml").write_text(STARTUP_XFAILS)
    started = time.monotonic()
    proc, piddir = _start(workdir, ["--kv-strict", "--kv-xfails", "known.toml", "-k", "kv_l1",
                                    "--kv-report", "r.json"])
    watched: set[int] = set()
    if _wait_for(piddir, "starting.mark", 1, proc, timeout=300):
        watched = descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
    outcome = _finish(f"Ctrl-C in {where}", proc, piddir, started, workdir / "r.json",
                      watched, timeout=120.0)
    outcome.watched.add(proc.pid)
    return outcome


# Kills the xdist worker that runs KILLED_TEST, from inside the test's call (after its
# set-up was reported), as the kernel's OOM killer would.
KILLED_TEST = "test_kv_l1[GOOD]"
KILL_XDIST_WORKER = f'''

import signal

import pytest


class _Kill:  # a registered plugin: the suite's tests live outside this conftest's directory
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item):
        if item.name == {KILLED_TEST!r} and os.environ.get("PYTEST_XDIST_WORKER"):
            os.kill(os.getpid(), signal.SIGKILL)


def pytest_configure(config):
    config.pluginmanager.register(_Kill())
'''


def xdist_worker_killed(workdir: Path) -> Outcome:
    """``-n 2``: the xdist worker running :data:`KILLED_TEST` is SIGKILLed mid-test."""
    conftest(workdir, "import os\n" + backends_conftest({"GOOD": Good}) + KILL_XDIST_WORKER)
    started = time.monotonic()
    proc, piddir = _start(workdir, ["-n", "2", "--kv-backend", "GOOD", "-k", "kv_l1 or kv_l2",
                                    "--kv-report", "r.json"])
    return _finish("xdist worker killed", proc, piddir, started, workdir / "r.json", set())


def concurrent_writers(workdir: Path) -> Outcome:
    """Two runs started together, writing one ``--kv-report`` path.

    Whichever writes last, ``r.json`` must validate and ``r.md`` name its run id: a
    mixed pair is recorded as the report's error.  The exit status is the first
    non-zero one of the two runs (0 if both passed).
    """
    conftest(workdir, backends_conftest({"GOOD": Good}))
    started = time.monotonic()
    runs = [_start(workdir, ["--kv-backend", "GOOD", "-k", "kv_l1", "--kv-report", "r.json"])
            for _ in range(2)]
    outcomes = [_finish("concurrent writers", proc, piddir, started, workdir / "r.json", set())
                for proc, piddir in runs]
    first, second = outcomes
    first.returncode = first.returncode or second.returncode
    first.output += "\n[faultkit] second run:\n" + second.output
    first.seconds = max(first.seconds, second.seconds)
    first.leaked |= second.leaked
    first.workers |= second.workers
    first.watched |= second.watched
    first.temp_left += second.temp_left
    first.peak_rss_mib = max(first.peak_rss_mib, second.peak_rss_mib)
    first.leaked_dirs += second.leaked_dirs
    first.report_error = first.report_error or second.report_error
    if first.report_error is None:
        try:
            report_mod.check_pair(workdir / "r.json")
        except report_mod.ReportError as exc:
            first.report_error = f"ReportError: {exc.message}"
    return first


def terminated_at_startup(workdir: Path, *, early: bool = False) -> Outcome:
    """SIGTERM to pytest during start-up, with ``--kv-report``: once the run has made its
    temporary directory (the fork server started, importing vLLM; pytest about to import
    vllm-omni for discovery), or, ``early``, 1 s after the process started (Python and
    pytest still loading: SIGTERM may still have its default effect then)."""
    conftest(workdir, "")
    started = time.monotonic()
    proc, piddir = _start(workdir, ["--kv-backend", "FLASH_ATTN", "-k", "kv_a2 and bf16_h8",
                                    "--kv-report", "r.json"])
    tmpdir = _tmpdirs[proc.pid]
    if early:
        time.sleep(1.0)
    else:
        deadline = time.monotonic() + 120
        while not any(p.name.startswith(tempdirs.PREFIX) for p in tmpdir.iterdir()) and \
                proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    watched = descendants(proc.pid)
    os.kill(proc.pid, signal.SIGTERM)
    outcome = _finish(f"SIGTERM {'early' if early else 'in start-up'}", proc, piddir, started,
                      None if early else workdir / "r.json", watched, timeout=120.0)
    outcome.watched.add(proc.pid)
    return outcome


# Sends the run its own signal (``SIG_NAME``, ``SIG_TIMES`` times) at one moment of its end:
# ``sessionfinish`` (a conftest's last end-of-run hook: the report is on disk or about to
# be), ``unconfigure`` (the summary printed, the plugins unconfiguring) or ``atexit`` (the
# interpreter exiting).
LATE_SIGNAL = '''
import atexit
import os
import signal

import pytest

MOMENT = os.environ["SIG_AT"]


def _send():
    for _ in range(int(os.environ.get("SIG_TIMES", "1"))):
        os.kill(os.getpid(), getattr(signal, os.environ["SIG_NAME"]))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    if MOMENT == "sessionfinish":
        _send()


def pytest_unconfigure(config):
    if MOMENT == "unconfigure":
        _send()


if MOMENT == "atexit":
    atexit.register(_send)
'''
LATE_SELECT = ("--kv-backend", "GOOD", "-k", "kv_l1 or kv_l2")


def signalled_late(workdir: Path, moment: str | None, sig: int = signal.SIGTERM,
                   times: int = 1) -> Outcome:
    """``sig`` sent ``times`` by the run to itself at ``moment`` of its end (None: never, the
    baseline), with ``--kv-report``."""
    conftest(workdir, backends_conftest({"GOOD": Good}) + LATE_SIGNAL)
    started = time.monotonic()
    extra = {"SIG_AT": moment or "", "SIG_NAME": signal.Signals(sig).name,
             "SIG_TIMES": str(times)}
    proc, piddir = _start(workdir, [*LATE_SELECT, "--kv-report", "r.json"], extra)
    return _finish(f"{signal.Signals(sig).name} x{times} at {moment}", proc, piddir, started,
                   workdir / "r.json", set(), timeout=300.0)


# A backend whose declaration loops in C, holding the GIL, once it marked that it started.
GIL_HOLDING = '''

import pathlib


class GilHolding:
    @classmethod
    def indexes_kv_by_block_stride(cls):
        pathlib.Path(os.environ["KVCONFORM_WORKER_PIDDIR"], "declaring.mark").touch()
        return sum(range(10**13)) < 0


def pytest_kvconform_backends(config):
    return {"HOG": GilHolding}
'''


def terminated_in_a_gil_holding_declaration(workdir: Path) -> Outcome:
    """SIGTERM to pytest while a backend's declaration loops holding the GIL in test_kv_l1
    (``--kv-timeout 600``, far longer than the wait): the time from the signal to the exit
    is the outcome's ``seconds``."""
    conftest(workdir, "import os\n" + GIL_HOLDING)
    proc, piddir = _start(workdir, ["--kv-backend", "HOG", "-k", "kv_l1 or kv_l2",
                                    "--kv-timeout", "600", "--kv-report", "r.json"])
    watched: set[int] = set()
    started = time.monotonic()
    if _wait_for(piddir, "declaring.mark", 1, proc, timeout=300):
        time.sleep(1.0)
        watched = descendants(proc.pid)  # the forked check and its declaration's loop
        started = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
    outcome = _finish("SIGTERM in a GIL-holding declaration", proc, piddir, started,
                      workdir / "r.json", watched, timeout=120.0)
    outcome.watched.add(proc.pid)
    return outcome


SCENARIOS = {
    "worker-faults": worker_faults,
    "blocking-declaration": blocking_declaration,
    "sigint-serial": lambda d: killed(d, xdist=False, sig=signal.SIGINT),
    "sigkill-serial": lambda d: killed(d, xdist=False, sig=signal.SIGKILL),
    "sigint-xdist": lambda d: killed(d, xdist=True, sig=signal.SIGINT),
    "sigkill-xdist": lambda d: killed(d, xdist=True, sig=signal.SIGKILL),
    "concurrent-writers": concurrent_writers,
    "sigterm-early": lambda d: terminated_at_startup(d, early=True),
    "sigterm-startup": terminated_at_startup,
    "sigterm-serial": lambda d: killed(d, xdist=False, sig=signal.SIGTERM),
    "sigterm-xdist": lambda d: killed(d, xdist=True, sig=signal.SIGTERM),
    "huge-case": huge_case,
    "hung-declaration": hung_declaration,
    "sigterm-after-summary": lambda d: signalled_late(d, "unconfigure"),
    "sigterm-gil-declaration": terminated_in_a_gil_holding_declaration,
}
