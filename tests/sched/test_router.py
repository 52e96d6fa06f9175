"""Tests for `mooncake.sched.router`.

Example tests for the edge contracts (no candidates, ties, congestion, the
transfer plan, the adaptive threshold); properties over random instance sets
(2–8 prefill views with random queues, random prefix lengths, a best holder)
against the brute-force router of `tests/reference/sched.py`: the choice
minimises the router's own TTFT estimate, the ratio rule holds, an infinite
threshold never transfers, the ablations pick what they say they pick.
"""

from __future__ import annotations

import collections
import math
import random

import attrs
import numpy as np
import pytest
from hypothesis import event, example, given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mooncake.cache.hashing import reusable_prefix_tokens
from mooncake.cache.index import key_array
from mooncake.errors import ConfigError
from mooncake.sched.cost import HARDWARE, MODELS, FittedPrefillModel, PrefillCostModel, TransferCostModel
from mooncake.sched.router import (
    AdaptiveThreshold,
    KvCacheCentricRouter,
    LoadBalancingRouter,
    PrefixBlocks,
    RandomRouter,
    RoundRobinRouter,
    RouteDecision,
    RouteQuery,
    Router,
    TtftEstimator,
    local_cache_aware_router,
    spread_weights,
)
from mooncake.sched.view import PrefillBoard, PrefillView, QueuedPrefill
from mooncake.types import BlockKey, InstanceId, RequestId
from tests.reference.sched import (
    documented_ttft_s,
    reference_local_route,
    reference_route,
    rendezvous_weight,
    should_transfer,
    usable_blocks,
)
from tests.strategies import SCHED_NOW_S, finite_thresholds, prefill_views, route_queries, ttft_estimators

NOW = SCHED_NOW_S
A, B, C = InstanceId("prefill-a"), InstanceId("prefill-b"), InstanceId("prefill-c")
LLAMA3 = MODELS["llama3-70b"]
ESTIMATOR = TtftEstimator(
    prefill=PrefillCostModel(model=LLAMA3, hardware=HARDWARE["8xA800"]),
    transfer=TransferCostModel(bandwidth_bytes_per_s=100e9),
    kv_bytes_per_token=LLAMA3.kv_bytes_per_token,
)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[PrefillView], RouteQuery]:
    views = draw(prefill_views())
    return views, draw(route_queries(views))


def busy(instance: InstanceId, until_s: float) -> PrefillView:
    """A view whose queue drains at `until_s`."""
    return PrefillView(instance, queue=[QueuedPrefill(request_id=RequestId("busy"), start_s=NOW, finish_s=until_s)])


def query(prefix: dict[InstanceId, int], *, input_tokens: int = 8192, block_size: int = 256) -> RouteQuery:
    best = min(prefix, key=lambda i: (-prefix[i], i)) if prefix else None
    return RouteQuery(
        input_tokens=input_tokens,
        block_size_tokens=block_size,
        prefix_blocks=prefix,
        best_instance=best,
        best_blocks=prefix[best] if best is not None else 0,
    )


# A minimal case of the infinite-threshold bug: the holder is busy, B holds nothing.
EMPTY_INSTANCE_CASE = ([busy(A, NOW + 10), PrefillView(B)], query({A: 32}))


# ---------------------------------------------------------------------------- estimator and query


def test_prefix_tokens_leave_the_block_of_the_last_token_to_compute() -> None:
    """A prefix covering the whole prompt still leaves the block holding its last token to compute."""
    q = RouteQuery(input_tokens=100, block_size_tokens=16, prefix_blocks={})
    assert q.prefix_tokens(0) == 0
    assert q.prefix_tokens(3) == 48
    assert q.prefix_tokens(7) == 96  # token 99 is in block 6: blocks 0-5 are reused
    assert RouteQuery(input_tokens=96, block_size_tokens=16, prefix_blocks={}).prefix_tokens(6) == 80
    assert RouteQuery(input_tokens=1, block_size_tokens=16, prefix_blocks={}).prefix_tokens(1) == 0


@given(st.integers(1, 5000), st.integers(0, 40), st.integers(1, 600))
def test_prefix_tokens_are_the_one_rule(input_tokens: int, blocks: int, block_size: int) -> None:
    """The router counts a cached prefix as the engine reuses it (`reusable_prefix_tokens`)."""
    q = RouteQuery(input_tokens=input_tokens, block_size_tokens=block_size, prefix_blocks={})
    assert q.prefix_tokens(blocks) == reusable_prefix_tokens(input_tokens, blocks, block_size)


def test_estimate_is_transfer_plus_queue_plus_prefill() -> None:
    """TTFT = max(T_transfer, T_queue) + T_prefill (the transfer runs while the request waits in the
    queue); the plan moves the missing blocks' KV with congestion."""
    view = busy(B, NOW + 2.5)
    q = query({A: 20, B: 4})
    decision = ESTIMATOR.decide(view, q, NOW, prefix_blocks=20, transfer_from=A, congestion=2)
    moved_bytes = (20 - 4) * 256 * LLAMA3.kv_bytes_per_token
    assert decision.transfer is not None
    assert decision.transfer.num_blocks == 16
    assert decision.transfer.num_bytes == moved_bytes
    assert decision.transfer_s == pytest.approx(1e-4 + 3 * moved_bytes / 100e9)
    assert decision.queue_s == pytest.approx(2.5)
    assert decision.prefill_s == pytest.approx(ESTIMATOR.prefill.prefill_s(8192, 20 * 256))
    assert decision.ttft_s == pytest.approx(max(decision.transfer_s, 2.5) + decision.prefill_s)
    slow = ESTIMATOR.decide(view, q, NOW, prefix_blocks=20, transfer_from=A, congestion=2000)
    assert slow.transfer_s > 2.5 and slow.ttft_s == pytest.approx(slow.transfer_s + slow.prefill_s)


# ---------------------------------------------------------------------------- KV-cache-centric routing


def test_routes_to_the_holder_when_it_is_idle() -> None:
    """With every queue empty the holder of the prefix wins and nothing moves."""
    decision = KvCacheCentricRouter(ESTIMATOR).route(
        [PrefillView(A), PrefillView(B)], query({B: 32}), NOW, random.Random(0)
    )
    assert decision is not None
    assert (decision.prefill_instance, decision.transfer, decision.prefix_tokens) == (B, None, 8192 - 256)


def test_busy_holder_makes_the_router_replicate_its_prefix() -> None:
    """A busy holder: an idle instance with a small prefix gets the missing blocks moved, and keeps them."""
    views = [busy(A, NOW + 10), PrefillView(B)]
    decision = KvCacheCentricRouter(ESTIMATOR, threshold=1.5).route(views, query({A: 32, B: 2}), NOW, random.Random(0))
    assert decision is not None
    assert decision.prefill_instance == B
    assert decision.transfer is not None
    # The blocks it lacks but the last, which the prefill computes anyway.
    assert (decision.transfer.source, decision.transfer.num_blocks, decision.transfer.keep_local_copy) == (A, 29, True)
    assert decision.prefix_tokens == 8192 - 256


def test_ratio_at_or_below_threshold_keeps_own_prefix() -> None:
    """best / own = 2 with threshold 2 does not transfer; with threshold 1.9 it does."""
    views = [busy(A, NOW + 10), PrefillView(B)]
    q = query({A: 30, B: 15})
    kept = KvCacheCentricRouter(ESTIMATOR, threshold=2.0).route(views, q, NOW, random.Random(0))
    moved = KvCacheCentricRouter(ESTIMATOR, threshold=1.9).route(views, q, NOW, random.Random(0))
    assert kept is not None and moved is not None
    assert (kept.prefill_instance, kept.transfer, kept.prefix_tokens) == (B, None, 15 * 256)
    assert moved.prefill_instance == B and moved.transfer is not None and moved.transfer.num_blocks == 15


def test_transfers_in_flight_from_the_holder_slow_a_new_one() -> None:
    """Congestion: each transfer already leaving the best holder adds one more bytes / bandwidth."""
    views = [busy(A, NOW + 10), PrefillView(B)]
    router = KvCacheCentricRouter(ESTIMATOR)
    quiet = query({A: 32})
    congested = attrs.evolve(quiet, best_transfers_in_flight=2)
    alone, shared = (
        router.route(views, quiet, NOW, random.Random(0)),
        router.route(views, congested, NOW, random.Random(0)),
    )
    assert alone is not None and shared is not None and alone.transfer is not None and shared.transfer is not None
    one = alone.transfer.num_bytes / 100e9
    assert shared.transfer_s == pytest.approx(alone.transfer_s + 2 * one)
    assert shared.transfer.transfer_s == shared.transfer_s


def test_ties_break_by_queue_then_cache_then_id() -> None:
    """Equal estimates: the shorter queue, then the emptier cache, then the smaller id."""
    router = KvCacheCentricRouter(ESTIMATOR)
    idle = router.route([PrefillView(C), PrefillView(B), PrefillView(A)], query({}), NOW, random.Random(0))
    assert idle is not None and idle.prefill_instance == A


def test_prompts_new_to_every_idle_instance_spread_and_keep_their_home() -> None:
    """Idle instances, none holding the prompt: each prompt goes to its rendezvous home, the same one every
    time, and different prompts spread over all instances (not all to the smallest id); a shorter queue
    still comes first, and a longer prefix first of all."""
    views = [PrefillView(A), PrefillView(B), PrefillView(C)]
    router = KvCacheCentricRouter(ESTIMATOR)
    homes = collections.Counter()
    for prompt in range(300):
        q = attrs.evolve(query({}), block_keys=tuple(BlockKey(1000 * prompt + i) for i in range(32)))
        chosen = router.route(views, q, NOW, random.Random(0))
        again = local_cache_aware_router(ESTIMATOR).route(list(reversed(views)), q, NOW, random.Random(1))
        assert chosen is not None and again is not None and chosen.prefill_instance == again.prefill_instance
        homes[chosen.prefill_instance] += 1
    assert set(homes) == {A, B, C} and min(homes.values()) >= 70, homes  # about 100 each
    q = attrs.evolve(query({}), block_keys=(BlockKey(7),))
    home = router.route(views, q, NOW, random.Random(0))
    assert home is not None
    others = [v.instance_id for v in views if v.instance_id != home.prefill_instance]
    busier = [busy(v.instance_id, NOW + 0.5) if v.instance_id == home.prefill_instance else v for v in views]
    chosen = router.route(busier, q, NOW, random.Random(0))
    assert chosen is not None and chosen.prefill_instance in others
    holding = attrs.evolve(query({others[0]: 8}), block_keys=q.block_keys)
    chosen = local_cache_aware_router(ESTIMATOR).route(views, holding, NOW, random.Random(0))
    assert chosen is not None and chosen.prefill_instance == others[0]


def test_spread_weights_depend_on_the_first_missing_key_and_the_instance() -> None:
    keys = tuple(BlockKey(k) for k in (11, 22, 33))
    ids = [A, B, C]
    weights = spread_weights(keys, np.array([0, 0, 0]), ids)
    assert ((weights >= 0) & (weights < 1)).all() and len(set(weights.tolist())) == 3
    # Holding one block weighs the second key; holding all weighs the last; alone or together the same.
    assert spread_weights(keys, np.array([1]), [A])[0] == spread_weights(keys[1:], np.array([0]), [A])[0]
    assert spread_weights(keys, np.array([5]), [B])[0] == spread_weights(keys[2:], np.array([0]), [B])[0]
    assert spread_weights(keys, np.array([0, 0, 0]), [C, A, B]).tolist() == [weights[2], weights[0], weights[1]]
    assert spread_weights((), np.array([0, 0]), [A, B]).tolist() == [0.0, 0.0]
    # The prompt's keys as the index stores them (a uint64 array) weigh the same as the keys themselves.
    assert (
        spread_weights(np.array([11, 22, 33], dtype=np.uint64), np.array([0, 0, 0]), ids).tolist() == weights.tolist()
    )


@given(
    keys=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=6),
    held=st.lists(st.integers(0, 8), min_size=1, max_size=4),
)
def test_spread_weights_are_splitmix64_of_the_first_missing_key_and_the_id(keys: list[int], held: list[int]) -> None:
    """Each instance weighs the key of the first block it lacks (the last key when it holds them all)."""
    ids = [InstanceId(f"prefill-{i}") for i in range(len(held))]
    weights = spread_weights(tuple(BlockKey(k) for k in keys), np.array(held), ids).tolist()
    assert weights == [rendezvous_weight(keys[min(n, len(keys) - 1)], i) for n, i in zip(held, ids, strict=True)]


def test_keys_wider_than_64_bits_weigh_as_the_index_stores_them() -> None:
    """XXH3-128 and SHA-256 keys (a regression: they overflowed a uint64 and routing raised) weigh as
    their folded 64-bit form, the key the index matches."""
    wide = (BlockKey(2**200 + 7), BlockKey(2**70))
    folded = tuple(BlockKey(int(k)) for k in key_array(wide))
    assert (
        spread_weights(wide, np.array([0, 1]), [A, B]).tolist()
        == spread_weights(folded, np.array([0, 1]), [A, B]).tolist()
    )


@attrs.frozen
class PerTokenPrefill:
    """A prefill of n tokens with p cached takes (n − p) / 1024 s: binary fractions, so sums are exact
    and different instances often reach the very same TTFT."""

    def prefill_s(self, num_tokens: int, prefix_tokens: int = 0) -> float:
        return (num_tokens - prefix_tokens) / 1024


EXACT_KV_BYTES_PER_TOKEN = 8
# Moving t tokens takes t · (1 + congestion) / 4096 s: a binary fraction too.
EXACT_ESTIMATOR = TtftEstimator(
    prefill=PerTokenPrefill(),
    transfer=TransferCostModel(bandwidth_bytes_per_s=4096.0 * EXACT_KV_BYTES_PER_TOKEN, latency_s=0.0),
    kv_bytes_per_token=EXACT_KV_BYTES_PER_TOKEN,
)


def test_equal_ttft_goes_to_the_shorter_queue_before_the_smaller_id() -> None:
    """A holds a quarter of the prompt but waits 2 s; B holds nothing and is idle: both estimate
    8 s, and the tie goes to B, whose queue is shorter, although A's id is smaller."""
    views = [busy(A, NOW + 2.0), PrefillView(B)]
    q = query({A: 8}, input_tokens=8192, block_size=256)
    for router in (local_cache_aware_router(EXACT_ESTIMATOR), LoadBalancingRouter(EXACT_ESTIMATOR)):
        chosen = router.route(views, q, NOW, random.Random(0))
        assert chosen is not None and chosen.prefill_instance == B
    local = local_cache_aware_router(EXACT_ESTIMATOR)
    decisions = {
        v.instance_id: EXACT_ESTIMATOR.decide(
            v, q, NOW, prefix_blocks=q.prefix_blocks.get(v.instance_id, 0), transfer_from=None
        )
        for v in views
    }
    assert decisions[A].ttft_s == decisions[B].ttft_s == 8.0
    assert local.route(PrefillBoard(views), q, NOW, random.Random(0)).prefill_instance == B  # type: ignore[union-attr]


@st.composite
def tied_scenarios(draw: st.DrawFn) -> tuple[list[PrefillView], RouteQuery]:
    """Each instance waits q s holding b blocks of 256 tokens (1 s of prefill per 4 blocks), mostly
    on the line q − b/4 = 0 where every staying-local estimate is equal: under the exact estimator,
    equal TTFTs with different queues are the rule, with a few instances off the line."""
    count = draw(st.integers(min_value=2, max_value=6))
    ids = [InstanceId(f"prefill-{i}") for i in range(count)]
    on_line, off_line = [(0.0, 0), (1.0, 4), (2.0, 8)], [(1.0, 0), (0.0, 8), (2.0, 4)]
    views, prefix = [], {}
    for instance in ids:
        queue_s, blocks = draw(st.sampled_from(on_line) | st.sampled_from(off_line))
        views.append(busy(instance, NOW + queue_s) if queue_s else PrefillView(instance))
        if blocks:
            prefix[instance] = blocks
    input_tokens = draw(st.sampled_from([2048, 4096, 8192]))
    q = query(prefix, input_tokens=input_tokens, block_size=256)
    congestion = draw(st.integers(0, 2)) if q.best_instance else 0
    keys = draw(st.lists(st.integers(0, 2**64 - 1), min_size=input_tokens // 256, max_size=input_tokens // 256))
    return views, attrs.evolve(q, best_transfers_in_flight=congestion, block_keys=tuple(map(BlockKey, keys)))


@given(tied_scenarios(), st.sampled_from([1.0, 1.5, 4.0, math.inf]))
def test_ties_on_ttft_break_by_queue_then_cache_then_id(
    scenario: tuple[list[PrefillView], RouteQuery], threshold: float
) -> None:
    """Among candidates of equal estimated TTFT, the router picks the shortest queue, then the longest
    prefix of its own, then the heaviest rendezvous weight, then the smallest id: the brute-force minimum
    by (TTFT, queue, −own blocks, −weight, id), with exact arithmetic."""
    views, q = scenario
    chosen = KvCacheCentricRouter(EXACT_ESTIMATOR, threshold=threshold).route(views, q, NOW, random.Random(0))
    expected, every = reference_route(EXACT_ESTIMATOR, views, q, NOW, threshold=threshold)
    assert chosen == expected
    assert chosen is not None and chosen.ttft_s == documented_ttft_s(chosen)
    tied = [d for d in every if d.ttft_s == chosen.ttft_s]
    if len({d.queue_s for d in tied}) > 1:
        event("TTFT tie between different queues")


@given(scenarios(), finite_thresholds)
def test_a_flat_prefill_model_keeps_the_prompt_on_its_prefix_holder(
    scenario: tuple[list[PrefillView], RouteQuery], threshold: float
) -> None:
    """A prefill model fitted flat (a cached prefix saves nothing by its estimate) ties every instance of
    the same queue: the one with the longest prefix of its own wins the tie, as the brute force says."""
    views, q = scenario
    flat = attrs.evolve(ESTIMATOR, prefill=FittedPrefillModel(coefficients=(0.05, 0.0, 0.0)))
    chosen = KvCacheCentricRouter(flat, threshold=threshold).route(views, q, NOW, random.Random(0))
    expected, every = reference_route(flat, views, q, NOW, threshold=threshold)
    assert chosen == expected and chosen is not None
    held = usable_blocks(q, q.prefix_blocks.get(chosen.prefill_instance, 0))
    for other in every:
        if (other.ttft_s, other.queue_s) == (chosen.ttft_s, chosen.queue_s):
            assert usable_blocks(q, q.prefix_blocks.get(other.prefill_instance, 0)) <= held


@pytest.mark.parametrize(
    "router",
    [
        KvCacheCentricRouter(ESTIMATOR),
        local_cache_aware_router(ESTIMATOR),
        LoadBalancingRouter(ESTIMATOR),
        RandomRouter(ESTIMATOR),
    ],
    ids=["kvcache_centric", "local_cache_aware", "load_balancing", "random"],
)
def test_no_candidates_no_decision(router: Router) -> None:
    """Every router returns None when no instance is up."""
    assert router.route([], query({A: 3}), NOW, random.Random(0)) is None


@given(scenarios(), ttft_estimators(), finite_thresholds)
def test_choice_minimises_its_own_estimate(
    scenario: tuple[list[PrefillView], RouteQuery], estimator: TtftEstimator, threshold: float
) -> None:
    """The chosen instance has the smallest TTFT estimate of all candidates, the documented one (brute force from
    the cost models, same rule)."""
    views, q = scenario
    chosen = KvCacheCentricRouter(estimator, threshold=threshold).route(views, q, NOW, random.Random(0))
    expected, every = reference_route(estimator, views, q, NOW, threshold=threshold)
    assert chosen == expected
    assert chosen is not None and chosen.ttft_s == documented_ttft_s(chosen)
    assert all(chosen.ttft_s <= documented_ttft_s(other) for other in every)


def test_prefix_blocks_is_a_mapping_of_the_holders() -> None:
    """An array over instances reads as instance → blocks, instances holding none absent."""
    blocks = PrefixBlocks((A, B, C), np.array([3, 0, 5], dtype=np.int64))
    assert dict(blocks) == {A: 3, C: 5} and len(blocks) == 2
    assert blocks.get(B, 0) == 0 and blocks.get(InstanceId("elsewhere")) is None and blocks[C] == 5
    with pytest.raises(KeyError):
        blocks[B]


@given(scenarios(), ttft_estimators(), st.sampled_from([1.0, 1.5, 4.0, math.inf]))
def test_a_board_with_prefix_arrays_routes_as_plain_views(
    scenario: tuple[list[PrefillView], RouteQuery], estimator: TtftEstimator, threshold: float
) -> None:
    """Candidates as a `PrefillBoard` and prefixes as `PrefixBlocks` over it (what the Conductor
    passes) give the decision the plain views and a dict give."""
    views, q = scenario
    router = KvCacheCentricRouter(estimator, threshold=threshold)
    board = PrefillBoard(views)
    blocks = np.array([q.prefix_blocks.get(i, 0) for i in board.instance_ids], dtype=np.int64)
    arrays = attrs.evolve(q, prefix_blocks=PrefixBlocks(board.instance_ids, blocks, board.slot))
    assert router.route(board, arrays, NOW, random.Random(0)) == router.route(views, q, NOW, random.Random(0))


@given(scenarios(), ttft_estimators(), finite_thresholds)
def test_ratio_rule_holds_for_the_choice(
    scenario: tuple[list[PrefillView], RouteQuery], estimator: TtftEstimator, threshold: float
) -> None:
    """The choice transfers iff best / own > threshold (own 0: infinite), from the best holder, both
    prefixes counted as far as the prefill reuses them."""
    views, q = scenario
    chosen = KvCacheCentricRouter(estimator, threshold=threshold).route(views, q, NOW, random.Random(0))
    assert chosen is not None
    own = q.prefix_blocks.get(chosen.prefill_instance, 0)
    expected = should_transfer(
        instance=chosen.prefill_instance,
        own_blocks=usable_blocks(q, own),
        best_instance=q.best_instance,
        best_blocks=usable_blocks(q, q.best_blocks),
        threshold=threshold,
    )
    assert (chosen.transfer is not None) == expected
    assert chosen.prefix_tokens == q.prefix_tokens(q.best_blocks if expected else own)


@given(scenarios(), ttft_estimators(), finite_thresholds)
def test_transfer_plan_moves_missing_blocks_and_keeps_a_copy_while_the_prefix_is_rare(
    scenario: tuple[list[PrefillView], RouteQuery], estimator: TtftEstimator, threshold: float
) -> None:
    """A transfer moves best − own blocks (their KV bytes) from the best holder, counted as far as the
    prefill reuses them; the receiver keeps the copy exactly while fewer than max(2, ⌈n / 2⌉) of the n
    candidates hold the prefix."""
    views, q = scenario
    chosen = KvCacheCentricRouter(estimator, threshold=threshold).route(views, q, NOW, random.Random(0))
    assert chosen is not None
    plan = chosen.transfer
    if plan is None:
        assert chosen.transfer_s == 0.0
        return
    own = q.prefix_blocks.get(chosen.prefill_instance, 0)
    assert plan.source == q.best_instance != chosen.prefill_instance
    assert plan.keep_local_copy == (q.best_holders < max(2, math.ceil(len(views) / 2)))
    assert plan.num_blocks == usable_blocks(q, q.best_blocks) - usable_blocks(q, own) > 0
    assert plan.num_bytes == (q.prefix_tokens(q.best_blocks) - q.prefix_tokens(own)) * estimator.kv_bytes_per_token
    assert plan.transfer_s == chosen.transfer_s


@given(scenarios(), ttft_estimators())
def test_infinite_threshold_is_local_cache_aware(
    scenario: tuple[list[PrefillView], RouteQuery], estimator: TtftEstimator
) -> None:
    """KvCacheCentricRouter with threshold ∞ and local_cache_aware_router decide alike, decision for decision."""
    views, q = scenario
    full = KvCacheCentricRouter(estimator, threshold=math.inf)
    ablation = local_cache_aware_router(estimator)
    assert ablation.current_threshold == math.inf
    assert full.route(views, q, NOW, random.Random(0)) == ablation.route(views, q, NOW, random.Random(0))


@given(scenarios(), ttft_estimators())
@example(scenario=EMPTY_INSTANCE_CASE, estimator=ESTIMATOR)
def test_infinite_threshold_never_transfers(
    scenario: tuple[list[PrefillView], RouteQuery], estimator: TtftEstimator
) -> None:
    """With transfers forbidden (threshold ∞) no transfer is planned; each instance uses only its own prefix."""
    views, q = scenario
    decision = local_cache_aware_router(estimator).route(views, q, NOW, random.Random(0))
    assert decision is not None
    assert decision.transfer is None
    assert decision == reference_local_route(estimator, views, q, NOW)


def test_local_cache_aware_does_not_move_the_prefix_to_an_empty_instance() -> None:
    """Minimal repro: A holds 32 blocks but is busy, B holds none; the no-transfer ablation must not move them."""
    views, q = EMPTY_INSTANCE_CASE
    decision = local_cache_aware_router(ESTIMATOR).route(views, q, NOW, random.Random(0))
    assert decision is not None
    assert decision.transfer is None


@given(scenarios(), ttft_estimators(), finite_thresholds)
def test_routing_is_deterministic(
    scenario: tuple[list[PrefillView], RouteQuery], estimator: TtftEstimator, threshold: float
) -> None:
    """The KV-cache-centric router neither draws from its generator nor changes its answer on a repeat."""
    views, q = scenario
    router = KvCacheCentricRouter(estimator, threshold=threshold)
    rng = random.Random(7)
    first = router.route(views, q, NOW, rng)
    assert rng.getstate() == random.Random(7).getstate()
    assert router.route(list(views), q, NOW, random.Random(99)) == first


# ---------------------------------------------------------------------------- ablations


@given(scenarios(), ttft_estimators())
def test_load_balancing_picks_the_least_queue(
    scenario: tuple[list[PrefillView], RouteQuery], estimator: TtftEstimator
) -> None:
    """The shortest queue wins (ties: id), with its own prefix and no transfer."""
    views, q = scenario
    decision = LoadBalancingRouter(estimator).route(views, q, NOW, random.Random(0))
    assert decision is not None
    shortest = min(views, key=lambda v: (v.queue_s(NOW), v.instance_id))
    assert decision.prefill_instance == shortest.instance_id
    assert decision.queue_s == min(v.queue_s(NOW) for v in views)
    assert decision.transfer is None
    assert decision.prefix_tokens == q.prefix_tokens(q.prefix_blocks.get(shortest.instance_id, 0))


@given(scenarios(), ttft_estimators(), st.integers(min_value=0, max_value=2**32 - 1))
def test_random_router_is_deterministic_for_a_seed(
    scenario: tuple[list[PrefillView], RouteQuery], estimator: TtftEstimator, seed: int
) -> None:
    """Two runs from the same seed route a sequence of requests the same way; each pick is a candidate, no transfer."""
    views, q = scenario
    router = RandomRouter(estimator)

    def run() -> list[RouteDecision | None]:
        rng = random.Random(seed)
        return [router.route(views, q, NOW, rng) for _ in range(20)]

    first = run()
    assert first == run()
    ids = {v.instance_id for v in views}
    for decision in first:
        assert decision is not None and decision.prefill_instance in ids and decision.transfer is None


def test_random_router_spreads_over_candidates() -> None:
    """Over many draws every candidate is picked."""
    views = [PrefillView(A), PrefillView(B), PrefillView(C)]
    rng = random.Random(0)
    decisions = [RandomRouter(ESTIMATOR).route(views, query({}), NOW, rng) for _ in range(100)]
    assert {d.prefill_instance for d in decisions if d is not None} == {A, B, C}


@given(st.lists(st.tuples(st.integers(0, 4), st.booleans()), min_size=1, max_size=40))
def test_round_robin_takes_the_instances_up_in_id_order(steps: list[tuple[int, bool]]) -> None:
    """Each choice is the first instance up after the previous choice in id order (wrapping), whichever
    instances went down or came back in between; a cycle with all up visits each once."""
    views = {name: PrefillView(InstanceId(name)) for name in ("a", "b", "c", "d", "e")}
    router = RoundRobinRouter(ESTIMATOR)
    previous: str | None = None
    for flip, up in steps:
        views["abcde"[flip]].is_up = up
        candidates = [v for v in views.values() if v.is_up]
        decision = router.route(candidates, query({}), NOW, random.Random(0))
        if not candidates:
            assert decision is None
            continue
        assert decision is not None
        ids = sorted(v.instance_id for v in candidates)
        later = [i for i in ids if previous is None or i > previous]
        assert decision.prefill_instance == (later[0] if later else ids[0])
        previous = decision.prefill_instance
    for view in views.values():
        view.is_up = True
    cycle = [router.route(list(views.values()), query({}), NOW, random.Random(0)) for _ in range(5)]
    assert sorted(d.prefill_instance for d in cycle if d is not None) == sorted(views)


# ---------------------------------------------------------------------------- adaptive threshold


def on_time(adaptive: AdaptiveThreshold, *, had_transfer: bool) -> AdaptiveThreshold:
    """`adaptive` after one decision of the kind on time (the threshold moves only once both kinds were seen)."""
    adaptive.observe(had_transfer=had_transfer, estimated_ttft_s=1.0, observed_ttft_s=1.0)
    return adaptive


def test_adaptive_threshold_moves_only_once_both_kinds_were_seen() -> None:
    """Local decisions alone say nothing about transfers (the transfer mean is only its prior): late or early,
    they leave the threshold where it is, however many (it climbed to its maximum on a bias of the local
    estimates alone, and with no transfers from then on, never came down)."""
    adaptive = AdaptiveThreshold()
    for _ in range(50):
        adaptive.observe(had_transfer=False, estimated_ttft_s=1.0, observed_ttft_s=0.1)
    assert adaptive.value == 1.5
    adaptive = AdaptiveThreshold()
    for _ in range(50):
        adaptive.observe(had_transfer=True, estimated_ttft_s=1.0, observed_ttft_s=5.0)
    assert adaptive.value == 1.5
    adaptive.observe(had_transfer=False, estimated_ttft_s=1.0, observed_ttft_s=1.0)
    assert adaptive.value > 1.5  # now transfers are known to run later than local decisions


def test_adaptive_threshold_rises_when_transfers_run_late() -> None:
    """Transfers slower than estimated push the threshold up (fewer transfers)."""
    adaptive = on_time(AdaptiveThreshold(), had_transfer=False)
    before = adaptive.value
    adaptive.observe(had_transfer=True, estimated_ttft_s=1.0, observed_ttft_s=3.0)
    assert adaptive.value > before
    again = adaptive.value
    adaptive.observe(had_transfer=True, estimated_ttft_s=1.0, observed_ttft_s=3.0)
    assert adaptive.value > again


def test_adaptive_threshold_falls_when_transfers_beat_estimates() -> None:
    """Transfers faster than estimated bring the threshold down (more transfers)."""
    adaptive = on_time(AdaptiveThreshold(value=8.0), had_transfer=False)
    adaptive.observe(had_transfer=True, estimated_ttft_s=2.0, observed_ttft_s=0.5)
    assert adaptive.value < 8.0


def test_adaptive_threshold_compares_with_local_decisions() -> None:
    """Local decisions running late (transfers on time) also lower the threshold: transfers look better."""
    adaptive = on_time(AdaptiveThreshold(value=8.0), had_transfer=True)
    adaptive.observe(had_transfer=False, estimated_ttft_s=1.0, observed_ttft_s=4.0)
    assert adaptive.value < 8.0


@pytest.mark.parametrize("estimate", [0.0, -1.0, math.inf, math.nan])
def test_adaptive_threshold_ignores_estimates_that_are_no_time(estimate: float) -> None:
    """An estimate of zero (or less), infinite or NaN teaches nothing: an infinite one read as a ratio of 0, a
    transfer infinitely faster than estimated, and pulled the threshold down."""
    adaptive = AdaptiveThreshold()
    for had_transfer in (True, False):
        adaptive.observe(had_transfer=had_transfer, estimated_ttft_s=estimate, observed_ttft_s=5.0)
    assert (adaptive.value, adaptive.transfer_ratio, adaptive.local_ratio) == (1.5, 1.0, 1.0)


@given(
    st.lists(
        st.tuples(st.booleans(), st.floats(min_value=0.01, max_value=100.0), st.floats(min_value=0.0, max_value=10.0)),
        max_size=60,
    ),
    st.floats(min_value=1.0, max_value=4.0),
    st.floats(min_value=4.0, max_value=64.0),
)
def test_adaptive_threshold_stays_within_bounds(
    observations: list[tuple[bool, float, float]], minimum: float, maximum: float
) -> None:
    """Whatever it observes (observed / estimated up to 1,000), the threshold stays in [minimum, maximum]."""
    adaptive = AdaptiveThreshold(value=4.0, minimum=minimum, maximum=maximum, rate=0.5, smoothing=0.5)
    for had_transfer, estimated, observed in observations:
        adaptive.observe(had_transfer=had_transfer, estimated_ttft_s=estimated, observed_ttft_s=observed)
        assert minimum <= adaptive.value <= maximum


class AdaptiveThresholdMachine(RuleBasedStateMachine):
    """`AdaptiveThreshold` against its documented update written out: an exponentially weighted mean of
    observed / estimated TTFT (capped at 100) per kind of decision, the threshold multiplied by
    exp(rate · (transfer mean − local mean)) clamped to one e-fold, then to [minimum, maximum], once both kinds
    were observed; observations that teach nothing (an estimate <= 0, an observation negative or not finite)
    change nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.adaptive = AdaptiveThreshold(value=4.0, minimum=1.0, maximum=32.0, rate=0.5, smoothing=0.25)
        self.value, self.ratios = 4.0, {True: 1.0, False: 1.0}
        self.seen: set[bool] = set()

    @rule(
        had_transfer=st.booleans(),
        estimated=st.one_of(st.floats(1e-4, 100.0), st.sampled_from([0.0, -1.0, math.nan])),
        observed=st.one_of(st.floats(0.0, 1000.0), st.sampled_from([-1.0, math.inf, math.nan])),
    )
    def observe(self, had_transfer: bool, estimated: float, observed: float) -> None:
        self.adaptive.observe(had_transfer=had_transfer, estimated_ttft_s=estimated, observed_ttft_s=observed)
        if not (estimated > 0 and 0 <= observed < math.inf):
            return
        self.ratios[had_transfer] += 0.25 * (min(observed / estimated, 100.0) - self.ratios[had_transfer])
        self.seen.add(had_transfer)
        if len(self.seen) < 2:
            return
        step = min(1.0, max(-1.0, 0.5 * (self.ratios[True] - self.ratios[False])))
        self.value = min(32.0, max(1.0, self.value * math.exp(step)))

    @invariant()
    def matches_the_reference(self) -> None:
        assert math.isclose(self.adaptive.value, self.value, rel_tol=1e-12)
        assert (self.adaptive.transfer_ratio, self.adaptive.local_ratio) == (self.ratios[True], self.ratios[False])


TestAdaptiveThresholdMachine = AdaptiveThresholdMachine.TestCase


def test_adaptive_threshold_survives_a_wildly_late_request() -> None:
    """A 0.1 ms estimate observed at 2 s (ratio 20,000) raises the threshold by a bounded step instead of overflowing."""
    adaptive = on_time(AdaptiveThreshold(), had_transfer=False)
    before = adaptive.value
    adaptive.observe(had_transfer=True, estimated_ttft_s=1e-4, observed_ttft_s=2.0)
    assert before < adaptive.value <= before * math.e  # at most one e-fold per observation
    for _ in range(20):
        adaptive.observe(had_transfer=True, estimated_ttft_s=1e-4, observed_ttft_s=2.0)
    assert adaptive.value == adaptive.maximum


def test_router_uses_the_adaptive_value() -> None:
    """With an adaptive threshold the router decides on its current value; a fixed threshold given beside it (which
    it would ignore) is a ConfigError."""
    adaptive = AdaptiveThreshold(value=1.5)
    with pytest.raises(ConfigError, match="not used with an adaptive threshold"):
        KvCacheCentricRouter(ESTIMATOR, threshold=100.0, adaptive=adaptive)
    router = KvCacheCentricRouter(ESTIMATOR, adaptive=adaptive)
    views, q = [busy(A, NOW + 10), PrefillView(B)], query({A: 32, B: 8})  # ratio 4
    assert router.current_threshold == 1.5
    moved = router.route(views, q, NOW, random.Random(0))
    assert moved is not None and moved.transfer is not None
    adaptive.value = 8.0
    kept = router.route(views, q, NOW, random.Random(0))
    assert kept is not None and kept.transfer is None


@pytest.mark.parametrize(
    "settings",
    [
        {"value": 0.0},
        {"rate": 0.0},
        {"smoothing": 0.0},
        {"minimum": 0.0},
        {"maximum": 0.0},
        {"value": 0.5, "minimum": 0.5},  # a threshold is a ratio of prefix lengths: at least 1, as the router's
        {"smoothing": 5.0},  # the newest observation's weight
        {"minimum": 8.0, "maximum": 4.0, "value": 6.0},
        {"value": 100.0},  # outside [minimum, maximum]
        {"rate": math.nan},
    ],
)
def test_adaptive_threshold_rejects_settings_out_of_their_range(settings: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        AdaptiveThreshold(**settings)


def test_a_negative_observed_ttft_teaches_the_threshold_nothing() -> None:
    """A TTFT observed from a clock that stepped back (negative) once drove the local ratio to -241 and pinned the
    threshold at its maximum for good; such an observation, or a non-finite one, is ignored."""
    adaptive = AdaptiveThreshold()
    before = attrs.asdict(adaptive)
    for observed in (-1000.0, math.nan, math.inf):
        adaptive.observe(had_transfer=False, estimated_ttft_s=4.0, observed_ttft_s=observed)
    assert attrs.asdict(adaptive) == before


@pytest.mark.parametrize("threshold", [math.nan, -1.0, 0.5, "x", -math.inf])
def test_a_threshold_that_is_not_a_ratio_of_at_least_one_is_refused(threshold: object) -> None:
    """Algorithm 1's threshold compares best_len / own: a number >= 1, or ∞ (never transfer)."""
    with pytest.raises(ConfigError, match="threshold must be a number >= 1"):
        KvCacheCentricRouter(ESTIMATOR, threshold=threshold)  # type: ignore[arg-type]
    assert KvCacheCentricRouter(ESTIMATOR, threshold=math.inf).current_threshold == math.inf
