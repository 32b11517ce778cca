"""What production prints for the KV-A deployments: kept in files the run reads, off the terminal.

Each process of the worker pool has its file descriptors 1 and 2 on a file of its own in
the run's temporary directory (``tempdirs.py``): a KV-A worker on its
``worker-<placement>-<slot>.log`` (``child.py`` points them there first thing, so vLLM's
logging handlers, C code and the worker processes production's executor starts, which
inherit them, all write there), the fork server on its ``server.log`` (with what a forked
worker prints before it opens its own).

A run reads them all: :func:`mark` when it starts, :func:`since` when it ends, as messages
(``run_env.import_messages``) that each name their :data:`source <SOURCE_KEY>`.  The
files stay until their pool closes (after the run's report): ``WorkerHandle.stderr_tail``
reads a worker's for its diagnostics, as before.

Stdlib only.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import Any

from pytest_kvconform.adapters import run_env

WORKER_LOG_KEY = "worker_log"  # the report's environment key (report/schema.py)
SOURCE_KEY = "source"  # which process printed a message (besides import_log's level, text)
FORK_SERVER = "fork server"

_sources: dict[str, str] = {}  # path -> the process writing it, in the order first watched


def worker_source(label: str) -> str:
    """The source of a KV-A worker's messages (``label``: its placement and slot)."""
    return f"KV-A worker {label}"


def watch(path: str, source: str) -> None:
    """Read ``path`` with the run's output from now on; ``source`` names who writes it."""
    _sources.setdefault(path, source)


def mark() -> dict[str, int]:
    """Where each watched file ends now: a run that starts here reads from there."""
    sizes = {}
    for path in _sources:
        with contextlib.suppress(OSError):
            sizes[path] = os.path.getsize(path)
    return sizes


def since(start: Mapping[str, int]) -> list[dict[str, Any]]:
    """Everything written to the watched files after ``start`` (a :func:`mark`; a file
    watched since is read whole), as messages, each file's in order, each with its source.

    A file gone meanwhile (its pool or fork server closed) is skipped.
    """
    messages: list[dict[str, Any]] = []
    for path, source in list(_sources.items()):
        try:
            with open(path, "rb") as f:
                f.seek(start.get(path, 0))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        messages += [{**m, SOURCE_KEY: source} for m in run_env.import_messages(text)]
    return messages
