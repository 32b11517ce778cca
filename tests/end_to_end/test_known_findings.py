"""The shipped known-findings file keeps strict CI green, and every entry is needed."""

from __future__ import annotations

import json
import re
import tomllib
from importlib import resources
from pathlib import Path

import pytest

from tests.conftest import needs_omni

KNOWN = Path(str(resources.files("pytest_kvconform.known") / "vllm_omni_0_30.toml"))
ENTRIES = tomllib.loads(KNOWN.read_text())["xfail"]
# Every entry's tests, and a passing neighbour for each, in one small selection.
SELECT = ("-k", "(kv_l8 and (TORCH_SDPA or SAGE_ATTN_3)) or kv_l6_seam or "
                "(kv_l1 and SAGE_ATTN_3) or (kv_l2 and TORCH_SDPA) or "
                "(kv_a4 and bf16_h8 and (FLASH_ATTN or seam)) or "
                "(kv_a3 and bf16_h8 and FLASH_ATTN)")

pytestmark = needs_omni


def _toml(entries: list[dict[str, str]]) -> str:
    # JSON strings are TOML basic strings: a pattern's backslashes survive the round trip.
    return "\n".join("[[xfail]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in e.items())
                     for e in entries)


def test_shipped_file_passes_strict(pytester: pytest.Pytester, kv_run) -> None:
    result = kv_run(*SELECT, "--kv-strict", "--kv-xfails", str(KNOWN), "--kv-report", "r.json")
    # Nothing in the selection blocks; but a -k selection never qualifies: it is
    # "partial", which strict mode refuses.  The full matrix qualifies in .ci/run.
    data = json.loads((pytester.path / "r.json").read_text())
    assert data["summary"]["blocking"] == [], result.stdout.str()[-3000:]
    assert data["summary"]["by_status"]["failed"] == data["summary"]["by_status"]["error"] == 0
    assert data["verdict"] == "partial"
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*kvconform: verdict*: partial (left out: -k *"])
    # SAGE_ATTN_3 does not import: declared, so forgiven, but named as unchecked, with why.
    sage3 = [e for e in data["uncovered"] if e["backend"] == "SAGE_ATTN_3"]
    assert [(e["scope"], e["kind"]) for e in sage3] == [("backend", "backend")], data["uncovered"]
    assert sage3[0]["declared"] and "sageattn3" in sage3[0]["reason"]
    result.stdout.fnmatch_lines(["*kvconform: verdict*: partial (*unchecked: SAGE_ATTN_3: not "
                                 "checked (every clause skipped, * results; backend skip, "
                                 "declared: backend SAGE_ATTN_3 is not importable: "
                                 "*sageattn3*"])


@pytest.mark.parametrize("index", range(len(ENTRIES)),
                         ids=[f"{e['backend']}-{e.get('test', e['clause'])}" for e in ENTRIES])
def test_each_entry_is_needed(pytester: pytest.Pytester, kv_run, index: int) -> None:
    removed = ENTRIES[index]
    kept = pytester.makefile(".toml", known=_toml(ENTRIES[:index] + ENTRIES[index + 1:]))
    result = kv_run(*SELECT, "--kv-strict", "--kv-xfails", str(kept), "-rf")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*kvconform: verdict*: not qualified*"])
    failed = re.findall(r"^FAILED \S+::(\S+)", result.stdout.str(), re.MULTILINE)
    if removed["clause"] == "*":  # an unimportable backend: its skips are no longer declared
        assert failed == []
        return
    assert failed, "removing the entry should make its tests fail"
    prefix = removed.get("test") or f"test_{removed['clause'].lower().replace('-', '_')}"
    for test_id in failed:
        assert test_id.startswith(prefix), test_id
        if removed["backend"] != "*":
            assert f"[{removed['backend']}]" in test_id


ALIAS = next(e for e in ENTRIES if e["test"] == "test_kv_l8_alias")
# A whole deployment's run narrowed with -k (--kv-backend would scope the verdict to the
# backend's own results, and KV-L8 is the stack's).
ALIAS_RUN = ("-k", "kv_l8_alias and TORCH_SDPA", "--kv-strict", "-rfx", "--kv-report", "r.json")


@pytest.mark.parametrize("match", [
    r"KeyError\('NHD'\)",  # one of the failure's two problems (HND's is the other)
    "disagrees with the layout resolved by the control plane",  # another finding's failure
])
def test_no_finding_absorbs_a_failure_it_does_not_describe(pytester: pytest.Pytester, kv_run,
                                                           match: str) -> None:
    """An entry covering a test that fails another way: the failure stays a failure, named
    as differing from the entry, and blocks qualification."""
    known = pytester.makefile(".toml", known=_toml([{**ALIAS, "match": match}]))
    result = kv_run(*ALIAS_RUN, "--kv-xfails", str(known))
    result.assert_outcomes(failed=1)
    entry = "known.toml:1 */KV-L8/test_kv_l8_alias"
    result.stdout.fnmatch_lines([
        "*- kvconform: known finding -*",
        f"differs from known finding {entry} (it expects a failure matching /*/): resolve_*",
        f"*kvconform: verdict*: not qualified (differs from known finding {entry}: KV-L8 "
        "test_kv_l8_alias[[]TORCH_SDPA]; left out: *",
        "FAILED *test_kv_l8_alias[[]TORCH_SDPA] - differs from *"])
    (row,) = json.loads((pytester.path / "r.json").read_text())["results"]
    assert (row["status"], row["xfail"]) == ("failed", entry)
    assert row["reason"].startswith(f"differs from known finding {entry} (it expects a failure "
                                    f"matching /{match}/): KV-L8 violated [backend=TORCH_SDPA")
    assert "bare KeyError('HND')" in row["reason"]


def test_the_shipped_finding_absorbs_the_failure_it_describes(pytester: pytest.Pytester,
                                                               kv_run) -> None:
    known = pytester.makefile(".toml", known=_toml([ALIAS]))
    result = kv_run(*ALIAS_RUN, "--kv-xfails", str(known))
    result.assert_outcomes(xfailed=1)
    (row,) = json.loads((pytester.path / "r.json").read_text())["results"]
    assert (row["status"], row["xfail"]) == ("xfailed", "known.toml:1 */KV-L8/test_kv_l8_alias")
    result.stdout.fnmatch_lines(["*kvconform: verdict*: partial (left out: -k *"])
