"""Discovery with fake sources: sorted, nothing dropped, collisions refused."""

from __future__ import annotations

import pathlib
import sys

import pytest

from pytest_kvconform.adapters import discovery
from pytest_kvconform.contract.outcomes import describe_error
from pytest_kvconform.contract.records import BackendUnderTest
from tests.conftest import needs_omni


class B:
    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        return False


def fake_registry(names: object = None) -> tuple[list[BackendUnderTest], str | None]:
    return [BackendUnderTest("ZETA", "m.Z", "registry", cls=B),
            BackendUnderTest("ALPHA", "m.A", "registry", error="ImportError (no message)")], None


def no_omni(names: object = None) -> tuple[list[BackendUnderTest], str | None]:
    return [], discovery.OMNI_MISSING


def no_platform(paths: object, only: object = None, guard: object = None) -> tuple[None, None]:
    return None, None


def test_sorted_and_unimportable_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(discovery, "platform_backend", no_platform)
    found = discovery.discover([{"MID": B}, None, {"LATE": "no_such_mod_x:Y"}],
                               registry=fake_registry, include_entry_points=False)
    assert found.names == ["ALPHA", "LATE", "MID", "ZETA"]
    late = found.by_name("LATE")
    assert not late.importable and "ModuleNotFoundError" in (late.error or "")
    assert found.by_name("MID").source == "hook"


def test_collision_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(discovery, "platform_backend", no_platform)
    with pytest.raises(discovery.DiscoveryError, match="'ZETA' is defined twice"):
        discovery.discover([{"ZETA": B}], registry=fake_registry, include_entry_points=False)



def test_a_run_naming_backends_imports_no_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """--kv-backend: the registry's and the platform's others are listed, not imported (a
    broken or slow one cannot touch a backend repository's run); a hook backend of a
    left-out name is still a collision."""
    asked: list[object] = []

    def registry(names: object = None) -> tuple[list[BackendUnderTest], str | None]:
        asked.append(names)
        return [b for b in fake_registry()[0] if names is None or b.name in names], None  # type: ignore[operator]

    platform = BackendUnderTest("PLAT", "p.PLAT", "platform")  # no class: not imported
    monkeypatch.setattr(discovery, "registry_snapshot",
                        lambda: {"ZETA": "m.Z", "ALPHA": "m.A"})
    monkeypatch.setattr(discovery, "platform_backend",
                        lambda paths, only=None, guard=None: (platform, None))
    found = discovery.discover([{"MID": B}], registry=registry, include_entry_points=False,
                               only=["ZETA", "MID"])
    assert asked == [["ZETA", "MID"]]
    assert found.names == ["MID", "ZETA"] and found.left_out == ["ALPHA", "PLAT"]
    with pytest.raises(discovery.DiscoveryError, match="'ALPHA' is defined twice"):
        discovery.discover([{"ALPHA": B}], registry=registry, include_entry_points=False,
                           only=["ZETA"])


# Backend modules whose import never finishes (a loop in C holding the GIL) or ends the
# process: a guarded discovery never runs them here, and says why.
HOSTILE_IMPORTS = {
    "kvconform_hog_import": "total = sum(range(10**13))\n\nclass B:\n    pass\n",
    "kvconform_exit_import": "import os\nos._exit(3)\n",
}


def test_a_guarded_import_that_hangs_or_exits_leaves_the_backend_unimportable(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_kvconform.workers import isolated

    for name, text in HOSTILE_IMPORTS.items():
        (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(discovery, "platform_backend", no_platform)
    found = discovery.discover([{"HOG": "kvconform_hog_import:B",
                                 "EXITS": "kvconform_exit_import:B", "FINE": B}],
                               registry=no_omni, include_entry_points=False,
                               guard=isolated.probe(1.0))
    hog, exits = found.by_name("HOG"), found.by_name("EXITS")
    assert not hog.importable and not exits.importable and found.by_name("FINE").importable
    assert hog.error == ("importing kvconform_hog_import (backend HOG) did not finish within 1s "
                         "(--kv-timeout; it blocks, or loops holding the GIL) and was killed; "
                         "it was not imported into the run")
    assert exits.error == ("importing kvconform_exit_import (backend EXITS) ended its process "
                           "(exit code 3); it was not imported into the run")
    assert "kvconform_hog_import" not in sys.modules and "kvconform_exit_import" not in sys.modules


def test_missing_omni_is_a_note() -> None:
    found = discovery.discover([], registry=no_omni, include_entry_points=False)
    assert found.backends == [] and found.notes == [discovery.OMNI_MISSING]


@pytest.mark.parametrize("bad", [{"bad name": B}, {"X": 3}, ["X"]])
def test_bad_hook_results(bad: object) -> None:
    with pytest.raises(discovery.DiscoveryError):
        discovery.discover([bad], registry=no_omni, include_entry_points=False)  # type: ignore[list-item]


def test_describe_error_never_empty() -> None:
    assert describe_error(ImportError()) == "ImportError (no message)"
    assert describe_error(ValueError("x")) == "ValueError: x"


@needs_omni
def test_registry_members_can_be_named() -> None:
    """Only the named members are looked up (and imported): ``kvconform selftest`` needs
    two of them."""
    found, note = discovery.registry_backends({"TORCH_SDPA", "NO_SUCH_MEMBER"})
    assert note is None and [b.name for b in found] == ["TORCH_SDPA"] and found[0].importable


@needs_omni
def test_every_member_of_the_installed_registry_is_discovered() -> None:
    """Whatever the installed vllm-omni's registry holds (0.32.0rc1 added VDNH3_ATTN), each
    member is a discovered backend, importable or with its reason."""
    from vllm_omni.diffusion.attention.backends.registry import DiffusionAttentionBackendEnum

    members = [member.name for member in DiffusionAttentionBackendEnum]
    found, note = discovery.registry_backends()
    assert note is None
    assert sorted(b.name for b in found) == sorted(members)
    assert all(b.importable or b.error for b in found)
