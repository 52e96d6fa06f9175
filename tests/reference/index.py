"""A brute-force model of `mooncake.cache.index.BlockIndex`, for tests.

Each source keeps a set of keys per tier and its (epoch, seq, stale) state; every
query walks everything. Event sequencing follows the contract of the index's
module docstring: a source's first event of an epoch has seq 0 and each later
one seq + 1; a higher epoch drops the source's holdings and a lower one is
ignored; a repeated or older seq is
ignored; a jump (or any event while stale) is a `SequenceGap`, not applied, and
leaves the source stale until `resync`. An instance holds a key if it holds it
in any tier.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

from mooncake.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent, SequenceGap
from mooncake.cache.index import Holder
from mooncake.types import BlockKey, InstanceId, Tier

__all__ = ["ReferenceIndex", "ReferenceMatch", "ReferenceSource"]


def _empty_holdings() -> dict[Tier, set[BlockKey]]:
    return {tier: set() for tier in Tier}


@attrs.define
class ReferenceSource:
    """What the model knows of one source."""

    epoch: int
    seq: int
    is_stale: bool = False
    holdings: dict[Tier, set[BlockKey]] = attrs.Factory(_empty_holdings)

    def held_keys(self) -> set[BlockKey]:
        return set().union(*self.holdings.values())


@attrs.frozen(kw_only=True)
class ReferenceMatch:
    """The expected `PrefixMatch`: lengths (>= 1 only), best instance and length."""

    lengths: dict[InstanceId, int]
    best_instance: InstanceId | None
    best_length: int


class ReferenceIndex:
    """Dict-of-sets model of the block index."""

    def __init__(self) -> None:
        self.sources: dict[InstanceId, ReferenceSource] = {}

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return len(set().union(*(source.held_keys() for source in self.sources.values())))

    @property
    def instances(self) -> tuple[InstanceId, ...]:
        return tuple(sorted(self.sources))

    @property
    def stale_sources(self) -> tuple[InstanceId, ...]:
        return tuple(sorted(s for s, source in self.sources.items() if source.is_stale))

    def holds(self, instance_id: InstanceId, key: BlockKey) -> bool:
        source = self.sources.get(instance_id)
        return source is not None and any(key in keys for keys in source.holdings.values())

    def num_blocks(self, instance_id: InstanceId) -> int:
        source = self.sources.get(instance_id)
        return 0 if source is None else len(source.held_keys())

    def holders(self, key: BlockKey) -> tuple[Holder, ...]:
        found = [
            Holder(instance, tier)
            for instance, source in self.sources.items()
            for tier, keys in source.holdings.items()
            if key in keys
        ]
        return tuple(sorted(found, key=lambda h: (h.tier, h.instance_id)))

    def holdings(self, instance_id: InstanceId) -> dict[Tier, frozenset[BlockKey]]:
        """Non-empty tiers of `instance_id` → the keys held there."""
        source = self.sources.get(instance_id)
        if source is None:
            return {}
        return {tier: frozenset(keys) for tier, keys in source.holdings.items() if keys}

    def match(self, keys: Iterable[BlockKey]) -> ReferenceMatch:
        keys = list(keys)
        lengths = {}
        for instance in self.sources:
            length = 0
            while length < len(keys) and self.holds(instance, keys[length]):
                length += 1
            if length:
                lengths[instance] = length
        if not lengths:
            return ReferenceMatch(lengths={}, best_instance=None, best_length=0)
        best = min(lengths, key=lambda instance: (-lengths[instance], instance))
        return ReferenceMatch(lengths=lengths, best_instance=best, best_length=lengths[best])

    # ------------------------------------------------------------------ updates

    def apply(self, event: CacheEvent) -> SequenceGap | None:
        state = self.sources.get(event.source)
        if state is not None and event.epoch < state.epoch:
            return None
        if state is None or state.epoch != event.epoch:
            if event.seq != 0:
                if state is None:
                    self.sources[event.source] = ReferenceSource(epoch=event.epoch, seq=-1, is_stale=True)
                else:
                    state.is_stale = True
                return self._gap(event, expected_epoch=event.epoch, expected_seq=0)
            state = self.sources[event.source] = ReferenceSource(epoch=event.epoch, seq=-1)
        elif state.is_stale or event.seq > state.seq + 1:
            state.is_stale = True
            return self._gap(event, expected_epoch=state.epoch, expected_seq=state.seq + 1)
        elif event.seq <= state.seq:
            return None
        if isinstance(event, BlockStored):
            state.holdings[event.tier].update(event.keys)
        elif isinstance(event, BlockRemoved):
            state.holdings[event.tier].difference_update(event.keys)
        else:
            assert isinstance(event, AllBlocksCleared)
            state.holdings = _empty_holdings()
        state.seq = event.seq
        return None

    def resync(self, source: InstanceId, holdings: Mapping[Tier, Iterable[BlockKey]], *, epoch: int, seq: int) -> None:
        state = self.sources[source] = ReferenceSource(epoch=epoch, seq=seq)
        for tier, keys in holdings.items():
            state.holdings[Tier(tier)].update(keys)

    def remove_instance(self, instance_id: InstanceId) -> None:
        self.sources.pop(instance_id, None)

    @staticmethod
    def _gap(event: CacheEvent, *, expected_epoch: int, expected_seq: int) -> SequenceGap:
        return SequenceGap(
            source=event.source,
            expected_epoch=expected_epoch,
            expected_seq=expected_seq,
            received_epoch=event.epoch,
            received_seq=event.seq,
        )
