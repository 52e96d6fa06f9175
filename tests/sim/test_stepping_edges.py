"""Edge contracts of the simulator's stepping and cost models that the module tests leave open.

The event clock: a NaN time is refused as a past one is, so is an arrival one float step back, a fed
stream may hold `None` items, and `run` restores whatever garbage-collector thresholds it found. The
batch: with nobody in it, its next step is the fixed costs of every branch, a branch dropped as never
binding included; two overtakings between the same two steps record no empty run. The coupled baseline,
against one-iteration-at-a-time references: a lone request decodes at the roofline's step with its prompt
as context, an arrival beside a decoding request is taken at the next step boundary and prefilled whole
(the batch stalled) or in chunks of the token budget less the decodes, each iteration a step plus its
chunk; a request's KV reservation is freed whole when it ends, a prefix cache of exactly one block holds
it, and a bad count names its field and value. The cost and step models: a fitted prefill never takes
negative time, `occupancy_s` asks a chunked-pipeline group for its first stage, the decode KV capacity is
the largest whole count that fits, and a step model cannot be fitted to samples that vary in one
direction only. `CoupledSpec` and `ReplayContext` refuse the bad values `ClusterSpec` refuses (they took
them, and a replay then hung or divided by zero).
"""

from __future__ import annotations

import gc
import itertools
import math
from typing import Any

import attrs
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.sched.cost import (
    HARDWARE,
    MODELS,
    ChunkedPipelineCost,
    FittedPrefillModel,
    Hardware,
    PrefillCostModel,
    occupancy_s,
)
from mooncake.sched.outcome import Outcome
from mooncake.sched.step import DecodeCostModel, FittedStepModel, RooflineStep, StepBranch
from mooncake.sim.batch import ContinuousBatch, Member
from mooncake.sim.clock import EventLoop
from mooncake.sim.coupled import CoupledCluster, CoupledSpec
from mooncake.sim.disaggregated import replay
from mooncake.sim.metrics import RequestRecord
from mooncake.sim.replayer import ReplayContext
from mooncake.sim.spec import ClusterSpec
from mooncake.types import RequestId, Slo
from tests.sim.test_coupled import make_request

LLAMA3 = MODELS["llama3-70b"]
A800 = HARDWARE["8xA800"]
BLOCK = 512


def coupled_spec(**options: Any) -> CoupledSpec:
    return CoupledSpec(**{"num_instances": 1, "model": LLAMA3, "hardware": A800, **options})


def small_hbm(tokens: int) -> Hardware:
    """8×A800 with just enough HBM for the weights and about `tokens` tokens of KV."""
    per_gpu = (LLAMA3.weight_bytes + (tokens + 0.5) * LLAMA3.kv_bytes_per_token) / (A800.num_gpus * 0.9)
    return attrs.evolve(A800, name="8xA800-small", hbm_bytes=per_gpu)


# --------------------------------------------------------------------------- the event clock


def test_an_event_at_nan_is_refused_as_one_in_the_past() -> None:
    """NaN compares false with every time, so "not before now" cannot be read as "not (time < now)": the
    loop refuses it, before a run and from a handler, and nothing is scheduled."""
    loop = EventLoop()
    with pytest.raises(ValueError, match="nan"):
        loop.at(math.nan, lambda _now: None)
    assert len(loop) == 0
    refused: list[Exception] = []

    def schedule_nan(_now: float) -> None:
        try:
            loop.at(math.nan, lambda _now: None)
        except ValueError as error:
            refused.append(error)

    loop.at(1.0, schedule_nan)
    loop.run()
    assert len(refused) == 1 and len(loop) == 0 and loop.now == 1.0


def test_a_fed_stream_may_hold_none_items() -> None:
    """Any item is an item, `None` included (`time_of` judges it): each is handled, in its turn among the
    scheduled events, and the stream ends only when it is used up."""
    loop = EventLoop()
    seen: list[tuple[float, object]] = []
    loop.at(1.0, lambda now: seen.append((now, "event")))
    loop.at(3.0, lambda now: seen.append((now, "event")))
    items: list[object] = [None, None, "x", None]
    times = iter([0.5, 2.0, 2.0, 4.0])
    stamped = [(next(times), item) for item in items]
    loop.feed(stamped, lambda pair: pair[0], lambda now, pair: seen.append((now, pair[1])))
    loop.run()
    assert seen == [(0.5, None), (1.0, "event"), (2.0, None), (2.0, "x"), (3.0, "event"), (4.0, None)]

    bare = EventLoop()
    got: list[object] = []
    bare.feed([None, None], lambda _item: 0.0, lambda _now, item: got.append(item))
    bare.run()
    assert got == [None, None]


@given(
    times=st.lists(st.floats(min_value=0.0, max_value=1e6), min_size=1, max_size=6),
    back=st.integers(min_value=1, max_value=3),
)
def test_a_fed_arrival_even_one_ulp_earlier_than_the_clock_is_refused(times: list[float], back: int) -> None:
    """Arrivals in order are handled at their times; one that goes back by any amount, the smallest float step
    included, is an InvalidRequestError naming it (a tolerance would let time run backwards)."""
    ordered = sorted(times)
    loop = EventLoop()
    handled: list[float] = []
    loop.feed(ordered, float, lambda now, _item: handled.append(now))
    loop.run()
    assert handled == ordered
    earlier = ordered[-1]
    for _ in range(back):
        earlier = math.nextafter(earlier, -math.inf)
    late = EventLoop()
    late.feed([*ordered, earlier], float, lambda _now, _item: None)
    with pytest.raises(InvalidRequestError, match="out of order") as caught:
        late.run()
    assert repr(earlier) in str(caught.value)


def test_run_restores_the_thresholds_it_found() -> None:
    """Whatever thresholds the garbage collector had before `run` (not only the interpreter's defaults), it
    has them again after, whether the run ends or a handler raises; inside, the oldest generation is off."""
    original = gc.get_threshold()
    chosen = (701, 11, 13)
    try:
        gc.set_threshold(*chosen)
        inside: list[tuple[int, ...]] = []
        loop = EventLoop()
        loop.at(0.0, lambda _now: inside.append(gc.get_threshold()))
        loop.run()
        assert inside == [(701, 11, 1 << 30)]
        assert gc.get_threshold() == chosen

        def fail(_now: float) -> None:
            raise RuntimeError("handler failed")

        failing = EventLoop()
        failing.at(0.0, fail)
        with pytest.raises(RuntimeError):
            failing.run()
        assert gc.get_threshold() == chosen
    finally:
        gc.set_threshold(*original)


# --------------------------------------------------------------------------- the batch


# Branches that never bind for a batch of one member or more, yet may for none: a fixed cost below another
# branch's fixed plus per-sequence cost, no steeper in anything.
dominated_pairs = st.builds(
    lambda s, f_share, c, c_share: (StepBranch(0.0, s, c), StepBranch(s * f_share, 0.0, c * c_share)),
    st.floats(min_value=1e-4, max_value=1e-2),
    st.floats(min_value=0.01, max_value=1.0),
    st.floats(min_value=0.0, max_value=1e-5),
    st.floats(min_value=0.0, max_value=1.0),
)


@given(
    pair=dominated_pairs,
    swap=st.booleans(),
    overhead_s=st.sampled_from([0.0, 0.005]),
    extra_context=st.integers(min_value=0, max_value=10**6),
)
def test_an_empty_batch_steps_for_the_fixed_costs_of_every_branch(
    pair: tuple[StepBranch, StepBranch], swap: bool, overhead_s: float, extra_context: int
) -> None:
    """With no members, `step_s(C)` is overhead + max_j (f_j + c_j · C) over all the branches, those that never
    bind for B >= 1 included (the batch integrates without them, but for B = 0 they may be the slowest); with
    one member joining, it is the roofline's step."""
    branches = pair[::-1] if swap else pair
    roofline = RooflineStep(branches, overhead_s=overhead_s)
    batch = ContinuousBatch(roofline)
    expected = overhead_s + max(
        b.fixed_s + b.per_sequence_s * 0 + b.per_context_token_s * extra_context for b in branches
    )
    assert batch.step_s(extra_context) == expected
    assert batch.step_s(extra_context, extra_members=1) == roofline.step_s(1, extra_context)


@st.composite
def double_crossings(draw: st.DrawFn) -> tuple[RooflineStep, int]:
    """Three branches for one member with no context (C grows by one a step): a flat one binds first, a
    steeper one crosses it at a non-integer step x1, and the steepest crosses that one before the next whole
    step, so both overtakings fall between the same two steps. Returns the roofline and ceil(x1)."""
    f0 = draw(st.floats(min_value=0.5, max_value=2.0))
    c1 = draw(st.floats(min_value=0.05, max_value=1.0))
    x1 = f0 / c1
    assume(x1 != math.ceil(x1))
    x12 = x1 + (math.ceil(x1) - x1) * draw(st.floats(min_value=0.01, max_value=0.99))
    c2 = c1 * draw(st.floats(min_value=1.1, max_value=4.0))
    branches = [StepBranch(f0, 0.0, 0.0), StepBranch(0.0, 0.0, c1), StepBranch(-(c2 - c1) * x12, 0.0, c2)]
    return RooflineStep(draw(st.permutations(branches))), math.ceil(x1)


@given(crossing=double_crossings(), extra=st.integers(min_value=0, max_value=5), gap_s=st.sampled_from([0.0, 0.5]))
def test_two_overtakings_within_one_step_record_no_empty_run(
    crossing: tuple[RooflineStep, int], extra: int, gap_s: float
) -> None:
    """When the middle branch would bind from the same step as the steepest, it never binds: the stretch is two
    runs (the flat branch's steps, then the steepest's), every run counts at least one interval, the counts add
    up to the steps, and each interval is the roofline's step, one at a time."""
    roofline, switch = crossing
    steps = switch + 1 + extra
    batch = ContinuousBatch(roofline)
    record = RequestRecord(RequestId("m"), 0.0, 1, steps + 2)
    batch.join(Member(record, steps + 1, 0, gap_s))
    batch.advance(steps)
    runs = record.intervals.runs
    assert all(count >= 1 for _, _, count in runs), runs
    assert sum(count for _, _, count in runs) == steps
    assert len(runs) == (3 if gap_s and switch > 1 else 2)  # a gap takes the first interval out of its run
    expected = [roofline.step_s(1, i) for i in range(steps)]
    expected[0] += gap_s
    for got, want in zip(record.intervals.values(), expected, strict=True):
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12)


# --------------------------------------------------------------------------- the coupled baseline


@settings(max_examples=30, deadline=None)
@given(
    input_tokens=st.integers(min_value=1, max_value=40_000),
    output_tokens=st.integers(min_value=1, max_value=400),
    chunked=st.booleans(),
    budget=st.sampled_from([64, 512, 4096]),
    analytic=st.booleans(),
)
def test_a_lone_request_decodes_one_roofline_step_at_a_time(
    input_tokens: int, output_tokens: int, chunked: bool, budget: int, analytic: bool
) -> None:
    """Alone on an instance, after its prefill (its first token), a request's i-th interval is the decode step of
    a batch of one holding its prompt and the i tokens since: step_s(1, n + i), as stepping one at a time gives;
    it finishes at the first token plus their sum."""
    spec = coupled_spec(chunked_prefill=chunked, token_budget=budget, analytic_decode=analytic)
    (record,) = CoupledCluster(spec).run([make_request("only", 0.25, input_tokens, output_tokens)]).records
    assert record.outcome == Outcome.COMPLETED
    steps = [spec.decode_cost.step_s(1, input_tokens + i) for i in range(output_tokens - 1)]
    assert record.intervals.count == output_tokens - 1
    for got, want in zip(record.intervals.values(), steps, strict=True):
        assert math.isclose(got, want, rel_tol=1e-12)
    assert record.first_token_s is not None and record.finish_s is not None
    assert math.isclose(record.first_token_s, 0.25 + spec.prefill_cost.prefill_s(input_tokens), rel_tol=1e-12)
    assert math.isclose(record.finish_s, record.first_token_s + math.fsum(steps), rel_tol=1e-9)


@pytest.mark.parametrize("chunked_prefill", [False, True])
def test_a_request_frees_its_whole_reservation_when_it_ends(chunked_prefill: bool) -> None:
    """Each of three requests reserves prompt + output, which together nearly fill the HBM: one at a time fits,
    and only if the one before gave back all of its reservation (its output's share too) can the next start."""
    cluster = CoupledCluster(coupled_spec(hardware=small_hbm(40_000), chunked_prefill=chunked_prefill))
    capacity = cluster.capacity_tokens
    output = capacity - 1000 - 8
    requests = [make_request(str(i), 0.01 * i, 1000, output, first_key=100 * i) for i in range(3)]
    records = cluster.run(requests).records
    assert [r.outcome for r in records] == [Outcome.COMPLETED] * 3
    for before, after in itertools.pairwise(records):
        assert before.finish_s is not None and after.first_token_s is not None
        assert after.first_token_s >= before.finish_s


@pytest.mark.parametrize(("capacity_tokens", "reused"), [(BLOCK - 1, 0), (BLOCK, BLOCK)])
def test_a_prefix_cache_of_exactly_one_block_holds_it(capacity_tokens: int, reused: int) -> None:
    """A coupled instance's HBM cache of `block_size_tokens` holds one block (a repeat reuses it); one token
    less holds none."""
    spec = coupled_spec(cache_capacity_tokens=capacity_tokens)
    requests = [make_request("a", 0.0, 1000, 3), make_request("b", 30.0, 1000, 3)]
    first, repeat = CoupledCluster(spec).run(requests).records
    assert (first.prefix_tokens, repeat.prefix_tokens) == (0, reused)


@settings(max_examples=60, deadline=None)
@given(
    decoding_input=st.integers(min_value=1, max_value=5000),
    arriving_input=st.integers(min_value=1, max_value=12_000),
    arriving_output=st.integers(min_value=2, max_value=6),
    boundary=st.integers(min_value=0, max_value=5),
    fraction=st.floats(min_value=0.05, max_value=0.95),
    chunked=st.booleans(),
    budget=st.sampled_from([2, 300, 2048]),
)
def test_an_arrival_is_prefilled_from_the_next_step_boundary_as_vllm_schedules_it(
    decoding_input: int,
    arriving_input: int,
    arriving_output: int,
    boundary: int,
    fraction: float,
    chunked: bool,
    budget: int,
) -> None:
    """A request arriving mid-step beside one decoding request, against a one-iteration-at-a-time reference: at
    the next step boundary it is taken; without chunked prefill its whole prefill runs alone, the batch stalled
    (no decode step in that iteration), and it joins at its end; with chunked prefill each iteration carries the
    decoding request's token and a chunk of the budget less that token, taking the step plus the chunk's
    prefill, until the last chunk ends with its first token. The decoding request's intervals are those
    iterations; then both decode together."""
    prefill, step = coupled_spec().prefill_cost, coupled_spec().decode_cost
    chunks = -(-arriving_input // (budget - 1)) if chunked else 1
    decoding_output = boundary + chunks + 6  # still decoding when the arrival's prefill ends
    first_s = prefill.prefill_s(decoding_input)
    times = [step.step_s(1, decoding_input + i) for i in range(boundary + 1)]
    arrival_s = first_s + math.fsum(times[:boundary]) + fraction * times[boundary]
    # The reference, one iteration at a time, from the first boundary after the arrival.
    now_s, context = first_s + math.fsum(times), decoding_input + boundary + 1
    expected = list(times)
    if chunked:
        done = 0
        while done < arriving_input:
            chunk = min(arriving_input - done, budget - 1)
            iteration_s = prefill.prefill_s(done + chunk, done) + step.step_s(1, context)
            expected.append(iteration_s)
            now_s, context, done = now_s + iteration_s, context + 1, done + chunk
    else:
        now_s += prefill.prefill_s(arriving_input)
    joined_s = now_s
    expected_stall_s = 0.0 if chunked else prefill.prefill_s(arriving_input)
    expected.append(expected_stall_s + step.step_s(2, context + arriving_input))  # the first step together

    spec = coupled_spec(chunked_prefill=chunked, token_budget=budget)
    requests = [
        make_request("decoding", 0.0, decoding_input, decoding_output),
        make_request("arriving", arrival_s, arriving_input, arriving_output, first_key=10_000),
    ]
    decoding, arriving = CoupledCluster(spec).run(requests).records
    assert arriving.first_token_s is not None
    assert math.isclose(arriving.first_token_s, joined_s, rel_tol=1e-9)
    got = decoding.intervals.values()[: len(expected)]
    assert len(got) == len(expected)
    for got_s, want_s in zip(got, expected, strict=True):
        assert math.isclose(got_s, want_s, rel_tol=1e-9)
    assert math.isclose(arriving.intervals.values()[0], expected[-1] - expected_stall_s, rel_tol=1e-9)


CHECKED_COUPLED_FIELDS = [
    (field, value)
    for field in ("num_instances", "block_size_tokens", "token_budget")
    for value in (0, -3, True, 2.0, "4", None)
]


@pytest.mark.parametrize(
    ("field", "value"), CHECKED_COUPLED_FIELDS, ids=[f"{f}={v!r}" for f, v in CHECKED_COUPLED_FIELDS]
)
def test_a_bad_count_in_a_coupled_spec_names_the_field_and_the_value(field: str, value: object) -> None:
    """A count that is not an integer >= 1 (a bool, a float equal to one, a string, None, zero or less) is a
    ConfigError at construction naming `CoupledSpec.<field>` and showing the value."""
    with pytest.raises(ConfigError) as caught:
        coupled_spec(**{field: value})
    assert f"CoupledSpec.{field}" in str(caught.value) and repr(value) in str(caught.value)


BAD_COUPLED_FIELDS = [
    ("sample_interval_s", 0.0),
    ("sample_interval_s", -1.0),
    ("sample_interval_s", math.nan),
    ("cache_capacity_tokens", -1),
    ("max_batch_size", 0),
    ("mfu", 2.0),
    ("chunked_prefill", "yes"),
    ("model", "llama3-70b"),
    ("model", None),
    ("hardware", None),
    ("hardware", "8xA800"),
]


@pytest.mark.parametrize(("field", "value"), BAD_COUPLED_FIELDS, ids=[f"{f}={v!r}" for f, v in BAD_COUPLED_FIELDS])
def test_a_bad_coupled_spec_field_is_a_config_error_naming_it(field: str, value: object) -> None:
    """As `ClusterSpec` does for its twins of these fields: a ConfigError at construction naming
    `CoupledSpec.<field>` and showing the value."""
    with pytest.raises(ConfigError) as caught:
        coupled_spec(**{field: value})
    assert f"CoupledSpec.{field}" in str(caught.value) and repr(value) in str(caught.value)


@pytest.mark.parametrize("interval_s", [0.0, -1.0, math.nan, math.inf])
def test_a_replay_context_refuses_a_sampling_interval_that_is_no_positive_time(interval_s: float) -> None:
    """The load is sampled every `sample_interval_s`: one that is not a finite time > 0 is a ConfigError naming
    it, when the context is made (not a hang or a crash inside a replay)."""
    with pytest.raises(ConfigError, match="sample_interval_s"):
        ReplayContext(Slo(), sample_interval_s=interval_s)


@pytest.mark.parametrize("slo", ["x", 30, (30.0, 0.1)])
def test_an_slo_that_is_no_slo_is_refused_before_the_replay(slo: object) -> None:
    """The summary measures attainment against the `slo` after the whole replay: one that is no `Slo` is a
    ConfigError naming it when the context or the coupled cluster is made (the cluster checks it even when handed
    a context of its own), not an AttributeError after the replay."""
    with pytest.raises(ConfigError, match=r"slo must be a mooncake\.types\.Slo") as caught:
        ReplayContext(slo, sample_interval_s=1.0)  # type: ignore[arg-type]
    assert repr(slo) in str(caught.value)
    context = ReplayContext(Slo(), sample_interval_s=1.0)
    for options in ({}, {"context": context}):
        with pytest.raises(ConfigError, match=r"slo must be a mooncake\.types\.Slo"):
            CoupledCluster(coupled_spec(), slo=slo, **options)  # type: ignore[arg-type]
    # `replay` reads the SLO's TBT for the workload's t_d before it builds the Conductor (an AttributeError).
    spec = ClusterSpec(
        num_prefill=1,
        num_decode=1,
        model=MODELS["llama3-70b"],
        prefill_hardware=HARDWARE["8xA800"],
        decode_hardware=HARDWARE["8xA800"],
    )
    for options in ({}, {"decode_s": 1.0}):
        with pytest.raises(ConfigError, match=r"slo must be a mooncake\.types\.Slo"):
            replay(spec, [make_request("r", 0.0, 100, 2)], slo=slo, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("keep", ["no", 0, 1, None])
def test_keep_intervals_must_be_a_switch(keep: object) -> None:
    """`keep_intervals="no"` would read as true: anything but True or False is a ConfigError naming it, before a
    request arrives."""
    cluster = CoupledCluster(coupled_spec())
    with pytest.raises(ConfigError, match="keep_intervals") as caught:
        cluster.run([make_request("a", 0.0, 1000, 4)], keep_intervals=keep)  # type: ignore[arg-type]
    assert repr(keep) in str(caught.value) and not cluster.replay.records


# --------------------------------------------------------------------------- cost and step models


@given(
    coefficients=st.tuples(
        st.floats(min_value=-1.0, max_value=1.0),
        st.floats(min_value=-1e-3, max_value=1e-3),
        st.floats(min_value=-1e-8, max_value=1e-8),
    ),
    n=st.integers(min_value=0, max_value=100_000),
    p=st.integers(min_value=0, max_value=100_000),
)
def test_a_fitted_prefill_never_takes_negative_time(coefficients: tuple[float, float, float], n: int, p: int) -> None:
    """c0 + c1·(n − p) + c2·(n² − p²) seconds, clamped at 0 (coefficients given by hand may be negative);
    nothing to compute takes nothing."""
    model = FittedPrefillModel(coefficients=coefficients)
    c0, c1, c2 = coefficients
    seconds = model.prefill_s(n, p)
    if n <= p:
        assert seconds == 0.0
    else:
        assert seconds == max(0.0, c0 + c1 * float(n - p) + c2 * (float(n) * n - float(p) * p))
    assert seconds >= 0.0


@given(
    n=st.integers(min_value=0, max_value=60_000),
    data=st.data(),
    stages=st.integers(min_value=2, max_value=4),
    chunk=st.sampled_from([512, 4096]),
    given_s=st.none() | st.floats(min_value=0.0, max_value=100.0),
)
def test_occupancy_is_the_first_stage_of_a_pipeline_and_the_whole_prefill_otherwise(
    n: int, data: st.DataObject, stages: int, chunk: int, given_s: float | None
) -> None:
    """`occupancy_s` asks a chunked-pipeline group for its first stage's busy time (whatever prefill time the
    caller passes), and takes any other model's whole prefill: the one passed, else the model's."""
    p = data.draw(st.integers(min_value=0, max_value=n))
    base = PrefillCostModel(model=LLAMA3, hardware=A800)
    group = ChunkedPipelineCost(base=base, group_size=stages, chunk_tokens=chunk)
    assert occupancy_s(group, n, p, prefill_s=given_s) == group.occupancy_s(n, p)
    if n - p > chunk:  # several chunks: the next prompt enters before this one is out
        assert occupancy_s(group, n, p) < group.prefill_s(n, p)
    assert occupancy_s(base, n, p) == base.prefill_s(n, p)
    if given_s is not None:
        assert occupancy_s(base, n, p, prefill_s=given_s) == given_s


@given(
    model=st.sampled_from(sorted(MODELS)),
    hardware=st.sampled_from(sorted(HARDWARE)),
    kv_memory_fraction=st.floats(min_value=0.05, max_value=1.0),
    hbm_scale=st.floats(min_value=0.05, max_value=3.0),
)
def test_decode_capacity_is_the_most_whole_tokens_beside_the_weights(
    model: str, hardware: str, kv_memory_fraction: float, hbm_scale: float
) -> None:
    """capacity = ⌊(G · HBM · kv_memory_fraction − weights) / KV per token⌋, at least 0: the most whole tokens
    whose KV fits, never one more."""
    shape = MODELS[model]
    hw = attrs.evolve(HARDWARE[hardware], hbm_bytes=HARDWARE[hardware].hbm_bytes * hbm_scale)
    cost = DecodeCostModel(model=shape, hardware=hw, kv_memory_fraction=kv_memory_fraction)
    room = hw.num_gpus * hw.hbm_bytes * kv_memory_fraction - shape.weight_bytes
    capacity = cost.capacity_tokens()
    assert isinstance(capacity, int) and capacity >= 0
    if room < 0:
        assert capacity == 0
    else:
        assert capacity == math.floor(room / shape.kv_bytes_per_token)
        assert capacity <= room / shape.kv_bytes_per_token < capacity + 1


@pytest.mark.parametrize(
    "samples",
    [
        pytest.param([(4, 100, 0.010), (4, 200, 0.011), (4, 400, 0.013), (4, 800, 0.017)], id="one-batch-size"),
        pytest.param([(1, 0, 0.010), (2, 0, 0.011), (4, 0, 0.013), (8, 0, 0.017)], id="no-context"),
        pytest.param([(1, 100, 0.010), (2, 200, 0.011), (4, 400, 0.013)], id="context-proportional-to-batch"),
    ],
)
def test_a_step_model_needs_samples_varying_in_batch_and_context(samples: list[tuple[int, int, float]]) -> None:
    """Samples that vary in one direction only (a single batch size, no context, or a context that is a fixed
    multiple of the batch) cannot separate the per-sequence and per-token costs: ConfigError, not an arbitrary
    plane."""
    with pytest.raises(ConfigError, match="vary"):
        FittedStepModel.fit(samples)
