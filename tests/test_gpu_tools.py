"""The GPU bundle's stdlib helpers: the offline wheel installer and the report's judge."""

from __future__ import annotations

import importlib.util
import sys
import zipfile
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def _tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_install_wheels_unpacks_import_tree_and_purelib(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "demo-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("demo/__init__.py", "VALUE = 1\n")
        zf.writestr("demo-1.0.dist-info/METADATA", "Name: demo\nVersion: 1.0\n")
        zf.writestr("demo-1.0.data/purelib/extra_mod.py", "X = 2\n")
        zf.writestr("demo-1.0.data/scripts/tool", "#!/bin/sh\n")
    names = _tool("gpu_bundle_install").install_wheels(wheels, tmp_path / "site")
    assert names == ["demo-1.0-py3-none-any.whl"]
    site = tmp_path / "site"
    assert (site / "demo" / "__init__.py").read_text() == "VALUE = 1\n"
    assert (site / "extra_mod.py").exists() and (site / "demo-1.0.dist-info/METADATA").exists()
    assert not (site / "tool").exists() and not (site / "scripts").exists()


def _result(backend: str, status: str, reason: str = "") -> dict:
    return {"clause": "KV-L7", "backend": backend, "status": status, "reason": reason}


def test_report_judges_kv_l7_against_the_seeded_expectations() -> None:
    judge = _tool("gpu_report").judge_l7
    wrong = "KV-L7 violated [x]: ... first block whose output differs: logical block 0 (...)"
    rows = judge([_result("PAGED_OK", "passed"), _result("PAGED_NO_TABLE", "failed", wrong),
                  _result("PAGED_BAD_STRIDE", "passed"),
                  _result("FLASH_ATTN", "skipped", "needs vLLM's native paged kernels (...)"),
                  _result("PAGED_TRUNCATES", "failed", "forward_paged raised RuntimeError()")])
    verdict = {backend: ok for backend, _, ok, _ in rows}
    assert verdict == {"PAGED_OK": True, "PAGED_NO_TABLE": True, "PAGED_BAD_STRIDE": False,
                       "FLASH_ATTN": True, "PAGED_TRUNCATES": False}
