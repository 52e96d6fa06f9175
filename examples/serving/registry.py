"""Policies by name: the one table every example's command line and config reads.

The library takes policy objects (`mooncake.sched.build.build_conductor`); the
names people type — `--router kvcache_centric`, `[policy] admission =
"baseline"` — are resolved here, once. A router may also be named
`FILE.py:FACTORY` or `package.module:FACTORY`: a callable taking the
cluster's `TtftEstimator` and returning a `Router` (docs/simulation.md shows
one).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

from mooncake.errors import ConfigError
from mooncake.sched.admission import AdmissionPolicy, BaselineAdmission, EarlyRejection, predictive_early_rejection
from mooncake.sched.build import RouterFactory, check_router_factory
from mooncake.sched.predictor import ExpectedOutputPredictor, LoadPredictor, UniformDecodePredictor, uniform_decode_s
from mooncake.sched.router import (
    DEFAULT_THRESHOLD,
    KvCacheCentricRouter,
    LoadBalancingRouter,
    RandomRouter,
    RoundRobinRouter,
    local_cache_aware_router,
)
from mooncake.types import Request, Slo

__all__ = [
    "ADMISSIONS",
    "NO_TRANSFER_ROUTERS",
    "PREDICTORS",
    "ROUTERS",
    "THRESHOLD_ROUTERS",
    "admission",
    "predictor",
    "reads_threshold",
    "router",
    "router_problem",
]

# name → the router factory, given the KV-cache-centric router's kvcache_balancing_threshold
ROUTERS: dict[str, Callable[[float], RouterFactory]] = {
    "random": lambda _threshold: RandomRouter,
    "round_robin": lambda _threshold: RoundRobinRouter,
    "load_balancing": lambda _threshold: LoadBalancingRouter,
    "local_cache_aware": lambda _threshold: local_cache_aware_router,
    "kvcache_centric": lambda threshold: functools.partial(KvCacheCentricRouter, threshold=threshold),
}
# The built-in routers `router` gives the threshold to; a FILE.py:FACTORY router is not given it.
THRESHOLD_ROUTERS = frozenset({"kvcache_centric"})
# Those that never plan a transfer: of the built-in ones only a router the threshold reaches does, and only at a
# finite one (local_cache_aware is kvcache_centric at an infinite one). A FILE.py:FACTORY router may: it is not
# presumed either way.
NO_TRANSFER_ROUTERS = frozenset(ROUTERS) - THRESHOLD_ROUTERS

ADMISSIONS: dict[str, Callable[[], AdmissionPolicy]] = {
    "baseline": BaselineAdmission,
    "early_rejection": EarlyRejection,
    "predictive_early_rejection": predictive_early_rejection,
}


# name → the decode load predictor of `predictive_early_rejection`, given the workload and the SLOs
PREDICTORS: dict[str, Callable[[Sequence[Request], Slo], LoadPredictor]] = {
    # the paper's: every request decodes for t_d = the workload's mean output x TBT objective, its context growing
    # a token per TBT objective (as expected_output's)
    "uniform": lambda requests, slo: UniformDecodePredictor(
        decode_s=uniform_decode_s((r.output_length for r in requests), slo.tbt_s), step_s=slo.tbt_s
    ),
    # each request for its own output x TBT objective
    "expected_output": lambda _requests, slo: ExpectedOutputPredictor(step_s=slo.tbt_s),
}


def predictor(name: str, requests: Sequence[Request], slo: Slo) -> LoadPredictor:
    """The load predictor called `name` (one of `PREDICTORS`) for a replay of `requests` under `slo`.

    Raises:
        ConfigError: an unknown name.
    """
    if name not in PREDICTORS:
        raise ConfigError(f"predictor must be one of {', '.join(PREDICTORS)}, got {name!r}")
    return PREDICTORS[name](requests, slo)


def reads_threshold(router: str, *, global_pool: bool) -> bool:
    """Whether a replay routed by `router` reads the threshold: a router of `THRESHOLD_ROUTERS`, with a global pool
    (with local caches nothing is transferred, so no holder's prefix is weighed against it)."""
    return global_pool and router in THRESHOLD_ROUTERS


_ROUTER_NAMES = f"must be one of {', '.join(ROUTERS)} or FILE.py:FACTORY"


def router(name: str, *, threshold: float = DEFAULT_THRESHOLD) -> RouterFactory:
    """The router factory called `name`: one of `ROUTERS`, or FILE.py:FACTORY / package.module:FACTORY.

    Raises:
        ConfigError: an unknown name, or a FACTORY that cannot be found or called.
    """
    if name in ROUTERS:
        return ROUTERS[name](threshold)
    where, colon, attribute = name.rpartition(":")
    if not colon or not where or not attribute:
        raise ConfigError(f"router {_ROUTER_NAMES}, got {name!r}")
    if where.endswith(".py"):
        module = _load_file(Path(where))
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as error:
            if error.name is None or not (where == error.name or where.startswith(error.name + ".")):
                raise  # the module was found and failed inside: its own traceback says where
            raise ConfigError(f"router module {where} not found ({error.name} is not importable)") from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ConfigError(f"{where} has no callable {attribute!r}")
    check_router_factory(factory)  # as build_conductor will: refused as the name is read, not at the build
    return factory  # type: ignore[no-any-return]


def router_problem(name: str) -> str | None:
    """Why `name` names no router factory `router` can make (None: it names one), for a config file's field
    check. A FILE.py:FACTORY is loaded to find out, as `router` would load it."""
    try:
        router(name)
    except ConfigError as error:
        # the field's check names the value itself: an unknown name is told only what names are
        return _ROUTER_NAMES if ":" not in name else str(error)
    return None


def _load_file(path: Path) -> ModuleType:
    """The module of a router file, loaded as running it would: its folder first on `sys.path` (its sibling
    modules import), the module in `sys.modules` (dataclasses and pickling look it up there) under a name of its
    own (a file named like a library module shadows nothing). Once per process: a config's check of the name, the
    build of the router and a copy of the config find the module loaded.

    Raises:
        ConfigError: the file is missing, or is not valid Python (naming the line).
    """
    if not path.is_file():
        raise ConfigError(f"router file {path} not found")
    name = f"mooncake_router_{path.stem}_{abs(hash(str(path.resolve()))):x}"
    if (loaded := sys.modules.get(name)) is not None:
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"router file {path} is not a Python module")
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as error:
        del sys.modules[name]
        raise ConfigError(f"router file {path}, line {error.lineno}: {error.msg}") from None
    except BaseException:
        del sys.modules[name]
        raise  # the file ran and failed: its own traceback says where
    return module


def admission(name: str) -> AdmissionPolicy:
    """The admission policy called `name` (one of `ADMISSIONS`).

    Raises:
        ConfigError: an unknown name.
    """
    if name not in ADMISSIONS:
        raise ConfigError(f"admission must be one of {', '.join(ADMISSIONS)}, got {name!r}")
    return ADMISSIONS[name]()
