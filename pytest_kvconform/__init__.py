"""pytest-kvconform: vLLM KV-cache layout conformance for diffusion attention backends."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from pytest_kvconform.contract import CONTRACT_VERSION  # the one definition

__all__ = ["CONTRACT_VERSION", "Case", "CheckResult", "CheckResults", "__version__",
           "check_backend"]

if TYPE_CHECKING:
    from pytest_kvconform.api import CheckResult, CheckResults, check_backend
    from pytest_kvconform.contract.records import Case

# The plain Python API, imported on first use: importing the package (as pytest does for
# every run, --kv-conformance or not) stays free of torch, vLLM and the checks.  ``Case`` is
# the spec case record that ``check_backend(cases=...)`` and the fixtures take.
_LAZY = {"check_backend": "pytest_kvconform.api", "CheckResult": "pytest_kvconform.api",
         "CheckResults": "pytest_kvconform.api", "Case": "pytest_kvconform.contract.records"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
