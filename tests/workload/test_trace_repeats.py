"""Repeats a trace line may not hold: a field named twice, and an id twice in one `hash_ids`.

Both were read silently. Python's JSON reader keeps a repeated field's last value, so
`{"output_length": 5, "output_length": 5000}` replayed 5000 output tokens whatever its writer meant, and a repeated
`input_length` gave a misleading --block-size hint. A chained id names its block's whole prefix, so no two blocks of
one prompt share one; `[7, 7, 7, 7]` read, and `trace_stats` and a replay counted the prompt's own earlier blocks
as cache hits (two such lines and a `[7]`: 9 blocks, 1 unique, reuse 0.56).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.errors import TraceFormatError
from mooncake.workload import PRESETS, generate_requests, load_trace, trace_stats, write_trace
from mooncake.workload.trace import SkippedLine
from mooncake.workload.trace_record import (
    TextSession,
    check_field_once,
    check_fields_once,
    parse_record,
    session_in_text,
)

BLOCK = 4


def write_text(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# --------------------------------------------------------------------------- a field named twice

GOOD = '"timestamp": 0, "input_length": 5, "output_length": 3, "hash_ids": [1, 2]'

REPEATED_FIELDS: dict[str, tuple[str, str]] = {
    # id: (a line naming a field twice, that field)
    "output_length": ("{" + GOOD + ', "output_length": 5000}', "output_length"),
    "input_length, whose count would hint a block size": ("{" + GOOD + ', "input_length": 5000}', "input_length"),
    "timestamp": ('{"timestamp": 9, ' + GOOD + "}", "timestamp"),
    "hash_ids": ("{" + GOOD + ', "hash_ids": [3, 4]}', "hash_ids"),
    "the same value twice": ("{" + GOOD + ', "output_length": 3}', "output_length"),
    "session_id": ('{"session_id": "a", ' + GOOD + ', "session_id": "b"}', "session_id"),
    "delay": ('{"delay": 1, "delay": 2, "input_length": 5, "output_length": 3}', "delay"),
    "text_input": ('{"text_input": "a", "text_input": "bb", "output_length": 3}', "text_input"),
    "an unknown field": ('{"note": 1, ' + GOOD + ', "note": 2}', "note"),
    "spelt with an escape": ("{" + GOOD + ', "output\\u005flength": 4}', "output_length"),
    "beside a text with colons": (
        '{"text_input": "a: b: c: d", "output_length": 3, "output_length": 4}',
        "output_length",
    ),
    "null, then a value": ('{"delay": null, "delay": 5, "input_length": 5, "output_length": 3}', "delay"),
}


@pytest.mark.parametrize(("text", "field"), REPEATED_FIELDS.values(), ids=REPEATED_FIELDS.keys())
def test_a_field_named_twice_is_refused_naming_it(tmp_path: Path, text: str, field: str) -> None:
    """A line naming a field twice is a `TraceFormatError` naming the file, the line and the field (not read as
    its last value, nor hinting at a block size)."""
    path = write_text(tmp_path / "t.jsonl", ['{"timestamp": 0, "input_length": 1, "output_length": 1}', text])
    with pytest.raises(TraceFormatError) as raised:
        load_trace(path, block_size_tokens=BLOCK)
    assert (raised.value.path, raised.value.line) == (str(path), 2)
    assert raised.value.reason.startswith(f"field '{field}' given twice"), raised.value.reason
    assert "block" not in raised.value.reason


@pytest.mark.parametrize(
    "text",
    [
        '{"text_input": "a: b: c: d", "output_length": 3}',
        '{"meta": {"a": 1, "a": 2}, "input_length": 5, "output_length": 3}',  # a field's own value: not the line's
        '{"note": "x:y", "timestamp": 0, "input_length": 5, "output_length": 3, "hash_ids": [1, 2]}',
    ],
    ids=["colons in a text", "a nested object's repeat", "colons in an unknown field"],
)
def test_a_line_with_more_colons_than_fields_but_no_repeat_reads(tmp_path: Path, text: str) -> None:
    """The lines read again to look for a repeat (more colons than fields) read when none repeats at the top."""
    path = write_text(tmp_path / "t.jsonl", [text])
    assert len(load_trace(path, block_size_tokens=BLOCK, on_caution=lambda _: None)) == 1


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet=':"{},ab\\ ', max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet=":ab", max_size=3), inner, max_size=3),
    max_leaves=8,
)


@given(
    pairs=st.lists(st.tuples(st.text(alphabet=':"ab\\', max_size=3), JSON_VALUES), max_size=6),
    separators=st.sampled_from([(",", ":"), (", ", ": "), (" , ", " :  ")]),
)
def test_check_fields_once_refuses_exactly_a_repeated_top_level_name(
    pairs: list[tuple[str, Any]], separators: tuple[str, str]
) -> None:
    """Against the pairs an object is written from, colons in names and values included: the first top-level
    name written twice is refused, named; an object naming each once passes, whatever its values hold."""
    item, key = separators
    text = "{" + item.join(f"{json.dumps(name)}{key}{json.dumps(value)}" for name, value in pairs) + "}"
    record = json.loads(text)
    names = [name for name, _ in pairs]
    repeated = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if repeated is None:
        check_fields_once(text, record)
    else:
        with pytest.raises(ValueError, match="given twice") as raised:
            check_fields_once(text, record)
        assert str(raised.value) == f"field {repeated!r} given twice (a line names each field once)"


def test_check_field_once_notes_a_name_and_refuses_it_the_second_time() -> None:
    seen: set[str] = set()
    check_field_once("delay", seen)
    assert seen == {"delay"}
    with pytest.raises(ValueError, match="field 'delay' given twice"):
        check_field_once("delay", seen)


def test_a_lenient_read_skips_a_line_naming_a_field_twice_and_loses_its_session(tmp_path: Path) -> None:
    """Skipped, the line's session (read from its text, named once) lost its turn: its later turn is skipped."""
    path = write_text(
        tmp_path / "t.jsonl",
        [
            '{"session_id": "a", "timestamp": 0, "input_length": 5, "output_length": 3, "output_length": 9}',
            '{"timestamp": 1, "input_length": 5, "output_length": 3}',
            '{"session_id": "a", "timestamp": 2, "input_length": 5, "output_length": 3}',
        ],
    )
    skipped: list[SkippedLine] = []
    requests = load_trace(path, block_size_tokens=BLOCK, strict=False, on_skip=skipped.append)
    assert [r.arrival_s for r in requests] == [0.001]
    assert [(s.line, s.reason.split(" (")[0]) for s in skipped] == [
        (1, "field 'output_length' given twice"),
        (3, "session 'a' lost its turn on line 1, which was skipped"),
    ]


def test_a_lenient_read_stops_at_a_session_id_named_twice(tmp_path: Path) -> None:
    """Which of its two sessions lost the turn cannot be told: a lenient read stops there, naming the line."""
    path = write_text(
        tmp_path / "t.jsonl",
        ['{"session_id": "a", "timestamp": 0, "input_length": 5, "output_length": 3, "session_id": "b"}'],
    )
    with pytest.raises(TraceFormatError) as raised:
        load_trace(path, block_size_tokens=BLOCK, strict=False, on_skip=lambda _: None)
    assert raised.value.line == 1 and "field 'session_id' given twice" in raised.value.reason


@pytest.mark.parametrize(
    "text",
    [
        '{"session_id": "a", "session_id": "b", "x": ',
        '{"session_id": "a", "x": 1, "session_id": "a", "y": [1,',
        '{"session_id": "a", "timestamp": NaN, "session_\\u0069d": "b"}',
    ],
    ids=["two ids, cut", "the same id twice, cut", "an escaped second id"],
)
def test_session_in_text_tells_no_session_of_an_id_named_twice(text: str) -> None:
    """The reader's rule for a repeated field (`check_field_once`), not json's last-wins: "cut"."""
    assert session_in_text(text) == TextSession(None, "cut")


def test_session_in_text_reads_a_session_beside_another_repeated_field() -> None:
    assert session_in_text('{"x": 1, "x": 2, "session_id": "a", "y": ') == TextSession("a", None)


# --------------------------------------------------------------------------- an id twice in hash_ids


def test_an_id_repeated_in_hash_ids_is_refused_naming_it(tmp_path: Path) -> None:
    """The reviewer's trace: `[7, 7, 7, 7]` is a `TraceFormatError` naming the file, the line, the id and where it
    repeats; it was read, and counted as reuse of the prompt's own blocks."""
    path = write_text(
        tmp_path / "t.jsonl",
        [
            '{"timestamp": 0, "input_length": 2048, "output_length": 5, "hash_ids": [7, 7, 7, 7]}',
            '{"timestamp": 10, "input_length": 2048, "output_length": 5, "hash_ids": [7, 7, 7, 7]}',
            '{"timestamp": 20, "input_length": 512, "output_length": 5, "hash_ids": [7]}',
        ],
    )
    with pytest.raises(TraceFormatError) as raised:
        load_trace(path)
    assert (raised.value.path, raised.value.line) == (str(path), 1)
    assert raised.value.reason.startswith("field 'hash_ids' repeats id 7 (blocks 0 and 1)"), raised.value.reason
    skipped: list[SkippedLine] = []
    assert len(load_trace(path, strict=False, on_skip=skipped.append)) == 1
    assert [s.line for s in skipped] == [1, 2]


@given(ids=st.lists(st.integers(0, 2**64), min_size=1, max_size=12), data=st.data())
def test_hash_ids_read_exactly_when_none_repeats(ids: list[int], data: st.DataObject) -> None:
    """Any list of ids reads when its ids are distinct; otherwise the first repeated one is named, with its first
    block and the block that repeats it."""
    record = {"input_length": len(ids) * BLOCK, "output_length": 1, "hash_ids": ids}
    first = next((i for i, key in enumerate(ids) if key in ids[:i]), None)
    if first is None:
        assert parse_record(record, BLOCK).hash_ids == tuple(ids)
    else:
        with pytest.raises(ValueError, match=rf"repeats id \d+ \(blocks {ids.index(ids[first])} and {first}\)"):
            parse_record(record, BLOCK)
    position = data.draw(st.integers(0, len(ids)))
    repeated = [*ids[:position], ids[0], *ids[position:]]
    with pytest.raises(ValueError, match="repeats id"):
        parse_record({**record, "input_length": len(repeated) * BLOCK, "hash_ids": repeated}, BLOCK)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_generated_workloads_write_read_back_and_repeat_no_id(tmp_path: Path, name: str) -> None:
    """Each preset's workload keeps every key of a prompt distinct, so it writes and reads back whole, its
    statistics unchanged."""
    workload = list(generate_requests(PRESETS[name], num_requests=300, seed=3))
    assert all(len(set(r.block_keys)) == len(r.block_keys) for r in workload)
    path = tmp_path / "t.jsonl"
    write_trace(path, workload)
    assert trace_stats(load_trace(path, block_size_tokens=PRESETS[name].block_size_tokens)) == trace_stats(workload)


def test_the_synthetic_trace_repeats_no_id_and_no_field(synthetic_trace: Path) -> None:
    """The published trace passes both rules: every line reads."""
    assert len(load_trace(synthetic_trace)) == 3993
