"""One ``--kv-conformance`` run: options, selection, results, start-up checks, xfail
entries and the xdist glue.  Imports nothing (``options`` is read with the plugin off)."""
