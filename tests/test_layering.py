"""Imports flow downwards: every module sits in a declared layer and imports only its own
layer or those below, and no import cycle closes inside a layer.

The layers are the package's subpackages.  They are read from the modules' own
``import`` statements (``ast``), lazy imports inside functions and imports under
``if TYPE_CHECKING:`` included: a type is a dependency too.
"""

from __future__ import annotations

import ast
import re

import pytest

from tests.paths import ROOT

PACKAGE = ROOT / "pytest_kvconform"

# Bottom first: one subpackage per layer, the entry points on top.  A module may import
# modules of its own layer or of a layer below.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("contract", ("contract", "contract.*")),
    ("adapters", ("adapters", "adapters.*")),
    ("workers", ("workers", "workers.*")),
    ("checks", ("checks", "checks.*")),
    ("faults", ("faults", "faults.*")),
    ("report", ("report", "report.*")),
    ("session", ("session", "session.*")),
    ("crossversion", ("crossversion", "crossversion.*")),
    ("gpu", ("gpu", "gpu.*")),
    ("top", ("pytest_kvconform", "plugin", "hookspecs", "api", "cli", "selftest", "selftest.*",
             "suite", "suite.*")),
)


def layer_of(module: str) -> int:
    """The index of ``module``'s layer (``pytest_kvconform.`` stripped); KeyError if none."""
    for index, (_, members) in enumerate(LAYERS):
        for member in members:
            if member == module or (member.endswith("*") and module.startswith(member[:-1])
                                    and module != member[:-2]):
                return index
    raise KeyError(f"module {module} is in no layer of tests/test_layering.py: declare it")


def _short(name: str) -> str:
    return "pytest_kvconform" if name == "pytest_kvconform" else \
        name.removeprefix("pytest_kvconform.")


def imports_of(source: str, modules: set[str]) -> set[str]:
    """The package modules ``source`` imports at run time (short names)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(_short(a.name) for a in node.names
                         if a.name.split(".")[0] == "pytest_kvconform")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] == "pytest_kvconform":
            base = _short(node.module)
            for alias in node.names:  # ``from pytest_kvconform import compat`` names a module
                sub = alias.name if base == "pytest_kvconform" else f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def package_modules() -> dict[str, str]:
    """Short module name -> source, for every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[_short(".".join(parts))] = path.read_text()
    return out


def violations(sources: dict[str, str]) -> list[str]:
    """Every import that runs back up a layer, and every cycle inside one."""
    names = set(sources)
    graph = {m: imports_of(src, names) - {m} for m, src in sources.items()}
    problems = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]}), "
                "a layer above it"
                for m, deps in sorted(graph.items()) for d in sorted(deps)
                if layer_of(d) > layer_of(m)]
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def walk(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                problems.append("import cycle: " + " -> ".join([*path[path.index(d):], d]))
            elif d not in state:
                walk(d, [*path, d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m, [m])
    return problems


def test_every_module_has_a_layer() -> None:
    for module in package_modules():
        layer_of(module)


def test_no_import_runs_back_up() -> None:
    assert violations(package_modules()) == []


@pytest.mark.parametrize("seed", [
    "\n\ndef _late():\n    from pytest_kvconform.checks import layout\n",
    "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
    "    from pytest_kvconform.checks import layout\n",
], ids=["lazy", "type-checking"])
def test_seeded_upward_import_is_reported(seed: str) -> None:
    sources = package_modules()
    sources["adapters.compat"] += seed
    problems = violations(sources)
    assert problems[0] == ("adapters.compat (adapters) imports checks.layout (checks), "
                           "a layer above it")
    assert all("compat" in p for p in problems)  # and the cycle it closes, nothing else


def test_seeded_cycle_in_a_layer_is_reported() -> None:
    sources = package_modules()
    sources["adapters.compat"] += "\nfrom pytest_kvconform.adapters import control_plane\n"
    problems = violations(sources)  # control_plane reaches compat directly and via kv_planner
    assert problems and all(p.startswith("import cycle: ") and "compat" in p
                            and "control_plane" in p for p in problems), problems


def test_type_checking_imports_count() -> None:
    text = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n" \
           "    from pytest_kvconform.session.run import KvSession\n"
    assert imports_of(text, {"session", "session.run"}) == {"session.run"}


def test_undeclared_module_is_refused() -> None:
    with pytest.raises(KeyError, match="newthing"):
        layer_of("newthing")


# ------------------------------------------------------------------ no module-level current test

# A name rebound through ``global`` that says it tracks which test runs (or is planned, or
# was started on speculation): such state belongs to an object handed to its user.
_CURRENT_TEST_RE = re.compile(r"running|current|planning|speculative|reserv", re.I)


def current_test_globals(sources: dict[str, str]) -> list[str]:
    """``module: name`` for each module-level name a function rebinds with ``global`` whose
    name says it tracks the running test."""
    found = []
    for module, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Global):
                found += [f"{module}: {name}" for name in node.names
                          if _CURRENT_TEST_RE.search(name)]
    return sorted(set(found))


def test_no_module_keeps_a_mutable_current_test() -> None:
    assert current_test_globals(package_modules()) == []


def test_seeded_current_test_global_is_reported() -> None:
    seeded = "_running = None\n\ndef running(test):\n    global _running\n    _running = test\n"
    assert current_test_globals({"pytest_kvconform.workers.pool": seeded}) == [
        "pytest_kvconform.workers.pool: _running"]


# ------------------------------------------------------------------ the seeded-fault package


def imports_of_faults(sources: dict[str, str]) -> list[str]:
    """``module -> faults.x`` for each import of the seeded-fault package from workers/ or
    adapters/ (they offer ``adapters/fault_hook.py`` instead), lazy ones included."""
    names = set(sources)
    return sorted(f"{m} -> {d}" for m, src in sources.items()
                  if m.split(".")[0] in ("workers", "adapters")
                  for d in imports_of(src, names) if d.split(".")[0] == "faults")


def test_the_mechanism_layers_import_nothing_of_the_seeded_faults() -> None:
    assert imports_of_faults(package_modules()) == []


def test_seeded_fault_import_from_a_worker_is_reported() -> None:
    sources = package_modules()
    sources["workers.child"] += "\n\ndef _f():\n    from pytest_kvconform.faults import hook\n"
    assert imports_of_faults(sources) == ["workers.child -> faults.hook"]
