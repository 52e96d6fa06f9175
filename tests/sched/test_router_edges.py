"""Edge tests for `mooncake.sched.router`, `mooncake.sched.predictor` and `mooncake.sched.view`, from a mutation round.

`tests/sched/test_router.py` checks the router against `tests/reference/sched.py`, whose brute force builds
each candidate's estimate with the router's own `TtftEstimator.decide`: a slip in `decide` (a dropped term of the
estimate) moves router and reference together. Here the estimate is written out from its documented formula
(docs/scheduling.md, Algorithm 1 of the Mooncake paper), term by term, on views whose queues free their instance
before their first token (a chunked-pipeline group) and that carry a reported backlog; the routers are fed their
candidates in any order; the tie between holders of the whole prompt and of all but its last block goes to the
rendezvous home. Then the contracts the existing tests left open: the estimator's and the router's settings
(the KV size per token among them: it was not checked, and 0 made every transfer free), the replica fraction, the expected-output predictor
at its boundaries, the output-length predictor asked about the past, the views' exact start-time sums, a set
context limit on the board, and the queue-order check.
"""

from __future__ import annotations

import math
import random
from typing import Any

import attrs
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mooncake.errors import ConfigError
from mooncake.sched.cost import HARDWARE, MODELS, ChunkedPipelineCost, PrefillCostModel, TransferCostModel
from mooncake.sched.join import DecodeLimits, DecodeLoad
from mooncake.sched.predictor import ExpectedOutputPredictor, OutputLengthPredictor, UniformDecodePredictor
from mooncake.sched.router import (
    AdaptiveThreshold,
    KvCacheCentricRouter,
    LoadBalancingRouter,
    RandomRouter,
    RoundRobinRouter,
    RouteDecision,
    RouteQuery,
    TtftEstimator,
    is_threshold,
    local_cache_aware_router,
)
from mooncake.sched.view import (
    ActiveDecode,
    DecodeBoard,
    DecodeView,
    PrefillView,
    QueuedPrefill,
)
from mooncake.types import BlockKey, InstanceId, RequestId
from tests.reference.sched import rendezvous_weight
from tests.strategies import SCHED_NOW_S, finite_thresholds, prefill_views, route_queries

NOW = SCHED_NOW_S
LLAMA3 = MODELS["llama3-70b"]
A, B, C = InstanceId("prefill-a"), InstanceId("prefill-b"), InstanceId("prefill-c")


# ---------------------------------------------------------------------------- the estimate, from its formula


class _NanPrefill:
    """A prefill model that times nothing as a number."""

    def prefill_s(self, num_tokens: int, prefix_tokens: int = 0) -> float:
        return math.nan


def test_an_estimate_that_is_no_number_is_refused_by_name() -> None:
    """A plug-in prefill model returning NaN: no instance's estimate compares, and the router says so (naming the
    model) where it raised a bare IndexError."""
    views = [PrefillView(instance_id=InstanceId(f"p{i}")) for i in range(2)]
    estimator = TtftEstimator(
        prefill=_NanPrefill(), transfer=TransferCostModel(bandwidth_bytes_per_s=1e9), kv_bytes_per_token=1
    )
    query = RouteQuery(input_tokens=600, block_size_tokens=512, prefix_blocks={}, block_keys=(BlockKey(1), BlockKey(2)))
    with pytest.raises(ConfigError, match="_NanPrefill"):
        KvCacheCentricRouter(estimator).route(views, query, NOW, random.Random(0))


@st.composite
def estimators(draw: st.DrawFn) -> TtftEstimator:
    """LLaMA3-70B on a preset, sometimes as a chunked-pipeline group (whose prefill frees the instance before
    its first token), a network slow enough that transfers sometimes lose, and a first-token overhead."""
    prefill: Any = PrefillCostModel(model=LLAMA3, hardware=HARDWARE[draw(st.sampled_from(["8xA800", "8xH800"]))])
    if draw(st.booleans()):
        prefill = ChunkedPipelineCost(
            base=prefill, group_size=draw(st.integers(2, 4)), chunk_tokens=draw(st.sampled_from([512, 2048]))
        )
    return TtftEstimator(
        prefill=prefill,
        transfer=TransferCostModel(
            bandwidth_bytes_per_s=draw(st.sampled_from([1e9, 6e9, 25e9, 100e9])),
            latency_s=draw(st.sampled_from([0.0, 1e-4, 0.05])),
        ),
        kv_bytes_per_token=LLAMA3.kv_bytes_per_token,
        first_token_overhead_s=draw(st.sampled_from([0.0, 0.004, 1.5])),
    )


@st.composite
def busy_views(draw: st.DrawFn) -> list[PrefillView]:
    """Prefill views whose queued requests free the instance somewhere between their start and their first
    token (`frees_s`), some with a reported backlog ending before, at or after now."""
    views = draw(prefill_views())
    for view in views:
        view.queue = [
            attrs.evolve(q, frees_s=q.start_s + draw(st.sampled_from([0.0, 0.25, 0.5, 1.0])) * (q.finish_s - q.start_s))
            for q in view.queue
        ]
        view.backlog_until_s = draw(st.sampled_from([-math.inf, NOW - 1.0, NOW, NOW + 0.5, NOW + 3.0]))
        view.check_invariants()
    return views


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[PrefillView], RouteQuery]:
    views = draw(busy_views())
    query = draw(route_queries(views))
    num_blocks = -(-query.input_tokens // query.block_size_tokens)
    keys = draw(st.lists(st.integers(0, 2**64 - 1), min_size=num_blocks, max_size=num_blocks))
    return views, attrs.evolve(query, block_keys=tuple(BlockKey(k) for k in keys))


def usable(query: RouteQuery, blocks: int) -> int:
    """Cached blocks as far as a prefill reuses them: never the block holding the prompt's last token."""
    return min(blocks, (query.input_tokens - 1) // query.block_size_tokens)


def documented_ttft(
    estimator: TtftEstimator, view: PrefillView, query: RouteQuery, threshold: float
) -> tuple[float, bool]:
    """docs/scheduling.md, written out: the instance moves the best holder's prefix iff best / own > threshold
    (own 0: always, unless the threshold is infinite); TTFT = max(max(T_transfer, T_queue) + T_prefill,
    T_drain + T_occupancy) + overhead, T_transfer = latency + bytes · (1 + transfers leaving the source) /
    bandwidth, T_queue until the last queued request frees the instance or the backlog ends, T_drain until the
    last queued request's first token or the backlog's end on a chunked-pipeline group (0 elsewhere: a prefill
    starts there once the one ahead has ended), T_occupancy the group's first stage (T_prefill elsewhere).
    Returns (TTFT, whether it moves)."""
    own = usable(query, query.prefix_blocks.get(view.instance_id, 0))
    best = usable(query, query.best_blocks)
    ratio = math.inf if own == 0 else best / own
    moves = query.best_instance not in (None, view.instance_id) and best > own and ratio > threshold
    blocks = best if moves else own
    prefix_tokens = blocks * query.block_size_tokens
    transfer_s = 0.0
    if moves:
        link = estimator.transfer
        moved_bytes = (blocks - own) * query.block_size_tokens * estimator.kv_bytes_per_token
        transfer_s = link.latency_s + moved_bytes * (1 + query.best_transfers_in_flight) / link.bandwidth_bytes_per_s
    frees = view.queue[-1].frees_s if view.queue else -math.inf
    queue_s = max(NOW, frees, view.backlog_until_s) - NOW
    prefill_s = estimator.prefill.prefill_s(query.input_tokens, prefix_tokens)
    model = estimator.prefill
    occupancy = (
        model.occupancy_s(query.input_tokens, prefix_tokens) if isinstance(model, ChunkedPipelineCost) else prefill_s
    )
    end = max(max(transfer_s, queue_s) + prefill_s, documented_drain(estimator, view) + occupancy)
    return end + estimator.first_token_overhead_s, moves


def documented_drain(estimator: TtftEstimator, view: PrefillView) -> float:
    """On a chunked-pipeline group, until the last queued request's first token, or the backlog's end (0 if
    both have passed); 0 elsewhere."""
    if not isinstance(estimator.prefill, ChunkedPipelineCost):
        return 0.0
    return max(NOW, view.queue[-1].finish_s if view.queue else -math.inf, view.backlog_until_s) - NOW


def assert_is_the_documented_estimate(
    decision: RouteDecision,
    estimator: TtftEstimator,
    views: list[PrefillView],
    query: RouteQuery,
    *,
    replica_fraction: float = 0.5,
) -> None:
    """Each term of `decision` is what the docs say for the instance it chose."""
    view = next(v for v in views if v.instance_id == decision.prefill_instance)
    own = usable(query, query.prefix_blocks.get(view.instance_id, 0))
    frees = view.queue[-1].frees_s if view.queue else -math.inf
    assert decision.queue_s == max(NOW, frees, view.backlog_until_s) - NOW
    blocks = own
    if decision.transfer is None:
        assert decision.transfer_s == 0.0
    else:
        plan, link = decision.transfer, estimator.transfer
        blocks = usable(query, query.best_blocks)
        moved_bytes = (blocks - own) * query.block_size_tokens * estimator.kv_bytes_per_token
        assert (plan.source, plan.num_blocks, plan.num_bytes) == (query.best_instance, blocks - own, moved_bytes)
        expected = link.latency_s + moved_bytes * (1 + query.best_transfers_in_flight) / link.bandwidth_bytes_per_s
        assert math.isclose(decision.transfer_s, expected, rel_tol=1e-12) and plan.transfer_s == decision.transfer_s
        assert plan.keep_local_copy == (query.best_holders < max(2, math.ceil(replica_fraction * len(views))))
    prefix_tokens = blocks * query.block_size_tokens
    assert decision.prefix_tokens == prefix_tokens
    model = estimator.prefill
    assert decision.prefill_s == model.prefill_s(query.input_tokens, prefix_tokens)
    first_stage = (
        model.occupancy_s(query.input_tokens, prefix_tokens) if isinstance(model, ChunkedPipelineCost) else None
    )
    assert decision.occupancy_s == (decision.prefill_s if first_stage is None else first_stage)
    assert decision.overhead_s == estimator.first_token_overhead_s
    wait = max(decision.transfer_s, decision.queue_s)
    assert decision.drain_s == documented_drain(estimator, view)
    end = max(wait + decision.prefill_s, decision.drain_s + decision.occupancy_s)
    assert decision.ttft_s == end + estimator.first_token_overhead_s


@settings(max_examples=80)
@given(
    scenarios(),
    estimators(),
    finite_thresholds | st.just(math.inf),
    st.sampled_from([0.25, 0.5, 1.0]),
)
def test_the_kvcache_centric_estimate_is_the_documented_formula_and_the_least(
    scenario: tuple[list[PrefillView], RouteQuery],
    estimator: TtftEstimator,
    threshold: float,
    replica_fraction: float,
) -> None:
    """Algorithm 1 from docs/scheduling.md, not from `TtftEstimator.decide`: each term of the chosen decision
    is the documented one (the queue until the last request frees the instance or its backlog ends, the
    transfer at latency + bytes · (1 + in flight) / bandwidth, the first-token overhead added, the occupancy a
    chunked group's first stage), the copy is kept while fewer than max(2, ⌈fraction · n⌉) hold the prefix,
    and no candidate's documented TTFT is lower."""
    views, query = scenario
    router = KvCacheCentricRouter(estimator, threshold=threshold, replica_fraction=replica_fraction)
    decision = router.route(views, query, NOW, random.Random(0))
    assert decision is not None
    assert_is_the_documented_estimate(decision, estimator, views, query, replica_fraction=replica_fraction)
    every = {v.instance_id: documented_ttft(estimator, v, query, threshold) for v in views}
    ttft, moves = every[decision.prefill_instance]
    assert (decision.transfer is not None) == moves
    assert math.isclose(decision.ttft_s, ttft, rel_tol=1e-12)
    assert decision.ttft_s <= min(t for t, _ in every.values()) * (1 + 1e-12)
    if decision.transfer is not None:  # hot-spot replication: only away from holders slower (then busier)
        best = usable(query, query.best_blocks)
        for view in views:
            if usable(query, query.prefix_blocks.get(view.instance_id, 0)) >= best:
                holder_ttft = every[view.instance_id][0]
                assert holder_ttft > decision.ttft_s or (
                    math.isclose(holder_ttft, decision.ttft_s, rel_tol=1e-12) and view.queue_s(NOW) > decision.queue_s
                )


@settings(max_examples=40)
@given(scenarios(), estimators(), st.integers(0, 2**32 - 1))
def test_the_ablations_estimate_by_the_documented_formula(
    scenario: tuple[list[PrefillView], RouteQuery], estimator: TtftEstimator, seed: int
) -> None:
    """Load balancing, random and round robin report the documented estimate of their instance with its own
    prefix; load balancing's is the shortest documented queue (backlog and early freeing counted)."""
    views, query = scenario
    routers = [LoadBalancingRouter(estimator), RandomRouter(estimator), RoundRobinRouter(estimator)]
    for router in routers:
        decision = router.route(views, query, NOW, random.Random(seed))
        assert decision is not None and decision.transfer is None
        assert_is_the_documented_estimate(decision, estimator, views, query)
    chosen = routers[0].route(views, query, NOW, random.Random(seed))
    assert chosen is not None
    free_at = {v.instance_id: max(NOW, v.queue[-1].frees_s if v.queue else -math.inf, v.backlog_until_s) for v in views}
    first = min(free_at.values())
    assert chosen.prefill_instance == min(i for i, at in free_at.items() if at == first)


@given(scenarios(), estimators(), finite_thresholds | st.just(math.inf), st.randoms(use_true_random=False))
def test_the_order_candidates_come_in_changes_no_choice(
    scenario: tuple[list[PrefillView], RouteQuery], estimator: TtftEstimator, threshold: float, shuffler: random.Random
) -> None:
    """The deterministic routers choose by their rule and ids, not by the order of the candidate list: shuffled
    candidates (equal queues are common) give the same decision, ties going to the smaller id."""
    views, query = scenario
    shuffled = list(views)
    shuffler.shuffle(shuffled)
    for make in (
        lambda: KvCacheCentricRouter(estimator, threshold=threshold),
        lambda: local_cache_aware_router(estimator),
        lambda: LoadBalancingRouter(estimator),
        lambda: RoundRobinRouter(estimator),
    ):
        assert make().route(shuffled, query, NOW, random.Random(0)) == make().route(views, query, NOW, random.Random(0))


@given(st.lists(st.integers(0, 2**64 - 1), min_size=8, max_size=8))
def test_holders_of_the_whole_prompt_and_of_all_but_its_last_block_tie_to_the_rendezvous_home(keys: list[int]) -> None:
    """A holds all 8 blocks of a 2,048-token prompt, B all but the last (the block a prefill computes anyway):
    idle, they reuse the same 7 blocks and estimate the same TTFT, so neither is preferred for its longer
    prefix; the prompt goes to the heavier rendezvous weight of the two, whatever the threshold."""
    block_keys = tuple(BlockKey(k) for k in keys)
    query = RouteQuery(
        input_tokens=2048,
        block_size_tokens=256,
        prefix_blocks={A: 8, B: 7},
        best_instance=A,
        best_blocks=8,
        best_holders=1,
        block_keys=block_keys,
    )
    # Each weighs the key of the first block it lacks: B the 8th, A (holding all) the last, the same key.
    home = A if rendezvous_weight(keys[7], A) > rendezvous_weight(keys[7], B) else B
    estimator = TtftEstimator(
        prefill=PrefillCostModel(model=LLAMA3, hardware=HARDWARE["8xA800"]),
        transfer=TransferCostModel(bandwidth_bytes_per_s=25e9),
        kv_bytes_per_token=LLAMA3.kv_bytes_per_token,
    )
    views = [PrefillView(C), PrefillView(B), PrefillView(A)]
    for router in (KvCacheCentricRouter(estimator), local_cache_aware_router(estimator)):
        decision = router.route(views, query, NOW, random.Random(0))
        assert decision is not None
        assert (decision.prefill_instance, decision.transfer, decision.prefix_tokens) == (home, None, 7 * 256)


# ---------------------------------------------------------------------------- settings and learning


@pytest.mark.parametrize(("fraction", "kept"), [(0.25, False), (0.5, False), (0.75, True), (1.0, True)])
def test_the_replica_fraction_sets_how_many_holders_keep_a_moved_prefix(fraction: float, kept: bool) -> None:
    """Two of four instances hold the prefix and are busy: the idle receiver keeps its copy iff 2 < max(2, ⌈fraction
    · 4⌉), so only a fraction above a half lets a third copy stay."""
    estimator = TtftEstimator(
        prefill=PrefillCostModel(model=LLAMA3, hardware=HARDWARE["8xA800"]),
        transfer=TransferCostModel(bandwidth_bytes_per_s=100e9),
        kv_bytes_per_token=LLAMA3.kv_bytes_per_token,
    )
    busy = [QueuedPrefill(request_id=RequestId("x"), start_s=NOW, finish_s=NOW + 10)]
    views = [PrefillView(A, queue=list(busy)), PrefillView(B, queue=list(busy)), PrefillView(C)]
    views.append(PrefillView(InstanceId("prefill-d")))
    query = RouteQuery(
        input_tokens=8192,
        block_size_tokens=256,
        prefix_blocks={A: 32, B: 32},
        best_instance=A,
        best_blocks=32,
        best_holders=2,
    )
    decision = KvCacheCentricRouter(estimator, replica_fraction=fraction).route(views, query, NOW, random.Random(0))
    assert decision is not None and decision.transfer is not None and decision.prefill_instance in (C, "prefill-d")
    assert decision.transfer.keep_local_copy is kept


@pytest.mark.parametrize("threshold", [True, False, 1 + 0j, None])
def test_a_threshold_that_is_no_real_number_is_refused(threshold: object) -> None:
    """A switch or a complex number is no ratio of prefix lengths, though True == 1 (a config's `yes` would
    otherwise transfer at every ratio above 1)."""
    assert not is_threshold(threshold)
    estimator = TtftEstimator(
        prefill=PrefillCostModel(model=LLAMA3, hardware=HARDWARE["8xA800"]),
        transfer=TransferCostModel(bandwidth_bytes_per_s=25e9),
        kv_bytes_per_token=LLAMA3.kv_bytes_per_token,
    )
    with pytest.raises(ConfigError, match="threshold must be a number >= 1"):
        KvCacheCentricRouter(estimator, threshold=threshold)  # type: ignore[arg-type]


@pytest.mark.parametrize("overhead", [-0.001, math.nan, math.inf, "0.1"])
def test_a_first_token_overhead_that_is_not_seconds_is_refused(overhead: object) -> None:
    """The overhead adds to every estimate: a negative, non-finite or non-number one is a ConfigError naming it."""
    with pytest.raises(ConfigError, match="first_token_overhead_s"):
        TtftEstimator(
            prefill=PrefillCostModel(model=LLAMA3, hardware=HARDWARE["8xA800"]),
            transfer=TransferCostModel(bandwidth_bytes_per_s=25e9),
            kv_bytes_per_token=LLAMA3.kv_bytes_per_token,
            first_token_overhead_s=overhead,  # type: ignore[arg-type]
        )


@pytest.mark.parametrize("kv_bytes", [0, -1, "x", None])
def test_a_kv_size_that_is_no_positive_count_of_bytes_is_refused(kv_bytes: object) -> None:
    """The KV bytes per token price every transfer: one that is not an integer >= 1 is a ConfigError naming it
    when the estimator is built, as its other parts are (not a free transfer, nor a TypeError mid-request)."""
    with pytest.raises(ConfigError, match="kv_bytes_per_token"):
        TtftEstimator(
            prefill=PrefillCostModel(model=LLAMA3, hardware=HARDWARE["8xA800"]),
            transfer=TransferCostModel(bandwidth_bytes_per_s=25e9),
            kv_bytes_per_token=kv_bytes,  # type: ignore[arg-type]
        )


@pytest.mark.parametrize(
    ("part", "value"),
    [("prefill", PrefillCostModel), ("prefill", "fitted"), ("transfer", TransferCostModel), ("transfer", None)],
)
def test_an_estimator_part_that_is_no_model_is_refused(part: str, value: object) -> None:
    """A model given by its class or name (whose method would need an instance) is refused when the estimator
    is built, naming the part, not at the first request."""
    parts: dict[str, Any] = {
        "prefill": PrefillCostModel(model=LLAMA3, hardware=HARDWARE["8xA800"]),
        "transfer": TransferCostModel(bandwidth_bytes_per_s=25e9),
    }
    parts[part] = value
    with pytest.raises(ConfigError, match=part):
        TtftEstimator(**parts, kv_bytes_per_token=LLAMA3.kv_bytes_per_token)


@pytest.mark.parametrize("fraction", [0.0, -0.5, math.nan, math.inf])
def test_a_replica_fraction_that_is_no_positive_fraction_is_refused(fraction: float) -> None:
    """`replica_fraction` sizes max(2, ⌈fraction · n⌉): it must be a finite number > 0."""
    estimator = TtftEstimator(
        prefill=PrefillCostModel(model=LLAMA3, hardware=HARDWARE["8xA800"]),
        transfer=TransferCostModel(bandwidth_bytes_per_s=25e9),
        kv_bytes_per_token=LLAMA3.kv_bytes_per_token,
    )
    with pytest.raises(ConfigError, match="replica_fraction"):
        KvCacheCentricRouter(estimator, replica_fraction=fraction)


def test_a_smoothing_of_one_follows_the_newest_observation() -> None:
    """Smoothing is the newest observation's weight, in (0, 1]: 1 is allowed, and each mean is then the last
    ratio seen of its kind."""
    adaptive = AdaptiveThreshold(smoothing=1.0)
    adaptive.observe(had_transfer=True, estimated_ttft_s=2.0, observed_ttft_s=3.0)
    adaptive.observe(had_transfer=False, estimated_ttft_s=4.0, observed_ttft_s=1.0)
    assert (adaptive.transfer_ratio, adaptive.local_ratio) == (1.5, 0.25)


# ---------------------------------------------------------------------------- predictors


def test_expected_output_drops_a_request_exactly_when_its_output_is_done() -> None:
    """A request decoding for exactly its output less the prefill's first token, × step_s, by t has left (the
    uniform rule's strict bound, per request), whether it was decoding now or joins from its prefill; a step
    earlier it is there."""
    predictor = ExpectedOutputPredictor(step_s=0.25)
    decoding = [ActiveDecode(request_id=RequestId("a"), start_s=0.0, context_tokens=100, output_tokens=20)]
    joining = [QueuedPrefill(request_id=RequestId("q"), start_s=0.0, finish_s=1.0, input_tokens=50, output_tokens=16)]
    assert predictor.predict(decoding, joining, now=0.0, at_s=4.75) == DecodeLoad(0, 0.0, 0)  # 19 and 15 steps
    assert predictor.predict(decoding, [], now=0.0, at_s=4.5) == DecodeLoad(1, 100 + 18, 120)
    assert predictor.predict([], joining, now=0.0, at_s=4.5) == DecodeLoad(1, 50 + 14, 66)


def test_expected_output_never_counts_a_request_ending_at_its_first_token() -> None:
    """Output 1 (the prefill's token only) never joins a batch (`takes_slot`), as for the other predictors."""
    predictor = ExpectedOutputPredictor(step_s=1.0)
    one = QueuedPrefill(request_id=RequestId("one"), start_s=0.0, finish_s=3.0, input_tokens=500, output_tokens=1)
    two = QueuedPrefill(request_id=RequestId("two"), start_s=0.0, finish_s=3.0, input_tokens=70, output_tokens=2)
    assert predictor.predict([], [one, two], now=0.0, at_s=3.5) == predictor.predict([], [two], now=0.0, at_s=3.5)
    assert predictor.predict([], [one], now=0.0, at_s=3.0) == DecodeLoad(0, 0.0, 0)


@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=10),
    st.integers(0, 40),
    st.integers(0, 40),
    st.integers(1, 200),
)
def test_output_length_load_asked_about_the_past_or_the_future_start_is_the_load_now(
    lengths: list[int], ahead: int, before: int, context: int
) -> None:
    """A request has produced nothing before it starts and loses nothing before now: asked about a time before
    now, or about a request whose start lies ahead of now (a clock slightly ahead), the survival predictor
    answers as for now and for a request starting now."""
    predictor = OutputLengthPredictor(step_s=0.5, lengths=lengths)
    now = 100.0

    def request(start_s: float) -> list[ActiveDecode]:
        return [ActiveDecode(request_id=RequestId("a"), start_s=start_s, context_tokens=context, output_tokens=50)]

    decoding = request(now - before / 2)
    assert predictor.predict(decoding, [], now, now - ahead / 2) == predictor.predict(decoding, [], now, now)
    assert predictor.predict(request(now + ahead / 2), [], now, now + 3.0) == predictor.predict(
        request(now), [], now, now + 3.0
    )


def test_uniform_and_expected_output_agree_at_the_uniform_boundary() -> None:
    """Equal outputs n at step s decode for n · s, the uniform t_d: a request exactly that old is gone for both."""
    decoding = [ActiveDecode(request_id=RequestId("a"), start_s=1.0, context_tokens=10, output_tokens=8)]
    at_s = 1.0 + 8 * 0.5
    assert UniformDecodePredictor(decode_s=4.0).predict(decoding, [], 1.0, at_s).batch_size == 0
    assert ExpectedOutputPredictor(step_s=0.5).predict(decoding, [], 1.0, at_s).batch_size == 0


# ---------------------------------------------------------------------------- views and events


@given(st.lists(st.integers(0, 10**7), min_size=1, max_size=30))
@example([1001, 2003])  # 1.001 s is 1,000,999,999.99… ns as a float: truncated, it loses a nanosecond
def test_start_times_sum_exactly_in_nanoseconds(starts_ms: list[int]) -> None:
    """Start times on a millisecond grid sum exactly (integer nanoseconds, each rounded to the nearest): the
    view's sum is the exact sum in seconds, joined in any order and after a leave."""
    view = DecodeView(InstanceId("decode-0"), DecodeLimits(kv_capacity_tokens=10**9))
    for n, ms in enumerate(starts_ms):
        view.join(ActiveDecode(request_id=RequestId(f"r{n}"), start_s=ms / 1000, context_tokens=1, output_tokens=1))
    assert view.started_s_sum == sum(starts_ms) * 10**6 / 1e9
    view.leave(RequestId("r0"))
    assert view.started_s_sum == sum(starts_ms[1:]) * 10**6 / 1e9
    view.check_invariants()


def test_a_decode_board_holds_a_set_context_limit() -> None:
    """A request's context limit, where one is set, is on the board beside the batch limit (UNLIMITED only
    where none is)."""
    limited = DecodeView(InstanceId("decode-0"), DecodeLimits(kv_capacity_tokens=10_000, max_context_tokens=4096))
    board = DecodeBoard([limited])
    assert board.max_context_tokens.tolist() == [4096]
    limited.limits = DecodeLimits(kv_capacity_tokens=10_000, max_context_tokens=2048, max_batch_size=3)
    board.refresh(0)
    assert (board.max_context_tokens.tolist(), board.max_batch_size.tolist()) == ([2048], [3])


def test_a_prefill_queue_out_of_order_fails_its_invariants() -> None:
    """`check_invariants` can fail: a request freeing the instance before the one ahead of it, or freeing it
    after its own first token."""
    ahead = QueuedPrefill(request_id=RequestId("a"), start_s=0.0, finish_s=5.0)
    behind = QueuedPrefill(request_id=RequestId("b"), start_s=0.0, finish_s=3.0)
    with pytest.raises(AssertionError, match="queue out of order"):
        PrefillView(A, queue=[ahead, behind]).check_invariants()
    with pytest.raises(AssertionError, match="times out of order"):
        PrefillView(
            A, queue=[QueuedPrefill(request_id=RequestId("c"), start_s=0.0, finish_s=1.0, frees_s=2.0)]
        ).check_invariants()
    PrefillView(A, queue=[behind, ahead]).check_invariants()
