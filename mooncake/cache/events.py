"""Cache events: how a cache tells the global index what it holds.

A source (one instance's cache) publishes `BlockStored`, `BlockRemoved` and
`AllBlocksCleared`, each stamped with the source's `epoch` and a sequence number
that rises by exactly one per event within the epoch, starting at 0. A source
that restarts picks a higher epoch (its start time in ns, say); events of a
lower epoch than the one a consumer has seen are stragglers and are ignored. A consumer that sees a sequence number jump has
lost events and must ask the source for a snapshot (`SequenceGap`); this is how
vLLM's KV-event publishers and Dynamo-style routers stay consistent, too.
"""

from __future__ import annotations

from typing import Any

import attrs

from mooncake._checks import int_at_least, require_str, shown
from mooncake.errors import ConfigError
from mooncake.types import BlockKey, InstanceId, Tier, key_tuple

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheEvent",
    "SequenceGap",
]


def _source(_instance: object, attribute: attrs.Attribute[InstanceId], value: object) -> None:
    # An instance id, as the index keys its sources by and sorts them: a non-empty string.
    require_str(attribute.name, value, what="instance id string")


def parse_tier(value: Any) -> Tier:
    """A tier, its value or its name ("DRAM"); ConfigError naming the tiers for anything else (a bool too: True
    would read as tier 1)."""
    try:
        if isinstance(value, bool):
            raise ValueError(value)
        return Tier[value] if isinstance(value, str) else Tier(value)
    except (KeyError, ValueError, TypeError):
        raise ConfigError(f"tier must be one of {', '.join(t.name for t in Tier)}, got {shown(value)}") from None


@attrs.frozen(kw_only=True)
class _BlockChange:
    """A change to `keys` held by `source` in `tier`; the subclass says which (an event
    of one kind never equals one of the other)."""

    source: InstanceId = attrs.field(validator=_source)
    seq: int = attrs.field(validator=int_at_least(0))
    keys: tuple[BlockKey, ...] = attrs.field(converter=key_tuple)
    tier: Tier = attrs.field(converter=parse_tier)
    epoch: int = attrs.field(default=0, validator=int_at_least(0))


@attrs.frozen(kw_only=True)
class BlockStored(_BlockChange):
    """`keys` are now held by `source` in `tier` (idempotent per key)."""


@attrs.frozen(kw_only=True)
class BlockRemoved(_BlockChange):
    """`keys` are no longer held by `source` in `tier` (keys it did not hold are ignored)."""


@attrs.frozen(kw_only=True)
class AllBlocksCleared:
    """`source` dropped every block in every tier."""

    source: InstanceId = attrs.field(validator=_source)
    seq: int = attrs.field(validator=int_at_least(0))
    epoch: int = attrs.field(default=0, validator=int_at_least(0))


CacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@attrs.frozen(kw_only=True)
class SequenceGap:
    """A consumer missed events from `source`: it expected `expected_seq` of
    `expected_epoch` and received `received_seq` of `received_epoch`.
    The source should be asked for a snapshot of its holdings."""

    source: InstanceId
    expected_epoch: int
    expected_seq: int
    received_epoch: int
    received_seq: int
