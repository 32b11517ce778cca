"""What users install is the wheel: every module and data file of the source ships in it,
and every ``kvconform`` command and entry point starts from it.

A wheel built from main once lacked ``pytest_kvconform.selftest``: pyproject.toml listed
the packages by hand, and every test ran an editable install, which imports the checkout.
"""

from __future__ import annotations

import argparse
import ast
import json
import zipfile
from pathlib import Path

from pytest_kvconform import cli
from tests.wheel_env import (
    PACKAGES,
    REPO,
    WheelEnv,
    missing,
    run,
    shipped_files,
    wheel_files,
)

SOURCE = shipped_files(REPO)


def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser's subcommands by name: a new command is checked without a line here."""
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def command_imports(parser: argparse.ArgumentParser, source: str) -> dict[str, list[str]]:
    """The import statements of the package each command runs when called: cli.py's own and
    those inside the command's handler (the layers a command imports only when it runs)."""
    tree = ast.parse(source)
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}

    def ours(nodes: list[ast.stmt] | list[ast.AST]) -> list[str]:
        return [ast.unparse(node) for node in nodes
                if isinstance(node, ast.ImportFrom) and node.module and not node.level
                and node.module.partition(".")[0] in PACKAGES]

    top = ours(tree.body)
    found = {}
    for name, sub in commands(parser).items():
        handler = functions[sub.get_default("func").__name__]
        found[name] = top + ours(list(ast.walk(handler)))
    return found


def test_the_source_listing_takes_modules_and_data_and_leaves_caches(tmp_path: Path) -> None:
    for name in ("pytest_kvconform/a.py", "pytest_kvconform/sub/data/x.toml",
                 "pytest_kvconform/__pycache__/a.cpython-311.pyc", "pytest_kvconform/.a.swp",
                 "conformance_cases/c.toml", "elsewhere/b.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert shipped_files(tmp_path) == {"pytest_kvconform/a.py", "conformance_cases/c.toml",
                                       "pytest_kvconform/sub/data/x.toml"}
    for name in ("pytest_kvconform/cli.py", "pytest_kvconform/selftest/__init__.py",
                 "pytest_kvconform/contract.md", "pytest_kvconform/py.typed",
                 "pytest_kvconform/known/vllm_omni_0_30.toml",
                 "pytest_kvconform/adapters/upstream_model/config.json",
                 "conformance_cases/attention.toml", "conformance_cases/__init__.py"):
        assert name in SOURCE, name


def test_a_file_missing_from_a_wheel_is_named(tmp_path: Path) -> None:
    """The comparison names what a wheel lacks, a module by its dotted name too."""
    wheel = tmp_path / "pytest_kvconform-0.1.0-py3-none-any.whl"
    left_out = {"pytest_kvconform/selftest/runner.py", "pytest_kvconform/selftest/__init__.py",
                "pytest_kvconform/known/vllm_omni_0_30.toml"}
    with zipfile.ZipFile(wheel, "w") as archive:
        for name in sorted(SOURCE - left_out):
            archive.writestr(name, "")
        archive.writestr("pytest_kvconform-0.1.0.dist-info/RECORD", "")
    assert missing(SOURCE, wheel_files(wheel)) == [
        "pytest_kvconform/known/vllm_omni_0_30.toml",
        "pytest_kvconform/selftest/__init__.py (module pytest_kvconform.selftest)",
        "pytest_kvconform/selftest/runner.py (module pytest_kvconform.selftest.runner)"]
    assert missing(wheel_files(wheel), SOURCE) == []


def test_the_build_warns_of_nothing_deprecated(wheel_env: WheelEnv) -> None:
    assert "Deprecat" not in wheel_env.build_output, wheel_env.build_output


def test_every_module_and_data_file_of_the_source_is_in_the_wheel(wheel_env: WheelEnv) -> None:
    shipped = wheel_files(wheel_env.wheel)
    assert not missing(SOURCE, shipped), \
        f"{wheel_env.wheel.name} lacks: {', '.join(missing(SOURCE, shipped))}"
    assert not missing(shipped, SOURCE), \
        f"{wheel_env.wheel.name} ships what the source has not: {missing(shipped, SOURCE)}"


def test_every_kvconform_command_starts_from_the_wheel(wheel_env: WheelEnv,
                                                       tmp_path: Path) -> None:
    names = sorted(commands(cli.build_parser()))
    assert {"selftest", "gpu-check", "run"} <= set(names), names
    failed = []
    for name in names:
        done = run([str(wheel_env.script("kvconform")), name, "--help"], cwd=tmp_path)
        if done.returncode != 0 or f"usage: kvconform {name}" not in done.stdout:
            failed.append(f"kvconform {name} --help exited {done.returncode}: "
                          f"{(done.stdout + done.stderr).strip()[-2000:]}")
    assert not failed, "\n".join(failed)


# Run in the wheel's venv: each command's imports, then each entry point the wheel declares;
# writes what failed and where the package's modules came from.
IMPORT_PROBE = '''
import json, sys
from importlib.metadata import distribution

statements, out = json.loads(sys.argv[1]), sys.argv[2]
failed = []
for command, lines in statements.items():
    for line in lines:
        try:
            exec(line, {})
        except Exception as exc:
            failed.append(f"kvconform {command}: {line}: {type(exc).__name__}: {exc}")
entry_points = distribution("pytest-kvconform").entry_points
for ep in entry_points:
    try:
        ep.load()
    except Exception as exc:
        failed.append(f"entry point {ep.group}: {ep.name} = {ep.value}: "
                      f"{type(exc).__name__}: {exc}")
origins = sorted({m.__file__ for n, m in list(sys.modules.items())
                  if n.partition(".")[0] in ("pytest_kvconform", "conformance_cases")
                  and getattr(m, "__file__", None)})
with open(out, "w") as f:
    json.dump({"failed": failed, "origins": origins, "entry_points": len(entry_points)}, f)
'''


def test_what_each_command_and_entry_point_imports_is_in_the_wheel(
        wheel_env: WheelEnv, tmp_path: Path) -> None:
    """A command imports its layer when called (``selftest``, ``gpu-check``, ``matrix``):
    ``--help`` alone would start without it."""
    statements = command_imports(cli.build_parser(), (REPO / "pytest_kvconform" / "cli.py")
                                 .read_text())
    assert any("pytest_kvconform.selftest" in line for line in statements["selftest"])
    out = tmp_path / "probe.json"
    done = run([str(wheel_env.python), "-c", IMPORT_PROBE, json.dumps(statements), str(out)],
               cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = json.loads(out.read_text())
    assert not found["failed"], "\n".join(found["failed"])
    assert found["entry_points"] >= 3, found  # pytest11, the Omni platform, the script
    outside = [o for o in found["origins"] if not Path(o).is_relative_to(wheel_env.venv)]
    assert found["origins"] and not outside, outside
