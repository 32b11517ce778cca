"""The fork server's last import (``workers/forkserver.py``): mark its preload done.

The test process waits for this marker, bounded, before it asks the server to fork
(``Process.start`` would otherwise block, unbounded, behind the imports).  The
objects the imports made are frozen out of the garbage collector's reach first, so
no forked worker's collections walk them (nor copy their pages), and the collector the
guard paused for the imports runs again.  Anywhere
else (the directory unset) importing it does nothing.
"""

from __future__ import annotations

import os

from pytest_kvconform.adapters import heap
from pytest_kvconform.workers import forkserver_guard


def _mark() -> None:
    if forkserver_guard.DIRECTORY:
        # What the server imported: out of every collection, in every fork; the collector
        # forkserver_guard paused for the imports (in a fresh interpreter, on) runs again.
        heap.resume(True)
        with open(os.path.join(forkserver_guard.DIRECTORY, "ready"), "w"):
            pass


_mark()
