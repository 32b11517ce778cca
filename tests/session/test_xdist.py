"""The xdist hooks (session/xdist.py): each xdist worker gets its device, with fake configs
and nodes, then in real xdist runs (no real GPU needed)."""

from __future__ import annotations

import json
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
    apply_worker_device,
)

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
