"""The conformance suite: thin pytest front-ends over ``pytest_kvconform.checks``.

Collected by the plugin when ``--kv-conformance`` is given.  Parameters come
from the plugin's ``pytest_generate_tests``: ``kv_backend`` (discovered
backends), ``kv_layout`` (the six physical layouts), ``kv_case`` (spec cases),
``kv_need`` (False/True for the control plane's explicit seam).
"""
