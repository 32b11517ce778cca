"""The qualification report: build it, write and read it; the one import for its users.

Stdlib only (nothing here imports pytest, torch or vllm), so ``kvconform show`` and
``kvconform merge`` run on a machine without the serving stack.

The report's concerns live in their own modules, each importing only the ones before it:

* :mod:`~pytest_kvconform.report.result_notes`: what speaks against qualification, in
  words, and which failures follow from a failed declaration;
* :mod:`~pytest_kvconform.report.verdict`: the strict rule, the verdict, the run and
  selection records;
* :mod:`~pytest_kvconform.report.schema`: the schema's keys and :func:`validate_report`;
* :mod:`~pytest_kvconform.report.env`: the ``environment`` record (versions, devices);
* :mod:`~pytest_kvconform.report.render`: the terminal matrix and the Markdown;
* :mod:`~pytest_kvconform.report.merge`: checking and merging several hosts' reports.

This module builds a report from results (:func:`build_report`), writes it atomically
and loads it, and re-exports the public names of the others, so callers import
``pytest_kvconform.report.build`` only.

A result is a dict with keys ``nodeid, backend, clause, case, layout, device,
status, reason, duration_s`` plus optional ``skip_kind`` (a
:class:`~pytest_kvconform.checks.errors.SkipKind` value) and ``xfail`` (the
``describe()`` id of the xfail entry applied).  ``backend`` is None for
upstream (per layout/case) tests; the matrices show those in a ``(upstream)`` row.

A status ``error`` result may carry ``error_kind`` (``worker-died``, ``timeout``,
``oom``, ``harness``): the harness failed there, not the backend.  A result whose test
drove KV-A workers under a seeded worker fault carries ``seeded_fault`` (the fault's
name, also in ``environment.seeded_faults``).
"""

from __future__ import annotations

import contextlib
import fcntl
import html
import json
import os
import re
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from pytest_kvconform.contract import CONTRACT_VERSION
from pytest_kvconform.contract.clauses import CLAUSE_RE, clause_sort_key, subject_of
from pytest_kvconform.report.env import environment_info
from pytest_kvconform.report.matrix import (
    MATRIX_SCHEMA,
    build_matrix,
    is_matrix,
    render_matrix_markdown,
    validate_matrix,
)
from pytest_kvconform.report.merge import (
    check_mergeable,
    host_labels,
    merged_uncovered,
    merged_verdict,
    render_merged_markdown,
)
from pytest_kvconform.report.render import (
    UPSTREAM_ROW,
    render_markdown,
    render_terminal_matrix,
    worst_status,
)
from pytest_kvconform.report.result_notes import not_a_fix, result_notes, with_dependencies
from pytest_kvconform.report.schema import (
    BACKEND_KEYS,
    BACKEND_OPTIONAL_KEYS,
    ENV_KEYS,
    ERROR_KINDS,
    RESULT_KEYS,
    RESULT_OPTIONAL_KEYS,
    SCHEMA,
    SKIP_KINDS,
    ReportError,
    expect_shallow,
    jsonable,
    result_sort_key,
    validate_report,
)
from pytest_kvconform.report.verdict import (
    EXIT_NOT_CHECKED,
    EXIT_STACK_REGRESSED,
    FORGIVEN_SKIP_KINDS,
    STATUSES,
    VERDICTS,
    backend_faults_text,
    bites,
    compute_verdict,
    describe_altered,
    describe_startup_failure,
    describe_uncovered,
    interruption_of,
    judge,
    left_out,
    not_checked,
    now_iso,
    only_not_checked,
    ran_count,
    run_record,
    scope_of,
    selection_record,
    stack_differs,
    stack_record,
    stack_text,
    startup_failures,
    summarize,
    uncovered_entries,
    verdict_text,
)
from pytest_kvconform.workers.devices import nvidia_smi

__all__ = [
    "CLAUSE_RE",
    "ERROR_KINDS",
    "EXIT_NOT_CHECKED",
    "EXIT_STACK_REGRESSED",
    "FORGIVEN_SKIP_KINDS",
    "MATRIX_SCHEMA",
    "SCHEMA",
    "SKIP_KINDS",
    "STATUSES",
    "UPSTREAM_ROW",
    "VERDICTS",
    "ReportError",
    "backend_faults_text",
    "bites",
    "build_matrix",
    "build_report",
    "check_mergeable",
    "check_pair",
    "clause_sort_key",
    "compute_verdict",
    "describe_altered",
    "describe_startup_failure",
    "describe_uncovered",
    "environment_info",
    "host_labels",
    "interruption_of",
    "is_matrix",
    "judge",
    "left_out",
    "load_report",
    "lock_path",
    "markdown_path",
    "markdown_run_id",
    "merged_uncovered",
    "merged_verdict",
    "not_a_fix",
    "not_checked",
    "now_iso",
    "nvidia_smi",
    "only_not_checked",
    "page_path",
    "page_run_id",
    "ran_count",
    "render_markdown",
    "render_matrix_markdown",
    "render_merged_markdown",
    "render_terminal_matrix",
    "report_lock",
    "report_paths",
    "result_notes",
    "run_record",
    "scope_of",
    "selection_record",
    "stack_differs",
    "stack_record",
    "stack_text",
    "startup_failures",
    "summarize",
    "uncovered_entries",
    "validate_matrix",
    "validate_report",
    "verdict_text",
    "with_dependencies",
    "worst_status",
    "write_matrix",
    "write_report",
]

# The schema's key tuples under the names they had when this module held them.
_ENV_KEYS = ENV_KEYS
_BACKEND_KEYS = BACKEND_KEYS
_BACKEND_OPTIONAL_KEYS = BACKEND_OPTIONAL_KEYS


def build_report(
    *,
    environment: Mapping[str, Any],
    backends: Iterable[Any],
    results: Iterable[Mapping[str, Any]],
    options: Mapping[str, Any],
    strict: bool,
    selection: Mapping[str, Any] | None = None,
    run: Mapping[str, Any] | None = None,
    altered: Sequence[str] = (),
) -> dict[str, Any]:
    """A validated report; results sorted by nodeid so ``-n 2`` and ``-n 0`` agree.

    ``altered``: what of the suite's own code changed after start-up (``integrity``;
    recorded, and the verdict is ``not qualified``).

    ``backends`` are :class:`~pytest_kvconform.contract.records.BackendUnderTest` records or
    dicts with the schema's keys.  ``options`` replaces ``environment["options"]``
    (the plugin knows its final options only after configuration).  Without a
    ``selection`` (see :func:`selection_record`) the verdict is at best ``partial``;
    without a ``run`` (see :func:`run_record`) a fresh run id is made.
    """
    env = jsonable(dict(environment))
    env["options"] = jsonable(dict(sorted(options.items())))
    rows = sorted(with_dependencies(_normalise_result(r) for r in results),
                  key=result_sort_key)
    run_rec = jsonable(dict(run)) if run is not None else run_record()
    sel = jsonable(dict(selection)) if selection is not None else None
    startup = startup_failures(env.get("plugins"))
    verdict, uncovered = judge(rows, strict, sel, run_rec, startup, altered)
    report = {
        "schema": SCHEMA,
        "contract": CONTRACT_VERSION,
        "run": run_rec,
        "environment": env,
        "selection": sel,
        "backends": [_backend_record(b) for b in backends],
        "results": rows,
        "summary": summarize(rows, strict),
        "verdict": verdict,
        "uncovered": uncovered,
        "startup_failures": startup,
        "stack": stack_record(rows),
    }
    if altered:
        report["integrity"] = list(altered)
    validate_report(report)
    return report


def _normalise_result(result: Mapping[str, Any]) -> dict[str, Any]:
    row = {k: jsonable(result.get(k)) for k in RESULT_KEYS + RESULT_OPTIONAL_KEYS}
    if row["subject"] is None:  # a row from before subjects: the clause table's
        row["subject"] = subject_of(str(row["nodeid"]).rpartition("::")[2].partition("[")[0])
    if row["duration_s"] is None:
        row["duration_s"] = 0.0
    extra = sorted(set(result) - set(row))
    if extra:  # kept so that validation names the stray key instead of dropping it
        row.update({k: jsonable(result[k]) for k in extra})
    return row


def _backend_record(backend: Any) -> dict[str, Any]:
    if isinstance(backend, Mapping):
        return jsonable(dict(backend))
    record: dict[str, Any] = backend.record()
    if record["origin"] is None:  # optional: only plugin-provided backends name one
        del record["origin"]
    return record


# --------------------------------------------------------------------------- files


def markdown_path(path: str | Path) -> Path:
    """``report.json`` -> ``report.md``: the Markdown rendering lives next to the JSON."""
    path = Path(path)
    if path.suffix in (".md", ".html"):
        raise ReportError("$", f"{path}: the JSON report path must not end in {path.suffix}")
    return path.with_suffix(".md")


def report_paths(path: str | Path) -> tuple[Path, Path]:
    """``(json, markdown)`` for a ``--kv-report`` path.

    ``r.json`` (or any other name) -> ``r.json`` and ``r.md``; a path ending in ``.md``
    (or ``.html``) is understood as the Markdown's (the page's): ``r.md`` -> ``r.json``
    and ``r.md``.  The page is :func:`page_path`.
    """
    path = Path(path)
    if path.suffix in (".md", ".html"):
        return path.with_suffix(".json"), path.with_suffix(".md")
    return path, markdown_path(path)


def page_path(path: str | Path) -> Path:
    """The HTML page of a ``--kv-report`` path: ``r.json`` -> ``r.html``."""
    return report_paths(path)[0].with_suffix(".html")


def write_report(path: str | Path, report: Mapping[str, Any]) -> tuple[Path, Path, Path]:
    """Validate, then write JSON, Markdown and the page, each via a temp file and
    ``os.replace``.

    A reader never sees a half-written report, even when a run is interrupted.  The
    files are written and renamed under :func:`report_lock`, so two runs writing the
    same path leave files from one run (the Markdown and the page name the JSON's run id;
    see :func:`check_pair`).  Files get the usual mode (0666 less the umask), not
    ``mkstemp``'s 0600.
    """
    from pytest_kvconform.report.html import render_report_html

    validate_report(report)
    json_path = report_paths(path)[0]
    page, problem = _rendered(lambda: render_report_html(report, json_path.name))
    written = _write_set(path, json.dumps(report, indent=2, allow_nan=False) + "\n",
                         render_markdown(report), page)
    _refuse_unrendered(path, problem)
    return written


def _rendered(render: Any) -> tuple[str | None, str | None]:
    """A page, or why it could not be rendered: the JSON and Markdown are written anyway."""
    try:
        return render(), None
    except Exception as exc:  # a template's error must not cost the report
        return None, f"{type(exc).__name__}: {exc}"


def _refuse_unrendered(path: str | Path, problem: str | None) -> None:
    if problem is not None:
        json_path, md_path = report_paths(path)
        raise ReportError("$", f"{page_path(path)}: the page could not be rendered "
                          f"({problem}); {json_path} and {md_path} are written")


def write_matrix(path: str | Path, matrix: Mapping[str, Any],
                 reports: Mapping[str, Mapping[str, Any]] | None = None
                 ) -> tuple[Path, Path, Path]:
    """A combined matrix report, its Markdown and its page, written as :func:`write_report`
    writes; ``reports`` (each leg that ran, by name) let the page tell a "not checked"
    skip from an "n/a" one, and a leg whose page is missing gets one next to its report."""
    from pytest_kvconform.report.html import render_matrix_html, render_report_html, write_html

    validate_matrix(matrix)
    page, problem = _rendered(lambda: render_matrix_html(matrix, reports))
    written = _write_set(path, json.dumps(matrix, indent=2, allow_nan=False) + "\n",
                         render_matrix_markdown(matrix), page)
    _refuse_unrendered(path, problem)
    base = written[0].parent
    for leg in matrix["legs"]:
        report = (reports or {}).get(leg["name"])
        if report is not None and leg["report"]:
            leg_page = page_path(base / leg["report"])
            if not leg_page.exists():
                write_html(leg_page, render_report_html(report, leg["report"]))
    return written


def _write_set(path: str | Path, json_text: str, md_text: str, html_text: str | None
               ) -> tuple[Path, Path, Path]:
    """JSON, Markdown and page (unless None: a stale one is removed), each via a temp file
    and ``os.replace``, under the lock."""
    json_path, md_path = report_paths(path)
    html_path = page_path(path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    with report_lock(json_path):
        temps: list[tuple[Path, Path]] = []
        try:
            for final, text in ((json_path, json_text), (md_path, md_text),
                                (html_path, html_text)):
                if text is not None:
                    temps.append((_temp_write(final, text), final))
            for tmp, final in temps:
                os.replace(tmp, final)
            if html_text is None:
                html_path.unlink(missing_ok=True)  # another run's page would pass for this
        finally:
            for tmp, _ in temps:
                tmp.unlink(missing_ok=True)  # gone once renamed
    return json_path, md_path, html_path


def lock_path(path: str | Path) -> Path:
    """The lock file of a report pair: ``dir/.r.json.lock`` next to ``dir/r.json``."""
    json_path, _ = report_paths(path)
    return json_path.with_name(f".{json_path.name}.lock")


@contextlib.contextmanager
def report_lock(path: str | Path, *, shared: bool = False) -> Iterator[bool]:
    """Hold the pair's lock (``flock``): exclusive for a writer, ``shared`` for a reader.

    The lock file is created 0600 (less the umask) and never followed through a
    symlink; it stays after the write, since removing it would let a later writer lock
    a fresh file while an earlier one still holds the old.  A reader does not create
    it: without one (or one it may not open), it reads unlocked and yields False.
    """
    flags = os.O_RDONLY if shared else os.O_WRONLY | os.O_CREAT
    try:
        fd = os.open(lock_path(path), flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        if not shared:
            raise
        fd = -1  # no lock file (or not ours to open): read without the lock
    if fd < 0:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)  # closing releases the lock


def _temp_write(path: Path, text: str) -> Path:
    """``text`` in a fresh temp file next to ``path``, for ``os.replace``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    # O_EXCL: never follow or reuse someone else's file; 0o666: the umask decides.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


_MD_RUN_RE = re.compile(r"^Contract .*, run `([^`]+)` started ", re.MULTILINE)
_HTML_RUN_RE = re.compile(r'<meta name="kvconform-run" content="([^"]*)">')


def markdown_run_id(text: str) -> str | None:
    """The run id a report's Markdown names (its header line), or None if it names none."""
    match = _MD_RUN_RE.search(text)
    return match.group(1) if match else None


def page_run_id(text: str) -> str | None:
    """The run id a report's page names (its ``kvconform-run`` meta tag), or None."""
    match = _HTML_RUN_RE.search(text)
    return html.unescape(match.group(1)) if match else None


def check_pair(path: str | Path) -> None:
    """Refuse a JSON report whose Markdown or page next to it comes from another run.

    All are read under the report's shared lock, so a writer's renames are never seen
    half done.  No Markdown or page is fine (a JSON copied alone, or renamed).
    """
    json_path, md_path = report_paths(path)
    with report_lock(json_path, shared=True):
        report = load_report(json_path)
        texts = {}
        for other in (md_path, page_path(json_path)):
            try:
                texts[other] = other.read_text(encoding="utf-8")
            except FileNotFoundError:
                continue
            except (OSError, UnicodeDecodeError) as exc:
                raise ReportError("$.run.id", f"{other}: cannot read: {exc}") from exc
    run = report.get("run")
    run_id = run.get("id") if isinstance(run, dict) else None
    for other, text in texts.items():
        named = markdown_run_id(text) if other == md_path else page_run_id(text)
        if named != run_id:
            theirs = f"run {named!r}" if named else "no run id"
            raise ReportError("$.run.id", f"{other} names {theirs} but {json_path} is run "
                              f"{run_id!r}: the files are from different runs (write them "
                              "again)")


def load_report(path: str | Path) -> dict[str, Any]:
    """Read a JSON report (not yet validated, but no deeper than a report nests: see
    :func:`expect_shallow`); problems raise :class:`ReportError` naming it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ReportError("$", f"{path}: cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ReportError("$", f"{path}: not UTF-8 text") from exc
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReportError("$", f"{path}: not JSON: {exc}") from exc
    except RecursionError as exc:  # the parser recurses per level: [[[[...]]]]
        raise ReportError("$", f"{path}: not a report: JSON nested too deeply to "
                          "read") from exc
    if not isinstance(obj, dict):
        raise ReportError("$", f"{path}: expected a JSON object, got {type(obj).__name__}")
    try:
        expect_shallow(obj)
    except ReportError as exc:
        raise ReportError(exc.path, f"{path}: {exc.message}") from exc
    return obj
