"""Tests of mooncake.cache.ssd: checksummed pages in a preallocated file, recovered after a crash.

Examples cover the edge contracts (geometry, label and format errors, out of
space, disk errors naming file, page and block, O_DIRECT, the fsync policy) and the damage a crash or a bad disk leaves behind
(flipped data or header bytes, torn and truncated pages). A property drives a
pool through random writes, frees and reopens against a model of the live
pages: after every reopen the recovered pages are exactly the newest live page
of each key, each reading back its exact bytes.
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake.cache import ssd
from mooncake.cache.pool import ALIGNMENT_BYTES, aligned_buffer
from mooncake.cache.ssd import HEADER_BYTES, RecoveredPage, SsdPagePool
from mooncake.errors import CapacityError, ConfigError, DiskError, IntegrityError, InvalidRequestError, MooncakeError
from mooncake.types import BlockKey, Tier
from tests.cache.damage import flip_byte, overwrite, read_file
from tests.strategies import page_pool_ops, page_sizes

HEADER_FIELDS_BYTES = 72  # magic, version, length, checksum, generation, key (32) and the header's own checksum
_example_ids = itertools.count()


def header_offset(pool: SsdPagePool, page: int) -> int:
    """Where `page`'s slot (its header) starts in the file: after the 4 KiB superblock."""
    return HEADER_BYTES + page * pool.slot_bytes


def data_offset(pool: SsdPagePool, page: int) -> int:
    return header_offset(pool, page) + HEADER_BYTES


def write_new(pool: SsdPagePool, key: int, data: bytes) -> int:
    page = pool.try_allocate()
    assert page is not None
    pool.write(page, data, key=BlockKey(key))
    return page


def recovered_by_key(pool: SsdPagePool) -> dict[BlockKey, RecoveredPage]:
    found = {page.key: page for page in pool.recovered}
    assert len(found) == len(pool.recovered), "a key recovered twice"
    return found


def block(key: int, length: int) -> bytes:
    """Deterministic, key-dependent bytes."""
    return (xxhash.xxh3_64_digest(key.to_bytes(8, "little")) * (length // 8 + 1))[:length]


def open_direct(path: Path, page_bytes: int, num_pages: int) -> SsdPagePool:
    """An O_DIRECT pool, or a skip where the file system refuses O_DIRECT (tmpfs, some overlays)."""
    try:
        return SsdPagePool(path, page_bytes, num_pages, o_direct=True)
    except ConfigError as error:
        cause = error.__cause__
        if isinstance(cause, OSError) and cause.errno == errno.EINVAL:
            pytest.skip(f"the file system under {path.parent} refuses O_DIRECT (EINVAL)")
        raise


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("page_bytes", [1, 100, 4096, 5000, 3 * 4096])
def test_round_trip(tmp_path: Path, page_bytes: int) -> None:
    """Pages of every size up to a full page read back exactly, as copies verified against the header."""
    with SsdPagePool(tmp_path / "pool", page_bytes, 4) as pool:
        assert (pool.tier, pool.holds_bytes, pool.zero_copy, pool.num_free) == (Tier.SSD, True, False, 4)
        assert pool.recovered == ()
        assert pool.capacity_bytes == 4 * page_bytes
        payloads = [block(1, page_bytes), block(2, page_bytes // 2), b""]
        pages = [write_new(pool, key, data) for key, data in enumerate(payloads)]
        for page, data in zip(pages, payloads, strict=True):
            view = pool.read(page, len(data))
            assert bytes(view) == data
            out = bytearray(page_bytes)
            assert pool.read_into(page, len(data), out) == xxhash.xxh3_64_intdigest(data)
            assert bytes(out[: len(data)]) == data
        assert os.path.getsize(pool.path) == pool.file_bytes == HEADER_BYTES + 4 * pool.slot_bytes
        assert pool.slot_bytes % ALIGNMENT_BYTES == 0


def test_round_trip_of_numpy_arrays(tmp_path: Path) -> None:
    """An array is stored as its bytes, whatever its dtype and shape."""
    with SsdPagePool(tmp_path / "pool", 4096, 2) as pool:
        array = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
        page = write_new(pool, 1, array)  # type: ignore[arg-type]
        back = np.frombuffer(pool.read(page, array.nbytes), dtype=np.float32).reshape(array.shape)
        np.testing.assert_array_equal(back, array)


def test_read_returns_a_copy(tmp_path: Path) -> None:
    """What read returns does not change when the page is rewritten."""
    with SsdPagePool(tmp_path / "pool", 64, 1) as pool:
        page = write_new(pool, 1, b"a" * 64)
        first = pool.read(page, 64)
        pool.write(page, b"b" * 64, key=BlockKey(1))
        assert bytes(first) == b"a" * 64
        assert bytes(pool.read(page, 64)) == b"b" * 64


def test_contract_errors(tmp_path: Path) -> None:
    """Unallocated pages, None data, oversized data, bad keys and short buffers raise, naming the values."""
    with SsdPagePool(tmp_path / "pool", 100, 2) as pool:
        page = write_new(pool, 1, b"x" * 10)
        for bad in (1, 2, -1):
            with pytest.raises(InvalidRequestError, match="not allocated"):
                pool.write(bad, b"x", key=BlockKey(1))
            with pytest.raises(InvalidRequestError, match="not allocated"):
                pool.read(bad, 1)
        with pytest.raises(InvalidRequestError, match="must not be None"):
            pool.write(page, None, key=BlockKey(1))
        with pytest.raises(CapacityError, match="101 bytes do not fit a page of 100 bytes"):
            pool.write(page, b"x" * 101, key=BlockKey(1))
        for key in (-1, 1 << 256, True, "k"):
            with pytest.raises(InvalidRequestError, match=r"\[0, 2\*\*256\)"):
                pool.write(page, b"y", key=key)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="buffer of 5 bytes cannot take 10"):
            pool.read_into(page, 10, bytearray(5))
        assert bytes(pool.read(page, 10)) == b"x" * 10  # the failed writes changed nothing
        pool.free(page)
        with pytest.raises(InvalidRequestError):
            pool.free(page)


def test_read_with_the_wrong_length_raises_integrity_error(tmp_path: Path) -> None:
    """Asking for another length than the page holds raises IntegrityError naming both."""
    with SsdPagePool(tmp_path / "pool", 100, 1) as pool:
        page = write_new(pool, 1, b"x" * 10)
        with pytest.raises(IntegrityError, match="holds 10 bytes, expected 11"):
            pool.read(page, 11)


@pytest.mark.parametrize("length", [-1, 101, 2.0, "10", True])
def test_a_length_that_is_no_byte_count_of_a_page_is_refused_by_name(tmp_path: Path, length: object) -> None:
    """read and read_into of a length that is no integer in [0, page_bytes] raise the InvalidRequestError the
    DRAM pool raises, naming it (a negative one was a bare ValueError, a float a TypeError, one past the page
    a read into the next slot); the page still reads back."""
    with SsdPagePool(tmp_path / "pool", 100, 2) as pool:
        page = write_new(pool, 1, b"x" * 10)
        with pytest.raises(InvalidRequestError, match=r"length must be an integer in \[0, 100\], got"):
            pool.read(page, length)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match=r"length must be an integer in \[0, 100\], got"):
            pool.read_into(page, length, bytearray(8192))  # type: ignore[arg-type]
        assert bytes(pool.read(page, 10)) == b"x" * 10


def test_a_bad_checksum_or_key_is_refused_before_the_write_changes_anything(tmp_path: Path) -> None:
    """A checksum outside [0, 2**64) (or no integer) is the InvalidRequestError the cache raises for it, not a
    struct.error; neither it nor a bad key uses up a generation or touches the page: the next write is
    generation 2, and the page keeps its bytes."""
    path = tmp_path / "pool"
    with SsdPagePool(path, 100, 2) as pool:
        first = write_new(pool, 1, b"a" * 10)  # generation 1
        second = pool.try_allocate()
        assert second is not None
        for checksum in (-1, 1 << 64, 1.5, "0"):
            with pytest.raises(InvalidRequestError, match=r"checksum \(an XXH3-64 value\) must be an integer in"):
                pool.write(second, b"b" * 10, key=BlockKey(2), checksum=checksum)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="key"):
            pool.write(second, b"b" * 10, key=-1)  # type: ignore[arg-type]
        pool.write(second, b"b" * 10, key=BlockKey(2))
        assert bytes(pool.read(first, 10)) == b"a" * 10
    with SsdPagePool(path, 100, 2) as pool:
        assert [(found.key, found.generation) for found in pool.recovered] == [(1, 1), (2, 2)]


def test_a_read_naming_another_key_than_the_page_holds_raises_integrity_error(tmp_path: Path) -> None:
    """A read that names the block it expects (`key`) raises IntegrityError naming both where the page holds
    another, valid block: a caller whose map of blocks to pages went wrong never gets another block's bytes."""
    with SsdPagePool(tmp_path / "pool", 100, 1) as pool:
        page = write_new(pool, 7, b"x" * 10)
        with pytest.raises(IntegrityError, match="holds block 0x7, not block 0x8 as asked"):
            pool.read(page, 10, key=BlockKey(8))
        with pytest.raises(IntegrityError, match="not block 0x8"):
            pool.read_into(page, 10, bytearray(10), key=BlockKey(8))
        assert bytes(pool.read(page, 10, key=BlockKey(7))) == b"x" * 10


def test_reading_a_page_never_written_raises_integrity_error(tmp_path: Path) -> None:
    """An allocated page with no data yet has no valid header: read raises IntegrityError."""
    with SsdPagePool(tmp_path / "pool", 100, 1) as pool:
        page = pool.try_allocate()
        assert page is not None
        with pytest.raises(IntegrityError, match="invalid page header"):
            pool.read(page, 0)


def test_a_wrong_caller_checksum_is_caught_on_read(tmp_path: Path) -> None:
    """A checksum passed to write is stored as given; one that does not match the data fails on read."""
    with SsdPagePool(tmp_path / "pool", 64, 2) as pool:
        good = pool.try_allocate()
        bad = pool.try_allocate()
        assert good is not None and bad is not None
        pool.write(good, b"data", key=BlockKey(1), checksum=xxhash.xxh3_64_intdigest(b"data"))
        pool.write(bad, b"data", key=BlockKey(2), checksum=12345)
        assert bytes(pool.read(good, 4)) == b"data"
        with pytest.raises(IntegrityError, match="checksum"):
            pool.read(bad, 4)


# --------------------------------------------------------------------------- reopening


def test_reopen_recovers_every_page_written(tmp_path: Path) -> None:
    """Closing and reopening finds every written page with its key, length and checksum; freed pages stay gone."""
    path = tmp_path / "pool"
    with SsdPagePool(path, 4096, 8) as pool:
        pages = {key: write_new(pool, key, block(key, 500 * key)) for key in range(1, 7)}
        pool.free(pages[3])
        pool.free(pages[5])
        del pages[3], pages[5]
    with SsdPagePool(path, 4096, 8) as pool:
        found = recovered_by_key(pool)
        assert set(found) == set(pages)
        for key, page in pages.items():
            expected = block(key, 500 * key)
            assert (found[key].page, found[key].length) == (page, len(expected))
            assert found[key].checksum == xxhash.xxh3_64_intdigest(expected)
            assert bytes(pool.read(page, len(expected))) == expected
            assert pool.allocator.is_allocated(page)
        assert pool.num_free == 8 - len(pages)
        assert [p.page for p in pool.recovered] == sorted(pages.values())
        pool.allocator.check_invariants()
        new = write_new(pool, 99, b"after reopen")  # the freed pages are free again
        assert new not in pages.values()


def test_same_key_in_two_pages_comes_back_once_the_newest(tmp_path: Path) -> None:
    """A key in two pages recovers once, the newer copy; the older never comes back, even once the newer is freed."""
    path = tmp_path / "pool"
    with SsdPagePool(path, 64, 4) as pool:
        old = write_new(pool, 7, b"old copy")
        write_new(pool, 8, b"other")
        new = write_new(pool, 7, b"new copy!")
    for _ in range(2):
        with SsdPagePool(path, 64, 4) as pool:
            found = recovered_by_key(pool)
            assert set(found) == {7, 8}
            assert (found[BlockKey(7)].page, found[BlockKey(7)].length) == (new, 9)
            assert bytes(pool.read(new, 9)) == b"new copy!"
            assert not pool.allocator.is_allocated(old)
            assert found[BlockKey(7)].generation > found[BlockKey(8)].generation
    with SsdPagePool(path, 64, 4) as pool:
        pool.free(new)  # the newest copy goes: the stale one must not come back in its place
    with SsdPagePool(path, 64, 4) as pool:
        assert set(recovered_by_key(pool)) == {8}


def test_generations_keep_rising_across_reopens(tmp_path: Path) -> None:
    """A key rewritten after a reopen beats its copy from before, however often that copy was rewritten."""
    path = tmp_path / "pool"
    with SsdPagePool(path, 64, 4) as pool:
        old = write_new(pool, 5, b"before")
        for _ in range(4):
            pool.write(old, b"before", key=BlockKey(5))  # generation 5 on disk
    with SsdPagePool(path, 64, 4) as pool:
        new = write_new(pool, 5, b"after!!")
        assert new != old
    with SsdPagePool(path, 64, 4) as pool:
        assert [(p.page, p.key, p.length) for p in pool.recovered] == [(new, 5, 7)]
        assert pool.recovered[0].generation == 6


@given(page_bytes=page_sizes, num_pages=st.integers(1, 6), data=st.data())
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_reopen_recovers_exactly_the_live_pages(
    tmp_path: Path, page_bytes: int, num_pages: int, data: st.DataObject
) -> None:
    """After random writes, frees and reopens, each reopen recovers exactly the newest live page of each key."""
    path = tmp_path / f"pool-{next(_example_ids)}"
    pool = SsdPagePool(path, page_bytes, num_pages)
    allocated: set[int] = set()
    written: dict[int, tuple[BlockKey, bytes, int]] = {}  # page -> (key, data, write number)
    writes = itertools.count()
    try:
        for op in data.draw(page_pool_ops(page_bytes=page_bytes)):
            if op[0] == "allocate":
                page = pool.try_allocate()
                assert (page is None) == (len(allocated) == num_pages)
                if page is not None:
                    allocated.add(page)
            elif op[0] == "write" and allocated:
                page = sorted(allocated)[op[1] % len(allocated)]  # type: ignore[operator]
                key, payload = op[2], op[3]
                pool.write(page, payload, key=key)  # type: ignore[arg-type]
                written[page] = (key, payload, next(writes))  # type: ignore[assignment]
            elif op[0] == "free" and allocated:
                page = sorted(allocated)[op[1] % len(allocated)]  # type: ignore[operator]
                pool.free(page)
                allocated.remove(page)
                written.pop(page, None)
            elif op[0] == "reopen":
                pool.close()
                newest: dict[BlockKey, int] = {}
                for page, (key, _, number) in written.items():
                    if key not in newest or number > written[newest[key]][2]:
                        newest[key] = page
                pool = SsdPagePool(path, page_bytes, num_pages)
                expected = {
                    (page, key, len(written[page][1]), xxhash.xxh3_64_intdigest(written[page][1]))
                    for key, page in newest.items()
                }
                assert {(p.page, p.key, p.length, p.checksum) for p in pool.recovered} == expected
                written = {page: written[page] for page in newest.values()}
                allocated = set(written)
            for page, (_, payload, _) in written.items():
                assert bytes(pool.read(page, len(payload))) == payload
            assert pool.num_free == num_pages - len(allocated)
            pool.allocator.check_invariants()
    finally:
        pool.close()
        path.unlink()


def test_page_size_mismatch_on_reopen_names_both_geometries(tmp_path: Path) -> None:
    """Reopening with another geometry raises ConfigError naming both and leaves the file as it was."""
    path = tmp_path / "pool"
    with SsdPagePool(path, 4096, 4) as pool:
        write_new(pool, 1, b"keep me")
    before = path.read_bytes()
    with pytest.raises(ConfigError, match=r"holds 4 pages of 4096 bytes; asked for 4 pages of 8192 bytes"):
        SsdPagePool(path, 8192, 4)
    with pytest.raises(ConfigError, match=r"holds 4 pages of 4096 bytes; asked for 5 pages of 4096 bytes"):
        SsdPagePool(path, 4096, 5)
    assert path.read_bytes() == before
    with SsdPagePool(path, 4096, 4) as pool:
        assert [(p.key, p.length) for p in pool.recovered] == [(1, 7)]


@pytest.mark.parametrize(
    "content",
    [b"not a pool", os.urandom(3 * 4096), b"\0" * 8192, b"MCSSD\0v1" + b"\xff" * 4088],
    ids=["short", "random", "zeros", "bad-superblock-checksum"],
)
def test_a_file_that_is_not_a_pool_file_raises_config_error(tmp_path: Path, content: bytes) -> None:
    """Opening a file that is not a pool file raises ConfigError naming it, and leaves it untouched."""
    path = tmp_path / "foreign.bin"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=r"foreign\.bin is not a mooncake SSD pool file"):
        SsdPagePool(path, 4096, 2)
    assert path.read_bytes() == content


def test_a_flipped_superblock_byte_makes_the_file_foreign(tmp_path: Path) -> None:
    """A pool file whose superblock is damaged is refused with ConfigError, not misread."""
    path = tmp_path / "pool"
    SsdPagePool(path, 4096, 2).close()
    flip_byte(path, 12)  # inside page_bytes
    with pytest.raises(ConfigError, match="bad superblock"):
        SsdPagePool(path, 4096, 2)


def test_an_empty_existing_file_becomes_a_new_pool(tmp_path: Path) -> None:
    """An existing empty file is taken as a new pool and preallocated."""
    path = tmp_path / "pool"
    path.touch()
    with SsdPagePool(path, 4096, 3) as pool:
        assert pool.recovered == ()
        assert path.stat().st_size == pool.file_bytes


@pytest.mark.parametrize("num_pages", [2**40, 2**42, 2**60], ids=["8-PiB", "32-PiB", "beyond-off_t"])
def test_out_of_space_raises_capacity_error_and_leaves_no_file(tmp_path: Path, num_pages: int) -> None:
    """A file larger than the file system allows raises CapacityError naming the size and leaves no file."""
    path = tmp_path / "huge.pool"
    with pytest.raises(CapacityError, match=r"cannot preallocate [\d,]+ bytes for .*huge\.pool"):
        SsdPagePool(path, 4096, num_pages)
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("error_number", [errno.ENOSPC, errno.EFBIG, errno.EDQUOT], ids=errno.errorcode.get)
def test_a_full_file_system_raises_capacity_error_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error_number: int
) -> None:
    """Preallocation failing for lack of space (injected) raises CapacityError and removes the new file."""

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(error_number, os.strerror(error_number))

    monkeypatch.setattr(os, "posix_fallocate", full)
    path = tmp_path / "pool"
    with pytest.raises(
        CapacityError, match=rf"cannot preallocate 20,480 bytes for .*pool: {os.strerror(error_number)}"
    ):
        SsdPagePool(path, 4096, 2)
    assert not path.exists()


def test_another_preallocation_failure_propagates_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A preallocation failure that is not about space (EIO) propagates as OSError; no file is left."""

    def broken(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "posix_fallocate", broken)
    path = tmp_path / "pool"
    with pytest.raises(OSError, match=os.strerror(errno.EIO)):
        SsdPagePool(path, 4096, 2)
    assert not path.exists()


def test_a_failure_never_removes_a_file_that_was_there_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty file (or a device: /dev/null reads as one) the pool cannot set up is left where it was: only a
    file the pool created is removed when it fails."""

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    path = tmp_path / "pool"
    path.touch()
    with pytest.raises(CapacityError):
        SsdPagePool(path, 4096, 2)
    assert path.exists()


@pytest.mark.parametrize("error_number", [errno.ENOSPC, errno.EFBIG, errno.EDQUOT], ids=errno.errorcode.get)
@pytest.mark.parametrize("failing", ["pwrite", "fsync"])
def test_a_full_file_system_refusing_the_superblock_raises_capacity_error_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error_number: int, failing: str
) -> None:
    """A new file's superblock is written (and synced) before the file is preallocated, so on a full disk that
    write is the first to fail: CapacityError as for the preallocation (it used to be a bare OSError), and the
    new file is removed."""

    def full(*_args: Any) -> None:
        raise OSError(error_number, os.strerror(error_number))

    monkeypatch.setattr(os, failing, full)
    path = tmp_path / "pool"
    with pytest.raises(
        CapacityError, match=rf"cannot write the superblock .* for .*pool: {os.strerror(error_number)}"
    ) as raised:
        SsdPagePool(path, 4096, 2)
    assert isinstance(raised.value.__cause__, OSError) and raised.value.__cause__.errno == error_number
    assert list(tmp_path.iterdir()) == []


def test_invalid_options_raise_config_error(tmp_path: Path) -> None:
    """Bad geometry or fsync_every raise ConfigError before any file is made."""
    path = tmp_path / "pool"
    for page_bytes, num_pages in [(0, 1), (4096, 0), (4096, True)]:
        with pytest.raises(ConfigError, match="must be a positive integer"):
            SsdPagePool(path, page_bytes, num_pages)
    for fsync_every in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="fsync_every"):
            SsdPagePool(path, 4096, 1, fsync_every=fsync_every)  # type: ignore[arg-type]
    for o_direct in ("no", 1, None):
        with pytest.raises(ConfigError, match="o_direct must be True or False"):
            SsdPagePool(path, 4096, 1, o_direct=o_direct)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cannot open SSD pool file"):
        SsdPagePool(tmp_path / "missing-dir" / "pool", 4096, 1)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- O_DIRECT and fsync


@pytest.mark.parametrize("page_bytes", [100, 4096, 6000])
def test_o_direct_round_trip_and_reopen(tmp_path: Path, page_bytes: int) -> None:
    """With O_DIRECT, pages of any length round-trip, survive a reopen, and corruption is still caught."""
    path = tmp_path / "pool"
    payloads = {key: block(key, length) for key, length in [(1, page_bytes), (2, page_bytes // 3), (3, 1), (4, 0)]}
    with open_direct(path, page_bytes, 6) as pool:
        pages = {key: write_new(pool, key, data) for key, data in payloads.items()}
        for key, data in payloads.items():
            assert bytes(pool.read(pages[key], len(data))) == data
        out = np.zeros(2 * 4096 + ALIGNMENT_BYTES, dtype=np.uint8)
        aligned = out[-out.ctypes.data % ALIGNMENT_BYTES :][: 2 * 4096]
        assert pool.read_into(pages[2], len(payloads[2]), aligned) == xxhash.xxh3_64_intdigest(payloads[2])
        assert aligned[: len(payloads[2])].tobytes() == payloads[2]
        pool.free(pages[3])
    flip_byte(path, data_offset(pool, pages[1]))
    with open_direct(path, page_bytes, 6) as pool:
        assert {p.key for p in pool.recovered} == {1, 2, 4}
        assert bytes(pool.read(pages[2], len(payloads[2]))) == payloads[2]
        assert bytes(pool.read(pages[4], 0)) == b""
        with pytest.raises(IntegrityError, match="checksum"):
            pool.read(pages[1], page_bytes)


@pytest.mark.parametrize(("fsync_every", "expected_syncs"), [(0, 0), (1, 7), (3, 2), (7, 1), (8, 0)])
def test_fsync_every_is_honoured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync_every: int, expected_syncs: int
) -> None:
    """fdatasync runs once per fsync_every page writes (never with 0); flush syncs now and restarts the count."""
    calls: list[int] = []
    real = os.fdatasync

    def counting(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", counting)
    with SsdPagePool(tmp_path / "pool", 64, 8, fsync_every=fsync_every) as pool:
        for key in range(7):
            write_new(pool, key, b"x" * key)
        pool.free(0)  # frees are not page writes
        assert len(calls) == expected_syncs
        pool.flush()
        assert len(calls) == expected_syncs + 1
        if fsync_every:
            for i in range(fsync_every - 1):
                pool.write(1 + i % 6, b"again", key=BlockKey(i))
            assert len(calls) == expected_syncs + 1, "flush did not restart the count"
            pool.write(1, b"last", key=BlockKey(1))
            assert len(calls) == expected_syncs + 2


# --------------------------------------------------------------------------- labels

BF16 = "llama3-8b@seed=0/16 tokens/kv bfloat16 [layers, k|v, tokens, width]"
FP16 = "llama3-8b@seed=0/16 tokens/kv float16 [layers, k|v, tokens, width]"


def test_a_file_written_under_another_label_is_refused_naming_both(tmp_path: Path) -> None:
    """Pages written for one meaning of their bytes (bf16 KV) are refused by a pool of another (fp16 KV of the same
    model and page size, so the same keys and geometry): ConfigError naming the file and both labels, the file
    untouched (it used to be adopted, its bf16 bytes served as fp16 and announced as stored). The same label
    recovers the pages."""
    path = tmp_path / "kv.pool"
    with SsdPagePool(path, 4096, 4, label=BF16) as pool:
        page = write_new(pool, 0xABC, block(0xABC, 4096))
    before = path.read_bytes()
    with pytest.raises(ConfigError) as raised:
        SsdPagePool(path, 4096, 4, label=FP16)
    assert f"{path} holds pages labelled {BF16!r}, but this pool is labelled {FP16!r}" in str(raised.value)
    with pytest.raises(ConfigError, match="labelled ''"):
        SsdPagePool(path, 4096, 4)  # the default label is a label too
    assert path.read_bytes() == before
    with SsdPagePool(path, 4096, 4, label=BF16) as pool:
        assert [(p.page, p.key) for p in pool.recovered] == [(page, 0xABC)]
        assert bytes(pool.read(page, 4096)) == block(0xABC, 4096)


@pytest.mark.parametrize("label", ["", "x", "ü" * (ssd.MAX_LABEL_BYTES // 2)], ids=["empty", "short", "longest"])
def test_a_label_is_kept_checksummed_in_the_superblock(tmp_path: Path, label: str) -> None:
    """A label of any length up to the limit comes back from the superblock, and a flipped byte of it makes the
    file foreign, not a pool of another label. A reader of format version 1 (which finds the superblock's
    checksum right after the geometry) refuses the file instead of ignoring its label."""
    path = tmp_path / "pool"
    SsdPagePool(path, 4096, 2, label=label).close()
    SsdPagePool(path, 4096, 2, label=label).close()
    raw = read_file(path, 0, 36)
    assert xxhash.xxh3_64_intdigest(raw[:28]) != int.from_bytes(raw[28:36], "little")
    if label:
        flip_byte(path, 32)  # the label's first byte
        with pytest.raises(ConfigError, match="bad superblock"):
            SsdPagePool(path, 4096, 2, label=label)


def write_version_1_superblock(path: Path, page_bytes: int, num_pages: int) -> None:
    """Give the pool file at `path` the superblock of format version 1 (before labels): magic, version, geometry,
    and the XXH3 of those 28 bytes; the rest of its 4 KiB zero."""
    fields = (
        b"MCSSD\0v1" + (1).to_bytes(4, "little") + page_bytes.to_bytes(8, "little") + num_pages.to_bytes(8, "little")
    )
    superblock = fields + xxhash.xxh3_64_intdigest(fields).to_bytes(8, "little")
    overwrite(path, 0, superblock.ljust(HEADER_BYTES, b"\0"))


def test_a_file_of_format_version_1_reads_as_label_empty(tmp_path: Path) -> None:
    """A file written before labels (format version 1) is a pool of label "": opened with the default label it
    recovers its pages as before; opened with another label it is refused, the message saying why."""
    path = tmp_path / "old.pool"
    with SsdPagePool(path, 4096, 3) as pool:
        page = write_new(pool, 7, block(7, 100))
    write_version_1_superblock(path, 4096, 3)
    with pytest.raises(ConfigError, match=r"labelled '' \(format version 1, from before labels\), .* labelled 'x'"):
        SsdPagePool(path, 4096, 3, label="x")
    with SsdPagePool(path, 4096, 3) as pool:
        assert [(p.page, p.key) for p in pool.recovered] == [(page, 7)]
        assert bytes(pool.read(page, 100)) == block(7, 100)


def test_a_superblock_of_an_unknown_version_is_refused(tmp_path: Path) -> None:
    """A superblock of a format version this code does not know (a newer one) is refused by name."""
    path = tmp_path / "pool"
    SsdPagePool(path, 4096, 2).close()
    overwrite(path, 8, (3).to_bytes(4, "little"))
    with pytest.raises(ConfigError, match=r"not a mooncake SSD pool file of a format this version reads \(version 3\)"):
        SsdPagePool(path, 4096, 2)


@pytest.mark.parametrize(
    ("label", "message"),
    [
        (None, "label must be a string, got None"),
        (b"bytes", "label must be a string"),
        ("\udc80", "label must be encodable as UTF-8"),
        ("x" * (ssd.MAX_LABEL_BYTES + 1), f"at most {ssd.MAX_LABEL_BYTES} bytes of UTF-8, got 1025"),
        ("é" * (ssd.MAX_LABEL_BYTES // 2 + 1), "at most 1024 bytes of UTF-8, got 1026"),
    ],
    ids=["none", "bytes", "surrogate", "too-long", "too-long-in-utf-8"],
)
def test_a_label_that_cannot_be_stored_is_refused_before_any_file_is_made(
    tmp_path: Path, label: object, message: str
) -> None:
    """A label that is no string, or does not fit the superblock, raises ConfigError naming it; no file is made."""
    with pytest.raises(ConfigError, match=message):
        SsdPagePool(tmp_path / "pool", 4096, 2, label=label)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- disk errors


def test_verification_errors_name_the_block(tmp_path: Path) -> None:
    """Each way a read fails verification names the file, the page and the block meant to be there (the key this
    pool wrote), so that a log line says which block was lost (they used to name the page alone)."""
    path = tmp_path / "pool"
    with SsdPagePool(path, 4096, 2) as pool:
        page = write_new(pool, 0xABC, block(0xABC, 100))
        where = rf"{path} page {page} \(block 0xabc\)"
        with pytest.raises(IntegrityError, match=rf"{where}: holds 100 bytes, expected 99"):
            pool.read(page, 99)
        flip_byte(path, data_offset(pool, page) + 3)
        with pytest.raises(IntegrityError, match=rf"{where}: checksum"):
            pool.read(page, 100)
        flip_byte(path, header_offset(pool, page) + 5)
        with pytest.raises(IntegrityError, match=rf"{where}: invalid page header"):
            pool.read(page, 100)


@pytest.mark.parametrize("operation", ["write", "free", "read", "flush"])
def test_a_failing_disk_raises_disk_error_naming_file_page_and_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, operation: str
) -> None:
    """An I/O error under a page's write, release, read or sync raises DiskError: a MooncakeError, and an OSError
    with the cause's errno (so `except OSError` still catches it), whose message names the file, the page and
    block (where there is one) and the cause's text, raised from the cause (it used to be the bare OSError)."""
    path = tmp_path / "pool"
    pool = SsdPagePool(path, 4096, 2)
    page = write_new(pool, 0xABC, block(0xABC, 100))
    cause = OSError(errno.EIO, "Input/output error (injected)")

    def refuse(*_args: Any) -> None:
        raise cause

    call = {
        "write": ("pwritev", lambda: pool.write(page, b"again", key=BlockKey(0xABC))),
        "free": ("pwrite", lambda: pool.free(page)),
        "read": ("preadv", lambda: pool.read(page, 100)),
        "flush": ("fdatasync", pool.flush),
    }
    name, action = call[operation]
    monkeypatch.setattr(os, name, refuse)
    with pytest.raises(OSError) as raised:
        action()
    monkeypatch.undo()
    error = raised.value
    assert isinstance(error, MooncakeError) and isinstance(error, DiskError)
    assert error.errno == errno.EIO and error.__cause__ is cause
    where = f"{path}" if operation == "flush" else f"{path} page {page} (block 0xabc)"
    assert where in str(error) and "Input/output error (injected)" in str(error)
    if operation == "free":  # released all the same
        assert not pool.allocator.is_allocated(page)
    pool.close()


# --------------------------------------------------------------------------- damage


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_flipped_data_byte_makes_read_raise_integrity_error(tmp_path: Path, where: str) -> None:
    """A byte flipped in a page's data makes read raise IntegrityError, live and after a reopen."""
    path = tmp_path / "pool"
    length = 5000
    at = {"first": 0, "middle": length // 2, "last": length - 1}[where]
    with SsdPagePool(path, 8192, 3) as pool:
        pages = [write_new(pool, key, block(key, length)) for key in range(3)]
        flip_byte(path, data_offset(pool, pages[1]) + at)
        with pytest.raises(IntegrityError, match=rf"page {pages[1]} \(block 0x1\): checksum"):
            pool.read(pages[1], length)
        with pytest.raises(IntegrityError):
            pool.read_into(pages[1], length, bytearray(length))
    with SsdPagePool(path, 8192, 3) as pool:
        assert {p.key for p in pool.recovered} == {0, 1, 2}  # the header is intact: data is checked on read
        with pytest.raises(IntegrityError, match="checksum"):
            pool.read(pages[1], length)
        for key in (0, 2):
            assert bytes(pool.read(pages[key], length)) == block(key, length)


def test_bytes_past_the_data_are_not_part_of_the_page(tmp_path: Path) -> None:
    """Damage in a slot's padding (past the stored length) changes nothing a reader sees."""
    path = tmp_path / "pool"
    with SsdPagePool(path, 4096, 1) as pool:
        page = write_new(pool, 1, b"short")
        flip_byte(path, data_offset(pool, page) + 100)
        assert bytes(pool.read(page, 5)) == b"short"


@given(offset=st.integers(0, HEADER_FIELDS_BYTES - 1), mask=st.integers(1, 255))
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_damaged_header_makes_the_page_vanish_on_reopen(tmp_path: Path, offset: int, mask: int) -> None:
    """Any damage to a page's header fields makes that page (alone) vanish on reopen."""
    path = tmp_path / f"pool-{next(_example_ids)}"
    try:
        with SsdPagePool(path, 64, 3) as pool:
            pages = [write_new(pool, key, block(key, 10 + key)) for key in range(3)]
            target = header_offset(pool, pages[1]) + offset
        byte = read_file(path, target, 1)[0]
        overwrite(path, target, bytes([byte ^ mask]))
        with SsdPagePool(path, 64, 3) as pool:
            assert sorted((p.page, p.key) for p in pool.recovered) == [(pages[0], 0), (pages[2], 2)]
            assert not pool.allocator.is_allocated(pages[1])
            for key in (0, 2):
                assert bytes(pool.read(pages[key], 10 + key)) == block(key, 10 + key)
            with pytest.raises(InvalidRequestError):
                pool.read(pages[1], 11)
    finally:
        path.unlink()


def test_a_torn_page_raises_integrity_error(tmp_path: Path) -> None:
    """A write torn by a crash (part of the data region overwritten on disk) fails its checksum on read."""
    path = tmp_path / "pool"
    with SsdPagePool(path, 3 * 4096, 2) as pool:
        page = write_new(pool, 1, block(1, 3 * 4096))
        overwrite(path, data_offset(pool, page) + 4096, b"\0" * 4096)  # the middle OS page never landed
        with pytest.raises(IntegrityError, match="checksum"):
            pool.read(page, 3 * 4096)
    with SsdPagePool(path, 3 * 4096, 2) as pool:
        assert [p.page for p in pool.recovered] == [page]
        with pytest.raises(IntegrityError, match="checksum"):
            pool.read(page, 3 * 4096)


def test_a_new_header_over_old_data_raises_integrity_error(tmp_path: Path) -> None:
    """A rewrite whose header landed but whose data did not (old bytes under a new header) is caught."""
    path = tmp_path / "pool"
    with SsdPagePool(path, 4096, 1) as pool:
        page = write_new(pool, 1, block(1, 4096))
        old_data = read_file(path, data_offset(pool, page), 4096)
        pool.write(page, block(2, 4096), key=BlockKey(2))
        overwrite(path, data_offset(pool, page), old_data)
    with SsdPagePool(path, 4096, 1) as pool:
        assert [(p.page, p.key) for p in pool.recovered] == [(page, 2)]
        with pytest.raises(IntegrityError, match="checksum"):
            pool.read(page, 4096)


def test_a_slot_holding_another_keys_page_raises_integrity_error_naming_both(tmp_path: Path) -> None:
    """A slot overwritten with another key's valid page (a misdirected write, another writer) fails the
    read, naming the key found and the key this pool wrote there."""
    path = tmp_path / "pool"
    with SsdPagePool(path, 4096, 2) as pool:
        pages = [write_new(pool, key, block(key, 4096)) for key in (0x11, 0x22)]
        overwrite(path, header_offset(pool, pages[0]), read_file(path, header_offset(pool, pages[1]), pool.slot_bytes))
        with pytest.raises(IntegrityError, match=f"page {pages[0]}: holds block 0x22, but this pool wrote block 0x11"):
            pool.read(pages[0], 4096)
        assert bytes(pool.read(pages[1], 4096)) == block(0x22, 4096)


def test_one_pool_per_file(tmp_path: Path) -> None:
    """A second pool on a file in use raises ConfigError and leaves the file as it was; it opens once the first closes."""
    path = tmp_path / "pool"
    with SsdPagePool(path, 4096, 2) as pool:
        page = write_new(pool, 7, b"kept")
        with pytest.raises(ConfigError, match="in use by another pool"):
            SsdPagePool(path, 4096, 2)
        assert bytes(pool.read(page, 4)) == b"kept"
    with SsdPagePool(path, 4096, 2) as pool:
        assert [(p.page, p.key) for p in pool.recovered] == [(page, 7)]


def test_a_child_forked_without_exec_holds_the_pool_lock_until_it_exits(tmp_path: Path) -> None:
    """The pool's flock belongs to the open file, which a child forked without exec shares: with the parent's
    pool closed (as a parent killed with SIGKILL leaves it), the file is refused while the child lives, and opens
    once it exits (docs/cache.md, crash safety: the documented caveat, pinned here)."""
    path = tmp_path / "pool"
    pool = SsdPagePool(path, 4096, 2)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: waits for the test to close the pipe (or to die), then exits
        try:
            os.close(write_end)
            os.read(read_end, 1)
        finally:
            os._exit(0)
    os.close(read_end)
    try:
        pool.close()
        with pytest.raises(ConfigError, match="in use by another pool"):
            SsdPagePool(path, 4096, 2)
    finally:
        os.close(write_end)
        os.waitpid(pid, 0)
    SsdPagePool(path, 4096, 2).close()


def test_a_truncated_file_loses_only_the_cut_pages(tmp_path: Path) -> None:
    """A file cut inside a page: that page fails its read, earlier pages read back, later ones are gone."""
    path = tmp_path / "pool"
    with SsdPagePool(path, 4096, 4) as pool:
        pages = [write_new(pool, key, block(key, 4096)) for key in range(4)]
        cut = data_offset(pool, pages[1]) + 1000
    os.truncate(path, cut)
    with SsdPagePool(path, 4096, 4) as pool:
        assert [(p.page, p.key) for p in pool.recovered] == [(pages[0], 0), (pages[1], 1)]
        assert bytes(pool.read(pages[0], 4096)) == block(0, 4096)
        with pytest.raises(IntegrityError, match="checksum"):  # its cut part reads as the zeros preallocated
            pool.read(pages[1], 4096)
        page = write_new(pool, 9, b"past the cut")
        assert bytes(pool.read(page, 12)) == b"past the cut"
        assert os.path.getsize(path) == pool.file_bytes  # preallocated again: no later write meets a full disk


def test_a_pool_file_cut_short_while_it_was_made_opens_as_an_empty_pool(tmp_path: Path) -> None:
    """A process killed while it preallocated a new pool file leaves the superblock it wrote first and little
    else: the next pool opens it (not 'not a mooncake SSD pool file'), empty, preallocated whole, and serves."""
    path = tmp_path / "pool"
    with SsdPagePool(path, 4096, 4) as pool:
        file_bytes = pool.file_bytes
    os.truncate(path, HEADER_BYTES)  # as the kill left it: the superblock, then nothing
    with SsdPagePool(path, 4096, 4) as pool:
        assert pool.recovered == () and os.path.getsize(path) == file_bytes
        page = write_new(pool, 3, block(3, 4096))
        assert bytes(pool.read(page, 4096)) == block(3, 4096)


# --------------------------------------------------------------------------- chunked reads


@pytest.mark.parametrize("o_direct", [False, True])
@given(
    length=st.integers(0, 6 * 4096),
    chunk_pages=st.integers(1, 3),
    damage=st.one_of(st.none(), st.integers(0, 6 * 4096 - 1)),
)
@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_page_read_in_chunks_is_the_page_read_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, o_direct: bool, length: int, chunk_pages: int, damage: int | None
) -> None:
    """Large pages are read and hashed chunk by chunk (`READ_CHUNK_BYTES`, shrunk here so that small pages
    take that path): the bytes and checksum are those of a whole read, and a byte flipped anywhere in the
    data, in any chunk, still fails the checksum; one flipped past the data changes nothing."""
    monkeypatch.setattr(ssd, "READ_CHUNK_BYTES", chunk_pages * 4096)
    path = tmp_path / f"pool-{next(_example_ids)}"
    try:
        with open_direct(path, 6 * 4096, 1) if o_direct else SsdPagePool(path, 6 * 4096, 1) as pool:
            data = block(length, length)
            page = write_new(pool, 1, data)
            if damage is not None:
                flip_byte(path, data_offset(pool, page) + damage)
            if damage is not None and damage < length:
                with pytest.raises(IntegrityError, match="checksum"):
                    pool.read(page, length)
            else:
                assert bytes(pool.read(page, length)) == data
                out = aligned_buffer(6 * 4096)
                assert pool.read_into(page, length, out) == xxhash.xxh3_64_intdigest(data)
                assert out[:length].tobytes() == data
    finally:
        path.unlink(missing_ok=True)


def test_a_file_cut_inside_a_later_chunk_is_a_short_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A page whose file ends inside its second chunk fails with the byte where the read came up short."""
    monkeypatch.setattr(ssd, "READ_CHUNK_BYTES", 4096)
    path = tmp_path / "pool"
    with SsdPagePool(path, 4 * 4096, 1) as pool:
        page = write_new(pool, 1, block(1, 4 * 4096))
        os.truncate(path, data_offset(pool, page) + 4096 + 100)
        with pytest.raises(IntegrityError, match="short read at byte 4096"):
            pool.read(page, 4 * 4096)


# --------------------------------------------------------------------------- threads


def test_concurrent_reads_of_good_pages_never_raise(tmp_path: Path) -> None:
    """Reader threads reading different good pages at once each get their bytes, never IntegrityError."""
    with SsdPagePool(tmp_path / "pool", 4096, 8) as pool:
        pages = [write_new(pool, key, block(key, 100 + 10 * key)) for key in range(8)]
        errors: list[BaseException] = []
        stop = threading.Event()

        def reader(start: int) -> None:
            for i in range(5_000):
                if stop.is_set():
                    return
                key = (start + i) % 8
                try:
                    assert bytes(pool.read(pages[key], 100 + 10 * key)) == block(key, 100 + 10 * key)
                except BaseException as error:
                    errors.append(error)
                    stop.set()

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in threads)
        assert errors == [], f"{len(errors)} reads failed, first: {errors[0]!r}"


def test_a_writer_freeing_pages_beside_readers_leaves_a_recoverable_file(tmp_path: Path) -> None:
    """A writer thread writing and freeing pages while readers read: no read fails, and a reopen finds
    exactly the readers' pages (a freed slot never takes another page's header)."""
    path = tmp_path / "pool"
    stable_keys = range(100, 108)
    with SsdPagePool(path, 4096, 16) as pool:
        churn = [pool.try_allocate() for _ in range(8)]  # the low pages: a stray header there would win on reopen
        for page in churn:
            pool.free(page)  # type: ignore[arg-type]
        stable = {key: write_new(pool, key, block(key, 200)) for key in stable_keys}
        errors: list[BaseException] = []
        done = threading.Event()

        def writer() -> None:
            try:
                for i in range(2_000):
                    page = write_new(pool, i, block(i, 300))
                    pool.free(page)
            except BaseException as error:
                errors.append(error)
            finally:
                done.set()

        def reader() -> None:
            while not done.is_set():
                for key, page in stable.items():
                    try:
                        assert bytes(pool.read(page, 200)) == block(key, 200)
                    except BaseException as error:
                        errors.append(error)
                        return

        threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in threads)
        assert errors == [], f"{len(errors)} failures, first: {errors[0]!r}"
    with SsdPagePool(path, 4096, 16) as pool:
        assert sorted((p.key, p.page) for p in pool.recovered) == sorted(stable.items())
        for key, page in stable.items():
            assert bytes(pool.read(page, 200)) == block(key, 200)


def test_recovered_pages_are_records(tmp_path: Path) -> None:
    """RecoveredPage is a frozen value: page, key, length, checksum, generation."""
    path = tmp_path / "pool"
    with SsdPagePool(path, 64, 1) as pool:
        write_new(pool, 3, b"abc")
    with SsdPagePool(path, 64, 1) as pool:
        (found,) = pool.recovered
        assert found == RecoveredPage(
            page=0, key=BlockKey(3), length=3, checksum=xxhash.xxh3_64_intdigest(b"abc"), generation=1
        )
        with pytest.raises(AttributeError):
            found.page = 1  # type: ignore[misc]
