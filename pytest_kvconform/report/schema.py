"""What a valid report is: the schema's version and keys, and :func:`validate_report`.

Every reader of a report (``kvconform show`` / ``merge``, the session before it writes)
goes through one check, so a hand-edited or truncated report is refused with the JSON
path of its first problem.  The verdict it recomputes comes from
:mod:`pytest_kvconform.report.verdict`, so a report cannot claim a verdict its results
do not give.  Stdlib only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from enum import Enum
from pathlib import PurePath
from typing import Any

from pytest_kvconform.contract import CONTRACT_VERSION
from pytest_kvconform.contract.clauses import CLAUSE_RE, SUBJECTS
from pytest_kvconform.contract.outcomes import ErrorKind, SkipKind
from pytest_kvconform.report.result_notes import dependents
from pytest_kvconform.report.verdict import (
    STARTUP_FAILURE_KEYS,
    STATUSES,
    UNCOVERED_KEYS,
    UNCOVERED_SCOPES,
    VERDICTS,
    judge,
    ran_count,
    stack_record,
    startup_failures,
    summarize,
    verdict_text,
)

# 2: ``uncovered`` lists entries (backend or clause, kind, reason), not clause ids;
# ``startup_failures``; ``seeded_faults`` on the environment, ``seeded_fault`` on the
# results a seeded worker fault touched.
SCHEMA = "pytest-kvconform/report/2"
# The contract versions (contract.md) this kvconform's clause ids and checks mean.
KNOWN_CONTRACTS = (CONTRACT_VERSION,)
# A report nests about six levels (options and plugin records a few more): anything much
# deeper is not one, and is refused before code that walks it recursively can overflow.
MAX_DEPTH = 64
SKIP_KINDS = tuple(k.value for k in SkipKind)
ERROR_KINDS = tuple(k.value for k in ErrorKind)

# The keys of each object, in the order they are written; optional ones may be absent.
TOP_KEYS = (
    "schema", "contract", "run", "environment", "selection", "backends", "results", "summary",
    "verdict", "uncovered", "startup_failures",
)
# stack: the serving stack's results told apart (verdict.stack_record): nodeids of its
# results that are known findings (xfailed: "known"), regressions ("regressions") and known
# findings that passed ("fixed"); and "findings", what became of each known finding on this
# stack (verdict.finding_lifetimes): "persists" (the entries, by id, whose failure the stack
# still shows), "fixed" (the entries whose every result passed) and "new" (nodeids of the
# stack's failures no entry describes).  "findings" is optional: reports written before it
# validate without it.  integrity: what of the suite's own code changed after start-up (the
# verdict is then not qualified).
TOP_OPTIONAL_KEYS = ("stack", "integrity")
RUN_KEYS = ("id", "started", "duration_s", "interruption")
SELECTION_KEYS = (
    "keyword", "markexpr", "paths", "backends", "excluded_backends", "collected", "selected",
    "deselected",
)
ENV_KEYS = (
    "python", "torch", "vllm", "vllm_omni", "platform", "devices", "host", "options", "seed",
)
DEVICE_KEYS = ("name", "memory_bytes", "driver", "cuda")
BACKEND_KEYS = ("name", "path", "source", "overridden", "importable", "reason")
# origin: "in-tree", or the distribution / entry point whose plugin re-pointed the member;
# family: whose backend it is ("diffusion": vllm-omni's; "vllm": vLLM's own), absent from
# reports written before vLLM's backends were checked (read as "diffusion").
BACKEND_OPTIONAL_KEYS = ("origin", "family")
BACKEND_FAMILIES = ("diffusion", "vllm")
# plugins: what loading vLLM / vllm-omni plugins did (omni_plugins.PluginLoad.as_dict());
# seeded_faults: the $KVCONFORM_WORKER_FAULT values the run's KV-A workers ran under;
# import_log: what importing the serving stack printed during discovery, one
# {"level", "text"} per message (run_env.import_messages); worker_log: what production
# printed for the KV-A deployments (its worker processes, the fork server, its code run
# between tests), the same, each with the process it came from (workers/worker_log.py).
ENV_OPTIONAL_KEYS = ("plugins", "seeded_faults", "import_log", "worker_log")
IMPORT_LOG_KEYS = ("level", "text")
WORKER_LOG_OPTIONAL_KEYS = ("source",)
RESULT_KEYS = (
    "nodeid", "backend", "clause", "case", "layout", "device", "status", "reason", "duration_s",
)
# seeded_fault: the seeded worker fault this result's test sent its KV-A workers; via: the
# production entry point a KV-A / KV-L6 result went through.
# subject: "backend" or "stack" (the clause table's, per control; "backend" for a fault the
# backend's own code caused); depends_on: the failed clause a failure follows from (KV-L1,
# the backend's declaration); caused_by: the call into the backend's own code a harness
# error happened in (it hung, ended its process, asked for the memory).
RESULT_OPTIONAL_KEYS = ("skip_kind", "xfail", "error_kind", "seeded_fault", "via", "subject",
                        "depends_on", "caused_by")
SUMMARY_KEYS = ("strict", "total", "by_status", "by_clause", "blocking")


class ReportError(ValueError):
    """A report that does not follow the schema; ``path`` is a JSON path like ``$.results[3]``."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}")


def result_sort_key(result: Mapping[str, Any]) -> tuple[str, ...]:
    """The order a report's results are in (nodeid first), so ``-n 2`` and ``-n 0`` agree."""
    keys = ("nodeid", "backend", "clause", "case", "layout")
    return tuple(str(result.get(k) or "") for k in keys)


def jsonable(value: Any) -> Any:
    """Plain JSON values: paths and enums as strings, tuples as lists, str keys."""
    if isinstance(value, Enum):
        return jsonable(value.value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [jsonable(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    return str(value)


# --------------------------------------------------------------------------- validation


def validate_report(obj: Any) -> None:
    """Raise :class:`ReportError` naming the JSON path of the first schema problem.

    Besides shapes and types, the summary, verdict, uncovered entries and
    start-up failures must agree with the results, the selection, the run and
    the plugins: a hand-edited verdict, a "qualified" for a partial or
    interrupted run, or a dropped start-up failure is caught here.  Every
    number must be finite (JSON has no NaN; Python's json module writes one).
    """
    key: Any  # a backend's key (str), then a result's sort key (tuple)
    expect_shallow(obj)
    expect_keys(obj, "$", TOP_KEYS, TOP_OPTIONAL_KEYS)
    if obj["schema"] != SCHEMA:
        raise ReportError("$.schema", f"expected {SCHEMA!r}, got {obj['schema']!r}")
    expect_finite(obj, "$")
    expect_type(obj["contract"], "$.contract", str)
    if obj["contract"] not in KNOWN_CONTRACTS:
        raise ReportError("$.contract", f"unknown contract version {obj['contract']!r} "
                          f"(this kvconform knows {', '.join(map(repr, KNOWN_CONTRACTS))})")
    validate_run(obj["run"])
    _validate_environment(obj["environment"])
    _validate_selection(obj["selection"])
    _validate_startup(obj["startup_failures"], obj["environment"].get("plugins"))
    expect_type(obj["backends"], "$.backends", list)
    for i, backend in enumerate(obj["backends"]):
        where = f"$.backends[{i}]"
        expect_keys(backend, where, BACKEND_KEYS, BACKEND_OPTIONAL_KEYS)
        expect_type(backend.get("origin"), f"{where}.origin", str, none=True)
        if backend.get("family", "diffusion") not in BACKEND_FAMILIES:
            raise ReportError(f"{where}.family", f"expected one of {BACKEND_FAMILIES}, got "
                              f"{backend.get('family')!r}")
        for key in ("name", "path", "source"):
            expect_type(backend[key], f"{where}.{key}", str)
        for key in ("overridden", "importable"):
            expect_type(backend[key], f"{where}.{key}", bool)
        expect_type(backend["reason"], f"{where}.reason", str, none=True)
    expect_type(obj["results"], "$.results", list)
    previous: tuple[str, ...] | None = None
    faults = obj["environment"].get("seeded_faults") or []
    for i, result in enumerate(obj["results"]):
        _validate_result(result, f"$.results[{i}]")
        if result.get("seeded_fault") is not None and result["seeded_fault"] not in faults:
            raise ReportError(f"$.results[{i}].seeded_fault",
                              f"{result['seeded_fault']!r} is not in $.environment."
                              f"seeded_faults ({faults})")
        sort_key = result_sort_key(result)
        if previous is not None and sort_key < previous:
            raise ReportError(f"$.results[{i}]", "results are not sorted by nodeid")
        previous = sort_key
    selected = (obj["selection"] or {}).get("selected")
    if selected is not None and ran_count(obj["results"]) > selected:
        raise ReportError("$.selection.selected", f"{selected} tests selected but "
                          f"{ran_count(obj['results'])} have results")
    found = dependents(obj["results"])
    for i, result in enumerate(obj["results"]):
        if result.get("depends_on") not in (None, found.get(result["nodeid"])):
            raise ReportError(f"$.results[{i}].depends_on", f"{result['depends_on']!r}, but "
                              f"the results give {found.get(result['nodeid'])!r}")
    if "stack" in obj:
        expected = stack_record(obj["results"])
        if isinstance(obj["stack"], dict) and "findings" not in obj["stack"]:
            del expected["findings"]  # written before findings had a lifetime
        if obj["stack"] != expected:
            raise ReportError("$.stack", "does not match the results")
    _validate_summary(obj["summary"])
    strict = obj["summary"]["strict"]
    if obj["summary"] != summarize(obj["results"], strict):
        raise ReportError("$.summary", "does not match the results")
    if obj["verdict"] not in VERDICTS:
        raise ReportError("$.verdict", f"expected one of {VERDICTS}, got {obj['verdict']!r}")
    startup = obj["startup_failures"]
    altered = obj.get("integrity", [])
    expect_type(altered, "$.integrity", list)
    for i, change in enumerate(altered):
        expect_type(change, f"$.integrity[{i}]", str)
    verdict, uncovered = judge(obj["results"], strict, obj["selection"], obj["run"], startup,
                               altered)
    if obj["verdict"] != verdict:
        mode = "strict" if strict else "non-strict"
        why = verdict_text(verdict, [], obj["selection"], obj["run"], obj["results"], startup,
                           altered)
        raise ReportError("$.verdict", f"{obj['verdict']!r} but the results give {verdict!r} "
                                       f"({mode})" + (f": {why}" if why != verdict else ""))
    expect_type(obj["uncovered"], "$.uncovered", list)
    for i, entry in enumerate(obj["uncovered"]):
        _validate_uncovered(entry, f"$.uncovered[{i}]")
    if obj["uncovered"] != uncovered:
        raise ReportError("$.uncovered", f"expected {uncovered}, got {obj['uncovered']!r}")


def expect_shallow(obj: Any) -> None:
    """Refuse JSON nested deeper than :data:`MAX_DEPTH` (walked without recursion)."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ReportError("$", f"not a report: nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            stack.extend((item, depth + 1) for item in value.values())
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)


def _validate_uncovered(entry: Any, where: str) -> None:
    expect_keys(entry, where, UNCOVERED_KEYS)
    if entry["scope"] not in UNCOVERED_SCOPES:
        raise ReportError(f"{where}.scope",
                          f"expected one of {', '.join(UNCOVERED_SCOPES)}, got {entry['scope']!r}")
    for key in ("backend", "kind"):
        expect_type(entry[key], f"{where}.{key}", str, none=True)
    expect_type(entry["reason"], f"{where}.reason", str)
    expect_type(entry["results"], f"{where}.results", int)
    for key in ("clauses", "declared"):
        expect_type(entry[key], f"{where}.{key}", list)
        for j, item in enumerate(entry[key]):
            expect_type(item, f"{where}.{key}[{j}]", str)


def _validate_startup(startup: Any, plugins: Any) -> None:
    """Each plugin whose hook raised is listed, and nothing else (see ``startup_failures``)."""
    expect_type(startup, "$.startup_failures", list)
    for i, failure in enumerate(startup):
        where = f"$.startup_failures[{i}]"
        expect_keys(failure, where, STARTUP_FAILURE_KEYS)
        for key in STARTUP_FAILURE_KEYS:
            expect_type(failure[key], f"{where}.{key}", str, none=key != "plugin")
    expected = startup_failures(plugins if isinstance(plugins, dict) else None)
    if startup != expected:
        raise ReportError("$.startup_failures", f"expected {expected} (the plugins of "
                          f"$.environment.plugins whose hook raised), got {startup!r}")


def expect_finite(value: Any, where: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ReportError(where, f"expected a finite number, got {value!r}")
    if isinstance(value, dict):
        for key, item in value.items():
            expect_finite(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            expect_finite(item, f"{where}[{i}]")


def validate_run(run: Any) -> None:
    expect_keys(run, "$.run", RUN_KEYS)
    for key in ("id", "started"):
        expect_type(run[key], f"$.run.{key}", str)
        if not run[key]:
            raise ReportError(f"$.run.{key}", "must not be empty")
    expect_number(run["duration_s"], "$.run.duration_s")
    expect_type(run["interruption"], "$.run.interruption", str, none=True)


def _validate_selection(selection: Any) -> None:
    if selection is None:  # not recorded: the verdict is at best partial
        return
    where = "$.selection"
    expect_keys(selection, where, SELECTION_KEYS)
    for key in ("keyword", "markexpr"):
        expect_type(selection[key], f"{where}.{key}", str, none=True)
    for key in ("paths", "backends", "excluded_backends"):
        expect_type(selection[key], f"{where}.{key}", list)
        for i, item in enumerate(selection[key]):
            expect_type(item, f"{where}.{key}[{i}]", str)
    counts = {}
    for key in ("collected", "selected", "deselected"):
        expect_type(selection[key], f"{where}.{key}", int, none=True)
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
    expect_keys(env, "$.environment", ENV_KEYS, ENV_OPTIONAL_KEYS)
    if "plugins" in env:
        expect_type(env["plugins"], "$.environment.plugins", dict)
    if "seeded_faults" in env:
        expect_type(env["seeded_faults"], "$.environment.seeded_faults", list)
        for i, fault in enumerate(env["seeded_faults"]):
            expect_type(fault, f"$.environment.seeded_faults[{i}]", str)
    for key, optional in (("import_log", ()), ("worker_log", WORKER_LOG_OPTIONAL_KEYS)):
        if key not in env:
            continue
        expect_type(env[key], f"$.environment.{key}", list)
        for i, message in enumerate(env[key]):
            where = f"$.environment.{key}[{i}]"
            expect_keys(message, where, IMPORT_LOG_KEYS, optional)
            expect_type(message["level"], f"{where}.level", str, none=True)
            expect_type(message["text"], f"{where}.text", str)
            if "source" in message:
                expect_type(message["source"], f"{where}.source", str)
    expect_type(env["python"], "$.environment.python", str)
    for key in ("torch", "vllm", "vllm_omni"):
        expect_type(env[key], f"$.environment.{key}", str, none=True)
    for key in ("platform", "host"):
        expect_type(env[key], f"$.environment.{key}", str)
    expect_type(env["options"], "$.environment.options", dict)
    expect_type(env["seed"], "$.environment.seed", int, none=True)
    expect_type(env["devices"], "$.environment.devices", list)
    for i, device in enumerate(env["devices"]):
        where = f"$.environment.devices[{i}]"
        expect_keys(device, where, DEVICE_KEYS)
        expect_type(device["name"], f"{where}.name", str)
        expect_type(device["memory_bytes"], f"{where}.memory_bytes", int, none=True)
        for key in ("driver", "cuda"):
            expect_type(device[key], f"{where}.{key}", str, none=True)


def _validate_result(result: Any, where: str) -> None:
    expect_keys(result, where, RESULT_KEYS, optional=RESULT_OPTIONAL_KEYS)
    expect_type(result["nodeid"], f"{where}.nodeid", str)
    expect_type(result["clause"], f"{where}.clause", str)
    if not CLAUSE_RE.match(result["clause"]):
        raise ReportError(f"{where}.clause", f"not a clause id: {result['clause']!r}")
    for key in ("backend", "case", "layout", "device", "reason", "xfail", "seeded_fault", "via",
                "depends_on", "caused_by"):
        expect_type(result.get(key), f"{where}.{key}", str, none=True)
    if result.get("subject") not in (None, *SUBJECTS):
        raise ReportError(f"{where}.subject", f"expected one of {', '.join(SUBJECTS)}, got "
                          f"{result['subject']!r}")
    if result["status"] not in STATUSES:
        raise ReportError(
            f"{where}.status", f"expected one of {', '.join(STATUSES)}, got {result['status']!r}"
        )
    expect_number(result["duration_s"], f"{where}.duration_s")
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


def expect_number(value: Any, where: str) -> None:
    """A finite number >= 0 (durations)."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0
            or not math.isfinite(value)):
        raise ReportError(where, f"expected a number >= 0, got {value!r}")


def _validate_summary(summary: Any) -> None:
    expect_keys(summary, "$.summary", SUMMARY_KEYS)
    expect_type(summary["strict"], "$.summary.strict", bool)
    expect_type(summary["total"], "$.summary.total", int)
    expect_type(summary["by_status"], "$.summary.by_status", dict)
    expect_type(summary["by_clause"], "$.summary.by_clause", dict)
    expect_type(summary["blocking"], "$.summary.blocking", list)


def expect_keys(
    obj: Any, where: str, required: Sequence[str], optional: Sequence[str] = ()
) -> None:
    expect_type(obj, where, dict)
    for key in required:
        if key not in obj:
            raise ReportError(f"{where}.{key}", "missing")
    for key in obj:
        if key not in required and key not in optional:
            raise ReportError(f"{where}.{key}", "unknown key")


_TYPE_NAMES = {str: "a string", int: "an integer", bool: "a boolean", list: "a list",
               dict: "an object"}


def expect_type(value: Any, where: str, kind: type, *, none: bool = False) -> None:
    if value is None and none:
        return
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        expected = _TYPE_NAMES[kind] + (" or null" if none else "")
        raise ReportError(where, f"expected {expected}, got {value!r}")
