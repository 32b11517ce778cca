"""Running one layout resolution and judging it: kept or refused, config untouched.

The KV-L3, KV-L4 and KV-L8 checks (``checks/layout.py``) each pin a layout (on
``CacheConfig``, as a connector's requirement, in ``VLLM_KV_CACHE_LAYOUT``, or on a
worker) and ask whether production kept it or refused it cleanly; this is the one place
that says what kept and refused mean, as a :data:`Problem` or None.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from pytest_kvconform.adapters import compat, run_env
from pytest_kvconform.checks.common import Problems
from pytest_kvconform.contract import oracle

# (detail, expected, actual) of one thing that went wrong.
Problem = tuple[str, object, object]
# VLLM_KV_CACHE_LAYOUT values per need: (consistent, contradicting).  The
# consistent one is never the resolver's default for that need, so a variable
# that is silently ignored cannot pass by coincidence.
_ENV_PICKS = {False: ("LBHNC", "BLNHC"), True: ("BLHNC", "LBNHC")}


def layouts_for(need: bool, *, consistent: bool) -> list[str]:
    """The layouts whose block-outermost-ness (per the oracle) matches or contradicts ``need``."""
    return [name for name in compat.LAYOUT_NAMES
            if (oracle.is_block_outermost(name) == need) is consistent]


def layout_name(layout: Any) -> Any:
    return getattr(layout, "name", layout)


def pinned_config(pinned: str | None) -> Any:
    """A fresh ``VllmConfig``, its ``CacheConfig`` pinned to ``pinned`` as a user would."""
    vllm_config = compat.plain_vllm_config()
    if pinned is not None:
        vllm_config.cache_config.kv_cache_layout = pinned
    return vllm_config


def resolve(vllm_config: Any, need: bool, required: Any = None) -> Any:
    return compat.resolve_diffusion_layout(vllm_config, indexes_kv_by_block_stride=need,
                                           required_layout=required)


def raised(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        return f"raised a bare KeyError({exc})"
    return f"raised {type(exc).__name__}: {exc}"


def kept_problem(call: Callable[[], Any], vllm_config: Any, expected: str,
                 recorded: tuple[str, ...]) -> Problem | None:
    """None when ``call()`` returns ``expected`` and the config records one of ``recorded``."""
    try:
        got = call()
    except Exception as exc:
        return f"refused it and {raised(exc)}", expected, repr(exc)
    if layout_name(got) != expected:
        return "returned another layout", expected, layout_name(got)
    after = vllm_config.cache_config.kv_cache_layout
    if after not in recorded:
        return "changed CacheConfig.kv_cache_layout", recorded[0], after
    return None


def refusal_problem(call: Callable[[], Any], vllm_config: Any,
                    names: tuple[str, ...]) -> Problem | None:
    """None when ``call()`` raises ValueError naming one of ``names``, config untouched."""
    before = vllm_config.cache_config.kv_cache_layout
    expected = f"ValueError naming {names[0]}, CacheConfig.kv_cache_layout left {before!r}"
    try:
        got = call()
    except ValueError as exc:
        after = vllm_config.cache_config.kv_cache_layout
        if after != before:
            return "raised but changed CacheConfig.kv_cache_layout", before, after
        if not any(name in str(exc) for name in names):
            return "raised a ValueError that does not name the layout", expected, str(exc)
        return None
    except Exception as exc:
        return f"{raised(exc)} instead of a ValueError naming the layout", expected, repr(exc)
    after = vllm_config.cache_config.kv_cache_layout
    return (f"accepted it: returned {layout_name(got)}, CacheConfig.kv_cache_layout={after!r}",
            expected, layout_name(got))


def add_problem(problems: Problems, what: str, problem: Problem, layout: str, verb: str) -> None:
    """Record ``problem`` of the sub-scenario ``what`` (``verb``: who went wrong)."""
    detail, expected, actual = problem
    problems.add(f"{what}, but {verb} {detail}", layout=layout, expected=expected, actual=actual)


def _env_problem(need: bool, value: str, consistent: bool, device: str) -> Problem | None:
    """Resolve a production config built under ``VLLM_KV_CACHE_LAYOUT=value``."""
    var = compat.LAYOUT_ENV_VAR
    expected = value if consistent else f"ValueError naming {value} or {var}"
    with run_env.variable_set(var, value):
        try:
            vllm_config = compat.production_vllm_config(device)
            got = resolve(vllm_config, need)
        except ValueError as exc:
            if consistent:
                return "was refused although it is consistent", expected, repr(exc)
            if value not in str(exc) and var not in str(exc):
                return "was refused by a ValueError naming neither it nor the variable", \
                    expected, str(exc)
            return None
        except Exception as exc:
            return f"{raised(exc)}", expected, repr(exc)
    recorded = vllm_config.cache_config.kv_cache_layout
    if consistent and layout_name(got) == value and recorded == value:
        return None
    return (f"was silently ignored: diffusion resolution pinned {recorded} "
            f"(returned {layout_name(got)})", expected, layout_name(got))


def add_env_var_problems(problems: Problems, need: bool, device: str, *,
                         consistent: bool) -> None:
    """``VLLM_KV_CACHE_LAYOUT`` set to a layout consistent with ``need`` (or contradicting
    it) must be honoured (or refused with a ValueError), and restored afterwards; what went
    wrong is added to ``problems``."""
    var = compat.LAYOUT_ENV_VAR
    before = os.environ.get(var)
    value = _ENV_PICKS[need][0 if consistent else 1]
    relation = "consistent with" if consistent else "contradicts"
    what = (f"{var}={value} ({relation} indexes_kv_by_block_stride()={need}) must be "
            + ("honoured" if consistent else "refused with a ValueError"))
    problem = _env_problem(need, value, consistent, device)
    if problem is not None:
        add_problem(problems, what, problem, value, "it")
    if os.environ.get(var) != before:
        problems.add(f"{var} leaked out of the check, but it was not restored", layout="",
                     expected=before, actual=os.environ.get(var))
