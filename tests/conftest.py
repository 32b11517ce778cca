"""Shared fixtures for the plugin's own tests."""

from __future__ import annotations

import importlib.util
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

import pytest
from _pytest import pytester as _pytester_mod

HAVE_OMNI = importlib.util.find_spec("vllm_omni") is not None
needs_omni = pytest.mark.skipif(not HAVE_OMNI, reason="vllm-omni not installed")

# Inline pytester runs of the conformance suite: quiet, no cache, no xdist.
KV_ARGS = ("--kv-conformance", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly")


@pytest.fixture
def kv_run(pytester: pytest.Pytester):
    """Run the conformance suite inline in the pytester directory."""

    def run(*args: str) -> pytest.RunResult:
        return pytester.runpytest(*KV_ARGS, *args)

    return run


_KEEP_ROOTS = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib",
                                                        "platlib")} |
                    {str(Path(__file__).resolve().parents[1] / "pytest_kvconform")})


class _KeepInstalledModules(_pytester_mod.SysModulesSnapshot):
    """Inline runs keep installed packages imported.

    pytester drops every module an inline run imported; re-importing torch,
    vLLM or vllm-omni in the same process re-registers native operators and
    crashes.  Only modules from the pytester directories are dropped.
    """

    def __init__(self, preserve: Callable[[str], bool] | None = None) -> None:
        def keep(name: str) -> bool:
            if preserve is not None and preserve(name):
                return True
            top = sys.modules.get(name.partition(".")[0])
            file = getattr(top, "__file__", None) or ""
            paths = [str(p) for p in getattr(top, "__path__", [])]
            return any(f.startswith(_KEEP_ROOTS) for f in [file, *paths] if f)

        super().__init__(preserve=keep)


_ORIGINAL_SNAPSHOT = _pytester_mod.SysModulesSnapshot


def pytest_configure(config: pytest.Config) -> None:
    _pytester_mod.SysModulesSnapshot = _KeepInstalledModules  # type: ignore[misc]


def pytest_unconfigure(config: pytest.Config) -> None:
    _pytester_mod.SysModulesSnapshot = _ORIGINAL_SNAPSHOT  # type: ignore[misc]
