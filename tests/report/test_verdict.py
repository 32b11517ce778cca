"""An honest verdict: partial and interrupted runs, harness faults, unwritable outputs.

Pure tests of the verdict, the schema, the fault classifier and the start-up checks
first; then end-to-end runs through pytest (inline, sharing one vllm-omni import),
each asserting the verdict, the exit code, the message and that the summary printed.
"""

from __future__ import annotations

import copy
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from pytest_kvconform.cli import main
from pytest_kvconform.contract import outcome_rule
from pytest_kvconform.contract.outcomes import ErrorKind, HarnessError
from pytest_kvconform.report import build as rp
from pytest_kvconform.session import result_rows, startup, xfails
from tests.conftest import KV_ARGS, needs_omni
from tests.report_rows import ENVIRONMENT, backend_record, build, row
from tests.seeding import Seeder, backends_conftest
from tests.standin_backends import Good

# --------------------------------------------------------------------------- verdict


def test_complete_run_qualifies() -> None:
    assert build([row("a"), row("b")])["verdict"] == "qualified"


@pytest.mark.parametrize(("selection", "phrase"), [
    ({"keyword": "kv_l1", "collected": 258, "selected": 2},
     "-k 'kv_l1' deselected 256 of 258 suite tests"),
    ({"markexpr": "slow", "collected": 3, "selected": 2}, "-m 'slow' deselected 1 of 3"),
    ({"collected": 3, "selected": 2}, "deselection (--deselect, --lf or a plugin) deselected 1"),
    ({"paths": ["suite/test_layout.py"]}, "collection narrowed to suite/test_layout.py"),
    ({"collected": None, "selected": None}, "number of suite tests collected was not reported"),
])
def test_left_out_parts_make_the_run_partial(selection: dict[str, Any], phrase: str) -> None:
    report = build([row("a"), row("b")], **selection)
    assert report["verdict"] == "partial"
    assert phrase in rp.verdict_text(report["verdict"], [], report["selection"], report["run"],
                                     report["results"])
    assert phrase in rp.render_markdown(report)
    report["verdict"] = "qualified"  # as a hand edit would
    with pytest.raises(rp.ReportError, match=r"'qualified' but the results give 'partial'"):
        rp.validate_report(report)


def test_a_backend_scoped_run_is_judged_on_its_backends_own_results() -> None:
    """--kv-backend leaving others out scopes the verdict: the named backend's own results
    decide it; the stack's (a seam control, an upstream clause) are reported apart."""
    own = row("s.py::test_kv_l1[GOOD]", "KV-L1", backend="GOOD")
    seam = row("s.py::test_kv_l6_seam[need_True]", "KV-L6", "failed", backend="need_True")
    upstream = row("s.py::test_kv_s1[LBNHC-c]", "KV-S1", "failed", backend=None)
    report = build([own, seam, upstream], excluded_backends=["FLASH_ATTN", "SAGE"])
    assert report["verdict"] == "qualified"
    assert [r["subject"] for r in report["results"]] == ["backend", "stack", "stack"]
    assert report["stack"]["regressions"] == [seam["nodeid"], upstream["nodeid"]]
    text = rp.verdict_text(report["verdict"], [], report["selection"], report["run"],
                           report["results"])
    assert text == "qualified"
    assert "**Verdict for GOOD: qualified** (strict)" in rp.render_markdown(report)
    # The same results as a whole deployment: the stack's failures are the verdict's.
    assert build([own, seam, upstream])["verdict"] == "not qualified"
    failing = row("s.py::test_kv_l2[GOOD]", "KV-L2", "failed", backend="GOOD")
    assert build([own, failing, seam], excluded_backends=["SAGE"])["verdict"] == "not qualified"


ALIAS_ENTRY = "k.toml:1 */KV-L8/test_kv_l8_alias"
SEAM_ENTRY = "k.toml:6 need_True/KV-L6/test_kv_l6_seam"


def test_each_known_finding_persists_is_fixed_or_a_failure_is_new() -> None:
    """The stack's results by finding: an entry whose failure still shows persists, one
    whose results all pass is fixed, and a failure no entry describes is new; the stack's
    line, the report's record and its Markdown count the three apart."""
    alias = [row(f"s.py::test_kv_l8_alias[{b}]", "KV-L8", "xfailed", backend=b,
                 xfail=ALIAS_ENTRY) for b in ("A", "B")]
    seam = row("s.py::test_kv_l6_seam[need_True]", "KV-L6", "xpassed", backend="need_True",
               xfail=SEAM_ENTRY)
    new = row("s.py::test_kv_s1[LBNHC-c]", "KV-S1", "failed", backend=None)
    report = build([*alias, seam, new], strict=False)
    assert report["stack"]["findings"] == {"persists": [ALIAS_ENTRY], "fixed": [SEAM_ENTRY],
                                           "new": [new["nodeid"]]}
    rp.validate_report(report)
    assert rp.stack_text(report["results"]) == (
        f"1 known finding persists (2 results), 1 fixed (remove their entries, or narrow their "
        f"versions): {SEAM_ENTRY}, 1 new (no known finding describes them): KV-S1 "
        "test_kv_s1[LBNHC-c]")
    md = rp.render_markdown(report)
    assert "1 known findings persist (2 results), 1 fixed, 1 new" in md
    assert f"Known findings that persist:\n\n- `{ALIAS_ENTRY}`" in md
    # A finding with one result passing and one failing as described still persists.
    partly = build([alias[0], {**alias[1], "status": "xpassed"}], strict=False)
    assert partly["stack"]["findings"] == {"persists": [ALIAS_ENTRY], "fixed": [], "new": []}
    assert rp.stack_text(partly["results"]).endswith(
        "known findings that no longer fail on some results (narrow their entries): KV-L8 "
        "test_kv_l8_alias[B]")
    # A report written before findings had a lifetime still validates.
    old = copy.deepcopy(report)
    del old["stack"]["findings"]
    rp.validate_report(old)
    old["stack"]["known"] = []
    with pytest.raises(rp.ReportError, match=r"\$\.stack: does not match the results"):
        rp.validate_report(old)


GHOST_REASON = "backend GHOST is not importable: ModuleNotFoundError: No module named 'x'"


def _ghost(clause: str, test: str, **extra: Any) -> dict[str, Any]:
    """A result of GHOST, a backend that does not import: every one skipped."""
    return row(f"s.py::{test}[GHOST]", clause, "skipped", backend="GHOST", skip_kind="backend",
               reason=f"{clause}: {GHOST_REASON}", **extra)


@pytest.mark.parametrize("strict", [False, True], ids=["non_strict", "strict"])
def test_a_backend_none_of_whose_results_ran_is_not_checked_never_qualified(
        strict: bool) -> None:
    """Nothing ran, nothing qualified: a backend-scoped run of GHOST, a whole deployment
    holding it, with or without --kv-strict, each says it was not checked and why; a known
    finding that declares every one of its skips excuses the deployment, not the backend."""
    ghost = [_ghost("KV-L1", "test_kv_l1"), _ghost("KV-L2", "test_kv_l2"),
             _ghost("KV-L8", "test_kv_l8_alias")]  # KV-L8: the stack's guard, run on it
    good = row("s.py::test_kv_l1[GOOD]", "KV-L1", backend="GOOD")
    why = ("GHOST: not checked (every clause skipped, 2 results; backend skip: "
           f"{GHOST_REASON})")
    scoped = build(ghost, strict=strict, backends=[backend_record("GHOST")],
                   excluded_backends=["GOOD"])
    whole = build([good, *ghost], strict=strict,
                  backends=[backend_record("GOOD"), backend_record("GHOST")])
    for report in (scoped, whole):
        assert report["verdict"] == "not qualified"
        text = rp.verdict_text(report["verdict"], report["uncovered"], report["selection"],
                               report["run"], report["results"])
        assert text == f"not qualified ({why})", text  # named once, not again as unchecked
        assert rp.only_not_checked(report["results"], strict, report["selection"],
                                   report["run"])
        rp.validate_report(report)  # the verdict is the results'
    declared = [{**r, "xfail": "known.toml:1 GHOST/*"} for r in ghost]
    excused = build([good, *declared], strict=strict,
                    backends=[backend_record("GOOD"), backend_record("GHOST")])
    assert excused["verdict"] == "qualified"
    assert "GHOST: not checked (every clause skipped" in rp.describe_uncovered(
        excused["uncovered"][0])
    scoped_declared = build(declared, strict=strict, excluded_backends=["GOOD"],
                            backends=[backend_record("GHOST")])
    assert scoped_declared["verdict"] == "not qualified"
    # A failure elsewhere is what the run exits for, not the unchecked backend.
    failing = row("s.py::test_kv_l2[GOOD]", "KV-L2", "failed", backend="GOOD")
    mixed = build([good, failing, *ghost], strict=strict)
    assert not rp.only_not_checked(mixed["results"], strict, mixed["selection"], mixed["run"])


def test_an_altered_judge_qualifies_nothing_and_says_what_changed() -> None:
    """Whatever the results: not qualified, the change named in the line, the Markdown and
    the report (which validation holds the verdict to)."""
    changed = "pytest_kvconform.suite.check_call.run_check replaced by evil.lenient"
    results = [row("s.py::test_kv_l1[GOOD]")]
    report = rp.build_report(environment=ENVIRONMENT, backends=[backend_record()],
                             results=results, options={}, strict=True,
                             selection=build(results)["selection"], run=rp.run_record(),
                             altered=[changed])
    assert (report["verdict"], report["integrity"]) == ("not qualified", [changed])
    text = rp.verdict_text(report["verdict"], report["uncovered"], report["selection"],
                           report["run"], report["results"], altered=report["integrity"])
    assert text == ("not qualified (the judge was altered after start-up, so nothing here is "
                    "judged (a backend's code ran in the judging process): " + changed + ")")
    assert f"- {changed}" in rp.render_markdown(report)
    hidden = copy.deepcopy(report)
    del hidden["integrity"]  # a hand edit hiding it: the verdict no longer follows
    with pytest.raises(rp.ReportError, match=r"^\$\.verdict: 'not qualified' but the results "
                                             r"give 'qualified'"):
        rp.validate_report(hidden)


def test_a_selection_holding_nothing_applicable_checked_nothing_and_claims_nothing() -> None:
    """-k that leaves a backend only not-applicable skips: partial, not 'not checked'."""
    na = row("s.py::test_kv_l6[GOOD]", "KV-L6", "skipped", skip_kind="not-applicable",
             reason="KV-L6: no paged KV")
    report = build([na], keyword="kv_l6", collected=10, selected=1)
    assert report["verdict"] == "partial"
    assert rp.not_checked(report["results"], declared_ok=False) == []


def _t(test: str, params: str, status: str, clause: str, **extra: Any) -> dict[str, Any]:
    """A row of suite test ``test[params]`` (backend, case from the params)."""
    backend, _, case = params.partition("-")
    return row(f"suite/t.py::{test}[{params}]", clause, status, backend=backend,
               case=case or None, **extra)


def test_the_verdict_names_each_failed_control() -> None:
    """Failures by suite test, the one that differs from its known finding named so."""
    results = [
        _t("test_kv_a4_unadopted", "FLASH_ATTN-bf16_h8", "passed", "KV-A4"),
        _t("test_kv_a4_disagreement", "FLASH_ATTN-bf16_h8", "failed", "KV-A4"),
        _t("test_kv_a4_disagreement", "FLASH_ATTN-ws2", "failed", "KV-A4"),
        _t("test_kv_a4_contradiction", "FLASH_ATTN-bf16_h8", "failed", "KV-A4",
           xfail="k.toml:7 */KV-A4/test_kv_a4_contradiction"),
        *[_t("test_kv_l8_alias", b, "failed", "KV-L8") for b in "ABCDE"],
    ]
    report = build(results)
    line = rp.verdict_text(report["verdict"], report["uncovered"], report["selection"],
                           report["run"], report["results"])
    assert line == ("not qualified (differs from known finding k.toml:7 */KV-A4/"
                    "test_kv_a4_contradiction: KV-A4 test_kv_a4_contradiction[FLASH_ATTN-bf16_h8]"
                    "; failed: KV-A4 test_kv_a4_disagreement[FLASH_ATTN-bf16_h8, FLASH_ATTN-ws2], "
                    "KV-L8 test_kv_l8_alias[A, B, C, +2 more])")
    assert "- failed: KV-A4 test_kv_a4_disagreement[FLASH_ATTN-bf16_h8, FLASH_ATTN-ws2]" in \
        rp.render_markdown(report)


def test_a_pass_is_a_fix_only_while_its_controls_hold() -> None:
    """An xpass whose neighbouring control (the clause table's) failed for the same
    backend and case is no fix; one whose controls held is; KV-L6's seam test is its own
    control across the two needs."""
    alias = _t("test_kv_l8_worker_alias", "FLASH_ATTN", "xpassed", "KV-L8",
               xfail="k.toml:2 */KV-L8/test_kv_l8_worker_alias")
    broken = _t("test_kv_l8_worker_disagreement", "FLASH_ATTN", "failed", "KV-L8")
    held = _t("test_kv_l8_worker_disagreement", "TORCH_SDPA", "failed", "KV-L8")
    assert rp.not_a_fix([alias, broken]) == {alias["nodeid"]: [broken["nodeid"]]}
    assert rp.not_a_fix([alias, held]) == {}  # another backend's control
    assert rp.not_a_fix([alias, {**broken, "status": "xfailed"}]) == {}  # failing as known
    line = rp.verdict_text("not qualified", [], None, rp.run_record(), [alias, broken])
    assert ("passes, but no fix of its known finding: KV-L8 test_kv_l8_worker_alias[FLASH_ATTN] "
            "(its control test_kv_l8_worker_disagreement[FLASH_ATTN] failed)") in line
    assert "xpassed" not in line
    fixed = rp.verdict_text("not qualified", [], None, rp.run_record(), [alias])
    assert "xpassed (a known finding no longer fails: remove its entry): KV-L8 " \
        "test_kv_l8_worker_alias[FLASH_ATTN]" in fixed
    need_true = _t("test_kv_l6_seam", "need_True", "xpassed", "KV-L6")
    need_false = _t("test_kv_l6_seam", "need_False", "failed", "KV-L6")
    assert rp.not_a_fix([need_true, need_false]) == {need_true["nodeid"]: [need_false["nodeid"]]}
    contradiction = _t("test_kv_a4_contradiction_seam", "need_True-bf16_h8", "xpassed", "KV-A4")
    allocation = _t("test_kv_a3_seam", "need_True-bf16_h8", "failed", "KV-A3")
    other_case = _t("test_kv_a3_seam", "need_True-ws2", "failed", "KV-A3")
    assert rp.not_a_fix([contradiction, allocation, other_case]) == {
        contradiction["nodeid"]: [allocation["nodeid"]]}


def test_unrecorded_selection_is_at_best_partial() -> None:
    report = rp.build_report(environment=ENVIRONMENT, backends=[backend_record()],
                             results=[row("a")], options={}, strict=True)
    assert report["selection"] is None
    assert report["verdict"] == "partial"


def test_interruption_wins_and_missing_results_mean_interrupted() -> None:
    stopped = build([row("a")], interruption="KeyboardInterrupt")
    assert stopped["verdict"] == "interrupted"
    assert "Interrupted: KeyboardInterrupt." in rp.render_markdown(stopped)
    failed_then_stopped = build([row("a", status="failed")],
                                interruption="stopping after 1 failures")
    assert failed_then_stopped["verdict"] == "interrupted"
    short = build([row("a")], collected=3, selected=3)  # two selected tests never reported
    assert short["verdict"] == "interrupted"
    assert rp.interruption_of(short["run"], short["selection"], short["results"]) == (
        "2 of 3 selected suite tests did not run")


def test_failure_in_a_partial_run_is_not_qualified() -> None:
    report = build([row("a", status="failed")], keyword="kv_l1", collected=9, selected=1)
    assert report["verdict"] == "not qualified"


def test_more_results_than_selected_tests_is_refused() -> None:
    report = build([row("a"), row("b")])
    report["selection"].update(collected=1, selected=1)
    with pytest.raises(rp.ReportError, match=r"^\$\.selection\.selected: 1 tests selected"):
        rp.validate_report(report)


@pytest.mark.parametrize("where", ["result", "run"])
def test_non_finite_numbers_are_refused(tmp_path: Path, capsys: Any, where: str) -> None:
    report = build([row("a")])
    if where == "result":
        report["results"][0]["duration_s"] = float("nan")
        path = "$.results[0].duration_s"
    else:
        report["run"]["duration_s"] = float("inf")
        path = "$.run.duration_s"
    with pytest.raises(rp.ReportError) as info:
        rp.validate_report(report)
    assert info.value.path == path
    bad = tmp_path / "nan.json"
    bad.write_text(json.dumps(report))  # Python writes NaN / Infinity; JSON has neither
    assert main(["validate", str(bad)]) == 2
    assert f"{bad}: {path}: expected a finite number" in capsys.readouterr().err
    good = tmp_path / "good.json"
    good.write_text(json.dumps(build([row("a")])))
    assert main(["merge", str(good), str(bad)]) == 2


def test_merge_refuses_the_same_run_twice(tmp_path: Path, capsys: Any) -> None:
    a = tmp_path / "a.json"
    a.write_text(json.dumps(build([row("a")])))
    copy = tmp_path / "copy.json"
    copy.write_text(a.read_text())
    for pair in ([a, a], [a, copy]):
        assert main(["merge", *map(str, pair)]) == 2
        err = capsys.readouterr().err
        assert f"{pair[0]} and {pair[1]} are the same run" in err
        assert "host 'box'" in err and "merge each host's report once" in err
    other = tmp_path / "other.json"  # the same host, another run: fine
    other.write_text(json.dumps(build([row("a")])))
    assert main(["merge", str(a), str(other)]) == 0


def test_merged_verdict_is_the_worst_host() -> None:
    reports = [build([row("a")]), build([row("a")], keyword="kv")]
    assert rp.merged_verdict(reports) == "partial"
    assert "**Verdict: partial**" in rp.render_merged_markdown(
        [("a.json", reports[0]), ("b.json", reports[1])])


def test_error_rows_carry_their_kind() -> None:
    results = [row("a"), row("b", status="error", error_kind="worker-died",
                             reason="worker pid 7 died (exit code -9)")]
    report = build(results, strict=False)
    assert report["verdict"] == "not qualified"
    md = rp.render_markdown(report)
    assert "| GOOD | error 1/2[^1] |" in md
    assert "[^1]: error (worker-died): worker pid 7 died (exit code -9)" in md
    assert "Harness errors (E; the harness failed, not the backend): worker-died 1." in md
    matrix = rp.render_terminal_matrix(report["results"], [backend_record()])
    assert matrix[1].split() == ["GOOD", "E"]
    bad = json.loads(json.dumps(report))
    bad["results"][1]["error_kind"] = "gremlins"
    with pytest.raises(rp.ReportError, match=r"error_kind: expected one of worker-died"):
        rp.validate_report(bad)
    bad["results"][1]["error_kind"] = None
    bad["results"][0]["error_kind"] = "oom"
    with pytest.raises(rp.ReportError, match=r"results\[0\]\.error_kind: set on a 'passed'"):
        rp.validate_report(bad)


# ------------------------------------------------ what the verdict did not check, and why


SAGE3_ENTRY = "known.toml:1 SAGE3/*"


def _unchecked_run() -> dict[str, Any]:
    """GOOD passes but for KV-L7 (no CUDA); SAGE3 does not import, declared in the xfails."""
    results = [
        row("t::test_kv_l1[GOOD]"),
        row("t::test_kv_l7[GOOD]", "KV-L7", "skipped", skip_kind="hardware",
            reason="KV-L7: needs CUDA"),
        row("t::test_kv_l6[GOOD]", "KV-L6", "skipped", skip_kind="not-applicable",
            reason="KV-L6: nothing to check"),
        *(row(f"t::test_kv_{c[3:].lower()}[SAGE3]", c, "skipped", backend="SAGE3",
              skip_kind="backend", xfail=SAGE3_ENTRY,
              reason=f"{c}: backend SAGE3 is not importable: ImportError: sageattn3")
          for c in ("KV-L1", "KV-L7")),
    ]
    return build(results, backends=[backend_record("GOOD"), backend_record("SAGE3")])


def test_a_qualified_verdict_names_what_it_left_unchecked() -> None:
    """A backend whose whole row was skipped, and a clause left to missing hardware: in
    the verdict line, the Markdown's Verdict section and the JSON, with the reason."""
    report = _unchecked_run()
    assert report["verdict"] == "qualified"
    assert report["uncovered"] == [
        {"scope": "backend", "backend": "SAGE3", "clauses": ["KV-L1", "KV-L7"],
         "kind": "backend", "declared": [SAGE3_ENTRY],
         "reason": "backend SAGE3 is not importable: ImportError: sageattn3", "results": 2},
        {"scope": "clause", "backend": "GOOD", "clauses": ["KV-L7"], "kind": "hardware",
         "declared": [], "reason": "needs CUDA", "results": 1},
    ]
    line = rp.verdict_text(report["verdict"], report["uncovered"], report["selection"],
                           report["run"], report["results"])
    assert line == ("qualified (unchecked: SAGE3: not checked (every clause skipped, 2 results; "
                    "backend skip, declared: backend SAGE3 is not importable: ImportError: "
                    "sageattn3); "
                    "KV-L7 for GOOD (1 result; hardware skip: needs CUDA))")
    md = rp.render_markdown(report)
    verdict_section = md.split("## Verdict")[1].split("## Environment")[0]
    assert ("- SAGE3: not checked (every clause skipped, 2 results; backend skip, declared: "
            "backend SAGE3 is not importable: ImportError: sageattn3)") in verdict_section
    assert "- KV-L7 for GOOD (1 result; hardware skip: needs CUDA)" in verdict_section
    assert "KV-L6" not in verdict_section  # not applicable: nothing was left unchecked
    hidden = copy.deepcopy(report)
    hidden["uncovered"] = hidden["uncovered"][1:]  # as a hand edit would hide the backend
    with pytest.raises(rp.ReportError, match=r"^\$\.uncovered: expected"):
        rp.validate_report(hidden)
    bad = copy.deepcopy(report)
    bad["uncovered"][0]["scope"] = "host"
    with pytest.raises(rp.ReportError, match=r"^\$\.uncovered\[0\]\.scope: expected one of"):
        rp.validate_report(bad)


def test_merge_keeps_what_no_host_checked(tmp_path: Path, capsys: Any) -> None:
    """A GPU host that ran KV-L7 for GOOD covers the CPU host's hardware gap; nobody ran
    SAGE3."""
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps(_unchecked_run()))
    gpu_rows = [row("t::test_kv_l7[GOOD]", "KV-L7", device="cuda:0")]
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps(build(gpu_rows, env={**ENVIRONMENT, "host": "gpu"})))
    assert main(["merge", str(cpu), str(gpu)]) == 0
    md = capsys.readouterr().out.splitlines()
    at = md.index("Not checked by any host:")
    assert md[at + 2:at + 4] == [
        "- SAGE3: not checked (every clause skipped, 2 results; backend skip, declared: "
        "backend SAGE3 is not importable: ImportError: sageattn3)", ""]


def _failed_plugin(**changes: Any) -> dict[str, Any]:
    plugin = {"group": "vllm_omni.general_plugins", "name": "broken", "value": "pkg:explode",
              "dist": "pkg 1.0", "status": "hook-failed", "error": "RuntimeError: boom",
              "changed": []}
    return {"mode": "production", "vllm_plugins": None, "loader": "x", "overrides": {},
            "origins": {}, "platform": None, "platform_source": None, "notes": [],
            "plugins": [{**plugin, **changes}]}


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
def test_a_plugin_hook_that_raises_is_not_qualified_and_named(strict: bool) -> None:
    """Production's loaders call hooks unguarded: the deployment does not start."""
    env = {**ENVIRONMENT, "plugins": _failed_plugin()}
    report = build([row("a"), row("b")], strict=strict, env=env)
    assert report["verdict"] == "not qualified"
    assert report["startup_failures"] == [
        {"plugin": "broken", "group": "vllm_omni.general_plugins", "distribution": "pkg 1.0",
         "error": "RuntimeError: boom"}]
    line = rp.verdict_text(report["verdict"], report["uncovered"], report["selection"],
                           report["run"], report["results"], report["startup_failures"])
    assert line == ("not qualified (production would not start: plugin broken "
                    "(vllm_omni.general_plugins, pkg 1.0) hook raised RuntimeError: boom)")
    verdict_section = rp.render_markdown(report).split("## Verdict")[1]
    assert ("- plugin broken (vllm_omni.general_plugins, pkg 1.0) hook raised RuntimeError: "
            "boom") in verdict_section
    dropped = copy.deepcopy(report)
    dropped["startup_failures"] = []
    with pytest.raises(rp.ReportError, match=r"^\$\.startup_failures: expected \[\{'plugin': "
                                             r"'broken'"):
        rp.validate_report(dropped)
    # A plugin that fails to import is what production logs and skips: not a finding.
    skipped = {**ENVIRONMENT, "plugins": _failed_plugin(status="load-failed")}
    assert build([row("a")], strict=strict, env=skipped)["verdict"] == "qualified"


def test_results_under_a_seeded_fault_are_named_and_block() -> None:
    """A result whose workers ran under $KVCONFORM_WORKER_FAULT speaks for the fault."""
    results = [row("a"), row("b", "KV-A3", "failed", reason="KV-A3 violated",
                             seeded_fault="wrong_offset")]
    env = {**ENVIRONMENT, "seeded_faults": ["wrong_offset"]}
    report = build(results, strict=False, env=env)
    assert report["verdict"] == "not qualified"
    assert report["summary"]["blocking"] == ["b"]
    line = rp.verdict_text(report["verdict"], report["uncovered"], report["selection"],
                           report["run"], report["results"])
    assert "seeded worker fault wrong_offset in 1 result(s)" in line
    md = rp.render_markdown(report)
    assert "| seeded worker fault | wrong_offset ($KVCONFORM_WORKER_FAULT) |" in md
    assert "[^1]: fail (under the seeded worker fault wrong_offset): KV-A3 violated" in md
    assert "Seeded worker fault `wrong_offset` (`$KVCONFORM_WORKER_FAULT`) was active: 1 " \
        "result(s)" in md
    passing = build([row("a", seeded_fault="wrong_offset")], env=env)
    assert passing["verdict"] == "not qualified"  # even a pass qualifies nothing under it
    unrecorded = copy.deepcopy(report)
    del unrecorded["environment"]["seeded_faults"]
    with pytest.raises(rp.ReportError, match=r"results\[1\]\.seeded_fault: 'wrong_offset' is "
                                             r"not in \$\.environment\.seeded_faults"):
        rp.validate_report(unrecorded)


# --------------------------------------------------------------------------- faults


def _raise_value_error() -> None:
    raise ValueError("raised outside the plugin, as installed code would")


def test_harness_kind_classifies_what_escapes_a_check() -> None:
    def caught(fn: Any) -> BaseException:
        try:
            fn()
        except BaseException as exc:
            return exc
        raise AssertionError("did not raise")

    assert outcome_rule.harness_kind(HarnessError("x", kind=ErrorKind.TIMEOUT)) is ErrorKind.TIMEOUT
    assert outcome_rule.harness_kind(HarnessError("x")) is ErrorKind.HARNESS
    assert outcome_rule.harness_kind(MemoryError()) is ErrorKind.OOM
    torch_oom = type("OutOfMemoryError", (RuntimeError,), {})()
    assert outcome_rule.harness_kind(torch_oom) is ErrorKind.OOM
    assert outcome_rule.harness_kind(AssertionError("clause")) is None
    assert outcome_rule.harness_kind(KeyboardInterrupt()) is None
    # Installed code raising through a check stays a clause outcome...
    assert outcome_rule.harness_kind(caught(_raise_value_error)) is None
    # ...the plugin's own code raising is a harness fault.
    plugin_bug = caught(lambda: rp.clause_sort_key(None))  # type: ignore[arg-type]
    assert outcome_rule.raised_in_plugin(plugin_bug)
    assert outcome_rule.harness_kind(plugin_bug) is ErrorKind.HARNESS


@pytest.mark.parametrize(("value", "absorbs"), [
    ("true", {"worker-died", "timeout", "oom", "harness"}),
    ("false", set()),
    ('"oom"', {"oom"}),
    ('["timeout", "worker-died"]', {"timeout", "worker-died"}),
])
def test_xfail_entries_absorb_errors_only_when_they_say_so(tmp_path: Path, value: str,
                                                           absorbs: set[str]) -> None:
    f = tmp_path / "x.toml"
    f.write_text(f'[[xfail]]\nbackend = "A"\nclause = "KV-A3"\ntest = "test_kv_a3"\n'
                 f'reason = "r"\nerrors = {value}\nmatch = "x"\n'
                 '[[xfail]]\nbackend = "A"\nclause = "KV-A3"\ntest = "test_kv_a3"\n'
                 'reason = "plain"\nmatch = "x"\n')
    with_key, plain = xfails.load_xfails(f)
    assert {k for k in outcome_rule.ErrorKind if with_key.absorbs_error(k.value)} == absorbs
    assert not any(plain.absorbs_error(k.value) for k in outcome_rule.ErrorKind)


def test_xfail_errors_key_is_validated(tmp_path: Path) -> None:
    f = tmp_path / "x.toml"
    f.write_text('[[xfail]]\nbackend = "A"\nclause = "KV-A3"\ntest = "test_kv_a3"\n'
                 'reason = "r"\nerrors = "gremlin"\n')
    with pytest.raises(xfails.XfailFileError, match=r"x\.toml: \[\[xfail\]\] entry 1: key "
                       r"'errors': unknown harness-error kind 'gremlin'"):
        xfails.load_xfails(f)


# --------------------------------------------------------------------------- start-up checks


def _sys_is_writable() -> bool:
    try:
        startup.check_report_path(Path("/sys/kvconform-r.json"))
    except startup.StartupError:
        return False
    return True


def test_report_path_checks(tmp_path: Path) -> None:
    assert startup.check_report_path(tmp_path / "r.json") == (tmp_path / "r.json",
                                                              tmp_path / "r.md")
    # A .md path is understood: Markdown there, JSON next to it.
    assert startup.check_report_path(tmp_path / "r.md") == (tmp_path / "r.json",
                                                            tmp_path / "r.md")
    with pytest.raises(startup.StartupError, match="is a directory; give a file path"):
        startup.check_report_path(tmp_path)
    (tmp_path / "d.md").mkdir()
    with pytest.raises(startup.StartupError, match=r"d\.md is a directory"):
        startup.check_report_path(tmp_path / "d.json")
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(startup.StartupError, match=r"file is not a directory"):
        startup.check_report_path(a_file / "r.json")  # refused even for root
    with pytest.raises(startup.StartupError, match="does not exist"):
        startup.check_report_path(tmp_path / "no" / "r.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.md", "file"]  # no probe left


@pytest.mark.skipif(_sys_is_writable(), reason="/sys is writable here")
def test_report_path_in_a_directory_nobody_may_write(tmp_path: Path) -> None:
    with pytest.raises(startup.StartupError, match=r"directory /sys is not writable"):
        startup.check_report_path(Path("/sys/r.json"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a mode-0555 directory")
def test_report_path_in_a_read_only_directory(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(startup.StartupError, match=r"ro is not writable"):
            startup.check_report_path(ro / "r.json")
    finally:
        ro.chmod(0o755)


def test_reports_are_written_with_the_usual_mode(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        json_path, md_path, page = rp.write_report(tmp_path / "r.md", build([row("a")]))
    finally:
        os.umask(old)
    assert (json_path.name, md_path.name, page.name) == ("r.json", "r.md", "r.html")
    for path in (json_path, md_path, page):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
    # No temp file; the report's lock (private) stays.
    assert sorted(p.name for p in tmp_path.iterdir()) == [".r.json.lock", "r.html", "r.json",
                                                          "r.md"]


# --------------------------------------------------------------------------- end to end

# GOOD and OTHER: two registered stand-ins; ``import pytest`` for the hooks added below.
STAND_INS = "import pytest\n" + backends_conftest({"GOOD": Good, "OTHER": Good})
# Stop the session after the first suite test, as Ctrl-C would.  A registered plugin,
# not a conftest hook: the suite's tests live outside this conftest's directory.
CTRL_C = '''

class _CtrlC:
    def pytest_runtest_logfinish(self, nodeid, location):
        raise KeyboardInterrupt


def pytest_configure(config):
    config.pluginmanager.register(_CtrlC())
'''
# The plugin's own bug: a broken constant inside checks/layout.py (restored afterwards).
PLUGIN_BUG = '''

import pytest_kvconform.checks.layout as _layout
_CALLS = _layout._CALLS


def pytest_configure(config):
    _layout._CALLS = "three"


def pytest_unconfigure(config):
    _layout._CALLS = _CALLS
'''
KV_L1 = ("-k", "kv_l1 and not name", "--kv-backend", "GOOD")


def _summary_printed(result: pytest.RunResult) -> None:
    result.stdout.fnmatch_lines(["*kvconform: backend x clause*", "backend *",
                                 "legend: *E error*"])


@needs_omni
def test_k_selected_strict_run_is_partial(pytester: pytest.Pytester, kv_run: Any) -> None:
    pytester.makeconftest(STAND_INS)
    (pytester.path / "out").mkdir()
    result = kv_run(*KV_L1, "--kv-strict", "--kv-report", "out/r.json")
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # everything that ran passed
    result.assert_outcomes(passed=1)
    _summary_printed(result)
    # Scoped to GOOD (--kv-backend): the backends left out do not make it partial, -k does.
    result.stdout.fnmatch_lines(["*kvconform: verdict for GOOD: partial (left out: -k 'kv_l1 "
                                 "and not name' deselected * of * suite tests)"])
    data = json.loads((pytester.path / "out" / "r.json").read_text())
    rp.validate_report(data)
    assert data["verdict"] == "partial"
    sel = data["selection"]
    assert (sel["keyword"], sel["backends"], sel["selected"]) == ("kv_l1 and not name", ["GOOD"],
                                                                  1)
    assert "OTHER" in sel["excluded_backends"]
    assert sel["collected"] > 1 and sel["deselected"] == sel["collected"] - 1
    assert data["run"]["interruption"] is None and data["run"]["id"]
    # Without --kv-strict the verdict is the same; the exit code is pytest's.
    lenient = kv_run(*KV_L1)
    assert lenient.ret == pytest.ExitCode.OK
    lenient.stdout.fnmatch_lines(["*kvconform: verdict*: partial*"])


@needs_omni
def test_interrupted_run_says_interrupted(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(STAND_INS + CTRL_C)
    result = pytester.runpytest(*KV_ARGS, "-k", "kv_l1", "--kv-backend", "GOOD", "--kv-backend",
                                "OTHER", "--kv-report", "r.md", no_reraise_ctrlc=True)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    _summary_printed(result)
    result.stdout.fnmatch_lines(["*kvconform: verdict*: interrupted (interrupted: "
                                 "KeyboardInterrupt*"])
    data = json.loads((pytester.path / "r.json").read_text())  # .md understood
    rp.validate_report(data)
    assert (data["verdict"], data["run"]["interruption"]) == ("interrupted", "KeyboardInterrupt")
    assert data["summary"]["total"] == 1
    assert "Interrupted: KeyboardInterrupt." in (pytester.path / "r.md").read_text()


def _interrupt(*args: Any, **kwargs: Any) -> None:
    raise KeyboardInterrupt


def test_ctrl_c_before_the_results_plugin_exists_still_reports(
        pytester: pytest.Pytester, seed: Seeder) -> None:
    """The first thing the plugin does, its start-up checks, interrupted: still a verdict
    line and a valid report (the run is in this process, so the seed reaches it)."""
    seed.replace("pytest_kvconform.session.startup.check_report_path", _interrupt)
    result = pytester.runpytest(*KV_ARGS, "--kv-report", "r.json", no_reraise_ctrlc=True)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["kvconform: verdict: interrupted (interrupted: "
                                 "KeyboardInterrupt during start-up, before any test was "
                                 "collected*",
                                 "kvconform: report written to r.json, r.md and r.html"])
    data = json.loads((pytester.path / "r.json").read_text())
    rp.validate_report(data)
    assert (data["verdict"], data["results"]) == ("interrupted", [])


# Ctrl-C as collection starts: nothing was matched against the xfail entries yet.
CTRL_C_COLLECTING = '''

class _CtrlC:
    def pytest_collectstart(self, collector):
        raise KeyboardInterrupt


def pytest_configure(config):
    config.pluginmanager.register(_CtrlC())
'''


def test_ctrl_c_before_collection_warns_of_no_stale_entry(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CTRL_C_COLLECTING)
    known = pytester.makefile(".toml", known='''
        [[xfail]]
        backend = "*"
        clause = "KV-L8"
        test = "test_kv_l8_alias"
        match = "KeyError"
        reason = "would match, had collection run"
    ''')
    result = pytester.runpytest(*KV_ARGS, "--kv-xfails", str(known), "--kv-report", "r.json",
                                no_reraise_ctrlc=True)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*kvconform: verdict*: interrupted (interrupted: "
                                 "KeyboardInterrupt*"])
    assert "stale known-finding entr" not in result.stdout.str()
    rp.validate_report(json.loads((pytester.path / "r.json").read_text()))


def test_a_crashed_tests_properties_are_read_back_from_its_id() -> None:
    """xdist reports a dead worker's test by id alone when it died in set-up."""
    known = {"backends": ["FLASH_ATTN", "FLASH_ATTN_3_HUB"], "layouts": ["LBNHC", "BLNHC"],
             "cases": ["bf16_h8", "ws2"], "device": "cpu"}
    props = result_rows.properties_from_id(
        "suite/test_table.py::test_kv_a2[FLASH_ATTN_3_HUB-ws2]", **known)
    assert props == [("kv_clause", "KV-A2"), ("kv_backend", "FLASH_ATTN_3_HUB"),
                     ("kv_layout", None), ("kv_case", "ws2"), ("kv_device", "cpu")]
    props = result_rows.properties_from_id("s.py::test_kv_s1[BLNHC-bf16_h8]", **known)
    assert dict(props or [])["kv_layout"] == "BLNHC"
    seam = result_rows.properties_from_id("s.py::test_kv_a3_seam[need_True-ws2]", **known)
    assert dict(seam or [])["kv_backend"] == "need_True"
    assert result_rows.properties_from_id("t.py::test_other[x]", **known) is None


@needs_omni
def test_maxfail_stop_is_interrupted(pytester: pytest.Pytester, kv_run: Any) -> None:
    pytester.makeconftest(STAND_INS + PLUGIN_BUG)
    result = kv_run("-x", "-k", "kv_l1 or kv_l2", "--kv-backend", "GOOD", "--kv-strict")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    _summary_printed(result)
    result.stdout.fnmatch_lines(["*kvconform: verdict*: interrupted (interrupted: stopping after "
                                 "1 failures*"])


@needs_omni
def test_plugin_bug_is_an_error_never_a_failure(pytester: pytest.Pytester, kv_run: Any) -> None:
    pytester.makeconftest(STAND_INS + PLUGIN_BUG)
    plain = pytester.makefile(".toml", plain='''
        [[xfail]]
        backend = "GOOD"
        clause = "KV-L1"
        test = "test_kv_l1"
        match = "."
        reason = "a clause failure only"
    ''')
    result = kv_run(*KV_L1, "--kv-xfails", str(plain), "--kv-report", "r.json")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(failed=1)  # the xfail entry did not absorb it
    _summary_printed(result)
    result.stdout.fnmatch_lines(["GOOD *E", "*1 harness error(s) (harness): the harness failed, "
                                 "not the backend*", "*verdict*: not qualified*"])
    (row_,) = json.loads((pytester.path / "r.json").read_text())["results"]
    assert (row_["status"], row_["error_kind"]) == ("error", "harness")
    assert "TypeError" in row_["reason"]
    declared = pytester.makefile(".toml", declared='''
        [[xfail]]
        backend = "GOOD"
        clause = "KV-L1"
        test = "test_kv_l1"
        reason = "the harness is known broken here"
        errors = ["harness"]
    ''')
    absorbed = kv_run(*KV_L1, "--kv-xfails", str(declared), "--kv-report", "r2.json")
    absorbed.assert_outcomes(xfailed=1)
    (row_,) = json.loads((pytester.path / "r2.json").read_text())["results"]
    assert (row_["status"], row_["error_kind"]) == ("xfailed", "harness")


# Kill the rank-0 worker before adoption; the harness must call it worker-died.
WORKER_KILL = '''

import pytest_kvconform.workers.deployment as _deployment
from pytest_kvconform.contract.outcomes import ErrorKind, HarnessError

_START = _deployment.start


def _killed(spec, handles, **kwargs):
    try:
        handles[0].request("crash", text="seeded: worker killed", code=9)
    except HarnessError:
        raise  # the worker harness already says what happened
    except Exception as exc:  # before workers.py raises HarnessError kinds itself
        raise HarnessError(str(exc), kind=ErrorKind.WORKER_DIED) from exc
    raise AssertionError("the crash command returned")


def pytest_configure(config):
    _deployment.start = _killed


def pytest_unconfigure(config):
    _deployment.start = _START
'''


@needs_omni
def test_killed_worker_is_an_error_of_kind_worker_died(pytester: pytest.Pytester,
                                                      kv_run: Any) -> None:
    pytester.makeconftest(STAND_INS + WORKER_KILL)
    entry = pytester.makefile(".toml", known='''
        [[xfail]]
        backend = "*"
        clause = "KV-A3"
        test = "test_kv_a3_seam"
        match = "."
        reason = "would silently absorb a crash if errors matched"
    ''')
    result = kv_run("-k", "test_kv_a3_seam and need_False and bf16_h8", "--kv-xfails",
                    str(entry), "--kv-report", "r.json", "--kv-strict")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(failed=1)
    _summary_printed(result)
    result.stdout.fnmatch_lines(["need_False *E", "*harness error(s) (worker-died)*"])
    (row_,) = json.loads((pytester.path / "r.json").read_text())["results"]
    assert (row_["status"], row_["error_kind"], row_["clause"]) == ("error", "worker-died",
                                                                     "KV-A3")
    assert "KV-A3 violated" not in row_["reason"]
    assert "error (worker-died)" in (pytester.path / "r.md").read_text()


@needs_omni
def test_suite_path_argument_is_partial(pytester: pytest.Pytester, kv_run: Any) -> None:
    pytester.makeconftest(STAND_INS)
    suite_file = Path(rp.__file__).parents[1] / "suite" / "test_nullblock.py"
    result = kv_run(str(suite_file), "-k", "kv_n1", "--kv-report", "r.json")
    assert result.ret == pytest.ExitCode.OK
    _summary_printed(result)
    result.stdout.fnmatch_lines([f"*kvconform: verdict*: partial (left out: *collection narrowed "
                                 f"to {suite_file}*"])
    data = json.loads((pytester.path / "r.json").read_text())
    assert data["selection"]["paths"] == [str(suite_file)]
    assert data["verdict"] == "partial"


@needs_omni
def test_unwritable_report_at_the_end_still_prints_the_summary(pytester: pytest.Pytester,
                                                               kv_run: Any) -> None:
    # The directory is replaced by a file after start-up, before the report is written.
    pytester.makeconftest(STAND_INS + '''

import shutil
from pathlib import Path


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    shutil.rmtree("out")
    Path("out").write_text("not a directory any more")
''')
    (pytester.path / "out").mkdir()
    result = kv_run(*KV_L1, "--kv-report", "out/r.json")
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # the test passed; the report is lost
    result.assert_outcomes(passed=1)
    _summary_printed(result)
    result.stdout.fnmatch_lines(["*kvconform: verdict*: partial*",
                                 "*kvconform: ERROR: the report could not be written to "
                                 "out/r.json: File exists: *out*"])
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    assert "pytest_sessionfinish" not in result.stdout.str() + result.stderr.str()


def test_raising_backends_hook_is_a_usage_error(pytester: pytest.Pytester, kv_run: Any) -> None:
    pytester.makeconftest('''
        def pytest_kvconform_backends(config):
            raise RuntimeError("registry offline")
    ''')
    result = kv_run("--collect-only")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*kvconform: the pytest_kvconform_backends hook in "
                                 f"{pytester.path / 'conftest.py'} raised RuntimeError: "
                                 "registry offline (at *conftest.py:2)*"])
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()


def test_report_path_is_a_directory_is_a_usage_error(pytester: pytest.Pytester,
                                                      kv_run: Any) -> None:
    (pytester.path / "out").mkdir()
    result = kv_run("--kv-report", "out")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kv-report: out is a directory; give a file path such as "
                                 "out/report.json*"])


# Records, at the very end of the process, whether the serving stack was imported.
IMPORT_PROBE = '''
import sys
from pathlib import Path


def pytest_unconfigure(config):
    heavy = sorted(m for m in ("torch", "vllm", "vllm_omni") if m in sys.modules)
    Path("heavy.txt").write_text(",".join(heavy))
'''


def _read_only_dir(pytester: pytest.Pytester) -> str:
    """A directory this process truly cannot write into, root or not."""
    if os.geteuid() != 0:
        ro = pytester.mkdir("ro")
        ro.chmod(0o555)
        return str(ro)
    if not _sys_is_writable():
        return "/sys"
    pytest.skip("no directory is read-only for root here")


@pytest.mark.parametrize("bad", ["read-only report dir", "bad xfails"])
def test_startup_errors_come_before_discovery(pytester: pytest.Pytester, bad: str) -> None:
    pytester.makeconftest(IMPORT_PROBE)
    if bad == "read-only report dir":
        directory = _read_only_dir(pytester)
        args = ["--kv-report", f"{directory}/r.json"]
        expected = f"*--kv-report: {directory}/r.json: directory {directory} is not writable*"
    else:
        pytester.makefile(".toml", bad="[[xfail]]\nbackend = 'A'\n")
        args = ["--kv-xfails", "bad.toml"]
        expected = "*--kv-xfails: bad.toml: [[]*xfail]] entry 1: key 'clause': missing*"
    result = pytester.runpytest_subprocess(*KV_ARGS, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([expected])
    assert (pytester.path / "heavy.txt").read_text() == ""  # nothing heavy imported
    assert not list(Path(pytester.path).glob("**/.kvconform-probe-*"))


# --------------------------------------------------------------------------- kvconform run


@needs_omni
def test_kvconform_run_keeps_the_report_where_asked_or_says_none(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    pytester.makeconftest(STAND_INS)

    def inline_main(args: list[str], plugins: Any = ()) -> int:
        return int(pytester.inline_run(*args, "-p", "no:cacheprovider", "-p", "no:xdist",
                                       plugins=list(plugins)).ret)

    monkeypatch.setattr(pytest, "main", inline_main)
    assert main(["run", "--report", "kept.md", *KV_L1]) == 0
    out = capsys.readouterr().out
    assert (pytester.path / "kept.json").is_file() and (pytester.path / "kept.md").is_file()
    assert "**Verdict for GOOD: partial** (non-strict)" in out
    assert main(["run", *KV_L1]) == 0
    out = capsys.readouterr().out
    assert "**Verdict for GOOD: partial** (non-strict)" in out
    assert out.rstrip().endswith("kvconform: no report file kept (pass --report PATH to keep "
                                 "one)")
    assert "report written to" not in out
    assert sorted(p.name for p in pytester.path.iterdir() if p.suffix in (".json", ".md")) == [
        "kept.json", "kept.md"]


# The worker for the test cannot even start: raised in the test body, before run_check.
WORKER_NO_START = '''

import pytest_kvconform.workers.kv_workers as _kv_workers
import pytest_kvconform.workers.protocol as _protocol

_FOR_WORLD_SIZE = _kv_workers.KvWorkers.for_world_size


def _no_start(self, n):
    raise _protocol.WorkerTimeout("seeded: worker cpu#0 did not answer 'start-up' within 1s")


def pytest_configure(config):
    _kv_workers.KvWorkers.for_world_size = _no_start


def pytest_unconfigure(config):
    _kv_workers.KvWorkers.for_world_size = _FOR_WORLD_SIZE
'''


@needs_omni
def test_worker_that_cannot_start_is_an_error_not_a_failure(pytester: pytest.Pytester,
                                                            kv_run: Any) -> None:
    pytester.makeconftest(STAND_INS + WORKER_NO_START)
    result = kv_run("-k", "test_kv_a2_seam and need_False and bf16_h8", "--kv-report", "r.json")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    _summary_printed(result)
    result.stdout.fnmatch_lines(["need_False *E", "*harness error(s) (timeout)*"])
    (row_,) = json.loads((pytester.path / "r.json").read_text())["results"]
    assert (row_["status"], row_["error_kind"], row_["clause"]) == ("error", "timeout", "KV-A2")
    assert "did not answer 'start-up'" in row_["reason"]
