"""README's commands are what CI runs, verbatim, and what a fresh clone gets.

A user copies the README's two command lines into a fresh clone with nothing set;
``.ci/run`` must run exactly those lines, and nothing may route around the defaults
(a default that only a variable set by CI made work would pass CI and fail the user).
"""

from __future__ import annotations

import re

from pytest_kvconform.contract import clauses
from tests.paths import ROOT as REPO

README = (REPO / "README.md").read_text()
CI = (REPO / ".ci" / "run").read_text()


def readme_command(heading: str) -> str:
    """The indented command line right after ``**<heading>**`` in README."""
    m = re.search(rf"^\*\*{re.escape(heading)}\*\*[^\n]*(?:\n[^\n]+)*\n\n    (\S[^\n]*)$",
                  README, re.M)
    assert m is not None, f"README has no '**{heading}**' section with an indented command"
    return m.group(1)


def ci_lines() -> list[str]:
    return [line.strip() for line in CI.splitlines()]


def test_ci_runs_the_readme_commands_verbatim() -> None:
    for heading in ("Main job", "Tests"):
        command = readme_command(heading)
        assert command in ci_lines(), f".ci/run does not run README's {heading} command " \
                                      f"verbatim: {command!r}"


def test_the_main_job_finds_its_known_findings_itself() -> None:
    """The main job names no known-findings file: the shipped one that matches the stack
    applies by default, in both environments CI runs it in."""
    main = readme_command("Main job")
    assert "--kv-strict" in main and "--kv-xfails" not in main, main
    jobs = [line for line in ci_lines() if "--kv-conformance" in line]
    assert len(jobs) == 2 and not [line for line in jobs if "--kv-xfails" in line], jobs
    assert any("py311-vllm030-cputorch" in line for line in jobs), jobs


def test_ci_sets_no_variable_that_routes_around_the_defaults() -> None:
    code = [line for line in ci_lines() if line and not line.startswith("#")]
    assert not [line for line in code if re.search(r"\bexport\b|^KVCONFORM_\w+=", line)], code
    assert not [line for line in code if re.search(r"KVCONFORM_\w+=", line)], code


def test_tox_ini_needs_no_variable_for_its_work_dir() -> None:
    tox_ini = (REPO / "tox.ini").read_text()
    # tox expands an {env:...} nested in an {env:VAR:default} default, but no other
    # substitution there ({homedir} stayed literal and made a folder of that name).
    assert not re.search(r"\{env:[^}]*\{(?!env:)", tox_ini), "nested substitution in a default"
    assert "{homedir}" not in tox_ini


def test_readme_links_to_the_contract() -> None:
    """Every relative link resolving is tests/test_docs.py's; the contract is linked here."""
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    assert "pytest_kvconform/contract.md" in links


def test_the_contract_ships_with_its_version_and_every_clause() -> None:
    from pytest_kvconform import CONTRACT_VERSION

    contract = (REPO / "pytest_kvconform" / "contract.md").read_text()
    assert f"Contract version: **{CONTRACT_VERSION}**" in contract
    stated = re.findall(r"^- (KV-[LSNAV][0-9]+) ", contract, re.M)
    assert stated == [c.id for c in clauses.CLAUSES], stated  # every row's, once, in order


def test_the_code_layout_names_every_module() -> None:
    """CONTRIBUTING's "Layout of the code" is where a new contributor starts: every module
    named by its path, every subpackage a layer of ``tests/test_layering.py``."""
    from tests.test_layering import LAYERS

    contributing = (REPO / "CONTRIBUTING.md").read_text()
    section = contributing.split("## Layout of the code", 1)[1].split("\n## ", 1)[0]
    package = REPO / "pytest_kvconform"
    missing = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if path.stem == "__init__":
            continue
        folder = rel.rpartition("/")[0]
        if f"`{rel}`" not in section and f"`{folder}/*.py`" not in section:
            missing.append(rel)
    layers = {m.rstrip(".*") for _, members in LAYERS for m in members if m.endswith(".*")}
    missing += [f"{d.name}/ (a layer)" for d in package.iterdir()
                if (d / "__init__.py").exists() and d.name in layers
                and f"`{d.name}/`" not in section]
    assert not missing, f"CONTRIBUTING's 'Layout of the code' does not name: {', '.join(missing)}"
