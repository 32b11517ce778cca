"""A host without an accelerator: production's worker path as deep as it runs, no false failure.

``adapters/worker_seams.py`` tells from torch's own report (never from an error message)
that the host has no accelerator for the worker's device, and then leaves out the one step
of ``DiffusionWorker``'s constructor that needs one (vLLM's ``MemorySnapshot`` measurement).
Here: that classification against a simulated torch, against the real ``MemorySnapshot``
on this host, and a KV-A run in a process whose torch reports an accelerator (the
registry's CUDA build on this GPU-less host) that the worker's device does not match.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from pytest_kvconform.adapters import worker_seams
from tests.conftest import needs_omni


def _torch_reports(monkeypatch: pytest.MonkeyPatch, accelerator: str | None,
                   available: bool) -> None:
    import torch

    current = None if accelerator is None else torch.device(accelerator)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: current)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: available)


@pytest.mark.parametrize(("accelerator", "available", "device", "gap"), [
    ("cuda", False, "cpu", "accelerator cuda (not available), and the worker's device is cpu"),
    ("cuda", True, "cpu", "accelerator cuda (available), and the worker's device is cpu"),
    (None, False, "cpu", "no accelerator, and the worker's device is cpu"),
    ("cuda", True, "cuda:0", None),
])
def test_the_gap_is_read_from_torchs_report(monkeypatch: pytest.MonkeyPatch,
                                            accelerator: str | None, available: bool,
                                            device: str, gap: str | None) -> None:
    _torch_reports(monkeypatch, accelerator, available)
    found = worker_seams.accelerator_gap(device)
    assert found == (None if gap is None else f"this host's torch reports {gap}")


def _raised_in(module: str) -> BaseException:
    namespace: dict[str, Any] = {"__name__": module}
    exec("def measure():\n    raise ValueError('any text at all')\n", namespace)
    try:
        namespace["measure"]()
    except ValueError as exc:
        return exc
    raise AssertionError("unreachable")


def test_a_host_limit_is_torchs_accelerator_api_failing_for_a_device_the_host_lacks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """By the failing frame's module and torch's report, not by the message."""
    _torch_reports(monkeypatch, "cuda", False)
    limit = worker_seams.host_limit(_raised_in("torch.accelerator.memory"), "cpu")
    assert limit is not None and "torch.accelerator.memory" in limit
    assert "accelerator cuda (not available)" in limit
    wrapped = RuntimeError("production wrapped it")
    wrapped.__cause__ = _raised_in("torch.cuda.memory")
    assert worker_seams.host_limit(wrapped, "cpu") is not None
    assert worker_seams.host_limit(_raised_in("vllm_omni.diffusion.worker"), "cpu") is None
    _torch_reports(monkeypatch, "cuda", True)  # the host has the device's accelerator
    assert worker_seams.host_limit(_raised_in("torch.accelerator.memory"), "cuda:0") is None


SNAPSHOT = """
import torch
from vllm.utils.mem_utils import MemorySnapshot

from pytest_kvconform.adapters import worker_seams

assert worker_seams.accelerator_gap("cpu") is not None  # no GPU on this host
try:
    MemorySnapshot(device=torch.device("cpu"))
except Exception as exc:  # whatever torch raises for it
    assert worker_seams.host_limit(exc, "cpu") is not None, repr(exc)
else:
    raise AssertionError("vLLM's MemorySnapshot measured cpu")
snapshot = worker_seams._measured_where_possible(MemorySnapshot)(device=torch.device("cpu"))
assert isinstance(snapshot, MemorySnapshot) and not snapshot.auto_measure
assert (snapshot.free_memory, snapshot.total_memory) == (0, 0)
print("ok")
"""


def test_vllms_memory_snapshot_cannot_measure_cpu_here_and_the_seam_leaves_it_unmeasured(
        ) -> None:
    """The production step the constructor cannot take on this host, classified as the
    host's; the seam builds vLLM's own snapshot with ``auto_measure=False`` instead.  In a
    fresh interpreter: an in-process run earlier in the session (``check_backend``) may
    have resolved vLLM's platform to its CPU platform, on which the snapshot does measure."""
    done = subprocess.run([sys.executable, "-c", SNAPSHOT], capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), \
        done.stdout[-2000:] + done.stderr[-4000:]


def _worker_module() -> Any:
    """Production's worker module, or a skip naming why it does not import here."""
    import importlib

    try:
        return importlib.import_module("vllm_omni.diffusion.worker.diffusion_worker")
    except ImportError as exc:  # torch's CPU build: no torchvision beside it
        pytest.skip(f"production's DiffusionWorker does not import here: {exc}")


@needs_omni
def test_the_seams_are_undone_and_never_stacked() -> None:
    worker = _worker_module()
    original = worker.MemorySnapshot
    with worker_seams.seams():
        seamed = worker.MemorySnapshot
        assert seamed is not original and seamed.kvconform_seam
        with worker_seams.seams():
            assert worker.MemorySnapshot is seamed
    assert worker.MemorySnapshot is original


@needs_omni
def test_kv_a_on_a_torch_whose_accelerator_the_device_does_not_match_fails_nothing(
        ) -> None:
    """The registry's torch (a CUDA build) on this GPU-less host reports accelerator cuda,
    not available; the KV-A workers' device is cpu.  Production's worker constructor cannot
    complete there; KV-A drives production's executors and worker below that one step,
    passes, and every result says which path ran and why."""
    import torch

    from pytest_kvconform import api
    from pytest_kvconform.adapters import entry_points

    current = torch.accelerator.current_accelerator()
    if current is None or entry_points.entry_point().level != entry_points.EXECUTOR:
        pytest.skip("this torch reports no accelerator, or production's DiffusionWorker does "
                    f"not import here ({entry_points.entry_point().why_not_executor}): the "
                    "mismatch this test is about needs the registry's torch build")
    assert current.type == "cuda" and not torch.accelerator.is_available()
    results = api.check_backend("FLASH_ATTN", cases=["bf16_h8", "ws2"],
                                clauses=["KV-A1", "KV-A2", "KV-A3", "KV-A5", "KV-L6"],
                                device="cpu")
    ran = [r for r in results if r.status != "skipped"]
    assert {r.status for r in ran} == {"passed"}, [(r.test, r.message) for r in results]
    assert {r.clause for r in ran} == {"KV-A1", "KV-A2", "KV-A3", "KV-A5", "KV-L6"}
    for result in (r for r in ran if r.clause != "KV-L6"):
        assert result.via is not None
        assert "DiffusionWorker.set_kv_cache_configs -> DiffusionModelRunner" in result.via
        assert ("DiffusionWorker's constructor cannot complete on this host: its init_device "
                "measures the device with vLLM's MemorySnapshot") in result.via
        assert "torch reports accelerator cuda (not available), and the worker's device " \
               "is cpu" in result.via
    topologies = {r.test: r.via for r in ran}
    assert topologies["test_kv_a2[FLASH_ATTN-bf16_h8]"].startswith(  # a process per rank
        "DiffusionExecutor.set_kv_cache_configs (the multiproc executor's RPC envelope to one "
        "KV-A worker process per rank) -> DiffusionWorker.set_kv_cache_configs")
    assert topologies["test_kv_a1[FLASH_ATTN-bf16_h8]"].startswith("UniProcDiffusionExecutor")


def test_a_rank_above_0_waits_for_rank_0s_rendezvous_store_and_no_longer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """It returns once the port accepts a connection; with nothing listening, after its
    bound, so production's own start then runs as it would have."""
    import socket
    import threading
    from types import SimpleNamespace

    server = socket.socket()
    server.bind(("localhost", 0))
    port = server.getsockname()[1]
    accepted: list[object] = []

    def listen_later() -> None:
        server.listen()
        accepted.append(server.accept()[0])

    later = threading.Timer(0.05, listen_later)
    try:
        later.start()
        worker_seams.await_rendezvous(SimpleNamespace(master_port=port), 1)
        later.join()  # returns once the wait's connection was accepted
        assert len(accepted) == 1
    finally:
        server.close()
    monkeypatch.setattr(worker_seams, "RENDEZVOUS_WAIT_S", 0.05)
    worker_seams.await_rendezvous(SimpleNamespace(master_port=port), 1)  # nothing listens
    worker_seams.await_rendezvous(SimpleNamespace(master_port=None), 1)
    worker_seams.await_rendezvous(SimpleNamespace(master_port=port), 0)  # rank 0 serves


# --- the rendezvous port ------------------------------------------------------------------


def _ephemeral_low() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def test_the_rendezvous_ports_lie_below_the_kernels_ephemeral_range() -> None:
    """Where no other socket's port can land: 200 sockets the kernel gives a port to (as
    a starting deployment's do) take none of them."""
    import socket

    ports = worker_seams.rendezvous_ports({})
    assert ports is not None and 1024 <= ports.start and ports.stop <= _ephemeral_low()
    sockets = [socket.socket() for _ in range(200)]
    try:
        for s in sockets:
            s.bind(("", 0))
        assert not [s.getsockname()[1] for s in sockets if s.getsockname()[1] in ports]
    finally:
        for s in sockets:
            s.close()


def test_each_xdist_worker_has_its_own_share_of_them() -> None:
    whole = worker_seams.rendezvous_ports({})
    shares = [worker_seams.rendezvous_ports({"PYTEST_XDIST_WORKER": f"gw{i}",
                                              "PYTEST_XDIST_WORKER_COUNT": "4"})
              for i in range(4)]
    assert whole is not None and all(share is not None for share in shares)
    seen: set[int] = set()
    for share in shares:
        assert share is not None and set(share) <= set(whole) and not set(share) & seen
        seen |= set(share)


def test_with_master_port_set_production_picks_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Production reads ``$MASTER_PORT`` before a config's own: the harness hands none."""
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert worker_seams.rendezvous_ports() is None and worker_seams.rendezvous_port() is None


def test_each_deployment_gets_the_next_free_port(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    monkeypatch.delenv("MASTER_PORT", raising=False)
    ports = worker_seams.rendezvous_ports()
    assert ports is not None
    monkeypatch.setattr(worker_seams._Cursor, "next", 0)
    first = worker_seams.rendezvous_port()
    with socket.socket() as taken:  # the next one is in use: skipped
        try:
            taken.bind(("", ports[1]))
            taken.listen()
        except OSError:
            pass  # in use already
        assert first == ports[0] and worker_seams.rendezvous_port() == ports[2]


def test_a_worker_that_ran_a_deployment_gets_the_rank_variables_as_at_its_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What production's ``init_device`` set in the process is undone: its
    ``$MASTER_PORT`` would otherwise override the next config's own port."""
    import os

    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "before")
    at_start = {name: os.environ.get(name) for name in worker_seams.RANK_ENV}
    monkeypatch.setenv("MASTER_PORT", "31001")
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    worker_seams.fresh_rank_env(at_start)
    assert "MASTER_PORT" not in os.environ and os.environ["MASTER_ADDR"] == "before"
