"""Tests for `mooncake.sched.admission`.

Example tests for each policy's rule and for the difference the decode load
makes (current for early rejection, predicted for the predictive variant);
properties: a policy accepts exactly when its SLO checks pass, a rejection
always carries a reason, and every request the Conductor accepts under a
policy has estimates within that policy's SLOs.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from mooncake.cache.events import BlockStored
from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.sched.admission import (
    WAITS_FOR_ROOM,
    AdmissionPolicy,
    BaselineAdmission,
    EarlyRejection,
    predictive_early_rejection,
    room_wait_deadline,
)
from mooncake.sched.conductor import Conductor, ScheduleDecision
from mooncake.sched.cost import HARDWARE, MODELS, PrefillCostModel, TransferCostModel
from mooncake.sched.decode import DecodeChoice
from mooncake.sched.join import DecodeLimits, JoinVerdict
from mooncake.sched.outcome import Reason
from mooncake.sched.predictor import OutputLengthPredictor, UniformDecodePredictor
from mooncake.sched.router import KvCacheCentricRouter, RouteDecision, TtftEstimator
from mooncake.sched.step import DecodeCostModel
from mooncake.sched.view import DecodeFinished, DecodeJoined, PrefillFinished, RequestAborted
from mooncake.types import BlockKey, InstanceId, Request, RequestId, Slo, Tier

LLAMA3 = MODELS["llama3-70b"]
A800 = HARDWARE["8xA800"]
DECODE_COST = DecodeCostModel(model=LLAMA3, hardware=A800)  # 15.7 ms a step, + 2.5 ms per 100k context tokens
ESTIMATOR = TtftEstimator(
    prefill=PrefillCostModel(model=LLAMA3, hardware=A800),  # 1.16 s for 10k tokens
    transfer=TransferCostModel(bandwidth_bytes_per_s=25e9),
    kv_bytes_per_token=LLAMA3.kv_bytes_per_token,
)
BLOCK = 64
TIGHT_TBT = Slo(ttft_s=30.0, tbt_s=0.017)  # room for about 53k tokens of decode context
POLICIES: dict[str, AdmissionPolicy] = {
    "baseline": BaselineAdmission(),
    "early_rejection": EarlyRejection(),
    "predictive_early_rejection": predictive_early_rejection(),
}


def route(ttft_s: float) -> RouteDecision:
    return RouteDecision(
        prefill_instance=InstanceId("p"), prefix_tokens=0, transfer=None, transfer_s=0.0, queue_s=0.0, prefill_s=ttft_s
    )


def decode(tbt_s: float, slo: Slo) -> DecodeChoice:
    """A decode choice whose verdict is the TBT check of `tbt_s` against `slo` (as `choose_decode` gives)."""
    within = tbt_s <= slo.tbt_s
    verdict = JoinVerdict(accepted=within, reason=None if within else Reason.TBT_SLO, predicted_tbt_s=tbt_s)
    return DecodeChoice(decode_instance=InstanceId("d"), verdict=verdict)


LIMITS = DecodeLimits(kv_capacity_tokens=DECODE_COST.capacity_tokens())


def conductor(
    policy: AdmissionPolicy, *, slo: Slo = TIGHT_TBT, prefill: int = 1, decode: int = 1, decode_s: float = 10.0
) -> Conductor:
    c = Conductor(
        router=KvCacheCentricRouter(ESTIMATOR),
        step_model=DECODE_COST,
        admission=policy,
        predictor=UniformDecodePredictor(decode_s=decode_s),
        slo=slo,
        block_size_tokens=BLOCK,
    )
    for i in range(prefill):
        c.add_prefill_instance(InstanceId(f"prefill-{i}"))
    for i in range(decode):
        c.add_decode_instance(InstanceId(f"decode-{i}"), LIMITS)
    return c


def request(name: str, tokens: int, *, output: int = 200, first_key: int = 0, arrival_s: float = 0.0) -> Request:
    blocks = -(-tokens // BLOCK)
    return Request(
        request_id=RequestId(name),
        arrival_s=arrival_s,
        input_length=tokens,
        output_length=output,
        block_keys=tuple(BlockKey(first_key + i) for i in range(blocks)),
    )


def run_to_decode(c: Conductor, r: Request, now: float) -> None:
    """Schedule `r` (it must be accepted) and bring it to decoding at `now`."""
    decision = c.schedule(r, now)
    assert decision.accepted, decision
    assert decision.prefill_instance is not None and decision.decode_instance is not None
    c.handle(PrefillFinished(request_id=r.request_id, instance_id=decision.prefill_instance, now=now))
    c.handle(
        DecodeJoined(
            request_id=r.request_id,
            instance_id=decision.decode_instance,
            now=now,
            context_tokens=r.input_length,
            output_tokens=r.output_length,
        )
    )


# ---------------------------------------------------------------------------- the rules


def test_policy_names_and_load_times() -> None:
    """Each policy names itself and says which decode load it needs."""
    assert [(p.name, p.load_at) for p in POLICIES.values()] == [
        ("baseline", "none"),
        ("early_rejection", "now"),
        ("predictive_early_rejection", "arrival"),
    ]


def test_baseline_checks_only_ttft() -> None:
    """Baseline accepts within the TTFT SLO whatever the TBT, and rejects beyond it with TTFT_SLO."""
    slo = Slo(ttft_s=2.0, tbt_s=0.1)
    policy = BaselineAdmission()
    assert policy.admit(route(2.0), decode(5.0, slo), slo).accepted
    rejected = policy.admit(route(2.01), decode(0.01, slo), slo)
    assert (rejected.accepted, rejected.reason) == (False, Reason.TTFT_SLO)


@pytest.mark.parametrize("policy", [EarlyRejection(), predictive_early_rejection()], ids=lambda p: p.name)
def test_early_rejection_checks_ttft_then_tbt(policy: EarlyRejection) -> None:
    """Early rejection needs both estimates within SLO; TTFT is checked first."""
    slo = Slo(ttft_s=2.0, tbt_s=0.1)
    assert policy.admit(route(2.0), decode(0.1, slo), slo).accepted
    assert policy.admit(route(2.0), decode(0.11, slo), slo).reason is Reason.TBT_SLO
    assert policy.admit(route(3.0), decode(0.01, slo), slo).reason is Reason.TTFT_SLO
    assert policy.admit(route(3.0), decode(0.5, slo), slo).reason is Reason.TTFT_SLO


@pytest.mark.parametrize("policy", POLICIES.values(), ids=lambda p: p.name)
def test_no_decode_instance_is_refused_with_its_bound(policy: AdmissionPolicy) -> None:
    """When no decode instance can take the request, every policy refuses with the bound that stopped it."""
    nobody = DecodeChoice(decode_instance=None, verdict=JoinVerdict(accepted=False, reason=Reason.BATCH_FULL))
    assert policy.admit(route(0.1), nobody, Slo()).reason is Reason.BATCH_FULL


@pytest.mark.parametrize("policy", POLICIES.values(), ids=lambda p: p.name)
def test_ttft_is_checked_before_the_decode_sides_room(policy: AdmissionPolicy) -> None:
    """A request that misses its TTFT objective is rejected as TTFT_SLO whether or not the decode side has room (the
    reason depends on neither what else is short nor a wait); a refusal no wait lifts (no instance up that could
    hold it, a context none holds) comes first, as a missing prefill instance does."""
    slo = Slo(ttft_s=2.0, tbt_s=0.1)
    lasting = (Reason.CONTEXT_TOO_LONG, Reason.NO_DECODE_INSTANCE)
    for reason in (*sorted(WAITS_FOR_ROOM, key=lambda r: r.value), *lasting):
        nobody = DecodeChoice(decode_instance=None, verdict=JoinVerdict(accepted=False, reason=reason))
        assert policy.admit(route(1.0), nobody, slo).reason is reason
        late = policy.admit(route(3.0), nobody, slo)
        assert (late.accepted, late.reason) == (False, reason if reason in lasting else Reason.TTFT_SLO)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_late_request_meeting_a_full_batch_is_a_ttft_rejection_waited_or_not(name: str) -> None:
    """Through the Conductor: a request whose TTFT estimate misses the objective while the only decode instance's
    batch is full is TTFT_SLO, as it is with room, and as it is when it has waited (it was BATCH_FULL unless it
    had waited)."""
    slo = Slo(ttft_s=0.5, tbt_s=0.1)
    for full in (False, True):
        c = conductor(POLICIES[name], slo=slo, decode=0)
        c.add_decode_instance(InstanceId("decode-0"), DecodeLimits(kv_capacity_tokens=10**7, max_batch_size=1))
        if full:
            assert c.schedule(request("first", 1000), 0.0).accepted
        late = request("late", 8000, first_key=10**6)
        decision = c.schedule(late, 0.0)
        assert decision.ttft_s is not None and decision.ttft_s > slo.ttft_s
        assert (decision.accepted, decision.reason) == (False, Reason.TTFT_SLO), full
        assert c.schedule(late, 0.0, waited_s=1e-9).reason is Reason.TTFT_SLO


slos = st.builds(Slo, ttft_s=st.floats(min_value=0.01, max_value=60), tbt_s=st.floats(min_value=0.001, max_value=1))
seconds = st.floats(min_value=0.0, max_value=100.0)


@given(st.sampled_from(sorted(POLICIES)), seconds, st.floats(min_value=0.0, max_value=2.0), slos)
def test_accepts_exactly_within_its_slos(name: str, ttft_s: float, tbt_s: float, slo: Slo) -> None:
    """A policy accepts iff TTFT (and, unless baseline, TBT) is within SLO; a rejection has a reason, an acceptance none."""
    verdict = POLICIES[name].admit(route(ttft_s), decode(tbt_s, slo), slo)
    within = ttft_s <= slo.ttft_s and (name == "baseline" or tbt_s <= slo.tbt_s)
    assert verdict.accepted == within
    assert (verdict.reason is None) == verdict.accepted


# ---------------------------------------------------------------------------- current vs predicted decode load


def judged_by_each_policy(c: Conductor, probe: Request, now: float) -> dict[str, ScheduleDecision]:
    """The probe's decision under each policy, from the same cluster state (policies do not change it)."""
    decisions = {}
    for name, policy in POLICIES.items():
        c.admission = policy
        decisions[name] = c.schedule(probe, now)
        if decisions[name].accepted:  # undo, so the next policy sees the same state
            c.handle(DecodeFinished(request_id=probe.request_id, instance_id=InstanceId("decode-0"), now=now))
    return decisions


def test_early_rejection_sees_load_that_baseline_ignores() -> None:
    """A decode batch already over the TBT budget: baseline accepts, early rejection refuses before prefill."""
    c = conductor(BaselineAdmission(), decode_s=10.0)
    for i in range(10):  # 100k context tokens decoding since t = 0, 20 s apart
        run_to_decode(c, request(f"filler-{i}", 10_000, first_key=1000 * (i + 1)), now=20.0 * i)
    verdicts = judged_by_each_policy(c, request("probe", 1000), now=200.0)
    assert verdicts["baseline"].accepted
    assert verdicts["early_rejection"].reason is Reason.TBT_SLO
    assert verdicts["early_rejection"].tbt_s > TIGHT_TBT.tbt_s
    # The fillers will have decoded longer than t_d by the time the probe arrives: predicted empty.
    assert verdicts["predictive_early_rejection"].accepted


def test_the_tokens_a_batch_generated_count_toward_early_rejections_check() -> None:
    """A decoding request's context grows a token a step, as the instance's own check counts it: early rejection
    estimates the growth from how long it has decoded (at the step its batch runs), so a probe that fits beside
    it when it joins is refused for TBT once it has generated enough, instead of after its prefill."""
    c = conductor(EarlyRejection())
    run_to_decode(c, request("long-answer", 40_000, output=30_000), now=0.0)
    probe = request("probe", 1000, first_key=10**6)
    assert judged_by_each_policy(c, probe, now=0.0)["early_rejection"].accepted
    step_s = DECODE_COST.step_s(1, 40_000)
    later = judged_by_each_policy(c, probe, now=250.0)["early_rejection"]  # ~15,000 tokens generated by then
    assert later.reason is Reason.TBT_SLO
    assert later.tbt_s == DECODE_COST.step_s(2, 40_000 + math.floor(250.0 / step_s) + 1000) > TIGHT_TBT.tbt_s


def test_a_coupled_instance_counts_the_tokens_its_batch_generated_too() -> None:
    """The same check on a cluster of coupled instances (vLLM servers, whose scheduler has no TBT check of its
    own): the one that decodes a long answer refuses a probe for TBT once the answer has grown."""
    c = Conductor(
        router=KvCacheCentricRouter(ESTIMATOR),
        step_model=DECODE_COST,
        admission=EarlyRejection(),
        predictor=UniformDecodePredictor(decode_s=10.0),
        slo=TIGHT_TBT,
        block_size_tokens=BLOCK,
    )
    c.add_coupled_instance(InstanceId("vllm-0"), LIMITS)
    run_to_decode(c, request("long-answer", 40_000, output=30_000), now=0.0)
    probe = request("probe", 1000, first_key=10**6)
    assert c.schedule(probe, now=0.0).accepted
    c.handle(DecodeFinished(request_id=probe.request_id, instance_id=InstanceId("vllm-0"), now=0.0))
    assert c.schedule(probe, now=250.0).reason is Reason.TBT_SLO


def test_requests_still_in_prefill_count_toward_the_decode_batch() -> None:
    """Prefills heading to the decode instance are part of its load: early rejection counts them as
    committed now, the predictive one because they arrive before the probe does; baseline does not look."""
    c = conductor(BaselineAdmission(), decode_s=10.0)
    for i in range(10):  # 100k tokens of prompts queued at t = 0 on the one prefill instance
        assert c.schedule(request(f"filler-{i}", 10_000, first_key=1000 * (i + 1)), now=0.0).accepted
    verdicts = judged_by_each_policy(c, request("probe", 1000), now=0.0)
    assert verdicts["baseline"].accepted
    assert verdicts["early_rejection"].reason is Reason.TBT_SLO
    assert verdicts["predictive_early_rejection"].reason is Reason.TBT_SLO


def test_predictive_rejection_takes_an_instance_predicted_empty_when_the_least_committed_fails_tbt() -> None:
    """decode-1 holds eight requests that joined at t = 0, decode-0 two that joined at t = 95 (t_d 10 s). At t =
    100 decode-0 is committed to less and ranks first, but at the probe's arrival it still holds its two, and its
    step with the probe would exceed the TBT objective; decode-1's eight will have left by then. The predictive
    policy sends the probe to decode-1 (it refused it for TBT, judging decode-0 alone); early rejection, on what
    each holds now, refuses it."""
    slo = Slo(ttft_s=30.0, tbt_s=0.017)
    assert DECODE_COST.step_s(3, 104_000) > slo.tbt_s > DECODE_COST.step_s(1, 4000)  # decode-0 fails, empty passes
    assert DECODE_COST.step_s(3, 104_000) < DECODE_COST.step_s(9, 404_000)  # decode-0 ranks first now
    c = conductor(BaselineAdmission(), slo=slo, decode=0)  # the baseline places the fillers unchecked
    c.add_decode_instance(InstanceId("decode-1"), LIMITS)
    for i in range(8):
        run_to_decode(c, request(f"old-{i}", 50_000, first_key=10**6 * (i + 1)), 0.0)
    c.add_decode_instance(InstanceId("decode-0"), LIMITS)
    for i in range(2):
        run_to_decode(c, request(f"new-{i}", 50_000, first_key=10**6 * (i + 20)), 95.0)
    assert {view.instance_id: len(view.active) for view in c.decode_views} == {"decode-0": 2, "decode-1": 8}
    probe = request("probe", 4000, first_key=10**8)
    c.admission = EarlyRejection()
    assert c.schedule(probe, 100.0).reason is Reason.TBT_SLO
    c.admission = predictive_early_rejection()
    predictive = c.schedule(probe, 100.0)
    assert (predictive.accepted, predictive.decode_instance) == (True, InstanceId("decode-1"))
    assert predictive.tbt_s == DECODE_COST.step_s(1, 4000)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_request_that_waited_is_held_to_what_its_wait_left_of_the_ttft_objective(name: str) -> None:
    """The wait counts against the TTFT objective: accepted while the wait plus the estimate meets it, else a
    TTFT rejection, with nothing reserved; what could never fit keeps its own reason."""
    slo = Slo(ttft_s=2.0, tbt_s=0.1)
    c = conductor(POLICIES[name], slo=slo)
    estimate = c.schedule(request("probe", 10_000), 0.0)
    assert estimate.accepted and estimate.ttft_s is not None and 1.0 < estimate.ttft_s < 2.0
    c.handle(RequestAborted(request_id=RequestId("probe"), now=0.0, reason=Reason.CLIENT_GONE))
    budget = slo.ttft_s - estimate.ttft_s
    late = c.schedule(request("late", 10_000), 0.0, waited_s=budget + 0.01)
    assert (late.accepted, late.reason, c.in_flight) == (False, Reason.TTFT_SLO, ())
    assert c.schedule(request("in-time", 10_000), 0.0, waited_s=budget - 0.01).accepted
    never = c.schedule(request("never", LIMITS.kv_capacity_tokens), 0.0, waited_s=5.0)  # its KV alone overflows
    assert never.reason is Reason.CONTEXT_TOO_LONG


@pytest.mark.parametrize("waited_s", [-1.0, math.nan, math.inf, "1", False, None])
def test_a_wait_that_is_no_time_is_named(waited_s: object) -> None:
    c = conductor(BaselineAdmission())
    with pytest.raises(InvalidRequestError, match="waited_s"):
        c.schedule(request("r", 100), 0.0, waited_s=waited_s)  # type: ignore[arg-type]
    assert c.in_flight == ()


def test_no_room_on_any_decode_instance_is_a_rejection_for_every_policy() -> None:
    """A request whose KV could never fit is rejected as CONTEXT_TOO_LONG by every policy (no wait makes room
    for it); one meeting a full
    batch is refused with BATCH_FULL by the policies that look at the decode load, and left by the
    baseline to the instance's own check."""
    for name, policy in POLICIES.items():
        c = Conductor(
            router=KvCacheCentricRouter(ESTIMATOR),
            step_model=DECODE_COST,
            admission=policy,
            predictor=UniformDecodePredictor(decode_s=10.0),
            slo=Slo(),
            block_size_tokens=BLOCK,
        )
        c.add_prefill_instance(InstanceId("prefill-0"))
        c.add_decode_instance(InstanceId("decode-0"), DecodeLimits(kv_capacity_tokens=1000, max_batch_size=1))
        decision = c.schedule(request("big", 900, output=101), 0.0)
        assert (decision.accepted, decision.reason) == (False, Reason.CONTEXT_TOO_LONG), name
        assert c.in_flight == ()
        run_to_decode(c, request("small", 100, output=100), 0.0)
        decision = c.schedule(request("second", 100, output=100, first_key=10**6), 0.0)
        if name == "baseline":
            assert decision.accepted
        else:
            assert (decision.accepted, decision.reason) == (False, Reason.BATCH_FULL), name


# ---------------------------------------------------------------------------- the Conductor keeps its promises

arrival = st.tuples(
    st.sampled_from([0.0, 0.05, 0.3, 2.0]),  # time since the previous arrival: bursts build queues
    st.sampled_from([1, 600, 4000, 12_000]) | st.integers(min_value=1, max_value=12_000),  # prompt tokens
    st.sampled_from([1, 2000]) | st.integers(min_value=1, max_value=2000),  # output tokens
    st.integers(min_value=0, max_value=3),  # shared document (prefix) id
    st.sampled_from(["queue", "prefilled", "decoding", "finished"]),  # how far it gets before the next arrival
)
arrivals = st.integers(min_value=5, max_value=30).flatmap(lambda n: st.lists(arrival, min_size=n, max_size=n))


@given(
    st.sampled_from(sorted(POLICIES)),
    st.sampled_from([Slo(ttft_s=1.0, tbt_s=0.0162), Slo(ttft_s=2.0, tbt_s=0.0165), Slo(ttft_s=30.0, tbt_s=0.02)]),
    st.sampled_from(["uniform", "output_length"]),
    arrivals,
    st.lists(st.sampled_from([0.0, 0.0, 0.25, 0.9, 3.0]), min_size=30, max_size=30),
)
def test_accepted_requests_are_within_their_policys_slos(
    name: str, slo: Slo, predictor_name: str, stream: list[tuple[float, int, int, int, str]], waits: list[float]
) -> None:
    """Every accepted decision has ttft_s <= SLO, the time the request waited for room counted (`waited_s`),
    and, for TBT-checking policies, tbt_s <= SLO (when it decodes at all); rejections carry a reason."""
    predictor = (
        UniformDecodePredictor(decode_s=5.0) if predictor_name == "uniform" else OutputLengthPredictor(step_s=0.02)
    )
    c = Conductor(
        router=KvCacheCentricRouter(ESTIMATOR),
        step_model=DECODE_COST,
        admission=POLICIES[name],
        predictor=predictor,
        slo=slo,
        block_size_tokens=BLOCK,
    )
    for i in range(3):
        c.add_prefill_instance(InstanceId(f"prefill-{i}"))
    for i in range(2):
        c.add_decode_instance(InstanceId(f"decode-{i}"), DecodeLimits(kv_capacity_tokens=30_000, max_batch_size=4))
    now = 0.0
    seqs = {InstanceId(f"prefill-{i}"): 0 for i in range(3)}
    for index, (gap_s, tokens, output, document, stage) in enumerate(stream):
        now += gap_s
        r = request(str(index), tokens, output=output, first_key=10**6 * document)
        decision = c.schedule(r, now, waited_s=waits[index])
        event(f"{name}: {decision.reason.value if decision.reason else 'accepted'}")
        assert decision.ttft_s is None or decision.ttft_s >= 0
        if not decision.accepted:
            assert decision.reason is not None
            continue
        assert decision.reason is None
        assert decision.ttft_s is not None and decision.tbt_s is not None
        assert waits[index] + decision.ttft_s <= slo.ttft_s
        if name != "baseline" and output > 1:  # a request whose only token is its prefill's never decodes
            # ... unless it decodes alone there: the rule never refuses a lone request (it would be refused
            # forever), and one whose own step exceeds the objective can be let in only that way.
            assert decision.tbt_s <= slo.tbt_s or DECODE_COST.step_s(1, tokens) > slo.tbt_s
        prefill, target = decision.prefill_instance, decision.decode_instance
        assert prefill is not None and target is not None
        if stage == "queue":
            continue
        c.handle(PrefillFinished(request_id=r.request_id, instance_id=prefill, now=now))
        c.apply_cache_event(BlockStored(source=prefill, seq=seqs[prefill], keys=r.block_keys, tier=Tier.VRAM))
        seqs[prefill] += 1
        if stage == "prefilled":
            continue
        c.handle(
            DecodeJoined(
                request_id=r.request_id, instance_id=target, now=now, context_tokens=tokens, output_tokens=output
            )
        )
        if stage == "finished":
            c.handle(DecodeFinished(request_id=r.request_id, instance_id=target, now=now, generated_tokens=output))
    for view in (*c.prefill_views, *c.decode_views):
        view.check_invariants()


times = st.floats(0.0, 1e4, allow_nan=False)


@given(st.sampled_from(list(Reason)), st.none() | times, times, times, st.floats(0.0, 1e3, allow_nan=False))
def test_only_a_rejection_for_room_waits_and_never_past_its_ttft_objective(
    reason: Reason, estimated_ttft_s: float | None, arrival_s: float, ttft_slo_s: float, max_wait_s: float
) -> None:
    """A request waits for a full batch, KV room or the TBT objective only: at most `max_wait_s` after its
    arrival, and only while the time waited plus its estimated TTFT stays within the objective."""
    slo = Slo(ttft_s=max(ttft_slo_s, 1e-3), tbt_s=0.1)
    deadline = room_wait_deadline(
        reason, estimated_ttft_s=estimated_ttft_s, arrival_s=arrival_s, slo=slo, max_wait_s=max_wait_s
    )
    if reason not in WAITS_FOR_ROOM or estimated_ttft_s is None or max_wait_s == 0:
        assert deadline == -math.inf
        return
    event(f"waits: {deadline > arrival_s}")
    assert deadline <= arrival_s + max_wait_s
    assert deadline - arrival_s + estimated_ttft_s <= slo.ttft_s + 1e-9 * max(1.0, arrival_s)
    # and no earlier than both bounds allow: it waits as long as it may
    assert deadline >= min(arrival_s + max_wait_s, arrival_s + slo.ttft_s - estimated_ttft_s)


@pytest.mark.parametrize("reason", [Reason.BATCH_FULL, Reason.TTFT_SLO], ids=["waits", "never-waits"])
@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("estimated_ttft_s", math.nan, InvalidRequestError),
        ("estimated_ttft_s", -100.0, InvalidRequestError),
        ("estimated_ttft_s", "1", InvalidRequestError),
        ("arrival_s", math.inf, InvalidRequestError),
        ("max_wait_s", True, ConfigError),
        ("max_wait_s", -1.0, ConfigError),
        ("max_wait_s", math.nan, ConfigError),
    ],
)
def test_a_wait_deadline_from_no_time_is_named(reason: Reason, field: str, value: object, error: type) -> None:
    """`room_wait_deadline` takes times: a NaN or negative estimate (which gave a deadline of 5 s, or one 100 s past
    the objective), an arrival that is no time, or a wait bound that is a bool or negative is an error naming the
    argument and its value, whatever the reason (the bad value was ignored when the reason could not wait)."""
    arguments: dict[str, object] = {"estimated_ttft_s": 1.0, "arrival_s": 0.0, "max_wait_s": 5.0, field: value}
    with pytest.raises(error, match=f"{field} must be a finite number.*got {value!r}"):
        room_wait_deadline(reason, slo=Slo(), **arguments)  # type: ignore[arg-type]


def test_a_wait_deadline_for_no_reason_or_no_objective_is_named() -> None:
    """A reason given as a string was never one that waits (a wait the caller meant was silently refused), and
    no `Slo` failed as an AttributeError: each is an error naming the argument."""
    arguments: dict[str, object] = {"estimated_ttft_s": 1.0, "arrival_s": 0.0, "max_wait_s": 5.0}
    with pytest.raises(InvalidRequestError, match=r"reason must be a mooncake\.sched\.Reason, got 'batch_full'"):
        room_wait_deadline("batch_full", slo=Slo(), **arguments)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"slo must be a mooncake\.types\.Slo, got None"):
        room_wait_deadline(Reason.BATCH_FULL, slo=None, **arguments)  # type: ignore[arg-type]
    assert room_wait_deadline(Reason.BATCH_FULL, slo=Slo(ttft_s=3.0), **arguments) == 2.0  # type: ignore[arg-type]
