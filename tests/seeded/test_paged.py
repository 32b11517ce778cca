"""KV-L7 with stand-in paged backends: the conforming one passes on CPU, each seeded
misread fails naming the first wrong block, and FLASH_ATTN skips on CPU for its kernel.

The stand-ins (``pytest_kvconform/adapters/paged_standins.py``) are registered through
the plugin's hook in a pytester conftest (``tests/seeding.py``), as a backend repository
would register its own; the allocation fault is planted with ``seed``.
"""

from __future__ import annotations

import itertools

import pytest

from tests.conftest import needs_omni
from tests.seeding import Seeder, backend_args, expect_run, register_backends

pytestmark = needs_omni


def _backends(pytester: pytest.Pytester, *names: str) -> list[str]:
    """Register the named stand-ins (registry members pass through) and select them."""
    from pytest_kvconform.adapters.paged_standins import STANDINS

    register_backends(pytester, {n: STANDINS[n] for n in names if n in STANDINS})
    return backend_args(*names)


def test_l7_conforming_standins_pass_on_cpu(kv_run, pytester: pytest.Pytester) -> None:
    result = kv_run("-k", "kv_l7", *_backends(pytester, "PAGED_OK", "PAGED_OK_BS"), "-rA")
    expect_run(result, passed=2)


def test_l7_misreads_fail_naming_first_wrong_block(kv_run, pytester: pytest.Pytester) -> None:
    result = kv_run("-k", "kv_l7", *_backends(pytester, "PAGED_NO_TABLE", "PAGED_BAD_STRIDE",
                                              "PAGED_TRUNCATES"))
    expect_run(result, failed=3, clauses=["KV-L7"] * 3, in_order=False, lines=[
        "*KV-L7 violated [[]backend=PAGED_NO_TABLE, case=l7_f32, layout=LBHNC[]]*request 0*"
        "first block whose output differs: logical block 0 (physical block *max abs error*"
        "> tolerance 0.001 for float32*",
        "*KV-L7 violated [[]backend=PAGED_BAD_STRIDE, case=l7_f32, layout=BLHNC[]]*"
        "first block whose output differs: logical block 0 (physical block *",
        "*KV-L7 violated [[]backend=PAGED_TRUNCATES, case=l7_f32, layout=LBHNC[]]*"
        "first block whose output differs: logical block 2 (physical block *",
    ])


def test_l7_skips_by_kernel_device_on_cpu(kv_run, pytester: pytest.Pytester) -> None:
    result = kv_run("-k", "kv_l7", "-rs", "--kv-device", "cpu",
                    *_backends(pytester, "FLASH_ATTN", "TORCH_SDPA", "PAGED_CUDA_ONLY"))
    expect_run(result, skipped=3, in_order=False, lines=[
        "SKIPPED*KV-L7: needs the backend's kernel device (CUDA): FLASH_ATTN's paged path "
        "runs vLLM's native paged kernels*which needs CUDA*",
        "SKIPPED*KV-L7: the backend does not declare supports_paged_kv*",
        "SKIPPED*KV-L7: needs the backend's kernel device (CUDA): the backend declares its "
        "paged kernel runs on ('cuda',)*so it needs CUDA*",
    ])
    assert "not implemented" not in result.stdout.str()


def test_l7_block_ids_are_scattered() -> None:
    from pytest_kvconform.checks import paged

    case = paged.CASES["float32"]
    ids = paged.choose_block_ids(case, 12)
    flat = [b for row in ids for b in row]
    assert 0 not in flat and len(set(flat)) == len(flat)
    assert all(b != j for row in ids for j, b in enumerate(row))
    assert all(abs(b - a) != 1 for row in ids for a, b in itertools.pairwise(row))
    assert [len(row) for row in ids] == paged._blocks_needed(case)


def test_l7_layouts_follow_the_declared_need() -> None:
    from pytest_kvconform.adapters.paged_standins import PagedOk, PagedOkBlockStride
    from pytest_kvconform.checks import paged

    accepted, refused = paged.accepted_layouts(PagedOk)
    assert sorted(accepted) == ["LBHNC", "LBNHC", "LHBNC"]
    assert sorted(refused) == ["BHLNC", "BLHNC", "BLNHC"]
    accepted, _ = paged.accepted_layouts(PagedOkBlockStride)
    assert sorted(accepted) == ["BHLNC", "BLHNC", "BLNHC"]


def test_l7_setup_failure_is_a_harness_error(seed: Seeder) -> None:
    """Production allocation failing is the harness's problem, never the backend's."""
    from pytest_kvconform.adapters.paged_standins import PagedOk
    from pytest_kvconform.checks import paged
    from pytest_kvconform.contract.outcomes import ClauseFailure, HarnessError
    from pytest_kvconform.contract.records import BackendUnderTest

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("allocator exploded")

    seed.replace("pytest_kvconform.adapters.kv_allocation.init_kv_cache", broken)
    backend = BackendUnderTest("PAGED_OK", "pytest_kvconform.adapters.paged_standins:PagedOk",
                               "hook", cls=PagedOk)
    with pytest.raises(HarnessError, match="allocator exploded") as info:
        paged.check_kv_l7(backend, "cpu")
    assert not isinstance(info.value, ClauseFailure)
