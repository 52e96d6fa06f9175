"""Trace records into timed prompts: arrivals, aiperf sessions and block keys.

A line starts a session unless an earlier line had its `session_id` (a line
without one is a session of its own). Its arrival, in ms from the trace start:

- with `timestamp`: that time (aiperf too prefers it to `delay`);
- a later turn without `timestamp`: its session's previous turn's arrival plus
  `delay` (0 if absent). aiperf waits `delay` after the previous turn's
  response ends, a time only the server knows; a trace can count it from the
  previous turn's arrival only, so a turn comes the response time earlier;
- a start without `timestamp`: the latest start above it (0 at the top) plus
  its `delay`: the line arrives as soon as the trace reaches it.

Its prompt:

- a start is the line itself: `hash_ids` are its keys; `text_input` is byte
  tokens keyed by the byte rule below; with neither, keys unique to the line;
- a later turn is the whole conversation, as aiperf replays sessions by default
  (earlier turns, each live response, then this turn): input = previous input
  + previous output + the line's own tokens. The previous prompt's full blocks
  keep their keys (the prefix a cache can reuse); the rest get keys unique to
  this turn of this session, since the response in them is generated live.
  A conversation may not grow past `MAX_LINE_TOKENS` (2**24), the bound on one
  line's lengths: past it no model serves it, and its keys would grow without end.

Keys are chained like `mooncake.cache.hashing` keys, with H(s) = XXH3-64(s),
seed 0 (xxhash, as every key of the library), and B the block size:

    byte rule   key_i = H("text:B:" key_{i-1} ":" || bytes of block i)     key_{-1} = ""
    made up     key_i = H(label ":" key_{i-1} ":" i)                      label names the line or session turn

(numbers in decimal). Equal texts get equal keys; made-up keys match nothing
else (up to 64-bit collisions, hash_ids included).

Order, so that the reader can stream: a start may not arrive before the
previous start (for traces without sessions, the Mooncake rule that timestamps
never decrease); a later turn may not arrive before its session's previous
turn nor before the latest start above it. Sessions may thus be written
grouped, in start order (as aiperf's writers do), or line by line in arrival
order.

A line's arrival may not pass 2**43 ms (`MAX_LINE_MS`), the bound on a
timestamp, however `delay` puts it there.

A reader that skips refused lines (`--skip-invalid`) asks `doubtful_start`
after each: once `MAX_LINES_BEHIND` (10) lines in a row, none placed between,
were refused for arriving before the latest start, that start is the likelier
fault (a timestamp typo or unit slip raises the mark, and every later line would
be refused against it), or the trace is not in arrival order; either way
skipping on would lose the rest of the trace, so the reader stops there.
A refused line whose session cannot be told (cut short before its
`session_id` shows) is `lose_unknown`; once any line names a session, that
line may have been a turn of any of them, whose later turns would be built
without it, so `doubtful_loss` names it and the reader stops there too.

Invariant: no line still to come arrives before `mark_ms`, the latest start.
"""

from __future__ import annotations

import json
from typing import cast

import attrs
import numpy as np
import numpy.typing as npt
import xxhash

from mooncake._checks import shown
from mooncake.types import BlockKey, block_count
from mooncake.workload.trace_record import MAX_LINE_MS, MAX_LINE_TOKENS, TraceRecord

__all__ = ["MAX_LINES_BEHIND", "TraceAssembler", "Turn", "made_up_keys", "text_block_keys"]

MAX_LINES_BEHIND = 10
"""Lines in a row refused for arriving before one start after which `TraceAssembler.doubtful_start` blames it:
more than a few bad lines in a row (a truncated write, a seam of two logs) and far fewer than a trace would lose."""


def _h(data: bytes) -> BlockKey:
    return BlockKey(xxhash.xxh3_64_intdigest(data))


def text_block_keys(data: bytes, *, block_size_tokens: int) -> tuple[BlockKey, ...]:
    """Keys of a prompt of byte tokens (`text_input` as UTF-8) by the byte rule."""
    keys: list[BlockKey] = []
    parent = ""
    for start in range(0, len(data), block_size_tokens):
        key = _h(f"text:{block_size_tokens}:{parent}:".encode() + data[start : start + block_size_tokens])
        keys.append(key)
        parent = str(key)
    return tuple(keys)


def made_up_keys(label: str, parent: BlockKey | None, count: int, *, first_index: int) -> tuple[BlockKey, ...]:
    """`count` keys of unknown content chained after `parent`, numbered from `first_index`."""
    keys: list[BlockKey] = []
    previous = "" if parent is None else str(parent)
    for index in range(first_index, first_index + count):
        key = _h(f"{label}:{previous}:{index}".encode())
        keys.append(key)
        previous = str(key)
    return tuple(keys)


@attrs.frozen(kw_only=True, eq=False)
class Turn:
    """A line as a timed prompt: what a `Request` is made of."""

    arrival_ms: float
    input_length: int
    output_length: int
    block_keys: tuple[BlockKey, ...]
    tokens: npt.NDArray[np.int32] | None
    line: int


@attrs.define(eq=False)
class TraceAssembler:
    """Places validated records, in file order, on the timeline and builds their prompts.

    Invariants:
        `mark_ms` is the arrival of the latest start (0 before any) and never
        decreases; every turn placed arrived at or after the mark of its time,
        and at most `MAX_LINE_MS`.
        Each session's latest turn has ceil(input_length / block size) keys and,
        for a lost session, lies above the skipped line.
        The lines refused for arriving before the mark since the last placed
        line, if any, lie below the mark's line, the first of them on
        `_first_behind`.
        A line of a session seen, placed or lost, is on `_first_session` or
        below it.
    """

    block_size_tokens: int
    mark_ms: float = 0
    _mark_line: int | None = None
    _mark_session: str | None = None  # the latest start's session (None: a line without session_id), for messages
    _last_line: int | None = None
    _sessions: dict[str, Turn] = attrs.field(factory=dict)
    _turns: dict[str, int] = attrs.field(factory=dict)
    _lost: dict[str, int] = attrs.field(factory=dict)
    _num_behind: int = 0  # lines refused for arriving before the mark since the last line placed
    _first_behind: int = 0  # the first of them
    _last_behind: int = 0  # and the last
    _first_session: int | None = None  # the first line naming a session, placed or lost
    _unknown: tuple[int, str] | None = None  # the first line lost to a session that cannot be told, and why

    def check_invariants(self) -> None:
        """Raise AssertionError if an invariant of the class docstring fails."""
        assert 0 <= self.mark_ms <= MAX_LINE_MS, f"mark {self.mark_ms} ms"
        assert self._mark_line is None or self._mark_line <= (self._last_line or 0), "the mark is below no line"
        for session_id, turn in self._sessions.items():
            assert len(turn.block_keys) == block_count(turn.input_length, self.block_size_tokens), session_id
            assert turn.line < self._lost.get(session_id, turn.line + 1), f"session {session_id!r} grew after a loss"
        if self._num_behind:
            assert self._mark_line is not None and self._mark_line < self._first_behind, "refused before no start"
        lines = [turn.line for turn in self._sessions.values()] + list(self._lost.values())
        first = self._first_session
        assert (first is not None and first <= min(lines)) if lines else first is None, f"first session line {first}"

    def lose(self, session_id: str | None, line: int) -> None:
        """A line of `session_id` was skipped: its later turns cannot be built."""
        if session_id is not None and session_id not in self._lost:
            self._lost[session_id] = line
            self._seen(line)

    def lose_unknown(self, line: int, reason: str) -> None:
        """A line was skipped (for `reason`) that may have been a turn of any session: see `doubtful_loss`."""
        if self._unknown is None:
            self._unknown = line, reason

    def doubtful_loss(self) -> tuple[int, str] | None:
        """The first line `lose_unknown` was told of and why it stops a lenient read, once a line names a session
        (above or below it); else None."""
        if self._unknown is None or self._first_session is None:
            return None
        line, reason = self._unknown
        return line, (
            f"{reason}, and the line breaks off before a session_id shows, in a trace with sessions (line "
            f"{self._first_session}): it may be a turn of any session, whose later turns would be built without it; "
            "fix or remove this line (a lenient read stops here rather than build them)"
        )

    def _seen(self, line: int) -> None:
        """`line` names a session."""
        if self._first_session is None or line < self._first_session:
            self._first_session = line

    def doubtful_start(self) -> tuple[int, str] | None:
        """The latest start's line and why its arrival looks wrong, once `MAX_LINES_BEHIND` lines after it, none
        placed between, were refused for arriving before it; else None."""
        if self._num_behind < MAX_LINES_BEHIND or self._mark_line is None:
            return None
        return self._mark_line, (
            f"arrives at {self.mark_ms} ms, but the {self._num_behind} lines after it (lines {self._first_behind} "
            f"to {self._last_behind}, none read between) all arrive before it and were left out: its arrival looks "
            "wrong, or the trace is not in arrival order; fix or remove this line, or sort the trace by timestamp "
            "(a lenient read stops here rather than leave out every line after it)"
        )

    def place(self, record: TraceRecord, line: int) -> Turn:
        """The record's turn.

        Raises:
            ValueError: the record breaks an order rule, or belongs to a session
                whose earlier line was skipped; nothing changes but the count of
                lines refused for arriving before the mark (`doubtful_start`).
        """
        session_id = record.session_id
        if session_id is not None and session_id in self._lost:
            raise ValueError(
                f"session {shown(session_id)} lost its turn on line {self._lost[session_id]}, which was skipped"
            )
        previous = self._sessions.get(session_id) if session_id is not None else None
        turn = self._start(record, line) if previous is None else self._continue(record, line, previous)
        if previous is None:
            self.mark_ms, self._mark_line, self._mark_session = turn.arrival_ms, line, session_id
        if session_id is not None:
            self._sessions[session_id] = turn
            self._turns[session_id] = self._turns.get(session_id, 0) + 1
            self._seen(line)
        self._last_line = line
        self._num_behind = 0
        return turn

    def _behind(self, line: int) -> None:
        """`line` is refused for arriving before the mark."""
        if not self._num_behind:
            self._first_behind = line
        self._num_behind += 1
        self._last_behind = line

    def _start(self, record: TraceRecord, line: int) -> Turn:
        if record.timestamp_ms is None:
            arrival = self.mark_ms + (record.delay_ms or 0)
            if arrival > MAX_LINE_MS:
                after = "the top" if self._mark_line is None else f"the latest start (line {self._mark_line})"
                raise ValueError(
                    f"line arrives at {arrival} ms, {after} at {self.mark_ms} ms + its delay "
                    f"{record.delay_ms} ms, past 2**43 ms (the bound on a timestamp)"
                )
        else:
            arrival = record.timestamp_ms
            if arrival < self.mark_ms:
                self._behind(line)
                # The previous line read, unless lines between were refused against it too.
                is_previous = self._mark_line == self._last_line and self._num_behind == 1
                where = "the previous line's" if is_previous else f"line {self._mark_line}'s"
                raise ValueError(f"timestamp {arrival} is earlier than {where} {self.mark_ms}")
        tokens = None
        if record.text is not None:
            keys = text_block_keys(record.text, block_size_tokens=self.block_size_tokens)
            tokens = np.frombuffer(record.text, dtype=np.uint8).astype(np.int32)
        elif record.hash_ids is not None:
            keys = cast("tuple[BlockKey, ...]", record.hash_ids)  # validated ints already
        else:
            keys = made_up_keys(
                f"line {line}", None, block_count(record.input_length, self.block_size_tokens), first_index=0
            )
        return Turn(
            arrival_ms=arrival,
            input_length=record.input_length,
            output_length=record.output_length,
            block_keys=keys,
            tokens=tokens,
            line=line,
        )

    def _continue(self, record: TraceRecord, line: int, previous: Turn) -> Turn:
        session_id = record.session_id
        arrival = record.timestamp_ms
        if arrival is None:
            arrival = previous.arrival_ms + (record.delay_ms or 0)
            if arrival > MAX_LINE_MS:
                raise ValueError(
                    f"turn of session {shown(session_id)} arrives at {arrival} ms, its previous turn (line "
                    f"{previous.line}) at {previous.arrival_ms} ms + its delay {record.delay_ms} ms, past 2**43 ms "
                    "(the bound on a timestamp)"
                )
        if arrival < self.mark_ms:
            self._behind(line)  # whichever rule below refuses it
        if arrival < previous.arrival_ms:
            raise ValueError(
                f"turn of session {shown(session_id)} arrives at {arrival} ms, before its previous turn "
                f"(line {previous.line}, {previous.arrival_ms} ms)"
            )
        if arrival < self.mark_ms:
            # The latest start is another line's: were it this session's own, the previous turn would be at or after
            # it, and the check above would have refused the turn.
            start = (
                "a line without session_id" if self._mark_session is None else f"session {shown(self._mark_session)}"
            )
            raise ValueError(
                f"turn of session {shown(session_id)} arrives at {arrival} ms, before the latest start above it "
                f"({start}, line {self._mark_line}, {self.mark_ms} ms): no turn may arrive before a start above it; "
                "write sessions grouped in start order, or lines in arrival order"
            )
        input_length = previous.input_length + previous.output_length + record.input_length
        if input_length > MAX_LINE_TOKENS:
            raise ValueError(
                f"turn of session {shown(session_id)} makes its conversation {input_length} tokens long "
                f"(previous turn on line {previous.line}), past 2**24"
            )
        shared = previous.input_length // self.block_size_tokens
        parent = previous.block_keys[shared - 1] if shared else None
        # JSON quoting keeps labels unambiguous whatever the id holds.
        label = f"session {json.dumps(session_id)} turn {self._turns[str(session_id)] + 1}"
        fresh = block_count(input_length, self.block_size_tokens) - shared
        keys = previous.block_keys[:shared] + made_up_keys(label, parent, fresh, first_index=shared)
        return Turn(
            arrival_ms=arrival,
            input_length=input_length,
            output_length=record.output_length,
            block_keys=keys,
            tokens=None,
            line=line,
        )
