"""Faults seeded inside the KV-A worker side, for the harness's own tests and
``kvconform selftest`` (its registry: ``adapters/fault_registry.py``).

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
import stat
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

ENV = "KVCONFORM_WORKER_FAULT"
# A check's own negative control, for worker processes production spawns while it runs.
CONTROL_ENV = "KVCONFORM_WORKER_CONTROL"
PIDDIR_ENV = "KVCONFORM_WORKER_PIDDIR"
# The seeded ``oom`` fault asks for this many times the real allocation (past any host).
OOM_FACTOR = 1 << 40

_BACKEND = "vllm_omni.diffusion.diffusion_kv.model_runner_backend"
_WORKER = "vllm_omni.diffusion.worker.diffusion_worker"
_UNIPROC = "vllm_omni.diffusion.executor.uniproc_executor"
_EXECUTOR = "vllm_omni.diffusion.executor.abstract"
_CONTROL_PLANE = "vllm_omni.diffusion.diffusion_kv.initialization"


@dataclass(frozen=True)
class Regression:
    """A production function rewritten the way a regression would change it."""

    target: str  # "module:function" or "module:Class.method"
    what: str  # what the rewritten function does wrong, in words
    runs_with: str = ""  # a module the target needs to run at all (beyond its own)

    @property
    def qualname(self) -> str:
        return self.target.partition(":")[2]


REGRESSIONS: dict[str, Regression] = {
    "skip_adoption": Regression(f"{_BACKEND}:DiffusionKVModelRunnerBackend.initialize_kv_cache",
                                "no longer adopts the control plane's layout"),
    "skip_layer_assertion": Regression(
        f"{_BACKEND}:DiffusionKVModelRunnerBackend.initialize_kv_cache",
        "no longer asserts each layer's backend against the layout"),
    "allocate_before_adopting": Regression(
        f"{_BACKEND}:DiffusionKVModelRunnerBackend.initialize_kv_cache",
        "allocates before it adopts the layout"),
    "other_rank_config": Regression(f"{_WORKER}:DiffusionWorker.set_kv_cache_configs",
                                    "hands its runner another rank's config"),
    "shared_cache_config": Regression(f"{_UNIPROC}:UniProcDiffusionExecutor.collective_rpc",
                                      "hands the inline worker the control plane's own "
                                      "CacheConfig", runs_with=_WORKER),
    "handoff_drops_layout": Regression(
        f"{_EXECUTOR}:DiffusionExecutor.set_kv_cache_configs",
        "hands the workers each config rebuilt from its blocks, tensors and groups: the "
        "layout stamp is dropped"),
    "unstamped_configs": Regression(f"{_CONTROL_PLANE}:build_native_kv_cache_configs",
                                    "no longer stamps the layout on the configs"),
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
PROCESS_FAULTS = ("hang", "die", "oom")
FAULTS: tuple[str, ...] = (*REGRESSIONS, *CORRUPTIONS, *CORRECTIONS, "wrong_offset",
                           *PROCESS_FAULTS)


def active() -> str | None:
    """The fault(s) ``$KVCONFORM_WORKER_FAULT`` names (comma-separated), or None; an unknown
    name raises."""
    value = os.environ.get(ENV) or None
    unknown = [n for n in names(value) if n not in FAULTS]
    if unknown:
        raise ValueError(f"${ENV}={value!r} is not a known worker fault; expected one of "
                         f"{', '.join(FAULTS)} (comma-separated, or unset)")
    return value


def names(fault: str | None) -> tuple[str, ...]:
    """The faults a ``$KVCONFORM_WORKER_FAULT`` value seeds."""
    return tuple(n.strip() for n in (fault or "").split(",") if n.strip())


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


# --- regressions: production methods rewritten -----------------------------------


def _owner(target: str) -> tuple[Any, str]:
    """(the module or class holding the function, its attribute name)."""
    module, _, path = target.partition(":")
    owner: Any = importlib.import_module(module)
    *classes, name = path.split(".")
    for cls in classes:
        owner = getattr(owner, cls)
    return owner, name


class SeedError(RuntimeError):
    """The production source no longer has the statement a regression rewrites."""


def _is_call_to(node: ast.AST, name: str) -> bool:
    value = node.value if isinstance(node, ast.Expr | ast.Assign) else None
    return isinstance(value, ast.Call) and getattr(value.func, "id", None) == name


def _is_assertion_loop(node: ast.AST) -> bool:
    return isinstance(node, ast.For) and any(
        _is_call_to(stmt, "assert_backend_layout_supported") for stmt in node.body)


def _is_stamping_loop(node: ast.AST) -> bool:
    return isinstance(node, ast.For) and any(
        isinstance(stmt, ast.Assign) and any(
            isinstance(t, ast.Attribute) and t.attr == "kv_cache_layout" for t in stmt.targets)
        for stmt in node.body)


class _Rewrite(ast.NodeTransformer):
    """Apply regressions to the statements of a function body (any nesting depth)."""

    def __init__(self, faults: set[str]) -> None:
        self.faults = faults
        self.done: set[str] = set()

    def _drop(self, stmt: ast.stmt) -> bool:
        for fault, matches in (("skip_adoption", _is_adoption),
                               ("skip_layer_assertion", _is_assertion_loop),
                               ("unstamped_configs", _is_stamping_loop)):
            if fault in self.faults and matches(stmt):
                self.done.add(fault)
                return True
        return False

    def _body(self, body: list[ast.stmt]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        moved: ast.stmt | None = None
        for stmt in body:
            if self._drop(stmt):
                continue
            if "allocate_before_adopting" in self.faults:
                if _is_adoption(stmt):
                    moved = stmt
                    continue
                if moved is not None and _is_call_to(stmt, "init_kv_cache"):
                    out.extend([stmt, moved])
                    moved = None
                    self.done.add("allocate_before_adopting")
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

    def visit_Call(self, node: ast.Call) -> ast.AST:
        """``collective_rpc("set_kv_cache_configs", args=(configs, ...))``: the configs
        rebuilt field by field, without the stamp (``handoff_drops_layout``)."""
        self.generic_visit(node)
        if "handoff_drops_layout" not in self.faults or \
                getattr(node.func, "attr", None) != "collective_rpc" or not node.args or \
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
                self.done.add("handoff_drops_layout")
        return node

    def visit_Subscript(self, node: ast.Subscript) -> ast.AST:
        """``kv_cache_configs[self.rank]`` -> the next rank's (``other_rank_config``)."""
        self.generic_visit(node)
        if "other_rank_config" in self.faults and \
                ast.unparse(node) == "kv_cache_configs[self.rank]":
            self.done.add("other_rank_config")
            return ast.parse("kv_cache_configs[(self.rank + 1) % len(kv_cache_configs)]",
                             mode="eval").body
        return node


def _is_adoption(node: ast.AST) -> bool:
    return _is_call_to(node, "adopt_kv_cache_layout")


def _rewritten(original: Callable[..., Any], faults: set[str], where: str) -> Callable[..., Any]:
    """``original`` with ``faults`` applied to its own source; same globals, same name."""
    import types

    tree = ast.parse(textwrap.dedent(inspect.getsource(original)))
    rewrite = _Rewrite(faults)
    tree = ast.fix_missing_locations(rewrite.visit(tree))
    missing = faults - rewrite.done
    if missing:
        raise SeedError(f"seeded fault {', '.join(sorted(missing))}: {where} no longer has the "
                        "statement the regression rewrites; update adapters/seeds.py")
    namespace: dict[str, Any] = dict(original.__globals__)
    exec(compile(tree, f"<{', '.join(sorted(faults))}: {where}>", "exec"), namespace)
    built = namespace[original.__name__]
    code = built.__code__.replace(co_qualname=original.__code__.co_qualname)
    function = types.FunctionType(code, original.__globals__, original.__name__,
                                  original.__defaults__, original.__closure__)
    function.__kwdefaults__ = original.__kwdefaults__
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
        _owner(regression.target)
        if regression.runs_with:
            importlib.import_module(regression.runs_with)
    except Exception as exc:  # the target's module does not import here
        return (f"{regression.qualname} does not run on this host ({type(exc).__name__}: "
                f"{exc})")
    return None


def unseedable(fault: str) -> str | None:
    """Why a regression or corruption cannot be seeded into the installed stack (its target
    does not import, or no longer has the statement it rewrites), or None: the rewrite is
    compiled here, as each worker would, and thrown away."""
    reason = applicable(fault)
    regression = REGRESSIONS.get(fault)
    if reason is None and regression is not None and fault != "shared_cache_config":
        owner, name = _owner(regression.target)
        try:
            _rewritten(vars(owner)[name], {fault}, regression.qualname)
        except SeedError as exc:
            reason = str(exc)
    if fault in CORRUPTIONS:
        try:
            module = importlib.import_module(_CONTROL_PLANE)
        except Exception as exc:  # the control plane does not import here
            return f"{_CONTROL_PLANE} does not import ({type(exc).__name__}: {exc})"
        if not hasattr(module, "build_native_kv_cache_configs"):
            return f"{_CONTROL_PLANE}.build_native_kv_cache_configs is gone on this version"
    return reason


@contextlib.contextmanager
def regression(*faults: str | None) -> Iterator[None]:
    """For the duration: the production functions the faults name, rewritten (else nothing).

    Several regressions of one function are applied to its source together.
    """
    by_target: dict[str, set[str]] = {}
    for fault in faults:
        if fault in REGRESSIONS and applicable(fault) is None:
            by_target.setdefault(REGRESSIONS[fault].target, set()).add(fault)
    undo: list[tuple[Any, str, Any]] = []
    try:
        for target, names in by_target.items():
            owner, name = _owner(target)
            original = vars(owner)[name]
            if names == {"shared_cache_config"}:
                replacement = _shared_cache_config(original)
            else:
                replacement = _rewritten(original, names - {"shared_cache_config"},
                                         REGRESSIONS[next(iter(names))].qualname)
            setattr(owner, name, replacement)
            undo.append((owner, name, original))
        yield
    finally:
        for owner, name, original in reversed(undo):
            setattr(owner, name, original)


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


# --- process faults ----------------------------------------------------------------


def _open_piddir(piddir: str) -> int:
    """``$KVCONFORM_WORKER_PIDDIR`` opened as a directory, if only this user can plant files
    in it; ValueError (naming it) if not.  One descriptor: no path swap after the check."""
    fd = os.open(piddir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    st = os.fstat(fd)
    why = None
    if st.st_uid != os.geteuid():
        why = f"it belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    elif st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        why = "anyone may write to it (world-writable, no sticky bit)"
    if why is not None:
        os.close(fd)
        raise ValueError(f"${PIDDIR_ENV}={piddir}: refusing to write PID files there: {why}")
    return fd


def check_piddir() -> None:
    """At a run's start: ValueError (one line naming it) if the PID-file directory is set
    and unsafe or not a directory; nothing if it is unset."""
    piddir = os.environ.get(PIDDIR_ENV)
    if not piddir:
        return
    try:
        os.close(_open_piddir(piddir))
    except OSError as exc:
        raise ValueError(f"${PIDDIR_ENV}={piddir}: not a directory this run can use "
                         f"({exc.strerror})") from None


def mark_pid(suffix: str) -> bool:
    """Create ``$KVCONFORM_WORKER_PIDDIR/<pid>.<suffix>`` for a test to find this process.

    Never through a link and never over an existing file (``O_CREAT|O_EXCL|O_NOFOLLOW``,
    in the directory :func:`_open_piddir` checked): a symlink planted under the name
    cannot get its target written.  A refusal is one line on stderr (a worker's log) and
    the process carries on: the file only helps a test count processes, and refusing it
    must not change the result the process runs for.  False when nothing was written.
    """
    piddir = os.environ.get(PIDDIR_ENV)
    if not piddir:
        return False
    name = f"{os.getpid()}.{suffix}"
    try:
        directory = _open_piddir(piddir)
    except (OSError, ValueError) as exc:
        _refuse(name, str(exc))
        return False
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=directory)
    except FileExistsError:
        _refuse(name, f"{os.path.join(piddir, name)} already exists (a file or a symbolic "
                      "link put there before this process): left as it is")
        return False
    except OSError as exc:
        _refuse(name, f"{os.path.join(piddir, name)}: {exc.strerror}")
        return False
    finally:
        os.close(directory)
    os.close(fd)
    return True


def _refuse(name: str, why: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, f"kvconform: ${PIDDIR_ENV}: not writing {name}: {why}\n".encode())


def process_fault(fault: str | None) -> None:
    """The ``hang`` and ``die`` faults, in the process that is about to adopt (a deployment's
    engine process, or a rank receiving its configs); ``oom`` is at the allocation."""
    if "hang" in names(fault):
        mark_pid("hang")
        while True:
            time.sleep(3600)
    if "die" in names(fault):
        os.write(2, b"kvconform: seeded fault 'die': SIGKILL mid-command\n")
        os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def oversized_allocation(fault: str | None) -> Iterator[None]:
    """``oom``: the runner's ``init_kv_cache`` first asks the allocator for far too much."""
    if "oom" not in names(fault):
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


_SEEDED_HERE: list[str | None] = []  # what this process applies now (inherited by a fork)


@contextlib.contextmanager
def seeded(fault: str | None, control: str | None = None) -> Iterator[None]:
    """Everything a process hosting production applies: the run's seeded ``fault`` and a
    check's own negative ``control`` (a regression it applies on purpose).  The control
    is also exported (:data:`CONTROL_ENV`) to worker processes production spawns meanwhile,
    which apply both through :func:`inherited`."""
    previous = os.environ.get(CONTROL_ENV)
    with regression(control, *names(fault)), corruption(fault), \
            oversized_allocation(fault), corrected(fault):
        _SEEDED_HERE.append(control)
        if control:
            os.environ[CONTROL_ENV] = control
        try:
            yield
        finally:
            _SEEDED_HERE.pop()
            if previous is None:
                os.environ.pop(CONTROL_ENV, None)
            else:
                os.environ[CONTROL_ENV] = previous


def inherited() -> contextlib.AbstractContextManager[None]:
    """In a worker process production started: what its engine process applies, unless
    this process already has it (the engine's own, or a fork of it)."""
    if _SEEDED_HERE:
        return contextlib.nullcontext()
    return seeded(active(), os.environ.get(CONTROL_ENV) or None)


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
