"""Block-key hashing throughput: batch (numba over xxhash C), per request, the plain path, and a SHA-256 chain.

    python benchmarks/hashing.py [--json] [--requests N] [--blocks-per-request B] [--block-size T]

All hash the same requests of random int32 tokens in blocks of 512 (by
default), chaining each block on its parent's key. The plain path is what runs
where numba is not installed (xxhash's Python API per block; the same keys),
timed in batch and per request. The SHA-256 chain (the peer, measured in this
run) is what a safe-by-default server such as vLLM does per block:
sha256(parent bytes || token bytes) in a Python loop.
Goals: batch >= 10 M blocks/s, per request >= 3 M blocks/s (both compiled).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import numpy as np

from mooncake.cache._compiled import compiled_path
from mooncake.cache.hashing import BlockHasher


def best_seconds(run, repeats: int) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--requests", type=int, default=256, help="a scheduling step's worth (33 MB of tokens at the defaults)"
    )
    parser.add_argument("--blocks-per-request", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for option in ("requests", "blocks_per_request", "block_size", "repeats"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1, got {getattr(args, option)}")

    rng = np.random.default_rng(0)
    tokens_per_request = args.blocks_per_request * args.block_size
    tokens = rng.integers(0, 128_000, size=args.requests * tokens_per_request, dtype=np.int32)
    offsets = np.arange(args.requests + 1, dtype=np.int64) * tokens_per_request
    requests = [tokens[offsets[r] : offsets[r + 1]] for r in range(args.requests)]
    num_blocks = args.requests * args.blocks_per_request
    hasher = BlockHasher(model="bench", block_size_tokens=args.block_size)
    if not hasher.is_compiled:
        raise SystemExit(
            "the compiled path is unavailable here: numba is not installed (the accel extra) or xxhash's C symbols were not found"
        )
    import numba  # installed, as the compiled path needs it: the batch kernel's thread count is numba's

    warm = min(2, args.requests)
    hasher.hash_batch(tokens[: offsets[warm]], offsets[: warm + 1])  # compile outside the timing
    hasher.block_keys(requests[0])
    batch_s = best_seconds(lambda: hasher.hash_batch(tokens, offsets), args.repeats)
    per_request_s = best_seconds(lambda: [hasher.block_keys(r) for r in requests], args.repeats)
    with compiled_path(False):
        plain_batch_s = best_seconds(lambda: hasher.hash_batch(tokens, offsets), args.repeats)
        plain_per_request_s = best_seconds(lambda: [hasher.block_keys(r) for r in requests], args.repeats)
        plain_batch = hasher.hash_batch(tokens, offsets)

    sample = requests[: max(1, args.requests // 10)]  # the peer is slow; time a tenth
    data = [r.tobytes() for r in sample]
    step = 4 * args.block_size

    def sha256_chain() -> None:
        for blob in data:
            parent = b"\0" * 32
            for start in range(0, len(blob), step):
                parent = hashlib.sha256(parent + blob[start : start + step]).digest()

    sha_s = best_seconds(sha256_chain, args.repeats) * args.requests / len(sample)

    batch = hasher.hash_batch(tokens, offsets)
    assert batch[args.requests - 1] == hasher.block_keys(requests[-1])  # the paths agree
    assert np.array_equal(batch.keys, plain_batch.keys)

    result = {
        "blocks": num_blocks,
        "block_size_tokens": args.block_size,
        "threads": numba.get_num_threads(),  # the batch kernel's (NUMBA_NUM_THREADS), not the machine's CPUs
        "batch_blocks_per_s": num_blocks / batch_s,
        "per_request_blocks_per_s": num_blocks / per_request_s,
        "sha256_chain_blocks_per_s": num_blocks / sha_s,
        "speedup_vs_sha256": sha_s / batch_s,
        "per_request_speedup_vs_sha256": sha_s / per_request_s,
        "batch_gbytes_per_s": num_blocks * step / batch_s / 1e9,
        "plain_batch_blocks_per_s": num_blocks / plain_batch_s,
        "plain_per_request_blocks_per_s": num_blocks / plain_per_request_s,
        "batch_speedup_vs_plain": plain_batch_s / batch_s,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{num_blocks:,} blocks of {args.block_size} int32 tokens, batch on {result['threads']} threads")
    print(
        f"batch (numba + xxhash C)   {result['batch_blocks_per_s'] / 1e6:8.2f} M blocks/s  ({result['batch_gbytes_per_s']:.1f} GB/s)"
    )
    print(f"per request                {result['per_request_blocks_per_s'] / 1e6:8.2f} M blocks/s")
    print(
        f"plain (no numba)           {result['plain_batch_blocks_per_s'] / 1e6:8.2f} M blocks/s batch, "
        f"{result['plain_per_request_blocks_per_s'] / 1e6:.2f} per request ({result['batch_speedup_vs_plain']:.1f}x slower batch)"
    )
    print(f"sha256 chain (peer)        {result['sha256_chain_blocks_per_s'] / 1e6:8.2f} M blocks/s")
    print(
        f"speedup vs sha256          {result['speedup_vs_sha256']:8.1f}x batch, {result['per_request_speedup_vs_sha256']:.1f}x per request"
    )


if __name__ == "__main__":
    main()
