"""The transfer engine with real peer processes on 127.0.0.1."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.errors import AuthenticationError, ConfigError, PeerUnavailable, TransferError, TransferTimeout
from mooncake.transfer import tcp
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.request import EngineConfig, RequestState, TransferOp, TransferRequest
from mooncake.transfer.wire import ANSWER_BYTES, Frame, Kind, recv_frame, send_frame
from tests.transfer.conftest import SECRET, PeerProcess, engine_on, request, start_peer
from tests.transfer.peer_process import pattern
from tests.transfer.test_engine_machine import own_segments
from tests.waiting import stop_process

SIZE = 1 << 23


def digest(data: np.ndarray | memoryview) -> str:
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_mixed_batch_arrives_byte_exact(
    engine: TransferEngine, peers: Callable[..., PeerProcess], transport: str
) -> None:
    """Writes and reads of sizes from 1 byte to 3 MiB, over one transport, all byte-exact."""
    remote = peers(SIZE)
    local, buffer = engine.allocate_shared(SIZE)
    buffer[:] = pattern(SIZE, 9)
    name = engine.connect(remote.address, transport=transport)
    assert engine.transport_names(name) == (transport,)
    sizes = [1, 4095, 4096, 65537, 1 << 20, 3 << 20]
    offsets = np.cumsum([0, *sizes[:-1]]).tolist()
    writes = [
        request(TransferOp.WRITE, local.region_id, name, remote.shared, n, local_offset=o, remote_offset=o)
        for n, o in zip(sizes, offsets, strict=True)
    ]
    statuses = engine.wait(engine.submit(writes), timeout=30)
    assert [s.state for s in statuses] == [RequestState.DONE] * len(sizes)
    total = sum(sizes)
    assert engine.call(name, "digest", {"region": remote.shared, "offset": 0, "length": total}) == digest(
        buffer[:total]
    )
    # Read the peer's untouched tail back into a fresh part of our buffer.
    reads = [
        request(
            TransferOp.READ,
            local.region_id,
            name,
            remote.shared,
            1000 + i,
            local_offset=total + 8192 * i,
            remote_offset=total + 8192 * i,
        )
        for i in range(8)
    ]
    statuses = engine.wait(engine.submit(reads), timeout=30)
    assert all(s.state == RequestState.DONE for s in statuses)
    expected = pattern(SIZE, 1)
    for i in range(8):
        start = total + 8192 * i
        assert np.array_equal(buffer[start : start + 1000 + i], expected[start : start + 1000 + i])


def test_transport_is_chosen_per_peer_and_region(engine: TransferEngine, peers: Callable[..., PeerProcess]) -> None:
    """A same-host peer gets shm and tcp; its plain (non-shared) region is reached over tcp."""
    remote = peers(SIZE)
    local, buffer = engine.allocate_shared(SIZE)
    name = engine.connect(remote.address)
    assert engine.transport_names(name) == ("shm", "tcp")
    statuses = engine.wait(
        engine.submit(
            [
                request(TransferOp.READ, local.region_id, name, remote.shared, 4096),
                request(TransferOp.READ, local.region_id, name, remote.plain, 4096, local_offset=4096),
            ]
        ),
        timeout=30,
    )
    assert [s.transport for s in statuses] == ["shm", "tcp"]
    assert np.array_equal(buffer[:4096], pattern(SIZE, 1)[:4096])
    assert np.array_equal(buffer[4096:8192], pattern(SIZE, 2)[:4096])


def test_a_peer_killed_mid_batch_fails_its_requests_only(
    engine: TransferEngine, peers: Callable[..., PeerProcess]
) -> None:
    """Requests to a killed peer fail with PeerUnavailable, the other peer's complete, nothing hangs."""
    doomed, healthy = peers(64 << 20), peers(SIZE)
    local, _ = engine.allocate_shared(64 << 20)
    doomed_name = engine.connect(doomed.address, transport="tcp")
    healthy_name = engine.connect(healthy.address, transport="tcp")
    batch = engine.submit(
        [
            request(
                TransferOp.WRITE, local.region_id, doomed_name, doomed.shared, 32 << 20, remote_offset=i * (32 << 20)
            )
            for i in range(2)
        ]
        + [request(TransferOp.WRITE, local.region_id, healthy_name, healthy.shared, 1 << 20)]
    )
    doomed.kill()
    start = time.monotonic()
    statuses = engine.wait(batch, timeout=20)
    assert time.monotonic() - start < 20
    assert statuses[2].state == RequestState.DONE
    failed = [s for s in statuses[:2] if s.state == RequestState.FAILED]
    assert failed, "a request to a killed peer cannot have been delivered in full"
    assert all(isinstance(s.error, PeerUnavailable | TransferTimeout) for s in failed)
    later = engine.wait(
        engine.submit([request(TransferOp.WRITE, local.region_id, doomed_name, doomed.shared, 100)]), timeout=20
    )
    assert later[0].state == RequestState.FAILED and isinstance(later[0].error, PeerUnavailable)


def test_a_killed_shm_peer_fails_its_requests(engine: TransferEngine, peers: Callable[..., PeerProcess]) -> None:
    """Over shm, a peer whose process is gone fails the request instead of copying into its orphaned segment."""
    remote = peers(SIZE)
    local, _ = engine.allocate_shared(SIZE)
    name = engine.connect(remote.address, transport="shm")
    remote.kill()
    statuses = engine.wait(
        engine.submit([request(TransferOp.WRITE, local.region_id, name, remote.shared, 4096)]), timeout=10
    )
    assert statuses[0].state == RequestState.FAILED and isinstance(statuses[0].error, PeerUnavailable)


class DroppingRelay:
    """A TCP relay to a peer that cuts the first data connection after `cut_after` bytes from the client."""

    def __init__(self, target: str, *, cut_after: int, flip_byte_at: int | None = None) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.cut_after = cut_after
        self.flip_byte_at = flip_byte_at
        self.connections = 0
        self.cuts = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.threads: list[threading.Thread] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            upstream = socket.create_connection(self.target)
            # The second connection is the first data stream (the first carries the handshake's describe).
            doomed = self.connections == 2
            for source, sink, forward in ((client, upstream, True), (upstream, client, False)):
                thread = threading.Thread(
                    target=self._pump, args=(source, sink, forward and doomed, forward), daemon=True
                )
                thread.start()
                self.threads.append(thread)

    def _pump(self, source: socket.socket, sink: socket.socket, doomed: bool, forward: bool) -> None:
        moved = 0
        try:
            while True:
                data = bytearray(source.recv(65536))
                if not data:
                    break
                if forward and self.flip_byte_at is not None and moved <= self.flip_byte_at < moved + len(data):
                    data[self.flip_byte_at - moved] ^= 0xFF
                    self.flip_byte_at = None
                if doomed and moved + len(data) > self.cut_after:
                    self.cuts += 1
                    break
                sink.sendall(data)
                moved += len(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        self.listener.close()


def test_a_dropped_connection_is_retried_and_completes(peers: Callable[..., PeerProcess]) -> None:
    """A connection cut mid-write is replaced and the slice resent: the request completes byte-exact."""
    remote = peers(SIZE)
    relay = DroppingRelay(remote.address, cut_after=300_000)
    config = EngineConfig(streams_per_peer=1, slice_bytes=1 << 20, io_timeout_s=5.0, max_retries=2)
    try:
        with TransferEngine(secret=SECRET, config=config) as local_engine:
            local, buffer = local_engine.allocate_shared(SIZE)
            buffer[:] = pattern(SIZE, 5)
            name = local_engine.connect(relay.address, transport="tcp")
            statuses = local_engine.wait(
                local_engine.submit([request(TransferOp.WRITE, local.region_id, name, remote.plain, 2 << 20)]),
                timeout=30,
            )
            assert statuses[0].state == RequestState.DONE, statuses[0]
            assert relay.cuts == 1
            assert local_engine.call(
                name, "digest", {"region": remote.plain, "offset": 0, "length": 2 << 20}
            ) == digest(buffer[: 2 << 20])
    finally:
        relay.close()


def test_a_corrupted_payload_is_never_reported_done(peers: Callable[..., PeerProcess]) -> None:
    """With checksums on, a byte flipped on the wire fails the request instead of completing it."""
    remote = peers(SIZE)
    relay = DroppingRelay(remote.address, cut_after=1 << 40, flip_byte_at=200_000)
    config = EngineConfig(streams_per_peer=1, slice_bytes=1 << 20, io_timeout_s=5.0, max_retries=0, checksums=True)
    try:
        with TransferEngine(secret=SECRET, config=config) as local_engine:
            local, buffer = local_engine.allocate_shared(SIZE)
            buffer[:] = pattern(SIZE, 6)
            name = local_engine.connect(relay.address, transport="tcp")
            statuses = local_engine.wait(
                local_engine.submit([request(TransferOp.WRITE, local.region_id, name, remote.plain, 1 << 20)]),
                timeout=30,
            )
            assert statuses[0].state == RequestState.FAILED
            assert "checksum" in str(statuses[0].error)
    finally:
        relay.close()


def test_wrong_secret_is_refused(peers: Callable[..., PeerProcess]) -> None:
    """An engine with another secret cannot connect, and an unauthenticated socket gets no data."""
    remote = peers(SIZE)
    with TransferEngine(secret=b"not the right secret!") as stranger, pytest.raises(AuthenticationError):
        stranger.connect(remote.address)
    host, port = remote.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.recv(64)  # the hello
        raw.sendall(bytes(ANSWER_BYTES))  # a made-up answer
        assert raw.recv(2) == b"NO"
        assert raw.recv(1) == b""  # and the peer hangs up


def test_out_of_bounds_requests_touch_no_memory(engine: TransferEngine, peers: Callable[..., PeerProcess]) -> None:
    """Crafted offsets, lengths and regions are refused by the peer, and its memory is unchanged."""
    remote = peers(SIZE)
    name = engine.connect(remote.address, transport="tcp")
    before = engine.call(name, "digest", {"region": remote.shared, "offset": 0, "length": SIZE})
    host, port = remote.address.rsplit(":", 1)
    sock = tcp.connect(host, int(port), secret=SECRET, config=engine.config)
    try:
        for region, offset, length in [(remote.shared, SIZE - 10, 100), (remote.shared, 2**63, 16), (999, 0, 16)]:
            send_frame(sock, Frame(Kind.WRITE, region=region, offset=offset, length=length), b"\xff" * length)
            reply = recv_frame(sock, max_length=1 << 20)
            assert reply.kind == Kind.ERROR
            sock.recv(reply.length, socket.MSG_WAITALL)
        send_frame(sock, Frame(Kind.READ, region=remote.shared, offset=SIZE, length=1))
        assert recv_frame(sock, max_length=1 << 20).kind == Kind.ERROR
    finally:
        sock.close()
    assert engine.call(name, "digest", {"region": remote.shared, "offset": 0, "length": SIZE}) == before
    local, _ = engine.allocate_shared(4096)
    with pytest.raises(TransferError, match="outside"):
        engine.submit([request(TransferOp.WRITE, local.region_id, name, remote.shared, 4097)])  # local bounds


def test_oversized_frames_end_the_connection(engine: TransferEngine, peers: Callable[..., PeerProcess]) -> None:
    """A header announcing more than the frame bound closes the connection before anything is read."""
    remote = peers(SIZE)
    host, port = remote.address.rsplit(":", 1)
    sock = tcp.connect(host, int(port), secret=SECRET, config=engine.config)
    try:
        send_frame(sock, Frame(Kind.WRITE, region=remote.shared, offset=0, length=1 << 40))
        assert sock.recv(1) == b""
    finally:
        sock.close()


def test_a_stalled_peer_times_out(peers: Callable[..., PeerProcess]) -> None:
    """A peer that stops answering makes `wait` raise TransferTimeout on time, then fails the request."""
    remote = peers(SIZE)
    config = EngineConfig(io_timeout_s=1.0, connect_timeout_s=1.0, max_retries=1)
    with TransferEngine(secret=SECRET, config=config) as local_engine:
        local, _ = local_engine.allocate_shared(SIZE)
        name = local_engine.connect(remote.address, transport="tcp")
        stop_process(remote.pid)
        try:
            batch = local_engine.submit([request(TransferOp.READ, local.region_id, name, remote.shared, 1 << 20)])
            start = time.monotonic()
            with pytest.raises(TransferTimeout):
                local_engine.wait(batch, timeout=0.5)
            assert time.monotonic() - start < 2
            statuses = local_engine.wait(batch, timeout=30)
            assert statuses[0].state == RequestState.FAILED
        finally:
            os.kill(remote.pid, signal.SIGCONT)


def test_listeners_bind_loopback_and_config_is_validated() -> None:
    """Engines listen on 127.0.0.1 unless told otherwise; bad configs and secrets are ConfigErrors."""
    with TransferEngine(secret=SECRET) as local_engine:
        assert local_engine.host == "127.0.0.1"
    with pytest.raises(ConfigError):
        TransferEngine(secret=b"short")
    with pytest.raises(ConfigError):
        EngineConfig(transports=("carrier-pigeon",))
    with pytest.raises(ConfigError):
        EngineConfig(slice_bytes=2 << 20, max_frame_bytes=1 << 20)


@pytest.mark.parametrize(
    ("argument", "value", "named"),
    [
        ("name", 5, "5"),
        ("name", "", "''"),
        ("name", b"engine", "b'engine'"),
        ("config", {}, "dict"),
        ("config", {"port": 0}, "dict"),
        ("config", "x", "str"),
        ("rdma", 5, "int"),
        ("rdma", "mlx5_0", "str"),
    ],
    ids=repr,
)
def test_an_engine_argument_of_another_type_is_a_config_error_naming_it(
    argument: str, value: object, named: str
) -> None:
    """`name` is a non-empty string (peers refuse any other in its descriptor), `config` an EngineConfig (a falsy
    dict is never taken for the default) and `rdma` an RDMA device: anything else is a ConfigError naming the
    argument and what it got."""
    with pytest.raises(ConfigError, match=rf"^{argument} must be .*{named}"):
        TransferEngine(secret=SECRET, **{argument: value})  # type: ignore[arg-type]


# --------------------------------------------------------------------------- differential: shm and tcp in lockstep


@pytest.fixture(scope="module")
def lockstep() -> Iterator[tuple[TransferEngine, TransferEngine, PeerProcess]]:
    """Two initiators, one forced to shm and one to tcp, and one peer process they both target."""
    remote = start_peer(1 << 17)
    config = EngineConfig(slice_bytes=1 << 14, streams_per_peer=2)
    via_shm = TransferEngine(secret=SECRET, config=config)
    via_tcp = TransferEngine(secret=SECRET, config=config)
    via_shm.connect(remote.address, transport="shm")
    via_tcp.connect(remote.address, transport="tcp")
    yield via_shm, via_tcp, remote
    via_shm.close()
    via_tcp.close()
    remote.kill()


operations = st.lists(
    st.tuples(
        st.sampled_from([TransferOp.READ, TransferOp.WRITE]),
        st.integers(0, 1 << 16),
        st.integers(0, 1 << 16),
        st.integers(0, (1 << 17) + 1000),  # past the remote region sometimes: both must refuse it whole, alike
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=40, deadline=None)
@given(ops=operations, seed=st.integers(0, 2**32 - 1))
def test_shm_and_tcp_in_lockstep(
    lockstep: tuple[TransferEngine, TransferEngine, PeerProcess], ops: list[tuple[TransferOp, int, int, int]], seed: int
) -> None:
    """The same random requests to a peer process through shm and through tcp leave identical bytes and outcomes.

    The shm initiator works on the peer's shared region, the tcp one on its plain region; both
    regions and both local buffers start from the same pattern. Each request is its own batch, in
    order: a batch's requests run concurrently, so overlapping ones within one batch have no order.
    A request past the end of the remote region is refused by `submit` (the peer described the region), over
    both, before any byte moves.
    """
    via_shm, via_tcp, remote = lockstep
    size = 1 << 17
    outcomes, finals = [], []
    for initiator, region in ((via_shm, remote.shared), (via_tcp, remote.plain)):
        peer = remote.address  # an engine's peer name is its address
        local, local_buffer = initiator.allocate_shared(size)
        local_buffer[:] = pattern(size, seed % 1000 + 1)
        seen = []
        # Start the remote region from the same bytes: write them through this initiator.
        initiator.transfer_sync([request(TransferOp.WRITE, local.region_id, peer, region, size)], timeout=30)
        local_buffer[:] = pattern(size, seed % 1000)
        for op, length, local_offset, remote_offset in ops:
            one = request(
                op,
                local.region_id,
                peer,
                region,
                min(length, size - local_offset),
                local_offset=local_offset,
                remote_offset=remote_offset,
            )
            if one.remote_offset + one.length > size:
                with pytest.raises(TransferError, match="past its end"):
                    initiator.submit([one])
                seen.append(("refused", None))
                continue
            (status,) = initiator.wait(initiator.submit([one]), timeout=30)
            seen.append((status.state, type(status.error).__name__ if status.error else None))
        outcomes.append(seen)
        finals.append(
            (local_buffer.copy(), initiator.call(peer, "digest", {"region": region, "offset": 0, "length": size}))
        )
        initiator.unregister_memory(local.region_id)
    assert outcomes[0] == outcomes[1]
    assert np.array_equal(finals[0][0], finals[1][0])
    assert finals[0][1] == finals[1][1]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_transfer_sync_moves_bytes_in_the_calling_thread(
    engine: TransferEngine, peers: Callable[..., PeerProcess], transport: str
) -> None:
    """The synchronous path returns final statuses, byte-exact, and refuses bad requests before moving anything."""
    remote = peers(SIZE)
    local, buffer = engine.allocate_shared(SIZE)
    buffer[:] = pattern(SIZE, 12)
    name = engine.connect(remote.address, transport=transport)
    statuses = engine.transfer_sync(
        [
            request(TransferOp.WRITE, local.region_id, name, remote.shared, 3 << 20),
            request(
                TransferOp.READ, local.region_id, name, remote.shared, 4096, local_offset=4 << 20, remote_offset=5 << 20
            ),
        ],
        timeout=30,
    )
    assert [s.state for s in statuses] == [RequestState.DONE, RequestState.DONE]
    assert engine.call(name, "digest", {"region": remote.shared, "offset": 0, "length": 3 << 20}) == digest(
        buffer[: 3 << 20]
    )
    assert np.array_equal(buffer[4 << 20 : (4 << 20) + 4096], pattern(SIZE, 1)[5 << 20 : (5 << 20) + 4096])
    with pytest.raises(TransferError, match="outside"):
        engine.transfer_sync([request(TransferOp.WRITE, local.region_id, name, remote.shared, SIZE + 1)], timeout=5)


def test_transfer_sync_against_a_stalled_peer_is_bounded(peers: Callable[..., PeerProcess]) -> None:
    """A synchronous transfer to a peer that stopped answering fails within its io timeouts; later slices are not started."""
    remote = peers(SIZE)
    config = EngineConfig(io_timeout_s=0.5, connect_timeout_s=0.5, max_retries=0, slice_bytes=1 << 20)
    with TransferEngine(secret=SECRET, config=config) as local_engine:
        local, _ = local_engine.allocate_shared(SIZE)
        name = local_engine.connect(remote.address, transport="tcp")
        stop_process(remote.pid)
        try:
            start = time.monotonic()
            statuses = local_engine.transfer_sync(
                [request(TransferOp.WRITE, local.region_id, name, remote.shared, 4 << 20)], timeout=0.2
            )
            assert time.monotonic() - start < 3
            assert statuses[0].state == RequestState.FAILED
            assert isinstance(statuses[0].error, TransferTimeout | PeerUnavailable)
        finally:
            os.kill(remote.pid, signal.SIGCONT)


def test_request_fields_are_bounded() -> None:
    """Offsets past 2**62 and region ids past 2**32 are refused when the request is made."""
    with pytest.raises(ConfigError, match="remote_offset"):
        request(TransferOp.WRITE, 1, "peer", 1, 8, remote_offset=2**64)
    with pytest.raises(ConfigError, match="remote_region"):
        TransferRequest(
            op=TransferOp.WRITE,
            local_region=1,
            local_offset=0,
            peer="p",
            remote_region=2**32,
            remote_offset=0,
            length=1,
        )


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"op": "write"}, "op"),  # was sent as a READ whose answer nobody read: DONE with nothing moved
        ({"op": None}, "op"),
        ({"peer": ""}, "peer"),
        ({"peer": 7}, "peer"),
    ],
)
def test_a_request_with_a_bad_op_or_peer_is_refused_by_name(fields: dict[str, object], named: str) -> None:
    values: dict[str, object] = {
        "op": TransferOp.WRITE,
        "local_region": 1,
        "local_offset": 0,
        "peer": "p",
        "remote_region": 1,
        "remote_offset": 0,
        "length": 1,
    }
    with pytest.raises(ConfigError, match=f"^{named} must be"):
        TransferRequest(**{**values, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("checksums", "no"),
        ("checksums", 0),
        ("port", 70000),
        ("port", -1),
        ("host", ""),
        ("socket_buffer_bytes", 2**31),  # setsockopt takes a C int: it failed at the first connection
        ("spin_us", 2**31),
        ("max_retries", 2**31),
    ],
)
def test_engine_config_fields_are_checked_by_name(field: str, value: object) -> None:
    """A string is no switch ("no" is truthy), a port is at most 65535, a host is a non-empty string, the counts
    the system takes as a C int are below 2**31."""
    with pytest.raises(ConfigError, match=f"^{field} must be"):
        EngineConfig(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_zero_length_request_is_checked_by_the_peer(
    engine: TransferEngine, peers: Callable[..., PeerProcess], transport: str
) -> None:
    """Moving nothing still names a real place: in bounds (the region's end included) it is DONE; past the end of
    a region the peer described it is refused before anything starts; in a region the peer did not describe it
    goes to the peer, which FAILS it; through submit and transfer_sync alike."""
    remote = peers(SIZE)
    name = engine.connect(remote.address, transport=transport)
    local, _ = engine.allocate_shared(4096)
    for op in TransferOp:
        for offset in (0, SIZE):
            zero = request(op, local.region_id, name, remote.shared, 0, remote_offset=offset)
            assert engine.transfer_sync([zero], timeout=5)[0].state == RequestState.DONE, (op, offset)
            assert engine.wait(engine.submit([zero]), timeout=5)[0].state == RequestState.DONE, (op, offset)
        for offset in (SIZE + 1, 10**9):
            zero = request(op, local.region_id, name, remote.shared, 0, remote_offset=offset)
            with pytest.raises(TransferError, match="past its end"):
                engine.transfer_sync([zero], timeout=5)
            with pytest.raises(TransferError, match="past its end"):
                engine.submit([zero])
    if transport == "tcp":  # shm refuses an unknown region before anything starts (no transport reaches it)
        zero = request(TransferOp.READ, local.region_id, name, 999, 0)
        assert engine.transfer_sync([zero], timeout=5)[0].state == RequestState.FAILED


@pytest.mark.parametrize("timeout", [math.nan, -1.0, "5", True])
def test_a_wait_without_a_real_limit_is_refused(engine: TransferEngine, timeout: object) -> None:
    """NaN made every deadline comparison false (a wait that never timed out); the limit is checked first."""
    local, _ = engine.allocate_shared(64)
    batch = engine.submit([])
    with pytest.raises(ConfigError, match="timeout must be"):
        engine.wait(batch, timeout)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="timeout must be"):
        engine.transfer_sync([], timeout=timeout)  # type: ignore[arg-type]
    assert engine.wait(batch, None) == engine.wait(batch, math.inf) == engine.wait(batch, 1e300) == ()
    assert local.length == 64


def test_a_closed_engine_refuses_new_work_and_creates_nothing() -> None:
    """After close, memory, connections and batches are refused (they would outlive the close that
    should release them: a shared segment no one unlinks, threads no one stops)."""
    peer = TransferEngine(secret=SECRET)
    local_engine = TransferEngine(secret=SECRET)
    try:
        region, _ = local_engine.allocate_shared(64)
        name = local_engine.connect(peer.address)
        with pytest.raises(ConfigError, match=r"nbytes must be an integer in \[0, 2\*\*63\), got -1"):
            local_engine.allocate_shared(-1)
        local_engine.close()
        before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
        threads = threading.active_count()
        zero = request(TransferOp.READ, region.region_id, name, 1, 0)
        for attempt in (
            lambda: local_engine.allocate_shared(64),
            lambda: local_engine.register_memory(bytearray(64)),
            lambda: local_engine.connect(peer.address),
            lambda: local_engine.submit([zero]),
            lambda: local_engine.transfer_sync([zero], timeout=1),
        ):
            with pytest.raises(TransferError, match="is closed"):
                attempt()
        assert (set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()) == before
        assert threading.active_count() <= threads
    finally:
        local_engine.close()
        peer.close()


def test_a_lying_peer_descriptor_is_refused(engine: TransferEngine) -> None:
    """A peer describing a shared segment that is not its own mooncake segment cannot be connected to."""
    with TransferEngine(secret=SECRET) as liar:
        region, _ = liar.allocate_shared(4096)
        honest = liar.handle_call("describe", None)
        for bad in (
            {"shm_name": "some-other-program"},
            {"shm_name": f"mooncake-{os.getpid() + 1}-abcdef"},
            {"length": -1},
        ):
            lie = {**honest, "regions": [{**honest["regions"][0], **bad}]}
            liar.register_handler("describe", lambda _args, lie=lie: lie)
            with pytest.raises(TransferError, match="malformed"):
                engine.connect(liar.address)
        assert region.region_id == honest["regions"][0]["region_id"]


def test_closing_an_engine_ends_its_open_batches(peers: Callable[..., PeerProcess]) -> None:
    """Requests still moving when their engine closes end FAILED, and `wait` does not hang."""
    remote = peers(SIZE)
    local_engine = TransferEngine(secret=SECRET, config=EngineConfig(slice_bytes=1 << 16, streams_per_peer=1))
    local, _ = local_engine.allocate_shared(SIZE)
    name = local_engine.connect(remote.address, transport="tcp")
    stop_process(remote.pid)
    try:
        batch = local_engine.submit([request(TransferOp.WRITE, local.region_id, name, remote.shared, 4 << 20)])
        local_engine.close()
        statuses = local_engine.wait(batch, timeout=5)
        assert statuses[0].state == RequestState.FAILED
    finally:
        os.kill(remote.pid, signal.SIGCONT)


# --------------------------------------------------------------------------- a restarted peer, deadlines, bad input


def test_a_peer_restarted_on_its_address_is_unavailable_until_connected_again() -> None:
    """A peer engine closed and started again on its port (its region ids start again at 1) is not the engine
    this one described: a WRITE meant for the old region 1 (through submit, whose streams were connected to the
    old engine, and through transfer_sync, which connects anew) fails with PeerUnavailable naming the restart and
    lands nowhere; control calls and `refresh` fail alike, and `peer_regions` still shows what was described.
    `connect` again learns the new engine, and a WRITE then lands in its region. (The handshake proved only the
    secret: the WRITE was reported DONE into the new engine's unrelated region 1.)"""
    config = EngineConfig(transports=("tcp",), io_timeout_s=5.0)
    with TransferEngine(secret=SECRET, config=config) as here:
        source = np.full(4096, 0xAB, np.uint8)
        local = here.register_memory(source)
        first = TransferEngine(secret=SECRET, config=config)
        try:
            old = first.register_memory(np.zeros(4096, np.uint8))
            peer = here.connect(first.address)
            write = request(TransferOp.WRITE, local.region_id, peer, old.region_id, 4096)
            assert here.wait(here.submit([write]), timeout=10)[0].state == RequestState.DONE
            described = here.peer_regions(peer)
        finally:
            first.close()
        with engine_on(first.port, config) as second:
            victim = np.zeros(4096, np.uint8)
            assert second.register_memory(victim).region_id == old.region_id  # the same id, another region
            (queued,) = here.wait(here.submit([write]), timeout=30)
            (inline,) = here.transfer_sync([write], timeout=10)
            for status in (queued, inline):
                assert status.state == RequestState.FAILED and type(status.error) is PeerUnavailable, status
                assert "restarted" in str(status.error), status.error
            with pytest.raises(PeerUnavailable, match="restarted"):
                here.call(peer, "describe", None)
            with pytest.raises(PeerUnavailable, match="restarted"):
                here.refresh(peer)
            assert here.peer_regions(peer) == described
            assert not victim.any(), "a WRITE meant for the old engine landed in the new one"
            assert here.connect(second.address) == peer
            assert here.wait(here.submit([write]), timeout=10)[0].state == RequestState.DONE
            assert np.array_equal(victim, source)


def test_a_refused_dial_leaves_the_next_free_to_find_the_peer_restarted() -> None:
    """A peer closed: a WRITE to it fails at once (refused), and that quick failure does not mark the peer down,
    so a WRITE right after the peer started again on its port dials it and names the restart, rather than
    repeating the stale refusal (only a dial that timed out takes a peer for down, for connect_timeout_s)."""
    config = EngineConfig(transports=("tcp",), io_timeout_s=5.0, connect_timeout_s=30.0, max_retries=0)
    with TransferEngine(secret=SECRET, config=config) as here:
        local = here.register_memory(np.full(4096, 0xAB, np.uint8))
        first = TransferEngine(secret=SECRET, config=config)
        try:
            old = first.register_memory(np.zeros(4096, np.uint8))
            peer = here.connect(first.address)
        finally:
            first.close()
        write = request(TransferOp.WRITE, local.region_id, peer, old.region_id, 4096)
        start = time.monotonic()
        (refused,) = here.wait(here.submit([write]), timeout=30)
        assert refused.state == RequestState.FAILED and type(refused.error) is PeerUnavailable, refused
        assert time.monotonic() - start < 10 and "restarted" not in str(refused.error)
        with engine_on(first.port, config) as second:
            second.register_memory(np.zeros(4096, np.uint8))
            (status,) = here.wait(here.submit([write]), timeout=30)
            assert status.state == RequestState.FAILED and "restarted" in str(status.error), status.error


def test_transfer_sync_connects_by_its_deadline(peers: Callable[..., PeerProcess]) -> None:
    """transfer_sync(timeout=0.5) to a peer that stopped (SIGSTOP) before the inline connection was made: the
    connection's handshake is cut at the call's deadline, not at connect_timeout_s (20 s here), and the request
    fails with TransferTimeout, each time. (It took connect_timeout_s and failed with PeerUnavailable.)"""
    remote = peers(SIZE)
    config = EngineConfig(transports=("tcp",), connect_timeout_s=20.0, io_timeout_s=20.0)
    with TransferEngine(secret=SECRET, config=config) as local_engine:
        local = local_engine.register_memory(np.zeros(4096, np.uint8))
        name = local_engine.connect(remote.address)
        stop_process(remote.pid)
        try:
            for _ in range(2):
                start = time.monotonic()
                (status,) = local_engine.transfer_sync(
                    [request(TransferOp.READ, local.region_id, name, remote.plain, 4096)], timeout=0.5
                )
                elapsed = time.monotonic() - start
                assert status.state == RequestState.FAILED and isinstance(status.error, TransferTimeout), status
                assert elapsed < 0.5 + 5.0, elapsed  # a loaded machine's margin; well before the old 20 s
        finally:
            os.kill(remote.pid, signal.SIGCONT)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_write_crossing_the_remote_end_is_refused_whole(transport: str) -> None:
    """A WRITE of four slices whose last two cross the end of the peer's region is refused by `submit` (a
    TransferError naming the region, remote_offset and length) and its first slices do not land: the peer's
    bytes are all unchanged. (It failed, yet its first slices overwrote the peer's region, over tcp and shm.)"""
    config = EngineConfig(slice_bytes=1 << 16)
    with TransferEngine(secret=SECRET, config=config) as here, TransferEngine(secret=SECRET, config=config) as there:
        local, source = here.allocate_shared(1 << 20)
        source[:] = 0xCD
        remote, target = there.allocate_shared(1 << 20)
        peer = here.connect(there.address, transport=transport)
        offset, length = (1 << 20) - (3 << 16) + 100, 4 << 16
        crossing = request(TransferOp.WRITE, local.region_id, peer, remote.region_id, length, remote_offset=offset)
        expected = f"remote region {remote.region_id} of {peer}: remote_offset {offset} \\+ length {length}"
        with pytest.raises(TransferError, match=expected):
            here.submit([crossing])
        with pytest.raises(TransferError, match=expected):
            here.transfer_sync([crossing], timeout=10)
        assert not target.any(), "a refused WRITE changed the peer's region"


@pytest.fixture
def connected() -> Iterator[tuple[TransferEngine, str]]:
    """An engine connected to another over tcp: (engine, peer key)."""
    config = EngineConfig(transports=("tcp",))
    with TransferEngine(secret=SECRET, config=config) as here, TransferEngine(secret=SECRET, config=config) as there:
        yield here, here.connect(there.address)


# (name, the call, its message); the engine is Any: the calls pass what its signatures do not allow.
BAD_CALLS: list[tuple[str, Callable[[Any, str], object], str]] = [
    ("connect int", lambda e, _p: e.connect(123), r"^address must be .*, got 123$"),
    ("connect None", lambda e, _p: e.connect(None), r"^address must be .*, got None$"),
    ("submit None", lambda e, _p: e.submit(None), r"^requests must be an iterable, got None$"),
    ("submit [None]", lambda e, _p: e.submit([None]), r"^requests\[0\] must be a TransferRequest, got None$"),
    ("sync None", lambda e, _p: e.transfer_sync(None, timeout=1), r"^requests must be an iterable, got None$"),
    ("status list", lambda e, _p: e.status([1]), r"^batch_id must be an integer >= 0, got \[1\]$"),
    ("wait list", lambda e, _p: e.wait([1], 1), r"^batch_id must be an integer >= 0, got \[1\]$"),
    ("forget list", lambda e, _p: e.forget([1]), r"^batch_id must be an integer >= 0, got \[1\]$"),
    ("unregister list", lambda e, _p: e.unregister_memory([1]), r"^region_id must be an integer >= 0, got \[1\]$"),
    ("unregister str", lambda e, _p: e.unregister_memory("x"), r"^region_id must be an integer >= 0, got 'x'$"),
    ("handler method", lambda e, _p: e.register_handler(1, lambda _a: None), r"^method must be .*, got 1$"),
    ("handler None", lambda e, _p: e.register_handler("m", None), r"^handler must be callable, got None$"),
    ("call args", lambda e, p: e.call(p, "describe", object()), r"^the args of control call 'describe' must"),
    ("call args too deep", lambda e, p: e.call(p, "describe", _nested(100_000)), r"^the args of control call 'desc"),
    ("call args huge int", lambda e, p: e.call(p, "describe", {"n": 10**5000}), r"^the args of control call 'desc"),
]


def _nested(depth: int) -> list[Any]:
    """A list nested `depth` deep: past what json.dumps recurses into (RecursionError, not TypeError)."""
    nested: list[Any] = []
    for _ in range(depth):
        nested = [nested]
    return nested


@pytest.mark.parametrize(("call", "message"), [(c, m) for _n, c, m in BAD_CALLS], ids=[n for n, _c, _m in BAD_CALLS])
def test_bad_arguments_are_config_errors_naming_them(
    connected: tuple[TransferEngine, str], call: Callable[[Any, str], object], message: str
) -> None:
    """An address that is no string, requests that are no iterable of TransferRequest, a batch or region id that
    is no integer (a list among them: unhashable), a handler that is no callable or args JSON cannot encode are a
    ConfigError naming the argument and the value (they were AttributeError and TypeError), and the engine goes
    on: its peer still answers."""
    engine, peer = connected
    with pytest.raises(ConfigError, match=message):
        call(engine, peer)
    assert engine.call(peer, "describe", None) is not None


def test_memory_that_cannot_be_registered_or_allocated_is_a_transfer_error() -> None:
    """A numpy array of Python objects (no bytes to expose) cannot be registered, and a shared segment the system
    will not create (4 EiB) is a TransferError naming nbytes; nothing is left in /dev/shm. (They were a bare
    TypeError and OSError.)"""
    with TransferEngine(secret=SECRET) as engine:
        with pytest.raises(TransferError, match="dtype object"):
            engine.register_memory(np.array([None] * 4, dtype=object))
        before = own_segments()
        with pytest.raises(TransferError, match=f"nbytes={2**62}"):
            engine.allocate_shared(2**62)
        assert own_segments() == before
        assert engine.regions() == ()


@pytest.mark.parametrize(
    "nbytes", [2**63 - 1, 2**63, 2**64, 10**30, 10**5000], ids=["2**63-1", "2**63", "2**64", "10**30", "10**5000"]
)
def test_a_shared_segment_past_what_a_file_can_hold_is_refused_and_leaves_nothing(nbytes: int) -> None:
    """A file holds less than 2**63 bytes (off_t): a size from 2**63 up is a ConfigError naming nbytes before any
    segment is made, and 2**63 - 1 the system's refusal (TransferError); neither leaves a segment in /dev/shm.
    (From 2**63 os.ftruncate raised OverflowError, which SharedMemory does not clean up after: the bare error
    escaped and the empty segment stayed in /dev/shm for the life of the host.)"""
    with TransferEngine(secret=SECRET) as engine:
        before = own_segments()
        with pytest.raises(TransferError if nbytes < 2**63 else ConfigError, match="nbytes") as raised:
            engine.allocate_shared(nbytes)
        assert own_segments() == before
        assert engine.regions() == ()
        assert len(str(raised.value)) < 300


def test_a_local_refusal_names_the_request_and_says_the_region_is_local(connected: tuple[TransferEngine, str]) -> None:
    """A request past the end of its local region, or naming no local region, is refused by `submit` and
    `transfer_sync` with a message that starts with the request's index in the batch and says "local", so it
    does not read as the peer's region's fault. (It read "region 1: bytes [...) are outside ...".)"""
    engine, peer = connected
    local, _buffer = engine.allocate_shared(4096)
    remote = 1  # the peer has no region: refused locally first, it is never asked
    fine = request(TransferOp.WRITE, local.region_id, peer, remote, 16)
    past_end = request(TransferOp.WRITE, local.region_id, peer, remote, 16, local_offset=4090)
    no_region = request(TransferOp.WRITE, local.region_id + 100, peer, remote, 16)
    expected_past = rf"^requests\[1\]: local region {local.region_id}: bytes \[4090, 4106\) are outside"
    expected_none = rf"^requests\[2\]: no local region {local.region_id + 100}$"
    for move in (engine.submit, lambda requests: engine.transfer_sync(requests, timeout=10)):
        with pytest.raises(TransferError, match=expected_past):
            move([fine, past_end])
        with pytest.raises(TransferError, match=expected_none):
            move([fine, fine, no_region])
    assert engine.num_batches == 0  # refused whole: nothing started
