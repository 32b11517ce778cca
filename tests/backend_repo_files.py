"""What a backend repository holds, written once for the tests that build one
(``end_to_end/test_backend_repo.py`` from the installed wheel, ``end_to_end/test_subjects.py``
inline)."""

from __future__ import annotations

# Subclasses of vllm-omni's SDPA backend: production's worker serves paged KV with them.
SDPA_BACKENDS = '''"""A backend repository's backends: one per registration route, and a slip."""

from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend


class HookBackend(SDPABackend):
    supports_paged_kv = True  # production's worker serves paged KV with it

    @classmethod
    def get_name(cls) -> str:
        return "MY_HOOK_ATTN"


class EntryPointBackend(SDPABackend):
    supports_paged_kv = True

    @classmethod
    def get_name(cls) -> str:
        return "MY_EP_ATTN"


class SlipBackend(SDPABackend):
    """A real slip: the declaration written as an instance method."""

    supports_paged_kv = True

    @classmethod
    def get_name(cls) -> str:
        return "MY_SLIP"

    def indexes_kv_by_block_stride(self) -> bool:
        return False


class MisnamedBackend(SDPABackend):
    """Registered as MY_MISNAMED, answers to a registry member's name."""

    supports_paged_kv = True

    @classmethod
    def get_name(cls) -> str:
        return "TORCH_SDPA"
'''

# A backend whose module, at import, rewrites the suite's check runner so that its broken
# declaration (an instance method) passes: the judge's integrity must refuse it.
JUDGE_REWRITER = '''"""Hostile: importing it replaces the suite's check runner."""

import pytest_kvconform.suite.check_call as _check_call
from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend

_run_check = _check_call.run_check


def lenient(request, check, *args, **kwargs):
    """The backend's own clauses pass unrun; the stack's run as ever."""
    if getattr(check, "__name__", "").startswith(("check_kv_l1", "check_kv_l2")):
        return None
    return _run_check(request, check, *args, **kwargs)


_check_call.run_check = lenient


class RewritesTheJudge(SDPABackend):
    supports_paged_kv = True

    @classmethod
    def get_name(cls) -> str:
        return "MY_REWRITER"

    def indexes_kv_by_block_stride(self) -> bool:
        return False
'''


def pyproject(name: str) -> str:
    """A pyproject.toml's build system and project table, for more tables to follow."""
    return f'''[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "{name}"
version = "0.1"
'''


# Backends whose own code misbehaves, each as a hostile backend repository's would: a
# declaration looping in C (it never lets go of the GIL), one that blocks, and a class that
# ends (or asks for 1 TiB in) the KV-A worker production's engine runs it in.
HOSTILE_BACKENDS = '''"""Backends whose own code hangs, holds the GIL, ends its process or asks
for 1 TiB."""

import multiprocessing
import os
import pathlib
import time

from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend


def _in_a_worker() -> bool:
    """Inside a process the run started (a KV-A worker), not the one judging."""
    return multiprocessing.parent_process() is not None


class GilHoldingBackend(SDPABackend):
    supports_paged_kv = True

    @classmethod
    def get_name(cls) -> str:
        return "HOG"  # its registered name (KV-L1)

    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        mark = os.environ.get("HOSTILE_MARK")
        if mark:
            pathlib.Path(mark).touch()
        return sum(range(10**13)) < 0  # a loop in C: the GIL is never released


class SleepingBackend(SDPABackend):
    supports_paged_kv = True

    @classmethod
    def get_name(cls) -> str:
        return "SLEEPY"  # its registered name (KV-L1)

    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        time.sleep(3600)
        return False


class ExitingBackend(SDPABackend):
    supports_paged_kv = True

    @classmethod
    def get_name(cls) -> str:
        return "EXITS"  # its registered name (KV-L1)

    @classmethod
    def get_impl_cls(cls):
        if _in_a_worker():
            os._exit(0)
        return super().get_impl_cls()


class GreedyBackend(SDPABackend):
    supports_paged_kv = True

    @classmethod
    def get_name(cls) -> str:
        return "GREEDY"  # its registered name (KV-L1)

    @classmethod
    def get_impl_cls(cls):
        if _in_a_worker():
            import torch

            torch.empty(1 << 40, dtype=torch.uint8)  # 1 TiB
        return super().get_impl_cls()
'''
