"""The signal tests pass whatever signal dispositions the test run inherits.

A job started in the background by a non-interactive shell (``cmd &``, ``nohup cmd &``,
some CI runners) inherits SIGINT ignored, and Python then raises no KeyboardInterrupt;
a blocked SIGINT survives ``exec`` too.  Each test marked ``delivers_signal`` installs
what it needs itself; here they run in a pytest started with SIGINT both ignored and
blocked, the worst a parent can hand down.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

from tests.paths import ROOT

SIGNAL_TESTS = [ROOT / "tests" / "seeded" / "test_process.py",
                ROOT / "tests" / "crossversion" / "test_release_matrix.py"]


def _sigint_ignored_and_blocked() -> None:
    """In the child before exec: what ``trap '' INT`` plus a blocked mask hand down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "KVCONFORM_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=timeout,
                          preexec_fn=_sigint_ignored_and_blocked)


def test_the_child_inherits_sigint_ignored_and_blocked() -> None:
    probe = _run("-c", "import signal; print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN,"
                       " signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))",
                 timeout=60)
    assert probe.stdout.split() == ["True", "True"], probe.stdout + probe.stderr


def test_signal_tests_pass_with_sigint_inherited_ignored() -> None:
    """The serial ones: the xdist variants add only more processes to the same path."""
    result = _run("-m", "pytest", *map(str, SIGNAL_TESTS), "-m", "delivers_signal", "-k",
                  "not xdist", "-p", "no:randomly", "-p", "no:cacheprovider", "-q",
                  timeout=300)
    tail = result.stdout[-4000:] + result.stderr[-2000:]
    assert result.returncode == 0, tail
    counts = dict((word, int(n)) for n, word in re.findall(r"(\d+) (passed|failed|error)",
                                                           result.stdout))
    assert counts.get("passed", 0) >= 1 and not counts.get("failed") and not counts.get("error"), \
        tail


# SIGTERM in a --kv-conformance run (lifetime.RunSignals): Ctrl-C's unwinding where SIGTERM
# had its default, and nothing changed where someone else chose otherwise.
SIGTERM_PROBE = '''
import os, signal, sys
from pytest_kvconform.workers import lifetime

def now():
    handler = signal.getsignal(signal.SIGTERM)
    return "ours" if callable(handler) else signal.Handlers(handler).name

if sys.argv[1] == "ignored":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
undo = lifetime.terminate_as_interrupt()
try:
    os.kill(os.getpid(), signal.SIGTERM)
    print("carried on")
except KeyboardInterrupt as exc:
    print(type(exc).__name__, exc, "| again:", now(), flush=True)
if sys.argv[2:] == ["twice"]:
    os.kill(os.getpid(), signal.SIGTERM)
    print("never printed")
if undo is not None:
    undo()
print("after:", now())
'''


def test_sigterm_unwinds_as_ctrl_c_once_then_the_undo_puts_the_default_back() -> None:
    result = _run("-c", SIGTERM_PROBE, "default", timeout=60)
    assert result.stdout.splitlines() == [
        "Terminated SIGTERM: the run was terminated | again: ours",
        "after: SIG_DFL"], result.stdout + result.stderr


def test_a_second_sigterm_while_the_run_unwinds_exits_2_at_once_without_a_traceback() -> None:
    result = _run("-c", SIGTERM_PROBE, "default", "twice", timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        "Terminated SIGTERM: the run was terminated | again: ours"], result.stdout
    assert result.stderr.strip() == ("kvconform: SIGTERM again: exiting at once with status 2, "
                                     "without this run's report"), result.stderr


def test_an_ignored_sigterm_stays_ignored() -> None:
    result = _run("-c", SIGTERM_PROBE, "ignored", timeout=60)
    assert result.stdout.splitlines() == ["carried on", "after: SIG_IGN"], \
        result.stdout + result.stderr
