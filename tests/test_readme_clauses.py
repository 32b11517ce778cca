"""The clause table in docs/clauses.md is the clause table's own (generated, compared here)."""

from __future__ import annotations

from pathlib import Path

from pytest_kvconform.contract import clauses
from tests.paths import ROOT as REPO

PAGE = REPO / "docs" / "clauses.md"
REGENERATE = ('python -c "from pytest_kvconform.contract import clauses; '
              'clauses.write_markdown_table()"')


def clause_block(text: str) -> str | None:
    start = text.find(clauses.CLAUSE_LIST_BEGIN)
    end = text.find(clauses.CLAUSE_LIST_END)
    if start < 0 or end < start:
        return None
    return text[start:end + len(clauses.CLAUSE_LIST_END)]


def test_the_clause_table_page_is_generated_from_the_table() -> None:
    text = PAGE.read_text(encoding="utf-8")
    block = clause_block(text)
    assert block is not None, f"no clause table between {clauses.CLAUSE_LIST_BEGIN!r} markers"
    assert block == clauses.markdown_table(), (
        f"docs/clauses.md's clause table is stale; regenerate it with {REGENERATE}")
    assert text.count(clauses.CLAUSE_LIST_BEGIN) == text.count(clauses.CLAUSE_LIST_END) == 1
    assert REGENERATE in text, "docs/clauses.md says how to regenerate the table"


def test_the_clause_table_is_written_once() -> None:
    """Every other page links to docs/clauses.md instead of holding a copy."""
    pages = [REPO / "README.md", REPO / "CONTRIBUTING.md", *(REPO / "docs").glob("*.md")]
    copies = [p.relative_to(REPO).as_posix() for p in pages if p != PAGE
              and (clauses.CLAUSE_LIST_BEGIN in p.read_text(encoding="utf-8")
                   or "| clause | title |" in p.read_text(encoding="utf-8"))]
    assert not copies, f"a copy of the clause table in {copies}"


def test_a_stale_table_is_detected_and_regenerated(tmp_path: Path) -> None:
    stale = clauses.markdown_table().replace("| KV-L2 | Resolution |", "| KV-L2 | Resolving |")
    assert clause_block(stale) != clauses.markdown_table()
    assert clause_block("no markers") is None
    page = tmp_path / "clauses.md"
    page.write_text(f"# head\n\n{stale}\n\ntail\n")
    clauses.write_markdown_table(page)
    assert page.read_text() == f"# head\n\n{clauses.markdown_table()}\n\ntail\n"
