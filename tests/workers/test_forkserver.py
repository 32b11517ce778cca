"""forkserver.share / attach: a process forks its workers from another process's server
(an xdist worker from its controller's) and never stops that server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pytest_kvconform.workers import forkserver
from tests.paths import ROOT

pytestmark = pytest.mark.skipif(not forkserver.usable(), reason="needs Linux forkserver")


# The "controller": starts a server that preloads nothing, prints share(), waits for EOF.
OWNER = textwrap.dedent('''
    import json, sys
    from pytest_kvconform.workers import forkserver
    assert forkserver.start([]) and forkserver.wait_ready(60)
    print(json.dumps(forkserver.share()), flush=True)
    sys.stdin.read()
''')

# The "xdist worker": attaches, forks one process through the server, reports its parents.
CLIENT = textwrap.dedent('''
    import json, multiprocessing, os, sys
    from pytest_kvconform.workers import forkserver
    import probe

    shared = json.loads(sys.argv[1])
    assert forkserver.attach(shared)
    assert forkserver.attached() and forkserver.pid() == shared["pid"]
    assert forkserver.start([]) and forkserver.is_ready()  # the shared one, not a new one
    ours, theirs = multiprocessing.Pipe()
    child = multiprocessing.get_context("forkserver").Process(target=probe.parents,
                                                              args=(theirs,))
    child.start()
    seen = ours.recv()
    child.join(30)
    forkserver.stop()  # detaches: the server is the owner's
    print(json.dumps({"child": seen, "exit": child.exitcode, "me": os.getpid(),
                      "attached_after_stop": forkserver.attached()}))
''')
PROBE = textwrap.dedent('''
    import os
    from multiprocessing import parent_process

    def parents(conn):
        conn.send({"ppid": os.getppid(), "mp_parent": parent_process().pid})
''')


def _env(tmp_path: Path) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT), str(tmp_path), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


def test_an_attached_process_forks_through_the_shared_server_and_leaves_it_running(
        tmp_path: Path) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    env = _env(tmp_path)
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        assert owner.stdout is not None
        shared = json.loads(owner.stdout.readline())
        client = subprocess.run([sys.executable, "-c", CLIENT, json.dumps(shared)],
                                capture_output=True, text=True, env=env, cwd=tmp_path,
                                timeout=120)
        assert client.returncode == 0, client.stderr[-3000:]
        seen = json.loads(client.stdout.strip().splitlines()[-1])
        assert seen["child"] == {"ppid": shared["pid"], "mp_parent": seen["me"]}
        assert seen["exit"] == 0 and seen["attached_after_stop"] is False
        assert Path(f"/proc/{shared['pid']}").exists(), "a detaching client stopped the server"
    finally:
        if owner.stdin is not None:
            owner.stdin.close()
        owner.wait(30)
    # the owner's exit ends its server (atexit stop, or its parent-death signal)
    assert not Path(f"/proc/{shared['pid']}").exists() or \
        Path(f"/proc/{shared['pid']}/stat").read_text().rpartition(")")[2].split()[0] == "Z"


def test_nothing_is_shared_without_a_server_and_a_dead_server_is_not_attached() -> None:
    if forkserver.running():
        pytest.skip("this process runs a fork server of its own")
    assert forkserver.share() is None
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    assert forkserver.attach({"address": "/nonexistent", "pid": int(dead.stdout),
                              "dir": "/nonexistent", "preload": []}) is False
    assert not forkserver.attached()
