"""A run's temporary files: one directory per process, swept once its owner is gone.

The sweep removes only what it can prove is a gone run's: our prefix, this user's, a
real directory, its owner PID not running (or running since another time: reused), and
of what it claimed only ``pymp-*`` directories beside it.  Whole runs (SIGTERM, SIGKILL)
are in tests/seeded/test_process.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_kvconform.workers import tempdirs

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(),
                                reason="owner start times are read from /proc (Linux)")


@pytest.fixture
def dead_pid() -> int:
    """A PID whose process has ended (and was reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def live_pid() -> Iterator[int]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def plant(base: Path, pid: int, started: str | None = None, claims: list[Path] = ()) -> Path:
    """A run directory as ``tempdirs.run_dir`` makes one, for ``pid``."""
    path = base / f"{tempdirs.PREFIX}{pid}-abcd1234"
    path.mkdir()
    (path / "workers-x").mkdir()
    (path / "workers-x" / "worker-cpu-0.log").write_text("log\n")
    recorded = started if started is not None else tempdirs.start_time(pid) or "?"
    (path / tempdirs.OWNER_FILE).write_text(f"{pid} {recorded}\n")
    if claims:
        (path / tempdirs.CLAIMS_FILE).write_text("".join(f"{c}\n" for c in claims))
    return path


def test_a_gone_runs_directory_and_its_pymp_claim_go_a_live_runs_stay(
        tmp_path: Path, dead_pid: int, live_pid: int) -> None:
    pymp = tmp_path / "pymp-dead0001"
    pymp.mkdir()
    (pymp / "listener-x").write_text("")
    stale = plant(tmp_path, dead_pid, started="12345", claims=[pymp])
    live_pymp = tmp_path / "pymp-live0001"
    live_pymp.mkdir()
    live = plant(tmp_path, live_pid, claims=[live_pymp])
    own = plant(tmp_path, os.getpid())
    unrelated = tmp_path / "pymp-unclaimed"
    unrelated.mkdir()

    removed = tempdirs.sweep(str(tmp_path))

    assert sorted(removed) == sorted([str(stale), str(pymp)])
    assert not stale.exists() and not pymp.exists()
    assert live.exists() and live_pymp.exists() and own.exists() and unrelated.exists()


def test_a_reused_pid_does_not_keep_a_gone_runs_directory(tmp_path: Path,
                                                          live_pid: int) -> None:
    """The PID runs again, but since another time than the one the owner file records."""
    reused = plant(tmp_path, live_pid, started="1")
    assert tempdirs.sweep(str(tmp_path)) == [str(reused)]


def test_an_owner_that_cannot_be_told_keeps_its_directory(tmp_path: Path,
                                                          live_pid: int) -> None:
    """No owner file yet (being made) or no start time recorded: a live PID keeps it."""
    unwritten = tmp_path / f"{tempdirs.PREFIX}{live_pid}-unwritte"
    unwritten.mkdir()
    unknown = plant(tmp_path, live_pid, started="?")
    assert tempdirs.sweep(str(tmp_path)) == []
    assert unwritten.exists() and unknown.exists()


def test_the_sweep_follows_no_link_and_no_claim_outside_its_directory(
        tmp_path: Path, dead_pid: int) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / "precious"
    target.mkdir()
    (target / "data").write_text("keep\n")
    outside = elsewhere / "pymp-outside"  # a pymp-* name, but not beside the run directory
    outside.mkdir()
    base = tmp_path / "tmp"
    base.mkdir()
    not_pymp = base / "precious-too"
    not_pymp.mkdir()
    linked = base / "pymp-linked"
    linked.symlink_to(target)
    (base / f"{tempdirs.PREFIX}{dead_pid}-linkedrun").symlink_to(target)
    stale = plant(base, dead_pid, started="7", claims=[outside, not_pymp, linked])

    assert tempdirs.sweep(str(base)) == [str(stale)]
    assert (target / "data").read_text() == "keep\n"
    assert outside.exists() and not_pymp.exists() and linked.is_symlink()


def test_names_not_ours_are_left_alone(tmp_path: Path, dead_pid: int) -> None:
    for name in (f"kvconform-forkserver-{dead_pid}", f"{tempdirs.PREFIX}x{dead_pid}-abc",
                 f"{tempdirs.PREFIX}-abc", "tmpabcdef"):
        (tmp_path / name).mkdir()
    assert tempdirs.sweep(str(tmp_path)) == []
    assert len(list(tmp_path.iterdir())) == 4


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory away")
def test_another_users_directory_is_left_alone(tmp_path: Path, dead_pid: int) -> None:
    theirs = plant(tmp_path, dead_pid, started="7")
    os.chown(theirs, 4242, 4242)
    assert tempdirs.sweep(str(tmp_path)) == []
    assert theirs.exists()


def test_the_run_directory_is_named_after_its_owner_and_removed_only_by_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempdirs.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(tempdirs, "_run", None)
    workers_dir = Path(tempdirs.make("workers"))
    run = workers_dir.parent
    assert run.parent == tmp_path and tempdirs.owner_pid(run.name) == os.getpid()
    assert (run / tempdirs.OWNER_FILE).read_text().split() == [
        str(os.getpid()), tempdirs.start_time(os.getpid())]
    assert not tempdirs.owner_gone(str(run), os.getpid())
    monkeypatch.setattr(tempdirs, "_run", (os.getpid() + 1, str(run)))  # a forked child's view
    tempdirs.remove()
    assert run.exists()
    monkeypatch.setattr(tempdirs, "_run", (os.getpid(), str(run)))
    tempdirs.remove()
    assert not run.exists() and tempdirs._run is None
