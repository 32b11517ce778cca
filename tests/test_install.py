"""An install lands on a qualified stack, and the release table cannot go stale.

README's "Supported stacks" table is rendered from the shipped release table
(``pytest_kvconform/release_table.json``, written from the last matrix run by
``kvconform release-table``); the table has a row for every leg of tox.ini's ``matrix``
label, at the pins the leg's requirements ask for; each qualified row has the extra that
pins its stack in pyproject.toml, and each extra pins a qualified row.  README's install
lines, as written, resolve to the qualified stack: uv's resolver is read here
(``uv pip compile``, seconds from its cache); pip's (``pip install --dry-run --report``)
takes minutes on this host, so it runs when ``KVCONFORM_PIP_RESOLVE=1`` is set.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_kvconform.crossversion import release_record, tox_leg
from pytest_kvconform.report import release_table
from tests.paths import ROOT
from tests.wheel_env import build_wheel

README = (ROOT / "README.md").read_text(encoding="utf-8")
TABLE = release_table.load()
PINS = release_record.extra_pins(ROOT)
QUALIFIED = [row for row in TABLE["legs"] if release_table.qualified(row)]
RELEASE = "py311-vllm030"  # the stack the release is made for: `omni` installs it


def test_the_readme_table_is_the_release_table() -> None:
    """Rendered from the shipped table: regenerate with `kvconform release-table`."""
    section = "\n".join(release_record.readme_section(TABLE, ROOT))
    assert section in README, ("README's supported stacks differ from the release table: "
                               "run `kvconform release-table OUT/matrix.json`")


def _deps() -> list[tuple[set[str], str]]:
    """tox.ini's deps lines: (the factors any of which selects the line, its requirement)."""
    tox_ini = (ROOT / "tox.ini").read_text(encoding="utf-8")
    block = re.split(r"\n(?=\S)", tox_ini.split("\ndeps =\n", 1)[1], maxsplit=1)[0]
    lines = [line.strip() for line in block.splitlines() if line.strip()]
    return [(set(cond.split(",")), requirement)
            for cond, _, requirement in (line.partition(": ") for line in lines)]


def _requested(leg: str) -> dict[str, str | None]:
    """What tox installs for a leg: the requirements of every deps line its factors select."""
    factors = set(leg.split("-"))
    selected = [req for cond, req in _deps() if cond & factors]
    return tox_leg.requested_stack("\n".join(selected), ROOT)


def test_every_leg_has_its_row_at_its_pins() -> None:
    """A pin changed, or a leg added, without a matrix run since is a stale table."""
    legs = release_record.matrix_legs(ROOT)
    assert [row["leg"] for row in TABLE["legs"]] == legs
    for row in TABLE["legs"]:
        requested = _requested(row["leg"])
        have = {key: row[key] for key in release_table.STACK}
        have["torch"] = have["torch"] and have["torch"].split("+")[0]
        assert have == requested, (f"{row['leg']}: the table's last run had {have}, its "
                                   f"requirements now pin {requested}: rerun the leg")


STACK_FACTOR = re.compile(r"vllm0\d\d|omni\d{3}(?:a|b|rc)\d+")


def test_each_stack_factor_pins_from_its_own_requirements_file() -> None:
    """A stack's factor (vllm0NN, omniNNNrcN) takes its pins from requirements/<factor>.txt
    (how a leg is added: a file and a line, no code); any other file a factor adds (test
    tooling) pins no part of the stack."""
    for cond, requirement in _deps():
        if not any(STACK_FACTOR.fullmatch(f) for f in cond):
            continue
        if any(requirement == f"-r requirements/{f}.txt" for f in cond):
            continue
        pins = tox_leg.requested_stack(requirement, ROOT)
        assert pins == dict.fromkeys(release_table.STACK), (cond, requirement, pins)


def test_each_qualified_stack_has_the_extra_that_pins_it() -> None:
    installs = release_table.installs(TABLE, PINS)
    assert sorted(installs) == sorted(row["leg"] for row in QUALIFIED)
    assert installs[RELEASE] == "omni"
    qualified_pins = [{"vllm": r["vllm"], "vllm-omni": r["vllm_omni"], "torch": r["torch"]}
                      for r in QUALIFIED]
    for extra, pins in PINS.items():
        assert pins in qualified_pins, f"extra {extra!r} pins {pins}, no qualified stack"


def _readme_installs(tool: str) -> list[str]:
    """README's install lines of the built wheel, as written (``pip install "...whl[x]"``)."""
    lines = re.findall(rf"^    ({tool} install \"dist/[^\"]+\")", README, re.MULTILINE)
    assert lines, f"README's install section has no `{tool} install \"dist/...\"` line"
    return lines


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built, _ = build_wheel(tmp_path_factory.mktemp("install"))
    return built


def _target(line: str, wheel: Path, extra: str | None = None) -> str:
    """The line's requirement, with the built wheel for ``dist/...`` (and another extra)."""
    requirement = re.search(r'"dist/[^"\[]+(\[[^\]]+\])"', line)
    assert requirement is not None, line
    return f"{wheel}{f'[{extra}]' if extra else requirement.group(1)}"


def _resolved(output: str) -> dict[str, str]:
    found = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", output, re.MULTILINE))
    return {name.lower().replace("_", "-"): version for name, version in found.items()}


def _expected(row: dict[str, str | None]) -> dict[str, str | None]:
    return {"vllm": row["vllm"], "vllm-omni": row["vllm_omni"], "torch": row["torch"]}


def _uv_compile(requirement: str, tmp_path: Path) -> dict[str, str]:
    spec = tmp_path / "requirements.in"
    spec.write_text(requirement + "\n")
    done = subprocess.run(["uv", "pip", "compile", "-q", "--python-version", "3.11",
                           str(spec)], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return _resolved(done.stdout)


def test_the_readme_uv_line_resolves_to_the_release(wheel: Path, tmp_path: Path) -> None:
    (line,) = _readme_installs("uv pip")
    got = _uv_compile(_target(line, wheel), tmp_path)
    release = next(r for r in QUALIFIED if r["leg"] == RELEASE)
    assert {k: got.get(k) for k in ("vllm", "vllm-omni", "torch")} == _expected(release)


@pytest.mark.parametrize("leg", [r["leg"] for r in QUALIFIED if r["leg"] != RELEASE])
def test_each_pre_release_extra_resolves_to_its_stack(wheel: Path, tmp_path: Path,
                                                      leg: str) -> None:
    """An exact pin of a pre-release under an extra is taken without --prerelease."""
    (line,) = _readme_installs("uv pip")
    extra = release_table.installs(TABLE, PINS)[leg]
    got = _uv_compile(_target(line, wheel, extra), tmp_path)
    row = next(r for r in QUALIFIED if r["leg"] == leg)
    assert {k: got.get(k) for k in ("vllm", "vllm-omni", "torch")} == _expected(row)


@pytest.mark.skipif(os.environ.get("KVCONFORM_PIP_RESOLVE") != "1",
                    reason="pip's resolver takes minutes here: set KVCONFORM_PIP_RESOLVE=1")
def test_the_readme_pip_line_resolves_to_the_release(wheel: Path, tmp_path: Path) -> None:
    """In a fresh venv, as written; this host's pip may take torch's CPU build of the same
    version (a local label: 2.13.0+cpu), which the release table counts as 2.13.0."""
    (line, *_) = _readme_installs("pip")
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "v")], check=True)
    report = tmp_path / "report.json"
    done = subprocess.run([str(tmp_path / "v" / "bin" / "pip"), "install", "-q", "--dry-run",
                           "--ignore-installed", "--report", str(report),
                           _target(line, wheel)], capture_output=True, text=True,
                          timeout=1800, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = {i["metadata"]["name"].lower(): i["metadata"]["version"]
           for i in json.loads(report.read_text())["install"]}
    got["torch"] = got["torch"].split("+")[0]
    release = next(r for r in QUALIFIED if r["leg"] == RELEASE)
    assert {k: got.get(k) for k in ("vllm", "vllm-omni", "torch")} == _expected(release)


# --------------------------------------------------------------------------- the header


def _line(vllm: str, omni: str | None, torch: str) -> str:
    return release_table.header_line(TABLE, {"vllm": vllm, "vllm-omni": omni,
                                             "torch": torch}, PINS)


def test_the_header_says_a_qualified_stack_is_one() -> None:
    assert _line("0.30.0", "0.30.0", "2.13.0+cu130") == (
        "kvconform: release table: this stack is qualified by leg py311-vllm030")
    assert _line("0.30.0", "0.30.0", "2.13.0+cpu").endswith("qualified by leg py311-vllm030")
    row = QUALIFIED[-1]
    assert _line(str(row["vllm"]), row["vllm_omni"], str(row["torch"])) == (
        f"kvconform: release table: this stack is qualified (a pre-release) by leg "
        f"{row['leg']}")


@pytest.mark.parametrize(("vllm", "omni", "torch", "why"), [
    ("0.33.0", None, "2.14.0", "no leg of the release table runs it"),
    ("0.30.0", "0.30.0", "2.14.0", "no leg of the release table runs it"),
    ("0.29.0", None, "2.13.0", "leg py311-vllm029 is not qualified: "),
])
def test_the_header_says_what_to_install_on_any_other(vllm: str, omni: str | None, torch: str,
                                                      why: str) -> None:
    line = _line(vllm, omni, torch)
    assert line.startswith(f"kvconform: release table: this stack is not qualified ({why}")
    assert '; install a qualified one: pip install "pytest-kvconform[omni]" (vLLM 0.30.0 / ' \
           'vllm-omni 0.30.0 / torch 2.13.0) or pip install "pytest-kvconform[' in line
