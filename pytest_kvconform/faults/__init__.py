"""Seeded faults: what the suite must catch, planted or rewritten into the installed stack.

For the harness's own tests and ``kvconform selftest``: the worker-side regressions and
control-plane corruptions (``worker_faults.py``), the process faults (``process_faults.py``),
PID marking (``pid_marking.py``), the faults planted in the checks' process (``plants.py``)
and the registry of them all (``registry.py``).  The mechanism layers never import this
package: importing it installs :mod:`pytest_kvconform.faults.hook` as the one hook they
call (``adapters/fault_hook.py``).
"""

from __future__ import annotations

from pytest_kvconform.adapters import fault_hook

fault_hook.install(f"{__name__}.hook")
