"""The smallest honest model for KV-A: a few vllm-omni ``Attention`` layers, nothing else.

Production's diffusion worker registers paged KV layers by walking its loaded
pipeline for vllm-omni ``Attention`` modules that opt into Scheduler-managed KV
(``paged_kv_cache_role``).  This pipeline is loaded through vllm-omni's own
custom-pipeline route (``custom_pipeline_args={"pipeline_class": PIPELINE}``,
``load_format="custom_pipeline"``): each layer selects its attention backend the
way any model's layers do, from the ``diffusion_attention_config`` the user set,
so its ``attn_backend`` is the backend under test and the worker's per-layer
checks see the real class.

The geometry comes from ``od_config.custom_pipeline_args[GEOMETRY_KEY]``
(:func:`geometry_args`), the spec case's layers, heads, head size and dtype.  With
several ranks each rank holds its own slice of the model, as pipeline-parallel
stages do (rank ``r`` the layers ``r * L .. r * L + L - 1``, its rank read from
``RANK``, which production's worker sets): every rank-local config then names
that rank's layers, so a worker holding another rank's config shows.
"""

from __future__ import annotations

import os
from typing import Any

from pytest_kvconform.contract.records import Case

PIPELINE = "pytest_kvconform.adapters.tiny_pipeline.KvConformPipeline"
GEOMETRY_KEY = "kvconform_geometry"
PAGED_ROLE = "self"


def layer_name(index: int) -> str:
    """The canonical prefix of layer ``index`` (as the other clauses name layers)."""
    return f"model.layers.{index}.attn"


def rank_of(od_config: Any) -> int:
    """This process's rank in the deployment (``RANK``, set by the worker), 0 alone."""
    return int(os.environ.get("RANK", "0")) if (od_config.num_gpus or 1) > 1 else 0


def geometry_args(case: Case) -> dict[str, Any]:
    """What the pipeline reads from ``custom_pipeline_args`` to build the case's layers."""
    return {"num_layers": case.num_layers, "num_heads": case.num_kv_heads,
            "num_kv_heads": case.num_kv_heads, "head_size": case.head_size,
            "dtype": case.dtype}


def __getattr__(name: str) -> Any:
    """``KvConformPipeline`` is built on first use: importing this module imports no torch."""
    if name == "KvConformPipeline":
        cls = _pipeline_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _pipeline_class() -> type:
    import torch
    from torch import nn
    from vllm_omni.diffusion.attention.layer import Attention

    class KvConformPipeline(nn.Module):  # type: ignore[misc]
        """``num_layers`` paged self-attention layers of the case's geometry."""

        def __init__(self, *, od_config: Any, **_: Any) -> None:
            super().__init__()
            geometry = dict((od_config.custom_pipeline_args or {})[GEOMETRY_KEY])
            dtype = getattr(torch, geometry["dtype"])
            head_size = int(geometry["head_size"])
            count = int(geometry["num_layers"])
            first = count * rank_of(od_config)
            self.layers = nn.ModuleList(
                Attention(num_heads=int(geometry["num_heads"]), head_size=head_size,
                          causal=False, softmax_scale=head_size ** -0.5,
                          num_kv_heads=int(geometry["num_kv_heads"]), prefix=layer_name(i),
                          paged_kv_cache_role=PAGED_ROLE, paged_kv_cache_dtype=dtype)
                for i in range(first, first + count))

        # Nothing to load: attention layers carry no weights, and the pipeline names no
        # checkpoint (vllm-omni's loader reads both).
        weights_sources: tuple[Any, ...] = ()

        def load_weights(self, weights: Any) -> set[str]:
            for _name, _tensor in weights:
                raise ValueError(f"the KV-A pipeline has no weight named {_name!r}")
            return set()

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("the KV-A pipeline only registers attention layers; it never "
                               "runs a forward pass")

    KvConformPipeline.__module__ = __name__
    KvConformPipeline.__qualname__ = "KvConformPipeline"
    return KvConformPipeline
