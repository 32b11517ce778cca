"""Production functions rewritten the way a regression would change them: the mechanism.

A :class:`Regression` names a production function and how its source changes (a
:class:`Rewrite` of its syntax tree, or a wrapper).  :func:`applied` swaps the rewritten
functions in for a block; several regressions of one function are applied to its source
together.  Which regressions exist belongs to their owners: a check's own negative control
(``checks/adoption_controls.py``) or the seeded faults (``faults/worker_faults.py``).  They
reach the processes that host production through ``fault_hook.py``.

Stdlib only.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import textwrap
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, cast


class Rewrite(ast.NodeTransformer):
    """One regression's change to a function's syntax tree; ``done`` once it changed it."""

    def __init__(self) -> None:
        self.done = False


class StatementRewrite(Rewrite):
    """A change to the function's statement lists, at any nesting depth (:meth:`body`)."""

    def body(self, stmts: list[ast.stmt]) -> list[ast.stmt]:
        return stmts

    def generic_visit(self, node: ast.AST) -> ast.AST:
        super().generic_visit(node)
        for name in ("body", "orelse", "finalbody"):
            stmts = getattr(node, name, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                setattr(node, name, self.body(stmts))
        return node


class DropStatements(StatementRewrite):
    """Drops every statement ``matches`` selects."""

    def __init__(self, matches: Callable[[ast.AST], bool]) -> None:
        super().__init__()
        self.matches = matches

    def body(self, stmts: list[ast.stmt]) -> list[ast.stmt]:
        kept = [stmt for stmt in stmts if not self.matches(stmt)]
        self.done |= len(kept) != len(stmts)
        return kept


def is_call_to(node: ast.AST, name: str) -> bool:
    """``name(...)`` as a statement, or assigned."""
    value = node.value if isinstance(node, ast.Expr | ast.Assign) else None
    return isinstance(value, ast.Call) and getattr(value.func, "id", None) == name


@dataclass(frozen=True)
class Regression:
    """A production function rewritten the way a regression would change it."""

    target: str  # "module:function" or "module:Class.method"
    what: str  # what the rewritten function does wrong, in words
    rewrite: Callable[[], Rewrite] | None = None  # a fresh transformer of its source
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None  # or a wrapper
    runs_with: str = ""  # a module the target needs to run at all (beyond its own)

    @property
    def qualname(self) -> str:
        return self.target.partition(":")[2]


class SeedError(RuntimeError):
    """The production source no longer has the statement a regression rewrites."""


def owner(target: str) -> tuple[Any, str]:
    """(the module or class holding the function, its attribute name)."""
    module, _, path = target.partition(":")
    holder: Any = importlib.import_module(module)
    *classes, name = path.split(".")
    for cls in classes:
        holder = getattr(holder, cls)
    return holder, name


def rewritten(original: Callable[..., Any], regressions: Iterable[Regression],
              where: str) -> Callable[..., Any]:
    """``original`` with the regressions' rewrites applied to its own source; same globals,
    same name.  :class:`SeedError` where one found nothing to rewrite."""
    tree: ast.Module = ast.parse(textwrap.dedent(inspect.getsource(original)))
    missing = []
    names = []
    for regression in regressions:
        assert regression.rewrite is not None
        rewrite = regression.rewrite()
        tree = cast(ast.Module, rewrite.visit(tree))
        names.append(regression.what)
        if not rewrite.done:
            missing.append(regression.what)
    if missing:
        raise SeedError(f"{where} no longer has the statement the regression rewrites; update "
                        f"its rewrite ({'; '.join(missing)})")
    tree = ast.fix_missing_locations(tree)
    namespace: dict[str, Any] = dict(original.__globals__)
    exec(compile(tree, f"<rewritten: {where}>", "exec"), namespace)
    built = namespace[original.__name__]
    code = built.__code__.replace(co_qualname=original.__code__.co_qualname)
    function = types.FunctionType(code, original.__globals__, original.__name__,
                                  original.__defaults__, original.__closure__)
    function.__kwdefaults__ = original.__kwdefaults__
    function.__qualname__ = original.__qualname__
    return function


def applicable(regression: Regression) -> str | None:
    """Why ``regression`` cannot be applied in this process (its target does not import)."""
    try:
        owner(regression.target)
        if regression.runs_with:
            importlib.import_module(regression.runs_with)
    except Exception as exc:  # the target's module does not import here
        return (f"{regression.qualname} does not run on this host ({type(exc).__name__}: "
                f"{exc})")
    return None


def unseedable(regression: Regression, label: str) -> str | None:
    """Why ``regression`` (``label`` names it) cannot be applied to the installed stack (its
    target does not import, or no longer has the statement it rewrites), or None: the
    rewrite is compiled here, as each worker would, and thrown away."""
    reason = applicable(regression)
    if reason is None and regression.rewrite is not None:
        holder, name = owner(regression.target)
        try:
            rewritten(vars(holder)[name], [regression], regression.qualname)
        except SeedError as exc:
            reason = f"{label}: {exc}"
    return reason


@contextlib.contextmanager
def applied(regressions: Iterable[Regression]) -> Iterator[None]:
    """For the duration: the production functions the regressions name, rewritten (those
    whose target does not import here are left as they are)."""
    by_target: dict[str, list[Regression]] = {}
    for regression in dict.fromkeys(regressions):  # a control and a fault may be the same
        if applicable(regression) is None:
            by_target.setdefault(regression.target, []).append(regression)
    undo: list[tuple[Any, str, Any]] = []
    try:
        for target, group in by_target.items():
            holder, name = owner(target)
            original = vars(holder)[name]
            replacement = original
            rewrites = [r for r in group if r.rewrite is not None]
            if rewrites:
                replacement = rewritten(original, rewrites, group[0].qualname)
            for regression in group:
                if regression.wrap is not None:
                    replacement = regression.wrap(replacement)
            setattr(holder, name, replacement)
            undo.append((holder, name, original))
        yield
    finally:
        for holder, name, original in reversed(undo):
            setattr(holder, name, original)
