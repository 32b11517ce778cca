"""Faults planted in vLLM's own layout path for the V clauses (KV-V3..KV-V5).

KV-V3 and KV-V5: patterns of ``faults/plants.py`` (a
:class:`~pytest_kvconform.faults.plants.Patch`: an installed function replaced by
``make(original)``, mostly delegating to it), declared with ``plants.declare`` so the
registry and ``kvconform selftest`` have them.  KV-V4: a worker-side regression (below),
one of ``worker_faults.REGRESSIONS``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from pytest_kvconform.adapters import run_env
from pytest_kvconform.adapters.source_rewrite import DropStatements, Regression, is_call_to
from pytest_kvconform.faults import plants
from pytest_kvconform.faults.plants import Patch, Planted

_UTILS = "vllm.v1.attention.backends.utils"
RESOLVE = f"{_UTILS}:resolve_kv_cache_layout"
WORKER_RPC = "vllm.v1.worker.worker_base:WorkerBase.set_kv_cache_layout"
FAMILY = "vllm backends"
# The backend the guarding checks run against: a real vLLM backend that imports on a CPU host
# (KV-V5's: one whose customize_spec repacks the page unconditionally).
BACKEND = plants.VLLM_PLAIN  # vllm.CPU_ATTN
REPACKING = "vllm.ROCM_ATTN"


def _ignores_env(original: Any) -> Any:
    """Resolution run as if ``$VLLM_KV_CACHE_LAYOUT`` were unset."""
    def resolve_kv_cache_layout(*args: Any, **kwargs: Any) -> Any:
        with run_env.variable_set("VLLM_KV_CACHE_LAYOUT", None):
            return original(*args, **kwargs)
    return resolve_kv_cache_layout


def _missized(original: Any) -> Any:
    """``customize_spec`` whose packed content is one byte per head short of the data."""
    def customize_spec(cls: Any, spec: Any) -> Any:
        out = original.__func__(cls, spec) if hasattr(original, "__func__") else original(spec)
        content = getattr(out, "state_content_bytes", None)
        if content is None:
            return out
        return dataclasses.replace(out, state_content_bytes=content - 1)
    return classmethod(customize_spec)


def _planted(name: str, clause: str, what: str, patch: Patch, backend: str) -> Planted:
    return Planted(name, (clause,), what, (patch,), backend=backend, family=FAMILY)


RESOLUTION_IGNORES_ENV = _planted(
    "resolution_ignores_env_layout", "KV-V3", "the engine core resolves as if "
    "VLLM_KV_CACHE_LAYOUT were unset", Patch(RESOLVE, _ignores_env), BACKEND)
CUSTOMIZE_MISSIZES_PAGE = _planted(
    "customize_spec_missizes_page", "KV-V5", "ROCM_ATTN's customize_spec packs each head "
    "group one byte short of its K or V data",
    Patch("vllm.v1.attention.backends.rocm_attn:RocmAttentionBackend.customize_spec",
          _missized), REPACKING)

V_FAULTS: dict[str, Planted] = {
    plant.name: plant
    for plant in (RESOLUTION_IGNORES_ENV, CUSTOMIZE_MISSIZES_PAGE)}
for _plant in V_FAULTS.values():  # declared once, here: the registry reads plants.PLANTED
    plants.declare(_plant.name, _plant.clauses, _plant.what, *_plant.patches,
                   backend=_plant.backend, cases=_plant.cases, family=_plant.family)

# --- KV-V4: production's worker, rewritten in the worker process ------------------------
# A worker process never sees this process's patches: the fault is a source rewrite applied
# there (``adapters/source_rewrite.py``), named by reference as KV-A's controls are
# (``check_kv_v4(..., control=WORKER_IGNORES_RPC_REF)``), and one of
# ``worker_faults.REGRESSIONS`` (and the registry) so ``$KVCONFORM_WORKER_FAULT`` seeds it.
WORKER_IGNORES_RPC = Regression(
    WORKER_RPC, "acknowledges the set_kv_cache_layout RPC and records nothing",
    rewrite=functools.partial(
        DropStatements, lambda node: is_call_to(node, "record_kv_cache_layout")))
WORKER_IGNORES_RPC_NAME = "worker_ignores_layout_rpc"
WORKER_IGNORES_RPC_REF = f"{__name__}:WORKER_IGNORES_RPC"
