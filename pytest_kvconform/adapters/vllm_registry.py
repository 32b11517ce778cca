"""vLLM's own attention backends, as production resolves them (family ``vllm``).

vLLM selects an attention backend by a member of ``AttentionBackendEnum`` (and a Mamba
layer's by ``MambaAttentionBackendEnum``), each member resolved through ``get_class()``:
its ``register_backend`` override first (a ``vllm.general_plugins`` plugin's, loaded
before discovery as production loads them; a ``CUSTOM`` registration included), else its
in-tree path.  Every member is returned, importable or not, with why not:

- ``unregistered``: a placeholder member (``CUSTOM``, ``TORCH_SDPA``) nothing registered;
- ``missing-module``: the path names a module the installed vLLM does not have (a finding
  about the stack, reported by KV-V1's module control, never a skip of the backend);
- ``hardware``: an in-tree module that exists but does not import on a host without CUDA
  (a driver, a compiled extension);
- ``None`` otherwise (a plain import error: the backend's).

Names are ``vllm.<MEMBER>`` (``vllm.mamba.<MEMBER>`` for the Mamba registry), apart from
vllm-omni's diffusion registry, which has members of the same names.  Stdlib only at
import: vLLM is imported inside the functions.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Collection, Iterator
from typing import Any

from pytest_kvconform.contract.outcomes import describe_error
from pytest_kvconform.contract.records import BackendUnderTest

FAMILY = "vllm"
REGISTRY_MODULE = "vllm.v1.attention.backends.registry"
# (enum name, discovery source, name prefix): the registries, in discovery's order.
REGISTRIES: tuple[tuple[str, str, str], ...] = (
    ("AttentionBackendEnum", "vllm-registry", "vllm."),
    ("MambaAttentionBackendEnum", "vllm-mamba-registry", "vllm.mamba."),
)
SOURCES = frozenset(source for _, source, _ in REGISTRIES)
UNREGISTERED = "unregistered"
MISSING_MODULE = "missing-module"
HARDWARE = "hardware"


def member_name(backend: BackendUnderTest) -> str | None:
    """The registry member a ``vllm`` backend is (``vllm.CPU_ATTN`` -> ``CPU_ATTN``); None
    for one registered otherwise (an entry point, the hook)."""
    for _, source, prefix in REGISTRIES:
        if backend.source == source:
            return backend.name.removeprefix(prefix)
    return None


def enum_of(backend: BackendUnderTest) -> str | None:
    """The registry enum's name a ``vllm`` backend is a member of, or None."""
    for enum, source, _ in REGISTRIES:
        if backend.source == source:
            return enum
    return None


def _enums() -> Iterator[tuple[Any, str, str]]:
    try:
        module = importlib.import_module(REGISTRY_MODULE)
    except Exception:
        return
    for enum, source, prefix in REGISTRIES:
        found = getattr(module, enum, None)
        if found is not None:
            yield found, source, prefix


def vllm_installed() -> bool:
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def snapshot() -> dict[str, str]:
    """Where each member resolves now (overrides count), by its discovery name."""
    snap: dict[str, str] = {}
    for enum, _, prefix in _enums():
        for member in enum:
            try:
                snap[prefix + member.name] = str(member.get_path())
            except Exception as exc:
                snap[prefix + member.name] = f"<unresolvable: {describe_error(exc)}>"
    return snap


def overridden() -> dict[str, str]:
    """The members ``register_backend`` re-pointed, by discovery name."""
    found: dict[str, str] = {}
    for enum, _, prefix in _enums():
        for member in enum:
            try:
                if member.is_overridden():
                    found[prefix + member.name] = str(member.get_path())
            except Exception:  # an override that does not resolve is listed by discovery
                continue
    return found


def current_path(backend: BackendUnderTest) -> str | None:
    """Where production resolves a registry member now (``get_path()``, overrides
    counted); None for a backend of no registry, or one that does not resolve."""
    member = member_name(backend)
    enum = enum_of(backend)
    for found, _, _ in _enums():
        if member is not None and found.__name__ == enum:
            try:
                return str(found[member].get_path())
            except Exception:
                return None
    return None


def restore(saved: dict[str, str]) -> None:
    """Put vLLM's registry overrides back as ``saved`` (:func:`overridden`, with other
    registries' members beside) holds them."""
    try:
        register = importlib.import_module(REGISTRY_MODULE).register_backend
    except Exception:
        return
    for enum, source, prefix in _enums():
        mamba = source == "vllm-mamba-registry"
        for member in enum:
            if prefix + member.name in saved:
                register(member, saved[prefix + member.name], is_mamba=mamba)
            else:
                member.clear_override()


def module_exists(module: str) -> bool:
    """Whether the installed packages have ``module``: found by the import system's finders,
    its parent packages not run (one may raise at import: a module needing CUDA)."""
    from pytest_kvconform.adapters.backend_names import module_source

    if module in sys.modules:
        return True
    try:
        return module_source(module) is not None
    except Exception:  # a finder that cannot answer: not known to exist
        return False


def _no_cuda() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except Exception:
        return True


def why_unusable(path: str, exc: BaseException) -> str | None:
    """The kind of reason an in-tree member's class does not import (module docstring)."""
    module = path.rpartition(".")[0]
    if not module_exists(module):
        return MISSING_MODULE
    if module.partition(".")[0] == "vllm" and _no_cuda():
        return HARDWARE
    return None


# Discovery's guard on an import (``discovery.guard_import`` bound to its guard): the reason
# the path's module must not be imported here, or None.
ImportGuard = Callable[[str, str], "str | None"]


def _unguarded(path: str, name: str) -> str | None:
    return None


def registry_backends(names: Collection[str] | None = None,
                      guard: ImportGuard = _unguarded
                      ) -> tuple[list[BackendUnderTest], list[str], str | None]:
    """Every member of vLLM's attention registries (those ``names`` names, when given: the
    others come back by name, not imported); a note when vLLM has none here.  ``guard``
    (discovery's) decides whether a module outside the stack's packages (an override's)
    may be imported here."""
    found: list[BackendUnderTest] = []
    left_out: list[str] = []
    enums = list(_enums())
    if not enums:
        if not vllm_installed():
            return [], [], "vLLM not installed: no vLLM attention backend"
        return [], [], f"vLLM's attention registry ({REGISTRY_MODULE}) not importable"
    for enum, source, prefix in enums:
        for member in enum:
            name = prefix + member.name
            if names is not None and name not in names:
                left_out.append(name)
                continue
            found.append(_member(member, name, source, guard))
    return found, left_out, None


def _member(member: Any, name: str, source: str, guard: ImportGuard) -> BackendUnderTest:
    def record(path: str, **fields: Any) -> BackendUnderTest:
        return BackendUnderTest(name, path, source, re_pointed, family=FAMILY, **fields)

    try:
        re_pointed = bool(member.is_overridden())
    except Exception:
        re_pointed = False
    try:
        path = str(member.get_path())
    except Exception as exc:  # a placeholder nothing registered (CUSTOM, TORCH_SDPA)
        return record("", error=describe_error(exc), unusable=UNREGISTERED)
    refused = guard(path, name)
    if refused is not None:
        return record(path, error=refused)
    try:
        cls = member.get_class()
    except Exception as exc:
        return record(path, error=describe_error(exc),
                      unusable=None if re_pointed else why_unusable(path, exc))
    return record(path, cls=cls)


def is_attention_backend(obj: Any) -> bool:
    """Whether ``obj`` is a class deriving from vLLM's ``AttentionBackend`` (a vLLM
    attention backend, not a diffusion one); False where vLLM does not import."""
    if not isinstance(obj, type):
        return False
    try:
        from vllm.v1.attention.backend import AttentionBackend
    except Exception:
        return False
    return issubclass(obj, AttentionBackend)
