"""``check_backend``: the conformance clauses for one backend, without pytest.

What ``check_estimator`` is to scikit-learn: the same check functions the
pytest suite runs, parametrised from the same clause table
(:mod:`pytest_kvconform.contract.clauses`), returned as :class:`CheckResult` records
instead of test outcomes.  Nothing here imports pytest; torch, vLLM and
vllm-omni are imported by the checks when they run.

    >>> from pytest_kvconform import check_backend
    >>> results = check_backend(TorchSDPABackend, clauses=["KV-L1", "KV-L2"])
    >>> [r.status for r in results]
    ['passed', 'passed']

Scope: every clause by default, KV-A included.  The clauses that stand up
production's engine (KV-L6, KV-A1..A6 and KV-V4: the table's checks that take workers)
start worker processes, which need vLLM imported (~20-40 s, overlapped; CPU workers
fork from one preloaded fork server, ``workers/pool.py``);
they are closed before ``check_backend`` returns unless a pytest
``--kv-conformance`` session in this process still holds them.  Pass
``clauses=`` to run fewer.  The per-need seam variants (``need_False`` /
``need_True``, which test the control plane rather than the backend) run only
with ``seams=True``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from pytest_kvconform.adapters import run_env
from pytest_kvconform.checks.arguments import Sources, arguments, expand
from pytest_kvconform.checks.common import run_in_child, via_recorded
from pytest_kvconform.contract import clauses as clauses_mod
from pytest_kvconform.contract.outcome_rule import harness_kind
from pytest_kvconform.contract.outcomes import (
    ClauseFailure,
    ClauseSkip,
    ErrorKind,
    HarnessError,
    SkipKind,
    Unsupported,
    describe_error,
)
from pytest_kvconform.contract.records import API_SOURCE, BackendUnderTest, Case
from pytest_kvconform.workers import budget, isolated, protocol

Status = Literal["passed", "failed", "skipped", "error"]
STATUSES: tuple[Status, ...] = ("passed", "failed", "skipped", "error")
WHO_AXES = ("backend", "need")  # the axes that say whom a run speaks for


@dataclass(frozen=True)
class CheckResult:
    """One run of one check: a clause for a backend (or a need), a layout and a case.

    ``backend`` is None for the clauses that do not depend on the backend
    (KV-S, KV-N: they check the installed vLLM / vllm-omni code), and
    ``need_False`` / ``need_True`` for the control plane's seam variants.
    ``test`` is the id the pytest suite gives the same run.  ``seeded_fault`` names
    the seeded worker fault (``$KVCONFORM_WORKER_FAULT``) its KV-A workers ran under:
    such a result speaks for the fault, not the backend, and is never ``ok``.
    """

    clause: str
    backend: str | None
    case: str | None
    layout: str | None
    status: Status
    message: str = ""
    skip_kind: SkipKind | None = None
    error_kind: ErrorKind | None = None
    test: str = ""
    duration_s: float = 0.0
    via: str | None = None  # the production entry point a KV-A check drove
    seeded_fault: str | None = None
    # An error the backend's own code caused: the call into its class that hung, ended its
    # process or ran out of memory (it speaks for the backend, whatever the clause).
    caused_by: str | None = None

    @property
    def ok(self) -> bool:
        """Passed, or skipped for a reason strict qualification forgives this clause; never
        under a seeded worker fault."""
        if self.seeded_fault is not None:
            return False
        return self.status == "passed" or (
            self.status == "skipped" and clauses_mod.skip_forgiven(self.clause, self.skip_kind))


class CheckResults(list[CheckResult]):
    """What :func:`check_backend` returns: its results, in plan order (a list), and what
    they say about the backend.  Nothing ran, nothing qualified: a backend none of whose
    own results ran (it does not import, or every clause was skipped) is never
    :attr:`qualified`, and :attr:`not_checked` says why, as a run's verdict does.
    :attr:`altered` names what of the suite's own code changed while the backend's code
    ran (the judge's integrity): then nothing is qualified either."""

    def __init__(self, results: Iterable[CheckResult] = (), altered: Sequence[str] = ()):
        super().__init__(results)
        self.altered: list[str] = list(altered)

    @property
    def not_checked(self) -> str | None:
        """``X: not checked (every clause skipped, N results; backend skip: why)``, or None
        when some result of the backend's own ran."""
        from pytest_kvconform.report.verdict import describe_uncovered, not_checked

        rows = [{"nodeid": r.test, "backend": r.backend, "clause": r.clause,
                 "status": r.status, "reason": r.message,
                 "skip_kind": r.skip_kind.value if r.skip_kind is not None else None}
                for r in self]
        found = not_checked(rows, declared_ok=False)
        return describe_uncovered(found[0]) if found else None

    @property
    def qualified(self) -> bool:
        """Every result :attr:`~CheckResult.ok`, and some result of the backend's own ran."""
        return (bool(self) and all(r.ok for r in self) and self.not_checked is None
                and not self.altered)


@dataclass(frozen=True)
class _Run:
    """One planned call: a check and the parameters it runs with."""

    clause: clauses_mod.Clause
    check: clauses_mod.Check
    who: BackendUnderTest | bool | None
    layout: str | None
    case: Case | None
    # The parameters' ids, in test-id order (``checks/arguments.expand``), as the suite's.
    ids: tuple[str, ...] = ()
    # Set when the selected cases leave this clause nothing to run on: reported, not dropped.
    no_case: str | None = None

    @property
    def backend_label(self) -> str | None:
        if isinstance(self.who, bool):
            return f"need_{self.who}"
        return self.who.name if self.who is not None else None

    @property
    def test_id(self) -> str:
        name = self.clause.test_name(self.check)
        return f"{name}[{'-'.join(self.ids)}]" if self.ids else name


def check_backend(
    backend_cls: Any,
    cases: Sequence[Case | str] | None = None,
    clauses: Iterable[str] | None = None,
    *,
    device: str = "auto",
    seams: bool = False,
    memory_fraction: float = 0.5,
    plugins: str = "production",
) -> CheckResults:
    """Run the applicable clauses against ``backend_cls``; one :class:`CheckResult` per run,
    in a :class:`CheckResults` (a list that also says whether the backend qualified, or
    was not checked, and why).

    ``backend_cls``: the backend's class (a registry member's class is tested
    under its registry name), a :class:`~pytest_kvconform.contract.records.BackendUnderTest`,
    or a string: a ``DiffusionAttentionBackendEnum`` member name or an import path.
    ``cases``: the spec cases (Case records, or ids of the shipped cases);
    None means every shipped case.  ``clauses``: clause ids (``"KV-L2"``);
    None means all.  ``device``: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
    ``plugins``: ``production`` loads the vLLM / vllm-omni general plugins first, as
    a production process does, so a registry name resolves to what production runs;
    ``none`` checks the in-tree classes (``VLLM_PLUGINS=""`` for the call).

    Bad input (an unknown clause, case or backend name, a bad device) raises one
    ValueError naming it; a failing check never raises, it is a result.
    """
    import pytest_kvconform.faults  # noqa: F401  (installs the seeded-fault hook, as a run does)
    from pytest_kvconform.adapters import omni_plugins
    from pytest_kvconform.session import integrity

    fingerprint = integrity.take(integrity.WITHOUT_PYTEST)  # before the backend's code runs

    if plugins not in ("production", "none"):
        raise ValueError(f"check_backend: plugins={plugins!r}; expected 'production' or 'none'")
    selected = clauses_mod.select(clauses)
    torch_device, gpu_ids = _device(device)
    cpu = run_env.CPU_DEFAULTS if torch_device == "cpu" else {}
    with run_env.applied(), run_env.applied(cpu):  # quiet vLLM, no kernel builds; CPU
        saved = omni_plugins.set_plugins_env(plugins)
        try:
            case_list = _cases(cases)
            omni_plugins.load_plugins(plugins)
            backend = backend_under_test(backend_cls)
            plan = list(_plan(selected, backend, case_list, seams=seams))
            with _worker_pool(plan, torch_device, gpu_ids) as kv_workers:
                results = [_execute(run, torch_device, kv_workers, memory_fraction)
                           for run in plan]
            return CheckResults(results, altered=fingerprint.changes())
        finally:
            omni_plugins.restore_plugins_env(saved)


# --- inputs ----------------------------------------------------------------------------------


def backend_under_test(backend: Any) -> BackendUnderTest:
    """A :class:`BackendUnderTest` for a class, a registry name or an import path."""
    if isinstance(backend, BackendUnderTest):
        return backend
    from pytest_kvconform.adapters import discovery, vllm_registry

    guard = isolated.probe(budget.DEFAULT_TIMEOUT_S)  # an import that hangs: never here
    if isinstance(backend, str):
        registry, note = discovery.registry_backends(guard=guard)
        registry += vllm_registry.registry_backends(
            {backend}, lambda path, name: discovery.guard_import(guard, path, name))[0]
        for found in registry:
            if found.name == backend:
                return found
        if "." not in backend and ":" not in backend:
            names = ", ".join(b.name for b in registry) or f"none ({note})"
            raise ValueError(f"check_backend: unknown backend {backend!r}; registry backends: "
                             f"{names}; or pass the class or its import path")
        refused = discovery.guard_import(guard, backend, backend)
        if refused is not None:
            return BackendUnderTest(backend, backend, API_SOURCE, error=refused)
        try:
            cls = discovery.import_object(backend)
        except Exception as exc:  # reported by every clause as the backend's skip
            return BackendUnderTest(backend, backend, API_SOURCE,
                                    error=describe_error(exc))
        return _from_class(cls)
    if not isinstance(backend, type):
        raise ValueError(f"check_backend: expected a backend class, a BackendUnderTest or a "
                         f"name, got {backend!r}")
    return _from_class(backend)


def _from_class(cls: type) -> BackendUnderTest:
    """The registry's record when ``cls`` is a registry member's class, else a new one."""
    from pytest_kvconform.adapters import compat, discovery

    if compat.omni_installed():
        registry, _ = discovery.registry_backends(guard=isolated.probe(budget.DEFAULT_TIMEOUT_S))
        for found in registry:
            if found.cls is cls:
                return found
    from pytest_kvconform.adapters import vllm_registry

    family = vllm_registry.FAMILY if vllm_registry.is_attention_backend(cls) else "diffusion"
    return BackendUnderTest(cls.__name__, f"{cls.__module__}.{cls.__qualname__}", API_SOURCE,
                            cls=cls, family=family)


def _cases(cases: Sequence[Case | str] | None) -> list[Case]:
    from pytest_kvconform.contract import cases as cases_mod

    if cases is not None and not isinstance(cases, str):
        for record in cases:  # held to a case file's limits
            if isinstance(record, Case):
                try:
                    cases_mod.validate_case(record)
                except cases_mod.CaseFileError as exc:
                    raise ValueError(f"check_backend: {exc}") from None
    if cases is not None and all(isinstance(c, Case) for c in cases):
        return [c for c in cases if isinstance(c, Case)]
    shipped = cases_mod.load_cases()
    if cases is None:
        return shipped
    if isinstance(cases, str):
        cases = [cases]
    by_id = {c.id: c for c in shipped}
    chosen: list[Case] = []
    for item in cases:
        if isinstance(item, Case):
            chosen.append(item)
        elif item in by_id:
            chosen.append(by_id[item])
        else:
            raise ValueError(f"check_backend: unknown case {item!r}; shipped cases: "
                             f"{', '.join(by_id)}")
    return chosen


def _device(device: str) -> tuple[str, list[str]]:
    from pytest_kvconform.workers import devices

    try:
        request = devices.parse_device_option(device)
    except devices.DeviceError as exc:
        raise ValueError(f"check_backend: {exc}") from None
    gpu_ids = devices.visible_gpu_ids(os.environ, devices.count_gpus_without_cuda_init)
    try:
        return devices.torch_device_for(request, gpu_ids), gpu_ids
    except devices.DeviceError as exc:
        raise ValueError(f"check_backend: {exc}") from None


# --- the plan --------------------------------------------------------------------------------


def _plan(selected: Sequence[clauses_mod.Clause], backend: BackendUnderTest,
          cases: Sequence[Case], *, seams: bool) -> Iterator[_Run]:
    """Every (check, parameters) the suite would collect for this one backend: the same
    axes, expanded by the same function (``checks/arguments.expand``), in the same order."""
    for clause in selected:
        for check in clause.checks:
            if check.seam and not seams:
                continue
            axes = expand(check.axes, backends=[backend], cases=cases, predicate=clause.cases,
                          family=check.backend_family)
            if any(a.name == "case" and not a.values for a in axes):
                reason = (f"{clause.id}: none of the selected cases "
                          f"({', '.join(c.id for c in cases) or 'none'}) is one it runs on")
                whos: list[tuple[Any, tuple[str, ...]]] = [
                    (value, (ident,)) for a in axes if a.name in WHO_AXES
                    for value, ident in zip(a.values, a.ids, strict=True)]
                for who, ids in whos or [(None, ())]:
                    yield _Run(clause, check, who, None, None, ids, reason)
                continue
            pairs = [list(zip(a.values, a.ids, strict=True)) for a in axes]
            for combination in itertools.product(*pairs):
                params = {a.name: value for a, (value, _) in zip(axes, combination, strict=True)}
                who = params["backend"] if "backend" in params else params.get("need")
                yield _Run(clause, check, who, params.get("layout"), params.get("case"),
                           tuple(ident for _, ident in combination))


@contextlib.contextmanager
def _worker_pool(plan: Sequence[_Run], device: str, gpu_ids: list[str]) -> Iterator[Any]:
    """The KV-A worker processes, held for the run and closed after it (no orphans)."""
    sizes = [r.case.world_size if r.case is not None else 1
             for r in plan if r.check.needs_workers]
    if not sizes:
        yield None
        return
    from pytest_kvconform.workers import pool as workers
    from pytest_kvconform.workers.kv_workers import KvWorkers

    workers.hold()
    try:
        kv_workers = KvWorkers(device, gpu_ids)
        kv_workers.prestart(max(sizes))  # their vLLM imports overlap the other clauses
        yield kv_workers
    finally:
        workers.release()


# --- one run -----------------------------------------------------------------------------------


def _arguments(run: _Run, device: str, kv_workers: Any, memory_fraction: float) -> list[Any]:
    return arguments(run.check.args, Sources(who=run.who, layout=run.layout, case=run.case,
                                             device=device, kv_workers=kv_workers,
                                             memory_fraction=memory_fraction))


def _execute(run: _Run, device: str, kv_workers: Any, memory_fraction: float) -> CheckResult:
    """One run as a result; a run whose KV-A workers got a seeded fault says so."""
    from pytest_kvconform.workers import fault_tally

    before = fault_tally.faulted_commands()
    result = _execute_check(run, device, kv_workers, memory_fraction)
    faults = fault_tally.faults_since(before)
    if not faults:
        return result
    note = (f"(ran under the seeded worker fault {faults[-1]!r}, ${protocol.FAULT_ENV}: this "
            "result speaks for the fault, not the backend)")
    return replace(result, seeded_fault=faults[-1],
                               message=f"{result.message} {note}".strip())


def _execute_check(run: _Run, device: str, kv_workers: Any,
                   memory_fraction: float) -> CheckResult:
    started = time.monotonic()
    skip_kind: SkipKind | None = None
    error_kind: ErrorKind | None = None
    caused_by: str | None = None
    if run.no_case is not None:  # not forgiven: the caller's selection left nothing to check
        return CheckResult(clause=run.clause.id, backend=run.backend_label, case=None,
                           layout=None, status="skipped", message=run.no_case,
                           test=run.test_id)
    via: list[str] = []
    try:
        check = run.check.resolve()
        args = _arguments(run, device, kv_workers, memory_fraction)
        with budget.per_test(budget.DEFAULT_TIMEOUT_S), \
                via_recorded() as via:  # as --kv-timeout bounds a test
            if run.check.isolated:  # as under pytest: in a child forked for it
                run_in_child(check, args, clause=run.clause.id, backend=run.backend_label)
            else:
                check(*args)
    except (ClauseSkip, Unsupported) as exc:  # an adapter's absence: the running clause's skip
        skip = exc if isinstance(exc, ClauseSkip) else exc.skip(run.clause.id)
        status: Status = "skipped"
        message = f"{skip.clause}: {skip.reason}"
        skip_kind = skip.kind
    except ClauseFailure as failure:
        status, message = "failed", str(failure)
    except HarnessError as exc:
        status, message, error_kind = "error", f"{type(exc).__name__}: {exc}", exc.kind
        caused_by = exc.caused_by
    except Exception as exc:  # the one outcome rule, as under pytest (faults.harness_kind)
        error_kind = harness_kind(exc)
        if error_kind is None:  # the installed code raised and the check let it through
            status = "failed"
            message = (f"{run.clause.id}: {type(exc).__name__}: {exc} (raised by the installed "
                       "code, not by the harness)")
        else:  # the harness's own fault, not the backend's: an error
            status = "error"
            message = f"{run.clause.id}: the check raised {type(exc).__name__}: {exc}"
    else:
        status, message = "passed", ""
    return CheckResult(
        clause=run.clause.id, backend=run.backend_label,
        case=run.case.id if run.case is not None else None, layout=run.layout,
        status=status, message=message, skip_kind=skip_kind, error_kind=error_kind,
        test=run.test_id, duration_s=round(time.monotonic() - started, 4),
        via="; ".join(via) or None, caused_by=caused_by)
