"""Errors from a trace's line data name the file and line, and a lenient read skips the line; the session-order
error names the start it is checked against.

A `hash_ids` id of 2**256 or more passed the reader's checks and was refused only by `Request` (its keys lie below
`BLOCK_KEY_LIMIT`), built after the reader's handling of bad lines: a strict read raised an `InvalidRequestError`
with no file or line, and a lenient read (`strict=False`, `--skip-invalid`) stopped on it instead of skipping the
line. Now the reader bounds the ids itself (`trace_record._hash_ids`), and any refusal by `Request` of a line's
turn is a `TraceFormatError` naming the line.

A later turn arriving before the latest start above it, the start of another session, was said to arrive "before
the session started on line N", as if line N were its own session's start. Now the message names that start's
session (or that it has none), line and arrival.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from mooncake.cli import main
from mooncake.errors import TraceFormatError
from mooncake.workload import SkippedLine, load_trace
from mooncake.workload import trace_record as trace_record_module
from mooncake.workload.assembly import TraceAssembler
from mooncake.workload.trace_record import parse_record

BLOCK = 4
LIMIT = 2**256  # written out here, not read from the module under test: the documented bound


def line(timestamp: int, *ids: int, **fields: Any) -> dict[str, Any]:
    """A line of two blocks of BLOCK tokens, keyed `ids` (two of them)."""
    return {"timestamp": timestamp, "input_length": 2 * BLOCK, "output_length": 3, "hash_ids": list(ids), **fields}


def write(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(fields) + "\n" for fields in lines), encoding="utf-8")
    return path


# --------------------------------------------------------------------------- hash_ids below 2**256


@pytest.mark.parametrize("huge", [LIMIT, LIMIT + 1, 2**1000])
def test_an_id_of_2_256_or_more_names_file_line_and_field(tmp_path: Path, huge: int) -> None:
    """A strict read raises TraceFormatError naming the file, line 2, the field and the id's size."""
    path = write(tmp_path / "t.jsonl", [line(0, 1, 2), line(10, 1, huge), line(20, 1, 3)])
    with pytest.raises(TraceFormatError) as caught:
        load_trace(path, block_size_tokens=BLOCK)
    assert (caught.value.path, caught.value.line) == (str(path), 2)
    assert str(caught.value) == (
        f"{path}:2: field 'hash_ids' must hold ids below 2**256, got an integer of {huge.bit_length()} bits"
    )


def test_a_lenient_read_skips_the_line_of_a_huge_id(tmp_path: Path) -> None:
    """`strict=False` skips line 2, reports it, and reads the lines around it."""
    path = write(tmp_path / "t.jsonl", [line(0, 1, 2), line(10, 1, LIMIT), line(20, 1, 3)])
    skipped: list[SkippedLine] = []
    workload = load_trace(path, block_size_tokens=BLOCK, strict=False, on_skip=skipped.append)
    assert [r.block_keys for r in workload] == [(1, 2), (1, 3)]
    assert [(s.line, s.reason) for s in skipped] == [
        (2, "field 'hash_ids' must hold ids below 2**256, got an integer of 257 bits")
    ]


def test_a_session_start_with_a_huge_id_loses_its_session(tmp_path: Path) -> None:
    """A lenient read skips the start and its session's later turn (built on it), and keeps another session."""
    lines = [line(0, 1, LIMIT, session_id="a"), line(5, 7, 8, session_id="b"), line(10, 4, 5, session_id="a")]
    skipped: list[SkippedLine] = []
    workload = load_trace(
        write(tmp_path / "t.jsonl", lines), block_size_tokens=BLOCK, strict=False, on_skip=skipped.append
    )
    assert [r.block_keys[:2] for r in workload] == [(7, 8)]
    assert [s.line for s in skipped] == [1, 3]
    assert "session 'a' lost its turn on line 1" in skipped[1].reason


@given(st.integers(min_value=-(2**300), max_value=2**300) | st.integers(min_value=LIMIT - 3, max_value=LIMIT + 3))
def test_an_id_reads_if_and_only_if_it_lies_in_0_to_2_256(key: int) -> None:
    """parse_record keeps an id in [0, 2**256) as it is and refuses any other, naming the field."""
    first = 2 if key == 1 else 1  # the other block's id, never the same (a repeated id is refused for that)
    fields = line(0, first, key)
    if 0 <= key < LIMIT:
        assert parse_record(fields, BLOCK).hash_ids == (first, key)
    else:
        with pytest.raises(ValueError, match=r"^field 'hash_ids' must hold "):
            parse_record(fields, BLOCK)


def test_a_turn_the_request_refuses_is_named_by_its_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backstop: with the reader's own bound lifted, `Request`'s refusal of the keys still names file and line
    (an InvalidRequestError with neither, before)."""
    monkeypatch.setattr(trace_record_module, "BLOCK_KEY_LIMIT", 2**512, raising=False)  # absent before the fix
    path = write(tmp_path / "t.jsonl", [line(0, 1, 2), line(10, 1, LIMIT)])
    with pytest.raises(TraceFormatError, match=rf"^{re.escape(str(path))}:2: block keys must be below 2\*\*256"):
        load_trace(path, block_size_tokens=BLOCK)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """main(argv) in-process: (exit status, stdout, stderr)."""
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_trace_stats_names_the_line_of_a_huge_id_and_skips_it_on_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`mooncake trace stats`: status 2 and file:line on stderr; with --skip-invalid, line 2 named and 2 requests."""
    path = write(tmp_path / "t.jsonl", [line(0, 1, 2), line(10, 1, LIMIT), line(20, 1, 3)])
    reason = "field 'hash_ids' must hold ids below 2**256, got an integer of 257 bits"
    status, out, err = run(capsys, "trace", "stats", str(path), "--json", "--block-size", str(BLOCK))
    assert (status, out, err) == (2, "", f"mooncake: error: {path}:2: {reason}\n")
    status, out, err = run(capsys, "trace", "stats", str(path), "--json", "--block-size", str(BLOCK), "--skip-invalid")
    assert (status, err) == (0, f"mooncake: skipped {path}:2: {reason}\n")
    assert json.loads(out)["num_requests"] == 2


# --------------------------------------------------------------------------- a turn before the latest start


@pytest.mark.parametrize(
    ("start", "named"),
    [({"session_id": "b"}, "session 'b'"), ({}, "a line without session_id")],
    ids=["another session", "no session"],
)
def test_a_turn_before_another_start_names_that_start(tmp_path: Path, start: dict[str, Any], named: str) -> None:
    """Session a's turn at 50 ms, below a start at 100 ms on line 2: the error names line 2's start as what it is."""
    lines = [line(0, 1, 2, session_id="a"), line(100, 1, 3, **start), line(50, 1, 4, session_id="a")]
    path = write(tmp_path / "t.jsonl", lines)
    with pytest.raises(TraceFormatError) as caught:
        load_trace(path, block_size_tokens=BLOCK)
    assert str(caught.value) == (
        f"{path}:3: turn of session 'a' arrives at 50 ms, before the latest start above it ({named}, line 2, "
        "100 ms): no turn may arrive before a start above it; write sessions grouped in start order, or lines in "
        "arrival order"
    )


SESSIONS = st.sampled_from(["a", "b", "c", None])


@given(st.lists(st.tuples(SESSIONS, st.integers(0, 30)), min_size=1, max_size=12))
def test_the_start_named_is_the_latest_start_above_the_turn(rows: list[tuple[str | None, int]]) -> None:
    """A later turn at or after its previous turn but before the latest start placed above it is refused, and the
    error names that start: its line, its session (never the turn's own) and its arrival."""
    assembler = TraceAssembler(BLOCK)
    previous: dict[str, int] = {}  # each session's latest turn's arrival
    latest: tuple[int, str | None, int] | None = None  # line, session, arrival of the latest start placed
    pattern = re.compile(r"before the latest start above it \((.*), line (\d+), (\d+) ms\)")
    for number, (session, timestamp) in enumerate(rows, start=1):
        fields = line(timestamp, 1, 2) if session is None else line(timestamp, 1, 2, session_id=session)
        is_start = session is None or session not in previous
        behind = not is_start and latest is not None and previous[str(session)] <= timestamp < latest[2]
        try:
            assembler.place(parse_record(fields, BLOCK), number)
        except ValueError as error:
            found = pattern.search(str(error))
            assert (found is not None) == behind, str(error)
            if found is not None and latest is not None:
                event("refused: before the latest start")
                named = "a line without session_id" if latest[1] is None else f"session {latest[1]!r}"
                assert found.groups() == (named, str(latest[0]), str(latest[2]))
                assert latest[1] != session
            continue
        assert not behind
        if is_start:
            latest = (number, session, timestamp)
        if session is not None:
            previous[session] = timestamp
        assembler.check_invariants()
