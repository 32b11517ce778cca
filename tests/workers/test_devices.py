"""Device assignment (workers/devices.py) with fake GPU lists (no real GPU needed); the xdist
hooks that hand each xdist worker its device are tests/session/test_xdist.py's."""

from __future__ import annotations

import os
import stat
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_kvconform.workers.devices import (
    WORKERINPUT_DEVICE,
    DeviceError,
    DeviceRequest,
    Unplaceable,
    WorkerDevice,
    apply_worker_device,
    assign_devices,
    count_gpus_without_cuda_init,
    devices_for_world_size,
    parse_device_option,
    torch_device_for,
    visible_gpu_ids,
)

AUTO = DeviceRequest("auto")
CPU = DeviceRequest("cpu")
CUDA = DeviceRequest("cuda")


def _no_count() -> int:
    raise AssertionError("GPUs must not be counted when CUDA_VISIBLE_DEVICES is set")


# --- parse_device_option -------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("auto", DeviceRequest("auto")),
        ("cpu", DeviceRequest("cpu")),
        ("cuda", DeviceRequest("cuda")),
        ("cuda:0", DeviceRequest("cuda", 0)),
        (" CUDA:12 ", DeviceRequest("cuda", 12)),
    ],
)
def test_parse_device_option_accepts(value: str, expected: DeviceRequest) -> None:
    assert parse_device_option(value) == expected


@pytest.mark.parametrize("value", ["", "gpu", "cuda:", "cuda:-1", "cuda:x", "cpu:0", "auto:1"])
def test_parse_device_option_names_bad_value(value: str) -> None:
    with pytest.raises(DeviceError, match="--kv-device") as info:
        parse_device_option(value)
    assert repr(value) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_device_request_str_round_trips() -> None:
    for text in ("auto", "cpu", "cuda", "cuda:3"):
        assert str(parse_device_option(text)) == text


# --- visible_gpu_ids / counting -----------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("3,5", ["3", "5"]),
        (" 3 , 5 ", ["3", "5"]),
        ("", []),
        ("-1", []),
        ("0,-1,2", ["0"]),
        ("GPU-aaaa,MIG-bbbb", ["GPU-aaaa", "MIG-bbbb"]),
    ],
)
def test_visible_gpu_ids_from_outer_env(value: str, expected: list[str]) -> None:
    assert visible_gpu_ids({"CUDA_VISIBLE_DEVICES": value}, _no_count) == expected


def test_visible_gpu_ids_counts_when_unset() -> None:
    assert visible_gpu_ids({}, lambda: 3) == ["0", "1", "2"]
    assert visible_gpu_ids({}, lambda: 0) == []


def _fake_nvidia_smi(tmp_path: Path, body: str) -> None:
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


def test_count_gpus_parses_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_nvidia_smi(
        tmp_path,
        textwrap.dedent(
            """\
            echo 'GPU 0: NVIDIA H200 (UUID: GPU-aaa)'
            echo '  MIG 1g.18gb     Device  0: (UUID: MIG-bbb)'
            echo 'GPU 1: NVIDIA H200 (UUID: GPU-ccc)'
            """
        ),
    )
    monkeypatch.setenv("PATH", str(tmp_path))
    assert count_gpus_without_cuda_init() == 2


def test_count_gpus_is_zero_without_working_nvidia_smi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert count_gpus_without_cuda_init() == 0  # absent
    _fake_nvidia_smi(tmp_path, "echo 'GPU 0: X'\nexit 9\n")
    assert count_gpus_without_cuda_init() == 0  # fails (driver/library mismatch etc.)


# --- assign_devices -------------------------------------------------------------------


def test_outer_visible_devices_give_one_gpu_per_worker() -> None:
    gpus = visible_gpu_ids({"CUDA_VISIBLE_DEVICES": "3,5"}, _no_count)
    devices = assign_devices(2, AUTO, gpus, allow_oversubscribe=False)
    assert devices == [WorkerDevice("cuda", "3"), WorkerDevice("cuda", "5")]
    assert [d.torch_device for d in devices] == ["cuda:0", "cuda:0"]


def test_more_workers_than_gpus_is_a_usage_error() -> None:
    with pytest.raises(DeviceError) as info:
        assign_devices(3, AUTO, ["3", "5"], allow_oversubscribe=False)
    message = str(info.value)
    assert "3 xdist workers" in message
    assert "2 CUDA device(s)" in message
    assert "--kv-allow-oversubscribe" in message


def test_oversubscription_when_allowed_is_round_robin() -> None:
    devices = assign_devices(3, CUDA, ["3", "5"], allow_oversubscribe=True)
    assert [d.visible for d in devices] == ["3", "5", "3"]


@pytest.mark.parametrize(("request_", "gpus"), [(CPU, ["3", "5"]), (AUTO, [])])
def test_cpu_runs_give_every_worker_cpu(request_: DeviceRequest, gpus: list[str]) -> None:
    devices = assign_devices(4, request_, gpus, allow_oversubscribe=False)
    assert devices == [WorkerDevice("cpu")] * 4
    assert {d.torch_device for d in devices} == {"cpu"}


def test_cuda_without_gpus_is_refused() -> None:
    with pytest.raises(DeviceError, match="no CUDA device is visible"):
        assign_devices(1, CUDA, [], allow_oversubscribe=True)


def test_cuda_index_selects_among_visible_gpus() -> None:
    assert assign_devices(1, DeviceRequest("cuda", 1), ["3", "5"], False) == [
        WorkerDevice("cuda", "5")
    ]
    with pytest.raises(DeviceError, match="--kv-allow-oversubscribe"):
        assign_devices(2, DeviceRequest("cuda", 1), ["3", "5"], False)
    with pytest.raises(DeviceError, match="only 2 CUDA device"):
        assign_devices(1, DeviceRequest("cuda", 2), ["3", "5"], False)


def test_zero_workers_and_negative_counts() -> None:
    assert assign_devices(0, AUTO, ["0"], False) == []
    with pytest.raises(ValueError):
        assign_devices(-1, AUTO, ["0"], False)


@pytest.mark.parametrize(
    ("request_", "gpus", "expected"),
    [
        (AUTO, ["3", "5"], "cuda:0"),
        (AUTO, [], "cpu"),
        (CPU, ["3", "5"], "cpu"),
        (CUDA, ["0"], "cuda:0"),
        (DeviceRequest("cuda", 1), ["3", "5"], "cuda:1"),
    ],
)
def test_torch_device_without_xdist(
    request_: DeviceRequest, gpus: list[str], expected: str
) -> None:
    assert torch_device_for(request_, gpus) == expected


def test_torch_device_without_xdist_refuses_missing_gpu() -> None:
    with pytest.raises(DeviceError):
        torch_device_for(CUDA, [])
    with pytest.raises(DeviceError):
        torch_device_for(DeviceRequest("cuda", 2), ["0", "1"])


# --- apply_worker_device --------------------------------------------------------------


def test_apply_worker_device_pins_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    workerinput = {
        "workerid": "gw1",
        WORKERINPUT_DEVICE: WorkerDevice("cuda", "5").to_workerinput(),
    }
    assert apply_worker_device(workerinput) == "cuda:0"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5"


def test_apply_worker_device_cpu_leaves_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    workerinput = {WORKERINPUT_DEVICE: WorkerDevice("cpu").to_workerinput()}
    assert apply_worker_device(workerinput) == "cpu"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3,5"


def test_apply_worker_device_uses_given_environ() -> None:
    env: dict[str, str] = {}
    wi = {WORKERINPUT_DEVICE: {"kind": "cuda", "visible": "7"}}
    assert apply_worker_device(wi, env) == "cuda:0"
    assert env == {"CUDA_VISIBLE_DEVICES": "7"}


@pytest.mark.parametrize(
    "workerinput",
    [
        {"workerid": "gw0"},
        {WORKERINPUT_DEVICE: {"kind": "cuda", "visible": None}},
        {WORKERINPUT_DEVICE: {"kind": "tpu"}},
    ],
)
def test_apply_worker_device_refuses_missing_or_malformed(workerinput: dict[str, Any]) -> None:
    env: dict[str, str] = {}
    with pytest.raises(DeviceError):
        apply_worker_device(workerinput, env)
    assert env == {}


def test_apply_worker_device_refuses_after_cuda_init(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_torch = SimpleNamespace(cuda=SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    env = {"CUDA_VISIBLE_DEVICES": "3,5"}
    wi = {WORKERINPUT_DEVICE: {"kind": "cuda", "visible": "5"}}
    with pytest.raises(DeviceError, match="before its device 5 could be pinned"):
        apply_worker_device(wi, env)
    assert env == {"CUDA_VISIBLE_DEVICES": "3,5"}


# --- devices_for_world_size -----------------------------------------------------------


def test_world_size_on_cpu_is_always_possible() -> None:
    assert devices_for_world_size(3, "cpu", []) == ["cpu", "cpu", "cpu"]


def test_world_size_gets_distinct_gpus_this_one_first() -> None:
    assert devices_for_world_size(1, "cuda:0", ["5"]) == ["cuda:0"]
    assert devices_for_world_size(2, "cuda:0", ["3", "5"]) == ["cuda:0", "cuda:1"]
    assert devices_for_world_size(2, "cuda:1", ["3", "5", "7"]) == ["cuda:1", "cuda:0"]
    assert devices_for_world_size(2, "cuda", ["3", "5"]) == ["cuda:0", "cuda:1"]


def test_world_size_beyond_visible_gpus_gives_skip_reason() -> None:
    # an xdist worker sees exactly its one GPU
    assert devices_for_world_size(2, "cuda:0", ["5"]) == Unplaceable(
        "needs 2 CUDA devices, 1 visible")
    with pytest.raises(ValueError):
        devices_for_world_size(0, "cpu", [])
