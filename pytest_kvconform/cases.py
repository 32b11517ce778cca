"""Loading and validating the spec cases in ``conformance_cases/*.toml``.

Stdlib only.  A bad file gets one :class:`CaseFileError` naming the file, the
case and the key, so a typo never turns into a silently skipped case.
"""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from pytest_kvconform import model
from pytest_kvconform.model import Case

MIN_PAGES = 2  # the null block plus one usable block
CASE_DTYPES = ("bfloat16", "float16", "float32")  # the dtype names a case file may use
DTYPE_SIZES: dict[str, int] = {name: model.DTYPE_SIZES[name] for name in CASE_DTYPES}
_INT_KEYS = ("block_size", "num_kv_heads", "head_size", "num_layers", "num_pages", "world_size",
             "num_groups")
_OPTIONAL_INT_KEYS = ("kernel_block_size", "page_size_padded", "expected_usable_blocks")
_STR_KEYS = ("dtype", "description")
_KNOWN_KEYS = frozenset({"id", *_INT_KEYS, *_OPTIONAL_INT_KEYS, *_STR_KEYS})


class CaseFileError(ValueError):
    """A case file is malformed; the message names file, case and key."""


def _err(file: str, case: str | None, key: str | None, msg: str) -> CaseFileError:
    where = file + (f", case {case!r}" if case else "") + (f", key {key!r}" if key else "")
    return CaseFileError(f"{where}: {msg}")


def _validate(raw: dict[str, Any], file: str, index: int) -> Case:
    case_id = raw.get("id")
    label = case_id if isinstance(case_id, str) else f"#{index}"
    if not isinstance(case_id, str) or not case_id or not case_id.replace("_", "").isalnum():
        raise _err(file, label, "id", "needs a short id of letters, digits and '_'")
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
    case = Case(file=file, **raw)
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
    return case


def page_bytes(case: Case) -> int:
    """Dense page size: K and V for every head and token of one block."""
    return case.num_kv_heads * case.block_size * 2 * case.head_size * DTYPE_SIZES[case.dtype]


def load_case_file(path: Path | str, text: str | None = None) -> list[Case]:
    """Parse one TOML file of ``[[case]]`` tables, with an optional ``[defaults]`` table."""
    file = str(path)
    try:
        data = tomllib.loads(text if text is not None else Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise _err(file, None, None, f"cannot read: {exc.strerror or exc}") from None
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
    return cases
