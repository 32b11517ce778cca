"""Which attention backends exist, and why one is unusable.

Sources, in order: vllm-omni's ``DiffusionAttentionBackendEnum`` (each member
resolved through ``get_class()`` so ``register_diffusion_backend`` overrides
count), the current Omni platform's default choice, vLLM's own attention registries
(``adapters/vllm_registry.py``: family ``vllm``), the
``pytest_kvconform_backends`` hook and the ``pytest_kvconform.backends``
entry-point group.  A backend that fails to import is still returned, with the
error, so its tests report it instead of vanishing.  The result is sorted by
name: every xdist worker must collect the same tests.

Importing a backend runs its code in this process.  With a ``guard`` (the session's and
``check_backend``'s: ``workers/isolated.probe``), each import that would run backend code
not yet run here (a module outside the serving stack's own packages not imported yet, an
entry point, a callable entry point's call) is first made in a child process the guard can
give up on: one that hangs (a loop holding the GIL included) or ends its process makes the
backend unimportable, with that reason, and this process never runs it.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Protocol

from pytest_kvconform.adapters import compat, vllm_registry
from pytest_kvconform.adapters.backend_names import ENTRY_POINT_GROUP
from pytest_kvconform.adapters.omni_plugins import registry_snapshot
from pytest_kvconform.contract.outcomes import describe_error
from pytest_kvconform.contract.records import BackendUnderTest

OMNI_MISSING = "vllm-omni not installed"
# Runs ``fn`` (named ``what``) where the caller can give up on it: None when it returned or
# raised (this process may do it too), else why not (it hung, or it ended its process).
Guard = Callable[[str, Callable[[], object]], "str | None"]


def unguarded(what: str, fn: Callable[[], object]) -> str | None:
    """No guard: every import is made here, as it comes."""
    return None


def _module_of(spec: str) -> str:
    return spec.partition(":")[0] if ":" in spec else spec.rpartition(".")[0]


# The serving stack's own packages: discovery imports them here by design (the registry,
# the platform), so an in-tree backend's module is the stack's code, not a backend
# repository's; only code from elsewhere goes through the guard.
STACK_PACKAGES = ("vllm", "vllm_omni", "torch")


def guard_import(guard: Guard, spec: str, name: str) -> str | None:
    """The guard's reason against importing ``spec`` here; None when its module is
    imported already (no code of it left to run), is the stack's own
    (:data:`STACK_PACKAGES`), or imported fine in the guard's child."""
    module = _module_of(spec)
    if not module or module in sys.modules or module.partition(".")[0] in STACK_PACKAGES:
        return None
    return guard(f"importing {module} (backend {name})",
                 lambda: importlib.import_module(module))


class Origins(Protocol):
    """Who re-pointed a registry member (``omni_plugins.PluginLoad``)."""

    def origin_of(self, member: str, overridden: bool) -> str: ...


class DiscoveryError(ValueError):
    """Backends cannot be listed consistently (a name defined twice, a bad hook result)."""


@dataclass
class Discovery:
    """The backends found, plus notes on sources that contributed nothing."""

    backends: list[BackendUnderTest] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Backends the registry or the platform holds that a run naming others (``only``)
    # left out, by name: not imported (importing a backend can cost seconds).
    left_out: list[str] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [b.name for b in self.backends]

    def by_name(self, name: str) -> BackendUnderTest:
        for backend in self.backends:
            if backend.name == name:
                return backend
        raise KeyError(name)


def import_object(spec: str) -> Any:
    """Resolve ``module:qualname`` or ``module.qualname``."""
    if ":" in spec:
        module_name, _, qualname = spec.partition(":")
    else:
        module_name, _, qualname = spec.rpartition(".")
    if not module_name or not qualname:
        raise ImportError(f"not an import path: {spec!r} (use 'package.module:Class')")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _path_of(cls: Any) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def registry_backends(names: Collection[str] | None = None, guard: Guard = unguarded
                      ) -> tuple[list[BackendUnderTest], str | None]:
    """Every ``DiffusionAttentionBackendEnum`` member (those ``names`` names, when given:
    the others are not imported), importable or not; each import through ``guard``."""
    if not compat.omni_installed():
        return [], OMNI_MISSING
    try:
        from vllm_omni.diffusion.attention.backends.registry import (
            DiffusionAttentionBackendEnum,
        )
    except Exception as exc:  # a broken vllm-omni install is reported, not fatal
        return [], f"vllm-omni registry not importable: {describe_error(exc)}"
    found = []
    for member in DiffusionAttentionBackendEnum:
        if names is not None and member.name not in names:
            continue
        try:
            overridden = bool(member.is_overridden())
            path = member.get_path()
        except Exception as exc:
            found.append(BackendUnderTest(member.name, "", "registry", overridden,
                                          error=describe_error(exc)))
            continue
        refused = guard_import(guard, str(path), member.name)
        if refused is not None:
            found.append(BackendUnderTest(member.name, path, "registry", overridden,
                                          error=refused))
            continue
        try:
            cls = member.get_class()
        except Exception as exc:
            found.append(BackendUnderTest(member.name, path, "registry", overridden,
                                          error=describe_error(exc)))
            continue
        found.append(BackendUnderTest(member.name, path, "registry", overridden, cls=cls))
    return found, None


def in_tree_name(member: str) -> str | None:
    """The name a registry member's in-tree class answers to (its ``get_name()``), read
    from the class the enum names by default, overrides aside: production's own name for
    the member (``TORCH_SDPA``'s is ``SDPA``).  None where vllm-omni has no such member, or
    its in-tree class does not import here or names itself no string."""
    if not compat.omni_installed():
        return None
    try:
        from vllm_omni.diffusion.attention.backends.registry import (
            DiffusionAttentionBackendEnum,
        )

        name = import_object(str(DiffusionAttentionBackendEnum[member].value)).get_name()
    except Exception:  # no such member, or its in-tree class does not import here
        return None
    return name if isinstance(name, str) else None


def _left_out(name: str, only: Collection[str] | None) -> bool:
    """Whether a run naming ``only`` leaves this backend out (and does not import it)."""
    return only is not None and name not in only


def platform_backend(known_paths: set[str], head_size: int = 64,
                     only: Collection[str] | None = None, guard: Guard = unguarded) -> tuple[
        BackendUnderTest | None, str | None]:
    """The current Omni platform's default backend, when it is not a registry member.

    With ``only``, a backend of another name is not imported: it comes back without a
    class or an error, for :func:`discover` to list as left out."""
    try:
        from vllm_omni.platforms import current_omni_platform

        path = current_omni_platform.get_diffusion_attn_backend_cls(None, head_size)
    except NotImplementedError:
        return None, "the current Omni platform selects no default diffusion backend"
    except Exception as exc:
        return None, f"platform default backend unavailable: {describe_error(exc)}"
    if not isinstance(path, str) or path in known_paths:
        return None, None
    name = path.rsplit(".", 1)[-1]
    origin = f"the Omni platform {_path_of(type(current_omni_platform))}"
    if _left_out(name, only):
        return BackendUnderTest(name, path, "platform", origin=origin), None
    refused = guard_import(guard, path, name)
    if refused is not None:
        return BackendUnderTest(name, path, "platform", error=refused, origin=origin), None
    try:
        return BackendUnderTest(name, path, "platform", cls=import_object(path),
                                origin=origin), None
    except Exception as exc:
        return BackendUnderTest(name, path, "platform", error=describe_error(exc),
                                origin=origin), None


def _from_mapping(mapping: Mapping[str, Any], source: str,
                  guard: Guard = unguarded) -> list[BackendUnderTest]:
    if not isinstance(mapping, Mapping):
        raise DiscoveryError(f"{source} returned {type(mapping).__name__}, expected a mapping "
                             "of name -> backend class or 'module:Class'")
    found = []
    for name, target in mapping.items():
        if not isinstance(name, str) or not name or not name.replace("_", "").isalnum():
            raise DiscoveryError(f"{source} gave backend name {name!r}; use letters, digits, '_'")
        if isinstance(target, str):
            refused = guard_import(guard, target, name)
            if refused is not None:
                found.append(BackendUnderTest(name, target, source, error=refused))
                continue
            try:
                found.append(BackendUnderTest(name, target, source, cls=import_object(target)))
            except Exception as exc:
                found.append(BackendUnderTest(name, target, source, error=describe_error(exc)))
        elif isinstance(target, type):
            found.append(BackendUnderTest(name, _path_of(target), source, cls=target))
        else:
            raise DiscoveryError(f"{source} gave {name!r} -> {target!r}; expected a class or "
                                 "an import string")
    return found


def entry_point_backends(guard: Guard = unguarded) -> list[BackendUnderTest]:
    """Backends from the ``pytest_kvconform.backends`` entry-point group."""
    found: list[BackendUnderTest] = []
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        source = f"entry-point {ep.name} ({ep.value})"
        refused = None if ep.module in sys.modules or \
            ep.module.partition(".")[0] in STACK_PACKAGES else \
            guard(f"loading the entry point {ep.name} ({ep.value})", ep.load)
        if refused is not None:
            found.append(BackendUnderTest(ep.name, ep.value, "entry-point", error=refused))
            continue
        try:
            obj = ep.load()
        except Exception as exc:
            found.append(BackendUnderTest(ep.name, ep.value, "entry-point",
                                          error=describe_error(exc)))
            continue
        if isinstance(obj, type):
            found.append(BackendUnderTest(ep.name, _path_of(obj), "entry-point", cls=obj))
        elif callable(obj):
            refused = guard(f"calling the entry point {ep.name} ({ep.value})", obj)
            if refused is not None:
                found.append(BackendUnderTest(ep.name, ep.value, "entry-point", error=refused))
                continue
            try:
                mapping = obj()
            except Exception as exc:
                found.append(BackendUnderTest(ep.name, ep.value, "entry-point",
                                              error=f"calling it raised {describe_error(exc)}"))
                continue
            found.extend(_from_mapping(mapping, "entry-point", guard))
        else:
            raise DiscoveryError(f"{source} loads {obj!r}; expected a class or a callable "
                                 "returning a mapping")
    return found


def _add_vllm_backends(result: Discovery, origins: Origins | None,
                       only: Collection[str] | None, guard: Guard) -> None:
    """vLLM's own attention registries' members (family ``vllm``), after the plugins."""
    found, left_out, note = vllm_registry.registry_backends(
        only, lambda path, name: guard_import(guard, path, name))
    if origins is not None:
        found = [dataclasses.replace(b, origin=origins.origin_of(b.name, b.overridden))
                 for b in found]
    result.backends.extend(found)
    result.left_out.extend(left_out)
    if note:
        result.notes.append(note)


def _with_family(backend: BackendUnderTest) -> BackendUnderTest:
    """A repository's backend (hook, entry point) as family ``vllm`` when its class is a
    vLLM ``AttentionBackend`` subclass (not a diffusion one)."""
    if backend.cls is not None and vllm_registry.is_attention_backend(backend.cls):
        return dataclasses.replace(backend, family=vllm_registry.FAMILY)
    return backend


Registry = Callable[[Collection[str] | None], tuple[list[BackendUnderTest], str | None]]


def discover(hook_results: Iterable[Mapping[str, Any] | None] = (),
             *, include_registry: bool = True,
             include_entry_points: bool = True,
             registry: Registry | None = None,
             origins: Origins | None = None,
             only: Collection[str] | None = None,
             guard: Guard = unguarded,
             ) -> Discovery:
    """All backends, sorted by name; a name defined by two sources is an error.

    Load the plugins first (``omni_plugins.load_plugins``), as production does
    before it resolves a backend, and pass the result as ``origins``: each
    registry member then says who put its class there.  With ``only`` (a
    ``--kv-backend`` run), the registry's and the platform's other backends are
    listed in ``left_out`` by name, not imported; hook and entry-point backends
    are all loaded (a callable entry point names its backends only when called).  Each
    import goes through ``guard`` (the module docstring).
    """
    result = Discovery()
    if include_registry:
        found, reason = (registry(only) if registry is not None
                         else registry_backends(only, guard))
        if origins is not None:
            found = [dataclasses.replace(b, origin=origins.origin_of(b.name, b.overridden))
                     for b in found]
        result.backends.extend(found)
        if reason:
            result.notes.append(reason)
        else:
            # Every member's path (the named ones' imported, the others' only read), so the
            # platform's default is recognised as a member whether or not it was named.
            paths = {**(registry_snapshot() if only is not None else {}),
                     **{b.name: b.path for b in found}}
            result.left_out.extend(name for name in paths if _left_out(name, only))
            extra, note = platform_backend(set(paths.values()), only=only, guard=guard)
            if extra is not None and _left_out(extra.name, only):
                result.left_out.append(extra.name)
            elif extra is not None:
                result.backends.append(extra)
            if note:
                result.notes.append(note)
    if include_registry and registry is None:
        _add_vllm_backends(result, origins, only, guard)
    repository: list[BackendUnderTest] = []
    for mapping in hook_results:
        if mapping:
            repository.extend(_from_mapping(mapping, "hook", guard))
    if include_entry_points:
        repository.extend(entry_point_backends(guard))
    result.backends.extend(_with_family(b) for b in repository)
    result.left_out = sorted(set(result.left_out))
    seen: dict[str, BackendUnderTest] = {}
    for backend in result.backends:
        if backend.name in result.left_out:
            raise DiscoveryError(f"backend name {backend.name!r} is defined twice: by the "
                                 f"registry or the platform and by {backend.source} "
                                 f"({backend.path})")
        if backend.name in seen:
            raise DiscoveryError(f"backend name {backend.name!r} is defined twice: by "
                                 f"{seen[backend.name].source} ({seen[backend.name].path}) and "
                                 f"by {backend.source} ({backend.path})")
        seen[backend.name] = backend
    result.backends.sort(key=lambda b: b.name)
    return result
