"""Appending a dated section to a raw results file (default benchmarks/raw.md, untracked):
one helper for every benchmark.  benchmarks/RESULTS.md keeps the current tables."""

from __future__ import annotations

import datetime
import os
import platform
from collections.abc import Sequence
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def append_table(output: str | Path, title: str, columns: Sequence[str],
                 rows: Sequence[str], *, notes: str = "") -> None:
    """``## <UTC stamp> — <title>, <host>, <cores> cores`` then a Markdown table of ``rows``."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    header = (f"\n## {stamp} — {title}, {platform.node()}, {os.cpu_count()} cores\n\n"
              f"| {' | '.join(columns)} |\n|{'---|' * len(columns)}\n")
    with open(output, "a", encoding="utf-8") as out:
        out.write(header + "\n".join(rows) + "\n" + (f"\n{notes}\n" if notes else ""))
