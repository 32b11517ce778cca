"""KV-V: vLLM's own attention backends (family ``vllm``), per backend (generated from the
clause table)."""

from __future__ import annotations

from pytest_kvconform.suite.generate import generate

GENERATED = generate(globals())
