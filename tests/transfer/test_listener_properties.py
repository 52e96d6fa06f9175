"""Properties of the `listener`: what it admits, what it refuses, what it drops, over generated clients.

Each example runs a `Listener` on 127.0.0.1 whose `serve` records what reaches it (the bytes
an authenticated connection carries after its answer), and raw clients that speak the
handshake of `wire` by hand: in pieces, wrongly, partly, or not at all. The listener is
what is tested; `serve` stands for an engine's frame loop, which is not.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import socket
import threading
import time
from collections.abc import Iterator

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.transfer.listener import Listener
from mooncake.transfer.request import EngineConfig
from mooncake.transfer.wire import ANSWER_BYTES, BUSY, INCARNATION_BYTES, REFUSED, Agreement
from tests.transfer.conftest import SECRET
from tests.transfer.test_listener import closed_by_peer, other_loopback_address
from tests.waiting import wait_for

HELLO_BYTES = 43  # "MCTE-HELLO", the version byte, the server's 32-byte nonce
VERDICT_BYTES = 50  # "OK", the server's 16-byte incarnation id and its 32-byte proof
NONCE_BYTES = 32

secrets_ = st.binary(min_size=16, max_size=64)


class Recorder:
    """A `serve` that reads its connection to the end and records every byte it got, per connection."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.num_started = 0
        self.received: list[bytes] = []
        self.agreements: list[Agreement] = []

    def serve(self, sock: socket.socket, agreement: Agreement) -> None:
        with self._lock:
            self.num_started += 1
            self.agreements.append(agreement)
        chunks = []
        try:
            # The listener may have closed the socket already (its close raced this thread's start).
            sock.settimeout(30)  # a test that goes wrong must not leave the thread behind for long
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except OSError:
            pass  # ended: what arrived is recorded
        finally:
            with self._lock:
                self.received.append(b"".join(chunks))

    @property
    def num_finished(self) -> int:
        with self._lock:
            return len(self.received)


@contextlib.contextmanager
def listening(config: EngineConfig, recorder: Recorder, *, secret: bytes = SECRET) -> Iterator[Listener]:
    listener = Listener(secret=secret, config=config, serve=recorder.serve, name="prop")
    try:
        yield listener
    finally:
        listener.close()


@contextlib.contextmanager
def clients() -> Iterator[list[socket.socket]]:
    """Client sockets an example opens; every one closed at the end."""
    opened: list[socket.socket] = []
    try:
        yield opened
    finally:
        for sock in opened:
            sock.close()


@attrs.frozen
class Client:
    sock: socket.socket
    hello: bytes


def dial(listener: Listener, opened: list[socket.socket], *, source: str = "127.0.0.1") -> Client:
    """A connection to `listener` whose hello has arrived (so the listener has accepted it)."""
    sock = socket.create_connection((listener.host, listener.port), timeout=10, source_address=(source, 0))
    opened.append(sock)
    hello = recv_up_to(sock, HELLO_BYTES)
    assert len(hello) == HELLO_BYTES and hello.startswith(b"MCTE-HELLO"), hello
    return Client(sock, hello)


def recv_up_to(sock: socket.socket, count: int) -> bytes:
    """`count` bytes from `sock`, or fewer if the other end closes first."""
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            break
        data += chunk
    return data


def recv_to_end(sock: socket.socket) -> bytes:
    """Everything until the other end closes (a reset counts as the end)."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def answer_to(
    hello: bytes, secret: bytes, *, checksums: bool = False, incarnation: bytes = bytes(INCARNATION_BYTES)
) -> tuple[bytes, bytes]:
    """The client's answer to `hello` (its nonce, its flags byte and HMAC(secret, "client" || server nonce ||
    client nonce || flags)), and the verdict an honest server of `incarnation` sends back ("OK", the
    incarnation and HMAC(secret, "server" || client nonce || server nonce || incarnation)), as the `wire` module
    documents them."""
    server_nonce = hello[-NONCE_BYTES:]
    client_nonce = os.urandom(NONCE_BYTES)
    flags = bytes([1 if checksums else 0])
    mac = hmac.new(secret, b"client" + server_nonce + client_nonce + flags, hashlib.sha256).digest()
    proof = hmac.new(secret, b"server" + client_nonce + server_nonce + incarnation, hashlib.sha256).digest()
    return client_nonce + flags + mac, b"OK" + incarnation + proof


def authenticate(client: Client, secret: bytes = SECRET) -> bytes:
    """Answer the hello correctly; the verdict received (fewer bytes if the listener closed first)."""
    answer, _ = answer_to(client.hello, secret)
    client.sock.sendall(answer)
    return recv_up_to(client.sock, len(REFUSED))


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({cut for cut in cuts if 0 < cut < len(data)})
    return [data[start:end] for start, end in zip([0, *points], [*points, len(data)], strict=True)]


@settings(max_examples=30, deadline=None)
@given(
    secret=secrets_,
    payload=st.binary(max_size=2048),
    cuts=st.lists(st.integers(min_value=1, max_value=ANSWER_BYTES + 64), max_size=4),
    checksums=st.booleans(),
)
def test_an_authenticated_connection_reaches_serve_with_every_byte_after_its_answer(
    secret: bytes, payload: bytes, cuts: list[int], checksums: bool
) -> None:
    """Whatever the secret, however the answer is cut into pieces, and whatever the client sends right
    behind it (without waiting for the verdict), the client gets "OK", the listener's incarnation id and the
    server's proof of the secret, and `serve` receives what the client asked of the connection (checksums or
    not) and exactly the bytes after the answer: the gate reads no byte of a frame before the connection
    authenticated, and loses none of a partial answer."""
    recorder = Recorder()
    with listening(EngineConfig(), recorder, secret=secret) as listener, clients() as opened:
        client = dial(listener, opened)
        sock = client.sock
        answer, verdict = answer_to(client.hello, secret, checksums=checksums, incarnation=listener.incarnation)
        for piece in split(answer + payload, cuts):
            sock.sendall(piece)
            # Spreads the pieces over several passes of the gate. Not synchronisation: the
            # property holds for every interleaving, this only makes the partial ones likely.
            time.sleep(0.002)
        sock.shutdown(socket.SHUT_WR)
        assert recv_up_to(sock, VERDICT_BYTES) == verdict
        wait_for(lambda: recorder.num_finished == 1, timeout=10, what="serve to read the connection to its end")
        assert recorder.received == [payload]
        assert recorder.agreements == [Agreement(checksums=checksums)]


@st.composite
def wrong_answers(draw: st.DrawFn, right: bytes) -> bytes:
    """Answers of the right length that are not `right`: one bit flipped, a wrong secret's, or noise."""
    kind = draw(st.sampled_from(["flip", "other secret", "noise"]))
    if kind == "flip":
        index, bit = draw(st.integers(0, ANSWER_BYTES - 1)), draw(st.integers(0, 7))
        wrong = bytearray(right)
        wrong[index] ^= 1 << bit
        return bytes(wrong)
    if kind == "other secret":
        return right[:NONCE_BYTES] + draw(
            st.binary(min_size=ANSWER_BYTES - NONCE_BYTES, max_size=ANSWER_BYTES - NONCE_BYTES)
        )
    return draw(st.binary(min_size=ANSWER_BYTES, max_size=ANSWER_BYTES).filter(lambda noise: noise != right))


@settings(max_examples=30, deadline=None)
@given(data=st.data(), trailing=st.binary(max_size=256))
def test_a_wrong_answer_is_told_no_and_never_served(data: st.DataObject, trailing: bytes) -> None:
    """Any answer other than the right one (one bit off included), whatever follows it, is answered
    exactly "NO" and the connection closed; `serve` is never called and nothing stays pending."""
    recorder = Recorder()
    with listening(EngineConfig(), recorder) as listener, clients() as opened:
        client = dial(listener, opened)
        sock = client.sock
        right, _ = answer_to(client.hello, SECRET)
        sock.sendall(data.draw(wrong_answers(right), label="answer") + trailing)
        assert recv_up_to(sock, len(REFUSED)) == REFUSED
        assert recv_to_end(sock) == b"", "more than the refusal"
        wait_for(lambda: listener.num_pending == 0, timeout=10, what="the refused connection to be forgotten")
        assert recorder.num_started == 0 and listener.num_served == 0


@settings(max_examples=25, deadline=None)
@given(length=st.integers(min_value=0, max_value=ANSWER_BYTES - 1))
def test_a_connection_that_ends_mid_answer_is_dropped_unserved(length: int) -> None:
    """A client that sends only part of a right answer and then ends its side gets no verdict at all and
    its connection is closed at once (not at its deadline: a closed connection must not hold a place in the
    pending budget); `serve` is never called and nothing stays pending."""
    recorder = Recorder()
    with listening(EngineConfig(auth_timeout_s=60.0), recorder) as listener, clients() as opened:
        client = dial(listener, opened)
        sock = client.sock
        right, _ = answer_to(client.hello, SECRET)
        sock.sendall(right[:length])
        sock.shutdown(socket.SHUT_WR)
        assert recv_to_end(sock) == b""
        wait_for(lambda: listener.num_pending == 0, timeout=10, what="the dropped connection to be forgotten")
        assert recorder.num_started == 0 and listener.num_served == 0


@settings(max_examples=25, deadline=None)
@given(max_connections=st.integers(min_value=1, max_value=3), num_clients=st.integers(min_value=1, max_value=6))
def test_at_most_max_connections_are_served_and_a_freed_slot_admits_again(
    max_connections: int, num_clients: int
) -> None:
    """Clients authenticating one after another: the first `max_connections` get "OK" and are served, every
    later one is told "BY" and closed; once a served client leaves, the next one is admitted."""
    recorder = Recorder()
    config = EngineConfig(max_connections=max_connections)
    with listening(config, recorder) as listener, clients() as opened:
        admitted = []
        for index in range(num_clients):
            client = dial(listener, opened)
            verdict = authenticate(client)
            if index < max_connections:
                assert verdict == b"OK", index
                admitted.append(client.sock)
            else:
                assert verdict == BUSY, index
                assert recv_to_end(client.sock) == b""
            assert listener.num_served == min(index + 1, max_connections)
            listener.check_invariants()
        admitted[0].close()
        wait_for(lambda: listener.num_served == len(admitted) - 1, timeout=10, what="the slot of a closed connection")
        assert authenticate(dial(listener, opened)) == b"OK"
        assert listener.num_served == len(admitted)


@pytest.mark.skipif(other_loopback_address() is None, reason="127.0.0.2 is not a usable loopback address here")
@settings(max_examples=20, deadline=None)
@given(budget=st.integers(min_value=2, max_value=5), num_flood=st.integers(min_value=0, max_value=10))
def test_a_flood_from_one_address_only_churns_its_own_pending_connections(budget: int, num_flood: int) -> None:
    """A peer's pending connection from 127.0.0.1, the oldest of all, then `num_flood` silent ones from
    127.0.0.2: past the budget the flood's own oldest connections are dropped, in arrival order, and the
    newest stay; the peer is never dropped and then authenticates. At no point are more than `budget`
    connections pending. With a budget of 2 the arriving connection counts for its address: else the flood's
    one pending connection would tie with the peer's, and the tie drop the older, the peer's."""
    config = EngineConfig(max_unauthenticated_connections=budget, auth_timeout_s=60.0)
    with listening(config, Recorder()) as listener, clients() as opened:
        peer = dial(listener, opened, source="127.0.0.1")
        flood = []
        for _ in range(num_flood):
            flood.append(dial(listener, opened, source="127.0.0.2"))
            listener.check_invariants()
        num_dropped = max(0, num_flood - (budget - 1))
        # Each drop happened before the hello of the connection that needed the room, which has arrived.
        assert all(closed_by_peer(client.sock, timeout_s=10) for client in flood[:num_dropped])
        assert not any(closed_by_peer(client.sock, timeout_s=0) for client in flood[num_dropped:])
        wait_for(
            lambda: listener.num_pending == 1 + num_flood - num_dropped, timeout=10, what="every connect to be pending"
        )
        assert authenticate(peer) == b"OK"


@settings(max_examples=5, deadline=None)
@given(auth_timeout_s=st.sampled_from([0.2, 0.3, 0.5]), num_silent=st.integers(min_value=1, max_value=3))
def test_a_silent_connection_is_closed_at_its_deadline_not_before(auth_timeout_s: float, num_silent: int) -> None:
    """Connections that never answer, within the pending budget, are closed once `auth_timeout_s` has passed
    since they connected: not earlier (nothing needed their room) and not much later."""
    config = EngineConfig(auth_timeout_s=auth_timeout_s)
    with listening(config, Recorder()) as listener, clients() as opened:
        start = time.monotonic()
        silent = [dial(listener, opened) for _ in range(num_silent)]
        for client in silent:
            assert closed_by_peer(client.sock, timeout_s=auth_timeout_s + 10)
        elapsed = time.monotonic() - start
        assert elapsed >= auth_timeout_s, f"closed after {elapsed:.3f} s, before its deadline"
        wait_for(lambda: listener.num_pending == 0, timeout=10, what="the expired connections to be forgotten")


@settings(max_examples=20, deadline=None)
@given(num_pending=st.integers(min_value=0, max_value=3), num_served=st.integers(min_value=0, max_value=3))
def test_after_close_nothing_is_accepted_and_every_connection_is_closed(num_pending: int, num_served: int) -> None:
    """`close` with connections pending and served: each of them is closed, every `serve` that began returns
    and no connection is counted as served any more, and a new connection is refused."""
    recorder = Recorder()
    with clients() as opened, listening(EngineConfig(auth_timeout_s=60.0), recorder) as listener:
        served = [dial(listener, opened) for _ in range(num_served)]
        for client in served:
            assert authenticate(client) == b"OK"
        pending = [dial(listener, opened) for _ in range(num_pending)]
        wait_for(lambda: listener.num_served == num_served, timeout=10, what="the served connections")
        listener.close()
        for client in [*served, *pending]:
            assert closed_by_peer(client.sock, timeout_s=10)
        # A serving thread that starts only after `close` finds its socket closed and never calls serve.
        wait_for(lambda: listener.num_served == 0, timeout=10, what="every serving thread to end")
        assert recorder.num_finished == recorder.num_started <= num_served
        assert listener.num_pending == 0
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((listener.host, listener.port), timeout=5).close()
