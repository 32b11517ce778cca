"""The qualification report: build, verdict, schema check, JSON/Markdown/terminal output, merge.

Stdlib only (nothing here imports pytest, torch or vllm), so ``kvconform show`` and
``kvconform merge`` run on a machine without the serving stack.

A result is a dict with keys ``nodeid, backend, clause, case, layout, device,
status, reason, duration_s`` plus optional ``skip_kind`` (a
:class:`~pytest_kvconform.checks.errors.SkipKind` value) and ``xfail`` (the
``describe()`` id of the xfail entry applied).  ``backend`` is None for
upstream (per layout/case) tests; the matrices show those in a ``(upstream)`` row.

A status ``error`` result may carry ``error_kind`` (``worker-died``, ``timeout``,
``oom``, ``harness``): the harness failed there, not the backend.

Results alone (:func:`compute_verdict`):

* non-strict: qualified iff at least one result ran and none failed or errored
  (an xpass or a skip does not disqualify);
* strict (``--kv-strict``): additionally every xpass disqualifies, and every
  skip unless the clause table forgives its kind for its clause
  (:func:`pytest_kvconform.clauses.skip_forgiven`) or an xfails entry declares it
  (``xfail`` on the result).

The report's verdict (:func:`judge`) also needs the whole matrix to have run: the
``selection`` record (``-k``, ``-m``, narrowed paths, backends left out by
``--kv-backend``, suite tests collected / selected / deselected) and the ``run``
record (``interruption``).  A run that was interrupted, or in which a selected
test has no result, is ``interrupted``; a run that left any part of the matrix
out is ``partial``; a failure or error makes it ``not qualified`` (interrupted
still wins: nothing about an unfinished run is certified).

Clauses with a hardware skip are listed as ``uncovered`` in both modes.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import socket
import uuid
from collections.abc import Iterable, Mapping, Sequence
from enum import Enum
from pathlib import Path, PurePath
from typing import Any

from pytest_kvconform import CONTRACT_VERSION, clauses
from pytest_kvconform.clauses import CLAUSE_RE, clause_sort_key, skip_forgiven
from pytest_kvconform.devices import nvidia_smi
from pytest_kvconform.model import installed_version
from pytest_kvconform.outcomes import ErrorKind, SkipKind

SCHEMA = "pytest-kvconform/report/1"
STATUSES = ("passed", "failed", "skipped", "xfailed", "xpassed", "error")
SKIP_KINDS = tuple(k.value for k in SkipKind)
ERROR_KINDS = tuple(k.value for k in ErrorKind)
VERDICTS = ("qualified", "not qualified", "partial", "interrupted")
UPSTREAM_ROW = "(upstream)"

# Worst first: the status a matrix cell shows when it aggregates several tests.
_SEVERITY = ("failed", "error", "xpassed", "skipped", "xfailed", "passed")
_CELL_WORD = {
    "passed": "pass",
    "failed": "fail",
    "skipped": "skip",
    "xfailed": "xfail",
    "xpassed": "xpass",
    "error": "error",
}
_CELL_CHAR = {
    "passed": ".",
    "failed": "F",
    "skipped": "s",
    "xfailed": "x",
    "xpassed": "X",
    "error": "E",
}

_TOP_KEYS = (
    "schema", "contract", "run", "environment", "selection", "backends", "results", "summary",
    "verdict", "uncovered",
)
_RUN_KEYS = ("id", "started", "duration_s", "interruption")
_SELECTION_KEYS = (
    "keyword", "markexpr", "paths", "backends", "excluded_backends", "collected", "selected",
    "deselected",
)
_ENV_KEYS = (
    "python", "torch", "vllm", "vllm_omni", "platform", "devices", "host", "options", "seed",
)
_DEVICE_KEYS = ("name", "memory_bytes", "driver", "cuda")
_BACKEND_KEYS = ("name", "path", "source", "overridden", "importable", "reason")
# origin: "in-tree", or the distribution / entry point whose plugin re-pointed the member.
_BACKEND_OPTIONAL_KEYS = ("origin",)
# plugins: what loading vLLM / vllm-omni plugins did (omni_plugins.PluginLoad.as_dict()).
_ENV_OPTIONAL_KEYS = ("plugins",)
_RESULT_KEYS = (
    "nodeid", "backend", "clause", "case", "layout", "device", "status", "reason", "duration_s",
)
_RESULT_OPTIONAL_KEYS = ("skip_kind", "xfail", "error_kind")
_SUMMARY_KEYS = ("strict", "total", "by_status", "by_clause", "blocking")


class ReportError(ValueError):
    """A report that does not follow the schema; ``path`` is a JSON path like ``$.results[3]``."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}")


# --------------------------------------------------------------------------- environment


def environment_info(options: Mapping[str, Any], seed: int | None) -> dict[str, Any]:
    """Versions, host and devices of this machine, probed without importing torch or vllm.

    Importing the serving stack takes tens of seconds and may initialise CUDA;
    the report only needs distribution metadata and ``nvidia-smi``.
    """
    return {
        "python": platform.python_version(),
        "torch": installed_version("torch"),
        "vllm": installed_version("vllm"),
        "vllm_omni": installed_version("vllm-omni"),
        "platform": platform.platform(),
        "devices": _probe_devices(),
        "host": socket.gethostname(),
        "options": _jsonable(dict(sorted(options.items()))),
        "seed": seed,
    }


def _probe_devices() -> list[dict[str, Any]]:
    gpus = _nvidia_gpus()
    if gpus:
        return gpus
    return [{"name": "cpu", "memory_bytes": _host_memory_bytes(), "driver": None, "cuda": None}]


def _nvidia_gpus() -> list[dict[str, Any]]:
    """GPUs as ``nvidia-smi`` lists them; empty when it is absent, fails or hangs."""
    listing = nvidia_smi("--query-gpu=name,memory.total,driver_version",
                         "--format=csv,noheader,nounits")
    if listing is None:
        return []
    header = nvidia_smi() or ""
    m = re.search(r"CUDA Version:\s*([0-9.]+)", header)
    cuda = m.group(1) if m else None
    gpus = []
    for line in listing.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 3 or not fields[0]:
            continue
        name, mib, driver = fields
        try:
            memory: int | None = int(float(mib)) * 1024 * 1024
        except ValueError:
            memory = None
        gpus.append({"name": name, "memory_bytes": memory, "driver": driver or None, "cuda": cuda})
    return gpus


def _host_memory_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


# --------------------------------------------------------------------------- build + verdict


def _result_sort_key(result: Mapping[str, Any]) -> tuple[str, ...]:
    keys = ("nodeid", "backend", "clause", "case", "layout")
    return tuple(str(result.get(k) or "") for k in keys)


# Every kind some clause forgives (the table says which clause forgives which).
FORGIVEN_SKIP_KINDS = tuple(sorted(k.value for k in clauses.FORGIVEN_SKIP_KINDS))


def _blocks(result: Mapping[str, Any], strict: bool) -> bool:
    status = result.get("status")
    if status in ("failed", "error"):
        return True
    if not strict:
        return False
    if status == "xpassed":
        return True
    # Forgiven in strict mode: a skip the clause table forgives for its clause
    # (missing hardware, a clause that does not apply), and a skip the
    # expected-failures file declares (``xfail``).
    return (status == "skipped"
            and not skip_forgiven(str(result.get("clause")), result.get("skip_kind"))
            and not result.get("xfail"))


def compute_verdict(
    results: Iterable[Mapping[str, Any]], strict: bool
) -> tuple[str, list[str]]:
    """``("qualified" | "not qualified", uncovered clauses)``; see the module docstring.

    An empty run is never qualified: nothing was checked.
    """
    results = list(results)
    qualified = bool(results) and not any(_blocks(r, strict) for r in results)
    uncovered = {
        r["clause"]
        for r in results
        if r.get("status") == "skipped" and r.get("skip_kind") == "hardware"
    }
    return ("qualified" if qualified else "not qualified"), sorted(uncovered, key=clause_sort_key)


def summarize(results: Sequence[Mapping[str, Any]], strict: bool) -> dict[str, Any]:
    """Counts per status and per clause, plus the nodeids that block qualification."""
    by_status = dict.fromkeys(STATUSES, 0)
    by_clause: dict[str, dict[str, int]] = {}
    for r in results:
        by_status[r["status"]] += 1
        by_clause.setdefault(r["clause"], dict.fromkeys(STATUSES, 0))[r["status"]] += 1
    return {
        "strict": strict,
        "total": len(results),
        "by_status": by_status,
        "by_clause": {c: by_clause[c] for c in sorted(by_clause, key=clause_sort_key)},
        "blocking": [r["nodeid"] for r in results if _blocks(r, strict)],
    }


def run_record(
    *, run_id: str | None = None, started: str | None = None, duration_s: float = 0.0,
    interruption: str | None = None,
) -> dict[str, Any]:
    """Identity and end of one run: ``merge`` tells two runs on one host apart by ``id``."""
    return {
        "id": run_id or uuid.uuid4().hex,
        "started": started or now_iso(),
        "duration_s": round(float(duration_s), 3),
        "interruption": interruption,
    }


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def selection_record(
    *, keyword: str | None = None, markexpr: str | None = None, paths: Iterable[str] = (),
    backends: Iterable[str] = (), excluded_backends: Iterable[str] = (),
    collected: int | None = None, selected: int | None = None,
) -> dict[str, Any]:
    """What part of the matrix a run selected; ``collected`` counts suite tests before
    ``-k`` / ``-m`` / ``--deselect``, ``selected`` after (None: not known)."""
    deselected = None if collected is None or selected is None else collected - selected
    return {
        "keyword": keyword or None,
        "markexpr": markexpr or None,
        "paths": [str(p) for p in paths],
        "backends": list(backends),
        "excluded_backends": sorted(excluded_backends),
        "collected": collected,
        "selected": selected,
        "deselected": deselected,
    }


def ran_count(results: Iterable[Mapping[str, Any]]) -> int:
    """Suite tests with at least one result (a test may have a call and a teardown row)."""
    return len({r["nodeid"] for r in results})


def left_out(selection: Mapping[str, Any] | None) -> list[str]:
    """What the selection left out of the full matrix, one phrase each; empty when complete."""
    if selection is None:
        return ["the selection was not recorded"]
    notes = []
    collected, deselected = selection["collected"], selection["deselected"]
    filters = [f"-k {selection['keyword']!r}" if selection["keyword"] else "",
               f"-m {selection['markexpr']!r}" if selection["markexpr"] else ""]
    how = " and ".join(f for f in filters if f) or "deselection (--deselect, --lf or a plugin)"
    if collected is None or selection["selected"] is None:
        notes.append("the number of suite tests collected was not reported")
    elif deselected:
        notes.append(f"{how} deselected {deselected} of {collected} suite tests")
    elif selection["keyword"] or selection["markexpr"]:
        notes.append(f"{how} given (deselected none, but the selection is filtered)")
    if selection["paths"]:
        notes.append("collection narrowed to " + ", ".join(selection["paths"]))
    excluded = selection["excluded_backends"]
    if excluded:
        notes.append(f"--kv-backend left out {len(excluded)} backend(s): {', '.join(excluded)}")
    return notes


def interruption_of(run: Mapping[str, Any], selection: Mapping[str, Any] | None,
                    results: Sequence[Mapping[str, Any]]) -> str | None:
    """Why the run did not finish: recorded, or selected tests without a result."""
    if run.get("interruption"):
        return str(run["interruption"])
    selected = selection.get("selected") if selection is not None else None
    if selected is not None:
        ran = ran_count(results)
        if ran < selected:
            return f"{selected - ran} of {selected} selected suite tests did not run"
    return None


def judge(
    results: Sequence[Mapping[str, Any]], strict: bool, selection: Mapping[str, Any] | None,
    run: Mapping[str, Any],
) -> tuple[str, list[str]]:
    """The report's verdict and uncovered clauses: results, completeness, interruption.

    ``interrupted`` > ``not qualified`` > ``partial`` > ``qualified``.
    """
    verdict, uncovered = compute_verdict(results, strict)
    if interruption_of(run, selection, results):
        verdict = "interrupted"
    elif verdict == "qualified" and left_out(selection):
        verdict = "partial"
    return verdict, uncovered


def verdict_text(verdict: str, uncovered: Sequence[str], selection: Mapping[str, Any] | None,
                 run: Mapping[str, Any], results: Sequence[Mapping[str, Any]]) -> str:
    """One line: the verdict and what it rests on (what was left out, why it stopped)."""
    notes = []
    if verdict == "interrupted":
        notes.append(f"interrupted: {interruption_of(run, selection, results)}")
    missing = left_out(selection)
    if missing and verdict != "qualified":
        notes.append("left out: " + "; ".join(missing))
    if uncovered:
        notes.append(f"hardware could not cover: {', '.join(uncovered)}")
    errors = sorted({r.get("error_kind") or "harness" for r in results
                     if r.get("status") == "error"})
    if errors:
        notes.append(f"harness errors ({', '.join(errors)}), not blamed on any backend")
    return verdict + (f" ({'; '.join(notes)})" if notes else "")


def build_report(
    *,
    environment: Mapping[str, Any],
    backends: Iterable[Any],
    results: Iterable[Mapping[str, Any]],
    options: Mapping[str, Any],
    strict: bool,
    selection: Mapping[str, Any] | None = None,
    run: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A validated report; results sorted by nodeid so ``-n 2`` and ``-n 0`` agree.

    ``backends`` are :class:`~pytest_kvconform.model.BackendUnderTest` records or
    dicts with the schema's keys.  ``options`` replaces ``environment["options"]``
    (the plugin knows its final options only after configuration).  Without a
    ``selection`` (see :func:`selection_record`) the verdict is at best ``partial``;
    without a ``run`` (see :func:`run_record`) a fresh run id is made.
    """
    env = _jsonable(dict(environment))
    env["options"] = _jsonable(dict(sorted(options.items())))
    rows = sorted((_normalise_result(r) for r in results), key=_result_sort_key)
    run_rec = _jsonable(dict(run)) if run is not None else run_record()
    sel = _jsonable(dict(selection)) if selection is not None else None
    verdict, uncovered = judge(rows, strict, sel, run_rec)
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
    }
    validate_report(report)
    return report


def _normalise_result(result: Mapping[str, Any]) -> dict[str, Any]:
    row = {k: _jsonable(result.get(k)) for k in _RESULT_KEYS + _RESULT_OPTIONAL_KEYS}
    if row["duration_s"] is None:
        row["duration_s"] = 0.0
    extra = sorted(set(result) - set(row))
    if extra:  # kept so that validation names the stray key instead of dropping it
        row.update({k: _jsonable(result[k]) for k in extra})
    return row


def _backend_record(backend: Any) -> dict[str, Any]:
    if isinstance(backend, Mapping):
        return _jsonable(dict(backend))
    record: dict[str, Any] = backend.record()
    if record["origin"] is None:  # optional: only plugin-provided backends name one
        del record["origin"]
    return record


def _jsonable(value: Any) -> Any:
    """Plain JSON values: paths and enums as strings, tuples as lists, str keys."""
    if isinstance(value, Enum):
        return _jsonable(value.value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_jsonable(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    return str(value)


# --------------------------------------------------------------------------- validation


def validate_report(obj: Any) -> None:
    """Raise :class:`ReportError` naming the JSON path of the first schema problem.

    Besides shapes and types, the summary, verdict and uncovered list must
    agree with the results, the selection and the run: a hand-edited verdict,
    or a "qualified" for a partial or interrupted run, is caught here.  Every
    number must be finite (JSON has no NaN; Python's json module writes one).
    """
    key: Any  # a backend's key (str), then a result's sort key (tuple)
    _expect_keys(obj, "$", _TOP_KEYS)
    if obj["schema"] != SCHEMA:
        raise ReportError("$.schema", f"expected {SCHEMA!r}, got {obj['schema']!r}")
    _expect_finite(obj, "$")
    _expect_type(obj["contract"], "$.contract", str)
    _validate_run(obj["run"])
    _validate_environment(obj["environment"])
    _validate_selection(obj["selection"])
    _expect_type(obj["backends"], "$.backends", list)
    for i, backend in enumerate(obj["backends"]):
        where = f"$.backends[{i}]"
        _expect_keys(backend, where, _BACKEND_KEYS, _BACKEND_OPTIONAL_KEYS)
        _expect_type(backend.get("origin"), f"{where}.origin", str, none=True)
        for key in ("name", "path", "source"):
            _expect_type(backend[key], f"{where}.{key}", str)
        for key in ("overridden", "importable"):
            _expect_type(backend[key], f"{where}.{key}", bool)
        _expect_type(backend["reason"], f"{where}.reason", str, none=True)
    _expect_type(obj["results"], "$.results", list)
    previous: tuple[str, ...] | None = None
    for i, result in enumerate(obj["results"]):
        _validate_result(result, f"$.results[{i}]")
        sort_key = _result_sort_key(result)
        if previous is not None and sort_key < previous:
            raise ReportError(f"$.results[{i}]", "results are not sorted by nodeid")
        previous = sort_key
    selected = (obj["selection"] or {}).get("selected")
    if selected is not None and ran_count(obj["results"]) > selected:
        raise ReportError("$.selection.selected", f"{selected} tests selected but "
                          f"{ran_count(obj['results'])} have results")
    _validate_summary(obj["summary"])
    strict = obj["summary"]["strict"]
    if obj["summary"] != summarize(obj["results"], strict):
        raise ReportError("$.summary", "does not match the results")
    if obj["verdict"] not in VERDICTS:
        raise ReportError("$.verdict", f"expected one of {VERDICTS}, got {obj['verdict']!r}")
    verdict, uncovered = judge(obj["results"], strict, obj["selection"], obj["run"])
    if obj["verdict"] != verdict:
        mode = "strict" if strict else "non-strict"
        why = verdict_text(verdict, [], obj["selection"], obj["run"], obj["results"])
        raise ReportError("$.verdict", f"{obj['verdict']!r} but the results give {verdict!r} "
                                       f"({mode})" + (f": {why}" if why != verdict else ""))
    _expect_type(obj["uncovered"], "$.uncovered", list)
    if obj["uncovered"] != uncovered:
        raise ReportError("$.uncovered", f"expected {uncovered}, got {obj['uncovered']!r}")


def _expect_finite(value: Any, where: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ReportError(where, f"expected a finite number, got {value!r}")
    if isinstance(value, dict):
        for key, item in value.items():
            _expect_finite(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _expect_finite(item, f"{where}[{i}]")


def _validate_run(run: Any) -> None:
    _expect_keys(run, "$.run", _RUN_KEYS)
    for key in ("id", "started"):
        _expect_type(run[key], f"$.run.{key}", str)
        if not run[key]:
            raise ReportError(f"$.run.{key}", "must not be empty")
    _expect_number(run["duration_s"], "$.run.duration_s")
    _expect_type(run["interruption"], "$.run.interruption", str, none=True)


def _validate_selection(selection: Any) -> None:
    if selection is None:  # not recorded: the verdict is at best partial
        return
    where = "$.selection"
    _expect_keys(selection, where, _SELECTION_KEYS)
    for key in ("keyword", "markexpr"):
        _expect_type(selection[key], f"{where}.{key}", str, none=True)
    for key in ("paths", "backends", "excluded_backends"):
        _expect_type(selection[key], f"{where}.{key}", list)
        for i, item in enumerate(selection[key]):
            _expect_type(item, f"{where}.{key}[{i}]", str)
    counts = {}
    for key in ("collected", "selected", "deselected"):
        _expect_type(selection[key], f"{where}.{key}", int, none=True)
        if selection[key] is not None and selection[key] < 0:
            raise ReportError(f"{where}.{key}", f"expected a count >= 0, got {selection[key]}")
        counts[key] = selection[key]
    if None not in counts.values() and counts["collected"] != (counts["selected"] +
                                                               counts["deselected"]):
        raise ReportError(f"{where}.deselected", f"collected {counts['collected']} != selected "
                          f"{counts['selected']} + deselected {counts['deselected']}")
    if counts["collected"] is not None and counts["deselected"] is None:
        raise ReportError(f"{where}.deselected", "missing while collected is given")


def _validate_environment(env: Any) -> None:
    _expect_keys(env, "$.environment", _ENV_KEYS, _ENV_OPTIONAL_KEYS)
    if "plugins" in env:
        _expect_type(env["plugins"], "$.environment.plugins", dict)
    _expect_type(env["python"], "$.environment.python", str)
    for key in ("torch", "vllm", "vllm_omni"):
        _expect_type(env[key], f"$.environment.{key}", str, none=True)
    for key in ("platform", "host"):
        _expect_type(env[key], f"$.environment.{key}", str)
    _expect_type(env["options"], "$.environment.options", dict)
    _expect_type(env["seed"], "$.environment.seed", int, none=True)
    _expect_type(env["devices"], "$.environment.devices", list)
    for i, device in enumerate(env["devices"]):
        where = f"$.environment.devices[{i}]"
        _expect_keys(device, where, _DEVICE_KEYS)
        _expect_type(device["name"], f"{where}.name", str)
        _expect_type(device["memory_bytes"], f"{where}.memory_bytes", int, none=True)
        for key in ("driver", "cuda"):
            _expect_type(device[key], f"{where}.{key}", str, none=True)


def _validate_result(result: Any, where: str) -> None:
    _expect_keys(result, where, _RESULT_KEYS, optional=_RESULT_OPTIONAL_KEYS)
    _expect_type(result["nodeid"], f"{where}.nodeid", str)
    _expect_type(result["clause"], f"{where}.clause", str)
    if not CLAUSE_RE.match(result["clause"]):
        raise ReportError(f"{where}.clause", f"not a clause id: {result['clause']!r}")
    for key in ("backend", "case", "layout", "device", "reason", "xfail"):
        _expect_type(result.get(key), f"{where}.{key}", str, none=True)
    if result["status"] not in STATUSES:
        raise ReportError(
            f"{where}.status", f"expected one of {', '.join(STATUSES)}, got {result['status']!r}"
        )
    _expect_number(result["duration_s"], f"{where}.duration_s")
    kind = result.get("skip_kind")
    if kind is not None and kind not in SKIP_KINDS:
        raise ReportError(
            f"{where}.skip_kind", f"expected one of {', '.join(SKIP_KINDS)}, got {kind!r}"
        )
    error_kind = result.get("error_kind")
    if error_kind is not None:
        if error_kind not in ERROR_KINDS:
            raise ReportError(f"{where}.error_kind",
                              f"expected one of {', '.join(ERROR_KINDS)}, got {error_kind!r}")
        if result["status"] not in ("error", "xfailed"):
            raise ReportError(f"{where}.error_kind", f"set on a {result['status']!r} result; "
                              "only an error (or an xfail that declares errors) has a kind")


def _expect_number(value: Any, where: str) -> None:
    """A finite number >= 0 (durations)."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0
            or not math.isfinite(value)):
        raise ReportError(where, f"expected a number >= 0, got {value!r}")


def _validate_summary(summary: Any) -> None:
    _expect_keys(summary, "$.summary", _SUMMARY_KEYS)
    _expect_type(summary["strict"], "$.summary.strict", bool)
    _expect_type(summary["total"], "$.summary.total", int)
    _expect_type(summary["by_status"], "$.summary.by_status", dict)
    _expect_type(summary["by_clause"], "$.summary.by_clause", dict)
    _expect_type(summary["blocking"], "$.summary.blocking", list)


def _expect_keys(
    obj: Any, where: str, required: Sequence[str], optional: Sequence[str] = ()
) -> None:
    _expect_type(obj, where, dict)
    for key in required:
        if key not in obj:
            raise ReportError(f"{where}.{key}", "missing")
    for key in obj:
        if key not in required and key not in optional:
            raise ReportError(f"{where}.{key}", "unknown key")


_TYPE_NAMES = {str: "a string", int: "an integer", bool: "a boolean", list: "a list",
               dict: "an object"}


def _expect_type(value: Any, where: str, kind: type, *, none: bool = False) -> None:
    if value is None and none:
        return
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        expected = _TYPE_NAMES[kind] + (" or null" if none else "")
        raise ReportError(where, f"expected {expected}, got {value!r}")


# --------------------------------------------------------------------------- files


def markdown_path(path: str | Path) -> Path:
    """``report.json`` -> ``report.md``: the Markdown rendering lives next to the JSON."""
    path = Path(path)
    if path.suffix == ".md":
        raise ReportError("$", f"{path}: the JSON report path must not end in .md")
    return path.with_suffix(".md")


def report_paths(path: str | Path) -> tuple[Path, Path]:
    """``(json, markdown)`` for a ``--kv-report`` path.

    ``r.json`` (or any other name) -> ``r.json`` and ``r.md``; a path ending in ``.md``
    is understood as the Markdown's: ``r.md`` -> ``r.json`` and ``r.md``.
    """
    path = Path(path)
    if path.suffix == ".md":
        return path.with_suffix(".json"), path
    return path, markdown_path(path)


def write_report(path: str | Path, report: Mapping[str, Any]) -> tuple[Path, Path]:
    """Validate, then write JSON and Markdown, each via a temp file and ``os.replace``.

    A reader never sees a half-written report, even when a run is interrupted.
    Files get the usual mode (0666 less the umask), not ``mkstemp``'s 0600.
    """
    validate_report(report)
    json_path, md_path = report_paths(path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(json_path, json.dumps(report, indent=2, allow_nan=False) + "\n")
    _atomic_write(md_path, render_markdown(report))
    return json_path, md_path


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    # O_EXCL: never follow or reuse someone else's file; 0o666: the umask decides.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_report(path: str | Path) -> dict[str, Any]:
    """Read a JSON report (not yet validated); problems raise :class:`ReportError` naming it."""
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
    if not isinstance(obj, dict):
        raise ReportError("$", f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


# --------------------------------------------------------------------------- matrices


def _row_name(result: Mapping[str, Any]) -> str:
    return result.get("backend") or UPSTREAM_ROW


def _backend_names(backends: Iterable[Any]) -> list[str]:
    names = []
    for b in backends:
        if isinstance(b, str):
            names.append(b)
        elif isinstance(b, Mapping):
            names.append(b["name"])
        else:
            names.append(b.name)
    return names


def _rows(results: Sequence[Mapping[str, Any]], backends: Iterable[Any]) -> list[str]:
    """Discovered backends in discovery order, then backends only seen in results, then upstream."""
    rows = list(dict.fromkeys(_backend_names(backends)))
    seen = {_row_name(r) for r in results}
    rows += sorted(seen - set(rows) - {UPSTREAM_ROW})
    if UPSTREAM_ROW in seen:
        rows.append(UPSTREAM_ROW)
    return rows


def _columns(results: Iterable[Mapping[str, Any]]) -> list[str]:
    return sorted({r["clause"] for r in results}, key=clause_sort_key)


def worst_status(statuses: Iterable[str]) -> str:
    """The status a cell aggregating these shows (failed > error > xpassed > skipped > ...)."""
    return min(statuses, key=_SEVERITY.index)


def render_terminal_matrix(
    results: Iterable[Mapping[str, Any]], backends: Iterable[Any]
) -> list[str]:
    """Compact backend x clause matrix for the terminal summary, plus a legend line."""
    results = list(results)
    if not results:
        return ["kvconform: no clause results"]
    rows = _rows(results, backends)
    columns = _columns(results)
    headers = [c.removeprefix("KV-") for c in columns]
    cells: dict[tuple[str, str], list[str]] = {}
    for r in results:
        cells.setdefault((_row_name(r), r["clause"]), []).append(r["status"])
    width = max(len("backend"), *(len(row) for row in rows))
    lines = [" ".join(["backend".ljust(width), *headers]).rstrip()]
    for row in rows:
        marks = []
        for clause, header in zip(columns, headers, strict=True):
            statuses = cells.get((row, clause))
            mark = _CELL_CHAR[worst_status(statuses)] if statuses else " "
            marks.append(mark.center(len(header)))
        lines.append(" ".join([row.ljust(width), *marks]).rstrip())
    legend = "  ".join(f"{_CELL_CHAR[s]} {_CELL_WORD[s]}" for s in STATUSES)
    lines.append(f"legend: {legend}  (blank) not run")
    return lines


class _Footnotes:
    """Numbered footnotes, one per distinct (status, reason), shared across cells."""

    def __init__(self) -> None:
        self._numbers: dict[tuple[str, str], int] = {}

    def ref(self, status: str, reason: str, error_kind: str | None = None) -> str:
        word = _CELL_WORD[status] + (f" ({error_kind})" if error_kind else "")
        key = (word, " ".join(reason.split()))
        number = self._numbers.setdefault(key, len(self._numbers) + 1)
        return f"[^{number}]"

    def lines(self) -> list[str]:
        return [f"[^{n}]: {word}: {reason}" for (word, reason), n in self._numbers.items()]


def _cell(results: Sequence[Mapping[str, Any]], notes: _Footnotes) -> str:
    if not results:
        return ""
    worst = worst_status(r["status"] for r in results)
    count = sum(1 for r in results if r["status"] == worst)
    refs = dict.fromkeys(
        notes.ref(r["status"], r["reason"], r.get("error_kind"))
        for r in results
        if r["status"] != "passed" and (r.get("reason") or r.get("error_kind"))
    )
    return f"{_CELL_WORD[worst]} {count}/{len(results)}" + "".join(refs)


def _md(text: Any) -> str:
    return "" if text is None else str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(_md(h) for h in header) + " |"]
    lines.append("|" + "|".join("---" for _ in header) + "|")
    lines += ["| " + " | ".join(_md(c) for c in row) + " |" for row in rows]
    return lines


def _matrix_lines(
    labelled: Sequence[tuple[tuple[str, ...], Sequence[Mapping[str, Any]]]],
    key_header: Sequence[str],
    columns: Sequence[str],
    notes: _Footnotes,
) -> list[str]:
    rows = []
    for key, results in labelled:
        by_clause: dict[str, list[Mapping[str, Any]]] = {}
        for r in results:
            by_clause.setdefault(r["clause"], []).append(r)
        rows.append([*key, *(_cell(by_clause.get(c, []), notes) for c in columns)])
    return _table([*key_header, *columns], rows)


def _format_bytes(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def _device_text(device: Mapping[str, Any]) -> str:
    parts = [device["name"], _format_bytes(device["memory_bytes"])]
    if device.get("driver"):
        parts.append(f"driver {device['driver']}")
    if device.get("cuda"):
        parts.append(f"CUDA {device['cuda']}")
    return ", ".join(parts)


def _verdict_line(report: Mapping[str, Any]) -> str:
    mode = "strict" if report["summary"]["strict"] else "non-strict"
    return f"**Verdict: {report['verdict']}** ({mode})"


def _completeness_lines(report: Mapping[str, Any]) -> list[str]:
    """Why a verdict is partial or interrupted, and the harness errors, as Markdown lines."""
    lines = []
    interruption = interruption_of(report["run"], report["selection"], report["results"])
    if interruption:
        lines += ["", f"Interrupted: {interruption}."]
    missing = left_out(report["selection"])
    if missing:
        lines += ["", "Left out of the matrix: " + "; ".join(missing) + "."]
    kinds: dict[str, int] = {}
    for r in report["results"]:
        if r["status"] == "error":
            kind = r.get("error_kind") or "harness"
            kinds[kind] = kinds.get(kind, 0) + 1
    if kinds:
        counts = ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items()))
        lines += ["", f"Harness errors (E; the harness failed, not the backend): {counts}."]
    return lines


def render_markdown(report: Mapping[str, Any]) -> str:
    """Matrix (with footnoted reasons), environment, backends and verdict of one report."""
    env = report["environment"]
    results = report["results"]
    notes = _Footnotes()
    grouped: dict[str, list[Mapping[str, Any]]] = {}
    for r in results:
        grouped.setdefault(_row_name(r), []).append(r)
    rows = _rows(results, report["backends"])
    labelled = [((row,), grouped.get(row, [])) for row in rows]
    lines = [
        "# pytest-kvconform qualification report",
        "",
        _verdict_line(report),
        "",
        f"Contract {report['contract']}, schema `{report['schema']}`, host `{env['host']}`, "
        f"run `{report['run']['id']}` started {report['run']['started']}.",
        "",
        "## Matrix",
        "",
    ]
    if results:
        lines += _matrix_lines(labelled, ["backend"], _columns(results), notes)
    else:
        lines.append("No clause results.")
    lines += ["", "## Verdict", "", _verdict_line(report), ""]
    counts = report["summary"]["by_status"]
    lines.append(", ".join(f"{counts[s]} {s}" for s in STATUSES) + f" of {len(results)}.")
    lines += _completeness_lines(report)
    if report["uncovered"]:
        lines += ["", "Not covered by this host's hardware: " + ", ".join(report["uncovered"])]
    if report["summary"]["blocking"]:
        lines += ["", "Blocking results:", ""]
        lines += [f"- `{nodeid}`" for nodeid in report["summary"]["blocking"]]
    lines += ["", "## Environment", ""]
    env_rows: list[tuple[str, Any]] = [
        (key, env[key] if env[key] is not None else "not installed")
        for key in ("python", "torch", "vllm", "vllm_omni")
    ]
    env_rows += [("platform", env["platform"]), ("host", env["host"]), ("seed", env["seed"])]
    env_rows += [(f"device {i}", _device_text(d)) for i, d in enumerate(env["devices"])]
    env_rows += [("options", json.dumps(env["options"], sort_keys=True))]
    lines += _table(["key", "value"], env_rows)
    if report["backends"]:
        lines += ["", "## Backends", ""]
        lines += _table(
            ["backend", "source", "path", "overridden", "importable", "reason"],
            [
                [b["name"], b["source"], b["path"], b["overridden"], b["importable"], b["reason"]]
                for b in report["backends"]
            ],
        )
    lines += _plugin_lines(env.get("plugins"), report["backends"])
    footnotes = notes.lines()
    if footnotes:
        lines += ["", *footnotes]
    return "\n".join(lines) + "\n"


def _plugin_lines(plugins: Mapping[str, Any] | None,
                  backends: Sequence[Mapping[str, Any]]) -> list[str]:
    """The Markdown's plugin section: mode, platform, each plugin's outcome, who put
    each backend's class there."""
    if not plugins:
        return []
    env = plugins.get("vllm_plugins")
    lines = ["", "## Plugins", "",
             f"Mode `{plugins.get('mode')}` (`VLLM_PLUGINS` "
             f"{'unset' if env is None else repr(env)}); Omni platform "
             f"`{plugins.get('platform')}` ({plugins.get('platform_source') or '-'}).", ""]
    lines += _table(["group", "plugin", "distribution", "status", "re-pointed", "error"],
                    [[p["group"], p["name"], p["dist"], p["status"],
                      ", ".join(p["changed"]) or "-", p["error"]]
                     for p in plugins.get("plugins", [])])
    lines += [f"- note: {_md(note)}" for note in plugins.get("notes", [])]
    origins = [[b["name"], b["path"], b["overridden"], b["origin"]] for b in backends
               if b.get("origin")]
    if origins:
        lines += ["", *_table(["backend", "path", "overridden", "origin"], origins)]
    return lines


# --------------------------------------------------------------------------- merge


def check_mergeable(named: Sequence[tuple[str, Mapping[str, Any]]]) -> None:
    """Refuse reports of different schema or contract, naming both files and values.

    Checked before full validation so that a report of another schema version
    gets this message rather than a confusing schema error.
    """
    if not named:
        raise ReportError("$", "no reports to merge")
    first_name, first = named[0]
    seen: dict[Any, str] = {}
    for name, report in named:
        identity = _run_identity(report)
        if identity in seen:
            raise ReportError(
                "$.run.id",
                f"{seen[identity]} and {name} are the same run (run {identity[0]!r} on host "
                f"{identity[1]!r}, started {identity[2]!r}); merge each host's report once",
            )
        seen[identity] = name
    for key in ("schema", "contract"):
        for name, report in named[1:]:
            if report.get(key) != first.get(key):
                raise ReportError(
                    f"$.{key}",
                    f"{first_name} has {key} {first.get(key)!r} but {name} has "
                    f"{report.get(key)!r}; reports of different {key} versions cannot be merged",
                )


def _run_identity(report: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    """A run is its id; host and start time are named in the message."""
    run: Mapping[str, Any] = report["run"] if isinstance(report.get("run"), Mapping) else {}
    env: Mapping[str, Any] = (report["environment"] if isinstance(report.get("environment"),
                                                                  Mapping) else {})
    run_id = run.get("id") or json.dumps(report, sort_keys=True, default=str)
    return (run_id, env.get("host"), run.get("started"))


def merged_verdict(reports: Sequence[Mapping[str, Any]]) -> str:
    """Every host must qualify; otherwise the worst host's verdict."""
    for verdict in ("not qualified", "interrupted", "partial"):
        if any(rep["verdict"] == verdict for rep in reports):
            return verdict
    return "qualified"


def host_labels(named: Sequence[tuple[str, Mapping[str, Any]]]) -> list[str]:
    """``environment.host`` per report; equal hosts get the file name, then a counter."""
    hosts = [report["environment"]["host"] for _, report in named]
    named_labels = [
        f"{host} ({Path(name).name})" if hosts.count(host) > 1 else host
        for host, (name, _) in zip(hosts, named, strict=True)
    ]
    return [
        f"{label} #{named_labels[:i].count(label) + 1}" if named_labels.count(label) > 1 else label
        for i, label in enumerate(named_labels)
    ]


def merged_uncovered(reports: Sequence[Mapping[str, Any]]) -> list[str]:
    """Clauses some host could not cover for hardware and no host actually ran."""
    ran = {
        r["clause"] for rep in reports for r in rep["results"] if r["status"] != "skipped"
    }
    missing = {c for rep in reports for c in rep["uncovered"]} - ran
    return sorted(missing, key=clause_sort_key)


def render_merged_markdown(named: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """One backend x host x clause matrix from several validated, mergeable reports."""
    check_mergeable(named)
    labels = host_labels(named)
    reports = [report for _, report in named]
    all_results = [r for rep in reports for r in rep["results"]]
    rows = _rows(all_results, [b for rep in reports for b in rep["backends"]])
    notes = _Footnotes()
    labelled = []
    for row in rows:
        for label, rep in zip(labels, reports, strict=True):
            results = [r for r in rep["results"] if _row_name(r) == row]
            labelled.append(((row, label), results))
    overall = merged_verdict(reports)
    lines = [
        "# pytest-kvconform merged qualification matrix",
        "",
        f"**Verdict: {overall}** (every host must qualify)",
        "",
        f"Contract {reports[0]['contract']}, schema `{reports[0]['schema']}`.",
        "",
        "## Hosts",
        "",
    ]
    host_rows = []
    for label, (name, rep) in zip(labels, named, strict=True):
        env = rep["environment"]
        devices = "; ".join(_device_text(d) for d in env["devices"])
        mode = "strict" if rep["summary"]["strict"] else "non-strict"
        host_rows.append([
            label, name, f"{rep['verdict']} ({mode})", env["vllm"], env["vllm_omni"],
            env["torch"], devices,
        ])
    lines += _table(["host", "file", "verdict", "vllm", "vllm_omni", "torch", "devices"],
                    host_rows)
    lines += ["", "## Matrix", ""]
    if all_results:
        lines += _matrix_lines(labelled, ["backend", "host"], _columns(all_results), notes)
    else:
        lines.append("No clause results.")
    uncovered = merged_uncovered(reports)
    if uncovered:
        lines += ["", "Not covered by any host: " + ", ".join(uncovered)]
    footnotes = notes.lines()
    if footnotes:
        lines += ["", *footnotes]
    return "\n".join(lines) + "\n"
