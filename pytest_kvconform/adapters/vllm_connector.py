"""A stand-in KV connector whose required layout the harness chooses (KV-V3's connector
scenario): production's resolution asks a connector through ``KVConnectorFactory`` for
``get_required_kvcache_layout``, and this is the connector it finds, named on the config's
``kv_transfer_config`` as an external module, the way a connector repository plugs in.

Imported only by vLLM's connector factory (it imports vLLM at import time).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

# The key of ``kv_connector_extra_config`` naming the layout the connector requires.
LAYOUT_KEY = "kvconform_required_layout"


class KvConformConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """Requires the layout its config names; does nothing else (never instantiated)."""

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        value = extra.get(LAYOUT_KEY)
        return None if value is None else str(value)
