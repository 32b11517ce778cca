"""KV-S: stride derivation, per layout x spec case (generated from the clause table)."""

from __future__ import annotations

from pytest_kvconform.suite.generate import generate

GENERATED = generate(globals())
