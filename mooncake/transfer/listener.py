"""The listener: accepts connections, authenticates them, hands authenticated ones to serving threads.

Two budgets, so that strangers cannot crowd out peers. A connection that has
not authenticated yet costs no thread: one gate thread drives every pending
handshake without blocking (a selector over the listening socket and the
pending connections), each with a short deadline (`auth_timeout_s`), at most
`max_unauthenticated_connections` at once. When a new connection arrives and
that budget is spent, one pending connection makes room: the oldest of the
client address that holds the most. A flood from a few addresses therefore
only churns its own connections, and a peer elsewhere (one pending
connection, answered within a round trip) is never the one dropped unless
the flood comes from as many addresses as the budget. In each pass the gate
reads the answers that arrived before it accepts new connections, so an
answer already received is decided, not dropped. A connection
that proves the secret is counted against `max_connections` and served on a
thread of its own, with what its client settled in the handshake
(`wire.Agreement`); past that limit it is told "busy" (`wire.BUSY`) and closed.
The verdict tells the client this listener's incarnation id, so that a client
reconnecting to the address can tell a restarted engine from the one it knew.

The gate never blocks on a peer: the hello (43 bytes) and the verdict (50
bytes) go into an empty send buffer of a fresh connection, and a send that
would block ends that connection instead.

Invariants:
- At most `max_unauthenticated_connections` connections are pending, each at
  most `auth_timeout_s` (plus one pass of the gate) old.
- At most `max_connections` authenticated connections are served at once.
- No byte of a frame is read from a connection before it authenticated.
- The gate runs until `close`: an unexpected error ends only the connection
  it arose on (counted in `num_gate_errors`), and it never waits longer than
  select can (`_MAX_WAIT_S`).
- After `close`, nothing is accepted and every connection is closed, and no
  serving thread runs any more (`close` waits for them, at most `io_timeout_s`
  in all: a thread that had received a WRITE when its connection was shut down
  finishes with it before `close` returns, never after).
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections.abc import Callable

import attrs

from mooncake._checks import shown
from mooncake.errors import AuthenticationError, ConfigError, TransferError
from mooncake.transfer.request import EngineConfig
from mooncake.transfer.wire import (
    ANSWER_BYTES,
    BUSY,
    INCARNATION_BYTES,
    REFUSED,
    Agreement,
    new_incarnation,
    server_hello,
    server_verdict,
)

__all__ = ["Listener"]

_ACCEPTS_PER_PASS = 256  # so that pending handshakes are served between bursts of connects
_MAX_WAIT_S = 3600.0  # the gate wakes at least this often: a wait longer than select can take would kill it


@attrs.define(eq=False)
class _Pending:
    sock: socket.socket
    address: str
    nonce: bytes
    deadline: float
    answer: bytearray = attrs.field(factory=lambda: bytearray(ANSWER_BYTES))
    received: int = 0


class Listener:
    """Listens on `config.host`, `config.port`; calls `serve(sock, agreement)` on a thread per authenticated
    connection.

    Args:
        secret: the shared secret peers must prove.
        config: address, budgets and deadlines.
        serve: serves one authenticated connection until it ends (the listener
            closes the socket afterwards), given what its client settled in the handshake.
        name: a prefix for thread names.
        incarnation: the id told to every client (`wire.INCARNATION_BYTES`; by default a fresh one): its engine's.

    Raises:
        ConfigError: `incarnation` is not `wire.INCARNATION_BYTES` long.
        TransferError: it cannot listen on `config.host`, `config.port` (the port is taken, the host does not
            resolve or is not this machine's); host, port and the system's reason are named, and nothing is left
            open.
    """

    def __init__(
        self,
        *,
        secret: bytes,
        config: EngineConfig,
        serve: Callable[[socket.socket, Agreement], None],
        name: str,
        incarnation: bytes | None = None,
    ) -> None:
        self._secret, self._config, self._serve, self._name = secret, config, serve, name
        self.incarnation = new_incarnation() if incarnation is None else incarnation
        if len(self.incarnation) != INCARNATION_BYTES:  # checked here: the gate thread must not fail on it
            raise ConfigError(f"incarnation must be {INCARNATION_BYTES} bytes, got {shown(self.incarnation)}")
        try:  # create_server closes the socket it could not bind
            self._sock = socket.create_server((config.host, config.port), backlog=1024)
        except OSError as error:  # the port is taken, the host does not resolve or is not this machine's
            # The system's reason quotes the address again, a long host whole: cut short, as the host is.
            reason = shown(error.strerror or str(error), limit=120, quote=str)
            raise TransferError(f"cannot listen on {shown(config.host, quote=str)}:{config.port}: {reason}") from error
        self._sock.setblocking(False)
        self.host, self.port = self._sock.getsockname()[:2]
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ)
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        # The gate alone touches these two. Both in arrival order: the first is the oldest.
        self._pending: dict[socket.socket, _Pending] = {}
        self._by_address: dict[str, dict[socket.socket, _Pending]] = {}
        self._served: set[socket.socket] = set()
        self._serving: set[threading.Thread] = set()  # the threads serving `_served`, joined by `close`
        self._lock = threading.Lock()  # guards _served, _serving and _closed
        self._closed = False
        self._gate_errors = 0
        self._gate = threading.Thread(target=self._run, name=f"{name}-gate", daemon=True)
        self._gate.start()

    @property
    def num_gate_errors(self) -> int:
        """Connections the gate dropped on an unexpected error (a bug, or the system refusing a call): it went on."""
        return self._gate_errors

    @property
    def num_pending(self) -> int:
        """Connections still authenticating."""
        return len(self._pending)

    @property
    def num_served(self) -> int:
        """Authenticated connections being served."""
        with self._lock:
            return len(self._served)

    def close(self) -> None:
        """Stop accepting; close every pending and served connection; wait for the gate and the serving threads.

        A serving thread may be past the last byte of a WRITE when its connection is shut down (hashing or copying
        it): `close` waits for it (for every serving thread, `io_timeout_s` in all), so that no byte a peer sent
        lands in a region after `close` returned. A thread that outlives the wait (a control call's handler that
        does not return) is left to end on its own; its connection is closed.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            served = list(self._served)
        with contextlib.suppress(OSError):
            self._wake_write.send(b"x")
        self._gate.join(timeout=5)
        for sock in served:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes its serving thread, which closes it
        # The gate has stopped: no serving thread starts after this snapshot.
        with self._lock:
            # One not started yet (a gate that outlived its join, between adding and starting it) cannot be joined.
            serving = [
                thread
                for thread in self._serving
                if thread is not threading.current_thread() and thread.ident is not None
            ]
        deadline = time.monotonic() + self._config.io_timeout_s
        for thread in serving:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        for sock in served:
            sock.close()  # closed by its thread already, unless that thread outlived the wait
        self._wake_write.close()

    def check_invariants(self) -> None:
        pending = dict(self._pending)  # the gate may move on meanwhile: check one snapshot
        assert len(pending) <= self._config.max_unauthenticated_connections, len(pending)
        assert self.num_served <= self._config.max_connections, self.num_served
        now = time.monotonic()
        assert all(entry.deadline <= now + self._config.auth_timeout_s for entry in pending.values())

    # ------------------------------------------------------------------ the gate thread

    def _run(self) -> None:
        # One connection's unexpected error (a bug, or a system call failing in a way not foreseen) ends that
        # connection, counted in `num_gate_errors`, never the gate: a gate that died would accept no one again.
        try:
            while not self._closed:
                timeout = _MAX_WAIT_S
                if self._pending:
                    oldest = next(iter(self._pending.values()))
                    timeout = min(timeout, max(0.0, oldest.deadline - time.monotonic()))
                ready = {key.fileobj for key, _events in self._selector.select(timeout)}
                if self._wake_read in ready:
                    return
                # Answers first: one that has arrived is decided before new connections may push it out.
                for sock in ready:
                    pending = self._pending.get(sock)  # type: ignore[call-overload]
                    if pending is not None:
                        try:
                            self._advance(pending)
                        except Exception:
                            self._fail(pending)
                if self._sock in ready:
                    self._accept()
                self._expire(time.monotonic())
        finally:
            for pending in list(self._pending.values()):
                self._drop(pending)
            self._selector.close()
            self._sock.close()
            self._wake_read.close()

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_PASS):
            try:
                sock, address = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # e.g. out of descriptors: the connection waits in the backlog
            try:
                self._admit(sock, str(address[0]))
            except Exception:
                pending = self._pending.get(sock)
                if pending is not None:
                    self._fail(pending)
                else:
                    self._gate_errors += 1
                    sock.close()

    def _admit(self, sock: socket.socket, address: str) -> None:
        """Greet a new connection and make it pending (or close it if the greeting cannot go out at once)."""
        if len(self._pending) >= self._config.max_unauthenticated_connections:
            self._make_room(address)
        sock.setblocking(False)
        nonce, hello = server_hello()
        try:
            if sock.send(hello) != len(hello):
                raise BlockingIOError
        except OSError:
            sock.close()
            return
        pending = _Pending(sock, address, nonce, time.monotonic() + self._config.auth_timeout_s)
        self._pending[sock] = pending
        self._by_address.setdefault(pending.address, {})[sock] = pending
        self._selector.register(sock, selectors.EVENT_READ)

    def _fail(self, pending: _Pending) -> None:
        """End a pending connection whose handling raised unexpectedly (counted), whatever state it was left in."""
        self._gate_errors += 1
        if self._pending.get(pending.sock) is pending:
            with contextlib.suppress(Exception):
                self._forget(pending)
        with self._lock:
            served = pending.sock in self._served
        if served:
            self._end(pending.sock)
        else:
            pending.sock.close()

    def _make_room(self, arriving: str) -> None:
        """Drop the oldest pending connection of the address that holds the most, counting the connection
        `arriving` from its address (ties: the older one). Counting it, a flood from one address with a budget
        of two drops its own connection, not the peer's that came first."""

        def crowding(address: str) -> tuple[int, float]:
            mine = self._by_address[address]
            return len(mine) + (address == arriving), -next(iter(mine.values())).deadline

        self._drop(next(iter(self._by_address[max(self._by_address, key=crowding)].values())))

    def _advance(self, pending: _Pending) -> None:
        """Read what the peer sent of its answer; decide once all of it is in."""
        try:
            got = pending.sock.recv_into(memoryview(pending.answer)[pending.received :])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(pending)
            return
        if got == 0:
            self._drop(pending)
            return
        pending.received += got
        if pending.received < ANSWER_BYTES:
            return
        try:
            verdict, agreement = server_verdict(
                self._secret, pending.nonce, bytes(pending.answer), incarnation=self.incarnation
            )
        except AuthenticationError:
            self._drop(pending, farewell=REFUSED)
            return
        with self._lock:
            admitted = not self._closed and len(self._served) < self._config.max_connections
            if admitted:
                self._served.add(pending.sock)
        if not admitted:
            self._drop(pending, farewell=BUSY)
            return
        self._forget(pending)
        sock = pending.sock
        try:
            if sock.send(verdict) != len(verdict):
                raise BlockingIOError
        except OSError:
            self._end(sock)
            return
        thread = threading.Thread(
            target=self._serve_then_close, args=(sock, agreement), name=f"{self._name}-serve", daemon=True
        )
        with self._lock:
            self._serving.add(thread)  # before it starts: a thread that ends at once still finds itself there
        try:
            thread.start()
        except BaseException:
            # The system refused a thread (a pids limit, say): this connection is not served, and `close` must not
            # wait for a thread that never ran. The gate ends the connection (`_fail`).
            with self._lock:
                self._serving.discard(thread)
            raise

    def _expire(self, now: float) -> None:
        while self._pending:
            oldest = next(iter(self._pending.values()))
            if oldest.deadline > now:
                return
            self._drop(oldest)

    def _forget(self, pending: _Pending) -> None:
        del self._pending[pending.sock]
        mine = self._by_address[pending.address]
        del mine[pending.sock]
        if not mine:
            del self._by_address[pending.address]
        self._selector.unregister(pending.sock)

    def _drop(self, pending: _Pending, *, farewell: bytes = b"") -> None:
        self._forget(pending)
        if farewell:
            with contextlib.suppress(OSError):
                pending.sock.send(farewell)
        pending.sock.close()

    # ------------------------------------------------------------------ served connections

    def _serve_then_close(self, sock: socket.socket, agreement: Agreement) -> None:
        try:
            sock.setblocking(True)
            self._serve(sock, agreement)
        except Exception:
            pass  # the connection ends; the engine keeps serving others
        finally:
            self._end(sock)
            with self._lock:
                self._serving.discard(threading.current_thread())

    def _end(self, sock: socket.socket) -> None:
        sock.close()  # first: a connection no longer counted in `num_served` is closed (its client can tell)
        with self._lock:
            self._served.discard(sock)
