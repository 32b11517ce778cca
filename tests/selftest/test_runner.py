"""``kvconform selftest``: each seeded fault caught, missed or unseedable, and said so.

The verdict rule and the registry are checked without the stack; one run seeds real
faults in forked children of this process (a planted one and a worker-side one that the
suite catches, one that changes nothing and one whose guarding clause is left out, which
it must report missed, and one whose target is gone) and checks what it reports.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
from pathlib import Path
from typing import Any

import pytest

from pytest_kvconform.adapters import paged_standins
from pytest_kvconform.api import CheckResult
from pytest_kvconform.cli import build_parser, main
from pytest_kvconform.contract import clauses
from pytest_kvconform.contract.outcomes import ErrorKind
from pytest_kvconform.faults import plants, vllm_plants, worker_faults
from pytest_kvconform.faults import registry as fault_registry
from pytest_kvconform.faults.registry import REGISTRY, Fault
from pytest_kvconform.selftest import catches, runner
from tests.conftest import needs_omni
from tests.seeding import Seeder


def _result(test: str, status: Any, message: str = "") -> CheckResult:
    return CheckResult(clause="KV-L2", backend="TORCH_SDPA", case=None, layout=None,
                       status=status, message=message, test=test,
                       error_kind=ErrorKind.TIMEOUT if status == "error" else None)


# --- the verdict rule ---------------------------------------------------------------------


def test_caught_is_a_failure_where_the_clean_install_passes() -> None:
    clean = {"t[a]": _result("t[a]", "passed"), "t[b]": _result("t[b]", "passed")}
    outcome, detail = catches.judge(
        [_result("t[a]", "passed"), _result("t[b]", "failed", "KV-L2 violated: x")], clean)
    assert outcome == "caught"
    assert detail == "1 of 2 guarding results fail that pass clean; first t[b]: KV-L2 violated: x"


def test_a_failure_the_clean_install_shares_is_not_caught() -> None:
    clean = {"t[a]": _result("t[a]", "failed", "known finding")}
    outcome, detail = catches.judge([_result("t[a]", "failed", "KV-L2 violated: y")], clean)
    assert outcome == "missed"
    assert detail == ("none of its 1 guarding results fails where the clean install passes: "
                      "1 failed on the clean install too (failed); t[a] clean: known finding")


def test_passes_errors_and_nothing_run_are_missed() -> None:
    clean = {"t[a]": _result("t[a]", "passed"), "t[b]": _result("t[b]", "passed")}
    outcome, detail = catches.judge(
        [_result("t[a]", "passed"), _result("t[b]", "error", "timed out")], clean)
    assert outcome == "missed"
    assert "1 passed, 1 error (timeout); t[b]: timed out" in detail
    assert catches.judge([], clean)[0] == "missed"
    assert catches.judge([_result("t[c]", "failed")], clean) == (
        "missed", "none of its 1 guarding results fails where the clean install passes: 1 "
                  "failed with no clean result to compare")


def _verdict(name: str, outcome: Any) -> catches.FaultResult:
    return catches.FaultResult(REGISTRY[name], outcome, "")


def test_exit_status_counts_seedable_faults_only() -> None:
    found = catches.SelftestRun({}, [_verdict("wrong_pin", "caught"),
                                      _verdict("other_rank_config", "unseedable")])
    assert (found.exit_code, len(found.seedable), len(found.caught)) == (0, 1, 1)
    assert catches.summary_line(found).startswith(
        "kvconform selftest: caught 1/1 seedable faults; 1 not seedable here: other_rank_config")
    for outcome in ("missed", "error"):
        found.faults.append(_verdict("view_offset", outcome))
        assert found.exit_code == 1
        found.faults.pop()


# --- the registry -------------------------------------------------------------------------


def test_every_worker_side_production_fault_is_registered() -> None:
    """Every regression and corruption ``faults/worker_faults.py`` can seed is a selftest
    fault."""
    registered = {f.worker for f in REGISTRY.values() if f.worker is not None}
    assert registered == {*worker_faults.REGRESSIONS, *worker_faults.CORRUPTIONS}


def test_every_planted_fault_is_registered() -> None:
    planted = {name for name, value in vars(plants).items()
               if name.isupper() and isinstance(value, tuple) and value
               and all(isinstance(p, plants.Patch) for p in value)}
    used = {name for name in planted
            if any(f.patches is getattr(plants, name) for f in REGISTRY.values())}
    assert used == planted
    # Declared once, in plants.py, and registered as declared.
    assert [n for n in REGISTRY if REGISTRY[n].patches] == list(plants.PLANTED)
    with pytest.raises(ValueError, match="planted fault 'wrong_pin' is declared twice"):
        plants.declare("wrong_pin", ("KV-L2",), "again")


def test_each_fault_has_one_seed_real_clauses_and_a_known_backend() -> None:
    backends = {fault_registry.PAGED, fault_registry.PLAIN, *paged_standins.STANDINS, None,
                plants.VLLM_PLAIN, vllm_plants.REPACKING}
    for fault in REGISTRY.values():
        assert (fault.worker is None) != (not fault.patches), fault.name
        assert [clauses.clause(c).id for c in fault.clauses] == list(fault.clauses)
        assert fault.backend in backends, fault.name
        assert set(fault.beside) <= set(worker_faults.CORRECTIONS), fault.name
        assert fault.what, fault.name


def test_an_unknown_fault_is_one_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"unknown fault 'nope'; known faults: skip_adoption, "):
        fault_registry.select(["nope"])


# --- seedability --------------------------------------------------------------------------

GONE = Fault("gone_target", "layout", "a function the installed version no longer has",
             ("KV-L2",), fault_registry.PLAIN,
             patches=(plants.Patch("vllm_omni.diffusion.diffusion_kv.layout:no_such_function",
                                   lambda original: original),))


@needs_omni
def test_a_fault_whose_target_is_gone_or_does_not_import_is_unseedable() -> None:
    assert GONE.unseedable() == ("vllm_omni.diffusion.diffusion_kv.layout.no_such_function is "
                                 "gone on this version (vllm_omni.diffusion.diffusion_kv.layout "
                                 "has no 'no_such_function')")
    missing = dataclasses.replace(GONE, patches=(plants.Patch("vllm_omni.no_such_module:f",
                                                              lambda original: original),))
    assert (missing.unseedable() or "").startswith(
        "vllm_omni.no_such_module does not import (ModuleNotFoundError: ")


@needs_omni
def test_a_regression_whose_statement_is_gone_is_unseedable(seed: Seeder) -> None:
    """A runner that no longer calls ``adopt_kv_cache_layout`` cannot lose that call."""
    def initialize_kv_cache(self: Any, kv_cache_config: Any) -> None:
        return None

    seed.replace("vllm_omni.diffusion.diffusion_kv.model_runner_backend."
                 "DiffusionKVModelRunnerBackend.initialize_kv_cache", initialize_kv_cache)
    assert REGISTRY["skip_adoption"].unseedable() == (
        "seeded fault skip_adoption: DiffusionKVModelRunnerBackend.initialize_kv_cache no "
        "longer has the statement the regression rewrites; update its rewrite (no longer "
        "adopts the control plane's layout)")


@needs_omni
def test_every_planted_fault_is_seedable_on_this_install() -> None:
    assert {f.name: f.unseedable() for f in REGISTRY.values() if f.patches} == \
        {f.name: None for f in REGISTRY.values() if f.patches}


# --- one run --------------------------------------------------------------------------------


@needs_omni
def test_selftest_reports_what_the_suite_catches_and_what_it_cannot_see(tmp_path: Path) -> None:
    """Caught: a planted fault and a worker-side one.  Missed: a fault that changes
    nothing, and a real fault whose guarding clause is left out of its selection.
    Unseedable: a fault whose target is gone."""
    noop = dataclasses.replace(REGISTRY["wrong_pin"], name="changes_nothing", patches=(
        plants.Patch(plants.RESOLVER, lambda original: original),))
    unguarded = dataclasses.replace(REGISTRY["pool_hands_out_null_block"],
                                    name="guard_deselected", clauses=("KV-N2",))
    lines: list[str] = []
    found = runner.run([REGISTRY["wrong_pin"], noop, unguarded, GONE,
                          REGISTRY["misnamed_configs"]], progress=lines.append)
    outcomes = {r.fault.name: r.outcome for r in found.faults}
    assert outcomes == {"wrong_pin": "caught", "changes_nothing": "missed",
                        "guard_deselected": "missed", "gone_target": "unseedable",
                        "misnamed_configs": "caught"}, catches.render(found)
    assert found.exit_code == 1 and found.baseline_errors == []
    assert multiprocessing.active_children() == []
    text = catches.render(found)
    assert "missed     changes_nothing   [KV-L2]  none of its 1 guarding results fails where " \
           "the clean install passes: 1 passed" in text
    assert "missed     guard_deselected  [KV-N2]  none of its 1 guarding results" in text
    assert "caught     misnamed_configs  [KV-A1, KV-A3]  " in text
    assert "KV-A1 violated [backend=FLASH_ATTN, case=bf16_h8, layout=LBNHC]" in text
    assert text.endswith(
        "caught 2/4 seedable faults; not caught: changes_nothing, guard_deselected; 1 not "
        f"seedable here: gone_target ({found.duration_s:.0f}s)\n")
    assert lines[0].startswith("stack imported, plugins loaded, backends discovered in ")
    # one baseline per backend and cases: wrong_pin's serves changes_nothing too
    assert sum(" clean " in line for line in lines) == 3
    record = json.loads(json.dumps(catches.as_json(found)))
    assert record["summary"] | {"prepare_s": 0, "duration_s": 0} == {
        "faults": 5, "seedable": 4, "caught": 2, "exit_code": 1, "prepare_s": 0,
        "duration_s": 0, "jobs": runner.DEFAULT_JOBS}
    misnamed = next(f for f in record["faults"] if f["name"] == "misnamed_configs")
    assert misnamed["seeded"] == "worker" and {r["status"] for r in misnamed["results"]} == \
        {"failed"}


def _resolver_that(does: Any, name: str) -> Fault:
    return dataclasses.replace(REGISTRY["wrong_pin"], name=name, patches=(
        plants.Patch(plants.RESOLVER, lambda original: does),))


@needs_omni
def test_a_run_that_hangs_or_dies_is_an_error_and_leaves_no_process() -> None:
    """A run past its time limit is killed; a run whose process dies is named with its exit
    status; both are errors (exit status 1), never caught, and no child is left."""
    import os
    import time

    def hang(*args: Any, **kwargs: Any) -> Any:
        time.sleep(3600)

    def die(*args: Any, **kwargs: Any) -> Any:
        print("about to die", flush=True)
        os._exit(3)

    found = runner.run([_resolver_that(hang, "hangs"), _resolver_that(die, "dies")],
                         timeout=5)
    errors = {r.fault.name: r.detail for r in found.faults}
    assert [r.outcome for r in found.faults] == ["error", "error"] and found.exit_code == 1
    assert errors["hangs"].startswith("its run failed: did not finish within 5s and was killed")
    assert errors["dies"].startswith("its run failed: its process ended without a result "
                                     "(exit code 3)")
    assert "--- its output (tail) ---\nabout to die" in errors["dies"]
    assert multiprocessing.active_children() == []


# --- the command ------------------------------------------------------------------------


def test_cli_interrupted_says_so(capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run", interrupted)
    assert main(["selftest", "--fault", "wrong_pin"]) == 2
    assert capsys.readouterr().err == ("kvconform selftest: interrupted (KeyboardInterrupt); "
                                       "no verdict\n")



def test_cli_refuses_an_unknown_fault_and_an_unwritable_json_path(
        tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "run", lambda *a, **k: pytest.fail("ran"))
    assert main(["selftest", "--fault", "nope"]) == 2
    assert "kvconform: error: selftest: unknown fault 'nope'" in capsys.readouterr().err
    missing = tmp_path / "no" / "x.json"
    assert main(["selftest", "--json", str(missing)]) == 2
    assert f"{missing}: cannot write the selftest's JSON there" in capsys.readouterr().err
    assert main(["selftest", "--jobs", "0"]) == 2


def test_cli_lists_the_faults(capsys: Any) -> None:
    assert main(["selftest", "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == list(REGISTRY)
    assert any(line.startswith("hand_strides") and "[KV-S1, KV-S3] on no backend: "
               "build_kv_cache_tensor writes" in line for line in out)


def test_cli_prints_the_account_writes_json_and_exits_with_its_status(
        tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def run(faults: Any, **kwargs: Any) -> catches.SelftestRun:
        seen.update(faults=faults, **kwargs)
        kwargs["progress"]("[1/1] seeded view_offset: 12 failed (1.0s)")
        return catches.SelftestRun({"vllm": "0.30.0"}, [_verdict("view_offset", "missed")])

    monkeypatch.setattr(runner, "run", run)
    out = tmp_path / "st.json"
    assert main(["selftest", "--fault", "view_offset", "-j", "1", "--json", str(out)]) == 1
    captured = capsys.readouterr()
    assert captured.err == "kvconform selftest: [1/1] seeded view_offset: 12 failed (1.0s)\n"
    assert "missed     view_offset  [KV-S2]" in captured.out
    assert captured.out.splitlines()[-1].startswith(
        "kvconform selftest: caught 0/1 seedable faults; not caught: view_offset")
    assert (seen["faults"], seen["jobs"]) == (["view_offset"], 1)
    assert json.loads(out.read_text())["schema"] == catches.SCHEMA


def test_cli_defaults_are_the_runners() -> None:
    args = build_parser().parse_args(["selftest"])
    assert (args.jobs, args.timeout) == (runner.DEFAULT_JOBS, runner.DEFAULT_TIMEOUT_S)
