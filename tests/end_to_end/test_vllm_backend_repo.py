"""A backend repository that ships a vLLM attention backend (family ``vllm``): the built
wheel and the repository installed beside it, the suite run from the repository as its CI
runs it.  A subclass of vLLM's CPU_ATTN class under its own name conforms (exit 0); one
declaring its layouts by name fails KV-V2, naming the clause and the backend (exit 1)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.backend_repo_files import pyproject
from tests.wheel_env import WheelEnv, run

VLLM_BACKENDS = '''
"""A repository's vLLM attention backends: CPU_ATTN's class under names of their own."""

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend


class MyVllmBackend(CPUAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "MY_VLLM_ATTN"


class NamedLayoutsBackend(CPUAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "MY_VLLM_NAMES"

    @classmethod
    def supported_kv_cache_layouts(cls):
        return ("LBHNC",)
'''
VLLM_REPO = {
    "pyproject.toml": pyproject("my-vllm-backends") + textwrap.dedent('''
        [project.entry-points."pytest_kvconform.backends"]
        MY_VLLM_ATTN = "my_vllm_backends.attention:MyVllmBackend"
        MY_VLLM_NAMES = "my_vllm_backends.attention:NamedLayoutsBackend"

        [tool.setuptools]
        packages = ["my_vllm_backends"]
    '''),
    "my_vllm_backends/__init__.py": "",
    "my_vllm_backends/attention.py": VLLM_BACKENDS,
}


@pytest.fixture(scope="module")
def vllm_repo(wheel_env: WheelEnv, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[Path, Path]:
    """(venv python, repository): the vLLM backend repository installed beside the wheel."""
    return wheel_env.install_repo(tmp_path_factory.mktemp("vllm-repo") / "my-vllm-backends",
                                  VLLM_REPO)


def _suite(python: Path, repo: Path, *args: str) -> tuple[int, str]:
    done = run([str(python), "-m", "pytest", "--kv-conformance", "-p", "no:cacheprovider",
                *args], repo, timeout=900)
    return done.returncode, done.stdout + done.stderr


def test_a_conforming_vllm_backend_qualifies(vllm_repo: tuple[Path, Path]) -> None:
    python, repo = vllm_repo
    code, out = _suite(python, repo, "--kv-backend", "MY_VLLM_ATTN", "--kv-strict")
    assert code == 0, out[-6000:]
    assert "kvconform: verdict for MY_VLLM_ATTN: qualified" in out, out[-6000:]
    assert "kvconform/test_vllm.py" in out and "test_kv_l1[MY_VLLM_ATTN]" not in out


def test_layouts_declared_by_name_fail_kv_v2(vllm_repo: tuple[Path, Path]) -> None:
    python, repo = vllm_repo
    code, out = _suite(python, repo, "--kv-backend", "MY_VLLM_NAMES", "--kv-strict")
    assert code == 1, out[-6000:]
    assert "FAILED kvconform/test_vllm.py::test_kv_v2[MY_VLLM_NAMES] - " in out, out[-6000:]
    assert ("KV-V2 violated [backend=MY_VLLM_NAMES]: supported_kv_cache_layouts()[0] is "
            "'LBHNC' of type str, not a KVCacheLayout member") in out, out[-6000:]
    verdict = next(line for line in out.splitlines()
                   if line.startswith("kvconform: verdict for MY_VLLM_NAMES: "))
    assert "not qualified" in verdict and "KV-V2 test_kv_v2[MY_VLLM_NAMES]" in verdict, verdict
