"""`mooncake.cache.vllm_events` against what vLLM's block pool and offloading connector publish.

The events here are made the way vLLM 0.32's code makes them (read from its source; vLLM itself is not
imported: these tests run without it):

- `BlockPool.cache_full_blocks` (``vllm/v1/core/block_pool.py``): one `BlockStored` per call, the newly cached
  full blocks of a request, their hashes through `maybe_convert_block_hash` (``kv_cache_utils.py``: by default
  the int ``int.from_bytes(h, "big") & (2**64 - 1)``), the parent's too, and exactly `block_size` tokens each.
  `BlockHashToBlockMap` does not de-duplicate: two requests that computed one block at once hold two physical
  copies, each announced, and `_maybe_evict_cached_block` publishes one `BlockRemoved` per evicted copy.
  `emit_cached_block_events` (requests with ``kv_cache_report_mode="full"``) re-announces the blocks a request
  reuses, from block 0, with no parent: no new copy.
- The offloading connector names each chunk of ``blocks_per_chunk`` GPU blocks by its last block's hash
  (`RequestOffloadState.update_offload_keys`: ``make_offload_key(h, group)``, ``h + group.to_bytes(4)``);
  vLLM 0.32 publishes it as `maybe_convert_block_hash(get_offload_block_hash(key))`
  (`OffloadingEventsTracker._placeholder_stored`), earlier releases as the raw bytes `get_offload_block_hash(key)`
  (``key[:-4]``), with block size 0 (or, in some releases, the chunk's tokens).

Layers: examples of each form and mode; a property against a model of vLLM's block pool and CPU tier (physical
copies per hash, chunks per key), whose holdings an index fed the decoder's events must equal after every batch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.cache.events import BlockRemoved
from mooncake.cache.index import BlockIndex
from mooncake.cache.vllm_events import VllmEventDecoder, index_hash
from mooncake.errors import ConfigError, VllmEventError
from mooncake.types import BlockKey, Tier
from tests.cache.test_vllm_events import BLOCK, HASHER, SOURCE, decoded, payload, removed_wire, stored_wire

pytest.importorskip("msgpack", reason="msgpack (the kv-events extra) is not installed")


# ---------------------------------------------------------------------- vLLM's hashes, as its code makes them


def vllm_block_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """A `BlockHash`: SHA-256 bytes chained over the parent's (vLLM's `hash_block_tokens`, in spirit)."""
    return hashlib.sha256((parent or b"none") + repr(list(tokens)).encode()).digest()


def vllm_hashes(tokens: Sequence[int]) -> list[bytes]:
    """`Request.block_hashes`: one per full block."""
    hashes: list[bytes] = []
    for start in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
        hashes.append(vllm_block_hash(hashes[-1] if hashes else None, tokens[start : start + BLOCK]))
    return hashes


def maybe_convert_block_hash(block_hash: bytes, *, use_int: bool = True) -> int | bytes:
    """`vllm.v1.core.kv_cache_utils.maybe_convert_block_hash` (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: `use_int`)."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1) if use_int else block_hash


def get_offload_block_hash(block_hash: bytes, group_idx: int = 0) -> bytes:
    """`get_offload_block_hash(make_offload_key(block_hash, group_idx))`: the key's bytes but the group's 4."""
    key = block_hash + group_idx.to_bytes(4, "big", signed=False)
    return key[:-4]


def gpu_stored(
    tokens: Sequence[int], start: int, end: int, *, use_int: bool = True, parent: bool = True
) -> dict[str, Any]:
    """`cache_full_blocks`' event for blocks [start, end) of a request: `parent=False` gives the re-announcement
    of `emit_cached_block_events` (start 0, no parent)."""
    hashes = vllm_hashes(tokens)
    parent_hash = maybe_convert_block_hash(hashes[start - 1], use_int=use_int) if start and parent else None
    return stored_wire(
        [maybe_convert_block_hash(h, use_int=use_int) for h in hashes[start:end]],
        parent_hash,
        tokens[start * BLOCK : end * BLOCK],
    )


def offloaded(chunk_ends: Sequence[bytes], *, form: str, block_size: int = 0) -> dict[str, Any]:
    """The offloading connector's placeholder `BlockStored` of chunks named by their last blocks' hashes: `form`
    "0.32" converts them as the GPU pool does, "raw" is earlier releases' bytes."""
    named = [get_offload_block_hash(h) for h in chunk_ends]
    if form == "0.32":
        named = [maybe_convert_block_hash(h) for h in named]  # type: ignore[misc]
    return stored_wire(named, None, [], medium="CPU", block_size=block_size)


def offload_removed(chunk_ends: Sequence[bytes], *, form: str) -> dict[str, Any]:
    named: list[Any] = [get_offload_block_hash(h) for h in chunk_ends]
    if form == "0.32":
        named = [maybe_convert_block_hash(h) for h in named]
    return removed_wire(named, "CPU")


TOKENS = list(range(100, 100 + 4 * BLOCK))
KEYS = HASHER.block_keys(TOKENS)
HASHES = vllm_hashes(TOKENS)


def feed(d: VllmEventDecoder, index: BlockIndex, batches: Sequence[Sequence[dict[str, Any]]]) -> None:
    for events in batches:
        for event in decoded(d.decode(payload(events), seq=d.expected_seq)):
            assert index.apply(event) is None
        d.check_invariants()


def tiers_of(index: BlockIndex, key: BlockKey) -> set[Tier]:
    return {holder.tier for holder in index.holders(key) if holder.instance_id == SOURCE}


# ---------------------------------------------------------------------- hash forms


@pytest.mark.parametrize("form", ["raw", "0.32"])
@pytest.mark.parametrize("use_int", [True, False])
def test_a_cpu_copy_finds_its_gpu_block_in_every_hash_form(form: str, use_int: bool) -> None:
    """The GPU pool publishes a block's hash as an int (vLLM's default) or as its bytes; the offloading connector
    as its bytes (earlier releases) or converted like the pool's (0.32). Every pairing names the same block: its
    copy to CPU joins the DRAM tier and its removal leaves it (the raw bytes were "never stored": strict decoders
    refused the batch, lenient ones skipped every CPU copy). `key_of` answers every form."""
    d, index = VllmEventDecoder(HASHER, SOURCE), BlockIndex()
    feed(d, index, [[gpu_stored(TOKENS, 0, 2, use_int=use_int)], [offloaded(HASHES[:2], form=form)]])
    assert [tiers_of(index, key) for key in KEYS[:2]] == [{Tier.VRAM, Tier.DRAM}] * 2
    for block_hash in (HASHES[1], maybe_convert_block_hash(HASHES[1]), index_hash(HASHES[1])):
        assert d.key_of(block_hash) == KEYS[1]
    feed(d, index, [[offload_removed(HASHES[1:2], form=form)], [removed_wire([HASHES[0]], "GPU")]])
    assert [tiers_of(index, key) for key in KEYS[:2]] == [{Tier.DRAM}, {Tier.VRAM}]
    assert d.num_skipped == 0


def test_index_hash_is_the_low_64_bits_of_every_form() -> None:
    """Bytes read big-endian, ints (signed ones too, from older vLLM's Python `hash`) taken modulo 2**64."""
    assert (
        index_hash(HASHES[0]) == maybe_convert_block_hash(HASHES[0]) == index_hash(maybe_convert_block_hash(HASHES[0]))
    )
    assert index_hash(-1) == index_hash(b"\xff" * 8) == (1 << 64) - 1
    assert index_hash(b"\x01") == index_hash(1) == 1


# ---------------------------------------------------------------------- chunks


@pytest.mark.parametrize(
    ("options", "block_size"), [({"blocks_per_chunk": 2}, 0), ({}, 2 * BLOCK)], ids=["option", "event"]
)
def test_a_chunk_named_by_its_last_block_stands_for_all_its_blocks(options: dict[str, Any], block_size: int) -> None:
    """With 2 GPU blocks a chunk, the connector names chunk 0 by block 1's hash and chunk 1 by block 3's: all four
    blocks join DRAM (a DRAM prefix match sees them), and a chunk's removal takes both its blocks out. The chunk's
    size is the decoder's `blocks_per_chunk` where the event gives none, else the event's block size (some
    releases write the chunk's tokens)."""
    d, index = VllmEventDecoder(HASHER, SOURCE, **options), BlockIndex()
    feed(
        d, index, [[gpu_stored(TOKENS, 0, 4)], [offloaded([HASHES[1], HASHES[3]], form="0.32", block_size=block_size)]]
    )
    assert [tiers_of(index, key) for key in KEYS] == [{Tier.VRAM, Tier.DRAM}] * 4
    feed(
        d,
        index,
        [[removed_wire([maybe_convert_block_hash(h) for h in HASHES])], [offload_removed([HASHES[3]], form="0.32")]],
    )
    assert [tiers_of(index, key) for key in KEYS] == [{Tier.DRAM}, {Tier.DRAM}, set(), set()]
    assert index.match(KEYS).length(SOURCE) == 2


def test_chunks_sharing_blocks_hold_them_until_the_last_goes() -> None:
    """Two chunks of 2 that share their first block (prompts diverging inside the chunk) count it twice in DRAM:
    the first chunk's removal keeps it, the second's takes it."""
    other = [*TOKENS[:BLOCK], *range(900, 900 + BLOCK)]
    other_hashes, other_keys = vllm_hashes(other), HASHER.block_keys(other)
    d, index = VllmEventDecoder(HASHER, SOURCE, blocks_per_chunk=2), BlockIndex()
    feed(
        d,
        index,
        [[gpu_stored(TOKENS, 0, 2), gpu_stored(other, 1, 2)], [offloaded([HASHES[1], other_hashes[1]], form="raw")]],
    )
    assert d.num_copies(HASHES[0], Tier.DRAM) == 2
    feed(d, index, [[offload_removed([HASHES[1]], form="raw")]])
    assert [tiers_of(index, key) for key in (KEYS[0], KEYS[1], other_keys[1])] == [
        {Tier.VRAM, Tier.DRAM},
        {Tier.VRAM},
        {Tier.VRAM, Tier.DRAM},
    ]
    feed(d, index, [[offload_removed([other_hashes[1]], form="raw")]])
    assert Tier.DRAM not in tiers_of(index, KEYS[0])


def test_a_block_size_that_is_no_whole_number_of_blocks_is_refused() -> None:
    """A token-less BlockStored whose block size is not a multiple of the hasher's is a VllmEventError naming both;
    `blocks_per_chunk` below 1 and an unknown `report_mode` are ConfigErrors."""
    d = VllmEventDecoder(HASHER, SOURCE)
    feed(d, BlockIndex(), [[gpu_stored(TOKENS, 0, 2)]])
    with pytest.raises(VllmEventError, match=f"block_size {BLOCK + 1}, not a multiple of the hasher's {BLOCK}"):
        d.decode(payload([offloaded(HASHES[:1], form="raw", block_size=BLOCK + 1)]), seq=1)
    with pytest.raises(ConfigError, match="blocks_per_chunk"):
        VllmEventDecoder(HASHER, SOURCE, blocks_per_chunk=0)
    with pytest.raises(ConfigError, match="report_mode"):
        VllmEventDecoder(HASHER, SOURCE, report_mode="all")


# ---------------------------------------------------------------------- copies


def test_each_physical_copy_of_a_block_is_counted() -> None:
    """Two requests computed the same two blocks at once: vLLM holds two physical copies of each, announced twice.
    One copy of block 1 evicted: vLLM still serves it, and the index still matches both blocks (the first removal
    used to drop it); the second eviction takes it."""
    d, index = VllmEventDecoder(HASHER, SOURCE), BlockIndex()
    feed(d, index, [[gpu_stored(TOKENS, 0, 2)], [gpu_stored(TOKENS, 0, 2)]])
    assert d.num_copies(HASHES[1], Tier.VRAM) == 2
    feed(d, index, [[removed_wire([maybe_convert_block_hash(HASHES[1])])]])
    assert index.match(KEYS[:2]).length(SOURCE) == 2
    out = decoded(d.decode(payload([removed_wire([maybe_convert_block_hash(HASHES[1])])]), seq=d.expected_seq))
    assert out == (BlockRemoved(source=SOURCE, seq=2, keys=KEYS[1:2], tier=Tier.VRAM),)  # the first made none


@pytest.mark.parametrize("mode", ["incremental", "full"])
def test_a_reused_blocks_reannouncement_adds_no_copy_in_full_report_mode(mode: str) -> None:
    """Requests with kv_cache_report_mode "full" make vLLM re-announce the cached blocks they reuse (from block 0, no
    parent): with `report_mode="full"` that is no copy, and one eviction drops the block; a copy stored after a
    parent is one all the same. In "incremental" mode (vLLM's default) every BlockStored is a copy."""
    d, index = VllmEventDecoder(HASHER, SOURCE, report_mode=mode), BlockIndex()
    feed(d, index, [[gpu_stored(TOKENS, 0, 2)], [gpu_stored(TOKENS, 0, 2, parent=False), gpu_stored(TOKENS, 1, 3)]])
    assert [d.num_copies(h, Tier.VRAM) for h in HASHES[:3]] == ([1, 2, 1] if mode == "full" else [2, 3, 1])
    out = decoded(d.decode(payload([removed_wire([maybe_convert_block_hash(HASHES[0])])]), seq=d.expected_seq))
    assert [e.keys for e in out] == ([KEYS[:1]] if mode == "full" else [])  # type: ignore[union-attr]


def test_skip_to_counts_copies_from_zero() -> None:
    """After lost batches the counts are unknown: `skip_to` starts them from zero (translations kept), so the next
    removal of a block held before is published (two copies counted, one lost removal, a store: the removal of
    that store used to leave the block held for ever)."""
    d, index = VllmEventDecoder(HASHER, SOURCE), BlockIndex()
    feed(d, index, [[gpu_stored(TOKENS, 0, 1)], [gpu_stored(TOKENS, 0, 1)]])
    d.skip_to(5)
    d.check_invariants()
    assert d.key_of(HASHES[0]) == KEYS[0] and d.num_copies(HASHES[0], Tier.VRAM) == 0
    feed(d, index, [[gpu_stored(TOKENS, 0, 1)], [removed_wire([maybe_convert_block_hash(HASHES[0])])]])
    assert tiers_of(index, KEYS[0]) == set()


# ---------------------------------------------------------------------- a model of vLLM's block pool

PROMPTS = [list(range(1, 1 + 4 * BLOCK)), [*range(1, 1 + 2 * BLOCK), *range(50, 50 + 2 * BLOCK)], list(range(70, 78))]
CHUNK = 2  # GPU blocks per offloaded chunk


class VllmModel:
    """vLLM's GPU pool and CPU tier, as far as their events go: physical copies per hash (a pool of `num_blocks`
    ids, evicting the oldest cached copy when full) and the chunks offloaded to CPU (each key stored once)."""

    def __init__(self, num_blocks: int, *, use_int: bool, form: str, report_mode: str) -> None:
        self.num_blocks, self.use_int, self.form, self.report_mode = num_blocks, use_int, form, report_mode
        self.copies: list[tuple[int, bytes]] = []  # (block id, hash) of cached GPU copies, oldest first
        self.next_id = 0
        self.cpu: dict[bytes, tuple[bytes, ...]] = {}  # chunk key → the hashes of its blocks
        self.tokens: dict[bytes, tuple[int, ...]] = {}  # hash → the prompt up to its block

    def _hash(self, block_hash: bytes) -> int | bytes:
        return maybe_convert_block_hash(block_hash, use_int=self.use_int)

    def compute(self, prompt: list[int], upto: int, seen: int) -> list[dict[str, Any]]:
        """A request computes blocks [0, upto): it reuses the cached leading blocks it sees (at most `seen`, fewer
        when another request is still computing them: those it computes again, a second copy) and stores the rest."""
        hashes = vllm_hashes(prompt)[:upto]
        cached = {h for _, h in self.copies}
        hit = 0
        while hit < min(seen, len(hashes)) and hashes[hit] in cached:
            hit += 1
        events = []
        if hit and self.report_mode == "full":
            events.append(gpu_stored(prompt, 0, hit, use_int=self.use_int, parent=False))
        new = hashes[hit:]
        if not new or len(new) > self.num_blocks:
            return events
        if not hit and self.report_mode == "full" and any(h in cached for h in new):
            return events  # a duplicate from block 0: in "full" mode, read as a re-announcement (documented)
        while len(self.copies) + len(new) > self.num_blocks:
            _, evicted = self.copies.pop(0)
            events.append(removed_wire([self._hash(evicted)]))
        for block_hash in new:
            self.copies.append((self.next_id, block_hash))
            self.next_id += 1
        for i, block_hash in enumerate(hashes):
            self.tokens[block_hash] = tuple(prompt[: (i + 1) * BLOCK])
        events.append(gpu_stored(prompt, hit, upto, use_int=self.use_int))
        return events

    def offload(self, prompt: list[int]) -> list[dict[str, Any]]:
        """The connector stores the chunks of the prompt's blocks the GPU holds now, those not stored yet."""
        hashes = vllm_hashes(prompt)
        cached = {h for _, h in self.copies}
        new = []
        for end in range(CHUNK, len(hashes) + 1, CHUNK):
            chunk = tuple(hashes[end - CHUNK : end])
            if all(h in cached for h in chunk) and chunk[-1] not in self.cpu:
                self.cpu[chunk[-1]] = chunk
                new.append(chunk[-1])
        return [offloaded(new, form=self.form)] if new else []

    def cpu_evict(self, which: int) -> list[dict[str, Any]]:
        if not self.cpu:
            return []
        key = sorted(self.cpu)[which % len(self.cpu)]
        del self.cpu[key]
        return [offload_removed([key], form=self.form)]

    def holdings(self) -> dict[tuple[int, ...], set[Tier]]:
        """Prompt prefix (of whole blocks) → the tiers holding its last block."""
        held: dict[tuple[int, ...], set[Tier]] = {}
        for _, block_hash in self.copies:
            held.setdefault(self.tokens[block_hash], set()).add(Tier.VRAM)
        for chunk in self.cpu.values():
            for block_hash in chunk:
                held.setdefault(self.tokens[block_hash], set()).add(Tier.DRAM)
        return held


operations = st.lists(
    st.one_of(
        st.tuples(st.just("compute"), st.integers(0, len(PROMPTS) - 1), st.integers(1, 4), st.integers(0, 4)),
        st.tuples(st.just("offload"), st.integers(0, len(PROMPTS) - 1), st.just(0), st.just(0)),
        st.tuples(st.just("cpu_evict"), st.integers(0, 7), st.just(0), st.just(0)),
    ),
    max_size=25,
)


@settings(max_examples=120, deadline=None)
@given(
    operations,
    st.integers(min_value=2, max_value=6),
    st.booleans(),
    st.sampled_from(["raw", "0.32"]),
    st.sampled_from(["incremental", "full"]),
)
def test_an_index_fed_the_decoder_holds_what_vllms_pool_holds(
    ops: list[tuple[str, int, int, int]], num_blocks: int, use_int: bool, form: str, report_mode: str
) -> None:
    """Requests compute prompts (re-computing blocks another request is still computing: duplicate copies),
    vLLM evicts copies to make room, the connector offloads chunks of 2 blocks to CPU and evicts them, hashes in
    every form vLLM writes, in both report modes: after every batch, the index fed the decoder's events holds
    each block in exactly the tiers that hold a copy of it in the model. (Where a duplicate starts at block 0 in
    "full" mode, the decoder cannot tell it from a re-announcement: the model then makes none.)"""
    model = VllmModel(num_blocks, use_int=use_int, form=form, report_mode=report_mode)
    d = VllmEventDecoder(HASHER, SOURCE, blocks_per_chunk=CHUNK, report_mode=report_mode)
    index = BlockIndex()
    for kind, which, upto, seen in ops:
        if kind == "compute":
            events = model.compute(PROMPTS[which], upto, seen)
        elif kind == "offload":
            events = model.offload(PROMPTS[which])
        else:
            events = model.cpu_evict(which)
        feed(d, index, [events])
        expected = model.holdings()
        for prompt in PROMPTS:
            for i, key in enumerate(HASHER.block_keys(prompt)):
                assert tiers_of(index, key) == expected.get(tuple(prompt[: (i + 1) * BLOCK]), set()), (kind, i)
