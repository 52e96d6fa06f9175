"""Capacity analysis: prefix hit ratio of one cache against its size.

Replays requests (their chained block keys, in arrival order) through a cache of
`capacity_blocks` blocks run by an eviction policy, with a `BlockIndex` fed by
the cache's events answering the hit question, exactly as in serving (a
`TieredCache` whose first tier has `capacity_blocks` pages, asked `prefix_match`
and then given the request's chain by `put_chain`):

1. hit = the contiguous prefix of the request's keys the cache holds on arrival
   (the index's `match`);
2. then each key, in request order, is refreshed if cached or inserted if not
   (its parent the request's previous key), evicting by the policy while the
   cache is full. As `put_chain` does, the chain never makes room by evicting
   its own earlier blocks: from the first time room is needed for a block past
   its head, the chain's cached blocks are pinned in the policy (each later one
   as it is reached) until the request is stored, and where nothing else can be
   evicted the chain stops there, its head cached and the rest not stored (a
   tail without its prefix could never be matched). A chain whose first block
   finds no room stores nothing (`put_chain` raises `CapacityError` there).

Invariant: the blocks a request stores all lie in the cached prefix of its
chain, so hits equal those of that `TieredCache`, for every policy.

hit_ratio = hit blocks / all blocks. This is the paper's Table 1 and FAST'25
Fig. 9 measure; with an unbounded cache it equals the trace's prefix_reuse_ratio.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import attrs

from mooncake._checks import require_int, require_iterable, shown
from mooncake.cache._placement import is_policy
from mooncake.cache.events import BlockRemoved, BlockStored
from mooncake.cache.index import BlockIndex
from mooncake.cache.policy import EvictionPolicy
from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.types import BlockKey, InstanceId, Tier

__all__ = ["CapacityPoint", "hit_ratio_curve", "simulate_prefix_hits"]

_SOURCE = InstanceId("cache")
_REPLAY_METHODS = ("access", "evict", "pin", "unpin", "__len__", "__contains__")  # what a replay calls


def _require_policy(name: str, policy: object) -> None:
    """ConfigError naming `name` unless `policy` is an eviction policy a replay can run (checked before it starts,
    not met as an AttributeError or a TypeError of `len` halfway through it)."""
    if not is_policy(policy, _REPLAY_METHODS):
        raise ConfigError(f"{name} must be an EvictionPolicy (an instance, LruPolicy() say), got {shown(policy)}")


@attrs.frozen(kw_only=True)
class CapacityPoint:
    """Prefix hits of one replay at one capacity."""

    capacity_blocks: int
    hit_blocks: int
    total_blocks: int

    @property
    def hit_ratio(self) -> float:
        """hit_blocks / total_blocks (0 for an empty replay)."""
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0


def simulate_prefix_hits(
    requests: Iterable[Sequence[BlockKey]],
    policy: EvictionPolicy,
    *,
    capacity_blocks: int,
) -> CapacityPoint:
    """Replay `requests` (block key lists) through a `capacity_blocks` cache run by `policy`.

    Each request is stored as `TieredCache.put_chain` stores it into a first tier
    of `capacity_blocks` pages (see the module docstring), so the hits equal
    those of that cache driven by `prefix_match` then `put_chain`.

    Args:
        requests: each request's chained keys (a sequence each), in arrival order.
        policy: a fresh policy; it decides what to evict (and is consumed).
        capacity_blocks: blocks the cache holds at most (>= 1).

    Raises:
        InvalidRequestError: `requests` is no iterable, a request no sequence of block keys.
        ConfigError: `capacity_blocks` is not an integer >= 1; `policy` is no eviction policy (a policy class,
            say, where an instance was meant).
    """
    capacity_blocks = require_int("capacity_blocks", capacity_blocks, minimum=1)
    _require_policy("policy", policy)
    requests = require_iterable("requests", requests, error=InvalidRequestError)
    index = BlockIndex()
    seq = 0
    hits = total = 0
    size = len(policy)  # tracked here: the policy changes size only when we insert or evict
    access, evict, pin, unpin = policy.access, policy.evict, policy.pin, policy.unpin
    for keys in requests:
        try:
            num_keys = len(keys)  # a sequence: read twice (matched, then stored) and sliced, which an iterator is not
        except TypeError:
            raise InvalidRequestError(f"each request must be a sequence of block keys, got {keys!r:.80}") from None
        hits += index.match(keys).length(_SOURCE)
        total += num_keys
        stored: list[BlockKey] = []
        evicted: list[BlockKey] = []
        parent = None
        # The chain's cached blocks, pinned from the first time room must be made for a block past its head
        # (until then nothing was evicted, so all of them are still cached): its victims are never its own.
        protected: list[BlockKey] | None = None
        try:
            for position, key in enumerate(keys):
                if key in policy:
                    access(key)  # a use: put_chain passes no parent or position for a cached block
                else:
                    while size >= capacity_blocks:
                        if position and protected is None:
                            protected = [earlier for earlier in keys[:position] if earlier in policy]
                            for earlier in protected:
                                pin(earlier)
                        victim = evict()
                        if victim is None:
                            break
                        evicted.append(victim)
                        size -= 1
                    if size >= capacity_blocks:
                        break  # nothing evictable but the chain's own blocks: the rest of it stays out
                    stored.append(key)
                    size += 1
                    access(key, parent=parent, position=position)
                if protected is not None:
                    pin(key)
                    protected.append(key)
                parent = key
        finally:
            for key in protected or ():
                unpin(key)
        # At most one event of each kind per request, net of what happened inside
        # it: only the final state matters, since the next match comes after it.
        removed = [key for key in evicted if key not in policy] if evicted else None
        added = [key for key in stored if key in policy] if stored else None
        for event_type, changed in ((BlockRemoved, removed), (BlockStored, added)):
            if changed:
                index.apply(event_type(source=_SOURCE, seq=seq, keys=changed, tier=Tier.DRAM))
                seq += 1
    return CapacityPoint(capacity_blocks=capacity_blocks, hit_blocks=hits, total_blocks=total)


def hit_ratio_curve(
    requests: Iterable[Sequence[BlockKey]],
    make_policy: Callable[[], EvictionPolicy],
    *,
    capacities_blocks: Iterable[int],
) -> tuple[CapacityPoint, ...]:
    """`simulate_prefix_hits` at each capacity, each with a fresh policy.

    `requests` is replayed once per capacity: an iterable that can be read only once (a generator) is read into a
    list first, so every point replays all of it.

    Raises:
        InvalidRequestError: `requests` is no iterable, a request no sequence of keys (see `simulate_prefix_hits`).
        ConfigError: `capacities_blocks` is no iterable of integers >= 1, or `make_policy` is not callable or
            makes no eviction policy.
    """
    if not isinstance(requests, Sequence):  # a generator would be used up by the first capacity: read it once
        requests = list(require_iterable("requests", requests, error=InvalidRequestError))
    capacities = [
        require_int("capacities_blocks", capacity, minimum=1)
        for capacity in require_iterable("capacities_blocks", capacities_blocks)
    ]
    if not callable(make_policy):
        raise ConfigError(f"make_policy must be a callable returning a fresh policy, got {shown(make_policy)}")
    points = []
    for capacity in capacities:
        policy = make_policy()
        _require_policy("make_policy()", policy)  # named as the caller gave it, not as the replay's argument
        points.append(simulate_prefix_hits(requests, policy, capacity_blocks=capacity))
    return tuple(points)
