"""One way to build a Conductor: a model, its hardware, the instances, and the block geometry.

    conductor = build_conductor(
        model=MODELS["llama3-70b"], hardware=HARDWARE["8xA800"],
        prefill_instances=["prefill-0", "prefill-1"], decode_instances=["decode-0"],
        hasher=BlockHasher(model="llama3-70b", block_size_tokens=512),
    )

Everything else has a documented default, each replaceable by an object of
your own:

    block size      the hasher's (`hasher`), or `block_size_tokens` where keys come from elsewhere
                    (a trace's `hash_ids`: 512); exactly one of the two
    router          `KvCacheCentricRouter` (Algorithm 1, threshold 1.5): any callable making a
                    `Router` from the `TtftEstimator` (a router class, `functools.partial(...)`)
    admission       `EarlyRejection()`
    predictor       `default_predictor(slo)`: `UniformDecodePredictor(decode_s=DEFAULT_DECODE_S,
                    step_s=slo.tbt_s)` (the paper's t_d; contexts grow at the TBT objective's pace);
                    `sim.spec.build_conductor` takes the same one, with its `decode_s`
    slo             `Slo()`: TTFT 30 s, TBT 100 ms
    cost models     `PrefillCostModel` and `DecodeCostModel` of the model on its hardware, the
                    transfer model at the hardware's NIC; `decode_hardware` when decode runs on
                    other GPUs; a fitted `prefill` / `step_model` replaces them
    decode limits   the decode hardware's HBM beside the weights (a ConfigError where the weights leave no
                    room for KV), no batch or context limit

Names of policies ("kvcache_centric", "baseline", ...) belong to the command
lines and configs that read them (`examples/serving/registry.py`), not here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable

from mooncake._checks import binding_error, shown
from mooncake.cache.hashing import BlockHasher
from mooncake.errors import ConfigError
from mooncake.sched.admission import AdmissionPolicy, EarlyRejection
from mooncake.sched.conductor import Conductor
from mooncake.sched.cost import Hardware, ModelShape, PrefillCostModel, PrefillModel, TransferCostModel
from mooncake.sched.join import DecodeLimits
from mooncake.sched.predictor import DEFAULT_DECODE_S, DEFAULT_STEP_S, LoadPredictor, UniformDecodePredictor
from mooncake.sched.router import KvCacheCentricRouter, Router, TtftEstimator
from mooncake.sched.step import AnalyticStepModel, DecodeCostModel
from mooncake.types import InstanceId, Slo

__all__ = ["RouterFactory", "build_conductor", "check_router_factory", "default_predictor", "ttft_estimator"]

RouterFactory = Callable[[TtftEstimator], Router]  # a router class, or any callable making one from the estimator


def ttft_estimator(
    model: ModelShape,
    hardware: Hardware,
    *,
    prefill: PrefillModel | None = None,
    transfer: TransferCostModel | None = None,
    first_token_overhead_s: float = 0.0,
) -> TtftEstimator:
    """The router's TTFT estimator for `model` on `hardware`: the analytic prefill model (or `prefill`),
    transfers at the hardware's NIC (or `transfer`), the model's KV bytes per token, and the serving
    path's fixed latency to the first token."""
    return TtftEstimator(
        first_token_overhead_s=first_token_overhead_s,
        prefill=prefill if prefill is not None else PrefillCostModel(model=model, hardware=hardware),
        transfer=transfer
        if transfer is not None
        else TransferCostModel(bandwidth_bytes_per_s=hardware.nic_bytes_per_s),
        kv_bytes_per_token=model.kv_bytes_per_token,
    )


def default_predictor(slo: object, decode_s: float = DEFAULT_DECODE_S) -> UniformDecodePredictor:
    """The paper's uniform decode load predictor, every request decoding for `decode_s` (t_d), its context grown
    at the pace the TBT check holds a batch to (`slo.tbt_s`), so the prediction counts contexts as the check does.
    A `slo` that is no `Slo` has no pace: `DEFAULT_STEP_S` (the Conductor refuses such a slo, naming it)."""
    pace = slo.tbt_s if isinstance(slo, Slo) else DEFAULT_STEP_S
    return UniformDecodePredictor(decode_s=decode_s, step_s=pace)


def check_router_factory(router: object) -> None:
    """A router factory is called with the TTFT estimator alone: say so before calling it, instead of the
    TypeError a class with another constructor (or a router instance given for its class) would raise. The one
    check: `build_conductor` makes it, and so may a caller that reads a factory by name before building.

    Raises:
        ConfigError: `router` is not callable, cannot be called with one argument, or is a class with no route().
    """
    if not callable(router):
        raise ConfigError(f"router must be a router class or factory taking the TTFT estimator, got {shown(router)}")
    if (error := binding_error(router, object())) is not None:
        name = getattr(router, "__qualname__", repr(router))
        parameters = ", ".join(inspect.signature(router).parameters)
        raise ConfigError(
            f"router factory {name}({parameters}) cannot be called with the TTFT estimator alone ({error}): a router "
            "factory takes the estimator and returns a router (see mooncake.sched.build.RouterFactory)"
        )
    if isinstance(router, type) and not callable(getattr(router, "route", None)):
        # a class that is no router (dict, say) would fail inside its own constructor, or only at the check
        # of the instance it made
        raise ConfigError(f"router class {router.__qualname__} has no route() method: it is not a router (see Router)")


def build_conductor(
    *,
    model: ModelShape,
    hardware: Hardware,
    prefill_instances: Iterable[str],
    decode_instances: Iterable[str],
    hasher: BlockHasher | None = None,
    block_size_tokens: int | None = None,
    router: RouterFactory = KvCacheCentricRouter,
    admission: AdmissionPolicy | None = None,
    predictor: LoadPredictor | None = None,
    slo: Slo | None = None,
    decode_hardware: Hardware | None = None,
    prefill: PrefillModel | None = None,
    step_model: AnalyticStepModel | None = None,
    transfer: TransferCostModel | None = None,
    decode_limits: DecodeLimits | None = None,
    transfers: bool = True,
    first_token_overhead_s: float = 0.0,
    seed: int = 0,
    prefill_cache_blocks: int | None = None,
) -> Conductor:
    """A Conductor with its instances added (defaults in the module docstring).

    Args:
        transfers: False when instances cannot fetch each other's blocks (no global pool).
        prefill_cache_blocks: the most blocks each prefill instance's cache holds (None: no bound;
            `Conductor.add_prefill_instances`).
        first_token_overhead_s: the serving path's fixed latency from a prefill's end to its first token,
            part of every TTFT estimate.

    Raises:
        ConfigError: a model or hardware that is not a `ModelShape` / `Hardware` (a preset's name, say), neither
            or both of `hasher` and `block_size_tokens`, a hasher that is no `BlockHasher`, a block size that is
            not an integer >= 1, an instance list given as one string (or no collection), an instance listed
            twice, a `prefill` or `transfer` model without its method, `transfers` not a bool, a router
            factory that cannot be called with the TTFT estimator alone, a class that is no router, or, without
            `decode_limits`, decode hardware whose HBM leaves no room for the model's KV beside its weights
            (`DecodeCostModel.require_capacity_tokens`: every request would be refused as too long).
    """
    for name, value, kind, table in (
        ("model", model, ModelShape, "MODELS"),
        ("hardware", hardware, Hardware, "HARDWARE"),
        ("decode_hardware", decode_hardware if decode_hardware is not None else hardware, Hardware, "HARDWARE"),
    ):
        if not isinstance(value, kind):  # a preset's name, most likely: say where the object is
            raise ConfigError(
                f"{name} must be a {kind.__name__} (e.g. mooncake.sched.{table}[name]), got {shown(value)}"
            )
    if (hasher is None) == (block_size_tokens is None):
        raise ConfigError(
            f"give the block geometry once: a hasher or block_size_tokens, got hasher={shown(hasher)}, "
            f"block_size_tokens={shown(block_size_tokens)}"
        )
    if hasher is not None and not isinstance(hasher, BlockHasher):
        raise ConfigError(f"hasher must be a mooncake.cache.hashing.BlockHasher, got {shown(hasher)}")
    block = hasher.block_size_tokens if hasher is not None else block_size_tokens
    assert block is not None
    for name, instances in (("prefill_instances", prefill_instances), ("decode_instances", decode_instances)):
        if isinstance(instances, str):  # iterating it would add one instance per character
            raise ConfigError(f"{name} must be a collection of instance ids, got the string {shown(instances)}")
        if not isinstance(instances, Iterable):
            raise ConfigError(f"{name} must be a collection of instance ids, got {shown(instances)}")
    check_router_factory(router)
    decode_gpus = decode_hardware if decode_hardware is not None else hardware
    decode_cost = DecodeCostModel(model=model, hardware=decode_gpus)
    if decode_limits is None:
        # A node sized by HBM with no room for KV would refuse every request as too long: refuse the config instead.
        field = "decode_hardware" if decode_hardware is not None else "hardware"
        decode_limits = DecodeLimits(kv_capacity_tokens=decode_cost.require_capacity_tokens(field))
    slo = slo if slo is not None else Slo()
    if predictor is None:
        predictor = default_predictor(slo)
    conductor = Conductor(
        router=router(
            ttft_estimator(
                model, hardware, prefill=prefill, transfer=transfer, first_token_overhead_s=first_token_overhead_s
            )
        ),
        step_model=step_model if step_model is not None else decode_cost,
        admission=admission if admission is not None else EarlyRejection(),
        predictor=predictor,
        slo=slo,
        block_size_tokens=block,
        transfers=transfers,
        seed=seed,
    )
    conductor.add_prefill_instances(
        (InstanceId(instance) for instance in prefill_instances), cache_blocks=prefill_cache_blocks
    )
    conductor.add_decode_instances((InstanceId(instance) for instance in decode_instances), decode_limits)
    return conductor
