"""KV-A workers started before collection, and dropped when nothing uses them."""

from __future__ import annotations

import shutil
import types
from collections.abc import Iterator

import pytest

from pytest_kvconform.session import may_need_workers
from pytest_kvconform.session import xdist as xdist_hooks
from pytest_kvconform.workers import pool as workers


class _Config:
    def __init__(self, **option: object) -> None:
        self.option = types.SimpleNamespace(**option)

    def getoption(self, name: str, default: object = None) -> object:
        return getattr(self.option, name, default)

    def getini(self, name: str) -> object:
        raise ValueError(name)


@pytest.mark.parametrize(("keyword", "expected"), [
    ("", True),
    ("kv_a", True),
    ("kv_a3 and not seam", True),
    ("test_kv_a3 and TORCH_SDPA and perf_00", True),
    ("TORCH_SDPA", True),
    ("kv_l", True),  # KV-L6 runs production's engine in a worker
    ("kv_l1 or kv_l2", False),
    ("kv_s or kv_n", False),
    ("kv_a1", True),  # production's control plane collects specs from its workers
])
def test_may_select_adoption(keyword: str, expected: bool) -> None:
    config = _Config(keyword=keyword, dist="no")
    assert may_need_workers.may_select_adoption(config) is expected, keyword


def test_an_xdist_controller_is_told_apart() -> None:
    """It runs no test: it starts no worker, only the fork server its workers share."""
    controller = _Config(keyword="", dist="load", tx=["2*popen"], collectonly=False)
    assert xdist_hooks.is_controller(controller) is True
    assert xdist_hooks.is_controller(_Config(keyword="", dist="no")) is False


class _Handle:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def own() -> Iterator[workers.WorkerPool]:
    pool = workers.WorkerPool()
    yield pool
    shutil.rmtree(pool.workdir, ignore_errors=True)


def test_drop_speculative_closes_only_its_own(own: workers.WorkerPool) -> None:
    own.workers = {("cpu", 0): _Handle(), ("cpu", 1): _Handle()}  # type: ignore[dict-item]
    own.speculative = {("cpu", 1)}
    other, mine = own.workers[("cpu", 0)], own.workers[("cpu", 1)]
    assert own.drop_speculative() == 1
    assert mine.closed and not other.closed  # type: ignore[attr-defined]
    assert list(own.workers) == [("cpu", 0)]
    assert own.drop_speculative() == 0  # forgotten once decided


def test_drop_speculative_keeps_needed_workers(own: workers.WorkerPool) -> None:
    own.workers = {("cpu", 0): _Handle()}  # type: ignore[dict-item]
    own.speculative = {("cpu", 0)}
    assert own.drop_speculative(keep=[("cpu", 0)]) == 0
    assert not own.workers[("cpu", 0)].closed  # type: ignore[attr-defined]
