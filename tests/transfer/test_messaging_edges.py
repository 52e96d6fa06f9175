"""Edges of the transfer engine's messaging: frames and handshakes a peer gets wrong, peers that drop, stall
or lie, configs and descriptors at the ends of their ranges, and the sockets and threads that must be gone.

- `wire`: a header reads back as packed (a checksum of 0 included) and is accepted exactly up to its kind's
  bound; a deadline bounds a read even on a socket whose own timeout is longer; a "server" that cannot
  prove the secret never gets a client through, and each way it fails is told apart.
- `request`: each EngineConfig field is accepted exactly in its range, slices fit frames fit staging.
- `peers` / `listener`: descriptor integers at their wire ranges; a control call that provably never left
  is sent once more on a fresh connection, one cut after it left (or answered out of protocol) is never
  repeated and is PeerUnavailable; reconnecting, a refused connect and `close` leave nothing served.
- `messenger`: a peer that answers for other keys, or whose bytes never arrive or come late, gets nothing
  committed and holds nothing here; aborts and `close` end leases (quarantined ones too) and the sweeper; a
  malformed commit is refused with its lease kept, and one that fails midway still ends its lease.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import xxhash
from hypothesis import example, given
from hypothesis import strategies as st

from mooncake.cache.tiered import TieredCache
from mooncake.errors import (
    AuthenticationError,
    ConfigError,
    InvalidRequestError,
    PeerUnavailable,
    TransferError,
    TransferTimeout,
)
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.listener import Listener
from mooncake.transfer.messenger import Messenger, shared_dram_pool
from mooncake.transfer.peers import PeerDescriptor
from mooncake.transfer.request import EngineConfig
from mooncake.transfer.wire import (
    ANSWER_BYTES,
    BUSY,
    HEADER,
    INCARNATION_BYTES,
    MAX_CONTROL_BYTES,
    REFUSED,
    VERSION,
    Agreement,
    Frame,
    Json,
    Kind,
    ProtocolError,
    client_handshake,
    new_incarnation,
    recv_exact,
    recv_frame,
    send_frame,
    server_hello,
    server_verdict,
)
from mooncake.types import BlockKey
from tests.transfer.conftest import SECRET
from tests.transfer.test_messenger import PAGE, Node, block, make_node
from tests.waiting import wait_for

DATA_KINDS = (Kind.WRITE, Kind.READ, Kind.OK)  # bounded by the engine's max_frame_bytes; the rest by MAX_CONTROL_BYTES
HELLO_BYTES = len(server_hello()[1])


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected socket pair (peer end, our end), both closed at the end."""
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


# ---------------------------------------------------------------------------------------------------- wire


@given(
    kind=st.sampled_from(list(Kind)),
    max_length=st.integers(1, 1 << 24),
    delta=st.sampled_from([-1, 0, 1]) | st.integers(-(1 << 20), 1 << 20),
)
@example(kind=Kind.OK, max_length=1024, delta=1)  # an OK answers a READ: a data frame
@example(kind=Kind.CALL, max_length=1024, delta=0)  # a control frame: its own bound
@example(kind=Kind.WRITE, max_length=1024, delta=0)
def test_a_header_is_accepted_exactly_up_to_the_bound_of_its_kind(kind: Kind, max_length: int, delta: int) -> None:
    """Data frames (WRITE, READ and OK, which answers a READ with its bytes) are bounded by `max_length`,
    control frames by MAX_CONTROL_BYTES; a length at the bound is accepted, one past it is a ProtocolError
    that names the kind and both numbers."""
    bound = max_length if kind in DATA_KINDS else MAX_CONTROL_BYTES
    length = max(0, bound + delta)
    a, b = socket.socketpair()
    try:
        a.sendall(Frame(kind, tag=3, length=length).pack())
        if length <= bound:
            assert recv_frame(b, max_length=max_length, deadline=time.monotonic() + 5) == Frame(
                kind, tag=3, length=length
            )
        else:
            with pytest.raises(ProtocolError, match=f"{kind.name} frame of {length} bytes .* bound of {bound}$"):
                recv_frame(b, max_length=max_length, deadline=time.monotonic() + 5)
    finally:
        a.close()
        b.close()


@given(
    kind=st.sampled_from(list(Kind)),
    checksum=st.sampled_from([None, 0, 1, 2**64 - 1]) | st.integers(0, 2**64 - 1),
    tag=st.sampled_from([0, 2**64 - 1]) | st.integers(0, 2**64 - 1),
    offset=st.sampled_from([0, 2**64 - 1]) | st.integers(0, 2**64 - 1),
)
@example(kind=Kind.READ, checksum=0, tag=0, offset=0)
def test_a_packed_header_reads_back_as_it_was_with_its_checksum_or_none(
    kind: Kind, checksum: int | None, tag: int, offset: int
) -> None:
    """Packing and reading a header is the identity, at the ends of every u64 field too, and a checksum of 0
    is a checksum (the flag says one is carried), not its absence: READ asks for one with 0."""
    frame = Frame(kind, tag=tag, region=2**32 - 1, offset=offset, length=0, checksum=checksum)
    a, b = socket.socketpair()
    try:
        a.sendall(frame.pack())
        assert recv_frame(b, max_length=1, deadline=time.monotonic() + 5) == frame
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("sent", [0, 1, HEADER.size - 1])
def test_a_deadline_bounds_a_header_read_whatever_the_sockets_own_timeout(
    pair: tuple[socket.socket, socket.socket], sent: int
) -> None:
    """A peer that sends part of a header (or none) and then nothing holds a reader only until its deadline,
    even on a socket whose own timeout is far longer (a connection's io_timeout_s): TimeoutError, not a wait."""
    peer, ours = pair
    peer.sendall(Frame(Kind.WRITE, length=1).pack()[:sent])
    ours.settimeout(8.0)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        recv_frame(ours, max_length=1 << 20, deadline=started + 0.3)
    assert time.monotonic() - started < 4.0


def good_hello() -> bytes:
    return server_hello()[1]


# What a "server" that does not know the client's nonce in advance can send: a hello (this protocol's, or
# bytes of another one), then a verdict and proof of any bytes, then it hangs up.
server_streams = st.one_of(
    st.builds(lambda proof: good_hello() + b"OK" + proof, st.binary(min_size=48, max_size=48)),  # an impostor
    st.builds(lambda rest: good_hello() + rest, st.binary(max_size=40)),
    st.builds(
        lambda verdict, rest: good_hello() + verdict + rest,
        st.sampled_from([b"OK", BUSY, REFUSED]),
        st.binary(max_size=40),
    ),
    st.builds(
        lambda version, rest: good_hello()[:10] + bytes([version]) + os.urandom(32) + rest,
        st.integers(0, 255).filter(lambda v: v != VERSION),
        st.binary(max_size=40),
    ),
    st.binary(max_size=HELLO_BYTES + 40),
)


def expected_handshake_error(stream: bytes) -> tuple[type[BaseException], ...]:
    """The model: which error a client meets from a server that sent `stream` and hung up."""
    hello, verdict = stream[:HELLO_BYTES], stream[HELLO_BYTES : HELLO_BYTES + 2]
    if len(hello) < HELLO_BYTES:
        return (ConnectionError,)  # it hung up before it said what it is
    if hello[:10] != b"MCTE-HELLO" or hello[10] != VERSION:
        return (ProtocolError,)
    if verdict == BUSY:
        return (PeerUnavailable,)
    if verdict == b"OK" and len(stream) < HELLO_BYTES + 2 + INCARNATION_BYTES + 32:
        return (AuthenticationError, ConnectionError)  # hung up before its incarnation and proof
    return (AuthenticationError,)  # refused, cut in the verdict, another verdict, or a proof it cannot make


@given(stream=server_streams)
@example(stream=b"MCTE-HELLO" + bytes([1]) + bytes(32) + b"OK")  # another version (the one before this)
@example(stream=b"MCTE-HELLO" + bytes([VERSION]) + bytes(32))  # hangs up after its hello
@example(stream=b"MCTE-HELLO" + bytes([VERSION]) + bytes(32) + BUSY)
@example(stream=b"MCTE-HELLO" + bytes([VERSION]) + bytes(32) + b"OK" + bytes(48))  # an impostor
@example(stream=b"MCTE-HELLO" + bytes([VERSION]) + bytes(32) + b"OK" + bytes(16))  # hangs up before its proof
def test_a_server_that_cannot_prove_the_secret_never_lets_a_client_through(stream: bytes) -> None:
    """Whatever a server sends without knowing the secret, `client_handshake` fails within its deadline, and
    the way it failed tells what happened: ProtocolError for another protocol or version, PeerUnavailable for
    "busy", AuthenticationError for a refusal, a cut verdict or a proof that does not verify (an impostor's
    "OK" included); ConnectionError only when the stream ends before the hello (or, after "OK", the proof)."""
    a, b = socket.socketpair()
    try:
        a.sendall(stream)
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(expected_handshake_error(stream)) as caught:
            client_handshake(b, SECRET, deadline=time.monotonic() + 5)
        assert not isinstance(caught.value, TimeoutError)
    finally:
        a.close()
        b.close()


def test_a_server_that_knows_the_secret_lets_the_client_through(pair: tuple[socket.socket, socket.socket]) -> None:
    """The other half of the model above: a server that proves the secret completes the handshake (so the
    failures above are failures of the server, not of the client)."""
    server, client = pair
    outcome: list[object] = []
    incarnation = new_incarnation()

    def serve() -> None:
        nonce, hello = server_hello()
        server.sendall(hello)
        answer = bytearray()
        while len(answer) < ANSWER_BYTES:
            chunk = server.recv(ANSWER_BYTES - len(answer))
            if not chunk:
                break
            answer += chunk
        reply, _agreement = server_verdict(SECRET, nonce, bytes(answer), incarnation=incarnation)
        outcome.append(reply)
        server.sendall(reply)

    server.settimeout(5)
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        told = client_handshake(client, SECRET, deadline=time.monotonic() + 5)
    finally:
        thread.join(timeout=10)
    assert not thread.is_alive() and len(outcome) == 1
    assert told == incarnation


@given(answer=st.binary(max_size=2 * ANSWER_BYTES).filter(lambda a: len(a) != ANSWER_BYTES))
def test_a_handshake_answer_of_another_length_is_refused_naming_both_lengths(answer: bytes) -> None:
    """The server's check of an answer that is not ANSWER_BYTES long is an AuthenticationError that says
    how long an answer is and how long this one was."""
    nonce, _hello = server_hello()
    with pytest.raises(AuthenticationError, match=f"{ANSWER_BYTES} bytes, got {len(answer)}$"):
        server_verdict(SECRET, nonce, answer, incarnation=new_incarnation())


# ---------------------------------------------------------------------------------------------------- config

# Each checked field of EngineConfig: the least integer it takes and the most (None: no most), or for a
# duration that it is a finite number above 0.
INT_RANGES: dict[str, tuple[int, int | None]] = {
    "port": (0, 65535),
    "streams_per_peer": (1, None),
    "max_connections": (1, None),
    "max_unauthenticated_connections": (1, None),
    "max_retries": (0, 2**31 - 1),  # counts the system takes as a C int, or that feed float sums
    "spin_us": (0, 2**31 - 1),
    "socket_buffer_bytes": (0, 2**31 - 1),
}
DURATIONS = ("io_timeout_s", "idle_timeout_s", "auth_timeout_s", "connect_timeout_s")


def config_cases() -> list[tuple[str, object, bool]]:
    """Every checked EngineConfig field with each value at or past the ends of its range (or of another
    type), and whether it is valid."""
    cases: list[tuple[str, object, bool]] = []
    for field, (low, high) in sorted(INT_RANGES.items()):
        near = [low - 1, low, low + 1] + ([high - 1, high, high + 1] if high is not None else [1 << 40])
        for value in [*near, True, 1.0, "1", None]:
            valid = isinstance(value, int) and not isinstance(value, bool) and value >= low
            cases.append((field, value, valid and (high is None or value <= high)))  # type: ignore[operator]
    for field in DURATIONS:
        for duration in [0, 0.0, -0.0, -1e-9, 1e-9, 1, 3.5, float("inf"), float("nan"), True, "1", None]:
            number = isinstance(duration, int | float) and not isinstance(duration, bool)
            cases.append((field, duration, number and 0 < duration < float("inf")))  # type: ignore[operator]
    return cases


@pytest.mark.parametrize("case", config_cases(), ids=lambda case: f"{case[0]}={case[1]!r}")
def test_an_engine_config_field_is_accepted_exactly_in_its_range(case: tuple[str, object, bool]) -> None:
    """Counts are integers from their least value (a port also at most 65535, retries from 0, a C int's counts
    below 2**31), durations finite numbers above 0 (a timeout of 0 would fail every socket operation at once);
    any other value is a ConfigError naming the field."""
    field, value, valid = case
    if valid:
        assert getattr(EngineConfig(**{field: value}), field) == value  # type: ignore[arg-type]
    else:
        with pytest.raises(ConfigError, match=f"^{field} must be"):
            EngineConfig(**{field: value})  # type: ignore[arg-type]


@given(
    slice_bytes=st.integers(1, 1 << 12),
    max_frame_bytes=st.integers(1, 1 << 12),
    max_staging_bytes=st.integers(1, 1 << 12),
    transports=st.lists(st.sampled_from(["shm", "rdma", "tcp", "udp"]), max_size=4),
)
@example(slice_bytes=64, max_frame_bytes=64, max_staging_bytes=64, transports=["tcp"])
@example(slice_bytes=64, max_frame_bytes=64, max_staging_bytes=64, transports=[])
def test_an_engine_config_is_valid_exactly_when_slices_fit_frames_fit_staging(
    slice_bytes: int, max_frame_bytes: int, max_staging_bytes: int, transports: list[str]
) -> None:
    """A slice must fit one frame and a frame the staging memory (equal sizes fit), and the transports must
    be a non-empty subset of shm, rdma and tcp; otherwise the config is a ConfigError."""
    valid = (
        slice_bytes <= max_frame_bytes <= max_staging_bytes
        and bool(transports)
        and set(transports) <= {"shm", "rdma", "tcp"}
    )
    fields = {
        "slice_bytes": slice_bytes,
        "max_frame_bytes": max_frame_bytes,
        "max_staging_bytes": max_staging_bytes,
        "transports": tuple(transports),
    }
    if valid:
        EngineConfig(**fields)  # type: ignore[arg-type]
    else:
        with pytest.raises(ConfigError):
            EngineConfig(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("transports", [None, 5, 1.5, [["tcp"]], [{"tcp": 1}], "tcp"], ids=repr)
def test_transports_that_are_no_names_are_a_config_error(transports: object) -> None:
    """Like every other field, `transports` refuses a bad value with a ConfigError naming it."""
    with pytest.raises(ConfigError, match="transports"):
        EngineConfig(transports=transports)  # type: ignore[arg-type]


def test_the_default_streams_per_peer_is_half_the_cpus_from_2_to_8(monkeypatch: pytest.MonkeyPatch) -> None:
    """By default a peer gets half the CPUs as streams, never fewer than 2 nor more than 8 (and 2 where
    the CPU count is unknown)."""
    for cpus, streams in ((None, 2), (1, 2), (2, 2), (4, 2), (6, 3), (16, 8), (64, 8)):
        monkeypatch.setattr(os, "cpu_count", lambda cpus=cpus: cpus)
        assert EngineConfig().streams_per_peer == streams, cpus


# ---------------------------------------------------------------------------------------------------- peers

TCP_ONLY = EngineConfig(
    transports=("tcp",),  # type: ignore[arg-type]
    streams_per_peer=1,
    io_timeout_s=5.0,
    connect_timeout_s=5.0,
)


@pytest.fixture
def two() -> Iterator[tuple[TransferEngine, TransferEngine]]:
    """Two engines over TCP, one stream per peer (so a peer costs its engine two served connections)."""
    a, b = TransferEngine(secret=SECRET, config=TCP_ONLY), TransferEngine(secret=SECRET, config=TCP_ONLY)
    yield a, b
    a.close()
    b.close()


def counting(calls: list[Any]) -> Callable[[Any], int]:
    """A control-call handler that records its arguments and answers how many calls it has run."""

    def handler(args: Any) -> int:
        calls.append(args)
        return len(calls)

    return handler


def served(engine: TransferEngine | Listener, count: int, what: str) -> None:
    """Wait until `engine` serves `count` authenticated connections."""
    wait_for(
        lambda: (engine if isinstance(engine, Listener) else engine.listener).num_served == count,
        timeout=15,
        what=f"{what} ({count} served)",
    )


def test_reconnecting_and_closing_leave_no_connection_behind(two: tuple[TransferEngine, TransferEngine]) -> None:
    """A peer dialled again (the same engine, over the same transports) is kept, and the control connection the
    new dial opened is closed; one dialled over other transports is replaced, its control connection and streams
    closed (the peer serves one set, not one per connect); closing the engine closes the last set too."""
    a, b = two
    # Each peer record is kept alive here: its connections must be closed, not merely dropped for the collector
    # to close.
    records = [a._peers._peers[a.connect(b.address)]]
    served(b, 2, "a control connection and a stream")
    for _ in range(3):
        records.append(a._peers._peers[a.connect(b.address)])
    served(b, 2, "only the first peer's connections")
    assert all(record is records[0] for record in records)
    records.append(a._peers._peers[a.connect(b.address, transport="shm")])
    served(b, 1, "only the newest peer's control connection (shm needs no stream)")
    assert records[-1] is not records[0]
    assert records[0].control is None or records[0].control.fileno() == -1
    a.close()
    served(b, 0, "nothing after the dialler closed")
    assert all(peer.control is None or peer.control.fileno() == -1 for peer in records)


@pytest.mark.parametrize("how", ["malformed-descriptor", "no-usable-transport"])
def test_a_refused_connect_leaves_no_connection_open(two: tuple[TransferEngine, TransferEngine], how: str) -> None:
    """A connect that fails after authenticating (the descriptor does not validate, or no transport the caller
    allows reaches the peer) closes its control connection: the peer serves nothing for it."""
    a, b = two
    # The error is kept (and with it the frames of the failed connect, their sockets included) until the
    # check: the control connection must have been closed, not merely dropped for the collector to close.
    if how == "malformed-descriptor":
        b.register_handler("describe", lambda _args: {"name": "b", "host_id": "x", "pid": -1, "regions": []})
        with pytest.raises(TransferError, match="pid") as caught:
            a.connect(b.address)
    else:
        with pytest.raises(ConfigError, match="no usable transport") as caught:  # type: ignore[assignment]
            a.connect(b.address, transport="rdma")
    served(b, 0, "no connection left after a refused connect")
    assert caught.value.__traceback__ is not None


def test_a_control_call_that_never_left_is_sent_once_on_a_fresh_connection(
    two: tuple[TransferEngine, TransferEngine],
) -> None:
    """A control connection that can no longer send (the call provably never reached the peer) is replaced
    and the call sent once on the new one: the handler runs exactly once per call."""
    a, b = two
    calls: list[Any] = []
    b.register_handler("count", counting(calls))
    peer = a.connect(b.address)
    assert a.call(peer, "count", "first") == 1
    control = a._peers._peers[peer].control
    assert control is not None
    control.shutdown(socket.SHUT_WR)  # stale: a send on it fails before any byte leaves
    assert a.call(peer, "count", "second") == 2
    assert calls == ["first", "second"]


def test_a_control_call_cut_after_it_left_is_reported_and_never_repeated(
    two: tuple[TransferEngine, TransferEngine],
) -> None:
    """A call whose connection drops while the peer runs it may have run: it fails with PeerUnavailable
    and is not sent again (it may not be idempotent); the next call goes over a fresh connection."""
    a, b = two
    calls: list[Any] = []
    entered, release = threading.Event(), threading.Event()

    def slow(args: Any) -> Any:
        calls.append(args)
        entered.set()
        release.wait(10)
        return "late"

    b.register_handler("slow", slow)
    b.register_handler("count", counting(calls))
    peer = a.connect(b.address)
    outcome: list[BaseException | object] = []

    def caller() -> None:
        try:
            outcome.append(a.call(peer, "slow", "once"))
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=caller, daemon=True)
    thread.start()
    try:
        assert entered.wait(10), "the call never reached the peer"
        for sock in list(b.listener._served):  # the peer drops every connection, as a restarting process would
            sock.shutdown(socket.SHUT_RDWR)
    finally:
        release.set()
        thread.join(timeout=20)
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], PeerUnavailable), outcome
    assert a.call(peer, "count", "next") == 2
    assert calls == ["once", "next"]


@pytest.mark.parametrize(
    ("field", "value", "valid"),
    [
        ("pid", 1, True),
        ("pid", 2**31 - 1, True),
        ("pid", 2**31, False),
        ("pid", 0, False),
        ("region_id", 2**64 - 1, True),
        ("region_id", 2**64, False),
        ("length", 2**64 - 1, True),
        ("length", 2**64, False),
        ("rdma_address", 2**64 - 1, True),
        ("rdma_rkey", 2**64, False),
    ],
)
def test_a_descriptor_integer_is_accepted_exactly_up_to_its_wire_range(field: str, value: int, valid: bool) -> None:
    """A pid is a positive pid_t (below 2**31); a region's integers are u64s (below 2**64): the last value
    in range is taken, the first past it refused as a malformed descriptor."""
    region = {"region_id": 1, "length": 64, "shm_name": None, "rdma_address": None, "rdma_rkey": None}
    data: dict[str, Any] = {"name": "p", "host_id": "h", "pid": 7, "regions": [region], "rdma": False}
    if field == "pid":
        data["pid"] = value
    else:
        region[field] = value
    if valid:
        descriptor = PeerDescriptor.from_json(data)
        assert descriptor.pid == value if field == "pid" else getattr(descriptor.regions[0], field) == value
    else:
        with pytest.raises(TransferError, match=f"malformed segment descriptor: {field}="):
            PeerDescriptor.from_json(data)


@pytest.mark.parametrize("field", ["region_id", "length", "shm_name", "rdma_address", "rdma_rkey"])
def test_only_a_region_s_optional_fields_may_be_null(field: str) -> None:
    """A region descriptor's shm_name and RDMA address and key may be null (a region not shared, not registered
    with a device); its id and length may not: a descriptor that gives either as null is refused as malformed
    at connect. (It was kept as validated, and the next submit or transfer_sync to the region was a bare
    TypeError, None compared with an int.)"""
    region: dict[str, Any] = {"region_id": 1, "length": 64, "shm_name": None, "rdma_address": None, "rdma_rkey": None}
    region[field] = None
    data = {"name": "p", "host_id": "h", "pid": 7, "regions": [region], "rdma": False}
    if field in ("region_id", "length"):
        with pytest.raises(TransferError, match=f"malformed segment descriptor: {field}=None"):
            PeerDescriptor.from_json(data)
    else:
        assert getattr(PeerDescriptor.from_json(data).regions[0], field) is None


def test_a_peer_describing_a_region_of_null_length_is_refused_at_connect() -> None:
    """End to end: a peer (buggy, or of another version) whose descriptor lists a region of length null is
    refused by connect with a TransferError naming the field, and nothing of it is kept."""
    with (
        TransferEngine(secret=SECRET, config=TCP_ONLY) as here,
        TransferEngine(secret=SECRET, config=TCP_ONLY) as there,
    ):
        region = there.register_memory(bytearray(4096))
        described: Any = there.handle_call("describe", None)
        described["regions"] = [{"region_id": region.region_id, "length": None}]
        there.register_handler("describe", lambda _args: described)
        with pytest.raises(TransferError, match="malformed segment descriptor: length=None"):
            here.connect(there.address)
        with pytest.raises(TransferError, match="unknown peer"):
            here.peer_regions(there.address)


class OffProtocolPeer:
    """An engine look-alike on 127.0.0.1: authenticates and answers "describe" as an engine does (no region,
    another host), then answers any other call with a REPLY of another tag (no reply to that call)."""

    def __init__(self) -> None:
        self.listener = Listener(secret=SECRET, config=TCP_ONLY, serve=self._serve, name="off-protocol")
        self.address = f"{self.listener.host}:{self.listener.port}"

    @staticmethod
    def _serve(sock: socket.socket, _agreement: Agreement) -> None:
        sock.settimeout(10)
        while True:
            frame = recv_frame(sock, max_length=MAX_CONTROL_BYTES)
            body = bytearray(frame.length)
            recv_exact(sock, memoryview(body))
            if json.loads(body)["method"] == "describe":
                reply = json.dumps({"name": "fake", "host_id": "elsewhere", "pid": 1, "regions": []}).encode()
                send_frame(sock, Frame(Kind.REPLY, length=len(reply)), reply)
            else:
                send_frame(sock, Frame(Kind.REPLY, tag=9, length=2), b"{}")


def test_a_peer_that_answers_out_of_protocol_is_unavailable_and_its_connection_replaced(
    two: tuple[TransferEngine, TransferEngine],
) -> None:
    """A control call answered with something that is no reply to it fails with PeerUnavailable (the call
    may have run: it is not repeated), the connection it came over is closed, and the next call goes over
    a fresh one."""
    a, _b = two
    fake = OffProtocolPeer()
    try:
        peer = a.connect(fake.address)
        served(fake.listener, 2, "a control connection and a stream")
        with pytest.raises(PeerUnavailable, match="odd"):
            a.call(peer, "odd", None)
        served(fake.listener, 1, "the stream only: the control connection was dropped")
        assert a.call(peer, "describe", None) == {"name": "fake", "host_id": "elsewhere", "pid": 1, "regions": []}
    finally:
        a.close()
        fake.listener.close()


def test_a_call_to_a_peer_that_closed_is_peer_unavailable_and_stays_so(
    two: tuple[TransferEngine, TransferEngine],
) -> None:
    """Once a peer has closed, every control call to it fails with PeerUnavailable (the one that finds the
    connection dropped, and those after it that cannot reconnect), each within the connect timeout."""
    a, b = two
    peer = a.connect(b.address)
    assert a.call(peer, "describe", None)["name"] == b.name  # type: ignore[index, call-overload]
    b.close()
    for _ in range(3):
        started = time.monotonic()
        with pytest.raises(PeerUnavailable):
            a.call(peer, "describe", None)
        assert time.monotonic() - started < TCP_ONLY.connect_timeout_s + 2


def test_a_closed_listener_holds_no_socket_and_no_thread() -> None:
    """`close` ends the gate thread and closes the listening socket and both ends of the wake-up pair
    (nothing of the listener is left for the collector), and a second `close` is harmless."""
    listener = Listener(secret=SECRET, config=TCP_ONLY, serve=lambda _sock, _agreement: None, name="edge")
    with socket.create_connection((listener.host, listener.port), timeout=5):
        wait_for(lambda: listener.num_pending == 1, timeout=10, what="the connection pending")
    listener.close()
    listener.close()
    assert not listener._gate.is_alive()
    assert [s.fileno() for s in (listener._sock, listener._wake_read, listener._wake_write)] == [-1, -1, -1]


# ---------------------------------------------------------------------------------------------------- messenger


@pytest.fixture
def nodes() -> Iterator[tuple[Node, Node, str]]:
    """Two messenger nodes over TCP; the first is connected to the second."""
    a, b = make_node(8, "tcp"), make_node(8, "tcp")
    try:
        yield a, b, a.engine.connect(b.engine.address)
    finally:
        a.engine.close()
        b.engine.close()


def free_pages(node: Node) -> int:
    return node.cache.pools[0].num_free


@pytest.mark.parametrize(
    "answered",
    [[2], [2, 1], [1, 2, 3], [7], [1, 1]],
    ids=["skips-the-first", "reordered", "one-more", "not-asked", "repeated"],
)
def test_a_lookup_answered_for_other_keys_fetches_nothing_and_releases_the_lease(
    nodes: tuple[Node, Node, str], answered: list[int]
) -> None:
    """A peer's lookup answer must be a prefix of the keys asked for, in order; any other answer is a
    TransferError before a page is reserved or a byte read here, and the peer is told to release the lease."""
    a, b, peer = nodes
    for key in (1, 2, 3, 7):
        b.cache.put(BlockKey(key), block(key))
    real_release = b.messenger._serve_release
    released: list[str] = []

    def lookup(_args: Any) -> Any:
        found = []
        for key in answered:
            location = b.cache.location(BlockKey(key))
            assert location is not None
            found.append([key, location.page * PAGE, location.length, b.cache.checksum(BlockKey(key))])
        return {"region": b.messenger.region.region_id, "blocks": found}

    def release(args: Any) -> Any:
        released.append(args["lease"])
        return real_release(args)

    b.engine.register_handler("blocks.lookup", lookup)
    b.engine.register_handler("blocks.release", release)
    free = free_pages(a)
    with pytest.raises(TransferError, match="not asked for"):
        a.messenger.fetch([BlockKey(1), BlockKey(2)], peer)
    assert free_pages(a) == free and len(a.cache) == 0
    assert len(released) == 1


@pytest.mark.parametrize("answered", [[2, 1], [1], [1, 2, 3]], ids=["reordered", "one-less", "one-more"])
def test_a_reservation_answered_for_other_keys_is_refused_and_unpins_what_it_pinned(
    nodes: tuple[Node, Node, str], answered: list[int]
) -> None:
    """A peer's reservation must answer for exactly the keys pushed, in order; any other answer is a
    TransferError, and the local pins the push took are gone (the blocks can be removed)."""
    a, b, peer = nodes
    for key in (1, 2):
        a.cache.put(BlockKey(key), block(key))
    b.engine.register_handler(
        "blocks.reserve",
        lambda _args: {
            "region": b.messenger.region.region_id,
            "blocks": [[k, i * PAGE] for i, k in enumerate(answered)],
        },
    )
    with pytest.raises(TransferError, match="other keys"):
        a.messenger.push([BlockKey(1), BlockKey(2)], peer)
    a.cache.remove(BlockKey(1))  # unpinned: BlockPinnedError otherwise
    a.cache.remove(BlockKey(2))


@pytest.mark.parametrize("parts", [1, 2])
def test_a_block_whose_bytes_never_arrived_is_not_committed_even_if_its_page_matches(
    nodes: tuple[Node, Node, str], parts: int
) -> None:
    """A fetch whose READ fails (the peer points it at a region it does not have: it refuses the READ) commits
    nothing, even where the page here happens to hold bytes that match the peer's checksum (a fresh page of
    zeros): the page goes back."""
    a, b, peer = nodes
    length = 100
    zeros_checksum = xxhash.xxh3_64_intdigest(bytes(length))
    b.engine.register_handler(
        "blocks.lookup", lambda _args: {"region": 4_000_000, "blocks": [[1, 0, length, zeros_checksum]]}
    )
    free = free_pages(a)
    fetch = a.messenger.fetch([BlockKey(1)], peer, parts=parts)
    assert fetch.keys == (1,)
    with pytest.raises(TransferError):
        fetch.wait_part(0, timeout=10)
    assert fetch.finish(timeout=10) == ()
    assert BlockKey(1) not in a.cache and a.cache.location(BlockKey(1)) is None
    assert free_pages(a) == free


@pytest.mark.parametrize("parts", [1, 2])
def test_a_fetch_pointed_past_the_peers_region_is_refused_and_reserves_nothing(
    nodes: tuple[Node, Node, str], parts: int
) -> None:
    """A lookup answer that points past the end of the region the peer described fails the fetch at once (the
    engine refuses the READ whole): no page stays reserved here, nothing is cached, and the peer's pins are
    released."""
    a, b, peer = nodes
    length = 100
    leases: list[str] = []

    def lookup(args: Any) -> Json:
        leases.append(args["lease"])
        return {"region": b.messenger.region.region_id, "blocks": [[1, 1 << 40, length, 0]]}

    released: list[str] = []
    b.engine.register_handler("blocks.lookup", lookup)
    b.engine.register_handler("blocks.release", lambda args: released.append(args["lease"]))
    free = free_pages(a)
    with pytest.raises(TransferError, match="past its end"):
        a.messenger.fetch([BlockKey(1)], peer, parts=parts)
    assert BlockKey(1) not in a.cache and a.cache.location(BlockKey(1)) is None
    assert free_pages(a) == free
    assert released == leases and len(leases) == 1


@pytest.mark.parametrize("parts", [1, 2])
def test_a_push_pointed_past_the_peers_region_is_refused_and_releases_its_reservation(
    nodes: tuple[Node, Node, str], parts: int
) -> None:
    """A reservation answer that points past the end of the region the peer described: the engine refuses the
    WRITE whole, the push fails with that error, the peer is told to release the lease at once (its pages were
    left reserved until the lease expired into quarantine), and the local pin is gone."""
    a, b, peer = nodes
    a.cache.put(BlockKey(1), block(1))
    leases: list[str] = []

    def reserve(args: Any) -> Json:
        leases.append(args["lease"])
        return {"region": b.messenger.region.region_id, "blocks": [[1, 1 << 40]]}

    released: list[str] = []
    b.engine.register_handler("blocks.reserve", reserve)
    b.engine.register_handler("blocks.release", lambda args: released.append(args["lease"]))
    push = a.messenger.push([BlockKey(1)], peer, parts=parts)
    with pytest.raises(TransferError, match="past its end"):
        push.finish(timeout=10)
    assert push.finish(timeout=10) == ()
    assert released == leases and len(leases) == 1
    a.cache.remove(BlockKey(1))  # unpinned: BlockPinnedError otherwise


def test_a_commit_without_a_checksum_for_a_reserved_block_gives_its_page_back(
    nodes: tuple[Node, Node, str],
) -> None:
    """ "blocks.commit" commits the reserved blocks it has a checksum for and aborts the others: their pages
    are free again and the keys neither cached nor reserved."""
    a, b, peer = nodes
    free = free_pages(b)
    data = block(5)
    reply: Any = a.engine.call(
        peer,
        "blocks.reserve",
        {"lease": "edge", "blocks": [[5, len(data), None], [6, 100, 5]], "owner": a.engine.address},
    )
    assert [key for key, _offset in reply["blocks"]] == [5, 6] and free_pages(b) == free - 2
    page = b.cache.location(BlockKey(5))
    assert page is not None
    b.cache.pools[0].buffer[page.page * PAGE : page.page * PAGE + len(data)] = memoryview(data)  # type: ignore[attr-defined]
    reply = a.engine.call(peer, "blocks.commit", {"lease": "edge", "checksums": [[5, xxhash.xxh3_64_intdigest(data)]]})
    assert reply == {"committed": [5], "failed": []}
    assert BlockKey(5) in b.cache and b.cache.location(BlockKey(6)) is None
    assert free_pages(b) == free - 1


@pytest.mark.parametrize(
    "checksums",
    [[[5, -1], [6, 0]], [[5, 1 << 64]], [[5, 1.5]], [[5, True]], [["5", 0]], [[5]], [5], "x", None, {"5": 0}],
    ids=repr,
)
def test_a_malformed_commit_is_refused_and_keeps_its_lease(nodes: tuple[Node, Node, str], checksums: object) -> None:
    """A "blocks.commit" whose checksums are no list of [block key, XXH3-64 value] entries is refused with a
    ProtocolError naming them, before its lease is touched: a commit done right still commits, and a lease left
    to expire is quarantined and freed by `release_owner`; no page stays reserved for good."""
    a, b, peer = nodes
    free = free_pages(b)
    data = block(5)
    for lease in ("retried", "abandoned"):
        a.engine.call(
            peer, "blocks.reserve", {"lease": lease, "blocks": [[5, len(data), None]], "owner": a.engine.address}
        )
        location = b.cache.location(BlockKey(5))
        assert location is not None and free_pages(b) == free - 1
        with pytest.raises(TransferError, match=r"ProtocolError: checksums must be"):
            a.engine.call(peer, "blocks.commit", {"lease": lease, "checksums": checksums})
        if lease == "retried":
            b.cache.pools[0].buffer[location.page * PAGE : location.page * PAGE + len(data)] = memoryview(data)  # type: ignore[attr-defined]
            reply = a.engine.call(
                peer, "blocks.commit", {"lease": lease, "checksums": [[5, xxhash.xxh3_64_intdigest(data)]]}
            )
            assert reply == {"committed": [5], "failed": []} and BlockKey(5) in b.cache
            b.cache.remove(BlockKey(5))
        else:
            b.now[0] += 1000  # long expired: quarantined, its pages kept for a pusher that may only be paused
            b.messenger.sweep()
            assert b.messenger.quarantined == 1
            assert b.messenger.release_owner(a.engine.address) == 1
        assert free_pages(b) == free and b.messenger.quarantined == 0 and not b.messenger._leases


def test_a_commit_that_fails_midway_still_ends_its_lease(
    nodes: tuple[Node, Node, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a commit has taken its lease off the tables, whatever goes wrong ends it there: the blocks it did
    not commit give their pages back (nothing else could find the lease to release them)."""
    a, b, peer = nodes
    free = free_pages(b)
    a.engine.call(
        peer, "blocks.reserve", {"lease": "edge", "blocks": [[5, 100, None], [6, 100, 5]], "owner": a.engine.address}
    )
    assert free_pages(b) == free - 2

    def broken(_key: BlockKey, *, checksum: int | None = None) -> None:
        raise OSError("the cache broke")

    monkeypatch.setattr(b.cache, "commit", broken)
    with pytest.raises(TransferError, match="the cache broke"):
        a.engine.call(peer, "blocks.commit", {"lease": "edge", "checksums": [[5, 0], [6, 0]]})
    assert free_pages(b) == free and not b.messenger._leases and b.messenger.quarantined == 0


@pytest.mark.parametrize(
    "parts", [0, -1, True, 2.0, "2", 10**30, 10**5000], ids=["0", "-1", "True", "2.0", "text", "1e30", "10**5000"]
)
@pytest.mark.parametrize("op", ["fetch", "push"])
def test_a_part_count_that_is_no_positive_integer_is_refused_before_anything_moves(
    nodes: tuple[Node, Node, str], op: str, parts: object
) -> None:
    """`parts` must be an integer in [1, page_bytes] (more than a page's bytes spun through empty ranges for ever):
    anything else is a ConfigError naming it, raised before the peer is asked for anything (no call reaches it) and
    before a block is pinned here."""
    a, b, peer = nodes
    a.cache.put(BlockKey(1), block(1))
    b.cache.put(BlockKey(1), block(1))
    asked: list[str] = []
    for method in ("blocks.lookup", "blocks.reserve"):
        b.engine.register_handler(method, lambda _args, method=method: asked.append(method))  # type: ignore[misc]
    with pytest.raises(ConfigError, match=r"^parts must be"):
        getattr(a.messenger, op)([BlockKey(1)], peer, parts=parts)
    assert asked == []
    a.cache.remove(BlockKey(1))  # not pinned


@pytest.mark.parametrize("key", [1.5, 1.0, "1", True], ids=["fraction", "float", "text", "bool"])
def test_a_key_that_is_no_block_key_is_refused_not_coerced_into_another_block(
    nodes: tuple[Node, Node, str], key: object
) -> None:
    """A key to fetch is a non-negative integer, as the cache takes it; anything else is an InvalidRequestError
    naming it, before the peer is asked (never the block an int() of it happens to name)."""
    a, b, peer = nodes
    b.cache.put(BlockKey(1), block(1))
    with pytest.raises(InvalidRequestError, match="block key"):
        a.messenger.fetch([key], peer)  # type: ignore[list-item]
    assert len(a.cache) == 0


def test_aborting_a_push_whose_lease_expired_frees_its_quarantined_pages(nodes: tuple[Node, Node, str]) -> None:
    """A push's reservation outlives its lease (quarantined, for a pusher that may only be paused); when the
    pusher gives up (`abort`, a "blocks.release"), the pages are free again and nothing stays quarantined."""
    a, b, peer = nodes
    a.cache.put(BlockKey(6), block(6))
    free = free_pages(b)
    push = a.messenger.push([BlockKey(6)], peer)
    b.now[0] += 11.0
    b.messenger.sweep()
    assert b.messenger.quarantined == 1 and free_pages(b) == free - 1
    push.abort()
    assert b.messenger.quarantined == 0 and free_pages(b) == free
    a.cache.remove(BlockKey(6))  # the pusher's own pin is gone too


def test_close_ends_every_lease_quarantined_ones_included(nodes: tuple[Node, Node, str]) -> None:
    """`Messenger.close` releases what every peer holds: the pins of an unfinished fetch, the reservation of
    an unfinished push, and that of a push whose lease expired (quarantined)."""
    a, b, peer = nodes
    b.cache.put(BlockKey(1), block(1))
    for key in (6, 7):
        a.cache.put(BlockKey(key), block(key))
    free = free_pages(b)
    a.messenger.push([BlockKey(6)], peer)
    b.now[0] += 11.0
    b.messenger.sweep()
    a.messenger.fetch([BlockKey(1)], peer)
    a.messenger.push([BlockKey(7)], peer)
    assert b.messenger.quarantined == 1 and free_pages(b) == free - 2
    b.messenger.close()
    assert b.messenger.quarantined == 0 and free_pages(b) == free
    assert b.cache.location(BlockKey(6)) is None and b.cache.location(BlockKey(7)) is None
    b.cache.remove(BlockKey(1))  # unpinned


def test_a_block_that_left_its_page_during_a_push_is_not_committed_at_the_peer(
    nodes: tuple[Node, Node, str],
) -> None:
    """A block pushed while it is still being filled here may be aborted and reserved again on another page
    before the push ends: the bytes sent came from the old page, so `finish` does not vouch for them (no
    checksum is sent for it) and the peer commits nothing of it."""
    a, b, peer = nodes
    data = block(9)
    view = a.cache.reserve(BlockKey(9), len(data))
    assert view is not None
    view[:] = data  # type: ignore[assignment]
    old = a.cache.location(BlockKey(9))
    assert old is not None
    push = a.messenger.push([BlockKey(9)], peer)
    push.send_part(0)
    a.cache.abort(BlockKey(9))  # the local fill failed; the key is then reserved again, on another page
    for filler in range(100, 100 + 8):
        a.cache.reserve(BlockKey(filler), len(data))
        location = a.cache.location(BlockKey(filler))
        if location is not None and location.page == old.page:
            break
    assert a.cache.reserve(BlockKey(9), len(data)) is not None
    new = a.cache.location(BlockKey(9))
    assert new is not None and new.page != old.page
    assert push.finish(timeout=10) == ()
    assert BlockKey(9) not in b.cache and b.cache.location(BlockKey(9)) is None


class SlowBlockPeer:
    """A block-serving engine look-alike on 127.0.0.1 holding one block (key 1) in region 1 at offset 0: it
    answers "describe", "blocks.lookup" and "blocks.release" at once, but a READ only once `gate` is set."""

    def __init__(self, data: bytes) -> None:
        self.data, self.gate = data, threading.Event()
        self.released: list[str] = []
        self.listener = Listener(secret=SECRET, config=TCP_ONLY, serve=self._serve, name="slow-block")
        self.address = f"{self.listener.host}:{self.listener.port}"

    def _answer(self, method: str, args: Any) -> Any:
        if method == "describe":
            region = {"region_id": 1, "length": PAGE, "shm_name": None, "rdma_address": None, "rdma_rkey": None}
            return {"name": "slow", "host_id": "elsewhere", "pid": 1, "regions": [region]}
        if method == "blocks.lookup":
            return {"region": 1, "blocks": [[1, 0, len(self.data), xxhash.xxh3_64_intdigest(self.data)]]}
        self.released.append(args["lease"])
        return None

    def _serve(self, sock: socket.socket, _agreement: Agreement) -> None:
        sock.settimeout(10)
        while True:
            frame = recv_frame(sock, max_length=1 << 20)
            if frame.kind == Kind.READ:
                self.gate.wait(10)
                chunk = self.data[frame.offset : frame.offset + frame.length]
                send_frame(sock, Frame(Kind.OK, tag=frame.tag, length=len(chunk)), chunk)
                continue
            body = bytearray(frame.length)
            recv_exact(sock, memoryview(body))
            call = json.loads(body)
            reply = json.dumps(self._answer(call["method"], call["args"])).encode()
            send_frame(sock, Frame(Kind.REPLY, length=len(reply)), reply)


def test_a_part_that_timed_out_is_not_committed_when_its_bytes_come_late() -> None:
    """Once `wait_part` has said a part did not arrive in time (naming the peer), `finish` commits nothing, even
    when the bytes
    come afterwards and verify: it waits for the late slice to end, gives the page back and releases the
    peer's lease."""
    data = block(1)
    peer_engine = SlowBlockPeer(data)
    a = make_node(8, "tcp")
    try:
        peer = a.engine.connect(peer_engine.address)
        free = free_pages(a)
        fetch = a.messenger.fetch([BlockKey(1)], peer)
        with pytest.raises(TransferTimeout, match=f"part 0 of the fetch from {peer} did not arrive within 0.2s"):
            fetch.wait_part(0, timeout=0.2)
        peer_engine.gate.set()  # the bytes arrive now, and match the checksum
        assert fetch.finish(timeout=10) == ()
        assert BlockKey(1) not in a.cache and free_pages(a) == free
        assert len(peer_engine.released) == 1
    finally:
        peer_engine.gate.set()
        a.engine.close()
        peer_engine.listener.close()


def test_a_batch_that_did_not_settle_is_forgotten_once_it_has_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fetch that gives up while its READ is still held by the peer: settling it times out (its bound, the
    slice deadline plus a second, cut to one second here), and the engine refuses to forget a batch still moving,
    so the messenger has it forgotten when it ends: once the READ has ended, the engine holds no record of it."""
    monkeypatch.setattr(EngineConfig, "slice_deadline_s", property(lambda _config: 0.0))
    data = block(1)
    peer_engine = SlowBlockPeer(data)
    a = make_node(8, "tcp")
    try:
        peer = a.engine.connect(peer_engine.address)
        before = a.engine.num_batches
        fetch = a.messenger.fetch([BlockKey(1)], peer)
        with pytest.raises(TransferTimeout):
            fetch.wait_part(0, timeout=0.2)
        assert fetch.finish(timeout=0.2) == ()  # its READ is still held: the batch did not settle
        assert a.engine.num_batches == before + 1
        peer_engine.gate.set()
        wait_for(lambda: a.engine.num_batches == before, timeout=20, what="the unsettled batch to be forgotten")
    finally:
        peer_engine.gate.set()
        a.engine.close()
        peer_engine.listener.close()


def test_close_stops_the_sweeper_thread() -> None:
    """A messenger with a sweeper runs exactly one sweeper thread, and `close` ends it (bounded)."""
    before = set(threading.enumerate())
    engine = TransferEngine(secret=SECRET, config=TCP_ONLY)
    try:
        pool, region = shared_dram_pool(engine, PAGE, 4)
        messenger = Messenger(engine, TieredCache([pool]), region=region, sweep_interval_s=0.01)
        sweepers = [t for t in threading.enumerate() if t not in before and t.name == "messenger-sweep"]
        assert len(sweepers) == 1
        messenger.close()
        sweepers[0].join(timeout=5)
        assert not sweepers[0].is_alive()
    finally:
        engine.close()
