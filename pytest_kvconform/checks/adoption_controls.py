"""KV-A4's own negative control: production's worker side with adoption skipped, on purpose.

The check deploys with this regression applied (``control=SKIP_ADOPTION_REF``) to see that
``init_kv_cache`` then refuses the unresolved layout.  It reaches the processes that host
production as a reference (``module:name``) through ``adapters/fault_hook.py``, which
imports this module there; the seeded faults reuse it (``faults/worker_faults.py``).
"""

from __future__ import annotations

import ast
import functools

from pytest_kvconform.adapters.source_rewrite import DropStatements, Regression, is_call_to

RUNNER_BACKEND = "vllm_omni.diffusion.diffusion_kv.model_runner_backend"


def is_adoption(node: ast.AST) -> bool:
    """The runner's ``adopt_kv_cache_layout(...)`` statement."""
    return is_call_to(node, "adopt_kv_cache_layout")


SKIP_ADOPTION = Regression(f"{RUNNER_BACKEND}:DiffusionKVModelRunnerBackend.initialize_kv_cache",
                           "no longer adopts the control plane's layout",
                           rewrite=functools.partial(DropStatements, is_adoption))
# How a deployment names it (a command and an environment variable carry it).
SKIP_ADOPTION_REF = f"{__name__}:SKIP_ADOPTION"
