"""A process hosting production's engine knows which call into the backend's code it makes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pytest_kvconform.adapters import backend_calls
from tests.paths import ROOT

BACKEND = '''
import os
import torch


class MyBackend:
    @classmethod
    def get_impl_cls(cls):
        if os.environ.get("EXIT_IN_IMPL"):
            os._exit(0)
        return MyImpl

    @staticmethod
    def get_name():
        return "MINE"


class MyImpl:
    def __init__(self):
        torch.empty(1 << 40, dtype=torch.uint8)  # 1 TiB


class Imported(torch.nn.Module):
    pass
'''


@pytest.fixture
def backend_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "kvconform_marked_backend.py").write_text(BACKEND)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_an_exception_raised_through_the_backends_code_names_the_call(
        backend_module: Path) -> None:
    backend_calls.instrument("MINE", "kvconform_marked_backend.MyBackend")
    import kvconform_marked_backend as module

    assert module.MyBackend.get_name() == "MINE"  # still answers as before
    with pytest.raises(RuntimeError, match="tried to allocate 1099511627776 bytes") as info:
        module.MyBackend.get_impl_cls()()
    assert backend_calls.raised_through(info.value) == "MyImpl.__init__()"
    wrapped_from = RuntimeError("production's own wrapper")
    wrapped_from.__cause__ = info.value
    assert backend_calls.raised_through(wrapped_from) == "MyImpl.__init__()"
    assert backend_calls.raised_through(ValueError("elsewhere")) is None
    assert not hasattr(module.Imported.forward, "__wrapped__")  # not the backend's own class


def test_the_marker_names_the_call_a_process_died_in(backend_module: Path,
                                                     tmp_path: Path) -> None:
    marker = tmp_path / "worker.log.backend-call"
    script = textwrap.dedent(f'''
        import sys
        sys.path[:0] = [{str(backend_module)!r}, {str(ROOT)!r}]
        from pytest_kvconform.adapters import backend_calls
        backend_calls.open_marker({str(marker)!r})
        backend_calls.instrument("MINE", "kvconform_marked_backend.MyBackend")
        import kvconform_marked_backend as module
        module.MyBackend.get_name()
        module.MyBackend.get_impl_cls()
    ''')
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "EXIT_IN_IMPL": "1"}, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert backend_calls.read_marker(str(marker)) == "MyBackend.get_impl_cls()"
    marker.write_text("")
    assert backend_calls.read_marker(str(marker)) is None
