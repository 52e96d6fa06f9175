"""Properties of `mooncake.sim.replayer.ReplayContext` over generated small workloads.

`ReplayContext.run` drives a cluster: it calls `arrive(now, request)` at each
arrival, in arrival order, merged in time order with the events the cluster
schedules on `loop` (an arrival before any other event at the same time);
`progress` is told 1, 2, ... n as the cluster opens the records; the load is
`counts()` sampled on the grid of `sample_interval_s`; every record opened is
in `records`, in arrival order, and ends exactly once (`complete` or
`reject`). These are checked with the smallest cluster that uses the context
as the simulators do (each request's fate drawn: refused on arrival, refused
after its prefill, or completed after a drawn prefill and token gaps), whose
every step is logged as the reference, and once with the coupled simulator
handed a context of its own.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.errors import InvalidRequestError
from mooncake.sched.outcome import Outcome, Reason
from mooncake.sim.coupled import CoupledCluster
from mooncake.sim.metrics import LoadSample, LoadTrace, RecordTable, ReplayResult, RequestRecord
from mooncake.sim.replayer import ReplayContext
from mooncake.types import Request, RequestId, Slo
from tests.sim.test_coupled import make_spec as coupled_spec
from tests.sim.test_disaggregated import workloads as prefix_workloads
from tests.strategies import requests as spread_requests

REPLAY = settings(max_examples=40, deadline=None)
SLO = Slo(ttft_s=1.0, tbt_s=0.5)
ARRIVAL = "arrive"

# Far-apart arrivals (up to 10⁶ s: idle stretches the load trace compresses) or bunched ones (equal times).
workloads = st.one_of(spread_requests(), prefix_workloads()).filter(bool)
sample_intervals = st.sampled_from([0.1, 0.25, 1.0])
# Arrivals on whole seconds: many at one time, and events (prefills, token gaps of whole seconds) landing on them.
bunched_workloads = workloads.map(
    lambda requests: [attrs.evolve(r, arrival_s=float(math.floor(r.arrival_s))) for r in requests]
)


@attrs.frozen
class Fate:
    """What the toy cluster does with one request."""

    kind: str  # "rejected before prefill", "rejected after prefill" or "completed"
    prefill_s: float
    gaps_s: tuple[float, ...]  # between its tokens (none: its only token is the prefill's)


fates = st.builds(
    Fate,
    st.sampled_from(["rejected before prefill", "rejected after prefill", "completed", "completed"]),
    st.sampled_from([0.0, 0.001, 0.25, 1.0, 1.5]),
    st.lists(st.sampled_from([0.0, 0.005, 0.25, 1.0]), max_size=4).map(tuple),
)


class ToyCluster:
    """A cluster run by a `ReplayContext` as the simulators run: it opens a record at each arrival, schedules
    the request's prefill end and tokens on the context's loop, and ends each record once. Every handler call
    is logged with its time and the counts after it (the reference the context's output is checked against)."""

    def __init__(self, context: ReplayContext, fates: dict[RequestId, Fate]) -> None:
        self.context, self.fates = context, fates
        self.prefilling = self.decoding = 0
        self.log: list[tuple[float, str, RequestId]] = []
        self.counts_after: list[tuple[float, tuple[int, int]]] = []  # (time, counts once that event was handled)

    def run(self, requests: Iterable[object], **options: object) -> ReplayResult:
        return self.context.run(requests, self.arrive, self.counts, **options)  # type: ignore[arg-type]

    def counts(self) -> tuple[int, int]:
        return self.prefilling, self.decoding

    def _handled(self, now: float, what: str, request_id: RequestId) -> None:
        self.log.append((now, what, request_id))

    def _done(self, now: float) -> None:
        self.counts_after.append((now, self.counts()))

    def arrive(self, now: float, request: Request) -> None:
        self._handled(now, ARRIVAL, request.request_id)
        record = self.context.open(now, request)
        fate = self.fates[request.request_id]
        if fate.kind == "rejected before prefill":
            self.context.reject(now, record, Outcome.REJECTED_BEFORE_PREFILL, Reason.NO_PREFILL_INSTANCE)
        else:
            self.prefilling += 1
            self.context.loop.at(now + fate.prefill_s, self.prefilled, record, fate)
        self._done(now)

    def prefilled(self, now: float, record: RequestRecord, fate: Fate) -> None:
        self._handled(now, "prefilled", record.request_id)
        self.prefilling -= 1
        record.prefill_s, record.first_token_s = fate.prefill_s, now
        if fate.kind == "rejected after prefill":
            self.context.reject(now, record, Outcome.REJECTED_AFTER_PREFILL, Reason.KV_BUDGET)
        elif fate.gaps_s:
            self.decoding += 1
            self.context.loop.at(now + fate.gaps_s[0], self.token, record, fate, 1)
        else:
            self.context.complete(now, record)
        self._done(now)

    def token(self, now: float, record: RequestRecord, fate: Fate, done: int) -> None:
        self._handled(now, "token", record.request_id)
        record.intervals.add(fate.gaps_s[done - 1], 0.0, 1)
        if done < len(fate.gaps_s):
            self.context.loop.at(now + fate.gaps_s[done], self.token, record, fate, done + 1)
        else:
            self.decoding -= 1
            self.context.complete(now, record)
        self._done(now)


def draw_fates(data: st.DataObject, requests: Sequence[Request]) -> dict[RequestId, Fate]:
    return {request.request_id: data.draw(fates, label=f"fate of {request.request_id}") for request in requests}


def replay(
    requests: Sequence[Request], fates: dict[RequestId, Fate], interval_s: float = 1.0, **options: object
) -> tuple[ToyCluster, ReplayResult]:
    cluster = ToyCluster(ReplayContext(SLO, sample_interval_s=interval_s), fates)
    return cluster, cluster.run(requests, **options)


def times_of(request: Request, fate: Fate) -> Iterator[float]:
    """The reference times of its prefill end and each later token, summed as the cluster sums them."""
    now = request.arrival_s + fate.prefill_s
    yield now
    for gap in fate.gaps_s:
        now += gap
        yield now


# --------------------------------------------------------------------------- records


@REPLAY
@given(workloads, st.data())
def test_every_request_has_one_record_ended_once_as_its_cluster_ended_it(
    requests: list[Request], data: st.DataObject
) -> None:
    """One record per request, in arrival order, none left live; each says what the cluster did: refusals with
    their outcome and reason and no finish, completions with the finish time of the last token and the TBT of
    its gaps (the largest: fewer than ten of them); the summary counts each outcome once."""
    fates = draw_fates(data, requests)
    _, result = replay(requests, fates)
    records = result.records
    assert isinstance(records, RecordTable)
    records.check_invariants()
    assert records.num_live == 0
    assert [r.request_id for r in records] == [r.request_id for r in requests]
    for request, record in zip(requests, records, strict=True):
        fate = fates[request.request_id]
        assert (record.arrival_s, record.input_tokens, record.output_tokens) == (
            request.arrival_s,
            request.input_length,
            request.output_length,
        )
        if fate.kind == "rejected before prefill":
            assert (record.outcome, record.reason) == (Outcome.REJECTED_BEFORE_PREFILL, Reason.NO_PREFILL_INSTANCE)
            assert record.first_token_s is None and record.finish_s == request.arrival_s  # refused on arrival
            continue
        times = list(times_of(request, fate))
        assert record.first_token_s == times[0]
        if fate.kind == "rejected after prefill":
            assert (record.outcome, record.reason) == (Outcome.REJECTED_AFTER_PREFILL, Reason.KV_BUDGET)
            assert record.finish_s == times[0]  # the refusal, its client's answer
        else:
            assert (record.outcome, record.reason) == (Outcome.COMPLETED, None)
            assert record.finish_s == times[-1]
            assert record.tbt_s == max(fate.gaps_s, default=0.0)
            assert record.intervals.listed() == list(fate.gaps_s)
    summary = result.summary
    kinds = [fates[r.request_id].kind for r in requests]
    assert summary.num_requests == len(requests)
    assert summary.completed == kinds.count("completed")
    assert summary.rejected_before_prefill == kinds.count("rejected before prefill")
    assert summary.rejected_after_prefill == kinds.count("rejected after prefill")


@REPLAY
@given(workloads, st.data())
def test_a_replay_without_intervals_keeps_every_tbt(requests: list[Request], data: st.DataObject) -> None:
    """`keep_intervals=False` (large replays) lets each ended record's intervals go but not its TBT: the
    records are those of the same replay with intervals, less the intervals."""
    fates = draw_fates(data, requests)
    _, kept = replay(requests, fates)
    _, freed = replay(requests, fates, keep_intervals=False)
    assert all(record.intervals.count == 0 for record in freed.records)
    assert [attrs.evolve(record, intervals=attrs.evolve(record.intervals, runs=[])) for record in kept.records] == (
        list(freed.records)
    )
    assert attrs.evolve(kept.summary, sim_wall_s=0.0) == attrs.evolve(freed.summary, sim_wall_s=0.0)


# --------------------------------------------------------------------------- order of events


@REPLAY
@given(bunched_workloads, st.data())
def test_arrivals_and_scheduled_events_are_handled_in_time_order(requests: list[Request], data: st.DataObject) -> None:
    """Each request arrives once, in workload order, at its arrival time; every event the cluster scheduled
    is handled, at its time; time never goes back; and at any one time the arrivals come before the
    scheduled events (a request arriving as another's prefill ends is seen by that event's handler)."""
    fates = draw_fates(data, requests)
    cluster, _ = replay(requests, fates)
    log = cluster.log
    assert [(now, who) for now, what, who in log if what == ARRIVAL] == [(r.arrival_s, r.request_id) for r in requests]
    assert [now for now, _, _ in log] == sorted(now for now, _, _ in log)
    for (now, what, _), (later, then, _) in itertools.pairwise(log):
        assert not (now == later and what != ARRIVAL and then == ARRIVAL), f"an arrival at {now} came after an event"
    for request in requests:
        fate = fates[request.request_id]
        handled = [now for now, what, who in log if who == request.request_id and what != ARRIVAL]
        scheduled = [] if fate.kind == "rejected before prefill" else list(times_of(request, fate))
        assert handled == (scheduled[:1] if fate.kind == "rejected after prefill" else scheduled)


@REPLAY
@given(workloads, st.data())
def test_progress_is_told_the_count_at_each_arrival(requests: list[Request], data: st.DataObject) -> None:
    """`progress` hears 1, 2, ..., n, the k-th time inside the k-th request's arrival, at its arrival time,
    before its record is added: a progress bar advances with the replay, once per request."""
    told: list[tuple[int, float, int, tuple[float, str, RequestId]]] = []
    cluster = ToyCluster(ReplayContext(SLO, sample_interval_s=1.0), draw_fates(data, requests))
    context = cluster.context

    def progress(count: int) -> None:
        told.append((count, context.loop.now, len(context.records), cluster.log[-1]))

    cluster.run(requests, progress=progress)
    assert told == [
        (k + 1, request.arrival_s, k, (request.arrival_s, ARRIVAL, request.request_id))
        for k, request in enumerate(requests)
    ]


# --------------------------------------------------------------------------- load samples


def grid_index(time_s: float, interval_s: float) -> int:
    """The index of the last multiple of `interval_s` at or before `time_s` (products, as the trace keeps)."""
    index = math.floor(time_s / interval_s)
    while index * interval_s > time_s:
        index -= 1
    while (index + 1) * interval_s <= time_s:
        index += 1
    return index


def counts_before(cluster: ToyCluster, time_s: float) -> tuple[int, int]:
    """The cluster's counts once every event before `time_s` was handled (none handled: idle)."""
    held = (0, 0)
    for now, counts in cluster.counts_after:
        if now >= time_s:
            break
        held = counts
    return held


@REPLAY
@given(workloads, sample_intervals, st.data())
def test_the_load_is_the_clusters_counts_on_the_sampling_grid(
    requests: list[Request], interval_s: float, data: st.DataObject
) -> None:
    """Samples sit on the multiples of `sample_interval_s`, from the one at or before the first arrival to
    the one at or before the last event, each consecutive (an idle stretch longer than the trace keeps is its
    first and last samples only), and each holds the counts the cluster had then: after every earlier event,
    before the ones at or after it."""
    cluster, result = replay(requests, draw_fates(data, requests), interval_s)
    load = result.load
    assert all(isinstance(sample, LoadSample) for sample in load)
    indices = [grid_index(sample.time_s, interval_s) for sample in load]
    assert [index * interval_s for index in indices] == [sample.time_s for sample in load]
    assert indices[0] == grid_index(requests[0].arrival_s, interval_s)
    assert indices[-1] == grid_index(cluster.log[-1][0], interval_s)
    assert all(b - a == 1 or b - a > LoadTrace.MAX_GAP_SAMPLES for a, b in itertools.pairwise(indices))
    for sample in load:
        assert (sample.prefill_requests, sample.decode_requests) == counts_before(cluster, sample.time_s), sample


# --------------------------------------------------------------------------- refusals


@REPLAY
@given(workloads, st.data(), st.sampled_from([("0", 1.0), {"request_id": "x"}, "request", 3.5, None]))
def test_an_item_that_is_no_request_is_refused_naming_its_type(
    requests: list[Request], data: st.DataObject, stray: object
) -> None:
    """A workload holding something that is not a `Request` (a raw trace line, a tuple, a None) is an
    `InvalidRequestError` naming its type, raised when the replay reaches it: the requests before it arrived.
    (A None is no end of the stream: the requests after it are not dropped unseen.)"""
    position = data.draw(st.integers(0, len(requests)), label="position")
    cluster = ToyCluster(ReplayContext(SLO, sample_interval_s=1.0), draw_fates(data, requests))
    with pytest.raises(InvalidRequestError, match=f"got {type(stray).__name__}"):
        cluster.run([*requests[:position], stray, *requests[position:]])
    assert [who for _, what, who in cluster.log if what == ARRIVAL] == [r.request_id for r in requests[:position]]


def test_a_replay_of_nothing_is_refused() -> None:
    """No request at all (an iterator already used up by a replay) is an `InvalidRequestError` saying so, not a
    summary of nothing."""
    cluster = ToyCluster(ReplayContext(SLO, sample_interval_s=1.0), {})
    with pytest.raises(InvalidRequestError, match="no request to replay"):
        cluster.run(iter(()))


# --------------------------------------------------------------------------- a simulator in a handed context


@settings(max_examples=20, deadline=None)
@given(prefix_workloads(), sample_intervals)
def test_a_simulator_handed_a_context_replays_in_it_as_in_its_own(requests: list[Request], interval_s: float) -> None:
    """The coupled simulator handed a context runs in it (its records are the context's, progress is told at
    each arrival with the context's clock at the arrival) and gives the replay it gives in a context made for
    it: the same records, load and summary."""
    context = ReplayContext(SLO, sample_interval_s=interval_s)
    told: list[tuple[int, float, int]] = []
    result = CoupledCluster(coupled_spec(), slo=SLO, context=context).run(
        requests, progress=lambda count: told.append((count, context.loop.now, len(context.records)))
    )
    assert result.records is context.records
    assert told == [(k + 1, request.arrival_s, k) for k, request in enumerate(requests)]
    own = CoupledCluster(coupled_spec(sample_interval_s=interval_s), slo=SLO).run(requests)
    assert list(result.records) == list(own.records)
    assert result.load == own.load
    assert attrs.evolve(result.summary, sim_wall_s=0.0) == attrs.evolve(own.summary, sim_wall_s=0.0)
