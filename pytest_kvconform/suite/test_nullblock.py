"""KV-N: null-block sizing, per spec case of a single cache group (generated from the
clause table)."""

from __future__ import annotations

from pytest_kvconform.suite.generate import generate

GENERATED = generate(globals())
