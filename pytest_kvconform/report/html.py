"""The report pages: one self-contained HTML file per report, matrix, merge or diff.

Rendered with Jinja2 from the templates shipped beside this module (``templates/``), with
autoescaping on: every message from a backend or the stack is text in the page, whatever
it holds (a ``<script>`` in an exception message stays text).  What a page shows is read
from the JSON by :mod:`~pytest_kvconform.report.html_model`; this module only renders it.

A page fetches nothing: its style and its one script are inline, and its
Content-Security-Policy allows those two (by hash) and nothing else, so it works from
``file://``, offline and under a strict policy.  It reads without JavaScript; the script
only adds filters.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

from pytest_kvconform.report import html_model as model

TEMPLATES = Path(__file__).resolve().parent / "templates"
# The pages' budget: a whole deployment's page stays under it (tests/report/test_html.py).
PAGE_BUDGET_BYTES = 1_000_000


@cache
def _static(name: str) -> str:
    text = (TEMPLATES / name).read_text(encoding="utf-8")
    closing = "</style" if name.endswith(".css") else "</script"
    if closing in text.lower():  # it would end its element early
        raise ValueError(f"{name} must not contain {closing!r}")
    return text


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def csp() -> str:
    """The pages' policy: nothing fetched, the inline style and script allowed by hash."""
    return (f"default-src 'none'; style-src {_sha256(_static('page.css'))}; script-src "
            f"{_sha256(_static('filters.js'))}; img-src data:; base-uri 'none'; "
            "form-action 'none'")


def facts(result: model.ResultView) -> str:
    """``case bf16_h8 · layout LBNHC · device cpu · 0.12 s`` (its group names the backend)."""
    parts = [f"{key} {value}" for key, value in (
        ("case", result.case), ("layout", result.layout), ("device", result.device)) if value]
    return " · ".join([*parts, f"{result.duration_s:.2f} s"])


@cache
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True,
        undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.globals.update(STATES=model.STATES, STATE=model.STATE, facts=facts,
                       clause_title=model.clause_title, FINDING_STATES=model.FINDING_STATES,
                       FINDING_WORDS=model.FINDING_WORDS)
    return env


def _render(template: str, run_id: str | None, **context: Any) -> str:
    page = _environment().get_template(template)
    return page.render(css=Markup(_static("page.css")), script=Markup(_static("filters.js")),
                       csp=csp(), run_id=run_id, **context)


def _filter_states() -> str:
    return json.dumps([[s.key, s.glyph, s.word] for s in model.STATES], ensure_ascii=False)


def render_report_html(report: Mapping[str, Any], json_name: str | None = None) -> str:
    """One report's page (a validated report); over :data:`PAGE_BUDGET_BYTES`, its passing
    and n/a results are listed by id alone (the JSON keeps their details)."""
    page = model.report_page(report, json_name)
    text = ""
    for compact in (False, True):
        text = _render("report.html.j2", page.run_id, p=page, total=len(report["results"]),
                       filter_states=_filter_states(), compact=compact,
                       known_file=report["environment"]["options"].get("xfails"),
                       has_family=any(b.get("family") for b in report["backends"]))
        if len(text.encode()) <= PAGE_BUDGET_BYTES:
            break
    return text


def render_matrix_html(matrix: Mapping[str, Any],
                       reports: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """A release matrix's page: the legs, stack x clause, each backend x stack x clause;
    each leg linking to its own page (its report's ``.html``, next to the matrix).  With
    the legs' reports (by name) a skip reads "not checked" or "n/a" as it was."""
    page = model.matrix_page(matrix, reports)
    return _render("matrix.html.j2", matrix["run"]["id"], p=page)


def render_merged_html(named: Sequence[tuple[str, Mapping[str, Any]]],
                       pages: Mapping[str, str] | None = None) -> str:
    """Several hosts' reports as one backend x host x clause page; ``pages`` names each
    report's own page (by the report's name), linked from its rows."""
    page = model.merged_page(named, pages or {})
    return _render("merged.html.j2", None, p=page)


def render_diff_html(diff: Any, a_name: str, b_name: str, *, a: Mapping[str, Any] | None = None,
                     b: Mapping[str, Any] | None = None, b_page: str | None = None) -> str:
    """B against A: a :class:`~pytest_kvconform.report.diff.ReportDiff` (with both reports)
    or a :class:`~pytest_kvconform.report.diff.MatrixDiff`; ``b_page`` is B's own page,
    which each changed result links into."""
    page = model.diff_page(diff, a_name, b_name, a=a, b=b, b_page=b_page)
    return _render("diff.html.j2", None, p=page)


def html_path(path: str | Path) -> Path:
    """``r.json`` -> ``r.html``: the page lives next to the JSON."""
    return Path(path).with_suffix(".html")


def write_html(path: str | Path, text: str) -> Path:
    """Write a page via a temp file and ``os.replace`` (a reader never sees half of one)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
