"""Hooks a backend repository implements (in a conftest.py or a plugin).

Nothing heavy is imported here: pytest loads this module on every run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest


@pytest.hookspec
def pytest_kvconform_backends(config: pytest.Config) -> Mapping[str, Any] | None:
    """Return extra diffusion attention backends to check, as ``name -> backend``.

    A backend is a class or an import string, ``"package.module:Class"`` (or
    ``"package.module.Class"``).  Names become test ids (``test_kv_l2[NAME]``),
    so keep them short; they must not collide with registry members.  Every
    implementation is called and the mappings are merged.
    """
