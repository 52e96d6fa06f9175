"""Tests of how `serving.api` reads a body's numbers and its /tokenize fields, as vLLM 0.32's pydantic models do.

vLLM validates a body with pydantic in lax mode: an int field takes "7", " 7 ", "7.0" and true, a float field
"0.5", "1e3" and "inf". `RULES` is the table of those readings, each checked against pydantic 2.14.4
(pydantic-core 2.50.5, vLLM 0.32's) when written; where pydantic is installed the properties check `lax_integer`
and `lax_number` against it on any string. /tokenize reads only vLLM's `TokenizeCompletionRequest` and
`TokenizeChatRequest` fields, and a completion has no `max_completion_tokens` (vLLM's `CompletionRequest` ignores
it).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from serving.api import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    ServedModel,
    lax_integer,
    lax_number,
    parse_chat,
    parse_completion,
    parse_tokenize,
    tokenize_body,
)
from serving.tokenizer import ByteTokenizer

SERVED = ServedModel(name="tiny", max_prompt_tokens=64, default_max_tokens=16, max_context_tokens=129, vocab_size=256)
TOKENIZER = ByteTokenizer()
USER = [{"role": "user", "content": "hi"}]
NAN = object()  # a float NaN, which no == matches

# (JSON value, an int field's value, a float field's value), None where pydantic refuses it: pydantic 2.14.4's.
RULES: list[tuple[Any, int | None, float | object | None]] = [
    (True, 1, 1.0),
    (False, 0, 0.0),
    (7, 7, 7.0),
    (7.0, 7, 7.0),
    (7.5, None, 7.5),
    (-0.0, 0, -0.0),
    (1e20, None, 1e20),  # a whole float past int64: no int
    (9.223372036854775e18, 9223372036854774784, 9.223372036854775e18),
    (2.0**63, None, 2.0**63),
    (-(2.0**63), None, -(2.0**63)),
    (10**20, 10**20, 1e20),
    (10**400, 10**400, None),  # no float holds it
    ("7", 7, 7.0),
    (" 7 ", 7, 7.0),
    ("\t7\n", 7, 7.0),
    ("\u30007\u2028", 7, 7.0),  # Rust's trim: Unicode White_Space
    ("\x1c7", None, None),  # ... which Python's strip would cut
    ("\ufeff7", None, None),
    ("+7", 7, 7.0),
    ("-7", -7, -7.0),
    ("07", 7, 7.0),
    ("0_7", 7, 7.0),
    ("1_000", 1000, 1000.0),
    ("1__0", None, None),
    ("_1", None, None),
    ("1_", None, None),
    ("-_1", None, -1.0),
    ("0-7", -7, None),  # pydantic-core strips the leading zeros, then reads "-7"
    ("0-07", None, None),
    ("+-7", None, None),
    ("7.0", 7, 7.0),
    ("7.00", 7, 7.0),
    ("1_0.0", 10, 10.0),
    ("7.", None, 7.0),
    (".0", None, 0.0),
    ("7.5", None, 7.5),
    (".5", None, 0.5),
    ("1e3", None, 1000.0),
    ("1E3", None, 1000.0),
    ("1_0e1", None, 100.0),
    ("1.0_0", None, 1.0),
    ("0x10", None, None),
    ("0o7", None, None),
    ("1,5", None, None),
    ("7 0", None, None),
    ("", None, None),
    (" ", None, None),
    ("٣", None, None),  # a digit Python's int() reads
    ("７", None, None),
    ("inf", None, math.inf),
    ("-Infinity", None, -math.inf),
    ("iNf", None, math.inf),
    ("nan", None, NAN),
    ("+nan", None, NAN),
    ("infinit", None, None),
    ("1e400", None, math.inf),
    ("true", None, None),
    ("9" * 4300, int("9" * 4300), math.inf),
    ("9" * 4301, None, math.inf),  # past pydantic's 4300 digits
    ("0" * 5000 + "1", 1, 1.0),  # leading zeros do not count
    ("1" * 4300 + "_1", None, float("1" * 4301)),
    ([], None, None),
    ({}, None, None),
]


def same(got: float | None, expected: float | object | None) -> bool:
    """`got` is `expected` (NaN for `NAN`; a float's sign too)."""
    if expected is NAN:
        return got is not None and math.isnan(got)
    if got is None or expected is None:
        return got is expected
    assert isinstance(expected, int | float)
    return got == expected and math.copysign(1.0, got) == math.copysign(1.0, expected)


@pytest.mark.parametrize(("value", "as_int", "as_float"), RULES)
def test_numbers_are_read_as_vllms_pydantic_reads_them(value: Any, as_int: int | None, as_float: Any) -> None:
    """An int field's and a float field's reading of each value of the table, or None where vLLM refuses it."""
    assert lax_integer(value) == as_int and type(lax_integer(value)) is type(as_int)
    assert same(lax_number(value), as_float)


@pytest.mark.parametrize(
    ("body", "read"),
    [
        ({"max_tokens": "7"}, lambda r: r.sampling.max_tokens == 7),
        ({"max_tokens": True}, lambda r: r.sampling.max_tokens == 1),
        ({"n": "2"}, lambda r: r.n == 2),
        ({"seed": " 5 "}, lambda r: r.sampling.seed == 5),
        ({"min_tokens": "3"}, lambda r: r.sampling.min_tokens == 3),
        ({"top_k": "5.0"}, lambda r: r.sampling.top_k == 5),
        ({"temperature": "0.5"}, lambda r: r.sampling.temperature == 0.5),
        ({"temperature": False}, lambda r: r.sampling.temperature == 0.0),
        ({"top_p": ".5"}, lambda r: r.sampling.top_p == 0.5),
        ({"presence_penalty": "-1e0"}, lambda r: r.sampling.presence_penalty == -1.0),
        ({"logprobs": True}, lambda r: r.sampling.logprobs == 1),
        ({"logprobs": False}, lambda r: r.sampling.logprobs == 0),  # vLLM's answer: each token's own
        ({"prompt_logprobs": True}, lambda r: r.output.prompt_logprobs == 1),
        ({"truncate_prompt_tokens": "4"}, lambda r: r.output.truncate_prompt_tokens == 4),
        ({"stop_token_ids": ["5", 3.0]}, lambda r: r.sampling.stop_token_ids == (3, 5)),
        ({"logit_bias": {"5": "0.5"}}, lambda r: r.sampling.logit_bias == ((5, 0.5),)),
        ({"priority": "3"}, lambda r: True),
        ({"spaces_between_special_tokens": "false"}, lambda r: True),
        ({"echo": True, "max_tokens": False}, lambda r: r.echo_only),  # max_tokens 0: the prompt alone
    ],
)
def test_request_fields_take_what_vllm_takes(body: dict[str, Any], read: Any) -> None:
    """Each numeric field of a completion takes the values vLLM's pydantic model takes (true for 1, "7" for 7,
    "0.5" for 0.5), as that value."""
    assert read(parse_completion({"prompt": "hi", **body}, SERVED))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": "1e3"}, "max_tokens"),
        ({"max_tokens": "0x10"}, "max_tokens"),
        ({"n": "2.5"}, "n"),
        ({"temperature": "nan"}, "temperature"),  # pydantic reads it; our range refuses it
        ({"temperature": "inf"}, "temperature"),
        ({"repetition_penalty": "inf"}, "repetition_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": "2"}, "logprobs"),  # vLLM's own check of its counts refuses a string before pydantic reads it
        ({"prompt_logprobs": "2"}, "prompt_logprobs"),
        ({"logit_bias": {"5": "inf"}}, "logit_bias"),
        ({"stop_token_ids": ["x"]}, "stop_token_ids"),
        ({"priority": "1.5"}, "priority"),
        ({"priority": 2**63}, "priority"),
        ({"spaces_between_special_tokens": 2}, "spaces_between_special_tokens"),
    ],
)
def test_numbers_vllm_refuses_or_out_of_range_are_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as raised:
        parse_completion({"prompt": "hi", **body}, SERVED)
    assert (raised.value.status, raised.value.param) == (400, param)


def test_a_chats_counts_are_read_as_vllm_reads_them() -> None:
    """A chat's `max_completion_tokens` and `top_logprobs` are int fields as vLLM reads them ("7", 2.0, true), but
    `top_logprobs` is no string (vLLM's own check of its log-probability counts)."""
    chat = parse_chat(
        {"messages": USER, "max_completion_tokens": " 7", "logprobs": "true", "top_logprobs": 2.0}, SERVED
    )
    assert (chat.sampling.max_tokens, chat.sampling.logprobs) == (7, 2)
    assert parse_chat({"messages": USER, "logprobs": True, "top_logprobs": True}, SERVED).sampling.logprobs == 1
    with pytest.raises(ApiError) as raised:
        parse_chat({"messages": USER, "logprobs": True, "top_logprobs": "2"}, SERVED)
    assert raised.value.param == "top_logprobs"


# Strings of the characters the readings turn on: digits, signs, underscores, points, exponents, the letters of
# "inf" and "nan", whitespace Rust trims and whitespace it does not.
NUMBERISH = st.text(alphabet="0123456789_+-.eEinfatyINFATY \t\n\x0b\x1c\x85\xa0\u2003\u3000\u200b١x,", max_size=12)


@settings(max_examples=500)
@example("0-7")
@example(" 1_0.00 ")
@example("-_1")
@given(st.one_of(NUMBERISH, st.text(max_size=6), st.integers(), st.floats(), st.booleans()))
def test_any_value_is_read_as_pydantic_reads_it(value: Any) -> None:
    """`lax_integer` and `lax_number` read any JSON scalar exactly as pydantic's lax `int` and `float` do (the
    value, or None where pydantic refuses it)."""
    pydantic = pytest.importorskip("pydantic")
    for read, kind in ((lax_integer, int), (lax_number, float)):
        try:
            expected: Any = pydantic.TypeAdapter(kind).validate_python(value)
        except pydantic.ValidationError:
            expected = None
        if isinstance(expected, float) and math.isnan(expected):
            expected = NAN
        assert same(read(value), expected), (value, kind)


# ---------------------------------------------------------------------------------------------- /tokenize


def test_tokenize_reads_only_its_own_fields() -> None:
    """/tokenize takes what vLLM's tokenize requests hold (`prompt` or `messages`, `add_special_tokens`,
    `return_token_strs`, a chat's rendering options) and ignores a generation's fields, which vLLM never checks
    there: `max_tokens` 0 or a `min_tokens` over it are no 400."""
    for extra in ({"max_tokens": 0}, {"min_tokens": 5, "max_tokens": 3}, {"temperature": 9}, {"stream": "maybe"}):
        request, _ = parse_tokenize({"prompt": "abc", **extra}, SERVED)
        assert tokenize_body(request, TOKENIZER, SERVED)["tokens"] == list(b"abc")
        chat, _ = parse_tokenize({"messages": USER, **extra}, SERVED)
        assert bytes(tokenize_body(chat, TOKENIZER, SERVED)["tokens"]) == b"<|user|>\nhi\n<|assistant|>\n"
    request, _ = parse_tokenize({"prompt": "abc", "add_special_tokens": "false"}, SERVED)
    assert isinstance(request, CompletionRequest) and not request.sampling.add_special_tokens
    chat, _ = parse_tokenize({"messages": USER, "add_generation_prompt": False}, SERVED)
    assert (
        isinstance(chat, ChatRequest) and bytes(tokenize_body(chat, TOKENIZER, SERVED)["tokens"]) == b"<|user|>\nhi\n"
    )


def test_tokenize_measures_a_chat_of_more_messages_than_the_prompt_limit() -> None:
    """A chat whose messages outnumber the prompt limit is a generation's 400 (`context_length_exceeded`), but
    /tokenize measures it as it measures any prompt over the limits."""
    many = {"messages": [{"role": "user", "content": ""}] * (SERVED.max_prompt_tokens + 1)}
    with pytest.raises(ApiError) as raised:
        parse_chat(many, SERVED)
    assert raised.value.code == "context_length_exceeded"
    chat, _ = parse_tokenize(many, SERVED)
    assert tokenize_body(chat, TOKENIZER, SERVED)["count"] == len(b"<|user|>\n\n") * 65 + len(b"<|assistant|>\n")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [1, 2]}, "prompt"),  # vLLM's TokenizeCompletionRequest: a string
        ({"prompt": ["a", "b"]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "a", "add_special_tokens": "maybe"}, "add_special_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": USER, "tools": [{"type": "function"}]}, "tools"),  # vLLM would render them
        ({"messages": USER, "chat_template": "{{ messages }}"}, "chat_template"),
        ({"messages": USER, "continue_final_message": True}, "continue_final_message"),
    ],
)
def test_tokenize_refuses_its_own_fields_bad_values_naming_them(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as raised:
        parse_tokenize(body, SERVED)
    assert (raised.value.status, raised.value.param) == (400, param)


# ---------------------------------------------------------------------------------------------- max_completion_tokens


def test_a_completion_ignores_max_completion_tokens_as_vllm_does(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's `CompletionRequest` has no `max_completion_tokens`: a completion's is ignored (with the warning any
    unknown field gets), whatever its value, and `max_tokens` (or its default 16) decides; a chat's still wins over
    its `max_tokens`."""
    with caplog.at_level("WARNING", logger="serving.api"):
        parsed = parse_completion({"prompt": "hi", "max_tokens": 5, "max_completion_tokens": 50}, SERVED)
    assert parsed.sampling.max_tokens == 5 and "max_completion_tokens" in caplog.text
    assert parse_completion({"prompt": "hi", "max_completion_tokens": "bad"}, SERVED).sampling.max_tokens == 16
    echoed = parse_completion({"prompt": "hi", "echo": True, "max_completion_tokens": 0}, SERVED)
    assert not echoed.echo_only and echoed.sampling.max_tokens == 16
    chat = parse_chat({"messages": USER, "max_tokens": 5, "max_completion_tokens": 50}, SERVED)
    assert chat.sampling.max_tokens == 50
