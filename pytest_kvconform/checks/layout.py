"""KV-L clauses: a backend's declared layout need and its resolution."""

from __future__ import annotations

from functools import partial
from typing import Any

from pytest_kvconform.adapters import compat, discovery
from pytest_kvconform.adapters.control_plane import production_control_plane_call
from pytest_kvconform.checks.common import (
    Problems,
    Where,
    backend_class,
    call_declaration,
    cuda_init_recorder,
    declared,
    declared_need,
    production_with_class,
    supports_paged_kv,
)
from pytest_kvconform.checks.errors import HarnessError, SkipKind
from pytest_kvconform.checks.layout_resolution import (
    add_env_var_problems,
    add_problem,
    kept_problem,
    layout_name,
    layouts_for,
    pinned_config,
    raised,
    refusal_problem,
    resolve,
)
from pytest_kvconform.contract import oracle
from pytest_kvconform.contract.records import UNREGISTERED_SOURCES, BackendUnderTest, Case
from pytest_kvconform.workers.devices import Unplaceable

DEFAULT_LAYOUT = "LBNHC"
_CALLS = 3


def check_kv_l1(backend: BackendUnderTest) -> None:
    """KV-L1: ``indexes_kv_by_block_stride`` is a device-free, stable, real bool."""
    clause = "KV-L1"
    where = Where(clause, backend=backend.name)
    cls = backend_class(clause, backend)
    method = getattr(cls, "indexes_kv_by_block_stride", None)
    if method is None:
        raise where.fail("the backend class has no indexes_kv_by_block_stride "
                         "classmethod")
    if not callable(method):
        raise where.fail(f"indexes_kv_by_block_stride is {method!r}, not callable")
    answers = []
    error: Exception | None = None
    with cuda_init_recorder() as cuda_calls:
        for _ in range(_CALLS):
            try:
                answers.append(call_declaration(clause, backend.name, method))
            except HarnessError:
                raise
            except Exception as exc:  # judged below, after the device question
                error = exc
                break
    # A declaration that reaches for CUDA fails on a CPU build with an unrelated
    # error; the device access is the finding, so it is reported first.
    if cuda_calls:
        raise where.fail("indexes_kv_by_block_stride() initialised a CUDA context; "
                         "the declaration must need no device",
                         expected="no CUDA initialisation", actual=cuda_calls)
    if error is not None:
        how = ("cannot be called on the class with no arguments" if isinstance(error, TypeError)
               else "raised")
        raise where.fail(f"indexes_kv_by_block_stride() {how}: {error!r}") from error
    first = answers[0]
    if type(first) is not bool:
        raise where.fail(f"indexes_kv_by_block_stride() returned {first!r} of type "
                         f"{type(first).__name__}; a real bool is required",
                         expected="bool", actual=type(first).__name__)
    if any(a is not first for a in answers):
        raise where.fail("indexes_kv_by_block_stride() changes its answer between "
                         "calls", expected=first, actual=answers)


def check_kv_l1_name(backend: BackendUnderTest) -> None:
    """KV-L1 (name): ``get_name()`` returns, as a ``str``, the name the backend is
    registered under.

    Production names a backend by it: a layer's backend preference and its implementation
    overrides are keyed on it, and model code branches on it (``vllm_omni.diffusion.
    attention.layer``); a backend registered as one name that answers to another is served
    as that other.
    """
    clause = "KV-L1"
    where = Where(clause, backend=backend.name)
    cls = backend_class(clause, backend)
    method = getattr(cls, "get_name", None)
    if method is None or not callable(method):
        raise where.fail(f"the backend class has no callable get_name() (found {method!r}); "
                         "production names a backend by it")
    name = declared(where, backend.name, method, "get_name")
    if type(name) is not str:
        raise where.fail(f"get_name() returned {name!r} of type {type(name).__name__}, but "
                         f"the backend is registered as {backend.name!r}; a str is required",
                         expected="str", actual=type(name).__name__)
    accepted = registered_names(backend)
    if accepted is not None and name not in accepted:
        also = (f" (its registry member's in-tree class answers to {accepted[1]!r})"
                if len(accepted) > 1 else "")
        raise where.fail(f"get_name() returned {name!r}, but the backend is registered as "
                         f"{backend.name!r}{also}: production would serve it as {name!r} "
                         "(backend preference, implementation overrides)",
                         expected=accepted[0] if len(accepted) == 1 else list(accepted),
                         actual=name)


def registered_names(backend: BackendUnderTest) -> tuple[str, ...] | None:
    """The names ``get_name()`` may return: the name the backend is registered under, and
    for a registry member the one its in-tree class answers to (production's own name for
    the member: an override may keep it); None where any ``str`` will do, because the name
    is not a registration (a platform's default backend, which discovery names after its
    class; a class handed to ``check_backend``)."""
    if backend.source in UNREGISTERED_SOURCES:
        return None
    names = [backend.name]
    if backend.source == "registry":
        in_tree = discovery.in_tree_name(backend.name)
        if in_tree is not None:
            names.append(in_tree)
    return tuple(dict.fromkeys(names))


def check_kv_l2(backend: BackendUnderTest) -> None:
    """KV-L2: resolution on an unpinned config pins the layout the backend needs."""
    clause = "KV-L2"
    where = Where(clause, backend=backend.name)
    compat.require_omni(clause)
    need = declared_need(clause, backend)
    vllm_config = compat.plain_vllm_config()
    cache_config = vllm_config.cache_config
    if cache_config.kv_cache_layout is not None:
        raise where.fail("a fresh CacheConfig is already pinned",
                         expected=None,
                         actual=cache_config.kv_cache_layout)
    resolved = compat.resolve_diffusion_layout(vllm_config, indexes_kv_by_block_stride=need)
    name = getattr(resolved, "name", resolved)
    if need:
        if not str(name).startswith("B"):
            raise where.fail("a backend that indexes K/V by block stride needs a "
                             "block-outermost layout",
                             expected="a B... layout (block outermost)", actual=name)
    elif name != DEFAULT_LAYOUT:
        raise where.fail("a backend that does not index by block stride gets the "
                         "default layer-outermost layout",
                         expected=DEFAULT_LAYOUT, actual=name)
    if cache_config.kv_cache_layout != name:
        raise where.fail("resolution did not record the layout name on "
                         "CacheConfig.kv_cache_layout",
                         expected=name, actual=cache_config.kv_cache_layout)
    try:
        got = cache_config.get_resolved_kv_cache_layout()
    except Exception as exc:
        raise where.fail(f"get_resolved_kv_cache_layout() raised after resolution: "
                         f"{exc!r}") from exc
    if got is not compat.layout(name):
        raise where.fail("get_resolved_kv_cache_layout() disagrees with the recorded "
                         "name", expected=name, actual=got)


# --- KV-L3 .. KV-L8 -------------------------------------------------------------

# The control plane's probe model (KV-L6): which layout gets pinned is the point,
# not sizing, which KV-S and KV-N cover.
_PROBE_CASE = Case(id="kv_l6_probe", file="<kv_l6>")


def check_kv_l3(backend: BackendUnderTest) -> None:
    """KV-L3: consistent pinned / connector-required layouts are kept, idempotently."""
    clause = "KV-L3"
    where = Where(clause, backend=backend.name)
    compat.require_omni(clause)
    need = declared_need(clause, backend)
    problems = Problems(where)
    for name in layouts_for(need, consistent=True):
        member = compat.layout(name)
        pinned, required, both = pinned_config(name), pinned_config(None), pinned_config(name)
        scenarios = (
            (f"pinned layout {name} (consistent with the backend)", pinned, None),
            (f"pinned layout {name}, resolved a second time (idempotence)", pinned, None),
            (f"connector-required layout {name} (consistent with the backend)", required, member),
            (f"connector-required layout {name}, resolved a second time (idempotence)",
             required, member),
            (f"pinned layout {name} equal to the connector's requirement", both, member),
        )
        for what, vllm_config, req in scenarios:
            problem = kept_problem(partial(resolve, vllm_config, need, req), vllm_config,
                                   name, (name,))
            if problem is not None:
                add_problem(problems, what, problem, name, "resolution")
    problems.raise_any()


def check_kv_l4(backend: BackendUnderTest) -> None:
    """KV-L4: a contradictory pinned / connector-required layout raises, config untouched."""
    clause = "KV-L4"
    where = Where(clause, backend=backend.name)
    compat.require_omni(clause)
    need = declared_need(clause, backend)
    problems = Problems(where)
    for name in layouts_for(need, consistent=False):
        pinned, required = pinned_config(name), pinned_config(None)
        scenarios = (
            (f"pinned layout {name} contradicts indexes_kv_by_block_stride()={need}",
             pinned, None),
            (f"connector-required layout {name} contradicts indexes_kv_by_block_stride()={need}",
             required, compat.layout(name)),
        )
        for what, vllm_config, req in scenarios:
            problem = refusal_problem(partial(resolve, vllm_config, need, req), vllm_config,
                                      (name,))
            if problem is not None:
                add_problem(problems, what, problem, name, "resolution")
    problems.raise_any()


def _l5(backend: BackendUnderTest) -> tuple[Where, Any, bool]:
    clause = "KV-L5"
    compat.require_omni(clause)
    return (Where(clause, backend=backend.name), backend_class(clause, backend),
            declared_need(clause, backend))


def _assert_supported(where: Where, name: str | None, cls: Any) -> str | None:
    """Production's backend-layout assertion for a config pinned to ``name`` (None:
    unresolved), handed the backend's class: the layout the config holds afterwards, or
    what the assertion raised (bounded and named as a call into the class is)."""

    def assertion() -> str | None:
        config = pinned_config(name)
        compat.assert_backend_layout_supported(config, cls)
        return config.cache_config.kv_cache_layout

    assert where.backend is not None
    return production_with_class(where.clause, where.backend,
                                 "assert_backend_layout_supported", assertion)


def check_kv_l5_unresolved(backend: BackendUnderTest) -> None:
    """KV-L5: the backend-layout assertion is silent while the layout is unresolved (a
    worker not yet told the layout must not crash) and pins nothing."""
    where, cls, _ = _l5(backend)
    try:
        pinned = _assert_supported(where, None, cls)
    except HarnessError:
        raise
    except Exception as exc:
        raise where.fail("assert_backend_layout_supported raised while the layout is "
                         "unresolved (a worker not yet told the layout must not crash): "
                         f"{exc!r}", expected="silence",
                         actual=repr(exc)) from exc
    if pinned is not None:
        raise where.fail("assert_backend_layout_supported pinned a layout on an "
                         "unresolved config; the worker would then disagree with the control "
                         "plane", expected=None, actual=pinned)


def check_kv_l5_consistent(backend: BackendUnderTest) -> None:
    """KV-L5: the backend-layout assertion passes every layout consistent with the need."""
    where, cls, need = _l5(backend)
    for name in layouts_for(need, consistent=True):
        try:
            _assert_supported(where, name, cls)
        except HarnessError:
            raise
        except Exception as exc:
            raise where.fail(f"assert_backend_layout_supported raised for layout {name}"
                             f", which is consistent with indexes_kv_by_block_stride()={need}",
                             layout=name, expected="silence",
                             actual=repr(exc)) from exc


def check_kv_l5_contradiction(backend: BackendUnderTest) -> None:
    """KV-L5: the backend-layout assertion raises for every layout contradicting the need."""
    where, cls, need = _l5(backend)
    for name in layouts_for(need, consistent=False):
        try:
            _assert_supported(where, name, cls)
        except ValueError:
            continue
        except HarnessError:
            raise
        except Exception as exc:
            raise where.fail(f"assert_backend_layout_supported {raised(exc)} for "
                             f"contradictory layout {name}",
                             layout=name, expected="ValueError", actual=repr(exc)) from exc
        raise where.fail(f"assert_backend_layout_supported stayed silent for layout "
                         f"{name}, which contradicts indexes_kv_by_block_stride()={need}",
                         layout=name, expected="ValueError",
                         actual="no exception")


def check_kv_l6(backend: BackendUnderTest, workers: Any) -> None:
    """KV-L6: what production's engine pins for a model served with the backend, and its
    worker allocates, satisfies the backend's need.

    Production's whole engine runs (``checks.adoption``): the control plane as the
    engine runs it, for a paged model whose attention layers select this backend
    through ``diffusion_attention_config``, against the executor production selects,
    whose worker adopts and allocates.
    """
    from pytest_kvconform.adapters import engine, entry_points
    from pytest_kvconform.checks import adoption

    clause = "KV-L6"
    where = Where(clause, backend=backend.name)
    compat.require_omni(clause)
    need = declared_need(clause, backend)
    if not supports_paged_kv(clause, backend):
        raise where.skip(f"{backend.name} has no paged KV support (supports_paged_kv is not "
                         "True): production serves no paged model with it "
                         f"({adoption.REFUSAL} raises NotImplementedError)",
                         SkipKind.NOT_APPLICABLE)
    if isinstance(workers, Unplaceable):
        raise where.skip(workers.reason, SkipKind.HARDWARE)
    run = adoption.Run(clause, backend.name, _PROBE_CASE, need=need, name=backend.name,
                       path=engine.dotted(backend.path))
    with adoption.deploy(run, workers, topology=entry_points.UNI) as deployed:
        report = deployed.report
    if report.error is not None and not report.rank_configs:
        adoption.ran(run, report)
    pinned = report.pinned
    if pinned is None:
        raise where.fail("the control plane recorded no layout on "
                         "CacheConfig.kv_cache_layout",
                         expected="a layout name", actual=None)
    sent = [getattr(c, "kv_cache_layout", None)
            for c in (*report.rank_configs, report.scheduler_config)]
    if not report.rank_configs or any(name != pinned for name in sent):
        raise where.fail("the layout handed to the workers / scheduler is not the one "
                         "the control plane pinned", layout=pinned,
                         expected=pinned, actual=sent)
    canonical = compat.layout_aliases().get(pinned, pinned)
    if oracle.is_block_outermost(canonical) == need:
        return
    allocated = [seen["layout_after"] for seen in report.ranks]
    worker = (f"; production's worker then allocated {', '.join(map(str, allocated))} without "
              "complaint" if report.error is None and allocated else
              f"; production's worker refused it ({report.error['type']}: "
              f"{report.error['message']})" if report.error else "")
    _, call_kwargs = production_control_plane_call()
    if need and "indexes_kv_by_block_stride" not in call_kwargs:
        detail = ("the control plane never receives indexes_kv_by_block_stride; pinned "
                  f"{pinned} for a backend that needs a block-outermost layout "
                  "(initialize_diffusion_kv_control_plane calls build_native_kv_cache_configs "
                  "without the backend's flag, so its kernel would read K/V at the wrong "
                  f"offsets){worker}")
    else:
        detail = (f"the production control plane pinned {pinned} (is_block_outermost="
                  f"{not need}) for a backend declaring indexes_kv_by_block_stride()={need}"
                  f"{worker}")
    raise where.fail(detail, layout=pinned,
                     expected="a block-outermost layout" if need else
                     "a layer-outermost layout", actual=pinned)


def seam_backend(need: bool) -> BackendUnderTest:
    """A paged backend declaring ``need``, so KV-L6 covers both needs even while the
    registry declares only False (a wiring gap would otherwise stay invisible)."""
    from pytest_kvconform.adapters import seam_backends

    path = seam_backends.path(need)
    if not compat.omni_installed():  # no class to build; check_kv_l6 skips, naming why
        return BackendUnderTest(f"need_{need}", path, "synthetic",
                                error="vllm-omni not installed")
    return BackendUnderTest(f"need_{need}", path, "synthetic",
                            cls=getattr(seam_backends, seam_backends.NAMES[need]))


def check_kv_l7(backend: BackendUnderTest, device: str = "cpu") -> str:
    """KV-L7: the paged read path against a dense reference (``checks/paged.py``)."""
    from pytest_kvconform.checks import paged

    return paged.check_kv_l7(backend, device)


def _l8_canonical(backend: BackendUnderTest, *, consistent: bool) -> None:
    clause = "KV-L8"
    where = Where(clause, backend=backend.name)
    compat.require_omni(clause)
    need = declared_need(clause, backend)
    problems = Problems(where)
    for name in layouts_for(need, consistent=consistent):
        vllm_config = pinned_config(name)
        call = partial(resolve, vllm_config, need)
        if consistent:
            what = f"user-pinned CacheConfig.kv_cache_layout={name!r} must be honoured"
            problem = kept_problem(call, vllm_config, name, (name,))
        else:
            what = (f"user-pinned CacheConfig.kv_cache_layout={name!r} contradicts the backend "
                    "and must be refused with a ValueError naming it")
            problem = refusal_problem(call, vllm_config, (name,))
        if problem is not None:
            add_problem(problems, what, problem, name, "it")
    problems.raise_any()


def check_kv_l8_canonical_honoured(backend: BackendUnderTest) -> None:
    """KV-L8: each canonical layout name a user pins that is consistent is honoured."""
    _l8_canonical(backend, consistent=True)


def check_kv_l8_canonical_refused(backend: BackendUnderTest) -> None:
    """KV-L8: each canonical layout name a user pins that contradicts is refused clearly."""
    _l8_canonical(backend, consistent=False)


def check_kv_l8_alias(backend: BackendUnderTest) -> None:
    """KV-L8: the legacy aliases upstream accepts (NHD, HND) are honoured or refused clearly."""
    clause = "KV-L8"
    where = Where(clause, backend=backend.name)
    compat.require_omni(clause)
    need = declared_need(clause, backend)
    aliases = compat.layout_aliases()
    if not aliases:
        raise where.skip("installed vLLM accepts no legacy layout alias",
                         SkipKind.NOT_APPLICABLE)
    problems = Problems(where)
    for alias, canonical in aliases.items():
        vllm_config = pinned_config(alias)
        call = partial(resolve, vllm_config, need)
        if oracle.is_block_outermost(canonical) == need:
            what = (f"user-pinned CacheConfig.kv_cache_layout={alias!r} (upstream's legacy alias "
                    f"for {canonical}) must be honoured as {canonical}")
            problem = kept_problem(call, vllm_config, canonical, (alias, canonical))
        else:
            what = (f"user-pinned CacheConfig.kv_cache_layout={alias!r} (upstream's legacy alias "
                    f"for {canonical}) contradicts the backend and must be refused with a "
                    "ValueError naming it")
            problem = refusal_problem(call, vllm_config, (alias, canonical))
        if problem is not None:
            add_problem(problems, what, problem, alias, "it")
    problems.raise_any()


def check_kv_l8_worker_disagreement(backend: BackendUnderTest) -> None:
    """KV-L8: a worker pinned to another layout than the control plane's refuses it.

    The neighbour of the worker-alias control: a worker pinned to an alias of the
    control plane's layout must agree, so one pinned to a genuinely different layout
    (consistent with the backend too, so nothing but the disagreement can refuse it)
    must still raise, naming both; else accepting the alias proves nothing.
    """
    clause = "KV-L8"
    where = Where(clause, backend=backend.name)
    compat.require_omni(clause)
    need = declared_need(clause, backend)
    consistent = layouts_for(need, consistent=True)
    sent_name, pinned = consistent[0], consistent[-1]
    worker = pinned_config(pinned)
    sent = compat.kv_cache_config_with_layout(sent_name)
    what = (f"a worker whose CacheConfig.kv_cache_layout={pinned!r} must refuse the control "
            f"plane's {sent_name!r} (another layout, not an alias of it)")
    problem = refusal_problem(partial(compat.adopt_layout, worker, sent), worker,
                              (pinned, sent_name))
    if problem is not None:
        detail, expected, actual = problem
        raise where.fail(f"{what}, but adoption {detail}", layout=pinned, expected=expected,
                         actual=actual)


def check_kv_l8_worker_alias(backend: BackendUnderTest) -> None:
    """KV-L8: a worker pinned to an alias of the control plane's layout agrees with it."""
    clause = "KV-L8"
    where = Where(clause, backend=backend.name)
    compat.require_omni(clause)
    need = declared_need(clause, backend)
    aliases = compat.layout_aliases()
    usable = {a: c for a, c in aliases.items() if oracle.is_block_outermost(c) == need}
    if not usable:
        listing = ", ".join(f"{a}->{c}" for a, c in aliases.items()) or "none"
        raise where.skip("no legacy alias names a layout consistent with this backend "
                         f"(aliases: {listing}), so no control plane pins one",
                         SkipKind.NOT_APPLICABLE)
    problems = Problems(where)
    for alias, canonical in usable.items():
        worker = pinned_config(alias)
        sent = compat.kv_cache_config_with_layout(canonical)
        what = (f"a worker whose CacheConfig.kv_cache_layout={alias!r} (alias of {canonical}) "
                f"must adopt the control plane's {canonical!r}")
        problem = kept_problem(partial(compat.adopt_layout, worker, sent), worker, canonical,
                               (alias, canonical))
        if problem is None:
            got = worker.cache_config.get_resolved_kv_cache_layout()
            if layout_name(got) != canonical:
                problem = ("left get_resolved_kv_cache_layout() at another layout", canonical,
                           layout_name(got))
        if problem is not None:
            add_problem(problems, what, problem, alias, "it")
    problems.raise_any()


def _l8_env(backend: BackendUnderTest, device: str, *, consistent: bool) -> None:
    clause = "KV-L8"
    where = Where(clause, backend=backend.name)
    compat.require_omni(clause)
    need = declared_need(clause, backend)
    problems = Problems(where)
    add_env_var_problems(problems, need, device, consistent=consistent)
    problems.raise_any()


def check_kv_l8_env_honoured(backend: BackendUnderTest, device: str = "cpu") -> None:
    """KV-L8: ``VLLM_KV_CACHE_LAYOUT`` consistent with the backend is honoured."""
    _l8_env(backend, device, consistent=True)


def check_kv_l8_env_refused(backend: BackendUnderTest, device: str = "cpu") -> None:
    """KV-L8: ``VLLM_KV_CACHE_LAYOUT`` contradicting the backend is refused."""
    _l8_env(backend, device, consistent=False)
