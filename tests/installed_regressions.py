"""Regressions seeded in the installed vLLM / vllm-omni, as every process that imports it sees it.

A release run under ``--kv-strict`` refuses ``$KVCONFORM_WORKER_FAULT`` (a seeded fault
speaks for the fault, not the backend), so a test asking what the release verdict says
about a regression cannot seed it that way.  It seeds it where a real regression would
be: in the installed source.  :func:`overlay` writes a ``sitecustomize.py`` that, in
every Python process started with the overlay on ``PYTHONPATH`` (the pytest run, its
KV-A workers' fork server and the workers it forks, the ranks production's executor
spawns), compiles the target module from its installed source with one statement of one
function rewritten, as ``faults/worker_faults.py`` rewrites production's callers.  Nothing of
the package knows about it; the installed files are not touched.

A rewrite that finds nothing to rewrite raises at import (the run fails loudly rather
than passing for want of a fault).  Stdlib only: ``sitecustomize`` imports this module
before anything else.
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_LAYOUT = "vllm_omni.diffusion.diffusion_kv.layout"


@dataclass(frozen=True)
class Regression:
    """One statement of one installed function, rewritten."""

    module: str
    function: str
    what: str  # in words, for messages
    rewrite: Callable[[ast.FunctionDef], int]  # rewrites in place; how many nodes it changed


def _drop_raise(marker: str) -> Callable[[ast.FunctionDef], int]:
    """The ``raise`` whose source contains ``marker`` becomes ``pass``: the check removed."""

    def rewrite(function: ast.FunctionDef) -> int:
        done = 0
        for node in ast.walk(function):
            for field in ("body", "orelse"):
                stmts = getattr(node, field, None)
                if not isinstance(stmts, list):
                    continue
                for i, stmt in enumerate(stmts):
                    if isinstance(stmt, ast.Raise) and marker in ast.unparse(stmt):
                        stmts[i] = ast.copy_location(ast.Pass(), stmt)
                        done += 1
        return done

    return rewrite


def _default_when_unresolved(function: ast.FunctionDef) -> int:
    """``X.get_resolved_kv_cache_layout()`` -> LBNHC while ``X`` holds no layout, instead of
    vLLM's unresolved-layout error."""

    class Fallback(ast.NodeTransformer):
        done = 0

        def visit_Call(self, node: ast.Call) -> Any:
            self.generic_visit(node)
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "get_resolved_kv_cache_layout":
                owner = ast.unparse(func.value)
                self.done += 1
                return ast.parse(
                    f"({owner}.get_resolved_kv_cache_layout() if {owner}.kv_cache_layout is not "
                    "None else __import__('vllm.v1.kv_cache_layout', fromlist=['x'])"
                    ".KVCacheLayout.LBNHC)", mode="eval").body
            return node

    fallback = Fallback()
    fallback.visit(function)
    return fallback.done


REGRESSIONS: dict[str, Regression] = {
    "no_disagreement_check": Regression(
        _LAYOUT, "adopt_kv_cache_layout",
        "adopt_kv_cache_layout no longer refuses a worker already pinned to another layout",
        _drop_raise("disagrees with the layout resolved by the control plane")),
    "no_unresolved_check": Regression(
        "vllm.v1.worker.gpu.attn_utils", "init_kv_cache",
        "the worker's init_kv_cache allocates LBNHC when no layout was adopted, instead of "
        "raising the unresolved-layout error", _default_when_unresolved),
    "no_contradiction_check": Regression(
        _LAYOUT, "resolve_diffusion_kv_cache_layout",
        "resolve_diffusion_kv_cache_layout no longer refuses a pinned layout that contradicts "
        "the backend", _drop_raise("contradicts the attention backend/connector requirement")),
}


class _Loader(importlib.machinery.SourceFileLoader):
    """Compiles the module from its source with the regression applied (no bytecode cache)."""

    regression: Regression

    def get_code(self, fullname: str) -> Any:
        tree = ast.parse(self.get_data(self.path), self.path)
        regression = self.regression
        targets = [n for n in tree.body
                   if isinstance(n, ast.FunctionDef) and n.name == regression.function]
        if len(targets) != 1 or not regression.rewrite(targets[0]):
            raise ImportError(f"seeded regression: {regression.module}.{regression.function} "
                              "no longer has the statement it rewrites; update "
                              "tests/installed_regressions.py")
        return compile(ast.fix_missing_locations(tree), self.path, "exec", dont_inherit=True)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, regression: Regression) -> None:
        self.regression = regression

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if fullname != self.regression.module:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return spec
        loader = _Loader(fullname, spec.loader.path)
        loader.regression = self.regression
        spec.loader = loader
        return spec


def install(name: str) -> None:
    """In this process, from now on: the regression's module imports rewritten."""
    regression = REGRESSIONS[name]
    if regression.module in sys.modules:
        raise RuntimeError(f"{regression.module} was imported before the regression")
    sys.meta_path.insert(0, _Finder(regression))


def overlay(directory: Path, name: str) -> str:
    """Write the overlay for regression ``name`` into ``directory``; the ``PYTHONPATH`` that
    seeds it in every process started with it (the repository stays importable)."""
    REGRESSIONS[name]  # a typo is a KeyError here, not a run without the fault
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(
        "from tests.installed_regressions import install\n\n"
        f"install({name!r})\n", encoding="utf-8")
    return f"{directory}:{ROOT}"
