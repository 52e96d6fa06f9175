"""What every simulated cluster runs in: an event loop, the requests' records, load samples.

A cluster holds a `ReplayContext` (made for it, or handed to it) and is
driven by it: `run` streams the requests into the event loop, calling the
cluster's `arrive(now, request)` at each arrival and sampling the cluster's
`counts()` (requests in prefill, in decode) every `sample_interval_s`, until
no event is left; then it summarizes. The cluster schedules its own events on
`loop`, opens a record at each arrival (`open`) and ends each record exactly
once: `complete` when its last token is out, `reject` when it is refused (both
stamp `finish_s`, the time its client had its answer).

Invariants: every record opened is in `records`; a record is sealed (ended)
exactly once, by `complete` or `reject`. A context runs one workload: its clock,
records and its cluster's state (caches, scheduler) would carry into a second,
so a second `run` is refused, and a result's `records` stay as they were.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from mooncake._checks import require_bool, require_iterable, require_number, shown
from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.sched.outcome import Outcome, Reason
from mooncake.sim.clock import EventLoop
from mooncake.sim.metrics import (
    LoadTrace,
    RecordTable,
    ReplayResult,
    RequestRecord,
    summarize,
    top_mean,
)
from mooncake.types import Request, Slo, require_slo
from mooncake.workload.trace_record import arrival_problem

__all__ = ["Progress", "ReplayContext"]

Progress = Callable[[int], None]  # told the count of requests arrived so far


def _arrival_s(request: Request) -> float:
    if not isinstance(request, Request):
        raise InvalidRequestError(f"a replay takes mooncake.types.Request items, got {type(request).__name__}")
    if (problem := arrival_problem(request.arrival_s)) is not None:  # later, a clock step could be lost
        raise InvalidRequestError(f"request {request.request_id} arrives at {request.arrival_s:.6g} s, {problem}")
    return request.arrival_s


class ReplayContext:
    """The event loop, records and load samples of one replay (see the module docstring).

    Args:
        slo: what the summary measures attainment against.
        sample_interval_s: how often load over time is sampled.

    Raises:
        ConfigError: an `slo` that is no `Slo`, or a `sample_interval_s` that is no time > 0.
    """

    def __init__(self, slo: Slo, *, sample_interval_s: float) -> None:
        self.slo = require_slo(slo)  # else only the summary, after the whole replay, finds it out
        # Checked here: a replay with an interval that is no time > 0 hung sampling, or divided by zero.
        self.sample_interval_s = require_number("sample_interval_s", sample_interval_s, minimum=0, strict=True)
        self.loop = EventLoop()
        self.records = RecordTable()
        self._arrived = 0
        self._progress: Progress | None = None
        self._has_run = False

    def run(
        self,
        requests: Iterable[Request],
        arrive: Callable[[float, Request], None],
        counts: Callable[[], tuple[int, int]],
        *,
        progress: Progress | None = None,
        keep_intervals: bool = True,
    ) -> ReplayResult:
        """Replay `requests` (in arrival order; streamed) to the end and summarize.

        Raises:
            InvalidRequestError: this context (its cluster) has replayed a workload already, `requests` that are
                no iterable, an item that is not a `Request`, one arriving past `MAX_ARRIVAL_S` (2**43 ms), or no
                request at all.
            ConfigError: a `keep_intervals` that is not True or False, or a `progress` that is neither callable
                nor None.

        Args:
            arrive: the cluster's arrival handler, called at each request's arrival time.
            counts: the cluster's requests in prefill and in decode, sampled for the load trace.
            progress: told the count of requests arrived so far, at each arrival.
            keep_intervals: keep every record's token intervals (False frees them once
                its TBT is known: large replays).
        """
        started = time.perf_counter()
        # Every check before anything changes: a refused call leaves the context as it was.
        if self._has_run:  # else the second workload's records join the first's (or "arrivals out of order")
            raise InvalidRequestError(
                "this cluster has replayed a workload already (its clock, records and scheduler state would carry"
                " into the next): build a new one to replay another"
            )
        keep_intervals = require_bool("keep_intervals", keep_intervals)
        if progress is not None and not callable(progress):  # else a TypeError at the first arrival
            raise ConfigError(f"progress must be a callable or None, got {shown(progress)}")
        stream = require_iterable("requests", requests, error=InvalidRequestError)
        self._has_run = True
        self._progress = progress
        self.records.keep_intervals = keep_intervals
        load = LoadTrace(self.sample_interval_s, counts)
        self.loop.feed(stream, _arrival_s, arrive)
        self.loop.run(load)
        if not self.records:
            raise InvalidRequestError(
                "no request to replay: the workload is empty (an iterator, such as generate_requests' workload, is"
                " used up by one replay: make a list of it to replay it again)"
            )
        return ReplayResult(
            summary=summarize(self.records, self.slo, sim_wall_s=time.perf_counter() - started),
            records=self.records,
            load=tuple(load.samples),
        )

    def open(self, now: float, request: Request) -> RequestRecord:
        """Count an arrival, tell the progress callback, and open the request's record."""
        self._arrived += 1
        if self._progress is not None:
            self._progress(self._arrived)
        record = RequestRecord(request.request_id, now, request.input_length, request.output_length)
        self.records.add(record)
        return record

    def complete(self, now: float, record: RequestRecord) -> None:
        """The request's last token came out at `now`: its TBT is known, its record ends."""
        record.outcome = Outcome.COMPLETED
        record.finish_s = now
        record.tbt_s = top_mean(record.intervals)
        self.records.seal(record)

    def reject(self, now: float, record: RequestRecord, outcome: Outcome, reason: Reason) -> None:
        """The request was refused at `now` (`outcome` says before or after its prefill): its record ends, its
        `finish_s` the refusal (its client's answer: the summary's span runs to the last answer of any kind)."""
        record.outcome = outcome
        record.reason = reason
        record.finish_s = now
        self.records.seal(record)
