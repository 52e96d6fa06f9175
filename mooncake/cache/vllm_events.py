"""vLLM's KV-cache events, read into this library's cache events and written from them.

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
starred fields (defaulted ones) when they are nil. A block hash is an int
(negative ones too: older vLLM used Python's ``hash``) or bytes (SHA-256 block
hashing); ``token_ids`` are the stored blocks' tokens, concatenated (vLLM stores
full blocks only); ``parent_block_hash`` is the hash of the block before the
first one (nil at the start of a sequence). Reading is lenient about versions: a
trailing field an older producer lacks reads as nil and a field a newer one adds
is ignored. `encode_batch` writes exactly what msgspec writes for those structs.
On the wire a batch is the third frame of ``[topic, seq as 8 bytes big-endian,
payload]`` (``examples/vllm_events.py`` has the subscriber and publisher).

Re-keying. A vLLM block hash is not this library's key, so `VllmEventDecoder`
re-derives keys from the token ids with a `BlockHasher` (the parent's key comes
from the parent hash), which makes prefixes match across engines and across this
library's own caches. It keeps, per source, a map vLLM hash → key: `BlockRemoved`
carries hashes only. The map holds every hash some tier holds, plus the
`max_retired_hashes` most recently dropped ones, so a block stored just after its
parent was evicted still finds its parent. LoRA blocks hash under a salt naming
the adapter; blocks with other ``extra_keys`` (multimodal inputs, cache salts)
cannot be re-derived from tokens and are refused; only KV-cache group `kv_group`
is read (a hybrid model's other groups repeat the same prefixes).

Sequencing. vLLM numbers batches 0, 1, 2, ... per process. The decoder turns
batch ``seq`` into this library's events of one source, numbered one by one in
its own epoch: a batch above the next expected one is a gap (nothing is applied;
replay the missing batches, or `skip_to` to accept the loss); a batch below it
means vLLM restarted, which starts a new, empty epoch. Each batch is applied
whole or not at all.

Writing. `VllmEventEncoder` turns this library's events into vLLM batches. vLLM
events carry token ids, which this library's events do not, so the encoder needs
each stored block's tokens and parent: `register(tokens)` records them for every
block of a token sequence (call it when a request's blocks are cached);
`forget(keys)` drops them. Keys serve as the block hashes (64-bit keys as ints,
wider ones as big-endian bytes); a `BlockStored` becomes one vLLM event per run of
chained keys, parents first.

Invariants (`VllmEventDecoder.check_invariants`):
- a hash is mapped to a key iff some tier holds it or it is retired, not both;
- held hashes have a non-empty set of tiers; at most `max_retired_hashes` are retired.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, cast

import attrs
import numpy as np
import numpy.typing as npt

from mooncake._checks import is_int, require_int
from mooncake.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent, SequenceGap
from mooncake.cache.hashing import BlockHasher
from mooncake.errors import UnknownBlockError, VllmEventError
from mooncake.types import BlockKey, InstanceId, Tier, as_token_array

__all__ = [
    "DEFAULT_MEDIUMS",
    "DEFAULT_TIERS",
    "ExternalHash",
    "VllmAllBlocksCleared",
    "VllmBlockRemoved",
    "VllmBlockStored",
    "VllmEvent",
    "VllmEventBatch",
    "VllmEventDecoder",
    "VllmEventEncoder",
    "VllmEventError",
    "WireLayout",
    "decode_batch",
    "encode_batch",
]

ExternalHash = int | bytes
"""A block hash as vLLM publishes it."""

WireLayout = Literal["array", "map"]
"""A msgpack struct as a positional array or as a map of field names."""

DEFAULT_TIERS: Mapping[str | None, Tier] = {None: Tier.VRAM, "GPU": Tier.VRAM, "CPU": Tier.DRAM, "DISK": Tier.SSD}
"""vLLM medium → tier (no medium: vLLM before mediums, which published GPU blocks only)."""

DEFAULT_MEDIUMS: Mapping[Tier, str] = {Tier.VRAM: "GPU", Tier.DRAM: "CPU", Tier.SSD: "DISK"}
"""Tier → the medium the encoder writes."""

_STORED, _REMOVED, _CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
_TAG_KEY = "type"
_INT32_MAX = 2**31 - 1


# ---------------------------------------------------------------------- wire records


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
    """
    import msgpack  # type: ignore[import-untyped]  # lazy: `import mooncake.cache` stays light

    events = [_event_wire(event, event_layout) for event in batch.events]
    rank = batch.data_parallel_rank
    body: list[Any] | dict[str, Any]
    if batch_layout == "array":
        body = [float(batch.ts), events, rank]
    else:
        body = {"ts": float(batch.ts), "events": events} | ({} if rank is None else {"data_parallel_rank": rank})
    return bytes(msgpack.packb(body, use_bin_type=True))


def _event_wire(event: VllmEvent, layout: WireLayout) -> list[Any] | dict[str, Any]:
    tag = (
        _STORED if isinstance(event, VllmBlockStored) else _REMOVED if isinstance(event, VllmBlockRemoved) else _CLEARED
    )
    values = [(name, getattr(event, name), required) for name, required in _FIELDS[tag]]
    values = [(n, [*v] if isinstance(v, tuple) else v, r) for n, v, r in values]
    if layout == "map":
        return {_TAG_KEY: tag} | {n: v for n, v, _ in values if not (n in _DEFAULTED and v is None)}
    return [tag, *(v for _, v, _ in values)]


def decode_batch(payload: bytes) -> VllmEventBatch:
    """Read a vLLM payload in either layout (see the module docstring).

    Raises:
        VllmEventError: not msgpack, or a batch or event breaks the layout (the message says where).
    """
    import msgpack

    try:
        body = msgpack.unpackb(payload, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        raise VllmEventError(f"payload is not one msgpack value ({len(payload)} bytes): {error}") from error
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
        raise VllmEventError(f"batch ts must be a finite number, got {ts!r}")
    if not isinstance(events, list):
        raise VllmEventError(f"batch events must be an array, got {type(events).__name__}")
    return VllmEventBatch(
        ts=float(ts),
        events=tuple(_read_event(i, raw) for i, raw in enumerate(events)),
        data_parallel_rank=_optional_int("data_parallel_rank", rank, "batch"),
    )


def _read_event(index: int, raw: object) -> VllmEvent:
    where = f"event {index}"
    if isinstance(raw, list):
        tag = raw[0] if raw else None
        fields = _FIELDS.get(tag) if isinstance(tag, str) else None
        if fields is None:
            raise VllmEventError(f"{where}: unknown tag {tag!r}, expected one of {sorted(_FIELDS)}")
        num_required = sum(required for _, required in fields)
        if len(raw) - 1 < num_required:
            raise VllmEventError(f"{where} ({tag}): needs at least {num_required} fields, got {len(raw) - 1}")
        values = dict(zip((name for name, _ in fields), raw[1:], strict=False))
    elif isinstance(raw, dict):
        tag = raw.get(_TAG_KEY)
        fields = _FIELDS.get(tag) if isinstance(tag, str) else None
        if fields is None:
            raise VllmEventError(f"{where}: unknown tag {tag!r}, expected one of {sorted(_FIELDS)}")
        # lora_id is positional-required but maps from other producers may leave it out.
        missing = [name for name, required in fields if required and name != "lora_id" and name not in raw]
        if missing:
            raise VllmEventError(f"{where} ({tag}): missing fields {missing}")
        values = {name: raw.get(name) for name, _ in fields}
    else:
        raise VllmEventError(f"{where}: must be a tagged array or map, got {type(raw).__name__}")
    where = f"{where} ({tag})"
    if tag == _CLEARED:
        return VllmAllBlocksCleared()
    hashes = _hashes(values["block_hashes"], where)
    medium = values.get("medium")
    if medium is not None and not isinstance(medium, str):
        raise VllmEventError(f"{where}: medium must be a string or nil, got {medium!r}")
    group_idx = _optional_int("group_idx", values.get("group_idx"), where)
    if tag == _REMOVED:
        return VllmBlockRemoved(block_hashes=hashes, medium=medium, group_idx=group_idx)
    parent = values["parent_block_hash"]
    if parent is not None:
        parent = _hashes([parent], f"{where} parent_block_hash")[0]
    tokens = values["token_ids"]
    if not isinstance(tokens, list) or not all(is_int(t) and 0 <= t <= _INT32_MAX for t in tokens):
        raise VllmEventError(f"{where}: token_ids must be an array of token ids in [0, 2**31), got {tokens!r:.80}")
    block_size = values["block_size"]
    if not is_int(block_size) or block_size < 1:
        raise VllmEventError(f"{where}: block_size must be an integer >= 1, got {block_size!r}")
    lora_name, spec_kind = values.get("lora_name"), values.get("kv_cache_spec_kind")
    for name, value in (("lora_name", lora_name), ("kv_cache_spec_kind", spec_kind)):
        if value is not None and not isinstance(value, str):
            raise VllmEventError(f"{where}: {name} must be a string or nil, got {value!r}")
    extra = values.get("extra_keys")
    if extra is not None and not (isinstance(extra, list) and all(e is None or isinstance(e, list) for e in extra)):
        raise VllmEventError(f"{where}: extra_keys must be an array of arrays or nils, got {extra!r:.80}")
    return VllmBlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tuple(tokens),
        block_size=int(block_size),
        lora_id=_optional_int("lora_id", values.get("lora_id"), where),
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
        raise VllmEventError(f"{where}: block hashes must be integers or bytes, got {raw!r:.80}")
    return tuple(raw)


def _optional_int(name: str, value: object, where: str) -> int | None:
    if value is not None and not is_int(value):
        raise VllmEventError(f"{where}: {name} must be an integer or nil, got {value!r}")
    return None if value is None else int(cast("int", value))


# ---------------------------------------------------------------------- decoding


class VllmEventDecoder:
    """Turns one vLLM instance's batches into this library's events for `source`.

    Args:
        hasher: computes this library's keys; its block size must be vLLM's.
        source: the instance the events are about.
        epoch: the first epoch (a later one starts on each restart or `skip_to`).
        tiers: vLLM medium → tier (default `DEFAULT_TIERS`).
        kv_group: the KV-cache group read (events of other groups are ignored).
        strict: raise on a hash never seen (True), or skip what cannot be translated
            and count it in `num_skipped` (for a subscriber that joined late).
        max_retired_hashes: dropped hashes whose keys are kept, most recent first.

    Raises:
        ConfigError: `epoch`, `kv_group` or `max_retired_hashes` is not an integer >= 0.

    Not thread-safe. Invariants: see the module docstring; `check_invariants` verifies them.
    """

    def __init__(
        self,
        hasher: BlockHasher,
        source: InstanceId,
        *,
        epoch: int = 0,
        tiers: Mapping[str | None, Tier] = DEFAULT_TIERS,
        kv_group: int = 0,
        strict: bool = True,
        max_retired_hashes: int = 1 << 16,
    ) -> None:
        self.hasher = hasher
        self.source = source
        self.tiers = {medium: Tier(tier) for medium, tier in tiers.items()}
        self.kv_group = require_int("kv_group", kv_group, minimum=0)
        self.strict = strict
        self.max_retired_hashes = require_int("max_retired_hashes", max_retired_hashes, minimum=0)
        self.num_skipped = 0
        self._epoch = require_int("epoch", epoch, minimum=0)
        self._expected = 0  # the next vLLM batch seq
        self._seq = 0  # the next event seq of ours
        self._keys: dict[ExternalHash, BlockKey] = {}
        self._held: dict[ExternalHash, int] = {}  # hash → bit mask of the tiers holding it
        self._retired: OrderedDict[ExternalHash, None] = OrderedDict()
        self._lora_hashers: dict[str, BlockHasher] = {}
        self._undo: list[tuple[ExternalHash, BlockKey | None, int | None, bool]] | None = None

    @property
    def epoch(self) -> int:
        """The epoch the next events carry."""
        return self._epoch

    @property
    def expected_seq(self) -> int:
        """The vLLM batch seq the decoder expects next."""
        return self._expected

    def key_of(self, block_hash: ExternalHash) -> BlockKey | None:
        """This library's key for a vLLM hash the decoder knows (held or retired), else None."""
        return self._keys.get(block_hash)

    def decode(self, payload: bytes, *, seq: int) -> tuple[CacheEvent, ...] | SequenceGap:
        """`translate` of `decode_batch(payload)`."""
        return self.translate(decode_batch(payload), seq=seq)

    def translate(self, batch: VllmEventBatch, *, seq: int) -> tuple[CacheEvent, ...] | SequenceGap:
        """This library's events for vLLM batch number `seq`.

        Feed each batch once, in order; a batch below `expected_seq` is taken as
        vLLM having restarted (its numbers start again at 0), so the decoder first
        starts a new, empty epoch.

        Returns:
            The events, numbered on from the last ones (empty when nothing in the
            batch concerns the index); or, for a batch above `expected_seq`, a
            `SequenceGap` in vLLM batch numbers, with nothing applied.

        Raises:
            VllmEventError: a block size other than the hasher's, a block count that
                does not fit the tokens, an unknown medium, or extra keys (strict).
            UnknownBlockError: a parent or removed hash never seen (strict only).
            Either way the batch is not applied.
        """
        seq = require_int("seq", seq, minimum=0, error=VllmEventError)
        if seq < self._expected:
            self.restart(epoch=self._epoch + 1)
        if seq > self._expected:
            return SequenceGap(
                source=self.source,
                expected_epoch=self._epoch,
                expected_seq=self._expected,
                received_epoch=self._epoch,
                received_seq=seq,
            )
        self._undo = []
        try:
            changes = [change for event in batch.events if (change := self._apply(event)) is not None]
        except BaseException:
            self._rollback()
            raise
        finally:
            self._undo = None
        source, epoch = self.source, self._epoch
        events = tuple(
            AllBlocksCleared(source=source, seq=self._seq + i, epoch=epoch)
            if kind == _CLEARED
            else (BlockStored if kind == _STORED else BlockRemoved)(
                source=source, seq=self._seq + i, keys=keys, tier=tier, epoch=epoch
            )
            for i, (kind, keys, tier) in enumerate(changes)
        )
        self._seq += len(events)
        self._expected = seq + 1
        return events

    def skip_to(self, seq: int) -> None:
        """Accept that the batches before `seq` are lost: expect `seq` next, in a new epoch.

        A consumer's holdings for this source are unknown from here; a `BlockIndex`
        drops them on the new epoch's first event (or `resync` it to empty at once).
        Hash translations are kept: a hash always stands for the same tokens.
        """
        seq = require_int("seq", seq, minimum=0, error=VllmEventError)
        self._epoch += 1
        self._seq = 0
        self._expected = seq

    def restart(self, *, epoch: int | None = None) -> None:
        """Forget everything (vLLM restarted): expect batch 0 next, in `epoch` (default: the next)."""
        self._epoch = self._epoch + 1 if epoch is None else epoch
        self._seq = 0
        self._expected = 0
        self._keys, self._held, self._retired = {}, {}, OrderedDict()

    def check_invariants(self) -> None:
        """Raise AssertionError if an invariant of the module docstring fails."""
        assert set(self._keys) == set(self._held) | set(self._retired), "mapped hashes != held + retired"
        assert not set(self._held) & set(self._retired), "a hash is both held and retired"
        assert all(0 < mask < 1 << len(Tier) for mask in self._held.values()), "a held hash has no tier"
        assert len(self._retired) <= self.max_retired_hashes, f"{len(self._retired)} retired hashes"

    # ------------------------------------------------------------------ internals

    def _apply(self, event: VllmEvent) -> tuple[str, tuple[BlockKey, ...], Tier] | None:
        if isinstance(event, VllmAllBlocksCleared):
            for block_hash in list(self._held):
                self._set(block_hash, self._keys[block_hash], None)
            return (_CLEARED, (), Tier.VRAM)
        if event.group_idx not in (None, self.kv_group):
            return None
        if event.medium not in self.tiers:
            raise VllmEventError(
                f"{self.source}: unknown medium {event.medium!r}, known {sorted(map(str, self.tiers))}"
            )
        tier = self.tiers[event.medium]
        bit = 1 << tier
        if isinstance(event, VllmBlockRemoved):
            removed: list[BlockKey] = []
            for block_hash in event.block_hashes:
                key = self._keys.get(block_hash)
                if key is None:
                    self._unknown(f"{self.source}: BlockRemoved names hash {block_hash!r}, never stored (or retired)")
                    continue
                mask = self._held.get(block_hash, 0) & ~bit
                self._set(block_hash, key, mask or None)
                removed.append(key)
            return (_REMOVED, tuple(removed), tier) if removed else None
        keys = self._stored_keys(event)
        if keys is None:
            return None
        for block_hash, key in zip(event.block_hashes, keys, strict=True):
            self._set(block_hash, key, self._held.get(block_hash, 0) | bit)
        return (_STORED, keys, tier) if keys else None

    def _stored_keys(self, event: VllmBlockStored) -> tuple[BlockKey, ...] | None:
        hasher = self.hasher
        if event.block_size != hasher.block_size_tokens:
            raise VllmEventError(
                f"{self.source}: BlockStored has block_size {event.block_size}, the hasher {hasher.block_size_tokens}"
            )
        num_blocks = hasher.num_blocks(len(event.token_ids))
        if num_blocks != len(event.block_hashes):
            raise VllmEventError(
                f"{self.source}: BlockStored has {len(event.block_hashes)} hashes for {len(event.token_ids)} tokens"
                f" ({num_blocks} blocks of {event.block_size})"
            )
        if event.extra_keys is not None and any(extra is not None for extra in event.extra_keys):
            if self.strict:
                raise VllmEventError(
                    f"{self.source}: BlockStored has extra_keys {event.extra_keys!r:.80}: its keys depend on more"
                    " than token ids"
                )
            self.num_skipped += 1
            return None
        parent = None
        if event.parent_block_hash is not None:
            parent = self._keys.get(event.parent_block_hash)
            if parent is None:
                self._unknown(
                    f"{self.source}: BlockStored's parent hash {event.parent_block_hash!r} was never stored (or retired)"
                )
                return None
        adapter = event.lora_name if event.lora_name is not None else event.lora_id
        if adapter is not None:
            hasher = self._lora_hasher(str(adapter))
        return hasher.block_keys(np.asarray(event.token_ids, dtype=np.int32), parent=parent)

    def _lora_hasher(self, adapter: str) -> BlockHasher:
        hasher = self._lora_hashers.get(adapter)
        if hasher is None:
            # An adapter's KV differs from the base model's: a salt keeps their keys apart.
            hasher = attrs.evolve(self.hasher, salt=f"{self.hasher.salt}\x00lora:{adapter}")
            self._lora_hashers[adapter] = hasher
        return hasher

    def _unknown(self, message: str) -> None:
        if self.strict:
            raise UnknownBlockError(message)
        self.num_skipped += 1

    def _set(self, block_hash: ExternalHash, key: BlockKey, mask: int | None) -> None:
        """Map `block_hash` to `key`, held in `mask`'s tiers (None: retired), recording the undo."""
        if self._undo is not None:
            self._undo.append(
                (block_hash, self._keys.get(block_hash), self._held.get(block_hash), block_hash in self._retired)
            )
        self._keys[block_hash] = key
        if mask is not None:
            self._held[block_hash] = mask
            self._retired.pop(block_hash, None)
            return
        self._held.pop(block_hash, None)
        self._retired[block_hash] = None
        self._retired.move_to_end(block_hash)
        while len(self._retired) > self.max_retired_hashes:
            oldest = next(iter(self._retired))
            if self._undo is not None:
                self._undo.append((oldest, self._keys[oldest], None, True))
            del self._retired[oldest], self._keys[oldest]

    def _rollback(self) -> None:
        for block_hash, key, mask, retired in reversed(self._undo or []):
            self._held.pop(block_hash, None)
            self._retired.pop(block_hash, None)
            self._keys.pop(block_hash, None)
            if key is not None:
                self._keys[block_hash] = key
            if mask is not None:
                self._held[block_hash] = mask
            if retired:
                self._retired[block_hash] = None


# ---------------------------------------------------------------------- encoding


@attrs.frozen
class _Block:
    parent: BlockKey | None
    tokens: npt.NDArray[np.int32]
    depth: int


class VllmEventEncoder:
    """Writes this library's cache events as vLLM batches.

    Args:
        hasher: the hasher the events' keys come from (its block size is written).
        mediums: tier → vLLM medium (default `DEFAULT_MEDIUMS`).

    Not thread-safe.
    """

    def __init__(self, hasher: BlockHasher, *, mediums: Mapping[Tier, str] = DEFAULT_MEDIUMS) -> None:
        self.hasher = hasher
        self.mediums = {Tier(tier): medium for tier, medium in mediums.items()}
        self._blocks: dict[BlockKey, _Block] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def register(self, tokens: Any) -> tuple[BlockKey, ...]:
        """Remember every block of `tokens` (its tokens and parent) so that it can be encoded.

        Returns:
            The blocks' keys, as `hasher.block_keys(tokens)`.
        """
        array = as_token_array(tokens)
        keys = self.hasher.block_keys(array)
        size = self.hasher.block_size_tokens
        for i, key in enumerate(keys):
            if key not in self._blocks:
                chunk = array[i * size : (i + 1) * size].copy()
                self._blocks[key] = _Block(keys[i - 1] if i else None, chunk, i)
        return keys

    def forget(self, keys: Iterable[BlockKey]) -> None:
        """Drop what `register` recorded for `keys` (keys it did not record are ignored)."""
        for key in keys:
            self._blocks.pop(key, None)

    def external_hash(self, key: BlockKey) -> ExternalHash:
        """`key` as a vLLM block hash: an int when it fits 64 bits, else big-endian bytes."""
        width = self.hasher.key_bytes
        return int(key) if width == 8 else int(key).to_bytes(width, "big")

    def to_vllm(self, event: CacheEvent) -> tuple[VllmEvent, ...]:
        """`event` as vLLM events: one per run of chained keys for a `BlockStored`.

        Raises:
            UnknownBlockError: a stored key that `register` did not record.
            VllmEventError: a tier with no medium.
        """
        if isinstance(event, AllBlocksCleared):
            return (VllmAllBlocksCleared(),)
        medium = self.mediums.get(event.tier)
        if medium is None:
            raise VllmEventError(
                f"no vLLM medium for tier {event.tier.name}, known {sorted(t.name for t in self.mediums)}"
            )
        if isinstance(event, BlockRemoved):
            hashes = tuple(self.external_hash(k) for k in event.keys)
            return (VllmBlockRemoved(block_hashes=hashes, medium=medium),) if hashes else ()
        return tuple(
            VllmBlockStored(
                block_hashes=tuple(self.external_hash(k) for k in run),
                parent_block_hash=None
                if (parent := self._blocks[run[0]].parent) is None
                else self.external_hash(parent),
                token_ids=tuple(np.concatenate([self._blocks[k].tokens for k in run]).tolist()),
                block_size=self.hasher.block_size_tokens,
                medium=medium,
            )
            for run in self._runs(event.keys)
        )

    def encode(
        self,
        events: Sequence[CacheEvent],
        *,
        ts: float,
        data_parallel_rank: int | None = None,
        event_layout: WireLayout = "map",
        batch_layout: WireLayout = "array",
    ) -> bytes:
        """`events` as one vLLM payload (see `encode_batch` for the layouts)."""
        vllm_events = tuple(e for event in events for e in self.to_vllm(event))
        batch = VllmEventBatch(ts=ts, events=vllm_events, data_parallel_rank=data_parallel_rank)
        return encode_batch(batch, event_layout=event_layout, batch_layout=batch_layout)

    def _runs(self, keys: Iterable[BlockKey]) -> list[list[BlockKey]]:
        """`keys` as chains, parents before children: each run's keys follow one another."""
        unique = list(dict.fromkeys(keys))
        for key in unique:
            if key not in self._blocks:
                raise UnknownBlockError(f"block {key} was not registered: its tokens are unknown")
        runs: list[list[BlockKey]] = []
        open_at: dict[BlockKey, int] = {}  # a run's last key → its index
        for key in sorted(unique, key=lambda k: self._blocks[k].depth):
            parent = self._blocks[key].parent
            index = open_at.pop(parent, None) if parent is not None else None
            if index is None:
                index = len(runs)
                runs.append([])
            runs[index].append(key)
            open_at[key] = index
        return runs
