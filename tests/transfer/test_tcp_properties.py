"""Properties of `mooncake.transfer.tcp` against byte models of the regions at both ends.

A server engine on 127.0.0.1 (in this process, so its regions can be compared directly) serves
two regions and a region id it never registered. Three properties:

- Through `TcpTransport` (1 to 4 streams, checksums on or off, queued or inline): random batches
  of READ and WRITE slices, at offsets and lengths that include zero, an exact fit against a
  region's end and every kind of out-of-bounds range, leave both the server's regions and the
  client's local buffer equal to a model that applies the slices in order; an in-bounds slice
  ends with None, an out-of-bounds one with the server's TransferError refusal, and nothing of
  it touches either end. Slices that touch overlapping bytes are run in order (waves); the rest
  run concurrently.
- On one raw authenticated connection speaking the wire format: a sequence of WRITEs (no
  checksum, correct checksum, wrong checksum, payload corrupted after its checksum was taken;
  in and out of bounds; small enough for the connection's own buffer or large enough for the
  staging pool) and READs (with or without a checksum asked for) is answered frame by frame
  with the right tag, and only verified in-bounds WRITEs change the region.
- A connection that sends a malformed header, or a frame cut short, is closed by the server;
  a WRITE cut short leaves nothing (checksummed) or at most a prefix of the bytes that
  arrived (unchecksummed); the server's thread ends and the next client is served correctly.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Iterator

import attrs
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.errors import PeerUnavailable, TransferError, TransferTimeout
from mooncake.transfer import tcp
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.request import MAX_OFFSET, EngineConfig, Slice, TransferOp
from mooncake.transfer.wire import (
    HEADER,
    MAGIC,
    MAX_CONTROL_BYTES,
    VERSION,
    Frame,
    Kind,
    ProtocolError,
    bind_checksum,
    recv_exact,
    recv_frame,
    send_frame,
)
from tests.transfer.conftest import SECRET
from tests.waiting import wait_for

BIG = 96 << 10  # above the 64 KiB a connection stages in its own buffer: larger WRITEs use the staging pool
SMALL = 1000
LOCAL = BIG
MAX_FRAME = 1 << 20
UNKNOWN_REGION = 4_000_000_000  # never registered (fits the wire's u32 region field)
CONFIG = EngineConfig(
    transports=("tcp",),
    io_timeout_s=10.0,
    idle_timeout_s=120.0,
    connect_timeout_s=10.0,
    max_frame_bytes=MAX_FRAME,
    slice_bytes=MAX_FRAME,
    max_staging_bytes=4 * MAX_FRAME,
    max_retries=0,  # the server is honest: a retry could only hide a defect
    spin_us=0,
)


@attrs.define(eq=False)
class Server:
    """An engine serving two regions whose arrays this process holds."""

    engine: TransferEngine
    arrays: dict[int, np.ndarray] = attrs.field(repr=False)

    def reset(self, seed: int) -> dict[int, bytearray]:
        """Fill every region with fresh bytes (nothing is in flight); returns the model of them."""
        rng = np.random.default_rng(seed)
        for array in self.arrays.values():
            array[:] = rng.integers(0, 256, array.size, dtype=np.uint8)
        return {region: bytearray(array.tobytes()) for region, array in self.arrays.items()}

    def size(self, region: int) -> int:
        """The region's length; an unknown region counts as empty (nothing is inside it)."""
        array = self.arrays.get(region)
        return 0 if array is None else array.size

    def assert_equals(self, model: dict[int, bytearray]) -> None:
        for region, array in self.arrays.items():
            assert array.tobytes() == bytes(model[region]), f"region {region} differs from its model"


def start_server() -> Server:
    engine = TransferEngine(secret=SECRET, config=CONFIG)
    arrays: dict[int, np.ndarray] = {}
    for size in (BIG, SMALL):
        array = np.zeros(size, np.uint8)
        arrays[engine.register_memory(array).region_id] = array
    assert UNKNOWN_REGION not in arrays and 0 not in arrays  # region 0: what malformed headers name
    return Server(engine, arrays)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    served = start_server()
    try:
        yield served
    finally:
        served.engine.close()


@pytest.fixture(scope="module")
def transports(server: Server) -> Iterator[dict[tuple[int, bool], tcp.TcpTransport]]:
    """One `TcpTransport` per (streams, checksums), made on first use and closed at the end."""
    made: dict[tuple[int, bool], tcp.TcpTransport] = {}
    try:
        yield made
    finally:
        for transport in made.values():
            transport.close()


def transport_for(
    made: dict[tuple[int, bool], tcp.TcpTransport], server: Server, streams: int, checksums: bool
) -> tcp.TcpTransport:
    key = (streams, checksums)
    if key not in made:
        config = attrs.evolve(CONFIG, streams_per_peer=streams, checksums=checksums)
        made[key] = tcp.TcpTransport(server.engine.host, server.engine.port, secret=SECRET, config=config)
    return made[key]


@contextlib.contextmanager
def authenticated(server: Server) -> Iterator[socket.socket]:
    sock = tcp.connect(server.engine.host, server.engine.port, secret=SECRET, config=CONFIG)
    try:
        yield sock
    finally:
        sock.close()


def closed_by_peer(sock: socket.socket, timeout_s: float) -> bool:
    """Whether the peer closes `sock` within `timeout_s` (whatever it sends meanwhile is dropped)."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([sock], [], [], left)
        if not ready:
            return False
        try:
            if not sock.recv(1 << 16):
                return True
        except OSError:
            return True
    return False


# --------------------------------------------------------------------------- slices through TcpTransport


@attrs.frozen
class Move:
    """One slice as drawn: the local range, the remote range."""

    op: TransferOp
    local_offset: int
    region: int
    remote_offset: int
    length: int


def is_inside(server: Server, move: Move) -> bool:
    return move.region in server.arrays and move.remote_offset + move.length <= server.size(move.region)


@st.composite
def moves(draw: st.DrawFn, server: Server) -> Move:
    """A slice: in bounds (zero length, exact fit at the region's end, anywhere), or out of bounds
    (one byte past the end, starting past the end, far beyond, or in a region never registered)."""
    op = draw(st.sampled_from(TransferOp))
    region = draw(st.sampled_from([*server.arrays, UNKNOWN_REGION]))
    size = server.size(region)
    shape = draw(st.sampled_from(["inside", "empty", "to-the-end", "one-past", "beyond", "far"]))
    if shape == "inside":
        offset = draw(st.integers(0, size))
        length = draw(st.integers(0, min(size - offset, LOCAL)))
    elif shape == "empty":
        offset, length = draw(st.sampled_from([0, size])), 0
    elif shape == "to-the-end":
        length = draw(st.integers(0, min(size, LOCAL)))
        offset = size - length
    elif shape == "one-past":
        length = draw(st.integers(1, min(size + 1, LOCAL)))
        offset = size - length + 1
    elif shape == "beyond":
        offset = draw(st.integers(size + 1, size + 100))
        length = draw(st.integers(0, 100))
    else:
        offset = draw(st.sampled_from([MAX_OFFSET, MAX_OFFSET - 1, 2**32, 2**32 - 1]))
        length = draw(st.integers(0, 64))
    local_offset = draw(st.integers(0, LOCAL - length))
    return Move(op, local_offset, region, offset, length)


def overlaps(a_start: int, a_length: int, b_start: int, b_length: int) -> bool:
    return a_start < b_start + b_length and b_start < a_start + a_length


def conflicts(server: Server, earlier: Move, later: Move) -> bool:
    """Whether the two slices touch common bytes with at least one of them changing them (refused
    slices touch nothing)."""
    if not (is_inside(server, earlier) and is_inside(server, later)):
        return False
    writes = TransferOp.WRITE in (earlier.op, later.op)  # a WRITE changes the remote range
    reads = TransferOp.READ in (earlier.op, later.op)  # a READ changes the local range
    remote = earlier.region == later.region and overlaps(
        earlier.remote_offset, earlier.length, later.remote_offset, later.length
    )
    local = overlaps(earlier.local_offset, earlier.length, later.local_offset, later.length)
    return (remote and writes) or (local and reads)


def waves(server: Server, drawn: list[Move]) -> list[list[int]]:
    """Indices of `drawn` in waves: a slice runs in a wave after every earlier slice it conflicts with,
    so the concurrent result equals applying the slices in order."""
    wave_of: list[int] = []
    for index, move in enumerate(drawn):
        wave_of.append(1 + max((wave_of[j] for j in range(index) if conflicts(server, drawn[j], move)), default=-1))
    return [[i for i, w in enumerate(wave_of) if w == wave] for wave in range(max(wave_of, default=-1) + 1)]


def apply(model: dict[int, bytearray], local: bytearray, move: Move) -> None:
    remote = model[move.region]
    lo, ro, n = move.local_offset, move.remote_offset, move.length
    if move.op == TransferOp.WRITE:
        remote[ro : ro + n] = local[lo : lo + n]
    else:
        local[lo : lo + n] = remote[ro : ro + n]


def is_refusal(error: TransferError | None) -> bool:
    """The server's refusal of a range: a TransferError that is no connection failure."""
    return (
        isinstance(error, TransferError)
        and not isinstance(error, PeerUnavailable | TransferTimeout | ProtocolError)
        and ("outside" in str(error) or "no region" in str(error))
    )


@settings(max_examples=100, deadline=None)
@given(
    data=st.data(),
    streams=st.integers(1, 4),
    checksums=st.booleans(),
    inline=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_slices_move_exactly_the_model_bytes_and_out_of_bounds_ones_move_none(
    server: Server,
    transports: dict[tuple[int, bool], tcp.TcpTransport],
    data: st.DataObject,
    streams: int,
    checksums: bool,
    inline: bool,
    seed: int,
) -> None:
    """A random batch of READ and WRITE slices through a TcpTransport leaves the server's regions and the
    client's local buffer byte for byte as a model applying the slices in order says; each slice's
    on_done is called once, with None when its range is inside its region, and with the server's
    refusal (a TransferError naming the range) when it is not, which changes no byte at either end."""
    drawn = data.draw(st.lists(moves(server), min_size=1, max_size=10), label="slices")
    model = server.reset(seed)
    local = bytearray(np.random.default_rng(seed + 1).integers(0, 256, LOCAL, dtype=np.uint8).tobytes())
    local_model = bytearray(local)
    transport = transport_for(transports, server, streams, checksums)
    outcomes: list[list[TransferError | None]] = [[] for _ in drawn]
    lock = threading.Lock()
    view = memoryview(local)
    for wave in waves(server, drawn):
        finished = threading.Semaphore(0)
        for index in wave:
            move = drawn[index]

            def done(error: TransferError | None, index: int = index, finished: threading.Semaphore = finished) -> None:
                with lock:
                    outcomes[index].append(error)
                finished.release()

            piece = Slice(
                move.op,
                view[move.local_offset : move.local_offset + move.length],
                move.region,
                move.remote_offset,
                done,
            )
            if inline:
                done(transport.run_inline(piece))
            else:
                transport.submit(piece)
        for _ in wave:
            assert finished.acquire(timeout=30), "a slice never ended"
        for index in wave:
            if is_inside(server, drawn[index]):
                apply(model, local_model, drawn[index])
    server.assert_equals(model)
    assert local == local_model, "the local buffer differs from its model"
    for move, ended in zip(drawn, outcomes, strict=True):
        assert len(ended) == 1, (move, ended)
        if is_inside(server, move):
            assert ended[0] is None, (move, ended[0])
        else:
            assert is_refusal(ended[0]), (move, ended[0])
    server.engine.check_invariants()


# --------------------------------------------------------------------------- raw frames on one connection


@attrs.frozen
class RawFrame:
    """One client frame on the wire and how its checksum is treated."""

    kind: Kind  # WRITE or READ
    region: int
    offset: int
    length: int
    checksum: str  # WRITE: none | good | wrong | corrupted; READ: none | asked
    seed: int


@st.composite
def raw_frames(draw: st.DrawFn, server: Server) -> RawFrame:
    kind = draw(st.sampled_from([Kind.WRITE, Kind.READ]))
    region = draw(st.sampled_from([*server.arrays, UNKNOWN_REGION]))
    size = server.size(region)
    if draw(st.booleans()):  # inside: empty, all of it, anything, or more than a connection's own staging buffer
        large = st.integers(min(size, (64 << 10) + 1), size)
        length = draw(st.sampled_from([0, size]) | st.integers(0, size) | large)
        offset = draw(st.integers(0, size - length))
    else:  # past the end; its payload must still be consumed
        length = draw(st.integers(1, BIG))
        offset = draw(st.integers(max(0, size - length + 1), size + 10))
    modes = ["none", "good", "wrong", "corrupted"] if kind == Kind.WRITE else ["none", "asked"]
    checksum = draw(st.sampled_from(modes))
    if checksum == "corrupted" and length == 0:
        checksum = "wrong"  # no byte to corrupt
    return RawFrame(kind, region, offset, length, checksum, draw(st.integers(0, 2**16)))


@settings(max_examples=100, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_a_raw_connection_changes_the_region_only_by_verified_in_bounds_writes(
    server: Server, data: st.DataObject, seed: int
) -> None:
    """A sequence of WRITE and READ frames on one authenticated connection, checksums absent, right,
    wrong or of a payload corrupted on the way, ranges in or out of bounds: every frame is answered in
    order with its own tag; a WRITE is OK exactly when its range is inside and its payload verifies, and
    only then does the region change (staged in the connection's buffer or the staging pool, a payload
    that fails leaves the region as it was); a refused WRITE's payload is consumed, so the next frame
    is read in step; a READ returns the model's bytes, with their checksum when asked."""
    frames = data.draw(st.lists(raw_frames(server), min_size=1, max_size=8), label="frames")
    model = server.reset(seed)
    with authenticated(server) as sock:
        for tag, frame in enumerate(frames, start=1):
            inside = frame.region in server.arrays and frame.offset + frame.length <= server.size(frame.region)
            if frame.kind == Kind.WRITE:
                payload = bytearray(
                    np.random.default_rng(frame.seed).integers(0, 256, frame.length, np.uint8).tobytes()
                )
                header = Frame(Kind.WRITE, tag, frame.region, frame.offset, frame.length)
                checksum = (
                    None if frame.checksum == "none" else bind_checksum(header, xxhash.xxh3_64_intdigest(payload))
                )
                if frame.checksum == "wrong":
                    checksum = (checksum or 0) ^ 1
                elif frame.checksum == "corrupted":
                    payload[frame.seed % frame.length] ^= 0xFF
                header = attrs.evolve(header, checksum=checksum)
                send_frame(sock, header, bytes(payload))
                accepted = inside and frame.checksum in ("none", "good")
                reply = recv_frame(sock, max_length=MAX_FRAME)
                assert reply.tag == tag
                if accepted:
                    assert reply.kind == Kind.OK and reply.length == 0
                    model[frame.region][frame.offset : frame.offset + frame.length] = payload
                else:
                    message = bytearray(reply.length)
                    recv_exact(sock, memoryview(message))
                    assert reply.kind == Kind.ERROR, frame
                    expected = b"checksum" if inside else b"outside" if frame.region in server.arrays else b"no region"
                    assert expected in message, (frame, message)
            else:
                asked = 0 if frame.checksum == "asked" else None
                read = Frame(Kind.READ, tag, frame.region, frame.offset, frame.length, asked)
                send_frame(sock, read)
                reply = recv_frame(sock, max_length=MAX_FRAME)
                assert reply.tag == tag
                body = bytearray(reply.length)
                recv_exact(sock, memoryview(body))
                if inside:
                    expected_bytes = bytes(model[frame.region][frame.offset : frame.offset + frame.length])
                    assert reply.kind == Kind.OK and bytes(body) == expected_bytes
                    expected_checksum = bind_checksum(read, xxhash.xxh3_64_intdigest(expected_bytes))
                    assert reply.checksum == (None if asked is None else expected_checksum)
                else:
                    assert reply.kind == Kind.ERROR, frame
            server.assert_equals(model)
    server.engine.check_invariants()


# --------------------------------------------------------------------------- malformed and cut frames


@pytest.fixture(scope="module")
def quiet_server() -> Iterator[Server]:
    """A server of its own, with no other client, so its count of served connections is this test's."""
    served = start_server()
    try:
        yield served
    finally:
        served.engine.close()


def header_bytes(magic: bytes, version: int, kind: int, flags: int, length: int) -> bytes:
    return HEADER.pack(magic, version, kind, flags, 0, 9, 0, length, 0)


# Headers no client may send, each breaking one rule: magic, version, unknown flag bits, unknown kind, a kind
# only a server sends, a data frame over max_frame_bytes, a control frame over MAX_CONTROL_BYTES.
malformed_headers = st.one_of(
    st.binary(min_size=4, max_size=4).filter(lambda m: m != MAGIC).map(lambda m: header_bytes(m, VERSION, 2, 0, 8)),
    st.integers(0, 255).filter(lambda v: v != VERSION).map(lambda v: header_bytes(MAGIC, v, 2, 0, 8)),
    st.integers(2, 0xFFFF).map(lambda f: header_bytes(MAGIC, VERSION, Kind.READ, f & ~1 or 2, 8)),
    st.integers(0, 255).filter(lambda k: k not in set(Kind)).map(lambda k: header_bytes(MAGIC, VERSION, k, 0, 8)),
    st.sampled_from([Kind.OK, Kind.ERROR, Kind.REPLY]).map(lambda k: header_bytes(MAGIC, VERSION, k, 0, 0)),
    st.tuples(st.sampled_from([Kind.READ, Kind.WRITE]), st.integers(MAX_FRAME + 1, 2**64 - 1)).map(
        lambda kl: header_bytes(MAGIC, VERSION, kl[0], 0, kl[1])
    ),
    st.integers(MAX_CONTROL_BYTES + 1, 2**64 - 1).map(lambda n: header_bytes(MAGIC, VERSION, Kind.CALL, 0, n)),
)


@st.composite
def cut_frames(draw: st.DrawFn, region: int, size: int) -> tuple[bytes, int, Frame]:
    """A valid WRITE (checksummed or not), READ or CALL, and a cut point strictly inside it."""
    kind = draw(st.sampled_from([Kind.WRITE, Kind.READ, Kind.CALL]))
    if kind == Kind.CALL:
        payload = b'{"method": "describe", "args": null}'
        frame = Frame(Kind.CALL, tag=0, length=len(payload))
    else:
        length = draw(st.integers(1, size))
        offset = draw(st.integers(0, size - length))
        payload = bytes(np.random.default_rng(length).integers(0, 256, length, np.uint8)) if kind == Kind.WRITE else b""
        checksum = xxhash.xxh3_64_intdigest(payload) if kind == Kind.WRITE and draw(st.booleans()) else None
        frame = Frame(kind, tag=3, region=region, offset=offset, length=length, checksum=checksum)
    whole = frame.pack() + payload
    return whole, draw(st.integers(1, len(whole) - 1)), frame


def holds_a_prefix(landed: bytes, before: bytes, payload: bytes, arrived: int) -> bool:
    """Whether `landed` is `payload[:k] + before[k:]` for some k at most `arrived`."""
    now, old, new = (np.frombuffer(b, np.uint8) for b in (landed, before, payload))
    from_payload = np.flatnonzero(now != new)  # the prefix that matches the payload ends at the first of these
    prefix = int(from_payload[0]) if from_payload.size else now.size
    from_before = np.flatnonzero(now != old)  # the suffix that matches the old bytes starts after the last
    suffix_start = int(from_before[-1]) + 1 if from_before.size else 0
    return suffix_start <= min(prefix, max(arrived, 0))


@settings(max_examples=100, deadline=None)
@given(data=st.data(), malformed=st.booleans(), seed=st.integers(0, 2**16))
def test_a_malformed_or_cut_frame_ends_its_connection_and_the_server_serves_the_next(
    quiet_server: Server, data: st.DataObject, malformed: bool, seed: int
) -> None:
    """A header breaking any rule of the wire (the client keeping its end open), or a valid frame cut short
    (the client then closing its sending side): the server closes that connection and its serving thread
    ends; a cut checksummed WRITE leaves the region as it was, a cut unchecksummed one at most a prefix of
    the payload bytes that arrived (the module's documented trade), nothing past them and nothing outside its
    range; the next client's READ returns the model's bytes."""
    server = quiet_server
    region = next(iter(server.arrays))
    size = server.size(region)
    model = server.reset(seed)
    # The previous example's last connection may still be ending: this server has no other clients.
    wait_for(lambda: server.engine.listener.num_served == 0, timeout=10, what="earlier connections to end")
    baseline = 0
    frame, whole = None, b""
    with authenticated(server) as sock:
        wait_for(lambda: server.engine.listener.num_served == baseline + 1, timeout=10, what="the connection served")
        if malformed:
            sock.sendall(data.draw(malformed_headers, label="header"))  # nothing after it: the header alone ends it
        else:
            whole, cut, frame = data.draw(cut_frames(region, size), label="cut frame")
            sock.sendall(whole[:cut])
            sock.shutdown(socket.SHUT_WR)
        assert closed_by_peer(sock, timeout_s=10), "the server kept the connection open"
    wait_for(lambda: server.engine.listener.num_served == baseline, timeout=10, what="the serving thread to end")
    if frame is not None and frame.kind == Kind.WRITE and frame.checksum is None:
        # Received straight into the region: some prefix of what arrived may be there, nothing else.
        start, end = frame.offset, frame.offset + frame.length
        landed = server.arrays[region][start:end].tobytes()
        assert holds_a_prefix(landed, bytes(model[region][start:end]), whole[HEADER.size :], cut - HEADER.size)
        model[region][start:end] = landed
    server.assert_equals(model)
    server.engine.check_invariants()
    with authenticated(server) as sock:
        read = Frame(Kind.READ, tag=1, region=region, offset=0, length=size, checksum=0)
        send_frame(sock, read)
        reply = recv_frame(sock, max_length=MAX_FRAME)
        body = bytearray(reply.length)
        recv_exact(sock, memoryview(body))
        assert reply.kind == Kind.OK and bytes(body) == bytes(model[region])
        assert reply.checksum == bind_checksum(read, xxhash.xxh3_64_intdigest(body))
