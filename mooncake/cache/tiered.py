"""The tiered cache: block keys → pages across an ordered list of page pools.

Tiers are ordered fastest first (say DRAM, then SSD). A block lives in exactly
one tier at a time:

- `put(key, data)` writes into the first tier, making room by evicting that
  tier's victim (chosen by its eviction policy) and demoting it to the next
  tier (past one whose pages are all pinned), which may in turn demote its own
  victim; a victim that no lower tier can take is dropped. `put` of a key
  already cached only records a use: keys are content hashes, so the bytes are
  the same (and a pinned block is never overwritten); `put` of a key being
  filled (`reserve`d, not yet committed) is refused. A copy that failed
  verification is not cached: a `put` of its key stores the new bytes, even
  while a reader still pins the damaged copy (whose page is freed at its last
  pin; an `unpin` of the key releases that copy's pins first).
- `get(key)` returns the bytes: a zero-copy view in DRAM/VRAM, a verified copy
  from SSD. A block read from a lower tier is promoted to the first tier on its
  `promote_after`-th read there (0: never); into a full first tier, the
  demotions it causes end in the page the block leaves (from the second tier,
  the two swap pages), so that a promotion in a full hierarchy loses no block.
- Keys are block keys (`types.check_block_key`): every call taking one
  refuses anything else with InvalidRequestError, and takes a numpy integer
  as the Python int it equals; `key in cache` answers False for a non-key.
  (An object that merely hashes and compares equal to a key, 1.0 or True,
  would otherwise find block 1, and be stored in its policy as that block.)
- Prefix-aware eviction spans the tiers (`_placement`): eviction drops no block
  while a successor of it is cached in any tier.
- `pin` / `unpin` (reference counted): a pinned block is never evicted,
  demoted, promoted or overwritten, so a view of it stays valid. Engines pin
  the blocks they read; `pinned(key)` does it as a context manager. An `unpin`
  of a key that is pinned always succeeds.
- A failed page write raises `DiskError`; a failed page release (an SSD header
  that cannot be zeroed) never does: the page is free all the same, so the call
  completes, counted in `stats.failed_releases` and logged as a warning.
- Every page written to SSD carries an XXH3-64 checksum, verified on every SSD
  read; `put(..., checksum=...)` verifies blocks imported from a peer. A block
  that fails verification is dropped and reported as a miss (counted in
  `stats.corrupt_blocks`, and logged as a warning on the `mooncake.cache`
  logger, naming tier, block and reason), never returned; so is one whose page
  cannot be read (an I/O error: a bad sector, which reading again will not mend).
- The cache publishes `BlockStored` / `BlockRemoved` events (with tier) for the
  global index: `take_events()` drains them, numbered in one sequence per epoch,
  the changes since the last call grouped by kind and tier (a full cache taking
  a chain is one removal and one store, not one of each per block).
  A pool reopened with recovered pages (SSD after a crash) is announced first;
  `announce_all` starts a new epoch with an `AllBlocksCleared`, then every block held.

Threads: one writer and any number of readers. Metadata changes happen under
one lock; the writer's copy into a freshly reserved page, and SSD reads of a
block that is not promoted, happen outside it.

Where blocks live and how they move between tiers (eviction, demotion,
promotion, verification failures) is `BlockPlacement` (module `_placement`),
which this class extends with the calls above; its invariants are the cache's
(`check_invariants`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import attrs
import xxhash

from mooncake._checks import require_int, require_iterable, require_str
from mooncake.cache._placement import STORED, BlockPlacement, CacheStats, Entry, group_changes
from mooncake.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent
from mooncake.cache.policy import EvictionPolicy, LruPolicy
from mooncake.cache.pool import Buffer, PageBytes, PagePool, as_bytes_view, check_checksum
from mooncake.errors import (
    BlockPinnedError,
    CapacityError,
    ConfigError,
    IntegrityError,
    InvalidRequestError,
    UnknownBlockError,
)
from mooncake.types import BLOCK_KEY_LIMIT, BlockKey, InstanceId, Tier, check_block_key

__all__ = ["BlockLocation", "CacheStats", "TieredCache"]

_LOCAL = InstanceId("local")


@attrs.frozen
class BlockLocation:
    """A block's page: `ready` is False while it is reserved and being filled."""

    tier: Tier
    page: int
    length: int
    ready: bool


class TieredCache(BlockPlacement):
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
        # The events' stamp is checked here, not when the first events are taken and it is too late to say where.
        require_str("source", source, what="instance id string")
        require_int("epoch", epoch, minimum=0)
        super().__init__(pools, policy=policy, promote_after=promote_after)
        self.source = source
        self.epoch = epoch
        self._seq = 0
        self._announcing = False  # `announce_all` was called: the next `take_events` opens with AllBlocksCleared

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for entry in self._entries.values() if entry.is_live)

    def __contains__(self, key: object) -> bool:
        """Whether block `key` is cached; False for anything that is no block key (as a dict answers for a key of
        another type, but without a TypeError for an unhashable one, nor True for 1.0 where block 1 is cached)."""
        if type(key) is not int:
            try:
                key = check_block_key(key)
            except InvalidRequestError:
                return False
        entry = self._entries.get(key)  # type: ignore[call-overload]
        return entry is not None and entry.is_live

    def tier_of(self, key: BlockKey) -> Tier | None:
        """The tier holding `key`, or None.

        Raises:
            InvalidRequestError: `key` is no block key.
        """
        entry = self._entries.get(_key(key))
        return self.pools[entry.level].tier if entry is not None and entry.is_live else None

    def prefix_match(self, keys: Iterable[BlockKey]) -> int:
        """How many leading `keys` the cache holds (in any tier).

        Raises:
            InvalidRequestError: `keys` is not iterable, or one of the keys read (up to the first not held) is no
                block key.
        """
        count = 0
        entries = self._entries
        keys = require_iterable("keys", keys, error=InvalidRequestError)
        with self._lock:
            for key in keys:
                if type(key) is not int:  # the range of an int matters only where it misses: checked there
                    key = check_block_key(key)
                entry = entries.get(key)
                if entry is None or not entry.ready or entry.corrupt:  # not is_live
                    _key(key)
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
            CapacityError: `data` exceeds a page, or every block of the first tier is pinned or the prefix of a
                pinned block that no lower tier can take.
            BlockPinnedError: `key` is being filled (reserved, not yet committed): its bytes are the filler's to
                commit or abort, and a put that stored nothing would be lost with an abort.
            InvalidRequestError: `key`, `parent`, `position` or `length` is not a non-negative integer, or
                `checksum` not in [0, 2**64).
        """
        key = check_block_key(key)
        if parent is not None:
            parent = check_block_key(parent)
        _check_position(position)
        if checksum is not None:
            check_checksum(checksum)
        if data is not None:
            view = as_bytes_view(data, self.page_bytes)
            size = view.nbytes
            if checksum is not None and xxhash.xxh3_64_intdigest(view) != checksum:
                raise IntegrityError(f"block {key}: data does not match the sender's checksum {checksum:#018x}")
        else:
            if self.pools[0].holds_bytes:
                raise ConfigError(f"the {self.pools[0].tier.name} tier stores bytes: put needs data")
            view = None
            size = self._length_without_data(length)
        with self._lock:
            entry = self._unless_corrupt(key, self._entries.get(key))
            if entry is not None:
                if not entry.ready:
                    raise BlockPinnedError(
                        f"block {key} is being filled (reserved, not yet committed): commit or abort it first"
                    )
                self._policies[entry.level].access(key)
                return self.pools[entry.level].tier
            entry = self._claim(key, size, parent, position)
        if checksum is None and view is not None and not self.pools[0].zero_copy:
            # A pool that copies (SSD) would hash the bytes for its page header: hashed here instead, the digest is
            # kept as the block's, so `checksum(key)` never reads the page back.
            checksum = xxhash.xxh3_64_intdigest(view)
        try:
            self.pools[0].write(entry.page, view, key=key, checksum=checksum)
        except BaseException:
            self.abort(key)
            raise
        self._publish(key, entry, checksum)
        return self.pools[0].tier

    def _length_without_data(self, length: int | None) -> int:
        """The size of a block stored without data (`put`, `put_chain`): `length`, or a whole page where None.

        Raises:
            InvalidRequestError: `length` is not an integer >= 0 (a float, a bool, a str).
            CapacityError: it exceeds a page.
        """
        if length is None:
            return self.page_bytes
        size = require_int("length", length, minimum=0, error=InvalidRequestError)
        if size > self.page_bytes:
            raise CapacityError(f"{size} bytes do not fit a page of {self.page_bytes} bytes")
        return size

    def put_chain(self, keys: Sequence[BlockKey], *, length: int | None = None) -> None:
        """Record a request's chain of blocks without data (metadata-only first tier).

        Equivalent to `put(key, parent=previous key, position=i, length=length)`
        for each key in order (cached ones count as used), under one lock: the
        simulator stores every prefill's chain this way. Except that the chain
        never makes room for a block by evicting one of its own earlier blocks
        (a chain longer than the first tier can hold): it stops there, its head
        cached and the rest not stored, where storing on would have evicted the
        head (leaf first, or, under a policy that ranks blocks alone, oldest
        first) and kept a tail that no prompt can match. So, whatever the policy,
        the chain's blocks this call stores all lie in its cached prefix.

        Raises:
            ConfigError: the first tier stores bytes.
            CapacityError: `length` exceeds a page, or the chain's first block needs a page and every first-tier
                page holds a pinned block (a later block finding no room ends the chain instead).
            InvalidRequestError: `keys` is not iterable, a key is no block key, or `length` is not a non-negative
                integer (nothing is stored).
        """
        if type(keys) is not list and type(keys) is not tuple:  # sliced below; None is refused by name
            keys = list(require_iterable("keys", keys, error=InvalidRequestError))
        if not all(type(key) is int and 0 <= key < BLOCK_KEY_LIMIT for key in keys):  # before a block is stored
            keys = [check_block_key(key) for key in keys]
        pool = self.pools[0]
        if pool.holds_bytes:
            raise ConfigError(f"the {pool.tier.name} tier stores bytes: put_chain needs a metadata-only tier")
        size = self._length_without_data(length)
        entries, log, has_holds = self._entries, self._log, self._has_holds
        accesses = [policy.access for policy in self._policies]
        access, allocate = accesses[0], pool.try_allocate
        parent = None
        puts = 0
        # The chain's blocks so far, pinned in their tiers' policies from the first time room must be made (until
        # then nothing is evicted, so all of them are still cached): the victims that make room are never its own.
        protected: list[tuple[int, BlockKey]] | None = None
        with self._lock:
            try:
                for position, key in enumerate(keys):
                    entry = entries.get(key)
                    if entry is not None and entry.corrupt:
                        entry = self._unless_corrupt(key, entry)
                    if entry is not None:
                        if entry.ready:
                            accesses[entry.level](key)
                            if protected is not None:
                                self._protect(protected, key, entry)
                    else:
                        page = allocate()
                        if page is None:
                            if not position:
                                page = self._make_room(0, needed_for=key)
                            else:
                                if protected is None:
                                    protected = []
                                    for earlier in keys[:position]:
                                        self._protect(protected, earlier, entries.get(earlier))
                                page = self._try_make_room(0)
                                if page is None:
                                    break  # only the chain's own blocks could make room: the rest stays out
                        entry = entries[key] = Entry(0, page, size, None, parent, 0, position, True)  # pins 0, ready
                        access(key, parent=parent, position=position)
                        if has_holds:
                            self._add_successor(key, parent)
                        log.append((STORED, 0, key))
                        puts += 1
                        if protected is not None:
                            self._protect(protected, key, entry)
                    parent = key
            finally:
                for level, key in protected or ():
                    self._policies[level].unpin(key)
                self._counts["puts"] += puts

    def _protect(self, protected: list[tuple[int, BlockKey]], key: BlockKey, entry: Entry | None) -> None:
        """Pin a cached block of `put_chain`'s chain in its tier's policy, noting where to unpin it (lock held)."""
        if entry is not None and entry.ready:
            self._policies[entry.level].pin(key)
            protected.append((entry.level, key))

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
            InvalidRequestError: `key` or `parent` is not a non-negative integer.
        """
        key = check_block_key(key)
        if parent is not None:
            parent = check_block_key(parent)
        _check_position(position)
        require_int("length", length, minimum=0, error=InvalidRequestError)
        if not self.pools[0].zero_copy:
            raise ConfigError(f"the {self.pools[0].tier.name} tier cannot be filled in place: use put")
        if not 0 <= length <= self.page_bytes:
            raise CapacityError(f"{length} bytes do not fit a page of {self.page_bytes} bytes")
        with self._lock:
            if self._unless_corrupt(key, self._entries.get(key)) is not None:
                return None
            entry = self._claim(key, length, parent, position)
            return self.pools[0].read(entry.page, length)

    def commit(self, key: BlockKey, *, checksum: int | None = None) -> None:
        """Publish a reserved block, first verifying it against `checksum` when given.

        Raises:
            UnknownBlockError: `key` is not reserved.
            IntegrityError: the bytes do not match `checksum` (the reservation is dropped).
            InvalidRequestError: `key` is no block key, or `checksum` not in [0, 2**64).
        """
        key = _key(key)
        if checksum is not None:
            check_checksum(checksum)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.ready:
                raise UnknownBlockError(f"block {key} is not reserved")
        if checksum is not None:
            actual = self._digest(key, entry)
            if actual != checksum:
                self.abort(key)
                raise IntegrityError(f"block {key}: bytes hash to {actual:#018x}, the sender said {checksum:#018x}")
        self._publish(key, entry, checksum)

    def abort(self, key: BlockKey) -> None:
        """Give back the page of a reserved block (no effect if `key` is not reserved).

        Raises:
            InvalidRequestError: `key` is no block key.
        """
        key = _key(key)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and not entry.ready:
                del self._entries[key]
                if self._has_holds:
                    self._remove_successor(key, entry.parent)
                self._release(entry.level, entry.page)

    def location(self, key: BlockKey) -> BlockLocation | None:
        """Where a cached or reserved block lives, or None; pin a cached block first if
        the answer must stay true (a reserved one stays put until committed).

        Raises:
            InvalidRequestError: `key` is no block key.
        """
        key = _key(key)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.corrupt:
                return None
            return BlockLocation(self.pools[entry.level].tier, entry.page, entry.length, entry.ready)

    def remove(self, key: BlockKey) -> None:
        """Drop `key` from the cache.

        Raises:
            UnknownBlockError: it is not cached. BlockPinnedError: it is pinned.
            InvalidRequestError: `key` is no block key.
        """
        key = _key(key)
        with self._lock:
            entry = self._ready_entry(key)
            if entry.pins:
                raise BlockPinnedError(f"block {key} is pinned {entry.pins} time(s)")
            self._policies[entry.level].remove(key)
            self._drop(key, entry)

    def evict(self, num_blocks: int) -> int:
        """Evict up to `num_blocks` unpinned blocks from the first tier, chosen by its eviction policy and moved
        down (or dropped) as a put that needs their pages would: for an owner whose pages this cache shares
        with other uses (a simulated vLLM instance's HBM, whose running requests take pages from its prefix
        cache). O(blocks evicted).

        Returns:
            The blocks evicted: fewer than `num_blocks` only when every other first-tier block is pinned, or is
            the prefix of a cached block and no lower tier takes it (dropping it would strand its successors:
            in a single tier, the prefix of a pinned block stays).

        Raises:
            InvalidRequestError: `num_blocks` is not a non-negative integer.
        """
        require_int("num_blocks", num_blocks, minimum=0, error=InvalidRequestError)
        with self._lock:
            for evicted in range(num_blocks):
                if not self._evict_one(0):
                    return evicted
            return num_blocks

    # ------------------------------------------------------------------ reads

    def get(self, key: BlockKey) -> PageBytes | None:
        """The bytes of `key`, or None on a miss.

        A DRAM hit is a zero-copy view of the page, valid while the block is
        pinned (or until the cache next changes); an SSD hit is a verified copy,
        or a view of the first tier when the read promotes it. A block that fails
        its checksum, or whose page cannot be read (an I/O error), is dropped and reported as a miss.

        Raises:
            InvalidRequestError: `key` is no block key.
            ConfigError: its tier holds no bytes (use `touch`).
        """
        key = _key(key)
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
                return self.pools[0].read(entry.page, entry.length, key=key)
            if entry.level:
                entry.lower_reads += 1
                if self._should_promote(entry):
                    return self._promote(key, entry)
            entry.pins += 1  # hold the page while reading outside the lock
            entry.reads += 1
            self._policies[entry.level].pin(key)
        data = None
        failure: Exception | None = None  # the page failed verification or could not be read; not an interrupt
        try:
            data = self.pools[entry.level].read(entry.page, entry.length, key=key)
        except (IntegrityError, OSError) as error:  # an unreadable page (a bad sector) is as good as corrupt
            failure = error
        finally:
            with self._lock:
                if failure is not None:
                    self._warn_corrupt(key, entry.level, failure)
                    self._found_corrupt(key, entry)
                entry.reads -= 1
                self._unpin_entry(key, entry)
        return data

    def touch(self, key: BlockKey) -> Tier | None:
        """Record a read of `key` without its bytes (promoting it as `get` would); its tier, or None. Where every
        first-tier page is pinned the block stays put and no page is read (`get` would verify its bytes there).

        Raises:
            InvalidRequestError: `key` is no block key.
        """
        key = _key(key)
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
                    self._promote(key, entry, read=False)
            return self.pools[entry.level].tier if key in self._entries else None

    def checksum(self, key: BlockKey) -> int:
        """XXH3-64 of the block's bytes, for exporting it to a peer (which verifies the bytes it gets against it).

        The digest the block was stored or verified with (every block on SSD has one: its page header's), else
        computed once from its bytes and remembered. Bytes that fail verification as they are read (or a page
        that cannot be read) make the block a miss, as in `get`: it is dropped (at its last unpin, if pinned),
        counted in `stats.corrupt_blocks` and announced removed, and the call raises UnknownBlockError.

        Raises:
            UnknownBlockError: `key` is not cached, or its bytes failed verification.
            ConfigError: its tier holds no bytes.
            InvalidRequestError: `key` is no block key.
        """
        key = _key(key)
        with self._lock:
            entry = self._ready_entry(key)
            if entry.corrupt:
                raise UnknownBlockError(f"block {key} is not cached (it failed verification)")
            if entry.checksum is None:
                try:
                    entry.checksum = self._digest(key, entry)
                except IntegrityError as error:
                    self._warn_corrupt(key, entry.level, error)
                    self._found_corrupt_unread(key, entry)
                    raise UnknownBlockError(f"block {key} is not cached: its bytes failed verification") from error
            return entry.checksum

    def _found_corrupt_unread(self, key: BlockKey, entry: Entry) -> None:
        """`entry`'s bytes failed verification outside a read that counts as a hit (lock held): dropped now, or
        at its last unpin (which counts it), as `get` drops a block it finds corrupt; logged removed now."""
        self._mark_corrupt(key, entry)
        if entry.pins == 0:
            self._policies[entry.level].remove(key)
            self._drop(key, entry)
            self._counts["corrupt_blocks"] += 1

    # ------------------------------------------------------------------ pins

    def pin(self, key: BlockKey) -> None:
        """Protect `key` from eviction, demotion, promotion and overwrite (reference counted).

        Raises:
            UnknownBlockError: it is not cached. InvalidRequestError: `key` is no block key.
        """
        key = _key(key)
        with self._lock:
            entry = self._ready_entry(key)
            if entry.corrupt:
                raise UnknownBlockError(f"block {key} is not cached (it failed verification)")
            entry.pins += 1
            self._policies[entry.level].pin(key)

    def unpin(self, key: BlockKey) -> None:
        """Release one pin of `key`: first one taken before its copy failed verification and was replaced (that
        copy's page is freed at its last pin), so the new copy's pins never fall below its holders'.

        Never fails once the pin is found: the last unpin of a block that failed verification drops it and frees
        its page, and where the disk then refuses to invalidate the page (an SSD header that cannot be zeroed) the
        page is free all the same, so the unpin completes, counting the failure in `stats.failed_releases` and
        logging it as a warning. (Raising there, after the pin was released, would stop a caller releasing
        several pins in a loop, leaving the rest pinned for good.)

        Raises:
            UnknownBlockError: it is not pinned (a read in progress in another thread holds a pin of its own,
                which no unpin releases). InvalidRequestError: `key` is no block key.
        """
        key = _key(key)
        with self._lock:
            for copy in self._aside.get(key, ()):
                if copy.pins > copy.reads:  # a holder's pin, not a read's in progress
                    self._unpin_entry(key, copy)
                    return
            entry = self._ready_entry(key)
            if entry.pins == entry.reads:  # the rest are held by reads in progress, which release their own
                raise UnknownBlockError(f"block {key} is not pinned")
            self._unpin_entry(key, entry)

    @contextlib.contextmanager
    def pinned(self, key: BlockKey) -> Iterator[PageBytes | None]:
        """Pin `key` and yield its bytes (None on a miss) for the duration of the block.

        A read that promotes the block (its `promote_after`-th in a lower tier) promotes it first and
        pins it where it lands: a pinned block never moves, so reads under a pin alone would never promote.

        Raises:
            InvalidRequestError: `key` is no block key (on entering the block).
        """
        key = _key(key)
        with self._lock:
            entry = self._entries.get(key)
            promotes = (
                entry is not None and entry.is_live and entry.level and self._should_promote(entry, reads_ahead=1)
            )
            if promotes:
                data = self.get(key)  # promoted under the lock (RLock), so nothing evicts it before the pin
                hit = data is not None
            else:
                hit = key in self
                if not hit:
                    self._counts["misses"] += 1
            if hit:
                self.pin(key)
        if not hit:
            yield None  # outside the lock: the caller's block may take its time
            return
        try:
            yield data if promotes else self.get(key)
        finally:
            with self._lock:
                if key in self._entries or key in self._aside:
                    self.unpin(key)

    # ------------------------------------------------------------------ events

    def take_events(self) -> list[CacheEvent]:
        """Events since the last call: the changes grouped into one event per kind and tier,
        within stretches of the log where no key changes twice (changes to distinct keys commute,
        so a consumer applying the events in order ends where applying each change would)."""
        with self._lock:
            log, self._log = self._log, []
            groups = group_changes(log)
            cleared, self._announcing = self._announcing, False
            first_seq = self._seq
            self._seq += cleared + len(groups)
            source, epoch = self.source, self.epoch
        events: list[CacheEvent] = [AllBlocksCleared(source=source, seq=first_seq, epoch=epoch)] if cleared else []
        first_seq += cleared
        events.extend(
            (BlockStored if kind == STORED else BlockRemoved)(
                source=source, seq=first_seq + i, keys=keys, tier=self.pools[level].tier, epoch=epoch
            )
            for i, ((kind, level), keys) in enumerate(groups)
        )
        return events

    def announce_all(self, epoch: int) -> None:
        """Start event epoch `epoch` with everything the cache holds: the next `take_events` begins with an
        `AllBlocksCleared` at seq 0 of `epoch`, then one `BlockStored` per tier of the blocks it holds (what every
        event so far, applied in order, would leave), and changes not yet taken are folded into it. For a consumer
        that lost this cache's events (an index that forgot the source while it did not answer, a subscriber that
        joined late): an index applies an epoch's seq 0 whatever it knew of the source, replacing it. The clear
        comes first whatever the cache holds, as vLLM's publisher clears on a reset: an empty cache has no store to
        carry the new epoch, and without an event a consumer would keep every block it last believed held.

        Raises:
            InvalidRequestError: `epoch` is not an integer above the current epoch (a consumer drops an event of
                an epoch it has passed).
        """
        with self._lock:
            require_int("epoch", epoch, minimum=self.epoch + 1, error=InvalidRequestError)
            self.epoch, self._seq, self._announcing = epoch, 0, True
            self._log = [(STORED, entry.level, key) for key, entry in self._entries.items() if entry.is_live]

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close every pool."""
        for pool in self.pools:
            pool.close()


def _key(key: object) -> BlockKey:
    """`key` as a block key (`check_block_key`: a numpy integer becomes the int it equals), an int in range in one
    test; InvalidRequestError for anything else."""
    return key if type(key) is int and 0 <= key < BLOCK_KEY_LIMIT else check_block_key(key)  # type: ignore[return-value]


def _check_position(position: object) -> None:
    """A block's index in its request: checked before a page is claimed (a policy refusing it afterwards
    would leave a block that is cached but no policy can evict)."""
    require_int("position", position, minimum=0, error=InvalidRequestError)
