"""How fast bad output paths, a bad xfails file and an unknown backend name are refused
(target: ~1 s, before vLLM; an unknown ``--kv-backend`` under 5 s).

Run in the default environment:  python benchmarks/bench_startup.py [-o FILE]
Each case is a fresh ``pytest --kv-conformance`` process that must end in a usage error
(exit 4) at start-up; the table records its wall time and whether torch / vllm /
vllm_omni were imported by then (a conftest writes ``sys.modules`` at unconfigure).
Results are appended to benchmarks/raw.md (untracked).  No timed assertions: this only measures.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results import append_table  # benchmarks/, the script's own directory

PROBE = '''
import sys
from pathlib import Path


def pytest_unconfigure(config):
    heavy = sorted(m for m in ("torch", "vllm", "vllm_omni") if m in sys.modules)
    Path("heavy.txt").write_text(",".join(heavy) or "none")
'''


def cases(tmp: Path) -> dict[str, list[str]]:
    (tmp / "bad.toml").write_text("[[xfail]]\nbackend = 'A'\n")
    (tmp / "a_file").write_text("")
    (tmp / "a_dir").mkdir()
    ro = "/sys" if os.geteuid() == 0 else str(tmp / "ro")
    if ro != "/sys":
        Path(ro).mkdir()
        Path(ro).chmod(0o555)
    return {
        f"--kv-report into a read-only directory ({ro})": ["--kv-report", f"{ro}/r.json"],
        "--kv-report under a file (file/r.json)": ["--kv-report", "a_file/r.json"],
        "--kv-report naming a directory": ["--kv-report", "a_dir"],
        "--kv-xfails file missing a key": ["--kv-xfails", "bad.toml"],
        "--kv-backend NOPE (no registry has it)": ["--kv-backend", "NOPE"],
        "--kv-backend '' (an empty name)": ["--kv-backend", ""],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-o", "--output", default=str(Path(__file__).with_name("raw.md")))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        (tmp / "conftest.py").write_text(PROBE)
        for label, extra in cases(tmp).items():
            cmd = [sys.executable, "-m", "pytest", "--kv-conformance", "-p", "no:cacheprovider",
                   "-q", *extra]
            started = time.perf_counter()
            proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=600)
            seconds = time.perf_counter() - started
            heavy = (tmp / "heavy.txt").read_text() if (tmp / "heavy.txt").exists() else "?"
            message = (proc.stderr.strip().splitlines() or [""])[-1].replace("|", "\\|")
            rows.append(f"| {label} | {seconds:.2f} | {proc.returncode} | {heavy} | {message} |")
            print(rows[-1], flush=True)
    append_table(args.output, "start-up refusals",
                 ("case", "wall s", "exit", "heavy modules imported", "message"), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
