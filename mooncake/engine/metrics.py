"""Per-request outcomes of a replay and their summary (TTFT, TBT, SLO attainment, goodput).

TBT follows the paper: a request's TBT is the mean of its longest 10 % token
intervals (at least one). Decode intervals come in runs of arithmetic
progressions (a run per stretch of constant batch membership, each step a
little longer as contexts grow), so a request keeps `IntervalRuns` instead of
every interval, and the top-10 % mean is found by bisection on the cut value.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence

import attrs
import numpy as np

from mooncake.types import InstanceId, RequestId, Slo

__all__ = [
    "IntervalRuns",
    "LoadSample",
    "LoadTrace",
    "Outcome",
    "ReplayResult",
    "RequestRecord",
    "Summary",
    "summarize",
    "top_mean",
]


@attrs.define
class IntervalRuns:
    """Intervals stored as runs: `count` values first, first + step, first + 2·step, ..."""

    runs: list[tuple[float, float, int]] = attrs.field(factory=list)

    def add(self, first: float, step: float, count: int) -> None:
        if count > 0:
            self.runs.append((first, step, count))

    @property
    def count(self) -> int:
        return sum(run[2] for run in self.runs)

    def values(self) -> np.ndarray:
        """Every interval, in order."""
        if not self.runs:
            return np.empty(0)
        firsts, steps, counts = (np.asarray(column) for column in zip(*self.runs, strict=True))
        starts = np.cumsum(counts) - counts
        offsets = np.arange(int(counts.sum())) - np.repeat(starts, counts)
        values: np.ndarray = np.repeat(firsts, counts) + np.repeat(steps, counts) * offsets
        return values


def _count_and_sum_at_least(runs: Sequence[tuple[float, float, int]], cut: float) -> tuple[int, float]:
    count, total = 0, 0.0
    for first, step, n in runs:
        # A ratio too large for a float (a subnormal step) means: beyond the run.
        if step > 0:
            reach = (cut - first) / step
            start = 0 if first >= cut else (n if reach >= n else math.ceil(reach))
        elif step < 0:
            start = 0 if first >= cut else n
            if first >= cut:
                reach = (first - cut) / -step
                n = n if reach >= n else min(n, math.floor(reach) + 1)
        else:
            start = 0 if first >= cut else n
        k = n - start
        if k > 0:
            count += k
            total += k * first + step * (start + n - 1) * k / 2
    return count, total


def top_mean(runs: IntervalRuns, fraction: float = 0.1) -> float:
    """Mean of the largest ceil(fraction · n) intervals (0 when there are none)."""
    n = runs.count
    if n == 0:
        return 0.0
    m = max(1, math.ceil(fraction * n))
    if n <= 4096:
        values = runs.values()
        return float(np.partition(values, n - m)[n - m :].mean())
    low = min(min(f, f + s * (c - 1)) for f, s, c in runs.runs)
    high = max(max(f, f + s * (c - 1)) for f, s, c in runs.runs)
    for _ in range(100):  # bisection on the cut value: count(values >= cut) >= m
        middle = (low + high) / 2
        if _count_and_sum_at_least(runs.runs, middle)[0] >= m:
            low = middle
        else:
            high = middle
    count, total = _count_and_sum_at_least(runs.runs, high)
    return (total + (m - count) * low) / m


class Outcome(enum.Enum):
    COMPLETED = "completed"
    REJECTED_BEFORE_PREFILL = "rejected_before_prefill"
    REJECTED_AFTER_PREFILL = "rejected_after_prefill"


@attrs.define
class RequestRecord:
    """What happened to one request in a replay (times in seconds of simulated time)."""

    request_id: RequestId
    arrival_s: float
    input_tokens: int
    output_tokens: int
    outcome: Outcome | None = None
    reason: str = ""
    prefill_instance: InstanceId | None = None
    decode_instance: InstanceId | None = None
    prefix_tokens: int = 0
    prefill_s: float = 0.0
    inline_prefill: bool = False
    first_token_s: float | None = None
    finish_s: float | None = None
    tbt_s: float = 0.0
    intervals: IntervalRuns = attrs.field(factory=IntervalRuns)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s


def _percentiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    array = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(array, [50, 90, 99])
    return {"mean": float(array.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


@attrs.frozen(kw_only=True)
class Summary:
    """The replay's figures (the `--json` of examples/replay.py)."""

    num_requests: int
    completed: int
    rejected_before_prefill: int
    rejected_after_prefill: int
    wasted_prefill_s: float
    ttft_s: dict[str, float]
    tbt_s: dict[str, float]
    slo_attainment: float
    goodput_rps: float
    cache_hit_ratio: float
    mean_prefill_s: float
    sim_wall_s: float = 0.0

    def to_json(self) -> dict[str, object]:
        return attrs.asdict(self)


def summarize(records: Sequence[RequestRecord], slo: Slo, *, sim_wall_s: float = 0.0) -> Summary:
    """Summary of a replay's records."""
    completed = [r for r in records if r.outcome == Outcome.COMPLETED]
    prefilled = [r for r in records if r.first_token_s is not None]
    within = [r for r in completed if (r.ttft_s or 0.0) <= slo.ttft_s and r.tbt_s <= slo.tbt_s]
    arrivals = [r.arrival_s for r in records]
    ends = [r.finish_s for r in completed if r.finish_s is not None]
    span = (max(ends) if ends else 0.0) - (min(arrivals) if arrivals else 0.0)
    input_tokens = sum(r.input_tokens for r in prefilled)
    return Summary(
        num_requests=len(records),
        completed=len(completed),
        rejected_before_prefill=sum(1 for r in records if r.outcome == Outcome.REJECTED_BEFORE_PREFILL),
        rejected_after_prefill=sum(1 for r in records if r.outcome == Outcome.REJECTED_AFTER_PREFILL),
        wasted_prefill_s=sum(r.prefill_s for r in records if r.outcome == Outcome.REJECTED_AFTER_PREFILL),
        ttft_s=_percentiles([r.ttft_s for r in completed if r.ttft_s is not None]),
        tbt_s=_percentiles([r.tbt_s for r in completed]),
        slo_attainment=len(within) / len(records) if records else 0.0,
        goodput_rps=len(within) / span if span > 0 else 0.0,
        cache_hit_ratio=sum(r.prefix_tokens for r in prefilled) / input_tokens if input_tokens else 0.0,
        mean_prefill_s=float(np.mean([r.prefill_s for r in prefilled])) if prefilled else 0.0,
        sim_wall_s=sim_wall_s,
    )


@attrs.frozen
class LoadSample:
    """Cluster load at one moment: requests queued for or running prefill, and decoding."""

    time_s: float
    prefill_requests: int
    decode_requests: int


class LoadTrace:
    """Samples `counts()` (prefill, decode) every `interval_s` of simulated time.

    Used as the event loop's `before_each` hook: at each event it records the
    load for every sample time passed since the last event (the state held
    since then).
    """

    def __init__(self, interval_s: float, counts: Callable[[], tuple[int, int]]) -> None:
        self.interval_s = interval_s
        self.counts = counts
        self.samples: list[LoadSample] = []
        self._next_s = 0.0

    def __call__(self, now: float) -> None:
        if now >= self._next_s:
            prefill, decode = self.counts()
            while now >= self._next_s:
                self.samples.append(LoadSample(self._next_s, prefill, decode))
                self._next_s += self.interval_s


@attrs.frozen(kw_only=True)
class ReplayResult:
    """A replay's summary, every request's record, and load over time."""

    summary: Summary
    records: tuple[RequestRecord, ...]
    load: tuple[LoadSample, ...]
