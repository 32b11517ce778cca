"""What users install is the wheel: every module and data file of the source ships in it,
every ``kvconform`` command and entry point starts from it, and the tox environments (the
tests and the main job) run it, not this checkout.

A wheel built from main once lacked ``pytest_kvconform.selftest``: pyproject.toml listed
the packages by hand, and every test ran an editable install, which imports the checkout.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import types
import zipfile
from pathlib import Path

import pytest

import conformance_cases
import pytest_kvconform
from pytest_kvconform import cli
from tests.wheel_env import (
    PACKAGES,
    REPO,
    WheelEnv,
    clean_env,
    missing,
    run,
    shipped_files,
    wheel_files,
)

SOURCE = shipped_files(REPO)
# Rebuilding the environment reinstalls the wheel; setuptools builds it through build/lib,
# where a file the source no longer has stays and ships again.
STALE_HINT = ("rebuild: `tox -e <env> --notest` reinstalls the wheel; a file that ships "
              "although the source lost it is an earlier build's leftover: rm -rf build")


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


def _installed_here() -> Path | None:
    """The site-packages holding this interpreter's pytest-kvconform (not the current
    directory's egg-info), unless it is an editable install or absent."""
    purelib = Path(sysconfig.get_path("purelib"))
    dist = next(iter(importlib.metadata.distributions(path=[str(purelib)],
                                                      name="pytest-kvconform")), None)
    if dist is None:
        return None
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    return None if direct.get("dir_info", {}).get("editable") else purelib


def _compare(module: types.ModuleType) -> list[str]:
    """How the package this session imported differs from this checkout's source."""
    imported = Path(str(module.__file__)).resolve().parents[1]
    ours, theirs = shipped_files(REPO, [module.__name__]), shipped_files(imported,
                                                                         [module.__name__])
    found = [f"{imported} lacks {name}" for name in missing(ours, theirs)]
    found += [f"{imported} has {name}, the checkout has not" for name in missing(theirs, ours)]
    found += [f"{imported / name} differs from the checkout's" for name in sorted(ours & theirs)
              if (imported / name).read_bytes() != (REPO / name).read_bytes()]
    return found


def test_this_session_tests_this_checkouts_code() -> None:
    """Tests read the checkout's source (README, layering) and import the package: where it
    is the installed wheel (tox), the two must be the same files."""
    found = [line for module in (pytest_kvconform, conformance_cases) for line in
             _compare(module)]
    assert not found, "\n".join([*found, STALE_HINT])


ORIGINS_PLUGIN = '''
import json, os, sys


def pytest_collection_finish(session):
    modules = sorted({m.__file__ for n, m in list(sys.modules.items())
                      if n.partition(".")[0] in ("pytest_kvconform", "conformance_cases")
                      and getattr(m, "__file__", None)})
    with open(os.environ["KVCONFORM_ORIGINS_OUT"], "w") as f:
        json.dump({"modules": modules, "items": sorted({str(i.path) for i in session.items})},
                  f)
'''


def test_the_main_job_runs_the_installed_wheel(tmp_path: Path) -> None:
    """The main job (README) is this environment's ``pytest --kv-conformance`` run from the
    clone: its plugin, suite and cases must be the installed wheel's, not the clone's, which
    pytest puts on sys.path to import tests/conftest.py (pyproject.toml: append, not prepend).
    """
    purelib = _installed_here()
    if purelib is None:
        pytest.skip("pytest-kvconform is installed editable here, or not at all")
    script = shutil.which("pytest", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip(f"no pytest script beside {sys.executable}")
    (tmp_path / "kvconform_origins.py").write_text(textwrap.dedent(ORIGINS_PLUGIN))
    out = tmp_path / "origins.json"
    env = {k: v for k, v in clean_env().items() if not k.startswith("KVCONFORM_")}
    env.update(PYTHONPATH=str(tmp_path), KVCONFORM_ORIGINS_OUT=str(out))
    done = subprocess.run([script, "--kv-conformance", "--collect-only", "-q", "-p",
                           "no:cacheprovider", "-p", "kvconform_origins"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = json.loads(out.read_text())
    assert found["items"] and any("conformance_cases" in m for m in found["modules"]), found
    outside = [p for p in [*found["modules"], *found["items"]]
               if not Path(p).is_relative_to(purelib)]
    assert not outside, f"the main job imports from outside {purelib}: {outside}"
