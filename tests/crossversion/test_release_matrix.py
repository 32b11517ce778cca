"""The release matrix's mechanics (``kvconform matrix``), with a stand-in for tox: every leg is
named with its outcome, the combined report validates against its legs' reports, and a
tampered one does not.  The real matrix builds and runs each environment (minutes per leg);
it is not part of the plugin's tests (docs/release.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_kvconform.cli import main
from pytest_kvconform.crossversion import release_matrix as matrix
from pytest_kvconform.crossversion import tox_leg as legs
from pytest_kvconform.report.build import ReportError, validate_matrix
from tests import faultkit
from tests.fake_tox import UV_ERROR
from tests.paths import ROOT

FAKE_TOX = f"{sys.executable} {ROOT / 'tests' / 'fake_tox.py'}"
STACK_029 = {"vllm": "0.29.0", "vllm_omni": None, "torch": "2.13.0", "vllm_error": None,
             "omni_error": None}
LEGS = {
    "py311-vllm029": {"description": "vLLM 0.29 alone", "deps": "-r requirements/a.txt",
                      "build": "ok", "probe": STACK_029, "suite": "qualified"},
    "py311-vllm031": {"description": "vLLM 0.31, vllm-omni 0.30", "deps": "-r requirements/b.txt",
                      "build": "ok", "suite": "failing",
                      "probe": {"vllm": "0.31.0", "vllm_omni": "0.30.0", "torch": "2.13.0",
                                "vllm_error": None,
                                "omni_error": "ImportError: cannot import name "
                                              "'RoutedExpertsLists'"}},
    "py311-vllm034": {"description": "vLLM 0.34", "deps": "-r requirements/c.txt",
                      "build": "uv-error", "probe": STACK_029, "suite": "qualified"},
}


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    """A clone's root: tox.ini, requirements with pins, the fake tox's legs."""
    root = tmp_path / "clone"
    (root / "requirements").mkdir(parents=True)
    (root / "tox.ini").write_text("[tox]\n")
    (root / "requirements" / "test.txt").write_text("pytest==9.2.0\n")
    for name, pins in (("a", "vllm==0.29.0"), ("b", "vllm==0.31.0\nvllm-omni==0.30.0"),
                       ("c", "vllm==0.34.0  # needs flashinfer-python 0.7.3")):
        (root / "requirements" / f"{name}.txt").write_text(f"-r test.txt\ntorch==2.14.0\n{pins}\n")
    (root / "fake_tox.json").write_text(json.dumps({"legs": LEGS}))
    return root


def run(clone: Path, out: Path, **kwargs: Any) -> dict[str, Any]:
    return matrix.run_matrix(root=clone, out=out, tox=FAKE_TOX.split(), echo=lambda _: None,
                             **kwargs)


def test_every_leg_is_named_with_its_outcome(clone: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    combined = run(clone, out)
    by_name = {leg["name"]: leg for leg in combined["legs"]}
    assert list(by_name) == sorted(LEGS)
    assert combined["verdict"] == "not qualified"
    assert combined["qualified_legs"] == ["py311-vllm029"]
    good, failing, unbuilt = by_name.values()
    assert (good["state"], good["verdict"], good["reason"]) == ("ran", "qualified", None)
    assert good["stack"] == {"vllm": "0.29.0", "vllm_omni": None, "torch": "2.13.0"}
    assert failing["verdict"] == "not qualified"
    assert failing["reason"] == (
        "vllm-omni 0.30.0 does not import on vLLM 0.31.0: ImportError: cannot import name "
        "'RoutedExpertsLists'; 1 failed in KV-L6 (KV-L6 violated: pinned "
        "LBNHC); 1 skipped and not forgiven in KV-A1 (vllm-omni not installed)")
    assert (unbuilt["state"], unbuilt["verdict"], unbuilt["report"]) == ("not built", None, None)
    assert unbuilt["reason"].startswith("uv: No solution found when resolving dependencies: "
                                        "Because there is no version of flashinfer-python==0.7.3")
    assert unbuilt["stack"] == {"vllm": "0.34.0", "vllm_omni": None, "torch": "2.14.0"}
    assert unbuilt["stack_source"] == "requested"
    assert "unsatisfiable" in (out / "py311-vllm034.log").read_text()
    cells = {(c["leg"], c["clause"]): c for c in combined["by_stack"]}
    assert cells["py311-vllm031", "KV-L6"]["status"] == "failed"
    assert cells["py311-vllm031", "KV-A1"]["reason"] == "vllm-omni not installed"
    assert {c["backend"] for c in combined["by_backend"]} == {"GOOD", "(upstream)"}


def test_cli_writes_validates_and_shows_the_combined_report(clone: Path, tmp_path: Path,
                                                             capsys: Any) -> None:
    out = tmp_path / "out"
    code = main(["matrix", "--root", str(clone), "--tox", FAKE_TOX, "-o", str(out),
                 "--xfails", "none"])
    assert code == 1  # a leg not qualified
    printed = capsys.readouterr().out
    assert "kvconform: matrix verdict: not qualified (qualified: py311-vllm029; not qualified: " \
           "py311-vllm031; not built: py311-vllm034)" in printed
    # Each leg that ran counts its stack's known findings: persisting, fixed, new.
    assert "kvconform: matrix: py311-vllm029 (vLLM 0.29.0 / vllm-omni - / torch 2.13.0): " \
           "qualified (0 known findings persist, 0 fixed, 0 new)\n" in printed
    assert "kvconform: matrix: py311-vllm031 (vLLM 0.31.0 / vllm-omni 0.30.0 / torch 2.13.0): " \
           "not qualified (0 known findings persist, 0 fixed, 1 new): " in printed
    assert main(["validate", str(out / "matrix.json")]) == 0
    assert "valid (pytest-kvconform/matrix/1, 2 leg report(s) of pytest-kvconform/report/2)" \
        in capsys.readouterr().out
    assert main(["show", str(out / "matrix.json")]) == 0
    shown = capsys.readouterr().out
    assert shown == (out / "matrix.md").read_text()
    assert "| stack | leg | KV-L1 | KV-L6 | KV-S1 | KV-A1 |" in shown
    assert "| vLLM 0.31.0 / vllm-omni 0.30.0 / torch 2.13.0 | py311-vllm031 | pass 1/1 | " \
           "fail 1/1[^1] | pass 1/1 | skip 1/1[^2] |" in shown
    assert "[^1]: fail: KV-L6 violated: pinned LBNHC" in shown
    assert "| GOOD | vLLM 0.29.0 / vllm-omni - / torch 2.13.0 | pass 1/1 |" in shown


def test_one_leg_and_the_suite_arguments(clone: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    combined = run(clone, out, legs=["py311-vllm029"], extra=["-n", "2"],
                   xfails=clone / "tox.ini")
    assert [leg["name"] for leg in combined["legs"]] == ["py311-vllm029"]
    assert combined["verdict"] == "qualified"
    log = (out / "py311-vllm029.log").read_text()
    report = out / "py311-vllm029.json"
    assert f"-- --kv-conformance --kv-strict -rs --kv-xfails {clone / 'tox.ini'} --kv-report " \
           f"{report} -n 2\n" in log


def test_unknown_leg_is_a_usage_error(clone: Path, tmp_path: Path, capsys: Any) -> None:
    code = main(["matrix", "--root", str(clone), "--tox", FAKE_TOX, "-o", str(tmp_path / "o"),
                 "--leg", "py311-vllm099"])
    assert code == 2
    assert capsys.readouterr().err == (
        "kvconform: error: --leg py311-vllm099: not in tox.ini's 'matrix' label (legs: "
        "py311-vllm029, py311-vllm031, py311-vllm034)\n")


def test_missing_tox_and_tox_ini_are_one_line(tmp_path: Path, capsys: Any) -> None:
    assert main(["matrix", "--root", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"kvconform: error: {tmp_path}: no tox.ini here (run "
                                       "from the clone, or pass --root)\n")
    (tmp_path / "tox.ini").write_text("[tox]\n")
    assert main(["matrix", "--root", str(tmp_path), "--tox", "no-such-tox-here"]) == 2
    assert "no-such-tox-here not found: install tox and tox-uv" in capsys.readouterr().err


def test_a_leg_without_report_or_import_is_named(clone: Path, tmp_path: Path) -> None:
    spec = json.loads((clone / "fake_tox.json").read_text())
    spec["legs"]["py311-vllm029"]["suite"] = "no-report"
    spec["legs"]["py311-vllm031"]["probe"] = "crash"
    (clone / "fake_tox.json").write_text(json.dumps(spec))
    out = tmp_path / "out"
    (out).mkdir()
    (out / "py311-vllm029.json").write_text("{}")  # an earlier run's: never credited
    combined = run(clone, out, legs=["py311-vllm029", "py311-vllm031"])
    first, second = combined["legs"]
    assert (first["state"], first["exit_code"]) == ("no report", 4)
    assert first["reason"] == ("the suite wrote no report (exit 4): ERROR: usage: pytest "
                               "[options] | pytest: error: unrecognized arguments: --kv-x")
    assert second["state"] == "not importable"
    assert second["reason"].startswith("the stack probe printed no result (exit 1): Traceback")
    assert combined["by_stack"] == []


def test_tampered_combined_report_is_refused(clone: Path, tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "out"
    run(clone, out)
    path = out / "matrix.json"
    original = json.loads(path.read_text())
    for change, message in (
        (lambda m: m.update(verdict="qualified"), "$.verdict: 'qualified' but the legs give "
                                                  "'not qualified'"),
        (lambda m: m["by_stack"][0].update(status="failed"), "$.by_stack[0].status: 'failed' "
                                                             "is not the worst status"),
        (lambda m: m["legs"][2].update(reason=None), "$.legs[2].reason: a leg in state "
                                                     "'not built' must say why"),
        (lambda m: m["by_backend"].pop(), "$.by_backend: does not match the legs' reports"),
        (lambda m: m["legs"][0].update(run_id="other"), "$.legs[0].run_id: 'other' but the "
                                                        "leg's report"),
    ):
        tampered = json.loads(json.dumps(original))
        change(tampered)
        path.write_text(json.dumps(tampered))
        assert main(["validate", str(path)]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(ReportError, match="expected 'pytest-kvconform/matrix/1'"):
        validate_matrix({**original, "schema": "pytest-kvconform/matrix/0"})


def test_build_failure_reason_is_uvs_error_block() -> None:
    step = legs.Step(["tox"], 1, legs.ANSI.sub("", UV_ERROR), 1.2)
    assert legs.build_failure(step) == (
        "uv: No solution found when resolving dependencies: Because there is no version of "
        "flashinfer-python==0.7.3 and vllm>=0.34.0 depends on flashinfer-python==0.7.3, we can "
        "conclude that vllm>=0.34.0 cannot be used. And because you require vllm==0.34.0, we "
        "can conclude that your requirements are unsatisfiable.")
    other = legs.Step(["tox"], 2, "one\n\ntwo\nthree\n", 0.1)
    assert legs.build_failure(other) == "tox exited 2: one | two | three"


def test_repository_matrix_label_names_every_supported_stack() -> None:
    """tox.ini's label is the matrix: vLLM 0.29-0.34, each with the vllm-omni release or
    pre-release that goes with it (a factor adds the pre-release's pin)."""
    root = ROOT
    text = (root / "tox.ini").read_text()
    label = next(line for line in text.splitlines() if line.strip().startswith("matrix ="))
    assert [name.strip() for name in label.split("=", 1)[1].split(",")] == [
        "py311-vllm029", "py311-vllm030", "py311-vllm031-omni031rc1",
        "py311-vllm032-omni032rc1", "py311-vllm033-omni032rc1", "py311-vllm034"]
    assert legs.requested_stack("-r requirements/vllm030.txt", root) == {
        "vllm": "0.30.0", "vllm_omni": "0.30.0", "torch": "2.13.0"}
    assert legs.requested_stack("-r requirements/vllm032.txt\n-r requirements/omni032rc1.txt",
                                root) == {"vllm": "0.32.0", "vllm_omni": "0.32.0rc1",
                                          "torch": "2.13.0"}


@pytest.mark.delivers_signal
def test_sigterm_stops_the_running_leg_and_leaves_an_interrupted_matrix(
        clone: Path, tmp_path: Path) -> None:
    """No child outlives the matrix; what finished stays, the rest is named."""
    import signal
    import subprocess
    import time

    spec = json.loads((clone / "fake_tox.json").read_text())
    spec["legs"]["py311-vllm031"]["suite"] = "hang"
    (clone / "fake_tox.json").write_text(json.dumps(spec))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "pytest_kvconform.cli", "matrix", "--root", str(clone),
               "--tox", FAKE_TOX, "-o", str(out)]
    pid_file = clone / "fake_tox.pid"
    with subprocess.Popen(command, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        deadline = time.monotonic() + 60
        hung = 0
        while not hung and time.monotonic() < deadline:  # written, and not half-written
            time.sleep(0.1)
            text = pid_file.read_text() if pid_file.exists() else ""
            hung = int(text) if text.strip().isdigit() else 0
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2, err
    assert "kvconform: matrix interrupted; what finished is in" in err
    assert not faultkit.wait_gone([hung]), f"the hung leg's process {hung} outlived the matrix"
    combined = json.loads((out / "matrix.json").read_text())
    assert combined["verdict"] == "interrupted"
    assert combined["run"]["interruption"] == "Terminated during leg py311-vllm031"
    states = [(leg["name"], leg["state"], leg["reason"]) for leg in combined["legs"]]
    assert states == [
        ("py311-vllm029", "ran", None),
        ("py311-vllm031", "interrupted", "Terminated: SIGTERM: the run was terminated"),
        ("py311-vllm034", "not run", "not run: the matrix was interrupted")]
    assert main(["validate", str(out / "matrix.json")]) == 0
