"""Real vLLM attention backends for the V-clause tests: the installed classes, as discovery
hands them to the checks (``BackendUnderTest`` with ``cls`` set)."""

from __future__ import annotations

import pytest

from pytest_kvconform.contract.records import BackendUnderTest


def vllm_backend(name: str) -> BackendUnderTest:
    """The installed vLLM's ``AttentionBackendEnum`` member ``name``; the test skips if it
    does not import here."""
    name = name.removeprefix("vllm.")  # a registry name (vllm.CPU_ATTN) or the member's
    registry = pytest.importorskip("vllm.v1.attention.backends.registry")
    member = getattr(registry.AttentionBackendEnum, name, None)
    if member is None:
        pytest.skip(f"installed vLLM has no attention backend {name}")
    try:
        cls = member.get_class()
    except Exception as exc:
        pytest.skip(f"{name} does not import here: {exc}")
    return BackendUnderTest(name=name, path=f"{cls.__module__}:{cls.__qualname__}",
                            source="registry", cls=cls)
