"""KV-A6's allocation for a free-memory figure: what the control plane sizes, and where
the check's far pages start.

KV-A6 hands production's control plane ``memory_fraction`` of a device's free memory and
reads pages back past 2^31 and 2^32 bytes; this runs the same control plane
(``build_control_plane``) and picks the same pages (the check's own ``_far_pages``), so
the report shows what the check probed.  No allocation is made: it runs on CPU for any
figure (the tests use an H200's 143771 MiB).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pytest_kvconform.adapters.control_plane import build_control_plane
from pytest_kvconform.checks.adoption import _geometry
from pytest_kvconform.checks.adoption_bytes import PROBES, _far_pages
from pytest_kvconform.contract import cases, clauses, oracle
from pytest_kvconform.contract.records import Case

CLAUSE = "KV-A6"


@dataclass(frozen=True)
class Probe:
    """One far page KV-A6 writes and reads back: its first byte's offset in the tensor."""

    layer: int
    block: int
    byte_offset: int


@dataclass(frozen=True)
class A6Sizing:
    case: str
    need: bool  # the control plane's indexes_kv_by_block_stride
    layout: str
    free_bytes: int
    fraction: float
    allocation_bytes: int
    num_blocks: int
    probes: tuple[Probe, ...]

    def past(self, boundary: int) -> bool:
        """Whether a probed page starts at or beyond ``boundary`` bytes."""
        return any(p.byte_offset >= boundary for p in self.probes)

    def as_dict(self) -> dict[str, Any]:
        """JSON's shape: lists, and whether a probe reaches each boundary."""
        return {**asdict(self), "probes": [asdict(p) for p in self.probes],
                **{f"past_2_{b.bit_length() - 1}": self.past(b) for b in PROBES}}


def a6_case() -> Case:
    """The first shipped case KV-A6 runs on (the clause table's predicate)."""
    runs_on = clauses.clause(CLAUSE).cases
    assert runs_on is not None, f"{CLAUSE} takes a case"
    return next(c for c in cases.load_cases(()) if runs_on(c))


def a6_sizing(free_bytes: int, *, fraction: float, need: bool, device: str,
              case: Case | None = None) -> A6Sizing:
    """The allocation KV-A6 gets from ``fraction`` of ``free_bytes``, and its far pages."""
    case = case or a6_case()
    plane = build_control_plane(need, case, device=device,
                                available_memory=[int(free_bytes * fraction)])
    config = plane.rank_configs[0]
    tensor = config.kv_cache_tensors[0]
    layout = plane.pinned or config.kv_cache_layout
    geom = _geometry(config, len(tensor.layers))
    probes = tuple(Probe(layer, block, oracle.page_start(layout, geom, layer, block,
                                                         tensor.offset))
                   for layer, block in _far_pages(layout, geom, tensor.offset))
    return A6Sizing(case=case.id, need=need, layout=layout, free_bytes=free_bytes,
                    fraction=fraction,
                    allocation_bytes=max(t.size for t in config.kv_cache_tensors),
                    num_blocks=config.num_blocks, probes=probes)
