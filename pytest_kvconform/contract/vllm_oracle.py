"""What resolving one KV-cache layout for vLLM's own attention backends must give (KV-V3).

The contract's rules, written from the contract (``PROPOSED_CONTRACT_V.md``: KV-V3) and
vLLM's documented behaviour, never from its code: a worker's layouts are what every one of
its backends supports (a backend declaring None supports any layout and contributes
nothing; a worker where nothing declares follows the default preference); identical
declarations keep their order, otherwise a layout more backends put first comes first,
ties in the enum's order; nothing in common is refused.  The engine core then refuses
ranks that disagree, narrows mixed page shapes to block-compact layouts, takes
``VLLM_KV_CACHE_LAYOUT`` as hard (``NHD``/``HND`` aliases), a connector's preference as
soft, and a layout already pinned outright.

Stdlib only (layout names as strings; the order is the contract's list): no vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pytest_kvconform.contract.oracle import PHYSICAL_LAYOUTS, is_block_compact

# The enum's order (``KVCacheLayout``'s members, first to last): the tie-break.
ENUM_ORDER: tuple[str, ...] = PHYSICAL_LAYOUTS
# What a worker whose backends declare nothing follows, most preferred first.
DEFAULT_PREFERENCE: tuple[str, ...] = ("LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC")
# The legacy names upstream accepts for a layout, alias -> canonical.
ALIASES: dict[str, str] = {"NHD": "LBNHC", "HND": "LBHNC"}

Declaration = tuple[str, ...] | None


@dataclass(frozen=True)
class Expected:
    """What resolution must give: a layout (a list for a worker), or a refusal and why."""

    value: tuple[str, ...] | str | None = None
    refused: str | None = None  # why it must be refused; None: value is expected

    def __str__(self) -> str:
        if self.refused is not None:
            return f"refused ({self.refused})"
        if isinstance(self.value, tuple):
            return "[" + ", ".join(self.value) + "]"
        return str(self.value)


def canonical(name: str) -> str:
    """``name`` with an alias replaced; an unknown name is a ValueError (never a KeyError)."""
    name = ALIASES.get(name, name)
    if name not in ENUM_ORDER:
        raise ValueError(f"unknown KV-cache layout {name!r}")
    return name


def worker_layouts(declarations: Sequence[Declaration]) -> Expected:
    """The layouts one worker supports, most preferred first, from its backends' declarations."""
    declared = [tuple(d) for d in declarations if d is not None]
    if not declared:
        return Expected(DEFAULT_PREFERENCE)
    if all(d == declared[0] for d in declared):
        return Expected(declared[0])
    common = [name for name in ENUM_ORDER if all(name in d for d in declared)]
    if not common:
        return Expected(refused="no layout is in every backend's declaration")
    firsts = {name: sum(1 for d in declared if d and d[0] == name) for name in common}
    # Stable by enum order within equal counts of first places.
    ranked = sorted(common, key=lambda name: (-firsts[name], ENUM_ORDER.index(name)))
    return Expected(tuple(ranked))


def resolve(ranks: Sequence[Sequence[str]], *, mixed_pages: bool = False,
            env: str | None = None, connector: str | None = None,
            pinned: str | None = None) -> Expected:
    """The layout the engine core must resolve over ``ranks`` (each rank's worker layouts)."""
    if pinned is not None:
        return Expected(canonical(pinned))
    if not ranks or not all(ranks):
        return Expected(refused="a rank reported no layout")
    first = tuple(ranks[0])
    if any(tuple(r) != first for r in ranks[1:]):
        return Expected(refused="ranks disagree on their supported layouts")
    candidates = list(first)
    if mixed_pages:
        candidates = [name for name in candidates if is_block_compact(name)]
        if not candidates:
            return Expected(refused="mixed page shapes need a block-compact layout")
    if env is not None:
        wanted = canonical(env)
        if wanted not in candidates:
            return Expected(refused=f"VLLM_KV_CACHE_LAYOUT={env} is not supported")
        return Expected(wanted)
    if connector is not None and canonical(connector) in candidates:
        return Expected(canonical(connector))
    return Expected(candidates[0])
