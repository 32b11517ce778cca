"""pytest-kvconform: vLLM KV-cache layout conformance for diffusion attention backends."""

__version__ = "0.1.0"

# Version of contract.md (shipped in this package) that the clause ids refer to.  Reports of
# different contract versions are not merged.
CONTRACT_VERSION = "1"

__all__ = ["CONTRACT_VERSION", "__version__"]
