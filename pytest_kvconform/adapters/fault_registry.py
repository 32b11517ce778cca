"""The production faults the suite must catch: each with its seed and the clauses guarding it.

One record per fault (:data:`REGISTRY`), read by ``kvconform selftest`` and by the
harness's own tests.  A fault is seeded one of two ways, never into the checks or the
oracle:

- **worker**: production's worker side rewritten as a regression would change it
  (``adapters/seeds.py``), in every process that hosts production's engine, through
  ``$KVCONFORM_WORKER_FAULT``;
- **planted**: an installed function replaced in the process that runs the checks
  (``adapters/plants.py``): layout resolution, stride derivation, null-block sizing, and
  the paged stand-ins' reads.

``clauses``, ``backend`` and ``cases`` are what the guarding checks run on: the fault
is caught when one of their results fails that passes without it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from pytest_kvconform.adapters import plants, seeds
from pytest_kvconform.adapters.plants import Patch

# The backends the guarding checks run against: production's paged backend for the worker
# side, a plain registry backend for layout resolution, the paged stand-ins for KV-L7.
PAGED = "FLASH_ATTN"
PLAIN = "TORCH_SDPA"


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
            return seeds.unseedable(self.worker)
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


@contextlib.contextmanager
def worker_faults(names: tuple[str, ...]) -> Iterator[None]:
    """For the duration: ``$KVCONFORM_WORKER_FAULT`` names ``names`` (unset if none)."""
    saved = os.environ.get(seeds.ENV)
    if names:
        os.environ[seeds.ENV] = ",".join(names)
    else:
        os.environ.pop(seeds.ENV, None)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(seeds.ENV, None)
        else:
            os.environ[seeds.ENV] = saved


def _worker(name: str, clauses: tuple[str, ...], cases: tuple[str, ...] = ("bf16_h8",),
            beside: tuple[str, ...] = ()) -> Fault:
    what = seeds.describe(name).partition(": ")[2]
    return Fault(name, "adoption", what, clauses, PAGED, cases, worker=name, beside=beside)


def _planted(name: str, family: str, what: str, clauses: tuple[str, ...],
             patches: tuple[Patch, ...], backend: str | None = None,
             cases: tuple[str, ...] = ("bf16_h8",)) -> Fault:
    return Fault(name, family, what, clauses, backend, cases, patches=patches)


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
    # --- layout resolution (KV-L) ---
    _planted("wrong_pin", "layout", "resolve_diffusion_kv_cache_layout pins LBHNC whatever "
             "the backend needs", ("KV-L2",), plants.WRONG_PIN, PLAIN),
    _planted("overwrites_consistent_pin", "layout", "resolve_diffusion_kv_cache_layout "
             "replaces a pinned layout consistent with the backend by the default",
             ("KV-L3",), plants.OVERWRITES_CONSISTENT_PIN, PLAIN),
    _planted("accepts_contradictory_pin", "layout", "resolve_diffusion_kv_cache_layout "
             "silently replaces a pinned layout that contradicts the backend",
             ("KV-L4",), plants.ACCEPTS_CONTRADICTORY_PIN, PLAIN),
    _planted("silent_layout_assertion", "layout", "assert_backend_layout_supported never "
             "raises", ("KV-L5",), plants.SILENT_ASSERTION, PLAIN),
    _planted("assertion_raises_unresolved", "layout", "assert_backend_layout_supported "
             "raises while the layout is still unresolved", ("KV-L5",),
             plants.ASSERTION_RAISES_UNRESOLVED, PLAIN),
    _planted("assertion_refuses_all", "layout", "assert_backend_layout_supported refuses "
             "every pinned layout, consistent ones too", ("KV-L5",),
             plants.ASSERTION_REFUSES_ALL, PLAIN),
    _planted("adoption_accepts_any_layout", "layout", "adopt_kv_cache_layout takes whatever "
             "layout the control plane sends over the worker's own pin", ("KV-L8",),
             plants.ADOPTS_ANY_LAYOUT, PLAIN),
    # --- stride derivation (KV-S) ---
    _planted("hand_strides", "strides", "build_kv_cache_tensor writes layer-outermost "
             "strides whatever the layout", ("KV-S1", "KV-S3"), plants.HAND_STRIDES),
    _planted("view_offset", "strides", "create_kv_cache_views starts every view one page "
             "late", ("KV-S2",), plants.VIEW_OFFSET),
    _planted("view_offset_allocate", "strides", "the views allocate_kv_cache makes start "
             "one page late", ("KV-S2",), plants.VIEW_OFFSET_ALLOCATE),
    _planted("padded_as_dense", "strides", "build_kv_cache_tensor drops a padded page's "
             "padding", ("KV-S4",), plants.PADDED_AS_DENSE, cases=("padded",)),
    _planted("unrelated_padded", "strides", "padded pages raise an unrelated ValueError "
             "where the documented error is due", ("KV-S4",), plants.UNRELATED_PADDED,
             cases=("padded",)),
    _planted("unrelated_split", "strides", "kernel-block splitting raises an unrelated "
             "ValueError where the documented error is due", ("KV-S4",),
             plants.UNRELATED_SPLIT, cases=("split_k8",)),
    _planted("alias_in_group", "strides", "with several cache groups, layer l+1 starts one "
             "block after layer l", ("KV-S5",), plants.ALIAS_IN_GROUP, cases=("groups2",)),
    # --- null-block sizing (KV-N) ---
    _planted("pool_hands_out_null_block", "null block", "BlockPool.get_new_blocks hands out "
             "the null block as the last free block", ("KV-N1",), plants.HANDS_OUT_NULL_BLOCK),
    _planted("pool_crashes_when_exhausted", "null block", "an exhausted BlockPool raises "
             "RuntimeError instead of refusing", ("KV-N1",), plants.CRASHES_WHEN_EXHAUSTED),
    _planted("sizing_forgets_null_block", "null block", "auto-fit and admission count the "
             "null block as usable (the pre-0.29 sizing)", ("KV-N2", "KV-N3", "KV-N4"),
             plants.FORGETS_NULL_BLOCK),
    _planted("override_ignored", "null block", "the control plane sizes ranks from profiled "
             "memory and drops num_gpu_blocks_override", ("KV-N3",), plants.OVERRIDE_IGNORED),
    _planted("no_refusal_below_two_pages", "null block", "memory left for no usable block is "
             "accepted instead of refused", ("KV-N4",), plants.NO_REFUSAL),
    _planted("ranks_sized_for_largest", "null block", "every rank is sized from the largest "
             "rank's memory", ("KV-N5",), plants.SIZED_FOR_LARGEST),
    _planted("rank_tensors_not_shrunk", "null block", "ranks take the smallest num_blocks "
             "but keep tensors sized for their own memory", ("KV-N5",),
             plants.TENSORS_NOT_SHRUNK),
    # --- paged reads (KV-L7), planted into the conforming stand-ins ---
    _planted("paged_ignores_block_table", "paged read", "PAGED_OK's kernel reads physical "
             "block j for logical block j", ("KV-L7",), plants.IGNORES_TABLE, "PAGED_OK"),
    _planted("paged_wrong_block_stride", "paged read", "PAGED_OK_BS's kernel steps blocks by "
             "one page in a block-outermost layout", ("KV-L7",), plants.WRONG_BLOCK_STRIDE,
             "PAGED_OK_BS"),
    _planted("paged_truncates_partial_block", "paged read", "PAGED_OK's kernel reads a "
             "request's partial last block from the null block", ("KV-L7",),
             plants.TRUNCATES_PARTIAL_BLOCK, "PAGED_OK"),
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
