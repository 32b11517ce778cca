"""``kvconform gpu-check`` on CPU: everything but its CUDA calls.

The refusal (in-process and as the console command), KV-A6's sizing for an H200's free
memory through the real control plane, each check's verdict rules, the pinning file's
parsing, the report, and one end-to-end run of both pytest steps against the installed
stack with a stand-in for ``host.probe()`` (the one function that asks CUDA).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_kvconform.adapters import paged_drivers
from pytest_kvconform.cli import main
from pytest_kvconform.gpu import host, pinning, report
from pytest_kvconform.gpu.check_verdicts import (
    CheckVerdict,
    Verdict,
    judge_a6,
    judge_l7,
    judge_pinning,
    judge_sizing,
)
from pytest_kvconform.gpu.pinning import PinningError, WorkerRecord, parse_records
from pytest_kvconform.gpu.sizing import A6Sizing, Probe, a6_sizing
from tests.conftest import needs_omni

MIB = 2**20
H200_FREE = 143771 * MIB  # what the H200 host reported
CUDA = importlib.util.find_spec("torch") is not None and __import__("torch").cuda.is_available()
cpu_host = pytest.mark.skipif(CUDA, reason="checks the refusal on a host without CUDA")
NO_CUDA_LINE = ("kvconform: error: gpu-check: torch {} sees no CUDA device "
                "(torch.cuda.is_available() is False, 0 device(s)); the GPU checks need a CUDA "
                "host with vLLM installed with its compiled kernels")


# --- the refusal ------------------------------------------------------------------------


@pytest.mark.parametrize(("facts", "why"), [
    ({"torch_version": None}, "torch is not installed; the GPU checks need"),
    ({"cuda_available": False, "device_count": 0},
     "torch 2.13.0+cu130 sees no CUDA device (torch.cuda.is_available() is False, 0 device(s))"),
    ({"device_count": 0}, "torch 2.13.0+cu130 sees no CUDA device (torch.cuda.is_available() "
                          "is True, 0 device(s))"),
    ({"kernels_missing": "vllm._C_stable_libtorch does not load: ImportError: undefined "
                         "symbol: _ZN3c10"},
     "vLLM's compiled kernels cannot be loaded here: vllm._C_stable_libtorch does not load: "
     "ImportError: undefined symbol: _ZN3c10; the GPU checks need"),
], ids=["no-torch", "no-cuda", "no-device", "no-kernels"])
def test_refusal_names_what_is_missing(facts: dict[str, Any], why: str) -> None:
    given = {"torch_version": "2.13.0+cu130", "cuda_available": True, "device_count": 1,
             "kernels_missing": None, **facts}
    line = host.refusal(**given)
    assert line is not None and line.startswith(why) and "\n" not in line
    assert line.endswith(host.NEEDS)


def test_no_refusal_with_cuda_and_kernels() -> None:
    assert host.refusal(torch_version="2.13.0", cuda_available=True, device_count=8,
                        kernels_missing=None) is None


@cpu_host
def test_probe_refuses_this_cpu_host() -> None:
    import torch

    with pytest.raises(host.Refused) as info:
        host.probe()
    assert f"kvconform: error: gpu-check: {info.value}" == NO_CUDA_LINE.format(torch.__version__)


@cpu_host
def test_gpu_check_command_refuses_with_one_line(tmp_path: Path) -> None:
    import torch

    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "pytest_kvconform.cli", "gpu-check", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines() == [NO_CUDA_LINE.format(torch.__version__)]
    assert done.stdout == ""
    assert not out.exists()  # nothing written


def test_gpu_check_refuses_a_file_as_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    target = tmp_path / "report.json"
    target.write_text("{}")
    assert main(["gpu-check", str(target)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"kvconform: error: gpu-check: {target}: not a directory"]


def test_gpu_check_refuses_a_bad_memory_fraction(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gpu-check", "--memory-fraction", "1.5"]) == 2
    assert "argument --memory-fraction: '1.5' is not a fraction in (0, 1]" in \
        capsys.readouterr().err


# --- vLLM's compiled kernels, by feature -----------------------------------------------


def test_kernels_missing_when_no_compiled_ops_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paged_drivers, "COMPILED_OPS", ("no_such_pkg._C", "no_such_pkg._D"))
    assert paged_drivers.native_kernels_missing() == (
        "none of no_such_pkg._C, no_such_pkg._D is installed (vLLM without its compiled ops)")


def test_kernels_that_do_not_load_are_missing(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "fake_ops.py").write_text("raise OSError('libcuda.so.1: cannot open\\nshared')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(paged_drivers, "COMPILED_OPS", ("no_such_pkg._C", "fake_ops"))
    assert paged_drivers.native_kernels_missing() == (
        "fake_ops does not load: OSError: libcuda.so.1: cannot open shared")


def test_kernels_that_load_are_not_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paged_drivers, "COMPILED_OPS", ("no_such_pkg._C", "json"))
    monkeypatch.setattr(paged_drivers, "FLASH_ATTN_MODULE", "json.decoder")
    assert paged_drivers.native_kernels_missing() is None


@cpu_host
@needs_omni
def test_installed_vllm_kernels_are_found_by_feature() -> None:
    """The installed vLLM's compiled ops are found under whichever name it ships them
    (0.30: ``_C_stable_libtorch`` only), and without CUDA they do not load."""
    shipped = [n for n in paged_drivers.COMPILED_OPS if importlib.util.find_spec(n)]
    assert shipped, "the installed vLLM ships no compiled ops"
    missing = paged_drivers.native_kernels_missing()
    assert missing is not None and missing.startswith(f"{shipped[0]} does not load: ")


# --- KV-A6 sizing through the control plane ---------------------------------------------

# Case bf16_h8: block 16, 2 KV heads, head size 8, bf16, 2 layers.  A page holds K and V:
# 16 x 2 x (2 x 8 x 2 bytes) = 1024 bytes per layer and block, 2048 per block.  Half an
# H200's 143771 MiB is 75,377,410,048 bytes = 36,805,376 blocks exactly.
H200_BLOCKS = 36_805_376


@needs_omni
@pytest.mark.parametrize(("need", "layout", "past_2_31", "past_2_32"), [
    # layer-outermost: page (layer, block) starts at layer * blocks * 1024 + block * 1024
    (False, "LBNHC", (0, 2**31 // 1024), (0, 2**32 // 1024)),
    # block-outermost: at (block * 2 + layer) * 1024
    (True, "BLNHC", (0, 2**31 // 2048), (0, 2**32 // 2048)),
], ids=["need_False", "need_True"])
def test_a6_sizing_for_an_h200(need: bool, layout: str, past_2_31: tuple[int, int],
                               past_2_32: tuple[int, int]) -> None:
    sized = a6_sizing(H200_FREE, fraction=0.5, need=need, device="cpu")
    assert (sized.case, sized.layout) == ("bf16_h8", layout)
    assert sized.num_blocks == H200_BLOCKS
    assert sized.allocation_bytes == H200_BLOCKS * 2048 == 75_377_410_048
    offsets = {(p.layer, p.block): p.byte_offset for p in sized.probes}
    assert offsets[past_2_31] == 2**31 and offsets[past_2_32] == 2**32
    assert offsets[(1, H200_BLOCKS - 1)] == H200_BLOCKS * 2048 - 1024  # the far end
    assert offsets[(0, past_2_31[1] - 1)] < 2**31 <= offsets[past_2_31]  # the first past it
    assert sized.as_dict()["past_2_31"] and sized.as_dict()["past_2_32"]
    assert judge_sizing([sized]).verdict is Verdict.OK


@needs_omni
def test_a6_sizing_short_of_2_32_is_not_checked() -> None:
    sized = a6_sizing(6 * 2**30, fraction=0.5, need=False, device="cpu")
    assert sized.allocation_bytes == 3 * 2**30
    assert sized.past(2**31) and not sized.past(2**32)
    judged = judge_sizing([sized])
    assert judged.verdict is Verdict.NOT_CHECKED
    assert judged.rows[0].detail == "no probe page reaches 2^32"


def test_sizing_not_computed_is_not_checked() -> None:
    assert judge_sizing([]).verdict is Verdict.NOT_CHECKED


# --- the verdict rules ------------------------------------------------------------------


def result(clause: str, backend: str, status: str, reason: str = "",
           skip_kind: str | None = None, error_kind: str | None = None) -> dict[str, Any]:
    test = f"test_kv_{clause[3:].lower()}"
    return {"nodeid": f"suite/t.py::{test}[{backend}]", "clause": clause, "backend": backend,
            "status": status, "reason": reason or None, "skip_kind": skip_kind,
            "error_kind": error_kind}


def a6(backend: str, status: str, skip_kind: str | None = None) -> dict[str, Any]:
    return result("KV-A6", backend, status, skip_kind=skip_kind)


@pytest.mark.parametrize(("rows", "expected"), [
    ([a6("FLASH_ATTN", "passed"), a6("TORCH_SDPA", "skipped", "not-applicable"),
      a6("SAGE_ATTN_3", "skipped", "backend")], Verdict.OK),
    ([a6("FLASH_ATTN", "passed"), a6("need_False", "skipped", "hardware")], Verdict.NOT_CHECKED),
    ([a6("FLASH_ATTN", "passed"), a6("need_True", "failed")], Verdict.FAILED),
    ([a6("FLASH_ATTN", "error"), a6("need_True", "skipped", "hardware")], Verdict.FAILED),
    ([a6("TORCH_SDPA", "skipped", "not-applicable")], Verdict.NOT_CHECKED),
    ([], Verdict.NOT_CHECKED),
], ids=["pass", "hardware-skip", "fail", "error", "nothing-passed", "no-result"])
def test_a6_verdict(rows: list[dict[str, Any]], expected: Verdict) -> None:
    judged = judge_a6([*rows, result("KV-L7", "FLASH_ATTN", "failed")])  # other clauses ignored
    assert judged.verdict is expected
    assert len(judged.rows) == len(rows)


WRONG = "KV-L7 violated [backend=X]: ...; first block whose output differs: logical block 2 (...)"
GOOD_L7 = {
    "PAGED_OK": ("passed", ""), "PAGED_OK_BS": ("passed", ""), "PAGED_CUDA_ONLY": ("passed", ""),
    "PAGED_NO_TABLE": ("failed", WRONG), "PAGED_BAD_STRIDE": ("failed", WRONG),
    "PAGED_TRUNCATES": ("failed", WRONG), "FLASH_ATTN": ("passed", ""),
    "TORCH_SDPA": ("skipped", "the backend does not declare supports_paged_kv"),
}


def l7(**changes: tuple[str, str] | None) -> list[dict[str, Any]]:
    table = {**GOOD_L7, **changes}
    return [result("KV-L7", b, status, reason,
                   skip_kind=("not-applicable" if b == "TORCH_SDPA" else "environment")
                   if status == "skipped" else None)
            for b, outcome in table.items() if outcome is not None for status, reason in [outcome]]


@pytest.mark.parametrize(("changes", "expected", "why"), [
    ({}, Verdict.OK, ""),
    ({"PAGED_BAD_STRIDE": ("passed", "")}, Verdict.FAILED, "PAGED_BAD_STRIDE"),
    ({"PAGED_TRUNCATES": ("failed", "forward_paged raised RuntimeError()")}, Verdict.FAILED,
     "PAGED_TRUNCATES"),
    ({"PAGED_OK": ("failed", WRONG)}, Verdict.FAILED, "PAGED_OK"),
    ({"FLASH_ATTN": ("failed", "KV-L7 violated [backend=FLASH_ATTN]")}, Verdict.FAILED,
     "FLASH_ATTN"),
    ({"FLASH_ATTN": ("skipped", "needs vLLM's native paged kernels")}, Verdict.NOT_CHECKED,
     "FLASH_ATTN"),
    ({"PAGED_NO_TABLE": None}, Verdict.NOT_CHECKED, ""),
], ids=["as-seeded", "misread-passes", "misread-not-localised", "conforming-fails",
        "native-fails", "native-skipped", "standin-missing"])
def test_l7_verdict(changes: dict[str, tuple[str, str] | None], expected: Verdict,
                    why: str) -> None:
    judged = judge_l7(l7(**changes))
    assert judged.verdict is expected, judged
    bad = [r.subject for r in judged.rows if r.verdict is not Verdict.OK]
    assert bad == ([f"test_kv_l7[{why}]"] if why else []), judged.rows
    if "PAGED_NO_TABLE" in changes:
        assert "stand-in(s) not run: PAGED_NO_TABLE" in judged.summary


def test_l7_without_a_native_pass_is_not_checked() -> None:
    judged = judge_l7(l7(FLASH_ATTN=None))
    assert judged.verdict is Verdict.NOT_CHECKED
    assert "no native backend's paged path passed" in judged.summary


def worker(name: str = "gw0", visible: str | None = "0", count: int = 1,
           kv_device: str | None = "cuda:0", error: str | None = None) -> WorkerRecord:
    return WorkerRecord(name, visible, count, "NVIDIA H200" if count else None, kv_device,
                        tests=0 if kv_device is None else 11, error=error)


@pytest.mark.parametrize(("records", "gpus", "expected", "problem"), [
    ([worker()], 1, Verdict.OK, ""),  # the H200 host: 1 worker, CUDA_VISIBLE_DEVICES=0
    ([worker(), worker("gw1", "1")], 2, Verdict.OK, ""),
    ([worker(kv_device=None)], 1, Verdict.OK, ""),  # ran no test: its pinning still counts
    ([worker(), worker("gw1", "0")], 2, Verdict.FAILED, "shares GPU 0 with another worker"),
    ([worker(visible="0,1", count=2)], 1, Verdict.FAILED,
     "CUDA_VISIBLE_DEVICES='0,1' is not one GPU; torch sees 2 CUDA devices, not 1"),
    ([worker(visible=None, count=0, kv_device="cpu")], 1, Verdict.FAILED,
     "CUDA_VISIBLE_DEVICES=None is not one GPU; torch sees 0 CUDA devices, not 1; "
     "kv_device is cpu, not cuda:0"),
    ([worker(kv_device="cuda:1")], 1, Verdict.FAILED, "kv_device is cuda:1, not cuda:0"),
    ([worker()], 2, Verdict.FAILED, ""),
    ([worker("gw0", None, 0, None, error="handed back no record (crashed)")], 1,
     Verdict.FAILED, "handed back no record (crashed)"),
    ([], 1, Verdict.NOT_CHECKED, ""),
], ids=["h200", "two-gpus", "no-test", "shared", "two-visible", "cpu", "wrong-device",
        "too-few-workers", "worker-crashed", "nothing"])
def test_pinning_verdict(records: list[WorkerRecord], gpus: int, expected: Verdict,
                         problem: str) -> None:
    judged = judge_pinning(records, gpus)
    assert judged.verdict is expected, judged
    if problem:
        assert problem in [r.detail for r in judged.rows]
    if gpus != len(records) and records:
        assert judged.rows[-1].subject == "-n auto" and judged.rows[-1].expected == \
            f"{gpus}: one per GPU"


def test_final_verdict_is_the_worst() -> None:
    def check(v: Verdict) -> CheckVerdict:
        return CheckVerdict("c", v, "")

    assert report.final_verdict([check(Verdict.OK)] * 4) is Verdict.OK
    assert report.final_verdict([check(Verdict.OK), check(Verdict.NOT_CHECKED)]) is \
        Verdict.NOT_CHECKED
    assert report.final_verdict([check(Verdict.NOT_CHECKED), check(Verdict.FAILED)]) is \
        Verdict.FAILED


# --- the pinning file -------------------------------------------------------------------

H200_RECORD = {"worker": "gw0", "cuda_visible_devices": "0", "device_count": 1,
               "device_name": "NVIDIA H200", "kv_device": "cuda:0", "tests": 11, "error": None}


def test_pinning_records_parse() -> None:
    (record,) = parse_records([H200_RECORD])
    assert record == WorkerRecord("gw0", "0", 1, "NVIDIA H200", "cuda:0", 11)
    assert record.as_dict() == H200_RECORD
    without_error = {k: v for k, v in H200_RECORD.items() if k != "error"}
    assert parse_records([without_error]) == [record]


@pytest.mark.parametrize(("raw", "message"), [
    ({"gw0": H200_RECORD}, "expected a list of worker records, got dict"),
    (["gw0"], "record 0: expected an object, got str"),
    ([H200_RECORD, {**H200_RECORD, "device_count": "1"}],
     "record 1: field 'device_count' is '1', expected int"),
    ([{**H200_RECORD, "tests": True}], "record 0: field 'tests' is True, expected int"),
    ([{k: v for k, v in H200_RECORD.items() if k != "kv_device"}],
     "record 0: field 'kv_device' is missing"),
    ([{**H200_RECORD, "gpu": 0}], "record 0: unknown field(s) gpu"),
], ids=["not-a-list", "not-an-object", "wrong-type", "bool-for-int", "missing", "unknown"])
def test_malformed_pinning_records_are_named(raw: Any, message: str) -> None:
    with pytest.raises(PinningError) as info:
        parse_records(raw)
    assert str(info.value) == message


def test_pinning_file_problems_name_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "pinning.json"
    with pytest.raises(PinningError, match=r"pinning.json: cannot read: No such file"):
        pinning.read_records(missing)
    missing.write_text("[{")
    with pytest.raises(PinningError, match=r"pinning.json: not JSON: "):
        pinning.read_records(missing)
    missing.write_text(json.dumps([H200_RECORD]))
    assert pinning.read_records(missing) == parse_records([H200_RECORD])


# --- the report -------------------------------------------------------------------------


def test_report_renders_every_check_and_an_abnormal_step(tmp_path: Path) -> None:
    gpus = host.GpuHost("2.11.0+cu130", "13.0", (host.GpuDevice(0, "NVIDIA H200",
                                                                  150754820096),))
    checks = [judge_a6([a6("FLASH_ATTN", "passed")]), judge_l7(l7()),
              judge_pinning([worker()], 1)]
    steps = [{"name": "suite", "argv": ["python", "-m", "pytest", "-k", "kv_a6 or kv_l7"],
              "returncode": 0, "seconds": 1.0, "log": "suite.log"},
             {"name": "pinning", "argv": ["python"], "returncode": 4, "seconds": 0.5,
              "log": "pinning.log", "log_tail": ["ERROR: usage: ..."]}]
    env = {"python": "3.12.3", "vllm": "0.30.0", "vllm_omni": "0.30.0", "host": "h200",
           "devices": [{"name": "NVIDIA H200", "driver": "580.159.04"}]}
    sized = A6Sizing("bf16_h8", False, "LBNHC", H200_FREE, 0.5, H200_BLOCKS * 2048,
                     H200_BLOCKS, (Probe(0, 0, 0), Probe(0, 2**22, 2**32)))
    record = report.record(checks=checks, host=gpus.as_dict(), environment=env, steps=steps,
                           sizing=[sized.as_dict()], pinning=[worker().as_dict()],
                           seconds=12.34)
    markdown = report.write(tmp_path, record)
    assert json.loads((tmp_path / report.JSON_NAME).read_text()) == record
    text = markdown.read_text()
    assert text.startswith("# kvconform gpu-check: ok\n")
    assert "- GPU 0: NVIDIA H200, 143771 MiB, driver 580.159.04" in text
    assert "| KV-L7 | ok | 8 results: 8 ok |" in text
    assert "| xdist pinning | ok | 1 worker(s) for 1 GPU(s) |" in text
    assert "| suite | 0 | 1.0 | suite.log | `python -m pytest -k 'kv_a6 or kv_l7'` |" in text
    assert "pinning ended with exit status 4; the end of pinning.log:" in text
    assert "| False | LBNHC | bf16_h8 | 75377410048 bytes (70.20 GiB) | 36805376 | (0, 0): 0, " \
        "(0, 4194304): 4294967296 |" in text
    assert record["sizing"][0]["past_2_31"] and record["sizing"][0]["past_2_32"]
    assert "| gw0 | CUDA_VISIBLE_DEVICES=0, 1 device(s) (NVIDIA H200), kv_device cuda:0, " \
        "11 test(s) |" in text


# --- end to end on CPU: both pytest steps, the sizing, the report ------------------------


@needs_omni
@cpu_host
def test_gpu_check_runs_its_steps_against_the_installed_stack(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``check.run`` with a stand-in for the probe's answer (one H200) and the sizing on
    CPU: the steps' command lines, the stand-in and pinning plugins, the suite's report and
    the verdicts meet for real.  On CPU, KV-A6 and FLASH_ATTN skip for hardware (not
    checked) and the workers are not pinned to GPUs (failed)."""
    from pytest_kvconform.gpu import check

    # -n auto without GPUs is xdist's own count (one per core): two, whatever the machine
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "2")
    gpus = host.GpuHost("2.13.0", "13.0", (host.GpuDevice(0, "NVIDIA H200", 150754820096),))
    record = check.run(tmp_path, memory_fraction=0.5, gpus=gpus, sizing_device="cpu",
                       free_memory=lambda index: H200_FREE)
    verdicts = {c["name"]: c for c in record["checks"]}
    assert {n: c["verdict"] for n, c in verdicts.items()} == {
        "KV-A6": "not checked", "KV-L7": "not checked", "xdist pinning": "failed",
        "KV-A6 sizing": "ok"}
    assert record["verdict"] == "failed"
    assert [(s["name"], s["returncode"]) for s in record["steps"]] == [("suite", 1),
                                                                       ("pinning", 0)]

    l7_rows = {r["subject"]: r["verdict"] for r in verdicts["KV-L7"]["rows"]}
    for name in ("PAGED_OK", "PAGED_OK_BS", "PAGED_NO_TABLE", "PAGED_BAD_STRIDE",
                 "PAGED_TRUNCATES"):
        assert l7_rows[f"test_kv_l7[{name}]"] == "ok", name
    assert l7_rows["test_kv_l7[FLASH_ATTN]"] == l7_rows["test_kv_l7[PAGED_CUDA_ONLY]"] == \
        "not checked"
    a6_rows = {r["subject"]: r for r in verdicts["KV-A6"]["rows"]}
    assert a6_rows["test_kv_a6_seam[need_False-bf16_h8]"]["detail"] == \
        "KV-A6: needs CUDA (this process's device is cpu)"
    assert not any("PAGED_" in subject for subject in a6_rows)

    workers = record["pinning"]
    assert [w["worker"] for w in workers] == ["gw0", "gw1"]
    assert all(w["kv_device"] == "cpu" and w["cuda_visible_devices"] is None for w in workers)
    assert sum(w["tests"] for w in workers) >= 10  # KV-L1, one per backend
    assert [s["allocation_bytes"] for s in record["sizing"]] == [75_377_410_048] * 2

    text = (tmp_path / report.MARKDOWN_NAME).read_text()
    assert text.startswith("# kvconform gpu-check: failed\n")
    assert "| KV-A6 sizing | ok | 0.5 of 150754820096 free bytes (143771 MiB) on GPU 0 |" in text
    assert json.loads((tmp_path / report.JSON_NAME).read_text()) == record
    out = capsys.readouterr().out
    assert out.rstrip().endswith(f"kvconform gpu-check: failed; report in {tmp_path}/REPORT.md")
