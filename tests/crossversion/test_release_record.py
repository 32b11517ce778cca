"""``kvconform release-table``: the release table and README's supported stacks, written
from a matrix run into a clone; a run of some legs updates theirs and keeps the others'."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pytest_kvconform.cli import main
from pytest_kvconform.crossversion import release_record
from pytest_kvconform.report import release_table
from pytest_kvconform.report.build import build_matrix, run_record, write_matrix
from tests.report_rows import build, environment, row

TOX_INI = """[tox]
labels =
    matrix = py311-vllm030, py311-vllm032-omni032rc1, py311-vllm034
"""
PYPROJECT = """[project]
name = "x"
[project.optional-dependencies]
omni = ["vllm==0.30.0", "vllm-omni==0.30.0", "torch==2.13.0"]
vllm032-omni032rc1 = ["vllm==0.32.0", "vllm-omni==0.32.0rc1", "torch==2.13.0"]
"""
README = f"""# x

## Supported stacks

{release_record.BEGIN}
(old)
{release_record.END}

## Install
"""
ALIAS = "k.toml:1 */KV-L8/test_kv_l8_alias"


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    root = tmp_path / "clone"
    (root / "pytest_kvconform").mkdir(parents=True)
    (root / "tox.ini").write_text(TOX_INI)
    (root / "pyproject.toml").write_text(PYPROJECT)
    (root / "README.md").write_text(README)
    return root


def _report(vllm: str, omni: str, status: str = "xfailed") -> dict[str, Any]:
    return build([row("s::test_kv_l8_alias[GOOD]", "KV-L8", status, xfail=ALIAS),
                  row("s::test_kv_l1[GOOD]")],
                 strict=False, env=environment(vllm=vllm, vllm_omni=omni, torch="2.13.0+cu130"))


def _leg(name: str, report: dict[str, Any] | None) -> dict[str, Any]:
    env = (report or {}).get("environment", {})
    return {"name": name, "description": name, "state": "ran" if report else "not built",
            "reason": None if report else "uv: no solution", "notes": [],
            "stack": {"vllm": env.get("vllm", "0.34.0"), "vllm_omni": env.get("vllm_omni"),
                      "torch": env.get("torch", "2.14.0")},
            "stack_source": "installed" if report else "requested",
            "report": f"{name}.json" if report else None, "exit_code": 0 if report else None,
            "duration_s": 1.0, "log": f"{name}.log"}


def _matrix(out: Path, reports: dict[str, dict[str, Any] | None]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for name, report in reports.items():
        if report is not None:
            (out / f"{name}.json").write_text(json.dumps(report))
    combined = build_matrix([_leg(n, r) for n, r in reports.items()],
                            {n: r for n, r in reports.items() if r is not None}, run_record())
    write_matrix(out / "matrix.json", combined)
    return out / "matrix.json"


def test_the_table_and_readme_are_written_from_the_matrix(clone: Path, tmp_path: Path,
                                                          capsys: Any) -> None:
    matrix = _matrix(tmp_path / "out", {
        "py311-vllm030": _report("0.30.0", "0.30.0"),
        "py311-vllm032-omni032rc1": _report("0.32.0", "0.32.0rc1"),
        "py311-vllm034": None})
    assert main(["release-table", str(matrix), "--root", str(clone)]) == 0
    printed = capsys.readouterr().out
    assert "kvconform: release table: py311-vllm032-omni032rc1: qualified (pre-release)\n" \
        in printed
    table = release_table.load(clone / "pytest_kvconform" / "release_table.json")
    rows = {r["leg"]: r for r in table["legs"]}
    assert list(rows) == ["py311-vllm030", "py311-vllm032-omni032rc1", "py311-vllm034"]
    assert rows["py311-vllm032-omni032rc1"]["findings"] == {"persists": 1, "fixed": 0,
                                                            "new": 0}
    assert rows["py311-vllm032-omni032rc1"]["torch"] == "2.13.0+cu130"
    assert release_table.status(rows["py311-vllm034"]) == "not built: uv: no solution"
    readme = (clone / "README.md").read_text()
    assert "(old)" not in readme and readme.endswith("## Install\n")
    assert ("| 0.32.0 | 0.32.0rc1 | 2.13.0+cu130 | `py311-vllm032-omni032rc1` | qualified "
            "(pre-release) | 1 passed, 1 xfailed | [1 persist](docs/findings-vllm-omni-0.30.md)"
            ", 0 fixed, 0 new | `[vllm032-omni032rc1]` |") in readme
    assert "| `py311-vllm030` | qualified | 1 passed, 1 xfailed |" in readme
    assert readme.count("`[omni]`") == 1


def test_a_run_of_one_leg_updates_its_row_and_keeps_the_others(clone: Path,
                                                              tmp_path: Path) -> None:
    first = _matrix(tmp_path / "one", {"py311-vllm030": _report("0.30.0", "0.30.0"),
                                       "py311-vllm032-omni032rc1": _report("0.32.0",
                                                                           "0.32.0rc1")})
    assert main(["release-table", str(first), "--root", str(clone)]) == 0
    fixed = _matrix(tmp_path / "two", {"py311-vllm032-omni032rc1": _report(
        "0.32.0", "0.32.0rc1", status="xpassed")})
    assert main(["release-table", str(fixed), "--root", str(clone)]) == 0
    rows = {r["leg"]: r for r in release_table.load(
        clone / "pytest_kvconform" / "release_table.json")["legs"]}
    assert rows["py311-vllm030"]["findings"] == {"persists": 1, "fixed": 0, "new": 0}
    assert rows["py311-vllm032-omni032rc1"]["findings"] == {"persists": 0, "fixed": 1,
                                                            "new": 0}
    assert rows["py311-vllm034"]["state"] == "not run"  # no matrix ran it yet


def test_a_clone_without_its_markers_is_one_line(clone: Path, tmp_path: Path,
                                                  capsys: Any) -> None:
    (clone / "README.md").write_text("# x\n")
    matrix = _matrix(tmp_path / "out", {"py311-vllm030": _report("0.30.0", "0.30.0")})
    assert main(["release-table", str(matrix), "--root", str(clone)]) == 2
    assert capsys.readouterr().err.startswith("kvconform: error: README.md has no release "
                                              "table between")
    assert not (clone / "pytest_kvconform" / "release_table.json").exists()
