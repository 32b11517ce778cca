"""The suite's test ids stay as they are: xfail files, reports and CI filters name them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_kvconform.contract.records import installed_version

ROOT = Path(__file__).resolve().parents[1]
STORED = ROOT / "tests" / "data" / "collected_ids.txt"
_PINS_RE = re.compile(r"^# vllm==(\S+) vllm-omni==(\S+)$", re.MULTILINE)


def stored_ids() -> tuple[list[str], tuple[str, str]]:
    text = STORED.read_text(encoding="utf-8")
    pins = _PINS_RE.search(text)
    assert pins is not None, f"{STORED}: no '# vllm==X vllm-omni==Y' line"
    ids = [line for line in text.splitlines() if line and not line.startswith("#")]
    return ids, (pins[1], pins[2])


def collect() -> list[str]:
    """The ids a fresh ``pytest --kv-conformance --collect-only`` lists (a subprocess)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--kv-conformance", "--collect-only", "-q",
         "-p", "no:cacheprovider", "-p", "no:randomly"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [line for line in proc.stdout.splitlines() if "::" in line]


def difference(stored: list[str], collected: list[str]) -> str:
    """What changed, readable: ids gone, ids new, or only the order."""
    gone = [i for i in stored if i not in set(collected)]
    new = [i for i in collected if i not in set(stored)]
    if not gone and not new:
        return "" if stored == collected else "same ids, different order"
    lines = [f"{len(gone)} ids gone, {len(new)} new (stored list: {STORED})"]
    lines += [f"  - {i}" for i in gone[:20]] + [f"  + {i}" for i in new[:20]]
    return "\n".join(lines)


def test_difference_names_what_changed() -> None:
    stored = ["a::test_kv_l1[X]", "a::test_kv_l2[X]"]
    assert difference(stored, stored) == ""
    assert difference(stored, stored[::-1]) == "same ids, different order"
    text = difference(stored, ["a::test_kv_l1[X]", "a::test_kv_l2_renamed[X]"])
    assert "1 ids gone, 1 new" in text
    assert "  - a::test_kv_l2[X]" in text and "  + a::test_kv_l2_renamed[X]" in text


def test_collected_ids_are_unchanged() -> None:
    stored, pins = stored_ids()
    installed = (installed_version("vllm"), installed_version("vllm_omni"))
    if installed != pins:
        pytest.skip(f"the stored ids are for vllm {pins[0]} + vllm-omni {pins[1]}; installed: "
                    f"vllm {installed[0]} + vllm-omni {installed[1]} (other backends)")
    assert difference(stored, collect()) == ""
