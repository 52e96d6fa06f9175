"""The decode rule's four callers give one verdict: the Conductor, the simulated decode node, the coupled
baseline and the real `DecodeEngine`.

A scenario is a decode instance's limits (a KV capacity, a batch-size limit, a
per-request context limit), a step model (`DecodeCostModel` of a drawn
hardware, the simulated cluster's own `spec.decode_cost`) and a TBT SLO, and a
few requests (prompt, output) that try to join that one instance one after
another at the same instant: no decode step runs between joins, so every
caller's batch context is exactly the prompts of the requests that joined.
Each request's verdict (accepted, or refused with a `Reason`) must be the same
from every caller and the rule as its docstring states it
(`tests/reference/sched.reference_verdict`, on the joined requests' sums);
accepted requests join, and afterwards all four count the same load (batch,
context, reserved KV). The callers, each reached as a test double would be,
past the machinery that would otherwise step decode in between:

(a) the Conductor, with one prefill and one decode instance of those limits,
    `EarlyRejection` admission and a huge TTFT SLO: `schedule`, then for an
    accepted request `PrefillFinished` and at once `DecodeJoined` (its
    reservation becomes its membership) or, for a single-token request,
    `DecodeFinished` (it ended with its prefill);
(b) the simulated disaggregated cluster's decode node: `_decode_arrive`, the
    handler that runs when a prefilled request's KV arrives (the rule via
    `_check` on the node's load, then `_enqueue` to join at the next step
    boundary, or a rejection after prefill, read back from the request's
    record). Its KV capacity and batch limit come from `ClusterSpec.decode_limits`
    (the hardware's HBM is sized to the scenario's capacity); the spec has no
    per-request context limit, so the context limit is added where the
    cluster reads its limits, the Conductor's decode view. A single-token
    request never reaches a simulated decode node (it finishes with its
    prefill): `_check` is asked for it directly;
(c) the coupled baseline: `_verdict(instance.load(), request)`, the check its
    scheduler makes before taking a request, and an accepted one joins the
    instance's batch as a finished prefill does. It has no TBT check (vLLM's
    scheduler has none), so it is compared on the structural reasons: where
    the others refuse for TBT it accepts. Its KV capacity and batch limit come
    from `CoupledSpec`; the context limit is added to its `limits`;
(d) the `DecodeEngine` with the tiny model (torch), each prompt's KV pages put
    into its cache, `DecodeConfig(max_batch_size, max_context_tokens,
    kv_budget_tokens, tbt_slo_s)` and the same step model.

Every reason of the rule is reached (`hypothesis.event` names each verdict:
run with --hypothesis-show-statistics to see how often).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
from hypothesis import event, example, given
from hypothesis import strategies as st

from mooncake.sched.admission import EarlyRejection
from mooncake.sched.conductor import Conductor
from mooncake.sched.cost import Hardware, ModelShape
from mooncake.sched.join import DecodeLimits, DecodeLoad, JoinVerdict
from mooncake.sched.outcome import Outcome, Reason
from mooncake.sched.predictor import UniformDecodePredictor
from mooncake.sched.router import LoadBalancingRouter, TtftEstimator
from mooncake.sched.step import DecodeCostModel
from mooncake.sched.view import DecodeFinished, DecodeJoined, PrefillFinished
from mooncake.sim.batch import Member
from mooncake.sim.coupled import CoupledCluster, CoupledSpec
from mooncake.sim.disaggregated import DisaggregatedCluster
from mooncake.sim.spec import ClusterSpec
from mooncake.types import BlockKey, InstanceId, Request, RequestId, Slo
from tests.reference.sched import reference_verdict

BLOCK = 4  # tokens per block key and KV page
PREFILL, DECODE = InstanceId("prefill-0"), InstanceId("decode-0")
NO_TTFT_LIMIT_S = 1e9
# A small model whose decode step depends on the batch and the context alike over the scenarios' sizes:
# memory-bound up to two requests, compute-bound from three (a 4.5 to 15 ms step).
MODEL = ModelShape(name="probe", num_layers=32, hidden_size=4096, gqa=1, num_params=2e8)
STRUCTURAL = (Reason.CONTEXT_TOO_LONG, Reason.BATCH_FULL, Reason.KV_BUDGET)

Verdict = tuple[bool, Reason | None]


def hardware(kv_capacity_tokens: int) -> Hardware:
    """One GPU whose HBM holds the weights and exactly `kv_capacity_tokens` of KV (at the cost model's
    `kv_memory_fraction`): half a token to spare, so that rounding cannot move the capacity."""
    fraction = attrs.fields(DecodeCostModel).kv_memory_fraction.default
    hbm = (MODEL.weight_bytes + (kv_capacity_tokens + 0.5) * MODEL.kv_bytes_per_token) / fraction
    return Hardware(
        name="probe",
        num_gpus=1,
        peak_flops_per_gpu=4e11,
        hbm_bytes_per_s=1.25e11,
        hbm_bytes=hbm,
        host_to_device_bytes_per_s=1e10,
        nic_bytes_per_s=1e10,
    )


@attrs.frozen
class Scenario:
    kv_capacity_tokens: int
    max_batch_size: int
    max_context_tokens: int
    tbt_slo_s: float
    requests: tuple[tuple[int, int], ...]  # (prompt, output) each

    @property
    def hardware(self) -> Hardware:
        return hardware(self.kv_capacity_tokens)

    @property
    def limits(self) -> DecodeLimits:
        return DecodeLimits(
            kv_capacity_tokens=self.kv_capacity_tokens,
            max_batch_size=self.max_batch_size,
            max_context_tokens=self.max_context_tokens,
        )

    def request(self, index: int) -> Request:
        prompt, output = self.requests[index]
        return Request(
            request_id=RequestId(f"r{index}"),
            arrival_s=0.0,
            input_length=prompt,
            output_length=output,
            block_keys=tuple(BlockKey(1000 * index + b) for b in range(math.ceil(prompt / BLOCK))),
        )


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    """Limits drawn within the range the requests make binding: a context limit up to the largest
    request's and a KV capacity up to all of theirs (each often exactly that: room for all, so that
    the later checks bind); an SLO at the step of a batch they may make (ties are the edge), or none
    that binds."""
    outputs = st.sampled_from(range(1, 7))  # a single-token request one time in six
    requests = draw(st.lists(st.tuples(st.integers(1, 8), outputs), min_size=2, max_size=7))
    needs = [prompt + output for prompt, output in requests]
    context = draw(st.just(max(needs)) | st.integers(2, max(needs)))
    capacity = draw(st.just(sum(needs)) | st.integers(1, sum(needs)))
    cost = DecodeCostModel(model=MODEL, hardware=hardware(capacity))
    at = cost.step_s(draw(st.integers(1, 3)), draw(st.integers(0, sum(prompt for prompt, _ in requests))))
    slo = draw(st.sampled_from([at, at, at * (1 + 1e-9), NO_TTFT_LIMIT_S]))
    return Scenario(capacity, draw(st.sampled_from([1, 2, 3, 4])), context, slo, tuple(requests))


def lone_step_s(kv_capacity_tokens: int) -> float:
    """The step of one request with no context: an SLO that any second request breaks."""
    return DecodeCostModel(model=MODEL, hardware=hardware(kv_capacity_tokens)).step_s(1, 0)


EVERY_REASON = (  # whatever the draws, each verdict is reached
    Scenario(20, 2, 10, lone_step_s(20), ((4, 3), (8, 4), (12, 1), (3, 1), (2, 3))),  # ok, context x2, ok, TBT
    Scenario(12, 2, 10, NO_TTFT_LIMIT_S, ((4, 3), (3, 3), (1, 2), (1, 2), (2, 1))),  # ok, KV, ok, batch, ok
)


# ------------------------------------------------------------------------------------------------ the callers


def conductor(scenario: Scenario, limits: DecodeLimits, cost: DecodeCostModel, spec: ClusterSpec) -> Conductor:
    """One prefill and one decode instance of `limits`, early rejection, no TTFT limit to speak of."""
    estimator = TtftEstimator(
        prefill=spec.prefill_cost, transfer=spec.transfer_cost, kv_bytes_per_token=MODEL.kv_bytes_per_token
    )
    made = Conductor(
        router=LoadBalancingRouter(estimator),
        step_model=cost,
        admission=EarlyRejection(),
        predictor=UniformDecodePredictor(decode_s=1.0),
        slo=Slo(ttft_s=NO_TTFT_LIMIT_S, tbt_s=scenario.tbt_slo_s),
        block_size_tokens=BLOCK,
    )
    made.add_prefill_instance(PREFILL)
    made.add_decode_instance(DECODE, limits)
    return made


class ConductorCaller:
    """(a) The Conductor's decode selection and admission; an accepted request joins at once."""

    def __init__(self, scenario: Scenario, cost: DecodeCostModel, spec: ClusterSpec) -> None:
        self.conductor = conductor(scenario, scenario.limits, cost, spec)
        self.tbt_s: float | None = None

    def join(self, request: Request) -> Verdict:
        decision = self.conductor.schedule(request, 0.0)
        self.tbt_s = decision.tbt_s
        if decision.accepted:
            assert decision.decode_instance == DECODE
            now, request_id = 0.0, request.request_id
            self.conductor.handle(PrefillFinished(request_id=request_id, instance_id=PREFILL, now=now))
            if request.output_length > 1:
                joined = DecodeJoined(
                    request_id=request_id,
                    instance_id=DECODE,
                    now=now,
                    context_tokens=request.input_length,
                    output_tokens=request.output_length,
                )
                self.conductor.handle(joined)
            else:  # its only token was the prefill's
                self.conductor.handle(DecodeFinished(request_id=request_id, instance_id=DECODE, now=now))
        self.conductor.check_invariants()
        return decision.accepted, decision.reason

    def load(self) -> DecodeLoad:
        (view,) = self.conductor.decode_views
        return view.load()


class SimulatedCaller:
    """(b) The simulated disaggregated cluster's decode node, when a prefilled request's KV arrives."""

    def __init__(self, scenario: Scenario, spec: ClusterSpec) -> None:
        assert spec.decode_limits == attrs.evolve(scenario.limits, max_context_tokens=None)
        limits = attrs.evolve(spec.decode_limits, max_context_tokens=scenario.max_context_tokens)
        self.cluster = DisaggregatedCluster(spec, conductor(scenario, limits, spec.decode_cost, spec))
        self.side = self.cluster._decode[DECODE]
        assert self.side.limits == scenario.limits

    def join(self, request: Request) -> Verdict:
        record = self.cluster.replay.open(0.0, request)
        record.prefill_instance, record.decode_instance = PREFILL, DECODE
        if request.output_length <= 1:  # it finished with its prefill: ask the node's rule all the same
            verdict = self.cluster._check(self.side, record, 0.0, tbt_slo_s=self.cluster.slo.tbt_s)
            return verdict.accepted, verdict.reason
        joining = len(self.side.joining)
        self.cluster._decode_arrive(0.0, self.side, record)
        if record.outcome is None:
            assert len(self.side.joining) == joining + 1
            return True, None
        assert record.outcome is Outcome.REJECTED_AFTER_PREFILL and len(self.side.joining) == joining
        return False, record.reason

    def load(self) -> DecodeLoad:
        return self.side.load(0.0)


class CoupledCaller:
    """(c) The coupled baseline's check before it takes a request; an accepted one joins the batch."""

    def __init__(self, scenario: Scenario) -> None:
        spec = CoupledSpec(
            num_instances=1,
            model=MODEL,
            hardware=scenario.hardware,
            block_size_tokens=BLOCK,
            max_batch_size=scenario.max_batch_size,
        )
        self.cluster = CoupledCluster(spec, slo=Slo(ttft_s=NO_TTFT_LIMIT_S, tbt_s=scenario.tbt_slo_s))
        assert self.cluster.limits == attrs.evolve(scenario.limits, max_context_tokens=None)
        self.cluster.limits = scenario.limits
        (self.instance,) = self.cluster._instances

    def join(self, request: Request) -> Verdict:
        verdict = self.cluster._verdict(self.instance.load(), request)
        return verdict.accepted, verdict.reason

    def admit(self, request: Request) -> None:
        """What `_boundary` does when a request's prefill completes: it joins the batch."""
        if request.output_length > 1:
            record = self.cluster.replay.open(0.0, request)
            self.instance.node.batch.join(Member(record, request.output_length - 1, request.input_length))
            self.instance.kv_tokens += request.input_length + request.output_length

    def load(self) -> DecodeLoad:
        return self.instance.load()


class EngineCaller:
    """(d) The real decode engine, its requests' KV pages in its cache."""

    def __init__(self, scenario: Scenario, cost: DecodeCostModel, support: Any) -> None:
        from mooncake.engine.decode import DecodeConfig, DecodeEngine

        self.layout = support.layout(BLOCK)
        pages = sum(math.ceil(prompt / BLOCK) for prompt, _ in scenario.requests)
        self.cache = support.dram_cache(BLOCK, pages=pages)
        config = DecodeConfig(
            max_batch_size=scenario.max_batch_size,
            max_context_tokens=scenario.max_context_tokens,
            kv_budget_tokens=scenario.kv_capacity_tokens,
            tbt_slo_s=scenario.tbt_slo_s,
        )
        self.engine = DecodeEngine(support.tiny_model(), self.cache, block_tokens=BLOCK, config=config, step_model=cost)
        assert self.engine.limits == scenario.limits
        self.tbt_s: float | None = None

    def join(self, request: Request) -> Verdict:
        for b, key in enumerate(request.block_keys):  # the prefill's pages: their bytes are never read here
            tokens = min(BLOCK, request.input_length - b * BLOCK)
            self.cache.put(key, bytes(self.layout.block_bytes(tokens)))
        verdict: JoinVerdict = self.engine.try_join(
            request.request_id,
            request.block_keys,
            prompt_tokens=request.input_length,
            first_token=0,
            max_new_tokens=request.output_length,
        )
        self.tbt_s = verdict.predicted_tbt_s
        self.engine.check_invariants()
        return verdict.accepted, verdict.reason

    def load(self) -> DecodeLoad:
        return self.engine.load()


@pytest.fixture(scope="module")
def engine_support() -> Iterator[Any]:
    """tests/engine/support (the tiny model, caches, layouts); the engine needs torch."""
    pytest.importorskip("torch")
    from tests.engine import support

    yield support


def label(verdict: Verdict, request: Request) -> str:
    accepted, reason = verdict
    if not accepted:
        assert reason is not None
        return reason.value
    return "accepted" if request.output_length > 1 else "accepted, single token"


# ------------------------------------------------------------------------------------------------ the property


@given(scenario=scenarios())
@example(scenario=EVERY_REASON[0])
@example(scenario=EVERY_REASON[1])
def test_the_four_callers_give_one_verdict(engine_support: Any, scenario: Scenario) -> None:
    """Request after request, the Conductor, the simulated decode node, the coupled baseline (on the
    structural reasons) and the decode engine give the verdict the rule states; the accepted ones join,
    and all four count the same batch, context and reserved KV."""
    spec = ClusterSpec(
        num_prefill=1,
        num_decode=1,
        model=MODEL,
        prefill_hardware=scenario.hardware,
        decode_hardware=scenario.hardware,
        block_size_tokens=BLOCK,
        cache_capacity_tokens=64 * BLOCK,
        max_decode_batch_size=scenario.max_batch_size,
    )
    cost = spec.decode_cost  # the simulator's step model is every caller's
    planner = ConductorCaller(scenario, cost, spec)
    simulated = SimulatedCaller(scenario, spec)
    coupled = CoupledCaller(scenario)
    engine = EngineCaller(scenario, cost, engine_support)
    callers: dict[str, Callable[[Request], Verdict]] = {
        "conductor": planner.join,
        "simulated": simulated.join,
        "engine": engine.join,
    }
    joined: list[Request] = []
    for index in range(len(scenario.requests)):
        request = scenario.request(index)
        load = load_after(joined)
        reason = reference_verdict(
            scenario.limits,
            load,
            prompt_tokens=request.input_length,
            output_tokens=request.output_length,
            step_model=cost,
            tbt_slo_s=scenario.tbt_slo_s,
        )
        expected: Verdict = (reason is None, reason)
        got = {name: join(request) for name, join in callers.items()}
        assert got == dict.fromkeys(callers, expected), (index, request, load)
        structural = expected if reason in (None, *STRUCTURAL) else (True, None)
        assert coupled.join(request) == structural, (index, request, load)
        assert engine.tbt_s == planner.tbt_s  # the same predicted step with the request added, or none
        event(label(expected, request))
        if expected[0]:
            coupled.admit(request)
            joined.append(request)
        loads = {"conductor": planner.load(), "simulated": simulated.load(), "coupled": coupled.load()}
        loads["engine"] = engine.load()
        assert loads == dict.fromkeys(loads, load_after(joined)), index


def test_the_explicit_scenarios_reach_every_verdict() -> None:
    """The property's explicit examples reach each reason of the rule and both kinds of acceptance."""
    labels = set()
    for scenario in EVERY_REASON:
        cost = DecodeCostModel(model=MODEL, hardware=scenario.hardware)
        joined: list[Request] = []
        for index in range(len(scenario.requests)):
            request = scenario.request(index)
            reason = reference_verdict(
                scenario.limits,
                load_after(joined),
                prompt_tokens=request.input_length,
                output_tokens=request.output_length,
                step_model=cost,
                tbt_slo_s=scenario.tbt_slo_s,
            )
            labels.add(label((reason is None, reason), request))
            joined += [request] if reason is None else []
    assert labels == {*(r.value for r in (*STRUCTURAL, Reason.TBT_SLO)), "accepted", "accepted, single token"}


def load_after(joined: list[Request]) -> DecodeLoad:
    """The batch the joined requests make before any step: the decoding ones, their prompts, their reservations."""
    decoding = [r for r in joined if r.output_length > 1]
    return DecodeLoad(
        len(decoding), sum(r.input_length for r in decoding), sum(r.input_length + r.output_length for r in decoding)
    )
