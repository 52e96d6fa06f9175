"""The TCP transport: authenticated connections, several streams per peer, zero-copy I/O.

Client side (`TcpTransport`): `streams` worker threads per peer, each owning one
persistent connection and taking slices from a shared queue, so the slices of a
large request travel over several connections at once. A WRITE sends the header
and then the payload straight from the registered region (`sendall` of a
memoryview); a READ receives straight into it (`recv_into`). A slice is done
only when the peer has acknowledged it (WRITE) or every byte has arrived and,
with checksums on, verified (READ). The answer's header, and a READ's payload,
are each due within `io_timeout_s` (a peer sending a byte at a time cannot hold
a slice). A connection that drops or times out is replaced and the slice
retried, `max_retries` times (a kept connection is checked before each slice: one the peer
closed while it idled, at its `idle_timeout_s`, is replaced without spending a
retry); a peer that cannot be reached fails the slice
with `PeerUnavailable`, and one whose dial timed out (a stopped or unreachable
peer) is taken for down for `connect_timeout_s`: the slices that meet it then
fail at once with that error rather than each waiting out a connect timeout of
its own (a batch to a stopped peer ends within its slices' bound,
`EngineConfig.slice_deadline_s`), and the first one after it dials again. A peer restarted at its address fails its slices with
`PeerUnavailable` too: every
connection checks the incarnation id the server tells in its handshake
against the one the peer had when the engine connected to it (a new engine's
region ids start again at 1: a WRITE meant for the old one would land in an
unrelated region of the new one). A slice run inline with a deadline connects
(and authenticates) by that deadline too: cut short, it is a
`TransferTimeout`. `close` shuts every connection down first: a slice in
flight fails at once and is not retried, so no byte lands after `close`.

With `checksums` on, the client says so in each connection's handshake
(`wire.Agreement`): then a READ answered without a checksum is a
`ProtocolError` (never taken unverified), and the serving side refuses a
WRITE that comes without one and answers every READ with one. A checksum is
bound to its request's header (`wire.bind_checksum`), so a WRITE whose
region, offset, length or tag changed on the way is refused, and a READ
served for other ones fails its check. A WRITE is acknowledged by an OK that
carries nothing: any other OK (the answer to a READ its WRITE was corrupted
into, say) is a `ProtocolError`, never taken as the acknowledgement.

Server side (`serve_connection`): one thread per authenticated connection
(the `listener` authenticates) serves frames, checking every region, offset
and length against the registered bounds before touching memory. Between
frames a connection may idle (`idle_timeout_s`); once a frame has started, its
header must be complete within `io_timeout_s` of its first byte and its
payload within `io_timeout_s` of the header, so a peer cannot hold a thread
with half a frame. A WRITE that carries a checksum is received into staging
memory, verified there, and only then copied into the region: a payload that
fails its checksum leaves the region as it was, and so does one whose region
was unregistered, or whose engine began closing, while it arrived (the
listener's `close` waits for a copy already under way). Small payloads (up to 64 KiB)
are staged in a buffer of the connection's own (beside its socket buffers of
megabytes, and free of the pool's lock), larger ones in the engine's
`staging.StagingPool`. A
WRITE without a checksum is received straight into the region (no copy; a
dropped connection may leave part of it there, which the retry overwrites).
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time
from typing import Any, Protocol

import attrs
import numpy as np
import xxhash

from mooncake import _json
from mooncake._checks import shown
from mooncake.errors import AuthenticationError, ConfigError, PeerUnavailable, TransferError, TransferTimeout
from mooncake.transfer.region import Region
from mooncake.transfer.request import EngineConfig, Slice, TransferOp
from mooncake.transfer.staging import StagingPool
from mooncake.transfer.wire import (
    MAX_CONTROL_BYTES,
    Agreement,
    Frame,
    Json,
    Kind,
    ProtocolError,
    bind_checksum,
    client_handshake,
    recv_exact,
    recv_frame,
    send_frame,
)
from mooncake.transfer.workers import Workers

__all__ = ["CallNotSent", "ServerContext", "TcpTransport", "call", "connect", "open_connection", "serve_connection"]

_DRAIN_CHUNK = 1 << 20
_SMALL_FRAME_BYTES = 64 << 10  # staged in the connection's own buffer
_MAX_REFUSAL_BYTES = 4096  # of the reason an ERROR frame gives: what a server sends, and a client reads, at most


def _checksum(request: Frame, payload: memoryview | bytes) -> int:
    """The checksum of `payload` as a data frame of `request` carries it (`wire.bind_checksum`)."""
    return bind_checksum(request, xxhash.xxh3_64_intdigest(payload))


def spin_until_readable(sock: socket.socket, budget_s: float) -> None:
    """Poll `sock` for up to `budget_s` before the caller blocks on it.

    A blocked thread pays a wake-up (tens of microseconds on a busy machine) when
    its answer arrives; a thread that is still polling does not. Spending a few
    hundred microseconds of CPU per request halves small-transfer latency.
    """
    if budget_s <= 0:
        return
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    deadline = time.perf_counter() + budget_s
    while not poller.poll(0) and time.perf_counter() < deadline:
        pass


def open_connection(
    host: str, port: int, *, secret: bytes, config: EngineConfig, deadline: float | None = None
) -> tuple[socket.socket, bytes]:
    """An authenticated connection to a peer engine, and the incarnation id of the engine that answered.

    Connecting and the whole handshake end within `config.connect_timeout_s`, and by `deadline`
    (time.monotonic) if one is given. The handshake tells the server whether `config.checksums` is on.

    Raises:
        PeerUnavailable: nothing accepts connections there, or it did not authenticate within
            `connect_timeout_s`, or it dropped the connection.
        TransferTimeout: `deadline` came before `connect_timeout_s` would have, and cut the attempt short.
        AuthenticationError: the secrets differ.
    """
    start = time.monotonic()
    end = start + config.connect_timeout_s
    cut = deadline is not None and deadline < end  # the caller's deadline, not ours, bounds this attempt
    if deadline is not None:
        end = min(end, deadline)
    if end <= start:
        raise TransferTimeout(f"{host}:{port}: the deadline passed before connecting")
    try:
        sock = socket.create_connection((host, port), timeout=end - start)
    except TimeoutError as error:
        raise _connect_timed_out(host, port, config, cut=cut, doing="connect") from error
    except OSError as error:
        raise PeerUnavailable(f"cannot connect to {host}:{port}: {error}") from error
    try:
        _tune(sock, config)
        # One deadline for the whole handshake: a server cannot stall us a byte at a time.
        incarnation = client_handshake(sock, secret, deadline=end, checksums=config.checksums)
        sock.settimeout(config.io_timeout_s)
    except TimeoutError as error:
        sock.close()
        raise _connect_timed_out(host, port, config, cut=cut, doing="authenticate") from error
    except (OSError, ConnectionError) as error:
        sock.close()
        raise PeerUnavailable(f"{host}:{port} dropped the connection during authentication: {error}") from error
    except BaseException:
        sock.close()
        raise
    return sock, incarnation


def _connect_timed_out(host: str, port: int, config: EngineConfig, *, cut: bool, doing: str) -> TransferError:
    """The error of a connection attempt that ran out of time while it did `doing` (connect, authenticate): the
    caller's deadline's, or the peer's fault."""
    if cut:
        return TransferTimeout(f"{host}:{port}: connecting and authenticating did not finish by the deadline")
    return PeerUnavailable(f"{host}:{port} did not {doing} within {config.connect_timeout_s}s")


def connect(
    host: str,
    port: int,
    *,
    secret: bytes,
    config: EngineConfig,
    incarnation: bytes | None = None,
    deadline: float | None = None,
) -> socket.socket:
    """An authenticated connection to a peer engine (`open_connection`), to the engine `incarnation` if given.

    Args:
        incarnation: the incarnation id the peer had when this engine connected to it: another engine answering
            there (the peer restarted since) is refused.

    Raises:
        PeerUnavailable: as `open_connection`, or another incarnation of the peer answers (a restarted peer's
            regions are not the ones this engine knows of it: `connect()` to it again).
        TransferTimeout: `deadline` cut the attempt short.
        AuthenticationError: the secrets differ.
    """
    sock, answered = open_connection(host, port, secret=secret, config=config, deadline=deadline)
    if incarnation is not None and answered != incarnation:
        sock.close()
        raise PeerUnavailable(
            f"{host}:{port} restarted: another engine answers there than the one this engine connected to, and its"
            " regions are not the ones described; connect() to it again"
        )
    return sock


class CallNotSent(ConnectionError):
    """A control call failed before its request was sent (safe to retry)."""


def _tune(sock: socket.socket, config: EngineConfig) -> None:
    """No Nagle delay (small frames answer at once), and buffers big enough for a slice in flight."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if config.socket_buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, config.socket_buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, config.socket_buffer_bytes)


def call(sock: socket.socket, method: str, args: object, *, timeout_s: float | None = None) -> Json:
    """One control call on an authenticated connection: JSON in, JSON out.

    `args` is any value `json.dumps` encodes; the result is the decoded reply. The reply's header, then its body,
    are each due within `timeout_s` (by default the socket's timeout when the call began; an engine passes its
    `io_timeout_s`), and the socket keeps that timeout afterwards: every call on a connection gets the whole
    budget, however long the previous one took.

    Raises:
        CallNotSent: the connection failed while sending, or the peer had closed it (the peer did not get the
            call).
        ConfigError: `args` is not JSON-encodable (nothing is sent).
        TransferError: the peer reported an error.
        OSError: the connection failed after the call was sent (it may have run).
    """
    try:
        payload = json.dumps({"method": method, "args": args}).encode()
    # An object JSON has no form for, a cycle, an int past 4,300 digits (ValueError), or nesting past the encoder's
    # depth (RecursionError).
    except (TypeError, ValueError, RecursionError) as error:
        raise ConfigError(
            f"the args of control call {shown(method)} must be JSON-encodable, got {shown(args)}: {error}"
        ) from None
    if len(payload) > MAX_CONTROL_BYTES:
        raise TransferError(
            f"control call {shown(method, quote=str)} of {len(payload)} bytes exceeds {MAX_CONTROL_BYTES}"
        )
    if _has_unasked_input(sock):
        # The peer closed this connection (it went away, or restarted) while it was idle: nothing is sent on it.
        raise CallNotSent("the peer closed the connection (or sent what no call asked for) while it was idle")
    # Taken once, and put back at the end: `recv_exact` leaves the socket at what was left of its deadline, and a
    # budget read back from the socket would shrink with every call (a call the peer ran, reported failed).
    timeout = sock.gettimeout() if timeout_s is None else timeout_s
    try:
        sock.settimeout(timeout)
        try:
            send_frame(sock, Frame(Kind.CALL, length=len(payload)), payload)
        except OSError as error:
            raise CallNotSent(str(error)) from error
        # A reply is a control payload: bounded as one, and its kind checked before its body is read. The header,
        # then the body, are each due within the timeout (a peer answering a byte at a time cannot hold the call).
        reply = recv_frame(sock, max_length=MAX_CONTROL_BYTES, deadline=_within(timeout))
        if reply.kind not in (Kind.REPLY, Kind.ERROR) or reply.tag != 0:
            raise ProtocolError(
                f"expected a REPLY to {shown(method, quote=str)}, got {reply.kind.name} (tag {reply.tag})"
            )
        body = bytearray(reply.length)
        recv_exact(sock, memoryview(body), deadline=_within(timeout))
    finally:
        with contextlib.suppress(OSError):  # closed meanwhile: nothing to put back
            sock.settimeout(timeout)
    if reply.kind == Kind.ERROR:
        raise TransferError(f"peer refused {shown(method, quote=str)}: {_refusal_text(body)}")
    try:
        decoded: Json = _json.loads(body)
    except ValueError as error:  # malformed, or nested too deep
        raise ProtocolError(f"the REPLY to {shown(method, quote=str)} is not JSON: {error}") from error
    return decoded


def _has_unasked_input(sock: socket.socket) -> bool:
    """Whether `sock`, with no call outstanding, has something to read: an end of stream, or bytes no call asked
    for. (poll, not select: a process serving many connections has descriptors past select's 1024.)"""
    poller = select.poll()
    try:
        poller.register(sock, select.POLLIN)
    except (OSError, ValueError):  # closed here: nothing can be sent on it either
        return True
    return bool(poller.poll(0))


def _within(timeout_s: float | None, deadline: float | None = None) -> float | None:
    """The deadline (time.monotonic) of a wait of at most `timeout_s` that must also end by `deadline`."""
    if timeout_s is None:
        return deadline
    end = time.monotonic() + timeout_s
    return end if deadline is None else min(end, deadline)


class TcpTransport:
    """Slices to and from one peer over `config.streams_per_peer` connections.

    `incarnation` is the peer's incarnation id when the engine connected to it (None: whichever engine answers):
    a connection that reaches another (the peer restarted) is refused, and the slice fails with `PeerUnavailable`.
    `close` shuts down every connection the transport holds before it joins the workers, so a slice in flight
    fails at once, and no worker retries, reconnects or writes into a region once the transport is closed: a
    slice reported failed never lands later.
    """

    name = "tcp"

    def __init__(
        self, host: str, port: int, *, secret: bytes, config: EngineConfig, incarnation: bytes | None = None
    ) -> None:
        self._host, self._port, self._secret, self._config = host, port, secret, config
        self._incarnation = incarnation
        self._closing = False
        self._open: set[socket.socket] = set()  # every connection a worker or the inline path holds
        self._open_lock = threading.Lock()
        # Small batches run in the caller's thread over a connection of their own.
        self._inline_lock = threading.Lock()
        self._inline_sock: socket.socket | None = None
        self._tag = 0
        # The last fresh connection's failure, and until when (time.monotonic) it stands for the peer: see `_connect`.
        self._down: PeerUnavailable | None = None
        self._down_until = 0.0
        self._workers = Workers(
            self._stream,
            count=config.streams_per_peer,
            name=f"tcp-{host}:{port}",
            closed_message=f"transport to {host}:{port} is closed",
            join_timeout_s=config.io_timeout_s,
        )

    def submit(self, piece: Slice) -> None:
        self._workers.submit(piece)

    def run_inline(self, piece: Slice, *, deadline: float | None = None) -> TransferError | None:
        """Move `piece` now, in the calling thread (no hand-off: the latency path).

        `deadline` (time.monotonic) stops retries once passed and caps each socket wait, connecting (and
        authenticating) included, and the wait for another thread's inline slice to this peer (it holds the one
        inline connection): past it, `TransferTimeout`.
        """
        wait_s = -1.0 if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._inline_lock.acquire(timeout=wait_s):
            return TransferTimeout(f"not started by its deadline: another inline slice to {self._host}:{self._port}")
        try:
            if self._workers.is_closed:
                return self._workers.closed_error()
            try:
                self._inline_sock, error = self._move(self._inline_sock, piece, deadline=deadline)
            except Exception as unexpected:
                if self._inline_sock is not None:
                    self._drop(self._inline_sock)
                self._inline_sock, error = None, TransferError(f"{self._where(piece)}: slice failed: {unexpected!r}")
            return error
        finally:
            self._inline_lock.release()

    def close(self) -> None:
        with self._open_lock:
            self._closing = True
            for sock in self._open:  # a blocked send or receive fails now, and its worker stops (below)
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already closed by its peer
        self._workers.close()
        with self._inline_lock:
            if self._inline_sock is not None:
                self._drop(self._inline_sock)
                self._inline_sock = None

    def _connect(self, deadline: float | None = None) -> socket.socket:
        """A new connection to the peer's incarnation, made by `deadline` if given, held in `_open` (refused once
        the transport is closing).

        A connection that fails with `PeerUnavailable` after spending the whole `connect_timeout_s` (not connected
        or authenticated in time: a stopped or unreachable peer) marks the peer down for `connect_timeout_s`:
        until then every connection asked for fails at once with that error, undialled. Otherwise each slice
        queued to such a peer would wait out a connect timeout of its own, one after another, and a batch would
        end long after its slices' bound (`EngineConfig.slice_deadline_s`); after the window the next slice dials
        again (the peer may be back). A quick failure (refused, reset, busy, restarted) marks nothing: it costs
        each slice no wait, and the next dial may find a peer restarting meanwhile, and say so.
        """
        with self._open_lock:
            down, down_until = self._down, self._down_until
        if down is not None and time.monotonic() < down_until:
            raise PeerUnavailable(
                f"{down} (within {self._config.connect_timeout_s:g} s of that failure: not dialled again yet)"
            )
        dialled = time.monotonic()
        try:
            sock = connect(
                self._host,
                self._port,
                secret=self._secret,
                config=self._config,
                incarnation=self._incarnation,
                deadline=deadline,
            )
        except PeerUnavailable as error:
            failed = time.monotonic()
            if failed - dialled >= self._config.connect_timeout_s:  # timed out: the peer stopped or is unreachable
                with self._open_lock:
                    self._down, self._down_until = error, failed + self._config.connect_timeout_s
            raise
        with self._open_lock:
            self._down = None  # reached: whatever failed before does not stand for the peer any more
            if not self._closing:
                self._open.add(sock)
                return sock
        sock.close()
        raise self._workers.closed_error()

    def _where(self, piece: Slice) -> str:
        """The peer and the place a slice goes to or comes from, for its errors."""
        return f"{self._host}:{self._port} region {piece.remote_region} offset {piece.remote_offset}"

    def _drop(self, sock: socket.socket) -> None:
        with self._open_lock:
            self._open.discard(sock)
        sock.close()

    # ------------------------------------------------------------------ one stream

    def _stream(self, workers: Workers) -> None:
        sock: socket.socket | None = None
        try:
            # Connect now, so that the first slices do not pay for the handshake.
            sock = self._connect()
        except TransferError:
            sock = None  # retried when the first slice comes
        try:
            while (piece := workers.take()) is not None:
                if workers.is_closed:
                    piece.on_done(workers.closed_error())
                    continue
                try:
                    sock, error = self._move(sock, piece)
                except Exception as unexpected:  # a worker must never die with a slice unanswered
                    if sock is not None:
                        self._drop(sock)
                    sock, error = None, TransferError(f"{self._where(piece)}: slice failed: {unexpected!r}")
                piece.on_done(error)
        finally:
            if sock is not None:
                self._drop(sock)

    def _move(
        self, sock: socket.socket | None, piece: Slice, *, deadline: float | None = None
    ) -> tuple[socket.socket | None, TransferError | None]:
        """Move one slice, reconnecting and retrying on a dropped connection (until `deadline`; never once the
        transport is closing: a slice it answers as failed does not land later)."""
        last: TransferError | None = None
        for attempt in range(self._config.max_retries + 1):
            if deadline is not None and attempt and time.monotonic() >= deadline:
                break
            if self._closing:
                last = self._workers.closed_error()
                break
            try:
                if sock is not None and _has_unasked_input(sock):
                    # A reused connection the peer closed while it idled (its idle_timeout_s), or on which it sent
                    # what no slice asked for: nothing was sent on it yet, so a fresh one costs no attempt.
                    self._drop(sock)
                    sock = None
                if sock is None:
                    sock = self._connect(deadline)
                timeout = self._config.io_timeout_s
                if deadline is not None:
                    timeout = max(0.001, min(timeout, deadline - time.monotonic()))
                sock.settimeout(timeout)
                self._exchange(sock, piece, deadline=deadline)
                return sock, None
            except (PeerUnavailable, AuthenticationError, TransferTimeout) as error:
                # A fresh connection failed (or the deadline cut it: raised by connecting alone): no point retrying.
                return None, error
            except ProtocolError as error:
                # Named here, where the peer and the slice are known (a bad header, a checksum or size mismatch).
                last = ProtocolError(f"{self._where(piece)}: {error}")
                last.__cause__ = error
            except TimeoutError as error:
                last = TransferTimeout(f"{self._host}:{self._port} timed out after {self._config.io_timeout_s}s")
                last.__cause__ = error
            except OSError as error:
                last = PeerUnavailable(f"connection to {self._host}:{self._port} dropped: {error}")
            except TransferError as error:  # the peer refused this slice (bounds, checksum): final
                return sock, error
            if sock is not None:
                self._drop(sock)
                sock = None
            if self._closing:  # `close` shut the connection down: the slice ends here, unmoved, not retried
                return None, self._workers.closed_error()
        if sock is not None:
            self._drop(sock)
        return None, last

    def _exchange(self, sock: socket.socket, piece: Slice, *, deadline: float | None = None) -> None:
        """One slice on `sock`: its header (and a WRITE's payload) out, then the reply's header and a READ's
        payload each due within the io timeout (and by `deadline`), whatever pace the peer sends at."""
        self._tag = (self._tag + 1) & 0xFFFFFFFFFFFFFFFF
        tag = self._tag
        length = piece.local.nbytes
        if piece.op == TransferOp.WRITE:
            header = Frame(Kind.WRITE, tag=tag, region=piece.remote_region, offset=piece.remote_offset, length=length)
            if self._config.checksums:
                header = attrs.evolve(header, checksum=_checksum(header, piece.local))
            send_frame(sock, header, piece.local)
        else:
            wants_checksum = 0 if self._config.checksums else None
            header = Frame(
                Kind.READ,
                tag=tag,
                region=piece.remote_region,
                offset=piece.remote_offset,
                length=length,
                checksum=wants_checksum,
            )
            send_frame(sock, header)
        spin_until_readable(sock, self._config.spin_us / 1e6)
        io_timeout = self._config.io_timeout_s
        reply = recv_frame(sock, max_length=self._config.max_frame_bytes, deadline=_within(io_timeout, deadline))
        if reply.kind == Kind.ERROR:
            message = bytearray(reply.length)
            recv_exact(sock, memoryview(message), deadline=_within(io_timeout, deadline))
            raise TransferError(f"{self._where(piece)}: the peer refused: {_refusal_text(message)}")
        if reply.kind != Kind.OK:
            raise ProtocolError(f"expected OK, got {reply.kind.name}")
        if reply.tag != tag:
            raise ProtocolError(f"a reply for slice {reply.tag} came while waiting for {tag}")
        if piece.op == TransferOp.WRITE:
            if reply.length or reply.checksum is not None:
                # An OK with bytes answers a READ (a WRITE whose kind was corrupted on the way, say): it does not
                # say that this WRITE landed.
                raise ProtocolError(
                    f"a WRITE's acknowledgement carries nothing; got one of {reply.length} bytes"
                    f"{'' if reply.checksum is None else ' with a checksum'}"
                )
        else:
            if reply.length != length:
                raise ProtocolError(f"asked for {length} bytes, the peer announced {reply.length}")
            if self._config.checksums and reply.checksum is None:
                # The connection agreed on checksums: an answer without one lost it on the way; its bytes are not
                # taken unverified (nor received into the region at all).
                raise ProtocolError("a READ reply came without the checksum its connection agreed on")
            recv_exact(sock, piece.local, deadline=_within(io_timeout, deadline))
            # Bound to the READ as sent here: bytes served for another region, offset or length fail it too.
            if reply.checksum is not None and _checksum(header, piece.local) != reply.checksum:
                raise ProtocolError("a READ slice failed its end-to-end checksum")


class ServerContext(Protocol):
    """What a serving connection needs from its engine."""

    config: EngineConfig
    staging: StagingPool

    def region(self, region_id: int) -> Region | None:
        """The registered region, or None (none once the engine has begun to close)."""

    def handle_call(self, method: str, args: Any) -> Json:
        """Run a control call (raise TransferError to refuse it)."""


def serve_connection(sock: socket.socket, context: ServerContext, agreement: Agreement | None = None) -> None:
    """Serve frames on an authenticated connection until the peer leaves, idles out or breaks the protocol.

    `agreement` is what the client settled in the handshake (None: nothing); with checksums agreed, a WRITE
    without one is refused (its payload drained, the region unchanged) and every READ is answered with one.
    Returns when the connection is done with (the caller closes it); failed I/O
    and protocol violations end it quietly, so the engine keeps serving others.
    """
    checksums = agreement is not None and agreement.checksums
    config = context.config
    try:
        _tune(sock, config)
        sock.settimeout(config.io_timeout_s)  # deadlines below shorten it only when they must
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        scratch = memoryview(bytearray(_SMALL_FRAME_BYTES))
        while True:
            if not _next_frame_starts(poller, spin_s=config.spin_us / 1e6, idle_s=config.idle_timeout_s):
                return  # idle for too long
            # The frame has started: the rest of its header is due within the io timeout.
            frame = recv_frame(sock, max_length=config.max_frame_bytes, deadline=time.monotonic() + config.io_timeout_s)
            if frame.kind == Kind.WRITE:
                _serve_write(sock, context, frame, scratch, checksums=checksums)
            elif frame.kind == Kind.READ:
                _serve_read(sock, context, frame, checksums=checksums)
            elif frame.kind == Kind.CALL:
                _serve_call(sock, context, frame)
            else:
                raise ProtocolError(f"a client may not send {frame.kind.name}")
    except (OSError, ConnectionError, TransferError):
        return  # the connection ends; the engine keeps serving others


def _next_frame_starts(poller: select.poll, *, spin_s: float, idle_s: float) -> bool:
    """Whether the connection has bytes (or an end of stream) to read within `idle_s`.

    Polls without blocking for `spin_s` first: the next request often follows at
    once, and a thread that is still polling does not pay a wake-up.
    """
    if spin_s > 0:
        deadline = time.perf_counter() + spin_s
        while time.perf_counter() < deadline:
            if poller.poll(0):
                return True
    return bool(poller.poll(idle_s * 1000))


def _payload_deadline(context: ServerContext) -> float:
    return time.monotonic() + context.config.io_timeout_s


def _reply(
    sock: socket.socket, context: ServerContext, frame: Frame, payload: bytes | memoryview | None = None
) -> None:
    """Send `frame` (and its payload) within the io timeout (a peer that never reads cannot hold us)."""
    if sock.gettimeout() != context.config.io_timeout_s:  # a deadline may have shortened it
        sock.settimeout(context.config.io_timeout_s)
    send_frame(sock, frame, payload)


def _refusal_text(message: bytes | bytearray) -> str:
    """The reason a peer's ERROR frame gives, cut to what an engine sends (a peer may send up to a frame's bound)."""
    return bytes(message[:_MAX_REFUSAL_BYTES]).decode(errors="replace")


def _refuse(sock: socket.socket, context: ServerContext, frame: Frame, reason: str) -> None:
    message = reason.encode()[:_MAX_REFUSAL_BYTES]
    _reply(sock, context, Frame(Kind.ERROR, tag=frame.tag, length=len(message)), message)


def _target(context: ServerContext, frame: Frame) -> tuple[memoryview | None, str]:
    region = context.region(frame.region)
    if region is None:
        return None, f"no region {frame.region}"
    try:
        return region.slice(frame.offset, frame.length), ""
    except TransferError as error:
        return None, str(error)


def _drain(sock: socket.socket, length: int, deadline: float) -> None:
    """Consume a payload without storing it, so the stream stays in step."""
    scratch = memoryview(bytearray(min(length, _DRAIN_CHUNK)))
    left = length
    while left:
        step = min(left, scratch.nbytes)
        recv_exact(sock, scratch[:step], deadline=deadline)
        left -= step


def _serve_write(
    sock: socket.socket, context: ServerContext, frame: Frame, scratch: memoryview, *, checksums: bool
) -> None:
    deadline = _payload_deadline(context)
    target, reason = _target(context, frame)
    if target is not None and checksums and frame.checksum is None:
        # Its checksum flag lost on the way: landing it unverified is what the client asked never to happen.
        target, reason = None, "a WRITE without the checksum its connection agreed on; the region is unchanged"
    if target is None:
        _drain(sock, frame.length, deadline)
        _refuse(sock, context, frame, reason)
        return
    if frame.checksum is None:
        recv_exact(sock, target, deadline=deadline)
        _reply(sock, context, Frame(Kind.OK, tag=frame.tag))
        return
    # Stage, verify, then copy: the region never holds bytes that failed their checksum.
    gone = ""
    if frame.length <= scratch.nbytes:
        staged = scratch[: frame.length]
        recv_exact(sock, staged, deadline=deadline)
        verified = _checksum(frame, staged) == frame.checksum
        if verified and not (gone := _gone(context, frame)):
            target[:] = staged
    else:
        # Half the io timeout for memory, so that the payload can still be drained in step (by a deadline of its
        # own) and the refusal reach the client, rather than the connection dropping like a dead peer's.
        wait_s = context.config.io_timeout_s / 2
        buffer = context.staging.try_allocate(frame.length, deadline=min(deadline, time.monotonic() + wait_s))
        if buffer is None:
            _drain(sock, frame.length, _payload_deadline(context))
            _refuse(sock, context, frame, f"no staging memory for {frame.length} bytes within {wait_s:g} s")
            return
        try:
            recv_exact(sock, buffer.data[: frame.length], deadline=deadline)
            verified = _checksum(frame, buffer.data[: frame.length]) == frame.checksum
            if verified and not (gone := _gone(context, frame)):
                np.copyto(np.frombuffer(target, dtype=np.uint8), buffer[: frame.length])  # GIL released
        finally:
            context.staging.free(buffer)
    if not verified:
        _refuse(sock, context, frame, "WRITE payload failed its end-to-end checksum; the region is unchanged")
        return
    if gone:
        _refuse(sock, context, frame, gone)
        return
    _reply(sock, context, Frame(Kind.OK, tag=frame.tag))


def _gone(context: ServerContext, frame: Frame) -> str:
    """Why a staged WRITE may no longer be copied into its region ("" if it may): receiving and hashing it took
    time, in which the owner may have unregistered the region or begun closing the engine (which lets go of every
    region first, then waits for the serving threads); either way it believes the memory is no longer served, and
    a copy now would land behind its back."""
    if context.region(frame.region) is None:
        return (
            f"region {frame.region} was unregistered (or its engine began closing) while the WRITE arrived;"
            " it is unchanged"
        )
    return ""


def _serve_read(sock: socket.socket, context: ServerContext, frame: Frame, *, checksums: bool) -> None:
    source, reason = _target(context, frame)
    if source is None:
        _refuse(sock, context, frame, reason)
        return
    # Bound to the READ as read here: a client that asked for other bytes than these rejects them.
    checksum = _checksum(frame, source) if checksums or frame.checksum is not None else None
    _reply(sock, context, Frame(Kind.OK, tag=frame.tag, length=frame.length, checksum=checksum), source)


def _serve_call(sock: socket.socket, context: ServerContext, frame: Frame) -> None:
    body = bytearray(frame.length)
    recv_exact(sock, memoryview(body), deadline=_payload_deadline(context))
    try:
        request = _json.loads(body)
        result = context.handle_call(str(request["method"]), request.get("args"))
        payload = json.dumps(result).encode()
    except Exception as error:
        try:
            reason = f"{type(error).__name__}: {error}"
        except Exception:  # a handler's exception whose message itself fails: refused all the same, by its type
            reason = f"{type(error).__name__} (its message cannot be printed)"
        _refuse(sock, context, frame, reason)
        return
    if len(payload) > MAX_CONTROL_BYTES:
        _refuse(sock, context, frame, f"reply of {len(payload)} bytes exceeds {MAX_CONTROL_BYTES}")
        return
    _reply(sock, context, Frame(Kind.REPLY, tag=frame.tag, length=len(payload)), payload)
