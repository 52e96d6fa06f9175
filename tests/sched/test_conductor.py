"""Tests for `mooncake.sched.conductor.Conductor`.

Three layers: example tests for the contracts (routing to the prefix holder,
transfers from the best holder, down instances, the event flow, duplicate ids);
a `RuleBasedStateMachine` that drives random arrivals and events (prefill
started and finished, decode joined and finished, rejection by decode, instances
down and up, caches loading and dropping prefixes, time passing) against a
simple model of what must be in flight where and how each request ended; and a
property that replays one random program twice from the same seed and gets the
same decisions.
"""

from __future__ import annotations

import collections
import itertools
import math
import random
import re
from collections.abc import Sequence
from typing import Any

import attrs
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mooncake.cache.events import AllBlocksCleared, BlockStored
from mooncake.errors import ConfigError, InvalidRequestError, UnknownInstanceError
from mooncake.sched.admission import AdmissionDecision, AdmissionPolicy, BaselineAdmission, EarlyRejection
from mooncake.sched.conductor import Conductor, ScheduleDecision
from mooncake.sched.cost import HARDWARE, MODELS, ChunkedPipelineCost, PrefillCostModel, TransferCostModel
from mooncake.sched.join import DecodeLimits, DecodeLoad, check_join
from mooncake.sched.outcome import Outcome, Reason, RequestEnd
from mooncake.sched.predictor import OutputLengthPredictor, UniformDecodePredictor
from mooncake.sched.router import (
    AdaptiveThreshold,
    KvCacheCentricRouter,
    LoadBalancingRouter,
    RandomRouter,
    RouteDecision,
    RouteQuery,
    Router,
    TransferPlan,
    TtftEstimator,
    local_cache_aware_router,
)
from mooncake.sched.step import DecodeCostModel
from mooncake.sched.view import (
    DecodeFinished,
    DecodeJoined,
    InstanceDown,
    InstanceUp,
    PrefillBacklog,
    PrefilledInline,
    PrefillFinished,
    PrefillStarted,
    PrefillView,
    RequestAborted,
    RequestRejected,
    Reservation,
)
from mooncake.types import BlockKey, InstanceId, Request, RequestId, Slo, Tier
from tests.reference.sched import HoldingsModel

LLAMA3 = MODELS["llama3-70b"]
A800 = HARDWARE["8xA800"]
BLOCK = 256
ESTIMATOR = TtftEstimator(
    prefill=PrefillCostModel(model=LLAMA3, hardware=A800),  # 0.92 s for 8,192 tokens
    transfer=TransferCostModel(bandwidth_bytes_per_s=100e9),  # 27 ms for 8,192 tokens of KV
    kv_bytes_per_token=LLAMA3.kv_bytes_per_token,
)
DECODE_COST = DecodeCostModel(model=LLAMA3, hardware=A800)
P0, P1, P2 = (InstanceId(f"prefill-{i}") for i in range(3))
D0, D1 = InstanceId("decode-0"), InstanceId("decode-1")
PREFILL_IDS, DECODE_IDS = (P0, P1, P2), (D0, D1)
ROUTERS = ("kvcache_centric", "adaptive", "local_cache_aware", "load_balancing", "random")
ADMISSIONS = ("baseline", "early_rejection", "predictive_early_rejection")
STRUCTURAL = (Reason.CONTEXT_TOO_LONG, Reason.BATCH_FULL, Reason.KV_BUDGET, Reason.NO_DECODE_INSTANCE)
MACHINE_BLOCK = 128  # the state machine's prompts: up to 18 blocks, 2,304 tokens (about 0.2 s of prefill)


def make_router(name: str, *, threshold: float = 1.5) -> Router:
    estimator = ESTIMATOR
    if name == "kvcache_centric":
        return KvCacheCentricRouter(estimator, threshold=threshold)
    if name == "adaptive":
        return KvCacheCentricRouter(estimator, adaptive=AdaptiveThreshold(value=threshold))
    if name == "local_cache_aware":
        return local_cache_aware_router(estimator)
    if name == "load_balancing":
        return LoadBalancingRouter(estimator)
    assert name == "random"
    return RandomRouter(estimator)


def make_admission(name: str) -> AdmissionPolicy:
    if name == "baseline":
        return BaselineAdmission()
    return EarlyRejection(predictive=name == "predictive_early_rejection")


def make_conductor(
    *,
    router: str | Router = "kvcache_centric",
    threshold: float = 1.5,
    admission: str = "baseline",
    predictor: Any = None,
    slo: Slo | None = None,
    capacity_tokens: int | None = None,
    max_batch_size: int | None = None,
    block_size: int = BLOCK,
    seed: int = 0,
    cache_blocks: int | None = None,
) -> Conductor:
    conductor = Conductor(
        router=make_router(router, threshold=threshold) if isinstance(router, str) else router,
        step_model=DECODE_COST,
        admission=make_admission(admission),
        predictor=predictor if predictor is not None else UniformDecodePredictor(decode_s=10.0),
        slo=slo if slo is not None else Slo(),
        block_size_tokens=block_size,
        seed=seed,
    )
    for instance in PREFILL_IDS:
        conductor.add_prefill_instance(instance, cache_blocks=cache_blocks)
    for instance in DECODE_IDS:
        capacity = DECODE_COST.capacity_tokens() if capacity_tokens is None else capacity_tokens
        conductor.add_decode_instance(
            instance, DecodeLimits(kv_capacity_tokens=capacity, max_batch_size=max_batch_size)
        )
    return conductor


def one_pair(estimator: TtftEstimator) -> Conductor:
    """P0 and D0 (room for any request), routed by load on `estimator`, every request admitted."""
    conductor = Conductor(
        router=LoadBalancingRouter(estimator),
        step_model=DECODE_COST,
        admission=make_admission("baseline"),
        predictor=UniformDecodePredictor(decode_s=10.0),
        slo=Slo(ttft_s=1e6),
        block_size_tokens=BLOCK,
    )
    conductor.add_prefill_instance(P0)
    conductor.add_decode_instance(D0, DecodeLimits(kv_capacity_tokens=10**7))
    return conductor


def request(name: str, keys: Sequence[int], *, tokens: int | None = None, output: int = 100) -> Request:
    """A request over `keys`, filling its last block unless `tokens` says otherwise."""
    return Request(
        request_id=RequestId(name),
        arrival_s=0.0,
        input_length=tokens if tokens is not None else max(1, len(keys) * BLOCK),
        output_length=output,
        block_keys=tuple(BlockKey(k) for k in keys),
    )


DOC = tuple(range(100, 132))  # a 32-block (8,192-token) shared prefix


def placement(decision: ScheduleDecision) -> tuple[InstanceId, InstanceId]:
    """The prefill and decode instances of an accepted decision."""
    assert decision.accepted and decision.prefill_instance is not None and decision.decode_instance is not None
    return decision.prefill_instance, decision.decode_instance


@attrs.define
class Caches:
    """The prefill instances' caches as the index hears of them: per-source epoch and seq, and a model of holdings."""

    holdings: HoldingsModel = attrs.field(factory=HoldingsModel)
    epoch: dict[InstanceId, int] = attrs.field(factory=lambda: collections.defaultdict(int))
    seq: dict[InstanceId, int] = attrs.field(factory=lambda: collections.defaultdict(int))

    def _stamp(self, instance: InstanceId) -> dict[str, Any]:
        stamp = {"source": instance, "seq": self.seq[instance], "epoch": self.epoch[instance]}
        self.seq[instance] += 1
        return stamp

    def store(self, conductor: Conductor, instance: InstanceId, keys: Sequence[int]) -> None:
        event = BlockStored(keys=tuple(keys), tier=Tier.VRAM, **self._stamp(instance))
        assert conductor.apply_cache_event(event) is None
        self.holdings.store(instance, (BlockKey(k) for k in keys))

    def clear(self, conductor: Conductor, instance: InstanceId) -> None:
        assert conductor.apply_cache_event(AllBlocksCleared(**self._stamp(instance))) is None
        self.holdings.clear(instance)

    def restart(self, instance: InstanceId) -> None:
        """The instance went down: the index forgot it, and its cache comes back empty in a new epoch."""
        self.holdings.clear(instance)
        self.epoch[instance] += 1
        self.seq[instance] = 0


def occupy(conductor: Conductor, instance: InstanceId, *, count: int, now: float = 0.0) -> list[ScheduleDecision]:
    """Queue `count` uncached 8,192-token prompts on `instance`, taking the other prefill instances down meanwhile
    (so call it before anything else is queued on them)."""
    others = [p for p in PREFILL_IDS if p != instance]
    for other in others:
        conductor.handle(InstanceDown(instance_id=other, now=now))
    decisions = [
        conductor.schedule(request(f"filler-{instance}-{i}", range(10_000 * (i + 1), 10_000 * (i + 1) + 32)), now)
        for i in range(count)
    ]
    for other in others:
        conductor.handle(InstanceUp(instance_id=other, now=now))
    assert all(d.accepted and d.prefill_instance == instance for d in decisions)
    return decisions


# ---------------------------------------------------------------------------- routing


def test_prompts_keyed_wider_than_64_bits_are_routed() -> None:
    """SHA-256 or XXH3-128 keys (a regression: the tie-break overflowed on them) route like any others:
    to the instance holding the prefix, as the index matches their folded form."""
    conductor = make_conductor()
    wide = [2**255 + k for k in range(4)]
    conductor.apply_cache_event(BlockStored(source=PREFILL_IDS[1], seq=0, keys=wide[:3], tier=Tier.DRAM))
    decision = conductor.schedule(request("wide", wide), now=0.0)
    assert decision.accepted and decision.prefill_instance == PREFILL_IDS[1]
    assert decision.prefix_tokens == 3 * BLOCK


def test_routes_to_the_instance_holding_the_prefix() -> None:
    """All idle: the holder of the whole prompt wins, reusing all but the block holding its last token,
    moving nothing."""
    conductor, caches = make_conductor(), Caches()
    caches.store(conductor, P1, DOC)
    decision = conductor.schedule(request("r", DOC), 0.0)
    assert decision.accepted
    assert (decision.prefill_instance, decision.prefix_tokens, decision.transfer) == (P1, 8192 - BLOCK, None)
    assert decision.ttft_s == pytest.approx(ESTIMATOR.prefill.prefill_s(8192, 8192 - BLOCK))
    conductor.check_invariants()


def test_prefers_the_longest_prefix() -> None:
    """Several holders: the longest prefix wins when queues are equal."""
    conductor, caches = make_conductor(threshold=100.0), Caches()
    caches.store(conductor, P0, DOC[:8])
    caches.store(conductor, P2, DOC[:24])
    decision = conductor.schedule(request("r", DOC), 0.0)
    assert (decision.prefill_instance, decision.prefix_tokens, decision.transfer) == (P2, 24 * BLOCK, None)


def test_plans_a_transfer_from_the_best_holder_when_the_threshold_allows() -> None:
    """Busy holder, idle peers: with threshold 1.5 the prefix moves to a peer, which keeps the copy."""
    conductor, caches = make_conductor(threshold=1.5), Caches()
    occupy(conductor, P0, count=3)  # P0 busy for ~2.7 s
    caches.store(conductor, P0, DOC)
    decision = conductor.schedule(request("r", DOC), 0.0)
    assert decision.accepted and decision.prefill_instance in (P1, P2)  # the idle peers tie: the prompt's home
    plan = decision.transfer
    assert plan is not None
    # All the blocks but the last, which the prefill computes (for the first token) and so nothing moves for.
    assert (plan.source, plan.num_blocks, plan.keep_local_copy) == (P0, 31, True)
    assert plan.num_bytes == 31 * BLOCK * LLAMA3.kv_bytes_per_token
    assert decision.prefix_tokens == 31 * BLOCK
    assert decision.ttft_s == pytest.approx(plan.transfer_s + ESTIMATOR.prefill.prefill_s(8192, 31 * BLOCK))
    conductor.check_invariants()


def test_a_hot_prefixs_transfers_leave_the_replica_with_the_fewest_leaving() -> None:
    """Two busy instances hold the prefix and two idle ones lack it: the first transfer comes from the smallest
    id, the second from the other replica, which has none leaving it (all from the first, the second was estimated
    at twice the transfer time, and one replica carried a hot prefix's every copy)."""
    conductor, caches = make_conductor(threshold=1.5), Caches()
    for busy in (P0, P1):
        conductor.handle(PrefillBacklog(instance_id=busy, now=0.0, until_s=3.0))
    conductor.add_prefill_instance(InstanceId("prefill-3"))
    caches.store(conductor, P0, DOC)
    caches.store(conductor, P1, DOC)
    first = conductor.schedule(request("first", DOC), 0.0)
    second = conductor.schedule(request("second", DOC), 0.0)
    assert first.transfer is not None and second.transfer is not None
    assert {first.prefill_instance, second.prefill_instance} == {P2, InstanceId("prefill-3")}
    assert (first.transfer.source, second.transfer.source) == (P0, P1)
    assert second.transfer.transfer_s == pytest.approx(first.transfer.transfer_s)  # neither shares its link
    conductor.check_invariants()


def test_holders_of_all_a_prefill_reuses_are_replicas_alike() -> None:
    """A prompt of 32 whole blocks reuses 31 (the last token's block is computed): an instance holding all 32
    and one holding 31 are two replicas of what moves, so with three instances the receiver of a transfer does
    not keep a third copy (it did, counting only the holder of all 32)."""
    conductor, caches = make_conductor(threshold=1.5), Caches()
    for busy in (P0, P1):
        conductor.handle(PrefillBacklog(instance_id=busy, now=0.0, until_s=3.0))
    caches.store(conductor, P0, DOC)
    caches.store(conductor, P1, DOC[:31])
    decision = conductor.schedule(request("r", DOC), 0.0)
    assert decision.prefill_instance == P2 and decision.transfer is not None
    assert (decision.transfer.source, decision.transfer.num_blocks, decision.transfer.keep_local_copy) == (
        P0,
        31,
        False,
    )
    conductor.check_invariants()


def test_a_transfer_counts_against_its_source_only_while_its_request_waits_for_it() -> None:
    """Concurrent transfers from one source slow each other (the estimate's congestion); one whose request
    ended, or left its prefill queue, no longer counts: an aborted request's transfer doubled the next
    request's estimate (and stayed counted until the source was next the best holder)."""
    conductor, caches = make_conductor(threshold=1.5), Caches()
    occupy(conductor, P0, count=3)
    caches.store(conductor, P0, DOC)
    first = conductor.schedule(request("first", DOC), 0.0)
    assert first.transfer is not None and first.transfer.source == P0
    conductor.handle(RequestAborted(request_id=first.request_id, now=0.0))
    conductor.check_invariants()
    again = conductor.schedule(request("again", DOC), 0.0)
    assert again.transfer is not None and again.ttft_s == pytest.approx(first.ttft_s)
    conductor.check_invariants()


def test_a_transfer_source_going_down_aborts_the_prefills_waiting_for_it() -> None:
    """The blocks a queued prefill was planned on may never arrive from a source that went down: the request
    ends, aborted with `instance_down` (as those on the instance itself), instead of waiting on a void plan."""
    conductor, caches = make_conductor(threshold=1.5), Caches()
    occupy(conductor, P0, count=3)
    caches.store(conductor, P0, DOC)
    decision = conductor.schedule(request("r", DOC), 0.0)
    assert decision.transfer is not None and decision.transfer.source == P0
    started = conductor.schedule(request("started", DOC), 0.0)
    assert started.transfer is not None and started.transfer.source == P0 and started.prefill_instance is not None
    conductor.handle(PrefillStarted(request_id=started.request_id, instance_id=started.prefill_instance, now=0.0))
    ends = conductor.handle(InstanceDown(instance_id=P0, now=0.0))
    assert RequestEnd(decision.request_id, Outcome.ABORTED, Reason.INSTANCE_DOWN) in ends
    assert decision.request_id not in conductor.in_flight
    assert started.request_id in conductor.in_flight  # its prefill runs: the blocks are there
    conductor.check_invariants()


def test_a_transfer_estimated_done_when_its_source_goes_down_is_kept() -> None:
    """A source going down at the very time a queued prefill's transfer was estimated to finish takes nothing
    with it: the blocks are taken to have arrived (only a transfer still running is doomed)."""
    conductor, caches = make_conductor(threshold=1.5), Caches()
    occupy(conductor, P0, count=3)
    caches.store(conductor, P0, DOC)
    decision = conductor.schedule(request("r", DOC), 0.0)
    assert decision.transfer is not None and decision.transfer.source == P0
    done_s = decision.transfer.transfer_s
    assert done_s > 0
    conductor.handle(InstanceDown(instance_id=P0, now=done_s))
    assert decision.request_id in conductor.in_flight
    conductor.check_invariants()


def test_a_backlog_that_ends_now_is_no_backlog() -> None:
    """A backlog report ending at its own time leaves the instance free now, as one ending before it does."""
    conductor = make_conductor()
    conductor.handle(PrefillBacklog(instance_id=P0, now=5.0, until_s=5.0))
    (view,) = [v for v in conductor.prefill_views if v.instance_id == P0]
    assert view.backlog_until_s == -math.inf and view.queue_s(5.0) == 0.0


class _StepOnly:
    """A step model with a step time and no roofline (`sched.step.StepModel` without `AnalyticStepModel`)."""

    def step_s(self, batch_size: int, context_tokens: int) -> float:
        return 0.01


@pytest.mark.parametrize(
    ("part", "value", "named"),
    [
        ("slo", 30, "slo must be"),
        ("admission", "baseline", "admission must have"),
        ("router", None, "router must"),
        ("admission", EarlyRejection, "the class EarlyRejection"),
        ("router", attrs.make_class("RouteOnly", {}, bases=(), slots=True)(), "router must have a route"),
        # A step model without its roofline: decode selection failed at the first request.
        ("step_model", _StepOnly(), "step_model must have a roofline"),
        ("admission", attrs.evolve(BaselineAdmission(), load_at="later"), "load_at must be one of none, now, arrival"),
        ("seed", "a", "seed"),
    ],
)
def test_a_misplaced_part_is_refused_when_the_conductor_is_made(part: str, value: object, named: str) -> None:
    """An SLO given as a number or a policy by its name failed at the first request, as an AttributeError."""
    parts: dict[str, Any] = {
        "router": make_router("kvcache_centric"),
        "step_model": DECODE_COST,
        "admission": BaselineAdmission(),
        "predictor": UniformDecodePredictor(decode_s=10.0),
        "slo": Slo(),
    }
    with pytest.raises(ConfigError, match=named):
        Conductor(**{**parts, part: value}, block_size_tokens=BLOCK)


@attrs.define
class _Misrouting:
    """A router that asks the real one, then breaks its answer with `change` (a plug-in's mistakes)."""

    inner: Router
    change: Any

    def route(self, *args: Any) -> Any:
        return self.change(self.inner.route(*args))

    def observe(self, **_observed: Any) -> None:
        pass


@attrs.define
class _Misadmitting:
    """An admission policy that answers `answer` whatever it is asked."""

    answer: Any
    name: str = "misadmitting"
    load_at: str = "now"

    def admit(self, *_args: Any) -> Any:
        return self.answer


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda route: attrs.evolve(route, prefill_instance=InstanceId("prefill-99")), "an unknown prefill instance"),
        (lambda route: route.prefill_instance, "not a RouteDecision"),
        (lambda route: attrs.evolve(route, queue_s=math.nan), "negative or not finite"),
        (lambda route: attrs.evolve(route, prefill_s=-5.0), "negative or not finite"),
        (
            lambda route: attrs.evolve(
                route, transfer=TransferPlan(source=route.prefill_instance, num_blocks=1, num_bytes=1, transfer_s=0.0)
            ),
            "a transfer from the instance to itself",
        ),
        (
            lambda route: attrs.evolve(
                route, transfer=TransferPlan(source=InstanceId("ghost"), num_blocks=1, num_bytes=1, transfer_s=0.0)
            ),
            "a transfer from an unknown instance",
        ),
    ],
)
def test_a_routers_broken_decision_is_a_config_error_naming_it(change: Any, named: str) -> None:
    """A plugged-in router's decision is checked where it can be named (it failed deep inside, as a KeyError or an
    AttributeError, or was acted on as it was); the Conductor is unchanged."""
    conductor = make_conductor(router=_Misrouting(make_router("kvcache_centric"), change))
    with pytest.raises(ConfigError, match=f"router _Misrouting.*{named}"):
        conductor.schedule(request("r", [1, 2]), 0.0)
    assert not conductor.in_flight
    conductor.check_invariants()


def a_transfer_from(source: str) -> Any:
    """A router's change: its decision plans a transfer of one block from `source`, whatever it chose."""
    return lambda route: attrs.evolve(
        route, transfer=TransferPlan(source=InstanceId(source), num_blocks=1, num_bytes=1, transfer_s=0.0)
    )


def test_a_transfer_from_a_down_instance_or_in_a_cluster_without_transfers_is_a_config_error() -> None:
    """The plan's source must be a prefill instance that is up, in a cluster with transfers: either was acted on
    (the prefix counted, a transfer booked leaving it) and the replay went on with numbers it never had."""
    down = make_conductor(router=_Misrouting(make_router("local_cache_aware"), a_transfer_from(P1)))
    down.handle(InstanceDown(instance_id=P1, now=0.0))
    with pytest.raises(ConfigError, match="a transfer from a prefill instance that is not up"):
        down.schedule(request("r", [1, 2]), 0.0)
    none = make_conductor(router=_Misrouting(make_router("local_cache_aware"), a_transfer_from(P1)))
    none.transfers = False
    with pytest.raises(ConfigError, match="a transfer in a cluster without transfers"):
        none.schedule(request("r", [1, 2]), 0.0)
    for conductor in (down, none):
        assert not conductor.in_flight
        conductor.check_invariants()


class _Unobserving(_Misrouting):
    def observe(self) -> None:  # type: ignore[override]  # takes none of the Conductor's arguments
        pass


class _UnobservingPredictor:
    def predict(self, *args: Any) -> Any:
        return UniformDecodePredictor(decode_s=10.0).predict(*args)

    def observe(self, output_tokens: int, extra: int) -> None:  # one argument more than it is given
        pass


@pytest.mark.parametrize(
    ("part", "observer"),
    [
        ("router", lambda: _Unobserving(make_router("kvcache_centric"), lambda route: route)),
        ("predictor", _UnobservingPredictor),
    ],
)
def test_an_observe_that_cannot_take_the_conductors_arguments_is_refused_at_construction(
    part: str, observer: Any
) -> None:
    """A policy's observe is called only once a request has prefilled (a router's) or finished (a predictor's):
    one whose signature does not take those arguments was a bare TypeError in the middle of a run."""
    policy = observer()
    with pytest.raises(ConfigError, match=rf"{part} .*its observe\(.*\) cannot be called as the Conductor calls it"):
        make_conductor(**{part: policy})


@pytest.mark.parametrize(
    "answer",
    [
        AdmissionDecision(False),  # a rejection without its reason
        AdmissionDecision(False, "too busy"),  # a reason that is not a Reason
        AdmissionDecision(True, Reason.TTFT_SLO),  # accepted, with a reason
        AdmissionDecision(Reason.TTFT_SLO),  # the reason given first: accepted is a Reason, truthy (it accepted)
        AdmissionDecision("no"),  # nor a string
        True,  # not a decision
    ],
)
def test_an_admission_policys_broken_answer_is_a_config_error_naming_it(answer: Any) -> None:
    conductor = make_conductor()
    conductor.admission = _Misadmitting(answer)  # type: ignore[assignment]
    with pytest.raises(ConfigError, match=r"admission _Misadmitting.*answered"):
        conductor.schedule(request("r", [1, 2]), 0.0)
    assert not conductor.in_flight


def test_an_acceptance_where_no_decode_instance_can_take_the_request_is_a_config_error() -> None:
    conductor = make_conductor(capacity_tokens=10)  # no decode instance holds the request's KV
    conductor.admission = _Misadmitting(AdmissionDecision(True))  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="decode instance None"):
        conductor.schedule(request("r", [1, 2]), 0.0)


@pytest.mark.parametrize("event", ["x", None, 3])
def test_handle_refuses_what_is_no_event(event: object) -> None:
    with pytest.raises(InvalidRequestError, match="handle takes a scheduler event"):
        make_conductor().handle(event)  # type: ignore[arg-type]


def test_a_request_size_beyond_any_context_is_refused_by_name() -> None:
    """A count the compiled scan could not hold (int64) was a bare OverflowError from inside `schedule`."""
    for field in ("input_length", "output_length"):
        with pytest.raises(InvalidRequestError, match=rf"{field} must be an integer in \[1, 2\*\*40\], got {2**63}"):
            Request(
                request_id=RequestId("r"),
                arrival_s=0.0,
                block_keys=(),
                **{"input_length": 8, "output_length": 8, field: 2**63},
            )


def test_ratio_below_threshold_keeps_the_own_prefix() -> None:
    """Peers holding half the prefix (ratio 2): threshold 4 keeps their own half; threshold 1.5 moves the other half."""
    for threshold, expected_blocks in [(4.0, None), (1.5, 15)]:
        conductor, caches = make_conductor(threshold=threshold), Caches()
        occupy(conductor, P0, count=3)
        caches.store(conductor, P0, DOC)
        caches.store(conductor, P1, DOC[:16])
        caches.store(conductor, P2, DOC[:16])
        decision = conductor.schedule(request("r", DOC), 0.0)
        assert decision.prefill_instance == P1
        moved = decision.transfer.num_blocks if decision.transfer is not None else None
        assert moved == expected_blocks  # the 16 blocks it lacks but the last one, which is computed
        assert decision.prefix_tokens == (16 * BLOCK if expected_blocks is None else 31 * BLOCK)


def test_transfers_from_one_source_congest() -> None:
    """A second transfer from the same holder while the first is still moving takes twice the bytes' time."""
    conductor, caches = make_conductor(), Caches()
    other_doc = tuple(key + 1_000 for key in DOC)  # as long, so that both move the same bytes
    occupy(conductor, P0, count=3)
    caches.store(conductor, P0, DOC)
    caches.store(conductor, P0, other_doc)
    first = conductor.schedule(request("r1", DOC), 0.0)
    second = conductor.schedule(request("r2", other_doc), 0.0)
    assert first.transfer is not None and second.transfer is not None
    assert {first.prefill_instance, second.prefill_instance} == {P1, P2}
    one = first.transfer.num_bytes / 100e9
    assert second.transfer.transfer_s == pytest.approx(first.transfer.transfer_s + one)
    later = conductor.schedule(request("r3", DOC), 10.0)  # both transfers are done by now
    assert later.transfer is None or later.transfer.transfer_s == pytest.approx(first.transfer.transfer_s)


def test_a_prefix_queued_ahead_counts_as_cached() -> None:
    """A request queued behind one with the same prefix on the same instance finds that prefix stored when
    it starts (FIFO), so it is estimated with it; once the one ahead leaves without storing it, it is not."""
    conductor = make_conductor()
    for other in (P1, P2):
        conductor.handle(InstanceDown(instance_id=other, now=0.0))
    first = conductor.schedule(request("r1", DOC), 0.0)
    assert first.prefill_instance == P0 and first.prefix_tokens == 0
    second = conductor.schedule(request("r2", (*DOC, 999)), 0.0)
    assert second.prefix_tokens == 32 * BLOCK and second.transfer is None
    assert second.ttft_s - first.ttft_s < 0.1 * first.ttft_s  # one block to compute, not 33
    conductor.handle(RequestAborted(request_id=first.request_id, now=0.1))
    third = conductor.schedule(request("r3", (*DOC, 998)), 0.1)
    assert third.prefix_tokens == 32 * BLOCK  # still on its way, behind r2
    conductor.handle(RequestAborted(request_id=second.request_id, now=0.2))
    conductor.handle(RequestAborted(request_id=third.request_id, now=0.2))
    assert conductor.schedule(request("r4", DOC), 0.2).prefix_tokens == 0


def test_a_prefix_queued_ahead_counts_only_as_far_as_the_cache_holds() -> None:
    """An instance whose cache holds 4 blocks keeps no more of a 32-block chain queued on it (a prefix-preserving
    cache keeps the chain's first blocks), so a request queued behind it is estimated with 4 blocks, not 32; what
    the index shows the instance holding now counts whole, beyond the bound (the index is what is stored)."""
    conductor = make_conductor(cache_blocks=4)
    for other in (P1, P2):
        conductor.handle(InstanceDown(instance_id=other, now=0.0))
    first = conductor.schedule(request("r1", DOC), 0.0)
    assert first.prefix_tokens == 0
    second = conductor.schedule(request("r2", (*DOC, 999)), 0.0)
    assert second.prefix_tokens == 4 * BLOCK
    Caches().store(conductor, P0, list(DOC[:10]))  # what the index says is stored stands
    third = conductor.schedule(request("r3", (*DOC, 998)), 0.0)
    assert third.prefix_tokens == 10 * BLOCK
    nothing = make_conductor(cache_blocks=0)
    for other in (P1, P2):
        nothing.handle(InstanceDown(instance_id=other, now=0.0))
    nothing.schedule(request("r1", DOC), 0.0)
    assert nothing.schedule(request("r2", (*DOC, 999)), 0.0).prefix_tokens == 0
    for bad in (-1, 1.5, True, "4", 2**63):
        with pytest.raises(ConfigError, match="cache_blocks must be an integer"):
            nothing.add_prefill_instance(InstanceId("prefill-9"), cache_blocks=bad)  # type: ignore[arg-type]
    assert InstanceId("prefill-9") not in {view.instance_id for view in nothing.prefill_views}


def test_a_prompt_computed_whole_counts_no_cached_prefix_and_moves_none() -> None:
    """A request that does not reuse a prefix (its prompt's log-probabilities are wanted) is estimated as a
    cold prefill wherever its prefix is cached, coming or moving: no prefix tokens, no transfer, the cold TTFT;
    the same prompt reusing is routed to its holder as before."""
    conductor, caches = make_conductor(threshold=1.5), Caches()
    occupy(conductor, P0, count=3)
    caches.store(conductor, P0, DOC)
    caches.store(conductor, P1, DOC[:16])
    reusing = conductor.schedule(request("reusing", DOC), 0.0)
    assert reusing.prefix_tokens > 0  # what the flag changes
    whole = conductor.schedule(attrs.evolve(request("whole", DOC), reuses_prefix=False), 0.0)
    assert whole.accepted and (whole.prefix_tokens, whole.transfer) == (0, None)
    assert whole.prefill_instance == P2  # the idle instance without the prefix: none counts anywhere
    assert whole.ttft_s == pytest.approx(ESTIMATOR.prefill.prefill_s(8192, 0))
    with pytest.raises(InvalidRequestError, match="reuses_prefix"):
        attrs.evolve(request("bad", DOC), reuses_prefix=1)
    conductor.check_invariants()


def test_queues_follow_each_other() -> None:
    """On one instance, each queued request is predicted to start when the previous one finishes."""
    conductor = make_conductor()
    decisions = occupy(conductor, P2, count=3)
    queue = next(v for v in conductor.prefill_views if v.instance_id == P2).queue
    assert [q.request_id for q in queue] == [d.request_id for d in decisions]
    assert queue[0].start_s == 0.0
    for before, after in itertools.pairwise(queue):
        assert after.start_s == pytest.approx(before.finish_s)
    assert decisions[2].ttft_s == pytest.approx(queue[2].finish_s)


def test_prefill_started_late_pushes_the_queue_back() -> None:
    """A head that starts late delays everyone behind it by as much; after it ends the rest keep their durations."""
    conductor = make_conductor()
    occupy(conductor, P2, count=3)
    view = next(v for v in conductor.prefill_views if v.instance_id == P2)
    durations = [q.finish_s - q.start_s for q in view.queue]
    head = view.queue[0].request_id
    conductor.handle(PrefillStarted(request_id=head, instance_id=P2, now=1.0))
    assert view.queue[0].start_s == 1.0
    assert view.queue[2].finish_s == pytest.approx(1.0 + sum(durations))
    conductor.handle(PrefillFinished(request_id=head, instance_id=P2, now=1.5))
    assert [q.finish_s - q.start_s for q in view.queue] == pytest.approx(durations[1:])
    assert view.queue[0].start_s >= 1.5
    assert view.queue[1].start_s == pytest.approx(view.queue[0].finish_s)


def test_a_request_ahead_that_is_aborted_or_ends_early_leaves_no_time_behind() -> None:
    """The queue behind a request that leaves it sooner than predicted (aborted before it ran, or finished early)
    starts as soon as the instance is free, not when the request was predicted to free it: each then starts
    when the one ahead frees it (or now) and keeps its own duration, however long the queue stays busy."""
    conductor = make_conductor()
    occupy(conductor, P2, count=4)
    view = next(v for v in conductor.prefill_views if v.instance_id == P2)
    ids = [q.request_id for q in view.queue]
    durations = {q.request_id: q.prefill_s for q in view.queue}
    conductor.handle(RequestAborted(request_id=ids[0], now=0.0))  # the head, before it ran
    assert [q.start_s for q in view.queue] == pytest.approx([0.0, durations[ids[1]], durations[ids[1]] * 2])
    assert view.busy_until_s(0.0) == pytest.approx(3 * durations[ids[1]])
    conductor.handle(RequestAborted(request_id=ids[2], now=0.0))  # one in the middle
    assert [q.request_id for q in view.queue] == [ids[1], ids[3]]
    assert view.queue[1].start_s == pytest.approx(view.queue[0].finish_s)
    assert view.queue[1].finish_s == pytest.approx(2 * durations[ids[1]])
    conductor.handle(PrefillStarted(request_id=ids[1], instance_id=P2, now=0.0))
    conductor.handle(PrefillFinished(request_id=ids[1], instance_id=P2, now=0.1))  # far sooner than predicted
    (last,) = view.queue
    assert (last.start_s, last.finish_s) == pytest.approx((0.1, 0.1 + durations[ids[3]]))
    conductor.check_invariants()


@pytest.mark.parametrize("pipelined", [False, True], ids=["plain", "chunked_pipeline"])
def test_a_backlog_reported_after_requests_were_queued_keeps_their_times(pipelined: bool) -> None:
    """A backlog is work routed elsewhere: what was queued before its report keeps its times (a start reported
    then ends it its prefill later, on a chunked-pipeline group too), and what is routed after it starts after it,
    also when the requests ahead leave the queue early."""
    prefill = ESTIMATOR.prefill
    if pipelined:
        prefill = ChunkedPipelineCost(base=prefill, group_size=4, chunk_tokens=1024)
    estimator = TtftEstimator(
        prefill=prefill, transfer=ESTIMATOR.transfer, kv_bytes_per_token=LLAMA3.kv_bytes_per_token
    )
    conductor = one_pair(estimator)
    for i in range(2):
        assert conductor.schedule(request(f"r{i}", range(100 * i, 100 * i + 32)), 0.0).accepted
    (view,) = conductor.prefill_views
    before = [(q.start_s, q.frees_s, q.finish_s) for q in view.queue]
    conductor.handle(PrefillBacklog(instance_id=P0, now=0.0, until_s=100.0))
    conductor.handle(PrefillStarted(request_id=RequestId("r0"), instance_id=P0, now=0.0))
    assert [(q.start_s, q.frees_s, q.finish_s) for q in view.queue] == before
    assert [q.finish_s for q in conductor.incoming(D0)] == [finish for _, _, finish in before]  # predictors read
    late = conductor.schedule(request("late", range(1000, 1032)), 0.0)
    assert late.accepted and view.queue[-1].start_s == 100.0
    for name in ("r0", "r1"):
        conductor.handle(RequestAborted(request_id=RequestId(name), now=1.0))
    assert view.queue[0].start_s == 100.0  # behind the backlog still
    conductor.check_invariants()


# ---------------------------------------------------------------------------- down instances


def test_never_routes_to_a_down_instance() -> None:
    """A down holder is neither chosen nor a transfer source; its cache is forgotten."""
    conductor, caches = make_conductor(), Caches()
    caches.store(conductor, P0, DOC)
    conductor.handle(InstanceDown(instance_id=P0, now=0.0))
    decision = conductor.schedule(request("r", DOC), 0.0)
    assert decision.accepted and decision.prefill_instance in (P1, P2)
    assert decision.transfer is None and decision.prefix_tokens == 0
    conductor.handle(RequestAborted(request_id=decision.request_id, now=1.0))  # nothing of DOC is on its way
    conductor.handle(InstanceUp(instance_id=P0, now=1.0))
    back = conductor.schedule(request("r2", DOC), 1.0)
    assert back.prefix_tokens == 0  # it restarted empty


def test_no_prefill_instance_up_is_a_rejection() -> None:
    """With every prefill instance down the request is rejected with NO_PREFILL_INSTANCE."""
    conductor = make_conductor()
    for instance in PREFILL_IDS:
        conductor.handle(InstanceDown(instance_id=instance, now=0.0))
    decision = conductor.schedule(request("r", DOC), 0.0)
    assert (decision.accepted, decision.reason, decision.prefill_instance) == (
        False,
        Reason.NO_PREFILL_INSTANCE,
        None,
    )
    assert conductor.in_flight == ()


def test_down_decode_instances_are_skipped() -> None:
    """A down decode instance is never chosen; with both down the request is rejected with NO_DECODE_INSTANCE."""
    conductor = make_conductor()
    conductor.handle(InstanceDown(instance_id=D0, now=0.0))
    assert conductor.schedule(request("r1", DOC), 0.0).decode_instance == D1
    conductor.handle(InstanceDown(instance_id=D1, now=0.0))
    decision = conductor.schedule(request("r2", DOC), 0.0)
    assert (decision.accepted, decision.reason, decision.decode_instance) == (False, Reason.NO_DECODE_INSTANCE, None)
    assert decision.prefill_instance is not None  # routing got that far


def test_instance_down_ends_its_requests_with_a_reason() -> None:
    """A prefill instance going down ends the requests queued there; a decode one ends all headed or decoding there."""
    conductor = make_conductor()
    on_p0 = occupy(conductor, P0, count=2)
    elsewhere = [conductor.schedule(request(f"r{i}", range(1000 * i, 1000 * i + 32)), 0.0) for i in (1, 2)]
    assert {d.prefill_instance for d in elsewhere} == {P1, P2}
    first = on_p0[0]
    assert first.decode_instance is not None
    conductor.handle(PrefillFinished(request_id=first.request_id, instance_id=P0, now=1.0))
    joined = DecodeJoined(
        request_id=first.request_id, instance_id=first.decode_instance, now=1.0, context_tokens=8192, output_tokens=100
    )
    conductor.handle(joined)
    ends = conductor.handle(InstanceDown(instance_id=P0, now=2.0))
    # The decoding one outlives its prefill node.
    assert ends == (RequestEnd(on_p0[1].request_id, Outcome.ABORTED, Reason.INSTANCE_DOWN),)
    doomed = {d.request_id for d in [first, *elsewhere] if d.decode_instance == first.decode_instance}
    ends = conductor.handle(InstanceDown(instance_id=first.decode_instance, now=3.0))
    assert {e.request_id for e in ends} == doomed and len(ends) == len(doomed)
    assert {(e.outcome, e.reason) for e in ends} == {(Outcome.ABORTED, Reason.INSTANCE_DOWN)}
    assert set(conductor.in_flight) == {d.request_id for d in elsewhere} - doomed
    assert conductor.handle(InstanceDown(instance_id=P0, now=4.0)) == ()  # nothing left to end there
    conductor.check_invariants()


def test_events_about_unknown_instances_are_config_errors() -> None:
    """Instance events must name a known instance, and ids are unique across prefill and decode."""
    conductor = make_conductor()
    with pytest.raises(ConfigError):
        conductor.handle(InstanceDown(instance_id=InstanceId("nowhere"), now=0.0))
    with pytest.raises(ConfigError):
        conductor.add_prefill_instance(D0)
    with pytest.raises(ConfigError):
        conductor.add_decode_instance(P0, DecodeLimits(kv_capacity_tokens=1000))


def test_a_cache_event_from_an_unknown_instance_is_refused() -> None:
    """A misspelt source would index blocks no route finds: UnknownInstanceError naming it, nothing applied;
    the same event from the instance itself is applied."""
    conductor = make_conductor()
    stray = BlockStored(source=InstanceId("prefill_0"), seq=0, keys=DOC[:2], tier=Tier.DRAM)
    with pytest.raises(UnknownInstanceError, match="'prefill_0', which is no instance of this Conductor"):
        conductor.apply_cache_event(stray)
    assert len(conductor.index) == 0 and conductor.index.instances == ()
    assert conductor.apply_cache_event(attrs.evolve(stray, source=P0)) is None
    assert conductor.index.instances == (P0,)


def test_a_failed_add_changes_nothing() -> None:
    """A bad id or limits are a ConfigError naming them, raised before anything is registered: the same id
    can then be added properly."""
    conductor = make_conductor()
    with pytest.raises(ConfigError, match="decode limits must be DecodeLimits, got None"):
        conductor.add_decode_instance(InstanceId("decode-9"), None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="limits"):
        conductor.add_coupled_instance(InstanceId("decode-9"), {"kv_capacity_tokens": 10})  # type: ignore[arg-type]
    for bad in ("", None, 7):
        with pytest.raises(ConfigError, match="non-empty string"):
            conductor.add_prefill_instance(bad)  # type: ignore[arg-type]
    assert InstanceId("decode-9") not in [v.instance_id for v in (*conductor.decode_views, *conductor.prefill_views)]
    conductor.add_decode_instance(InstanceId("decode-9"), DecodeLimits(kv_capacity_tokens=10**6))
    conductor.handle(InstanceDown(instance_id=InstanceId("decode-9"), now=0.0))
    conductor.check_invariants()
    with pytest.raises(UnknownInstanceError, match="decode-8"):
        conductor.incoming(InstanceId("decode-8"))
    with pytest.raises(InvalidRequestError, match="decode-8"):  # bad input, caught as such too
        conductor.handle(InstanceDown(instance_id=InstanceId("decode-8"), now=0.0))


def test_instances_added_together_are_checked_first_and_equal_those_added_one_by_one() -> None:
    """`add_*_instances` check every id, then rebuild the board once (one by one, each add rebuilds it: a
    cluster of n instances cost O(n²)); a repeated or known id anywhere in the batch adds none of it."""
    together, one_by_one = make_conductor(), make_conductor()
    prefill = [InstanceId(f"extra-prefill-{i}") for i in range(5)]
    decode = [InstanceId(f"extra-decode-{i}") for i in range(3)]
    limits = DecodeLimits(kv_capacity_tokens=10**6, max_batch_size=8)
    together.add_prefill_instances(prefill)
    together.add_decode_instances(decode, limits)
    for instance in prefill:
        one_by_one.add_prefill_instance(instance)
    for instance in decode:
        one_by_one.add_decode_instance(instance, limits)
    for conductor in (together, one_by_one):
        conductor.check_invariants()
    assert [v.instance_id for v in together.prefill_views] == [v.instance_id for v in one_by_one.prefill_views]
    assert [(v.instance_id, v.limits) for v in together.decode_views] == [
        (v.instance_id, v.limits) for v in one_by_one.decode_views
    ]
    before = (together.prefill_views, together.decode_views)
    for batch in ([InstanceId("new-0"), InstanceId("new-0")], [InstanceId("new-1"), P0]):
        with pytest.raises(ConfigError, match="is already known"):
            together.add_prefill_instances(batch)
        with pytest.raises(ConfigError, match="is already known"):
            together.add_decode_instances(batch, limits)
    with pytest.raises(ConfigError, match="the one string 'prefill-x'"):  # not five instances p, r, e, ...
        together.add_prefill_instances("prefill-x")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="the one string"):
        together.add_decode_instances("decode-x", limits)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="DecodeLimits"):  # checked even when the batch is empty
        together.add_decode_instances([], None)  # type: ignore[arg-type]
    assert (together.prefill_views, together.decode_views) == before


def test_a_lasting_refusal_is_what_no_wait_could_change_and_changes_nothing() -> None:
    """`lasting_refusal` (the admission line asks it of a request arriving behind others): a context past every
    decode instance up, even empty, or no instance of a role up; None for a request a wait could get in (here a
    full decode side); nothing is scheduled."""
    conductor = make_conductor(admission="early_rejection", capacity_tokens=10_000, max_batch_size=1)
    for i, instance in enumerate(DECODE_IDS):  # both decode instances full
        assert placement(conductor.schedule(request(f"filler-{i}", [10 * i + 1]), 0.0))[1] == instance
    waiting = request("waits", [50])
    assert conductor.schedule(waiting, 0.0).reason is Reason.BATCH_FULL
    assert conductor.lasting_refusal(waiting) is None
    huge = request("huge", list(range(200, 240)), output=10)  # 10,240 + 10 tokens of KV, past 10,000
    assert conductor.lasting_refusal(huge) is Reason.CONTEXT_TOO_LONG
    assert conductor.in_flight == (RequestId("filler-0"), RequestId("filler-1"))
    with pytest.raises(InvalidRequestError, match="already scheduled"):  # what schedule refuses, it refuses too
        conductor.lasting_refusal(request("filler-0", [1]))
    for instance in DECODE_IDS:
        conductor.handle(InstanceDown(instance_id=instance, now=0.0))
    assert conductor.lasting_refusal(waiting) is Reason.NO_DECODE_INSTANCE
    for instance in PREFILL_IDS:
        conductor.handle(InstanceDown(instance_id=instance, now=0.0))
    assert conductor.lasting_refusal(waiting) is Reason.NO_PREFILL_INSTANCE
    with pytest.raises(InvalidRequestError, match="Request"):
        conductor.lasting_refusal("waits")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="block keys"):
        conductor.lasting_refusal(request("short", [1, 2], tokens=10))


def test_a_context_only_an_instance_that_is_down_holds_is_unavailable_not_too_long() -> None:
    """A request that only a decode instance now down could hold is NO_DECODE_INSTANCE (503: it may come back),
    from `schedule` and `lasting_refusal` alike, accepted once that instance is up, and CONTEXT_TOO_LONG (400)
    only when no instance could hold it."""
    conductor = make_conductor(admission="early_rejection", capacity_tokens=10_000)
    conductor.add_decode_instance(InstanceId("decode-large"), DecodeLimits(kv_capacity_tokens=100_000))
    long = request("long", list(range(200, 240)), output=10)  # 10,250 tokens of KV: only decode-large holds it
    conductor.handle(InstanceDown(instance_id=InstanceId("decode-large"), now=0.0))
    assert conductor.lasting_refusal(long) is Reason.NO_DECODE_INSTANCE
    assert conductor.schedule(long, 0.0).reason is Reason.NO_DECODE_INSTANCE
    too_long = request("too-long", list(range(300, 700)), output=10)  # 102,410: past every instance
    assert conductor.lasting_refusal(too_long) is Reason.CONTEXT_TOO_LONG
    assert conductor.schedule(too_long, 0.0).reason is Reason.CONTEXT_TOO_LONG
    assert not conductor.in_flight
    conductor.handle(InstanceUp(instance_id=InstanceId("decode-large"), now=0.0))
    assert conductor.lasting_refusal(long) is None
    assert placement(conductor.schedule(long, 0.0))[1] == InstanceId("decode-large")


@pytest.mark.parametrize("block", [0, -4, 512.0, "512"])
def test_a_block_size_that_is_not_a_positive_integer_is_refused(block: object) -> None:
    with pytest.raises(ConfigError, match="block_size_tokens must be an integer >= 1"):
        make_conductor(block_size=block)  # type: ignore[arg-type]


@pytest.mark.parametrize("now", [math.nan, math.inf, "0"])
def test_times_must_be_finite_numbers(now: object) -> None:
    """A NaN or infinite `now`, in `schedule` or in an event, is an InvalidRequestError naming it (one
    would poison every queue time after it); nothing changes."""
    conductor = make_conductor()
    with pytest.raises(InvalidRequestError, match=f"now must be a finite number, got {now!r}$"):  # no ">= -inf"
        conductor.schedule(request("r", DOC), now)  # type: ignore[arg-type]
    assert conductor.in_flight == ()
    with pytest.raises(InvalidRequestError, match=r"schedule takes a mooncake\.types\.Request, got str"):
        conductor.schedule("r", 0.0)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="now must be a finite number"):
        PrefillStarted(request_id=RequestId("r"), instance_id=P0, now=now)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="until_s must be a finite number"):
        PrefillBacklog(instance_id=P0, now=0.0, until_s=now)  # type: ignore[arg-type]


def test_negative_token_counts_in_events_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="context_tokens must be an integer >= 0, got -1000"):
        DecodeJoined(request_id=RequestId("r"), instance_id=D0, now=0.0, context_tokens=-1000, output_tokens=1)
    with pytest.raises(InvalidRequestError, match="output_tokens"):
        DecodeJoined(request_id=RequestId("r"), instance_id=D0, now=0.0, context_tokens=10, output_tokens=-5)
    with pytest.raises(InvalidRequestError, match="generated_tokens"):
        DecodeFinished(request_id=RequestId("r"), instance_id=D0, now=0.0, generated_tokens=-50)


@pytest.mark.parametrize(("instance", "request_id"), [(["x"], "r"), ("", "r"), (None, "r"), ("prefill-0", ["r"])])
def test_an_event_naming_no_instance_or_request_id_is_refused_when_made(instance: object, request_id: object) -> None:
    """An event's instance and request are id strings: a list (unhashable), an empty or a missing one is an
    InvalidRequestError naming the field when the event is made, never a TypeError inside the Conductor."""
    with pytest.raises(InvalidRequestError, match=r"instance_id|request_id"):
        PrefillStarted(request_id=request_id, instance_id=instance, now=0.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("reason", [None, "batch_full", 3])
def test_an_end_without_a_reason_of_the_vocabulary_is_refused_before_anything_ends(reason: object) -> None:
    """An abort or a decode rejection must name a `Reason`: one without is refused when the event is made, so the
    request it names is still in flight, and a proper event ends it once."""
    conductor = make_conductor()
    decision = conductor.schedule(request("r", DOC), 0.0)
    with pytest.raises(InvalidRequestError, match=r"reason must be a mooncake\.sched\.Reason"):
        RequestAborted(request_id=decision.request_id, now=1.0, reason=reason)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match=r"reason must be a mooncake\.sched\.Reason"):
        RequestRejected(request_id=decision.request_id, instance_id=D0, now=1.0, reason=reason)  # type: ignore[arg-type]
    assert conductor.in_flight == (decision.request_id,)
    ends = conductor.handle(RequestAborted(request_id=decision.request_id, now=1.0, reason=Reason.CLIENT_GONE))
    assert [end.reason for end in ends] == [Reason.CLIENT_GONE] and conductor.in_flight == ()


def test_new_decode_limits_apply_to_new_requests_and_keep_what_was_promised() -> None:
    """`set_decode_limits` (a server restarted with another batch size): a request the new limits leave no room
    for is refused for that bound, one they make room for is accepted; what the instance already held stays in
    flight; an unknown instance or limits that are no DecodeLimits are refused, changing nothing."""
    conductor = make_conductor(admission="early_rejection", max_batch_size=1)
    for i, instance in enumerate(DECODE_IDS):
        assert placement(conductor.schedule(request(f"filler-{i}", [10 * i + 1]), 0.0))[1] == instance
    assert conductor.schedule(request("waits", [50]), 0.0).reason is Reason.BATCH_FULL
    conductor.set_decode_limits(DECODE_IDS[0], DecodeLimits(kv_capacity_tokens=10**6, max_batch_size=2))
    assert placement(conductor.schedule(request("fits-now", [60]), 0.0))[1] == DECODE_IDS[0]
    conductor.set_decode_limits(DECODE_IDS[0], DecodeLimits(kv_capacity_tokens=10**6, max_batch_size=1))
    assert conductor.schedule(request("full-again", [70]), 0.0).reason is Reason.BATCH_FULL
    assert set(conductor.in_flight) == {RequestId("filler-0"), RequestId("filler-1"), RequestId("fits-now")}
    conductor.check_invariants()
    with pytest.raises(UnknownInstanceError, match="no decode instance"):
        conductor.set_decode_limits(InstanceId("nowhere"), DecodeLimits(kv_capacity_tokens=1))
    with pytest.raises(ConfigError, match="DecodeLimits"):
        conductor.set_decode_limits(DECODE_IDS[0], {"kv_capacity_tokens": 1})  # type: ignore[arg-type]
    assert conductor.decode_views[0].limits.max_batch_size == 1


@pytest.mark.parametrize("field", ["kv_capacity_tokens", "max_batch_size", "max_context_tokens"])
def test_a_limit_past_what_the_scan_holds_is_refused_and_adds_nothing(field: str) -> None:
    """A decode limit of 2**61 or more (past the compiled scan's int64 room) is a ConfigError naming it, made
    with the limits, before any instance is added; the largest allowed, 2**61 - 1, is taken."""
    with pytest.raises(ConfigError, match=rf"{field} must be an integer in \[\d, 2\*\*61\), got {2**64}"):
        DecodeLimits(**{"kv_capacity_tokens": 1000, field: 2**64})
    conductor = make_conductor()
    conductor.add_decode_instance(
        InstanceId("decode-big"), DecodeLimits(**{"kv_capacity_tokens": 1000, field: 2**61 - 1})
    )
    assert placement(conductor.schedule(request("r", DOC), 0.0))[1] in (*DECODE_IDS, InstanceId("decode-big"))


def test_events_from_unknown_or_wrong_instances_are_refused() -> None:
    """A progress event naming an instance never added, or one of the wrong kind, is an
    UnknownInstanceError that says what to do; one from a known instance the request was not routed
    to is an InvalidRequestError naming both; nothing changes either way."""
    conductor = make_conductor()
    prefill, decode = placement(conductor.schedule(request("r", DOC), 0.0))
    other_prefill = next(p for p in PREFILL_IDS if p != prefill)
    with pytest.raises(UnknownInstanceError, match=r"prefill-9.*add_prefill_instance"):
        conductor.handle(PrefillStarted(request_id=RequestId("r"), instance_id=InstanceId("prefill-9"), now=1.0))
    with pytest.raises(UnknownInstanceError, match="it is a decode instance"):
        conductor.handle(PrefillFinished(request_id=RequestId("r"), instance_id=decode, now=1.0))
    with pytest.raises(UnknownInstanceError, match="decode"):
        conductor.handle(DecodeFinished(request_id=RequestId("r"), instance_id=prefill, now=1.0))
    with pytest.raises(InvalidRequestError, match=rf"{other_prefill}.*routed to {prefill}"):
        conductor.handle(PrefillFinished(request_id=RequestId("r"), instance_id=other_prefill, now=1.0))
    assert conductor.in_flight == (RequestId("r"),)
    conductor.check_invariants()
    # About an unknown request (ended, or never accepted) a known instance's report is ignored.
    assert conductor.handle(DecodeFinished(request_id=RequestId("gone"), instance_id=decode, now=1.0)) == ()


@pytest.mark.parametrize(
    ("keys", "tokens", "block", "match"),
    [
        (3, 200, None, "3 block keys, but 200 tokens"),  # 200 tokens in 256-token blocks: one key
        (1, 300, None, "1 block keys, but 300 tokens"),
        (1, 200, 128, "keyed in 128-token blocks"),
    ],
)
def test_requests_must_be_keyed_in_the_conductors_blocks(keys: int, tokens: int, block: int | None, match: str) -> None:
    """A request whose keys do not cover its prompt in the Conductor's blocks, or that was keyed with
    another block size, is an InvalidRequestError naming both values; nothing is scheduled."""
    conductor = make_conductor()
    r = Request(
        request_id=RequestId("r"),
        arrival_s=0.0,
        input_length=tokens,
        output_length=10,
        block_keys=tuple(BlockKey(k) for k in range(keys)),
        block_size_tokens=block if block is None or keys == -(-tokens // block) else None,
    )
    if block is not None:  # keyed consistently, but in other blocks than the Conductor's
        r = attrs.evolve(r, block_size_tokens=block, block_keys=tuple(BlockKey(k) for k in range(-(-tokens // block))))
    with pytest.raises(InvalidRequestError, match=match):
        conductor.schedule(r, 0.0)
    assert conductor.in_flight == ()
    assert all(not v.queue for v in conductor.prefill_views)


@given(
    input_length=st.integers(1, 20_000),
    keyed_with=st.sampled_from([None, 64, 128, 256, 512]),
    conductor_block=st.sampled_from([64, 256, 512]),
)
@settings(max_examples=50)
def test_a_request_is_scheduled_iff_keyed_in_the_conductors_blocks(
    input_length: int, keyed_with: int | None, conductor_block: int
) -> None:
    """One source of truth: a request keyed (or, without a stated block size, counted) in other blocks than
    the Conductor's is refused naming both values and leaves nothing behind; one keyed in its blocks is decided."""
    block = keyed_with if keyed_with is not None else 128  # unstated: its keys were made in 128-token blocks
    keys = tuple(BlockKey(k) for k in range(-(-input_length // block)))
    r = Request(
        request_id=RequestId("r"),
        arrival_s=0.0,
        input_length=input_length,
        output_length=10,
        block_keys=keys,
        block_size_tokens=keyed_with,
    )
    conductor = make_conductor(block_size=conductor_block)
    fits = len(keys) == -(-input_length // conductor_block) and keyed_with in (None, conductor_block)
    if fits:
        assert conductor.schedule(r, 0.0).request_id == r.request_id
    else:
        with pytest.raises(InvalidRequestError, match=str(conductor_block)):
            conductor.schedule(r, 0.0)
        assert conductor.in_flight == ()
    conductor.check_invariants()


# ---------------------------------------------------------------------------- the event flow


def test_request_flows_from_prefill_to_decode_and_ends_once() -> None:
    """Scheduled → prefill started/finished → decode joined → finished: views follow; later events are ignored."""
    conductor = make_conductor()
    r = request("r", DOC, output=300)
    decision = conductor.schedule(r, 0.0)
    assert decision.accepted and decision.reason is None
    prefill, decode = decision.prefill_instance, decision.decode_instance
    assert prefill is not None and decode is not None
    view = {v.instance_id: v for v in conductor.decode_views}[decode]
    assert view.reserved == {r.request_id: Reservation(8192, 300)} and view.used_tokens == 0
    assert conductor.handle(PrefillStarted(request_id=r.request_id, instance_id=prefill, now=0.5)) == ()
    assert conductor.handle(PrefillFinished(request_id=r.request_id, instance_id=prefill, now=1.4)) == ()
    assert all(not v.queue for v in conductor.prefill_views)
    joined = DecodeJoined(request_id=r.request_id, instance_id=decode, now=1.5, context_tokens=8192, output_tokens=300)
    assert conductor.handle(joined) == ()
    assert (view.batch_size, view.used_tokens, view.reserved_tokens) == (1, 8492, 0)
    conductor.check_invariants()
    assert conductor.in_flight == (r.request_id,)
    ends = conductor.handle(DecodeFinished(request_id=r.request_id, instance_id=decode, now=9.0, generated_tokens=280))
    assert ends == (RequestEnd(r.request_id, Outcome.COMPLETED),)
    assert (view.batch_size, view.used_tokens, conductor.in_flight) == (0, 0, ())
    for late in (
        joined,
        DecodeFinished(request_id=r.request_id, instance_id=decode, now=9.5),
        RequestRejected(request_id=r.request_id, instance_id=decode, now=9.5),
    ):
        assert conductor.handle(late) == ()
    conductor.check_invariants()


def test_invariants_hold_between_prefill_and_decode() -> None:
    """Minimal repro: after PrefillFinished (KV on its way to decode) the Conductor's own invariants still hold."""
    conductor = make_conductor()
    prefill, _ = placement(conductor.schedule(request("r", DOC[:4]), 0.0))
    conductor.handle(PrefillFinished(request_id=RequestId("r"), instance_id=prefill, now=1.0))
    conductor.check_invariants()


def test_decode_joined_without_prefill_finished_leaves_the_queue() -> None:
    """Joining decode implies the prefill is over: the request leaves its queue and its reservation becomes use."""
    conductor = make_conductor()
    _, decode = placement(conductor.schedule(request("r", DOC), 0.0))
    conductor.handle(
        DecodeJoined(request_id=RequestId("r"), instance_id=decode, now=1.0, context_tokens=8192, output_tokens=100)
    )
    assert all(not v.queue for v in conductor.prefill_views)
    conductor.check_invariants()


def test_a_reported_backlog_delays_what_is_routed_there_until_it_clears() -> None:
    """Work the Conductor did not route (another client of a shared server) counts as queue: a request
    goes elsewhere while it lasts, and where it goes it starts after it; a report of none clears it."""
    conductor = make_conductor(router="load_balancing")
    conductor.handle(PrefillBacklog(instance_id=P0, now=0.0, until_s=5.0))
    first = conductor.schedule(request("first", DOC[:2]), 0.0)
    assert first.prefill_instance == P1
    for instance in (P1, P2):
        conductor.handle(PrefillBacklog(instance_id=instance, now=0.0, until_s=9.0))
    second = conductor.schedule(request("second", DOC[2:4]), 0.0)
    assert second.prefill_instance == P0 and second.ttft_s is not None and second.ttft_s > 5.0
    view = next(v for v in conductor.prefill_views if v.instance_id == P0)
    assert view.queue[-1].start_s == 5.0
    conductor.handle(PrefillBacklog(instance_id=P2, now=1.0, until_s=1.0))  # none any more
    assert next(v for v in conductor.prefill_views if v.instance_id == P2).queue_s(1.0) == 0.0
    conductor.check_invariants()
    with pytest.raises(UnknownInstanceError, match="it is a decode instance"):
        conductor.handle(PrefillBacklog(instance_id=D0, now=1.0, until_s=2.0))


def test_new_prompts_spread_over_idle_instances_and_follow_their_cache() -> None:
    """Prompts new to every idle prefill instance spread over all of them (rendezvous homes, not the
    smallest id); once one holds a prompt, the prompt's next request goes there."""
    conductor, caches = make_conductor(router="local_cache_aware"), Caches()
    where = collections.Counter()
    for n in range(60):
        decision = conductor.schedule(request(f"new{n}", range(10_000 * (n + 1), 10_000 * (n + 1) + 4)), 1000.0 * n)
        where[decision.prefill_instance] += 1
        conductor.handle(RequestAborted(request_id=RequestId(f"new{n}"), now=1000.0 * n))
    assert set(where) == set(PREFILL_IDS) and min(where.values()) >= 10, where
    home = conductor.schedule(request("doc", range(5000, 5004)), 1e6).prefill_instance
    conductor.handle(RequestAborted(request_id=RequestId("doc"), now=1e6))
    other = next(p for p in PREFILL_IDS if p != home)
    caches.store(conductor, other, range(5000, 5004))  # another instance holds it now
    again = conductor.schedule(request("again", range(5000, 5006)), 2e6)
    assert again.prefill_instance == other


def test_a_request_of_one_output_token_holds_nothing_on_decode() -> None:
    """Its only token is its prefill's: promised no slot and no KV, it holds none when it joins (found by
    the state machine: an instance filled to what early rejection promised went over capacity)."""
    conductor = make_conductor(admission="early_rejection", capacity_tokens=20_000)
    _, decode = placement(conductor.schedule(request("one", DOC[:4], output=1), 0.0))
    conductor.handle(
        DecodeJoined(
            request_id=RequestId("one"), instance_id=decode, now=1.0, context_tokens=4 * BLOCK, output_tokens=1
        )
    )
    conductor.check_invariants()
    view = next(v for v in conductor.decode_views if v.instance_id == decode)
    assert (view.used_tokens, view.reserved_tokens, view.batch_size) == (0, 0, 0)
    assert all(not v.queue for v in conductor.prefill_views)
    assert conductor.handle(DecodeFinished(request_id=RequestId("one"), instance_id=decode, now=2.0)) == (
        RequestEnd(RequestId("one"), Outcome.COMPLETED, None),
    )
    conductor.check_invariants()


def test_rejection_by_decode_ends_the_request_with_its_reason() -> None:
    """The decode instance's own refusal ends the request: the reason given, or decode_rejected."""
    conductor = make_conductor()
    (_, first), (_, second) = (
        placement(conductor.schedule(request("a", DOC), 0.0)),
        placement(conductor.schedule(request("b", DOC), 0.0)),
    )
    plain = RequestRejected(request_id=RequestId("a"), instance_id=first, now=1.0)
    rejected = Outcome.REJECTED_AFTER_PREFILL
    assert conductor.handle(plain) == (RequestEnd(RequestId("a"), rejected, Reason.DECODE_REJECTED),)
    tbt = RequestRejected(request_id=RequestId("b"), instance_id=second, now=1.0, reason=Reason.TBT_SLO)
    assert conductor.handle(tbt) == (RequestEnd(RequestId("b"), rejected, Reason.TBT_SLO),)
    assert conductor.in_flight == ()
    assert all(v.reserved_tokens == 0 for v in conductor.decode_views)
    conductor.check_invariants()


def test_duplicate_request_id_is_an_invalid_request() -> None:
    """Scheduling an id already in flight raises InvalidRequestError and changes nothing; once ended it may return."""
    conductor = make_conductor()
    _, decode = placement(conductor.schedule(request("r", DOC), 0.0))
    queues = [list(v.queue) for v in conductor.prefill_views]
    with pytest.raises(InvalidRequestError, match="r"):
        conductor.schedule(request("r", DOC[:3]), 0.1)
    assert [list(v.queue) for v in conductor.prefill_views] == queues
    conductor.handle(DecodeFinished(request_id=RequestId("r"), instance_id=decode, now=1.0))
    assert conductor.schedule(request("r", DOC), 2.0).accepted


def test_prefill_finished_teaches_the_adaptive_threshold() -> None:
    """A transfer decision whose prefill finishes far later than estimated raises the adaptive threshold."""
    conductor, caches = make_conductor(router="adaptive"), Caches()
    router = conductor.router
    assert isinstance(router, KvCacheCentricRouter) and router.adaptive is not None
    occupy(conductor, P0, count=3)
    caches.store(conductor, P0, DOC)
    decision = conductor.schedule(request("r", DOC), 0.0)
    prefill, _ = placement(decision)
    assert decision.transfer is not None and decision.ttft_s is not None
    router.adaptive.observe(had_transfer=False, estimated_ttft_s=1.0, observed_ttft_s=1.0)  # a local one, on time
    before = router.adaptive.value
    conductor.handle(PrefillFinished(request_id=RequestId("r"), instance_id=prefill, now=3 * decision.ttft_s))
    assert router.adaptive.value > before


def test_a_router_learns_the_prefill_end_it_estimated_without_the_first_tokens_overhead() -> None:
    """PrefillFinished comes at the prefill's end, before the first token's overhead: the estimate a router
    learns against is the TTFT less that overhead, so a prefill ending as estimated reads as on time (it read as
    early by the overhead, and an adaptive threshold climbed on that bias alone)."""
    router = RecordingRouter(attrs.evolve(ESTIMATOR, first_token_overhead_s=0.5))
    conductor = make_conductor(router=router)
    decision = conductor.schedule(request("r", DOC), 1.0)
    prefill, _ = placement(decision)
    assert decision.ttft_s is not None and decision.ttft_s > 0.5
    end = 1.0 + decision.ttft_s - 0.5
    conductor.handle(PrefillFinished(request_id=RequestId("r"), instance_id=prefill, now=end))
    ((_, estimated, observed),) = router.observed
    assert estimated == pytest.approx(observed) and estimated == pytest.approx(decision.ttft_s - 0.5)


@attrs.define
class RecordingRouter:
    """Routes to the first candidate, and keeps what it is told through `observe`."""

    estimator: TtftEstimator
    observed: list[tuple[bool, float, float]] = attrs.field(factory=list)

    def route(
        self, candidates: Sequence[PrefillView], query: RouteQuery, now: float, rng: random.Random
    ) -> RouteDecision | None:
        if not candidates:
            return None
        view = candidates[0]
        own = query.prefix_blocks.get(view.instance_id, 0)
        return self.estimator.decide(view, query, now, prefix_blocks=own, transfer_from=None)

    def observe(self, *, had_transfer: bool, estimated_ttft_s: float, observed_ttft_s: float) -> None:
        self.observed.append((had_transfer, estimated_ttft_s, observed_ttft_s))


def test_routers_learn_through_observe_once_per_prefill() -> None:
    """Any router is told each finished prefill once, through its protocol's `observe`: the TTFT it
    estimated and the one observed since scheduling; a request prefilled inline teaches nothing."""
    router = RecordingRouter(ESTIMATOR)
    conductor = make_conductor(router=router)
    decision = conductor.schedule(request("r", DOC), 1.0)
    prefill, _ = placement(decision)
    assert decision.ttft_s is not None
    for now in (4.0, 5.0):  # the repeat is ignored
        conductor.handle(PrefillFinished(request_id=RequestId("r"), instance_id=prefill, now=now))
    assert router.observed == [(False, decision.ttft_s, 3.0)]
    _, inline_decode = placement(conductor.schedule(request("inline", DOC[:2]), 6.0))
    conductor.handle(PrefilledInline(request_id=RequestId("inline"), instance_id=inline_decode, now=6.0))
    assert router.observed == [(False, decision.ttft_s, 3.0)]


def test_prefilled_inline_leaves_the_queue_and_keeps_the_reservation() -> None:
    """A request prefilled inside its decode batch leaves its prefill queue at once; its KV stays
    reserved on the decode instance until it joins, and a later PrefillFinished about it is ignored."""
    conductor = make_conductor(router="adaptive")
    prefill, decode = placement(conductor.schedule(request("r", DOC), 0.0))
    router = conductor.router
    assert isinstance(router, KvCacheCentricRouter) and router.adaptive is not None
    before = router.adaptive.value
    assert conductor.handle(PrefilledInline(request_id=RequestId("r"), instance_id=decode, now=0.0)) == ()
    assert all(not v.queue for v in conductor.prefill_views)
    view = {v.instance_id: v for v in conductor.decode_views}[decode]
    assert RequestId("r") in view.reserved
    conductor.check_invariants()
    conductor.handle(PrefillFinished(request_id=RequestId("r"), instance_id=prefill, now=50.0))
    assert router.adaptive.value == before
    conductor.handle(
        DecodeJoined(request_id=RequestId("r"), instance_id=decode, now=0.1, context_tokens=8192, output_tokens=100)
    )
    assert view.batch_size == 1 and not view.reserved
    conductor.check_invariants()


@settings(deadline=None)
@given(
    st.sampled_from(ROUTERS),
    st.sampled_from(ADMISSIONS),
    st.integers(min_value=2, max_value=5),
    st.lists(st.tuples(st.integers(1, 12_000), st.integers(2, 2000)), min_size=1, max_size=25),
)
def test_no_request_piles_onto_a_node_while_another_is_idle(
    router: str, admission: str, num_decode: int, requests: list[tuple[int, int]]
) -> None:
    """On a symmetric cluster, requests arriving together go to an idle decode instance while one is
    left: those accepted but still in prefill count on the instance they were sent to. Equal
    requests end up spread evenly (counts differ by at most one)."""
    conductor = Conductor(
        router=make_router(router),
        step_model=DECODE_COST,
        admission=make_admission(admission),
        predictor=UniformDecodePredictor(decode_s=10.0),
        slo=Slo(ttft_s=1e9, tbt_s=1.0),
        block_size_tokens=BLOCK,
    )
    for instance in PREFILL_IDS:
        conductor.add_prefill_instance(instance)
    decode_ids = [InstanceId(f"decode-{i}") for i in range(num_decode)]
    for instance in decode_ids:
        conductor.add_decode_instance(instance, DecodeLimits(kv_capacity_tokens=DECODE_COST.capacity_tokens()))
    counts = dict.fromkeys(decode_ids, 0)
    for i, (tokens, output) in enumerate(requests):
        r = Request(
            request_id=RequestId(f"r{i}"),
            arrival_s=0.0,
            input_length=tokens,
            output_length=output,
            block_keys=tuple(BlockKey(10_000 * i + b) for b in range(-(-tokens // BLOCK))),
        )
        idle_before = [d for d in decode_ids if counts[d] == 0]
        decision = conductor.schedule(r, 0.0)
        assert decision.accepted, decision
        assert decision.decode_instance is not None
        if idle_before:
            assert decision.decode_instance in idle_before, (decision.decode_instance, counts)
        counts[decision.decode_instance] += 1
    equal = [(tokens, output) for tokens, output in requests[:1]] * len(requests)
    if requests == equal:
        assert max(counts.values()) - min(counts.values()) <= 1, counts


C0, C1 = InstanceId("coupled-0"), InstanceId("coupled-1")


@settings(deadline=None)
@given(
    st.sampled_from(ROUTERS),
    st.sampled_from(ADMISSIONS),
    st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12_000), st.integers(2, 2000)), min_size=1, max_size=25),
    st.integers(1, 4),
)
def test_a_coupled_instance_decodes_what_it_prefilled_and_nothing_else(
    router: str, admission: str, requests: list[tuple[int, int, int]], max_batch: int
) -> None:
    """In a cluster of prefill, decode and coupled instances, a request routed to a coupled instance
    decodes there (or is refused by the rule there: a full batch is not a reason to decode elsewhere),
    and one routed to a prefill instance never decodes on a coupled one."""
    conductor = make_conductor(router=router, admission=admission, max_batch_size=max_batch)
    for instance in (C0, C1):
        conductor.add_coupled_instance(instance, DecodeLimits(kv_capacity_tokens=100_000, max_batch_size=max_batch))
    for i, (shared, tokens, output) in enumerate(requests):
        keys = [*DOC[: min(shared, len(DOC))], *range(10_000 * (i + 1), 10_000 * (i + 1) + 48)]
        r = request(f"r{i}", keys[: -(-tokens // BLOCK)], tokens=tokens, output=output)
        decision = conductor.schedule(r, float(i))
        if decision.prefill_instance in (C0, C1):
            assert decision.decode_instance in (decision.prefill_instance, None), decision
        elif decision.decode_instance is not None:
            assert decision.decode_instance in DECODE_IDS, decision
        conductor.check_invariants()


def test_a_coupled_instance_takes_its_events_under_one_id_and_goes_down_whole() -> None:
    """Prefill and decode events name the coupled instance; down, it leaves routing and decode
    selection both and ends what it held; up again, it serves both."""
    conductor = Conductor(
        router=make_router("kvcache_centric"),
        step_model=DECODE_COST,
        admission=make_admission("early_rejection"),
        predictor=UniformDecodePredictor(decode_s=10.0),
        slo=Slo(),
        block_size_tokens=BLOCK,
    )
    for instance in (C0, C1):
        conductor.add_coupled_instance(instance, DecodeLimits(kv_capacity_tokens=100_000))
    with pytest.raises(ConfigError):
        conductor.add_decode_instance(C0, DecodeLimits(kv_capacity_tokens=1))
    prefill, decode = placement(conductor.schedule(request("r", DOC[:4]), 0.0))
    assert prefill == decode
    conductor.handle(PrefillFinished(request_id=RequestId("r"), instance_id=prefill, now=0.5))
    conductor.handle(
        DecodeJoined(request_id=RequestId("r"), instance_id=decode, now=0.5, context_tokens=1024, output_tokens=1)
    )
    conductor.check_invariants()
    assert conductor.handle(InstanceDown(instance_id=prefill, now=1.0)) == (
        RequestEnd(RequestId("r"), Outcome.ABORTED, Reason.INSTANCE_DOWN),
    )
    other = C1 if prefill == C0 else C0
    assert {v.instance_id: v.is_up for v in conductor.decode_views} == {prefill: False, other: True}
    for i in range(3):
        assert placement(conductor.schedule(request(f"s{i}", DOC[:4]), 2.0)) == (other, other)
    conductor.handle(InstanceUp(instance_id=prefill, now=2.0))
    assert all(v.is_up for v in (*conductor.prefill_views, *conductor.decode_views))
    assert placement(conductor.schedule(request("t", range(5000, 5004)), 2.0)) == (prefill, prefill)  # the idle one
    conductor.check_invariants()


def test_a_queue_is_retimed_by_occupancy_and_never_in_the_past() -> None:
    """On a chunked-pipeline group the queue's next prefill starts once the one before has left the first stage
    (its occupancy, not its whole prefill), also when a late start retimes the queue; a prefill that ends late
    moves those not started yet to now, never earlier."""
    cpp = TtftEstimator(
        prefill=ChunkedPipelineCost(base=ESTIMATOR.prefill, group_size=4, chunk_tokens=1024),
        transfer=ESTIMATOR.transfer,
        kv_bytes_per_token=LLAMA3.kv_bytes_per_token,
    )
    conductor = one_pair(cpp)
    for i in range(3):
        assert conductor.schedule(request(f"r{i}", range(100 * i, 100 * i + 32)), 0.0).accepted
    hold = cpp.prefill.occupancy_s(32 * BLOCK)
    assert hold < cpp.prefill.prefill_s(32 * BLOCK)
    conductor.handle(PrefillStarted(request_id=RequestId("r0"), instance_id=P0, now=0.5))
    (view,) = conductor.prefill_views
    assert [e.start_s for e in view.queue] == pytest.approx([0.5, 0.5 + hold, 0.5 + 2 * hold])
    conductor.handle(PrefillFinished(request_id=RequestId("r0"), instance_id=P0, now=50.0))
    assert [e.start_s for e in view.queue] == pytest.approx([50.0, 50.0 + hold])
    conductor.check_invariants()


def test_a_join_claiming_more_context_than_was_reserved_is_held_to_the_reservation() -> None:
    """A DecodeJoined whose context exceeds what the request reserved (prompt + output) counts the reservation:
    the instance's KV never grows past what admission promised, and no request holds a negative output."""
    conductor = make_conductor()
    _, decode = placement(conductor.schedule(request("r", DOC, output=100), 0.0))
    conductor.handle(
        DecodeJoined(request_id=RequestId("r"), instance_id=decode, now=1.0, context_tokens=50_000, output_tokens=10)
    )
    view = next(v for v in conductor.decode_views if v.instance_id == decode)
    assert view.used_tokens == len(DOC) * BLOCK + 100 and view.active[RequestId("r")].output_tokens == 0
    conductor.check_invariants()


def test_a_removed_instance_is_forgotten_and_its_id_may_come_back() -> None:
    """Removing an instance ends what going down ends, drops it from the views, the boards and the index, lets
    a request it already prefilled finish on its decode instance, ignores its late reports (they race with its
    removal, which ended its requests; they were refused as from an unknown instance), and frees its id for a new
    instance."""
    conductor = make_conductor()
    first = conductor.schedule(request("done", DOC), 0.0)
    prefill, decode = placement(first)
    conductor.handle(PrefillFinished(request_id=RequestId("done"), instance_id=prefill, now=0.5))
    conductor.apply_cache_event(BlockStored(source=prefill, seq=0, keys=[BlockKey(k) for k in DOC], tier=Tier.DRAM))
    queued = conductor.schedule(request("queued", DOC), 0.6)
    assert placement(queued)[0] == prefill  # it holds the document
    assert conductor.remove_instance(prefill, 1.0) == (
        RequestEnd(RequestId("queued"), Outcome.ABORTED, Reason.INSTANCE_DOWN),
    )
    assert prefill not in {v.instance_id for v in conductor.prefill_views}
    assert prefill not in conductor.index.instances
    conductor.check_invariants()
    # What it prefilled goes on.
    conductor.handle(
        DecodeJoined(request_id=RequestId("done"), instance_id=decode, now=1.1, context_tokens=8192, output_tokens=100)
    )
    assert conductor.handle(DecodeFinished(request_id=RequestId("done"), instance_id=decode, now=2.0)) == (
        RequestEnd(RequestId("done"), Outcome.COMPLETED),
    )
    for late in (
        PrefillStarted(request_id=RequestId("queued"), instance_id=prefill, now=2.0),
        PrefillFinished(request_id=RequestId("queued"), instance_id=prefill, now=2.0),
        PrefillBacklog(instance_id=prefill, now=2.0, until_s=3.0),
    ):
        assert conductor.handle(late) == ()
    conductor.check_invariants()
    with pytest.raises(UnknownInstanceError):  # an instance never added is still a misuse
        conductor.handle(PrefillStarted(request_id=RequestId("queued"), instance_id=InstanceId("p-never"), now=2.0))
    with pytest.raises(UnknownInstanceError):
        conductor.remove_instance(prefill, 2.0)
    for bad in (["p0"], None, 7):  # no id at all: the library's error, not a TypeError
        with pytest.raises(UnknownInstanceError):
            conductor.remove_instance(bad, 2.0)  # type: ignore[arg-type]
        with pytest.raises(UnknownInstanceError):
            conductor.set_decode_limits(bad, DecodeLimits(kv_capacity_tokens=1))  # type: ignore[arg-type]
        with pytest.raises(UnknownInstanceError):
            conductor.incoming(bad)  # type: ignore[arg-type]
    for i in range(6):  # never routed to it again
        assert placement(conductor.schedule(request(f"after{i}", range(500 + 10 * i, 504 + 10 * i)), 2.0))[0] != prefill
    # A decode instance goes the same way; the ids come back as new instances, with nothing of the old ones.
    ended = conductor.remove_instance(D1, 3.0)
    assert all(end.reason is Reason.INSTANCE_DOWN for end in ended)
    assert [v.instance_id for v in conductor.decode_views] == [D0]
    conductor.add_prefill_instance(prefill)
    conductor.add_decode_instance(D1, DecodeLimits(kv_capacity_tokens=10**6))
    assert conductor.index.match([BlockKey(k) for k in DOC]).best_length == 0
    assert len(conductor.prefill_views) == 3 and len(conductor.decode_views) == 2
    conductor.check_invariants()
    with pytest.raises(InvalidRequestError, match="now"):
        conductor.remove_instance(prefill, math.nan)


def test_decode_finished_teaches_the_output_length_predictor() -> None:
    """Generated token counts reported at the end feed an output-length predictor."""
    predictor = OutputLengthPredictor(step_s=0.02)
    conductor = make_conductor(admission="predictive_early_rejection", predictor=predictor)
    for i, generated in enumerate([30, 10, 20]):
        _, decode = placement(conductor.schedule(request(f"r{i}", DOC), float(i)))
        finished = DecodeFinished(
            request_id=RequestId(f"r{i}"), instance_id=decode, now=i + 0.5, generated_tokens=generated
        )
        conductor.handle(finished)
    assert predictor.lengths == [10, 20, 30]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, 1e30, "3", True])
@pytest.mark.parametrize("field", ["batch_size", "context_tokens", "kv_tokens"])
def test_a_predictor_answering_a_load_that_is_no_count_is_named(field: str, bad: float) -> None:
    """A plugged-in predictor's NaN, infinity or negative count is a ConfigError naming it and the instance,
    before the schedule changes anything."""

    class Broken:
        def predict(self, active: object, incoming: object, now: float, at_s: float) -> DecodeLoad:
            return attrs.evolve(DecodeLoad(1, 10, 10), **{field: bad})

        def observe(self, output_tokens: int) -> None:
            pass

    conductor = make_conductor(admission="predictive_early_rejection", predictor=Broken())
    named = re.escape(f"{field}={bad!r}")
    with pytest.raises(ConfigError, match=rf"predictor Broken predicted .*{named}.* for {DECODE_IDS[0]}"):
        conductor.schedule(request("r", DOC), 0.0)
    assert not conductor.in_flight
    conductor.check_invariants()


# ---------------------------------------------------------------------------- state machine


@attrs.define
class Tracked:
    """What the model knows of one request in flight."""

    request: Request
    prefill: InstanceId
    decode: InstanceId
    scheduled_s: float
    stage: str  # queued | started | prefilled | decoding
    keeps: bool = True  # its prefill leaves its blocks in the prefill instance's cache
    transfer: tuple[InstanceId, float] | None = None  # the source its prefill fetches from, and the estimated finish

    @property
    def tokens(self) -> int:
        return self.request.input_length + self.request.output_length


class ConductorMachine(RuleBasedStateMachine):
    """Random arrivals and events against a model of where each request is, and how each ended."""

    def __init__(self) -> None:
        super().__init__()
        self.conductor: Conductor
        self.tracked: dict[RequestId, Tracked] = {}
        self.ends: collections.Counter[RequestId] = collections.Counter()
        self.down: set[InstanceId] = set()
        self.removed: set[InstanceId] = set()  # forgotten by the Conductor (also in `down`: nothing routes there)
        self.caches = Caches()
        self.now = 0.0
        self.next_id = 0
        self.next_fresh_key = 10**6
        self.backlog: dict[InstanceId, float] = {}  # the backlog each prefill instance's owner last reported
        # The queue timing's reference: when each queued request could start as routed (its transfer done, the
        # backlog it was routed behind over), when its start was reported, and per prefill instance the queue
        # (ids, started) last seen and when it was last retimed (a start reported, a request leaving it).
        self.earliest: dict[RequestId, float] = {}
        self.started_at: dict[RequestId, float] = {}
        self.seen_queues: dict[InstanceId, list[tuple[RequestId, bool]]] = {}
        self.retimed_at: dict[InstanceId, float] = {}

    @initialize(
        router=st.sampled_from(ROUTERS),
        admission=st.sampled_from(ADMISSIONS),
        predictor=st.sampled_from(["uniform", "output_length"]),
        slo=st.sampled_from([Slo(), Slo(ttft_s=1.0, tbt_s=0.0165), Slo(ttft_s=3.0, tbt_s=0.017)]),
        capacity=st.sampled_from([20_000, 60_000, 400_000]),
        threshold=st.sampled_from([1.0, 1.5, 4.0]),
        seed=st.integers(min_value=0, max_value=2**32 - 1),
        cache_blocks=st.sampled_from([None, 0, 3, 8]),
        warm=st.lists(
            st.tuples(st.integers(min_value=0, max_value=3), st.sampled_from(PREFILL_IDS), st.integers(1, 12)),
            max_size=4,
        ),
    )
    def setup(
        self,
        router: str,
        admission: str,
        predictor: str,
        slo: Slo,
        capacity: int,
        threshold: float,
        seed: int,
        cache_blocks: int | None,
        warm: list[tuple[int, InstanceId, int]],
    ) -> None:
        self.router_name, self.admission_name, self.slo, self.capacity = router, admission, slo, capacity
        self.cache_blocks = cache_blocks
        self.conductor = make_conductor(
            router=router,
            threshold=threshold,
            admission=admission,
            predictor=UniformDecodePredictor(decode_s=2.0)
            if predictor == "uniform"
            else OutputLengthPredictor(step_s=0.02),
            slo=slo,
            capacity_tokens=capacity,
            block_size=MACHINE_BLOCK,
            seed=seed,
            cache_blocks=cache_blocks,
        )
        for document, instance, blocks in warm:  # documents some caches already hold
            self.caches.store(self.conductor, instance, [1000 * document + i for i in range(blocks)])

    # ---------------------------------------------------------------- helpers

    def _in_stage(self, *stages: str) -> list[RequestId]:
        return sorted(rid for rid, t in self.tracked.items() if t.stage in stages)

    def _end(
        self, request_id: RequestId, ends: tuple[RequestEnd, ...], outcome: Outcome, reason: Reason | None = None
    ) -> None:
        assert ends == (RequestEnd(request_id, outcome, reason),)
        del self.tracked[request_id]
        self.ends[request_id] += 1

    # ---------------------------------------------------------------- rules

    @rule(
        document=st.integers(min_value=0, max_value=3),
        shared=st.integers(min_value=0, max_value=12),
        fresh=st.integers(min_value=0, max_value=6),
        last_block=st.integers(min_value=1, max_value=MACHINE_BLOCK),
        output=st.sampled_from([1, 64, 1500]) | st.integers(min_value=1, max_value=2000),
    )
    def arrive(self, document: int, shared: int, fresh: int, last_block: int, output: int) -> None:
        self._arrive(document, shared, fresh, last_block, output)

    @rule(
        document=st.integers(min_value=0, max_value=3),
        shared=st.integers(min_value=1, max_value=12),
        count=st.integers(min_value=2, max_value=6),
    )
    def burst(self, document: int, shared: int, count: int) -> None:
        """Several requests on one document at once: its holder gets busy, so replication pays."""
        for _ in range(count):
            self._arrive(document, shared, 1, MACHINE_BLOCK, 100)

    def _arrive(self, document: int, shared: int, fresh: int, last_block: int, output: int) -> None:
        keys = [1000 * document + i for i in range(shared)]
        keys += range(self.next_fresh_key, self.next_fresh_key + max(fresh, 0 if keys else 1))
        self.next_fresh_key += len(keys)
        r = Request(
            request_id=RequestId(f"r{self.next_id}"),
            arrival_s=self.now,
            input_length=(len(keys) - 1) * MACHINE_BLOCK + last_block,
            output_length=output,
            block_keys=tuple(BlockKey(k) for k in keys),
        )
        self.next_id += 1
        up_prefill = [p for p in PREFILL_IDS if p not in self.down]
        _longest, best_blocks = self.caches.holdings.best(up_prefill, r.block_keys)
        usable = (r.input_length - 1) // MACHINE_BLOCK  # blocks before the one holding the last token
        # The replicas: holders of as much as a prefill reuses; the source is the one with the fewest transfers
        # still leaving it for waiting prefills (ties: the smallest id).
        enough = min(best_blocks, usable) or best_blocks
        holders = [
            p for p in up_prefill if best_blocks and self.caches.holdings.prefix_blocks(p, r.block_keys) >= enough
        ]
        best = min(holders, key=lambda p: (self._leaving(p), p)) if holders else None
        # A queue whose times went stale (one started was to end before now, or the first not reported started
        # behind a started one was to start before now) is retimed now, before the request is routed.
        for view in self.conductor.prefill_views:
            running = list(itertools.takewhile(lambda q: q.started, view.queue))
            waiting = view.queue[len(running)] if running and len(running) < len(view.queue) else None
            if any(q.finish_s < self.now for q in running) or (waiting is not None and waiting.start_s < self.now):
                self.retimed_at[view.instance_id] = self.now
        decision = self.conductor.schedule(r, self.now)
        event(
            f"{decision.reason.value if decision.reason else 'accepted'}{' with transfer' if decision.transfer else ''}"
        )
        assert decision.request_id == r.request_id
        if not decision.accepted:
            assert decision.reason is not None
            if decision.reason is Reason.NO_PREFILL_INSTANCE:
                assert not up_prefill
            if decision.reason in STRUCTURAL and self.admission_name != "predictive_early_rejection":
                # No instance up that the decode rule lets in, against what each is committed to.
                assert not any(
                    check_join(v.limits, v.load(), prompt_tokens=r.input_length, output_tokens=r.output_length).accepted
                    for v in self.conductor.decode_views
                    if v.is_up
                )
            self.ends[r.request_id] += 1
            return
        assert decision.reason is None
        prefill, decode = decision.prefill_instance, decision.decode_instance
        assert prefill in up_prefill and decode is not None and decode not in self.down
        assert decision.ttft_s is not None and decision.tbt_s is not None
        assert decision.ttft_s <= self.slo.ttft_s
        if self.admission_name != "baseline":
            assert decision.tbt_s <= self.slo.tbt_s
        own = self._own_prefix(prefill, r.block_keys)
        if decision.transfer is None:
            assert decision.prefix_tokens == min(own, usable) * MACHINE_BLOCK
        else:
            assert self.router_name in ("kvcache_centric", "adaptive", "local_cache_aware")
            assert decision.transfer.source == best and best not in self.down and best != prefill
            assert decision.transfer.num_blocks == min(best_blocks, usable) - min(own, usable) > 0
            assert decision.transfer.keep_local_copy == (len(holders) < max(2, math.ceil(len(up_prefill) / 2)))
            assert decision.prefix_tokens == min(best_blocks, usable) * MACHINE_BLOCK
        keeps = decision.transfer is None or decision.transfer.keep_local_copy
        view = next(v for v in self.conductor.prefill_views if v.instance_id == prefill)
        assert view.queue[-1].request_id == r.request_id
        assert view.queue[-1].start_s >= self.backlog.get(prefill, self.now)  # it starts after the backlog
        entry = view.queue[-1]
        transfer = (entry.transfer_source, entry.transfer_finish_s) if entry.transfer_source is not None else None
        transfer_done = self.now + (decision.transfer.transfer_s if decision.transfer is not None else 0.0)
        self.earliest[r.request_id] = max(transfer_done, self.backlog.get(prefill, -math.inf))
        self.tracked[r.request_id] = Tracked(r, prefill, decode, self.now, "queued", keeps, transfer)

    def _own_prefix(self, instance: InstanceId, keys: Sequence[BlockKey]) -> int:
        """The instance's cached prefix, continued by the blocks of the requests queued on it before
        (FIFO: they will have stored them when this one starts), as far as its cache holds them (what it holds
        now counts whole)."""
        indexed = own = self.caches.holdings.prefix_blocks(instance, keys)
        bound = len(keys) if self.cache_blocks is None else min(len(keys), max(self.cache_blocks, indexed))
        pending = {
            key
            for t in self.tracked.values()
            if t.prefill == instance and t.stage in ("queued", "started") and t.keeps
            for key in t.request.block_keys
        }
        while own < bound and keys[own] in pending:
            own += 1
        return own

    @precondition(lambda self: self.tracked)
    @rule(data=st.data())
    def schedule_duplicate(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.tracked)))
        before = [list(v.queue) for v in self.conductor.prefill_views]
        with pytest.raises(InvalidRequestError):
            self.conductor.schedule(self.tracked[request_id].request, self.now)
        assert [list(v.queue) for v in self.conductor.prefill_views] == before

    @precondition(lambda self: self._in_stage("queued"))
    @rule(data=st.data())
    def prefill_started(self, data: st.DataObject) -> None:
        t = self.tracked[data.draw(st.sampled_from(self._in_stage("queued")))]
        assert (
            self.conductor.handle(PrefillStarted(request_id=t.request.request_id, instance_id=t.prefill, now=self.now))
            == ()
        )
        t.stage = "started"
        self.started_at[t.request.request_id] = self.now

    @precondition(lambda self: self._in_stage("queued", "started"))
    @rule(data=st.data())
    def prefill_finished(self, data: st.DataObject) -> None:
        t = self.tracked[data.draw(st.sampled_from(self._in_stage("queued", "started")))]
        assert (
            self.conductor.handle(PrefillFinished(request_id=t.request.request_id, instance_id=t.prefill, now=self.now))
            == ()
        )
        t.stage = "prefilled"
        self.caches.store(self.conductor, t.prefill, t.request.block_keys)  # the prefill instance now caches the prompt

    @precondition(lambda self: self._in_stage("queued"))
    @rule(data=st.data())
    def prefilled_inline(self, data: st.DataObject) -> None:
        """Its decode instance prefilled it: it leaves its prefill queue without running there."""
        t = self.tracked[data.draw(st.sampled_from(self._in_stage("queued")))]
        event = PrefilledInline(request_id=t.request.request_id, instance_id=t.decode, now=self.now)
        assert self.conductor.handle(event) == ()
        t.stage = "prefilled"

    @precondition(lambda self: self._in_stage("queued", "started", "prefilled"))
    @rule(data=st.data())
    def decode_joined(self, data: st.DataObject) -> None:
        t = self.tracked[data.draw(st.sampled_from(self._in_stage("queued", "started", "prefilled")))]
        event = DecodeJoined(
            request_id=t.request.request_id,
            instance_id=t.decode,
            now=self.now,
            context_tokens=t.request.input_length,
            output_tokens=t.request.output_length,
        )
        assert self.conductor.handle(event) == ()
        t.stage = "decoding"

    @precondition(lambda self: self.tracked)
    @rule(data=st.data(), generated=st.integers(min_value=1, max_value=2000))
    def decode_finished(self, data: st.DataObject, generated: int) -> None:
        t = self.tracked[data.draw(st.sampled_from(sorted(self.tracked)))]
        event = DecodeFinished(
            request_id=t.request.request_id, instance_id=t.decode, now=self.now, generated_tokens=generated
        )
        self._end(t.request.request_id, self.conductor.handle(event), Outcome.COMPLETED)

    @precondition(lambda self: self._in_stage("queued", "started", "prefilled"))
    @rule(data=st.data(), reason=st.sampled_from([Reason.DECODE_REJECTED, Reason.TBT_SLO, Reason.KV_BUDGET]))
    def rejected_by_decode(self, data: st.DataObject, reason: Reason) -> None:
        t = self.tracked[data.draw(st.sampled_from(self._in_stage("queued", "started", "prefilled")))]
        event = RequestRejected(request_id=t.request.request_id, instance_id=t.decode, now=self.now, reason=reason)
        self._end(t.request.request_id, self.conductor.handle(event), Outcome.REJECTED_AFTER_PREFILL, reason)

    @precondition(lambda self: self.tracked)
    @rule(data=st.data(), reason=st.sampled_from([Reason.CLIENT_GONE, Reason.TIMEOUT, Reason.FAILED]))
    def aborted(self, data: st.DataObject, reason: Reason) -> None:
        t = self.tracked[data.draw(st.sampled_from(sorted(self.tracked)))]
        event = RequestAborted(request_id=t.request.request_id, now=self.now, reason=reason)
        self._end(t.request.request_id, self.conductor.handle(event), Outcome.ABORTED, reason)

    @precondition(lambda self: self.ends)
    @rule(data=st.data())
    def event_after_the_end(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.ends)))
        prefill = data.draw(st.sampled_from(PREFILL_IDS))
        decode = data.draw(st.sampled_from(DECODE_IDS))
        event = data.draw(
            st.sampled_from(
                [
                    PrefillStarted(request_id=request_id, instance_id=prefill, now=self.now),
                    PrefillFinished(request_id=request_id, instance_id=prefill, now=self.now),
                    PrefilledInline(request_id=request_id, instance_id=decode, now=self.now),
                    DecodeJoined(
                        request_id=request_id, instance_id=decode, now=self.now, context_tokens=1, output_tokens=1
                    ),
                    DecodeFinished(request_id=request_id, instance_id=decode, now=self.now),
                    RequestRejected(request_id=request_id, instance_id=decode, now=self.now),
                    RequestAborted(request_id=request_id, now=self.now),
                ]
            )
        )
        assert self.conductor.handle(event) == ()  # a removed instance's late report too: ignored

    def _waiting_on(self, source: InstanceId) -> set[RequestId]:
        """The queued prefills still waiting (by the estimate) for blocks from `source` (a started one has them)."""
        return {
            rid
            for rid, t in self.tracked.items()
            if t.stage == "queued" and t.transfer is not None and t.transfer[0] == source and t.transfer[1] > self.now
        }

    def _leaving(self, source: InstanceId) -> int:
        return len(self._waiting_on(source))

    def _doomed(self, instance: InstanceId) -> set[RequestId]:
        # A prefill instance takes down what it has not finished; finished KV is on its way to decode. A
        # source takes down the prefills still waiting for its blocks.
        return {
            rid
            for rid, t in self.tracked.items()
            if (t.prefill == instance and t.stage in ("queued", "started")) or t.decode == instance
        } | self._waiting_on(instance)

    def _ended_by(self, instance: InstanceId, doomed: set[RequestId], ends: tuple[RequestEnd, ...]) -> None:
        assert len(ends) == len(doomed)
        assert {e.request_id for e in ends} == doomed
        assert {(e.outcome, e.reason) for e in ends} <= {(Outcome.ABORTED, Reason.INSTANCE_DOWN)}
        for request_id in doomed:
            del self.tracked[request_id]
            self.ends[request_id] += 1
        self.down.add(instance)
        if instance in PREFILL_IDS:
            self.caches.restart(instance)

    @rule(instance=st.sampled_from(PREFILL_IDS + DECODE_IDS))
    def instance_down(self, instance: InstanceId) -> None:
        if instance in self.removed:  # a late report, raced by its removal (which took it down): ignored
            assert self.conductor.handle(InstanceDown(instance_id=instance, now=self.now)) == ()
            return
        doomed = self._doomed(instance)
        self._ended_by(instance, doomed, self.conductor.handle(InstanceDown(instance_id=instance, now=self.now)))

    @rule(instance=st.sampled_from(PREFILL_IDS + DECODE_IDS))
    def instance_removed(self, instance: InstanceId) -> None:
        """Scaled in: what going down ends ends, and the instance is forgotten (what it prefilled goes on)."""
        if instance in self.removed:
            with pytest.raises(UnknownInstanceError):
                self.conductor.remove_instance(instance, self.now)
            return
        doomed = self._doomed(instance)
        self._ended_by(instance, doomed, self.conductor.remove_instance(instance, self.now))
        self.removed.add(instance)
        self.backlog.pop(instance, None)
        assert instance not in {v.instance_id for v in (*self.conductor.prefill_views, *self.conductor.decode_views)}

    @precondition(lambda self: self.removed)
    @rule(data=st.data())
    def instance_added_back(self, data: st.DataObject) -> None:
        """A new instance under a removed one's id: up, empty, with nothing of the old one."""
        instance = data.draw(st.sampled_from(sorted(self.removed)))
        if instance in PREFILL_IDS:
            self.conductor.add_prefill_instance(instance, cache_blocks=self.cache_blocks)
        else:
            self.conductor.add_decode_instance(instance, DecodeLimits(kv_capacity_tokens=self.capacity))
        self.removed.discard(instance)
        self.down.discard(instance)

    @precondition(lambda self: self.down)
    @rule(data=st.data())
    def instance_up(self, data: st.DataObject) -> None:
        instance = data.draw(st.sampled_from(sorted(self.down)))
        if instance in self.removed:  # a late report: ignored, the instance stays forgotten
            assert self.conductor.handle(InstanceUp(instance_id=instance, now=self.now)) == ()
            return
        assert self.conductor.handle(InstanceUp(instance_id=instance, now=self.now)) == ()
        self.down.discard(instance)

    @rule(
        document=st.integers(min_value=0, max_value=3),
        instance=st.sampled_from(PREFILL_IDS),
        blocks=st.integers(min_value=1, max_value=12),
    )
    def cache_loads_document(self, document: int, instance: InstanceId, blocks: int) -> None:
        """A cache announces a document's prefix (loaded from a slower tier, say)."""
        if instance not in self.down:
            self.caches.store(self.conductor, instance, [1000 * document + i for i in range(blocks)])

    @precondition(lambda self: self.removed & set(PREFILL_IDS))
    @rule(data=st.data(), document=st.integers(min_value=0, max_value=3), blocks=st.integers(min_value=1, max_value=12))
    def late_cache_event_from_removed(self, data: st.DataObject, document: int, blocks: int) -> None:
        """A removed instance's cache events still on the way (a prefill that finished as it was removed) are
        dropped: its blocks stay out of the index, which routes as before."""
        instance = data.draw(st.sampled_from(sorted(self.removed & set(PREFILL_IDS))))
        keys = tuple(BlockKey(1000 * document + i) for i in range(blocks))
        stamp = {"source": instance, "seq": data.draw(st.integers(min_value=0, max_value=3)), "epoch": 0}
        late = data.draw(st.sampled_from([BlockStored(keys=keys, tier=Tier.VRAM, **stamp), AllBlocksCleared(**stamp)]))
        assert self.conductor.apply_cache_event(late, strict=data.draw(st.booleans())) is None
        assert instance not in self.conductor.index.instances

    @rule(instance=st.sampled_from(PREFILL_IDS))
    def evict_everything(self, instance: InstanceId) -> None:
        if instance not in self.down:
            self.caches.clear(self.conductor, instance)

    @rule(instance=st.sampled_from(PREFILL_IDS), seconds=st.sampled_from([-1.0, 0.0, 0.5, 3.0, 60.0]))
    def backlog_reported(self, instance: InstanceId, seconds: float) -> None:
        """The instance's owner sees work the Conductor did not route (or none: `seconds` <= 0)."""
        event = PrefillBacklog(instance_id=instance, now=self.now, until_s=self.now + seconds)
        assert self.conductor.handle(event) == ()  # from a removed instance: a late report, ignored
        if instance not in self.removed:
            self.backlog[instance] = self.now + seconds

    @rule(seconds=st.sampled_from([0.0, 0.01, 0.3, 2.0, 10.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds

    # ---------------------------------------------------------------- invariants

    @invariant()
    def views_are_consistent(self) -> None:
        for view in (*self.conductor.prefill_views, *self.conductor.decode_views):
            view.check_invariants()
        self.conductor.check_invariants()

    @invariant()
    def a_new_request_would_start_after_the_backlog(self) -> None:
        for view in self.conductor.prefill_views:
            assert view.queue_s(self.now) >= self.backlog.get(view.instance_id, self.now) - self.now

    @invariant()
    def queued_prefills_start_as_soon_as_they_can(self) -> None:
        """Each queued prefill starts when the one ahead frees the instance, from the time it could start on
        (reported started: then; else: its transfer done, the backlog it was routed behind over, and not before
        the queue was last retimed), however late it was predicted before; on the plain prefill model it ends
        its own prefill after its start, a started one no sooner than the queue was last retimed (it runs until
        its end is reported)."""
        for view in self.conductor.prefill_views:
            seen = [(q.request_id, q.started) for q in view.queue]
            before = self.seen_queues.get(view.instance_id, [])
            if not {rid for rid, _ in before} <= {rid for rid, _ in seen} or any(
                started and (rid, False) in before for rid, started in seen
            ):  # a request left the queue, or started: the Conductor retimed it now
                self.retimed_at[view.instance_id] = self.now
            self.seen_queues[view.instance_id] = seen
            previous_frees = -math.inf
            for q in view.queue:
                if q.started:
                    floor = self.started_at[q.request_id]
                else:
                    floor = max(self.earliest[q.request_id], self.retimed_at.get(view.instance_id, -math.inf))
                assert math.isclose(q.start_s, max(floor, previous_frees), rel_tol=1e-9, abs_tol=1e-9), (q, floor)
                end = q.start_s + q.prefill_s
                if q.started:
                    end = max(end, self.retimed_at.get(view.instance_id, -math.inf))
                assert math.isclose(q.finish_s, end, rel_tol=1e-9, abs_tol=1e-9), q
                previous_frees = q.frees_s

    @invariant()
    def in_flight_matches_the_model(self) -> None:
        assert set(self.conductor.in_flight) == set(self.tracked)

    @invariant()
    def every_request_ends_exactly_once(self) -> None:
        assert all(count == 1 for count in self.ends.values()), self.ends.most_common(1)
        assert not set(self.ends) & set(self.tracked)
        assert len(self.ends) + len(self.tracked) == self.next_id

    @invariant()
    def queues_are_never_negative(self) -> None:
        for view in self.conductor.prefill_views:
            assert view.queue_s(self.now) >= 0
            for entry in view.queue:
                t = self.tracked[entry.request_id]
                assert t.prefill == view.instance_id and t.stage in ("queued", "started")
                assert t.scheduled_s <= entry.start_s <= entry.finish_s

    @invariant()
    def vram_is_never_over_capacity(self) -> None:
        for view in self.conductor.decode_views:
            assert 0 <= view.used_tokens <= view.capacity_tokens
            if self.admission_name == "early_rejection":  # the baseline and a prediction may promise more
                assert view.used_tokens + view.reserved_tokens <= view.capacity_tokens
            mine = [t for t in self.tracked.values() if t.decode == view.instance_id]
            # A request whose only token is its prefill's is promised nothing and holds nothing.
            assert view.used_tokens == sum(
                t.tokens for t in mine if t.stage == "decoding" and t.request.output_length > 1
            )
            assert view.reserved_tokens == sum(
                t.tokens for t in mine if t.stage != "decoding" and t.request.output_length > 1
            )

    @invariant()
    def nothing_waits_on_a_down_instance(self) -> None:
        for t in self.tracked.values():
            assert t.decode not in self.down
            assert t.stage in ("prefilled", "decoding") or t.prefill not in self.down
        for view in (*self.conductor.prefill_views, *self.conductor.decode_views):
            assert view.is_up == (view.instance_id not in self.down)


ConductorMachine.TestCase.settings = settings(stateful_step_count=40, max_examples=150)
TestConductorMachine = ConductorMachine.TestCase


# ---------------------------------------------------------------------------- determinism

operations = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.integers(0, 3), st.integers(0, 10), st.integers(1, 2000)),
        st.tuples(st.sampled_from(["start", "prefilled", "join", "finish", "reject"]), st.integers(0, 63)),
        st.tuples(st.sampled_from(["down", "up"]), st.sampled_from(PREFILL_IDS + DECODE_IDS)),
        st.tuples(st.just("wait"), st.sampled_from([0.0, 0.1, 1.0, 5.0])),
    ),
    max_size=40,
)


def replay(ops: list[tuple[Any, ...]], *, router: str, admission: str, seed: int) -> list[object]:
    """Run `ops` on a fresh Conductor (prefill instances caching what they computed) and return all it said."""
    conductor = make_conductor(
        router=router, admission=admission, capacity_tokens=60_000, block_size=MACHINE_BLOCK, seed=seed
    )
    caches, down = Caches(), set()
    trace: list[object] = []
    now = 0.0
    requests: dict[RequestId, Request] = {}
    placed: dict[RequestId, ScheduleDecision] = {}
    for op in ops:
        kind = op[0]
        if kind == "arrive":
            _, document, blocks, output = op
            keys = [1000 * document + i for i in range(blocks)] + [10**6 + len(requests)]
            r = Request(
                request_id=RequestId(f"r{len(requests)}"),
                arrival_s=now,
                input_length=len(keys) * MACHINE_BLOCK,
                output_length=output,
                block_keys=tuple(BlockKey(k) for k in keys),
            )
            requests[r.request_id] = r
            decision = conductor.schedule(r, now)
            trace.append(decision)
            placed[r.request_id] = decision
        elif kind in ("start", "prefilled", "join", "finish", "reject"):
            live = sorted(conductor.in_flight)
            if not live:
                continue
            d, r = placed[live[op[1] % len(live)]], requests[live[op[1] % len(live)]]
            prefill, decode = d.prefill_instance, d.decode_instance
            assert prefill is not None and decode is not None
            if kind == "start":
                event: Any = PrefillStarted(request_id=r.request_id, instance_id=prefill, now=now)
            elif kind == "prefilled":
                event = PrefillFinished(request_id=r.request_id, instance_id=prefill, now=now)
                if prefill not in down:
                    caches.store(conductor, prefill, r.block_keys)
            elif kind == "join":
                event = DecodeJoined(
                    request_id=r.request_id,
                    instance_id=decode,
                    now=now,
                    context_tokens=r.input_length,
                    output_tokens=r.output_length,
                )
            elif kind == "finish":
                event = DecodeFinished(request_id=r.request_id, instance_id=decode, now=now, generated_tokens=7)
            else:
                event = RequestRejected(request_id=r.request_id, instance_id=decode, now=now)
            trace.append(conductor.handle(event))
        elif kind == "down":
            trace.append(conductor.handle(InstanceDown(instance_id=op[1], now=now)))
            down.add(op[1])
            if op[1] in PREFILL_IDS:
                caches.restart(op[1])
        elif kind == "up":
            trace.append(conductor.handle(InstanceUp(instance_id=op[1], now=now)))
            down.discard(op[1])
        else:
            now += op[1]
        trace.append(tuple((v.instance_id, tuple(v.queue)) for v in conductor.prefill_views))
        trace.append(tuple((v.instance_id, v.used_tokens, v.reserved_tokens) for v in conductor.decode_views))
    return trace


@given(operations, st.sampled_from(ROUTERS), st.sampled_from(ADMISSIONS), st.integers(min_value=0, max_value=2**32 - 1))
def test_decisions_are_deterministic_for_a_seed(
    ops: list[tuple[Any, ...]], router: str, admission: str, seed: int
) -> None:
    """The same operations from the same seed give the same decisions, ends and queues (random routing included)."""
    assert replay(ops, router=router, admission=admission, seed=seed) == replay(
        ops, router=router, admission=admission, seed=seed
    )
