"""Load vLLM / vllm-omni plugins as a production process does, recording what each did.

vllm-omni's engine, stage process and diffusion workers call
``vllm_omni.plugins.load_omni_general_plugins()`` before they resolve a
backend: vLLM's ``vllm.general_plugins`` group, then ``vllm_omni.general_plugins``,
each filtered by ``VLLM_PLUGINS``.  Out-of-tree packages re-point registry members
(``register_diffusion_backend``) from such a hook, so the suite must check what
production would run.  The installed production functions do the work (the
group loaders, found by feature detection); only the loop that calls each hook
is ours, so a snapshot of the registry before and after each hook says which
distribution and entry point put an override there.  The two failures production
tells apart stay apart: a plugin that fails to *import* is logged and skipped by
production's loader, and so here; a hook that *raises* stops a production process
at start-up (the loaders call hooks unguarded), so here it is recorded
(``hook-failed``), its registry changes are undone, and the run goes on to check
the deployment without it, while the verdict names it as what keeps production from
starting (``report_verdict.startup_failures``).  ``current_omni_platform`` is then
resolved (platform plugins included), as production resolves it.

Once per process, like production's own ``*_plugins_loaded`` flags; the test
process, each xdist worker and each spawned KV-A worker call :func:`load_plugins`.
Stdlib only at import: vLLM and vllm-omni are imported inside the functions.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from pytest_kvconform.adapters import vllm_registry
from pytest_kvconform.contract.outcomes import describe_error

MODES = ("production", "none")
ENV = "VLLM_PLUGINS"
CPU_PLATFORM_ENV = "KVCONFORM_CPU_OMNI_PLATFORM"  # omni_cpu_platform.ENV
IN_TREE = "in-tree"
BEFORE = "set before kvconform loaded plugins (a conftest, or an import)"
VLLM_GROUP = "vllm.general_plugins"
OMNI_GROUP = "vllm_omni.general_plugins"
PLATFORM_GROUP = "vllm_omni.platform_plugins"
# The production loggers whose "Failed to load plugin %s" records carry a load error.
_LOADER_LOGGERS = ("vllm.plugins", "vllm_omni.plugins")
_PLATFORM_LOGGER = "vllm_omni.platforms"

Snapshot = dict[str, str]  # registry member -> the path it resolves to


@dataclass(frozen=True)
class PluginRecord:
    """One entry point of a plugin group and what became of it."""

    group: str
    name: str
    value: str
    dist: str | None
    status: str  # loaded | load-failed | hook-failed | not-allowed | shadowed
    error: str | None = None
    changed: tuple[str, ...] = ()  # registry members its hook re-pointed

    @property
    def origin(self) -> str:
        dist = f"distribution {self.dist}, " if self.dist else ""
        return f"{dist}entry point {self.group}:{self.name} ({self.value})"


@dataclass
class PluginLoad:
    """What loading the plugins did in this process."""

    mode: str = "production"
    vllm_plugins: str | None = None  # $VLLM_PLUGINS as production read it
    loader: str = ""
    plugins: list[PluginRecord] = field(default_factory=list)
    overrides: dict[str, str] = field(default_factory=dict)  # member -> path
    origins: dict[str, str] = field(default_factory=dict)  # overridden member -> origin
    platform: str | None = None
    platform_source: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def failed(self) -> list[PluginRecord]:
        return [p for p in self.plugins if p.status.endswith("failed")]

    def origin_of(self, member: str, overridden: bool) -> str:
        if not overridden:
            return IN_TREE
        return self.origins.get(member, BEFORE)

    def as_dict(self) -> dict[str, Any]:
        """The report's ``environment.plugins``."""
        data = asdict(self)
        data["plugins"] = [{**asdict(p), "changed": list(p.changed)} for p in self.plugins]
        return data

    def header_lines(self) -> list[str]:
        """The run header's plugin lines: mode, each override with its source, each failure."""
        env = "unset" if self.vllm_plugins is None else repr(self.vllm_plugins)
        loaded = [f"{p.name}" for p in self.plugins if p.status == "loaded"]
        lines = [f"kvconform: plugins: {self.mode} (VLLM_PLUGINS {env}); loaded: "
                 f"{', '.join(loaded) or '-'}; platform: {self.platform or '-'}"
                 + (f" ({self.platform_source})" if self.platform_source else "")]
        skipped = [p.name for p in self.plugins if p.status == "not-allowed"]
        if skipped:
            lines.append(f"kvconform: plugins not loaded (VLLM_PLUGINS): {', '.join(skipped)}")
        for member, path in sorted(self.overrides.items()):
            lines.append(f"kvconform: override: {member} -> {path} (by "
                         f"{self.origin_of(member, True)})")
        if not self.overrides:
            lines.append("kvconform: override: none (every registry member is its in-tree "
                         "class)")
        for p in self.failed:
            who = f"plugin {p.name} ({p.group}, {p.dist or 'no distribution'})"
            if p.status == "load-failed":
                lines.append(f"kvconform: WARNING: {who} failed to load: {p.error}; production "
                             "logs this and starts without it, and so does the run")
            else:
                lines.append(f"kvconform: ERROR: {who} hook raised: {p.error}; production's "
                             "loader calls it unguarded, so a server with it installed fails "
                             "at start-up: the run is not qualified (it checks the deployment "
                             "without this plugin)")
        lines += [f"kvconform: note: plugins: {note}" for note in self.notes]
        return lines


# --- registry state -------------------------------------------------------------------


def registry_snapshot() -> Snapshot:
    """Where each registry member resolves now (overrides count): vllm-omni's diffusion
    registry's, and vLLM's own attention registries' (``vllm.<MEMBER>``)."""
    snap = vllm_registry.snapshot()
    try:
        from vllm_omni.diffusion.attention.backends.registry import (
            DiffusionAttentionBackendEnum,
        )
    except Exception:
        return snap
    for member in DiffusionAttentionBackendEnum:
        try:
            snap[member.name] = str(member.get_path())
        except Exception as exc:
            snap[member.name] = f"<unresolvable: {describe_error(exc)}>"
    return snap


def overridden_members() -> dict[str, str]:
    """The members ``register_diffusion_backend`` or vLLM's ``register_backend`` re-pointed."""
    found = vllm_registry.overridden()
    try:
        from vllm_omni.diffusion.attention.backends.registry import (
            DiffusionAttentionBackendEnum,
        )
    except Exception:
        return found
    return {**found, **{m.name: str(m.get_path()) for m in DiffusionAttentionBackendEnum
                        if m.is_overridden()}}


def _changed(before: Snapshot, after: Snapshot) -> tuple[str, ...]:
    return tuple(sorted(k for k in after if before.get(k) != after[k]))


# --- capture of the production loaders' logging --------------------------------------


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _captured(names: tuple[str, ...], level: int | None = None,
              ) -> Iterator[list[logging.LogRecord]]:
    """Records the named loggers emit while the block runs (``level``: lowered to it)."""
    handler = _Capture()
    saved = []
    for name in names:
        logger = logging.getLogger(name)
        saved.append((logger, logger.level))
        logger.addHandler(handler)
        if level is not None and logger.getEffectiveLevel() > level:
            logger.setLevel(level)
    try:
        yield handler.records
    finally:
        for logger, old in saved:
            logger.removeHandler(handler)
            logger.setLevel(old)


def _load_error(records: list[logging.LogRecord], name: str) -> str | None:
    for record in records:
        if "Failed to load plugin" in str(record.msg) and name in (record.args or ()):
            if record.exc_info and record.exc_info[1] is not None:
                return describe_error(record.exc_info[1])
            return record.getMessage()
    return None


# --- loading --------------------------------------------------------------------------


def _dist(ep: EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None
    return f"{dist.metadata['Name']} {dist.version}"


def allowed_plugins() -> list[str] | None:
    """``VLLM_PLUGINS`` as production parses it (vllm.envs), None when unset."""
    try:
        import vllm.envs as envs

        value = envs.VLLM_PLUGINS
        return None if value is None else list(value)
    except Exception:
        raw = os.environ.get(ENV)
        return None if raw is None else raw.split(",")


def _load_group(result: PluginLoad, group: str,
                loader: Callable[[str], dict[str, Callable[[], Any]]]) -> None:
    """``loader(group)`` (production's), then each hook in order, each one watched."""
    allowed = allowed_plugins()
    eps = list(entry_points(group=group))
    before = registry_snapshot()
    with _captured(_LOADER_LOGGERS) as records:
        try:
            hooks = loader(group)
        except Exception as exc:
            result.notes.append(f"loading group {group} raised {describe_error(exc)}")
            hooks = {}
    at_import = _changed(before, registry_snapshot())
    if at_import:  # a module that registers when imported: one of this group's
        names = ", ".join(sorted(hooks)) or "-"
        for member in at_import:
            result.origins[member] = f"import of the {group} plugins ({names})"
    last = {ep.name: ep for ep in eps}  # production keeps one hook per name: the last
    for ep in eps:
        record = PluginRecord(group, ep.name, ep.value, _dist(ep), "loaded")
        if last[ep.name] is not ep:
            result.plugins.append(replace(record, status="shadowed",
                                          error="a later entry point has the same name"))
            continue
        if allowed is not None and ep.name not in allowed:
            result.plugins.append(replace(record, status="not-allowed"))
            continue
        if ep.name not in hooks:
            error = _load_error(records, ep.name) or _reload_error(ep)
            result.plugins.append(replace(record, status="load-failed", error=error))
            continue
        before = registry_snapshot()
        saved = overridden_members()
        try:
            hooks[ep.name]()
        except (Exception, SystemExit) as exc:
            error = describe_error(exc)
            partial = _changed(before, registry_snapshot())
            if partial:
                _restore_overrides(saved)
                error += f" (it had re-pointed {', '.join(partial)}: undone)"
            record = replace(record, status="hook-failed", error=error)
        changed = _changed(before, registry_snapshot())
        for member in changed:
            result.origins[member] = record.origin
        result.plugins.append(replace(record, changed=changed))


def _restore_overrides(saved: dict[str, str]) -> None:
    """Put the registry's overrides back as they were (``overridden_members()``): what a
    hook changed before it raised is not what production would run."""
    from vllm_omni.diffusion.attention.backends.registry import (
        DiffusionAttentionBackendEnum,
        register_diffusion_backend,
    )

    for member in DiffusionAttentionBackendEnum:
        if member.name in saved:
            register_diffusion_backend(member, saved[member.name])
        else:
            member.clear_override()
    vllm_registry.restore(saved)


def _reload_error(ep: EntryPoint) -> str:
    try:
        ep.load()
    except Exception as exc:
        return describe_error(exc)
    return "failed to load (the production loader logged no error)"


_loaded: PluginLoad | None = None


def load_plugins(mode: str = "production") -> PluginLoad:
    """Run the general plugins (mode ``production``) and resolve the Omni platform.

    ``none`` loads no general plugin; the caller sets ``VLLM_PLUGINS=""`` so the
    platform and spawned workers load none either.  Once per process: later
    calls return the first record.
    """
    global _loaded
    if _loaded is not None:
        note = (f"plugins were loaded in this process in mode {_loaded.mode} before; mode "
                f"{mode} cannot undo that")
        if _loaded.mode != mode and note not in _loaded.notes:
            _loaded.notes.append(note)
        return _loaded
    result = PluginLoad(mode=mode, vllm_plugins=os.environ.get(ENV))
    if importlib.util.find_spec("vllm_omni") is None:
        result.notes.append("vllm-omni not installed: no plugin loaded")
        _loaded = result
        return result
    before = overridden_members()
    # The platform may resolve while plugins load (backend modules ask for it): its
    # "plugin X is activated" record is caught wherever it happens.
    with _captured((_PLATFORM_LOGGER,), logging.INFO) as platform_records:
        if mode == "production":
            _load_general(result)
        else:
            result.loader = "none (--kv-plugins=none)"
            for group in (VLLM_GROUP, OMNI_GROUP):
                result.plugins += [PluginRecord(group, ep.name, ep.value, _dist(ep),
                                                "not-allowed")
                                   for ep in entry_points(group=group)]
        for member in before:
            result.origins.setdefault(member, BEFORE)
        _resolve_platform(result, platform_records)
    result.overrides = overridden_members()
    _loaded = result
    return result


def _load_general(result: PluginLoad) -> None:
    """Production's ``load_omni_general_plugins``, one hook at a time."""
    try:
        vllm_plugins = importlib.import_module("vllm.plugins")
        omni_plugins = importlib.import_module("vllm_omni.plugins")
    except Exception as exc:
        result.notes.append(f"vllm-omni's plugin loader does not import: {describe_error(exc)}")
        return
    vllm_loader = getattr(vllm_plugins, "load_plugins_by_group", None)
    omni_loader = getattr(omni_plugins, "load_omni_plugins_by_group", None)
    if getattr(omni_plugins, "omni_plugins_loaded", False):
        result.loader = "already run in this process before kvconform"
        result.notes.append("vllm-omni's general plugins were already loaded in this process; "
                            "sources of overrides are unknown")
        return
    if vllm_loader is None or omni_loader is None:
        _load_whole(result, omni_plugins)
        return
    result.loader = "vllm.plugins.load_plugins_by_group + vllm_omni.plugins." \
                    "load_omni_plugins_by_group"
    setattr(omni_plugins, "omni_plugins_loaded", True)  # noqa: B010 - as production, first
    if getattr(vllm_plugins, "plugins_loaded", False):
        result.notes.append(f"vLLM's {VLLM_GROUP} were already loaded in this process")
    else:
        setattr(vllm_plugins, "plugins_loaded", True)  # noqa: B010
        _load_group(result, getattr(vllm_plugins, "DEFAULT_PLUGINS_GROUP", VLLM_GROUP),
                    vllm_loader)
    _load_group(result, getattr(omni_plugins, "OMNI_DEFAULT_PLUGINS_GROUP", OMNI_GROUP),
                omni_loader)


def _load_whole(result: PluginLoad, omni_plugins: Any) -> None:
    """An install without per-group loaders: run the whole entry point, watch the registry."""
    load = getattr(omni_plugins, "load_omni_general_plugins", None)
    if load is None:
        result.loader = "none (the installed vllm-omni has no general-plugin loader)"
        result.notes.append("installed vllm-omni has no load_omni_general_plugins; none loaded")
        return
    result.loader = "vllm_omni.plugins.load_omni_general_plugins"
    before = registry_snapshot()
    saved = overridden_members()
    try:
        load()
    except Exception as exc:
        error = describe_error(exc)
        partial = _changed(before, registry_snapshot())
        if partial:
            _restore_overrides(saved)
            error += f" (the plugins had re-pointed {', '.join(partial)}: undone)"
        result.plugins.append(PluginRecord(OMNI_GROUP, "load_omni_general_plugins", "", None,
                                           "hook-failed", error))
    for member in _changed(before, registry_snapshot()):
        result.origins[member] = "load_omni_general_plugins() (per-plugin source unknown)"


def _detects(entry_point: Any, qualname: str) -> bool:
    """Whether a platform plugin's detector names ``qualname`` here (as vllm-omni calls it)."""
    try:
        return bool(entry_point.load()() == qualname)
    except Exception:  # a detector that fails did not activate (vllm-omni's reading too)
        return False


def _resolve_platform(result: PluginLoad, records: list[logging.LogRecord]) -> None:
    """``current_omni_platform`` as production resolves it (platform plugins included)."""
    before = registry_snapshot()
    try:
        platforms = importlib.import_module("vllm_omni.platforms")
        platform = platforms.current_omni_platform
    except Exception as exc:
        result.notes.append(f"the current Omni platform does not resolve: {describe_error(exc)}")
        return
    cls = type(platform)
    result.platform = f"{cls.__module__}.{cls.__qualname__}"
    activated = [str(r.args[0]) for r in records
                 if "is activated" in str(r.msg) and isinstance(r.args, tuple) and r.args]
    allowed = allowed_plugins()
    eps = [e for e in entry_points(group=PLATFORM_GROUP) if allowed is None or e.name in allowed]
    if activated:
        eps = [e for e in eps if e.name == activated[0]]
    elif len(eps) > 1:  # resolved before the logs were caught: ask each detector again
        eps = [e for e in eps if _detects(e, result.platform)] or eps
    if cls.__module__.startswith("vllm_omni.") and not activated:
        result.platform_source = "built-in"
    elif len(eps) == 1:
        ep = eps[0]
        result.platform_source = PluginRecord(PLATFORM_GROUP, ep.name, ep.value, _dist(ep),
                                              "loaded").origin
    else:  # resolved before kvconform loaded plugins: say which plugins could have
        names = ", ".join(e.name for e in eps) or "none installed"
        result.platform_source = f"a platform plugin, one of: {names}"
    for member in _changed(before, registry_snapshot()):
        result.origins[member] = f"the Omni platform {result.platform}"


def set_plugins_env(mode: str) -> tuple[bool, str | None]:
    """``none``: ``VLLM_PLUGINS=""`` (production's switch) here and in spawned workers; on a
    CPU run ``VLLM_PLUGINS=kvconform_cpu``, which loads no general plugin either.

    Returns what to hand :func:`restore_plugins_env`.
    """
    saved = (ENV in os.environ, os.environ.get(ENV))
    if mode == "none":  # a CPU run keeps the plugin's own CPU platform (run_env.CPU_DEFAULTS)
        os.environ[ENV] = "kvconform_cpu" if os.environ.get(CPU_PLATFORM_ENV) == "1" else ""
    return saved


def restore_plugins_env(saved: tuple[bool, str | None]) -> None:
    present, value = saved
    if present and value is not None:
        os.environ[ENV] = value
    else:
        os.environ.pop(ENV, None)


# --- in a worker ----------------------------------------------------------------------


def worker_summary(load: PluginLoad) -> dict[str, Any]:
    """What a spawned worker reports about its plugin load (plain values, for the pipe)."""
    return {"mode": load.mode, "vllm_plugins": load.vllm_plugins, "overrides": load.overrides,
            "failed": [f"{p.name}: {p.error}" for p in load.failed], "notes": load.notes}
