"""Two runs writing one ``--kv-report`` path leave a JSON and a Markdown of one run.

Each writer is its own process (as two pytest runs are); a reader checks the pair the
whole time, as ``kvconform validate`` does (:func:`~pytest_kvconform.report.build.check_pair`).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pytest_kvconform.cli import main
from pytest_kvconform.report import build as rp
from tests.paths import ROOT
from tests.report_rows import build, row

ROUNDS = 3
WRITES = 150

# One writer: builds a report once, then writes it WRITES times, each under a new run id,
# starting when the go file appears (so both writers overlap).
WRITER = """
import sys, time
from pathlib import Path
from pytest_kvconform.report import build as rp
from tests.report_rows import build, row

path, tag, writes, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
report = build([row(f"t.py::test_{i}") for i in range(40)])
print("ready", flush=True)
while not go.exists():
    time.sleep(0.001)
for i in range(writes):
    report["run"]["id"] = f"{tag}-{i}"
    rp.write_report(path, report)
"""


def _race(path: Path, go: Path) -> list[str]:
    """Run two writers at once; the pair problems a reader saw meanwhile and at the end."""
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), tag, str(WRITES),
                                 str(go)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
               for tag in ("a", "b")]
    problems: list[str] = []
    try:
        for writer in writers:
            assert writer.stdout is not None and writer.stdout.readline() == "ready\n"
        go.touch()
        while any(w.poll() is None for w in writers):
            if path.exists():
                try:
                    rp.check_pair(path)
                except rp.ReportError as exc:
                    problems.append(exc.message)
            time.sleep(0.001)
    finally:
        for writer in writers:
            if writer.poll() is None:
                writer.kill()
            writer.wait()
    assert [w.returncode for w in writers] == [0, 0]
    try:
        rp.check_pair(path)
    except rp.ReportError as exc:
        problems.append(f"at the end: {exc.message}")
    return problems


def test_two_concurrent_writers_leave_one_runs_pair(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    for n in range(ROUNDS):
        problems = _race(path, tmp_path / f"go{n}")
        assert problems == [], f"round {n}: {len(problems)} mixed pairs, first: {problems[0]}"
        md_id = rp.markdown_run_id((tmp_path / "r.md").read_text())
        assert md_id == json.loads(path.read_text())["run"]["id"]
        assert md_id is not None and md_id.endswith(f"-{WRITES - 1}")
    # Only the pair and its lock are left: no temp file of either writer.
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("go")) == \
        [".r.json.lock", "r.html", "r.json", "r.md"]


def test_markdown_names_the_run_id(tmp_path: Path) -> None:
    report = build([row("a")])
    _, md_path, page = rp.write_report(tmp_path / "r.json", report)
    assert rp.page_run_id(page.read_text()) == report["run"]["id"]
    assert rp.markdown_run_id(md_path.read_text()) == report["run"]["id"]
    rp.check_pair(tmp_path / "r.json")


def _mixed_pair(tmp_path: Path) -> tuple[Path, Path, dict[str, Any]]:
    first, second = build([row("a")]), build([row("a")])
    json_path, md_path, _ = rp.write_report(tmp_path / "r.json", first)
    md_path.write_text(rp.render_markdown(second))
    return json_path, md_path, first


def test_validate_refuses_a_pair_of_two_runs(tmp_path: Path, capsys: Any) -> None:
    json_path, md_path, first = _mixed_pair(tmp_path)
    assert main(["validate", str(json_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"{md_path} names run '" in err and str(json_path) in err
    assert f"is run {first['run']['id']!r}" in err and "from different runs" in err
    md_path.write_text("# not a rendering\n")  # hand-written: names no run
    assert main(["validate", str(json_path)]) == 2
    assert "names no run id" in capsys.readouterr().err
    md_path.unlink()  # a JSON on its own is fine
    assert main(["validate", str(json_path)]) == 0


def test_lock_file_is_private_and_never_followed(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        rp.write_report(tmp_path / "r.json", build([row("a")]))
    finally:
        os.umask(old)
    assert stat.S_IMODE(rp.lock_path(tmp_path / "r.json").stat().st_mode) == 0o600
    victim = tmp_path / "victim"
    victim.write_text("keep")
    planted = tmp_path / "s.json"
    rp.lock_path(planted).symlink_to(victim)
    with pytest.raises(OSError):
        rp.write_report(planted, build([row("a")]))
    assert victim.read_text() == "keep"
    assert not planted.exists()
