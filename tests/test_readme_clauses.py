"""The README's clause list is the clause table's (generated, compared here)."""

from __future__ import annotations

from pathlib import Path

from pytest_kvconform.contract import clauses

README = Path(__file__).resolve().parents[1] / "README.md"


def clause_block(text: str) -> str | None:
    start = text.find(clauses.CLAUSE_LIST_BEGIN)
    end = text.find(clauses.CLAUSE_LIST_END)
    if start < 0 or end < start:
        return None
    return text[start:end + len(clauses.CLAUSE_LIST_END)]


def test_readme_clause_list_is_generated_from_the_table() -> None:
    block = clause_block(README.read_text(encoding="utf-8"))
    assert block is not None, f"no clause list between {clauses.CLAUSE_LIST_BEGIN!r} markers"
    assert block == clauses.markdown_table(), (
        "README.md's clause list is stale; regenerate it with "
        "python -c 'from pytest_kvconform import clauses; print(clauses.markdown_table())'")


def test_a_stale_list_is_detected() -> None:
    stale = clauses.markdown_table().replace("| KV-L2 | Resolution |", "| KV-L2 | Resolving |")
    assert clause_block(stale) != clauses.markdown_table()
    assert clause_block("no markers") is None
