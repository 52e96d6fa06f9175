"""Tests of mooncake.cache.policy: examples, properties against the reference, and a state machine."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mooncake.cache.policy import LengthAwarePolicy, LfuPolicy, LruPolicy, SievePolicy
from mooncake.errors import BlockPinnedError, InvalidRequestError, MooncakeError, UnknownBlockError
from mooncake.types import BlockKey
from tests.cache.policies import ALL_POLICIES, POLICIES
from tests.reference.policy import ReferencePolicy
from tests.strategies import (
    POLICY_KEY_UNIVERSE,
    key_chains,
    policy_keys,
    policy_op_lists,
    policy_parents,
    policy_positions,
)

POLICY_CLASSES = pytest.mark.parametrize("policy_class", list(POLICIES.values()), ids=list(POLICIES))

K = BlockKey


def make_pair(kind: str, prefix_aware: bool) -> tuple[Any, ReferencePolicy]:
    policy = POLICIES[kind](prefix_aware=prefix_aware)
    reference = ReferencePolicy(kind, prefix_aware=prefix_aware)
    return policy, reference


def call(target: Any, op: tuple[Any, ...]) -> Any:
    name, *args = op
    if name == "access":
        key, parent, position = args
        return target.access(key, parent=parent, position=position)
    return getattr(target, name)(*args)


def apply_both(policy: Any, reference: ReferencePolicy, op: tuple[Any, ...]) -> Any:
    """Apply `op` to the policy and the reference; assert the same result or the same error."""
    try:
        expected = call(reference, op)
    except MooncakeError as error:
        with pytest.raises(type(error)):
            call(policy, op)
        return None
    actual = call(policy, op)
    assert actual == expected, f"{op}: library {actual!r}, reference {expected!r}"
    return actual


def drain(policy: Any) -> list[BlockKey]:
    """Evict until None; the victims in order."""
    victims = []
    while (victim := policy.evict()) is not None:
        victims.append(victim)
    return victims


def access_all(policy: Any, keys: list[int]) -> None:
    for key in keys:
        policy.access(K(key))


# Layer 1: examples ------------------------------------------------------------


def test_lru_evicts_least_recently_accessed_first() -> None:
    """LRU evicts in order of last access; a re-access moves a key to the back."""
    policy = LruPolicy()
    access_all(policy, [1, 2, 3, 1])
    assert drain(policy) == [2, 3, 1]


def test_lfu_evicts_fewest_uses_first_ties_least_recent() -> None:
    """LFU evicts the key with fewest accesses; among equals, the least recently accessed."""
    policy = LfuPolicy()
    access_all(policy, [1, 2, 3, 1, 3])
    assert drain(policy) == [2, 1, 3]


def test_lfu_counts_uses_since_insertion_only() -> None:
    """A key removed and re-inserted starts again from one use."""
    policy = LfuPolicy()
    access_all(policy, [1, 1, 1, 2, 2])
    policy.remove(K(1))
    access_all(policy, [1])
    assert drain(policy) == [1, 2]


def test_length_aware_prefers_later_positions_among_equal_uses() -> None:
    """LengthAware: fewest uses first; among equals the larger position; then least recent."""
    policy = LengthAwarePolicy()
    policy.access(K(1), position=0)
    policy.access(K(2), position=5)
    policy.access(K(3), position=2)
    policy.access(K(4), position=2)
    policy.access(K(5), position=9)
    policy.access(K(5))  # two uses: last despite the largest position
    assert drain(policy) == [2, 3, 4, 1, 5]


def test_length_aware_keeps_position_from_insertion() -> None:
    """A re-access's position is ignored; the position given at insertion ranks the key."""
    policy = LengthAwarePolicy()
    policy.access(K(1), position=0)
    policy.access(K(2), position=1)
    policy.access(K(1), position=9)
    policy.access(K(2), position=0)
    assert drain(policy) == [2, 1]


def test_sieve_sweeps_from_the_hand_clearing_visited_bits() -> None:
    """SIEVE: visited keys survive one pass of the hand, which rests after each victim."""
    policy = SievePolicy()
    access_all(policy, [1, 2, 3, 1])
    assert policy.evict() == 2  # 1 visited: bit cleared; 2 unvisited; the hand rests on 3
    access_all(policy, [4, 3])
    assert policy.evict() == 4  # 3 visited: cleared; 4 unvisited; the hand falls off the newest end
    assert policy.evict() == 1  # from the oldest again: 1's bit was cleared by the first sweep
    assert policy.evict() == 3
    assert policy.evict() is None


def test_sieve_remove_of_the_hand_moves_it_to_the_newer_neighbour() -> None:
    """Removing the key under SIEVE's hand leaves the hand on that key's newer neighbour."""
    policy = SievePolicy()
    access_all(policy, [1, 2, 3, 4, 1])
    assert policy.evict() == 2  # hand now on 3
    access_all(policy, [4, 1])
    policy.remove(K(3))  # hand moves to 4
    assert policy.evict() == 4  # 4 visited: cleared; 1 visited: cleared; 4 unvisited
    policy.check_invariants()


def test_sieve_steps_over_protected_keys_without_clearing_their_bit() -> None:
    """SIEVE's hand skips a pinned key and leaves its visited bit set."""
    policy = SievePolicy()
    access_all(policy, [1, 2, 1])
    policy.pin(K(1))
    assert policy.evict() == 2
    policy.unpin(K(1))
    access_all(policy, [3])
    assert policy.evict() == 3  # 1 still visited: its bit is cleared now, 3 goes
    assert policy.evict() == 1


def test_sieve_failed_evict_leaves_hand_in_place() -> None:
    """An evict() that returns None does not move SIEVE's hand: the oldest unvisited key still goes first."""
    policy = SievePolicy()
    access_all(policy, [1, 2])
    policy.pin(K(1))
    policy.pin(K(2))
    assert policy.evict() is None
    policy.unpin(K(1))
    policy.unpin(K(2))
    assert policy.evict() == 1  # the library evicts 2: its hand moved from 1 to 2 on the failed evict


@POLICY_CLASSES
def test_evict_on_empty_policy_returns_none(policy_class: Any) -> None:
    """evict() on an empty policy returns None."""
    policy = policy_class()
    assert policy.evict() is None
    assert len(policy) == 0


@POLICY_CLASSES
def test_evict_forgets_the_victim(policy_class: Any) -> None:
    """evict() returns a cached key and drops it."""
    policy = policy_class()
    access_all(policy, [7])
    assert policy.evict() == 7
    assert K(7) not in policy
    assert len(policy) == 0


@POLICY_CLASSES
def test_remove_unknown_raises_unknown_block_error(policy_class: Any) -> None:
    """remove() of a key never cached, or already dropped, raises UnknownBlockError (a KeyError)."""
    policy = policy_class()
    with pytest.raises(UnknownBlockError):
        policy.remove(K(1))
    access_all(policy, [1])
    policy.remove(K(1))
    with pytest.raises(KeyError):
        policy.remove(K(1))


@POLICY_CLASSES
def test_remove_pinned_raises_until_unpinned(policy_class: Any) -> None:
    """remove() of a pinned key raises BlockPinnedError and keeps it; after unpin it succeeds."""
    policy = policy_class()
    access_all(policy, [1])
    policy.pin(K(1))
    with pytest.raises(BlockPinnedError):
        policy.remove(K(1))
    assert K(1) in policy
    policy.unpin(K(1))
    policy.remove(K(1))
    assert K(1) not in policy
    policy.check_invariants()


@POLICY_CLASSES
def test_pin_unknown_raises(policy_class: Any) -> None:
    """pin() of a key not cached raises UnknownBlockError."""
    policy = policy_class()
    with pytest.raises(UnknownBlockError):
        policy.pin(K(1))


@POLICY_CLASSES
def test_unpin_of_unpinned_key_raises(policy_class: Any) -> None:
    """unpin() of a cached but unpinned key, or an unknown key, raises UnknownBlockError."""
    policy = policy_class()
    access_all(policy, [1])
    with pytest.raises(UnknownBlockError):
        policy.unpin(K(1))
    with pytest.raises(UnknownBlockError):
        policy.unpin(K(2))


@POLICY_CLASSES
def test_pins_are_reference_counted(policy_class: Any) -> None:
    """A key pinned twice stays protected after one unpin and becomes evictable after the second."""
    policy = policy_class()
    access_all(policy, [1])
    policy.pin(K(1))
    policy.pin(K(1))
    policy.unpin(K(1))
    assert policy.is_pinned(K(1))
    assert policy.evict() is None
    policy.unpin(K(1))
    assert not policy.is_pinned(K(1))
    assert policy.evict() == 1
    with pytest.raises(UnknownBlockError):
        policy.unpin(K(1))


@POLICY_CLASSES
def test_pinned_keys_are_skipped_not_lost(policy_class: Any) -> None:
    """evict() passes over pinned keys, returns None when only pinned keys remain, and keeps them."""
    policy = policy_class()
    access_all(policy, [1, 2, 3])
    policy.pin(K(1))
    policy.pin(K(3))
    assert drain(policy) == [2]
    assert len(policy) == 2 and K(1) in policy and K(3) in policy
    policy.unpin(K(3))
    assert drain(policy) == [3]
    policy.check_invariants()


@POLICY_CLASSES
def test_prefix_aware_evicts_leaf_first(policy_class: Any) -> None:
    """Prefix-aware: a chain is evicted from its tail even when the head is the better victim."""
    policy = policy_class()
    policy.access(K(1), position=0)
    policy.access(K(2), parent=K(1), position=1)
    policy.access(K(3), parent=K(2), position=2)
    policy.access(K(2))
    policy.access(K(3))  # re-accesses make 1 the first choice of every ranking when flat
    assert not policy.is_candidate(K(1)) and not policy.is_candidate(K(2))
    assert drain(policy) == [3, 2, 1]


@POLICY_CLASSES
def test_flat_mode_ignores_parents(policy_class: Any) -> None:
    """prefix_aware=False ranks keys alone: a parent may go before its cached child."""
    policy = policy_class(prefix_aware=False)
    policy.access(K(1), position=0)
    policy.access(K(2), parent=K(1), position=1)
    policy.access(K(3), parent=K(2), position=2)
    policy.access(K(2))
    policy.access(K(3))
    assert policy.is_candidate(K(1))
    assert policy.evict() == 1


@POLICY_CLASSES
def test_parent_is_recorded_at_insertion_only(policy_class: Any) -> None:
    """A parent given on re-access is ignored: the named parent stays a candidate."""
    policy = policy_class()
    access_all(policy, [1, 2])
    policy.access(K(2), parent=K(1))
    assert policy.is_candidate(K(1))
    policy.check_invariants()


@POLICY_CLASSES
def test_key_is_never_its_own_parent(policy_class: Any) -> None:
    """access(k, parent=k) records no link, so k stays evictable."""
    policy = policy_class()
    policy.access(K(1), parent=K(1))
    assert policy.evict() == 1


@POLICY_CLASSES
def test_children_that_outlive_their_parent_protect_it_on_reinsertion(policy_class: Any) -> None:
    """A parent removed while its child is cached, then re-inserted, is protected until the child goes."""
    policy = policy_class()
    policy.access(K(1))
    policy.access(K(2), parent=K(1))
    policy.remove(K(1))  # the caller may drop a parent; the child's link stays
    policy.access(K(1))
    assert not policy.is_candidate(K(1))
    policy.check_invariants()
    assert drain(policy) == [2, 1]


@POLICY_CLASSES
def test_parent_cycle_protects_both_keys(policy_class: Any) -> None:
    """Keys recorded as each other's parent are never candidates while both are cached."""
    policy = policy_class()
    policy.access(K(1), parent=K(2))
    policy.access(K(2), parent=K(1))
    assert policy.evict() is None
    policy.remove(K(2))
    assert policy.evict() == 1
    policy.check_invariants()


@POLICY_CLASSES
def test_check_invariants_detects_corrupt_child_counts(policy_class: Any) -> None:
    """check_invariants() raises when the child counts disagree with the parent links."""
    policy = policy_class()
    policy.access(K(1))
    policy.access(K(2), parent=K(1))
    policy.check_invariants()
    policy._children[K(1)] = 2  # white box: the checker must notice a miscount
    with pytest.raises(AssertionError):
        policy.check_invariants()


@pytest.mark.parametrize(("kind", "prefix_aware"), ALL_POLICIES)
def test_long_run_through_heap_compaction_matches_reference(kind: str, prefix_aware: bool) -> None:
    """Thousands of re-accesses (forcing heap rebuilds) keep the library in step; cold keys stay reachable."""
    policy, reference = make_pair(kind, prefix_aware)
    for cold in range(100, 105):  # accessed once, before any rebuild, never again
        apply_both(policy, reference, ("access", K(cold), None, 0))
    for step in range(3000):
        key = K(step % 7)
        apply_both(policy, reference, ("access", key, K(key - 1) if key else None, key))
        if step % 400 == 3:
            apply_both(policy, reference, ("pin", K(step % 7)))
        if step % 400 == 200:
            apply_both(policy, reference, ("unpin", K((step - 197) % 7)))
    for key, count in list(reference.pins.items()):
        for _ in range(count):
            apply_both(policy, reference, ("unpin", key))
    policy.check_invariants()
    assert len(policy) == 12
    assert drain(policy) == drain(reference)
    assert len(policy) == len(reference) == 0


# Layer 2: properties against the reference -----------------------------------


@pytest.mark.parametrize(("kind", "prefix_aware"), ALL_POLICIES)
@given(ops=policy_op_lists(max_size=60))
def test_policy_matches_reference(kind: str, prefix_aware: bool, ops: list[tuple[Any, ...]]) -> None:
    """Every operation returns (or raises) what the reference does, and the cached set agrees."""
    policy, reference = make_pair(kind, prefix_aware)
    for op in ops:
        apply_both(policy, reference, op)
        assert len(policy) == len(reference)
    assert sorted(k for k in POLICY_KEY_UNIVERSE if k in policy) == sorted(reference.keys)
    policy.check_invariants()


@pytest.mark.parametrize(("kind", "prefix_aware"), ALL_POLICIES)
@given(before=policy_op_lists(max_size=40))
def test_evict_with_every_key_pinned_disturbs_nothing(
    kind: str, prefix_aware: bool, before: list[tuple[Any, ...]]
) -> None:
    """A failed evict (every cached key pinned), then unpinning, leaves the victims the reference chooses."""
    policy, reference = make_pair(kind, prefix_aware)
    for op in before:
        apply_both(policy, reference, op)
    cached = list(reference.keys)
    for key in cached:
        apply_both(policy, reference, ("pin", key))
    assert policy.evict() is reference.evict() is None
    for key in cached:
        apply_both(policy, reference, ("unpin", key))
    assert drain(policy) == drain(reference)
    policy.check_invariants()


@pytest.mark.parametrize(("kind", "prefix_aware"), ALL_POLICIES)
@given(ops=policy_op_lists(max_size=60))
def test_pinned_or_parent_keys_are_never_evicted(kind: str, prefix_aware: bool, ops: list[tuple[Any, ...]]) -> None:
    """A victim is never pinned (by the policy's own is_pinned) nor, prefix-aware, a recorded parent of a cached key."""
    policy, reference = make_pair(kind, prefix_aware)
    for op in ops:
        if op[0] == "evict":
            pinned = {k for k in POLICY_KEY_UNIVERSE if policy.is_pinned(k)}
            parents = {reference.parent[c] for c in reference.keys if c in reference.parent} if prefix_aware else set()
            victim = policy.evict()
            assert victim not in pinned
            assert victim not in parents
            if victim is not None:
                reference.remove(victim)
            continue
        try:
            call(reference, op)
        except MooncakeError:
            continue
        call(policy, op)


@pytest.mark.parametrize(("kind", "prefix_aware"), ALL_POLICIES)
@given(ops=policy_op_lists(max_size=60))
def test_evict_returns_none_only_without_candidates(kind: str, prefix_aware: bool, ops: list[tuple[Any, ...]]) -> None:
    """evict() returns None exactly when the reference sees no candidate, and a cached key otherwise."""
    policy, reference = make_pair(kind, prefix_aware)
    for op in ops:
        if op[0] == "evict":
            has_candidate = bool(reference.candidates())
            victim = policy.evict()
            assert (victim is not None) == has_candidate
            if victim is not None:
                reference.remove(victim)  # raises if the victim is not cached or is pinned
            continue
        apply_both(policy, reference, op)


@pytest.mark.parametrize(("kind", "prefix_aware"), ALL_POLICIES)
@given(
    requests=st.lists(key_chains(max_size=6), max_size=12),
    capacity=st.integers(min_value=1, max_value=6),
    num_pinned=st.integers(min_value=0, max_value=6),
)
def test_capacity_driver_never_exceeds_capacity(
    kind: str, prefix_aware: bool, requests: list[tuple[BlockKey, ...]], capacity: int, num_pinned: int
) -> None:
    """Evicting until below capacity before each insertion (skipping it when evict() is None) bounds the size."""
    policy = POLICIES[kind](prefix_aware=prefix_aware)
    for keys in requests:
        held: list[BlockKey] = []  # pinned while "the request runs", as an engine would
        parent = None
        for position, key in enumerate(keys):
            if key not in policy:
                while len(policy) >= capacity:
                    victim = policy.evict()
                    if victim is None:
                        break
                    assert victim not in held
                if len(policy) >= capacity:
                    parent = key
                    continue
            policy.access(key, parent=parent, position=position)
            parent = key
            if len(held) < num_pinned:
                policy.pin(key)
                held.append(key)
            assert len(policy) <= capacity
        for key in held:
            policy.unpin(key)
        policy.check_invariants()
    assert len(policy) <= capacity


# Layer 3: a state machine per policy -----------------------------------------


class PolicyMachine(RuleBasedStateMachine):
    """Drives a library policy and the reference in lockstep."""

    kind: ClassVar[str]
    prefix_aware: ClassVar[bool]

    def __init__(self) -> None:
        super().__init__()
        self.policy, self.reference = make_pair(self.kind, self.prefix_aware)

    @rule(key=policy_keys, parent=policy_parents, position=policy_positions)
    def access(self, key: BlockKey, parent: BlockKey | None, position: int) -> None:
        apply_both(self.policy, self.reference, ("access", key, parent, position))

    @rule()
    def evict(self) -> None:
        apply_both(self.policy, self.reference, ("evict",))

    @rule()
    def evict_unpinned(self) -> None:
        apply_both(self.policy, self.reference, ("evict_unpinned",))

    @rule(key=policy_keys)
    def pin(self, key: BlockKey) -> None:
        apply_both(self.policy, self.reference, ("pin", key))

    @rule()
    def pin_every_cached_key(self) -> None:
        for key in list(self.reference.keys):
            apply_both(self.policy, self.reference, ("pin", key))

    @rule(key=policy_keys)
    def unpin(self, key: BlockKey) -> None:
        apply_both(self.policy, self.reference, ("unpin", key))

    @rule(key=policy_keys)
    def remove(self, key: BlockKey) -> None:
        apply_both(self.policy, self.reference, ("remove", key))

    @invariant()
    def same_contents(self) -> None:
        assert len(self.policy) == len(self.reference)
        for key in POLICY_KEY_UNIVERSE:
            assert (key in self.policy) == (key in self.reference), key

    @invariant()
    def same_pins_and_candidates(self) -> None:
        for key in POLICY_KEY_UNIVERSE:
            assert self.policy.is_pinned(key) == (key in self.reference.pins), key
            assert self.policy.is_candidate(key) == self.reference.is_candidate(key), key

    @invariant()
    def bookkeeping_consistent(self) -> None:
        self.policy.check_invariants()


def _machine(kind: str, prefix_aware: bool) -> type[PolicyMachine]:
    name = f"{POLICIES[kind].__name__}{'Prefix' if prefix_aware else 'Flat'}Machine"
    return type(name, (PolicyMachine,), {"kind": kind, "prefix_aware": prefix_aware})


TestLruPrefixMachine = _machine("lru", True).TestCase
TestLruFlatMachine = _machine("lru", False).TestCase
TestLfuPrefixMachine = _machine("lfu", True).TestCase
TestLfuFlatMachine = _machine("lfu", False).TestCase
TestLengthAwarePrefixMachine = _machine("length_aware", True).TestCase
TestLengthAwareFlatMachine = _machine("length_aware", False).TestCase
TestSievePrefixMachine = _machine("sieve", True).TestCase
TestSieveFlatMachine = _machine("sieve", False).TestCase


def test_length_aware_ties_go_to_the_least_recently_accessed_not_the_first_inserted() -> None:
    """Equal uses and equal position: the tie goes by last access, which a re-access refreshes."""
    policy = LengthAwarePolicy()
    policy.access(K(1), position=3)
    policy.access(K(2), position=3)
    policy.access(K(2))  # both now two uses, position 3; 1 used last
    policy.access(K(1))
    assert policy.evict() == K(2)
    assert policy.evict() == K(1)


@pytest.mark.parametrize("kind", ["lru", "lfu", "length_aware"])
def test_every_candidate_keeps_an_entry_across_a_heap_rebuild(kind: str) -> None:
    """Two keys used in turn push a heap entry at every access until the heap is rebuilt; the bookkeeping must
    hold at the very access that rebuilds it (the entry of the block used just before included)."""
    policy = POLICIES[kind](prefix_aware=False)
    for step in range(2500):  # past 4 * 2 + 1024 entries: at least two rebuilds
        policy.access(K(step % 2), position=0)
        policy.check_invariants()


@pytest.mark.parametrize("policy_class", [LfuPolicy, LengthAwarePolicy], ids=["lfu", "length_aware"])
@pytest.mark.parametrize("position", [None, "x", -1, 1.5, True])
def test_a_policy_ranking_by_position_refuses_one_that_is_no_index(policy_class: Any, position: Any) -> None:
    """A new block's position is part of an LFU or length-aware rank: None (which the rank read as a re-access of
    a block it had never seen: a bare KeyError), a string (a bare TypeError at the next eviction), a negative, a
    float or a bool is an InvalidRequestError naming it, and nothing is inserted."""
    policy = policy_class()
    policy.access(K(1), position=0)
    with pytest.raises(InvalidRequestError, match="position"):
        policy.access(K(2), parent=K(1), position=position)
    assert K(2) not in policy and len(policy) == 1
    policy.check_invariants()
    assert policy.evict() == K(1)


@POLICY_CLASSES
def test_a_numpy_position_is_the_int_it_equals(policy_class: Any) -> None:
    """A position read from a numpy array ranks a block as the same int does (the evictions agree)."""
    numpy_positions, int_positions = policy_class(), policy_class()
    for key, position in [(1, 3), (2, 1), (3, 2)]:
        numpy_positions.access(K(key), position=np.int64(position))
        int_positions.access(K(key), position=position)
    assert [numpy_positions.evict() for _ in range(3)] == [int_positions.evict() for _ in range(3)]
