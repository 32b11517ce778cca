"""Hand-built report inputs, defined once for the report, verdict and cli tests: an
environment, backend records, result rows and a report built from them by production's
``build_report`` (so every report here passes the schema)."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from pytest_kvconform.report import build as rp

ENVIRONMENT: dict[str, Any] = {
    "python": "3.11.7", "torch": "2.13.0", "vllm": "0.30.0", "vllm_omni": "0.30.0",
    "platform": "Linux", "host": "box", "options": {}, "seed": None,
    "devices": [{"name": "cpu", "memory_bytes": None, "driver": None, "cuda": None}],
}


def environment(**changes: Any) -> dict[str, Any]:
    """:data:`ENVIRONMENT` with ``changes``."""
    return {**copy.deepcopy(ENVIRONMENT), **changes}


def backend_record(name: str = "GOOD", path: str = "m:G", source: str = "hook") -> dict[str, Any]:
    """An importable backend as the report lists it."""
    return {"name": name, "path": path, "source": source, "overridden": False,
            "importable": True, "reason": None}


def row(nodeid: str, clause: str = "KV-L1", status: str = "passed", *,
        backend: str | None = "GOOD", case: str | None = None, layout: str | None = None,
        device: str = "cpu", reason: str | None = None, duration_s: float = 0.1,
        **extra: Any) -> dict[str, Any]:
    """One result row (``extra``: ``skip_kind``, ``error_kind``, ...)."""
    return {"nodeid": nodeid, "backend": backend, "clause": clause, "case": case,
            "layout": layout, "device": device, "status": status, "reason": reason,
            "duration_s": duration_s, **extra}


def _name(backend: Any) -> str:
    return str(backend["name"] if isinstance(backend, Mapping) else backend.name)


def build(results: Sequence[Mapping[str, Any]], *, strict: bool = True,
          env: Mapping[str, Any] = ENVIRONMENT, backends: Sequence[Any] | None = None,
          options: Mapping[str, Any] | None = None, run: Mapping[str, Any] | None = None,
          interruption: str | None = None, **selection: Any) -> dict[str, Any]:
    """A report of ``results``; the selection is every collected test of ``backends``
    (``selection`` changes it: ``keyword``, ``collected``, ...)."""
    backends = [backend_record()] if backends is None else backends
    n = rp.ran_count(results)
    fields = {"backends": [_name(b) for b in backends], "collected": n, "selected": n,
              **selection}
    return rp.build_report(environment=env, backends=backends, results=results,
                           options=options or {}, strict=strict,
                           selection=rp.selection_record(**fields),
                           run=run or rp.run_record(interruption=interruption))
