"""Case files: the shipped ones load, bad ones get one message naming file, case and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_kvconform.contract import cases


def test_builtin_cases_load_with_unique_ids() -> None:
    loaded = cases.load_cases()
    ids = [c.id for c in loaded]
    assert len(ids) == len(set(ids))
    assert {"bf16_h8", "bf16_h64", "fp16_h8", "fp16_h64", "distinct", "ws2"} <= set(ids)
    seed = next(c for c in loaded if c.id == "bf16_h8")
    assert (seed.block_size, seed.num_kv_heads, seed.num_pages, seed.usable_blocks) == \
        (16, 2, 16, 15)


def test_distinct_case_has_pairwise_distinct_extents() -> None:
    case = next(c for c in cases.load_cases() if c.id == "distinct")
    content = 2 * case.head_size * cases.DTYPE_SIZES[case.dtype]
    extents = [case.num_layers, case.num_pages, case.num_kv_heads, case.block_size, content]
    assert len(set(extents)) == 5


@pytest.mark.parametrize(("text", "message"), [
    ('[[case]]\nid = "a"\nblock_size = 0\n', "case 'a', key 'block_size': must be a positive"),
    ('[[case]]\nid = "a"\ndtype = "int4"\n', "case 'a', key 'dtype': unsupported dtype"),
    ('[[case]]\nid = "a"\nkernel_block_size = 5\n', "key 'kernel_block_size': 5 does not divide"),
    ('[[case]]\nid = "a"\npage_size_padded = 8\n', "key 'page_size_padded': 8 is smaller"),
    ('[[case]]\nid = "a"\nexpected_usable_blocks = 16\n', "must be below num_pages"),
    ('[[case]]\nblock_size = 16\n', "case '#0', key 'id'"),
    ('[cases]\n', "key 'cases': unknown top-level table"),
    ("[[case]\n", "invalid TOML"),
])
def test_bad_files(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(cases.CaseFileError, match=None) as info:
        cases.load_case_file(path)
    assert str(path) in str(info.value)
    assert message in str(info.value)


def test_duplicate_id_across_files(tmp_path: Path) -> None:
    path = tmp_path / "dup.toml"
    path.write_text('[[case]]\nid = "bf16_h8"\n')
    with pytest.raises(cases.CaseFileError, match="duplicate id, already defined in"):
        cases.load_cases([path])


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(cases.CaseFileError, match="cannot read"):
        cases.load_case_file(tmp_path / "nope.toml")


def test_page_bytes_counts_k_and_v_of_every_head_and_token() -> None:
    seed = next(c for c in cases.load_cases() if c.id == "bf16_h8")
    assert cases.page_bytes(seed) == 2 * 16 * (8 + 8) * 2  # H * N * (K + V) * bf16 = 1024


def test_helpers_without_callers_are_gone() -> None:
    assert not hasattr(cases, "select") and not hasattr(cases, "as_dict")


def test_dtype_sizes_are_one_table() -> None:
    """The case files' dtypes are sized by the oracle's table, not by a copy."""
    from pytest_kvconform.contract import oracle, records

    assert oracle.DTYPE_SIZES is records.DTYPE_SIZES
    assert all(cases.DTYPE_SIZES[d] == oracle.dtype_size(d) for d in cases.CASE_DTYPES)


# --- limits: a case file cannot ask for a host-sized allocation ------------------

# The smallest case: an 8-byte page (1 head x 1 token x K+V x 1 fp32 element), 1 layer.
TINY = {"block_size": 1, "num_kv_heads": 1, "head_size": 1, "dtype": '"float32"',
        "num_layers": 1, "num_pages": 2}


def _case_text(**values: object) -> str:
    fields = {**TINY, **values}
    return '[[case]]\nid = "big"\n' + "".join(f"{k} = {v}\n" for k, v in fields.items())


@pytest.mark.parametrize("key", sorted(cases.LIMITS))
def test_each_bounded_key_is_refused_past_its_limit(tmp_path: Path, key: str) -> None:
    limit = cases.LIMITS[key]
    path = tmp_path / "big.toml"
    path.write_text(_case_text(**{key: limit.value}))
    [case] = cases.load_case_file(path)  # the limit itself is allowed
    assert getattr(case, key) == limit.value
    path.write_text(_case_text(**{key: limit.value + 1}))
    with pytest.raises(cases.CaseFileError) as info:
        cases.load_case_file(path)
    assert str(info.value) == (f"{path}, case 'big', key {key!r}: {limit.value + 1} exceeds "
                               f"the limit {limit.value} ({limit.why})")


@pytest.mark.parametrize(("values", "message"), [
    ({"num_groups": 3, "num_layers": 2},
     "key 'num_groups': 3 exceeds the limit 2 (num_layers: every cache group holds a layer)"),
    ({"description": '"' + "x" * 1001 + '"'},
     "key 'description': 1001 characters exceed the limit 1000"),
    ({"num_pages": 10**12}, "key 'num_pages': 1000000000000 exceeds the limit 65536 (KV-N1"),
])
def test_keys_bounded_by_others(tmp_path: Path, values: dict[str, object], message: str) -> None:
    path = tmp_path / "big.toml"
    path.write_text(_case_text(**values))
    with pytest.raises(cases.CaseFileError, match=None) as info:
        cases.load_case_file(path)
    assert f"{path}, case 'big', {message}" in str(info.value)


def test_a_long_id_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "big.toml"
    path.write_text(f'[[case]]\nid = "{"a" * 65}"\n')
    with pytest.raises(cases.CaseFileError, match="at most 64 characters"):
        cases.load_case_file(path)


def test_the_kv_cache_a_case_describes_is_bounded(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Every key within its limit, the product past what the oracle tabulates: refused,
    naming the factors; a padded page counts with its padding."""
    monkeypatch.setattr(cases.memory, "host_available_bytes", lambda: None)
    path = tmp_path / "big.toml"
    # 128 layers x 1024 pages x 1024-byte pages = 128 MiB
    path.write_text(_case_text(num_layers=128, num_pages=1024, num_kv_heads=2, block_size=16,
                               head_size=8, dtype='"bfloat16"'))
    with pytest.raises(cases.CaseFileError) as info:
        cases.load_case_file(path)
    assert str(info.value) == (
        f"{path}, case 'big', key 'num_pages': the KV cache of num_layers 128 x num_pages 1024 "
        "x 1024-byte pages (num_kv_heads * block_size * 2 * head_size * 2 bytes) = 134217728 "
        "bytes exceeds the limit 67108864 bytes (KV-S2 tabulates one oracle address per byte "
        "of it, up to 67108864 cells); use fewer pages, layers or smaller pages")
    path.write_text(_case_text(num_layers=64, num_pages=1024, page_size_padded=2048))
    with pytest.raises(cases.CaseFileError, match=r"x 2048-byte pages \(page_size_padded\) = "
                       "134217728 bytes exceeds the limit 67108864"):
        cases.load_case_file(path)


def test_the_kv_cache_is_bounded_by_this_hosts_memory(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    available = 160_000  # half of it over 80 bytes per KV byte: 1000 bytes of KV cache
    monkeypatch.setattr(cases.memory, "host_available_bytes", lambda: available)
    assert cases.kv_bytes_limit()[0] == 1000
    path = tmp_path / "big.toml"
    path.write_text(_case_text(num_pages=125))  # 125 pages x 8 bytes: at the limit
    cases.load_case_file(path)
    path.write_text(_case_text(num_pages=126))
    with pytest.raises(cases.CaseFileError) as info:
        cases.load_case_file(path)
    assert ("= 1008 bytes exceeds the limit 1000 bytes (KV-S2's byte map takes about 80 bytes "
            "of the test process per KV byte, and 0.5 of this host's 160000 available bytes "
            "may go to it)") in str(info.value)


def test_the_kv_bytes_limit_is_what_the_oracle_tabulates() -> None:
    from pytest_kvconform.contract import oracle

    assert cases.MAX_KV_BYTES == oracle.MAX_TABLE_CELLS


def test_builtin_cases_are_far_inside_the_limits() -> None:
    assert max(cases.kv_bytes(c) for c in cases.load_cases()) * 64 <= cases.MAX_KV_BYTES


def test_a_large_file_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "big.toml"
    path.write_text("# padding\n" * (cases.MAX_FILE_BYTES // 10 + 1))
    with pytest.raises(cases.CaseFileError, match=f"larger than the limit {cases.MAX_FILE_BYTES}"):
        cases.load_case_file(path)


def test_too_many_cases_in_one_run(tmp_path: Path) -> None:
    path = tmp_path / "many.toml"
    path.write_text("".join(f'[[case]]\nid = "c{i}"\n' for i in range(cases.MAX_CASES)))
    with pytest.raises(cases.CaseFileError, match=f"more than the limit {cases.MAX_CASES} cases"):
        cases.load_cases([path])  # the built-in cases count too
    assert len(cases.load_cases([path], builtin=False)) == cases.MAX_CASES


def test_a_case_record_made_in_code_is_held_to_the_same_limits() -> None:
    from pytest_kvconform.contract.records import Case

    with pytest.raises(cases.CaseFileError, match="key 'world_size': 9 exceeds the limit 8"):
        cases.validate_case(Case(id="mine", file="code", world_size=9))
    assert cases.validate_case(Case(id="mine", file="code")).id == "mine"
