"""The GPU checks' report: ``OUT/gpu-check.json`` and ``OUT/REPORT.md`` from one record."""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pytest_kvconform.contract import inert
from pytest_kvconform.gpu.check_verdicts import CheckVerdict, Verdict

SCHEMA = "kvconform-gpu-check/1"
JSON_NAME = "gpu-check.json"
MARKDOWN_NAME = "REPORT.md"
LOG_TAIL_LINES = 15  # of a step that ended abnormally, shown in the Markdown


def final_verdict(checks: Sequence[CheckVerdict]) -> Verdict:
    """Failed if one check failed, not checked if one was not, else ok."""
    verdicts = {c.verdict for c in checks}
    for worst in (Verdict.FAILED, Verdict.NOT_CHECKED):
        if worst in verdicts:
            return worst
    return Verdict.OK


def record(*, checks: Sequence[CheckVerdict], host: dict[str, Any],
           environment: dict[str, Any], steps: Sequence[dict[str, Any]],
           sizing: Sequence[dict[str, Any]], pinning: Sequence[dict[str, Any]],
           seconds: float) -> dict[str, Any]:
    """The JSON report: everything REPORT.md says, and the raw facts behind it."""
    return {
        "schema": SCHEMA,
        "verdict": final_verdict(checks).value,
        "seconds": round(seconds, 1),
        "host": host,
        "environment": environment,
        "checks": [{"name": c.name, "verdict": c.verdict.value, "summary": c.summary,
                    "rows": [{**asdict(r), "verdict": r.verdict.value} for r in c.rows]}
                   for c in checks],
        "sizing": list(sizing),
        "pinning": list(pinning),
        "steps": list(steps),
    }


def _cell(text: object, limit: int = 400) -> str:
    flat = " ".join(str(text).split()).replace("|", "/")
    return inert.markdown(flat if len(flat) <= limit else flat[:limit - 3] + "...")


def _code(text: str, limit: int) -> str:
    flat = " ".join(text.split()).replace("|", "/")
    return inert.code_span(flat if len(flat) <= limit else flat[:limit - 3] + "...")


def render_markdown(report: dict[str, Any]) -> str:
    env, host = report["environment"], report["host"]
    lines = [f"# kvconform gpu-check: {report['verdict']}", "",
             f"python {env.get('python')}, torch {host.get('torch')} (CUDA {host.get('cuda')}), "
             f"vLLM {env.get('vllm')}, vllm-omni {env.get('vllm_omni')}; host "
             f"{env.get('host')}; {report['seconds']} s", ""]
    drivers = {d.get("driver") for d in env.get("devices", []) if d.get("driver")}
    for d in host.get("devices", []):
        lines.append(f"- GPU {d['index']}: {d['name']}, {d['total_bytes'] // 2**20} MiB"
                     f"{f', driver {next(iter(drivers))}' if len(drivers) == 1 else ''}")
    lines += ["", "| check | verdict | summary |", "|---|---|---|"]
    lines += [f"| {c['name']} | {c['verdict']} | {_cell(c['summary'])} |"
              for c in report["checks"]]
    if report["sizing"]:
        lines += ["", "## KV-A6 sizing", "",
                  "| need | layout | case | allocation | blocks | probe pages (layer, block): "
                  "byte offset |", "|---|---|---|---|---|---|"]
        lines += [f"| {s['need']} | {s['layout']} | {s['case']} | {s['allocation_bytes']} bytes "
                  f"({s['allocation_bytes'] / 2**30:.2f} GiB) | {s['num_blocks']} | "
                  + ", ".join(f"({p['layer']}, {p['block']}): {p['byte_offset']}"
                              for p in s["probes"]) + " |"
                  for s in report["sizing"]]
    for c in report["checks"]:
        if not c["rows"]:
            continue
        lines += ["", f"## {c['name']}: {c['verdict']}", "",
                  "| subject | outcome | expected | verdict | detail |", "|---|---|---|---|---|"]
        lines += [f"| {r['subject']} | {_cell(r['outcome'])} | {_cell(r['expected'])} | "
                  f"{r['verdict']} | {_cell(r['detail'])} |" for r in c["rows"]]
    lines += ["", "## Steps", "", "| step | exit | seconds | log | command |",
              "|---|---|---|---|---|"]
    lines += [f"| {s['name']} | {s['returncode']} | {s['seconds']} | {s['log']} | "
              f"{_code(shlex.join(s['argv']), 1000)} |" for s in report["steps"]]
    for s in report["steps"]:
        if s.get("log_tail"):
            fence = inert.fence_for(s["log_tail"])
            lines += ["", f"{s['name']} ended with exit status {s['returncode']}; the end of "
                      f"{s['log']}:", "", fence,
                      *(inert.terminal(line) for line in s["log_tail"]), fence]
    return "\n".join(lines) + "\n"


def write(out: Path, report: dict[str, Any]) -> Path:
    """Write both files into ``out``; returns the Markdown's path."""
    (out / JSON_NAME).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    markdown = out / MARKDOWN_NAME
    markdown.write_text(render_markdown(report), encoding="utf-8")
    return markdown
