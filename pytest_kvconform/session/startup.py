"""Checks that run at start-up, before discovery imports vLLM: output paths, xfails file,
backend names.

A report path that cannot be written, an xfails file that does not parse, or a
``--kv-backend`` name no source has is a usage error within a second, not a traceback
after the whole suite has run (nor a refusal after the stack's import).
Stdlib only (plus ``packaging`` through ``xfails``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pytest_kvconform.report.build import page_path, report_paths


class StartupError(ValueError):
    """An option names an output or input that cannot be used; the message names it."""


def check_report_path(path: Path) -> tuple[Path, Path]:
    """``(json, markdown)`` paths for ``--kv-report``, each checked writable now, and the
    page beside them (``r.html``).

    A path ending in ``.md`` (or ``.html``) is understood as the Markdown's (JSON goes
    next to it).
    Writability is tried, not inferred from mode bits: root ignores them, while a
    read-only mount, ``/sys`` or a file used as a directory refuse even root.
    """
    json_path, md_path = report_paths(path)
    for target in (json_path, md_path, page_path(path)):
        _check_writable_file(path, target)
    return json_path, md_path


def _check_writable_file(given: Path, target: Path) -> None:
    what = f"{given}" if target == given else f"{given}: {target}"
    if target.is_dir():
        raise StartupError(f"{what} is a directory; give a file path such as "
                           f"{target / 'report.json'}")
    if target.exists() and not target.is_file():
        raise StartupError(f"{what} exists and is not a regular file")
    parent = target.resolve().parent
    if not parent.exists():
        raise StartupError(f"{what}: directory {parent} does not exist")
    if not parent.is_dir():
        raise StartupError(f"{what}: {parent} is not a directory")
    probe = parent / f".kvconform-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise StartupError(f"{what}: directory {parent} is not writable "
                           f"({exc.strerror or exc})") from None
    os.close(fd)
    probe.unlink(missing_ok=True)


def known_findings(value: str) -> Any:
    """The known findings ``--kv-xfails`` names (``auto``: the shipped file for the
    installed stack, read from its metadata, nothing imported); a bad file raises
    :class:`StartupError` naming it."""
    from pytest_kvconform.contract.records import installed_version
    from pytest_kvconform.session import xfails

    versions = {"vllm": installed_version("vllm"), "vllm_omni": installed_version("vllm-omni")}
    try:
        return xfails.known_findings(value, versions)
    except (OSError, xfails.XfailFileError) as exc:
        raise StartupError(str(exc)) from None


def unknown_backends(unknown: Iterable[str], available: Iterable[str]) -> str:
    """``--kv-backend``'s refusal, naming each unknown name as written (``''`` for an empty
    one) and the names there are."""
    names = ", ".join(repr(name) for name in unknown)
    listing = ", ".join(sorted(available)) or "none"
    return f"unknown backend {names}; available backends: {listing}"


def check_backend_names(wanted: Sequence[str], hooks: Sequence[str]) -> None:
    """Refuse a ``--kv-backend`` name no source has, before the stack is imported
    (``backend_names``); where a source cannot be sure (a ``pytest_kvconform_backends``
    hook, named in ``hooks``, names its backends only when called at session start),
    discovery decides after the import."""
    if not wanted:
        return
    from pytest_kvconform.adapters import backend_names

    known = backend_names.static_names()
    unknown = [name for name in wanted if name not in known.names]
    if unknown and not hooks and not known.undecided:
        raise StartupError(unknown_backends(unknown, known.names))
