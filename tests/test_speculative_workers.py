"""KV-A workers started before collection, and dropped when nothing uses them."""

from __future__ import annotations

import types

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


def test_drop_speculative_closes_only_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = types.SimpleNamespace(workers={("cpu", 0): _Handle(), ("cpu", 1): _Handle()})
    monkeypatch.setattr(workers, "_pool", pool)
    monkeypatch.setattr(workers, "_speculative", {("cpu", 1)})
    other, mine = pool.workers[("cpu", 0)], pool.workers[("cpu", 1)]
    assert workers.drop_speculative() == 1
    assert mine.closed and not other.closed
    assert list(pool.workers) == [("cpu", 0)]
    assert workers.drop_speculative() == 0  # forgotten once decided


def test_drop_speculative_keeps_needed_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = types.SimpleNamespace(workers={("cpu", 0): _Handle()})
    monkeypatch.setattr(workers, "_pool", pool)
    monkeypatch.setattr(workers, "_speculative", {("cpu", 0)})
    assert workers.drop_speculative(keep=[("cpu", 0)]) == 0
    assert not pool.workers[("cpu", 0)].closed
