"""The executor's wire for KV-A: the RPC envelope and the bytes a worker receives.

Harness code, not the installed API: the executor's broadcast queue (vLLM's
``MessageQueue``) is driven as is against stand-in zmq sockets, so the configs
reach the spawned workers serialised exactly as the executor sends them.
vLLM is imported lazily, inside functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

EXECUTOR_RPC_METHOD = "set_kv_cache_configs"


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
    out-of-band buffers and a tensor reducer) is run as is, with a stand-in for
    its remote socket, so the bytes are those a worker would receive.  Plain
    highest-protocol pickle is the fallback where that queue cannot be driven.
    """
    import pickle
    from types import SimpleNamespace

    try:
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

        sink = _FrameSink()
        writer = SimpleNamespace(_is_writer=True, n_local_reader=0, n_remote_reader=1,
                                 remote_socket=sink, local_socket=None)
        MessageQueue.enqueue(writer, obj)
        if sink.frames:
            return [bytes(f) for f in sink.frames], "vllm MessageQueue.enqueue"
    except (ImportError, AttributeError, TypeError):
        pass
    return [pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)], "pickle (fallback)"


def decode(frames: Sequence[bytes]) -> Any:
    """Deserialise frames the way a worker's queue does (``MessageQueue.recv``)."""
    import pickle

    try:
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

        recv = MessageQueue.recv
    except (ImportError, AttributeError):
        return pickle.loads(frames[0], buffers=list(frames[1:]))
    return recv(_FrameSource(frames), None)
