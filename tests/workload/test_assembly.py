"""Records into timed prompts: arrivals by timestamp and delay, sessions' whole conversations, keys, order rules."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.workload.assembly import TraceAssembler, Turn, made_up_keys, text_block_keys
from mooncake.workload.trace_record import parse_record

BLOCK = 4


def place(assembler: TraceAssembler, line: int, **fields: Any) -> Turn:
    return assembler.place(parse_record(fields, BLOCK), line)


def keyed(**fields: Any) -> dict[str, Any]:
    """A line of `input_length` tokens with fresh hash_ids."""
    length = fields.get("input_length", 5)
    return {
        "input_length": length,
        "output_length": 3,
        "hash_ids": list(range(100, 100 + -(-length // BLOCK))),
    } | fields


# --------------------------------------------------------------------------- arrivals


def test_timestamps_are_arrivals_and_raise_the_mark() -> None:
    """A line with a timestamp arrives then; each start raises the mark to its arrival."""
    assembler = TraceAssembler(BLOCK)
    assert place(assembler, 1, **keyed(timestamp=10)).arrival_ms == 10
    assert assembler.mark_ms == 10
    assert place(assembler, 2, **keyed(timestamp=25.5)).arrival_ms == 25.5
    assert assembler.mark_ms == 25.5
    assembler.check_invariants()


def test_a_later_turn_arrives_delay_after_the_previous_turn() -> None:
    """delay counts from the session's previous turn's arrival; without delay the turn follows at once."""
    assembler = TraceAssembler(BLOCK)
    assert place(assembler, 1, session_id="a", **keyed(timestamp=1000)).arrival_ms == 1000
    assert place(assembler, 2, session_id="a", delay=250, **keyed()).arrival_ms == 1250
    assert place(assembler, 3, session_id="a", **keyed()).arrival_ms == 1250
    assert assembler.mark_ms == 1000  # later turns are not starts


def test_a_start_without_timestamp_arrives_with_the_latest_start() -> None:
    """A session's first line without timestamp arrives at the latest start above it (0 at the top), plus its delay."""
    assembler = TraceAssembler(BLOCK)
    assert place(assembler, 1, session_id="a", **keyed()).arrival_ms == 0
    assert place(assembler, 2, session_id="b", **keyed(timestamp=40)).arrival_ms == 40
    assert place(assembler, 3, session_id="c", **keyed()).arrival_ms == 40
    assert place(assembler, 4, session_id="d", delay=5, **keyed()).arrival_ms == 45
    assert place(assembler, 5, text_input="no session", output_length=1).arrival_ms == 45


def test_a_later_turn_with_a_timestamp_uses_it() -> None:
    """A timestamp wins over delay on a later turn too."""
    assembler = TraceAssembler(BLOCK)
    place(assembler, 1, session_id="a", **keyed(timestamp=0))
    assert place(assembler, 2, session_id="a", delay=5, **keyed(timestamp=900)).arrival_ms == 900


# --------------------------------------------------------------------------- prompts


def test_a_start_uses_its_hash_ids() -> None:
    """A line that starts a session is its own prompt, keyed by its hash_ids."""
    turn = place(
        TraceAssembler(BLOCK), 1, session_id="a", timestamp=0, input_length=6, output_length=2, hash_ids=[7, 8]
    )
    assert (turn.input_length, turn.output_length, turn.block_keys, turn.tokens) == (6, 2, (7, 8), None)


def test_a_later_turn_is_the_whole_conversation() -> None:
    """Turn 2 is turn 1's prompt, turn 1's output and its own tokens; it keeps turn 1's full blocks."""
    assembler = TraceAssembler(BLOCK)
    first = place(assembler, 1, session_id="a", timestamp=0, input_length=6, output_length=2, hash_ids=[7, 8])
    second = place(assembler, 2, session_id="a", delay=1, input_length=3, output_length=4, hash_ids=[9])
    assert second.input_length == 6 + 2 + 3
    assert len(second.block_keys) == 3
    assert second.block_keys[0] == first.block_keys[0]  # the one full block of turn 1
    assert second.block_keys[1] != first.block_keys[1]  # turn 1's partial block now holds its output too
    assert 9 not in second.block_keys  # the line's own ids sit after a live response: not comparable
    third = place(assembler, 3, session_id="a", text_input="abcdef", output_length=1)
    assert third.input_length == 11 + 4 + 6
    assert third.block_keys[:2] == second.block_keys[:2]  # 11 tokens: two full blocks
    assert third.tokens is None  # the responses' tokens are unknown


def test_made_up_keys_are_unique_per_session_turn() -> None:
    """Two sessions with equal lines share their first turn's keys but not their later turns' own keys."""
    assembler = TraceAssembler(BLOCK)
    turns = {}
    for line, session in enumerate(("a", "b"), start=1):
        first = place(
            assembler, 2 * line - 1, session_id=session, timestamp=0, input_length=4, output_length=4, hash_ids=[1]
        )
        turns[session] = (first, place(assembler, 2 * line, session_id=session, input_length=4, output_length=1))
    assert turns["a"][0].block_keys == turns["b"][0].block_keys == (1,)
    assert turns["a"][1].block_keys[0] == turns["b"][1].block_keys[0] == 1
    assert set(turns["a"][1].block_keys[1:]).isdisjoint(turns["b"][1].block_keys[1:])


def test_lines_without_hash_ids_get_keys_of_their_own() -> None:
    """aiperf's input_length without hash_ids: keys unique to the line, the right count."""
    assembler = TraceAssembler(BLOCK)
    a = place(assembler, 1, session_id="a", input_length=9, output_length=1)
    b = place(assembler, 2, session_id="b", input_length=9, output_length=1)
    assert len(a.block_keys) == len(b.block_keys) == 3
    assert set(a.block_keys).isdisjoint(b.block_keys)


def test_text_is_byte_tokens_keyed_by_the_byte_rule() -> None:
    """text_input: tokens are its UTF-8 bytes, keys the byte rule's."""
    turn = place(TraceAssembler(BLOCK), 1, text_input="héllo!", output_length=2)
    data = "héllo!".encode()
    assert turn.tokens is not None and bytes(turn.tokens.astype("uint8")) == data
    assert turn.block_keys == text_block_keys(data, block_size_tokens=BLOCK)


@given(a=st.binary(min_size=1, max_size=40), b=st.binary(min_size=1, max_size=40), block=st.integers(1, 8))
def test_byte_rule_keys_agree_exactly_up_to_the_first_differing_block(a: bytes, b: bytes, block: int) -> None:
    """Keys of block i are equal iff the first i+1 blocks are equal (prefix chaining), and there are ceil(n/B)."""
    keys_a, keys_b = (text_block_keys(x, block_size_tokens=block) for x in (a, b))
    assert len(keys_a) == -(-len(a) // block)
    for i, (key_a, key_b) in enumerate(zip(keys_a, keys_b, strict=False)):
        assert (key_a == key_b) == (a[: (i + 1) * block] == b[: (i + 1) * block])


def test_made_up_keys_chain_on_their_parent() -> None:
    """Made-up keys depend on label, parent and index; the count is what was asked."""
    keys = made_up_keys("x", None, 3, first_index=0)
    assert len(set(keys)) == 3
    assert made_up_keys("x", None, 3, first_index=0) == keys
    assert made_up_keys("y", None, 1, first_index=0)[0] != keys[0]
    assert made_up_keys("x", keys[0], 2, first_index=1) == keys[1:]  # a chain continues from any of its keys
    assert made_up_keys("x", keys[2], 1, first_index=1)[0] != keys[1]


# --------------------------------------------------------------------------- order rules

ORDER_ERRORS: dict[str, tuple[list[dict[str, Any]], str]] = {
    "start before the previous start": (
        [keyed(timestamp=100), keyed(timestamp=99)],
        "timestamp 99 is earlier than the previous line's 100",
    ),
    "start before an earlier line's start": (
        [keyed(timestamp=100, session_id="a"), keyed(session_id="a", delay=5), keyed(timestamp=99)],
        "timestamp 99 is earlier than line 1's 100",
    ),
    "turn before its previous turn": (
        [keyed(timestamp=100, session_id="a"), keyed(timestamp=50, session_id="a")],
        "turn of session 'a' arrives at 50 ms, before its previous turn (line 1, 100 ms)",
    ),
    "turn before a later session's start": (
        [keyed(timestamp=0, session_id="a"), keyed(timestamp=10, session_id="b"), keyed(session_id="a", delay=1)],
        "turn of session 'a' arrives at 1 ms, before the latest start above it (session 'b', line 2, 10 ms)",
    ),
    "turn delayed past 2**43 ms": (
        [keyed(timestamp=2**43, session_id="a"), keyed(session_id="a", delay=1000)],
        "turn of session 'a' arrives at 8796093023208 ms, its previous turn (line 1) at 8796093022208 ms + its "
        "delay 1000 ms, past 2**43 ms",
    ),
    "start delayed past 2**43 ms": (
        [keyed(timestamp=2**43 - 1), keyed(delay=2)],
        "line arrives at 8796093022209 ms, the latest start (line 1) at 8796093022207 ms + its delay 2 ms, "
        "past 2**43 ms",
    ),
    "first line delayed past 2**43 ms": (  # two delays of 2**43 each, from the top
        [keyed(delay=2**43), keyed(delay=2**43)],
        "line arrives at 17592186044416 ms, the latest start (line 1) at 8796093022208 ms + its delay",
    ),
}


@pytest.mark.parametrize(("lines", "reason"), ORDER_ERRORS.values(), ids=ORDER_ERRORS.keys())
def test_order_rules_raise_and_change_nothing(lines: list[dict[str, Any]], reason: str) -> None:
    """A line out of order is a ValueError naming both times; the mark is unchanged."""
    assembler = TraceAssembler(BLOCK)
    for number, fields in enumerate(lines[:-1], start=1):
        place(assembler, number, **fields)
    mark = assembler.mark_ms
    with pytest.raises(ValueError) as caught:
        place(assembler, len(lines), **lines[-1])
    assert reason in str(caught.value)
    assert assembler.mark_ms == mark
    assembler.check_invariants()


def test_a_delay_may_reach_2_43_ms_exactly() -> None:
    """The bound on a timestamp is inclusive for an arrival made of a delay too."""
    assembler = TraceAssembler(BLOCK)
    assert place(assembler, 1, session_id="a", **keyed(timestamp=2**43 - 5)).arrival_ms == 2**43 - 5
    assert place(assembler, 2, session_id="a", **keyed(delay=5)).arrival_ms == 2**43
    assert place(assembler, 3, **keyed(delay=5)).arrival_ms == 2**43
    assembler.check_invariants()


def test_a_lost_session_refuses_its_later_turns() -> None:
    """After one of its lines was skipped, a session's later turns are refused, naming that line."""
    assembler = TraceAssembler(BLOCK)
    place(assembler, 1, session_id="a", **keyed(timestamp=0))
    assembler.lose("a", 2)
    assembler.lose(None, 3)  # a line whose session is unknown loses nothing
    with pytest.raises(ValueError, match=r"session 'a' lost its turn on line 2, which was skipped"):
        place(assembler, 4, session_id="a", **keyed())
    assert place(assembler, 5, session_id="b", **keyed()).arrival_ms == 0


def test_a_conversation_may_not_grow_past_the_line_bound() -> None:
    """Turns of at most 2**24 tokens each add up; the turn that takes the conversation past 2**24 is refused
    (a ValueError the reader reports with the line), before any key is made for it."""
    assembler = TraceAssembler(BLOCK)
    half = 2**23
    place(assembler, 1, session_id="a", timestamp=0, input_length=half - 1, output_length=1)
    assert place(assembler, 2, session_id="a", input_length=half - 1, output_length=1).input_length == 2**24 - 1
    with pytest.raises(ValueError, match=r"session 'a' makes its conversation 16777217 tokens long .*line 2"):
        place(assembler, 3, session_id="a", input_length=1, output_length=1)
