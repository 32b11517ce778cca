"""The garbage collector across one run: paused while the stack imports, frozen for the tests.

Importing vLLM and vllm-omni leaves about a million objects the collector tracks.  Left
alone, the collector walks them again and again while they are made (1.7 s of a 10 s
import, measured: benchmarks/RESULTS.md), during the tests, and in the interpreter's last
collections at exit (about 2.5 s more).  None of those walks finds garbage worth the time:
these are modules, classes and functions that live as long as the process.  So a run

- pauses the collector from its start until discovery has imported the stack
  (:func:`pause`, :func:`resume`), as production's own start-up does;
- moves what is there out of its reach once collection is done (:func:`freeze`), so the
  tests' collections, and pytest's two at the end, do not walk it;
- hands it back when the run ends (:func:`thaw`), so a process that goes on (a
  ``pytest.main`` caller, a pytester run) keeps nothing frozen and collects its garbage,
  and freezes it again at interpreter exit (an ``atexit`` handler; :func:`thaw` arms it),
  where the only collections left are the interpreter's final ones, which would walk the
  whole heap only to free what the process is about to drop anyway.

Stdlib only.
"""

from __future__ import annotations

import atexit
import gc


def pause() -> bool:
    """Stop automatic collections; whether they were on (what :func:`resume` restores)."""
    enabled = gc.isenabled()
    gc.disable()
    return enabled


def resume(enabled: bool) -> None:
    """Freeze what the paused stretch made, then collect automatically again if ``enabled``."""
    gc.freeze()
    if enabled:
        gc.enable()


def freeze() -> int:
    """Move every object the collector tracks into its permanent generation; how many."""
    gc.freeze()
    return gc.get_freeze_count()


def thaw() -> None:
    """Give the frozen objects back to the collector, and freeze them again at exit.

    Objects that became garbage while frozen are collected from now on.  The exit handler
    is registered once however many runs a process holds.
    """
    gc.unfreeze()
    atexit.unregister(_freeze_at_exit)
    atexit.register(_freeze_at_exit)


def _freeze_at_exit() -> None:
    """Interpreter exit: keep the final collections off the heap (see the module doc)."""
    gc.freeze()
