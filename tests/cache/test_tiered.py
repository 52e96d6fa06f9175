"""The tiered cache against a dict-with-losses reference, plus its edge contracts."""

from __future__ import annotations

import math
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mooncake.cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from mooncake.cache.index import BlockIndex, Holder
from mooncake.cache.policy import LengthAwarePolicy, LfuPolicy, LruPolicy, SievePolicy
from mooncake.cache.pool import DramPagePool, MetadataPagePool
from mooncake.cache.ssd import SsdPagePool
from mooncake.cache.tiered import BlockLocation, TieredCache
from mooncake.errors import (
    BlockPinnedError,
    CapacityError,
    ConfigError,
    IntegrityError,
    InvalidRequestError,
    UnknownBlockError,
)
from mooncake.types import BlockKey, InstanceId, Tier
from tests.cache.policies import ALL_POLICIES, POLICIES
from tests.strategies import block_keys

PAGE = 64
SOURCE = InstanceId("node-0")


def block(key: int) -> bytes:
    """The bytes of block `key`: a function of the key, as content-addressed blocks are."""
    seed = xxhash.xxh3_64_digest(key.to_bytes(8, "little"))
    return (seed * 8)[: 1 + key % PAGE]


def make_cache(tmp: Path, *, dram_pages: int = 3, ssd_pages: int = 5, **options: object) -> TieredCache:
    pools = [DramPagePool(PAGE, dram_pages), SsdPagePool(tmp / "ssd.pool", PAGE, ssd_pages)]
    return TieredCache(pools, source=SOURCE, **options)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- examples


def test_put_get_round_trip_and_zero_copy(tmp_path: Path) -> None:
    """A DRAM hit is a zero-copy view of the page holding exactly the bytes put."""
    cache = make_cache(tmp_path)
    assert cache.put(BlockKey(7), block(7)) == Tier.DRAM
    view = cache.get(BlockKey(7))
    assert bytes(view) == block(7)
    pool = cache.pools[0]
    assert isinstance(pool, DramPagePool)
    assert np.shares_memory(np.frombuffer(view, dtype=np.uint8), pool.buffer)
    cache.close()


def test_put_is_idempotent(tmp_path: Path) -> None:
    """Putting a cached key again stores nothing new and keeps the first bytes."""
    cache = make_cache(tmp_path)
    cache.put(BlockKey(1), block(1))
    cache.take_events()
    cache.put(BlockKey(1), b"other bytes")
    assert bytes(cache.get(BlockKey(1))) == block(1)
    assert cache.take_events() == []
    assert cache.stats.puts == 1
    cache.close()


def test_eviction_demotes_then_drops(tmp_path: Path) -> None:
    """Blocks leave DRAM for SSD in LRU order and leave SSD for nowhere; every step is an event."""
    cache = make_cache(tmp_path, dram_pages=2, ssd_pages=2)
    for key in range(1, 6):
        cache.put(BlockKey(key), block(key))
    assert [cache.tier_of(BlockKey(k)) for k in range(1, 6)] == [None, Tier.SSD, Tier.SSD, Tier.DRAM, Tier.DRAM]
    assert cache.stats.demotions == 3 and cache.stats.drops == 1
    assert cache.used_bytes(Tier.DRAM) == 2 * PAGE and cache.used_bytes(Tier.SSD) == 2 * PAGE
    cache.check_invariants()
    cache.close()


def test_ssd_read_promotes_by_policy(tmp_path: Path) -> None:
    """With promote_after=2 a block climbs back to DRAM on its second read there; 0 never promotes."""
    cache = make_cache(tmp_path, dram_pages=1, ssd_pages=3, promote_after=2)
    cache.put(BlockKey(1), block(1))
    cache.put(BlockKey(2), block(2))
    assert cache.tier_of(BlockKey(1)) == Tier.SSD
    assert bytes(cache.get(BlockKey(1))) == block(1)
    assert cache.tier_of(BlockKey(1)) == Tier.SSD
    assert bytes(cache.get(BlockKey(1))) == block(1)
    assert cache.tier_of(BlockKey(1)) == Tier.DRAM
    assert cache.tier_of(BlockKey(2)) == Tier.SSD
    assert cache.stats.promotions == 1
    cache.close()
    (tmp_path / "never").mkdir()
    never = make_cache(tmp_path / "never", dram_pages=1, ssd_pages=3, promote_after=0)
    never.put(BlockKey(1), block(1))
    never.put(BlockKey(2), block(2))
    for _ in range(3):
        assert bytes(never.get(BlockKey(1))) == block(1)
    assert never.tier_of(BlockKey(1)) == Tier.SSD
    never.close()


def test_a_promotion_in_a_full_hierarchy_swaps_the_block_with_the_first_tiers_victim(tmp_path: Path) -> None:
    """Every page holds a block: a read that promotes one from SSD trades places with DRAM's victim, and no
    block is lost (demoting the victim first would have found SSD full and dropped one); the events say so."""
    cache = make_cache(tmp_path, dram_pages=2, ssd_pages=2, promote_after=1)
    index = BlockIndex()
    for key in range(1, 5):
        cache.put(BlockKey(key), block(key))
    assert [cache.tier_of(BlockKey(k)) for k in range(1, 5)] == [Tier.SSD, Tier.SSD, Tier.DRAM, Tier.DRAM]
    assert bytes(cache.get(BlockKey(1))) == block(1)
    assert [cache.tier_of(BlockKey(k)) for k in range(1, 5)] == [Tier.DRAM, Tier.SSD, Tier.SSD, Tier.DRAM]
    stats = cache.stats
    assert (stats.promotions, stats.drops, stats.demotions) == (1, 0, 3)
    for key in range(1, 5):
        assert bytes(cache.get(BlockKey(key))) == block(key)
    for event in cache.take_events():
        assert index.apply(event) is None
    assert [index.holders(BlockKey(k)) for k in range(1, 5)] == [
        (Holder(SOURCE, cache.tier_of(BlockKey(k))),)
        for k in range(1, 5)  # type: ignore[arg-type]
    ]
    cache.check_invariants()
    cache.close()


def test_a_swap_with_a_zero_copy_second_tier_keeps_both_blocks_bytes() -> None:
    """The swap where the second tier's reads are views of its pages (host memory under an accelerator's, here
    two host pools standing in): the promoted block's bytes are taken whole before the victim overwrites its
    page, and both blocks read back right."""
    pools = [DramPagePool(PAGE, 1, tier=Tier.VRAM), DramPagePool(PAGE, 1)]
    cache = TieredCache(pools, source=SOURCE, promote_after=1)  # type: ignore[arg-type]
    cache.put(BlockKey(1), block(1))
    cache.put(BlockKey(2), block(2))  # 1 goes down to the second tier
    assert bytes(cache.get(BlockKey(1))) == block(1)  # promoted: 2 goes down in its place
    assert (cache.tier_of(BlockKey(1)), cache.tier_of(BlockKey(2))) == (Tier.VRAM, Tier.DRAM)
    assert bytes(cache.get(BlockKey(2))) == block(2) and bytes(cache.get(BlockKey(1))) == block(1)
    cache.check_invariants()
    cache.close()


def test_a_promotion_from_the_third_tier_passes_one_block_down_each_tier(tmp_path: Path) -> None:
    """Three full tiers of one page each: promoting the SSD block moves VRAM's block to DRAM and DRAM's into the
    SSD page it left; nothing is dropped and the events say where each block is."""
    pools = [DramPagePool(PAGE, 1, tier=Tier.VRAM), DramPagePool(PAGE, 1), SsdPagePool(tmp_path / "ssd", PAGE, 1)]
    cache = TieredCache(pools, source=SOURCE, promote_after=1)  # type: ignore[arg-type]
    index = BlockIndex()
    for key in (1, 2, 3):
        cache.put(BlockKey(key), block(key))
    assert [cache.tier_of(BlockKey(k)) for k in (1, 2, 3)] == [Tier.SSD, Tier.DRAM, Tier.VRAM]
    assert bytes(cache.get(BlockKey(1))) == block(1)
    assert [cache.tier_of(BlockKey(k)) for k in (1, 2, 3)] == [Tier.VRAM, Tier.SSD, Tier.DRAM]
    assert (cache.stats.promotions, cache.stats.drops) == (1, 0)
    for key in (1, 2, 3):
        assert bytes(cache.get(BlockKey(key))) == block(key)
    for event in cache.take_events():
        assert index.apply(event) is None
    for key in (1, 2, 3):
        assert index.holders(BlockKey(key)) == (Holder(SOURCE, cache.tier_of(BlockKey(key))),)  # type: ignore[arg-type]
    cache.check_invariants()
    cache.close()


def test_a_victim_passes_a_tier_whose_pages_are_all_pinned(tmp_path: Path) -> None:
    """A first-tier victim whose next tier holds only pinned blocks goes to the tier below it, not away."""
    pools = [DramPagePool(PAGE, 1, tier=Tier.VRAM), DramPagePool(PAGE, 1), SsdPagePool(tmp_path / "ssd", PAGE, 2)]
    cache = TieredCache(pools, source=SOURCE, promote_after=0)  # type: ignore[arg-type]
    cache.put(BlockKey(1), block(1))
    cache.put(BlockKey(2), block(2))  # 1 goes down to DRAM
    cache.pin(BlockKey(1))
    cache.put(BlockKey(3), block(3))
    assert [cache.tier_of(BlockKey(k)) for k in (1, 2, 3)] == [Tier.DRAM, Tier.SSD, Tier.VRAM]
    assert cache.stats.drops == 0 and bytes(cache.get(BlockKey(2))) == block(2)
    cache.unpin(BlockKey(1))
    cache.check_invariants()
    cache.close()


def test_reads_under_pinned_promote_as_plain_gets_do(tmp_path: Path) -> None:
    """`pinned` (the documented way to read) promotes on the same read as `get`, and pins the block where
    it lands: it was pinned before its read, and a pinned block never moves, so it never promoted."""
    for promote_after in (1, 2):
        folder = tmp_path / str(promote_after)
        folder.mkdir()
        cache = make_cache(folder, dram_pages=1, ssd_pages=3, promote_after=promote_after)
        cache.put(BlockKey(1), block(1))
        cache.put(BlockKey(2), block(2))
        for read in range(1, promote_after + 1):
            assert cache.tier_of(BlockKey(1)) == Tier.SSD
            with cache.pinned(BlockKey(1)) as view:
                assert bytes(view) == block(1)  # type: ignore[arg-type]
                with pytest.raises(BlockPinnedError):
                    cache.remove(BlockKey(1))
                if read == promote_after:
                    assert cache.tier_of(BlockKey(1)) == Tier.DRAM
                    with pytest.raises(CapacityError, match="pinned"):  # the only DRAM page: pinned where it landed
                        cache.put(BlockKey(3), block(3))
                    assert bytes(view) == block(1)  # type: ignore[arg-type]
        assert cache.stats.promotions == 1
        cache.check_invariants()
        cache.remove(BlockKey(1))  # no pin is left behind
        cache.close()


def test_pinned_blocks_are_never_moved_or_lost(tmp_path: Path) -> None:
    """A pinned DRAM block survives any number of puts; with DRAM all pinned, a new put fails clearly."""
    cache = make_cache(tmp_path, dram_pages=2, ssd_pages=2)
    cache.put(BlockKey(1), block(1))
    cache.pin(BlockKey(1))
    for key in range(2, 10):
        cache.put(BlockKey(key), block(key))
    assert cache.tier_of(BlockKey(1)) == Tier.DRAM
    cache.pin(BlockKey(9))
    with pytest.raises(CapacityError, match="pinned"):
        cache.put(BlockKey(20), block(20))
    assert BlockKey(20) not in cache
    with pytest.raises(BlockPinnedError):
        cache.remove(BlockKey(1))
    cache.unpin(BlockKey(1))
    with pytest.raises(UnknownBlockError):
        cache.unpin(BlockKey(1))
    cache.put(BlockKey(20), block(20))
    assert cache.tier_of(BlockKey(1)) == Tier.SSD
    cache.check_invariants()
    cache.close()


def test_pinned_context_manager(tmp_path: Path) -> None:
    """`pinned` yields the bytes while holding a pin, and None on a miss."""
    cache = make_cache(tmp_path)
    cache.put(BlockKey(3), block(3))
    with cache.pinned(BlockKey(3)) as view:
        assert bytes(view) == block(3)
        with pytest.raises(BlockPinnedError):
            cache.remove(BlockKey(3))
    cache.remove(BlockKey(3))
    with cache.pinned(BlockKey(3)) as view:
        assert view is None
    cache.close()


def test_import_checksum_and_export_checksum(tmp_path: Path) -> None:
    """A peer's checksum is verified on put; `checksum` gives the value a peer will verify."""
    cache = make_cache(tmp_path)
    good = xxhash.xxh3_64_intdigest(block(5))
    with pytest.raises(IntegrityError):
        cache.put(BlockKey(5), block(5), checksum=good ^ 1)
    assert BlockKey(5) not in cache
    cache.put(BlockKey(5), block(5), checksum=good)
    cache.put(BlockKey(6), block(6))
    assert cache.checksum(BlockKey(5)) == good
    assert cache.checksum(BlockKey(6)) == xxhash.xxh3_64_intdigest(block(6))
    cache.close()


def test_prefix_match_counts_leading_blocks_in_any_tier(tmp_path: Path) -> None:
    """prefix_match stops at the first missing key; blocks in SSD count."""
    cache = make_cache(tmp_path, dram_pages=1, ssd_pages=4)
    for key in (1, 2, 3):
        cache.put(BlockKey(key), block(key), parent=BlockKey(key - 1) if key > 1 else None)
    assert cache.prefix_match([BlockKey(k) for k in (1, 2, 3, 4)]) == 3
    assert cache.prefix_match([BlockKey(k) for k in (2, 1)]) == 2
    assert cache.prefix_match([BlockKey(9), BlockKey(1)]) == 0
    cache.close()


def test_invalid_configurations(tmp_path: Path) -> None:
    """No pools, mixed page sizes, repeated tiers, bad promote_after, epoch or source are ConfigErrors; oversize data a
    CapacityError."""
    with pytest.raises(ConfigError):
        TieredCache([])
    with pytest.raises(ConfigError, match="page size"):
        TieredCache([DramPagePool(64, 2), SsdPagePool(tmp_path / "x", 128, 2)])
    with pytest.raises(ConfigError, match="distinct"):
        TieredCache([DramPagePool(64, 2), DramPagePool(64, 2)])
    with pytest.raises(ConfigError, match="promote_after"):
        TieredCache([DramPagePool(64, 2)], promote_after=-1)
    # The events' stamp, refused when the cache is made (not when its first events are taken).
    with pytest.raises(ConfigError, match="epoch must be an integer >= 0, got -1"):
        TieredCache([DramPagePool(64, 2)], epoch=-1)
    for source in ("", 5):
        with pytest.raises(ConfigError, match="source must be a non-empty instance id string"):
            TieredCache([DramPagePool(64, 2)], source=source)  # type: ignore[arg-type]
    cache = TieredCache([DramPagePool(64, 2)])
    with pytest.raises(CapacityError, match="65 bytes"):
        cache.put(BlockKey(1), bytes(65))
    with pytest.raises(ConfigError, match="needs data"):
        cache.put(BlockKey(1))


def test_metadata_only_cache_runs_the_same_code() -> None:
    """Metadata pools account pages without bytes: put without data, touch, promotion, events."""
    cache = TieredCache(
        [MetadataPagePool(Tier.DRAM, 1 << 30, 2), MetadataPagePool(Tier.SSD, 1 << 30, 10**12)], source=SOURCE
    )
    for key in range(1, 6):
        cache.put(BlockKey(key), length=1 << 20)
    assert cache.tier_of(BlockKey(1)) == Tier.SSD
    assert cache.touch(BlockKey(1)) == Tier.DRAM
    assert cache.touch(BlockKey(99)) is None
    with pytest.raises(ConfigError, match="touch"):
        cache.get(BlockKey(1))
    index = BlockIndex()
    for event in cache.take_events():
        assert index.apply(event) is None
    assert {k for k in range(1, 6) if index.holders(BlockKey(k))} == set(range(1, 6))
    cache.check_invariants()


def test_recovered_blocks_are_announced_and_served(tmp_path: Path) -> None:
    """After reopening, SSD blocks are served again and announced in one stored event of the new epoch."""
    cache = make_cache(tmp_path, dram_pages=1, ssd_pages=4)
    for key in (1, 2, 3):
        cache.put(BlockKey(key), block(key))
    cache.close()  # DRAM contents are lost with the process; SSD pages survive
    again = make_cache(tmp_path, dram_pages=1, ssd_pages=4, epoch=1)
    events = again.take_events()
    assert len(events) == 1 and events[0].tier == Tier.SSD and events[0].epoch == 1
    assert set(events[0].keys) == {1, 2}
    assert bytes(again.get(BlockKey(2))) == block(2)
    assert BlockKey(3) not in again
    again.close()


def test_concurrent_pinned_readers_see_only_right_bytes(tmp_path: Path) -> None:
    """One writer churning the cache and three readers under `pinned`: no reader sees wrong bytes."""
    cache = make_cache(tmp_path, dram_pages=4, ssd_pages=6)
    wrong: list[int] = []
    stop = threading.Event()

    def reader(offset: int) -> None:
        key = offset
        while not stop.is_set():
            key = (key * 7 + 3) % 40
            with cache.pinned(BlockKey(key)) as view:
                if view is not None and bytes(view) != block(key):
                    wrong.append(key)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    try:
        for i in range(3000):
            cache.put(BlockKey(i % 40), block(i % 40))
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)
    assert wrong == []
    cache.check_invariants()
    cache.close()


# --------------------------------------------------------------------------- state machine

keys = st.integers(min_value=1, max_value=12).map(BlockKey)


class TieredMachine(RuleBasedStateMachine):
    """The cache against a dict with losses: what it returns was put, pins hold, events mirror it, and a block
    is lost only to make room for another while every page of the hierarchy holds a block: one at most, and
    only by a put or a reservation (a read, a pin or a remove of another block loses nothing)."""

    policy_class: type = LruPolicy
    with_parents = False

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="tiered-machine-"))
        self.cache = TieredCache(
            self.pools(),
            source=SOURCE,
            policy=lambda: self.policy_class(prefix_aware=self.with_parents),
            promote_after=2,
        )
        self.reference: dict[BlockKey, bytes] = {}  # everything ever put; the cache may lose any unpinned one
        self.pins: dict[BlockKey, int] = {}
        self.pinned_tier: dict[BlockKey, Tier | None] = {}
        self.index = BlockIndex()
        self.held: set[BlockKey] = set()  # what the cache held after the last step
        self.may_evict = False  # the step may claim a page (a put or a reservation)
        self.removed: set[BlockKey] = set()  # what the step removed on purpose

    def pools(self) -> list[Any]:
        return [DramPagePool(PAGE, 3), SsdPagePool(self.tmp / "ssd.pool", PAGE, 4)]

    def teardown(self) -> None:
        self.cache.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def first_tier_all_pinned(self) -> bool:
        first = self.cache.pools[0]
        return sum(1 for k in self.pins if self.cache.tier_of(k) == first.tier) >= first.num_pages

    @rule(key=keys)
    def put(self, key: BlockKey) -> None:
        self.may_evict = True
        parent = BlockKey(key - 1) if self.with_parents and key > 1 else None
        if key not in self.cache and self.first_tier_all_pinned():
            with pytest.raises(CapacityError):
                self.cache.put(key, block(key), parent=parent)
            return
        self.cache.put(key, block(key), parent=parent)
        self.reference[key] = block(key)
        assert key in self.cache

    @rule(forget=st.booleans())
    def announce_all(self, forget: bool) -> None:
        """A consumer that lost the events (an index that forgot the source, or not) is brought back by a new
        epoch announcing everything held: the invariant below applies it and compares."""
        if forget:
            self.index.remove_instance(SOURCE)
        self.cache.announce_all(self.cache.epoch + 1)

    @rule(key=keys, good=st.booleans(), abort=st.booleans())
    def reserve_fill_commit(self, key: BlockKey, good: bool, abort: bool) -> None:
        self.may_evict = True
        data = block(key)
        parent = BlockKey(key - 1) if self.with_parents and key > 1 else None
        if key in self.cache:
            assert self.cache.reserve(key, len(data), parent=parent) is None
            return
        if self.first_tier_all_pinned():
            with pytest.raises(CapacityError):
                self.cache.reserve(key, len(data), parent=parent)
            return
        view = self.cache.reserve(key, len(data), parent=parent)
        assert key not in self.cache  # invisible until committed
        view[:] = data
        if abort:
            self.cache.abort(key)
        elif good:
            self.cache.commit(key, checksum=xxhash.xxh3_64_intdigest(data))
            self.reference[key] = data
        else:
            with pytest.raises(IntegrityError):
                self.cache.commit(key, checksum=xxhash.xxh3_64_intdigest(data) ^ 1)
        assert (key in self.cache) == (good and not abort)

    @rule(key=keys)
    def get(self, key: BlockKey) -> None:
        view = self.cache.get(key)
        if view is None:
            assert key not in self.pins, "a pinned block was lost"
        else:
            assert bytes(view) == self.reference[key]

    @rule(key=keys)
    def touch(self, key: BlockKey) -> None:
        tier = self.cache.touch(key)
        assert (tier is None) == (key not in self.cache)

    # Not with parents: prefix-aware, a put may find no room while the first tier still holds unpinned blocks,
    # prefixes of pinned or cached blocks that a last tier full of such blocks cannot take (`_make_room`'s
    # second refusal). `put` here expects a refusal iff every first-tier page is pinned, which holds only for
    # blocks ranked alone. Pins with prefix awareness are driven by test_tiered_prefix.py's PrefixMachine (LRU,
    # SIEVE, and LFU on three tiers), whose `put` allows that refusal.
    @precondition(lambda self: not self.with_parents)
    @rule(key=keys)
    def pin(self, key: BlockKey) -> None:
        if key in self.cache:
            self.cache.pin(key)
            self.pins[key] = self.pins.get(key, 0) + 1
            self.pinned_tier[key] = self.cache.tier_of(key)
        else:
            with pytest.raises(UnknownBlockError):
                self.cache.pin(key)

    @precondition(lambda self: bool(self.pins))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.pins)))
        self.cache.unpin(key)
        self.pins[key] -= 1
        if not self.pins[key]:
            del self.pins[key]

    @rule(key=keys)
    def remove(self, key: BlockKey) -> None:
        if key in self.pins:
            with pytest.raises(BlockPinnedError):
                self.cache.remove(key)
        elif key in self.cache:
            self.cache.remove(key)
            self.removed = {key}
            assert key not in self.cache
        else:
            with pytest.raises(UnknownBlockError):
                self.cache.remove(key)

    @invariant()
    def only_what_was_put_is_served(self) -> None:
        for key in range(1, 13):
            tier = self.cache.tier_of(BlockKey(key))
            if tier is not None:
                assert BlockKey(key) in self.reference
        self.cache.check_invariants()

    @invariant()
    def blocks_are_lost_only_to_room_for_others(self) -> None:
        held = {BlockKey(key) for key in range(1, 13) if BlockKey(key) in self.cache}
        lost = self.held - held - self.removed
        if lost:
            assert self.may_evict, f"{sorted(lost)} lost by a step that claims no page"
            full = sum(pool.num_pages for pool in self.cache.pools)
            assert len(lost) == 1 and len(self.held) == full, f"{sorted(lost)} lost with {len(self.held)} held"
        self.held, self.may_evict, self.removed = held, False, set()

    @invariant()
    def pinned_blocks_are_kept(self) -> None:
        for key in self.pins:
            assert key in self.cache, f"pinned block {key} was lost"
            assert self.cache.tier_of(key) == self.pinned_tier[key], f"pinned block {key} moved"

    @invariant()
    def capacities_hold(self) -> None:
        for pool in self.cache.pools:
            assert self.cache.used_bytes(pool.tier) <= self.cache.capacity_bytes(pool.tier)
            assert self.cache.capacity_bytes(pool.tier) == pool.page_bytes * pool.num_pages

    @invariant()
    def events_mirror_the_cache(self) -> None:
        for event in self.cache.take_events():
            assert self.index.apply(event) is None
        for key in range(1, 13):
            tier = self.cache.tier_of(BlockKey(key))
            expected = () if tier is None else (Holder(SOURCE, tier),)
            assert self.index.holders(BlockKey(key)) == expected, f"block {key}"


TieredMachine.TestCase.settings = settings(stateful_step_count=40, deadline=None)
TestTieredLru = TieredMachine.TestCase


class TieredSieveMachine(TieredMachine):
    policy_class = SievePolicy


class TieredLfuPrefixMachine(TieredMachine):
    policy_class = LfuPolicy
    with_parents = True


class ThreeTierMachine(TieredMachine):
    """Three tiers (host pools standing in for VRAM and DRAM, over SSD): a block promoted from the third tier
    rotates the first two tiers' victims down one tier each, into the page it leaves."""

    def pools(self) -> list[Any]:
        return [
            DramPagePool(PAGE, 2, tier=Tier.VRAM),
            DramPagePool(PAGE, 2),
            SsdPagePool(self.tmp / "ssd.pool", PAGE, 3),
        ]


TestTieredSieve = TieredSieveMachine.TestCase
TestThreeTiers = ThreeTierMachine.TestCase
TestThreeTiers.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestTieredLfuPrefix = TieredLfuPrefixMachine.TestCase


def test_pinned_on_a_miss_does_not_hold_the_lock(tmp_path: Path) -> None:
    """While a `pinned` block runs on a miss, other threads can still use the cache."""
    cache = make_cache(tmp_path)
    done = threading.Event()
    with cache.pinned(BlockKey(99)) as view:
        assert view is None
        worker = threading.Thread(target=lambda: (cache.put(BlockKey(1), block(1)), done.set()))
        worker.start()
        assert done.wait(timeout=10), "put blocked behind a miss"
        worker.join()
    cache.close()


# --------------------------------------------------------------------------- put_chain


def metadata_cache(*, dram_pages: int, ssd_pages: int, policy: type, prefix_aware: bool) -> TieredCache:
    pools = [MetadataPagePool(Tier.DRAM, PAGE, dram_pages)]
    if ssd_pages:
        pools.append(MetadataPagePool(Tier.SSD, PAGE, ssd_pages))
    return TieredCache(pools, source=SOURCE, policy=lambda: policy(prefix_aware=prefix_aware), promote_after=1)


def put_one_by_one(cache: TieredCache, keys: list[BlockKey], length: int | None) -> None:
    """What put_chain stands for: put each key with the previous one as parent and its index as position, every
    earlier block of the chain pinned while a new one is put (in whichever tier it is), and the chain ended at a
    block for which no room could be made then (only the chain's own blocks could have made it: storing on would
    have evicted the head and kept a tail no prompt matches); the first block's CapacityError goes to the caller."""
    parent = None
    for position, key in enumerate(keys):
        earlier = []
        if position and cache.location(key) is None:
            earlier = [k for k in keys[:position] if (where := cache.location(k)) is not None and where.ready]
        for k in earlier:
            cache.pin(k)
        try:
            cache.put(key, parent=parent, position=position, length=length)
        except CapacityError:
            if position:
                break
            raise
        finally:
            for k in earlier:
                cache.unpin(k)
        parent = key


chain_ops = st.lists(
    st.one_of(
        st.tuples(st.just("chain"), st.lists(block_keys, max_size=8), st.sampled_from([None, 0, 1, PAGE])),
        st.tuples(st.just("pin"), block_keys),
        st.tuples(st.just("unpin"), block_keys),
        st.tuples(st.just("touch"), block_keys),
        st.tuples(st.just("remove"), block_keys),
    ),
    max_size=25,
)


def outcome(call: Callable[..., object], *args: object, **kwargs: object) -> str:
    """Run `call(*args, **kwargs)`; the name of the exception it raised, or "ok"."""
    try:
        call(*args, **kwargs)
    except Exception as error:
        return type(error).__name__
    return "ok"


@settings(max_examples=120)
@given(
    chain_ops,
    st.integers(min_value=1, max_value=6),
    st.sampled_from([0, 3]),
    st.sampled_from([LruPolicy, LfuPolicy, SievePolicy, LengthAwarePolicy]),
    st.booleans(),
)
def test_put_chain_equals_puts_one_by_one(
    ops: list[tuple[Any, ...]], dram_pages: int, ssd_pages: int, policy: type, prefix_aware: bool
) -> None:
    """Against a second cache fed put(key, parent=previous, position=i, length=...) per key: the same
    contents, tiers, pages, stats and events, evictions and demotions included, and the same errors
    (every page pinned) with pins, touches and removals in between."""
    chained = metadata_cache(dram_pages=dram_pages, ssd_pages=ssd_pages, policy=policy, prefix_aware=prefix_aware)
    single = metadata_cache(dram_pages=dram_pages, ssd_pages=ssd_pages, policy=policy, prefix_aware=prefix_aware)
    for op in ops:
        if op[0] == "chain":
            _, keys, length = op
            results = [outcome(chained.put_chain, keys, length=length), outcome(put_one_by_one, single, keys, length)]
        else:  # pins may pile up until every page is pinned: then both must refuse new blocks alike
            name, key = op
            results = [outcome(getattr(cache, name), key) for cache in (chained, single)]
        assert results[0] == results[1]
        assert chained.take_events() == single.take_events()
        for candidate in range(31):
            assert chained.location(BlockKey(candidate)) == single.location(BlockKey(candidate))
        assert chained.stats == single.stats
        chained.check_invariants()
        single.check_invariants()


def test_put_chain_publishes_one_stored_event_per_run() -> None:
    """A chain into room is one BlockStored of its keys, in order; cached keys are uses, not new events."""
    cache = metadata_cache(dram_pages=8, ssd_pages=0, policy=LruPolicy, prefix_aware=True)
    cache.put_chain([BlockKey(k) for k in (5, 6, 7)], length=10)
    (stored,) = cache.take_events()
    assert (stored.keys, stored.tier, stored.seq) == ((5, 6, 7), Tier.DRAM, 0)
    cache.put_chain([BlockKey(k) for k in (5, 6, 8)])
    (stored,) = cache.take_events()
    assert (stored.keys, stored.seq) == ((8,), 1)
    assert cache.location(BlockKey(5)).length == 10  # type: ignore[union-attr]
    assert cache.location(BlockKey(8)).length == PAGE  # type: ignore[union-attr]
    assert cache.stats.puts == 4
    cache.put_chain([])
    assert cache.take_events() == []


def test_a_full_cache_taking_a_chain_publishes_one_removal_and_one_store() -> None:
    """Evictions interleaved with stores are grouped by kind and tier: one event each, in order."""
    cache = metadata_cache(dram_pages=3, ssd_pages=0, policy=LruPolicy, prefix_aware=False)
    cache.put_chain([BlockKey(k) for k in (1, 2, 3)])
    cache.take_events()
    cache.put_chain([BlockKey(k) for k in (7, 8)])
    removed, stored = cache.take_events()
    assert (type(removed), removed.keys, removed.tier, removed.seq) == (BlockRemoved, (1, 2), Tier.DRAM, 1)
    assert (type(stored), stored.keys, stored.tier, stored.seq) == (BlockStored, (7, 8), Tier.DRAM, 2)


def test_a_key_changed_twice_keeps_its_changes_in_order() -> None:
    """A key stored, evicted and stored again between two calls ends up held by whoever applies the events."""
    cache = metadata_cache(dram_pages=1, ssd_pages=0, policy=LruPolicy, prefix_aware=True)
    cache.put_chain([BlockKey(1)])
    cache.put_chain([BlockKey(2)])
    cache.put_chain([BlockKey(1)])
    events = cache.take_events()
    assert [(type(e), e.keys) for e in events] == [
        (BlockStored, (1,)),
        (BlockRemoved, (1,)),
        (BlockStored, (2,)),
        (BlockRemoved, (2,)),
        (BlockStored, (1,)),
    ]
    index = BlockIndex()
    for event in events:
        assert index.apply(event) is None
    assert index.holders(BlockKey(1)) == (Holder(SOURCE, Tier.DRAM),) and BlockKey(2) not in index


def test_put_chain_evicts_leaves_before_their_prefixes() -> None:
    """With prefix-aware LRU a full cache gives up a chain's tail before its head (as put does)."""
    cache = metadata_cache(dram_pages=4, ssd_pages=0, policy=LruPolicy, prefix_aware=True)
    cache.put_chain([BlockKey(k) for k in (1, 2, 3, 4)])
    cache.put_chain([BlockKey(k) for k in (10, 11)])
    assert cache.prefix_match([BlockKey(k) for k in (1, 2, 3, 4)]) == 2
    assert cache.prefix_match([BlockKey(10), BlockKey(11)]) == 2
    cache.check_invariants()


def test_put_chain_needs_a_metadata_first_tier(tmp_path: Path) -> None:
    """A byte-holding first tier raises ConfigError and stores nothing; a length over a page, CapacityError."""
    cache = make_cache(tmp_path)
    with pytest.raises(ConfigError, match="metadata"):
        cache.put_chain([BlockKey(1), BlockKey(2)])
    assert len(cache) == 0 and cache.take_events() == []
    cache.close()
    metadata = metadata_cache(dram_pages=2, ssd_pages=0, policy=LruPolicy, prefix_aware=True)
    with pytest.raises(CapacityError, match=str(PAGE + 1)):
        metadata.put_chain([BlockKey(1)], length=PAGE + 1)
    assert len(metadata) == 0


@pytest.mark.parametrize("bad", ["64", 1.5, True, -1, math.nan])
def test_put_chain_checks_length_as_put_does(bad: object) -> None:
    """A length that is no integer >= 0 (a str, a float, a bool, a negative) is the InvalidRequestError put
    raises, word for word, from put_chain too (it used to be a bare TypeError, or stored blocks of 1.5 or True
    bytes); nothing is stored, and a whole-number length still works."""
    errors = []
    for store in (lambda c: c.put(BlockKey(1), length=bad), lambda c: c.put_chain([BlockKey(1)], length=bad)):
        metadata = metadata_cache(dram_pages=2, ssd_pages=0, policy=LruPolicy, prefix_aware=True)
        with pytest.raises(InvalidRequestError, match="length must be an integer >= 0") as raised:
            store(metadata)
        errors.append(str(raised.value))
        assert len(metadata) == 0 and metadata.take_events() == []
        metadata.put_chain([BlockKey(1)], length=64)
        assert metadata.location(BlockKey(1)) == BlockLocation(Tier.DRAM, 0, 64, True)
    assert errors[0] == errors[1]


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda cache: cache.put(BlockKey(1), b"x", position="x"), "position"),
        (lambda cache: cache.put(BlockKey(1), b"x", position=-1), "position"),
        (lambda cache: cache.reserve(BlockKey(1), 4, position=1.5), "position"),
        (lambda cache: cache.reserve(BlockKey(1), 1.5), "length"),
        (lambda cache: cache.put(BlockKey(1), b"x", checksum="abc"), "checksum"),
        (lambda cache: cache.put(BlockKey(1), b"x", checksum=math.nan), "checksum"),
        (lambda cache: cache.put(BlockKey(1), b"x", checksum=1 << 64), "checksum"),
        (lambda cache: cache.put(True, b"x"), "block key"),
        (lambda cache: cache.put(BlockKey(1), "text"), "page data must be bytes-like"),
    ],
)
def test_bad_arguments_are_refused_by_name_before_a_page_is_claimed(
    tmp_path: Path, call: Callable[[TieredCache], object], named: str
) -> None:
    """A bad position (refused by a length-aware policy only after the page was claimed, which left a
    block cached that no policy could evict), length or checksum is an InvalidRequestError naming it;
    nothing is stored, no event is sent, the invariants hold."""
    cache = make_cache(tmp_path, policy=LengthAwarePolicy)
    with pytest.raises(InvalidRequestError, match=named):
        call(cache)
    assert len(cache) == 0 and cache.take_events() == []
    cache.check_invariants()
    metadata = TieredCache([MetadataPagePool(Tier.DRAM, 64, 4)], source=InstanceId("p"))
    with pytest.raises(InvalidRequestError, match="length"):
        metadata.put(BlockKey(1), length=1.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="tier must be one of"):
        metadata.used_bytes("RAM")  # type: ignore[arg-type]
    assert metadata.used_bytes("DRAM") == 0  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["abc", -1, 2.5, None])
def test_invalid_keys_are_refused_before_anything_is_stored(tmp_path: Path, bad: object) -> None:
    """A key that is not a non-negative integer is an InvalidRequestError naming it, from put, reserve
    and put_chain alike; the cache is unchanged and keeps working."""
    cache = make_cache(tmp_path)
    with pytest.raises(InvalidRequestError, match="block key"):
        cache.put(bad, b"x")  # type: ignore[arg-type]
    if bad is not None:  # no parent is a valid parent
        with pytest.raises(InvalidRequestError, match="block key"):
            cache.put(BlockKey(1), b"x", parent=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="block key"):
        cache.reserve(bad, 4)  # type: ignore[arg-type]
    assert cache.take_events() == [] and cache.get(BlockKey(1)) is None
    metadata = TieredCache([MetadataPagePool(Tier.DRAM, 64, 4)], source=InstanceId("p"))
    with pytest.raises(InvalidRequestError, match="block key"):
        metadata.put_chain([BlockKey(1), bad, BlockKey(3)])  # type: ignore[list-item]
    assert metadata.prefix_match([BlockKey(1)]) == 0 and metadata.take_events() == []
    cache.put(BlockKey(7), b"fine")
    assert bytes(cache.get(BlockKey(7))) == b"fine"  # type: ignore[arg-type]


@pytest.mark.parametrize(("kind", "prefix_aware"), ALL_POLICIES)
@pytest.mark.parametrize("ssd_pages", [0, 2])
def test_a_chain_longer_than_the_first_tier_keeps_its_head(kind: str, prefix_aware: bool, ssd_pages: int) -> None:
    """A prompt of 8 blocks into 4 unpinned first-tier pages, under every policy (those that rank blocks alone
    too), with or without a tier below: its first 4 blocks stay cached and a repeat of it matches them, where
    storing on evicted the head (leaf first, or oldest first under a plain policy, which kept blocks 4..7 and
    matched none) and kept a tail that nothing matches. A later chain still takes the room."""
    cache = metadata_cache(dram_pages=4, ssd_pages=ssd_pages, policy=POLICIES[kind], prefix_aware=prefix_aware)
    first = [BlockKey(k) for k in range(8)]
    cache.put_chain(first, length=10)
    assert cache.prefix_match(first) == 4 and [cache.location(k) is not None for k in first] == [True] * 4 + [False] * 4
    assert [(type(e).__name__, e.keys) for e in cache.take_events()] == [("BlockStored", (0, 1, 2, 3))]
    second = [BlockKey(k) for k in range(100, 103)]
    cache.put_chain(second, length=10)
    assert cache.prefix_match(second) == 3
    cache.check_invariants()


@settings(max_examples=150)
@given(
    st.sampled_from(sorted(POLICIES)),
    st.booleans(),
    st.integers(min_value=1, max_value=5),
    st.sampled_from([0, 1, 3]),
    st.lists(st.tuples(st.lists(st.integers(100, 115).map(BlockKey), max_size=6), st.booleans()), max_size=6),
    st.lists(st.integers(0, 9).map(BlockKey) | st.integers(100, 115).map(BlockKey), unique=True, max_size=12),
)
def test_what_put_chain_stores_lies_in_the_chains_cached_prefix(
    kind: str,
    prefix_aware: bool,
    dram_pages: int,
    ssd_pages: int,
    before: list[tuple[list[BlockKey], bool]],
    chain: list[BlockKey],
) -> None:
    """Whatever the policy (prefix-aware or ranking blocks alone), the tiers and the blocks cached or pinned before:
    every block `put_chain` stores lies in the chain's cached prefix (`prefix_match`), and of a chain of blocks not
    cached before, what is cached afterwards is a prefix of it. (A plain LRU or SIEVE used to evict the chain's
    head to make room for its tail, and kept blocks that no prompt can match.)"""
    cache = metadata_cache(dram_pages=dram_pages, ssd_pages=ssd_pages, policy=POLICIES[kind], prefix_aware=prefix_aware)
    for keys, pin_last in before:
        if outcome(cache.put_chain, keys) == "ok" and pin_last and keys and keys[-1] in cache:
            cache.pin(keys[-1])
    was_cached = {key for key in chain if key in cache}
    cache.take_events()
    if outcome(cache.put_chain, chain) != "ok":  # the first block found every first-tier page pinned
        assert not cache.take_events() and all(key in cache for key in was_cached)
        return
    matched = cache.prefix_match(chain)
    events = cache.take_events()  # the first tier's stores are the chain's (a lower tier's, demotions)
    stored = {
        key for event in events if isinstance(event, BlockStored) and event.tier is Tier.DRAM for key in event.keys
    }
    assert stored <= set(chain[:matched])
    if not was_cached:
        assert [key in cache for key in chain] == [True] * matched + [False] * (len(chain) - matched)
    cache.check_invariants()


@settings(max_examples=40, deadline=None)
@given(
    count=st.integers(1, 12),
    pinned=st.sets(st.integers(0, 11), max_size=12),
    touched=st.lists(st.integers(0, 11), max_size=12),
    evict=st.integers(0, 16),
)
def test_evict_takes_the_least_recently_used_unpinned_blocks(
    count: int, pinned: set[int], touched: list[int], evict: int
) -> None:
    """`evict(n)` drops (one tier: no lower one to take them) the n least recently used unpinned blocks, or all of
    them where fewer are unpinned; pinned blocks stay, and the count evicted is returned."""
    cache = TieredCache([MetadataPagePool(Tier.VRAM, 64, 16)], policy=LruPolicy)
    order = list(range(count))
    for key in order:
        cache.put(BlockKey(key), None, length=64)
    for key in touched:
        if key < count:
            cache.put(BlockKey(key), None, length=64)  # a use
            order.remove(key)
            order.append(key)
    held = {key for key in pinned if key < count}
    for key in held:
        cache.pin(BlockKey(key))
    unpinned = [key for key in order if key not in held]
    assert cache.evict(evict) == min(evict, len(unpinned))
    gone = set(unpinned[:evict])
    assert {key for key in range(count) if cache.location(BlockKey(key)) is None} == gone


def test_evict_refuses_a_count_that_is_not_a_non_negative_integer() -> None:
    cache = TieredCache([MetadataPagePool(Tier.VRAM, 64, 4)], policy=LruPolicy)
    for bad in (-1, 1.5, "2", None):
        with pytest.raises(InvalidRequestError, match="num_blocks"):
            cache.evict(bad)  # type: ignore[arg-type]


def test_announce_all_starts_an_epoch_holding_what_the_cache_holds(tmp_path: Path) -> None:
    """The index that forgot the source (a dispatcher marked it down, then up) gets every block back by tier, after
    the new epoch's clear, the changes not yet taken folded in; a stale or equal epoch is refused by name."""
    cache = TieredCache([DramPagePool(PAGE, 2), SsdPagePool(tmp_path / "ssd.pool", PAGE, 4)], source=SOURCE, epoch=5)
    index = BlockIndex()
    for key in (1, 2, 3):
        cache.put(BlockKey(key), block(key))
    for event in cache.take_events():
        assert index.apply(event) is None
    index.remove_instance(SOURCE)
    cache.put(BlockKey(4), block(4))  # not taken yet: folded into the announcement
    cache.announce_all(6)
    events = cache.take_events()
    assert [(e.seq, e.epoch, type(e)) for e in events] == [
        (0, 6, AllBlocksCleared),
        (1, 6, BlockStored),
        (2, 6, BlockStored),
    ]
    for event in events:
        assert index.apply(event) is None
    for key in (1, 2, 3, 4):
        assert index.holders(BlockKey(key)) == (Holder(SOURCE, cache.tier_of(BlockKey(key))),)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="epoch"):
        cache.announce_all(6)
    cache.close()
