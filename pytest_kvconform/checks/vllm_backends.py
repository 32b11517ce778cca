"""KV-V clauses: vLLM's own attention backends, their registration and their declaration.

Each backend is a ``BackendUnderTest`` of family ``vllm`` (``adapters/vllm_registry.py``):
a member of vLLM's attention registries as production resolves it, or a repository's
``AttentionBackend`` subclass.  Every call into its class is bounded
(``common.call_declaration``); the expected page is computed here from the spec's shape
and the dtype's size (``records.DTYPE_SIZES``), never read from production.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

from pytest_kvconform.adapters import vllm_registry
from pytest_kvconform.checks.common import (
    Problems,
    Where,
    backend_class,
    declared,
)
from pytest_kvconform.checks.errors import ClauseSkip, SkipKind
from pytest_kvconform.contract.records import DTYPE_SIZES, BackendUnderTest

LAYOUTS = "supported_kv_cache_layouts"
KERNEL_BLOCK_SIZES = "get_supported_kernel_block_sizes"
CUSTOMIZE = "customize_spec"
# The spec KV-V2's page control sizes: an unquantized page of each kernel block size.
SPEC_HEADS = 2
SPEC_HEAD_SIZE = 64
SPEC_DTYPE = "bfloat16"
# The block size a MultipleOf(m) kernel block size is checked at: the first multiple of m
# from this one.
SPEC_MIN_BLOCK = 16


def vllm_class(clause: str, backend: BackendUnderTest) -> Any:
    """The backend's class; else the skip that says why it is unusable here, of the kind
    the reason is: a placeholder nothing registered (not applicable), a module the installed
    vLLM lacks (not applicable here: KV-V1's module control reports it, as the stack's), a
    class that needs CUDA to import on a host without it (hardware), else the backend's."""
    if backend.cls is None and backend.source != "none":
        where = f"(from {backend.source} {backend.path or '-'})"
        if backend.unusable == vllm_registry.UNREGISTERED:
            raise ClauseSkip(clause, f"{backend.name} is a placeholder nothing registered: "
                             f"{backend.error}", SkipKind.NOT_APPLICABLE)
        if backend.unusable == vllm_registry.MISSING_MODULE:
            raise ClauseSkip(clause, f"{backend.name}'s registry entry names a module the "
                             f"installed vLLM does not have ({backend.error}); the stack's "
                             "finding, reported by test_kv_v1_module", SkipKind.NOT_APPLICABLE)
        if backend.unusable == vllm_registry.HARDWARE:
            raise ClauseSkip(clause, f"{backend.name}'s in-tree class needs CUDA to import, and "
                             f"this host has none: {backend.error} {where}", SkipKind.HARDWARE)
    return backend_class(clause, backend)


def _declared(where: Where, backend: BackendUnderTest, method: Any, name: str,
              *args: Any) -> Any:
    """``method(*args)``, bounded (:func:`~pytest_kvconform.checks.common.declared`), kept
    for the process under the call it stands for."""
    key = (backend.name, name + "".join(f":{a!r}" for a in args), 0)
    return declared(where, backend.name, method, name, *args, key=key)


def _method(where: Where, cls: Any, name: str) -> Any:
    method = getattr(cls, name, None)
    if method is None or not callable(method):
        raise where.fail(f"the backend class has no callable {name}() (found {method!r})")
    return method


# --- KV-V1 --------------------------------------------------------------------------------


def check_kv_v1(backend: BackendUnderTest) -> None:
    """KV-V1: the entry resolves to an ``AttentionBackend`` subclass answering to its name.

    vLLM's ``Attention`` layer maps its backend back to its registry member by
    ``AttentionBackendEnum[backend.get_name()]``: an in-tree class answering to another
    member's name is served as that member, one answering to no member's name fails the
    layer's construction.  The Mamba registry is never looked up by name: any non-empty
    name will do there.  A repository's backend answers to the name it is registered under.
    """
    clause = "KV-V1"
    where = Where(clause, backend=backend.name)
    cls = vllm_class(clause, backend)
    if not vllm_registry.is_attention_backend(cls):
        raise where.fail(f"{cls!r} is not a subclass of vLLM's AttentionBackend "
                         "(vllm.v1.attention.backend)")
    name = _declared(where, backend, _method(where, cls, "get_name"), "get_name")
    if type(name) is not str or not name:
        raise where.fail(f"get_name() returned {name!r} of type {type(name).__name__}; a "
                         "non-empty str is required", expected="str", actual=type(name).__name__)
    enum = vllm_registry.enum_of(backend)
    member = vllm_registry.member_name(backend)
    if enum == "MambaAttentionBackendEnum" or backend.source == "api":
        return
    expected = member if member is not None else backend.name
    if name != expected:
        how = (f"production's Attention layer maps it to AttentionBackendEnum[{name!r}] and "
               "serves it as that member, or fails if there is none" if enum is not None
               else f"it is registered as {expected!r}")
        raise where.fail(f"get_name() returned {name!r}, but the backend is "
                         f"{enum + '.' if enum else ''}{expected}: {how}",
                         expected=expected, actual=name)


def check_kv_v1_module(backend: BackendUnderTest) -> None:
    """KV-V1 (the stack's registry): a member's path names a module the installed vLLM
    has, so production can resolve the member at all."""
    clause = "KV-V1"
    where = Where(clause, backend=backend.name)
    if backend.source == "none":
        backend_class(clause, backend)
    enum = vllm_registry.enum_of(backend)
    if enum is None:
        raise where.skip("not a registry member: no registry entry of the stack's to check",
                         SkipKind.NOT_APPLICABLE)
    if backend.unusable == vllm_registry.UNREGISTERED:
        raise where.skip(f"{backend.name} is a placeholder nothing registered: "
                         f"{backend.error}", SkipKind.NOT_APPLICABLE)
    path = vllm_registry.current_path(backend) or backend.path
    module = path.rpartition(".")[0]
    if not module or not vllm_registry.module_exists(module):
        raise where.fail(f"{enum}.{vllm_registry.member_name(backend)} names "
                         f"{path!r}, but the installed vLLM has no module {module!r}: "
                         "production cannot resolve the member (get_class() raises "
                         "ModuleNotFoundError)", expected=f"module {module}", actual="none")


# --- KV-V2 --------------------------------------------------------------------------------


def check_kv_v2(backend: BackendUnderTest) -> None:
    """KV-V2: ``supported_kv_cache_layouts()``, called on the class with no device, is None
    or a non-empty tuple of distinct ``KVCacheLayout`` members."""
    clause = "KV-V2"
    where = Where(clause, backend=backend.name)
    cls = vllm_class(clause, backend)
    from vllm.v1.attention.backend import AttentionBackend

    if not hasattr(AttentionBackend, LAYOUTS):
        raise where.skip(f"the installed vLLM's AttentionBackend declares no {LAYOUTS}()",
                         SkipKind.ENVIRONMENT)
    from vllm.v1.kv_cache_layout import KVCacheLayout

    found = _declared(where, backend, _method(where, cls, LAYOUTS), LAYOUTS)
    if found is None:
        return
    if not isinstance(found, tuple):
        raise where.fail(f"{LAYOUTS}() returned {found!r} of type {type(found).__name__}; "
                         "None or a tuple of KVCacheLayout members is required",
                         expected="tuple", actual=type(found).__name__)
    if not found:
        raise where.fail(f"{LAYOUTS}() returned an empty tuple: no layout can be resolved for "
                         "it (None says any layout will do)", expected="None or a non-empty "
                         "tuple", actual="()")
    problems = Problems(where)
    for i, item in enumerate(found):
        if not isinstance(item, KVCacheLayout):
            problems.add(f"{LAYOUTS}()[{i}] is {item!r} of type {type(item).__name__}, not a "
                         "KVCacheLayout member", expected="KVCacheLayout",
                         actual=type(item).__name__)
    repeated = sorted({str(getattr(x, "name", x)) for x in found if found.count(x) > 1})
    if repeated:
        problems.add(f"{LAYOUTS}() lists {', '.join(repeated)} more than once",
                     expected="distinct members", actual=repr(found))
    problems.raise_any()


def _kernel_blocks(where: Where, sizes: Any) -> list[int]:
    """The block sizes the page control sizes, one per declared kernel block size."""
    from vllm.v1.attention.backend import MultipleOf

    if not isinstance(sizes, (list, tuple)):
        raise where.fail(f"{KERNEL_BLOCK_SIZES}() returned {sizes!r} of type "
                         f"{type(sizes).__name__}; a list of int or MultipleOf is required")
    blocks: list[int] = []
    for i, size in enumerate(sizes):
        if isinstance(size, MultipleOf):
            base = getattr(size, "base", None)
            if type(base) is not int or base <= 0:
                raise where.fail(f"{KERNEL_BLOCK_SIZES}()[{i}] is MultipleOf({base!r}); a "
                                 "positive int base is required")
            blocks.append(base * math.ceil(SPEC_MIN_BLOCK / base))
        elif type(size) is int and size > 0:
            blocks.append(size)
        else:
            raise where.fail(f"{KERNEL_BLOCK_SIZES}()[{i}] is {size!r} of type "
                             f"{type(size).__name__}; a positive int or a MultipleOf is "
                             "required")
    return list(dict.fromkeys(blocks)) or [SPEC_MIN_BLOCK]


def _spec_facts(cls: Any, block_size: int) -> dict[str, Any]:
    """The spec ``customize_spec`` makes of an unquantized page of ``block_size`` tokens,
    as plain data (made in a child: a backend's spec never crosses back)."""
    import torch
    from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=SPEC_HEADS,
                             head_size=SPEC_HEAD_SIZE, dtype=getattr(torch, SPEC_DTYPE))
    out = cls.customize_spec(spec) if hasattr(cls, CUSTOMIZE) else spec
    if not isinstance(out, AttentionSpec):
        return {"type": type(out).__name__}
    return {"type": type(out).__name__, "spec": True, "block_size": out.block_size,
            "page": int(out.page_size_bytes)}


def check_kv_v2_page(backend: BackendUnderTest) -> None:
    """KV-V2 (the page): each kernel block size ``get_supported_kernel_block_sizes()``
    declares is one ``customize_spec()`` sizes an unquantized page of exactly: tokens x
    heads x (K + V head size) x the dtype's size."""
    clause = "KV-V2"
    where = Where(clause, backend=backend.name)
    cls = vllm_class(clause, backend)
    blocks = [SPEC_MIN_BLOCK]
    if hasattr(cls, KERNEL_BLOCK_SIZES):
        sizes = _declared(where, backend, _method(where, cls, KERNEL_BLOCK_SIZES),
                          KERNEL_BLOCK_SIZES)
        blocks = _kernel_blocks(where, sizes)
    problems = Problems(where)
    element = DTYPE_SIZES[SPEC_DTYPE]
    for block in blocks:
        expected = block * SPEC_HEADS * 2 * SPEC_HEAD_SIZE * element
        shape = (f"{block} tokens x {SPEC_HEADS} heads x (K+V) {SPEC_HEAD_SIZE} x "
                 f"{SPEC_DTYPE} ({element} B)")
        facts = _declared(where, backend, partial(_spec_facts, cls), CUSTOMIZE, block)
        if not facts.get("spec"):
            problems.add(f"{CUSTOMIZE}() of an unquantized page of {block} tokens returned a "
                         f"{facts.get('type')}, not an AttentionSpec",
                         expected="AttentionSpec", actual=facts.get("type"))
        elif facts["block_size"] != block:
            problems.add(f"{CUSTOMIZE}() changed the block size of a {block}-token page to "
                         f"{facts['block_size']}", expected=block, actual=facts["block_size"])
        elif facts["page"] != expected:
            problems.add(f"{CUSTOMIZE}() sizes an unquantized page of {shape} at "
                         f"{facts['page']} bytes, not {expected}", expected=expected,
                         actual=facts["page"])
    problems.raise_any()
