"""The report, expected failures and strict mode, end to end through pytest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pytest_kvconform.report import build as report
from pytest_kvconform.report.verdict import EXIT_NOT_CHECKED
from tests.seeding import register_backends
from tests.standin_backends import GOOD_AND_INT_FLAG, Good

# The one expected failure most tests declare: INT_FLAG's KV-L1.
INT_FLAG_ENTRY = '''
[[xfail]]
backend = "INT_FLAG"
clause = "KV-L1"
test = "test_kv_l1"
match = "returned 1 of type int; a real bool is required"
reason = "returns an int"
'''
# KV-L1's need control (its name control passes for both: tests/seeded/test_layout.py).
SELECT = ("-k", "kv_l1 and not name", "--kv-backend", "GOOD", "--kv-backend", "INT_FLAG")


def _results(path: Path) -> list[dict[str, Any]]:
    data = json.loads(path.read_text())
    return [{k: v for k, v in r.items() if k != "duration_s"} for r in data["results"]]


def test_report_json_and_markdown(pytester: pytest.Pytester, kv_run) -> None:
    register_backends(pytester, GOOD_AND_INT_FLAG)
    result = kv_run(*SELECT, "--kv-report", "r.json")
    result.assert_outcomes(passed=1, failed=1)
    data = json.loads((pytester.path / "r.json").read_text())
    report.validate_report(data)
    assert data["verdict"] == "not qualified"
    by_backend = {r["backend"]: r for r in data["results"]}
    assert by_backend["GOOD"]["status"] == "passed"
    assert by_backend["INT_FLAG"]["status"] == "failed"
    assert "returned 1 of type int" in by_backend["INT_FLAG"]["reason"]
    assert {b["name"] for b in data["backends"]} == {"GOOD", "INT_FLAG"}
    markdown = (pytester.path / "r.md").read_text()
    assert "INT_FLAG" in markdown and "KV-L1" in markdown
    result.stdout.fnmatch_lines(["*kvconform: backend x clause*", "GOOD *.", "INT_FLAG *F"])


def test_report_is_the_same_under_xdist(pytester: pytest.Pytester, kv_run) -> None:
    register_backends(pytester, GOOD_AND_INT_FLAG)
    serial = kv_run(*SELECT, "--kv-report", "serial.json")
    serial.assert_outcomes(passed=1, failed=1)
    parallel = pytester.runpytest("--kv-conformance", "-p", "no:cacheprovider", *SELECT,
                                  "-n", "2", "--kv-report", "parallel.json")
    parallel.assert_outcomes(passed=1, failed=1)
    assert _results(pytester.path / "serial.json") == _results(pytester.path / "parallel.json")


def test_xfails_match_and_stale_entry_warned(pytester: pytest.Pytester, kv_run) -> None:
    register_backends(pytester, GOOD_AND_INT_FLAG)
    xf = pytester.makefile(".toml", known=INT_FLAG_ENTRY + '''
        [[xfail]]
        backend = "NOT_THERE"
        clause = "KV-L2"
        test = "test_kv_l2"
        match = "."
        reason = "stale"
    ''')
    result = kv_run(*SELECT, "-rx", "--kv-xfails", str(xf), "--kv-report", "r.json")
    result.assert_outcomes(passed=1, xfailed=1)
    result.stdout.fnmatch_lines(["*1 stale known-finding entry matched no test: "
                                 "known.toml:2 NOT_THERE/KV-L2/test_kv_l2"])
    statuses = {r["backend"]: r["status"] for r in _results(pytester.path / "r.json")}
    assert statuses == {"GOOD": "passed", "INT_FLAG": "xfailed"}


def test_strict_mode_fails_on_xpass_and_names_verdict(pytester: pytest.Pytester,
                                                      kv_run) -> None:
    register_backends(pytester, GOOD_AND_INT_FLAG)
    xf = pytester.makefile(".toml", known='''
        [[xfail]]
        backend = "GOOD"
        clause = "KV-L1"
        test = "test_kv_l1"
        match = "."
        reason = "claims a failure that is fixed"
    ''')
    result = kv_run("-k", "kv_l1 and not name", "--kv-backend", "GOOD", "--kv-xfails", str(xf),
                    "--kv-strict", "--kv-report", "r.json")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*kvconform: verdict*: not qualified (xpassed (a known finding "
                                 "no longer fails: remove its entry): KV-L1 test_kv_l1[[]GOOD]; "
                                 "left out: *"])
    (row,) = _results(pytester.path / "r.json")
    assert row["status"] == "xpassed"  # pytest fails it (strict); the report says what it is
    assert row["reason"].startswith("[XPASS(strict)] known: claims a failure that is fixed")


@pytest.mark.parametrize("args", [("-k", "kv_l1"), ("--kv-strict",)],
                         ids=["non_strict", "strict"])
def test_a_backend_that_does_not_import_is_not_checked(pytester: pytest.Pytester, kv_run,
                                                        args: tuple[str, ...]) -> None:
    """Nothing ran, nothing qualified, with or without --kv-strict: exit status 7 (strict
    mode fails a -k selection for itself: its run is whole)."""
    register_backends(pytester, {"GOOD": Good, "BROKEN": "no_mod_q:X"})
    result = kv_run("--kv-backend", "BROKEN", *args)
    assert result.ret == EXIT_NOT_CHECKED
    result.stdout.fnmatch_lines(["kvconform: verdict for BROKEN: not qualified (BROKEN: not "
                                 "checked (every clause skipped, * result*; backend skip: "
                                 "backend BROKEN is not importable: ModuleNotFoundError*"])


def test_junit_properties(pytester: pytest.Pytester, kv_run) -> None:
    register_backends(pytester, GOOD_AND_INT_FLAG)
    kv_run(*SELECT, "--junitxml", "j.xml")
    xml = (pytester.path / "j.xml").read_text()
    assert '<property name="kv_clause" value="KV-L1"' in xml
    assert '<property name="kv_backend" value="INT_FLAG"' in xml


def test_deselected_or_unselected_entries_are_not_stale(pytester: pytest.Pytester,
                                                        kv_run) -> None:
    """-k deselection and --kv-backend selection never make an entry look stale."""
    register_backends(pytester, GOOD_AND_INT_FLAG)
    xf = pytester.makefile(".toml", known=INT_FLAG_ENTRY + '''
        [[xfail]]
        backend = "GOOD"
        clause = "KV-L2"
        test = "test_kv_l2"
        match = "."
        reason = "deselected by -k below"
    ''')
    result = kv_run("-k", "kv_l1 and not name", "--kv-backend", "GOOD", "--kv-xfails", str(xf))
    result.assert_outcomes(passed=1)
    assert "stale known-finding entr" not in result.stdout.str()


def test_stale_detection_under_xdist(pytester: pytest.Pytester) -> None:
    register_backends(pytester, GOOD_AND_INT_FLAG)
    xf = pytester.makefile(".toml", known=INT_FLAG_ENTRY + '''
        [[xfail]]
        backend = "NOT_THERE"
        clause = "KV-L2"
        test = "test_kv_l2"
        match = "."
        reason = "names no test"
    ''')
    result = pytester.runpytest("--kv-conformance", "-p", "no:cacheprovider", *SELECT,
                                "-n", "2", "--kv-xfails", str(xf))
    result.assert_outcomes(passed=1, xfailed=1)
    result.stdout.fnmatch_lines(["*stale known-finding entry matched no test: "
                                 "known.toml:2 NOT_THERE/KV-L2/test_kv_l2"])
    assert "known.toml:1" not in result.stdout.str()


def test_the_page_and_the_job_summary(pytester: pytest.Pytester, kv_run,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``--kv-report r.json`` writes ``r.html`` beside it, and a run under GitHub Actions
    appends its verdict and grid to the job's summary."""
    register_backends(pytester, GOOD_AND_INT_FLAG)
    summary = pytester.path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    result = kv_run(*SELECT, "--kv-report", "r.json")
    result.stdout.fnmatch_lines(["kvconform: report written to r.json, r.md and r.html",
                                 "kvconform: verdict and grid appended to the job summary "
                                 "($GITHUB_STEP_SUMMARY)"])
    page = (pytester.path / "r.html").read_text()
    data = json.loads((pytester.path / "r.json").read_text())
    assert report.page_run_id(page) == data["run"]["id"]
    assert 'id="test_kv_l1[INT_FLAG]"' in page and "returned 1 of type int" in page
    text = summary.read_text()
    assert text.startswith("### kvconform: ✗ verdict for GOOD, INT_FLAG: not qualified "
                           "(non-strict)")
    assert "| INT_FLAG | ✗ fail 1/1 |" in text and "| GOOD | ✓ pass 1/1 |" in text
    assert "`r.html`" in text
