"""What each parameter name of a clause check is given: one mapping for both front-ends.

The clause table names a check's parameters (``clauses.Check.args``); the pytest suite
(``suite/test_table.py``, from fixtures) and :func:`pytest_kvconform.check_backend` (from
its own planning) both hand :func:`arguments` the same :class:`Sources`, so a check is
called alike from either.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pytest_kvconform.contract.records import BackendUnderTest, Case

# The parameter names a check may take.
NAMES = ("backend", "need", "need_backend", "layout", "case", "device", "workers", "worker",
         "workers_device", "workers_factory", "memory_fraction")


@dataclass(frozen=True)
class Sources:
    """What one check call is about: the backend (or the seam's need), the layout, the
    case, the device, the KV-A workers (``KvWorkers``; None where no check needs them)."""

    who: BackendUnderTest | bool | None = None
    layout: str | None = None
    case: Case | None = None
    device: str = "cpu"
    kv_workers: Any = None
    memory_fraction: float = 0.0

    @classmethod
    def of(cls, values: Mapping[str, Any], **fields: Any) -> Sources:
        """From a suite test's fixture values (``kv_need`` else ``kv_backend``, ``kv_layout``,
        ``kv_case``, ``kv_device``, ``kv_workers``); ``fields`` set the rest or override."""
        who = values["kv_need"] if "kv_need" in values else values.get("kv_backend")
        return cls(**{"who": who, "layout": values.get("kv_layout"),
                      "case": values.get("kv_case"), "device": values.get("kv_device", "cpu"),
                      "kv_workers": values.get("kv_workers"), **fields})


def argument(name: str, sources: Sources) -> Any:
    """The value of the check parameter ``name``."""
    if name in ("backend", "need"):
        return sources.who
    if name == "need_backend":
        from pytest_kvconform.checks.layout import seam_backend

        assert isinstance(sources.who, bool), sources.who
        return seam_backend(sources.who)
    if name in ("workers", "workers_factory"):
        kv_workers, case = sources.kv_workers, sources.case
        assert kv_workers is not None and case is not None

        def ranks() -> Any:
            return kv_workers.for_world_size(case.world_size)

        return ranks() if name == "workers" else ranks
    if name == "worker":
        return sources.kv_workers.for_world_size(1)
    if name == "workers_device":
        return sources.kv_workers.device
    if name in ("layout", "case", "device", "memory_fraction"):
        return getattr(sources, name)
    raise KeyError(f"no check parameter {name!r} (known: {', '.join(NAMES)})")


def arguments(names: Sequence[str], sources: Sources) -> list[Any]:
    """:func:`argument` for each of ``names``, in order."""
    return [argument(name, sources) for name in names]
