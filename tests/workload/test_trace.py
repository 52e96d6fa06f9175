"""Traces: round trips in both forms, gzip, aiperf's fields and sessions, line validation, lenient reading, speedup,
atomic writes, the real trace."""

from __future__ import annotations

import codecs
import gzip
import itertools
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from mooncake.errors import ConfigError, InvalidRequestError, TraceFormatError
from mooncake.types import BlockKey, Request, RequestId
from mooncake.workload import (
    TRACE_BLOCK_SIZE_TOKENS,
    TRACE_FORMS,
    SkippedLine,
    iter_trace,
    load_trace,
    text_request,
    trace_stats,
    write_trace,
)
from tests.strategies import requests

BLOCK = 4
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
REQUIRED = ("input_length", "output_length")  # timestamp and hash_ids may be left out (aiperf's reading)
GOOD: dict[str, Any] = {"timestamp": 0, "input_length": 5, "output_length": 3, "hash_ids": [1, 2]}

chained_requests = requests(block_size_tokens=BLOCK)
"""`requests` of the trace's block size (their keys chained ids, as a trace's are: none repeats within a request)."""


def line(**changes: Any) -> str:
    """A trace line: GOOD with `changes` applied; a change to `...` drops the field."""
    record = {name: value for name, value in {**GOOD, **changes}.items() if value is not ...}
    return json.dumps(record)


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(f"{text}\n" for text in lines), encoding="utf-8")
    return path


def request(index: int, arrival_s: float, input_length: int = 5, keys: tuple[int, ...] = (1, 2)) -> Request:
    return Request(
        request_id=RequestId(str(index)),
        arrival_s=arrival_s,
        input_length=input_length,
        output_length=3,
        block_keys=tuple(BlockKey(k) for k in keys),
    )


def files_in(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}  # hidden temporaries included


# --------------------------------------------------------------------------- round trip


@given(workload=chained_requests)
def test_reader_round_trips_writer_output(tmp_path_factory: pytest.TempPathFactory, workload: list[Request]) -> None:
    """write_trace then load_trace (same block size) gives equal requests; the count is returned."""
    path = tmp_path_factory.mktemp("roundtrip") / "trace.jsonl"
    assert write_trace(path, workload, block_size_tokens=BLOCK) == len(workload)
    read = [attrs.evolve(r, block_size_tokens=BLOCK) for r in workload]  # the reader says what its keys are of
    assert load_trace(path, block_size_tokens=BLOCK) == read
    assert list(iter_trace(path, block_size_tokens=BLOCK)) == read


@given(workload=chained_requests)
def test_rewriting_a_loaded_trace_is_byte_identical(
    tmp_path_factory: pytest.TempPathFactory, workload: list[Request]
) -> None:
    """write → load → write gives the same bytes: the format has one spelling."""
    directory = tmp_path_factory.mktemp("rewrite")
    first, second = directory / "a.jsonl", directory / "b.jsonl"
    write_trace(first, workload, block_size_tokens=BLOCK)
    write_trace(second, load_trace(first, block_size_tokens=BLOCK), block_size_tokens=BLOCK)
    assert first.read_bytes() == second.read_bytes()


def test_written_file_has_the_published_format(tmp_path: Path) -> None:
    """Each line is an object with exactly timestamp (int ms), input_length, output_length, hash_ids."""
    path = tmp_path / "trace.jsonl"
    workload = [request(0, 0.0), request(1, 1.25, input_length=8), request(2, 61.0015, input_length=1, keys=(7,))]
    write_trace(path, workload, block_size_tokens=BLOCK)
    records = [json.loads(text) for text in path.read_text(encoding="utf-8").splitlines()]
    assert [tuple(record) for record in records] == [FIELDS] * 3
    assert all(type(record["timestamp"]) is int for record in records)
    assert [record["timestamp"] for record in records] == [0, 1250, 61002]
    assert records[1] == {"timestamp": 1250, "input_length": 8, "output_length": 3, "hash_ids": [1, 2]}
    assert path.read_text(encoding="utf-8").endswith("}\n")


def test_rewriting_the_synthetic_trace_reproduces_it(synthetic_trace: Path, tmp_path: Path) -> None:
    """Loading the public trace and writing it back gives the original file byte for byte."""
    copy = tmp_path / "synthetic.jsonl"
    assert write_trace(copy, load_trace(synthetic_trace)) == 3993
    assert copy.read_bytes() == synthetic_trace.read_bytes()


def test_a_byte_order_mark_before_the_first_line_is_skipped(tmp_path: Path) -> None:
    """A file saved with a UTF-8 BOM (Windows editors) reads as without it; elsewhere a BOM is no JSON."""
    path = tmp_path / "bom.jsonl"
    path.write_bytes(codecs.BOM_UTF8 + f"{line()}\n{line(timestamp=5)}\n".encode())
    assert [r.arrival_s for r in load_trace(path, block_size_tokens=BLOCK)] == [0.0, 0.005]
    path.write_bytes(f"{line()}\n".encode() + codecs.BOM_UTF8 + f"{line(timestamp=5)}\n".encode())
    with pytest.raises(TraceFormatError, match=r"bom\.jsonl:2: invalid JSON: Unexpected UTF-8 BOM"):
        load_trace(path, block_size_tokens=BLOCK)


def test_synthetic_trace_has_3993_requests(synthetic_trace: Path) -> None:
    """The public synthetic trace reads as 3,993 valid requests with ids 0..3992 and 512-token blocks."""
    workload = load_trace(synthetic_trace)
    assert len(workload) == 3993
    assert [r.request_id for r in workload] == [str(i) for i in range(3993)]
    assert all(len(r.block_keys) == math.ceil(r.input_length / TRACE_BLOCK_SIZE_TOKENS) for r in workload)
    assert workload[0].arrival_s == 0.0
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(workload))


# --------------------------------------------------------------------------- malformed lines

MALFORMED: dict[str, tuple[str, str]] = {
    # id: (bad line, expected words in the reason)
    "truncated json": ('{"timestamp": 0, "input_length": 5,', "invalid JSON"),
    # where the line ends (its newline is no part of it: the column was 1, of the next line)
    "cut before its brace": (
        '{"timestamp": 0, "input_length": 5',
        "invalid JSON: Expecting ',' delimiter at column 35",
    ),
    "not json": ("timestamp=0", "invalid JSON"),
    "json array": ("[0, 5, 3, [1, 2]]", "expected a JSON object, got list"),
    # a JSON array of requests over several lines, pretty-printed or not: its first line fails
    "array's opening line": ("[", "invalid JSON: Expecting value at column 2 (a trace is JSON Lines: one object"),
    "array's first request": (f"[{line()},", "at column 78 (a trace is JSON Lines: one object per line, not a JSON"),
    "json number": ("42", "expected a JSON object, got int"),
    "json string": ('"hello"', "expected a JSON object, got str"),
    "json null": ("null", "expected a JSON object, got NoneType"),
    **{f"missing {name}": (line(**{name: ...}), f"missing field '{name}'") for name in REQUIRED},
    "output_length null": (line(output_length=None), "missing field 'output_length' (it is null)"),
    "timestamp string": (line(timestamp="0"), "field 'timestamp' must be a number"),
    "timestamp bool": (line(timestamp=True), "field 'timestamp' must be a number"),
    "input_length string": (line(input_length="5"), "field 'input_length' must be an integer"),
    "input_length float": (line(input_length=5.5), "field 'input_length' must be an integer, got 5.5"),
    "input_length bool": (line(input_length=True, hash_ids=[1]), "field 'input_length' must be an integer"),
    "output_length string": (line(output_length="3"), "field 'output_length' must be an integer"),
    "output_length float": (line(output_length=3.5), "field 'output_length' must be an integer"),
    "output_length bool": (line(output_length=False), "field 'output_length' must be an integer"),
    "hash_ids string": (line(hash_ids="1,2"), "field 'hash_ids' must be a list of integers"),
    "hash_ids object": (line(hash_ids={"0": 1}), "field 'hash_ids' must be a list of integers"),
    "hash_ids int": (line(hash_ids=1), "field 'hash_ids' must be a list of integers"),
    "hash_ids with string": (
        line(hash_ids=[1, "2"]),
        "field 'hash_ids' must be a list of integers, got an element '2'",
    ),
    "hash_ids with float": (line(hash_ids=[1, 2.5]), "field 'hash_ids' must be a list of integers, got an element 2.5"),
    "hash_ids with null": (
        line(hash_ids=[1, None]),
        "field 'hash_ids' must be a list of integers, got an element None",
    ),
    "aiperf messages": (line(messages=[{"role": "user", "content": "hi"}]), "field 'messages' is not supported"),
    "hash_ids with bool": (line(hash_ids=[1, True]), "field 'hash_ids' must be a list of integers"),
    "hash_ids nested": (line(hash_ids=[[1], [2]]), "field 'hash_ids' must be a list of integers"),
    "hash_ids negative": (line(hash_ids=[1, -2]), "non-negative"),
    "input_length zero": (line(input_length=0, hash_ids=[]), "field 'input_length' must be positive, got 0"),
    "input_length negative": (line(input_length=-5), "field 'input_length' must be positive, got -5"),
    "output_length zero": (line(output_length=0), "field 'output_length' must be positive, got 0"),
    "output_length negative": (line(output_length=-1), "field 'output_length' must be positive, got -1"),
    "timestamp negative": (line(timestamp=-1), "field 'timestamp' must be a number of ms in [0, 2**43], got -1"),
    "timestamp NaN": (line(timestamp=math.nan), "invalid JSON: NaN is not a JSON number"),
    "timestamp Infinity": (line(timestamp=math.inf), "invalid JSON: Infinity is not a JSON number"),
    "timestamp -Infinity": (line(timestamp=-math.inf), "invalid JSON: -Infinity is not a JSON number"),
    "timestamp 10**400": (
        line(timestamp=10**400),
        "field 'timestamp' must be a number of ms in [0, 2**43], got an integer",
    ),
    "timestamp 1e400": (
        line().replace('"timestamp": 0', '"timestamp": 1e400'),
        "must be a number of ms in [0, 2**43], got inf",
    ),
    "a 5,000-digit integer": (line().replace("[1, 2]", f"[1, {'9' * 5000}]"), "a number of over 4300 digits"),
    "200,000-deep nesting": (
        "[" * 200_000 + "]" * 200_000,
        "invalid JSON: arrays or objects nested deeper than 128 levels",
    ),
    "input_length 2**24 + 1": (line(input_length=2**24 + 1), "field 'input_length' must be at most 2**24 tokens"),
    "too few hash_ids": (line(hash_ids=[1]), "1 hash_ids for input_length 5: expected ceil(5/4) = 2"),
    "too many hash_ids": (line(hash_ids=[1, 2, 3]), "3 hash_ids for input_length 5: expected ceil(5/4) = 2"),
    "hash_ids of 16-token blocks": (
        line(input_length=1742, hash_ids=list(range(109))),
        "109 hash_ids for input_length 1742: expected ceil(1742/4) = 436 (the count fits 16-token blocks: "
        "block_size_tokens / --block-size 16)",
    ),
    "no hash_ids": (line(hash_ids=[]), "0 hash_ids for input_length 5"),
    "earlier timestamp": (line(timestamp=99), "timestamp 99 is earlier than the previous line's 100"),
    "a JSON array on one line": (f"[{line()}]", "expected a JSON object, got list (a trace is JSON Lines"),
    "a pretty-printed object": ("{", "(a trace is JSON Lines: each request's object on one line"),
    "a CSV row": ("2024-05-10 00:00:00.01,4808,10", "(a trace is JSON Lines, not CSV"),
}


@pytest.mark.parametrize(("magic", "name"), [(b"\xfd7zXZ\x00\x00", "xz"), (b"BZh91AY&SY", "bzip2")])
def test_a_file_compressed_other_than_gzip_is_named(tmp_path: Path, magic: bytes, name: str) -> None:
    """Only plain and gzip traces are read; an xz or bzip2 file's error says what it probably is."""
    path = tmp_path / "t.jsonl.x"
    path.write_bytes(magic + b"\x80\x00\xff\n")
    with pytest.raises(TraceFormatError, match=f"a {name}-compressed file"):
        load_trace(path)


@pytest.mark.parametrize(("bad", "reason"), MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_line_is_rejected_with_file_and_line(tmp_path: Path, bad: str, reason: str) -> None:
    """A malformed line raises TraceFormatError with its 1-based line (blank lines counted) and the file."""
    path = write_lines(tmp_path / "bad.jsonl", [line(timestamp=100), "", bad, line(timestamp=200)])
    with pytest.raises(TraceFormatError) as caught:
        load_trace(path, block_size_tokens=BLOCK)
    error = caught.value
    assert error.line == 3
    assert error.path == str(path)
    assert str(error).startswith(f"{path}:3: ")
    assert reason in error.reason
    assert isinstance(error, ValueError)


@pytest.mark.parametrize("position", [1, 2, 5])
def test_error_names_the_first_bad_line(tmp_path: Path, position: int) -> None:
    """With several bad lines the first one is reported, at its own line number."""
    lines = [line(timestamp=t) for t in range(6)]
    lines[position - 1] = "{"
    lines[-1] = "["
    with pytest.raises(TraceFormatError) as caught:
        load_trace(write_lines(tmp_path / "t.jsonl", lines), block_size_tokens=BLOCK)
    assert caught.value.line == position


def test_equal_timestamps_are_allowed(tmp_path: Path) -> None:
    """Timestamps need only be non-decreasing; float timestamps are accepted."""
    path = write_lines(tmp_path / "t.jsonl", [line(timestamp=5), line(timestamp=5), line(timestamp=5.5)])
    read = load_trace(path, block_size_tokens=BLOCK, on_caution=lambda _: None)  # 5.5 ms: a caution
    assert [r.arrival_s for r in read] == [0.005, 0.005, 0.0055]


def test_a_trace_timed_in_seconds_or_microseconds_reads_with_its_time_unit(tmp_path: Path) -> None:
    """`time_unit` "s" (Alibaba's Qwen-Bailian traces: the Mooncake fields, seconds to the millisecond) and "us"
    give the same arrivals as the trace in milliseconds; a millisecond trace with a fraction of a millisecond gets
    one caution naming the file, the line and the unit to try, and reads as written; an unknown unit is a
    ConfigError at the call."""
    seconds = write_lines(tmp_path / "s.jsonl", [line(timestamp=0), line(timestamp=61.114), line(timestamp=61.5)])
    micro = write_lines(tmp_path / "us.jsonl", [line(timestamp=t) for t in (0, 61_114_000, 61_500_000)])
    milli = write_lines(tmp_path / "ms.jsonl", [line(timestamp=t) for t in (0, 61_114, 61_500)])
    expected = [r.arrival_s for r in load_trace(milli, block_size_tokens=BLOCK)]
    assert expected == [0.0, 61.114, 61.5]
    assert [r.arrival_s for r in load_trace(seconds, block_size_tokens=BLOCK, time_unit="s")] == expected
    assert [r.arrival_s for r in load_trace(micro, block_size_tokens=BLOCK, time_unit="us")] == expected
    cautions: list[str] = []
    as_ms = load_trace(seconds, block_size_tokens=BLOCK, on_caution=cautions.append)
    assert [r.arrival_s for r in as_ms] == pytest.approx([0.0, 0.061114, 0.0615])
    assert len(cautions) == 1 and cautions[0].startswith(f"{seconds}:2: timestamp 61.114 has a fraction")
    assert "time_unit='s'" in cautions[0]
    load_trace(seconds, block_size_tokens=BLOCK, time_unit="s", on_caution=cautions.append)
    precise = write_lines(tmp_path / "precise.jsonl", [line(timestamp=0), line(timestamp=61.1140005)])  # to the us
    load_trace(precise, block_size_tokens=BLOCK, time_unit="s", on_caution=cautions.append)
    assert len(cautions) == 1  # read in seconds, fractions of a millisecond too: no second caution
    with pytest.raises(ConfigError, match="time_unit must be one of ms, s, us"):
        iter_trace(milli, time_unit="minutes")  # type: ignore[arg-type]
    with pytest.raises(TraceFormatError, match=r"must be a number of s in \[0, 8796093022.208\]"):
        load_trace(write_lines(tmp_path / "far.jsonl", [line(timestamp=2**43)]), time_unit="s")


def test_iter_trace_streams_up_to_the_bad_line(tmp_path: Path) -> None:
    """iter_trace yields the valid lines before a bad one, then raises at it."""
    path = write_lines(tmp_path / "t.jsonl", [line(timestamp=1), line(timestamp=2), line(output_length=0)])
    stream = iter_trace(path, block_size_tokens=BLOCK)
    assert next(stream).arrival_s == 0.001
    assert next(stream).arrival_s == 0.002
    with pytest.raises(TraceFormatError) as caught:
        next(stream)
    assert caught.value.line == 3


def test_load_trace_returns_nothing_on_error(tmp_path: Path) -> None:
    """load_trace raises on a bad last line instead of returning the valid lines before it."""
    path = write_lines(tmp_path / "t.jsonl", [line(timestamp=t) for t in range(100)] + ["oops"])
    result: list[Request] | None = None
    with pytest.raises(TraceFormatError):
        result = load_trace(path, block_size_tokens=BLOCK)
    assert result is None


def test_invalid_utf8_is_a_trace_format_error(tmp_path: Path) -> None:
    """A line that is not UTF-8 is reported as a TraceFormatError naming its line."""
    path = tmp_path / "t.jsonl"
    path.write_bytes(line().encode() + b"\n" + b'{"timestamp": 1, "x": "\xff"}\n')
    with pytest.raises(TraceFormatError) as caught:
        load_trace(path, block_size_tokens=BLOCK)
    assert caught.value.line == 2


@pytest.mark.parametrize("path", [3, None, b"t.jsonl"])
def test_a_path_that_is_not_one_is_a_config_error_at_the_call(path: object) -> None:
    """An int would be opened as a file descriptor ("Bad file descriptor", naming nothing)."""
    with pytest.raises(ConfigError, match=r"trace path must be a str or os\.PathLike"):
        iter_trace(path)  # type: ignore[arg-type]


def test_missing_file_raises_os_error(tmp_path: Path) -> None:
    """A trace that does not exist raises FileNotFoundError (I/O, not format)."""
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "absent.jsonl")


@pytest.mark.parametrize("kind", ["directory", "unreadable"])
def test_a_path_that_cannot_be_read_is_an_os_error_naming_it(tmp_path: Path, kind: str) -> None:
    """A directory, or a file whose reads fail (/proc/self/mem: EIO even for root), is an OSError with the path."""
    path = tmp_path if kind == "directory" else Path("/proc/self/mem")
    if not path.exists():
        pytest.skip(f"no {path} here")
    with pytest.raises(OSError) as caught:
        load_trace(path)
    assert caught.value.filename == str(path)


# Lines of anything: JSON objects with the trace's fields (and others) holding any JSON value, NaN and
# Infinity, numbers past a float and past 4300 digits, deep nesting, bytes that are not UTF-8.
NUMBERS = st.one_of(
    st.integers(-10, 10**6),
    st.integers(),
    st.floats(),
    st.sampled_from([2**43, 2**43 + 1, 2**53 + 1, 2**24 + 1, 10**400]),
)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | NUMBERS | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=10,
)
RECORDS = st.dictionaries(
    st.sampled_from([*FIELDS, "session_id", "delay", "text_input", "other"]),
    st.one_of(JSON_VALUES, st.lists(NUMBERS, max_size=4), st.sampled_from(["s", "t", ""])),
    max_size=7,
)
ANY_LINES = st.one_of(
    RECORDS.map(lambda record: json.dumps(record).encode()),
    st.binary(max_size=40),
    st.text(max_size=40).map(lambda text: text.encode("utf-8", "surrogatepass")),
    st.sampled_from([b"[" * 200_000, b"[" + b"1" * 5000 + b"]", b"NaN", b"\xff\xfe", b"\x1f\x8b\x08", b""]),
)


@example(lines=[b'"session_id'], block_size=1)  # a lenient read stops: which session lost the turn is unknown
@given(lines=st.lists(ANY_LINES, max_size=6), block_size=st.sampled_from([1, BLOCK, 512]))
def test_any_lines_read_or_fail_as_one_trace_format_error(
    tmp_path_factory: pytest.TempPathFactory, lines: list[bytes], block_size: int
) -> None:
    """Strict: requests or a TraceFormatError naming file and line, nothing else; lenient: the same, and an
    error only where the strict read failed too, at that line or a later one (a lenient read stops where going on
    would build wrong requests: a broken gzip stream, a turn whose session cannot be told, ...)."""
    path = tmp_path_factory.mktemp("any") / "t.jsonl"
    data = b"\n".join(lines)
    path.write_bytes(data)
    strict: TraceFormatError | None = None
    try:
        load_trace(path, block_size_tokens=block_size)
    except TraceFormatError as error:
        assert str(error).startswith(f"{path}:{error.line}: ") and "\n" not in str(error)
        strict = error
    skipped: list[SkippedLine] = []
    try:
        workload = load_trace(path, block_size_tokens=block_size, strict=False, on_skip=skipped.append)
    except TraceFormatError as error:
        assert str(error).startswith(f"{path}:{error.line}: ") and "\n" not in str(error)
        assert strict is not None and error.line >= strict.line, (strict, error)
        return
    assert all("\n" not in str(line) for line in skipped)
    assert len(workload) + len(skipped) <= data.count(b"\n") + 1


def test_blank_lines_are_skipped(tmp_path: Path) -> None:
    """Empty and whitespace-only lines (anywhere, CRLF too) are skipped; ids stay consecutive."""
    path = tmp_path / "t.jsonl"
    path.write_text(f"\n  \n{line(timestamp=1)}\r\n\t\n\n{line(timestamp=2)}\n\n", encoding="utf-8")
    workload = load_trace(path, block_size_tokens=BLOCK)
    assert [(r.request_id, r.arrival_s) for r in workload] == [("0", 0.001), ("1", 0.002)]


def test_empty_file_is_an_empty_trace(tmp_path: Path) -> None:
    """An empty file (or only blank lines) is a valid trace of no requests."""
    assert load_trace(write_lines(tmp_path / "t.jsonl", [])) == []
    assert load_trace(write_lines(tmp_path / "u.jsonl", ["", " "])) == []


def test_unknown_fields_are_ignored(tmp_path: Path) -> None:
    """Fields the format does not define are ignored (with one caution naming them)."""
    plain = write_lines(tmp_path / "plain.jsonl", [line()])
    extra = write_lines(
        tmp_path / "extra.jsonl", [line(session_id="s-1", tags=["a"], nested={"hash_ids": "no"}, timestamp_ms=5)]
    )
    cautions: list[str] = []
    read = load_trace(extra, block_size_tokens=BLOCK, on_caution=cautions.append)
    assert read == load_trace(plain, block_size_tokens=BLOCK)
    assert len(cautions) == 1 and "'nested', 'tags', 'timestamp_ms'" in cautions[0]


def test_fields_become_request_fields(tmp_path: Path) -> None:
    """timestamp ms → arrival_s, lengths and hash_ids as block_keys, ids in file order."""
    path = write_lines(tmp_path / "t.jsonl", [line(timestamp=1500, input_length=9, hash_ids=[4, 5, 2**70])])
    assert load_trace(path, block_size_tokens=BLOCK) == [
        Request(
            request_id=RequestId("0"),
            arrival_s=1.5,
            input_length=9,
            output_length=3,
            block_keys=(BlockKey(4), BlockKey(5), BlockKey(2**70)),
            block_size_tokens=BLOCK,
        )
    ]


def test_default_block_size_is_512(tmp_path: Path) -> None:
    """Without block_size_tokens, hash_ids are counted at 512 tokens per block."""
    path = write_lines(tmp_path / "t.jsonl", [line(input_length=513, hash_ids=[1, 2])])
    assert TRACE_BLOCK_SIZE_TOKENS == 512
    assert len(load_trace(path)[0].block_keys) == 2
    with pytest.raises(TraceFormatError):
        load_trace(path, block_size_tokens=BLOCK)


# --------------------------------------------------------------------------- options


def test_speedup_two_halves_arrivals(tmp_path: Path) -> None:
    """speedup=2.0 halves every arrival time and changes nothing else."""
    path = write_lines(tmp_path / "t.jsonl", [line(timestamp=t) for t in (0, 1000, 3000, 3001)])
    normal = load_trace(path, block_size_tokens=BLOCK)
    fast = load_trace(path, block_size_tokens=BLOCK, speedup=2.0)
    assert [r.arrival_s for r in fast] == [0.0, 0.5, 1.5, 1.5005]
    assert [(r.input_length, r.output_length, r.block_keys) for r in fast] == [
        (r.input_length, r.output_length, r.block_keys) for r in normal
    ]


@given(workload=chained_requests, speedup=st.floats(0.01, 1000) | st.integers(1, 10))
def test_speedup_divides_arrivals(
    tmp_path_factory: pytest.TempPathFactory, workload: list[Request], speedup: float
) -> None:
    """Any positive speedup divides every arrival time by it."""
    path = tmp_path_factory.mktemp("speedup") / "t.jsonl"
    write_trace(path, workload, block_size_tokens=BLOCK)
    fast = load_trace(path, block_size_tokens=BLOCK, speedup=speedup)
    assert [r.arrival_s for r in fast] == pytest.approx([r.arrival_s / speedup for r in workload], rel=1e-12)


BAD_SPEEDUPS = [0, 0.0, -1.0, math.inf, math.nan, True, "2", None]
BAD_BLOCK_SIZES = [0, -4, 4.0, True, "4", None]


@pytest.mark.parametrize("speedup", BAD_SPEEDUPS)
def test_invalid_speedup_is_a_config_error(tmp_path: Path, speedup: object) -> None:
    """load_trace rejects a non-positive, non-finite or non-numeric speedup, naming it."""
    path = write_lines(tmp_path / "t.jsonl", [line()])
    with pytest.raises(ConfigError, match="speedup"):
        load_trace(path, block_size_tokens=BLOCK, speedup=speedup)  # type: ignore[arg-type]


def test_writing_or_summarizing_what_is_not_a_request_names_it(tmp_path: Path) -> None:
    """write_trace and trace_stats take Requests: anything else is an InvalidRequestError naming its position
    and value (not an AttributeError), and no file is left behind."""
    with pytest.raises(InvalidRequestError, match=r"request 1: expected a mooncake\.types\.Request, got 2"):
        write_trace(tmp_path / "out.jsonl", [request(0, 0.0), 2], block_size_tokens=BLOCK)  # type: ignore[list-item]
    assert files_in(tmp_path) == set()
    with pytest.raises(InvalidRequestError, match=r"request 0: expected a mooncake\.types\.Request, got 1"):
        trace_stats([1])  # type: ignore[list-item]


def test_a_trace_is_written_in_its_requests_block_size_and_only_what_reads_back(tmp_path: Path) -> None:
    """Without a block size the trace takes its requests' (as they were keyed); a request keyed in another one
    than the trace's, or with a field past the reader's bounds (2**24 tokens, 2**43 ms), is an
    InvalidRequestError naming it, and nothing is written."""
    keyed = [
        attrs.evolve(request(i, float(i), input_length=40, keys=(1, 2, 3)), block_size_tokens=16) for i in range(2)
    ]
    assert write_trace(tmp_path / "sixteen.jsonl", keyed) == 2
    assert load_trace(tmp_path / "sixteen.jsonl", block_size_tokens=16)[0].block_keys == keyed[0].block_keys
    with pytest.raises(InvalidRequestError, match="keyed in 16-token blocks, the trace in 512-token blocks"):
        write_trace(tmp_path / "out.jsonl", keyed, block_size_tokens=512)
    mixed = [request(0, 0.0, input_length=40, keys=(1,)), keyed[1]]
    with pytest.raises(InvalidRequestError, match="request 1 is keyed in 16-token blocks"):
        write_trace(tmp_path / "out.jsonl", mixed)
    huge = request(0, 0.0, input_length=2**24 + 1, keys=tuple(range(-(-(2**24 + 1) // 512))))
    late = request(0, 2**43 / 1000 + 1, input_length=5, keys=(1,))
    for bad, message in (
        (huge, "request 0 cannot be read back from a trace: field 'input_length'"),
        (late, "request 0 arrives at .* s, past the 8796093022208 ms"),
    ):
        with pytest.raises(InvalidRequestError, match=message):
            write_trace(tmp_path / "out.jsonl", [bad])
    assert files_in(tmp_path) == {"sixteen.jsonl"}


@pytest.mark.parametrize("block_size", BAD_BLOCK_SIZES)
def test_invalid_block_size_is_a_config_error(tmp_path: Path, block_size: object) -> None:
    """load_trace and write_trace reject a block size that is not a positive int (None, for write_trace: the
    requests' own); nothing is written."""
    path = write_lines(tmp_path / "t.jsonl", [line()])
    with pytest.raises(ConfigError, match="block_size_tokens"):
        load_trace(path, block_size_tokens=block_size)  # type: ignore[arg-type]
    if block_size is not None:
        with pytest.raises(ConfigError, match="block_size_tokens"):
            write_trace(tmp_path / "out.jsonl", [request(0, 0.0)], block_size_tokens=block_size)  # type: ignore[arg-type]
    assert files_in(tmp_path) == {"t.jsonl"}


def test_iter_trace_rejects_invalid_options_when_called(tmp_path: Path) -> None:
    """iter_trace raises ConfigError for a bad option when called, not later when iterated."""
    path = write_lines(tmp_path / "t.jsonl", [line()])
    with pytest.raises(ConfigError):
        iter_trace(path, speedup=0)


# --------------------------------------------------------------------------- atomic writes


def bad_middle_requests() -> dict[str, list[Request]]:
    first, last = request(0, 1.0), request(3, 9.0)
    return {
        "decreasing arrival": [first, request(1, 2.0), request(2, 1.5), last],
        "too few keys": [first, request(1, 2.0, input_length=9), last],
        "too many keys": [first, request(1, 2.0, input_length=4), last],
    }


@pytest.mark.parametrize("case", bad_middle_requests().keys())
def test_failed_write_leaves_an_existing_file_untouched(tmp_path: Path, case: str) -> None:
    """An invalid request mid-way raises InvalidRequestError, keeps the old file and leaves no temporaries."""
    target = tmp_path / "trace.jsonl"
    target.write_text("old content\n", encoding="utf-8")
    with pytest.raises(InvalidRequestError, match=r"request [12]\b"):
        write_trace(target, bad_middle_requests()[case], block_size_tokens=BLOCK)
    assert target.read_text(encoding="utf-8") == "old content\n"
    assert files_in(tmp_path) == {"trace.jsonl"}


@pytest.mark.parametrize("case", bad_middle_requests().keys())
def test_failed_write_creates_nothing(tmp_path: Path, case: str) -> None:
    """A failed write to a new path leaves the directory empty."""
    with pytest.raises(InvalidRequestError):
        write_trace(tmp_path / "trace.jsonl", bad_middle_requests()[case], block_size_tokens=BLOCK)
    assert files_in(tmp_path) == set()


def test_failure_of_the_source_iterable_leaves_no_trace(tmp_path: Path) -> None:
    """An exception raised by the requests iterable mid-way propagates; the target and directory are untouched."""
    target = tmp_path / "trace.jsonl"
    target.write_text("old\n", encoding="utf-8")

    def source() -> Iterator[Request]:
        yield request(0, 0.0)
        raise RuntimeError("source broke")

    with pytest.raises(RuntimeError, match="source broke"):
        write_trace(target, source(), block_size_tokens=BLOCK)
    assert target.read_text(encoding="utf-8") == "old\n"
    assert files_in(tmp_path) == {"trace.jsonl"}


def test_successful_write_replaces_the_file(tmp_path: Path) -> None:
    """A valid write replaces an existing file whole and leaves no temporaries."""
    target = tmp_path / "trace.jsonl"
    target.write_text("old content that is longer than the new one\n" * 50, encoding="utf-8")
    assert write_trace(target, iter([request(0, 0.0)]), block_size_tokens=BLOCK) == 1
    assert target.read_text(encoding="utf-8") == line() + "\n"
    assert files_in(tmp_path) == {"trace.jsonl"}


def test_writing_nothing_gives_an_empty_file(tmp_path: Path) -> None:
    """Writing no requests creates an empty trace that loads as no requests."""
    target = tmp_path / "empty.jsonl"
    assert write_trace(str(target), []) == 0
    assert target.read_bytes() == b""
    assert load_trace(str(target)) == []


def test_write_into_a_missing_directory_raises_and_creates_nothing(tmp_path: Path) -> None:
    """A target in a directory that does not exist raises FileNotFoundError."""
    with pytest.raises(FileNotFoundError):
        write_trace(tmp_path / "absent" / "trace.jsonl", [request(0, 0.0)], block_size_tokens=BLOCK)
    assert files_in(tmp_path) == set()


def test_a_write_beneath_a_file_names_the_target_and_leaves_nothing(tmp_path: Path) -> None:
    """A parent of the target that is a regular file fails the write naming the target: removing the temporary
    failed the same way and replaced that error with one naming the hidden sibling."""
    (tmp_path / "afile").write_text("mine", encoding="utf-8")
    target = tmp_path / "afile" / "g.jsonl"
    with pytest.raises(NotADirectoryError) as caught:
        write_trace(target, [request(0, 0.0)], block_size_tokens=BLOCK)
    assert caught.value.filename == str(target)
    assert files_in(tmp_path) == {"afile"} and (tmp_path / "afile").read_text(encoding="utf-8") == "mine"


# --------------------------------------------------------------------------- gzip


def gzip_bytes(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


def test_gzip_trace_reads_like_the_plain_one(tmp_path: Path) -> None:
    """A gzip-compressed trace gives the same requests as its plain text."""
    plain = write_lines(tmp_path / "t.jsonl", [line(timestamp=t) for t in (0, 5, 9)])
    packed = tmp_path / "t.jsonl.gz"
    packed.write_bytes(gzip_bytes(plain.read_bytes()))
    assert load_trace(packed, block_size_tokens=BLOCK) == load_trace(plain, block_size_tokens=BLOCK)


def test_the_reader_goes_by_content_not_name(tmp_path: Path) -> None:
    """gzip bytes under a .jsonl name and plain text under a .gz name both read."""
    text = (line(timestamp=1) + "\n").encode()
    disguised, plain_gz = tmp_path / "packed.jsonl", tmp_path / "plain.jsonl.gz"
    disguised.write_bytes(gzip_bytes(text))
    plain_gz.write_bytes(text)
    assert load_trace(disguised, block_size_tokens=BLOCK) == load_trace(plain_gz, block_size_tokens=BLOCK)


@given(workload=chained_requests)
def test_gz_names_are_written_compressed_and_repeatably(
    tmp_path_factory: pytest.TempPathFactory, workload: list[Request]
) -> None:
    """A .gz target gets the plain trace gzip-compressed, the same bytes on every write."""
    directory = tmp_path_factory.mktemp("gz")
    plain, first, second = directory / "t.jsonl", directory / "a.jsonl.gz", directory / "b.jsonl.gz"
    for path in (plain, first, second):
        write_trace(path, workload, block_size_tokens=BLOCK)
    assert first.read_bytes()[:2] == b"\x1f\x8b"
    assert first.read_bytes() == second.read_bytes()
    assert gzip.decompress(first.read_bytes()) == plain.read_bytes()


@pytest.mark.parametrize("damage", ["truncated", "corrupted"])
@pytest.mark.parametrize("strict", [True, False])
def test_a_broken_gzip_stream_is_a_trace_format_error(tmp_path: Path, damage: str, strict: bool) -> None:
    """A truncated or corrupted gzip stream raises TraceFormatError, lenient or not: it is no line to skip."""
    data = gzip_bytes("".join(line(timestamp=t) + "\n" for t in range(2000)).encode())
    broken = data[: len(data) // 2] if damage == "truncated" else data[:40] + bytes(64) + data[104:]
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(broken)
    with pytest.raises(TraceFormatError, match="broken gzip stream") as caught:
        load_trace(path, block_size_tokens=BLOCK, strict=strict, on_skip=lambda _: None)
    assert caught.value.path == str(path)


def test_a_failed_gz_write_leaves_nothing(tmp_path: Path) -> None:
    """A bad request mid-way through a gzip write leaves the directory as it was."""
    with pytest.raises(InvalidRequestError):
        write_trace(tmp_path / "t.jsonl.gz", bad_middle_requests()["decreasing arrival"], block_size_tokens=BLOCK)
    assert files_in(tmp_path) == set()


# --------------------------------------------------------------------------- the two forms


@st.composite
def mixed_requests(draw: st.DrawFn) -> list[Request]:
    """Requests in arrival order, whole-ms arrivals, some keyed by hash ids and some text prompts."""
    keyed = draw(chained_requests)
    out = []
    for request in keyed:
        if draw(st.booleans()):
            text = draw(st.text(min_size=1, max_size=30))  # Hypothesis leaves out surrogates: always encodable
            request = text_request(
                text,
                request_id=request.request_id,
                arrival_s=request.arrival_s,
                output_length=request.output_length,
                block_size_tokens=BLOCK,
            )
        out.append(request)
    return out


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
@given(workload=mixed_requests())
def test_both_forms_round_trip_what_they_can_express(
    tmp_path_factory: pytest.TempPathFactory, suffix: str, workload: list[Request]
) -> None:
    """aiperf's form gives back every request, text included; Mooncake's gives them back without their tokens."""
    directory = tmp_path_factory.mktemp("forms")
    for form in TRACE_FORMS:
        path = directory / f"{form}{suffix}"
        assert write_trace(path, workload, block_size_tokens=BLOCK, form=form) == len(workload)
        back = load_trace(path, block_size_tokens=BLOCK)
        read = [attrs.evolve(r, block_size_tokens=BLOCK) for r in workload]
        expected = read if form == "aiperf" else [attrs.evolve(r, tokens=None) for r in read]
        assert back == expected


def test_the_aiperf_form_writes_text_prompts_as_text_input(tmp_path: Path) -> None:
    """A text prompt is timestamp, text_input, output_length; other requests keep the four Mooncake fields."""
    workload = [
        text_request(
            "What is the capital of France?", request_id="0", arrival_s=0.0, output_length=20, block_size_tokens=BLOCK
        ),
        request(1, 0.5),
    ]
    path = tmp_path / "t.jsonl"
    write_trace(path, workload, block_size_tokens=BLOCK, form="aiperf")
    records = [json.loads(text) for text in path.read_text(encoding="utf-8").splitlines()]
    assert records[0] == {"timestamp": 0, "text_input": "What is the capital of France?", "output_length": 20}
    assert tuple(records[1]) == FIELDS
    write_trace(path, workload, block_size_tokens=BLOCK)
    assert [tuple(json.loads(text)) for text in path.read_text(encoding="utf-8").splitlines()] == [FIELDS] * 2


def test_tokens_that_are_not_byte_rule_text_are_written_as_hash_ids(tmp_path: Path) -> None:
    """Tokens that are no text, or text keyed otherwise, go out as input_length and hash_ids."""
    text = text_request("abcdef", request_id="0", arrival_s=0.0, output_length=1, block_size_tokens=BLOCK)
    workload = [
        attrs.evolve(text, block_keys=(1, 2)),  # the text's bytes, other keys
        attrs.evolve(text, request_id=RequestId("1"), tokens=np.array([300, 1, 2, 3, 4, 5])),  # not bytes
        attrs.evolve(text, request_id=RequestId("2"), tokens=np.array([0xFF] * 6)),  # bytes, not UTF-8
    ]
    path = tmp_path / "t.jsonl"
    write_trace(path, workload, block_size_tokens=BLOCK, form="aiperf")
    assert all("hash_ids" in json.loads(text) for text in path.read_text(encoding="utf-8").splitlines())


@pytest.mark.parametrize("form", ["vllm", "", None, "AIPERF"])
def test_an_unknown_form_is_a_config_error(tmp_path: Path, form: object) -> None:
    """write_trace knows the forms in TRACE_FORMS only, and writes nothing otherwise."""
    with pytest.raises(ConfigError, match="form"):
        write_trace(tmp_path / "t.jsonl", [request(0, 0.0)], form=form)  # type: ignore[arg-type]
    assert files_in(tmp_path) == set()


# --------------------------------------------------------------------------- aiperf traces


def test_aiperf_text_inputs_without_timestamps_arrive_together(tmp_path: Path) -> None:
    """aiperf's custom-prompt trace (text_input and output_length only) reads as text prompts all at 0 s."""
    texts = ["What is the capital of France?", "Explain quantum computing in simple terms."]
    path = write_lines(tmp_path / "t.jsonl", [json.dumps({"text_input": t, "output_length": 20}) for t in texts])
    workload = load_trace(path, block_size_tokens=BLOCK)
    assert workload == [
        text_request(t, request_id=str(i), arrival_s=0.0, output_length=20, block_size_tokens=BLOCK)
        for i, t in enumerate(texts)
    ]


def test_aiperf_sessions_with_timestamps(tmp_path: Path) -> None:
    """Turns that carry timestamps arrive then; grouped sessions come out in arrival order, each turn whole."""
    lines = [
        {"session_id": "a", "timestamp": 0, "input_length": 8, "output_length": 2, "hash_ids": [1, 2]},
        {"session_id": "a", "timestamp": 3000, "input_length": 1, "output_length": 2},
        {"session_id": "b", "timestamp": 1000, "input_length": 4, "output_length": 1, "hash_ids": [1]},
    ]
    workload = load_trace(write_lines(tmp_path / "t.jsonl", [json.dumps(x) for x in lines]), block_size_tokens=BLOCK)
    assert [(r.request_id, r.arrival_s, r.input_length) for r in workload] == [
        ("0", 0.0, 8),
        ("1", 1.0, 4),
        ("2", 3.0, 11),
    ]
    assert workload[2].block_keys[:2] == (1, 2)


def test_aiperf_sessions_without_timestamps(tmp_path: Path) -> None:
    """aiperf's multi-turn example: the first turn at the start, the next `delay` ms after it."""
    lines = [
        {"session_id": "abc-123", "input_length": 300, "output_length": 40},
        {"session_id": "abc-123", "delay": 2, "input_length": 150, "output_length": 20},
    ]
    workload = load_trace(write_lines(tmp_path / "t.jsonl", [json.dumps(x) for x in lines]))
    assert [(r.arrival_s, r.input_length, r.output_length) for r in workload] == [(0.0, 300, 40), (0.002, 490, 20)]


def test_held_turns_come_out_as_soon_as_the_trace_passes_them(tmp_path: Path) -> None:
    """A later turn waits only until a start passes its arrival: it is yielded before a bad line further on."""
    lines = [
        json.dumps({"session_id": "a", "timestamp": 0, **{k: GOOD[k] for k in FIELDS[1:]}}),
        json.dumps({"session_id": "a", "delay": 5000, "input_length": 1, "output_length": 1}),
        line(timestamp=6000),
        "oops",
    ]
    stream = iter_trace(write_lines(tmp_path / "t.jsonl", lines), block_size_tokens=BLOCK)
    assert [next(stream).arrival_s for _ in range(3)] == [0.0, 5.0, 6.0]
    with pytest.raises(TraceFormatError) as caught:
        next(stream)
    assert caught.value.line == 4


@st.composite
def session_traces(draw: st.DrawFn) -> list[list[dict[str, Any]]]:
    """Sessions in start order: a first turn with a timestamp (or none), later turns by delay (or timestamp)."""
    starts = sorted(draw(st.lists(st.integers(0, 5000), min_size=1, max_size=5)))
    sessions = []
    for number, start in enumerate(starts):
        first = {"session_id": f"s{number}", "input_length": draw(st.integers(1, 12)), "output_length": 2}
        if number == 0 or draw(st.booleans()) or start != starts[number - 1]:
            first["timestamp"] = start
        turns, arrival = [first], start
        for _ in range(draw(st.integers(0, 3))):
            gap = draw(st.integers(0, 4000))
            arrival += gap
            turn = {"session_id": f"s{number}", "input_length": draw(st.integers(1, 6)), "output_length": 1}
            turn |= {"timestamp": arrival} if draw(st.booleans()) else {"delay": gap}
            turns.append(turn)
        sessions.append(turns)
    return sessions


def expected_turns(sessions: list[list[dict[str, Any]]]) -> list[tuple[float, int, int, int]]:
    """(arrival ms, input, output, line) of each turn in grouped file order, computed turn by turn."""
    out, line_number, previous_start = [], 0, 0
    for turns in sessions:
        arrival, input_length = turns[0].get("timestamp", previous_start), 0
        previous_start = arrival
        for index, turn in enumerate(turns):
            line_number += 1
            if index:
                arrival = turn.get("timestamp", arrival + turn.get("delay", 0))
                input_length += turns[index - 1]["output_length"]
            input_length += turn["input_length"]
            out.append((arrival, input_length, turn["output_length"], line_number))
    return out


@given(sessions=session_traces())
def test_grouped_sessions_come_out_in_arrival_order(
    tmp_path_factory: pytest.TempPathFactory, sessions: list[list[dict[str, Any]]]
) -> None:
    """Sessions written grouped read as the turn-by-turn model, sorted by arrival then line."""
    path = tmp_path_factory.mktemp("sessions") / "t.jsonl"
    write_lines(path, [json.dumps(turn) for turns in sessions for turn in turns])
    workload = load_trace(path, block_size_tokens=BLOCK)
    expected = sorted(expected_turns(sessions), key=lambda t: (t[0], t[3]))
    assert [(r.arrival_s, r.input_length, r.output_length) for r in workload] == [
        (ms / 1000, length, output) for ms, length, output, _ in expected
    ]
    assert [r.request_id for r in workload] == [str(i) for i in range(len(workload))]


@given(sessions=session_traces())
def test_sessions_interleaved_in_arrival_order_read_the_same(
    tmp_path_factory: pytest.TempPathFactory, sessions: list[list[dict[str, Any]]]
) -> None:
    """The same sessions written line by line in arrival order give the same requests (up to ties' order)."""
    directory = tmp_path_factory.mktemp("interleaved")
    order = sorted(expected_turns(sessions), key=lambda t: t[0])
    flat = [turn for turns in sessions for turn in turns]
    grouped = load_trace(write_lines(directory / "g.jsonl", [json.dumps(t) for t in flat]), block_size_tokens=BLOCK)
    interleaved = load_trace(
        write_lines(directory / "i.jsonl", [json.dumps(flat[t[3] - 1]) for t in order]), block_size_tokens=BLOCK
    )

    def shape(workload: list[Request]) -> list[tuple[float, int, int]]:
        return sorted((r.arrival_s, r.input_length, r.output_length) for r in workload)

    assert shape(interleaved) == shape(grouped)
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(interleaved))


# --------------------------------------------------------------------------- lenient reading


@pytest.mark.parametrize(("bad", "reason"), MALFORMED.values(), ids=MALFORMED.keys())
def test_lenient_reading_skips_and_reports_each_bad_line(tmp_path: Path, bad: str, reason: str) -> None:
    """strict=False leaves the bad line out, reports its file, line and reason, and keeps ids consecutive."""
    path = write_lines(tmp_path / "bad.jsonl", [line(timestamp=100), "", bad, line(timestamp=200)])
    skipped: list[SkippedLine] = []
    workload = load_trace(path, block_size_tokens=BLOCK, strict=False, on_skip=skipped.append)
    assert [(r.request_id, r.arrival_s) for r in workload] == [("0", 0.1), ("1", 0.2)]
    assert [(s.path, s.line) for s in skipped] == [(str(path), 3)]
    assert reason in skipped[0].reason
    assert str(skipped[0]) == f"{path}:3: {skipped[0].reason}"


def test_lenient_reading_without_a_callback_warns(tmp_path: Path) -> None:
    """With no on_skip, each skipped line is a warning naming file and line: never silent."""
    path = write_lines(tmp_path / "t.jsonl", ["{", line(timestamp=1), "[1]"])
    with pytest.warns(UserWarning) as caught:
        workload = load_trace(path, block_size_tokens=BLOCK, strict=False)
    assert len(workload) == 1
    assert [str(w.message).split(": ")[0] for w in caught] == [f"skipped {path}:1", f"skipped {path}:3"]


def test_a_session_loses_its_turns_after_a_skipped_one(tmp_path: Path) -> None:
    """A turn after a skipped turn of its session is skipped too, naming the first; other sessions stay."""
    lines = [
        {"session_id": "a", "timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1]},
        {"session_id": "a", "delay": -1, "input_length": 1, "output_length": 1},
        {"session_id": "b", "timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [2]},
        {"session_id": "a", "delay": 1, "input_length": 1, "output_length": 1},
    ]
    skipped: list[SkippedLine] = []
    path = write_lines(tmp_path / "t.jsonl", [json.dumps(x) for x in lines])
    workload = load_trace(path, block_size_tokens=BLOCK, strict=False, on_skip=skipped.append)
    assert [r.block_keys for r in workload] == [(1,), (2,)]
    assert [s.line for s in skipped] == [2, 4]
    assert "'delay'" in skipped[0].reason
    assert "lost its turn on line 2" in skipped[1].reason


def test_strict_is_the_default_and_a_bool(tmp_path: Path) -> None:
    """Without strict=False a bad line raises; a strict that is not a bool is a ConfigError."""
    path = write_lines(tmp_path / "t.jsonl", ["{"])
    with pytest.raises(TraceFormatError):
        load_trace(path)
    with pytest.raises(ConfigError, match="strict"):
        iter_trace(path, strict="no")  # type: ignore[arg-type]


@pytest.mark.parametrize("cut", [8, 4000])  # the trailer only; mid-stream
def test_a_broken_gzip_stream_is_reported_at_the_line_it_broke(tmp_path: Path, cut: int) -> None:
    """The error names the line after the last one read: the one the broken stream could not give."""
    data = gzip_bytes("".join(line(timestamp=t) + "\n" for t in range(2000)).encode())
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(data[:-cut])
    read = []
    with pytest.raises(TraceFormatError, match="broken gzip stream") as caught:
        for request in iter_trace(path, block_size_tokens=BLOCK):
            read.append(request)
    assert caught.value.line == len(read) + 1
    if cut == 8:
        assert caught.value.line == 2001


def test_a_gz_trace_carries_no_name_and_no_time(tmp_path: Path) -> None:
    """The gzip header's mtime is 0 and no file name is stored: the bytes never depend on when or where."""
    request = text_request("abc", request_id="0", arrival_s=0.0, output_length=1, block_size_tokens=BLOCK)
    path = tmp_path / "t.jsonl.gz"
    write_trace(path, [request], block_size_tokens=BLOCK)
    header = path.read_bytes()[:10]
    assert header[:2] == b"\x1f\x8b" and header[3] & 0x08 == 0  # FNAME unset
    assert header[4:8] == bytes(4)  # MTIME 0


@pytest.mark.parametrize("name", ["", ".", ".."])
def test_a_path_that_names_no_file_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    sub = tmp_path / "d"
    sub.mkdir()
    monkeypatch.chdir(sub)  # "" and "." name this directory, ".." the test's own
    with pytest.raises(ConfigError, match="must name a file"):
        write_trace(name, [], block_size_tokens=BLOCK)
    assert list(sub.iterdir()) == []


def test_tokens_past_a_byte_are_not_written_as_text_even_when_they_wrap_to_it(tmp_path: Path) -> None:
    """Tokens 256 + b (not bytes) whose low bytes spell the text its keys are of: hash_ids, not text_input."""
    text = text_request("abcdef", request_id="0", arrival_s=0.0, output_length=1, block_size_tokens=BLOCK)
    wrapped = attrs.evolve(
        text, request_id=RequestId("1"), tokens=np.frombuffer(b"abcdef", np.uint8).astype(np.int64) + 256
    )
    path = tmp_path / "t.jsonl"
    write_trace(path, [wrapped], block_size_tokens=BLOCK, form="aiperf")
    assert "hash_ids" in json.loads(path.read_text(encoding="utf-8"))
