"""`RecordTable` as a state machine, against a plain list of the records it was given.

The machine adds records as requests arrive (a fresh id, or one already in
the table, which must be refused), moves live requests along (outcome, times,
instances, intervals), seals them (and tries to seal what is not live),
changes a record after it was sealed, and reads the table back every way a
sequence is read, changing each sealed row it read. The reference is a list with one entry per added record: the very
object while it is live, a copy taken at `seal` once sealed (without its
intervals when the table drops them). Columns are recomputed field by field
from that list, and the summary by `tests.reference.metrics`, record by record.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mooncake.errors import InvalidRequestError
from mooncake.sched.outcome import Outcome, Reason
from mooncake.sim.metrics import IntervalRuns, RecordTable, RequestRecord, summarize
from mooncake.types import InstanceId, RequestId, Slo
from tests.reference.metrics import reference_summary
from tests.strategies import instance_ids

FLOAT_FIELDS = ("arrival_s", "prefill_s", "tbt_s", "first_token_s", "finish_s")
INT_FIELDS = ("input_tokens", "output_tokens", "prefix_tokens")
CODED_FIELDS = ("outcome", "reason", "prefill_instance", "decode_instance", "inline_prefill")
SLOS = (Slo(), Slo(ttft_s=1.0, tbt_s=0.05))
REQUEST_IDS = tuple(RequestId(f"r{i}") for i in range(60))  # drawn at random: a used one now and then

times = st.sampled_from([0.0, 1.0, 30.0]) | st.floats(min_value=0.0, max_value=100.0)  # 1 and 30: the SLOs' TTFTs
tbts = st.sampled_from([0.0, 0.05, 0.1]) | st.floats(min_value=0.0, max_value=0.3)  # 0.05 and 0.1: their TBTs
instances = st.none() | instance_ids
SEEN_INSTANCES = tuple(InstanceId(f"node-{i}") for i in range(5))  # every value instance_ids draws
interval_runs = st.tuples(
    st.floats(min_value=0.0, max_value=0.5), st.floats(min_value=-0.01, max_value=0.01), st.integers(0, 20)
)
rows = st.integers(min_value=0, max_value=10**6)  # an index into the rows of some kind, taken modulo their number
indexes = st.integers(min_value=-50, max_value=50)
slice_ends = st.none() | st.integers(min_value=-45, max_value=45)

outcomes = st.sampled_from([None, Outcome.COMPLETED, Outcome.COMPLETED, *Outcome])  # completed: half the time

field_changes = st.fixed_dictionaries(
    {},
    optional={
        "outcome": outcomes,
        "reason": st.sampled_from([None, *Reason]),
        "prefill_instance": instances,
        "decode_instance": instances,
        "prefix_tokens": st.integers(min_value=0, max_value=5000),
        "prefill_s": times,
        "inline_prefill": st.booleans(),
        "ttft_s": st.none() | times,  # sets first_token_s, that long after arrival (None: no first token)
        "decode_s": st.none() | times,  # sets finish_s, that long after the first token (or arrival)
        "tbt_s": tbts,
    },
)
"""Some of the fields a request's progress sets (intervals aside), times relative to the record's own."""


def apply_changes(
    record: RequestRecord, changes: dict[str, Any], runs: list[tuple[float, float, int]] | None = None
) -> None:
    """Set `changes` on `record` and add the interval `runs`: what a request's progress does to it."""
    for run in runs or []:
        record.intervals.add(*run)
    for name, value in changes.items():
        if name == "ttft_s":
            record.first_token_s = None if value is None else record.arrival_s + value
        elif name == "decode_s":
            start = record.arrival_s if record.first_token_s is None else record.first_token_s
            record.finish_s = None if value is None else start + value
        else:
            setattr(record, name, value)


@st.composite
def new_records(draw: st.DrawFn) -> RequestRecord:
    """A record as a request arrives, sometimes already carrying progress (as `RecordTable.of` takes them)."""
    record = RequestRecord(
        draw(st.sampled_from(REQUEST_IDS)),
        draw(times),
        draw(st.integers(min_value=1, max_value=10_000)),
        draw(st.sampled_from([1, 1, 2]) | st.integers(min_value=1, max_value=500)),  # one token has no TBT
        outcome=draw(outcomes),
        tbt_s=draw(tbts),
    )
    apply_changes(record, draw(field_changes))
    for run in draw(st.lists(interval_runs, max_size=2)):
        record.intervals.add(*run)
    return record


def column_value(table: RecordTable, name: str, record: RequestRecord) -> float:
    """What `table.column(name)` holds for `record`, as documented: NaN for a missing time, codes for the rest."""
    value = getattr(record, name)
    if name in FLOAT_FIELDS:
        return math.nan if value is None else float(value)
    if name == "outcome":
        return table.outcome_code(value)
    if name == "reason":
        return table.reason_code(value)
    if name == "inline_prefill":
        return int(value)
    if name in CODED_FIELDS:
        return table.code_of(value)
    return int(value)


@attrs.define(eq=False)
class Row:
    """One added record: the object given to `add`, and what the table must read back once it is sealed."""

    given: RequestRecord
    sealed: RequestRecord | None = None

    def expected(self) -> RequestRecord:
        return self.given if self.sealed is None else self.sealed


class RecordTableMachine(RuleBasedStateMachine):
    """Arrivals, progress, seals and reads on one table (intervals kept or not), against a list of rows.

    Invariants: the table is the list of expected records (`len`, `==`, iteration, indexing with negative and
    out-of-range indices, slices with any step, `in`, `index`, `count`, `reversed`); a live row is the very
    object added, a sealed one an equal copy taken at `seal` (no intervals when the table drops them) that later
    changes to the record or to a read-back row do not reach; `num_live` counts the unsealed rows; every column
    equals the one recomputed from the list, and is a copy; `summarize` equals the record-by-record reference,
    and a table built by `RecordTable.of` from the list reads and summarizes alike; an id already in the table is
    refused with InvalidRequestError, and so is sealing a record that is not live, neither changing the table;
    `check_invariants` holds throughout.
    """

    def __init__(self) -> None:
        super().__init__()
        self.table = RecordTable()
        self.rows: list[Row] = []

    @initialize(keep_intervals=st.booleans())
    def build(self, keep_intervals: bool) -> None:
        self.table = RecordTable(keep_intervals=keep_intervals)
        assert len(self.table) == 0 and list(self.table) == [] and self.table.num_live == 0

    # ------------------------------------------------------------------ the reference

    def expected(self) -> list[RequestRecord]:
        return [row.expected() for row in self.rows]

    def live_rows(self) -> list[Row]:
        return [row for row in self.rows if row.sealed is None]

    def sealed_rows(self) -> list[Row]:
        return [row for row in self.rows if row.sealed is not None]

    def has_live(self) -> bool:
        return bool(self.live_rows())

    def has_sealed(self) -> bool:
        return bool(self.sealed_rows())

    def snapshot(self, record: RequestRecord) -> RequestRecord:
        kept = IntervalRuns(list(record.intervals.runs)) if self.table.keep_intervals else IntervalRuns()
        return attrs.evolve(record, intervals=kept)

    # ------------------------------------------------------------------ changes

    @rule(record=new_records())
    def add(self, record: RequestRecord) -> None:
        if any(row.given.request_id == record.request_id for row in self.rows):
            with pytest.raises(InvalidRequestError):
                self.table.add(record)
        else:
            self.table.add(record)
            self.rows.append(Row(record))

    @precondition(lambda self: bool(self.rows))
    @rule(which=rows, record=new_records())
    def add_a_used_id(self, which: int, record: RequestRecord) -> None:
        """Refused whether the row with that id is live or sealed; the refused record is not in the table."""
        record.request_id = self.rows[which % len(self.rows)].given.request_id
        with pytest.raises(InvalidRequestError):
            self.table.add(record)

    @precondition(has_live)
    @rule(which=rows, changes=field_changes, runs=st.lists(interval_runs, max_size=2))
    def progress(self, which: int, changes: dict[str, Any], runs: list[tuple[float, float, int]]) -> None:
        """A live record changes in place: the table reads it as it is now."""
        live = self.live_rows()
        record = live[which % len(live)].given
        apply_changes(record, changes, runs)

    @precondition(has_live)
    @rule(which=rows)
    def seal(self, which: int) -> None:
        live = self.live_rows()
        row = live[which % len(live)]
        self.table.seal(row.given)
        row.sealed = self.snapshot(row.given)

    @precondition(has_live)
    @rule(which=rows)
    def seal_a_count_past_int64(self, which: int) -> None:
        """A field no column holds fails the seal halfway through its writes, a named error: the record stays live,
        read as the object it is."""
        live = self.live_rows()
        row = live[which % len(live)]
        record, kept = row.given, row.given.input_tokens
        record.input_tokens = 2**63
        with pytest.raises(InvalidRequestError, match="input_tokens=9223372036854775808"):
            self.table.seal(record)
        assert self.table[self.rows.index(row)] is record
        record.input_tokens = kept

    @precondition(has_sealed)
    @rule(which=rows, changes=field_changes, runs=st.lists(interval_runs, min_size=1, max_size=2))
    def change_after_seal(self, which: int, changes: dict[str, Any], runs: list[tuple[float, float, int]]) -> None:
        """The record was copied at `seal`, its intervals included: changing the object later leaves the row as
        it was."""
        sealed = self.sealed_rows()
        record = sealed[which % len(sealed)].given
        apply_changes(record, changes, runs)

    @precondition(has_sealed)
    @rule(which=rows)
    def seal_again(self, which: int) -> None:
        sealed = self.sealed_rows()
        with pytest.raises(InvalidRequestError, match="not live"):
            self.table.seal(sealed[which % len(sealed)].given)

    @precondition(has_live)
    @rule(which=rows)
    def seal_an_equal_copy(self, which: int) -> None:
        """Sealing goes by identity: an equal record that was never added is not the live one."""
        live = self.live_rows()
        record = live[which % len(live)].given
        with pytest.raises(InvalidRequestError, match="not live"):
            self.table.seal(attrs.evolve(record))

    # ------------------------------------------------------------------ reads

    @rule(index=indexes)
    def get_one(self, index: int) -> None:
        expected = self.expected()
        if -len(expected) <= index < len(expected):
            got = self.table[index]
            assert got == expected[index]
            if self.rows[index].sealed is None:
                assert got is self.rows[index].given
        else:
            with pytest.raises(IndexError):
                self.table[index]

    @rule(start=slice_ends, stop=slice_ends, step=st.none() | st.integers(min_value=-5, max_value=5))
    def get_slice(self, start: int | None, stop: int | None, step: int | None) -> None:
        expected = self.expected()
        if step == 0:
            with pytest.raises(ValueError):
                self.table[start:stop:step]
            return
        got = self.table[start:stop:step]
        assert isinstance(got, tuple) and got == tuple(expected[start:stop:step])
        positions = range(len(expected))[start:stop:step]
        for record, position in zip(got, positions, strict=True):
            if self.rows[position].sealed is None:
                assert record is self.rows[position].given

    @precondition(lambda self: bool(self.rows))
    @rule(which=rows)
    def search(self, which: int) -> None:
        expected = self.expected()
        wanted = expected[which % len(expected)]
        assert wanted in self.table
        assert self.table.index(wanted) == expected.index(wanted)
        assert self.table.count(wanted) == expected.count(wanted) == 1  # ids are unique
        assert list(reversed(self.table)) == expected[::-1]

    @rule(name=st.sampled_from(FLOAT_FIELDS + INT_FIELDS + CODED_FIELDS))
    def column_is_a_copy(self, name: str) -> None:
        column = self.table.column(name)
        before = column.copy()
        column[:] = 7
        assert np.array_equal(self.table.column(name), before, equal_nan=True)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def table_is_the_list(self) -> None:
        self.table.check_invariants()
        expected = self.expected()
        assert len(self.table) == len(expected)
        assert self.table.num_live == len(self.live_rows())
        assert list(self.table) == expected
        assert [self.table[i - len(expected)] for i in range(len(expected))] == expected  # negative indices
        assert self.table == expected and self.table == tuple(expected)
        assert self.table != [*expected, None] and (not expected or self.table != expected[1:])
        assert self.table != "" and self.table != {}  # a string or a mapping is no sequence of records
        for row, got in zip(self.rows, self.table, strict=True):
            if row.sealed is None:
                assert got is row.given
            else:
                assert self.table.keep_intervals or got.intervals.runs == []
                got.tbt_s += 1.0  # a sealed row is rebuilt on each read: changing one read changes no later read
                got.intervals.add(0.5, 0.0, 1)
        assert list(self.table) == expected

    @invariant()
    def columns_are_the_lists_fields(self) -> None:
        expected = self.expected()
        for codes in (
            [self.table.outcome_code(outcome) for outcome in (None, *Outcome)],
            [self.table.reason_code(reason) for reason in (None, *Reason)],
            [self.table.code_of(name) for name in (None, *SEEN_INSTANCES)],
        ):
            assert len(set(codes)) == len(codes), codes  # a code names one value
        for name in FLOAT_FIELDS + INT_FIELDS + CODED_FIELDS:
            column = self.table.column(name)
            want = [column_value(self.table, name, record) for record in expected]
            assert len(column) == len(want)
            if name in FLOAT_FIELDS:
                assert column.dtype == np.float64
                assert np.array_equal(column, np.array(want, dtype=np.float64), equal_nan=True), name
            else:
                assert column.dtype.kind == "i" and column.tolist() == want, name

    @invariant()
    def summary_is_the_references(self) -> None:
        expected = self.expected()
        rebuilt = RecordTable.of(expected)
        assert rebuilt.num_live == 0 and list(rebuilt) == expected
        for slo in SLOS:
            want = reference_summary(expected, slo, sim_wall_s=0.25)
            assert summarize(self.table, slo, sim_wall_s=0.25) == want
            assert summarize(rebuilt, slo, sim_wall_s=0.25) == want


RecordTableMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestRecordTableMachine = RecordTableMachine.TestCase
