"""How transports run slices: a queue served by worker threads, and one slice's outcome.

`Workers` is the hand-off between `Transport.submit` and a transport's threads:
slices wait in one queue, and each of `count` threads runs the transport's
`serve` loop, taking slices with `take` until it gets None (the stop marker).
`close` stops taking slices, puts one stop marker per thread, waits for the
threads, then fails whatever is still queued with `PeerUnavailable` and gives
each thread still busy (past the wait) its stop marker again.

`attempt` runs one move of a slice and turns its exceptions into the slice's
outcome: a `TransferError` as raised, anything else wrapped in one, so that a
worker never dies with a slice unanswered.

Invariants:
- Every submitted slice has its `on_done` called exactly once: by a worker, at
  `submit` when the queue is closed, or by `close` when it was left queued.
- No slice enters the queue after `close` has drained it (both hold one lock).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from mooncake.errors import PeerUnavailable, TransferError
from mooncake.transfer.request import Slice

__all__ = ["Workers", "attempt"]


def attempt(move: Callable[[Slice], None], piece: Slice, *, action: str) -> TransferError | None:
    """Run `move(piece)` and return its outcome.

    Returns:
        None when it returned; the `TransferError` it raised; any other exception
        wrapped as `TransferError("{action} failed: ...")`.
    """
    try:
        move(piece)
    except TransferError as error:
        return error
    except Exception as unexpected:
        return TransferError(f"{action} failed: {unexpected!r}")
    return None


class Workers:
    """A queue of slices served by `count` threads, each running `serve(self)`.

    Args:
        serve: the body of every worker thread; it takes slices with `take` and
            returns when `take` gives None.
        count: worker threads.
        name: their name prefix (each gets "-{index}").
        closed_message: the message of the `PeerUnavailable` a slice ends with
            when the queue is closed.
        join_timeout_s: how long `close` waits for each thread.
    """

    def __init__(
        self,
        serve: Callable[[Workers], None],
        *,
        count: int,
        name: str,
        closed_message: str,
        join_timeout_s: float,
    ) -> None:
        self._queue: queue.SimpleQueue[Slice | None] = queue.SimpleQueue()
        self._closed = False
        self._state_lock = threading.Lock()
        self._closed_message = closed_message
        self._join_timeout_s = join_timeout_s
        self._threads = [
            threading.Thread(target=serve, args=(self,), name=f"{name}-{i}", daemon=True) for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def is_closed(self) -> bool:
        return self._closed

    def closed_error(self) -> PeerUnavailable:
        """The error of a slice that meets a closed queue."""
        return PeerUnavailable(self._closed_message)

    def submit(self, piece: Slice) -> None:
        """Queue `piece` for a worker; once closed, fail it at once."""
        with self._state_lock:  # so that no slice slips in after close drained the queue
            if not self._closed:
                self._queue.put(piece)
                return
        piece.on_done(self.closed_error())

    def take(self) -> Slice | None:
        """The next slice, waiting for one; None tells the calling worker to stop."""
        return self._queue.get()

    def close(self) -> None:
        """Stop the workers and fail the slices still queued."""
        with self._state_lock:
            self._closed = True
            for _ in self._threads:
                self._queue.put(None)
        for thread in self._threads:
            thread.join(timeout=self._join_timeout_s)
        while True:  # slices queued behind the stop markers are answered, not dropped
            try:
                piece = self._queue.get_nowait()
            except queue.Empty:
                break
            if piece is not None:
                piece.on_done(self.closed_error())
        for thread in self._threads:  # the drain took its stop marker: a worker busy past the join still gets one
            if thread.is_alive():
                self._queue.put(None)
