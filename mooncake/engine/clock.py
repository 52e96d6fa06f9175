"""A discrete-event loop on a virtual clock.

Events are (time, sequence, handler, arguments) in a heap; the sequence number
breaks ties in the order events were scheduled, so a run is deterministic.
Handlers schedule further events. The clock never goes backwards: scheduling
an event in the past is a bug and raises.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

__all__ = ["EventLoop"]


class EventLoop:
    """Runs handlers in time order; `now` is the time of the event being handled."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._sequence = itertools.count()
        self.now = 0.0

    def at(self, time_s: float, handler: Callable[..., None], *args: Any) -> None:
        """Call `handler(time_s, *args)` when the clock reaches `time_s`."""
        if time_s < self.now:
            raise ValueError(f"event at {time_s} scheduled after the clock reached {self.now}")
        heapq.heappush(self._heap, (time_s, next(self._sequence), handler, args))

    def __len__(self) -> int:
        return len(self._heap)

    def run(self, before_each: Callable[[float], None] | None = None) -> None:
        """Handle events until none are left; `before_each(time)` runs before each one."""
        heap = self._heap
        pop = heapq.heappop
        while heap:
            now, _, handler, args = pop(heap)
            self.now = now
            if before_each is not None:
                before_each(now)
            handler(now, *args)
