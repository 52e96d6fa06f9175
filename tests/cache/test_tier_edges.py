"""Edge contracts of the tiered cache, its policies, pools and capacity replay that a review found open.

- `announce_all` on a cache that holds nothing still reaches the consumer: its new epoch opens with an
  `AllBlocksCleared`, so an index that lost the cache's removals drops what it last believed held.
- A policy refuses an unhashable parent before it inserts the key (it used to cache the key with no parent
  count to match, unevictable), and its queries refuse an unhashable key by name.
- Every pool takes an empty block (a VRAM pool refused one through `torch.frombuffer`), and a VRAM pool
  writes `bytes` without lending torch read-only memory.
- A capacity replay refuses what is no eviction policy (a policy class, say) by name, before it starts.
- `TieredCache.evict` evicts fewer blocks than asked where the rest are pinned or prefixes of pinned blocks.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mooncake.cache.capacity import hit_ratio_curve, simulate_prefix_hits
from mooncake.cache.events import AllBlocksCleared, BlockStored
from mooncake.cache.index import BlockIndex
from mooncake.cache.policy import LengthAwarePolicy, LfuPolicy, LruPolicy, SievePolicy
from mooncake.cache.pool import AllocatingPool, DramPagePool, MetadataPagePool, VramPagePool
from mooncake.cache.ssd import SsdPagePool
from mooncake.cache.tiered import TieredCache
from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.types import BlockKey, InstanceId, Tier

PAGE = 64
SOURCE = InstanceId("prefill-0")
POLICY_CLASSES = [LruPolicy, LfuPolicy, LengthAwarePolicy, SievePolicy]
KEYS = [BlockKey(1), BlockKey(2), BlockKey(3)]

# --------------------------------------------------------------------------- announce_all


def applied_then_lost(cache: TieredCache, index: BlockIndex, removed: list[BlockKey]) -> None:
    """`cache` stores `KEYS`, its events applied to `index`; then it removes `removed`, those events lost."""
    for key in KEYS:
        cache.put(key, b"x" * 8)
    for event in cache.take_events():
        assert index.apply(event) is None
    for key in removed:
        cache.remove(key)
    cache.take_events()  # lost on the wire


def test_announce_all_on_an_empty_cache_clears_what_the_index_still_believes() -> None:
    """An index that lost a cache's removals is mended by `announce_all` even when the cache holds nothing: the
    new epoch opens with an `AllBlocksCleared` at seq 0, which the index applies whatever it knew (before, the
    announcement sent no event at all, and the index kept all three blocks)."""
    cache = TieredCache([DramPagePool(PAGE, 4)], source=SOURCE)
    index = BlockIndex()
    applied_then_lost(cache, index, KEYS)
    cache.announce_all(cache.epoch + 1)
    events = cache.take_events()
    assert events == [AllBlocksCleared(source=SOURCE, seq=0, epoch=1)]
    for event in events:
        assert index.apply(event) is None
    assert index.match(KEYS).length(SOURCE) == 0
    for key in KEYS:
        assert index.holders(key) == ()
    cache.put(BlockKey(9), b"y")  # the epoch goes on from there
    assert [(e.seq, e.epoch) for e in cache.take_events()] == [(1, 1)]


def test_announce_all_on_a_cache_that_holds_blocks_clears_then_stores_them() -> None:
    """With blocks held, the clear comes first and the blocks follow in one store: the index holds exactly them."""
    cache = TieredCache([DramPagePool(PAGE, 4)], source=SOURCE)
    index = BlockIndex()
    applied_then_lost(cache, index, [BlockKey(1)])
    cache.announce_all(cache.epoch + 1)
    events = cache.take_events()
    assert events == [
        AllBlocksCleared(source=SOURCE, seq=0, epoch=1),
        BlockStored(source=SOURCE, seq=1, keys=(2, 3), tier=Tier.DRAM, epoch=1),
    ]
    for event in events:
        assert index.apply(event) is None
    assert index.holders(BlockKey(1)) == ()
    assert index.match([BlockKey(2), BlockKey(3)]).length(SOURCE) == 2
    assert cache.take_events() == []  # the clear is the announcement's alone


# --------------------------------------------------------------------------- policies


@pytest.mark.parametrize("policy_class", POLICY_CLASSES)
def test_an_unhashable_parent_is_refused_before_the_key_is_inserted(policy_class: Any) -> None:
    """`access(key, parent=[1])` raises InvalidRequestError and inserts nothing (the key used to be cached with a
    parent link but no child count, so `evict` and `check_invariants` raised TypeError on it)."""
    policy = policy_class()
    policy.access(BlockKey(1))
    with pytest.raises(InvalidRequestError, match=r"hashable.*\[1\]"):
        policy.access(BlockKey(7), parent=[1])
    assert BlockKey(7) not in policy and len(policy) == 1
    policy.check_invariants()
    assert policy.evict() == 1 and policy.evict() is None
    policy.check_invariants()


@pytest.mark.parametrize("policy_class", POLICY_CLASSES)
@pytest.mark.parametrize("query", ["num_holds", "is_pinned", "is_candidate"])
def test_policy_queries_refuse_an_unhashable_key_by_name(policy_class: Any, query: str) -> None:
    """A query given an unhashable key raises InvalidRequestError, as `remove`, `hold` and `access` do (it raised
    a bare TypeError)."""
    policy = policy_class()
    policy.access(BlockKey(1))
    with pytest.raises(InvalidRequestError, match=r"hashable.*\[1\]"):
        getattr(policy, query)([1])
    assert getattr(policy, query)(BlockKey(2)) in (0, False)  # an unknown key is still an answer


# --------------------------------------------------------------------------- pools


class CpuTensorPool(VramPagePool):
    """A VRAM pool whose buffer is a CPU tensor (no CUDA here): its writes and reads are the VRAM pool's."""

    def __init__(self, page_bytes: int, num_pages: int) -> None:
        torch = pytest.importorskip("torch", reason="torch is not installed (extra 'engine')")
        AllocatingPool.__init__(self, Tier.VRAM, page_bytes, num_pages)
        self._torch = torch
        self.buffer = torch.zeros(page_bytes * num_pages, dtype=torch.uint8)


def test_every_pool_takes_an_empty_block(tmp_path: Path) -> None:
    """Zero bytes write nothing in every pool (the VRAM pool raised torch's bare ValueError)."""
    pools = [
        DramPagePool(PAGE, 2),
        SsdPagePool(tmp_path / "ssd.pool", PAGE, 2),
        MetadataPagePool(Tier.DRAM, PAGE, 2),
        CpuTensorPool(PAGE, 2),
    ]
    for pool in pools:
        page = pool.try_allocate()
        assert page is not None
        pool.write(page, b"", key=BlockKey(1))
        data = pool.read(page, 0, key=BlockKey(1))
        assert data is None if not pool.holds_bytes else len(data) == 0, pool
        pool.close()


def test_a_vram_first_cache_stores_and_moves_an_empty_block() -> None:
    """An empty block is put into a VRAM first tier, demoted to DRAM, and promoted back, read whole each time."""
    cache = TieredCache([CpuTensorPool(PAGE, 1), DramPagePool(PAGE, 2)], promote_after=1)
    cache.put(BlockKey(1), b"a" * 8)
    cache.put(BlockKey(2), b"")  # into VRAM, 1 demoted
    assert cache.tier_of(BlockKey(2)) == Tier.VRAM and len(cache.get(BlockKey(2))) == 0  # type: ignore[arg-type]
    assert bytes(cache.get(BlockKey(1)).numpy()) == b"a" * 8  # type: ignore[union-attr]  # promoted: 2 goes down
    assert cache.tier_of(BlockKey(2)) == Tier.DRAM
    assert len(cache.get(BlockKey(2))) == 0  # type: ignore[arg-type]  # promoted back into VRAM
    assert cache.tier_of(BlockKey(2)) == Tier.VRAM
    cache.check_invariants()


def test_a_vram_pool_writes_bytes_without_lending_torch_read_only_memory() -> None:
    """`bytes` reach `torch.frombuffer` as writable memory (a read-only buffer makes torch warn that its tensor
    could write into the `bytes`), and read back exactly; a bytearray is lent as it is, without a copy."""
    pool = CpuTensorPool(PAGE, 2)
    torch = pool._torch
    lent: list[bool] = []

    def frombuffer(buffer: Any, **options: Any) -> Any:
        lent.append(memoryview(buffer).readonly)
        return torch.frombuffer(buffer, **options)

    pool._torch = SimpleNamespace(Tensor=torch.Tensor, uint8=torch.uint8, frombuffer=frombuffer)
    page = pool.try_allocate()
    pool.write(page, b"\x01\x02\x03", key=BlockKey(1))
    assert lent == [False]
    assert bytes(pool.read(page, 3).numpy()) == b"\x01\x02\x03"
    source = bytearray(b"\x04\x05")
    pool.write(page, source, key=BlockKey(1))
    assert bytes(pool.read(page, 2).numpy()) == b"\x04\x05"


# --------------------------------------------------------------------------- capacity replay


@pytest.mark.parametrize("policy", [LruPolicy, 3, None], ids=["a-class", "an-int", "none"])
def test_a_replay_refuses_what_is_no_eviction_policy_by_name(policy: Any) -> None:
    """`simulate_prefix_hits` given a policy class (or anything else) where an instance is meant raises ConfigError
    naming it (it failed with "object of type 'type' has no len()"); `hit_ratio_curve` checks what its
    `make_policy` makes the same way."""
    with pytest.raises(ConfigError, match=r"^policy must be an EvictionPolicy"):
        simulate_prefix_hits([[BlockKey(1)]], policy, capacity_blocks=2)
    with pytest.raises(ConfigError, match=r"^make_policy\(\) must be an EvictionPolicy"):
        hit_ratio_curve([[BlockKey(1)]], lambda: policy, capacities_blocks=[2])


def test_a_cache_refuses_a_policy_factory_that_makes_a_class() -> None:
    """`policy=lambda: LruPolicy` makes a class, whose methods are there but unbound: refused at construction."""
    with pytest.raises(ConfigError, match="policy must make an eviction policy"):
        TieredCache([DramPagePool(PAGE, 2)], policy=lambda: LruPolicy)  # type: ignore[arg-type, return-value]


# --------------------------------------------------------------------------- evict


def test_evict_keeps_the_prefix_of_a_pinned_block_in_a_single_tier() -> None:
    """As `evict` documents: a block that is the prefix of a pinned block, with no lower tier to take it, is not
    evicted (dropping it would strand the pinned block), so fewer blocks than asked go."""
    cache = TieredCache([DramPagePool(PAGE, 4)])
    cache.put(BlockKey(1), b"a")
    cache.put(BlockKey(2), b"b", parent=BlockKey(1))
    cache.pin(BlockKey(2))
    assert cache.evict(1) == 0
    assert BlockKey(1) in cache and BlockKey(2) in cache
    cache.unpin(BlockKey(2))
    assert cache.evict(2) == 2 and len(cache) == 0
