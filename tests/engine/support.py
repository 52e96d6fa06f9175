"""Shared pieces of the torch engine tests: the tiny model, caches, nodes, strategies.

Import it after `pytest.importorskip("torch")`: it imports the engine, hence torch.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator
from pathlib import Path

import attrs
import torch
from hypothesis import strategies as st

from mooncake.cache.hashing import BlockHasher
from mooncake.cache.pool import DramPagePool, PagePool
from mooncake.cache.ssd import SsdPagePool
from mooncake.cache.tiered import TieredCache
from mooncake.engine.config import PRESETS
from mooncake.engine.kv import KvLayout
from mooncake.engine.model import LlamaModel
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.messenger import Messenger, shared_dram_pool
from mooncake.transfer.request import EngineConfig
from mooncake.types import BlockKey

# Tiny tensors: one intra-op thread is fastest, and OpenMP workers spinning for a busy core
# (a loaded 2-core CI box) made a 1 ms forward pass take 100 ms.
torch.set_num_threads(1)

TINY = PRESETS["tiny"]
SECRET = bytes(range(32))

# fp32 results that differ only by kernel choice, summation order or batch padding.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}

prompts = st.lists(st.integers(min_value=0, max_value=TINY.vocab_size - 1), min_size=1, max_size=24)
block_sizes = st.sampled_from([1, 3, 4, 8])


@functools.cache
def tiny_model(seed: int = 0) -> LlamaModel:
    """The fp32 tiny model (shared: nothing in the engines mutates weights)."""
    return LlamaModel(TINY, seed=seed)


def layout(block_tokens: int) -> KvLayout:
    return KvLayout(config=TINY, block_tokens=block_tokens)


def hasher(block_tokens: int) -> BlockHasher:
    return BlockHasher(model=TINY.name, block_size_tokens=block_tokens)


def dram_cache(block_tokens: int, pages: int = 64) -> TieredCache:
    return TieredCache([DramPagePool(layout(block_tokens).page_bytes, pages)])


def tiered_cache(
    block_tokens: int, ssd_path: Path, *, dram_pages: int, ssd_pages: int, promote_after: int = 1
) -> TieredCache:
    """A DRAM tier in front of an SSD tier in a file: small DRAM forces demotion."""
    page = layout(block_tokens).page_bytes
    pools = [DramPagePool(page, dram_pages), SsdPagePool(ssd_path, page, ssd_pages)]
    return TieredCache(pools, promote_after=promote_after)


def reference_logits(tokens: Iterable[int]) -> torch.Tensor:
    """The plain forward pass's logits [T, vocab] of `tokens`."""
    with torch.inference_mode():
        return tiny_model()(torch.tensor(list(tokens), dtype=torch.long))


def page_bytes(cache: TieredCache, key: BlockKey) -> bytes:
    data = cache.get(key)
    assert data is not None, f"block {key} is not cached"
    return bytes(memoryview(data).cast("B"))


def assert_nothing_held(cache: TieredCache, keys: Iterable[BlockKey]) -> None:
    """No block of `keys` is reserved or pinned, and no page leaked.

    Destructive: removing a pinned block raises, so every cached key is removed;
    afterwards every pool must be as free as its other blocks allow.
    """
    cache.check_invariants()
    for key in dict.fromkeys(keys):
        location = cache.location(key)
        assert location is None or location.ready, f"block {key} is still reserved"
        if location is not None:
            cache.remove(key)  # BlockPinnedError if a pin leaked
    used = sum(pool.num_pages - pool.num_free for pool in cache.pools)
    assert used == len(cache), "a page is held by no cached block"


# Nodes over real TCP ----------------------------------------------------------------


@attrs.define
class Node:
    """One machine's KV service: a TCP transfer engine, a tiered cache whose DRAM it exports, a messenger."""

    engine: TransferEngine
    cache: TieredCache
    messenger: Messenger


@contextlib.contextmanager
def tcp_nodes(
    block_tokens: int, *, ssd_dir: Path | None = None, ssd_node: int = 0, dram_pages: int = 6
) -> Iterator[tuple[Node, Node, str]]:
    """Two nodes on 127.0.0.1 over TCP, the first connected to the second (the third value is its peer name).

    With `ssd_dir`, node `ssd_node` has an SSD tier behind only `dram_pages` DRAM pages; other DRAM tiers
    have 64 pages.
    """
    page = layout(block_tokens).page_bytes
    made: list[Node] = []
    try:
        for index in range(2):
            engine = TransferEngine(secret=SECRET, config=EngineConfig(transports=("tcp",), slice_bytes=1024))
            with_ssd = ssd_dir is not None and index == ssd_node
            pool, region = shared_dram_pool(engine, page, dram_pages if with_ssd else 64)
            pools: list[PagePool] = [pool]
            if ssd_dir is not None and with_ssd:
                pools.append(SsdPagePool(ssd_dir / f"node{index}.ssd", page, 64))
            cache = TieredCache(pools)
            made.append(Node(engine, cache, Messenger(engine, cache, region=region, lease_s=30.0, sweep_interval_s=0)))
        peer = made[0].engine.connect(made[1].engine.address, transport="tcp")
        yield made[0], made[1], peer
    finally:
        for node in made:
            node.messenger.close()
            node.engine.close()
            node.cache.close()


class CancelAfter:
    """A caller's cancel flag that turns True at its `asks`-th reading."""

    def __init__(self, asks: int) -> None:
        self.asks, self.read = asks, 0

    def __call__(self) -> bool:
        self.read += 1
        return self.read >= self.asks
