"""`encode_batch` and `decode_batch` refuse alike: the writer never writes an event its own reader refuses.

Both check each event by one rule (`vllm_wire._record`): an empty `lora_name`, a `lora_id` below 1, a negative
`group_idx` (which the reader always refused, and the writer used to write), a medium that is no string, a token
id outside [0, 2**31), ... raise the same `VllmEventError`, naming the event, the field and the value, whichever
way the event goes.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.cache.vllm_wire import (
    VllmBlockRemoved,
    VllmBlockStored,
    VllmEvent,
    VllmEventBatch,
    decode_batch,
    encode_batch,
)
from mooncake.errors import VllmEventError

msgpack = pytest.importorskip("msgpack", reason="msgpack (the kv-events extra) is not installed")

BASE: dict[str, Any] = {
    "block_hashes": (1,),
    "parent_block_hash": None,
    "token_ids": tuple(range(16)),
    "block_size": 16,
}


def outcome(call: Any) -> str:
    """ "ok", or the VllmEventError's message (any other error escapes, failing the test)."""
    try:
        call()
    except VllmEventError as error:
        return str(error)
    return "ok"


def wire(event: VllmEvent) -> bytes:
    """`event` packed by msgpack itself, a map of every field, as a producer other than `encode_batch` would."""
    tag = type(event).__name__.removeprefix("Vllm")
    fields = {
        name: list(value) if isinstance(value, tuple) else value
        for name, value in attrs.asdict(event, recurse=False).items()
    }
    return bytes(msgpack.packb([1.0, [{"type": tag, **fields}], None]))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("lora_name", "", "lora_name must be a non-empty string or nil, got ''"),
        ("lora_id", 0, r"lora_id must be an integer >= 1 or nil, got 0"),
        ("group_idx", -1, r"group_idx must be an integer >= 0 or nil, got -1"),
        ("medium", 5, "medium must be a string or nil, got 5"),
        ("block_size", 0, "block_size must be an integer >= 1"),
    ],
)
def test_the_writer_refuses_what_the_reader_refuses_with_the_same_message(field: str, value: Any, message: str) -> None:
    """Each value vLLM never writes: `decode_batch` refuses it on the wire, and `encode_batch` refuses the record
    holding it, with the one message (before, the writer wrote the first three and its own reader refused them)."""
    event = VllmBlockStored(**BASE | {field: value})
    refused = outcome(lambda: encode_batch(VllmEventBatch(ts=1.0, events=(event,))))
    assert refused == outcome(lambda: decode_batch(wire(event)))
    assert refused.startswith("event 0 (BlockStored): ") and message in refused


def test_a_removal_in_a_negative_group_and_a_rank_past_msgpack_are_refused_by_the_writer() -> None:
    """A BlockRemoved's group is checked as a BlockStored's is; a rank msgpack cannot hold is the VllmEventError
    naming it (it escaped as msgpack's OverflowError)."""
    removed = VllmBlockRemoved(block_hashes=(1,), group_idx=-2)
    refused = outcome(lambda: encode_batch(VllmEventBatch(ts=1.0, events=(removed,))))
    assert refused == outcome(lambda: decode_batch(wire(removed))) != "ok"
    assert "group_idx" in refused
    with pytest.raises(VllmEventError, match=r"data_parallel_rank must be an integer in \[-2\*\*63, 2\*\*64\)"):
        encode_batch(VllmEventBatch(ts=1.0, events=(), data_parallel_rank=2**64))


hashes = st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=8)


@st.composite
def events(draw: st.DrawFn) -> VllmEvent:
    """A BlockStored or BlockRemoved whose fields are each valid or a value the reader refuses."""
    block_hashes = tuple(draw(st.lists(hashes | st.just("h"), max_size=3)))
    medium = draw(st.sampled_from([None, "GPU", 5]))
    group_idx = draw(st.none() | st.integers(-2, 2))
    if draw(st.booleans()):
        return VllmBlockRemoved(block_hashes=block_hashes, medium=medium, group_idx=group_idx)
    return VllmBlockStored(
        block_hashes=block_hashes,
        parent_block_hash=draw(st.none() | hashes | st.just("p")),
        token_ids=tuple(draw(st.lists(st.integers(-1, 2**31), max_size=4))),
        block_size=draw(st.integers(-1, 4)),
        lora_id=draw(st.none() | st.integers(-1, 2)),
        medium=medium,
        lora_name=draw(st.sampled_from([None, "", "adapter", 7])),
        extra_keys=draw(st.none() | st.lists(st.none() | st.tuples(st.text(max_size=2)), max_size=2).map(tuple)),
        group_idx=group_idx,
        kv_cache_spec_kind=draw(st.sampled_from([None, "full", 3])),
        kv_cache_spec_sliding_window=draw(st.none() | st.integers(-1, 3) | st.just("w")),
    )


@given(events(), st.sampled_from(["map", "array"]))
def test_encode_and_decode_refuse_alike(event: VllmEvent, layout: Any) -> None:
    """Any record, its fields each valid or not: `encode_batch` refuses it exactly when `decode_batch` refuses the
    same event on the wire, with the same message; what it writes reads back as the record."""
    batch = VllmEventBatch(ts=1.0, events=(event,))
    written = outcome(lambda: encode_batch(batch, event_layout=layout))
    assert written == outcome(lambda: decode_batch(wire(event)))
    if written == "ok":
        assert decode_batch(encode_batch(batch, event_layout=layout)) == batch
