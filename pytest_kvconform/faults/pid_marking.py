"""PID files a test counts processes by: ``$KVCONFORM_WORKER_PIDDIR/<pid>.<role>``.

Written only into a directory this user alone may plant files in, never through a link
and never over an existing file; a refusal is one line on stderr and the process carries on.
"""

from __future__ import annotations

import contextlib
import os
import stat

from pytest_kvconform.adapters.fault_hook import PIDDIR_ENV


def _open_piddir(piddir: str) -> int:
    """``$KVCONFORM_WORKER_PIDDIR`` opened as a directory, if only this user can plant files
    in it; ValueError (naming it) if not.  One descriptor: no path swap after the check."""
    fd = os.open(piddir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    st = os.fstat(fd)
    why = None
    if st.st_uid != os.geteuid():
        why = f"it belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    elif st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        why = "anyone may write to it (world-writable, no sticky bit)"
    if why is not None:
        os.close(fd)
        raise ValueError(f"${PIDDIR_ENV}={piddir}: refusing to write PID files there: {why}")
    return fd


def check_piddir() -> None:
    """At a run's start: ValueError (one line naming it) if the PID-file directory is set
    and unsafe or not a directory; nothing if it is unset."""
    piddir = os.environ.get(PIDDIR_ENV)
    if not piddir:
        return
    try:
        os.close(_open_piddir(piddir))
    except OSError as exc:
        raise ValueError(f"${PIDDIR_ENV}={piddir}: not a directory this run can use "
                         f"({exc.strerror})") from None


def mark_pid(suffix: str) -> bool:
    """Create ``$KVCONFORM_WORKER_PIDDIR/<pid>.<suffix>`` for a test to find this process.

    Never through a link and never over an existing file (``O_CREAT|O_EXCL|O_NOFOLLOW``,
    in the directory :func:`_open_piddir` checked): a symlink planted under the name
    cannot get its target written.  A refusal is one line on stderr (a worker's log) and
    the process carries on: the file only helps a test count processes, and refusing it
    must not change the result the process runs for.  False when nothing was written.
    """
    piddir = os.environ.get(PIDDIR_ENV)
    if not piddir:
        return False
    name = f"{os.getpid()}.{suffix}"
    try:
        directory = _open_piddir(piddir)
    except (OSError, ValueError) as exc:
        _refuse(name, str(exc))
        return False
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=directory)
    except FileExistsError:
        _refuse(name, f"{os.path.join(piddir, name)} already exists (a file or a symbolic "
                      "link put there before this process): left as it is")
        return False
    except OSError as exc:
        _refuse(name, f"{os.path.join(piddir, name)}: {exc.strerror}")
        return False
    finally:
        os.close(directory)
    os.close(fd)
    return True


def _refuse(name: str, why: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, f"kvconform: ${PIDDIR_ENV}: not writing {name}: {why}\n".encode())
