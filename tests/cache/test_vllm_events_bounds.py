"""What a `VllmEventDecoder` keeps across losses, and the values vLLM's wire never carries.

A decoder maps every hash some tier holds, plus at most `max_retired_hashes` dropped ones. A loss (`skip_to`,
which the fleet calls on every server down) makes every count of copies unknown: those hashes are retired, so
however many down/up cycles a server goes through, the map stays within that bound and what the tiers hold
since. The wire reader refuses what vLLM never writes (an empty adapter name, an adapter id below 1, a negative
group or rank) as a `VllmEventError` naming the field, the error a subscriber catches.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.cache.vllm_events import VllmEventDecoder
from mooncake.cache.vllm_wire import VllmEventBatch, decode_batch, encode_batch
from mooncake.errors import VllmEventError
from mooncake.types import Tier
from tests.cache.test_vllm_events import BLOCK, HASHER, SOURCE, decoded, payload, removed_wire, stored_wire

pytest.importorskip("msgpack", reason="msgpack (the kv-events extra) is not installed")

CLEARED = {"type": "AllBlocksCleared"}


def chain(first: int, num_blocks: int, medium: str) -> dict[str, Any]:
    """A BlockStored of `num_blocks` fresh blocks, hashes `first`, `first + 1`, ..., each of its own tokens."""
    tokens = [(first + i) % 50_000 for i in range(num_blocks) for _ in range(BLOCK)]
    return stored_wire(list(range(first, first + num_blocks)), None, tokens, medium=medium)


@settings(max_examples=40, deadline=None)
@given(
    bound=st.integers(0, 20),
    cycles=st.lists(
        st.tuples(st.integers(1, 30), st.sampled_from(["GPU", "CPU"]), st.booleans(), st.booleans()),
        min_size=1,
        max_size=8,
    ),
)
def test_store_loss_and_clear_cycles_keep_the_decoder_bounded(
    bound: int, cycles: list[tuple[int, str, bool, bool]]
) -> None:
    """Each cycle stores a fresh chain (GPU or CPU), loses a batch (`skip_to`, as the fleet on a server down),
    and maybe gets vLLM's GPU clear. After each loss nothing is held and at most `bound` hashes are mapped, the
    most recently held of them still translating; in between, no more than `bound` plus what was stored since.
    (Before the fix every cycle's blocks stayed held, with no copies, for ever.)"""
    d = VllmEventDecoder(HASHER, SOURCE, max_retired_hashes=bound)
    seq, first = 0, 1
    for num_blocks, medium, ahead, clear in cycles:
        decoded(d.decode(payload([chain(first, num_blocks, medium)]), seq=seq))
        assert len(d._keys) <= bound + num_blocks
        d.skip_to(seq + 1 + ahead)
        seq += 1 + ahead
        d.check_invariants()
        assert (len(d._held), len(d._held_at)) == (0, 0) and len(d._keys) <= bound and len(d._parents) <= bound
        newest = range(first + num_blocks - min(bound, num_blocks), first + num_blocks)
        assert all(d.key_of(h) is not None for h in newest)  # translations kept as retired ones are
        if clear:
            assert decoded(d.decode(payload([CLEARED]), seq=seq)) == ()  # no index holds them in this epoch
            seq += 1
            d.check_invariants()
            assert len(d._keys) <= bound
        first += num_blocks


def test_a_block_held_before_a_loss_is_removed_and_stored_again_as_a_retired_one() -> None:
    """After `skip_to` a block held before is retired: its removal (from any tier) is published and leaves it
    retired, and a store of it again counts its copies from one."""
    d = VllmEventDecoder(HASHER, SOURCE)
    decoded(d.decode(payload([chain(1, 2, "CPU")]), seq=0))
    key = d.key_of(1)
    d.skip_to(3)
    assert d.num_copies(1, Tier.DRAM) == 0
    out = decoded(d.decode(payload([removed_wire([1], "CPU")]), seq=3))
    assert [(e.keys, e.tier) for e in out] == [((key,), Tier.DRAM)]  # type: ignore[union-attr]
    assert [e.keys for e in decoded(d.decode(payload([chain(1, 1, "GPU")]), seq=4))] == [(key,)]  # type: ignore[union-attr]
    d.check_invariants()
    assert (d.num_copies(1, Tier.VRAM), d.key_of(1)) == (1, key)


# ---------------------------------------------------------------------- values vLLM never writes


def stored(**fields: Any) -> bytes:
    return payload([stored_wire([1], None, [1, 2, 3, 4], **fields)])


@pytest.mark.parametrize(
    ("wire", "field", "value"),
    [
        (stored(lora_name=""), "lora_name", "''"),
        (stored(lora_id=0), "lora_id", "0"),
        (stored(lora_id=-3), "lora_id", "-3"),
        (stored(group_idx=-1), "group_idx", "-1"),
        (payload([removed_wire([1], group_idx=-2)]), "group_idx", "-2"),
        (payload([], rank=-5), "data_parallel_rank", "-5"),
    ],
    ids=["empty lora_name", "lora_id 0", "lora_id -3", "stored group_idx -1", "removed group_idx -2", "rank -5"],
)
def test_a_value_vllm_never_writes_is_a_vllm_event_error_naming_it(wire: bytes, field: str, value: str) -> None:
    """An empty LoRA name (the adapter's namespace needs a name), a LoRA id below 1 (vLLM's `LoRARequest` refuses
    them), a negative KV group (its events would vanish unread) or data-parallel rank raises VllmEventError naming
    the event, field and value, from `decode_batch` and from a decoder, which applies nothing (the error the
    example subscriber catches, counts and skips; the empty name used to escape as InvalidRequestError); a group,
    rank or id at its bound reads."""
    with pytest.raises(VllmEventError, match=rf"(event 0 \(Block\w+\)|batch): {field} must be .*got {value}"):
        decode_batch(wire)
    d = VllmEventDecoder(HASHER, SOURCE, strict=False)
    with pytest.raises(VllmEventError, match=field):
        d.decode(wire, seq=0)
    assert d.expected_seq == 0 and d.key_of(1) is None
    assert decode_batch(stored(lora_id=1, group_idx=0)).events[0].lora_id == 1  # type: ignore[union-attr]
    assert decode_batch(payload([], rank=0)).data_parallel_rank == 0


def test_encode_batch_refuses_a_negative_rank() -> None:
    """`encode_batch` checks the rank as the reader does: it never writes a batch `decode_batch` refuses."""
    with pytest.raises(VllmEventError, match="data_parallel_rank must be an integer >= 0 or nil, got -1"):
        encode_batch(VllmEventBatch(ts=1.0, events=(), data_parallel_rank=-1))
