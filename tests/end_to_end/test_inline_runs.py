"""Inline pytester runs reuse this process's serving stack instead of importing it anew.

pytester drops what an inline run imported once the run is over; ``tests/conftest.py``
imports it before pytester's snapshot instead.  A module missing there costs every
inline run its import again (and a serving-stack module may not survive a second
import): this test names any that a representative run still imports.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import needs_omni

# Written at the end of the inline run, before pytester drops its imports.
RECORD_MODULES = '''
import json
import sys
from pathlib import Path


def pytest_unconfigure(config):
    Path("modules.json").write_text(json.dumps(sorted(sys.modules)))
'''
HEAVY = ("torch", "vllm", "vllm_omni", "hypothesis")


@needs_omni
def test_an_inline_run_imports_no_serving_stack_module_anew(pytester: pytest.Pytester,
                                                            kv_run) -> None:
    before = set(sys.modules)
    pytester.makeconftest(RECORD_MODULES)
    kv_run("-k", "(bf16_h8 or kv_l) and not kv_a", "--kv-backend", "TORCH_SDPA")
    after = json.loads((pytester.path / "modules.json").read_text())
    anew = [m for m in after if m not in before and m.partition(".")[0] in HEAVY]
    assert anew == [], "add to tests/conftest.py LAZY_IMPORTS: " + ", ".join(anew)
