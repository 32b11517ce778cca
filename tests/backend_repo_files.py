"""What a backend repository holds, written once for the tests that build one
(``end_to_end/test_backend_repo.py`` from the installed wheel, ``end_to_end/test_subjects.py``
inline)."""

from __future__ import annotations

# Subclasses of vllm-omni's SDPA backend: production's worker serves paged KV with them.
SDPA_BACKENDS = '''"""A backend repository's backends: one per registration route, and a slip."""

from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend


class HookBackend(SDPABackend):
    supports_paged_kv = True  # production's worker serves paged KV with it

    @classmethod
    def get_name(cls) -> str:
        return "MY_HOOK_ATTN"


class EntryPointBackend(SDPABackend):
    supports_paged_kv = True

    @classmethod
    def get_name(cls) -> str:
        return "MY_EP_ATTN"


class SlipBackend(SDPABackend):
    """A real slip: the declaration written as an instance method."""

    supports_paged_kv = True

    @classmethod
    def get_name(cls) -> str:
        return "MY_SLIP"

    def indexes_kv_by_block_stride(self) -> bool:
        return False
'''


def pyproject(name: str) -> str:
    """A pyproject.toml's build system and project table, for more tables to follow."""
    return f'''[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "{name}"
version = "0.1"
'''
