"""Which exceptions escaping a clause check are harness faults, not clause failures.

Stdlib only.  A check reports the contract through :class:`ClauseFailure` (an
``AssertionError``) and :class:`ClauseSkip`; anything else that escapes is judged
here:

- a :class:`HarnessError` (a worker died or timed out, an OOM in the harness) keeps
  its own kind;
- ``MemoryError`` / torch's ``OutOfMemoryError`` in the test process is ``oom``;
- any other exception raised by the plugin's own code (its innermost traceback frame
  lies in this package: a bug or an adapter that could not adapt) is ``harness``;
- an exception the installed code (vLLM, vllm-omni, a backend) raised and the check
  let through stays a clause failure, as before: the installed code misbehaved.

A harness fault becomes status ``error`` with its kind, never a failure blamed on a
backend, and no xfail entry absorbs it unless the entry says so.
"""

from __future__ import annotations

from pathlib import Path

from pytest_kvconform.outcomes import ClauseSkip, ErrorKind, HarnessError

# user_properties key carrying a harness fault's kind from the test to the report.
ERROR_KIND_PROPERTY = "kv_error_kind"
PACKAGE_DIR = Path(__file__).resolve().parent
_OOM_NAMES = ("OutOfMemoryError",)  # torch.cuda.OutOfMemoryError, without importing torch


def harness_kind(exc: BaseException) -> ErrorKind | None:
    """The :class:`ErrorKind` of a harness fault, or None for a clause outcome."""
    if isinstance(exc, HarnessError):
        return exc.kind
    if not isinstance(exc, Exception) or isinstance(exc, (AssertionError, ClauseSkip)):
        return None  # KeyboardInterrupt, pytest outcomes, failures, skips
    if isinstance(exc, MemoryError) or type(exc).__name__ in _OOM_NAMES:
        return ErrorKind.OOM
    if raised_in_plugin(exc):
        return ErrorKind.HARNESS
    return None


def raised_in_plugin(exc: BaseException) -> bool:
    """Whether the innermost Python frame of ``exc``'s traceback is in this package."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    try:
        file = Path(tb.tb_frame.f_code.co_filename).resolve()
    except (OSError, ValueError):
        return False
    return file == PACKAGE_DIR or PACKAGE_DIR in file.parents
