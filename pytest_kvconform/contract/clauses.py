"""The clause table: one row per contract clause, the one place each fact about a clause lives.

A row says which family a clause belongs to, its title, which skip kinds strict
qualification forgives it, what it is parametrised over, which spec cases it
runs on, and which check function(s) in ``pytest_kvconform.checks`` carry it out
(as import strings, resolved only when called).  The clause-id grammar, the family
order and each family's suite module live here too.

Stdlib only, beside :mod:`pytest_kvconform.contract.outcomes` at the bottom of the
package: importing it imports neither pytest, torch, vLLM nor vllm-omni, so
the plugin, the report, the plain Python API (:mod:`pytest_kvconform.api`) and
the tests may all read it.

Adding a clause is four edits (CONTRIBUTING.md, "Adding a clause"): its text in
``contract.md``, a :class:`Clause` row in :data:`CLAUSES`, a ``check_kv_<x><n>``
function in its family's ``checks/`` module, and its seeded fault (one
``plants.declare(...)`` in ``faults/plants.py``).  Everything else follows from the
row: the family's suite module (:data:`FAMILY_MODULES`) generates its pytest tests,
:func:`pytest_kvconform.check_backend` plans it, ``checks/arguments.py`` expands its
axes for both, the report gets its column, ``kvconform selftest`` seeds its fault, and
``docs/clauses.md``'s table is regenerated from :func:`markdown_table`
(:func:`write_markdown_table`).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pytest_kvconform.contract.outcomes import SkipKind

if TYPE_CHECKING:
    from pytest_kvconform.contract.records import Case

# The contract's sections, in its order: the order of the report's columns.
FAMILY_ORDER = "LSNAV"
FAMILY_TITLES: Mapping[str, str] = {
    "L": "layout contract",
    "S": "stride derivation",
    "N": "null-block sizing",
    "A": "control plane to worker adoption",
    "V": "vLLM attention backends",
}
# The suite module that generates each family's tests (``pytest_kvconform/suite/<name>.py``):
# their ids read ``kvconform/test_layout.py::test_kv_l1[FLASH_ATTN]``.  A family without one
# has its tests generated in ``suite/test_table.py``.
FAMILY_MODULES: Mapping[str, str] = {
    "L": "test_layout",
    "S": "test_strides",
    "N": "test_nullblock",
    "A": "test_adoption",
    "V": "test_vllm",
}
# The one clause-id grammar: ``KV-L2`` is family L, number 2.
CLAUSE_RE = re.compile(rf"^KV-(?P<family>[{FAMILY_ORDER}])(?P<number>[0-9]+)$")
# A suite test cites its clause in its name: ``test_kv_l8_alias[TORCH_SDPA]`` -> KV-L8.
TEST_NAME_RE = re.compile(rf"^test_kv_(?P<family>[{FAMILY_ORDER.lower()}])(?P<number>[0-9]+)"
                          r"(?:_(?P<variant>\w+?))?(?:\[|$)")

# What a check is called with, in order (the suite's fixture of the same meaning in brackets):
#   backend         the BackendUnderTest (a diffusion backend)            [kv_backend]
#   vllm_backend    the BackendUnderTest (one of vLLM's own attention      [kv_backend]
#                   backends, family "vllm": the V family's)
#   need            False / True, the control plane's explicit seam       [kv_need]
#   need_backend    a stand-in backend declaring the need                 [layout.seam_backend]
#   layout          one of the six physical layouts                       [kv_layout]
#   case            a spec case the clause's predicate selects            [kv_case]
#   device          the torch device of this process                      [kv_device]
#   workers         the worker processes for the case's world size, or    [kv_workers]
#                   the reason (a str) there are not enough devices
#   worker          one worker process (a world-size-1 deployment), or    [kv_workers]
#                   the reason there is none
#   workers_device  the device the workers were placed from              [kv_workers.device]
#   workers_factory a callable returning ``workers`` (started on demand)
#   memory_fraction the share of free device memory KV-A6 allocates       [--kv-memory-fraction]
Arg = Literal["backend", "vllm_backend", "need", "need_backend", "layout", "case", "device",
              "workers", "worker", "workers_device", "workers_factory", "memory_fraction"]
# The parameter axes a check runs over, in test-id order (``test_kv_a1_seam[need_True-ws2]``);
# ``checks/arguments.py`` expands them for the suite and for ``check_backend`` alike.
AXES: tuple[str, ...] = ("backend", "need", "layout", "case")
WHO_ARGS: frozenset[str] = frozenset({"backend", "vllm_backend", "need", "need_backend"})
# The arguments that are a discovered backend, and the family of backends each runs over
# (``BackendUnderTest.family``): a diffusion clause never runs on vLLM's own backends, nor
# a V clause on a diffusion backend.
BACKEND_ARGS: Mapping[str, str] = {"backend": "diffusion", "vllm_backend": "vllm"}
WORKER_ARGS: frozenset[str] = frozenset({"workers", "worker", "workers_factory"})
AppliesTo = Literal["backend", "layout x case", "case", "backend x case", "vLLM backend"]
# Whom a result speaks for: the backend under test (what its class and its declaration
# decide) or the serving stack (vLLM / vllm-omni: the seam controls, the upstream families,
# and the stack's own guards even where they run on a backend).  A backend-scoped run's
# verdict and exit status speak for its backends' ``backend`` results alone.
Subject = Literal["backend", "stack"]
SUBJECTS: tuple[Subject, ...] = ("backend", "stack")
# A backend's declaration: every other result of the backend uses it, so when it fails
# the backend's other failures are reported as depending on it.
ROOT_CLAUSE = "KV-L1"

ALWAYS_FORGIVEN: frozenset[SkipKind] = frozenset({SkipKind.NOT_APPLICABLE})
HARDWARE_FORGIVEN: frozenset[SkipKind] = frozenset({SkipKind.NOT_APPLICABLE, SkipKind.HARDWARE})


# --- case predicates (the suite's ``kv_cases`` markers import these) ---------------------

# The adoption clauses run on two cases: world size 1 and 2.
A_CASES = ("bf16_h8", "ws2")


def one_rank_one_group(case: Case) -> bool:
    return case.world_size == 1 and case.num_groups == 1


def one_group(case: Case) -> bool:
    return case.num_groups == 1


def plain(case: Case) -> bool:
    """One rank, one group, no padding: the cases every layout must lay out."""
    return case.world_size == 1 and case.num_groups == 1 and case.page_size_padded is None


def dense(case: Case) -> bool:
    return plain(case) and case.kernel_block_size is None


def split_or_padded(case: Case) -> bool:
    return case.world_size == 1 and case.num_groups == 1 and (
        case.kernel_block_size is not None or case.page_size_padded is not None)


def several_groups(case: Case) -> bool:
    return case.world_size == 1 and case.num_groups > 1


def adoption_case(case: Case) -> bool:
    return case.id in A_CASES


def adoption_multi_rank(case: Case) -> bool:
    return case.id in A_CASES and case.world_size > 1


def adoption_single_rank(case: Case) -> bool:
    return case.id in A_CASES and case.world_size == 1


# --- the table ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One check function of a clause, and the suite test that runs it.

    ``variant`` is the suffix of the suite test's name (``"alias"`` for
    ``test_kv_l8_alias``; ``""`` for the plain ``test_kv_l8``): one check per
    independent control, so a known failure of one never hides another.  ``seam``
    marks the variants that run once per need (False, True) through the control
    plane's explicit seam instead of for a discovered backend.  ``controls`` names
    the neighbouring controls (suite test functions) whose behaviour must hold for a
    pass of this check to count as a fix of a known finding: a check about something
    refused that should be accepted has a neighbour that must still be refused, and
    the other way round (see ``report/verdict.py``).
    """

    function: str  # "module:function"
    args: tuple[Arg, ...]
    variant: str = ""
    seam: bool = False
    controls: tuple[str, ...] = ()
    # Set for the stack's guards that run on a backend (KV-L8, KV-A4); otherwise a check
    # of a discovered backend is the backend's, and any other the stack's (:attr:`subject`).
    guards_stack: bool = False
    # Set when the check touches the backend's class only through its declaration as
    # ``checks/common.declared_need`` reads it (itself made in a child process, and kept for
    # the process): the check then needs no child of its own (:attr:`isolated`).
    declaration_only: bool = False

    @property
    def subject(self) -> Subject:
        """Whom this control's results speak for (see :data:`Subject`)."""
        return "backend" if self.takes_backend and not self.guards_stack else "stack"

    @property
    def takes_backend(self) -> bool:
        """Whether it runs on a discovered backend (of either family)."""
        return any(a in BACKEND_ARGS for a in self.args)

    @property
    def backend_family(self) -> str:
        """The family of backends its backend axis runs over (``diffusion``, ``vllm``)."""
        return next((BACKEND_ARGS[a] for a in self.args if a in BACKEND_ARGS), "diffusion")

    def resolve(self) -> Callable[..., None]:
        """The check function itself (imports its module now, not before)."""
        module, _, name = self.function.partition(":")
        fn: Callable[..., None] = getattr(importlib.import_module(module), name)
        return fn

    @property
    def axes(self) -> tuple[str, ...]:
        """The parameters a run of this check varies over, in test-id order."""
        named = {"need" if a == "need_backend" else "backend" if a in BACKEND_ARGS else a
                 for a in self.args}
        return tuple(a for a in AXES if a in named)

    @property
    def needs_workers(self) -> bool:
        return bool(WORKER_ARGS & set(self.args))

    @property
    def isolated(self) -> bool:
        """Whether it runs whole in a child process forked for it (``workers/isolated.py``):
        it calls into a discovered backend's class from the checking process, beyond the
        declaration read in a child of its own (:attr:`declaration_only`), and drives no
        KV-A worker (whose pipes live in that process; the calls it makes itself are each
        made in a child)."""
        return self.takes_backend and not self.needs_workers and not self.declaration_only


@dataclass(frozen=True)
class Clause:
    """One contract clause."""

    id: str
    title: str
    applies_to: AppliesTo
    checks: tuple[Check, ...]
    # The skip kinds strict qualification forgives: a skip of any other kind blocks it.
    forgiven: frozenset[SkipKind] = ALWAYS_FORGIVEN
    # Which spec cases it runs on; None when it takes no case.
    cases: Callable[[Case], bool] | None = None

    @property
    def family(self) -> str:
        return parse_clause(self.id)[0]

    @property
    def number(self) -> int:
        return parse_clause(self.id)[1]

    @property
    def suite_module(self) -> str:
        """The suite module its tests are collected from (``test_layout``)."""
        return FAMILY_MODULES.get(self.family, "test_table")

    def test_name(self, check: Check) -> str:
        """The suite test function that runs ``check``: ``test_kv_l8_alias``."""
        base = "test_kv_" + self.id.removeprefix("KV-").lower()
        suffix = "_".join(p for p in (check.variant, "seam" if check.seam else "") if p)
        return f"{base}_{suffix}" if suffix else base


def _c(module: str, name: str, *args: Arg, variant: str = "", seam: bool = False,
       controls: tuple[str, ...] = (), guards_stack: bool = False,
       declaration_only: bool = False) -> Check:
    return Check(f"pytest_kvconform.checks.{module}:{name}", args, variant, seam, controls,
                 guards_stack, declaration_only)


def _guard(module: str, name: str, *args: Arg, variant: str = "",
           controls: tuple[str, ...] = (), declaration_only: bool = False) -> Check:
    """A check of the stack's own guard, run on a backend (its subject is the stack)."""
    return _c(module, name, *args, variant=variant, controls=controls, guards_stack=True,
              declaration_only=declaration_only)


def _l(n: int, title: str, *checks: Check, forgiven: frozenset[SkipKind] = ALWAYS_FORGIVEN
       ) -> Clause:
    return Clause(f"KV-L{n}", title, "backend", checks, forgiven)


def _v(n: int, title: str, *checks: Check) -> Clause:
    """A clause on vLLM's own attention backends (family ``vllm``); a CPU host forgives a
    member whose in-tree class needs CUDA to import."""
    return Clause(f"KV-V{n}", title, "vLLM backend", checks, HARDWARE_FORGIVEN)


def _s(n: int, title: str, cases: Callable[[Case], bool], *checks: Check) -> Clause:
    return Clause(f"KV-S{n}", title, "layout x case", checks, ALWAYS_FORGIVEN, cases)


def _n(n: int, title: str, cases: Callable[[Case], bool], *args: Arg) -> Clause:
    check = _c("nullblock", f"check_kv_n{n}", *args)
    return Clause(f"KV-N{n}", title, "case", (check,), ALWAYS_FORGIVEN, cases)


def _a(n: int, title: str, cases: Callable[[Case], bool], *args: Arg,
       module: str = "adoption", forgiven: frozenset[SkipKind] = HARDWARE_FORGIVEN,
       variants: Mapping[str, tuple[str, ...]] | None = None,
       guards_stack: bool = False) -> Clause:
    """An adoption clause: for the backend's declared need, and once per need (seam).

    ``module`` is the ``checks/`` module holding its check functions (``adoption``, or
    ``adoption_bytes`` for the clauses that read the worker's bytes).  ``variants`` maps
    each independent control to its neighbouring controls' test names (a seam check's
    neighbours are the seam ones).
    """
    checks: list[Check] = []
    for variant, controls in (variants or {"": ()}).items():
        name = f"check_kv_a{n}" + (f"_{variant}" if variant else "")
        checks += [_c(module, name, "backend", *args, variant=variant, controls=controls,
                      guards_stack=guards_stack),
                   _c(module, name, "need", *args, variant=variant, seam=True,
                      controls=tuple(f"{c}_seam" for c in controls))]
    return Clause(f"KV-A{n}", title, "backend x case", tuple(checks), forgiven, cases)


_A6_ARGS: tuple[Arg, ...] = ("case", "workers_device", "workers_factory", "memory_fraction")

CLAUSES: tuple[Clause, ...] = (
    # Two controls: the layout need, and the name the backend answers to.
    _l(1, "Declaration", _c("layout", "check_kv_l1", "backend"),
       _c("layout", "check_kv_l1_name", "backend", variant="name")),
    # KV-L2..L4 and KV-L8 touch the class only through its declaration (declaration_only).
    _l(2, "Resolution", _c("layout", "check_kv_l2", "backend", declaration_only=True)),
    _l(3, "Precedence", _c("layout", "check_kv_l3", "backend", declaration_only=True)),
    _l(4, "Contradiction", _c("layout", "check_kv_l4", "backend", declaration_only=True)),
    _l(5, "Enforcement",
       _c("layout", "check_kv_l5_unresolved", "backend", variant="unresolved"),
       _c("layout", "check_kv_l5_consistent", "backend", variant="consistent"),
       _c("layout", "check_kv_l5_contradiction", "backend", variant="contradiction")),
    _l(6, "Production wiring", _c("layout", "check_kv_l6", "backend", "worker"),
       # need_True's finding (LBNHC pinned regardless) is fixed only while need_False's
       # LBNHC still comes out: the seam test's other need is its neighbour.
       _c("layout", "check_kv_l6", "need_backend", "worker", seam=True,
          controls=("test_kv_l6_seam",))),
    _l(7, "Paged read path", _c("layout", "check_kv_l7", "backend", "device"),
       forgiven=HARDWARE_FORGIVEN),
    # The stack's handling of what a user pins (names, aliases, the environment, a worker's
    # own pin): vllm-omni's resolution, run on each backend.
    _l(8, "User-selected layouts",
       _guard("layout", "check_kv_l8_canonical_honoured", "backend",
              variant="canonical_honoured", declaration_only=True),
       _guard("layout", "check_kv_l8_canonical_refused", "backend",
              variant="canonical_refused", declaration_only=True),
       _guard("layout", "check_kv_l8_alias", "backend", variant="alias",
              controls=("test_kv_l8_canonical_refused",), declaration_only=True),
       _guard("layout", "check_kv_l8_worker_disagreement", "backend",
              variant="worker_disagreement", declaration_only=True),
       _guard("layout", "check_kv_l8_worker_alias", "backend", variant="worker_alias",
              controls=("test_kv_l8_worker_disagreement",), declaration_only=True),
       _guard("layout", "check_kv_l8_env_honoured", "backend", "device", variant="env_honoured",
              controls=("test_kv_l8_env_refused",), declaration_only=True),
       _guard("layout", "check_kv_l8_env_refused", "backend", "device", variant="env_refused",
              controls=("test_kv_l8_env_honoured",), declaration_only=True)),
    _s(1, "Production tensor", plain, _c("strides", "check_kv_s1", "layout", "case")),
    _s(2, "View addresses", dense, _c("strides", "check_kv_s2", "layout", "case", "device"),
       _c("strides", "check_kv_s2_allocate", "layout", "case", "device", variant="allocate")),
    _s(3, "Packing", plain, _c("strides", "check_kv_s3", "layout", "case")),
    _s(4, "Kernel-block splitting and padded pages", split_or_padded,
       _c("strides", "check_kv_s4", "layout", "case", "device")),
    _s(5, "Several cache groups", several_groups,
       _c("strides", "check_kv_s5", "layout", "case", "device")),
    _n(1, "The null block is never handed out", one_rank_one_group, "case"),
    _n(2, "P pages of memory: P blocks, P-1 planned", one_rank_one_group, "case"),
    _n(3, "num_gpu_blocks_override", one_rank_one_group, "case"),
    _n(4, "Fewer than two pages refused", one_rank_one_group, "case"),
    _n(5, "Several ranks take the smallest num_blocks", one_group, "case"),
    _a(1, "Pinned before sizing, stamped on every config", adoption_case, "case", "workers"),
    _a(2, "A real process boundary", adoption_case, "case", "workers"),
    _a(3, "Worker adoption and allocation at oracle offsets", adoption_case, "case", "workers",
       module="adoption_bytes"),
    # The worker's own guards (production's), run on each backend.
    _a(4, "Negative controls", adoption_case, "case", "workers",
       # The contradiction is refused only by a fix that still allocates a consistent
       # layout (KV-A3) for the same backend and case.
       variants={"unadopted": (), "disagreement": (), "contradiction": ("test_kv_a3",)},
       guards_stack=True),
    _a(5, "Several ranks, one process each", adoption_multi_rank, "case", "workers",
       module="adoption_bytes"),
    _a(6, "Real allocation at scale", adoption_single_rank, *_A6_ARGS, module="adoption_bytes"),
    # vLLM's own attention backends (AttentionBackendEnum, MambaAttentionBackendEnum and the
    # repository's).
    _v(1, "Registration", _c("vllm_backends", "check_kv_v1", "vllm_backend"),
       # The registry's own entry: a path to a module the installed vLLM has.
       _guard("vllm_backends", "check_kv_v1_module", "vllm_backend", variant="module")),
    _v(2, "Declaration", _c("vllm_backends", "check_kv_v2", "vllm_backend"),
       _c("vllm_backends", "check_kv_v2_page", "vllm_backend", variant="page")),
    _v(3, "Resolution",
       _c("vllm_resolution", "check_kv_v3", "vllm_backend", declaration_only=True)),
    _v(4, "Adoption", _c("vllm_adoption", "check_kv_v4", "vllm_backend", "worker"),
       # Negative control: production's worker refuses a layout other than its own pin.
       _guard("vllm_adoption", "check_kv_v4_disagreement", "vllm_backend", "worker",
              variant="disagreement")),
    # KV-V5 reads customize_spec off the class itself: it runs whole in a child.
    _v(5, "Customised page", _c("vllm_spec", "check_kv_v5", "vllm_backend")),
)
BY_ID: Mapping[str, Clause] = {c.id: c for c in CLAUSES}
# The skip kinds strict qualification forgives some clause (the report's global rule).
FORGIVEN_SKIP_KINDS: frozenset[SkipKind] = frozenset().union(*(c.forgiven for c in CLAUSES))


# --- the grammar ------------------------------------------------------------------------------


def parse_clause(clause: str) -> tuple[str, int]:
    """``"KV-L2"`` -> ``("L", 2)``; a ValueError naming the id otherwise."""
    m = CLAUSE_RE.match(clause)
    if m is None:
        raise ValueError(f"not a clause id: {clause!r} (expected KV-<{'|'.join(FAMILY_ORDER)}>"
                         f"<number>, e.g. KV-L2)")
    return m["family"], int(m["number"])


def clause_sort_key(clause: str) -> tuple[int, int, str]:
    """Contract order: L, S, N, A, V families, then by number (KV-L2 before KV-L10)."""
    m = CLAUSE_RE.match(clause)
    if m is None:
        return (len(FAMILY_ORDER) + 1, 0, clause)
    return (FAMILY_ORDER.index(m["family"]), int(m["number"]), clause)


def clause_from_test_name(name: str) -> str | None:
    """``test_kv_l2`` / ``test_kv_l2[FLASH_ATTN]`` -> ``KV-L2``; None for other tests."""
    m = TEST_NAME_RE.match(name)
    if m is None:
        return None
    return f"KV-{m['family'].upper()}{m['number']}"


def clause(clause_id: str) -> Clause:
    """The table row of ``clause_id``; a ValueError naming it (and the known ids) if absent."""
    parse_clause(clause_id)
    try:
        return BY_ID[clause_id]
    except KeyError:
        raise ValueError(f"unknown clause {clause_id!r}; the contract has "
                         f"{', '.join(BY_ID)}") from None


def select(clause_ids: Iterable[str] | None) -> list[Clause]:
    """The rows named (all when None), in contract order; bad ids are one clear error."""
    if clause_ids is None:
        return list(CLAUSES)
    if isinstance(clause_ids, str):
        clause_ids = [clause_ids]
    wanted = {clause(c).id for c in clause_ids}
    return [c for c in CLAUSES if c.id in wanted]


def skip_forgiven(clause_id: str, kind: SkipKind | str | None) -> bool:
    """Whether strict qualification forgives a skip of ``kind`` for this clause."""
    if kind is None:
        return False
    try:
        return SkipKind(kind) in BY_ID[clause_id].forgiven
    except (KeyError, ValueError):
        return False


def check_names() -> dict[str, tuple[Clause, Check]]:
    """Every suite test function name the table implies, with its row and check."""
    return {c.test_name(check): (c, check) for c in CLAUSES for check in c.checks}


def subject_of(test: str) -> Subject | None:
    """The subject of a suite test function's results (``test_kv_a4_unadopted`` ->
    ``"stack"``); None for a name the table does not hold."""
    found = check_names().get(test)
    return found[1].subject if found is not None else None


# --- the contract text ------------------------------------------------------------------------

CONTRACT = Path(__file__).resolve().parents[1] / "contract.md"
_CONTRACT_ITEM_RE = re.compile(r"^- (KV-[A-Z]+[0-9]+) (.*)$")


def contract_clauses(text: str | None = None) -> dict[str, str]:
    """Clause id -> the first line of its text in ``contract.md`` (in the contract's order)."""
    if text is None:
        text = CONTRACT.read_text(encoding="utf-8")
    found: dict[str, str] = {}
    for line in text.splitlines():
        m = _CONTRACT_ITEM_RE.match(line)
        if m is not None:
            if m[1] in found:
                raise ValueError(f"contract.md states clause {m[1]} twice")
            found[m[1]] = m[2]
    return found


def contract_texts(text: str | None = None) -> dict[str, str]:
    """Clause id -> its whole text in ``contract.md`` (the item's lines, joined), for the
    report pages that show a result beside the clause it checks."""
    if text is None:
        text = CONTRACT.read_text(encoding="utf-8")
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        m = _CONTRACT_ITEM_RE.match(line)
        if m is not None:
            current = found.setdefault(m[1], [])
            current.append(m[2])
        elif current is not None and line.startswith("  ") and line.strip():
            current.append(line.strip())
        else:
            current = None
    return {clause: " ".join(lines) for clause, lines in found.items()}


def as_rows() -> list[dict[str, Any]]:
    """The table as plain rows (for docs/clauses.md's table and for tools)."""
    return [{"clause": c.id, "family": c.family, "title": c.title, "applies_to": c.applies_to,
             "forgiven": sorted(k.value for k in c.forgiven),
             "tests": [c.test_name(k) for k in c.checks],
             "subjects": {c.test_name(k): k.subject for k in c.checks},
             "controls": {c.test_name(k): list(k.controls) for k in c.checks if k.controls},
             "checks": [k.function for k in c.checks]} for c in CLAUSES]


CLAUSE_LIST_BEGIN = ("<!-- clause-table: generated by "
                     "pytest_kvconform.contract.clauses.markdown_table -->")
CLAUSE_LIST_END = "<!-- /clause-table -->"


def markdown_table() -> str:
    """docs/clauses.md's clause table, between its markers (a test compares the two)."""
    lines = [CLAUSE_LIST_BEGIN, "",
             "| clause | title | applies to | a skip is forgiven for | suite tests (one per "
             "control), by subject | a pass is a fix only while |",
             "|---|---|---|---|---|---|"]
    for row in as_rows():
        tests = "; ".join(
            f"{subject}: " + ", ".join(f"`{t}`" for t in row["tests"]
                                      if row["subjects"][t] == subject)
            for subject in SUBJECTS if subject in row["subjects"].values())
        controls = "; ".join(
            f"`{t}`: " + ", ".join(f"`{c}`" + (" (its other needs)" if c == t else "")
                                   for c in cs) + " holds"
            for t, cs in row["controls"].items())
        lines.append(f"| {row['clause']} | {row['title']} | {row['applies_to']} | "
                     f"{', '.join(row['forgiven'])} | {tests} | {controls} |")
    return "\n".join([*lines, "", CLAUSE_LIST_END])


def with_markdown_table(text: str) -> str:
    """``text`` (a page holding the generated table between its markers) with the table
    regenerated from the rows."""
    start, end = text.find(CLAUSE_LIST_BEGIN), text.find(CLAUSE_LIST_END)
    if start < 0 or end < start:
        raise ValueError(f"no clause table between {CLAUSE_LIST_BEGIN!r} and "
                         f"{CLAUSE_LIST_END!r}")
    return text[:start] + markdown_table() + text[end + len(CLAUSE_LIST_END):]


def write_markdown_table(path: str | Path = "docs/clauses.md") -> None:
    """Regenerate the clause table in the page at ``path`` (docs/clauses.md), in place."""
    page = Path(path)
    page.write_text(with_markdown_table(page.read_text(encoding="utf-8")), encoding="utf-8")
