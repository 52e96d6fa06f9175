"""Edge contracts of `mooncake.sched.conductor`, `mooncake.sched.decode` and `mooncake.sched.outcome` that the
module tests leave open (found by mutating the product and seeing which changes no test noticed).

Properties: a prefix holder that is down, or any holder without a global pool, is no transfer source; a source's
congestion counts exactly the transfers still moving for requests that wait for them (a brute-force count over
random plans, ends and starts); the queue entries, and the incoming prefills predictors read, carry the current
times; the wait plus the estimate meeting the TTFT objective exactly is in time; every time of a router's decision
is checked (two, the occupancy and the overhead, were not); repeated or late reports change nothing; a removed coupled instance leaves no
coupling behind; the predicted load is asked for the request's arrival; the baseline checks an empty load; the
decode verdict's TBT exemption and its majority reason read the load asked about.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mooncake.cache.events import BlockStored, SequenceGap
from mooncake.errors import ConfigError, InvalidRequestError, SequenceGapError, UnknownInstanceError
from mooncake.sched.admission import BaselineAdmission, EarlyRejection, predictive_early_rejection
from mooncake.sched.conductor import Conductor
from mooncake.sched.decode import choose_decode, lasting_decode_refusal
from mooncake.sched.join import DecodeLimits, DecodeLoad
from mooncake.sched.outcome import Outcome, Reason, RequestEnd
from mooncake.sched.predictor import UniformDecodePredictor
from mooncake.sched.router import KvCacheCentricRouter, RouteDecision
from mooncake.sched.view import (
    BoardLoads,
    DecodeBoard,
    DecodeFinished,
    DecodeJoined,
    DecodeView,
    InstanceDown,
    InstanceUp,
    PrefillBacklog,
    PrefilledInline,
    PrefillFinished,
    PrefillStarted,
    RequestAborted,
)
from mooncake.types import InstanceId, RequestId, Slo, Tier
from tests.sched.test_conductor import (
    BLOCK,
    D0,
    D1,
    DECODE_COST,
    DOC,
    ESTIMATOR,
    P0,
    P1,
    P2,
    occupy,
    request,
)


def make(
    *,
    admission: object = None,
    slo: Slo | None = None,
    transfers: bool = True,
    prefill: Sequence[InstanceId] = (P0, P1, P2),
    decode: Sequence[InstanceId] = (D0, D1),
    limits: DecodeLimits | None = None,
) -> Conductor:
    conductor = Conductor(
        router=KvCacheCentricRouter(ESTIMATOR, threshold=1.5),
        step_model=DECODE_COST,
        admission=admission if admission is not None else BaselineAdmission(),  # type: ignore[arg-type]
        predictor=UniformDecodePredictor(decode_s=10.0),
        slo=slo if slo is not None else Slo(),
        block_size_tokens=BLOCK,
        transfers=transfers,
    )
    conductor.add_prefill_instances(prefill)
    conductor.add_decode_instances(
        decode, limits if limits is not None else DecodeLimits(kv_capacity_tokens=DECODE_COST.capacity_tokens())
    )
    return conductor


def store(conductor: Conductor, instance: InstanceId, keys: Sequence[int], *, epoch: int = 0, seq: int = 0) -> None:
    assert (
        conductor.apply_cache_event(BlockStored(source=instance, seq=seq, epoch=epoch, keys=keys, tier=Tier.VRAM))
        is None
    )


# ---------------------------------------------------------------------------- transfer sources


def test_a_holder_that_is_down_is_no_transfer_source() -> None:
    """An instance that is down may still be heard of by the index (a restart announcing its new epoch): its
    blocks are no prefix to move, since nothing can be fetched from it until it is up."""
    conductor = make()
    conductor.handle(InstanceDown(instance_id=P0, now=0.0))
    store(conductor, P0, DOC, epoch=1)
    decision = conductor.schedule(request("r", DOC), 0.0)
    assert decision.accepted and decision.prefill_instance in (P1, P2)
    assert decision.transfer is None and decision.prefix_tokens == 0
    conductor.check_invariants()


def test_without_a_global_pool_no_prefix_moves() -> None:
    """`transfers=False`: a busy holder's prefix is never planned to move to an idle peer (the same cluster
    with a pool moves it)."""
    for transfers in (True, False):
        conductor = make(transfers=transfers)
        occupy(conductor, P0, count=3)
        store(conductor, P0, DOC)
        decision = conductor.schedule(request("r", DOC), 0.0)
        assert decision.accepted
        if transfers:
            assert decision.transfer is not None and decision.transfer.source == P0
        else:
            assert decision.transfer is None
            assert decision.prefill_instance == P0 or decision.prefix_tokens == 0
        conductor.check_invariants()


@given(now=st.floats(min_value=0.5, max_value=1e4, allow_nan=False))
@settings(max_examples=20)
def test_a_queued_transfer_is_published_in_the_decisions_clock(now: float) -> None:
    """The queue entry's `transfer_finish_s` is the decision's time plus the transfer's estimate: the instant from
    which the source going down no longer dooms the request."""
    conductor = make()
    occupy(conductor, P0, count=3, now=now)
    store(conductor, P0, DOC)
    decision = conductor.schedule(request("r", DOC), now)
    assert decision.transfer is not None and decision.prefill_instance is not None
    (entry,) = [e for v in conductor.prefill_views for e in v.queue if e.request_id == "r"]
    assert entry.transfer_source == P0
    assert entry.transfer_finish_s == now + decision.transfer.transfer_s
    assert conductor.incoming(decision.decode_instance)[-1].transfer_finish_s == entry.transfer_finish_s  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- the wait and the TTFT objective


@pytest.mark.parametrize("admission", [BaselineAdmission(), EarlyRejection()], ids=["baseline", "early_rejection"])
def test_a_wait_that_leaves_exactly_the_estimate_is_in_time(admission: object) -> None:
    """The wait plus the TTFT estimate equal to the objective meets it (as an estimate equal to it does); a wait
    a little longer is a TTFT rejection that reserves nothing."""
    probe = make().schedule(request("probe", DOC), 0.0)
    assert probe.ttft_s is not None
    waited = 0.75
    slo = Slo(ttft_s=waited + probe.ttft_s, tbt_s=1.0)
    conductor = make(admission=admission, slo=slo)
    on_time = conductor.schedule(request("on-time", DOC), 0.0, waited_s=waited)
    assert on_time.ttft_s == probe.ttft_s and waited + on_time.ttft_s == slo.ttft_s
    assert on_time.accepted
    conductor.handle(RequestAborted(request_id=RequestId("on-time"), now=0.0))
    late = conductor.schedule(request("late", DOC), 0.0, waited_s=waited + 1e-6)
    assert (late.accepted, late.reason, conductor.in_flight) == (False, Reason.TTFT_SLO, ())


# ---------------------------------------------------------------------------- a plugged-in router's decision


class _Misrouting:
    """A router that asks the real one, then breaks its answer with `change`."""

    def __init__(self, change: Callable[[RouteDecision], RouteDecision]) -> None:
        self.inner = KvCacheCentricRouter(ESTIMATOR, threshold=1.5)
        self.change = change
        self.observed: list[dict[str, object]] = []

    def route(self, *args: Any) -> RouteDecision | None:
        route = self.inner.route(*args)
        return None if route is None else self.change(route)

    def observe(self, **observed: object) -> None:
        self.observed.append(observed)


def misrouted(change: Callable[[RouteDecision], RouteDecision]) -> Conductor:
    conductor = make()
    conductor.router = _Misrouting(change)
    return conductor


@pytest.mark.parametrize(
    ("field", "value"),
    [
        *((field, value) for field in ("queue_s", "transfer_s", "prefill_s") for value in (-1.0, -1e-9, math.inf)),
        ("overhead_s", -100.0),  # the TTFT it makes is negative
        ("overhead_s", math.inf),
    ],
)
def test_a_routers_time_that_is_negative_or_infinite_is_refused(field: str, value: float) -> None:
    """Each of the times a router's decision is judged on must be a finite, non-negative number of seconds, and so
    must the TTFT they make (an overhead that makes it negative or infinite); the Conductor is left unchanged by a
    decision that breaks this."""
    conductor = misrouted(lambda route: attrs.evolve(route, **{field: value}))
    with pytest.raises(ConfigError, match=r"router .*_Misrouting.*negative or not finite"):
        conductor.schedule(request("r", DOC), 0.0)
    assert conductor.in_flight == () and all(not v.queue for v in conductor.prefill_views)
    conductor.check_invariants()


@pytest.mark.parametrize("prefix_tokens", [-1, len(DOC) * BLOCK + 1, 1.5, True])
def test_a_routers_prefix_that_is_no_count_of_the_prompt_is_refused(prefix_tokens: object) -> None:
    """A decision's prefix is a count of the prompt's tokens, 0 up to its length: one below or past it (or no
    integer) is named, not passed on to the ScheduleDecision and the prefill that would compute a negative rest."""
    conductor = misrouted(lambda route: attrs.evolve(route, prefix_tokens=prefix_tokens))
    with pytest.raises(ConfigError, match=r"router .*_Misrouting.*a prefix that is no count"):
        conductor.schedule(request("r", DOC), 0.0)
    assert conductor.in_flight == () and all(not v.queue for v in conductor.prefill_views)
    conductor.check_invariants()


def test_a_router_choosing_an_instance_that_is_down_is_refused() -> None:
    """A router that picks a known prefill instance that is down (not among its candidates) is named."""
    conductor = misrouted(lambda route: attrs.evolve(route, prefill_instance=P2))
    conductor.handle(InstanceDown(instance_id=P2, now=0.0))
    with pytest.raises(ConfigError, match=r"router .*_Misrouting.*not up"):
        conductor.schedule(request("r", DOC), 0.0)
    assert conductor.in_flight == ()
    conductor.check_invariants()


@pytest.mark.parametrize(
    "change",
    [
        {"occupancy_s": -5.0},
        {"occupancy_s": math.nan},
        {"overhead_s": -0.5},
    ],
    ids=["negative-occupancy", "nan-occupancy", "negative-overhead"],
)
def test_every_time_of_a_routers_decision_is_checked(change: dict[str, float]) -> None:
    """`_check_route` promises a decision whose times are finite and not negative: the occupancy (when the next
    prefill may start) and the first-token overhead are times of the decision too."""
    conductor = misrouted(lambda route: attrs.evolve(route, **change))
    with pytest.raises(ConfigError, match=r"router .*_Misrouting"):
        conductor.schedule(request("r", DOC), 0.0)
    assert conductor.in_flight == ()


# ---------------------------------------------------------------------------- repeated and late reports


def test_a_repeated_prefill_finished_teaches_once_and_moves_nothing_back() -> None:
    """A second PrefillFinished (a retried report), before or after the request joined its decode batch, is
    ignored: the router learns from it once, and a decoding request stays decoding (its KV counted as used)."""
    conductor = make()
    router = _Misrouting(lambda route: route)
    conductor.router = router
    decision = conductor.schedule(request("r", DOC), 0.0)
    prefill, decode = decision.prefill_instance, decision.decode_instance
    assert prefill is not None and decode is not None
    finished = PrefillFinished(request_id=RequestId("r"), instance_id=prefill, now=1.0)
    assert conductor.handle(finished) == ()
    assert conductor.handle(attrs.evolve(finished, now=1.5)) == ()
    assert len(router.observed) == 1 and router.observed[0]["observed_ttft_s"] == 1.0
    joined = DecodeJoined(
        request_id=RequestId("r"), instance_id=decode, now=2.0, context_tokens=8192, output_tokens=100
    )
    assert conductor.handle(joined) == ()
    assert conductor.handle(attrs.evolve(finished, now=2.5)) == ()
    assert len(router.observed) == 1
    conductor.check_invariants()
    (view,) = [v for v in conductor.decode_views if v.instance_id == decode]
    assert (view.used_tokens, view.reserved_tokens) == (8192 + 100, 0)
    ends = conductor.handle(DecodeFinished(request_id=RequestId("r"), instance_id=decode, now=3.0))
    assert ends == (RequestEnd(RequestId("r"), Outcome.COMPLETED),)
    assert (view.used_tokens, view.reserved_tokens) == (0, 0)


def test_a_late_prefilled_inline_or_repeated_join_changes_nothing() -> None:
    """PrefilledInline about a request that already left its queue (prefill finished) or joined its decode batch
    is ignored, and so is a repeated DecodeJoined (claiming more context): a decoding request keeps its place in
    the batch and the KV it was counted with."""
    conductor = make()
    decision = conductor.schedule(request("r", DOC), 0.0)
    prefill, decode = decision.prefill_instance, decision.decode_instance
    assert prefill is not None and decode is not None
    inline = PrefilledInline(request_id=RequestId("r"), instance_id=decode, now=1.0)
    assert conductor.handle(PrefillFinished(request_id=RequestId("r"), instance_id=prefill, now=1.0)) == ()
    assert conductor.handle(inline) == ()
    conductor.check_invariants()
    joined = DecodeJoined(
        request_id=RequestId("r"), instance_id=decode, now=2.0, context_tokens=8192, output_tokens=100
    )
    assert conductor.handle(joined) == ()
    assert conductor.handle(attrs.evolve(inline, now=2.5)) == ()
    assert conductor.handle(attrs.evolve(joined, now=2.5, context_tokens=9000, output_tokens=900)) == ()
    conductor.check_invariants()
    (view,) = [v for v in conductor.decode_views if v.instance_id == decode]
    assert list(view.active) == ["r"] and view.used_tokens == 8192 + 100 and view.reserved_tokens == 0


# ---------------------------------------------------------------------------- instances that come and go

LIMITS = DecodeLimits(kv_capacity_tokens=DECODE_COST.capacity_tokens())
C0 = InstanceId("worker-0")  # sorts after the decode instances: a board slot of its own


def test_a_coupled_instances_id_added_back_as_decode_only_serves_the_prefill_instances() -> None:
    """A removed coupled instance leaves nothing of its coupling behind: its id added back as a decode instance
    takes requests prefilled elsewhere (the only decode instance there is), and added back as a prefill
    instance it hands what it prefills to a decode instance."""
    conductor = make(decode=())
    conductor.add_coupled_instance(C0, LIMITS)
    conductor.remove_instance(C0, 0.0)
    conductor.add_decode_instance(C0, LIMITS)
    decision = conductor.schedule(request("r", DOC), 0.0)
    assert decision.accepted and (decision.prefill_instance, decision.decode_instance) != (C0, C0)
    assert decision.decode_instance == C0
    conductor.check_invariants()

    conductor = make(prefill=(), decode=(D0,))
    conductor.add_coupled_instance(C0, LIMITS)
    conductor.remove_instance(C0, 0.0)
    conductor.add_prefill_instance(C0)
    decision = conductor.schedule(request("r", DOC), 0.0)
    assert decision.accepted and (decision.prefill_instance, decision.decode_instance) == (C0, D0)
    conductor.check_invariants()


def busy(conductor: Conductor, instance: InstanceId, other: InstanceId) -> None:
    """Two uncached 8,192-token prompts queued on `instance` (`other` down meanwhile), ended on the decode side at
    once: `instance`'s queue is long, every decode slot free."""
    conductor.handle(InstanceDown(instance_id=other, now=0.0))
    for i in range(2):
        name = f"filler-{instance}-{i}"
        assert conductor.schedule(request(name, range(10_000 * (i + 1), 10_000 * (i + 1) + 32)), 0.0).accepted
    conductor.handle(InstanceUp(instance_id=other, now=0.0))


@pytest.mark.parametrize("full", ["context", "batch"])
def test_in_a_mixed_fleet_a_request_the_coupled_instance_cannot_take_goes_the_other_way(full: str) -> None:
    """A coupled instance that is idle is the fastest route, but it cannot hold the prompt (its context is too
    short) or its one slot is taken: the request goes to a prefill instance and a decode instance instead of
    being refused (as too long for every instance, though the decode instance could hold it, or for a full
    batch while the decode instance sat idle); and the reverse, a decode side with no room, goes coupled."""
    small = DecodeLimits(kv_capacity_tokens=10**6, max_context_tokens=8 * BLOCK, max_batch_size=1)
    conductor = make(prefill=(P0,), decode=(D0,), admission=EarlyRejection())  # it checks the decode side's room
    conductor.add_coupled_instance(C0, small)
    busy(conductor, P0, C0)  # the prefill instance is busy: the coupled one would be faster
    if full == "batch":
        taken = conductor.schedule(request("taken", range(900, 904)), 0.0)
        assert (taken.prefill_instance, taken.decode_instance) == (C0, C0)
    keys = range(100, 104) if full == "batch" else range(100, 112)  # 12 blocks: past its 8-block context
    decision = conductor.schedule(request("r", keys), 0.0)
    assert decision.accepted and (decision.prefill_instance, decision.decode_instance) == (P0, D0)
    assert conductor.lasting_refusal(request("again", keys)) is None
    conductor.check_invariants()

    reverse = make(
        prefill=(P0,),
        decode=(D0,),
        limits=DecodeLimits(kv_capacity_tokens=10**6, max_batch_size=1),
        admission=EarlyRejection(),
    )
    reverse.add_coupled_instance(C0, DecodeLimits(kv_capacity_tokens=10**6))
    busy(reverse, C0, P0)  # slower than the prefill instance now
    assert reverse.schedule(request("first", range(10, 14)), 0.0).decode_instance == D0  # its one slot
    second = reverse.schedule(request("second", range(20, 24)), 0.0)
    assert second.accepted and second.decode_instance == C0
    reverse.check_invariants()


def test_in_a_mixed_fleet_a_request_too_long_for_the_kind_up_waits_for_the_other() -> None:
    """The prefill instance is down and the coupled instance's context is too short for the prompt, which the
    decode instance could hold: the cluster is unavailable for it (a 503), as `lasting_refusal` says, not the
    request wrong (the 400 of CONTEXT_TOO_LONG); once the prefill instance is back it is served."""
    conductor = make(
        prefill=(P0,),
        decode=(D0,),
        admission=EarlyRejection(),
        limits=DecodeLimits(kv_capacity_tokens=10**6, max_context_tokens=64 * BLOCK),
    )
    conductor.add_coupled_instance(C0, DecodeLimits(kv_capacity_tokens=10**6, max_context_tokens=8 * BLOCK))
    conductor.handle(InstanceDown(instance_id=P0, now=0.0))
    keys = range(100, 112)  # 12 blocks: past the coupled instance's 8-block context
    assert conductor.lasting_refusal(request("probe", keys)) is None
    decision = conductor.schedule(request("r", keys), 0.0)
    assert not decision.accepted and decision.reason is Reason.NO_PREFILL_INSTANCE
    conductor.handle(InstanceUp(instance_id=P0, now=1.0))
    assert conductor.schedule(request("again", keys), 1.0).accepted
    too_long = range(1000, 1100)  # past every instance: never served here
    assert conductor.schedule(request("huge", too_long), 1.0).reason is Reason.CONTEXT_TOO_LONG
    conductor.check_invariants()


def test_in_a_mixed_fleet_a_request_too_long_for_one_kind_waits_for_room_on_the_other() -> None:
    """The coupled instance's context is too short for the prompt; the decode instance could hold it, but its
    one slot is taken: the request is refused for the room it waits for (BATCH_FULL, which an admission line
    holds), not as too long (a 400) nor as if no prefill instance were up (a 503)."""
    conductor = make(
        prefill=(P0,),
        decode=(D0,),
        admission=EarlyRejection(),
        limits=DecodeLimits(kv_capacity_tokens=10**6, max_context_tokens=64 * BLOCK, max_batch_size=1),
    )
    conductor.add_coupled_instance(C0, DecodeLimits(kv_capacity_tokens=10**6, max_context_tokens=8 * BLOCK))
    filler = conductor.schedule(request("filler", range(5000, 5060)), 0.0)
    assert filler.accepted and filler.decode_instance == D0
    keys = range(100, 112)  # 12 blocks: past the coupled instance's 8-block context
    assert conductor.lasting_refusal(request("probe", keys)) is None
    decision = conductor.schedule(request("r", keys), 0.0)
    assert not decision.accepted and decision.reason is Reason.BATCH_FULL
    conductor.check_invariants()


# ---------------------------------------------------------------------------- what the decode side is checked on


@attrs.define
class _RecordingPredictor:
    """The uniform predictor, recording what it was asked."""

    inner: UniformDecodePredictor = attrs.field(factory=lambda: UniformDecodePredictor(decode_s=10.0))
    calls: list[tuple[int, int, float, float]] = attrs.field(factory=list)

    def predict(self, active: Sequence[Any], incoming: Sequence[Any], now: float, at_s: float) -> Any:
        self.calls.append((len(active), len(incoming), now, at_s))
        return self.inner.predict(active, incoming, now, at_s)

    def observe(self, output_tokens: int) -> None:
        self.inner.observe(output_tokens)


@given(now=st.floats(min_value=0.0, max_value=1e5, allow_nan=False), backlog=st.sampled_from([0.0, 0.5, 7.0]))
@settings(max_examples=25)
def test_the_predicted_load_is_asked_for_the_requests_arrival(now: float, backlog: float) -> None:
    """With a predictive policy, each decode instance's load is predicted at the request's arrival there: the
    decision's time plus its estimated TTFT (the queue ahead of it included) plus the KV stream's tail, here one
    latency (the prefill hides the rest: `TransferCostModel.handoff_s`), with what it decodes and what is routed
    to it."""
    tail = ESTIMATOR.transfer.latency_s
    predictor = _RecordingPredictor()
    conductor = make(admission=EarlyRejection(predictive=True), slo=Slo(ttft_s=100.0, tbt_s=1.0))
    conductor.predictor = predictor
    for instance in (P0, P1, P2):
        conductor.handle(PrefillBacklog(instance_id=instance, now=now, until_s=now + backlog))
    first = conductor.schedule(request("first", DOC), now)
    assert first.accepted and first.ttft_s is not None
    assert first.ttft_s >= backlog
    assert predictor.calls == [(0, 0, now, now + first.ttft_s + tail)] * 2
    predictor.calls.clear()
    second = conductor.schedule(request("second", range(500, 532)), now)
    assert second.ttft_s is not None
    routed = {d: int(first.decode_instance == d) for d in (D0, D1)}
    assert predictor.calls == [(0, routed[d], now, now + second.ttft_s + tail) for d in (D0, D1)]


def test_a_decode_instance_may_report_its_cache() -> None:
    """Any instance of the Conductor may feed the index (a decode instance's cache is a source of blocks too);
    only an id it does not know is refused."""
    conductor = make()
    for instance in (D0, P1):
        assert conductor.apply_cache_event(BlockStored(source=instance, seq=0, keys=DOC[:4], tier=Tier.DRAM)) is None
    with pytest.raises(UnknownInstanceError, match="decode-9"):
        conductor.apply_cache_event(BlockStored(source=InstanceId("decode-9"), seq=0, keys=DOC[:4], tier=Tier.DRAM))


# ---------------------------------------------------------------------------- congestion at a transfer source

congestion_ops = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.sampled_from([0.0, 0.0, 0.005, 0.02, 0.1])),
        st.tuples(st.sampled_from(["abort", "start"]), st.integers(min_value=0, max_value=15)),
    ),
    min_size=1,
    max_size=18,
)


@given(congestion_ops)
@settings(max_examples=40)
# Transfers ending at 0.104 s, then 0.052 s and 0.078 s planned under less congestion; the 0.052 s one ends first:
# what is left must still give the earliest finish first, or one estimated done at 0.1 s is still counted.
@example([("arrive", 0.0)] * 4 + [("abort", 0)] * 3 + [("arrive", 0.0)] * 2 + [("abort", 1), ("arrive", 0.1)])
def test_a_sources_congestion_counts_the_transfers_still_moving_for_a_waiting_request(
    ops: list[tuple[str, Any]],
) -> None:
    """Every transfer planned from a busy holder is charged the transfers from it that are still moving (by their
    estimates) for requests that still wait for them: not those whose request ended or started its prefill, nor
    those estimated done, whatever order they were planned, ended and started in (a brute-force count)."""
    conductor = make(slo=Slo(ttft_s=1e3, tbt_s=1.0))
    occupy(conductor, P0, count=20)  # about 18 s of prefill ahead on the holder
    documents = [tuple(range(1000 * (d + 1), 1000 * (d + 1) + 32)) for d in range(len(ops))]
    for seq, document in enumerate(documents):
        store(conductor, P0, document, seq=seq)
    now, waiting, placed = 0.0, {}, {}  # request → its transfer's estimated finish; request → its prefill instance
    for i, (kind, value) in enumerate(ops):
        if kind == "arrive":
            now += value
            decision = conductor.schedule(request(f"r{i}", documents[i]), now)
            plan = decision.transfer
            assert decision.accepted and plan is not None and plan.source == P0, decision
            charged = (plan.transfer_s - ESTIMATOR.transfer.latency_s) * ESTIMATOR.transfer.bandwidth_bytes_per_s
            assert round(charged / plan.num_bytes) - 1 == sum(finish > now for finish in waiting.values())
            waiting[decision.request_id] = now + plan.transfer_s
            placed[decision.request_id] = decision.prefill_instance
        elif waiting:
            request_id = sorted(waiting)[value % len(waiting)]
            del waiting[request_id]
            if kind == "abort":
                conductor.handle(RequestAborted(request_id=request_id, now=now))
            else:
                conductor.handle(PrefillStarted(request_id=request_id, instance_id=placed[request_id], now=now))
        conductor.check_invariants()


def test_a_policy_that_leaves_the_check_to_the_instance_fills_past_its_batch() -> None:
    """The baseline (`load_at` none) asks the decode rule about an empty instance: a second request goes to the one
    decode instance whose only batch slot is already promised, where that instance's own check will judge it."""
    conductor = make(decode=(D0,), limits=DecodeLimits(kv_capacity_tokens=10**6, max_batch_size=1))
    first = conductor.schedule(request("first", DOC), 0.0)
    second = conductor.schedule(request("second", range(500, 532)), 0.0)
    assert (first.decode_instance, second.decode_instance) == (D0, D0)
    assert first.accepted and second.accepted
    early = make(
        admission=EarlyRejection(), decode=(D0,), limits=DecodeLimits(kv_capacity_tokens=10**6, max_batch_size=1)
    )
    assert early.schedule(request("first", DOC), 0.0).accepted
    refused = early.schedule(request("second", range(500, 532)), 0.0)
    assert (refused.accepted, refused.reason) == (False, Reason.BATCH_FULL)


# ---------------------------------------------------------------------------- what predictors read


def assert_incoming_follows_the_queues(conductor: Conductor) -> None:
    """Each prefill queued for a decode instance is, as it is now timed, among the instance's incoming prefills."""
    queued = {e.request_id: e for v in conductor.prefill_views for e in v.queue}
    for view in conductor.decode_views:
        for entry in conductor.incoming(view.instance_id):
            if entry.request_id in queued:
                assert entry == queued[entry.request_id]


@given(
    starts=st.lists(
        st.tuples(st.integers(min_value=0, max_value=5), st.sampled_from([0.0, 0.3, 2.0, 9.0])), max_size=6
    ),
    aborts=st.lists(st.integers(min_value=0, max_value=5), max_size=3),
)
# A start reported late behind an overrun: the overrun's instance-free time, extended by rounding, passed its end.
@example(starts=[(0, 0.3), (1, 0.3), (3, 0.3)], aborts=[])
@settings(max_examples=30)
def test_the_incoming_prefills_carry_the_queues_current_times(
    starts: list[tuple[int, float]], aborts: list[int]
) -> None:
    """A queue retimed by a late start or by an end ahead (its entries' start, finish and frees times move) is what
    `incoming` reports: a predictor of the decode load reads when each prefill will arrive."""
    conductor = make(prefill=(P0,))
    for i in range(6):
        assert conductor.schedule(request(f"r{i}", range(1000 * (i + 1), 1000 * (i + 1) + 8)), 0.0).accepted
    assert_incoming_follows_the_queues(conductor)
    for index, late in starts:
        queue = conductor.prefill_views[0].queue
        entry = queue[min(index, len(queue) - 1)] if queue else None
        if entry is not None and not entry.started:
            conductor.handle(PrefillStarted(request_id=entry.request_id, instance_id=P0, now=entry.start_s + late))
            assert_incoming_follows_the_queues(conductor)
    for index in aborts:
        queue = conductor.prefill_views[0].queue
        if queue:
            conductor.handle(RequestAborted(request_id=queue[index % len(queue)].request_id, now=1.0))
            assert_incoming_follows_the_queues(conductor)
    conductor.check_invariants()


@given(early=st.booleans(), off=st.sampled_from([0.05, 0.5, 10.0]), inline=st.booleans())
@settings(max_examples=20)
def test_a_finished_prefill_reaches_the_decode_side_when_it_ended(early: bool, off: float, inline: bool) -> None:
    """A prefill that ended earlier or later than predicted is, to the decode side's predictors, a first token
    that came when it ended: its incoming entry finishes then (it kept the estimate, so a prefill that ran long
    looked decoded and gone). On a one-slot instance that request still holds the slot: the next one is refused."""
    conductor = make(
        prefill=(P0,),
        decode=(D0,),
        admission=predictive_early_rejection(),
        limits=DecodeLimits(kv_capacity_tokens=10**7, max_batch_size=1),
    )
    conductor.predictor = UniformDecodePredictor(decode_s=1.0)
    first = conductor.schedule(request("r0", range(1000, 1016)), 0.0)
    assert first.accepted
    conductor.handle(PrefillStarted(request_id=RequestId("r0"), instance_id=P0, now=0.0))
    ended = max(first.ttft_s - off, 0.0) if early else first.ttft_s + off
    if inline:
        conductor.handle(PrefilledInline(request_id=RequestId("r0"), instance_id=D0, now=ended))
    else:
        conductor.handle(PrefillFinished(request_id=RequestId("r0"), instance_id=P0, now=ended))
    (entry,) = conductor.incoming(D0)
    assert entry.finish_s == ended and entry.start_s <= entry.frees_s <= entry.finish_s
    later = conductor.schedule(request("r1", range(2000, 2004)), ended + 0.5)
    assert not later.accepted and later.reason is Reason.BATCH_FULL
    conductor.check_invariants()


# ---------------------------------------------------------------------------- decode selection's verdict


def _decode_view(instance: InstanceId, *, reserved: int) -> DecodeView:
    view = DecodeView(instance, DecodeLimits(kv_capacity_tokens=10**7))
    for i in range(reserved):
        view.reserve(RequestId(f"on-its-way-{i}"), 1000, 10)
    return view


@pytest.mark.parametrize(("reserved", "checked_batch"), [(4, 0), (0, 3)])
def test_the_tbt_check_exempts_an_empty_batch_of_the_load_asked_about(reserved: int, checked_batch: int) -> None:
    """The TBT check of the verdict reads the batch of the load the policy asks about (not the committed one that
    ranks): a request joining what is predicted to be an empty batch slows nobody down, so it passes whatever its
    step; one joining a predicted batch of three is held to the objective, however idle the instance is now."""
    choice = choose_decode(
        DecodeBoard([_decode_view(D0, reserved=reserved)]),
        prompt_tokens=1000,
        output_tokens=100,
        step_model=DECODE_COST,
        tbt_slo_s=1e-9,
        loads=BoardLoads.of([DecodeLoad(checked_batch, 1000 * checked_batch, 0)]),
    )
    assert choice.decode_instance == D0
    assert choice.verdict.accepted == (checked_batch == 0)
    assert choice.verdict.reason is (None if checked_batch == 0 else Reason.TBT_SLO)
    assert choice.tbt_s == DECODE_COST.step_s(checked_batch + 1, 1000 * (checked_batch + 1))


@pytest.mark.parametrize("kv_full", [2, 3])
def test_with_no_room_anywhere_the_reason_most_instances_give_wins(kv_full: int) -> None:
    """No instance can take the request now: the verdict names the bound that most instances up refuse it for
    (here KV room, given by two or three of them), not the earliest bound any one of them gives (a full batch)."""
    batch_full = DecodeView(D0, DecodeLimits(kv_capacity_tokens=10**6, max_batch_size=1))
    kv = [DecodeView(InstanceId(f"decode-kv-{i}"), DecodeLimits(kv_capacity_tokens=5000)) for i in range(kv_full)]
    board = DecodeBoard([batch_full, *kv])
    loads = {D0: DecodeLoad(1, 1000, 1100)} | {v.instance_id: DecodeLoad(1, 4000, 4500) for v in kv}
    choice = choose_decode(
        board,
        prompt_tokens=1000,
        output_tokens=100,
        step_model=DECODE_COST,
        tbt_slo_s=1.0,
        loads=BoardLoads.of([loads[i] for i in board.instance_ids]),
    )
    assert choice.decode_instance is None and choice.verdict.reason is Reason.KV_BUDGET


@pytest.mark.parametrize(("prompt", "output"), [(0, 10), (10, 0), (-1, 10), (10, 1.5), (True, 10), ("10", 10)])
def test_a_lasting_refusal_of_no_token_count_is_an_invalid_request(prompt: object, output: object) -> None:
    """`lasting_decode_refusal` checks its token counts as `choose_decode` does, whatever the views."""
    for views in ([], [_decode_view(D0, reserved=0)]):
        with pytest.raises(InvalidRequestError):
            lasting_decode_refusal(views, prompt_tokens=prompt, output_tokens=output)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- what a rejection says


def test_a_rejection_names_where_routing_got_and_the_estimates_it_was_taken_on() -> None:
    """A request rejected for its TTFT still names the prefill and decode instances it was routed to and the
    TTFT and TBT estimated there (the gateway and the metrics report them); one with no prefill instance up names
    none, and neither holds anything."""
    conductor = make(admission=EarlyRejection(), slo=Slo(ttft_s=0.1, tbt_s=1.0))
    late = conductor.schedule(request("late", DOC), 0.0)
    assert (late.accepted, late.reason) == (False, Reason.TTFT_SLO)
    assert late.prefill_instance in (P0, P1, P2) and late.decode_instance in (D0, D1)
    assert late.ttft_s is not None and late.ttft_s > 0.1 and late.tbt_s == DECODE_COST.step_s(1, 8192)
    for instance in (P0, P1, P2):
        conductor.handle(InstanceDown(instance_id=instance, now=0.0))
    nowhere = conductor.schedule(request("nowhere", DOC), 0.0)
    assert (nowhere.accepted, nowhere.reason) == (False, Reason.NO_PREFILL_INSTANCE)
    assert (nowhere.prefill_instance, nowhere.decode_instance, nowhere.ttft_s, nowhere.tbt_s) == (None,) * 4
    assert conductor.in_flight == ()
    conductor.check_invariants()


@pytest.mark.parametrize("predictive", [True, False], ids=["predictive", "now"])
def test_a_coupled_instance_is_judged_on_its_own_load_among_decode_instances(predictive: bool) -> None:
    """In a cluster of a decode instance and a coupled one (added after it), a request prefilled on the coupled
    instance is judged on the coupled instance's load, predicted or committed: its one batch slot taken, the next
    request is refused however idle the decode instance is."""
    limits = DecodeLimits(kv_capacity_tokens=10**6, max_batch_size=1)
    conductor = make(
        admission=EarlyRejection(predictive=predictive), slo=Slo(ttft_s=100.0, tbt_s=1.0), prefill=(), decode=(D0,)
    )
    conductor.set_decode_limits(D0, limits)
    conductor.add_coupled_instance(C0, limits)
    first = conductor.schedule(request("first", DOC), 0.0)
    assert (first.accepted, first.prefill_instance, first.decode_instance) == (True, C0, C0)
    second = conductor.schedule(request("second", range(500, 532)), 0.0)
    assert (second.accepted, second.reason) == (False, Reason.BATCH_FULL)
    conductor.check_invariants()


def test_a_lost_cache_event_is_returned_when_not_strict() -> None:
    """`apply_cache_event(strict=False)` hands a gap in a source's events back as a `SequenceGap` (the caller asks
    the source for a snapshot) instead of raising it; strict, it raises."""
    conductor = make()
    store(conductor, P0, DOC[:2], seq=0)
    skipped = BlockStored(source=P0, seq=5, keys=DOC[2:4], tier=Tier.VRAM)
    gap = conductor.apply_cache_event(skipped, strict=False)
    assert isinstance(gap, SequenceGap) and gap.source == P0
    with pytest.raises(SequenceGapError):
        conductor.apply_cache_event(BlockStored(source=P1, seq=3, keys=DOC[:2], tier=Tier.VRAM))


@pytest.mark.parametrize("later", [0.5, 0.95])
def test_a_request_routed_ahead_counts_from_when_it_joins_its_decode_instance(later: float) -> None:
    """With a first-token overhead of 0.5 s and a t_d of 1 s on a one-slot decode instance, A (accepted first)
    joins at its prefill's end plus the overhead and the KV's tail, and decodes for 1 s from then: B, whose own
    arrival there falls in that second, is refused for the slot (the predictors counted A from its prefill's
    end, so B at 0.95 was accepted and then refused by the instance after its prefill)."""
    estimator = attrs.evolve(ESTIMATOR, first_token_overhead_s=0.5)
    conductor = Conductor(
        router=KvCacheCentricRouter(estimator, threshold=1.5),
        step_model=DECODE_COST,
        admission=predictive_early_rejection(),
        predictor=UniformDecodePredictor(decode_s=1.0),
        slo=Slo(),
        block_size_tokens=BLOCK,
        transfers=True,
    )
    conductor.add_prefill_instances([P0])
    conductor.add_decode_instances([D0], DecodeLimits(kv_capacity_tokens=10**7, max_batch_size=1))
    assert conductor.schedule(request("a", range(1000, 1016)), 0.0).accepted
    (entry,) = conductor.incoming(D0)
    assert entry.joins_s == entry.finish_s + 0.5 + ESTIMATOR.transfer.latency_s  # the prefill hides the KV
    b = conductor.schedule(request("b", range(2000, 2001), tokens=16), later)
    assert later + b.ttft_s < entry.joins_s + 1.0  # B would arrive while A decodes
    assert not b.accepted and b.reason is Reason.BATCH_FULL
