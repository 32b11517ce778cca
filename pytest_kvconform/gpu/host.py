"""Is this a host the GPU checks can run on, and what does it have?

The only module of the GPU checks that calls CUDA.  The decision itself
(:func:`refusal`) takes plain values, so the CPU tests drive every branch of it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pytest_kvconform.adapters import paged_drivers, run_env

NEEDS = "the GPU checks need a CUDA host with vLLM installed with its compiled kernels"


class Refused(Exception):
    """This host cannot run the GPU checks; the message is the one line to print."""


@dataclass(frozen=True)
class GpuDevice:
    index: int
    name: str
    total_bytes: int


@dataclass(frozen=True)
class GpuHost:
    """What the checks run on: torch's view of the CUDA devices."""

    torch: str
    cuda: str | None
    devices: tuple[GpuDevice, ...]

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "devices": [asdict(d) for d in self.devices]}  # JSON's shape


def refusal(*, torch_version: str | None, cuda_available: bool, device_count: int,
            kernels_missing: str | None) -> str | None:
    """Why the GPU checks cannot run here (one line), or None when they can."""
    if torch_version is None:
        return f"torch is not installed; {NEEDS}"
    if not cuda_available or device_count < 1:
        return (f"torch {torch_version} sees no CUDA device (torch.cuda.is_available() is "
                f"{cuda_available}, {device_count} device(s)); {NEEDS}")
    if kernels_missing is not None:
        return f"vLLM's compiled kernels cannot be loaded here: {kernels_missing}; {NEEDS}"
    return None


def probe() -> GpuHost:
    """torch's CUDA devices, once vLLM's compiled kernels are known to load; else
    :class:`Refused`.  Creates no CUDA context: the checks' own processes get the memory."""
    try:
        import torch
    except ImportError:
        torch = None
    version = None if torch is None else str(torch.__version__)
    available = torch is not None and bool(torch.cuda.is_available())
    count = int(torch.cuda.device_count()) if available else 0
    missing = None
    if available and count:
        with run_env.applied(), run_env.captured_output():  # vLLM's import-time messages
            missing = paged_drivers.native_kernels_missing()
    why = refusal(torch_version=version, cuda_available=available, device_count=count,
                  kernels_missing=missing)
    if why is not None:
        raise Refused(why)
    assert torch is not None
    devices = tuple(GpuDevice(i, str(p.name), int(p.total_memory))
                    for i, p in ((i, torch.cuda.get_device_properties(i)) for i in range(count)))
    return GpuHost(torch=str(version), cuda=torch.version.cuda, devices=devices)


def free_memory(index: int) -> int:
    """Free bytes on CUDA device ``index`` now (creates this process's context there)."""
    import torch

    free, _total = torch.cuda.mem_get_info(index)
    return int(free)
