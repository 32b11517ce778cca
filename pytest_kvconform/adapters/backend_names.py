"""Which backend names exist, known without importing vLLM or vllm-omni.

``--kv-backend NAME`` is checked against these at start-up, so a name no source has is
refused in a second instead of after the stack's import.  Each source reads what is
installed without running it: vllm-omni's registry enum from its source file
(``ast``), the ``pytest_kvconform.backends`` entry points from their metadata (and, to
tell a class from a callable that names its backends when called, the target's source),
the Omni platforms' sources for a default backend outside the registry.  A source that
cannot be sure names the reason (:attr:`KnownNames.undecided`): a name no source has is
then left to discovery, which imports the stack and knows.

Stdlib only: nothing here imports vLLM, vllm-omni or a backend's module.
"""

from __future__ import annotations

import ast
import importlib.machinery
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from importlib.metadata import Distribution, EntryPoint, PackageNotFoundError, distribution
from importlib.metadata import entry_points as installed_entry_points
from pathlib import Path

ENTRY_POINT_GROUP = "pytest_kvconform.backends"
OMNI_DIST = "vllm-omni"
OMNI_REGISTRY = "vllm_omni.diffusion.attention.backends.registry"
OMNI_ENUM = "DiffusionAttentionBackendEnum"
OMNI_PLATFORMS = "vllm_omni/platforms/"
PLATFORM_GROUPS = ("vllm.platform_plugins", "vllm_omni.platform_plugins")
OWN_DIST = "pytest-kvconform"
# A dotted path to a backend class, as a platform returns its default: ``pkg.mod.XBackend``.
_BACKEND_PATH = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+\.(?P<cls>[A-Z]\w*Backend)$")


@dataclass
class KnownNames:
    """The backend names sources know before the stack is imported, and why a name
    outside them may still exist (``undecided``: empty when the names are all there are)."""

    names: set[str] = field(default_factory=set)
    undecided: list[str] = field(default_factory=list)

    def add(self, other: KnownNames) -> None:
        self.names |= other.names
        self.undecided += other.undecided


# --- where an installed module's source is, without importing it ----------------------------


def module_source(module: str, dist: Distribution | None = None) -> Path | None:
    """The file that ``import module`` would run, found without running it (nor its
    parent packages): the distribution's recorded files first, then the import system's
    finders, parent by parent; None where no finder has it."""
    loaded = sys.modules.get(module)
    if loaded is not None:
        found = getattr(loaded, "__file__", None)
        return Path(found) if found else None
    rel = module.replace(".", "/")
    if dist is not None:
        for file in dist.files or []:
            if str(file) in (f"{rel}.py", f"{rel}/__init__.py"):
                return Path(str(dist.locate_file(file)))
    path: list[str] | None = None
    parts = module.split(".")
    for i in range(len(parts)):
        name = ".".join(parts[: i + 1])
        parent = sys.modules.get(name)
        if parent is not None and i < len(parts) - 1:
            path = list(getattr(parent, "__path__", None) or [])
            continue
        spec = _find_spec(name, path)
        if spec is None:
            return None
        if i < len(parts) - 1:
            path = list(spec.submodule_search_locations or [])
            continue
        return Path(spec.origin) if spec.origin and spec.has_location else None
    return None


def _find_spec(name: str, path: list[str] | None) -> importlib.machinery.ModuleSpec | None:
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(name, path)
        except Exception:  # a finder that cannot answer is asked no further
            continue
        if spec is not None:
            return spec
    return None


def _parse(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None


def _top_level(body: Iterable[ast.stmt]) -> Iterator[ast.stmt]:
    """A module's statements, with those inside its top-level ``if`` / ``try`` blocks."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _top_level([*node.body, *node.orelse])
        elif isinstance(node, ast.Try):
            yield from _top_level([*node.body, *node.orelse, *node.finalbody,
                                   *(s for h in node.handlers for s in h.body)])


# --- the sources ---------------------------------------------------------------------------


def registry_members() -> KnownNames:
    """vllm-omni's registry enum members, read from its installed source (none when
    vllm-omni is not installed: discovery then finds no registry either)."""
    try:
        dist = distribution(OMNI_DIST)
    except PackageNotFoundError:
        return KnownNames()
    where = module_source(OMNI_REGISTRY, dist)
    tree = _parse(where) if where is not None else None
    for node in _top_level(tree.body if tree is not None else ()):
        if isinstance(node, ast.ClassDef) and node.name == OMNI_ENUM:
            names = {target.id for stmt in node.body if isinstance(stmt, ast.Assign)
                     for target in stmt.targets
                     if isinstance(target, ast.Name) and not target.id.startswith("_")}
            return KnownNames(names)
    return KnownNames(undecided=[f"vllm-omni's registry ({OMNI_ENUM}) is not where this "
                                 f"kvconform reads it ({OMNI_REGISTRY})"])


VLLM_DIST = "vllm"
VLLM_REGISTRY = "vllm.v1.attention.backends.registry"
# vLLM's registries and the prefix discovery names their members with
# (``adapters/vllm_registry.REGISTRIES``, kept stdlib-only here).
VLLM_ENUMS = {"AttentionBackendEnum": "vllm.", "MambaAttentionBackendEnum": "vllm.mamba."}


def vllm_registry_members() -> KnownNames:
    """vLLM's own attention registries' members (``vllm.<MEMBER>``,
    ``vllm.mamba.<MEMBER>``), read from its installed source."""
    try:
        dist = distribution(VLLM_DIST)
    except PackageNotFoundError:
        return KnownNames()
    where = module_source(VLLM_REGISTRY, dist)
    tree = _parse(where) if where is not None else None
    found = KnownNames()
    for node in _top_level(tree.body if tree is not None else ()):
        if isinstance(node, ast.ClassDef) and node.name in VLLM_ENUMS:
            found.names |= {VLLM_ENUMS[node.name] + target.id for stmt in node.body
                            if isinstance(stmt, ast.Assign) for target in stmt.targets
                            if isinstance(target, ast.Name) and not target.id.startswith("_")}
    if not found.names:
        found.undecided.append(f"vLLM's attention registry is not where this kvconform reads "
                               f"it ({VLLM_REGISTRY})")
    return found


def entry_point_names() -> KnownNames:
    """Each ``pytest_kvconform.backends`` entry point's name; one whose target may be a
    callable (which names its backends only when called) leaves the names undecided."""
    found = KnownNames()
    for ep in installed_entry_points(group=ENTRY_POINT_GROUP):
        found.names.add(ep.name)
        if not _names_a_class(ep):
            found.undecided.append(f"entry point {ep.name} ({ep.value}) may be a callable that "
                                   "names its backends when called")
    return found


def _names_a_class(ep: EntryPoint) -> bool:
    """Whether the entry point's target is a class (its backend is named after the entry
    point), read from the target module's source; a module that cannot be found is one
    that will not import, and discovery names that backend after the entry point too."""
    module, _, attr = ep.value.partition(":")
    attr = attr.strip()
    if not attr or "." in attr:
        return False
    where = module_source(module.strip(), ep.dist)
    if where is None:
        return True
    tree = _parse(where)
    if tree is None:
        return False
    for node in _top_level(tree.body):
        if isinstance(node, ast.ClassDef) and node.name == attr:
            return True
    return False


def platform_defaults() -> KnownNames:
    """A platform's default backend outside the registry, which discovery names after its
    class: the class of each dotted path to a backend class vllm-omni's platforms hold in
    their source (they name registry members in 0.30);
    a platform plugin of another distribution may choose one of its own (undecided)."""
    found = KnownNames()
    for group in PLATFORM_GROUPS:
        for ep in installed_entry_points(group=group):
            owner = ep.dist.metadata["Name"] if ep.dist is not None else None
            if owner != OWN_DIST:
                found.undecided.append(f"platform plugin {ep.name} ({owner or ep.value}) may "
                                       "choose a default backend of its own")
    try:
        omni = distribution(OMNI_DIST)
    except PackageNotFoundError:
        return found
    for file in omni.files or []:
        if str(file).startswith(OMNI_PLATFORMS) and str(file).endswith(".py"):
            tree = _parse(Path(str(omni.locate_file(file))))
            for node in ast.walk(tree) if tree is not None else ():
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    m = _BACKEND_PATH.match(node.value)
                    if m is not None:
                        found.names.add(m["cls"])
    return found


# Every source of backend names, in discovery's order.  A family of backends joins by adding
# its function here.
SOURCES: tuple[Callable[[], KnownNames], ...] = (
    registry_members, platform_defaults, vllm_registry_members, entry_point_names,
)


def static_names() -> KnownNames:
    """What every source knows before the stack is imported."""
    found = KnownNames()
    for source in SOURCES:
        found.add(source())
    return found
