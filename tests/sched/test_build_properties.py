"""Properties of `mooncake.sched.build.build_conductor` over generated configurations.

The reference model is the module docstring read literally: a Conductor assembled by hand from the documented
defaults (Algorithm 1 on `ttft_estimator(model, hardware)`, `EarlyRejection()`, the uniform predictor at
`DEFAULT_DECODE_S`, `Slo()`, `DecodeCostModel` of the decode hardware, its HBM's KV as each decode instance's
limits), each replaced by what was given. A built Conductor must read back as that assembly through its public
attributes and views, and decide as it does, request for request, for the same seed. Every bad argument is a
`ConfigError` naming the argument and the value.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake._checks import shown
from mooncake.cache.hashing import BlockHasher
from mooncake.errors import ConfigError
from mooncake.sched.admission import BaselineAdmission, EarlyRejection
from mooncake.sched.build import build_conductor, ttft_estimator
from mooncake.sched.conductor import Conductor, ScheduleDecision
from mooncake.sched.cost import HARDWARE, MODELS, PrefillCostModel, TransferCostModel
from mooncake.sched.join import DecodeLimits
from mooncake.sched.predictor import DEFAULT_DECODE_S, UniformDecodePredictor
from mooncake.sched.router import KvCacheCentricRouter, LoadBalancingRouter, RandomRouter
from mooncake.sched.step import DecodeCostModel
from mooncake.types import BlockKey, InstanceId, Request, RequestId, Slo
from tests.strategies import request_streams

LLAMA3, A800 = MODELS["llama3-70b"], HARDWARE["8xA800"]

models = st.sampled_from(sorted(MODELS))
hardwares = st.sampled_from(sorted(HARDWARE))
routers = st.sampled_from(
    [KvCacheCentricRouter, RandomRouter, LoadBalancingRouter, functools.partial(KvCacheCentricRouter, threshold=4.0)]
)
slos = st.builds(Slo, ttft_s=st.sampled_from([0.05, 0.5, 30.0]), tbt_s=st.sampled_from([0.01, 0.1]))
limits = st.builds(
    DecodeLimits,
    kv_capacity_tokens=st.integers(0, 20_000),
    max_batch_size=st.none() | st.integers(1, 4),
    max_context_tokens=st.none() | st.integers(1, 5_000),
)


@st.composite
def instance_lists(draw: st.DrawFn) -> tuple[list[str], list[str]]:
    """Disjoint prefill and decode id lists, in a drawn (not sorted) order; either may be empty."""
    names = draw(st.lists(st.text("pdq0123", min_size=1, max_size=3), unique=True, max_size=7))
    cut = draw(st.integers(0, len(names)))
    return names[:cut], names[cut:]


@st.composite
def configurations(draw: st.DrawFn) -> dict[str, Any]:
    """Keyword arguments of `build_conductor`: a model, its hardware, a geometry given one of its two ways, and
    each optional part either left to its default (absent) or given."""
    prefill_ids, decode_ids = draw(instance_lists())
    model_name = draw(models)
    block = draw(st.sampled_from([1, 4, 16, 512]))
    options: dict[str, Any] = {
        "model": MODELS[model_name],
        "hardware": HARDWARE[draw(hardwares)],
        "prefill_instances": prefill_ids,
        "decode_instances": decode_ids,
    }
    if draw(st.booleans()):
        options["hasher"] = BlockHasher(model=model_name, block_size_tokens=block)
    else:
        options["block_size_tokens"] = block
    optional: dict[str, st.SearchStrategy[Any]] = {
        "router": routers,
        "admission": st.sampled_from([EarlyRejection(), EarlyRejection(predictive=True), BaselineAdmission()]),
        "slo": slos,
        "decode_hardware": hardwares.map(HARDWARE.__getitem__),
        "decode_limits": limits,
        "transfers": st.booleans(),
        "first_token_overhead_s": st.sampled_from([0.0, 0.004, 1.5]),
        "seed": st.integers(0, 2**32),
    }
    for name, values in optional.items():
        if draw(st.booleans()):
            options[name] = draw(values)
    return options


def by_hand(options: dict[str, Any]) -> Conductor:
    """The Conductor the module docstring describes for `options`, assembled from its parts."""
    model, hardware = options["model"], options["hardware"]
    decode_hardware = options.get("decode_hardware", hardware)
    factory = options.get("router", KvCacheCentricRouter)
    estimator = ttft_estimator(model, hardware, first_token_overhead_s=options.get("first_token_overhead_s", 0.0))
    hasher = options.get("hasher")
    conductor = Conductor(
        router=factory(estimator),
        step_model=DecodeCostModel(model=model, hardware=decode_hardware),
        admission=options.get("admission", EarlyRejection()),
        predictor=UniformDecodePredictor(
            decode_s=DEFAULT_DECODE_S, step_s=options.get("slo", Slo(ttft_s=30.0, tbt_s=0.1)).tbt_s
        ),
        slo=options.get("slo", Slo(ttft_s=30.0, tbt_s=0.1)),
        block_size_tokens=hasher.block_size_tokens if hasher is not None else options["block_size_tokens"],
        transfers=options.get("transfers", True),
        seed=options.get("seed", 0),
    )
    capacity = DecodeCostModel(model=model, hardware=decode_hardware).capacity_tokens()
    conductor.add_prefill_instances(InstanceId(i) for i in options["prefill_instances"])
    conductor.add_decode_instances(
        (InstanceId(i) for i in options["decode_instances"]),
        options.get("decode_limits", DecodeLimits(kv_capacity_tokens=capacity)),
    )
    return conductor


def decisions(conductor: Conductor, requests: list[Request]) -> list[ScheduleDecision]:
    """`conductor`'s decision on each request of a stream, at its arrival; its invariants checked after."""
    out = [conductor.schedule(request, request.arrival_s) for request in requests]
    conductor.check_invariants()
    return out


@given(configurations())
def test_a_built_conductor_reads_back_as_its_documented_assembly(options: dict[str, Any]) -> None:
    """Every part read back through the public attributes and views is the one given, or else the documented
    default: prefill and transfer costs on the (prefill) hardware, decode costs and default limits on the decode
    hardware, the hasher's block size, the instances in the order given."""
    conductor = build_conductor(**options)
    model, hardware = options["model"], options["hardware"]
    decode_hardware = options.get("decode_hardware", hardware)
    estimator = conductor.router.estimator  # type: ignore[attr-defined]
    assert estimator.prefill == PrefillCostModel(model=model, hardware=hardware)
    assert estimator.transfer == TransferCostModel(bandwidth_bytes_per_s=hardware.nic_bytes_per_s)
    assert estimator.kv_bytes_per_token == model.kv_bytes_per_token
    assert estimator.first_token_overhead_s == options.get("first_token_overhead_s", 0.0)
    factory = options.get("router", KvCacheCentricRouter)
    assert conductor.router == factory(estimator)
    assert conductor.step_model == DecodeCostModel(model=model, hardware=decode_hardware)
    if "admission" in options:
        assert conductor.admission is options["admission"]
    else:
        assert conductor.admission == EarlyRejection()
    assert conductor.predictor == UniformDecodePredictor(decode_s=DEFAULT_DECODE_S, step_s=conductor.slo.tbt_s)
    assert conductor.slo == options.get("slo", Slo(ttft_s=30.0, tbt_s=0.1))
    hasher = options.get("hasher")
    assert conductor.block_size_tokens == (
        hasher.block_size_tokens if hasher is not None else options["block_size_tokens"]
    )
    assert conductor.transfers is options.get("transfers", True)
    assert [v.instance_id for v in conductor.prefill_views] == options["prefill_instances"]
    assert [v.instance_id for v in conductor.decode_views] == options["decode_instances"]
    # One question, one answer: the decode capacity is the decode hardware's, as its step model computes it.
    capacity = DecodeCostModel(model=model, hardware=decode_hardware).capacity_tokens()
    expected = options.get("decode_limits", DecodeLimits(kv_capacity_tokens=capacity))
    assert all(view.limits == expected for view in conductor.decode_views)
    assert conductor.in_flight == ()
    conductor.check_invariants()


@given(configurations(), st.data())
def test_equal_inputs_decide_as_the_hand_assembly_does(options: dict[str, Any], data: st.DataObject) -> None:
    """Two builds from equal arguments, and the hand assembly of the documented parts with the same seed,
    make the same decision for every request of the same stream (a random router draws the same instances)."""
    options["prefill_instances"] = options["prefill_instances"] or ["p-a", "p-b", "p-c"]
    options["decode_instances"] = options["decode_instances"] or ["d-a", "d-b"]
    block = options["hasher"].block_size_tokens if "hasher" in options else options["block_size_tokens"]
    stream = data.draw(request_streams(block))
    first = decisions(build_conductor(**options), stream)
    assert decisions(build_conductor(**options), stream) == first
    assert decisions(by_hand(options), stream) == first


@given(st.integers(0, 2**32), st.integers(2, 5))
def test_the_seed_is_the_one_routing_draws_from(seed: int, num_prefill: int) -> None:
    """A random router's choices over a stream are those of a hand-assembled Conductor seeded alike."""
    options: dict[str, Any] = {
        "model": LLAMA3,
        "hardware": A800,
        "prefill_instances": [f"p{i}" for i in range(num_prefill)],
        "decode_instances": ["d"],
        "block_size_tokens": 16,
        "router": RandomRouter,
        "seed": seed,
    }
    stream = [
        Request(
            request_id=RequestId(f"r{i}"),
            arrival_s=i / 100,
            input_length=20,
            output_length=4,
            block_keys=(BlockKey(1000 + 2 * i), BlockKey(1001 + 2 * i)),
            block_size_tokens=16,
        )
        for i in range(24)
    ]
    built = [d.prefill_instance for d in decisions(build_conductor(**options), stream)]
    assert built == [d.prefill_instance for d in decisions(by_hand(options), stream)]


class _CountingFactory:
    """A router factory that counts its calls: a build refused up front never made a router."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, estimator: Any) -> KvCacheCentricRouter:
        self.calls += 1
        return KvCacheCentricRouter(estimator)


not_integers = (
    st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=3)
    | st.booleans()
    | st.none()
    | st.integers(max_value=0)
    | st.just(512.0)
)
not_times = st.sampled_from([-1.0, -1e-9, math.nan, math.inf, -math.inf, "0", None, True])


@st.composite
def bad_arguments(draw: st.DrawFn) -> tuple[dict[str, Any], str, object, bool]:
    """One argument made bad: (the overrides, the name the error must carry, the value it must show, whether it
    is refused before any part is built)."""
    kind = draw(
        st.sampled_from(
            [
                "model",
                "hardware",
                "decode_hardware",
                "block_size_tokens",
                "string_ids",
                "id_type",
                "duplicate",
                "seed",
                "overhead",
            ]
        )
    )
    value: Any
    if kind in ("model", "hardware", "decode_hardware"):
        value = draw(st.sampled_from([*sorted(MODELS), *sorted(HARDWARE), 8, None]))
        if kind == "decode_hardware" and value is None:
            value = "8xH800"  # None is the default (the prefill hardware)
        if kind != "model" and isinstance(value, str) and value in MODELS:
            value = MODELS[value]  # a model where hardware belongs
        return {kind: value}, kind, value, True
    if kind == "block_size_tokens":
        value = draw(not_integers.filter(lambda v: v is not None))
        return {"block_size_tokens": value}, "block_size_tokens", value, False
    if kind == "string_ids":
        name = draw(st.sampled_from(["prefill_instances", "decode_instances"]))
        value = draw(st.text(min_size=1, max_size=4))
        return {name: value}, name, value, True
    if kind == "id_type":
        name = draw(st.sampled_from(["prefill_instances", "decode_instances"]))
        value = draw(st.sampled_from([1, "", None, 2.5, b"p"]))
        return {name: ["ok-0", value]}, "instance id", value, False
    if kind == "duplicate":
        value = draw(st.text("pd01", min_size=1, max_size=2))
        where = draw(st.sampled_from(["prefill", "decode", "both"]))
        ids = {
            "prefill": {"prefill_instances": [value, "x", value]},
            "decode": {"decode_instances": ["x", value, value]},
            "both": {"prefill_instances": [value], "decode_instances": [value]},
        }[where]
        return ids, "instance", str(value), False
    if kind == "seed":
        value = draw(st.integers(max_value=-1) | st.sampled_from([1.5, "0", None, True]))
        return {"seed": value}, "seed", value, False
    value = draw(not_times)
    return {"first_token_overhead_s": value}, "first_token_overhead_s", value, True


@given(bad_arguments())
def test_every_bad_argument_is_a_config_error_naming_it(bad: tuple[dict[str, Any], str, object, bool]) -> None:
    """A bad argument (a preset's name for a model or hardware, a block size that is no integer >= 1, one string
    for an instance list, an id that is no non-empty string, an id listed twice, a negative or non-integer seed, a
    negative or non-finite overhead) raises ConfigError naming the argument and showing the value; those checked
    up front are refused before the router factory makes anything."""
    overrides, named, value, up_front = bad
    factory = _CountingFactory()
    options: dict[str, Any] = {
        "model": LLAMA3,
        "hardware": A800,
        "prefill_instances": ["p0"],
        "decode_instances": ["d0"],
        "block_size_tokens": 16,
        "router": factory,
        **overrides,
    }
    with pytest.raises(ConfigError) as caught:
        build_conductor(**options)
    message = str(caught.value)
    assert named in message and (shown(value) in message or str(value) in message), message
    if up_front:
        assert factory.calls == 0


def _base() -> dict[str, Any]:
    return {
        "model": LLAMA3,
        "hardware": A800,
        "prefill_instances": ["p0"],
        "decode_instances": ["d0"],
        "block_size_tokens": 16,
    }


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"transfers": "no"}, "transfers"),
        ({"block_size_tokens": None, "hasher": "llama3-70b"}, "hasher"),
        ({"prefill": "fitted"}, "prefill"),
        ({"prefill_instances": None}, "prefill_instances"),
    ],
)
def test_a_part_of_the_wrong_type_is_refused_when_built(overrides: dict[str, Any], named: str) -> None:
    """A part of the wrong type is a ConfigError naming it at build time, as a model or hardware of the wrong
    type is, not an AttributeError / TypeError (or a silent misreading) at the first request."""
    options = {**_base(), **overrides}
    with pytest.raises(ConfigError, match=named):
        conductor = build_conductor(**options)
        request = Request(request_id=RequestId("r"), arrival_s=0.0, input_length=20, output_length=2, block_keys=(1, 2))
        conductor.schedule(request, 0.0)
