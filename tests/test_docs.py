"""The documentation says what the code does: every documented option, command and import
exists, every link resolves, the README stays a front page, and the results read as results.

README.md is the front page; docs/ holds one page per reader and question; each fact is
stated once and linked.  These tests read the Markdown as a reader would: code blocks,
inline code and links.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.paths import ROOT as REPO

README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
RESULTS = REPO / "benchmarks" / "RESULTS.md"
PAGES = [README, REPO / "CONTRIBUTING.md", REPO / "CHANGELOG.md", *DOCS]
ALL_MARKDOWN = [*PAGES, RESULTS, REPO / "pytest_kvconform" / "contract.md"]
FRONT_PAGE_LINES = 150


def text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def fenced_blocks(markdown: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", markdown, re.M | re.S)


def code_text(markdown: str) -> str:
    """Everything a reader would copy: fenced and indented blocks and inline code."""
    parts = [body for _, body in fenced_blocks(markdown)]
    prose = re.sub(r"^```\w*\n.*?^```", "", markdown, flags=re.M | re.S)
    parts += [line for line in prose.splitlines() if line.startswith("    ")]
    parts += re.findall(r"`([^`\n]+)`", prose)
    return "\n".join(parts)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    plain = re.sub(r"[`*]", "", heading.strip()).lower()
    plain = re.sub(r"\]\([^)]*\)", "", plain).replace("[", "")
    return re.sub(r"[^\w\- ]", "", plain).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    prose = re.sub(r"^```\w*\n.*?^```", "", markdown, flags=re.M | re.S)
    for heading in re.findall(r"^#{1,6} (.+)$", prose, re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


# ----------------------------------------------------------------------------- the front page


def test_readme_is_a_front_page_that_links_every_page() -> None:
    readme = text(README)
    lines = readme.count("\n") + (not readme.endswith("\n"))
    assert lines <= FRONT_PAGE_LINES, f"README.md has {lines} lines (at most {FRONT_PAGE_LINES})"
    linked = {(README.parent / link).resolve()
              for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)}
    assert DOCS, "docs/ has no page"
    missing = [p.relative_to(REPO).as_posix() for p in DOCS if p.resolve() not in linked]
    assert not missing, f"README.md does not link: {', '.join(missing)}"


def test_the_ci_job_in_the_readme_runs_plain_commands() -> None:
    """The backend repository's CI job: GitHub Actions YAML whose ``run:`` steps are shell
    commands a test can run as they stand, ending in the strict backend-scoped run."""
    yaml = pytest.importorskip("yaml")
    (job_text,) = [body for lang, body in fenced_blocks(text(README)) if lang == "yaml"]
    workflow = yaml.safe_load(job_text)
    (job,) = workflow["jobs"].values()
    runs = [step["run"] for step in job["steps"] if "run" in step]
    assert runs and all(isinstance(r, str) and "\n" not in r.strip() for r in runs), runs
    assert any(r.split()[:3] == ["python", "-m", "pip"] and " install " in r for r in runs), runs
    last = runs[-1].split()
    assert last[:2] == ["pytest", "--kv-conformance"] and "--kv-strict" in last, runs[-1]
    assert "--kv-backend" in last, runs[-1]


# ----------------------------------------------------------------------------- links


@pytest.mark.parametrize("page", ALL_MARKDOWN, ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_resolve(page: Path) -> None:
    """Every relative link names a file in the repository, and its anchor a heading there."""
    prose = re.sub(r"^```\w*\n.*?^```", "", text(page), flags=re.M | re.S)
    problems = []
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", prose):
        if re.match(r"[a-z]+:", target):
            continue
        path = (page.parent / target).resolve() if target else page.resolve()
        if not path.is_relative_to(REPO):
            problems.append(f"{target}: leaves the repository")
        elif not path.exists():
            problems.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(text(path)):
            problems.append(f"{target}#{anchor}: no such heading")
    assert not problems, f"{page.relative_to(REPO)}: " + "; ".join(problems)


# ----------------------------------------------------------------------------- options


def _registered_options() -> tuple[set[str], set[str]]:
    """(command-line options, ini keys) the plugin registers, as ``pytest --help`` lists
    them: a fresh process with the installed plugin, outside this repository's config."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTEST_ADDOPTS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD", "PYTEST_PLUGINS")}
    done = subprocess.run([sys.executable, "-m", "pytest", "--help", "-p", "no:cacheprovider"],
                          cwd=REPO / "docs", env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    options = set(re.findall(r"^  (--kv-[\w-]+)", done.stdout, re.M))
    ini = set(re.findall(r"^  (kv_\w+) \(", done.stdout, re.M))
    assert options and ini, done.stdout
    return options, ini


def test_the_options_page_lists_exactly_the_registered_options() -> None:
    rows = re.findall(r"^\| `(--kv-[\w-]+)[^`]*` \| `(kv_\w+)`", text(REPO / "docs" / "options.md"),
                      re.M)
    documented = {option for option, _ in rows}
    documented_ini = {key for _, key in rows}
    assert len(rows) == len(documented), "an option is listed twice"
    options, ini = _registered_options()
    assert documented == options, (f"docs/options.md lists {sorted(documented - options)}, "
                                   "which do not exist, and leaves out "
                                   f"{sorted(options - documented)}")
    assert documented_ini == ini, (f"docs/options.md's ini keys {sorted(documented_ini - ini)} "
                                   f"do not exist; it leaves out {sorted(ini - documented_ini)}")
    assert all(key == option[2:].replace("-", "_") for option, key in rows), rows


def test_every_option_the_docs_mention_exists() -> None:
    options, _ = _registered_options()
    unknown = {f"{page.relative_to(REPO)}: {option}"
               for page in [*PAGES, RESULTS] for option in re.findall(r"--kv-[a-z][\w-]*",
                                                                        text(page))
               if option.rstrip("-") not in options}
    assert not unknown, sorted(unknown)


# ----------------------------------------------------------------------------- imports


def _documented_imports() -> set[tuple[str, str | None, str]]:
    """(module, name or None, page) of every import the docs show, in code or prose."""
    found: set[tuple[str, str | None, str]] = set()
    for page in PAGES:
        where = page.relative_to(REPO).as_posix()
        for lang, body in fenced_blocks(text(page)):
            if lang != "python":
                continue
            for node in ast.walk(ast.parse(textwrap.dedent(body))):
                if isinstance(node, ast.ImportFrom) and node.module:
                    found.update((node.module, a.name, where) for a in node.names)
                elif isinstance(node, ast.Import):
                    found.update((a.name, None, where) for a in node.names)
        for module, names in re.findall(r"\bfrom ((?:pytest_kvconform|vllm_omni)[\w.]*) import "
                                        r"([\w, ]+)", text(page)):
            found.update((module, n.strip(), where) for n in names.split(",") if n.strip())
        found.update((m, None, where) for m in
                     re.findall(r"\bimport (pytest_kvconform[\w.]*)", text(page)))
    return found


def test_every_documented_import_of_the_package_imports() -> None:
    problems = []
    for module, name, page in sorted(_documented_imports(), key=str):
        if module.partition(".")[0] != "pytest_kvconform":
            continue
        try:
            mod = importlib.import_module(module)
            if name is not None and not hasattr(mod, name):
                importlib.import_module(f"{module}.{name}")
        except ImportError as exc:
            problems.append(f"{page}: from {module} import {name}: {exc}")
    assert not problems, problems


def test_every_documented_name_from_vllm_omni_exists() -> None:
    """Read from the installed source, without importing vllm-omni (seconds of imports)."""
    spec = importlib.util.find_spec("vllm_omni")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vllm-omni not installed")
    root = Path(next(iter(spec.submodule_search_locations)))
    problems = []
    for module, name, page in sorted(_documented_imports(), key=str):
        if module.partition(".")[0] != "vllm_omni" or name is None:
            continue
        rel = Path(*module.split(".")[1:])
        source = root / rel.with_suffix(".py")
        source = source if source.is_file() else root / rel / "__init__.py"
        if not source.is_file():
            problems.append(f"{page}: {module} is not a module of vllm-omni")
        elif not re.search(rf"^(?:class|def) {name}\b|^{name}\s*[:=]|\b{name}\b.*import|"
                           rf"import.*\b{name}\b", source.read_text(), re.M):
            problems.append(f"{page}: {module} has no {name}")
    assert not problems, problems


def test_the_documented_check_backend_signature_is_the_real_one() -> None:
    from pytest_kvconform.api import check_backend

    page = text(REPO / "docs" / "backend-authors.md")
    (line,) = re.findall(r"^    (check_backend\(.*\))$", page, re.M)
    documented = ast.parse(f"def {line}: pass").body[0]
    assert isinstance(documented, ast.FunctionDef)
    args = documented.args
    doc = [(a.arg, "positional") for a in args.args] + \
          [(a.arg, "keyword") for a in args.kwonlyargs]
    real = [(p.name, "keyword" if p.kind is p.KEYWORD_ONLY else "positional")
            for p in inspect.signature(check_backend).parameters.values()]
    assert doc == real, f"documented {doc}, real {real}"
    defaults = [ast.literal_eval(d) for d in args.defaults] + \
               [ast.literal_eval(d) for d in args.kw_defaults if d is not None]
    real_defaults = [p.default for p in inspect.signature(check_backend).parameters.values()
                     if p.default is not p.empty]
    assert defaults == real_defaults


def _clause_ids(phrase: str) -> set[str]:
    """The clause ids a phrase names, ranges (``KV-A1..A6``) expanded."""
    ids = set()
    for family, first, last in re.findall(r"KV-([A-Z])(\d+)(?:\.\.[A-Z]?(\d+))?", phrase):
        ids.update(f"KV-{family}{n}" for n in range(int(first), int(last or first) + 1))
    return ids


def test_the_clauses_said_to_start_workers_are_the_tables() -> None:
    from pytest_kvconform.contract import clauses

    page = text(REPO / "docs" / "backend-authors.md")
    (started,) = re.findall(r"The clauses that stand up production's engine, (.*?), start "
                            r"worker processes", page, re.S)
    (skipped,) = re.findall(r"To skip the workers, pass `clauses=` without (.*?)\.(?:\s|$)",
                            page, re.S)
    real = {row.id for row in clauses.CLAUSES if any(c.needs_workers for c in row.checks)}
    assert _clause_ids(started) == real
    assert _clause_ids(skipped) == real


def test_the_environment_check_backend_sets_is_documented() -> None:
    from pytest_kvconform.adapters import run_env

    page = text(REPO / "docs" / "backend-authors.md")
    (bullet,) = [b for b in page.split("\n- ") if b.startswith("Importing `pytest_kvconform`")]
    documented = dict(re.findall(r"`([A-Z_]+)=([^`]*)`", bullet))
    assert documented == {**run_env.DEFAULTS, **run_env.CPU_DEFAULTS}
    assert "`VLLM_PLUGINS` to the empty string" in " ".join(bullet.split())


# ----------------------------------------------------------------------------- the CLI


def test_every_documented_kvconform_command_exists() -> None:
    from pytest_kvconform.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if a.dest == "command"]
    commands = set(sub.choices)  # type: ignore[arg-type]
    documented = {(cmd, page.relative_to(REPO).as_posix()) for page in [*PAGES, RESULTS]
                  for cmd in re.findall(r"(?:^|[\s`(/])kvconform ([a-z][\w-]*)(?![\w:-])",
                                        code_text(text(page)), re.M)}
    assert {cmd for cmd, _ in documented} >= {"matrix", "diff", "selftest"}, documented
    unknown = sorted(f"{page}: kvconform {cmd}" for cmd, page in documented
                     if cmd not in commands)
    assert not unknown, unknown


def test_every_option_of_every_kvconform_command_is_documented() -> None:
    """Each subcommand's flags (short forms too) and the positional defaults a reader relies
    on are in a page's code text."""
    import argparse

    from pytest_kvconform.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if a.dest == "command"]
    documented = "\n".join(code_text(text(page)) for page in PAGES)
    missing = []
    for name, parser in sub.choices.items():  # type: ignore[union-attr]
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for option in action.option_strings:
                if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", documented):
                    missing.append(f"kvconform {name} {option}")
            if not action.option_strings and isinstance(action.default, str) \
                    and f"./{action.default}" not in documented:  # an output folder
                missing.append(f"kvconform {name}: {action.metavar}'s default "
                               f"./{action.default}")
    assert not missing, missing


# ----------------------------------------------------------------------------- versions


def test_the_changelog_carries_the_versions_in_the_code() -> None:
    import tomllib

    import pytest_kvconform
    from pytest_kvconform.gpu import report as gpu_report
    from pytest_kvconform.report import matrix, schema
    from pytest_kvconform.selftest import catches

    table = dict(re.findall(r"^\| ([^|]+?) \| `?([^|`]+?)`? \|", text(REPO / "CHANGELOG.md"),
                            re.M))
    version = tomllib.loads(text(REPO / "pyproject.toml"))["project"]["version"]
    assert version == pytest_kvconform.__version__
    expected = {
        "package": pytest_kvconform.__version__,
        "contract": pytest_kvconform.CONTRACT_VERSION,
        "report schema": schema.SCHEMA,
        "combined matrix report schema": matrix.MATRIX_SCHEMA,
        "`kvconform selftest --json`": catches.SCHEMA,
        "`kvconform gpu-check` JSON": gpu_report.SCHEMA,
    }
    assert {k: table.get(k) for k in expected} == expected


# ----------------------------------------------------------------------------- results


def test_results_read_as_results() -> None:
    """One current table per question, each with its goal and its reproducing command; no
    dated diary sections, no unmeasured figure printed as nan."""
    results = text(RESULTS)
    assert not re.findall(r"^#+ .*\b20\d\d-\d\d-\d\d", results, re.M), "a dated section"
    assert not re.findall(r"\bnan\b", results, re.I), "a figure printed as nan"
    sections = re.split(r"^## ", results, flags=re.M)[1:]
    assert len(sections) >= 8
    for section in sections:
        title = section.splitlines()[0]
        assert re.search(r"\bgoal\b", section, re.I), f"'{title}' states no goal"
        assert re.search(r"^    .*(benchmarks/|kvconform )", section, re.M), \
            f"'{title}' has no command that reproduces it"
    (rss,) = [s for s in sections if s.lower().startswith("peak rss")]
    assert "1 GiB" in rss and re.search(r"\| not met \|", rss), "the peak-RSS goal and its status"


def test_the_docs_speak_of_the_product() -> None:
    """No first person, internal labels or local paths: the docs describe the product."""
    problems = []
    for page in ALL_MARKDOWN:
        body = text(page)
        for pattern in (r"\b(?:I|we|our|us)\b", r"\bstop \d+", r"\bissue \d+", r"/tmp/",
                        r"\bwt-[\w-]+", r"\bahead2\b", r"shared draft"):
            problems += [f"{page.relative_to(REPO)}: {m!r}"
                         for m in re.findall(pattern, body, 0 if pattern.startswith(r"\b(")
                                             else re.I)]
    assert not problems, problems
