"""The judge's integrity: the suite's own code is what it shipped when it judges.

Backends are imported into the process that judges them, and a backend's module runs
whatever it likes at import (and its methods when the checks call them): it could replace
the check runner, a check, the oracle or the verdict, and earn a verdict nothing checked.
So before any backend is imported (:func:`take`, at session start before discovery; at
the start of ``check_backend``), every module of the package is imported and
fingerprinted: each module's ``sys.modules`` entry, each function and class it defines
(the objects themselves, a function's code, a class's own functions); after discovery and
again before the verdict, :func:`Fingerprint.changes` names whatever differs.  A run with a
change qualifies nothing, and says what changed.

Outside the fingerprint: the modules a run imports as backends or stand-ins of them
(``adapters/paged_standins.py``), the weightless model config (``adapters/upstream_model``)
and the suite's test modules (pytest imports those at collection; what they call, the
check runner and the checks, is fingerprinted).  Module-level values other than functions
and classes (a constant, a cache) are not.  Stdlib only: ``check_backend`` uses it too.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from dataclasses import dataclass, field
from types import FunctionType, MethodType, ModuleType
from typing import Any

PACKAGE = "pytest_kvconform"
# Not the judge: a backend source, a model config, and the test modules pytest collects.
_OUTSIDE = ("pytest_kvconform.adapters.paged_standins", "pytest_kvconform.adapters.upstream_model",
            "pytest_kvconform.suite.test_")
# What a run judges with, imported before any backend: the layers and the top modules a
# run uses; check_backend's, which import no pytest.  Other commands' modules (gpu-check,
# selftest, matrix, the CLI) are fingerprinted where they are loaded, not imported here.
WITHOUT_PYTEST = ("contract", "adapters", "workers", "checks", "faults", "report", "api")
RUN = (*WITHOUT_PYTEST, "session", "suite", "plugin", "hookspecs")
# The fork server's first and last imports, and the KV connector vLLM's connector factory
# loads by name (it imports vLLM's distributed stack at import): fingerprinted when
# imported, never imported here.
_NOT_IMPORTED = ("pytest_kvconform.workers.forkserver_guard",
                 "pytest_kvconform.workers.forkserver_ready",
                 "pytest_kvconform.adapters.vllm_connector")


def _judged(name: str) -> bool:
    return (name == PACKAGE or name.startswith(PACKAGE + ".")) and not name.startswith(_OUTSIDE)


def _code(value: Any) -> Any:
    """A function's code (through a classmethod, staticmethod, property or cache)."""
    for attr in ("__func__", "fget", "__wrapped__"):
        inner = getattr(value, attr, None)
        if inner is not None:
            value = inner
    return value.__code__ if isinstance(value, (FunctionType, MethodType)) else None


def _ours(value: Any) -> bool:
    """A function, class or callable the package defines (not one it imported)."""
    module = getattr(value, "__module__", None)
    return callable(value) and isinstance(module, str) and _judged(module)


def _describe(value: Any) -> str:
    if value is _MISSING:
        return "removed"
    module = getattr(value, "__module__", None) or type(value).__module__
    name = getattr(value, "__qualname__", None) or type(value).__qualname__
    return f"replaced by {module}.{name}"


_MISSING = object()


@dataclass
class Fingerprint:
    """The package as it was when taken: modules, their functions and classes, and those
    classes' own members, each kept with its code."""

    modules: dict[str, ModuleType] = field(default_factory=dict)
    objects: dict[tuple[str, str], tuple[Any, Any]] = field(default_factory=dict)
    members: dict[tuple[str, str, str], tuple[Any, Any]] = field(default_factory=dict)

    def changes(self) -> list[str]:
        """What differs from the fingerprint, one phrase each, sorted (empty: nothing): the
        same changes read the same whichever module was imported first."""
        found = []
        for name, module in self.modules.items():
            entry = sys.modules.get(name)
            if entry is not module:
                found.append(f"module {name} " + ("removed from sys.modules" if entry is None
                                                  else "replaced in sys.modules"))
        for (module_name, attr), (value, code) in self.objects.items():
            now: Any = getattr(self.modules[module_name], attr, _MISSING)
            where = f"{module_name}.{attr}"
            if now is not value:
                found.append(f"{where} {_describe(now)}")
            elif code is not None and _code(now) is not code:
                found.append(f"{where} has other code ({_code(now)!r})")
        for (module_name, cls_name, attr), (value, code) in self.members.items():
            cls = self.objects[(module_name, cls_name)][0]
            now = vars(cls).get(attr, _MISSING)
            where = f"{module_name}.{cls_name}.{attr}"
            if now is not value:
                found.append(f"{where} {_describe(now)}")
            elif code is not None and _code(now) is not code:
                found.append(f"{where} has other code")
        return sorted(found)


def import_judge(parts: tuple[str, ...] = RUN) -> None:
    """Import every module of the package that judges (``parts``: its subpackages and top
    modules; see the module docstring), so that none is imported first by a backend."""
    package = importlib.import_module(PACKAGE)
    for info in pkgutil.iter_modules(package.__path__, PACKAGE + "."):
        if info.name.removeprefix(PACKAGE + ".") in parts:
            _import_tree(info.name, info.ispkg)


def _import_tree(name: str, is_package: bool) -> None:
    if not _judged(name) or name.startswith(_NOT_IMPORTED):
        return
    module = importlib.import_module(name)
    if is_package:
        for info in pkgutil.iter_modules(module.__path__, name + "."):
            _import_tree(info.name, info.ispkg)


def take(parts: tuple[str, ...] = RUN) -> Fingerprint:
    """The package's fingerprint now (the modules of ``parts`` imported first)."""
    import_judge(parts)
    found = Fingerprint()
    for name, module in list(sys.modules.items()):
        if not _judged(name) or not isinstance(module, ModuleType):
            continue
        found.modules[name] = module
        for attr, value in list(vars(module).items()):
            if not _ours(value):
                continue
            found.objects[(name, attr)] = (value, _code(value))
            if isinstance(value, type) and value.__module__ == name and value.__name__ == attr:
                for member, inner in list(vars(value).items()):
                    if _code(inner) is not None:
                        found.members[(name, attr, member)] = (inner, _code(inner))
    return found

