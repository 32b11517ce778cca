"""The KV-A workers' fork server: vLLM / vllm-omni imported once, workers forked.

multiprocessing's ``forkserver`` start method, with a preload: one server process,
started by the test process, imports the workers' modules once; every worker is
then forked from it in well under a second instead of importing them again
(benchmarks/RESULTS.md, "KV-A workers").  The server only *imports*: it never loads
plugins, builds a config or touches CUDA (each worker does those itself after the fork),
and it is used only for ``"cpu"`` placements (``workers/pool.py`` spawns GPU workers).

The server is one per process (a ``multiprocessing`` global), so it is shared by the
pools of pytester's inline runs; :func:`acquire` / :func:`release` count its users
and the last release stops it, so no server outlives the session.

Under xdist the controller starts the one server of the run and hands it to its
workers through ``workerinput`` (:func:`share`); each worker :func:`attach`-es to it
instead of starting its own, so a CPU run imports vLLM once per xdist worker plus
once for the server, not twice per worker.  An attached process never
stops the server (it is its starter's): :func:`stop` only detaches.

Lifetime: its preload starts with :mod:`forkserver_guard`, whose import ties the
server to the process that started it (parent-death signal, armed before the slow
imports: a SIGKILLed pytest never leaves a server importing), and ends with
:mod:`forkserver_ready`, whose import marks the preload done, so a start-up wait is
bounded (:func:`wait_ready`) instead of blocking in ``Process.start``.  The server is
started only from the main thread (a parent-death signal fires when the *thread*
that started the server exits).  Its stdout / stderr go to ``server.log`` in its
directory, which is in the run's own (``workers/tempdirs.py``), and so is its ``$TMPDIR``:
what its imports leave there (cuda.tile makes a directory at import) goes with the run.
The run reads that log for its account of what the workers printed (``worker_log.py``).

Stdlib only.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from pytest_kvconform.workers import lifetime, tempdirs, worker_log

GUARD = "pytest_kvconform.workers.forkserver_guard"
READY = "pytest_kvconform.workers.forkserver_ready"
# Read (and removed) by forkserver_guard inside the server: who started it, its directory,
# and where this process imports the package from (a server importing another copy exits).
PARENT_ENV = "KVCONFORM_FORKSERVER_PARENT"
DIR_ENV = "KVCONFORM_FORKSERVER_DIR"
PACKAGE_ENV = "KVCONFORM_FORKSERVER_PACKAGE"
READY_FILE = "ready"
LOG_FILE = "server.log"
TMP_DIR = "tmp"  # the server's $TMPDIR (a forked worker goes back to its parent's)
_POLL_S = 0.02
SHARE_KEY = "kvconform_forkserver"  # workerinput: the controller's server (share())

# The stdlib's one server per process (private: its pid and _stop are what tests use too).
_server: Any = multiprocessing.forkserver._forkserver
_dir: str | None = None  # the running server's directory (ready marker, log)
_preload: tuple[str, ...] = ()  # what the running server imported
_holders = lifetime.Holders(lambda: stop())
_attached = False  # the server is another process's (attach())


def package_dir() -> str:
    """The directory of the pytest_kvconform this process imports (this file's grandparent)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def usable() -> bool:
    """Linux (the guard's parent-death signal) and a ``forkserver`` start method."""
    return sys.platform.startswith("linux") and \
        "forkserver" in multiprocessing.get_all_start_methods()


def pid() -> int | None:
    """The running (or last started) server's pid, or None."""
    value = _server._forkserver_pid
    return int(value) if value is not None else None


def _gone(server_pid: int) -> bool:
    """Whether another process's server has exited: not our child, so no wait*(); a zombie
    awaiting its starter counts as gone."""
    try:
        with open(f"/proc/{server_pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def _exited(server_pid: int) -> bool:
    """Whether the server has exited, without reaping it (multiprocessing reaps it)."""
    if _attached:
        return _gone(server_pid)
    try:
        return os.waitid(os.P_PID, server_pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def running() -> bool:
    server_pid = pid()
    return server_pid is not None and _dir is not None and not _exited(server_pid)


def start(preload: Sequence[str]) -> bool:
    """Start the server preloading ``preload`` (modules only) unless one is running.

    Returns without waiting for the imports.  False when no server can be started
    here: not Linux, or not the main thread (see the module docstring).
    """
    global _dir, _preload
    if running() and (_holders.count > 0 or set(preload) <= set(_preload)):
        return True  # in use (its workers die with it), or it preloads all of that already
    if not usable() or threading.current_thread() is not threading.main_thread():
        return False
    stop()
    _dir = tempdirs.make("forkserver")
    _preload = tuple(preload)
    worker_log.watch(os.path.join(_dir, LOG_FILE), worker_log.FORK_SERVER)  # the run's account
    _server.set_forkserver_preload([GUARD, *preload, READY])
    server_tmp = os.path.join(_dir, TMP_DIR)
    os.mkdir(server_tmp, 0o700)
    tell = {PARENT_ENV: str(os.getpid()), DIR_ENV: _dir,
            PACKAGE_ENV: package_dir(),
            "TMPDIR": server_tmp,  # what its imports leave in $TMPDIR goes with _dir
            # Its preload imports what this process imports: this process's sys.path, not
            # its own current directory first (multiprocessing hands a server no sys.path;
            # a clone's cwd would shadow the installed package, which the guard refuses).
            "PYTHONSAFEPATH": "1", "PYTHONPATH": _parent_path()}
    saved = {key: os.environ.get(key) for key in tell}
    os.environ.update(tell)  # the server inherits this environment at its start
    try:
        _server.ensure_running()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    address = _server._forkserver_address
    if isinstance(address, str):  # its socket, in this process's multiprocessing pymp-* dir
        tempdirs.claim(os.path.dirname(address))
    return True


def _parent_path() -> str:
    """This process's import path as ``$PYTHONPATH`` (its current directory made explicit),
    less any entry holding another copy of this package: a directory put first after this
    process imported it (a conftest's ``sys.path.insert(0, clone)``) would have the server
    import that copy, which the guard refuses."""
    own, package = os.path.split(package_dir())
    entries = [os.path.abspath(p or os.getcwd()) for p in sys.path]
    return os.pathsep.join(
        p for p in entries if p == own or not os.path.isdir(os.path.join(p, package)))


def attached() -> bool:
    """Whether this process forks its workers from another process's server."""
    return _attached


def share() -> dict[str, Any] | None:
    """This process's running server as other processes reach it (for ``workerinput``)."""
    if _attached or not running():
        return None
    return {"address": _server._forkserver_address, "pid": pid(), "dir": _dir,
            "preload": list(_preload)}


def attach(shared: Mapping[str, Any]) -> bool:
    """Fork this process's workers from the server :func:`share` described (an xdist
    controller's).  False, and nothing changed, if this process runs its own server or
    that one is gone; a worker forked from it is this process's child in multiprocessing's
    terms (its pipe, its exit status), the server's in the OS's, as with an own server.
    """
    global _dir, _preload, _attached
    if _attached or running() or not usable():
        return False
    server_pid = int(shared["pid"])
    if _gone(server_pid):
        return False
    _attached = True
    _server._forkserver_address = shared["address"]
    _server._forkserver_pid = server_pid
    # Sent to each forked worker as "the server's alive fd", which a worker never uses.
    _server._forkserver_alive_fd = os.open(os.devnull, os.O_RDONLY)
    _server.ensure_running = _ensure_attached  # multiprocessing's would wait on a non-child
    _dir, _preload = str(shared["dir"]), tuple(shared["preload"])
    return True


def attach_after_fork(shared: Mapping[str, Any] | None) -> bool:
    """In a process ``os.fork``-ed from the server's starter: forget the inherited server
    (it is the starter's: this process must never stop it) and :func:`attach` to it as
    :func:`share` described it.  A starter that was itself attached passes None: its
    attachment holds in the fork as it is.  False when no server is there to use."""
    global _dir
    if _attached:
        return True
    if _server._forkserver_pid is not None:
        with contextlib.suppress(OSError, TypeError):
            os.close(_server._forkserver_alive_fd)
        _server._forkserver_address = _server._forkserver_alive_fd = None
        _server._forkserver_pid = None
        _dir = None
    return shared is not None and attach(shared)


def _ensure_attached() -> None:
    """``ensure_running`` for an attached server: the resource tracker, and a live server."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    server_pid = pid()
    if server_pid is None or _exited(server_pid):
        raise RuntimeError(f"the shared kvconform fork server (pid {server_pid}) is gone")


def _detach() -> None:
    global _dir, _attached
    with contextlib.suppress(OSError, TypeError):
        os.close(_server._forkserver_alive_fd)
    with contextlib.suppress(AttributeError):
        del _server.ensure_running
    _server._forkserver_address = _server._forkserver_alive_fd = None
    _server._forkserver_pid = None
    _dir, _attached = None, False


def wait_ready(timeout: float) -> bool | None:
    """True once the server's preload is done; False if it died; None after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        server_pid = pid()
        if server_pid is None or _dir is None or _exited(server_pid):
            return False
        if os.path.exists(os.path.join(_dir, READY_FILE)):
            return True
        if time.monotonic() >= deadline:
            return None
        time.sleep(_POLL_S)


def is_ready() -> bool:
    return running() and _dir is not None and os.path.exists(os.path.join(_dir, READY_FILE))


def log_tail(chars: int = 2000) -> str:
    """The end of the server's stdout / stderr (its imports' messages)."""
    if _dir is None:
        return "(no fork server)"
    try:
        with open(os.path.join(_dir, LOG_FILE), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - chars))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return "(no fork server log)"


def log_size() -> int:
    """The server log's size now: where a worker forked next starts writing to it."""
    if _dir is None:
        return 0
    try:
        return os.path.getsize(os.path.join(_dir, LOG_FILE))
    except OSError:
        return 0


def log_since(offset: int, chars: int = 2000) -> str:
    """What the server's log got from ``offset`` on (its last ``chars``): a forked worker's
    output before it opened its own log (``workers/pool.py``)."""
    if _dir is None:
        return ""
    try:
        with open(os.path.join(_dir, LOG_FILE), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(offset, f.tell() - chars))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def stop() -> None:
    """Kill the server (its workers die with it, by their parent-death signal) and reap it;
    detach from it if it is another process's."""
    global _dir
    if _attached:
        _detach()
        return
    server_pid = pid()
    if server_pid is not None:
        with contextlib.suppress(OSError):
            os.kill(server_pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            _server._stop()  # closes our end of its alive pipe, reaps it
        _server._forkserver_pid = None  # even if _stop failed half-way
    if _dir is not None:
        shutil.rmtree(_dir, ignore_errors=True)
        _dir = None


def acquire() -> None:
    """One more user of the server (a pool with forked workers)."""
    _holders.hold()


def release() -> None:
    """One user fewer; the last one stops the server."""
    _holders.release()


atexit.register(stop)
