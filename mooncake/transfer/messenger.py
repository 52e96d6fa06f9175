"""The Messenger: a node's block service over its transfer engine and tiered cache.

Blocks move between nodes' first-tier (DRAM) pages directly: the page pool's
buffer is one registered region, and a block at page p sits at offset
``p * page_bytes`` in it.

- `fetch(keys, peer)` copies the leading blocks of `keys` that `peer` holds into
  the local cache (this is how hot blocks replicate): the peer pins them and
  returns their region, offsets and checksums ("blocks.lookup"); the messenger
  reserves local pages, READs straight into them, then commits each page after
  checking it against the peer's checksum; the peer's pins are released at the end.
- `push(keys, peer)` streams local blocks into a peer's cache (prefill → decode):
  the peer reserves pages ("blocks.reserve"), the messenger WRITEs into them,
  and the peer commits each against the checksum sent with "blocks.commit".

Both move a block in `parts` byte ranges (equal, a layer each, for a KV block
laid out layer by layer) so an engine can overlap transfer with compute:
`Fetch.wait_part(p)` returns as soon as range p of every block has arrived, and
`Push.send_part(p)` ships range p as soon as it is written.

Leases: pins and reservations taken for a peer expire `lease_s` after its last
call, released by a sweeper thread (and on every call), so a vanished peer
holds nothing for long. A reserved page is never given back while a transfer
that targets it may still write into it: a failed fetch first waits for its
slices to end, and a pusher commits only once its writes have ended. So an
expired lease's pins go, but its reservations stay (quarantined) until its
pusher commits or releases it, or `release_owner` says its process is gone: a
pusher that was only paused (SIGSTOP) may resume mid-write, and the pages it
writes into must not meanwhile hold other blocks. (A pusher stopped for good,
or one whose slices never settle, keeps its pages until its process is gone.)
Each lease names its owner, the engine address of the peer that opened it.
`lease_s` should exceed how long a pusher's slice can take
(`EngineConfig.slice_deadline_s`; 66 s with the default engine settings), else
a slow push outlives its lease and is refused at its commit: by default it is
twice that, and at least 30 s. A peer opens a lease with any id it likes, so the table of
leases is bounded: ids of at most 64 characters, at most `max_leases` open at
once (a call that would open one more is refused with `CapacityError` until
some end or expire), and a lookup that pinned nothing keeps no lease.

The module is one piece, past the usual size, because it holds both ends of the
block protocol: `fetch` against "blocks.lookup" and "blocks.release", `push`
against "blocks.reserve" and "blocks.commit". Their messages must agree field
by field and the leases bind the serving side to both, so each half is read
with the other.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs
import xxhash

from mooncake._checks import ceil_div, require_int, require_number, shown
from mooncake.cache.pool import DramPagePool, check_checksum
from mooncake.cache.tiered import TieredCache
from mooncake.errors import (
    BlockPinnedError,
    CapacityError,
    ConfigError,
    IntegrityError,
    MooncakeError,
    TransferError,
    TransferTimeout,
    UnknownBlockError,
)
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.region import RegionDescriptor
from mooncake.transfer.request import RequestState, TransferOp, TransferRequest
from mooncake.transfer.wire import Json, ProtocolError
from mooncake.types import BlockKey, key_tuple

__all__ = ["Fetch", "Messenger", "Push", "part_range", "shared_dram_pool"]

_MAX_LEASE_ID = 64  # characters; ours are 16 hex digits
MIN_LEASE_S = 30.0  # the default lease's floor: a vanished peer's pins go within a minute or so
_MAX_OWNER = 256  # characters of an owner's engine address (host:port)
_MAX_SHOWN = 200  # characters of a malformed reply quoted in its error
_T = TypeVar("_T")


def shared_dram_pool(engine: TransferEngine, page_bytes: int, num_pages: int) -> tuple[DramPagePool, RegionDescriptor]:
    """A DRAM page pool in the engine's shared memory, registered: same-host peers copy into it directly."""
    region, buffer = engine.allocate_shared(page_bytes * num_pages)
    return DramPagePool(page_bytes, num_pages, buffer=buffer), region


def part_range(length: int, parts: int, part: int) -> tuple[int, int]:
    """Byte range [start, end) of `part` when `length` bytes are cut into `parts` pieces of ceil(length / parts).

    The pieces tile [0, length) in order; they are equal when `parts` divides `length` (a KV block's
    layers), else the last non-empty one may be shorter and any after it are empty (10 in 4: 3, 3, 3, 1;
    4 in 3: 2, 2, 0).
    """
    step = ceil_div(length, parts) if length else 0
    start = min(length, part * step)
    return start, min(length, start + step)


@attrs.define(eq=False)
class _Lease:
    pinned: list[BlockKey] = attrs.field(factory=list)
    reserved: list[BlockKey] = attrs.field(factory=list)
    deadline: float = 0.0
    owner: str = ""  # the engine address of the peer that opened it ("": not said)


class Messenger:
    """Serves and moves KV blocks of one node.

    Args:
        engine: the node's transfer engine.
        cache: the node's tiered cache; its first tier must be a `DramPagePool`.
        region: the engine's descriptor of that pool's buffer, if already registered
            (see `shared_dram_pool`); otherwise the buffer is registered here.
        lease_s: how long pins and reservations held for a peer survive without it (None: twice the engine's
            `slice_deadline_s`, at least 30 s).
        sweep_interval_s: how often a background thread releases expired leases
            (0: only on calls, and when `sweep()` is called).
        max_leases: leases held for peers at once; past it, calls that would open
            another are refused (a peer looping on lookups cannot grow the table).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self,
        engine: TransferEngine,
        cache: TieredCache,
        *,
        region: RegionDescriptor | None = None,
        lease_s: float | None = None,
        sweep_interval_s: float | None = None,
        max_leases: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if lease_s is None:
            lease_s = max(MIN_LEASE_S, 2 * engine.config.slice_deadline_s)
        lease_s = require_number("lease_s", lease_s, minimum=0, strict=True)
        if sweep_interval_s is not None:
            require_number("sweep_interval_s", sweep_interval_s, minimum=0)
        pool = cache.pools[0]
        if not isinstance(pool, DramPagePool):
            raise ConfigError("the messenger moves first-tier pages: the cache's first tier must be a DramPagePool")
        self.engine, self.cache = engine, cache
        self.page_bytes = pool.page_bytes
        self.region = region if region is not None else engine.register_memory(pool.buffer)
        self._lease_s, self._clock = lease_s, clock
        self._max_leases = require_int("max_leases", max_leases, minimum=1)
        self._leases: dict[str, _Lease] = {}
        # Expired leases with reservations: their pages stay reserved until the owner commits, releases or is gone.
        self._quarantine: dict[str, _Lease] = {}
        self._lock = threading.Lock()
        engine.register_handler("blocks.lookup", self._serve_lookup)
        engine.register_handler("blocks.release", self._serve_release)
        engine.register_handler("blocks.reserve", self._serve_reserve)
        engine.register_handler("blocks.commit", self._serve_commit)
        interval = lease_s / 2 if sweep_interval_s is None else sweep_interval_s
        self._stop = threading.Event()
        if interval > 0:
            threading.Thread(target=self._sweeper, args=(interval,), name="messenger-sweep", daemon=True).start()

    def close(self) -> None:
        """Stop the sweeper and release every lease (the engine is closed by its owner)."""
        self._stop.set()
        with self._lock:
            leases = [*self._leases.values(), *self._quarantine.values()]
            self._leases.clear()
            self._quarantine.clear()
        for lease in leases:
            self._end(lease)

    def release_owner(self, owner: str) -> int:
        """End every lease `owner` (a peer's engine address) holds here, quarantined ones included: its process
        is gone, so nothing of it can still write into the pages it reserved. Returns how many ended.

        Raises:
            TransferError: `owner` is not a non-empty string.
        """
        if not isinstance(owner, str) or not owner:
            raise TransferError(f"an owner is a peer's engine address, got {shown(owner)}")
        with self._lock:
            leases = []
            for table in (self._leases, self._quarantine):
                for lease_id in [i for i, lease in table.items() if lease.owner == owner]:
                    leases.append(table.pop(lease_id))
        for lease in leases:
            self._end(lease)
        return len(leases)

    @property
    def quarantined(self) -> int:
        """Expired leases whose reservations are held until their owner commits, releases or is gone."""
        return len(self._quarantine)

    # ------------------------------------------------------------------ moving blocks

    def fetch(self, keys: Sequence[BlockKey], from_peer: str, *, parts: int = 1) -> Fetch:
        """Start copying the leading `keys` that `from_peer` holds (and we do not) into the local cache, in
        `parts` byte ranges of each block (`part_range`): an integer in [1, page_bytes].

        Raises:
            ConfigError: `parts` is not such an integer.
        """
        parts = self._parts(parts)
        self.sweep()
        lease = secrets.token_hex(8)
        wanted = list(key_tuple(keys))  # checked before any call: int() made 1.5, "1" and True block 1
        reply: Any = self.engine.call(
            from_peer, "blocks.lookup", {"lease": lease, "keys": wanted, "owner": self.engine.address}
        )
        reserved: list[tuple[BlockKey, int, int, int, int]] = []  # key, remote offset, length, checksum, local offset
        batches: list[int] = []
        try:
            remote_region, found = _read_reply(from_peer, "blocks.lookup", reply, _lookup_answer)
            if [entry[0] for entry in found] != wanted[: len(found)]:
                raise TransferError(f"{from_peer} answered a lookup with keys it was not asked for")
            parent: BlockKey | None = None
            for key, remote_offset, length, checksum in found:
                try:
                    view = self.cache.reserve(key, length, parent=parent)
                except CapacityError:
                    break  # no room left here: fetch what fits
                parent = key
                if view is None:
                    continue  # we hold it already
                location = self.cache.location(key)
                assert location is not None
                reserved.append((key, remote_offset, length, checksum, location.page * self.page_bytes))
            for part in range(parts):
                requests = []
                for _key, remote_offset, length, _checksum, local_offset in reserved:
                    start, end = part_range(length, parts, part)
                    if end > start:
                        requests.append(
                            TransferRequest(
                                op=TransferOp.READ,
                                local_region=self.region.region_id,
                                local_offset=local_offset + start,
                                peer=from_peer,
                                remote_region=remote_region,
                                remote_offset=remote_offset + start,
                                length=end - start,
                            )
                        )
                batches.append(self.engine.submit(requests))
        except BaseException:
            self._settle(batches)
            for entry in reserved:
                self.cache.abort(entry[0])
            self._release_remote(from_peer, lease)
            raise
        return Fetch(self, from_peer, lease, tuple((b[0], b[3]) for b in reserved), tuple(batches))

    def _parts(self, parts: object) -> int:
        """`parts`, a transfer's byte ranges of a block: at most a page's bytes, past which every further range is
        empty (a block fills at most one page) and a count of 10**30 spun through them for ever."""
        return require_int("parts", parts, minimum=1, below=self.page_bytes + 1)

    def push(self, keys: Sequence[BlockKey], to_peer: str, *, parts: int = 1) -> Push:
        """Start streaming local blocks (cached, or reserved and being filled) into `to_peer`'s cache.

        Raises:
            UnknownBlockError: a key is neither cached in the first tier nor reserved here.
            ConfigError: `parts` is not an integer in [1, page_bytes].
        """
        parts = self._parts(parts)
        self.sweep()
        local: list[tuple[BlockKey, int, int, bool]] = []  # key, local offset, length, pinned here
        try:
            for key in keys:
                location = self.cache.location(key)
                pinned = location is not None and location.ready
                if pinned:
                    self.cache.pin(key)  # pin first, then read where it is: it cannot move any more
                    location = self.cache.location(key)
                if location is None or location.tier != self.cache.pools[0].tier:
                    if pinned:
                        self.cache.unpin(key)
                    raise UnknownBlockError(f"block {key} is not in this node's first tier")
                local.append((key, location.page * self.page_bytes, location.length, pinned))
            lease = secrets.token_hex(8)
            wanted = [
                [int(key), length, int(local[i - 1][0]) if i else None] for i, (key, _o, length, _p) in enumerate(local)
            ]
            reply: Any = self.engine.call(
                to_peer, "blocks.reserve", {"lease": lease, "blocks": wanted, "owner": self.engine.address}
            )
            try:
                remote_region, places = _read_reply(to_peer, "blocks.reserve", reply, _reserve_answer)
                if [entry[0] for entry in places] != [int(key) for key, *_ in local]:
                    raise TransferError(f"{to_peer} answered a reservation for other keys")
            except TransferError:
                # Nothing was written into what the peer may have reserved: let it go now, not at quarantine.
                self._release_remote(to_peer, lease)
                raise
        except BaseException:
            for key, _offset, _length, pinned in local:
                if pinned:
                    self.cache.unpin(key)
            raise
        targets = tuple(
            (entry, offset) for entry, (_key, offset) in zip(local, places, strict=True) if offset is not None
        )
        return Push(self, to_peer, lease, remote_region, targets, parts, tuple(e for e in local if e[3]))

    def sweep(self) -> None:
        """Release what peers that went quiet still hold (expired leases)."""
        now = self._clock()
        with self._lock:
            expired = [lease_id for lease_id, lease in self._leases.items() if lease.deadline < now]
            leases = [self._leases.pop(lease_id) for lease_id in expired]
            pins = []
            for lease_id, lease in zip(expired, leases, strict=True):
                # Taken off the lease here, under the lock: a quarantined lease can be ended at once by another
                # thread (a commit, a release, release_owner), which must not unpin them a second time.
                pins.extend(lease.pinned)
                lease.pinned = []
                if lease.reserved:  # its pusher may only be paused: the pages wait for it (module docstring)
                    self._quarantine[lease_id] = lease
        self._unpin(pins)

    # ------------------------------------------------------------------ serving peers

    def _serve_lookup(self, args: Any) -> Json:
        self.sweep()
        lease_id = str(args["lease"])
        lease = self._lease(lease_id, _owner(args))
        first_tier = self.cache.pools[0].tier
        blocks: list[Json] = []
        for raw in args["keys"]:
            key = BlockKey(int(raw))
            if self.cache.tier_of(key) not in (None, first_tier):
                self.cache.touch(key)  # a read from a lower tier promotes it (by the cache's policy)
            try:
                self.cache.pin(key)  # pin first: a pinned block cannot move while we read where it is
            except UnknownBlockError:
                break  # chained keys: the blocks after a missing one are useless to the caller
            location = self.cache.location(key)
            if location is None or location.tier != first_tier:
                self.cache.unpin(key)
                break
            lease.pinned.append(key)
            blocks.append([key, location.page * self.page_bytes, location.length, self.cache.checksum(key)])
        if not lease.pinned:
            self._drop_if_empty(lease_id)
        return {"region": self.region.region_id, "blocks": blocks}

    def _serve_release(self, args: Any) -> Json:
        lease_id = str(args["lease"])
        with self._lock:
            lease = self._leases.pop(lease_id, None) or self._quarantine.pop(lease_id, None)
        if lease is not None:
            self._end(lease)
        return None

    def _serve_reserve(self, args: Any) -> Json:
        self.sweep()
        lease = self._lease(str(args["lease"]), _owner(args))
        places: list[Json] = []
        for raw_key, length, parent in args["blocks"]:
            key = BlockKey(int(raw_key))
            try:
                view = self.cache.reserve(key, int(length), parent=None if parent is None else BlockKey(int(parent)))
            except CapacityError:  # no room: the receiver finds it missing, as it would an evicted block
                places.append([key, None])
                continue
            if view is None:
                # Cached already: held until the commit (then used last), so that the pushes that fill the
                # cache meanwhile cannot evict a block the receiver counts on finding when this one ends.
                self._hold(lease, key)
                places.append([key, None])
                continue
            lease.reserved.append(key)
            location = self.cache.location(key)
            assert location is not None
            places.append([key, location.page * self.page_bytes])
        return {"region": self.region.region_id, "blocks": places}

    def _serve_commit(self, args: Any) -> Json:
        lease_id = str(args["lease"])
        # Read whole before the lease leaves its table: a malformed commit is refused with the lease kept (it
        # can be retried, and it still expires), never raised out of a lease that nothing could end any more.
        checksums = _commit_checksums(args)
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            expired = self._quarantine.pop(lease_id, None) if lease is None else None
        if expired is not None:  # its pusher is back and done writing: the pages it held are free again
            self._end(expired)
            raise TransferError("expired lease: its reservations were held for it until now, and are released")
        if lease is None:
            raise TransferError("unknown or expired lease")
        settled: list[BlockKey] = []
        try:
            committed, failed = _commit_reserved(self.cache, lease.reserved, checksums, settled)
            for key in lease.pinned:
                self.cache.touch(key)  # the receiver is about to read it: last to be evicted
        finally:
            # No table holds the lease now, so whatever went wrong this ends it, aborting the reservations not
            # settled (`_commit_reserved`: a settled key is no longer this lease's).
            del lease.reserved[: len(settled)]
            self._end(lease)
        return {"committed": list[Json](committed), "failed": list[Json](failed)}

    def _hold(self, lease: _Lease, key: BlockKey) -> None:
        """Pin a block that is cached here for `lease` (not one still being filled: its filler's lease
        ends with it)."""
        try:
            self.cache.pin(key)
        except UnknownBlockError:
            return  # being filled by another push
        lease.pinned.append(key)

    def _lease(self, lease_id: str, owner: str) -> _Lease:
        """The lease `lease_id` of `owner`, opened if new, its deadline pushed back.

        Raises:
            TransferError: the id is longer than 64 characters, or names an expired lease.
            CapacityError: it is new and `max_leases` are open already (quarantined ones count).
        """
        if len(lease_id) > _MAX_LEASE_ID:
            raise TransferError(f"a lease id has at most {_MAX_LEASE_ID} characters, got {len(lease_id)}")
        with self._lock:
            if lease_id in self._quarantine:
                raise TransferError("expired lease: commit or release it")
            lease = self._leases.get(lease_id)
            if lease is None:
                held = len(self._leases) + len(self._quarantine)
                if held >= self._max_leases:
                    raise CapacityError(
                        f"{held} leases are open for peers, the most this node holds"
                        f" (max_leases={self._max_leases}); they end on release, commit or after {self._lease_s}s"
                    )
                lease = self._leases[lease_id] = _Lease(owner=owner)
            lease.deadline = self._clock() + self._lease_s
            return lease

    def _drop_if_empty(self, lease_id: str) -> None:
        """Forget a lease that holds nothing (a lookup that found no block): it would only take a slot."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is not None and not lease.pinned and not lease.reserved:
                del self._leases[lease_id]

    def _end(self, lease: _Lease) -> None:
        """Release what a lease no table holds any more (so no other thread can end it too)."""
        self._unpin(lease.pinned)
        for key in lease.reserved:
            self.cache.abort(key)
        lease.pinned.clear()
        lease.reserved.clear()

    def _unpin(self, keys: Sequence[BlockKey]) -> None:
        for key in keys:
            try:
                self.cache.unpin(key)
            except UnknownBlockError:
                pass

    def _sweeper(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.sweep()
            except MooncakeError:
                pass  # the next sweep tries again

    def _settle(self, batches: Sequence[int]) -> bool:
        """Wait until no slice of `batches` can still write; False if some may (pages must then stay)."""
        bound = self.engine.config.slice_deadline_s + 1.0
        settled = True
        for batch in batches:
            try:
                self.engine.wait(batch, timeout=bound)
            except TransferTimeout:
                settled = False
                self.engine.forget_when_ended(batch)  # its record goes when its last slice ends
                continue
            except TransferError:
                pass  # unknown batch: nothing in flight
            self.engine.forget(batch)
        return settled

    def _release_remote(self, peer: str, lease: str) -> None:
        try:
            self.engine.call(peer, "blocks.release", {"lease": lease})
        except TransferError:
            pass  # the peer's lease expires on its own


def _read_reply(peer: str, method: str, reply: Any, read: Callable[[Any], _T]) -> _T:
    """`read(reply)`: a peer's answer to `method`, by the block protocol.

    Raises:
        ProtocolError: the reply is malformed (not the shape `read` takes, a field missing, of another type or
            negative); the message names the peer, the method and the reply (cut short).
    """
    try:
        return read(reply)
    except (KeyError, TypeError, ValueError, IndexError) as error:
        raise ProtocolError(
            f"{peer} answered {method} with a malformed reply ({error!r}): {shown(reply, limit=_MAX_SHOWN)}"
        ) from error


def _count(value: Any) -> int:
    """An integer >= 0 as a peer sent it, never coerced (1.5, "1" and true are not block keys or offsets)."""
    if type(value) is not int or value < 0:
        raise ValueError(f"{shown(value)} is not an integer >= 0")
    return value


def _entries(value: Any, width: int) -> list[list[Any]]:
    """A list of lists of `width` fields each."""
    if type(value) is not list or any(type(entry) is not list or len(entry) != width for entry in value):
        raise ValueError(f"not a list of {width}-field entries")
    return value


def _lookup_answer(reply: Any) -> tuple[int, list[tuple[BlockKey, int, int, int]]]:
    """The answer to "blocks.lookup": the peer's region, and per block found its key, offset, length, checksum."""
    found = [
        (BlockKey(_count(key)), _count(offset), _count(length), _count(checksum))
        for key, offset, length, checksum in _entries(reply["blocks"], 4)
    ]
    return _count(reply["region"]), found


def _reserve_answer(reply: Any) -> tuple[int, list[tuple[int, int | None]]]:
    """The answer to "blocks.reserve": the peer's region, and per block its key and the offset reserved for it
    (None: none)."""
    places = [(_count(key), None if offset is None else _count(offset)) for key, offset in _entries(reply["blocks"], 2)]
    return _count(reply["region"]), places


def _commit_answer(reply: Any) -> tuple[BlockKey, ...]:
    """The answer to "blocks.commit": the keys the peer committed."""
    committed = reply["committed"]
    if type(committed) is not list:
        raise ValueError("committed is not a list")
    return tuple(BlockKey(_count(key)) for key in committed)


def _commit_checksums(args: Any) -> dict[BlockKey, int]:
    """The checksum a "blocks.commit" sends per block: its "checksums", a list of [block key, XXH3-64 value].

    Raises:
        ProtocolError: they are missing or not of that shape (a key no integer >= 0, a checksum outside
            [0, 2**64)); the message names them and what was sent (cut short).
    """
    raw = args.get("checksums") if isinstance(args, dict) else None
    try:
        return {BlockKey(_count(key)): check_checksum(value) for key, value in _entries(raw, 2)}
    except ValueError as error:  # InvalidRequestError (a checksum out of range) is one
        raise ProtocolError(
            f"checksums must be a list of [block key, XXH3-64 value] entries ({error}), got {shown(raw, limit=_MAX_SHOWN)}"
        ) from error


def _commit_reserved(
    cache: TieredCache, keys: Sequence[BlockKey], checksums: dict[BlockKey, int], settled: list[BlockKey]
) -> tuple[list[BlockKey], list[BlockKey]]:
    """Settle `keys`, reservations of one lease (or fetch), in order: commit each against its checksum, abort
    one that has none. Each key goes into `settled` once it is, so a caller that this interrupts knows which are
    left: those, and only those, are still its own to abort. A settled key is not: a commit that failed its
    checksum dropped the reservation itself (`TieredCache.commit`), so the key may at once be reserved again, by
    another lease, and `TieredCache.abort`, which does not know whose reservation it drops, would free that one.

    Returns:
        The keys committed, and those whose commit failed (their bytes did not match, or they were no longer
        reserved).
    """
    committed: list[BlockKey] = []
    failed: list[BlockKey] = []
    for key in keys:
        if key not in checksums:
            cache.abort(key)
        else:
            try:
                cache.commit(key, checksum=checksums[key])
                committed.append(key)
            except (IntegrityError, UnknownBlockError):
                failed.append(key)
        settled.append(key)
    return committed, failed


def _owner(args: Any) -> str:
    """The engine address a peer's call names as the lease's owner ("" if none)."""
    owner = args.get("owner", "") if isinstance(args, dict) else ""
    if not isinstance(owner, str) or len(owner) > _MAX_OWNER:
        raise TransferError(f"a lease's owner is an engine address of at most {_MAX_OWNER} characters")
    return owner


class Fetch:
    """Blocks on their way in; commit them with `finish` (or leave them with `abort`)."""

    def __init__(
        self,
        messenger: Messenger,
        peer: str,
        lease: str,
        blocks: tuple[tuple[BlockKey, int], ...],
        batches: tuple[int, ...],
    ) -> None:
        self._messenger, self._peer, self._lease = messenger, peer, lease
        self.keys = tuple(key for key, _ in blocks)
        self._checksums = dict(blocks)
        self._batches = batches
        self._failed: set[int] = set()
        self._done: tuple[BlockKey, ...] | None = None

    @property
    def parts(self) -> int:
        return len(self._batches)

    def wait_part(self, part: int, timeout: float) -> None:
        """Return once byte range `part` of every block has arrived.

        Raises:
            TransferTimeout: it did not arrive within `timeout` seconds (`finish` then commits nothing); the message
                names the peer.
            TransferError: a piece of it failed.
        """
        try:
            statuses = self._messenger.engine.wait(self._batches[part], timeout=timeout)
        except TransferTimeout as error:
            self._failed.add(part)
            raise TransferTimeout(
                f"part {part} of the fetch from {self._peer} did not arrive within {timeout}s: {error}"
            ) from error
        failures = [s.error for s in statuses if s.state == RequestState.FAILED]
        if failures:
            self._failed.add(part)
            raise TransferError(f"part {part} of the fetch from {self._peer} failed: {failures[0]}")

    def finish(self, timeout: float) -> tuple[BlockKey, ...]:
        """Wait for every part, commit the blocks that verify, release the peer's pins (once).

        `timeout` bounds the wait for each part not yet waited out, one after another, not the call: a fetch that
        does not complete can take, in all, up to `parts` · `timeout` (the parts), then `parts` ·
        (`slice_deadline_s` + 1 s) for its slices still moving to end (its pages are not given back while a late
        slice may write into them: one that outlasts that keeps them reserved), then the "blocks.release" call
        (bounded as `TransferEngine.call`: its wait behind other calls to the peer and its reply, `io_timeout_s`
        each, plus `connect_timeout_s` per dial). A fetch whose parts all arrived takes the parts' wait and that
        call only.

        Returns:
            The keys now cached here (a block whose bytes fail the peer's checksum is dropped).
        """
        if self._done is not None:
            return self._done
        messenger, cache = self._messenger, self._messenger.cache
        done: list[BlockKey] = []
        settled: list[BlockKey] = []
        try:
            for part in range(self.parts):
                if part not in self._failed:
                    try:
                        self.wait_part(part, timeout)
                    except TransferError:
                        pass
            if not self._failed:
                done, _failed = _commit_reserved(cache, self.keys, self._checksums, settled)
        finally:
            # Only the reservations still this fetch's own (`_commit_reserved`: a settled key may be another's now).
            leftover = self.keys[len(settled) :]
            if leftover and messenger._settle(self._batches):
                for key in leftover:
                    cache.abort(key)
            elif not leftover:
                for batch in self._batches:
                    messenger.engine.forget(batch)
            messenger._release_remote(self._peer, self._lease)
            self._done = tuple(done)
        return self._done


class Push:
    """Blocks on their way out; `send_part` ships a byte range, `finish` commits them at the peer, `abort` gives up.

    `keys` are the blocks it sends: those the peer reserved (not one it held already, nor one it had no room
    for). `finish` returns those the peer committed, so a caller that needs them all compares the two.
    """

    def __init__(
        self,
        messenger: Messenger,
        peer: str,
        lease: str,
        remote_region: int,
        targets: tuple[tuple[tuple[BlockKey, int, int, bool], int], ...],
        parts: int,
        pinned: tuple[tuple[BlockKey, int, int, bool], ...],
    ) -> None:
        self._messenger, self._peer, self._lease, self._remote_region = messenger, peer, lease, remote_region
        self._targets, self._parts, self._pinned = targets, parts, pinned
        self._batches: dict[int, int] = {}
        self._done: tuple[BlockKey, ...] | None = None
        self.keys = tuple(entry[0] for entry, _ in targets)

    def send_part(self, part: int) -> None:
        """Ship byte range `part` of every block (once its bytes are final locally).

        Raises:
            TransferError: the engine refused the part whole before a byte moved (a range past the region the
                peer described): the push is aborted (`abort`).
        """
        if part in self._batches or self._done is not None:
            return
        messenger = self._messenger
        requests = []
        for (_key, local_offset, length, _pinned), remote_offset in self._targets:
            start, end = part_range(length, self._parts, part)
            if end > start:
                requests.append(
                    TransferRequest(
                        op=TransferOp.WRITE,
                        local_region=messenger.region.region_id,
                        local_offset=local_offset + start,
                        peer=self._peer,
                        remote_region=self._remote_region,
                        remote_offset=remote_offset + start,
                        length=end - start,
                    )
                )
        try:
            self._batches[part] = messenger.engine.submit(requests)
        except TransferError:
            # Refused whole before a byte moved (a range past the region the peer described): the push cannot
            # complete, so the peer's reservation is released now rather than left to expire into quarantine.
            self.abort()
            raise

    def finish(self, timeout: float) -> tuple[BlockKey, ...]:
        """Ship what is left, then have the peer verify and commit; returns the keys it committed (once).

        Raises:
            TransferTimeout: a slice did not settle (nothing is committed: the peer keeps the pages it reserved, as a
                late slice may still land).
            TransferError: the peer refused the commit (its lease expired: the pages are then free again), or the
                engine refused a part whole before a byte moved (`send_part`: the push is aborted).
        """
        if self._done is not None:
            return self._done
        messenger = self._messenger
        committed: tuple[BlockKey, ...] = ()
        try:
            for part in range(self._parts):
                self.send_part(part)
            ok = True
            for batch in self._batches.values():
                try:
                    statuses = messenger.engine.wait(batch, timeout=timeout)
                    ok = ok and all(s.state == RequestState.DONE for s in statuses)
                except TransferTimeout:
                    ok = False
            # The commit frees the pages of what it does not commit: it goes out only once no slice can still
            # write into them (a wait that timed out leaves slices running). Unsettled, nothing is sent: the lease
            # expires at the peer and its pages stay reserved for this process until it is gone.
            if not messenger._settle(list(self._batches.values())):
                raise TransferTimeout(f"a push to {self._peer} did not settle: its reservations stay at the peer")
            checksums = []
            if ok:
                buffer = messenger.cache.pools[0].buffer  # type: ignore[attr-defined]
                for (key, local_offset, length, _pinned), _remote in self._targets:
                    location = messenger.cache.location(key)
                    if location is None or location.page * messenger.page_bytes != local_offset:
                        continue  # the block left its page meanwhile: its bytes there are not its own
                    checksums.append(
                        [int(key), xxhash.xxh3_64_intdigest(buffer[local_offset : local_offset + length].data)]
                    )
            reply: Any = messenger.engine.call(
                self._peer, "blocks.commit", {"lease": self._lease, "checksums": checksums}
            )
            committed = _read_reply(self._peer, "blocks.commit", reply, _commit_answer)
        finally:
            if self._done is None:  # else a refused part aborted the push: its pins are already dropped
                messenger._settle(list(self._batches.values()))
                for key, _offset, _length, _pinned in self._pinned:
                    try:
                        messenger.cache.unpin(key)
                    except (UnknownBlockError, BlockPinnedError):
                        pass
                self._done = committed
        return committed

    def abort(self) -> None:
        """Give up: nothing is committed at the peer (its reservations are released once no slice can still land
        in them; while one may, they stay), local pins are dropped."""
        if self._done is not None:
            return
        messenger = self._messenger
        try:
            if messenger._settle(list(self._batches.values())):  # else a slice may still write: keep the pages
                messenger._release_remote(self._peer, self._lease)
        finally:
            for key, _offset, _length, _pinned in self._pinned:
                try:
                    messenger.cache.unpin(key)
                except (UnknownBlockError, BlockPinnedError):
                    pass
            self._done = ()
