"""`TraceAssembler` against a reference written from `mooncake.workload.assembly`'s docstring.

Generated traces mix lines with and without sessions, timestamps (mostly in order, sometimes
not) and delays, prompts given by hash_ids, by text_input or by input_length alone, and lines the
reader skipped (`lose`). The reference places each line by the docstring's three arrival rules and
its order rules, refuses what it refuses (and then changes nothing), and builds each prompt: a start
is the line itself (its hash_ids; the byte rule, written out here with xxhash, for text; keys of its
own otherwise), a later turn the whole conversation keeping the previous prompt's full-block keys.
Some examples use 64 Ki-token blocks, so that conversations of millions of tokens are cheap and
`MAX_LINE_TOKENS` is reached.
"""

from __future__ import annotations

import math
import re
from typing import Any

import attrs
import pytest
import xxhash
from hypothesis import event, given, settings
from hypothesis import strategies as st

from mooncake.workload.assembly import TraceAssembler, Turn
from mooncake.workload.trace_record import MAX_LINE_TOKENS, parse_record

BIG_BLOCK = 2**16  # a block size at which lengths near MAX_LINE_TOKENS make only a few hundred keys
# Sessions whose ids look like other labels: made-up keys must still be unique to their line.
SESSION_IDS = ["a", "b", 'a" turn 2', "line 1", "session 1", "é"]
# Lengths that add up to MAX_LINE_TOKENS exactly, or just past it, over a turn or two.
BIG_LENGTHS = st.sampled_from([1, 2**22, 2**23 - 1, 2**23, 2**24 - 1, 2**24]) | st.integers(1, MAX_LINE_TOKENS)


@st.composite
def traces(draw: st.DrawFn) -> tuple[int, list[dict[str, Any] | str | None]]:
    """A block size and the lines of a trace: a line's fields, or a skipped line (its session id, or None)."""
    block = draw(st.sampled_from([1, 4, 16, BIG_BLOCK, BIG_BLOCK]))
    lengths = BIG_LENGTHS if block == BIG_BLOCK else st.integers(1, 3 * block + 1)
    sessions = draw(st.lists(st.sampled_from(SESSION_IDS), min_size=1, max_size=3, unique=True))
    clock = 0
    lines: list[dict[str, Any] | str | None] = []
    for _ in range(draw(st.integers(1, 14))):
        session = draw(st.none() | st.sampled_from(sessions))
        if draw(st.integers(0, 15)) == 0:
            lines.append(session)  # the reader skipped this line
            continue
        fields: dict[str, Any] = {"output_length": draw(lengths)}
        if session is not None:
            fields["session_id"] = session
        timing = draw(st.sampled_from(["none", "in order", "in order", "any"]))
        if timing == "in order":
            clock += draw(st.integers(0, 10))
            fields["timestamp"] = clock if draw(st.booleans()) else clock + 0.25
        elif timing == "any":
            fields["timestamp"] = draw(st.integers(0, 60))
        if timing == "any" and draw(st.integers(0, 5)) == 0:
            fields["timestamp"] = 2**43 - draw(st.integers(0, 8))  # at the bound: a delay may pass it
        if draw(st.booleans()):
            fields["delay"] = draw(st.integers(0, 8) | st.sampled_from([0.5, 1.25, 2**43]))
        prompt = draw(st.sampled_from(["hash_ids", "text", "length"]))
        if prompt == "text":
            fields["text_input"] = draw(st.text(st.sampled_from("ab\u00e9\u4e2d"), min_size=1, max_size=3 * 4))
        else:
            fields["input_length"] = draw(lengths)
            if prompt == "hash_ids":
                count = -(-fields["input_length"] // block)
                # Distinct, as chained ids are; from a small universe, so that lines share some.
                ids = st.integers(0, max(20, 2 * count))
                fields["hash_ids"] = draw(st.lists(ids, min_size=count, max_size=count, unique=True))
        lines.append(fields)
    return block, lines


def byte_rule(data: bytes, block: int) -> tuple[int, ...]:
    """The docstring's byte rule: key_i = XXH3-64("text:B:" key_{i-1} ":" || block i's bytes), key_-1 = ""."""
    keys: list[int] = []
    parent = ""
    for start in range(0, len(data), block):
        keys.append(xxhash.xxh3_64_intdigest(f"text:{block}:{parent}:".encode() + data[start : start + block]))
        parent = str(keys[-1])
    return tuple(keys)


@attrs.define
class Expected:
    """What the reference says a line becomes: a refusal (its message's pattern), or a turn whose keys start with
    `inherited` and end with `fresh` made-up ones (held by no other line)."""

    refused: str | None = None
    arrival_ms: float = 0.0
    input_length: int = 0
    output_length: int = 0
    inherited: tuple[int, ...] = ()  # the keys it must start with
    fresh: int = 0  # made-up keys after them
    exact_keys: tuple[int, ...] | None = None  # all its keys, where the docstring fixes them
    tokens: bytes | None = None


@attrs.define
class Reference:
    """The docstring's rules, line by line."""

    block: int
    mark_ms: float = 0
    sessions: dict[str, tuple[float, int, int, tuple[int, ...], int]] = attrs.field(factory=dict)
    lost: dict[str, int] = attrs.field(factory=dict)

    def place(self, fields: dict[str, Any], line: int, made: Turn | ValueError) -> Expected:
        """The line as the rules place it; `made` is the assembler's turn, whose keys the session keeps (made-up
        keys are the assembler's to choose; the tests check them against the rules)."""
        session = fields.get("session_id")
        timestamp, delay = fields.get("timestamp"), fields.get("delay", 0)
        if session in self.lost:
            return Expected(refused=rf"session {re.escape(repr(session))} lost its turn on line {self.lost[session]}")
        previous = self.sessions.get(session) if session is not None else None
        output = fields["output_length"]
        own = len(fields["text_input"].encode()) if "text_input" in fields else fields["input_length"]
        if previous is None:
            arrival = self.mark_ms + delay if timestamp is None else timestamp
            if arrival > 2**43:
                return Expected(refused=rf"line arrives at {arrival} ms, .*\+ its delay {delay} ms, past 2\*\*43 ms")
            if arrival < self.mark_ms:
                return Expected(refused=rf"timestamp {timestamp} is earlier than .*{self.mark_ms}")
            expected = Expected(arrival_ms=arrival, input_length=own, output_length=output)
            if "text_input" in fields:
                data = fields["text_input"].encode()
                expected.exact_keys, expected.tokens = byte_rule(data, self.block), data
            elif "hash_ids" in fields:
                expected.exact_keys = tuple(fields["hash_ids"])
            else:
                expected.fresh = math.ceil(own / self.block)
            self.mark_ms = arrival
        else:
            before_ms, before_input, before_output, before_keys, before_line = previous
            arrival = before_ms + delay if timestamp is None else timestamp
            if arrival > 2**43:
                return Expected(
                    refused=rf"arrives at {arrival} ms, its previous turn \(line {before_line}\) at {before_ms} ms "
                    rf"\+ its delay {delay} ms, past 2\*\*43 ms"
                )
            if arrival < before_ms:
                return Expected(refused=rf"arrives at {arrival} ms, before its previous turn \(line {before_line}")
            if arrival < self.mark_ms:
                return Expected(refused=rf"arrives at {arrival} ms, before the latest start above it")
            length = before_input + before_output + own
            if length > MAX_LINE_TOKENS:
                return Expected(
                    refused=rf"session {re.escape(repr(session))} makes its conversation {length} tokens long "
                    rf"\(previous turn on line {before_line}\), past 2\*\*24"
                )
            shared = before_input // self.block
            expected = Expected(
                arrival_ms=arrival,
                input_length=length,
                output_length=output,
                inherited=before_keys[:shared],
                fresh=math.ceil(length / self.block) - shared,
            )
        if session is not None:
            self.sessions[session] = (arrival, expected.input_length, output, getattr(made, "block_keys", ()), line)
        return expected


def replay(block: int, lines: list[dict[str, Any] | str | None]) -> list[tuple[Expected, Turn | ValueError]]:
    """Each line as the reference expects it beside what the assembler made of it (skipped lines left out)."""
    assembler, reference = TraceAssembler(block), Reference(block)
    out: list[tuple[Expected, Turn | ValueError]] = []
    for line, fields in enumerate(lines, start=1):
        if not isinstance(fields, dict):
            assembler.lose(fields, line)
            if fields is not None:
                reference.lost.setdefault(fields, line)
            continue
        record = parse_record(fields, block)
        outcome: Turn | ValueError
        try:
            outcome = assembler.place(record, line)
        except ValueError as error:
            outcome = error
        expected = reference.place(fields, line, outcome)
        out.append((expected, outcome))
        assert assembler.mark_ms == reference.mark_ms
        assembler.check_invariants()
    return out


def refusal_kind(pattern: str | None) -> str:
    """A label for Hypothesis' statistics: which rule refused a line, if one did."""
    kinds = ("lost", "earlier than", r"past 2\*\*43", "past 2", "previous turn", "session started")
    return next((f"refused: {kind}" for kind in kinds if pattern and kind in pattern), "placed")


@settings(max_examples=150)
@given(trace=traces())
def test_arrivals_and_refusals_follow_the_documented_rules(trace: tuple[int, list[Any]]) -> None:
    """Each line arrives by the three rules (timestamp; previous turn + delay; latest start + delay), a line
    breaking an order rule, arriving past 2**43 ms by its delay, growing a conversation past 2**24 or continuing
    a lost session is refused with a ValueError naming it, and a refused line changes nothing (the lines after it
    place as if it were absent)."""
    for expected, outcome in replay(*trace):
        event(refusal_kind(expected.refused))
        if expected.refused is not None:
            assert isinstance(outcome, ValueError), (expected.refused, outcome)
            assert re.search(expected.refused, str(outcome)), (expected.refused, str(outcome))
        else:
            assert isinstance(outcome, Turn), outcome
            event("a later turn" if expected.inherited else "a start or a turn after a short one")
            assert (outcome.arrival_ms, outcome.input_length, outcome.output_length) == (
                expected.arrival_ms,
                expected.input_length,
                expected.output_length,
            )


@settings(max_examples=150)
@given(trace=traces())
def test_prompts_are_whole_conversations_keyed_as_documented(trace: tuple[int, list[Any]]) -> None:
    """A start's keys are its hash_ids, or the byte rule's over its text (whose bytes are its tokens); a later
    turn keeps the previous prompt's full-block keys as its prefix; every prompt has one key per block."""
    block, _ = trace
    for expected, outcome in replay(*trace):
        if not isinstance(outcome, Turn):
            continue
        keys = outcome.block_keys
        assert len(keys) == math.ceil(outcome.input_length / block)
        if expected.exact_keys is not None:
            assert keys == expected.exact_keys
        assert keys[: len(expected.inherited)] == expected.inherited
        if expected.tokens is None:
            assert outcome.tokens is None
        else:
            assert outcome.tokens is not None and bytes(outcome.tokens.astype("uint8")) == expected.tokens


@settings(max_examples=150)
@given(trace=traces())
def test_made_up_keys_are_unique_to_their_line(trace: tuple[int, list[Any]]) -> None:
    """Keys made up for a line (a start without hash_ids or text, a later turn's blocks after the previous
    prompt's full ones) are distinct and held by no other line, except as the kept prefix of a later turn of the
    same session, whatever the session ids look like."""
    owner: dict[int, int] = {}  # made-up key → its line
    for expected, outcome in replay(*trace):
        if not isinstance(outcome, Turn):
            continue
        keys = outcome.block_keys
        made = keys[len(keys) - expected.fresh :] if expected.fresh else ()
        assert len(set(made)) == len(made), keys
        for key in keys[: len(keys) - expected.fresh]:  # given or kept: made up by no other line, or kept from it
            assert key not in owner or key in expected.inherited, (key, owner[key])
        for key in made:
            assert key not in owner, (key, owner[key], outcome.line)
            owner[key] = outcome.line


def test_a_conversation_of_exactly_max_line_tokens_is_served() -> None:
    """The bound is inclusive: a conversation reaching 2**24 tokens exactly is a turn, one token more is not."""
    assembler = TraceAssembler(BIG_BLOCK)
    assembler.place(parse_record({"session_id": "s", "input_length": 2**23, "output_length": 2**22}, BIG_BLOCK), 1)
    turn = assembler.place(parse_record({"session_id": "s", "input_length": 2**22, "output_length": 1}, BIG_BLOCK), 2)
    assert turn.input_length == MAX_LINE_TOKENS
    with pytest.raises(ValueError, match=r"16777218 tokens long \(previous turn on line 2\), past 2\*\*24"):
        assembler.place(parse_record({"session_id": "s", "input_length": 1, "output_length": 1}, BIG_BLOCK), 3)
