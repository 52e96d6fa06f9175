"""The global block index: which instances hold which blocks, in which tier.

The Conductor asks one question of it per request: for the request's chained
block keys, how long a prefix does each instance hold, and who holds the
longest (`match`). Caches keep it current by publishing events (`stored`,
`removed`, `cleared`), each stamped with a per-source epoch and sequence number.

Layout: each holding instance gets a small integer slot. Per key the index keeps
one integer: bit `slot` says "this instance holds the key in some tier" (the
presence bits, `width` of them), and bit ``width + slot * 3 + tier`` records the
tier. Integers with equal value are interned, so keys held by the same holders
share one object.

`match(keys)` walks the keys once, intersecting the presence bits of the
instances still "alive" in the prefix; an instance whose bit drops out gets the
current position as its prefix length. Each step is a few integer operations,
and each instance drops out once, so a match costs O(len(keys) + holders), not
O(len(keys) × holders).

Events: a source's first event of an epoch must have seq 0, and each later one
seq + 1. A new epoch means the source restarted: its old holdings are dropped.
A repeated or older seq is ignored (redelivery). A jump is a gap: the event is
not applied, the source is marked stale, `apply` returns a `SequenceGap`, and
the source's events are refused until `resync` installs its snapshot. Stale
holdings stay visible to `match`: a wrong hint costs a recomputation, not
correctness, and the engines verify what they load.

Invariants:
- A key is present iff some (instance, tier) holds it; no key maps to 0.
- Presence bit of an instance set iff at least one of its tier bits is set.
- `num_blocks(instance)` equals the number of keys whose presence bit is set.
- Slots map one-to-one to the instances that have a source state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

import attrs

from mooncake.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent, SequenceGap
from mooncake.types import BlockKey, InstanceId, Tier

__all__ = ["BlockIndex", "Holder", "IndexSnapshot", "PrefixMatch", "SourceSnapshot"]

_NUM_TIERS = len(Tier)
_TIER_MASK = (1 << _NUM_TIERS) - 1
_INTERN_LIMIT = 1 << 14  # distinct holder sets remembered; beyond it interning restarts


@attrs.frozen
class Holder:
    """An instance holding a block in one tier."""

    instance_id: InstanceId
    tier: Tier


@attrs.frozen(kw_only=True)
class PrefixMatch:
    """Result of `BlockIndex.match`.

    Attributes:
        lengths: instance → number of leading keys it holds (only instances holding >= 1).
        best_instance: an instance with the longest prefix (ties: smallest id), or None.
        best_length: that prefix length (0 when nobody holds the first key).
    """

    lengths: Mapping[InstanceId, int] = attrs.field(hash=False)
    best_instance: InstanceId | None
    best_length: int

    def length(self, instance_id: InstanceId) -> int:
        """Prefix length `instance_id` holds (0 if none)."""
        return self.lengths.get(instance_id, 0)


@attrs.frozen(kw_only=True)
class SourceSnapshot:
    """What the index knows of one source: its sequence state and holdings per tier.

    `seq` is the last applied sequence number (-1: none yet in this epoch).
    """

    source: InstanceId
    epoch: int
    seq: int
    is_stale: bool = False
    keys_by_tier: tuple[tuple[Tier, tuple[BlockKey, ...]], ...] = ()


@attrs.frozen
class IndexSnapshot:
    """A whole index, restorable with `BlockIndex.restore`."""

    sources: tuple[SourceSnapshot, ...]


@attrs.define
class _SourceState:
    epoch: int
    seq: int
    is_stale: bool


class BlockIndex:
    """Key → holders map fed by cache events, answering longest-prefix queries.

    Not thread-safe: the Conductor owns it and applies events from one thread.

    Invariants: see the module docstring; `check_invariants` verifies them.
    """

    def __init__(self) -> None:
        self._entries: dict[BlockKey, int] = {}
        self._width = 8  # presence bits; doubles (with a rebuild) when slots run out
        self._slot_of: dict[InstanceId, int] = {}
        self._instance_of: list[InstanceId | None] = []
        self._free_slots: list[int] = []
        self._counts: list[int] = []
        self._sources: dict[InstanceId, _SourceState] = {}
        self._intern: dict[int, int] = {}

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    @property
    def instances(self) -> tuple[InstanceId, ...]:
        """Instances the index has a source state for, sorted."""
        return tuple(sorted(self._slot_of))

    @property
    def stale_sources(self) -> tuple[InstanceId, ...]:
        """Sources whose events are refused until `resync`, sorted."""
        return tuple(sorted(s for s, state in self._sources.items() if state.is_stale))

    def num_blocks(self, instance_id: InstanceId) -> int:
        """Keys `instance_id` holds in at least one tier."""
        slot = self._slot_of.get(instance_id)
        return 0 if slot is None else self._counts[slot]

    def holders(self, key: BlockKey) -> tuple[Holder, ...]:
        """Who holds `key`, sorted by tier then instance id (empty if nobody)."""
        value = self._entries.get(key, 0)
        found = [
            Holder(instance, Tier(tier))
            for slot, instance in enumerate(self._instance_of)
            if instance is not None and value >> slot & 1
            for tier in range(_NUM_TIERS)
            if value >> (self._width + slot * _NUM_TIERS + tier) & 1
        ]
        return tuple(sorted(found, key=lambda h: (h.tier, h.instance_id)))

    def match(self, keys: Iterable[BlockKey]) -> PrefixMatch:
        """Each instance's contiguous prefix of `keys`, and the longest.

        Args:
            keys: a request's chained block keys, in order.

        Returns:
            A `PrefixMatch`; an instance holding none of the leading keys is absent.
        """
        get = self._entries.get
        presence = (1 << self._width) - 1
        iterator = iter(keys)
        first = next(iterator, None)
        alive = get(first, 0) & presence if first is not None else 0
        found: dict[int, int] = {}
        position = 1
        for key in iterator:
            if not alive:
                break
            still = get(key, 0) & alive
            dropped = alive ^ still
            while dropped:
                low = dropped & -dropped
                found[low.bit_length() - 1] = position
                dropped ^= low
            alive = still
            position += 1
        while alive:
            low = alive & -alive
            found[low.bit_length() - 1] = position
            alive ^= low
        instance_of = self._instance_of
        lengths = {instance_of[slot]: length for slot, length in found.items()}
        best_instance = None
        best_length = 0
        for instance, length in lengths.items():
            if length > best_length or (length == best_length and best_instance is not None and instance < best_instance):
                best_instance, best_length = instance, length
        return PrefixMatch(lengths=MappingProxyType(lengths), best_instance=best_instance, best_length=best_length)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ events

    def apply(self, event: CacheEvent) -> SequenceGap | None:
        """Apply one event in its source's sequence.

        Returns:
            None when applied or ignored as a redelivery; a `SequenceGap` when
            events were lost (the event is then not applied and the source is
            stale until `resync`).
        """
        source = event.source
        state = self._sources.get(source)
        if state is None or state.epoch != event.epoch:
            if event.seq != 0:
                return self._gap(source, event, expected_epoch=event.epoch, expected_seq=0)
            # A new epoch: the source restarted empty.
            self._drop_holdings(source)
            state = self._sources[source] = _SourceState(epoch=event.epoch, seq=-1, is_stale=False)
            self._ensure_slot(source)
        elif state.is_stale or event.seq > state.seq + 1:
            return self._gap(source, event, expected_epoch=state.epoch, expected_seq=state.seq + 1)
        elif event.seq <= state.seq:
            return None
        slot = self._slot_of[source]
        if isinstance(event, BlockStored):
            for key in event.keys:
                self._add(key, slot, event.tier)
        elif isinstance(event, BlockRemoved):
            for key in event.keys:
                self._discard(key, slot, event.tier)
        elif isinstance(event, AllBlocksCleared):
            self._clear_slot(slot)
        else:  # pragma: no cover - the union is closed
            raise TypeError(f"not a cache event: {event!r}")
        state.seq = event.seq
        return None

    def resync(
        self,
        source: InstanceId,
        holdings: Mapping[Tier, Iterable[BlockKey]],
        *,
        epoch: int,
        seq: int,
    ) -> None:
        """Replace everything known of `source` with its snapshot.

        Args:
            source: the instance.
            holdings: tier → keys it holds there.
            epoch, seq: the source's epoch and the last event seq the snapshot
                reflects (-1 if none); the next event expected is ``seq + 1``.
        """
        self._drop_holdings(source)
        self._sources[source] = _SourceState(epoch=epoch, seq=seq, is_stale=False)
        slot = self._ensure_slot(source)
        for tier, keys in holdings.items():
            for key in keys:
                self._add(key, slot, Tier(tier))

    def remove_instance(self, instance_id: InstanceId) -> None:
        """Forget `instance_id` entirely (it is gone); its next event must start an epoch or resync."""
        self._drop_holdings(instance_id)
        self._sources.pop(instance_id, None)
        slot = self._slot_of.pop(instance_id, None)
        if slot is not None:
            self._instance_of[slot] = None
            self._free_slots.append(slot)

    # ------------------------------------------------------------------ snapshot

    def snapshot(self) -> IndexSnapshot:
        """Everything needed to rebuild this index."""
        per_slot: dict[int, list[list[BlockKey]]] = {slot: [[] for _ in Tier] for slot in self._slot_of.values()}
        width = self._width
        for key, value in self._entries.items():
            present = value & ((1 << width) - 1)
            while present:
                low = present & -present
                slot = low.bit_length() - 1
                tiers = value >> (width + slot * _NUM_TIERS) & _TIER_MASK
                for tier in range(_NUM_TIERS):
                    if tiers >> tier & 1:
                        per_slot[slot][tier].append(key)
                present ^= low
        sources = []
        for source in sorted(self._sources):
            state = self._sources[source]
            by_tier = per_slot.get(self._slot_of.get(source, -1), [[] for _ in Tier])
            sources.append(
                SourceSnapshot(
                    source=source,
                    epoch=state.epoch,
                    seq=state.seq,
                    is_stale=state.is_stale,
                    keys_by_tier=tuple((Tier(t), tuple(keys)) for t, keys in enumerate(by_tier) if keys),
                )
            )
        return IndexSnapshot(tuple(sources))

    @classmethod
    def restore(cls, snapshot: IndexSnapshot) -> BlockIndex:
        """A new index equal to the one `snapshot` was taken of."""
        index = cls()
        for source in snapshot.sources:
            index.resync(source.source, dict(source.keys_by_tier), epoch=source.epoch, seq=source.seq)
            index._sources[source.source].is_stale = source.is_stale
        return index

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Raise AssertionError if an invariant of the module docstring fails."""
        width = self._width
        counts = [0] * len(self._instance_of)
        for key, value in self._entries.items():
            assert value != 0, f"key {key} maps to no holder"
            assert value >> (width + len(self._instance_of) * _NUM_TIERS) == 0, f"key {key} has bits past the last slot"
            for slot, instance in enumerate(self._instance_of):
                present = value >> slot & 1
                tiers = value >> (width + slot * _NUM_TIERS) & _TIER_MASK
                assert bool(present) == bool(tiers), f"key {key} slot {slot}: presence {present} tiers {tiers:b}"
                if present:
                    assert instance is not None, f"key {key} held by freed slot {slot}"
                    counts[slot] += 1
        assert counts == self._counts, f"per-instance counts {self._counts} != recount {counts}"
        assert len(self._instance_of) <= width, "more slots than presence bits"
        live = {instance: slot for slot, instance in enumerate(self._instance_of) if instance is not None}
        assert live == self._slot_of, "slot table out of sync"
        assert set(self._slot_of) == set(self._sources), "sources without slots or slots without sources"

    # ------------------------------------------------------------------ internals

    def _gap(self, source: InstanceId, event: CacheEvent, *, expected_epoch: int, expected_seq: int) -> SequenceGap:
        state = self._sources.get(source)
        if state is None:
            self._sources[source] = _SourceState(epoch=event.epoch, seq=-1, is_stale=True)
            self._ensure_slot(source)
        else:
            state.is_stale = True
        return SequenceGap(
            source=source,
            expected_epoch=expected_epoch,
            expected_seq=expected_seq,
            received_epoch=event.epoch,
            received_seq=event.seq,
        )

    def _intern_value(self, value: int) -> int:
        interned = self._intern.setdefault(value, value)
        if len(self._intern) > _INTERN_LIMIT:
            self._intern.clear()
        return interned

    def _ensure_slot(self, instance_id: InstanceId) -> int:
        slot = self._slot_of.get(instance_id)
        if slot is not None:
            return slot
        if self._free_slots:
            self._free_slots.sort()
            slot = self._free_slots.pop(0)
            self._instance_of[slot] = instance_id
        else:
            slot = len(self._instance_of)
            if slot >= self._width:
                self._grow(2 * self._width)
            self._instance_of.append(instance_id)
            self._counts.append(0)
        self._slot_of[instance_id] = slot
        return slot

    def _grow(self, width: int) -> None:
        old = self._width
        presence = (1 << old) - 1
        self._intern.clear()
        self._entries = {
            key: self._intern_value((value & presence) | (value >> old << width)) for key, value in self._entries.items()
        }
        self._width = width

    def _add(self, key: BlockKey, slot: int, tier: Tier) -> None:
        value = self._entries.get(key, 0)
        tier_bit = 1 << (self._width + slot * _NUM_TIERS + tier)
        if value & tier_bit:
            return
        if not value >> slot & 1:
            self._counts[slot] += 1
        self._entries[key] = self._intern_value(value | tier_bit | 1 << slot)

    def _discard(self, key: BlockKey, slot: int, tier: Tier) -> None:
        value = self._entries.get(key, 0)
        shift = self._width + slot * _NUM_TIERS
        tier_bit = 1 << (shift + tier)
        if not value & tier_bit:
            return
        value ^= tier_bit
        if not value >> shift & _TIER_MASK:
            value ^= 1 << slot
            self._counts[slot] -= 1
        if value:
            self._entries[key] = self._intern_value(value)
        else:
            del self._entries[key]

    def _clear_slot(self, slot: int) -> None:
        if not self._counts[slot]:
            return
        keep = ~((1 << slot) | (_TIER_MASK << (self._width + slot * _NUM_TIERS)))
        emptied = []
        for key, value in self._entries.items():
            if value >> slot & 1:
                value &= keep
                if value:
                    self._entries[key] = self._intern_value(value)
                else:
                    emptied.append(key)
        for key in emptied:
            del self._entries[key]
        self._counts[slot] = 0

    def _drop_holdings(self, instance_id: InstanceId) -> None:
        slot = self._slot_of.get(instance_id)
        if slot is not None:
            self._clear_slot(slot)
