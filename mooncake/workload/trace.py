"""Mooncake-format traces, as Mooncake publishes them and as aiperf writes them.

JSON Lines, one request per line, plain or gzip-compressed (`.jsonl.gz`; the
reader goes by the file's first bytes, the writer by a `.gz` name):

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

`timestamp` is the arrival in milliseconds from the trace start (`time_unit`
reads traces that keep these fields but count seconds, as Alibaba's Qwen-Bailian
traces do, or microseconds; a millisecond trace whose timestamps have fractions
of a millisecond gets one warning that it may be timed in seconds, and one with
a field neither format defines, as a misspelt `Timestamp` or `hash_id` would
be read as absent, one warning naming it); `hash_ids` are
the chained ids of the prompt's blocks of `block_size_tokens` (512 in the
published traces), the last partial block included, so there are exactly
ceil(input_length / block_size) of them.

aiperf's `mooncake_trace` loader (ai-dynamo/aiperf: `MooncakeTrace` in
src/aiperf/dataset/loader/models.py, the loader in loader/mooncake_trace.py,
turn timing in src/aiperf/timing/strategies/fixed_schedule.py, session replay
in docs/reference/conversation-context-mode.md) also reads `session_id` (the
turns of one conversation), `delay` (ms to wait after the session's previous
turn, instead of `timestamp`) and `text_input` (the prompt's literal text,
instead of `input_length` and `hash_ids`). Here (details in
`mooncake.workload.assembly`):

- a turn without `timestamp` arrives `delay` after its session's previous turn
  (aiperf counts from that turn's response, unknown to a trace); a session's
  first line without one arrives with the latest session start above it;
- a session's later turn is the whole conversation so far, as aiperf sends it:
  earlier prompt, earlier output, then the line's own tokens; it reuses the
  earlier prompt's full blocks, the rest of its keys are its own;
- `text_input` becomes byte tokens (its UTF-8), keyed by a documented byte rule,
  and the request carries them as `tokens`.

Reading validates every line (`mooncake.workload.trace_record`) and, strict by
default, raises `TraceFormatError` naming file and line at the first bad one:
invalid JSON, a missing or wrongly typed field, a field given twice (JSON leaves
its meaning open; Python's reader keeps the last), a non-positive length, a
wrong `hash_ids` count or an id repeated in it, an arrival out of order. With `strict=False` such lines are
skipped instead, each reported as a `SkippedLine` (file, line, why); a session
turn after a skipped one of its session is skipped too. A line that is no JSON
(a truncated write) is tied to its session by its text
(`trace_record.session_in_text`): its top-level fields as far as they read. A
lenient read still stops, naming the line, at a start that `MAX_LINES_BEHIND`
(10) lines in a row after it arrive before (`TraceAssembler.doubtful_start`):
one timestamp typo would otherwise cost every line after it; and at a line that
is no JSON whose session cannot be told, though the trace has sessions: its
`session_id` is cut short, or it breaks off before one shows while some line,
above or below, names a session (`TraceAssembler.doubtful_loss`): some
session's later turns would be built without it. Blank lines are ignored, as
are fields neither format defines.

A trace slightly out of order (logs merged with jitter) reads with `sort=True`
(`--sort`): the whole file is read, its lines stable-sorted by timestamp, then
placed as above, each still named by its line in the file. It refuses a line
that names a session or has no timestamp: the order of the lines decides which
turn of its session a line is, and when a line without a timestamp arrives.

`iter_trace` streams: it holds a request back only until no later line can
arrive before it (a trace without sessions holds none; sessions written
grouped hold their later turns until the trace's other sessions catch up) and
remembers each session's latest turn. `load_trace` returns nothing unless the
whole file reads. Writing goes to a temporary file renamed into place, so a
trace is written whole or not at all (through a symbolic link, to the file it
leads to; a FIFO or /dev/stdout, a stream, is written as it goes: see
`mooncake._files.atomic_path`); gzip output is byte-for-byte repeatable.
"""

from __future__ import annotations

import codecs
import gzip
import io
import json
import os
import sys
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator
from heapq import heappop, heappush
from pathlib import Path
from typing import Any, Literal

import attrs
import numpy as np

from mooncake import _json
from mooncake._checks import require_int, require_iterable, require_number, shown
from mooncake._files import atomic_path, names_a_file
from mooncake._json import NestingError
from mooncake.errors import ConfigError, InvalidRequestError, TraceFormatError
from mooncake.types import Request, RequestId
from mooncake.workload.assembly import TraceAssembler, Turn, text_block_keys
from mooncake.workload.trace_record import (
    AIPERF_FIELDS,
    ARRAY_HINT,
    MAX_LINE_MS,
    MOONCAKE_FIELDS,
    TIME_UNITS,
    TimeUnit,
    TraceRecord,
    arrival_problem,
    check_block_count,
    check_fields_once,
    parse_record,
    session_in_text,
    session_of,
)

__all__ = [
    "SkippedLine",
    "TIME_UNITS",
    "TRACE_BLOCK_SIZE_TOKENS",
    "TRACE_FORMS",
    "TimeUnit",
    "TraceForm",
    "iter_trace",
    "load_trace",
    "text_request",
    "write_trace",
]

_KNOWN_FIELDS = frozenset(MOONCAKE_FIELDS + AIPERF_FIELDS)

TRACE_BLOCK_SIZE_TOKENS = 512
"""Block size of the published Mooncake traces."""

TraceForm = Literal["mooncake", "aiperf"]
"""How `write_trace` spells a request: Mooncake's four fields, or aiperf's `text_input` where the prompt is text."""

TRACE_FORMS: tuple[TraceForm, ...] = ("mooncake", "aiperf")

_GZIP_MAGIC = b"\x1f\x8b"


@attrs.frozen
class SkippedLine:
    """A line a lenient read left out, and why."""

    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


class _Prefixed(io.RawIOBase):
    """A stream that reads `head`, then the rest of `rest`: the bytes read to tell the format, put back in front
    (a pipe cannot seek back to them)."""

    def __init__(self, head: bytes, rest: io.BufferedReader) -> None:
        self._head = head
        self._rest = rest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        if not self._head:
            return self._rest.readinto(buffer)
        count = min(len(buffer), len(self._head))
        memoryview(buffer)[:count] = self._head[:count]
        self._head = self._head[count:]
        return count


def _lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, bytes]]:
    """(1-based number, raw line) of a plain or gzip file; a broken gzip stream is a TraceFormatError.

    Raises:
        OSError: the file cannot be opened or read; it always names the file.
    """
    with open(path, "rb") as raw:
        number = 0
        try:
            # read() waits for both bytes (or the end); peek() gives what has come so far, from a pipe perhaps 1 byte,
            # and a gzip stream whose first write is one byte would be read as text.
            head = raw.read(len(_GZIP_MAGIC))
            data = io.BufferedReader(_Prefixed(head, raw))
            stream: Iterable[bytes] = gzip.GzipFile(fileobj=data, mode="rb") if head == _GZIP_MAGIC else data
            for number, line in enumerate(stream, start=1):
                yield number, line
        except (EOFError, zlib.error, gzip.BadGzipFile) as error:
            raise TraceFormatError(path, number + 1, f"broken gzip stream: {error}") from error
        except OSError as error:
            if error.filename is not None:
                raise
            # A read that fails (EIO) names no file: name it, so one line says which.
            raise type(error)(error.errno, error.strerror, os.fspath(path)) from error


_BLANK = object()
_UNREAD = object()  # a line's record before `_record` returns


def _not_json(name: str) -> Any:
    raise ValueError(f"invalid JSON: {name} is not a JSON number")


_COMPRESSED = {b"\xfd7zXZ\x00": "xz", b"BZh": "bzip2", b"\x28\xb5\x2f\xfd": "zstd"}


def _hint(line: str) -> str:
    """What a line that is no JSON object may be instead, for the error: another format than JSON Lines."""
    data = line.encode("utf-8", "surrogateescape")
    packed = next((name for magic, name in _COMPRESSED.items() if data.startswith(magic)), None)
    text = line.strip()
    if packed is not None:
        return f" (a {packed}-compressed file? only plain and gzip traces are read)"
    if text.startswith("["):
        return ARRAY_HINT
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return " (a UTF-16 file? a trace is UTF-8)"
    if text.startswith("\ufeff"):
        return " (a byte-order mark past line 1: files joined with cat? only the file's first line may have one)"
    if text == "{":
        return " (a trace is JSON Lines: each request's object on one line, not pretty-printed)"
    if "," in text and not text.startswith("{"):
        return " (a trace is JSON Lines, not CSV: one object per line with timestamp, input_length, ...)"
    return ""


def _record(raw: bytes) -> Any:
    """The line's decoded JSON, or `_BLANK`.

    Raises:
        ValueError: whatever the line holds: not UTF-8, not JSON (NaN and
            Infinity, which Python's reader takes, included), a number of more
            digits than Python converts, nesting deeper than its recursion, an
            object naming a field twice (`check_fields_once`).
    """
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        hint = _hint(raw.decode("utf-8", "surrogateescape"))
        raise ValueError(f"not UTF-8: byte {raw[error.start]:#04x} at column {error.start + 1}{hint}") from error
    if not line.strip():
        return _BLANK
    try:
        # Without its line ending: a line cut short is then reported at its end, not at column 1 of the next.
        text = line.rstrip("\r\n")
        record = _json.loads(text, parse_constant=_not_json)
    except NestingError as error:
        raise ValueError(f"invalid JSON: {error}") from error
    except json.JSONDecodeError as error:
        # A JSON array of requests (pretty-printed), a pretty-printed object, a CSV trace or a compressed file fail
        # on their first line: say what a trace is.
        # Some of json's messages end in "at" ("Unterminated string starting at"), for a place to follow.
        message = error.msg.removesuffix(" at")
        raise ValueError(f"invalid JSON: {message} at column {error.colno}{_hint(line)}") from error
    except ValueError as error:
        if str(error).startswith("invalid JSON"):
            raise
        # int() refuses to read more digits than sys.get_int_max_str_digits().
        raise ValueError(f"invalid JSON: a number of over {sys.get_int_max_str_digits()} digits") from error
    if isinstance(record, dict):
        check_fields_once(text, record)  # json.loads keeps a repeated field's last value
    return record


def _warn(skipped: SkippedLine) -> None:
    warnings.warn(f"skipped {skipped}", stacklevel=2)


def _caution(message: str) -> None:
    warnings.warn(message, stacklevel=2)


def iter_trace(
    path: str | os.PathLike[str],
    *,
    block_size_tokens: int = TRACE_BLOCK_SIZE_TOKENS,
    speedup: float = 1.0,
    strict: bool = True,
    on_skip: Callable[[SkippedLine], object] | None = None,
    time_unit: TimeUnit = "ms",
    on_caution: Callable[[str], object] | None = None,
    sort: bool = False,
) -> Iterator[Request]:
    """Stream the requests of a trace in arrival order, validating each line as it is read.

    Args:
        path: the JSONL trace, plain or gzip.
        block_size_tokens: tokens per hash id.
        speedup: replay speed; 2.0 halves every arrival.
        strict: raise at the first unusable line (the default), or skip it (but see Raises).
        on_skip: told of each line a lenient read skips (default: a warning each).
        time_unit: what `timestamp` and `delay` count: "ms" (the Mooncake format), "s" or "us".
        on_caution: told, once each, that a millisecond trace has timestamps with fractions of a millisecond
            (the first, by file and line), as a trace timed in seconds has, and of the first line with a field
            neither format defines (ignored: a misspelt field reads as absent) (default: a warning).
        sort: read the whole file, then take its lines in timestamp order (file order among equal timestamps):
            for a trace slightly out of order, as merged logs are. What is said of a line still names its line
            in the file. Only for a trace without sessions whose every line has a timestamp.

    Yields:
        Requests with ids "0", "1", ... in arrival order (file order among equal
        arrivals) and ``arrival_s = arrival_ms / 1000 / speedup``.

    Raises:
        TraceFormatError: at the first unusable line when strict, at a broken gzip stream, at the first
            arrival that `speedup` puts past `MAX_ARRIVAL_S` (2**43 ms, the bound on a timestamp), and, lenient,
            naming a line whose arrival the `MAX_LINES_BEHIND` (10) lines after it, none read between, are all
            left out for preceding (its timestamp is likely wrong, or the trace unsorted; skipping on would lose
            the rest of the trace); with `sort`, at a line that names a session or has no timestamp (its place in
            the file decides its turn or arrival).
        ConfigError: for invalid options.
    """
    # Checked here, not in the generator, so that bad options fail at the call.
    _check_path(path)
    for name, callback in (("on_skip", on_skip), ("on_caution", on_caution)):
        if callback is not None and not callable(callback):  # else a TypeError at the first bad line, hours in
            raise ConfigError(f"{name} must be a callable or None, got {shown(callback)}")
    block_size_tokens = require_int("block_size_tokens", block_size_tokens, minimum=1)
    speedup = require_number("speedup", speedup, minimum=0, strict=True)
    for name, flag in (("strict", strict), ("sort", sort)):
        if not isinstance(flag, bool):
            raise ConfigError(f"{name} must be a bool, got {shown(flag)}")
    if not isinstance(time_unit, str) or time_unit not in TIME_UNITS:
        raise ConfigError(f"time_unit must be one of {', '.join(TIME_UNITS)}, got {shown(time_unit)}")
    entries = _entries(path, block_size_tokens, time_unit)
    if sort:
        entries = _sorted(path, entries)
    return _read(path, entries, block_size_tokens, speedup, strict, on_skip or _warn, time_unit, on_caution or _caution)


def _check_path(path: object) -> None:
    if not isinstance(path, str | os.PathLike):  # open() would take an int as a file descriptor
        raise ConfigError(f"a trace path must be a str or os.PathLike, got {shown(path)}")
    if "\0" in os.fspath(path):  # open() raises a bare ValueError for it
        raise ConfigError(f"a trace path cannot hold a NUL byte, got {shown(os.fspath(path))}")


_Entry = tuple[int, bytes, Any, TraceRecord | ValueError]
"""A line that is not blank: its number, its bytes, its JSON (`_UNREAD` if it is none), its record or why none."""

_UNSORTED_HINT = " (is the trace unsorted? sort=True / --sort reads it sorted by timestamp)"


def _entries(path: str | os.PathLike[str], block_size_tokens: int, time_unit: TimeUnit) -> Iterator[_Entry]:
    """The lines that are not blank, in file order, each read as far as it goes."""
    for number, raw in _lines(path):
        data = raw[3:] if number == 1 and raw.startswith(codecs.BOM_UTF8) else raw  # Windows' BOM
        record: Any = _UNREAD
        try:
            record = _record(data)
            if record is _BLANK:
                continue
            parsed: TraceRecord | ValueError = parse_record(record, block_size_tokens, time_unit=time_unit)
        except ValueError as error:
            parsed = error
        yield number, data, record, parsed


def _sorted(path: str | os.PathLike[str], entries: Iterable[_Entry]) -> Iterator[_Entry]:
    """`entries`, those with no record as they come, then those with one stable-sorted by timestamp.

    The whole file is read, its records held, before the first of them comes out; each keeps its line number.

    Raises:
        TraceFormatError: a line names a session (the order of its lines decides each session's turns) or has no
            timestamp (its place in the file decides its arrival): sorting would change what the trace says.
    """
    keyed: list[tuple[float, _Entry]] = []
    for number, data, record, parsed in entries:
        if isinstance(parsed, ValueError):
            if record is not _UNREAD:
                named = session_of(record) is not None
            else:  # no JSON (a truncated write): its session, if its text shows one
                found = session_in_text(data.decode("utf-8", "surrogateescape"))
                named = found.session_id is not None or found.doubt == "cut"
            if named:
                raise _unsortable(path, number, "the line names a session")
            yield number, data, record, parsed  # skipped (or raised) where it is read
        elif parsed.session_id is not None:
            raise _unsortable(path, number, f"the line names session {shown(parsed.session_id)}")
        elif parsed.timestamp_ms is None:
            raise TraceFormatError(
                path,
                number,
                "the line has no timestamp: it arrives by its place in the file (its delay after the latest line "
                "above), which sorting would change; a trace read sorted (sort=True / --sort) needs one on each line",
            )
        else:
            keyed.append((parsed.timestamp_ms, (number, b"", record, parsed)))  # its bytes: read for no record
    keyed.sort(key=lambda item: item[0])  # stable: file order among equal timestamps
    for _, entry in keyed:
        yield entry


def _unsortable(path: str | os.PathLike[str], number: int, what: str) -> TraceFormatError:
    return TraceFormatError(
        path,
        number,
        f"{what}: a trace with sessions cannot be read sorted (sort=True / --sort), since the order of its lines "
        "decides which turn of its session each line is",
    )


def _place(assembler: TraceAssembler, record: TraceRecord, number: int, *, has_sessions: bool) -> Turn:
    """`assembler.place`, whose refusal of a start before the latest one, in a trace without sessions (the
    Mooncake rule that timestamps never decrease), says that a sorted read takes the trace.

    Raises:
        ValueError: as `assembler.place`.
    """
    stamp = record.timestamp_ms
    unsorted = not has_sessions and stamp is not None and stamp < assembler.mark_ms
    try:
        return assembler.place(record, number)
    except ValueError as error:
        if unsorted:
            raise ValueError(f"{error}{_UNSORTED_HINT}") from error
        raise


def _read(
    path: str | os.PathLike[str],
    entries: Iterable[_Entry],
    block_size_tokens: int,
    speedup: float,
    strict: bool,
    on_skip: Callable[[SkippedLine], object],
    time_unit: TimeUnit,
    on_caution: Callable[[str], object],
) -> Iterator[Request]:
    assembler = TraceAssembler(block_size_tokens)
    held: list[tuple[float, int, Turn]] = []
    index = 0
    cautioned = time_unit != "ms"
    strange = False  # a field neither format defines was cautioned about
    has_sessions = False  # a line read named a session: a sorted read, which refuses them, is no help
    for number, data, record, parsed in entries:
        try:
            if isinstance(parsed, ValueError):
                raise parsed
            has_sessions = has_sessions or parsed.session_id is not None
            turn = _place(assembler, parsed, number, has_sessions=has_sessions)
        except ValueError as error:
            if strict:
                raise TraceFormatError(path, number, str(error)) from error
            _lose(assembler, path, number, data, record, error)
            if (loss := assembler.doubtful_loss()) is not None:
                raise TraceFormatError(path, *loss) from error
            on_skip(SkippedLine(os.fspath(path), number, str(error)))
            if (doubt := assembler.doubtful_start()) is not None:  # one bad line must not cost the rest
                raise TraceFormatError(path, *doubt) from error
            continue
        if (loss := assembler.doubtful_loss()) is not None:
            raise TraceFormatError(path, *loss)
        if not strange and (unknown := record.keys() - _KNOWN_FIELDS):
            strange = True
            on_caution(
                f"{os.fspath(path)}:{number}: not a trace field: {_names(unknown)} (the Mooncake "
                f"format has {', '.join(MOONCAKE_FIELDS)}; aiperf adds {', '.join(AIPERF_FIELDS)}): ignored, so a "
                "misspelt field reads as absent"
            )
        stamp = parsed.timestamp_ms
        if not cautioned and isinstance(stamp, float) and not stamp.is_integer():
            cautioned = True  # Mooncake's traces count whole milliseconds; Qwen-Bailian's seconds, to the ms
            on_caution(
                f"{os.fspath(path)}:{number}: timestamp {stamp} has a fraction of a millisecond: if the trace is "
                "timed in seconds (as Alibaba's Qwen-Bailian traces are), read it with time_unit='s' (--time-unit s)"
            )
        heappush(held, (turn.arrival_ms, number, turn))
        # No later line arrives before the mark, so everything up to it is in its final order.
        while held and held[0][0] <= assembler.mark_ms:
            yield _request(path, *heappop(held)[1:], index, speedup, block_size_tokens)
            index += 1
    while held:
        yield _request(path, *heappop(held)[1:], index, speedup, block_size_tokens)
        index += 1


def _names(fields: Iterable[str]) -> str:
    """A line's `fields` as a caution names them: the first three in sorted order, quoted and cut short together
    (a line may hold thousands of them, or one a megabyte long), and how many more."""
    names = sorted(fields)
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return shown(", ".join(map(repr, names[:3])), quote=str, limit=80) + more


def _lose(
    assembler: TraceAssembler, path: str | os.PathLike[str], number: int, data: bytes, record: Any, error: ValueError
) -> None:
    """Tell `assembler` whose turn the skipped line `number` was: its `session_id`, read from its text when it is
    no JSON (a truncated write), or that this cannot be told.

    Raises:
        TraceFormatError: the line names a session_id that cannot be read whole.
    """
    if record is not _UNREAD:
        assembler.lose(session_of(record), number)
        return
    found = session_in_text(data.decode("utf-8", "surrogateescape"))
    if found.doubt == "cut":
        # Not a guess at the id: a session lost this turn, and as no one can tell which, any session's later turn
        # could be built without it; skipping on would hand out such prompts as whole conversations.
        raise TraceFormatError(
            path,
            number,
            f"{error}, and its session_id cannot be read whole: a session lost this turn, but which cannot be told, "
            "so its later turns would be built without it; fix or remove this line (a lenient read stops here "
            "rather than build them)",
        ) from error
    if found.doubt == "unread":
        assembler.lose_unknown(number, str(error))
    assembler.lose(found.session_id, number)


def _request(
    path: str | os.PathLike[str], number: int, turn: Turn, index: int, speedup: float, block_size_tokens: int
) -> Request:
    """The request of line `number`'s turn, the `index`-th the trace yields.

    Raises:
        TraceFormatError: naming the line, for an arrival past `MAX_ARRIVAL_S` after the speed-up, or for a turn
            `Request` refuses. `parse_record` bounds every field as `Request` does, so the latter is a backstop:
            no error from line data leaves the reader without its file and line. Both stop a lenient read too: the
            turn is placed already, and later turns of its session may be built on it.
    """
    arrival_s = turn.arrival_ms / 1000.0 / speedup
    if (problem := arrival_problem(arrival_s)) is not None:  # a speedup below 1: said where it first shows
        # The assembler keeps every arrival within 2**43 ms, so only a slow-down puts one past it.
        hint = ": a larger speedup" if speedup < 1 else ""
        raise TraceFormatError(
            path, number, f"arrival {turn.arrival_ms} ms at speedup {speedup!r} is {arrival_s:.3g} s, {problem}{hint}"
        )
    try:
        return Request(
            request_id=RequestId(str(index)),
            arrival_s=arrival_s,
            input_length=turn.input_length,
            output_length=turn.output_length,
            block_keys=turn.block_keys,
            tokens=turn.tokens,
            block_size_tokens=block_size_tokens,  # what its keys are of (scaling cuts text blocks this long)
        )
    except InvalidRequestError as error:
        raise TraceFormatError(path, number, str(error)) from error


def load_trace(
    path: str | os.PathLike[str],
    *,
    block_size_tokens: int = TRACE_BLOCK_SIZE_TOKENS,
    speedup: float = 1.0,
    strict: bool = True,
    on_skip: Callable[[SkippedLine], object] | None = None,
    time_unit: TimeUnit = "ms",
    on_caution: Callable[[str], object] | None = None,
    sort: bool = False,
) -> list[Request]:
    """All requests of a trace, or an error and nothing (see `iter_trace`)."""
    return list(
        iter_trace(
            path,
            block_size_tokens=block_size_tokens,
            speedup=speedup,
            strict=strict,
            on_skip=on_skip,
            time_unit=time_unit,
            on_caution=on_caution,
            sort=sort,
        )
    )


def text_request(
    text: str,
    *,
    request_id: str,
    arrival_s: float,
    output_length: int,
    block_size_tokens: int = TRACE_BLOCK_SIZE_TOKENS,
) -> Request:
    """The request of a literal prompt, as a trace's `text_input` reads: byte tokens keyed by the byte rule.

    Raises:
        InvalidRequestError: a text that is no str of valid Unicode (a lone surrogate) or is empty, a block size
            that is not an integer >= 1, or invalid other fields.
    """
    # Checked before keying, which would fail with Python's own errors (range() of a block of 0, say).
    block_size_tokens = require_int("block_size_tokens", block_size_tokens, minimum=1, error=InvalidRequestError)
    if not isinstance(text, str):
        raise InvalidRequestError(f"request {request_id}: text must be a str, got {type(text).__name__}")
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidRequestError(
            f"request {request_id}: text is not valid Unicode ({error.reason} at character {error.start})"
        ) from None
    return Request(
        request_id=RequestId(request_id),
        arrival_s=arrival_s,
        input_length=len(data),
        output_length=output_length,
        block_keys=text_block_keys(data, block_size_tokens=block_size_tokens),
        tokens=np.frombuffer(data, dtype=np.uint8),
        block_size_tokens=block_size_tokens,
    )


def _text_of(request: Request, block_size_tokens: int) -> str | None:
    """The request's prompt as text, when its tokens are the bytes of a text keyed by the byte rule."""
    tokens = request.tokens
    if tokens is None or int(tokens.max()) > 255:
        return None
    data = tokens.astype(np.uint8).tobytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if request.block_keys == text_block_keys(data, block_size_tokens=block_size_tokens) else None


def _line(request: Request, block_size_tokens: int, form: TraceForm) -> dict[str, Any]:
    """The request's line, checked by the reader's own rule (`parse_record`): a written trace always reads back.

    Raises:
        InvalidRequestError: the request is keyed in another block size, or a field is past the reader's bounds.
    """
    if request.block_size_tokens is not None and request.block_size_tokens != block_size_tokens:
        raise InvalidRequestError(
            f"request {shown(request.request_id, quote=str)} is keyed in {request.block_size_tokens}-token blocks, the trace in "
            f"{block_size_tokens}-token blocks: write each block size's requests to a trace of their own"
        )
    timestamp = round(request.arrival_s * 1000)
    if timestamp > MAX_LINE_MS:  # said here: the reader's message would guess at a trace timed in microseconds
        raise InvalidRequestError(
            f"request {shown(request.request_id, quote=str)} arrives at {request.arrival_s:.6g} s, past the {MAX_LINE_MS} ms (2**43) "
            "a trace's timestamp holds"
        )
    if form == "aiperf" and (text := _text_of(request, block_size_tokens)) is not None:
        line: dict[str, Any] = {"timestamp": timestamp, "text_input": text, "output_length": request.output_length}
    else:
        line = {
            "timestamp": timestamp,
            "input_length": request.input_length,
            "output_length": request.output_length,
            "hash_ids": list(request.block_keys),
        }
    try:
        # The fields as the reader checks them; the keys by their count (a Request's are valid ids, none repeated).
        parse_record({**line, "hash_ids": None}, block_size_tokens)
        if "hash_ids" in line:
            check_block_count(len(request.block_keys), request.input_length, block_size_tokens)
    except ValueError as error:
        raise InvalidRequestError(
            f"request {shown(request.request_id, quote=str)} cannot be read back from a trace: {error}"
        ) from None
    return line


def _write_lines(
    write: Callable[[bytes], object], requests: Iterable[Request], block_size_tokens: int | None, form: TraceForm
) -> int:
    count = 0
    previous = -float("inf")
    for request in require_iterable("requests", requests, error=InvalidRequestError):
        if not isinstance(request, Request):
            raise InvalidRequestError(f"request {count}: expected a mooncake.types.Request, got {shown(request)}")
        if block_size_tokens is None:  # the first request's, as it was keyed
            block_size_tokens = request.block_size_tokens or TRACE_BLOCK_SIZE_TOKENS
        if request.arrival_s < previous:
            raise InvalidRequestError(
                f"request {shown(request.request_id, quote=str)} arrives at {request.arrival_s}s, before the previous one ({previous}s)"
            )
        previous = request.arrival_s
        write(json.dumps(_line(request, block_size_tokens, form), separators=(", ", ": ")).encode("utf-8") + b"\n")
        count += 1
    return count


def write_trace(
    path: str | os.PathLike[str],
    requests: Iterable[Request],
    *,
    block_size_tokens: int | None = None,
    form: TraceForm = "mooncake",
) -> int:
    """Write requests as a trace, atomically; gzip-compressed when `path` ends in `.gz`.

    Atomically as `mooncake._files.atomic_path` writes: a regular file (or the
    file a symbolic link leads to) whole or not at all, synced to the disk with
    its folder, keeping the permissions of a file it replaces; a stream (a FIFO,
    /dev/stdout) as it goes.

    Timestamps are written as whole milliseconds. Requests must arrive in
    non-decreasing order and carry ceil(input_length / block_size) keys, in the
    trace's block size (`block_size_tokens`; None: the first request's, as it
    was keyed, else 512); each line is checked by the reader's rule, so that a
    written trace always reads back (with that block size). The
    "mooncake" form writes `timestamp`, `input_length`, `output_length` and
    `hash_ids`; the "aiperf" form writes the same, except for a request whose
    prompt is text (its tokens the UTF-8 bytes of a text, its keys the byte
    rule's, as `text_request` makes and a trace's `text_input` reads): that one
    is `timestamp`, `text_input`, `output_length`. Sessions are not written: a
    request is a whole prompt, which aiperf replays as a one-turn conversation.

    Returns:
        The number of requests written.

    Raises:
        InvalidRequestError: a request cannot be represented; the file is left untouched.
        ConfigError: an unknown form or block size, or a path that is none or names no file (ends in a slash).
        OSError: the file cannot be written (named by `path`), or reading the requests failed.
    """
    if block_size_tokens is not None:
        block_size_tokens = require_int("block_size_tokens", block_size_tokens, minimum=1)
    if form not in TRACE_FORMS:
        raise ConfigError(f"form must be one of {', '.join(TRACE_FORMS)}, got {shown(form)}")
    _check_path(path)
    target = Path(path)
    if not names_a_file(path):
        raise ConfigError(f"path must name a file, got {shown(os.fspath(path))}")
    # Appending: the temporary sibling is empty, and a descriptor's file (`- >> log.jsonl`, /dev/stdout) keeps what
    # its shell's `>>` kept, where "wb" would truncate it (a shell's `>` has already emptied it).
    with atomic_path(target) as temporary, open(temporary, "ab") as raw:
        if target.name.endswith(".gz"):
            # No name and mtime 0 in the gzip header: the same requests give the same bytes.
            with gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as packed:
                count = _write_lines(packed.write, requests, block_size_tokens, form)
        else:
            count = _write_lines(raw.write, requests, block_size_tokens, form)
    return count
