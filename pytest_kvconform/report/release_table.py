"""The release table: the stacks this release qualifies, from the matrix legs' last results.

``kvconform release-table OUT/matrix.json`` writes it from a release matrix's combined
report (``pytest_kvconform/release_table.json``, shipped with the package) and renders
README's "Supported stacks" table from it, so neither is written by hand and neither can go
stale: ``tests/test_install.py`` holds the README's table, tox.ini's ``matrix`` label, the
legs' requirements and pyproject.toml's extras to it.  A run's header says whether the
installed stack is one the table qualifies and, if not, what to install
(:func:`header_line`).  Stdlib only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pytest_kvconform.report.schema import ReportError, expect_keys, expect_type

SCHEMA = "pytest-kvconform/release-table/1"
TABLE = Path(__file__).resolve().parents[1] / "release_table.json"
TOP_KEYS = ("schema", "matrix_run", "started", "legs")
STACK = ("vllm", "vllm_omni", "torch")
# One leg's last result: its stack, what happened to it, and its known findings (counts of
# verdict.finding_lifetimes: persisting, fixed and new).
ROW_KEYS = ("leg", "description", *STACK, "stack_source", "state", "verdict", "reason",
            "counts", "findings", "run_id", "started")
FINDINGS = ("persists", "fixed", "new")
_REASON_CHARS = 120
_CLAUSES = re.compile(r"(?<=in )KV-[A-Z]+\d+(?:, KV-[A-Z]+\d+){3,}")  # a long list, counted
_PATH = re.compile(r" \(/[^)\s]*\)")  # a file named in an import error: the host's, not the leg's
_PRE = re.compile(r"(a|b|rc)\d+$")
# ``vllm==0.30.0; extra == "omni"``: a pin of a package under an extra (package metadata).
_EXTRA_PIN = re.compile(r'^\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s;]+)\s*;\s*extra\s*==\s*"([^"]+)"')


# --------------------------------------------------------------------------- building


def table_from_matrix(matrix: Mapping[str, Any], legs: Sequence[str],
                      previous: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The table for the ``legs`` named (tox.ini's ``matrix`` label, in its order): each
    leg's row from the combined report where it has one, else from ``previous`` (a matrix
    run with ``--leg`` updates the legs it ran); a leg neither has is ``not run``."""
    rows = {row["leg"]: row for row in (previous or {}).get("legs", [])}
    for leg in matrix["legs"]:
        rows[leg["name"]] = _row(leg, matrix["run"])
    table = {"schema": SCHEMA, "matrix_run": matrix["run"]["id"],
             "started": matrix["run"]["started"],
             "legs": [rows.get(name) or _not_run(name) for name in legs]}
    validate_table(table)
    return table


def _row(leg: Mapping[str, Any], run: Mapping[str, Any]) -> dict[str, Any]:
    findings = leg.get("findings")
    reason = _PATH.sub("", " ".join(str(leg.get("reason") or "").split()))
    reason = _CLAUSES.sub(lambda m: f"{m.group(0).count(',') + 1} clauses", reason)
    if len(reason) > _REASON_CHARS:
        reason = reason[:_REASON_CHARS - 3] + "..."
    return {"leg": leg["name"], "description": leg["description"],
            **{key: leg["stack"][key] for key in STACK}, "stack_source": leg["stack_source"],
            "state": leg["state"], "verdict": leg["verdict"], "reason": reason or None,
            "counts": {s: n for s, n in (leg["counts"] or {}).items() if n} or None,
            "findings": ({key: len(findings[key]) for key in FINDINGS}
                         if findings is not None else None),
            "run_id": leg["run_id"], "started": run["started"]}


def _not_run(name: str) -> dict[str, Any]:
    return {"leg": name, "description": "", **dict.fromkeys(STACK), "stack_source": "requested",
            "state": "not run", "verdict": None, "reason": "no matrix has run it yet",
            "counts": None, "findings": None, "run_id": None, "started": None}


def validate_table(obj: Any, where: str = "release table") -> None:
    """Raise :class:`ReportError` at the first problem (shapes, and a leg named twice)."""
    try:
        expect_keys(obj, "$", TOP_KEYS)
        if obj["schema"] != SCHEMA:
            raise ReportError("$.schema", f"expected {SCHEMA!r}, got {obj['schema']!r}")
        expect_type(obj["legs"], "$.legs", list)
        seen = set()
        for i, row in enumerate(obj["legs"]):
            at = f"$.legs[{i}]"
            expect_keys(row, at, ROW_KEYS)
            for key in ("leg", "description", "stack_source", "state"):
                expect_type(row[key], f"{at}.{key}", str)
            for key in (*STACK, "verdict", "reason", "run_id", "started"):
                expect_type(row[key], f"{at}.{key}", str, none=True)
            for key in ("counts", "findings"):
                expect_type(row[key], f"{at}.{key}", dict, none=True)
            if row["leg"] in seen:
                raise ReportError(f"{at}.leg", f"leg {row['leg']!r} appears twice")
            seen.add(row["leg"])
    except ReportError as exc:
        raise ReportError(exc.path, f"{where}: {exc.message}") from None


def load(path: Path = TABLE) -> dict[str, Any]:
    """The shipped table (validated); :class:`ReportError` names what is wrong with it."""
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ReportError("$", f"release table {path}: cannot read: {exc}") from None
    validate_table(table, f"release table {path}")
    return table


def write(table: Mapping[str, Any], path: Path = TABLE) -> None:
    path.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- reading


def qualified(row: Mapping[str, Any]) -> bool:
    return row["state"] == "ran" and row["verdict"] == "qualified"


def pre_release(row: Mapping[str, Any]) -> bool:
    """Whether the row's vLLM or vllm-omni is a pre-release (``0.32.0rc1``)."""
    return any(_PRE.search(str(row[key] or "")) for key in ("vllm", "vllm_omni"))


def status(row: Mapping[str, Any]) -> str:
    """The row's status in words: ``qualified``, ``qualified (pre-release)``, ``not
    qualified: ...``, ``not built: ...``."""
    if qualified(row):
        return "qualified" + (" (pre-release)" if pre_release(row) else "")
    outcome = row["verdict"] if row["state"] == "ran" else row["state"]
    return f"{outcome}: {row['reason']}" if row["reason"] else str(outcome)


def extras(requirements: Iterable[str]) -> dict[str, dict[str, str]]:
    """extra -> {package: pinned version}, from the package's ``Requires-Dist`` lines."""
    found: dict[str, dict[str, str]] = {}
    for line in requirements:
        pin = _EXTRA_PIN.match(line)
        if pin:
            found.setdefault(pin.group(3), {})[_canonical(pin.group(1))] = pin.group(2)
    return found


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installs(table: Mapping[str, Any], pins: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """leg -> the extra that installs its stack (pins vLLM, vllm-omni and torch exactly as
    the row has them, a torch build's local label aside; ``omni`` first), for each qualified
    row one pins."""
    out = {}
    for row in table["legs"]:
        if not qualified(row):
            continue
        want = {"vllm": row["vllm"], "vllm-omni": row["vllm_omni"],
                "torch": _public(row["torch"])}
        for extra in sorted(pins, key=lambda e: (e != "omni", e)):
            if all(pins[extra].get(name) == version for name, version in want.items()):
                out[row["leg"]] = extra
                break
    return out


def install_command(extra: str) -> str:
    return f'pip install "pytest-kvconform[{extra}]"'


def _public(version: str | None) -> str | None:
    return None if version is None else version.split("+", 1)[0]


def row_for(table: Mapping[str, Any], versions: Mapping[str, str | None]
            ) -> Mapping[str, Any] | None:
    """The row of the installed stack: its vLLM, vllm-omni (or none) and torch, the
    torch build's local label aside (``2.13.0+cpu`` is 2.13.0)."""
    have = {"vllm": versions.get("vllm"), "vllm_omni": versions.get("vllm-omni"),
            "torch": _public(versions.get("torch"))}
    ran = [row for row in table["legs"] if row["stack_source"] == "installed"]
    return next((row for row in ran if all(row[key] == have[key] for key in STACK)), None)


def describe_stack(stack: Mapping[str, str | None]) -> str:
    return (f"vLLM {stack.get('vllm') or '-'} / vllm-omni {stack.get('vllm_omni') or '-'} / "
            f"torch {stack.get('torch') or '-'}")


def header_line(table: Mapping[str, Any], versions: Mapping[str, str | None],
                pins: Mapping[str, Mapping[str, str]]) -> str:
    """Whether the installed stack is one the release table qualifies; if not, what to
    install (the qualified release first, then its qualified pre-releases)."""
    row = row_for(table, versions)
    if row is not None and qualified(row):
        return (f"kvconform: release table: this stack is qualified "
                f"{'(a pre-release) ' if pre_release(row) else ''}by leg {row['leg']}")
    why = (f"leg {row['leg']} is {status(row)}" if row is not None else
           "no leg of the release table runs it")
    legs = installs(table, pins)
    by_leg = {r["leg"]: r for r in table["legs"]}
    offers = [f"{install_command(extra)} ({describe_stack(by_leg[leg])}"
              f"{', a pre-release' if pre_release(by_leg[leg]) else ''})"
              for leg, extra in sorted(legs.items(), key=lambda kv: (kv[1] != "omni", kv[0]))]
    if not offers:
        offers = [describe_stack(r) for r in table["legs"] if qualified(r)]
    todo = ("; install a qualified one: " + " or ".join(offers)) if offers else \
        "; the release table qualifies no stack"
    return f"kvconform: release table: this stack is not qualified ({why}){todo}"


# --------------------------------------------------------------------------- rendering


def render_markdown(table: Mapping[str, Any], legs_install: Mapping[str, str],
                    findings_page: str = "docs/findings-vllm-omni-0.30.md") -> list[str]:
    """README's "Supported stacks" table: one row per leg, from its last result."""
    lines = ["| vLLM | vllm-omni | torch | leg | status | last result | known findings | "
             "install |", "|---|---|---|---|---|---|---|---|"]
    for row in table["legs"]:
        counts = ", ".join(f"{n} {s}" for s, n in (row["counts"] or {}).items()) or "-"
        found = row["findings"]
        persist = (f"[{found['persists']} persist]({findings_page})"
                   if found is not None and found["persists"] else "0 persist")
        known = "-" if found is None else f"{persist}, {found['fixed']} fixed, {found['new']} new"
        extra = legs_install.get(row["leg"])
        torch = (row["torch"] or "-") + (" (requested)" if row["stack_source"] == "requested"
                                         else "")
        cells = [row["vllm"] or "-", row["vllm_omni"] or "none", torch, f"`{row['leg']}`",
                 status(row), counts, known, f"`[{extra}]`" if extra else "-"]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return lines
