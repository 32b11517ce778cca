"""The backend-repository path: the built wheel, installed with uv, run from the repo.

A backend repository adds pytest-kvconform as a dev dependency and runs
``pytest --kv-conformance`` in its own environment, under its own strict pytest
settings.  This installs such a repository into the session's venv, which holds the
wheel built from a copy of the source tree (``wheel_env``: uv, at this environment's
versions, without this checkout), and runs the suite from a scratch directory
shaped like a backend repository: its own pyproject.toml, tests, a backend from its
conftest hook and one from the ``pytest_kvconform.backends`` entry-point group.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from pytest_kvconform.report.diff import diff_reports
from pytest_kvconform.report.verdict import EXIT_NOT_CHECKED, EXIT_STACK_REGRESSED
from tests.backend_repo_files import HOSTILE_BACKENDS, JUDGE_REWRITER, SDPA_BACKENDS, pyproject
from tests.conftest import needs_omni
from tests.wheel_env import REPO, WheelEnv, clean_env, run

RAISES_AT_IMPORT = """
raise RuntimeError("this backend's module refuses to import")


class Backend:
    pass
"""
BACKEND_REPO = {
    "pyproject.toml": pyproject("my-backends") + textwrap.dedent('''
        [project.entry-points."pytest_kvconform.backends"]
        MY_EP_ATTN = "my_backends.attention:EntryPointBackend"
        GHOST = "no_such_pkg_kvc.mod:Backend"
        GHOST_ATTR = "my_backends.attention:NoSuchBackend"
        GHOST_RAISES = "my_backends.raises:Backend"

        [tool.setuptools]
        packages = ["my_backends"]

        [tool.pytest.ini_options]
        addopts = "--strict-markers --import-mode=importlib"
        filterwarnings = ["error"]
        testpaths = ["tests"]
    '''),
    "my_backends/__init__.py": "",
    "my_backends/attention.py": SDPA_BACKENDS,
    "my_backends/raises.py": RAISES_AT_IMPORT,
    "my_backends/rewriter.py": JUDGE_REWRITER,
    "conftest.py": '''
        import os


        def pytest_kvconform_backends(config):
            found = {"MY_HOOK_ATTN": "my_backends.attention:HookBackend",
                     "MY_SLIP": "my_backends.attention:SlipBackend",
                     "MY_MISNAMED": "my_backends.attention:MisnamedBackend"}
            if os.environ.get("SEED_JUDGE_REWRITER"):  # its import rewrites the judge
                found["MY_REWRITER"] = "my_backends.rewriter:RewritesTheJudge"
            return found


        def pytest_sessionstart(session):
            """Stands in for an upstream regression no shipped finding describes (the
            suite's own test of itself: a real repository has no such hook)."""
            if os.environ.get("SEED_STACK_REGRESSION"):
                from pytest_kvconform.faults import plants

                for holder, name, value in plants.replacements(plants.HAND_STRIDES):
                    setattr(holder, name, value)
    ''',
    "tests/test_own.py": '''
        def test_own_tests_run_beside_the_suite():
            assert True
    ''',
}


@pytest.fixture(scope="module")
def backend_repo(wheel_env: WheelEnv, tmp_path_factory: pytest.TempPathFactory
                 ) -> tuple[Path, Path]:
    """(venv python, backend repository): the repo installed beside the session's wheel."""
    return wheel_env.install_repo(tmp_path_factory.mktemp("backend-repo") / "my-backends",
                                  BACKEND_REPO)


@needs_omni
def test_packaged_data_comes_from_the_wheel(backend_repo: tuple[Path, Path]) -> None:
    python, repo = backend_repo
    probe = run([str(python), "-c", textwrap.dedent('''
        import pathlib, pytest_kvconform, conformance_cases
        from pytest_kvconform.contract import cases
        pkg = pathlib.Path(pytest_kvconform.__file__).parent
        print(pkg)
        print(pathlib.Path(conformance_cases.__file__).parent)
        assert (pkg / "contract.md").read_text().startswith("# The KV-cache layout")
        assert (pkg / "known" / "vllm_omni_0_30.toml").is_file()
        assert (pkg / "py.typed").is_file()
        print(len(cases.load_cases(())))
    ''')], cwd=repo)
    assert probe.returncode == 0, probe.stdout + probe.stderr
    package_dir, cases_dir, n_cases = probe.stdout.split()
    venv = python.parent.parent
    assert Path(package_dir).is_relative_to(venv), package_dir
    assert Path(cases_dir).is_relative_to(venv), cases_dir
    assert not Path(package_dir).is_relative_to(REPO)
    assert int(n_cases) > 5


@needs_omni
def test_suite_runs_against_the_repos_backends(backend_repo: tuple[Path, Path]) -> None:
    """Both registration routes, under the repo's strict settings, beside its own tests."""
    python, repo = backend_repo
    result = run([str(python), "-m", "pytest", "--kv-conformance", "-p", "no:cacheprovider",
                  "--kv-backend", "MY_HOOK_ATTN", "--kv-backend", "MY_EP_ATTN",
                  "-k", "(kv_l1 or kv_l2 or kv_l6 or own) and not seam", "-v", "-rs", "tests"],
                 cwd=repo)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    for test_id in ("test_kv_l1[MY_HOOK_ATTN] PASSED", "test_kv_l2[MY_EP_ATTN] PASSED",
                    "test_kv_l6[MY_HOOK_ATTN] PASSED", "test_kv_l6[MY_EP_ATTN] PASSED"):
        assert test_id.split()[0] in out, out
    assert "test_own_tests_run_beside_the_suite" in out or "test_own.py" in out, out
    assert "9 passed" in out, out
    # The suite came from the installed wheel, not this checkout.
    assert str(REPO / "pytest_kvconform") not in out


@needs_omni
def test_gpu_check_ships_in_the_wheel(backend_repo: tuple[Path, Path]) -> None:
    """The installed ``kvconform gpu-check`` loads its modules and the stand-ins' plugin
    from the wheel; on a host without CUDA it refuses in one line and writes nothing."""
    python, repo = backend_repo
    probe = run([str(python), "-c", textwrap.dedent('''
        import importlib.util
        from pathlib import Path
        from pytest_kvconform.gpu import check
        argv = [*check.suite_step(Path("out"), 0.5).argv, *check.pinning_step(Path("out")).argv]
        for i, arg in enumerate(argv):
            if arg == "-p" and not argv[i + 1].startswith("no:"):
                print(importlib.util.find_spec(argv[i + 1]).origin)
    ''')], cwd=repo)
    assert probe.returncode == 0, probe.stdout + probe.stderr
    origins = probe.stdout.split()
    assert [Path(o).name for o in origins] == ["paged_standins.py", "pinning.py"]
    assert all(Path(o).is_relative_to(python.parent.parent) for o in origins), origins
    result = run([str(python.parent / "kvconform"), "gpu-check", "gpu-out"], cwd=repo)
    if "sees no CUDA device" not in result.stderr:
        pytest.skip(f"this host has CUDA: {result.stderr.strip()}")
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert not (repo / "gpu-out").exists()


def _suite(python: Path, repo: Path, *args: str, env: dict[str, str] | None = None,
           cache: bool = False) -> tuple[int, str]:
    """``pytest --kv-conformance ARGS`` in the repository: (exit status, its output)."""
    argv = [str(python), "-m", "pytest", "--kv-conformance",
            *([] if cache else ["-p", "no:cacheprovider"]), *args]
    done = run(argv, repo, timeout=900, extra=env)
    return done.returncode, done.stdout + done.stderr


@needs_omni
def test_a_conforming_backend_qualifies_on_its_own(backend_repo: tuple[Path, Path]) -> None:
    """The whole backend-scoped run, as a backend repository's CI runs it: its verdict
    names the backend, the stack's known findings are listed (no file named), and the
    test ids read as the repository's own."""
    python, repo = backend_repo
    code, out = _suite(python, repo, "--kv-backend", "MY_EP_ATTN", "-rs",
                       "--junitxml", "junit.xml", "--kv-report", "r.json")
    assert code == 0, out[-6000:]
    assert ("kvconform: known findings: pytest_kvconform/known/vllm_0_30.toml, "
            "pytest_kvconform/known/vllm_omni_0_30.toml (shipped; vllm_0_30.toml known on vllm "
            ">=0.29,<0.34; vllm_omni_0_30.toml known on vllm >=0.30,<0.33 and vllm-omni "
            ">=0.30,<0.33: the installed vllm 0.30.0, vllm-omni 0.30.0)") in out, out[-6000:]
    # The installed stack is the release's: the shipped release table says so.
    assert "kvconform: release table: this stack is qualified by leg py311-vllm030\n" in out
    assert "kvconform: verdict for MY_EP_ATTN: qualified" in out, out[-6000:]
    assert "kvconform: stack (vllm 0.30.0, vllm-omni 0.30.0): " in out
    assert ", 0 fixed, 0 new" in out and "is bitten in production" in out, out[-6000:]
    summary = out.split("short test summary info")[-1]
    assert "SKIPPED [1] kvconform/test_layout.py:" in summary, summary
    assert "site-packages" not in summary, summary
    junit = (repo / "junit.xml").read_text()
    assert 'classname="kvconform.test_layout" name="test_kv_l1[MY_EP_ATTN]"' in junit, junit[:2000]
    assert "site-packages" not in "".join(re.findall(r'classname="[^"]*"', junit))
    report = json.loads((repo / "r.json").read_text())
    assert report["verdict"] == "qualified"
    assert {r["subject"] for r in report["results"]} == {"backend", "stack"}
    assert report["stack"]["regressions"] == []
    strict_code, strict_out = _suite(python, repo, "--kv-backend", "MY_EP_ATTN", "--kv-strict")
    assert strict_code == 0, strict_out[-6000:]
    assert "kvconform: verdict for MY_EP_ATTN: qualified" in strict_out


@needs_omni
def test_the_backends_own_slip_fails_it_root_cause_first(backend_repo: tuple[Path, Path]
                                                         ) -> None:
    python, repo = backend_repo
    code, out = _suite(python, repo, "--kv-backend", "MY_SLIP", "--kv-strict")
    assert code == 1, out[-6000:]
    verdict = next(line for line in out.splitlines()
                   if line.startswith("kvconform: verdict for MY_SLIP: "))
    assert verdict.startswith("kvconform: verdict for MY_SLIP: not qualified (MY_SLIP: KV-L1 "
                              "failed (root cause): KV-L1 test_kv_l1[MY_SLIP]; "), verdict
    assert re.search(r"; \d+ results depend on it: KV-L2 test_kv_l2\[MY_SLIP\]", verdict)
    assert "FAILED kvconform/test_layout.py::test_kv_l2[MY_SLIP] - depends on KV-L1" in out
    assert "FAILED kvconform/test_layout.py::test_kv_l1[MY_SLIP] - KV-L1 violated" in out
    assert "differs from known finding" not in verdict
    # README's red example is this slip, in its quickstart backend's name.
    assert_shown(readme_example("A red run names the clause and the backend"), out,
                 MY_ATTN="MY_SLIP")


@needs_omni
def test_a_stack_regression_is_reported_as_the_stacks(backend_repo: tuple[Path, Path]) -> None:
    python, repo = backend_repo
    code, out = _suite(python, repo, "--kv-backend", "MY_EP_ATTN", "-k",
                       "kv_l1 or (kv_s1 and bf16_h8 and BLNHC)",
                       env={"SEED_STACK_REGRESSION": "1"})
    assert code == EXIT_STACK_REGRESSED, out[-6000:]
    assert "kvconform: verdict for MY_EP_ATTN: partial (left out: -k" in out, out[-6000:]
    assert ("kvconform: stack (vllm 0.30.0, vllm-omni 0.30.0): 0 known findings persist "
            "(0 results), 0 fixed, 1 new (no known finding describes them): KV-S1 "
            "test_kv_s1[BLNHC-bf16_h8]") in out, out[-6000:]


@needs_omni
def test_a_backend_that_never_imports_is_not_checked(backend_repo: tuple[Path, Path]) -> None:
    """Nothing ran, nothing qualified, without --kv-strict: an entry point to a missing
    module, to a missing attribute, and to a module that raises at import."""
    python, repo = backend_repo
    ghosts = {"GHOST": "ModuleNotFoundError: No module named 'no_such_pkg_kvc'",
              "GHOST_ATTR": "AttributeError",
              "GHOST_RAISES": "RuntimeError: this backend's module refuses to import"}
    code, out = _suite(python, repo, *(a for name in ghosts for a in ("--kv-backend", name)),
                       "--kv-report", "r.json")
    assert code == EXIT_NOT_CHECKED, out[-6000:]
    verdict = next(line for line in out.splitlines() if line.startswith("kvconform: verdict"))
    assert verdict.startswith("kvconform: verdict for GHOST, GHOST_ATTR, GHOST_RAISES: not "
                              "qualified (GHOST: not checked (every clause skipped, "), verdict
    for name, why in ghosts.items():
        assert f"{name}: not checked (every clause skipped, " in verdict, verdict
        assert f"backend {name} is not importable: {why}" in verdict, verdict
    assert json.loads((repo / "r.json").read_text())["verdict"] == "not qualified"


@needs_omni
def test_a_registry_member_that_does_not_import_here_is_not_checked(
        backend_repo: tuple[Path, Path]) -> None:
    """SAGE_ATTN_3 on a CPU host: the shipped known finding declares it unimportable (so
    the strict whole deployment still qualifies), but a run checking it alone checked
    nothing of it."""
    python, repo = backend_repo
    code, out = _suite(python, repo, "--kv-backend", "SAGE_ATTN_3", "--kv-strict")
    assert code == EXIT_NOT_CHECKED, out[-6000:]
    assert ("kvconform: verdict for SAGE_ATTN_3: not qualified (SAGE_ATTN_3: not checked "
            "(every clause skipped, ") in out, out[-6000:]
    assert "backend skip, declared: backend SAGE_ATTN_3 is not importable: " in out


@needs_omni
def test_a_backend_registered_under_another_name_fails_kv_l1(
        backend_repo: tuple[Path, Path]) -> None:
    """get_name() answering to a registry member's name: KV-L1's name control fails, naming
    both names, and the verdict puts it first."""
    python, repo = backend_repo
    code, out = _suite(python, repo, "--kv-backend", "MY_MISNAMED", "-k", "kv_l1 or kv_l2")
    assert code == 1, out[-6000:]
    assert ("KV-L1 violated [backend=MY_MISNAMED]: get_name() returned 'TORCH_SDPA', but the "
            "backend is registered as 'MY_MISNAMED'") in out, out[-6000:]
    assert "FAILED kvconform/test_layout.py::test_kv_l1_name[MY_MISNAMED]" in out
    assert ("kvconform: verdict for MY_MISNAMED: not qualified (MY_MISNAMED: KV-L1 failed "
            "(root cause): KV-L1 test_kv_l1_name[MY_MISNAMED]") in out, out[-6000:]


@needs_omni
def test_a_backend_whose_import_rewrites_the_judge_is_refused(
        backend_repo: tuple[Path, Path]) -> None:
    """Its module replaces the check runner at import, so that its broken declaration
    passes: the run names what changed and qualifies nothing, strict or not."""
    python, repo = backend_repo
    code, out = _suite(python, repo, "--kv-backend", "MY_REWRITER", "--kv-strict",
                       "--kv-report", "r.json", env={"SEED_JUDGE_REWRITER": "1"})
    assert code == 1, out[-6000:]
    changed = ("pytest_kvconform.suite.check_call.run_check replaced by "
               "my_backends.rewriter.lenient")
    assert ("kvconform: WARNING: the judge was altered after start-up, so nothing here is "
            "judged (a backend's code ran in the judging process): " + changed) in out, \
        out[-6000:]
    assert ("kvconform: verdict for MY_REWRITER: not qualified (the judge was altered after "
            "start-up") in out, out[-6000:]
    report = json.loads((repo / "r.json").read_text())
    assert report["verdict"] == "not qualified"
    assert report["integrity"] == [changed]


@needs_omni
def test_ids_work_with_lf_and_deselect(backend_repo: tuple[Path, Path]) -> None:
    python, repo = backend_repo
    shutil.rmtree(repo / ".pytest_cache", ignore_errors=True)
    first, out = _suite(python, repo, "--kv-backend", "MY_SLIP", "-k", "kv_l1 or kv_l3 or kv_l4",
                        "-q", cache=True)
    assert first == 1 and "3 failed" in out, out[-3000:]
    again, out = _suite(python, repo, "--kv-backend", "MY_SLIP", "--lf",
                        "--deselect", "kvconform/test_layout.py::test_kv_l1[MY_SLIP]", "-v",
                        cache=True)
    assert again == 1, out[-3000:]
    ran = re.findall(r"^(kvconform/\S+::\S+) (?:PASSED|FAILED)", out, re.MULTILINE)
    assert ran == ["kvconform/test_layout.py::test_kv_l3[MY_SLIP]",
                   "kvconform/test_layout.py::test_kv_l4[MY_SLIP]"], out[-3000:]


QUICKSTART = "my-quickstart"


def readme_blocks(lang: str) -> list[str]:
    """README.md's fenced code blocks of one language, in order."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)


def readme_example(lead: str) -> list[str]:
    """The indented output lines README shows after the paragraph starting with ``lead``."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    m = re.search(rf"^{re.escape(lead)}.*?\n\n((?:    [^\n]*\n)+)", text, re.M | re.S)
    assert m is not None, f"README has no example after {lead!r}"
    return [line[4:] for line in m.group(1).splitlines() if line.strip() != "..."]


def assert_shown(example: list[str], out: str, **names: str) -> None:
    """Each README example line is a line of the real output, ``...`` standing for what
    README leaves out (and ``names`` renamed: README's backend is another repository's)."""
    lines = out.splitlines()
    for line in example:
        for readme_name, real_name in names.items():
            line = line.replace(readme_name, real_name)
        pattern = "^" + ".*".join(re.escape(part) for part in line.split("...")) + "$"
        assert any(re.match(pattern, real) for real in lines), \
            f"README shows {line!r}, which the run does not print:\n{out[-6000:]}"


@needs_omni
def test_the_readme_quickstart_and_ci_job_run_as_written(wheel_env: WheelEnv,
                                                          tmp_path: Path) -> None:
    """README's backend, its entry point and its GitHub Actions job's commands, run as
    written in a new repository (the suite from the built wheel, as the job's comment says)."""
    import yaml

    (backend,) = readme_blocks("python")
    (entry_point,) = readme_blocks("toml")
    (job,) = readme_blocks("yaml")
    path = backend.splitlines()[0].removeprefix("# ").strip()
    repo = tmp_path / QUICKSTART
    (repo / path).parent.mkdir(parents=True)
    (repo / path).write_text(backend)
    (repo / Path(path).parent / "__init__.py").write_text("")
    (repo / "pyproject.toml").write_text(pyproject(QUICKSTART) + "\n" + entry_point)
    steps = [step["run"] for steps in (j["steps"] for j in yaml.safe_load(job)["jobs"].values())
             for step in steps if "run" in step]
    assert steps, job
    # A venv of its own: the job installs its repository's package (my_backends) there.
    venv = wheel_env.another(tmp_path / "venv", "vllm-omni")
    env = {"CONFORMANCE_SUITE": f"{venv.wheel}[omni]",
           "PATH": f"{venv.python.parent}{os.pathsep}{os.environ['PATH']}"}
    for step in steps:
        done = run(["bash", "-euo", "pipefail", "-c", step], repo, timeout=1500, extra=env)
        out = done.stdout + done.stderr
        assert done.returncode == 0, f"{step}\n{out[-6000:]}"
    assert "kvconform: verdict for MY_ATTN: qualified" in out, out[-6000:]
    assert json.loads((repo / "kv-report.json").read_text())["verdict"] == "qualified"
    assert_shown(readme_example("A green run ends with exit status 0"), out)


HOSTILE_REPO = {
    "pyproject.toml": pyproject("hostile-backends") + textwrap.dedent('''
        [tool.setuptools]
        packages = ["hostile_backends"]
    '''),
    "hostile_backends/__init__.py": "",
    "hostile_backends/attention.py": HOSTILE_BACKENDS,
    "conftest.py": '''
        def pytest_kvconform_backends(config):
            return {"HOG": "hostile_backends.attention:GilHoldingBackend",
                    "SLEEPY": "hostile_backends.attention:SleepingBackend",
                    "EXITS": "hostile_backends.attention:ExitingBackend",
                    "GREEDY": "hostile_backends.attention:GreedyBackend"}
    ''',
}


@pytest.fixture(scope="module")
def hostile_repo(wheel_env: WheelEnv, tmp_path_factory: pytest.TempPathFactory
                 ) -> tuple[Path, Path]:
    """(venv python, repository): backends whose own code hangs, holds the GIL, ends its
    process or asks for 1 TiB, registered by a repository beside the session's wheel."""
    return wheel_env.install_repo(tmp_path_factory.mktemp("hostile-repo") / "hostile-backends",
                                  HOSTILE_REPO)


def _processes_in(directory: Path) -> list[str]:
    """The processes (but this one) whose working directory is ``directory``: what a run
    started there left running."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if Path(os.readlink(entry / "cwd")) == directory:
                found.append(f"{entry.name}: {(entry / 'cmdline').read_bytes()[:200]!r}")
        except OSError:
            continue
    return found


def _no_process_left(repo: Path) -> None:
    deadline = time.monotonic() + 5
    while _processes_in(repo) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_in(repo) == []


@needs_omni
def test_a_gil_holding_declaration_costs_one_budget_and_the_run_ends(
        hostile_repo: tuple[Path, Path]) -> None:
    """A declaration looping in C holds the GIL: the child making the call is killed at
    --kv-timeout, every later test refuses it at once, and the backend's tests take
    --kv-timeout + 30 s at most; its faults are its own, never the stack's."""
    python, repo = hostile_repo
    code, out = _suite(python, repo, "--kv-backend", "HOG", "--kv-timeout", "15",
                       "--kv-report", "r.json")
    assert code == 1, out[-6000:]
    report = json.loads((repo / "r.json").read_text())
    mine = [r for r in report["results"] if r["backend"] == "HOG"]
    assert sum(r["duration_s"] for r in mine) < 15 + 30, sorted(r["duration_s"] for r in mine)
    paid = [r for r in mine if r["duration_s"] >= 15]
    assert [r["nodeid"].rpartition("::")[2] for r in paid] == ["test_kv_l1[HOG]"]
    call = "HOG.indexes_kv_by_block_stride() (the backend's layout declaration)"
    assert paid[0]["reason"].endswith(
        f"KV-L1 [backend=HOG]: timed out after 15.0s (what was left of the per-test budget, "
        f"--kv-timeout=15) waiting for {call} to return (its process was killed)"), paid[0]
    errors = [r for r in mine if r["status"] == "error"]
    assert {(r["error_kind"], r["subject"], r["caused_by"]) for r in errors} == {
        ("timeout", "backend", call)}
    assert report["stack"]["regressions"] == []
    assert report["verdict"] == "not qualified"
    _no_process_left(repo)


@needs_omni
@pytest.mark.delivers_signal
def test_sigterm_ends_a_run_held_by_a_gil_holding_declaration(
        hostile_repo: tuple[Path, Path]) -> None:
    python, repo = hostile_repo
    mark = repo / "declaring.mark"
    mark.unlink(missing_ok=True)
    (repo / "r.json").unlink(missing_ok=True)
    proc = subprocess.Popen(
        [str(python), "-m", "pytest", "--kv-conformance", "-p", "no:cacheprovider",
         "--kv-backend", "HOG", "-k", "kv_l1 or kv_l2", "--kv-timeout", "600",
         "--kv-report", "r.json"], cwd=repo, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, env={**clean_env(), "HOSTILE_MARK": str(mark)},
        preexec_fn=_signals_at_default)
    try:
        deadline = time.monotonic() + 600
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert mark.exists(), proc.communicate(timeout=60)[0][-6000:]
        time.sleep(1)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, out[-6000:]
    assert took < 10, took
    assert "Traceback" not in out, out[-6000:]
    report = json.loads((repo / "r.json").read_text())
    assert report["verdict"] == "interrupted"
    assert re.match(r"SIGTERM: the run was terminated while KV-L1 \[backend=HOG\] had waited "
                    r"[\d.]+s for HOG\.indexes_kv_by_block_stride\(\)",
                    report["run"]["interruption"]), report["run"]
    _no_process_left(repo)


@needs_omni
def test_the_backends_own_faults_in_workers_add_no_stack_regression(
        hostile_repo: tuple[Path, Path]) -> None:
    """Backends that end their KV-A worker (``os._exit(0)`` in ``get_impl_cls``), ask it
    for 1 TiB, or whose declaration blocks: the stack's guards run on them (KV-A4, KV-L8)
    error as their other tests do, each error names the backend's call and counts for the
    backend; the stack shows no regression, and a diff lists them apart."""
    python, repo = hostile_repo
    code, out = _suite(python, repo, "--kv-backend", "EXITS", "--kv-backend", "GREEDY",
                       "--kv-backend", "SLEEPY", "--kv-timeout", "15", "--kv-report", "r.json")
    assert code == 1, out[-6000:]
    report = json.loads((repo / "r.json").read_text())
    assert report["stack"]["regressions"] == []
    assert re.search(r"^kvconform: stack \(vllm [^)]*\): .*, 0 fixed, 0 new$", out,
                     re.MULTILINE), out[-6000:]
    by_backend: dict[str, set[tuple[str, str | None, str | None]]] = {}
    for r in report["results"]:
        if r["status"] in ("failed", "error"):
            by_backend.setdefault(r["backend"], set()).add(
                (r["status"], r["error_kind"], r["caused_by"]))
    assert by_backend == {
        "EXITS": {("error", "worker-died", "ExitingBackend.get_impl_cls()")},
        "GREEDY": {("error", "oom", "GreedyBackend.get_impl_cls()")},  # one kind, everywhere
        "SLEEPY": {("error", "timeout", "SLEEPY.indexes_kv_by_block_stride() (the backend's "
                                        "layout declaration)")}}, by_backend
    guards = [r for r in report["results"] if r["caused_by"] and
              r["nodeid"].rpartition("::")[2].startswith(("test_kv_a4", "test_kv_l8"))]
    assert len(guards) >= 12 and {r["subject"] for r in guards} == {"backend"}
    greedy = [r["reason"] for r in report["results"] if r["backend"] == "GREEDY"
              and r["status"] == "error"]
    assert all("asked for 1099511627776 bytes" in reason for reason in greedy), greedy
    # The stack's results alone, as a run that knew no hostile backend had them: against
    # them, these are the backends' faults, not new failures of the stack.
    stack_only = {**report, "results": [r for r in report["results"] if not r["caused_by"]]}
    diff = diff_reports(stack_only, report)
    assert diff.new_failures == [] and len(diff.backend_faults) == len(
        [r for r in report["results"] if r["caused_by"]])
    _no_process_left(repo)


def _signals_at_default() -> None:
    """In the child before exec: SIGINT and SIGTERM as in a terminal, whatever this run
    inherited (``cmd &`` starts with SIGINT ignored)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
