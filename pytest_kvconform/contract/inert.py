"""Text from a report or a backend, made inert before a terminal or a Markdown page shows it.

A report may come from another host, and a message may quote what a backend's code
returned, raised or printed: either can carry an escape sequence that clears a terminal,
sets its title or rewrites lines already printed, or Markdown that renders as HTML, a
link or a broken table.  :func:`terminal` writes every control character (C0 but newline
and tab, DEL, C1) and every bidirectional override as its escape (``\\x1b``, ``\\u202e``),
so what it returns shows as it reads; :func:`markdown` does that and escapes what Markdown
would render, on one line; :func:`code_span` quotes text as code whatever backticks it
holds.  Every place where such text reaches a terminal or Markdown goes through these.

Stdlib only, at the bottom of the package: every layer may use it.
"""

from __future__ import annotations

import re
from typing import Any

# Control characters but newline and tab; DEL; C1; bidirectional marks, embeddings,
# overrides and isolates (text that reorders what follows it on screen).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e"
                      "\u2066-\u2069]")
# What Markdown renders: a backslash (which would escape what follows), code spans,
# emphasis and strikethrough, table pipes, and a link's or an image's target.
_MARKUP = re.compile(r"[\\`*|~]|\]\(")
# A tag, a comment, a declaration or an autolink starts with "<" and one of these.
_TAG = re.compile(r"<(?=[A-Za-z/!?])")
_ENTITY = re.compile(r"&(?=#?\w+;)")
# Underscores that could open or close emphasis (not those inside a word: MY_ATTN).
_UNDERSCORE = re.compile(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def terminal(text: Any) -> str:
    """``text`` with every control character written as its escape (newlines and tabs kept)."""
    return _CONTROL.sub(lambda m: _escape(m[0]), "" if text is None else str(text))


def markdown(text: Any) -> str:
    """``text`` for a Markdown table cell or list item: inert (:func:`terminal`), on one
    line, with what would render as markup escaped."""
    if text is None:
        return ""
    line = terminal(text).replace("\n", " ").replace("\t", " ")
    line = _MARKUP.sub(lambda m: "\\" + m[0], line)
    line = _ENTITY.sub("&amp;", line)
    line = _TAG.sub("&lt;", line)
    return _UNDERSCORE.sub(r"\\_", line)


def code_span(text: Any) -> str:
    """``text`` as an inline code span, on one line, fenced by more backticks than it holds
    in a row (so none of it can close the span early)."""
    line = terminal(text).replace("\n", " ").replace("\t", " ")
    longest = max((len(run) for run in re.findall(r"`+", line)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if line.startswith("`") or line.endswith("`") else ""
    return f"{fence}{pad}{line}{pad}{fence}"


def fence_for(texts: Any) -> str:
    """A code fence (four backticks or more) longer than any backtick run in ``texts``."""
    longest = max((len(run) for text in texts for run in re.findall(r"`+", str(text))),
                  default=0)
    return "`" * max(4, longest + 1)
