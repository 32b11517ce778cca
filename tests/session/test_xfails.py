"""Expected-failure files: parsing, matching, version/device conditions, staleness."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_kvconform.session import xfails
from pytest_kvconform.session.xfails import (
    XfailEntry,
    XfailFileError,
    first_match,
    load_xfails,
    stale_entries,
)

GOOD = """
[[xfail]]
backend = "FLASH_ATTN"
clause = "KV-L6"
test = "test_kv_l6"
match = "never receives indexes_kv_by_block_stride"
reason = "vllm-omni 0.30 drops the backend's flag"
vllm_omni = ">=0.30,<0.31"

[[xfail]]
backend = "*"
clause = "KV-S4"
test = "test_kv_s4"
match = "padding"
case = "padded"
layout = "BLNHC"
reason = "padding not supported"
vllm = ">=0.30"
device = "cuda"
"""

V030 = {"vllm": "0.30.0", "vllm_omni": "0.30.0"}


def write(tmp_path: Path, text: str, name: str = "xfails.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture
def entries(tmp_path: Path) -> list[XfailEntry]:
    return load_xfails(write(tmp_path, GOOD))


def test_load_parses_entries(entries: list[XfailEntry], tmp_path: Path) -> None:
    first, second = entries
    assert (first.index, first.backend, first.clause, first.case, first.layout) == (
        1, "FLASH_ATTN", "KV-L6", None, None
    )
    assert first.file == str(tmp_path / "xfails.toml")
    assert str(first.vllm_omni) == "<0.31,>=0.30"
    assert first.vllm is None and first.device is None
    assert (second.index, second.case, second.layout, second.device) == (
        2, "padded", "BLNHC", "cuda"
    )


def test_describe_is_stable_and_host_independent(tmp_path: Path) -> None:
    a = load_xfails(write(tmp_path, GOOD))
    other = tmp_path / "elsewhere"
    other.mkdir()
    b = load_xfails(write(other, GOOD))
    assert [e.describe() for e in a] == [
        "xfails.toml:1 FLASH_ATTN/KV-L6/test_kv_l6",
        "xfails.toml:2 */KV-S4/test_kv_s4/padded@BLNHC",
    ]
    assert [e.describe() for e in a] == [e.describe() for e in b]


def test_empty_file_gives_no_entries(tmp_path: Path) -> None:
    assert load_xfails(write(tmp_path, "# nothing yet\n")) == []


def test_matches(entries: list[XfailEntry]) -> None:
    flash, padded = entries
    assert flash.matches("FLASH_ATTN", "KV-L6", None, None, "test_kv_l6")
    # unset fields match any
    assert flash.matches("FLASH_ATTN", "KV-L6", "any-case", "LBHNC", "test_kv_l6")
    assert not flash.matches("SAGE", "KV-L6", None, None)
    assert not flash.matches("FLASH_ATTN", "KV-L7", None, None)
    assert not flash.matches(None, "KV-L6", None, None)
    # "*" names upstream tests too
    assert padded.matches(None, "KV-S4", "padded", "BLNHC", "test_kv_s4")
    assert padded.matches("SAGE", "KV-S4", "padded", "BLNHC", "test_kv_s4")
    assert not flash.matches("FLASH_ATTN", "KV-L6", None, None,
                             "test_kv_l6_seam")
    assert not padded.matches(None, "KV-S4", "padded", "LBNHC")
    assert not padded.matches(None, "KV-S4", "split", "BLNHC")
    assert not padded.matches(None, "KV-S4", None, "BLNHC")


def test_applies_to_versions(entries: list[XfailEntry]) -> None:
    flash, _ = entries
    assert flash.applies_to(V030, "cpu")
    assert flash.applies_to({"vllm": "0.30.0", "vllm_omni": "0.30.2.dev3+gabc"}, "cpu")
    assert not flash.applies_to({"vllm": "0.30.0", "vllm_omni": "0.31.0"}, "cpu")
    assert not flash.applies_to({"vllm": "0.30.0", "vllm_omni": None}, "cpu")  # not installed
    assert not flash.applies_to({"vllm": "0.30.0"}, "cpu")
    assert not flash.applies_to({"vllm": "0.30.0", "vllm_omni": "unknown"}, "cpu")
    assert flash.applies_to({"vllm-omni": "0.30.1"}, "cpu")  # distribution spelling accepted


def test_a_torch_condition_names_a_build_by_its_local_label(tmp_path: Path) -> None:
    """``torch = "==2.13.0+cpu"`` holds on torch's CPU build only: not on the registry's
    CUDA build of the same version, nor where torch's version is unknown."""
    path = tmp_path / "k.toml"
    path.write_text('[[xfail]]\nbackend = "vllm.FLASHINFER"\nclause = "KV-V1"\n'
                    'test = "test_kv_v1"\nskip = "hardware"\nmatch = "."\nreason = "r"\n'
                    'torch = "==2.13.0+cpu"\n')
    (entry,) = load_xfails(path)
    assert entry.applies_to({"torch": "2.13.0+cpu"}, "cpu")
    assert not entry.applies_to({"torch": "2.13.0+cu130"}, "cpu")
    assert not entry.applies_to({"torch": "2.13.0"}, "cpu")
    assert not entry.applies_to({}, "cpu")


def test_applies_to_device(entries: list[XfailEntry]) -> None:
    _, padded = entries
    assert padded.applies_to(V030, "cuda")
    assert padded.applies_to(V030, "cuda:1")
    assert not padded.applies_to(V030, "cpu")
    assert not padded.applies_to({"vllm": "0.29.9", "vllm_omni": None}, "cuda")
    assert padded.applies_to({"vllm": "0.31.0", "vllm_omni": None}, "cuda")  # omni unconditioned


def test_first_match(entries: list[XfailEntry]) -> None:
    found = first_match(entries, backend="FLASH_ATTN", clause="KV-L6", case=None, layout=None,
                        versions=V030, device_kind="cpu", test="test_kv_l6")
    assert found is entries[0]
    assert first_match(entries, backend=None, clause="KV-S4", case="padded", layout="BLNHC",
                       versions=V030, device_kind="cpu") is None


def test_stale_entries(entries: list[XfailEntry]) -> None:
    flash, padded = entries
    assert stale_entries(entries, {flash.describe()}) == [padded]
    assert stale_entries(entries, {flash.describe(), padded.describe()}) == []
    assert stale_entries(entries, set()) == [flash, padded]
    # On a CPU host the cuda-only entry is written for another host: not stale here.
    assert stale_entries(entries, set(), versions=V030, device_kind="cpu") == [flash]


L6 = 'backend = "A"\nclause = "KV-L6"\ntest = "test_kv_l6"\nmatch = "m"\nreason = "r"\n'


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (L6 + 'backends = "B"',
         r"entry 2: key 'backends': unknown key"),
        ('backend = "A"\nclause = "KV-L6"\ntest = "test_kv_l6"',
         r"entry 2: key 'reason': missing"),
        ('backend = "A"\nclause = "KV-L6"\nreason = "r"',
         r"entry 2: key 'test': missing \(required\): the failing control, one suite test "
         r"function \(e.g. 'test_kv_l6'\)"),
        ('backend = "A"\nclause = "KV-L6"\ntest = "*"\nmatch = "m"\nreason = "r"',
         r"entry 2: key 'test': '\*' names no control; name the failing suite test of KV-L6"),
        ('backend = "A"\nclause = "KV-L6"\ntest = "test_kv_l6_nope"\nmatch = "m"\n'
         'reason = "r"',
         r"entry 2: key 'test': unknown suite test 'test_kv_l6_nope'; the tests of KV-L6 are "
         r"test_kv_l6, test_kv_l6_seam"),
        ('backend = "A"\nclause = "KV-L6"\ntest = "test_kv_l2"\nmatch = "m"\nreason = "r"',
         r"entry 2: key 'test': 'test_kv_l2' is a test of KV-L2, not of KV-L6"),
        ('backend = "A"\nclause = "KV-L6"\ntest = "test_kv_l6"\nmatch = "(unclosed"\n'
         'reason = "r"', r"entry 2: key 'match': not a regular expression"),
        ('backend = "A"\nclause = "KV-L6"\ntest = "test_kv_l6"\nskip = "not-applicable"\n'
         'reason = "r"', r"entry 2: key 'skip': must be one of hardware, environment, backend"),
        ('backend = "A"\nclause = "KV-L6"\ntest = "test_kv_l6"\nreason = "   "',
         r"entry 2: key 'reason': must be a"),
        (L6 + 'vllm = "~=banana"',
         r"entry 2: key 'vllm': bad PEP 440 specifier '~=banana'"),
        (L6 + 'vllm_omni = "0.30"',
         r"entry 2: key 'vllm_omni': bad PEP 440 specifier"),
        ('backend = "A"\nclause = "L6"\ntest = "test_kv_l6"\nreason = "r"',
         r"entry 2: key 'clause': bad clause id 'L6'"),
        ('backend = "A"\nclause = "KV-X1"\ntest = "test_kv_l6"\nreason = "r"',
         r"key 'clause': bad clause id"),
        (L6 + 'device = "tpu"',
         r"entry 2: key 'device': must be one of cpu, cuda"),
        ('backend = 3\nclause = "KV-L6"\ntest = "test_kv_l6"\nreason = "r"',
         r"entry 2: key 'backend': must be a"),
    ],
)
def test_bad_entry_names_file_index_and_key(tmp_path: Path, body: str, expected: str) -> None:
    ok = ('[[xfail]]\nbackend = "A"\nclause = "KV-L1"\ntest = "test_kv_l1"\nmatch = "m"\n'
          'reason = "fine"\n\n')
    path = write(tmp_path, ok + "[[xfail]]\n" + body + "\n", name="known.toml")
    with pytest.raises(XfailFileError, match=expected) as info:
        load_xfails(path)
    assert str(info.value).startswith(str(path) + ": [[xfail]] entry 2: key ")
    assert info.value.index == 2


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[[xfail]\nbackend = 1", "not valid TOML"),
        ('[[xfails]]\nbackend = "A"', "unknown top-level key 'xfails'"),
        ('xfail = "A"', "must be an array of tables"),
        ("xfail = [1]", "entry 1: must be a table"),
    ],
)
def test_bad_file_names_the_file(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text, name="bad.toml")
    with pytest.raises(XfailFileError, match=expected) as info:
        load_xfails(path)
    assert str(info.value).startswith(str(path))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(XfailFileError, match=r"nope\.toml: cannot read"):
        load_xfails(tmp_path / "nope.toml")


def test_test_key_narrows_to_one_suite_function(tmp_path: Path) -> None:
    path = tmp_path / "x.toml"
    path.write_text('[[xfail]]\nbackend = "*"\nclause = "KV-L8"\ntest = "test_kv_l8_alias"\n'
                    'match = "KeyError"\nreason = "aliases"\n')
    (entry,) = xfails.load_xfails(path)
    assert entry.matches("FLASH_ATTN", "KV-L8", None, None, "test_kv_l8_alias")
    assert not entry.matches("FLASH_ATTN", "KV-L8", None, None, "test_kv_l8_canonical_refused")
    assert "test_kv_l8_alias" in entry.describe()


def test_shipped_known_file_loads() -> None:
    from importlib import resources

    known = resources.files("pytest_kvconform.known") / "vllm_omni_0_30.toml"
    entries = xfails.load_xfails(str(known))
    assert entries and all(e.reason and e.vllm_omni is not None for e in entries)


def test_an_entry_must_describe_its_failure(tmp_path: Path) -> None:
    """No pattern, no skip kind, no error kinds: the entry would absorb any failure."""
    path = write(tmp_path, '[[xfail]]\nbackend = "A"\nclause = "KV-L1"\ntest = "test_kv_l1"\n'
                 'reason = "r"\n')
    with pytest.raises(XfailFileError, match=r"entry 1: describes no failure: give 'match'"):
        load_xfails(path)


def test_an_entry_absorbs_only_the_failure_it_describes(tmp_path: Path) -> None:
    """Every problem of the failure must contain the pattern: one more problem is another
    failure; a skip entry declares skips of its kind (and reason) only."""
    path = write(tmp_path, '[[xfail]]\nbackend = "*"\nclause = "KV-L8"\n'
                 'test = "test_kv_l8_alias"\nmatch = "raised a bare KeyError"\nreason = "r"\n'
                 '[[xfail]]\nbackend = "X"\nclause = "*"\ntest = "*"\nskip = "backend"\n'
                 'match = "No module named \'x3\'"\nreason = "r"\n')
    alias, skip = load_xfails(path)
    assert alias.describes_failure(["NHD: raised a bare KeyError('NHD')"])
    assert not alias.describes_failure(["NHD: raised a bare KeyError('NHD')",
                                        "HND: accepted it: returned BLNHC"])
    assert not alias.describes_failure(["accepted it"])
    assert not alias.describes_failure([])
    assert not alias.describes_skip("backend", "raised a bare KeyError")
    assert skip.describes_skip("backend", "ImportError: No module named 'x3'")
    assert not skip.describes_skip("backend", "ImportError: No module named 'x4'")
    assert not skip.describes_skip("environment", "No module named 'x3'")
    assert not skip.describes_failure(["No module named 'x3'"])
    assert alias.expectation() == "a failure matching /raised a bare KeyError/"
    assert skip.expectation() == "a backend skip matching /No module named 'x3'/"


# --- the stacks a file's findings are known on ------------------------------------------

ALIAS_ENTRY = ('[[xfail]]\nbackend = "*"\nclause = "KV-L8"\ntest = "test_kv_l8_alias"\n'
               'match = "KeyError"\nreason = "r"\n')
KNOWN_ON = '[known_on]\nvllm = ">=0.30,<0.33"\nvllm_omni = ">=0.30,<0.33"\n\n'


@pytest.mark.parametrize(("vllm", "omni", "applies"), [
    ("0.30.0", "0.30.0", True),
    ("0.31.0", "0.31.0rc1", True),  # a pre-release inside the range is in it
    ("0.32.0", "0.32.0rc1", True),
    ("0.33.0", "0.32.0rc1", False),  # one condition fails
    ("0.32.0", "0.33.0rc1", False),  # "<0.33" excludes 0.33's pre-releases (PEP 440)
    ("0.30.0", None, False),  # a condition on an absent package does not hold
])
def test_one_file_is_known_on_every_stack_its_range_holds_for(
        tmp_path: Path, vllm: str, omni: str | None, applies: bool) -> None:
    write(tmp_path, KNOWN_ON + ALIAS_ENTRY, name="omni.toml")
    versions = {"vllm": vllm, "vllm_omni": omni}
    found = xfails.shipped_for(versions, shipped=tmp_path)
    assert bool(found.paths) is applies
    # However the file is applied, its entries apply only where it is known.
    (entry,) = load_xfails(tmp_path / "omni.toml")
    assert entry.applies_to(versions, "cpu") is applies
    if applies:
        assert found.header_line() == (
            f"kvconform: known findings: {tmp_path / 'omni.toml'} (shipped; known on vllm "
            f">=0.30,<0.33 and vllm-omni >=0.30,<0.33: the installed vllm {vllm}, vllm-omni "
            f"{omni})")


def test_an_entry_narrows_its_files_range(tmp_path: Path) -> None:
    """A finding fixed in 0.32 says so in its own entry; the file stays known on 0.32."""
    write(tmp_path, KNOWN_ON + ALIAS_ENTRY + 'vllm_omni = "<0.32"\n', name="omni.toml")
    (entry,) = load_xfails(tmp_path / "omni.toml")
    assert entry.applies_to({"vllm": "0.31.0", "vllm_omni": "0.31.0rc1"}, "cpu")
    assert not entry.applies_to({"vllm": "0.32.0", "vllm_omni": "0.32.0rc1"}, "cpu")
    assert xfails.shipped_for({"vllm": "0.32.0", "vllm_omni": "0.32.0rc1"},
                              shipped=tmp_path).paths == (tmp_path / "omni.toml",)


def test_every_file_known_on_the_stack_applies(tmp_path: Path) -> None:
    """vllm-omni's findings and vLLM's own (a file for vLLM alone, with or without
    vllm-omni) apply together; a file for another stack does not."""
    write(tmp_path, KNOWN_ON + ALIAS_ENTRY, name="a_omni.toml")
    write(tmp_path, '[known_on]\nvllm = ">=0.29"\n\n' + ALIAS_ENTRY, name="b_vllm.toml")
    write(tmp_path, '[known_on]\nvllm = "<0.29"\n\n' + ALIAS_ENTRY, name="c_old.toml")
    found = xfails.shipped_for({"vllm": "0.30.0", "vllm_omni": "0.30.0"}, shipped=tmp_path)
    assert found.paths == (tmp_path / "a_omni.toml", tmp_path / "b_vllm.toml")
    assert [e.describe() for e in found.entries] == [
        "a_omni.toml:1 */KV-L8/test_kv_l8_alias", "b_vllm.toml:1 */KV-L8/test_kv_l8_alias"]
    assert "a_omni.toml known on vllm >=0.30,<0.33 and vllm-omni >=0.30,<0.33; b_vllm.toml " \
           "known on vllm >=0.29: the installed" in found.header_line()
    alone = xfails.shipped_for({"vllm": "0.29.0", "vllm_omni": None}, shipped=tmp_path)
    assert alone.paths == (tmp_path / "b_vllm.toml",)


@pytest.mark.parametrize(("table", "expected"), [
    ('[known_on]\ntorch = ">=2"\n', r"\[known_on\]: unknown key 'torch'"),
    ('[known_on]\nvllm = "0.30"\n', r"\[known_on\]: key 'vllm': bad PEP 440 specifier"),
    ("known_on = 3\n", r"\[known_on\] must be a table"),
])
def test_a_bad_known_on_table_names_the_file(tmp_path: Path, table: str, expected: str) -> None:
    path = write(tmp_path, table + ALIAS_ENTRY)
    with pytest.raises(XfailFileError, match=expected):
        load_xfails(path)


# --- a file, and its patterns, are bounded ----------------------------------------------

@pytest.mark.parametrize("pattern", [
    "(.+)+#", "(a+)+$", "(a|aa)+$", r"(\\w+\\s?)*$", "(.*a){20}", "(?:x+x+)+y", "(ab|cd)+",
    r"(x)(?:\\1)+", "(.{2,3})+",
])
def test_a_match_that_can_backtrack_without_end_is_refused(tmp_path: Path,
                                                            pattern: str) -> None:
    path = write(tmp_path, ALIAS_ENTRY.replace('"KeyError"', f'"{pattern}"'))
    with pytest.raises(XfailFileError, match=r"entry 1: key 'match': .* can backtrack "
                                             r"without end: a repetition"):
        load_xfails(path)


@pytest.mark.parametrize("pattern", [
    r"must be honoured as LB[NH]{2}C, but it refused it", r"^VLLM_KV_CACHE_LAYOUT=\\w+ .*x",
    "(NHD|HND)", r"(\\d{3})+", "a++b", "(?>a+)b", "(a|b)*c",
])
def test_a_match_that_cannot_is_kept(tmp_path: Path, pattern: str) -> None:
    (entry,) = load_xfails(write(tmp_path, ALIAS_ENTRY.replace('"KeyError"', f'"{pattern}"')))
    assert entry.match is not None


def test_a_search_past_its_budget_is_given_up() -> None:
    """Polynomial backtracking (no nested repetition) on a long hostile message: the search
    is given up at its budget, and the entry does not describe that failure."""
    import re

    slow = re.compile(".*.*.*.*#")
    assert xfails.bounded_search(slow, "x" * 2000, budget=0.2) is None
    assert xfails.bounded_search(slow, "x" * 20 + "#", budget=0.2) is True
    assert xfails.bounded_search(re.compile("#"), "x" * 2000, budget=0.2) is False


def test_a_file_past_its_size_or_entry_limit_is_refused(tmp_path: Path) -> None:
    big = write(tmp_path, "# " + "x" * xfails.MAX_FILE_BYTES + "\n" + ALIAS_ENTRY)
    with pytest.raises(XfailFileError, match=r"larger than the limit 1048576 bytes"):
        load_xfails(big)
    many = write(tmp_path, ALIAS_ENTRY * (xfails.MAX_ENTRIES + 1), name="many.toml")
    with pytest.raises(XfailFileError, match=r"1001 entries, more than the limit 1000"):
        load_xfails(many)


def test_stale_entries_are_summarised(tmp_path: Path) -> None:
    entries = load_xfails(write(tmp_path, ALIAS_ENTRY * 12, name="k.toml"))
    assert xfails.stale_summary([]) is None
    assert xfails.stale_summary(entries[:1]) == (
        "1 stale known-finding entry matched no test: k.toml:1 */KV-L8/test_kv_l8_alias")
    assert xfails.stale_summary(entries) == (
        "12 stale known-finding entries matched no test: " +
        ", ".join(f"k.toml:{i} */KV-L8/test_kv_l8_alias" for i in range(1, 6)) +
        ", and 7 more")
