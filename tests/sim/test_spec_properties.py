"""Properties of `mooncake.sim.spec`: a spec's Conductor is the spec, whole; one question, one answer.

`tests/sim/test_spec.py` checks instance counts, limits, the prefill cost's kind and the bandwidth. Here the rest
of the spec must reach the Conductor: the block size, the global pool (as `transfers`), the MFU and the CPP chunk
in the prefill cost, the first-token overhead, the ids, the predictor's t_d, the seed. Each derived quantity is
computed independently from the function the docstring names for it (the decode capacity from
`DecodeCostModel.capacity_tokens` of the decode hardware, whatever step model is fitted), and a hand-assembled
Conductor on those values decides exactly as the spec's does. A spec is valid once built and never changes: any
field made bad, at construction or through `attrs.evolve`, is a ConfigError naming `ClusterSpec.<field>` and
the value.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake._checks import shown
from mooncake.errors import ConfigError
from mooncake.sched.admission import BaselineAdmission, EarlyRejection
from mooncake.sched.build import build_conductor as library_build
from mooncake.sched.conductor import Conductor
from mooncake.sched.cost import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_MFU,
    HARDWARE,
    MODELS,
    ChunkedPipelineCost,
    FittedPrefillModel,
    PrefillCostModel,
    TransferCostModel,
)
from mooncake.sched.join import DecodeLimits
from mooncake.sched.predictor import DEFAULT_DECODE_S, UniformDecodePredictor
from mooncake.sched.router import KvCacheCentricRouter, LoadBalancingRouter, RandomRouter, TtftEstimator
from mooncake.sched.step import DecodeCostModel, FittedStepModel
from mooncake.sim.coupled import CoupledCluster, CoupledSpec
from mooncake.sim.spec import DEFAULT_CACHE_BLOCKS, ClusterSpec, build_conductor
from mooncake.types import InstanceId, Slo
from mooncake.workload.trace import TRACE_BLOCK_SIZE_TOKENS
from tests.sched.test_build_properties import decisions
from tests.strategies import request_streams

FITTED_PREFILL = FittedPrefillModel(coefficients=(0.01, 1e-4, 1e-9))
FITTED_STEP = FittedStepModel(coefficients=(0.001, 2e-4, 3e-7))


@st.composite
def specs(draw: st.DrawFn) -> ClusterSpec:
    """Valid specs over every field the Conductor reads, each either left to its default or drawn."""
    size = draw(st.integers(1, 3))
    fields: dict[str, Any] = {
        "num_prefill": size * draw(st.integers(1, 3)),
        "num_decode": draw(st.integers(1, 3)),
        "model": MODELS[draw(st.sampled_from(sorted(MODELS)))],
        "prefill_hardware": HARDWARE[draw(st.sampled_from(sorted(HARDWARE)))],
        "decode_hardware": HARDWARE[draw(st.sampled_from(sorted(HARDWARE)))],
        "cpp_group_size": size,
    }
    optional: dict[str, st.SearchStrategy[Any]] = {
        "block_size_tokens": st.sampled_from([1, 16, 64, 512]),
        "global_pool": st.booleans(),
        "mfu": st.floats(0.05, 1.0),
        "network_bytes_per_s": st.floats(1e8, 1e12),
        "cpp_chunk_tokens": st.integers(64, 4096),
        "max_decode_batch_size": st.integers(1, 64),
        "prefill_model": st.just(FITTED_PREFILL),
        "step_model": st.just(FITTED_STEP),
        "decode_node_limits": st.builds(
            DecodeLimits, kv_capacity_tokens=st.integers(0, 50_000), max_batch_size=st.none() | st.integers(1, 8)
        ),
        "first_token_overhead_s": st.sampled_from([0.0, 0.003, 0.5]),
    }
    for name, values in optional.items():
        if draw(st.booleans()):
            fields[name] = draw(values)
    if "decode_node_limits" in fields and "max_decode_batch_size" in fields:  # the batch slots are given once
        del fields[draw(st.sampled_from(["decode_node_limits", "max_decode_batch_size"]))]
    return ClusterSpec(**fields)


@st.composite
def build_options(draw: st.DrawFn) -> dict[str, Any]:
    """`sim.spec.build_conductor`'s keyword arguments, each absent (its default) or drawn."""
    options: dict[str, Any] = {}
    choices: dict[str, st.SearchStrategy[Any]] = {
        "router": st.sampled_from(
            [RandomRouter, LoadBalancingRouter, functools.partial(KvCacheCentricRouter, threshold=3.0)]
        ),
        "admission": st.sampled_from([EarlyRejection(predictive=True), BaselineAdmission()]),
        "slo": st.builds(Slo, ttft_s=st.sampled_from([0.05, 1.0]), tbt_s=st.sampled_from([0.02, 0.1])),
        "decode_s": st.floats(0.1, 60.0),
        "seed": st.integers(0, 2**32),
    }
    for name, values in choices.items():
        if draw(st.booleans()):
            options[name] = draw(values)
    if "decode_s" not in options and draw(st.booleans()):
        options["predictor"] = UniformDecodePredictor(decode_s=draw(st.floats(0.1, 60.0)))
    return options


def expected_prefill(spec: ClusterSpec) -> object:
    """One prefill instance's cost, from the fields the docstring names: the fitted model as is, else the
    analytic model of the model on the prefill hardware at the spec's MFU, pipelined over a CPP group."""
    if spec.prefill_model is not None:
        return spec.prefill_model
    base = PrefillCostModel(model=spec.model, hardware=spec.prefill_hardware, mfu=spec.mfu)
    if spec.cpp_group_size == 1:
        return base
    return ChunkedPipelineCost(base=base, group_size=spec.cpp_group_size, chunk_tokens=spec.cpp_chunk_tokens)


def expected_limits(spec: ClusterSpec) -> DecodeLimits:
    """One decode node's limits: the given ones, else the decode hardware's HBM beside the weights (as the analytic
    decode model computes it, whatever step model is fitted) and the batch slots."""
    if spec.decode_node_limits is not None:
        return spec.decode_node_limits
    capacity = DecodeCostModel(model=spec.model, hardware=spec.decode_hardware).capacity_tokens()
    return DecodeLimits(kv_capacity_tokens=capacity, max_batch_size=spec.max_decode_batch_size)


def by_hand(spec: ClusterSpec, options: dict[str, Any]) -> Conductor:
    """The Conductor `build_conductor(spec, **options)` documents, assembled from independently derived parts."""
    estimator = TtftEstimator(
        prefill=expected_prefill(spec),  # type: ignore[arg-type]
        transfer=TransferCostModel(
            bandwidth_bytes_per_s=spec.network_bytes_per_s or spec.prefill_hardware.nic_bytes_per_s
        ),
        kv_bytes_per_token=spec.model.kv_bytes_per_token,
        first_token_overhead_s=spec.first_token_overhead_s,
    )
    predictor = options.get(
        "predictor",
        UniformDecodePredictor(
            decode_s=options.get("decode_s", DEFAULT_DECODE_S), step_s=options.get("slo", Slo()).tbt_s
        ),
    )
    conductor = Conductor(
        router=options.get("router", KvCacheCentricRouter)(estimator),
        step_model=spec.step_model or DecodeCostModel(model=spec.model, hardware=spec.decode_hardware),
        admission=options.get("admission", EarlyRejection()),
        predictor=predictor,
        slo=options.get("slo", Slo()),
        block_size_tokens=spec.block_size_tokens,
        transfers=spec.global_pool,
        seed=options.get("seed", 0),
    )
    conductor.add_prefill_instances(InstanceId(f"prefill-{i}") for i in range(spec.num_prefill // spec.cpp_group_size))
    conductor.add_decode_instances((InstanceId(f"decode-{i}") for i in range(spec.num_decode)), expected_limits(spec))
    return conductor


@given(specs(), build_options())
def test_a_specs_conductor_carries_every_field(spec: ClusterSpec, options: dict[str, Any]) -> None:
    """Block size, global pool, MFU, CPP chunk, overhead, ids, predictor, SLO, admission and router factory all
    reach the Conductor, each as the docstring derives it; the decode capacity is the one answer the analytic
    decode model of the decode hardware gives, for the spec and for the library's own default alike."""
    conductor = build_conductor(spec, **options)
    estimator = conductor.router.estimator  # type: ignore[attr-defined]
    assert spec.prefill_cost == expected_prefill(spec) and estimator.prefill == expected_prefill(spec)
    assert estimator.first_token_overhead_s == spec.first_token_overhead_s
    bandwidth = spec.network_bytes_per_s or spec.prefill_hardware.nic_bytes_per_s
    assert spec.transfer_cost == estimator.transfer == TransferCostModel(bandwidth_bytes_per_s=bandwidth)
    assert conductor.router == options.get("router", KvCacheCentricRouter)(estimator)
    assert conductor.block_size_tokens == spec.block_size_tokens
    assert conductor.transfers is spec.global_pool
    assert conductor.step_model == (spec.step_model or DecodeCostModel(model=spec.model, hardware=spec.decode_hardware))
    assert [v.instance_id for v in conductor.prefill_views] == [
        f"prefill-{i}" for i in range(spec.num_prefill_instances)
    ]
    assert spec.num_prefill_instances * spec.cpp_group_size == spec.num_prefill
    assert [v.instance_id for v in conductor.decode_views] == [f"decode-{i}" for i in range(spec.num_decode)]
    assert spec.decode_limits == expected_limits(spec)
    assert all(view.limits == expected_limits(spec) for view in conductor.decode_views)
    assert conductor.predictor == options.get(
        "predictor",
        UniformDecodePredictor(
            decode_s=options.get("decode_s", DEFAULT_DECODE_S), step_s=options.get("slo", Slo()).tbt_s
        ),
    )
    assert conductor.slo == options.get("slo", Slo(ttft_s=30.0, tbt_s=0.1))
    assert conductor.admission == options.get("admission", EarlyRejection())
    if spec.decode_node_limits is None and spec.max_decode_batch_size is None:
        # One question, one answer: the library's default for the same decode hardware is the spec's.
        library = library_build(
            model=spec.model,
            hardware=spec.prefill_hardware,
            decode_hardware=spec.decode_hardware,
            prefill_instances=[],
            decode_instances=["d"],
            block_size_tokens=spec.block_size_tokens,
        )
        assert library.decode_views[0].limits == spec.decode_limits


def test_the_defaults_are_the_documented_ones() -> None:
    """Trace blocks of 512 tokens, 10 000 of them per cache, a global pool, the default MFU and CPP chunk, no
    inline prefill, no batch cap, analytic decode, 1 s samples, no overhead and no admission wait."""
    spec = ClusterSpec(
        num_prefill=1, num_decode=1, model=MODELS["llama3-70b"], prefill_hardware=HARDWARE["8xA800"],
        decode_hardware=HARDWARE["8xA800"],
    )  # fmt: skip
    assert (spec.block_size_tokens, spec.cache_capacity_tokens) == (512, DEFAULT_CACHE_BLOCKS * 512)
    assert TRACE_BLOCK_SIZE_TOKENS == 512 and DEFAULT_CACHE_BLOCKS == 10_000
    assert spec.global_pool and spec.analytic_decode and spec.mfu == DEFAULT_MFU
    assert (spec.cpp_group_size, spec.cpp_chunk_tokens, spec.inline_prefill_tokens) == (1, DEFAULT_CHUNK_TOKENS, 0)
    assert spec.max_decode_batch_size is None and spec.sample_interval_s == 1.0
    assert spec.first_token_overhead_s == 0.0 and spec.admission_wait_s == 0.0
    assert spec.transfer_cost == TransferCostModel(bandwidth_bytes_per_s=HARDWARE["8xA800"].nic_bytes_per_s)


@given(specs(), build_options(), st.data())
def test_equal_specs_decide_as_the_hand_assembly(
    spec: ClusterSpec, options: dict[str, Any], data: st.DataObject
) -> None:
    """A spec rebuilt field for field, with the same options and seed, decides every request of a stream as the
    original does, and both as the Conductor assembled by hand from the independently derived parts."""
    stream = data.draw(request_streams(spec.block_size_tokens))
    first = decisions(build_conductor(spec, **options), stream)
    twin = ClusterSpec(**attrs.asdict(spec, recurse=False))
    assert twin == spec
    assert decisions(build_conductor(twin, **options), stream) == first
    assert decisions(by_hand(spec, options), stream) == first


class StepOnly:
    """A step model with a `step_s` but no `roofline` (which the simulator's analytic batch asks for)."""

    def step_s(self, batch_size: int, context_tokens: int) -> float:
        return 0.01


NOT_COUNTS = [-1, 0.5, 2.0, "2", None, True, math.nan]
NOT_RATES = [0, -1.0, math.nan, math.inf, -math.inf, "1", True]
NOT_SECONDS = [-1e-9, -1.0, math.nan, math.inf, "0", True, None]
BAD_FIELDS: dict[str, list[Any]] = {
    "num_prefill": NOT_COUNTS,
    "num_decode": NOT_COUNTS,
    "block_size_tokens": NOT_COUNTS,
    "cache_capacity_tokens": [-1, 1.0, "0", None, False],
    "cpp_group_size": NOT_COUNTS,
    "cpp_chunk_tokens": NOT_COUNTS,
    "inline_prefill_tokens": [-1, 1.5, "0", True],
    "max_decode_batch_size": [0, -3, 1.0, "8", True],
    "mfu": [0, -0.5, 1.0001, 2, math.nan, math.inf, "0.5", True, None],
    "network_bytes_per_s": NOT_RATES,
    "sample_interval_s": [*NOT_RATES, None],
    "first_token_overhead_s": NOT_SECONDS,
    "admission_wait_s": NOT_SECONDS,
    "model": ["llama3-70b", None, 70],
    "prefill_hardware": ["8xA800", None, MODELS["llama3-70b"]],
    "decode_hardware": ["8xH800", None],
    "global_pool": ["no", 0, 1, None],
    "analytic_decode": ["yes", 0, None],
    "decode_node_limits": [{"kv_capacity_tokens": 10}, 10],
    "prefill_model": ["fitted", 3, FITTED_STEP],
    "step_model": ["fitted", 3, FITTED_PREFILL, StepOnly()],
}


@pytest.mark.parametrize("field", sorted(BAD_FIELDS))
@settings(max_examples=15)
@given(spec=specs())
def test_a_bad_field_is_refused_and_the_spec_never_changes(spec: ClusterSpec, field: str) -> None:
    """Every bad value of a field, through `attrs.evolve` or at construction, is a ConfigError naming
    `ClusterSpec.<field>` and showing the value; the spec it came from is untouched, and no field can be set."""
    before = attrs.asdict(spec, recurse=False)
    for value in BAD_FIELDS[field]:
        with pytest.raises(ConfigError) as caught:
            attrs.evolve(spec, **{field: value})
        message = str(caught.value)
        assert f"ClusterSpec.{field}" in message and shown(value) in message, message
        with pytest.raises(ConfigError, match=rf"ClusterSpec\.{field}\b"):
            ClusterSpec(**{**before, field: value})
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            setattr(spec, field, value)
    assert attrs.asdict(spec, recurse=False) == before


@given(st.sampled_from(sorted(MODELS)), st.sampled_from(sorted(HARDWARE)), st.integers(1, 4), st.floats(10e9, 80e9))
def test_a_decode_node_must_hold_some_kv(model: str, hardware: str, num_gpus: int, hbm_bytes: float) -> None:
    """Decode hardware whose HBM holds no KV beside the model's weights (every request would be refused as too long)
    is a ConfigError naming `ClusterSpec.decode_hardware` and the model, as the coupled baseline refuses the same
    hardware; one that holds some is a spec whose decode node holds that; with `decode_node_limits` a node holds
    what they say, whatever its hardware."""
    decode = attrs.evolve(HARDWARE[hardware], num_gpus=num_gpus, hbm_bytes=hbm_bytes)
    capacity = DecodeCostModel(model=MODELS[model], hardware=decode).capacity_tokens()
    fields: dict[str, Any] = {
        "num_prefill": 1,
        "num_decode": 1,
        "model": MODELS[model],
        "prefill_hardware": HARDWARE["8xA800"],
        "decode_hardware": decode,
    }
    if capacity == 0:
        with pytest.raises(ConfigError) as caught:
            ClusterSpec(**fields)
        assert "ClusterSpec.decode_hardware" in str(caught.value) and shown(model) in str(caught.value)
        with pytest.raises(ConfigError):
            CoupledCluster(CoupledSpec(num_instances=1, model=MODELS[model], hardware=decode))
    else:
        assert ClusterSpec(**fields).decode_limits == DecodeLimits(kv_capacity_tokens=capacity)
    limits = DecodeLimits(kv_capacity_tokens=1000, max_batch_size=4)
    assert ClusterSpec(**fields, decode_node_limits=limits).decode_limits == limits


def test_one_a800_leaves_llama3_70b_no_kv() -> None:
    """The case that built a cluster refusing every request: one A800 of 80 GB under 141 GB of LLaMA3-70B weights."""
    one = attrs.evolve(HARDWARE["8xA800"], num_gpus=1)
    with pytest.raises(ConfigError, match=r"ClusterSpec\.decode_hardware='8xA800' \(num_gpus=1.*'llama3-70b'"):
        ClusterSpec(
            num_prefill=1, num_decode=1, model=MODELS["llama3-70b"], prefill_hardware=HARDWARE["8xA800"],
            decode_hardware=one,
        )  # fmt: skip


@given(
    specs(),
    st.integers(1, 64),
    st.builds(DecodeLimits, kv_capacity_tokens=st.integers(0, 50_000), max_batch_size=st.none() | st.integers(1, 8)),
)
def test_the_batch_slots_are_given_once(spec: ClusterSpec, batch: int, limits: DecodeLimits) -> None:
    """`max_decode_batch_size` beside `decode_node_limits` (whose `max_batch_size` is a node's batch slots) is a
    ConfigError naming both, not one of them silently dropped; either alone is a spec."""
    with pytest.raises(ConfigError) as caught:
        attrs.evolve(spec, max_decode_batch_size=batch, decode_node_limits=limits)
    message = str(caught.value)
    assert f"ClusterSpec.max_decode_batch_size={batch}" in message and f"decode_node_limits={limits!r}" in message
    assert attrs.evolve(spec, max_decode_batch_size=None, decode_node_limits=limits).decode_limits == limits
    alone = attrs.evolve(spec, max_decode_batch_size=batch, decode_node_limits=None)
    assert alone.decode_limits.max_batch_size == batch


@given(specs(), st.integers(1, 4), st.integers(1, 3))
def test_a_cpp_group_size_must_divide_the_prefill_nodes(spec: ClusterSpec, group: int, nodes: int) -> None:
    """A group size that divides `num_prefill` is a spec with num_prefill / group instances; one that does not is a
    ConfigError naming both numbers."""
    if nodes % group == 0:
        grouped = attrs.evolve(spec, num_prefill=nodes, cpp_group_size=group)
        assert grouped.num_prefill_instances == nodes // group
        assert len(build_conductor(grouped).prefill_views) == nodes // group
    else:
        with pytest.raises(ConfigError, match=rf"cpp_group_size={group} must divide num_prefill={nodes}"):
            attrs.evolve(spec, num_prefill=nodes, cpp_group_size=group)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"decode_s": 0.0}, "decode_s"),
        ({"decode_s": math.nan}, "decode_s"),
        ({"decode_s": -5.0}, "decode_s"),
        ({"seed": -1}, "seed"),
        ({"seed": 0.5}, "seed"),
        ({"router": "kvcache_centric"}, "router"),
        ({"slo": 30}, "slo"),
    ],
)
def test_a_bad_build_option_is_a_config_error_naming_it(options: dict[str, Any], named: str) -> None:
    """The options of `build_conductor(spec, ...)` are checked like the library's: a ConfigError naming the option
    and showing the value."""
    spec = ClusterSpec(
        num_prefill=1, num_decode=1, model=MODELS["llama3-70b"], prefill_hardware=HARDWARE["8xA800"],
        decode_hardware=HARDWARE["8xA800"],
    )  # fmt: skip
    with pytest.raises(ConfigError) as caught:
        build_conductor(spec, **options)
    assert named in str(caught.value) and shown(next(iter(options.values()))) in str(caught.value)
