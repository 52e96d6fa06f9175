"""Tests for `mooncake.sim.metrics`: interval runs, the top-10 % mean, summaries and load traces.

`top_mean` is checked against a brute-force reference (materialise every
interval, sort, average the ceil(0.1 n) largest), on runs small enough for its
sorting path and large enough (n > 4,096) for its bisection path, with
falling, flat and rising runs; `summarize` on hand-built records; `LoadTrace`
driven by an `EventLoop`; `RecordTable` (live records, sealed rows rebuilt
equal) and the columnar `summarize` against the record-by-record reference of
`tests/reference/metrics.py`, figure for figure.
"""

from __future__ import annotations

import math
import signal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.errors import InvalidRequestError
from mooncake.sched.outcome import Outcome, Reason
from mooncake.sim.clock import EventLoop
from mooncake.sim.metrics import (
    IntervalRuns,
    LoadSample,
    LoadTrace,
    RecordTable,
    RequestRecord,
    summarize,
    top_mean,
    top_mean_of,
)
from mooncake.types import InstanceId, RequestId, Slo
from tests.reference.metrics import reference_summary

BISECTION_ABOVE = 4096  # top_mean sorts up to this many intervals, bisects above


def reference_top_mean(values: np.ndarray, fraction: float = 0.1) -> float:
    """Brute force: the mean of the ceil(fraction · n) largest values (0 for none)."""
    if values.size == 0:
        return 0.0
    m = max(1, math.ceil(fraction * values.size))
    return float(np.sort(values)[-m:].mean())


def assert_top_mean(runs: IntervalRuns, fraction: float = 0.1) -> None:
    values = runs.values()
    expected = reference_top_mean(values, fraction)
    scale = float(np.abs(values).max()) if values.size else 1.0
    assert math.isclose(top_mean(runs, fraction), expected, rel_tol=1e-9, abs_tol=1e-12 * max(scale, 1.0))


run_firsts = st.sampled_from([0.0, 0.016, -0.5, 1.0]) | st.floats(min_value=-2.0, max_value=2.0)
run_steps = st.sampled_from([0.0, 0.0, 2.5e-8, -2.5e-8, 1e-4, -1e-4]) | (
    st.floats(min_value=-1e-3, max_value=1e-3).map(lambda step: step if abs(step) >= 1e-12 else 0.0)
)  # subnormal steps overflow the bisection: see test_top_mean_subnormal_step


@st.composite
def interval_runs(draw: st.DrawFn, *, max_count: int) -> IntervalRuns:
    runs = IntervalRuns()
    for _ in range(draw(st.integers(min_value=0, max_value=6))):
        runs.add(draw(run_firsts), draw(run_steps), draw(st.integers(min_value=0, max_value=max_count)))
    return runs


# --------------------------------------------------------------------------- IntervalRuns


def test_runs_expand_to_arithmetic_progressions() -> None:
    """values() lists each run's first, first + step, ...; empty runs are not stored; count sums counts."""
    runs = IntervalRuns()
    runs.add(1.0, 0.5, 3)
    runs.add(9.0, 1.0, 0)
    runs.add(-1.0, -1.0, 2)
    assert runs.runs == [(1.0, 0.5, 3), (-1.0, -1.0, 2)]
    assert runs.count == 5
    np.testing.assert_array_equal(runs.values(), [1.0, 1.5, 2.0, -1.0, -2.0])
    assert IntervalRuns().values().size == 0


def test_top_mean_hand_examples() -> None:
    """The mean of the longest 10 % (at least one) of the intervals; 0 with none."""
    assert top_mean(IntervalRuns()) == 0.0
    assert top_mean(IntervalRuns([(0.2, 0.0, 1)])) == 0.2
    assert top_mean(IntervalRuns([(1.0, 1.0, 10)])) == 10.0  # 10 values: the largest one
    assert top_mean(IntervalRuns([(1.0, 1.0, 11)])) == 10.5  # 11 values: ceil(1.1) = 2 largest
    assert top_mean(IntervalRuns([(1.0, 1.0, 10)]), fraction=0.5) == 8.0


@given(interval_runs(max_count=800))
def test_top_mean_small_runs_match_brute_force(runs: IntervalRuns) -> None:
    """Up to a few thousand intervals (the sorting path) the result is the brute-force one."""
    assert_top_mean(runs)


@given(interval_runs(max_count=800))
def test_top_mean_is_numpys_mean_of_the_partitioned_values_bit_for_bit(runs: IntervalRuns) -> None:
    """Up to 4,096 intervals the result is exactly numpy's mean of the top of `np.partition(values)`
    (replays must not change by an ulp), however the values are listed or summed."""
    values = runs.values()
    assert values.tolist() == runs.listed()
    if 0 < values.size <= BISECTION_ABOVE:
        m = max(1, math.ceil(0.1 * values.size))
        expected = float(np.partition(values, values.size - m)[values.size - m :].mean())
        assert top_mean(runs) == expected and math.copysign(1.0, top_mean(runs)) == math.copysign(1.0, expected)


@given(st.lists(st.floats(min_value=0.0, max_value=10.0), max_size=300), st.floats(min_value=0.01, max_value=1.0))
def test_top_mean_of_an_array_is_the_mean_of_its_largest_tenth(values: list[float], fraction: float) -> None:
    """A client's intervals in an array (validate.py's): the mean of the largest ceil(fraction * n), against a
    sort (to rounding), and 0 for none."""
    largest = sorted(values)[len(values) - max(1, math.ceil(fraction * len(values))) :] if values else []
    expected = sum(largest) / len(largest) if largest else 0.0
    assert top_mean_of(np.array(values, dtype=np.float64), fraction) == pytest.approx(expected, rel=1e-12, abs=1e-300)


@settings(max_examples=40)
@given(interval_runs(max_count=4000), st.integers(min_value=BISECTION_ABOVE + 1, max_value=20_000))
def test_top_mean_large_runs_match_brute_force(runs: IntervalRuns, extra: int) -> None:
    """Above 4,096 intervals (the bisection path) the result is still the brute-force one."""
    runs.add(0.0158, 2.5e-8, extra)  # a long decode stretch ensures n > 4,096
    assert runs.count > BISECTION_ABOVE
    assert_top_mean(runs)


@pytest.mark.parametrize(
    "runs",
    [
        [(0.02, 0.0, 5000)],  # all equal
        [(0.02, 0.0, 4000), (0.05, 0.0, 200), (0.01, 0.0, 900)],  # ties across the cut
        [(1.0, -1e-4, 6000)],  # falling
        [(-1.0, 1e-4, 6000), (0.0, 0.0, 100)],  # rising through zero
        [(0.5, 0.0, 3000), (0.5, 1e-9, 3000), (0.5, -1e-9, 3000)],  # nearly tied runs
        [(0.0158, 2.5e-8, 4097)],  # just past the threshold
        [(0.1, 0.0, 1), (0.0158, 2.5e-8, 9000), (3.0, 0.0, 1)],  # a few long gaps (stalls) among steps
    ],
    ids=["equal", "ties", "falling", "through-zero", "near-ties", "threshold", "stalls"],
)
def test_top_mean_bisection_examples(runs: list[tuple[float, float, int]]) -> None:
    """Edge shapes for the bisection: equal values, ties at the cut, falling runs, values around zero."""
    interval_runs_ = IntervalRuns(list(runs))
    assert interval_runs_.count > BISECTION_ABOVE
    assert_top_mean(interval_runs_)


def test_top_mean_subnormal_step() -> None:
    """A run whose step is tiny but not zero (5e-324) must not break the bisection path."""
    assert_top_mean(IntervalRuns([(0.0158, 2.5e-8, 5000), (0.0159, 5e-324, 3)]))


@settings(max_examples=20)
@given(interval_runs(max_count=3000), st.floats(min_value=0.01, max_value=1.0))
def test_top_mean_other_fractions(runs: IntervalRuns, fraction: float) -> None:
    """Any fraction in (0, 1], on both paths."""
    runs.add(0.03, 1e-6, 4200)
    assert_top_mean(runs, fraction)


# --------------------------------------------------------------------------- summarize


def record(
    name: str,
    outcome: Outcome | None,
    *,
    arrival_s: float,
    first_token_s: float | None = None,
    finish_s: float | None = None,
    tbt_s: float = 0.0,
    input_tokens: int = 1000,
    prefix_tokens: int = 0,
    prefill_s: float = 0.0,
) -> RequestRecord:
    return RequestRecord(
        RequestId(name),
        arrival_s,
        input_tokens,
        10,
        outcome=outcome,
        prefix_tokens=prefix_tokens,
        prefill_s=prefill_s,
        first_token_s=first_token_s,
        finish_s=finish_s,
        tbt_s=tbt_s,
    )


def test_summarize_hand_built_records() -> None:
    """Counts, attainment over all requests, goodput over the span, hit ratio over prefilled prompts."""
    slo = Slo(ttft_s=1.0, tbt_s=0.1)
    records = [
        # within both SLOs
        record(
            "ok",
            Outcome.COMPLETED,
            arrival_s=0.0,
            first_token_s=0.5,
            finish_s=2.0,
            tbt_s=0.05,
            prefix_tokens=500,
            prefill_s=0.4,
        ),
        # TTFT exactly at the SLO counts as within
        record("edge", Outcome.COMPLETED, arrival_s=1.0, first_token_s=2.0, finish_s=3.0, tbt_s=0.1, prefill_s=0.6),
        # too slow a first token
        record("late", Outcome.COMPLETED, arrival_s=2.0, first_token_s=3.5, finish_s=4.0, tbt_s=0.01, prefill_s=1.0),
        # too slow between tokens; finishes last
        record("slow", Outcome.COMPLETED, arrival_s=3.0, first_token_s=3.2, finish_s=9.0, tbt_s=0.2, prefill_s=0.2),
        # prefilled, then rejected by its decode instance: wasted work, counted in the hit ratio
        record(
            "wasted", Outcome.REJECTED_AFTER_PREFILL, arrival_s=4.0, first_token_s=4.9, prefix_tokens=250, prefill_s=0.8
        ),
        # never prefilled
        record("refused", Outcome.REJECTED_BEFORE_PREFILL, arrival_s=5.0),
    ]
    summary = summarize(records, slo, sim_wall_s=1.25)
    assert summary.num_requests == 6
    assert (summary.completed, summary.rejected_before_prefill, summary.rejected_after_prefill) == (4, 1, 1)
    assert summary.wasted_prefill_s == pytest.approx(0.8)
    assert summary.slo_attainment == pytest.approx(2 / 6)
    assert summary.goodput_rps == pytest.approx(2 / (9.0 - 0.0))
    assert summary.cache_hit_ratio == pytest.approx(750 / 5000)
    assert summary.mean_prefill_s == pytest.approx((0.4 + 0.6 + 1.0 + 0.2 + 0.8) / 5)
    ttfts = [0.5, 1.0, 1.5, 0.2]
    assert summary.ttft_s["mean"] == pytest.approx(np.mean(ttfts))
    assert summary.ttft_s["p50"] == pytest.approx(np.percentile(ttfts, 50))
    assert summary.tbt_s["p90"] == pytest.approx(np.percentile([0.05, 0.1, 0.01, 0.2], 90))
    assert summary.sim_wall_s == 1.25
    assert summary.to_json()["completed"] == 4


def test_summarize_nothing_and_nothing_completed() -> None:
    """No records, or only rejections: zeros, never a division by zero."""
    slo = Slo()
    empty = summarize([], slo)
    assert (empty.num_requests, empty.slo_attainment, empty.goodput_rps, empty.cache_hit_ratio) == (0, 0.0, 0.0, 0.0)
    assert empty.ttft_s == {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    rejected = summarize([record("r", Outcome.REJECTED_BEFORE_PREFILL, arrival_s=3.0)], slo)
    assert (rejected.completed, rejected.slo_attainment, rejected.goodput_rps) == (0, 0.0, 0.0)
    assert rejected.mean_prefill_s == 0.0


# --------------------------------------------------------------------------- RecordTable


def test_record_table_returns_live_records_and_rebuilds_sealed_ones() -> None:
    """In flight, a row is the very object added; sealed, an equal record rebuilt from the columns."""
    table = RecordTable()
    first = record("a", None, arrival_s=0.5)
    second = record("b", None, arrival_s=1.5)
    table.add(first)
    table.add(second)
    assert len(table) == 2 and table[0] is first and table[-1] is second
    table.check_invariants()
    first.outcome, first.first_token_s, first.finish_s, first.tbt_s = Outcome.COMPLETED, 0.75, 2.0, 0.02
    first.prefill_instance = first.decode_instance = InstanceId("node-1")
    first.intervals.add(0.02, 0.001, 3)
    table.seal(first)
    table.check_invariants()
    rebuilt = table[0]
    assert rebuilt is not first and rebuilt == first and table[0:1] == (first,)
    assert list(table) == [first, second] and table == [first, second]
    assert table.column("first_token_s")[1] != table.column("first_token_s")[1]  # None reads as NaN
    with pytest.raises(IndexError):
        table[2]


def test_record_table_may_drop_intervals() -> None:
    """With `keep_intervals=False` a sealed record keeps its TBT but not its intervals."""
    table = RecordTable(keep_intervals=False)
    done = record("a", Outcome.COMPLETED, arrival_s=0.0, first_token_s=1.0, finish_s=2.0, tbt_s=0.03)
    done.intervals.add(0.03, 0.0, 10)
    table.add(done)
    table.seal(done)
    assert table[0].intervals.runs == [] and table[0].tbt_s == 0.03


_times = st.floats(min_value=0.0, max_value=100.0) | st.sampled_from([0.0, 1.0, 30.0])


@st.composite
def record_lists(draw: st.DrawFn) -> list[RequestRecord]:
    records = []
    for i in range(draw(st.integers(min_value=0, max_value=30))):
        arrival = draw(_times)
        outcome = draw(st.sampled_from([None, *Outcome]))
        first = None if outcome == Outcome.REJECTED_BEFORE_PREFILL else arrival + draw(_times | st.just(0.0))
        if outcome is None and draw(st.booleans()):
            first = None
        finish = first + draw(_times) if outcome == Outcome.COMPLETED and first is not None else None
        records.append(
            RequestRecord(
                RequestId(f"r{i}"),
                arrival,
                draw(st.integers(min_value=1, max_value=10_000)),
                draw(st.integers(min_value=1, max_value=500)),
                outcome=outcome,
                reason=draw(st.sampled_from([None, *Reason])),
                prefill_instance=draw(st.sampled_from([None, InstanceId("p-0"), InstanceId("p-1")])),
                decode_instance=draw(st.sampled_from([None, InstanceId("d-0")])),
                prefix_tokens=draw(st.integers(min_value=0, max_value=5000)),
                prefill_s=draw(_times),
                inline_prefill=draw(st.booleans()),
                first_token_s=first,
                finish_s=finish,
                tbt_s=draw(st.floats(min_value=0.0, max_value=0.3)),
            )
        )
    return records


@given(record_lists(), st.sampled_from([Slo(), Slo(ttft_s=1.0, tbt_s=0.05)]))
def test_columnar_summary_equals_the_record_by_record_one(records: list[RequestRecord], slo: Slo) -> None:
    """`summarize` over a table (or a list) gives exactly the figures summing record by record gives,
    and the table's rows equal the records sealed into it."""
    table = RecordTable.of(records)
    assert list(table) == records
    want = reference_summary(records, slo, sim_wall_s=0.5)
    assert summarize(table, slo, sim_wall_s=0.5) == want
    assert summarize(records, slo, sim_wall_s=0.5) == want


# --------------------------------------------------------------------------- LoadTrace


def test_load_trace_samples_the_state_held_at_each_sample_time() -> None:
    """A sample at time t records the state after the last event before t (before the event at t, if any)."""
    loop = EventLoop()
    state = {"prefill": 0, "decode": 0}
    trace = LoadTrace(1.0, lambda: (state["prefill"], state["decode"]))

    def set_state(_now: float, prefill: int, decode: int) -> None:
        state.update(prefill=prefill, decode=decode)

    loop.at(0.0, set_state, 2, 0)
    loop.at(0.5, set_state, 1, 1)
    loop.at(2.0, set_state, 0, 3)  # the sample at 2.0 sees the state held since 0.5
    loop.at(4.5, set_state, 0, 0)
    loop.run(trace)
    assert trace.samples == [
        LoadSample(0.0, 0, 0),  # before the first event ran
        LoadSample(1.0, 1, 1),
        LoadSample(2.0, 1, 1),
        LoadSample(3.0, 0, 3),
        LoadSample(4.0, 0, 3),
    ]


@given(
    st.sampled_from([0.25, 0.5, 1.0, 3.0, 0.1, 0.01, 0.3]),  # and ones no float holds: the grid is k · i as computed
    st.lists(st.integers(min_value=0, max_value=300), min_size=1, max_size=20),
    st.lists(st.integers(min_value=0, max_value=3000), max_size=5),
)
def test_load_trace_has_one_sample_per_interval_up_to_the_last_event(
    interval_s: float, event_ticks: list[int], on_grid: list[int]
) -> None:
    """Samples at the multiples of i from the last at or before the first event up to the last event's time,
    each the count set by the latest earlier event (events exactly at a sample time included: k · i / i can
    round below k)."""
    loop = EventLoop()
    # Within 30 s: at most 3,000 intervals, below the gap that keeps only its ends (MAX_GAP_SAMPLES, tested apart).
    times = sorted([t / 10 for t in event_ticks] + [k * interval_s for k in on_grid if k * interval_s <= 30])
    current = [0]
    trace = LoadTrace(interval_s, lambda: (current[0], -current[0]))
    for number, time_s in enumerate(times, start=1):
        loop.at(time_s, lambda _now, n: current.__setitem__(0, n), number)
    loop.run(trace)

    def last_at_or_before(time_s: float) -> int:  # by counting, as the grid's times compute
        k = 0
        while (k + 1) * interval_s <= time_s:
            k += 1
        return k

    first = last_at_or_before(times[0])
    assert len(trace.samples) == last_at_or_before(times[-1]) - first + 1
    for index, sample in enumerate(trace.samples):
        assert sample.time_s == (first + index) * interval_s
        before = [n for n, t in enumerate(times, start=1) if t < sample.time_s]  # an event at the time: not yet
        assert sample.prefill_requests == (before[-1] if before else 0)
        assert sample.decode_requests == -sample.prefill_requests


@pytest.mark.parametrize(("interval_s", "now"), [(1.0, 1e98), (1e-300, 1.0), (1.0, 2.0**60), (5e-324, 1.0)])
def test_load_trace_places_a_time_past_its_exact_grid_at_once(interval_s: float, now: float) -> None:
    """An event 2**50 intervals or more in (a time far out, or a tiny interval) is placed by the quotient: there
    neighbouring sample times round to one float, and stepping along the grid to pass it never ended (a replay at
    --speedup 1e-100 hung there). One sample is taken, once."""

    def hung(_signum: int, _frame: object) -> None:
        raise TimeoutError(f"LoadTrace({interval_s}) at {now} did not return")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)
    try:
        trace = LoadTrace(interval_s, lambda: (1, 0))
        trace(now)
        trace(now)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert [(sample.prefill_requests, sample.decode_requests) for sample in trace.samples] == [(1, 0)]


def test_load_trace_memory_follows_the_events_not_the_idle_time() -> None:
    """A trace stamped in epoch seconds samples from its first event (not from 0: 1.7e9 samples), and a gap of
    months between two events is its first and last samples (10 million samples of one unchanged state)."""
    loop = EventLoop()
    current = [0]
    trace = LoadTrace(1.0, lambda: (current[0], 0))
    start = 1.7e9
    for time_s, count in [(start, 1), (start + 2.5, 2), (start + 1e7, 3), (start + 1e7 + 1.5, 4)]:
        loop.at(time_s, lambda _now, n: current.__setitem__(0, n), count)
    loop.run(trace)
    times = [sample.time_s for sample in trace.samples]
    assert times[:3] == [start, start + 1, start + 2] and len(times) < 10
    assert times[3:] == [start + 3, start + 1e7, start + 1e7 + 1]  # the gap: its first sample, then its last
    assert [sample.prefill_requests for sample in trace.samples][3:] == [2, 2, 3]
    # The bound: a stretch of MAX_GAP_SAMPLES intervals keeps every sample, one more keeps only its ends.
    for gap, kept in ((LoadTrace.MAX_GAP_SAMPLES, LoadTrace.MAX_GAP_SAMPLES + 2), (LoadTrace.MAX_GAP_SAMPLES + 1, 3)):
        bounded = LoadTrace(1.0, lambda: (0, 0))
        bounded(0.0)  # samples 0; the next is due at 1
        bounded(float(gap + 1))  # the stretch from sample 1 to sample gap + 1
        assert len(bounded.samples) == kept


def test_a_count_no_column_holds_is_a_named_error_and_the_record_stays_live() -> None:
    """No `Request` reaches 2**63 tokens, but a hand-built record may: `seal` names the field, keeps it live."""
    table = RecordTable()
    record = RequestRecord(request_id=RequestId("r"), arrival_s=0.0, input_tokens=2**70, output_tokens=1)
    table.add(record)
    with pytest.raises(InvalidRequestError, match=r"input_tokens=1180591620717411303424 is past"):
        table.seal(record)
    assert table[0] is record


def test_no_waste_is_a_float_zero() -> None:
    """`wasted_prefill_s` is a float even when nothing was wasted (JSON readers see 0.0 beside the floats)."""
    record = RequestRecord(request_id=RequestId("r"), arrival_s=0.0, input_tokens=4, output_tokens=1)
    summary = summarize([record], Slo())
    assert summary.wasted_prefill_s == 0 and isinstance(summary.wasted_prefill_s, float)


def test_a_completion_with_no_first_token_meets_no_ttft_objective() -> None:
    """A completed record without a first token (a client that saw none) has no TTFT to meet: it is outside the
    objectives, whatever they are, and in no TTFT percentile. It met any TTFT objective (its TTFT read as 0)."""
    records = [record("none", Outcome.COMPLETED, arrival_s=0.0, finish_s=2.0, tbt_s=0.0)]
    summary = summarize(records, Slo(ttft_s=0.5, tbt_s=0.1))
    assert (summary.completed, summary.slo_attainment, summary.goodput_rps) == (1, 0.0, 0.0)
    assert summary.ttft_s == {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
