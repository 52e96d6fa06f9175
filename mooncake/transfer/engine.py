"""The transfer engine: registered memory, peers, and batches of reads and writes.

Usage (both sides run an engine with the same secret):

    engine = TransferEngine(secret=b"...")
    buffer = engine.allocate_shared(1 << 30)             # or register_memory(any buffer)
    local = engine.regions()[0]
    peer = engine.connect("10.0.0.2:7000")               # handshake: auth + segment descriptors
    remote = engine.peer_regions(peer)[0]
    batch = engine.submit([TransferRequest(op=TransferOp.WRITE, local_region=local.region_id,
        local_offset=0, peer=peer, remote_region=remote.region_id, remote_offset=0, length=1 << 20)])
    statuses = engine.wait(batch, timeout=5.0)            # or engine.transfer_sync([...], timeout=5.0)

Peers are discovered peer to peer: `connect` authenticates (mutual HMAC challenge,
see `wire`) and fetches the peer's segment descriptor (its regions, host and
process) with a control call; no metadata service is needed. Each peer gets the
transports it can use, by preference: `shm` when it runs on this host and the
remote region lives in shared memory, `rdma` where both ends have a device,
`tcp` always. Requests are cut into slices of at most `slice_bytes`, spread
over the transport's streams; a request is done when all its slices are, and
fails with the first slice error. The requests of a batch move concurrently:
requests that overlap (a write and a read of the same bytes) have no order.

Invariants:
- A request is reported DONE only after every byte of it was delivered (and
  acknowledged by the peer, or received and verified).
- Each request ends exactly once (DONE or FAILED); `wait` never blocks past its timeout.
- Every access is bounds-checked before a byte moves: over TCP by the side that
  owns the memory; over shm and RDMA by the initiator, against the peer's
  descriptor (validated when received), and for RDMA by the NIC again.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable
from multiprocessing import shared_memory
from typing import Any

import attrs

from mooncake.errors import ConfigError, PeerUnavailable, TransferError, TransferTimeout
from mooncake.transfer import tcp
from mooncake.transfer.rdma import QueuePair, RdmaTransport, Verbs, buffer_address, open_device
from mooncake.transfer.region import Region, RegionDescriptor, as_writable_bytes, create_shared
from mooncake.transfer.request import (
    EngineConfig,
    RequestState,
    RequestStatus,
    Slice,
    TransferRequest,
    Transport,
)
from mooncake.transfer.shm import ShmTransport
from mooncake.transfer.wire import ProtocolError

__all__ = ["PeerDescriptor", "TransferEngine", "host_id"]

Handler = Callable[[Any], Any]


def host_id() -> str:
    """Identifies this machine (hostname and boot id): equal ids mean shared memory is shared."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as boot:
            boot_id = boot.read().strip()
    except OSError:
        boot_id = ""
    return f"{socket.gethostname()}/{boot_id}"


@attrs.frozen(kw_only=True)
class PeerDescriptor:
    """What the handshake tells about a peer."""

    name: str
    host_id: str
    pid: int
    regions: tuple[RegionDescriptor, ...]
    rdma: bool = False


@attrs.define(eq=False)
class _Peer:
    host: str
    port: int
    descriptor: PeerDescriptor
    transports: dict[str, Transport]
    control: socket.socket | None = None
    control_lock: threading.Lock = attrs.field(factory=threading.Lock)


@attrs.define(eq=False)
class _Batch:
    requests: tuple[TransferRequest, ...]
    remaining: list[int]  # slices still moving, per request
    errors: list[TransferError | None]
    transports: list[str]
    open_requests: int


class TransferEngine:
    """Registers memory, talks to peers, and moves batches of bytes.

    Args:
        secret: shared by every engine of a deployment; peers prove they know it.
        config: listening address and transfer behaviour.
        name: how peers call this engine (default its "host:port").
        rdma: the RDMA device to use; by default the first one pyverbs finds,
            when "rdma" is among the configured transports (none: no RDMA).
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
        self.secret = secret
        self.config = config = config or EngineConfig()
        self._regions: dict[int, Region] = {}
        self._region_ids = itertools.count(1)
        self._handlers: dict[str, Handler] = {
            "describe": lambda _args: self._describe_self(),
            "rdma_connect": self._accept_rdma,
        }
        if rdma is None and "rdma" in config.transports:
            rdma = open_device()
        self._rdma = rdma if "rdma" in config.transports else None
        self._rdma_keys: list[tuple[int, int, int]] = []  # (start address, end address, lkey) per region
        self._queue_pairs: list[QueuePair] = []  # accepted from peers, closed with the engine
        self._peers: dict[str, _Peer] = {}
        self._batches: dict[int, _Batch] = {}
        self._batch_ids = itertools.count(1)
        self._lock = threading.RLock()
        self._finished = threading.Condition(self._lock)
        self._connections: set[socket.socket] = set()
        self._closed = False
        self._listener = socket.create_server((config.host, config.port), backlog=128)
        self.host, self.port = self._listener.getsockname()[:2]
        self.name = name or f"{self.host}:{self.port}"
        self._host_id = host_id()
        self._acceptor = threading.Thread(target=self._accept, name=f"engine-{self.port}-accept", daemon=True)
        self._acceptor.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # ------------------------------------------------------------------ memory

    def register_memory(self, buffer: Any) -> RegionDescriptor:
        """Make `buffer` (contiguous, writable) addressable by peers; returns its descriptor."""
        view = as_writable_bytes(buffer)
        return self._add_region(view, keepalive=buffer, shm_name=None)

    def allocate_shared(self, nbytes: int) -> tuple[RegionDescriptor, Any]:
        """A new registered region in shared memory (same-host peers copy into it directly).

        Returns:
            Its descriptor and a uint8 numpy array over it. The segment is
            unlinked when the engine closes.
        """
        segment, array = create_shared(nbytes)
        descriptor = self._add_region(array.data, keepalive=(segment, array), shm_name=segment.name)
        return descriptor, array

    def unregister_memory(self, region_id: int) -> None:
        """Stop serving a region, over every transport (RDMA included: its memory region is
        deregistered); requests already in flight against it may still complete."""
        with self._lock:
            region = self._regions.pop(region_id, None)
            address = region.descriptor.rdma_address if region is not None else None
            if address is not None:
                self._rdma_keys = [entry for entry in self._rdma_keys if entry[0] != address]
        if region is None:
            return
        if address is not None and self._rdma is not None:
            self._rdma.deregister(address)
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
            descriptor = RegionDescriptor(
                region_id=next(self._region_ids),
                length=view.nbytes,
                shm_name=shm_name,
                rdma_address=rdma_address,
                rdma_rkey=rdma_rkey,
            )
            self._regions[descriptor.region_id] = Region(descriptor, view, keepalive)
            if rdma_address is not None:
                self._rdma_keys.append((rdma_address, rdma_address + view.nbytes, lkey))
        return descriptor

    # ------------------------------------------------------------------ peers

    def connect(self, address: str, *, transport: str | None = None) -> str:
        """Authenticate to the engine at "host:port" and learn its regions.

        Args:
            address: the peer's listening address.
            transport: force one transport ("tcp", "shm", "rdma") instead of choosing.

        Returns:
            The peer's key for `TransferRequest.peer`: the address dialled (names a
            peer gives itself are not trusted to be unique).

        Raises:
            PeerUnavailable: nobody answers there. AuthenticationError: the secrets differ.
        """
        host, _, port_text = address.rpartition(":")
        if not host or not port_text.isdigit():
            raise ConfigError(f"a peer address is host:port, got {address!r}")
        port = int(port_text)
        key = f"{host}:{port}"
        control = tcp.connect(host, port, secret=self.secret, config=self.config)
        transports: dict[str, Transport] = {}
        try:
            descriptor = _peer_descriptor(
                tcp.call(control, "describe", None, max_frame_bytes=self.config.max_frame_bytes)
            )
            transports = self._transports_for(host, port, key, descriptor, transport, control)
        except BaseException:
            for built in transports.values():
                built.close()
            control.close()
            raise
        peer = _Peer(host, port, descriptor, transports, control)
        with self._lock:
            old = self._peers.pop(key, None)
            self._peers[key] = peer
        if old is not None:
            _close_peer(old)
        return key

    def peer_regions(self, peer: str) -> tuple[RegionDescriptor, ...]:
        """The regions `peer` had registered at the last handshake or refresh."""
        return self._peer(peer).descriptor.regions

    def refresh(self, peer: str) -> PeerDescriptor:
        """Fetch `peer`'s current segment descriptor (after it registers more memory)."""
        state = self._peer(peer)
        descriptor = _peer_descriptor(self.call(peer, "describe", None))
        state.descriptor = descriptor
        return descriptor

    def transport_names(self, peer: str) -> tuple[str, ...]:
        """The transports in use for `peer`, in preference order."""
        return tuple(self._peer(peer).transports)

    def register_handler(self, method: str, handler: Handler) -> None:
        """Serve control calls named `method` (JSON in, JSON out) to authenticated peers."""
        self._handlers[method] = handler

    def handle_call(self, method: str, args: Any) -> Any:
        handler = self._handlers.get(method)
        if handler is None:
            raise TransferError(f"no handler for {method!r}")
        return handler(args)

    def call(self, peer: str, method: str, args: Any) -> Any:
        """Run `method` on `peer` (a control call over its control connection, reconnected once if dropped)."""
        state = self._peer(peer)
        with state.control_lock:
            for attempt in range(2):
                if state.control is None:
                    state.control = tcp.connect(state.host, state.port, secret=self.secret, config=self.config)
                try:
                    return tcp.call(state.control, method, args, max_frame_bytes=self.config.max_frame_bytes)
                except tcp.CallNotSent as error:
                    # Nothing reached the peer (a stale connection): safe to retry once, fresh.
                    state.control.close()
                    state.control = None
                    if attempt:
                        raise PeerUnavailable(f"{peer} dropped the control connection: {error}") from error
                except (OSError, TransferError) as error:
                    # The call may have run: never repeat it (it may not be idempotent).
                    state.control.close()
                    state.control = None
                    if isinstance(error, TransferError) and not isinstance(error, ProtocolError):
                        raise
                    raise PeerUnavailable(f"{peer}: the control call {method} failed midway: {error}") from error
        raise AssertionError("unreachable")  # pragma: no cover

    # ------------------------------------------------------------------ batches

    def submit(self, requests: Iterable[TransferRequest]) -> int:
        """Start moving `requests`; returns a batch id for `status` and `wait`.

        Raises:
            TransferError: a request names an unknown peer or region or is out of its
                local bounds (nothing of the batch is started then).
        """
        requests = tuple(requests)
        plans = [self._plan(request) for request in requests]  # validates all before starting any
        with self._lock:
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

    def transfer_sync(self, requests: Iterable[TransferRequest], *, timeout: float) -> tuple[RequestStatus, ...]:
        """Move `requests` in this thread, one slice after another, and return their statuses.

        The latency path (like the upstream engine's `transfer_sync_*`): requests of
        one slice each move in this thread, with no hand-off to a transport's
        threads; those not started by `timeout` seconds fail with `TransferTimeout`
        (one in flight is bounded by the connection's io timeout). Larger requests
        go through `submit` and `wait`, so their slices use every stream; those
        not done by `timeout` are reported FAILED with `TransferTimeout`.

        Raises:
            TransferError: as `submit`, before anything moves.
        """
        requests = tuple(requests)
        plans = [self._plan(request) for request in requests]
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
                self.forget(batch)
        deadline = time.monotonic() + timeout
        statuses = []
        for request, (transport, pieces) in zip(requests, plans, strict=True):
            error: TransferError | None = None
            for local, remote_offset in pieces:
                if time.monotonic() > deadline:
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
        """Where each request of the batch stands."""
        with self._lock:
            batch = self._batches.get(batch_id)
            if batch is None:
                raise TransferError(f"unknown batch {batch_id}")
            return tuple(_status(batch, i) for i in range(len(batch.requests)))

    def wait(self, batch_id: int, timeout: float) -> tuple[RequestStatus, ...]:
        """Block until every request of the batch has ended, then return their statuses.

        Raises:
            TransferTimeout: requests were still moving after `timeout` seconds
                (they go on; `status` tells how they end).
        """
        with self._finished:
            batch = self._batches.get(batch_id)
            if batch is None:
                raise TransferError(f"unknown batch {batch_id}")
            if not self._finished.wait_for(lambda: batch.open_requests == 0, timeout=timeout):
                raise TransferTimeout(
                    f"batch {batch_id}: {batch.open_requests} of {len(batch.requests)} requests still moving after {timeout}s"
                )
            return tuple(_status(batch, i) for i in range(len(batch.requests)))

    def forget(self, batch_id: int) -> None:
        """Drop a finished batch's record."""
        with self._lock:
            self._batches.pop(batch_id, None)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Stop listening, close every connection and transport, unlink owned shared memory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers = list(self._peers.values())
            self._peers.clear()
            connections = list(self._connections)
            regions = list(self._regions.values())
            self._regions.clear()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (close alone does not)
        self._listener.close()
        for peer in peers:
            _close_peer(peer)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()
        self._acceptor.join(timeout=5)
        for region in regions:
            _release(region)
        with self._finished:  # nothing moves any more: no batch may stay pending
            for batch in self._batches.values():
                for index, remaining in enumerate(batch.remaining):
                    if remaining:
                        batch.remaining[index] = 0
                        batch.errors[index] = batch.errors[index] or PeerUnavailable("the engine closed")
                        batch.open_requests -= 1
            self._finished.notify_all()
        for queue_pair in self._queue_pairs:
            queue_pair.close()
        if self._rdma is not None:
            self._rdma.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _peer(self, name: str) -> _Peer:
        with self._lock:
            peer = self._peers.get(name)
        if peer is None:
            raise TransferError(f"unknown peer {name!r}: connect() to it first")
        return peer

    def _describe_self(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "host_id": self._host_id,
            "pid": os.getpid(),
            "regions": [region.to_json() for region in self.regions()],
            "rdma": self._rdma is not None,
        }

    def _accept_rdma(self, endpoint: Any) -> Any:
        """The peer side of an RDMA connection: a queue pair connected to the caller's."""
        if self._rdma is None:
            raise TransferError("this engine has no RDMA device")
        with self._lock:
            if len(self._queue_pairs) >= self.config.max_connections:
                raise TransferError("too many RDMA queue pairs")
        queue_pair = self._rdma.create_queue_pair()
        queue_pair.connect(endpoint)
        with self._lock:
            self._queue_pairs.append(queue_pair)
        return queue_pair.endpoint()

    def _local_key(self, view: memoryview) -> tuple[int, int]:
        address = buffer_address(view)
        for start, end, lkey in self._rdma_keys:
            if start <= address and address + view.nbytes <= end:
                return address, lkey
        raise TransferError("the local bytes are not in RDMA-registered memory")

    def _transports_for(
        self,
        host: str,
        port: int,
        peer_name: str,
        descriptor: PeerDescriptor,
        forced: str | None,
        control: socket.socket,
    ) -> dict[str, Transport]:
        allowed = (forced,) if forced else self.config.transports
        transports: dict[str, Transport] = {}

        def describe(region_id: int) -> RegionDescriptor | None:
            return self._remote_region(peer_name, region_id)

        try:
            for name in allowed:
                if name == "shm" and descriptor.host_id == self._host_id:
                    transports["shm"] = ShmTransport(
                        describe, peer_pid=descriptor.pid, workers=self.config.streams_per_peer
                    )
                elif name == "rdma" and self._rdma is not None and descriptor.rdma:
                    queue_pair = self._rdma.create_queue_pair()
                    remote = tcp.call(
                        control, "rdma_connect", queue_pair.endpoint(), max_frame_bytes=self.config.max_frame_bytes
                    )
                    queue_pair.connect(remote)
                    transports["rdma"] = RdmaTransport(
                        queue_pair, local_key=self._local_key, describe=describe, config=self.config
                    )
                elif name == "tcp":
                    transports["tcp"] = tcp.TcpTransport(host, port, secret=self.secret, config=self.config)
        except BaseException:
            for built in transports.values():
                built.close()
            raise
        if not transports or (forced and forced not in transports):
            for built in transports.values():
                built.close()
            raise ConfigError(f"no usable transport to {peer_name} among {allowed}")
        return transports

    def _remote_region(self, peer: str, region_id: int) -> RegionDescriptor | None:
        state = self._peer(peer)
        for descriptor in state.descriptor.regions:
            if descriptor.region_id == region_id:
                return descriptor
        return None

    def _plan(self, request: TransferRequest) -> tuple[Transport, list[tuple[memoryview, int]]]:
        local = self._regions.get(request.local_region)
        if local is None:
            raise TransferError(f"no local region {request.local_region}")
        view = local.slice(request.local_offset, request.length)
        peer = self._peer(request.peer)
        remote = self._remote_region(request.peer, request.remote_region)
        transport = None
        for name, candidate in peer.transports.items():
            if name == "shm" and (remote is None or remote.shm_name is None):
                continue  # shm reaches shared regions only
            if name == "rdma" and (remote is None or remote.rdma_address is None):
                continue  # and rdma registered ones
            transport = candidate
            break
        if transport is None:
            raise TransferError(f"no transport reaches region {request.remote_region} of {request.peer}")
        step = self.config.slice_bytes
        pieces = [
            (view[start : start + step], request.remote_offset + start) for start in range(0, request.length, step)
        ]
        return transport, pieces

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
                        self._finished.notify_all()

        return done

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return  # the listener was closed
            with self._lock:
                if self._closed:
                    connection.close()
                    return
                if len(self._connections) >= self.config.max_connections:
                    connection.close()  # refuse rather than let peers exhaust our threads
                    continue
                self._connections.add(connection)
            threading.Thread(
                target=tcp.serve_connection,
                args=(connection, self, lambda c=connection: self._forget_connection(c)),
                name=f"engine-{self.port}-serve",
                daemon=True,
            ).start()

    def _forget_connection(self, connection: socket.socket) -> None:
        with self._lock:
            self._connections.discard(connection)


def _ignore(_error: TransferError | None) -> None:
    """The completion callback of a slice run inline: its caller takes the outcome directly."""


def _status(batch: _Batch, index: int) -> RequestStatus:
    if batch.remaining[index]:
        return RequestStatus(RequestState.PENDING, transport=batch.transports[index])
    error = batch.errors[index]
    state = RequestState.FAILED if error is not None else RequestState.DONE
    return RequestStatus(state, error, batch.transports[index])


_SHM_NAME = re.compile(r"mooncake-(\d+)-[0-9a-f]+")


def _checked_region(data: Any, peer_pid: int) -> RegionDescriptor:
    """A peer's region descriptor, refused unless every field is plausible: the
    initiator trusts it for shm and RDMA bounds. Shared segments must be mooncake
    segments of the peer's own process (by name), so a peer cannot point our
    copies at another program's shared memory. (Authenticated peers are trusted
    with every region registered in the deployment: that is what the secret grants.)"""
    descriptor = RegionDescriptor.from_json(data)
    for name in ("region_id", "length", "rdma_address", "rdma_rkey"):
        value = getattr(descriptor, name)
        if value is not None and (type(value) is not int or not 0 <= value < 2**64):
            raise TransferError(f"malformed segment descriptor: {name}={value!r}")
    if descriptor.shm_name is not None:
        match = _SHM_NAME.fullmatch(str(descriptor.shm_name))
        if match is None or int(match.group(1)) != peer_pid:
            raise TransferError(f"malformed segment descriptor: shm_name={descriptor.shm_name!r}")
    return descriptor


def _peer_descriptor(data: Any) -> PeerDescriptor:
    try:
        pid = int(data["pid"])
        return PeerDescriptor(
            name=str(data["name"]),
            host_id=str(data["host_id"]),
            pid=pid,
            regions=tuple(_checked_region(r, pid) for r in data["regions"]),
            rdma=bool(data.get("rdma", False)),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise TransferError(f"malformed segment descriptor: {error}") from error


def _close_peer(peer: _Peer) -> None:
    for transport in peer.transports.values():
        transport.close()
    if peer.control is not None:
        peer.control.close()


def _release(region: Region) -> None:
    """Unlink the shared segment behind `region`, if it has one. The mapping itself lives
    on while arrays over it exist (a caller may still hold one) and goes with the process."""
    keepalive = region.keepalive
    if isinstance(keepalive, tuple) and isinstance(keepalive[0], shared_memory.SharedMemory):
        with contextlib.suppress(FileNotFoundError):
            keepalive[0].unlink()
