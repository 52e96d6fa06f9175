"""The workload's entry points quote what they were given through `_checks.shown`, as tests/test_shown_everywhere.py
checks for the others: however large or long the value, and however long a session id a trace holds.

Python refuses to repr an integer past 4,300 digits, so a message that quoted one with `!r` escaped as a bare
ValueError, not the named error; a deeply nested list's repr raised RecursionError; a 500-character string, and a
session id of a megabyte read from a trace line, were printed whole (a 1,000,124-character `TraceFormatError`).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mooncake.errors import ConfigError, InvalidRequestError, MooncakeError, TraceFormatError
from mooncake.types import Request, RequestId
from mooncake.workload import iter_trace, load_trace, trace_stats, write_trace
from mooncake.workload.trace import SkippedLine
from tests.shown_cases import ALL, BOUND, HUGE, NEGATIVE, TEXT, entry_params, refused_briefly

PATH = "trace.jsonl"  # never opened: the options are checked at the call
NUL_PATH = "\0" + TEXT  # a str path open() would refuse with a bare ValueError
DIRECTORY_PATH = TEXT + "/"  # a str path that names no file


def deep_list(depth: int = 200_000) -> list[Any]:
    """A list nested past Python's recursion: its repr raises RecursionError."""
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


ENTRIES: list[tuple[str, Callable[[Any], object], type[MooncakeError], tuple[Any, ...]]] = [
    ("iter_trace path", iter_trace, ConfigError, (HUGE, NEGATIVE, NUL_PATH)),
    ("iter_trace on_skip", lambda v: iter_trace(PATH, on_skip=v), ConfigError, ALL),
    ("iter_trace on_caution", lambda v: iter_trace(PATH, on_caution=v), ConfigError, ALL),
    ("iter_trace strict", lambda v: iter_trace(PATH, strict=v), ConfigError, ALL),
    ("iter_trace sort", lambda v: iter_trace(PATH, sort=v), ConfigError, ALL),
    ("iter_trace time_unit", lambda v: iter_trace(PATH, time_unit=v), ConfigError, ALL),
    ("load_trace path", load_trace, ConfigError, (HUGE, NEGATIVE, NUL_PATH)),
    ("write_trace form", lambda v: write_trace(os.devnull, [], form=v), ConfigError, ALL),
    ("write_trace path", lambda v: write_trace(v, []), ConfigError, (HUGE, NEGATIVE, NUL_PATH, DIRECTORY_PATH)),
    ("write_trace request", lambda v: write_trace(os.devnull, [v]), InvalidRequestError, ALL),
    ("trace_stats request", lambda v: trace_stats([v]), InvalidRequestError, (*ALL, deep_list())),
]


@pytest.mark.parametrize(("call", "error", "value"), entry_params(ENTRIES))
def test_a_huge_or_long_value_is_the_named_error_in_a_short_message(
    call: Callable[[Any], object], error: type[MooncakeError], value: Any
) -> None:
    """10**5000 and -10**5000 (whose repr Python refuses), a 500-character string (a path holding a NUL byte or
    naming a directory, where a string is a path) and, for `trace_stats`, a list nested too deep to repr: each is
    the entry's own error (a `MooncakeError`), its message at most `BOUND` characters."""
    refused_briefly(lambda: call(value), error)


SESSION_BOUND = 400
"""The longest reason naming sessions may give: its words plus two session ids quoted by `shown` (a turn before
the latest start names its own session and the start's)."""

LONG_ID = "s" * 1_000_000
OTHER_ID = "t" * 1_000_000


def line(**fields: Any) -> dict[str, Any]:
    return {"input_length": 600, "output_length": 5} | fields


# id: (the lines of a trace whose sessions have ids of a megabyte, read strict, sort=True or not)
LONG_SESSIONS: dict[str, tuple[list[dict[str, Any]], bool]] = {
    "before its previous turn": (
        [line(session_id=LONG_ID, timestamp=10), line(session_id=LONG_ID, timestamp=5)],
        False,
    ),
    "before the latest start": (
        [
            line(session_id=LONG_ID, timestamp=10),
            line(session_id=OTHER_ID, timestamp=20),
            line(session_id=LONG_ID, timestamp=15),
        ],
        False,
    ),
    "a delay past 2**43 ms": (
        [line(session_id=LONG_ID, timestamp=2**43), line(session_id=LONG_ID, delay=1)],
        False,
    ),
    "a conversation past 2**24 tokens": (
        [line(session_id=LONG_ID, timestamp=0, input_length=2**24), line(session_id=LONG_ID, timestamp=1)],
        False,
    ),
    "read sorted": ([line(session_id=LONG_ID, timestamp=0)], True),
}


@pytest.mark.parametrize(("lines", "sort"), LONG_SESSIONS.values(), ids=LONG_SESSIONS.keys())
def test_a_megabyte_session_id_is_quoted_short(tmp_path: Path, lines: list[dict[str, Any]], sort: bool) -> None:
    """A session id of a megabyte, read from a trace, is quoted cut short in the `TraceFormatError` that names
    its session (it was quoted whole: a message of a million characters)."""
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in lines), encoding="utf-8")
    with pytest.raises(TraceFormatError) as raised:
        load_trace(path, sort=sort)
    assert len(raised.value.reason) <= SESSION_BOUND, raised.value.reason[:1000]


def test_a_lenient_read_says_a_megabyte_session_lost_its_turn_in_a_short_reason(tmp_path: Path) -> None:
    """The turn of a session whose earlier turn was skipped is skipped too, the reason quoting its id cut short."""
    path = tmp_path / "t.jsonl"
    lines = [line(session_id=LONG_ID, timestamp=0, output_length=0), line(session_id=LONG_ID, timestamp=1)]
    path.write_text("".join(json.dumps(record) + "\n" for record in lines), encoding="utf-8")
    skipped: list[SkippedLine] = []
    assert load_trace(path, strict=False, on_skip=skipped.append) == []
    assert [entry.line for entry in skipped] == [1, 2]
    assert "lost its turn on line 1" in skipped[1].reason
    assert all(len(entry.reason) <= SESSION_BOUND for entry in skipped)


@pytest.mark.parametrize(
    "unknown", [{TEXT * 2000: 1}, {f"field{i}": i for i in range(10_000)}], ids=["a long name", "many names"]
)
def test_the_caution_at_a_field_neither_format_defines_is_short(tmp_path: Path, unknown: dict[str, int]) -> None:
    """The caution naming a line's unknown fields quotes a long name cut short, and names a few of many."""
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(line(timestamp=0) | unknown) + "\n", encoding="utf-8")
    cautions: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(load_trace(path, on_caution=cautions.append)) == 1
    [caution] = cautions
    assert "not a trace field" in caution
    assert len(caution) <= BOUND + len(os.fspath(path)), caution[:1000]


def test_the_writer_quotes_a_megabyte_request_id_short() -> None:
    """A request the writer refuses is named by its id cut short, as `Request` names it."""
    first = Request(request_id=RequestId("a"), arrival_s=1.0, input_length=1, output_length=1, block_keys=(1,))
    late = Request(request_id=RequestId(LONG_ID), arrival_s=0.0, input_length=1, output_length=1, block_keys=(2,))
    with pytest.raises(InvalidRequestError) as raised:
        write_trace(os.devnull, [first, late])
    assert "before the previous one" in str(raised.value)
    assert len(str(raised.value)) <= BOUND
