"""KV-N clauses: the null block that ``BlockPool`` holds back, and sizing around it.

Expected numbers come from the case and first principles only: P physical pages,
P-1 usable ones (``Case.usable_blocks``), the block size, the model's declared
sequence limit and the oracle's page size; never from vLLM's sizing helpers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pytest_kvconform.adapters import compat, kv_planner
from pytest_kvconform.checks.common import Where, allocating, note_via
from pytest_kvconform.checks.errors import ClauseSkip, HarnessError, Unsupported
from pytest_kvconform.checks.geometry import geometry_for, page_stride
from pytest_kvconform.contract import oracle
from pytest_kvconform.contract.records import Case

# Extra pages per rank for KV-N5; the smallest is not on rank 0, so "take rank 0's
# count" and "take the largest" both show.
RANK_EXTRA_PAGES: tuple[int, ...] = (3, 0, 7)
# What one block of a BlockPool costs the test process, as measured (benchmarks/RESULTS.md,
# "What a case costs the test process"), rounded up for the allocator's own overhead.
POOL_BYTES_PER_BLOCK = 256


@dataclass(frozen=True)
class Plan:
    """What the production control plane produced for one memory budget."""

    worker_configs: list[Any]
    scheduler_config: Any
    max_model_len: int


def bytes_per_block(case: Case) -> int:
    """Memory one block costs a rank: one (padded) page for every layer."""
    return page_stride(case) * case.num_layers


def auto_fit_len(case: Case, usable: int) -> int:
    """Auto-fit plans for the usable blocks only, capped by the model's limit."""
    return min(compat.MODEL_SEQ_LIMIT, case.block_size * usable)


def plan(case: Case, memory: list[int], *, max_model_len: int = -1,
         num_gpu_blocks_override: int | None = None) -> Plan:
    """Size through the installed control plane, exactly as it is called: vllm-omni's
    production one, or vLLM's own engine core's where vllm-omni is absent (``via``)."""
    via = kv_planner.control_plane_via()
    if via is not None:
        note_via(via)
    vllm_config = kv_planner.control_plane_config(
        max_model_len=max_model_len, num_gpu_blocks_override=num_gpu_blocks_override,
        world_size=len(memory))
    specs = compat.worker_specs(replace(case, world_size=len(memory)))
    workers, scheduler = kv_planner.control_plane(vllm_config, specs, memory)
    return Plan(workers, scheduler, vllm_config.model_config.max_model_len)


def _plan_or_fail(where: Where, memory: list[int], what: str, **kwargs: Any) -> Plan:
    try:
        return plan(where.the_case, memory, **kwargs)
    except (ClauseSkip, HarnessError):  # not the control plane refusing: report as they are
        raise
    except Unsupported as exc:
        raise exc.skip(where.clause) from None
    except Exception as exc:
        raise where.fail(f"the control plane refused {what}: {type(exc).__name__}: "
                         f"{exc}") from exc


def _is_null(pool: Any, block: Any) -> bool:
    null = getattr(pool, "null_block", None)
    null_id = getattr(null, "block_id", 0)
    return block is null or bool(getattr(block, "is_null", False)) or block.block_id == null_id


# --- KV-N1 -----------------------------------------------------------------------


def check_kv_n1(case: Case) -> None:
    """KV-N1: a pool of P blocks hands out at most P-1, never the null block."""
    clause = "KV-N1"
    where = Where(clause, case=case)
    pages, usable = case.num_pages, case.usable_blocks
    pool = _block_pool(where, pages)
    free = pool.get_num_free_blocks()
    if free != usable:
        raise where.fail(f"a fresh BlockPool of {pages} blocks reports the wrong "
                         "number of free blocks (the null block is held back)",
                         expected=usable, actual=free)
    handed: list[Any] = []
    for _ in range(pages + 1):  # bounded: a pool that never runs dry still ends
        if pool.get_num_free_blocks() <= 0:
            break
        handed.extend(pool.get_new_blocks(1))
    _check_handed(where, pool, handed, usable, "one block at a time")
    _check_refuses(where, pool, 1, len(handed))

    pool = _block_pool(where, pages)
    _check_refuses(where, pool, pages, 0)
    handed = pool.get_new_blocks(usable)
    _check_handed(where, pool, handed, usable, f"get_new_blocks({usable})")
    pool.free_blocks(handed)
    again = pool.get_new_blocks(usable)
    _check_handed(where, pool, again, usable, "after free_blocks and reallocation")
    _check_refuses(where, pool, 1, len(again))


def _block_pool(where: Where, pages: int) -> Any:
    """vLLM's BlockPool of ``pages`` blocks, built here: bounded, or an ``oom`` error."""
    with allocating(where, f"building a BlockPool of {pages} blocks",
                    pages * POOL_BYTES_PER_BLOCK):
        return kv_planner.block_pool(pages)


def _check_handed(where: Where, pool: Any, handed: list[Any], usable: int,
                  how: str) -> None:
    case = where.the_case
    nulls = [b.block_id for b in handed if _is_null(pool, b)]
    if nulls:
        raise where.fail(f"the pool handed out the null block ({how})",
                         expected="no null block", actual=f"block_id {nulls[0]}")
    ids = [b.block_id for b in handed]
    if len(ids) != usable:
        raise where.fail(f"allocating until exhaustion ({how}) handed out the wrong "
                         f"number of blocks from {case.num_pages}",
                         expected=usable, actual=len(ids))
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise where.fail(f"the pool handed out one block twice ({how})",
                         expected="distinct block ids", actual=f"block_id {dup}")


def _check_refuses(where: Where, pool: Any, count: int, taken: int) -> None:
    """An exhausted pool refuses with the ValueError ``BlockPool.get_new_blocks`` documents.

    Any other exception is a crash, not a refusal, and fails the clause by name.
    """
    case = where.the_case
    asked = f"get_new_blocks({count}) with {taken} of {case.num_pages} blocks taken"
    try:
        extra = pool.get_new_blocks(count)
    except ValueError:
        return
    except Exception as exc:
        raise where.fail(f"{asked} raised {type(exc).__name__}: {exc}, not the "
                         "ValueError of an exhausted pool",
                         expected="ValueError", actual=f"{type(exc).__name__}: {exc}") \
            from exc
    ids = [b.block_id for b in extra]
    null = " (the null block)" if any(_is_null(pool, b) for b in extra) else ""
    raise where.fail(f"{asked} did not raise: it handed out block ids {ids}{null}",
                     expected="ValueError", actual=ids)


# --- KV-N2 / KV-N3 -----------------------------------------------------------------


def check_kv_n2(case: Case) -> None:
    """KV-N2: memory for exactly P pages gives P blocks, planned as P-1 usable."""
    _check_sizing(Where("KV-N2", case=case), case.num_pages, override=None)


def check_kv_n3(case: Case) -> None:
    """KV-N3: ``num_gpu_blocks_override = P`` (with more memory) gives KV-N2's numbers."""
    _check_sizing(Where("KV-N3", case=case), 2 * case.num_pages + 5, override=case.num_pages)


def _check_sizing(where: Where, memory_pages: int, *, override: int | None) -> None:
    case = where.the_case
    pages, usable = case.num_pages, case.usable_blocks
    memory = [memory_pages * bytes_per_block(case)]
    setting = f"memory for {memory_pages} pages" + (
        f" with num_gpu_blocks_override={override}" if override is not None else "")
    auto = _plan_or_fail(where, memory, f"{setting}, max_model_len auto-fit",
                         num_gpu_blocks_override=override)
    for rank, config in enumerate(auto.worker_configs):
        if config.num_blocks != pages:
            raise where.fail(f"{setting}: rank {rank}'s KVCacheConfig.num_blocks "
                             "must count every physical page, the null block included",
                             expected=pages, actual=config.num_blocks)
    if auto.scheduler_config.num_blocks != pages:
        raise where.fail(f"{setting}: the scheduler KVCacheConfig.num_blocks",
                         expected=pages,
                         actual=auto.scheduler_config.num_blocks)
    expected_len = auto_fit_len(case, usable)
    if auto.max_model_len != expected_len:
        raise where.fail(f"{setting}: auto-fit max_model_len must plan for the "
                         f"{usable} usable blocks, min({compat.MODEL_SEQ_LIMIT}, "
                         f"{case.block_size} * {usable})",
                         expected=expected_len, actual=auto.max_model_len)
    vllm_config = kv_planner.control_plane_config(max_model_len=auto.max_model_len,
                                              num_gpu_blocks_override=override)
    with allocating(where, f"building the scheduler's BlockPool of {pages} blocks",
                    pages * POOL_BYTES_PER_BLOCK):
        scheduler_pool = kv_planner.scheduler_block_pool(vllm_config, auto.scheduler_config)
    free = scheduler_pool.get_num_free_blocks()
    if free != usable:
        raise where.fail(f"{setting}: the scheduler's BlockPool must offer "
                         "num_blocks - 1 free blocks", expected=usable,
                         actual=free)
    _check_admission(where, memory, setting, override, usable)


def _check_admission(where: Where, memory: list[int], setting: str,
                     override: int | None, usable: int) -> None:
    """A fixed max_model_len of ``block_size * usable`` fits; one token more does not."""
    case = where.the_case
    fits = case.block_size * usable
    if fits + 1 > compat.MODEL_SEQ_LIMIT:
        return  # the model's own limit, not the null block, decides beyond it
    fixed = _plan_or_fail(where, memory, f"{setting}, max_model_len={fits} "
                          f"({usable} usable blocks of {case.block_size})",
                          max_model_len=fits, num_gpu_blocks_override=override)
    if fixed.max_model_len != fits:
        raise where.fail(f"{setting}: a fixed max_model_len was changed",
                         expected=fits, actual=fixed.max_model_len)
    try:
        over = plan(case, memory, max_model_len=fits + 1, num_gpu_blocks_override=override)
    except ValueError:
        return
    except Exception as exc:
        raise where.fail(f"{setting}: max_model_len={fits + 1} needs "
                         f"{usable + 1} blocks and must be refused with a ValueError",
                         expected="ValueError",
                         actual=f"{type(exc).__name__}: {exc}") from exc
    raise where.fail(f"{setting}: admission must plan for {usable} usable blocks, "
                     f"yet max_model_len={fits + 1} (needing {usable + 1} blocks) was "
                     "admitted", expected="ValueError",
                     actual=f"admitted with num_blocks={over.worker_configs[0].num_blocks}")


# --- KV-N4 -----------------------------------------------------------------------


def check_kv_n4(case: Case) -> None:
    """KV-N4: memory for fewer than two pages is refused with a clear error."""
    clause = "KV-N4"
    where = Where(clause, case=case)
    block = bytes_per_block(case)
    attempts = (
        ("memory for 1 page", block, -1),
        ("memory for 0 pages", 0, -1),
        ("memory for 2 pages minus 1 byte", 2 * block - 1, -1),
        (f"memory for 1 page, max_model_len={case.block_size}", block, case.block_size),
    )
    for what, memory, max_model_len in attempts:
        _check_refused(where, what, memory, max_model_len)
    two = _plan_or_fail(where, [2 * block], "memory for 2 pages (1 usable block)")
    got = (two.worker_configs[0].num_blocks, two.max_model_len)
    want = (2, auto_fit_len(case, 1))
    if got != want:
        raise where.fail("memory for 2 pages must give 2 blocks (1 usable) and "
                         "auto-fit max_model_len for 1 block",
                         expected=f"num_blocks={want[0]}, max_model_len={want[1]}",
                         actual=f"num_blocks={got[0]}, max_model_len={got[1]}")


def _check_refused(where: Where, what: str, memory: int, max_model_len: int) -> None:
    case = where.the_case
    try:
        got = plan(case, [memory], max_model_len=max_model_len)
    except ValueError as exc:
        if "memory" not in str(exc).lower():
            raise where.fail(f"{what} was refused, but the error does not say that "
                             "memory is short",
                             expected="a ValueError mentioning memory",
                             actual=str(exc)) from exc
        return
    except Exception as exc:
        raise where.fail(f"{what} must be refused with a ValueError",
                         expected="ValueError", actual=f"{type(exc).__name__}: {exc}") \
            from exc
    blocks = got.worker_configs[0].num_blocks
    raise where.fail(f"{what} was accepted: a config with no usable block "
                     "(the null block is held back)",
                     expected="ValueError mentioning memory",
                     actual=f"num_blocks={blocks}, max_model_len={got.max_model_len}")


# --- KV-N5 -----------------------------------------------------------------------


def rank_pages(case: Case) -> list[int]:
    """Pages per rank: at least three ranks with different memory, the smallest P."""
    ranks = max(case.world_size, len(RANK_EXTRA_PAGES))
    extra = [*RANK_EXTRA_PAGES, *range(8, 8 + ranks - len(RANK_EXTRA_PAGES))]
    return [case.num_pages + e for e in extra[:ranks]]


def check_kv_n5(case: Case) -> None:
    """KV-N5: ranks with different memory all get the smallest num_blocks, tensors shrunk."""
    clause = "KV-N5"
    where = Where(clause, case=case)
    pages = rank_pages(case)
    smallest = min(pages)
    block = bytes_per_block(case)
    setting = f"ranks with memory for {pages} pages"
    got = _plan_or_fail(where, [p * block for p in pages], setting)
    if len(got.worker_configs) != len(pages):
        raise where.fail(f"{setting}: one KVCacheConfig per rank",
                         expected=len(pages), actual=len(got.worker_configs))
    counts = [c.num_blocks for c in got.worker_configs]
    if counts != [smallest] * len(pages):
        rank = next(r for r, n in enumerate(counts) if n != smallest)
        raise where.fail(f"{setting}: every rank must get the smallest num_blocks; "
                         f"rank {rank} (memory for {pages[rank]} pages) differs "
                         f"(all ranks: {counts})", expected=smallest,
                         actual=counts[rank])
    for rank, config in enumerate(got.worker_configs):
        _check_rank_tensors(where, rank, pages[rank], config, smallest)


def _check_rank_tensors(where: Where, rank: int, rank_pages_: int, config: Any,
                        smallest: int) -> None:
    case = where.the_case
    name = config.kv_cache_layout
    if name not in oracle.PHYSICAL_LAYOUTS:
        raise where.fail(f"rank {rank}'s KVCacheConfig carries no resolved layout",
                         expected="a KVCacheLayout name", actual=name)
    if not config.kv_cache_tensors:
        raise where.fail(f"rank {rank}'s KVCacheConfig has no tensors",
                         layout=name)
    want = oracle.expected_tensor(name, geometry_for(case, num_blocks=smallest))
    for index, tensor in enumerate(config.kv_cache_tensors):
        for field in ("size", "layer_stride", "block_stride"):
            actual, expected = getattr(tensor, field), getattr(want, field)
            if actual != expected:
                raise where.fail(f"rank {rank} (memory for {rank_pages_} pages) "
                                 f"kv_cache_tensors[{index}].{field} must shrink to "
                                 f"{smallest} blocks", layout=name,
                                 expected=expected, actual=actual)
