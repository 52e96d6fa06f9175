"""The TCP wire under misbehaving peers: staged checksums, started frames, bounded lengths, peers that stall,
headers damaged on the way."""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator

import attrs
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.errors import PeerUnavailable, TransferError
from mooncake.transfer import tcp
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.request import EngineConfig, RequestState, Slice, TransferOp
from mooncake.transfer.wire import (
    ANSWER_BYTES,
    HEADER,
    INCARNATION_BYTES,
    MAX_CONTROL_BYTES,
    Frame,
    Kind,
    ProtocolError,
    bind_checksum,
    client_handshake,
    new_incarnation,
    recv_exact,
    recv_frame,
    send_frame,
    server_hello,
    server_verdict,
)
from tests.transfer.conftest import SECRET, request
from tests.transfer.peer_process import pattern

SIZE = 1 << 20
CONFIG = EngineConfig(io_timeout_s=0.5, idle_timeout_s=60.0, max_frame_bytes=4 << 20, slice_bytes=1 << 20)
# For the tests that show an error comes at once, not after a wait: an I/O timeout no pause of a busy machine reaches.
PATIENT = attrs.evolve(CONFIG, io_timeout_s=3.0)
INCARNATION = new_incarnation()  # the scripted server's


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[TransferEngine, np.ndarray, int]]:
    """An engine serving one plain region (in this process, so its bytes can be compared directly)."""
    with TransferEngine(secret=SECRET, config=CONFIG) as engine:
        target = pattern(SIZE, 1).copy()
        region = engine.register_memory(target)
        yield engine, target, region.region_id


@contextlib.contextmanager
def authenticated(engine: TransferEngine) -> Iterator[socket.socket]:
    sock = tcp.connect(engine.host, engine.port, secret=SECRET, config=CONFIG)
    try:
        yield sock
    finally:
        sock.close()


def closed_within(sock: socket.socket, timeout_s: float) -> float | None:
    """Seconds until the peer closes `sock` (what it sends meanwhile is dropped), or None if it does not."""
    start = time.monotonic()
    while (left := start + timeout_s - time.monotonic()) > 0:
        ready, _, _ = select.select([sock], [], [], left)
        if not ready:
            break
        try:
            if not sock.recv(1 << 16):
                return time.monotonic() - start
        except OSError:
            return time.monotonic() - start
    return None


def write_frame(region: int, offset: int, payload: bytes, checksum: int | None) -> tuple[Frame, bytes]:
    return Frame(Kind.WRITE, tag=7, region=region, offset=offset, length=len(payload), checksum=checksum), payload


def checksum_of(request: Frame, payload: bytes | bytearray) -> int:
    """The checksum a data frame of `request` carries for `payload`: the wire's, bound to the request."""
    return bind_checksum(request, xxhash.xxh3_64_intdigest(payload))


def bound_checksum(region: int, offset: int, payload: bytes) -> int:
    """The checksum of `payload` in the WRITE `write_frame` makes of it (bound to that header)."""
    return checksum_of(write_frame(region, offset, payload, None)[0], payload)


# --------------------------------------------------------------------------- checksums before visibility


@pytest.mark.parametrize("length", [4096, SIZE], ids=["connection-buffer", "staging-pool"])
def test_a_write_failing_its_checksum_leaves_the_region_unchanged(
    server: tuple[TransferEngine, np.ndarray, int], length: int
) -> None:
    """A WRITE whose payload does not match its checksum is refused and no byte of it reaches the
    region (small payloads are staged per connection, large ones in the pool); the connection
    stays in step, and a correct WRITE on it then lands."""
    engine, target, region = server
    before = target.copy()
    payload = bytes(pattern(length, 2))
    with authenticated(engine) as sock:
        send_frame(sock, *write_frame(region, 0, payload, bound_checksum(region, 0, payload) ^ 1))
        reply = recv_frame(sock, max_length=SIZE)
        message = bytearray(reply.length)
        recv_exact(sock, memoryview(message))
        assert reply.kind == Kind.ERROR and b"checksum" in message
        assert np.array_equal(target, before), "a refused WRITE must not touch the region"
        send_frame(sock, *write_frame(region, 0, payload, bound_checksum(region, 0, payload)))
        assert recv_frame(sock, max_length=SIZE).kind == Kind.OK
    assert bytes(target[:length]) == payload
    target[:] = before


def test_a_checksummed_write_cut_midway_leaves_the_region_unchanged(
    server: tuple[TransferEngine, np.ndarray, int],
) -> None:
    """A connection that drops halfway through a checksummed payload leaves no partial bytes behind."""
    engine, target, region = server
    before = target.copy()
    payload = bytes(pattern(SIZE, 3))
    with authenticated(engine) as sock:
        frame, _ = write_frame(region, 0, payload, bound_checksum(region, 0, payload))
        sock.sendall(frame.pack() + payload[: SIZE // 2])
    assert wait_for(lambda: engine.listener.num_served == 0, timeout_s=5)
    assert np.array_equal(target, before)


@settings(max_examples=30, deadline=None)
@given(
    offset=st.integers(0, SIZE - 1),
    length=st.integers(1, 1 << 18),
    flip=st.one_of(st.none(), st.integers(0, (1 << 18) - 1)),
    seed=st.integers(0, 1000),
)
def test_only_verified_writes_become_visible(
    server: tuple[TransferEngine, np.ndarray, int], offset: int, length: int, flip: int | None, seed: int
) -> None:
    """Against a model of the region: a checksummed WRITE changes exactly its range when its payload
    verifies, and nothing when one byte of it was flipped on the way."""
    engine, target, region = server
    length = min(length, SIZE - offset)
    model = target.copy()
    payload = bytearray(pattern(length, seed))
    checksum = bound_checksum(region, offset, bytes(payload))
    if flip is not None:
        payload[flip % length] ^= 0xFF
    else:
        model[offset : offset + length] = np.frombuffer(payload, np.uint8)
    with authenticated(engine) as sock:
        send_frame(sock, *write_frame(region, offset, bytes(payload), checksum))
        reply = recv_frame(sock, max_length=SIZE)
        assert reply.kind == (Kind.OK if flip is None else Kind.ERROR)
    assert np.array_equal(target, model)
    engine.check_invariants()


# --------------------------------------------------------------------------- started frames must finish


def wait_for(condition: Callable[[], bool], *, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def _half_header(sock: socket.socket, region: int) -> None:
    sock.sendall(Frame(Kind.READ, region=region, length=16).pack()[:20])


def _dribbled_header(sock: socket.socket, region: int) -> None:
    header = Frame(Kind.READ, region=region, length=16).pack()
    for i in range(len(header) - 1):  # a byte every 0.1 s: each recv is quick, the header never completes
        try:
            sock.send(header[i : i + 1])
        except OSError:
            return  # closed on us
        time.sleep(0.1)


def _half_payload(sock: socket.socket, region: int) -> None:
    sock.sendall(Frame(Kind.WRITE, region=region, length=4096).pack() + bytes(100))


def _half_call(sock: socket.socket, region: int) -> None:
    sock.sendall(Frame(Kind.CALL, length=1000).pack() + b'{"method": ')


@pytest.mark.parametrize("stall", [_half_header, _dribbled_header, _half_payload, _half_call])
def test_a_started_frame_must_finish_within_the_io_timeout(
    server: tuple[TransferEngine, np.ndarray, int], stall: Callable[[socket.socket, int], None]
) -> None:
    """Half a header, a header dribbled a byte at a time, half a payload, half a call: the connection is
    closed about io_timeout_s after the frame started (idle_timeout_s is 60 s), and the engine
    answers another connection meanwhile."""
    engine, _target, region = server
    with authenticated(engine) as stalled, authenticated(engine) as other:
        start = time.monotonic()
        worker = threading.Thread(target=stall, args=(stalled, region), daemon=True)
        worker.start()
        assert tcp.call(other, "describe", None) is not None  # served while the other stalls
        closed_after = closed_within(stalled, timeout_s=10)
        assert closed_after is not None, "the stalled connection was left open"
        assert time.monotonic() - start < CONFIG.io_timeout_s + 4
        worker.join(timeout=10)
        assert tcp.call(other, "describe", None) is not None


def test_an_idle_connection_may_wait_between_frames(server: tuple[TransferEngine, np.ndarray, int]) -> None:
    """No frame started, no io deadline: a connection quiet for several io timeouts still gets answers."""
    engine, _target, _region = server
    with authenticated(engine) as sock:
        assert closed_within(sock, timeout_s=4 * CONFIG.io_timeout_s) is None
        assert tcp.call(sock, "describe", None) is not None


def test_a_peer_that_never_reads_is_dropped(server: tuple[TransferEngine, np.ndarray, int]) -> None:
    """A client that asks for large READs and never reads the answers holds a serving thread for
    about io_timeout_s, then its connection is closed; others are served throughout."""
    engine, _target, region = server
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
        sock.settimeout(5)
        sock.connect((engine.host, engine.port))
        client_handshake(sock, SECRET, deadline=time.monotonic() + 5)
        served_before = engine.listener.num_served
        for _ in range(16):  # far more than the kernel buffers of both ends hold
            send_frame(sock, Frame(Kind.READ, region=region, length=SIZE))
        with authenticated(engine) as other:
            assert tcp.call(other, "describe", None) is not None
        assert wait_for(lambda: engine.listener.num_served < served_before, timeout_s=CONFIG.io_timeout_s + 4)
    finally:
        sock.close()


# --------------------------------------------------------------------------- bounded length fields


@pytest.mark.parametrize(
    "frame",
    [
        Frame(Kind.CALL, length=MAX_CONTROL_BYTES + 1),
        Frame(Kind.READ, region=1, length=CONFIG.max_frame_bytes + 1),
        Frame(Kind.WRITE, region=1, length=2**64 - 1),
        Frame(Kind.ERROR, length=10),
        Frame(Kind.OK, length=10),
    ],
    ids=["call-over-1MiB", "read-over-max-frame", "write-2^64", "client-error", "client-ok"],
)
def test_an_oversized_or_misdirected_header_ends_the_connection_at_once(frame: Frame) -> None:
    """A header that announces more than its bound, or a kind a client may not send, closes the
    connection before any payload is read or any memory is set aside for it (well before the server's
    I/O timeout, which waiting for the payload would end in)."""
    with TransferEngine(secret=SECRET, config=PATIENT) as engine, authenticated(engine) as sock:
        send_frame(sock, frame)
        closed_after = closed_within(sock, timeout_s=10)
        assert closed_after is not None and closed_after < PATIENT.io_timeout_s


class ScriptedServer:
    """A server that authenticates like an engine, then answers the first frame with `answer`."""

    def __init__(self, answer: Callable[[socket.socket], None] | None = None, *, hello_delay_s: float = 0.0) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._answer, self._hello_delay_s = answer, hello_delay_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            connection, _ = self.listener.accept()
            with connection:
                connection.settimeout(10)
                nonce, hello = server_hello()
                if self._hello_delay_s:  # a byte at a time, each well within any socket timeout
                    for i in range(len(hello)):
                        connection.sendall(hello[i : i + 1])
                        if self._stop.wait(self._hello_delay_s):
                            return
                else:
                    connection.sendall(hello)
                answer = bytearray(ANSWER_BYTES)
                recv_exact(connection, memoryview(answer))
                connection.sendall(server_verdict(SECRET, nonce, bytes(answer), incarnation=INCARNATION)[0])
                frame = recv_frame(connection, max_length=MAX_CONTROL_BYTES)
                if frame.kind in (Kind.WRITE, Kind.CALL):  # a READ's length is what it asks for: nothing follows
                    recv_exact(connection, memoryview(bytearray(frame.length)))
                if self._answer is not None:
                    self._answer(connection)
                self._stop.wait(10)

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        self._thread.join(timeout=10)


@pytest.mark.parametrize(
    "answer",
    [
        lambda c: c.sendall(Frame(Kind.OK, length=32 << 20).pack()),  # a data frame's bound, not a reply's
        lambda c: c.sendall(Frame(Kind.REPLY, tag=5, length=2).pack() + b"{}"),  # another call's reply
        lambda c: send_frame(c, Frame(Kind.REPLY, length=7), b"not js!"),
        lambda c: send_frame(c, Frame(Kind.REPLY, length=200_000), b"[" * 200_000),  # past the parser's depth
    ],
    ids=["ok-32MiB", "wrong-tag", "not-json", "nested-json"],
)
def test_a_control_reply_is_checked_before_it_is_read(answer: Callable[[socket.socket], None]) -> None:
    """A reply to a control call that is no reply (a 32 MiB data frame, another tag, not JSON, JSON
    nested past the parser) is a ProtocolError at once, not an allocation or a wait for its body."""
    scripted = ScriptedServer(answer)
    try:
        sock = tcp.connect("127.0.0.1", scripted.port, secret=SECRET, config=PATIENT)
        with sock:
            start = time.monotonic()
            with pytest.raises(ProtocolError):
                tcp.call(sock, "describe", None)
            assert time.monotonic() - start < PATIENT.io_timeout_s
    finally:
        scripted.close()


READ_BYTES = 4096
DATA = bytes(range(256)) * (READ_BYTES // 256)


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (
            lambda c: send_frame(
                c,
                Frame(
                    Kind.OK,
                    tag=1,
                    length=READ_BYTES,
                    checksum=checksum_of(Frame(Kind.READ, tag=1, length=READ_BYTES), DATA) ^ 1,
                ),
                DATA,
            ),
            "checksum",
        ),
        (lambda c: send_frame(c, Frame(Kind.OK, tag=7, length=READ_BYTES), DATA), "a reply for slice 7"),
        (lambda c: send_frame(c, Frame(Kind.OK, tag=1, length=16), DATA[:16]), "asked for 4096 bytes"),
        (lambda c: send_frame(c, Frame(Kind.OK, tag=1, length=READ_BYTES), DATA), "without the checksum"),
        (lambda c: c.sendall(b"\0" * HEADER.size), "bad frame header"),
    ],
    ids=["bad-checksum", "wrong-tag", "wrong-length", "no-checksum", "bad-header"],
)
def test_a_read_reply_is_checked(answer: Callable[[socket.socket], None], error: str) -> None:
    """A READ answered with bytes failing their end-to-end checksum, for another slice, of another length, or
    (checksums on) without a checksum at all, or with a header that is none, is a ProtocolError for that slice:
    its bytes are never taken as the region's. The error names the peer (host:port) and the slice's region and
    offset. (One without a checksum was taken unverified; the errors named neither peer nor place.)"""
    scripted = ScriptedServer(answer)
    config = attrs.evolve(PATIENT, checksums=True, max_retries=0, streams_per_peer=1)
    transport = tcp.TcpTransport("127.0.0.1", scripted.port, secret=SECRET, config=config)  # its one stream connects
    try:
        failures: list[Exception | None] = []
        done = threading.Event()
        target = bytearray(READ_BYTES)
        transport.submit(Slice(TransferOp.READ, memoryview(target), 0, 0, lambda e: (failures.append(e), done.set())))
        assert done.wait(10)
        assert isinstance(failures[0], ProtocolError) and error in str(failures[0])
        assert str(failures[0]).startswith(f"127.0.0.1:{scripted.port} region 0 offset 0: "), failures[0]
    finally:
        transport.close()
        scripted.close()


def test_the_client_handshake_has_one_deadline() -> None:
    """A server that sends its hello a byte every 0.1 s (each recv well within the socket timeout)
    is given up on at connect_timeout_s, not after 43 of them."""
    scripted = ScriptedServer(hello_delay_s=0.1)
    config = EngineConfig(connect_timeout_s=0.5)
    try:
        start = time.monotonic()
        with pytest.raises(PeerUnavailable, match="authenticate"):
            tcp.connect("127.0.0.1", scripted.port, secret=SECRET, config=config)
        assert time.monotonic() - start < config.connect_timeout_s + 1.5
    finally:
        scripted.close()


def test_calls_refused_by_the_handler_keep_the_connection(server: tuple[TransferEngine, np.ndarray, int]) -> None:
    """Malformed control calls (not JSON, nested past the parser, unknown method) are refused one by
    one on a connection that goes on serving."""
    engine, _target, _region = server
    with authenticated(engine) as sock:
        for body in (b"not json", b"[" * 100_000, json.dumps({"method": "nope"}).encode()):
            send_frame(sock, Frame(Kind.CALL, length=len(body)), body)
            reply = recv_frame(sock, max_length=MAX_CONTROL_BYTES)
            recv_exact(sock, memoryview(bytearray(reply.length)))
            assert reply.kind == Kind.ERROR
        assert tcp.call(sock, "describe", None) is not None


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no message")


def test_a_handler_error_that_cannot_be_printed_is_refused_by_its_type(
    server: tuple[TransferEngine, np.ndarray, int],
) -> None:
    """A handler's exception whose message itself raises is still answered as a refusal naming its type, on a
    connection that goes on serving (the refusal's own formatting raised out of the serving loop, and the peer saw
    only a dropped connection)."""
    engine, _target, _region = server

    def broken(_args: object) -> None:
        raise _Unprintable

    engine.register_handler("broken", broken)
    with authenticated(engine) as sock:
        with pytest.raises(TransferError, match="_Unprintable"):
            tcp.call(sock, "broken", None)
        assert tcp.call(sock, "describe", None) is not None


def test_a_deadline_already_past_never_passes_off_a_slice_as_moved(
    server: tuple[TransferEngine, np.ndarray, int],
) -> None:
    """A slice run inline with its deadline already passed still gets its one try: it moves, or it fails; it is
    never reported done with nothing moved."""
    engine, target, region = server
    transport = tcp.TcpTransport(
        engine.host, engine.port, secret=SECRET, config=attrs.evolve(CONFIG, streams_per_peer=1)
    )
    try:
        data = bytes(range(200)) * 20
        piece = Slice(TransferOp.WRITE, memoryview(data), region, 4096, lambda _error: None)
        error = transport.run_inline(piece, deadline=time.monotonic() - 1.0)
        assert error is not None or bytes(target[4096 : 4096 + len(data)]) == data
    finally:
        transport.close()


# --------------------------------------------------------------------------- what a connection's handshake settles


def test_every_connection_tells_the_incarnation_of_the_engine_that_answers(
    server: tuple[TransferEngine, np.ndarray, int],
) -> None:
    """Each handshake tells the serving engine's incarnation id: the same on every connection to one engine,
    another for another engine; a connection that expects another one is refused as a restart."""
    engine, _target, _region = server
    ids = []
    for _ in range(2):
        sock, incarnation = tcp.open_connection(engine.host, engine.port, secret=SECRET, config=CONFIG)
        sock.close()
        ids.append(incarnation)
    with TransferEngine(secret=SECRET, config=CONFIG) as other:
        sock, elsewhere = tcp.open_connection(other.host, other.port, secret=SECRET, config=CONFIG)
        sock.close()
    assert ids[0] == ids[1] and len(ids[0]) == INCARNATION_BYTES and elsewhere != ids[0]
    tcp.connect(engine.host, engine.port, secret=SECRET, config=CONFIG, incarnation=ids[0]).close()
    with pytest.raises(PeerUnavailable, match="restarted"):
        tcp.connect(engine.host, engine.port, secret=SECRET, config=CONFIG, incarnation=elsewhere)


def test_a_connection_that_agreed_on_checksums_takes_no_unverified_write(
    server: tuple[TransferEngine, np.ndarray, int],
) -> None:
    """On a connection whose client said in its handshake that every data frame carries a checksum, a WRITE that
    comes without one (its flag lost on the way) is refused and leaves the region unchanged, a READ asked without
    one is answered with one, and the connection stays in step: a checksummed WRITE on it then lands. (The WRITE
    was received straight into the region.)"""
    engine, target, region = server
    before = target.copy()
    payload = bytes(pattern(4096, 5))
    with contextlib.closing(
        tcp.connect(engine.host, engine.port, secret=SECRET, config=attrs.evolve(CONFIG, checksums=True))
    ) as sock:
        send_frame(sock, *write_frame(region, 0, payload, None))
        reply = recv_frame(sock, max_length=SIZE)
        message = bytearray(reply.length)
        recv_exact(sock, memoryview(message))
        assert (reply.kind, reply.tag) == (Kind.ERROR, 7) and b"without the checksum" in message, bytes(message)
        assert np.array_equal(target, before), "an unverified WRITE reached the region"
        read = Frame(Kind.READ, tag=8, region=region, offset=0, length=4096)
        send_frame(sock, read)
        reply = recv_frame(sock, max_length=SIZE)
        answered = bytearray(reply.length)
        recv_exact(sock, memoryview(answered))
        assert reply.kind == Kind.OK and reply.checksum == checksum_of(read, answered)
        assert bytes(answered) == bytes(before[:4096])
        send_frame(sock, *write_frame(region, 0, payload, bound_checksum(region, 0, payload)))
        assert recv_frame(sock, max_length=SIZE).kind == Kind.OK
    assert bytes(target[:4096]) == payload
    target[:] = before


def test_a_read_reply_that_lost_its_checksum_fails_its_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines with checksums on, the serving one answering READs without the checksum flag and with a byte flipped
    (a frame damaged on the way): the request FAILS with a ProtocolError, on every retry, and the local buffer is
    untouched. (It was reported DONE with the flipped byte in place.)"""

    def damaged_read(sock: socket.socket, context: tcp.ServerContext, frame: Frame, **_options: object) -> None:
        source, _reason = tcp._target(context, frame)
        assert source is not None
        payload = bytearray(source)
        payload[0] ^= 0xFF
        tcp._reply(sock, context, Frame(Kind.OK, tag=frame.tag, length=frame.length), bytes(payload))

    monkeypatch.setattr(tcp, "_serve_read", damaged_read)  # only the serving side calls it
    config = EngineConfig(transports=("tcp",), checksums=True, io_timeout_s=5.0)
    with TransferEngine(secret=SECRET, config=config) as here, TransferEngine(secret=SECRET, config=config) as there:
        mine = np.zeros(4096, np.uint8)
        local = here.register_memory(mine)
        remote = there.register_memory(np.full(4096, 7, np.uint8))
        peer = here.connect(there.address)
        read = request(TransferOp.READ, local.region_id, peer, remote.region_id, 4096)
        for status in (here.wait(here.submit([read]), timeout=30)[0], here.transfer_sync([read], timeout=30)[0]):
            assert status.state == RequestState.FAILED and isinstance(status.error, ProtocolError), status
            assert "without the checksum" in str(status.error)
        assert not mine.any(), "the damaged READ reached the local buffer"


# --------------------------------------------------------------------------- budgets that stay whole


def test_a_call_gets_its_whole_timeout_however_long_the_previous_reply_took() -> None:
    """A reply whose body comes in three pieces over 2.1 s of a 3 s budget, then a call answered 2.25 s after it
    came: both succeed. (`call` read its budget back from the socket, which the previous reply's deadline had
    left at what was left of it when its last piece was awaited, 1.5 s: the second call, which the peer ran,
    failed, and every later one had less.) The times are three times the ratios the test needs, so that a loaded
    machine's stall of a few tenths of a second does not fail it."""
    client, server = socket.socketpair()
    client.settimeout(3.0)
    body = json.dumps("x" * 1000).encode()

    def serve() -> None:  # a slow peer: the pauses are its pace, not synchronisation
        with contextlib.suppress(OSError):
            frame = recv_frame(server, max_length=MAX_CONTROL_BYTES)
            recv_exact(server, memoryview(bytearray(frame.length)))
            send_frame(server, Frame(Kind.REPLY, length=len(body)), body[:10])
            time.sleep(1.5)
            server.sendall(body[10:20])
            time.sleep(0.6)
            server.sendall(body[20:])
            frame = recv_frame(server, max_length=MAX_CONTROL_BYTES)
            recv_exact(server, memoryview(bytearray(frame.length)))
            time.sleep(2.25)
            send_frame(server, Frame(Kind.REPLY, length=4), b'"ok"')

    peer = threading.Thread(target=serve, daemon=True)
    peer.start()
    try:
        assert tcp.call(client, "big", None) == "x" * 1000
        assert tcp.call(client, "slowish", None) == "ok"
        assert client.gettimeout() == 3.0
    finally:
        client.close()
        server.close()
        peer.join(timeout=10)


def test_an_explicit_call_timeout_stands_whatever_the_socket_holds() -> None:
    """`timeout_s` is the call's budget (the engine passes its io timeout), not the socket's current timeout, and
    the socket keeps it afterwards."""
    client, server = socket.socketpair()
    client.settimeout(0.05)  # what a previous deadline may have left

    def serve() -> None:
        with contextlib.suppress(OSError):
            frame = recv_frame(server, max_length=MAX_CONTROL_BYTES)
            recv_exact(server, memoryview(bytearray(frame.length)))
            time.sleep(0.3)  # the peer's pace
            send_frame(server, Frame(Kind.REPLY, length=4), b'"ok"')

    peer = threading.Thread(target=serve, daemon=True)
    peer.start()
    try:
        assert tcp.call(client, "slowish", None, timeout_s=2.0) == "ok"
        assert client.gettimeout() == 2.0
    finally:
        client.close()
        server.close()
        peer.join(timeout=10)


@pytest.mark.parametrize("path", ["inline", "streams"])
def test_a_connection_the_peer_closed_while_idle_is_replaced_without_spending_a_retry(path: str) -> None:
    """The serving side closes connections idle past its `idle_timeout_s`. The next slice on a kept connection
    (the inline one of `transfer_sync`, a stream's of `submit`) finds it closed before sending and reconnects,
    so with no retries at all it still succeeds. (A kept connection used to be sent on as it was: the first
    slice after an idle spell failed, or spent one of its retries.)"""
    server_config = EngineConfig(idle_timeout_s=0.3, spin_us=0, io_timeout_s=5.0)
    client_config = EngineConfig(max_retries=0, streams_per_peer=1, slice_bytes=64 << 10, io_timeout_s=5.0)
    length = 4096 if path == "inline" else 128 << 10  # one slice moves inline, two go to the stream

    def write(engine: TransferEngine, peer: str, local: int, remote: int) -> RequestState:
        requests = [request(TransferOp.WRITE, local, peer, remote, length)]
        if path == "inline":
            return engine.transfer_sync(requests, timeout=10)[0].state
        batch = engine.submit(requests)
        try:
            return engine.wait(batch, timeout=10)[0].state
        finally:
            engine.forget(batch)

    with (
        TransferEngine(secret=SECRET, config=server_config) as server,
        TransferEngine(secret=SECRET, config=client_config) as client,
    ):
        remote = server.register_memory(np.zeros(length, np.uint8))
        local = client.register_memory(pattern(length, 3).copy())
        peer = client.connect(server.address, transport="tcp")
        assert write(client, peer, local.region_id, remote.region_id) is RequestState.DONE
        assert wait_for(lambda: server.listener.num_served == 0, timeout_s=20), "connections did not idle out"
        assert write(client, peer, local.region_id, remote.region_id) is RequestState.DONE


# --------------------------------------------------------------------------- headers damaged on the way


class HeaderFlippingRelay:
    """A relay on 127.0.0.1 to a server: it passes the bytes of every connection both ways, and flips
    `header[byte] ^= mask` in the first frame of kind `kind` a client sends (once over all connections)."""

    def __init__(self, target: tuple[str, int], *, kind: Kind, byte: int, mask: int) -> None:
        self.target, self.kind, self.byte, self.mask = target, kind, byte, mask
        self.flipped = False
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                return
            server.settimeout(None)
            with self._lock:
                self._sockets += [client, server]
                for run, args in ((self._relay_frames, (client, server)), (self._relay, (server, client))):
                    thread = threading.Thread(target=run, args=args, daemon=True)
                    self._threads.append(thread)
                    thread.start()

    def _relay(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 16):
                sink.sendall(data)
        self._end(source, sink)

    def _relay_frames(self, client: socket.socket, server: socket.socket) -> None:
        """Client to server, frame by frame (after the handshake answer), so that a header can be found."""
        with contextlib.suppress(OSError, ConnectionError):
            server.sendall(self._read(client, ANSWER_BYTES))
            while True:
                header = self._read(client, HEADER.size)
                _magic, _version, kind, _flags, _region, _tag, _offset, length, _checksum = HEADER.unpack(header)
                with self._lock:
                    if kind == self.kind and not self.flipped:
                        self.flipped = True
                        header[self.byte] ^= self.mask
                server.sendall(header)
                if kind in (Kind.WRITE, Kind.CALL):  # the payload as the client sent it, its length unchanged
                    server.sendall(self._read(client, length))
        self._end(client, server)

    @staticmethod
    def _read(sock: socket.socket, nbytes: int) -> bytearray:
        data = bytearray(nbytes)
        recv_exact(sock, memoryview(data))
        return data

    @staticmethod
    def _end(*ends: socket.socket) -> None:
        for end in ends:
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                self._end(sock)
        for thread in self._threads:
            thread.join(timeout=10)
        for sock in self._sockets:
            sock.close()


FLIP_LENGTH = 12 << 10  # 0x3000: bit 12 of its length flipped, a header announces 8 KiB
# Where each field sits in a header (`wire.HEADER`), and the flip: region 1 <-> 2, offset +4 KiB, length -4 KiB,
# kind WRITE <-> READ.
FLIPS = {"kind": (5, 0x03), "region": (8, 0x03), "offset": (21, 0x10), "length": (29, 0x10)}


@pytest.mark.parametrize("field", sorted(FLIPS))
@pytest.mark.parametrize("op", [TransferOp.WRITE, TransferOp.READ])
def test_a_header_damaged_on_the_way_fails_its_checksummed_request(op: TransferOp, field: str) -> None:
    """With checksums on and no retries, a bit of a data frame's header flipped between the engines (the region,
    the offset, the length, or the kind: WRITE <-> READ) fails the request: a WRITE lands nowhere (neither the
    region it named nor the one the damaged header names), a READ is never DONE with bytes of another place.
    (A WRITE landed 4 KiB off, or in the other region, or was taken as done when the peer answered it as a READ;
    a READ returned the neighbouring bytes: all DONE. The checksum covered the payload only.)"""
    byte, mask = FLIPS[field]
    config = EngineConfig(
        transports=("tcp",), checksums=True, max_retries=0, spin_us=0, io_timeout_s=1.0, streams_per_peer=1
    )
    size = 64 << 10
    with TransferEngine(secret=SECRET, config=config) as here, TransferEngine(secret=SECRET, config=config) as there:
        mine = pattern(size, 11).copy()
        local = here.register_memory(mine)
        theirs = [pattern(size, 12).copy(), pattern(size, 13).copy()]
        remote = [there.register_memory(array) for array in theirs]
        assert [r.region_id for r in remote] == [1, 2]  # what the region flip turns into each other
        before = [array.copy() for array in theirs]
        relay = HeaderFlippingRelay(
            (there.host, there.port), kind=Kind.WRITE if op is TransferOp.WRITE else Kind.READ, byte=byte, mask=mask
        )
        try:
            peer = here.connect(f"127.0.0.1:{relay.port}")
            (status,) = here.transfer_sync(
                [request(op, local.region_id, peer, remote[0].region_id, FLIP_LENGTH)], timeout=10
            )
            assert relay.flipped
            assert status.state is RequestState.FAILED, (status, bytes(mine[:8]), bytes(theirs[0][:8]))
            if op is TransferOp.WRITE:
                assert all(np.array_equal(now, was) for now, was in zip(theirs, before, strict=True))
        finally:
            relay.close()


def test_a_write_acknowledged_with_bytes_is_not_done() -> None:
    """An OK that carries a payload (the answer to a READ) is no WRITE's acknowledgement: the WRITE fails with a
    ProtocolError. (Any OK with the slice's tag was taken for one.)"""
    scripted = ScriptedServer(lambda c: send_frame(c, Frame(Kind.OK, tag=1, length=16), bytes(16)))
    config = attrs.evolve(PATIENT, max_retries=0, streams_per_peer=1)
    transport = tcp.TcpTransport("127.0.0.1", scripted.port, secret=SECRET, config=config)
    try:
        outcomes: list[Exception | None] = []
        done = threading.Event()
        data = bytes(16)
        transport.submit(Slice(TransferOp.WRITE, memoryview(data), 0, 0, lambda e: (outcomes.append(e), done.set())))
        assert done.wait(10)
        assert isinstance(outcomes[0], ProtocolError) and "acknowledgement" in str(outcomes[0]), outcomes
    finally:
        transport.close()
        scripted.close()


@settings(max_examples=50, deadline=None)
@given(
    fields=st.tuples(
        st.sampled_from([Kind.WRITE, Kind.READ]),
        st.integers(0, 2**32 - 1),
        st.integers(0, 2**64 - 1),
        st.integers(0, 2**64 - 1),
        st.integers(0, 2**64 - 1),
    ),
    index=st.integers(0, 4),
    bit=st.integers(0, 63),
    payload=st.binary(max_size=64),
)
def test_a_checksum_changes_with_every_field_of_its_request(
    fields: tuple[Kind, int, int, int, int], index: int, bit: int, payload: bytes
) -> None:
    """`wire.bind_checksum` of a payload differs between two requests that differ in one bit of one field (kind,
    region, tag, offset, length), and equals itself for the same request (the checksum field aside)."""
    kind, region, tag, offset, length = fields
    widths = [2, 32, 64, 64, 64]
    changed = list(fields)
    changed[index] = Kind(3 - kind) if index == 0 else changed[index] ^ (1 << (bit % widths[index]))
    frame = Frame(kind, tag=tag, region=region, offset=offset, length=length)
    other = Frame(changed[0], tag=changed[2], region=changed[1], offset=changed[3], length=changed[4])
    digest = xxhash.xxh3_64_intdigest(payload)
    assert bind_checksum(frame, digest) == bind_checksum(attrs.evolve(frame, checksum=5), digest)
    assert bind_checksum(frame, digest) != bind_checksum(other, digest)
