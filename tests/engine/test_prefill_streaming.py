"""Tests for `PrefillEngine` streaming to a decode node (`MessengerSink`) over a node whose blocks move between tiers.

A push ships first-tier pages only. Examples over real TCP nodes: a repeated prompt whose blocks were demoted
to SSD (the last one, which is computed again, and the prefix ones, whatever `promote_after`) streams whole
again, each block's bytes at the decode node those of the prefill node; in a batch that streams, a prefix block
one prompt pins on SSD is brought up for another prompt's push; a push whose parts fail mid-stream fails the
prefill (`TransferError` naming the blocks) rather than passing as streamed, leaving nothing at the decode node,
while a block the decode node had no room for is not counted as a failure; a streamed prompt whose blocks sit on
SSD while every DRAM page is pinned fails with CapacityError and keeps them there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")

import torch

from mooncake.cache.events import BlockRemoved
from mooncake.cache.hashing import reusable_prefix_tokens
from mooncake.cache.pool import PagePool
from mooncake.cache.ssd import SsdPagePool
from mooncake.cache.tiered import TieredCache
from mooncake.engine.prefill import MessengerSink, PrefillEngine
from mooncake.errors import CapacityError, TransferError
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.messenger import Messenger, shared_dram_pool
from mooncake.transfer.request import EngineConfig
from mooncake.types import BlockKey, Tier
from tests.engine.support import (
    SECRET,
    TINY,
    TOLERANCE,
    Node,
    assert_nothing_held,
    hasher,
    layout,
    page_bytes,
    tiered_cache,
)
from tests.engine.support import tiny_model as model

BLOCK = 4
PROMPT = [(5 * i + 1) % TINY.vocab_size for i in range(13)]  # 3 whole blocks of 4 and a partial one


@contextlib.contextmanager
def nodes(
    ssd_dir: Path | None = None, *, promote_after: int = 1, prefill_dram: int = 6, decode_dram: int = 64
) -> Iterator[tuple[Node, Node, str]]:
    """A prefill node (with `ssd_dir`, an SSD tier behind `prefill_dram` DRAM pages) connected over TCP on
    127.0.0.1 to a decode node of `decode_dram` DRAM pages; the third value is the decode node's peer name."""
    page = layout(BLOCK).page_bytes
    made: list[Node] = []
    try:
        for index, dram in enumerate((prefill_dram, decode_dram)):
            engine = TransferEngine(secret=SECRET, config=EngineConfig(transports=("tcp",), slice_bytes=1024))
            pool, region = shared_dram_pool(engine, page, dram)
            pools: list[PagePool] = [pool]
            if ssd_dir is not None and index == 0:
                pools.append(SsdPagePool(ssd_dir / "prefill.ssd", page, 64))
            cache = TieredCache(pools, promote_after=promote_after)
            made.append(Node(engine, cache, Messenger(engine, cache, region=region, lease_s=30.0, sweep_interval_s=0)))
        yield made[0], made[1], made[0].engine.connect(made[1].engine.address, transport="tcp")
    finally:
        for node in made:
            node.messenger.close()
            node.engine.close()
            node.cache.close()


def sink(node: Node, peer: str) -> MessengerSink:
    return MessengerSink(node.messenger, peer, num_layers=TINY.num_layers, timeout_s=10.0)


def assert_streamed_whole(prefill_node: Node, decode_node: Node, keys: tuple[BlockKey, ...]) -> None:
    """Every block is at the decode node, with the prefill node's bytes (which sit in its first tier)."""
    for key in keys:
        assert prefill_node.cache.tier_of(key) == Tier.DRAM
        assert page_bytes(decode_node.cache, key) == page_bytes(prefill_node.cache, key)


@pytest.mark.parametrize("promote_after", [1, 2, 0])
@pytest.mark.parametrize("num_tokens", [1, 8, 9, 13])
def test_a_repeated_prompt_whose_blocks_went_to_ssd_streams_whole_again(
    tmp_path: Path, promote_after: int, num_tokens: int
) -> None:
    """A prompt prefilled again after its blocks were demoted to SSD (and the decode node dropped its copies)
    streams every block: the last one, computed again, and the prefix ones, read from SSD whether or not the
    cache's policy promotes them on this read; its prefix is reused and its first token is the first prefill's."""
    tokens = PROMPT[:num_tokens]
    with nodes(tmp_path, promote_after=promote_after) as (prefill_node, decode_node, peer):
        with PrefillEngine(model(), prefill_node.cache, hasher(BLOCK)) as engine:
            first = engine.prefill(tokens, sink=sink(prefill_node, peer))
            prefill_node.cache.evict(len(first.keys))  # DRAM pressure from other requests
            assert all(prefill_node.cache.tier_of(key) == Tier.SSD for key in first.keys)
            for key in first.keys:  # the decode node finished the first request and dropped its copy
                decode_node.cache.remove(key)
            again = sink(prefill_node, peer)
            second = engine.prefill(tokens, sink=again)
        assert second.keys == first.keys
        assert set(again.committed) == set(first.keys)
        assert second.prefix_tokens == reusable_prefix_tokens(num_tokens, len(first.keys), BLOCK)
        assert second.first_token == first.first_token
        assert torch.allclose(second.logits, first.logits, **TOLERANCE)
        assert_streamed_whole(prefill_node, decode_node, first.keys)
        assert_nothing_held(prefill_node.cache, first.keys)
        assert_nothing_held(decode_node.cache, first.keys)


def test_a_batch_that_streams_brings_up_a_prefix_block_another_prompt_pins(tmp_path: Path) -> None:
    """A streamed prompt computes its last block, which a longer prompt of the same batch (not streamed) reuses
    from SSD as its prefix (promote_after=0: the read does not promote it): the pin the longer prompt holds
    does not keep that block on SSD, out of the streamed prompt's push."""
    short, long = PROMPT[:8], PROMPT
    with nodes(tmp_path, promote_after=0) as (prefill_node, decode_node, peer):
        with PrefillEngine(model(), prefill_node.cache, hasher(BLOCK)) as engine:
            cached = engine.prefill(short)
            prefill_node.cache.evict(len(cached.keys))
            assert all(prefill_node.cache.tier_of(key) == Tier.SSD for key in cached.keys)
            streamed = sink(prefill_node, peer)
            results = engine.prefill_batch([short, long], sinks=[streamed, None])
        assert results[0].prefix_tokens == BLOCK and results[1].prefix_tokens == 2 * BLOCK
        assert set(streamed.committed) == set(cached.keys)
        assert_streamed_whole(prefill_node, decode_node, cached.keys)
        assert_nothing_held(prefill_node.cache, results[1].keys)
        assert_nothing_held(decode_node.cache, cached.keys)


class CutMidStream(MessengerSink):
    """Before the second layer ships, the decode node stops serving its page region (as on its shutdown): that
    layer's writes fail at the peer, a failure mid-stream the push only learns of at its end."""

    def __init__(self, node: Node, peer: str, decode_node: Node) -> None:
        super().__init__(node.messenger, peer, num_layers=TINY.num_layers, timeout_s=10.0)
        self.decode_node = decode_node

    def layer_ready(self, layer: int) -> None:
        if layer == 1:
            self.decode_node.engine.unregister_memory(self.decode_node.messenger.region.region_id)
        super().layer_ready(layer)


def test_a_push_that_fails_mid_stream_fails_the_prefill() -> None:
    """Parts that fail mid-stream fail the prefill with a `TransferError` naming the blocks not committed (not
    a success whose hand-off finds them missing); the decode node holds none of them, the prefill node no pin."""
    with nodes() as (prefill_node, decode_node, peer):
        keys = hasher(BLOCK).block_keys(PROMPT)
        failed = pytest.raises(TransferError, match=f"committed 0 of the {len(keys)} blocks.*{keys[0]}")
        with PrefillEngine(model(), prefill_node.cache, hasher(BLOCK)) as engine, failed:
            engine.prefill(PROMPT, sink=CutMidStream(prefill_node, peer, decode_node))
        assert all(decode_node.cache.location(key) is None for key in keys)
        assert_nothing_held(prefill_node.cache, keys)


def test_a_block_the_decode_node_has_no_room_for_is_not_a_failed_push() -> None:
    """A decode node with room for two of the prompt's blocks: the push sends those two, the peer commits them,
    and the prefill succeeds (the hand-off, not the stream, reports the missing room)."""
    with nodes(decode_dram=2) as (prefill_node, decode_node, peer):
        streamed = sink(prefill_node, peer)
        with PrefillEngine(model(), prefill_node.cache, hasher(BLOCK)) as engine:
            result = engine.prefill(PROMPT[:12], sink=streamed)
        assert len(result.keys) == 3
        assert streamed.committed == result.keys[:2]
        assert all(key in decode_node.cache for key in result.keys[:2])
        assert_nothing_held(prefill_node.cache, result.keys)
        assert_nothing_held(decode_node.cache, result.keys)


class QuietSink:
    """A `KvSink` that sends nothing: what a streaming prefill does to the local cache, without a decode node."""

    def begin(self, keys: tuple[BlockKey, ...]) -> None:
        pass

    def layer_ready(self, layer: int) -> None:
        pass

    def end(self) -> None:
        pass

    def abort(self) -> None:
        pass


@pytest.mark.parametrize(
    ("tokens", "prefix_tokens"),
    [(list(range(9)), 2 * BLOCK), ([7, 8, 9, 10], 0)],
    ids=["a prefix block lifted", "a block computed whole"],
)
def test_a_streaming_prefill_that_finds_no_first_tier_room_keeps_the_lower_tier_copy(
    tmp_path: Path, tokens: list[int], prefix_tokens: int
) -> None:
    """A streamed prompt whose blocks sit on SSD while another holder pins every DRAM page fails with a
    CapacityError naming the first block, which stays on SSD with its bytes (no removal announced), and streams
    once the pins are gone. A block of its cached prefix (`_lift`) or one it computes whole (`_overwrite_if_lower`)
    lost its SSD copy before: it was removed there, then the first-tier reserve raised, leaving it in no tier."""
    cache = tiered_cache(BLOCK, tmp_path / "prefill.ssd", dram_pages=3, ssd_pages=16, promote_after=1000)
    try:
        with PrefillEngine(model(), cache, hasher(BLOCK)) as engine:
            keys = engine.prefill(tokens).keys
            others = engine.prefill(list(range(100, 112))).keys  # three blocks: the prompt's go down to SSD
            assert all(cache.tier_of(key) == Tier.SSD for key in keys)
            before = [page_bytes(cache, key) for key in keys]
            for key in others:  # a decode copy, a push: every DRAM page is pinned
                cache.pin(key)
            cache.take_events()
            with pytest.raises(CapacityError) as raised:
                engine.prefill(tokens, sink=QuietSink())
            assert [cache.tier_of(key) for key in keys] == [Tier.SSD] * len(keys)
            assert [page_bytes(cache, key) for key in keys] == before
            assert not [event for event in cache.take_events() if isinstance(event, BlockRemoved)]
            assert str(raised.value).startswith(f"no room to move block {keys[0]} up to DRAM, it stays in SSD")
            for key in others:
                cache.unpin(key)
            again = engine.prefill(tokens, sink=QuietSink())
        assert again.keys == keys and again.prefix_tokens == prefix_tokens
        assert all(cache.tier_of(key) == Tier.DRAM for key in keys)
        assert_nothing_held(cache, keys + others)
    finally:
        cache.close()
