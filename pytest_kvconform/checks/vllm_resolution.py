"""KV-V3: production resolves the layout a vLLM backend's declaration allows.

Production's worker-side intersection (``get_supported_kv_cache_layouts``) and engine-core
resolution (``resolve_kv_cache_layout``) are driven for the backend alone, an identical
pair, the backend beside other real vLLM backends, ``VLLM_KV_CACHE_LAYOUT`` (every layout
and alias), a connector's preference, a pinned layout, disagreeing ranks and mixed page
shapes; each answer is compared with ``contract/vllm_oracle.py``.  One result: the first
difference (scenario, expected, actual) and how many more there were.

The backend's class is touched only inside bounded calls (its declaration, and production's
intersection, which calls it); the engine core's resolution reads names only, here.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from pytest_kvconform.adapters import vllm_layout
from pytest_kvconform.adapters.vllm_layout import Got
from pytest_kvconform.checks.common import (
    Where,
    backend_call_key,
    call_declaration,
    note_via,
    production_with_class,
    unsupported_as_skip,
)
from pytest_kvconform.checks.errors import ClauseFailure, SkipKind
from pytest_kvconform.checks.vllm_backends import vllm_class
from pytest_kvconform.contract import vllm_oracle
from pytest_kvconform.contract.records import BackendUnderTest
from pytest_kvconform.contract.vllm_oracle import Expected

CLAUSE = "KV-V3"
# Real vLLM backends the backend is mixed with (each that imports here; itself excluded):
# one per kind of declaration vLLM 0.30 ships (head-major, token-major, two layouts, all six).
MIX_WITH = ("CPU_ATTN", "FLEX_ATTENTION", "ROCM_ATTN", "TRITON_FLASH_ATTN")
# Refusals production may raise: a clear error, never a bare KeyError.
REFUSALS = ("ValueError", "AssertionError")
VIA = f"{vllm_layout.UTILS}.get_supported_kv_cache_layouts + resolve_kv_cache_layout"


@dataclass(frozen=True)
class Difference:
    scenario: str
    expected: Expected
    got: Got

    def detail(self, source: str) -> str:
        return (f"{self.scenario}: expected {self.expected}, production's {source} "
                f"gave {self.got}")


def declaring_class(clause: str, backend: BackendUnderTest) -> Any:
    """The backend's class, with the installed vLLM's layout path there and the class
    declaring its layouts; else the skip that says which is missing (KV-V3, KV-V4)."""
    cls = vllm_class(clause, backend)
    with unsupported_as_skip(clause):
        vllm_layout.production()
    if not vllm_layout.declares_layouts(cls):
        raise Where(clause, backend=backend.name).skip(
            f"{backend.name} has no supported_kv_cache_layouts (not a vLLM attention "
            "backend); see KV-V2", SkipKind.NOT_APPLICABLE)
    return cls


def check_kv_v3(backend: BackendUnderTest) -> None:
    """Every scenario production resolves as the contract's rules say (one result)."""
    cls = declaring_class(CLAUSE, backend)
    others = mix_partners(backend.name)
    declared = _declarations(backend, cls, others)
    mine = declared[backend.name]

    worker = worker_scenarios(backend.name, mine, {n: declared[n] for n in others})
    got = production_with_class(
        CLAUSE, backend.name, "get_supported_kv_cache_layouts",
        partial(_run_workers, [[(cls if n == backend.name else others[n]) for n in names]
                               for _, names, _ in worker]))
    differences = [Difference(label, expected, found)
                   for (label, _, expected), found in zip(
                       worker, (Got(tuple(v) if v is not None else None, r) for v, r in got),
                       strict=True)
                   if not agrees(expected, found)]
    sources = ["get_supported_kv_cache_layouts"] * len(differences)

    resolved = resolve_scenarios(backend.name, mine, {n: declared[n] for n in others})
    for label, kwargs, expected in resolved:
        found = vllm_layout.resolve(**kwargs)
        if not agrees(expected, found):
            differences.append(Difference(label, expected, found))
            sources.append("resolve_kv_cache_layout")
    note_via(VIA)
    if differences:
        first = differences[0]
        more = len(differences) - 1
        tail = f" ({more} more difference{'s' * (more != 1)})" if more else ""
        raise ClauseFailure(
            CLAUSE, first.detail(sources[0]) + tail, backend=backend.name,
            expected=str(first.expected), actual=str(first.got),
            problems=tuple(d.detail(s) for d, s in zip(differences, sources, strict=True)))


def mix_partners(name: str) -> dict[str, Any]:
    """The real vLLM backends of :data:`MIX_WITH` that import here, by name (not ``name``)."""
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except ImportError:
        return {}
    found: dict[str, Any] = {}
    for other in MIX_WITH:
        member = getattr(AttentionBackendEnum, other, None)
        if other == name or member is None:
            continue
        try:
            found[other] = member.get_class()
        except Exception:  # a partner that does not import here is left out
            continue
    return found


def _declarations(backend: BackendUnderTest, cls: Any, others: dict[str, Any]
                  ) -> dict[str, tuple[str, ...] | None]:
    """Each backend's declaration as names: the backend's own read in one bounded call."""
    try:
        mine = read_declaration(CLAUSE, backend.name, cls)
    except ClauseFailure:
        raise
    except Exception as exc:
        raise ClauseFailure(CLAUSE, f"supported_kv_cache_layouts() raised "
                            f"{type(exc).__name__}: {exc} (see KV-V2)",
                            backend=backend.name) from exc
    declared: dict[str, tuple[str, ...] | None] = {backend.name: mine}
    for name, other in others.items():
        declared[name] = vllm_layout.declaration(other)  # vLLM's own, in-tree
    known = set(vllm_oracle.ENUM_ORDER)
    stray = [n for n in (mine or ()) if n not in known]
    if stray:
        raise ClauseFailure(CLAUSE, f"supported_kv_cache_layouts() names {stray}, no "
                            "KVCacheLayout member (see KV-V2)", backend=backend.name)
    return declared


def read_declaration(clause: str, name: str, cls: Any) -> tuple[str, ...] | None:
    """``cls.supported_kv_cache_layouts()`` as names, in one bounded call named after the
    method (a call that hung is remembered under it), kept for the process."""
    static = inspect.getattr_static(cls, vllm_layout.DECLARATION, None)
    return call_declaration(clause, name, partial(vllm_layout.declaration, cls), cache=True,
                            key=backend_call_key(name, static, vllm_layout.DECLARATION))


def _run_workers(mixes: Sequence[Sequence[Any]]) -> list[tuple[Any, str | None]]:
    """Production's intersection for each mix, as plain data (it crosses a process)."""
    return [(got.value, got.raised)
            for got in (vllm_layout.worker_layouts(classes) for classes in mixes)]


Scenario = tuple[str, Sequence[str], Expected]


def worker_scenarios(name: str, mine: tuple[str, ...] | None,
                     others: dict[str, tuple[str, ...] | None]) -> list[Scenario]:
    """(label, the worker's backends by name, expected) for production's intersection."""
    out: list[Scenario] = [
        (f"a worker with {name} alone", [name], vllm_oracle.worker_layouts([mine])),
        (f"a worker with {name} twice (an identical pair)", [name, name],
         vllm_oracle.worker_layouts([mine, mine])),
    ]
    for other, theirs in others.items():
        out.append((f"a worker with {name} and {other}", [name, other],
                    vllm_oracle.worker_layouts([mine, theirs])))
        out.append((f"a worker with {other} and {name}", [other, name],
                    vllm_oracle.worker_layouts([theirs, mine])))
    return out


ResolveScenario = tuple[str, dict[str, Any], Expected]


def resolve_scenarios(name: str, mine: tuple[str, ...] | None,
                      others: dict[str, tuple[str, ...] | None]) -> list[ResolveScenario]:
    """(label, production's inputs, expected) for the engine core's resolution."""
    alone = vllm_oracle.worker_layouts([mine])
    assert isinstance(alone.value, tuple)  # a single declaration is never refused
    ranks = [alone.value]
    names = tuple(vllm_oracle.ENUM_ORDER) + tuple(vllm_oracle.ALIASES)
    out: list[ResolveScenario] = []

    def add(label: str, **kwargs: Any) -> None:
        out.append((f"{name}: {label}", kwargs, vllm_oracle.resolve(**kwargs)))

    add("one rank", ranks=ranks)
    add("two ranks with identical declarations", ranks=ranks * 2)
    for other, theirs in others.items():
        mixed = vllm_oracle.worker_layouts([mine, theirs])
        if isinstance(mixed.value, tuple):
            add(f"two ranks, each with {name} and {other}", ranks=[mixed.value] * 2)
        if vllm_oracle.worker_layouts([theirs]).value != alone.value:
            theirs_alone = vllm_oracle.worker_layouts([theirs]).value
            assert isinstance(theirs_alone, tuple)
            add(f"rank 1 runs {other} (ranks disagree)", ranks=[alone.value, theirs_alone])
    add("mixed page shapes (block-compact layouts only)", ranks=ranks, mixed_pages=True)
    for value in names:
        add(f"VLLM_KV_CACHE_LAYOUT={value}", ranks=ranks, env=value)
        add(f"a connector preferring {value}", ranks=ranks, connector=value)
        add(f"a layout already pinned to {value}", ranks=ranks, pinned=value)
    for value in alone.value[:1] + vllm_oracle.ENUM_ORDER[-1:]:
        add(f"VLLM_KV_CACHE_LAYOUT={value} and mixed page shapes", ranks=ranks, env=value,
            mixed_pages=True)
        other_pick = next(n for n in vllm_oracle.ENUM_ORDER if n != value)
        add(f"VLLM_KV_CACHE_LAYOUT={value} with a connector preferring {other_pick}",
            ranks=ranks, env=value, connector=other_pick)
    return out


def agrees(expected: Expected, got: Got) -> bool:
    """A refusal is any clear error (:data:`REFUSALS`); a value must match exactly."""
    if expected.refused is not None:
        return got.raised is not None and got.raised.split(":", 1)[0] in REFUSALS
    return got.raised is None and got.value == expected.value

