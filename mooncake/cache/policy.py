"""Eviction policies: which cached block to drop next.

One protocol, four policies:
- `LruPolicy`: least recently used first.
- `LfuPolicy`: least frequently used first, ties least recently used.
- `LengthAwarePolicy`: the paper's LengthAwareCache, LFU-like but, among blocks
  used equally often, blocks that occur later in requests go first (early
  blocks are shared by more prompts); ties least recently used.
- `SievePolicy`: SIEVE (NSDI'24): a FIFO queue with a visited bit and a hand
  that sweeps from oldest to newest, clearing visited bits and evicting the
  first unvisited block. In prefix-aware mode the hand steps over every block
  that still has a cached child, so an eviction costs O(chain length): SIEVE
  is slower there than the heap policies (`mooncake trace capacity TRACE
  --prefix-aware` with `--policy sieve` against `--policy lru` shows it).

The caller owns capacity: it calls `access` for every use of a block (inserting
it when new) and `evict` until what it holds fits. Time is logical (one tick per
access), so a policy is a pure function of its call sequence.

Prefix-aware mode (default) evicts leaf first: a block is not a candidate while
a block recorded as its chain successor is still cached, since a successor
without its prefix can never be matched (vLLM and SGLang evict this way).
Without it, blocks are ranked alone, as in the paper's Table 1. A caller that
caches a block's successors where the policy does not see them (another tier)
protects it with `hold` / `release`, which count as cached children; holds end
when the block leaves the policy. `evict_unpinned` is the fallback of a tier
whose victims are kept cached below it (demoted, not dropped): the policy's
order among unpinned blocks, prefix protection aside.

Invariants:
- `evict` never returns a pinned block, nor (prefix-aware) a block with a cached child.
- `evict` returns None only when no cached block is a candidate.
- `evict_unpinned` never returns a pinned block, and None only when every cached block is pinned.
- Every candidate is reachable by `evict` (heap policies: it has a current entry,
  in the heap or as the entry of the block accessed last).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

from mooncake._checks import require_int
from mooncake.errors import BlockPinnedError, InvalidRequestError, UnknownBlockError
from mooncake.types import BlockKey

__all__ = ["EvictionPolicy", "LengthAwarePolicy", "LfuPolicy", "LruPolicy", "SievePolicy"]


class EvictionPolicy(Protocol):
    """Chooses victims among the blocks it has seen accessed and not yet dropped."""

    def access(self, key: BlockKey, *, parent: BlockKey | None = None, position: int = 0) -> None:
        """Record a use of `key` (inserting it if new); `parent` is its chain predecessor,
        `position` its block index in the request (a policy that ranks by it refuses one that is not an
        integer >= 0 with InvalidRequestError, inserting nothing)."""

    def remove(self, key: BlockKey) -> None:
        """Forget `key`, dropped by the caller (raises if unknown or pinned)."""

    def pin(self, key: BlockKey) -> None:
        """Protect `key` from eviction (reference counted)."""

    def unpin(self, key: BlockKey) -> None:
        """Release one pin of `key`."""

    def evict(self) -> BlockKey | None:
        """Choose, forget and return a victim; None if every block is protected."""

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...


def _unhashable(key: object) -> InvalidRequestError:
    return InvalidRequestError(f"a block key must be hashable (an integer), got {key!r:.80}")


def _lookup(table: dict[BlockKey, int], key: object, default: int) -> int:
    """`table.get(key, default)`; for an unhashable key, what a dict says, as the library's error."""
    try:
        return table.get(key, default)  # type: ignore[call-overload, no-any-return]
    except TypeError:
        raise _unhashable(key) from None


class _PolicyBase:
    """Pins and prefix-awareness, shared by every policy.

    Invariants (`check_invariants`): child counts equal a recount of the parent
    links of cached keys plus the holds; every pin and every hold is on a cached
    key with a positive count.
    """

    def __init__(self, *, prefix_aware: bool = True) -> None:
        self.prefix_aware = prefix_aware
        self._pins: dict[BlockKey, int] = {}
        self._parent: dict[BlockKey, BlockKey] = {}
        # Cached children per key, kept even while the key itself is absent, so a
        # re-inserted parent is protected by children that outlived it.
        self._children: dict[BlockKey, int] = {}
        # Successors cached elsewhere (`hold`), a part of `_children` while the key is cached.
        self._holds: dict[BlockKey, int] = {}

    # Subclass hooks -------------------------------------------------------
    def __contains__(self, key: object) -> bool:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def access(self, key: BlockKey, *, parent: BlockKey | None = None, position: int = 0) -> None:
        """Record a use of `key`, inserting it (and linking `parent`) when new."""
        raise NotImplementedError

    def _delete(self, key: BlockKey) -> None:
        raise NotImplementedError

    def _choose(self) -> BlockKey | None:
        raise NotImplementedError

    def _became_candidate(self, key: BlockKey) -> None:
        """`key` was unpinned or lost its last child."""

    def _choose_unpinned(self) -> BlockKey | None:
        """The first unpinned key in the policy's order, prefix protection aside (O(blocks))."""
        raise NotImplementedError

    # Protocol ---------------------------------------------------------------
    def _require_cached(self, key: BlockKey, verb: str | None) -> None:
        """Raise UnknownBlockError (naming `verb`, the call refused) unless `key` is cached; InvalidRequestError for
        an unhashable key. The message is built only when raised: pins run once per block of a prompt."""
        try:
            is_cached = key in self
        except TypeError:  # unhashable: what a dict says, as the library's error
            raise _unhashable(key) from None
        if not is_cached:
            raise UnknownBlockError(
                f"block {key} is not cached" if verb is None else f"cannot {verb} block {key}: not cached"
            )

    def remove(self, key: BlockKey) -> None:
        self._require_cached(key, None)
        if key in self._pins:
            raise BlockPinnedError(f"block {key} is pinned {self._pins[key]} time(s); unpin before removing")
        self._forget(key)

    def pin(self, key: BlockKey) -> None:
        self._require_cached(key, "pin")
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: BlockKey) -> None:
        count = _lookup(self._pins, key, 0)
        if not count:
            raise UnknownBlockError(f"cannot unpin block {key}: not pinned")
        if count > 1:
            self._pins[key] = count - 1
            return
        del self._pins[key]
        if self.is_candidate(key):
            self._became_candidate(key)

    def evict(self) -> BlockKey | None:
        victim = self._choose()
        if victim is not None:
            self._forget(victim)
        return victim

    def evict_unpinned(self) -> BlockKey | None:
        """Choose, forget and return the first unpinned block in the policy's order, ignoring prefix protection;
        None if every block is pinned. For a tier whose victims stay cached below it (a demotion keeps a prefix
        matchable) when `evict` finds every block protected. O(blocks)."""
        victim = self._choose_unpinned()
        if victim is not None:
            self._forget(victim)
        return victim

    def hold(self, key: BlockKey, count: int = 1) -> None:
        """Protect cached `key` as the chain predecessor of `count` more blocks cached where this policy does not
        see them (another tier): prefix-aware, it is no candidate while it holds one, as with a cached child.
        Unlike a pin, a hold does not stop `remove`; the holds of a key end when it leaves the policy.

        Raises:
            UnknownBlockError: `key` is not cached. InvalidRequestError: `count` is not an integer >= 1.
        """
        require_int("count", count, minimum=1, error=InvalidRequestError)
        self._require_cached(key, "hold")
        self._holds[key] = self._holds.get(key, 0) + count
        self._children[key] = self._children.get(key, 0) + count

    def release(self, key: BlockKey, count: int = 1) -> None:
        """End `count` holds of `key` (it becomes a candidate with its last child and hold, if unpinned).

        Raises:
            UnknownBlockError: `key` has fewer than `count` holds. InvalidRequestError: `count` is not an
                integer >= 1.
        """
        require_int("count", count, minimum=1, error=InvalidRequestError)
        held = _lookup(self._holds, key, 0)
        if held < count:
            raise UnknownBlockError(f"cannot release {count} hold(s) of block {key}: it has {held}")
        if held == count:
            del self._holds[key]
        else:
            self._holds[key] = held - count
        self._drop_children(key, count)

    def num_holds(self, key: BlockKey) -> int:
        """How many holds `key` has (0 when it has none or is not cached); InvalidRequestError for an unhashable
        key, as every call taking a key."""
        return _lookup(self._holds, key, 0)

    # Queries ----------------------------------------------------------------
    def is_pinned(self, key: BlockKey) -> bool:
        """Whether `key` is pinned; InvalidRequestError for an unhashable key."""
        return _lookup(self._pins, key, 0) > 0

    def is_candidate(self, key: BlockKey) -> bool:
        """Whether `evict` may choose `key` now; InvalidRequestError for an unhashable key."""
        try:
            return key in self and self._is_unprotected(key)
        except TypeError:
            raise _unhashable(key) from None

    def _is_unprotected(self, key: BlockKey) -> bool:
        return key not in self._pins and not (self.prefix_aware and key in self._children)

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping disagrees with a recount."""
        recount: dict[BlockKey, int] = {}
        for key, parent in self._parent.items():
            assert key in self, f"parent link kept for dropped block {key}"
            recount[parent] = recount.get(parent, 0) + 1
        for key, held in self._holds.items():
            recount[key] = recount.get(key, 0) + held
        assert recount == self._children, "child counts disagree with parent links and holds"
        assert all(key in self and n > 0 for key, n in self._pins.items()), "pins on dropped blocks"
        assert all(key in self and n > 0 for key, n in self._holds.items()), "holds on dropped blocks"

    # Shared mechanics -------------------------------------------------------
    def _link(self, key: BlockKey, parent: BlockKey | None) -> None:
        """Record `parent` as the chain predecessor of `key`, about to be inserted; InvalidRequestError, recording
        nothing, for an unhashable `parent` (so `access` calls it before it inserts anything: a key inserted before
        the refusal would be cached with no parent count to match, and `evict` would fail on it)."""
        if self.prefix_aware and parent is not None and parent != key:
            children = self._children
            num_children = _lookup(children, parent, 0)
            children[parent] = num_children + 1
            self._parent[key] = parent

    def _forget(self, key: BlockKey) -> None:
        self._delete(key)
        if self._holds:
            held = self._holds.pop(key, 0)
            if held:
                self._drop_children(key, held)
        parent = self._parent.pop(key, None)
        if parent is not None:
            self._drop_children(parent, 1)

    def _drop_children(self, key: BlockKey, count: int) -> None:
        """`key` has `count` fewer cached children (or holds)."""
        remaining = self._children[key] - count
        if remaining:
            self._children[key] = remaining
        else:
            del self._children[key]
            if self.is_candidate(key):
                self._became_candidate(key)


class _HeapPolicy(_PolicyBase):
    """Evicts the candidate of smallest priority, through a lazily cleaned heap.

    Each candidate has an entry (priority, key) with its current priority; stale
    entries (old priority, dropped or protected key) are discarded when popped.
    The entry of the block accessed last waits outside the heap (`_newest`) until
    the next access, and goes in only if it is still current then: a block just
    stored usually gets a child with the next block of its chain, which would
    leave a stale entry for every block but a chain's last. `_choose` compares it
    with the heap's top, so it counts exactly as if it were in the heap.
    """

    _ranked_by_tick: ClassVar[bool] = False  # the priority is the tick itself (LRU): `access` skips `_rank`

    def __init__(self, *, prefix_aware: bool = True) -> None:
        super().__init__(prefix_aware=prefix_aware)
        self._priority: dict[BlockKey, Any] = {}
        self._heap: list[tuple[Any, BlockKey]] = []
        self._newest: tuple[Any, BlockKey] | None = None
        self._tick = 0

    def __contains__(self, key: object) -> bool:
        return key in self._priority

    def __len__(self) -> int:
        return len(self._priority)

    def _rank(self, key: BlockKey, position: int | None) -> Any:
        """New priority of `key` at an access (`position` is None for a re-access)."""
        raise NotImplementedError

    def access(self, key: BlockKey, *, parent: BlockKey | None = None, position: int = 0) -> None:
        # One flat method rather than the base's insert/touch hooks: the capacity
        # analysis calls this once per block of a trace.
        current = self._priority
        try:
            is_cached = key in current
        except TypeError:  # unhashable: refused before the clock or any table moves
            raise _unhashable(key) from None
        if not is_cached:  # the new key's arguments are refused before anything moves, too
            if not self._ranked_by_tick and (type(position) is not int or position < 0):
                # Ranked by it: None would read as a re-access.
                position = require_int("position", position, minimum=0, error=InvalidRequestError)
            self._link(key, parent)
        tick = self._tick = self._tick + 1
        if is_cached:
            priority = current[key] = tick if self._ranked_by_tick else self._rank(key, None)
        else:
            priority = current[key] = tick if self._ranked_by_tick else self._rank(key, position)
        pins, children, prefix_aware = self._pins, self._children, self.prefix_aware
        newest = self._newest
        if newest is not None:
            self._newest = None
            old, waiting = newest
            if current.get(waiting) == old and waiting not in pins and not (prefix_aware and waiting in children):
                heap = self._heap
                heapq.heappush(heap, newest)
                if len(heap) > 4 * len(current) + 1024:
                    self._heap = [(p, k) for k, p in current.items() if self.is_candidate(k)]
                    heapq.heapify(self._heap)
        if key not in pins and not (prefix_aware and key in children):  # _is_unprotected, inlined
            self._newest = (priority, key)

    def _delete(self, key: BlockKey) -> None:
        del self._priority[key]

    def _became_candidate(self, key: BlockKey) -> None:
        heapq.heappush(self._heap, (self._priority[key], key))

    def _choose(self) -> BlockKey | None:
        heap, current, pins, children = self._heap, self._priority, self._pins, self._children
        prefix_aware = self.prefix_aware
        while heap:
            priority, key = heap[0]
            # Inlined is_candidate: this loop is the policy's hot path.
            if current.get(key) == priority and key not in pins and not (prefix_aware and key in children):
                break
            heapq.heappop(heap)
        newest = self._newest
        if newest is not None:
            priority, key = newest
            if current.get(key) != priority or key in pins or (prefix_aware and key in children):
                self._newest = None
            elif not heap or newest < heap[0]:
                self._newest = None
                return key
        return heapq.heappop(heap)[1] if heap else None

    def _choose_unpinned(self) -> BlockKey | None:
        pins = self._pins
        best = min(((priority, key) for key, priority in self._priority.items() if key not in pins), default=None)
        return None if best is None else best[1]

    def check_invariants(self) -> None:
        super().check_invariants()
        entries = set(self._heap) | ({self._newest} if self._newest is not None else set())
        for key, priority in self._priority.items():
            if self.is_candidate(key):
                assert (priority, key) in entries, f"candidate {key} has no current heap entry"


class LruPolicy(_HeapPolicy):
    """Least recently used first."""

    _ranked_by_tick = True

    def _rank(self, key: BlockKey, position: int | None) -> Any:
        return self._tick  # the logical clock: one tick per access


class LfuPolicy(_HeapPolicy):
    """Least frequently used first (counts since insertion); ties least recently used."""

    def _rank(self, key: BlockKey, position: int | None) -> Any:
        uses = 1 if position is not None else self._priority[key][0] + 1
        return (uses, self._tick)


class LengthAwarePolicy(_HeapPolicy):
    """LFU whose ties go to the block later in its request first; then least recently used."""

    def _rank(self, key: BlockKey, position: int | None) -> Any:
        if position is None:  # a re-access: one more use, same position
            uses, negated_position, _ = self._priority[key]
            return (uses + 1, negated_position, self._tick)
        return (1, -position, self._tick)


class SievePolicy(_PolicyBase):
    """SIEVE: FIFO order, a visited bit per block, and a hand sweeping oldest → newest.

    On `evict` the hand clears visited bits until it meets an unvisited
    candidate, evicts it and stays where it was; new blocks enter at the newest
    end. Protected blocks are stepped over. Two sweeps bound the search.
    """

    def __init__(self, *, prefix_aware: bool = True) -> None:
        super().__init__(prefix_aware=prefix_aware)
        self._visited: dict[BlockKey, bool] = {}
        self._newer: dict[BlockKey, BlockKey | None] = {}
        self._older: dict[BlockKey, BlockKey | None] = {}
        self._oldest: BlockKey | None = None
        self._newest: BlockKey | None = None
        self._hand: BlockKey | None = None

    def __contains__(self, key: object) -> bool:
        return key in self._visited

    def __len__(self) -> int:
        return len(self._visited)

    def access(self, key: BlockKey, *, parent: BlockKey | None = None, position: int = 0) -> None:
        try:
            is_cached = key in self._visited
        except TypeError:
            raise _unhashable(key) from None
        if is_cached:
            self._visited[key] = True
            return
        self._link(key, parent)  # first: it refuses an unhashable parent before anything moves
        self._visited[key] = False
        self._older[key] = self._newest
        self._newer[key] = None
        if self._newest is None:
            self._oldest = key
        else:
            self._newer[self._newest] = key
        self._newest = key

    def _delete(self, key: BlockKey) -> None:
        older, newer = self._older.pop(key), self._newer.pop(key)
        del self._visited[key]
        if older is None:
            self._oldest = newer
        else:
            self._newer[older] = newer
        if newer is None:
            self._newest = older
        else:
            self._older[newer] = older
        if self._hand == key:
            self._hand = newer

    def _choose(self) -> BlockKey | None:
        return self._sweep(self._is_unprotected)  # the hand passes cached blocks alone

    def _choose_unpinned(self) -> BlockKey | None:
        """The sweep of `_choose` with every unpinned block a candidate."""
        pins = self._pins
        return self._sweep(lambda key: key not in pins)

    def _sweep(self, candidate: Callable[[BlockKey], bool]) -> BlockKey | None:
        """SIEVE's hand: from where it stopped, towards the newest and round again, the first `candidate` not
        visited since the hand last passed (each visited one passed is cleared); None, the hand where it was,
        when two rounds find none."""
        node = self._hand
        for _ in range(2 * len(self._visited) + 1):
            if node is None:
                node = self._oldest
                if node is None:
                    return None
            if candidate(node):
                if not self._visited[node]:
                    self._hand = node
                    return node
                self._visited[node] = False
            node = self._newer[node]
        return None  # nothing evictable: the hand stays where it was

    def check_invariants(self) -> None:
        super().check_invariants()
        order, node = [], self._oldest
        while node is not None:
            order.append(node)
            node = self._newer[node]
        assert len(order) == len(self._visited) and set(order) == set(self._visited), "FIFO list broken"
        assert self._hand is None or self._hand in self._visited, "hand on a dropped block"
