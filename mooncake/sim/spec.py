"""What a simulated disaggregated cluster is: its spec, and the Conductor whose estimates are its truth.

`ClusterSpec` names the nodes (prefill, decode, chunked-pipeline groups), the
model and hardware, the caches and the network; its cost models (`prefill_cost`,
`decode_cost`, `transfer_cost`) are what the simulator charges.
`build_conductor` makes a Conductor on those same cost models, with a router
and an admission policy chosen by name (`ROUTERS`, `ADMISSIONS`) or a router
factory of your own, and registers the spec's instances with it.

Invariants: a spec is valid once built (every field checked, `cpp_group_size`
divides `num_prefill`), and never changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs

from mooncake.errors import ConfigError
from mooncake.sched.admission import AdmissionPolicy, BaselineAdmission, EarlyRejection, predictive_early_rejection
from mooncake.sched.conductor import Conductor
from mooncake.sched.cost import (
    ChunkedPipelineCost,
    Hardware,
    ModelShape,
    PrefillCostModel,
    PrefillModel,
    TransferCostModel,
)
from mooncake.sched.join import DecodeLimits
from mooncake.sched.predictor import UniformDecodePredictor
from mooncake.sched.router import (
    KvCacheCentricRouter,
    LoadBalancingRouter,
    RandomRouter,
    Router,
    TtftEstimator,
    local_cache_aware_router,
)
from mooncake.sched.step import DecodeCostModel
from mooncake.types import InstanceId, Slo

__all__ = ["ADMISSIONS", "ClusterSpec", "ROUTERS", "build_conductor"]

ROUTERS = ("random", "load_balancing", "local_cache_aware", "kvcache_centric")
ADMISSIONS = ("baseline", "early_rejection", "predictive_early_rejection")


def _at_least(minimum: int) -> Callable[[object, attrs.Attribute[int], int], None]:
    def check(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"ClusterSpec.{attribute.name} must be an integer >= {minimum}, got {value!r}")

    return check


@attrs.frozen(kw_only=True)
class ClusterSpec:
    """A simulated cluster.

    Attributes:
        num_prefill, num_decode: nodes of each kind.
        model: the model served; prefill_hardware / decode_hardware: one node's GPUs.
        block_size_tokens: tokens per block key (512 for the published traces).
        cache_capacity_tokens: KV tokens each prefill node's cache (DRAM + SSD) holds.
        global_pool: any node may fetch any block (Mooncake Store); False: each node only its own cache.
        mfu: model FLOPs utilisation of prefill.
        network_bytes_per_s: KV transfer bandwidth (default: the prefill hardware's NIC).
        cpp_group_size: prefill nodes per chunked-pipeline group (1: no CPP); divides num_prefill.
        cpp_chunk_tokens: the CPP chunk.
        inline_prefill_tokens: prompts up to this long may be prefilled inside a decode batch (0: never).
        max_decode_batch_size: requests a decode node decodes at once (None: as many as its HBM holds).
        analytic_decode: advance decode batches analytically (False: step by step).
        sample_interval_s: how often load over time is sampled.
    """

    num_prefill: int = attrs.field(validator=_at_least(1))
    num_decode: int = attrs.field(validator=_at_least(1))
    model: ModelShape
    prefill_hardware: Hardware
    decode_hardware: Hardware
    block_size_tokens: int = attrs.field(default=512, validator=_at_least(1))
    cache_capacity_tokens: int = attrs.field(default=50_000 * 512, validator=_at_least(0))
    global_pool: bool = True
    mfu: float = 0.5
    network_bytes_per_s: float | None = None
    cpp_group_size: int = attrs.field(default=1, validator=_at_least(1))
    cpp_chunk_tokens: int = attrs.field(default=4096, validator=_at_least(1))
    inline_prefill_tokens: int = attrs.field(default=0, validator=_at_least(0))
    max_decode_batch_size: int | None = attrs.field(default=None, validator=attrs.validators.optional(_at_least(1)))
    analytic_decode: bool = True
    sample_interval_s: float = 1.0

    def __attrs_post_init__(self) -> None:
        if self.num_prefill % self.cpp_group_size:
            raise ConfigError(
                f"ClusterSpec.cpp_group_size={self.cpp_group_size} must divide num_prefill={self.num_prefill}"
            )
        for name in ("mfu", "sample_interval_s", "network_bytes_per_s"):
            value = getattr(self, name)
            if value is None and name == "network_bytes_per_s":
                continue  # the prefill hardware's NIC
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
                raise ConfigError(f"ClusterSpec.{name} must be a finite number > 0, got {value!r}")

    @property
    def num_prefill_instances(self) -> int:
        """Prefill instances the Conductor sees (CPP groups count once)."""
        return self.num_prefill // self.cpp_group_size

    @property
    def prefill_cost(self) -> PrefillModel:
        """One prefill instance's prefill time (a CPP group's when grouped)."""
        base = PrefillCostModel(model=self.model, hardware=self.prefill_hardware, mfu=self.mfu)
        if self.cpp_group_size == 1:
            return base
        return ChunkedPipelineCost(base=base, group_size=self.cpp_group_size, chunk_tokens=self.cpp_chunk_tokens)

    @property
    def decode_cost(self) -> DecodeCostModel:
        return DecodeCostModel(model=self.model, hardware=self.decode_hardware)

    @property
    def decode_limits(self) -> DecodeLimits:
        """What one decode node holds: its HBM's KV beside the weights, and its batch slots."""
        return DecodeLimits(
            kv_capacity_tokens=self.decode_cost.capacity_tokens(), max_batch_size=self.max_decode_batch_size
        )

    @property
    def transfer_cost(self) -> TransferCostModel:
        bandwidth = (
            self.network_bytes_per_s if self.network_bytes_per_s is not None else self.prefill_hardware.nic_bytes_per_s
        )
        return TransferCostModel(bandwidth_bytes_per_s=bandwidth)


def build_conductor(
    spec: ClusterSpec,
    *,
    router: str | Callable[[TtftEstimator], Router] = "kvcache_centric",
    admission: str = "early_rejection",
    threshold: float = 1.5,
    slo: Slo | None = None,
    decode_s: float = 10.0,
    seed: int = 0,
) -> Conductor:
    """A Conductor with the spec's cost models (so its estimates are the simulator's truth).

    Args:
        router: one of `ROUTERS`, or a factory making your own `Router` from the spec's estimator.
        admission: one of `ADMISSIONS`.
        threshold: kvcache_balancing_threshold of the KV-cache-centric router.
        decode_s: the uniform decode duration of the paper's load predictor.
    """
    estimator = TtftEstimator(
        prefill=spec.prefill_cost, transfer=spec.transfer_cost, kv_bytes_per_token=spec.model.kv_bytes_per_token
    )
    routers: dict[str, Callable[[], Router]] = {
        "random": lambda: RandomRouter(estimator),
        "load_balancing": lambda: LoadBalancingRouter(estimator),
        "local_cache_aware": lambda: local_cache_aware_router(estimator),
        "kvcache_centric": lambda: KvCacheCentricRouter(estimator=estimator, threshold=threshold),
    }
    admissions: dict[str, Callable[[], AdmissionPolicy]] = {
        "baseline": BaselineAdmission,
        "early_rejection": EarlyRejection,
        "predictive_early_rejection": predictive_early_rejection,
    }
    if isinstance(router, str) and router not in routers:
        raise ConfigError(f"router must be one of {ROUTERS} or a factory, got {router!r}")
    if admission not in admissions:
        raise ConfigError(f"admission must be one of {ADMISSIONS}, got {admission!r}")
    if not spec.global_pool and router == "kvcache_centric":
        router = "local_cache_aware"  # without a global pool there is nothing to transfer from
    conductor = Conductor(
        router=routers[router]() if isinstance(router, str) else router(estimator),
        step_model=spec.decode_cost,
        admission=admissions[admission](),
        predictor=UniformDecodePredictor(decode_s=decode_s),
        slo=slo or Slo(),
        block_size_tokens=spec.block_size_tokens,
        seed=seed,
    )
    for i in range(spec.num_prefill_instances):
        conductor.add_prefill_instance(InstanceId(f"prefill-{i}"))
    for i in range(spec.num_decode):
        conductor.add_decode_instance(InstanceId(f"decode-{i}"), spec.decode_limits)
    return conductor
