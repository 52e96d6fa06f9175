"""The cache events' wire format between a worker and the gateway (no torch: the gateway never loads it).

A prefill worker reports its node's cache events with `prefill.done` as JSON
lists, in order; the gateway turns them back into events for the Conductor's
index:

    ["stored" | "removed", source, seq, epoch, tier, [key, ...]]
    ["cleared", source, seq, epoch]

Invariant: `event_from_wire(event_to_wire(e)) == e` for every cache event.
"""

from __future__ import annotations

from typing import Any

from mooncake.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent
from mooncake.types import InstanceId

__all__ = ["event_from_wire", "event_to_wire"]


def event_to_wire(event: CacheEvent) -> list[Any]:
    """`event` as a JSON list."""
    if isinstance(event, AllBlocksCleared):
        return ["cleared", event.source, event.seq, event.epoch]
    kind = "stored" if isinstance(event, BlockStored) else "removed"
    return [kind, event.source, event.seq, event.epoch, int(event.tier), [int(k) for k in event.keys]]


def event_from_wire(data: list[Any]) -> CacheEvent:
    """The event `event_to_wire` made `data` from."""
    if data[0] == "cleared":
        return AllBlocksCleared(source=InstanceId(data[1]), seq=data[2], epoch=data[3])
    kind = BlockStored if data[0] == "stored" else BlockRemoved
    return kind(source=InstanceId(data[1]), seq=data[2], epoch=data[3], tier=data[4], keys=data[5])
