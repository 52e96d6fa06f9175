"""Per-request outcomes of a replay and their summary (TTFT, TBT, SLO attainment, goodput).

TBT follows the paper: a request's TBT is the mean of its longest 10 % token
intervals (at least one). Decode intervals come in runs of arithmetic
progressions (a run per stretch of constant batch membership, each step a
little longer as contexts grow), so a request keeps `IntervalRuns` instead of
every interval, and the top-10 % mean is found by bisection on the cut value.

A replay's records live in a `RecordTable`: a request's `RequestRecord` is a
live object while the request is in flight, and once it has ended (`seal`) its
fields move into one compact column per field (a million requests take about
a hundred bytes each, and no objects for the garbage collector to walk). The
table is a sequence of records in arrival order, rebuilt from the columns on
access.
"""

from __future__ import annotations

import array
import heapq
import itertools
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, overload

import attrs
import numpy as np

from mooncake._checks import is_int, require_iterable, shown
from mooncake.errors import InvalidRequestError
from mooncake.sched.join import takes_slot
from mooncake.sched.outcome import Outcome, Reason
from mooncake.types import InstanceId, RequestId, Slo, require_slo

__all__ = [
    "IntervalRuns",
    "LoadSample",
    "LoadTrace",
    "RecordTable",
    "ReplayResult",
    "RequestRecord",
    "Summary",
    "has_tbt",
    "summarize",
    "top_mean",
    "top_mean_of",
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
        return sum([run[2] for run in self.runs])

    def values(self) -> np.ndarray:
        """Every interval, in order (float64)."""
        if not self.runs:
            return np.empty(0)
        runs = self.runs
        if self.count <= 96:  # a few values: listing them is quicker than the array steps below
            return np.array(self.listed(), dtype=np.float64)
        # counts are exact as floats (< 2**53); fromiter over the flattened runs is the quick way in
        table = np.fromiter(itertools.chain.from_iterable(runs), dtype=np.float64, count=3 * len(runs)).reshape(-1, 3)
        counts = table[:, 2].astype(np.int64)
        ends = counts.cumsum()
        offsets = np.arange(ends[-1]) - (ends - counts).repeat(counts)
        first_and_step = table[:, :2].repeat(counts, axis=0)
        values: np.ndarray = first_and_step[:, 0] + first_and_step[:, 1] * offsets
        return values

    def listed(self) -> list[float]:
        """Every interval, in order, as floats: the very values of `values()` (first + step · k)."""
        return [first + step * k for first, step, count in self.runs for k in range(count)]


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


def top_mean_of(values: np.ndarray, fraction: float = 0.1) -> float:
    """`top_mean` of intervals in an array (partitioned in place, as np.partition does to its copy): the mean of
    its largest ceil(fraction · n), 0 when it is empty. A client's TBT of the intervals it saw (validate.py's)."""
    n = values.size
    if n == 0:
        return 0.0
    m = max(1, math.ceil(fraction * n))
    values.partition(n - m)
    return float(np.add.reduce(values[n - m :]) / m)  # ndarray.mean, without its wrapper


def top_mean(runs: IntervalRuns, fraction: float = 0.1) -> float:
    """Mean of the largest ceil(fraction · n) intervals (0 when there are none)."""
    n = runs.count
    if n == 0:
        return 0.0
    m = max(1, math.ceil(fraction * n))
    if m <= 2:  # the largest one or two: their sum does not depend on the order numpy would add them in
        largest = heapq.nlargest(m, runs.listed())
        return largest[0] if m == 1 else (largest[0] + largest[1]) / 2
    if n <= 4096:
        return top_mean_of(runs.values(), fraction)  # a fresh array: partitioned in place
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


@attrs.define
class RequestRecord:
    """What happened to one request in a replay (times in seconds of simulated time)."""

    request_id: RequestId
    arrival_s: float
    input_tokens: int
    output_tokens: int
    outcome: Outcome | None = None
    reason: Reason | None = None
    prefill_instance: InstanceId | None = None
    decode_instance: InstanceId | None = None
    prefix_tokens: int = 0
    prefill_s: float = 0.0
    inline_prefill: bool = False
    first_token_s: float | None = None  # None: no token reached its client (rejected before or after prefill)
    # When its client had its answer: the last token, the refusal, or (a real run's) the failure (None: in flight).
    finish_s: float | None = None
    tbt_s: float = 0.0
    intervals: IntervalRuns = attrs.field(factory=IntervalRuns)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s


def has_tbt(record: RequestRecord) -> bool:
    """Whether `record` has a TBT to report: it completed and took a decode slot (`sched.join.takes_slot`: more
    than one output token). A one-token answer has no token interval; its TBT 0 is no pace, so the summary's
    TBT, the CSV and the CDF plots all leave it out."""
    return bool(_has_tbt(record.outcome is Outcome.COMPLETED, record.output_tokens))


def _has_tbt(completed: Any, output_tokens: Any) -> Any:
    # Elementwise on columns too (`summarize`): `&` and takes_slot's `>` work on bools and on arrays alike.
    return completed & takes_slot(output_tokens)


_OUTCOMES: tuple[Outcome | None, ...] = (None, *Outcome)
_OUTCOME_CODE = {outcome: code for code, outcome in enumerate(_OUTCOMES)}
_REASONS: tuple[Reason | None, ...] = (None, *Reason)
_REASON_CODE = {reason: code for code, reason in enumerate(_REASONS)}


class _Names:
    """Strings (or None) as small codes: the few instance ids a replay uses."""

    def __init__(self) -> None:
        self.names: list[str | None] = [None]
        self._codes: dict[str | None, int] = {None: 0}

    def code(self, name: str | None) -> int:
        code = self._codes.get(name)
        if code is None:
            code = self._codes[name] = len(self.names)
            self.names.append(name)
        return code


class RecordTable(Sequence[RequestRecord]):
    """Every request's record in arrival order: live objects in flight, columns once ended.

    `add` a record when its request arrives and `seal` it when the request has
    ended (completed or rejected): its fields are copied into the columns and the
    table drops the object. Reading (`table[i]`, iteration) returns the live object,
    or a `RequestRecord` rebuilt from the columns. With `keep_intervals=False` a
    sealed record's intervals are not kept (its TBT is).

    Invariants: every row is either live or sealed; columns have one entry per row; request ids are unique.
    """

    def __init__(self, *, keep_intervals: bool = True) -> None:
        self.keep_intervals = keep_intervals
        self._live: dict[int, RequestRecord] = {}  # row → record, while its request is in flight
        self._row_of: dict[int, int] = {}  # id(live record) → row
        self._request_ids: list[RequestId] = []
        self._seen: set[RequestId] = set()
        self._floats = {name: array.array("d") for name in _FLOAT_FIELDS}
        self._ints = {name: array.array("q") for name in _INT_FIELDS}
        self._codes = {name: array.array("i") for name in _CODE_FIELDS}
        self._columns: list[array.array[Any]] = [*self._floats.values(), *self._ints.values(), *self._codes.values()]
        self._names = _Names()
        self._intervals: list[IntervalRuns | None] = []

    @classmethod
    def of(cls, records: Iterable[RequestRecord], *, keep_intervals: bool = True) -> RecordTable:
        """A table of `records`, each sealed as it stands.

        Raises:
            InvalidRequestError: `records` that are no iterable, an item that is no `RequestRecord`, or a record
                `add` or `seal` refuses (naming the request and the field).
        """
        table = cls(keep_intervals=keep_intervals)
        for record in require_iterable("records", records, error=InvalidRequestError):
            if not isinstance(record, RequestRecord):  # else an AttributeError, from wherever it is first read
                raise InvalidRequestError(f"records must hold RequestRecord items, got {shown(record)}")
            table.add(record)
            table.seal(record)
        return table

    def add(self, record: RequestRecord) -> None:
        """Append a live record (its request has just arrived).

        Raises:
            InvalidRequestError: a record of this request id is in the table already (a workload's ids are unique:
                every outcome is counted by them), or an id that is unhashable (no set could count it).
        """
        try:  # free in the common case: a per-request path
            seen = record.request_id in self._seen
        except TypeError:
            raise InvalidRequestError(
                f"request id {shown(record.request_id)} is unhashable ({type(record.request_id).__name__})"
            ) from None
        if seen:
            raise InvalidRequestError(f"request id {shown(record.request_id)} appears twice in the workload")
        self._seen.add(record.request_id)
        row = len(self._request_ids)
        self._request_ids.append(record.request_id)
        for column in self._columns:
            column.append(0)
        if self.keep_intervals:
            self._intervals.append(None)
        self._live[row] = record
        self._row_of[id(record)] = row

    def seal(self, record: RequestRecord) -> None:
        """`record`'s request has ended: keep it as columns only (the table lets go of the object, and later
        changes to it, its intervals included, change nothing here).

        Raises:
            InvalidRequestError: `record` is not live in this table (sealed already, or never added); or a field
                no column holds (a time that is no number, a count that is no int or past int64, which no `Request`
                reaches, an outcome or reason that is no `Outcome` or `Reason`), naming it: the record stays live.
        """
        row = self._row_of.get(id(record))
        if row is None:
            raise InvalidRequestError(
                f"the record of request {shown(record.request_id)} is not live in this table (sealed already, or an"
                " object never added)"
            )
        # The columns first: a live row reads from its object, so a write that fails halfway shows nowhere.
        floats, ints, codes, code = self._floats, self._ints, self._codes, self._names.code
        try:  # free when every field fits (a per-request path); the slow search for the culprit only on a failure
            floats["arrival_s"][row] = record.arrival_s
            floats["prefill_s"][row] = record.prefill_s
            floats["tbt_s"][row] = record.tbt_s
            floats["first_token_s"][row] = math.nan if record.first_token_s is None else record.first_token_s
            floats["finish_s"][row] = math.nan if record.finish_s is None else record.finish_s
            ints["input_tokens"][row] = record.input_tokens
            ints["output_tokens"][row] = record.output_tokens
            ints["prefix_tokens"][row] = record.prefix_tokens
            codes["outcome"][row] = _OUTCOME_CODE[record.outcome]
            codes["reason"][row] = _REASON_CODE[record.reason]
            codes["prefill_instance"][row] = code(record.prefill_instance)
            codes["decode_instance"][row] = code(record.decode_instance)
            codes["inline_prefill"][row] = record.inline_prefill
            if self.keep_intervals:
                self._intervals[row] = IntervalRuns(list(record.intervals.runs))
        except (TypeError, KeyError, OverflowError, AttributeError) as error:
            raise InvalidRequestError(
                _record_problem(record) or f"request {shown(record.request_id)}: {error}"
            ) from error
        del self._row_of[id(record)], self._live[row]

    def column(self, name: str) -> np.ndarray:
        """A field of every record as an array, live records included (times: NaN for None;
        outcome, reason, instances and inline_prefill: codes, see `outcome_code`, `reason_code` and
        `code_of`)."""
        if name in self._floats:
            values: np.ndarray = np.frombuffer(self._floats[name], dtype=np.float64).copy()
        elif name in self._ints:
            values = np.frombuffer(self._ints[name], dtype=np.int64).copy()
        else:
            values = np.frombuffer(self._codes[name], dtype=np.int32).copy()
        for row, record in self._live.items():
            values[row] = _as_column_value(name, getattr(record, name), self)
        return values

    @staticmethod
    def outcome_code(outcome: Outcome | None) -> int:
        return _OUTCOME_CODE[outcome]

    @staticmethod
    def reason_code(reason: Reason | None) -> int:
        return _REASON_CODE[reason]

    def code_of(self, name: str | None) -> int:
        """The code `name` has (or would get) in the coded columns."""
        return self._names.code(name)

    @property
    def num_live(self) -> int:
        """Records whose request has not ended yet."""
        return len(self._live)

    def check_invariants(self) -> None:
        """Raise AssertionError if a row is neither live nor sealed once, or a column is short."""
        assert sorted(self._row_of.values()) == sorted(self._live), "live rows out of sync"
        assert all(id(record) in self._row_of for record in self._live.values()), "a live record lost its row"
        assert all(len(column) == len(self) for column in self._columns), "a column is short"
        assert not self.keep_intervals or len(self._intervals) == len(self), "intervals out of sync"

    def __len__(self) -> int:
        return len(self._request_ids)

    @overload
    def __getitem__(self, index: int) -> RequestRecord: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[RequestRecord, ...]: ...

    def __getitem__(self, index: int | slice) -> RequestRecord | tuple[RequestRecord, ...]:
        if isinstance(index, slice):
            return tuple(self._record(row) for row in range(*index.indices(len(self))))
        row = range(len(self))[index]  # IndexError, negative indices
        return self._record(row)

    def __iter__(self) -> Iterator[RequestRecord]:
        return (self._record(row) for row in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def _record(self, row: int) -> RequestRecord:
        live = self._live.get(row)
        if live is not None:
            return live
        floats, ints, codes, names = self._floats, self._ints, self._codes, self._names.names
        first, finish = floats["first_token_s"][row], floats["finish_s"][row]
        intervals = self._intervals[row] if self.keep_intervals else None
        return RequestRecord(
            request_id=self._request_ids[row],
            arrival_s=floats["arrival_s"][row],
            input_tokens=ints["input_tokens"][row],
            output_tokens=ints["output_tokens"][row],
            outcome=_OUTCOMES[codes["outcome"][row]],
            reason=_REASONS[codes["reason"][row]],
            prefill_instance=names[codes["prefill_instance"][row]],  # type: ignore[arg-type]
            decode_instance=names[codes["decode_instance"][row]],  # type: ignore[arg-type]
            prefix_tokens=ints["prefix_tokens"][row],
            prefill_s=floats["prefill_s"][row],
            inline_prefill=bool(codes["inline_prefill"][row]),
            first_token_s=None if math.isnan(first) else first,
            finish_s=None if math.isnan(finish) else finish,
            tbt_s=floats["tbt_s"][row],
            intervals=IntervalRuns(list(intervals.runs)) if intervals is not None else IntervalRuns(),
        )


_FLOAT_FIELDS = ("arrival_s", "prefill_s", "tbt_s", "first_token_s", "finish_s")
_INT_FIELDS = ("input_tokens", "output_tokens", "prefix_tokens")
_CODE_FIELDS = ("outcome", "reason", "prefill_instance", "decode_instance", "inline_prefill")
_OPTIONAL_TIMES = ("first_token_s", "finish_s")


def _record_problem(record: RequestRecord) -> str | None:
    """What in `record` no column holds, naming the request and the field (None: nothing found). Read in the
    order `RecordTable.seal` writes, so the field named is the one that failed there."""

    def problem(name: str, what: str) -> str:
        return f"request {shown(record.request_id)}: {name}={shown(getattr(record, name))} {what}"

    def fits(typecode: str, value: Any) -> bool:
        try:
            array.array(typecode, [value])
        except (TypeError, OverflowError):
            return False
        return True

    for name in _FLOAT_FIELDS:
        optional = name in _OPTIONAL_TIMES
        value = getattr(record, name)
        if not (optional and value is None) and not fits("d", value):
            return problem(name, f"is no time in seconds (a number{' or None' if optional else ''})")
    for name in _INT_FIELDS:
        value = getattr(record, name)
        if not fits("q", value):
            return problem(name, "is past what a column holds (int64)" if is_int(value) else "is no count (an int)")
    for name, codes, kind in (("outcome", _OUTCOME_CODE, "Outcome"), ("reason", _REASON_CODE, "Reason")):
        try:
            known = getattr(record, name) in codes  # its value as text is no member: the enum itself is
        except TypeError:
            known = False
        if not known:
            return problem(name, f"is neither None nor a mooncake.sched.{kind}")
    for name in ("prefill_instance", "decode_instance"):
        try:
            hash(getattr(record, name))
        except TypeError:
            return problem(name, "is neither None nor an instance id (a string)")
    if not fits("i", record.inline_prefill):
        return problem("inline_prefill", "is not True or False")
    if not isinstance(record.intervals, IntervalRuns):
        return problem("intervals", "is no IntervalRuns")
    return None


def _as_column_value(name: str, value: object, table: RecordTable) -> float | int:
    if name in _FLOAT_FIELDS:
        return math.nan if value is None else value  # type: ignore[return-value]
    if name in _INT_FIELDS:
        return value  # type: ignore[return-value]
    if name == "outcome":
        return _OUTCOME_CODE[value]  # type: ignore[index]
    if name == "reason":
        return _REASON_CODE[value]  # type: ignore[index]
    if name == "inline_prefill":
        return int(bool(value))
    return table.code_of(value)  # type: ignore[arg-type]


def _percentiles(values: Sequence[float] | np.ndarray) -> dict[str, float]:
    # numpy's default method (linear between the nearest two), as vLLM's benchmark's np.percentile calls.
    if not len(values):
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    array = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(array, [50, 90, 99])
    return {"mean": float(array.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


@attrs.frozen(kw_only=True)
class Summary:
    """The replay's figures (the `--json` of examples/replay.py).

    `ttft_s` and `tbt_s` are over the completed requests (0 when none completed; a ranking leaves such a run
    out), `tbt_s` over those with more than one output token (`has_tbt`); their percentiles are numpy's default
    (linear interpolation between the two nearest values), as vLLM's benchmark takes them. `slo_attainment` is
    over every arrival; a completion without a first token (`RequestRecord.first_token_s` None) meets no TTFT
    objective and is in no TTFT percentile. `goodput_rps` is the requests completed within both objectives per second from the
    first arrival to the last answer of any kind (a completion, a refusal, a failure: `RequestRecord.finish_s`), as
    vLLM's benchmark counts it: a policy that finishes its backlog sooner has the shorter span, so goodput can
    rank two policies against their attainment on the same arrivals, and one that refuses the tail does not
    shorten its span by it.
    """

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

    @property
    def rejected(self) -> int:
        """Requests rejected, before prefill or after it."""
        return self.rejected_before_prefill + self.rejected_after_prefill

    def to_json(self) -> dict[str, object]:
        return attrs.asdict(self)


def summarize(records: Sequence[RequestRecord], slo: Slo, *, sim_wall_s: float = 0.0) -> Summary:
    """Summary of a replay's records (read as columns: a `RecordTable` is summarized without a loop).

    Raises:
        ConfigError: an `slo` that is no `Slo`.
        InvalidRequestError: `records` that are no iterable of `RequestRecord`s, or a record with a field no
            summary can read (`RecordTable.seal`: naming the request and the field), or two of one request id.
    """
    slo = require_slo(slo)
    table = records if isinstance(records, RecordTable) else RecordTable.of(records, keep_intervals=False)
    outcome = table.column("outcome")
    completed = outcome == table.outcome_code(Outcome.COMPLETED)
    after_prefill = outcome == table.outcome_code(Outcome.REJECTED_AFTER_PREFILL)
    arrival, first_token = table.column("arrival_s"), table.column("first_token_s")
    # A request refused after its prefill has no first token (its client never got one), but was prefilled.
    prefilled = ~np.isnan(first_token) | after_prefill
    ttft = first_token - arrival  # NaN where there is no first token
    tbt, prefill_s = table.column("tbt_s"), table.column("prefill_s")
    # A completion with no first token (a client that saw none) has no TTFT to meet: NaN meets no objective.
    within = completed & (ttft <= slo.ttft_s) & (tbt <= slo.tbt_s)
    num_within = int(within.sum())
    # vLLM's benchmark divides by its whole run, until every request was answered, refusals and failures
    # included (vllm/benchmarks/serve.py: `benchmark_duration` is taken after gathering every request's task,
    # and `calculate_metrics` gives `request_goodput=good_completed / dur_s`). So the span ends at the last
    # answer of any kind: ending it at the last completion would let a policy that refuses the tail shorten it.
    ends = table.column("finish_s")
    ends = ends[~np.isnan(ends)].tolist()
    span = (max(ends) if ends else 0.0) - (min(arrival.tolist()) if len(table) else 0.0)
    # Python sums over lists, in record order: the same floats and ints as summing record by record.
    input_tokens = sum(table.column("input_tokens")[prefilled].tolist())
    return Summary(
        num_requests=len(table),
        completed=int(completed.sum()),
        rejected_before_prefill=int((outcome == table.outcome_code(Outcome.REJECTED_BEFORE_PREFILL)).sum()),
        rejected_after_prefill=int(after_prefill.sum()),
        wasted_prefill_s=sum(prefill_s[after_prefill].tolist(), 0.0),
        ttft_s=_percentiles(ttft[completed & prefilled]),
        tbt_s=_percentiles(tbt[_has_tbt(completed, table.column("output_tokens"))]),
        slo_attainment=num_within / len(table) if len(table) else 0.0,
        goodput_rps=num_within / span if span > 0 else 0.0,
        cache_hit_ratio=sum(table.column("prefix_tokens")[prefilled].tolist()) / input_tokens if input_tokens else 0.0,
        mean_prefill_s=float(np.mean(prefill_s[prefilled])) if prefilled.any() else 0.0,
        sim_wall_s=sim_wall_s,
    )


@attrs.frozen
class LoadSample:
    """Cluster load at one moment: requests queued for or running prefill, and decoding."""

    time_s: float
    prefill_requests: int
    decode_requests: int


class LoadTrace:
    """Samples `counts()` (prefill, decode) at the multiples of `interval_s` of simulated time, from the first
    event on.

    Used as the event loop's `before_each` hook: at each event it records the
    load for every sample time passed since the last event (the state held
    since then). Sampling starts at the first event, not at time 0 (a trace
    stamped in epoch milliseconds starts decades in), and a stretch of more
    than `MAX_GAP_SAMPLES` intervals without an event is recorded by its first
    and last samples only (the state is the same throughout), so memory follows
    the events, not the idle time between them.
    """

    MAX_GAP_SAMPLES = 3600
    EXACT_INDICES = 2**50  # below it, sample times k · interval_s are distinct floats, increasing with k

    def __init__(self, interval_s: float, counts: Callable[[], tuple[int, int]]) -> None:
        self.interval_s = interval_s
        self.counts = counts
        self.samples: list[LoadSample] = []
        self._next: int | None = None  # the next sample is at next · interval (a product: no drift from adding)
        self._next_s = -math.inf  # that time (the first call always samples)

    def _last_index(self, now: float) -> int:
        """The index of the last sample time at or before `now`."""
        quotient = now / self.interval_s
        if not quotient < self.EXACT_INDICES:
            # Neighbouring sample times round to one float out here: stepping along the grid might never pass
            # `now` (an endless loop), and the quotient is as exact as the grid can be.
            return math.floor(min(quotient, sys.float_info.max))
        last = math.floor(quotient)
        while last * self.interval_s > now:  # the division rounded up
            last -= 1
        while (last + 1) * self.interval_s <= now:  # or down
            last += 1
        return last

    def __call__(self, now: float) -> None:
        if now < self._next_s:  # per event: one comparison
            return
        interval = self.interval_s
        last = self._last_index(now)
        if self._next is None:  # the first event: the grid's point at or before it
            self._next = last
        prefill, decode = self.counts()
        if last - self._next > self.MAX_GAP_SAMPLES:
            self.samples.append(LoadSample(self._next * interval, prefill, decode))
            self._next = last
        while self._next <= last:
            self.samples.append(LoadSample(self._next * interval, prefill, decode))
            self._next += 1
        self._next_s = self._next * interval


@attrs.frozen(kw_only=True)
class ReplayResult:
    """A replay's summary, every request's record, and load over time."""

    summary: Summary
    records: Sequence[RequestRecord]
    load: tuple[LoadSample, ...]
