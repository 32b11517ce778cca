"""What a clause check runs over and is given: one expansion, one mapping, both front-ends.

The clause table names a check's parameters (``clauses.Check.args``) and so its axes
(``clauses.Check.axes``: backend or need, layout, case).  :func:`expand` gives each axis's
values and ids, once for both front-ends: the pytest suite parametrises its fixtures with
them (``session/selection.py``, the fixture of each in :data:`FIXTURE`) and
:func:`pytest_kvconform.check_backend` plans its runs from them (``api._plan``), so the
two run the same parameters under the same test ids.  Both then hand :func:`arguments`
the same :class:`Sources`, so a check is called alike from either.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pytest_kvconform.contract.clauses import AXES
from pytest_kvconform.contract.records import BackendUnderTest, Case

# The parameter names a check may take.
NAMES = ("backend", "vllm_backend", "need", "need_backend", "layout", "case", "device",
         "workers", "worker", "workers_device", "workers_factory", "memory_fraction")
# The suite fixture each parameter (and so each axis) comes from; ``request`` for what the
# session's options give.
FIXTURE: Mapping[str, str] = {
    "backend": "kv_backend", "vllm_backend": "kv_backend", "need": "kv_need",
    "need_backend": "kv_need",
    "layout": "kv_layout", "case": "kv_case", "device": "kv_device",
    "workers": "kv_workers", "worker": "kv_workers", "workers_device": "kv_workers",
    "workers_factory": "kv_workers", "memory_fraction": "request"}
# The seam's two needs, and their ids.
NEEDS = (False, True)


@dataclass(frozen=True)
class Axis:
    """One parameter axis of a check: its name (:data:`~pytest_kvconform.contract.clauses.AXES`),
    its values and their ids, in order."""

    name: str
    values: tuple[Any, ...]
    ids: tuple[str, ...]

    @property
    def fixture(self) -> str:
        return FIXTURE[self.name]


def axis(name: str, *, backends: Sequence[BackendUnderTest], cases: Sequence[Case],
         predicate: Callable[[Case], bool] | None = None, family: str | None = None) -> Axis:
    """The values of axis ``name``: the backends (those of ``family``, when given: a
    check's ``clauses.Check.backend_family``), the two needs, the six layouts, or the
    cases ``predicate`` selects (all of them when it is None)."""
    if name == "backend":
        picked = tuple(b for b in backends if family is None or b.family == family)
        return Axis(name, picked, tuple(b.name for b in picked))
    if name == "need":
        return Axis(name, NEEDS, tuple(f"need_{n}" for n in NEEDS))
    if name == "layout":
        from pytest_kvconform.adapters.compat import LAYOUT_NAMES

        return Axis(name, tuple(LAYOUT_NAMES), tuple(LAYOUT_NAMES))
    if name == "case":
        chosen = tuple(c for c in cases if predicate is None or predicate(c))
        return Axis(name, chosen, tuple(c.id for c in chosen))
    raise KeyError(f"no parameter axis {name!r} (known: {', '.join(AXES)})")


def expand(names: Sequence[str], *, backends: Sequence[BackendUnderTest],
           cases: Sequence[Case], predicate: Callable[[Case], bool] | None = None,
           family: str | None = None) -> list[Axis]:
    """:func:`axis` for each of ``names``, in test-id order (:data:`AXES`)."""
    unknown = [n for n in names if n not in AXES]
    if unknown:
        raise KeyError(f"no parameter axis {unknown[0]!r} (known: {', '.join(AXES)})")
    return [axis(n, backends=backends, cases=cases, predicate=predicate, family=family)
            for n in AXES if n in names]


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
    if name in ("backend", "vllm_backend", "need"):
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
