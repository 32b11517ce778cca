"""One KV-A deployment as the test process drives it: where production runs, what it did.

``adapters/engine.py`` runs production's control plane, executor and diffusion worker; this
module decides where, given the KV-A worker processes a check was handed (one per
rank) and the deepest production entry point those processes can run
(``entry_points.entry_point``, reported by each worker at start-up):

- :class:`ChildDeployment`: the whole engine inside the first worker.  At world size
  1 that is production's uniproc topology (control plane and worker in one process,
  configs by reference); with production's executors available it is also the
  multiproc topology, whose executor starts its own worker processes.
- :class:`ParentDeployment`: where only production's model runner can run, a
  multi-process deployment puts the control plane here and one rank in each
  worker; :class:`PipeExecutor` carries the calls.

What the harness does around production's methods on either path is listed, once, in
``adapters/worker_seams.py``.  The result names the production entry point that ran
(``EngineReport.via``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from pytest_kvconform.adapters import engine, entry_points, executor_wire, fault_hook, worker_seams
from pytest_kvconform.adapters.engine import EngineReport, EngineSpec
from pytest_kvconform.contract.outcomes import Unsupported
from pytest_kvconform.workers.handle import WorkerHandle
from pytest_kvconform.workers.protocol import WorkerError


def _entry_point(handles: Sequence[WorkerHandle]) -> entry_points.EntryPoint:
    info = handles[0].wait_ready() if handles else {}
    return entry_points.reported(info.get("entry_point"))


def level(handles: Sequence[WorkerHandle]) -> str:
    """The production entry point the workers can run (``entry_points.EXECUTOR`` / ``RUNNER``)."""
    return _entry_point(handles).level


class ChildDeployment:
    """The whole engine in one worker process."""

    def __init__(self, handle: WorkerHandle, spec: EngineSpec, *, control: str | None,
                 prepin: str | None, visible_devices: str | None) -> None:
        self.handle = handle
        handle.send({"cmd": "engine_run", "spec": spec, "control": control, "prepin": prepin,
                     "visible_devices": visible_devices})
        self.report: EngineReport = handle.receive("engine_run")

    def call(self, method: str, rank: int, *args: Any) -> Any:
        return self.handle.engine_call(method, rank, *args)

    def close(self) -> None:
        if self.handle.alive:
            if self.handle.defers_release:
                self.handle.release_later()
            else:
                self.handle.release()


class ParentDeployment:
    """The control plane here, one rank of production's worker (or, at the runner level, of
    its model runner) per KV-A worker, started and released together (a rank's process
    group waits for the others)."""

    def __init__(self, handles: Sequence[WorkerHandle], spec: EngineSpec, *,
                 control: str | None, prepin: str | None) -> None:
        self.handles = list(handles)
        self.started: list[WorkerHandle] = []
        point = _entry_point(self.handles)
        try:
            with engine.backend_selected(spec) as selected, \
                    fault_hook.seeded(fault_hook.active()):
                self.started = self.handles
                # The od_config the control plane here hands every rank.
                od = engine.od_config(spec, selected, executor_backend=None)
                try:
                    _all(self.handles, lambda rank, handle: handle.send(
                        {"cmd": "rank_start", "spec": spec, "rank": rank,
                         "control": control, "od": od}), "rank_start")
                except BaseException:
                    # A rank whose start failed may hold a half-built process group (its
                    # peer died or ran out of memory after the rendezvous): never reused.
                    for handle in self.handles:
                        handle.kill()
                    raise
                self.executor = _pipe_executor_class()(
                    od, self.handles, gathered=point.level == entry_points.EXECUTOR)
                self.report = engine.run_control_plane(
                    self.executor, od, spec, via=point.chain(entry_points.PIPE), prepin=prepin)
        except BaseException:
            self.close()
            raise

    def call(self, method: str, rank: int, *args: Any) -> Any:
        return self.executor.collective_rpc(method, args=args, unique_reply_rank=rank)

    def close(self) -> None:
        alive = [handle for handle in self.started if handle.alive]
        self.started = []
        waited = []
        for handle in alive:
            if handle.defers_release:
                handle.release_later()
            else:
                waited.append(handle)
        _all(waited, lambda _rank, handle: handle.send({"cmd": "release"}), "release")


Deployment = ChildDeployment | ParentDeployment


def start(spec: EngineSpec, handles: Sequence[WorkerHandle], *, control: str | None = None,
          prepin: str | None = None) -> Deployment:
    """Run production's engine for ``spec`` on ``handles`` (one per rank).

    Raises :class:`Unsupported` when no production worker entry point can run in
    the workers (the reason says what is missing).
    """
    spec = replace(spec, master_port=worker_seams.rendezvous_port())
    visible = _route(spec, handles)
    if visible is _PARENT:
        return ParentDeployment(handles, spec, control=control, prepin=prepin)
    return ChildDeployment(handles[0], spec, control=control, prepin=prepin,
                           visible_devices=visible)


_PARENT = "parent"


def _route(spec: EngineSpec, handles: Sequence[WorkerHandle]) -> str | None:
    """Where the deployment runs: :data:`_PARENT` (the control plane here), else in the
    first worker, with the GPUs its own workers may use (None: as it is)."""
    point = level(handles)
    if not point:
        info = handles[0].wait_ready().get("entry_point") or {}
        raise Unsupported("production's diffusion worker cannot run here: "
                          f"{info.get('why_not_runner') or 'unknown'}")
    on_cpu = not any(h.device.startswith("cuda") for h in handles)
    # worker_seams: on CPU, or at the runner level, the control plane runs here
    if spec.topology == entry_points.MP and (point == entry_points.RUNNER or on_cpu):
        return _PARENT
    gpus = [h.gpu_id for h in handles if h.gpu_id is not None]
    return ",".join(gpus) if spec.topology == entry_points.MP and len(gpus) > 1 else None


def _pipe_executor_class() -> type:
    from vllm_omni.diffusion.executor.abstract import DiffusionExecutor

    class PipeExecutor(DiffusionExecutor):  # type: ignore[misc]
        """Production's ``DiffusionExecutor`` over the KV-A worker pipes (runner level).

        Only ``collective_rpc`` is the harness's: the multiproc executor's RPC envelope,
        serialised with the executor's broadcast queue, sent to the ranks it addresses.
        A call every rank runs but one rank answers gets what that rank's worker would
        answer after its all-gather: every rank's list, in rank order.
        """

        def __init__(self, od_config: Any, handles: Sequence[WorkerHandle], *,
                     gathered: bool = False) -> None:
            self.handles = list(handles)
            self.gathered = gathered  # the ranks all-gather themselves (production's workers)
            self.wire = ""
            super().__init__(od_config)

        def _init_executor(self) -> None:
            """The ranks are already started (``ParentDeployment``)."""

        @property
        def is_dead(self) -> bool:
            return not all(h.alive for h in self.handles)

        def collective_rpc(self, method: str, timeout: float | None = None,
                           args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                           unique_reply_rank: int | None = None,
                           exec_all_ranks: bool = False) -> Any:
            multi_rank_reply = unique_reply_rank is None and exec_all_ranks
            every_rank = unique_reply_rank is None or exec_all_ranks
            rpc = {"type": "rpc", "method": method, "args": tuple(args),
                   "kwargs": dict(kwargs or {}),
                   "output_rank": None if multi_rank_reply else (unique_reply_rank or 0),
                   "exec_all_ranks": every_rank,
                   "collect_rank_status": unique_reply_rank is None and not multi_rank_reply}
            frames, self.wire = executor_wire.encode(rpc)
            ranks = (list(range(len(self.handles))) if every_rank
                     else [int(unique_reply_rank or 0)])
            replies = _exchange([self.handles[r] for r in ranks], frames, method)
            if unique_reply_rank is None:
                return replies
            if exec_all_ranks and not self.gathered and all(isinstance(r, list)
                                                            for r in replies):
                return [item for reply in replies for item in reply]
            return replies[ranks.index(unique_reply_rank)]

        def execute_request(self, scheduler_output: Any) -> Any:
            raise NotImplementedError

        execute_batch = execute_step = execute_request

        def check_health(self) -> None:
            if self.is_dead:
                raise RuntimeError("a KV-A worker process is gone")

        def shutdown(self) -> None:
            """The ranks are closed by their deployment."""

    return PipeExecutor


def _exchange(handles: Sequence[WorkerHandle], frames: Sequence[bytes], method: str) -> list[Any]:
    """Send the executor's frames to every rank at once (as it broadcasts), then collect."""
    return _all(handles, lambda _rank, handle: handle.send_rpc(frames), method)


def _all(handles: Sequence[WorkerHandle], send: Callable[[int, WorkerHandle], None],
         what: str) -> list[Any]:
    """Send every rank its command first (the ranks may wait for each other), then collect.

    Every reply that was asked for is read before an error is raised, so no rank's pipe is
    left holding a stale reply for its next request.  The error raised is the first one
    the backend's own code caused, if any (a rank that died in it leaves the others
    waiting for it until they time out), else the first.
    """
    sent: list[WorkerHandle] = []
    errors: list[WorkerError] = []
    for rank, handle in enumerate(handles):
        try:
            send(rank, handle)
        except WorkerError as exc:
            errors.append(exc)
            break
        sent.append(handle)
    replies = []
    for handle in sent:
        try:
            replies.append(handle.receive(what))
        except WorkerError as exc:
            errors.append(exc)
    if errors:
        raise next((e for e in errors if getattr(e, "caused_by", None)), errors[0])
    return replies
