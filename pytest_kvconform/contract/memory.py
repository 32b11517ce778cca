"""What this host's memory allows, and an allocation that would exceed it as an ``oom`` error.

Stdlib only.  Linux overcommits: an allocation far past the host's memory usually
succeeds and then grows the process until the kernel's OOM killer ends it, with no
verdict and no report.  So an allocation the harness makes in its own
process is checked against the host's available memory *before* it is made
(:func:`bounded`), and one that still fails (``MemoryError``, torch's allocator
errors) becomes the same :class:`OutOfMemory` error, of kind ``oom``.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator

from pytest_kvconform.contract.outcomes import ErrorKind, HarnessError

# Share of the host's available memory one in-process allocation may take: the rest is
# the test process's own (vLLM's imports), the KV-A workers' and everyone else's.
IN_PROCESS_SHARE = 0.5


def host_available_bytes() -> int | None:
    """Memory the host can still give (``MemAvailable``), or None when it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's CUDA / CPU allocator failures and MemoryError, told apart from other errors."""
    if isinstance(exc, AssertionError):  # a clause failure that talks about memory
        return False
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc).lower()
    return "out of memory" in text or "can't allocate memory" in text


_UNITS = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
# torch's CPU allocator ("you tried to allocate 1099511627776 bytes") and its CUDA one
# ("Tried to allocate 2.00 GiB").
_ASKED = re.compile(r"tried to allocate ([\d.]+)\s*(bytes|[kmgt]i?b)\b", re.IGNORECASE)


def asked_bytes(text: str) -> int | None:
    """How many bytes an allocator's out-of-memory message says were asked for, if it says."""
    found = _ASKED.search(text)
    if found is None:
        return None
    unit = found.group(2).lower()
    try:
        return int(float(found.group(1)) * _UNITS.get(unit, 1))
    except ValueError:
        return None


class OutOfMemory(HarnessError):
    """An allocation of the harness would not fit, or failed for want of memory."""

    kind = ErrorKind.OOM

    def __init__(self, message: str, *, asked: int = 0, available: int | None = None,
                 caused_by: str | None = None) -> None:
        self.asked = asked
        self.available = available
        super().__init__(message, caused_by=caused_by)


@contextlib.contextmanager
def bounded(asked: int, *, share: float = IN_PROCESS_SHARE) -> Iterator[None]:
    """Run an allocation of about ``asked`` bytes in this process, or refuse it.

    Refused (:class:`OutOfMemory`, nothing allocated) when ``asked`` is over ``share``
    of the host's available memory; an out-of-memory error raised inside the block
    becomes the same error.  The messages say how much was asked and available; the
    caller names the allocation.
    """
    available = host_available_bytes()
    if available is not None and asked > available * share:
        raise OutOfMemory(f"it would take about {asked} bytes, more than {share:g} of the "
                          f"{available} bytes this host has available; not attempted",
                          asked=asked, available=available)
    try:
        yield
    except Exception as exc:
        if not is_out_of_memory(exc) or isinstance(exc, HarnessError):
            raise
        raise OutOfMemory(f"it ran out of memory asking for about {asked} bytes ({available} "
                          f"bytes were available): {type(exc).__name__}: {exc}",
                          asked=asked, available=available) from exc
