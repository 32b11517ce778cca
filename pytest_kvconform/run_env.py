"""Environment defaults a ``--kv-conformance`` run sets while it runs, never over a user's value.

- ``VLLM_LOGGING_LEVEL=WARNING``: vLLM logs every config it builds at INFO, and the
  checks build hundreds.
- ``HUMMING_DISABLE_PARALLEL_BUILD=1``: importing vLLM imports humming (its quantised
  GEMM kernels), which then starts two background builds, each a Python process that
  imports torch and compiles a CUDA launcher.  The suite launches no humming kernel, so
  those builds only compete for the cores: 5 s of a 21 s serial run on 2 cores, more
  under xdist, where every process that imports vLLM starts its own pair (issue 12,
  benchmarks/RESULTS.md).  A serving process started later builds them when it needs them.

On a CPU run (:data:`CPU_DEFAULTS`), also the platforms production's diffusion worker
needs there: ``VLLM_TARGET_DEVICE=cpu`` (vLLM's own switch to its CPU platform, which
vLLM's CPU build selects by itself) and ``KVCONFORM_CPU_OMNI_PLATFORM=1``, which
activates the plugin's CPU Omni platform (``omni_cpu_platform.py``; vllm-omni ships
none for CPU, and the entry point stays inert in any process without it).

Set before anything imports vLLM, so the fork server, xdist workers and KV-A workers
inherit them; restored at the end of the run.

Also :func:`freeze_heap` / :func:`thaw_heap`: after collection, the objects the serving
stack's import left behind (~940,000 tracked by the garbage collector) are moved out of
its reach for the tests, so a full collection (one during the suite, and pytest's own two
at the end of the run) no longer walks them: 0.3-0.4 s each on 2 cores (issue 12).  They
are handed back when the run ends, before the process exits: the interpreter's final
collections find what they always did, and a pytester run leaves nothing frozen.

Stdlib only.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator, Mapping

DEFAULTS: Mapping[str, str] = {
    "VLLM_LOGGING_LEVEL": "WARNING",
    "HUMMING_DISABLE_PARALLEL_BUILD": "1",
}
CPU_PLATFORM_ENV = "KVCONFORM_CPU_OMNI_PLATFORM"  # omni_cpu_platform.ENV (same layer, kept apart)
CPU_DEFAULTS: Mapping[str, str] = {
    "VLLM_TARGET_DEVICE": "cpu",
    CPU_PLATFORM_ENV: "1",
}
_ALL: Mapping[str, str] = {**DEFAULTS, **CPU_DEFAULTS}


def apply(defaults: Mapping[str, str] = DEFAULTS) -> list[str]:
    """Set each default the environment lacks; return the names set (for :func:`restore`)."""
    added = [name for name in defaults if name not in os.environ]
    for name in added:
        os.environ[name] = defaults[name]
    return added


def restore(added: list[str]) -> None:
    """Remove what :func:`apply` set."""
    for name in added:
        os.environ.pop(name, None)


def header_line(added: list[str]) -> str | None:
    """The run header's account of what this run set (None when it set nothing)."""
    if not added:
        return None
    return "kvconform: environment set for this run: " + ", ".join(
        f"{name}={_ALL[name]}" for name in added)


@contextlib.contextmanager
def applied(defaults: Mapping[str, str] = DEFAULTS) -> Iterator[list[str]]:
    """:func:`apply` for the duration of a ``with`` block."""
    added = apply(defaults)
    try:
        yield added
    finally:
        restore(added)


def freeze_heap() -> int:
    """Move every object the collector tracks into its permanent generation; how many."""
    gc.freeze()
    return gc.get_freeze_count()


def thaw_heap() -> None:
    """Give the frozen objects back to the collector (objects that became garbage while
    frozen are collected from then on)."""
    gc.unfreeze()
