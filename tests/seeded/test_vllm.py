"""Seeded faults for the KV-V clauses (vLLM's own attention backends): each planted fault of
``faults/plants.py`` turns its clause red for the backend it is planted in, with a message
naming the clause and the backend, and the clean run passes; a repository's vLLM backend
registered through the hook is checked as family ``vllm`` (the V clauses, never the L ones)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from pytest_kvconform.faults import plants
from tests.seeding import Seeder, expect_run, register_backends

CPU_ATTN = ("-m", "kv_vllm", "--kv-backend", plants.VLLM_PLAIN)


def test_clean_cpu_attn_passes(kv_run) -> None:
    """Every V control passes on CPU_ATTN; KV-V5 does not apply (its customize_spec
    changes no page)."""
    expect_run(kv_run(*CPU_ATTN), passed=7, skipped=1)


@pytest.mark.parametrize(("patches", "test", "line"), [
    (plants.LAYOUTS_AS_NAMES, "test_kv_v2",
     "supported_kv_cache_layouts()[[]0[]] is 'LBHNC' of type str, not a KVCacheLayout member"),
    (plants.NO_LAYOUTS, "test_kv_v2", "supported_kv_cache_layouts() returned an empty tuple"),
    (plants.MIS_SIZED_PAGE, "test_kv_v2_page",
     "customize_spec() sizes an unquantized page of * at 32768 bytes, not 16384"),
    (plants.MISNAMED_VLLM_BACKEND, "test_kv_v1",
     "get_name() returned 'CPU_ATTENTION', but the backend is AttentionBackendEnum.CPU_ATTN"),
    (plants.MISSING_MODULE, "test_kv_v1_module",
     "AttentionBackendEnum.CPU_ATTN names 'vllm.v1.attention.backends.cpu_attention.*', but "
     "the installed vLLM has no module"),
], ids=["layouts_as_names", "no_layouts", "mis_sized_page", "misnamed", "missing_module"])
def test_planted_fault_fails_its_clause(kv_run, seed: Seeder, patches: Sequence[plants.Patch],
                                        test: str, line: str) -> None:
    clause = "KV-V1" if "v1" in test else "KV-V2"
    seed.plant(patches)
    # Its clause's controls (a broken declaration fails KV-V3..V5 too, which read it).
    result = kv_run(*CPU_ATTN, "-k", "kv_v1 or kv_v2")
    # Planted before discovery, a missing module leaves the member unusable: its own
    # controls do not apply (the registry's entry is the stack's finding).
    passed, skipped = (0, 3) if patches is plants.MISSING_MODULE else (3, 0)
    expect_run(result, failed=1, passed=passed, skipped=skipped, clauses=[clause], lines=[
        f"*{clause} violated [[]backend={plants.VLLM_PLAIN}[]]: {line}*",
        f"FAILED kvconform/test_vllm.py::{test}[[]{plants.VLLM_PLAIN}[]] - *"])


def test_repository_vllm_backend_is_checked_as_one(kv_run, pytester: pytest.Pytester) -> None:
    """A hook's AttentionBackend subclass runs the V clauses (its registration's module
    control does not apply: no registry entry) and none of the diffusion ones."""
    register_backends(pytester, {"MY_VLLM_ATTN": "tests.vllm_standins:MyVllmAttn",
                                 "BAD_VLLM_ATTN": "tests.vllm_standins:StringLayouts"})
    result = kv_run("-m", "kv_vllm", "--kv-backend", "MY_VLLM_ATTN",
                    "--kv-backend", "BAD_VLLM_ATTN", "-k", "kv_v1 or kv_v2")
    expect_run(result, failed=1, passed=5, skipped=2, clauses=["KV-V2"],
               in_order=False, lines=[
                   "*KV-V2 violated [[]backend=BAD_VLLM_ATTN[]]: supported_kv_cache_layouts()"
                   "[[]0[]] is 'LBHNC' of type str*",
                   "FAILED kvconform/test_vllm.py::test_kv_v2[[]BAD_VLLM_ATTN[]] - *"])
    layout = pytester.runpytest("--kv-conformance", "-p", "no:cacheprovider", "-p", "no:xdist",
                                "--kv-backend", "MY_VLLM_ATTN", "--collect-only", "-q",
                                "-m", "kv_diffusion", "-k", "test_kv_l1")
    ids = [line for line in layout.stdout.lines if "::test_kv_" in line]
    assert ids == ["kvconform/test_layout.py::test_kv_l1[no-backend]",
                   "kvconform/test_layout.py::test_kv_l1_name[no-backend]"], ids
