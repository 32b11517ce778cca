"""``kvconform``: show, validate, merge and diff qualification reports, render their pages
(``html``, and ``--html`` of ``merge`` and ``diff``),
validate expected-failures files, run the suite (``run``), the release matrix (``matrix``),
the GPU checks (``gpu-check``, which imports its layer when called) and the suite's
self-test on the installed stack (``selftest``, which imports it when called).

Exit codes: 0 success, 1 a check or gate that failed (``run``, ``gpu-check``; ``diff``: a new
failure; ``matrix``: a leg not qualified; ``selftest``: a seedable fault not caught), 2 a
bad file, an unmergeable set of reports, a usage error, an interrupted ``matrix`` or
``selftest``, or a subcommand that is not available (``gpu-check`` on a host without CUDA
or vLLM's compiled kernels).  Every error is one line on stderr naming the file or the host
it is about.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pytest_kvconform.contract import inert
from pytest_kvconform.report.build import (
    MATRIX_SCHEMA,
    SCHEMA,
    ReportError,
    check_mergeable,
    check_pair,
    is_matrix,
    load_report,
    page_path,
    render_markdown,
    render_matrix_markdown,
    render_merged_markdown,
    report_paths,
    validate_matrix,
    validate_report,
)

EXIT_OK = 0
EXIT_GATE = 1
EXIT_BAD_INPUT = 2


def _error(message: str) -> int:
    print(inert.terminal(f"kvconform: error: {message}"), file=sys.stderr)
    return EXIT_BAD_INPUT


def _out(text: str) -> None:
    """Text built from reports, to stdout: a report from anywhere cannot drive the terminal
    (:mod:`~pytest_kvconform.contract.inert`)."""
    sys.stdout.write(inert.terminal(text))


def _load_valid(path: str) -> dict[str, Any]:
    """Load and validate one report; errors name the file (via :class:`ReportError`)."""
    report = load_report(path)
    if report.get("schema") != SCHEMA:
        raise ReportError(
            "$.schema", f"{path}: unsupported schema {report.get('schema')!r} (expected {SCHEMA!r})"
        )
    try:
        validate_report(report)
    except ReportError as exc:
        raise ReportError(exc.path, f"{path}: {exc.path}: {exc.message}") from exc
    return report


def _load_matrix(path: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """A combined matrix report and its legs' reports (by leg name), all validated; a leg
    report is read next to the combined one, where the matrix wrote it."""
    matrix = load_report(path)
    if matrix.get("schema") != MATRIX_SCHEMA:
        raise ReportError("$.schema", f"{path}: unsupported schema {matrix.get('schema')!r} "
                          f"(expected {MATRIX_SCHEMA!r})")
    _named(path, validate_matrix, matrix)
    reports = {}
    for leg in matrix["legs"]:
        if leg["report"] is not None:
            leg_path = str(Path(path).parent / leg["report"])
            reports[leg["name"]] = _load_valid(leg_path)  # its errors name the leg's file
            check_pair(leg_path)
    _named(path, validate_matrix, matrix, reports)
    return matrix, reports


def _named(path: str, check: Any, *args: Any) -> None:
    """``check(*args)``, its :class:`ReportError` naming ``path``."""
    try:
        check(*args)
    except ReportError as exc:
        raise ReportError(exc.path, f"{path}: {exc.path}: {exc.message}") from exc


def _cmd_show(args: argparse.Namespace) -> int:
    try:
        if is_matrix(load_report(args.report)):
            _out(render_matrix_markdown(_load_matrix(args.report)[0]))
        else:
            _out(render_markdown(_load_valid(args.report)))
    except ReportError as exc:
        return _error(exc.message)
    return EXIT_OK


def _cmd_validate(args: argparse.Namespace) -> int:
    for path in args.reports:
        if path.endswith(".toml"):  # an expected-failures file (--kv-xfails)
            from pytest_kvconform.session import xfails

            try:
                found = xfails.load_findings_file(path)
            except xfails.XfailFileError as exc:
                return _error(str(exc))
            known_on = (f", known on {xfails.describe_conditions(found.known_on)}"
                        if found.known_on else "")
            print(f"{path}: valid (expected failures: {len(found.entries)} entries{known_on})")
            continue
        try:
            if is_matrix(load_report(path)):
                _, reports = _load_matrix(path)
                schema = f"{MATRIX_SCHEMA}, {len(reports)} leg report(s) of {SCHEMA}"
            else:
                _load_valid(path)
                schema = SCHEMA
            check_pair(path)  # the Markdown next to it, if any, is of the same run
        except ReportError as exc:
            return _error(exc.message)
        print(f"{path}: valid ({schema})")
    return EXIT_OK


def _cmd_diff(args: argparse.Namespace) -> int:
    """B against A; exit 1 when B has a failure A does not (the CI gate)."""
    from pytest_kvconform.report.diff import (
        diff_matrices,
        diff_reports,
        render_diff,
        render_matrix_diff,
    )

    try:
        kinds = [is_matrix(load_report(path)) for path in (args.a, args.b)]
        if kinds[0] != kinds[1]:
            which = args.a if kinds[0] else args.b
            raise ReportError("$.schema", f"{which} is a combined matrix report and the other a "
                              "single report: diff two of a kind (a leg's report is "
                              "OUT/<leg>.json)")
        if kinds[0]:
            (a, reports_a), (b, reports_b) = _load_matrix(args.a), _load_matrix(args.b)
            found = diff_matrices(a, b, reports_a, reports_b)
            _out(render_matrix_diff(found, args.a, args.b))
            code = _diff_page(args, found)
            return code if code != EXIT_OK else EXIT_GATE if found.new_failures else EXIT_OK
        a, b = _load_valid(args.a), _load_valid(args.b)
    except ReportError as exc:
        return _error(exc.message)
    single = diff_reports(a, b)
    _out(render_diff(single, args.a, a, args.b, b))
    code = _diff_page(args, single, a, b)
    return code if code != EXIT_OK else EXIT_GATE if single.new_failures else EXIT_OK


def _relative_page(report: str, out: Path) -> str | None:
    """The page of ``report`` (next to it), as a link from a page written to ``out``; None
    when it has none."""
    page = page_path(report)
    return os.path.relpath(page, out.resolve().parent) if page.is_file() else None


def _write_page(out: Path, text: str) -> int:
    from pytest_kvconform.report.html import write_html

    try:
        write_html(out, text)
    except OSError as exc:
        return _error(f"{out}: cannot write: {exc.strerror or exc}")
    print(f"kvconform: page written to {out}", file=sys.stderr)
    return EXIT_OK


def _diff_page(args: argparse.Namespace, found: Any, a: dict[str, Any] | None = None,
               b: dict[str, Any] | None = None) -> int:
    """``--html``: the diff's page (each changed result linking into B's page, if B has one)."""
    if args.html is None:
        return EXIT_OK
    from pytest_kvconform.report.html import render_diff_html

    out = Path(args.html)
    b_page = _relative_page(args.b, out) if b is not None else None
    return _write_page(out, render_diff_html(found, args.a, args.b, a=a, b=b, b_page=b_page))


def _cmd_html(args: argparse.Namespace) -> int:
    """A report's page, or a matrix's (its folder or ``matrix.json``) with each leg's."""
    from pytest_kvconform.report.html import render_matrix_html, render_report_html, write_html

    source = Path(args.report)
    if source.is_dir():
        source = source / "matrix.json"
    try:
        if is_matrix(load_report(source)):
            matrix, reports = _load_matrix(str(source))
            out = Path(args.output) if args.output else page_path(source)
            for leg in matrix["legs"]:
                if leg["name"] in reports:
                    leg_json = source.parent / leg["report"]
                    try:
                        write_html(page_path(leg_json), render_report_html(
                            reports[leg["name"]], leg_json.name))
                    except OSError as exc:
                        return _error(f"{page_path(leg_json)}: cannot write: "
                                      f"{exc.strerror or exc}")
            return _write_page(out, render_matrix_html(matrix, reports))
        report = _load_valid(str(source))
    except ReportError as exc:
        return _error(exc.message)
    out = Path(args.output) if args.output else page_path(source)
    return _write_page(out, render_report_html(report, source.name))


def _cmd_matrix(args: argparse.Namespace) -> int:
    """Every leg of tox.ini's matrix label; exit 0 only when every leg qualified."""
    from pytest_kvconform.crossversion.release_matrix import MatrixUsageError, ToxError, run_matrix

    known: dict[str, Any] = {} if args.xfails is None else \
        {"xfails": args.xfails if args.xfails in ("auto", "none") else
         Path(args.xfails).resolve()}
    try:
        matrix = run_matrix(root=Path(args.root).resolve(), out=Path(args.out).resolve(),
                            legs=args.leg, tox=args.tox.split(), timeout=args.timeout,
                            extra=args.extra, **known)
    except (MatrixUsageError, ToxError) as exc:
        return _error(str(exc))
    except KeyboardInterrupt:
        print(f"kvconform: matrix interrupted; what finished is in {args.out}", file=sys.stderr)
        return EXIT_BAD_INPUT
    from pytest_kvconform.report.matrix import verdict_line

    print(f"kvconform: matrix verdict: {verdict_line(matrix)}")
    print(f"kvconform: combined report: {Path(args.out) / 'matrix.json'} (and .md)")
    return EXIT_OK if matrix["verdict"] == "qualified" else EXIT_GATE


def _cmd_release_table(args: argparse.Namespace) -> int:
    """The clone's release table and README's "Supported stacks" from a matrix run."""
    from pytest_kvconform.crossversion.release_record import ReleaseRecordError, write_record
    from pytest_kvconform.report import release_table

    try:
        matrix, _ = _load_matrix(args.matrix)
        table = write_record(Path(args.root).resolve(), matrix)
    except ReportError as exc:
        return _error(exc.message)
    except ReleaseRecordError as exc:
        return _error(str(exc))
    for row in table["legs"]:
        print(f"kvconform: release table: {row['leg']}: {release_table.status(row)}")
    print(f"kvconform: wrote {Path(args.root) / 'pytest_kvconform' / 'release_table.json'} and "
          f"README.md's supported stacks")
    return EXIT_OK


def _cmd_merge(args: argparse.Namespace) -> int:
    try:
        named = [(path, load_report(path)) for path in args.reports]
        check_mergeable(named)  # before validation: a foreign schema gets the clearer message
        named = [(path, _load_valid(path)) for path in args.reports]
        text = inert.terminal(render_merged_markdown(named))
    except ReportError as exc:
        return _error(exc.message)
    if args.html is not None:
        from pytest_kvconform.report.html import render_merged_html

        out = Path(args.html)
        pages = {path: page for path in args.reports
                 if (page := _relative_page(path, out)) is not None}
        code = _write_page(out, render_merged_html(named, pages))
        if code != EXIT_OK:
            return code
    if args.output is None:
        _out(text)
        return EXIT_OK
    try:
        Path(args.output).write_text(text, encoding="utf-8")
    except OSError as exc:
        return _error(f"{args.output}: cannot write: {exc.strerror or exc}")
    print(f"kvconform: merged {len(named)} reports into {args.output}")
    return EXIT_OK


def _cmd_run(args: argparse.Namespace) -> int:
    """Run the suite in this process and print the report's Markdown.

    A convenience front-end for release engineers: the same checks and report
    as ``pytest --kv-conformance --kv-report PATH``; extra arguments go to pytest.
    With ``--report PATH`` the report is kept there (a ``.md`` path keeps the JSON
    next to it); without, it is printed and none is kept, and the last line says so.
    """
    import pytest

    if args.report:
        code = int(pytest.main(["--kv-conformance", "-q", "--kv-report", args.report,
                                *args.extra]))
        json_path, _ = report_paths(args.report)
        if json_path.is_file():
            try:
                _out(render_markdown(load_report(json_path)) + "\n")
            except ReportError as exc:
                _error(exc.message)
        else:
            print(f"kvconform: no report was written to {args.report} (see the errors above)")
        return code
    grab = _GrabReport()
    code = int(pytest.main(["--kv-conformance", "-q", *args.extra], plugins=[grab]))
    if grab.report is not None:
        _out(render_markdown(grab.report) + "\n")
    print("kvconform: no report file kept (pass --report PATH to keep one)")
    return code


def _cmd_gpu_check(args: argparse.Namespace) -> int:
    """KV-A6, KV-L7 and xdist pinning on this CUDA host; OUT/REPORT.md and JSON."""
    from pytest_kvconform.gpu import check, host
    from pytest_kvconform.gpu.check_verdicts import Verdict

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return _error(f"gpu-check: {out}: not a directory")
    try:
        gpus = host.probe()
    except host.Refused as exc:
        return _error(f"gpu-check: {exc}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return _error(f"gpu-check: {out}: cannot create: {exc.strerror or exc}")
    record = check.run(out.resolve(), memory_fraction=args.memory_fraction, gpus=gpus)
    return EXIT_OK if record["verdict"] == Verdict.OK else 1


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in (0, 1]")
    return value


class _GrabReport:
    """A pytest plugin object: asks the session for its report and keeps it in memory."""

    report: dict[str, Any] | None = None

    def pytest_configure(self, config: Any) -> None:
        from pytest_kvconform.plugin import SESSION_PLUGIN

        session = config.pluginmanager.get_plugin(SESSION_PLUGIN)
        if session is not None:
            session.report_wanted = True

    def pytest_unconfigure(self, config: Any) -> None:
        from pytest_kvconform.plugin import SESSION_PLUGIN

        session = config.pluginmanager.get_plugin(SESSION_PLUGIN)
        self.report = getattr(session, "built_report", None)


def _cmd_selftest(args: argparse.Namespace) -> int:
    """Seed each known production fault in a fresh process and check the suite catches it
    (``pytest_kvconform/selftest/``); the account on stdout, progress on stderr."""
    from pytest_kvconform.faults import registry as fault_registry

    try:
        faults = fault_registry.select(args.fault)
    except ValueError as exc:
        return _error(f"selftest: {exc}")
    if args.list:
        for fault in faults:
            print(f"{fault.name:<30} {fault.family:<10} {fault.how:<7} "
                  f"[{', '.join(fault.clauses)}] on {fault.backend or 'no backend'}: "
                  f"{fault.what}")
        return EXIT_OK
    if args.jobs < 1:
        return _error(f"selftest: --jobs {args.jobs}: expected 1 or more")
    if args.json is not None:
        parent = Path(args.json).resolve().parent
        if Path(args.json).is_dir() or not parent.is_dir():
            return _error(f"{args.json}: cannot write the selftest's JSON there (a directory, "
                          "or its parent is missing)")
    from pytest_kvconform.selftest import catches, runner

    try:
        found = runner.run([f.name for f in faults], jobs=args.jobs, timeout=args.timeout,
                             progress=lambda line: print(f"kvconform selftest: {line}",
                                                         file=sys.stderr, flush=True))
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: its processes are gone already
        print(f"kvconform selftest: interrupted ({type(exc).__name__}); no verdict",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    sys.stdout.write(catches.render(found))
    if args.json is not None:
        import json

        try:
            Path(args.json).write_text(json.dumps(catches.as_json(found), indent=1) + "\n",
                                       encoding="utf-8")
        except OSError as exc:
            return _error(f"{args.json}: cannot write: {exc.strerror or exc}")
    return found.exit_code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvconform", description="pytest-kvconform qualification reports"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    show = sub.add_parser("show", help="print a JSON report as Markdown")
    show.add_argument("report")
    show.set_defaults(func=_cmd_show)

    validate = sub.add_parser("validate", help="check reports (and expected-failures files, "
                              "*.toml) against their schema")
    validate.add_argument("reports", nargs="+", metavar="REPORT|XFAILS.toml")
    validate.set_defaults(func=_cmd_validate)

    merge = sub.add_parser("merge", help="merge reports from several hosts into one matrix")
    merge.add_argument("reports", nargs="+", metavar="REPORT")
    merge.add_argument("-o", "--output", help="Markdown file to write (default: stdout)")
    merge.add_argument("--html", metavar="PAGE", help="also write the merged matrix's page "
                       "(each host's rows linking to its report's page, where it has one)")
    merge.set_defaults(func=_cmd_merge)

    diff = sub.add_parser("diff", help="what changed from report A to report B (two reports, or "
                          "two combined matrix reports); exit 1 on a new failure")
    diff.add_argument("a", metavar="A")
    diff.add_argument("b", metavar="B")
    diff.add_argument("--html", metavar="PAGE", help="also write the diff's page (each changed "
                      "result linking into B's page, where B has one)")
    diff.set_defaults(func=_cmd_diff)

    html = sub.add_parser("html", help="write the page of a report, or of a release matrix (its "
                          "folder or matrix.json: the matrix's page and each leg's)")
    html.add_argument("report", metavar="REPORT|MATRIX|DIR")
    html.add_argument("-o", "--output", metavar="PAGE", help="where to write the page "
                      "(default: next to the JSON, .html)")
    html.set_defaults(func=_cmd_html)

    matrix = sub.add_parser("matrix", help="the strict suite in every environment of tox.ini's "
                            "matrix label, one report per leg and a combined one; other "
                            "arguments go to pytest")
    matrix.add_argument("-o", "--out", default="matrix", help="directory for the reports and "
                        "logs (default: ./matrix)")
    matrix.add_argument("--leg", action="append", default=[], help="run only this leg "
                        "(repeatable; default: every leg)")
    matrix.add_argument("--root", default=".", help="the clone holding tox.ini (default: .)")
    matrix.add_argument("--tox", default="tox", help="the tox command (default: tox)")
    matrix.add_argument("--xfails", help="known findings for every leg, as --kv-xfails takes "
                        "them (default: auto, the file shipped for each leg's stack; 'none' for "
                        "none)")
    matrix.add_argument("--timeout", type=float, help="seconds each tox step may take")
    matrix.set_defaults(func=_cmd_matrix)  # takes pytest's arguments too: see main()

    table = sub.add_parser("release-table", help="from a matrix run's combined report, "
                           "rewrite the clone's release table (pytest_kvconform/"
                           "release_table.json) and README's supported stacks")
    table.add_argument("matrix", metavar="MATRIX.json", help="OUT/matrix.json of "
                       "`kvconform matrix -o OUT` (its legs' reports beside it)")
    table.add_argument("--root", default=".", help="the clone (default: .)")
    table.set_defaults(func=_cmd_release_table)

    run = sub.add_parser("run", help="run the suite and print the report; other arguments "
                         "go to pytest (e.g. --kv-backend NAME, -n 2)")
    run.add_argument("--report", help="keep the JSON report (and .md) at this path; a path "
                     "ending in .md keeps the Markdown there and the JSON next to it")
    run.set_defaults(func=_cmd_run)  # takes any arguments: see main()

    gpu = sub.add_parser("gpu-check", help="on a CUDA host with vLLM installed: KV-A6, KV-L7 "
                         "(paged stand-ins and native backends) and xdist -n auto pinning "
                         "against the installed stack; writes OUT/REPORT.md and "
                         "OUT/gpu-check.json")
    gpu.add_argument("out", nargs="?", default="kvconform-gpu-check", metavar="OUT",
                     help="output directory (default: ./kvconform-gpu-check)")
    gpu.add_argument("--memory-fraction", type=_fraction, default=0.5, metavar="F",
                     help="share of GPU 0's free memory KV-A6 allocates (default 0.5)")
    gpu.set_defaults(func=_cmd_gpu_check)

    selftest = sub.add_parser("selftest", help="seed each known production fault into the "
                              "installed stack and check that the suite catches it; exit 1 "
                              "if a seedable fault is not caught")
    selftest.add_argument("--fault", action="append", metavar="NAME",
                          help="seed only this fault (repeatable; --list names them)")
    selftest.add_argument("--list", action="store_true", help="list the faults and exit")
    selftest.add_argument("--jobs", "-j", type=int, default=2, metavar="N",
                          help="faults run at once, each in its own process (default 2)")
    selftest.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                          help="time limit of one fault's run (default 600)")
    selftest.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    selftest.set_defaults(func=_cmd_selftest)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point; returns the exit code instead of raising SystemExit."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra and args.command not in ("run", "matrix"):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help or a usage error, already printed by argparse
        return exc.code if isinstance(exc.code, int) else EXIT_BAD_INPUT
    args.extra = extra
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
