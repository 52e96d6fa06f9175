"""Edge contracts of `mooncake.cache.vllm_wire` and `mooncake.cache.vllm_events` that the main tests leave open.

Layers: malformed fields a vLLM (or a broken producer) might send, each refused with a
`VllmEventError` naming the field and nothing applied; a state machine of one decoder's
holdings (copies per hash and tier, the bounded list of retired hashes, other KV groups, refused
batches) against a plain model; the redelivery window's bound; defaults, LoRA salts and
the encoder's copies; and the defects this round found (a refused batch that reordered the held and retired
hashes, restarted the decoder or kept its skips; LoRA blocks as vLLM publishes them refused).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mooncake.cache.events import BlockRemoved, BlockStored, CacheEvent
from mooncake.cache.hashing import BlockHasher
from mooncake.cache.vllm_events import (
    DEFAULT_MEDIUMS,
    DEFAULT_TIERS,
    REDELIVERY_WINDOW,
    VllmEventDecoder,
    VllmEventEncoder,
)
from mooncake.cache.vllm_wire import VllmEventBatch, WireLayout, decode_batch
from mooncake.errors import MooncakeError, UnknownBlockError, VllmEventError
from mooncake.types import BlockKey, Tier
from tests.cache.test_vllm_events import BLOCK, HASHER, SOURCE, decoded, payload, removed_wire, stored_wire

msgpack = pytest.importorskip("msgpack", reason="msgpack (the kv-events extra) is not installed")


def key_of_tokens(tokens: Sequence[int], parent: BlockKey | None = None, hasher: BlockHasher = HASHER) -> BlockKey:
    return hasher.block_keys(np.asarray(tokens, dtype=np.int32), parent=parent)[0]


# ---------------------------------------------------------------------- malformed fields

GOOD = stored_wire([1], None, [1, 2, 3, 4])


@pytest.mark.parametrize(
    ("wire", "field"),
    [
        (msgpack.packb([True, [], 0]), "ts"),  # a msgpack bool is no timestamp, though Python's True == 1
        (msgpack.packb([math.nan, [], 0]), "ts"),
        (msgpack.packb([math.inf, [], 0]), "ts"),
        (msgpack.packb({"ts": 1.0}), "events"),
        (msgpack.packb([1.0, [stored_wire([2], None, [1, 2, 3, 4], group_idx="g")], 0]), "group_idx"),
        (msgpack.packb([1.0, [removed_wire([1], group_idx=0.5)], 0]), "group_idx"),
        (msgpack.packb([1.0, [stored_wire([2], None, [1, 2, 3, 4], kv_cache_spec_kind=5)], 0]), "kv_cache_spec_kind"),
        (msgpack.packb([1.0, [stored_wire([2], None, [1, 2, 3, 4], lora_name=5)], 0]), "lora_name"),
        (
            msgpack.packb([1.0, [stored_wire([2], None, [1, 2, 3, 4], kv_cache_spec_sliding_window="w")], 0]),
            "kv_cache_spec_sliding_window",
        ),
        (msgpack.packb([1.0, [stored_wire([2], None, [1, 2, 3, 4], extra_keys=[7])], 0]), "extra_keys"),
        (msgpack.packb([1.0, [stored_wire([2], None, [1, 2, 3, 4], extra_keys=["salt"])], 0]), "extra_keys"),
        (msgpack.packb([1.0, [stored_wire([2], None, [1, 2, 3, 4], block_size=True)], 0]), "block_size"),
    ],
)
def test_a_malformed_field_is_a_vllm_event_error_naming_it(wire: bytes, field: str) -> None:
    """A field of the wrong type (a bool or non-finite timestamp, a batch map without events, a group index,
    spec kind, LoRA name or sliding window of the wrong type, extra keys that are not arrays or nils, a bool
    block size) raises VllmEventError, a MooncakeError naming the field, from `decode_batch` and from a
    decoder, which applies nothing: what it held before stays, and the same seq is expected again."""
    with pytest.raises(VllmEventError, match=field):
        decode_batch(wire)
    d = VllmEventDecoder(HASHER, SOURCE)
    decoded(d.decode(payload([GOOD]), seq=0))
    with pytest.raises(MooncakeError, match=field):
        d.decode(wire, seq=1)
    assert (d.expected_seq, d.epoch, d.key_of(1), d.key_of(2)) == (1, 0, key_of_tokens([1, 2, 3, 4]), None)


# ---------------------------------------------------------------------- the decoder's holdings, against a model

NUM_ROOTS = 3
MEDIUMS: list[str | None] = ["GPU", "CPU", "STORAGE", "DISK", "cpu", None]


def external(i: int) -> int | bytes:
    """Block `i`'s vLLM hash: negative ints, positive ints and SHA-256-like bytes, as vLLM versions publish."""
    return (-i, i * 7919, bytes([i]) * 32)[i % 3]


def tokens_of(i: int) -> list[int]:
    return [i] * BLOCK


# Blocks 1..NUM_ROOTS start sequences; block NUM_ROOTS + r is block r's child.
KEYS: dict[int, BlockKey] = {r: key_of_tokens(tokens_of(r)) for r in range(1, NUM_ROOTS + 1)}
KEYS |= {NUM_ROOTS + r: key_of_tokens(tokens_of(NUM_ROOTS + r), KEYS[r]) for r in range(1, NUM_ROOTS + 1)}
BLOCKS = sorted(KEYS)


def parent_of(i: int) -> int | None:
    return i - NUM_ROOTS if i > NUM_ROOTS else None


def store_of(i: int, medium: str | None) -> dict[str, Any]:
    parent = parent_of(i)
    return stored_wire([external(i)], None if parent is None else external(parent), tokens_of(i), medium=medium)


class DecoderHoldingsMachine(RuleBasedStateMachine):
    """One strict decoder's holdings against a model: per block, the copies each tier holds (in the order blocks
    were first held) and the retired blocks, oldest first, at most `max_retired_hashes`. A store adds a copy in its
    tier (vLLM announces each physical copy of a block); a removal takes one away (none below zero), is published
    when the tier has none left, and retires a block left in no tier (again, for a retired one: it becomes the
    newest);
    AllBlocksCleared (vLLM's GPU pool's) takes every GPU copy, published as one removal from VRAM of the blocks
    that had one, in the order held, and retires the blocks it leaves in no tier; `skip_to` (a loss: copies
    unknown) retires every held block, in the order held, and starts a new epoch; a stored child needs its parent
    known (held or retired), a removal known hashes, else UnknownBlockError and nothing applied; events of another KV group change nothing but use
    their number; a batch with a refused event at its end leaves no trace. Each applied batch gives exactly the
    events the model says, numbered on; a hash translates to its block's key iff the model knows the block."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder: VllmEventDecoder | None = None
        self.bound = 0
        self.held: dict[int, dict[Tier, int]] = {}  # block → copies per tier, a tier with none left out
        self.retired: list[int] = []
        self.expected, self.ours, self.epoch = 0, 0, 0

    @initialize(bound=st.sampled_from([0, 1, 2, 64]))
    def make(self, bound: int) -> None:
        self.bound = bound
        self.decoder = VllmEventDecoder(HASHER, SOURCE, max_retired_hashes=bound)

    # --- the model
    def _known(self, i: int) -> bool:
        return i in self.held or i in self.retired

    def _retire(self, i: int) -> None:
        self.held.pop(i, None)
        if i in self.retired:
            self.retired.remove(i)
        self.retired.append(i)
        del self.retired[: max(0, len(self.retired) - self.bound)]

    def _deliver(self, events: list[dict[str, Any]], layout: WireLayout) -> tuple[CacheEvent, ...]:
        assert self.decoder is not None
        out = decoded(self.decoder.decode(payload(events, layout=layout), seq=self.expected))
        self.expected += 1
        assert [e.seq for e in out] == list(range(self.ours, self.ours + len(out)))
        assert all(e.epoch == self.epoch and e.source == SOURCE for e in out)
        self.ours += len(out)
        return out

    def _refused(
        self, events: list[dict[str, Any]], layout: WireLayout, error: type[Exception] | tuple[type[Exception], ...]
    ) -> None:
        assert self.decoder is not None
        with pytest.raises(error):
            self.decoder.decode(payload(events, layout=layout), seq=self.expected)

    # --- the rules
    @precondition(lambda self: self.decoder is not None)
    @rule(i=st.sampled_from(BLOCKS), medium=st.sampled_from(MEDIUMS), layout=st.sampled_from(["array", "map"]))
    def store(self, i: int, medium: str | None, layout: WireLayout) -> None:
        parent = parent_of(i)
        if parent is not None and not self._known(parent):
            self._refused([store_of(i, medium)], layout, UnknownBlockError)
            return
        tier = DEFAULT_TIERS[medium.upper() if medium else medium]  # mediums are case-blind
        out = self._deliver([store_of(i, medium)], layout)
        assert [(type(e), e.keys, e.tier) for e in out] == [(BlockStored, (KEYS[i],), tier)]  # type: ignore[union-attr]
        self._add_copy(i, tier)

    def _add_copy(self, i: int, tier: Tier) -> None:
        if i in self.retired:
            self.retired.remove(i)
        copies = self.held.setdefault(i, {})
        copies[tier] = copies.get(tier, 0) + 1

    @precondition(lambda self: self.decoder is not None)
    @rule(root=st.integers(1, NUM_ROOTS), medium=st.sampled_from(MEDIUMS))
    def store_a_chain(self, root: int, medium: str | None) -> None:
        """A root and its child in one event: two hashes, their tokens concatenated."""
        child = root + NUM_ROOTS
        event = stored_wire([external(root), external(child)], None, tokens_of(root) + tokens_of(child), medium=medium)
        tier = DEFAULT_TIERS[medium.upper() if medium else medium]  # mediums are case-blind
        out = self._deliver([event], "map")
        assert [(type(e), e.keys, e.tier) for e in out] == [(BlockStored, (KEYS[root], KEYS[child]), tier)]  # type: ignore[union-attr]
        for i in (root, child):
            self._add_copy(i, tier)

    @precondition(lambda self: self.decoder is not None)
    @rule(
        blocks=st.lists(st.sampled_from(BLOCKS), unique=True, max_size=3),
        medium=st.sampled_from(MEDIUMS),
        layout=st.sampled_from(["array", "map"]),
    )
    def remove(self, blocks: list[int], medium: str | None, layout: WireLayout) -> None:
        """Hashes are removed in order: one retired may push out one named after it, which is then unknown. A block
        the tier still has a copy of is not published."""
        tier = DEFAULT_TIERS[medium.upper() if medium else medium]  # mediums are case-blind
        held, retired = {i: dict(t) for i, t in self.held.items()}, list(self.retired)
        gone = []
        for i in blocks:
            if not self._known(i):
                self.held, self.retired = held, retired  # refused whole: every hash back in its place
                self._refused([removed_wire([external(b) for b in blocks], medium)], layout, UnknownBlockError)
                return
            copies = self.held.get(i, {})
            left = max(0, copies.pop(tier, 0) - 1)
            if left:
                copies[tier] = left
            else:
                gone.append(i)
            if not copies:
                self._retire(i)
        out = self._deliver([removed_wire([external(i) for i in blocks], medium)], layout)
        expected = [(BlockRemoved, tuple(KEYS[i] for i in gone), tier)] if gone else []
        assert [(type(e), e.keys, e.tier) for e in out] == expected  # type: ignore[union-attr]

    @precondition(lambda self: self.decoder is not None)
    @rule()
    def clear(self) -> None:
        out = self._deliver([{"type": "AllBlocksCleared"}], "map")
        gone = [i for i, copies in self.held.items() if copies.get(Tier.VRAM)]
        expected = [(BlockRemoved, tuple(KEYS[i] for i in gone), Tier.VRAM)] if gone else []
        assert [(type(e), e.keys, e.tier) for e in out] == expected  # type: ignore[union-attr]
        for i in gone:
            del self.held[i][Tier.VRAM]
            if not self.held[i]:
                self._retire(i)

    @precondition(lambda self: self.decoder is not None)
    @rule(ahead=st.integers(0, 3))
    def skipped(self, ahead: int) -> None:
        """Batches lost (`skip_to`): the copies are unknown, so every held block is retired, in the order held, and
        the events go on, numbered from 0, in a new epoch."""
        assert self.decoder is not None
        self.decoder.skip_to(self.expected + ahead)
        for i in list(self.held):
            self._retire(i)
        self.epoch, self.expected, self.ours = self.epoch + 1, self.expected + ahead, 0

    @precondition(lambda self: self.decoder is not None)
    @rule(i=st.sampled_from(BLOCKS), medium=st.sampled_from([*MEDIUMS, "TAPE"]))
    def another_group(self, i: int, medium: str | None) -> None:
        """Another KV group's store (of any parent, in any medium) and removal (of any hash) are ignored."""
        events = [store_of(i, medium) | {"group_idx": 1}, removed_wire([external(i)], medium, group_idx=2)]
        assert self._deliver(events, "array") == ()

    @precondition(lambda self: self.decoder is not None)
    @rule(
        steps=st.lists(st.tuples(st.sampled_from(["store", "remove"]), st.sampled_from(BLOCKS)), max_size=4),
        medium=st.sampled_from(MEDIUMS),
        tail=st.sampled_from(["unknown hash", "unknown medium", "block size", "extra keys"]),
    )
    def a_refused_batch(self, steps: list[tuple[str, int]], medium: str | None, tail: str) -> None:
        """Events valid now, then a refused one: nothing applies, every hash back in its place among the held and
        the retired. (Under a small bound, a retirement in the batch may push out a hash a later event names: that
        event is the one refused, an unknown hash.)"""
        events = []
        for kind, i in steps:
            if kind == "remove" and self._known(i):
                events.append(removed_wire([external(i)], medium))
            elif kind == "store" and (parent_of(i) is None or self._known(parent_of(i) or 0)):
                events.append(store_of(i, medium))
        bad = {
            "unknown hash": removed_wire([b"never stored"]),
            "unknown medium": stored_wire([b"x"], None, [1, 2, 3, 4], medium="TAPE"),
            "block size": stored_wire([b"x"], None, [1] * 8, block_size=8),
            "extra keys": stored_wire([b"x"], None, [1, 2, 3, 4], extra_keys=[["mm-hash"]]),
        }[tail]
        error = UnknownBlockError if tail == "unknown hash" else VllmEventError
        self._refused([*events, bad], "map", error if self.bound >= len(BLOCKS) else (error, UnknownBlockError))

    @invariant()
    def matches_the_model(self) -> None:
        if self.decoder is None:
            return
        self.decoder.check_invariants()
        assert (self.decoder.expected_seq, self.decoder.epoch) == (self.expected, self.epoch)
        for i in BLOCKS:
            assert self.decoder.key_of(external(i)) == (KEYS[i] if self._known(i) else None), (i, self.retired)
            for tier in Tier:
                assert self.decoder.num_copies(external(i), tier) == self.held.get(i, {}).get(tier, 0), (i, tier)


DecoderHoldingsMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestDecoderHoldingsMachine = DecoderHoldingsMachine.TestCase


def test_a_refused_batch_gives_back_the_retired_hashes_it_pushed_out() -> None:
    """With one retired hash allowed, a batch that retires a second one (pushing the first out) and is then refused
    leaves the first translated: a child stored after it still finds its parent."""
    d = VllmEventDecoder(HASHER, SOURCE, max_retired_hashes=1)
    decoded(d.decode(payload([store_of(1, "GPU"), store_of(2, "GPU")]), seq=0))
    decoded(d.decode(payload([removed_wire([external(1)])]), seq=1))  # 1 retired
    with pytest.raises(UnknownBlockError):
        d.decode(payload([removed_wire([external(2)]), removed_wire([b"never stored"])]), seq=2)
    d.check_invariants()
    assert (d.key_of(external(1)), d.key_of(external(2))) == (KEYS[1], KEYS[2])
    out = decoded(d.decode(payload([store_of(1 + NUM_ROOTS, "GPU")]), seq=2))
    assert out[0].keys == (KEYS[1 + NUM_ROOTS],)  # type: ignore[union-attr]


def test_a_hash_dropped_again_is_the_most_recently_dropped() -> None:
    """Two retired hashes allowed: retire 1, then 2, then drop 1 again (a removal from another medium); retiring 3
    then pushes out 2, the least recently dropped, and keeps 1."""
    d = VllmEventDecoder(HASHER, SOURCE, max_retired_hashes=2)
    decoded(d.decode(payload([store_of(i, "GPU") for i in (1, 2, 3)]), seq=0))
    decoded(d.decode(payload([removed_wire([external(1)]), removed_wire([external(2)])]), seq=1))
    decoded(d.decode(payload([removed_wire([external(1)], "CPU")]), seq=2))
    decoded(d.decode(payload([removed_wire([external(3)])]), seq=3))
    assert [d.key_of(external(i)) for i in (1, 2, 3)] == [KEYS[1], None, KEYS[3]]


def test_lenient_removals_of_unknown_hashes_give_no_event_and_use_no_number() -> None:
    """A lenient decoder (a subscriber that joined late) skips a removal naming only hashes it never saw, and a
    store of no blocks: no event of ours with no keys is made, so the next event takes the next number."""
    d = VllmEventDecoder(HASHER, SOURCE, strict=False)
    assert decoded(d.decode(payload([removed_wire([5, b"\x05"]), stored_wire([], None, [])]), seq=0)) == ()
    assert d.num_skipped == 2
    out = decoded(d.decode(payload([GOOD]), seq=1))
    assert [(type(e), e.seq) for e in out] == [(BlockStored, 0)]


# ---------------------------------------------------------------------- sequencing edges


def test_the_redelivery_window_holds_the_last_batches_only() -> None:
    """After REDELIVERY_WINDOW + 1 batches, the newest redelivered is ignored, and the oldest (its number and
    timestamp forgotten) reads as vLLM restarted: a new epoch."""
    d = VllmEventDecoder(HASHER, SOURCE)
    empty = VllmEventBatch(ts=0.0, events=())
    for seq in range(REDELIVERY_WINDOW + 1):
        assert d.translate(VllmEventBatch(ts=float(seq), events=()), seq=seq) == ()
    newest = REDELIVERY_WINDOW
    assert d.translate(VllmEventBatch(ts=float(newest), events=()), seq=newest) == ()
    assert (d.num_redelivered, d.epoch, d.expected_seq) == (1, 0, newest + 1)
    assert d.translate(empty, seq=0) == ()  # batch 0 had ts 0.0 too, but it left the window
    assert (d.num_redelivered, d.epoch, d.expected_seq) == (1, 1, 1)


def test_restart_takes_the_epoch_it_is_given() -> None:
    """`restart(epoch=n)` starts epoch n (not merely the next one), empty, expecting batch 0."""
    d = VllmEventDecoder(HASHER, SOURCE, epoch=2)
    decoded(d.decode(payload([GOOD]), seq=0))
    d.restart(epoch=9)
    assert (d.epoch, d.expected_seq, d.key_of(1)) == (9, 0, None)
    assert decoded(d.decode(payload([GOOD]), seq=0))[0].epoch == 9
    d.restart()
    assert d.epoch == 10


# ---------------------------------------------------------------------- defaults, LoRA salts, the encoder


@pytest.mark.parametrize("tier", list(Tier))
def test_the_default_mediums_and_tiers_are_inverse(tier: Tier) -> None:
    """Events of every tier written by a default encoder read back in the same tier by a default decoder,
    under vLLM's medium names."""
    assert DEFAULT_TIERS[DEFAULT_MEDIUMS[tier]] is tier
    encoder = VllmEventEncoder(HASHER)
    keys = encoder.register([1, 2, 3, 4, 5, 6, 7, 8])
    wire = encoder.encode([BlockStored(source=SOURCE, seq=0, keys=keys, tier=tier)], ts=1.0)
    assert decode_batch(wire).events[0].medium == {Tier.VRAM: "GPU", Tier.DRAM: "CPU", Tier.SSD: "STORAGE"}[tier]  # type: ignore[union-attr]
    out = decoded(VllmEventDecoder(HASHER, SOURCE).decode(wire, seq=0))
    assert [(e.keys, e.tier) for e in out] == [(keys, tier)]  # type: ignore[union-attr]


def test_lora_keys_stay_in_the_hashers_namespace() -> None:
    """A LoRA adapter's keys depend on the base hasher's salt (tenants with different salts never share blocks)
    as well as on the adapter."""
    event = payload([stored_wire([1], None, [1, 2, 3, 4], lora_name="sql")])
    keys = set()
    for salt in ("tenant-a", "tenant-b"):
        hasher = BlockHasher(model="edge-model", block_size_tokens=BLOCK, salt=salt)
        out = decoded(VllmEventDecoder(hasher, SOURCE).decode(event, seq=0))
        keys.add(out[0].keys)  # type: ignore[union-attr]
        assert out[0].keys != hasher.block_keys([1, 2, 3, 4])  # type: ignore[union-attr]
    assert len(keys) == 2


def test_the_encoder_keeps_its_own_copy_of_the_tokens() -> None:
    """Tokens registered from an int32 array the caller later reuses are written as they were registered; an event
    of no keys becomes no vLLM event."""
    encoder = VllmEventEncoder(HASHER)
    tokens = np.arange(8, dtype=np.int32)
    keys = encoder.register(tokens)
    tokens[:] = 99
    (event,) = encoder.to_vllm(BlockStored(source=SOURCE, seq=0, keys=keys, tier=Tier.VRAM))
    assert event.token_ids == tuple(range(8))  # type: ignore[union-attr]
    assert encoder.to_vllm(BlockRemoved(source=SOURCE, seq=0, keys=(), tier=Tier.VRAM)) == ()
    assert encoder.to_vllm(BlockStored(source=SOURCE, seq=0, keys=(), tier=Tier.VRAM)) == ()


# ---------------------------------------------------------------------- defects this round found (fixed)


ROLLBACK_SCENARIOS = {
    # Retire 1 then 2; the refused batch retires 3, pushing 1 out; retiring 3 again must push out 1, not 2.
    "retired order": (
        2,
        [[store_of(1, "GPU"), store_of(2, "GPU"), store_of(3, "GPU")], [removed_wire([external(i)]) for i in (1, 2)]],
        [removed_wire([external(3)])],
        [[removed_wire([external(3)])], [store_of(2 + NUM_ROOTS, "GPU")]],
    ),
    # Blocks 1 then 6 held; the refused batch retires 1; the GPU's clear must retire 1 then 6, keeping 6.
    "held order": (
        1,
        [[store_of(1, "GPU"), store_of(1 + NUM_ROOTS, "GPU")]],
        [removed_wire([external(1)])],
        [[{"type": "AllBlocksCleared"}]],
    ),
}


@pytest.mark.parametrize("scenario", sorted(ROLLBACK_SCENARIOS))
def test_a_refused_batch_keeps_the_order_hashes_were_held_and_retired_in(scenario: str) -> None:
    """Two decoders get the same batches, one also a batch that is refused (valid events, then a hash never
    stored): afterwards they translate every hash alike, and take the same later batches alike."""
    bound, before, refused, after = ROLLBACK_SCENARIOS[scenario]
    seen, unseen = (VllmEventDecoder(HASHER, SOURCE, max_retired_hashes=bound) for _ in range(2))
    for seq, events in enumerate(before):
        assert decoded(seen.decode(payload(events), seq=seq)) == decoded(unseen.decode(payload(events), seq=seq))
    with pytest.raises(UnknownBlockError):
        seen.decode(payload([*refused, removed_wire([b"never stored"])]), seq=len(before))
    for seq, events in enumerate(after, start=len(before)):
        assert [seen.key_of(external(i)) for i in BLOCKS] == [unseen.key_of(external(i)) for i in BLOCKS]
        assert decoded(seen.decode(payload(events), seq=seq)) == decoded(unseen.decode(payload(events), seq=seq))
    assert [seen.key_of(external(i)) for i in BLOCKS] == [unseen.key_of(external(i)) for i in BLOCKS]


@pytest.mark.parametrize("extra", [["sql"], [1]], ids=["lora_name", "lora_int_id"])
def test_lora_blocks_as_vllm_publishes_them_are_keyed_by_the_adapter(extra: list[Any]) -> None:
    """A LoRA block as vLLM publishes it (lora_id 1, lora_name "sql", extra_keys naming the adapter per block)
    is keyed as the same block without the redundant extra keys is."""
    tokens = list(range(8))
    plain = stored_wire([1, 2], None, tokens, lora_id=1, lora_name="sql")
    expected = decoded(VllmEventDecoder(HASHER, SOURCE).decode(payload([plain]), seq=0))
    as_vllm = plain | {"extra_keys": [extra, extra]}
    assert decoded(VllmEventDecoder(HASHER, SOURCE).decode(payload([as_vllm]), seq=0)) == expected


def test_a_refused_batch_below_the_expected_one_changes_nothing() -> None:
    """A batch numbered below the next one, not a redelivery, and refused (an unknown medium) leaves the decoder as
    it was: same epoch, same expected seq, same translations."""
    d = VllmEventDecoder(HASHER, SOURCE)
    decoded(d.decode(payload([GOOD], ts=1.0), seq=0))
    decoded(d.decode(payload([], ts=2.0), seq=1))
    with pytest.raises(VllmEventError, match="TAPE"):
        d.decode(payload([stored_wire([9], None, [1, 2, 3, 4], medium="TAPE")], ts=5.0), seq=0)
    assert (d.epoch, d.expected_seq, d.key_of(1)) == (0, 2, key_of_tokens([1, 2, 3, 4]))


def test_a_refused_batch_skips_nothing() -> None:
    """A lenient decoder refusing a batch (an unknown medium after an unknown hash) counts no skipped event: the
    batch was not applied, and a replay of it would count its skips again."""
    d = VllmEventDecoder(HASHER, SOURCE, strict=False)
    with pytest.raises(VllmEventError):
        d.decode(payload([removed_wire([5]), stored_wire([9], None, [1, 2, 3, 4], medium="TAPE")]), seq=0)
    assert d.num_skipped == 0


def test_an_unknown_hash_is_named_in_full() -> None:
    """A strict decoder's refusal names the 32-byte hash it never saw whole (a message cut at `shown`'s default 60
    characters would lose most of it, and with it what to look for in vLLM's log)."""
    unknown = bytes(range(200, 232))
    with pytest.raises(UnknownBlockError, match=re.escape(repr(unknown))):
        VllmEventDecoder(HASHER, SOURCE).decode(payload([removed_wire([unknown])]), seq=0)
