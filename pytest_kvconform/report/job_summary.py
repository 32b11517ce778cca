"""The run's verdict and grid in a CI job's summary (``$GITHUB_STEP_SUMMARY``), as Markdown.

GitHub Actions shows the Markdown a step appends to the file that variable names on the
run's page, where a backend author looks first; the page (``r.html``) and the JSON stay the
job's artifacts.  The grid is the page's (:mod:`~pytest_kvconform.report.html_model`), each
cell its glyph, word and count.  Stdlib only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pytest_kvconform.report import html_model as model
from pytest_kvconform.report.render import markdown_table, md_escape

VARIABLE = "GITHUB_STEP_SUMMARY"


def wanted() -> bool:
    """Whether this run appends to a job summary (the variable names a file)."""
    return bool(os.environ.get(VARIABLE))


def _text(text: Any) -> str:
    """Text from a backend or the stack in the summary: one line, ``|`` escaped, and no
    markup (GitHub renders the HTML a summary holds)."""
    return md_escape(text).replace("<", "&lt;").replace(">", "&gt;")


def summary_markdown(report: Mapping[str, Any], page: Path | None = None) -> str:
    """The verdict with its notes, and the backend x clause grid, one table per band."""
    v = model.verdict_view(report)
    env = report["environment"]
    whom = f" for {', '.join(v.scope)}" if v.scope else ""
    counts = ", ".join(f"{n} {s}" for s, n in report["summary"]["by_status"].items() if n)
    lines = [f"### kvconform: {v.glyph} verdict{_text(whom)}: {v.verdict} ({v.mode})", "",
             f"{_text(model.stack_label(env))} · host `{_text(env['host'])}` · "
             f"{len(report['results'])} results: {counts or 'none'}", ""]
    for note in v.notes:
        lines.append(f"- {_text(note.head)}" + (":" if note.items else ""))
        lines += [f"  - {_text(item)}" for item in note.items]
    for grid in model.report_grids(report):
        lines += ["", f"**{grid.title}** ({grid.meaning})", ""]
        rows = [[_text(row.name), *((cell.text + (f" ({cell.rest_text})" if cell.rest else ""))
                                    if cell else "" for cell in row.cells)]
                for row in grid.rows]
        lines += markdown_table([grid.row_header, *(c.removeprefix("KV-") for c in grid.columns)],
                                rows)
    legend = " · ".join(f"{s.glyph} {s.word}: {s.meaning}" for s in model.STATES)
    lines += ["", f"<sub>{_text(legend)}</sub>"]
    if page is not None:
        lines += ["", f"Every result, with its message: `{_text(page.name)}` (the job's "
                  "artifact)."]
    return "\n".join(lines) + "\n"


def append(report: Mapping[str, Any], page: Path | None = None) -> str | None:
    """Append the summary to the file ``$GITHUB_STEP_SUMMARY`` names; the error in words
    when it cannot be written (None when it was, or no summary is wanted)."""
    target = os.environ.get(VARIABLE)
    if not target:
        return None
    try:
        with open(target, "a", encoding="utf-8") as fh:
            fh.write(summary_markdown(report, page) + "\n")
    except OSError as exc:
        return f"${VARIABLE} ({target}): {exc.strerror or exc}"
    return None
