"""Case files: the shipped ones load, bad ones get one message naming file, case and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_kvconform import cases


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
    from pytest_kvconform import model, oracle

    assert oracle.DTYPE_SIZES is model.DTYPE_SIZES
    assert all(cases.DTYPE_SIZES[d] == oracle.dtype_size(d) for d in cases.CASE_DTYPES)
