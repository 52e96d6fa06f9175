"""The RDMA transport: its logic against an in-memory fabric; pyverbs where a device exists."""

from __future__ import annotations

import shutil
import subprocess
import time
from typing import Any

import attrs
import numpy as np
import pytest

from mooncake.errors import PeerUnavailable, ProtocolError, TransferError, TransferTimeout
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.rdma import MAX_SEND_WR, RdmaTransport, open_device
from mooncake.transfer.request import EngineConfig, RequestState, TransferOp
from tests.transfer.conftest import SECRET, request
from tests.transfer.fake_verbs import FakeFabric, FakeVerbs
from tests.transfer.peer_process import pattern
from tests.waiting import wait_for

SIZE = 1 << 20


@pytest.fixture
def pair(
    rdma_pair: tuple[FakeFabric, TransferEngine, TransferEngine],
) -> tuple[FakeFabric, TransferEngine, TransferEngine]:
    return rdma_pair


def test_rdma_is_preferred_and_moves_bytes(pair: tuple[FakeFabric, TransferEngine, TransferEngine]) -> None:
    """Two RDMA engines connect queue pairs in the handshake; writes and reads are byte-exact."""
    fabric, a, b = pair
    source = pattern(SIZE, 3)
    local = a.register_memory(source)
    target = np.zeros(SIZE, np.uint8)
    remote = b.register_memory(target)
    assert local.rdma_rkey is not None and remote.rdma_address is not None
    peer = a.connect(b.address)
    assert a.transport_names(peer) == ("rdma", "tcp")
    statuses = a.wait(a.submit([request(TransferOp.WRITE, local.region_id, peer, remote.region_id, SIZE)]), timeout=10)
    assert statuses[0].state == RequestState.DONE and statuses[0].transport == "rdma"
    assert np.array_equal(source, target)
    assert fabric.posted == SIZE // (1 << 16)  # one work request per slice
    back = np.zeros(4096, np.uint8)
    back_region = a.register_memory(back)
    statuses = a.wait(
        a.submit([request(TransferOp.READ, back_region.region_id, peer, remote.region_id, 4096, remote_offset=5000)]),
        timeout=10,
    )
    assert statuses[0].state == RequestState.DONE
    assert np.array_equal(back, source[5000:9096])


@pytest.mark.parametrize(("max_send_wr", "num_requests", "slices_per_request"), [(None, 1, 1100), (8, 48, 12)])
def test_more_work_requests_than_the_send_queue_holds_all_complete(
    max_send_wr: int | None, num_requests: int, slices_per_request: int
) -> None:
    """One request of more slices than a real queue pair's depth (1024), and many requests over a shallow one
    (the fake refuses a post past max_send_wr with ENOMEM, as ibv_post_send does): every request is DONE over
    rdma with its bytes in place, every slice posted exactly once, never more than the depth outstanding.
    (Every slice was posted at once: the 1025th was refused and its request FAILED.)"""
    fabric = FakeFabric() if max_send_wr is None else FakeFabric(max_send_wr=max_send_wr)
    slice_bytes = 4096
    size = num_requests * slices_per_request * slice_bytes
    config = EngineConfig(transports=("rdma", "tcp"), slice_bytes=slice_bytes, io_timeout_s=10.0)
    with (
        TransferEngine(secret=SECRET, config=config, rdma=FakeVerbs(fabric)) as a,
        TransferEngine(secret=SECRET, config=config, rdma=FakeVerbs(fabric)) as b,
    ):
        source = pattern(size, 9)
        local = a.register_memory(source)
        target = np.zeros(size, np.uint8)
        remote = b.register_memory(target)
        peer = a.connect(b.address)
        length = slices_per_request * slice_bytes
        requests = [
            request(TransferOp.WRITE, local.region_id, peer, remote.region_id, length, local_offset=i * length)
            for i in range(num_requests)
        ]
        depth = max_send_wr or MAX_SEND_WR
        fabric.hold = True  # the NIC completes nothing until the send queue is full
        batch = a.submit([attrs.evolve(r, remote_offset=r.local_offset) for r in requests])
        wait_for(lambda: fabric.posted >= depth, timeout=30, what="the send queue to fill")
        assert fabric.posted == depth, fabric.posted
        fabric.hold = False
        statuses = a.wait(batch, timeout=60)
        assert all(s.state is RequestState.DONE and s.transport == "rdma" for s in statuses), statuses
        assert np.array_equal(source, target)
        assert fabric.posted == num_requests * slices_per_request
        assert fabric.peak_outstanding == depth


def test_remote_bounds_are_checked_before_posting(pair: tuple[FakeFabric, TransferEngine, TransferEngine]) -> None:
    """An offset past the peer's region refuses the request without posting a work request (refused whole by
    `submit`: the peer described the region; the transport's own check of each slice is RdmaMachine's)."""
    fabric, a, b = pair
    local = a.register_memory(np.zeros(SIZE, np.uint8))
    remote = b.register_memory(np.zeros(100, np.uint8))
    peer = a.connect(b.address)
    with pytest.raises(TransferError, match="outside"):
        a.submit([request(TransferOp.WRITE, local.region_id, peer, remote.region_id, 50, remote_offset=60)])
    assert fabric.posted == 0


def test_a_failed_completion_takes_the_queue_pair_down(pair: tuple[FakeFabric, TransferEngine, TransferEngine]) -> None:
    """A failed work request fails its request and, the RC queue pair being in error, every later one."""
    fabric, a, b = pair
    local = a.register_memory(pattern(SIZE, 4))
    remote = b.register_memory(np.zeros(SIZE, np.uint8))
    peer = a.connect(b.address)
    fabric.fail_next = 1
    statuses = a.wait(
        a.submit([request(TransferOp.WRITE, local.region_id, peer, remote.region_id, 1 << 16)]), timeout=10
    )
    assert statuses[0].state == RequestState.FAILED and isinstance(statuses[0].error, PeerUnavailable)
    statuses = a.wait(a.submit([request(TransferOp.WRITE, local.region_id, peer, remote.region_id, 100)]), timeout=10)
    assert statuses[0].state == RequestState.FAILED


def test_a_slice_is_posted_under_the_registration_that_holds_all_of_it(
    pair: tuple[FakeFabric, TransferEngine, TransferEngine],
) -> None:
    """Two registrations that start at one address (a buffer's head, then the whole buffer): a slice past the
    head's end goes under the whole buffer's key, which covers it (the head's would fail on a real NIC)."""
    _fabric, a, b = pair
    source = pattern(SIZE, 5)
    a.register_memory(source[:4096])
    whole = a.register_memory(source)
    target = np.zeros(SIZE, np.uint8)
    remote = b.register_memory(target)
    peer = a.connect(b.address)
    statuses = a.wait(a.submit([request(TransferOp.WRITE, whole.region_id, peer, remote.region_id, SIZE)]), timeout=10)
    assert statuses[0].state == RequestState.DONE and statuses[0].transport == "rdma"
    assert np.array_equal(source, target)


@pytest.mark.parametrize("second", ["head-view", "same-buffer"])
def test_unregistering_one_of_two_regions_at_one_address_leaves_the_other(
    pair: tuple[FakeFabric, TransferEngine, TransferEngine], second: str
) -> None:
    """Two regions that start at one address (a buffer and a view of its head, or one buffer registered twice),
    on both sides: unregistering one deregisters its own memory region only, so the other still moves bytes over
    RDMA, as the initiator's source and as the target, at any offset; the unregistered one's rkey is revoked.
    (Registrations were keyed by start address: unregistering one took the other's lkey and memory region too,
    so its next RDMA write failed and took the queue pair down for good.)"""
    fabric, a, b = pair
    chunk = 1 << 16
    source = pattern(SIZE, 5)
    local = a.register_memory(source)
    a.unregister_memory(a.register_memory(source[:chunk] if second == "head-view" else source).region_id)
    pool = np.zeros(SIZE, np.uint8)
    whole = b.register_memory(pool)
    other = b.register_memory(pool[:chunk] if second == "head-view" else pool)
    peer = a.connect(b.address)
    b.unregister_memory(other.region_id)
    assert other.rdma_rkey not in fabric.memory and whole.rdma_rkey in fabric.memory
    for offset in (0, SIZE - chunk):
        write = request(TransferOp.WRITE, local.region_id, peer, whole.region_id, chunk, local_offset=offset)
        (status,) = a.wait(a.submit([attrs.evolve(write, remote_offset=offset)]), timeout=10)
        assert status.state is RequestState.DONE and status.transport == "rdma", status
        assert np.array_equal(pool[offset : offset + chunk], source[offset : offset + chunk])


@pytest.mark.parametrize("transport_fails_them", [True, False])
def test_closing_ends_posted_work_that_never_completed(
    pair: tuple[FakeFabric, TransferEngine, TransferEngine], monkeypatch: pytest.MonkeyPatch, transport_fails_them: bool
) -> None:
    """Work requests the NIC never completes: closing the engine ends their request FAILED (never DONE), and
    `wait` returns; also when the transport loses track of them at its close (the engine's own last sweep)."""
    fabric, a, b = pair
    if not transport_fails_them:
        monkeypatch.setattr(RdmaTransport, "_fail_all", lambda self, error: None)
    local = a.register_memory(pattern(SIZE, 6))
    remote = b.register_memory(np.zeros(SIZE, np.uint8))
    peer = a.connect(b.address)
    fabric.stall = True
    batch = a.submit([request(TransferOp.WRITE, local.region_id, peer, remote.region_id, SIZE)])
    a.close()
    (status,) = a.wait(batch, timeout=5)
    assert status.state == RequestState.FAILED and isinstance(status.error, PeerUnavailable)


def test_transfer_sync_over_rdma_waits_no_longer_than_its_deadline() -> None:
    """A work request the NIC never completes: transfer_sync(timeout=0.3) returns at its deadline, the request
    FAILED with TransferTimeout, not after the io timeout (10 s here) its inline wait used to take."""
    fabric = FakeFabric()
    config = EngineConfig(transports=("rdma", "tcp"), io_timeout_s=10.0)
    with (
        TransferEngine(secret=SECRET, config=config, rdma=FakeVerbs(fabric)) as a,
        TransferEngine(secret=SECRET, config=config, rdma=FakeVerbs(fabric)) as b,
    ):
        local = a.register_memory(np.zeros(4096, np.uint8))
        remote = b.register_memory(np.zeros(4096, np.uint8))
        peer = a.connect(b.address)
        fabric.stall = True
        start = time.monotonic()
        (status,) = a.transfer_sync(
            [request(TransferOp.WRITE, local.region_id, peer, remote.region_id, 4096)], timeout=0.3
        )
        elapsed = time.monotonic() - start
        assert status.transport == "rdma" and status.state == RequestState.FAILED, status
        assert isinstance(status.error, TransferTimeout), status.error
        assert elapsed < 0.3 + 4.0, elapsed  # a loaded machine's margin; well before the old 10 s


def test_unregistered_remote_memory_goes_over_tcp(pair: tuple[FakeFabric, TransferEngine, TransferEngine]) -> None:
    """A region registered before RDMA was available has no rkey: tcp carries it."""
    _fabric, a, _b = pair
    local = a.register_memory(pattern(4096, 7))
    plain = TransferEngine(secret=SECRET, config=EngineConfig(transports=("tcp",)))
    try:
        target = np.zeros(4096, np.uint8)
        remote = plain.register_memory(target)
        peer = a.connect(plain.address)
        assert a.transport_names(peer) == ("tcp",)
        statuses = a.wait(
            a.submit([request(TransferOp.WRITE, local.region_id, peer, remote.region_id, 4096)]), timeout=10
        )
        assert statuses[0].transport == "tcp" and statuses[0].state == RequestState.DONE
        assert np.array_equal(target, pattern(4096, 7))
    finally:
        plain.close()


def _has_rdma_device() -> bool:
    if shutil.which("ibv_devices") is None:
        return False
    listing = subprocess.run(["ibv_devices"], capture_output=True, text=True, check=False)
    return listing.returncode == 0 and len(listing.stdout.strip().splitlines()) > 2


@pytest.mark.skipif(
    not _has_rdma_device(),
    reason="no RDMA device here (ibv_devices lists none): the pyverbs path runs only on RDMA hosts",
)
def test_pyverbs_loopback_write() -> None:
    """On a host with an RDMA device: two engines move bytes through real queue pairs."""
    assert open_device() is not None
    config = EngineConfig(transports=("rdma",))
    with TransferEngine(secret=SECRET, config=config) as a, TransferEngine(secret=SECRET, config=config) as b:
        source = pattern(SIZE, 8)
        local = a.register_memory(source)
        target = np.zeros(SIZE, np.uint8)
        remote = b.register_memory(target)
        peer = a.connect(b.address)
        statuses = a.wait(
            a.submit([request(TransferOp.WRITE, local.region_id, peer, remote.region_id, SIZE)]), timeout=30
        )
        assert statuses[0].state == RequestState.DONE
        assert np.array_equal(source, target)


def test_a_flood_of_rdma_connects_cannot_use_up_the_queue_pairs(
    pair: tuple[FakeFabric, TransferEngine, TransferEngine],
) -> None:
    """An authenticated peer calling "rdma_connect" over and over holds at most max_connections
    queue pairs (the oldest are closed); a peer connecting afterwards still gets RDMA and moves bytes."""
    fabric, a, _b = pair
    config = EngineConfig(transports=("rdma", "tcp"), slice_bytes=1 << 16, io_timeout_s=2.0, max_connections=4)
    with TransferEngine(secret=SECRET, config=config, rdma=FakeVerbs(fabric)) as target_engine:
        target = np.zeros(SIZE, np.uint8)
        remote = target_engine.register_memory(target)
        flooder = a.connect(target_engine.address, transport="tcp")
        for _ in range(3 * config.max_connections):
            a.call(flooder, "rdma_connect", FakeVerbs(fabric).create_queue_pair().endpoint())
            assert target_engine.num_accepted_queue_pairs <= config.max_connections
        local = a.register_memory(pattern(SIZE, 5))
        peer = a.connect(target_engine.address)  # builds its rdma transport after the flood
        assert a.transport_names(peer) == ("rdma", "tcp")
        statuses = a.wait(
            a.submit([request(TransferOp.WRITE, local.region_id, peer, remote.region_id, SIZE)]), timeout=10
        )
        assert statuses[0].state == RequestState.DONE and statuses[0].transport == "rdma"
        assert np.array_equal(target, pattern(SIZE, 5))


def _refuse(_endpoint: object) -> object:
    raise RuntimeError("no queue pair for you")


@pytest.mark.parametrize(
    ("reply", "error", "message"),
    [
        (lambda _endpoint: {}, ProtocolError, "qp_num"),
        (lambda _endpoint: "x", ProtocolError, "'x'"),
        (lambda _endpoint: None, ProtocolError, "None"),
        (lambda _endpoint: {"qp_num": "7", "lid": 1, "gid": "fe80::1", "psn": 0}, ProtocolError, "qp_num"),
        (lambda _endpoint: {"qp_num": 7, "lid": 1, "gid": "fe80::1", "psn": 2**24}, ProtocolError, "psn"),
        (lambda _endpoint: {"qp_num": 7, "lid": True, "gid": "fe80::1", "psn": 0}, ProtocolError, "lid"),
        (lambda _endpoint: {"qp_num": 7, "lid": 1, "gid": None, "psn": 0}, ProtocolError, "gid"),
        (_refuse, TransferError, "no queue pair for you"),
    ],
    ids=["empty", "text", "null", "qp_num-text", "psn-past-24-bits", "lid-bool", "gid-null", "refused"],
)
def test_a_malformed_or_refused_rdma_connect_closes_the_new_queue_pair(
    pair: tuple[FakeFabric, TransferEngine, TransferEngine], reply: Any, error: type[TransferError], message: str
) -> None:
    """The initiator creates a queue pair, then asks the peer for its endpoint ("rdma_connect"). A reply that is
    not an endpoint (no dict; qp_num, lid and psn unsigned integers of their 24, 16 and 24 bits, gid a string) is
    a ProtocolError naming the peer, and a refusal the peer's TransferError: either way the queue pair just
    created is closed, nothing of the peer is kept, and a later connect (the peer answering again) gets RDMA.
    (A malformed reply was a bare KeyError or TypeError, and the queue pair stayed open in both cases.)"""
    fabric, a, b = pair
    b.register_handler("rdma_connect", reply)
    before = set(fabric.queue_pairs)
    with pytest.raises(error, match=message) as raised:
        a.connect(b.address)
    assert error is not ProtocolError or b.address in str(raised.value)
    assert set(fabric.queue_pairs) == before, "the queue pair created for the peer was left open"
    with pytest.raises(TransferError, match="unknown peer"):
        a.transport_names(b.address)
    b.register_handler("rdma_connect", b._peers._accept_rdma)
    assert a.transport_names(a.connect(b.address)) == ("rdma", "tcp")


@pytest.mark.parametrize("endpoint", [{}, "x", None, {"qp_num": -1, "lid": 1, "gid": "fe80::1", "psn": 0}])
def test_a_malformed_endpoint_sent_to_rdma_connect_is_refused_and_leaves_no_queue_pair(
    pair: tuple[FakeFabric, TransferEngine, TransferEngine], endpoint: object
) -> None:
    """The serving side reads the caller's endpoint by the same rule: one that is not an endpoint is a
    ProtocolError (the call is refused) and the queue pair it created for it is closed."""
    fabric, _a, b = pair
    before = set(fabric.queue_pairs)
    with pytest.raises(ProtocolError, match="endpoint"):
        b.handle_call("rdma_connect", endpoint)
    assert set(fabric.queue_pairs) == before
    assert b.num_accepted_queue_pairs == 0
