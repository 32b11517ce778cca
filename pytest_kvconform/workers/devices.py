"""Which device this process, or each xdist worker, owns.

Stdlib only at import: the xdist controller decides devices *before* any worker touches
CUDA, and must never create a CUDA context itself, so GPUs are counted with ``nvidia-smi``
and torch is consulted only lazily (and only to refuse a too-late assignment).
Everything here is a pure function over fake-able inputs (environment mapping, GPU
counter), so the assignment is unit-tested without a GPU.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal

DeviceKind = Literal["auto", "cpu", "cuda"]

# Keys this plugin adds to xdist's ``workerinput`` (controller -> worker).
WORKERINPUT_DEVICE = "kvconform_device"
WORKERINPUT_GPU_IDS = "kvconform_gpu_ids"

OVERSUBSCRIBE_OPTION = "--kv-allow-oversubscribe"
DEVICE_OPTION = "--kv-device"

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


class DeviceError(ValueError):
    """A device request that cannot be honoured; the message is meant for the user."""


@dataclass(frozen=True)
class DeviceRequest:
    """The parsed ``--kv-device`` value; ``index`` is a position among visible GPUs."""

    kind: DeviceKind
    index: int | None = None

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"


@dataclass(frozen=True)
class WorkerDevice:
    """One xdist worker's device; ``visible`` is its ``CUDA_VISIBLE_DEVICES`` entry."""

    kind: Literal["cpu", "cuda"]
    visible: str | None = None

    @property
    def torch_device(self) -> str:
        """The device string inside the worker, whose only visible GPU is index 0."""
        return "cuda:0" if self.kind == "cuda" else "cpu"

    def to_workerinput(self) -> dict[str, Any]:
        """Plain dict: ``workerinput`` crosses execnet, which only carries builtins."""
        return {"kind": self.kind, "visible": self.visible}

    @classmethod
    def from_workerinput(cls, value: Mapping[str, Any]) -> WorkerDevice:
        kind = value.get("kind")
        visible = value.get("visible")
        if kind == "cpu":
            return cls("cpu", None)
        if kind == "cuda" and isinstance(visible, str) and visible:
            return cls("cuda", visible)
        raise DeviceError(f"malformed {WORKERINPUT_DEVICE} in xdist workerinput: {value!r}")


def parse_device_option(value: str) -> DeviceRequest:
    """``auto`` | ``cpu`` | ``cuda`` | ``cuda:N`` -> DeviceRequest; anything else is refused."""
    m = _DEVICE_RE.match(value.strip().lower()) if isinstance(value, str) else None
    if m is None or (m.group(2) is not None and m.group(1) != "cuda"):
        raise DeviceError(
            f"{DEVICE_OPTION}: invalid value {value!r}; expected auto, cpu, cuda or cuda:N "
            "(N a visible GPU index >= 0)"
        )
    index = int(m.group(2)) if m.group(2) is not None else None
    return DeviceRequest(m.group(1), index)  # type: ignore[arg-type]


def visible_gpu_ids(environ: Mapping[str, str], count_gpus: Callable[[], int]) -> list[str]:
    """GPU ids this process may use, as ``CUDA_VISIBLE_DEVICES`` entries.

    Honours an outer ``CUDA_VISIBLE_DEVICES`` (ids are kept opaque, so UUIDs and MIG
    names pass through); like CUDA, a negative entry ends the list, so ``-1`` and ``''``
    mean no GPU.  Unset: ``0 .. count_gpus()-1``.
    """
    raw = environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return [str(i) for i in range(max(0, count_gpus()))]
    ids: list[str] = []
    for entry in raw.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        ids.append(entry)
    return ids


NVIDIA_SMI_TIMEOUT_S = 10.0


def nvidia_smi(*args: str, timeout_s: float = NVIDIA_SMI_TIMEOUT_S) -> str | None:
    """``nvidia-smi``'s output for ``args``; None when it is absent, fails or hangs.

    The one probe of the driver (device counting here, the report's environment):
    a subprocess, so nothing here can create a CUDA context.
    """
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, *args], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def count_gpus_without_cuda_init(timeout_s: float = NVIDIA_SMI_TIMEOUT_S) -> int:
    """Number of NVIDIA GPUs per ``nvidia-smi -L``; 0 when it is absent or fails.

    A subprocess, not torch: the xdist controller must not create a CUDA context (its
    workers would then inherit nothing useful and the controller would hold memory).
    """
    out = nvidia_smi("-L", timeout_s=timeout_s)
    if out is None:
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def _gpu_pool(request: DeviceRequest, gpu_ids: list[str]) -> list[str]:
    """The GPU ids a request may use; empty means CPU.  Refuses impossible CUDA requests."""
    if request.kind == "cpu":
        return []
    if request.kind == "auto":
        return list(gpu_ids)
    if not gpu_ids:
        raise DeviceError(f"{DEVICE_OPTION} {request} requested but no CUDA device is visible")
    if request.index is None:
        return list(gpu_ids)
    if request.index >= len(gpu_ids):
        raise DeviceError(
            f"{DEVICE_OPTION} {request}: only {len(gpu_ids)} CUDA device(s) visible "
            f"(CUDA_VISIBLE_DEVICES ids {','.join(gpu_ids)})"
        )
    return [gpu_ids[request.index]]


def assign_devices(
    num_workers: int,
    request: DeviceRequest,
    gpu_ids: list[str],
    allow_oversubscribe: bool,
) -> list[WorkerDevice]:
    """One device per xdist worker: a distinct GPU each, or CPU for all.

    More workers than GPUs is a usage error unless oversubscription is allowed, because
    two workers sharing a GPU silently halve each one's free memory (KV-A6 sizes from it).
    """
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    pool = _gpu_pool(request, gpu_ids)
    if not pool:
        return [WorkerDevice("cpu") for _ in range(num_workers)]
    if num_workers > len(pool) and not allow_oversubscribe:
        raise DeviceError(
            f"{num_workers} xdist workers but {len(pool)} CUDA device(s) available to "
            f"{DEVICE_OPTION} {request} (ids {','.join(pool)}): use -n {len(pool)} or -n auto "
            f"for one worker per GPU, or pass {OVERSUBSCRIBE_OPTION} to share GPUs round robin"
        )
    return [WorkerDevice("cuda", pool[i % len(pool)]) for i in range(num_workers)]


def torch_device_for(request: DeviceRequest, gpu_ids: list[str]) -> str:
    """The torch device for a run without xdist (all visible GPUs stay visible)."""
    pool = _gpu_pool(request, gpu_ids)
    if not pool:
        return "cpu"
    return f"cuda:{request.index or 0}"


def _cuda_already_initialised() -> bool:
    """True when torch is imported here and has created its CUDA state (too late to pin)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:  # a broken or stub torch cannot have initialised CUDA for us
        return False


def apply_worker_device(
    workerinput: Mapping[str, Any], environ: MutableMapping[str, str] | None = None
) -> str:
    """Pin this xdist worker to its assigned GPU; returns its torch device string.

    Must run in the worker's ``pytest_configure``, before anything touches CUDA: the
    runtime reads ``CUDA_VISIBLE_DEVICES`` once, at initialisation.
    """
    env = os.environ if environ is None else environ
    raw = workerinput.get(WORKERINPUT_DEVICE)
    if raw is None:
        raise DeviceError(
            f"xdist worker {workerinput.get('workerid', '?')} got no {WORKERINPUT_DEVICE} from "
            "the controller (is pytest-kvconform active there with --kv-conformance?)"
        )
    device = WorkerDevice.from_workerinput(raw)
    if device.kind == "cuda":
        assert device.visible is not None
        if _cuda_already_initialised() and env.get("CUDA_VISIBLE_DEVICES") != device.visible:
            raise DeviceError(
                f"CUDA was initialised in xdist worker {workerinput.get('workerid', '?')} "
                f"before its device {device.visible} could be pinned"
            )
        env["CUDA_VISIBLE_DEVICES"] = device.visible
    return device.torch_device


@dataclass(frozen=True)
class Unplaceable:
    """``n`` ranks cannot be placed here; ``reason`` becomes the case's skip message."""

    reason: str

    def __str__(self) -> str:
        return self.reason


def devices_for_world_size(n: int, this_process_device: str,
                           gpu_ids: list[str]) -> list[str] | Unplaceable:
    """Device strings for ``n`` worker processes, or why they cannot be placed.

    This process's device comes first; on CUDA every rank needs its own visible GPU.
    """
    if n < 1:
        raise ValueError(f"world size must be >= 1, got {n}")
    if this_process_device == "cpu":
        return ["cpu"] * n
    if this_process_device == "cuda":
        this_process_device = "cuda:0"
    if n == 1:
        return [this_process_device]
    if n > len(gpu_ids):
        return Unplaceable(f"needs {n} CUDA devices, {len(gpu_ids)} visible")
    all_devices = [f"cuda:{i}" for i in range(len(gpu_ids))]
    rest = [d for d in all_devices if d != this_process_device]
    first = [this_process_device] if this_process_device in all_devices else []
    return (first + rest)[:n]
