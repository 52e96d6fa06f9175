"""Holds (a block's successors cached where the policy does not see them) and `evict_unpinned` (the policy's
order, prefix protection aside), for every policy."""

from __future__ import annotations

import pytest

from mooncake.errors import InvalidRequestError, UnknownBlockError
from mooncake.types import BlockKey
from tests.cache.policies import ALL_POLICIES, POLICIES

K = BlockKey


@pytest.mark.parametrize(("kind", "prefix_aware"), ALL_POLICIES)
def test_a_held_block_is_protected_as_a_parent_is(kind: str, prefix_aware: bool) -> None:
    """Prefix-aware, a held block is no candidate until its last hold goes (or it leaves); ranking blocks alone,
    holds change nothing."""
    policy = POLICIES[kind](prefix_aware=prefix_aware)
    for key in (1, 2):
        policy.access(K(key))
    policy.hold(K(1), 2)
    assert policy.num_holds(K(1)) == 2
    policy.check_invariants()
    assert policy.evict() == (K(2) if prefix_aware else K(1))
    if not prefix_aware:
        return
    assert policy.evict() is None
    policy.release(K(1))
    assert policy.evict() is None
    policy.release(K(1))
    policy.check_invariants()
    assert policy.evict() == K(1)
    policy.check_invariants()


@pytest.mark.parametrize(("kind", "prefix_aware"), ALL_POLICIES)
def test_holds_end_when_the_block_leaves(kind: str, prefix_aware: bool) -> None:
    """Removing a held block ends its holds: inserted again, it is a candidate (a hold is no pin, and unlike the
    links of cached children it is not kept for a block that left)."""
    policy = POLICIES[kind](prefix_aware=prefix_aware)
    policy.access(K(1))
    policy.hold(K(1))
    policy.remove(K(1))
    assert policy.num_holds(K(1)) == 0
    policy.check_invariants()
    policy.access(K(1))
    assert policy.evict() == K(1)
    with pytest.raises(UnknownBlockError):
        policy.hold(K(1))
    policy.access(K(1))
    with pytest.raises(UnknownBlockError):
        policy.release(K(1))
    with pytest.raises(InvalidRequestError):
        policy.hold(K(1), 0)


@pytest.mark.parametrize(("kind", "prefix_aware"), ALL_POLICIES)
def test_evict_unpinned_ignores_prefix_protection_but_never_takes_a_pinned_block(kind: str, prefix_aware: bool) -> None:
    """Chain 5 → 9 → 2 with 2 pinned and 5 used again: `evict` finds nothing (prefix-aware), `evict_unpinned` takes
    the policy's first unpinned block, then the next, then nothing. Every policy ranks 9 first (least recent, fewest
    uses, unvisited by SIEVE's hand), so a choice by key id (5) or by insertion order (5) is caught."""
    policy = POLICIES[kind](prefix_aware=prefix_aware)
    policy.access(K(5))
    policy.access(K(9), parent=K(5), position=1)
    policy.access(K(2), parent=K(9), position=2)
    policy.access(K(5))
    policy.pin(K(2))
    if prefix_aware:
        assert policy.evict() is None
    assert [policy.evict_unpinned(), policy.evict_unpinned()] == [K(9), K(5)]
    assert policy.evict_unpinned() is None
    policy.check_invariants()
    policy.unpin(K(2))
    assert policy.evict() == K(2)
    policy.check_invariants()
