"""Production's engine for KV-A: its control plane, its executor, its diffusion worker.

What runs is what a paged diffusion deployment runs, for a model whose attention
layers use the backend under test (``tiny_pipeline``):

- the control plane, ``initialize_diffusion_kv_control_plane`` (for the seam
  variants its call of ``build_native_kv_cache_configs`` is handed the need, the
  control plane's explicit seam);
- the executor production selects, ``DiffusionExecutor.get_class(od_config)``:
  uniproc at world size 1 (the worker inline, configs by reference), multiproc
  above it (or when the check asks for a process boundary);
- production's ``DiffusionWorker``, its ``DiffusionModelRunner`` and
  ``DiffusionKVModelRunnerBackend``, which adopt, assert each layer's backend and
  allocate.

Where a piece cannot run on this host, the deepest production entry point that
can run is driven instead, and every result names it (:func:`entry_point`):
``executor`` (the whole chain), else ``runner`` (production's
``DiffusionModelRunner.set_kv_cache_config`` and everything below it).  What the
harness does around production's methods on either level is listed, once, in
``adapters/worker_seams.py``; no other copy of production's sequence exists here.

The harness owns only lifetime, placement and observation
(``worker_extension.Observation``).  This module runs inside KV-A worker processes
and, for a multi-process topology on the ``runner`` path, its control-plane half
runs in the test process (``deployment.PipeExecutor``).  vLLM and vllm-omni are
imported lazily.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pytest_kvconform.adapters import (
    backend_calls,
    fault_hook,
    run_env,
    tiny_pipeline,
    worker_extension,
    worker_seams,
)
from pytest_kvconform.adapters.entry_points import (
    EXECUTOR,
    RUNNER,
    UNI,
    EntryPoint,
    entry_point,
)
from pytest_kvconform.contract.memory import is_out_of_memory as is_out_of_memory  # re-exported
from pytest_kvconform.contract.outcomes import HarnessError
from pytest_kvconform.contract.records import Case

# The control plane only hands profile requests to the workers; with the KV budget given
# as ``kv_cache_memory_bytes`` production's worker skips profiling, so any request does.
PROFILE_REQUESTS: tuple[str, ...] = ("kvconform-profile",)


@dataclass(frozen=True)
class EngineSpec:
    """One KV-A deployment: the backend, the case, the topology, the control-plane seam."""

    backend: str  # its name as discovered (a registry member, or a hook / stand-in name)
    backend_path: str
    case: Case
    world_size: int
    topology: str  # UNI or MP
    device: str = "cpu"
    need: bool | None = None  # handed to the control plane's seam; None: production as is
    memory: int | None = None  # KV bytes per rank; None: exactly the case's pages
    # The rendezvous port the harness hands it (worker_seams.rendezvous_port); None:
    # production picks one.  Not what makes two deployments the same.
    master_port: int | None = field(default=None, compare=False)


@dataclass
class EngineReport:
    """What the control plane produced and what each rank's worker did with it."""

    via: str
    pinned: str | None = None
    sized_with: list[str | None] = field(default_factory=list)
    rank_configs: list[Any] = field(default_factory=list)
    scheduler_config: Any = None
    max_model_len: int | None = None
    specs: list[dict[str, Any]] = field(default_factory=list)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    fresh_layouts: list[str | None] = field(default_factory=list)  # before the configs came
    # Each rank's layers -> the class they selected, read even where the deployment failed.
    layer_backends: list[dict[str, str | None]] = field(default_factory=list)
    control_plane_pid: int | None = None
    block_size: int | None = None  # what the platform's worker config uses
    error: dict[str, Any] | None = None  # {"type", "message", "where", "stage", "oom"}


# --- production's configuration for the spec -------------------------------------


def od_config(spec: EngineSpec, selected: str, *, executor_backend: str | None) -> Any:
    """The ``OmniDiffusionConfig`` of a paged deployment of the KV-A pipeline.

    The KV budget per rank is given as ``kv_cache_memory_bytes`` (production's
    worker then reports it instead of profiling): the case's pages, at the block
    size the platform gives the worker's config.
    """
    import torch

    from pytest_kvconform.adapters import compat

    def make(memory: int | None) -> Any:
        return compat.production_od_config(
            attention_backend=selected, world_size=spec.world_size,
            extra={"dtype": getattr(torch, spec.case.dtype), "enforce_eager": True,
                   "kv_cache_memory_bytes": memory, "master_port": spec.master_port,
                   "distributed_executor_backend": executor_backend,
                   "worker_extension_cls": worker_extension.EXTENSION,
                   "custom_pipeline_args": {
                       "pipeline_class": tiny_pipeline.PIPELINE,
                       tiny_pipeline.GEOMETRY_KEY: tiny_pipeline.geometry_args(spec.case)}})

    if spec.memory is not None:
        return make(spec.memory)
    return make(memory_budget(spec.case, platform_block_size(make(None), spec.device)))


def platform_block_size(od: Any, device: str) -> int:
    """The block size the platform gives a worker's config for this deployment."""
    import torch
    from vllm_omni.diffusion.vllm_config import create_diffusion_vllm_config

    vllm_config = create_diffusion_vllm_config(torch.device(device.split(":", 1)[0]), od)
    return int(vllm_config.cache_config.block_size)


def memory_budget(case: Case, block_size: int) -> int:
    """Bytes per rank for exactly ``case.num_pages`` pages of every layer (oracle sizes)."""
    from pytest_kvconform.contract import oracle

    page = 2 * block_size * case.num_kv_heads * case.head_size * oracle.dtype_size(case.dtype)
    return page * case.num_layers * case.num_pages


def dotted(path: str) -> str:
    """``pkg.mod:Class`` (a hook's form) as ``pkg.mod.Class``, the form production resolves."""
    return path.replace(":", ".")


@contextlib.contextmanager
def backend_selected(spec: EngineSpec) -> Iterator[str]:
    """The registry name this deployment selects; a backend that is no registry member is
    plugged in over one, as a backend repository does (also in production's spawned
    workers, through :data:`worker_extension.OVERRIDE_ENV`)."""
    from pytest_kvconform.adapters import compat

    with compat.backend_selected(spec.backend, dotted(spec.backend_path)) as selected:
        if selected == spec.backend:
            yield selected
            return
        with run_env.variable_set(worker_extension.OVERRIDE_ENV,
                                  f"{selected}={dotted(spec.backend_path)}"):
            yield selected


# --- the control plane's instruments ------------------------------------------------


# The last control plane's config built in this process: what it pinned, for the report
# when the deployment failed before the control plane returned (and for a seeded fault).
_CONTROL_PLANE_CONFIGS: list[Any] = []


def _record_control_plane_config(vllm_config: Any) -> None:
    del _CONTROL_PLANE_CONFIGS[:]
    _CONTROL_PLANE_CONFIGS.append(vllm_config)


def last_control_plane_config() -> Any:
    """The last control plane's ``VllmConfig`` built in this process, or None."""
    return _CONTROL_PLANE_CONFIGS[-1] if _CONTROL_PLANE_CONFIGS else None


@contextlib.contextmanager
def _instrumented(need: bool | None, sized_with: list[str | None]) -> Iterator[None]:
    """Observe sizing (the layout pinned each time it sizes); hand the seam the need."""
    module: Any = importlib.import_module("vllm_omni.diffusion.diffusion_kv.initialization")
    size, build, create = (module.get_kv_cache_configs, module.build_native_kv_cache_configs,
                           module.create_diffusion_vllm_config)

    def sizing(vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        sized_with.append(getattr(getattr(vllm_config, "cache_config", None),
                                  "kv_cache_layout", None))
        return size(vllm_config, *args, **kwargs)

    def creating(*args: Any, **kwargs: Any) -> Any:
        vllm_config = create(*args, **kwargs)
        _record_control_plane_config(vllm_config)
        return vllm_config

    module.get_kv_cache_configs = sizing
    module.create_diffusion_vllm_config = creating
    if need is not None:
        module.build_native_kv_cache_configs = functools.partial(
            build, indexes_kv_by_block_stride=need)
    try:
        yield
    finally:
        module.get_kv_cache_configs = size
        module.build_native_kv_cache_configs = build
        module.create_diffusion_vllm_config = create


def production_frame(exc: BaseException) -> str:
    """The production functions (vLLM / vllm-omni) the exception came through, outermost
    first: ``DiffusionKVModelRunnerBackend.initialize_kv_cache -> ... -> init_kv_cache``."""
    chain: list[str] = []
    for frame, _line in traceback.walk_tb(exc.__traceback__):
        module = frame.f_globals.get("__name__", "")
        name = frame.f_code.co_qualname
        if module.partition(".")[0] in ("vllm", "vllm_omni") and name not in chain[-1:]:
            chain.append(name)
    if len(chain) > 6:  # the entry, and the innermost calls where it went wrong
        chain = [chain[0], "...", *chain[-4:]]
    return " -> ".join(chain) or type(exc).__module__


def error_record(exc: BaseException, stage: str) -> dict[str, Any]:
    """An exception as plain values: type, message, the production function, the stage.

    An exception that carries the record of one raised in another process (a rank's
    ``remote``) is described by that record, where production actually raised.
    """
    remote = getattr(exc, "remote", None)
    if remote:
        return {**remote, "stage": stage}
    return {"type": type(exc).__name__, "message": str(exc), "stage": stage,
            "where": production_frame(exc), "oom": is_out_of_memory(exc),
            "caused_by": backend_calls.raised_through(exc),
            "host_limit": _host_limit(exc),
            "traceback": "".join(traceback.format_exception(exc))[-4000:]}


def _host_limit(exc: BaseException) -> str | None:
    """Why the exception is the host's hardware limit (``worker_seams.host_limit``)."""
    try:
        return worker_seams.host_limit(exc)
    except Exception:  # no platform to ask for the worker's device: nothing to tell
        return None


def run_control_plane(executor: Any, od: Any, spec: EngineSpec, *, via: str,
                      prepin: str | None = None) -> EngineReport:
    """Production's control plane against ``executor``; what each rank's worker did.

    ``via`` names the production chain that receives the configs (:meth:`EntryPoint.chain`):
    the caller's, since where the control plane runs beside workers of other processes
    (``workers/deployment.py``) those workers know it, and detecting it here would import
    production's worker into a process that runs none of it.

    Around the executor's own ``set_kv_cache_configs`` the harness only looks: it
    records the configs the control plane hands over and each worker's layout just
    before (``prepin`` first pins it, KV-A4's control).
    """
    import os

    import torch

    module: Any = importlib.import_module("vllm_omni.diffusion.diffusion_kv.initialization")
    report = EngineReport(via=via, control_plane_pid=os.getpid(), block_size=_block_size(od, spec))
    sent: dict[str, Any] = {}
    set_configs, specs_of = executor.set_kv_cache_configs, executor.get_kv_cache_specs
    ranks = range(spec.world_size)

    def on_ranks(method: str, *args: Any) -> list[Any]:
        return [executor.collective_rpc(method, args=args, unique_reply_rank=r) for r in ranks]

    def recording_specs() -> Any:
        specs = specs_of()
        report.specs = [dict(s) for s in specs]
        return specs

    def recording_set(configs: list[Any], max_model_len: int) -> None:
        # As handed over: a hand-off that alters them in place must not alter the record.
        sent["configs"], sent["max_model_len"] = copy.deepcopy(list(configs)), max_model_len
        report.fresh_layouts = on_ranks("kvconform_layout")
        if prepin is not None:
            on_ranks("kvconform_prepin", prepin)
        set_configs(configs, max_model_len)

    executor.get_kv_cache_specs, executor.set_kv_cache_configs = recording_specs, recording_set
    stage = "control plane"
    try:
        with _instrumented(spec.need, report.sized_with):
            result = module.initialize_diffusion_kv_control_plane(
                executor, od, profile_requests=list(PROFILE_REQUESTS),
                device=torch.device(spec.device.split(":", 1)[0]))
        if result is None:
            raise RuntimeError("the control plane declined to run for a paged diffusion config")
        report.scheduler_config, vllm_config = result[0], result[-1]
        report.pinned = vllm_config.cache_config.kv_cache_layout
        stage = "observation"
        report.ranks = on_ranks("kvconform_report")
        report.layer_backends = [seen["layer_backends"] for seen in report.ranks]
    except HarnessError:
        raise  # a worker died, timed out or ran out of memory: not production's answer
    except Exception as exc:
        report.error = error_record(exc, "set_kv_cache_configs"
                                    if "configs" in sent and stage != "observation" else stage)
        with contextlib.suppress(Exception):
            report.pinned = last_control_plane_config().cache_config.kv_cache_layout
        with contextlib.suppress(Exception):
            report.layer_backends = on_ranks("kvconform_layer_backends")
    finally:
        del executor.get_kv_cache_specs, executor.set_kv_cache_configs
    report.rank_configs = list(sent.get("configs", []))
    report.max_model_len = sent.get("max_model_len")
    return report


def _block_size(od: Any, spec: EngineSpec) -> int | None:
    with contextlib.suppress(Exception):
        return platform_block_size(od, spec.device)
    return None


# --- the worker, where production's cannot run --------------------------------------


class RankHost(worker_extension.Observation):
    """Stands in for ``DiffusionWorker`` where it cannot be imported: hosts its runner
    (runner level; what it does around the runner: ``worker_seams``)."""

    def __init__(self, od: Any, rank: int) -> None:
        import os

        from vllm.config import set_current_vllm_config
        from vllm.utils.import_utils import resolve_obj_by_qualname
        from vllm_omni.diffusion.vllm_config import create_diffusion_vllm_config
        from vllm_omni.platforms import current_omni_platform as platform

        self.rank = rank
        self.od_config = od
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(od.num_gpus or 1)
        self.device = platform.get_torch_device(rank)
        platform.set_device(self.device)
        self.vllm_config = create_diffusion_vllm_config(self.device, od)
        platform.init_diffusion_worker_vllm_config(self.vllm_config)
        runner_cls = resolve_obj_by_qualname(platform.get_diffusion_model_runner_cls())
        self.model_runner = runner_cls(vllm_config=self.vllm_config, od_config=od,
                                       device=self.device)
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.load_model(
                load_format="custom_pipeline",
                custom_pipeline_name=od.custom_pipeline_args["pipeline_class"])

    def get_kv_cache_specs(self) -> list[dict[str, Any]]:
        """This rank's specs (the executor gathers the ranks, as the worker's all-gather)."""
        return [self.model_runner.get_kv_cache_spec()]

    def determine_available_kv_memory(self, profile_requests: Any) -> list[int]:
        """The configured KV budget, as the worker answers when it is given one."""
        return [int(self.vllm_config.cache_config.kv_cache_memory_bytes)]

    def set_kv_cache_configs(self, kv_cache_configs: list[Any],
                             resolved_max_model_len: int) -> None:
        """Take this rank's config and hand it to production's runner."""
        config = kv_cache_configs[self.rank]
        self.vllm_config.model_config.max_model_len = resolved_max_model_len
        self.vllm_config.cache_config.num_gpu_blocks = config.num_blocks
        self.model_runner.set_kv_cache_config(config)

    def shutdown(self) -> None:
        self.model_runner = None


def rank_worker(od: Any, rank: int) -> Any:
    """One rank of a deployment whose control plane runs in another process: production's
    worker, built as the multiproc executor's worker process builds it (its queues, the
    executor's transport, are not built), else :class:`RankHost` (``worker_seams``)."""
    if entry_point().level != EXECUTOR:
        return RankHost(od, rank)
    from vllm_omni.diffusion.worker.diffusion_worker import WorkerProc

    worker_seams.await_rendezvous(od, rank)
    with worker_seams.seams():
        return WorkerProc._create_worker(WorkerProc.__new__(WorkerProc), rank, od,
                                         od.worker_extension_cls,
                                         getattr(od, "custom_pipeline_args", None))


def _executor_class() -> type:
    from vllm_omni.diffusion.executor.abstract import DiffusionExecutor

    class InlineExecutor(DiffusionExecutor):  # type: ignore[misc]
        """Production's ``DiffusionExecutor`` over one inline :class:`RankHost` (runner
        level): only ``collective_rpc`` is the harness's, uniproc's inline call."""

        def _init_executor(self) -> None:
            self.host: RankHost | None = RankHost(self.od_config, 0)

        @property
        def is_dead(self) -> bool:
            return self.host is None

        def collective_rpc(self, method: str, timeout: float | None = None,
                           args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                           unique_reply_rank: int | None = None,
                           exec_all_ranks: bool = False) -> Any:
            if self.host is None:
                raise RuntimeError("the inline executor is shut down")
            result = getattr(self.host, method)(*args, **(kwargs or {}))
            return result if unique_reply_rank is not None else [result]

        def execute_request(self, scheduler_output: Any) -> Any:
            raise NotImplementedError

        execute_batch = execute_step = execute_request

        def check_health(self) -> None:
            """Inline: healthy while it exists."""

        def shutdown(self) -> None:
            if self.host is not None:
                self.host.shutdown()
            self.host = None

    return InlineExecutor


# --- one engine, in this process ------------------------------------------------------


class Engine:
    """One deployment run here: control plane, executor and (inline or spawned) workers."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.executor: Any = None
        self.report: EngineReport | None = None
        self._stack = contextlib.ExitStack()

    def run(self, *, fault: str | None = None, control: str | None = None,
            prepin: str | None = None) -> EngineReport:
        """Start production's executor for the spec and run the control plane against it.

        ``control`` is a check's own negative control (a reference to the
        ``source_rewrite.Regression`` it applies on purpose); ``fault`` the seeded fault of the
        run (``$KVCONFORM_WORKER_FAULT``).  Both stay applied until :meth:`close`.
        """
        point = entry_point()
        spec = self.spec
        stack = self._stack
        selected = stack.enter_context(backend_selected(spec))
        stack.enter_context(fault_hook.seeded(fault, control))
        od = od_config(spec, selected,
                       executor_backend=spec.topology if point.level == EXECUTOR else None)
        try:
            with worker_seams.seams() if point.level == EXECUTOR else contextlib.nullcontext():
                self.executor = self._make_executor(point, od)
        except Exception as exc:
            self.report = EngineReport(via=point.chain(spec.topology),
                                       error=error_record(exc, "worker start-up"))
            return self.report
        self.report = run_control_plane(self.executor, od, spec, via=point.chain(spec.topology),
                                        prepin=prepin)
        return self.report

    def _make_executor(self, point: EntryPoint, od: Any) -> Any:
        if point.level == EXECUTOR:
            from vllm_omni.diffusion.executor.abstract import DiffusionExecutor

            return DiffusionExecutor.get_class(od)(od)
        if point.level == RUNNER and self.spec.topology == UNI:
            return _executor_class()(od)
        raise RuntimeError(point.chain(self.spec.topology))

    def call(self, method: str, rank: int, *args: Any) -> Any:
        """A worker-side observation on ``rank`` (production's ``collective_rpc``)."""
        return self.executor.collective_rpc(method, args=args, unique_reply_rank=rank)

    def close(self) -> None:
        """Shut production's executor down (its workers go with it); undo the seeded faults."""
        try:
            if self.executor is not None:
                with contextlib.suppress(Exception):
                    self.executor.shutdown()
        finally:
            self.executor = None
            self._stack.close()
