"""The plugin's front door: options, off-means-free, discovery sources, usage errors."""

from __future__ import annotations

import textwrap
import types

import pytest

from pytest_kvconform import plugin
from tests.conftest import needs_omni
from tests.seeding import register_backends
from tests.standin_backends import Good, GoodBlockStride, IntFlag

REGISTRY = [
    "CUDNN_ATTN", "FASTVIDEO_VSA", "FLASHINFER_ATTN", "FLASH_ATTN", "FLASH_ATTN_3_HUB",
    "FLASH_ATTN_HUB", "RAINFUSION_ATTN", "SAGE_ATTN", "SAGE_ATTN_3", "TORCH_SDPA", "TRTLLM_ATTN",
]

FAKE_BACKENDS = {"GOOD_BS": GoodBlockStride, "INT_FLAG": IntFlag,
                 "MISSING": "no_such_module_kvc:Backend"}


def test_off_means_free(pytester: pytest.Pytester) -> None:
    """Without --kv-conformance: no torch/vllm/vllm_omni import, no test added."""
    pytester.makepyfile(test_probe='''
        import sys

        def test_probe():
            heavy = [m for m in ("torch", "vllm", "vllm_omni") if m in sys.modules]
            assert heavy == []
            ours = {m for m in sys.modules if m.startswith("pytest_kvconform")}
            assert ours <= {"pytest_kvconform", "pytest_kvconform.contract",
                            "pytest_kvconform.plugin", "pytest_kvconform.session",
                            "pytest_kvconform.session.options", "pytest_kvconform.hookspecs"}, ours
    ''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert "kvconform:" not in result.stdout.str()  # no header lines, no matrix


def test_tests_on_worker_processes_run_after_the_rest() -> None:
    """Their workers start meanwhile; the order within each part is kept."""
    items = [types.SimpleNamespace(name=name, fixturenames=fixtures) for name, fixtures in (
        ("a1", ["kv_workers"]), ("l1", ["kv_device"]), ("a2", ["kv_workers", "kv_device"]),
        ("user", []))]

    def run(session_plugin: object) -> list[str]:
        config = types.SimpleNamespace(pluginmanager=types.SimpleNamespace(
            get_plugin=lambda name: session_plugin if name == plugin.SESSION_PLUGIN else None))
        ordered = list(items)
        plugin.pytest_collection_modifyitems(config, ordered)  # type: ignore[arg-type]
        return [i.name for i in ordered]

    assert run(object()) == ["l1", "user", "a1", "a2"]
    assert run(None) == ["a1", "l1", "a2", "user"]  # --kv-conformance off: untouched


def test_the_timeout_default_is_one_number() -> None:
    """options keeps its own copy so that a run without --kv-conformance imports no budget."""
    from pytest_kvconform.session import options
    from pytest_kvconform.workers import budget

    assert options.DEFAULT_TIMEOUT_S == budget.DEFAULT_TIMEOUT_S


def test_help_lists_options_in_their_group(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--help")
    result.stdout.fnmatch_lines(["*KV-cache layout conformance (pytest-kvconform)*"])
    for flag in ("--kv-conformance", "--kv-backend=NAME", "--kv-device=auto|cpu|cuda[:N]",
                 "--kv-cases=PATH", "--kv-report=PATH", "--kv-xfails=auto|none|FILE",
                 "--kv-strict"):
        assert flag in result.stdout.str(), flag
    result.stdout.fnmatch_lines(["*kv_conformance (bool)*"])


@needs_omni
def test_collect_only_lists_all_registry_members(kv_run) -> None:
    result = kv_run("--collect-only", "-q", "-k", "kv_l1 or kv_l2")
    out = result.stdout.str()
    for name in REGISTRY:
        assert f"test_kv_l1[{name}]" in out, name
        assert f"test_kv_l2[{name}]" in out, name


@needs_omni
def test_registry_run_l1_l2(kv_run) -> None:
    result = kv_run("-rs", "-k", "kv_l1 or kv_l2")
    result.assert_outcomes(passed=30, skipped=3)  # KV-L1's two controls, KV-L2
    result.stdout.fnmatch_lines([
        "*backend x clause*",
        "*KV-L1: backend SAGE_ATTN_3 is not importable: ImportError*",
    ])
    for name in REGISTRY:
        result.stdout.fnmatch_lines([f"{name} *"])


@needs_omni
def test_unknown_backend_is_usage_error(kv_run) -> None:
    result = kv_run("--kv-backend", "NOPE")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kv-backend: unknown backend 'NOPE'; available backends: "
                                 "CUDNN_ATTN, *TORCH_SDPA, TRTLLM_ATTN*"])


def test_hook_backends_and_bad_flag(pytester: pytest.Pytester, kv_run) -> None:
    register_backends(pytester, FAKE_BACKENDS)
    result = kv_run("-rs", "-k", "kv_l1", "--kv-backend", "GOOD_BS", "--kv-backend", "INT_FLAG",
                    "--kv-backend", "MISSING")
    result.assert_outcomes(passed=3, failed=1, skipped=2)  # each names itself as registered
    result.stdout.fnmatch_lines([
        "*KV-L1 violated [[]backend=INT_FLAG[]]: indexes_kv_by_block_stride() returned 1 of "
        "type int; a real bool is required*",
        "*KV-L1: backend MISSING is not importable: ModuleNotFoundError*no_such_module_kvc*",
    ])


def test_entry_point_backend(pytester: pytest.Pytester, kv_run,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny installed distribution registers a backend through the entry-point group."""
    site = pytester.mkdir("site")
    (site / "kvc_fake_backend.py").write_text(textwrap.dedent('''
        class EntryBackend:
            @classmethod
            def indexes_kv_by_block_stride(cls):
                return False

            @classmethod
            def get_name(cls):
                return "EP_CLASS"

        class MappedBackend(EntryBackend):
            @classmethod
            def get_name(cls):
                return "EP_MAPPED"

        def more():
            return {"EP_MAPPED": MappedBackend}
    '''))
    info = site / "kvc_fake_backend-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvc-fake-backend\n"
                                   "Version: 0.1\n")
    (info / "entry_points.txt").write_text("[pytest_kvconform.backends]\n"
                                           "EP_CLASS = kvc_fake_backend:EntryBackend\n"
                                           "EP_FACTORY = kvc_fake_backend:more\n")
    monkeypatch.syspath_prepend(str(site))
    result = kv_run("-v", "-k", "kv_l1 and EP_")
    result.stdout.fnmatch_lines(["*test_kv_l1[[]EP_CLASS[]] PASSED*",
                                 "*test_kv_l1[[]EP_MAPPED[]] PASSED*",
                                 "*test_kv_l1_name[[]EP_CLASS[]] PASSED*",
                                 "*test_kv_l1_name[[]EP_MAPPED[]] PASSED*"])
    result.assert_outcomes(passed=4)


def test_duplicate_backend_name_is_usage_error(pytester: pytest.Pytester, kv_run) -> None:
    register_backends(pytester, {"TORCH_SDPA": Good})
    result = kv_run()
    if result.ret == pytest.ExitCode.USAGE_ERROR:
        result.stderr.fnmatch_lines(["*backend name 'TORCH_SDPA' is defined twice*"])
    else:  # vllm-omni absent: no registry member to collide with
        pytest.importorskip("vllm_omni")


def test_bad_case_file_names_file_case_and_key(pytester: pytest.Pytester, kv_run) -> None:
    bad = pytester.makefile(".toml", bad='[[case]]\nid = "mine"\nhead_sise = 8\n')
    result = kv_run("--kv-cases", str(bad))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--kv-cases: {bad}, case 'mine', key 'head_sise': "
                                 "unknown key*"])


def test_bad_device_option(kv_run) -> None:
    result = kv_run("--kv-device", "tpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*tpu*"])


def test_ini_keys_enable_the_suite(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nkv_conformance = true\nkv_backend = ONLY\n")
    register_backends(pytester, {"ONLY": Good})
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:xdist", "-q",
                                "--collect-only", "-k", "kv_l1")
    result.stdout.fnmatch_lines(["*test_kv_l1[[]ONLY[]]*"])


def test_report_into_missing_directory_is_usage_error(kv_run) -> None:
    result = kv_run("--kv-report", "no/such/dir/r.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kv-report: no/such/dir/r.json: directory*does not exist*"])


def test_missing_xfails_file_is_usage_error(kv_run) -> None:
    result = kv_run("--kv-xfails", "nope.toml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kv-xfails:*nope.toml*"])


def test_a_runaway_match_is_refused_at_start_up(pytester: pytest.Pytester, kv_run) -> None:
    hostile = pytester.makefile(".toml", hostile='[[xfail]]\nbackend = "*"\nclause = "KV-L8"\n'
                                'test = "test_kv_l8_alias"\nmatch = "(.+)+#"\nreason = "r"\n')
    result = kv_run("--kv-xfails", str(hostile))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kv-xfails:*hostile.toml: *entry 1: key 'match': '(.+)+#' "
                                 "can backtrack without end: *"])


def test_seeded_worker_fault_is_announced_and_refused_in_strict_mode(
        kv_run, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCONFORM_WORKER_FAULT", "skip_adoption")
    result = kv_run("--kv-strict")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*refusing to qualify with the seeded worker fault*"])
    result = kv_run("--collect-only", "-k", "kv_l1")
    result.stdout.fnmatch_lines(["*WARNING: seeded worker fault 'skip_adoption' is active*"])
    monkeypatch.setenv("KVCONFORM_WORKER_FAULT", "typo")
    result = kv_run("--collect-only", "-q")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*KVCONFORM_WORKER_FAULT='typo' is not a known worker fault*"])


@needs_omni
def test_kv_control_plane_takes_a_backend_class(pytester: pytest.Pytester, kv_run) -> None:
    """The fixture takes a backend class, as ``kv_deployment`` does and the backend authors'
    page says, and the package exports the ``Case`` record it takes."""
    pytester.makepyfile(test_mine='''
        from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend

        from pytest_kvconform import Case


        class MyBackend(SDPABackend):
            supports_paged_kv = True

            @classmethod
            def get_name(cls):
                return "MY_ATTN"


        def test_the_control_plane_of_a_class(kv_control_plane):
            plane = kv_control_plane(MyBackend, Case(id="mine", file="<my tests>"))
            assert plane.pinned == "LBNHC"
            assert [config.kv_cache_layout for config in plane.rank_configs] == ["LBNHC"]
    ''')
    result = kv_run("test_mine.py", "-k", "the_control_plane_of_a_class")
    result.assert_outcomes(passed=1)
