"""`VllmEventDecoder` across vLLM's prefix-cache resets, and a refused batch leaving no trace.

vLLM 0.32 publishes `AllBlocksCleared` from one place, its GPU pool (`BlockPool.reset_prefix_cache`,
``vllm/v1/core/block_pool.py``). `Scheduler.reset_prefix_cache` resets the offloading connector (the CPU tier)
only when asked (``reset_connector=True``), and the connector's `reset_cache` (``v1/kv_offload/cpu/manager.py``)
publishes nothing. So after an ordinary ``/reset_prefix_cache`` vLLM still serves the offloaded prefixes from
CPU: the decoder must drop the GPU's holdings alone. The events below are made as vLLM makes them
(`test_vllm_events_copies` has the forms; the recordings ``vllm_0_32_*.json`` the real shapes).

Layers: the scripted reset sequence; examples of what a clear leaves; the epoch `restart` takes; a property
that a refused batch, however it fails (a hash never stored, a medium not known, an event that cannot be
made, a restart undone), leaves the decoder exactly as it was, so a retry counts every copy once.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.cache import vllm_events
from mooncake.cache.events import AllBlocksCleared, BlockRemoved
from mooncake.cache.index import BlockIndex
from mooncake.cache.vllm_events import VllmEventDecoder, VllmEventEncoder
from mooncake.cache.vllm_wire import VllmAllBlocksCleared
from mooncake.errors import ConfigError, MooncakeError, UnknownBlockError, VllmEventError
from mooncake.types import Tier
from tests.cache.test_vllm_events import HASHER, SOURCE, decoded, payload, removed_wire
from tests.cache.test_vllm_events_copies import (
    HASHES,
    KEYS,
    TOKENS,
    feed,
    gpu_stored,
    maybe_convert_block_hash,
    offload_removed,
    offloaded,
    tiers_of,
)
from tests.cache.test_vllm_events_edges import BLOCKS, external, store_of

pytest.importorskip("msgpack", reason="msgpack (the kv-events extra) is not installed")

CLEARED = {"type": "AllBlocksCleared"}  # what BlockPool.reset_prefix_cache appends to its event queue


# ---------------------------------------------------------------------- vLLM's reset_prefix_cache


def test_a_gpu_reset_keeps_what_the_cpu_tier_holds() -> None:
    """A request's four blocks are cached on the GPU, the offloading connector copies them to CPU in two chunks
    of two, then ``/reset_prefix_cache`` clears the GPU pool (the connector is not reset). The clear is the
    removal of the four blocks from VRAM; DRAM keeps them, so the index still matches the whole prefix, as vLLM
    serves it from CPU. Later events go on: the connector evicting a chunk takes its two blocks from DRAM, and
    the GPU storing the blocks again finds their parents."""
    d, index = VllmEventDecoder(HASHER, SOURCE, blocks_per_chunk=2), BlockIndex()
    feed(d, index, [[gpu_stored(TOKENS, 0, 4)], [offloaded([HASHES[1], HASHES[3]], form="0.32")]])
    assert [tiers_of(index, key) for key in KEYS] == [{Tier.VRAM, Tier.DRAM}] * 4
    out = decoded(d.decode(payload([CLEARED]), seq=d.expected_seq))
    assert out == (BlockRemoved(source=SOURCE, seq=2, keys=KEYS, tier=Tier.VRAM),)
    for event in out:
        index.apply(event)
    d.check_invariants()
    assert [tiers_of(index, key) for key in KEYS] == [{Tier.DRAM}] * 4
    assert index.match(KEYS).length(SOURCE) == 4
    assert [(d.num_copies(h, Tier.VRAM), d.num_copies(h, Tier.DRAM)) for h in HASHES] == [(0, 1)] * 4
    feed(d, index, [[offload_removed([HASHES[3]], form="0.32")], [gpu_stored(TOKENS, 2, 4)]])
    assert [tiers_of(index, key) for key in KEYS] == [{Tier.DRAM}] * 2 + [{Tier.VRAM}] * 2
    assert index.match(KEYS).length(SOURCE) == 4


def test_a_gpu_reset_retires_blocks_held_nowhere_else_and_drops_the_gpus_chunks() -> None:
    """A block only the GPU held is retired (no tier holds it; its hash still translates, for a late child); a
    chunk recorded for the GPU tier goes with it, so a later GPU removal of its hash takes only itself. A clear
    of an empty GPU publishes nothing but uses its number."""
    d, index = VllmEventDecoder(HASHER, SOURCE, blocks_per_chunk=2), BlockIndex()
    chunk_on_gpu = offloaded([HASHES[1]], form="0.32") | {"medium": "GPU"}
    feed(d, index, [[gpu_stored(TOKENS, 0, 2), chunk_on_gpu]])
    assert d.num_copies(HASHES[0], Tier.VRAM) == 2  # its own copy and the chunk's
    feed(d, index, [[CLEARED]])
    d.check_invariants()
    assert [tiers_of(index, key) for key in KEYS[:2]] == [set(), set()]
    assert [d.num_copies(h, Tier.VRAM) for h in HASHES[:2]] == [0, 0]
    assert d.key_of(maybe_convert_block_hash(HASHES[1])) == KEYS[1]
    feed(d, index, [[gpu_stored(TOKENS, 0, 2)], [removed_wire([maybe_convert_block_hash(HASHES[1])])]])
    assert [tiers_of(index, key) for key in KEYS[:2]] == [{Tier.VRAM}, set()]
    (out,) = decoded(d.decode(payload([CLEARED]), seq=d.expected_seq))
    assert (type(out), out.keys, out.tier) == (BlockRemoved, KEYS[:1], Tier.VRAM)  # type: ignore[union-attr]
    expected = d.expected_seq
    assert decoded(d.decode(payload([CLEARED]), seq=expected)) == ()
    assert d.expected_seq == expected + 1


def test_the_gpu_is_the_tier_of_the_gpu_medium() -> None:
    """With a tier map that puts vLLM's GPU medium elsewhere, the clear removes from that tier."""
    d = VllmEventDecoder(HASHER, SOURCE, tiers={"GPU": Tier.DRAM, "CPU": Tier.SSD})
    decoded(d.decode(payload([gpu_stored(TOKENS, 0, 1)]), seq=0))
    assert decoded(d.decode(payload([CLEARED]), seq=1)) == (
        BlockRemoved(source=SOURCE, seq=1, keys=KEYS[:1], tier=Tier.DRAM),
    )


def test_this_librarys_all_blocks_cleared_still_means_the_whole_source() -> None:
    """Other producers' AllBlocksCleared empties every tier of their source in the index, and the encoder still
    writes it as vLLM's (which a vLLM consumer reads as the GPU's)."""
    index = BlockIndex()
    d = VllmEventDecoder(HASHER, SOURCE, blocks_per_chunk=2)
    feed(d, index, [[gpu_stored(TOKENS, 0, 2)], [offloaded([HASHES[1]], form="0.32")]])
    index.apply(AllBlocksCleared(source=SOURCE, seq=2))
    assert [tiers_of(index, key) for key in KEYS[:2]] == [set(), set()]
    assert VllmEventEncoder(HASHER).to_vllm(AllBlocksCleared(source=SOURCE, seq=0)) == (VllmAllBlocksCleared(),)


# ---------------------------------------------------------------------- restart's epoch


@pytest.mark.parametrize("epoch", [-1, "1", 1.0, 2.5, True])
def test_restart_refuses_an_epoch_the_constructor_refuses(epoch: Any) -> None:
    """`restart(epoch=...)` checks it as the constructor does (ConfigError naming it) and forgets nothing; before,
    it took any value and the next batch failed while its events were built, half applied."""
    d = VllmEventDecoder(HASHER, SOURCE)
    decoded(d.decode(payload([gpu_stored(TOKENS, 0, 1)]), seq=0))
    before = snapshot(d)
    with pytest.raises(ConfigError, match="epoch"):
        d.restart(epoch=epoch)
    assert snapshot(d) == before
    d.restart(epoch=7)
    assert (d.epoch, d.expected_seq, d.key_of(maybe_convert_block_hash(HASHES[0]))) == (7, 0, None)


def test_an_event_that_cannot_be_made_refuses_the_whole_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """An event of ours that fails to build (here forced) refuses the batch like any other failure: the copies it
    counted are undone and the same seq is expected again, so the retry counts each copy once."""
    d = VllmEventDecoder(HASHER, SOURCE)
    batch = payload([gpu_stored(TOKENS, 0, 1)])
    with monkeypatch.context() as patched:
        patched.setattr(vllm_events, "BlockStored", Unbuildable)
        with pytest.raises(VllmEventError, match="cannot be built"):
            d.decode(batch, seq=0)
    assert (d.expected_seq, d.num_copies(HASHES[0], Tier.VRAM)) == (0, 0)
    decoded(d.decode(batch, seq=0))
    assert (d.expected_seq, d.num_copies(HASHES[0], Tier.VRAM)) == (1, 1)


# ---------------------------------------------------------------------- a refused batch leaves no trace


class Unbuildable:
    """Stands in for an event class whose events cannot be made."""

    def __init__(self, **fields: Any) -> None:
        raise VllmEventError(f"an event of {sorted(fields)} cannot be built")


def snapshot(d: VllmEventDecoder) -> tuple[Any, ...]:
    """Everything a batch may change (white box; the held and the retired in their order, which decides what a
    clear retires first and which retired hash goes first), but the stamps' clock, which only orders them, and
    `group_kinds`, a fact of the server kept whatever the batch's fate."""
    return (
        *holdings(d),
        d.num_redelivered,
        dict(d._held_at),
        list(d._retired.items()),
        list(d._applied.items()),
    )


def holdings(d: VllmEventDecoder) -> tuple[Any, ...]:
    """What two decoders given the same batches agree on (their stamps may differ)."""
    return (
        d.epoch,
        d.expected_seq,
        d._seq,
        d.num_skipped,
        dict(d._keys),
        list(d._held.items()),
        list(d._retired),
        dict(d._parents),
        dict(d._chunks),
    )


MEDIUMS = ["GPU", "CPU", "STORAGE"]
events = st.one_of(
    st.builds(store_of, st.sampled_from(BLOCKS), st.sampled_from(MEDIUMS)),
    st.builds(lambda i, m: removed_wire([external(i)], m), st.sampled_from(BLOCKS), st.sampled_from(MEDIUMS)),
    st.just(CLEARED),
)
batches = st.lists(st.lists(events, max_size=4), max_size=6)
FAILURES = ["unknown hash", "unknown medium", "unbuildable"]


def deliver(d: VllmEventDecoder, events: list[dict[str, Any]], seq: int, ts: float = 1.0) -> object:
    """The decoder's answer to a batch: its events, or the kind of error that refused it."""
    try:
        return d.decode(payload(events, ts=ts), seq=seq)
    except MooncakeError as error:
        return type(error)


@settings(max_examples=150, deadline=None)
@given(
    before=batches,
    refused=st.lists(events, max_size=4),
    failure=st.sampled_from(FAILURES),
    as_restart=st.booleans(),
    after=batches,
    lenient=st.booleans(),
)
def test_a_refused_batch_leaves_the_decoder_as_it_was(
    before: list[list[dict[str, Any]]],
    refused: list[dict[str, Any]],
    failure: str,
    as_restart: bool,
    after: list[list[dict[str, Any]]],
    lenient: bool,
) -> None:
    """Two decoders take the same batches; one also a batch that is refused: valid events, then one that fails
    (a removal of a hash never stored, a medium not in the tier map, or an event of ours that cannot be made),
    numbered next or, as a restart of vLLM, 0 with another timestamp. The refused one's whole state is as before,
    and both answer every later batch alike, so nothing of the refused batch counts twice when it is replayed."""
    seen, unseen = (VllmEventDecoder(HASHER, SOURCE, strict=not lenient, max_retired_hashes=2) for _ in range(2))
    for seq, events_ in enumerate(before):
        assert deliver(seen, events_, seq) == deliver(unseen, events_, seq)
    state = snapshot(seen)
    seq, ts = (0, 2.0) if as_restart and seen.expected_seq else (seen.expected_seq, 1.0)
    with pytest.MonkeyPatch.context() as patched:
        if failure == "unknown hash":
            tail = [removed_wire([b"never stored"])]
        elif failure == "unknown medium":
            tail = [store_of(1, "TAPE")]
        else:  # a root's store always makes an event; none can be made
            tail = [store_of(1, "GPU")]
            patched.setattr(vllm_events, "BlockStored", Unbuildable)
            patched.setattr(vllm_events, "BlockRemoved", Unbuildable)
        answer = deliver(seen, [*refused, *tail], seq, ts)
    if not (lenient and failure == "unknown hash"):  # lenient decoders skip an unknown hash
        assert answer in (UnknownBlockError, VllmEventError)
        assert snapshot(seen) == state
    else:
        assert deliver(unseen, [*refused, *tail], seq, ts) == answer
    seen.check_invariants()
    for number, events_ in enumerate(after, start=unseen.expected_seq):
        assert deliver(seen, events_, number) == deliver(unseen, events_, number)
        assert holdings(seen) == holdings(unseen)
    assert [seen.key_of(external(i)) for i in BLOCKS] == [unseen.key_of(external(i)) for i in BLOCKS]
    assert holdings(seen) == holdings(unseen)


def test_a_gpu_reset_after_a_loss_leaves_blocks_of_unknown_copies_alone() -> None:
    """After `skip_to` the copies are unknown (all zero) and no index holds the blocks in the new epoch: the clear
    publishes nothing for them and keeps them translatable; a block stored since is removed from VRAM."""
    d = VllmEventDecoder(HASHER, SOURCE)
    decoded(d.decode(payload([gpu_stored(TOKENS, 0, 2)]), seq=0))
    d.skip_to(5)
    decoded(d.decode(payload([gpu_stored(TOKENS, 2, 3)]), seq=5))
    (out,) = decoded(d.decode(payload([CLEARED]), seq=6))
    assert (type(out), out.keys, out.tier) == (BlockRemoved, KEYS[2:3], Tier.VRAM)  # type: ignore[union-attr]
    assert [d.key_of(maybe_convert_block_hash(h)) for h in HASHES[:3]] == list(KEYS[:3])
    d.check_invariants()
