"""KV-A clauses: the control plane's layout reaches production's workers intact.

Each check stands up a deployment of production's own engine
(``workers/deployment.py`` / ``adapters/engine.py``): vllm-omni's control plane
(``initialize_diffusion_kv_control_plane``; for the seam variants its call of
``build_native_kv_cache_configs`` is handed the need), the executor production
selects for the case (uniproc at world size 1, multiproc above it, or wherever a
process boundary is the point), and production's diffusion worker, model runner
and ``DiffusionKVModelRunnerBackend`` for a model whose attention layers use the
backend under test.  The checks only look: at the configs the control plane handed
over, at what each rank's worker did with them, and at bytes written through the
views production bound to each layer, compared with the oracle.  Where a production
piece cannot run on this host the deepest one that can is driven, and the result
names it (``via``).

A backend without ``supports_paged_kv`` is refused by production's worker
(``DiffusionKVModelRunnerBackend.register_kv_cache_layers``): no layout ever reaches
a worker for it, so the clauses do not apply.  A worker that dies, times out or runs
out of memory is the harness's fault, not the backend's: it stays a
:class:`HarnessError` (with the clause, backend and case added), never a
ClauseFailure.  What production raised fails the clause, naming the function.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pytest_kvconform.adapters import compat, engine, entry_points, executor_wire, seam_backends
from pytest_kvconform.adapters.control_plane import ControlPlane, build_control_plane
from pytest_kvconform.adapters.engine import EngineReport, EngineSpec
from pytest_kvconform.adapters.worker_extension import config_summary
from pytest_kvconform.checks.adoption_controls import SKIP_ADOPTION_REF
from pytest_kvconform.checks.common import (
    Where,
    declared_need,
    note_via,
    supports_paged_kv,
    unsupported_as_skip,
)
from pytest_kvconform.checks.errors import HarnessError, SkipKind, Unsupported
from pytest_kvconform.contract import oracle
from pytest_kvconform.contract.records import BackendUnderTest, Case
from pytest_kvconform.workers import deployment
from pytest_kvconform.workers.devices import Unplaceable
from pytest_kvconform.workers.handle import WorkerHandle
from pytest_kvconform.workers.protocol import WorkerCommandError

Source = BackendUnderTest | bool  # a backend (its declared need) or an explicit need
Workers = Sequence[WorkerHandle] | Unplaceable  # one worker per rank, or why there are none
SAMPLED_PAGES = 4
_FULL_READ_LIMIT = 1 << 26  # read the whole allocation back below this many bytes
_GUARD_BYTES = 256  # bytes checked (must stay zero) on either side of a probed page
_TABLE_CELLS = 1 << 22
REFUSAL = "DiffusionKVModelRunnerBackend.register_kv_cache_layers"


@dataclass(frozen=True)
class Run(Where):
    """A KV-A check's failure context plus what its deployment serves.

    ``need`` is the need the backend declares (a seam variant's explicit one);
    ``path`` the class every registered layer must use; ``seam``: the need is
    handed to the control plane through its explicit seam.
    """

    need: bool = False
    name: str = ""
    path: str = ""
    seam: bool = False


def _run(clause: str, source: Source, case: Case) -> Run:
    compat.require_omni(clause)
    if isinstance(source, bool):
        return Run(clause, f"need={source}", case, need=source, name=f"need_{source}",
                    path=seam_backends.path(source), seam=True)
    run = Run(clause, source.name, case, need=declared_need(clause, source),
               name=source.name, path=engine.dotted(source.path))
    if not supports_paged_kv(clause, source):
        raise run.skip(f"{source.name} has no paged KV support (supports_paged_kv is not True): "
                       f"production's worker refuses to serve paged KV with it ({REFUSAL} "
                       "raises NotImplementedError), so no layout reaches a worker",
                       SkipKind.NOT_APPLICABLE)
    return run


# The public ``kv_control_plane`` fixture reads a backend's need as KV-A1 does.
FIXTURE_CLAUSE = "KV-A1"


def fixture_control_plane(source: Source, case: Case, *, world_size: int | None = None,
                          device: str = "cpu") -> ControlPlane:
    """The ``kv_control_plane`` fixture's work: the production control plane for a need.

    A failure or skip names :data:`FIXTURE_CLAUSE`, the clause whose reading of
    the need it shares; the plugin names none.
    """
    need = source if isinstance(source, bool) else declared_need(FIXTURE_CLAUSE, source)
    with unsupported_as_skip(FIXTURE_CLAUSE):
        return build_control_plane(need, case, world_size=world_size, device=device)


# The public ``kv_deployment`` fixture stands up what KV-A3 checks.
DEPLOYMENT_CLAUSE = "KV-A3"


def fixture_deployment(source: Source, case: Case, workers: Workers, *,
                       boundary: bool = False) -> Any:
    """The ``kv_deployment`` fixture's work: production's engine for a backend or a need.

    A context manager yielding the deployment (``.report``, ``.call``); a backend
    production serves no paged KV with, or too few devices, is a skip naming
    :data:`DEPLOYMENT_CLAUSE`.
    """
    run = _run(DEPLOYMENT_CLAUSE, source, case)
    return deploy(run, _ranks(run, workers), topology=_topology(case, boundary=boundary))


def _ranks(run: Run, workers: Workers) -> list[WorkerHandle]:
    if isinstance(workers, Unplaceable):
        raise run.skip(workers.reason, SkipKind.HARDWARE)
    if len(workers) != run.the_case.world_size:
        raise ValueError(f"{len(workers)} workers for world size {run.the_case.world_size}")
    return list(workers)


def _topology(case: Case, *, boundary: bool = False) -> str:
    """What production selects for the case (uniproc alone, multiproc above), or a process
    boundary on purpose (production's multiproc executor at any world size)."""
    return entry_points.MP if boundary or case.world_size > 1 else entry_points.UNI


@contextmanager
def deploy(run: Run, handles: Sequence[WorkerHandle], *, topology: str,
              need: bool | None = None, control: str | None = None,
              prepin: str | None = None, memory: int | None = None,
              ) -> Iterator[deployment.Deployment]:
    """Production's engine for this check's backend and case, closed afterwards."""
    case = run.the_case
    spec = EngineSpec(backend=run.name, backend_path=run.path, case=case,
                      world_size=case.world_size, topology=topology, device=handles[0].device,
                      need=need if need is not None else (run.need if run.seam else None),
                      memory=memory)
    try:
        deployed = deployment.start(spec, handles, control=control, prepin=prepin)
    except Unsupported as exc:
        raise exc.skip(run.clause) from None
    except HarnessError as exc:
        raise run.harness(exc, f"running production's deployment ({topology})") from exc
    except WorkerCommandError as exc:  # a rank's worker could not start
        _host_limit(run, exc.remote or {})
        raise run.fail("production's diffusion worker could not start for this backend: "
                       f"{_production_error(exc.remote)}" if exc.remote else
                       f"the deployment could not run: {exc}") from exc
    try:
        note_via(deployed.report.via)
        yield deployed
    finally:
        try:
            deployed.close()
        except HarnessError:
            pass  # a dead worker holds nothing; the check's own outcome stands


def _production_error(error: dict[str, Any]) -> str:
    where = error.get("where") or "production"
    return f"{where} raised {error['type']}: {error['message']}"


def ran(run: Run, report: EngineReport) -> None:
    """The deployment came up and the control plane handed every rank its config."""
    error = report.error
    if error is None:
        return
    _same_class(run, report)  # a worker that built the layers with another class says most
    if error["stage"] == "worker start-up":
        _host_limit(run, error)
        raise run.fail("production's diffusion worker could not start for this backend: "
                       f"{_production_error(error)}", layout=report.pinned)
    if error["stage"] == "set_kv_cache_configs":
        raise run.fail(f"a worker refused its rank-local config: {_production_error(error)}",
                       layout=report.pinned)
    raise run.fail(f"production's control plane failed: {_production_error(error)}",
                   layout=report.pinned)


def _host_limit(run: Run, error: dict[str, Any]) -> None:
    """A worker that could not start for want of an accelerator: the host's limit."""
    if error.get("host_limit"):
        raise run.skip("production's diffusion worker cannot start on this host: "
                       f"{error['host_limit']} ({_production_error(error)})", SkipKind.HARDWARE)


def _same_class(run: Run, report: EngineReport) -> None:
    """Each rank's worker process, having loaded its plugins as production's do, built its
    layers with the class the test process checked."""
    for rank, layers in enumerate(report.layer_backends):
        backends = sorted({str(path) for path in layers.values()})
        if backends and backends != [run.path]:
            raise run.fail(f"rank {rank}: production's worker built its attention layers with "
                           f"{backends}, not the class the test process checked ({run.path}); "
                           "production would run a class nobody checked",
                           expected=run.path, actual=backends)


def _served(run: Run, report: EngineReport) -> None:
    """Each rank's worker built its layers with the class under test, and registered the
    case's geometry (else the deployment would test something else)."""
    _same_class(run, report)
    for rank, specs in enumerate(report.specs):
        for layer, spec in specs.items():
            case = run.the_case
            got = (spec.num_kv_heads, spec.head_size, str(spec.dtype).removeprefix("torch."))
            if got != (case.num_kv_heads, case.head_size, case.dtype):
                raise HarnessError(f"{run.clause}: rank {rank}'s layer {layer} registered "
                                   f"{got}, not the case's (num_kv_heads, head_size, dtype)")


# --- KV-A1 --------------------------------------------------------------------------


def check_kv_a1(source: Source, case: Case, workers: Workers) -> None:
    """KV-A1: the control plane pins before sizing and stamps every config with the name."""
    run = _run("KV-A1", source, case)
    handles = _ranks(run, workers)
    with deploy(run, handles, topology=_topology(case)) as deployed:
        report = deployed.report
    if report.error is not None and not report.rank_configs:
        ran(run, report)
    pinned = report.pinned
    if pinned is None:
        raise run.fail("the control plane left its own CacheConfig unpinned",
                       expected="a layout name", actual=None)
    if not report.sized_with:
        raise run.fail("sizing (get_kv_cache_configs) was not observed; cannot tell whether "
                       "the layout was pinned before it", layout=pinned)
    if any(name != pinned for name in report.sized_with):
        raise run.fail("the layout was not pinned when the control plane sized the cache",
                       layout=pinned, expected=pinned, actual=report.sized_with)
    if oracle.is_block_outermost(pinned) != run.need:
        raise run.fail("the pinned layout contradicts the declared need "
                       f"(indexes_kv_by_block_stride={run.need})", layout=pinned,
                       expected=f"is_block_outermost={run.need}", actual=pinned)
    if len(report.rank_configs) != case.world_size:
        raise run.fail("one rank-local config per rank", layout=pinned,
                       expected=case.world_size, actual=len(report.rank_configs))
    stamped = [(f"rank {r}", c) for r, c in enumerate(report.rank_configs)]
    for who, config in [*stamped, ("scheduler", report.scheduler_config)]:
        name = getattr(config, "kv_cache_layout", None)
        if name != pinned:
            raise run.fail(f"the {who} KVCacheConfig is not stamped with the pinned layout",
                           layout=pinned, expected=pinned, actual=name)
    for who, config in stamped:
        _sized_for(run, who, config, pinned)


def _geometry(config: Any, layers: int) -> oracle.Geometry:
    """Manager-block grain, from the spec production's worker registered (its block size
    is the platform's): the oracle's inputs, never production's derivation."""
    spec = config.kv_cache_groups[0].kv_cache_spec
    return oracle.Geometry.for_attention(
        num_layers=layers, num_blocks=config.num_blocks, num_kv_heads=spec.num_kv_heads,
        block_size=spec.block_size, head_size=spec.head_size,
        dtype=str(spec.dtype).removeprefix("torch."),
        page_size_padded=getattr(spec, "page_size_padded", None), kernel_block_size=None)


def _expected_offset(run: Run, who: str, tensor: Any, layout: str | None) -> int:
    """The byte offset of a single-group tensor's first page: 0, from first principles.

    One group owns the whole allocation, so its first page starts at byte 0;
    production's ``offset`` is asserted against that, never fed to the oracle.
    """
    case = run.the_case
    if case.num_groups != 1:
        raise run.skip(f"case {case.id} has {case.num_groups} KV cache "
                       "groups; the expected tensor offset is derived for one group only",
                       SkipKind.NOT_APPLICABLE)
    if tensor.offset != 0:
        raise run.fail(f"the {who} KVCacheTensor.offset is not 0, although its one KV cache "
                       "group owns the whole allocation", layout=layout, expected=0,
                       actual=tensor.offset)
    return 0


def _sized_for(run: Run, who: str, config: Any, layout: str) -> None:
    """The sizing agrees with the pinned layout: strides are the oracle's for it."""
    for tensor in config.kv_cache_tensors:
        geom = _geometry(config, len(tensor.layers))
        want = oracle.expected_tensor(layout, geom, _expected_offset(run, who, tensor, layout))
        got = oracle.OracleTensor(tensor.size, tensor.layer_stride, tensor.block_stride,
                                  tensor.offset)
        if got != want:
            raise run.fail(f"the {who} KVCacheTensor was not sized for the pinned layout",
                           layout=layout, expected=want, actual=got)


# --- KV-A2 --------------------------------------------------------------------------


def check_kv_a2(source: Source, case: Case, workers: Workers) -> None:
    """KV-A2: each rank-local config reaches an unpinned worker process intact.

    Runs production's multiproc topology whatever the world size: the boundary is
    the point (the uniproc executor hands configs over by reference).
    """
    run = _run("KV-A2", source, case)
    handles = _ranks(run, workers)
    with deploy(run, handles, topology=entry_points.MP) as deployed:
        report = deployed.report
        wire = getattr(getattr(deployed, "executor", None), "wire", "the executor's own queue")
    ran(run, report)
    _served(run, report)
    pinned = report.pinned
    for rank, seen in enumerate(report.ranks):
        _crossed_process_boundary(run, rank, seen, report.control_plane_pid, pinned)
        fresh = report.fresh_layouts[rank] if rank < len(report.fresh_layouts) else "?"
        if fresh is not None:
            raise run.fail(f"rank {rank}: the worker's own config started pinned",
                           layout=pinned, expected=None, actual=fresh)
        _first_field_difference(run, pinned, rank, config_summary(report.rank_configs[rank]),
                                seen["received"])
    if wire not in (executor_wire.ENQUEUE, "the executor's own queue"):
        raise run.skip(f"the executor's serialiser could not be driven; the "
                       f"configs crossed as {wire}", SkipKind.ENVIRONMENT)


def _crossed_process_boundary(run: Run, rank: int, seen: dict[str, Any],
                              control_plane: int | None, layout: str | None) -> None:
    """The worker says, from inside, that it is another process than the control plane's,
    started on the control plane's behalf (multiprocessing names it as the parent)."""
    keys = ("pid", "ppid", "parent_pid", "has_parent_process", "start_method")
    actual = {key: seen.get(key) for key in keys}
    if actual["pid"] == control_plane:
        raise run.fail(f"rank {rank}: the worker ran in the control plane's process",
                       layout=layout, expected=f"pid not {control_plane}", actual=actual)
    if not actual["has_parent_process"] or actual["parent_pid"] != control_plane:
        raise run.fail(f"rank {rank}: the worker is not a child process started for the "
                       "control plane", layout=layout,
                       expected={"parent_pid": control_plane, "has_parent_process": True},
                       actual=actual)
    if control_plane != os.getpid() and seen.get("ppid") != control_plane:
        raise run.fail(f"rank {rank}: the worker's OS parent is not the engine process",
                       layout=layout, expected=control_plane, actual=actual)


def _first_field_difference(run: Run, layout: str | None, rank: int, sent: Any,
                            received: Any, path: str = "") -> None:
    if isinstance(sent, dict) and isinstance(received, dict):
        for key in sent:
            _first_field_difference(run, layout, rank, sent[key], received.get(key),
                                    f"{path}.{key}" if path else key)
        return
    if isinstance(sent, list) and isinstance(received, list) and len(sent) == len(received):
        for i, (a, b) in enumerate(zip(sent, received, strict=True)):
            _first_field_difference(run, layout, rank, a, b, f"{path}[{i}]")
        return
    if sent != received:
        raise run.fail(f"rank {rank}: the config the worker's runner holds differs from the "
                       f"control plane's rank-{rank} config at {path or 'the top'}",
                       layout=layout, expected=sent, actual=received)


# --- KV-A4 --------------------------------------------------------------------------


# Three independent negative controls, each its own result: a known failure of one
# (the contradiction, on vllm-omni 0.30) must not hide a regression of another.


def check_kv_a4_unadopted(source: Source, case: Case, workers: Workers) -> None:
    """KV-A4: a worker that skips adoption makes ``init_kv_cache`` raise the
    unresolved-layout error (no allocation under a layout nobody resolved)."""
    run = _run("KV-A4", source, case)
    handles = _ranks(run, workers)
    unresolved = compat.unresolved_layout_error_text()
    with deploy(run, handles, topology=_topology(case), control=SKIP_ADOPTION_REF) as deployed:
        report = deployed.report
    error = _refusal(run, report)
    if error is None:
        raise run.fail("with adoption skipped (DiffusionKVModelRunnerBackend.initialize_kv_cache "
                       "rewritten without adopt_kv_cache_layout), the worker allocated",
                       layout=report.pinned,
                       expected=f"ValueError: {unresolved or 'unresolved layout'}",
                       actual=f"an allocation laid out as {_layouts(report)}")
    if not unresolved or unresolved not in error["message"]:
        raise run.fail("skipping adoption raised another error than the unresolved-layout "
                       "error", layout=report.pinned, expected=unresolved,
                       actual=_production_error(error))


def check_kv_a4_disagreement(source: Source, case: Case, workers: Workers) -> None:
    """KV-A4: a worker already pinned to another layout than the control plane's raises
    the disagreement error, naming both, instead of adopting."""
    run = _run("KV-A4", source, case)
    handles = _ranks(run, workers)
    for other in compat.LAYOUT_NAMES[:2]:  # the second only if the first was the one stamped
        with deploy(run, handles, topology=_topology(case), prepin=other) as deployed:
            report = deployed.report
        stamped = _stamped(report)
        if stamped != other:
            break
    error = _refusal(run, report)
    if error is None:
        raise run.fail(f"a worker already pinned to {other} adopted {stamped} without the "
                       "disagreement error", layout=report.pinned,
                       expected="ValueError naming both layouts",
                       actual=f"allocated as {_layouts(report)}")
    text = error["message"]
    if error["type"] != "ValueError" or other not in text or str(stamped) not in text:
        raise run.fail("the disagreement error does not name both layouts",
                       layout=report.pinned, expected=f"ValueError naming {other} and {stamped}",
                       actual=_production_error(error))


def check_kv_a4_contradiction(source: Source, case: Case, workers: Workers) -> None:
    """KV-A4: a worker handed a layout that contradicts its layers' attention backend
    refuses to allocate it."""
    run = _run("KV-A4", source, case)
    handles = _ranks(run, workers)
    with deploy(run, handles, topology=_topology(case), need=not run.need) as deployed:
        report = deployed.report
    if _refusal(run, report) is None:
        native = sorted({n for seen in report.ranks
                         for n in seen.get("native_backends", {}).values()})
        raise run.fail(
            f"a worker handed {_layouts(report)} for layers whose backend declares "
            f"indexes_kv_by_block_stride()={run.need} allocated it: "
            "DiffusionKVModelRunnerBackend.initialize_kv_cache asserts each registered layer "
            f"against the layout through the layer's native paged backend ({', '.join(native)}), "
            "which declares no need, so the contradiction passes unchecked",
            layout=report.pinned, expected="ValueError: the layout contradicts the backend",
            actual=f"allocated as {_layouts(report)}")


def _refusal(run: Run, report: EngineReport) -> dict[str, Any] | None:
    """The worker's refusal of its config, or None when it allocated."""
    error = report.error
    if error is None:
        _served(run, report)
        return None
    if error["stage"] != "set_kv_cache_configs":
        ran(run, report)
    return error


def _stamped(report: EngineReport) -> str | None:
    return report.rank_configs[0].kv_cache_layout if report.rank_configs else report.pinned


def _layouts(report: EngineReport) -> str:
    return ", ".join(sorted({str(seen["layout_after"]) for seen in report.ranks})) or "?"
