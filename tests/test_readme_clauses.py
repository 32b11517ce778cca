"""The README's clause list is the clause table's (generated, compared here)."""

from __future__ import annotations

from pathlib import Path

from pytest_kvconform import clauses

ROOT = Path(__file__).resolve().parents[1]
# Until the lead merges the sections into README.md, they wait in this file.
PENDING = ROOT / "docs_README_sections.md"


def clause_block(text: str) -> str | None:
    start = text.find(clauses.CLAUSE_LIST_BEGIN)
    end = text.find(clauses.CLAUSE_LIST_END)
    if start < 0 or end < start:
        return None
    return text[start:end + len(clauses.CLAUSE_LIST_END)]


def test_readme_clause_list_is_generated_from_the_table() -> None:
    sources = [p for p in (ROOT / "README.md", PENDING) if p.exists()]
    blocks = [(p, clause_block(p.read_text(encoding="utf-8"))) for p in sources]
    found = [(p, b) for p, b in blocks if b is not None]
    assert found, f"no clause list between {clauses.CLAUSE_LIST_BEGIN!r} markers in README.md"
    path, block = found[0]
    assert block == clauses.markdown_table(), (
        f"{path.name}'s clause list is stale; regenerate it with "
        "python -c 'from pytest_kvconform import clauses; print(clauses.markdown_table())'")


def test_a_stale_list_is_detected() -> None:
    stale = clauses.markdown_table().replace("| KV-L2 | Resolution |", "| KV-L2 | Resolving |")
    assert clause_block(stale) != clauses.markdown_table()
    assert clause_block("no markers") is None
