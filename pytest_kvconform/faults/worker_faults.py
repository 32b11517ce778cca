"""Production's worker side and control plane, changed the way a regression would change them.

Seeded through ``$KVCONFORM_WORKER_FAULT`` (comma-separated names) in every process that
hosts production's engine (``adapters/fault_hook.py``), never by monkeypatching the test
process, which those processes never see.  Four sorts:

- *regressions* (:data:`REGRESSIONS`): a production function's own source rewritten
  (``adapters/source_rewrite.py``; the layout helpers it calls are never touched).  The
  clause they break must fail, naming the production function.  ``skip_adoption`` is
  KV-A4's own negative control (``checks/adoption_controls.py``), reused here;
- *corruptions* (:data:`CORRUPTIONS`): the control plane's output spoiled after it is built;
- *corrections* (:data:`CORRECTIONS`): production corrected, so a control can be seen to pass;
- ``wrong_offset``: the harness's own pattern lands one token off (a KV-A3 failure), and
  the process faults (``process_faults.py``): a harness error, and the run goes on.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from typing import Any

from pytest_kvconform.adapters import source_rewrite
from pytest_kvconform.adapters.fault_hook import FAULT_ENV, names
from pytest_kvconform.adapters.source_rewrite import (
    DropStatements,
    Regression,
    Rewrite,
    StatementRewrite,
    is_call_to,
)
from pytest_kvconform.checks.adoption_controls import RUNNER_BACKEND, SKIP_ADOPTION, is_adoption
from pytest_kvconform.faults import vllm_plants
from pytest_kvconform.faults.process_faults import PROCESS_FAULTS

_BACKEND = RUNNER_BACKEND
_WORKER = "vllm_omni.diffusion.worker.diffusion_worker"
_UNIPROC = "vllm_omni.diffusion.executor.uniproc_executor"
_EXECUTOR = "vllm_omni.diffusion.executor.abstract"
_CONTROL_PLANE = "vllm_omni.diffusion.diffusion_kv.initialization"


# --- the rewrites ------------------------------------------------------------------------


def _is_assertion_loop(node: ast.AST) -> bool:
    return isinstance(node, ast.For) and any(
        is_call_to(stmt, "assert_backend_layout_supported") for stmt in node.body)


def _is_stamping_loop(node: ast.AST) -> bool:
    return isinstance(node, ast.For) and any(
        isinstance(stmt, ast.Assign) and any(
            isinstance(t, ast.Attribute) and t.attr == "kv_cache_layout" for t in stmt.targets)
        for stmt in node.body)


class _AllocateFirst(StatementRewrite):
    """The adoption statement moved after the ``init_kv_cache`` allocation."""

    def body(self, stmts: list[ast.stmt]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        moved: ast.stmt | None = None
        for stmt in stmts:
            if is_adoption(stmt):
                moved = stmt
                continue
            if moved is not None and is_call_to(stmt, "init_kv_cache"):
                out.extend([stmt, moved])
                moved = None
                self.done = True
                continue
            out.append(stmt)
        if moved is not None:
            out.append(moved)
        return out


class _HandoffDropsLayout(Rewrite):
    """``collective_rpc("set_kv_cache_configs", args=(configs, ...))``: the configs rebuilt
    field by field, without the stamp."""

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        if getattr(node.func, "attr", None) != "collective_rpc" or not node.args or \
                getattr(node.args[0], "value", None) != "set_kv_cache_configs":
            return node
        for keyword in node.keywords:
            if keyword.arg == "args" and isinstance(keyword.value, ast.Tuple) and \
                    isinstance(keyword.value.elts[0], ast.Name):
                configs = keyword.value.elts[0].id
                keyword.value.elts[0] = ast.parse(
                    f"[type(c)(num_blocks=c.num_blocks, kv_cache_tensors=c.kv_cache_tensors, "
                    f"kv_cache_groups=c.kv_cache_groups) for c in {configs}]",
                    mode="eval").body
                self.done = True
        return node


class _OtherRankConfig(Rewrite):
    """``kv_cache_configs[self.rank]`` -> the next rank's."""

    def visit_Subscript(self, node: ast.Subscript) -> ast.AST:
        self.generic_visit(node)
        if ast.unparse(node) == "kv_cache_configs[self.rank]":
            self.done = True
            return ast.parse("kv_cache_configs[(self.rank + 1) % len(kv_cache_configs)]",
                             mode="eval").body
        return node


def _shared_cache_config(original: Callable[..., Any]) -> Callable[..., Any]:
    """The uniproc executor hands its inline worker the control plane's ``CacheConfig``."""

    def collective_rpc(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        from pytest_kvconform.adapters import engine

        control_plane = engine.last_control_plane_config()
        if method == "set_kv_cache_configs" and control_plane is not None:
            worker = getattr(self.driver_worker, "worker", self.driver_worker)
            worker.vllm_config.cache_config = control_plane.cache_config
        return original(self, method, *args, **kwargs)

    collective_rpc.__qualname__ = original.__qualname__
    return collective_rpc


REGRESSIONS: dict[str, Regression] = {
    "skip_adoption": SKIP_ADOPTION,
    vllm_plants.WORKER_IGNORES_RPC_NAME: vllm_plants.WORKER_IGNORES_RPC,  # KV-V4
    "skip_layer_assertion": Regression(
        f"{_BACKEND}:DiffusionKVModelRunnerBackend.initialize_kv_cache",
        "no longer asserts each layer's backend against the layout",
        rewrite=functools.partial(DropStatements, _is_assertion_loop)),
    "allocate_before_adopting": Regression(
        f"{_BACKEND}:DiffusionKVModelRunnerBackend.initialize_kv_cache",
        "allocates before it adopts the layout", rewrite=_AllocateFirst),
    "other_rank_config": Regression(f"{_WORKER}:DiffusionWorker.set_kv_cache_configs",
                                    "hands its runner another rank's config",
                                    rewrite=_OtherRankConfig),
    "shared_cache_config": Regression(f"{_UNIPROC}:UniProcDiffusionExecutor.collective_rpc",
                                      "hands the inline worker the control plane's own "
                                      "CacheConfig", wrap=_shared_cache_config,
                                      runs_with=_WORKER),
    "handoff_drops_layout": Regression(
        f"{_EXECUTOR}:DiffusionExecutor.set_kv_cache_configs",
        "hands the workers each config rebuilt from its blocks, tensors and groups: the "
        "layout stamp is dropped", rewrite=_HandoffDropsLayout),
    "unstamped_configs": Regression(f"{_CONTROL_PLANE}:build_native_kv_cache_configs",
                                    "no longer stamps the layout on the configs",
                                    rewrite=functools.partial(DropStatements, _is_stamping_loop)),
}
# Not a fault: production corrected.  The runner asserts each layer's own (Omni) backend
# against the layout, where production asserts the layer's native paged backend; with it
# seeded, KV-A4's contradiction control can be seen to pass.
CORRECTIONS: dict[str, str] = {
    "assert_layer_backends": "DiffusionKVModelRunnerBackend.initialize_kv_cache asserts each "
                             "layer's own attention backend against the layout (a correction)",
}
# The control plane's output, spoiled after it is built (no statement of it is rewritten).
CORRUPTIONS: dict[str, str] = {
    "misnamed_configs": "the control plane stamps its rank-local configs with a layout it did "
                        "not pin",
    "shifted_offset": "the control plane shifts each rank's tensor by 512 bytes (size "
                      "included)",
}
FAULTS: tuple[str, ...] = (*REGRESSIONS, *CORRUPTIONS, *CORRECTIONS, "wrong_offset",
                           *PROCESS_FAULTS)


def validate(fault: str) -> None:
    """ValueError naming ``$KVCONFORM_WORKER_FAULT`` for a name that is no fault."""
    unknown = [n for n in names(fault) if n not in FAULTS]
    if unknown:
        raise ValueError(f"${FAULT_ENV}={fault!r} is not a known worker fault; expected one of "
                         f"{', '.join(FAULTS)} (comma-separated, or unset)")


def describe(fault: str) -> str:
    """For headers and reports: what the seeded fault(s) do."""
    return "; ".join(_describe(name) for name in names(fault))


def _describe(fault: str) -> str:
    regression = REGRESSIONS.get(fault)
    if regression is not None:
        return f"{fault}: {regression.qualname} {regression.what}"
    if fault in CORRUPTIONS:
        return f"{fault}: {CORRUPTIONS[fault]}"
    if fault in CORRECTIONS:
        return f"{fault}: {CORRECTIONS[fault]}"
    return {"wrong_offset": "wrong_offset: the harness writes its pattern one token off",
            "hang": "hang: the worker hangs while adopting",
            "die": "die: the worker is SIGKILLed while adopting",
            "oom": "oom: the worker's allocation asks for more memory than any host has",
            }[fault]


def regressions(fault: str | None) -> list[Regression]:
    """The production functions ``fault`` rewrites."""
    return [REGRESSIONS[name] for name in names(fault) if name in REGRESSIONS]


def applicable(fault: str) -> str | None:
    """Why a regression cannot be seeded in this process (its target does not import)."""
    regression = REGRESSIONS.get(fault)
    return None if regression is None else source_rewrite.applicable(regression)


def unseedable(fault: str) -> str | None:
    """Why a regression or corruption cannot be seeded into the installed stack (its target
    does not import, or no longer has the statement it rewrites), or None."""
    regression = REGRESSIONS.get(fault)
    if regression is not None:
        return source_rewrite.unseedable(regression, f"seeded fault {fault}")
    if fault in CORRUPTIONS:
        try:
            module = importlib.import_module(_CONTROL_PLANE)
        except Exception as exc:  # the control plane does not import here
            return f"{_CONTROL_PLANE} does not import ({type(exc).__name__}: {exc})"
        if not hasattr(module, "build_native_kv_cache_configs"):
            return f"{_CONTROL_PLANE}.build_native_kv_cache_configs is gone on this version"
    return None


# --- the control plane's output, a correction, the harness's pattern ---------------------


@contextlib.contextmanager
def corruption(fault: str | None) -> Iterator[None]:
    """For the duration: the control plane's configs spoiled as ``fault`` names."""
    fault = next((n for n in names(fault) if n in CORRUPTIONS), None)
    if fault is None:
        yield
        return
    module: Any = importlib.import_module(_CONTROL_PLANE)
    original = module.build_native_kv_cache_configs

    def spoiled(*args: Any, **kwargs: Any) -> Any:
        rank_configs, scheduler_config = original(*args, **kwargs)
        for config in rank_configs:
            if fault == "misnamed_configs":  # LBNHC -> LBHNC, BLNHC -> BLHNC
                name = config.kv_cache_layout
                config.kv_cache_layout = name[:2] + "HN" + name[4:]
            else:
                tensor = config.kv_cache_tensors[0]
                tensor.offset += 512
                tensor.size += 512
        return rank_configs, scheduler_config

    module.build_native_kv_cache_configs = spoiled
    try:
        yield
    finally:
        module.build_native_kv_cache_configs = original


@contextlib.contextmanager
def corrected(fault: str | None) -> Iterator[None]:
    """``assert_layer_backends``: the runner's per-layer assertion made to check each
    layer's own attention backend (recorded as the layers register), not its native one."""
    if "assert_layer_backends" not in names(fault):
        yield
        return
    module: Any = importlib.import_module(_BACKEND)
    cls = module.DiffusionKVModelRunnerBackend
    register, assertion = cls.register_kv_cache_layers, module.assert_backend_layout_supported
    own: dict[int, list[Any]] = {}

    def registering(self: Any, layers: Any) -> Any:
        own[id(self)] = [layer.attn_backend for layer, _spec in layers.values()]
        self._kvconform_id = id(self)
        return register(self, layers)

    def asserting(vllm_config: Any, native: Any) -> None:
        for frame in _callers():
            backends = own.get(getattr(frame.f_locals.get("self"), "_kvconform_id", -1))
            if backends is not None:
                for backend in backends:
                    assertion(vllm_config, backend)
                return
        assertion(vllm_config, native)

    cls.register_kv_cache_layers, module.assert_backend_layout_supported = registering, asserting
    try:
        yield
    finally:
        cls.register_kv_cache_layers, module.assert_backend_layout_supported = register, assertion


def _callers() -> Iterator[Any]:
    import sys

    frame = sys._getframe(2)
    while frame is not None:
        yield frame
        frame = frame.f_back  # type: ignore[assignment]


@contextlib.contextmanager
def offset_pattern(fault: str | None) -> Iterator[None]:
    """``wrong_offset``: the harness writes each page's pattern one token off (inside the
    allocation), through ``worker_extension.target_page``."""
    if "wrong_offset" not in names(fault):
        yield
        return
    from pytest_kvconform.adapters import worker_extension

    original = worker_extension.target_page

    def shifted(raw: Any, page: Any) -> Any:
        import torch

        shift = min(page.stride()[:2])
        end = page.storage_offset() + shift + sum(
            (n - 1) * s for n, s in zip(page.shape, page.stride(), strict=True)) + 1
        shift = -shift if end > raw.numel() else shift
        return torch.as_strided(raw, page.shape, page.stride(), page.storage_offset() + shift)

    worker_extension.target_page = shifted
    try:
        yield
    finally:
        worker_extension.target_page = original
