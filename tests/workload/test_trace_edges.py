"""Edges of reading, writing and generating traces that the other workload tests leave open, each found by a
mutant they let live: inclusive bounds, every negative hash id, the block-size hint against a brute-force model,
short messages for long junk, aiperf's `payload`, Dynamo's nulls beside `text_input`, `delay` in the trace's time
unit, the microseconds hint (and that its advice works), file order among equal arrivals, no misleading format
hints, the column of a non-UTF-8 byte, zstd files, whole-float timestamps, `.gz` names; the generator's rate at
any cv, session prompts in documented order, constant lengths, and ids unique past a thousand segments. The
last four are argument checks that `write_trace`, `iter_trace` and `text_request` had left to Python's own
errors (and "out/" wrote a file named out). A gzip trace on a pipe whose first write is one byte."""

from __future__ import annotations

import fcntl
import gzip
import json
import math
import os
import struct
import termios
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mooncake.errors import ConfigError, InvalidRequestError, TraceFormatError
from mooncake.types import BlockKey, Request, RequestId
from mooncake.workload import (
    ArrivalProcess,
    LengthDistribution,
    WorkloadSpec,
    fixed_length_requests,
    generate_requests,
    iter_trace,
    load_trace,
    text_request,
    trace_stats,
    write_trace,
)
from mooncake.workload.trace_record import MAX_ARRIVAL_S, check_block_count, parse_record

BLOCK = 4
GOOD: dict[str, Any] = {"timestamp": 0, "input_length": 5, "output_length": 3, "hash_ids": [1, 2]}
MS_PER_UNIT = {"ms": 1, "s": 1000, "us": 0.001}  # written out here, not read from the module under test


def write_lines(path: Path, records: list[Any]) -> Path:
    """A trace of `records` (dicts as JSON, strings as they are), one per line."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


# --------------------------------------------------------------------------- one line


def test_every_bound_is_inclusive_and_one_past_it_is_refused() -> None:
    """2**24 tokens (input, output, text bytes) and 2**43 ms (timestamp, delay) read; one more is refused,
    naming the field."""
    top = 2**24
    record = parse_record(
        {"timestamp": 2**43, "delay": 2**43, "input_length": top, "output_length": top, "session_id": "s"}, 512
    )
    assert (record.timestamp_ms, record.delay_ms, record.input_length, record.output_length) == (
        2**43,
        2**43,
        top,
        top,
    )
    assert parse_record({"text_input": "a" * top, "output_length": 1}, 512).input_length == top
    with pytest.raises(ValueError, match="field 'text_input' must be at most 2\\*\\*24 bytes"):
        parse_record({"text_input": "a" * (top + 1), "output_length": 1}, 512)
    for name in ("timestamp", "delay"):
        with pytest.raises(ValueError, match=f"field '{name}'"):
            parse_record({**GOOD, name: 2**43 + 1}, BLOCK)


@given(bad=st.integers(max_value=-1), position=st.integers(0, 1))
@example(bad=-1, position=0)
@example(bad=-1, position=1)
def test_any_negative_hash_id_is_refused(bad: int, position: int) -> None:
    """A hash id below zero, -1 included, anywhere in the list, is an error naming it."""
    hash_ids = [7, 7]
    hash_ids[position] = bad
    with pytest.raises(ValueError, match="field 'hash_ids' must hold non-negative ids"):
        parse_record({**GOOD, "hash_ids": hash_ids}, BLOCK)


POWERS_OF_TWO = [2**k for k in range(13)]  # 1 .. 4096: vLLM's, SGLang's and Mooncake's block sizes and beyond


@given(input_length=st.integers(1, 20_000), count=st.integers(0, 400), block=st.sampled_from([1, 16, 64, 512]))
@example(input_length=17, count=3, block=512)  # fits 8-token blocks only
@example(input_length=5, count=1, block=4)  # fits 8 .. 4096: no single size
def test_a_wrong_count_names_the_one_block_size_it_fits(input_length: int, count: int, block: int) -> None:
    """A count other than ceil(input / block) is refused; the message names the power of two (1 to 4096) whose
    blocks the count fits when exactly one does, and asks for another block size without naming one otherwise."""
    expected = -(-input_length // block)
    if count == expected:
        check_block_count(count, input_length, block)
        return
    with pytest.raises(ValueError) as caught:
        check_block_count(count, input_length, block)
    message = str(caught.value)
    assert message.startswith(f"{count} hash_ids for input_length {input_length}: expected ")
    assert f"= {expected} (" in message
    fits = [size for size in POWERS_OF_TWO if -(-input_length // size) == count]
    if len(fits) == 1:
        assert f"the count fits {fits[0]}-token blocks: block_size_tokens / --block-size {fits[0]})" in message
    else:
        assert "is the trace keyed in another block size?" in message
        assert "the count fits" not in message


LONG_JUNK = st.lists(st.text(max_size=5), min_size=100, max_size=500)  # a wrong value for any field


@given(
    field=st.sampled_from(["timestamp", "delay", "input_length", "output_length", "hash_ids", "text_input"]),
    junk=LONG_JUNK | st.text(min_size=200, max_size=2000),
)
def test_a_long_wrong_value_is_shown_shortened(field: str, junk: list[str] | str) -> None:
    """A field holding a long wrong value (a list of strings; a text where a number goes) is refused by a
    message that names the field and shows the value cut to a few dozen characters: one readable line."""
    if field == "text_input":  # a text is a prompt there: give the list instead, and no other prompt
        line: dict[str, Any] = {"text_input": junk if isinstance(junk, list) else list(junk), "output_length": 1}
    else:
        line = {**GOOD, field: junk}
    with pytest.raises(ValueError, match=f"field '{field}'") as caught:
        parse_record(line, BLOCK)
    assert len(str(caught.value)) < 200


@pytest.mark.parametrize("prompt", ["messages", "payload"])
def test_aiperfs_other_prompt_forms_are_refused_by_name(prompt: str) -> None:
    """A line whose prompt is aiperf's `messages` or `payload` is refused naming the field, not read as the
    input_length beside it (a null one is absent, as every field)."""
    with pytest.raises(ValueError, match=f"field '{prompt}' is not supported"):
        parse_record({**GOOD, prompt: [{"role": "user", "content": "hi"}]}, BLOCK)
    assert parse_record({**GOOD, prompt: None}, BLOCK) == parse_record(GOOD, BLOCK)


def test_null_fields_beside_text_input_are_absent() -> None:
    """Dynamo's writer leaves input_length and hash_ids null beside a text_input: absent, so the line is the
    text (a value in either is refused)."""
    line = {"text_input": "héllo", "input_length": None, "hash_ids": None, "output_length": 3, "timestamp": None}
    record = parse_record(line, BLOCK)
    assert (record.text, record.input_length, record.hash_ids) == ("héllo".encode(), 6, None)
    with pytest.raises(ValueError, match="field 'input_length' cannot go with 'text_input'"):
        parse_record({**line, "input_length": 6}, BLOCK)


@given(
    unit=st.sampled_from(sorted(MS_PER_UNIT)),
    timestamp=st.integers(0, 10**6) | st.floats(0, 10**6),
    delay=st.integers(0, 10**6) | st.floats(0, 10**6),
)
def test_timestamp_and_delay_are_both_counted_in_the_time_unit(unit: str, timestamp: float, delay: float) -> None:
    """`time_unit` scales `delay` as it scales `timestamp`: both are held in ms."""
    record = parse_record({**GOOD, "timestamp": timestamp, "delay": delay}, BLOCK, time_unit=unit)  # type: ignore[arg-type]
    assert record.timestamp_ms == pytest.approx(timestamp * MS_PER_UNIT[unit], rel=1e-15)
    assert record.delay_ms == pytest.approx(delay * MS_PER_UNIT[unit], rel=1e-15)


def test_a_session_turn_by_delay_in_seconds_arrives_that_many_seconds_later(tmp_path: Path) -> None:
    """A Qwen-style trace timed in seconds: a turn 2.5 `delay` after its session's first arrives 2.5 s later."""
    turns = [
        {"session_id": "a", "timestamp": 1.5, "input_length": 4, "output_length": 1},
        {"session_id": "a", "delay": 2.5, "input_length": 4, "output_length": 1},
    ]
    read = load_trace(write_lines(tmp_path / "t.jsonl", turns), block_size_tokens=BLOCK, time_unit="s")
    assert [r.arrival_s for r in read] == [1.5, 4.0]


@given(
    value=st.integers(2**43 + 1, 2**64) | st.integers(2**64 + 1, 2**80),
    unit=st.sampled_from(["ms", "s"]),
)
@example(value=2**64, unit="ms")
@example(value=2**53 + 1, unit="ms")
@example(value=2**64 + 1, unit="ms")
def test_a_timestamp_past_the_bound_asks_for_microseconds_only_where_they_could_be(value: int, unit: str) -> None:
    """An integer timestamp past 2**43 ms up to 2**64 (epoch microseconds, 1.7e15 in 2024) is refused with the
    hint to read it in microseconds; past 2**64, or in another unit than ms, without it."""
    with pytest.raises(ValueError, match="field 'timestamp' must be a number of") as caught:
        parse_record({**GOOD, "timestamp": value}, BLOCK, time_unit=unit)  # type: ignore[arg-type]
    hinted = "is the trace timed in microseconds?" in str(caught.value)
    assert hinted == (unit == "ms" and value <= 2**64)


def test_the_microseconds_hint_is_advice_that_works(tmp_path: Path) -> None:
    """An epoch-microsecond trace read as ms is refused with the hint; read with time_unit="us", as the hint
    says, it gives the epoch seconds (past 2**43 microseconds, within 2**43 ms)."""
    epoch_us = [1_733_300_000_000_000, 1_733_300_000_250_000, 1_733_300_001_000_000]
    path = write_lines(tmp_path / "epoch.jsonl", [{**GOOD, "timestamp": t} for t in epoch_us])
    with pytest.raises(TraceFormatError, match=r"epoch\.jsonl:1: .*time_unit / --time-unit us\)"):
        load_trace(path, block_size_tokens=BLOCK)
    read = load_trace(path, block_size_tokens=BLOCK, time_unit="us")
    assert [r.arrival_s for r in read] == pytest.approx([t / 1e6 for t in epoch_us], rel=1e-15, abs=0)


# --------------------------------------------------------------------------- a file


@st.composite
def tied_sessions(draw: st.DrawFn) -> list[list[int]]:
    """Timestamps of sessions written grouped in start order, all within 0..2 ms: later turns tie with one
    another and with the starts of sessions below them."""
    starts = sorted(draw(st.lists(st.integers(0, 2), min_size=1, max_size=4)))
    return [[start, *sorted(draw(st.lists(st.integers(start, 2), max_size=3)))] for start in starts]


@given(sessions=tied_sessions())
@example(sessions=[[0, 1], [1]])  # a held turn ties with the start below it
def test_equal_arrivals_come_out_in_file_order(
    tmp_path_factory: pytest.TempPathFactory, sessions: list[list[int]]
) -> None:
    """Requests come out by arrival and, among equal arrivals, in file order: a held later turn before the
    start of a session below it at the same millisecond (each line is told apart by its output_length)."""
    lines: list[dict[str, Any]] = []
    number = 0
    for index, timestamps in enumerate(sessions):
        for timestamp in timestamps:
            number += 1
            lines.append(
                {"session_id": f"s{index}", "timestamp": timestamp, "input_length": 1, "output_length": number}
            )
    path = write_lines(tmp_path_factory.mktemp("ties") / "t.jsonl", lines)
    read = load_trace(path, block_size_tokens=BLOCK)
    expected = sorted(lines, key=lambda line: (line["timestamp"], line["output_length"]))
    assert [(r.arrival_s, r.output_length) for r in read] == [
        (line["timestamp"] / 1000, line["output_length"]) for line in expected
    ]
    assert [r.request_id for r in read] == [str(i) for i in range(len(read))]


@pytest.mark.parametrize(
    "bad",
    [
        '{"timestamp": 0, "input_length": 5,',  # cut short
        '{"timestamp": 0, "input_length": 5, "output_length": 3, "hash_ids": [1, 2]',  # no closing brace
        '{"timestamp": 0, "input_length": 5 "output_length": 3}',  # a comma missing
    ],
)
def test_a_broken_object_is_not_called_csv_or_pretty_printed(tmp_path: Path, bad: str) -> None:
    """A JSON object broken on its one line is reported as invalid JSON, without the hints meant for CSV rows
    and pretty-printed objects (it is neither)."""
    path = write_lines(tmp_path / "t.jsonl", [GOOD, bad])
    with pytest.raises(TraceFormatError) as caught:
        load_trace(path, block_size_tokens=BLOCK)
    assert caught.value.line == 2 and caught.value.reason.startswith("invalid JSON")
    assert "not CSV" not in caught.value.reason and "not pretty-printed" not in caught.value.reason


def test_a_latin_1_line_names_the_byte_and_its_column(tmp_path: Path) -> None:
    """A line saved in Latin-1 (café as caf 0xe9) is not read as some other text: the error names the line,
    the byte and its 1-based column."""
    path = tmp_path / "latin1.jsonl"
    good = json.dumps({"text_input": "cafe", "output_length": 1}).encode()
    path.write_bytes(good + b"\n" + '{"text_input": "café", "output_length": 1}'.encode("latin-1") + b"\n")
    with pytest.raises(TraceFormatError) as caught:
        load_trace(path, block_size_tokens=BLOCK)
    assert (caught.value.line, caught.value.reason) == (2, "not UTF-8: byte 0xe9 at column 20")


@pytest.mark.parametrize(("magic", "name"), [(b"\x28\xb5\x2f\xfd", "zstd"), (b"\xfd7zXZ\x00", "xz"), (b"BZh", "bzip2")])
def test_a_compressed_file_is_named_by_its_format(tmp_path: Path, magic: bytes, name: str) -> None:
    """A zstd, xz or bzip2 file (a .jsonl.zst download) is an error at line 1 saying what it probably is."""
    path = tmp_path / "t.jsonl"
    path.write_bytes(magic + b"\x00\x01\xb5\x80rest\n")
    with pytest.raises(TraceFormatError, match=f"a {name}-compressed file") as caught:
        load_trace(path)
    assert caught.value.line == 1


def test_a_utf16_file_and_a_byte_order_mark_past_line_1_are_named(tmp_path: Path) -> None:
    """A UTF-16 file (Windows' "Unicode" save) and two traces joined with cat (the second's BOM on a later line)
    were told they looked like CSV; each hint now says what they are."""
    text = json.dumps(GOOD) + "\n"
    utf16 = tmp_path / "utf16.jsonl"
    utf16.write_bytes(text.encode("utf-16"))
    with pytest.raises(TraceFormatError, match=r"a UTF-16 file\? a trace is UTF-8") as caught:
        load_trace(utf16, block_size_tokens=BLOCK)
    assert caught.value.line == 1
    joined = tmp_path / "joined.jsonl"
    joined.write_bytes(("\ufeff" + text).encode() * 2)  # the first line's BOM is read past
    with pytest.raises(TraceFormatError, match="a byte-order mark past line 1: files joined with cat") as caught:
        load_trace(joined, block_size_tokens=BLOCK)
    assert caught.value.line == 2


def test_a_request_past_a_traces_timestamps_is_refused_as_such(tmp_path: Path) -> None:
    """A request arriving past 2**43 ms cannot be written: the error says so (it used to ask whether the trace was
    timed in microseconds, a reader's question), and no file is left."""
    path = tmp_path / "late.jsonl"
    with pytest.raises(
        InvalidRequestError, match=r"request 1 arrives at 8.8e\+09 s, past the 8796093022208 ms"
    ) as caught:
        write_trace(path, [a_request(0, 0.0), a_request(1, 8.8e9)], block_size_tokens=BLOCK)
    assert "microseconds" not in str(caught.value) and not path.exists()


def test_what_is_no_workload_is_a_clear_error(tmp_path: Path) -> None:
    """None where requests or an arrival process belong, and a generated prompt longer than a trace line holds,
    are errors naming the argument (they were an AttributeError, a TypeError, and a workload `write_trace` then
    refused)."""
    with pytest.raises(InvalidRequestError, match="requests must be an iterable, got None"):
        write_trace(tmp_path / "none.jsonl", None)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="requests must be an iterable, got None"):
        trace_stats(None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="arrivals must be an ArrivalProcess, got None"):
        fixed_length_requests(input_tokens=8, output_tokens=1, num_requests=2, arrivals=None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="max_input_tokens must be an integer in"):
        WorkloadSpec(max_input_tokens=2**24 + 1)
    assert not list(tmp_path.iterdir())


def test_whole_float_timestamps_read_without_a_caution(tmp_path: Path) -> None:
    """pandas writes a timestamp column with a gap as floats (27482.0): that is whole milliseconds, read as such
    and with no caution that the trace may be in seconds; a fraction of a millisecond gets the one caution."""
    whole = write_lines(tmp_path / "whole.jsonl", [{**GOOD, "timestamp": t} for t in (0.0, 27482.0, 27483.0)])
    cautions: list[str] = []
    read = load_trace(whole, block_size_tokens=BLOCK, on_caution=cautions.append)
    assert [r.arrival_s for r in read] == [0.0, 27.482, 27.483] and cautions == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default caution is a warning: none here
        load_trace(whole, block_size_tokens=BLOCK)
    fraction = write_lines(tmp_path / "fraction.jsonl", [{**GOOD, "timestamp": t} for t in (0.0, 1.0, 1.5, 2.5)])
    load_trace(fraction, block_size_tokens=BLOCK, on_caution=cautions.append)
    assert len(cautions) == 1 and cautions[0].startswith(f"{fraction}:3: timestamp 1.5 has a fraction")
    with pytest.warns(UserWarning) as caught:  # without on_caution: a warning, never silence
        load_trace(fraction, block_size_tokens=BLOCK)
    assert [str(w.message) for w in caught] == cautions


def test_a_field_neither_format_defines_gets_one_caution_naming_it(tmp_path: Path) -> None:
    """A misspelt `Timestamp` reads as absent (the line arrives with the one above, as aiperf's rule has it) and
    a `hash_id` leaves the prompt unkeyed: the first such line gets one caution naming its file, line and fields;
    the Mooncake fields and aiperf's get none."""
    known = {**GOOD, "session_id": "s", "delay": 5}
    clean = write_lines(tmp_path / "clean.jsonl", [GOOD, known])
    cautions: list[str] = []
    load_trace(clean, block_size_tokens=BLOCK, on_caution=cautions.append)
    assert cautions == []
    misspelt = write_lines(
        tmp_path / "misspelt.jsonl",
        [GOOD, {**GOOD, "Timestamp": 60_000, "hash_id": [1]}, {**GOOD, "arrival_time": 1}],
    )
    read = load_trace(misspelt, block_size_tokens=BLOCK, on_caution=cautions.append)
    assert len(read) == 3 and len(cautions) == 1
    assert cautions[0].startswith(f"{misspelt}:2: not a trace field: 'Timestamp', 'hash_id' (")


# --------------------------------------------------------------------------- writing


def a_request(index: int, arrival_s: float) -> Request:
    return Request(
        request_id=RequestId(str(index)),
        arrival_s=arrival_s,
        input_length=5,
        output_length=3,
        block_keys=(BlockKey(1), BlockKey(2)),
    )


@pytest.mark.parametrize(
    ("name", "packed"),
    [("t.gz", True), ("t.jsonl.gz", True), ("t.json.gz", True), ("t.jsonl", False), ("t.gz.jsonl", False)],
)
def test_every_gz_name_and_only_one_is_written_compressed(tmp_path: Path, name: str, packed: bool) -> None:
    """A target whose name ends in .gz, whatever precedes it, is gzip; any other name plain; both read back."""
    path = tmp_path / name
    workload = [a_request(0, 0.0), a_request(1, 0.5)]
    write_trace(path, workload, block_size_tokens=BLOCK)
    data = path.read_bytes()
    assert data.startswith(b"\x1f\x8b") == packed
    text = gzip.decompress(data) if packed else data
    assert text.decode("utf-8").count("\n") == 2
    assert [r.arrival_s for r in load_trace(path, block_size_tokens=BLOCK)] == [0.0, 0.5]


def pending_bytes(fd: int) -> int:
    """Bytes written to the pipe of `fd` and not yet read."""
    count: int = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
    return count


@pytest.mark.skipif(not Path("/dev/fd").is_dir(), reason="opens a pipe by its /dev/fd name")
@pytest.mark.parametrize("packed", [True, False], ids=["gzip", "plain"])
def test_a_trace_on_a_pipe_is_told_by_its_first_two_bytes_when_the_first_write_is_one(
    tmp_path: Path, packed: bool
) -> None:
    """A trace whose first byte comes through a pipe alone, the rest once the reader has taken it, reads as the file
    does: the reader waits for gzip's two magic bytes. It peeked, which from a pipe gives what has come so far, and
    read such a gzip stream as text ("not UTF-8: byte 0x8b")."""
    path = tmp_path / ("t.jsonl.gz" if packed else "t.jsonl")
    write_trace(path, [a_request(0, 0.0), a_request(1, 0.5)], block_size_tokens=BLOCK)
    data = path.read_bytes()
    read_end, write_end = os.pipe()

    def feed() -> None:
        try:
            os.write(write_end, data[:1])
            deadline = time.monotonic() + 10
            while pending_bytes(write_end) and time.monotonic() < deadline:  # the reader's first read has its byte
                time.sleep(0.001)
            os.write(write_end, data[1:])  # a few hundred bytes: the pipe holds them whether or not they are read
        finally:
            os.close(write_end)

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        read = load_trace(f"/dev/fd/{read_end}", block_size_tokens=BLOCK)
    finally:
        writer.join(timeout=10)
        os.close(read_end)
    assert not writer.is_alive()
    assert read == load_trace(path, block_size_tokens=BLOCK)


@pytest.mark.parametrize("path", [3, None, b"t.jsonl", "t\0.jsonl"])
def test_write_trace_refuses_a_path_that_is_not_one_as_iter_trace_does(tmp_path: Path, path: object) -> None:
    """write_trace, like iter_trace, refuses a path that is no str or os.PathLike with a ConfigError naming it."""
    with pytest.raises(ConfigError, match="path"):
        iter_trace(path)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="path"):
        write_trace(path, [a_request(0, 0.0)], block_size_tokens=BLOCK)  # type: ignore[arg-type]


@pytest.mark.parametrize("tail", ["/", "/.", "/.."])
def test_a_path_ending_in_a_slash_or_a_dot_names_no_file(tmp_path: Path, tail: str) -> None:
    """'out/' and 'out/.' name a directory (POSIX: they resolve only to one), which pathlib drops: a ConfigError,
    nothing written (not a file named out)."""
    with pytest.raises(ConfigError, match="must name a file"):
        write_trace(f"{tmp_path / 'out'}{tail}", [a_request(0, 0.0)], block_size_tokens=BLOCK)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("option", ["on_skip", "on_caution"])
def test_callbacks_that_cannot_be_called_are_refused_at_the_call(tmp_path: Path, option: str) -> None:
    """A callback that is no callable is a ConfigError naming it when iter_trace is called."""
    path = write_lines(tmp_path / "t.jsonl", ["{", {**GOOD, "timestamp": 0.5}])
    with pytest.raises(ConfigError, match=option):
        iter_trace(path, block_size_tokens=BLOCK, strict=False, **{option: 5})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "block_size_tokens"),
    [("hello", 0), ("hello", 2.0), ("a\ud800", 4), (b"hello", 4)],
    ids=["block 0", "block 2.0", "lone surrogate", "bytes"],
)
def test_text_request_refuses_bad_input_as_an_invalid_request(text: object, block_size_tokens: object) -> None:
    """text_request documents InvalidRequestError for an invalid field (a block size of -1 is one already): a
    block size of 0 or 2.0, a text that is no valid Unicode str, are too."""
    with pytest.raises(InvalidRequestError, match="block_size_tokens"):
        text_request("hello", request_id="0", arrival_s=0.0, output_length=1, block_size_tokens=-1)
    with pytest.raises(InvalidRequestError):
        text_request(
            text,  # type: ignore[arg-type]
            request_id="0",
            arrival_s=0.0,
            output_length=1,
            block_size_tokens=block_size_tokens,  # type: ignore[arg-type]
        )


# --------------------------------------------------------------------------- generating


@settings(max_examples=20)
@given(seed=st.integers(0, 2**32 - 1), rate=st.floats(0.1, 100.0), cv=st.sampled_from([0.5, 2.0, 3.0]))
def test_any_cv_keeps_the_requested_mean_rate(seed: int, rate: float, cv: float) -> None:
    """The gamma gaps of a bursty (or regular) process keep the mean gap 1 / rate: cv shapes the gaps, never the
    rate (within 15 % over 20,000 arrivals: seven standard errors at cv 3)."""
    count = 20_001
    times = ArrivalProcess(rate_per_s=rate, cv=cv).times_s(np.random.default_rng(seed), count)
    assert times[-1] / (count - 1) == pytest.approx(1 / rate, rel=0.15)
    assert math.isfinite(times[-1])


def test_a_document_session_opens_with_its_system_prompt() -> None:
    """Document Q&A is system prompt + document: with one system prompt of three and a bit blocks, chat and
    document sessions alike share its three full blocks, and document sessions go on with a document."""
    spec = WorkloadSpec(
        chat_weight=1.0,
        document_weight=1.0,
        num_system_prompts=1,
        system_prompt_tokens=LengthDistribution(mean_tokens=1700, sigma=0.0),
        num_documents=20,
        document_tokens=LengthDistribution(mean_tokens=6000, sigma=0.3),
        continue_probability=0.0,  # every request opens a session
    )
    workload = list(generate_requests(spec, num_requests=200, seed=1))
    assert len({r.block_keys[:3] for r in workload}) == 1
    assert any(r.input_length > 6000 for r in workload)  # documents were drawn


@given(
    mean=st.floats(1.0, 10_000.0),
    bounds=st.tuples(st.integers(1, 20_000), st.integers(1, 20_000)).map(sorted),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_constant_length_is_the_nearest_integer_to_the_mean_within_its_clip(
    mean: float, bounds: list[int], seed: int
) -> None:
    """sigma 0 gives a constant: the mean rounded to the nearest integer (2.6 is 3 tokens, not 2), clipped to
    [min_tokens, max_tokens]."""
    low, high = bounds
    lengths = LengthDistribution(mean_tokens=mean, sigma=0.0, min_tokens=low, max_tokens=high)
    drawn = lengths.sample(np.random.default_rng(seed))
    assert type(drawn) is int
    assert drawn == min(max(round(mean), low), high)


@settings(max_examples=5)
@given(seed=st.integers(0, 2**32 - 1))
def test_sessions_that_share_only_the_system_prompt_share_no_later_key(seed: int) -> None:
    """Equal ids mean equal prefixes: 800 one-turn chats over one 512-token system prompt (well over a thousand
    segments in all) share its one key and no other; every message is a session's own."""
    spec = WorkloadSpec(
        num_system_prompts=1,
        system_prompt_tokens=LengthDistribution(mean_tokens=512, sigma=0.0),
        user_message_tokens=LengthDistribution(mean_tokens=1500, sigma=0.5, min_tokens=600),
        continue_probability=0.0,
    )
    owner: dict[int, str] = {}
    for request in generate_requests(spec, num_requests=800, seed=seed):
        assert request.input_length > 512 and owner.setdefault(request.block_keys[0], "system") == "system"
        for key in request.block_keys[1:]:
            assert owner.setdefault(key, request.request_id) == request.request_id, f"key {key} is shared"


@pytest.mark.parametrize(("speedup", "line"), [(1e-308, 2), (1e-100, 2), (0.5, 3)])
def test_an_arrival_that_a_speedup_puts_past_the_timestamps_bound_names_its_line(
    tmp_path: Path, speedup: float, line: int
) -> None:
    """A speedup that puts an arrival past 2**43 ms (MAX_ARRIVAL_S: the bound on a timestamp, what a replay can
    time) is a TraceFormatError at the first line it does so (the earlier ones are read), overflowing a float or
    not: a replay of arrivals at 1e98 s once hung. At speedup 1 the bound itself is read."""
    stamps = (0, 1, 2**43)
    records = [{"timestamp": t, "input_length": 4, "output_length": 1} for t in stamps]
    path = write_lines(tmp_path / "t.jsonl", records)
    read: list[Request] = []
    message = rf"t\.jsonl:{line}: arrival {stamps[line - 1]} ms at speedup {speedup!r} is .* past the 8.796e\+09 s"
    with pytest.raises(TraceFormatError, match=message) as caught:
        read.extend(iter_trace(path, block_size_tokens=BLOCK, speedup=speedup))
    assert caught.value.line == line and [r.arrival_s for r in read] == [t / 1000 / speedup for t in stamps[: line - 1]]
    assert [r.arrival_s for r in load_trace(path, block_size_tokens=BLOCK)][-1] == MAX_ARRIVAL_S
    assert str(caught.value).endswith(": a larger speedup")  # only a slow-down can put an arrival past the bound


@pytest.mark.parametrize("speedup", [1.0, 2.0])
def test_a_delay_past_the_timestamps_bound_names_the_line_s_fields_not_the_speedup(
    tmp_path: Path, speedup: float
) -> None:
    """A later turn whose previous turn's arrival + delay passes 2**43 ms is refused at its line, naming both
    (it once advised "a larger speedup" at speedup 1, from a command, `trace stats`, that has none)."""
    records = [
        {"session_id": "a", "timestamp": 2**43, "input_length": 10, "output_length": 5},
        {"session_id": "a", "delay": 1000, "input_length": 10, "output_length": 5},
    ]
    path = write_lines(tmp_path / "t.jsonl", records)
    with pytest.raises(TraceFormatError) as caught:
        list(iter_trace(path, block_size_tokens=BLOCK, speedup=speedup))
    assert caught.value.line == 2
    assert caught.value.reason == (
        "turn of session 'a' arrives at 8796093023208 ms, its previous turn (line 1) at 8796093022208 ms + its "
        "delay 1000 ms, past 2**43 ms (the bound on a timestamp)"
    )
    assert "speedup" not in str(caught.value)
