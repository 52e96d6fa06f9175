"""Edge contracts of the decode rule (`sched.join`), admission (`sched.admission`), the waiting line
(`sched.waiting`) and the pending blocks (`sched.pending`) that the modules' own test files leave unchecked.

Found by a mutation round: each test here fails on a plausible change to the product that every other test
of these modules let through (a prediction truncated instead of rounded, a TBT tie refused, an objective of 0
taken for none, a batch limit of 0, a wait allowed with `max_wait_s` 0, the TBT objective no longer a reason to
wait, a rule's reason replaced by another, waits due together tried out of line order, a lasting refusal's
reason replaced, a request that raised at its deadline kept in line, a count lookup or walk blind to the
table's first bucket, a backward-shift deletion that forgets the probe runs that wrap around the table's end),
and two that the product had (an unset batch limit below the largest load taken; a pump at no time that dropped
the waiting head)."""

from __future__ import annotations

import collections
import math

import attrs
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mooncake.cache._compiled import compiled_path, numba_available
from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.sched.admission import (
    WAITS_FOR_ROOM,
    BaselineAdmission,
    EarlyRejection,
    predictive_early_rejection,
    room_wait_deadline,
)
from mooncake.sched.conductor import Conductor, ScheduleDecision
from mooncake.sched.cost import HARDWARE, MODELS, PrefillCostModel, TransferCostModel
from mooncake.sched.decode import DecodeChoice
from mooncake.sched.join import MAX_LOAD, UNLIMITED, DecodeLimits, DecodeLoad, JoinVerdict, check_join
from mooncake.sched.outcome import Reason
from mooncake.sched.pending import PendingBlocks
from mooncake.sched.predictor import UniformDecodePredictor
from mooncake.sched.router import LoadBalancingRouter, RouteDecision, TtftEstimator
from mooncake.sched.step import DecodeCostModel
from mooncake.sched.waiting import AdmissionQueue
from mooncake.types import BlockKey, InstanceId, Request, RequestId, Slo
from tests.reference.sched import reference_verdict

COST = DecodeCostModel(model=MODELS["llama3-70b"], hardware=HARDWARE["8xA800"])
STRUCTURAL = (Reason.CONTEXT_TOO_LONG, Reason.BATCH_FULL, Reason.KV_BUDGET)
PATHS = [
    pytest.param(False, id="plain"),
    pytest.param(True, id="compiled", marks=pytest.mark.skipif(not numba_available(), reason="numba is not installed")),
]


# ------------------------------------------------------------------------------------------------ the decode rule


def rule_on_rounded(limits: DecodeLimits, load: DecodeLoad, prompt: int, output: int, slo: float | None) -> JoinVerdict:
    """The whole verdict the rule gives on `load` with each count rounded by Python's `round` (half to even), as
    the module docstring states it: the checks one by one (`reference_verdict`), the predicted step with the
    request added on the rounded batch whenever the structural checks pass."""
    whole = DecodeLoad(round(load.batch_size), round(load.context_tokens), round(load.kv_tokens))
    reason = reference_verdict(
        limits, whole, prompt_tokens=prompt, output_tokens=output, step_model=COST, tbt_slo_s=slo
    )
    if reason in STRUCTURAL:
        return JoinVerdict(accepted=False, reason=reason)
    predicted = COST.step_s(int(whole.batch_size) + 1, int(whole.context_tokens) + prompt)
    return JoinVerdict(accepted=reason is None, reason=reason, predicted_tbt_s=predicted)


# Offsets of a predicted count from the whole number it rounds to: the halves are where rounding rules differ.
offsets = st.sampled_from([-0.5, -0.25, 0.0, 0.25, 0.4999, 0.5, 0.75]) | st.floats(-0.5, 0.5)


@st.composite
def boundary_cases(draw: st.DrawFn) -> tuple[DecodeLimits, DecodeLoad, int, int, float | None]:
    """A fractional load and limits within a token or a slot of where each check flips on its rounding."""
    prompt, output = draw(st.integers(1, 60)), draw(st.sampled_from([1, 2]) | st.integers(1, 60))
    need = prompt + output
    batch, context, kv = draw(st.integers(0, 6)), draw(st.integers(0, 50_000)), draw(st.integers(0, 500))
    load = DecodeLoad(max(0.0, batch + draw(offsets)), max(0.0, context + draw(offsets)), max(0.0, kv + draw(offsets)))
    limits = DecodeLimits(
        kv_capacity_tokens=max(0, kv + need + draw(st.integers(-1, 1))),
        max_batch_size=draw(st.none() | st.integers(max(1, batch), batch + 2)),
        max_context_tokens=draw(st.none() | st.integers(max(1, need - 1), need + 1)),
    )
    at = COST.step_s(batch + 1, context + prompt)
    slo = draw(st.none() | st.sampled_from([at, math.nextafter(at, 0.0), 0.0001, 1.0]))
    return limits, load, prompt, output, slo


@settings(max_examples=150)
@given(boundary_cases())
@example((DecodeLimits(kv_capacity_tokens=100, max_batch_size=3), DecodeLoad(2.6, 0, 0), 10, 10, None))
@example((DecodeLimits(kv_capacity_tokens=100), DecodeLoad(0, 0, 80.4), 10, 10, None))
@example((DecodeLimits(kv_capacity_tokens=100, max_batch_size=3), DecodeLoad(2.5, 0, 0), 10, 10, None))
def test_a_predicted_load_is_judged_on_each_count_rounded_half_to_even(
    case: tuple[DecodeLimits, DecodeLoad, int, int, float | None],
) -> None:
    """`check_join` on a fractional load gives exactly the verdict (reason and predicted step) the rule gives on
    its batch, context and KV each rounded to the nearest, half to even: never truncated, never left fractional."""
    limits, load, prompt, output, slo = case
    got = check_join(limits, load, prompt_tokens=prompt, output_tokens=output, step_model=COST, tbt_slo_s=slo)
    assert got == rule_on_rounded(limits, load, prompt, output, slo)
    assert load.rounded() == DecodeLoad(round(load.batch_size), round(load.context_tokens), round(load.kv_tokens))


def test_a_step_exactly_at_the_objective_meets_it() -> None:
    """The TBT check refuses a step *over* the objective: one predicted exactly at it is accepted, one a float
    above it is refused."""
    limits = DecodeLimits(kv_capacity_tokens=10_000)
    load = DecodeLoad(1, 100, 200)
    at = COST.step_s(2, 200)
    tie = check_join(limits, load, prompt_tokens=100, output_tokens=10, step_model=COST, tbt_slo_s=at)
    assert tie == JoinVerdict(accepted=True, predicted_tbt_s=at)
    below = math.nextafter(at, 0.0)
    over = check_join(limits, load, prompt_tokens=100, output_tokens=10, step_model=COST, tbt_slo_s=below)
    assert over == JoinVerdict(accepted=False, reason=Reason.TBT_SLO, predicted_tbt_s=at)
    # An objective of 0 is an objective (only None is none): every step is over it.
    zero = check_join(limits, load, prompt_tokens=100, output_tokens=10, step_model=COST, tbt_slo_s=0.0)
    assert zero == JoinVerdict(accepted=False, reason=Reason.TBT_SLO, predicted_tbt_s=at)


def test_a_load_given_without_kv_reserves_none() -> None:
    """`DecodeLoad(batch, context)` (a predictor that predicts no KV) holds no KV: a request that needs exactly the
    capacity joins beside it, one token more is refused for KV."""
    load = DecodeLoad(1, 100)
    assert load == DecodeLoad(1, 100, 0)
    limits = DecodeLimits(kv_capacity_tokens=20)
    assert check_join(limits, load, prompt_tokens=10, output_tokens=10).accepted
    assert check_join(limits, DecodeLoad(1, 100, 1), prompt_tokens=10, output_tokens=10).reason is Reason.KV_BUDGET


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("kv_capacity_tokens", -1),
        ("kv_capacity_tokens", UNLIMITED + 1),
        ("kv_capacity_tokens", 10.0),
        ("max_batch_size", 0),
        ("max_batch_size", UNLIMITED + 1),
        ("max_batch_size", True),
        ("max_context_tokens", 0),
        ("max_context_tokens", UNLIMITED + 1),
    ],
)
def test_limits_out_of_range_are_config_errors_naming_the_field(field: str, value: object) -> None:
    """A capacity below 0, a batch or context limit below 1 (a batch of none could never decode), a limit past
    `UNLIMITED`, or a count that is not an int is a ConfigError naming the field; each bound itself is a limit."""
    bounds = {"kv_capacity_tokens": 0, "max_batch_size": 1, "max_context_tokens": 1}
    kwargs: dict[str, object] = {"kv_capacity_tokens": 1000, field: value}
    with pytest.raises(ConfigError, match=field):
        DecodeLimits(**kwargs)  # type: ignore[arg-type]
    for bound in (bounds[field], UNLIMITED):
        assert getattr(DecodeLimits(**{"kv_capacity_tokens": 1000, field: bound}), field) == bound


def test_no_batch_limit_never_refuses_for_a_full_batch() -> None:
    """`max_batch_size=None` is "as many as fit": the largest load the rule takes is not BATCH_FULL, and one past it
    is a bad load, not a full batch. (UNLIMITED, the stand-in for an unset limit, was 2**61 - 1 while loads up to
    2**62 were taken, so an instance with no batch limit could refuse for a full batch.)"""
    limits = DecodeLimits(kv_capacity_tokens=UNLIMITED)
    verdict = check_join(limits, DecodeLoad(MAX_LOAD - 1, 0, 0), prompt_tokens=1, output_tokens=2)
    assert verdict.accepted, verdict
    with pytest.raises(InvalidRequestError, match="batch_size"):
        check_join(limits, DecodeLoad(MAX_LOAD, 0, 0), prompt_tokens=1, output_tokens=2)


# ------------------------------------------------------------------------------------------------ admission

SLO = Slo(ttft_s=2.0, tbt_s=0.1)


def route(ttft_s: float) -> RouteDecision:
    return RouteDecision(
        prefill_instance=InstanceId("p"), prefix_tokens=0, transfer=None, transfer_s=0.0, queue_s=0.0, prefill_s=ttft_s
    )


@pytest.mark.parametrize("reason", list(Reason), ids=lambda r: r.value)
def test_exactly_the_rejections_for_room_the_decode_side_frees_may_wait(reason: Reason) -> None:
    """A full batch, no KV room and the TBT objective wait (their requests ending frees what they lack); nothing
    else does. A `max_wait_s` of 0 (the paper's early rejection) waits for nothing: the deadline is -inf, not the
    arrival; a NaN one is no bound at all, a ConfigError naming it (as `AdmissionQueue` refuses it)."""
    room = {Reason.BATCH_FULL, Reason.KV_BUDGET, Reason.TBT_SLO}
    assert room == WAITS_FOR_ROOM
    waits = room_wait_deadline(reason, estimated_ttft_s=0.5, arrival_s=10.0, slo=SLO, max_wait_s=5.0)
    assert waits == (11.5 if reason in room else -math.inf)
    assert room_wait_deadline(reason, estimated_ttft_s=0.5, arrival_s=10.0, slo=SLO, max_wait_s=0.0) == -math.inf
    with pytest.raises(ConfigError, match=r"max_wait_s must be a finite number >= 0\.0, got nan"):
        room_wait_deadline(reason, estimated_ttft_s=0.5, arrival_s=10.0, slo=SLO, max_wait_s=math.nan)


@pytest.mark.parametrize("reason", [*STRUCTURAL, Reason.TBT_SLO], ids=lambda r: r.value)
def test_early_rejection_answers_with_the_rules_own_reason(reason: Reason) -> None:
    """Early rejection (current or predicted load) refuses a request the decode rule refused on the chosen instance
    with the rule's reason, whichever it is; the baseline, which asks about no load, admits it."""
    refused = DecodeChoice(decode_instance=InstanceId("d"), verdict=JoinVerdict(accepted=False, reason=reason))
    for policy in (EarlyRejection(), predictive_early_rejection()):
        assert (policy.admit(route(1.0), refused, SLO).reason, policy.name) == (reason, policy.name)
    assert BaselineAdmission().admit(route(1.0), refused, SLO).accepted


# ------------------------------------------------------------------------------------------------ pending blocks


@pytest.mark.parametrize("compiled", PATHS)
def test_every_counted_key_is_found_by_count(compiled: bool) -> None:
    """`count` finds every (owner, key) that `counts` lists, wherever it sits in the table (its first bucket
    included), with that count, and the walk along a prompt continues over each; a key counted for one owner is 0
    for another."""
    with compiled_path(compiled):
        table = PendingBlocks(capacity=16)
        keys = np.arange(600, dtype=np.uint64)
        table.add(0, keys)
        table.add(0, keys[::3])
        table.add(1, keys[:50])
        if compiled:  # the first bucket holds an entry: its lookup is the edge checked
            assert int(table._store._owners[0]) >= 0  # type: ignore[union-attr]
        counted = table.counts()
        assert len(counted) == 650
        for (owner, key), n in counted.items():
            assert table.count(owner, key) == n == (2 if owner == 0 and key % 3 == 0 else 1)
        assert table.count(1, 599) == 0
        # The walk finds them the same way: owner 0 has the whole prompt coming, owner 1 its first 50 keys.
        walked = table.walk(keys, np.zeros(3, dtype=np.int64), np.array([0, 1, -1], dtype=np.int64))
        assert walked.tolist() == [600, 50, 0]


@settings(max_examples=200)
@given(
    st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=8, unique=True),
    st.randoms(use_true_random=False),
)
def test_removing_in_any_order_keeps_every_entry_reachable(keys: list[int], rng: object) -> None:
    """In a table of 16 buckets filled up to half (its most), removing the keys one by one in any order keeps every
    remaining entry reachable from its home bucket (backward-shift deletion, probe runs that wrap around the end
    included) with its count, and the walk along a prompt sees exactly the keys still counted."""
    if not numba_available():
        pytest.skip("numba is not installed: the table is the compiled path")
    with compiled_path(True):
        table = PendingBlocks(capacity=16)
        table.add(0, np.array(keys, dtype=np.uint64))
        model = collections.Counter({(0, key): 1 for key in keys})
        order = list(keys)
        rng.shuffle(order)  # type: ignore[attr-defined]
        for key in order:
            table.remove(0, np.array([key], dtype=np.uint64))
            del model[(0, key)]
            table.check_invariants()
            assert table.counts() == dict(model)
            assert all(table.count(0, k) == 1 for _, k in model)
            prompt = np.array([k for _, k in model], dtype=np.uint64)
            walked = table.walk(prompt, np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64))
            assert walked.tolist() == [len(model)]


# ------------------------------------------------------------------------------------------------ the waiting line


WAIT_SLO = Slo(ttft_s=10.0, tbt_s=0.1)


@attrs.define
class RoomScheduler:
    """Room for `free` units, a request taking `input_length` of them; every estimate 1 s of TTFT. Refuses what
    does not fit with BATCH_FULL (a wait may help), raises for the ids in `raises_for` (scheduled meanwhile by
    another caller, say), and says `lasting` is why no wait could help any request."""

    free: int
    slo: Slo = WAIT_SLO
    lasting: Reason | None = None
    raises_for: set[RequestId] = attrs.field(factory=set)
    tried: list[RequestId] = attrs.field(factory=list)

    def schedule(self, request: Request, now: float, *, waited_s: float = 0.0) -> ScheduleDecision:
        self.tried.append(request.request_id)
        if request.request_id in self.raises_for:
            raise InvalidRequestError(f"request {request.request_id} is already scheduled")
        if request.input_length > self.free:
            return ScheduleDecision(request_id=request.request_id, accepted=False, reason=Reason.BATCH_FULL, ttft_s=1.0)
        self.free -= request.input_length
        return ScheduleDecision(request_id=request.request_id, accepted=True, ttft_s=1.0)

    def lasting_refusal(self, request: Request) -> Reason | None:
        return self.lasting


def waiting_request(name: str, arrival_s: float, size: int) -> Request:
    return Request(request_id=RequestId(name), arrival_s=arrival_s, input_length=size, output_length=2, block_keys=())


def line_with_a_blocked_head(scheduler: RoomScheduler) -> AdmissionQueue[str]:
    """ "H" (5 units, no room) waits at the head until 2 + 5 = 7; "A" and "B", read late (arrived at 0.5), wait
    behind it untried until 0.5 + 5 = 5.5 each."""
    queue: AdmissionQueue[str] = AdmissionQueue(scheduler, max_wait_s=5.0)
    assert queue.arrive("H", waiting_request("h", 2.0, 5), 2.0) is None
    for name in ("A", "B"):
        assert queue.arrive(name, waiting_request(name.lower(), 0.5, 1), 2.0) is None
    assert [queue.deadline(item) for item in queue] == [7.0, 5.5, 5.5]
    return queue


def test_requests_due_at_the_same_time_are_tried_in_line_order() -> None:
    """Two waits ending at the same instant are tried in the order the requests joined the line: the room that
    the blocked head cannot use goes to the one ahead, first come, first served."""
    scheduler = RoomScheduler(free=0)
    queue = line_with_a_blocked_head(scheduler)
    scheduler.free = 1
    decided = queue.pump(5.5)
    assert [(item, d.accepted, d.reason) for item, d in decided] == [("A", True, None), ("B", False, Reason.BATCH_FULL)]
    assert list(queue) == ["H"]


@pytest.mark.parametrize("lasting", [Reason.NO_PREFILL_INSTANCE, Reason.NO_DECODE_INSTANCE, Reason.CONTEXT_TOO_LONG])
def test_an_arrival_no_wait_could_help_is_refused_with_the_schedulers_reason(lasting: Reason) -> None:
    """Behind a waiter, an arrival the scheduler says no wait could get in is refused at once, untried, with the
    reason the scheduler gives (no prefill instance up, no decode instance up, a context none holds)."""
    scheduler = RoomScheduler(free=0)
    queue: AdmissionQueue[str] = AdmissionQueue(scheduler, max_wait_s=5.0)
    assert queue.arrive("H", waiting_request("h", 0.0, 5), 0.0) is None
    scheduler.lasting = lasting
    decision = queue.arrive("X", waiting_request("x", 0.1, 1), 0.1)
    assert decision == ScheduleDecision(request_id=RequestId("x"), accepted=False, reason=lasting)
    assert list(queue) == ["H"] and scheduler.tried == [RequestId("h")]


def test_a_request_whose_try_at_its_deadline_raises_leaves_the_line() -> None:
    """A wait that ends in a try the scheduler raises for (out of turn, at its deadline) propagates, and that
    request leaves the line for good, as one at the head does: it is neither waiting, nor due again, nor handed
    back; the others keep their places and the next pump decides them."""
    scheduler = RoomScheduler(free=0, raises_for={RequestId("a")})
    queue = line_with_a_blocked_head(scheduler)
    scheduler.free = 1
    with pytest.raises(InvalidRequestError, match="request a"):
        queue.pump(5.5)
    assert list(queue) == ["H", "B"] and len(queue) == 2
    with pytest.raises(InvalidRequestError, match="does not wait"):
        queue.deadline("A")
    assert not queue.remove("A")
    assert [(item, d.accepted) for item, d in queue.pump(5.5)] == [("B", True)]
    assert queue.pump(7.0)[0][0] == "H" and len(queue) == 0 and queue.next_deadline() == math.inf
    assert scheduler.tried.count(RequestId("a")) == 1


def test_a_pump_at_no_time_is_refused_and_loses_no_request() -> None:
    """A `now` that is no time (NaN) is the caller's error, not the waiting request's: `pump` refuses it naming
    `now` and the line is unchanged (as `arrive` changes nothing when the request is refused as invalid)."""
    model, hardware = MODELS["llama3-70b"], HARDWARE["8xA800"]
    estimator = TtftEstimator(
        prefill=PrefillCostModel(model=model, hardware=hardware),
        transfer=TransferCostModel(bandwidth_bytes_per_s=25e9),
        kv_bytes_per_token=model.kv_bytes_per_token,
    )
    conductor = Conductor(
        router=LoadBalancingRouter(estimator),
        step_model=COST,
        admission=EarlyRejection(),
        predictor=UniformDecodePredictor(decode_s=10.0),
        slo=Slo(ttft_s=30.0, tbt_s=1.0),
        block_size_tokens=64,
    )
    conductor.add_prefill_instance(InstanceId("prefill-0"))
    conductor.add_decode_instance(InstanceId("decode-0"), DecodeLimits(kv_capacity_tokens=10**6, max_batch_size=1))
    queue: AdmissionQueue[str] = AdmissionQueue(conductor, max_wait_s=5.0)
    for number, name in enumerate(("first", "second")):
        request = Request(
            request_id=RequestId(name), arrival_s=0.0, input_length=64, output_length=10, block_keys=(BlockKey(number),)
        )
        queue.arrive(name, request, 0.0)
    assert list(queue) == ["second"]  # the batch of one is full: it waits
    with pytest.raises(InvalidRequestError, match="now"):
        queue.pump(math.nan)
    assert list(queue) == ["second"]
