"""``kvconform release-table OUT/matrix.json``: what a release matrix leaves in the clone.

From a matrix run's combined report (and its legs' reports) it rewrites the release table
(``pytest_kvconform/release_table.json``, which ships with the package and which a run's
header reads) and README's "Supported stacks" table rendered from it, one row per leg of
tox.ini's ``matrix`` label, in its order.  A run of some legs (``--leg``) updates their rows
and keeps the others'.  The install column names the extra of pyproject.toml that pins the
row's stack, for each qualified row.  Stdlib only.
"""

from __future__ import annotations

import configparser
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pytest_kvconform.crossversion.release_matrix import LABEL
from pytest_kvconform.report import release_table
from pytest_kvconform.report.schema import ReportError

TABLE = Path("pytest_kvconform") / "release_table.json"
BEGIN = "<!-- release-table: written by `kvconform release-table OUT/matrix.json`; do not edit -->"
END = "<!-- /release-table -->"


class ReleaseRecordError(ValueError):
    """The clone lacks what the record is written into (one line naming it)."""


def matrix_legs(root: Path) -> list[str]:
    """The environments of tox.ini's ``matrix`` label, in its order."""
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read(root / "tox.ini", encoding="utf-8")
        labels = parser.get("tox", "labels")
    except (configparser.Error, OSError) as exc:
        raise ReleaseRecordError(f"{root / 'tox.ini'}: no [tox] labels ({exc})") from None
    for line in labels.splitlines():
        name, _, value = line.partition("=")
        if name.strip() == LABEL:
            return [leg.strip() for leg in value.split(",") if leg.strip()]
    raise ReleaseRecordError(f"{root / 'tox.ini'}: no {LABEL!r} label")


def extra_pins(root: Path) -> dict[str, dict[str, str]]:
    """extra -> {package: pinned version}, from pyproject.toml's optional dependencies."""
    try:
        project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    except (OSError, tomllib.TOMLDecodeError, KeyError) as exc:
        raise ReleaseRecordError(f"{root / 'pyproject.toml'}: cannot read its project "
                                 f"({exc})") from None
    lines = [f'{requirement}; extra == "{extra}"'
             for extra, requirements in project.get("optional-dependencies", {}).items()
             for requirement in requirements]
    return release_table.extras(lines)


def readme_section(table: Mapping[str, Any], root: Path) -> list[str]:
    """README's table, its install column from ``root``'s pyproject.toml."""
    legs = release_table.installs(table, extra_pins(root))
    return [BEGIN, *release_table.render_markdown(table, legs), END]


def replace_section(text: str, section: list[str]) -> str:
    """``text`` with the lines between the markers (the markers included) replaced."""
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.DOTALL)
    if not pattern.search(text):
        raise ReleaseRecordError(f"README.md has no release table between {BEGIN!r} and "
                                 f"{END!r}")
    return pattern.sub(lambda _: "\n".join(section), text, count=1)


def write_record(root: Path, matrix: Mapping[str, Any]) -> dict[str, Any]:
    """Rewrite the clone's release table and README's table from ``matrix`` (validated)."""
    path = root / TABLE
    try:
        previous = release_table.load(path) if path.is_file() else None
    except ReportError:
        previous = None  # a table that does not load is rewritten whole
    table = release_table.table_from_matrix(matrix, matrix_legs(root), previous)
    readme = root / "README.md"
    try:
        text = readme.read_text(encoding="utf-8")
    except OSError as exc:
        raise ReleaseRecordError(f"{readme}: cannot read ({exc.strerror or exc})") from None
    updated = replace_section(text, readme_section(table, root))
    release_table.write(table, path)
    readme.write_text(updated, encoding="utf-8")
    return table
