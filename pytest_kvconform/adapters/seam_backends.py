"""Stand-in backends for KV-A's seam variants: real vllm-omni backends, one per need.

The seam variants (``need_False`` / ``need_True``) exercise the block-outermost path
end to end while no in-tree backend declares it.  Production's worker registers a
paged layer only for a backend with ``supports_paged_kv``, and builds the layer
from the backend's own classes, so these are vllm-omni's SDPA backend with paged
support declared and the need answered; importable by path (``NeedTrue``), so
every process that serves a deployment resolves the same class.  Importing this
module imports no vllm-omni; the classes are built on first use.
"""

from __future__ import annotations

from typing import Any

NAMES = {False: "NeedFalse", True: "NeedTrue"}


def path(need: bool) -> str:
    """The import path of the stand-in declaring ``need``."""
    return f"{__name__}.{NAMES[need]}"


def _backend(need: bool) -> type:
    from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend

    def indexes_kv_by_block_stride(cls: type) -> bool:
        return need

    def get_name() -> str:
        return f"KVCONFORM_NEED_{str(need).upper()}"

    return type(NAMES[need], (SDPABackend,), {
        "__module__": __name__,
        "__doc__": f"vllm-omni's SDPA backend, paged, declaring indexes_kv_by_block_stride()="
                   f"{need}.",
        "supports_paged_kv": True,
        "indexes_kv_by_block_stride": classmethod(indexes_kv_by_block_stride),
        "get_name": staticmethod(get_name),
    })


def __getattr__(name: str) -> Any:
    for need, class_name in NAMES.items():
        if name == class_name:
            cls = _backend(need)
            globals()[name] = cls
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
