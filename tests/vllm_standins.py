"""Stand-in vLLM attention backends (family ``vllm``) a repository might ship: subclasses
of vLLM's CPU_ATTN class, registered through the plugin's hook by ``tests/seeded/test_vllm.py``.
Imports vLLM: only a hook's import string names this module."""

from __future__ import annotations

from typing import Any

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend


class MyVllmAttn(CPUAttentionBackend):
    """Conforms: CPU_ATTN's declaration under its own name."""

    @staticmethod
    def get_name() -> str:
        return "MY_VLLM_ATTN"


class StringLayouts(MyVllmAttn):
    """Declares its layouts by name (``"LBHNC"``), not as KVCacheLayout members."""

    @staticmethod
    def get_name() -> str:
        return "BAD_VLLM_ATTN"

    @classmethod
    def supported_kv_cache_layouts(cls) -> Any:
        return ("LBHNC",)
