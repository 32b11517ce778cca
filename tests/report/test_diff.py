"""``kvconform diff A B``: what changed between two reports, and the gate's exit code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pytest_kvconform.cli import main
from pytest_kvconform.report.build import build_matrix, run_record, write_matrix
from pytest_kvconform.report.diff import diff_matrices, diff_reports
from tests.paths import ROOT
from tests.report_rows import backend_record, build, environment, row

KNOWN = "known.toml:3 GOOD/KV-L8"


def report_a() -> dict[str, Any]:
    return build([
        row("s::test_kv_l1[GOOD]"),
        row("s::test_kv_l2[GOOD]", "KV-L2", "failed", reason="KV-L2 violated: pinned BLNHC"),
        row("s::test_kv_l3[GOOD]", "KV-L3", "failed", reason="KV-L3 violated: kept LBHNC"),
        row("s::test_kv_l8_alias[GOOD]", "KV-L8", "xfailed", xfail=KNOWN,
            reason="KV-L8 violated: KeyError 'HND'"),
        row("s::test_kv_s1[LBNHC-bf16_h8]", "KV-S1", backend=None, layout="LBNHC"),
        row("s::test_kv_s2[LBNHC-bf16_h8]", "KV-S2", backend=None, layout="LBNHC"),
        row("s::test_kv_n1[bf16_h8]", "KV-N1", "skipped", backend=None,
            reason="KV-N1: vllm-omni not installed", skip_kind="environment"),
    ], strict=False, options={"xfails": "known.toml"})


def report_b() -> dict[str, Any]:
    return build([
        row("s::test_kv_l1[GOOD]", "KV-L1", "failed", reason="KV-L1 violated: returned 1"),
        row("s::test_kv_l2[GOOD]", "KV-L2", "passed"),
        row("s::test_kv_l3[GOOD]", "KV-L3", "failed", reason="KV-L3 violated: kept LBHNC"),
        row("s::test_kv_l8_alias[GOOD]", "KV-L8", "passed"),
        row("s::test_kv_s1[LBNHC-bf16_h8]", "KV-S1", "skipped", backend=None, layout="LBNHC",
            reason="KV-S1: vllm-omni not installed", skip_kind="environment"),
        row("s::test_kv_n1[bf16_h8]", "KV-N1", backend=None),
    ], strict=False, env=environment(vllm="0.32.0", vllm_omni=None),
        backends=[backend_record(), backend_record("NEW", "m:N")])


def test_each_kind_of_change_is_listed() -> None:
    diff = diff_reports(report_a(), report_b())
    assert [(c.test, c.before, c.after) for c in diff.new_failures] == [
        ("test_kv_l1[GOOD]", "passed", "failed")]
    assert diff.new_failures[0].reason == "KV-L1 violated: returned 1"
    assert [(c.test, c.note) for c in diff.fixed] == [
        ("test_kv_l2[GOOD]", ""), ("test_kv_l8_alias[GOOD]", f"stale known finding: {KNOWN}")]
    assert [c.test for c in diff.stale] == ["test_kv_l8_alias[GOOD]"]
    assert [(c.test, c.after, c.reason, c.note) for c in diff.newly_unchecked] == [
        ("test_kv_s1[LBNHC-bf16_h8]", "skipped", "vllm-omni not installed", "environment skip"),
        ("test_kv_s2[LBNHC-bf16_h8]", None, "not collected (deselected, or the test is gone)",
         "")]
    assert [c.test for c in diff.newly_checked] == ["test_kv_n1[bf16_h8]"]
    assert diff.still_failing == 1
    assert diff.environment == [
        "vllm: 0.30.0 -> 0.32.0", "vllm_omni: 0.30.0 -> not installed",
        "known findings file: known.toml -> none", "backends new: NEW"]


def test_cli_exits_1_on_a_new_failure_only(tmp_path: Path, capsys: Any) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(report_a()))
    b.write_text(json.dumps(report_b()))
    assert main(["diff", str(a), str(b)]) == 1
    text = capsys.readouterr().out
    assert "**1 new failure(s), 2 fixed (1 stale known finding(s)), 0 known finding(s) persist " \
           "(0 result(s)), 2 newly unchecked, " \
           "1 newly checked, 0 newly declared known, 0 checked through another entry point; " \
           "1 still failing**" in text
    assert "- `test_kv_l1[GOOD]` (KV-L1, GOOD): passed -> failed: KV-L1 violated: returned 1" \
        in text
    assert f"- `test_kv_l8_alias[GOOD]` (KV-L8, GOOD): xfailed -> passed (stale known finding: " \
           f"{KNOWN})\n" in text
    assert "- KV-S1 (1 result; (upstream)): passed -> skipped (environment skip): vllm-omni " \
           "not installed" in text
    assert "- vllm_omni: 0.30.0 -> not installed" in text
    assert main(["diff", str(b), str(b)]) == 0  # nothing new
    assert "**0 new failure(s)" in capsys.readouterr().out
    assert main(["diff", str(a), str(a)]) == 0  # the known finding persists
    text = capsys.readouterr().out
    assert "**0 new failure(s), 0 fixed (0 stale known finding(s)), 1 known finding(s) persist " \
           "(1 result(s)), " in text
    assert f"### Known findings that persist\n\n- `{KNOWN}` (1 result)\n" in text
    assert main(["diff", str(b), str(a)]) == 1  # L2 fails again


def test_diff_refuses_a_mix_and_bad_files(tmp_path: Path, capsys: Any) -> None:
    a = tmp_path / "a.json"
    a.write_text(json.dumps(report_a()))
    assert main(["diff", str(a), str(tmp_path / "missing.json")]) == 2
    assert "missing.json: cannot read" in capsys.readouterr().err
    combined = tmp_path / "m" / "matrix.json"
    _matrix(combined, report_a())
    assert main(["diff", str(combined), str(a)]) == 2
    assert f"{combined} is a combined matrix report and the other a single report" in \
        capsys.readouterr().err


def _leg(name: str, report: str | None) -> dict[str, Any]:
    return {"name": name, "description": "", "state": "ran" if report else "not built",
            "reason": None if report else "uv: no solution", "notes": [],
            "stack": {"vllm": "0.30.0", "vllm_omni": None, "torch": "2.13.0"},
            "stack_source": "installed" if report else "requested", "report": report,
            "exit_code": 1 if report else None, "duration_s": 1.0, "log": f"{name}.log"}


def _matrix(path: Path, report: dict[str, Any], *, built: bool = False) -> dict[str, Any]:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent / "leg.json").write_text(json.dumps(report))
    legs = [_leg("py311-a", "leg.json"), _leg("py311-b", "leg.json" if built else None)]
    combined = build_matrix(legs, {"py311-a": report, **({"py311-b": report} if built else {})},
                            run_record())
    write_matrix(path, combined)
    return combined


def test_two_matrices_are_compared_leg_by_leg(tmp_path: Path, capsys: Any) -> None:
    one, two = tmp_path / "one" / "matrix.json", tmp_path / "two" / "matrix.json"
    a = _matrix(one, report_a())
    b = _matrix(two, report_b(), built=True)
    diff = diff_matrices(a, b, {"py311-a": report_a()}, {"py311-a": report_b(),
                                                         "py311-b": report_b()})
    assert diff.new_failures == 1 and list(diff.legs) == ["py311-a"]
    assert diff.changes == ["leg py311-b: not built -> not qualified: 2 failed in KV-L1, "
                            "KV-L3 (KV-L1 violated: returned 1 (and 1 other reason))"]
    assert main(["diff", str(one), str(two)]) == 1
    text = capsys.readouterr().out
    assert "**1 new failure(s) over 1 leg(s) that ran in both**" in text
    assert "## py311-a" in text


def test_a_result_checked_through_another_entry_point_is_listed() -> None:
    via = "vLLM alone (vllm-omni not installed): vLLM's engine-core control plane"
    a = build([row("s::test_kv_n2[bf16_h8]", "KV-N2", backend=None)])
    b = build([row("s::test_kv_n2[bf16_h8]", "KV-N2", backend=None, via=via)])
    diff = diff_reports(a, b)
    assert [(c.test, c.note) for c in diff.rerouted] == [("test_kv_n2[bf16_h8]", f"via {via}")]
    assert not (diff.new_failures or diff.fixed or diff.newly_unchecked or diff.newly_checked)


def test_a_fault_the_backends_own_code_caused_is_no_new_failure_of_the_stack(
        tmp_path: Path, capsys: Any) -> None:
    """A stack guard run on a backend (KV-A4) that errored because the backend's own code
    died: listed apart, never a new failure, and the gate passes."""
    caused = "DieBackend.get_impl_cls()"
    a = build([row("s::test_kv_a4_unadopted[DIES-bf16_h8]", "KV-A4", backend="DIES",
                   case="bf16_h8")], backends=[backend_record("DIES")])
    b = build([row("s::test_kv_a4_unadopted[DIES-bf16_h8]", "KV-A4", "error", backend="DIES",
                   case="bf16_h8", error_kind="worker-died", subject="backend",
                   caused_by=caused, reason="KV-A4 [backend=DIES, case=bf16_h8]: worker died")],
              backends=[backend_record("DIES")])
    assert b["stack"]["regressions"] == []
    diff = diff_reports(a, b)
    assert diff.new_failures == []
    assert [(c.test, c.note) for c in diff.backend_faults] == [
        ("test_kv_a4_unadopted[DIES-bf16_h8]", f"caused by DIES's own code: {caused}")]
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert main(["diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    text = capsys.readouterr().out
    assert "**0 new failure(s)" in text and "1 fault(s) of the backends' own code (not the " \
        "stack's)" in text
    assert "### Faults of the backends' own code (not the stack's)" in text


def test_ci_does_not_run_the_matrix() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "kvconform matrix" not in ci and "-m matrix" not in ci


def test_a_known_finding_on_a_new_backend_persists() -> None:
    """B's new backend fails as a finding A knows: the finding persists (on one row more),
    it is not newly declared; a finding A never knew is."""
    alias = row("s::test_kv_l8_alias[GOOD]", "KV-L8", "xfailed", xfail=KNOWN)
    a = build([alias], strict=False)
    other = "known.toml:9 */KV-L8/test_kv_l8_env_refused"
    b = build([alias, {**alias, "nodeid": "s::test_kv_l8_alias[NEW]", "backend": "NEW"},
               row("s::test_kv_l8_env_refused[NEW]", "KV-L8", "xfailed", backend="NEW",
                   xfail=other)],
              strict=False, backends=[backend_record(), backend_record("NEW", "m:N")])
    diff = diff_reports(a, b)
    assert [c.test for c in diff.persists] == ["test_kv_l8_alias[GOOD]", "test_kv_l8_alias[NEW]"]
    assert diff.persisting_findings == [KNOWN]
    assert [(c.test, c.note) for c in diff.declared] == [
        ("test_kv_l8_env_refused[NEW]", f"declared: {other}")]
    assert not diff.new_failures


def test_a_declared_skip_persists_and_a_seeded_failure_says_so() -> None:
    """A backend that still does not import, as its entry declares, is a finding that
    persists; a result produced under a seeded worker fault is a new failure naming it."""
    skip = row("s::test_kv_l1[SAGE3]", "KV-L1", "skipped", backend="SAGE3",
               skip_kind="backend", reason="KV-L1: no module sageattn3",
               xfail="known.toml:5 SAGE3/*")
    a = build([skip, row("s::test_kv_a2[GOOD-c]", "KV-A2")], strict=False)
    b = build([skip, row("s::test_kv_a2[GOOD-c]", "KV-A2", "failed", reason="KV-A2 violated",
                         seeded_fault="handoff_drops_layout")],
              strict=False, env=environment(seeded_faults=["handoff_drops_layout"]))
    diff = diff_reports(a, b)
    assert diff.persisting_findings == ["known.toml:5 SAGE3/*"]
    assert [(c.test, c.note) for c in diff.new_failures] == [
        ("test_kv_a2[GOOD-c]", "under the seeded worker fault handoff_drops_layout")]
