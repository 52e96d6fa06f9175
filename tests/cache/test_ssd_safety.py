"""Tests of mooncake.cache.ssd where a caller's mistake, a dropped pool or a dying disk could cost blocks.

A pool dropped without `close()` gives its file and lock back when collected; a
read into a buffer that cannot take it is refused by name before any I/O (never
blamed on the disk); a write the disk fails part-way is never adopted after a
restart, and the caller's error names that failure; and a recovery finding a
key twice keeps the newest copy whose bytes verify, not a torn newest one.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mooncake.cache.events import BlockStored
from mooncake.cache.pool import DramPagePool, aligned_buffer
from mooncake.cache.ssd import HEADER_BYTES, SsdPagePool
from mooncake.cache.tiered import TieredCache
from mooncake.errors import DiskError, InvalidRequestError
from mooncake.types import BlockKey
from tests.cache.damage import overwrite, read_file
from tests.cache.test_ssd import block, header_offset, open_direct, write_new

PAGE = 4096


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# --------------------------------------------------------------------------- a pool dropped unclosed


def test_a_pool_dropped_unclosed_releases_its_file_when_collected(tmp_path: Path) -> None:
    """A pool (or the cache over it) dropped without `close()` closes its file when collected, with a
    ResourceWarning as an unclosed file gives: the process can open the file again (its fd and flock used to be
    held until the process exited, so no pool could ever reopen it)."""
    path = tmp_path / "pool"
    before = open_fds()
    pool = SsdPagePool(path, PAGE, 4)
    write_new(pool, 7, b"kept")
    cache = TieredCache([DramPagePool(PAGE, 1), SsdPagePool(tmp_path / "under-a-cache", PAGE, 4)])
    with pytest.warns(ResourceWarning, match="never closed") as caught:
        del pool, cache
        gc.collect()
    assert len([w for w in caught if issubclass(w.category, ResourceWarning)]) == 2
    assert open_fds() == before
    with SsdPagePool(path, PAGE, 4) as again, SsdPagePool(tmp_path / "under-a-cache", PAGE, 4):
        assert [found.key for found in again.recovered] == [7]


def test_close_is_idempotent_and_a_closed_pool_is_collected_silently(tmp_path: Path) -> None:
    """`close()` twice is one close; a pool closed (by hand or by `with`) warns of nothing when collected."""
    pool = SsdPagePool(tmp_path / "pool", PAGE, 2)
    pool.close()
    pool.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with SsdPagePool(tmp_path / "other", PAGE, 2):
            pass
        del pool
        gc.collect()


# --------------------------------------------------------------------------- buffers read_into refuses


def refuse_io(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any page read fail the test: a refused buffer must be refused before the disk is touched."""

    def no_read(*_args: Any) -> int:
        raise AssertionError("read_into touched the disk with a buffer it should have refused")

    monkeypatch.setattr(os, "preadv", no_read)


@pytest.mark.parametrize(
    ("out", "named"),
    [
        (123, "out must be a writable buffer .* got 123"),
        ("abc", "out must be a writable buffer .* got str"),
        (b"\0" * 16, "out must be a writable, contiguous buffer, got bytes"),
        (memoryview(bytearray(32))[::2], "out must be a writable, contiguous buffer, got memoryview"),
        (np.zeros((20, 4), np.uint8)[:, 0], r"writable, contiguous array .* got a uint8 array of shape \(20,\)"),
        (np.zeros((20, 4), np.float32)[:, 0], r"writable, contiguous array .* got a float32 array"),
        (np.frombuffer(b"\0" * 16, np.uint8), r"writable, contiguous array .* got a uint8 array of shape \(16,\)"),
        (np.zeros(16, object), r"array of plain values \(no Python objects\), got a object array"),
    ],
    ids=["int", "str", "bytes", "strided-view", "strided-uint8", "strided-float32", "read-only-array", "objects"],
)
def test_read_into_refuses_a_buffer_it_cannot_fill_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, out: Any, named: str
) -> None:
    """A buffer that is none (an int, a str), read-only or not contiguous is an InvalidRequestError naming it,
    raised before any I/O (they were a bare TypeError or BufferError, some from inside the read)."""
    with SsdPagePool(tmp_path / "pool", PAGE, 2) as pool:
        page = write_new(pool, 1, b"x" * 10)
        refuse_io(monkeypatch)
        with pytest.raises(InvalidRequestError, match=named):
            pool.read_into(page, 10, out)


@pytest.mark.parametrize(
    ("make_out", "named"),
    [
        (lambda: bytearray(5000), "buffer of 5000 bytes cannot take 8192 \\(with O_DIRECT: 5000 rounded up"),
        (lambda: aligned_buffer(5000), "buffer of 5000 bytes cannot take 8192 \\(with O_DIRECT: 5000 rounded up"),
        (lambda: aligned_buffer(8192 + 1)[1:], "out must start on a 4096-byte boundary with O_DIRECT"),
    ],
    ids=["short-of-the-rounded-length", "aligned-but-short", "misaligned"],
)
def test_an_o_direct_read_into_a_buffer_it_cannot_use_is_the_callers_mistake(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_out: Any, named: str
) -> None:
    """With O_DIRECT, a buffer not 4 KiB-aligned, or shorter than the length rounded up to 4 KiB, is refused
    by name before any I/O: it used to reach the disk and come back as DiskError EINVAL, a caller's mistake
    blamed on the disk (a tiered cache drops the block for that). An aligned buffer of the rounded length reads."""
    with open_direct(tmp_path / "pool", 10000, 2) as pool:
        page = write_new(pool, 1, b"x" * 5000)
        good = aligned_buffer(8192)
        assert pool.read_into(page, 5000, good) and bytes(good[:5000]) == b"x" * 5000
        refuse_io(monkeypatch)
        with pytest.raises(InvalidRequestError, match=named):
            pool.read_into(page, 5000, make_out())


# --------------------------------------------------------------------------- a write the disk fails


def fail_write(*_args: Any) -> int:
    raise OSError(errno.EIO, "Input/output error (injected)")


def dying_disk(monkeypatch: pytest.MonkeyPatch, landed: int) -> None:
    """The disk dies during the next write: that call puts its first `landed` bytes on disk and raises EIO, and
    every later write (a free zeroing a header among them) fails whole."""
    real_pwrite = os.pwrite
    dead = [False]

    def write(fd: int, buffers: list[Any], offset: int) -> int:
        if not dead[0]:
            dead[0] = True
            real_pwrite(fd, b"".join(bytes(buffer) for buffer in buffers)[:landed], offset)
        raise OSError(errno.EIO, "Input/output error (injected)")

    monkeypatch.setattr(os, "pwritev", write)
    monkeypatch.setattr(os, "pwrite", lambda fd, buffer, offset: write(fd, [buffer], offset))


@pytest.mark.parametrize("landed", [HEADER_BYTES, HEADER_BYTES + PAGE // 2, HEADER_BYTES + PAGE - 1])
@pytest.mark.parametrize("earlier", ["fresh", "header-left-standing"])
def test_a_write_the_disk_fails_is_never_adopted_after_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, landed: int, earlier: str
) -> None:
    """A put whose page write dies part-way (EIO after `landed` bytes), with the free of its page failing too,
    raises the write's DiskError (it used to name only the zeroing's); the failed free, which released the page
    all the same, is counted and logged naming both; after a restart the block is not recovered nor announced
    (the header used to land first, so the torn page came back as stored, and its first get found it corrupt).
    Also where the page held an older block whose header a failed free had left standing: that header is never
    adopted over the new bytes."""
    path = tmp_path / "pool"
    cache = TieredCache([SsdPagePool(path, PAGE, 1)])
    if earlier == "header-left-standing":
        cache.put(BlockKey(1), block(1, PAGE))
        monkeypatch.setattr(os, "pwrite", fail_write)
        cache.remove(BlockKey(1))  # the page is released, its header not zeroed (counted, logged)
        monkeypatch.undo()
        assert cache.stats.failed_releases == 1
        assert read_file(path, HEADER_BYTES, 4) == b"MCPG"  # block 1's header stands over its bytes
    cache.take_events()
    dying_disk(monkeypatch, landed)
    with caplog.at_level(logging.WARNING, logger="mooncake.cache"), pytest.raises(DiskError) as raised:
        cache.put(BlockKey(7), block(7, PAGE))
    monkeypatch.undo()
    assert "(block 0x7): writing the page failed: Input/output error" in str(raised.value)
    assert cache.stats.failed_releases == 1 + (earlier == "header-left-standing")
    (logged,) = [record.getMessage() for record in caplog.records if "(block 0x7)" in record.getMessage()]
    assert "zeroing the header to free it failed" in logged and "before that" in logged
    assert BlockKey(7) not in cache and cache.take_events() == []
    cache.close()
    restarted = TieredCache([SsdPagePool(path, PAGE, 1)], epoch=1)
    assert restarted.pools[0].recovered == ()  # type: ignore[attr-defined]
    assert not any(isinstance(event, BlockStored) for event in restarted.take_events())
    assert BlockKey(7) not in restarted and BlockKey(1) not in restarted
    restarted.close()


@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "o_direct"])
def test_a_header_is_written_only_after_all_of_its_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, o_direct: bool
) -> None:
    """A page write is two calls: the data behind a zeroed header, then the header alone. A write failing in the
    first leaves no header, even over a page whose old block was live; in the second, the data is all there."""
    path = tmp_path / "pool"
    pool = open_direct(path, PAGE, 2) if o_direct else SsdPagePool(path, PAGE, 2)
    page = write_new(pool, 1, block(1, PAGE))
    calls: list[tuple[int, bytes]] = []
    real_pwritev, real_pwrite = os.pwritev, os.pwrite

    def record_pwritev(fd: int, buffers: list[Any], offset: int) -> int:
        calls.append((offset, b"".join(bytes(buffer) for buffer in buffers)))
        return real_pwritev(fd, buffers, offset)

    def record_pwrite(fd: int, buffer: Any, offset: int) -> int:
        calls.append((offset, bytes(buffer)))
        return real_pwrite(fd, buffer, offset)

    monkeypatch.setattr(os, "pwritev", record_pwritev)
    monkeypatch.setattr(os, "pwrite", record_pwrite)
    pool.write(page, block(2, PAGE), key=BlockKey(2))
    monkeypatch.undo()
    (first_at, first), (second_at, second) = calls
    assert first_at == second_at == header_offset(pool, page)
    assert first == bytes(HEADER_BYTES) + block(2, PAGE)  # the old header is gone with the first byte written
    assert second[:4] == b"MCPG" and len(second) == HEADER_BYTES
    assert bytes(pool.read(page, PAGE, key=BlockKey(2))) == block(2, PAGE)
    assert len(calls) == 2
    pool.close()


# --------------------------------------------------------------------------- a key found twice


def same_key_twice(path: Path, o_direct: bool) -> tuple[int, int, int]:
    """A pool file holding key 5 in two pages (generation 1, then 2), as a free whose zeroing was lost leaves it:
    (older page, newer page, slot bytes)."""
    pool = open_direct(path, PAGE, 4) if o_direct else SsdPagePool(path, PAGE, 4)
    with pool:
        older = write_new(pool, 5, block(5, PAGE))
        newer = write_new(pool, 5, block(5, PAGE))
        return older, newer, pool.slot_bytes


def data_of(path: Path, page: int, slot_bytes: int) -> int:
    return HEADER_BYTES + page * slot_bytes + HEADER_BYTES


@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "o_direct"])
def test_a_torn_newest_copy_gives_way_to_the_older_good_one(tmp_path: Path, o_direct: bool) -> None:
    """Of a key found twice, the newest copy whose data verifies is kept and the other invalidated: a newest copy
    torn by a crash (its header landed, half its data did not) used to win by its header alone and have the good
    older copy zeroed, so the block became a miss."""
    path = tmp_path / "pool"
    older, newer, slot_bytes = same_key_twice(path, o_direct)
    overwrite(path, data_of(path, newer, slot_bytes) + PAGE // 2, bytes(PAGE // 2))
    for _ in range(2):  # and the choice lasts: the torn copy's header was zeroed
        with open_direct(path, PAGE, 4) if o_direct else SsdPagePool(path, PAGE, 4) as pool:
            assert [(found.page, found.key, found.generation) for found in pool.recovered] == [(older, 5, 1)]
            assert bytes(pool.read(older, PAGE, key=BlockKey(5))) == block(5, PAGE)
            assert not pool.allocator.is_allocated(newer)
    assert read_file(path, HEADER_BYTES + newer * slot_bytes, 4) == bytes(4)


def test_of_two_good_copies_the_newest_wins_and_of_two_torn_neither_comes_back(tmp_path: Path) -> None:
    """Both copies good: the newest is kept (as before). Both torn: neither is adopted, both are invalidated."""
    path = tmp_path / "pool"
    older, newer, slot_bytes = same_key_twice(path, o_direct=False)
    with SsdPagePool(path, PAGE, 4) as pool:
        assert [(found.page, found.generation) for found in pool.recovered] == [(newer, 2)]
    path.unlink()
    older, newer, slot_bytes = same_key_twice(path, o_direct=False)
    for page in (older, newer):
        overwrite(path, data_of(path, page, slot_bytes), b"torn")
    with SsdPagePool(path, PAGE, 4) as pool:
        assert pool.recovered == () and pool.num_free == 4
    for page in (older, newer):
        assert read_file(path, HEADER_BYTES + page * slot_bytes, 4) == bytes(4)
