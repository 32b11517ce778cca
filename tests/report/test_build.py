"""Report schema, verdict, Markdown and terminal rendering, from hand-built results."""

from __future__ import annotations

import copy
import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_kvconform import CONTRACT_VERSION
from pytest_kvconform.contract.records import BackendUnderTest
from pytest_kvconform.report import build as rp
from pytest_kvconform.workers import devices as dev
from tests import report_rows
from tests.paths import ROOT
from tests.report_rows import environment, row

# Rows of FLASH_ATTN's results unless told otherwise; skip_kind always present.
result = functools.partial(row, backend="FLASH_ATTN", duration_s=0.25, skip_kind=None)

ENV = environment(vllm_omni=None, platform="Linux-x86_64", host="box-a", seed=7, devices=[
    {"name": "cpu", "memory_bytes": 2**34, "driver": None, "cuda": None}])

BACKENDS = [
    BackendUnderTest(name="FLASH_ATTN", path="omni.flash:FlashBackend", source="registry"),
    BackendUnderTest(
        name="SAGE", path="omni.sage:SageBackend", source="registry", error="ImportError: sage"
    ),
]


def sample_results() -> list[dict[str, Any]]:
    layouts = ["LBNHC", "LBHNC", "LHBNC"]
    rows = [
        result("t.py::test_kv_l1[FLASH_ATTN]", "KV-L1", "passed"),
        result(
            "t.py::test_kv_l6[FLASH_ATTN]", "KV-L6", "failed", reason="pinned LBNHC, wants BLNHC"
        ),
        result(
            "t.py::test_kv_l7[FLASH_ATTN]", "KV-L7", "skipped",
            reason="needs a CUDA device", skip_kind="hardware",
        ),
        result(
            "t.py::test_kv_l1[SAGE]", "KV-L1", "skipped", backend="SAGE",
            reason="ImportError: sage", skip_kind="backend",
        ),
    ]
    rows += [
        result(f"t.py::test_kv_s1[{lay}]", "KV-S1", "passed", backend=None, layout=lay)
        for lay in layouts
    ]
    # Deliberately unsorted: build_report must sort.
    return list(reversed(rows))


RUN = rp.run_record(run_id="run-a", started="2026-12-03T07:00:00Z", duration_s=1.5)


def build(results: list[dict[str, Any]] | None = None, strict: bool = False) -> dict[str, Any]:
    """The sample results (or ``results``) as a complete run of :data:`BACKENDS`."""
    results = sample_results() if results is None else results
    options = {"kv_strict": strict, "kv_report": Path("out/r.json")}
    return report_rows.build(results, strict=strict, env=ENV, backends=BACKENDS,
                             options=options, run=RUN)


# --------------------------------------------------------------------------- build + schema


def test_build_report_fills_summary_verdict_and_sorts() -> None:
    report = build()
    assert report["schema"] == rp.SCHEMA
    assert report["contract"] == CONTRACT_VERSION
    nodeids = [r["nodeid"] for r in report["results"]]
    assert nodeids == sorted(nodeids)
    assert report["summary"]["total"] == 7
    assert report["summary"]["by_status"]["passed"] == 4
    assert report["summary"]["by_status"]["failed"] == 1
    assert report["summary"]["by_clause"]["KV-S1"]["passed"] == 3
    assert list(report["summary"]["by_clause"]) == ["KV-L1", "KV-L6", "KV-L7", "KV-S1"]
    assert report["summary"]["blocking"] == ["t.py::test_kv_l6[FLASH_ATTN]"]
    assert report["verdict"] == "not qualified"
    assert report["uncovered"] == [
        {"scope": "backend", "backend": "SAGE", "clauses": ["KV-L1"], "kind": "backend",
         "declared": [], "reason": "ImportError: sage", "results": 1},
        {"scope": "clause", "backend": "FLASH_ATTN", "clauses": ["KV-L7"], "kind": "hardware",
         "declared": [], "reason": "needs a CUDA device", "results": 1},
    ]
    assert report["startup_failures"] == []
    assert report["environment"]["options"]["kv_report"] == "out/r.json"
    sage = report["backends"][1]
    assert sage == {
        "name": "SAGE", "path": "omni.sage:SageBackend", "source": "registry",
        "overridden": False, "importable": False, "reason": "ImportError: sage",
        "family": "diffusion",
    }
    json.dumps(report)  # plain JSON values only


def test_build_report_is_order_independent() -> None:
    a = build(sample_results())
    b = build(list(reversed(sample_results())))
    assert a == b


def test_valid_report_survives_json_roundtrip() -> None:
    report = json.loads(json.dumps(build()))
    rp.validate_report(report)


@pytest.mark.parametrize(
    ("mutate", "path"),
    [
        (lambda r: r.__setitem__("schema", "pytest-kvconform/report/1"), "$.schema"),
        (lambda r: r.pop("verdict"), "$.verdict"),
        (lambda r: r.__setitem__("extra", 1), "$.extra"),
        (lambda r: r["results"][2].__setitem__("status", "ok"), "$.results[2].status"),
        (lambda r: r["results"][0].__setitem__("duration_s", -1), "$.results[0].duration_s"),
        (lambda r: r["results"][1].__setitem__("clause", "L1"), "$.results[1].clause"),
        (lambda r: r["results"][3].__setitem__("skip_kind", "weather"), "$.results[3].skip_kind"),
        (lambda r: r["results"][4].pop("device"), "$.results[4].device"),
        (lambda r: r["environment"]["devices"][0].__setitem__("memory_bytes", "16G"),
         "$.environment.devices[0].memory_bytes"),
        (lambda r: r["environment"].__setitem__("seed", True), "$.environment.seed"),
        (lambda r: r["backends"][0].__setitem__("importable", "yes"), "$.backends[0].importable"),
        (lambda r: r.__setitem__("verdict", "qualified"), "$.verdict"),
        (lambda r: r["summary"]["by_status"].__setitem__("passed", 99), "$.summary"),
        (lambda r: r.__setitem__("uncovered", []), "$.uncovered"),
        (lambda r: r["results"].reverse(), "$.results[1]"),
    ],
)
def test_mutated_report_names_the_path(mutate: Any, path: str) -> None:
    report = copy.deepcopy(build())
    mutate(report)
    with pytest.raises(rp.ReportError) as info:
        rp.validate_report(report)
    assert info.value.path == path
    assert str(info.value).startswith(path + ":")


def test_validate_rejects_non_object() -> None:
    with pytest.raises(rp.ReportError, match=r"^\$: expected an object"):
        rp.validate_report([1, 2])


def test_build_report_rejects_unknown_result_key() -> None:
    bad = sample_results()
    bad[0]["worker"] = "gw0"
    with pytest.raises(rp.ReportError, match=r"\.worker: unknown key"):
        build(bad)


# --------------------------------------------------------------------------- verdict


def test_verdict_non_strict_only_failures_and_errors_block() -> None:
    ok = [
        result("a", "KV-L1", "passed"),
        result("b", "KV-L2", "xpassed"),
        result("c", "KV-L3", "skipped", skip_kind="environment"),
        result("d", "KV-L4", "xfailed"),
    ]
    assert rp.compute_verdict(ok, strict=False)[0] == "qualified"
    assert rp.compute_verdict([*ok, result("e", "KV-L5", "error")], strict=False)[0] == (
        "not qualified"
    )
    assert rp.compute_verdict([*ok, result("e", "KV-L5", "failed")], strict=False)[0] == (
        "not qualified"
    )


@pytest.mark.parametrize(
    ("extra", "verdict"),
    [
        (result("z", "KV-L7", "skipped", skip_kind="hardware"), "qualified"),
        (result("z", "KV-L7", "skipped", skip_kind="environment"), "not qualified"),
        (result("z", "KV-L7", "skipped", skip_kind="backend"), "not qualified"),
        (result("z", "KV-L7", "skipped", skip_kind=None), "not qualified"),
        (result("z", "KV-L7", "xpassed"), "not qualified"),
        (result("z", "KV-L7", "xfailed"), "qualified"),
    ],
)
def test_verdict_strict(extra: dict[str, Any], verdict: str) -> None:
    base = [result("a", "KV-L1", "passed")]
    assert rp.compute_verdict([*base, extra], strict=True)[0] == verdict
    assert rp.compute_verdict([*base, extra], strict=False)[0] == "qualified"


def test_uncovered_lists_unchecked_clauses_in_contract_order() -> None:
    results = [
        result("a", "KV-A6", "skipped", skip_kind="hardware"),
        result("b", "KV-L7", "skipped", skip_kind="hardware"),
        result("c", "KV-L10", "skipped", skip_kind="hardware"),
        result("d", "KV-L7", "skipped", skip_kind="hardware", backend="SAGE"),
        result("e", "KV-S2", "skipped", skip_kind="environment", backend=None),
        result("f", "KV-L1", "passed"),
        result("g", "KV-L1", "passed", backend="SAGE"),
        result("h", "KV-L6", "skipped", skip_kind="not-applicable"),  # nothing to check
    ]
    verdict, uncovered = rp.compute_verdict(results, strict=True)
    assert verdict == "not qualified"  # the environment skip
    assert [(e["scope"], e["clauses"], e["backend"], e["kind"], e["results"])
            for e in uncovered] == [
        ("clause", ["KV-L7"], None, "hardware", 2),  # two rows: no one backend named
        ("clause", ["KV-L10"], "FLASH_ATTN", "hardware", 1),
        ("clause", ["KV-S2"], None, "environment", 1),
        ("clause", ["KV-A6"], "FLASH_ATTN", "hardware", 1),
    ]


def test_empty_run_is_not_qualified() -> None:
    assert rp.compute_verdict([], strict=False) == ("not qualified", [])


def test_strict_flag_changes_report_verdict() -> None:
    results = [result("a", "KV-L1", "passed"), result("b", "KV-L2", "xpassed")]
    assert build(results, strict=False)["verdict"] == "qualified"
    strict = build(results, strict=True)
    assert strict["verdict"] == "not qualified"
    assert strict["summary"]["blocking"] == ["b"]


# --------------------------------------------------------------------------- markdown


def test_markdown_matrix_with_footnotes_environment_and_verdict() -> None:
    md = rp.render_markdown(build())
    lines = md.splitlines()
    header = next(line for line in lines if line.startswith("| backend |"))
    assert header == "| backend | KV-L1 | KV-L6 | KV-L7 | KV-S1 |"
    flash = next(line for line in lines if line.startswith("| FLASH_ATTN |"))
    cells = [c.strip() for c in flash.strip("|").split("|")]
    assert cells[1] == "pass 1/1"
    assert cells[2].startswith("fail 1/1[^")
    assert cells[3].startswith("skip 1/1[^")
    assert cells[4] == ""
    upstream = next(line for line in lines if line.startswith("| (upstream) |"))
    assert "pass 3/3" in upstream
    sage = next(line for line in lines if line.startswith("| SAGE |"))
    assert "skip 1/1[^" in sage
    ref = cells[2][len("fail 1/1"):]
    assert f"{ref}: fail: pinned LBNHC, wants BLNHC" in lines
    assert "| vllm_omni | not installed |" in lines
    assert "| host | box-a |" in lines
    assert any(line.startswith("| device 0 | cpu, 16.0 GiB") for line in lines)
    assert "**Verdict: not qualified** (non-strict)" in lines
    assert ("- SAGE: not checked (every clause skipped, 1 result; backend skip: ImportError: "
            "sage)") in lines
    assert "- KV-L7 for FLASH_ATTN (1 result; hardware skip: needs a CUDA device)" in lines
    assert "- `t.py::test_kv_l6[FLASH_ATTN]`" in lines


def test_markdown_cell_shows_worst_status_and_count() -> None:
    results = [
        result(f"s[{i}]", "KV-S1", "failed" if i == 2 else "passed", backend=None,
               layout=f"L{i}", reason="stride 64 != 128" if i == 2 else None)
        for i in range(6)
    ]
    md = rp.render_markdown(build(results))
    row = next(line for line in md.splitlines() if line.startswith("| (upstream) |"))
    assert "fail 1/6[^1]" in row
    assert "[^1]: fail: stride 64 != 128" in md.splitlines()


def test_markdown_shares_footnotes_and_escapes_pipes() -> None:
    results = [
        result("a", "KV-L7", "skipped", reason="no CUDA", skip_kind="hardware"),
        result("b", "KV-L7", "skipped", backend="SAGE", reason="no CUDA", skip_kind="hardware"),
        result("c", "KV-L6", "failed", reason="a | b\nsecond line"),
    ]
    md = rp.render_markdown(build(results)).splitlines()
    # Row by row, column by column: FLASH_ATTN's KV-L6 failure is numbered first.
    assert "[^1]: fail: a \\| b second line" in md
    assert md.count("[^2]: skip: no CUDA") == 1
    assert sum("skip 1/1[^2]" in line for line in md) == 2

    backends = [{"name": "ODD", "path": "m:C", "source": "hook", "overridden": True,
                 "importable": False, "reason": "bad | worse"}]
    report = report_rows.build(results, strict=False, env=ENV, backends=backends, run=RUN)
    table_row = next(line for line in rp.render_markdown(report).splitlines()
                     if line.startswith("| ODD | hook"))
    assert table_row == "| ODD | hook | m:C | True | False | bad \\| worse |"


# --------------------------------------------------------------------------- terminal


def test_terminal_matrix() -> None:
    results = [
        *sample_results(),
        result("x", "KV-L6", "xfailed", backend="SAGE"),
        result("y", "KV-L10", "xpassed", backend="SAGE"),
        result("z", "KV-A1", "error", backend="EXTRA"),
    ]
    lines = rp.render_terminal_matrix(results, BACKENDS)
    assert lines[0].split() == ["backend", "L1", "L6", "L7", "L10", "S1", "A1"]
    rows = {line.split()[0]: line for line in lines[1:-1]}
    assert list(rows) == ["FLASH_ATTN", "SAGE", "EXTRA", "(upstream)"]
    # Cells sit under their headers.
    columns = {h: lines[0].index(h) for h in ("L1", "L6", "L7", "L10", "S1", "A1")}
    assert rows["FLASH_ATTN"][columns["L1"]] == "."
    assert rows["FLASH_ATTN"][columns["L6"]] == "F"
    assert rows["FLASH_ATTN"][columns["L7"]] == "s"
    assert rows["SAGE"][columns["L6"]] == "x"
    assert rows["SAGE"][columns["L10"] + 1] == "X"
    assert rows["EXTRA"].rstrip().endswith("E")
    assert rows["(upstream)"].split() == ["(upstream)", "."]
    assert lines[-1].startswith("legend: . pass  F fail  s skip  x xfail  X xpass  E error")


def test_terminal_matrix_worst_status_wins() -> None:
    results = [result(f"n{i}", "KV-S1", s, backend=None)
               for i, s in enumerate(["passed", "xfailed", "error", "passed"])]
    lines = rp.render_terminal_matrix(results, [])
    assert lines[1].split() == ["(upstream)", "E"]


def test_terminal_matrix_empty() -> None:
    assert rp.render_terminal_matrix([], ["A"]) == ["kvconform: no clause results"]


# --------------------------------------------------------------------------- files


def test_write_report_writes_json_markdown_and_page(tmp_path: Path) -> None:
    report = build()
    json_path, md_path, page = rp.write_report(tmp_path / "sub" / "r.json", report)
    assert json_path == tmp_path / "sub" / "r.json"
    assert md_path == tmp_path / "sub" / "r.md"
    assert page == tmp_path / "sub" / "r.html"
    assert json.loads(json_path.read_text()) == report
    assert md_path.read_text() == rp.render_markdown(report)
    assert rp.page_run_id(page.read_text()) == report["run"]["id"]
    # The report's lock stays (see tests/report/test_writers.py); no temp file does.
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == [".r.json.lock", "r.html",
                                                                    "r.json", "r.md"]


def test_write_report_refuses_invalid_report(tmp_path: Path) -> None:
    report = build()
    report["verdict"] = "qualified"
    with pytest.raises(rp.ReportError, match=r"^\$\.verdict"):
        rp.write_report(tmp_path / "r.json", report)
    assert list(tmp_path.iterdir()) == []


def test_load_report_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(rp.ReportError, match=r"bad\.json: not JSON"):
        rp.load_report(bad)
    with pytest.raises(rp.ReportError, match=r"missing\.json: cannot read"):
        rp.load_report(tmp_path / "missing.json")


# --------------------------------------------------------------------------- environment


def test_environment_info_without_nvidia_smi(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dev.shutil, "which", lambda name: None)
    env = rp.environment_info({"b": 1, "a": Path("x")}, seed=3)
    assert list(env) == list(rp._ENV_KEYS)
    assert env["devices"] == [
        {"name": "cpu", "memory_bytes": env["devices"][0]["memory_bytes"], "driver": None,
         "cuda": None}
    ]
    assert env["devices"][0]["memory_bytes"] > 0
    assert env["options"] == {"a": "x", "b": 1}
    assert list(env["options"]) == ["a", "b"]
    assert env["seed"] == 3


def test_environment_info_parses_nvidia_smi(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def fake_run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        assert kwargs["timeout"] <= 10
        if len(argv) > 1:
            out = "NVIDIA H200, 143771, 570.86.15\nNVIDIA H200, 143771, 570.86.15\n"
        else:
            out = "| NVIDIA-SMI 570.86.15   Driver Version: 570.86.15   CUDA Version: 12.8 |"
        return subprocess.CompletedProcess(argv, 0, out, "")

    monkeypatch.setattr(dev.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(dev.subprocess, "run", fake_run)
    devices = rp.environment_info({}, None)["devices"]
    assert devices == [
        {"name": "NVIDIA H200", "memory_bytes": 143771 * 2**20, "driver": "570.86.15",
         "cuda": "12.8"}
    ] * 2
    assert "--format=csv,noheader,nounits" in calls[0]


def test_environment_info_falls_back_when_nvidia_smi_hangs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def hang(argv: list[str], **kwargs: Any) -> None:
        raise subprocess.TimeoutExpired(argv, kwargs["timeout"])

    monkeypatch.setattr(dev.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(dev.subprocess, "run", hang)
    assert rp.environment_info({}, None)["devices"][0]["name"] == "cpu"


def test_environment_info_imports_neither_torch_nor_vllm() -> None:
    code = (
        "import sys\n"
        "from pytest_kvconform.report.build import environment_info\n"
        "env = environment_info({}, None)\n"
        "heavy = [m for m in ('torch', 'vllm', 'vllm_omni') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "print(env['vllm'])\n"
    )
    root = ROOT
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root,
        env={"PYTHONPATH": str(root), "PATH": ""},
    )
    assert proc.returncode == 0, proc.stderr


def test_environment_probe_is_the_device_probe() -> None:
    """One nvidia-smi probe (and one timeout) for device counting and the report."""
    assert rp.nvidia_smi is dev.nvidia_smi
    assert not hasattr(rp, "_run_quiet")


def test_backend_record_is_written_once() -> None:
    """The report's backend records and the session's come from BackendUnderTest.record()."""
    b = BackendUnderTest("X", "pkg.X", "registry", error="boom")
    assert tuple(b.record()) == (*rp._BACKEND_KEYS, *rp._BACKEND_OPTIONAL_KEYS)
    assert rp._backend_record(b) == {k: v for k, v in b.record().items() if k != "origin"}
    with_origin = BackendUnderTest("Y", "pkg.Y", "platform", origin="dist:ep")
    assert rp._backend_record(with_origin) == with_origin.record()


IMPORT_LOG = [{"level": "WARNING", "text": "WARNING [sage_attn.py:46] SageAttentionBackend is "
               "not available."},
              {"level": None, "text": "Traceback (most recent call last):\n  File \"x.py\"\n"
               "ValueError: boom"}]


def test_the_import_log_is_an_optional_environment_record_shown_in_the_markdown() -> None:
    report = copy.deepcopy(build())
    assert "import_log" not in report["environment"]
    rp.validate_report(report)
    report["environment"]["import_log"] = IMPORT_LOG
    rp.validate_report(json.loads(json.dumps(report)))
    md = rp.render_markdown(report)
    section = md.split("### Output of the serving stack's imports", 1)[1].split("\n## ", 1)[0]
    assert "2 messages printed while vLLM / vllm-omni were imported" in section
    assert "SageAttentionBackend is not available." in section and "ValueError: boom" in section
    for bad, path in ((["text"], "$.environment.import_log[0]"),
                      ([{"level": 3, "text": "x"}], "$.environment.import_log[0].level"),
                      ([{"level": None, "text": "x", "pid": 1}],
                       "$.environment.import_log[0].pid")):
        report["environment"]["import_log"] = bad
        with pytest.raises(rp.ReportError) as info:
            rp.validate_report(report)
        assert info.value.path == path


WORKER_LOG = [{"level": "WARNING", "text": "WARNING [cpu.py:293] Reset SSM cache type to "
               "float32 for accelerated GDN mamba backend 'none'.",
               "source": "KV-A worker cpu-0"},
              {"level": "WARNING", "text": "(DiffusionWorker) WARNING [gpu_memory_utils.py:88] "
               "NVML init failed", "source": "gw1 KV-A worker cpu-1"},
              {"level": None, "text": "no source"}]


def test_the_worker_log_is_an_optional_environment_record_shown_in_the_markdown() -> None:
    report = copy.deepcopy(build())
    assert "worker_log" not in report["environment"]
    report["environment"]["worker_log"] = WORKER_LOG
    rp.validate_report(json.loads(json.dumps(report)))
    md = rp.render_markdown(report)
    section = md.split("### Output of production's KV-A workers", 1)[1].split("\n## ", 1)[0]
    assert "3 messages printed by production's KV-A worker processes" in section
    assert "[KV-A worker cpu-0] WARNING [cpu.py:293] Reset SSM cache type" in section
    assert "[gw1 KV-A worker cpu-1] (DiffusionWorker) WARNING" in section
    assert "\nno source\n" in section
    for bad, path in ((["text"], "$.environment.worker_log[0]"),
                      ([{"level": None, "text": "x", "source": 1}],
                       "$.environment.worker_log[0].source"),
                      ([{"level": None, "text": "x", "pid": 1}],
                       "$.environment.worker_log[0].pid")):
        report["environment"]["worker_log"] = bad
        with pytest.raises(rp.ReportError) as info:
            rp.validate_report(report)
        assert info.value.path == path
    report["environment"]["import_log"] = [{"level": None, "text": "x", "source": "y"}]
    del report["environment"]["worker_log"]
    with pytest.raises(rp.ReportError, match="unknown key"):
        rp.validate_report(report)  # the import log's messages name no source
