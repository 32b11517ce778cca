"""Plugins load as in production: an out-of-tree override is what the suite checks.

A tiny installed package (a ``*.dist-info`` with ``entry_points.txt`` next to its
module, on ``PYTHONPATH``) hooks ``vllm_omni.general_plugins`` the way real
out-of-tree backends do: ``register_diffusion_backend(SAGE_ATTN, ...)`` re-points
the member at a subclass of the in-tree class that declares block-stride indexing.
The suite runs in a subprocess (the override would otherwise outlive the run in
this process), under xdist, so every process loads the plugins on its own.
"""

from __future__ import annotations

import json
import os
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import needs_omni
from tests.paths import ROOT

DIST = "oot-kvplugin"
ENTRY_POINTS = """
[vllm_omni.general_plugins]
oot_kvplugin = oot_kvplugin:register
oot_kvplugin_broken = oot_kvplugin:explode
oot_kvplugin_missing = oot_kvplugin_no_such_module:register
oot_kvplugin_parent_only = oot_kvplugin:register_parent_only
"""
PLATFORM_ENTRY_POINTS = """
[vllm_omni.platform_plugins]
oot_platform = oot_kvplugin:platform
"""
MODULE = '''
"""Hooks as an out-of-tree backend package writes them."""
import multiprocessing


def register():
    from vllm_omni.diffusion.attention.backends.registry import (
        DiffusionAttentionBackendEnum, register_diffusion_backend)
    register_diffusion_backend(DiffusionAttentionBackendEnum.SAGE_ATTN,
                               "oot_kvplugin_backends.BlockStrideSage")


def platform():
    return "oot_kvplugin_platform.OotPlatform"


def explode():
    raise RuntimeError("oot_kvplugin_broken: boom")


def half_then_raise():
    """Re-points a member, then raises: production never runs with that half-done."""
    from vllm_omni.diffusion.attention.backends.registry import (
        DiffusionAttentionBackendEnum, register_diffusion_backend)
    register_diffusion_backend(DiffusionAttentionBackendEnum.SAGE_ATTN,
                               "oot_kvplugin_backends.BlockStrideSage")
    raise RuntimeError("oot_kvplugin_half: gave up")


def register_parent_only():
    """A seeded wiring fault: the override is made in the main process only."""
    if multiprocessing.parent_process() is None:
        from vllm_omni.diffusion.attention.backends.registry import (
            DiffusionAttentionBackendEnum, register_diffusion_backend)
        register_diffusion_backend(DiffusionAttentionBackendEnum.TORCH_SDPA,
                                   "oot_kvplugin_backends.ParentOnlySDPA")
'''
BACKENDS = '''
from vllm_omni.diffusion.attention.backends.sage_attn import SageAttentionBackend
from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend


class BlockStrideSage(SageAttentionBackend):
    supports_paged_kv = True

    @classmethod
    def indexes_kv_by_block_stride(cls):
        return True


class ParentOnlySDPA(SDPABackend):
    supports_paged_kv = True


class OotPlatformAttention(SDPABackend):
    supports_paged_kv = True
'''
# Its own module: a platform is resolved while backend modules import (they ask for it).
PLATFORM = '''
from pytest_kvconform.adapters.omni_cpu_platform import CpuOmniPlatform


class OotPlatform(CpuOmniPlatform):  # an out-of-tree CPU platform (production's worker runs)
    @classmethod
    def get_diffusion_attn_backend_cls(cls, selected_backend, head_size,
                                       allow_trtllm_default=False):
        if selected_backend is None:
            return "oot_kvplugin_backends.OotPlatformAttention"
        from vllm_omni.diffusion.attention.backends.registry import (
            DiffusionAttentionBackendEnum)
        return DiffusionAttentionBackendEnum[selected_backend].get_path()
'''
OVERRIDE = "oot_kvplugin_backends.BlockStrideSage"
PARENT_ONLY = "oot_kvplugin_backends.ParentOnlySDPA"
IN_TREE_SAGE = "vllm_omni.diffusion.attention.backends.sage_attn.SageAttentionBackend"
IN_TREE_SDPA = "vllm_omni.diffusion.attention.backends.sdpa.SDPABackend"
# bf16_h8 only: world size 1, so one KV-A worker per process.
PLATFORM_BACKEND = "OotPlatformAttention"
SELECT = ("-k", "((SAGE_ATTN and (kv_l1 or kv_l2 or kv_l6 or kv_a2)) or (TORCH_SDPA and kv_a2)"
                f" or ({PLATFORM_BACKEND} and (kv_l1 or kv_a2))) and not seam and not ws2")


def install_plugin(site: Path, entry_points: str = ENTRY_POINTS + PLATFORM_ENTRY_POINTS) -> Path:
    """The plugin package, installed into ``site`` as pip would leave it."""
    info = site / f"{DIST.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    (site / "oot_kvplugin.py").write_text(MODULE)
    (site / "oot_kvplugin_backends.py").write_text(BACKENDS)
    (site / "oot_kvplugin_platform.py").write_text(PLATFORM)
    return site


@pytest.fixture
def with_plugin(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    site = install_plugin(pytester.path / "site")
    repo = str(ROOT)
    rest = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), repo, rest])))
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    return pytester


def _run(pytester: pytest.Pytester, *args: str) -> tuple[pytest.RunResult, dict[str, Any]]:
    result = pytester.runpytest_subprocess("--kv-conformance", "-p", "no:cacheprovider",
                                           "-p", "no:randomly", "--kv-report", "r.json", "-rfs",
                                           *args, timeout=900)
    return result, json.loads((pytester.path / "r.json").read_text())


def _statuses(report: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {r["nodeid"].split("::")[-1]: (r["status"], r["reason"]) for r in report["results"]}


@needs_omni
def test_override_is_checked_in_every_process(with_plugin: pytest.Pytester) -> None:
    """Controller, xdist workers and KV-A workers all load the plugin; L6 finds the gap."""
    result, report = _run(with_plugin, "--kv-backend", "SAGE_ATTN", "--kv-backend", "TORCH_SDPA",
                          "--kv-backend", PLATFORM_BACKEND, *SELECT, "-n", "2")
    out = result.stdout.str()
    # the header: the override, its source, and the failed plugins by name
    result.stdout.fnmatch_lines_random([
        "kvconform: plugins: production (VLLM_PLUGINS unset); loaded: *oot_kvplugin*; platform: "
        f"oot_kvplugin_platform.OotPlatform (distribution {DIST} 0.1, entry point "
        "vllm_omni.platform_plugins:oot_platform (oot_kvplugin:platform))",
        f"kvconform: override: SAGE_ATTN -> {OVERRIDE} (by distribution {DIST} 0.1, entry "
        "point vllm_omni.general_plugins:oot_kvplugin (oot_kvplugin:register))",
        "kvconform: ERROR: plugin oot_kvplugin_broken (vllm_omni.general_plugins, "
        f"{DIST} 0.1) hook raised: RuntimeError: oot_kvplugin_broken: boom; production's "
        "loader calls it unguarded, so a server with it installed fails at start-up*",
        "kvconform: WARNING: plugin oot_kvplugin_missing * failed to load: "
        "ModuleNotFoundError: *oot_kvplugin_no_such_module*; production logs this and starts "
        "without it, and so does the run",
    ])
    assert report["verdict"] == "not qualified"
    assert [f["plugin"] for f in report["startup_failures"]] == ["oot_kvplugin_broken"]
    # the report: path and source per backend, the failures by name
    backends = {b["name"]: b for b in report["backends"]}
    sage = backends["SAGE_ATTN"]
    assert (sage["path"], sage["overridden"]) == (OVERRIDE, True)
    assert f"distribution {DIST} 0.1" in sage["origin"] and "oot_kvplugin" in sage["origin"]
    assert backends["TORCH_SDPA"]["path"] == PARENT_ONLY
    # the platform plugin's default backend is discovered like any other
    platform = backends[PLATFORM_BACKEND]
    assert platform["source"] == "platform" and "OotPlatform" in platform["origin"]
    plugins = {p["name"]: p for p in report["environment"]["plugins"]["plugins"]}
    assert plugins["oot_kvplugin"]["changed"] == ["SAGE_ATTN"]
    assert plugins["oot_kvplugin_broken"]["status"] == "hook-failed"
    assert "boom" in plugins["oot_kvplugin_broken"]["error"]
    assert plugins["oot_kvplugin_missing"]["status"] == "load-failed"
    assert report["environment"]["options"]["plugins"] == "production"
    assert "## Plugins" in (with_plugin.path / "r.md").read_text()
    # the results, each from an xdist worker that loaded the plugin itself
    got = _statuses(report)
    assert got["test_kv_l1[SAGE_ATTN]"][0] == "passed", out[-3000:]
    assert got["test_kv_l2[SAGE_ATTN]"][0] == "passed", out[-3000:]
    status, reason = got["test_kv_l6[SAGE_ATTN]"]
    assert status == "failed" and "never receives indexes_kv_by_block_stride" in reason, reason
    assert got["test_kv_a2[SAGE_ATTN-bf16_h8]"][0] == "passed", out[-3000:]
    assert got[f"test_kv_l1[{PLATFORM_BACKEND}]"][0] == "passed", out[-3000:]
    assert got[f"test_kv_a2[{PLATFORM_BACKEND}-bf16_h8]"][0] == "passed", out[-3000:]
    # the seeded fault: the KV-A worker resolves another class than the test process
    status, reason = got["test_kv_a2[TORCH_SDPA-bf16_h8]"]
    assert status == "failed", out[-3000:]
    assert (f"production's worker built its attention layers with ['{IN_TREE_SDPA}'], not the "
            f"class the test process checked ({PARENT_ONLY})") in reason, reason


@needs_omni
def test_plugins_none_checks_in_tree_classes(with_plugin: pytest.Pytester) -> None:
    """--kv-plugins=none: in-tree classes, here and in the KV-A worker; the report says so."""
    result, report = _run(with_plugin, "--kv-plugins", "none", "--kv-backend", "SAGE_ATTN",
                          "--kv-backend", "FLASH_ATTN",
                          "-k", "(kv_l6 or kv_a2) and not seam and not ws2", "-p", "no:xdist")
    result.stdout.fnmatch_lines_random([
        "kvconform: plugins: none (VLLM_PLUGINS 'kvconform_cpu'); loaded: -*",
        "kvconform: plugins not loaded (VLLM_PLUGINS): *, oot_kvplugin, *",
        "kvconform: override: none (every registry member is its in-tree class)",
    ])
    sage = next(b for b in report["backends"] if b["name"] == "SAGE_ATTN")
    assert (sage["path"], sage["overridden"], sage["origin"]) == (IN_TREE_SAGE, False, "in-tree")
    assert report["environment"]["options"]["plugins"] == "none"
    assert report["environment"]["plugins"]["mode"] == "none"
    # the in-tree SAGE class serves no paged KV (production refuses it); FLASH_ATTN's worker
    # is production's, with the in-tree class (it loaded no plugin either)
    got = _statuses(report)
    for test in ("test_kv_l6[SAGE_ATTN]", "test_kv_a2[SAGE_ATTN-bf16_h8]"):
        assert got[test][0] == "skipped" and "no paged KV support" in got[test][1], got[test]
    for test in ("test_kv_l6[FLASH_ATTN]", "test_kv_a2[FLASH_ATTN-bf16_h8]"):
        assert got[test][0] == "passed", result.stdout.str()[-3000:]
    assert result.ret == pytest.ExitCode.OK


@needs_omni
def test_load_group_records_sources_and_failures(pytester: pytest.Pytester,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """One group through production's loader, in process: sources, errors, VLLM_PLUGINS."""
    from vllm_omni.diffusion.attention.backends.registry import DiffusionAttentionBackendEnum
    from vllm_omni.plugins import load_omni_plugins_by_group

    from pytest_kvconform.adapters import omni_plugins

    group = "kvconform_test.general_plugins"
    site = install_plugin(pytester.path / "site", ENTRY_POINTS.replace(
        "vllm_omni.general_plugins", group))
    (site / "oot_kvplugin_backends.py").write_text("class BlockStrideSage: pass\n"
                                                  "class ParentOnlySDPA: pass\n")
    monkeypatch.syspath_prepend(str(site))
    member = DiffusionAttentionBackendEnum.SAGE_ATTN
    assert not member.is_overridden()
    monkeypatch.setenv("VLLM_PLUGINS", "oot_kvplugin,oot_kvplugin_broken,oot_kvplugin_missing")
    load = omni_plugins.PluginLoad()
    try:
        omni_plugins._load_group(load, group, load_omni_plugins_by_group)
    finally:
        member.clear_override()
    records = {p.name: p for p in load.plugins}
    assert records["oot_kvplugin"].status == "loaded"
    assert records["oot_kvplugin"].changed == ("SAGE_ATTN",)
    assert load.origins["SAGE_ATTN"] == (f"distribution {DIST} 0.1, entry point "
                                         f"{group}:oot_kvplugin (oot_kvplugin:register)")
    assert records["oot_kvplugin_broken"].status == "hook-failed"
    assert records["oot_kvplugin_broken"].error == "RuntimeError: oot_kvplugin_broken: boom"
    assert records["oot_kvplugin_missing"].status == "load-failed"
    assert "oot_kvplugin_no_such_module" in (records["oot_kvplugin_missing"].error or "")
    assert records["oot_kvplugin_parent_only"].status == "not-allowed"  # not in VLLM_PLUGINS
    lines = "\n".join(load.header_lines())
    assert "plugin oot_kvplugin_broken" in lines and "hook raised" in lines


@needs_omni
def test_a_hook_that_raises_leaves_no_half_done_override(pytester: pytest.Pytester,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """What is checked is what production would run: never a raising hook's partial work."""
    from vllm_omni.diffusion.attention.backends.registry import DiffusionAttentionBackendEnum
    from vllm_omni.plugins import load_omni_plugins_by_group

    from pytest_kvconform.adapters import omni_plugins

    group = "kvconform_test.half_plugins"
    site = install_plugin(pytester.path / "site", f"[{group}]\n"
                          "oot_kvplugin_half = oot_kvplugin:half_then_raise\n")
    (site / "oot_kvplugin_backends.py").write_text("class BlockStrideSage: pass\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    member = DiffusionAttentionBackendEnum.SAGE_ATTN
    load = omni_plugins.PluginLoad()
    try:
        omni_plugins._load_group(load, group, load_omni_plugins_by_group)
        assert not member.is_overridden(), member.get_path()
    finally:
        member.clear_override()
    (record,) = load.plugins
    assert (record.status, record.changed) == ("hook-failed", ())
    assert record.error == ("RuntimeError: oot_kvplugin_half: gave up (it had re-pointed "
                            "SAGE_ATTN: undone)")
    assert "SAGE_ATTN" not in load.origins


# Only a raising hook and a plugin that does not import.
BROKEN_PLUGINS = """
[vllm_omni.general_plugins]
oot_kvplugin_broken = oot_kvplugin:explode
oot_kvplugin_missing = oot_kvplugin_no_such_module:register
"""


@needs_omni
def test_a_strict_run_with_a_raising_hook_is_not_qualified_by_name(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server would not start: exit non-zero, the verdict names plugin, distribution and
    error; the plugin that does not import is production's warning, not a finding."""
    site = install_plugin(pytester.path / "site", BROKEN_PLUGINS)
    repo = str(ROOT)
    rest = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), repo, rest])))
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    result, report = _run(pytester, "--kv-strict", "--kv-backend", "TORCH_SDPA", "-k",
                          "kv_l1", "-p", "no:xdist")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()[-3000:]
    named = (f"plugin oot_kvplugin_broken (vllm_omni.general_plugins, {DIST} 0.1) hook raised "
             "RuntimeError: oot_kvplugin_broken: boom")
    result.stdout.fnmatch_lines([
        "kvconform: WARNING: plugin oot_kvplugin_missing * failed to load: *",
        f"*kvconform: verdict*: not qualified (production would not start: {named}; *"])
    assert "oot_kvplugin_missing" not in result.stdout.str().split("kvconform: verdict")[1]
    assert report["verdict"] == "not qualified"
    assert report["startup_failures"] == [
        {"plugin": "oot_kvplugin_broken", "group": "vllm_omni.general_plugins",
         "distribution": f"{DIST} 0.1", "error": "RuntimeError: oot_kvplugin_broken: boom"}]
    assert {r["status"] for r in report["results"]} == {"passed"}  # checked without it
    verdict_section = (pytester.path / "r.md").read_text().split("## Verdict")[1]
    assert f"- {named}" in verdict_section


def test_worker_disagreement_is_a_clause_failure() -> None:
    """KV-A's class check names both paths, from the layers production's worker built."""
    from pytest_kvconform.adapters.engine import EngineReport
    from pytest_kvconform.checks import adoption
    from pytest_kvconform.checks.errors import ClauseFailure
    from pytest_kvconform.contract.records import Case

    run = adoption.Run("KV-A2", "SAGE_ATTN", Case(id="c", file="f"), need=False,
                       name="SAGE_ATTN", path="oot.Cls")
    report = EngineReport(via="", layer_backends=[{"model.layers.0.attn": "in.tree.Cls"}],
                          error={"type": "ValueError", "message": "x", "stage": "control plane",
                                 "where": "w"})
    with pytest.raises(ClauseFailure, match=re.escape(
            "rank 0: production's worker built its attention layers with ['in.tree.Cls'], not "
            "the class the test process checked (oot.Cls)")):
        adoption.ran(run, report)
    agree = EngineReport(via="", layer_backends=[{"model.layers.0.attn": "oot.Cls"}])
    adoption.ran(run, agree)


def test_report_carries_origins_and_plugin_outcomes() -> None:
    """Origin per backend and the plugin outcomes validate and show in the Markdown."""
    from pytest_kvconform.adapters.omni_plugins import PluginLoad, PluginRecord
    from pytest_kvconform.contract.records import BackendUnderTest
    from pytest_kvconform.report import build as rp

    load = PluginLoad(plugins=[
        PluginRecord("vllm_omni.general_plugins", "good", "m:f", "pkg 1", "loaded",
                     changed=("SAGE_ATTN",)),
        PluginRecord("vllm_omni.general_plugins", "bad", "m:g", "pkg 1", "hook-failed",
                     "RuntimeError: boom")],
        overrides={"SAGE_ATTN": "pkg.Sage"}, origins={"SAGE_ATTN": "distribution pkg 1"},
        platform="p.P", platform_source="built-in")
    env = {**rp.environment_info({}, seed=None), "plugins": load.as_dict()}
    backends = [BackendUnderTest("SAGE_ATTN", "pkg.Sage", "registry", True, cls=object,
                                 origin=load.origin_of("SAGE_ATTN", True)),
                BackendUnderTest("TORCH_SDPA", "in.Sdpa", "registry", cls=object,
                                 origin=load.origin_of("TORCH_SDPA", False))]
    built = rp.build_report(environment=env, backends=backends, results=[],
                            options={"plugins": "production"}, strict=False)
    assert [b["origin"] for b in built["backends"]] == ["distribution pkg 1", "in-tree"]
    markdown = rp.render_markdown(built)
    assert "| SAGE_ATTN | pkg.Sage | True | distribution pkg 1 |" in markdown
    assert "| vllm_omni.general_plugins | bad | pkg 1 | hook-failed | - | RuntimeError: boom |" \
        in markdown
    bad = {**built, "backends": [{**built["backends"][0], "origin": 3}]}
    with pytest.raises(rp.ReportError, match=r"backends\[0\]\.origin"):
        rp.validate_report(bad)
    header = "\n".join(load.header_lines())
    assert "override: SAGE_ATTN -> pkg.Sage (by distribution pkg 1)" in header
    assert "ERROR: plugin bad (vllm_omni.general_plugins, pkg 1) hook raised: " \
        "RuntimeError: boom" in header
    assert built["verdict"] == "not qualified"
    assert built["startup_failures"] == [{"plugin": "bad", "group": "vllm_omni.general_plugins",
                                          "distribution": "pkg 1", "error": "RuntimeError: boom"}]
