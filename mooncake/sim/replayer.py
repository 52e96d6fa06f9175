"""What every simulated cluster shares: arrivals streamed into an event loop, records, load samples.

A cluster derives from `Replayer`, calls `_start_replay` in its constructor and
implements `_arrive(now, request)`, which begins with `_record_arrival`; `run`
replays a request stream to the end and summarizes it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from mooncake.sim.clock import EventLoop
from mooncake.sim.metrics import LoadTrace, RecordTable, ReplayResult, RequestRecord, summarize
from mooncake.types import Request, Slo

__all__ = ["Replayer"]


def _arrival_s(request: Request) -> float:
    return request.arrival_s


class Replayer:
    """The replay driver of a simulated cluster (see the module docstring)."""

    slo: Slo

    def _start_replay(self, sample_interval_s: float, counts: Callable[[], tuple[int, int]]) -> None:
        self.loop = EventLoop()
        self._records = RecordTable()
        self._load = LoadTrace(sample_interval_s, counts)
        self._arrived = 0
        self._progress: Callable[[int], None] | None = None

    def run(
        self,
        requests: Iterable[Request],
        *,
        progress: Callable[[int], None] | None = None,
        keep_intervals: bool = True,
    ) -> ReplayResult:
        """Replay `requests` (in arrival order; streamed) to the end and summarize.

        Args:
            progress: told the count of requests arrived so far, at each arrival.
            keep_intervals: keep every record's token intervals (False frees them once
                its TBT is known: large replays).
        """
        started = time.perf_counter()
        self._progress = progress
        self._records.keep_intervals = keep_intervals
        self.loop.feed(requests, _arrival_s, self._arrive)
        self.loop.run(self._load)
        return ReplayResult(
            summary=summarize(self._records, self.slo, sim_wall_s=time.perf_counter() - started),
            records=self._records,
            load=tuple(self._load.samples),
        )

    def _arrive(self, now: float, request: Request) -> None:
        raise NotImplementedError

    def _record_arrival(self, now: float, request: Request) -> RequestRecord:
        """Count the arrival, tell the progress callback, and open the request's record."""
        self._arrived += 1
        if self._progress is not None:
            self._progress(self._arrived)
        record = RequestRecord(request.request_id, now, request.input_length, request.output_length)
        self._records.add(record)
        return record
