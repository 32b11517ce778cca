"""The report pages in a real browser: Debian's Chromium, headless, driven by Playwright.

The pages are a real strict whole-deployment run's (the installed wheel, as the README's
main job runs it), a release matrix's (the matrix runner with a stand-in for tox: two legs
that ran and one that could not be built) and a ``kvconform diff``'s (the real run against
the same run with one result turned into a failure whose message holds a ``<script>``).
Each is opened from ``file://``.  The grid is read back from the page and compared with the
JSON by this file's own reading of the statuses, not the renderer's.

A machine without Chromium (or Playwright) skips these with the reason; under CI (``$CI``
set, as CI sets it) they fail instead: ``.ci/run`` installs the browser and the tox
environment the Python packages (requirements/browser.txt).  Screenshots are kept in
``artifacts/`` for CI.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_kvconform.cli import main
from pytest_kvconform.report import build as rp
from pytest_kvconform.report.diff import diff_reports
from tests.crossversion.test_release_matrix import FAKE_TOX, LEGS
from tests.paths import ROOT
from tests.wheel_env import run as run_clean

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
ARTIFACTS = ROOT / "artifacts"
BUDGET = 1_000_000
SCRIPT = "<script>alert('owned')</script>"

# This file's own reading of a result, independent of report/html_model.py: the word a cell
# shows for it, worst first.
WORDS = {"failed": "fail", "error": "error", "xpassed": "fixed", "xfailed": "known",
         "passed": "pass"}
WORST_FIRST = ("fail", "error", "fixed", "not checked", "known", "pass", "n/a")


def word(result: dict[str, Any]) -> str:
    if result["status"] == "skipped":
        return "n/a" if result.get("skip_kind") == "not-applicable" else "not checked"
    return WORDS[result["status"]]


def _missing() -> str | None:
    if not CHROMIUM.is_file():
        return f"no Chromium at {CHROMIUM} (Debian: apt-get install -y chromium)"
    try:
        import axe_playwright_python  # noqa: F401
        import playwright.sync_api  # noqa: F401
    except ImportError as exc:
        return f"{exc.name} is not installed (pip install -r requirements/browser.txt)"
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    missing = _missing()
    if missing is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the browser tests, but {missing}: .ci/run installs Chromium "
                        "and tox the Python packages")
        pytest.skip(f"the browser tests need a browser: {missing}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The README's main job, strict, whole deployment, by the installed wheel."""
    workdir = tmp_path_factory.mktemp("run")
    done = run_clean([sys.executable, "-m", "pytest", "--kv-conformance", "--kv-strict", "-rs",
                      "-p", "no:cacheprovider", "--kv-report", "report.json"], cwd=workdir,
                     timeout=900)
    assert (workdir / "report.json").is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    assert "kvconform: report written to report.json, report.md and report.html" in done.stdout
    return workdir / "report.json"


@pytest.fixture(scope="module")
def matrix_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``kvconform matrix`` over three legs (a stand-in for tox): two ran, one not built."""
    root = tmp_path_factory.mktemp("clone")
    (root / "requirements").mkdir()
    (root / "tox.ini").write_text("[tox]\n")
    (root / "requirements" / "test.txt").write_text("pytest==9.2.0\n")
    for name, pins in (("a", "vllm==0.29.0"), ("b", "vllm==0.31.0\nvllm-omni==0.30.0"),
                       ("c", "vllm==0.34.0")):
        (root / "requirements" / f"{name}.txt").write_text(f"-r test.txt\n{pins}\n")
    (root / "fake_tox.json").write_text(json.dumps({"legs": LEGS}))
    out = root / "out"
    assert main(["matrix", "--root", str(root), "--tox", FAKE_TOX, "-o", str(out),
                 "--xfails", "none"]) == 1
    assert main(["html", str(out)]) == 0  # the folder: the matrix's page and each leg's
    return out


@pytest.fixture(scope="module")
def diff_pages(real_run: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """``kvconform diff A B --html``: A the real run, B the same with one passing result
    failing, its message holding a ``<script>``; B has its own page."""
    workdir = tmp_path_factory.mktemp("diff")
    a = json.loads(real_run.read_text())
    results = [dict(r) for r in a["results"]]
    victim = next(r for r in results if r["status"] == "passed" and r["backend"])
    victim.update(status="failed", reason=f"{victim['clause']} violated: {SCRIPT}\n  expected: "
                  "'<b>bold</b>'\n  actual:   'none'")
    b = rp.build_report(environment=a["environment"], backends=a["backends"], results=results,
                        options=a["environment"]["options"], strict=True,
                        selection=a["selection"], run=rp.run_record())
    (workdir / "a.json").write_text(json.dumps(a))
    (workdir / "b.json").write_text(json.dumps(b))
    assert main(["html", str(workdir / "b.json")]) == 0
    assert main(["diff", str(workdir / "a.json"), str(workdir / "b.json"), "--html",
                 str(workdir / "diff.html")]) == 1
    assert main(["merge", str(workdir / "a.json"), str(workdir / "b.json"), "--html",
                 str(workdir / "merged.html")]) == 0
    return workdir / "diff.html", a, b


@pytest.fixture
def open_page(browser: Any) -> Iterator[Any]:
    """Open a page from ``file://``: the page, every request it made, its console errors."""
    contexts = []

    def opener(path: Path, *, javascript: bool = True, bypass_csp: bool = False,
               fragment: str = "", width: int = 1400) -> tuple[Any, list[str], list[str]]:
        context = browser.new_context(java_script_enabled=javascript, bypass_csp=bypass_csp,
                                      viewport={"width": width, "height": 900})
        contexts.append(context)
        page = context.new_page()
        requests: list[str] = []
        errors: list[str] = []
        page.on("request", lambda request: requests.append(request.url))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("dialog", lambda d: errors.append(f"dialog: {d.message}"))
        page.goto(path.as_uri() + fragment)
        page.wait_for_load_state("load")
        return page, requests, errors

    yield opener
    for context in contexts:
        context.close()


def _shot(page: Any, name: str, **kwargs: Any) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), **kwargs)


def _grid_cells(page: Any) -> list[dict[str, str]]:
    """Every grid cell as the page shows it: band, row, column and its text."""
    return list(page.evaluate("""() => {
        const out = [];
        for (const table of document.querySelectorAll('table.grid')) {
          const heads = [...table.tHead.rows[0].cells].map(c => c.innerText.trim());
          for (const tr of table.tBodies[0].rows) {
            if (!tr.dataset.row) continue;
            const row = tr.cells[0].innerText.trim();
            [...tr.cells].slice(1).forEach((td, i) => {
              const cell = td.querySelector('.cell');
              const text = sel => (cell.querySelector(sel) || {innerText: ''}).innerText
                .replace(/\\s+/g, ' ').trim();
              if (cell) out.push({band: table.dataset.band, row, column: heads[i + 1],
                                  text: text('.gw') + ' ' + text('.n'), rest: text('.rest'),
                                  visible: cell.checkVisibility() ? 'yes' : 'no'});
            });
          }
        }
        return out;
    }"""))


def _expected_cells(report: dict[str, Any]) -> dict[tuple[str, str, str], tuple[str, str]]:
    """(band, row, column) -> ``fail 2/6``, the cell's worst state without its glyph, and
    the counts of its other states, worst first, from the JSON."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in report["results"]:
        key = (r["subject"], r["backend"] or "(upstream)", r["clause"].removeprefix("KV-"))
        groups.setdefault(key, []).append(r)
    out = {}
    for key, rows in groups.items():
        words = Counter(word(r) for r in rows)
        worst = min(words, key=WORST_FIRST.index)
        others = [str(words[w]) for w in WORST_FIRST if w in words and w != worst]
        out[key] = (f"{worst} {words[worst]}/{len(rows)}", " ".join(others))
    return out


# --------------------------------------------------------------------------- the run's page


def test_the_run_page_loads_from_file_with_no_request_but_the_file(real_run: Path,
                                                                   open_page: Any) -> None:
    page_file = rp.page_path(real_run)
    size = page_file.stat().st_size
    assert size < BUDGET, f"{page_file}: {size} bytes, over the page budget {BUDGET}"
    page, requests, errors = open_page(page_file)
    assert requests == [page_file.as_uri()]
    assert errors == []  # no policy violation, no script error
    _shot(page, "report-page.png")
    _shot(page, "report-page-full.png", full_page=False, clip={"x": 0, "y": 0, "width": 1400,
                                                               "height": 2200})


def test_the_run_grid_matches_the_json_and_reads_without_javascript(real_run: Path,
                                                                    open_page: Any) -> None:
    report = json.loads(real_run.read_text())
    expected = _expected_cells(report)
    for javascript in (True, False):
        page, _, _ = open_page(rp.page_path(real_run), javascript=javascript)
        shown = {(c["band"], c["row"], c["column"]): c for c in _grid_cells(page)}
        assert set(shown) == set(expected)
        for key, cell in shown.items():
            assert cell["visible"] == "yes", key
            glyph, _, text = cell["text"].partition(" ")
            assert text == expected[key][0], (key, cell["text"])
            counts = [n for n in cell["rest"].split() if n.isdigit()]
            assert " ".join(counts) == expected[key][1], (key, cell["rest"])
            assert glyph and not glyph.isalnum(), cell["text"]  # a glyph before the word
        filters = page.locator("form.filters").count()
        assert filters == (1 if javascript else 0)  # the script adds filters, nothing else
        if not javascript:
            verdict = page.locator("section.verdict")
            assert verdict.is_visible()


def test_the_verdict_is_the_runs(real_run: Path, open_page: Any) -> None:
    report = json.loads(real_run.read_text())
    line = rp.verdict_text(report["verdict"], report["uncovered"], report["selection"],
                           report["run"], report["results"], report["startup_failures"])
    page, _, _ = open_page(rp.page_path(real_run))
    verdict = page.locator("section.verdict")
    assert verdict.get_attribute("data-verdict-line") == line
    assert page.locator("#verdict .verdict-word").inner_text() == report["verdict"]
    shown = verdict.inner_text()
    for entry in report["uncovered"]:
        assert rp.describe_uncovered(entry) in shown


def test_a_permalink_opens_its_result(real_run: Path, open_page: Any) -> None:
    report = json.loads(real_run.read_text())
    known = next(r for r in report["results"] if r["status"] == "xfailed")
    test_id = known["nodeid"].rsplit("::", 1)[1]
    page, _, _ = open_page(rp.page_path(real_run), javascript=False,
                           fragment="#" + test_id)  # as a person pastes it
    body = page.locator(f'[id="{test_id}"]')
    assert body.is_visible()
    assert body.evaluate("b => b.closest('details').open") is True
    box = body.bounding_box()
    assert box is not None and 0 <= box["y"] < 900
    assert known["xfail"] in body.inner_text()
    _shot(page, "report-permalink.png")


def test_the_keyboard_reaches_every_drill_down(real_run: Path, open_page: Any) -> None:
    page, _, _ = open_page(rp.page_path(real_run))
    wanted = page.evaluate("""() => {
        const all = [...document.querySelectorAll('a.cell, details > summary')];
        all.forEach((el, i) => el.setAttribute('data-k', i));
        return all.length;
    }""")
    reached: set[int] = set()
    for _ in range(wanted * 3 + 200):
        page.keyboard.press("Tab")
        k = page.evaluate("() => document.activeElement.getAttribute('data-k')")
        if k is not None:
            if int(k) in reached and len(reached) == wanted:
                break
            reached.add(int(k))
    assert len(reached) == wanted
    first = page.locator("details:not([open]) > summary").first.element_handle()
    first.focus()
    page.keyboard.press("Enter")
    assert first.evaluate("s => s.parentElement.open") is True


def test_forced_colours_keep_every_state(real_run: Path, open_page: Any) -> None:
    page, _, _ = open_page(rp.page_path(real_run))
    page.emulate_media(forced_colors="active")
    assert page.evaluate("() => matchMedia('(forced-colors: active)').matches")
    styles = page.evaluate("""() => [...document.querySelectorAll('.cell')].slice(0, 40).map(
        c => [getComputedStyle(c).borderTopStyle, getComputedStyle(c).borderTopWidth,
              c.innerText.trim()])""")
    for style, width, text in styles:
        assert style != "none" and width != "0px", text
        assert len(text.split()) >= 3, text  # glyph, word, count: no colour needed
    _shot(page, "report-forced-colors.png")


def test_axe_finds_no_serious_violation(real_run: Path, matrix_dir: Path, diff_pages: Any,
                                        open_page: Any) -> None:
    from axe_playwright_python.base import AXE_SCRIPT

    for path in (rp.page_path(real_run), matrix_dir / "matrix.html", diff_pages[0],
                 diff_pages[0].with_name("merged.html")):
        page, _, _ = open_page(path, bypass_csp=True)  # the page's policy forbids axe
        page.evaluate(AXE_SCRIPT)
        found = page.evaluate("async () => (await axe.run(document)).violations.map("
                              "v => [v.id, v.impact, v.nodes.length, v.help])")
        serious = [v for v in found if v[1] in ("serious", "critical")]
        assert serious == [], f"{path.name}: {serious}"


# --------------------------------------------------------------------------- the matrix


def test_the_matrix_page(matrix_dir: Path, open_page: Any) -> None:
    matrix = json.loads((matrix_dir / "matrix.json").read_text())
    path = matrix_dir / "matrix.html"
    assert path.stat().st_size < BUDGET
    for javascript in (True, False):
        page, requests, errors = open_page(path, javascript=javascript)
        assert requests == [path.as_uri()] and errors == []
        from pytest_kvconform.report.matrix import verdict_line

        assert page.locator("section.verdict").get_attribute("data-verdict-line") == \
            verdict_line(matrix)
        cells = {(c["row"].split()[0], c["column"]): c["text"] for c in _grid_cells(page)
                 if c["band"] == "stack"}
        expected = {}
        for c in matrix["by_stack"]:
            total = sum(c["counts"].values())
            expected[(c["leg"], c["clause"].removeprefix("KV-"))] = (c["counts"][c["status"]],
                                                                     total)
        assert set(cells) == set(expected)
        for key, text in cells.items():
            assert text.endswith(f" {expected[key][0]}/{expected[key][1]}"), (key, text)
    # Each leg that ran links to its own page, which opens; the one not built to its log.
    for leg in matrix["legs"]:
        link = page.locator(f'tr[id="leg-{leg["name"]}"] a')
        href = link.get_attribute("href")
        assert href == (f"{leg['name']}.html" if leg["state"] == "ran" else f"{leg['name']}.log")
        assert (matrix_dir / href).is_file()
    leg_page, _, _ = open_page(matrix_dir / "py311-vllm031.html",
                               fragment="#GOOD%3AKV-L6")
    assert leg_page.locator("#verdict .verdict-word").inner_text() == "not qualified"
    _shot(page, "matrix-page.png", full_page=True)


# --------------------------------------------------------------------------- the diff


def test_the_diff_page(diff_pages: Any, open_page: Any) -> None:
    path, a, b = diff_pages
    found = diff_reports(a, b)
    assert path.stat().st_size < BUDGET
    page, requests, errors = open_page(path)
    assert requests == [path.as_uri()]
    assert errors == []  # the <script> in B's message never ran: no dialog
    table = page.locator('table[data-section="new"] tbody tr')
    assert table.count() == len(found.new_failures) == 1
    assert SCRIPT in table.first.inner_text()  # shown as text
    assert page.locator("#verdict .verdict-word").inner_text() == "1 new failure(s)"
    # The changed result links into B's page, where its permalink opens it.
    href = table.first.locator("a").get_attribute("href")
    assert href is not None and href.startswith("b.html#")
    page.locator('table[data-section="new"] a').first.click()
    page.wait_for_load_state("load")
    test_id = found.new_failures[0].test
    body = page.locator(f'[id="{test_id}"]')
    assert body.is_visible() and SCRIPT in body.inner_text()
    assert "<b>bold</b>" in body.inner_text()
    assert errors == []
    _shot(page, "diff-target.png")


def test_the_filters_only_hide(real_run: Path, open_page: Any) -> None:
    """The script's one job: with a text, only the results (and grid rows) that name it stay;
    a state unticked hides its results."""
    page, _, _ = open_page(rp.page_path(real_run))
    results = page.locator(".result")
    total = results.count()
    page.locator("form.filters input[type=search]").fill("kv_l8_alias")
    shown = page.evaluate("() => [...document.querySelectorAll('.result')].filter("
                          "r => !r.hidden).map(r => r.id || r.querySelector('.body').id)")
    assert shown and all("kv_l8_alias" in s for s in shown)
    page.locator("form.filters input[type=search]").fill("")
    page.locator("form.filters input[name=state-pass]").uncheck()
    states = page.evaluate("() => [...document.querySelectorAll('.result')].filter("
                           "r => !r.hidden).map(r => r.dataset.state)")
    assert "pass" not in states and 0 < len(states) < total
    assert results.count() == total  # hidden, never removed


def test_the_merged_page(diff_pages: Any, open_page: Any) -> None:
    path = diff_pages[0].with_name("merged.html")
    page, requests, errors = open_page(path, javascript=False)
    assert requests == [path.as_uri()] and errors == []
    assert page.locator("#verdict .verdict-word").inner_text() == "not qualified"
    hosts = page.locator("#hosts tbody tr")
    assert hosts.count() == 2
    assert page.locator('#hosts a[href="b.html"]').count() == 1  # B has its own page
