"""KV-L7: what a paged backend reads through the block table is the K/V written there.

For every layout the backend's production path accepts, the cache is allocated
through production code (control plane, adoption, ``init_kv_cache``), K/V for
two requests is placed at shuffled, non-contiguous block ids (never block i for
logical block i), and the backend's ``forward_paged`` output is compared with
torch SDPA over the same K/V laid out densely.  A mismatch is localised by
re-running the backend on growing block prefixes, so the failure names the first
logical block whose K/V was misread.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Any

from pytest_kvconform.adapters import compat, paged_drivers
from pytest_kvconform.adapters.paged_drivers import Row
from pytest_kvconform.checks.common import Where, backend_class, declared_need
from pytest_kvconform.checks.errors import ClauseFailure, ClauseSkip, SkipKind, Unsupported
from pytest_kvconform.contract.outcomes import HarnessError
from pytest_kvconform.contract.records import BackendUnderTest, Case

CLAUSE = "KV-L7"
QUERY_HEADS_PER_KV_HEAD = 2  # GQA, so a backend that pairs heads wrongly is caught too
# How a failure names where the misread starts (what a localised failure says).
FIRST_WRONG_BLOCK = "first block whose output differs"
# Max abs error allowed against the float64 reference, per dtype of Q/K/V.
TOLERANCE = {"float32": 1e-3, "float16": 6e-3, "bfloat16": 3e-2}
_SEED = 20260


def _case(dtype: str, tag: str) -> Case:
    return Case(id=f"l7_{tag}", file="<kv_l7>", dtype=dtype, block_size=16, num_kv_heads=2,
                head_size=32, num_layers=2, num_pages=12)


CASES = {"float32": _case("float32", "f32"), "bfloat16": _case("bfloat16", "bf16"),
         "float16": _case("float16", "f16")}


@dataclass(frozen=True)
class _Step:
    """One paged call: ``name`` for messages, and its rows."""

    name: str
    rows: tuple[Row, ...]


def _steps(case: Case) -> tuple[_Step, ...]:
    bs = case.block_size
    long_a, long_b = 2 * bs + bs // 2, 3 * bs - 3  # both end inside their third block
    return (
        _Step("prefill (every token queries, K/V written this call)",
              (Row(0, long_a, long_a), Row(1, long_b, long_b))),
        _Step("cached read (a short query reads K/V written by the previous call)",
              (Row(0, long_a, bs // 2 + 3), Row(1, long_b, 5))),
    )


def _lengths(case: Case) -> list[int]:
    """Tokens per request (the prefill step writes them all)."""
    return [r.seq_len for r in _steps(case)[0].rows]


def _blocks_needed(case: Case) -> list[int]:
    return [-(-n // case.block_size) for n in _lengths(case)]


def choose_block_ids(case: Case, num_blocks: int) -> list[list[int]]:
    """Shuffled, non-contiguous block ids per request; never the null block 0, never
    block i for logical block i, never ascending."""
    need = _blocks_needed(case)
    usable = list(range(1, num_blocks))
    if len(usable) < sum(need):
        raise HarnessError(f"KV-L7 set-up: {num_blocks} blocks allocated, {sum(need) + 1} "
                           "needed (with the null block)")
    rng = random.Random(_SEED)
    for _ in range(1000):
        rng.shuffle(usable)
        ids, at = [], 0
        for n in need:
            ids.append(usable[at:at + n])
            at += n
        flat = [b for row in ids for b in row]
        fixed = any(b == j for row in ids for j, b in enumerate(row))
        contiguous = any(abs(b - a) == 1 for row in ids for a, b in itertools.pairwise(row))
        if not fixed and not contiguous and flat != sorted(flat):
            return ids
    raise HarnessError(f"KV-L7 set-up: no scattered block table found in {num_blocks} blocks")


def kernel_driver(backend: BackendUnderTest, cls: Any, device: str) -> str:
    """Which driver runs the backend here; skips when its kernel's device is absent."""
    try:
        declared = paged_drivers.declared_devices(cls)
    except TypeError as exc:
        raise ClauseFailure(CLAUSE, str(exc), backend=backend.name) from exc
    kind = device.split(":", 1)[0]
    if declared is None:
        if kind not in paged_drivers.NATIVE_DEVICES:
            raise ClauseSkip(CLAUSE, "needs the backend's kernel device (CUDA): "
                             f"{backend.name}'s paged path runs {paged_drivers.NATIVE_KERNEL}, "
                             f"which needs CUDA; this process's device is {device}",
                             SkipKind.HARDWARE)
        missing = paged_drivers.native_kernels_missing()
        if missing:
            raise ClauseSkip(CLAUSE, f"needs {paged_drivers.NATIVE_KERNEL}: {missing}",
                             SkipKind.ENVIRONMENT)
        return "native"
    if kind not in declared:
        wanted = "CUDA" if declared == ("cuda",) else " or ".join(declared)
        raise ClauseSkip(CLAUSE, f"needs the backend's kernel device ({wanted}): the backend "
                         f"declares its paged kernel runs on {declared} "
                         f"({paged_drivers.DEVICES_ATTR}), so it needs {wanted}; this "
                         f"process's device is {device}", SkipKind.HARDWARE)
    return "portable"


def accepted_layouts(cls: Any) -> tuple[list[str], dict[str, str]]:
    """Layouts the production path accepts for the backend, and why the others are not."""
    accepted: list[str] = []
    refused: dict[str, str] = {}
    supported = getattr(cls, "supported_kv_cache_layouts", None)
    declared = supported() if callable(supported) else None
    declared_names = None if declared is None else {getattr(x, "name", x) for x in declared}
    for name in compat.LAYOUT_NAMES:
        config = compat.plain_vllm_config()
        config.cache_config.kv_cache_layout = name
        try:
            compat.assert_backend_layout_supported(config, cls)
        except ValueError as exc:
            refused[name] = f"vllm-omni refuses it for this backend ({exc})"
            continue
        if declared_names is not None and name not in declared_names:
            refused[name] = "not in the backend's supported_kv_cache_layouts()"
            continue
        accepted.append(name)
    return accepted, refused


def _cases_for(driver: str, device: str) -> list[Case]:
    if driver == "native":  # vLLM's FlashAttention kernels take fp16/bf16 only
        return [CASES["bfloat16"], CASES["float16"]]
    if device.startswith("cuda"):
        return [CASES["float32"], CASES["bfloat16"], CASES["float16"]]
    return [CASES["float32"], CASES["bfloat16"]]


def check_kv_l7(backend: BackendUnderTest, device: str = "cpu") -> str:
    """KV-L7: the paged read path matches a dense reference on every accepted layout.

    Returns a one-line account of what was covered and what did not apply.
    """
    cls = backend_class(CLAUSE, backend)
    if not getattr(cls, "supports_paged_kv", False):
        raise ClauseSkip(CLAUSE, "the backend does not declare supports_paged_kv; it has no "
                         "paged read path", SkipKind.NOT_APPLICABLE)
    compat.require_omni(CLAUSE)
    driver = kernel_driver(backend, cls, device)
    need = declared_need(CLAUSE, backend)
    accepted, refused = accepted_layouts(cls)
    if not accepted:
        raise ClauseSkip(CLAUSE, "no layout is accepted for this backend: " + "; ".join(
            f"{k}: {v}" for k, v in refused.items()), SkipKind.NOT_APPLICABLE)
    cases = _cases_for(driver, device)
    for case in cases:
        for layout in accepted:
            _check_layout(backend, cls, driver, device, need, case, layout)
    not_applicable = "; ".join(f"{k} not applicable: {v}" for k, v in refused.items())
    return (f"{driver} driver on {device}: {', '.join(accepted)} x "
            f"{', '.join(c.id for c in cases)} match the dense reference"
            + (f"; {not_applicable}" if not_applicable else ""))


# --- one layout -------------------------------------------------------------------


def _make_driver(driver: str, backend: BackendUnderTest, cls: Any, case: Case,
                 device: str) -> Any:
    heads = case.num_kv_heads * QUERY_HEADS_PER_KV_HEAD
    if driver == "native":
        return paged_drivers.NativeDriver(cls, case, device, heads, backend.name, backend.path)
    return paged_drivers.PortableDriver(cls, case, device, heads)


def _check_layout(backend: BackendUnderTest, cls: Any, driver_kind: str, device: str,
                  need: bool, case: Case, layout: str) -> None:
    driver = _make_driver(driver_kind, backend, cls, case, device)
    try:
        alloc = driver.allocate(layout, need, None, lambda n: choose_block_ids(case, n))
    except (ClauseSkip, ClauseFailure, HarnessError):
        raise
    except Unsupported as exc:
        raise exc.skip(CLAUSE) from None
    except Exception as exc:
        raise HarnessError(f"KV-L7 set-up ({driver.name} driver, layout {layout}, case "
                           f"{case.id}): allocating through the production path failed: "
                           f"{exc!r}") from exc
    data = _Data(case, driver.layer_names, driver.num_heads)
    driver.write(data.keys, data.values)
    ctx = _Ctx(backend, case, layout, alloc.block_ids, driver, data)
    for step in _steps(case):
        for layer in driver.layer_names:
            ctx.compare(step, layer)


class _Data:
    """Q/K/V per layer and request (CPU, in the case's dtype), from a fixed seed."""

    def __init__(self, case: Case, layers: list[str], num_heads: int) -> None:
        import torch

        gen = torch.Generator().manual_seed(_SEED)
        dtype = compat.torch_dtype(case.dtype)
        lengths = _lengths(case)
        d, hkv = case.head_size, case.num_kv_heads

        def draw(heads: int) -> dict[str, list[Any]]:
            return {name: [torch.randn((n, heads, d), generator=gen).to(dtype) for n in lengths]
                    for name in layers}

        self.keys, self.values, self.queries = draw(hkv), draw(hkv), draw(num_heads)


def reference(query: Any, key: Any, value: Any) -> Any:
    """Dense SDPA in float64 on CPU: [Q, Hq, D] x [S, Hkv, D] -> [Q, Hq, D], non-causal."""
    import torch

    q, k, v = (t.detach().to("cpu", torch.float64) for t in (query, key, value))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=q.shape[-1] ** -0.5)
    return out.transpose(0, 1)


class _Ctx:
    """One layout x case: runs steps, compares, localises, words the failure."""

    def __init__(self, backend: BackendUnderTest, case: Case, layout: str,
                 block_ids: list[list[int]], driver: Any, data: _Data) -> None:
        self.backend, self.case, self.layout = backend, case, layout
        self.where = Where(CLAUSE, backend=backend.name, case=case, layout=layout)
        self.block_ids, self.driver, self.data = block_ids, driver, data
        self.tol = TOLERANCE[case.dtype]

    def _inputs(self, layer: str, rows: tuple[Row, ...]) -> tuple[Any, Any, Any]:
        import torch

        d = self.data
        pick = [(d.queries[layer][r.request][r.kv_start:r.seq_len],
                 d.keys[layer][r.request][r.kv_start:r.seq_len],
                 d.values[layer][r.request][r.kv_start:r.seq_len]) for r in rows]
        return tuple(torch.cat(parts) for parts in zip(*pick, strict=True))

    def _run(self, step: str, layer: str, rows: tuple[Row, ...]) -> Any:
        import torch

        query, key, value = self._inputs(layer, rows)
        try:
            out = self.driver.forward(layer, list(rows), query, key, value)
        except HarnessError:
            raise
        except Exception as exc:
            raise self._fail(f"{step}, layer {layer}: forward_paged raised {exc!r}") from exc
        want = query.shape[0] * query.shape[1] * self.case.head_size
        if not isinstance(out, torch.Tensor) or out.numel() != want:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise self._fail(f"{step}, layer {layer}: forward_paged returned {shape}, expected "
                             f"{tuple(query.shape)} ([tokens, heads, head_size])")
        return out.detach().to("cpu", torch.float64).reshape(query.shape)

    def _errors(self, layer: str, rows: tuple[Row, ...], out: Any) -> list[float]:
        """Max abs error per row against the dense reference."""
        d, errs, at = self.data, [], 0
        for r in rows:
            q = d.queries[layer][r.request][r.kv_start:r.seq_len]
            ref = reference(q, d.keys[layer][r.request][:r.seq_len],
                            d.values[layer][r.request][:r.seq_len])
            got = out[at:at + r.query_len]
            at += r.query_len
            diff = (got - ref).abs()
            errs.append(float("inf") if diff.isnan().any() else float(diff.max()))
        return errs

    def compare(self, step: _Step, layer: str) -> None:
        out = self._run(step.name, layer, step.rows)
        errs = self._errors(layer, step.rows, out)
        bad = [i for i, e in enumerate(errs) if e > self.tol]
        if not bad:
            return
        row = step.rows[bad[0]]
        first = self._first_wrong_block(layer, row)
        table = self.block_ids[row.request]
        if first is None:
            where = ("no single-query prefix probe differs, so the misread depends on the "
                     "batch (several requests or query tokens at once)")
        else:
            j, probe_err = first
            where = (f"{FIRST_WRONG_BLOCK}: logical block {j} (physical block "
                     f"{table[j]}; probe error {probe_err:.3g})")
        raise self._fail(
            f"{step.name}, layer {layer}, request {row.request} (seq_len {row.seq_len}, "
            f"{row.query_len} query tokens): the paged output differs from the dense SDPA "
            f"reference on the same K/V; {where}; block table {table}; max abs error "
            f"{max(errs):.3g} > tolerance {self.tol:g} for {self.case.dtype}",
            expected=f"max abs error <= {self.tol:g}", actual=f"{max(errs):.3g}")

    def _first_wrong_block(self, layer: str, row: Row) -> tuple[int, float] | None:
        """Re-run with one query token over growing block prefixes of the request."""
        bs = self.case.block_size
        for j in range(-(-row.seq_len // bs)):
            n = min((j + 1) * bs, row.seq_len)
            probe = (Row(row.request, n, 1),)
            try:
                out = self._run("probe", layer, probe)
            except ClauseFailure:
                return j, float("inf")
            err = self._errors(layer, probe, out)[0]
            if err > self.tol:
                return j, err
        return None

    def _fail(self, detail: str, **kw: Any) -> ClauseFailure:
        return self.where.fail_at(self.layout, detail, **kw)
