"""The production faults the suite must catch: each with its seed and the clauses guarding it.

One record per fault (:data:`REGISTRY`), read by ``kvconform selftest`` and by the
harness's own tests.  A fault is seeded one of two ways, never into the checks or the
oracle:

- **worker**: production's worker side rewritten as a regression would change it
  (``faults/worker_faults.py``), in every process that hosts production's engine, through
  ``$KVCONFORM_WORKER_FAULT``;
- **planted**: an installed function replaced in the process that runs the checks
  (``faults/plants.py``): layout resolution, stride derivation, null-block sizing, and
  the paged stand-ins' reads.  Each is declared once, where it is planted
  (``plants.declare``), and registered here from :data:`plants.PLANTED`.

``clauses``, ``backend`` and ``cases`` are what the guarding checks run on: the fault
is caught when one of their results fails that passes without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from pytest_kvconform.adapters import run_env
from pytest_kvconform.adapters.fault_hook import FAULT_ENV
from pytest_kvconform.contract.clauses import parse_clause
from pytest_kvconform.faults import (
    plants,
    vllm_plants,  # declares the V faults (plants.PLANTED)
)
from pytest_kvconform.faults import worker_faults as worker_side
from pytest_kvconform.faults.plants import Patch

# The backends the guarding checks run against: production's paged backend for the worker
# side, a plain registry backend for layout resolution (plants.PLAIN), the paged stand-ins
# for KV-L7.
PAGED = "FLASH_ATTN"
PLAIN = plants.PLAIN


@dataclass(frozen=True)
class Fault:
    """A production fault: how it is seeded, what it breaks, and what must catch it."""

    name: str
    family: str  # adoption, layout, strides, null block, paged read
    what: str  # what the seeded code does wrong, in words
    clauses: tuple[str, ...]  # the clauses whose checks guard it
    backend: str | None  # what those checks run against (None: they check no backend)
    cases: tuple[str, ...] = ("bf16_h8",)  # the spec cases they run on
    worker: str | None = None  # a worker-side seed ($KVCONFORM_WORKER_FAULT), or
    patches: tuple[Patch, ...] = ()  # installed functions replaced in the checks' process
    # Worker-side corrections in place with the fault and in its clean baseline alike: the
    # fault removes something the installed version only does once corrected.
    beside: tuple[str, ...] = ()

    @property
    def how(self) -> str:
        return "worker" if self.worker is not None else "planted"

    def unseedable(self) -> str | None:
        """Why this fault cannot be seeded into the installed stack, or None."""
        if self.worker is not None:
            return worker_side.unseedable(self.worker)
        try:
            plants.replacements(self.patches)
        except plants.Unplantable as exc:
            return str(exc)
        return None

    @contextlib.contextmanager
    def seeded(self) -> Iterator[None]:
        """For the duration: the fault in place (with what it is ``beside``)."""
        with worker_faults((*self.beside, self.worker) if self.worker else self.beside), \
                plants.planted(self.patches):
            yield


def worker_faults(names: tuple[str, ...]) -> contextlib.AbstractContextManager[None]:
    """For the duration: ``$KVCONFORM_WORKER_FAULT`` names ``names`` (unset if none)."""
    return run_env.variable_set(FAULT_ENV, ",".join(names) or None)


def _worker(name: str, clauses: tuple[str, ...], cases: tuple[str, ...] = ("bf16_h8",),
            beside: tuple[str, ...] = (), backend: str = PAGED, family: str = "adoption"
            ) -> Fault:
    what = worker_side.describe(name).partition(": ")[2]
    return Fault(name, family, what, clauses, backend, cases, worker=name, beside=beside)


# The registry's family of a planted fault, by its first clause's family.
_FAMILIES = {"L": "layout", "S": "strides", "N": "null block", "A": "adoption",
             "V": "vllm backends"}


def _planted(plant: plants.Planted) -> Fault:
    """A fault declared in ``faults/plants.py`` (:func:`plants.declare`)."""
    family = plant.family or _FAMILIES[parse_clause(plant.clauses[0])[0]]
    return Fault(plant.name, family, plant.what, plant.clauses, plant.backend, plant.cases,
                 patches=plant.patches)


_FAULTS: tuple[Fault, ...] = (
    # --- production's worker side and control plane output (KV-A) ---
    _worker("skip_adoption", ("KV-A3", "KV-A4")),
    _worker("allocate_before_adopting", ("KV-A3",)),
    _worker("skip_layer_assertion", ("KV-A4",), beside=("assert_layer_backends",)),
    _worker("other_rank_config", ("KV-A3", "KV-A5"), cases=("ws2",)),
    _worker("shared_cache_config", ("KV-A4",)),
    _worker("handoff_drops_layout", ("KV-A2", "KV-A5"), cases=("bf16_h8", "ws2")),
    _worker("unstamped_configs", ("KV-A1", "KV-A3", "KV-A4")),
    _worker("misnamed_configs", ("KV-A1", "KV-A3")),
    _worker("shifted_offset", ("KV-A1", "KV-A3")),
    # --- vLLM's own worker (KV-V4), on a vLLM backend ---
    _worker(vllm_plants.WORKER_IGNORES_RPC_NAME, ("KV-V4",), backend=vllm_plants.BACKEND,
            family=vllm_plants.FAMILY),
    # --- planted in the checks' process (layout resolution, strides, null-block sizing, the
    # paged stand-ins' reads): each declared once, in faults/plants.py ---
    *(_planted(plant) for plant in plants.PLANTED.values()),
)
REGISTRY: dict[str, Fault] = {fault.name: fault for fault in _FAULTS}


def select(names: list[str] | tuple[str, ...] | None) -> list[Fault]:
    """The faults ``names`` names (all when None or empty), in registry order; an unknown
    name raises one ValueError listing the known ones."""
    if not names:
        return list(_FAULTS)
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown fault {', '.join(map(repr, unknown))}; known faults: "
                         f"{', '.join(REGISTRY)}")
    return [f for f in _FAULTS if f.name in names]
