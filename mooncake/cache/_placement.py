"""Block placement: the tier and page each block of a tiered cache occupies, and the moves between tiers.

`BlockPlacement` is the mechanism under `TieredCache` (module `tiered`, which
holds the public API and its locking contract). It keeps one `Entry` per block
(tier level, page, length, checksum, chain parent, pins, state), one eviction
policy per tier, the change log the cache's events are made from, and the
counters of `CacheStats`. Every move runs with the lock held:

- making room in a tier takes a free page, or else evicts the tier's policy
  victim and demotes it to the next tier down, which makes room the same way
  (or, where all its pages are pinned, to the one below it); a victim that no
  lower tier can take is dropped (unless a successor of it is cached: below);
- promotion moves a block read from a lower tier into the first tier, making
  room there; the demotions it causes end in the page the block leaves, so in
  a full hierarchy it loses nothing; when every first-tier page is pinned, the
  block is read in place;
- a move copies the bytes (verified when they come from SSD) and re-homes the
  entry; bytes that fail verification make the block a miss and drop it (with
  a warning on the `mooncake.cache` logger naming tier, block and reason: the
  caller sees only a miss);
- an I/O error (a write refused) goes on to the caller from any depth of a
  cascade, each block being moved left whole where it was (back in its policy)
  or where it went, or dropped; a page is released only after the last record
  of its block, so no block outlives its page;
- a page release never fails a call: a pool's `free` that raises an OSError
  has released the page all the same (`SsdPagePool.free`, whose header zeroing
  failed), after the call's changes are made, so the error is counted in
  `stats.failed_releases` and logged as a warning instead (`_release`): an
  `unpin` that drops a block must not stop a caller releasing several pins.

Prefix-aware eviction spans the tiers: each tier's policy sees only the chain
links among its own blocks, so the last tier, whose victims are dropped, would
drop a block whose successor lives in a faster tier (a suffix block promoted
alone, or stored after its prefix was demoted), leaving a block no prompt can
match. There the placement counts each block's cached successors in every
tier and holds the block in the last tier's policy (`hold`) once per successor
instead of linking it; a policy without holds ranks blocks by its own links.
A tier above the last demotes rather than drops, so where its policy finds
every block protected by a successor it falls back to the policy's order among
unpinned blocks (`evict_unpinned`), provided a lower tier takes the victim.
A block being put counts as a successor of its parent, which is kept while
anything else can go; where nothing else can (a chain fills what eviction
could free), the parent is the one dropped: it is the deepest cached block of
its chain, and losing it strands only the new block, so with nothing pinned a
put always finds room (some cached block always has no cached successor).

Each change is logged as (`STORED` or `REMOVED`, tier level, key), in order;
a block that fails verification is logged removed when found (it is no longer
cached, though a pin may keep its page a while), and not again when dropped;
`group_changes` folds a log into one group of keys per kind and tier wherever
that keeps the order of changes to each key.

Invariants (`check_invariants`):
- each cached key has one page, allocated in its tier's pool, and each
  allocated page belongs to exactly one key (or a write in progress, or a
  copy that failed verification and was replaced while pinned: set aside,
  out of every policy, until its last pin);
- a tier's policy knows exactly the ready keys of that tier; pinned keys are
  pinned in it;
- used bytes never exceed a tier's capacity (pages are the unit of capacity);
- with holds (more than one tier, a policy offering them): the successor counts
  equal a recount of the parent links of cached and claimed blocks (a put
  drops its block's parent to make room for it only where nothing else can go:
  `_claim`), and each block of the
  last tier's policy has one hold per cached successor, so no block is dropped
  from the last tier by eviction while a successor is cached in any tier; nor
  from a tier above it, whose victim stays where no lower tier takes it and a
  successor is cached (another victim goes instead).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence

import attrs
import xxhash

from mooncake._checks import require_iterable, shown
from mooncake.cache.events import parse_tier
from mooncake.cache.policy import EvictionPolicy
from mooncake.cache.pool import PageBytes, PagePool
from mooncake.errors import CapacityError, ConfigError, IntegrityError, UnknownBlockError
from mooncake.types import BlockKey, Tier

__all__ = ["REMOVED", "STORED", "BlockPlacement", "CacheStats", "Entry", "group_changes", "is_policy"]

LOG = logging.getLogger("mooncake.cache")
STORED, REMOVED = 0, 1  # the kinds of change in the log
_CORRUPT: tuple[None] = (None,)  # what a promotion carries when its block failed verification as it left
# What the cache uses of a `PagePool` and an `EvictionPolicy` (checked once, at construction).
_POOL_ATTRIBUTES = (
    "tier",
    "page_bytes",
    "num_pages",
    "holds_bytes",
    "zero_copy",
    "try_allocate",
    "free",
    "write",
    "read",
)
_POLICY_METHODS = ("access", "remove", "pin", "unpin", "evict")
_HOLD_METHODS = ("hold", "release", "num_holds")  # optional: cross-tier prefix protection in the last tier


def is_policy(value: object, methods: Iterable[str]) -> bool:
    """Whether `value` is an eviction policy with each of `methods` (those its user calls): an object, not a class,
    whose methods are there too but unbound (`LruPolicy` where `LruPolicy()` was meant)."""
    return not isinstance(value, type) and all(hasattr(value, name) for name in methods)


@attrs.frozen(kw_only=True)
class CacheStats:
    """Counters since the cache was created."""

    hits: int
    misses: int
    puts: int
    demotions: int
    promotions: int
    drops: int
    corrupt_blocks: int
    failed_releases: int  # pages released whose release raised (an SSD header not zeroed): free all the same


@attrs.define(eq=False)
class Entry:
    """Where one block is and what state it is in."""

    level: int
    page: int
    length: int
    checksum: int | None
    parent: BlockKey | None
    pins: int = 0
    position: int = 0
    ready: bool = False  # False while its first write is in progress
    corrupt: bool = False  # failed verification; dropped when the last pin goes
    lower_reads: int = 0
    reads: int = 0  # the pins held by reads in progress outside the lock (a part of `pins`)

    @property
    def is_live(self) -> bool:
        return self.ready and not self.corrupt


class BlockPlacement:
    """Blocks → (tier, page) across `pools`, fastest first, with one eviction policy per tier.

    Args:
        pools: page pools, fastest first, with equal `page_bytes` and distinct tiers, all holding bytes or all
            metadata-only; pages a pool recovered (an SSD pool reopened) are adopted as cached blocks.
        policy: makes one eviction policy per tier.
        promote_after: promote a block to the first tier on this many reads in a
            lower tier (0: never).
    """

    def __init__(self, pools: Sequence[PagePool], *, policy: Callable[[], EvictionPolicy], promote_after: int) -> None:
        pools = tuple(require_iterable("pools", () if pools is None else pools))
        if not pools:
            raise ConfigError("pools must name at least one tier")
        for pool in pools:  # else an AttributeError from the first use of whatever it is
            if not all(hasattr(pool, name) for name in _POOL_ATTRIBUTES):
                raise ConfigError(f"pools must be page pools (DramPagePool, SsdPagePool, ...), got {shown(pool)}")
        if not callable(policy):
            raise ConfigError(
                f"policy must make an eviction policy (LruPolicy, a function of none), got {shown(policy)}"
            )
        sizes = {pool.page_bytes for pool in pools}
        if len(sizes) != 1:
            raise ConfigError(f"every tier must use one page size, got {sorted(sizes)}")
        tiers = [pool.tier for pool in pools]
        if len(set(tiers)) != len(tiers):
            raise ConfigError(f"tiers must be distinct, got {[t.name for t in tiers]}")
        # A block moves between tiers whole: a demotion into a metadata tier would drop its bytes while the block
        # stays cached (and announced), and one out of it would have no bytes to write.
        if len({pool.holds_bytes for pool in pools}) != 1:
            holding = [pool.tier.name for pool in pools if pool.holds_bytes]
            metadata = [pool.tier.name for pool in pools if not pool.holds_bytes]
            raise ConfigError(
                f"every tier must hold bytes, or none: {holding} hold bytes, {metadata} are metadata-only"
            )
        if isinstance(promote_after, bool) or not isinstance(promote_after, int) or promote_after < 0:
            raise ConfigError(f"promote_after must be an integer >= 0, got {shown(promote_after)}")
        self.pools = tuple(pools)
        self.page_bytes = pools[0].page_bytes
        self.promote_after = promote_after
        self._policies = [policy() for _ in pools]
        if not is_policy(self._policies[0], _POLICY_METHODS):
            raise ConfigError(f"policy must make an eviction policy, but it made {shown(self._policies[0])}")
        self._entries: dict[BlockKey, Entry] = {}
        self._last = len(pools) - 1
        # Cross-tier prefix protection (module docstring): the last tier's policy holds each of its blocks once
        # per successor cached anywhere; counts kept while a block is not cached, as a policy keeps its links.
        last = self._policies[-1]
        self._has_holds = (
            self._last > 0
            and getattr(last, "prefix_aware", True)  # one that ranks blocks alone protects no prefix
            and all(hasattr(last, name) for name in _HOLD_METHODS)
        )
        self._successors: dict[BlockKey, int] = {}
        # Copies that failed verification while pinned and were then replaced by a new copy of their key: out of
        # the cache, each holds its page until its last pin goes.
        self._aside: dict[BlockKey, list[Entry]] = {}
        self._lock = threading.RLock()
        self._log: list[tuple[int, int, BlockKey]] = []
        self._counts = dict.fromkeys(attrs.fields_dict(CacheStats), 0)
        self._leaving: tuple[BlockKey, Entry] | None = None  # the block `_promote` moves, until `_vacate` takes it
        self._carried: tuple[memoryview | None] | None = None  # its bytes, once taken
        for level, pool in enumerate(self.pools):
            for found in getattr(pool, "recovered", ()):
                if found.key in self._entries:  # the same block recovered in two tiers: keep the faster
                    self._release(level, found.page)
                    continue
                entry = self._entries[found.key] = Entry(
                    level, found.page, found.length, found.checksum, None, ready=True
                )
                self._enter(found.key, entry)
                self._log.append((STORED, level, found.key))

    def check_invariants(self) -> None:
        """Raise AssertionError if an invariant of the module docstring fails."""
        with self._lock:
            aside = [entry for entries in self._aside.values() for entry in entries]
            for key, entries in self._aside.items():
                assert entries, f"block {key}: an empty list of copies set aside"
                for entry in entries:
                    assert entry.corrupt and 0 <= entry.reads <= entry.pins and entry.pins > 0, f"block {key}: {entry}"
                    assert self._entries.get(key) is not entry, f"block {key}: set aside and cached"
            for level, pool in enumerate(self.pools):
                here = {k: e for k, e in self._entries.items() if e.level == level}
                pages = [e.page for e in here.values()] + [e.page for e in aside if e.level == level]
                assert len(set(pages)) == len(pages), f"tier {pool.tier.name}: two keys share a page"
                assert pool.num_pages - pool.num_free == len(pages), f"tier {pool.tier.name}: pages leaked"
                ready = {k for k, e in here.items() if e.ready}
                policy = self._policies[level]
                assert len(policy) == len(ready) and all(k in policy for k in ready), "policy out of sync"
                for key, entry in here.items():
                    assert entry.pins >= entry.reads >= 0, f"block {key}: pins {entry.pins}, reads {entry.reads}"
                    assert entry.length <= pool.page_bytes
                    if entry.ready:
                        is_pinned = getattr(policy, "is_pinned", None)
                        if is_pinned is not None:
                            assert is_pinned(key) == (entry.pins > 0), f"block {key}: pin state out of sync"
            if self._has_holds:
                recount: dict[BlockKey, int] = {}
                for key, entry in self._entries.items():  # ready or claimed
                    if entry.parent is not None and entry.parent != key:
                        recount[entry.parent] = recount.get(entry.parent, 0) + 1
                assert recount == self._successors, "successor counts disagree with the parent links"
                last = self._policies[-1]
                for key, entry in self._entries.items():
                    if entry.ready and entry.level == self._last:
                        held, expected = last.num_holds(key), self._successors.get(key, 0)  # type: ignore[attr-defined]
                        assert held == expected, f"block {key}: {held} holds for {expected} cached successors"

    def _enter(self, key: BlockKey, entry: Entry) -> None:
        """Insert ready `key` into the policy of its tier (lock held): linked to its parent, or, in the last tier
        with holds, held once per cached successor instead (module docstring)."""
        policy = self._policies[entry.level]
        if self._has_holds and entry.level == self._last:
            policy.access(key, position=entry.position)
            successors = self._successors.get(key)
            if successors:
                policy.hold(key, successors)  # type: ignore[attr-defined]
        else:
            policy.access(key, parent=entry.parent, position=entry.position)

    def _add_successor(self, key: BlockKey, parent: BlockKey | None) -> None:
        """`key`, child of `parent`, is stored or claimed (lock held): it counts as a cached successor of its
        parent (with holds); a claimed one already, so that making room for it never drops its parent."""
        if parent is None or parent == key:
            return
        self._successors[parent] = self._successors.get(parent, 0) + 1
        last = self._policies[-1]
        if parent in last:
            last.hold(parent)  # type: ignore[attr-defined]

    def _remove_successor(self, key: BlockKey, parent: BlockKey | None) -> None:
        """`key`, child of `parent`, leaves the cache or its claim (lock held): its parent has one successor
        fewer (with holds)."""
        if parent is None or parent == key:
            return
        remaining = self._successors[parent] - 1
        if remaining:
            self._successors[parent] = remaining
        else:
            del self._successors[parent]
        last = self._policies[-1]
        if parent in last:
            last.release(parent)  # type: ignore[attr-defined]

    def _level_of(self, tier: Tier | int | str) -> int:
        tier = parse_tier(tier)
        for level, pool in enumerate(self.pools):
            if pool.tier == tier:
                return level
        raise ConfigError(f"this cache has no {tier.name} tier")

    def _ready_entry(self, key: BlockKey) -> Entry:
        entry = self._entries.get(key)
        if entry is None or not entry.ready:
            raise UnknownBlockError(f"block {key} is not cached")
        return entry

    def _unpin_entry(self, key: BlockKey, entry: Entry) -> None:
        entry.pins -= 1
        if self._entries.get(key) is not entry:  # set aside: out of every policy, it holds only its page
            if entry.pins == 0:
                copies = self._aside[key]
                copies.remove(entry)
                if not copies:
                    del self._aside[key]
                self._release(entry.level, entry.page)  # last: see `_drop`
            return
        self._policies[entry.level].unpin(key)
        if entry.corrupt and entry.pins == 0:
            self._policies[entry.level].remove(key)
            self._drop(key, entry)
            self._counts["corrupt_blocks"] += 1

    def _found_corrupt(self, key: BlockKey, entry: Entry) -> None:
        """A read of `entry` failed verification (lock held): that read is a miss, and the
        block is dropped now, or when its last pin goes."""
        self._counts["hits"] -= 1
        self._counts["misses"] += 1
        self._mark_corrupt(key, entry)

    def _mark_corrupt(self, key: BlockKey, entry: Entry) -> None:
        """`entry` failed verification (lock held): it is no longer cached, so it is logged removed now, even
        while pins keep its page; dropping it later logs nothing more (`_forget`)."""
        if not entry.corrupt:
            entry.corrupt = True
            self._log.append((REMOVED, entry.level, key))

    def _warn_corrupt(self, key: BlockKey, level: int, reason: BaseException) -> None:
        """Log that block `key` of tier `level` failed verification (`reason`) and is dropped: callers see only a
        miss (serving recomputes the block), so this is where a failing disk shows."""
        LOG.warning(
            "block %#x in the %s tier failed verification and is dropped: %s", key, self.pools[level].tier.name, reason
        )

    def _unless_corrupt(self, key: BlockKey, entry: Entry | None) -> Entry | None:
        """`key`'s entry as a new copy of the block must respect it (lock held): None where there is none, or where
        it failed verification and a reader still pins it. That copy is no longer cached, so the new one takes its
        place: it leaves the cache now (as it would at its last unpin), and its page stays held, set aside, until
        those pins go. (Seeing it as cached, a put of the recomputed block would store nothing, and the key would
        be gone at the unpin.)"""
        if entry is None or not entry.corrupt:
            return entry
        policy = self._policies[entry.level]
        for _ in range(entry.pins):
            policy.unpin(key)
        policy.remove(key)
        self._forget(key, entry)
        self._counts["corrupt_blocks"] += 1
        self._aside.setdefault(key, []).append(entry)
        return None

    def _should_promote(self, entry: Entry, *, reads_ahead: int = 0) -> bool:
        """Whether `entry` (in a lower tier) moves up now, or after `reads_ahead` more reads."""
        return bool(self.promote_after) and entry.lower_reads + reads_ahead >= self.promote_after and entry.pins == 0

    def _claim(self, key: BlockKey, length: int, parent: BlockKey | None, position: int) -> Entry:
        """A first-tier page for a new block, held (pinned, not ready) until `_publish` (lock held).

        With holds the claim counts as a successor of `parent` first, so that making room prefers any other
        victim to it. Where nothing else can go (its chain fills every page the cascade could free, and the
        deepest cached block of that chain is `parent` itself), the claim stops protecting it and room is made
        again: a put whose only obstacle is its own prefix must not fail, as unpinned blocks always make room.
        """
        if self._has_holds:
            self._add_successor(key, parent)
        try:
            page = self._try_make_room(0)
            if page is None and self._has_holds and parent is not None and parent != key:
                self._remove_successor(key, parent)
                try:
                    page = self._try_make_room(0)
                finally:
                    self._add_successor(key, parent)
            if page is None:
                page = self._make_room(0, needed_for=key)  # raises CapacityError, explaining why
        except BaseException:
            if self._has_holds:
                self._remove_successor(key, parent)
            raise
        entry = self._entries[key] = Entry(0, page, length, None, parent, pins=1, position=position)
        return entry

    def _publish(self, key: BlockKey, entry: Entry, checksum: int | None) -> None:
        """Make a claimed block visible: it joins its tier's policy and the event log."""
        with self._lock:
            if self._entries.get(key) is not entry or entry.ready:
                raise UnknownBlockError(f"block {key} is no longer reserved (aborted or committed meanwhile)")
            entry.checksum = checksum if checksum is not None else entry.checksum
            entry.pins -= 1
            entry.ready = True
            self._enter(key, entry)
            self._log.append((STORED, 0, key))
            self._counts["puts"] += 1

    def _make_room(self, level: int, *, needed_for: BlockKey) -> int:
        page = self._try_make_room(level)
        if page is None:
            pool = self.pools[level]
            num_pinned = sum(1 for entry in self._entries.values() if entry.level == level and entry.pins)
            if num_pinned >= pool.num_pages:
                why = f"all {pool.num_pages} pages hold pinned blocks"
            else:  # the rest are protected as prefixes, and no lower tier could take one
                why = (
                    f"its {pool.num_pages} pages hold {num_pinned} pinned blocks and "
                    f"{pool.num_pages - num_pinned} prefixes of pinned or cached blocks that no lower tier can take"
                )
            raise CapacityError(f"no room for block {needed_for} in {pool.tier.name}: {why}")
        return page

    def _try_make_room(self, level: int) -> int | None:
        """A free page of `level`, evicting (and demoting) as needed; None if all is protected."""
        pool = self.pools[level]
        page = pool.try_allocate()
        if page is None:
            page = self._vacate(level)
        while page is None:
            if not self._evict_one(level):
                return None
            page = pool.try_allocate()
        return page

    def _evict_one(self, level: int) -> bool:
        """Evict the block `level`'s policy chooses, moved down a tier (dropped from the last); False if every
        block there is protected (above the last tier: pinned, or protected as a prefix with no lower tier to
        take it)."""
        policy = self._policies[level]
        victim = policy.evict()
        if victim is None:
            return level < self._last and self._demote_unpinned(level)
        if level == self._last:  # no tier to demote to: what _demote would do
            self._drop(victim, self._entries[victim])
            return True
        # A victim that no lower tier takes and whose successors are cached stays (pinned in the policy for the
        # rest of this eviction, so it is not chosen again): the next victim goes in its place.
        kept: list[BlockKey] = []
        try:
            while not self._demote(victim, self._entries[victim]):
                policy.pin(victim)
                kept.append(victim)
                victim = policy.evict()
                if victim is None:
                    return False
            return True
        finally:
            for key in kept:
                policy.unpin(key)

    def _demote_unpinned(self, level: int) -> bool:
        """Demote the first unpinned block of `level` in its policy's order, prefix protection aside: a tier above
        the last keeps its victims cached below, so a prefix of pinned blocks moves down rather than filling the
        tier. False where every block is pinned, the policy has no such order, or no lower tier takes the victim
        (dropping it would strand its successors)."""
        evict_unpinned = getattr(self._policies[level], "evict_unpinned", None)
        victim = evict_unpinned() if evict_unpinned is not None else None
        if victim is None:
            return False
        entry = self._entries[victim]
        try:
            room = self._room_below(level)
        except BaseException:
            self._enter(victim, entry)
            raise
        if room is None:
            self._enter(victim, entry)
            return False
        if not self._move(victim, entry, *room):
            self._drop(victim, entry)
        return True

    def _demote(self, key: BlockKey, entry: Entry) -> bool:
        """Move an evicted block (already out of its policy) to the nearest lower tier that has room or can make
        it (one whose pages are all pinned cannot), or drop it; or, with holds, where no tier takes it and a
        successor of it is cached, put it back in its policy and return False (dropping it would strand them).

        Where making that room raises (an I/O error anywhere down the cascade), the block is still where it was,
        whole: it rejoins its tier's policy before the error goes on, or nothing could ever evict it again (its
        tier would look all pinned to every later put). A failed move restores it the same way (`_move`).
        """
        try:
            room = self._room_below(entry.level)
        except BaseException:
            self._enter(key, entry)
            raise
        if room is None and self._has_holds and self._successors.get(key):
            self._enter(key, entry)
            return False
        if room is None or not self._move(key, entry, *room):
            self._drop(key, entry)
        return True

    def _room_below(self, level: int) -> tuple[int, int] | None:
        """(tier, free page) in the nearest tier below `level` that has room or can make it; None if none can."""
        for target in range(level + 1, len(self.pools)):
            page = self._try_make_room(target)
            if page is not None:
                return target, page
        return None

    def _promote(self, key: BlockKey, entry: Entry, *, read: bool = True) -> PageBytes | None:
        """Move `key` (read from a lower tier) to the first tier; returns its bytes (None if corrupt, or with
        `read` False: a `touch`, which then reads no page where the block cannot move).

        Making room in a full first tier demotes its victim, whose tier makes room the same way, down to the
        tier `key` leaves: there the cascade takes `key`'s page (`_vacate`), so a promotion in a full hierarchy
        rotates one block down each tier between and loses none. (Evicting there instead would find that tier
        full, with `key` still in it, and drop a block the move is about to make room for.)"""
        source_level = entry.level
        self._policies[source_level].remove(key)
        self._leaving, self._carried = (key, entry), None
        try:
            page = self._try_make_room(0)
        except BaseException:
            if self._carried is _CORRUPT:  # `_vacate` forgot it as it gave its page to the cascade
                pass
            elif self._carried is not None:  # its page went to the cascade: its bytes are nowhere now
                self._forget(key, entry)
            elif key in self._entries and entry.level == source_level:  # not dropped or moved meanwhile
                self._enter(key, entry)
            raise
        finally:
            self._leaving, carried, self._carried = None, self._carried, None
        if carried is not None:
            data = self._land(key, entry, page, carried)
            return data if read else None
        if page is not None:
            if not self._move(key, entry, 0, page):
                self._found_corrupt(key, entry)
                self._drop(key, entry)
                return None
            return self.pools[0].read(page, entry.length, key=key) if read else None
        # The first tier is all pinned: serve it from where it is.
        self._enter(key, entry)
        if not read:  # a touch: the bytes would be thrown away, and an SSD read under the lock stalls every caller
            return None
        try:
            return self._read_host(key, entry) if self.pools[source_level].holds_bytes else None
        except IntegrityError as error:
            self._warn_corrupt(key, source_level, error)
            self._found_corrupt(key, entry)
            self._policies[source_level].remove(key)
            self._drop(key, entry)
            self._counts["corrupt_blocks"] += 1
            return None

    def _vacate(self, level: int) -> int | None:
        """The page of the block being promoted, if it lies in `level` (lock held, during `_promote`): its bytes are
        taken first (verified, and copied where a read is a view of the page) and carried to the first tier; a
        block whose bytes fail verification is dropped there instead, its page given all the same."""
        leaving = self._leaving
        if leaving is None or leaving[1].level != level:
            return None
        key, entry = leaving
        self._leaving = None  # one page per promotion
        try:
            data = self._read_host(key, entry) if self.pools[0].holds_bytes else None
        except IntegrityError as error:
            self._warn_corrupt(key, level, error)
            self._found_corrupt(key, entry)
            self._forget(key, entry)
            self._counts["corrupt_blocks"] += 1
            self._carried = _CORRUPT
            return entry.page
        if data is not None:
            if self.pools[level].zero_copy:  # a view of the page the cascade is about to fill
                data = memoryview(bytes(data))
            if entry.checksum is None:
                entry.checksum = xxhash.xxh3_64_intdigest(data)
        self._carried = (data,)
        return entry.page

    def _land(
        self, key: BlockKey, entry: Entry, page: int | None, carried: tuple[memoryview | None]
    ) -> PageBytes | None:
        """Write the bytes `_vacate` carried into `page` of the first tier (which the cascade freed), or give the
        page back where the block was dropped as corrupt."""
        assert page is not None  # the cascade that took the carried block's page demoted a first-tier victim
        if carried is _CORRUPT:
            self._release(0, page)
            return None
        try:
            self.pools[0].write(page, carried[0], key=key, checksum=entry.checksum)
        except BaseException:  # nowhere left for `key`
            self._forget(key, entry)
            self._release(0, page)  # last: see `_drop`
            raise
        self._rehome(key, entry, 0, page)
        return self.pools[0].read(page, entry.length, key=key)

    def _move(self, key: BlockKey, entry: Entry, target: int, page: int) -> bool:
        """Copy a block (out of every policy) into `page` of tier `target` and re-home it there.

        Returns False, with `page` given back and the block untouched, when its bytes
        fail verification (the caller drops it); other errors restore its policy entry.
        """
        source_level, source_page = entry.level, entry.page
        try:
            data = self._read_host(key, entry) if self.pools[target].holds_bytes else None
            if data is not None and entry.checksum is None:
                entry.checksum = xxhash.xxh3_64_intdigest(data)  # lower tiers (SSD) store it with the page
            self.pools[target].write(page, data, key=key, checksum=entry.checksum)
        except IntegrityError as error:
            self._warn_corrupt(key, source_level, error)
            self._release(target, page)
            self._counts["corrupt_blocks"] += 1
            return False
        except BaseException:
            # The policy entry first: whatever ends the release (an interrupt), the block, still where it was,
            # must stay evictable.
            self._enter(key, entry)
            self._release(target, page)
            raise
        self._rehome(key, entry, target, page)
        self._release(source_level, source_page)  # last: see `_drop`
        return True

    def _rehome(self, key: BlockKey, entry: Entry, target: int, page: int) -> None:
        """The block now lives in `page` of tier `target` (its bytes are there): its entry, its new tier's policy,
        the change log and the counters say so."""
        self._log += [(REMOVED, entry.level, key), (STORED, target, key)]
        self._counts["demotions" if target > entry.level else "promotions"] += 1
        entry.level, entry.page, entry.lower_reads = target, page, 0
        self._enter(key, entry)

    def _read_host(self, key: BlockKey, entry: Entry) -> memoryview | None:
        """Block `key`'s bytes in host memory (verified when they come from SSD, the page's label included; None
        from a metadata pool).

        Raises:
            IntegrityError: they fail verification, or their page cannot be read (an I/O error: a bad sector, as
                good as corrupt, since reading it again will not help).
        """
        try:
            data = self.pools[entry.level].read(entry.page, entry.length, key=key)
        except OSError as error:
            raise IntegrityError(f"the {self.pools[entry.level].tier.name} page cannot be read: {error}") from error
        if data is None or isinstance(data, memoryview):
            return data
        return data.cpu().numpy().data  # a VRAM page, copied to the host

    def _digest(self, key: BlockKey, entry: Entry) -> int:
        """XXH3-64 of block `key`'s bytes; ConfigError where its tier holds none (metadata only)."""
        data = self._read_host(key, entry)
        if data is None:
            raise ConfigError(f"the {self.pools[entry.level].tier.name} tier holds no bytes to hash")
        return xxhash.xxh3_64_intdigest(data)

    def _drop(self, key: BlockKey, entry: Entry) -> None:
        """Forget `key` everywhere (its policy entry is already gone).

        The page goes back last, after every record of the block is gone: a release can be cut short (an
        interrupt) with the page released all the same, and a block still cached on a page handed to the next
        block would serve that block's bytes. (Every release of a page that a block leaves comes last for the
        same reason.)
        """
        self._forget(key, entry)
        self._release(entry.level, entry.page)

    def _release(self, level: int, page: int) -> None:
        """Give `page` back to tier `level`'s pool (lock held), the last step of the change that frees it.

        A pool's `free` that raises an OSError has released the page all the same (`SsdPagePool.free`, whose
        header could not be zeroed: the stale header is harmless, see there), and the change is made: raising
        would stop the caller part way (a loop of unpins, removes or demotions) for a loss that is the disk's.
        The failure is counted in `stats.failed_releases` and logged as a warning instead (where a failing disk
        shows, as with `_warn_corrupt`).
        """
        try:
            self.pools[level].free(page)
        except OSError as error:
            self._counts["failed_releases"] += 1
            LOG.warning(
                "the %s tier's page %d is released, but not cleanly: %s", self.pools[level].tier.name, page, error
            )

    def _forget(self, key: BlockKey, entry: Entry) -> None:
        """`_drop` where `key`'s page is no longer its own (`_vacate` gave it away). A corrupt block was logged
        removed when found (`_mark_corrupt`)."""
        del self._entries[key]
        if self._has_holds:
            self._remove_successor(key, entry.parent)
        if not entry.corrupt:
            self._log.append((REMOVED, entry.level, key))
        self._counts["drops"] += 1


def group_changes(log: list[tuple[int, int, BlockKey]]) -> list[tuple[tuple[int, int], list[BlockKey]]]:
    """The log's (kind, level) → keys groups, in order: a stretch without a repeated key is one
    group per (kind, level), in the order they first appear; a repeated key starts a new stretch."""
    if len({key for _, _, key in log}) == len(log):  # no key changes twice: one stretch
        by_kind: dict[tuple[int, int], list[BlockKey]] = {}
        for kind, level, key in log:
            keys = by_kind.get((kind, level))
            if keys is None:
                keys = by_kind[(kind, level)] = []
            keys.append(key)
        return list(by_kind.items())
    groups: list[tuple[tuple[int, int], list[BlockKey]]] = []
    stretch: dict[tuple[int, int], list[BlockKey]] = {}
    touched: set[BlockKey] = set()
    for kind, level, key in log:
        if key in touched:
            stretch.clear()
            touched.clear()
        keys = stretch.get((kind, level))
        if keys is None:
            keys = stretch[(kind, level)] = []
            groups.append(((kind, level), keys))
        keys.append(key)
        touched.add(key)
    return groups
