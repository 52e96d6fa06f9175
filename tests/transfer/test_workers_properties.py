"""Properties of `mooncake.transfer.workers`: `attempt`'s mapping, and `Workers` driven step by step.

`WorkersMachine` runs a real `Workers` whose worker threads wait for the test's word before each
`take`, so the machine chooses the interleaving of submit, take (by which worker), a worker that
stops serving early, and close, and checks it against a reference model: the FIFO queue of slices
submitted and not yet taken, which workers still serve, and what each slice must end with. After
every step each slice's `on_done` has fired at most once, exactly once for every slice no longer
queued, with the outcome the model says: a worker's `attempt` of it, or the queue's
`PeerUnavailable` when it met the closed queue or was left queued at the close. A close either finds
the serving workers free to drain the queue (`join_timeout_s` ample: every queued slice is served
and every thread ends) or busy past a short `join_timeout_s` (every queued slice fails).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mooncake.errors import IntegrityError, PeerUnavailable, TransferError, TransferTimeout
from mooncake.transfer.request import Slice, TransferOp
from mooncake.transfer.workers import Workers, attempt

ACTION = "test move"
CLOSED = "the test queue is closed"
WAIT_S = 10.0  # a bound on every wait for a worker; a correct run never comes near it

# What a slice's move does: return, raise a TransferError of some kind (returned as raised), or raise any other
# exception (wrapped).
behaviours = st.one_of(
    st.none(),
    st.sampled_from([TransferError, PeerUnavailable, TransferTimeout, IntegrityError]).map(lambda kind: kind("no")),
    st.sampled_from([ValueError, OSError, KeyError, RuntimeError, ZeroDivisionError]).map(lambda kind: kind("x")),
)


def expected_outcome(behaviour: Exception | None, outcome: TransferError | None) -> bool:
    """Whether `outcome` is what `attempt` must make of a move that raised `behaviour` (None: returned)."""
    if behaviour is None:
        return outcome is None
    if isinstance(behaviour, TransferError):
        return outcome is behaviour
    return type(outcome) is TransferError and str(outcome) == f"{ACTION} failed: {behaviour!r}"


def move_for(behaviour: Exception | None) -> tuple[list[Slice], Callable[[Slice], None]]:
    moved: list[Slice] = []

    def move(piece: Slice) -> None:
        moved.append(piece)
        if behaviour is not None:
            raise behaviour

    return moved, move


@settings(max_examples=100, deadline=None)
@given(behaviour=behaviours)
def test_attempt_returns_none_the_transfer_error_or_a_wrapped_one(behaviour: Exception | None) -> None:
    """`attempt` runs the move once on the slice and returns None when it returns, the very TransferError it
    raised (subclass kept), or a plain TransferError "{action} failed: {exception!r}" for anything else."""
    piece = Slice(TransferOp.READ, memoryview(b""), 0, 0, lambda _error: None)
    moved, move = move_for(behaviour)
    outcome = attempt(move, piece, action=ACTION)
    assert moved == [piece]
    assert expected_outcome(behaviour, outcome), (behaviour, outcome)


# --------------------------------------------------------------------------- the machine


@attrs.define(eq=False)
class Tracked:
    """A submitted slice, what its move does, and every outcome its `on_done` got."""

    number: int
    behaviour: Exception | None
    piece: Slice | None = None
    outcomes: list[TransferError | None] = attrs.field(factory=list)


@settings(max_examples=100, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
class WorkersMachine(RuleBasedStateMachine):
    """A real `Workers` whose threads take a slice only when told, against a FIFO model.

    Model: `queued` (FIFO of slices submitted and not taken), `serving` (worker indices whose serve
    loop still runs), `closed`, and every slice with the outcomes it got.
    """

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.slices: list[Tracked] = []
        self.queued: list[Tracked] = []
        self.numbers = itertools.count()
        self.reports: queue.Queue[tuple[int, Tracked | None]] = queue.Queue()
        self.closed = False

    @initialize(count=st.integers(1, 4), patient=st.booleans())
    def start(self, count: int, patient: bool) -> None:
        """`count` workers; a patient close waits for them, an impatient one gives up at once."""
        self.patient = patient
        self.commands: list[queue.SimpleQueue[str]] = [queue.SimpleQueue() for _ in range(count)]
        self.serving = set(range(count))
        self.name = f"workers-machine-{id(self)}"
        indices = iter(range(count))
        index_lock = threading.Lock()

        def serve(workers: Workers) -> None:
            with index_lock:
                index = next(indices)
            self.serve(index, workers)

        self.workers = Workers(
            serve, count=count, name=self.name, closed_message=CLOSED, join_timeout_s=WAIT_S if patient else 0.01
        )

    def serve(self, index: int, workers: Workers) -> None:
        """A worker: on "take" it takes one slice, on "drain" every slice until the stop marker, on "quit" it
        stops serving (as a transport whose connection failed for good)."""
        while True:
            try:
                command = self.commands[index].get(timeout=WAIT_S * 3)
            except queue.Empty:
                return  # the test is gone: do not linger
            if command == "quit":
                return
            while True:
                piece = workers.take()
                tracked = None if piece is None else self.find(piece)
                if tracked is not None:
                    assert piece is not None
                    _moved, move = move_for(tracked.behaviour)
                    piece.on_done(attempt(move, piece, action=ACTION))
                self.reports.put((index, tracked))
                if tracked is None:
                    return
                if command == "take":
                    break

    def find(self, piece: Slice) -> Tracked:
        with self.lock:
            return next(tracked for tracked in self.slices if tracked.piece is piece)

    def outcome_recorder(self, tracked: Tracked) -> Callable[[TransferError | None], None]:
        def done(error: TransferError | None) -> None:
            with self.lock:
                tracked.outcomes.append(error)

        return done

    def threads(self) -> list[threading.Thread]:
        return [thread for thread in threading.enumerate() if thread.name.startswith(f"{self.name}-")]

    # ------------------------------------------------------------------ rules

    @rule(behaviour=behaviours)
    def submit(self, behaviour: Exception | None) -> None:
        """A slice submitted: queued while open (nothing fires yet), failed at once with the queue's
        PeerUnavailable once closed (and never taken by a worker)."""
        tracked = Tracked(next(self.numbers), behaviour)
        tracked.piece = Slice(TransferOp.WRITE, memoryview(b""), 0, tracked.number, self.outcome_recorder(tracked))
        with self.lock:
            self.slices.append(tracked)
        self.workers.submit(tracked.piece)
        if self.closed:
            assert len(tracked.outcomes) == 1 and is_closed_error(tracked.outcomes[0]), tracked.outcomes
        else:
            self.queued.append(tracked)

    @precondition(lambda self: not self.closed and self.queued and self.serving)
    @rule(data=st.data())
    def take(self, data: st.DataObject) -> None:
        """A worker takes the oldest queued slice (FIFO across workers), and its on_done fires once with
        what `attempt` makes of its move."""
        index = data.draw(st.sampled_from(sorted(self.serving)), label="worker")
        self.commands[index].put("take")
        reporter, tracked = self.reports.get(timeout=WAIT_S)
        assert reporter == index
        assert tracked is self.queued[0], "a worker took a slice out of order"
        self.queued.pop(0)
        assert len(tracked.outcomes) == 1 and expected_outcome(tracked.behaviour, tracked.outcomes[0])

    @precondition(lambda self: not self.closed and self.serving)
    @rule(data=st.data())
    def quit(self, data: st.DataObject) -> None:
        """A worker's serve loop ends early; the others go on (and the close still answers its share)."""
        index = data.draw(st.sampled_from(sorted(self.serving)), label="worker")
        self.commands[index].put("quit")
        self.serving.discard(index)

    @precondition(lambda self: not self.closed)
    @rule()
    def close(self) -> None:
        """Patient: the serving workers drain the queue, each then gets its stop marker, and every thread has
        ended when close returns. Impatient (the workers busy past join_timeout_s): close fails every queued
        slice with the queue's PeerUnavailable. With no worker serving, close fails them all too."""
        draining = self.patient and bool(self.serving)
        if draining:
            for index in self.serving:
                self.commands[index].put("drain")
        self.workers.close()
        self.closed = True
        assert self.workers.is_closed
        if draining:
            stopped: set[int] = set()
            served: list[Tracked] = []
            while stopped != self.serving:
                reporter, tracked = self.reports.get(timeout=WAIT_S)
                if tracked is None:
                    assert reporter not in stopped, "a worker got two stop markers"
                    stopped.add(reporter)
                else:
                    served.append(tracked)
            assert sorted(t.number for t in served) == sorted(t.number for t in self.queued)
            assert not self.threads(), "a worker thread outlived a patient close"
            for tracked in self.queued:
                assert len(tracked.outcomes) == 1 and expected_outcome(tracked.behaviour, tracked.outcomes[0])
        else:
            for tracked in self.queued:
                assert len(tracked.outcomes) == 1 and is_closed_error(tracked.outcomes[0]), tracked.outcomes
            for index in self.serving:  # busy through the close; let them go without taking again
                self.commands[index].put("quit")
        self.queued.clear()
        self.serving.clear()

    # ------------------------------------------------------------------ invariants

    @invariant()
    def every_slice_ends_once_and_only_when_no_longer_queued(self) -> None:
        queued = {tracked.number for tracked in self.queued}
        with self.lock:
            for tracked in self.slices:
                assert len(tracked.outcomes) == (0 if tracked.number in queued else 1), (tracked, tracked.outcomes)

    @invariant()
    def is_closed_says_whether_close_was_called(self) -> None:
        if hasattr(self, "workers"):
            assert self.workers.is_closed == self.closed

    def teardown(self) -> None:
        if not hasattr(self, "workers"):
            return
        if not self.closed:
            self.close()
        for thread in self.threads():
            thread.join(timeout=WAIT_S)
        assert not self.threads(), "a worker thread outlived the machine"
        with self.lock:
            assert all(len(tracked.outcomes) == 1 for tracked in self.slices)


def is_closed_error(error: TransferError | None) -> bool:
    return isinstance(error, PeerUnavailable) and str(error) == CLOSED


TestWorkersMachine = WorkersMachine.TestCase


# --------------------------------------------------------------------------- a worker busy through the close


@pytest.mark.parametrize("count", [1, 3])
def test_a_worker_busy_through_the_close_still_stops(count: int) -> None:
    """Workers busy with a slice longer than join_timeout_s when `close` runs: the slices still queued fail
    with the queue's PeerUnavailable, and once the workers finish their slices, their next `take` is the stop
    (None), so their threads end, as every worker's does after a close."""
    release = threading.Event()
    took = threading.Semaphore(0)
    stopped = threading.Semaphore(0)

    def serve(workers: Workers) -> None:
        while (piece := workers.take()) is not None:
            took.release()
            release.wait(WAIT_S)
            piece.on_done(None)
        stopped.release()

    workers = Workers(serve, count=count, name="busy", closed_message=CLOSED, join_timeout_s=0.01)
    outcomes: list[TransferError | None] = []
    try:
        for number in range(count + 2):
            workers.submit(Slice(TransferOp.WRITE, memoryview(b""), 0, number, outcomes.append))
        assert all(took.acquire(timeout=WAIT_S) for _ in range(count))
        workers.close()
        assert [str(error) for error in outcomes] == [CLOSED, CLOSED]  # the two left queued
        release.set()
        assert all(stopped.acquire(timeout=3) for _ in range(count)), "a worker busy through the close never stopped"
        assert outcomes.count(None) == count
    finally:
        release.set()
        for _ in range(count):  # whatever the outcome, no thread of this test lingers
            workers._queue.put(None)
