"""Edge contracts of the tiered cache, its placement and its pools that the main tests leave open.

Each test here kills a mutant of `tiered`, `_placement`, `ssd` or `pool` that the main tests let live.

- Corruption: a damaged SSD block is a miss to every call at once (`get`, `touch`, `pinned`,
  `prefix_match`, `location`, `pin`), also while a reader still pins it, and also when found on
  the way up or read in place under a pinned first tier; a model-based property damages SSD pages
  of a full cache at random between reads and checks that no wrong byte is ever served, each read
  is one hit or one miss, and a read loses nothing but the damaged block it read.
- Reservations: a second reservation of a key being filled, a failed commit, an abort or unpin of
  the wrong thing; none of them leaks or loses a page. `len` counts blocks, `used_bytes` pages.
- Moves: every read refreshes recency in the block's tier; promotion counts reads since the block
  last moved; a pinned block is read in place; a failed write in a demotion or a promotion's
  cascade leaves the blocks where they were; an SSD first tier cannot be reserved in place.
- Pools: the same key recovered in two tiers keeps the faster copy and frees the other page; a
  header claiming more than a page is never adopted; a short SSD write fails the put and leaves
  nothing behind; buffer and length checks at their exact bounds; wide-item buffers are bytes.

- Construction and the review's findings: tiers that do not all hold bytes are refused; a `put` of a key being
  filled is refused (it stored nothing and answered a tier); `checksum` answers an SSD block's stored digest
  and, where it must read bytes that fail, drops the block as `get` does and raises UnknownBlockError.

- Keys and arguments at the boundary: every call taking a key refuses a non-key (1.0, True, a list, a
  negative int, 2**256) by name, `in` answers False for one; numpy keys (a `KeyBatch`'s) work everywhere and
  act as the ints they equal (a property runs the same calls with both); bad pools, policies and key
  iterables are the library's errors.

A numpy integer key is a key in every tier (it broke the SSD tier's page headers). A block put again after
it failed verification, while a reader still pins the damaged copy or reads it, is stored; the damaged
copy's page is held until its last pin, and a pin never unprotects the new copy.
"""

from __future__ import annotations

import array
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mooncake.cache.events import BlockRemoved, BlockStored
from mooncake.cache.hashing import BlockHasher
from mooncake.cache.index import BlockIndex, Holder
from mooncake.cache.policy import LruPolicy
from mooncake.cache.pool import DramPagePool, MetadataPagePool
from mooncake.cache.ssd import HEADER_BYTES, SsdPagePool
from mooncake.cache.tiered import TieredCache
from mooncake.errors import BlockPinnedError, ConfigError, IntegrityError, InvalidRequestError, UnknownBlockError
from mooncake.types import BlockKey, InstanceId, Tier
from tests.cache.damage import flip_byte
from tests.cache.test_tiered_faults import FailingPool

PAGE = 64
SOURCE = InstanceId("node-e")


def block(key: int) -> bytes:
    """Block `key`'s bytes: a function of the key alone (content-addressed), 1 to PAGE bytes long."""
    seed = xxhash.xxh3_64_digest(key.to_bytes(8, "little"))
    return (seed * 8)[: 1 + key % PAGE]


def make_cache(folder: Path, *, dram_pages: int = 2, ssd_pages: int = 4, **options: Any) -> TieredCache:
    pools: list[Any] = [DramPagePool(PAGE, dram_pages), SsdPagePool(folder / "ssd.pool", PAGE, ssd_pages)]
    return TieredCache(pools, source=SOURCE, **options)


def damage(cache: TieredCache, key: BlockKey, at: int = 0) -> None:
    """Flip one data byte of `key`'s SSD page in the pool file (as a bad sector would)."""
    location = cache.location(key)
    assert location is not None and location.tier == Tier.SSD
    pool = cache.pools[[p.tier for p in cache.pools].index(Tier.SSD)]
    assert isinstance(pool, SsdPagePool)
    flip_byte(Path(pool.path), HEADER_BYTES + location.page * pool.slot_bytes + HEADER_BYTES + at % location.length)


def on_ssd_with_room_above(folder: Path, **options: Any) -> TieredCache:
    """Blocks 1 and 2 on SSD, 3 and 4 in DRAM (two pages each)."""
    cache = make_cache(folder, **options)
    for key in (1, 2, 3, 4):
        cache.put(BlockKey(key), block(key))
    assert [cache.tier_of(BlockKey(k)) for k in (1, 2, 3, 4)] == [Tier.SSD, Tier.SSD, Tier.DRAM, Tier.DRAM]
    return cache


# --------------------------------------------------------------------------- corruption


def test_a_corrupt_block_held_by_a_reader_is_a_miss_to_everyone_else(tmp_path: Path) -> None:
    """While a pinned reader keeps a block that failed verification, every other call sees a miss: not in the
    cache, no tier, no location, prefix_match stops at it, touch misses, pin refuses; it goes at the unpin."""
    cache = on_ssd_with_room_above(tmp_path, promote_after=0)
    key = BlockKey(1)
    damage(cache, key)
    with cache.pinned(key) as view:
        assert view is None
        assert key not in cache and cache.tier_of(key) is None and cache.location(key) is None
        assert cache.prefix_match([key, BlockKey(2)]) == 0
        assert cache.touch(key) is None
        assert cache.get(key) is None
        with pytest.raises(UnknownBlockError, match="failed verification"):
            cache.pin(key)
        cache.check_invariants()
    assert cache.location(key) is None and cache.stats.corrupt_blocks == 1
    assert bytes(cache.get(BlockKey(2))) == block(2)  # type: ignore[arg-type]
    cache.check_invariants()
    cache.close()


def test_touch_of_a_block_that_fails_verification_as_it_promotes_is_a_miss(tmp_path: Path) -> None:
    """`touch` promotes as `get` does; a block whose bytes fail on the way up is gone, and touch says None."""
    cache = on_ssd_with_room_above(tmp_path, promote_after=1)
    cache.remove(BlockKey(3))  # a free DRAM page: the promotion moves the block
    damage(cache, BlockKey(1), at=3)
    assert cache.touch(BlockKey(1)) is None
    assert BlockKey(1) not in cache and cache.stats.corrupt_blocks == 1
    cache.check_invariants()
    cache.close()


def test_a_block_served_in_place_under_a_pinned_first_tier_stays_evictable(tmp_path: Path) -> None:
    """With every DRAM page pinned a due promotion reads the SSD block in place; it stays in its tier's
    policy, so the SSD tier can still evict it to make room (no page is stranded)."""
    cache = on_ssd_with_room_above(tmp_path, ssd_pages=2, promote_after=1)
    cache.pin(BlockKey(3))
    cache.pin(BlockKey(4))
    assert bytes(cache.get(BlockKey(1))) == block(1)  # type: ignore[arg-type]
    assert cache.tier_of(BlockKey(1)) == Tier.SSD
    cache.check_invariants()
    cache.unpin(BlockKey(3))
    cache.unpin(BlockKey(4))
    for key in (5, 6, 7, 8):  # two full rounds through DRAM push both SSD blocks out
        cache.put(BlockKey(key), block(key))
    assert BlockKey(1) not in cache and BlockKey(2) not in cache
    cache.check_invariants()
    cache.close()


ops = st.lists(
    st.tuples(st.sampled_from(["put", "get", "touch", "pinned", "damage", "damage", "remove"]), st.integers(1, 8)),
    max_size=30,
)


@settings(deadline=None)
@given(ops=ops, promote_after=st.sampled_from([0, 1, 2]))
def test_damaged_ssd_pages_are_never_served_and_cost_only_themselves(
    ops: list[tuple[str, int]], promote_after: int
) -> None:
    """A full cache against the bytes each key stands for and the set of keys whose SSD page was damaged: every
    read (get, touch, pinned) returns the exact bytes or a miss; a held, undamaged block is never a miss; a damaged block is
    dropped on its first read that touches its bytes and counted once; each read is one hit or one miss; a
    read loses nothing but a damaged block; the events mirror the cache throughout."""
    folder = Path(tempfile.mkdtemp(prefix="tiered-edges-"))
    cache = make_cache(folder, dram_pages=2, ssd_pages=3, promote_after=promote_after)
    index = BlockIndex()
    damaged: set[BlockKey] = set()
    corrupt_seen = reads = misses = 0
    try:
        for key in range(1, 6):  # every page holds a block: the cache's normal state
            cache.put(BlockKey(key), block(key))
        for event in cache.take_events():
            assert index.apply(event) is None
        for name, raw in ops:
            key = BlockKey(raw)
            held_before = {BlockKey(k) for k in range(1, 10) if BlockKey(k) in cache}
            meant_to_drop: set[BlockKey] = set()
            if name == "put":
                cache.put(key, block(key))  # a new block is written whole; a cached one is only used
            elif name == "damage":  # the raw number picks one of the blocks on SSD
                on_ssd = sorted(k for k in held_before - damaged if cache.tier_of(k) == Tier.SSD)  # flipped once
                if on_ssd:
                    damage(cache, on_ssd[raw % len(on_ssd)], at=raw)
                    damaged.add(on_ssd[raw % len(on_ssd)])
            elif name == "remove":
                if key in cache:
                    cache.remove(key)
                    meant_to_drop = {key}
            else:
                if name == "get":
                    data = cache.get(key)
                    served = data is not None
                elif name == "pinned":
                    with cache.pinned(key) as data:
                        served = data is not None
                        if served:
                            assert bytes(data) == block(key)  # type: ignore[arg-type]
                else:
                    served = cache.touch(key) is not None
                reads, misses = reads + 1, misses + (not served)
                if served and name != "touch":
                    assert bytes(data) == block(key), f"block {key}: wrong bytes"  # type: ignore[arg-type]
                if key in damaged and not (name == "touch" and served):  # touch reads bytes only to promote
                    assert not served, f"damaged block {key} was served"
                    corrupt_seen += 1
                    meant_to_drop = {key}
                else:
                    assert served == (key in held_before), f"block {key}: held {key in held_before}, served {served}"
                assert key in cache if served else key not in cache
            damaged &= {BlockKey(k) for k in range(1, 10) if BlockKey(k) in cache}
            stats = cache.stats
            assert (stats.corrupt_blocks, stats.hits + stats.misses, stats.misses) == (corrupt_seen, reads, misses)
            lost = held_before - {BlockKey(k) for k in range(1, 10) if BlockKey(k) in cache}
            if name != "put":  # only a put makes room; a read loses only the damaged block it read
                assert lost == meant_to_drop, f"{name} {key} lost {sorted(lost)}"
            cache.check_invariants()
            for event in cache.take_events():
                assert index.apply(event) is None
            for k in range(1, 10):
                tier = cache.tier_of(BlockKey(k))
                assert index.holders(BlockKey(k)) == (() if tier is None else (Holder(SOURCE, tier),))
    finally:
        cache.close()
        shutil.rmtree(folder, ignore_errors=True)


# --------------------------------------------------------------------------- reservations


def test_a_key_being_filled_cannot_be_reserved_twice(tmp_path: Path) -> None:
    """A second `reserve` of a key whose reservation is still open returns None and claims no page; the
    first reservation still commits, and an abort after it changes nothing."""
    cache = make_cache(tmp_path)
    view = cache.reserve(BlockKey(1), 8)
    assert view is not None
    assert cache.reserve(BlockKey(1), 8) is None
    assert cache.pools[0].num_free == cache.pools[0].num_pages - 1
    cache.check_invariants()
    assert isinstance(view, memoryview)  # a DRAM page
    view[:] = block(9)[:8]
    cache.commit(BlockKey(1))
    cache.abort(BlockKey(1))  # not reserved any more: no effect
    assert bytes(cache.get(BlockKey(1))) == block(9)[:8]  # type: ignore[arg-type]
    cache.check_invariants()
    cache.close()


def test_a_commit_that_fails_its_checksum_gives_the_page_back(tmp_path: Path) -> None:
    """A reservation whose bytes fail `commit(checksum=...)` is gone: its page is free, nothing is announced,
    and the same key can be reserved and committed again."""
    cache = make_cache(tmp_path)
    data = block(7)
    view = cache.reserve(BlockKey(7), len(data))
    assert view is not None
    assert isinstance(view, memoryview)  # a DRAM page
    view[:] = bytes(len(data))
    with pytest.raises(IntegrityError):
        cache.commit(BlockKey(7), checksum=xxhash.xxh3_64_intdigest(data))
    assert cache.pools[0].num_free == cache.pools[0].num_pages and cache.location(BlockKey(7)) is None
    assert cache.take_events() == []
    cache.check_invariants()
    again = cache.reserve(BlockKey(7), len(data))
    assert again is not None
    assert isinstance(again, memoryview)  # a DRAM page
    again[:] = data
    cache.commit(BlockKey(7), checksum=xxhash.xxh3_64_intdigest(data))
    assert bytes(cache.get(BlockKey(7))) == data  # type: ignore[arg-type]
    cache.close()


def test_abort_of_a_cached_block_changes_nothing(tmp_path: Path) -> None:
    """`abort` touches only reservations: a cached block stays, with its bytes, page and policy entry."""
    cache = make_cache(tmp_path)
    cache.put(BlockKey(3), block(3))
    where = cache.location(BlockKey(3))
    cache.abort(BlockKey(3))
    assert cache.location(BlockKey(3)) == where and bytes(cache.get(BlockKey(3))) == block(3)  # type: ignore[arg-type]
    cache.check_invariants()
    cache.close()


# --------------------------------------------------------------------------- promotion and recovery


def test_promotion_counts_only_the_reads_since_the_block_last_moved(tmp_path: Path) -> None:
    """With promote_after=2, a block that was promoted and then demoted again needs two fresh reads on SSD
    to climb back: the reads that promoted it before do not count."""
    cache = make_cache(tmp_path, dram_pages=1, ssd_pages=3, promote_after=2)
    cache.put(BlockKey(1), block(1))
    cache.put(BlockKey(2), block(2))  # 1 goes down
    for _ in range(2):
        cache.get(BlockKey(1))
    assert (cache.tier_of(BlockKey(1)), cache.tier_of(BlockKey(2))) == (Tier.DRAM, Tier.SSD)
    for _ in range(2):
        cache.get(BlockKey(2))  # 2 climbs back, 1 goes down
    assert (cache.tier_of(BlockKey(1)), cache.tier_of(BlockKey(2))) == (Tier.SSD, Tier.DRAM)
    assert bytes(cache.get(BlockKey(1))) == block(1)  # type: ignore[arg-type]
    assert cache.tier_of(BlockKey(1)) == Tier.SSD, "promoted on its first read since it came down"
    cache.get(BlockKey(1))
    assert cache.tier_of(BlockKey(1)) == Tier.DRAM
    cache.close()


def test_a_key_recovered_in_two_tiers_keeps_the_faster_copy_and_frees_the_other(tmp_path: Path) -> None:
    """Two persistent tiers both hold block 5 after a crash: the faster copy is adopted, the slower page is
    given back (no page leaks), each tier announces what it kept, and both keep serving."""
    fast, slow = tmp_path / "fast.pool", tmp_path / "slow.pool"
    for path, keys in ((fast, (5,)), (slow, (5, 6))):
        with SsdPagePool(path, PAGE, 3) as pool:
            for key in keys:
                page = pool.try_allocate()
                assert page is not None
                pool.write(page, block(key), key=BlockKey(key))
    pools = [SsdPagePool(fast, PAGE, 3, tier=Tier.DRAM), SsdPagePool(slow, PAGE, 3)]
    cache = TieredCache(pools, source=SOURCE, promote_after=0)
    try:
        assert (cache.tier_of(BlockKey(5)), cache.tier_of(BlockKey(6))) == (Tier.DRAM, Tier.SSD)
        assert pools[1].num_free == 2
        cache.check_invariants()
        events = cache.take_events()
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert len(stored) == len(events) and [(e.tier, e.keys) for e in stored] == [
            (Tier.DRAM, (5,)),
            (Tier.SSD, (6,)),
        ]
        for key in (7, 8, 9, 10):  # fill both tiers: every page is usable
            cache.put(BlockKey(key), block(key))
        cache.check_invariants()
        assert len(cache) == 6
    finally:
        cache.close()


def test_a_page_header_claiming_more_than_a_page_is_never_adopted(tmp_path: Path) -> None:
    """A slot whose header is self-consistent (magic, checksum) but claims more bytes than a page holds, as a
    stray write of another geometry's pool could leave, is not recovered: a read would run into the next slot."""
    path = tmp_path / "ssd.pool"
    with SsdPagePool(path, PAGE, 3) as pool:
        page = pool.try_allocate()
        assert page is not None
        pool.write(page, block(1), key=BlockKey(1))
        spill = bytes(2 * PAGE)
        header = pool._pack_header(2 * PAGE, xxhash.xxh3_64_intdigest(spill), 99, 2)  # the pool's own format
        os.pwrite(pool._fd, header, pool._slot(1))
    cache = make_cache(tmp_path, ssd_pages=3)
    try:
        assert BlockKey(2) not in cache and [found.key for found in cache.pools[1].recovered] == [1]  # type: ignore[attr-defined]
        cache.check_invariants()
        assert bytes(cache.get(BlockKey(1))) == block(1)  # type: ignore[arg-type]
    finally:
        cache.close()


# --------------------------------------------------------------------------- pins


def test_a_pinned_lower_tier_block_is_read_in_place_and_promotes_after_its_unpin(tmp_path: Path) -> None:
    """A pinned block on SSD whose promotion is due is served where it is (it never moves while pinned, and
    the read does not fail); once unpinned, its next read promotes it."""
    cache = make_cache(tmp_path, dram_pages=1, ssd_pages=3, promote_after=1)
    cache.put(BlockKey(1), block(1))
    cache.put(BlockKey(2), block(2))  # 1 goes down
    cache.pin(BlockKey(1))
    for _ in range(3):
        assert bytes(cache.get(BlockKey(1))) == block(1)  # type: ignore[arg-type]
        assert cache.tier_of(BlockKey(1)) == Tier.SSD
    assert cache.touch(BlockKey(1)) == Tier.SSD and cache.stats.promotions == 0
    cache.check_invariants()
    cache.unpin(BlockKey(1))
    assert bytes(cache.get(BlockKey(1))) == block(1)  # type: ignore[arg-type]
    assert cache.tier_of(BlockKey(1)) == Tier.DRAM and cache.stats.promotions == 1
    cache.check_invariants()
    cache.close()


def test_unpin_of_a_block_not_cached_or_still_being_filled_is_an_unknown_block(tmp_path: Path) -> None:
    """`unpin` of a key never cached, or of one whose reservation is still open, raises UnknownBlockError and
    leaves the reservation intact: it still commits and serves."""
    cache = make_cache(tmp_path)
    with pytest.raises(UnknownBlockError):
        cache.unpin(BlockKey(4))
    view = cache.reserve(BlockKey(5), 3)
    assert view is not None
    with pytest.raises(UnknownBlockError):
        cache.unpin(BlockKey(5))
    assert isinstance(view, memoryview)  # a DRAM page
    view[:] = b"abc"
    cache.commit(BlockKey(5))
    assert bytes(cache.get(BlockKey(5))) == b"abc"  # type: ignore[arg-type]
    cache.check_invariants()
    cache.close()


# --------------------------------------------------------------------------- pools under the cache


def test_a_short_ssd_write_fails_the_put_and_leaves_nothing_half_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write to the SSD tier that the kernel only partly performs (a full disk, an I/O error midway) raises
    OSError from `put`; the block is not cached, its page is free, and a reopened pool recovers nothing."""
    path = tmp_path / "ssd.pool"
    cache = TieredCache([SsdPagePool(path, PAGE, 2)], source=SOURCE)
    real = os.pwritev

    def torn(fd: int, buffers: list[Any], offset: int) -> int:
        header, data = buffers
        return real(fd, [header, memoryview(data)[: len(data) // 2]], offset)

    monkeypatch.setattr(os, "pwritev", torn)
    with pytest.raises(OSError, match="short write"):
        cache.put(BlockKey(9), block(9))
    monkeypatch.setattr(os, "pwritev", real)
    assert BlockKey(9) not in cache and cache.take_events() == [] and cache.stats.puts == 0
    assert cache.pools[0].num_free == 2
    cache.check_invariants()
    cache.close()
    with SsdPagePool(path, PAGE, 2) as pool:
        assert pool.recovered == ()


def test_read_into_takes_a_buffer_of_exactly_the_length_and_refuses_one_byte_less(tmp_path: Path) -> None:
    """`read_into` needs room for `length` bytes: exactly that many is enough, one fewer is refused by name."""
    with SsdPagePool(tmp_path / "ssd.pool", PAGE, 1) as pool:
        page = pool.try_allocate()
        assert page is not None
        pool.write(page, block(40), key=BlockKey(40))
        exact = bytearray(len(block(40)))
        assert pool.read_into(page, len(exact), exact) == xxhash.xxh3_64_intdigest(block(40))
        assert bytes(exact) == block(40)
        with pytest.raises(InvalidRequestError, match=f"cannot take {len(exact)}"):
            pool.read_into(page, len(exact), bytearray(len(exact) - 1))


@pytest.mark.parametrize("size", [4 * PAGE - 1, 4 * PAGE + 1])
def test_a_dram_pool_refuses_a_supplied_buffer_of_another_size(size: int) -> None:
    """A buffer handed to a DRAM pool (a transfer engine's region) must hold exactly its pages: one byte more
    or less is a ConfigError naming the size wanted."""
    with pytest.raises(ConfigError, match=str(4 * PAGE)):
        DramPagePool(PAGE, 4, buffer=np.zeros(size, dtype=np.uint8))


def test_a_demotion_whose_write_fails_leaves_the_victim_where_it_was() -> None:
    """A put into a full first tier demotes its victim; where the lower tier's write fails, the error reaches
    the caller, the new block is not stored, the victim is still cached and evictable in the first tier, and
    the lower tier's page is free again."""
    lower = FailingPool(PAGE, 2)
    cache = TieredCache([DramPagePool(PAGE, 1, tier=Tier.VRAM), lower], source=SOURCE)
    cache.put(BlockKey(1), block(1))
    lower.failing = True
    with pytest.raises(OSError, match="injected"):
        cache.put(BlockKey(2), block(2))
    lower.failing = False
    assert cache.tier_of(BlockKey(1)) == Tier.VRAM and BlockKey(2) not in cache
    assert lower.num_free == 2
    cache.check_invariants()
    cache.put(BlockKey(2), block(2))  # the victim can still be demoted
    assert (cache.tier_of(BlockKey(1)), cache.tier_of(BlockKey(2))) == (Tier.DRAM, Tier.VRAM)
    cache.close()


def test_a_promotion_whose_cascade_fails_above_its_tier_leaves_the_block_in_place() -> None:
    """Three tiers: promoting a third-tier block demotes the first tier's victim into the second tier, whose
    write fails before the cascade reaches the promoted block's tier. The reader gets the error; the block is
    still cached where it was (and evictable there), and nothing is lost."""
    middle = FailingPool(PAGE, 1)
    pools = [DramPagePool(PAGE, 1, tier=Tier.VRAM), middle, DramPagePool(PAGE, 2, tier=Tier.SSD)]
    cache = TieredCache(pools, source=SOURCE, promote_after=1)
    for key in (1, 2, 3):
        cache.put(BlockKey(key), block(key))
    assert [cache.tier_of(BlockKey(k)) for k in (1, 2, 3)] == [Tier.SSD, Tier.DRAM, Tier.VRAM]
    middle.failing = True
    with pytest.raises(OSError, match="injected"):
        cache.get(BlockKey(1))
    middle.failing = False
    assert cache.tier_of(BlockKey(1)) == Tier.SSD and len(cache) == 3
    cache.check_invariants()
    for key in (1, 2, 3):
        assert bytes(cache.get(BlockKey(key))) == block(key)  # type: ignore[arg-type]
    cache.check_invariants()
    cache.close()


@pytest.mark.parametrize("numpy_key", [np.int64(5), np.uint64(5)])
def test_a_numpy_integer_key_is_a_key_in_every_tier(tmp_path: Path, numpy_key: Any) -> None:
    """A key is any non-negative integer, numpy's included (as `put` documents by accepting them): such a block
    is demoted to SSD like any other, later puts are unaffected, and it is served by its plain-int key."""
    cache = make_cache(tmp_path, dram_pages=1, ssd_pages=3)
    try:
        cache.put(numpy_key, block(5))
        for key in (6, 7):
            cache.put(BlockKey(key), block(key))
        assert cache.tier_of(BlockKey(5)) == Tier.SSD
        assert bytes(cache.get(BlockKey(5))) == block(5)  # type: ignore[arg-type]
        cache.check_invariants()
    finally:
        cache.close()


def test_a_block_put_again_after_it_failed_verification_is_stored(tmp_path: Path) -> None:
    """A reader's miss on a damaged block leads the engine to recompute it and put it again, possibly while that
    reader still holds its pin: the new bytes are stored (the damaged block is not cached, so this put is no mere
    use) and served after the reader lets go; the damaged copy's page is held until then, and freed at its pin."""
    cache = on_ssd_with_room_above(tmp_path, promote_after=0)
    ssd = cache.pools[1]
    damage(cache, BlockKey(1))
    with cache.pinned(BlockKey(1)) as view:
        assert view is None
        cache.put(BlockKey(1), block(1))
        assert BlockKey(1) in cache and cache.tier_of(BlockKey(1)) == Tier.DRAM
        held = ssd.num_free  # blocks 2 and 3 (DRAM's victim), and the damaged copy's page, held by the pin
        assert held == 1
        cache.check_invariants()
    assert ssd.num_free == held + 1
    assert bytes(cache.get(BlockKey(1))) == block(1)  # type: ignore[arg-type]
    assert cache.stats.corrupt_blocks == 1
    cache.check_invariants()
    cache.close()


def test_a_pin_on_a_replaced_damaged_copy_never_unprotects_the_new_one(tmp_path: Path) -> None:
    """Two holders, one of the damaged copy and one of its replacement: after one unpin (whoever's: a pin names
    only its key) the replacement is still pinned, never evicted, until both have let go."""
    cache = on_ssd_with_room_above(tmp_path, promote_after=0)
    damage(cache, BlockKey(1))
    cache.pin(BlockKey(1))  # the old holder
    assert cache.get(BlockKey(1)) is None
    cache.put(BlockKey(1), block(1))
    cache.pin(BlockKey(1))  # the new holder
    cache.unpin(BlockKey(1))  # one of them lets go
    for key in (5, 6):  # fill DRAM: the replacement is still pinned, so it stays
        cache.put(BlockKey(key), block(key))
    assert cache.tier_of(BlockKey(1)) == Tier.DRAM
    cache.check_invariants()
    cache.unpin(BlockKey(1))
    with pytest.raises(UnknownBlockError, match="not pinned"):
        cache.unpin(BlockKey(1))
    cache.check_invariants()
    cache.put(BlockKey(7), block(7))  # now it can go down
    assert cache.tier_of(BlockKey(1)) == Tier.SSD and bytes(cache.get(BlockKey(1))) == block(1)  # type: ignore[arg-type]
    cache.check_invariants()
    cache.close()


def test_a_block_put_again_during_the_read_that_finds_it_damaged_is_stored(tmp_path: Path) -> None:
    """Two reads of a damaged block run outside the lock; the first ends (a miss) and the writer stores the
    recomputed block while the second is still under way: that read ends as a miss too, the new copy stays, and
    the damaged page is freed when the read lets go of it (not before: the read still holds it)."""
    cache = on_ssd_with_room_above(tmp_path, promote_after=0)
    ssd = cache.pools[1]
    assert isinstance(ssd, SsdPagePool)
    damage(cache, BlockKey(1))
    seen: list[int] = []
    real_read = ssd.read

    def read_while_put(page: int, length: int, *, key: BlockKey | None = None) -> Any:
        ssd.read = real_read  # type: ignore[method-assign]
        assert cache.get(BlockKey(1)) is None  # the first read, ending before this one
        cache.put(BlockKey(1), block(1))  # the writer, while this read is under way
        seen.append(ssd.num_free)
        return real_read(page, length, key=key)

    ssd.read = read_while_put  # type: ignore[method-assign]
    assert cache.get(BlockKey(1)) is None
    assert seen == [1]  # blocks 2 and 3 (DRAM's victim), and the damaged page while its read ran
    assert ssd.num_free == 2 and cache.tier_of(BlockKey(1)) == Tier.DRAM
    assert bytes(cache.get(BlockKey(1))) == block(1)  # type: ignore[arg-type]
    cache.check_invariants()
    cache.close()


def test_a_corrupt_block_read_in_place_under_a_pinned_first_tier_leaves_no_trace(tmp_path: Path) -> None:
    """A due promotion finds every first-tier page pinned and the block's bytes damaged: it is a miss and is
    gone from its tier's policy too, so later evictions there never pick a block that no longer exists."""
    cache = on_ssd_with_room_above(tmp_path, ssd_pages=2, promote_after=1)
    cache.pin(BlockKey(3))
    cache.pin(BlockKey(4))
    damage(cache, BlockKey(1))
    assert cache.get(BlockKey(1)) is None and BlockKey(1) not in cache
    cache.check_invariants()
    cache.unpin(BlockKey(3))
    cache.unpin(BlockKey(4))
    for key in (5, 6, 7, 8):  # churn the SSD tier through its policy
        cache.put(BlockKey(key), block(key))
    assert cache.stats.corrupt_blocks == 1
    cache.check_invariants()
    cache.close()


def test_reading_fewer_bytes_than_the_page_holds_is_refused_naming_both_lengths(tmp_path: Path) -> None:
    """The header's length is the block's length: a read of fewer bytes is an IntegrityError that says both,
    not a checksum failure (the page is fine, the caller's length is not)."""
    with SsdPagePool(tmp_path / "ssd.pool", PAGE, 1) as pool:
        page = pool.try_allocate()
        assert page is not None
        data = block(PAGE - 1)
        pool.write(page, data, key=BlockKey(1))
        with pytest.raises(IntegrityError, match=f"holds {len(data)} bytes, expected {len(data) - 1}"):
            pool.read(page, len(data) - 1)
        assert bytes(pool.read(page, len(data))) == data


def test_len_counts_cached_blocks_and_used_bytes_counts_pages_in_use(tmp_path: Path) -> None:
    """A reservation holds a page (counted in `used_bytes`) but no block yet (not in `len`); a partly full tier
    reports only its used pages, an empty one none."""
    cache = make_cache(tmp_path, dram_pages=3, ssd_pages=4)
    cache.put(BlockKey(1), block(1))
    assert cache.reserve(BlockKey(2), 5) is not None
    assert len(cache) == 1
    assert (cache.used_bytes(Tier.DRAM), cache.used_bytes(Tier.SSD)) == (2 * PAGE, 0)
    assert (cache.capacity_bytes(Tier.DRAM), cache.capacity_bytes(Tier.SSD)) == (3 * PAGE, 4 * PAGE)
    cache.abort(BlockKey(2))
    assert len(cache) == 1 and cache.used_bytes(Tier.DRAM) == PAGE
    cache.close()


# --------------------------------------------------------------------------- recency and odd buffers


@pytest.mark.parametrize("read", ["get", "touch", "pinned"])
@pytest.mark.parametrize("tier", [Tier.DRAM, Tier.SSD])
def test_a_read_makes_a_block_the_most_recently_used_of_its_tier(tmp_path: Path, read: str, tier: Tier) -> None:
    """Reads refresh recency in the tier the block is in: with LRU and two blocks in a full tier, the block
    just read (by get, touch or pinned) outlives the other when that tier next makes room."""
    cache = make_cache(tmp_path, dram_pages=2, ssd_pages=2, promote_after=0)
    for key in (1, 2, 3, 4):
        cache.put(BlockKey(key), block(key))
    older, newer = (BlockKey(3), BlockKey(4)) if tier == Tier.DRAM else (BlockKey(1), BlockKey(2))
    assert cache.tier_of(older) == cache.tier_of(newer) == tier
    if read == "pinned":
        with cache.pinned(older) as view:
            assert bytes(view) == block(older)  # type: ignore[arg-type]
    else:
        assert getattr(cache, read)(older) is not None
    cache.put(BlockKey(5), block(5))  # DRAM's victim goes down; SSD makes room by dropping its own victim
    if tier == Tier.DRAM:
        assert (cache.tier_of(older), cache.tier_of(newer)) == (Tier.DRAM, Tier.SSD)
    else:
        assert (cache.tier_of(older), cache.tier_of(newer)) == (Tier.SSD, None)
    cache.close()


def test_an_ssd_first_tier_cannot_be_reserved_in_place(tmp_path: Path) -> None:
    """`reserve` hands out a view of the page to fill; an SSD page has none (a read is a copy), so an SSD first
    tier refuses with ConfigError, claims no page, and `put` still works."""
    cache = TieredCache([SsdPagePool(tmp_path / "ssd.pool", PAGE, 2)], source=SOURCE)
    try:
        with pytest.raises(ConfigError, match="in place"):
            cache.reserve(BlockKey(1), 8)
        assert cache.pools[0].num_free == 2 and cache.location(BlockKey(1)) is None
        cache.put(BlockKey(1), block(1))
        assert bytes(cache.get(BlockKey(1))) == block(1)  # type: ignore[arg-type]
    finally:
        cache.close()


def test_a_buffer_of_wider_items_is_stored_as_its_bytes() -> None:
    """Page data is any bytes-like object: an `array('I')` (4-byte items) is written as its raw bytes."""
    items = array.array("I", range(PAGE // 4))
    cache = TieredCache([DramPagePool(PAGE, 1)], source=SOURCE)
    cache.put(BlockKey(1), items)
    assert bytes(cache.get(BlockKey(1))) == items.tobytes()  # type: ignore[arg-type]


# --------------------------------------------------------------------------- mixed tiers, puts while filling, checksums


@pytest.mark.parametrize("byte_tier_first", [True, False])
def test_tiers_that_do_not_all_hold_bytes_are_refused(tmp_path: Path, byte_tier_first: bool) -> None:
    """A byte tier over a metadata-only one (or under it) is a ConfigError naming both kinds of tier: demoting into
    the metadata tier dropped the block's bytes while it stayed cached and announced (`get` then refused it, `touch`
    failed promoting it), and demoting out of one has no bytes to write."""
    pools: list[Any] = [DramPagePool(PAGE, 2), MetadataPagePool(Tier.SSD, PAGE, 8)]
    named = r"\['DRAM'\] hold bytes, \['SSD'\] are metadata-only"
    if not byte_tier_first:
        pools = [MetadataPagePool(Tier.DRAM, PAGE, 2), SsdPagePool(tmp_path / "ssd.pool", PAGE, 8)]
        named = r"\['SSD'\] hold bytes, \['DRAM'\] are metadata-only"
    with pytest.raises(ConfigError, match=named):
        TieredCache(pools, source=SOURCE)
    for pool in pools:
        pool.close()


def test_a_put_of_a_key_being_filled_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    """`put` of a key whose reservation is open (a peer's push filling it) raises BlockPinnedError saying it is
    being filled, where it used to store nothing and answer a tier, and the block was gone once the push failed
    (`abort`); the reservation is untouched and commits; once aborted instead, a put stores the block."""
    cache = make_cache(tmp_path)
    for commits in (True, False):
        key = BlockKey(11 if commits else 12)
        view = cache.reserve(key, PAGE)
        assert isinstance(view, memoryview)  # a DRAM page
        with pytest.raises(BlockPinnedError, match=f"block {key} is being filled"):
            cache.put(key, block(key))
        location = cache.location(key)
        assert location is not None and (location.length, location.ready) == (PAGE, False)
        assert cache.stats.puts == (0 if commits else 1)
        view[:] = bytes(PAGE)
        if commits:
            cache.commit(key)
            assert bytes(cache.get(key)) == bytes(PAGE)  # type: ignore[arg-type]
        else:
            cache.abort(key)
            assert cache.put(key, block(key)) is Tier.DRAM
            assert bytes(cache.get(key)) == block(key)  # type: ignore[arg-type]
        cache.check_invariants()
    cache.close()


def test_checksum_of_a_damaged_ssd_block_is_the_digest_it_was_stored_with(tmp_path: Path) -> None:
    """An SSD first tier's block keeps the digest its page header holds: `checksum` answers it without reading the
    damaged page back (it used to raise an IntegrityError its docstring did not name, and left the block cached);
    the peer the block goes to verifies the bytes against it, and a `get` finds the damage: a miss, counted."""
    cache = TieredCache([SsdPagePool(tmp_path / "ssd.pool", PAGE, 4)], source=SOURCE)
    try:
        data = bytes(range(PAGE))
        cache.put(BlockKey(5), data)
        damage(cache, BlockKey(5))
        assert cache.checksum(BlockKey(5)) == xxhash.xxh3_64_intdigest(data)
        assert cache.get(BlockKey(5)) is None
        assert BlockKey(5) not in cache and cache.stats.corrupt_blocks == 1
        cache.check_invariants()
    finally:
        cache.close()


class UnreadablePool(DramPagePool):
    """A host pool whose reads raise OSError once `failing` is set (a bad sector, as good as corrupt)."""

    failing = False

    def read(self, page: int, length: int, *, key: BlockKey | None = None) -> Any:
        if self.failing:
            raise OSError("injected read failure")
        return super().read(page, length, key=key)


@pytest.mark.parametrize("pinned", [False, True])
def test_checksum_of_a_block_whose_bytes_cannot_be_read_is_a_miss(pinned: bool) -> None:
    """A block whose digest must be computed and whose bytes cannot be read back goes the way `get` sends it: the
    call raises UnknownBlockError (not the pool's IntegrityError), the block is dropped, counted in
    `stats.corrupt_blocks` and announced removed; a pinned one is a miss and announced removed at once, and its
    page goes (counted) at its last unpin, announced no more."""
    pool = UnreadablePool(PAGE, 2)
    cache = TieredCache([pool], source=SOURCE)
    cache.put(BlockKey(3), block(3))
    cache.take_events()
    if pinned:
        cache.pin(BlockKey(3))
    pool.failing = True
    with pytest.raises(UnknownBlockError, match="block 3 is not cached"):
        cache.checksum(BlockKey(3))
    assert BlockKey(3) not in cache and cache.prefix_match([BlockKey(3)]) == 0
    with pytest.raises(UnknownBlockError):
        cache.checksum(BlockKey(3))
    removed = [(type(e), e.keys) for e in cache.take_events()]  # type: ignore[union-attr]
    assert removed == [(BlockRemoved, (3,))]  # at once: an index must stop sending requests for it
    if pinned:
        assert cache.stats.corrupt_blocks == 0 and pool.num_free == 1  # its page held for the pin
        cache.unpin(BlockKey(3))
    assert cache.stats.corrupt_blocks == 1 and cache.location(BlockKey(3)) is None
    assert cache.take_events() == []
    assert pool.num_free == 2
    cache.check_invariants()


# --------------------------------------------------------------------------- keys and arguments at the boundary


def test_numpy_keys_from_a_key_batch_work_in_every_call_and_every_tier(tmp_path: Path) -> None:
    """`hash_batch(...).keys` is a uint64 array: its items are keys to every call taking one, each read as the
    int it equals. (A `get` with one used to leave the numpy integer in the DRAM policy as the newest block's
    key; its demotion then failed in the SSD page header, naming another block's key, and so did later puts.)"""
    keys = BlockHasher(model="m", block_size_tokens=4).hash_batch(list(range(32)), [0, 32]).keys
    assert keys.dtype == np.uint64
    cache = make_cache(tmp_path, dram_pages=2, ssd_pages=8)
    try:
        cache.put(keys[0], block(0))
        cache.put(keys[1], block(1), parent=keys[0])
        assert bytes(cache.get(keys[1])) == block(1)  # type: ignore[arg-type]
        assert cache.touch(keys[0]) == Tier.DRAM
        cache.pin(keys[1])
        with cache.pinned(keys[1]) as view:
            assert view is not None and bytes(view) == block(1)
        cache.unpin(keys[1])
        for i in range(2, 8):
            cache.put(keys[i], block(i), parent=keys[i - 1], position=i)  # demotes to SSD, every time
        assert all(cache.tier_of(key) is not None for key in keys)
        assert cache.prefix_match(keys) == len(keys) and all(key in cache for key in keys)
        assert cache.checksum(keys[0]) == xxhash.xxh3_64_intdigest(block(0))
        location = cache.location(keys[0])
        assert location is not None and location.tier == Tier.SSD
        assert bytes(cache.get(int(keys[0]))) == block(0)  # type: ignore[arg-type]
        cache.remove(keys[7])
        assert keys[7] not in cache
        assert {type(key) for event in cache.take_events() for key in event.keys} == {int}  # type: ignore[union-attr]
        cache.check_invariants()
    finally:
        cache.close()


BAD_KEYS = [1.0, True, [1], "1", None, -1, 2**256, np.float64(1.0), np.bool_(True)]
KEY_CALLS: dict[str, Any] = {
    "get": lambda cache, key: cache.get(key),
    "touch": lambda cache, key: cache.touch(key),
    "pin": lambda cache, key: cache.pin(key),
    "unpin": lambda cache, key: cache.unpin(key),
    "remove": lambda cache, key: cache.remove(key),
    "checksum": lambda cache, key: cache.checksum(key),
    "location": lambda cache, key: cache.location(key),
    "tier_of": lambda cache, key: cache.tier_of(key),
    "commit": lambda cache, key: cache.commit(key),
    "abort": lambda cache, key: cache.abort(key),
    "pinned": lambda cache, key: cache.pinned(key).__enter__(),
    "prefix_match": lambda cache, key: cache.prefix_match([key]),
    "prefix_match-second": lambda cache, key: cache.prefix_match([BlockKey(1), key]),
    "put": lambda cache, key: cache.put(key, block(1)),
    "put_chain": lambda cache, key: cache.put_chain([key]),
}


@pytest.mark.parametrize("bad", BAD_KEYS, ids=lambda key: repr(key)[:16])
@pytest.mark.parametrize("name", list(KEY_CALLS))
def test_a_non_key_is_refused_by_name_by_every_call_taking_a_key(bad: object, name: str) -> None:
    """Every call taking a key refuses what is no block key (a float or a bool equal to block 1's key, a list, a
    string, None, a negative int, one of 2**256 or more) with InvalidRequestError naming it, and changes nothing:
    block 1 is never found by 1.0 or True (they used to read it, and leave themselves in its policy), an
    unhashable key is no bare TypeError. `in` answers False for all of them."""
    metadata = name == "put_chain"  # a chain goes into a metadata-only tier
    pool = MetadataPagePool(Tier.DRAM, PAGE, 2) if metadata else DramPagePool(PAGE, 2)
    cache = TieredCache([pool], source=SOURCE)
    if metadata:
        cache.put_chain([BlockKey(1)])
    else:
        cache.put(BlockKey(1), block(1))
    cache.take_events()
    with pytest.raises(InvalidRequestError, match="block key"):
        KEY_CALLS[name](cache, bad)
    assert bad not in cache
    assert cache.take_events() == [] and cache.stats.hits == 0 and len(cache) == 1
    cache.check_invariants()


def test_a_key_must_lie_below_2_to_the_256(tmp_path: Path) -> None:
    """The widest key is SHA-256's: 2**256 - 1 is a key in every tier (demoted to SSD and read back), 2**256 is
    none, refused by `put` and `put_chain` before anything is stored (it used to be cached in DRAM, then fail
    every demotion to SSD and, chosen as the victim again each time, every later put)."""
    widest = BlockKey(2**256 - 1)
    cache = make_cache(tmp_path, dram_pages=1, ssd_pages=4)
    try:
        with pytest.raises(InvalidRequestError, match="below 2\\*\\*256"):
            cache.put(2**256, block(5))  # type: ignore[arg-type]
        assert len(cache) == 0 and cache.take_events() == []
        cache.put(widest, block(5))
        for key in (2, 3):
            assert cache.put(BlockKey(key), block(key)) == Tier.DRAM
        assert cache.tier_of(widest) == Tier.SSD
        assert bytes(cache.get(widest)) == block(5)  # type: ignore[arg-type]
        cache.check_invariants()
    finally:
        cache.close()
    metadata = TieredCache([MetadataPagePool(Tier.DRAM, PAGE, 4)], source=SOURCE)
    with pytest.raises(InvalidRequestError, match="block key"):
        metadata.put_chain([BlockKey(1), BlockKey(2**256)])
    assert len(metadata) == 0 and metadata.take_events() == []


@pytest.mark.parametrize(
    ("call", "error", "named"),
    [
        (lambda: TieredCache([DramPagePool(PAGE, 2)]).prefix_match(None), InvalidRequestError, "keys"),  # type: ignore[arg-type]
        (lambda: TieredCache([MetadataPagePool(Tier.DRAM, PAGE, 2)]).put_chain(None), InvalidRequestError, "keys"),  # type: ignore[arg-type]
        (lambda: TieredCache([1]), ConfigError, "page pools"),  # type: ignore[list-item]
        (lambda: TieredCache(["DRAM"]), ConfigError, "page pools"),  # type: ignore[list-item]
        (lambda: TieredCache(5), ConfigError, "pools"),  # type: ignore[arg-type]
        (lambda: TieredCache([DramPagePool(PAGE, 2)], policy=None), ConfigError, "policy"),  # type: ignore[arg-type]
        (lambda: TieredCache([DramPagePool(PAGE, 2)], policy=LruPolicy()), ConfigError, "policy"),  # type: ignore[arg-type]
        (lambda: TieredCache([DramPagePool(PAGE, 2)], policy=int), ConfigError, "policy"),  # type: ignore[arg-type]
    ],
)
def test_bad_arguments_to_the_cache_are_refused_by_name(call: Any, error: type[Exception], named: str) -> None:
    """Arguments that are not what the cache takes (no iterable of keys; no page pools; no policy maker) are the
    library's errors naming them, not a bare TypeError or AttributeError from deep inside."""
    with pytest.raises(error, match=named):
        call()


def test_a_generator_of_keys_is_a_chain_to_put_chain() -> None:
    """`put_chain` takes any iterable of keys, numpy's and a generator's included, as the chain they are."""
    cache = TieredCache([MetadataPagePool(Tier.DRAM, PAGE, 4)], source=SOURCE)
    cache.put_chain(BlockKey(k) for k in (1, 2, 3))
    cache.put_chain(np.array([1, 2, 4], dtype=np.uint64))  # type: ignore[arg-type]
    assert cache.prefix_match([BlockKey(1), BlockKey(2), BlockKey(3)]) == 3 and BlockKey(4) in cache
    cache.check_invariants()


@given(st.lists(st.tuples(st.sampled_from(["put", "get", "touch", "pinned"]), st.integers(0, 7), st.booleans())))
@example([("put", 1, False), ("put", 2, False), ("get", 2, True), ("put", 3, False), ("put", 4, False)])
@settings(max_examples=40)
def test_numpy_and_python_keys_are_one_and_the_same(ops: list[tuple[str, int, bool]]) -> None:
    """Any sequence of puts and reads, each naming its key as a Python int or as a numpy uint64, leaves the cache
    (DRAM 2 pages over SSD 3: reads promote, puts demote and drop) as the same sequence with Python ints: the same
    tiers, the same bytes, the same events, and every demotion to SSD succeeds."""
    folder = Path(tempfile.mkdtemp())
    caches = [
        TieredCache([DramPagePool(PAGE, 2), SsdPagePool(folder / name, PAGE, 3)], source=SOURCE)
        for name in ("numpy", "python")
    ]
    try:
        for op, number, as_numpy in ops:
            for cache, key in zip(caches, [np.uint64(number) if as_numpy else number, number], strict=True):
                if op == "put":
                    cache.put(key, block(number))
                elif op == "pinned":
                    with cache.pinned(key) as view:
                        assert view is None or bytes(view) == block(number)
                else:
                    getattr(cache, op)(key)
        numpy_cache, python_cache = caches
        assert [numpy_cache.tier_of(BlockKey(k)) for k in range(8)] == [
            python_cache.tier_of(BlockKey(k)) for k in range(8)
        ]
        assert numpy_cache.take_events() == python_cache.take_events()
        for cache in caches:
            cache.check_invariants()
    finally:
        for cache in caches:
            cache.close()
        shutil.rmtree(folder)
