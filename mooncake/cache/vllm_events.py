"""vLLM's KV-cache events read into this library's cache events, and written from them.

The records and their msgpack layout are `mooncake.cache.vllm_wire`'s; this
module gives them this library's keys and sequence numbers.

Re-keying. A vLLM block hash is not this library's key, so `VllmEventDecoder`
re-derives keys from the token ids with a `BlockHasher` (the parent's key comes
from the parent hash), which makes prefixes match across engines and across this
library's own caches. vLLM stores and publishes full blocks only, so a
`BlockStored` must carry exactly `block_size` tokens per hash. The decoder keeps,
per source, a map vLLM hash → key: `BlockRemoved` carries hashes only, and so does
the `BlockStored` of vLLM's offloading connector (no token ids: a copy to CPU of
blocks the GPU stored), whose keys are looked up. Hashes are looked up in one form
(`index_hash`: their low 64 bits), because vLLM writes one block's hash in
several: its GPU pool as an int (`maybe_convert_block_hash`, by default), some
versions of its offloading connector as the raw bytes. The map holds every hash
some tier holds, plus the `max_retired_hashes` most recently dropped ones, so a
block stored just after its parent was evicted still finds its parent (a loss,
`skip_to`, drops every hash: their copies are unknown). LoRA
blocks are keyed in their adapter's namespace (`BlockHasher.for_lora`, where a
router keys a request naming that adapter; vLLM also writes the adapter's name,
or id, as each block's ``extra_keys``: those say nothing more); blocks with other
``extra_keys`` (multimodal inputs, cache salts) cannot be re-derived from tokens
and are refused. Only KV-cache group `kv_group` is read: a hybrid model's groups
hold the same prefixes but lose blocks independently (a sliding-window group frees
a request's blocks that slide out of its window while it runs, so they are evicted
first), and vLLM's hit needs every group; read a full-attention group, whose blocks
go only when the whole prefix is unused (vLLM numbers groups in the order of each
kind's first layer, so a model whose layer 0 slides has it at 1 or later). The
`kv_cache_spec_kind` that vLLM's `BlockStored` names is recorded per group
(`group_kinds`) to tell which one that is.

Copies. vLLM does not de-duplicate its cache: two requests that computed the same
block at once hold two physical copies of it under one hash, each announced by its
own `BlockStored` and retracted by its own `BlockRemoved` (`BlockPool`,
`BlockHashToBlockMap`), and the offloading connector's chunks re-announce the blocks
they share. The decoder therefore counts copies per hash and tier, and a tier gives
up a block (our `BlockRemoved`) when its last copy goes. Requests sent with
``kv_cache_report_mode="full"`` make vLLM re-announce the cached blocks they reuse,
which are no new copies: `report_mode="full"` reads a parentless GPU `BlockStored` of
a block the GPU holds already as such. The offloading connector names each chunk of
`blocks_per_chunk` GPU blocks by its last block's hash alone: the decoder counts
the chunk's every block (found through their parents).

Clearing. vLLM's `AllBlocksCleared` is its GPU pool's alone (`BlockPool.reset_prefix_cache`, the only place
vLLM publishes it): the decoder reads it as the removal of every block from the GPU's tier (our `BlockRemoved`
of the blocks the GPU held, their GPU copies dropped), and the other tiers keep theirs, for vLLM keeps serving
prefixes from CPU after a ``/reset_prefix_cache``. Resetting the offloading connector too
(``reset_connector``, ``reset_external``) publishes no event at all, so what the decoder, and an index it
feeds, hold for the CPU and storage tiers goes stale until those blocks' removals come, or a gap (`skip_to`,
then a `BlockIndex` drops the source's holdings on the new epoch's first event) or a restart of vLLM starts a
new epoch. This library's own `AllBlocksCleared` still means the whole source, for the producers that publish it.

Sequencing. vLLM numbers batches 0, 1, 2, ... per process. The decoder turns
batch ``seq`` into this library's events of one source, numbered one by one in
its own epoch: a batch above the next expected one is a gap (nothing is applied;
replay the missing batches, or `skip_to` to accept the loss); a batch below it is
a redelivery when it is one the decoder applied (the same number and publisher
timestamp, among the last `REDELIVERY_WINDOW`: vLLM delivers at least once, and a
replay may overlap what came live), ignored, and otherwise means vLLM restarted,
which starts a new, empty epoch. Each batch is applied whole or not at all.

Writing. `VllmEventEncoder` turns this library's events into vLLM batches. vLLM
events carry token ids, which this library's events do not, so the encoder needs
each stored block's tokens and parent: `register(tokens)` records them for every
full block of a token sequence (call it when a request's blocks are cached);
`forget(keys)` drops them. Keys serve as the block hashes (64-bit keys as ints,
wider ones as big-endian bytes); a `BlockStored` becomes one vLLM event per run of
chained keys, parents first. What vLLM never publishes, a partial last block, is
left out: `register` returns the full blocks' keys, and the key of a partial block
it met is left out of the events.

Invariants (`VllmEventDecoder.check_invariants`):
- a hash is mapped to a key iff some tier holds it or it is retired, not both;
- held hashes have a count of copies >= 0 per tier, some of them positive (a hash whose counts a loss made
  unknown, at `skip_to`, is retired); at most `max_retired_hashes` are retired, so the map is bounded by them and
  what some tier holds; a hash whose parent is recorded is mapped; a chunk stored without tokens is recorded, per
  tier, with its blocks (its naming hash last) and copies;
- the held are kept in the order they came to be held (a GPU clear retires them so), the retired in the order
  they were retired (the oldest goes first); a refused batch puts every hash back in its place.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from mooncake._checks import require_bool, require_int, require_iterable, require_str, shown
from mooncake.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent, SequenceGap, parse_tier
from mooncake.cache.hashing import BlockHasher
from mooncake.cache.vllm_wire import (
    ExternalHash,
    VllmAllBlocksCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmEvent,
    VllmEventBatch,
    WireLayout,
    decode_batch,
    encode_batch,
)
from mooncake.errors import ConfigError, InvalidRequestError, UnknownBlockError, VllmEventError
from mooncake.types import BlockKey, InstanceId, Tier, as_token_array

__all__ = [
    "DEFAULT_MEDIUMS",
    "DEFAULT_TIERS",
    "REDELIVERY_WINDOW",
    "REPORT_MODES",
    "VllmEventDecoder",
    "VllmEventEncoder",
    "index_hash",
]

DEFAULT_TIERS: Mapping[str | None, Tier] = {
    None: Tier.VRAM,
    "GPU": Tier.VRAM,
    "CPU": Tier.DRAM,
    "STORAGE": Tier.SSD,
    "DISK": Tier.SSD,
}
"""vLLM medium → tier (no medium: vLLM before mediums, which published GPU blocks only). vLLM's names
(`vllm.distributed.kv_events`: GPU, CPU, STORAGE, the last its offloading connector's disk tier), and DISK,
which this library's encoder wrote before vLLM named that medium. Mediums are read case-blind: vLLM's Mooncake
store connector writes "cpu"."""

DEFAULT_MEDIUMS: Mapping[Tier, str] = {Tier.VRAM: "GPU", Tier.DRAM: "CPU", Tier.SSD: "STORAGE"}
"""Tier → the medium the encoder writes."""

REDELIVERY_WINDOW = 1 << 14
"""How many applied batches (number → timestamp) a decoder remembers to tell a redelivery from a restart: more
than vLLM's replay buffer holds (`buffer_steps`, 10,000 by default)."""

REPORT_MODES = ("incremental", "full")
"""vLLM's `kv_cache_report_mode`s a decoder reads (see `VllmEventDecoder`'s `report_mode`)."""

# A hash a message names in full: a 32-byte one's repr is up to 131 characters (`shown` cuts at 60 by default).
_HASH_SHOWN = 140

_LOW_64 = (1 << 64) - 1
_NO_COPIES: tuple[int, ...] = (0,) * len(Tier)
_MISSING: Any = object()  # what the undo log records for an entry a table did not have


def index_hash(block_hash: ExternalHash) -> int:
    """The form in which a decoder looks up a vLLM block hash of any form: its low 64 bits.

    vLLM names one block in several forms. Its GPU pool publishes `maybe_convert_block_hash(h)` (vLLM's
    `vllm/v1/core/kv_cache_utils.py`): by default (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`) the int
    `int.from_bytes(h, "big") & (2**64 - 1)`, else the bytes `h`; the offloading connector of some releases
    published the raw bytes `get_offload_block_hash(key)` (`key[:-4]`, the same `h`) whatever that setting, and
    vLLM 0.32's converts them as the pool does (`OffloadingEventsTracker._placeholder_stored`). The low 64 bits
    of the big-endian bytes are that int, so every form of a block meets in one; older vLLM's signed ints (Python's
    `hash`) map one to one too.
    """
    if isinstance(block_hash, bytes):
        return int.from_bytes(block_hash, "big") & _LOW_64
    return block_hash & _LOW_64


_Change = tuple[type[BlockStored] | type[BlockRemoved], tuple[BlockKey, ...], Tier]
"""What one vLLM event does to a source's holdings: the kind of event of ours, its keys, its tier."""


def _medium_name(medium: str | None) -> str | None:
    """A medium as the decoder's map keys it: case-blind."""
    return medium.upper() if isinstance(medium, str) else medium


class VllmEventDecoder:
    """Turns one vLLM instance's batches into this library's events for `source`.

    Args:
        hasher: computes this library's keys; its block size must be vLLM's.
        source: the instance the events are about.
        epoch: the first epoch (a later one starts on each restart or `skip_to`).
        tiers: vLLM medium → tier (default `DEFAULT_TIERS`).
        kv_group: the KV-cache group read (events of other groups are ignored): for a hybrid model, a
            full-attention group (see the module docstring; `group_kinds` tells the groups' kinds).
        strict: raise on a hash never seen (True), or skip what cannot be translated
            and count it in `num_skipped` (for a subscriber that joined late).
        max_retired_hashes: dropped hashes whose keys are kept, most recent first.
        blocks_per_chunk: GPU blocks per chunk of vLLM's offloading connector (its
            ``kv_connector_extra_config`` ``blocks_per_chunk``, or ``block_size`` over the
            GPU block size), for its announcements that give no block size; one that
            does (some releases: the chunk's tokens) is read instead.
        report_mode: vLLM's ``kv_cache_report_mode`` of the requests: "incremental"
            (vLLM's default: each `BlockStored` is a new copy) or "full" (vLLM also
            re-announces the cached blocks a request reuses: a GPU `BlockStored` with no
            parent of a block the GPU holds already adds no copy, so a copy computed
            twice at once from the first block is then taken for one).

    Raises:
        ConfigError: `epoch`, `kv_group` or `max_retired_hashes` is not an integer >= 0, `blocks_per_chunk` not
            one >= 1, `report_mode` not one of `REPORT_MODES`; `hasher` is no `BlockHasher`, `source` no instance id
            string, `tiers` no map of mediums to tiers (or their names), `strict` no bool.

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
        blocks_per_chunk: int = 1,
        report_mode: str = "incremental",
    ) -> None:
        if not isinstance(hasher, BlockHasher):
            raise ConfigError(f"hasher must be a mooncake.cache.hashing.BlockHasher, got {shown(hasher)}")
        self.hasher = hasher
        self.source = InstanceId(require_str("source", source, what="instance id string"))
        if not isinstance(tiers, Mapping) or not all(isinstance(m, str | None) for m in tiers):
            raise ConfigError(f"tiers must map vLLM mediums (strings, or None) to tiers, got {shown(tiers)}")
        self.tiers: dict[str | None, Tier] = {}
        for medium, tier in tiers.items():
            named = _medium_name(medium)
            if named in self.tiers and self.tiers[named] != parse_tier(tier):
                raise ConfigError(
                    f"tiers maps medium {shown(medium)} twice (mediums are case-blind), to different tiers"
                )
            self.tiers[named] = parse_tier(tier)
        self.kv_group = require_int("kv_group", kv_group, minimum=0)
        self.strict = require_bool("strict", strict)
        self.max_retired_hashes = require_int("max_retired_hashes", max_retired_hashes, minimum=0)
        self.blocks_per_chunk = require_int("blocks_per_chunk", blocks_per_chunk, minimum=1)
        if report_mode not in REPORT_MODES:
            raise ConfigError(f"report_mode must be one of {REPORT_MODES}, got {shown(report_mode)}")
        self.report_mode = report_mode
        # The tier vLLM's GPU pool, the publisher of AllBlocksCleared, stores in (vLLM before mediums: no medium).
        self._gpu_tier = self.tiers.get("GPU", self.tiers.get(None, Tier.VRAM))
        self.num_skipped = 0
        self._epoch = require_int("epoch", epoch, minimum=0)
        self._expected = 0  # the next vLLM batch seq
        self._seq = 0  # the next event seq of ours
        # Every table is keyed by `index_hash`.
        self._keys: dict[int, BlockKey] = {}
        self._held: dict[int, tuple[int, ...]] = {}  # hash → copies per tier, oldest held first
        self._held_at: dict[int, int] = {}  # hash → when it came to be held (its place in `_held`)
        self._retired: OrderedDict[int, int] = OrderedDict()  # hash → when it was retired, oldest first
        self._parents: dict[int, int] = {}  # hash → its parent's (a hash that starts a sequence has none)
        self._chunks: dict[tuple[int, int], tuple[tuple[int, ...], int]] = {}  # (hash, tier) → (its chunk, copies)
        self._clock = 0  # stamps the moves above, so that a refused batch can put each hash back in its place
        self._lora_hashers: dict[str, BlockHasher] = {}
        self._undo: list[tuple[dict[Any, Any], Any, Any]] | None = None  # (table, key, value before)
        self._applied: OrderedDict[int, float] = OrderedDict()  # the last batches applied: seq → publisher's ts
        self.num_redelivered = 0
        # The kv_cache_spec_kind each group's BlockStored named, the last one seen (kept across restarts: a fact
        # of the server's model, which a later BlockStored corrects; vLLM before 0.32 names none).
        self.group_kinds: dict[int, str] = {}

    @property
    def epoch(self) -> int:
        """The epoch the next events carry."""
        return self._epoch

    @property
    def expected_seq(self) -> int:
        """The vLLM batch seq the decoder expects next."""
        return self._expected

    def key_of(self, block_hash: ExternalHash) -> BlockKey | None:
        """This library's key for a vLLM hash (in any of its forms) the decoder knows (held or retired), else None."""
        if not isinstance(block_hash, int | bytes):
            return None
        return self._keys.get(index_hash(block_hash))

    def num_copies(self, block_hash: ExternalHash, tier: Tier | int | str) -> int:
        """How many copies of a block (a vLLM hash, in any form) `tier` holds, as the events counted them.

        Raises:
            VllmEventError: `block_hash` is not an int or bytes.
            ConfigError: `tier` is no tier.
        """
        if not isinstance(block_hash, int | bytes):
            raise VllmEventError(f"block_hash must be a vLLM block hash (an int or bytes), got {shown(block_hash)}")
        return self._held.get(index_hash(block_hash), _NO_COPIES)[parse_tier(tier)]

    def decode(self, payload: bytes, *, seq: int) -> tuple[CacheEvent, ...] | SequenceGap:
        """`translate` of `decode_batch(payload)`."""
        return self.translate(decode_batch(payload), seq=seq)

    def translate(self, batch: VllmEventBatch, *, seq: int) -> tuple[CacheEvent, ...] | SequenceGap:
        """This library's events for vLLM batch number `seq`.

        Batches come in order; a batch below `expected_seq` that the decoder applied
        (the same number and timestamp) is a redelivery, ignored (no events; counted
        in `num_redelivered`); any other batch below it is taken as vLLM having
        restarted (its numbers start again at 0), so the decoder first starts a new,
        empty epoch.

        Returns:
            The events, numbered on from the last ones (empty when nothing in the
            batch concerns the index, or for a redelivery); or, for a batch above
            `expected_seq`, a `SequenceGap` in vLLM batch numbers, with nothing applied.

        Each `BlockStored` is a copy more of its blocks in its tier (see `report_mode`),
        each `BlockRemoved` one fewer; our `BlockStored` names them all, our
        `BlockRemoved` those whose last copy in the tier went. vLLM's `AllBlocksCleared`
        (its GPU pool's) takes every GPU copy: our `BlockRemoved` from the GPU's tier of
        the blocks it held there (other tiers keep theirs; see the module docstring). A `BlockStored` without
        token ids (vLLM's offloading connector copying blocks to CPU) names blocks by
        hash alone: each must be a hash the decoder knows (from the GPU's store), and
        stands for its chunk: itself and the blocks before it, `blocks_per_chunk` in
        all (or its block size over the hasher's, where it gives one), each of which
        gains a copy in the event's tier; a removal of it takes them back.

        Raises:
            VllmEventError: a block size other than the hasher's (a token-less event's: not a multiple of it),
                token ids other than `block_size` per hash (vLLM stores full blocks only), an unknown medium, or
                extra keys (strict); `batch` is no `VllmEventBatch`, `seq` no integer >= 0.
            UnknownBlockError: a parent, removed or token-less stored hash never seen (strict only).
            Either way the batch is not applied.
        """
        if not isinstance(batch, VllmEventBatch):
            raise VllmEventError(f"batch must be a VllmEventBatch (decode_batch reads one), got {shown(batch)}")
        seq = require_int("seq", seq, minimum=0, error=VllmEventError)
        before_restart = None
        if seq < self._expected:
            if self._applied.get(seq) == batch.ts:
                self.num_redelivered += 1
                return ()
            before_restart = self._state()  # a restart the batch then refused did not happen
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
        skipped = self.num_skipped
        try:
            changes = [change for event in batch.events if (change := self._apply(event)) is not None]
            # Built before anything commits: an event that cannot be made leaves the decoder as it was.
            source, epoch = self.source, self._epoch
            events = tuple(
                kind(source=source, seq=self._seq + i, keys=keys, tier=tier, epoch=epoch)
                for i, (kind, keys, tier) in enumerate(changes)
            )
        except BaseException:
            self._rollback()
            self.num_skipped = skipped  # what a refused batch skipped is skipped again when it is replayed
            if before_restart is not None:
                self._restore(before_restart)
            raise
        finally:
            self._undo = None
        self._seq += len(events)
        self._expected = seq + 1
        self._applied[seq] = batch.ts
        if len(self._applied) > REDELIVERY_WINDOW:
            self._applied.popitem(last=False)
        return events

    def skip_to(self, seq: int) -> None:
        """Accept that the batches before `seq` are lost: expect `seq` next, in a new epoch.

        A consumer's holdings for this source are unknown from here; a `BlockIndex`
        drops them on the new epoch's first event (or `resync` it to empty at once).
        So are the counts of copies (the lost batches changed them): every held hash
        is retired, in the order they came to be held, as if its last copy went, so
        the next removal of a block held before publishes its removal, and a block
        stored again counts its copies from zero. Hash translations are kept as
        retired ones are (a hash always stands for the same tokens): the
        `max_retired_hashes` most recent, so that the decoder's memory stays bounded
        however often batches are lost (the fleet's `skip_to(0)` on every server
        down); a removal of a hash pushed out since is one never seen.
        """
        seq = require_int("seq", seq, minimum=0, error=VllmEventError)
        self._epoch += 1
        self._seq = 0
        self._expected = seq
        for block_hash, key in [(h, self._keys[h]) for h in self._held]:  # oldest held first: it retires first
            self._set(block_hash, key, None)
        self._chunks = {}

    def restart(self, *, epoch: int | None = None) -> None:
        """Forget everything (vLLM restarted): expect batch 0 next, in `epoch` (default: the next).

        Raises:
            ConfigError: `epoch` is not an integer >= 0 (as the constructor's); nothing is forgotten then.
        """
        epoch = self._epoch + 1 if epoch is None else require_int("epoch", epoch, minimum=0)
        self._epoch = epoch
        self._seq = 0
        self._expected = 0
        # New containers, not cleared ones: `translate` keeps the old to undo a restart whose batch is refused.
        self._keys, self._held, self._held_at, self._retired = {}, {}, {}, OrderedDict()
        self._parents, self._chunks = {}, {}
        self._applied = OrderedDict()

    # What a restart replaces: kept by `translate` to undo a restart whose batch is refused.
    _RESTARTED = (
        "_epoch",
        "_seq",
        "_expected",
        "_keys",
        "_held",
        "_held_at",
        "_retired",
        "_parents",
        "_chunks",
        "_applied",
    )

    def _state(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._RESTARTED)

    def _restore(self, state: tuple[Any, ...]) -> None:
        for name, value in zip(self._RESTARTED, state, strict=True):
            setattr(self, name, value)

    def check_invariants(self) -> None:
        """Raise AssertionError if an invariant of the module docstring fails."""
        assert set(self._keys) == set(self._held) | set(self._retired), "mapped hashes != held + retired"
        assert self._held_at.keys() == self._held.keys(), "a held hash without its stamp"
        assert list(self._held) == sorted(self._held, key=self._held_at.__getitem__), "held out of order"
        assert list(self._retired.values()) == sorted(self._retired.values()), "retired out of order"
        assert not set(self._held) & set(self._retired), "a hash is both held and retired"
        assert all(len(counts) == len(Tier) and min(counts) >= 0 for counts in self._held.values()), (
            "a held hash's copies are not counted per tier"
        )
        assert all(any(counts) for counts in self._held.values()), "a hash held with no copies (it is retired)"
        assert len(self._retired) <= self.max_retired_hashes, f"{len(self._retired)} retired hashes"
        assert set(self._parents) <= set(self._keys), "a parent link of a hash no longer mapped"
        for (block_hash, tier), (chunk, copies) in self._chunks.items():
            assert copies > 0 and chunk[-1] == block_hash and 0 <= tier < len(Tier), f"chunk {block_hash}: {chunk}"

    # ------------------------------------------------------------------ internals

    def _apply(self, event: VllmEvent) -> _Change | None:
        if isinstance(event, VllmAllBlocksCleared):
            return self._clear_gpu()
        if isinstance(event, VllmBlockStored) and event.group_idx is not None and event.kv_cache_spec_kind:
            self.group_kinds[event.group_idx] = event.kv_cache_spec_kind
        if event.group_idx not in (None, self.kv_group):
            return None
        tier = self.tiers.get(_medium_name(event.medium))
        if tier is None:
            raise VllmEventError(
                f"{self.source}: unknown medium {shown(event.medium)}, known {sorted(map(str, self.tiers))}"
            )
        if isinstance(event, VllmBlockRemoved):
            removed: list[BlockKey] = []
            for raw in event.block_hashes:
                block_hash = index_hash(raw)
                if block_hash not in self._keys:
                    self._unknown(
                        f"{self.source}: BlockRemoved names hash {shown(raw, limit=_HASH_SHOWN)}, never stored (or retired)"
                    )
                    continue
                for covered in self._uncopy_chunk(block_hash, tier):
                    key = self._keys.get(covered)
                    # The tier's last copy went (or none was counted: a copy stored before a loss).
                    if key is not None and self._add_copies(covered, key, tier, -1) == 0:
                        removed.append(key)
            return (BlockRemoved, tuple(removed), tier) if removed else None
        stored = self._copied(event, tier) if not event.token_ids else self._stored(event)
        if stored is None:
            return None
        # The GPU pool re-announces reused blocks (report mode "full") from the sequence's first block, no parent
        # (`BlockPool.emit_cached_block_events`); the offloading connector's chunks are copies, parent or not.
        reannounces = (
            self.report_mode == "full"
            and event.parent_block_hash is None
            and bool(event.token_ids)
            and tier == self.tiers.get("GPU")
        )
        for block_hash, key in stored:
            if not (reannounces and self._held.get(block_hash, _NO_COPIES)[tier]):
                self._add_copies(block_hash, key, tier, 1)
        keys = tuple(dict.fromkeys(key for _, key in stored))  # chunks sharing blocks name them once
        return (BlockStored, keys, tier) if keys else None

    def _clear_gpu(self) -> _Change | None:
        """vLLM's AllBlocksCleared: its GPU pool dropped every block (`BlockPool.reset_prefix_cache`, the event's
        only publisher); the offloading connector's tiers keep theirs (its reset publishes nothing). Every GPU copy
        goes, in the order the blocks came to be held, and a block left in no tier is retired; the GPU's chunk
        records go too. Blocks retired at `skip_to` (their copies unknown) stay retired: no index holds them in
        this epoch."""
        tier = self._gpu_tier
        removed: list[BlockKey] = []
        for block_hash, counts in list(self._held.items()):
            if counts[tier]:
                key = self._keys[block_hash]
                self._add_copies(block_hash, key, tier, -counts[tier])
                removed.append(key)
        for chunk in [chunk for chunk in self._chunks if chunk[1] == tier]:
            self._write(self._chunks, chunk, _MISSING)
        keys = tuple(dict.fromkeys(removed))  # two hashes of one key (a hash in two forms) name it once
        return (BlockRemoved, keys, tier) if keys else None

    def _add_copies(self, block_hash: int, key: BlockKey, tier: Tier, delta: int) -> int:
        """Count `delta` copies more of block `key` (`block_hash`) in `tier` (never below zero: a removal of a copy
        never counted, after a loss, leaves none); the copies it has there now. A hash with none anywhere is
        retired."""
        counts = list(self._held.get(block_hash, _NO_COPIES))
        counts[tier] = max(0, counts[tier] + delta)
        self._set(block_hash, key, tuple(counts) if any(counts) else None)
        return counts[tier]

    def _uncopy_chunk(self, block_hash: int, tier: Tier) -> tuple[int, ...]:
        """The hashes a removal of `block_hash` from `tier` takes a copy of: the chunk it named when stored there
        without tokens (one copy of that chunk fewer), else itself."""
        recorded = self._chunks.get((block_hash, tier))
        if recorded is None:
            return (block_hash,)
        chunk, copies = recorded
        self._write(self._chunks, (block_hash, tier), (chunk, copies - 1) if copies > 1 else _MISSING)
        return chunk

    def _copied(self, event: VllmBlockStored, tier: Tier) -> list[tuple[int, BlockKey]]:
        """(hash, key) of each block that a BlockStored without token ids stands for, parents first. vLLM's
        offloading connector announces the chunks it copies to CPU by the hash of each chunk's last GPU block
        alone (`RequestOffloadState.update_offload_keys`, `OffloadingEventsTracker._placeholder_stored`), each a
        block the decoder met when the GPU stored it; the chunk's other blocks are that block's parents. A hash
        it does not know goes as in a BlockRemoved."""
        per_chunk = self._blocks_in_chunk(event)
        known: list[tuple[int, BlockKey]] = []
        for raw in event.block_hashes:
            block_hash = index_hash(raw)
            if block_hash not in self._keys:
                self._unknown(
                    f"{self.source}: BlockStored (no token ids) names hash {shown(raw, limit=_HASH_SHOWN)}, never stored"
                )
                continue
            chunk = [block_hash]
            while len(chunk) < per_chunk and (parent := self._parents.get(chunk[-1])) is not None:
                if parent not in self._keys:  # retired and pushed out since its child was stored
                    self._unknown(
                        f"{self.source}: BlockStored (no token ids) names hash {shown(raw, limit=_HASH_SHOWN)}, whose chunk's"
                        f" block {parent:#x} was never stored (or retired)"
                    )
                    break
                chunk.append(parent)
            chunk.reverse()
            if len(chunk) > 1:
                copies = self._chunks.get((block_hash, tier), ((), 0))[1]
                self._write(self._chunks, (block_hash, tier), (tuple(chunk), copies + 1))
            known.extend((covered, self._keys[covered]) for covered in chunk)
        return known

    def _blocks_in_chunk(self, event: VllmBlockStored) -> int:
        """How many GPU blocks each hash of a token-less BlockStored stands for: its block size (some releases write
        the chunk's tokens) over the hasher's, or `blocks_per_chunk` where it gives none (vLLM 0.32 writes 0)."""
        if not event.block_size:
            return self.blocks_per_chunk
        per_chunk, rest = divmod(event.block_size, self.hasher.block_size_tokens)
        if rest or not per_chunk:
            raise VllmEventError(
                f"{self.source}: BlockStored (no token ids) has block_size {event.block_size}, not a multiple of the"
                f" hasher's {self.hasher.block_size_tokens}"
            )
        return per_chunk

    def _stored(self, event: VllmBlockStored) -> list[tuple[int, BlockKey]] | None:
        """(hash, key) of each block a BlockStored with token ids names, its key re-derived from the tokens (and
        its parent recorded); None where the event is skipped."""
        keys = self._stored_keys(event)
        if keys is None:
            return None
        hashes = [index_hash(raw) for raw in event.block_hashes]
        parent = None if event.parent_block_hash is None else index_hash(event.parent_block_hash)
        for block_hash in hashes:  # for the offloading connector's chunks, named by their last block
            if parent is not None and self._parents.get(block_hash) != parent:
                self._write(self._parents, block_hash, parent)
            parent = block_hash
        return list(zip(hashes, keys, strict=True))

    def _stored_keys(self, event: VllmBlockStored) -> tuple[BlockKey, ...] | None:
        hasher = self.hasher
        if event.block_size != hasher.block_size_tokens:
            raise VllmEventError(
                f"{self.source}: BlockStored has block_size {event.block_size}, the hasher {hasher.block_size_tokens}"
            )
        # vLLM caches and publishes full blocks only (`BlockPool.cache_full_blocks`): a partial block's key would
        # stand for tokens that no full block of the prompt has, and its children would chain off it.
        expected = len(event.block_hashes) * event.block_size
        if len(event.token_ids) != expected:
            raise VllmEventError(
                f"{self.source}: BlockStored has {len(event.token_ids)} token ids for {len(event.block_hashes)} hashes"
                f" of {event.block_size}-token blocks: {expected} expected (full blocks only)"
            )
        adapter = event.lora_name if event.lora_name is not None else event.lora_id
        if event.extra_keys is not None and any(not _names_adapter(extra, event) for extra in event.extra_keys):
            if self.strict:
                raise VllmEventError(
                    f"{self.source}: BlockStored has extra_keys {shown(event.extra_keys)}: its keys depend on more"
                    " than token ids"
                )
            self.num_skipped += 1
            return None
        parent = None
        if event.parent_block_hash is not None:
            parent = self._keys.get(index_hash(event.parent_block_hash))
            if parent is None:
                self._unknown(
                    f"{self.source}: BlockStored's parent hash {shown(event.parent_block_hash, limit=_HASH_SHOWN)} was never stored (or "
                    "retired)"
                )
                return None
        if adapter is not None:
            hasher = self._lora_hasher(str(adapter))
        return hasher.block_keys(np.asarray(event.token_ids, dtype=np.int32), parent=parent)

    def _lora_hasher(self, adapter: str) -> BlockHasher:
        hasher = self._lora_hashers.get(adapter)
        if hasher is None:
            # The one LoRA namespace: the vLLM router keys an adapter's prompts through it too.
            hasher = self.hasher.for_lora(adapter)
            self._lora_hashers[adapter] = hasher
        return hasher

    def _unknown(self, message: str) -> None:
        if self.strict:
            raise UnknownBlockError(message)
        self.num_skipped += 1

    def _write(self, table: dict[Any, Any], key: Any, value: Any) -> None:
        """`table[key] = value` (`_MISSING`: remove it), recording what was there for `_rollback`."""
        if self._undo is not None:
            self._undo.append((table, key, table.get(key, _MISSING)))
        if value is _MISSING:
            table.pop(key, None)
        else:
            table[key] = value

    def _set(self, block_hash: int, key: BlockKey, counts: tuple[int, ...] | None) -> None:
        """Map `block_hash` to `key`, held with `counts` copies per tier (None: retired)."""
        self._write(self._keys, block_hash, key)
        self._clock += 1
        if counts is not None:
            if block_hash not in self._held:
                self._write(self._held_at, block_hash, self._clock)
            self._write(self._held, block_hash, counts)
            if block_hash in self._retired:
                self._write(self._retired, block_hash, _MISSING)
            return
        leaving: tuple[dict[int, Any], ...] = (self._held, self._held_at, self._retired)
        for table in leaving:  # retired again: it becomes the newest
            if block_hash in table:
                self._write(table, block_hash, _MISSING)
        self._write(self._retired, block_hash, self._clock)
        while len(self._retired) > self.max_retired_hashes:
            oldest = next(iter(self._retired))
            forgotten: tuple[dict[int, Any], ...] = (self._retired, self._keys, self._parents)
            for table in forgotten:
                if oldest in table:
                    self._write(table, oldest, _MISSING)

    def _rollback(self) -> None:
        """Undo the batch's writes, each hash back in its place among the held and the retired (by its stamp:
        the order decides which retired hash goes first and in which order a clear retires the held)."""
        for table, key, value in reversed(self._undo or []):
            table.pop(key, None)
            if value is not _MISSING:
                table[key] = value
        self._held = {h: self._held[h] for h in sorted(self._held, key=self._held_at.__getitem__)}
        self._retired = OrderedDict(sorted(self._retired.items(), key=lambda item: item[1]))


def _names_adapter(extra: tuple[Any, ...] | None, event: VllmBlockStored) -> bool:
    """Whether a block's extra keys say no more than its LoRA adapter (which the LoRA salt keys): none, or the
    adapter alone as vLLM adds it to every block of a LoRA request (`lora_name`; `lora_int_id` in older vLLM)."""
    if extra is None:
        return True
    return len(extra) == 1 and any(
        type(extra[0]) is type(named) and extra[0] == named
        for named in (event.lora_name, event.lora_id)
        if named is not None
    )


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
        if not isinstance(hasher, BlockHasher):
            raise ConfigError(f"hasher must be a mooncake.cache.hashing.BlockHasher, got {shown(hasher)}")
        self.hasher = hasher
        if not isinstance(mediums, Mapping) or not all(isinstance(m, str) for m in mediums.values()):
            raise ConfigError(f"mediums must map tiers to vLLM medium strings, got {shown(mediums)}")
        self.mediums = {parse_tier(tier): medium for tier, medium in mediums.items()}
        self._blocks: dict[BlockKey, _Block] = {}
        self._partial: set[BlockKey] = set()  # partial last blocks `register` met: left out of every event

    def __len__(self) -> int:
        return len(self._blocks)

    def register(self, tokens: Any) -> tuple[BlockKey, ...]:
        """Remember every full block of `tokens` (its tokens and parent) so that it can be encoded.

        vLLM caches and publishes full blocks only, so a partial last block is not one of them: its key (of
        `hasher.block_keys(tokens)`) is left out of the events (`to_vllm`), where a cache stores it anyway.

        Returns:
            The full blocks' keys: `hasher.block_keys(tokens)` up to the last full block.
        """
        array = as_token_array(tokens)
        keys = self.hasher.block_keys(array)
        size = self.hasher.block_size_tokens
        num_full = len(array) // size
        for i, key in enumerate(keys[:num_full]):
            if key not in self._blocks:
                chunk = array[i * size : (i + 1) * size].copy()
                self._blocks[key] = _Block(keys[i - 1] if i else None, chunk, i)
        self._partial.update(keys[num_full:])
        return keys[:num_full]

    def forget(self, keys: Iterable[BlockKey]) -> None:
        """Drop what `register` recorded for `keys` (keys it did not record are ignored).

        Raises:
            InvalidRequestError: `keys` is not an iterable of keys.
        """
        keys = require_iterable("keys", keys, error=InvalidRequestError)
        for key in keys:
            self._blocks.pop(key, None)
            self._partial.discard(key)

    def external_hash(self, key: BlockKey) -> ExternalHash:
        """`key` as a vLLM block hash: an int when it fits 64 bits, else big-endian bytes."""
        width = self.hasher.key_bytes
        return int(key) if width == 8 else int(key).to_bytes(width, "big")

    def to_vllm(self, event: CacheEvent) -> tuple[VllmEvent, ...]:
        """`event` as vLLM events: one per run of chained keys for a `BlockStored`, partial blocks left out.

        An `AllBlocksCleared` (this library's: the whole source) becomes vLLM's, which only its GPU pool
        publishes and a decoder reads as the GPU tier's clear: publish the other tiers' removals as well
        (`BlockRemoved` per tier) for a vLLM consumer to see them go.

        Raises:
            UnknownBlockError: a stored key that `register` did not record.
            VllmEventError: a tier with no medium; `event` is no cache event.
        """
        if not isinstance(event, BlockStored | BlockRemoved | AllBlocksCleared):
            raise VllmEventError(
                f"to_vllm takes a cache event (BlockStored, BlockRemoved, AllBlocksCleared), got {shown(event)}"
            )
        if isinstance(event, AllBlocksCleared):
            return (VllmAllBlocksCleared(),)
        medium = self.mediums.get(event.tier)
        if medium is None:
            raise VllmEventError(
                f"no vLLM medium for tier {event.tier.name}, known {sorted(t.name for t in self.mediums)}"
            )
        if isinstance(event, BlockRemoved):
            hashes = tuple(self.external_hash(k) for k in event.keys if k not in self._partial)
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
        """`keys` (but partial blocks) as chains, parents before children: each run's keys follow one another."""
        unique = [key for key in dict.fromkeys(keys) if key not in self._partial]
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
