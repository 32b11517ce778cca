"""This machine, for the report: interpreter, serving-stack versions, host and devices.

Probed without importing torch or vLLM (distribution metadata and ``nvidia-smi``), so
the report costs nothing at the end of a run and never initialises CUDA.  The
``nvidia-smi`` call is :func:`pytest_kvconform.workers.devices.nvidia_smi`, the one device
assignment uses: one probe, one timeout.
"""

from __future__ import annotations

import os
import platform
import re
import socket
from collections.abc import Mapping
from typing import Any

from pytest_kvconform.contract.records import installed_version
from pytest_kvconform.report.schema import jsonable
from pytest_kvconform.workers.devices import nvidia_smi


def environment_info(options: Mapping[str, Any], seed: int | None) -> dict[str, Any]:
    """Versions, host and devices of this machine, probed without importing torch or vllm.

    Importing the serving stack takes tens of seconds and may initialise CUDA;
    the report only needs distribution metadata and ``nvidia-smi``.
    """
    return {
        "python": platform.python_version(),
        "torch": installed_version("torch"),
        "vllm": installed_version("vllm"),
        "vllm_omni": installed_version("vllm-omni"),
        "platform": platform.platform(),
        "devices": _probe_devices(),
        "host": socket.gethostname(),
        "options": jsonable(dict(sorted(options.items()))),
        "seed": seed,
    }


def _probe_devices() -> list[dict[str, Any]]:
    gpus = _nvidia_gpus()
    if gpus:
        return gpus
    return [{"name": "cpu", "memory_bytes": _host_memory_bytes(), "driver": None, "cuda": None}]


def _nvidia_gpus() -> list[dict[str, Any]]:
    """GPUs as ``nvidia-smi`` lists them; empty when it is absent, fails or hangs."""
    listing = nvidia_smi("--query-gpu=name,memory.total,driver_version",
                         "--format=csv,noheader,nounits")
    if listing is None:
        return []
    header = nvidia_smi() or ""
    m = re.search(r"CUDA Version:\s*([0-9.]+)", header)
    cuda = m.group(1) if m else None
    gpus = []
    for line in listing.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 3 or not fields[0]:
            continue
        name, mib, driver = fields
        try:
            memory: int | None = int(float(mib)) * 1024 * 1024
        except ValueError:
            memory = None
        gpus.append({"name": name, "memory_bytes": memory, "driver": driver or None, "cuda": cuda})
    return gpus


def _host_memory_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None
