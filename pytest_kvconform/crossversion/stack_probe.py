"""This environment's serving stack, for a release matrix's leg: its versions, and whether
vLLM and vllm-omni's control plane import the way the suite imports them.

Run in the leg's environment as ``python -m pytest_kvconform.crossversion.stack_probe``;
it prints one line, ``kvconform-probe: {json}`` (importing vLLM prints its own lines around
it).  A vLLM that does not import makes the leg unrunnable; a vllm-omni that does not
import (a release built for another vLLM) is a note on the leg, whose vLLM-only clauses
still run.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any

from pytest_kvconform.adapters import compat, run_env
from pytest_kvconform.workers import devices

PREFIX = "kvconform-probe: "
# What the suite imports of vLLM before any clause can run.
VLLM_MODULES = ("vllm.config", "vllm.v1.kv_cache_interface")


def probe() -> dict[str, Any]:
    """Versions (metadata) and the first import error of vLLM and of vllm-omni, or None."""
    run_env.apply(run_env.DEFAULTS)  # what a run sets, so the imports behave as in one
    if not devices.visible_gpu_ids(os.environ, devices.count_gpus_without_cuda_init):
        run_env.apply(run_env.CPU_DEFAULTS)
    versions = compat.versions()
    vllm_error = None
    for name in VLLM_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:
            vllm_error = f"importing {name} fails: {type(exc).__name__}: {exc}"
            break
    return {"vllm": versions["vllm"], "vllm_omni": versions["vllm-omni"],
            "torch": versions["torch"], "vllm_error": vllm_error,
            "omni_error": compat.production_import_error() if vllm_error is None else None}


def parse(output: str) -> dict[str, Any] | None:
    """The probe's record from a process's output (its last probe line), or None."""
    for line in reversed(output.splitlines()):
        if line.startswith(PREFIX):
            try:
                found = json.loads(line[len(PREFIX):])
            except json.JSONDecodeError:
                return None
            return found if isinstance(found, dict) else None
    return None


def main() -> int:
    print(PREFIX + json.dumps(probe()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
