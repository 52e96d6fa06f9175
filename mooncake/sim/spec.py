"""What a simulated disaggregated cluster is: its spec, and the Conductor whose estimates are its truth.

`ClusterSpec` names the nodes (prefill, decode, chunked-pipeline groups), the
model and hardware, the caches and the network; its cost models (`prefill_cost`,
`decode_cost`, `transfer_cost`) are what the simulator charges.
`build_conductor` makes a Conductor on those same cost models (through the
library's `mooncake.sched.build.build_conductor`), with the router and the
admission policy given as objects, and registers the spec's instances with it.

Invariants: a spec is valid once built (every field checked, `cpp_group_size`
divides `num_prefill` and is at most the model's layers, a decode node holds
some KV, its batch slots given once), and never changes.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from mooncake._checks import require_number, shown
from mooncake.errors import ConfigError
from mooncake.sched.admission import AdmissionPolicy
from mooncake.sched.build import RouterFactory, default_predictor
from mooncake.sched.build import build_conductor as build
from mooncake.sched.conductor import Conductor
from mooncake.sched.cost import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_MFU,
    ChunkedPipelineCost,
    Hardware,
    ModelShape,
    PrefillCostModel,
    PrefillModel,
    TransferCostModel,
)
from mooncake.sched.join import DecodeLimits
from mooncake.sched.predictor import DEFAULT_DECODE_S, LoadPredictor
from mooncake.sched.router import KvCacheCentricRouter
from mooncake.sched.step import AnalyticStepModel, DecodeCostModel
from mooncake.types import Slo
from mooncake.workload.trace import TRACE_BLOCK_SIZE_TOKENS

__all__ = ["ClusterSpec", "DEFAULT_CACHE_BLOCKS", "build_conductor"]

DEFAULT_CACHE_BLOCKS = 10_000
"""A simulated prefill node's KV cache, in 512-token trace blocks: ~1.6 TB of LLaMA3-70B KV, a node's DRAM."""


def _at_least(minimum: int) -> Callable[[object, attrs.Attribute[int], int], None]:
    def check(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"ClusterSpec.{attribute.name} must be an integer >= {minimum}, got {shown(value)}")

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
        cpp_group_size: prefill nodes per chunked-pipeline group (1: no CPP); divides num_prefill, and is at
            most the model's layers (a stage holds at least one).
        cpp_chunk_tokens: the CPP chunk.
        inline_prefill_tokens: prompts up to this long may be prefilled inside a decode batch (0: never).
        max_decode_batch_size: requests a decode node decodes at once (None: as many as its HBM holds); not with
            `decode_node_limits`, whose `max_batch_size` says it.
        analytic_decode: advance decode batches analytically (False: step by step).
        sample_interval_s: how often load over time is sampled.
        prefill_model: a prefill instance's time fitted to real engines (`FittedPrefillModel`), used as
            is in place of the analytic model of `model`, the prefill hardware and `mfu` (for a CPP
            group, the group's time).
        step_model: a decode node's step time fitted to real engines (`FittedStepModel`), in place of
            the analytic `DecodeCostModel`: an `AnalyticStepModel`, with a `roofline()` beside its `step_s`
            (the simulator's analytic batch runs on it).
        join_step_model: the step model a decode node's join check asks (`sched.join.check_join`'s TBT test),
            where it is not the one its steps take (None: `decode_cost`, both): a real decode engine judges a
            join with the model it was configured with, whatever its speed turns out to be. The example
            cluster's worker checks with the profile while validate.py's twin times its steps with the
            profile calibrated to the cluster's measured overheads.
        decode_node_limits: what one decode node holds (its engine's KV budget and batch slots), in
            place of its HBM beside the weights and `max_decode_batch_size` (then None). Without it, the decode
            hardware's HBM must hold some of the model's KV beside its weights.
        first_token_overhead_s: the serving path's fixed latency from a prefill's end to its first token
            at the client, beyond the modelled KV transfer (reports, the decode join, the gateway),
            measured on a real cluster (0: none). A request's simulated first token, the end of its TTFT, is
            its prefill's end plus this; its KV reaches the decode node this plus what the prefill did not
            hide of the KV stream after the prefill, and it joins the batch at the next step boundary. The
            example cluster's client gets the first token at that join (the decode worker sends it as it
            joins the request): a few ms later (the stream's unhidden part and the rest of the running step).
            An inline prefill, run in the decode batch itself, has no hand-off and pays none of it: its first
            token comes when its stall ends.
        admission_wait_s: how long a request rejected for room the decode side frees may wait for it before
            its prefill, in line (`sched.waiting.AdmissionQueue`, as the example cluster's gateway with its
            `[limits] admission_wait_s`); 0 (the paper's early rejection): rejected at once.
    """

    num_prefill: int = attrs.field(validator=_at_least(1))
    num_decode: int = attrs.field(validator=_at_least(1))
    model: ModelShape
    prefill_hardware: Hardware
    decode_hardware: Hardware
    block_size_tokens: int = attrs.field(default=TRACE_BLOCK_SIZE_TOKENS, validator=_at_least(1))
    cache_capacity_tokens: int = attrs.field(
        default=DEFAULT_CACHE_BLOCKS * TRACE_BLOCK_SIZE_TOKENS, validator=_at_least(0)
    )
    global_pool: bool = True
    mfu: float = DEFAULT_MFU
    network_bytes_per_s: float | None = None
    cpp_group_size: int = attrs.field(default=1, validator=_at_least(1))
    cpp_chunk_tokens: int = attrs.field(default=DEFAULT_CHUNK_TOKENS, validator=_at_least(1))
    inline_prefill_tokens: int = attrs.field(default=0, validator=_at_least(0))
    max_decode_batch_size: int | None = attrs.field(default=None, validator=attrs.validators.optional(_at_least(1)))
    analytic_decode: bool = True
    sample_interval_s: float = 1.0
    prefill_model: PrefillModel | None = None
    step_model: AnalyticStepModel | None = None
    join_step_model: AnalyticStepModel | None = None
    decode_node_limits: DecodeLimits | None = None
    first_token_overhead_s: float = attrs.field(default=0.0)
    admission_wait_s: float = attrs.field(default=0.0)

    @first_token_overhead_s.validator
    @admission_wait_s.validator
    def _check_overhead(self, attribute: attrs.Attribute[float], value: float) -> None:
        require_number(f"ClusterSpec.{attribute.name}", value, minimum=0)

    def __attrs_post_init__(self) -> None:
        kinds: tuple[tuple[str, type | tuple[type, ...]], ...] = (
            ("model", ModelShape),
            ("prefill_hardware", Hardware),
            ("decode_hardware", Hardware),
            ("global_pool", bool),
            ("analytic_decode", bool),
            ("decode_node_limits", (DecodeLimits, type(None))),
        )
        for name, kind in kinds:
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(f"ClusterSpec.{name} has the wrong type: {shown(getattr(self, name))}")
        # The simulator asks a step model for its roofline too (the analytic batch), not only its step_s.
        for name, methods in (
            ("prefill_model", ("prefill_s",)),
            ("step_model", ("step_s", "roofline")),
            ("join_step_model", ("step_s", "roofline")),
        ):
            model = getattr(self, name)
            for method in methods:
                if model is not None and not callable(getattr(model, method, None)):
                    raise ConfigError(
                        f"ClusterSpec.{name} must have a {method} method (a fitted model), got {shown(model)}"
                    )
        if self.decode_node_limits is not None and self.max_decode_batch_size is not None:
            raise ConfigError(
                f"ClusterSpec.max_decode_batch_size={self.max_decode_batch_size} and "
                f"decode_node_limits={self.decode_node_limits!r} are both set: the limits' max_batch_size is a "
                "decode node's batch slots, give only one"
            )
        if self.decode_node_limits is None:
            self._hbm_capacity_tokens()  # a node with no KV room would refuse every request as too long: refuse now
        if self.cpp_group_size > self.model.num_layers:
            raise ConfigError(
                f"ClusterSpec.cpp_group_size={self.cpp_group_size} exceeds the model's num_layers="
                f"{self.model.num_layers}: a stage holds at least one layer"
            )
        if self.num_prefill % self.cpp_group_size:
            raise ConfigError(
                f"ClusterSpec.cpp_group_size={self.cpp_group_size} must divide num_prefill={self.num_prefill}"
            )
        for name in ("mfu", "sample_interval_s", "network_bytes_per_s"):
            value = getattr(self, name)
            if value is not None or name != "network_bytes_per_s":  # None: the prefill hardware's NIC
                require_number(f"ClusterSpec.{name}", value, minimum=0, strict=True)
        if self.mfu > 1:
            raise ConfigError(f"ClusterSpec.mfu is a fraction of the peak, at most 1, got {shown(self.mfu)}")

    @property
    def num_prefill_instances(self) -> int:
        """Prefill instances the Conductor sees (CPP groups count once)."""
        return self.num_prefill // self.cpp_group_size

    @property
    def prefill_cache_blocks(self) -> int:
        """Blocks one prefill instance's cache holds (a CPP group pools its nodes' caches): the simulated node's
        pages, and the bound its Conductor counts queued prompts' blocks to. A capacity under one block caches
        nothing: 0."""
        return self.cache_capacity_tokens * self.cpp_group_size // self.block_size_tokens

    @property
    def prefill_cost(self) -> PrefillModel:
        """One prefill instance's prefill time (a CPP group's when grouped)."""
        if self.prefill_model is not None:
            return self.prefill_model
        base = PrefillCostModel(model=self.model, hardware=self.prefill_hardware, mfu=self.mfu)
        if self.cpp_group_size == 1:
            return base
        return ChunkedPipelineCost(base=base, group_size=self.cpp_group_size, chunk_tokens=self.cpp_chunk_tokens)

    @property
    def decode_cost(self) -> AnalyticStepModel:
        """One decode node's step time: the fitted `step_model`, else the analytic model of its hardware."""
        if self.step_model is not None:
            return self.step_model
        return DecodeCostModel(model=self.model, hardware=self.decode_hardware)

    @property
    def decode_join_cost(self) -> AnalyticStepModel:
        """The step model a decode node's join check asks: `join_step_model`, else `decode_cost`."""
        return self.join_step_model if self.join_step_model is not None else self.decode_cost

    @property
    def decode_limits(self) -> DecodeLimits:
        """What one decode node holds: `decode_node_limits`, else its HBM's KV beside the weights and its
        batch slots."""
        if self.decode_node_limits is not None:
            return self.decode_node_limits
        return DecodeLimits(kv_capacity_tokens=self._hbm_capacity_tokens(), max_batch_size=self.max_decode_batch_size)

    def _hbm_capacity_tokens(self) -> int:
        """The KV tokens a decode node's HBM holds beside the weights, at least 1 (else a ConfigError)."""
        decode = DecodeCostModel(model=self.model, hardware=self.decode_hardware)
        return decode.require_capacity_tokens("ClusterSpec.decode_hardware")

    @property
    def transfer_cost(self) -> TransferCostModel:
        bandwidth = (
            self.network_bytes_per_s if self.network_bytes_per_s is not None else self.prefill_hardware.nic_bytes_per_s
        )
        return TransferCostModel(bandwidth_bytes_per_s=bandwidth)


def build_conductor(
    spec: ClusterSpec,
    *,
    router: RouterFactory = KvCacheCentricRouter,
    admission: AdmissionPolicy | None = None,
    slo: Slo | None = None,
    decode_s: float | None = None,
    predictor: LoadPredictor | None = None,
    seed: int = 0,
) -> Conductor:
    """A Conductor on the spec's cost models (so its estimates are the simulator's truth), with the
    spec's instances: `prefill-0` …, `decode-0` ….

    Args:
        router: makes the `Router` from the spec's estimator (default: Algorithm 1, threshold 1.5).
        admission: default `EarlyRejection()`.
        decode_s: the uniform decode duration t_d of the paper's load predictor (default `DEFAULT_DECODE_S`;
            `sched.predictor.uniform_decode_s` gives a workload's), its contexts grown at the TBT objective's pace.
        predictor: the decode load predictor instead of the paper's (then no `decode_s`).

    Raises:
        ConfigError: both a `decode_s` and a `predictor`.
    """
    if predictor is not None and decode_s is not None:
        raise ConfigError("give a decode_s (the paper's uniform predictor's t_d) or a predictor, not both")
    if predictor is None:
        predictor = default_predictor(slo, DEFAULT_DECODE_S if decode_s is None else decode_s)
    return build(
        model=spec.model,
        hardware=spec.prefill_hardware,
        decode_hardware=spec.decode_hardware,
        prefill_instances=[f"prefill-{i}" for i in range(spec.num_prefill_instances)],
        decode_instances=[f"decode-{i}" for i in range(spec.num_decode)],
        block_size_tokens=spec.block_size_tokens,
        router=router,
        admission=admission,
        predictor=predictor,
        slo=slo,
        prefill=spec.prefill_cost,
        step_model=spec.decode_cost,
        transfer=spec.transfer_cost,
        decode_limits=spec.decode_limits,
        transfers=spec.global_pool,  # without a global pool there is nothing to transfer from
        first_token_overhead_s=spec.first_token_overhead_s,  # what the simulator charges, estimated alike
        prefill_cache_blocks=spec.prefill_cache_blocks,  # what the simulated node keeps, counted alike
        seed=seed,
    )
