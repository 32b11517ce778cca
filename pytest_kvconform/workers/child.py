"""A KV-A worker process (the child side of ``pool.py``): its start-up and command loop.

Lifetime: a worker never outlives its parent (``workers/lifetime.py``: parent-death signal
plus a lifeline-pipe watchdog; a forked worker's parent-death signal is tied to the
fork server, which is tied to the test process, its lifeline to the test process
itself), ignores SIGINT (its parent decides when it stops),
and with ``$KVCONFORM_WORKER_PIDDIR`` set creates ``<pid>.worker`` there (never through a
link: ``fault_hook.mark_pid``), so a test can check by PID that nothing is left.
Its descriptors 1 and 2 are on its log before its imports, and every reply waits for what
the command printed to be there (``worker_log.py`` reads the log for the run).
Worker processes production's multiproc executor spawns are its own: they die with the
KV-A worker that started them (production sets their parent-death signal), which dies
with the test process.

Stdlib only at import (numpy, torch and ``compat`` are imported where used).
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

from pytest_kvconform.adapters import backend_calls, fault_hook, heap, run_env, worker_seams
from pytest_kvconform.adapters.worker_extension import process_identity
from pytest_kvconform.contract import memory
from pytest_kvconform.contract.memory import is_out_of_memory
from pytest_kvconform.workers import lifetime
from pytest_kvconform.workers.protocol import LOAD_PLUGINS


def _tie_to_parent(parent: tuple[int, Any, bool]) -> None:
    """Never outlive the parent; leave Ctrl-C (and SIGTERM's unwinding) to it."""
    parent_pid, lifeline, death_signal = parent
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    lifetime.tie_to_parent(parent_pid, lifeline, death_signal=death_signal)


def _worker_main(conn: Any, device: str, stderr_path: str, preload: Sequence[str],
                 gpu_id: str | None = None, parent: tuple[int, Any, bool] | None = None,
                 environ: dict[str, str] | None = None) -> None:
    """Entry point of a worker: pin its GPU, redirect output, import, answer.

    ``environ``: a forked worker's environment, its parent's at start (a spawned one
    inherits it; a forked one would get the fork server's).
    """
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
        tempfile.tempdir = None  # the server's $TMPDIR is the run's own: back to ours
    if parent is not None:  # first, so that not even the imports outlive the parent
        _tie_to_parent(parent)
    if gpu_id is not None:  # first, before anything can import torch or touch CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu_id
    import faulthandler

    fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    faulthandler.enable(sys.stderr)
    backend_calls.open_marker(backend_calls.marker_path(stderr_path))
    fault_hook.mark_pid("worker")  # $PIDDIR_ENV: a refusal is a line in this log, no more
    started = time.monotonic()
    plugins = None
    collecting = heap.pause()  # for the imports (a spawned worker's are the stack's)
    try:
        _refuse_inherited_cuda()
        for name in preload:
            if name == LOAD_PLUGINS:
                plugins = _load_plugins()
                continue
            with contextlib.suppress(ImportError):
                importlib.import_module(name)
    except BaseException as exc:
        traceback.print_exc()
        _reply(conn, {"ok": False, "error": repr(exc), "traceback": traceback.format_exc()})
        return
    heap.resume(collecting)  # the imports' objects: never walked by production's collections
    from dataclasses import asdict

    from pytest_kvconform.adapters import engine, entry_points

    _reply(conn, {"ok": True, "result": {**process_identity(), "device": device,
                                      "import_s": round(time.monotonic() - started, 2),
                                      "plugins": plugins,
                                      # where production's stack is preloaded: which of its
                                      # worker entry points can run here
                                      "entry_point": asdict(entry_points.entry_point())
                                      if "vllm_omni" in sys.modules else None}})
    state = _WorkerState(device)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the parent is gone: never outlive it
            return
        if message.get("cmd") == "shutdown":
            state.release()
            return
        try:
            reply = {"ok": True, "result": state.handle(message)}
        except Exception as exc:
            if is_out_of_memory(exc) and not isinstance(exc, _OutOfMemory):
                # whichever command met it (a rank's start-up, the engine's run): one kind
                exc = _OutOfMemory(_asked_of(exc), free_bytes(state.device), exc,
                                   backend_calls.raised_through(exc))
            if isinstance(exc, _OutOfMemory):
                state.release()  # recover: the next command starts from a clean device
                reply = {"ok": False, "error": f"{type(exc.error).__name__}: {exc.error}",
                         "oom": {"asked": exc.asked, "free": exc.free,
                                 "caused_by": exc.caused_by}}
                _reply(conn, reply)
                continue

            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                     "traceback": traceback.format_exc(),
                     "record": engine.error_record(exc, message.get("cmd", ""))}
        _reply(conn, reply)


def _reply(conn: Any, reply: dict[str, Any]) -> None:
    """Send ``reply`` once what the command printed is in the log: Python's buffered streams
    are flushed first, so a parent that reads the log after the reply finds all of it."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    conn.send(reply)


def _refuse_inherited_cuda() -> None:
    """A forked worker whose server had initialised CUDA must not run (CUDA is not fork-safe)."""

    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and multiprocessing.get_start_method(allow_none=True) == "forkserver" \
            and cuda.is_initialized():
        raise RuntimeError("this worker was forked from a fork server that had initialised "
                           "CUDA; the server must only import (kvconform forkserver.py)")


def _load_plugins() -> dict[str, Any]:
    """The worker's own plugin load (as vllm-omni's workers call load_omni_general_plugins).

    ``VLLM_PLUGINS`` is inherited from the parent, so ``--kv-plugins=none`` holds here too.
    """
    from pytest_kvconform.adapters import omni_plugins

    return omni_plugins.worker_summary(omni_plugins.load_plugins())


class _OutOfMemory(Exception):
    """An allocation failed for want of memory: answered as ``oom``, not as a command error.
    ``asked``: the bytes asked for (None: unknown); ``caused_by``: the call into the
    backend's own code it came through, if any."""

    def __init__(self, asked: int | None, free: int | None, error: BaseException,
                 caused_by: str | None = None) -> None:
        super().__init__(f"asked for {asked} bytes, {free} free")
        self.asked, self.free, self.error, self.caused_by = asked, free, error, caused_by


def free_bytes(device: str) -> int | None:
    """Free memory where ``device`` allocates: the GPU's, or the host's available memory."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    return memory.host_available_bytes()


class _WorkerState:
    """What one worker holds between commands: the engine (or rank host) it runs."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.engine: Any = None  # engine.Engine: control plane + executor + workers here
        self.host: Any = None  # one rank (engine.rank_worker) of a deployment run from the parent
        self.fault: str | None = None
        self._seeded = contextlib.ExitStack()
        # What production's init_device overwrites, as this worker started (its parent's).
        self._rank_env = {name: os.environ.get(name) for name in worker_seams.RANK_ENV}

    def handle(self, message: dict[str, Any]) -> Any:
        cmd = message["cmd"]
        if cmd == "ping":
            return {**process_identity(), "device": self.device}
        if cmd == "crash":
            os.write(2, str(message.get("text", "")).encode() + b"\n")
            os._exit(int(message.get("code", 3)))
        if cmd == "print":  # as production's code prints: through Python's buffered streams
            stream = sys.stdout if message.get("stream") == "stdout" else sys.stderr
            print(message.get("text", ""), file=stream)
            return None
        handler = getattr(self, f"cmd_{cmd}", None)
        if handler is None:
            raise ValueError(f"unknown worker command {cmd!r}")
        return handler(message)

    def release(self) -> None:
        """Close the deployment this worker ran (its executor, runner and allocation)."""
        if self.engine is not None:
            self.engine.close()
        if self.host is not None:
            self.host.shutdown()
        self.engine = self.host = None
        self._seeded.close()
        import gc

        gc.collect()
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()

    def cmd_release(self, message: dict[str, Any]) -> None:
        self.release()

    def cmd_free_memory(self, message: dict[str, Any]) -> int | None:
        from pytest_kvconform.adapters import compat

        self.release()
        return compat.device_free_memory(self.device)

    def cmd_engine_run(self, message: dict[str, Any]) -> Any:
        """Run a whole deployment here (production's control plane, executor, workers)."""
        from pytest_kvconform.adapters import engine

        self.release()
        worker_seams.fresh_rank_env(self._rank_env)
        fault_hook.process_fault(message.get("fault"))  # hang / die: the deployment's process
        _may_have_children()
        spec = message["spec"]
        backend_calls.instrument(spec.backend, engine.dotted(spec.backend_path))
        self.engine = engine.Engine(spec)
        with _visible_devices(message.get("visible_devices")):
            report = self.engine.run(fault=message.get("fault"), control=message.get("control"),
                                     prepin=message.get("prepin"))
        if report.error and report.error.get("oom"):
            raise _OutOfMemory(_asked(report), free_bytes(self.device),
                               RuntimeError(report.error["message"]),
                               report.error.get("caused_by"))
        return report

    def cmd_engine_call(self, message: dict[str, Any]) -> Any:
        """An observation of one rank of the deployment this worker runs."""
        if self.engine is None:
            raise RuntimeError("engine_call before engine_run")
        return self.engine.call(message["method"], message["rank"], *message.get("args", ()))

    def cmd_rank_start(self, message: dict[str, Any]) -> dict[str, Any]:
        """Host rank ``rank`` of a deployment whose control plane runs in the parent, with
        the parent's ``od_config`` (one for all ranks, as an executor hands its workers)."""
        from pytest_kvconform.adapters import engine

        self.release()
        worker_seams.fresh_rank_env(self._rank_env)
        spec = message["spec"]
        fault = message.get("fault")
        backend_calls.instrument(spec.backend, engine.dotted(spec.backend_path))
        self._seeded.enter_context(engine.backend_selected(spec))
        self._seeded.enter_context(fault_hook.seeded(fault, message.get("control")))
        self.fault = fault
        self.host = engine.rank_worker(message["od"], message["rank"])
        return process_identity()

    def cmd_rank_rpc(self, message: dict[str, Any]) -> Any:
        """One of the executor's RPCs, received as the executor's frames, made as the
        multiproc executor's worker process makes it (``execute_method``)."""
        from pytest_kvconform.adapters import executor_wire

        if self.host is None:
            raise RuntimeError("rank_rpc before rank_start")
        rpc = executor_wire.decode(message["frames"])
        method, args = rpc["method"], list(rpc.get("args", ()))
        if method == "set_kv_cache_configs":
            fault_hook.process_fault(self.fault)
        execute = getattr(self.host, "execute_method", None)
        try:
            if execute is not None:
                return execute(method, *args, **rpc.get("kwargs", {}))
            return getattr(self.host, method)(*args, **rpc.get("kwargs", {}))
        except Exception as exc:
            if is_out_of_memory(exc):
                asked = memory.asked_bytes(str(exc)) or _asked_configs(args) or None
                raise _OutOfMemory(asked, free_bytes(self.device), exc,
                                   backend_calls.raised_through(exc)) from exc
            raise

    def cmd_vllm_worker_start(self, message: dict[str, Any]) -> dict[str, Any]:
        """Be one of vLLM's multiproc worker processes (KV-V4): production's
        ``WorkerWrapperBase`` around its ``WorkerBase`` on a fresh, unpinned config (or one
        pinned to ``prepin``: a negative control) and a model whose attention ``layers`` use
        ``backend`` (``module:Class``), with the run's seeded fault and the check's control
        applied here."""
        from pytest_kvconform.adapters import vllm_layout

        self.release()
        self._seeded.enter_context(fault_hook.seeded(message.get("fault"),
                                                     message.get("control")))
        self.host = vllm_layout.production_worker_proc(
            pinned=message.get("prepin"), backend=message.get("backend"),
            layers=message.get("layers", ()))
        return process_identity()

    def cmd_vllm_rpc(self, message: dict[str, Any]) -> Any:
        """One RPC of vLLM's executor, received as its frames, run as ``WorkerProc`` runs it."""
        from pytest_kvconform.adapters import vllm_layout

        if self.host is None:
            raise RuntimeError("vllm_rpc before vllm_worker_start")
        return vllm_layout.worker_proc_receives(self.host, message["frames"])


def _may_have_children() -> None:
    """Let production's multiproc executor start its worker processes from this one.

    The pool starts this worker daemonic (the test process's exit ends it rather than
    waiting for it), and multiprocessing refuses children to a daemonic process.  Here the
    flag decides nothing else: this process's lifetime is tied to its parent's
    (``lifetime.py``), and production ties its workers' to this one.
    """
    process = multiprocessing.current_process()
    if process.daemon:
        process.daemon = False


def _asked(report: Any) -> int | None:
    """What the failed allocation asked for: the allocator's own figure, else the configs'."""
    asked = memory.asked_bytes(str(report.error.get("message", "")))
    if asked is None and report.rank_configs:
        asked = _asked_configs([report.rank_configs]) or None
    return asked


def _asked_of(exc: BaseException) -> int | None:
    return memory.asked_bytes(str(exc))


def _asked_configs(args: Sequence[Any]) -> int:
    """Bytes a ``set_kv_cache_configs`` call allocates on the first rank it names."""
    configs = args[0] if args and isinstance(args[0], list) else []
    return sum(int(t.size) for t in configs[0].kv_cache_tensors) if configs else 0


@contextlib.contextmanager
def _visible_devices(value: str | None) -> Iterator[None]:
    """For a deployment that spawns its own workers: the GPUs they may use."""
    if value is None:
        yield
        return
    with run_env.variable_set("CUDA_VISIBLE_DEVICES", value):
        yield
