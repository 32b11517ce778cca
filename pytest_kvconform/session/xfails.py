"""Expected-failure entries (``--kv-xfails FILE``): loading, matching, staleness.

Stdlib + ``packaging`` only.  A known defect of an installed vLLM / vLLM-Omni is
declared once, with a reason and the versions it applies to, instead of being
edited out of the suite; an entry that no longer matches anything is reported
stale so the list shrinks when upstream fixes land.

An entry describes the failure it expects, and absorbs only that one: the failing
control (``test``, one suite test function) and how it fails (``match``, a regular
expression every problem of its clause failure must contain; or ``skip``, the kind
of skip it declares; or ``errors``, the harness-error kinds it absorbs).  The test
failing (or skipping) any other way is a failure that "differs from known finding"
(the session's ``pytest_runtest_makereport``).  An entry without ``test``, or that
describes no outcome, is refused when the file is loaded, in every mode.

File format (TOML)::

    [known_on]                  # optional: the stacks the file's findings are known on;
    vllm_omni = ">=0.30,<0.33"  # --kv-xfails auto applies every shipped file whose
    vllm = ">=0.30"             # conditions hold (PEP 440; pre-releases included)

    [[xfail]]
    backend = "FLASH_ATTN"      # backend name, or "*" for any (including upstream tests)
    clause = "KV-L6"            # or "*" (every clause: a backend that cannot run at all)
    test = "test_kv_l6"         # the failing control: a suite test function ("*" only
                                # with clause = "*")
    match = "never receives"    # regex searched in each problem of the failure; or
    skip = "backend"            # the skip kind it declares (match then applies to the
                                # skip's reason); or
    errors = true               # harness errors it absorbs (any kind), or
                                # errors = ["oom", "timeout"] (worker-died, timeout, oom, harness)
    case = "two_layers"         # optional: only this spec case
    layout = "BLNHC"            # optional: only this layout
    reason = "vllm-omni 0.30 drops the backend's flag"
    vllm_omni = ">=0.30,<0.31"  # optional PEP 440 specifier; absent package -> not applied
    vllm = ">=0.30"             # optional, same rule
    device = "cuda"             # optional: "cpu" or "cuda"

Without ``errors`` an entry never absorbs a harness error (a worker that died or
timed out, an OOM, the plugin's own exception): those stay status ``error``.

A file is bounded as a case file is (:data:`MAX_FILE_BYTES`, :data:`MAX_ENTRIES`), and a
``match`` cannot run away: a pattern that can backtrack exponentially (a repetition of
something that itself varies in length or alternates, ``(.+)+``) is refused when the file
is loaded, and every search runs under a time budget (:func:`bounded_search`).
"""

from __future__ import annotations

import importlib
import re
import signal
import threading
import tomllib
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from pytest_kvconform.contract.clauses import CLAUSE_RE, check_names, clause_from_test_name
from pytest_kvconform.contract.outcomes import ErrorKind, SkipKind

ANY_BACKEND = "*"
ANY_CLAUSE = "*"  # every clause of the backend, e.g. one whose kernel package is absent
ANY_TEST = "*"  # every test of such a backend (only with ANY_CLAUSE)
DEVICE_KINDS = ("cpu", "cuda")
_REQUIRED = ("backend", "clause", "test", "reason")
_OPTIONAL = ("case", "layout", "match", "skip", "vllm", "vllm_omni", "torch", "device")
# The serving stack's versions: a file's [known_on], and what the header names.
_STACK_KEYS = ("vllm", "vllm_omni")
# An entry's PEP 440 conditions; ``torch`` may name a build by its local label
# (``==2.13.0+cpu``: torch's CPU build only).
_VERSION_KEYS = (*_STACK_KEYS, "torch")
ERRORS_KEY = "errors"
ERROR_KINDS = tuple(kind.value for kind in ErrorKind)
# A not-applicable skip needs no declaration: strict qualification forgives it everywhere.
SKIP_KINDS = tuple(kind.value for kind in SkipKind if kind is not SkipKind.NOT_APPLICABLE)
KNOWN_ON = "known_on"  # the file's table of the stacks its findings are known on
# A file is read whole and every entry is matched against every collected test: bounded as
# a case file is (a stack's findings are a few dozen entries).
MAX_FILE_BYTES = 1 << 20
MAX_ENTRIES = 1000
MAX_PATTERN_CHARS = 1000
# What one search of a ``match`` may take before it is given up (a failure it could not
# decide in time is not described by it).
MATCH_BUDGET_S = 1.0


class XfailFileError(ValueError):
    """A malformed xfail file; the message names the file, the entry and the key."""

    def __init__(
        self, file: str, message: str, *, index: int | None = None, key: str | None = None
    ) -> None:
        self.file = file
        self.index = index
        self.key = key
        where = file
        if index is not None:
            where += f": [[xfail]] entry {index}"
        if key is not None:
            where += f": key {key!r}"
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True)
class XfailEntry:
    """One ``[[xfail]]`` table; ``index`` is 1-based, in file order."""

    file: str
    index: int
    backend: str
    clause: str
    reason: str
    test: str = ANY_TEST  # the failing control: a suite function, e.g. "test_kv_l8_alias"
    case: str | None = None
    layout: str | None = None
    match: re.Pattern[str] | None = None  # what each problem of the failure contains
    skip: str | None = None  # the skip kind the entry declares (then match is the reason's)
    vllm: SpecifierSet | None = None
    vllm_omni: SpecifierSet | None = None
    torch: SpecifierSet | None = None
    device: str | None = None
    errors: frozenset[str] = frozenset()  # harness-error kinds this entry absorbs

    def absorbs_error(self, kind: str) -> bool:
        """Whether a harness error of ``kind`` may become this entry's xfail (opt-in only)."""
        return kind in self.errors

    def describes_failure(self, problems: Sequence[str]) -> bool:
        """Whether a failure reporting ``problems`` (a clause failure's, each on its own;
        an escaped exception's ``Type: message``) is the one this entry expects: every
        problem contains ``match``.  A failure with one problem more is another failure."""
        return (self.skip is None and self.match is not None and bool(problems)
                and all(bounded_search(self.match, problem) for problem in problems))

    def describes_skip(self, kind: str | None, reason: str) -> bool:
        """Whether a skip of ``kind`` with ``reason`` is the one this entry declares."""
        return (self.skip is not None and kind == self.skip
                and (self.match is None or bool(bounded_search(self.match, reason))))

    def expectation(self) -> str:
        """What the entry expects, in words: ``a failure matching 'KeyError'``."""
        pattern = f" matching /{self.match.pattern}/" if self.match is not None else ""
        if self.skip is not None:
            return f"a {self.skip} skip{pattern}"
        described = [f"a failure{pattern}"] if self.match is not None else []
        if self.errors:
            described.append(f"a harness error ({', '.join(sorted(self.errors))})")
        return " or ".join(described)

    def describe(self) -> str:
        """Stable id, e.g. ``xfails.toml:2 FLASH_ATTN/KV-L6/two_layers``.

        The plugin collects these strings (they cross xdist workers unchanged)
        and hands them to :func:`stale_entries`; the file's base name keeps the
        id the same on every host.
        """
        parts = [self.backend, self.clause]
        if self.test != ANY_TEST:
            parts.append(self.test)
        if self.case is not None:
            parts.append(self.case)
        text = f"{Path(self.file).name}:{self.index} {'/'.join(parts)}"
        if self.layout is not None:
            text += f"@{self.layout}"
        return text

    def matches(
        self,
        backend: str | None,
        clause: str,
        case: str | None,
        layout: str | None,
        test: str | None = None,
    ) -> bool:
        """Whether this entry names the test; None fields of the entry match anything.

        ``backend=None`` is an upstream (per layout/case) test: only ``"*"`` names it.
        """
        if self.backend != ANY_BACKEND and self.backend != backend:
            return False
        if self.clause != ANY_CLAUSE and self.clause != clause:
            return False
        if self.case is not None and self.case != case:
            return False
        if self.test != ANY_TEST and self.test != test:
            return False
        return self.layout is None or self.layout == layout

    def applies_to(self, versions: Mapping[str, str | None], device_kind: str) -> bool:
        """Whether the entry's version/device conditions hold on this host.

        ``versions`` maps ``vllm`` / ``vllm_omni`` to installed versions (None when
        absent).  A condition on a package that is absent, or whose version does
        not parse, does not hold: an xfail must never hide a failure it was not
        written for.  ``device_kind`` may be ``"cuda:1"``; only the kind counts.
        """
        return self.versions_hold(versions) and (
            self.device is None or self.device == device_kind.split(":", 1)[0])

    @property
    def conditioned(self) -> bool:
        """Whether the entry names the versions it was written for."""
        return any(getattr(self, key) is not None for key in _STACK_KEYS)

    def versions_hold(self, versions: Mapping[str, str | None]) -> bool:
        """Whether every version condition holds for ``versions`` (absent: does not)."""
        return conditions_hold({key: getattr(self, key) for key in _VERSION_KEYS}, versions)


def conditions_hold(conditions: Mapping[str, SpecifierSet | None],
                    versions: Mapping[str, str | None]) -> bool:
    """Whether each PEP 440 condition (``vllm`` / ``vllm_omni``; None: no condition) holds
    for the installed versions.  Pre-releases are versions like any other here
    (``>=0.30,<0.33`` holds for 0.32.0rc1; ``<0.31`` does not hold for 0.31.0rc1, a
    pre-release of the version it excludes).  A condition on a package that is absent, or
    whose version does not parse, does not hold."""
    for key, spec in conditions.items():
        if spec is None:
            continue
        installed = versions.get(key)
        if installed is None:
            installed = versions.get(key.replace("_", "-"))
        if installed is None:
            return False
        try:
            version = Version(installed)
        except InvalidVersion:
            return False
        if not spec.contains(version, prereleases=True):
            return False
    return True


def describe_conditions(conditions: Mapping[str, SpecifierSet | None]) -> str:
    """``vllm-omni >=0.30,<0.33`` (sorted specifiers, as PEP 440 prints them)."""
    return " and ".join(f"{key.replace('_', '-')} {_spec_text(spec)}"
                        for key, spec in conditions.items() if spec is not None)


def _spec_text(spec: SpecifierSet) -> str:
    return ",".join(sorted((str(s) for s in spec), key=lambda t: t.lstrip("<>=!~")))


@dataclass(frozen=True)
class FindingsFile:
    """One known-findings file: its entries, and the stacks it says they are known on
    (``[known_on]``; empty when it does not say)."""

    path: Path
    entries: tuple[XfailEntry, ...]
    known_on: Mapping[str, SpecifierSet] = field(default_factory=dict)

    def applies_to(self, versions: Mapping[str, str | None]) -> bool:
        """Whether ``--kv-xfails auto`` applies it to the installed stack: its
        ``[known_on]`` conditions hold; without that table, every conditioned entry's do
        (and it has one)."""
        if self.known_on:
            return conditions_hold(self.known_on, versions)
        conditioned = [e for e in self.entries if e.conditioned]
        return bool(conditioned) and all(e.versions_hold(versions) for e in conditioned)


def load_findings_file(path: str | Path) -> FindingsFile:
    """Parse and validate a known-findings file; the first problem raises
    :class:`XfailFileError` naming the file (and the entry and key)."""
    file = str(path)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)  # never more: a file of findings is small
    except OSError as exc:
        raise XfailFileError(file, f"cannot read: {exc.strerror or exc}") from exc
    if len(raw) > MAX_FILE_BYTES:
        raise XfailFileError(file, f"larger than the limit {MAX_FILE_BYTES} bytes for a "
                             "known-findings file")
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise XfailFileError(file, f"not UTF-8: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise XfailFileError(file, f"not valid TOML: {exc}") from exc
    unknown = sorted(set(data) - {"xfail", KNOWN_ON})
    if unknown:
        raise XfailFileError(
            file, f"unknown top-level key {unknown[0]!r} (expected [{KNOWN_ON}] and "
                  "[[xfail]] tables)")
    tables = data.get("xfail", [])
    if not isinstance(tables, list):
        raise XfailFileError(file, "'xfail' must be an array of tables ([[xfail]])")
    if len(tables) > MAX_ENTRIES:
        raise XfailFileError(file, f"{len(tables)} entries, more than the limit {MAX_ENTRIES} "
                             "for a known-findings file")
    known_on = _parse_known_on(file, data.get(KNOWN_ON))
    entries = tuple(_within(_parse_entry(file, i, table), known_on)
                    for i, table in enumerate(tables, start=1))
    return FindingsFile(Path(path), entries, known_on)


def _within(entry: XfailEntry, known_on: Mapping[str, SpecifierSet]) -> XfailEntry:
    """The entry's version conditions and its file's ``[known_on]``, both: however the
    file is applied (``auto`` or named), no entry applies where its file is not known."""
    def within(own: SpecifierSet | None, key: str) -> SpecifierSet | None:
        outer = known_on.get(key)
        return own if outer is None else outer if own is None else own & outer

    return replace(entry, vllm=within(entry.vllm, "vllm"),
                   vllm_omni=within(entry.vllm_omni, "vllm_omni"))


def _parse_known_on(file: str, table: Any) -> dict[str, SpecifierSet]:
    if table is None:
        return {}
    where = f"[{KNOWN_ON}]"
    if not isinstance(table, dict) or not table:
        raise XfailFileError(file, f"{where} must be a table of PEP 440 conditions on "
                             f"{' and '.join(_STACK_KEYS)}")
    out = {}
    for key, value in table.items():
        if key not in _STACK_KEYS:
            raise XfailFileError(file, f"{where}: unknown key {key!r} (allowed: "
                                 f"{', '.join(_STACK_KEYS)})")
        try:
            out[key] = SpecifierSet(value) if isinstance(value, str) and value.strip() else None
        except InvalidSpecifier:
            out[key] = None
        if out[key] is None:
            raise XfailFileError(file, f"{where}: key {key!r}: bad PEP 440 specifier {value!r}")
    return {key: spec for key, spec in out.items() if spec is not None}


def load_xfails(path: str | Path) -> list[XfailEntry]:
    """Parse and validate an xfail file's entries (:func:`load_findings_file`)."""
    return list(load_findings_file(path).entries)


def _parse_entry(file: str, index: int, table: Any) -> XfailEntry:
    def fail(message: str, key: str | None = None) -> XfailFileError:
        return XfailFileError(file, message, index=index, key=key)

    if not isinstance(table, dict):
        raise fail("must be a table")
    for key in table:
        if key not in _REQUIRED and key not in _OPTIONAL and key != ERRORS_KEY:
            allowed = ", ".join(_REQUIRED + _OPTIONAL + (ERRORS_KEY,))
            raise fail(f"unknown key (allowed: {allowed})", key)
    for key in _REQUIRED:
        if key not in table:
            hint = (": the failing control, one suite test function (e.g. "
                    f"{_example(str(table.get('clause')))!r})" if key == "test" else "")
            raise fail(f"missing (required){hint}", key)
    fields: dict[str, Any] = {}
    for key in _REQUIRED + _OPTIONAL:
        if key not in table:
            continue
        value = table[key]
        if not isinstance(value, str) or not value.strip():
            raise fail(f"must be a non-empty string, got {value!r}", key)
        fields[key] = value.strip()
    if fields["clause"] != ANY_CLAUSE and not CLAUSE_RE.match(fields["clause"]):
        raise fail(f"bad clause id {fields['clause']!r} (expected e.g. 'KV-L6')", "clause")
    _check_test(fields["test"], fields["clause"], fail)
    if "match" in fields:
        fields["match"] = _compile_match(fields["match"], fail)
    if "skip" in fields and fields["skip"] not in SKIP_KINDS:
        raise fail(f"must be one of {', '.join(SKIP_KINDS)} (a not-applicable skip needs no "
                   f"declaration), got {fields['skip']!r}", "skip")
    for key in _VERSION_KEYS:
        if key in fields:
            try:
                fields[key] = SpecifierSet(fields[key])
            except InvalidSpecifier as exc:
                raise fail(f"bad PEP 440 specifier {fields[key]!r}", key) from exc
    if "device" in fields and fields["device"] not in DEVICE_KINDS:
        raise fail(f"must be one of {', '.join(DEVICE_KINDS)}, got {fields['device']!r}", "device")
    if ERRORS_KEY in table:
        fields[ERRORS_KEY] = _parse_errors(table[ERRORS_KEY], fail)
    if "match" not in fields and "skip" not in fields and not fields.get(ERRORS_KEY):
        raise fail("describes no failure: give 'match' (a regular expression every problem of "
                   "the expected failure contains), 'skip' (the skip kind it declares) or "
                   "'errors' (the harness-error kinds it absorbs)")
    return XfailEntry(file=file, index=index, **fields)


def _compile_match(text: str, fail: Any) -> re.Pattern[str]:
    """``match`` compiled, refused when too long or when it can backtrack exponentially."""
    if len(text) > MAX_PATTERN_CHARS:
        raise fail(f"{len(text)} characters, more than the limit {MAX_PATTERN_CHARS}", "match")
    try:
        pattern = re.compile(text)
    except re.error as exc:
        raise fail(f"not a regular expression: {exc}", "match") from None
    except RecursionError:
        raise fail("not a regular expression: nested too deeply", "match") from None
    runaway = runaway_repeat(text)
    if runaway is not None:
        raise fail(f"{text!r} can backtrack without end: {runaway}; match what each problem "
                   "contains without repeating a group that itself repeats or alternates "
                   "(e.g. '.+' for '(.+)+', '[ab]+' for '(a|b)+')", "match")
    return pattern


# The regular expression parser's node kinds, by name (re._parser is private; read once).
_SRE: Any = importlib.import_module("re._parser")
_REPEATS = {str(op) for op in ("MAX_REPEAT", "MIN_REPEAT")}
_ATOMIC = {"POSSESSIVE_REPEAT", "ATOMIC_GROUP"}  # no backtracking into them


def runaway_repeat(text: str) -> str | None:
    """Why the pattern can backtrack exponentially, or None: a repetition (``*``, ``+``,
    ``{m,n}`` with n > 1) of something that can match in more than one way, i.e. that
    varies in length (``(.+)+``, ``(a*b?)*``, ``(.*a){20}``) or alternates (``(a|aa)+``),
    a back-reference included.  Possessive and atomic groups never backtrack: allowed."""
    def walk(items: Any, inside: str | None) -> str | None:
        for op, arg in items:
            name = str(op)
            if name in _ATOMIC:
                continue
            if name in _REPEATS:
                low, high, body = arg
                if inside is not None and low != high:
                    return f"{inside} repeats {_shown_node(name, low, high)}, which varies"
                repeats = high > 1 or high == _SRE.MAXREPEAT
                if repeats:
                    lo, hi = body.getwidth()
                    if lo != hi:
                        return f"a repetition {_shown_node(name, low, high)} of something " \
                               "that varies in length"
                found = walk(body, "a repetition" if repeats else inside)
            elif name == "BRANCH":
                if inside is not None:
                    return f"{inside} holds an alternation"
                found = next((f for f in (walk(b, None) for b in arg[1]) if f), None)
            elif name == "SUBPATTERN":
                found = walk(arg[-1], inside)
            elif name in ("ASSERT", "ASSERT_NOT"):
                found = walk(arg[1], inside)
            elif name == "GROUPREF" and inside is not None:
                return f"{inside} holds a back-reference"
            elif name == "GROUPREF_EXISTS":
                found = next((f for f in (walk(b, inside) for b in arg[1:] if b) if f), None)
            else:
                found = None
            if found:
                return found
        return None

    try:
        return walk(_SRE.parse(text), None)
    except (re.error, RecursionError):
        return None  # compile() says what is wrong with it


def _shown_node(name: str, low: int, high: int) -> str:
    most = "" if high == _SRE.MAXREPEAT else str(high)
    lazy = "?" if name == "MIN_REPEAT" else ""
    shown = {(0, ""): "*", (1, ""): "+", (0, "1"): "?"}.get(
        (low, most), f"{{{low}}}" if str(low) == most else f"{{{low},{most}}}")
    return f"'{shown}{lazy}'"


class _OverBudget(Exception):
    """A search ran past :data:`MATCH_BUDGET_S`."""


def bounded_search(pattern: re.Pattern[str], text: str,
                   budget: float = MATCH_BUDGET_S) -> bool | None:
    """Whether ``pattern`` is found in ``text``; None when the search was given up after
    ``budget`` seconds.  The bound is a real-time timer (the regular expression engine
    checks for signals as it goes), armed only in the main thread and only when no other
    timer or SIGALRM handler is in use; elsewhere the search runs unbounded (a pattern that
    can backtrack exponentially is refused at load already)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getitimer(signal.ITIMER_REAL)[0]
            or signal.getsignal(signal.SIGALRM) not in (signal.SIG_DFL, signal.SIG_IGN)):
        return pattern.search(text) is not None
    armed = True

    def expire(signum: int, frame: Any) -> None:
        if armed:
            raise _OverBudget

    previous = signal.signal(signal.SIGALRM, expire)
    try:
        signal.setitimer(signal.ITIMER_REAL, budget)
        try:
            return pattern.search(text) is not None
        finally:
            armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _OverBudget:
        return None
    finally:
        signal.signal(signal.SIGALRM, previous)


def _check_test(test: str, clause: str, fail: Any) -> None:
    """``test`` names one suite test function of ``clause`` (``*`` only for every clause)."""
    if test == ANY_TEST:
        if clause != ANY_CLAUSE:
            raise fail(f"'*' names no control; name the failing suite test of {clause}, e.g. "
                       f"{_example(clause)!r} ('*' is for clause = '*' only)", "test")
        return
    names = check_names()
    if test not in names:
        raise fail(f"unknown suite test {test!r}; the tests of "
                   f"{clause if clause != ANY_CLAUSE else 'the suite'} are "
                   f"{', '.join(n for n in names if clause in (ANY_CLAUSE, names[n][0].id))}",
                   "test")
    if clause != ANY_CLAUSE and clause_from_test_name(test) != clause:
        raise fail(f"{test!r} is a test of {clause_from_test_name(test)}, not of {clause}",
                   "test")


def _example(clause: str) -> str:
    names = [n for n, (row, _) in check_names().items() if row.id == clause]
    return names[0] if names else "test_kv_l2"


def _parse_errors(value: Any, fail: Any) -> frozenset[str]:
    """``true`` (every kind), ``false``, a kind, or a list of kinds."""
    if isinstance(value, bool):
        return frozenset(ERROR_KINDS) if value else frozenset()
    kinds = [value] if isinstance(value, str) else value
    if not isinstance(kinds, list) or not kinds:
        raise fail(f"must be true, false, a kind or a list of kinds, got {value!r}", ERRORS_KEY)
    for kind in kinds:
        if kind not in ERROR_KINDS:
            raise fail(f"unknown harness-error kind {kind!r} (expected "
                       f"{', '.join(ERROR_KINDS)})", ERRORS_KEY)
    return frozenset(kinds)


def matching(
    entries: Iterable[XfailEntry],
    *,
    backend: str | None,
    clause: str,
    case: str | None,
    layout: str | None,
    versions: Mapping[str, str | None],
    device_kind: str,
    test: str | None = None,
) -> list[XfailEntry]:
    """Every entry, in file order, that names the test and applies on this host."""
    return [entry for entry in entries
            if entry.matches(backend, clause, case, layout, test)
            and entry.applies_to(versions, device_kind)]


def first_match(
    entries: Iterable[XfailEntry],
    *,
    backend: str | None,
    clause: str,
    case: str | None,
    layout: str | None,
    versions: Mapping[str, str | None],
    device_kind: str,
    test: str | None = None,
) -> XfailEntry | None:
    """The first entry, in file order, that names the test and applies on this host."""
    found = matching(entries, backend=backend, clause=clause, case=case, layout=layout,
                     versions=versions, device_kind=device_kind, test=test)
    return found[0] if found else None


def xfail_reason(entry: XfailEntry) -> str:
    """The xfail reason a test an entry names is marked with (and its report keeps)."""
    return f"known: {entry.reason} [{entry.describe()}]"


def stale_entries(
    entries: Iterable[XfailEntry],
    matched_ids: Collection[str],
    *,
    versions: Mapping[str, str | None] | None = None,
    device_kind: str | None = None,
) -> list[XfailEntry]:
    """Entries whose :meth:`~XfailEntry.describe` id is not in ``matched_ids``.

    With ``versions`` and ``device_kind`` given, an entry whose conditions do
    not hold on this host is not stale here (it is written for another host).
    """
    stale = []
    for entry in entries:
        if entry.describe() in matched_ids:
            continue
        if versions is not None and device_kind is not None:
            if not entry.applies_to(versions, device_kind):
                continue
        stale.append(entry)
    return stale


# --- the known findings a run applies (``--kv-xfails auto|none|FILE``) -------------------

AUTO = "auto"
NONE = "none"
# The known findings shipped with the package, one file per serving stack.
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "known"


@dataclass(frozen=True)
class KnownFindings:
    """The known-findings files a run applies, their entries in file order, and why (the
    header's line)."""

    paths: tuple[Path, ...]
    why: str
    entries: tuple[XfailEntry, ...] = ()

    def header_line(self) -> str:
        where = ", ".join(_shown(p) for p in self.paths) or "none"
        return f"kvconform: known findings: {where} ({self.why})"

    @property
    def option(self) -> str | None:
        """What the report's options record as the files applied (None: none): a shipped
        file by its place in the package, so two environments' reports name it alike."""
        return ", ".join(_shown(p) for p in self.paths) or None


def _shown(path: Path) -> str:
    """A shipped file by its place in the package, any other as given."""
    try:
        return str(Path("pytest_kvconform", "known", path.relative_to(SHIPPED_DIR)))
    except ValueError:
        return str(path)


def describe_versions(versions: Mapping[str, str | None]) -> str:
    return ", ".join(f"{key.replace('_', '-')} {versions.get(key) or 'not installed'}"
                     for key in _STACK_KEYS)


def shipped_for(versions: Mapping[str, str | None],
                shipped: Path = SHIPPED_DIR) -> KnownFindings:
    """The shipped files whose findings are known on the installed stack (each one's
    ``[known_on]`` holds, or without it each conditioned entry's), in name order: one
    file holds a finding for every stack it is known on, and a stack may have several
    files (e.g. vllm-omni's findings and vLLM's own)."""
    found = [f for f in map(load_findings_file, sorted(shipped.glob("*.toml")))
             if f.applies_to(versions)]
    installed = describe_versions(versions)
    if not found:
        return KnownFindings((), f"no shipped file is written for {installed}")
    ranges = [f"{f.path.name if len(found) > 1 else ''} known on "
              f"{describe_conditions(f.known_on)}".lstrip() for f in found if f.known_on]
    if ranges:
        why = f"shipped; {'; '.join(ranges)}: the installed {installed}"
    else:
        why = f"shipped; written for the installed {installed}"
    return KnownFindings(tuple(f.path for f in found), why,
                         tuple(e for f in found for e in f.entries))


def known_findings(value: str | Path | None, versions: Mapping[str, str | None]
                   ) -> KnownFindings:
    """``--kv-xfails``: ``auto`` (default) the shipped files for the installed stack,
    ``none`` no known findings, else the file named; a bad file raises
    :class:`XfailFileError` naming it."""
    text = str(value) if value not in (None, "") else AUTO
    if text == AUTO:
        return shipped_for(versions)
    if text == NONE:
        return KnownFindings((), "--kv-xfails none")
    return KnownFindings((Path(text),), "--kv-xfails", tuple(load_xfails(text)))


# How many stale entries the summary names before it counts the rest.
SHOWN_STALE = 5


def stale_summary(stale: Sequence[XfailEntry], shown: int = SHOWN_STALE) -> str | None:
    """One line for the entries that matched no test: their count and the first few
    (a file of thousands would otherwise print thousands of lines); None when none."""
    if not stale:
        return None
    names = ", ".join(e.describe() for e in stale[:shown])
    more = f", and {len(stale) - shown} more" if len(stale) > shown else ""
    return (f"{len(stale)} stale known-finding entr{'ies' if len(stale) != 1 else 'y'} "
            f"matched no test: {names}{more}")
