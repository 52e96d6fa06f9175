"""A lenient read (`strict=False`, `--skip-invalid`) against one wrong timestamp, and `write_trace` into a stream.

One spiked timestamp (a typo, a unit slip) raised the mark that later lines are checked against, so a lenient read
skipped every line after it, each on its own: a 4,000-line trace came out as its first two requests. Now a run of
`MAX_LINES_BEHIND` lines, none read between, all refused for arriving before one start ends the read with an error
naming that start; a shorter run is skipped as before. Checked by example and against a reference written from the
docstring; strict reading is unchanged (tests/workload/test_trace.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, example, given
from hypothesis import strategies as st

from mooncake.errors import TraceFormatError
from mooncake.workload import SkippedLine, load_trace, write_trace
from mooncake.workload.assembly import MAX_LINES_BEHIND

BLOCK = 4
LIMIT = 10  # written out here, not read from the module under test: the documented bound


def record(timestamp: int, **fields: Any) -> dict[str, Any]:
    return {"timestamp": timestamp, "input_length": 5, "output_length": 3, "hash_ids": [1, 2], **fields}


def write(path: Path, lines: list[Any]) -> Path:
    """A trace of `lines` (dicts as JSON, strings as they are), one per line."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in lines), encoding="utf-8")
    return path


def lenient(path: Path) -> tuple[list[float] | TraceFormatError, list[int]]:
    """(the arrivals in ms, or the error) and the lines skipped, of a lenient read."""
    skipped: list[SkippedLine] = []
    try:
        workload = load_trace(path, block_size_tokens=BLOCK, strict=False, on_skip=skipped.append)
    except TraceFormatError as error:
        return error, [s.line for s in skipped]
    return [round(r.arrival_s * 1000) for r in workload], [s.line for s in skipped]


def test_the_documented_bound_is_ten() -> None:
    assert MAX_LINES_BEHIND == LIMIT


def test_one_spiked_timestamp_is_named_instead_of_costing_the_rest_of_the_trace(tmp_path: Path) -> None:
    """Line 2's timestamp spiked to 999999 in a 20-line trace: the ten lines after it are skipped, each named,
    and then the read fails naming line 2, its arrival and the lines it cost (it kept 2 of 20 requests)."""
    stamps = [0, 999_999, *range(100, 1900, 100)]
    path = write(tmp_path / "spike.jsonl", [record(t) for t in stamps])
    outcome, skipped = lenient(path)
    assert isinstance(outcome, TraceFormatError), outcome
    assert (outcome.line, skipped) == (2, list(range(3, 13)))
    assert str(outcome).startswith(f"{path}:2: arrives at 999999 ms, but the 10 lines after it (lines 3 to 12, ")
    assert "fix or remove this line, or sort the trace by timestamp" in str(outcome)


def test_a_run_shorter_than_the_bound_is_skipped_as_before(tmp_path: Path) -> None:
    """Nine lines behind one start, then one after it: the nine are skipped and the read goes on; so is a run
    of nine at the end of the trace. A placed line ends a run: two runs of nine make no error."""
    stamps = [0, 1000, *[500] * 9, 2000, *[1500] * 9, 3000, *[2500] * 9]
    path = write(tmp_path / "t.jsonl", [record(t) for t in stamps])
    outcome, skipped = lenient(path)
    assert outcome == [0, 1000, 2000, 3000]
    assert skipped == [*range(3, 12), *range(13, 22), *range(23, 32)]


def test_lines_skipped_for_other_reasons_neither_count_nor_end_a_run(tmp_path: Path) -> None:
    """A malformed line or a blank one between lines behind the start leaves the run going; a session's later
    turn behind the start counts as a line behind it: the tenth line behind it ends the read."""
    lines: list[Any] = [record(0), record(1000, session_id="s"), *[record(1) for _ in range(5)], "{", ""]
    lines += [record(2, session_id="s"), *[record(3) for _ in range(4)], record(4000)]
    path = write(tmp_path / "t.jsonl", lines)
    outcome, skipped = lenient(path)
    assert isinstance(outcome, TraceFormatError) and outcome.line == 2, outcome
    assert skipped == [3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14]
    assert "the 10 lines after it (lines 3 to 14, none read between)" in str(outcome)


def reference(stamps: list[int]) -> tuple[list[int] | int, list[int]]:
    """The docstring's rule, line by line: (the arrivals read, or the line the read fails at) and the skipped."""
    mark, mark_line, run, read, skipped = 0, 0, 0, [], []
    for number, stamp in enumerate(stamps, start=1):
        if stamp < mark:
            skipped.append(number)
            run += 1
            if run == LIMIT:
                return mark_line, skipped
            continue
        mark, mark_line, run = stamp, number, 0
        read.append(stamp)
    return read, skipped


@st.composite
def spiked(draw: st.DrawFn) -> list[int]:
    """Sorted timestamps, a few of them (each anywhere) raised by a spike of 1 to 1000."""
    stamps = sorted(draw(st.lists(st.integers(0, 30), min_size=1, max_size=40)))
    for index in draw(st.lists(st.integers(0, len(stamps) - 1), max_size=3)):
        stamps[index] += draw(st.integers(1, 1000))
    return stamps


@example(stamps=[0, 1000, *range(1, 12)])  # a run of ten, for sure
@example(stamps=[5, 1000, *range(1, 10), 1000, *range(1, 10)])  # two runs of nine
@given(stamps=spiked())
def test_a_lenient_read_skips_or_names_the_start_as_the_rule_says(
    tmp_path_factory: pytest.TempPathFactory, stamps: list[int]
) -> None:
    """Any timestamps (sorted, with some spiked): the lines read, the lines skipped and the line the read fails
    at, if it does, are the reference's; it never skips `MAX_LINES_BEHIND` lines in a row behind one line."""
    event("fails" if isinstance(reference(stamps)[0], int) else "reads")
    path = write(tmp_path_factory.mktemp("lenient") / "t.jsonl", [record(t) for t in stamps])
    outcome, skipped = lenient(path)
    expected, expected_skipped = reference(stamps)
    assert skipped == expected_skipped
    if isinstance(expected, int):
        assert isinstance(outcome, TraceFormatError) and outcome.line == expected, outcome
    else:
        assert outcome == expected


def test_a_trace_is_written_into_a_fifo_as_it_goes(tmp_path: Path) -> None:
    """A FIFO at the path (`mooncake trace convert IN FIFO`, or `-` and /dev/stdout on a pipe) gets the trace's
    lines and stays a FIFO: it was replaced by a regular file its reader never saw, and a stream has nothing to
    fsync (which fails on one)."""
    source = write(tmp_path / "t.jsonl", [record(0), record(5)])
    fifo = tmp_path / "out.jsonl"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # open first: the writer's open then does not wait
    try:
        assert write_trace(fifo, load_trace(source, block_size_tokens=BLOCK)) == 2
        assert os.read(reader, 4096) == source.read_bytes()
    finally:
        os.close(reader)
    assert fifo.is_fifo() and sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "t.jsonl"]
