"""What production prints for the KV-A deployments is counted, shown with -v and reported,
never printed between pytest's progress output (session/worker_output.py)."""

from __future__ import annotations

import json
import os
import types

import pytest

from pytest_kvconform.report import build as report
from pytest_kvconform.session.worker_output import ENTRY_POINT_KEY, OUTPUT_KEY, KvWorkerOutput
from tests.conftest import needs_omni


def _output(verbose: int = 0, report: str | None = None) -> KvWorkerOutput:
    config = types.SimpleNamespace(getoption=lambda name, default=None: verbose)
    options = types.SimpleNamespace(report=report)
    return KvWorkerOutput(config, options)  # type: ignore[arg-type]


def test_the_controller_reports_each_xdist_workers_output_after_its_own() -> None:
    output = _output(verbose=1, report="r.json")
    own = {"level": "WARNING", "text": "WARNING [x.py:1] the server's", "source": "fork server"}
    output.own = [own]
    for worker, text in (("gw1", "second"), ("gw0", "first")):
        node = types.SimpleNamespace(
            workerinput={"workerid": worker},
            workeroutput={OUTPUT_KEY: [{"level": None, "text": text,
                                        "source": "KV-A worker cpu-0"}]})
        output.pytest_testnodedown(node, None)
    output.pytest_testnodedown(types.SimpleNamespace(workeroutput={}), None)  # a crashed one
    assert output.record() == [
        own, {"level": None, "text": "first", "source": "gw0 KV-A worker cpu-0"},
        {"level": None, "text": "second", "source": "gw1 KV-A worker cpu-0"}]
    assert output.summary_lines() == [
        "kvconform: production's KV-A workers printed 3 messages (1 WARNING, 2 other): the "
        "installed stack's own, not findings of this run; shown below, the report keeps them "
        "(environment.worker_log)",
        "kvconform:   | [fork server] WARNING [x.py:1] the server's",
        "kvconform:   | [gw0 KV-A worker cpu-0] first",
        "kvconform:   | [gw1 KV-A worker cpu-0] second"]


def test_the_worker_path_is_the_one_the_kv_a_workers_reported() -> None:
    """The test process never detects it itself (that imports production's worker): an
    xdist controller takes it from its workers' output, and a run without KV-A workers
    names none."""
    output = _output()
    output.own = []
    output.pytest_testnodedown(types.SimpleNamespace(workeroutput={ENTRY_POINT_KEY: None}),
                               None)
    assert output.summary_lines() == []
    reported = {"level": "runner", "why_not_executor": "import x fails"}
    output.pytest_testnodedown(types.SimpleNamespace(workeroutput={ENTRY_POINT_KEY: reported}),
                               None)
    assert output.summary_lines() == [
        "kvconform: KV-A worker path: DiffusionModelRunner.set_kv_cache_config -> "
        "DiffusionKVModelRunnerBackend.initialize_kv_cache (DiffusionWorker and the executors "
        "cannot run here: import x fails)"]


def test_nothing_is_reported_before_the_run_ended_nor_said_when_nothing_was_printed() -> None:
    output = _output()
    assert output.record() is None and output.summary_lines() == []
    output.own = []
    assert output.record() == [] and output.summary_lines() == []


# --- end to end ---------------------------------------------------------------------------

# A host whose CPU has AVX512-BF16: vLLM's CPU platform then resets the SSM cache dtype, and
# says so, for every config it builds (production's own warning, in every process that
# builds one: the KV-A workers).
AVX512_BF16 = '''
import importlib.abc, importlib.machinery, sys

class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "vllm.platforms.cpu":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.torch.cpu._is_avx512_bf16_supported = lambda: True

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _Finder())
'''

NOISY_WORKERS = '''
def test_noisy_worker(kv_workers):
    (worker,) = kv_workers(1)
    worker.request("print", text="kvconform-test: a worker's stdout line", stream="stdout")
    worker.request("print", text="kvconform-test: a worker's stderr line", stream="stderr")
'''

RESET_SSM = "Reset SSM cache type to float32"

# What the test process itself imported and how it collected, seen at the run's end.
SEEN_AT_END = '''
import gc, json, sys

def pytest_sessionfinish(session):
    with open("seen.json", "w") as f:
        json.dump({"worker": "vllm_omni.diffusion.worker.diffusion_worker" in sys.modules,
                   "collecting": gc.isenabled(), "frozen": gc.get_freeze_count()}, f)
'''


@needs_omni
def test_a_kv_a_runs_worker_output_is_counted_shown_with_v_and_reported_not_printed(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real KV-A run in a process of its own, whose descriptors are the terminal's, on a
    host where production warns at every config: no line of it among pytest's progress
    lines, one count line, every message with -v, all in the report."""
    pytester.makepyfile(sitecustomize=AVX512_BF16, test_noisy=NOISY_WORKERS,
                        conftest=SEEN_AT_END)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(pytester.path), os.environ.get("PYTHONPATH")])))
    result = pytester.runpytest_subprocess(
        "--kv-conformance", "-p", "no:cacheprovider", "-p", "no:randomly", "-p", "no:xdist",
        "--kv-backend", "FLASH_ATTN", "-k", "kv_a3 or noisy", "test_noisy.py", "-v",
        "--kv-report", "r.json", timeout=900)
    result.assert_outcomes(passed=7)
    out = result.stdout.lines
    shown = [line for line in out if line.startswith("kvconform:   | ")]
    printed = [line for line in out if not line.startswith("kvconform:   | ")]
    assert not [line for line in printed if RESET_SSM in line or "kvconform-test" in line], \
        "\n".join(out)
    assert not result.stderr.str().strip(), result.stderr.str()[-2000:]
    (count,) = [line for line in out if "production's KV-A workers printed" in line]
    assert "shown below, the report keeps them (environment.worker_log)" in count
    data = json.loads((pytester.path / "r.json").read_text())
    report.validate_report(data)
    messages = data["environment"]["worker_log"]
    assert count.startswith(f"kvconform: production's KV-A workers printed {len(messages)} "), \
        count
    assert len(shown) >= len(messages)
    assert f"{RESET_SSM} for accelerated GDN mamba backend 'none'." in \
        {m["text"].rpartition("] ")[2] for m in messages}
    assert any(RESET_SSM in line and "[KV-A worker cpu-" in line for line in shown)
    by_source = {(m["source"].rpartition(" ")[0], m["text"]) for m in messages}
    assert ("KV-A worker", "kvconform-test: a worker's stdout line") in by_source
    assert ("KV-A worker", "kvconform-test: a worker's stderr line") in by_source
    assert "kvconform:   | [KV-A worker cpu-0] kvconform-test: a worker's stdout line" in shown \
        or any(line.endswith("] kvconform-test: a worker's stdout line") for line in shown)
    markdown = (pytester.path / "r.md").read_text()
    assert "### Output of production's KV-A workers" in markdown
    assert "kvconform-test: a worker's stderr line" in markdown and RESET_SSM in markdown
    # The path KV-A took is the one its workers reported: production's worker is imported
    # there (the fork server's preload), never in the test process (2.5 s: RESULTS.md).
    result.stdout.fnmatch_lines(["kvconform: KV-A worker path: *DiffusionModelRunner*"])
    seen = json.loads((pytester.path / "seen.json").read_text())
    assert seen == {"worker": False, "collecting": True, "frozen": seen["frozen"]}, seen
    assert seen["frozen"] > 100_000  # what the stack's import made, out of the tests' walks


@needs_omni
def test_each_xdist_workers_kv_a_workers_output_is_reported(pytester: pytest.Pytester) -> None:
    """Under xdist the controller writes the report: every test's worker line is in it,
    under the xdist worker that ran the test."""
    pytester.makepyfile(test_noisy='''
import os
import pytest

@pytest.mark.parametrize("n", range(4))
def test_noisy_worker(kv_workers, n):
    (worker,) = kv_workers(1)
    me = os.environ["PYTEST_XDIST_WORKER"]
    worker.request("print", text=f"kvconform-test: {n} from {me}")
''')
    result = pytester.runpytest("--kv-conformance", "-p", "no:cacheprovider", "-p",
                                "no:randomly", "-n", "2", "-k", "noisy", "test_noisy.py",
                                "--kv-backend", "FLASH_ATTN", "--kv-report", "r.json")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["kvconform: production's KV-A workers printed * messages*"])
    data = json.loads((pytester.path / "r.json").read_text())
    lines = [m for m in data["environment"]["worker_log"] if "kvconform-test" in m["text"]]
    assert sorted(m["text"].split()[1] for m in lines) == ["0", "1", "2", "3"], lines
    for message in lines:
        assert message["source"].startswith(message["text"].rpartition(" ")[2] + " KV-A worker")

