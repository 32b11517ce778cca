"""Start the coming KV-A tests' deployments while the tests before them run.

A deployment of production's engine is mostly its ranks starting up in the KV-A workers
(``DiffusionWorker.init_device``: ~27 process groups a rank), while the test process only
waits.  So at the start of each test the next few tests on KV-A's workers are looked at:
each one's first deployment, if it has one, is planned by running its check up to its
first ``deploy`` (``checks.adoption.planned``) and started on workers set aside for that
test (``WorkerPool.reserve``).  When the check asks for exactly that deployment it finds
it started (``workers.deployment.start``); a check that asks for anything else cancels
it, and so does the end of the test it was for: a wrong plan costs time, never a result.

The running test's own workers are set aside first (:meth:`Ahead.own`), so the tests
take their workers in their order, as without this.  Deployments then start at once:
each is handed a rendezvous port of the harness's own (``adapters/worker_seams.py``).

Only clause-table checks, not KV-A6 (which sizes its allocation from a worker's free
memory), and only on idle, ready forked workers: this never waits.

This runs between the tests, where pytest captures nothing, and planning a deployment runs
production's code here (its ``od_config`` builds vLLM configs, whose platform check may
warn): what it prints goes to the run's account of the workers' output
(``workers/worker_log.py``), not between pytest's progress dots.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from pytest_kvconform.checks import adoption
from pytest_kvconform.checks.arguments import Sources, arguments
from pytest_kvconform.contract import clauses
from pytest_kvconform.workers import deployment, pool, worker_log
from pytest_kvconform.workers.devices import Unplaceable

# Deployments started ahead at once (their workers, the running test's and one set tearing
# a deployment down fit in pool.SPARE_SETS), and how far ahead a test is looked for.
DEPTH = 2
LOOKAHEAD = 24


class _NotNow(Exception):
    """No idle, ready workers for the test now (it may be tried again later)."""


class _Never(Exception):
    """The test has no deployment to start ahead."""


class _Reserving:
    """Stands in for ``KvWorkers`` while a check is planned: reserves the ranks' workers."""

    def __init__(self, device: str, gpu_ids: Sequence[str], test: str) -> None:
        self.device, self.gpu_ids, self.test = device, list(gpu_ids), test
        self.handles: list[pool.WorkerHandle] = []

    def for_world_size(self, n: int) -> list[pool.WorkerHandle]:
        placements = pool.rank_placements(n, self.device, self.gpu_ids)
        if isinstance(placements, Unplaceable):
            raise _Never  # the test skips
        handles = pool.pool().reserve(placements, self.test)
        if handles is None:
            raise _NotNow
        self.handles = handles
        return handles


class Ahead:
    """One run's deployments started ahead (the tests looked at, once each)."""

    def __init__(self, device: str, gpu_ids: Sequence[str], items: Sequence[pytest.Item]) -> None:
        self.device, self.gpu_ids = device, list(gpu_ids)
        self.items = items
        self.positions = {item.nodeid: i for i, item in enumerate(items)}
        self.looked_at: set[str] = set()

    @contextlib.contextmanager
    def running(self, item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
        """Around one test: it gets what was started for it, the coming tests' deployments
        start, and what it did not claim is cancelled after it."""
        pool.running(item.nodeid)
        try:
            with worker_log.captured():  # production's config building: outside pytest's capture
                if self.own(item):
                    self.prepare(self.upcoming(item, nextitem))
            yield
        finally:
            pool.running(None)
            with worker_log.captured():
                self.done(item)

    def own(self, item: pytest.Item) -> bool:
        """The running test's workers first: those it takes without anything started
        ahead (the idle set ``WorkerPool.get`` would pick now), set aside for it, so the
        coming tests' deployments never take them.  False where it needs workers and none
        are idle and ready now: then nothing starts ahead of it, and it takes its own as
        ever (the tests take their workers in their order)."""
        if "kv_workers" not in getattr(item, "fixturenames", ()):
            return True  # runs in this process
        if item.nodeid in self.looked_at:
            return True  # started ahead for it, or it deploys nothing first
        try:
            planned = self._plan(item)
        except _NotNow:
            return False
        if planned is None:
            return False  # on the workers its own way (KV-A6)
        plan, handles = planned
        if plan is None:
            pool.pool().unreserve(handles)
        return True

    def upcoming(self, item: pytest.Item, nextitem: pytest.Item | None) -> Sequence[pytest.Item]:
        """The tests after ``item`` in the run's order; under xdist (whose order is its
        own) only ``nextitem``."""
        position = self.positions.get(item.nodeid)
        after = [] if position is None else self.items[position + 1:position + 1 + LOOKAHEAD]
        following = [nextitem] if nextitem is not None else []
        return after if after[:1] == following else following

    def prepare(self, upcoming: Sequence[pytest.Item]) -> int:
        """At the start of a test, with the tests after it: start what the first of them
        on KV-A's workers deploy first, up to :data:`DEPTH` waiting; how many started."""
        started = 0
        for item in upcoming[:LOOKAHEAD]:
            if deployment.started_ahead() >= DEPTH:
                break
            if item.nodeid in self.looked_at:
                continue
            try:
                started += self._start(item)
            except _NotNow:
                break  # no idle workers now: the tests after it wait too
            self.looked_at.add(item.nodeid)
        return started

    def _start(self, item: pytest.Item) -> bool:
        if item.get_closest_marker("skip") is not None:
            return False
        planned = self._plan(item)
        if planned is None:
            return False
        plan, handles = planned
        with contextlib.suppress(Exception):  # only a head start is lost; the test runs as ever
            if plan is not None and plan.start_ahead(item.nodeid):
                return True
        pool.pool().unreserve(handles)
        return False

    def _plan(self, item: pytest.Item) -> tuple[Any, list[pool.WorkerHandle]] | None:
        """``item``'s first deployment, planned on workers set aside for it: (the plan, or
        None where its check would skip, fail or deploy nothing first; those workers).
        None where it runs no clause-table check on KV-A's workers; :class:`_NotNow`,
        with nothing set aside, where no idle workers are ready now."""
        found = _check_and_params(item)
        if found is None:
            return None
        check, params = found
        reserving = _Reserving(self.device, self.gpu_ids, item.nodeid)
        try:
            sources = Sources.of(params, device=self.device, kv_workers=reserving)
            plan = adoption.planned(check.resolve(), *arguments(check.args, sources))
        except _NotNow:
            pool.pool().unreserve(reserving.handles)
            raise
        except Exception:  # the test itself reports it
            plan = None
        return plan, reserving.handles

    @staticmethod
    def done(item: pytest.Item) -> None:
        """After a test: what was started or set aside for it and not claimed is
        cancelled."""
        deployment.cancel_ahead(item.nodeid)
        pool.unreserve_test(item.nodeid)

    @staticmethod
    def finish() -> None:
        """At the end of the run: cancel whatever no test claimed."""
        deployment.cancel_ahead()


@functools.cache
def _checks() -> dict[str, tuple[clauses.Clause, clauses.Check]]:
    return clauses.check_names()


def _check_and_params(item: pytest.Item) -> tuple[Any, dict[str, Any]] | None:
    """The clause-table check ``item`` runs and its parameters, if it runs on KV-A's workers."""
    entry = _checks().get(getattr(item, "originalname", ""))
    params = getattr(getattr(item, "callspec", None), "params", None)
    if entry is None or params is None:
        return None
    _, check = entry
    if not check.needs_workers or "workers_factory" in check.args:
        return None
    return check, params
