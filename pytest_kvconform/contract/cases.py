"""Loading and validating the spec cases in ``conformance_cases/*.toml``.

Stdlib only.  A bad file gets one :class:`CaseFileError` naming the file, the
case and the key, so a typo never turns into a silently skipped case.

Every number is bounded: a case file is input, and a number past what any
clause needs must not become a host-sized allocation in the test process (a BlockPool
of 10^12 blocks grew pytest until the kernel's OOM killer ended it, with no verdict).
:data:`LIMITS` bounds each key from the sizes the clauses use; :func:`kv_bytes_limit`
bounds the KV cache a case describes by what the oracle can tabulate and by this
host's available memory.  A number past its limit is a usage error naming the file,
the case, the key and the limit.
"""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

from pytest_kvconform.contract import memory, records
from pytest_kvconform.contract.records import Case

MIN_PAGES = 2  # the null block plus one usable block
CASE_DTYPES = ("bfloat16", "float16", "float32")  # the dtype names a case file may use
DTYPE_SIZES: dict[str, int] = {name: records.DTYPE_SIZES[name] for name in CASE_DTYPES}
_INT_KEYS = ("block_size", "num_kv_heads", "head_size", "num_layers", "num_pages", "world_size",
             "num_groups")
_OPTIONAL_INT_KEYS = ("kernel_block_size", "page_size_padded", "expected_usable_blocks")
_STR_KEYS = ("dtype", "description")
_KNOWN_KEYS = frozenset({"id", *_INT_KEYS, *_OPTIONAL_INT_KEYS, *_STR_KEYS})


@dataclass(frozen=True)
class Limit:
    """The largest value a case key may take, and why (the usage error says both)."""

    value: int
    why: str


# Per key; the keys not listed are bounded by others (kernel_block_size divides
# block_size, expected_usable_blocks < num_pages, num_groups <= num_layers,
# page_size_padded through the KV cache's bytes).
LIMITS: dict[str, Limit] = {
    "num_pages": Limit(1 << 16, "KV-N1 builds BlockPools of this many blocks in the test "
                       "process and walks them one block at a time: 0.5 s at 65536 pages, "
                       "6 s at 2^20"),
    "block_size": Limit(2048, "tokens per block: vLLM's attention backends use a few hundred "
                        "at most"),
    "num_kv_heads": Limit(256, "KV heads per layer: the largest models have 128"),
    "head_size": Limit(1024, "elements per head: the largest models use 576 (MLA)"),
    "num_layers": Limit(256, "each layer is an attention module of the KV-A worker's model; "
                        "the largest models have about 128"),
    "world_size": Limit(8, "each rank is a KV-A worker process holding its own copy of the "
                        "cache (a GPU each on CUDA)"),
}
MAX_FILE_BYTES = 1 << 20  # a case file is a few dozen lines
MAX_CASES = 256  # in one run, across files: each case multiplies the collected tests
MAX_ID_CHARS = 64  # an id is part of every test id
MAX_DESCRIPTION_CHARS = 1000
# The KV cache one case describes (num_layers * num_pages * page, padding included):
# KV-S2 materialises one oracle address per byte of it, which the oracle refuses past
# oracle.MAX_TABLE_CELLS (tests/contract/test_cases.py checks that the two agree).
MAX_KV_BYTES = 1 << 26
# What one KV byte costs the test process while KV-S2 writes its byte map back (the
# guarded buffer, the int64 map and the oracle table): 77 bytes measured, on a 16 MiB
# case (benchmarks/RESULTS.md).  The KV-A workers' copies (world_size at most 8) are
# well inside it; on CUDA the device holds about 3 bytes per KV byte, which
# MAX_KV_BYTES keeps under 200 MiB, so a GPU's memory is not consulted.
HOST_BYTES_PER_KV_BYTE = 80


class CaseFileError(ValueError):
    """A case file is malformed; the message names file, case and key."""


def _err(file: str, case: str | None, key: str | None, msg: str) -> CaseFileError:
    where = file + (f", case {case!r}" if case else "") + (f", key {key!r}" if key else "")
    return CaseFileError(f"{where}: {msg}")


def _validate(raw: dict[str, Any], file: str, index: int) -> Case:
    case_id = raw.get("id")
    label = case_id if isinstance(case_id, str) else f"#{index}"
    if not isinstance(case_id, str) or not case_id or not case_id.replace("_", "").isalnum() \
            or len(case_id) > MAX_ID_CHARS:
        shown = label if len(label) <= MAX_ID_CHARS else f"{label[:MAX_ID_CHARS]}..."
        raise _err(file, shown, "id", f"needs a short id of letters, digits and '_' (at most "
                   f"{MAX_ID_CHARS} characters)")
    for key in raw:
        if key not in _KNOWN_KEYS:
            known = ", ".join(sorted(_KNOWN_KEYS))
            raise _err(file, label, key, f"unknown key; known keys: {known}")
    for key in _INT_KEYS + _OPTIONAL_INT_KEYS:
        if key in raw and (type(raw[key]) is not int or raw[key] <= 0):
            raise _err(file, label, key, f"must be a positive integer, got {raw[key]!r}")
    for key in _STR_KEYS:
        if key in raw and not isinstance(raw[key], str):
            raise _err(file, label, key, f"must be a string, got {raw[key]!r}")
    for key, limit in LIMITS.items():
        if key in raw and raw[key] > limit.value:
            raise _err(file, label, key, f"{raw[key]} exceeds the limit {limit.value} "
                       f"({limit.why})")
    if len(raw.get("description", "")) > MAX_DESCRIPTION_CHARS:
        raise _err(file, label, "description", f"{len(raw['description'])} characters exceed "
                   f"the limit {MAX_DESCRIPTION_CHARS}")
    case = Case(file=file, **raw)
    if case.num_groups > case.num_layers:
        raise _err(file, label, "num_groups", f"{case.num_groups} exceeds the limit "
                   f"{case.num_layers} (num_layers: every cache group holds a layer)")
    if case.dtype not in DTYPE_SIZES:
        raise _err(file, label, "dtype", f"unsupported dtype {case.dtype!r}; one of "
                   f"{', '.join(DTYPE_SIZES)}")
    if case.kernel_block_size is not None and case.block_size % case.kernel_block_size:
        raise _err(file, label, "kernel_block_size",
                   f"{case.kernel_block_size} does not divide block_size {case.block_size}")
    if case.page_size_padded is not None and case.page_size_padded < page_bytes(case):
        raise _err(file, label, "page_size_padded",
                   f"{case.page_size_padded} is smaller than the dense page ({page_bytes(case)} B)")
    if case.num_pages < MIN_PAGES:
        raise _err(file, label, "num_pages",
                   f"{case.num_pages} page cannot be served: a case needs at least {MIN_PAGES} "
                   "(the null block is held back, so fewer leaves no usable block; vLLM "
                   "refuses to size it); KV-N4 checks that refusal with its own amounts")
    if case.expected_usable_blocks is not None and case.expected_usable_blocks >= case.num_pages:
        raise _err(file, label, "expected_usable_blocks",
                   "must be below num_pages: the null block is never handed out")
    most, why = kv_bytes_limit()
    if kv_bytes(case) > most:
        page = ("page_size_padded" if case.page_size_padded is not None else
                f"num_kv_heads * block_size * 2 * head_size * {DTYPE_SIZES[case.dtype]} bytes")
        raise _err(file, label, "num_pages",
                   f"the KV cache of num_layers {case.num_layers} x num_pages {case.num_pages} x "
                   f"{page_stride(case)}-byte pages ({page}) = {kv_bytes(case)} bytes exceeds "
                   f"the limit {most} bytes ({why}); use fewer pages, layers or smaller pages")
    return case


def validate_case(case: Case) -> Case:
    """A :class:`Case` made in code (``check_backend``'s ``cases``), held to a file's rules
    and limits."""
    raw = {f.name: getattr(case, f.name) for f in fields(case)
           if f.name != "file" and getattr(case, f.name) is not None}
    return _validate(raw, case.file or "<Case record>", 0)


def page_stride(case: Case) -> int:
    """Bytes one (layer, block) page occupies, padding included."""
    return case.page_size_padded or page_bytes(case)


def kv_bytes(case: Case) -> int:
    """Bytes of the KV cache a case describes: every layer's pages."""
    return case.num_layers * case.num_pages * page_stride(case)


def kv_bytes_limit() -> tuple[int, str]:
    """The largest KV cache a case may describe here, and why: :data:`MAX_KV_BYTES`, or
    less when this host's available memory could not hold the test process's byte map."""
    static = (MAX_KV_BYTES, "KV-S2 tabulates one oracle address per byte of it, up to "
              f"{MAX_KV_BYTES} cells")
    available = memory.host_available_bytes()
    if available is None:
        return static
    fits = int(available * memory.IN_PROCESS_SHARE) // HOST_BYTES_PER_KV_BYTE
    if fits >= static[0]:
        return static
    return fits, (f"KV-S2's byte map takes about {HOST_BYTES_PER_KV_BYTE} bytes of the test "
                  f"process per KV byte, and {memory.IN_PROCESS_SHARE:g} of this host's "
                  f"{available} available bytes may go to it")


def page_bytes(case: Case) -> int:
    """Dense page size: K and V for every head and token of one block."""
    return case.num_kv_heads * case.block_size * 2 * case.head_size * DTYPE_SIZES[case.dtype]


def load_case_file(path: Path | str, text: str | None = None) -> list[Case]:
    """Parse one TOML file of ``[[case]]`` tables, with an optional ``[defaults]`` table."""
    file = str(path)
    try:
        if text is None:
            with open(path, "rb") as f:
                raw_bytes = f.read(MAX_FILE_BYTES + 1)  # never more: a case file is small
            if len(raw_bytes) > MAX_FILE_BYTES:
                raise _err(file, None, None, f"larger than the limit {MAX_FILE_BYTES} bytes "
                           "for a case file")
            text = raw_bytes.decode("utf-8")
        elif len(text) > MAX_FILE_BYTES:
            raise _err(file, None, None, f"larger than the limit {MAX_FILE_BYTES} bytes for "
                       "a case file")
        data = tomllib.loads(text)
    except OSError as exc:
        raise _err(file, None, None, f"cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise _err(file, None, None, f"not UTF-8: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise _err(file, None, None, f"invalid TOML: {exc}") from None
    unknown = set(data) - {"defaults", "case"}
    if unknown:
        raise _err(file, None, sorted(unknown)[0], "unknown top-level table; use [defaults] "
                   "and [[case]]")
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict) or "id" in defaults:
        raise _err(file, None, "defaults", "must be a table without 'id'")
    raws = data.get("case", [])
    if not isinstance(raws, list) or not raws:
        raise _err(file, None, "case", "needs at least one [[case]] table")
    return [_validate({**defaults, **raw}, file, i) for i, raw in enumerate(raws)]


def builtin_case_files() -> list[Path]:
    """The case files shipped in the ``conformance_cases`` package, sorted."""
    root = resources.files("conformance_cases")
    return sorted(Path(str(p)) for p in root.iterdir() if p.name.endswith(".toml"))


def load_cases(extra: Sequence[Path | str] = (), *, builtin: bool = True) -> list[Case]:
    """Built-in cases plus ``--kv-cases`` files; ids must be unique across files."""
    files: list[Path | str] = [*(builtin_case_files() if builtin else []), *extra]
    seen: dict[str, str] = {}
    cases: list[Case] = []
    for file in files:
        for case in load_case_file(file):
            if case.id in seen:
                raise _err(str(file), case.id, "id", f"duplicate id, already defined in "
                           f"{seen[case.id]}")
            seen[case.id] = str(file)
            cases.append(case)
            if len(cases) > MAX_CASES:
                raise _err(str(file), case.id, None, f"more than the limit {MAX_CASES} cases "
                           "in one run (built-in and --kv-cases files together)")
    return cases
