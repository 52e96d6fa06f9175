"""`mooncake.sim.report`'s files read back as written, or are not written at all.

Properties: random records' CSV reads back field for field (ids with commas, quotes and line breaks
included; times to the microsecond; empty where not reached), random summaries' JSON reads back as
the data with non-finite floats as null; an error part way through a write (a record or value that
cannot be written, the disk filling up, Ctrl-C) leaves the folder as it was, an earlier file at the
target included, and an OSError about the write names the file asked for; a second write started
inside the first (two runs sharing a folder) uses a temporary of its own, and both end whole.
"""

from __future__ import annotations

import csv
import errno
import json
import math
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mooncake.sched.outcome import Outcome, Reason
from mooncake.sim.metrics import RequestRecord, summarize
from mooncake.sim.report import RECORD_COLUMNS, summary_table, write_json, write_records_csv
from mooncake.types import InstanceId, RequestId, Slo

times_s = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)
# Ids as a trace or a client may write them: separators, quotes and line breaks that CSV must quote.
ids = st.text(st.sampled_from('ab,"\n\r ;\te\u00e9\u4e2d'), min_size=1, max_size=8)
instances = st.none() | st.sampled_from(["prefill-0", "decode-1", "a,b", 'q"uote']).map(InstanceId)


@st.composite
def records(draw: st.DrawFn) -> RequestRecord:
    arrival = draw(times_s)
    first_token = draw(st.none() | times_s.map(lambda t: arrival + t))
    return RequestRecord(
        request_id=RequestId(draw(ids)),
        arrival_s=arrival,
        input_tokens=draw(st.integers(1, 2**24)),
        output_tokens=draw(st.integers(1, 2**24)),
        outcome=draw(st.none() | st.sampled_from(Outcome)),
        reason=draw(st.none() | st.sampled_from(Reason)),
        prefill_instance=draw(instances),
        decode_instance=draw(instances),
        prefix_tokens=draw(st.integers(0, 2**24)),
        prefill_s=draw(times_s),
        inline_prefill=draw(st.booleans()),
        first_token_s=first_token,
        finish_s=draw(st.none() | times_s.map(lambda t: arrival + t)),
        tbt_s=draw(times_s),
    )


@given(rows=st.lists(records(), max_size=12, unique_by=lambda record: record.request_id))
@example(  # half a printed digit exactly: 0.75 s of wasted prefill prints as 0.8
    rows=[
        RequestRecord(
            request_id=RequestId("r"),
            arrival_s=0.0,
            input_tokens=1,
            output_tokens=1,
            outcome=Outcome.REJECTED_AFTER_PREFILL,
            prefill_s=0.75,
        )
    ]
)
def test_the_summary_table_shows_the_summarys_figures(rows: list[RequestRecord]) -> None:
    """The text table reads back as the summary: its outcome counts, and TTFT (s) and TBT (ms) mean, p50, p90
    and p99 to the printed precision, under a header naming the columns."""
    summary = summarize(rows, Slo(ttft_s=1.0, tbt_s=0.1))
    outcomes, header, ttft, tbt = summary_table(summary)
    shown = re.fullmatch(
        r"requests ([\d,]+): completed ([\d,]+), rejected before prefill ([\d,]+), after prefill ([\d,]+) "
        r"\(wasted prefill ([\d,.]+) s\)",
        outcomes,
    )
    assert shown is not None, outcomes
    counts = [int(n.replace(",", "")) for n in shown.groups()[:4]]
    assert counts == [
        summary.num_requests,
        summary.completed,
        summary.rejected_before_prefill,
        summary.rejected_after_prefill,
    ]
    # Half the last printed digit, and the floats' own rounding: 0.75 s prints as 0.8 (round half to even).
    assert float(shown[5].replace(",", "")) == pytest.approx(summary.wasted_prefill_s, abs=0.05 + 1e-12)
    assert header.split() == ["mean", "p50", "p90", "p99"]
    for line, unit, values, factor in ((ttft, "s", summary.ttft_s, 1.0), (tbt, "ms", summary.tbt_s, 1000.0)):
        name, printed_unit, *figures = line.split()
        assert printed_unit == unit and name in ("TTFT", "TBT")
        for printed, key in zip(figures, ("mean", "p50", "p90", "p99"), strict=True):
            assert float(printed) == pytest.approx(values[key] * factor, abs=0.0005 + 1e-12, rel=1e-9)


def microseconds(text: str, value: float | None) -> bool:
    """A time column: empty for None, else the value to the microsecond (half a microsecond, and the float's own
    rounding)."""
    if value is None:
        return text == ""
    return abs(float(text) - value) <= 5e-7 + 4 * math.ulp(value)


def hidden_files(folder: Path) -> list[str]:
    """What a write may leave beside its target: temporaries are hidden siblings."""
    return sorted(path.name for path in folder.iterdir() if path.name.startswith("."))


@settings(max_examples=60)
@given(rows=st.lists(records(), max_size=12))
def test_the_csv_reads_back_field_for_field(rows: list[RequestRecord]) -> None:
    """Every record is a row, in order, whose columns read back as its fields: ids exactly (CSV quoting keeps
    separators and line breaks), counts exactly, times to the microsecond, empty where unset (a TBT where no
    token interval was measured)."""
    with tempfile.TemporaryDirectory(prefix="report-props-") as name:
        path = Path(name) / "requests.csv"
        write_records_csv(rows, path)
        with path.open(encoding="utf-8", newline="") as stream:
            reader = csv.DictReader(stream)
            assert tuple(reader.fieldnames or ()) == RECORD_COLUMNS
            read = list(reader)
        assert hidden_files(Path(name)) == []
    assert len(read) == len(rows)
    for row, record in zip(read, rows, strict=True):
        assert row["request_id"] == record.request_id
        assert (row["prefill_instance"], row["decode_instance"]) == (
            record.prefill_instance or "",
            record.decode_instance or "",
        )
        assert (int(row["input_tokens"]), int(row["output_tokens"]), int(row["prefix_tokens"])) == (
            record.input_tokens,
            record.output_tokens,
            record.prefix_tokens,
        )
        assert (Outcome(row["outcome"]) if row["outcome"] else None) is record.outcome
        assert (Reason(row["reason"]) if row["reason"] else None) is record.reason
        assert row["inline_prefill"] == str(int(record.inline_prefill))
        for column, value in [
            ("arrival_s", record.arrival_s),
            ("prefill_s", record.prefill_s),
            # TBT only where an interval was measured (a completed answer of two tokens or more), as the summary's
            ("tbt_s", record.tbt_s if record.outcome is Outcome.COMPLETED and record.output_tokens > 1 else None),
            ("ttft_s", record.ttft_s),
            ("finish_s", record.finish_s),
        ]:
            assert microseconds(row[column], value), (column, row[column], value)


summaries = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=12,
)


def as_read_back(data: Any) -> Any:
    """What strict JSON makes of `data`: tuples as lists, non-finite floats as null."""
    if isinstance(data, float) and not math.isfinite(data):
        return None
    if isinstance(data, list | tuple):
        return [as_read_back(value) for value in data]
    if isinstance(data, dict):
        return {key: as_read_back(value) for key, value in data.items()}
    return data


def refuse_constant(name: str) -> Any:
    raise AssertionError(f"{name} is not strict JSON")


@given(data=summaries)
def test_the_json_reads_back_as_written(data: Any) -> None:
    """A summary reads back, by a strict parser, as itself with tuples as lists and non-finite floats as null;
    the file ends with a newline."""
    with tempfile.TemporaryDirectory(prefix="report-props-") as name:
        path = Path(name) / "summary.json"
        write_json(data, path)
        text = path.read_text(encoding="utf-8")
        assert hidden_files(Path(name)) == []
    assert text.endswith("\n")
    assert json.loads(text, parse_constant=refuse_constant) == as_read_back(data)


class Poison:
    """A record that raises `error` when the writer reads it: a failure part way through the file."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __getattr__(self, name: str) -> Any:
        raise self.error


class PoisonMapping(dict[str, Any]):
    """A summary's mapping that raises `error` when read: a failure inside the JSON write."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error

    def items(self) -> Any:
        raise self.error


FAILURES: dict[str, Callable[[], BaseException]] = {
    "a value that cannot be written": lambda: ValueError("mid-write"),
    "Ctrl-C": KeyboardInterrupt,
    "the disk fills up": lambda: OSError(errno.ENOSPC, "No space left on device"),
    "a file the writer reads is missing": lambda: FileNotFoundError(
        errno.ENOENT, "No such file or directory", "/elsewhere/source.bin"
    ),
}


@settings(max_examples=40)
@given(
    kind=st.sampled_from(sorted(FAILURES)),
    before=st.integers(0, 400),  # rows written first: past a buffer's worth, some reach the disk
    earlier=st.none() | st.binary(max_size=20),
    data=st.data(),
)
def test_a_write_that_fails_part_way_leaves_the_folder_as_it_was(
    kind: str, before: int, earlier: bytes | None, data: st.DataObject
) -> None:
    """Whatever stops a CSV or JSON write part way, the folder afterwards is as it was (an earlier file at the
    target keeps its bytes; no temporary is left); an OSError of the write itself names the file asked for, any
    other error passes unchanged."""
    record = RequestRecord(request_id=RequestId("r"), arrival_s=0.0, input_tokens=1, output_tokens=1)
    with tempfile.TemporaryDirectory(prefix="report-props-") as name:
        folder = Path(name)
        target = folder / data.draw(st.sampled_from(["requests.csv", "summary.json"]), label="target")
        if earlier is not None:
            target.write_bytes(earlier)
        error = FAILURES[kind]()
        with pytest.raises(BaseException) as caught:
            if target.suffix == ".csv":
                write_records_csv([record] * before + [Poison(error)], target)  # type: ignore[list-item]
            elif kind == "a value that cannot be written":  # json refuses it after the rows before it
                write_json({"rows": [1.5] * before, "z": object()}, target)
            else:
                write_json({"rows": [1.5] * before, "z": PoisonMapping(error)}, target)
        assert sorted(path.name for path in folder.iterdir()) == ([] if earlier is None else [target.name])
        if earlier is not None:
            assert target.read_bytes() == earlier
    if target.suffix == ".json" and kind == "a value that cannot be written":
        assert isinstance(caught.value, TypeError)
    elif kind == "the disk fills up":
        assert isinstance(caught.value, OSError) and caught.value.errno == errno.ENOSPC
        assert caught.value.filename == str(target)
    else:
        assert caught.value is error


class Interleaved:
    """A record whose first read runs a whole second write (another run sharing the folder) and checks that the
    first write's temporary survives it."""

    def __init__(self, record: RequestRecord, second: Any) -> None:
        self.record = record
        self.second = second
        self.done = False

    def __getattr__(self, name: str) -> Any:
        if not self.done:
            self.done = True
            folder = self.second()
            assert len(hidden_files(folder)) == 1, hidden_files(folder)  # the first write's own temporary
        return getattr(self.record, name)


@settings(max_examples=30)
@given(same_target=st.booleans(), second_json=st.booleans(), rows=st.integers(0, 300))
def test_a_second_writer_in_the_folder_has_a_temporary_of_its_own(
    same_target: bool, second_json: bool, rows: int
) -> None:
    """A write that starts and ends while another is half way through (two runs sharing --out) touches nothing of
    the first's: each ends whole (the later rename wins a shared target) and no temporary is left."""
    record = RequestRecord(request_id=RequestId("r"), arrival_s=0.0, input_tokens=1, output_tokens=1)
    with tempfile.TemporaryDirectory(prefix="report-props-") as name:
        folder = Path(name)
        first = folder / "out.csv"
        second = first if same_target else folder / ("summary.json" if second_json else "other.csv")

        def write_second() -> Path:
            if second_json:
                write_json({"run": 2}, second)
            else:
                write_records_csv([record], second)
            return folder

        write_records_csv([record] * rows + [Interleaved(record, write_second)], first)  # type: ignore[list-item]
        assert hidden_files(folder) == []
        with first.open(encoding="utf-8", newline="") as stream:
            assert len(list(csv.DictReader(stream))) == rows + 1
        if not same_target:
            assert second.stat().st_size > 0
            if second_json:
                assert json.loads(second.read_text(encoding="utf-8")) == {"run": 2}


def test_a_folder_that_cannot_be_made_names_the_file_asked_for(tmp_path: Path) -> None:
    """--out under a path that is a file: the error names the output asked for, as every other failed write
    does, so that the user sees which write failed."""
    (tmp_path / "blocker").write_text("", encoding="utf-8")
    target = tmp_path / "blocker" / "summary.json"
    with pytest.raises(OSError) as caught:
        write_json({"a": 1}, target)
    assert str(target) in str(caught.value)


def test_a_long_but_legal_file_name_is_written(tmp_path: Path) -> None:
    """A name of 240 bytes is legal (NAME_MAX is 255) and the file can be written directly; written whole via a
    temporary, it must be written too."""
    target = tmp_path / ("r" * 235 + ".json")
    target.write_text("{}", encoding="utf-8")  # the system takes the name
    target.unlink()
    write_json({"a": 1}, target)
    assert json.loads(target.read_text(encoding="utf-8")) == {"a": 1}
    assert hidden_files(tmp_path) == []
