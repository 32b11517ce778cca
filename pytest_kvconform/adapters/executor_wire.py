"""The executor's wire for KV-A: the RPC envelope and the bytes a worker receives.

Harness code, not the installed API: the executor's broadcast queue (vLLM's
``MessageQueue``) is driven as is against stand-in zmq sockets, so the configs
reach the spawned workers serialised exactly as the executor sends them.
vLLM is imported lazily, inside functions.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

EXECUTOR_RPC_METHOD = "set_kv_cache_configs"
# How the frames were made: the executor's own serialiser, or the fallback (and why).
ENQUEUE = "vllm MessageQueue.enqueue"
FALLBACK = "pickle"


class _FrameSink:
    """Stands in for the executor's zmq socket: keeps the frames ``enqueue`` sends."""

    def __init__(self) -> None:
        self.frames: list[Any] = []

    def send_multipart(self, frames: Sequence[Any], copy: bool = True) -> None:
        self.frames = list(frames)


class _FrameSource:
    """Stands in for a worker's zmq socket: hands ``MessageQueue.recv`` the frames."""

    def __init__(self, frames: Sequence[bytes]) -> None:
        self.frames = list(frames)

    def poll(self, timeout: int | None = None) -> bool:
        return True

    def recv_multipart(self, copy: bool = True) -> list[bytes]:
        return self.frames


def rpc_message(kv_cache_configs: Sequence[Any], max_model_len: int) -> dict[str, Any]:
    """The envelope vllm-omni's multiproc executor broadcasts for ``set_kv_cache_configs``.

    Every worker receives all rank-local configs and picks its own by rank, as
    ``DiffusionWorker.set_kv_cache_configs`` does.
    """
    return {"type": "rpc", "method": EXECUTOR_RPC_METHOD,
            "args": (list(kv_cache_configs), max_model_len), "kwargs": {},
            "output_rank": 0, "exec_all_ranks": True, "collect_rank_status": True}


def encode(obj: Any) -> tuple[list[bytes], str]:
    """Serialise ``obj`` with the executor's own serialiser; returns (frames, how).

    The executor's broadcast queue (vLLM's ``MessageQueue.enqueue``: pickle with
    out-of-band buffers and a tensor reducer, and whatever state it grows) is run as
    is on a queue its own constructor built, with a stand-in for its remote socket,
    so the bytes are those a worker would receive.  Plain highest-protocol pickle is
    the fallback where that queue cannot be built or driven; ``how`` then says why.
    """
    try:
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    except ImportError as exc:
        return _pickled(obj, f"vLLM's MessageQueue does not import: {exc}")
    sink = _FrameSink()
    # The constructor makes a zmq context that a queue without sockets leaves to its
    # destructor (vLLM 0.30: when the constructor returns; 0.32: a finalizer, when the queue
    # goes): it is destroyed here, inside this block, and its "unclosed" warning is not the
    # caller's.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            writer = _remote_writer(MessageQueue, sink)
        except Exception as exc:  # the constructor moved: say so, never guess its state
            return _pickled(obj, f"MessageQueue could not be built: {type(exc).__name__}: "
                                 f"{exc}")
        try:
            MessageQueue.enqueue(writer, obj)
        except (AttributeError, TypeError) as exc:
            return _pickled(obj, f"MessageQueue.enqueue could not be driven: "
                                 f"{type(exc).__name__}: {exc}")
        finally:
            writer.remote_socket = None  # the sink is not the queue's to close
            del writer
    if not sink.frames:
        return _pickled(obj, "MessageQueue.enqueue sent nothing to its remote reader")
    return [bytes(f) for f in sink.frames], ENQUEUE


def _remote_writer(message_queue: Any, sink: _FrameSink) -> Any:
    """A writer queue built by production's own constructor with no reader at all (no
    shared memory, no socket bound), then given one remote reader: ``sink``.  Every
    attribute the installed ``enqueue`` reads is the constructor's, whatever the version
    (0.32 added the tensor arena, None for a queue without local readers)."""
    writer = message_queue(n_reader=0, n_local_reader=0)
    writer.n_remote_reader = 1
    writer.remote_socket = sink
    return writer


def _pickled(obj: Any, why: str) -> tuple[list[bytes], str]:
    import pickle

    return [pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)], f"{FALLBACK} (fallback: {why})"


def decode(frames: Sequence[bytes]) -> Any:
    """Deserialise frames the way a worker's queue does (``MessageQueue.recv``)."""
    import pickle

    try:
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

        recv = MessageQueue.recv
    except (ImportError, AttributeError):
        return pickle.loads(frames[0], buffers=list(frames[1:]))
    return recv(_FrameSource(frames), None)
