"""Text from a report or a backend, inert before a terminal or Markdown shows it."""

from __future__ import annotations

from pytest_kvconform.contract import inert

HOSTILE = "ok\x1b]0;pwned\x07\x1b[2J\rback\x9b31m\u202eevil\x00"


def test_terminal_writes_each_control_character_as_its_escape() -> None:
    shown = inert.terminal(HOSTILE + "\n\tnext")
    assert shown == ("ok\\x1b]0;pwned\\x07\\x1b[2J\\x0dback\\x9b31m\\u202eevil\\x00\n\tnext")
    assert not any(ord(c) < 32 and c not in "\n\t" for c in shown)
    assert inert.terminal(None) == ""


def test_markdown_escapes_what_would_render() -> None:
    text = "a|b <img src=x onerror=y> [x](http://e) ![i](t) `c` *e* _u_ MY_ATTN &amp; \\| ~~s~~"
    assert inert.markdown(text + "\nnext") == (
        "a\\|b &lt;img src=x onerror=y> [x\\](http://e) ![i\\](t) \\`c\\` \\*e\\* \\_u\\_ "
        "MY_ATTN &amp;amp; \\\\\\| \\~\\~s\\~\\~ next")
    assert "\x1b" not in inert.markdown(HOSTILE)


def test_a_code_span_cannot_be_closed_by_what_it_quotes() -> None:
    assert inert.code_span("test_kv_l1[A]") == "`test_kv_l1[A]`"
    assert inert.code_span("a``b") == "```a``b```"
    assert inert.code_span("`x") == "`` `x ``"
    assert inert.fence_for(["plain", "has ````` five"]) == "``````"
