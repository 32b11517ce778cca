"""The process faults: a KV-A worker that hangs, dies or runs out of memory while adopting.

Each must end its test as a harness error naming what happened, and the run go on
(``tests/seeded/test_process.py``).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

from pytest_kvconform.adapters.fault_hook import names
from pytest_kvconform.faults.pid_marking import mark_pid

PROCESS_FAULTS = ("hang", "die", "oom")
# The seeded ``oom`` fault asks for this many times the real allocation (past any host).
OOM_FACTOR = 1 << 40


def process_fault(fault: str | None) -> None:
    """The ``hang`` and ``die`` faults, in the process that is about to adopt (a deployment's
    engine process, or a rank receiving its configs); ``oom`` is at the allocation."""
    if "hang" in names(fault):
        mark_pid("hang")
        while True:
            time.sleep(3600)
    if "die" in names(fault):
        os.write(2, b"kvconform: seeded fault 'die': SIGKILL mid-command\n")
        os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def oversized_allocation(fault: str | None) -> Iterator[None]:
    """``oom``: the runner's ``init_kv_cache`` first asks the allocator for far too much."""
    if "oom" not in names(fault):
        yield
        return
    module: Any = importlib.import_module("vllm_omni.diffusion.diffusion_kv.model_runner_backend")
    original = module.init_kv_cache

    def init_kv_cache(forward_context: Any, kv_cache_config: Any, device: Any, *args: Any,
                      **kwargs: Any) -> Any:
        import torch

        asked = sum(int(t.size) for t in kv_cache_config.kv_cache_tensors) * OOM_FACTOR
        torch.empty(asked, dtype=torch.uint8, device=device)
        return original(forward_context, kv_cache_config, device, *args, **kwargs)

    module.init_kv_cache = init_kv_cache
    try:
        yield
    finally:
        module.init_kv_cache = original
