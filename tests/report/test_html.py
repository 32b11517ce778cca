"""The report pages without a browser: what they hold, escaping, their policy and the CLI
that writes them (tests/report/test_html_browser.py opens them in Chromium)."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from pytest_kvconform.cli import main
from pytest_kvconform.report import build as rp
from pytest_kvconform.report import html, html_model, job_summary
from tests.report_rows import backend_record, build, row

SCRIPT = "<script>alert('owned')</script>"


def mixed_report(message: str = "pinned LBNHC") -> dict[str, Any]:
    """A report with every state: a failed declaration and its dependant, a known finding
    and a fixed one, a stack regression, a harness error, not checked and n/a."""
    return build([
        row("s::test_kv_l1[GOOD]"),
        row("s::test_kv_l1[BAD]", backend="BAD", status="failed",
            reason=f"KV-L1 violated [backend=BAD]: {message}\n  expected: True\n"
                   "  actual:   1"),
        row("s::test_kv_l2[BAD]", "KV-L2", "failed", backend="BAD",
            reason="KV-L2 violated [backend=BAD]: pinned LBNHC"),
        row("s::test_kv_l7[GOOD]", "KV-L7", "skipped", skip_kind="hardware",
            reason="KV-L7: needs CUDA"),
        row("s::test_kv_l6[GOOD]", "KV-L6", "skipped", skip_kind="not-applicable",
            reason="KV-L6: GOOD has no paged KV support"),
        row("s::test_kv_l8_alias[GOOD]", "KV-L8", "xfailed", xfail="k.toml:1 */KV-L8",
            reason="known: KeyError 'HND' [k.toml:1 */KV-L8]"),
        row("s::test_kv_l8_env_refused[GOOD]", "KV-L8", "xpassed", xfail="k.toml:2 */KV-L8"),
        row("s::test_kv_s1[LBNHC-bf16_h8]", "KV-S1", "failed", backend=None, layout="LBNHC",
            case="bf16_h8", reason="KV-S1 violated [case=bf16_h8, layout=LBNHC]: block_stride"
                                   "\n  expected: 4096\n  actual:   2048"),
        row("s::test_kv_a1[GOOD-bf16_h8]", "KV-A1", "error", case="bf16_h8",
            error_kind="worker-died", reason="KV-A1: harness error (worker-died): signal 9",
            via="UniProcDiffusionExecutor -> DiffusionWorker.set_kv_cache_configs (its "
                "constructor cannot complete here)"),
    ], backends=[backend_record(), backend_record("BAD", "m:B")],
        options={"xfails": "k.toml"}, strict=False)


class _Page(HTMLParser):
    """The page's elements, as far as these tests read them."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: list[str] = []
        self.cells: list[dict[str, str | None]] = []
        self.scripts = 0
        self.hrefs: list[str] = []
        self.styles: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.append(str(a["id"]))
        if "cell" in (a.get("class") or "").split():
            self.cells.append(a)
        if a.get("href"):
            self.hrefs.append(str(a["href"]))
        if a.get("style"):
            self.styles.append(str(a["style"]))
        self.scripts += tag == "script"


def parse(text: str) -> _Page:
    page = _Page()
    page.feed(text)
    return page


def test_a_message_holding_a_script_stays_text() -> None:
    text = html.render_report_html(mixed_report(SCRIPT))
    assert SCRIPT not in text
    assert "&lt;script&gt;alert(&#39;owned&#39;)&lt;/script&gt;" in text
    assert parse(text).scripts == 1  # the page's own filters, nothing else


def test_the_policy_allows_the_inline_style_and_script_and_nothing_else() -> None:
    text = html.render_report_html(mixed_report())
    policy = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', text)
    assert policy is not None
    csp = policy[1].replace("&#39;", "'")
    assert "default-src 'none'" in csp and "unsafe-inline" not in csp
    for tag, directive in (("style", "style-src"), ("script", "script-src")):
        body = re.search(rf"<{tag}>(.*?)</{tag}>", text, re.S)
        assert body is not None
        digest = base64.b64encode(hashlib.sha256(body[1].encode()).digest()).decode()
        assert f"{directive} 'sha256-{digest}'" in csp
    assert parse(text).styles == []  # a style attribute would need 'unsafe-inline'
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", text)


def test_cells_are_a_glyph_a_word_and_a_count_and_link_to_their_results() -> None:
    report = mixed_report()
    page = parse(html.render_report_html(report))
    cells = {(c["href"] or "").removeprefix("#"): c for c in page.cells}
    declaration = cells["backend%3ABAD%3AKV-L1"]
    assert (declaration["data-state"], declaration["data-count"], declaration["data-total"]) \
        == ("fail", "1", "1")
    known = cells["stack%3AGOOD%3AKV-L8"]  # one known, one fixed: the fixed one shows
    assert (known["data-state"], known["data-count"], known["data-total"]) == ("fixed", "1", "2")
    assert cells["backend%3AGOOD%3AKV-L7"]["data-state"] == "unchecked"
    assert cells["backend%3AGOOD%3AKV-L6"]["data-state"] == "na"
    assert cells["stack%3A%28upstream%29%3AKV-S1"]["data-state"] == "fail"
    for cell in page.cells:  # every cell's link lands on a group of results
        assert (cell["href"] or "").startswith("#")
    groups = {html_model.group_id(g.band, g.row, g.clause)
              for g in html_model.result_groups(report, [])}
    assert {c["href"] for c in page.cells} == {html_model.anchor(g) for g in groups}
    assert groups <= set(page.ids)
    assert len(page.cells) == len(groups)


def test_each_result_has_its_permalink_and_its_facts() -> None:
    report = mixed_report()
    text = html.render_report_html(report)
    page = parse(text)
    for r in report["results"]:
        assert html_model.test_id(r["nodeid"]) in page.ids
    assert "<dt>expected</dt><dd><pre>4096</pre></dd><dt>actual</dt><dd><pre>2048</pre></dd>" \
        in text
    assert "layout LBNHC" in text and "UniProcDiffusionExecutor -&gt; DiffusionWorker" in text
    assert "its constructor cannot complete here" in text  # the via's explanation, once
    assert "KV-L1 Declaration" in text and "is callable on the backend" in text  # the clause


def test_the_verdict_is_the_runs_root_cause_first() -> None:
    report = mixed_report()
    view = html_model.verdict_view(report)
    line = rp.verdict_text(report["verdict"], report["uncovered"], report["selection"],
                           report["run"], report["results"], report["startup_failures"])
    assert view.line == line
    assert view.notes[0].head.startswith("BAD: KV-L1 failed (root cause)")
    assert [r.root.text for r in view.roots] == ["test_kv_l1[BAD]"]
    assert [d.text for d in view.roots[0].dependents] == ["test_kv_l2[BAD]"]
    text = html.render_report_html(report)
    assert f'data-verdict-line="{line}"'.replace("'", "&#39;") in text.replace("&#34;", '"')


def test_findings_states_and_the_harness_apart() -> None:
    report = mixed_report()
    found = {(f.state, f.clause, f.entry) for f in html_model.findings(report)}
    assert found == {("persists", "KV-L8", "k.toml:1 */KV-L8"),
                     ("fixed", "KV-L8", "k.toml:2 */KV-L8"), ("new", "KV-S1", None)}
    harness = html_model.harness(report)
    assert [(kind, link.text) for kind, link, _ in harness.errors] == [
        ("worker-died", "test_kv_a1[GOOD-bf16_h8]")]
    assert [s.count for s in html_model.unchecked(report)] == [1]
    assert [s.text for s in html_model.not_applicable(report)] == [
        "KV-L6: the backend has no paged KV support"]


def test_finding_states_are_the_stack_records() -> None:
    """The page reads the report's own record of each finding's lifetime, not a guess."""
    report = mixed_report()
    lives = report["stack"]["findings"]
    states = html_model.finding_states(report)
    assert {n for n, s in states.items() if s == "new"} == set(lives["new"])
    persisting = {str(r["xfail"]) for r in report["results"]
                  if states.get(str(r["nodeid"])) == "persists"}
    assert persisting == set(lives["persists"])
    report["stack"]["findings"] = {"persists": [], "fixed": [], "new": []}
    assert set(html_model.finding_states(report).values()) <= {"fixed"}


def test_printed_messages_are_counted_and_bounded() -> None:
    env = {"worker_log": [{"level": "ERROR", "text": "same", "source": "w0"}] * 300 +
           [{"level": "WARNING", "text": f"m{i}" + "x" * 3000, "source": "w1"}
            for i in range(100)]}
    report = build([row("a")])
    report["environment"].update(env)
    log, = html_model.logs(report)
    assert (log.total, log.by_level) == (400, [("ERROR", 300), ("WARNING", 100)])
    assert log.messages[0].count == 300 and log.left_out == 101 - html_model.SHOWN_MESSAGES
    assert max(len(m.text) for m in log.messages) == html_model.MESSAGE_CHARS
    text = html.render_report_html(report)
    assert "<details><summary><strong>Production&#39;s KV-A worker processes</strong>: 400 " \
           "messages (300 ERROR, 100 WARNING), from 2 processes" in text


def test_the_grid_reads_the_family_a_report_records() -> None:
    report = mixed_report()
    for b in report["backends"]:
        b["family"] = "diffusion" if b["name"] == "GOOD" else "vLLM"
    grid = html_model.report_grids(report)[0]
    assert [(r.name, r.group) for r in grid.rows] == [("GOOD", "diffusion backends"),
                                                      ("BAD", "vLLM backends")]


def test_write_report_writes_the_page_and_a_stale_one_is_refused(tmp_path: Path,
                                                                 capsys: Any) -> None:
    first, second = mixed_report(), mixed_report()
    json_path, _, page = rp.write_report(tmp_path / "r.json", first)
    assert parse(page.read_text()).scripts == 1
    rp.check_pair(json_path)
    page.write_text(html.render_report_html(second))
    assert main(["validate", str(json_path)]) == 2
    assert f"{page} names run {second['run']['id']!r}" in capsys.readouterr().err


def test_cli_renders_a_report_a_merge_and_a_diff(tmp_path: Path, capsys: Any) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(build([row("s::test_kv_l1[GOOD]")])))
    b.write_text(json.dumps(mixed_report(SCRIPT)))
    assert main(["html", str(b)]) == 0
    assert (tmp_path / "b.html").is_file()
    assert main(["html", str(a), "-o", str(tmp_path / "pages" / "a-page.html")]) == 2
    assert "cannot write" in capsys.readouterr().err  # no such folder: one clear line
    assert main(["merge", str(a), str(b), "--html", str(tmp_path / "merged.html")]) == 0
    merged = (tmp_path / "merged.html").read_text()
    assert 'href="b.html"' in merged and SCRIPT not in merged
    assert main(["diff", str(a), str(b), "--html", str(tmp_path / "diff.html")]) == 1
    diff = (tmp_path / "diff.html").read_text()
    assert 'href="b.html#test_kv_l1%5BBAD%5D"' in diff and SCRIPT not in diff
    assert "&lt;script&gt;" in diff


def test_the_job_summary_is_appended_where_asked(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    report = mixed_report(SCRIPT)
    assert job_summary.append(report) is None  # not asked: nothing written
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv(job_summary.VARIABLE, str(summary))
    assert job_summary.append(report, tmp_path / "r.html") is None
    text = summary.read_text()
    assert text.startswith("earlier step\n### kvconform: ✗ verdict: not qualified (non-strict)")
    assert "| BAD | ✗ fail 1/1 | ✗ fail 1/1 |" in text
    assert "<script>" not in text and "`r.html`" in text
    monkeypatch.setenv(job_summary.VARIABLE, str(tmp_path))  # a directory: not writable
    assert "GITHUB_STEP_SUMMARY" in str(job_summary.append(report))


def _luminance(hex_colour: str) -> float:
    channels = [int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def contrast(a: str, b: str) -> float:
    """WCAG 2's contrast ratio of two ``#rrggbb`` colours."""
    hi, lo = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_every_text_colour_has_contrast_on_every_background_it_sits_on() -> None:
    """What axe leaves "incomplete" (a glyph alone, the striped "not checked" cells), checked
    from the palette itself: AA's 4.5:1 for each pair the style sheet puts together."""
    css = (html.TEMPLATES / "page.css").read_text()
    palette = dict(re.findall(r"--([a-z-]+): (#[0-9a-f]{6})", css))
    states = [s.key for s in html_model.STATES]
    pairs = [("ink", "paper"), ("muted", "paper"), ("muted", "band"), ("link", "paper"),
             ("link", "band")]
    for state in states:
        # the glyph, the word and the count on the state's tint (the count is muted)
        pairs += [(state, f"{state}-bg"), ("ink", f"{state}-bg"), ("muted", f"{state}-bg"),
                  ("link", f"{state}-bg")]
    low = [(fg, bg, round(contrast(palette[fg], palette[bg]), 2)) for fg, bg in pairs
           if contrast(palette[fg], palette[bg]) < 4.5]
    assert low == []
    stripe = re.search(r"var\(--unchecked-bg\) 0 6px, (#[0-9a-f]{6}) 6px", css)
    assert stripe is not None
    for fg in ("unchecked", "ink", "muted"):
        assert contrast(palette[fg], stripe[1]) >= 4.5, fg


def test_a_page_that_cannot_render_costs_neither_the_json_nor_the_markdown(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> str:
        raise KeyError("a field no template knows")

    monkeypatch.setattr(html, "render_report_html", broken)
    old = tmp_path / "r.html"
    old.write_text("another run's page")
    with pytest.raises(rp.ReportError, match=r"the page could not be rendered \(KeyError"):
        rp.write_report(tmp_path / "r.json", mixed_report())
    assert (tmp_path / "r.json").is_file() and (tmp_path / "r.md").is_file()
    assert not old.exists()


def test_a_page_stays_within_its_budget_however_many_results() -> None:
    """Over four times the results of vLLM 0.30's whole deployment: passing and n/a results
    are then listed by id alone, every one still has its permalink."""
    backends = [backend_record(f"BACKEND_{i:03d}", f"m:B{i}") for i in range(120)]
    results = []
    for b in backends:
        for clause in ("KV-L1", "KV-L2", "KV-L3", "KV-L4", "KV-L5"):
            test = f"s::test_kv_{clause[3:].lower()}"
            results += [row(f"{test}[{b['name']}-{case}]", clause, backend=b["name"], case=case)
                        for case in ("bf16_h8", "ws2", "fp8")]
        for clause in ("KV-A1", "KV-A2", "KV-A3"):
            test = f"s::test_kv_{clause[3:].lower()}"
            results += [row(f"{test}[{b['name']}-{case}]", clause, "skipped", backend=b["name"],
                            case=case, skip_kind="not-applicable",
                            reason=f"{clause}: {b['name']} has no paged KV support " * 3)
                        for case in ("bf16_h8", "ws2")]
    report = build(results, backends=backends)
    assert len(report["results"]) == 2520
    text = html.render_report_html(report)
    assert len(text.encode()) <= html.PAGE_BUDGET_BYTES
    ids = set(parse(text).ids)
    assert all(html_model.test_id(r["nodeid"]) in ids for r in report["results"])
    assert "by id only" in text


def test_an_interrupted_run_with_no_result_has_a_page() -> None:
    report = build([], interruption="KeyboardInterrupt during start-up")
    text = html.render_report_html(report)
    assert "No clause results." in text
    assert "<strong>Interrupted</strong>: KeyboardInterrupt during start-up." in text
    assert html_model.verdict_view(report).verdict == "interrupted"


def test_a_plugin_that_stops_production_is_shown_apart_from_the_clauses() -> None:
    from tests.report_rows import environment

    plugin = {"name": "bad", "group": "vllm.general_plugins", "dist": "bad 1.0",
              "status": "hook-failed", "error": f"RuntimeError: {SCRIPT}"}
    report = build([row("s::test_kv_l1[GOOD]")], env=environment(plugins={"plugins": [plugin]}))
    assert report["verdict"] == "not qualified"
    harness = html_model.harness(report)
    assert harness.startup == [f"plugin bad (vllm.general_plugins, bad 1.0) hook raised "
                               f"RuntimeError: {SCRIPT}"]
    text = html.render_report_html(report)
    panel = text.split('<section id="harness"', 1)[1].split("</section>", 1)[0]
    assert "Production would not start" in panel and "&lt;script&gt;" in panel
    assert SCRIPT not in text
