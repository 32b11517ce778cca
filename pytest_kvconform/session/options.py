"""Command-line options and ini keys; every option is both."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

GROUP = "kvconform"
# --kv-timeout's default, per test: budget.DEFAULT_TIMEOUT_S (the plain API's), kept here too
# so that a run without --kv-conformance imports no budget / outcomes (the plugin-off
# cost); tests/test_plugin.py checks that the two agree.
DEFAULT_TIMEOUT_S = 300.0


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup(GROUP, "KV-cache layout conformance (pytest-kvconform)")

    def both(flag: str, dest: str, help: str, *, ini_type: str | None = None,
             ini_default: Any = None, **kwargs: Any) -> None:
        group.addoption(flag, dest=dest, help=help + f" [ini: {dest}]", **kwargs)
        parser.addini(dest, help=help, type=ini_type, default=ini_default)  # type: ignore[arg-type]

    both("--kv-conformance", "kv_conformance",
         "run the KV-cache layout conformance suite against every registered diffusion "
         "attention backend", action="store_true", default=None, ini_type="bool",
         ini_default=False)
    both("--kv-backend", "kv_backend",
         "check only this backend (repeatable; others are not imported); an unknown name "
         "lists the available ones",
         action="append", default=None, metavar="NAME", ini_type="linelist", ini_default=[])
    both("--kv-device", "kv_device",
         "device the worker allocates on: auto (CUDA when visible, else cpu), cpu, cuda, "
         "cuda:N", default=None, metavar="auto|cpu|cuda[:N]", ini_type="string",
         ini_default="auto")
    both("--kv-cases", "kv_cases", "extra case file (TOML, repeatable)", action="append",
         default=None, metavar="PATH", ini_type="paths", ini_default=[])
    both("--kv-report", "kv_report",
         "write the qualification report as JSON to PATH and Markdown next to it (a PATH "
         "ending in .md: Markdown there, JSON next to it); checked writable at start-up",
         default=None, metavar="PATH", ini_type="string", ini_default="")
    both("--kv-xfails", "kv_xfails",
         "known findings (TOML): matching tests become xfails; auto (default): the file "
         "shipped for the installed vLLM / vllm-omni; none: no known findings",
         default=None, metavar="auto|none|FILE", ini_type="string", ini_default="auto")
    both("--kv-strict", "kv_strict",
         "qualification mode: an xpass or error fails, a partial run fails, and a skip fails "
         "unless the clause table forgives its kind for that clause",
         action="store_true", default=None, ini_type="bool", ini_default=False)
    both("--kv-allow-oversubscribe", "kv_allow_oversubscribe",
         "allow more xdist workers than GPUs (workers then share devices)",
         action="store_true", default=None, ini_type="bool", ini_default=False)
    both("--kv-memory-fraction", "kv_memory_fraction",
         "fraction of a GPU's free memory KV-A6 allocates (default 0.5)", default=None,
         metavar="F", ini_type="string", ini_default="0.5")
    both("--kv-timeout", "kv_timeout",
         "per-test budget in seconds: a clause check still waiting (on a worker, or on a "
         "backend's declaration) after it is an error naming what it waited for "
         f"(default {DEFAULT_TIMEOUT_S:g})", default=None, metavar="SECONDS",
         ini_type="string", ini_default=f"{DEFAULT_TIMEOUT_S:g}")
    both("--kv-plugins", "kv_plugins",
         "production: load vLLM / vllm-omni general and platform plugins before discovery, "
         "as production processes do (default); none: check in-tree classes only "
         "(sets VLLM_PLUGINS='')", default=None, metavar="production|none",
         ini_type="string", ini_default="production")


@dataclass(frozen=True)
class Options:
    """The resolved options: the CLI value where given, else the ini value."""

    enabled: bool = False
    backends: tuple[str, ...] = ()
    device: str = "auto"
    cases: tuple[Path, ...] = ()
    report: Path | None = None
    xfails: str = "auto"  # auto | none | a file (session/xfails.known_findings)
    strict: bool = False
    allow_oversubscribe: bool = False
    memory_fraction: float = 0.5
    timeout: float = DEFAULT_TIMEOUT_S
    plugins: str = "production"
    raw: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: pytest.Config) -> Options:
        def get(dest: str) -> Any:
            value = config.getoption(dest, None)
            return value if value is not None else config.getini(dest)

        base = config.invocation_params.dir
        cases = [Path(p) for p in (config.getoption("kv_cases") or [])]
        cases = [p if p.is_absolute() else base / p for p in cases]
        cases += [Path(p) for p in config.getini("kv_cases")] if not cases else []
        report = get("kv_report") or None
        xfails = str(get("kv_xfails") or "auto")
        fraction_text = str(get("kv_memory_fraction"))
        try:
            fraction = float(fraction_text)
        except ValueError:
            raise pytest.UsageError(f"--kv-memory-fraction: {fraction_text!r} is not a "
                                    "number") from None
        if not 0 < fraction <= 1:
            raise pytest.UsageError(f"--kv-memory-fraction: {fraction} must be in (0, 1]")
        timeout = _timeout(str(get("kv_timeout")))
        plugins = str(get("kv_plugins") or "production")
        if plugins not in ("production", "none"):
            raise pytest.UsageError(f"--kv-plugins: {plugins!r} is not one of production, none")
        return cls(
            enabled=bool(get("kv_conformance")),
            backends=tuple(get("kv_backend") or ()),
            device=str(get("kv_device") or "auto"),
            cases=tuple(cases),
            report=Path(report) if report else None,
            xfails=xfails,
            strict=bool(get("kv_strict")),
            allow_oversubscribe=bool(get("kv_allow_oversubscribe")),
            memory_fraction=fraction,
            timeout=timeout,
            plugins=plugins,
            raw={
                "backends": list(get("kv_backend") or []), "device": str(get("kv_device")),
                "cases": [str(c) for c in cases], "report": report, "xfails": xfails,
                "strict": bool(get("kv_strict")), "memory_fraction": fraction,
                "timeout": timeout,
                "numprocesses": getattr(config.option, "numprocesses", None),
                "plugins": plugins,
            },
        )


def _timeout(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise pytest.UsageError(f"--kv-timeout: {text!r} is not a number of seconds") from None
    if not 0 < seconds < float("inf"):
        raise pytest.UsageError(f"--kv-timeout: {seconds:g} must be a positive number of "
                                "seconds")
    return seconds
