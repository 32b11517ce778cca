"""pytest's rootdir and configfile, decided as if pytest had known the plugin's options.

pytest decides the rootdir, finds the configfile and prepends its ``addopts`` from the
arguments before any entry-point plugin has registered its options (``Config._preparse``).
An option it does not know yet is set aside, and its value taken for a test path: with
``--kv-xfails FILE`` (two arguments) an existing FILE outside the repository moves the
rootdir above it, the repository's ``pyproject.toml`` is not read (nor its ``kv_*`` keys,
``addopts`` or ``filterwarnings``), ``.pytest_cache`` is written outside it, and test ids
change, while ``--kv-xfails=FILE`` does none of this (pytest's issue 8846).

The first hook of the plugin that sees the arguments once every option is known is
``pytest_load_initial_conftests``, before any conftest is loaded or the configfile's
values are used.  There the setup is decided again, with the values of this plugin's
options read as values; only when an option of ours was written as two arguments, and
only when that gives another rootdir or configfile, the config takes them: the
configfile's ``addopts`` (and ``-o`` overrides) in place of the other's, its
``minversion``, ``required_plugins``, ``pythonpath`` and ``-p`` plugins, and the conftest
cut-off pytest derives from it.  pytest's private setup is reached by feature detection
(the attributes it has kept since 8.0); where one is missing nothing is changed.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from pytest_kvconform.session.options import GROUP


def value_flags(parser: pytest.Parser) -> set[str]:
    """This plugin's options that take a value (``--kv-xfails``, not ``--kv-strict``)."""
    flags: set[str] = set()
    for option in parser.getgroup(GROUP).options:
        if option.attrs().get("action") not in ("store_true", "store_false"):
            flags.update(name for name in option.names() if name.startswith("--"))
    return flags


def _split_values(args: Iterable[str], flags: set[str]) -> bool:
    """Whether an option of ours is written as two arguments (``--kv-xfails FILE``)."""
    args = list(args)
    return any(arg in flags and i + 1 < len(args) for i, arg in enumerate(args))


def settle(config: pytest.Config, args: list[str]) -> None:
    """Decide the rootdir and configfile again now that the options are known (see the
    module docstring); ``args`` is pytest's own list of arguments, changed in place."""
    if not _split_values(args, value_flags(config._parser)):
        return
    try:
        from _pytest.config.findpaths import determine_setup
    except ImportError:
        return
    old_addopts = list(config.getini("addopts") or ())
    given = args[len(old_addopts):] if args[:len(old_addopts)] == old_addopts else list(args)
    ns = config._parser.parse_known_args(given, namespace=copy.copy(config.option))
    found = _determine(determine_setup, ns, config.invocation_params.dir)
    if found is None:
        return
    rootpath, inipath = found[0], found[1]
    if (Path(rootpath), inipath and Path(inipath)) == (config.rootpath, config.inipath):
        return
    _adopt(config, args, given, found)


def _determine(determine_setup: Any, ns: Any, invocation_dir: Path) -> tuple[Any, ...] | None:
    """pytest's own determine_setup, called with what this version of it takes."""
    offered = {"inifile": ns.inifilename, "override_ini": getattr(ns, "override_ini", None),
               "args": ns.file_or_dir, "rootdir_cmd_arg": ns.rootdir or None,
               "invocation_dir": invocation_dir}
    params = inspect.signature(determine_setup).parameters
    if not {"inifile", "args"} <= set(params):
        return None
    found = determine_setup(**{k: v for k, v in offered.items() if k in params})
    return tuple(found)


_SETUP = ("_rootpath", "_inipath", "_inicfg", "_inicache", "_parser", "known_args_namespace")


def _adopt(config: Any, args: list[str], given: list[str], found: tuple[Any, ...]) -> None:
    if not all(hasattr(config, name) for name in _SETUP):
        return
    config._rootpath, config._inipath, config._inicfg = found[0], found[1], found[2]
    if len(found) > 3 and hasattr(config, "_ignored_config_files"):
        config._ignored_config_files = found[3]
    config._inicache.clear()
    config._parser.extra_info["rootdir"] = str(config.rootpath)
    config._parser.extra_info["inifile"] = str(config.inipath)
    addopts = list(config.getini("addopts") or ())
    if hasattr(config, "_validate_args"):
        addopts = config._validate_args(addopts, "via addopts config")
    args[:] = [*addopts, *given]
    config.known_args_namespace = config._parser.parse_known_args(
        args, namespace=copy.copy(config.option))
    _override_ini(config)
    if config.known_args_namespace.confcutdir is None:
        config.known_args_namespace.confcutdir = str(
            config.inipath.parent if config.inipath is not None else config.rootpath)
    for step in ("_checkversion", "_configure_python_path"):
        if hasattr(config, step):
            getattr(config, step)()
    if addopts:
        config.pluginmanager.consider_preparse(addopts, exclude_only=False)
    if hasattr(config, "_validate_plugins"):
        config._validate_plugins()


def _override_ini(config: Any) -> None:
    """``-o`` given in the configfile's addopts, applied as pytest applies it."""
    try:
        from _pytest.config.findpaths import parse_override_ini
    except ImportError:
        return
    overrides = parse_override_ini(getattr(config.known_args_namespace, "override_ini", None))
    if overrides:
        config._inicfg.update(overrides)
        config._inicache.clear()
