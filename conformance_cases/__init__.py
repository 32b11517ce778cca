"""Spec cases shipped with pytest-kvconform (TOML data, read with importlib.resources)."""
