"""Mooncake-format traces: round trips, line validation, speedup, atomic writes, the real trace."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.errors import ConfigError, InvalidRequestError, TraceFormatError
from mooncake.types import BlockKey, Request, RequestId
from mooncake.workload import TRACE_BLOCK_SIZE_TOKENS, iter_trace, load_trace, write_trace
from tests.strategies import requests

BLOCK = 4
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
GOOD: dict[str, Any] = {"timestamp": 0, "input_length": 5, "output_length": 3, "hash_ids": [1, 2]}


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


@given(workload=requests(block_size_tokens=BLOCK))
def test_reader_round_trips_writer_output(tmp_path_factory: pytest.TempPathFactory, workload: list[Request]) -> None:
    """write_trace then load_trace (same block size) gives equal requests; the count is returned."""
    path = tmp_path_factory.mktemp("roundtrip") / "trace.jsonl"
    assert write_trace(path, workload, block_size_tokens=BLOCK) == len(workload)
    assert load_trace(path, block_size_tokens=BLOCK) == workload
    assert list(iter_trace(path, block_size_tokens=BLOCK)) == workload


@given(workload=requests(block_size_tokens=BLOCK))
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
    "not json": ("timestamp=0", "invalid JSON"),
    "json array": ("[0, 5, 3, [1, 2]]", "expected a JSON object, got list"),
    "json number": ("42", "expected a JSON object, got int"),
    "json string": ('"hello"', "expected a JSON object, got str"),
    "json null": ("null", "expected a JSON object, got NoneType"),
    **{f"missing {name}": (line(**{name: ...}), f"missing field '{name}'") for name in FIELDS},
    "timestamp string": (line(timestamp="0"), "field 'timestamp' must be a number"),
    "timestamp bool": (line(timestamp=True), "field 'timestamp' must be a number"),
    "timestamp null": (line(timestamp=None), "field 'timestamp' must be a number"),
    "input_length string": (line(input_length="5"), "field 'input_length' must be an integer"),
    "input_length float": (line(input_length=5.0), "field 'input_length' must be an integer"),
    "input_length bool": (line(input_length=True, hash_ids=[1]), "field 'input_length' must be an integer"),
    "output_length string": (line(output_length="3"), "field 'output_length' must be an integer"),
    "output_length float": (line(output_length=3.5), "field 'output_length' must be an integer"),
    "output_length bool": (line(output_length=False), "field 'output_length' must be an integer"),
    "hash_ids string": (line(hash_ids="1,2"), "field 'hash_ids' must be a list of integers"),
    "hash_ids object": (line(hash_ids={"0": 1}), "field 'hash_ids' must be a list of integers"),
    "hash_ids int": (line(hash_ids=1), "field 'hash_ids' must be a list of integers"),
    "hash_ids null": (line(hash_ids=None), "field 'hash_ids' must be a list of integers"),
    "hash_ids with string": (line(hash_ids=[1, "2"]), "field 'hash_ids' must be a list of integers"),
    "hash_ids with float": (line(hash_ids=[1, 2.0]), "field 'hash_ids' must be a list of integers"),
    "hash_ids with bool": (line(hash_ids=[1, True]), "field 'hash_ids' must be a list of integers"),
    "hash_ids nested": (line(hash_ids=[[1], [2]]), "field 'hash_ids' must be a list of integers"),
    "hash_ids negative": (line(hash_ids=[1, -2]), "non-negative"),
    "input_length zero": (line(input_length=0, hash_ids=[]), "field 'input_length' must be positive, got 0"),
    "input_length negative": (line(input_length=-5), "field 'input_length' must be positive, got -5"),
    "output_length zero": (line(output_length=0), "field 'output_length' must be positive, got 0"),
    "output_length negative": (line(output_length=-1), "field 'output_length' must be positive, got -1"),
    "timestamp negative": (line(timestamp=-1), "field 'timestamp' must be a finite number >= 0, got -1"),
    "timestamp NaN": (line(timestamp=math.nan), "finite"),
    "timestamp Infinity": (line(timestamp=math.inf), "finite"),
    "too few hash_ids": (line(hash_ids=[1]), "1 hash_ids for input_length 5: expected ceil(5/4) = 2"),
    "too many hash_ids": (line(hash_ids=[1, 2, 3]), "3 hash_ids for input_length 5: expected ceil(5/4) = 2"),
    "no hash_ids": (line(hash_ids=[]), "0 hash_ids for input_length 5"),
    "earlier timestamp": (line(timestamp=99), "timestamp 99 is earlier than the previous line's 100"),
}


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
    assert [r.arrival_s for r in load_trace(path, block_size_tokens=BLOCK)] == [0.005, 0.005, 0.0055]


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


def test_missing_file_raises_os_error(tmp_path: Path) -> None:
    """A trace that does not exist raises FileNotFoundError (I/O, not format)."""
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "absent.jsonl")


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
    """Fields the format does not define are ignored."""
    plain = write_lines(tmp_path / "plain.jsonl", [line()])
    extra = write_lines(
        tmp_path / "extra.jsonl", [line(session_id="s-1", tags=["a"], nested={"hash_ids": "no"}, timestamp_ms=5)]
    )
    assert load_trace(extra, block_size_tokens=BLOCK) == load_trace(plain, block_size_tokens=BLOCK)


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


@given(workload=requests(block_size_tokens=BLOCK), speedup=st.floats(0.01, 1000) | st.integers(1, 10))
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


@pytest.mark.parametrize("block_size", BAD_BLOCK_SIZES)
def test_invalid_block_size_is_a_config_error(tmp_path: Path, block_size: object) -> None:
    """load_trace and write_trace reject a block size that is not a positive int; nothing is written."""
    path = write_lines(tmp_path / "t.jsonl", [line()])
    with pytest.raises(ConfigError, match="block_size_tokens"):
        load_trace(path, block_size_tokens=block_size)  # type: ignore[arg-type]
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
