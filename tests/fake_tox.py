"""A stand-in for tox, for the matrix's mechanics: ``python tests/fake_tox.py ARGS``.

It answers the four calls ``crossversion/tox_leg.py`` makes (``config -m LABEL``, ``-e NAME
--notest``, ``exec -e NAME -- probe``, ``-e NAME -- PYTEST_ARGS``) from ``fake_tox.json`` in
its working directory (the clone's root), one entry per leg::

    {"legs": {"py311-a": {"description": "...", "deps": "-r requirements/a.txt",
                          "build": "ok" | "uv-error", "probe": {...} | "crash",
                          "suite": "qualified" | "failing" | "no-report" | "hang"}}}

A suite run writes a report built by production's ``build_report`` (``tests/report_rows``)
to the ``--kv-report`` path, with the probe's versions; it takes no time and imports no vLLM.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

UV_ERROR = """py311-x: install_deps> uv pip install -r requirements/x.txt
\x1b[31mUsing Python 3.11.7 environment at: .tox/py311-x
error: No solution found when resolving dependencies
  cause: Because there is no version of flashinfer-python==0.7.3 and vllm>=0.34.0 depends on flashinfer-python==0.7.3, we can conclude that vllm>=0.34.0 cannot be used.
         And because you require vllm==0.34.0, we can conclude that your requirements are unsatisfiable.
\x1b[39mpy311-x: exit 1 (1.19 seconds) /clone> uv pip install -r requirements/x.txt pid=1
  py311-x: FAIL code 1 (1.22 seconds)
"""  # noqa: E501 - uv's own lines, verbatim


def _report(spec: dict[str, Any], path: Path) -> None:
    from tests.report_rows import build, environment, row

    probe = spec.get("probe") or {}
    env = environment(vllm=probe.get("vllm"), vllm_omni=probe.get("vllm_omni"),
                      torch=probe.get("torch"), options={"xfails": "known.toml"})
    results = [row("s::test_kv_l1[GOOD]"), row("s::test_kv_s1[LBNHC-bf16_h8]", "KV-S1",
                                               backend=None, layout="LBNHC", case="bf16_h8")]
    if spec["suite"] == "failing":
        results.append(row("s::test_kv_l6[GOOD]", "KV-L6", "failed",
                            reason="KV-L6 violated [backend=GOOD]: pinned LBNHC"))
        results.append(row("s::test_kv_a1[GOOD-bf16_h8]", "KV-A1", "skipped", case="bf16_h8",
                            reason="KV-A1: vllm-omni not installed", skip_kind="environment"))
    report = build(results, env=env)
    path.write_text(json.dumps(report, indent=2) + "\n")


def main(argv: list[str]) -> int:
    legs: dict[str, Any] = json.loads(Path("fake_tox.json").read_text())["legs"]
    if argv[:1] == ["config"]:
        for name, spec in legs.items():
            print(f"[testenv:{name}]\ndescription = {spec['description']}\n"
                  f"deps = {spec['deps']}\n")
        return 0
    if argv[:1] == ["exec"]:
        spec = legs[argv[argv.index("-e") + 1]]
        if spec["probe"] == "crash":
            print("Traceback (most recent call last):\nImportError: libcuda.so.1: not found")
            return 1
        print("Failed to import from vllm._C\nkvconform-probe: " + json.dumps(spec["probe"]))
        return 0
    spec = legs[argv[argv.index("-e") + 1]]
    if "--notest" in argv:
        if spec["build"] == "uv-error":
            sys.stdout.write(UV_ERROR)
            return 1
        print(f"{argv[1]}: OK")
        return 0
    args = argv[argv.index("--") + 1:]
    if spec["suite"] == "hang":  # until interrupted, its pid where the test looks
        Path("fake_tox.pid").write_text(str(os.getpid()))
        time.sleep(120)
        return 3
    if spec["suite"] == "no-report":
        print("ERROR: usage: pytest [options]\npytest: error: unrecognized arguments: --kv-x")
        return 4
    _report(spec, Path(args[args.index("--kv-report") + 1]))
    return 0 if spec["suite"] == "qualified" else 1


if __name__ == "__main__":
    # Run as a script, it imports tests.report_rows from the clone; imported (by
    # crossversion/test_release_matrix.py), it must not put the clone first on the importing
    # process's path.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main(sys.argv[1:]))
