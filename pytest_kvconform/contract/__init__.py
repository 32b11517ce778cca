"""The contract's own terms, imported by every layer above: the clause table and its
grammar, the outcomes a check raises, the records, the cases, the independent oracle,
and the bounds any input is held to.  Stdlib and numpy only."""

import re
from pathlib import Path

# contract.md, shipped in this package: the specification the clause ids refer to.
CONTRACT_TEXT = Path(__file__).resolve().parents[1] / "contract.md"
_VERSION_RE = re.compile(r"^Contract version: \*\*([^*\s]+)\*\*", re.MULTILINE)


def stated_version(text: str) -> str:
    """The version contract.md states on its ``Contract version: **N**`` line."""
    m = _VERSION_RE.search(text)
    if m is None:
        raise ValueError("contract.md states no 'Contract version: **N**' line")
    return m[1]


# The version of contract.md, as it states it (the one place it is written).  Reports carry
# it, and reports of different contract versions are not merged.  Bumping it is a release
# decision (a clause's meaning changed), recorded in contract.md and CHANGELOG.md; a new
# clause alone does not bump it.
CONTRACT_VERSION = stated_version(CONTRACT_TEXT.read_text(encoding="utf-8"))
