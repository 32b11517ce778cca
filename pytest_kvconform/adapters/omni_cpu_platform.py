"""The Omni platform a CPU run serves diffusion on: vllm-omni ships none for CPU.

vllm-omni resolves ``current_omni_platform`` from its built-in detectors (CUDA,
ROCm, NPU, XPU, MUSA) and the ``vllm_omni.platform_plugins`` entry points.  On a
host with none of those accelerators it falls back to ``UnspecifiedOmniPlatform``,
which cannot select a diffusion attention backend, so production's own diffusion
model runner cannot build an attention layer there.  This module is a real
``vllm_omni.platform_plugins`` entry point of the plugin's own
(``kvconform_cpu``), loaded the way production loads platforms, and it activates
only inside a ``--kv-conformance`` run on CPU (the run sets :data:`ENV`, and
vLLM's own CPU platform with ``VLLM_TARGET_DEVICE=cpu``), never in a deployment
that merely has the plugin installed.

The platform is vllm-omni's ``OmniPlatform`` interface on vLLM's own
``CpuPlatform``: device handling is vLLM's; what is added is backend selection
through vllm-omni's registry (the backend a user selects, overrides honoured) and
vLLM's CPU buffer shim (``vllm.v1.worker.cpu.shm``, what vLLM's CPU worker imports
so the GPU model-runner utilities allocate unpinned host buffers) before
production's paged-KV block tables are built.
"""

from __future__ import annotations

import os
from typing import Any

ENV = "KVCONFORM_CPU_OMNI_PLATFORM"
ENTRY_POINT = "kvconform_cpu"
QUALNAME = "pytest_kvconform.adapters.omni_cpu_platform.CpuOmniPlatform"
DEFAULT_BACKEND = "TORCH_SDPA"


def activate() -> str | None:
    """The ``vllm_omni.platform_plugins`` hook: this platform during a CPU run, else None.

    It stands back for any other out-of-tree platform that activates here: vllm-omni
    accepts one, and a deployment's own platform is the one production would run.
    """
    if os.environ.get(ENV) != "1" or _another_platform():
        return None
    return QUALNAME


def _another_platform() -> bool:
    """Whether another ``vllm_omni.platform_plugins`` entry point activates here."""
    from importlib.metadata import entry_points

    allowed = os.environ.get("VLLM_PLUGINS")
    names = None if allowed is None else {n.strip() for n in allowed.split(",") if n.strip()}
    for plugin in entry_points(group="vllm_omni.platform_plugins"):
        if plugin.name == ENTRY_POINT or (names is not None and plugin.name not in names):
            continue
        try:
            if plugin.load()() is not None:
                return True
        except Exception:  # a broken detector is vllm-omni's to report, not ours
            continue
    return False


def _platform_class() -> type:
    from vllm.platforms.cpu import CpuPlatform
    from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum

    class CpuOmniPlatform(OmniPlatform, CpuPlatform):  # type: ignore[misc]
        """vllm-omni's platform interface over vLLM's CPU platform."""

        _omni_enum = OmniPlatformEnum.OOT

        @classmethod
        def get_diffusion_attn_backend_cls(cls, selected_backend: str | None, head_size: int,
                                           allow_trtllm_default: bool = True) -> str:
            """The selected backend's class path from vllm-omni's registry (overrides honoured)."""
            from vllm_omni.diffusion.attention.backends.registry import (
                DiffusionAttentionBackendEnum,
            )

            name = (selected_backend or DEFAULT_BACKEND).upper()
            return str(DiffusionAttentionBackendEnum[name].get_path())

        @classmethod
        def supports_torch_inductor(cls) -> bool:
            return False

        @classmethod
        def get_torch_device(cls, local_rank: int | None = None) -> Any:
            import torch

            return torch.device("cpu")

        @classmethod
        def get_device_count(cls) -> int:
            return 1

        @classmethod
        def set_device(cls, device: Any) -> None:
            """Every rank shares the host's one CPU device."""

        @classmethod
        def synchronize(cls) -> None:
            """CPU work is synchronous."""

        @classmethod
        def empty_cache(cls) -> None:
            """The CPU allocator keeps no cache to return."""

        @classmethod
        def is_available(cls) -> bool:
            return True

        @classmethod
        def get_free_memory(cls, device: Any = None) -> int:
            return _available_host_memory()

        @classmethod
        def get_device_memory(cls, device: Any = None) -> tuple[int, int]:
            return _available_host_memory(), int(CpuPlatform.get_device_total_memory())

        @classmethod
        def memory_reserved(cls, device: Any = None) -> int:
            return 0

        @classmethod
        def get_diffusion_kv_block_tables_cls(cls) -> type:
            _import_cpu_buffer_shim()
            return super().get_diffusion_kv_block_tables_cls()

        @classmethod
        def init_diffusion_model_runner_runtime(cls, vllm_config: Any, od_config: Any,
                                                device: Any) -> None:
            _import_cpu_buffer_shim()

    CpuOmniPlatform.__module__ = __name__
    CpuOmniPlatform.__qualname__ = "CpuOmniPlatform"
    return CpuOmniPlatform


def _import_cpu_buffer_shim() -> None:
    """vLLM's CPU worker shim: host buffers instead of pinned UVA ones, as vLLM's CPU worker."""
    import vllm.v1.worker.cpu.shm  # noqa: F401


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def __getattr__(name: str) -> Any:
    """``CpuOmniPlatform`` is built on first use: importing this module imports no vLLM."""
    if name == "CpuOmniPlatform":
        cls = _platform_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
