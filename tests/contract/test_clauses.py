"""The clause table: complete, consistent with the contract and with the suite it describes."""

from __future__ import annotations

import functools
import importlib
import inspect
import subprocess
import sys
import textwrap
import types
import warnings

import pytest

from pytest_kvconform.checks import arguments
from pytest_kvconform.contract import clauses
from pytest_kvconform.contract.cases import load_cases
from pytest_kvconform.contract.outcomes import SkipKind
from pytest_kvconform.report import build as report
from pytest_kvconform.suite.check_call import FIXTURE
from tests.paths import ROOT

# The suite's modules: one per family, and the one for a family without its own.
SUITE_MODULES = (*dict.fromkeys(clauses.FAMILY_MODULES.values()), "test_table")


@functools.cache
def suite_tests() -> dict[str, types.FunctionType]:
    """The suite's test functions (its kv_cases marker is registered only under the plugin)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
        modules = [importlib.import_module(f"pytest_kvconform.suite.{m}") for m in SUITE_MODULES]
    return {name: fn for module in modules for name, fn in vars(module).items()
            if name.startswith("test") and inspect.isfunction(fn)}


# --- the table against the contract ------------------------------------------------------


def test_every_contract_clause_appears_once_in_contract_order() -> None:
    ids = [c.id for c in clauses.CLAUSES]
    assert len(ids) == len(set(ids)), f"a clause is in the table twice: {ids}"
    assert ids == list(clauses.contract_clauses())


def test_the_contract_version_is_the_one_contract_md_states() -> None:
    from pytest_kvconform import CONTRACT_VERSION
    from pytest_kvconform.contract import stated_version

    assert CONTRACT_VERSION == stated_version(clauses.CONTRACT.read_text(encoding="utf-8"))
    assert stated_version("# x\n\nContract version: **7** (more)\n") == "7"
    with pytest.raises(ValueError, match="states no 'Contract version"):
        stated_version("- KV-L1 Declaration. x\n")


def test_contract_parse_refuses_a_clause_stated_twice() -> None:
    text = "- KV-L1 Declaration. x\n- KV-L2 Resolution. y\n- KV-L1 Again. z\n"
    with pytest.raises(ValueError, match="KV-L1 twice"):
        clauses.contract_clauses(text)


def test_a_clause_missing_from_the_table_is_visible() -> None:
    """The comparison above is not vacuous: a contract with one more clause differs."""
    text = clauses.CONTRACT.read_text(encoding="utf-8") + "\n- KV-N6 A new clause.\n"
    assert list(clauses.contract_clauses(text)) != [c.id for c in clauses.CLAUSES]


def test_titles_of_the_named_clauses_are_the_contracts() -> None:
    """KV-L clauses carry a name in the contract ("KV-L1 Declaration."); the table uses it."""
    stated = clauses.contract_clauses()
    for row in clauses.CLAUSES:
        if row.family == "L":
            assert stated[row.id].startswith(row.title + ". "), (row.id, stated[row.id])
        assert row.title and row.family in clauses.FAMILY_ORDER


def test_families_and_what_they_apply_to() -> None:
    applies = {c.family: {r.applies_to for r in clauses.CLAUSES if r.family == c.family}
               for c in clauses.CLAUSES}
    assert applies == {"L": {"backend"}, "S": {"layout x case"}, "N": {"case"},
                       "A": {"backend x case"}, "V": {"vLLM backend"}}
    assert [c.family for c in clauses.CLAUSES] == sorted(
        (c.family for c in clauses.CLAUSES), key=clauses.FAMILY_ORDER.index)


# --- the grammar ---------------------------------------------------------------------------


def test_one_grammar_shared_by_the_report() -> None:
    assert report.clause_sort_key is clauses.clause_sort_key  # one order, not a copy
    assert report.CLAUSE_RE is clauses.CLAUSE_RE
    # Reports only hold valid ids (validate refuses others): the two orders agree on them.
    assert all(report.clause_sort_key(c) == clauses.clause_sort_key(c)
               for c in [*clauses.BY_ID, "KV-L10", "bogus"])


@pytest.mark.parametrize(("name", "clause"), [
    ("test_kv_l2", "KV-L2"), ("test_kv_l2[FLASH_ATTN]", "KV-L2"),
    ("test_kv_l8_worker_alias[TORCH_SDPA]", "KV-L8"), ("test_kv_a1_seam[need_True-ws2]", "KV-A1"),
    ("test_kv_s12", "KV-S12"), ("test_kv_x1", None), ("test_kv_l", None), ("test_layout", None),
    ("test_kv_l2x", None), ("helper_kv_l2", None),
])
def test_clause_from_test_name(name: str, clause: str | None) -> None:
    assert clauses.clause_from_test_name(name) == clause


def test_parse_clause_names_the_bad_id() -> None:
    assert clauses.parse_clause("KV-A6") == ("A", 6)
    with pytest.raises(ValueError, match="'KV-Q1'"):
        clauses.parse_clause("KV-Q1")
    with pytest.raises(ValueError, match=r"unknown clause 'KV-L9'.*KV-L1, KV-L2"):
        clauses.select(["KV-L1", "KV-L9"])
    assert [c.id for c in clauses.select(["KV-N1", "KV-L2", "KV-N1"])] == ["KV-L2", "KV-N1"]
    assert [c.id for c in clauses.select("KV-S3")] == ["KV-S3"]


# --- the table against the suite ----------------------------------------------------------------


def unmapped(names: list[str]) -> list[str]:
    """Suite test functions the table does not describe (they would drop out of the report)."""
    known = clauses.check_names()
    return [n for n in names if n not in known]


def test_every_suite_test_maps_to_a_table_check_and_back() -> None:
    names = sorted(suite_tests())
    assert unmapped(names) == []
    assert sorted(clauses.check_names()) == names


def test_a_suite_test_outside_the_naming_scheme_is_detected() -> None:
    """A test not named test_kv_<x><n> (or with no table row) is reported, not dropped."""
    names = [*suite_tests(), "test_layout_extra", "test_kv_l9", "test_kv_l2_typo"]
    assert unmapped(names) == ["test_layout_extra", "test_kv_l9", "test_kv_l2_typo"]
    assert clauses.clause_from_test_name("test_layout_extra") is None


def _code_names(fn: types.FunctionType) -> set[str]:
    """Names a test's body uses, nested closures included, through one level of module
    helper (``_a6``)."""
    names: set[str] = set()
    codes = [fn.__code__]
    while codes:
        code = codes.pop()
        names |= set(code.co_names)
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    for name in list(names):
        helper = fn.__globals__.get(name)
        if inspect.isfunction(helper) and helper.__module__ == fn.__module__:
            names |= set(helper.__code__.co_names)
    return names




def test_one_argument_mapping_knows_every_parameter_the_table_names() -> None:
    """The table's parameter names, the suite's fixtures for them and the mapping both
    front-ends call agree (a new parameter is added in all three or fails here)."""
    used = {a for _, check in clauses.check_names().values() for a in check.args}
    assert used <= set(arguments.NAMES) == set(FIXTURE)
    with pytest.raises(KeyError, match="no check parameter 'nope'"):
        arguments.argument("nope", arguments.Sources())


@pytest.mark.parametrize("name", sorted(clauses.check_names()))
def test_suite_test_matches_its_row(name: str) -> None:
    """Same check function, same parameters, same case predicate as the table says, in its
    family's module: a generated test runs the row's check; a hand-written one calls it."""
    from pytest_kvconform.suite.generate import CHECK_ATTR

    row, check = clauses.check_names()[name]
    fn = suite_tests()[name]
    assert fn.__module__ == f"pytest_kvconform.suite.{row.suite_module}", fn.__module__
    generated = getattr(fn, CHECK_ATTR, None)
    if generated is not None:
        assert generated is check, f"{name} runs another check than its row's"
    else:
        assert check.resolve().__name__ in _code_names(fn), \
            f"{name} does not call {check.function}"
    params = set(inspect.signature(fn).parameters) - {"request"}
    assert params == {FIXTURE[a] for a in check.args} - {"request"}
    marks = [m for m in getattr(fn, "pytestmark", []) if m.name == "kv_cases"]
    if row.cases is None:
        assert marks == [] and "case" not in check.args
    else:
        assert [m.args[0] for m in marks] == [row.cases], f"{name}: another case predicate"


def test_only_kv_l7_is_written_by_hand() -> None:
    """Every suite test is generated from the table but ``test_kv_l7``, which also records
    what KV-L7 covered (``suite/test_layout.py``)."""
    from pytest_kvconform.suite.generate import CHECK_ATTR

    by_hand = sorted(n for n, fn in suite_tests().items() if not hasattr(fn, CHECK_ATTR))
    assert by_hand == ["test_kv_l7"]


def test_suite_modules_hold_their_tests_in_table_order() -> None:
    """The collection order (and so the golden ids' order) is the table's, per module."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
        for module in SUITE_MODULES:
            found = [n for n in vars(importlib.import_module(f"pytest_kvconform.suite.{module}"))
                     if n.startswith("test_")]
            assert found == [n for n, (row, _) in clauses.check_names().items()
                             if row.suite_module == module], module


@pytest.mark.parametrize("name", sorted(clauses.check_names()))
def test_check_functions_take_the_arguments_the_table_gives(name: str) -> None:
    _, check = clauses.check_names()[name]
    signature = inspect.signature(check.resolve())
    signature.bind(*check.args)  # raises TypeError on a count mismatch


def test_case_predicates_select_shipped_cases() -> None:
    """Every clause with cases runs on at least one shipped case (A: world size 1 and 2)."""
    shipped = load_cases()
    for row in clauses.CLAUSES:
        if row.cases is not None:
            assert [c for c in shipped if row.cases(c)], row.id
    assert {c.world_size for c in shipped if clauses.adoption_case(c)} == {1, 2}
    assert set(clauses.A_CASES) <= {c.id for c in shipped}


# --- the strict rule ---------------------------------------------------------------------------


def test_forgiven_skip_kinds() -> None:
    assert clauses.skip_forgiven("KV-L1", SkipKind.NOT_APPLICABLE)
    assert clauses.skip_forgiven("KV-L7", "hardware")
    assert clauses.skip_forgiven("KV-A6", SkipKind.HARDWARE)
    assert clauses.skip_forgiven("KV-A2", SkipKind.HARDWARE)  # fewer devices than ranks
    assert not clauses.skip_forgiven("KV-L1", SkipKind.HARDWARE)  # needs no device at all
    assert not clauses.skip_forgiven("KV-S1", SkipKind.ENVIRONMENT)
    assert not clauses.skip_forgiven("KV-L2", SkipKind.BACKEND)
    assert not clauses.skip_forgiven("KV-L2", None)
    assert not clauses.skip_forgiven("KV-Z1", SkipKind.NOT_APPLICABLE)
    # The report's global rule is the union of the rows'.
    assert {k.value for k in clauses.FORGIVEN_SKIP_KINDS} == set(report.FORGIVEN_SKIP_KINDS)


def test_report_strict_rule_is_the_tables() -> None:
    """The report judges a skip by its clause's row, not by a global list of kinds."""
    def skipped(clause: str, kind: str) -> dict[str, object]:
        return {"nodeid": f"t[{clause}]", "clause": clause, "status": "skipped",
                "skip_kind": kind}

    passed = {"nodeid": "t0", "clause": "KV-L1", "status": "passed"}
    for clause in clauses.BY_ID:
        for kind in SkipKind:
            verdict, _ = report.compute_verdict([passed, skipped(clause, kind.value)], strict=True)
            forgiven = clauses.skip_forgiven(clause, kind)
            assert verdict == ("qualified" if forgiven else "not qualified"), (clause, kind)
    # KV-L1 needs no device: a hardware skip of it is not forgiven; KV-L7's is.
    assert report.compute_verdict([passed, skipped("KV-L1", "hardware")], True)[0] == \
        "not qualified"
    assert report.compute_verdict([passed, skipped("KV-L7", "hardware")], True)[0] == "qualified"
    assert report.SKIP_KINDS == tuple(k.value for k in SkipKind)


def test_rows_render_for_the_readme() -> None:
    rows = clauses.as_rows()
    assert [r["clause"] for r in rows] == list(clauses.BY_ID)
    l8 = rows[7]
    assert l8["tests"] == ["test_kv_l8_canonical_honoured", "test_kv_l8_canonical_refused",
                           "test_kv_l8_alias", "test_kv_l8_worker_disagreement",
                           "test_kv_l8_worker_alias", "test_kv_l8_env_honoured",
                           "test_kv_l8_env_refused"]
    a4 = next(r for r in rows if r["clause"] == "KV-A4")
    assert a4["tests"] == ["test_kv_a4_unadopted", "test_kv_a4_unadopted_seam",
                           "test_kv_a4_disagreement", "test_kv_a4_disagreement_seam",
                           "test_kv_a4_contradiction", "test_kv_a4_contradiction_seam"]


def test_every_control_names_a_check_of_the_table() -> None:
    """A check's neighbouring controls are suite tests the table generates; a seam check's
    are seam ones, a backend check's are not (their results share a backend column)."""
    names = clauses.check_names()
    for name, (_, check) in names.items():
        for control in check.controls:
            assert control in names, (name, control)
            assert names[control][1].seam == check.seam, (name, control)
    assert names["test_kv_l8_worker_alias"][1].controls == ("test_kv_l8_worker_disagreement",)
    assert names["test_kv_a4_contradiction_seam"][1].controls == ("test_kv_a3_seam",)


# --- light at import --------------------------------------------------------------------------


def test_importing_the_table_and_the_package_stays_light() -> None:
    code = textwrap.dedent("""
        import sys
        import pytest_kvconform
        import pytest_kvconform.contract.clauses
        assert callable(pytest_kvconform.__getattr__)
        heavy = sorted(m for m in sys.modules
                       if m.split(".")[0] in ("pytest", "_pytest", "torch", "vllm", "vllm_omni",
                                              "numpy"))
        assert heavy == [], heavy
        assert "pytest_kvconform.api" not in sys.modules
    """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT,
                   env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
