"""The Messenger: a node's block service over its transfer engine and tiered cache.

Blocks move between nodes' first-tier (DRAM) pages directly: the page pool's
buffer is one registered region, and a block at page p sits at offset
``p * page_bytes`` in it.

- `fetch(keys, peer)` copies the leading blocks of `keys` that `peer` holds into
  the local cache (this is how hot blocks replicate): the peer pins them and
  returns their offsets and checksums ("blocks.lookup"), the messenger reserves
  local pages, READs straight into them, then commits each page after checking
  it against the peer's checksum; the peer's pins are released at the end.
- `push(keys, peer)` streams local blocks into a peer's cache (prefill → decode):
  the peer reserves pages ("blocks.reserve"), the messenger WRITEs into them,
  and the peer commits each against the checksum sent with "blocks.commit".

Both move a block in `parts` equal byte ranges (a layer each, for a KV block
laid out layer by layer) so an engine can overlap transfer with compute:
`Fetch.wait_part(p)` returns as soon as range p of every block has arrived, and
`Push.send_part(p)` ships range p as soon as it is written. Pins and
reservations taken for a peer are leased: if the peer vanishes, they are
released when the lease expires.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import xxhash

from mooncake._checks import ceil_div, require_int
from mooncake.cache.pool import DramPagePool
from mooncake.cache.tiered import TieredCache
from mooncake.errors import CapacityError, ConfigError, IntegrityError, TransferError, UnknownBlockError
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.region import RegionDescriptor
from mooncake.transfer.request import RequestState, TransferOp, TransferRequest
from mooncake.types import BlockKey

__all__ = ["Fetch", "Messenger", "Push", "part_range", "shared_dram_pool"]


def shared_dram_pool(engine: TransferEngine, page_bytes: int, num_pages: int) -> tuple[DramPagePool, RegionDescriptor]:
    """A DRAM page pool in the engine's shared memory, registered: same-host peers copy into it directly."""
    region, buffer = engine.allocate_shared(page_bytes * num_pages)
    return DramPagePool(page_bytes, num_pages, buffer=buffer), region


def part_range(length: int, parts: int, part: int) -> tuple[int, int]:
    """Byte range [start, end) of `part` when `length` bytes are cut into `parts` equal pieces."""
    step = ceil_div(length, parts) if length else 0
    start = min(length, part * step)
    return start, min(length, start + step)


@attrs.define(eq=False)
class _Lease:
    pinned: list[BlockKey] = attrs.field(factory=list)
    reserved: list[BlockKey] = attrs.field(factory=list)
    deadline: float = 0.0


class Messenger:
    """Serves and moves KV blocks of one node.

    Args:
        engine: the node's transfer engine.
        cache: the node's tiered cache; its first tier must be a `DramPagePool`.
        region: the engine's descriptor of that pool's buffer, if already registered
            (see `shared_dram_pool`); otherwise the buffer is registered here.
        lease_s: how long pins and reservations held for a peer survive without it.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self,
        engine: TransferEngine,
        cache: TieredCache,
        *,
        region: RegionDescriptor | None = None,
        lease_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        pool = cache.pools[0]
        if not isinstance(pool, DramPagePool):
            raise ConfigError("the messenger moves first-tier pages: the cache's first tier must be a DramPagePool")
        self.engine, self.cache = engine, cache
        self.page_bytes = pool.page_bytes
        self.region = region if region is not None else engine.register_memory(pool.buffer)
        self._lease_s, self._clock = lease_s, clock
        self._leases: dict[str, _Lease] = {}
        self._lock = threading.Lock()
        engine.register_handler("blocks.lookup", self._serve_lookup)
        engine.register_handler("blocks.release", self._serve_release)
        engine.register_handler("blocks.reserve", self._serve_reserve)
        engine.register_handler("blocks.commit", self._serve_commit)

    # ------------------------------------------------------------------ moving blocks

    def fetch(self, keys: Sequence[BlockKey], from_peer: str, *, parts: int = 1) -> Fetch:
        """Start copying the leading `keys` that `from_peer` holds (and we do not) into the local cache."""
        parts = require_int("parts", parts, minimum=1)
        lease = secrets.token_hex(8)
        found = self.engine.call(from_peer, "blocks.lookup", {"lease": lease, "keys": [int(k) for k in keys]})["blocks"]
        blocks: list[tuple[BlockKey, int, int, int, int]] = []  # key, remote offset, length, checksum, local offset
        parent: BlockKey | None = None
        try:
            for key, remote_offset, length, checksum in found:
                key = BlockKey(key)
                try:
                    view = self.cache.reserve(key, length, parent=parent)
                except CapacityError:
                    break  # no room left here: fetch what fits
                parent = key
                if view is None:
                    continue  # we hold it already
                location = self.cache.location(key)
                assert location is not None
                blocks.append((key, remote_offset, length, checksum, location.page * self.page_bytes))
        except BaseException:
            self._abort_local([b[0] for b in blocks])
            self._release_remote(from_peer, lease)
            raise
        batches = []
        for part in range(parts):
            requests = []
            for _key, remote_offset, length, _checksum, local_offset in blocks:
                start, end = part_range(length, parts, part)
                if end > start:
                    requests.append(
                        TransferRequest(
                            op=TransferOp.READ,
                            local_region=self.region.region_id,
                            local_offset=local_offset + start,
                            peer=from_peer,
                            remote_region=_remote_region(self.engine, from_peer),
                            remote_offset=remote_offset + start,
                            length=end - start,
                        )
                    )
            batches.append(self.engine.submit(requests))
        return Fetch(self, from_peer, lease, tuple((b[0], b[3]) for b in blocks), tuple(batches))

    def push(self, keys: Sequence[BlockKey], to_peer: str, *, parts: int = 1) -> Push:
        """Start streaming local blocks (cached, or reserved and being filled) into `to_peer`'s cache.

        Raises:
            UnknownBlockError: a key is neither cached in the first tier nor reserved here.
        """
        parts = require_int("parts", parts, minimum=1)
        local: list[tuple[BlockKey, int, int, bool]] = []  # key, local offset, length, pinned here
        try:
            for key in keys:
                location = self.cache.location(key)
                if location is not None and location.ready:
                    self.cache.pin(key)
                    location = self.cache.location(key)
                if location is None or location.tier != self.cache.pools[0].tier:
                    raise UnknownBlockError(f"block {key} is not in this node's first tier")
                local.append((key, location.page * self.page_bytes, location.length, location.ready))
        except BaseException:
            for key, _offset, _length, pinned in local:
                if pinned:
                    self.cache.unpin(key)
            raise
        lease = secrets.token_hex(8)
        wanted = [
            [int(key), length, int(local[i - 1][0]) if i else None] for i, (key, _o, length, _p) in enumerate(local)
        ]
        places = self.engine.call(to_peer, "blocks.reserve", {"lease": lease, "blocks": wanted})["blocks"]
        targets = [(entry, offset) for entry, (_key, offset) in zip(local, places, strict=True) if offset is not None]
        return Push(self, to_peer, lease, tuple(targets), parts, tuple(e for e in local if e[3]))

    # ------------------------------------------------------------------ serving peers

    def _serve_lookup(self, args: Any) -> Any:
        self._sweep()
        lease = self._lease(str(args["lease"]))
        first_tier = self.cache.pools[0].tier
        blocks = []
        for raw in args["keys"]:
            key = BlockKey(int(raw))
            location = self.cache.location(key)
            if location is not None and location.ready and location.tier != first_tier:
                self.cache.get(key)  # a read from a lower tier promotes it (by the cache's policy)
                location = self.cache.location(key)
            if location is None or not location.ready or location.tier != first_tier:
                break  # chained keys: the blocks after a missing one are useless to the caller
            self.cache.pin(key)
            lease.pinned.append(key)
            blocks.append([key, location.page * self.page_bytes, location.length, self.cache.checksum(key)])
        return {"blocks": blocks}

    def _serve_release(self, args: Any) -> Any:
        with self._lock:
            lease = self._leases.pop(str(args["lease"]), None)
        if lease is not None:
            self._end(lease)
        return None

    def _serve_reserve(self, args: Any) -> Any:
        self._sweep()
        lease = self._lease(str(args["lease"]))
        places: list[list[Any]] = []
        for raw_key, length, parent in args["blocks"]:
            key = BlockKey(int(raw_key))
            try:
                view = self.cache.reserve(key, int(length), parent=None if parent is None else BlockKey(int(parent)))
            except CapacityError:
                view = None
            if view is None:
                places.append([key, None])  # cached already, or no room
                continue
            lease.reserved.append(key)
            location = self.cache.location(key)
            assert location is not None
            places.append([key, location.page * self.page_bytes])
        return {"blocks": places}

    def _serve_commit(self, args: Any) -> Any:
        with self._lock:
            lease = self._leases.pop(str(args["lease"]), None)
        if lease is None:
            raise TransferError("unknown or expired lease")
        checksums = {BlockKey(int(k)): int(v) for k, v in args["checksums"]}
        committed, failed = [], []
        for key in lease.reserved:
            if key not in checksums:
                self.cache.abort(key)
                continue
            try:
                self.cache.commit(key, checksum=checksums[key])
                committed.append(key)
            except (IntegrityError, UnknownBlockError):
                failed.append(key)
        lease.reserved.clear()
        self._end(lease)
        return {"committed": committed, "failed": failed}

    def _lease(self, lease_id: str) -> _Lease:
        with self._lock:
            lease = self._leases.setdefault(lease_id, _Lease())
            lease.deadline = self._clock() + self._lease_s
            return lease

    def _sweep(self) -> None:
        """Release what peers that went quiet still hold."""
        now = self._clock()
        with self._lock:
            expired = [lease_id for lease_id, lease in self._leases.items() if lease.deadline < now]
            leases = [self._leases.pop(lease_id) for lease_id in expired]
        for lease in leases:
            self._end(lease)

    def _end(self, lease: _Lease) -> None:
        for key in lease.pinned:
            try:
                self.cache.unpin(key)
            except UnknownBlockError:
                pass
        for key in lease.reserved:
            self.cache.abort(key)
        lease.pinned.clear()
        lease.reserved.clear()

    def _abort_local(self, keys: Sequence[BlockKey]) -> None:
        for key in keys:
            self.cache.abort(key)

    def _release_remote(self, peer: str, lease: str) -> None:
        try:
            self.engine.call(peer, "blocks.release", {"lease": lease})
        except TransferError:
            pass  # the peer's lease expires on its own


def _remote_region(engine: TransferEngine, peer: str) -> int:
    """The region the peer's messenger serves blocks from: its first registered region."""
    regions = engine.peer_regions(peer)
    if not regions:
        raise TransferError(f"{peer} has no registered memory")
    return regions[0].region_id


class Fetch:
    """Blocks on their way in; commit them with `finish`."""

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

    @property
    def parts(self) -> int:
        return len(self._batches)

    def wait_part(self, part: int, timeout: float) -> None:
        """Return once byte range `part` of every block has arrived.

        Raises:
            TransferError: a piece of it failed (`finish` then commits nothing).
        """
        statuses = self._messenger.engine.wait(self._batches[part], timeout=timeout)
        failures = [s.error for s in statuses if s.state == RequestState.FAILED]
        if failures:
            self._failed.add(part)
            raise TransferError(f"part {part} of the fetch from {self._peer} failed: {failures[0]}")

    def finish(self, timeout: float) -> tuple[BlockKey, ...]:
        """Wait for every part, commit the blocks that verify, release the peer's pins.

        Returns:
            The keys now cached here (a block whose bytes fail the peer's checksum is dropped).
        """
        cache = self._messenger.cache
        try:
            for part in range(self.parts):
                if part not in self._failed:
                    try:
                        self.wait_part(part, timeout)
                    except TransferError:
                        pass
            if self._failed:
                for key in self.keys:
                    cache.abort(key)
                return ()
            done = []
            for key in self.keys:
                try:
                    cache.commit(key, checksum=self._checksums[key])
                    done.append(key)
                except IntegrityError:
                    pass
            return tuple(done)
        finally:
            self._messenger._release_remote(self._peer, self._lease)
            for batch in self._batches:
                self._messenger.engine.forget(batch)


class Push:
    """Blocks on their way out; `send_part` ships a byte range, `finish` commits them at the peer."""

    def __init__(
        self,
        messenger: Messenger,
        peer: str,
        lease: str,
        targets: tuple[tuple[tuple[BlockKey, int, int, bool], int], ...],
        parts: int,
        pinned: tuple[tuple[BlockKey, int, int, bool], ...],
    ) -> None:
        self._messenger, self._peer, self._lease = messenger, peer, lease
        self._targets, self._parts, self._pinned = targets, parts, pinned
        self._batches: dict[int, int] = {}
        self.keys = tuple(entry[0] for entry, _ in targets)

    def send_part(self, part: int) -> None:
        """Ship byte range `part` of every block (once its bytes are final locally)."""
        if part in self._batches:
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
                        remote_region=_remote_region(messenger.engine, self._peer),
                        remote_offset=remote_offset + start,
                        length=end - start,
                    )
                )
        self._batches[part] = messenger.engine.submit(requests)

    def finish(self, timeout: float) -> tuple[BlockKey, ...]:
        """Ship what is left, then have the peer verify and commit; returns the keys it committed."""
        messenger = self._messenger
        try:
            for part in range(self._parts):
                self.send_part(part)
            ok = True
            for batch in self._batches.values():
                statuses = messenger.engine.wait(batch, timeout=timeout)
                ok = ok and all(s.state == RequestState.DONE for s in statuses)
                messenger.engine.forget(batch)
            checksums = []
            if ok:
                buffer = messenger.cache.pools[0].buffer  # type: ignore[attr-defined]
                for (key, local_offset, length, _pinned), _remote in self._targets:
                    checksums.append(
                        [int(key), xxhash.xxh3_64_intdigest(buffer[local_offset : local_offset + length].data)]
                    )
            reply = messenger.engine.call(self._peer, "blocks.commit", {"lease": self._lease, "checksums": checksums})
            return tuple(BlockKey(k) for k in reply["committed"])
        finally:
            for key, _offset, _length, _pinned in self._pinned:
                messenger.cache.unpin(key)
