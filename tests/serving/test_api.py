"""Tests of `serving.api` (the OpenAI protocol, pure) and `serving.tokenizer`'s stop strings, without a cluster.

Examples pin each attack on the body (a lone surrogate, deep nesting, a 5,000-digit integer, gzip garbage, an
unknown charset, non-object JSON) to a 4xx naming what is wrong, and each unimplemented parameter to a 400 naming
it. Properties: arbitrary bytes with arbitrary headers, and arbitrary JSON values (also under the API's own
keys), either parse into a request or raise an `ApiError` with a 4xx status whose body is JSON; a request built
from valid values parses back to the same record; `TextStream` gives out exactly the text cut before the first
stop string to complete, however the text is split.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from typing import Any

import attrs
import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st
from serving.api import (
    ApiError,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    Logprobs,
    Output,
    Reply,
    SamplingOptions,
    ServedModel,
    Usage,
    authorized,
    decode_body,
    detokenize_body,
    generation_limit,
    models_body,
    parse_chat,
    parse_completion,
    parse_tokenize,
    prompt_logprobs_json,
    prompt_tokens,
    rejection_error,
    requested_max_tokens,
    stream_flag,
    tokenize_body,
)
from serving.tokenizer import ByteTokenizer, TextStream

from mooncake.engine.logprobs import TokenLogprobs
from mooncake.sched.outcome import Outcome, Reason

SERVED = ServedModel(name="tiny", max_prompt_tokens=64, default_max_tokens=16, max_context_tokens=129, vocab_size=256)
TOKENIZER = ByteTokenizer()


def body_of(raw: bytes, **headers: str) -> dict[str, Any]:
    return decode_body(raw, content_type=headers.get("content_type"), content_encoding=headers.get("encoding"))


def refused(call: Any, *args: Any, **kwargs: Any) -> ApiError:
    with pytest.raises(ApiError) as raised:
        call(*args, **kwargs)
    return raised.value


# ---------------------------------------------------------------------------------------------- bytes to JSON


@pytest.mark.parametrize(
    ("raw", "headers", "status", "said"),
    [
        (b'{"prompt": [[[[' + b"[" * 200_000, {}, 400, "JSON"),  # deep nesting
        (b'{"max_tokens": ' + b"9" * 5000 + b"}", {}, 400, "JSON"),  # past Python's integer digit limit
        (b"\x1f\x8b\x08\x00garbage", {"encoding": "gzip"}, 400, "gzip"),
        (b"not deflate", {"encoding": "deflate"}, 400, "deflate"),
        (b"{}", {"encoding": "br"}, 415, "Content-Encoding"),
        (b"{}", {"encoding": "gzip, gzip, gzip"}, 415, "Content-Encoding"),
        (b'{"prompt": "hi"}', {"content_type": "application/json; charset=klingon"}, 400, "charset"),
        (b'{"prompt": "hi"}', {"content_type": "application/json; charset=rot13"}, 400, "charset"),
        (b"[1, 2]", {}, 400, "object"),
        (b'"prompt"', {}, 400, "object"),
        (b"null", {}, 400, "object"),
        (b"", {}, 400, "empty"),
        (b"  \n", {}, 400, "empty"),
        (b'{"temperature": NaN}', {}, 400, "JSON"),
        (b'{"temperature": Infinity}', {}, 400, "JSON"),
        (b"\xff\xfe{}", {}, 400, "utf-8"),
        (b"{not json", {}, 400, "JSON"),
    ],
)
def test_malformed_bodies_are_4xx(raw: bytes, headers: dict[str, str], status: int, said: str) -> None:
    """Each attack on the body is a 4xx saying what is wrong, never an exception of another kind."""
    error = refused(body_of, raw, **headers)
    assert error.status == status and said in error.message
    assert error.body()["error"]["type"] == "invalid_request_error"


def test_a_bomb_is_a_413() -> None:
    """A gzip body that inflates past the cap is refused without inflating it all."""
    bomb = gzip.compress(b" " * (4 << 20))
    error = refused(decode_body, bomb, content_encoding="gzip", max_bytes=1 << 20)
    assert error.status == 413


def test_encodings_and_charsets_decode() -> None:
    """gzip, zlib and raw deflate, identity, a BOM, UTF-16 and ASCII charsets all give the same object."""
    text = '{"prompt": "h\u00e9llo"}'
    raw = text.encode()
    expected = {"prompt": "h\u00e9llo"}
    assert body_of(gzip.compress(raw), encoding="gzip") == expected
    assert body_of(zlib.compress(raw), encoding="deflate") == expected
    raw_deflate = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    assert body_of(raw_deflate.compress(raw) + raw_deflate.flush(), encoding="deflate") == expected
    assert body_of(raw, encoding="identity") == expected
    assert body_of(b"\xef\xbb\xbf" + raw) == expected
    assert body_of(text.encode("utf-16"), content_type="application/json; charset=UTF-16") == expected
    assert body_of(b'{"prompt": "hi"}', content_type='application/json; charset="us-ascii"') == {"prompt": "hi"}


# ---------------------------------------------------------------------------------------------- fields


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "n": 17}, "n"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": "hi", "logprobs": -1}, "logprobs"),
        ({"prompt": "hi", "logprobs": "true"}, "logprobs"),  # an int field: true is 1, but "true" is no int
        ({"prompt": "hi", "echo": 2}, "echo"),
        ({"prompt": "hi", "suffix": "end"}, "suffix"),
        ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "hi", "frequency_penalty": -2.01}, "frequency_penalty"),
        ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"\u00b2": 1}}, "logit_bias"),  # a digit int() does not read
        ({"prompt": "hi", "logit_bias": {"5.0": 1}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"9" * 5000: 1}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"256": 1}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"5": "one"}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": [5, 1]}, "logit_bias"),
        ({"prompt": "hi", "stop_token_ids": [256]}, "stop_token_ids"),
        ({"prompt": "hi", "stop_token_ids": 5}, "stop_token_ids"),
        ({"prompt": "hi", "include_stop_str_in_output": 2}, "include_stop_str_in_output"),
        ({"prompt": "hi", "top_k": -2}, "top_k"),
        ({"prompt": "hi", "top_k": 2.5}, "top_k"),
        ({"prompt": "hi", "min_p": 1.5}, "min_p"),
        ({"prompt": "hi", "user": 5}, "user"),
        ({"prompt": "a\ud800"}, "prompt"),
        ({"prompt": ["a", 5]}, "prompt"),
        ({"prompt": [[1], [256]]}, "prompt"),
        ({"prompt": [[1], []]}, "prompt"),
        ({"prompt": ["a"] * 65}, "prompt"),
        ({"prompt": ["a"] * 5, "n": 13}, "n"),
        ({"prompt": [1, 256]}, "prompt"),
        ({"prompt": [1, "2"]}, "prompt"),
        ({"prompt": "hi", "min_tokens": -1}, "min_tokens"),
        ({"prompt": "hi", "max_tokens": 3, "min_tokens": 4}, "min_tokens"),
        ({"prompt": "hi", "ignore_eos": "maybe"}, "ignore_eos"),
        ({"prompt": "hi", "add_special_tokens": 2}, "add_special_tokens"),
        ({"prompt": "hi", "return_token_ids": 2}, "return_token_ids"),
        ({"prompt": "hi", "return_tokens_as_token_ids": "maybe"}, "return_tokens_as_token_ids"),
        ({"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
        ({"prompt": "hi", "allowed_token_ids": [256]}, "allowed_token_ids"),
        ({"prompt": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"prompt": "hi", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"prompt": "hi", "truncate_prompt_tokens": 65}, "truncate_prompt_tokens"),
        ({"prompt": "hi", "truncation_side": "both"}, "truncation_side"),
        ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "hi", "repetition_penalty": "1,2"}, "repetition_penalty"),
        ({"prompt": "hi", "repetition_penalty": 10**400}, "repetition_penalty"),
        ({"prompt": "hi", "skip_special_tokens": "nope"}, "skip_special_tokens"),
        ({"prompt": "hi", "model": 5}, "model"),
        ({"prompt": "hi", "max_tokens": 10**4000}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": "7.5"}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 5.5}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": math.inf}, "max_tokens"),
        ({"prompt": "hi", "temperature": 10**4000}, "temperature"),
        ({"prompt": "hi", "temperature": 2.5}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "top_p": 1.01}, "top_p"),
        ({"prompt": "hi", "seed": 2**63}, "seed"),
        ({"prompt": "hi", "stop": ""}, "stop"),
        ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": "hi", "stop": [3]}, "stop"),
        ({"prompt": "hi", "stop": "x" * 257}, "stop"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": 2}}, "stream_options"),
        ({"prompt": "hi", "stream": False, "stream_options": {"other": True}}, "stream_options"),
        ({"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": "maybe"}}, "stream_options"),
        ({"prompt": "hi", "stream": True, "stream_options": []}, "stream_options"),
        ({"prompt": "hi", "stream": "maybe"}, "stream"),
    ],
)
def test_a_completion_field_out_of_bounds_is_a_400_naming_it(body: dict[str, Any], param: str) -> None:
    """Unimplemented parameters at another than their neutral value, and ill-typed ones, are refused, naming
    the parameter."""
    error = refused(parse_completion, body, SERVED)
    assert error.status == 400 and error.param == param
    assert param in error.message and error.body()["error"]["param"] == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"prompt": "hi"}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": "hi", "tool_calls": [{"id": "c"}]}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": "hi", "audio": {}}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "a\udfff"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 2}, "logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1.5}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
def test_a_chat_field_out_of_bounds_is_a_400_naming_it(body: dict[str, Any], param: str) -> None:
    error = refused(parse_chat, body, SERVED)
    assert error.status == 400 and error.param == param


def test_an_unknown_model_is_a_404_model_not_found() -> None:
    """Another model than the served one is OpenAI's 404 `model_not_found`; the served one or none is accepted."""
    error = refused(parse_completion, {"prompt": "hi", "model": "gpt-4"}, SERVED)
    assert error.status == 404 and error.code == "model_not_found" and error.param == "model"
    assert error.body()["error"] == {
        "message": error.message,
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert parse_completion({"prompt": "hi", "model": "tiny"}, SERVED).model == "tiny"
    assert parse_completion({"prompt": "hi"}, SERVED).model == "tiny"


def test_a_full_request_parses_into_its_records() -> None:
    """Every implemented field lands in the records; neutral values of the unimplemented ones are accepted."""
    body = {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        ],
        "max_completion_tokens": 7,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 3,
        "stop": ["\n", "END"],
        "stream": True,
        "stream_options": {"include_usage": True},
        "n": 1,
        "logprobs": False,
        "presence_penalty": 0,
        "user": "someone",
        "tool_choice": "none",
    }
    assert parse_chat(body, SERVED) == ChatRequest(
        model="tiny",
        messages=(
            ChatMessage(role="system", content="Be brief."),
            ChatMessage(role="user", content=[{"type": "text", "text": "Hi"}]),
        ),
        sampling=SamplingOptions(
            max_tokens=7, temperature=0.7, top_p=0.9, seed=3, stop=("\n", "END"), add_special_tokens=False
        ),
        stream=True,
        include_usage=True,
    )
    assert parse_completion({"prompt": ["one"], "stop": "x"}, SERVED).sampling == SamplingOptions(
        max_tokens=16, temperature=1.0, stop=("x",)
    )


def test_without_max_tokens_a_completion_gets_16_and_a_chat_the_rest_of_the_context() -> None:
    """vLLM's defaults: a completion `default_max_tokens`; a chat what the context leaves after its prompt, settled
    once the prompt is tokenized (the check of prompt + max_tokens then has nothing to refuse); a given value
    stays, in either API."""
    assert parse_completion({"prompt": "hi"}, SERVED).sampling.max_tokens == 16
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, SERVED)
    assert chat.sampling.max_tokens is None
    tokens = prompt_tokens(chat, TOKENIZER, SERVED)
    assert generation_limit(chat.sampling, len(tokens), SERVED).max_tokens == 129 - len(tokens)
    longest = parse_chat({"messages": [{"role": "user", "content": "x" * 40}]}, SERVED)
    assert generation_limit(longest.sampling, 64, SERVED).max_tokens == 129 - 64 >= SERVED.default_max_tokens
    for limit in ("max_tokens", "max_completion_tokens"):
        given = parse_chat({"messages": [{"role": "user", "content": "hi"}], limit: 5}, SERVED).sampling
        assert generation_limit(given, len(tokens), SERVED).max_tokens == 5


def test_a_completions_null_max_tokens_is_16_as_vllm_reads_it() -> None:
    """vLLM 0.32's `CompletionRequest` reads an explicit null `max_tokens` as unset (its `normalize_null_max_tokens`
    validator puts the field's default, 16, back), so a completion's null is 16, as an absent one is, not the rest
    of the context (a chat's null is: its model has no such validator)."""
    assert requested_max_tokens({"max_tokens": None}, default=16, completion=True) == 16
    null = parse_completion({"prompt": "hi", "max_tokens": None}, SERVED)
    tokens = prompt_tokens(null, TOKENIZER, SERVED)
    assert generation_limit(null.sampling, len(tokens), SERVED).max_tokens == 16


def test_a_chat_without_max_tokens_generates_at_most_the_generation_configs_max_new_tokens() -> None:
    """vLLM's `get_max_tokens`: a chat that sets no max_tokens gets what the context leaves, capped by the
    checkpoint's `max_new_tokens`; a given max_tokens (above it too) and a completion's 16 are not capped; a
    min_tokens over the cap is vLLM's 400."""
    served = attrs.evolve(SERVED, default_chat_max_tokens=20)
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, served)
    assert generation_limit(chat.sampling, 10, served).max_tokens == 20
    assert generation_limit(chat.sampling, 120, served).max_tokens == 129 - 120  # the context leaves less
    given = parse_chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}, served).sampling
    assert generation_limit(given, 10, served).max_tokens == 50
    assert parse_completion({"prompt": "hi"}, attrs.evolve(served, default_chat_max_tokens=8)).sampling.max_tokens == 16
    eager = parse_chat({"messages": [{"role": "user", "content": "hi"}], "min_tokens": 21}, served).sampling
    with pytest.raises(ApiError, match="min_tokens must be less than or equal to max_tokens=20, got 21"):
        generation_limit(eager, 10, served)


def test_a_chat_message_as_the_sdk_dumps_an_answer_is_accepted() -> None:
    """A client appending `choices[0].message.model_dump()` sends OpenAI's assistant fields at null (function_call,
    audio, annotations, refusal, tool_calls); vLLM's `reasoning_content` and a part's `cache_control` are ignored
    as vLLM ignores them (the message keeps them, as given; the chat's reader drops them); only what asks for tools
    or audio is refused."""
    answer = {
        "role": "assistant",
        "content": "Hello.",
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": None,
        "reasoning_content": "thinking",
    }
    part = {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}
    request = parse_chat({"messages": [{"role": "user", "content": [part]}, answer]}, SERVED)
    rendered = TOKENIZER.render_chat([m.as_message() for m in request.messages])
    assert rendered == "<|user|>\nHi\n<|assistant|>\nHello.\n<|assistant|>\n"
    for key, value in (("function_call", {"name": "f", "arguments": "{}"}), ("audio", {"id": "a"})):
        error = refused(parse_chat, {"messages": [{**answer, key: value}]}, SERVED)
        assert error.status == 400 and f"messages[0].{key}" in error.message


def test_models_advertises_the_longest_context_every_split_of_it_fits() -> None:
    """vLLM's `max_model_len` bounds a prompt plus its max_tokens; with a prompt limit below the context, the
    length advertised is the prompt limit, so that no request within it is refused for length."""
    (model,) = models_body(SERVED)["data"]
    assert model["max_model_len"] == 64
    wide = attrs.evolve(SERVED, max_prompt_tokens=500, max_context_tokens=300)
    assert models_body(wide)["data"][0]["max_model_len"] == 300


def test_an_integral_float_is_its_integer() -> None:
    """`max_tokens: 5.0` and `seed: 7.0` read as 5 and 7, as vLLM's pydantic models read them (5.5 is a 400)."""
    sampling = parse_completion({"prompt": "hi", "max_tokens": 5.0, "seed": 7.0}, SERVED).sampling
    assert (sampling.max_tokens, sampling.seed) == (5, 7) and type(sampling.max_tokens) is int


def test_left_out_temperature_and_top_p_are_the_served_models_defaults() -> None:
    """As vLLM: a request without temperature or top_p samples at the checkpoint's generation_config values,
    else at 1.0 (OpenAI's defaults); a given value, 0 included, wins."""
    assert parse_completion({"prompt": "hi"}, SERVED).sampling.temperature == 1.0
    served = attrs.evolve(SERVED, default_temperature=0.6, default_top_p=0.9)
    sampling = parse_completion({"prompt": "hi"}, served).sampling
    assert (sampling.temperature, sampling.top_p) == (0.6, 0.9)
    given = parse_completion({"prompt": "hi", "temperature": 0, "top_p": 1}, served).sampling
    assert (given.temperature, given.top_p) == (0.0, 1.0)


@pytest.mark.parametrize(
    ("n", "message"),
    [
        (17, "n must be an integer in [1, 16], got 17"),
        (0, "n must be an integer in [1, 16], got 0"),
        (-1, "n must be an integer in [1, 16], got -1"),
        ("1.5", "n must be an integer in [1, 16], got '1.5'"),
        (1.5, "n must be an integer in [1, 16], got 1.5"),
        (10**4000, "n must be an integer in [1, 16]"),
        (False, "n must be an integer in [1, 16], got False"),  # 0, as vLLM reads it
    ],
)
def test_a_choice_count_out_of_its_range_is_a_400_naming_n(n: object, message: str) -> None:
    """`n` choices, 1 to 16 (each a request of the cluster); a count that is not one, or out of the range, is a
    400 naming `n` (a whole float is its integer, as vLLM reads it)."""
    error = refused(parse_completion, {"prompt": "hi", "n": n}, SERVED)
    assert (error.status, error.param) == (400, "n") and message in error.message
    assert parse_completion({"prompt": "hi", "n": 16.0}, SERVED).n == 16
    assert parse_chat({"messages": [{"role": "user", "content": "hi"}], "n": 3}, SERVED).n == 3
    # vLLM 0.32's requests have no best_of: it is ignored, and n choices drawn, whatever it says.
    for best_of in (1, 3, "x"):
        assert parse_completion({"prompt": "hi", "n": 2, "best_of": best_of}, SERVED).n == 2
        assert parse_chat({"messages": [{"role": "user", "content": "hi"}], "n": 2, "best_of": best_of}, SERVED).n == 2


def test_tokenize_measures_a_prompt_over_the_limits_and_detokenize_undoes_it() -> None:
    """vLLM's /tokenize answers a prompt's tokens however long it is (a client asks to measure it); /detokenize
    gives the text back; ids outside the vocabulary or another model are refused."""
    long = parse_completion({"prompt": "x" * 200}, SERVED)
    assert refused(prompt_tokens, long, TOKENIZER, SERVED).code == "context_length_exceeded"
    answer = tokenize_body(long, TOKENIZER, SERVED)
    assert (answer["count"], answer["max_model_len"]) == (200, 64) and answer["tokens"] == [120] * 200
    assert detokenize_body({"tokens": answer["tokens"]}, TOKENIZER, SERVED) == {"prompt": "x" * 200}
    for bad in ({"tokens": [256]}, {"tokens": "hi"}, {"tokens": ["x"]}, {}):
        assert refused(detokenize_body, bad, TOKENIZER, SERVED).param == "tokens"
    assert refused(detokenize_body, {"tokens": [1], "model": "other"}, TOKENIZER, SERVED).status == 404


def test_tokenize_lists_each_tokens_string_when_asked() -> None:
    """vLLM's `return_token_strs`: each token's vocabulary string beside the ids (null when not asked, or false); a
    value not a boolean is a 400 naming it; a chat's `messages` are tokenized through the template all the same."""
    request, asked = parse_tokenize({"prompt": "hé", "return_token_strs": True}, SERVED)
    answer = tokenize_body(request, TOKENIZER, SERVED, token_strs=asked)
    assert answer["tokens"] == list("hé".encode()) and answer["token_strs"] == [
        TOKENIZER.piece(t) for t in answer["tokens"]
    ]
    for body in (
        {"prompt": "h"},
        {"prompt": "h", "return_token_strs": False},
        {"prompt": "h", "return_token_strs": None},
    ):
        request, asked = parse_tokenize(body, SERVED)
        assert tokenize_body(request, TOKENIZER, SERVED, token_strs=asked)["token_strs"] is None
    assert refused(parse_tokenize, {"prompt": "h", "return_token_strs": "maybe"}, SERVED).param == "return_token_strs"
    chat, asked = parse_tokenize({"messages": [{"role": "user", "content": "hi"}], "return_token_strs": True}, SERVED)
    assert isinstance(chat, ChatRequest) and asked


def test_prompt_tokens_checks_the_limit() -> None:
    """A prompt over the limit, or a prompt and max_tokens over the context, is vLLM's 400
    `context_length_exceeded` naming the limit; an empty one a 400; chat goes through the template; token ids
    are the prompt as they are."""
    request = parse_completion({"prompt": "x" * 65}, SERVED)
    error = refused(prompt_tokens, request, TOKENIZER, SERVED)
    assert (error.status, error.code) == (400, "context_length_exceeded") and "64" in error.message
    assert refused(prompt_tokens, parse_completion({"prompt": ""}, SERVED), TOKENIZER, SERVED).status == 400
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, SERVED)
    assert bytes(prompt_tokens(chat, TOKENIZER, SERVED)) == b"<|user|>\nhi\n<|assistant|>\n"
    many = {"messages": [{"role": "user", "content": ""}] * 65}
    assert refused(parse_chat, many, SERVED).code == "context_length_exceeded"
    # 60 prompt tokens + 69 = the 129-token context: served as asked; more, up to the context itself, is trimmed to
    # the 69 left, as vLLM 0.32 trims it (`get_max_tokens`), not refused (past the context: test_api_edges).
    for asked, planned in ((69, 69), (70, 69), (129, 69)):
        request = parse_completion({"prompt": "x" * 60, "max_tokens": asked}, SERVED)
        assert len(prompt_tokens(request, TOKENIZER, SERVED)) == 60
        assert generation_limit(request.sampling, 60, SERVED).max_tokens == planned
    for ids in ([72, 105], [[72, 105]]):
        assert prompt_tokens(parse_completion({"prompt": ids}, SERVED), TOKENIZER, SERVED) == [72, 105]


def test_vllm_clients_extras_are_accepted_at_their_neutral_values_and_unknown_fields_ignored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """As vLLM: a client's extra fields this server does not know are ignored (with a warning naming them), and
    vLLM's own sampling extras are accepted where they change nothing; no seed means a fresh stream per request
    (drawn at admission), a given one is kept."""
    body = {
        "prompt": "hi",
        "top_k": -1,
        "min_tokens": 0,
        "repetition_penalty": 1.0,
        "ignore_eos": False,
        "skip_special_tokens": True,
        "chat_template_kwargs": {"enable_thinking": False},
        "max_tokens": 5,
        "some_new_field": 1,
    }
    with caplog.at_level("WARNING", logger="serving.api"):
        parsed = parse_completion(body, SERVED)
    assert parsed.sampling == SamplingOptions(max_tokens=5, temperature=1.0)
    assert parsed.sampling.seed is None and parse_completion({"prompt": "hi", "seed": 7}, SERVED).sampling.seed == 7
    assert "some_new_field" in caplog.text and "top_k" not in caplog.text


def test_vllms_value_ranges_and_rendering_options_are_taken_as_vllm_takes_them() -> None:
    """A negative 64-bit seed (vLLM takes any) is the same bits unsigned, but -1, which vLLM reads as no seed (a
    fresh stream per request, as null); n / best_of 1.0 and top_logprobs 0 are neutral; skip_special_tokens reaches the text stream; chat_template_kwargs reach the chat template (never
    its own inputs)."""
    assert parse_completion({"prompt": "hi", "seed": -1}, SERVED).sampling.seed is None
    assert parse_completion({"prompt": "hi", "seed": -2}, SERVED).sampling.seed == 2**64 - 2
    assert parse_completion({"prompt": "hi", "seed": -(2**63)}, SERVED).sampling.seed == 2**63
    assert refused(parse_completion, {"prompt": "hi", "seed": -(2**63) - 1}, SERVED).param == "seed"
    parsed = parse_completion({"prompt": "hi", "n": 1.0, "best_of": 1, "top_logprobs": 0, "logprobs": False}, SERVED)
    assert parsed.sampling.skip_special_tokens
    assert not parse_completion({"prompt": "hi", "skip_special_tokens": False}, SERVED).sampling.skip_special_tokens
    # vLLM 0.32's `CompletionRequest` has no `top_logprobs`: an unknown field, ignored (a chat's is served).
    plain = parse_completion({"prompt": "hi"}, SERVED)
    assert parse_completion({"prompt": "hi", "top_logprobs": 2}, SERVED) == plain
    messages = [{"role": "user", "content": "hi"}]
    chat = parse_chat({"messages": messages, "chat_template_kwargs": {"enable_thinking": False}}, SERVED)
    assert chat.template_variables == {"enable_thinking": False}
    seen: list[object] = []

    class Recording(ByteTokenizer):
        def render_chat(self, messages: Any, *, variables: Any = None, **_: Any) -> str:
            seen.append(variables)
            return super().render_chat(messages)

    prompt_tokens(chat, Recording(), SERVED)
    assert seen == [{"enable_thinking": False}]
    for bad in ([1], {"messages": []}, {"tools": [{"type": "function"}]}):
        error = refused(parse_chat, {"messages": messages, "chat_template_kwargs": bad}, SERVED)
        assert error.status == 400 and error.param == "chat_template_kwargs"
    flags = {"add_generation_prompt": False, "continue_final_message": True, "x": 1}  # the request's own win
    assert parse_chat({"messages": messages, "chat_template_kwargs": flags}, SERVED).template_variables == {"x": 1}


def test_what_benchmark_clients_send_is_taken_as_vllm_takes_it() -> None:
    """SGLang's `bench_serving` and `vllm bench serve --ignore-eos` send `ignore_eos: true` (and `min_tokens`) to fix
    each output's length: both reach the sampling options; `min_tokens` over `max_tokens`, or over what the context
    leaves a chat, is vLLM's 400. `add_special_tokens` defaults as vLLM's (a completion true, a chat false) and
    reaches the tokenizer. A message's text parts are joined by newlines, as vLLM renders them."""
    sglang = {"model": "tiny", "prompt": "hi", "temperature": 0.0, "best_of": 1, "max_tokens": 5, "stream": True}
    sampling = parse_completion({**sglang, "ignore_eos": True, "min_tokens": 5}, SERVED).sampling
    assert (sampling.ignore_eos, sampling.min_tokens, sampling.max_tokens) == (True, 5, 5)
    assert sampling.add_special_tokens
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}], "min_tokens": 100}, SERVED)
    assert not chat.sampling.add_special_tokens and chat.sampling.max_tokens is None
    assert generation_limit(chat.sampling, 29, SERVED).max_tokens == 100  # exactly what the context leaves
    over = refused(generation_limit, chat.sampling, 30, SERVED)
    assert (over.status, over.param) == (400, "min_tokens") and "max_tokens=99, got 100" in over.message
    asked: list[bool] = []

    class Recording(ByteTokenizer):
        def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
            asked.append(add_special_tokens)  # a chat's rendered text too
            return super().encode(text)

    for body, parse in (
        ({"prompt": "hi"}, parse_completion),
        ({"prompt": "hi", "add_special_tokens": False}, parse_completion),
        ({"messages": [{"role": "user", "content": "hi"}]}, parse_chat),
        ({"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True}, parse_chat),
    ):
        prompt_tokens(parse(body, SERVED), Recording(), SERVED)  # type: ignore[operator]
    assert asked == [True, False, False, True]
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    (message,) = parse_chat({"messages": [{"role": "user", "content": parts}]}, SERVED).messages
    assert TOKENIZER.render_chat([message.as_message()]) == "<|user|>\nHello\nworld\n<|assistant|>\n"


def test_min_tokens_holds_off_stops_and_ignore_eos_drops_the_stop_ids() -> None:
    """A `TextStream` with `min_tokens` m ends at no stop string within its first m tokens and at no stop id
    within its first m - 1 (they are text; vLLM's detokenizer and `check_stop`), and at the first after;
    `ignore_eos` leaves a checkpoint's stream no stop ids."""
    stream = TextStream(["b"], min_tokens=2)
    assert [stream.feed(t) for t in b"abab"] == ["a", "b", "a", ""]
    assert (stream.stopped, stream.stop_reason) == (True, "b")
    eos = TextStream(stop_ids=frozenset({300}), min_tokens=2)  # an id past the bytes: it decodes to nothing
    assert [eos.feed(t) for t in (300, ord("x"), 300, ord("y"))] == ["", "x", "", ""]
    assert eos.stopped and eos.stop_reason is None
    unheld = TextStream(["b"])
    assert [unheld.feed(t) for t in b"ab"] == ["a", ""] and unheld.stopped


def test_a_chat_transcript_with_tool_turns_parses() -> None:
    """An assistant turn without content (it called a tool) and a tool's answer (its `tool_call_id` kept for the
    chat template) are parts of a transcript."""
    body = {
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
    }
    assert parse_chat(body, SERVED).messages == (
        ChatMessage(role="user", content="weather?"),
        ChatMessage(role="assistant", content=None),
        ChatMessage(role="tool", content="sunny", fields={"tool_call_id": "call_1"}),
    )


# ---------------------------------------------------------------------------------------------- properties

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
API_KEYS = sorted(
    {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop"}
    | {"stream", "stream_options", "n", "logprobs", "echo", "best_of", "user", "tools", "response_format"}
)
api_bodies = st.fixed_dictionaries(
    {},
    optional={key: json_values for key in API_KEYS}
    | {
        "prompt": st.text(max_size=80) | json_values,
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "tool"]), "content": st.text(max_size=20) | json_values}
            ),
            max_size=3,
        ),
        "model": st.sampled_from(["tiny", "other"]),
    },
)
content_types = st.sampled_from(
    [None, "application/json", "application/json; charset=utf-8", "text/plain; charset=latin-1", "a; charset=utf-16"]
) | st.text(max_size=30)
encodings = st.sampled_from([None, "gzip", "deflate", "identity", "br", "gzip, identity"]) | st.text(max_size=12)


def outcome(raw: bytes, *, chat: bool, content_type: str | None = None, encoding: str | None = None) -> Any:
    """The request `raw` parses into, or the ApiError it raises, which must be a 4xx with a JSON body."""
    try:
        body = decode_body(raw, content_type=content_type, content_encoding=encoding, max_bytes=1 << 16)
        request = parse_chat(body, SERVED) if chat else parse_completion(body, SERVED)
        prompt_tokens(request, TOKENIZER, SERVED)
    except ApiError as error:
        assert 400 <= error.status < 500, error
        json.loads(json.dumps(error.body()))
        return error
    return request


@settings(max_examples=300)
@given(st.binary(max_size=300), st.booleans(), content_types, encodings)
def test_any_bytes_are_a_request_or_a_4xx(
    raw: bytes, chat: bool, content_type: str | None, encoding: str | None
) -> None:
    outcome(raw, chat=chat, content_type=content_type, encoding=encoding)


@settings(max_examples=300)
@st.composite
def nearly_valid_bodies(draw: st.DrawFn, chat: bool) -> tuple[dict[str, Any], bool]:
    """A valid body with at most one of the API's keys set to an arbitrary value: most parse, and the value then
    reaches the checks past parsing (`prompt_tokens`), which bodies of arbitrary values under every key never do."""
    body: dict[str, Any] = {"model": "tiny"}
    text = draw(st.text(min_size=1, max_size=8))  # a byte-level tokenizer: at most 32 tokens, within the 64
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    perturbed = draw(st.booleans())
    if perturbed:
        body[draw(st.sampled_from(sorted(API_KEYS)))] = draw(json_values)
    return body, perturbed


@given(json_values | api_bodies, st.booleans())
def test_any_json_is_a_request_or_a_4xx(value: Any, chat: bool) -> None:
    """Arbitrary JSON values, and objects of arbitrary values under the API's keys, never escape as another error."""
    outcome(json.dumps(value).encode(), chat=chat)


@given(st.data(), st.booleans())
def test_a_valid_body_with_one_arbitrary_value_is_a_request_or_a_4xx(data: st.DataObject, chat: bool) -> None:
    """A valid body with one key's value arbitrary is a request or a 4xx (the arbitrary bodies above are nearly
    all refused at parsing); without it, a request."""
    body, perturbed = data.draw(nearly_valid_bodies(chat))
    result = outcome(json.dumps(body).encode(), chat=chat)
    event("a request" if isinstance(result, (CompletionRequest, ChatRequest)) else "a 4xx")
    if not perturbed:
        assert isinstance(result, (CompletionRequest, ChatRequest))


@settings(max_examples=100)
@given(
    st.text(min_size=1, max_size=40),
    st.integers(min_value=1, max_value=128),
    st.floats(min_value=0.0, max_value=2.0),
    st.floats(min_value=0.001, max_value=1.0),
    st.integers(min_value=0, max_value=2**63 - 1),
    st.lists(st.text(min_size=1, max_size=8), max_size=4),
)
def test_valid_values_parse_back(
    prompt: str, max_tokens: int, temperature: float, top_p: float, seed: int, stop: list[str]
) -> None:
    """A body of valid values, sent as JSON, parses into the record holding exactly them."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": seed}
    expected = CompletionRequest(
        model="tiny",
        prompt=prompt,
        sampling=SamplingOptions(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=tuple(stop)
        ),
    )
    assert parse_completion(body_of(json.dumps({**body, "stop": stop}).encode()), SERVED) == expected


# ---------------------------------------------------------------------------------------------- answers


@pytest.mark.parametrize(
    ("options", "include_usage", "continuous_usage"),
    [
        (None, False, False),
        ({}, False, False),  # vLLM 0.32's defaults (`StreamOptions`): no usage unless asked for
        ({"include_usage": False}, False, False),
        ({"include_usage": True}, True, False),
        ({"continuous_usage_stats": True}, False, False),  # without include_usage: none (`should_include_usage`)
        ({"include_usage": True, "continuous_usage_stats": True}, True, True),
        ({"include_usage": False, "continuous_usage_stats": True}, False, False),  # vLLM: only with the last chunk
        ({"include_usage": None, "continuous_usage_stats": True}, False, False),  # an explicit null is false
        ({"include_obfuscation": False, "other": 1}, False, False),  # keys vLLM does not know are ignored
    ],
)
def test_stream_options_follow_vllm(options: Any, include_usage: bool, continuous_usage: bool) -> None:
    """stream_options as vLLM 0.32 reads it: include_usage defaults to false, the object given or not, and the
    usage in every chunk (continuous_usage_stats) comes only with the last chunk's."""
    body = {"prompt": "hi", "stream": True} | ({} if options is None else {"stream_options": options})
    parsed = parse_completion(body, SERVED)
    assert (parsed.include_usage, parsed.continuous_usage) == (include_usage, continuous_usage)


@pytest.mark.parametrize("stream", [False, None])
def test_empty_stream_options_without_stream_are_taken_as_vllm_takes_them(stream: bool | None) -> None:
    """vLLM refuses stream_options without `stream: true` only when they say something: `{}` (which clients
    built from a default object send) is served, with no usage chunk to give."""
    body: dict[str, Any] = {"prompt": "hi", "stream_options": {}} | ({} if stream is None else {"stream": stream})
    parsed = parse_completion(body, SERVED)
    assert (parsed.include_usage, parsed.continuous_usage) == (False, False)


def test_answer_bodies_have_openai_shapes() -> None:
    """A whole answer and stream chunks: ids, objects, the role on a chat's first chunk, the usage chunk."""
    usage = Usage(prompt_tokens=5, completion_tokens=3, cached_tokens=2)
    chat = Reply(name="chatcmpl-1", created=7, model="tiny", chat=True)
    whole = chat.completion("hi", "stop", usage).to_json()
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"] == {
        "role": "assistant",
        "content": "hi",
    }
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    first = json.loads(chat.chunk("h", role=True).to_sse()[len(b"data: ") :])
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"content": "h", "role": "assistant"}
    last = json.loads(chat.chunk(None, "length").to_sse()[len(b"data: ") :])
    assert last["choices"][0] == {
        "index": 0,
        "delta": {},
        "finish_reason": "length",
        "stop_reason": None,
        "logprobs": None,
    }
    assert json.loads(chat.usage_chunk(usage).to_sse()[6:])["choices"] == []
    text = Reply(name="cmpl-1", created=7, model="tiny", chat=False)
    assert text.completion("ab", "length", usage).to_json()["choices"][0]["text"] == "ab"
    assert json.loads(text.chunk("a").to_sse()[6:])["choices"][0]["text"] == "a"
    so_far = json.loads(text.chunk("a", usage=usage).to_sse()[6:])  # continuous_usage_stats: the usage so far
    assert so_far["choices"][0]["text"] == "a" and so_far["usage"]["completion_tokens"] == 3
    assert "usage" not in json.loads(text.chunk("a").to_sse()[6:])
    assert text.chunk("a").to_sse().endswith(b"\n\n")


# ---------------------------------------------------------------------------------------------- stop strings


def cut(text: str, stops: list[str], *, after: int = 0) -> tuple[str, bool, str | None]:
    """The reference (vLLM's `check_stop_strings`): `text` cut before the first stop string to complete after its
    first `after` characters, read character by character (of several completing at one character, the first
    listed), whether it was, and that stop string."""
    for end in range(after + 1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return text[: end - len(ending[0])], True, ending[0]
    return text, False, None


@settings(max_examples=300)
@example("abc", ["bc", "abc"], [], False)  # completing at one character: the first listed, as vLLM's
@given(
    st.text(alphabet="abcé\n", max_size=40),
    st.lists(st.text(alphabet="abcé\n", min_size=1, max_size=4), max_size=4),
    st.lists(st.integers(min_value=0, max_value=6), max_size=20),
    st.booleans(),
)
def test_a_text_stream_cuts_before_the_earliest_stop(
    text: str, stops: list[str], splits: list[int], include: bool
) -> None:
    """Fed in arbitrary pieces, the stream gives out exactly the reference's text, and stops iff it should, naming
    the stop string (a stop that would complete later, though it began earlier, does not count: generation stopped
    before); with `include_stop` the text ends with that stop string instead (vLLM's
    `include_stop_str_in_output`)."""
    stream, given_out, rest = TextStream(stops, include_stop=include), [], text
    for size in splits:
        given_out.append(stream.feed_text(rest[:size]))
        rest = rest[size:]
    given_out.append(stream.feed_text(rest))
    given_out.append(stream.finish())
    kept, stopped, reason = cut(text, stops)
    if include and reason is not None:
        kept += reason
    assert ("".join(given_out), stream.stopped, stream.stop_reason) == (kept, stopped, reason)


@settings(max_examples=300)
@example(text="abxyz", stops=["abc", "b"], min_tokens=2, include=False)  # "b" completed within min_tokens
@example(text="abc", stops=["bc", "abc"], min_tokens=0, include=False)  # a tie: the first listed
@given(
    st.text(alphabet="abé", max_size=20),
    st.lists(st.text(alphabet="abé", min_size=1, max_size=3), max_size=3),
    st.integers(min_value=0, max_value=8),
    st.booleans(),
)
def test_with_min_tokens_a_stop_string_counts_only_where_it_ends_after_them(
    text: str, stops: list[str], min_tokens: int, include: bool
) -> None:
    """Fed a byte a token, a stream with `min_tokens` m ends before the first stop string to complete in the text
    after its first m tokens' (vLLM's `check_stop_strings` window): one completed within them stays text and
    never ends the text later, even where a longer stop string holds it (vLLM goes on)."""
    data = text.encode()
    stream = TextStream(stops, min_tokens=min_tokens, include_stop=include)
    given_out = "".join(stream.feed(token) for token in data) + stream.finish()
    kept, stopped, reason = cut(text, stops, after=len(data[:min_tokens].decode("utf-8", "ignore")))
    if include and reason is not None:
        kept += reason
    assert (given_out, stream.stopped, stream.stop_reason) == (kept, stopped, reason)


def test_a_requests_stop_token_ids_end_the_text_naming_the_id() -> None:
    """The request's own stop ids end the text as the model's do (the token's text cut, or kept with
    `include_stop`), but `stop_reason` is the id (vLLM's), and the model's EOS is None; both wait for
    `min_tokens`."""
    for include, expected in ((False, "ab"), (True, "abc")):
        stream = TextStream(stop_token_ids=frozenset({ord("c")}), include_stop=include)
        text = "".join(stream.feed(t) for t in b"abcd") + stream.finish()
        assert (text, stream.stopped, stream.stop_reason) == (expected, True, ord("c"))
    stream = TextStream(stop_ids=frozenset({ord("c")}), stop_token_ids=frozenset({ord("c")}))
    assert "".join(stream.feed(t) for t in b"abc") == "ab" and stream.stop_reason is None  # the EOS check first
    stream = TextStream(stop_token_ids=frozenset({ord("a")}), min_tokens=3)  # the 3rd ends it, as in the engine
    assert "".join(stream.feed(t) for t in b"aaa") == "aa" and stream.stop_reason == ord("a")


@settings(max_examples=100)
@given(st.text(max_size=30), st.lists(st.text(min_size=1, max_size=3), max_size=4))
def test_tokens_stream_whole_characters(text: str, stops: list[str]) -> None:
    """Fed byte by byte as tokens (multi-byte characters split), the text is the same as fed whole."""
    stream = TextStream(stops)
    given_out = "".join(stream.feed(token) for token in text.encode("utf-8", "surrogatepass")) + stream.finish()
    expected = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    assert (given_out, stream.stopped, stream.stop_reason) == cut(expected, stops)
    assert TextStream().feed(300) == ""  # ids past the bytes decode to nothing


@given(
    key=st.text(min_size=1, max_size=40),
    other=st.text(max_size=40),
    scheme=st.sampled_from(["Bearer", "bearer", "BEARER"]),
)
def test_the_api_key_is_checked_as_vllm_checks_it(key: str, other: str, scheme: str) -> None:
    """`Bearer KEY` in any case of the scheme passes; another key, another scheme or no header does not; no
    key configured lets everything through."""
    assert authorized(f"{scheme} {key}", key)
    assert authorized(f"{scheme} {other}", key) == (other == key)
    assert not authorized(f"Basic {key}", key) and not authorized(key, key)
    assert not authorized(None, key) and not authorized("", key)
    assert authorized(None, "") and authorized(f"Basic {other}", "")


@pytest.mark.parametrize(
    ("body", "default", "expected"),
    [
        ({}, 16, 16),
        ({}, None, None),
        ({"max_tokens": 7}, 16, 7),
        ({"max_tokens": 7.0}, None, 7),
        ({"max_completion_tokens": 9, "max_tokens": 7}, 16, 9),
        ({"max_completion_tokens": None, "max_tokens": 7}, 16, 7),
        ({"max_tokens": None}, None, None),
    ],
)
def test_the_requested_output_is_read_as_vllm_reads_it(
    body: dict[str, Any], default: int | None, expected: int | None
) -> None:
    """A chat's `max_completion_tokens` wins where it is not null; neither set: the default (None: the context
    decides). A completion reads `max_tokens` only (vLLM's `CompletionRequest` ignores `max_completion_tokens`)."""
    assert requested_max_tokens(body, default=default, completion=False) == expected
    ignored = {key: value for key, value in body.items() if key != "max_completion_tokens"}
    assert requested_max_tokens(body, default=default, completion=True) == requested_max_tokens(
        ignored, default=default, completion=True
    )


@pytest.mark.parametrize(
    "body", [{"max_tokens": 0}, {"max_tokens": "8.5"}, {"max_completion_tokens": 1.5}, {"max_tokens": "0x8"}]
)
def test_a_requested_output_that_is_no_count_is_a_400_naming_it(body: dict[str, Any]) -> None:
    with pytest.raises(ApiError) as raised:
        requested_max_tokens(body, default=16, completion=False)
    assert raised.value.status == 400 and raised.value.param in body


@pytest.mark.parametrize("bad", ["abc", [1], {"x": 1}, "7.5", 1.5, "1e3"])
def test_a_chats_max_tokens_beside_max_completion_tokens_is_still_an_integer(bad: Any) -> None:
    """vLLM 0.32's `ChatCompletionRequest` types `max_tokens` as `int | None` whatever sets the limit: a value
    pydantic reads as no integer is its 400 naming `max_tokens`, even where `max_completion_tokens` wins."""
    body = {"max_completion_tokens": 2, "max_tokens": bad}
    with pytest.raises(ApiError) as raised:
        requested_max_tokens(body, default=None, completion=False)
    assert (raised.value.status, raised.value.param) == (400, "max_tokens")


@pytest.mark.parametrize("taken", ["7", 7.0, 0, -3, True, None])
def test_a_chats_max_tokens_beside_max_completion_tokens_is_typed_not_ranged(taken: Any) -> None:
    """Beside `max_completion_tokens`, any integer pydantic reads is taken (vLLM ignores its value, so no range
    applies) and the limit is `max_completion_tokens`'s."""
    assert requested_max_tokens({"max_completion_tokens": 2, "max_tokens": taken}, default=None, completion=False) == 2


@pytest.mark.parametrize(
    ("reason", "ttft_s", "status", "retry_after"),
    [
        (Reason.TTFT_SLO, 34.2, 429, "5"),  # what the estimate overshot the 30 s objective by, rounded up
        (Reason.TTFT_SLO, 30.1, 429, "1"),  # at least 1 s
        (Reason.TTFT_SLO, None, 429, "1"),
        (Reason.KV_BUDGET, 34.2, 429, "1"),  # a wait for room: no estimate of when
        (Reason.NO_DECODE_INSTANCE, None, 503, "1"),
        (Reason.CONTEXT_TOO_LONG, None, 400, None),  # no retry helps
    ],
)
def test_a_rejection_is_answered_alike_by_every_server(
    reason: Reason, ttft_s: float | None, status: int, retry_after: str | None
) -> None:
    """The status is `http_status`'s, the code the reason, the outcome said, and Retry-After one rule."""
    error = rejection_error(reason, Outcome.REJECTED_BEFORE_PREFILL, ttft_s=ttft_s, ttft_slo_s=30.0)
    assert (error.status, error.code, error.headers.get("Retry-After")) == (status, reason.value, retry_after)
    assert error.body()["error"]["outcome"] == "rejected_before_prefill" and reason.value in error.message


def test_a_ttft_refusal_after_a_wait_says_how_long_the_request_waited() -> None:
    """A request refused for TTFT after waiting for room has an estimate under the objective (the wait made up
    the rest): the message says the wait, so that "estimated TTFT 20 s, objective 30 s" does not read as a
    refusal for nothing; Retry-After still follows the estimate (a new request does not carry the wait)."""
    waited = rejection_error(
        Reason.TTFT_SLO, Outcome.REJECTED_BEFORE_PREFILL, ttft_s=20.0, ttft_slo_s=30.0, waited_s=15.0
    )
    assert "estimated TTFT 20.000 s after 15.000 s waited for room, objective 30 s" in waited.message
    assert waited.headers["Retry-After"] == "1"
    at_once = rejection_error(Reason.TTFT_SLO, Outcome.REJECTED_BEFORE_PREFILL, ttft_s=34.0, ttft_slo_s=30.0)
    assert "waited" not in at_once.message and "estimated TTFT 34.000 s, objective 30 s" in at_once.message


# ---------------------------------------------------------------------------------------------- log-probabilities


def test_logprobs_options_parse_as_vllm_reads_them() -> None:
    """A completion's `logprobs` is the count beside each token (null: none), an int field as vLLM reads it (false
    is 0, true 1); a chat's is `logprobs: true` with `top_logprobs` (default 0), and `top_logprobs` without
    `logprobs: true` is vLLM's 400."""
    assert parse_completion({"prompt": "hi", "logprobs": 0}, SERVED).sampling.logprobs == 0
    assert parse_completion({"prompt": "hi", "logprobs": 20.0}, SERVED).sampling.logprobs == 20
    assert parse_completion({"prompt": "hi", "logprobs": False}, SERVED).sampling.logprobs == 0
    assert parse_completion({"prompt": "hi", "logprobs": True}, SERVED).sampling.logprobs == 1
    assert parse_completion({"prompt": "hi"}, SERVED).sampling.logprobs is None
    messages = [{"role": "user", "content": "hi"}]
    assert parse_chat({"messages": messages, "logprobs": True}, SERVED).sampling.logprobs == 0
    assert parse_chat({"messages": messages, "logprobs": True, "top_logprobs": 5}, SERVED).sampling.logprobs == 5
    assert parse_chat({"messages": messages, "logprobs": False, "top_logprobs": 0}, SERVED).sampling.logprobs is None
    error = refused(parse_chat, {"messages": messages, "top_logprobs": 1}, SERVED)
    assert error.message == "when using top_logprobs, logprobs must be set to true"


def test_prompt_logprobs_parse_as_vllm_reads_them() -> None:
    """vLLM's `prompt_logprobs`: a count 0 to 20 for a completion or a chat, which the prefill computes; with
    `echo` and `logprobs` it wins over the echo's count; refused: -1 (the whole vocabulary, over the most listed),
    other negatives, a count with `stream` (0 with it is taken and lists nothing), and a non-integer."""
    messages = [{"role": "user", "content": "hi"}]
    for parse, body in [(parse_completion, {"prompt": "hi"}), (parse_chat, {"messages": messages})]:
        assert (
            parse(body, SERVED).output.prompt_logprobs is None and parse(body, SERVED).sampling.prompt_logprobs is None
        )
        for k in (0, 3, 20.0):
            parsed = parse({**body, "prompt_logprobs": k}, SERVED)
            assert parsed.output.prompt_logprobs == parsed.sampling.prompt_logprobs == k
        streamed = parse({**body, "prompt_logprobs": 0, "stream": True}, SERVED)
        assert streamed.output.prompt_logprobs is streamed.sampling.prompt_logprobs is None
        for bad, words in [
            (-1, "whole vocabulary"),
            (-2, "positive value or -1"),
            (21, "[0, 20]"),
            (1.5, "an integer"),
            ("1.5", "an integer"),
            ("one", "an integer"),
        ]:
            error = refused(parse, {**body, "prompt_logprobs": bad}, SERVED)
            assert error.param == "prompt_logprobs" and words in error.message, (bad, error.message)
        for k in (1, -1):
            error = refused(parse, {**body, "prompt_logprobs": k, "stream": True}, SERVED)
            assert "not available when stream" in error.message
    echoed = parse_completion({"prompt": "hi", "echo": True, "logprobs": 5, "prompt_logprobs": 2}, SERVED)
    assert (echoed.sampling.logprobs, echoed.sampling.prompt_logprobs, echoed.output.prompt_logprobs) == (5, 2, 2)
    echoed = parse_completion({"prompt": "hi", "echo": True, "logprobs": 5}, SERVED)
    assert (echoed.sampling.prompt_logprobs, echoed.output.prompt_logprobs) == (5, None)


def test_a_chats_rendering_options_parse_as_vllm_reads_them() -> None:
    """`add_generation_prompt` (default true) and `continue_final_message` (default false) reach the chat's
    prompt; both true is vLLM's 400; continuing ends the byte template's prompt right after the final text."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]
    plain = parse_chat({"messages": messages}, SERVED)
    assert (plain.add_generation_prompt, plain.continue_final_message) == (True, False)
    go_on = parse_chat({"messages": messages, "add_generation_prompt": False, "continue_final_message": True}, SERVED)
    assert TOKENIZER.decode(prompt_tokens(go_on, TOKENIZER, SERVED)).endswith("<|assistant|>\nHello")
    closed = parse_chat({"messages": messages, "add_generation_prompt": False}, SERVED)
    assert TOKENIZER.decode(prompt_tokens(closed, TOKENIZER, SERVED)).endswith("Hello\n")
    error = refused(parse_chat, {"messages": messages, "continue_final_message": True}, SERVED)
    assert error.param == "continue_final_message" and "Cannot set both" in error.message


def test_vllms_output_options_parse_as_vllm_reads_them() -> None:
    """`allowed_token_ids` (sorted, without repeats), `truncate_prompt_tokens` (-1: the longest prompt served),
    `return_token_ids` and `return_tokens_as_token_ids`, for a completion and a chat; the prompt is then its last
    k tokens, counted against the limits after the cut."""
    messages = [{"role": "user", "content": "hi"}]
    for parse, body in [(parse_completion, {"prompt": "hi"}), (parse_chat, {"messages": messages})]:
        plain = parse(body, SERVED)
        assert plain.sampling.allowed_token_ids == () and plain.output == Output()
        asked = {"allowed_token_ids": [7, 3, 7], "return_token_ids": True, "return_tokens_as_token_ids": True}
        parsed = parse({**body, **asked, "truncate_prompt_tokens": -1}, SERVED)
        assert parsed.sampling.allowed_token_ids == (3, 7)
        assert parsed.output == Output(return_token_ids=True, tokens_as_ids=True, truncate_prompt_tokens=64)
    long = parse_completion({"prompt": "x" * 100, "truncate_prompt_tokens": 5}, SERVED)
    assert prompt_tokens(long, TOKENIZER, SERVED) == TOKENIZER.encode("x" * 100)[-5:]
    assert refused(prompt_tokens, parse_completion({"prompt": "x" * 100}, SERVED), TOKENIZER, SERVED).status == 400


@given(st.data(), st.integers(min_value=0, max_value=4))
def test_prompt_logprobs_take_vllms_shape(data: st.DataObject, k: int) -> None:
    """Null for the first token; then per token an object keyed by token ids (strings): the token's own entry
    first with its rank, then the k most probable with ranks 1 to k (the token among them listed once, its rank
    then its place); each entry's `decoded_token` is the token's text; -inf is -9999.0."""
    tokens = data.draw(st.lists(st.integers(0, 255), min_size=1, max_size=8))
    logprob = st.floats(max_value=0.0, allow_nan=False)
    top = st.lists(st.tuples(st.integers(0, 255), logprob), max_size=6, unique_by=lambda pair: pair[0])
    made = st.builds(TokenLogprobs, logprob=logprob, rank=st.integers(1, 256), top=top.map(tuple))
    scored = data.draw(st.lists(made, min_size=len(tokens) - 1, max_size=len(tokens) - 1))
    text = ByteTokenizer().token_text
    listed = prompt_logprobs_json(tokens, scored, k, text)
    assert listed[0] is None and len(listed) == len(tokens)
    for token, entry, one in zip(tokens[1:], scored, listed[1:], strict=True):
        assert one is not None and next(iter(one)) == str(token)
        ranked = {str(t): (rank, lp) for rank, (t, lp) in enumerate(entry.top[:k], start=1)}
        assert list(one) == list(dict.fromkeys([str(token), *ranked]))
        for key, value in one.items():
            rank, logprob = ranked.get(key, (entry.rank, entry.logprob))
            assert value == {"logprob": max(-9999.0, logprob), "rank": rank, "decoded_token": text(int(key))}
    json.dumps(listed, allow_nan=False)


def entries(draw: st.DrawFn) -> list[tuple[int, TokenLogprobs | None]]:
    logprob = st.floats(max_value=0.0, allow_nan=False)
    top = st.lists(st.tuples(st.integers(0, 255), logprob), max_size=6)
    made = st.builds(TokenLogprobs, logprob=logprob, rank=st.integers(1, 256), top=top.map(tuple))
    return draw(st.lists(st.tuples(st.integers(0, 255), st.none() | made), max_size=8))


@given(st.data(), st.integers(min_value=0, max_value=4))
def test_logprobs_take_the_openai_shapes_across_parts(data: st.DataObject, k: int) -> None:
    """Whatever the tokens and however they are split into parts (chunks): a completion's four lists are
    parallel, `text_offset` sums the token texts before each across the parts, each top object starts with the
    token's own and adds at most k; a chat item's `top_logprobs` has the first k of the top list, its bytes
    are its text's; -inf is written -9999.0 (JSON has no infinity) and a token without log-probabilities gets
    nulls."""
    tokens = entries(data.draw)
    cut = data.draw(st.integers(min_value=0, max_value=len(tokens)))
    text = ByteTokenizer().token_text
    completion = Logprobs(chat=False, k=k, token_text=text)
    parts = [completion.take(tokens[:cut]), completion.take(tokens[cut:])]
    joined = {key: parts[0][key] + parts[1][key] for key in parts[0]}
    assert joined["tokens"] == [text(t) for t, _ in tokens]
    assert joined["text_offset"] == [sum(len(text(t)) for t, _ in tokens[:i]) for i in range(len(tokens))]
    for (token, entry), logprob, top in zip(tokens, joined["token_logprobs"], joined["top_logprobs"], strict=True):
        if entry is None:
            assert logprob is None and top is None
            continue
        assert logprob == max(entry.logprob, -9999.0) and next(iter(top)) == text(token)
        assert len(top) <= k + 1 and all(math.isfinite(v) for v in top.values())
    chat = Logprobs(chat=True, k=k, token_text=text).take(tokens)["content"]
    for (token, entry), item in zip(tokens, chat, strict=True):
        assert item["token"] == text(token) and item["bytes"] == list(text(token).encode())
        expected = [] if entry is None else [(text(t), max(lp, -9999.0)) for t, lp in entry.top[:k]]
        assert [(i["token"], i["logprob"]) for i in item["top_logprobs"]] == expected
    json.dumps(parts, allow_nan=False)  # valid JSON, as clients parse it


def test_vllms_sampling_extras_parse_with_the_checkpoints_defaults() -> None:
    """top_k (-1 and 0: all tokens), min_p, and the three penalties land in the sampling options; a request
    without them gets the served model's defaults (its generation_config.json's, as vLLM applies them), else
    none (the presence and frequency penalties none always: vLLM takes neither from the file)."""
    body = {"prompt": "hi", "top_k": 20, "min_p": 0.1, "repetition_penalty": 1.1}
    body |= {"presence_penalty": -2, "frequency_penalty": 2.0}
    sampling = parse_completion(body, SERVED).sampling
    assert (sampling.top_k, sampling.min_p, sampling.repetition_penalty) == (20, 0.1, 1.1)
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (-2.0, 2.0)
    assert parse_completion({"prompt": "hi", "top_k": -1}, SERVED).sampling.top_k == 0
    qwen = attrs.evolve(SERVED, default_top_k=20, default_min_p=0.05, default_repetition_penalty=1.05)
    sampling = parse_completion({"prompt": "hi"}, qwen).sampling
    assert (sampling.top_k, sampling.min_p, sampling.repetition_penalty) == (20, 0.05, 1.05)
    assert parse_completion({"prompt": "hi", "top_k": 0}, qwen).sampling.top_k == 0  # asked for all: all
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.0, 0.0)


def test_stop_token_ids_include_stop_str_and_logit_bias_parse_as_vllm_reads_them() -> None:
    """`stop_token_ids` (sorted, without repeats), `include_stop_str_in_output`, and `logit_bias` with OpenAI's
    string keys, each bias clamped to [-100, 100] as vLLM clamps it; null is none."""
    body = {"prompt": "hi", "stop_token_ids": [9, 3, 9], "include_stop_str_in_output": True}
    body |= {"logit_bias": {"7": 250, " 3": -1e9, "+012": 0.5}}
    sampling = parse_completion(body, SERVED).sampling
    assert sampling.stop_token_ids == (3, 9) and sampling.include_stop_str_in_output
    assert sampling.logit_bias == ((3, -100.0), (7, 100.0), (12, 0.5))
    neutral = parse_completion({"prompt": "hi", "logit_bias": None, "stop_token_ids": None}, SERVED).sampling
    assert (neutral.logit_bias, neutral.stop_token_ids, neutral.include_stop_str_in_output) == ((), (), False)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, True), ("false", False), ("True", True), ("yes", True), ("off", False), (1, True), (0.0, False)],
)
def test_boolean_fields_are_read_as_vllms_pydantic_reads_them(value: Any, expected: bool) -> None:
    """vLLM's request models read booleans in pydantic's lax mode: "false" is false (not a truthy string), 1 is
    true; the gateway and the vLLM router read every boolean field so (`_flag`, `lax_flag`, `stream_flag`)."""
    parsed = parse_completion({"prompt": "hi", "stream": value, "ignore_eos": value}, SERVED)
    assert parsed.stream is expected and parsed.sampling.ignore_eos is expected
    assert stream_flag({"stream": value}) is expected
