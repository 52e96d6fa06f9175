"""Peers: discovery by authenticated handshake, segment descriptors, control calls, the accept loop.

An engine finds its peers peer to peer, with no metadata service. `Peers.connect`
opens an authenticated control connection (mutual HMAC challenge, see `wire`),
fetches the peer's segment descriptor with a "describe" control call (its
regions, host, process and whether it has RDMA), validates it, and builds the
transports that reach the peer, by preference: `shm` when it runs on this host
and shares its /dev/shm and PID namespace (equal `host_id`; a container with
its own is reached over the others), `rdma` where both ends have a device (the
queue pairs meet through an "rdma_connect" control call), `tcp` always. A peer
is known by the address dialled. `transport_for` picks, per remote region, the
first of a peer's transports that reaches it (shm only shared regions, rdma only
registered ones).
A peer is kept until `disconnect` (or `close`): its transports hold threads and
connections, so a peer that went away for good (scaled in, or restarted on
another address) should be disconnected. Connecting again to a peer that is
connected and finding the same engine incarnation (below), to be reached over
the same transports, keeps the peer as it is, only its descriptor refreshed (as
upstream's openSegment returns the cached segment): its transports, and the
transfers moving on them, are untouched. Only another incarnation (a restart),
another set of transports (`connect(..., transport=...)` forcing another, say)
or a broken RDMA queue pair has `connect` build new transports and close the
old ones (failing what moves on them).

The other side is the `listener`: it authenticates incoming connections under
a budget and deadline of their own, then serves each authenticated one on a
thread of its own (`tcp.serve_connection`), at most `max_connections` at once;
control calls go to the handlers registered by method name ("describe" and
"rdma_connect" are built in). Checksummed WRITEs are staged in one
`StagingPool` of `max_staging_bytes` shared by every served connection.

Each engine draws a random incarnation id when it starts and tells it in every
handshake it serves (`wire`). `connect` keeps the id of the engine that
described itself beside its descriptor, and every later connection to the peer
(the TCP transport's, the control connection's) must reach that same engine:
one restarted on the address has regions of its own under the same ids, so
it is refused with `PeerUnavailable` until `connect` is called again.

Invariants:
- A stored descriptor was validated when received: its integers are in range
  and its shared segments are mooncake segments of the peer's own process
  (the shm and RDMA transports trust it for bounds).
- Every connection to a peer after `connect` reaches the engine incarnation
  that sent its stored descriptor, or is refused.
- A control call is sent again only when it provably did not reach the peer.
- A control call waits at most `io_timeout_s` for the calls to the same peer
  ahead of it (they share one control connection), then is refused unsent.
- `connect` to a peer connected to the same incarnation, over the same
  transports, none of them broken, closes nothing of it.
- After `close` no connection is accepted or served, and every peer's
  transports and control connection are closed; after `disconnect(peer)`,
  that peer's are, and it is unknown until connected again.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
from collections.abc import Callable
from typing import Any

import attrs

from mooncake._checks import require_str, shown
from mooncake.errors import ConfigError, PeerUnavailable, TransferError, TransferTimeout
from mooncake.transfer import tcp
from mooncake.transfer.listener import Listener
from mooncake.transfer.rdma import QueuePair, RdmaTransport, Verbs, check_endpoint
from mooncake.transfer.region import Region, RegionDescriptor
from mooncake.transfer.request import EngineConfig, Transport
from mooncake.transfer.shm import ShmTransport
from mooncake.transfer.staging import StagingPool
from mooncake.transfer.wire import Json, ProtocolError, new_incarnation

__all__ = ["Handler", "PeerDescriptor", "Peers", "host_id"]

# A control call's handler: the arguments a peer sent (read by the method's protocol;
# a malformed one raises and the call is refused), and the JSON value to answer.
Handler = Callable[[Any], Json]

_PORT = re.compile(r"[0-9]{1,5}")
_SHM_NAME = re.compile(r"mooncake-([1-9][0-9]*)-[0-9a-f]+")  # ASCII digits only, no leading zero: one name per pid


def host_id(*, shm_folder: str = "/dev/shm", pid_namespace: str = "/proc/self/ns/pid") -> str:
    """Identifies where this process's shared memory lives: equal ids mean shared memory is shared.

    Hostname and boot id name the machine; a container on it (host networking, so the same hostname) may
    still have a /dev/shm of its own, or a PID namespace of its own where the pids peers tell mean nothing
    here. So the id also holds the device of `shm_folder` (each tmpfs mount has its own) and the inode of
    `pid_namespace` (each namespace has its own), each empty where it cannot be read: peers that differ in
    either are not taken for same-host, and reach each other over the other transports.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as boot:
            boot_id = boot.read().strip()
    except OSError:
        boot_id = ""
    shm_device, namespace = _stat_field(shm_folder, "st_dev"), _stat_field(pid_namespace, "st_ino")
    return f"{socket.gethostname()}/{boot_id}/shm:{shm_device}/pid:{namespace}"


def _stat_field(path: str, field: str) -> str:
    """`field` of os.stat(path), or "" where it cannot be read (no /dev/shm, no /proc)."""
    try:
        return str(getattr(os.stat(path), field))
    except OSError:
        return ""


@attrs.frozen(kw_only=True)
class PeerDescriptor:
    """What the handshake tells about a peer: its segment descriptor, and the largest frame it reads
    (`max_frame_bytes`; None from a peer that does not say)."""

    name: str
    host_id: str
    pid: int
    regions: tuple[RegionDescriptor, ...]
    rdma: bool = False
    max_frame_bytes: int | None = None

    def to_json(self) -> dict[str, Json]:
        described: dict[str, Json] = {
            "name": self.name,
            "host_id": self.host_id,
            "pid": self.pid,
            "regions": [region.to_json() for region in self.regions],
            "rdma": self.rdma,
        }
        if self.max_frame_bytes is not None:
            described["max_frame_bytes"] = self.max_frame_bytes
        return described

    @classmethod
    def from_json(cls, data: Any) -> PeerDescriptor:
        """A peer's descriptor as it sent it, every field checked.

        Raises:
            TransferError: a field is missing, of the wrong type or implausible.
        """
        try:
            name, host, pid, regions = data["name"], data["host_id"], data["pid"], data["regions"]
            rdma = data.get("rdma", False)
            # Taken as sent, never coerced: a pid of "12", 12.9 or true, or rdma "false", is a lie or a bug.
            for field, value, kind in (("name", name, str), ("host_id", host, str), ("rdma", rdma, bool)):
                if type(value) is not kind:
                    raise TransferError(
                        f"malformed segment descriptor: {field}={shown(value)} is not a {kind.__name__}"
                    )
            if type(pid) is not int or not 0 < pid < 2**31:  # a process id: positive, and pid_t a signed 32-bit int
                raise TransferError(f"malformed segment descriptor: pid={shown(pid)}")
            if type(regions) is not list:
                raise TransferError(f"malformed segment descriptor: regions={shown(regions)} is not a list")
            frame = data.get("max_frame_bytes")
            if frame is not None and (type(frame) is not int or not 0 < frame < 2**63):
                raise TransferError(f"malformed segment descriptor: max_frame_bytes={shown(frame)}")
            return cls(
                name=name,
                host_id=host,
                pid=pid,
                regions=tuple(_checked_region(r, pid) for r in regions),
                rdma=rdma,
                max_frame_bytes=frame,
            )
        except (KeyError, TypeError, ValueError) as error:  # the error may quote what the peer sent: cut short
            raise TransferError(f"malformed segment descriptor: {shown(str(error), quote=str)}") from error


@attrs.define(eq=False)
class _Peer:
    host: str
    port: int
    descriptor: PeerDescriptor
    incarnation: bytes  # of the engine that sent `descriptor`: every connection must reach it
    transports: dict[str, Transport]
    control: socket.socket | None = None
    control_lock: threading.Lock = attrs.field(factory=threading.Lock)
    closed: bool = False  # disconnected (or the engine closed): no control connection is opened to it again


class Peers:
    """The peers of one engine, and the listener they reach it through.

    Args:
        secret: shared by every engine of a deployment; peers prove they know it.
        config: listening address and transfer behaviour.
        name: how peers call this engine (default its "host:port").
        rdma: the engine's RDMA device, if it uses one.
        regions: the engine's registered regions, for its own descriptor.
        region: the registered region with an id, or None (for serving connections).
        local_key: (address, lkey) of the RDMA-registered local memory holding a view.
    """

    def __init__(
        self,
        *,
        secret: bytes,
        config: EngineConfig,
        name: str | None,
        rdma: Verbs | None,
        regions: Callable[[], tuple[RegionDescriptor, ...]],
        region: Callable[[int], Region | None],
        local_key: Callable[[memoryview], tuple[int, int]],
    ) -> None:
        self.secret, self.config = secret, config
        self._rdma, self._regions, self._region, self._local_key = rdma, regions, region, local_key
        self._handlers: dict[str, Handler] = {
            "describe": lambda _args: self._describe_self(),
            "rdma_connect": self._accept_rdma,
        }
        self._queue_pairs: list[QueuePair] = []  # accepted from peers, oldest first, closed with the engine
        self._peers: dict[str, _Peer] = {}
        self._closed = False
        self._lock = threading.Lock()
        self.staging = StagingPool(config.max_staging_bytes)
        self.host_id = host_id()
        self.incarnation = new_incarnation()  # told in every handshake: peers notice when this engine restarts
        self._listener = Listener(
            secret=secret,
            config=config,
            serve=lambda sock, agreement: tcp.serve_connection(sock, self, agreement),
            name="engine",
            incarnation=self.incarnation,
        )
        self.host, self.port = self._listener.host, self._listener.port
        self.name = name or f"{self.host}:{self.port}"

    # ------------------------------------------------------------------ the peers we dial

    def connect(self, address: str, *, transport: str | None = None) -> str:
        """Authenticate to the engine at "host:port", learn its regions, build its transports.

        Connecting to a peer that is connected already and finding the same engine incarnation there, to be
        reached over the same transports, keeps that peer: its descriptor is refreshed (as `refresh`), the new
        control connection is closed, and its transports, with every transfer moving on them, are left alone, so
        connecting twice (two components each making sure) is harmless. Another incarnation (the peer restarted),
        another set of transports (`transport` forcing another, or no longer forcing one), or an RDMA queue
        pair that broke builds new transports and closes the old ones: transfers still moving on them fail with
        `PeerUnavailable`.

        Returns:
            The peer's key: the address dialled.

        Raises:
            ConfigError: not "host:port", or the peer reads frames smaller than this engine's `slice_bytes` (its
                `max_frame_bytes` named: every slice would be refused). TransferError: `close` came first, or the
                peer's descriptor is malformed, or refused or malformed its RDMA endpoint (`ProtocolError`, naming
                the peer); the queue pair made for it is closed.
            PeerUnavailable: the peer cannot be reached, or dropped or stalled the connection before it described
                itself (or before its transports were set up).
        """
        require_str("address", address, what='peer address ("host:port")')
        host, _, port_text = address.rpartition(":")
        if not host or _PORT.fullmatch(port_text) is None or not 0 < int(port_text) < 65536:
            raise ConfigError(f"a peer address is host:port (a TCP port, 1 to 65535), got {shown(address)}")
        port = int(port_text)
        key = f"{host}:{port}"
        if self._closed:
            raise TransferError(f"{self.name} is closed: no peer is kept")
        control, incarnation = tcp.open_connection(host, port, secret=self.secret, config=self.config)
        transports: dict[str, Transport] = {}
        kept: _Peer | None = None
        try:
            try:
                descriptor = PeerDescriptor.from_json(
                    tcp.call(control, "describe", None, timeout_s=self.config.io_timeout_s)
                )
                frame = descriptor.max_frame_bytes
                if frame is not None and frame < self.config.slice_bytes:
                    raise ConfigError(
                        f"{key} reads frames of at most {frame} bytes (its max_frame_bytes), this engine sends slices"
                        f" of {self.config.slice_bytes} (slice_bytes): set slice_bytes <= {frame} on this engine"
                    )
                kept = self._connected(key, incarnation, self._usable(descriptor, transport))
                if kept is None:
                    transports = self._transports_for(host, port, key, descriptor, transport, control, incarnation)
            except OSError as error:  # (a timeout among them) the peer died or went silent mid-handshake
                raise PeerUnavailable(f"{key} dropped the connection before it was set up: {error!r}") from error
        except BaseException:
            for built in transports.values():
                built.close()
            control.close()
            raise
        if kept is not None:  # connected to this very engine already: nothing of it is replaced
            control.close()
            self._keep_descriptor(kept, descriptor)
            return key
        peer = _Peer(host, port, descriptor, incarnation, transports, control)
        with self._lock:
            closed = self._closed  # under close()'s lock: a connect racing it keeps nothing
            old = None
            if not closed:
                # Another connect to the same engine may have been kept since the check above (two threads each
                # making sure they are connected): the first one stays, this one's transports go.
                kept = self._connected(key, incarnation, tuple(transports), locked=True)
                if kept is None:
                    old = self._peers.pop(key, None)
                    self._peers[key] = peer
        if closed:
            _close_peer(peer)
            raise TransferError(f"{self.name} is closed: no peer is kept")
        if kept is not None:
            _close_peer(peer)
            self._keep_descriptor(kept, descriptor)
        if old is not None:
            _close_peer(old)
        return key

    def _connected(self, key: str, incarnation: bytes, names: tuple[str, ...], *, locked: bool = False) -> _Peer | None:
        """The peer kept under `key` if a new connection to it would change nothing: it reached the same engine
        `incarnation`, has the transports `names` (in order), and none of them is broken for good (an RDMA queue
        pair that failed stays down: connecting again is how it is rebuilt)."""
        if locked:
            state = self._peers.get(key)
        else:
            with self._lock:
                state = self._peers.get(key)
        if state is None or state.incarnation != incarnation or tuple(state.transports) != names:
            return None
        for built in state.transports.values():
            if isinstance(built, RdmaTransport) and built.is_broken:
                return None
        return state

    def _keep_descriptor(self, state: _Peer, descriptor: PeerDescriptor) -> None:
        """Install `descriptor`, fresh from `state`'s peer, and let go of the shm segments it no longer lists."""
        state.descriptor = descriptor
        shm = state.transports.get("shm")
        if isinstance(shm, ShmTransport):  # segments the peer no longer lists were unregistered: unmap them
            shm.retain({region.shm_name for region in descriptor.regions if region.shm_name is not None})

    def disconnect(self, peer: str) -> None:
        """Forget `peer`: close its transports (their threads end; slices in flight or queued to it fail with
        `PeerUnavailable`) and its control connection. `connect` to it again to use it.

        Raises:
            ConfigError: `peer` is not a string.
            TransferError: `peer` is not a connected peer (never connected, or disconnected already).
        """
        require_str("peer", peer, what='peer key (the "host:port" connect returned)')
        with self._lock:
            state = self._peers.pop(peer, None)
        if state is None:
            raise TransferError(f"unknown peer {shown(peer)}: not connected (or disconnected already)")
        _close_peer(state)

    def descriptor(self, peer: str) -> PeerDescriptor:
        """`peer`'s descriptor as of the last handshake or refresh."""
        return self._peer(peer).descriptor

    def refresh(self, peer: str) -> PeerDescriptor:
        """Fetch and keep `peer`'s current descriptor.

        Raises:
            PeerUnavailable: as `call`; a peer restarted since `connect` among them (`connect` to it again).
        """
        state = self._peer(peer)
        descriptor = PeerDescriptor.from_json(self.call(peer, "describe", None))
        self._keep_descriptor(state, descriptor)
        return descriptor

    def transport_names(self, peer: str) -> tuple[str, ...]:
        return tuple(self._peer(peer).transports)

    def transport_for(self, peer: str, region_id: int) -> Transport:
        """The first of `peer`'s transports that reaches its region `region_id`.

        Raises:
            TransferError: `peer` is unknown, or none of its transports reaches the region.
        """
        state = self._peer(peer)
        remote = self.remote_region(peer, region_id)
        for name, candidate in state.transports.items():
            if name == "shm" and (remote is None or remote.shm_name is None):
                continue  # shm reaches shared regions only
            if name == "rdma" and (remote is None or remote.rdma_address is None):
                continue  # and rdma registered ones
            return candidate
        raise TransferError(f"no transport reaches region {region_id} of {peer}")

    def call(self, peer: str, method: str, args: object) -> Json:
        """Run `method` on `peer` over its control connection, reconnected once if it provably did not get the call.

        The calls to one peer share its control connection, one at a time: a call waits for those ahead of it for
        at most `io_timeout_s`, then is refused unsent. So a call ends within about `io_timeout_s` (its wait for
        the connection) + `connect_timeout_s` (dialling a fresh one, twice if the first provably lost the call)
        + `io_timeout_s` (the reply), however many calls to the peer other threads make.

        Raises:
            PeerUnavailable: the peer cannot be reached, the call failed midway, or the peer restarted since
                `connect` (another incarnation answers: `connect` to it again).
            TransferTimeout: the calls ahead of it held the control connection for `io_timeout_s` (nothing sent).
        """
        state = self._peer(peer)
        if not state.control_lock.acquire(timeout=self.config.io_timeout_s):
            raise TransferTimeout(
                f"{peer}: the control call {shown(method, quote=str)} waited {self.config.io_timeout_s}s (io_timeout_s) behind other"
                " control calls to it, which share its control connection, and was not sent"
            )
        try:
            for attempt in range(2):
                if state.control is None:
                    if state.closed:  # disconnected since `_peer`: a connection opened now would be kept by no one
                        raise PeerUnavailable(f"{peer} was disconnected")
                    state.control = tcp.connect(
                        state.host, state.port, secret=self.secret, config=self.config, incarnation=state.incarnation
                    )
                try:
                    return tcp.call(state.control, method, args, timeout_s=self.config.io_timeout_s)
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
                    raise PeerUnavailable(
                        f"{peer}: the control call {shown(method, quote=str)} failed midway: {error}"
                    ) from error
        finally:
            state.control_lock.release()
        raise AssertionError("unreachable")  # pragma: no cover

    # ------------------------------------------------------------------ the peers that dial us

    def register_handler(self, method: str, handler: Handler) -> None:
        """Serve control calls named `method` with `handler`.

        Raises:
            ConfigError: `method` is not a non-empty string, or `handler` is not callable.
        """
        require_str("method", method)
        if not callable(handler):
            raise ConfigError(f"handler must be callable, got {shown(handler)}")
        self._handlers[method] = handler

    def handle_call(self, method: str, args: Any) -> Json:
        handler = self._handlers.get(method)
        if handler is None:
            raise TransferError(f"no handler for {shown(method)}")
        return handler(args)

    def region(self, region_id: int) -> Region | None:
        """The registered local region `region_id` (what a serving connection reads and writes)."""
        return self._region(region_id)

    # ------------------------------------------------------------------ lifecycle

    @property
    def listener(self) -> Listener:
        """Where peers connect: its counts of pending and served connections."""
        return self._listener

    def close(self) -> None:
        """Stop listening; close every peer's transports and every served connection.

        The queue pairs accepted from peers close in `close_queue_pairs` (before their device).
        """
        with self._lock:
            self._closed = True
            peers = list(self._peers.values())
            self._peers.clear()
        self._listener.close()
        for peer in peers:
            _close_peer(peer)

    def close_queue_pairs(self) -> None:
        """Close the queue pairs accepted from peers (before their device closes)."""
        with self._lock:
            queue_pairs, self._queue_pairs = self._queue_pairs, []
        for queue_pair in queue_pairs:
            queue_pair.close()

    # ------------------------------------------------------------------ internals

    def _peer(self, name: str) -> _Peer:
        with self._lock:
            peer = self._peers.get(name)
        if peer is None:
            raise TransferError(f"unknown peer {shown(name)}: connect() to it first")
        return peer

    def remote_region(self, peer: str, region_id: int) -> RegionDescriptor | None:
        """`peer`'s region `region_id` as of the last handshake or refresh, or None if it did not list it."""
        state = self._peer(peer)
        for descriptor in state.descriptor.regions:
            if descriptor.region_id == region_id:
                return descriptor
        return None

    def _describe_self(self) -> Json:
        own = PeerDescriptor(
            name=self.name,
            host_id=self.host_id,
            pid=os.getpid(),
            regions=self._regions(),
            rdma=self._rdma is not None,
            max_frame_bytes=self.config.max_frame_bytes,
        )
        return own.to_json()

    def _accept_rdma(self, endpoint: Any) -> Json:
        """The peer side of an RDMA connection: a queue pair connected to the caller's.

        At most `max_connections` accepted queue pairs live at once; past it the
        oldest is closed (its initiator's transport fails with PeerUnavailable), so
        peers that reconnect, or one that floods "rdma_connect", cannot use up the
        device for good.
        """
        if self._rdma is None:
            raise TransferError("this engine has no RDMA device")
        queue_pair = self._rdma.create_queue_pair()
        try:
            queue_pair.connect(check_endpoint(endpoint, sender="the caller of rdma_connect"))
        except BaseException:
            queue_pair.close()
            raise
        with self._lock:
            self._queue_pairs.append(queue_pair)
            evicted = self._queue_pairs[: -self.config.max_connections]
            del self._queue_pairs[: -self.config.max_connections]
        for old in evicted:
            old.close()
        return queue_pair.endpoint()

    @property
    def num_queue_pairs(self) -> int:
        """Queue pairs accepted from peers and still open."""
        with self._lock:
            return len(self._queue_pairs)

    def _transports_for(
        self,
        host: str,
        port: int,
        peer_name: str,
        descriptor: PeerDescriptor,
        forced: str | None,
        control: socket.socket,
        incarnation: bytes,
    ) -> dict[str, Transport]:
        allowed = (forced,) if forced else self.config.transports
        transports: dict[str, Transport] = {}

        def describe(region_id: int) -> RegionDescriptor | None:
            return self.remote_region(peer_name, region_id)

        try:
            for name in self._usable(descriptor, forced):
                if name == "shm":
                    transports["shm"] = ShmTransport(
                        describe, peer_pid=descriptor.pid, workers=self.config.streams_per_peer, peer=peer_name
                    )
                elif name == "rdma" and self._rdma is not None:
                    queue_pair = self._rdma.create_queue_pair()
                    try:  # until the transport holds it, the queue pair is closed here on any failure
                        remote = tcp.call(
                            control, "rdma_connect", queue_pair.endpoint(), timeout_s=self.config.io_timeout_s
                        )
                        queue_pair.connect(check_endpoint(remote, sender=peer_name))
                        transports["rdma"] = RdmaTransport(
                            queue_pair, local_key=self._local_key, describe=describe, config=self.config
                        )
                    except BaseException:
                        queue_pair.close()
                        raise
                elif name == "tcp":
                    transports["tcp"] = tcp.TcpTransport(
                        host, port, secret=self.secret, config=self.config, incarnation=incarnation
                    )
        except BaseException:
            for built in transports.values():
                built.close()
            raise
        if not transports or (forced and forced not in transports):
            for built in transports.values():
                built.close()
            raise ConfigError(f"no usable transport to {peer_name} among {allowed}")
        return transports

    def _usable(self, descriptor: PeerDescriptor, forced: str | None) -> tuple[str, ...]:
        """The transports `connect` builds to the peer `descriptor` describes, in preference order: shm to a peer
        that shares this host's shared memory, rdma where both ends have a device, tcp always."""
        allowed = (forced,) if forced else self.config.transports
        return tuple(
            name
            for name in allowed
            if name == "tcp"
            or (name == "shm" and descriptor.host_id == self.host_id)
            or (name == "rdma" and self._rdma is not None and descriptor.rdma)
        )


def _checked_region(data: Any, peer_pid: int) -> RegionDescriptor:
    """A peer's region descriptor, refused unless every field is plausible: the
    initiator trusts it for shm and RDMA bounds. Shared segments must be mooncake
    segments of the peer's own process (by name), so a peer cannot point our
    copies at another program's shared memory. (Authenticated peers are trusted
    with every region registered in the deployment: that is what the secret grants.)"""
    descriptor = RegionDescriptor.from_json(data)
    for name, optional in (("region_id", False), ("length", False), ("rdma_address", True), ("rdma_rkey", True)):
        value = getattr(descriptor, name)
        # Only a region's ways to reach it may be absent: its id and length are what every bounds check reads.
        if not (optional and value is None) and (type(value) is not int or not 0 <= value < 2**64):
            raise TransferError(f"malformed segment descriptor: {name}={shown(value)}")
    if descriptor.shm_name is not None:
        shm_name = descriptor.shm_name
        match = _SHM_NAME.fullmatch(shm_name) if type(shm_name) is str else None
        if match is None or int(match.group(1)) != peer_pid:
            raise TransferError(f"malformed segment descriptor: shm_name={shown(descriptor.shm_name)}")
    return descriptor


def _close_peer(peer: _Peer) -> None:
    """Close `peer`'s transports and control connection. A call in flight on the control connection (it holds the
    control lock, so it is not taken here) fails at once: the connection is shut down under it."""
    peer.closed = True
    for transport in peer.transports.values():
        transport.close()
    control = peer.control
    if control is not None:
        with contextlib.suppress(OSError):
            control.shutdown(socket.SHUT_RDWR)
        control.close()
