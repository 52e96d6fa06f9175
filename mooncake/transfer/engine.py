"""The transfer engine: registered memory and batches of reads and writes to peers.

Usage (both sides run an engine with the same secret):

    engine = TransferEngine(secret=b"...")
    local, buffer = engine.allocate_shared(1 << 30)      # or register_memory(any buffer)
    peer = engine.connect("10.0.0.2:7000")               # handshake: auth + segment descriptors
    remote = engine.peer_regions(peer)[0]
    batch = engine.submit([TransferRequest(op=TransferOp.WRITE, local_region=local.region_id,
        local_offset=0, peer=peer, remote_region=remote.region_id, remote_offset=0, length=1 << 20)])
    statuses = engine.wait(batch, timeout=5.0)            # or engine.transfer_sync([...], timeout=5.0)
    engine.forget(batch)                                  # its record is kept until then
    engine.disconnect(peer)                               # when done with the peer (or engine.close())

The engine owns the registered regions (each also registered with the RDMA
device, when there is one) and the batches. Everything about peers (the
handshake, their segment descriptors and transports, control calls, the
accept loop that serves them) is `peers.Peers`, which the engine composes and
whose public calls it passes through (`disconnect` drops one peer: its
connections and threads). A request goes to the first of its
peer's transports that reaches the remote region (`Peers.transport_for`), cut
into slices of at most `slice_bytes` spread over the transport's streams; a
request is done when all its slices are, and fails with the first slice
error. The requests of a batch move concurrently: requests that overlap (a
write and a read of the same bytes) have no order.

Batches follow the upstream engine's explicit model: `submit` makes a record,
`status` and `wait` read it, and `forget` (upstream's freeBatchID) drops it,
once none of its requests is pending (one still moving is refused, so a thread
waiting on it is never left without the record it waits on). Until then the
record is kept: a caller that submits forgets too. `close` ends every pending
request (FAILED) and wakes every waiter.

Invariants:
- A request is reported DONE only after every byte of it was delivered (and
  acknowledged by the peer, or received and verified).
- Each request ends exactly once (DONE or FAILED); `wait` never blocks past its timeout.
- A batch record exists from `submit` until `forget`, which only a batch with
  no pending request may get (`transfer_sync`'s own batches are dropped when
  they end). After `close` no request is pending and no `wait` blocks.
- Every access is bounds-checked before a byte moves: the local range here,
  and the remote range against the peer's descriptor where it lists the region
  (it does once connected, or refreshed after the peer registered it), both
  before anything of its batch starts; then the remote range per slice, over
  TCP by the side that owns the memory, over shm and RDMA by the initiator
  against the peer's descriptor (validated when received), and for RDMA by the
  NIC again. So a request that crosses the end of a region the peer described
  is refused whole, and none of its slices lands.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterable
from multiprocessing import shared_memory
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from mooncake._checks import require_int, require_iterable, require_number, require_str, shown
from mooncake.errors import ConfigError, PeerUnavailable, TransferError, TransferTimeout
from mooncake.transfer.listener import Listener
from mooncake.transfer.peers import Handler, PeerDescriptor, Peers, host_id
from mooncake.transfer.rdma import Verbs, buffer_address, open_device
from mooncake.transfer.region import Region, RegionDescriptor, as_writable_bytes, bounds_error, create_shared
from mooncake.transfer.request import EngineConfig, RequestState, RequestStatus, Slice, TransferRequest, Transport
from mooncake.transfer.wire import Json

# PeerDescriptor and host_id live in `peers`; they stay importable from here.
__all__ = ["PeerDescriptor", "TransferEngine", "host_id"]


@attrs.define(eq=False)
class _Batch:
    requests: tuple[TransferRequest, ...]
    remaining: list[int]  # slices still moving, per request
    errors: list[TransferError | None]
    transports: list[str]
    open_requests: int
    dropped_when_ended: bool = False  # no caller holds its id: its record goes once its last request ends


# What an RDMA device (`rdma.Verbs`) offers; a Protocol, so checked by its methods.
_VERBS_METHODS = ("register", "deregister", "create_queue_pair", "close")


def _engine_arguments(config: object, name: object, rdma: object) -> EngineConfig:
    """`config` (the default one for None), once `config`, `name` and `rdma` are checked to be what the engine
    takes: a value of another type would only fail later, far from here (a peer refuses a descriptor whose
    name is no string; a falsy dict would pass for the default config).

    Raises:
        ConfigError: `config` is no EngineConfig, `name` no non-empty string, or `rdma` no RDMA device (each
            may be None); the message names the argument and what it got.
    """
    if config is not None and not isinstance(config, EngineConfig):
        raise ConfigError(f"config must be an EngineConfig or None, got {type(config).__name__}: {shown(config)}")
    if name is not None:
        require_str("name", name, what="string (how peers call this engine)")
    if rdma is not None and not all(callable(getattr(rdma, method, None)) for method in _VERBS_METHODS):
        raise ConfigError(
            f"rdma must be an RDMA device (with {', '.join(_VERBS_METHODS)}) or None,"
            f" got {type(rdma).__name__}: {shown(rdma)}"
        )
    return config if config is not None else EngineConfig()


class TransferEngine:
    """Registers memory, talks to peers, and moves batches of bytes.

    Args:
        secret: shared by every engine of a deployment; peers prove they know it.
        config: listening address and transfer behaviour.
        name: how peers call this engine (default its "host:port").
        rdma: the RDMA device to use; by default the first one pyverbs finds,
            when "rdma" is among the configured transports (none: no RDMA).

    Raises:
        ConfigError: `secret` is shorter than 16 bytes, or an argument is of another type (`_engine_arguments`).
        TransferError: it cannot listen on `config.host`, `config.port` (the port is taken, the host does not
            resolve or is not this machine's), named in the message; nothing is left open (an RDMA device it
            opened itself is closed again).
    """

    def __init__(
        self,
        *,
        secret: bytes,
        config: EngineConfig | None = None,
        name: str | None = None,
        rdma: Verbs | None = None,
    ) -> None:
        if not isinstance(secret, bytes) or len(secret) < 16:
            raise ConfigError("secret must be at least 16 bytes")
        config = _engine_arguments(config, name, rdma)
        self.secret = secret
        self.config = config
        self._regions: dict[int, Region] = {}
        self._region_ids = itertools.count(1)
        opened = rdma is None and "rdma" in config.transports
        if opened:
            rdma = open_device()
        self._rdma = rdma if "rdma" in config.transports else None
        # Per region id: (start address, end address, lkey). Keyed by region, never by address: two regions may
        # start at the same address (a buffer and a view of its head, or one buffer registered twice), each with a
        # memory region of its own, and unregistering one must leave the other's.
        self._rdma_keys: dict[int, tuple[int, int, int]] = {}
        self._batches: dict[int, _Batch] = {}
        self._batch_ids = itertools.count(1)
        self._lock = threading.RLock()
        self._finished = threading.Condition(self._lock)
        self._closed = False
        # Last: from here on peers may connect, and what they ask for must exist.
        try:
            self._peers = Peers(
                secret=secret,
                config=config,
                name=name,
                rdma=self._rdma,
                regions=self.regions,
                region=self.region,
                local_key=self._local_key,
            )
        except BaseException:
            if opened and rdma is not None:  # no engine holds the device it opened: nothing else would close it
                rdma.close()
            raise
        self.host, self.port, self.name = self._peers.host, self._peers.port, self._peers.name

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def listener(self) -> Listener:
        """Where peers connect: how many connections are authenticating and served, and their bounds."""
        return self._peers.listener

    def check_invariants(self) -> None:
        """The listener's and the staging pool's invariants (what tests check after an attack), and the batches':
        each counts as open exactly its requests with slices still moving, and one kept only until it ends is
        still open."""
        self._peers.listener.check_invariants()
        self._peers.staging.check_invariants()
        with self._lock:
            for batch_id, batch in self._batches.items():
                assert batch.open_requests == sum(1 for left in batch.remaining if left), batch_id
                assert batch.open_requests or not batch.dropped_when_ended, batch_id

    @property
    def num_accepted_queue_pairs(self) -> int:
        """RDMA queue pairs accepted from peers and still open (at most `max_connections`)."""
        return self._peers.num_queue_pairs

    # ------------------------------------------------------------------ memory

    def register_memory(self, buffer: Any) -> RegionDescriptor:
        """Make `buffer` (contiguous, writable) addressable by peers; returns its descriptor."""
        self._check_open()
        view = as_writable_bytes(buffer)
        return self._add_region(view, keepalive=buffer, shm_name=None)

    def allocate_shared(self, nbytes: int) -> tuple[RegionDescriptor, npt.NDArray[np.uint8]]:
        """A new registered region in shared memory (same-host peers copy into it directly).

        Returns:
            Its descriptor and a uint8 numpy array over it. The segment is
            unlinked when the engine closes.

        Raises:
            ConfigError: `nbytes` is not an integer in [0, 2**63) (a file's size, as a shared segment is one).
            TransferError: the system would not create a segment of `nbytes` (named in the message).
        """
        self._check_open()
        segment, array = create_shared(nbytes)  # checks nbytes first
        try:
            descriptor = self._add_region(array.data, keepalive=(segment, array), shm_name=segment.name)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                segment.unlink()
            raise
        return descriptor, array

    def unregister_memory(self, region_id: int) -> None:
        """Stop serving a region, over every transport (RDMA included: its own memory region is
        deregistered, not another region's at the same address); requests already in flight against it
        may still complete (a checksummed WRITE over TCP that is still being verified is refused). A region
        that is not registered (any more) is left alone.

        Raises:
            ConfigError: `region_id` is not an integer >= 0.
        """
        region_id = require_int("region_id", region_id, minimum=0)
        with self._lock:
            region = self._regions.pop(region_id, None)
            keys = self._rdma_keys.pop(region_id, None)
        if region is None:
            return
        if keys is not None and self._rdma is not None:
            self._rdma.deregister(keys[2])  # this region's memory region only (by its lkey)
        _release(region)

    def regions(self) -> tuple[RegionDescriptor, ...]:
        with self._lock:
            return tuple(region.descriptor for region in self._regions.values())

    def region(self, region_id: int) -> Region | None:
        """The registered local region `region_id` (used by serving connections)."""
        return self._regions.get(region_id)

    def _add_region(self, view: memoryview, *, keepalive: Any, shm_name: str | None) -> RegionDescriptor:
        rdma_address = rdma_rkey = None
        if self._rdma is not None and view.nbytes:
            rdma_address, lkey, rdma_rkey = self._rdma.register(view)
        with self._lock:
            if self._closed:  # closed since the caller's check: nothing would release the region
                if self._rdma is not None and rdma_address is not None:
                    self._rdma.deregister(lkey)
                raise TransferError(f"transfer engine {self.address} is closed")
            descriptor = RegionDescriptor(
                region_id=next(self._region_ids),
                length=view.nbytes,
                shm_name=shm_name,
                rdma_address=rdma_address,
                rdma_rkey=rdma_rkey,
            )
            self._regions[descriptor.region_id] = Region(descriptor, view, keepalive)
            if rdma_address is not None:
                self._rdma_keys[descriptor.region_id] = (rdma_address, rdma_address + view.nbytes, lkey)
        return descriptor

    # ------------------------------------------------------------------ peers

    def connect(self, address: str, *, transport: str | None = None) -> str:
        """Authenticate to the engine at "host:port" and learn its regions.

        Idempotent for a connected peer: the same engine (incarnation), reached over the same transports, is
        kept with the transfers moving to it, only its descriptor refreshed; a restarted one, or another choice
        of transports, is built anew and the old transports closed (see `Peers.connect`).

        Args:
            address: the peer's listening address.
            transport: force one transport ("tcp", "shm", "rdma") instead of choosing.

        Returns:
            The peer's key for `TransferRequest.peer`: the address dialled (names a
            peer gives itself are not trusted to be unique).

        Raises:
            PeerUnavailable: nobody answers there. AuthenticationError: the secrets differ.
            ConfigError: `address` is not "host:port".
            TransferError: its descriptor is malformed; or the RDMA endpoint it answered with (`ProtocolError`,
                naming the peer: nothing of it is kept, the queue pair made for it is closed).
        """
        self._check_open()
        return self._peers.connect(address, transport=transport)

    def disconnect(self, peer: str) -> None:
        """Drop `peer` (a key `connect` returned): its connections close and its transports' threads end. Requests
        still moving to or from it fail with `PeerUnavailable` (their batches end; none hangs). A peer that went
        away for good (scaled in, or restarted on another address) holds threads and sockets here until it is
        disconnected; `connect` to it again to use it.

        Raises:
            ConfigError: `peer` is not a string.
            TransferError: `peer` is not connected (never was, or was disconnected already).
        """
        self._peers.disconnect(peer)

    def peer_regions(self, peer: str) -> tuple[RegionDescriptor, ...]:
        """The regions `peer` had registered at the last handshake or refresh."""
        return self._peers.descriptor(peer).regions

    def refresh(self, peer: str) -> PeerDescriptor:
        """Fetch `peer`'s current segment descriptor (after it registers more memory).

        Raises:
            PeerUnavailable: it cannot be reached, or it restarted since `connect` (whose regions this engine does
                not know: `connect` to it again).
        """
        return self._peers.refresh(peer)

    def transport_names(self, peer: str) -> tuple[str, ...]:
        """The transports in use for `peer`, in preference order."""
        return self._peers.transport_names(peer)

    def register_handler(self, method: str, handler: Handler) -> None:
        """Serve control calls named `method` (JSON in, JSON out) to authenticated peers.

        Raises:
            ConfigError: `method` is not a non-empty string, or `handler` is not callable.
        """
        self._peers.register_handler(method, handler)

    def handle_call(self, method: str, args: Any) -> Json:
        """Run the handler registered for `method` on `args`, as a peer's control call would."""
        return self._peers.handle_call(method, args)

    def call(self, peer: str, method: str, args: object) -> Json:
        """Run `method` on `peer` (a control call over its control connection, reconnected once if dropped).

        Args:
            args: any value `json.dumps` encodes.

        Returns:
            The peer's reply, decoded.

        Raises:
            ConfigError: `args` is not JSON-encodable (nothing is sent).
            PeerUnavailable: the peer cannot be reached, the call failed midway, or the peer restarted since
                `connect` (`connect` to it again).
            TransferTimeout: other threads' calls to the peer held its control connection (calls to one peer go
                one at a time) for `io_timeout_s`: this one was not sent.
            TransferError: the peer refused the call.
        """
        return self._peers.call(peer, method, args)

    # ------------------------------------------------------------------ batches

    def submit(self, requests: Iterable[TransferRequest]) -> int:
        """Start moving `requests`; returns a batch id for `status` and `wait`.

        Raises:
            ConfigError: `requests` is not an iterable of `TransferRequest`s.
            TransferError: a request names an unknown peer or region or is out of its
                local bounds, or of its remote region's as the peer described it (nothing
                of the batch is started then).
        """
        self._check_open()
        requests = _requests(requests)
        plans = [self._plan(index, request) for index, request in enumerate(requests)]  # validates all first
        with self._lock:
            if self._closed:  # closed since the check above: no close would fail this batch
                raise TransferError(f"transfer engine {self.address} is closed")
            batch_id = next(self._batch_ids)
            batch = _Batch(
                requests=requests,
                remaining=[len(pieces) for _, pieces in plans],
                errors=[None] * len(requests),
                transports=[transport.name for transport, _ in plans],
                open_requests=sum(1 for _, pieces in plans if pieces),
            )
            self._batches[batch_id] = batch
        for index, (transport, pieces) in enumerate(plans):
            for local, remote_offset in pieces:
                request = requests[index]
                transport.submit(
                    Slice(
                        op=request.op,
                        local=local,
                        remote_region=request.remote_region,
                        remote_offset=remote_offset,
                        on_done=self._slice_done_callback(batch_id, index),
                    )
                )
        return batch_id

    def transfer_sync(self, requests: Iterable[TransferRequest], *, timeout: float | None) -> tuple[RequestStatus, ...]:
        """Move `requests` in this thread, one slice after another, and return their statuses.

        The latency path (like the upstream engine's `transfer_sync_*`): requests of
        one slice each move in this thread, with no hand-off to a transport's
        threads; those not started by `timeout` seconds fail with `TransferTimeout`
        (one in flight, connecting included, is cut at the deadline too). Larger requests
        go through `submit` and `wait`, so their slices use every stream; those
        not done by `timeout` are reported FAILED with `TransferTimeout`.

        Raises:
            ConfigError, TransferError: as `submit`, before anything moves.
        """
        self._check_open()
        limit = _timeout(timeout)
        requests = _requests(requests)
        plans = [self._plan(index, request) for index, request in enumerate(requests)]
        if any(len(pieces) > 1 for _, pieces in plans):
            # Requests of several slices gain more from the transports' parallel
            # streams than they lose to the hand-off.
            batch = self.submit(requests)
            try:
                return self.wait(batch, timeout)
            except TransferTimeout as late:
                # Not done in time: reported failed (they may still land; success never is claimed).
                return tuple(
                    RequestStatus(RequestState.FAILED, late, status.transport)
                    if status.state == RequestState.PENDING
                    else status
                    for status in self.status(batch)
                )
            finally:
                self.forget_when_ended(batch)  # no caller knows its id: its slices may still be moving
        deadline = time.monotonic() + limit if limit is not None else None
        statuses = []
        for request, (transport, pieces) in zip(requests, plans, strict=True):
            error: TransferError | None = None
            for local, remote_offset in pieces:
                if deadline is not None and time.monotonic() > deadline:
                    error = TransferTimeout(f"not started within {timeout}s")
                    break
                error = transport.run_inline(
                    Slice(request.op, local, request.remote_region, remote_offset, _ignore), deadline=deadline
                )
                if error is not None:
                    break
            state = RequestState.DONE if error is None else RequestState.FAILED
            statuses.append(RequestStatus(state, error, transport.name))
        return tuple(statuses)

    def status(self, batch_id: int) -> tuple[RequestStatus, ...]:
        """Where each request of the batch stands (PENDING until it ended).

        Raises:
            TransferError: no such batch (never submitted, or forgotten).
            ConfigError: `batch_id` is not an integer >= 0.
        """
        batch_id = require_int("batch_id", batch_id, minimum=0)
        with self._lock:
            batch = self._batches.get(batch_id)
            if batch is None:
                raise TransferError(f"unknown batch {shown(batch_id)}")
            return tuple(_status(batch, i) for i in range(len(batch.requests)))

    def wait(self, batch_id: int, timeout: float | None) -> tuple[RequestStatus, ...]:
        """Block until every request of the batch has ended, then return their statuses.

        The record stays: `forget` it once its outcome is read. `close` ends the requests still pending (FAILED,
        `PeerUnavailable`), so a wait returns then too.

        Args:
            timeout: seconds (None or math.inf: until they end).

        Raises:
            TransferTimeout: requests were still moving after `timeout` seconds
                (they go on; `status` tells how they end).
            TransferError: no such batch.
            ConfigError: `timeout` is negative or NaN, or `batch_id` is not an integer >= 0.
        """
        batch_id = require_int("batch_id", batch_id, minimum=0)
        limit = _timeout(timeout)
        with self._finished:
            batch = self._batches.get(batch_id)
            if batch is None:
                raise TransferError(f"unknown batch {shown(batch_id)}")
            if not self._finished.wait_for(lambda: batch.open_requests == 0, timeout=limit):
                raise TransferTimeout(
                    f"batch {batch_id}: {batch.open_requests} of {len(batch.requests)} requests still moving after {timeout}s"
                )
            return tuple(_status(batch, i) for i in range(len(batch.requests)))

    @property
    def num_batches(self) -> int:
        """Batch records held: submitted and not yet forgotten (`forget`), and `transfer_sync`'s own while they
        move."""
        with self._lock:
            return len(self._batches)

    def _check_open(self) -> None:
        if self._closed:  # a region or connection made now would outlive close(): nothing would release it
            raise TransferError(f"transfer engine {self.address} is closed")

    def forget(self, batch_id: int) -> None:
        """Drop the record of a batch whose requests have all ended (as upstream's freeBatchID); an id with no
        record (never submitted, or forgotten already) is left alone.

        Every submitted batch is kept until it is forgotten (or the engine is collected): call this once its
        statuses are read (`wait`, `status`), so that a long-lived engine does not accumulate them.

        Raises:
            TransferError: a request of the batch is still pending (its id and how many named): `wait` for it first,
                or `close` the engine, which ends it. A batch still moving is never dropped, so that a thread waiting
                on it is woken when it ends.
            ConfigError: `batch_id` is not an integer >= 0.
        """
        batch_id = require_int("batch_id", batch_id, minimum=0)
        with self._lock:
            batch = self._batches.get(batch_id)
            if batch is None:
                return
            if batch.open_requests:
                raise TransferError(
                    f"batch {batch_id} still has {batch.open_requests} of {len(batch.requests)} requests pending:"
                    " wait for it (or close the engine) before forgetting it"
                )
            del self._batches[batch_id]

    def forget_when_ended(self, batch_id: int) -> None:
        """`forget` a batch now if its requests have all ended, else as soon as its last request ends: for a batch
        whose statuses no caller will read (a wait that timed out while a slice may still be moving). A thread
        already waiting on it is still woken when it ends; a later `wait` or `status` finds no record.

        Raises:
            ConfigError: `batch_id` is not an integer >= 0.
        """
        batch_id = require_int("batch_id", batch_id, minimum=0)
        with self._lock:
            batch = self._batches.get(batch_id)
            if batch is None:
                return
            if batch.open_requests:
                batch.dropped_when_ended = True
            else:
                del self._batches[batch_id]

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Stop listening, close every connection and transport, unlink owned shared memory.

        Waits (up to `io_timeout_s`) for the threads serving peers' connections, so that no byte a peer sent lands
        in a region after `close` returned; then fails every request still pending (`PeerUnavailable`) and wakes
        every `wait`. Batch records stay until forgotten.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # Let go of the regions first: a serving thread that has staged a WRITE finds its region gone and
            # refuses it, and `Peers.close` waits for those threads, so nothing lands after this returns.
            regions = list(self._regions.values())
            self._regions.clear()
        self._peers.close()
        for region in regions:
            _release(region)
        with self._finished:  # nothing moves any more: no batch may stay pending, and every waiter wakes
            for batch in self._batches.values():
                for index, remaining in enumerate(batch.remaining):
                    if remaining:
                        batch.remaining[index] = 0
                        batch.errors[index] = batch.errors[index] or PeerUnavailable("the engine closed")
                        batch.open_requests -= 1
            self._batches = {key: batch for key, batch in self._batches.items() if not batch.dropped_when_ended}
            self._finished.notify_all()
        self._peers.close_queue_pairs()
        if self._rdma is not None:
            self._rdma.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _local_key(self, view: memoryview) -> tuple[int, int]:
        address = buffer_address(view)
        for start, end, lkey in list(self._rdma_keys.values()):  # a copy: regions come and go meanwhile
            if start <= address and address + view.nbytes <= end:
                return address, lkey
        raise TransferError("the local bytes are not in RDMA-registered memory")

    def _plan(self, index: int, request: TransferRequest) -> tuple[Transport, list[tuple[memoryview, int]]]:
        """`requests[index]`'s transport and its slices (local view, remote offset); a local refusal names the
        request's index and says it is local (the remote region may be fine)."""
        local = self._regions.get(request.local_region)
        if local is None:
            raise TransferError(f"requests[{index}]: no local region {request.local_region}")
        problem = bounds_error(request.local_offset, request.length, local.descriptor.length)
        if problem is not None:
            raise TransferError(f"requests[{index}]: local region {request.local_region}: {problem}")
        view = local.slice(request.local_offset, request.length)
        transport = self._peers.transport_for(request.peer, request.remote_region)
        self._check_remote_range(request)
        step = self.config.slice_bytes
        # A zero-length request is one empty slice, so that the peer still checks its region and offset.
        pieces = [
            (view[start : start + step], request.remote_offset + start)
            for start in range(0, max(request.length, 1), step)
        ]
        return transport, pieces

    def _check_remote_range(self, request: TransferRequest) -> None:
        """Refuse a request that crosses the end of its remote region, where the peer's descriptor lists it:
        refused whole here, before its first slices could land (each slice is checked again where it moves,
        but only for itself). A region the descriptor does not list (registered since) is left to the peer."""
        remote = self._peers.remote_region(request.peer, request.remote_region)
        if remote is None:
            return
        problem = bounds_error(request.remote_offset, request.length, remote.length)
        if problem is not None:
            raise TransferError(
                f"remote region {request.remote_region} of {request.peer}: remote_offset {request.remote_offset} +"
                f" length {request.length} is past its end ({problem}); nothing of the batch was started"
            )

    def _slice_done_callback(self, batch_id: int, index: int) -> Callable[[TransferError | None], None]:
        def done(error: TransferError | None) -> None:
            with self._finished:
                batch = self._batches.get(batch_id)
                if batch is None or batch.remaining[index] == 0:
                    return
                if error is not None and batch.errors[index] is None:
                    batch.errors[index] = error
                batch.remaining[index] -= 1
                if batch.remaining[index] == 0:
                    batch.open_requests -= 1
                    if batch.open_requests == 0:
                        if batch.dropped_when_ended:
                            del self._batches[batch_id]
                        self._finished.notify_all()

        return done


def _timeout(value: Any) -> float | None:
    """A wait's limit in seconds, None for none (None or math.inf); ConfigError for anything else but a number >= 0
    (NaN would make every deadline comparison false: a wait that never times out)."""
    if value is None or (isinstance(value, float) and value == math.inf):
        return None
    seconds = require_number("timeout", value, minimum=0)
    return None if seconds > threading.TIMEOUT_MAX else seconds  # longer than a lock wait can take: no limit


def _requests(value: Any) -> tuple[TransferRequest, ...]:
    """`value` as a tuple of requests, or a ConfigError naming what is not one (None, a number, a dict of fields)."""
    requests = tuple(require_iterable("requests", value))
    for index, one in enumerate(requests):
        if not isinstance(one, TransferRequest):
            raise ConfigError(f"requests[{index}] must be a TransferRequest, got {shown(one)}")
    return requests


def _ignore(_error: TransferError | None) -> None:
    """The completion callback of a slice run inline: its caller takes the outcome directly."""


def _status(batch: _Batch, index: int) -> RequestStatus:
    if batch.remaining[index]:
        return RequestStatus(RequestState.PENDING, transport=batch.transports[index])
    error = batch.errors[index]
    state = RequestState.FAILED if error is not None else RequestState.DONE
    return RequestStatus(state, error, batch.transports[index])


def _release(region: Region) -> None:
    """Unlink the shared segment behind `region`, if it has one. The mapping itself lives
    on while arrays over it exist (a caller may still hold one; see `region.shared_array`)."""
    keepalive = region.keepalive
    if isinstance(keepalive, tuple) and isinstance(keepalive[0], shared_memory.SharedMemory):
        with contextlib.suppress(FileNotFoundError):
            keepalive[0].unlink()
