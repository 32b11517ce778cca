"""The executor's wire: the configs are serialised by the installed vLLM's own broadcast
queue (``MessageQueue.enqueue``), found by feature detection, and read back as a worker's
queue reads them.  A queue whose ``enqueue`` reads state its constructor grew (vLLM 0.32's
tensor arena) is still driven; one that cannot be built says why it fell back."""

from __future__ import annotations

from typing import Any

import pytest

from pytest_kvconform.adapters import executor_wire

shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")


def test_the_installed_queue_serialises_the_envelope_and_a_worker_reads_it_back() -> None:
    torch = pytest.importorskip("torch")
    rpc = executor_wire.rpc_message(["c0", "c1"], 64)
    frames, how = executor_wire.encode({**rpc, "tensor": torch.arange(300_000)})
    assert how == executor_wire.ENQUEUE
    assert len(frames) == 2  # the tensor's bytes cross out of band, as the queue sends them
    back = executor_wire.decode(frames)
    assert back["args"] == (["c0", "c1"], 64)
    assert int(back["tensor"].sum()) == 299_999 * 300_000 // 2


class _QueueWithNewState(shm_broadcast.MessageQueue):  # type: ignore[misc]
    """A queue whose constructor sets state its ``enqueue`` reads, as a new vLLM adds
    (0.32's ``tensor_arena``): a writer built by hand, without it, cannot be driven."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.new_state = "built"

    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        assert self.new_state == "built"  # AttributeError on a hand-built writer
        super().enqueue(obj, timeout)


def test_a_queue_grown_new_state_is_still_driven(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_broadcast, "MessageQueue", _QueueWithNewState)
    frames, how = executor_wire.encode({"x": 1})
    assert how == executor_wire.ENQUEUE
    assert executor_wire.decode(frames) == {"x": 1}


def test_a_queue_that_cannot_be_built_falls_back_naming_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    class Moved(shm_broadcast.MessageQueue):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise TypeError("__init__() missing 1 required positional argument: 'group'")

    monkeypatch.setattr(shm_broadcast, "MessageQueue", Moved)
    frames, how = executor_wire.encode({"x": 1})
    assert how == ("pickle (fallback: MessageQueue could not be built: TypeError: __init__() "
                   "missing 1 required positional argument: 'group')")
    assert executor_wire.decode(frames) == {"x": 1}


def test_serialising_leaves_no_resource_behind() -> None:
    """The queue built for one message leaves no unclosed zmq context to warn about later
    (a backend repository running with warnings as errors would fail on it)."""
    import gc
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            executor_wire.encode({"x": 1})
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []
