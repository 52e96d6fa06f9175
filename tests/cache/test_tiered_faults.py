"""Fault tests of the tiered cache: crashes, corruption, bad inputs.

- A writer process killed with SIGKILL in the middle of puts; the SSD tier
  reopened in a new cache serves only blocks that verify, each exactly the
  bytes put for its key.
- Bytes flipped in the SSD file: the block is a miss (as `tiered` documents),
  counted in `stats.corrupt_blocks`, removed with a `BlockRemoved` event, never
  returned; the other blocks still serve.
- Out-of-space and page-size mismatches raise clear errors through the cache's
  construction and `put`.
- A block imported from a peer with a wrong checksum raises IntegrityError and
  stores nothing.
- I/O errors during moves: page writes and page releases failing at any tier of
  a three-tier hierarchy, in any put or get (a state machine), leave every key on
  a page of its own holding its own bytes, and later puts working; also where the
  block a get promotes is found damaged as the victim's demotion fails.
- Any other error in an SSD read (MemoryError, KeyboardInterrupt) leaves the block
  cached: only a failed verification or an unreadable page drops it.
- A disk error under `put`, `remove`, `evict` or `unpin` reaches the caller as a
  DiskError (an OSError) naming the file, page and block; a block dropped as
  corrupt is logged as a warning naming tier, block and reason.

Damaged bytes are found by searching the file for a block's (unique) bytes, so
these tests depend on the file format only through `HEADER_BYTES`.
"""

from __future__ import annotations

import errno
import inspect
import logging
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mooncake.cache.events import BlockRemoved, BlockStored
from mooncake.cache.index import BlockIndex, Holder
from mooncake.cache.pool import DramPagePool
from mooncake.cache.ssd import HEADER_BYTES, SsdPagePool
from mooncake.cache.tiered import TieredCache
from mooncake.errors import CapacityError, ConfigError, DiskError, IntegrityError, MooncakeError
from mooncake.types import BlockKey, InstanceId, Tier
from tests.cache.damage import flip_byte
from tests.strategies import page_payloads

PAGE = 3 * 4096  # several OS pages, so a write can tear between them
SOURCE = InstanceId("node-0")
REPO_ROOT = Path(__file__).resolve().parents[2]
WRITER_TIMEOUT_S = 30.0


def block_bytes(key: int, page_bytes: int) -> bytes:
    """Block `key`'s bytes: its XXH3 digest repeated, 64 to `page_bytes` long; a function of the key alone."""
    seed = xxhash.xxh3_64_digest(key.to_bytes(8, "little"))
    return (seed * (page_bytes // 8 + 1))[: 64 + (key * 7919) % (page_bytes - 63)]


def block(key: int) -> bytes:
    return block_bytes(key, PAGE)


def write_ssd_file(path: Path, keys: list[int], *, num_pages: int = 8) -> None:
    """A closed SSD pool file holding `block(key)` for each key, as a cache that died would leave it."""
    with SsdPagePool(path, PAGE, num_pages) as pool:
        for key in keys:
            page = pool.try_allocate()
            assert page is not None
            pool.write(page, block(key), key=BlockKey(key))


def reopen(path: Path, *, dram_pages: int = 2, ssd_pages: int = 8, **options: Any) -> TieredCache:
    pools = [DramPagePool(PAGE, dram_pages), SsdPagePool(path, PAGE, ssd_pages)]
    return TieredCache(pools, source=SOURCE, **options)


def data_offset(path: Path, key: int) -> int:
    """Where block `key`'s bytes start in the file (found by content: each block's bytes are unique)."""
    content = path.read_bytes()
    offset = content.find(block(key))
    assert offset > 0 and content.find(block(key), offset + 1) == -1, f"block {key} is not in {path} exactly once"
    return offset


# --------------------------------------------------------------------------- 1. SIGKILL mid-put

WRITER_SCRIPT = """
import sys, time
from mooncake.cache.pool import DramPagePool
from mooncake.cache.ssd import SsdPagePool
from mooncake.cache.tiered import TieredCache
from mooncake.types import BlockKey
import xxhash

{block_bytes}

path, page_bytes, dram_pages, ssd_pages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
pools = [DramPagePool(page_bytes, dram_pages)] if dram_pages else []
cache = TieredCache(pools + [SsdPagePool(path, page_bytes, ssd_pages)])
deadline = time.monotonic() + {timeout_s}  # a writer its test failed to kill stops by itself
key = 0
while time.monotonic() < deadline:
    cache.put(BlockKey(key), block_bytes(key, page_bytes))
    key += 1
    print(key, flush=True)
"""


def wait_for_puts(process: subprocess.Popen[bytes], count: int, timeout_s: float, stderr_path: Path) -> int:
    """Read the writer's progress lines until it reports at least `count` puts; the count it reported."""
    assert process.stdout is not None
    deadline = time.monotonic() + timeout_s
    pending = b""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"the writer reported fewer than {count} puts in {timeout_s} s")
        ready, _, _ = select.select([process.stdout], [], [], remaining)
        if not ready:
            continue
        chunk = os.read(process.stdout.fileno(), 1 << 16)
        if not chunk:
            status = process.wait(timeout=5)
            raise AssertionError(f"the writer exited early with {status}: {stderr_path.read_text()[-2000:]}")
        pending += chunk
        lines = pending.split(b"\n")
        pending = lines[-1]
        done = [int(line) for line in lines[:-1] if line]
        if done and done[-1] >= count:
            return done[-1]


@pytest.mark.parametrize("kill_after", [1, 20, 120])
@pytest.mark.parametrize(("dram_pages", "ssd_pages"), [(4, 48), (0, 48)], ids=["dram+ssd", "ssd-only"])
def test_sigkill_mid_put_then_reopen_serves_only_verified_blocks(
    tmp_path: Path, kill_after: int, dram_pages: int, ssd_pages: int
) -> None:
    """After a writer is SIGKILLed mid-put, the reopened SSD tier serves only exact, verified blocks."""
    path = tmp_path / "ssd.pool"
    script = WRITER_SCRIPT.format(block_bytes=inspect.getsource(block_bytes), timeout_s=WRITER_TIMEOUT_S)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    stderr_path = tmp_path / "writer.stderr"
    with open(stderr_path, "wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(script), str(path), str(PAGE), str(dram_pages), str(ssd_pages)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            cwd=tmp_path,
            env=environment,
        )
    try:
        reported = wait_for_puts(process, kill_after, timeout_s=WRITER_TIMEOUT_S, stderr_path=stderr_path)
        os.kill(process.pid, signal.SIGKILL)
        assert process.wait(timeout=10) == -signal.SIGKILL, "the writer was not killed mid-run"
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        assert process.stdout is not None
        process.stdout.close()

    cache = reopen(path, ssd_pages=ssd_pages)
    try:
        ssd = cache.pools[1]
        assert isinstance(ssd, SsdPagePool)
        recovered = [found.key for found in ssd.recovered]
        assert len(set(recovered)) == len(recovered)
        for found in ssd.recovered:  # a valid header names its block's true length
            assert found.length == len(block(found.key)), f"block {found.key}: header length {found.length}"
        events = cache.take_events()
        if recovered:
            assert events == [BlockStored(source=SOURCE, seq=0, keys=tuple(recovered), tier=Tier.SSD)]
        served = []
        for key in recovered:
            data = cache.get(key)
            if data is not None:
                assert bytes(data) == block(key), f"block {key} served wrong bytes"
                served.append(key)
        corrupt = cache.stats.corrupt_blocks
        assert len(served) + corrupt == len(recovered)
        assert corrupt <= 1, "more than the page being written was damaged"
        assert len(served) >= min(reported - dram_pages, ssd_pages) - 1, f"{reported} puts reported"
        cache.check_invariants()
        for key in served:  # still there, still right, wherever they moved
            assert bytes(cache.get(key)) == block(key)
    finally:
        cache.close()


# --------------------------------------------------------------------------- 2. flipped bytes


@pytest.mark.parametrize("promote_after", [0, 1, 3], ids=["no-promotion", "promote-on-first-read", "promote-later"])
@pytest.mark.parametrize("where", ["first", "last"])
def test_flipped_data_bytes_make_the_block_a_reported_miss(tmp_path: Path, promote_after: int, where: str) -> None:
    """A block with flipped bytes is a counted miss, removed with an event, and never served again."""
    path = tmp_path / "ssd.pool"
    keys = [10, 11, 12, 13, 14]
    write_ssd_file(path, keys)
    bad = BlockKey(12)
    flip_byte(path, data_offset(path, bad) + (0 if where == "first" else len(block(bad)) - 1))
    cache = reopen(path, promote_after=promote_after, epoch=3)
    assert [e.keys for e in cache.take_events()] == [tuple(keys)]
    assert bad in cache and cache.tier_of(bad) == Tier.SSD

    assert cache.get(bad) is None
    stats = cache.stats
    assert (stats.corrupt_blocks, stats.misses, stats.hits) == (1, 1, 0)
    assert bad not in cache and cache.tier_of(bad) is None and cache.prefix_match([bad]) == 0
    assert cache.take_events() == [BlockRemoved(source=SOURCE, seq=1, keys=(bad,), tier=Tier.SSD, epoch=3)]
    assert cache.get(bad) is None
    assert (cache.stats.corrupt_blocks, cache.stats.misses) == (1, 2), "a removed block was read again"
    for key in keys:
        if key != bad:
            assert bytes(cache.get(BlockKey(key))) == block(key)
    cache.check_invariants()
    cache.close()

    with SsdPagePool(path, PAGE, 8) as pool:
        assert {found.key for found in pool.recovered} <= set(keys) - {bad}


def test_a_block_found_damaged_as_it_swaps_up_is_a_miss_and_the_victim_still_goes_down(tmp_path: Path) -> None:
    """A full hierarchy: the block a read would promote fails verification, so it is a counted miss and
    dropped, and DRAM's victim, already chosen, is demoted into the page it left; nothing else is lost."""
    path = tmp_path / "ssd.pool"
    cache = reopen(path, dram_pages=2, ssd_pages=2, promote_after=1)
    for key in range(4):
        cache.put(BlockKey(key), block(key))
    assert [cache.tier_of(BlockKey(k)) for k in range(4)] == [Tier.SSD, Tier.SSD, Tier.DRAM, Tier.DRAM]
    flip_byte(path, data_offset(path, 0) + 1)
    assert cache.get(BlockKey(0)) is None
    assert (cache.stats.corrupt_blocks, cache.stats.misses, cache.stats.drops) == (1, 1, 1)
    assert [cache.tier_of(BlockKey(k)) for k in range(4)] == [None, Tier.SSD, Tier.SSD, Tier.DRAM]
    for key in range(1, 4):
        assert bytes(cache.get(BlockKey(key))) == block(key)
    cache.check_invariants()
    cache.close()


class FailingPool(DramPagePool):
    """A host pool whose writes raise OSError once `failing` is set (a device error, a full disk)."""

    failing = False

    def write(self, page: int, data: Any, *, key: BlockKey, checksum: int | None = None) -> None:
        if self.failing:
            raise OSError("injected write failure")
        super().write(page, data, key=key, checksum=checksum)


@pytest.mark.parametrize("failing_tier", [0, 1])
def test_a_write_failing_during_a_promotion_loses_only_the_promoted_block(failing_tier: int) -> None:
    """A full hierarchy promotes a block: the first tier's victim goes into the page the block leaves, and the
    block into the victim's. Where either write fails, the error reaches the reader, the victim stays whole
    (where it was, or where it went), and only the block in flight is dropped, its page given back: the cache
    keeps its invariants and its events still mirror it."""
    pools = [FailingPool(PAGE, 1, tier=Tier.VRAM), FailingPool(PAGE, 1)]
    cache = TieredCache(pools, source=SOURCE, promote_after=1)  # type: ignore[arg-type]
    index = BlockIndex()
    cache.put(BlockKey(1), block(1))
    cache.put(BlockKey(2), block(2))  # 1 goes down
    pools[failing_tier].failing = True
    with pytest.raises(OSError, match="injected"):
        cache.get(BlockKey(1))
    pools[failing_tier].failing = False
    assert cache.tier_of(BlockKey(1)) is None
    assert cache.tier_of(BlockKey(2)) == (Tier.VRAM if failing_tier == 1 else Tier.DRAM)
    assert bytes(cache.get(BlockKey(2))) == block(2)
    cache.check_invariants()
    for event in cache.take_events():
        assert index.apply(event) is None
    assert index.holders(BlockKey(1)) == ()
    assert index.holders(BlockKey(2)) == (Holder(SOURCE, cache.tier_of(BlockKey(2))),)  # type: ignore[arg-type]
    cache.put(BlockKey(3), block(3))  # every page is usable again
    cache.check_invariants()
    cache.close()


@pytest.mark.parametrize("failing", ["pwritev", "pwritev and pwrite"])
@pytest.mark.parametrize("memory_tiers", [1, 2], ids=["dram+ssd", "vram+dram+ssd"])
def test_a_disk_refusing_writes_during_a_demotion_loses_no_page_and_no_eviction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str, memory_tiers: int
) -> None:
    """The SSD file refuses writes (ENOSPC) while a put demotes a victim into it, directly (DRAM, then SSD) or at
    the end of a cascade (VRAM's victim goes to DRAM, whose victim goes to the SSD): the put raises the error,
    every victim stays where it was and evictable (the outer one used to stay out of VRAM's policy, so that no
    later put could evict it), every SSD page is free again (the failed page's release cannot fail with it),
    the invariants hold; once the disk takes writes again, later puts evict and demote as before."""

    def refuse(*_args: Any, **_kwargs: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    memory = (
        [DramPagePool(PAGE, 2)] if memory_tiers == 1 else [DramPagePool(PAGE, 1, tier=Tier.VRAM), DramPagePool(PAGE, 1)]
    )
    cache = TieredCache([*memory, SsdPagePool(tmp_path / "pool", PAGE, 4)])
    ssd = cache.pools[-1]
    cache.put(BlockKey(1), block(1))
    cache.put(BlockKey(2), block(2))
    before = [cache.tier_of(BlockKey(k)) for k in (1, 2)]
    assert before == ([Tier.DRAM, Tier.DRAM] if memory_tiers == 1 else [Tier.DRAM, Tier.VRAM])
    for name in failing.split(" and "):
        monkeypatch.setattr(os, name, refuse)
    with pytest.raises(OSError, match="injected"):
        cache.put(BlockKey(3), block(3))
    monkeypatch.undo()
    assert [cache.tier_of(BlockKey(k)) for k in (1, 2, 3)] == [*before, None]
    assert ssd.num_free == 4
    cache.check_invariants()
    for key in (1, 2):
        assert bytes(cache.get(BlockKey(key))) == block(key)
    for key in range(10, 20):
        assert cache.put(BlockKey(key), block(key)) == memory[0].tier
    assert cache.tier_of(BlockKey(1)) is None and ssd.num_free == 0  # evicted, the SSD used whole
    cache.check_invariants()
    cache.close()


def test_an_ssd_victim_whose_page_cannot_be_released_is_dropped_not_served_as_another_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both tiers full, a put evicts SSD's victim while the SSD refuses the write that releases its page (zeroing
    the header: `SsdPagePool.free` raises, and releases the page all the same). The put completes (a release
    never fails a call: counted in `stats.failed_releases`): the SSD victim is gone (it used to stay cached on
    the released page, and once the next block took that page, a get of it returned that block's bytes); DRAM's
    victim went down into that page; the invariants hold, and later puts and gets work, each block serving its
    own bytes."""
    cache = TieredCache([DramPagePool(PAGE, 2), SsdPagePool(tmp_path / "pool", PAGE, 2)], promote_after=0)
    for key in (1, 2, 3, 4):
        cache.put(BlockKey(key), block(key))
    assert [cache.tier_of(BlockKey(k)) for k in (1, 2, 3, 4)] == [Tier.SSD, Tier.SSD, Tier.DRAM, Tier.DRAM]

    def refuse(*_args: Any, **_kwargs: Any) -> int:
        raise OSError(errno.EIO, "Input/output error (injected)")

    monkeypatch.setattr(os, "pwrite", refuse)  # only a free writes with pwrite (a page goes in with pwritev)
    assert cache.put(BlockKey(5), block(5)) == Tier.DRAM
    monkeypatch.undo()
    assert [cache.tier_of(BlockKey(k)) for k in (1, 2, 3, 4, 5)] == [None, Tier.SSD, Tier.SSD, Tier.DRAM, Tier.DRAM]
    assert cache.pools[1].num_free == 0 and cache.stats.failed_releases == 1
    cache.check_invariants()
    for key in (6, 7, 8):
        cache.put(BlockKey(key), block(key))
    cache.check_invariants()
    assert cache.get(BlockKey(1)) is None
    for key in range(2, 9):
        data = cache.get(BlockKey(key))
        assert data is None or bytes(data) == block(key), f"block {key} served another block's bytes"
    assert sum(cache.get(BlockKey(key)) is not None for key in range(2, 9)) == 4  # both tiers full again
    cache.close()


def test_a_promoted_block_whose_ssd_page_cannot_be_released_lives_on_in_dram(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read promotes a block from the SSD into a DRAM page, and releasing its SSD page fails (the header cannot
    be zeroed). The read returns the block's bytes (a release never fails a call: counted in
    `stats.failed_releases`), and the block has moved: it is cached in DRAM (it used to stay cached on the
    released SSD page, out of every policy, with its new DRAM page lost), the invariants hold, and the SSD page is
    free for the next block."""
    cache = TieredCache([DramPagePool(PAGE, 2), SsdPagePool(tmp_path / "pool", PAGE, 4)], promote_after=1)
    for key in (1, 2, 3):
        cache.put(BlockKey(key), block(key))
    assert cache.tier_of(BlockKey(1)) == Tier.SSD

    def refuse(*_args: Any, **_kwargs: Any) -> int:
        raise OSError(errno.EIO, "Input/output error (injected)")

    monkeypatch.setattr(os, "pwrite", refuse)
    data = cache.get(BlockKey(1))  # DRAM's victim (2) goes down to a free SSD page, then 1 comes up
    monkeypatch.undo()
    assert bytes(data) == block(1)  # type: ignore[arg-type]
    assert [cache.tier_of(BlockKey(k)) for k in (1, 2, 3)] == [Tier.DRAM, Tier.SSD, Tier.DRAM]
    assert cache.pools[1].num_free == 3 and cache.stats.failed_releases == 1
    cache.check_invariants()
    for key in (1, 2, 3):
        assert bytes(cache.get(BlockKey(key))) == block(key)
    cache.check_invariants()
    cache.close()


class FaultyPool(DramPagePool):
    """A host pool whose writes, or page releases, fail while armed: a write raises before it stores anything
    (a device error, a full disk); a free releases the page and then raises, as `SsdPagePool.free` does when it
    cannot zero the page's header."""

    faults: frozenset[str] = frozenset()

    def write(self, page: int, data: Any, *, key: BlockKey, checksum: int | None = None) -> None:
        if "write" in self.faults:
            raise OSError("injected write failure")
        super().write(page, data, key=key, checksum=checksum)

    def free(self, page: int) -> None:
        super().free(page)
        if "free" in self.faults:
            raise OSError("injected free failure")


KEYS = st.integers(0, 11)  # more than the hierarchy's 7 pages: puts evict, demote and drop
FAULTS = st.one_of(st.none(), st.tuples(st.integers(0, 2), st.sampled_from([("write",), ("free",), ("write", "free")])))


class FaultyHierarchyMachine(RuleBasedStateMachine):
    """Three tiers (VRAM 2, DRAM 2, SSD 3 pages; a lower block promoted on its first read), whose writes or page
    releases fail, at any tier, during a put or a get: an I/O error anywhere in a cascade of demotions, in a
    promotion, or in a drop. Whatever failed, after every step the invariants hold, each cached key has a page
    of its own that holds its own bytes, the events mirror the cache, and a put or get with nothing failing
    succeeds (nothing is pinned, so nothing can be stuck): a get returns the block's own bytes exactly when it
    is cached, a put stores it in VRAM."""

    def __init__(self) -> None:
        super().__init__()
        self.pools = [FaultyPool(PAGE, 2, tier=Tier.VRAM), FaultyPool(PAGE, 2), FaultyPool(PAGE, 3, tier=Tier.SSD)]
        self.cache = TieredCache(self.pools, source=SOURCE, promote_after=1)  # type: ignore[arg-type]
        self.index = BlockIndex()

    def attempt(self, fault: tuple[int, tuple[str, ...]] | None, action: Any) -> tuple[bool, Any]:
        """(raised, result) of `action()` with `fault` armed (None: nothing fails, and nothing may raise)."""
        if fault is None:
            return False, action()
        level, ops = fault
        self.pools[level].faults = frozenset(ops)
        try:
            return False, action()
        except OSError as error:
            assert "injected" in str(error), error
            return True, None
        finally:
            self.pools[level].faults = frozenset()

    @rule(key=KEYS, fault=FAULTS)
    def put(self, key: int, fault: tuple[int, tuple[str, ...]] | None) -> None:
        was = self.cache.tier_of(BlockKey(key))
        raised, tier = self.attempt(fault, lambda: self.cache.put(BlockKey(key), block(key)))
        if not raised:
            assert tier == (was or Tier.VRAM) == self.cache.tier_of(BlockKey(key))
        elif was is None:
            assert self.cache.tier_of(BlockKey(key)) is None, "a put that failed stored its block"

    @rule(key=KEYS, fault=FAULTS)
    def get(self, key: int, fault: tuple[int, tuple[str, ...]] | None) -> None:
        was = self.cache.tier_of(BlockKey(key))
        raised, data = self.attempt(fault, lambda: self.cache.get(BlockKey(key)))
        if not raised:
            assert (data is None) == (was is None), f"block {key}: cached in {was}, read {data!r:.40}"
            assert data is None or bytes(data) == block(key), f"block {key}: another block's bytes"

    @invariant()
    def each_key_has_a_page_of_its_own_holding_its_bytes(self) -> None:
        self.cache.check_invariants()
        for pool in self.pools:
            pool.allocator.check_invariants()
        pages = {}
        for key in range(12):
            location = self.cache.location(BlockKey(key))
            if location is None:
                continue
            (pool,) = [pool for pool in self.pools if pool.tier == location.tier]
            assert bytes(pool.read(location.page, location.length)) == block(key), f"block {key}: wrong bytes"
            pages[(location.tier, location.page)] = key
        assert len(pages) == len(self.cache), "two keys share a page"

    @invariant()
    def the_events_mirror_the_cache(self) -> None:
        for event in self.cache.take_events():
            assert self.index.apply(event) is None
        for key in range(12):
            tier = self.cache.tier_of(BlockKey(key))
            assert self.index.holders(BlockKey(key)) == (() if tier is None else (Holder(SOURCE, tier),))


FaultyHierarchyMachine.TestCase.settings = settings(stateful_step_count=40)
TestFaultyHierarchy = FaultyHierarchyMachine.TestCase


def block_1_on_ssd(tmp_path: Path, promote_after: int) -> TieredCache:
    """A one-page DRAM tier over a four-page SSD tier holding block 1 (block 2 in DRAM), its events taken."""
    cache = TieredCache(
        [DramPagePool(PAGE, 1), SsdPagePool(tmp_path / "pool", PAGE, 4)], source=SOURCE, promote_after=promote_after
    )
    cache.put(BlockKey(1), block(1))
    cache.put(BlockKey(2), block(2))  # 1 goes down to the SSD
    cache.take_events()
    return cache


def fail_page_reads(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    """Every read of an SSD page raises `error` (the superblock, at offset 0, still reads)."""
    real = os.preadv

    def failing(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        if offset > 0:
            raise error
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", failing)


@pytest.mark.parametrize("promote_after", [0, 1])
def test_a_page_that_cannot_be_read_is_a_reported_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, promote_after: int
) -> None:
    """An SSD read failing with EIO (a bad sector), read in place or as it is promoted: `get` answers a miss, as
    for a corrupt page (it used to drop the block and raise the OSError as well); the block is dropped and counted
    corrupt, its removal published, and the cache keeps its invariants and serves the others."""
    cache = block_1_on_ssd(tmp_path, promote_after)
    fail_page_reads(monkeypatch, OSError(errno.EIO, "Input/output error (injected)"))
    assert cache.get(BlockKey(1)) is None
    monkeypatch.undo()
    assert cache.tier_of(BlockKey(1)) is None and cache.stats.corrupt_blocks == 1 and cache.stats.misses == 1
    assert any(isinstance(e, BlockRemoved) and BlockKey(1) in e.keys for e in cache.take_events())
    assert bytes(cache.get(BlockKey(2))) == block(2)
    cache.check_invariants()
    cache.close()


def test_flipped_bytes_in_a_live_cache_are_a_reported_miss(tmp_path: Path) -> None:
    """A block demoted to SSD and then damaged on disk is a miss when read back, never its bad bytes."""
    path = tmp_path / "ssd.pool"
    cache = reopen(path, dram_pages=2)
    for key in range(6):
        cache.put(BlockKey(key), block(key))
    on_ssd = [key for key in range(6) if cache.tier_of(BlockKey(key)) == Tier.SSD]
    assert len(on_ssd) == 4
    flip_byte(path, data_offset(path, on_ssd[0]) + 1)
    cache.take_events()
    assert cache.get(BlockKey(on_ssd[0])) is None
    assert cache.stats.corrupt_blocks == 1
    removed = [e for e in cache.take_events() if isinstance(e, BlockRemoved) and on_ssd[0] in e.keys]
    assert [e.tier for e in removed] == [Tier.SSD]
    for key in range(6):
        if key != on_ssd[0]:
            assert bytes(cache.get(BlockKey(key))) == block(key)
    cache.check_invariants()
    cache.close()


def test_a_flipped_header_byte_makes_the_block_vanish(tmp_path: Path) -> None:
    """A block whose page header was damaged is not recovered: a plain miss, never served; the rest serve."""
    path = tmp_path / "ssd.pool"
    write_ssd_file(path, [1, 2, 3])
    flip_byte(path, data_offset(path, 2) - HEADER_BYTES)  # the header's first byte
    cache = reopen(path)
    assert BlockKey(2) not in cache
    assert [e.keys for e in cache.take_events()] == [(1, 3)]
    assert cache.get(BlockKey(2)) is None
    assert cache.stats.corrupt_blocks == 0
    assert bytes(cache.get(BlockKey(1))) == block(1)
    assert bytes(cache.get(BlockKey(3))) == block(3)
    cache.close()


def test_flipped_bytes_in_an_ssd_only_cache_are_a_miss(tmp_path: Path) -> None:
    """With the SSD as the only (first) tier, a corrupt block is still a reported miss, not an exception."""
    path = tmp_path / "ssd.pool"
    write_ssd_file(path, [1, 2])
    flip_byte(path, data_offset(path, 1))
    cache = TieredCache([SsdPagePool(path, PAGE, 8)])
    try:
        assert cache.get(BlockKey(1)) is None
        assert cache.stats.corrupt_blocks == 1 and BlockKey(1) not in cache
    finally:
        cache.close()


def test_another_valid_page_copied_over_a_slot_is_a_miss_not_its_bytes(tmp_path: Path) -> None:
    """A slot overwritten with another key's valid page (header and data: a misdirected write) is a
    counted miss for the key the cache put there, never the other key's bytes."""
    path = tmp_path / "ssd.pool"
    cache = TieredCache([SsdPagePool(path, PAGE, 8)])
    try:
        for key in (1, 2):
            cache.put(BlockKey(key), block(key))
        first, second = (data_offset(path, key) - HEADER_BYTES for key in (1, 2))
        with path.open("r+b") as file:
            file.seek(second)
            slot = file.read(HEADER_BYTES + PAGE)
            file.seek(first)
            file.write(slot)
        assert cache.get(BlockKey(1)) is None
        assert cache.stats.corrupt_blocks == 1 and BlockKey(1) not in cache
        assert cache.get(BlockKey(2)) == block(2)
    finally:
        cache.close()


def test_a_second_cache_on_a_pool_file_in_use_is_refused(tmp_path: Path) -> None:
    """Two writers of one SSD file would hand out the same pages and serve each other's bytes: a second
    pool on a file in use (here, from another process) raises ConfigError, and opens once it is free."""
    path = tmp_path / "ssd.pool"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from mooncake.cache.ssd import SsdPagePool\n"
            f"pool = SsdPagePool({str(path)!r}, {PAGE}, 8); print('open', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=REPO_ROOT,
    )
    try:
        assert holder.stdout is not None
        ready, _, _ = select.select([holder.stdout], [], [], WRITER_TIMEOUT_S)
        assert ready and holder.stdout.readline() == b"open\n"
        with pytest.raises(ConfigError, match="in use by another pool"):
            reopen(path)
        assert holder.stdin is not None
        holder.stdin.close()  # the holder exits, which releases its lock
        holder.wait(timeout=WRITER_TIMEOUT_S)
        reopen(path).close()
    finally:
        holder.kill()
        holder.wait(timeout=WRITER_TIMEOUT_S)


def test_flipped_bytes_are_a_miss_while_the_first_tier_is_pinned(tmp_path: Path) -> None:
    """A corrupt SSD block read while every first-tier page is pinned (no room to promote) is a miss."""
    path = tmp_path / "ssd.pool"
    write_ssd_file(path, [1])
    flip_byte(path, data_offset(path, 1))
    cache = reopen(path, dram_pages=1)
    try:
        cache.put(BlockKey(2), block(2))
        cache.pin(BlockKey(2))
        assert cache.get(BlockKey(1)) is None
        assert cache.stats.corrupt_blocks == 1 and BlockKey(1) not in cache
    finally:
        cache.close()


def test_a_corrupt_block_read_under_a_pin_goes_when_unpinned(tmp_path: Path) -> None:
    """A corrupt block read inside `pinned()` is a miss, and is gone once the pin is released."""
    path = tmp_path / "ssd.pool"
    write_ssd_file(path, [1])
    flip_byte(path, data_offset(path, 1))
    cache = reopen(path)
    try:
        with cache.pinned(BlockKey(1)) as data:
            assert data is None
        assert BlockKey(1) not in cache, "still cached (and counted by prefix_match) after the last unpin"
        assert cache.stats.corrupt_blocks == 1 and cache.prefix_match([BlockKey(1)]) == 0
        cache.check_invariants()
    finally:
        cache.close()


def test_concurrent_readers_never_see_good_blocks_as_corrupt(tmp_path: Path) -> None:
    """Reader threads getting SSD blocks at once each get the right bytes; no good block is dropped."""
    cache = reopen(tmp_path / "ssd.pool", dram_pages=1, promote_after=0)
    keys = [BlockKey(key) for key in range(9)]
    for key in keys:
        cache.put(key, block(key))
    on_ssd = [key for key in keys if cache.tier_of(key) == Tier.SSD]
    failures: list[str] = []
    stop = threading.Event()

    def reader(start: int) -> None:
        for i in range(5_000):
            if stop.is_set():
                return
            key = on_ssd[(start + i) % len(on_ssd)]
            data = cache.get(key)
            if data is None or bytes(data) != block(key):
                failures.append(f"block {key}: {'a miss' if data is None else 'wrong bytes'}")
                stop.set()

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert failures == [] and cache.stats.corrupt_blocks == 0, failures[:3]
    finally:
        stop.set()
        cache.close()


# --------------------------------------------------------------------------- 3. clear errors


def test_tiers_with_different_page_sizes_raise_config_error(tmp_path: Path) -> None:
    """Tiers whose page sizes differ raise ConfigError naming both sizes."""
    ssd = SsdPagePool(tmp_path / "ssd.pool", 8192, 4)
    try:
        with pytest.raises(ConfigError, match=r"one page size, got \[4096, 8192\]"):
            TieredCache([DramPagePool(4096, 4), ssd])
    finally:
        ssd.close()


def test_reopening_the_ssd_tier_with_another_page_size_raises_config_error(tmp_path: Path) -> None:
    """A cache over an SSD file of another geometry raises ConfigError naming both; the file is untouched."""
    path = tmp_path / "ssd.pool"
    write_ssd_file(path, [1, 2])
    before = path.read_bytes()
    with pytest.raises(ConfigError, match=rf"holds 8 pages of {PAGE} bytes; asked for 8 pages of 4096 bytes"):
        TieredCache([DramPagePool(4096, 2), SsdPagePool(path, 4096, 8)])
    assert path.read_bytes() == before
    cache = reopen(path)
    assert bytes(cache.get(BlockKey(2))) == block(2)
    cache.close()


def test_an_ssd_tier_too_big_for_the_disk_raises_capacity_error(tmp_path: Path) -> None:
    """Building a cache whose SSD tier cannot be preallocated raises CapacityError and leaves no file."""
    path = tmp_path / "ssd.pool"
    with pytest.raises(CapacityError, match=r"cannot preallocate [\d,]+ bytes"):
        TieredCache([DramPagePool(4096, 2), SsdPagePool(path, 4096, 2**42)])
    assert not path.exists()


@pytest.mark.parametrize("with_ssd", [False, True], ids=["dram", "dram+ssd"])
def test_data_larger_than_a_page_raises_capacity_error_and_stores_nothing(tmp_path: Path, with_ssd: bool) -> None:
    """put of more than a page raises CapacityError naming both sizes; nothing is stored or announced."""
    pools: list[Any] = [DramPagePool(4096, 2)]
    if with_ssd:
        pools.append(SsdPagePool(tmp_path / "ssd.pool", 4096, 2))
    cache = TieredCache(pools)
    with pytest.raises(CapacityError, match="4097 bytes do not fit a page of 4096 bytes"):
        cache.put(BlockKey(1), b"x" * 4097)
    assert BlockKey(1) not in cache and len(cache) == 0
    assert cache.take_events() == [] and cache.stats.puts == 0
    assert all(cache.used_bytes(pool.tier) == 0 for pool in pools)
    cache.check_invariants()
    cache.close()


def test_a_first_tier_full_of_pinned_blocks_raises_capacity_error(tmp_path: Path) -> None:
    """put when every first-tier page holds a pinned block raises CapacityError naming the tier; nothing changes."""
    cache = reopen(tmp_path / "ssd.pool", dram_pages=1)
    cache.put(BlockKey(1), block(1))
    cache.pin(BlockKey(1))
    cache.take_events()
    with pytest.raises(CapacityError, match=r"no room for block 2 in DRAM: all 1 pages hold pinned blocks"):
        cache.put(BlockKey(2), block(2))
    assert BlockKey(2) not in cache and cache.take_events() == []
    assert bytes(cache.get(BlockKey(1))) == block(1)
    cache.unpin(BlockKey(1))
    assert cache.put(BlockKey(2), block(2)) == Tier.DRAM
    assert cache.tier_of(BlockKey(1)) == Tier.SSD
    cache.check_invariants()
    cache.close()


# --------------------------------------------------------------------------- 4. import from a peer


@pytest.mark.parametrize("first_tier", ["dram", "ssd"])
def test_import_with_a_wrong_checksum_raises_and_stores_nothing(tmp_path: Path, first_tier: str) -> None:
    """put(key, data, checksum=wrong) raises IntegrityError and stores nothing, in memory or on disk."""
    path = tmp_path / "ssd.pool"
    pools: list[Any] = [SsdPagePool(path, PAGE, 4)]
    if first_tier == "dram":
        pools.insert(0, DramPagePool(PAGE, 2))
    cache = TieredCache(pools)
    data = block(5)
    right = xxhash.xxh3_64_intdigest(data)
    with pytest.raises(IntegrityError, match=f"{right ^ 1:#018x}"):
        cache.put(BlockKey(5), data, checksum=right ^ 1)
    assert BlockKey(5) not in cache and len(cache) == 0
    assert cache.take_events() == [] and cache.stats.puts == 0
    assert all(pool.num_free == pool.num_pages for pool in pools)
    cache.check_invariants()

    assert cache.put(BlockKey(5), data, checksum=right) == pools[0].tier
    assert bytes(cache.get(BlockKey(5))) == data and cache.checksum(BlockKey(5)) == right
    with pytest.raises(IntegrityError):  # a cached block does not excuse a bad import
        cache.put(BlockKey(5), b"forged", checksum=right)
    assert bytes(cache.get(BlockKey(5))) == data
    cache.close()
    with SsdPagePool(path, PAGE, 4) as ssd:
        assert [found.key for found in ssd.recovered] == ([5] if first_tier == "ssd" else [])


@given(data=page_payloads(256), wrong=st.integers(0, 2**64 - 1))
def test_any_wrong_checksum_is_refused(data: bytes, wrong: int) -> None:
    """Whatever the bytes, a checksum that is not their XXH3-64 is refused and the cache stays empty."""
    right = xxhash.xxh3_64_intdigest(data)
    cache = TieredCache([DramPagePool(256, 1)])
    if wrong == right:
        wrong ^= 1 << 63
    with pytest.raises(IntegrityError):
        cache.put(BlockKey(1), data, checksum=wrong)
    assert len(cache) == 0 and cache.take_events() == []
    cache.put(BlockKey(1), data, checksum=right)
    assert bytes(cache.get(BlockKey(1))) == data


@pytest.mark.parametrize("memory_tiers", [1, 2], ids=["dram+ssd", "vram+dram+ssd"])
def test_a_corrupt_block_promoted_while_the_victims_demotion_fails_raises_the_disk_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, memory_tiers: int
) -> None:
    """A full hierarchy promotes a block whose SSD page is damaged, and the SSD refuses the write that would demote
    the first tier's victim into the page the block leaves: the read raises that OSError (docs/cache.md: disk
    errors reach the caller; it used to be a bare KeyError, the damaged block being forgotten twice), the damaged
    block is gone, counted corrupt and announced removed, every victim is where it was with its bytes, the SSD
    page is free, and once the disk takes writes again the cache works as before."""
    path = tmp_path / "ssd.pool"
    memory = (
        [DramPagePool(PAGE, 1)] if memory_tiers == 1 else [DramPagePool(PAGE, 1, tier=Tier.VRAM), DramPagePool(PAGE, 1)]
    )
    cache = TieredCache([*memory, SsdPagePool(path, PAGE, 1)], source=SOURCE, promote_after=1)
    index = BlockIndex()
    keys = [BlockKey(k) for k in range(1, memory_tiers + 2)]
    for key in keys:
        cache.put(key, block(key))
    assert cache.tier_of(keys[0]) == Tier.SSD
    before = [cache.tier_of(key) for key in keys[1:]]
    flip_byte(path, data_offset(path, keys[0]) + 1)

    def refuse(*_args: Any, **_kwargs: Any) -> int:
        raise OSError(errno.EIO, "Input/output error (injected)")

    monkeypatch.setattr(os, "pwritev", refuse)  # a page goes in with pwritev (a free zeroes a header with pwrite)
    with pytest.raises(OSError, match="injected"):
        cache.get(keys[0])
    monkeypatch.undo()
    assert cache.tier_of(keys[0]) is None and cache.stats.corrupt_blocks == 1
    assert [cache.tier_of(key) for key in keys[1:]] == before
    assert cache.pools[-1].num_free == 1
    cache.check_invariants()
    for event in cache.take_events():
        assert index.apply(event) is None
    assert index.holders(keys[0]) == ()
    assert [index.holders(key) for key in keys[1:]] == [(Holder(SOURCE, tier),) for tier in before]  # type: ignore[arg-type]
    for key in keys[1:]:
        assert bytes(cache.get(key)) == block(key)  # type: ignore[arg-type]
    cache.put(BlockKey(9), block(9))  # demotes into the free SSD page
    assert cache.pools[-1].num_free == 0 and bytes(cache.get(BlockKey(9))) == block(9)  # type: ignore[arg-type]
    cache.check_invariants()
    cache.close()


@pytest.mark.parametrize("promote_after", [0, 1], ids=["read-in-place", "promoted"])
@pytest.mark.parametrize("error", [MemoryError, KeyboardInterrupt])
def test_an_error_other_than_a_failed_read_leaves_a_healthy_ssd_block_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, promote_after: int, error: type[BaseException]
) -> None:
    """An SSD read interrupted by something that says nothing of the page (no memory for the copy, a Ctrl-C)
    raises it, and the block stays cached with its bytes: only a page that fails verification or cannot be read
    (IntegrityError, OSError) is dropped as corrupt (it used to be dropped whatever the error)."""
    cache = block_1_on_ssd(tmp_path, promote_after)
    fail_page_reads(monkeypatch, error("injected"))
    with pytest.raises(error):
        cache.get(BlockKey(1))
    monkeypatch.undo()
    assert cache.tier_of(BlockKey(1)) == Tier.SSD and cache.stats.corrupt_blocks == 0
    assert not any(isinstance(e, BlockRemoved) and BlockKey(1) in e.keys for e in cache.take_events())
    cache.check_invariants()
    assert bytes(cache.get(BlockKey(1))) == block(1)  # type: ignore[arg-type]
    assert bytes(cache.get(BlockKey(2))) == block(2)  # type: ignore[arg-type]
    cache.check_invariants()
    cache.close()


# --------------------------------------------------------------------------- what a failing disk tells


def ssd_page_of(cache: TieredCache, key: int) -> int:
    location = cache.location(BlockKey(key))
    assert location is not None and location.tier == Tier.SSD
    return location.page


@pytest.mark.parametrize("operation", ["put", "evict"])
def test_a_disk_error_under_a_cache_call_names_file_page_and_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, operation: str
) -> None:
    """The SSD refuses a page's write (ENOSPC: a put or an evict demoting a block into it): the call raises a
    DiskError, an OSError with the cause's errno and a MooncakeError, whose message names the pool file, the page
    and the block, raised from the cause (it used to be the bare OSError, naming none of them); the cache keeps
    its invariants. (A header that cannot be zeroed to free a page raises nothing: test_disk_failures.)"""
    path = tmp_path / "pool"
    cache = block_1_on_ssd(tmp_path, promote_after=0)  # block 1 on SSD, block 2 in DRAM
    error_number = errno.ENOSPC
    cause = OSError(error_number, os.strerror(error_number))

    def refuse(*_args: Any) -> int:
        raise cause

    page, key = 1, 2  # block 1 took SSD page 0; DRAM's block 2 goes into the next
    action = (lambda: cache.put(BlockKey(3), block(3))) if operation == "put" else (lambda: cache.evict(1))
    monkeypatch.setattr(os, "pwritev", refuse)
    with pytest.raises(OSError) as raised:
        action()
    monkeypatch.undo()
    error = raised.value
    assert isinstance(error, MooncakeError) and isinstance(error, DiskError), repr(error)
    assert error.errno == error_number and error.__cause__ is cause
    assert f"{path} page {page} (block {key:#x})" in str(error) and os.strerror(error_number) in str(error)
    cache.check_invariants()
    cache.close()


@pytest.mark.parametrize("how", ["read in place", "promoted", "swapped up", "read under a pinned first tier"])
@pytest.mark.parametrize("damage", ["flipped byte", "unreadable page"])
def test_a_block_dropped_as_corrupt_is_logged_naming_tier_block_and_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, how: str, damage: str
) -> None:
    """`get` answers a miss for a block that fails verification (serving recomputes it), however the read goes (in
    place, promoted into a free page, swapped with the first tier's victim, in place because the first tier is all
    pinned): the cache also logs one warning on the `mooncake.cache` logger naming the tier, the block and why,
    with the pool file and page (it used to say nothing, the loss seen only as `stats.corrupt_blocks` rising)."""
    path = tmp_path / "pool"
    cache = TieredCache(
        [DramPagePool(PAGE, 1), SsdPagePool(path, PAGE, 1 if how == "swapped up" else 4)],
        promote_after=0 if how == "read in place" else 1,
    )
    cache.put(BlockKey(1), block(1))
    cache.put(BlockKey(2), block(2))  # 1 goes down to the SSD
    page = ssd_page_of(cache, 1)
    if how == "read under a pinned first tier":
        cache.pin(BlockKey(2))
    if damage == "flipped byte":
        flip_byte(path, data_offset(path, 1) + 1)
        reason = "checksum"
    else:
        fail_page_reads(monkeypatch, OSError(errno.EIO, "Input/output error (injected)"))
        reason = "reading the page failed: Input/output error (injected)"
    with caplog.at_level(logging.WARNING, logger="mooncake.cache"):
        assert cache.get(BlockKey(1)) is None
    monkeypatch.undo()
    assert cache.stats.corrupt_blocks == 1 and BlockKey(1) not in cache
    records = [r for r in caplog.records if r.name == "mooncake.cache"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    message = records[0].getMessage()
    assert "block 0x1 in the SSD tier failed verification and is dropped" in message, message
    assert f"{path} page {page} (block 0x1)" in message and reason in message, message
    cache.check_invariants()
    cache.close()
