"""KV-L clauses: a backend's declared layout need and its resolution."""

from __future__ import annotations

from pytest_kvconform import compat
from pytest_kvconform.checks.common import backend_class, cuda_init_recorder, declared_need
from pytest_kvconform.checks.errors import ClauseFailure
from pytest_kvconform.model import BackendUnderTest

DEFAULT_LAYOUT = "LBNHC"
_CALLS = 3


def check_kv_l1(backend: BackendUnderTest) -> None:
    """KV-L1: ``indexes_kv_by_block_stride`` is a device-free, stable, real bool."""
    clause = "KV-L1"
    cls = backend_class(clause, backend)
    method = getattr(cls, "indexes_kv_by_block_stride", None)
    if method is None:
        raise ClauseFailure(clause, "the backend class has no indexes_kv_by_block_stride "
                            "classmethod", backend=backend.name)
    if not callable(method):
        raise ClauseFailure(clause, f"indexes_kv_by_block_stride is {method!r}, not callable",
                            backend=backend.name)
    answers = []
    with cuda_init_recorder() as cuda_calls:
        for _ in range(_CALLS):
            try:
                answers.append(method())
            except TypeError as exc:
                raise ClauseFailure(clause, "indexes_kv_by_block_stride() cannot be called on "
                                    f"the class with no arguments: {exc}",
                                    backend=backend.name) from exc
    first = answers[0]
    if type(first) is not bool:
        raise ClauseFailure(clause, f"indexes_kv_by_block_stride() returned {first!r} of type "
                            f"{type(first).__name__}; a real bool is required",
                            backend=backend.name, expected="bool", actual=type(first).__name__)
    if any(a is not first for a in answers):
        raise ClauseFailure(clause, "indexes_kv_by_block_stride() changes its answer between "
                            "calls", backend=backend.name, expected=first, actual=answers)
    if cuda_calls:
        raise ClauseFailure(clause, "indexes_kv_by_block_stride() initialised a CUDA context; "
                            "the declaration must need no device", backend=backend.name,
                            expected="no CUDA initialisation", actual=cuda_calls)


def check_kv_l2(backend: BackendUnderTest) -> None:
    """KV-L2: resolution on an unpinned config pins the layout the backend needs."""
    clause = "KV-L2"
    compat.require_omni(clause)
    need = declared_need(clause, backend)
    vllm_config = compat.plain_vllm_config()
    cache_config = vllm_config.cache_config
    if cache_config.kv_cache_layout is not None:
        raise ClauseFailure(clause, "a fresh CacheConfig is already pinned",
                            backend=backend.name, expected=None,
                            actual=cache_config.kv_cache_layout)
    resolved = compat.resolve_diffusion_layout(vllm_config, indexes_kv_by_block_stride=need)
    name = getattr(resolved, "name", resolved)
    if need:
        if not str(name).startswith("B"):
            raise ClauseFailure(clause, "a backend that indexes K/V by block stride needs a "
                                "block-outermost layout", backend=backend.name,
                                expected="a B... layout (block outermost)", actual=name)
    elif name != DEFAULT_LAYOUT:
        raise ClauseFailure(clause, "a backend that does not index by block stride gets the "
                            "default layer-outermost layout", backend=backend.name,
                            expected=DEFAULT_LAYOUT, actual=name)
    if cache_config.kv_cache_layout != name:
        raise ClauseFailure(clause, "resolution did not record the layout name on "
                            "CacheConfig.kv_cache_layout", backend=backend.name,
                            expected=name, actual=cache_config.kv_cache_layout)
    try:
        got = cache_config.get_resolved_kv_cache_layout()
    except Exception as exc:
        raise ClauseFailure(clause, f"get_resolved_kv_cache_layout() raised after resolution: "
                            f"{exc!r}", backend=backend.name) from exc
    if got is not compat.layout(name):
        raise ClauseFailure(clause, "get_resolved_kv_cache_layout() disagrees with the recorded "
                            "name", backend=backend.name, expected=name, actual=got)
