"""What the KV-A workers print is kept for the run, never on the terminal (workers/worker_log.py).

Pools here preload nothing (a worker starts in well under a second); the end-to-end runs
are in tests/session/test_worker_output.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pytest_kvconform.workers import pool as workers
from pytest_kvconform.workers import protocol, worker_log


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
