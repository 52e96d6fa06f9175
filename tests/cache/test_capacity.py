"""Tests of mooncake.cache.capacity: examples, a brute-force replay, and the synthetic trace's curves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.cache.capacity import CapacityPoint, hit_ratio_curve, simulate_prefix_hits
from mooncake.cache.policy import LruPolicy, SievePolicy
from mooncake.errors import ConfigError
from mooncake.types import BlockKey, Request, RequestId
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
