"""Tiered cache throughput against memcpy and raw file I/O, measured in the same run.

    python benchmarks/tiered_cache.py [--json] [--dir PATH] [--total-mib 256] [--small-ops 1000000]

- DRAM: `put` (copy into a page) and `get` (zero-copy view, then copied out, as
  a consumer would) of 1 MiB and 16 MiB pages, against `np.copyto` of the same
  sizes between the same kinds of buffers (`memcpy_gbps`).
- SSD: an SSD-only cache's `put` (the page behind a zeroed header, then its header: two pwritev calls) and `get`
  (pread + XXH3 verification into a new buffer), against raw `os.pwrite` /
  `os.pread` of the same sizes on the same file system; both fdatasync once at
  the end of their write phase. Reads hit the page cache for both.
- small_ops_per_s: 1 M puts then 1 M gets of 4 KiB pages in a DRAM cache of
  128 Ki pages (so most puts evict; every get hits a resident page), i.e. the
  per-operation overhead.

Goals: dram_vs_memcpy >= 0.7, ssd_vs_raw >= 0.7 (the cache costs at most 30 % over
the bare copy or file I/O it wraps).

JSON keys (GB/s are 10^9 bytes per second; DRAM and SSD figures the best of
`--repeats`, the small operations timed once):
- dram_put_gbps, dram_get_gbps, memcpy_gbps, dram_vs_memcpy (the lower of
  put and get over memcpy): at the page size where that ratio is lower;
- ssd_write_gbps, ssd_read_gbps, raw_file_write_gbps, raw_file_read_gbps,
  ssd_vs_raw (the lower of write and read over raw): at the page size where
  that ratio is lower;
- small_put_ops_per_s, small_get_ops_per_s, small_ops_per_s (both together);
- by_page_size: {"1MiB": ..., "16MiB": ...}, the nine DRAM and SSD figures
  above at each page size;
- dir: where the SSD files went.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mooncake.cache.pool import DramPagePool, aligned_buffer
from mooncake.cache.ssd import SsdPagePool
from mooncake.cache.tiered import TieredCache
from mooncake.types import BlockKey

MIB = 1 << 20


Run = tuple[Callable[[], None], Callable[[], None] | None]  # (timed body, untimed setup)


def best(runs: list[Run], repeats: int) -> list[float]:
    """Best time of each run over `repeats` rounds, the runs interleaved within a
    round so that a slow moment of a shared machine hits all of them alike."""
    fastest = [float("inf")] * len(runs)
    for _ in range(repeats):
        for i, (body, setup) in enumerate(runs):
            if setup is not None:
                setup()
            start = time.perf_counter()
            body()
            fastest[i] = min(fastest[i], time.perf_counter() - start)
    return fastest


def dram(page_bytes: int, total_bytes: int, repeats: int) -> dict[str, float]:
    count = total_bytes // page_bytes
    source = aligned_buffer(total_bytes, prefault=True)
    source[:] = np.random.default_rng(0).integers(0, 256, size=total_bytes, dtype=np.uint8)
    target = aligned_buffer(total_bytes, prefault=True)
    pages = [source[i * page_bytes : (i + 1) * page_bytes] for i in range(count)]
    outs = [target[i * page_bytes : (i + 1) * page_bytes] for i in range(count)]
    state: dict[str, TieredCache] = {}

    def fresh() -> None:
        state["cache"] = TieredCache([DramPagePool(page_bytes, count, prefault=True)])

    def put() -> None:
        cache = state["cache"]
        for i, page in enumerate(pages):
            cache.put(BlockKey(i), page)

    def get() -> None:
        cache = state["cache"]
        for i, out in enumerate(outs):
            out[:] = np.frombuffer(cache.get(BlockKey(i)), dtype=np.uint8)

    def memcpy() -> None:
        for page, out in zip(pages, outs, strict=True):
            np.copyto(out, page)

    put_s, get_s, copy_s = best([(put, fresh), (get, None), (memcpy, None)], repeats)
    assert bytes(outs[-1][:64]) == bytes(pages[-1][:64])
    gb = count * page_bytes / 1e9  # the bytes moved: whole pages
    return {"dram_put_gbps": gb / put_s, "dram_get_gbps": gb / get_s, "memcpy_gbps": gb / copy_s}


def ssd(page_bytes: int, total_bytes: int, repeats: int, directory: Path) -> dict[str, float]:
    count = total_bytes // page_bytes
    data = np.random.default_rng(1).integers(0, 256, size=page_bytes, dtype=np.uint8)
    pool_path, raw_path = directory / "bench.pool", directory / "bench.raw"
    state: dict[str, TieredCache] = {}

    def fresh() -> None:
        if "cache" in state:
            state["cache"].close()
        pool_path.unlink(missing_ok=True)
        state["cache"] = TieredCache([SsdPagePool(pool_path, page_bytes, count)])

    def put() -> None:
        cache = state["cache"]
        for i in range(count):
            cache.put(BlockKey(i), data)
        pool = cache.pools[0]
        assert isinstance(pool, SsdPagePool)
        pool.flush()

    def get() -> None:
        cache = state["cache"]
        for i in range(count):
            cache.get(BlockKey(i))

    raw: dict[str, int] = {}

    def fresh_raw() -> None:
        # Like the pool: a new preallocated file each time (ext4 converts
        # unwritten extents on first write, so reusing one would flatter raw I/O).
        if "fd" in raw:
            os.close(raw.pop("fd"))
        raw_path.unlink(missing_ok=True)
        raw["fd"] = os.open(raw_path, os.O_RDWR | os.O_CREAT, 0o644)
        os.posix_fallocate(raw["fd"], 0, count * page_bytes)

    def raw_write() -> None:
        fd = raw["fd"]
        for i in range(count):
            os.pwrite(fd, data.data, i * page_bytes)
        os.fdatasync(fd)

    def raw_read() -> None:
        fd = raw["fd"]
        for i in range(count):
            os.pread(fd, page_bytes, i * page_bytes)

    try:
        raw_write_s, write_s, raw_read_s, read_s = best(
            [(raw_write, fresh_raw), (put, fresh), (raw_read, None), (get, None)], repeats
        )
        assert bytes(state["cache"].get(BlockKey(0))) == data.tobytes()
    finally:
        # Whatever failed (ENOSPC from posix_fallocate, Ctrl-C), possibly before the first fresh(): close what was
        # opened and leave neither file behind, so that the error raised is the one that happened.
        try:
            if "fd" in raw:
                os.close(raw.pop("fd"))
            if "cache" in state:
                state.pop("cache").close()
        finally:
            pool_path.unlink(missing_ok=True)
            raw_path.unlink(missing_ok=True)
    gb = count * page_bytes / 1e9  # the bytes moved: whole pages
    return {
        "ssd_write_gbps": gb / write_s,
        "ssd_read_gbps": gb / read_s,
        "raw_file_write_gbps": gb / raw_write_s,
        "raw_file_read_gbps": gb / raw_read_s,
    }


def small_ops(num_ops: int) -> dict[str, float]:
    page = 4096
    cache = TieredCache([DramPagePool(page, 128 * 1024)])
    payload = bytes(page)
    start = time.perf_counter()
    for i in range(num_ops):
        cache.put(BlockKey(i), payload)
    put_s = time.perf_counter() - start
    resident = np.random.default_rng(2).choice(np.arange(max(0, num_ops - 128 * 1024), num_ops), size=num_ops)
    keys = [BlockKey(int(k)) for k in resident]  # the cache's last 128 Ki keys: every get is a hit
    start = time.perf_counter()
    for key in keys:
        if cache.get(key) is None:
            raise SystemExit(f"block {key} should be cached")
    get_s = time.perf_counter() - start
    return {
        "small_put_ops_per_s": num_ops / put_s,
        "small_get_ops_per_s": num_ops / get_s,
        "small_ops_per_s": 2 * num_ops / (put_s + get_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--dir", help="where the SSD files go (default: a temporary folder)")
    parser.add_argument(
        "--total-mib", type=int, default=256, help="MiB moved per measurement: a multiple of 16, the larger page"
    )
    parser.add_argument("--small-ops", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.total_mib < 16 or args.total_mib % 16:
        parser.error(f"--total-mib must be a positive multiple of 16 (whole 16 MiB pages), got {args.total_mib}")
    for option in ("small_ops", "repeats"):
        if getattr(args, option) < 1:  # --small-ops 0 printed 0 put/s
            parser.error(f"--{option.replace('_', '-')} must be at least 1, got {getattr(args, option)}")
    if args.dir:
        directory = Path(args.dir)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except FileExistsError:  # exist_ok covers a directory only
            parser.error(f"--dir must name a directory, got {args.dir}: a file")
        except OSError as error:  # beneath a file, or not ours to write
            parser.error(f"--dir must name a directory it can make, got {args.dir}: {error.strerror}")
    else:
        directory = Path(tempfile.mkdtemp(prefix="mooncake-bench-"))
    total = args.total_mib * MIB
    by_size: dict[str, dict[str, float]] = {}
    memories: list[dict[str, float]] = []
    disks: list[dict[str, float]] = []
    try:
        for page_bytes in (MIB, 16 * MIB):
            memory = dram(page_bytes, total, args.repeats)
            memory["dram_vs_memcpy"] = min(memory["dram_put_gbps"], memory["dram_get_gbps"]) / memory["memcpy_gbps"]
            disk = ssd(page_bytes, total, args.repeats, directory)
            disk["ssd_vs_raw"] = min(
                disk["ssd_write_gbps"] / disk["raw_file_write_gbps"], disk["ssd_read_gbps"] / disk["raw_file_read_gbps"]
            )
            memories.append(memory)
            disks.append(disk)
            by_size[f"{page_bytes // MIB}MiB"] = {**memory, **disk}
    finally:
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)
    # Headline figures: for DRAM and for SSD, the page size where the cache does worse against its peer, each
    # ratio beside the rates it came from.
    worst = {
        **min(memories, key=lambda figures: figures["dram_vs_memcpy"]),
        **min(disks, key=lambda figures: figures["ssd_vs_raw"]),
    }
    result = {**worst, **small_ops(args.small_ops), "by_page_size": by_size, "dir": str(directory)}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for name, figures in by_size.items():
        print(f"-- {name} pages, {args.total_mib} MiB per measurement")
        print(
            f"DRAM put {figures['dram_put_gbps']:6.2f} GB/s  get {figures['dram_get_gbps']:6.2f} GB/s  "
            f"memcpy {figures['memcpy_gbps']:6.2f} GB/s  ratio {figures['dram_vs_memcpy']:.2f}"
        )
        print(
            f"SSD write {figures['ssd_write_gbps']:6.2f} GB/s  read {figures['ssd_read_gbps']:6.2f} GB/s  "
            f"raw {figures['raw_file_write_gbps']:6.2f} / {figures['raw_file_read_gbps']:6.2f} GB/s  "
            f"ratio {figures['ssd_vs_raw']:.2f}"
        )
    print(f"small 4 KiB ops: {result['small_put_ops_per_s']:,.0f} put/s, {result['small_get_ops_per_s']:,.0f} get/s")


if __name__ == "__main__":
    main()
