"""A new clause is four edits: its contract text, its table row, its check, its seeded fault.

The package is copied into a temporary directory and exactly those four edits are made for
a stride clause KV-S6 ("layer and block strides are positive and distinct"):

1. ``contract.md``: the clause's text, after KV-S5;
2. ``contract/clauses.py``: its row in ``CLAUSES``;
3. ``checks/strides.py``: ``check_kv_s6``;
4. ``faults/plants.py``: its seeded fault, one ``declare`` (``layer_stride`` set to
   ``block_stride``).

With the copy first on ``PYTHONPATH``, in fresh processes (run side by side):

- ``pytest --kv-conformance -k kv_s6 --kv-report r.json`` collects ``test_kv_s6[...]`` in
  ``kvconform/test_strides.py`` for every layout x plain case and passes them, and the report
  has their KV-S6 rows; every id it collects (before ``-k``) is the stored golden list's plus
  KV-S6's derived ones (``tests/end_to_end/test_collected_ids.py``: the golden file needs no
  edit);
- ``kvconform selftest --fault equal_strides`` seeds the new fault and the suite catches it.

Nothing else is edited: the suite test, the docs' table source, the collected ids, the
report column, the selftest's registry entry and the plain API's plan all follow from the
row.  (Its cost is two stack imports, overlapped: about a minute on two cores.)
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_kvconform.contract import clauses
from pytest_kvconform.contract.cases import load_cases
from pytest_kvconform.contract.records import installed_version
from tests.conftest import needs_omni
from tests.end_to_end import test_collected_ids as golden
from tests.paths import ROOT
from tests.wheel_env import clean_env

pytestmark = needs_omni

PACKAGE = "pytest_kvconform"

# --- the four edits -------------------------------------------------------------------------

S5_TEXT = """- KV-S5 Several cache groups: tensors of different groups may alias by design,
  the layers of one group never do.
"""
CONTRACT_TEXT = """- KV-S6 vllm-omni's `build_kv_cache_tensor` gives `layer_stride` and
  `block_stride` positive, distinct values: no two (layer, block) pages of one tensor
  start at one byte.
"""
S5_ROW = """    _s(5, "Several cache groups", several_groups,
       _c("strides", "check_kv_s5", "layout", "case", "device")),
"""
ROW = """    _s(6, "Distinct strides", plain, _c("strides", "check_kv_s6", "layout", "case")),
"""
CHECK = '''

def check_kv_s6(layout: str, case: Case) -> None:
    """KV-S6: vllm-omni's layer and block strides are positive and distinct."""
    compat.require_omni("KV-S6")
    where = Where("KV-S6", case=case, layout=layout)
    tensor = where.call(OMNI_SOURCE, omni_tensor, case, layout)
    strides = {"layer_stride": tensor.layer_stride, "block_stride": tensor.block_stride}
    if min(strides.values()) <= 0 or tensor.layer_stride == tensor.block_stride:
        raise where.fail_at(OMNI_SOURCE, "layer_stride and block_stride must be positive and "
                            "distinct", expected="two positive, distinct strides",
                            actual=strides)
'''
FAULT = '''

def _equal_strides(original: Any) -> Any:
    """Layers step by the block stride: layer l+1 of block b is block b+1 of layer l (KV-S6)."""
    def build_kv_cache_tensor(spec: Any, num_blocks: int, layers: Any, *, layout: Any = None,
                              offset: int = 0) -> Any:
        tensor = original(spec, num_blocks, layers, layout=layout, offset=offset)
        return dataclasses.replace(tensor, layer_stride=tensor.block_stride)
    return build_kv_cache_tensor


EQUAL_STRIDES = declare(
    "equal_strides", ("KV-S6",), "build_kv_cache_tensor gives the layers the block stride",
    Patch(BUILD_TENSOR, _equal_strides))
'''
EDITED = ("contract.md", "contract/clauses.py", "checks/strides.py", "faults/plants.py")


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.count(old) == 1, f"{path}: the anchor of the edit is not there once"
    path.write_text(text.replace(old, new), encoding="utf-8")


def copy_with_new_clause(root: Path) -> Path:
    """The package copied under ``root``, with the four edits made; ``root``."""
    package = root / PACKAGE
    shutil.copytree(ROOT / PACKAGE, package,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    _edit(package / "contract.md", S5_TEXT, S5_TEXT + CONTRACT_TEXT)
    _edit(package / "contract" / "clauses.py", S5_ROW, S5_ROW + ROW)
    strides = package / "checks" / "strides.py"
    strides.write_text(strides.read_text(encoding="utf-8") + CHECK, encoding="utf-8")
    plants = package / "faults" / "plants.py"
    plants.write_text(plants.read_text(encoding="utf-8") + FAULT, encoding="utf-8")
    return root


def changed_files(a: Path, b: Path) -> list[str]:
    """The files that differ between two trees (either side only, or other content)."""
    found: list[str] = []

    def walk(cmp: filecmp.dircmp[str], prefix: str) -> None:
        found.extend(prefix + n for n in cmp.left_only + cmp.right_only + cmp.diff_files)
        for name, sub in cmp.subdirs.items():
            walk(sub, f"{prefix}{name}/")

    walk(filecmp.dircmp(a, b, ignore=["__pycache__"]), "")
    return sorted(found)


def the_new_row() -> clauses.Clause:
    """The row edit 2 adds, built in this process (to derive its ids here)."""
    return clauses._s(6, "Distinct strides", clauses.plain,
                      clauses._c("strides", "check_kv_s6", "layout", "case"))


# --- running the copy ------------------------------------------------------------------------

# Records every collected suite id (before -k deselects), in the order the run gives them:
# the tests on KV-A's worker processes last (plugin.pytest_collection_modifyitems).
RECORD_COLLECTED = '''
import json
import os


class _Record:
    def __init__(self):
        self.ids = []

    def pytest_itemcollected(self, item):
        self.ids.append((item.nodeid, "kv_workers" in getattr(item, "fixturenames", ())))

    def pytest_sessionfinish(self, session):
        ids = [nodeid for nodeid, _ in sorted(self.ids, key=lambda pair: pair[1])]
        with open(os.path.join(os.environ["KVCONFORM_TEST_OUT"], "collected.json"), "w") as f:
            json.dump(ids, f)


def pytest_configure(config):
    config.pluginmanager.register(_Record())
'''


def _env(copy: Path, out: Path) -> dict[str, str]:
    """This environment without pytest's or a run's variables, the copy first on the path."""
    env = {k: v for k, v in clean_env().items() if not k.startswith(("PYTEST_", "KVCONFORM_"))}
    env.update(PYTHONPATH=str(copy), KVCONFORM_TEST_OUT=str(out),
               VLLM_LOGGING_LEVEL="ERROR")
    return env


def _start(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(argv, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen[str], timeout: float = 600) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return proc.returncode, out


def test_a_stride_clause_is_four_edits(tmp_path: Path) -> None:
    copy = copy_with_new_clause(tmp_path / "src")
    assert changed_files(ROOT / PACKAGE, copy / PACKAGE) == sorted(EDITED)

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "conftest.py").write_text(RECORD_COLLECTED)
    env = _env(copy, run_dir)
    suite = _start([sys.executable, "-m", "pytest", "--kv-conformance", "-p", "no:cacheprovider",
                    "-p", "no:randomly", "--kv-xfails", "none", "-q", "-k", "kv_s6",
                    "--kv-report", "r.json"], run_dir, env)
    selftest = _start([sys.executable, "-c",
                       "import sys; from pytest_kvconform.cli import main; "
                       "sys.exit(main(sys.argv[1:]))",
                       "selftest", "--fault", "equal_strides", "--json", "selftest.json"],
                      run_dir, env)
    (suite_code, suite_out), (selftest_code, selftest_out) = _finish(suite), _finish(selftest)

    # The suite: test_kv_s6 for every layout x plain case, in the strides module; passed.
    plain = [c.id for c in load_cases() if clauses.plain(c)]
    expected = golden.derived_ids([the_new_row()], [])
    assert len(expected) == 6 * len(plain)
    assert expected[0] == f"kvconform/test_strides.py::test_kv_s6[LBHNC-{plain[0]}]"
    assert suite_code == 0, suite_out[-4000:]
    assert f"{len(expected)} passed" in suite_out, suite_out[-4000:]
    # The report: one KV-S6 row per test, and the clause in its matrix.
    report = json.loads((run_dir / "r.json").read_text())
    rows = [r for r in report["results"] if r["clause"] == "KV-S6"]
    assert sorted(r["nodeid"] for r in rows) == sorted(expected)
    assert {r["status"] for r in rows} == {"passed"}
    assert {r["clause"] for r in report["results"]} == {"KV-S6"}
    # Every collected id: the golden file's, unchanged, and KV-S6's derived ones.
    collected = json.loads((run_dir / "collected.json").read_text())
    assert set(expected) <= set(collected)
    stored, pins = golden.stored_ids()
    if (installed_version("vllm"), installed_version("vllm_omni")) == pins:
        table = (*clauses.CLAUSES, the_new_row())
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(clauses, "CLAUSES", table)
            assert golden.difference(stored, collected) == ""

    # The selftest: the new fault, registered from its one declaration, is caught.
    assert selftest_code == 0, selftest_out[-4000:]
    found = json.loads((run_dir / "selftest.json").read_text())
    [fault] = found["faults"]
    assert (fault["name"], fault["family"], fault["seeded"], fault["clauses"],
            fault["outcome"]) == ("equal_strides", "strides", "planted", ["KV-S6"], "caught"), \
        selftest_out[-4000:]
    assert "KV-S6 violated" in fault["detail"]
    assert {r["clause"] for r in found["baseline"]} == {"KV-S6"}
    assert os.path.isdir(copy / PACKAGE)
