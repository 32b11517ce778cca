"""What the test process and a KV-A worker share: the pipe protocol, placement, faults.

Protocol: one dict per message over a ``multiprocessing.Pipe``; the child answers
``{"ok": True, "result": ...}`` or ``{"ok": False, "error": ..., "traceback": ...}``.
Commands: ``ping``, ``engine_run`` / ``engine_call`` (a whole deployment here),
``rank_start`` / ``rank_rpc`` (one rank; the executor's frames), ``free_memory``,
``release``, ``shutdown`` (and ``crash`` and ``print``, for the harness's tests).  A suite worker
loads the vLLM / vllm-omni plugins at start-up, as vllm-omni's diffusion workers
do (``LOAD_PLUGINS``).

Placement: a worker runs on ``"cpu"`` or on ``"gpu:<id>"``, a
``CUDA_VISIBLE_DEVICES`` entry the child sets in its own environment before
anything imports torch, so it sees exactly one GPU, as ``cuda:0`` (an xdist
worker's narrowed ``CUDA_VISIBLE_DEVICES`` is not inherited).  A plain torch
device string (``"cuda:1"``) inherits the parent's environment.

Seeded faults (``adapters/fault_hook.py``) reach the child through the command, not
through monkeypatching (which a child process never sees): the parent forwards
``$KVCONFORM_WORKER_FAULT`` with every command; :func:`active_fault` says which one
is active, so a qualification run can refuse it.

Process faults are harness errors (:class:`~pytest_kvconform.contract.outcomes.HarnessError`),
never clause failures: :class:`WorkerDied`, :class:`WorkerTimeout` (the worker was
killed; the pool replaces it on the next request) and :class:`WorkerOOM` (with the
bytes asked for and free; the worker dropped its allocation and keeps serving).  One that
happened inside the backend's own code (``adapters/backend_calls.py``: the worker's marker,
or the call an out-of-memory error came through) names that call (``caused_by``): it
counts for the backend, not for the serving stack.
Every wait is bounded: start-up by ``STARTUP_TIMEOUT_S`` (the fork server's imports
and the worker's own start-up each), each command by what is
left of the per-test budget (``workers/budget.py``, ``--kv-timeout``), else ``COMMAND_TIMEOUT_S``.

Stdlib only.
"""

from __future__ import annotations

from typing import Any

from pytest_kvconform.adapters import fault_hook
from pytest_kvconform.contract.outcomes import ErrorKind, HarnessError

FAULT_ENV = fault_hook.FAULT_ENV
PIDDIR_ENV = fault_hook.PIDDIR_ENV
# A preload step, not a module: load the vLLM / vllm-omni plugins as vllm-omni's diffusion
# workers do (omni_plugins.load_plugins), so the worker resolves backends as production would.
LOAD_PLUGINS = "kvconform:load-plugins"
# What a suite worker imports before it reports ready: the cost is paid once, at start-up.
PRELOAD: tuple[str, ...] = (
    "pytest_kvconform.adapters.compat",
    "pytest_kvconform.adapters.engine",
    "vllm_omni.diffusion.vllm_config",
    "vllm_omni.diffusion.diffusion_kv.layout",
    "vllm_omni.diffusion.diffusion_kv.initialization",
    "vllm_omni.diffusion.executor.abstract",
    "vllm_omni.diffusion.worker.diffusion_model_runner",
    "vllm_omni.diffusion.worker.diffusion_worker",  # where it imports (not on every host)
    "vllm.distributed.device_communicators.shm_broadcast",
    "vllm.v1.worker.gpu.attn_utils",
    # Imported by production's model loading and engine in every deployment: once here
    # instead of at each forked worker's first deployment.
    "vllm_omni.diffusion.model_loader.host_weights",
    "vllm_omni.diffusion.diffusion_engine",
    LOAD_PLUGINS,
)
STARTUP_TIMEOUT_S = 300.0
COMMAND_TIMEOUT_S = 120.0


GPU_PREFIX = "gpu:"


class WorkerError(RuntimeError):
    """A worker could not answer: it died, timed out, or its command raised."""


class WorkerDied(WorkerError, HarnessError):
    """The worker process exited; the message carries its exit code and stderr tail."""

    kind = ErrorKind.WORKER_DIED


class WorkerTimeout(WorkerError, HarnessError):
    """The worker did not answer in time and was killed; the pool replaces it."""

    kind = ErrorKind.TIMEOUT


class WorkerOOM(WorkerError, HarnessError):
    """An allocation in the worker ran out of memory; the message has bytes asked and free."""

    kind = ErrorKind.OOM


def backend_note(caused_by: str | None) -> str:
    """How a worker fault the backend's own code caused says so (empty when it did not)."""
    return f" inside the backend's own code ({caused_by})" if caused_by else ""


class WorkerCommandError(WorkerError):
    """The command raised inside the worker; the message carries the child's traceback.

    Not a harness error: the code under test refused (a clause check decides).
    ``remote`` is the child's record of it (``engine.error_record``: type, message,
    the production function it came through).
    """

    def __init__(self, message: str, remote: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.remote = remote or {}


def child_device(placement: str) -> tuple[str, str | None]:
    """(torch device inside the child, ``CUDA_VISIBLE_DEVICES`` it sets or None)."""
    if placement.startswith(GPU_PREFIX):
        gpu_id = placement[len(GPU_PREFIX):]
        if not gpu_id:
            raise ValueError(f"worker placement {placement!r} names no GPU id")
        return "cuda:0", gpu_id
    return placement, None


