"""Obviously-correct eviction policies: one list, full scans, O(n) per operation.

`ReferencePolicy(kind)` models `mooncake.cache.policy` from the definitions
alone, with no heaps, linked lists or incremental bookkeeping:

- the cache is a list of keys in insertion order (oldest first), plus per-key
  facts: last access time on a logical clock (one tick per access), uses since
  insertion, position at insertion, parent at insertion, SIEVE visited bit, pins;
- candidates are recomputed by scanning: not pinned and, prefix-aware, no cached
  key recorded with it as parent (a parent equal to the key itself is ignored);
- LRU / LFU / LengthAware take `min` over the candidates of their rank;
- SIEVE walks the list from the hand (oldest when the hand is None), clearing
  visited bits of candidates, stepping over protected keys, and evicts the first
  unvisited candidate; the hand then rests on the victim's newer neighbour
  (None at the newest end). A failed evict leaves everything as it was;
- `evict_unpinned` is `evict` with every unpinned key a candidate (prefix
  protection aside): the same rank's `min`, or the same sweep, over them.

`reference_prefix_hits` replays requests through a cache driven by a
`ReferencePolicy`, counting hits with a plain set instead of an index and events.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from mooncake.errors import BlockPinnedError, UnknownBlockError
from mooncake.types import BlockKey

__all__ = ["KINDS", "ReferencePolicy", "reference_prefix_hits"]

KINDS = ("lru", "lfu", "length_aware", "sieve")


class ReferencePolicy:
    """A list-based twin of the library's policies (see the module docstring)."""

    def __init__(self, kind: str, *, prefix_aware: bool = True) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown policy kind {kind!r}; expected one of {KINDS}")
        self.kind = kind
        self.prefix_aware = prefix_aware
        self.keys: list[BlockKey] = []  # insertion order, oldest first
        self.clock = 0
        self.last_access: dict[BlockKey, int] = {}
        self.uses: dict[BlockKey, int] = {}
        self.position: dict[BlockKey, int] = {}
        self.parent: dict[BlockKey, BlockKey] = {}
        self.visited: dict[BlockKey, bool] = {}
        self.pins: dict[BlockKey, int] = {}
        self.hand: BlockKey | None = None

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    # Operations ---------------------------------------------------------------
    def access(self, key: BlockKey, *, parent: BlockKey | None = None, position: int = 0) -> None:
        self.clock += 1
        self.last_access[key] = self.clock
        if key in self.keys:
            self.uses[key] += 1
            self.visited[key] = True
            return
        self.keys.append(key)
        self.uses[key] = 1
        self.position[key] = position
        self.visited[key] = False
        if parent is not None and parent != key:
            self.parent[key] = parent

    def evict(self) -> BlockKey | None:
        victim = self.choose()
        if victim is not None:
            self._forget(victim)
        return victim

    def evict_unpinned(self) -> BlockKey | None:
        victim = self.choose(unpinned=True)
        if victim is not None:
            self._forget(victim)
        return victim

    def remove(self, key: BlockKey) -> None:
        if key not in self.keys:
            raise UnknownBlockError(f"reference: {key} is not cached")
        if key in self.pins:
            raise BlockPinnedError(f"reference: {key} is pinned")
        self._forget(key)

    def pin(self, key: BlockKey) -> None:
        if key not in self.keys:
            raise UnknownBlockError(f"reference: {key} is not cached")
        self.pins[key] = self.pins.get(key, 0) + 1

    def unpin(self, key: BlockKey) -> None:
        if key not in self.pins:
            raise UnknownBlockError(f"reference: {key} is not pinned")
        self.pins[key] -= 1
        if not self.pins[key]:
            del self.pins[key]

    # Queries ------------------------------------------------------------------
    def children(self, key: BlockKey) -> list[BlockKey]:
        """Cached keys recorded (at their insertion) with `key` as parent."""
        return [child for child in self.keys if self.parent.get(child) == key]

    def is_candidate(self, key: BlockKey) -> bool:
        if key not in self.keys or key in self.pins:
            return False
        return not (self.prefix_aware and self.children(key))

    def candidates(self, *, unpinned: bool = False) -> list[BlockKey]:
        """The keys `evict` may take; `unpinned`: those `evict_unpinned` may (every key not pinned)."""
        if unpinned:
            return [key for key in self.keys if key not in self.pins]
        return [key for key in self.keys if self.is_candidate(key)]

    def choose(self, *, unpinned: bool = False) -> BlockKey | None:
        """The victim `evict` (`unpinned`: `evict_unpinned`) would take (SIEVE: moves the hand and clears bits,
        as they do)."""
        candidates = self.candidates(unpinned=unpinned)
        if not candidates:
            return None
        if self.kind == "sieve":
            return self._sieve_choose(set(candidates))
        return min(candidates, key=self._rank)

    # Internals ----------------------------------------------------------------
    def _rank(self, key: BlockKey) -> Any:
        if self.kind == "lru":
            return self.last_access[key]
        if self.kind == "lfu":
            return (self.uses[key], self.last_access[key])
        return (self.uses[key], -self.position[key], self.last_access[key])

    def _sieve_choose(self, candidates: set[BlockKey]) -> BlockKey:
        index = 0 if self.hand is None else self.keys.index(self.hand)
        while True:  # ends: a candidate exists, and one lap clears every candidate's bit
            key = self.keys[index]
            if key in candidates:
                if not self.visited[key]:
                    self.hand = key
                    return key
                self.visited[key] = False
            index = (index + 1) % len(self.keys)

    def _forget(self, key: BlockKey) -> None:
        index = self.keys.index(key)
        if self.hand == key:
            self.hand = self.keys[index + 1] if index + 1 < len(self.keys) else None
        del self.keys[index]
        for facts in (self.last_access, self.uses, self.position, self.parent, self.visited):
            facts.pop(key, None)


def reference_prefix_hits(
    requests: Iterable[Sequence[BlockKey]], policy: ReferencePolicy, capacity_blocks: int
) -> tuple[int, int]:
    """(hit blocks, total blocks) of a replay, by the capacity module's rules, with a set for hits.

    Per request: hit = leading keys cached on arrival; then each key in order is
    refreshed if cached, else inserted after evicting while full, its parent the
    request's previous key. The chain never evicts its own blocks (`put_chain`'s
    rule): the first time a key past the head finds the cache full, the keys
    before it that are cached are pinned, and every key from there on once it is
    cached, until the request ends; a key for which nothing can be evicted ends
    the request's chain.
    """
    hits = total = 0
    for keys in requests:
        cached = set(policy.keys)
        for key in keys:
            if key not in cached:
                break
            hits += 1
        total += len(keys)
        protecting = False
        pinned: list[BlockKey] = []
        parent = None
        for position, key in enumerate(keys):
            if key in policy:
                policy.access(key)
            else:
                if len(policy) >= capacity_blocks and position and not protecting:
                    protecting = True
                    pinned += [earlier for earlier in keys[:position] if earlier in policy]
                    for earlier in pinned:
                        policy.pin(earlier)
                while len(policy) >= capacity_blocks and policy.evict() is not None:
                    pass
                if len(policy) >= capacity_blocks:
                    break
                policy.access(key, parent=parent, position=position)
            if protecting:
                policy.pin(key)
                pinned.append(key)
            parent = key
        for key in pinned:
            policy.unpin(key)
    return hits, total
