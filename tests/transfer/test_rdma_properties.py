"""Properties of `mooncake.transfer.rdma.RdmaTransport` over the in-memory fabric (tests/transfer/fake_verbs.py).

`RdmaMachine` drives one transport on a connected pair of fake queue pairs against a reference
model: bytearrays of the local buffer and the peer's regions, whether the queue pair is down or the
transport closed, which slices are still outstanding (posted while the fabric stalls), and how many
work requests must have been posted. Checked after every step: the memory equals the model; the
fabric saw exactly the posts the model expects (a slice whose range is outside the peer's
descriptor, in a region the peer does not offer over RDMA, or from unregistered local memory is
refused before posting, even where the NIC would have allowed it); every slice's `on_done` fired at
most once, and exactly once unless it is outstanding. An injected failed completion fails it and
every outstanding slice with `PeerUnavailable`, and every later slice at once; `close` fails what
is outstanding; at teardown every slice has ended exactly once.

Two more: a slice whose completion never comes ends once with `TransferTimeout` and a completion
arriving after that is ignored; and a zero-length request over RDMA (an engine-level check).

The send queue's depth: over a fabric whose queue pairs hold a few work requests (the fake refuses
one past `max_send_wr` with ENOMEM, as a device does), any number of slices all move, in submission
order, with never more than the depth outstanding; slices waiting for a slot end as posted ones do
when the transport closes or the queue pair fails, and with `TransferTimeout` when no slot frees.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mooncake.errors import PeerUnavailable, TransferError, TransferTimeout
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.rdma import MAX_SEND_WR, RdmaTransport, buffer_address
from mooncake.transfer.region import RegionDescriptor
from mooncake.transfer.request import EngineConfig, RequestState, Slice, TransferOp
from tests.transfer.conftest import SECRET, request
from tests.transfer.fake_verbs import FakeFabric, FakeQueuePair, FakeVerbs
from tests.waiting import wait_for

LOCAL = 4096
# region id -> (bytes registered with the fabric, length the peer's descriptor gives, registered for RDMA)
REGIONS = {1: (4096, 4096, True), 2: (2048, 1024, True), 3: (512, 512, False)}
UNKNOWN_REGION = 99
PATIENT = EngineConfig(io_timeout_s=600.0)  # no work request expires during a machine run


class RecordingQueuePair(FakeQueuePair):
    """A fake queue pair that remembers the work request ids posted on it, and can refuse the next post
    (a full send queue)."""

    def __init__(self, fabric: FakeFabric) -> None:
        super().__init__(fabric)
        self.wr_ids: list[int] = []
        self.refuse_next = False

    def post(
        self, wr_id: int, op: TransferOp, address: int, length: int, lkey: int, remote_address: int, rkey: int
    ) -> None:
        if self.refuse_next:
            self.refuse_next = False
            raise OSError("the send queue is full")
        self.wr_ids.append(wr_id)
        super().post(wr_id, op, address, length, lkey, remote_address, rkey)


@attrs.define(eq=False)
class Rig:
    """A transport on one end of a connected pair, the memory at both ends, and the fabric."""

    fabric: FakeFabric
    queue_pair: RecordingQueuePair
    transport: RdmaTransport
    local: np.ndarray
    remote: dict[int, np.ndarray]
    stray: np.ndarray  # local memory never registered

    def close(self) -> None:
        self.transport.close()


def make_rig(config: EngineConfig, *, max_send_wr: int = MAX_SEND_WR) -> Rig:
    fabric = FakeFabric(max_send_wr=max_send_wr)
    verbs = FakeVerbs(fabric)
    local = np.zeros(LOCAL, np.uint8)
    _address, lkey, _rkey = verbs.register(local.data)
    start = buffer_address(local.data)

    def local_key(view: memoryview) -> tuple[int, int]:
        address = buffer_address(view)
        if not (start <= address and address + view.nbytes <= start + LOCAL):
            raise TransferError("the local bytes are not in RDMA-registered memory")
        return address, lkey

    remote: dict[int, np.ndarray] = {}
    descriptors: dict[int, RegionDescriptor] = {}
    for region, (size, described, registered) in REGIONS.items():
        remote[region] = np.zeros(size, np.uint8)
        address = rkey = None
        if registered:
            address, _lkey, rkey = verbs.register(remote[region].data)
        descriptors[region] = RegionDescriptor(region_id=region, length=described, rdma_address=address, rdma_rkey=rkey)
    ours, theirs = RecordingQueuePair(fabric), RecordingQueuePair(fabric)
    ours.connect(theirs.endpoint())
    theirs.connect(ours.endpoint())
    transport = RdmaTransport(ours, local_key=local_key, describe=descriptors.get, config=config)
    return Rig(fabric, ours, transport, local, remote, np.zeros(64, np.uint8))


def is_reachable(region: int, offset: int, length: int) -> bool:
    """Whether the peer's descriptor offers [offset, offset + length) of `region` over RDMA."""
    if region not in REGIONS:
        return False
    _size, described, registered = REGIONS[region]
    return registered and offset + length <= described


@attrs.define(eq=False)
class Tracked:
    """A submitted slice and every outcome its `on_done` was called with."""

    outcomes: list[TransferError | None] = attrs.field(factory=list)
    lock: threading.Lock = attrs.field(factory=threading.Lock)

    def done(self, error: TransferError | None) -> None:
        with self.lock:
            self.outcomes.append(error)

    @property
    def count(self) -> int:
        with self.lock:
            return len(self.outcomes)


def ended(tracked: Tracked, *, what: str) -> TransferError | None:
    """The one outcome of `tracked`, waiting for it."""
    wait_for(lambda: tracked.count >= 1, timeout=10, what=what)
    return tracked.outcomes[0]


@st.composite
def ranges(draw: st.DrawFn) -> tuple[int, int, int]:
    """(region, offset, length), length at least 1 (zero-length slices: see the last test of this module):
    inside what the peer's descriptor offers, including its last byte, or not (past its end, past the
    descriptor but inside the registration, a region without RDMA, a region the peer does not have)."""
    region = draw(st.sampled_from([*REGIONS, UNKNOWN_REGION]))
    size, described, _registered = REGIONS.get(region, (64, 64, False))
    if draw(st.booleans()):
        length = draw(st.integers(1, described))
        offset = draw(st.integers(0, described - length) | st.just(described - length))
    else:
        length = draw(st.integers(1, 600))
        offset = draw(st.integers(max(0, described - length + 1), size + 16))
    return region, offset, length


def reachable_ranges() -> st.SearchStrategy[tuple[int, int, int]]:
    return ranges().filter(lambda r: is_reachable(*r))


@settings(max_examples=100, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
class RdmaMachine(RuleBasedStateMachine):
    """One `RdmaTransport` over the fake fabric against a model of the memory at both ends.

    Model: `local` and `remote` bytearrays; `down` (a failed completion took the queue pair down),
    `closed`; `outstanding`, the slices posted while the fabric stalled (never completed); `posts`,
    the work requests the fabric must have seen; every slice submitted, with what it must end with
    (None: it must not have ended yet).
    """

    def __init__(self) -> None:
        super().__init__()
        self.rig = make_rig(PATIENT)
        rng = np.random.default_rng(7)
        self.rig.local[:] = rng.integers(0, 256, LOCAL, dtype=np.uint8)
        for array in self.rig.remote.values():
            array[:] = rng.integers(0, 256, array.size, dtype=np.uint8)
        self.local = bytearray(self.rig.local.tobytes())
        self.remote = {region: bytearray(array.tobytes()) for region, array in self.rig.remote.items()}
        self.down = False
        self.closed = False
        self.outstanding: list[Tracked] = []
        self.posts = 0
        self.slices: list[Tracked] = []

    def submit(self, piece: Callable[[Callable[[TransferError | None], None]], Slice]) -> Tracked:
        tracked = Tracked()
        self.slices.append(tracked)
        self.rig.transport.submit(piece(tracked.done))
        return tracked

    @rule(op=st.sampled_from(TransferOp), span=ranges(), data=st.data(), inline=st.booleans())
    def move(self, op: TransferOp, span: tuple[int, int, int], data: st.DataObject, inline: bool) -> None:
        """A slice of local memory to or from a peer's region: moves its bytes when the descriptor offers the
        range, is refused before posting when it does not, fails with PeerUnavailable once down or closed;
        while the NIC stalls, a posted slice stays outstanding."""
        region, remote_offset, length = span
        local_offset = data.draw(st.integers(0, LOCAL - length), label="local offset")
        view = self.rig.local.data[local_offset : local_offset + length]
        reachable = is_reachable(region, remote_offset, length)
        stalls = self.rig.fabric.stall and reachable and not (self.down or self.closed)
        if inline and not self.rig.fabric.stall:  # an inline slice never completed would wait 2 io timeouts
            outcome = self.rig.transport.run_inline(Slice(op, view, region, remote_offset, lambda _error: None))
            tracked = Tracked()
            tracked.done(outcome)
            self.slices.append(tracked)
        else:
            tracked = self.submit(lambda done: Slice(op, view, region, remote_offset, done))
        if self.down or self.closed:
            assert isinstance(ended(tracked, what="a slice on a down transport"), PeerUnavailable)
            return
        if not reachable:
            outcome = ended(tracked, what="a refused slice")
            assert isinstance(outcome, TransferError) and not isinstance(outcome, PeerUnavailable), outcome
            return
        self.posts += 1
        if stalls:
            self.outstanding.append(tracked)
            return
        assert ended(tracked, what="a slice to complete") is None
        remote = self.remote[region]
        if op == TransferOp.WRITE:
            remote[remote_offset : remote_offset + length] = self.local[local_offset : local_offset + length]
        else:
            self.local[local_offset : local_offset + length] = remote[remote_offset : remote_offset + length]

    @rule(length=st.integers(1, 64))
    def move_from_unregistered_memory(self, length: int) -> None:
        """Local bytes outside every registration are refused before posting (PeerUnavailable once down)."""
        tracked = self.submit(lambda done: Slice(TransferOp.WRITE, self.rig.stray.data[:length], 1, 0, done))
        outcome = ended(tracked, what="a slice from unregistered memory")
        if self.down or self.closed:
            assert isinstance(outcome, PeerUnavailable)
        else:
            assert isinstance(outcome, TransferError) and not isinstance(outcome, PeerUnavailable), outcome

    @precondition(lambda self: not (self.down or self.closed))
    @rule(op=st.sampled_from(TransferOp), span=reachable_ranges())
    def post_refused(self, op: TransferOp, span: tuple[int, int, int]) -> None:
        """The device refuses a post: the slice ends at once with a TransferError (no PeerUnavailable: the
        queue pair is still up), and it is not left behind to be failed again later."""
        region, remote_offset, length = span
        self.rig.queue_pair.refuse_next = True
        tracked = self.submit(lambda done: Slice(op, self.rig.local.data[:length], region, remote_offset, done))
        outcome = ended(tracked, what="a refused post")
        assert isinstance(outcome, TransferError) and not isinstance(outcome, PeerUnavailable), outcome

    @rule(stall=st.booleans())
    def set_stall(self, stall: bool) -> None:
        """The NIC stops (or resumes) completing work requests; those it swallowed stay outstanding."""
        self.rig.fabric.stall = stall

    @precondition(lambda self: not (self.down or self.closed))
    @rule(op=st.sampled_from(TransferOp), span=reachable_ranges())
    def swallowed_move(self, op: TransferOp, span: tuple[int, int, int]) -> None:
        """A slice the stalled NIC accepts and never completes: posted, outstanding, not ended, no byte moved."""
        region, remote_offset, length = span
        self.rig.fabric.stall = True
        tracked = self.submit(lambda done: Slice(op, self.rig.local.data[:length], region, remote_offset, done))
        self.posts += 1
        self.outstanding.append(tracked)

    @precondition(lambda self: not (self.down or self.closed) and (self.outstanding or len(self.slices) >= 8))
    @rule(length=st.integers(1, 512))
    def fail_a_completion(self, length: int) -> None:
        """A failed completion: that slice and every outstanding one end with PeerUnavailable, and the queue
        pair is down for good; no byte of the failed slice moves."""
        self.rig.fabric.stall = False
        self.rig.fabric.fail_next = 1
        tracked = self.submit(lambda done: Slice(TransferOp.WRITE, self.rig.local.data[:length], 1, 0, done))
        self.posts += 1
        assert isinstance(ended(tracked, what="the failed completion"), PeerUnavailable)
        for pending in self.outstanding:
            assert isinstance(ended(pending, what="an outstanding slice to fail"), PeerUnavailable)
        self.outstanding.clear()
        self.down = True

    @precondition(lambda self: not self.closed and (self.outstanding or len(self.slices) >= 8))
    @rule()
    def close(self) -> None:
        """Closing fails every outstanding slice with PeerUnavailable."""
        self.rig.transport.close()
        for pending in self.outstanding:
            assert isinstance(ended(pending, what="an outstanding slice to fail at close"), PeerUnavailable)
        self.outstanding.clear()
        self.closed = True

    @invariant()
    def memory_matches_the_model(self) -> None:
        assert self.rig.local.tobytes() == bytes(self.local)
        for region, array in self.rig.remote.items():
            assert array.tobytes() == bytes(self.remote[region]), f"region {region}"

    @invariant()
    def only_reachable_slices_were_posted(self) -> None:
        assert self.rig.fabric.posted == self.posts

    @invariant()
    def the_transport_keeps_its_invariants(self) -> None:
        self.rig.transport.check_invariants()

    @invariant()
    def every_slice_ends_at_most_once(self) -> None:
        outstanding = {id(tracked) for tracked in self.outstanding}
        for tracked in self.slices:
            assert tracked.count == (0 if id(tracked) in outstanding else 1), tracked.outcomes

    def teardown(self) -> None:
        if not self.closed:
            self.rig.transport.close()
        for tracked in self.slices:
            assert tracked.count == 1, tracked.outcomes


TestRdmaMachine = RdmaMachine.TestCase


# --------------------------------------------------------------------------- expiry


@pytest.fixture
def quick_rig() -> Iterator[Rig]:
    rig = make_rig(EngineConfig(io_timeout_s=0.2))
    try:
        yield rig
    finally:
        rig.close()


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_slices=st.integers(1, 4), op=st.sampled_from(TransferOp))
def test_a_late_completion_never_ends_an_expired_slice_twice(quick_rig: Rig, num_slices: int, op: TransferOp) -> None:
    """Work requests the NIC swallows end once each with TransferTimeout after io_timeout_s; when their
    completions then arrive after all, nothing fires again, and the transport goes on moving bytes."""
    rig = quick_rig
    rig.fabric.stall = True
    first = len(rig.queue_pair.wr_ids)
    stalled = [Tracked() for _ in range(num_slices)]
    for tracked in stalled:
        rig.transport.submit(Slice(op, rig.local.data[:16], 1, 0, tracked.done))
    for tracked in stalled:
        assert isinstance(ended(tracked, what="a swallowed work request to expire"), TransferTimeout)
    rig.fabric.stall = False
    with rig.queue_pair.lock:  # the NIC completes them after all
        rig.queue_pair.completions += [(wr_id, None) for wr_id in rig.queue_pair.wr_ids[first:]]
    rig.local[:16] = 42
    fresh = Tracked()  # its completion follows the late ones: once it is polled, so were they
    rig.transport.submit(Slice(TransferOp.WRITE, rig.local.data[:16], 1, 100, fresh.done))
    assert ended(fresh, what="a slice after the late completions") is None
    assert bytes(rig.remote[1][100:116]) == bytes([42] * 16)
    assert all(tracked.count == 1 for tracked in stalled), [t.outcomes for t in stalled]


# --------------------------------------------------------------------------- zero-length requests


@pytest.mark.parametrize("op", list(TransferOp))
def test_a_zero_length_request_in_bounds_is_done_over_rdma(op: TransferOp) -> None:
    """An in-bounds request of zero bytes is DONE whichever transport carries it: over tcp the peer checks
    its range and acknowledges; over rdma the descriptor's bounds are checked and nothing needs moving."""
    fabric = FakeFabric()
    config = EngineConfig(transports=("rdma", "tcp"), io_timeout_s=5.0)
    with (
        TransferEngine(secret=SECRET, config=config, rdma=FakeVerbs(fabric)) as a,
        TransferEngine(secret=SECRET, config=config, rdma=FakeVerbs(fabric)) as b,
    ):
        local = a.register_memory(np.zeros(4096, np.uint8))
        remote = b.register_memory(np.zeros(4096, np.uint8))
        peer = a.connect(b.address)
        assert a.transport_names(peer)[0] == "rdma"
        (status,) = a.wait(a.submit([request(op, local.region_id, peer, remote.region_id, 0, remote_offset=10)]), 10)
        assert status.state == RequestState.DONE, status


# --------------------------------------------------------------------------- the send queue's depth


# Up to 40 moves each drawn through `reachable_ranges`' filter: a list now and then has Hypothesis discard more
# draws than its health check allows (seen once in CI), though every example it keeps is a valid one.
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(
    depth=st.integers(1, 6),
    moves=st.lists(st.tuples(st.sampled_from(TransferOp), reachable_ranges(), st.integers(0, LOCAL)), max_size=40),
)
def test_slices_past_the_send_queue_depth_wait_for_a_slot_and_all_move(
    depth: int, moves: list[tuple[TransferOp, tuple[int, int, int], int]]
) -> None:
    """More slices than the send queue holds, submitted at once: every one is posted (none refused with ENOMEM),
    in submission order (the bytes equal a model applying them one after another), each ends once with success,
    and the queue pair never held more than its depth."""
    rig = make_rig(PATIENT, max_send_wr=depth)
    try:
        rng = np.random.default_rng(depth)
        rig.local[:] = rng.integers(0, 256, LOCAL, dtype=np.uint8)
        local = bytearray(rig.local.tobytes())
        remote = {region: bytearray(array.tobytes()) for region, array in rig.remote.items()}
        slices = [Tracked() for _ in moves]
        for tracked, (op, (region, remote_offset, length), start) in zip(slices, moves, strict=True):
            local_offset = min(start, LOCAL - length)
            view = rig.local.data[local_offset : local_offset + length]
            rig.transport.submit(Slice(op, view, region, remote_offset, tracked.done))
            target = remote[region]
            if op == TransferOp.WRITE:
                target[remote_offset : remote_offset + length] = local[local_offset : local_offset + length]
            else:
                local[local_offset : local_offset + length] = target[remote_offset : remote_offset + length]
            rig.transport.check_invariants()
        for tracked in slices:
            assert ended(tracked, what="a slice past the send queue's depth") is None
        assert rig.fabric.posted == len(moves)
        assert rig.fabric.peak_outstanding <= depth
        assert rig.local.tobytes() == bytes(local)
        for region, array in rig.remote.items():
            assert array.tobytes() == bytes(remote[region]), f"region {region}"
        assert all(tracked.count == 1 for tracked in slices)
    finally:
        rig.close()


def stall_past_the_depth(rig: Rig, depth: int, waiting: int) -> list[Tracked]:
    """With the NIC stalled, `depth` slices fill the send queue (posted, never completed) and `waiting` more
    wait for a slot: none has ended, and only the first `depth` were posted."""
    rig.fabric.stall = True
    slices = [Tracked() for _ in range(depth + waiting)]
    for tracked in slices:
        rig.transport.submit(Slice(TransferOp.WRITE, rig.local.data[:16], 1, 0, tracked.done))
    rig.transport.check_invariants()
    assert rig.fabric.posted == depth
    assert [tracked.count for tracked in slices] == [0] * len(slices), [t.outcomes for t in slices]
    return slices


@pytest.mark.parametrize("how", ["close", "failed completion"])
def test_slices_waiting_for_a_slot_end_as_posted_ones_do(how: str) -> None:
    """Slices waiting for a send-queue slot end, each once, with the posted ones' PeerUnavailable when the
    transport closes or a failed completion takes the queue pair down; none of them is posted after that."""
    depth, waiting = 3, 5
    rig = make_rig(PATIENT, max_send_wr=depth)
    try:
        slices = stall_past_the_depth(rig, depth, waiting)
        if how == "close":
            rig.transport.close()
        else:
            with rig.queue_pair.lock:  # the NIC fails the first work request: the RC queue pair is in error
                rig.queue_pair.completions.append((rig.queue_pair.wr_ids[0], "injected failure"))
        for tracked in slices:
            assert isinstance(ended(tracked, what=f"a slice to fail at {how}"), PeerUnavailable)
        assert rig.fabric.posted == depth
        assert all(tracked.count == 1 for tracked in slices), [t.outcomes for t in slices]
    finally:
        rig.close()
    assert all(tracked.count == 1 for tracked in slices), [t.outcomes for t in slices]


def test_slices_waiting_behind_a_stalled_nic_time_out_then_the_queue_moves_again() -> None:
    """The send queue full of work requests the NIC swallowed: they end with TransferTimeout at the io timeout,
    and so do the slices waiting behind them (no slot freed for as long), each once; the expired work requests
    hold their slots until their completions come, then slices are posted again and move bytes."""
    rig = make_rig(EngineConfig(io_timeout_s=0.5), max_send_wr=2)
    try:
        slices = stall_past_the_depth(rig, 2, 3)
        for tracked in slices:
            assert isinstance(ended(tracked, what="a stalled or waiting slice to expire"), TransferTimeout)
        assert rig.queue_pair.outstanding == 2  # every slot is still held by a swallowed work request
        rig.transport.check_invariants()
        rig.fabric.stall = False
        with rig.queue_pair.lock:  # the NIC completes the swallowed ones after all
            rig.queue_pair.completions += [(wr_id, None) for wr_id in rig.queue_pair.wr_ids[:2]]
        wait_for(lambda: rig.queue_pair.outstanding == 0, timeout=10, what="the late completions to be polled")
        rig.local[:16] = 42
        late = Tracked()
        rig.transport.submit(Slice(TransferOp.WRITE, rig.local.data[:16], 1, 0, late.done))
        assert ended(late, what="a slice posted once slots freed") is None
        assert rig.fabric.posted == 3
        assert bytes(rig.remote[1][:16]) == bytes([42] * 16)
        assert all(tracked.count == 1 for tracked in [*slices, late]), [t.outcomes for t in slices]
    finally:
        rig.close()
