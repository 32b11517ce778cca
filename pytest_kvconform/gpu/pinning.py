"""xdist device pinning, observed from inside each worker.

A pytest plugin for the pinning step of ``kvconform gpu-check``::

    pytest --kv-conformance -n auto -p pytest_kvconform.gpu.pinning --kv-gpu-pinning PATH

Each xdist worker records what it was given: ``CUDA_VISIBLE_DEVICES``, the devices torch
sees, and the ``kv_device`` fixture of its first test.  It hands the record to the
controller through xdist's ``workeroutput``; the controller writes them to PATH as one
JSON list, which :func:`parse_records` reads back for the verdict.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest

OPTION_DEST = "kv_gpu_pinning"
OUTPUT_KEY = "kvconform_gpu_pinning"  # the workeroutput key
_KV_DEVICE = pytest.StashKey[str]()
_TESTS = pytest.StashKey[int]()
_RECORDS = pytest.StashKey[list[dict[str, Any]]]()


class PinningError(ValueError):
    """The pinning file is not what the plugin writes; the message names what is wrong."""


@dataclass(frozen=True)
class WorkerRecord:
    """What one xdist worker saw of its devices."""

    worker: str
    cuda_visible_devices: str | None
    device_count: int
    device_name: str | None
    kv_device: str | None  # None when the worker ran no test
    tests: int
    error: str | None = None  # why the worker handed nothing back

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_FIELDS: dict[str, tuple[type, ...]] = {
    "worker": (str,), "cuda_visible_devices": (str, type(None)), "device_count": (int,),
    "device_name": (str, type(None)), "kv_device": (str, type(None)), "tests": (int,),
    "error": (str, type(None)),
}


def parse_records(raw: Any) -> list[WorkerRecord]:
    """The records of a pinning file's JSON; :class:`PinningError` naming the first
    malformed entry and field."""
    if not isinstance(raw, list):
        raise PinningError(f"expected a list of worker records, got {type(raw).__name__}")
    records = []
    for index, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise PinningError(f"record {index}: expected an object, got {type(entry).__name__}")
        unknown = sorted(set(entry) - set(_FIELDS))
        if unknown:
            raise PinningError(f"record {index}: unknown field(s) {', '.join(unknown)}")
        for name, types in _FIELDS.items():
            if name not in entry and name != "error":
                raise PinningError(f"record {index}: field {name!r} is missing")
            value = entry.get(name)
            if not isinstance(value, types) or isinstance(value, bool):
                raise PinningError(f"record {index}: field {name!r} is {value!r}, expected "
                                   f"{' or '.join(t.__name__ for t in types)}")
        records.append(WorkerRecord(**entry))
    return records


def read_records(path: Path) -> list[WorkerRecord]:
    """:func:`parse_records` of a file; a missing or unreadable one is a PinningError too."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise PinningError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise PinningError(f"{path}: not JSON: {exc}") from exc
    try:
        return parse_records(raw)
    except PinningError as exc:
        raise PinningError(f"{path}: {exc}") from exc


# --- the plugin -----------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--kv-gpu-pinning", dest=OPTION_DEST, metavar="PATH",
                     help="write each xdist worker's CUDA_VISIBLE_DEVICES, torch devices "
                     "and kv_device to PATH (JSON)")


def _wanted(config: pytest.Config) -> bool:
    return config.getoption(OPTION_DEST) is not None


@pytest.fixture(autouse=True)
def _kvconform_gpu_pinning(request: pytest.FixtureRequest) -> None:
    """Note the ``kv_device`` this worker's tests get, and count them."""
    config = request.config
    if not _wanted(config) or not hasattr(config, "workerinput"):
        return
    if _KV_DEVICE not in config.stash:
        config.stash[_KV_DEVICE] = str(request.getfixturevalue("kv_device"))
    config.stash[_TESTS] = config.stash.get(_TESTS, 0) + 1


def observe(config: pytest.Config) -> dict[str, Any]:
    """This worker's record: its environment and what torch sees there."""
    import torch

    count = int(torch.cuda.device_count())
    return WorkerRecord(
        worker=str(getattr(config, "workerinput", {}).get("workerid", "?")),
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        device_count=count,
        device_name=str(torch.cuda.get_device_name(0)) if count else None,
        kv_device=config.stash.get(_KV_DEVICE, None), tests=config.stash.get(_TESTS, 0),
    ).as_dict()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object | None) -> None:
    """xdist controller: keep what each worker handed back."""
    config = node.config
    if not _wanted(config):
        return
    record = (getattr(node, "workeroutput", None) or {}).get(OUTPUT_KEY)
    if record is None:
        worker = str((getattr(node, "workerinput", None) or {}).get("workerid", "?"))
        record = WorkerRecord(worker, None, 0, None, None, 0,
                              error=f"handed back no record ({error or 'no error given'})"
                              ).as_dict()
    config.stash.setdefault(_RECORDS, []).append(record)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A worker hands its record to the controller; the controller writes them all."""
    config = session.config
    if not _wanted(config):
        return
    output = getattr(config, "workeroutput", None)
    if output is not None:
        output[OUTPUT_KEY] = observe(config)
        return
    records: list[dict[str, Any]] = config.stash.get(_RECORDS, [])
    records.sort(key=lambda r: str(r["worker"]))
    Path(config.getoption(OPTION_DEST)).write_text(json.dumps(records, indent=1) + "\n",
                                                   encoding="utf-8")
