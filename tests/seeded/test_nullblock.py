"""Seeded faults for the KV-N clauses: each turns exactly its clauses red.

The suite runs inline, in this process, so a fault planted with ``seed``
(``tests/seeding.py``; on the module attribute production reads at call time) is
live for the run and undone after it.  The faults are the package's
(``faults/plants.py``), which ``kvconform selftest`` seeds too.  The unpatched
selection runs too, so no clause fails by construction.  KV-N3 restates KV-N2's
numbers under an override, so a fault in the shared sizing path fails both, on purpose.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pytest_kvconform.faults import plants
from tests.conftest import needs_omni
from tests.seeding import Seeder, expect_run, literal

pytestmark = needs_omni

SELECT = ("-k", "kv_n and bf16_h8")
CLAUSES = ("KV-N1", "KV-N2", "KV-N3", "KV-N4", "KV-N5")


def _run(kv_run: Callable[..., pytest.RunResult], failing: dict[str, tuple[str, ...]]) -> None:
    """Run KV-N1..N5 on bf16_h8; exactly ``failing`` fail, each with its message lines.

    The first line of a message follows ``KV-Nx violated [case=bf16_h8...]``; later
    ones (``expected:``/``actual:``) are matched in order below it.
    """
    result = kv_run(*SELECT)
    lines: list[str] = []
    for clause, (first, *rest) in sorted(failing.items()):
        lines.append(literal(f"*{clause} violated [case=bf16_h8*{first}*"))
        lines.extend(literal(f"*{line}*") for line in rest)
    expect_run(result, failed=len(failing), passed=len(CLAUSES) - len(failing),
               clauses=failing, lines=lines)


def test_unpatched_selection_passes(kv_run: Callable[..., pytest.RunResult]) -> None:
    _run(kv_run, {})


def test_n1_pool_handing_out_the_null_block(kv_run: Callable[..., pytest.RunResult],
                                             seed: Seeder) -> None:
    """The pool counts the null block as free: one block more than it may hand out."""
    seed.plant(plants.HANDS_OUT_NULL_BLOCK)
    _run(kv_run, {"KV-N1": ("did not raise: it handed out block ids [0] (the null block)",)})


def test_n1_pool_crashing_when_exhausted(kv_run: Callable[..., pytest.RunResult],
                                         seed: Seeder) -> None:
    """An exhausted pool crashes with a RuntimeError: not the ValueError of a refusal."""
    seed.plant(plants.CRASHES_WHEN_EXHAUSTED)
    _run(kv_run, {"KV-N1": ("raised RuntimeError: free list corrupted, not the ValueError of "
                            "an exhausted pool", "expected: 'ValueError'",
                            "actual:   'RuntimeError: free list corrupted'")})


def test_sizing_forgetting_the_null_block(kv_run: Callable[..., pytest.RunResult],
                                          seed: Seeder) -> None:
    """The pre-0.29 sizing: auto-fit and admission both count the null block as usable.

    Planted in the two helpers ``get_kv_cache_configs`` hands its null-block
    reserve to, by handing one block back; KV-N5 compares ranks only and passes.
    """
    seed.plant(plants.FORGETS_NULL_BLOCK)
    _run(kv_run, {"KV-N2": ("auto-fit max_model_len must plan for the 15 usable", "expected: 240",
                            "actual:   256"),
                  "KV-N3": ("num_gpu_blocks_override=16: auto-fit", "expected: 240",
                            "actual:   256"),
                  "KV-N4": ("memory for 1 page was accepted", "actual:   'num_blocks=1")})


def test_n3_override_ignored(kv_run: Callable[..., pytest.RunResult], seed: Seeder) -> None:
    """The control plane sizes from profiled memory and drops num_gpu_blocks_override."""
    seed.plant(plants.OVERRIDE_IGNORED)
    _run(kv_run, {"KV-N3": ("memory for 37 pages with num_gpu_blocks_override=16: rank 0's "
                            "KVCacheConfig.num_blocks", "expected: 16", "actual:   37")})


def test_n4_missing_refusal(kv_run: Callable[..., pytest.RunResult], seed: Seeder) -> None:
    """No memory left after the null block is waved through instead of refused."""
    seed.plant(plants.NO_REFUSAL)
    _run(kv_run, {"KV-N4": ("memory for 1 page was accepted: a config with no usable block",)})


def test_n5_ranks_sized_for_the_largest(kv_run: Callable[..., pytest.RunResult],
                                        seed: Seeder) -> None:
    """Every rank gets the largest rank's memory instead of the smallest's."""
    seed.plant(plants.SIZED_FOR_LARGEST)
    _run(kv_run, {"KV-N5": ("every rank must get the smallest num_blocks; rank 0", "expected: 16",
                            "actual:   23")})


def test_n5_ranks_not_shrinking_tensors(kv_run: Callable[..., pytest.RunResult],
                                        seed: Seeder) -> None:
    """Ranks take the minimum count but keep tensors sized for their own memory."""
    seed.plant(plants.TENSORS_NOT_SHRUNK)
    _run(kv_run, {"KV-N5": ("rank 0 (memory for 19 pages) kv_cache_tensors[0].size must shrink "
                            "to 16", "expected: 32768", "actual:   38912")})


def test_n1_pool_out_of_memory_is_an_oom_error(kv_run: Callable[..., pytest.RunResult],
                                               seed: Seeder, pytester: pytest.Pytester) -> None:
    """An allocation that fails in the test process is the harness's ``oom``
    error naming the case and the bytes asked, never a crash or the backend's failure."""
    import json

    def exhausted(num_blocks: int) -> Any:
        raise MemoryError(f"cannot allocate a pool of {num_blocks} blocks")

    seed.replace("pytest_kvconform.adapters.kv_planner.block_pool", exhausted)
    result = kv_run("-k", "kv_n1 and bf16_h8", "--kv-report", "r.json")
    result.assert_outcomes(failed=1)  # pytest's outcome; the report says error
    [row] = json.loads((pytester.path / "r.json").read_text())["results"]
    assert (row["status"], row["error_kind"]) == ("error", "oom")
    assert ("KV-N1 [case=bf16_h8]: harness error (oom) while building a BlockPool of 16 "
            "blocks: it ran out of memory asking for about 4096 bytes") in row["reason"]
    assert "MemoryError: cannot allocate a pool of 16 blocks" in row["reason"]
    assert "violated" not in row["reason"]


def test_n1_pool_past_the_hosts_memory_is_refused_unallocated(seed: Seeder) -> None:
    """A case made in code (no file limits) asking for more than the host has: refused
    before vLLM allocates anything, as an ``oom`` error."""
    from pytest_kvconform.checks import nullblock
    from pytest_kvconform.contract import cases, memory

    case = next(c for c in cases.load_cases() if c.id == "bf16_h8")
    built: list[int] = []
    seed.replace("pytest_kvconform.adapters.kv_planner.block_pool", built.append)
    seed.replace("pytest_kvconform.contract.memory.host_available_bytes", lambda: 1000)
    with pytest.raises(memory.OutOfMemory) as info:
        nullblock.check_kv_n1(case)
    assert info.value.kind.value == "oom" and built == []
    assert str(info.value) == (
        "KV-N1 [case=bf16_h8]: harness error (oom) while building a BlockPool of 16 blocks: "
        "it would take about 4096 bytes, more than 0.5 of the 1000 bytes this host has "
        "available; not attempted")
