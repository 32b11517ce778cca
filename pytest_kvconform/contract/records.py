"""Plain records shared by discovery, checks, the pytest front-end and the report.

Stdlib only, and no other module of the package: every other module may import this one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any

# Bytes per element by dtype name: the one table (the oracle's sizes, the case files' dtypes).
DTYPE_SIZES: dict[str, int] = {
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "float8_e4m3fn": 1,
    "fp8": 1,
    "int8": 1,
    "uint8": 1,
}

# user_properties key carrying a ClauseSkip's kind from the test to the report.
SKIP_KIND_PROPERTY = "kv_skip_kind"
# user_properties key carrying the production entry point a KV-A check drove (``via``).
VIA_PROPERTY = "kv_via"
# user_properties key naming the seeded worker fault a test's KV-A workers ran under.
SEEDED_FAULT_PROPERTY = "kv_seeded_fault"
# user_properties key naming the call into the backend's own code a harness error happened in.
CAUSED_BY_PROPERTY = "kv_caused_by"


def installed_version(dist: str) -> str | None:
    """A distribution's installed version, read from metadata (nothing is imported)."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


# BackendUnderTest.source of a class handed to check_backend (named after the class).
API_SOURCE = "api"
# The sources whose backend name is no registration of the backend's own: a platform's
# default outside the registry (discovery names it after its class), and a class handed to
# check_backend.  KV-L1 holds get_name() to the name only where it is a registration.
UNREGISTERED_SOURCES = frozenset({"platform", API_SOURCE})


# BackendUnderTest.unusable of the stand-in a run parametrises a family's clauses with when
# --kv-backend named no backend of that family: they do not apply to the run.
NOT_SELECTED = "not-selected"


@dataclass(frozen=True)
class BackendUnderTest:
    """One attention backend as discovered, importable or not (its ``family`` says whose).

    ``cls`` is None when the backend failed to import; ``error`` then says why,
    and every test of the backend reports it instead of silently vanishing.
    """

    name: str
    path: str
    source: str  # "registry", "platform", "hook", "entry-point", "api"
    overridden: bool = False
    cls: Any = field(default=None, compare=False, repr=False)
    error: str | None = None
    # Who put the class there: "in-tree", or the plugin's distribution and entry point.
    origin: str | None = None
    # "diffusion" (vllm-omni's diffusion attention backends: the L, A families) or "vllm"
    # (vLLM's own AttentionBackend classes: the V family).
    family: str = "diffusion"
    # Why a vLLM registry member is unusable here, when that is no fault of the backend
    # ("unregistered", "missing-module", "hardware": adapters/vllm_registry.py); None else.
    unusable: str | None = field(default=None, compare=False)

    @property
    def importable(self) -> bool:
        return self.cls is not None

    def record(self) -> dict[str, Any]:
        """The backend as the report and the terminal matrix hold it (JSON values)."""
        return {"name": self.name, "path": self.path, "source": self.source,
                "overridden": bool(self.overridden), "importable": self.importable,
                "reason": self.error, "origin": self.origin, "family": self.family}


@dataclass(frozen=True)
class Case:
    """One spec case from ``conformance_cases/*.toml`` (validated by ``contract/cases.py``)."""

    id: str
    file: str
    block_size: int = 16
    num_kv_heads: int = 2
    head_size: int = 64
    dtype: str = "bfloat16"
    num_layers: int = 2
    num_pages: int = 16
    kernel_block_size: int | None = None
    page_size_padded: int | None = None
    world_size: int = 1
    num_groups: int = 1
    expected_usable_blocks: int | None = None
    description: str = ""

    @property
    def usable_blocks(self) -> int:
        """Blocks a scheduler may hand out: the null block is held back."""
        if self.expected_usable_blocks is not None:
            return self.expected_usable_blocks
        return self.num_pages - 1


@dataclass(frozen=True, slots=True)
class ResultRow:
    """One suite test's result, as the session collects it during the run.

    A typed row inside the session; :meth:`as_dict` is the edge to the report,
    which works on mappings because it also reads reports back from files.
    """

    nodeid: str
    backend: str | None
    clause: str
    case: str | None
    layout: str | None
    device: str | None
    status: str  # passed, failed, skipped, error, xfailed, xpassed
    reason: str
    duration_s: float
    skip_kind: str | None  # a ClauseSkip's kind (SKIP_KIND_PROPERTY)
    xfail: str | None  # the describe() of the expected-failure entry that matched
    error_kind: str | None  # an ErrorKind value, for error and xfailed rows only
    via: str | None = None  # the production entry point a KV-A check drove (VIA_PROPERTY)
    seeded_fault: str | None = None  # the seeded worker fault its KV-A workers ran under
    subject: str | None = None  # "backend" or "stack": whom it speaks for (clauses.Subject)
    # The call into the backend's own code a harness error happened in (CAUSED_BY_PROPERTY):
    # such a fault speaks for the backend, whatever the clause's subject.
    caused_by: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The row as the report and its JSON hold it (keys in field order)."""
        return asdict(self)
