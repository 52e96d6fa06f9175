"""The simulated node's KV cache (`sim.node.metadata_cache`): prefix-aware LRU over metadata pages.

A property: whatever chains that fit it are stored, the blocks held are closed under parents (a block is never
held without the block before it), since eviction takes a chain's leaves first; an example: the older chain's leaf goes, not
its root, where plain LRU would take the root.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mooncake.sim.node import metadata_cache
from mooncake.types import BlockKey, InstanceId, Tier

SOURCE = InstanceId("prefill-0")


def chain(document: int, length: int) -> list[BlockKey]:
    """The first `length` blocks of a document: block i's key is document·100 + i, its parent the one before."""
    return [BlockKey(document * 100 + i) for i in range(length)]


@given(
    pages=st.integers(1, 8),
    chains=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6)), min_size=1, max_size=30),
)
def test_the_blocks_held_are_closed_under_parents(pages: int, chains: list[tuple[int, int]]) -> None:
    cache = metadata_cache(SOURCE, Tier.DRAM, page_bytes=64, num_pages=pages)
    for document, length in chains:
        cache.put_chain(chain(document, min(length, pages)), length=64)  # a chain the cache can hold whole
        held = {key for document in range(4) for key in chain(document, 6) if key in cache}
        assert all(key % 100 == 0 or BlockKey(key - 1) in held for key in held), sorted(held)
        assert len(held) <= pages
        cache.check_invariants()


def test_the_older_chains_leaf_goes_before_its_root() -> None:
    """Three pages: chain a0-a1, then b0; a new block takes a1's page (a leaf), not a0's (the LRU block, but a
    prefix of a1)."""
    cache = metadata_cache(SOURCE, Tier.DRAM, page_bytes=64, num_pages=3)
    cache.put_chain(chain(0, 2), length=64)
    cache.put_chain(chain(1, 1), length=64)
    cache.put_chain(chain(2, 1), length=64)
    assert [key in cache for key in (*chain(0, 2), *chain(1, 1), *chain(2, 1))] == [True, False, True, True]
