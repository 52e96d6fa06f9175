"""Lifecycles of the engine's records and threads: a WRITE the serving side holds when its engine closes or its
region goes, batch records from `submit` to `forget`, and peers from `connect` to `disconnect`.

The serving side is held at one moment, between a checksummed WRITE's last byte and its copy into the region, by
standing in for `tcp.xxhash` (`HeldHashing`): so "the engine closes while a payload is being verified" happens on
every run, not by luck of timing. Everything runs in this process on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.errors import ConfigError, PeerUnavailable, TransferError, TransferTimeout
from mooncake.transfer import tcp
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.request import EngineConfig, RequestState, TransferOp
from tests.transfer.conftest import SECRET, request
from tests.waiting import wait_for

KIB = 1 << 10
MIB = 1 << 20
SERVER = EngineConfig(io_timeout_s=5.0)
# Checksummed, so that the serving side stages and hashes each WRITE; one stream and no retry: one slice in flight.
CLIENT = EngineConfig(checksums=True, streams_per_peer=1, max_retries=0, io_timeout_s=5.0, slice_bytes=MIB)


class HeldHashing:
    """Stands in for `tcp.xxhash`: a serving thread that hashes a payload of `nbytes` waits there for `release`
    (at most 30 s), with the whole payload received and not yet copied into its region."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.hashing = threading.Event()
        self.release = threading.Event()

    def xxh3_64_intdigest(self, data: Any) -> int:
        digest: int = xxhash.xxh3_64_intdigest(data)
        if threading.current_thread().name.endswith("-serve") and memoryview(data).nbytes == self.nbytes:
            self.hashing.set()
            self.release.wait(timeout=30)
        return digest


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[HeldHashing]:
    """A `HeldHashing` of `request.param` bytes (64 KiB unless parametrized) in place; released at the end."""
    hashing = HeldHashing(getattr(request, "param", 64 * KIB))
    monkeypatch.setattr(tcp, "xxhash", hashing)
    yield hashing
    hashing.release.set()


class HeldWrite(NamedTuple):
    server: TransferEngine
    client: TransferEngine
    region_id: int
    peer: str
    write: Any
    batch: int


@contextlib.contextmanager
def held_write(held: HeldHashing, target: np.ndarray) -> Iterator[HeldWrite]:
    """A server with `target` registered and a client connected to it over TCP (both closed at the end), and a
    checksummed WRITE of `held.nbytes` sevens from the client into `target`, submitted and held in the server's
    hash."""
    with (
        TransferEngine(secret=SECRET, config=SERVER) as server,
        TransferEngine(secret=SECRET, config=CLIENT) as client,
    ):
        region = server.register_memory(target)
        local, source = client.allocate_shared(held.nbytes)
        source[:] = 7
        peer = client.connect(server.address, transport="tcp")
        write = request(TransferOp.WRITE, local.region_id, peer, region.region_id, held.nbytes)
        batch = client.submit([write])
        assert held.hashing.wait(timeout=20), "the WRITE never reached the serving side's hash"
        yield HeldWrite(server, client, region.region_id, peer, write, batch)


def serving_threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name.endswith("-serve")}


@pytest.mark.parametrize("held", [4 * KIB, MIB], indirect=True, ids=["connection-buffer", "staging-pool"])
def test_no_byte_of_a_write_lands_after_close_returned(held: HeldHashing) -> None:
    """A checksummed WRITE whose payload the serving side has received and is verifying when its engine closes:
    `close` waits for that thread, which then finds the engine closing and refuses the WRITE, so the region holds
    at `close`'s return what it holds for good (and the WRITE fails at its sender). (`close` used to shut the
    connection and return at once; the thread then hashed the payload and copied it into memory its owner
    believed unserved.)"""
    before = serving_threads()
    target = np.zeros(held.nbytes, np.uint8)
    server = TransferEngine(secret=SECRET, config=SERVER)
    try:
        region = server.register_memory(target)
        with TransferEngine(secret=SECRET, config=CLIENT) as client:
            local, source = client.allocate_shared(held.nbytes)
            source[:] = 7
            peer = client.connect(server.address, transport="tcp")
            batch = client.submit([request(TransferOp.WRITE, local.region_id, peer, region.region_id, held.nbytes)])
            assert held.hashing.wait(timeout=20), "the WRITE never reached the serving side's hash"
            at_return: list[np.ndarray] = []

            def close() -> None:
                server.close()
                at_return.append(target.copy())

            closer = threading.Thread(target=close, daemon=True)
            closer.start()
            # A close that does not wait for the serving thread returns within this; one that does is still
            # waiting (up to io_timeout_s, 5 s) when the payload is let go below.
            closer.join(timeout=1.0)
            held.release.set()
            closer.join(timeout=20)
            assert at_return, "close() did not return"
            for thread in serving_threads() - before:  # whatever they still do with the payload, done now
                thread.join(timeout=10)
            (status,) = client.wait(batch, timeout=20)
            client.forget(batch)
        assert np.array_equal(target, at_return[0]), "bytes landed in the region after close() returned"
        assert not target.any() and status.state is RequestState.FAILED, status
    finally:
        held.release.set()
        server.close()


@pytest.mark.parametrize("held", [4 * KIB, MIB], indirect=True, ids=["connection-buffer", "staging-pool"])
def test_a_write_whose_region_is_unregistered_while_it_arrives_is_refused(held: HeldHashing) -> None:
    """The owner unregisters the target region while a checksummed WRITE to it is being verified: the WRITE is
    refused (naming the region) and the memory is left as it was, not copied into after the owner let it go."""
    target = np.zeros(held.nbytes, np.uint8)
    with held_write(held, target) as (server, client, region_id, _, _, batch):
        server.unregister_memory(region_id)
        held.release.set()
        (status,) = client.wait(batch, timeout=20)
        client.forget(batch)
    assert status.state is RequestState.FAILED and f"region {region_id} was unregistered" in str(status.error)
    assert not target.any()


def test_forget_refuses_a_batch_still_moving_and_close_wakes_its_waiter(held: HeldHashing) -> None:
    """`forget` of a batch with a request pending raises, naming the batch and the count (upstream's freeBatchID
    refuses it too), and keeps the record, so a thread waiting on it still has what it waits on: `close` ends
    the request and that waiter returns. (`forget` used to drop it: the waiter then never returned, not even
    after `close`.)"""
    with held_write(held, np.zeros(held.nbytes, np.uint8)) as (_, client, _, _, _, batch):
        outcome: list[Any] = []
        waiter = threading.Thread(target=lambda: outcome.append(client.wait(batch, None)), daemon=True)
        waiter.start()
        with pytest.raises(TransferError, match=rf"^batch {batch} still has 1 of 1 requests pending"):
            client.forget(batch)
        assert client.status(batch)[0].state is RequestState.PENDING and client.num_batches == 1
        client.close()
        held.release.set()  # else the server's close waits for its serving thread (up to io_timeout_s)
        waiter.join(timeout=20)
        assert not waiter.is_alive(), "a waiter of a batch still moving at close() was never woken"
        (status,) = outcome[0]
        assert status.state is RequestState.FAILED and isinstance(status.error, PeerUnavailable)
        client.forget(batch)  # ended now
        assert client.num_batches == 0


def test_transfer_sync_drops_the_batch_it_made_once_that_ends(held: HeldHashing) -> None:
    """A `transfer_sync` of several slices goes through a batch of its own; cut by its timeout while a slice is
    still moving, it reports the request FAILED, and its record stays until the slice ends, then goes (nobody
    else knows its id to forget it)."""
    config = EngineConfig(checksums=True, streams_per_peer=1, max_retries=0, io_timeout_s=5.0, slice_bytes=64 * KIB)
    with (
        TransferEngine(secret=SECRET, config=SERVER) as server,
        TransferEngine(secret=SECRET, config=config) as client,
    ):
        region = server.register_memory(np.zeros(2 * held.nbytes, np.uint8))
        local, _ = client.allocate_shared(2 * held.nbytes)
        peer = client.connect(server.address, transport="tcp")
        (status,) = client.transfer_sync(
            [request(TransferOp.WRITE, local.region_id, peer, region.region_id, 2 * held.nbytes)], timeout=0.5
        )
        assert status.state is RequestState.FAILED and isinstance(status.error, TransferTimeout), status
        assert held.hashing.is_set() and client.num_batches == 1
        held.release.set()
        wait_for(lambda: client.num_batches == 0, timeout=20, what="transfer_sync's batch to be dropped as it ended")


def test_forget_when_ended_drops_a_batch_as_its_last_request_ends(held: HeldHashing) -> None:
    """`forget_when_ended` of a batch still moving keeps its record (a waiter is still woken) and drops it the
    moment its last request ends; of an ended batch it drops it at once; a bad id is refused by name."""
    with held_write(held, np.zeros(held.nbytes, np.uint8)) as (_, client, _, _, _, batch):
        client.forget_when_ended(batch)
        assert client.status(batch)[0].state is RequestState.PENDING and client.num_batches == 1
        held.release.set()
        wait_for(lambda: client.num_batches == 0, timeout=20, what="the batch to be dropped as it ended")
        client.forget_when_ended(batch)  # no record any more: left alone, as forget
        with pytest.raises(ConfigError, match=r"^batch_id must be an integer >= 0, got -1$"):
            client.forget_when_ended(-1)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[TransferEngine, TransferEngine, str, int, int]]:
    """Two engines on 127.0.0.1, the first connected to the second over TCP: (client, server, peer, local region,
    remote region), 64 KiB each."""
    with (
        TransferEngine(secret=SECRET, config=SERVER) as server,
        TransferEngine(secret=SECRET, config=EngineConfig(io_timeout_s=5.0)) as client,
    ):
        remote, _ = server.allocate_shared(64 * KIB)
        local, _ = client.allocate_shared(64 * KIB)
        yield client, server, client.connect(server.address, transport="tcp"), local.region_id, remote.region_id


@settings(max_examples=30, deadline=None)
@given(steps=st.lists(st.sampled_from(["submit", "wait", "forget", "forget-unknown"]), max_size=12))
def test_batch_records_live_from_submit_to_forget(
    pair: tuple[TransferEngine, TransferEngine, str, int, int], steps: list[str]
) -> None:
    """Against a model (the batches submitted and not forgotten): `num_batches` counts exactly those; `forget`
    of one whose requests ended drops it, of one still moving is refused naming it (its record and its outcome
    stay), and of an id with no record does nothing. A batch waited for is always forgettable."""
    client, _server, peer, local, remote = pair
    base = client.num_batches
    held: list[int] = []  # the model: oldest first
    for step in steps:
        if step == "submit":
            held.append(client.submit([request(TransferOp.WRITE, local, peer, remote, 4 * KIB)]))
        elif step == "wait" and held:
            assert [s.state for s in client.wait(held[0], timeout=20)] == [RequestState.DONE]
            client.forget(held.pop(0))
        elif step == "forget" and held:
            try:
                client.forget(held[-1])
            except TransferError as refused:
                assert str(refused).startswith(f"batch {held[-1]} still has 1 of 1 requests pending")
                assert len(client.status(held[-1])) == 1  # kept
            else:
                held.pop()
        elif step == "forget-unknown":
            client.forget(10**9)
        assert client.num_batches == base + len(held)
        client.check_invariants()
    for batch in held:
        client.wait(batch, timeout=20)
        client.forget(batch)
    assert client.num_batches == base


def test_disconnect_fails_what_is_in_flight_and_lets_the_peer_go(held: HeldHashing) -> None:
    """`disconnect` of a peer with a WRITE in flight: the WRITE fails with PeerUnavailable (it does not hang),
    the peer's transport threads end, the peer is unknown afterwards (a second `disconnect` is refused naming it),
    and `connect` to it again works. (There was no way to drop a peer short of closing the engine: peers that
    went away kept their threads and sockets for good.)"""
    with held_write(held, np.zeros(held.nbytes, np.uint8)) as (server, client, _, peer, write, batch):
        prefix = f"tcp-{server.host}:{server.port}"
        assert any(thread.name.startswith(prefix) for thread in threading.enumerate())
        client.disconnect(peer)
        (status,) = client.wait(batch, timeout=20)
        client.forget(batch)
        assert status.state is RequestState.FAILED and isinstance(status.error, PeerUnavailable), status
        assert not [thread.name for thread in threading.enumerate() if thread.name.startswith(prefix)]
        with pytest.raises(TransferError, match=r"^unknown peer"):
            client.submit([write])
        with pytest.raises(TransferError, match=rf"^unknown peer '{peer}': not connected"):
            client.disconnect(peer)
        with pytest.raises(ConfigError, match=r"^peer must be"):
            client.disconnect(5)  # type: ignore[arg-type]
        held.release.set()
        assert client.connect(server.address, transport="tcp") == peer
        (status,) = client.transfer_sync([write], timeout=20)
        assert status.state is RequestState.DONE, status


def test_peers_that_come_and_go_hold_nothing_once_disconnected() -> None:
    """Peers that start, are connected to (shm and tcp), stop and are disconnected leave no thread and no
    descriptor behind in the engine that dialled them."""
    with TransferEngine(secret=SECRET, config=EngineConfig(io_timeout_s=5.0)) as client:
        threads = threading.active_count()
        for _ in range(3):
            with TransferEngine(secret=SECRET, config=SERVER) as server:
                peer = client.connect(server.address)
            client.disconnect(peer)
        wait_for(lambda: threading.active_count() <= threads, timeout=20, what="the peers' threads to end")
