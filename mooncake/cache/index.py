"""The global block index: which instances hold which blocks, in which tier.

The Conductor asks one question of it per request: for the request's chained
block keys, how long a prefix does each instance hold, and who holds the
longest (`match`). Caches keep it current by publishing events (`stored`,
`removed`, `cleared`), each stamped with a per-source epoch and sequence number.

Layout: each holding instance gets a small integer slot. Keys live in an
open-addressing table (`_key_table`, numba-compiled where numba is installed,
the same loops in plain Python otherwise) of uint64 keys with, per key, a
nibble per slot: which tiers hold it and a presence bit. Keys wider than
64 bits (XXH3-128, SHA-256) are folded to 64 bits by XXH3-64 on the way in; the
index is a routing hint, and the caches that serve blocks compare full keys.

`match(keys)` walks the keys once in compiled code, intersecting the presence
bits of the instances still "alive" in the prefix; an instance whose bit drops
out gets the current position as its prefix length. Each step is one probe and
one operation per 64-bit word of holder bits (16 instances a word), and each
instance drops out once, so a match costs O(len(keys) × ⌈holders / 16⌉ +
holders): for up to 16 instances, one probe per key. `prefix_lengths(keys,
instances)` gives the same answer as an array in the caller's order of
instances, with no per-holder Python work (the Conductor's path).

Events: a source's first event of an epoch must have seq 0, and each later one
seq + 1. Epochs only rise: a higher epoch means the source restarted, and its
old holdings are dropped; an event of a lower epoch is a late straggler and is
ignored.
A repeated or older seq is ignored (redelivery). A jump is a gap: the event is
not applied, the source is marked stale, `apply` raises `SequenceGapError`
(or, with ``strict=False``, returns the `SequenceGap`), and the source's events
are refused until `resync` installs its snapshot. Stale
holdings stay visible to `match`: a wrong hint costs a recomputation, not
correctness, and the engines verify what they load.

Invariants:
- A key is present iff some (instance, tier) holds it; no key maps to 0.
- Presence bit of an instance set iff at least one of its tier bits is set.
- `num_blocks(instance)` equals the number of keys whose presence bit is set.
- Slots map one-to-one to the instances that have a source state.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import SupportsIndex, cast

import attrs
import numpy as np
import numpy.typing as npt
import xxhash

from mooncake._checks import require_int, require_str, shown
from mooncake.cache._key_table import SLOTS_PER_WORD, KeyTable
from mooncake.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent, SequenceGap, parse_tier
from mooncake.errors import ConfigError, InvalidRequestError, SequenceGapError
from mooncake.types import BlockKey, InstanceId, Tier

__all__ = ["BlockIndex", "Holder", "IndexSnapshot", "PrefixMatch", "SourceSnapshot", "key_array"]

_NUM_TIERS = len(Tier)
_U64 = 2**64
_NO_KEYS = np.empty(0, dtype=np.uint64)


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
    slot: int


def _fold(key: object) -> int:
    """A key as stored: itself below 2**64, else its XXH3-64."""
    if isinstance(key, bool) or not isinstance(key, SupportsIndex) or operator.index(key) < 0:
        raise InvalidRequestError(f"block keys must be non-negative integers, got {shown(key)}")
    value = operator.index(key)
    if value < _U64:
        return value
    return xxhash.xxh3_64_intdigest(value.to_bytes((value.bit_length() + 7) // 8, "little"))


def key_array(keys: Iterable[BlockKey], *, integers: bool = False) -> npt.NDArray[np.uint64]:
    """Keys as the index stores them, a uint64 array: each key below 2**64 itself, a wider one (XXH3-128,
    SHA-256) folded to its XXH3-64; validated, so nothing is silently truncated or wrapped. A uint64
    array is returned as it is, so a caller converting a prompt's keys once can pass them on.
    `integers`: the caller vouches that the keys are non-negative Python ints (a `Request`'s, which
    `types.key_tuple` converted), so the check that numpy truncated no non-integer is skipped.

    Raises:
        InvalidRequestError: a key that is not a non-negative integer; bytes or a mapping for `keys` (whose items,
            small ints or a dict's keys, are no request's keys).
    """
    if isinstance(keys, np.ndarray):
        if keys.ndim != 1:  # the key table's loops take one flat run
            raise InvalidRequestError(f"block keys must be a flat sequence, got an array of shape {keys.shape}")
        if keys.dtype == np.uint64:
            return keys
        if keys.dtype.kind in "iu" and (keys.size == 0 or keys.min() >= 0):
            return keys.astype(np.uint64)
        keys = keys.tolist()
    if (
        type(keys) is not tuple
        and type(keys) is not list
        and isinstance(keys, bytes | bytearray | memoryview | Mapping)
    ):
        raise InvalidRequestError(f"block keys must be a sequence of non-negative integers, got {keys!r:.80}")
    try:
        values = keys if integers and isinstance(keys, tuple) else list(keys)
    except TypeError:  # None, a number: no keys at all
        raise InvalidRequestError(
            f"block keys must be a sequence of non-negative integers, got {shown(keys)}"
        ) from None
    try:
        array = np.array(values, dtype=np.uint64)
    except (OverflowError, TypeError, ValueError):  # wider than 64 bits, negative, or not integers
        return np.array([_fold(k) for k in values], dtype=np.uint64)
    if array.ndim != 1:  # keys that are sequences themselves
        raise InvalidRequestError(f"block keys must be a flat sequence of non-negative integers, got {keys!r:.80}")
    if not integers:
        # numpy took a float or a bool (1.0 and True as key 1, 1.5 as 1): what the tiered cache refuses, refused.
        kinds = set(map(type, values))
        if not kinds <= {int} and not all(kind is not bool and issubclass(kind, numbers.Integral) for kind in kinds):
            bad = next(k for k in values if isinstance(k, bool) or not isinstance(k, numbers.Integral))
            raise InvalidRequestError(f"block keys must be non-negative integers, got {shown(bad)}")
        # numpy 1.x wraps a negative int to 2**64 - n (numpy 2 raises, and the fold refuses it): -1 would then
        # match a real key. `integers` callers' keys were checked non-negative already.
        if values and (least := min(values)) < 0:
            raise InvalidRequestError(f"block keys must be non-negative integers, got {shown(least)}")
    return array


_EVENT_TYPES = (BlockStored, BlockRemoved, AllBlocksCleared)


class BlockIndex:
    """Key → holders map fed by cache events, answering longest-prefix queries.

    Not thread-safe: the Conductor owns it and applies events from one thread.

    Invariants: see the module docstring; `check_invariants` verifies them.
    """

    def __init__(self) -> None:
        self._table = KeyTable()
        self._sources: dict[InstanceId, _SourceState] = {}
        self._instance_of: list[InstanceId | None] = []  # slot → instance; None marks a free slot
        # prefix_lengths' last slot lookup: (instances, slot layout version, their slots, which have none, any)
        self._layout = 0
        self._gather: tuple[Sequence[InstanceId], int, npt.NDArray[np.intp], npt.NDArray[np.bool_], bool] | None = None

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return self._table.size

    def __contains__(self, key: object) -> bool:
        try:
            folded = _fold(key)
        except InvalidRequestError:
            return False
        return self._table.find(folded) >= 0

    @property
    def instances(self) -> tuple[InstanceId, ...]:
        """Instances the index has a source state for, sorted."""
        return tuple(sorted(self._sources))

    @property
    def stale_sources(self) -> tuple[InstanceId, ...]:
        """Sources whose events are refused until `resync`, sorted."""
        return tuple(sorted(s for s, state in self._sources.items() if state.is_stale))

    def num_blocks(self, instance_id: InstanceId) -> int:
        """Keys `instance_id` holds in at least one tier.

        Raises:
            InvalidRequestError: `instance_id` is not a string.
        """
        if not isinstance(instance_id, str):  # an unhashable one would be a bare TypeError
            raise InvalidRequestError(f"instance_id must be an instance id string, got {shown(instance_id)}")
        state = self._sources.get(instance_id)
        return 0 if state is None else int(self._table.counts[state.slot])

    def nbytes(self) -> int:
        """Bytes of the key table's arrays."""
        return self._table.nbytes()

    def holders(self, key: BlockKey) -> tuple[Holder, ...]:
        """Who holds `key`, sorted by tier then instance id (empty if nobody)."""
        entry = self._table.find(_fold(key))
        if entry < 0:
            return ()
        found = [
            Holder(instance, Tier(tier))
            for slot, instance in enumerate(self._instance_of)
            if instance is not None
            for tier in range(_NUM_TIERS)
            if self._table.nibble(entry, slot) >> tier & 1
        ]
        return tuple(sorted(found, key=lambda h: (h.tier, h.instance_id)))

    def match(self, keys: Iterable[BlockKey]) -> PrefixMatch:
        """Each instance's contiguous prefix of `keys`, and the longest.

        Args:
            keys: a request's chained block keys, in order (a sequence or a uint64 array).

        Returns:
            A `PrefixMatch`; an instance holding none of the leading keys is absent.

        Raises:
            InvalidRequestError: `keys` is not a sequence of non-negative integers (bytes and mappings are none).
        """
        per_slot = self._table.match(key_array(keys))
        instance_of = cast("list[InstanceId]", self._instance_of)  # matched slots are live
        lengths = {instance_of[slot]: int(per_slot[slot]) for slot in np.flatnonzero(per_slot).tolist()}
        best_instance: InstanceId | None = None
        best_length = 0
        for instance, n in lengths.items():
            if n > best_length or (n == best_length and best_instance is not None and instance < best_instance):
                best_instance, best_length = instance, n
        return PrefixMatch(lengths=MappingProxyType(lengths), best_instance=best_instance, best_length=best_length)

    def prefix_lengths(self, keys: Iterable[BlockKey], instances: Sequence[InstanceId]) -> npt.NDArray[np.int64]:
        """Each of `instances`' contiguous prefix of `keys`, in their order (0 for one the index
        does not know): `match` as an array, for a caller that asks about the same instances
        every time (the slot lookup is kept while the tuple and the slots stay the same; a list,
        which may change in place, is looked up anew each time).

        Raises:
            InvalidRequestError: a key is not a non-negative integer, or `instances` is not a sequence of instance
                id strings.
        """
        per_slot = self._table.match(key_array(keys))
        gather = self._gather
        if gather is None or gather[0] is not instances or gather[1] != self._layout or type(instances) is not tuple:
            if (
                isinstance(instances, str)
                or not isinstance(instances, Sequence)
                or not all(isinstance(i, str) for i in instances)
            ):
                raise InvalidRequestError(f"instances must be a sequence of instance id strings, got {instances!r:.80}")
            slots = [self._sources[i].slot if i in self._sources else -1 for i in instances]
            unknown = np.array([slot < 0 for slot in slots], dtype=bool)
            gather = (
                instances,
                self._layout,
                np.maximum(np.array(slots, dtype=np.intp), 0),
                unknown,
                bool(unknown.any()),
            )
            self._gather = gather
        lengths: npt.NDArray[np.int64] = per_slot[gather[2]]
        if gather[4]:
            lengths[gather[3]] = 0
        return lengths

    # ------------------------------------------------------------------ events

    def apply(self, event: CacheEvent, *, strict: bool = True) -> SequenceGap | None:
        """Apply one event in its source's sequence.

        Args:
            event: the next event of its source.
            strict: raise lost events (the default: a dropped gap would leave
                the index silently stale); False for a consumer that handles
                gaps itself, which then receives the `SequenceGap`.

        Returns:
            None when applied or ignored as a redelivery; with ``strict=False``,
            a `SequenceGap` when events were lost.

        Raises:
            SequenceGapError: events were lost (``strict``). Either way the
                event is not applied and the source is stale until `resync`.
            InvalidRequestError: not a cache event.
        """
        if not isinstance(event, _EVENT_TYPES):
            raise InvalidRequestError(
                f"apply takes a cache event (BlockStored, BlockRemoved, AllBlocksCleared), got {shown(event)}"
            )
        source = event.source
        # Keys are converted (and validated) before any state changes.
        keys = _NO_KEYS if isinstance(event, AllBlocksCleared) else key_array(event.keys)
        state = self._sources.get(source)
        if state is not None and event.epoch < state.epoch:
            return None  # a late event of an earlier incarnation
        if state is None or state.epoch != event.epoch:
            if event.seq != 0:
                return self._gap(source, event, expected_epoch=event.epoch, expected_seq=0, strict=strict)
            state = self._reset_source(source, epoch=event.epoch, seq=-1)  # restarted empty
        elif state.is_stale or event.seq > state.seq + 1:
            return self._gap(source, event, expected_epoch=state.epoch, expected_seq=state.seq + 1, strict=strict)
        elif event.seq <= state.seq:
            return None
        if isinstance(event, BlockStored):
            self._table.add(keys, state.slot, event.tier)
        elif isinstance(event, AllBlocksCleared):
            self._table.clear_slot(state.slot)
        else:
            self._table.discard(keys, state.slot, event.tier)
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
        require_str("source", source, what="instance id string")
        require_int("epoch", epoch, minimum=0)
        require_int("seq", seq, minimum=-1)  # NaN or a float would let any next event in without a gap check
        if not isinstance(holdings, Mapping):
            raise ConfigError(f"holdings must map tiers to the keys held there, got {shown(holdings)}")
        arrays = [(parse_tier(tier), key_array(keys)) for tier, keys in holdings.items()]
        state = self._reset_source(source, epoch=epoch, seq=seq)
        for tier, keys in arrays:
            self._table.add(keys, state.slot, tier)

    def remove_instance(self, instance_id: InstanceId) -> None:
        """Forget `instance_id` entirely (it is gone); its next event must start an epoch or resync.

        Raises:
            InvalidRequestError: `instance_id` is not a string.
        """
        if not isinstance(instance_id, str):  # an unhashable one would be a bare TypeError
            raise InvalidRequestError(f"instance_id must be an instance id string, got {shown(instance_id)}")
        state = self._sources.pop(instance_id, None)
        if state is not None:
            self._table.clear_slot(state.slot)
            self._instance_of[state.slot] = None
            self._layout += 1

    # ------------------------------------------------------------------ snapshot

    def snapshot(self) -> IndexSnapshot:
        """Everything needed to rebuild this index (keys sorted, as stored: folded to 64 bits)."""
        table = self._table
        sources = []
        for source in sorted(self._sources):
            state = self._sources[source]
            by_tier: list[tuple[Tier, tuple[BlockKey, ...]]] = []
            if table.counts[state.slot]:
                word, shift = divmod(state.slot, SLOTS_PER_WORD)
                nibbles = table.words[:, word] >> np.uint64(4 * shift)
                for tier in Tier:
                    held = (nibbles >> np.uint64(tier)) & np.uint64(1) == 1
                    if held.any():
                        by_tier.append((tier, tuple(np.sort(table.keys[held]).tolist())))
            sources.append(
                SourceSnapshot(
                    source=source,
                    epoch=state.epoch,
                    seq=state.seq,
                    is_stale=state.is_stale,
                    keys_by_tier=tuple(by_tier),
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
        table = self._table
        occupied = table.occupied()
        assert int(occupied.sum()) == table.size, f"size {table.size} != occupied entries {int(occupied.sum())}"
        for entry in np.flatnonzero(occupied).tolist():
            assert table.find(int(table.keys[entry])) == entry, f"key at entry {entry} is not reachable by probing"
        for slot in range(table.num_slots):
            word, shift = divmod(slot, SLOTS_PER_WORD)
            nibbles = (table.words[:, word] >> np.uint64(4 * shift)) & np.uint64(0xF)
            present = (nibbles & np.uint64(8)) != 0
            tiers = (nibbles & np.uint64(7)) != 0
            assert np.array_equal(present, tiers), f"slot {slot}: presence bits disagree with tier bits"
            assert int(present.sum()) == table.counts[slot], (
                f"slot {slot}: count {table.counts[slot]} != {int(present.sum())}"
            )
            if slot >= len(self._instance_of) or self._instance_of[slot] is None:
                assert not present.any(), f"free slot {slot} holds keys"
        live = {instance: slot for slot, instance in enumerate(self._instance_of) if instance is not None}
        assert live == {source: state.slot for source, state in self._sources.items()}, "slot table out of sync"

    # ------------------------------------------------------------------ internals

    def _gap(
        self, source: InstanceId, event: CacheEvent, *, expected_epoch: int, expected_seq: int, strict: bool
    ) -> SequenceGap:
        state = self._sources.get(source)
        if state is None:
            state = self._reset_source(source, epoch=event.epoch, seq=-1)
        state.is_stale = True
        gap = SequenceGap(
            source=source,
            expected_epoch=expected_epoch,
            expected_seq=expected_seq,
            received_epoch=event.epoch,
            received_seq=event.seq,
        )
        if strict:
            raise SequenceGapError(gap)
        return gap

    def _reset_source(self, source: InstanceId, *, epoch: int, seq: int) -> _SourceState:
        """A fresh, empty state for `source`, keeping its slot or taking the lowest free one."""
        state = self._sources.get(source)
        if state is not None:
            self._table.clear_slot(state.slot)
            slot = state.slot
        elif None in self._instance_of:
            slot = self._instance_of.index(None)
            self._instance_of[slot] = source
        else:
            slot = len(self._instance_of)
            self._instance_of.append(source)
            self._table.ensure_slots(slot + 1)
        state = self._sources[source] = _SourceState(epoch=epoch, seq=seq, is_stale=False, slot=slot)
        self._layout += 1
        return state
