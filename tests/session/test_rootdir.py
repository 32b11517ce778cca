"""The rootdir, configfile and ids do not move with how a path-valued option is written.

pytest decides the rootdir before the plugin's options are known, so ``--kv-xfails FILE``
(two arguments, FILE outside the repository) once made it take FILE for a test path:
another rootdir, no configfile, the repository's settings unread, other ids.
"""

from __future__ import annotations

import re
import shutil
import textwrap
from pathlib import Path

import pytest

from tests.conftest import needs_omni
from tests.paths import ROOT
from tests.seeding import register_backends
from tests.standin_backends import Good

PYPROJECT = '''
[tool.pytest.ini_options]
addopts = "-p no:randomly -p no:cacheprovider"
testpaths = ["tests"]
kv_timeout = "123"
'''
OWN_TEST = '''
def test_reads_the_repositorys_settings(pytestconfig):
    print(f"SETTINGS timeout={pytestconfig.getini('kv_timeout')} "
          f"config={pytestconfig.inipath.name if pytestconfig.inipath else None}")
'''
SPELLINGS = {
    "--kv-xfails": ("--kv-xfails", "{file}"),
    "--kv-xfails=": ("--kv-xfails={file}",),
    "--kv-cases": ("--kv-cases", "{file}"),
    "--kv-report": ("--kv-report", "{file}"),
}


@pytest.fixture
def repo(pytester: pytest.Pytester, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository with its own pyproject.toml and tests, and a file outside it."""
    pytester.makefile(".toml", pyproject=PYPROJECT)
    pytester.mkdir("tests")
    (pytester.path / "tests" / "test_own.py").write_text(textwrap.dedent(OWN_TEST))
    outside = tmp_path_factory.mktemp("outside") / "known.toml"
    shutil.copy(ROOT / "pytest_kvconform" / "known" / "vllm_omni_0_30.toml", outside)
    return outside


def _setup(result: pytest.RunResult) -> tuple[list[str], list[str], list[str]]:
    """The header's rootdir and configfile, the ids collected and the settings the test read."""
    out = result.stdout.lines
    header = [line for line in out if line.startswith(("rootdir:", "configfile:"))]
    ids = [line.split(" ")[0] for line in out if "::" in line]
    settings = [m[0] for line in out if (m := re.search(r"SETTINGS \S+ \S+", line))]
    return header, ids, settings


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_a_path_option_written_as_two_arguments_moves_nothing(
        pytester: pytest.Pytester, repo: Path, spelling: str) -> None:
    plain = pytester.runpytest("-v", "-s")
    written = [arg.format(file=repo) for arg in SPELLINGS[spelling]]
    spelled = pytester.runpytest(*written, "-v", "-s")
    assert plain.ret == spelled.ret == 0, spelled.stdout.str()
    assert _setup(spelled) == _setup(plain)
    header, ids, settings = _setup(spelled)
    assert header == [f"rootdir: {pytester.path}", "configfile: pyproject.toml"]
    assert ids == ["tests/test_own.py::test_reads_the_repositorys_settings"]
    assert settings == ["SETTINGS timeout=123 config=pyproject.toml"]


@needs_omni
def test_the_suites_ids_and_header_are_the_same_both_ways(pytester: pytest.Pytester,
                                                           repo: Path) -> None:
    """With the suite collected: the header and every id, ``--kv-xfails FILE`` against
    ``--kv-xfails=FILE`` (inline runs: the stack is imported once for both)."""
    register_backends(pytester, {"GOOD": Good})
    select = ("--kv-conformance", "--co", "--kv-backend", "GOOD", "-k", "kv_l1 or kv_l2")
    both = (("--kv-xfails", str(repo)), (f"--kv-xfails={repo}",))
    quiet = [pytester.runpytest(*select, "-q", *written) for written in both]
    loud = [pytester.runpytest(*select, *written) for written in both]
    for result in (*quiet, *loud):
        assert result.ret == 0, result.stdout.str()[-3000:]
    ids = [[line for line in r.stdout.lines if "::" in line] for r in quiet]
    assert ids[0] == ids[1]
    assert ids[0] and all(re.match(r"kvconform/test_\w+\.py::test_kv_l[12]", i) for i in ids[0])
    headers = [[line for line in r.stdout.lines
                if line.startswith(("rootdir:", "configfile:", "kvconform: known"))]
               for r in loud]
    assert headers[0] == headers[1]
    assert headers[0][-2:] == [f"rootdir: {pytester.path}", "configfile: pyproject.toml"]
