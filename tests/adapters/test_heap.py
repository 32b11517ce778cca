"""The collector across a run (adapters/heap.py): paused for the imports, frozen for the
tests, handed back at the end and frozen again only at interpreter exit."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from pytest_kvconform.adapters import heap


@pytest.mark.parametrize("on", [True, False], ids=["on", "off"])
def test_resume_restores_the_collector_as_pause_found_it(on: bool) -> None:
    was = gc.isenabled()
    try:
        (gc.enable if on else gc.disable)()
        assert heap.pause() is on and not gc.isenabled()
        heap.resume(on)
        assert gc.isenabled() is on and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        (gc.enable if was else gc.disable)()


def test_freeze_and_thaw() -> None:
    try:
        frozen = heap.freeze()
        # Frozen objects freed since (any deallocation) leave the count; none join it.
        assert 0 < gc.get_freeze_count() <= frozen
    finally:
        heap.thaw()
    assert gc.get_freeze_count() == 0


EXIT = '''
import atexit, gc
from pytest_kvconform.adapters import heap

atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0))  # runs last
heap.freeze()
heap.thaw()
heap.thaw()  # a second run in the process: still one handler
print("frozen after thaw:", gc.get_freeze_count())
'''


def test_a_thawed_heap_is_frozen_again_at_interpreter_exit() -> None:
    """The process goes on with nothing frozen; its final collections skip the heap."""
    out = subprocess.run([sys.executable, "-c", EXIT], capture_output=True, text=True,
                         check=True).stdout
    assert out.splitlines() == ["frozen after thaw: 0", "frozen at exit: True"], out
