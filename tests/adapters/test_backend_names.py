"""The backend names known before the stack is imported, and ``--kv-backend``'s early refusal."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pytest_kvconform.adapters import backend_names
from pytest_kvconform.session import startup
from tests.conftest import needs_omni
from tests.wheel_env import clean_env

BACKENDS = '''
class EntryBackend:
    @classmethod
    def indexes_kv_by_block_stride(cls):
        return False


def more():
    return {"EP_MAPPED": EntryBackend}
'''


def _site(root: Path, entry_points: str) -> Path:
    """A directory holding a module and a distribution whose entry points are given."""
    site = root / "site"
    site.mkdir()
    (site / "kvc_names_backend.py").write_text(BACKENDS)
    info = site / "kvc_names_backend-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvc-names-backend\n"
                                   "Version: 0.1\n")
    (info / "entry_points.txt").write_text("[pytest_kvconform.backends]\n" + entry_points)
    return site


def test_a_class_entry_point_is_a_name_known_for_certain(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(_site(tmp_path, "EP_CLASS = kvc_names_backend:EntryBackend\n"
                                                    "GHOST = no_such_pkg_kvc.mod:Backend\n")))
    found = backend_names.entry_point_names()
    assert found.names == {"EP_CLASS", "GHOST"}
    assert found.undecided == []
    assert "kvc_names_backend" not in sys.modules  # read, not imported


def test_a_callable_entry_point_leaves_the_names_to_discovery(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(_site(tmp_path, "EP_FACTORY = kvc_names_backend:more\n")))
    found = backend_names.entry_point_names()
    assert found.undecided == ["entry point EP_FACTORY (kvc_names_backend:more) may be a "
                               "callable that names its backends when called"]
    assert "kvc_names_backend" not in sys.modules


def test_a_module_is_found_without_importing_its_package(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "kvc_loud_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (pkg / "mod.py").write_text("class B: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert backend_names.module_source("kvc_loud_pkg.mod") == pkg / "mod.py"
    assert backend_names.module_source("kvc_loud_pkg.missing") is None
    assert "kvc_loud_pkg" not in sys.modules


@needs_omni
def test_the_registry_members_are_read_from_vllm_omnis_source() -> None:
    found = backend_names.registry_members()
    assert {"FLASH_ATTN", "TORCH_SDPA", "SAGE_ATTN_3"} <= found.names
    assert found.undecided == []


def test_the_refusal_names_each_name_as_written() -> None:
    assert startup.unknown_backends(["NOPE", ""], {"B", "A"}) == (
        "unknown backend 'NOPE', ''; available backends: A, B")


def test_a_hook_leaves_the_names_to_discovery() -> None:
    startup.check_backend_names(["NOPE"], ["conftest.py"])  # no refusal: decided later
    with pytest.raises(startup.StartupError, match="unknown backend 'NOPE'"):
        startup.check_backend_names(["NOPE"], [])


# What the process had imported when it ended: the refusal came before the stack's import.
RECORD = '''
import json
import sys


def pytest_unconfigure(config):
    heavy = sorted(m for m in ("torch", "vllm", "vllm_omni") if m in sys.modules)
    open("imported.json", "w").write(json.dumps(heavy))
'''


@pytest.mark.parametrize("name", ["NOPE", ""])
def test_a_name_no_registry_has_is_refused_before_the_stack_is_imported(
        tmp_path: Path, name: str) -> None:
    """The early refusal, from a fresh process: a usage error naming the name (an empty one
    quoted), with the stack unimported (benchmarks/RESULTS.md measures how long it takes)."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent(RECORD))
    done = subprocess.run([sys.executable, "-m", "pytest", "--kv-conformance", "-p",
                           "no:cacheprovider", "--kv-backend", name], cwd=tmp_path,
                          env=clean_env() | {"PYTHONPATH": str(Path(__file__).parents[2])},
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout + done.stderr
    assert f"ERROR: --kv-backend: unknown backend {name!r}; available backends: " in \
        done.stderr, done.stderr
    assert (tmp_path / "imported.json").read_text() == "[]"
