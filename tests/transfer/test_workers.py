"""`mooncake.transfer.workers`: every slice submitted gets its outcome exactly once, however `close` interleaves.

A property over worker counts, slices submitted from two threads, a close at any point of the submissions and
submissions after it: each slice's `on_done` is called once, with None when a worker moved it, and with the
queue's `PeerUnavailable` when it met the closed queue or was left queued at the close.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.errors import PeerUnavailable, TransferError
from mooncake.transfer.request import Slice, TransferOp
from mooncake.transfer.workers import Workers, attempt


@settings(max_examples=40, deadline=None)
@given(
    count=st.integers(1, 4),
    sizes=st.tuples(st.integers(0, 30), st.integers(0, 30)),
    close_after=st.integers(0, 30),
    later=st.integers(0, 5),
    slow=st.booleans(),
)
def test_every_slice_gets_its_outcome_exactly_once(
    count: int, sizes: tuple[int, int], close_after: int, later: int, slow: bool
) -> None:
    outcomes: Counter[int] = Counter()
    errors: dict[int, TransferError | None] = {}
    lock = threading.Lock()

    def piece(number: int) -> Slice:
        def done(error: TransferError | None) -> None:
            with lock:
                outcomes[number] += 1
                errors[number] = error

        return Slice(TransferOp.WRITE, memoryview(b""), 0, 0, done)

    def serve(workers: Workers) -> None:
        while (taken := workers.take()) is not None:
            if slow:
                time.sleep(0.0005)
            taken.on_done(attempt(lambda _slice: None, taken, action="test"))

    workers = Workers(serve, count=count, name="test", closed_message="closed", join_timeout_s=10)
    submitted = 0

    def submitter(first: int, how_many: int) -> None:
        for number in range(first, first + how_many):
            workers.submit(piece(number))

    threads = [
        threading.Thread(target=submitter, args=(0, sizes[0])),
        threading.Thread(target=submitter, args=(1000, sizes[1])),
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while submitted < close_after and any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        submitted = len(outcomes)  # roughly where the submissions are: close somewhere among them
        time.sleep(0.0001)
    workers.close()
    for number in range(5000, 5000 + later):  # after the close: failed at once
        workers.submit(piece(number))
    for thread in threads:
        thread.join(10)
    expected = {*range(sizes[0]), *range(1000, 1000 + sizes[1]), *range(5000, 5000 + later)}
    assert set(outcomes) == expected and all(n == 1 for n in outcomes.values()), outcomes
    assert all(errors[n] is None or isinstance(errors[n], PeerUnavailable) for n in expected)
    assert all(isinstance(errors[n], PeerUnavailable) for n in range(5000, 5000 + later))


def test_slices_left_queued_by_a_worker_that_stopped_are_answered_at_the_close() -> None:
    """A worker whose loop ended early (its transport failed) leaves the queue unserved: `close` answers what is
    still queued, each with the queue's PeerUnavailable, instead of dropping it."""
    outcomes: list[TransferError | None] = []
    took_one = threading.Event()

    def serve(workers: Workers) -> None:
        taken = workers.take()
        assert taken is not None
        taken.on_done(None)
        took_one.set()  # and stops serving

    workers = Workers(serve, count=1, name="test", closed_message="closed", join_timeout_s=10)
    workers.submit(Slice(TransferOp.WRITE, memoryview(b""), 0, 0, outcomes.append))
    assert took_one.wait(10)
    for _ in range(3):
        workers.submit(Slice(TransferOp.WRITE, memoryview(b""), 0, 0, outcomes.append))
    workers.close()
    assert outcomes[0] is None and len(outcomes) == 4
    assert all(isinstance(error, PeerUnavailable) for error in outcomes[1:])


def test_close_stops_every_idle_worker_without_waiting_out_a_join() -> None:
    """Each idle worker gets its own stop marker: `close` returns well within one `join_timeout_s`, with every
    thread ended (one marker for all would leave the others to the join's timeout, then to the second round)."""
    count, join_timeout_s = 4, 10.0

    def serve(workers: Workers) -> None:
        while workers.take() is not None:
            pass

    workers = Workers(serve, count=count, name="idle-close", closed_message="closed", join_timeout_s=join_timeout_s)
    started = time.monotonic()
    workers.close()
    elapsed = time.monotonic() - started
    lingering = [thread.name for thread in threading.enumerate() if thread.name.startswith("idle-close-")]
    assert lingering == [] and elapsed < join_timeout_s / 2, (lingering, elapsed)
