"""Calls into a backend's class made in a child process this one can give up on."""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from pytest_kvconform.contract.outcome_rule import harness_kind
from pytest_kvconform.contract.outcomes import (
    ClauseFailure,
    ClauseSkip,
    ErrorKind,
    HarnessError,
    SkipKind,
)
from pytest_kvconform.workers import budget, isolated
from tests import faultkit


@pytest.fixture(autouse=True)
def _forget() -> Iterator[None]:
    isolated.forget()
    yield
    isolated.forget()


def _raise(exc: BaseException) -> None:
    raise exc


def test_a_value_and_a_clause_outcome_come_back_as_they_were() -> None:
    assert isolated.call(lambda: {"need": False, "layouts": ("LBNHC", 2)}, "x") == {
        "need": False, "layouts": ("LBNHC", 2)}
    failure = ClauseFailure("KV-L1", "returned 1", backend="B", expected="bool",
                            actual=object(), problems=("returned 1",))
    with pytest.raises(ClauseFailure) as info:
        isolated.call(lambda: _raise(failure), "x")
    assert str(info.value) == str(failure) and info.value.problems == ("returned 1",)
    assert harness_kind(info.value) is None  # a clause outcome, judged in the child
    assert getattr(info.value, isolated.RAISED_AT_ATTR)[2] == "_raise"
    with pytest.raises(ClauseSkip) as skip:
        isolated.call(lambda: _raise(ClauseSkip("KV-L7", "no CUDA", SkipKind.HARDWARE)), "x")
    assert skip.value.kind is SkipKind.HARDWARE


def test_an_exception_keeps_the_kind_the_outcome_rule_gave_it_where_it_was_raised() -> None:
    """Raised by the plugin's own code: a harness fault; by anyone else's: a failure."""
    with pytest.raises(ValueError) as info:
        isolated.call(lambda: budget.refuse_if_hung(["unhashable"], "x") or
                      int("the plugin's bug"), "x")
    assert harness_kind(info.value) is None  # int() raised it, called from this test file
    with pytest.raises(ValueError) as plugin:  # a format error inside budget.describe
        isolated.call(lambda: budget.describe("not a number"), "x")  # type: ignore[arg-type]
    assert harness_kind(plugin.value) is ErrorKind.HARNESS
    assert "budget.py" in str(plugin.value.__cause__)  # the child's traceback, as the cause


def test_a_value_that_is_not_plain_data_is_the_harness_error() -> None:
    with pytest.raises(HarnessError, match="is not plain data"):
        isolated.call(threading.Lock, "x")


def test_the_parent_never_unpickles_a_global() -> None:
    """A child (a backend's code runs there) cannot make this process import or call."""
    data = pickle.dumps(("value", os.system))
    with pytest.raises(pickle.UnpicklingError, match="the child sent a global"):
        isolated._Plain(__import__("io").BytesIO(data)).load()


def test_a_call_that_holds_the_gil_is_killed_at_the_budget_and_remembered() -> None:
    before = faultkit.descendants(os.getpid())
    started = time.monotonic()
    with budget.per_test(0.5), pytest.raises(budget.WaitTimeout) as info:
        isolated.call(lambda: sum(range(10**13)), "HOG.declaration()", where="KV-L1 [backend=HOG]",
                      key=("HOG", 1), label="KV-L1")
    assert time.monotonic() - started < 10
    assert str(info.value).startswith("KV-L1 [backend=HOG]: timed out after 0.5s")
    assert info.value.caused_by == "HOG.declaration()"
    assert faultkit.wait_gone(faultkit.descendants(os.getpid()) - before) == set()
    with pytest.raises(budget.WaitTimeout, match=r"was not called again: it hung in .*KV-L1"):
        isolated.call(lambda: True, "HOG.declaration()", key=("HOG", 1))


def test_a_hang_inside_a_forked_check_names_the_announced_call() -> None:
    def check() -> None:
        isolated.call(lambda: True, "FAST.other()", where="KV-L2 [backend=X]")
        isolated.call(lambda: time.sleep(60), "SLOW.declaration()", where="KV-L2 [backend=X]",
                      key=("X", 2))

    with budget.per_test(1.0), pytest.raises(budget.WaitTimeout) as info:
        isolated.call(check, "the KV-L2 check", where="KV-L2 [backend=X]", backend_code=False)
    assert "waiting for SLOW.declaration() to return" in str(info.value)
    assert info.value.caused_by == "SLOW.declaration()"
    assert budget.hang_of(("X", 2)) is not None  # forked later, a child refuses it at once
    with budget.per_test(1.0), pytest.raises(budget.WaitTimeout, match="not called again"):
        isolated.call(check, "the KV-L2 check", where="KV-L2 [backend=X]", backend_code=False)


def test_a_slow_check_outside_any_backend_call_is_the_checks_own_timeout() -> None:
    with budget.per_test(0.5), pytest.raises(budget.WaitTimeout) as info:
        isolated.call(lambda: time.sleep(60), "the KV-L3 check", where="KV-L3 [backend=X]",
                      backend_code=False)
    assert "no call into the backend's class was running" in str(info.value)
    assert info.value.caused_by is None


def test_an_allocation_the_backends_code_cannot_get_is_an_oom_error_naming_the_bytes() -> None:
    def greedy() -> None:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                           "1099511627776 bytes. Error code 12")

    with pytest.raises(HarnessError) as info:
        isolated.call(greedy, "GREEDY.declaration()", where="KV-L1 [backend=GREEDY]")
    assert info.value.kind is ErrorKind.OOM and info.value.caused_by == "GREEDY.declaration()"
    assert "asking for 1099511627776 bytes" in str(info.value)


def test_a_child_runs_torch_after_this_process_ran_an_openmp_parallel_region() -> None:
    """libgomp's pool exists in this process only: the child runs ATen's loops inline."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        a = torch.randn(1024, 1024)
        float((a @ a).sum())  # opens a parallel region here

        def in_child() -> float:
            b = torch.randn(1024, 1024)
            return float((b @ b).sum().abs() >= 0) + torch.get_num_threads()

        with budget.per_test(120):
            assert isolated.call(in_child, "torch in a child", backend_code=False) == 2.0
    finally:
        torch.set_num_threads(threads)


@pytest.mark.delivers_signal
def test_an_interrupted_wait_kills_the_child_and_names_the_call() -> None:
    before = faultkit.descendants(os.getpid())
    timer = threading.Timer(1.0, lambda: signal.pthread_kill(
        threading.main_thread().ident or 0, signal.SIGINT))
    with faultkit.sigint_raises(), pytest.raises(KeyboardInterrupt) as info:
        timer.start()
        try:
            isolated.call(lambda: sum(range(10**13)), "HOG.declaration()",
                          where="KV-L1 [backend=HOG]", default=60)
        finally:
            timer.cancel()
    assert str(info.value).startswith("KeyboardInterrupt while KV-L1 [backend=HOG] had waited ")
    assert "for HOG.declaration()" in str(info.value)
    assert faultkit.wait_gone(faultkit.descendants(os.getpid()) - before) == set()
