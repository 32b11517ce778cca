"""``kvconform gpu-check``: the checks only a CUDA host runs, against the installed stack.

KV-A6 (a free-memory-sized allocation probed past 2^31 and 2^32 bytes), KV-L7 on CUDA
(the paged stand-ins and the native backends) and the xdist device pinning of
``pytest --kv-conformance -n auto``.  Everything but the CUDA calls in :mod:`.host` is
plain Python the plugin's own tests run on CPU.
"""
