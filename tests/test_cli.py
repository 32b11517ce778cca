"""The ``kvconform`` console script: show, validate, merge, and the ``run`` slot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pytest_kvconform import CONTRACT_VERSION
from pytest_kvconform.cli import main
from pytest_kvconform.report import build as rp
from tests.report_rows import backend_record, build, environment, row


def make_report(host: str, status_l7: str, *, skip_kind: str | None = None) -> dict[str, Any]:
    results = [
        row("t.py::test_kv_l1[FLASH_ATTN]", backend="FLASH_ATTN"),
        row("t.py::test_kv_l7[FLASH_ATTN]", "KV-L7", status_l7, backend="FLASH_ATTN",
            device="cuda:0", reason="no CUDA device" if status_l7 == "skipped" else None,
            duration_s=0.2, skip_kind=skip_kind),
    ]
    backends = [backend_record("FLASH_ATTN", "m:F", "registry")]
    return build(results, env=environment(host=host), backends=backends)


def dump(path: Path, obj: Any) -> Path:
    path.write_text(json.dumps(obj))
    return path


@pytest.fixture
def two_reports(tmp_path: Path) -> tuple[Path, Path]:
    cpu = dump(tmp_path / "cpu.json", make_report("cpu-box", "skipped", skip_kind="hardware"))
    gpu = dump(tmp_path / "gpu.json", make_report("gpu-box", "passed"))
    return cpu, gpu


def test_show_prints_markdown(two_reports: tuple[Path, Path], capsys: Any) -> None:
    cpu, _ = two_reports
    assert main(["show", str(cpu)]) == 0
    out = capsys.readouterr().out
    assert out == rp.render_markdown(json.loads(cpu.read_text()))
    assert "| FLASH_ATTN | pass 1/1 | skip 1/1[^1] |" in out


def test_validate(two_reports: tuple[Path, Path], tmp_path: Path, capsys: Any) -> None:
    cpu, gpu = two_reports
    assert main(["validate", str(cpu), str(gpu)]) == 0
    assert "valid" in capsys.readouterr().out
    broken = json.loads(cpu.read_text())
    broken["results"][1]["status"] = "maybe"
    bad = dump(tmp_path / "broken.json", broken)
    assert main(["validate", str(cpu), str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kvconform: error: {bad}: $.results[1].status: expected one of")
    assert len(err.splitlines()) == 1


def test_validate_checks_an_expected_failures_file(tmp_path: Path, capsys: Any) -> None:
    """``kvconform validate known.toml``: the same schema ``--kv-xfails`` enforces."""
    from importlib import resources

    known = str(resources.files("pytest_kvconform.known") / "vllm_omni_0_30.toml")
    assert main(["validate", known]) == 0
    assert capsys.readouterr().out.strip() == (f"{known}: valid (expected failures: 8 "
                                               "entries, known on vllm >=0.30,<0.33 and "
                                               "vllm-omni >=0.30,<0.33)")
    vague = tmp_path / "vague.toml"
    vague.write_text('[[xfail]]\nbackend = "*"\nclause = "KV-A4"\nreason = "fails"\n')
    assert main(["validate", str(vague)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"kvconform: error: {vague}: [[xfail]] entry 1: key 'test': missing "
                   "(required): the failing control, one suite test function (e.g. "
                   "'test_kv_a4_unadopted')")


def test_validate_refuses_a_match_that_would_run_away(tmp_path: Path, capsys: Any) -> None:
    """A pattern that backtracks exponentially is refused by reading it, not by running it."""
    hostile = tmp_path / "hostile.toml"
    hostile.write_text('[[xfail]]\nbackend = "*"\nclause = "KV-L8"\ntest = "test_kv_l8_alias"\n'
                       'match = "(.+)+#"\nreason = "r"\n')
    assert main(["validate", str(hostile)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"kvconform: error: {hostile}: [[xfail]] entry 1: key 'match': '(.+)+#' can backtrack "
        "without end: a repetition '+' of something that varies in length; match what each "
        "problem contains without repeating a group that itself repeats or alternates (e.g. "
        "'.+' for '(.+)+', '[ab]+' for '(a|b)+')")


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("{oops", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"schema": "other/1"}', "unsupported schema 'other/1'"),
    ],
)
def test_bad_file_is_one_clear_message(
    tmp_path: Path, capsys: Any, content: str, expected: str
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    for command in ("show", "validate"):
        assert main([command, str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        assert str(bad) in err and expected in err


@pytest.mark.parametrize("command", ["validate", "show", "merge"])
@pytest.mark.parametrize("nesting", ["array", "in-a-report"])
def test_deeply_nested_file_is_not_a_report(
    two_reports: tuple[Path, Path], tmp_path: Path, capsys: Any, command: str, nesting: str
) -> None:
    bad = tmp_path / "deep.json"
    if nesting == "array":  # 200 KB of [[[...]]]: the JSON parser itself would overflow
        bad.write_text("[" * 100_000 + "]" * 100_000)
    else:  # deep enough to pass the parser, in a field the schema leaves open
        report = json.loads(two_reports[0].read_text())
        report["environment"]["options"]["x"] = json.loads("[" * 500 + "]" * 500)
        dump(bad, report)
    args = [command, str(bad)] + ([str(two_reports[1])] if command == "merge" else [])
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"kvconform: error: {bad}: not a report: ")


@pytest.mark.parametrize("command", ["validate", "show"])
@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("contract", "99", f"$.contract: unknown contract version '99' (this kvconform knows "
                           f"'{CONTRACT_VERSION}')"),
        ("schema", "pytest-kvconform/report/99", "unsupported schema "
         f"'pytest-kvconform/report/99' (expected '{rp.SCHEMA}')"),
    ],
)
def test_unknown_version_is_refused(
    two_reports: tuple[Path, Path], tmp_path: Path, capsys: Any, command: str, key: str,
    value: str, expected: str
) -> None:
    claimed = json.loads(two_reports[0].read_text())
    claimed[key] = value
    bad = dump(tmp_path / "future.json", claimed)
    assert main([command, str(bad)]) == 2
    err = capsys.readouterr().err
    assert err == f"kvconform: error: {bad}: {expected}\n"


def test_merge_refuses_unknown_contract_on_every_report(tmp_path: Path, capsys: Any) -> None:
    reports = [json.loads(json.dumps(make_report(h, "passed"))) for h in ("a", "b")]
    paths = []
    for report in reports:
        report["contract"] = "99"
        paths.append(dump(tmp_path / f"{report['environment']['host']}.json", report))
    assert main(["merge", *map(str, paths)]) == 2
    assert f"{paths[0]}: $.contract: unknown contract version '99'" in capsys.readouterr().err


def test_missing_file(tmp_path: Path, capsys: Any) -> None:
    assert main(["show", str(tmp_path / "absent.json")]) == 2
    assert "absent.json: cannot read" in capsys.readouterr().err


def test_merge_writes_both_hosts(two_reports: tuple[Path, Path], tmp_path: Path) -> None:
    cpu, gpu = two_reports
    out = tmp_path / "matrix.md"
    assert main(["merge", str(cpu), str(gpu), "-o", str(out)]) == 0
    md = out.read_text().splitlines()
    assert "| backend | host | KV-L1 | KV-L7 |" in md
    assert "| FLASH_ATTN | cpu-box | pass 1/1 | skip 1/1[^1] |" in md
    assert "| FLASH_ATTN | gpu-box | pass 1/1 | pass 1/1 |" in md
    assert "[^1]: skip: no CUDA device" in md
    assert any(line.startswith("| cpu-box | " + str(cpu)) for line in md)
    assert any(line.startswith("| gpu-box | " + str(gpu)) for line in md)
    assert "**Verdict: qualified** (every host must qualify)" in md
    # The GPU host ran KV-L7: the merged matrix leaves no clause uncovered.
    assert not any(line.startswith("Not checked by any host") for line in md)


def test_merge_reports_uncovered_and_failing_host(tmp_path: Path, capsys: Any) -> None:
    a = dump(tmp_path / "a.json", make_report("cpu-box", "skipped", skip_kind="hardware"))
    b = dump(tmp_path / "b.json", make_report("cpu-box", "skipped", skip_kind="environment"))
    assert main(["merge", str(a), str(b)]) == 0
    md = capsys.readouterr().out.splitlines()
    # Equal hosts are told apart by file name.
    assert any(line.startswith("| FLASH_ATTN | cpu-box (a.json) |") for line in md)
    assert any(line.startswith("| FLASH_ATTN | cpu-box (b.json) |") for line in md)
    assert "**Verdict: not qualified** (every host must qualify)" in md
    assert "Not checked by any host:" in md
    assert "- KV-L7 for FLASH_ATTN (1 result; hardware skip: no CUDA device)" in md
    assert "- KV-L7 for FLASH_ATTN (1 result; environment skip: no CUDA device)" in md


def test_host_labels_disambiguate_same_file_name() -> None:
    rep = make_report("h", "passed")
    assert rp.host_labels([("x/r.json", rep), ("y/r.json", rep), ("z.json", rep)]) == [
        "h (r.json) #1", "h (r.json) #2", "h (z.json)"
    ]


def test_merge_refuses_different_schema(
    two_reports: tuple[Path, Path], tmp_path: Path, capsys: Any
) -> None:
    cpu, gpu = two_reports
    future = json.loads(gpu.read_text())
    future["schema"] = "pytest-kvconform/report/3"
    future_path = dump(tmp_path / "future.json", future)
    out = tmp_path / "matrix.md"
    assert main(["merge", str(cpu), str(future_path), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(cpu) in err and str(future_path) in err
    assert f"'{rp.SCHEMA}'" in err and "'pytest-kvconform/report/3'" in err
    assert "schema" in err
    assert not out.exists()


def test_merge_refuses_different_contract(
    two_reports: tuple[Path, Path], tmp_path: Path, capsys: Any
) -> None:
    cpu, gpu = two_reports
    other = json.loads(gpu.read_text())
    other["contract"] = "0"
    other_path = dump(tmp_path / "old.json", other)
    assert main(["merge", str(cpu), str(other_path)]) == 2
    err = capsys.readouterr().err
    assert f"{cpu} has contract '{CONTRACT_VERSION}' but {other_path} has '0'" in err


def test_merge_refuses_invalid_report(
    two_reports: tuple[Path, Path], tmp_path: Path, capsys: Any
) -> None:
    cpu, gpu = two_reports
    edited = json.loads(gpu.read_text())
    edited["verdict"] = "not qualified"
    edited_path = dump(tmp_path / "edited.json", edited)
    assert main(["merge", str(cpu), str(edited_path)]) == 2
    assert f"{edited_path}: $.verdict" in capsys.readouterr().err


def test_run_passes_arguments_to_pytest_and_prints_the_report(
        two_reports: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    cpu, _ = two_reports
    calls: list[list[str]] = []

    def fake_main(argv: list[str]) -> int:
        calls.append(argv)
        Path(argv[argv.index("--kv-report") + 1]).write_text(cpu.read_text())
        return 1

    monkeypatch.setattr(pytest, "main", fake_main)
    target = tmp_path / "kept.json"
    assert main(["run", "--report", str(target), "--kv-backend", "X", "-n", "2"]) == 1
    assert calls == [["--kv-conformance", "-q", "--kv-report", str(target), "--kv-backend", "X",
                      "-n", "2"]]
    assert "| backend |" in capsys.readouterr().out or target.is_file()


def test_usage_errors_return_2(capsys: Any) -> None:
    assert main([]) == 2
    assert main(["frobnicate"]) == 2
    assert main(["merge"]) == 2
    assert main(["--help"]) == 0
    assert "merge" in capsys.readouterr().out


ESCAPES = "\x1b[2J\x1b]0;pwned\x07\x1b[31m"  # clear the screen, set the title, turn red


def _hostile_report(host: str) -> dict[str, Any]:
    """A valid report whose texts carry escape sequences and Markdown: a report from
    another host is input, not output."""
    results = [
        row("t.py::test_kv_l1[FLASH_ATTN]", backend="FLASH_ATTN"),
        row("t.py::test_kv_l7[FLASH_ATTN]", "KV-L7", "skipped", backend="FLASH_ATTN",
            reason=f"no CUDA {ESCAPES}<img src=x onerror=alert(1)>|", skip_kind="hardware"),
    ]
    env = environment(host=f"{host}{ESCAPES}", import_log=[
        {"level": "WARNING", "text": f"vLLM said {ESCAPES}\n```` fence"}])
    backends = [backend_record("FLASH_ATTN", f"m:F{ESCAPES}", "registry")]
    return build(results, env=env, backends=backends)


def test_show_and_merge_print_no_escape_sequence(tmp_path: Path, capsys: Any) -> None:
    one = dump(tmp_path / "one.json", _hostile_report("cpu-box"))
    two = dump(tmp_path / "two.json", _hostile_report("gpu-box"))
    for argv in (["show", str(one)], ["merge", str(one), str(two)]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out and "\x07" not in out, argv
        assert "\\x1b[2J" in out, argv  # shown as text: what the report holds, visibly
        assert "<img" not in out, argv
    assert main(["merge", str(one), str(two), "-o", str(tmp_path / "m.md")]) == 0
    assert "\x1b" not in (tmp_path / "m.md").read_text()
