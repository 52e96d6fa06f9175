"""A dying disk under the cache: failed page releases, and headers or a superblock that cannot be read on reopening.

- Releasing a page never stops a cache call part way: `SsdPagePool.free` releases the page even when zeroing its
  header fails (EIO), so the call that dropped the block (the last `unpin` of a block found damaged, `remove`,
  `evict`) completes, counts the failure in `stats.failed_releases`, logs a warning naming the file, page and
  block, and announces the block removed. A caller releasing several pins in a loop releases all of them.
- Reopening a pool file whose slot header cannot be read (a bad sector) skips that slot, as a garbled one is
  skipped: the page is free, the rest recovered, a warning names the file and page. A superblock that cannot be
  read raises DiskError naming the file, from the OSError.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from mooncake.cache.index import BlockIndex, Holder
from mooncake.cache.pool import DramPagePool
from mooncake.cache.ssd import HEADER_BYTES, SsdPagePool
from mooncake.cache.tiered import TieredCache
from mooncake.errors import DiskError, MooncakeError
from mooncake.types import BlockKey, InstanceId, Tier
from tests.cache.damage import flip_byte

PAGE = 4096
SOURCE = InstanceId("node-0")


def block(key: int) -> bytes:
    return bytes([key % 251 + 1]) * 1000 + key.to_bytes(8, "little") * 10


def refuse_header_zeroing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every `pwrite` fails with EIO: a free zeroes a header with it (a page goes in with `pwritev`)."""

    def eio(*_args: Any) -> int:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "pwrite", eio)


def ssd_page_of(cache: TieredCache, key: int) -> int:
    location = cache.location(BlockKey(key))
    assert location is not None and location.tier == Tier.SSD
    return location.page


@pytest.mark.parametrize("copy", ["damaged in place", "damaged and replaced"])
def test_unpinning_several_blocks_releases_every_pin_when_a_drop_cannot_zero_its_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, copy: str
) -> None:
    """Blocks 1 and 2 (on SSD) are pinned; block 1 is found damaged, so its page goes at its last unpin (its copy
    in the cache, or a copy set aside after a new one was put), and the disk then refuses the write that zeroes
    that page's header. A caller unpinning both in a loop (decode's `finally: for key in pinned: unpin(key)`)
    releases both: the unpin that drops block 1 completes (it used to raise DiskError, leaving block 2 pinned for
    good), the failure counted and logged naming file, page and block; block 2 can be removed, the SSD page is
    free, the events mirror the cache and the invariants hold."""
    path = tmp_path / "pool"
    cache = TieredCache([DramPagePool(PAGE, 1), SsdPagePool(path, PAGE, 4)], source=SOURCE, promote_after=0)
    for key in (1, 2, 3):
        cache.put(BlockKey(key), block(key))
    assert [cache.tier_of(BlockKey(k)) for k in (1, 2, 3)] == [Tier.SSD, Tier.SSD, Tier.DRAM]
    page = ssd_page_of(cache, 1)
    pinned = [BlockKey(1), BlockKey(2)]
    for key in pinned:
        cache.pin(key)
    flip_byte(path, HEADER_BYTES + page * cache.pools[1].slot_bytes + HEADER_BYTES + 1)  # type: ignore[attr-defined]
    assert cache.get(BlockKey(1)) is None  # damaged: a miss, dropped at its last unpin
    if copy == "damaged and replaced":
        cache.put(BlockKey(1), block(1))  # the damaged copy is set aside until its pin goes
    index = BlockIndex()
    for event in cache.take_events():
        index.apply(event)
    refuse_header_zeroing(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="mooncake.cache"):
        for key in pinned:
            cache.unpin(key)
    monkeypatch.undo()
    assert cache.stats.failed_releases == 1
    (record,) = [r for r in caplog.records if "zeroing the header" in r.getMessage()]
    assert f"{path} page {page} (block 0x1)" in record.getMessage() and os.strerror(errno.EIO) in record.getMessage()
    cache.check_invariants()
    cache.remove(BlockKey(2))  # its pin was released: it used to raise BlockPinnedError
    assert cache.pools[1].num_free == 4 - (copy == "damaged and replaced")  # block 3 went down for the new copy
    for event in cache.take_events():
        assert index.apply(event) is None
    for key in (1, 2, 3):
        tier = cache.tier_of(BlockKey(key))
        assert index.holders(BlockKey(key)) == (() if tier is None else (Holder(SOURCE, tier),))
    assert (cache.tier_of(BlockKey(1)) is None) == (copy == "damaged in place")
    cache.close()


def test_removing_blocks_whose_headers_cannot_be_zeroed_removes_them_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`remove` of SSD blocks while the disk refuses to zero their headers: each remove completes (it used to
    raise DiskError after the block was gone, stopping a caller's loop), each failure counted and logged; the
    pages are free and the events announce the blocks removed."""
    path = tmp_path / "pool"
    cache = TieredCache([SsdPagePool(path, PAGE, 3)], source=SOURCE)
    for key in (1, 2, 3):
        cache.put(BlockKey(key), block(key))
    cache.take_events()
    refuse_header_zeroing(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="mooncake.cache"):
        for key in (1, 2, 3):
            cache.remove(BlockKey(key))
    monkeypatch.undo()
    assert len(cache) == 0 and cache.pools[0].num_free == 3 and cache.stats.failed_releases == 3
    assert sum("zeroing the header" in r.getMessage() for r in caplog.records) == 3
    (removed,) = cache.take_events()
    assert sorted(removed.keys) == [1, 2, 3]  # type: ignore[attr-defined]
    cache.check_invariants()
    cache.close()


def test_evicting_blocks_whose_headers_cannot_be_zeroed_evicts_them_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`evict(n)` from an SSD tier while the disk refuses to zero headers evicts `n` blocks and says so (it used
    to raise at the first, the count of those already gone lost)."""
    cache = TieredCache([SsdPagePool(tmp_path / "pool", PAGE, 3)])
    for key in (1, 2, 3):
        cache.put(BlockKey(key), block(key))
    refuse_header_zeroing(monkeypatch)
    assert cache.evict(2) == 2
    monkeypatch.undo()
    assert len(cache) == 1 and cache.pools[0].num_free == 2 and cache.stats.failed_releases == 2
    cache.check_invariants()
    cache.close()


# --------------------------------------------------------------------------- reopening a damaged disk


def filled_pool(path: Path) -> None:
    """A closed four-page pool file holding blocks 1..4 in pages 0..3."""
    with SsdPagePool(path, PAGE, 4) as pool:
        for page in range(4):
            assert pool.try_allocate() == page
            pool.write(page, block(page + 1), key=BlockKey(page + 1))


def fail_reads_at(monkeypatch: pytest.MonkeyPatch, bad_offset: int) -> OSError:
    """Reads of the file at `bad_offset` fail with EIO (a bad sector); returns the error they raise."""
    real = os.preadv
    cause = OSError(errno.EIO, os.strerror(errno.EIO))

    def preadv(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        if offset == bad_offset:
            raise cause
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", preadv)
    return cause


def test_reopening_with_an_unreadable_slot_header_skips_that_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One slot header cannot be read (EIO) as the pool file is reopened: the pool opens (it used to fail with a
    bare OSError naming neither file nor page, losing the whole tier), recovers the other blocks, leaves that
    page free, and logs a warning naming the file and page; once the disk reads again, the page takes a block."""
    path = tmp_path / "pool"
    filled_pool(path)
    slot_bytes = HEADER_BYTES + PAGE
    fail_reads_at(monkeypatch, HEADER_BYTES + 2 * slot_bytes)  # slot 2's header
    with caplog.at_level(logging.WARNING, logger="mooncake.cache"):
        pool = SsdPagePool(path, PAGE, 4)
    monkeypatch.undo()
    assert [(found.page, found.key) for found in pool.recovered] == [(0, 1), (1, 2), (3, 4)]
    assert pool.num_free == 1
    (record,) = caplog.records
    assert f"{path} page 2" in record.getMessage() and os.strerror(errno.EIO) in record.getMessage()
    assert pool.try_allocate() == 2
    pool.write(2, block(9), key=BlockKey(9))
    assert bytes(pool.read(2, len(block(9)), key=BlockKey(9))) == block(9)
    pool.close()


def test_reopening_with_an_unreadable_superblock_raises_disk_error_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The superblock cannot be read (EIO): opening raises DiskError (a MooncakeError and an OSError with errno
    EIO) naming the file, from the cause (it used to be the bare OSError), and leaves the file in place."""
    path = tmp_path / "pool"
    filled_pool(path)
    cause = fail_reads_at(monkeypatch, 0)
    with pytest.raises(DiskError) as raised:
        SsdPagePool(path, PAGE, 4)
    monkeypatch.undo()
    error = raised.value
    assert isinstance(error, MooncakeError) and error.errno == errno.EIO and error.__cause__ is cause
    assert str(path) in str(error) and "superblock" in str(error)
    with SsdPagePool(path, PAGE, 4) as pool:
        assert len(pool.recovered) == 4


def test_reopening_when_an_older_duplicate_cannot_be_invalidated_keeps_the_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two copies of one key (a freed copy whose zeroing was lost): reopening keeps the newer and zeroes the older
    one's header; where that write fails (EIO), the older page is left free with a warning naming file and page (it
    raised DiskError, losing the whole tier), and the next reopening picks the same winner."""
    path = tmp_path / "pool"
    with SsdPagePool(path, PAGE, 4) as pool:
        first, second = pool.try_allocate(), pool.try_allocate()
        pool.write(first, block(7), key=BlockKey(7))
        pool.write(second, block(7), key=BlockKey(7))

    def failing(_self: SsdPagePool, _data: object, _offset: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(SsdPagePool, "_pwrite", failing)
    with caplog.at_level(logging.WARNING, logger="mooncake.cache"):
        pool = SsdPagePool(path, PAGE, 4)
    monkeypatch.undo()
    assert [(found.page, found.key) for found in pool.recovered] == [(second, 7)]
    assert pool.num_free == 3
    (record,) = caplog.records
    assert f"{path} page {first}" in record.getMessage() and "invalidating an older copy" in record.getMessage()
    pool.close()
    with SsdPagePool(path, PAGE, 4) as again:
        assert [(found.page, found.key) for found in again.recovered] == [(second, 7)]
