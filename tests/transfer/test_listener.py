"""The listener under connection floods: unauthenticated connections have a budget and deadline of their own."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from mooncake.errors import ConfigError, PeerUnavailable, TransferError
from mooncake.transfer import listener as listener_module
from mooncake.transfer import tcp
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.request import EngineConfig, RequestState, TransferOp
from tests.transfer.conftest import SECRET, request
from tests.transfer.peer_process import pattern

SIZE = 1 << 20


def address_of(engine: TransferEngine) -> tuple[str, int]:
    return engine.host, engine.port


def wait_until(condition: Callable[[], bool], *, timeout_s: float) -> bool:
    """Poll `condition` until it holds or `timeout_s` passes; whether it held."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def closed_by_peer(sock: socket.socket, *, timeout_s: float) -> bool:
    """Whether the other end closes `sock` within `timeout_s` (what it sent before is read and dropped)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ready, _, _ = select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            return False
        try:
            if not sock.recv(65536):
                return True
        except OSError:  # reset: closed too
            return True


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    """Raw client sockets a test opens; all closed at the end."""
    opened: list[socket.socket] = []
    yield opened
    for sock in opened:
        sock.close()


def flood(
    target: tuple[str, int], count: int, opened: list[socket.socket], *, source: str = "127.0.0.1"
) -> list[socket.socket]:
    """`count` TCP connections from `source` that never say a word."""
    made = [socket.create_connection(target, timeout=5, source_address=(source, 0)) for _ in range(count)]
    opened.extend(made)
    return made


def other_loopback_address() -> str | None:
    """A second loopback address (Linux routes all of 127/8 to lo), or None where it is not usable."""
    try:
        with socket.create_server(("127.0.0.2", 0)):
            return "127.0.0.2"
    except OSError:
        return None


def test_a_flood_of_silent_connects_does_not_lock_out_peers(sockets: list[socket.socket]) -> None:
    """Three times `max_connections` silent connects, then a peer connects and transfers, promptly.

    The flood stays within its own small budget: the oldest silent connections make room,
    the rest are closed at their deadline, and the authenticated slots stay free for peers.
    """
    config = EngineConfig(
        max_connections=8, max_unauthenticated_connections=4, auth_timeout_s=1.0, streams_per_peer=2, io_timeout_s=5.0
    )
    with (
        TransferEngine(secret=SECRET, config=config) as server,
        TransferEngine(secret=SECRET, config=EngineConfig(streams_per_peer=2, io_timeout_s=5.0)) as client,
    ):
        target = np.zeros(SIZE, np.uint8)
        remote = server.register_memory(target)
        source = pattern(SIZE, 3)
        local = client.register_memory(source)
        silent = flood(address_of(server), 3 * config.max_connections, sockets)
        start = time.monotonic()
        peer = client.connect(server.address, transport="tcp")
        statuses = client.transfer_sync(
            [request(TransferOp.WRITE, local.region_id, peer, remote.region_id, SIZE)], timeout=10
        )
        assert statuses[0].state == RequestState.DONE, statuses[0]
        assert time.monotonic() - start < 10
        assert np.array_equal(target, source)
        server.listener.check_invariants()
        # Every silent connection is closed: made room for the others, or out of time.
        assert all(closed_by_peer(sock, timeout_s=config.auth_timeout_s + 5) for sock in silent)
        assert wait_until(lambda: server.listener.num_pending == 0, timeout_s=5)


@pytest.mark.skipif(other_loopback_address() is None, reason="127.0.0.2 is not a usable loopback address here")
def test_a_sustained_flood_leaves_authenticated_peers_alone(sockets: list[socket.socket]) -> None:
    """While silent connections keep coming from another address (each one the engine drops is
    opened again), a peer connects, transfers, and connects once more; the pending budget is
    never exceeded. The flood churns its own pending connections, never the peer's handshake."""
    config = EngineConfig(
        max_connections=8, max_unauthenticated_connections=8, auth_timeout_s=0.5, streams_per_peer=2, io_timeout_s=5.0
    )
    stop = threading.Event()
    with (
        TransferEngine(secret=SECRET, config=config) as server,
        TransferEngine(secret=SECRET, config=EngineConfig(streams_per_peer=2, io_timeout_s=5.0)) as client,
    ):
        target = np.zeros(SIZE, np.uint8)
        remote = server.register_memory(target)
        local = client.register_memory(pattern(SIZE, 4))
        reopened = [0]

        def keep_flooding() -> None:
            live = flood(address_of(server), 2 * config.max_connections, sockets, source="127.0.0.2")
            while not stop.is_set():
                ready, _, _ = select.select(live, [], [], 0.05)
                for sock in ready:
                    try:
                        data = sock.recv(65536)  # the hello, or the end
                    except OSError:
                        data = b""
                    if not data:
                        live.remove(sock)
                        with contextlib.suppress(OSError):
                            live.extend(flood(address_of(server), 1, sockets, source="127.0.0.2"))
                            reopened[0] += 1
                stop.wait(0.002)  # a steady flood, not a busy loop starving the threads under test

        flooder = threading.Thread(target=keep_flooding, daemon=True)
        flooder.start()
        try:
            assert wait_until(lambda: reopened[0] > config.max_unauthenticated_connections, timeout_s=10)
            churned_before = reopened[0]
            peer = client.connect(server.address, transport="tcp")
            for round_ in range(3):
                statuses = client.transfer_sync(
                    [request(TransferOp.WRITE, local.region_id, peer, remote.region_id, SIZE)], timeout=10
                )
                assert statuses[0].state == RequestState.DONE, (round_, statuses[0])
                server.listener.check_invariants()
            assert client.connect(server.address, transport="tcp") == peer  # a fresh handshake gets through too
            assert client.call(peer, "describe", None) is not None
            assert reopened[0] > churned_before, "the flood went on while the peer worked"
        finally:
            stop.set()
            flooder.join(timeout=10)
        assert np.array_equal(target, pattern(SIZE, 4))


def test_pending_connections_end_at_their_deadline(sockets: list[socket.socket]) -> None:
    """A silent connection and one that dribbles its answer a byte at a time are both closed by auth_timeout_s."""
    config = EngineConfig(auth_timeout_s=0.5)
    with TransferEngine(secret=SECRET, config=config) as server:
        silent, slow = flood(address_of(server), 2, sockets)
        start = time.monotonic()
        dribbled = 0
        while not closed_by_peer(slow, timeout_s=0) and time.monotonic() - start < 10:
            with contextlib.suppress(OSError):
                slow.send(b"\x00")  # progress that never completes the answer
                dribbled += 1
            time.sleep(0.05)
        assert time.monotonic() - start < 3, "the deadline counts from the connect, not from the last byte"
        assert dribbled > 1
        assert closed_by_peer(silent, timeout_s=3)
        assert wait_until(lambda: server.listener.num_pending == 0, timeout_s=5)


def test_a_full_engine_answers_busy_and_admits_again_when_a_slot_frees() -> None:
    """Past max_connections an authenticated peer hears "busy" (PeerUnavailable) at once; a closed
    connection frees its slot."""
    config = EngineConfig(max_connections=2)
    with TransferEngine(secret=SECRET, config=config) as server:
        host, port = address_of(server)
        first = tcp.connect(host, port, secret=SECRET, config=config)
        second = tcp.connect(host, port, secret=SECRET, config=config)
        try:
            assert wait_until(lambda: server.listener.num_served == 2, timeout_s=5)
            start = time.monotonic()
            with pytest.raises(PeerUnavailable, match="max_connections"):
                tcp.connect(host, port, secret=SECRET, config=config)
            assert time.monotonic() - start < 2
            first.close()
            assert wait_until(lambda: server.listener.num_served == 1, timeout_s=5)
            third = tcp.connect(host, port, secret=SECRET, config=config)
            assert tcp.call(third, "describe", None) is not None
            third.close()
        finally:
            first.close()
            second.close()


def test_wrong_answers_are_refused_and_peers_still_get_in(sockets: list[socket.socket]) -> None:
    """Many connections answering the challenge wrongly are told NO (or make room for younger ones
    before their answer is read) and closed; an honest peer still gets in."""
    config = EngineConfig(max_unauthenticated_connections=4, auth_timeout_s=2.0)
    with TransferEngine(secret=SECRET, config=config) as server:
        liars = flood(address_of(server), 32, sockets)
        for liar in liars:
            liar.sendall(bytes(64))
        for liar in liars:
            received = b""
            with contextlib.suppress(OSError):
                while chunk := liar.recv(64):
                    received += chunk
            assert received[:10] in (b"MCTE-HELLO", b"")
            assert received[43:] in (b"NO", b""), received[43:]
        host, port = address_of(server)
        with contextlib.closing(tcp.connect(host, port, secret=SECRET, config=config)) as honest:
            assert tcp.call(honest, "describe", None) is not None
        server.listener.check_invariants()


def test_the_new_limits_are_validated() -> None:
    """The unauthenticated budget and deadline, and the staging memory, must be sensible."""
    with pytest.raises(ConfigError, match="max_unauthenticated_connections"):
        EngineConfig(max_unauthenticated_connections=0)
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="auth_timeout_s"):
            EngineConfig(auth_timeout_s=bad)
    with pytest.raises(ConfigError, match="max_staging_bytes"):
        EngineConfig(max_frame_bytes=64 << 20, max_staging_bytes=1 << 20)
    assert EngineConfig().auth_timeout_s <= 5.0


@pytest.mark.parametrize("where", ["port in use", "no-such-host.invalid", "192.0.2.1"])
def test_an_address_the_engine_cannot_listen_on_is_a_transfer_error_naming_it(where: str) -> None:
    """A port another engine holds, a host that does not resolve and one that is not this machine's (TEST-NET-1)
    are a TransferError naming host and port, and the engine that failed to start leaves no socket or thread
    behind. (They were a bare OSError from socket.create_server.)"""
    with TransferEngine(secret=SECRET) as holder:
        host, port = (holder.host, holder.port) if where == "port in use" else (where, 0)
        fds, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
        with pytest.raises(TransferError, match=rf"^cannot listen on {host}:{port}: ") as raised:
            TransferEngine(secret=SECRET, config=EngineConfig(host=host, port=port))
        assert isinstance(raised.value.__cause__, OSError)
        assert len(os.listdir("/proc/self/fd")) == fds and threading.active_count() == threads
        assert holder.call(holder.connect(holder.address), "describe", None) is not None  # the holder serves on


@pytest.mark.parametrize("field", ["io_timeout_s", "idle_timeout_s", "auth_timeout_s", "connect_timeout_s"])
def test_timeouts_are_bounded_by_what_the_system_can_wait(field: str) -> None:
    """A timeout is at most 1e6 s (11.6 days), a ConfigError naming the field and value past it: poll() takes at
    most 2**31 - 1 ms, so a finite 3e6 s used to be accepted and then overflow where it was waited on (every
    served connection dropped at once for idle_timeout_s, the gate thread dead for good for auth_timeout_s)."""
    with pytest.raises(ConfigError, match=rf"^{field} must be at most 1e\+06 s, got 3000000.0$"):
        EngineConfig(**{field: 3e6})  # type: ignore[arg-type]
    assert getattr(EngineConfig(**{field: 1e6}), field) == 1e6  # type: ignore[arg-type]


def test_an_engine_waits_as_long_as_its_largest_timeouts_allow() -> None:
    """At the bounds (1e6 s to idle and to authenticate), served connections are kept between frames and the gate
    keeps admitting peers while a connection is pending."""
    config = EngineConfig(idle_timeout_s=1e6, auth_timeout_s=1e6, spin_us=0, io_timeout_s=5.0)
    with (
        TransferEngine(secret=SECRET, config=config) as server,
        TransferEngine(secret=SECRET, config=EngineConfig(max_retries=0, io_timeout_s=5.0)) as client,
        socket.create_connection(address_of(server), timeout=5) as pending,
    ):
        pending.recv(64)  # the hello: the gate now waits on a pending handshake with a deadline 1e6 s away
        remote = server.register_memory(np.zeros(4096, np.uint8))
        local = client.register_memory(pattern(4096, 2).copy())
        peer = client.connect(server.address, transport="tcp")
        for _ in range(2):  # the second on the connection the first left waiting between frames
            (status,) = client.transfer_sync(
                [request(TransferOp.WRITE, local.region_id, peer, remote.region_id, 4096)], timeout=10
            )
            assert status.state is RequestState.DONE, status
        assert server.listener.num_gate_errors == 0


@pytest.mark.parametrize("step", ["server_hello", "server_verdict"])
def test_the_gate_survives_an_unexpected_error_on_one_connection(step: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unexpected exception while the gate greets or decides one connection ends that connection (counted in
    `num_gate_errors`), not the gate: the next peer gets in. (It used to end the gate thread, and the listening
    socket with it: the engine accepted no one again, and nothing said so.)"""
    real = getattr(listener_module, step)
    failures = iter([True])

    def failing_once(*args: Any, **kwargs: Any) -> Any:
        if next(failures, False):
            raise RuntimeError(f"an unforeseen failure in {step}")
        return real(*args, **kwargs)

    monkeypatch.setattr(listener_module, step, failing_once)
    with (
        TransferEngine(secret=SECRET, config=EngineConfig(io_timeout_s=5.0)) as server,
        TransferEngine(secret=SECRET, config=EngineConfig(io_timeout_s=5.0)) as client,
    ):
        with pytest.raises(TransferError):
            client.connect(server.address, transport="tcp")
        peer = client.connect(server.address, transport="tcp")
        assert client.refresh(peer).pid == os.getpid()
        assert server.listener.num_gate_errors == 1
        server.listener.check_invariants()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm to see the segment unlinked")
def test_a_serving_thread_the_system_refuses_ends_its_connection_and_close_still_finishes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Starting the thread that would serve an authenticated connection fails once (the system refuses a thread:
    a pids limit, say): that connection ends (its client's connect fails, counted in `num_gate_errors`), the next
    peer is served, and the engine's close finishes: it unlinks its shared segments. (The thread that never
    started stayed among those `close` joins: close raised RuntimeError halfway and left the segment behind.)"""
    real_start = threading.Thread.start
    refusals = iter([True])

    def start(thread: threading.Thread) -> None:
        if thread.name.endswith("-serve") and next(refusals, False):
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    config = EngineConfig(io_timeout_s=5.0)
    server = TransferEngine(secret=SECRET, config=config)
    try:
        shared, _array = server.allocate_shared(4096)
        segment = f"/dev/shm/{shared.shm_name}"
        assert os.path.exists(segment)
        with TransferEngine(secret=SECRET, config=config) as client:
            with pytest.raises(TransferError):
                client.connect(server.address, transport="tcp")
            assert server.listener.num_gate_errors == 1
            peer = client.connect(server.address, transport="tcp")
            assert client.refresh(peer).pid == os.getpid()
        assert wait_until(lambda: server.listener.num_served == 0, timeout_s=10)
    finally:
        server.close()
    assert not os.path.exists(segment), "close stopped before it unlinked the engine's segment"
