"""Which production worker entry point can run on this host: feature detection, once.

``executor`` (production's whole chain: executor, ``DiffusionWorker``, model runner) where
the worker imports and a platform can build diffusion attention layers; else ``runner``
(``DiffusionModelRunner.set_kv_cache_config`` and below); else none, with the reason.  Every
KV-A result names what ran (:meth:`EntryPoint.chain`).  vLLM and vllm-omni are imported
lazily.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pytest_kvconform.adapters import worker_seams

EXECUTOR = "executor"
RUNNER = "runner"
UNI = "uni"
MP = "mp"
# Not production's selection: MP with one rank per KV-A worker, the executor's calls carried
# over their pipes (``worker_seams``); names the chain of such a deployment.
PIPE = "pipe"
_MODULES = {
    EXECUTOR: "vllm_omni.diffusion.worker.diffusion_worker",
    RUNNER: "vllm_omni.diffusion.worker.diffusion_model_runner",
}


@dataclass(frozen=True)
class EntryPoint:
    """The deepest production entry point that can run on this host, and why not higher.

    ``unmeasured``: at the executor level, why ``DiffusionWorker``'s constructor cannot
    complete here (the one step ``worker_seams.seams`` leaves out), or None.
    """

    level: str  # EXECUTOR, RUNNER or "" (none)
    why_not_executor: str | None = None
    why_not_runner: str | None = None
    unmeasured: str | None = None

    def chain(self, topology: str) -> str:
        """Which production code received the configs, in words (a result's ``via``)."""
        executor = {UNI: "UniProcDiffusionExecutor", MP: "MultiprocDiffusionExecutor",
                    PIPE: "DiffusionExecutor.set_kv_cache_configs (the multiproc executor's "
                          "RPC envelope to one KV-A worker process per rank)"}[topology]
        if self.level == EXECUTOR:
            chain = (f"{executor} -> DiffusionWorker.set_kv_cache_configs -> "
                     "DiffusionModelRunner.set_kv_cache_config -> "
                     "DiffusionKVModelRunnerBackend.initialize_kv_cache")
            if self.unmeasured is None:
                return chain
            return (f"{chain} (DiffusionWorker's constructor cannot complete on this host: "
                    f"{self.unmeasured}; so it runs with that memory snapshot unmeasured, "
                    "its one accelerator step, and the configured KV budget)")
        if self.level == RUNNER:
            return ("DiffusionModelRunner.set_kv_cache_config -> "
                    "DiffusionKVModelRunnerBackend.initialize_kv_cache (DiffusionWorker and "
                    f"the executors cannot run here: {self.why_not_executor})")
        return f"nothing: no production worker entry point runs here ({self.why_not_runner})"


def reported(point: Mapping[str, Any] | None) -> EntryPoint:
    """The entry point a KV-A worker reported at start-up (``workers/child.py``, as
    :func:`dataclasses.asdict`); none where it preloaded no stack."""
    return EntryPoint(**(point or {"level": ""}))


def _import_error(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except Exception as exc:  # an optional dependency of production's worker is missing
        root: BaseException = exc
        while root.__cause__ is not None:
            root = root.__cause__
        return f"import {module} fails: {type(root).__name__}: {root}"
    return None


@functools.cache
def entry_point() -> EntryPoint:
    """Feature detection: import production's worker, else its model runner; and a platform
    that can build diffusion attention layers here.  Where the host has no accelerator for
    the worker's device, the executor level runs if the one step the constructor cannot
    take here can be left out (``worker_seams``)."""
    why_platform = _no_platform()
    why_executor = _import_error(_MODULES[EXECUTOR]) or why_platform
    if why_executor is None:
        unmeasured = worker_seams.unmeasured_reason(worker_seams.worker_device())
        missing = worker_seams.seam_missing() if unmeasured else None
        if missing is None:
            return EntryPoint(EXECUTOR, unmeasured=unmeasured)
        why_executor = (f"DiffusionWorker's constructor cannot complete on this host "
                        f"({unmeasured}), and {missing}")
    why_runner = _import_error(_MODULES[RUNNER]) or why_platform
    if why_runner is None:
        return EntryPoint(RUNNER, why_not_executor=why_executor)
    return EntryPoint("", why_not_executor=why_executor, why_not_runner=why_runner)


def _no_platform() -> str | None:
    """Why no Omni platform can select a diffusion attention backend here, or None."""
    try:
        from vllm_omni.platforms import current_omni_platform
    except Exception as exc:
        return f"vllm-omni's platforms do not import: {type(exc).__name__}: {exc}"
    name = type(current_omni_platform).__name__
    if name == "UnspecifiedOmniPlatform":
        return ("vllm-omni resolved no Omni platform for this host (UnspecifiedOmniPlatform, "
                "which selects no diffusion attention backend); a CPU --kv-conformance run "
                "activates the plugin's own (vllm_omni.platform_plugins entry point "
                "kvconform_cpu), unless VLLM_PLUGINS leaves it out")
    return None
