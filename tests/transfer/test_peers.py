"""Peers, as engines use them: connecting again to a peer that is connected, and control calls queued behind
each other on a peer's one control connection.

- `connect` is idempotent for a healthy peer (as upstream's openSegment): the same engine, reached over the same
  transports, keeps its transports and the transfers moving on them, from one thread or several at once; only a
  restart, other transports or a broken RDMA queue pair builds anew.
- A control call waits at most `io_timeout_s` for the calls ahead of it, then is refused unsent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from mooncake.errors import PeerUnavailable, TransferTimeout
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.request import EngineConfig, RequestState, Slice, TransferOp
from tests.transfer.conftest import SECRET, request
from tests.transfer.fake_verbs import FakeFabric
from tests.waiting import wait_for

MIB = 1 << 20
TCP = EngineConfig(
    transports=("tcp",),  # type: ignore[arg-type]
    streams_per_peer=2,
    slice_bytes=1 << 16,
    io_timeout_s=5.0,
    connect_timeout_s=5.0,
)


@pytest.fixture
def two() -> Iterator[tuple[TransferEngine, TransferEngine]]:
    """Two engines over TCP, closed at the end."""
    a, b = TransferEngine(secret=SECRET, config=TCP), TransferEngine(secret=SECRET, config=TCP)
    yield a, b
    a.close()
    b.close()


def test_connecting_again_keeps_the_peers_transports_and_the_transfers_on_them(
    two: tuple[TransferEngine, TransferEngine],
) -> None:
    """A second `connect` to a connected peer (the same engine) returns the same key, keeps the very transport
    objects (none closed), refreshes the descriptor (a region registered since is listed), serves no extra
    connection, and the batch moving when it came ends DONE, byte-exact. (Each connect replaced the transports,
    failing every request in flight with "transport ... is closed".)"""
    a, b = two
    local, source = a.allocate_shared(16 * MIB)
    source[:] = np.arange(16 * MIB, dtype=np.uint64).astype(np.uint8)
    target = np.zeros(16 * MIB, np.uint8)
    remote = b.register_memory(target)
    peer = a.connect(b.address)
    transport = a._peers.transport_for(peer, remote.region_id)
    batch = a.submit([request(TransferOp.WRITE, local.region_id, peer, remote.region_id, 16 * MIB)])
    later = b.register_memory(np.zeros(64, np.uint8))
    assert a.connect(b.address) == peer
    assert a._peers.transport_for(peer, remote.region_id) is transport
    assert later.region_id in {region.region_id for region in a._peers.descriptor(peer).regions}
    (status,) = a.wait(batch, timeout=60)
    a.forget(batch)
    assert status.state == RequestState.DONE, status.error
    assert np.array_equal(source, target)
    wait_for(lambda: b.listener.num_served == 1 + TCP.streams_per_peer, timeout=10, what="one control, two streams")


def test_threads_connecting_at_once_each_get_a_peer_that_stays(two: tuple[TransferEngine, TransferEngine]) -> None:
    """Several threads that each make sure they are connected (check, then connect, unlocked: as a worker does)
    and then move bytes: every one's batch ends DONE, byte-exact, whichever connect came last, and the peer
    serves one set of connections in the end (the connects that lost the race closed theirs)."""
    a, b = two
    num_threads, length = 4, 4 * MIB
    local, source = a.allocate_shared(num_threads * length)
    source[:] = np.random.default_rng(7).integers(0, 256, num_threads * length, dtype=np.uint8)
    target = np.zeros(num_threads * length, np.uint8)
    remote = b.register_memory(target)
    start = threading.Barrier(num_threads)
    outcomes: list[Any] = []

    def worker(index: int) -> None:
        try:
            start.wait(10)
            peer = a.connect(b.address)
            offset = index * length
            write = request(
                TransferOp.WRITE,
                local.region_id,
                peer,
                remote.region_id,
                length,
                local_offset=offset,
                remote_offset=offset,
            )
            batch = a.submit([write])
            outcomes.append(a.wait(batch, timeout=60)[0])
            a.forget(batch)
        except Exception as error:  # reported below, by the test's thread
            outcomes.append(error)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert len(outcomes) == num_threads
    assert all(getattr(o, "state", None) == RequestState.DONE for o in outcomes), outcomes
    assert np.array_equal(source, target)
    wait_for(lambda: b.listener.num_served == 1 + TCP.streams_per_peer, timeout=10, what="one set of connections")


def test_a_peer_reached_over_other_transports_is_replaced(two: tuple[TransferEngine, TransferEngine]) -> None:
    """Connecting with another transport forced builds that one and closes the old (a slice on it fails as
    closed); the peer is then reached over the new one."""
    a, b = two
    remote, _shared = b.allocate_shared(4096)
    peer = a.connect(b.address)
    old = a._peers.transport_for(peer, remote.region_id)
    assert a.transport_names(a.connect(b.address, transport="shm")) == ("shm",)
    assert a._peers.transport_for(peer, remote.region_id) is not old
    closed = old.run_inline(Slice(TransferOp.READ, memoryview(bytearray(1)), remote.region_id, 0, lambda _e: None))
    assert isinstance(closed, PeerUnavailable) and "closed" in str(closed)
    local, _buffer = a.allocate_shared(4096)
    (status,) = a.transfer_sync([request(TransferOp.READ, local.region_id, peer, remote.region_id, 4096)], timeout=10)
    assert status.state == RequestState.DONE and status.transport == "shm"


def test_connecting_again_keeps_a_healthy_queue_pair_and_rebuilds_a_broken_one(
    rdma_pair: tuple[FakeFabric, TransferEngine, TransferEngine],
) -> None:
    """Over RDMA a second connect accepts no second queue pair at the peer while the first works; once a failed
    completion took it down (it stays down), connecting again is how it comes back: a new one moves bytes."""
    fabric, a, b = rdma_pair
    local = a.register_memory(np.full(4096, 5, np.uint8))
    target = np.zeros(4096, np.uint8)
    remote = b.register_memory(target)
    peer = a.connect(b.address)
    assert b.num_accepted_queue_pairs == 1
    assert a.connect(b.address) == peer
    assert b.num_accepted_queue_pairs == 1
    write = request(TransferOp.WRITE, local.region_id, peer, remote.region_id, 4096)
    fabric.fail_next = 1
    (status,) = a.transfer_sync([write], timeout=10)
    assert status.state == RequestState.FAILED and isinstance(status.error, PeerUnavailable)
    a.connect(b.address)
    assert b.num_accepted_queue_pairs == 2
    (status,) = a.transfer_sync([write], timeout=10)
    assert status.state == RequestState.DONE and status.transport == "rdma"
    assert target.tolist() == [5] * 4096


def test_a_control_call_waits_behind_others_at_most_the_io_timeout() -> None:
    """Calls to one peer share its control connection, one at a time: with one call running and two more
    queued, each call 0.6 of the io timeout, one of the queued ones would wait past the io timeout. It is refused
    then, with a TransferTimeout naming the peer, the method and why, unsent (the handler ran for the other two
    only), and no call takes much past the io timeout of waiting plus its own reply. (They all queued, the last
    one returning after more than twice the io timeout.)"""
    config = EngineConfig(transports=("tcp",), io_timeout_s=2.0, connect_timeout_s=2.0)  # type: ignore[arg-type]
    hold_s = 0.6 * config.io_timeout_s
    with TransferEngine(secret=SECRET, config=config) as here, TransferEngine(secret=SECRET, config=config) as there:
        ran: list[Any] = []
        first_in = threading.Event()

        def slow(args: Any) -> Any:
            ran.append(args)
            first_in.set()
            threading.Event().wait(hold_s)  # a handler that takes its time (no one sets this event)
            return args

        there.register_handler("slow", slow)
        peer = here.connect(there.address)
        outcomes: dict[int, tuple[float, Any]] = {}

        def caller(index: int) -> None:
            start = time.monotonic()
            try:
                result: Any = here.call(peer, "slow", index)
            except Exception as error:
                result = error
            outcomes[index] = (time.monotonic() - start, result)

        threads = [threading.Thread(target=caller, args=(0,), daemon=True)]
        threads[0].start()
        assert first_in.wait(10)
        threads += [threading.Thread(target=caller, args=(i,), daemon=True) for i in (1, 2)]
        for thread in threads[1:]:
            thread.start()
        for thread in threads:
            thread.join(30)
        refused = [result for _, result in outcomes.values() if isinstance(result, TransferTimeout)]
        assert len(refused) == 1, outcomes
        message = str(refused[0])
        assert peer in message and "slow" in message and "behind other control calls" in message
        assert sorted(ran) == sorted(i for i, (_, r) in outcomes.items() if not isinstance(r, Exception))
        assert len(ran) == 2
        assert all(took < config.io_timeout_s + hold_s + 1.0 for took, _ in outcomes.values()), outcomes
