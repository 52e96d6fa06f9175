"""One line of a trace, validated: the fields of the Mooncake format and aiperf's additions.

A line is a JSON object. The Mooncake format defines `timestamp` (ms; other
published traces, Alibaba's Qwen-Bailian ones, keep its fields but time them in
seconds: `time_unit` reads those, and its times are held in ms),
`input_length`, `output_length` and `hash_ids`; the published traces carry all
four. aiperf's `mooncake_trace` loader adds `session_id`, `delay` (ms) and
`text_input` (see `mooncake.workload.trace` for what they mean), and reads
every line as this parser does:

- `timestamp` may be left out (the line then arrives by `delay`, or with the
  lines above it);
- `text_input` replaces `input_length` and `hash_ids` (aiperf refuses either
  beside it, and so does this parser);
- `hash_ids` may be left out beside `input_length` (aiperf then makes up a
  prompt of its own for the line, so it shares nothing);
- a field given as `null` is absent (as Dynamo's trace writer leaves a field it
  has no value for, and aiperf reads it);
- a whole-number float is that integer (`6758.0`, as pandas writes a column
  that held a gap), below 2**53: a float `hash_ids` element of 2**53 or more is
  refused, since it names no one integer and distinct ids would merge.

`output_length` is required: aiperf lets the server choose, but a request here
has a known output. A line names each field once (`check_field_once`; the
reader checks the line's text, `check_fields_once`), and no id twice in its
`hash_ids` (`check_distinct_ids`: chained ids name whole prefixes). A field
present with a wrong type is an error naming it and its value; fields neither
format defines are ignored, but aiperf's other prompt forms (`messages`,
`payload`) are refused by name.

Values are bounded so that no line can make the reader fail or stall:
times lie in [0, 2**43] ms (up to the year 2248 as epoch milliseconds, each
held to a microsecond as float seconds, and sums of them stay exact; epoch
microseconds read as milliseconds would be past it, and are refused, not
replayed a thousand times too slowly),
lengths in [1, 2**24] tokens (past any model's context; a line without
`hash_ids` makes the reader invent a key per block), `hash_ids` in
[0, 2**256) (a `Request`'s keys, `mooncake.types.BLOCK_KEY_LIMIT`). JSON's NaN and Infinity
never reach here (the reader refuses them as not JSON).

Invariant: a parsed record has `0 < input_length <= MAX_LINE_TOKENS` tokens
and, when it has `hash_ids`, exactly ceil(input_length / block_size) of them,
all distinct.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any, Literal

import attrs

from mooncake._checks import shown
from mooncake._json import check_depth
from mooncake.types import BLOCK_KEY_LIMIT, block_count, repeated_key

__all__ = [
    "AIPERF_FIELDS",
    "MAX_ARRIVAL_S",
    "MAX_LINE_MS",
    "MAX_LINE_TOKENS",
    "MOONCAKE_FIELDS",
    "TIME_UNITS",
    "TextSession",
    "TimeUnit",
    "TraceRecord",
    "arrival_problem",
    "check_block_count",
    "check_distinct_ids",
    "check_field_once",
    "check_fields_once",
    "parse_record",
    "session_in_text",
    "session_of",
]

MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
"""The fields of the Mooncake format."""

AIPERF_FIELDS = ("session_id", "delay", "text_input")
"""The fields aiperf adds to the Mooncake format."""

UNSUPPORTED_PROMPTS = ("messages", "payload")
"""aiperf's other ways to give a line's prompt, which this reader does not take."""

MAX_LINE_MS = 2**43
"""Largest `timestamp` or `delay` (ms, 279 years): as float seconds, a time up to it keeps microseconds (2**-19 s
apart at most), and an integer count of ms is exact."""

MAX_ARRIVAL_S = MAX_LINE_MS / 1000
"""Latest arrival (s) a replay takes, however a speed-up, a generator or a horizon puts it: `MAX_LINE_MS`'s, so
simulated times keep microseconds (past ~2**53 intervals a step added to the clock leaves it where it was)."""


def arrival_problem(arrival_s: float) -> str | None:
    """None if a replay can time an arrival at `arrival_s` seconds (up to `MAX_ARRIVAL_S`, the bound itself
    included), else the phrase saying why not. The one check of that bound: the trace reader (after a speed-up),
    the replay and the examples' generated workloads each say which arrival and when, then this."""
    if arrival_s <= MAX_ARRIVAL_S:  # NaN fails this too
        return None
    return f"past the {MAX_ARRIVAL_S:.4g} s (2**43 ms) a replay can time"


TimeUnit = Literal["ms", "s", "us"]
"""What a trace's `timestamp` and `delay` count: milliseconds (the Mooncake format), seconds or microseconds."""

TIME_UNITS: dict[str, float] = {"ms": 1.0, "s": 1000.0, "us": 0.001}
"""Milliseconds per unit of each `TimeUnit`."""

ARRAY_HINT = " (a trace is JSON Lines: one object per line, not a JSON array)"

MAX_LINE_TOKENS = 2**24
"""Largest `input_length`, `output_length` or `text_input` (tokens, bytes for text)."""


@attrs.frozen(kw_only=True)
class TraceRecord:
    """The fields of one trace line, checked one by one (arrival rules need the lines around it).

    Attributes:
        timestamp_ms: absolute arrival in ms from the trace start, if given.
        delay_ms: aiperf's wait after the session's previous turn, if given.
        session_id: aiperf's multi-turn session, if given.
        input_length: tokens the line describes (for `text_input`, its UTF-8 bytes).
        output_length: tokens to generate.
        hash_ids: the line's block ids, if given.
        text: `text_input` as UTF-8 bytes, if given.
    """

    timestamp_ms: float | None
    delay_ms: float | None
    session_id: str | None
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] | None
    text: bytes | None


def _present(record: dict[str, Any], name: str) -> bool:
    """Whether the line gives `name` a value (`null` is no value)."""
    return record.get(name) is not None


def _whole(value: Any) -> Any:
    """A whole-number float as its int (pandas' 6758.0); anything else as it is."""
    return int(value) if type(value) is float and value.is_integer() else value


def _field(record: dict[str, Any], name: str, *, integer: bool) -> Any:
    if not _present(record, name):
        raise ValueError(f"missing field '{name}'" + (" (it is null)" if name in record else ""))
    value = _whole(record[name]) if integer else record[name]
    allowed = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, allowed):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"field '{name}' must be {kind}, got {shown(value)}")
    return value


def _milliseconds(record: dict[str, Any], name: str, unit: TimeUnit) -> float:
    value = _field(record, name, integer=False)
    scale = TIME_UNITS[unit]
    # An int is compared as an int: float() of one past 1e308 would overflow.
    bound = MAX_LINE_MS if unit == "ms" else MAX_LINE_MS / scale
    if (isinstance(value, float) and not math.isfinite(value)) or not 0 <= value <= bound:
        upper = "2**43" if unit == "ms" else f"{bound:.15g}"
        # Epoch microseconds (1.7e15 in 2024) read as milliseconds are past the bound: say so.
        micro = unit == "ms" and 0 < value <= 2**64
        hint = " (is the trace timed in microseconds? time_unit / --time-unit us)" if micro else ""
        raise ValueError(f"field '{name}' must be a number of {unit} in [0, {upper}], got {shown(value)}{hint}")
    return value if unit == "ms" else value * scale  # type: ignore[no-any-return]  # ms as written: int or float


def _positive(record: dict[str, Any], name: str) -> int:
    value: int = _field(record, name, integer=True)
    if value <= 0:
        raise ValueError(f"field '{name}' must be positive, got {shown(value)}")
    if value > MAX_LINE_TOKENS:
        raise ValueError(f"field '{name}' must be at most 2**24 tokens, got {shown(value)}")
    return value


def _text(record: dict[str, Any]) -> bytes:
    value = record["text_input"]
    if not isinstance(value, str) or not value:
        raise ValueError(f"field 'text_input' must be a non-empty string, got {shown(value)}")
    for other in ("input_length", "hash_ids"):
        if _present(record, other):
            raise ValueError(f"field '{other}' cannot go with 'text_input' (the text gives the prompt)")
    try:
        text = value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"field 'text_input' is not valid Unicode: {error.reason} at {error.start}") from error
    if len(text) > MAX_LINE_TOKENS:
        raise ValueError(f"field 'text_input' must be at most 2**24 bytes, got {len(text)}")
    return text


# The block sizes traces are keyed in (vLLM's 16 to 128, Mooncake's 512 and powers of two around them), tried for a
# hint when a line's hash_ids do not fit the one asked for: Alibaba's Qwen traces keep Mooncake's fields in 16-token
# blocks.
_BLOCK_SIZES = tuple(2**k for k in range(13))

_EXACT_FLOAT_IDS = 2.0**53
"""Whole floats below this are exact integers; a `hash_ids` float of it or more is refused."""


def _hash_ids(record: dict[str, Any], input_length: int, block_size_tokens: int) -> tuple[int, ...]:
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list):
        raise ValueError(f"field 'hash_ids' must be a list of integers, got {shown(hash_ids)}")
    if not all(type(h) is int for h in hash_ids):  # converted only when needed: every line of a trace passes here
        for h in hash_ids:
            # From 2**53 on a float is no one integer (2**53 + 1 reads as 2**53): distinct 64-bit ids, as a float
            # column writes them, would merge into one key and share a prefix they do not.
            if type(h) is float and h >= _EXACT_FLOAT_IDS:
                raise ValueError(
                    f"field 'hash_ids' holds the float {shown(h)}, at least 2**53, where a float names no one integer "
                    "(distinct ids would merge): write the ids as integers"
                )
        hash_ids = [_whole(h) for h in hash_ids]
        for h in hash_ids:
            if type(h) is not int:  # None too (a JSON null)
                raise ValueError(f"field 'hash_ids' must be a list of integers, got an element {shown(h)}")
    if hash_ids and min(hash_ids) < 0:
        raise ValueError(f"field 'hash_ids' must hold non-negative ids, got {shown(min(hash_ids))}")
    # A Request's keys lie below 2**256 (the widest an SSD page labels): refused here, where the line is named.
    if hash_ids and max(hash_ids) >= BLOCK_KEY_LIMIT:
        raise ValueError(f"field 'hash_ids' must hold ids below 2**256, got {shown(max(hash_ids))}")
    check_block_count(len(hash_ids), input_length, block_size_tokens)
    check_distinct_ids(hash_ids)
    return tuple(hash_ids)


def check_distinct_ids(hash_ids: Sequence[int]) -> None:
    """A line's `hash_ids` must all differ (the reader's rule, and the writer's): block i's id names its whole
    prefix, blocks 0 to i, so no two blocks of one prompt share one. A repeated id would also count as a cache hit
    on the prompt's own earlier block (`trace_stats`' reuse, a replay's prefix match).

    Raises:
        ValueError: an id given twice, naming it and its two blocks.
    """
    repeat = repeated_key(hash_ids)
    if repeat is not None:
        raise ValueError(
            f"field 'hash_ids' repeats id {shown(repeat[2])} (blocks {repeat[0]} and {repeat[1]}): a chained id names "
            "its block's whole prefix, so no id repeats within one prompt"
        )


def check_block_count(count: int, input_length: int, block_size_tokens: int) -> None:
    """A line's `count` hash_ids must be ceil(input_length / block_size_tokens), one per block, the partial last
    one included (the reader's rule, and the writer's).

    Raises:
        ValueError: another count, naming a block size it would fit where exactly one does.
    """
    expected = block_count(input_length, block_size_tokens)
    if count != expected:
        fits = [size for size in _BLOCK_SIZES if block_count(input_length, size) == count]
        hint = (
            f"the count fits {fits[0]}-token blocks: block_size_tokens / --block-size {fits[0]}"
            if len(fits) == 1
            else "is the trace keyed in another block size? block_size_tokens / --block-size"
        )
        raise ValueError(
            f"{count} hash_ids for input_length {input_length}: expected "
            f"ceil({input_length}/{block_size_tokens}) = {expected} ({hint})"
        )


def check_field_once(name: str, seen: set[str]) -> None:
    """Note a line's top-level field `name`, read after the fields in `seen`: the one rule for a repeated field,
    which the reader (`check_fields_once`) and `session_in_text` both follow. A line names each field once: JSON
    leaves a repeated name's meaning open and Python's reader keeps the last, so `{"output_length": 5,
    "output_length": 5000}` would read as 5000 whatever its writer meant, and a repeated `session_id` names no one
    session.

    Raises:
        ValueError: `name` is in `seen` already, naming it.
    """
    if name in seen:
        raise ValueError(f"field {shown(name)} given twice (a line names each field once)")
    seen.add(name)


def check_fields_once(text: str, record: dict[str, Any]) -> None:
    """Check by `check_field_once` that the JSON object `text`, which read as `record`, names no field twice.

    Cheap for a trace's lines: each field of an object takes a colon of the text, so a text with no more colons
    than `record` has fields names each once; only a text with more (a `text_input` holding colons, a nested
    object) is read again, its fields in order. An object_pairs_hook on every line would cost the reader a tenth
    of its time.

    Raises:
        ValueError: the first field named twice.
    """
    if text.count(":") <= len(record):
        return
    seen: set[str] = set()
    # The text read as `record` already: it reads again. Its top level is an object, so its pairs come back.
    for name, _ in json.loads(text, object_pairs_hook=tuple):
        check_field_once(name, seen)


def session_of(record: object) -> str | None:
    """The line's `session_id` when it is a usable one, even if the rest of the line is not."""
    if isinstance(record, dict):
        value = record.get("session_id")
        if isinstance(value, str) and value:
            return value
    return None


@attrs.frozen
class TextSession:
    """What the text of a line that is no JSON (cut short, as a truncated write leaves it) shows of its session.

    Attributes:
        session_id: its `session_id` as `session_of` would read it, when the text holds it whole and usable.
        doubt: None when the text shows the line's session, or that it has none; else why it does not:
            "cut": it names a session_id that cannot be read whole (cut short, or with a byte that is no UTF-8),
            names one twice, or holds one past where it stops reading (a line run into the next);
            "unread": it breaks off before its end, and before any session_id shows.
    """

    session_id: str | None
    doubt: Literal["cut", "unread"] | None


# A key, not the words in a string (escaped quotes), without its closing quote: a line may break off there.
_SESSION_KEY = re.compile(r'(?<!\\)"session_id')
_DECODER = json.JSONDecoder()
_BLANKS = " \t\n\r\ufeff"  # JSON's whitespace, and a byte-order mark (files joined with cat)
_WHITESPACE = re.compile(r"[ \t\n\r]*")


def _value_at(text: str, position: int) -> tuple[Any, int] | None:
    """The JSON value at `position` and the index past it, or None when none can be read there."""
    try:
        check_depth(text, position)
        return _DECODER.raw_decode(text, position)
    except ValueError:  # a JSONDecodeError, too many digits, nested too deep (NestingError)
        return None


def _skip_blanks(text: str, position: int) -> int:
    blanks = _WHITESPACE.match(text, position)  # a match everywhere: `*`
    return position if blanks is None else blanks.end()


def session_in_text(text: str) -> TextSession:
    """The session of a line that is no JSON, read from its text as far as it is a JSON object.

    The line's top-level fields are read one by one, as `json.loads` would, up to where the text breaks off; a
    `session_id` given twice names no session that can be told ("cut"), by the reader's rule for a repeated field
    (`check_field_once`). A text that is no object (CSV, an array) names no session unless it holds a
    `"session_id"` key.

    Returns:
        The session it names, or why that cannot be told (`TextSession.doubt`).
    """
    text = text.lstrip(_BLANKS)
    if not text.startswith("{"):
        return TextSession(None, "cut" if _SESSION_KEY.search(text) else None)
    session_id: str | None = None
    named = False  # a session_id showed, usable or not
    seen: set[str] = set()  # the fields read
    position = 1
    while True:
        position = unread = _skip_blanks(text, position)
        if text.startswith("}", position):  # read to its end: anything after it is another line run into it
            if _SESSION_KEY.search(text, position + 1):
                return TextSession(None, "cut")
            return TextSession(session_id, None)
        key = _value_at(text, position)
        if key is None or not isinstance(key[0], str):
            break
        name, position = key
        try:
            check_field_once(name, seen)
        except ValueError:
            if name == "session_id":  # given twice, it names no one session: whichever of them lost this turn
                return TextSession(None, "cut")
        position = _skip_blanks(text, position)
        if not text.startswith(":", position):
            if name == "session_id":
                return TextSession(None, "cut")
            break
        position = unread = _skip_blanks(text, position + 1)
        value = _value_at(text, position)
        if name == "session_id":
            if position == len(text) or (text[position] == '"' and value is None):
                return TextSession(None, "cut")
            if value is not None and isinstance(value[0], str):
                # A byte that is no UTF-8 reads as a lone surrogate (surrogateescape), which the text of no valid
                # line holds (an escaped one is ASCII there): the id read is not the id written.
                if any("\udc80" <= c <= "\udcff" for c in text[position : value[1]]):
                    return TextSession(None, "cut")
                session_id = value[0] or None
            else:
                session_id = None  # null, a number...: no session, as `session_of` reads it
            named = True
        if value is None:
            break
        position = unread = _skip_blanks(text, value[1])
        if text.startswith(",", position):
            position += 1
        elif not text.startswith("}", position):
            break
    if _SESSION_KEY.search(text, unread):  # past what was read (a key read as "inp{" included): one it holds
        return TextSession(None, "cut")
    return TextSession(session_id, None if named else "unread")


def parse_record(record: object, block_size_tokens: int, *, time_unit: TimeUnit = "ms") -> TraceRecord:
    """Validate one decoded JSON line, its times counted in `time_unit` (held in ms).

    Raises:
        ValueError: the line is not a usable record; the message names the field and value.
    """
    if not isinstance(record, dict):
        hint = ARRAY_HINT if isinstance(record, list) else ""
        raise ValueError(f"expected a JSON object, got {type(record).__name__}{hint}")
    for other in UNSUPPORTED_PROMPTS:
        if _present(record, other):
            raise ValueError(
                f"field '{other}' is not supported: a line's prompt is input_length (with hash_ids) or text_input"
            )
    session_id = None
    if _present(record, "session_id"):
        session_id = session_of(record)
        if session_id is None:
            raise ValueError(f"field 'session_id' must be a non-empty string, got {shown(record['session_id'])}")
    timestamp = _milliseconds(record, "timestamp", time_unit) if _present(record, "timestamp") else None
    delay = _milliseconds(record, "delay", time_unit) if _present(record, "delay") else None
    text = _text(record) if _present(record, "text_input") else None
    if text is None:
        input_length: int = _field(record, "input_length", integer=True)
        output_length: int = _field(record, "output_length", integer=True)
        _positive(record, "input_length")
    else:
        input_length = len(text)
        output_length = _field(record, "output_length", integer=True)
    _positive(record, "output_length")
    hash_ids = (
        _hash_ids(record, input_length, block_size_tokens) if text is None and _present(record, "hash_ids") else None
    )
    return TraceRecord(
        timestamp_ms=timestamp,
        delay_ms=delay,
        session_id=session_id,
        input_length=input_length,
        output_length=output_length,
        hash_ids=hash_ids,
        text=text,
    )
