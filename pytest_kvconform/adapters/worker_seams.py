"""What the harness does around production's worker methods: all of it, in this one place.

KV-A and KV-L6 hand the control plane's configs to production's own code, as deep as it
runs on this host (``entry_points.entry_point`` picks the level; every result's ``via`` and the
run's header name it and say why a deeper one did not run).  Around those methods the
harness does exactly this, and nothing elsewhere:

- **executor** level (production's ``DiffusionWorker`` imports): production's executor
  (``UniProcDiffusionExecutor`` at world size 1; ``MultiprocDiffusionExecutor`` above it on
  GPUs), ``WorkerWrapperBase`` and ``DiffusionWorker`` with its model runner run as they
  are, except:

  - where the host has no accelerator for the worker's device (:func:`accelerator_gap`,
    from torch's own report, never from an error message), ``DiffusionWorker``'s
    constructor cannot complete: its ``init_device`` (paged KV mode) takes vLLM's
    ``MemorySnapshot`` of the device, which measures it through ``torch.accelerator``.
    :func:`seams` builds that one snapshot unmeasured (vLLM's own ``auto_measure=False``);
    everything else the constructor does runs.  The snapshot only feeds the worker's
    memory profiling, which production skips when ``kv_cache_memory_bytes`` is configured
    (every KV-A deployment configures it), so ``determine_available_kv_memory`` answers
    the configured budget, as production's worker does when it is given one;
  - placement, on CPU above world size 1: production's multiproc executor would spawn
    each rank afresh (importing the stack again, tens of seconds), and forking its engine
    process instead deadlocks in libgomp once that process has run torch.  So each rank
    is a KV-A worker process (forked from the preloaded fork server) holding production's
    worker, built as the multiproc executor's worker process builds it
    (``WorkerProc._create_worker``, which runs ``WorkerWrapperBase``); the control plane
    runs in the test process, and production's ``DiffusionExecutor`` reaches the ranks
    through ``workers/deployment.py``'s ``PipeExecutor``: the multiproc executor's RPC
    envelope, serialised by its broadcast queue, over the KV-A worker pipes, each rank's
    call made through ``WorkerWrapperBase.execute_method``.  The ranks' all-gathers are
    production's own (``torch.distributed`` across the rank processes).  The ranks are
    handed their start together, and each rank above 0 first waits (at most
    :data:`RENDEZVOUS_WAIT_S`) until rank 0's rendezvous store listens
    (:func:`await_rendezvous`), as a launcher starting the ranks in order would: torch's
    store client that finds no server yet retries only after a random back-off.

- **runner** level (only production's model runner imports, as with torch's CPU build,
  beside which torchvision does not load): ``engine.RankHost`` stands in for
  ``DiffusionWorker`` around production's ``DiffusionModelRunner``, doing only what that
  worker does around it (its rank, its config, the runner, the custom-pipeline load, the
  configured KV budget, the rank's config handed to the runner), and production's
  ``DiffusionExecutor`` hands it the configs over a stand-in transport: at world size 1
  the uniproc executor's inline call (``engine.py``'s ``InlineExecutor``), above it the
  same ``PipeExecutor``, which then also stands in for the worker's all-gather (every
  rank's answer, in rank order).

- **starting**: deployments overlap (on CPU one tears down while the next starts, and
  each xdist worker runs its own), so each is handed its ``master_port``
  (:func:`rendezvous_port`, below the kernel's ephemeral range, where no other socket's
  port can land between the config's build and rank 0's bind); production's own choice
  is an ephemeral port.  Where ``$MASTER_PORT`` is set production uses it for every
  deployment.  A KV-A worker that ran a deployment gets the
  variables production's ``init_device`` set as they were at its start
  (:func:`fresh_rank_env`), as in a fresh process.

- **closing**, on CPU (KV-A workers forked from the fork server): each deployment is closed
  by production's own shutdown (the executor's, or a rank's worker's:
  ``child._WorkerState.release``), but the test process does not wait for it: the
  next deployment runs on other KV-A workers while it finishes (``WorkerHandle.release_later``,
  ``WorkerPool.get``, up to ``SPARE_SETS`` workers per rank, each set started while the
  deployment before it runs).  That teardown is mostly gloo process groups waiting on their
  transport's clock; a failure in it belongs to no check.  On GPUs
  the close is waited for, since it returns device memory a later check measures.

:func:`host_limit` tells a worker start-up failure that is the host's (raised by torch's
accelerator API for a device the host has no accelerator for) from production's own.
vLLM, vllm-omni and torch are imported lazily.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import random
import socket
import time
import traceback
from collections.abc import Iterator
from typing import Any

_WORKER = "vllm_omni.diffusion.worker.diffusion_worker"
# The torch modules whose frames mark a failure as raised by torch's accelerator API.
_ACCELERATOR_API = ("torch.accelerator", "torch.cuda")


# --- the host ---------------------------------------------------------------------


def accelerator_gap(device: Any) -> str | None:
    """Why torch cannot measure ``device``'s memory on this host, or None when it can: the
    current accelerator torch reports is absent, unavailable, or of another type."""
    import torch

    wanted = torch.device(device)
    api = getattr(torch, "accelerator", None)
    if api is not None:
        current, available = api.current_accelerator(), bool(api.is_available())
    else:  # a torch before torch.accelerator: CUDA is the only accelerator it measures
        available = bool(torch.cuda.is_available())
        current = torch.device("cuda") if torch.backends.cuda.is_built() else None
    if current is not None and available and current.type == wanted.type:
        return None
    reported = ("no accelerator" if current is None else
                f"accelerator {current.type} ({'available' if available else 'not available'})")
    return f"this host's torch reports {reported}, and the worker's device is {wanted}"


def worker_device() -> Any:
    """The device production's worker takes for rank 0 (``DiffusionWorker.init_device``)."""
    from vllm_omni.platforms import current_omni_platform

    return current_omni_platform.get_torch_device(0)


def unmeasured_reason(device: Any) -> str | None:
    """Why ``DiffusionWorker``'s constructor cannot complete here (None: it can)."""
    gap = accelerator_gap(device)
    if gap is None:
        return None
    return ("its init_device measures the device with vLLM's MemorySnapshot through "
            f"torch.accelerator, and {gap}")


def seam_missing() -> str | None:
    """Why the snapshot cannot be left unmeasured with the installed vLLM (None: it can)."""
    module: Any = importlib.import_module(_WORKER)
    snapshot = getattr(module, "MemorySnapshot", None)
    if snapshot is None:
        return f"{_WORKER} takes no MemorySnapshot"
    if not dataclasses.is_dataclass(snapshot) or "auto_measure" not in {
            f.name for f in dataclasses.fields(snapshot)}:
        return "vLLM's MemorySnapshot has no auto_measure field"
    return None


def host_limit(exc: BaseException, device: Any = None) -> str | None:
    """Why ``exc`` is this host's hardware limit rather than production's failure (None:
    it is production's): torch's accelerator API raised it, and the host has no
    accelerator for ``device`` (default: the device production's worker takes)."""
    module = _accelerator_frame(exc)
    if module is None:
        return None
    gap = accelerator_gap(worker_device() if device is None else device)
    if gap is None:
        return None
    return f"torch's accelerator API ({module}) cannot serve it: {gap}"


def _accelerator_frame(exc: BaseException) -> str | None:
    """The torch accelerator-API module a frame of ``exc`` (or of its causes) ran in."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        for frame, _line in traceback.walk_tb(error.__traceback__):
            module = str(frame.f_globals.get("__name__", ""))
            if module.startswith(_ACCELERATOR_API):
                return module
        error = error.__cause__ or error.__context__
    return None


# --- placement: the ranks' rendezvous ------------------------------------------------

RENDEZVOUS_WAIT_S = 5.0
_RENDEZVOUS_HOST = "localhost"  # DiffusionWorker.init_device's MASTER_ADDR


def await_rendezvous(od_config: Any, rank: int) -> None:
    """Rank > 0: return once rank 0's rendezvous store accepts connections on the
    deployment's ``master_port``, or after :data:`RENDEZVOUS_WAIT_S` regardless.

    Rank 0's ``init_distributed_environment`` serves the store; another rank's client
    that connects before it listens backs off at random, for longer than the whole start
    takes.
    The wait only orders the ranks' calls into production: whatever rank 0 does, each
    rank then runs production's start as it would have.
    """
    port = getattr(od_config, "master_port", None)
    if rank == 0 or not isinstance(port, int):
        return
    deadline = time.monotonic() + RENDEZVOUS_WAIT_S
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((_RENDEZVOUS_HOST, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.002)


# --- placement: the rendezvous port -----------------------------------------------------

# The variables production's ``DiffusionWorker.init_device`` sets in its process.
RANK_ENV = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "RANK", "WORLD_SIZE")
_EPHEMERAL = "/proc/sys/net/ipv4/ip_local_port_range"
_PORTS = 4096  # the ports just below the ephemeral range, shared by a run's xdist workers


class _Cursor:
    next: int | None = None
    rng = random.Random()  # its own: other plugins reseed the global one per test


def rendezvous_ports(environ: dict[str, str] | None = None) -> range | None:
    """The ports this process hands its deployments as ``master_port``, or None where
    production picks its own (``$MASTER_PORT`` is set, which production reads first; or
    the host does not say which ports the kernel hands out).

    Production picks an OS-assigned ephemeral port when it builds the config and binds it
    only when rank 0 starts; any other socket's ephemeral port can take it in between (a
    deployment starting meanwhile: ``DistNetworkError EADDRINUSE``).  The kernel never
    assigns a port below its ephemeral range, so these are taken from there, each xdist
    worker its own share.
    """
    env = os.environ if environ is None else environ
    if "MASTER_PORT" in env:
        return None
    try:
        with open(_EPHEMERAL) as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    first = max(1024, low - _PORTS)
    worker = env.get("PYTEST_XDIST_WORKER", "")
    count = int(env.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    share = (low - first) // max(count, 1)
    if share < 8 or index >= count:
        return None
    return range(first + index * share, first + (index + 1) * share)


def rendezvous_port() -> int | None:
    """The ``master_port`` for the next deployment: the next free port of
    :func:`rendezvous_ports`, from a random start (two runs on one host part ways), or None
    (production picks its own; deployments then never start at once)."""
    ports = rendezvous_ports()
    if ports is None:
        return None
    if _Cursor.next is None:
        _Cursor.next = _Cursor.rng.randrange(len(ports))
    for _ in range(len(ports)):
        port = ports[_Cursor.next % len(ports)]
        _Cursor.next += 1
        if _bindable(port):
            return port
    return None


def _bindable(port: int) -> bool:
    """As production's own check (``is_port_available``): bindable with ``SO_REUSEADDR``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def fresh_rank_env(at_start: dict[str, str | None]) -> None:
    """Before a deployment in a KV-A worker that ran one: :data:`RANK_ENV` as at the
    worker's start, as in a fresh process.  The last deployment's ``init_device`` left its
    values, and production reads ``$MASTER_PORT`` before a config's own ``master_port``."""
    for name in RANK_ENV:
        value = at_start.get(name)
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# --- the seam at the executor level -----------------------------------------------------


def _measured_where_possible(real: Any) -> Any:
    """vLLM's ``MemorySnapshot``, built unmeasured for a device the host cannot measure."""

    def memory_snapshot(*args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if device is not None and kwargs.get("auto_measure", True) and \
                accelerator_gap(device) is not None:
            kwargs["auto_measure"] = False
        return real(*args, **kwargs)

    memory_snapshot.kvconform_seam = True  # type: ignore[attr-defined]
    return memory_snapshot


@contextlib.contextmanager
def seams() -> Iterator[None]:
    """For the duration: ``DiffusionWorker``'s memory snapshot left unmeasured for a device
    the host cannot measure (once, however often entered)."""
    worker: Any = importlib.import_module(_WORKER)
    snapshot = getattr(worker, "MemorySnapshot", None)
    if snapshot is None or getattr(snapshot, "kvconform_seam", False) or \
            seam_missing() is not None:
        yield
        return
    worker.MemorySnapshot = _measured_where_possible(snapshot)
    try:
        yield
    finally:
        worker.MemorySnapshot = snapshot
