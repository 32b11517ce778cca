"""``kvconform matrix``: the suite across the supported stacks, one tox environment a leg.

Apart from ``session/`` (one ``--kv-conformance`` run in one environment): this package
starts such runs in other environments and combines their reports.  ``release_matrix``
runs the legs, ``tox_leg`` one leg, ``stack_probe`` runs inside a leg's environment.
"""
