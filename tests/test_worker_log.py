"""What the KV-A workers print is kept for the run, never on the terminal (workers/worker_log.py).

Pools here preload nothing (a worker starts in well under a second); the end-to-end runs
are in tests/test_worker_output.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_kvconform.workers import pool as workers
from pytest_kvconform.workers import protocol, worker_log

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def own() -> Iterator[workers.WorkerPool]:
    p = workers.WorkerPool(preload=())
    yield p
    p.close()


def _texts(messages: list[dict[str, object]], source: str) -> list[str]:
    return [str(m["text"]) for m in messages if m["source"] == source]


@pytest.mark.parametrize("placement", ["cpu", "cuda:9"], ids=["forked", "spawned"])
def test_every_line_a_worker_prints_is_in_the_capture(
        placement: str, own: workers.WorkerPool, capfd: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Python-level prints, still buffered when the command answers (a spawned worker
    starts without $PYTHONUNBUFFERED), on both streams: all of them, in order, under the
    worker's name; none on this process's descriptors."""
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    start = worker_log.mark()
    (handle,) = own.get([placement])
    assert handle.method == ("forkserver" if placement == "cpu" else "spawn")
    out = [f"kvconform-test: stdout line {i}" for i in range(2000)]
    err = [f"kvconform-test: stderr line {i}" for i in range(2000)]
    handle.request("print", text="\n".join(out), stream="stdout")
    handle.request("print", text="\n".join(err), stream="stderr")
    messages = worker_log.since(start)
    assert _texts(messages, worker_log.worker_source(handle.label)) == out + err
    printed = capfd.readouterr()
    assert "kvconform-test" not in printed.out + printed.err


def test_a_run_reads_only_what_was_printed_since_it_started(own: workers.WorkerPool) -> None:
    (handle,) = own.get(["cpu"])
    handle.request("print", text="kvconform-test: before the run")
    start = worker_log.mark()
    handle.request("print", text="kvconform-test: during the run")
    texts = _texts(worker_log.since(start), worker_log.worker_source(handle.label))
    assert texts == ["kvconform-test: during the run"]


def test_a_dying_workers_last_words_are_in_its_error_and_in_the_capture(
        own: workers.WorkerPool) -> None:
    start = worker_log.mark()
    (handle,) = own.get(["cpu"])
    handle.request("print", text="kvconform-test: still fine")
    with pytest.raises(protocol.WorkerDied) as info:
        handle.request("crash", code=7, text="kvconform-test: segfault stand-in")
    message = str(info.value)
    assert "exit code 7" in message and "--- worker stderr (tail) ---" in message
    assert "kvconform-test: still fine\nkvconform-test: segfault stand-in" in message
    texts = _texts(worker_log.since(start), worker_log.worker_source(handle.label))
    assert texts == ["kvconform-test: still fine", "kvconform-test: segfault stand-in"]


def test_the_end_of_a_run_waits_for_the_workers_last_teardowns(own: workers.WorkerPool) -> None:
    (handle,) = own.get(["cpu"])
    handle.release_later()
    own.settle(30)
    assert not handle.busy and handle.alive


CAPTURED = r'''
import logging, os, sys
from pytest_kvconform.workers import worker_log

start = worker_log.mark()
handler = logging.StreamHandler(sys.stdout)  # as vLLM's, made at its import
log = logging.getLogger("kvconform_test")
log.addHandler(handler)
print("before", flush=True)
with worker_log.captured():
    print("python-level print")              # buffered: flushed into the capture
    os.write(2, b"C-level write\n")
    log.warning("WARNING logged inside")
log.warning("logged after")
# A buffered print reaches the capture when flushed, so the order is not the test's claim.
print("found", sorted((m["source"], m["text"]) for m in worker_log.since(start)), flush=True)
'''


def test_what_the_test_process_prints_between_tests_goes_to_the_capture() -> None:
    """At the descriptor level, as vLLM's handlers and C code write: in a process of its
    own, whose descriptors 1 and 2 are the terminal's as in a real run."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", CAPTURED], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    found = [("test process", "C-level write"), ("test process", "WARNING logged inside"),
             ("test process", "python-level print")]
    assert done.stdout.splitlines() == ["before", "logged after", f"found {found}"]
    assert done.stderr == ""
