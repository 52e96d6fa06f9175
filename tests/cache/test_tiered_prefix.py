"""The tiered cache across tiers: prefix protection spanning them, the demotion of a pinned block's prefix, the
removal of a block found corrupt while pinned, an unpin racing a read, and a touch that cannot promote."""

from __future__ import annotations

import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
import xxhash
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mooncake.cache.events import BlockRemoved
from mooncake.cache.index import BlockIndex, Holder
from mooncake.cache.policy import LfuPolicy, LruPolicy, SievePolicy
from mooncake.cache.pool import DramPagePool
from mooncake.cache.ssd import HEADER_BYTES, SsdPagePool
from mooncake.cache.tiered import TieredCache
from mooncake.errors import BlockPinnedError, CapacityError, UnknownBlockError
from mooncake.types import BlockKey, InstanceId, Tier
from tests.cache.damage import flip_byte

PAGE = 64
SOURCE = InstanceId("node-p")
K = BlockKey


def block(key: int) -> bytes:
    seed = xxhash.xxh3_64_digest(key.to_bytes(8, "little"))
    return (seed * 8)[: 1 + key % PAGE]


def two_tiers(folder: Path, dram_pages: int, ssd_pages: int, **options: Any) -> TieredCache:
    pools: list[Any] = [DramPagePool(PAGE, dram_pages), SsdPagePool(folder / "ssd.pool", PAGE, ssd_pages)]
    return TieredCache(pools, source=SOURCE, **options)


def damage(cache: TieredCache, key: BlockKey) -> None:
    """Flip a data byte of `key`'s SSD page (a bad sector)."""
    location = cache.location(key)
    assert location is not None and location.tier == Tier.SSD
    pool = cache.pools[-1]
    assert isinstance(pool, SsdPagePool)
    flip_byte(Path(pool.path), HEADER_BYTES + location.page * pool.slot_bytes + HEADER_BYTES)


def mirrors(cache: TieredCache, index: BlockIndex, keys: range) -> None:
    """Feed the cache's events to `index` and check it says what the cache holds."""
    for event in cache.take_events():
        assert index.apply(event) is None
    for key in keys:
        tier = cache.tier_of(K(key))
        assert index.holders(K(key)) == (() if tier is None else (Holder(SOURCE, tier),)), f"block {key}"


# --------------------------------------------------------------------------- A: prefix protection across tiers


def test_an_ssd_prefix_outlives_unrelated_blocks_while_its_promoted_successor_is_cached(tmp_path: Path) -> None:
    """Block 2 is read alone (a transfer touching only the suffix it fetched) and promoted; its parent stays on
    SSD. Unrelated puts then churn the SSD tier: they must drop the unrelated blocks, not the parent, which a
    per-tier policy sees as a childless block (its child's link left with the child)."""
    cache = two_tiers(tmp_path, 2, 2)
    cache.put(K(1), block(1))
    cache.put(K(2), block(2), parent=K(1))
    cache.put(K(10), block(10))
    cache.put(K(11), block(11))
    cache.get(K(2))
    assert (cache.tier_of(K(1)), cache.tier_of(K(2))) == (Tier.SSD, Tier.DRAM)
    cache.put(K(12), block(12))  # 11 → SSD: the SSD victim is 10, not 1
    cache.put(K(13), block(13))  # 2 → SSD: 1 is still its prefix there
    assert {k: cache.tier_of(K(k)) for k in (1, 2, 10, 11)} == {1: Tier.SSD, 2: Tier.SSD, 10: None, 11: None}
    assert cache.prefix_match([K(1), K(2)]) == 2
    for key in (14, 15, 16):
        cache.put(K(key), block(key))
        assert K(1) in cache or K(2) not in cache, f"block 1 dropped while block 2 is cached (put of {key})"
        cache.check_invariants()


def test_a_block_stored_after_its_prefix_was_demoted_protects_that_prefix(tmp_path: Path) -> None:
    """The usual way a chain spans tiers: the prompt's prefix was demoted to SSD, its new block is stored in DRAM.
    While that block is cached, SSD evictions take other blocks."""
    cache = two_tiers(tmp_path, 1, 2)
    cache.put(K(1), block(1))
    cache.put(K(5), block(5))  # 1 → SSD
    cache.put(K(2), block(2), parent=K(1))  # 5 → SSD, SSD full
    cache.pin(K(2))  # keeps it in DRAM: puts go through it to SSD
    index = BlockIndex()
    for key in (6, 7, 8):
        with pytest.raises(CapacityError):  # DRAM all pinned
            cache.put(K(key), block(key))
    cache.unpin(K(2))
    cache.put(K(6), block(6))  # 2 → SSD: the SSD victim must be 5, not 1
    assert {k: cache.tier_of(K(k)) for k in (1, 2, 5, 6)} == {1: Tier.SSD, 2: Tier.SSD, 5: None, 6: Tier.DRAM}
    mirrors(cache, index, range(1, 9))
    cache.check_invariants()


def test_a_policy_that_ranks_blocks_alone_still_drops_the_least_recent(tmp_path: Path) -> None:
    """Holds are prefix protection: a cache whose policy is not prefix-aware ranks blocks alone in every tier."""
    cache = two_tiers(tmp_path, 1, 1, policy=lambda: LruPolicy(prefix_aware=False))
    cache.put(K(1), block(1))
    cache.put(K(2), block(2), parent=K(1))  # 1 → SSD
    cache.put(K(3), block(3))  # 2 → SSD, 1 dropped although 2 is its successor
    assert (K(1) in cache, cache.tier_of(K(2))) == (False, Tier.SSD)
    cache.check_invariants()


def test_a_victim_no_tier_takes_stays_while_its_successor_is_cached(tmp_path: Path) -> None:
    """Every SSD page pinned: a DRAM victim is dropped, but not one whose successor is cached on SSD; the put
    takes the next victim instead."""
    cache = two_tiers(tmp_path, 2, 1)
    cache.put(K(1), block(1))
    cache.put(K(2), block(2), parent=K(1))
    cache.put(K(3), block(3))  # 1 and 2 are a chain: 2 (the DRAM leaf) → SSD
    assert cache.tier_of(K(2)) == Tier.SSD
    cache.pin(K(2))
    cache.put(K(4), block(4))  # DRAM victim 1 (least recent) cannot go down and has block 2 cached: 3 goes
    assert {k: cache.tier_of(K(k)) for k in (1, 2, 3, 4)} == {1: Tier.DRAM, 2: Tier.SSD, 3: None, 4: Tier.DRAM}
    cache.check_invariants()


def test_a_chain_filling_every_tier_makes_room_for_its_next_block() -> None:
    """Regression (TestTieredLfuPrefix): chain 1 → … → 7 fills DRAM and SSD, nothing pinned, and block 8 extends
    it. Every cached block is a prefix, and 7 only of the block being put: the put must not fail. It drops 7,
    the deepest cached block, which strands only the new block (any other victim would strand more)."""
    with tempfile.TemporaryDirectory() as folder:
        cache = two_tiers(Path(folder), 3, 4, policy=LfuPolicy, promote_after=2)
        for key in (6, 1, 1, 1, 2, 3, 4, 7, 5):
            cache.put(K(key), block(key), parent=K(key - 1) if key > 1 else None)
        assert len(cache) == 7 and not cache.pools[0].num_free and not cache.pools[1].num_free
        cache.put(K(8), block(8), parent=K(7))
        assert {k: cache.tier_of(K(k)) is not None for k in range(1, 9)} == {k: k != 7 for k in range(1, 9)}
        assert cache.prefix_match([K(k) for k in range(1, 9)]) == 6
        cache.check_invariants()
        cache.close()


def test_a_put_drops_its_own_parent_only_where_nothing_else_can_go(tmp_path: Path) -> None:
    """Regression (TestPrefixLru): pins keep 2, 5 and 8 (with 1 and 4 their prefixes); block 6's parent 3 is
    the only block no pinned block needs, so the put of 6 drops it rather than failing; while another block
    could go, the parent stays (the claim protects it)."""
    cache = two_tiers(tmp_path, 3, 3)
    for key in (1, 2, 3, 5, 8):
        cache.put(K(key), block(key), parent=K(key // 2) if key > 1 else None)
    for key in (8, 2, 5):
        cache.pin(K(key))
    cache.put(K(4), block(4), parent=K(2))
    assert {k: cache.tier_of(K(k)) for k in (1, 2, 3, 4, 5, 8)} == {
        1: Tier.SSD,
        2: Tier.SSD,
        3: Tier.SSD,
        4: Tier.DRAM,
        5: Tier.DRAM,
        8: Tier.DRAM,
    }
    cache.put(K(6), block(6), parent=K(3))  # 4 (prefix of pinned 8) → SSD in the place of 3
    assert {k: cache.tier_of(K(k)) for k in (1, 2, 3, 4, 6)} == {
        1: Tier.SSD,
        2: Tier.SSD,
        3: None,
        4: Tier.SSD,
        6: Tier.DRAM,
    }
    cache.check_invariants()


# --------------------------------------------------------------------------- B: a pinned block's prefix


def test_the_unpinned_prefix_of_a_pinned_block_is_demoted_to_make_room(tmp_path: Path) -> None:
    """Chain 1 → 2 → 3 fills DRAM with 3 pinned: 1 and 2 are protected as prefixes, but demoting one keeps it
    cached, so the put demotes the policy's first (1, least recent) instead of failing."""
    cache = two_tiers(tmp_path, 3, 8)
    cache.put(K(1), block(1))
    cache.put(K(2), block(2), parent=K(1))
    cache.put(K(3), block(3), parent=K(2))
    cache.pin(K(3))
    cache.put(K(10), block(10))
    assert {k: cache.tier_of(K(k)) for k in (1, 2, 3, 10)} == {
        1: Tier.SSD,
        2: Tier.DRAM,
        3: Tier.DRAM,
        10: Tier.DRAM,
    }
    assert cache.prefix_match([K(1), K(2), K(3)]) == 3
    cache.check_invariants()


def test_capacity_error_names_the_prefixes_of_pinned_blocks() -> None:
    """With no tier below, the prefix of a pinned block cannot go anywhere: the error says so, not that every
    page is pinned."""
    cache = TieredCache([DramPagePool(PAGE, 3)], source=SOURCE)
    cache.put(K(1), block(1))
    cache.put(K(2), block(2), parent=K(1))
    cache.put(K(3), block(3), parent=K(2))
    cache.pin(K(3))
    with pytest.raises(CapacityError, match="1 pinned blocks and 2 prefixes of pinned or cached blocks"):
        cache.put(K(10), block(10))
    cache.pin(K(1))
    cache.pin(K(2))
    with pytest.raises(CapacityError, match="all 3 pages hold pinned blocks"):
        cache.put(K(10), block(10))


# --------------------------------------------------------------------------- C: corrupt while pinned


def test_a_pinned_block_found_corrupt_is_announced_removed_at_once(tmp_path: Path) -> None:
    """From the read that finds it corrupt the cache reports the block not cached, so the index must hear of it
    then, not at the last unpin (until which it would send requests for a block nobody can serve)."""
    cache = two_tiers(tmp_path, 1, 2, promote_after=0)
    cache.put(K(1), block(1))
    cache.put(K(2), block(2))
    index = BlockIndex()
    mirrors(cache, index, range(1, 3))
    cache.pin(K(1))
    damage(cache, K(1))
    assert cache.get(K(1)) is None and K(1) not in cache
    events = cache.take_events()
    assert [(type(e), e.keys) for e in events] == [(BlockRemoved, (1,))]  # type: ignore[union-attr]
    for event in events:
        index.apply(event)
    assert index.holders(K(1)) == ()
    cache.check_invariants()
    cache.unpin(K(1))  # its page goes now, announced no more
    assert cache.take_events() == [] and cache.stats.corrupt_blocks == 1 and cache.pools[1].num_free == 2
    cache.check_invariants()


# --------------------------------------------------------------------------- D: unpin during a read


class GatedPool(DramPagePool):
    """A pool whose reads by the thread named "reader" wait at a gate, so a read is held in progress."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def read(self, page: int, length: int, *, key: BlockKey | None = None) -> Any:
        if threading.current_thread().name == "reader":
            self.entered.set()
            assert self.gate.wait(30)
        return super().read(page, length, key=key)


def test_an_unpin_without_a_pin_is_refused_while_a_read_holds_the_block() -> None:
    """A read of a lower tier pins the block while it reads outside the lock; an unpin by a caller holding no
    pin must not take that pin (the read's release would then fail, and pins go negative)."""
    gated = GatedPool(PAGE, 2)
    cache = TieredCache([DramPagePool(PAGE, 1, tier=Tier.VRAM), gated], source=SOURCE, promote_after=0)
    cache.put(K(1), block(1))
    cache.put(K(2), block(2))  # 1 → DRAM, read outside the lock
    cache.pin(K(1))  # a holder's pin, besides the read's
    result: dict[str, Any] = {}

    def read() -> None:
        try:
            result["data"] = bytes(cache.get(K(1)) or b"")
        except Exception as error:  # reported below: the read must not fail
            result["data"] = error

    reader = threading.Thread(target=read, name="reader")
    reader.start()
    try:
        assert gated.entered.wait(30)
        cache.unpin(K(1))  # the holder's own
        with pytest.raises(UnknownBlockError, match="block 1 is not pinned"):
            cache.unpin(K(1))
    finally:
        gated.gate.set()
        reader.join(30)
    assert result["data"] == block(1)
    with pytest.raises(UnknownBlockError):
        cache.unpin(K(1))
    cache.check_invariants()


# --------------------------------------------------------------------------- E: touch without a promotion


class CountingSsdPool(SsdPagePool):
    """An SSD pool counting its page reads."""

    num_reads = 0

    def read(self, page: int, length: int, *, key: BlockKey | None = None) -> Any:
        self.num_reads += 1
        return super().read(page, length, key=key)


def test_touch_reads_no_page_where_it_cannot_promote(tmp_path: Path) -> None:
    """Every DRAM page pinned: a touch of an SSD block records the read and leaves the block where it is, reading
    nothing (the bytes would be thrown away, after a page read under the cache's lock)."""
    ssd = CountingSsdPool(tmp_path / "ssd.pool", PAGE, 4)
    cache = TieredCache([DramPagePool(PAGE, 1), ssd], source=SOURCE)
    cache.put(K(1), block(1))
    cache.put(K(2), block(2))
    cache.pin(K(2))
    for _ in range(5):
        assert cache.touch(K(1)) == Tier.SSD
    assert ssd.num_reads == 0 and cache.stats.hits == 5
    cache.unpin(K(2))
    assert cache.touch(K(1)) == Tier.DRAM  # it can move now: the move reads it (verified) once
    assert ssd.num_reads == 1
    cache.check_invariants()


# --------------------------------------------------------------------------- state machines

keys = st.integers(min_value=1, max_value=10).map(BlockKey)


def parent_of(key: int) -> BlockKey | None:
    """A tree of chains: 1 → 2 → 4 → 8, 1 → 3 → 6, 2 → 5 → 10, ... (each key's parent is fixed, as a content
    hash's is)."""
    return K(key // 2) if key > 1 else None


class PrefixMachine(RuleBasedStateMachine):
    """Prefix-aware tiers with pins: eviction never loses a block while a successor of it is cached, in any
    tier; a put finds room while the first tier holds an unpinned block and the last tier a free page; pinned
    blocks stay; the events mirror the cache."""

    policy_class: type = LruPolicy

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="tiered-prefix-"))
        self.cache = TieredCache(self.pools(), source=SOURCE, policy=self.policy_class, promote_after=1)
        self.pins: dict[BlockKey, int] = {}
        self.index = BlockIndex()
        self.held: set[BlockKey] = set()
        self.removed: set[BlockKey] = set()
        self.put_parent: BlockKey | None = None

    def pools(self) -> list[Any]:
        return [DramPagePool(PAGE, 3), SsdPagePool(self.tmp / "ssd.pool", PAGE, 3)]

    def teardown(self) -> None:
        self.cache.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def can_make_room(self) -> bool:
        first, last = self.cache.pools[0], self.cache.pools[-1]
        unpinned = any(self.cache.tier_of(K(k)) == first.tier and K(k) not in self.pins for k in range(1, 11))
        return first.num_free > 0 or (unpinned and last.num_free > 0)

    @rule(key=keys)
    def put(self, key: BlockKey) -> None:
        if key in self.cache:
            self.cache.put(key, block(key), parent=parent_of(key))
            return
        must_fit = self.can_make_room()
        self.put_parent = parent_of(key)  # the one block the put may drop while it is the block's prefix
        try:
            self.cache.put(key, block(key), parent=parent_of(key))
        except CapacityError:
            assert not must_fit, "CapacityError with an unpinned first-tier block and a free last-tier page"
            return
        assert key in self.cache

    @rule(key=keys)
    def get(self, key: BlockKey) -> None:
        data = self.cache.get(key)
        assert data is None or bytes(data) == block(key)

    @rule(key=keys)
    def touch(self, key: BlockKey) -> None:
        assert (self.cache.touch(key) is None) == (key not in self.cache)

    @rule(key=keys)
    def pin(self, key: BlockKey) -> None:
        if key in self.cache:
            self.cache.pin(key)
            self.pins[key] = self.pins.get(key, 0) + 1

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
        try:
            self.cache.remove(key)
            self.removed = {key}
        except (UnknownBlockError, BlockPinnedError):
            pass

    @rule(num_blocks=st.integers(min_value=0, max_value=3))
    def evict(self, num_blocks: int) -> None:
        self.cache.evict(num_blocks)

    @invariant()
    def no_prefix_is_lost_before_its_successors(self) -> None:
        self.cache.check_invariants()
        held = {K(k) for k in range(1, 11) if K(k) in self.cache}
        for key in self.held - held - self.removed:
            cached = [k for k in held if parent_of(k) == key]
            if key == self.put_parent and cached and all(k not in self.held for k in cached):
                continue  # the last resort of a put: its parent, whose only cached successor is the new block
            assert not cached, f"block {key} dropped while its successors {cached} are cached"
        for key in self.pins:
            assert key in held, f"pinned block {key} lost"
        self.held, self.removed, self.put_parent = held, set(), None

    @invariant()
    def events_mirror_the_cache(self) -> None:
        mirrors(self.cache, self.index, range(1, 11))


PrefixMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestPrefixLru = PrefixMachine.TestCase


class PrefixSieveMachine(PrefixMachine):
    policy_class = SievePolicy


class PrefixLfuThreeTierMachine(PrefixMachine):
    policy_class = LfuPolicy

    def pools(self) -> list[Any]:
        return [
            DramPagePool(PAGE, 2, tier=Tier.VRAM),
            DramPagePool(PAGE, 2),
            SsdPagePool(self.tmp / "ssd.pool", PAGE, 3),
        ]


TestPrefixSieve = PrefixSieveMachine.TestCase
TestPrefixLfuThreeTiers = PrefixLfuThreeTierMachine.TestCase


class CorruptionMachine(PrefixMachine):
    """The same, with SSD pages damaged under pinned and unpinned blocks: whatever a read finds, the events
    applied in order say exactly what the cache holds after every step (a block found corrupt is announced
    removed then, not at its last unpin)."""

    @rule(key=keys)
    def damage(self, key: BlockKey) -> None:
        if self.cache.tier_of(key) == Tier.SSD:
            damage(self.cache, key)

    @rule(key=keys)
    def damage_pinned(self, key: BlockKey) -> None:
        """A reader holds the block when its page goes bad: the next read finds it (in place: it is pinned)."""
        if self.cache.tier_of(key) == Tier.SSD:
            self.cache.pin(key)
            self.pins[key] = self.pins.get(key, 0) + 1
            damage(self.cache, key)  # (a second flip of the same byte mends it)
            data = self.cache.get(key)
            assert data is None or bytes(data) == block(key)

    @rule(key=keys)
    def checksum(self, key: BlockKey) -> None:
        try:
            self.cache.checksum(key)
        except UnknownBlockError:
            pass

    @invariant()
    def no_prefix_is_lost_before_its_successors(self) -> None:  # damage loses blocks, pinned ones too
        self.cache.check_invariants()


TestCorruption = CorruptionMachine.TestCase
TestCorruption.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
