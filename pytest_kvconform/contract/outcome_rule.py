"""Which exceptions escaping a clause check are harness faults, not clause failures.

Stdlib only.  A check reports the contract through :class:`ClauseFailure` (an
``AssertionError``) and :class:`ClauseSkip`; anything else that escapes is judged
here:

- a :class:`HarnessError` (a worker died or timed out, an OOM in the harness) keeps
  its own kind;
- ``MemoryError`` / torch's ``OutOfMemoryError`` in the test process is ``oom``;
- any other exception raised by the plugin's own code is ``harness`` (a bug, or an
  adapter that could not adapt): the innermost traceback frame that is not in a
  tool the plugin calls (the standard library, numpy, packaging) lies in this package;
- an exception the installed code (vLLM, vllm-omni, a backend) raised and the check
  let through stays a clause failure: the installed code misbehaved.

A harness fault becomes status ``error`` with its kind, never a failure blamed on a
backend, and no xfail entry absorbs it unless the entry says so.
"""

from __future__ import annotations

import importlib.util
import sysconfig
from functools import cache
from pathlib import Path

from pytest_kvconform.contract.memory import is_out_of_memory
from pytest_kvconform.contract.outcomes import ClauseSkip, ErrorKind, HarnessError

# user_properties key carrying a harness fault's kind from the test to the report.
ERROR_KIND_PROPERTY = "kv_error_kind"
PACKAGE_DIR = Path(__file__).resolve().parents[1]
# Set on an exception carried back from the child process that raised it
# (``workers/isolated.py``): its kind, judged there by this rule, where its traceback was
# (an ErrorKind value, or None for a clause outcome).
REMOTE_KIND_ATTR = "kvconform_remote_kind"


def harness_kind(exc: BaseException) -> ErrorKind | None:
    """The :class:`ErrorKind` of a harness fault, or None for a clause outcome."""
    if isinstance(exc, HarnessError):
        return exc.kind
    if hasattr(exc, REMOTE_KIND_ATTR):  # judged where it was raised
        remote = getattr(exc, REMOTE_KIND_ATTR)
        return None if remote is None else ErrorKind(remote)
    if not isinstance(exc, Exception) or isinstance(exc, (AssertionError, ClauseSkip)):
        return None  # KeyboardInterrupt, pytest outcomes, failures, skips
    if is_out_of_memory(exc):
        return ErrorKind.OOM
    if raised_in_plugin(exc):
        return ErrorKind.HARNESS
    return None


def raised_in_plugin(exc: BaseException) -> bool:
    """Whether the innermost traceback frame outside the plugin's tools is in this package.

    ``re.match(None)`` in the plugin raises in ``re``: that is still the plugin's bug.
    """
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    for filename in reversed(frames):
        path = _path(filename)
        if path is None or _is_tool(path):
            continue
        return path == PACKAGE_DIR or PACKAGE_DIR in path.parents
    return False


def _path(filename: str) -> Path | None:
    if filename.startswith("<"):  # <frozen ...>, <string>
        return None
    try:
        return Path(filename).resolve()
    except (OSError, ValueError):
        return None


def _is_tool(path: Path) -> bool:
    stdlib, packages, tools = _roots()
    if any(root in path.parents for root in tools):
        return True
    return (any(root in path.parents for root in stdlib)
            and not any(root in path.parents for root in packages))


@cache
def _roots() -> tuple[tuple[Path, ...], tuple[Path, ...], tuple[Path, ...]]:
    """(stdlib dirs, site-packages dirs, the tool packages' dirs), found without importing."""
    paths = sysconfig.get_paths()
    stdlib = tuple({Path(paths[k]).resolve() for k in ("stdlib", "platstdlib")})
    packages = tuple({Path(paths[k]).resolve() for k in ("purelib", "platlib")})
    tools = []
    for name in _TOOLS:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        for location in (spec.submodule_search_locations or []) if spec else []:
            tools.append(Path(location).resolve())
    return stdlib, packages, tuple(tools)


_TOOLS = ("numpy", "packaging")  # libraries the plugin itself calls; never under test
