"""pytest-xdist glue: the controller assigns each worker a device through ``workerinput``.

Kept in a class registered only when xdist is loaded (as pytest-randomly does), so the
xdist-only hooks never meet a pytest without xdist.  The controller counts GPUs without
creating a CUDA context; each worker then applies its device with
``devices.apply_worker_device`` in its own ``pytest_configure``.

Call ``register_xdist_hooks(config)`` from the plugin's ``pytest_load_initial_conftests``
(early enough for xdist to ask us how many workers ``-n auto`` means) and again from
``pytest_configure`` (idempotent; covers xdist loaded later).  Only local ``popen``
workers are meaningful: GPU ids are the controller host's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from pytest_kvconform.workers import forkserver
from pytest_kvconform.workers.devices import (
    WORKERINPUT_DEVICE,
    WORKERINPUT_GPU_IDS,
    DeviceError,
    DeviceRequest,
    WorkerDevice,
    assign_devices,
    count_gpus_without_cuda_init,
    parse_device_option,
    visible_gpu_ids,
)

PLUGIN_NAME = "kvconform-xdist"


def _option(config: Any, name: str, default: Any) -> Any:
    """Read an option tolerantly: the CLI value, else (``kv_*`` only) the ini key of the
    same name, else ``default`` -- also when the lead's options are not registered."""
    try:
        value = config.getoption(name, None)
    except (AttributeError, ValueError):
        value = None
    if value is None and name.startswith("kv_"):
        try:
            value = config.getini(name)
        except (AttributeError, ValueError, KeyError):
            value = None
    return default if value is None or value == "" else value


def _is_worker(config: Any) -> bool:
    return hasattr(config, "workerinput")


def is_controller(config: Any) -> bool:
    """This process hands the tests to xdist workers and runs none itself: true from
    configure on (xdist registers its ``dsession`` on the same options, read here)."""
    return planned_worker_count(config) > 0 and not _is_worker(config)


def _active(config: Any) -> bool:
    """Devices are only assigned for ``--kv-conformance``: other runs keep their GPUs."""
    return bool(_option(config, "kv_conformance", False))


def device_request(config: Any) -> DeviceRequest:
    """The ``--kv-device`` request, a bad value surfacing as a usage error."""
    try:
        return parse_device_option(str(_option(config, "kv_device", "auto")))
    except DeviceError as exc:
        raise pytest.UsageError(str(exc)) from exc


def planned_worker_count(config: Any) -> int:
    """How many xdist workers the controller will start (0: not distributing).

    Mirrors xdist's own ``--tx`` parsing (``-n 3`` becomes ``3 x popen``) so the
    oversubscription error comes at configure time, before any worker is spawned.
    """
    if _option(config, "dist", "no") == "no" or _option(config, "collectonly", False):
        return 0
    count = 0
    for spec in _option(config, "tx", []) or []:
        head, star, _ = str(spec).partition("*")
        count += int(head) if star and head.isdigit() else 1
    return count


def compute_assignment(config: Any, num_workers: int, gpu_ids: list[str]) -> list[WorkerDevice]:
    """The controller's per-worker devices for this config, or a usage error."""
    try:
        return assign_devices(
            num_workers,
            device_request(config),
            gpu_ids,
            bool(_option(config, "kv_allow_oversubscribe", False)),
        )
    except DeviceError as exc:
        raise pytest.UsageError(str(exc)) from exc


class KvXdistHooks:
    """Controller-side hooks; GPU discovery is injectable so tests use fake device lists."""

    def __init__(
        self,
        environ: Mapping[str, str] | None = None,
        count_gpus: Callable[[], int] = count_gpus_without_cuda_init,
    ) -> None:
        self._environ = environ
        self._count_gpus = count_gpus
        self._gpu_ids: list[str] | None = None
        self._assignment: list[WorkerDevice] | None = None
        self._slots: dict[str, int] = {}

    def gpu_ids(self) -> list[str]:
        """The controller's visible GPU ids, counted once."""
        if self._gpu_ids is None:
            environ = os.environ if self._environ is None else self._environ
            self._gpu_ids = visible_gpu_ids(environ, self._count_gpus)
        return self._gpu_ids

    def assignment(self, config: Any, num_workers: int) -> list[WorkerDevice]:
        """Computed once per worker count; every node reads from the same list."""
        if self._assignment is None or len(self._assignment) != num_workers:
            self._assignment = compute_assignment(config, num_workers, self.gpu_ids())
        return self._assignment

    def pytest_configure(self, config: pytest.Config) -> None:
        """Fail fast: a usage error before any worker starts (historic, so runs late too)."""
        if _active(config) and not _is_worker(config):
            num_workers = planned_worker_count(config)
            if num_workers:
                self.assignment(config, num_workers)

    @pytest.hookimpl(optionalhook=True, tryfirst=True)
    def pytest_xdist_auto_num_workers(self, config: pytest.Config) -> int | None:
        """``-n auto`` with ``--kv-conformance``: one worker per usable GPU."""
        if _is_worker(config) or not _active(config):
            return None
        request = device_request(config)
        if request.kind == "cpu":
            return None
        gpu_ids = self.gpu_ids()
        if not gpu_ids:
            return None  # cpu run (auto) or a usage error raised at configure (cuda)
        return 1 if request.index is not None else len(gpu_ids)

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        """Hand one worker its device before it is started."""
        if not _active(node.config):
            return
        num_workers = int(node.workerinput.get("workercount") or 1)
        devices = self.assignment(node.config, num_workers)
        slot = self._take_slot(str(node.gateway.id), len(devices))
        node.workerinput[WORKERINPUT_DEVICE] = devices[slot].to_workerinput()
        node.workerinput[WORKERINPUT_GPU_IDS] = list(self.gpu_ids())
        shared = forkserver.share()  # the CPU KV-A workers' server (plugin.py started it)
        if shared is not None:
            node.workerinput[forkserver.SHARE_KEY] = shared

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: object | None) -> None:
        """Free a crashed worker's slot, so its replacement gets the same device."""
        self._slots.pop(str(node.gateway.id), None)

    def _take_slot(self, worker_id: str, size: int) -> int:
        if worker_id in self._slots:
            return self._slots[worker_id]
        used = set(self._slots.values())
        free = [i for i in range(size) if i not in used]
        slot = free[0] if free else len(self._slots) % size
        self._slots[worker_id] = slot
        return slot


def register_xdist_hooks(config: pytest.Config) -> None:
    """Register ``KvXdistHooks`` once, and only when xdist is loaded."""
    manager = config.pluginmanager
    if manager.hasplugin("xdist") and manager.get_plugin(PLUGIN_NAME) is None:
        manager.register(KvXdistHooks(), PLUGIN_NAME)
