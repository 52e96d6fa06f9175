"""Tests of mooncake.cache.capacity: examples, a brute-force replay, the serving cache it stands for
(`TieredCache.put_chain`), and the synthetic trace's curves."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.cache.capacity import CapacityPoint, hit_ratio_curve, simulate_prefix_hits
from mooncake.cache.policy import LruPolicy, SievePolicy
from mooncake.cache.pool import MetadataPagePool
from mooncake.cache.tiered import TieredCache
from mooncake.errors import CapacityError, ConfigError, InvalidRequestError
from mooncake.types import BlockKey, Request, RequestId, Tier
from mooncake.workload import load_trace, trace_stats
from tests.cache.policies import ALL_POLICIES, POLICIES
from tests.reference.policy import ReferencePolicy, reference_prefix_hits
from tests.strategies import chained_workloads


def keys(*values: int) -> tuple[BlockKey, ...]:
    return tuple(BlockKey(v) for v in values)


def as_requests(workload: list[tuple[BlockKey, ...]]) -> list[Request]:
    return [
        Request(
            request_id=RequestId(str(i)),
            arrival_s=float(i),
            input_length=max(1, len(block_keys)),
            output_length=1,
            block_keys=block_keys,
        )
        for i, block_keys in enumerate(workload)
    ]


# Examples ---------------------------------------------------------------------


def test_hits_count_the_cached_leading_blocks() -> None:
    """A hand-worked replay: hits are the contiguous cached prefix on arrival, counted before inserting."""
    requests = [keys(1, 2, 3), keys(1, 2, 4), keys(1, 5), keys(1, 2, 3)]
    point = simulate_prefix_hits(requests, LruPolicy(), capacity_blocks=3)
    # r0: no hits; holds {1, 2, 3}.  r1: hits 1, 2; 4 replaces leaf 3.  r2: hits 1; 5 replaces leaf 4.
    # r3: hits 1, 2; 3 replaces 5, the less recent of the leaves 2 and 5.
    assert point == CapacityPoint(capacity_blocks=3, hit_blocks=0 + 2 + 1 + 2, total_blocks=11)
    assert point.hit_ratio == pytest.approx(5 / 11)


def test_flat_lru_evicts_a_shared_head_before_its_tail() -> None:
    """Without prefix awareness LRU may evict a chain's head, losing every later hit of that chain."""
    requests = [keys(1, 2), keys(3), keys(1, 2)]
    flat = simulate_prefix_hits(requests, LruPolicy(prefix_aware=False), capacity_blocks=2)
    leaf_first = simulate_prefix_hits(requests, LruPolicy(), capacity_blocks=2)
    assert flat.hit_blocks == 0  # 3 evicted head 1; r2 misses at once
    assert leaf_first.hit_blocks == 1  # 3 evicted leaf 2; r2 hits 1


@pytest.mark.parametrize(("kind", "prefix_aware"), ALL_POLICIES)
def test_a_chain_longer_than_the_cache_keeps_its_head(kind: str, prefix_aware: bool) -> None:
    """A 5-block prompt in a 3-block cache stores its first 3 blocks and stops, under every policy, as
    put_chain does: evicting its own head to store its tail would keep blocks no prompt can match."""
    chain = keys(11, 12, 13, 14, 15)
    policy = POLICIES[kind](prefix_aware=prefix_aware)
    point = simulate_prefix_hits([chain, chain], policy, capacity_blocks=3)
    assert (point.hit_blocks, point.total_blocks) == (3, 10)
    assert [key for key in chain if key in policy] == [11, 12, 13]
    policy.check_invariants()  # the chain's pins were all released
    assert not any(policy.is_pinned(key) for key in chain)


def test_a_chain_evicts_other_blocks_but_never_its_own() -> None:
    """Room for a chain's later blocks comes from other requests' blocks, least recent first; once only the
    chain's own blocks are left the chain stops, even where LRU would rank its head as the victim."""
    requests = [keys(1), keys(2, 3, 4, 5), keys(2, 3, 4, 5)]
    flat = LruPolicy(prefix_aware=False)
    point = simulate_prefix_hits(requests, flat, capacity_blocks=3)
    # r0 holds {1}.  r1 stores 2, 3; 4 replaces 1; 5 finds only 2, 3, 4 (its own): the chain stops.
    # r2 hits 2, 3, 4, then stops at 5 again.
    assert (point.hit_blocks, point.total_blocks) == (3, 9)
    assert [key for key in keys(1, 2, 3, 4, 5) if key in flat] == [2, 3, 4]


def test_empty_workload_has_zero_hit_ratio() -> None:
    """No requests, or only empty ones, give zero hits, zero blocks and a hit ratio of 0.0."""
    assert simulate_prefix_hits([], LruPolicy(), capacity_blocks=4).hit_ratio == 0.0
    point = simulate_prefix_hits([(), ()], LruPolicy(), capacity_blocks=4)
    assert (point.hit_blocks, point.total_blocks, point.hit_ratio) == (0, 0, 0.0)


@pytest.mark.parametrize("capacity", [0, -1, 1.5, 2.0, True, "3", None])
def test_invalid_capacity_raises_config_error(capacity: Any) -> None:
    """A capacity that is not a positive int (bools and floats included) raises ConfigError, a ValueError."""
    with pytest.raises(ConfigError):
        simulate_prefix_hits([keys(1)], LruPolicy(), capacity_blocks=capacity)
    with pytest.raises(ValueError):
        hit_ratio_curve([keys(1)], LruPolicy, capacities_blocks=[4, capacity])


def test_curve_runs_each_capacity_on_a_fresh_policy() -> None:
    """hit_ratio_curve gives, in order, what separate simulate_prefix_hits calls with fresh policies give."""
    requests = [keys(1, 2, 3), keys(1, 2, 4), keys(5), keys(1, 2, 3), keys(1, 6)]
    curve = hit_ratio_curve(requests, SievePolicy, capacities_blocks=[3, 1, 5])
    assert [p.capacity_blocks for p in curve] == [3, 1, 5]
    assert curve == tuple(simulate_prefix_hits(requests, SievePolicy(), capacity_blocks=c) for c in (3, 1, 5))


# Properties against the brute-force replay ------------------------------------


class CapacityWatch:
    """Wraps a policy and fails the moment it holds more than `capacity` blocks."""

    def __init__(self, policy: Any, capacity: int) -> None:
        self.policy, self.capacity, self.peak = policy, capacity, 0

    def access(self, key: BlockKey, **options: Any) -> None:
        self.policy.access(key, **options)
        self.peak = max(self.peak, len(self.policy))
        assert len(self.policy) <= self.capacity, f"{len(self.policy)} blocks in a {self.capacity}-block cache"

    def evict(self) -> BlockKey | None:
        return self.policy.evict()  # type: ignore[no-any-return]

    def pin(self, key: BlockKey) -> None:
        self.policy.pin(key)

    def unpin(self, key: BlockKey) -> None:
        self.policy.unpin(key)

    def __len__(self) -> int:
        return len(self.policy)

    def __contains__(self, key: object) -> bool:
        return key in self.policy


@pytest.mark.parametrize(("kind", "prefix_aware"), ALL_POLICIES)
@given(workload=chained_workloads(), capacity=st.integers(min_value=1, max_value=8))
def test_simulation_never_exceeds_capacity(
    kind: str, prefix_aware: bool, workload: list[tuple[BlockKey, ...]], capacity: int
) -> None:
    """The replay never holds more blocks than its capacity, at any step."""
    watch = CapacityWatch(POLICIES[kind](prefix_aware=prefix_aware), capacity)
    simulate_prefix_hits(workload, watch, capacity_blocks=capacity)  # type: ignore[arg-type]
    distinct = len({key for keys in workload for key in keys})
    assert watch.peak == min(capacity, distinct)  # it fills up, and no further


@pytest.mark.parametrize(("kind", "prefix_aware"), ALL_POLICIES)
@given(workload=chained_workloads(), capacity=st.integers(min_value=1, max_value=8))
def test_simulation_matches_reference_replay(
    kind: str, prefix_aware: bool, workload: list[tuple[BlockKey, ...]], capacity: int
) -> None:
    """Hits and totals equal a replay through the reference policy with a plain set for hits."""
    point = simulate_prefix_hits(workload, POLICIES[kind](prefix_aware=prefix_aware), capacity_blocks=capacity)
    expected = reference_prefix_hits(workload, ReferencePolicy(kind, prefix_aware=prefix_aware), capacity)
    assert (point.hit_blocks, point.total_blocks) == expected
    assert point.capacity_blocks == capacity


def put_chain_hits(workload: list[tuple[BlockKey, ...]], kind: str, prefix_aware: bool, capacity: int) -> int:
    """Hit blocks of a TieredCache with one metadata-only DRAM tier of `capacity` pages, driven as the simulator
    drives it: `prefix_match` on arrival, then `put_chain` of the prompt (a chain whose first block finds nothing
    evictable stores nothing: CapacityError, suppressed as the coupled simulator does)."""
    cache = TieredCache(
        [MetadataPagePool(Tier.DRAM, 64, capacity)], policy=lambda: POLICIES[kind](prefix_aware=prefix_aware)
    )
    hits = 0
    for block_keys in workload:
        hits += cache.prefix_match(block_keys)
        with contextlib.suppress(CapacityError):
            cache.put_chain(block_keys)
        cache.check_invariants()
    return hits


# Any key lists: keys repeat within a request and follow different parents, so prefix-aware parent links can
# form cycles (nothing evictable) and a request's own block may be its later block's only possible victim.
any_key_workloads = st.lists(st.lists(st.integers(0, 7).map(BlockKey), max_size=7).map(tuple), max_size=10)


@pytest.mark.parametrize(("kind", "prefix_aware"), ALL_POLICIES)
@given(
    workload=st.one_of(chained_workloads(max_blocks=10), any_key_workloads),
    capacity=st.integers(min_value=1, max_value=8),
)
def test_hits_equal_a_tiered_cache_driven_by_put_chain(
    kind: str, prefix_aware: bool, workload: list[tuple[BlockKey, ...]], capacity: int
) -> None:
    """The analysis is the serving cache: its hits, request by request, equal those of a TieredCache of
    `capacity` pages under the same policy fed each prompt by prefix_match then put_chain."""
    for end in range(len(workload) + 1):  # every prefix of the stream: the hits of each request agree
        point = simulate_prefix_hits(
            workload[:end], POLICIES[kind](prefix_aware=prefix_aware), capacity_blocks=capacity
        )
        assert point.hit_blocks == put_chain_hits(workload[:end], kind, prefix_aware, capacity)


@pytest.mark.parametrize(("kind", "prefix_aware"), ALL_POLICIES)
@given(workload=chained_workloads(), extra=st.integers(min_value=0, max_value=3))
def test_unbounded_capacity_equals_prefix_reuse_ratio(
    kind: str, prefix_aware: bool, workload: list[tuple[BlockKey, ...]], extra: int
) -> None:
    """With room for every distinct key the hit ratio is the trace's prefix_reuse_ratio (an infinite cache)."""
    capacity = max(1, len({k for block_keys in workload for k in block_keys})) + extra
    point = simulate_prefix_hits(workload, POLICIES[kind](prefix_aware=prefix_aware), capacity_blocks=capacity)
    assert point.hit_ratio == trace_stats(as_requests(workload)).prefix_reuse_ratio


@pytest.mark.parametrize(("kind", "prefix_aware"), ALL_POLICIES)
@given(workload=chained_workloads(), capacity=st.integers(min_value=1, max_value=8))
def test_finite_cache_hits_at_most_the_infinite_cache(
    kind: str, prefix_aware: bool, workload: list[tuple[BlockKey, ...]], capacity: int
) -> None:
    """A bounded cache never hits more blocks than an unbounded one."""
    point = simulate_prefix_hits(workload, POLICIES[kind](prefix_aware=prefix_aware), capacity_blocks=capacity)
    unbounded = trace_stats(as_requests(workload))
    assert point.total_blocks == unbounded.num_blocks
    assert point.hit_blocks <= round(unbounded.prefix_reuse_ratio * unbounded.num_blocks)


# The public synthetic trace -----------------------------------------------------


@pytest.fixture(scope="module")
def trace_keys(synthetic_trace: Path) -> list[tuple[BlockKey, ...]]:
    return [request.block_keys for request in load_trace(synthetic_trace)]


@pytest.mark.parametrize(
    ("prefix_aware", "expected"),
    [
        pytest.param(False, (0.0825, 0.4235, 0.6396), id="flat"),
        pytest.param(True, (0.0841, 0.4239, 0.6396), id="prefix"),
    ],
)
def test_synthetic_trace_lru_curve(
    trace_keys: list[tuple[BlockKey, ...]], prefix_aware: bool, expected: tuple[float, ...]
) -> None:
    """LRU on the Mooncake synthetic trace gives the published-run hit ratios at 1k / 10k / 50k blocks."""
    curve = hit_ratio_curve(
        trace_keys, lambda: LruPolicy(prefix_aware=prefix_aware), capacities_blocks=[1_000, 10_000, 50_000]
    )
    assert tuple(round(point.hit_ratio, 4) for point in curve) == expected


def test_requests_that_are_not_iterable_are_refused_by_name() -> None:
    with pytest.raises(InvalidRequestError, match="requests"):
        simulate_prefix_hits(None, LruPolicy(), capacity_blocks=2)  # type: ignore[arg-type]
