"""Environment defaults a ``--kv-conformance`` run sets while it runs, never over a user's value.

- ``VLLM_LOGGING_LEVEL=WARNING``: vLLM logs every config it builds at INFO, and the
  checks build hundreds.
- ``HUMMING_DISABLE_PARALLEL_BUILD=1``: importing vLLM imports humming (its quantised
  GEMM kernels), which then starts two background builds, each a Python process that
  imports torch and compiles a CUDA launcher.  The suite launches no humming kernel, so
  those builds only compete for the cores: 5 s of a 21 s serial run on 2 cores, more
  under xdist, where every process that imports vLLM starts its own pair (issue 12,
  benchmarks/RESULTS.md).  A serving process started later builds them when it needs them.

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
import logging
import os
import sys
from collections.abc import Iterator, Mapping

DEFAULTS: Mapping[str, str] = {
    "VLLM_LOGGING_LEVEL": "WARNING",
    "HUMMING_DISABLE_PARALLEL_BUILD": "1",
}


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
        f"{name}={DEFAULTS[name]}" for name in added)


@contextlib.contextmanager
def applied(defaults: Mapping[str, str] = DEFAULTS) -> Iterator[list[str]]:
    """:func:`apply` for the duration of a ``with`` block, a vLLM imported before it quieted
    too (:func:`loaded_vllm_quieted`)."""
    added = apply(defaults)
    try:
        with loaded_vllm_quieted(added):
            yield added
    finally:
        restore(added)


@contextlib.contextmanager
def loaded_vllm_quieted(added: list[str]) -> Iterator[None]:
    """The ``vllm`` logger at ``VLLM_LOGGING_LEVEL``'s default for the block, when this run
    set that variable and vLLM is already imported.

    vLLM reads the variable once, when it is imported: a script that imported vLLM or
    vllm-omni before calling ``check_backend`` would otherwise get an INFO line for every
    config the checks build.  vllm-omni's loggers propagate to ``vllm``'s.  Left alone
    when the user chose a level, or configures logging themselves
    (``VLLM_CONFIGURE_LOGGING=0``).
    """
    name = "VLLM_LOGGING_LEVEL"
    if name not in added or "vllm.logger" not in sys.modules or \
            os.environ.get("VLLM_CONFIGURE_LOGGING") == "0":
        yield
        return
    logger = logging.getLogger("vllm")
    before = logger.level
    logger.setLevel(os.environ[name])
    try:
        yield
    finally:
        logger.setLevel(before)


def freeze_heap() -> int:
    """Move every object the collector tracks into its permanent generation; how many."""
    gc.freeze()
    return gc.get_freeze_count()


def thaw_heap() -> None:
    """Give the frozen objects back to the collector (objects that became garbage while
    frozen are collected from then on)."""
    gc.unfreeze()
