"""A discrete-event loop on a virtual clock.

Events are (time, sequence, handler, arguments) in a heap; the sequence number
breaks ties in the order events were scheduled, so a run is deterministic.
Handlers schedule further events. The clock never goes backwards: scheduling
an event in the past is a bug and raises.

A stream of arrivals (`feed`) is merged in lazily, one item at a time, so a
replay of a million requests never holds them all; an arrival is handled
before any other event at the same time.

While `run` runs, the garbage collector does young collections only. A long
replay holds millions of long-lived objects (cached blocks' metadata, the
workload generator's state) and its handlers make no reference cycles, so a
full collection walks all of them to free nothing: at a million requests that
was a fifth of the run. A cycle dropped while young is still collected; an
older one waits for the first full collection after `run` (the thresholds are
restored when it returns).
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from mooncake._checks import shown
from mooncake.errors import InvalidRequestError

__all__ = ["EventLoop"]

_END = object()  # the stream's end: any item, None included, is an item (`time_of` judges it)


class EventLoop:
    """Runs handlers in time order; `now` is the time of the event being handled."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._sequence = itertools.count()
        self._stream: Iterator[Any] | None = None
        self._time_of: Callable[[Any], float] = float
        self._on_item: Callable[..., None] | None = None
        self.now = 0.0

    def at(self, time_s: float, handler: Callable[..., None], *args: Any) -> None:
        """Call `handler(time_s, *args)` when the clock reaches `time_s`."""
        if not time_s >= self.now:  # NaN too
            raise ValueError(f"event at {time_s} scheduled after the clock reached {self.now}")
        heapq.heappush(self._heap, (time_s, next(self._sequence), handler, args))

    def feed(self, items: Iterable[Any], time_of: Callable[[Any], float], handler: Callable[..., None]) -> None:
        """Call `handler(time_of(item), item)` for each item, in order; items must not go back in time."""
        self._stream = iter(items)
        self._time_of = time_of
        self._on_item = handler

    def __len__(self) -> int:
        return len(self._heap)

    def run(self, before_each: Callable[[float], None] | None = None) -> None:
        """Handle events until none are left; `before_each(time)` runs before each one.

        Raises:
            InvalidRequestError: a fed item's time is earlier than the previous one's.
        """
        with _young_collections_only():
            self._run(before_each)

    def _run(self, before_each: Callable[[float], None] | None) -> None:
        heap = self._heap
        pop = heapq.heappop
        stream, time_of, on_item = self._stream, self._time_of, self._on_item
        item = next(stream, _END) if stream is not None else _END
        item_s = time_of(item) if item is not _END else 0.0
        while heap or item is not _END:
            if item is not _END and (not heap or item_s <= heap[0][0]):
                if item_s < self.now:
                    raise InvalidRequestError(f"arrivals out of order: {shown(item)} at {item_s} after {self.now}")
                self.now = now = item_s
                if before_each is not None:
                    before_each(now)
                assert on_item is not None and stream is not None
                on_item(now, item)
                item = next(stream, _END)
                item_s = time_of(item) if item is not _END else 0.0
                continue
            now, _, handler, args = pop(heap)
            self.now = now
            if before_each is not None:
                before_each(now)
            handler(now, *args)


@contextlib.contextmanager
def _young_collections_only() -> Iterator[None]:
    """No full (oldest-generation) garbage collection inside the block; the thresholds are restored after."""
    young, middle, old = gc.get_threshold()
    gc.set_threshold(young, middle, 1 << 30)
    try:
        yield
    finally:
        gc.set_threshold(young, middle, old)
