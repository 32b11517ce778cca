"""Production's layout resolution for vLLM's own attention backends (KV-V3, KV-V4).

The installed functions are found by feature detection (never a version string):
``get_supported_kv_cache_layouts`` (a worker intersects its backends' declarations),
``resolve_kv_cache_layout`` (the engine core resolves one layout over the ranks) and
``record_kv_cache_layout`` (a worker adopts it), in ``vllm.v1.attention.backends.utils``.
Everything here returns plain data (layout names, refusals as text), so it can run in a
child that calls into a backend's class and send the answer back.
vLLM is imported lazily, inside functions.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pytest_kvconform.adapters import run_env
from pytest_kvconform.contract.outcomes import SkipKind, Unsupported

UTILS = "vllm.v1.attention.backends.utils"
FUNCTIONS = ("get_supported_kv_cache_layouts", "resolve_kv_cache_layout",
             "record_kv_cache_layout")
ENV_VAR = "VLLM_KV_CACHE_LAYOUT"
CONNECTOR_MODULE = "pytest_kvconform.adapters.vllm_connector"
CONNECTOR_CLASS = "KvConformConnector"
CONNECTOR_KEY = "kvconform_required_layout"


def production() -> Any:
    """The module holding production's three functions, or ``Unsupported`` naming the gap."""
    try:
        module = importlib.import_module(UTILS)
    except ImportError as exc:
        raise Unsupported(f"{UTILS} does not import: {exc}", SkipKind.ENVIRONMENT) from None
    missing = [name for name in FUNCTIONS if not callable(getattr(module, name, None))]
    if missing:
        raise Unsupported(f"installed vLLM has no {', '.join(missing)} in {UTILS}: it "
                          "resolves no layout from its backends' declarations",
                          SkipKind.NOT_APPLICABLE)
    return module


def declares_layouts(cls: Any) -> bool:
    """Whether the class has the declaration at all (read without running its code)."""
    import inspect

    return inspect.getattr_static(cls, "supported_kv_cache_layouts", None) is not None


DECLARATION = "supported_kv_cache_layouts"


def declaration(cls: Any) -> tuple[str, ...] | None:
    """``cls.supported_kv_cache_layouts()`` as names (runs the backend's code: bound it)."""
    found = cls.supported_kv_cache_layouts()
    if found is None:
        return None
    return tuple(_name(member) for member in found)


def _name(member: Any) -> str:
    return str(getattr(member, "name", member))


@dataclass(frozen=True)
class Got:
    """What production gave: a value (names, or one name), or the exception it raised."""

    value: tuple[str, ...] | str | None = None
    raised: str | None = None  # "ValueError: ..." when it refused

    def __str__(self) -> str:
        if self.raised is not None:
            return f"raised {self.raised}"
        if isinstance(self.value, tuple):
            return "[" + ", ".join(self.value) + "]"
        return str(self.value)


def _raised(exc: BaseException) -> Got:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return Got(raised=f"{type(exc).__name__}: {text}"[:300])


def worker_layouts(classes: Sequence[Any]) -> Got:
    """Production's ``get_supported_kv_cache_layouts`` for one worker's backends."""
    module = production()
    try:
        found = module.get_supported_kv_cache_layouts(list(classes))
    except Exception as exc:
        return _raised(exc)
    return Got(tuple(_name(member) for member in found))


def vllm_config(*, connector: str | None = None, pinned: str | None = None) -> Any:
    """A bare ``VllmConfig`` (CPU device); ``connector``: a connector requiring that layout
    (the stand-in in ``vllm_connector.py``); ``pinned``: the layout already recorded."""
    from vllm.config import DeviceConfig, VllmConfig

    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    if connector is not None:
        from vllm.config import KVTransferConfig

        config.kv_transfer_config = KVTransferConfig(
            kv_connector=CONNECTOR_CLASS, kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_both", kv_connector_extra_config={CONNECTOR_KEY: connector})
    if pinned is not None:
        config.cache_config.kv_cache_layout = pinned
    return config


def page_specs(mixed: bool) -> list[Any]:
    """Attention specs of a model: one page shape, or two (``mixed``: different head counts)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    one = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    if not mixed:
        return [one, one]
    return [one, FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64,
                                   dtype=torch.bfloat16)]


@contextlib.contextmanager
def env_layout(value: str | None) -> Iterator[None]:
    """For the duration: ``$VLLM_KV_CACHE_LAYOUT`` is ``value`` (unset when None)."""
    with run_env.variable_set(ENV_VAR, value):
        yield


def resolve(ranks: Sequence[Sequence[str]], *, mixed_pages: bool = False,
            env: str | None = None, connector: str | None = None,
            pinned: str | None = None) -> Got:
    """Production's ``resolve_kv_cache_layout`` over ``ranks`` (each rank's names).

    The name it returns must be the one it records on the config: a disagreement is given
    as a raised ``AssertionError`` naming both (never a layout it did not pin)."""
    module = production()
    try:
        config = vllm_config(connector=connector, pinned=pinned)
        with env_layout(env):
            layout = module.resolve_kv_cache_layout(
                config, [list(r) for r in ranks], page_specs(mixed_pages))
    except Exception as exc:
        return _raised(exc)
    name = _name(layout)
    recorded = config.cache_config.kv_cache_layout
    if recorded is None or _canonical_recorded(recorded) != name:
        return Got(raised=f"returned {name} but recorded {recorded!r} on the config")
    return Got(name)


def _canonical_recorded(recorded: str) -> str:
    from vllm.config.cache import _LAYOUT_COMPAT_ALIASES

    return str(_LAYOUT_COMPAT_ALIASES.get(recorded, recorded))


def aliases() -> dict[str, str]:
    """The legacy names the installed vLLM accepts (alias -> canonical); empty if none."""
    module = importlib.import_module("vllm.config.cache")
    return dict(getattr(module, "_LAYOUT_COMPAT_ALIASES", {}) or {})


def enum_names() -> tuple[str, ...]:
    """The installed ``KVCacheLayout``'s members, in order."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return tuple(member.name for member in KVCacheLayout)


# --- the engine core's RPC to the workers (KV-V4) ---------------------------------------

EXECUTOR = "vllm.v1.executor.abstract:Executor.set_kv_cache_layout"
WORKER = "vllm.v1.worker.worker_base:WorkerBase"
RUN_METHOD = "vllm.v1.serial_utils:run_method"


class WireExecutor:
    """Stands in for a multiproc executor's transport only: production's ``Executor``
    methods are run on it, and its ``collective_rpc`` serialises the call as vLLM's
    ``MultiprocExecutor.collective_rpc`` does (a callable by cloudpickle; the request by the
    executor's own broadcast queue, ``executor_wire.encode``) instead of sending it; the
    frames are what a worker process receives."""

    def __init__(self, transport: Any = None) -> None:
        self.frames: list[bytes] = []
        self.how = ""
        self.transport = transport  # frames -> the worker's output; None: keep the frames

    def collective_rpc(self, method: Any, timeout: float | None = None,
                       args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                       **_: Any) -> list[Any]:
        from pytest_kvconform.adapters import executor_wire

        if not isinstance(method, str):
            import pickle

            cloudpickle: Any = importlib.import_module("cloudpickle")  # vLLM's dependency
            method = cloudpickle.dumps(method, protocol=pickle.HIGHEST_PROTOCOL)
        # vLLM's MultiprocExecutor.collective_rpc enqueues (method, args, kwargs, output_rank).
        self.frames, self.how = executor_wire.encode((method, tuple(args), dict(kwargs or {}),
                                                      None))
        return [None if self.transport is None else self.transport(self.frames)]


def executor_frames(layout_name: str) -> tuple[list[bytes], str]:
    """The frames production's ``Executor.set_kv_cache_layout(layout_name)`` sends."""
    from vllm.v1.executor.abstract import Executor

    wire = WireExecutor()
    Executor.set_kv_cache_layout(wire, layout_name)
    return wire.frames, wire.how


def executor_supported(wire: WireExecutor) -> list[list[str]]:
    """Production's ``Executor.get_supported_kv_cache_layouts`` over ``wire``: each rank's."""
    from vllm.v1.executor.abstract import Executor

    return [list(names) for names in Executor.get_supported_kv_cache_layouts(wire)]


def executor_set_layout(wire: WireExecutor, layout_name: str) -> None:
    """Production's ``Executor.set_kv_cache_layout`` over ``wire``."""
    from vllm.v1.executor.abstract import Executor

    Executor.set_kv_cache_layout(wire, layout_name)


def engine_resolve(ranks: Sequence[Sequence[str]], spec: Any) -> str:
    """The engine core's step: production's ``resolve_kv_cache_layout`` on a fresh config,
    over the ranks' reports and the model's specs (every layer's)."""
    layout = production().resolve_kv_cache_layout(vllm_config(), [list(r) for r in ranks],
                                                  [spec, spec])
    return _name(layout)


def rpc_frames(method: Any, *args: Any) -> list[bytes]:
    """The frames of ``collective_rpc(method, args=args)`` (a callable: by cloudpickle)."""
    wire = WireExecutor()
    wire.collective_rpc(method, args=args)
    return wire.frames


def production_worker(pinned: str | None = None) -> Any:
    """Production's ``WorkerBase`` on a fresh CPU config whose layout is unpinned (or
    already ``pinned``)."""
    from vllm.v1.worker.worker_base import WorkerBase

    return WorkerBase(vllm_config(pinned=pinned), local_rank=0, rank=0,
                      distributed_init_method="tcp://127.0.0.1:0", is_driver_worker=True)


def production_worker_proc(pinned: str | None = None, backend: str | None = None,
                           layers: Sequence[str] = ()) -> Any:
    """What a vLLM worker process holds: production's ``WorkerWrapperBase`` (its RPC target)
    around :func:`production_worker` (``init_worker`` needs a model config, none here);
    with ``backend`` (``module:Class``), a model whose attention ``layers`` use it,
    registered where production finds a model's layers (the static forward context)."""
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    wrapper = WorkerWrapperBase(rpc_rank=0)
    wrapper.worker = production_worker(pinned)
    wrapper.vllm_config = wrapper.worker.vllm_config
    if backend is not None:
        cls = _load(backend)
        context = wrapper.vllm_config.compilation_config.static_forward_context
        for name in layers:
            context[name] = _attention_layer(cls)
    return wrapper


def _load(path: str) -> Any:
    module, _, qualname = path.partition(":")
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def _attention_layer(cls: Any) -> Any:
    """A model's attention layer that uses ``cls`` (all production asks of it here)."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    class Layer(AttentionLayerBase):  # type: ignore[misc]
        def get_attn_backend(self) -> Any:
            return cls

        def get_kv_cache_spec(self, vllm_config: Any) -> Any:
            return None

    return Layer()


def worker_proc_receives(wrapper: Any, frames: Sequence[bytes]) -> Any:
    """The worker process's side of one RPC: the frames decoded as its queue decodes them,
    then production's ``WorkerProc._execute_worker_rpc`` (found by feature detection; else
    its dispatch, ``run_method``) on a stand-in holding the wrapper; its output, or the
    exception the method raised, raised here."""
    from pytest_kvconform.adapters import executor_wire

    request = executor_wire.decode(frames)
    execute = _worker_proc_execute()
    if execute is None:
        from vllm.v1.serial_utils import run_method

        method, args, kwargs, _rank = request
        return run_method(wrapper, method, tuple(args), dict(kwargs))
    outputs: list[Any] = []
    proc = _ProcSide(wrapper, outputs)
    execute(proc, request)
    if not outputs:
        raise RuntimeError("WorkerProc._execute_worker_rpc handed back no output")
    if isinstance(outputs[0], BaseException):
        raise outputs[0]
    return outputs[0]


@dataclass
class _ProcSide:
    """The state ``WorkerProc._execute_worker_rpc`` reads: the worker, its rank, its output."""

    worker: Any
    outputs: list[Any]
    rank: int = 0

    def handle_output(self, output: Any) -> None:
        self.outputs.append(output)


def _worker_proc_execute() -> Any:
    try:
        from vllm.v1.executor.multiproc_executor import WorkerProc
    except ImportError:
        return None
    return getattr(WorkerProc, "_execute_worker_rpc", None)


def allocated_views(worker: Any, kv_cache_config: Any, layer_names: Sequence[str]
                    ) -> dict[str, Any]:
    """Run in the worker (a callable RPC): production's ``allocate_kv_cache`` at the layout
    the worker resolved; each layer view as plain data (bytes: shape, strides, offset)."""
    import torch
    from vllm.v1.worker.utils import allocate_kv_cache

    member = worker.vllm_config.cache_config.get_resolved_kv_cache_layout()
    views = allocate_kv_cache(kv_cache_config, torch.device("cpu"), member)
    out = []
    for name in layer_names:
        view = views[name]
        size = view.element_size()
        base = view.untyped_storage().data_ptr()
        out.append({"shape": list(view.shape), "stride": [s * size for s in view.stride()],
                    "offset": view.data_ptr() - base, "itemsize": size})
    return {"adopted": member.name, "views": out}
