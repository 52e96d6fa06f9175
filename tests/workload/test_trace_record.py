"""One trace line validated: the Mooncake fields, aiperf's session_id, delay and text_input, and their errors;
a property: any line within the bounds reads back field for field, and a wrong block count is refused."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.workload.trace_record import (
    AIPERF_FIELDS,
    TextSession,
    TraceRecord,
    parse_record,
    session_in_text,
    session_of,
)

BLOCK = 4
MOONCAKE: dict[str, Any] = {"timestamp": 0, "input_length": 5, "output_length": 3, "hash_ids": [1, 2]}


def parse(**fields: Any) -> TraceRecord:
    return parse_record(fields, BLOCK)


def test_a_mooncake_line_keeps_its_four_fields() -> None:
    """The Mooncake form reads as timestamp, lengths and hash_ids; no session, delay or text."""
    assert parse(**MOONCAKE) == TraceRecord(
        timestamp_ms=0, delay_ms=None, session_id=None, input_length=5, output_length=3, hash_ids=(1, 2), text=None
    )


AIPERF_WITHOUT_TIMESTAMP = {
    "session_id": {"session_id": "s", "input_length": 5, "output_length": 3, "hash_ids": [1, 2]},
    "delay": {"delay": 10, "input_length": 5, "output_length": 3, "hash_ids": [1, 2]},
    "text_input": {"text_input": "hello", "output_length": 3},
}


def test_the_aiperf_fields_are_the_three() -> None:
    """session_id, delay and text_input mark aiperf's form."""
    assert set(AIPERF_FIELDS) == set(AIPERF_WITHOUT_TIMESTAMP)


@pytest.mark.parametrize("fields", AIPERF_WITHOUT_TIMESTAMP.values(), ids=AIPERF_WITHOUT_TIMESTAMP.keys())
def test_any_aiperf_field_makes_timestamp_optional(fields: dict[str, Any]) -> None:
    """With session_id, delay or text_input, a line may leave out timestamp (aiperf's form)."""
    assert parse_record(fields, BLOCK).timestamp_ms is None


def test_aiperf_lines_may_leave_out_hash_ids() -> None:
    """aiperf makes up a prompt for input_length without hash_ids; the record has none."""
    record = parse(session_id="abc-123", input_length=300, output_length=40)
    assert (record.session_id, record.hash_ids, record.input_length) == ("abc-123", None, 300)


def test_aiperf_multi_turn_example_reads() -> None:
    """The example of aiperf's loader: a first turn, then a turn 2 ms later by delay."""
    first = parse(session_id="abc-123", input_length=300, output_length=40)
    second = parse(session_id="abc-123", delay=2, input_length=150, output_length=20)
    assert (first.delay_ms, second.delay_ms, second.timestamp_ms) == (None, 2, None)


def test_text_input_gives_utf8_bytes_as_the_input() -> None:
    """text_input counts its UTF-8 bytes as input tokens; the record keeps the bytes."""
    record = parse(text_input="héllo", output_length=2, timestamp=5)
    assert record.text == "héllo".encode()
    assert record.input_length == 6
    assert record.hash_ids is None


def test_timestamp_and_delay_may_both_be_given() -> None:
    """Both are kept; the timestamp wins when placing the line (as in aiperf)."""
    record = parse(**MOONCAKE, delay=7.5)
    assert (record.timestamp_ms, record.delay_ms) == (0, 7.5)


def test_lines_as_aiperf_pandas_and_dynamo_write_them_read() -> None:
    """aiperf's reading: timestamp and hash_ids may be left out (a line without hash_ids shares nothing); a
    null field is absent (Dynamo's writer); a whole-number float is its integer (pandas)."""
    assert parse(input_length=10, output_length=4) == TraceRecord(
        timestamp_ms=None, delay_ms=None, session_id=None, input_length=10, output_length=4, hash_ids=None, text=None
    )
    nulls = parse(timestamp=None, input_length=5, output_length=3, hash_ids=None, session_id=None, delay=None)
    assert (nulls.timestamp_ms, nulls.hash_ids, nulls.session_id, nulls.delay_ms) == (None, None, None, None)
    floats = parse(timestamp=0, input_length=5.0, output_length=3.0, hash_ids=[1.0, 2])
    assert (floats.input_length, floats.output_length, floats.hash_ids) == (5, 3, (1, 2))
    assert all(type(n) is int for n in (floats.input_length, floats.output_length, *floats.hash_ids))


@pytest.mark.parametrize("value", [2.0**53, float(11061003550842207561), 1e300])
def test_a_float_hash_id_of_2_53_or_more_is_refused_by_value(value: float) -> None:
    """From 2**53 on a float is no one integer: two distinct 64-bit ids written by a float column read as one
    key (a prefix shared that is not); such an element is refused, naming it. Whole floats below it read as
    their exact integers."""
    with pytest.raises(ValueError, match=r"field 'hash_ids' holds the float .*at least 2\*\*53") as caught:
        parse(timestamp=0, input_length=5, output_length=3, hash_ids=[1, value])
    assert repr(value) in str(caught.value)
    below = parse(timestamp=0, input_length=5, output_length=3, hash_ids=[2.0**53 - 1, 0.0])
    assert below.hash_ids == (2**53 - 1, 0) and all(type(h) is int for h in below.hash_ids)
    assert parse(timestamp=0, input_length=5, output_length=3, hash_ids=[2**63, 2**53 + 1]).hash_ids == (
        2**63,
        2**53 + 1,
    )  # integers are exact at any size


def test_unknown_fields_are_ignored() -> None:
    """Fields neither format defines change nothing."""
    assert parse(**MOONCAKE, extra={"a": 1}, priority=3, group_id=2) == parse(**MOONCAKE)


AIPERF_ERRORS: dict[str, tuple[dict[str, Any], str]] = {
    "session_id number": ({**MOONCAKE, "session_id": 7}, "field 'session_id' must be a non-empty string, got 7"),
    "session_id empty": ({**MOONCAKE, "session_id": ""}, "field 'session_id' must be a non-empty string"),
    "delay negative": ({**MOONCAKE, "delay": -1}, "field 'delay' must be a number of ms in [0, 2**43], got -1"),
    "delay string": ({**MOONCAKE, "delay": "5"}, "field 'delay' must be a number"),
    "delay NaN": ({**MOONCAKE, "delay": float("nan")}, "field 'delay' must be a number of ms in [0, 2**43], got nan"),
    "delay past 2**43": ({**MOONCAKE, "delay": 2**43 + 1}, "field 'delay' must be a number of ms in [0, 2**43]"),
    "epoch microseconds": (
        {**MOONCAKE, "timestamp": 1_733_300_000_000_000},
        "must be a number of ms in [0, 2**43], got 1733300000000000 (is the trace timed in microseconds?",
    ),
    "timestamp of 10**400": (  # float() of it would overflow
        {**MOONCAKE, "timestamp": 10**400},
        "field 'timestamp' must be a number of ms in [0, 2**43], got an integer of 1329 bits",
    ),
    "timestamp of 1e300": ({**MOONCAKE, "timestamp": 1e300}, "field 'timestamp' must be a number of ms in [0, 2**43]"),
    "input_length past 2**24": (
        {"session_id": "s", "input_length": 2**24 + 1, "output_length": 1},  # keys would be made up per block
        "field 'input_length' must be at most 2**24 tokens, got 16777217",
    ),
    "output_length of 10**100": (
        {**MOONCAKE, "output_length": 10**100},
        "field 'output_length' must be at most 2**24 tokens, got an integer of 333 bits",
    ),
    "text past 2**24 bytes": (
        {"text_input": "é" * (2**23 + 1), "output_length": 1},
        "field 'text_input' must be at most 2**24 bytes, got 16777218",
    ),
    "text empty": ({"text_input": "", "output_length": 1}, "field 'text_input' must be a non-empty string"),
    "text number": ({"text_input": 5, "output_length": 1}, "field 'text_input' must be a non-empty string"),
    "text with input_length": (
        {"text_input": "hi", "input_length": 2, "output_length": 1},
        "field 'input_length' cannot go with 'text_input'",
    ),
    "text with hash_ids": (
        {"text_input": "hi", "hash_ids": [1], "output_length": 1},
        "field 'hash_ids' cannot go with 'text_input'",
    ),
    "text lone surrogate": ({"text_input": "a\ud800", "output_length": 1}, "not valid Unicode"),
    "text without output_length": ({"text_input": "hi"}, "missing field 'output_length'"),
    "text with zero output": ({"text_input": "hi", "output_length": 0}, "field 'output_length' must be positive"),
    "aiperf without input": ({"session_id": "s", "output_length": 1}, "missing field 'input_length'"),
    "aiperf wrong hash_ids count": ({"session_id": "s", **MOONCAKE, "hash_ids": [1]}, "1 hash_ids for input_length 5"),
}


@pytest.mark.parametrize(("fields", "reason"), AIPERF_ERRORS.values(), ids=AIPERF_ERRORS.keys())
def test_bad_aiperf_fields_are_value_errors(fields: dict[str, Any], reason: str) -> None:
    """Each bad aiperf field is a ValueError whose message names the field (and the value)."""
    with pytest.raises(ValueError) as caught:
        parse_record(fields, BLOCK)
    assert reason in str(caught.value)


@pytest.mark.parametrize(
    ("record", "expected"),
    [({"session_id": "s"}, "s"), ({"session_id": ""}, None), ({"session_id": 3}, None), ({}, None), ([1], None)],
)
def test_session_of_reads_a_usable_session_id_from_any_line(record: object, expected: str | None) -> None:
    """session_of finds a line's session even when the rest of the line is unusable."""
    assert session_of(record) == expected


TEXT_SESSIONS: dict[str, tuple[str, TextSession]] = {
    # id: (a line that is no JSON, what its text shows of its session)
    "cut after the id": ('{"session_id": "s1", "delay": 1000, "output_len', TextSession("s1", None)),
    "cut right after its quote": ('{"input_length": 5, "session_id": "s1"', TextSession("s1", None)),
    "escaped key and id": ('{"session\\u005fid": "s\\u00e9", "x": [1,', TextSession("s\u00e9", None)),
    "a NaN elsewhere": ('\ufeff{"session_id": "q", "timestamp": NaN}', TextSession("q", None)),
    "two ids": ('{"session_id": "a", "session_id": "b", "x": ', TextSession(None, "cut")),  # a field given twice
    "the words in a text": ('{"session_id": "a", "text_input": "its \\"session_id\\" is', TextSession("a", None)),
    "cut inside the id": ('{"session_id": "s1', TextSession(None, "cut")),
    "cut after the colon": ('{"session_id": ', TextSession(None, "cut")),
    "cut inside the key": ('{"x": 1, "session_id', TextSession(None, "cut")),
    "a byte no UTF-8 in the id": ('{"session_id": "a\udcff", "x": 1', TextSession(None, "cut")),
    "a line run into it": ('{"session_id": "a", "x": 1}{"session_id": "b"}', TextSession(None, "cut")),
    "a line run into a key": ('{"session_id": "a", "inp{"session_id": "b"}', TextSession(None, "cut")),
    "no object, with an id": ('[{"session_id": "a"},', TextSession(None, "cut")),
    "cut before a field shows": ('{"timestamp": 0, "sess', TextSession(None, "unread")),
    "a nested id": ('{"meta": {"session_id": "n"}, "x": 1', TextSession(None, "unread")),
    "read to its end": ('{"timestamp": NaN, "input_length": 5}', TextSession(None, None)),
    "a null id": ('{"session_id": null, "x": [1,', TextSession(None, None)),
    "a number id, cut": ('{"session_id": 7', TextSession(None, None)),
    "no object": ("timestamp=0,5,3", TextSession(None, None)),
}


@pytest.mark.parametrize(("text", "expected"), TEXT_SESSIONS.values(), ids=TEXT_SESSIONS.keys())
def test_session_in_text_reads_a_whole_id_and_guesses_none(text: str, expected: TextSession) -> None:
    """A line that is no JSON names the session whose id it holds whole, as `json.loads` would read it; an id cut
    short, unreadable, given twice or past where the reading stops is "cut"; a line cut before any session_id
    shows, "unread"."""
    assert session_in_text(text) == expected


@given(
    input_length=st.integers(1, 5000),
    output_length=st.integers(1, 2**24),
    timestamp=st.none() | st.integers(0, 2**43) | st.floats(0, 2**43, allow_nan=False),
    block=st.sampled_from([16, 64, 512]),
    hashed=st.booleans(),
    data=st.data(),
)
def test_a_record_reads_back_what_its_line_says_and_its_block_count_is_checked(
    input_length: int, output_length: int, timestamp: float | None, block: int, hashed: bool, data: st.DataObject
) -> None:
    """Any line within the bounds reads back field for field (a timestamp in seconds as that many thousand ms);
    hash_ids of any other count than ceil(input_length / block) are refused, naming the count."""
    blocks = -(-input_length // block)
    hash_ids = (
        data.draw(st.lists(st.integers(0, 2**63), min_size=blocks, max_size=blocks, unique=True)) if hashed else None
    )
    line: dict[str, Any] = {"input_length": input_length, "output_length": output_length}
    if timestamp is not None:
        line["timestamp"] = timestamp
    if hash_ids is not None:
        line["hash_ids"] = hash_ids
    record = parse_record(json.loads(json.dumps(line)), block)
    assert (record.input_length, record.output_length) == (input_length, output_length)
    assert record.hash_ids == (None if hash_ids is None else tuple(hash_ids))
    assert record.timestamp_ms == timestamp and record.text is None and record.delay_ms is None
    if timestamp is not None and timestamp <= 2**43 / 1000:
        assert parse_record(line, block, time_unit="s").timestamp_ms == timestamp * 1000
    wrong = data.draw(st.integers(0, blocks + 3).filter(lambda n: n != blocks))
    with pytest.raises(ValueError, match=f"{wrong} hash_ids for input_length {input_length}"):
        parse_record({**line, "hash_ids": list(range(wrong))}, block)
