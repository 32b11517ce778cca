"""The seeded-fault package's side of ``adapters/fault_hook.py``: what the mechanism calls.

Imported by name (``$KVCONFORM_FAULT_HOOK``) in every process that hosts production, once
``pytest_kvconform.faults`` installed it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from pytest_kvconform.adapters.source_rewrite import Regression
from pytest_kvconform.faults import pid_marking, process_faults, worker_faults


def validate(fault: str) -> None:
    worker_faults.validate(fault)


def regressions(fault: str) -> list[Regression]:
    return worker_faults.regressions(fault)


@contextlib.contextmanager
def seeded(fault: str) -> Iterator[None]:
    """The fault's corruptions, corrections, oversized allocation and shifted pattern."""
    with worker_faults.corruption(fault), process_faults.oversized_allocation(fault), \
            worker_faults.corrected(fault), worker_faults.offset_pattern(fault):
        yield


def process_fault(fault: str) -> None:
    process_faults.process_fault(fault)


def mark_pid(suffix: str) -> bool:
    return pid_marking.mark_pid(suffix)
