"""The tiered cache: block keys → pages across an ordered list of page pools.

Tiers are ordered fastest first (say DRAM, then SSD). A block lives in exactly
one tier at a time:

- `put(key, data)` writes into the first tier, making room by evicting that
  tier's victim (chosen by its eviction policy) and demoting it to the next
  tier, which may in turn demote its own victim; a victim that no lower tier can
  take is dropped. `put` of a key already cached only records a use: keys are
  content hashes, so the bytes are the same (and a pinned block is never
  overwritten).
- `get(key)` returns the bytes: a zero-copy view in DRAM/VRAM, a verified copy
  from SSD. A block read from a lower tier is promoted to the first tier on its
  `promote_after`-th read there (0: never).
- `pin` / `unpin` (reference counted): a pinned block is never evicted,
  demoted, promoted or overwritten, so a view of it stays valid. Engines pin
  the blocks they read; `pinned(key)` does it as a context manager.
- Every page written to SSD carries an XXH3-64 checksum, verified on every SSD
  read; `put(..., checksum=...)` verifies blocks imported from a peer. A block
  that fails verification is dropped and reported as a miss (counted in
  `stats.corrupt_blocks`), never returned.
- The cache publishes `BlockStored` / `BlockRemoved` events (with tier) for the
  global index: `take_events()` drains them, numbered in one sequence per epoch,
  the changes since the last call grouped by kind and tier (a full cache taking
  a chain is one removal and one store, not one of each per block).
  A pool reopened with recovered pages (SSD after a crash) is announced first.

Threads: one writer and any number of readers. Metadata changes happen under
one lock; the writer's copy into a freshly reserved page, and SSD reads of a
block that is not promoted, happen outside it.

Invariants (`check_invariants`):
- each cached key has one page, allocated in its tier's pool, and each
  allocated page belongs to exactly one key (or a write in progress);
- a tier's policy knows exactly the ready keys of that tier; pinned keys are
  pinned in it;
- used bytes never exceed a tier's capacity (pages are the unit of capacity).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

import attrs
import xxhash

from mooncake.cache.events import BlockRemoved, BlockStored, CacheEvent
from mooncake.cache.policy import EvictionPolicy, LruPolicy
from mooncake.cache.pool import Buffer, PageBytes, PagePool, as_bytes_view
from mooncake.errors import BlockPinnedError, CapacityError, ConfigError, IntegrityError, UnknownBlockError
from mooncake.types import BlockKey, InstanceId, Tier

__all__ = ["BlockLocation", "CacheStats", "TieredCache"]

_STORED, _REMOVED = 0, 1
_LOCAL = InstanceId("local")


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


@attrs.frozen
class BlockLocation:
    """A block's page: `ready` is False while it is reserved and being filled."""

    tier: Tier
    page: int
    length: int
    ready: bool


@attrs.define(eq=False)
class _Entry:
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

    @property
    def is_live(self) -> bool:
        return self.ready and not self.corrupt


class TieredCache:
    """Keys → pages across tiers, with eviction, demotion, promotion, pins and events.

    Args:
        pools: page pools, fastest first, with equal `page_bytes` and distinct tiers.
        source: this cache's instance id in its events.
        epoch: the events' epoch; pick a higher one each time the process restarts.
        policy: makes one eviction policy per tier (default prefix-aware LRU).
        promote_after: promote a block to the first tier on this many reads in a
            lower tier (0: never).
    """

    def __init__(
        self,
        pools: Sequence[PagePool],
        *,
        source: InstanceId = _LOCAL,
        epoch: int = 0,
        policy: Callable[[], EvictionPolicy] = LruPolicy,
        promote_after: int = 1,
    ) -> None:
        if not pools:
            raise ConfigError("pools must name at least one tier")
        sizes = {pool.page_bytes for pool in pools}
        if len(sizes) != 1:
            raise ConfigError(f"every tier must use one page size, got {sorted(sizes)}")
        tiers = [pool.tier for pool in pools]
        if len(set(tiers)) != len(tiers):
            raise ConfigError(f"tiers must be distinct, got {[t.name for t in tiers]}")
        if isinstance(promote_after, bool) or not isinstance(promote_after, int) or promote_after < 0:
            raise ConfigError(f"promote_after must be an integer >= 0, got {promote_after!r}")
        self.pools = tuple(pools)
        self.page_bytes = pools[0].page_bytes
        self.source = source
        self.epoch = epoch
        self.promote_after = promote_after
        self._policies = [policy() for _ in pools]
        self._entries: dict[BlockKey, _Entry] = {}
        self._lock = threading.RLock()
        self._log: list[tuple[int, int, BlockKey]] = []
        self._seq = 0
        self._counts = dict.fromkeys(attrs.fields_dict(CacheStats), 0)
        for level, pool in enumerate(self.pools):
            for found in getattr(pool, "recovered", ()):
                if found.key in self._entries:  # the same block recovered in two tiers: keep the faster
                    pool.free(found.page)
                    continue
                self._entries[found.key] = _Entry(level, found.page, found.length, found.checksum, None, ready=True)
                self._policies[level].access(found.key)
                self._log.append((_STORED, level, found.key))

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for entry in self._entries.values() if entry.is_live)

    def __contains__(self, key: object) -> bool:
        entry = self._entries.get(key)  # type: ignore[call-overload]
        return entry is not None and entry.is_live

    def tier_of(self, key: BlockKey) -> Tier | None:
        """The tier holding `key`, or None."""
        entry = self._entries.get(key)
        return self.pools[entry.level].tier if entry is not None and entry.is_live else None

    def prefix_match(self, keys: Iterable[BlockKey]) -> int:
        """How many leading `keys` the cache holds (in any tier)."""
        count = 0
        entries = self._entries
        with self._lock:
            for key in keys:
                entry = entries.get(key)
                if entry is None or not entry.ready or entry.corrupt:  # not is_live
                    break
                count += 1
        return count

    @property
    def stats(self) -> CacheStats:
        return CacheStats(**self._counts)

    def used_bytes(self, tier: Tier) -> int:
        """Bytes of pages in use in `tier` (whole pages)."""
        pool = self.pools[self._level_of(tier)]
        return (pool.num_pages - pool.num_free) * pool.page_bytes

    def capacity_bytes(self, tier: Tier) -> int:
        """Bytes `tier` can hold: its pages times the page size."""
        pool = self.pools[self._level_of(tier)]
        return pool.num_pages * pool.page_bytes

    # ------------------------------------------------------------------ writes

    def put(
        self,
        key: BlockKey,
        data: Buffer | None = None,
        *,
        parent: BlockKey | None = None,
        position: int = 0,
        length: int | None = None,
        checksum: int | None = None,
    ) -> Tier:
        """Cache `data` under `key` in the first tier (a use, if already cached).

        Args:
            key: the block's chained key.
            data: its bytes (at most `page_bytes`); None with metadata-only pools.
            parent: the key of the block before it in its chain (for prefix-aware eviction).
            position: its block index in the request (for length-aware eviction).
            length: the block's size when `data` is None (default: a whole page).
            checksum: the sender's XXH3-64 of `data`, verified before storing (import from a peer).

        Returns:
            The tier now holding the block.

        Raises:
            IntegrityError: `data` does not match `checksum`.
            CapacityError: `data` exceeds a page, or every block of the first tier is pinned.
        """
        if data is not None:
            view = as_bytes_view(data, self.page_bytes)
            size = view.nbytes
            if checksum is not None and xxhash.xxh3_64_intdigest(view) != checksum:
                raise IntegrityError(f"block {key}: data does not match the sender's checksum {checksum:#018x}")
        else:
            if self.pools[0].holds_bytes:
                raise ConfigError(f"the {self.pools[0].tier.name} tier stores bytes: put needs data")
            view = None
            size = self.page_bytes if length is None else length
            if not 0 <= size <= self.page_bytes:
                raise CapacityError(f"{size} bytes do not fit a page of {self.page_bytes} bytes")
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                if entry.ready:
                    self._policies[entry.level].access(key)
                return self.pools[entry.level].tier
            entry = self._claim(key, size, parent, position)
        try:
            self.pools[0].write(entry.page, view, key=key, checksum=checksum)
        except BaseException:
            self.abort(key)
            raise
        self._publish(key, entry, checksum)
        return self.pools[0].tier

    def put_chain(self, keys: Sequence[BlockKey], *, length: int | None = None) -> None:
        """Record a request's chain of blocks without data (metadata-only first tier).

        Equivalent to `put(key, parent=previous key, position=i, length=length)`
        for each key in order (cached ones count as used), under one lock: the
        simulator stores every prefill's chain this way.

        Raises:
            ConfigError: the first tier stores bytes.
            CapacityError: `length` exceeds a page, or every block of the first tier is pinned.
        """
        pool = self.pools[0]
        if pool.holds_bytes:
            raise ConfigError(f"the {pool.tier.name} tier stores bytes: put_chain needs a metadata-only tier")
        size = self.page_bytes if length is None else length
        if not 0 <= size <= self.page_bytes:
            raise CapacityError(f"{size} bytes do not fit a page of {self.page_bytes} bytes")
        entries, log = self._entries, self._log
        accesses = [policy.access for policy in self._policies]
        access, allocate = accesses[0], pool.try_allocate
        parent = None
        puts = 0
        with self._lock:
            try:
                for position, key in enumerate(keys):
                    entry = entries.get(key)
                    if entry is not None:
                        if entry.ready:
                            accesses[entry.level](key)
                    else:
                        page = allocate()
                        if page is None:
                            page = self._make_room(0, needed_for=key)
                        entries[key] = _Entry(0, page, size, None, parent, 0, position, True)  # pins 0, ready
                        access(key, parent=parent, position=position)
                        log.append((_STORED, 0, key))
                        puts += 1
                    parent = key
            finally:
                self._counts["puts"] += puts

    def reserve(
        self, key: BlockKey, length: int, *, parent: BlockKey | None = None, position: int = 0
    ) -> PageBytes | None:
        """Claim a first-tier page for `key`, to be filled in place (zero copy), e.g. by a transfer.

        The block is invisible until `commit(key)`; `abort(key)` gives the page back.

        Returns:
            A writable view of the page's first `length` bytes, or None when `key`
            is already cached or being filled.

        Raises:
            ConfigError: the first tier cannot be written in place (SSD, metadata).
            CapacityError: `length` exceeds a page, or the first tier is all pinned.
        """
        if not self.pools[0].zero_copy:
            raise ConfigError(f"the {self.pools[0].tier.name} tier cannot be filled in place: use put")
        if not 0 <= length <= self.page_bytes:
            raise CapacityError(f"{length} bytes do not fit a page of {self.page_bytes} bytes")
        with self._lock:
            if key in self._entries:
                return None
            entry = self._claim(key, length, parent, position)
            return self.pools[0].read(entry.page, length)

    def commit(self, key: BlockKey, *, checksum: int | None = None) -> None:
        """Publish a reserved block, first verifying it against `checksum` when given.

        Raises:
            UnknownBlockError: `key` is not reserved.
            IntegrityError: the bytes do not match `checksum` (the reservation is dropped).
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.ready:
                raise UnknownBlockError(f"block {key} is not reserved")
        if checksum is not None:
            actual = self._digest(entry)
            if actual != checksum:
                self.abort(key)
                raise IntegrityError(f"block {key}: bytes hash to {actual:#018x}, the sender said {checksum:#018x}")
        self._publish(key, entry, checksum)

    def abort(self, key: BlockKey) -> None:
        """Give back the page of a reserved block (no effect if `key` is not reserved)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and not entry.ready:
                del self._entries[key]
                self.pools[entry.level].free(entry.page)

    def location(self, key: BlockKey) -> BlockLocation | None:
        """Where a cached or reserved block lives, or None; pin a cached block first if
        the answer must stay true (a reserved one stays put until committed)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.corrupt:
                return None
            return BlockLocation(self.pools[entry.level].tier, entry.page, entry.length, entry.ready)

    def remove(self, key: BlockKey) -> None:
        """Drop `key` from the cache.

        Raises:
            UnknownBlockError: it is not cached. BlockPinnedError: it is pinned.
        """
        with self._lock:
            entry = self._ready_entry(key)
            if entry.pins:
                raise BlockPinnedError(f"block {key} is pinned {entry.pins} time(s)")
            self._policies[entry.level].remove(key)
            self._drop(key, entry)

    # ------------------------------------------------------------------ reads

    def get(self, key: BlockKey) -> PageBytes | None:
        """The bytes of `key`, or None on a miss.

        A DRAM hit is a zero-copy view of the page, valid while the block is
        pinned (or until the cache next changes); an SSD hit is a verified copy,
        or a view of the first tier when the read promotes it. A block that fails
        its checksum is dropped and reported as a miss.
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or not entry.is_live:
                self._counts["misses"] += 1
                return None
            if not self.pools[entry.level].holds_bytes:
                raise ConfigError(f"the {self.pools[entry.level].tier.name} tier holds no bytes: use touch()")
            self._policies[entry.level].access(key)
            self._counts["hits"] += 1
            if entry.level == 0 and self.pools[0].zero_copy:
                return self.pools[0].read(entry.page, entry.length)
            if entry.level:
                entry.lower_reads += 1
                if self._should_promote(entry):
                    return self._promote(key, entry)
            entry.pins += 1  # hold the page while reading outside the lock
            self._policies[entry.level].pin(key)
        data = None
        try:
            data = self.pools[entry.level].read(entry.page, entry.length)
        except IntegrityError:
            pass
        finally:
            with self._lock:
                if data is None:
                    self._found_corrupt(entry)
                self._unpin_entry(key, entry)
        return data

    def touch(self, key: BlockKey) -> Tier | None:
        """Record a read of `key` without its bytes (promoting it as `get` would); its tier, or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or not entry.is_live:
                self._counts["misses"] += 1
                return None
            self._policies[entry.level].access(key)
            self._counts["hits"] += 1
            if entry.level:
                entry.lower_reads += 1
                if self._should_promote(entry):
                    self._promote(key, entry)
            return self.pools[entry.level].tier if key in self._entries else None

    def checksum(self, key: BlockKey) -> int:
        """XXH3-64 of the block's bytes (computed once, then remembered), for exporting it to a peer.

        Raises:
            UnknownBlockError: `key` is not cached. ConfigError: its tier holds no bytes.
        """
        with self._lock:
            entry = self._ready_entry(key)
            if entry.checksum is None:
                entry.checksum = self._digest(entry)
            return entry.checksum

    # ------------------------------------------------------------------ pins

    def pin(self, key: BlockKey) -> None:
        """Protect `key` from eviction, demotion, promotion and overwrite (reference counted)."""
        with self._lock:
            entry = self._ready_entry(key)
            if entry.corrupt:
                raise UnknownBlockError(f"block {key} is not cached (it failed verification)")
            entry.pins += 1
            self._policies[entry.level].pin(key)

    def unpin(self, key: BlockKey) -> None:
        """Release one pin of `key`."""
        with self._lock:
            entry = self._ready_entry(key)
            if entry.pins == 0:
                raise UnknownBlockError(f"block {key} is not pinned")
            self._unpin_entry(key, entry)

    @contextlib.contextmanager
    def pinned(self, key: BlockKey) -> Iterator[PageBytes | None]:
        """Pin `key` and yield its bytes (None on a miss) for the duration of the block."""
        with self._lock:
            hit = key in self
            if hit:
                self.pin(key)
            else:
                self._counts["misses"] += 1
        if not hit:
            yield None  # outside the lock: the caller's block may take its time
            return
        try:
            yield self.get(key)
        finally:
            with self._lock:
                if key in self._entries:
                    self.unpin(key)

    # ------------------------------------------------------------------ events

    def take_events(self) -> list[CacheEvent]:
        """Events since the last call: the changes grouped into one event per kind and tier,
        within stretches of the log where no key changes twice (changes to distinct keys commute,
        so a consumer applying the events in order ends where applying each change would)."""
        with self._lock:
            log, self._log = self._log, []
            groups = _group_changes(log)
            first_seq = self._seq
            self._seq += len(groups)
        return [
            (BlockStored if kind == _STORED else BlockRemoved)(
                source=self.source, seq=first_seq + i, keys=keys, tier=self.pools[level].tier, epoch=self.epoch
            )
            for i, ((kind, level), keys) in enumerate(groups)
        ]

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close every pool."""
        for pool in self.pools:
            pool.close()

    def check_invariants(self) -> None:
        """Raise AssertionError if an invariant of the module docstring fails."""
        with self._lock:
            for level, pool in enumerate(self.pools):
                here = {k: e for k, e in self._entries.items() if e.level == level}
                pages = [e.page for e in here.values()]
                assert len(set(pages)) == len(pages), f"tier {pool.tier.name}: two keys share a page"
                assert pool.num_pages - pool.num_free == len(pages), f"tier {pool.tier.name}: pages leaked"
                ready = {k for k, e in here.items() if e.ready}
                policy = self._policies[level]
                assert len(policy) == len(ready) and all(k in policy for k in ready), "policy out of sync"
                for key, entry in here.items():
                    assert entry.pins >= 0, f"block {key}: negative pins"
                    assert entry.length <= pool.page_bytes
                    if entry.ready:
                        is_pinned = getattr(policy, "is_pinned", None)
                        if is_pinned is not None:
                            assert is_pinned(key) == (entry.pins > 0), f"block {key}: pin state out of sync"

    # ------------------------------------------------------------------ internals

    def _level_of(self, tier: Tier) -> int:
        for level, pool in enumerate(self.pools):
            if pool.tier == tier:
                return level
        raise ConfigError(f"this cache has no {Tier(tier).name} tier")

    def _ready_entry(self, key: BlockKey) -> _Entry:
        entry = self._entries.get(key)
        if entry is None or not entry.ready:
            raise UnknownBlockError(f"block {key} is not cached")
        return entry

    def _unpin_entry(self, key: BlockKey, entry: _Entry) -> None:
        entry.pins -= 1
        self._policies[entry.level].unpin(key)
        if entry.corrupt and entry.pins == 0:
            self._policies[entry.level].remove(key)
            self._drop(key, entry)
            self._counts["corrupt_blocks"] += 1

    def _found_corrupt(self, entry: _Entry) -> None:
        """A read of `entry` failed verification (lock held): that read is a miss, and the
        block is dropped now, or when its last pin goes."""
        self._counts["hits"] -= 1
        self._counts["misses"] += 1
        entry.corrupt = True

    def _should_promote(self, entry: _Entry) -> bool:
        return bool(self.promote_after) and entry.lower_reads >= self.promote_after and entry.pins == 0

    def _claim(self, key: BlockKey, length: int, parent: BlockKey | None, position: int) -> _Entry:
        """A first-tier page for a new block, held (pinned, not ready) until `_publish` (lock held)."""
        page = self._make_room(0, needed_for=key)
        entry = self._entries[key] = _Entry(0, page, length, None, parent, pins=1, position=position)
        return entry

    def _publish(self, key: BlockKey, entry: _Entry, checksum: int | None) -> None:
        """Make a claimed block visible: it joins its tier's policy and the event log."""
        with self._lock:
            if self._entries.get(key) is not entry or entry.ready:
                raise UnknownBlockError(f"block {key} is no longer reserved (aborted or committed meanwhile)")
            entry.checksum = checksum if checksum is not None else entry.checksum
            entry.pins -= 1
            entry.ready = True
            self._policies[0].access(key, parent=entry.parent, position=entry.position)
            self._log.append((_STORED, 0, key))
            self._counts["puts"] += 1

    def _make_room(self, level: int, *, needed_for: BlockKey) -> int:
        page = self._try_make_room(level)
        if page is None:
            raise CapacityError(
                f"no room for block {needed_for} in {self.pools[level].tier.name}: all "
                f"{self.pools[level].num_pages} pages hold pinned blocks"
            )
        return page

    def _try_make_room(self, level: int) -> int | None:
        """A free page of `level`, evicting (and demoting) as needed; None if all is protected."""
        pool = self.pools[level]
        page = pool.try_allocate()
        if page is None:
            policy, last = self._policies[level], level + 1 == len(self.pools)
            while page is None:
                victim = policy.evict()
                if victim is None:
                    return None
                if last:  # no tier to demote to: what _demote would do
                    self._drop(victim, self._entries[victim])
                else:
                    self._demote(victim, self._entries[victim])
                page = pool.try_allocate()
        return page

    def _demote(self, key: BlockKey, entry: _Entry) -> None:
        """Move an evicted block (already out of its policy) one tier down, or drop it."""
        target = entry.level + 1
        page = self._try_make_room(target) if target < len(self.pools) else None
        if page is None or not self._move(key, entry, target, page):
            self._drop(key, entry)
            return
        self._counts["demotions"] += 1

    def _promote(self, key: BlockKey, entry: _Entry) -> PageBytes | None:
        """Move `key` (read from a lower tier) to the first tier; returns its bytes (None if corrupt)."""
        source_level = entry.level
        self._policies[source_level].remove(key)
        try:
            page = self._try_make_room(0)
        except BaseException:
            self._policies[source_level].access(key, parent=entry.parent, position=entry.position)
            raise
        if page is not None:
            if not self._move(key, entry, 0, page):
                self._found_corrupt(entry)
                self._drop(key, entry)
                return None
            self._counts["promotions"] += 1
            return self.pools[0].read(page, entry.length)
        # The first tier is all pinned: serve it from where it is.
        self._policies[source_level].access(key, parent=entry.parent, position=entry.position)
        try:
            return self._read_host(entry) if self.pools[source_level].holds_bytes else None
        except IntegrityError:
            self._found_corrupt(entry)
            self._policies[source_level].remove(key)
            self._drop(key, entry)
            self._counts["corrupt_blocks"] += 1
            return None

    def _move(self, key: BlockKey, entry: _Entry, target: int, page: int) -> bool:
        """Copy a block (out of every policy) into `page` of tier `target` and re-home it there.

        Returns False, with `page` given back and the block untouched, when its bytes
        fail verification (the caller drops it); other errors restore its policy entry.
        """
        source_level = entry.level
        try:
            data = self._read_host(entry) if self.pools[target].holds_bytes else None
            if data is not None and entry.checksum is None:
                entry.checksum = xxhash.xxh3_64_intdigest(data)  # lower tiers (SSD) store it with the page
            self.pools[target].write(page, data, key=key, checksum=entry.checksum)
        except IntegrityError:
            self.pools[target].free(page)
            self._counts["corrupt_blocks"] += 1
            return False
        except BaseException:
            self.pools[target].free(page)
            self._policies[source_level].access(key, parent=entry.parent, position=entry.position)
            raise
        self.pools[source_level].free(entry.page)
        entry.level, entry.page, entry.lower_reads = target, page, 0
        self._policies[target].access(key, parent=entry.parent, position=entry.position)
        self._log.append((_REMOVED, source_level, key))
        self._log.append((_STORED, target, key))
        return True

    def _read_host(self, entry: _Entry) -> memoryview | None:
        """The block's bytes in host memory (verified when they come from SSD; None from a metadata pool)."""
        data = self.pools[entry.level].read(entry.page, entry.length)
        if data is None or isinstance(data, memoryview):
            return data
        return data.cpu().numpy().data  # a VRAM page, copied to the host

    def _digest(self, entry: _Entry) -> int:
        """XXH3-64 of the block's bytes; ConfigError where its tier holds none (metadata only)."""
        data = self._read_host(entry)
        if data is None:
            raise ConfigError(f"the {self.pools[entry.level].tier.name} tier holds no bytes to hash")
        return xxhash.xxh3_64_intdigest(data)

    def _drop(self, key: BlockKey, entry: _Entry) -> None:
        """Forget `key` everywhere (its policy entry is already gone)."""
        self.pools[entry.level].free(entry.page)
        del self._entries[key]
        self._log.append((_REMOVED, entry.level, key))
        self._counts["drops"] += 1


def _group_changes(log: list[tuple[int, int, BlockKey]]) -> list[tuple[tuple[int, int], list[BlockKey]]]:
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
