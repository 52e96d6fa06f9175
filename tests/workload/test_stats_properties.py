"""`trace_stats`' prefix reuse as the docstring states it: the hit ratio of an infinite cache, in stream order.

`tests/workload/test_stats.py` checks the ratio against its set-of-earlier-keys definition. Here:
on chained keys (a key names its whole prefix, as the byte rule, the assembler and real traces key
blocks), the ratio is what an infinite prefix cache gets replaying the workload, both a trie of
the prefixes seen and the simulator's own `metadata_cache` with room for every block; and "earlier"
is the order the requests are read in, not their arrival times.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st

from mooncake.sim.node import metadata_cache
from mooncake.types import BlockKey, InstanceId, Request, RequestId, Tier
from mooncake.workload import trace_stats
from tests.strategies import chained_workloads, prefix_workloads

BLOCK = 4


def as_requests(chains: Sequence[tuple[BlockKey, ...]], arrivals_s: Sequence[float] | None = None) -> list[Request]:
    """A request per chain (at least one block each), arriving at `arrivals_s` (0 for all by default)."""
    return [
        Request(
            request_id=RequestId(str(index)),
            arrival_s=arrivals_s[index] if arrivals_s is not None else 0.0,
            input_length=BLOCK * len(keys),
            output_length=1,
            block_keys=keys,
        )
        for index, keys in enumerate(chains)
    ]


def reused_blocks(stats_ratio: float, workload: Sequence[Request]) -> int:
    """The reused block count behind a ratio (an integer over the blocks of the workload)."""
    total = sum(len(request.block_keys) for request in workload)
    count = round(stats_ratio * total)
    assert abs(count - stats_ratio * total) < 1e-6, (stats_ratio, total)
    return count


@given(chains=chained_workloads(max_requests=14, max_blocks=7).map(lambda cs: [c for c in cs if c]))
def test_on_chained_keys_the_ratio_is_an_infinite_caches_hit_ratio(chains: list[tuple[BlockKey, ...]]) -> None:
    """Replaying the requests through a cache that never evicts (a trie of prefixes; the simulator's metadata
    cache sized for every block), each request's hit is its longest cached prefix; the hits over all blocks are
    the ratio."""
    workload = as_requests(chains)
    total = sum(len(keys) for keys in chains)
    cache = metadata_cache(InstanceId("prefill-0"), Tier.DRAM, page_bytes=64, num_pages=max(total, 1))
    trie: set[tuple[BlockKey, ...]] = set()
    trie_hits = cache_hits = 0
    for keys in chains:
        hit = 0
        while hit < len(keys) and keys[: hit + 1] in trie:
            hit += 1
        trie_hits += hit
        trie.update(keys[: i + 1] for i in range(len(keys)))
        cache_hits += cache.prefix_match(keys)
        cache.put_chain(keys, length=64)
    assert trie_hits == cache_hits
    assert reused_blocks(trace_stats(workload).prefix_reuse_ratio, workload) == trie_hits


@given(workload=prefix_workloads(), data=st.data())
def test_earlier_means_read_earlier_not_arriving_earlier(workload: list[Request], data: st.DataObject) -> None:
    """The ratio depends on the order the requests are read in, not on their arrival times: the same requests
    at any other times (out of order, tied) give the same ratio, block for block; the duration is the arrivals'
    span whatever their order, never negative."""
    arrivals = data.draw(st.lists(st.integers(0, 5).map(float), min_size=len(workload), max_size=len(workload)))
    retimed = as_requests([request.block_keys for request in workload], arrivals)
    stats = trace_stats(iter(retimed))
    assert stats.prefix_reuse_ratio == trace_stats(iter(workload)).prefix_reuse_ratio
    assert stats.duration_s == (max(arrivals) - min(arrivals) if arrivals else 0.0)
