"""The suite's test ids stay as they are: xfail files, reports and CI filters name them.

``tests/data/collected_ids.txt`` is the golden list for the installed stack it names.
:func:`difference` holds a fresh collection to it this way:

- every stored id is still collected, and in the stored order: an id that disappears,
  is renamed or moves fails here (a deliberate change regenerates the file);
- every other collected id belongs to a clause the stored file does not name yet (a
  new row of the clause table), and is exactly what the table derives for that row: its
  family's module, its test names, its axes expanded by ``checks/arguments.expand`` over
  the backends the stored ids name and the shipped cases.

So adding a clause needs no edit here: its ids are the table's.  A new id for a clause the
file already names (a new control, case or backend) is a change the file must record.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from collections.abc import Sequence

import pytest

from pytest_kvconform.checks.arguments import expand
from pytest_kvconform.contract import clauses
from pytest_kvconform.contract.cases import load_cases
from pytest_kvconform.contract.records import BackendUnderTest, installed_version
from tests.paths import ROOT

STORED = ROOT / "tests" / "data" / "collected_ids.txt"
_PINS_RE = re.compile(r"^# vllm==(\S+) vllm-omni==(\S+)$", re.MULTILINE)
_ID_RE = re.compile(r"^kvconform/(?P<module>\w+)\.py::(?P<name>\w+?)(?:\[(?P<params>.*)\])?$")


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


def _clause_of(test_id: str) -> str | None:
    m = _ID_RE.match(test_id)
    return clauses.clause_from_test_name(m["name"]) if m is not None else None


def derived_ids(rows: Sequence[clauses.Clause], backends: Sequence[str]) -> list[str]:
    """The ids the table derives for ``rows``: each check's test in its family's module,
    parametrised over its axes (the shipped cases, ``backends`` by name)."""
    under_test = [BackendUnderTest(name, "", "golden") for name in backends]
    cases = load_cases()
    found = []
    for row in rows:
        for check in row.checks:
            axes = expand(check.axes, backends=under_test, cases=cases, predicate=row.cases)
            prefix = f"kvconform/{row.suite_module}.py::{row.test_name(check)}"
            for ids in itertools.product(*(a.ids for a in axes)):
                found.append(f"{prefix}[{'-'.join(ids)}]" if ids else prefix)
    return found


def difference(stored: list[str], collected: list[str]) -> str:
    """What changed, readable: ids gone, ids not derived from a new table row, or the
    order of the stored ones; "" when nothing did (see the module docstring)."""
    seen, kept = set(collected), set(stored)
    gone = [i for i in stored if i not in seen]
    named = {_clause_of(i) for i in stored}
    new_rows = [row for row in clauses.CLAUSES if row.id not in named]
    backends = list(dict.fromkeys(re.sub(r"^.*\[|\]$", "", i) for i in stored
                                  if "::test_kv_l1[" in i))
    derived = set(derived_ids(new_rows, backends))
    new = [i for i in collected if i not in kept]
    unexplained = [i for i in new if i not in derived]
    missing = sorted(derived - seen)
    if not gone and not unexplained and not missing:
        return "" if [i for i in collected if i in kept] == stored else \
            "same ids, different order"
    lines = [f"{len(gone)} ids gone, {len(unexplained)} new that no new table row derives, "
             f"{len(missing)} that a new row derives not collected (stored list: {STORED})"]
    lines += [f"  - {i}" for i in gone[:20]] + [f"  + {i}" for i in unexplained[:20]]
    lines += [f"  ? {i}" for i in missing[:20]]
    return "\n".join(lines)


STORED_TWO = ["kvconform/test_layout.py::test_kv_l1[X]", "kvconform/test_layout.py::test_kv_l2[X]"]


@pytest.fixture
def small_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """The clause table cut to KV-L1, KV-L2 (which :data:`STORED_TWO` names) and KV-S1."""
    monkeypatch.setattr(clauses, "CLAUSES", tuple(
        c for c in clauses.CLAUSES if c.id in ("KV-L1", "KV-L2", "KV-S1")))


@pytest.mark.usefixtures("small_table")
def test_difference_names_what_changed() -> None:
    stored = STORED_TWO
    s1 = derived_ids([clauses.BY_ID["KV-S1"]], ["X"])
    assert difference(stored, [*stored, *s1]) == ""
    assert difference(stored, [*stored[::-1], *s1]) == "same ids, different order"
    text = difference(stored, [stored[0], "kvconform/test_layout.py::test_kv_l2_renamed[X]", *s1])
    assert "1 ids gone, 1 new that no new table row derives" in text
    assert "  - kvconform/test_layout.py::test_kv_l2[X]" in text
    assert "  + kvconform/test_layout.py::test_kv_l2_renamed[X]" in text


@pytest.mark.usefixtures("small_table")
def test_a_new_table_row_adds_its_derived_ids_and_nothing_else() -> None:
    """A row the stored file does not name adds exactly its derived ids; an id for a clause
    the file names, or in another module, still fails."""
    stored = STORED_TWO
    s1 = derived_ids([clauses.BY_ID["KV-S1"]], ["X"])
    assert s1[0] == "kvconform/test_strides.py::test_kv_s1[LBHNC-bf16_h8]"
    assert difference(stored, [*stored, *s1]) == ""
    assert "1 that a new row derives not collected" in difference(stored, [*stored, *s1[1:]])
    for wrong in ("kvconform/test_layout.py::test_kv_l2[Y]",
                  "kvconform/test_table.py::test_kv_s1[LBHNC-bf16_h8]"):
        assert f"  + {wrong}" in difference(stored, [*stored, *s1, wrong])


def test_collected_ids_are_unchanged() -> None:
    stored, pins = stored_ids()
    installed = (installed_version("vllm"), installed_version("vllm_omni"))
    if installed != pins:
        pytest.skip(f"the stored ids are for vllm {pins[0]} + vllm-omni {pins[1]}; installed: "
                    f"vllm {installed[0]} + vllm-omni {installed[1]} (other backends)")
    assert difference(stored, collect()) == ""
