"""One leg of a release matrix: a tox environment built, its stack probed, the suite run in it.

Each step is a tox child process (tox-uv builds the environment in the clone's ``.tox``)
whose output goes to the leg's log; a step that fails ends the leg with the reason read from
that output (uv's resolver error, an import error), so a leg is never a silent gap.
:meth:`Tox.run` is the reusable part: the suite (any pytest arguments) in one built
environment, with extra ``KVCONFORM_*`` variables, which tox passes on.

No child outlives this process: each is asked to stop (SIGTERM) when it dies
(``PR_SET_PDEATHSIG``), and on Ctrl-C / SIGTERM here it is interrupted (SIGINT, which each
child receives with its default disposition, whatever this process inherited), then killed.
Stdlib only.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_kvconform.crossversion import stack_probe
from pytest_kvconform.workers.lifetime import set_parent_death_signal

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
STOP_GRACE_S = 60.0  # an interrupted suite writes its report before it exits
_PIN = re.compile(r"^([A-Za-z0-9_.-]+)\s*==\s*([^\s;#]+)")
_STACK = {"vllm": "vllm", "vllm-omni": "vllm_omni", "vllm_omni": "vllm_omni", "torch": "torch"}


class ToxError(RuntimeError):
    """tox cannot be run here, or tox.ini does not say what was asked (one line)."""


@dataclass(frozen=True)
class Leg:
    """A tox environment of the matrix: its name, description and requested pins."""

    name: str
    description: str = ""
    requested: Mapping[str, str | None] = field(default_factory=dict)


@dataclass(frozen=True)
class Step:
    """One child process: its command, exit code (None: stopped), output and duration."""

    argv: list[str]
    code: int | None
    output: str
    seconds: float
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.code == 0


@dataclass
class LegOutcome:
    """What happened to a leg: the matrix's leg record without what its report adds."""

    leg: Leg
    state: str = "not run"
    reason: str | None = None
    notes: list[str] = field(default_factory=list)
    stack: dict[str, str | None] = field(default_factory=dict)
    stack_source: str = "requested"
    report: Path | None = None
    exit_code: int | None = None
    seconds: float = 0.0

    def record(self, base: Path, log: Path) -> dict[str, Any]:
        """The leg record the combined report takes (paths relative to ``base``)."""
        return {"name": self.leg.name, "description": self.leg.description,
                "state": self.state, "reason": self.reason, "notes": list(self.notes),
                "stack": dict(self.stack or self.leg.requested),
                "stack_source": self.stack_source,
                "report": _relative(self.report, base) if self.report else None,
                "exit_code": self.exit_code, "duration_s": round(self.seconds, 3),
                "log": _relative(log, base)}


def _relative(path: Path, base: Path) -> str:
    try:
        return str(path.resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path)


class Tox:
    """tox, run from the clone (``root``, which holds tox.ini)."""

    def __init__(self, root: Path, command: Sequence[str] = ("tox",),
                 timeout: float | None = None) -> None:
        if not (root / "tox.ini").is_file():
            raise ToxError(f"{root}: no tox.ini here (run from the clone, or pass --root)")
        self.root = root
        self.command = list(command)
        self.timeout = timeout

    # --- steps ----------------------------------------------------------------------

    def legs(self, label: str) -> list[Leg]:
        """The environments of ``label`` in tox.ini, by name, with their requested pins."""
        step = self._step([*self.command, "config", "-m", label, "-k", "description", "deps"])
        if not step.ok:
            raise ToxError(f"`{' '.join(step.argv)}` failed ({step.code}): "
                           f"{tail(step.output, 3)}")
        sections = parse_config(step.output)
        if not sections:
            raise ToxError(f"tox.ini in {self.root} has no environment labelled {label!r}")
        return sorted((Leg(name, values.get("description", ""),
                           requested_stack(values.get("deps", ""), self.root))
                       for name, values in sections.items()), key=lambda leg: leg.name)

    def build(self, name: str, log: Path) -> Step:
        """Build (or reuse) the environment: ``tox -e NAME --notest``."""
        return self._step([*self.command, "-e", name, "--notest"], log)

    def exec(self, name: str, argv: Sequence[str], log: Path) -> Step:
        """A command in the built environment: ``tox exec -e NAME -qq -- ...``."""
        return self._step([*self.command, "exec", "-e", name, "-qq", "--", *argv], log)

    def run(self, name: str, pytest_args: Sequence[str], log: Path,
            env: Mapping[str, str] | None = None) -> Step:
        """The environment's command (pytest) with these arguments: ``tox -e NAME -- ...``."""
        return self._step([*self.command, "-e", name, "--", *pytest_args], log, env)

    def _step(self, argv: list[str], log: Path | None = None,
              env: Mapping[str, str] | None = None) -> Step:
        """Run ``argv`` from the clone; its output is appended to ``log`` (else captured)."""
        started = time.monotonic()
        environ = {**os.environ, "NO_COLOR": "1", **(env or {})}
        if log is None:
            code, timed_out, output = self._spawn(argv, environ, subprocess.PIPE)
        else:
            with open(log, "a", encoding="utf-8") as fh:
                fh.write(f"$ {' '.join(argv)}\n")
                fh.flush()
                start = os.path.getsize(log)
                code, timed_out, _ = self._spawn(argv, environ, fh)
            with open(log, "rb") as fh:
                fh.seek(start)
                output = fh.read().decode("utf-8", errors="replace")
        return Step(argv, code, ANSI.sub("", output), time.monotonic() - started, timed_out)

    def _spawn(self, argv: list[str], environ: Mapping[str, str],
               stdout: Any) -> tuple[int | None, bool, str]:
        try:
            child = subprocess.Popen(
                argv, cwd=self.root, env=dict(environ), text=True, stdout=stdout,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=_tie_to_this_process)  # this process starts no threads
        except FileNotFoundError as exc:
            raise ToxError(f"{argv[0]} not found: install tox and tox-uv (python3 -m pip "
                           "install tox==4.67.17 tox-uv==1.37.1) or pass --tox") from exc
        return _wait(child, self.timeout)


def _tie_to_this_process() -> None:
    """In the child before exec: it dies with us, and the SIGINT :func:`_stop` sends reaches it.

    Started as a background job (``cmd &``), this process inherits SIGINT ignored, and
    possibly blocked; tox would inherit that too and sit out its grace period.
    """
    set_parent_death_signal(signal.SIGTERM)  # tox stops its own command on SIGTERM
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _wait(child: subprocess.Popen[str], timeout: float | None) -> tuple[int | None, bool, str]:
    """Wait for ``child``; on timeout or Ctrl-C / SIGTERM here, stop it (then re-raise)."""
    try:
        out, _ = child.communicate(timeout=timeout)
        return child.returncode, False, out or ""
    except subprocess.TimeoutExpired:
        _stop(child)
        return None, True, ""
    except BaseException:
        _stop(child)
        raise


def _stop(child: subprocess.Popen[str]) -> None:
    """SIGINT (tox interrupts its command, which ends as interrupted), then SIGKILL."""
    if child.poll() is not None:
        return
    child.send_signal(signal.SIGINT)
    try:
        child.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


# --- reading tox's and uv's output -------------------------------------------------------


def parse_config(text: str) -> dict[str, dict[str, str]]:
    """``tox config`` output: ``[testenv:NAME]`` sections of ``key = value`` lines."""
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    key = None
    for line in text.splitlines():
        header = re.match(r"^\[testenv:([^\]]+)\]$", line.strip())
        if header:
            current = sections.setdefault(header.group(1), {})
            key = None
        elif current is not None and re.match(r"^\S[^=]*=", line):
            key, _, value = line.partition("=")
            key = key.strip()
            current[key] = value.strip()
        elif current is not None and key is not None and line[:1].isspace() and line.strip():
            current[key] += "\n" + line.strip()
    return sections


def requested_stack(deps: str, root: Path) -> dict[str, str | None]:
    """The vLLM / vllm-omni / torch pins the environment's requirements ask for."""
    found: dict[str, str | None] = dict.fromkeys(("vllm", "vllm_omni", "torch"))
    for line in _requirement_lines(deps.splitlines(), root, depth=0):
        pin = _PIN.match(line)
        if pin and pin.group(1).lower() in _STACK:
            found[_STACK[pin.group(1).lower()]] = pin.group(2)
    return found


def _requirement_lines(lines: Sequence[str], base: Path, depth: int) -> list[str]:
    out: list[str] = []
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if line.startswith("-r") and depth < 4:
            path = base / line[2:].strip()
            try:
                text = path.read_text(encoding="utf-8")
            except OSError:
                continue
            out += _requirement_lines(text.splitlines(), path.parent, depth + 1)
        elif line:
            out.append(line)
    return out


def tail(output: str, lines: int = 5) -> str:
    """The last non-empty lines of some output, on one line."""
    kept = [line.strip() for line in output.splitlines() if line.strip()]
    return " | ".join(kept[-lines:]) or "(no output)"


def build_failure(step: Step) -> str:
    """Why a build failed: uv's ``error:`` block (e.g. a resolver conflict), else the tail.

    uv prints ``error: No solution found ...`` followed by indented ``cause:`` lines;
    tox then prints its own ``NAME: exit 1`` line, which ends the block.
    """
    if step.timed_out:
        return f"building timed out after {step.seconds:.0f} s"
    lines = step.output.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("error:"):
            block = [line.removeprefix("error:").strip()]
            for nxt in lines[i + 1:]:
                if not nxt[:1].isspace() or not nxt.strip():
                    break
                block.append(nxt.strip().removeprefix("cause:").removeprefix("╰─▶").strip())
            head, rest = block[0], " ".join(block[1:])
            return f"uv: {head}" + (f": {rest}" if rest else "")
    return f"tox exited {step.code}: {tail(step.output)}"


# --- one leg ----------------------------------------------------------------------------


def probe_leg(tox: Tox, outcome: LegOutcome, log: Path) -> bool:
    """Probe the built environment's stack into ``outcome``; False if vLLM does not import."""
    step = tox.exec(outcome.leg.name, ["python", "-m", stack_probe.__name__], log)
    found = stack_probe.parse(step.output)
    if found is None:
        outcome.state = "not importable"
        outcome.reason = f"the stack probe printed no result (exit {step.code}): " \
                         f"{tail(step.output)}"
        return False
    outcome.stack = {key: found.get(key) for key in ("vllm", "vllm_omni", "torch")}
    outcome.stack_source = "installed"
    if found.get("vllm_error"):
        outcome.state = "not importable"
        outcome.reason = f"vLLM {found.get('vllm')} does not import: {found['vllm_error']}"
        return False
    if found.get("omni_error"):
        outcome.notes.append(f"vllm-omni {found.get('vllm_omni')} does not import on vLLM "
                             f"{found.get('vllm')}: {found['omni_error']}")
    return True


def run_leg(tox: Tox, leg: Leg, *, report: Path, log: Path, pytest_args: Sequence[str],
            env: Mapping[str, str] | None = None) -> LegOutcome:
    """Build, probe and run the suite in one leg, writing its report to ``report``.

    ``pytest_args`` must name ``report`` (``--kv-report``): a report left there by an
    earlier run is removed first, so a leg that writes none is never credited with it.
    On Ctrl-C / SIGTERM the running step is stopped and the outcome (state
    ``interrupted``) is attached to the exception as ``outcome``.
    """
    outcome = LegOutcome(leg, stack=dict(leg.requested))
    started = time.monotonic()
    for stale in (report, report.with_suffix(".md")):
        stale.unlink(missing_ok=True)
    log.write_text("", encoding="utf-8")  # this run's steps only
    try:
        build = tox.build(leg.name, log)
        if not build.ok:
            outcome.state, outcome.reason = "not built", build_failure(build)
        elif probe_leg(tox, outcome, log):
            suite = tox.run(leg.name, pytest_args, log, env)
            outcome.exit_code = suite.code
            if report.is_file():
                outcome.state, outcome.report = "ran", report
            else:
                outcome.state = "no report"
                outcome.reason = (f"timed out after {suite.seconds:.0f} s" if suite.timed_out
                                  else f"the suite wrote no report (exit {suite.code}): "
                                       f"{tail(suite.output)}")
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (lifetime.Terminated)
        outcome.state, outcome.reason = "interrupted", f"{type(exc).__name__}: {exc}".rstrip(": ")
        if report.is_file():
            outcome.report = report
        exc.outcome = outcome  # type: ignore[attr-defined]
        raise
    finally:
        outcome.seconds = time.monotonic() - started
    return outcome
