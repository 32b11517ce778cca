"""The fork server's first import (``workers/forkserver.py``): die with the process that started it.

Imported inside the server before the slow vLLM / vllm-omni imports, so a test process
SIGKILLed while the server still imports leaves no server behind (multiprocessing's
server only notices its parent's end between requests).  Also sends the server's
output to its log file, and exits if the server would import another copy of this
package than its parent (its workers would run that copy's code).  And pauses the garbage
collector for the imports (``forkserver_ready`` freezes what they made and resumes it; why:
``adapters/heap.py``).  Anywhere else (the variables unset) importing it does nothing.
"""

from __future__ import annotations

import os
import signal

from pytest_kvconform.adapters import heap
from pytest_kvconform.workers import lifetime

_PARENT_ENV = "KVCONFORM_FORKSERVER_PARENT"  # forkserver.PARENT_ENV (same layer, kept apart)
_DIR_ENV = "KVCONFORM_FORKSERVER_DIR"
_PACKAGE_ENV = "KVCONFORM_FORKSERVER_PACKAGE"
# The server's directory (its log, and forkserver_ready's marker); None outside a server.
DIRECTORY: str | None = None


def _arm() -> None:
    global DIRECTORY
    parent = os.environ.pop(_PARENT_ENV, None)
    directory = os.environ.pop(_DIR_ENV, None)
    package = os.environ.pop(_PACKAGE_ENV, None)
    if parent is None:
        return
    lifetime.set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != int(parent):  # the parent died before the signal was armed
        os._exit(lifetime.EXIT_ORPHANED)
    DIRECTORY = directory
    if directory:  # forkserver_ready resumes the collector where this is set
        heap.pause()  # the preload's imports: nothing they make is garbage worth the walks
        fd = os.open(os.path.join(directory, "server.log"),
                     os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package's
    if package and here != package:
        os.write(2, f"kvconform fork server: imports {here}, its parent {package}\n".encode())
        os._exit(lifetime.EXIT_ORPHANED)


_arm()
