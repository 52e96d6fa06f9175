"""Global block index: prefix matches per second and memory per key, against a naive peer.

    python benchmarks/index.py [--json] [--keys N] [--instances H] [--blocks-per-request B]

Indexes `--keys` chained keys (chains of 64, each held in full by one instance
and as a random prefix by up to two more, in DRAM or SSD) across `--instances`
(16), then times `match` on 64-block requests drawn from the indexed
chains, a quarter of them diverging halfway (partial hits). The peer, measured in the same run, is the obvious design: a set of
keys per instance and a per-instance prefix walk (O(keys × holders) per match).
bytes_per_key is the traced allocation of the index (its key table, as
measured by tracemalloc) divided by the number of keys; table_bytes_per_key
counts the table's arrays alone. plain_matches_per_s is the same match, on the
same mix of requests, on the plain-Python kernels (what runs where numba is
not installed), on an index of
the first `--plain-keys` keys, since building one of a million keys without
numba takes minutes. Goal: >= 50 k matches/s (compiled).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import time
import tracemalloc

import numpy as np

from mooncake.cache._compiled import compiled_path
from mooncake.cache.events import BlockStored
from mooncake.cache.index import BlockIndex
from mooncake.types import BlockKey, InstanceId, Tier


def chains(seed: int, num_chains: int, length: int) -> list[list[BlockKey]]:
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 2**64 - 1, size=(num_chains, length), dtype=np.uint64, endpoint=True)
    return keys.tolist()  # type: ignore[no-any-return]


def holdings(seed: int, num_chains: int, length: int, instances: int) -> list[list[tuple[int, int, int]]]:
    """Per chain: (instance, prefix length, tier) for each holder."""
    rng = np.random.default_rng(seed + 1)
    out = []
    for _ in range(num_chains):
        # One to three holders, never more than there are instances (with 3 or more, the draw it always was).
        owners = rng.choice(instances, size=int(rng.integers(1, min(3, instances) + 1)), replace=False)
        out.append(
            [
                (int(owner), length if i == 0 else int(rng.integers(1, length + 1)), int(rng.integers(1, 3)))
                for i, owner in enumerate(owners)
            ]
        )
    return out


def build(index_chains: list[list[BlockKey]], plan: list[list[tuple[int, int, int]]]) -> BlockIndex:
    index = BlockIndex()
    seq = collections.Counter[int]()  # each instance's next event number: any number of instances
    for keys, holders in zip(index_chains, plan, strict=True):
        for owner, length, tier in holders:
            index.apply(
                BlockStored(source=InstanceId(f"prefill-{owner}"), seq=seq[owner], keys=keys[:length], tier=Tier(tier))
            )
            seq[owner] += 1
    return index


def draw_queries(rng: np.random.Generator, indexed: list[list[BlockKey]], count: int) -> list[list[BlockKey]]:
    """`count` requests drawn from the `indexed` chains, every fourth diverging halfway (a new user turn: realistic
    partial hits), the rest whole-chain hits. Every path is timed on such a mix (the plain kernels once timed on
    whole-chain hits alone)."""
    length = len(indexed[0])
    queries = [indexed[i] for i in rng.integers(0, len(indexed), size=count)]
    for q in range(0, len(queries), 4):
        queries[q] = queries[q][: length // 2] + [
            BlockKey(k) for k in rng.integers(0, 2**64 - 1, size=length - length // 2, dtype=np.uint64).tolist()
        ]
    return queries


class NaiveIndex:
    """The peer: one key set per instance, a prefix walk per instance."""

    def __init__(self) -> None:
        self.held: dict[str, set[BlockKey]] = {}

    def store(self, instance: str, keys: list[BlockKey]) -> None:
        self.held.setdefault(instance, set()).update(keys)

    def match(self, keys: list[BlockKey]) -> dict[str, int]:
        lengths = {}
        for instance, held in self.held.items():
            n = 0
            for key in keys:
                if key not in held:
                    break
                n += 1
            if n:
                lengths[instance] = n
        return lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--instances", type=int, default=16)
    parser.add_argument("--blocks-per-request", type=int, default=64)
    parser.add_argument("--queries", type=int, default=20_000)
    parser.add_argument("--plain-keys", type=int, default=32_000, help="keys of the index timed without numba")
    parser.add_argument("--plain-queries", type=int, default=500)
    args = parser.parse_args()
    if args.blocks_per_request < 1:
        parser.error(f"--blocks-per-request must be at least 1, got {args.blocks_per_request}")
    if args.keys < args.blocks_per_request:
        parser.error(
            f"--keys must be at least --blocks-per-request ({args.blocks_per_request}: one chain), got {args.keys}"
        )
    for option in ("instances", "queries", "plain_queries"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1, got {getattr(args, option)}")
    length = args.blocks_per_request
    num_chains = args.keys // length
    plan = holdings(1, num_chains, length, args.instances)

    warm = build(chains(9, 4, length), holdings(9, 4, length, args.instances))  # load the compiled kernels
    warm.match(chains(9, 1, length)[0])
    gc.collect()
    tracemalloc.start()
    index = build(chains(0, num_chains, length), plan)
    gc.collect()
    index_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    num_keys = len(index)

    naive = NaiveIndex()
    gc.collect()
    tracemalloc.start()
    for keys, holders in zip(chains(0, num_chains, length), plan, strict=True):
        for owner, prefix, _tier in holders:
            naive.store(f"prefill-{owner}", keys[:prefix])
    gc.collect()
    naive_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()

    rng = np.random.default_rng(2)
    indexed = chains(0, num_chains, length)
    queries = draw_queries(rng, indexed, args.queries)

    for query in queries[:100]:
        assert dict(index.match(query).lengths) == naive.match(query)  # same answers

    start = time.perf_counter()
    for query in queries:
        index.match(query)
    index_s = time.perf_counter() - start
    naive_queries = queries[: max(1, len(queries) // 4)]
    start = time.perf_counter()
    for query in naive_queries:
        naive.match(query)
    naive_s = (time.perf_counter() - start) * len(queries) / len(naive_queries)

    plain_chains = max(1, min(num_chains, args.plain_keys // length))
    with compiled_path(False):
        plain = build(indexed[:plain_chains], plan[:plain_chains])
    plain_queries = draw_queries(rng, indexed[:plain_chains], args.plain_queries)  # the same mix of hits
    for query in plain_queries[:20]:
        assert plain.match(query) == index.match(query)  # the chains of both share their holders
    start = time.perf_counter()
    for query in plain_queries:
        plain.match(query)
    plain_s = (time.perf_counter() - start) * len(queries) / len(plain_queries)

    result = {
        "keys": num_keys,
        "instances": args.instances,
        "blocks_per_request": length,
        "matches_per_s": len(queries) / index_s,
        "bytes_per_key": index_bytes / num_keys,
        "table_bytes_per_key": index.nbytes() / num_keys,
        "naive_matches_per_s": len(queries) / naive_s,
        "naive_bytes_per_key": naive_bytes / num_keys,
        "speedup_vs_naive": naive_s / index_s,
        "memory_ratio_vs_naive": index_bytes / naive_bytes,
        "plain_matches_per_s": len(queries) / plain_s,
        "speedup_vs_plain": plain_s / index_s,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{num_keys:,} keys, {args.instances} instances, {length}-block requests")
    print(
        f"BlockIndex.match    {result['matches_per_s'] / 1e3:8.1f} k matches/s   {result['bytes_per_key']:6.1f} bytes/key"
    )
    print(f"plain (no numba)    {result['plain_matches_per_s'] / 1e3:8.1f} k matches/s")
    print(
        f"naive (peer)        {result['naive_matches_per_s'] / 1e3:8.1f} k matches/s   {result['naive_bytes_per_key']:6.1f} bytes/key"
    )
    print(
        f"ratio               {result['speedup_vs_naive']:8.1f}x faster       {result['memory_ratio_vs_naive']:6.2f}x the memory"
    )


if __name__ == "__main__":
    main()
