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
from collections.abc import Callable
from pathlib import Path

from mooncake.errors import ConfigError
from mooncake.sched.admission import AdmissionPolicy, BaselineAdmission, EarlyRejection, predictive_early_rejection
from mooncake.sched.build import RouterFactory
from mooncake.sched.router import (
    DEFAULT_THRESHOLD,
    KvCacheCentricRouter,
    LoadBalancingRouter,
    RandomRouter,
    RoundRobinRouter,
    local_cache_aware_router,
)

__all__ = ["ADMISSIONS", "ROUTERS", "admission", "router"]

# name → the router factory, given the KV-cache-centric router's kvcache_balancing_threshold
ROUTERS: dict[str, Callable[[float], RouterFactory]] = {
    "random": lambda _threshold: RandomRouter,
    "round_robin": lambda _threshold: RoundRobinRouter,
    "load_balancing": lambda _threshold: LoadBalancingRouter,
    "local_cache_aware": lambda _threshold: local_cache_aware_router,
    "kvcache_centric": lambda threshold: functools.partial(KvCacheCentricRouter, threshold=threshold),
}

ADMISSIONS: dict[str, Callable[[], AdmissionPolicy]] = {
    "baseline": BaselineAdmission,
    "early_rejection": EarlyRejection,
    "predictive_early_rejection": predictive_early_rejection,
}


def router(name: str, *, threshold: float = DEFAULT_THRESHOLD) -> RouterFactory:
    """The router factory called `name`: one of `ROUTERS`, or FILE.py:FACTORY / package.module:FACTORY.

    Raises:
        ConfigError: an unknown name, or a FACTORY that cannot be found or called.
    """
    if name in ROUTERS:
        return ROUTERS[name](threshold)
    where, colon, attribute = name.rpartition(":")
    if not colon or not where or not attribute:
        raise ConfigError(f"router must be one of {', '.join(ROUTERS)} or FILE.py:FACTORY, got {name!r}")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(where).stem, where)
        if spec is None or spec.loader is None or not Path(where).is_file():
            raise ConfigError(f"router file {where} not found")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
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
    return factory  # type: ignore[no-any-return]


def admission(name: str) -> AdmissionPolicy:
    """The admission policy called `name` (one of `ADMISSIONS`).

    Raises:
        ConfigError: an unknown name.
    """
    if name not in ADMISSIONS:
        raise ConfigError(f"admission must be one of {', '.join(ADMISSIONS)}, got {name!r}")
    return ADMISSIONS[name]()
