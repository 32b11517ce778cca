"""One temporary directory per process, named after its owner, so no run's files outlive it.

Everything the harness writes to ``$TMPDIR`` in a process (the fork server's directory
and its temporary files, the KV-A worker pool's logs) lives under one
``kvconform-run-<pid>-XXXXXXXX`` directory.  It goes at exit (``atexit``: a normal end,
Ctrl-C, and SIGTERM, which the plugin turns into Ctrl-C's unwinding: ``workers/lifetime.py``).
SIGKILL leaves it behind; so :func:`sweep`, run when a run starts, removes the ones
whose owner is gone: same user, our prefix, owner PID no longer running (or running
since another time: the PID was reused).  A live owner's directory, another user's,
or one whose owner cannot be told is never touched.

multiprocessing's own ``pymp-*`` directory (the fork server's socket, in the process
that started it) is outside ours and is removed by multiprocessing at exit; a run
records it in its directory (:func:`claim`), so a sweep can prove it was ours and
remove it with the rest.

Stdlib only.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import stat
import tempfile

PREFIX = "kvconform-run-"
OWNER_FILE = "owner"  # "<pid> <start time>": the PID alone could be reused
CLAIMS_FILE = "claimed"  # directories outside ours that this run created (one a line)
CLAIMABLE = ("pymp-",)  # which ones a sweep may remove on a claim's word

_run: tuple[int, str] | None = None  # (owner pid, directory): a forked child has another pid


def start_time(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot, Linux ``/proc``), or None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[19].decode()
    except (OSError, IndexError):
        return None


def run_dir() -> str:
    """This process's directory, created on first use."""
    global _run
    pid = os.getpid()
    if _run is None or _run[0] != pid or not os.path.isdir(_run[1]):
        path = tempfile.mkdtemp(prefix=f"{PREFIX}{pid}-")
        with open(os.path.join(path, OWNER_FILE), "w", encoding="ascii") as f:
            f.write(f"{pid} {start_time(pid) or '?'}\n")
        _run = (pid, path)
    return _run[1]


def make(kind: str) -> str:
    """A fresh directory ``<kind>-XXXXXXXX`` in this process's run directory."""
    return tempfile.mkdtemp(prefix=f"{kind}-", dir=run_dir())


def claim(path: str) -> None:
    """Record that this run created ``path`` (outside its directory): a sweep may remove it
    once this process is gone."""
    with contextlib.suppress(OSError), \
            open(os.path.join(run_dir(), CLAIMS_FILE), "a", encoding="utf-8") as f:
        f.write(os.path.abspath(path) + "\n")


def remove() -> None:
    """Remove this process's directory (never a parent's, in a forked child)."""
    global _run
    if _run is not None and _run[0] == os.getpid():
        shutil.rmtree(_run[1], ignore_errors=True)
        _run = None


def owner_pid(name: str) -> int | None:
    """The owner PID a directory's name carries, or None if it is not one of ours."""
    if not name.startswith(PREFIX):
        return None
    head = name[len(PREFIX):].partition("-")[0]
    return int(head) if head.isdigit() else None


def owner_gone(path: str, pid: int) -> bool:
    """Whether the process that made ``path`` has ended (a zombie has; a reused PID has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # someone's process: not provably gone
        return False
    started = start_time(pid)
    if started is None:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            if f.read().rpartition(b")")[2].split()[0] in (b"Z", b"X"):
                return True
        with open(os.path.join(path, OWNER_FILE), encoding="ascii") as f:
            recorded = f.read().split()
    except (OSError, IndexError):
        return False  # being written, or unreadable: keep it
    return len(recorded) == 2 and recorded[1] != "?" and recorded[1] != started


def _ours(path: str, st: os.stat_result | None = None) -> bool:
    """A real directory (not a link) owned by this user."""
    try:
        st = st or os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def _claims(path: str, base: str) -> list[str]:
    """The claimed directories a sweep may remove: ``pymp-*`` directly in ``base``, ours."""
    try:
        with open(os.path.join(path, CLAIMS_FILE), encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    real_base = os.path.realpath(base)
    found = []
    for line in lines:
        parent, name = os.path.split(line)
        if name.startswith(CLAIMABLE) and os.path.realpath(parent) == real_base and \
                _ours(os.path.join(real_base, name)):
            found.append(os.path.join(real_base, name))
    return found


def sweep(base: str | None = None) -> list[str]:
    """Remove the run directories in ``base`` (default ``$TMPDIR``) whose owner is gone,
    with what they claimed; returns the paths removed."""
    base = base or tempfile.gettempdir()
    try:
        entries = list(os.scandir(base))
    except OSError:
        return []
    removed = []
    for entry in entries:
        pid = owner_pid(entry.name)
        if pid is None or pid == os.getpid():
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not _ours(entry.path, st) or not owner_gone(entry.path, pid):
            continue
        for claimed in _claims(entry.path, base):
            shutil.rmtree(claimed, ignore_errors=True)
            removed.append(claimed)
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


atexit.register(remove)
