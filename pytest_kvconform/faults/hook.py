"""The seeded-fault package's side of ``adapters/fault_hook.py``: what the mechanism calls.

Imported by name (``$KVCONFORM_FAULT_HOOK``) in every process that hosts production, once
``pytest_kvconform.faults`` installed it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from pytest_kvconform.faults import process_faults, worker_faults
from pytest_kvconform.faults.pid_marking import mark_pid as mark_pid
from pytest_kvconform.faults.process_faults import process_fault as process_fault
from pytest_kvconform.faults.worker_faults import regressions as regressions
from pytest_kvconform.faults.worker_faults import validate as validate


@contextlib.contextmanager
def seeded(fault: str) -> Iterator[None]:
    """The fault's corruptions, corrections, oversized allocation and shifted pattern."""
    with worker_faults.corruption(fault), process_faults.oversized_allocation(fault), \
            worker_faults.corrected(fault), worker_faults.offset_pattern(fault):
        yield
