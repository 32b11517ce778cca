"""The KV-L7 stand-in backends (``pytest_kvconform/adapters/paged_standins.py``), loadable
from the repository as a plugin: ``-p tests.paged_standins``."""

from pytest_kvconform.adapters.paged_standins import STANDINS, pytest_kvconform_backends

__all__ = ["STANDINS", "pytest_kvconform_backends"]
