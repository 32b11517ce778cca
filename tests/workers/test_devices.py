"""Device assignment for xdist workers, with fake GPU lists (no real GPU needed)."""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_kvconform.session.xdist import (
    PLUGIN_NAME,
    KvXdistHooks,
    planned_worker_count,
    register_xdist_hooks,
)
from pytest_kvconform.workers.devices import (
    WORKERINPUT_DEVICE,
    WORKERINPUT_GPU_IDS,
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


# --- KvXdistHooks with fake config and nodes --------------------------------------------


class FakeConfig:
    """Only what the hooks read: ``getoption(name, default)`` and ``getini(name)``."""

    def __init__(self, ini: dict[str, Any] | None = None, **options: Any) -> None:
        self.options = {"kv_conformance": True, **options}
        self.ini = ini or {}

    def getoption(self, name: str, default: Any = None) -> Any:
        return self.options.get(name, default)

    def getini(self, name: str) -> Any:
        if name not in self.ini:
            raise ValueError(f"unknown configuration value: {name!r}")
        return self.ini[name]


def _node(config: FakeConfig, worker_id: str, count: int) -> SimpleNamespace:
    return SimpleNamespace(
        config=config,
        gateway=SimpleNamespace(id=worker_id),
        workerinput={"workerid": worker_id, "workercount": count},
    )


def _hooks(cvd: str | None = "3,5", count: int = 0) -> KvXdistHooks:
    env = {} if cvd is None else {"CUDA_VISIBLE_DEVICES": cvd}
    return KvXdistHooks(environ=env, count_gpus=lambda: count)


def test_configure_node_hands_each_worker_its_gpu() -> None:
    hooks, config = _hooks("3,5"), FakeConfig()
    nodes = [_node(config, f"gw{i}", 2) for i in range(2)]
    for node in nodes:
        hooks.pytest_configure_node(node)
    assert [n.workerinput[WORKERINPUT_DEVICE] for n in nodes] == [
        {"kind": "cuda", "visible": "3"},
        {"kind": "cuda", "visible": "5"},
    ]
    assert all(n.workerinput[WORKERINPUT_GPU_IDS] == ["3", "5"] for n in nodes)
    # and the worker side turns that into its own CUDA_VISIBLE_DEVICES
    env: dict[str, str] = {"CUDA_VISIBLE_DEVICES": "3,5"}
    assert apply_worker_device(nodes[1].workerinput, env) == "cuda:0"
    assert env["CUDA_VISIBLE_DEVICES"] == "5"


def test_configure_node_oversubscription_is_usage_error_unless_allowed() -> None:
    with pytest.raises(pytest.UsageError, match="--kv-allow-oversubscribe"):
        _hooks("3,5").pytest_configure_node(_node(FakeConfig(), "gw0", 3))
    hooks, config = _hooks("3,5"), FakeConfig(kv_allow_oversubscribe=True)
    nodes = [_node(config, f"gw{i}", 3) for i in range(3)]
    for node in nodes:
        hooks.pytest_configure_node(node)
    assert [n.workerinput[WORKERINPUT_DEVICE]["visible"] for n in nodes] == ["3", "5", "3"]


def test_configure_node_cpu_and_inactive() -> None:
    hooks, config = _hooks("3,5"), FakeConfig(kv_device="cpu")
    node = _node(config, "gw0", 5)
    hooks.pytest_configure_node(node)
    assert node.workerinput[WORKERINPUT_DEVICE] == {"kind": "cpu", "visible": None}
    inactive = _node(FakeConfig(kv_conformance=False), "gw0", 5)
    _hooks("3,5").pytest_configure_node(inactive)
    assert WORKERINPUT_DEVICE not in inactive.workerinput


def test_ini_values_apply_when_cli_leaves_options_unset() -> None:
    ini = {"kv_conformance": True, "kv_device": "cpu", "kv_allow_oversubscribe": False}
    node = _node(FakeConfig(ini, kv_conformance=None, kv_device=None), "gw0", 3)
    _hooks("3,5").pytest_configure_node(node)
    assert node.workerinput[WORKERINPUT_DEVICE] == {"kind": "cpu", "visible": None}
    cli_wins = _node(FakeConfig({"kv_device": "cpu"}, kv_device="cuda:1"), "gw0", 1)
    _hooks("3,5").pytest_configure_node(cli_wins)
    assert cli_wins.workerinput[WORKERINPUT_DEVICE] == {"kind": "cuda", "visible": "5"}


def test_bad_device_option_is_usage_error() -> None:
    with pytest.raises(pytest.UsageError, match="'gpu'"):
        _hooks().pytest_configure_node(_node(FakeConfig(kv_device="gpu"), "gw0", 1))


def test_replacement_worker_inherits_crashed_workers_gpu() -> None:
    hooks, config = _hooks("3,5"), FakeConfig()
    gw0, gw1 = _node(config, "gw0", 2), _node(config, "gw1", 2)
    hooks.pytest_configure_node(gw0)
    hooks.pytest_configure_node(gw1)
    hooks.pytest_testnodedown(gw1, error="crashed")
    gw2 = _node(config, "gw2", 2)
    hooks.pytest_configure_node(gw2)
    assert gw2.workerinput[WORKERINPUT_DEVICE]["visible"] == "5"


def test_gpus_counted_once_when_env_unset() -> None:
    calls: list[int] = []

    def count() -> int:
        calls.append(1)
        return 2

    hooks, config = KvXdistHooks(environ={}, count_gpus=count), FakeConfig()
    for i in range(2):
        hooks.pytest_configure_node(_node(config, f"gw{i}", 2))
    assert hooks.gpu_ids() == ["0", "1"]
    assert len(calls) == 1


@pytest.mark.parametrize(
    ("cvd", "options", "expected"),
    [
        ("3,5", {}, 2),
        ("3,5", {"kv_device": "cuda:1"}, 1),
        ("3,5", {"kv_device": "cpu"}, None),
        ("3,5", {"kv_conformance": False}, None),
        ("", {}, None),
    ],
)
def test_auto_num_workers_is_one_per_gpu(
    cvd: str, options: dict[str, Any], expected: int | None
) -> None:
    hooks = _hooks(cvd)
    assert hooks.pytest_xdist_auto_num_workers(FakeConfig(**options)) == expected  # type: ignore[arg-type]


def test_auto_num_workers_defers_in_workers() -> None:
    config = FakeConfig()
    config.workerinput = {}  # type: ignore[attr-defined]
    assert _hooks("3,5").pytest_xdist_auto_num_workers(config) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"dist": "load", "tx": ["popen"] * 3}, 3),
        ({"dist": "load", "tx": ["2*popen", "popen"]}, 3),
        ({"dist": "no", "tx": []}, 0),
        ({"dist": "load", "tx": ["popen"], "collectonly": True}, 0),
        ({}, 0),
    ],
)
def test_planned_worker_count(options: dict[str, Any], expected: int) -> None:
    assert planned_worker_count(FakeConfig(**options)) == expected


def test_configure_fails_fast_before_workers_start() -> None:
    config = FakeConfig(dist="load", tx=["3*popen"])
    with pytest.raises(pytest.UsageError, match="3 xdist workers but 2 CUDA"):
        _hooks("3,5").pytest_configure(config)  # type: ignore[arg-type]
    _hooks("3,5").pytest_configure(FakeConfig(dist="load", tx=["2*popen"]))  # type: ignore[arg-type]


def test_register_xdist_hooks_only_with_xdist_and_once() -> None:
    class Manager:
        def __init__(self, has_xdist: bool) -> None:
            self.has_xdist, self.plugins = has_xdist, {}

        def hasplugin(self, name: str) -> bool:
            return name == "xdist" and self.has_xdist

        def get_plugin(self, name: str) -> object | None:
            return self.plugins.get(name)

        def register(self, plugin: object, name: str) -> None:
            self.plugins[name] = plugin

    without, with_ = Manager(False), Manager(True)
    register_xdist_hooks(SimpleNamespace(pluginmanager=without))  # type: ignore[arg-type]
    assert without.plugins == {}
    register_xdist_hooks(SimpleNamespace(pluginmanager=with_))  # type: ignore[arg-type]
    first = with_.plugins[PLUGIN_NAME]
    register_xdist_hooks(SimpleNamespace(pluginmanager=with_))  # type: ignore[arg-type]
    assert isinstance(first, KvXdistHooks) and with_.plugins[PLUGIN_NAME] is first


# --- real xdist runs (subprocess: workers must import the plugin module) ------------------

_PLUGIN = """
import json, os
from pytest_kvconform.workers.devices import apply_worker_device
from pytest_kvconform.session.xdist import register_xdist_hooks

def pytest_addoption(parser):
    parser.addoption("--kv-conformance", action="store_true", dest="kv_conformance")
    parser.addoption("--kv-device", default="auto", dest="kv_device")
    parser.addoption("--kv-allow-oversubscribe", action="store_true",
                     dest="kv_allow_oversubscribe")

def pytest_load_initial_conftests(early_config):
    register_xdist_hooks(early_config)

def pytest_configure(config):
    register_xdist_hooks(config)
    if hasattr(config, "workerinput") and config.getoption("kv_conformance"):
        device = apply_worker_device(config.workerinput)
        with open("seen_%s.json" % config.workerinput["workerid"], "w") as f:
            json.dump([os.environ.get("CUDA_VISIBLE_DEVICES"), device,
                       config.workerinput["kvconform_gpu_ids"]], f)
"""


def _seen(pytester: pytest.Pytester) -> list[list[Any]]:
    return sorted(json.loads(p.read_text()) for p in pytester.path.glob("seen_gw*.json"))


@pytest.fixture
def xdist_project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    pytest.importorskip("xdist")
    pytester.makepyfile(kvplug=_PLUGIN, test_one="def test_one():\n    pass\n")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    # xdist's own answer to -n auto; ours (one per GPU) must win over it
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "4")
    return pytester


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """Our stand-in plugin only: the installed pytest-kvconform would clash on options."""
    return pytester.runpytest_subprocess(
        "-p", "no:kvconform", "-p", "kvplug", "-p", "no:cacheprovider", *args
    )


def test_xdist_auto_gives_one_worker_per_outer_visible_gpu(xdist_project: pytest.Pytester) -> None:
    result = _run(xdist_project, "--kv-conformance", "-n", "auto")
    assert result.ret == 0, result.stdout.str()
    assert _seen(xdist_project) == [["3", "cuda:0", ["3", "5"]], ["5", "cuda:0", ["3", "5"]]]


def test_xdist_more_workers_than_gpus_exits_with_usage_error(
    xdist_project: pytest.Pytester,
) -> None:
    result = _run(xdist_project, "--kv-conformance", "-n", "3")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*3 xdist workers but 2 CUDA device(s)*--kv-allow-oversubscribe*"])
    assert _seen(xdist_project) == []


def test_xdist_cpu_run_with_two_workers(xdist_project: pytest.Pytester) -> None:
    result = _run(xdist_project, "--kv-conformance", "--kv-device", "cpu", "-n", "2")
    assert result.ret == 0, result.stdout.str()
    assert _seen(xdist_project) == [["3,5", "cpu", ["3", "5"]]] * 2
