"""Tests for `mooncake.cache.index.BlockIndex`.

Three layers: example tests for the edge contracts (empty index, tiers, event
sequencing, epochs, removal, many instances and keys, ties); properties against the
brute-force model in `tests/reference/index.py`; and a state machine that drives
simulated caches (with lost and redelivered events, restarts, resyncs and
snapshot restores) against that model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mooncake.cache._compiled import compiled_path, numba_available
from mooncake.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent, SequenceGap
from mooncake.cache.index import BlockIndex, Holder, key_array
from mooncake.errors import ConfigError, InvalidRequestError, MooncakeError, SequenceGapError
from mooncake.types import BlockKey, InstanceId, Tier
from tests.reference.index import ReferenceIndex
from tests.strategies import block_keys, cache_event_sequences, instance_ids, tiers

A, B, C = InstanceId("node-a"), InstanceId("node-b"), InstanceId("node-c")
K = [BlockKey(k) for k in range(100)]
ALL_KEYS = [BlockKey(k) for k in range(31)]  # the universe of `tests.strategies.block_keys`
MANY_INSTANCE_IDS = [InstanceId(f"node-{i:02d}") for i in range(40)]
# One sequence object asked about every time, as the Conductor does: `prefix_lengths` keeps its slot lookup.
PROBED = (*(InstanceId(f"node-{i}") for i in range(5)), A, B, C, InstanceId("never-seen"))


def stored(source: InstanceId, seq: int, keys: Iterable[int], tier: Tier = Tier.VRAM, epoch: int = 0) -> BlockStored:
    return BlockStored(source=source, seq=seq, keys=tuple(BlockKey(k) for k in keys), tier=tier, epoch=epoch)


def removed(source: InstanceId, seq: int, keys: Iterable[int], tier: Tier = Tier.VRAM, epoch: int = 0) -> BlockRemoved:
    return BlockRemoved(source=source, seq=seq, keys=tuple(BlockKey(k) for k in keys), tier=tier, epoch=epoch)


def cleared(source: InstanceId, seq: int, epoch: int = 0) -> AllBlocksCleared:
    return AllBlocksCleared(source=source, seq=seq, epoch=epoch)


def apply(index: BlockIndex, event: CacheEvent) -> SequenceGap | None:
    """Apply `event` leniently (a gap is returned) and check the index's invariants afterwards."""
    result = index.apply(event, strict=False)
    index.check_invariants()
    return result


def build(events: Iterable[CacheEvent]) -> BlockIndex:
    """An index fed `events`, each of which must apply without a gap."""
    index = BlockIndex()
    for event in events:
        assert apply(index, event) is None, event
    return index


def holdings_of(index: BlockIndex, instance_id: InstanceId) -> dict[Tier, frozenset[BlockKey]]:
    """Non-empty tiers of `instance_id` in `index` → keys, read from a snapshot."""
    for source in index.snapshot().sources:
        if source.source == instance_id:
            return {tier: frozenset(keys) for tier, keys in source.keys_by_tier}
    return {}


def assert_match_equal(index: BlockIndex, reference: ReferenceIndex, keys: Sequence[BlockKey]) -> None:
    got = index.match(keys)
    want = reference.match(keys)
    assert dict(got.lengths) == want.lengths, keys
    assert (got.best_instance, got.best_length) == (want.best_instance, want.best_length), keys
    for instance in reference.instances:
        assert got.length(instance) == want.lengths.get(instance, 0)
    assert index.prefix_lengths(keys, PROBED).tolist() == [want.lengths.get(i, 0) for i in PROBED], keys


def assert_same_state(index: BlockIndex, reference: ReferenceIndex, keys: Iterable[BlockKey] = ALL_KEYS) -> None:
    index.check_invariants()
    assert len(index) == len(reference)
    assert index.instances == reference.instances
    assert index.stale_sources == reference.stale_sources
    for instance in {*reference.instances, *index.instances}:
        assert index.num_blocks(instance) == reference.num_blocks(instance), instance
    for key in keys:
        assert index.holders(key) == reference.holders(key), key
        assert (key in index) == bool(reference.holders(key)), key


def queries(events: Iterable[CacheEvent]) -> list[tuple[BlockKey, ...]]:
    """Prefix-shaped key lists: each stored chain, its halves, and its extension by the universe."""
    out: list[tuple[BlockKey, ...]] = [(), tuple(ALL_KEYS)]
    for event in events:
        if isinstance(event, BlockStored) and event.keys:
            out += [event.keys, event.keys[: len(event.keys) // 2 + 1], event.keys + tuple(ALL_KEYS)]
    return out


# ---------------------------------------------------------------------------- examples: queries


def test_empty_index_matches_nothing() -> None:
    """An empty index: no best instance, length 0, no lengths, no holders, no blocks."""
    index = BlockIndex()
    for keys in ([], [K[1]], [K[1], K[2]]):
        result = index.match(keys)
        assert result.best_instance is None
        assert result.best_length == 0
        assert dict(result.lengths) == {}
        assert result.length(A) == 0
    assert len(index) == 0
    assert K[1] not in index
    assert index.holders(K[1]) == ()
    assert index.num_blocks(A) == 0
    assert index.instances == ()
    assert index.stale_sources == ()
    index.check_invariants()


def test_match_of_no_keys_is_empty_on_a_populated_index() -> None:
    """Matching an empty key list finds nobody even when blocks are held."""
    index = build([stored(A, 0, [1, 2])])
    result = index.match([])
    assert (result.best_instance, result.best_length, dict(result.lengths)) == (None, 0, {})


def test_match_counts_only_the_contiguous_leading_prefix() -> None:
    """Keys held after a miss do not count; a missing first key means no match at all."""
    index = build([stored(A, 0, [1, 2, 4, 5]), stored(B, 0, [2, 3])])
    result = index.match([K[1], K[2], K[3], K[4], K[5]])
    assert dict(result.lengths) == {A: 2}
    assert (result.best_instance, result.best_length) == (A, 2)
    assert dict(index.match([K[9], K[1], K[2]]).lengths) == {}
    assert dict(index.match([K[2], K[3], K[4]]).lengths) == {A: 1, B: 2}


def test_match_accepts_any_iterable_of_keys() -> None:
    """`match` takes a one-shot iterator as well as a list."""
    index = build([stored(A, 0, [1, 2, 3])])
    result = index.match(iter([K[1], K[2], K[7]]))
    assert (dict(result.lengths), result.best_instance, result.best_length) == ({A: 2}, A, 2)


def test_match_accepts_integer_key_arrays() -> None:
    """`match` takes a uint64 or int64 numpy array of keys and answers as for the same list."""
    index = build([stored(A, 0, [1, 2, 3]), stored(B, 0, [1, 2**64 - 1])])
    want = index.match([K[1], K[2], K[7]])
    assert dict(want.lengths) == {A: 2, B: 1}
    assert index.match(np.array([1, 2, 7], dtype=np.uint64)) == want
    assert index.match(np.array([1, 2, 7], dtype=np.int64)) == want
    assert dict(index.match(np.array([1, 2**64 - 1], dtype=np.uint64)).lengths) == {A: 1, B: 2}
    assert dict(index.match(np.array([], dtype=np.uint64)).lengths) == {}


@given(st.lists(st.integers(0, 2**64 - 1) | st.integers(2**64, 2**256 - 1), max_size=16))
def test_key_array_of_vouched_integers_is_the_checked_one(keys: list[int]) -> None:
    """`key_array(..., integers=True)` (a Request's keys, already non-negative ints) gives the same
    array as the checked conversion, wide keys folded alike."""
    assert key_array(tuple(keys), integers=True).tolist() == key_array(keys).tolist()


def test_best_instance_ties_break_to_the_smallest_id() -> None:
    """Equal prefix lengths: the smallest instance id wins, whatever the arrival order."""
    index = build([stored(C, 0, [1, 2]), stored(B, 0, [1, 2, 3]), stored(A, 0, [1, 2, 3])])
    result = index.match([K[1], K[2], K[3]])
    assert dict(result.lengths) == {A: 3, B: 3, C: 2}
    assert (result.best_instance, result.best_length) == (A, 3)
    assert apply(index, removed(A, 1, [3])) is None
    result = index.match([K[1], K[2], K[3]])
    assert (result.best_instance, result.best_length) == (B, 3)
    result = index.match([K[1], K[2]])
    assert (result.best_instance, result.best_length) == (A, 2)


def test_longer_prefix_beats_smaller_id() -> None:
    """A longer prefix wins over a smaller id."""
    index = build([stored(A, 0, [1]), stored(B, 0, [1, 2])])
    assert (index.match([K[1], K[2]]).best_instance, index.match([K[1], K[2]]).best_length) == (B, 2)


def test_num_blocks_counts_keys_not_tier_copies() -> None:
    """`num_blocks` counts each key once however many tiers hold it, per instance."""
    index = build(
        [
            stored(A, 0, [1, 2, 3], Tier.VRAM),
            stored(A, 1, [2, 3, 4], Tier.SSD),
            stored(B, 0, [1], Tier.DRAM),
        ]
    )
    assert index.num_blocks(A) == 4
    assert index.num_blocks(B) == 1
    assert index.num_blocks(C) == 0
    assert len(index) == 4


# ---------------------------------------------------------------------------- examples: events and tiers


def test_stored_is_idempotent() -> None:
    """Storing a key already held in that tier changes nothing."""
    index = build([stored(A, 0, [1, 2]), stored(A, 1, [2, 1]), stored(A, 2, [1, 1])])
    assert index.num_blocks(A) == 2
    assert len(index) == 2
    assert index.holders(K[1]) == (Holder(A, Tier.VRAM),)
    assert dict(index.match([K[1], K[2]]).lengths) == {A: 2}


def test_removed_is_idempotent_and_ignores_unheld_keys() -> None:
    """Removing a key twice, or one never held (or held in another tier), changes nothing more."""
    index = build([stored(A, 0, [1, 2]), stored(A, 1, [3], Tier.SSD)])
    assert apply(index, removed(A, 2, [1, 9])) is None
    assert apply(index, removed(A, 3, [1])) is None
    assert apply(index, removed(A, 4, [3], Tier.VRAM)) is None  # held in SSD only
    assert K[1] not in index
    assert K[9] not in index
    assert index.holders(K[3]) == (Holder(A, Tier.SSD),)
    assert index.num_blocks(A) == 2
    assert len(index) == 2


def test_key_in_two_tiers_of_one_instance() -> None:
    """DRAM + SSD copies count once for match; holders lists both; one removal keeps the key held."""
    index = build([stored(A, 0, [1], Tier.DRAM), stored(A, 1, [1, 2], Tier.SSD)])
    assert index.holders(K[1]) == (Holder(A, Tier.DRAM), Holder(A, Tier.SSD))
    assert dict(index.match([K[1], K[2]]).lengths) == {A: 2}
    assert index.num_blocks(A) == 2

    assert apply(index, removed(A, 2, [1], Tier.DRAM)) is None
    assert index.holders(K[1]) == (Holder(A, Tier.SSD),)
    assert K[1] in index
    assert dict(index.match([K[1], K[2]]).lengths) == {A: 2}
    assert index.num_blocks(A) == 2

    assert apply(index, removed(A, 3, [1], Tier.SSD)) is None
    assert index.holders(K[1]) == ()
    assert K[1] not in index
    assert dict(index.match([K[1], K[2]]).lengths) == {}
    assert index.num_blocks(A) == 1
    assert len(index) == 1


def test_holders_are_sorted_by_tier_then_instance() -> None:
    """`holders` orders by tier (fastest first), then by instance id."""
    index = build(
        [
            stored(C, 0, [1], Tier.SSD),
            stored(B, 0, [1], Tier.VRAM),
            stored(C, 1, [1], Tier.VRAM),
            stored(A, 0, [1], Tier.SSD),
            stored(B, 1, [1], Tier.DRAM),
        ]
    )
    assert index.holders(K[1]) == (
        Holder(B, Tier.VRAM),
        Holder(C, Tier.VRAM),
        Holder(B, Tier.DRAM),
        Holder(A, Tier.SSD),
        Holder(C, Tier.SSD),
    )


def test_all_blocks_cleared_drops_every_tier_of_one_source_only() -> None:
    """AllBlocksCleared empties all tiers of its source; other sources keep their blocks."""
    index = build(
        [
            stored(A, 0, [1, 2], Tier.VRAM),
            stored(A, 1, [2, 3], Tier.SSD),
            stored(B, 0, [2, 5], Tier.DRAM),
        ]
    )
    assert apply(index, cleared(A, 2)) is None
    assert index.num_blocks(A) == 0
    assert index.num_blocks(B) == 2
    assert index.holders(K[2]) == (Holder(B, Tier.DRAM),)
    assert K[1] not in index
    assert K[3] not in index
    assert len(index) == 2
    assert index.instances == (A, B)  # a cleared source is still known
    assert apply(index, stored(A, 3, [1])) is None  # and its sequence goes on
    assert index.holders(K[1]) == (Holder(A, Tier.VRAM),)


# ---------------------------------------------------------------------------- examples: sequencing


def test_first_event_of_a_source_must_have_seq_zero() -> None:
    """An unknown source starting past seq 0 is a gap: not applied, and the source is stale."""
    index = BlockIndex()
    gap = apply(index, stored(A, 3, [1], epoch=2))
    assert gap == SequenceGap(source=A, expected_epoch=2, expected_seq=0, received_epoch=2, received_seq=3)
    assert K[1] not in index
    assert index.num_blocks(A) == 0
    assert index.stale_sources == (A,)
    # Even its seq 0 arriving late is refused until a resync.
    assert isinstance(apply(index, stored(A, 0, [1], epoch=2)), SequenceGap)
    assert K[1] not in index


def test_duplicate_and_older_seq_are_ignored() -> None:
    """Redelivering an applied event (same or older seq) returns None and is not applied again."""
    index = build([stored(A, 0, [1]), stored(A, 1, [2]), removed(A, 2, [1]), removed(A, 3, [2])])
    assert apply(index, stored(A, 3, [7])) is None  # same seq, other content: still ignored
    assert apply(index, stored(A, 0, [1])) is None
    assert apply(index, stored(A, 1, [2])) is None
    assert len(index) == 0
    assert index.stale_sources == ()
    assert apply(index, stored(A, 4, [5])) is None  # the sequence continues from 3
    assert index.holders(K[5]) == (Holder(A, Tier.VRAM),)


def test_a_gap_raises_by_default_naming_the_source_and_both_seqs() -> None:
    """Strict is the default: a lost event is a typed error, not a value to drop; the state is the lenient one."""
    index = build([stored(A, 0, [1]), stored(A, 1, [2])])
    with pytest.raises(
        SequenceGapError, match=r"node-a: expected seq 2 of epoch 0, received seq 5 of epoch 0"
    ) as raised:
        index.apply(stored(A, 5, [4]))
    assert isinstance(raised.value, MooncakeError)
    assert raised.value.gap == SequenceGap(source=A, expected_epoch=0, expected_seq=2, received_epoch=0, received_seq=5)
    assert "resync" in str(raised.value)
    assert K[4] not in index
    assert index.stale_sources == (A,)
    # Stale until resync, strictly too: the next event in order is refused, and the error says why.
    with pytest.raises(SequenceGapError, match=r"node-a are refused since an earlier gap .*resync"):
        index.apply(stored(A, 2, [3]))
    index.resync(A, {Tier.DRAM: [K[1]]}, epoch=0, seq=4)
    assert index.apply(stored(A, 5, [4])) is None
    index.check_invariants()


@pytest.mark.parametrize("source", [5, "", None])
def test_an_event_names_its_source_by_instance_id(source: object) -> None:
    """Sources are instance ids (the index sorts and keys them): anything else is refused when the event is made."""
    for make in (
        lambda: BlockStored(source=source, seq=0, keys=[1], tier=Tier.DRAM),  # type: ignore[arg-type]
        lambda: AllBlocksCleared(source=source, seq=0),  # type: ignore[arg-type]
    ):
        with pytest.raises(MooncakeError, match=f"source must be a non-empty instance id string, got {source!r}"):
            make()


def test_apply_takes_cache_events_only() -> None:
    """Anything but a cache event is an InvalidRequestError naming it, not an AttributeError from inside."""
    index = BlockIndex()
    with pytest.raises(MooncakeError, match=r"apply takes a cache event .*got 'x'"):
        index.apply("x")  # type: ignore[arg-type]
    assert len(index) == 0 and index.instances == ()


def test_an_event_tier_is_a_tier_its_value_or_its_name() -> None:
    """`Tier.DRAM`, 1 and "DRAM" are the same tier; another value or name is an error listing the tiers."""
    made = [BlockRemoved(source=A, seq=0, keys=[1], tier=tier).tier for tier in (Tier.DRAM, 1, "DRAM")]
    assert made == [Tier.DRAM] * 3
    for bad in ("dram", 7, None):
        with pytest.raises(MooncakeError, match="tier must be one of VRAM, DRAM, SSD"):
            BlockStored(source=A, seq=0, keys=[1], tier=bad)  # type: ignore[arg-type]


def test_seq_jump_is_a_gap_and_the_source_stays_stale_until_resync() -> None:
    """A jump returns the expected/received values, is not applied, and stalls the source until `resync`."""
    index = build([stored(A, 0, [1]), stored(A, 1, [2]), stored(B, 0, [1])])
    gap = apply(index, stored(A, 3, [4]))
    assert gap == SequenceGap(source=A, expected_epoch=0, expected_seq=2, received_epoch=0, received_seq=3)
    assert K[4] not in index
    assert index.stale_sources == (A,)

    # The missing event itself, and every later one, is refused now.
    gap = apply(index, stored(A, 2, [3]))
    assert gap == SequenceGap(source=A, expected_epoch=0, expected_seq=2, received_epoch=0, received_seq=2)
    assert isinstance(apply(index, stored(A, 4, [5])), SequenceGap)
    assert K[3] not in index
    assert K[5] not in index

    # Stale holdings stay visible to match; other sources are unaffected.
    assert dict(index.match([K[1], K[2]]).lengths) == {A: 2, B: 1}
    assert apply(index, stored(B, 1, [2])) is None

    index.resync(A, {Tier.DRAM: [K[1], K[3]], Tier.SSD: [K[4]]}, epoch=0, seq=4)
    index.check_invariants()
    assert index.stale_sources == ()
    assert holdings_of(index, A) == {Tier.DRAM: {K[1], K[3]}, Tier.SSD: {K[4]}}
    assert K[2] in index  # still held by B
    assert index.holders(K[2]) == (Holder(B, Tier.VRAM),)
    assert apply(index, stored(A, 4, [9])) is None  # already reflected by the snapshot
    assert K[9] not in index
    assert apply(index, stored(A, 5, [9])) is None
    assert index.holders(K[9]) == (Holder(A, Tier.VRAM),)


def test_new_epoch_at_seq_zero_drops_old_holdings() -> None:
    """A restart (new epoch, seq 0) drops everything the source held before, and only its blocks."""
    index = build([stored(A, 0, [1, 2], Tier.VRAM), stored(A, 1, [3], Tier.SSD), stored(B, 0, [2])])
    assert apply(index, stored(A, 0, [4], Tier.DRAM, epoch=1)) is None
    assert holdings_of(index, A) == {Tier.DRAM: {K[4]}}
    assert index.num_blocks(A) == 1
    assert index.holders(K[2]) == (Holder(B, Tier.VRAM),)
    assert K[1] not in index
    assert K[3] not in index
    assert apply(index, stored(A, 1, [5], epoch=1)) is None
    assert index.num_blocks(A) == 2


def test_events_of_an_earlier_epoch_are_ignored() -> None:
    """After a restart, a late event of the old epoch (even its seq 0) changes nothing."""
    index = build([stored(A, 0, [1]), stored(A, 0, [2], epoch=1), stored(A, 1, [3], epoch=1)])
    before = index.snapshot()
    assert apply(index, stored(A, 0, [1], epoch=0)) is None
    assert apply(index, stored(A, 5, [9], epoch=0)) is None
    assert index.snapshot() == before
    assert apply(index, stored(A, 2, [4], epoch=1)) is None  # the current epoch carries on
    assert holdings_of(index, A) == {Tier.VRAM: {K[2], K[3], K[4]}}


def test_new_epoch_past_seq_zero_is_a_gap() -> None:
    """A new epoch whose first seen event is not seq 0 is a gap expecting seq 0 of that epoch."""
    index = build([stored(A, 0, [1])])
    gap = apply(index, stored(A, 2, [5], epoch=1))
    assert gap == SequenceGap(source=A, expected_epoch=1, expected_seq=0, received_epoch=1, received_seq=2)
    assert K[5] not in index
    assert index.stale_sources == (A,)
    assert index.holders(K[1]) == (Holder(A, Tier.VRAM),)  # stale holdings stay visible


def test_resync_of_a_never_seen_source() -> None:
    """`resync` installs a source the index never heard of, with seq -1 meaning 'expect seq 0'."""
    index = BlockIndex()
    index.resync(A, {Tier.VRAM: [K[1], K[2]]}, epoch=3, seq=-1)
    index.check_invariants()
    assert index.instances == (A,)
    assert dict(index.match([K[1], K[2]]).lengths) == {A: 2}
    assert apply(index, stored(A, 0, [3], epoch=3)) is None
    assert index.num_blocks(A) == 3


@pytest.mark.parametrize(
    ("source", "holdings", "epoch", "seq", "named"),
    [
        (A, {Tier.VRAM: [K[1]]}, -1, 0, "epoch"),
        (A, {Tier.VRAM: [K[1]]}, 0, math.nan, "seq"),  # NaN let the next event in without a gap check
        (A, {Tier.VRAM: [K[1]]}, 0, -2, "seq"),
        (A, {9: [K[1]]}, 0, 0, "tier must be one of"),
        ("", {Tier.VRAM: [K[1]]}, 0, 0, "source"),
        (A, [K[1], K[2]], 0, 0, "holdings must map tiers"),
    ],
)
def test_resync_with_bad_arguments_is_refused_and_changes_nothing(
    source: object, holdings: object, epoch: object, seq: object, named: str
) -> None:
    index = BlockIndex()
    index.resync(A, {Tier.DRAM: [K[2]]}, epoch=1, seq=4)
    with pytest.raises(ConfigError, match=named):
        index.resync(source, holdings, epoch=epoch, seq=seq)  # type: ignore[arg-type]
    assert dict(index.match([K[2]]).lengths) == {A: 1} and index.num_blocks(A) == 1
    assert apply(index, stored(A, 5, [3], epoch=1)) is None


@pytest.mark.parametrize("keys", [None, 5, object()])
def test_a_match_of_no_keys_at_all_is_an_invalid_request(keys: object) -> None:
    """Keys that are no sequence (None, a number) are an InvalidRequestError saying so, not a TypeError."""
    with pytest.raises(InvalidRequestError, match="block keys must be a sequence"):
        build([stored(A, 0, [1])]).match(keys)  # type: ignore[arg-type]


def test_remove_instance_forgets_holdings_and_sequence() -> None:
    """`remove_instance` drops the instance's blocks and state; it must start over at seq 0 (or resync)."""
    index = build([stored(A, 0, [1, 2]), stored(A, 1, [3], Tier.SSD), stored(B, 0, [2])])
    index.remove_instance(A)
    index.check_invariants()
    assert index.instances == (B,)
    assert index.num_blocks(A) == 0
    assert index.holders(K[2]) == (Holder(B, Tier.VRAM),)
    assert K[1] not in index
    assert K[3] not in index
    assert dict(index.match([K[2]]).lengths) == {B: 1}

    gap = apply(index, stored(A, 2, [1]))
    assert gap == SequenceGap(source=A, expected_epoch=0, expected_seq=0, received_epoch=0, received_seq=2)
    assert K[1] not in index
    index.remove_instance(A)
    index.check_invariants()
    assert index.stale_sources == ()
    assert apply(index, stored(A, 0, [1])) is None
    assert index.holders(K[1]) == (Holder(A, Tier.VRAM),)


def test_remove_unknown_instance_is_a_no_op() -> None:
    """Removing an instance the index does not know changes nothing."""
    index = build([stored(A, 0, [1])])
    index.remove_instance(B)
    index.check_invariants()
    assert index.instances == (A,)
    assert index.holders(K[1]) == (Holder(A, Tier.VRAM),)


# ---------------------------------------------------------------------------- examples: keys


def test_boundary_and_wide_keys() -> None:
    """Keys 0, 2**64 - 1 and 128/256-bit keys (XXH3-128, SHA-256) behave like any other key."""
    narrow = [BlockKey(0), BlockKey(2**63), BlockKey(2**64 - 1)]
    wide = [BlockKey(2**64), BlockKey(2**128 - 1), BlockKey(2**256 - 1)]
    chain = narrow + wide
    index = build([stored(A, 0, chain), stored(B, 0, chain[:2], Tier.SSD)])
    result = index.match(chain)
    assert (dict(result.lengths), result.best_instance, result.best_length) == ({A: 6, B: 2}, A, 6)
    for key in chain:
        assert key in index
    assert index.holders(BlockKey(2**256 - 1)) == (Holder(A, Tier.VRAM),)
    assert index.holders(BlockKey(0)) == (Holder(A, Tier.VRAM), Holder(B, Tier.SSD))
    assert len(index) == 6
    assert index.num_blocks(A) == 6

    restored = BlockIndex.restore(index.snapshot())
    restored.check_invariants()
    assert restored.match(chain) == result
    for key in chain:
        assert restored.holders(key) == index.holders(key)

    assert apply(index, removed(A, 1, [0, 2**128 - 1])) is None
    assert dict(index.match(chain).lengths) == {B: 2}
    assert dict(index.match(chain[1:]).lengths) == {A: 3, B: 1}
    assert BlockKey(2**128 - 1) not in index
    assert index.holders(BlockKey(0)) == (Holder(B, Tier.SSD),)
    assert len(index) == 5


def test_thousands_of_keys_with_removals_and_clears() -> None:
    """Thousands of keys, many removed, one instance cleared: state and matches equal the reference."""
    index = BlockIndex()
    reference = ReferenceIndex()
    chains = {instance: [BlockKey(3 * i + n) for i in range(1500)] for n, instance in enumerate((A, B, C))}
    chains[B][:700] = chains[A][:700]  # B shares A's first 700 keys
    events: list[CacheEvent] = []
    for instance, chain in chains.items():
        events += [
            stored(instance, 0, chain, Tier.VRAM),
            stored(instance, 1, chain[::5], Tier.SSD),
            removed(instance, 2, chain[1000::2], Tier.VRAM),
            removed(instance, 3, chain[1000::5], Tier.SSD),
        ]
    events += [stored(A, 4, chains[C][:900:3]), cleared(C, 4), stored(C, 5, chains[A][:50], Tier.DRAM)]
    for event in events:
        assert apply(index, event) is None
        assert reference.apply(event) is None
    everything = sorted({key for chain in chains.values() for key in chain})
    assert_same_state(index, reference, everything)
    for chain in chains.values():
        for start in (0, 1, 699, 700, 999):
            assert_match_equal(index, reference, chain[start:])
    assert index.match(chains[A]).lengths == {A: 1000, B: 700, C: 50}  # key 1000 left both tiers


# ---------------------------------------------------------------------------- examples: many instances


def test_forty_instances_keep_matches_correct() -> None:
    """40 instances (slots grow), some removed and their slots reused: matches and holders stay right."""
    index = BlockIndex()
    reference = ReferenceIndex()
    chain = K[:41]
    for i, instance in enumerate(MANY_INSTANCE_IDS):
        # instance i holds the first i + 1 keys of the chain, spread over the tiers
        for seq, tier in enumerate(Tier):
            event = BlockStored(source=instance, seq=seq, keys=chain[tier : i + 1 : len(Tier)], tier=tier)
            assert apply(index, event) is None
            assert reference.apply(event) is None
        assert_match_equal(index, reference, chain)
    result = index.match(chain)
    assert result.lengths == {instance: i + 1 for i, instance in enumerate(MANY_INSTANCE_IDS)}
    assert (result.best_instance, result.best_length) == (MANY_INSTANCE_IDS[-1], 40)
    assert index.holders(K[0]) == tuple(Holder(instance, Tier.VRAM) for instance in MANY_INSTANCE_IDS)
    assert_same_state(index, reference, chain)

    # Free some slots, reuse them, and store keys shared across instances after growing.
    for instance in MANY_INSTANCE_IDS[::3]:
        index.remove_instance(instance)
        reference.remove_instance(instance)
    index.check_invariants()
    assert_same_state(index, reference, chain)
    for i, instance in enumerate(MANY_INSTANCE_IDS[::3]):
        event = stored(instance, 0, range(40 - i, 41), Tier.DRAM)
        assert apply(index, event) is None
        assert reference.apply(event) is None
    late = InstanceId("node-zz")
    for event in (stored(late, 0, range(41)), stored(late, 1, range(20), Tier.SSD)):
        assert apply(index, event) is None
        assert reference.apply(event) is None
    assert_same_state(index, reference, chain)
    for start in (0, 1, 20, 39, 40):
        assert_match_equal(index, reference, chain[start:])
    result = index.match(chain)
    assert (result.best_instance, result.best_length) == (late, 41)


# ---------------------------------------------------------------------------- examples: snapshots and checks


def test_snapshot_restore_round_trips_holdings_and_sequence_state() -> None:
    """A restored index answers like the original and continues each source's sequence, stale ones included."""
    index = build([stored(A, 0, [1, 2]), stored(A, 1, [2], Tier.SSD), stored(B, 0, [2, 3], epoch=4)])
    apply(index, stored(B, 2, [9], epoch=4))  # B goes stale
    restored = BlockIndex.restore(index.snapshot())
    restored.check_invariants()
    assert restored.snapshot() == index.snapshot()
    assert restored.stale_sources == (B,)
    for key in K[:10]:
        assert restored.holders(key) == index.holders(key)
    assert apply(restored, stored(A, 2, [5])) is None
    assert apply(restored, stored(A, 1, [6])) is None  # redelivery
    assert isinstance(apply(restored, stored(B, 1, [5], epoch=4)), SequenceGap)
    assert restored.holders(K[5]) == (Holder(A, Tier.VRAM),)
    assert K[6] not in restored


def test_snapshot_is_canonical_so_restore_round_trips_exactly() -> None:
    """Snapshots list each tier's keys sorted, whatever the event order, so restore(snapshot) snapshots equal."""
    # Key 5 first stored in DRAM, key 2 in VRAM, then key 2 in DRAM; a restore installs VRAM first.
    events = [stored(A, 0, [5], Tier.DRAM), stored(A, 1, [2], Tier.VRAM), stored(A, 2, [2, 9, 1], Tier.DRAM)]
    events += [stored(B, 0, [9, 3]), removed(B, 1, [9]), stored(B, 2, [9])]
    index = build(events)
    snapshot = index.snapshot()
    assert [s.source for s in snapshot.sources] == [A, B]
    assert snapshot.sources[0].keys_by_tier == ((Tier.VRAM, (2,)), (Tier.DRAM, (1, 2, 5, 9)))
    assert snapshot.sources[1].keys_by_tier == ((Tier.VRAM, (3, 9)),)
    assert BlockIndex.restore(snapshot).snapshot() == snapshot


# ---------------------------------------------------------------------------- properties


many_instance_ids = st.sampled_from(MANY_INSTANCE_IDS)
event_sequences = st.one_of(
    cache_event_sequences(),
    cache_event_sequences(sources=many_instance_ids, max_events=50, max_keys=4),
)


@given(events=event_sequences, data=st.data())
def test_match_equals_brute_force_longest_prefix(events: list[CacheEvent], data: st.DataObject) -> None:
    """After any valid event sequence, match equals the per-instance brute-force contiguous prefix."""
    index = BlockIndex()
    reference = ReferenceIndex()
    for event in events:
        assert index.apply(event) is None
        assert reference.apply(event) is None
    index.check_invariants()
    assert_same_state(index, reference)
    for keys in queries(events):
        assert_match_equal(index, reference, keys)
    for keys in data.draw(st.lists(st.lists(block_keys, max_size=10), max_size=5), label="random key lists"):
        assert_match_equal(index, reference, keys)


@given(events=event_sequences, data=st.data())
def test_snapshot_restore_round_trips(events: list[CacheEvent], data: st.DataObject) -> None:
    """restore(snapshot()) equals the original in snapshot, matches, holders and later event handling."""
    split = data.draw(st.integers(0, len(events)), label="split")
    lost = data.draw(st.sets(st.integers(0, max(len(events) - 1, 0)), max_size=3), label="lost")
    index = BlockIndex()
    reference = ReferenceIndex()
    for position, event in enumerate(events[:split]):
        if position not in lost:
            assert index.apply(event, strict=False) == reference.apply(event)

    snapshot = index.snapshot()
    restored = BlockIndex.restore(snapshot)
    restored.check_invariants()
    assert restored.snapshot() == snapshot
    assert_same_state(restored, reference)
    for keys in queries(events):
        assert restored.match(keys) == index.match(keys)
        assert dict(restored.match(keys).lengths) == dict(index.match(keys).lengths)

    for position, event in enumerate(events[split:], split):
        if position not in lost:
            want = reference.apply(event)
            assert index.apply(event, strict=False) == want
            assert restored.apply(event, strict=False) == want
    assert_same_state(restored, reference)
    assert restored.snapshot() == index.snapshot()


@pytest.mark.skipif(
    not numba_available(), reason="numba (the accel extra) is not installed: there is no compiled index to compare"
)
@given(events=event_sequences, data=st.data())
def test_answers_are_identical_with_and_without_numba(events: list[CacheEvent], data: st.DataObject) -> None:
    """An index on the plain-Python kernels answers every query exactly as the compiled one does."""
    compiled = BlockIndex()
    with compiled_path(False):
        plain = BlockIndex()
    for event in events:
        assert compiled.apply(event, strict=False) == plain.apply(event, strict=False)
    plain.check_invariants()
    assert plain.snapshot() == compiled.snapshot()
    assert len(plain) == len(compiled) and plain.nbytes() == compiled.nbytes()
    extra = data.draw(st.lists(st.lists(block_keys, max_size=10), max_size=5), label="random key lists")
    for keys in [*queries(events), *extra]:
        assert plain.match(keys) == compiled.match(keys)
        assert dict(plain.match(keys).lengths) == dict(compiled.match(keys).lengths)
        assert plain.prefix_lengths(keys, PROBED).tolist() == compiled.prefix_lengths(keys, PROBED).tolist()
    for key in ALL_KEYS:
        assert plain.holders(key) == compiled.holders(key)


holdings_strategy = st.dictionaries(tiers, st.frozensets(block_keys, max_size=8), max_size=3)


@given(
    events=cache_event_sequences(),
    source=instance_ids,
    holdings=holdings_strategy,
    epoch=st.integers(0, 3),
    seq=st.integers(-1, 5),
)
def test_resync_replaces_a_sources_holdings_exactly(
    events: list[CacheEvent],
    source: InstanceId,
    holdings: dict[Tier, frozenset[BlockKey]],
    epoch: int,
    seq: int,
) -> None:
    """After resync the source holds exactly the given keys, others are untouched, and seq + 1 is next."""
    index = build(events)
    reference = ReferenceIndex()
    for event in events:
        reference.apply(event)
    others_before = [s for s in index.snapshot().sources if s.source != source]

    index.resync(source, holdings, epoch=epoch, seq=seq)
    reference.resync(source, holdings, epoch=epoch, seq=seq)
    index.check_invariants()
    assert holdings_of(index, source) == {tier: keys for tier, keys in holdings.items() if keys}
    assert index.num_blocks(source) == len(set().union(*holdings.values()))
    assert [s for s in index.snapshot().sources if s.source != source] == others_before
    assert source in index.instances
    assert source not in index.stale_sources
    assert_same_state(index, reference)
    for keys in queries(events):
        assert_match_equal(index, reference, keys)

    assert isinstance(apply(index, stored(source, seq + 2, [0], epoch=epoch)), SequenceGap)
    index.resync(source, holdings, epoch=epoch, seq=seq)
    assert apply(index, stored(source, seq + 1, [30], epoch=epoch)) is None
    assert Holder(source, Tier.VRAM) in index.holders(BlockKey(30))


# ---------------------------------------------------------------------------- state machine


MACHINE_SOURCES = [InstanceId(f"node-{i}") for i in range(10)]
CROWD = [InstanceId(f"crowd-{i:02d}") for i in range(24)]  # joined in bulk: the holder slots grow mid-run
MACHINE_KEYS = [BlockKey(k) for k in range(12)]
# The first three sources are drawn more often, so their sequences get long and keys overlap.
machine_sources = st.one_of(st.sampled_from(MACHINE_SOURCES[:3]), st.sampled_from(MACHINE_SOURCES))
machine_keys = st.sampled_from(MACHINE_KEYS)
key_runs = st.one_of(
    st.lists(machine_keys, unique=True, max_size=6),
    st.tuples(st.integers(0, 11), st.integers(1, 6)).map(lambda t: MACHINE_KEYS[t[0] : t[0] + t[1]]),
)


@attrs.define
class SimulatedCache:
    """The truth of one source: what it holds, and the stamp of its next event."""

    epoch: int = 0
    next_seq: int = 0
    holdings: dict[Tier, set[BlockKey]] = attrs.Factory(lambda: {tier: set() for tier in Tier})
    sent: list[CacheEvent] = attrs.Factory(list)  # events of this epoch, delivered or lost

    def emit(self, source: InstanceId, kind: str, tier: Tier, keys: Sequence[BlockKey]) -> CacheEvent:
        stamp = {"source": source, "seq": self.next_seq, "epoch": self.epoch}
        event: CacheEvent
        if kind == "stored":
            event = BlockStored(keys=tuple(keys), tier=tier, **stamp)
            self.holdings[tier].update(keys)
        elif kind == "removed":
            event = BlockRemoved(keys=tuple(keys), tier=tier, **stamp)
            self.holdings[tier].difference_update(keys)
        else:
            event = AllBlocksCleared(**stamp)
            self.holdings = {t: set() for t in Tier}
        self.next_seq += 1
        self.sent.append(event)
        return event


class IndexMachine(RuleBasedStateMachine):
    """Simulated caches publish events to a `BlockIndex` and to the reference model; some events are
    lost or redelivered, caches restart and leave, sources get resynced, the index is snapshot-restored."""

    def __init__(self) -> None:
        super().__init__()
        self.index = BlockIndex()
        self.reference = ReferenceIndex()
        self.caches = {source: SimulatedCache() for source in [*MACHINE_SOURCES, *CROWD]}
        self.num_joined = 0

    def deliver(self, event: CacheEvent) -> SequenceGap | None:
        """Apply strictly: a gap is raised, carrying what the reference returns."""
        want = self.reference.apply(event)
        if want is None:
            assert self.index.apply(event) is None, event
        else:
            with pytest.raises(SequenceGapError) as raised:
                self.index.apply(event)
            assert raised.value.gap == want, event
        return want

    @rule(source=machine_sources, tier=tiers, keys=key_runs)
    def stored(self, source: InstanceId, tier: Tier, keys: list[BlockKey]) -> None:
        self.deliver(self.caches[source].emit(source, "stored", tier, keys))

    @rule(source=machine_sources, tier=tiers, keys=key_runs)
    def removed(self, source: InstanceId, tier: Tier, keys: list[BlockKey]) -> None:
        self.deliver(self.caches[source].emit(source, "removed", tier, keys))

    @rule(source=machine_sources)
    def cleared(self, source: InstanceId) -> None:
        self.deliver(self.caches[source].emit(source, "cleared", Tier.VRAM, ()))

    @rule(source=machine_sources, kind=st.sampled_from(["stored", "removed", "cleared"]), tier=tiers, keys=key_runs)
    def lose_event(self, source: InstanceId, kind: str, tier: Tier, keys: list[BlockKey]) -> None:
        """The cache changes, but its event never reaches the index: the next one will be a gap."""
        self.caches[source].emit(source, kind, tier, keys)

    @precondition(lambda self: any(cache.sent for cache in self.caches.values()))
    @rule(data=st.data())
    def redeliver(self, data: st.DataObject) -> None:
        """An event of the current epoch arrives again (or late, if it had been lost)."""
        source = data.draw(st.sampled_from([s for s, cache in self.caches.items() if cache.sent]), label="source")
        event = data.draw(st.sampled_from(self.caches[source].sent), label="event")
        state = self.reference.sources.get(source)
        is_duplicate = (
            state is not None and not state.is_stale and state.epoch == event.epoch and event.seq <= state.seq
        )
        before = self.index.snapshot()
        result = self.deliver(event)
        if is_duplicate:
            assert result is None
            assert self.index.snapshot() == before

    @precondition(lambda self: self.reference.stale_sources)
    @rule(data=st.data())
    def resync_stale(self, data: st.DataObject) -> None:
        """The Conductor answers a gap: the stale source's snapshot is installed."""
        source = data.draw(st.sampled_from(self.reference.stale_sources), label="stale source")
        self.resync(source)
        assert source not in self.index.stale_sources

    @rule(source=machine_sources)
    def resync(self, source: InstanceId) -> None:
        """The Conductor asks the cache for a snapshot and installs it (stale or not)."""
        cache = self.caches[source]
        holdings = {tier: sorted(keys) for tier, keys in cache.holdings.items()}
        self.index.resync(source, holdings, epoch=cache.epoch, seq=cache.next_seq - 1)
        self.reference.resync(source, holdings, epoch=cache.epoch, seq=cache.next_seq - 1)
        assert holdings_of(self.index, source) == {tier: frozenset(keys) for tier, keys in holdings.items() if keys}

    @rule(source=machine_sources)
    def restart(self, source: InstanceId) -> None:
        """The cache restarts empty under the next epoch; the index learns of it from its next event."""
        cache = self.caches[source]
        self.caches[source] = SimulatedCache(epoch=cache.epoch + 1)

    @precondition(lambda self: self.num_joined < len(CROWD))
    @rule(count=st.integers(1, 12), keys=key_runs)
    def crowd_joins(self, count: int, keys: list[BlockKey]) -> None:
        """Several more instances publish their first blocks, all sharing one run of keys."""
        for source in CROWD[self.num_joined : self.num_joined + count]:
            self.deliver(self.caches[source].emit(source, "stored", Tier.DRAM, keys))
        self.num_joined = min(self.num_joined + count, len(CROWD))

    @rule(source=st.one_of(machine_sources, st.sampled_from(CROWD), st.just(InstanceId("node-never"))))
    def remove_instance(self, source: InstanceId) -> None:
        self.index.remove_instance(source)
        self.reference.remove_instance(source)

    @rule()
    def restore_from_snapshot(self) -> None:
        """Replace the index by one restored from its snapshot; everything after must behave the same."""
        snapshot = self.index.snapshot()
        self.index = BlockIndex.restore(snapshot)
        assert self.index.snapshot() == snapshot

    @rule(keys=st.lists(machine_keys, max_size=10))
    def match_random_keys(self, keys: list[BlockKey]) -> None:
        assert_match_equal(self.index, self.reference, keys)

    @invariant()
    def invariants_hold(self) -> None:
        self.index.check_invariants()

    @invariant()
    def state_equals_reference(self) -> None:
        assert_same_state(self.index, self.reference, MACHINE_KEYS)

    @invariant()
    def prefix_matches_equal_reference(self) -> None:
        lists = {tuple(MACHINE_KEYS[start:]) for start in range(0, len(MACHINE_KEYS), 3)}
        lists |= {tuple(sorted(source.held_keys())) for source in self.reference.sources.values()}
        for keys in lists:
            assert_match_equal(self.index, self.reference, keys)

    @invariant()
    def synced_sources_mirror_their_caches(self) -> None:
        """A source whose every event so far was applied is known exactly as its cache holds it."""
        known: dict[InstanceId, dict[Tier, set[BlockKey]]] = {}
        for key in MACHINE_KEYS:
            for holder in self.index.holders(key):
                known.setdefault(holder.instance_id, {}).setdefault(holder.tier, set()).add(key)
        for source, state in self.reference.sources.items():
            cache = self.caches[source]
            if not state.is_stale and state.epoch == cache.epoch and state.seq == cache.next_seq - 1:
                assert known.get(source, {}) == {tier: keys for tier, keys in cache.holdings.items() if keys}


IndexMachine.TestCase.settings = settings(stateful_step_count=40)
TestIndexMachine = IndexMachine.TestCase
