"""KV-A: control plane to worker adoption, per backend (and per need) x world size.

``test_kv_aN`` runs for every backend's declared need; ``test_kv_aN_seam`` once
per need (False, True) through the control plane's explicit seam, so the
block-outermost path runs end to end even while no backend declares it.  Each
stands up production's engine on the ``kv_workers`` processes (``workers/deployment.py``).
The tests are generated from the clause table (``suite/generate.py``).
"""

from __future__ import annotations

from pytest_kvconform.suite.generate import generate

GENERATED = generate(globals())
