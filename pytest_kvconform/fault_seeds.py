"""Faults seeded inside the KV-A worker side, for the harness's own tests.

A seeded fault reaches the processes that host production's worker through
``$KVCONFORM_WORKER_FAULT`` (forwarded with every worker command, inherited by the
worker processes production's executor spawns), never through monkeypatching in
the test process, which those processes never see.  Two sorts:

- *Regressions* (:data:`REGRESSIONS`): production's worker-side callers changed the
  way a regression would change them, by rewriting the caller's own source (the
  layout helpers they call are never touched).  The clause they break must fail,
  naming the production function.
- *Process faults* (``hang``, ``die``, ``oom``) and ``wrong_offset`` (the harness's
  pattern lands one token off): the test must end as a harness error (or, for
  ``wrong_offset``, a KV-A3 failure), and the run go on.

:func:`active` validates the variable (a typo is an error, never a silent no-fault
run) so a session can announce the fault, or refuse it under ``--kv-strict``.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import os
import signal
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

ENV = "KVCONFORM_WORKER_FAULT"
PIDDIR_ENV = "KVCONFORM_WORKER_PIDDIR"
# The seeded ``oom`` fault asks for this many times the real allocation (past any host).
OOM_FACTOR = 1 << 40

_BACKEND = "vllm_omni.diffusion.diffusion_kv.model_runner_backend:DiffusionKVModelRunnerBackend"
_WORKER = "vllm_omni.diffusion.worker.diffusion_worker:DiffusionWorker"
_UNIPROC = "vllm_omni.diffusion.executor.uniproc_executor:UniProcDiffusionExecutor"


@dataclass(frozen=True)
class Regression:
    """A production method rewritten the way a regression would change it."""

    target: str  # "module:Class"
    method: str
    what: str  # what the rewritten method does wrong, in words

    @property
    def qualname(self) -> str:
        return f"{self.target.partition(':')[2]}.{self.method}"


REGRESSIONS: dict[str, Regression] = {
    "skip_adoption": Regression(_BACKEND, "initialize_kv_cache",
                                "no longer adopts the control plane's layout"),
    "skip_layer_assertion": Regression(_BACKEND, "initialize_kv_cache",
                                       "no longer asserts each layer's backend against the "
                                       "layout"),
    "allocate_before_adopting": Regression(_BACKEND, "initialize_kv_cache",
                                           "allocates before it adopts the layout"),
    "other_rank_config": Regression(_WORKER, "set_kv_cache_configs",
                                    "hands its runner another rank's config"),
    "shared_cache_config": Regression(_UNIPROC, "collective_rpc",
                                      "hands the inline worker the control plane's own "
                                      "CacheConfig"),
}
PROCESS_FAULTS = ("hang", "die", "oom")
FAULTS: tuple[str, ...] = (*REGRESSIONS, "wrong_offset", *PROCESS_FAULTS)


def active() -> str | None:
    """The fault ``$KVCONFORM_WORKER_FAULT`` names, or None; an unknown name raises."""
    value = os.environ.get(ENV) or None
    if value is not None and value not in FAULTS:
        raise ValueError(f"${ENV}={value!r} is not a known worker fault; expected one of "
                         f"{', '.join(FAULTS)} (or unset)")
    return value


def describe(fault: str) -> str:
    """One line for headers and reports: what the seeded fault does."""
    regression = REGRESSIONS.get(fault)
    if regression is not None:
        return f"{fault}: {regression.qualname} {regression.what}"
    return {"wrong_offset": "wrong_offset: the harness writes its pattern one token off",
            "hang": "hang: the worker hangs while adopting",
            "die": "die: the worker is SIGKILLed while adopting",
            "oom": "oom: the worker's allocation asks for more memory than any host has",
            }[fault]


# --- regressions: production methods rewritten -----------------------------------


def _resolve(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


class SeedError(RuntimeError):
    """The production source no longer has the statement a regression rewrites."""


def _is_call_to(node: ast.AST, name: str) -> bool:
    value = node.value if isinstance(node, ast.Expr | ast.Assign) else None
    return isinstance(value, ast.Call) and getattr(value.func, "id", None) == name


def _is_assertion_loop(node: ast.AST) -> bool:
    return isinstance(node, ast.For) and any(
        _is_call_to(stmt, "assert_backend_layout_supported") for stmt in node.body)


class _Rewrite(ast.NodeTransformer):
    """Apply one regression to the statements of a method body (any nesting depth)."""

    def __init__(self, fault: str) -> None:
        self.fault = fault
        self.done = False

    def _body(self, body: list[ast.stmt]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        moved: ast.stmt | None = None
        for stmt in body:
            if self.fault == "skip_adoption" and _is_call_to(stmt, "adopt_kv_cache_layout"):
                self.done = True
                continue
            if self.fault == "skip_layer_assertion" and _is_assertion_loop(stmt):
                self.done = True
                continue
            if self.fault == "allocate_before_adopting":
                if _is_call_to(stmt, "adopt_kv_cache_layout"):
                    moved = stmt
                    continue
                if moved is not None and _is_call_to(stmt, "init_kv_cache"):
                    out.extend([stmt, moved])
                    moved, self.done = None, True
                    continue
            out.append(stmt)
        if moved is not None:
            out.append(moved)
        return out

    def generic_visit(self, node: ast.AST) -> ast.AST:
        super().generic_visit(node)
        for name in ("body", "orelse", "finalbody"):
            stmts = getattr(node, name, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                setattr(node, name, self._body(stmts))
        return node

    def visit_Subscript(self, node: ast.Subscript) -> ast.AST:
        """``kv_cache_configs[self.rank]`` -> the next rank's (``other_rank_config``)."""
        self.generic_visit(node)
        if self.fault == "other_rank_config" and ast.unparse(node) == \
                "kv_cache_configs[self.rank]":
            self.done = True
            return ast.parse("kv_cache_configs[(self.rank + 1) % len(kv_cache_configs)]",
                             mode="eval").body
        return node


def _rewritten(fault: str, regression: Regression) -> Callable[..., Any]:
    cls = _resolve(regression.target)
    original = getattr(cls, regression.method)
    source = textwrap.dedent(inspect.getsource(original))
    tree = ast.parse(source)
    rewrite = _Rewrite(fault)
    tree = ast.fix_missing_locations(rewrite.visit(tree))
    if not rewrite.done:
        raise SeedError(f"seeded fault {fault!r}: {regression.qualname} no longer has the "
                        "statement the regression rewrites; update fault_seeds.py")
    module = inspect.getmodule(original)
    namespace: dict[str, Any] = dict(vars(module)) if module is not None else {}
    code = compile(tree, f"<{fault}: {regression.qualname}>", "exec")
    exec(code, namespace)  # production's own source, rewritten
    function: Callable[..., Any] = namespace[regression.method]
    function.__qualname__ = original.__qualname__
    return function


def _shared_cache_config(original: Callable[..., Any]) -> Callable[..., Any]:
    """The uniproc executor hands its inline worker the control plane's ``CacheConfig``."""

    def collective_rpc(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "set_kv_cache_configs" and _CONTROL_PLANE_CONFIGS:
            worker = getattr(self.driver_worker, "worker", self.driver_worker)
            worker.vllm_config.cache_config = _CONTROL_PLANE_CONFIGS[-1].cache_config
        return original(self, method, *args, **kwargs)

    collective_rpc.__qualname__ = original.__qualname__
    return collective_rpc


# The control planes' configs, recorded by the engine (for ``shared_cache_config``).
_CONTROL_PLANE_CONFIGS: list[Any] = []


def record_control_plane_config(vllm_config: Any) -> None:
    del _CONTROL_PLANE_CONFIGS[:]
    _CONTROL_PLANE_CONFIGS.append(vllm_config)


def applicable(fault: str) -> str | None:
    """Why a regression cannot be seeded in this process (its target does not import)."""
    regression = REGRESSIONS.get(fault)
    if regression is None:
        return None
    try:
        _resolve(regression.target)
    except Exception as exc:  # the target's module does not import here
        return (f"{regression.qualname} does not run on this host ({type(exc).__name__}: "
                f"{exc})")
    return None


@contextlib.contextmanager
def regression(fault: str | None) -> Iterator[None]:
    """For the duration: the production method ``fault`` names, rewritten (else nothing)."""
    spec = REGRESSIONS.get(fault or "")
    if fault is None or spec is None or applicable(fault) is not None:
        yield
        return
    cls = _resolve(spec.target)
    original = cls.__dict__[spec.method]
    replacement = (_shared_cache_config(original) if fault == "shared_cache_config"
                   else _rewritten(fault, spec))
    setattr(cls, spec.method, replacement)
    try:
        yield
    finally:
        setattr(cls, spec.method, original)


# --- process faults ----------------------------------------------------------------


def process_fault(fault: str | None) -> None:
    """The ``hang`` and ``die`` faults, where the worker adopts (``oom`` is at allocation)."""
    if fault == "hang":
        piddir = os.environ.get(PIDDIR_ENV)
        if piddir:
            with contextlib.suppress(OSError):
                open(os.path.join(piddir, f"{os.getpid()}.hang"), "w").close()
        while True:
            time.sleep(3600)
    if fault == "die":
        os.write(2, b"kvconform: seeded fault 'die': SIGKILL mid-command\n")
        os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def oversized_allocation(fault: str | None) -> Iterator[None]:
    """``oom``: the runner's ``init_kv_cache`` first asks the allocator for far too much."""
    if fault != "oom":
        yield
        return
    module: Any = importlib.import_module("vllm_omni.diffusion.diffusion_kv.model_runner_backend")
    original = module.init_kv_cache

    def init_kv_cache(forward_context: Any, kv_cache_config: Any, device: Any, *args: Any,
                      **kwargs: Any) -> Any:
        import torch

        asked = sum(int(t.size) for t in kv_cache_config.kv_cache_tensors) * OOM_FACTOR
        torch.empty(asked, dtype=torch.uint8, device=device)
        return original(forward_context, kv_cache_config, device, *args, **kwargs)

    module.init_kv_cache = init_kv_cache
    try:
        yield
    finally:
        module.init_kv_cache = original
