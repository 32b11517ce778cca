"""Environment defaults a ``--kv-conformance`` run sets while it runs, never over a user's value.

- ``VLLM_LOGGING_LEVEL=WARNING``: vLLM logs every config it builds at INFO, and the
  checks build hundreds.
- ``HUMMING_DISABLE_PARALLEL_BUILD=1``: importing vLLM imports humming (its quantised
  GEMM kernels), which then starts two background builds, each a Python process that
  imports torch and compiles a CUDA launcher.  The suite launches no humming kernel, so
  those builds only compete for the cores: 5 s of a 21 s serial run on 2 cores, more
  under xdist, where every process that imports vLLM starts its own pair
  (benchmarks/RESULTS.md).  A serving process started later builds them when it needs them.

On a CPU run (:data:`CPU_DEFAULTS`), also the platforms production's diffusion worker
needs there: ``VLLM_TARGET_DEVICE=cpu`` (vLLM's own switch to its CPU platform, which
vLLM's CPU build selects by itself) and ``KVCONFORM_CPU_OMNI_PLATFORM=1``, which
activates the plugin's CPU Omni platform (``adapters/omni_cpu_platform.py``; vllm-omni ships
none for CPU, and the entry point stays inert in any process without it).

Set before anything imports vLLM, so the fork server, xdist workers and KV-A workers
inherit them; restored at the end of the run.

Also :func:`captured_output`: what importing the serving stack prints (vllm-omni's
backends warn that SageAttention or FlashInfer is unavailable, transformers prints
``[ERROR]`` lines about docstrings) is the installed stack's, not the suite's, and would
come before pytest's session header looking like failures.  The run captures it while it
discovers, says in one header line how much there was, and keeps it for the report.

Stdlib only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

DEFAULTS: Mapping[str, str] = {
    "VLLM_LOGGING_LEVEL": "WARNING",
    "HUMMING_DISABLE_PARALLEL_BUILD": "1",
}
CPU_PLATFORM_ENV = "KVCONFORM_CPU_OMNI_PLATFORM"  # omni_cpu_platform.ENV (same layer, kept apart)
CPU_DEFAULTS: Mapping[str, str] = {
    "VLLM_TARGET_DEVICE": "cpu",
    CPU_PLATFORM_ENV: "1",
}
_ALL: Mapping[str, str] = {**DEFAULTS, **CPU_DEFAULTS}


def apply(defaults: Mapping[str, str] = DEFAULTS) -> list[str]:
    """Set each default the environment lacks; return the names set (for :func:`restore`)."""
    added = [name for name in defaults if name not in os.environ]
    for name in added:
        os.environ[name] = defaults[name]
    return added


def restore(added: list[str]) -> None:
    """Remove what :func:`apply` set."""
    for name in added:
        os.environ.pop(name, None)


@contextlib.contextmanager
def variable_set(name: str, value: str | None) -> Iterator[None]:
    """For the duration: ``$name`` is ``value`` (unset when None); afterwards as it was.

    How the harness tells a process it starts (production's spawned workers, a worker's own
    deployment) what this one is doing; set in this process's environment because that is
    what those processes inherit."""
    previous = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def header_line(added: list[str]) -> str | None:
    """The run header's account of what this run set (None when it set nothing)."""
    if not added:
        return None
    return "kvconform: environment set for this run: " + ", ".join(
        f"{name}={_ALL[name]}" for name in added)


@contextlib.contextmanager
def applied(defaults: Mapping[str, str] = DEFAULTS) -> Iterator[list[str]]:
    """:func:`apply` for the duration of a ``with`` block, a vLLM imported before it quieted
    too (:func:`loaded_vllm_quieted`)."""
    added = apply(defaults)
    try:
        with loaded_vllm_quieted(added):
            yield added
    finally:
        restore(added)


@contextlib.contextmanager
def loaded_vllm_quieted(added: list[str]) -> Iterator[None]:
    """The ``vllm`` logger at ``VLLM_LOGGING_LEVEL``'s default for the block, when this run
    set that variable and vLLM is already imported.

    vLLM reads the variable once, when it is imported: a script that imported vLLM or
    vllm-omni before calling ``check_backend`` would otherwise get an INFO line for every
    config the checks build.  vllm-omni's loggers propagate to ``vllm``'s.  Left alone
    when the user chose a level, or configures logging themselves
    (``VLLM_CONFIGURE_LOGGING=0``).
    """
    name = "VLLM_LOGGING_LEVEL"
    if name not in added or "vllm.logger" not in sys.modules or \
            os.environ.get("VLLM_CONFIGURE_LOGGING") == "0":
        yield
        return
    logger = logging.getLogger("vllm")
    before = logger.level
    logger.setLevel(os.environ[name])
    try:
        yield
    finally:
        logger.setLevel(before)


# --- what the serving stack's imports print ----------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_LEVEL = re.compile(r"^\[?(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")
_PY_WARNING = re.compile(r"^\S.*?: \w*Warning: ")
# vLLM's prefix, "WARNING 12-04 02:46:01 [file.py:46] ": the time goes, so the same run
# gives the same report.
_VLLM_TIME = re.compile(r"^((?:DEBUG|INFO|WARNING|ERROR|CRITICAL) )\d\d-\d\d \d\d:\d\d:\d\d"
                        r"(?:\.\d+)? ")
# torch's (glog's) prefix, "W1204 18:44:30.847000 13557 path.py:178] ": the time and the
# process id go; the letter becomes the level's name.
_TORCH_PREFIX = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d\d(?:\.\d+)? +\d+ ([^\s\]]+)\] ")
_TORCH_LEVELS = {"I": "INFO", "W": "WARNING", "E": "ERROR", "F": "CRITICAL"}
# vLLM's prefix on each line a worker process it started prints, "(DiffusionWorker pid=123) ".
_PROCESS = re.compile(r"^\(([^()\s]+) pid=\d+\) ")
IMPORT_LOG_KEY = "import_log"  # the report's environment key (report_schema.py)


def import_messages(text: str) -> list[dict[str, Any]]:
    """Captured output as messages, ``{"level", "text"}``: a line that starts a message
    (not indented), with its indented continuation lines; a traceback ends with its
    exception line.  ``level`` is read from vLLM's and transformers' prefixes, a Python
    warning or a traceback; None when the text names none.  vLLM's and torch's
    timestamps (and torch's process id) are dropped; so is the process id of the
    ``(DiffusionWorker pid=123) `` that vLLM puts before each line of a worker process it
    starts, which stays before the message, without its id."""
    messages: list[list[str]] = []
    processes: list[str] = []  # each message's "(DiffusionWorker) ", or ""
    for line in _ANSI.sub("", text).splitlines():
        if not line.strip():
            continue
        process = _PROCESS.match(line)
        if process:
            line = line[process.end():]
        line = _VLLM_TIME.sub(r"\1", line)
        line = _TORCH_PREFIX.sub(lambda m: f"{_TORCH_LEVELS[m[1]]} [{m[2]}] ", line)
        continues = line[:1].isspace() or (
            messages and messages[-1][0].startswith("Traceback")
            and messages[-1][-1][:1].isspace())
        if continues and messages:
            messages[-1].append(line)
        else:
            messages.append([line])
            processes.append(f"({process[1]}) " if process else "")
    return [{"level": _level(lines[0]), "text": process + "\n".join(lines)}
            for process, lines in zip(processes, messages, strict=True)]


def _level(first_line: str) -> str | None:
    m = _LEVEL.match(first_line)
    if m:
        return m.group(1)
    if first_line.startswith("Traceback"):
        return "ERROR"
    return "WARNING" if _PY_WARNING.match(first_line) else None


@contextlib.contextmanager
def captured_output() -> Iterator[list[dict[str, Any]]]:
    """File descriptors 1 and 2 into a temporary file for the block; the yielded list gets
    what was written there, as :func:`import_messages`, when the block ends.

    At the descriptor level (:func:`redirected`), so logging handlers a library creates
    meanwhile (vLLM's, at its import) keep the real ``sys.stdout`` and print to the
    terminal afterwards, and C-level writes are caught too.  When the block raises, what
    it printed goes to stderr as well: it may explain the error.  Without both
    descriptors, nothing is captured.
    """
    found: list[dict[str, Any]] = []
    with tempfile.TemporaryFile() as sink:
        failed = True
        try:
            with redirected(sink.fileno()):
                yield found
            failed = False
        finally:
            sink.seek(0)
            text = sink.read().decode("utf-8", "replace")
            found.extend(import_messages(text))
            if failed and text:
                with contextlib.suppress(Exception):
                    sys.stderr.write(text)
                    sys.stderr.flush()


@contextlib.contextmanager
def redirected(target: int) -> Iterator[bool]:
    """File descriptors 1 and 2 onto ``target`` (an open descriptor) for the block, then
    back to what they were.

    Python's streams are flushed on both sides, so no buffered text crosses the boundary.
    Yields False, redirecting nothing, where 1 and 2 cannot both be duplicated.
    """
    _flush()
    saved: list[int] = []
    try:
        saved += [os.dup(1), os.dup(2)]
    except OSError:
        for fd in saved:
            os.close(fd)
        yield False
        return
    os.dup2(target, 1)
    os.dup2(target, 2)
    try:
        yield True
    finally:
        _flush()
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()


def import_log_lines(messages: Sequence[dict[str, Any]], *, verbose: bool,
                     report: bool) -> list[str]:
    """The header's account of :func:`captured_output`'s messages: one summary line, and
    with ``verbose`` every message in full."""
    return printed_lines(messages, "importing vLLM / vllm-omni printed", IMPORT_LOG_KEY,
                         verbose=verbose, report=report)


def printed_lines(messages: Sequence[dict[str, Any]], who: str, key: str, *, verbose: bool,
                  report: bool) -> list[str]:
    """``kvconform: <who> N messages (counts by level): ...``, and with ``verbose`` every
    message in full (after its ``source``, where it has one); ``key`` is where the report
    keeps them (``environment.<key>``)."""
    if not messages:
        return []
    levels: dict[str, int] = {}
    for message in messages:
        level = message.get("level") or "other"
        levels[level] = levels.get(level, 0) + 1
    counts = ", ".join(f"{n} {level}" for level, n in sorted(levels.items()))
    where = ["shown below" if verbose else "-v shows them"]
    if report:
        where.append(f"the report keeps them (environment.{key})")
    lines = [f"kvconform: {who} {len(messages)} message"
             f"{'s' if len(messages) != 1 else ''} ({counts}): the installed stack's own, not "
             f"findings of this run; {', '.join(where)}"]
    if verbose:
        for message in messages:
            source = f"[{message['source']}] " if message.get("source") else ""
            text = source + str(message["text"])
            lines += [f"kvconform:   | {line}" for line in text.splitlines()]
    return lines
