"""Edge contracts of `serving.api` and `serving.protocol` that test_api.py and test_edge.py leave open.

A mutation round found them: each test here failed on a plausible change of the product that those files pass.
Properties against small references: an error's OpenAI type and code follow its status; a rejection's
Retry-After is one rule over any estimate (infinite and early ones included); any chain of up to two
Content-Encodings, listed in the order applied, decodes back to the object, and the decompression cap admits
exactly `max_bytes`; a token-id prompt is taken iff every id is an integer of the vocabulary; a prompt and its
max_tokens are served iff they fit both limits, and a refusal names the one that did not; answer bodies have
OpenAI's (and vLLM's) shapes for any field values; `LogLimiter` passes and counts as a dict of kinds does; the
refusals of `_Guarded` connections linger up to `MAX_LINGERING` and are forgotten when lost (a state machine).
Examples pin the boundaries of the field checks (stop lengths, neutral values, message keys, template variables),
the value a refusal shows beside its field, and vLLM's words for a context overflow and /detokenize.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import math
import types
import zlib
from typing import Any

import attrs
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

pytest.importorskip("aiohttp")

from aiohttp.http_exceptions import BadHttpMessage
from serving import protocol
from serving.api import (
    ApiError,
    ChatMessage,
    Reply,
    Usage,
    decode_body,
    detokenize_body,
    generation_limit,
    models_body,
    parse_chat,
    parse_completion,
    prompt_tokens,
    rejection_error,
    tokenize_body,
)
from serving.protocol import (
    ConnectionGuard,
    EdgeLimits,
    JsonRequestHandler,
    LogLimiter,
    install_log_limits,
    loop_exception_handler,
    refusal_bytes,
)
from serving.tokenizer import ByteTokenizer

from mooncake.errors import InvalidRequestError
from mooncake.sched.outcome import Outcome, Reason, http_status
from tests.serving.test_api import SERVED, TOKENIZER, refused

USER = [{"role": "user", "content": "hi"}]


# ---------------------------------------------------------------------------------------------- errors


@example(status=500, code=None)
@example(status=504, code=None)
@given(
    status=st.sampled_from([400, 401, 403, 404, 408, 413, 429, 500, 503, 504])
    | st.integers(min_value=400, max_value=599),
    code=st.none() | st.sampled_from(["model_not_found", "context_length_exceeded"]),
)
def test_an_errors_type_and_code_follow_its_status(status: int, code: str | None) -> None:
    """OpenAI's type by status (401, 403, 408, 429 and 504 named; any other 5xx a server_error, 4xx an
    invalid_request_error); the code is the one given, else the status, as vLLM's ErrorResponse says it."""
    named = {401: "authentication_error", 403: "permission_error", 408: "timeout_error", 429: "rate_limit_error"}
    expected = named.get(status) or ("timeout_error" if status == 504 else None)
    expected = expected or ("server_error" if status >= 500 else "invalid_request_error")
    error = ApiError(status, "m", code=code)
    assert error.body() == {"error": {"message": "m", "type": expected, "param": None, "code": code or status}}


@example(Reason.TTFT_SLO, Outcome.REJECTED_AFTER_PREFILL, math.inf, None, None)  # no finite estimate
@example(Reason.TTFT_SLO, Outcome.REJECTED_BEFORE_PREFILL, 20.0, None, None)  # under the objective, after a wait
@example(Reason.NO_DECODE_INSTANCE, Outcome.REJECTED_BEFORE_PREFILL, None, "no vLLM server is up", "max_tokens")
@given(
    reason=st.sampled_from(list(Reason)),
    outcome=st.sampled_from([Outcome.REJECTED_BEFORE_PREFILL, Outcome.REJECTED_AFTER_PREFILL]),
    ttft_s=st.none() | st.floats(min_value=0.0, max_value=1e6) | st.sampled_from([math.inf, 0.0, 29.0, 31.5]),
    detail=st.none() | st.just("no vLLM server is up"),
    param=st.none() | st.just("max_tokens"),
)
def test_a_rejections_retry_after_is_one_rule_for_any_estimate(
    reason: Reason, outcome: Outcome, ttft_s: float | None, detail: str | None, param: str | None
) -> None:
    """Retry-After: none with a 400; for a TTFT refusal with a finite estimate what it overshot the 30 s objective
    by, rounded up, at least 1 s (an estimate under the objective too, as after a wait); 1 s otherwise (an
    infinite estimate included). The message says which side refused (the decode engine after the prefill, or
    the gateway) and the caller's detail where given; the parameter named is the caller's."""
    error = rejection_error(reason, outcome, detail=detail, ttft_s=ttft_s, ttft_slo_s=30.0, param=param)
    assert error.param == param and (detail is None or error.message.endswith(f"({reason.value}): {detail}"))
    status = http_status(reason)
    if status == 400:
        expected = None
    elif reason is Reason.TTFT_SLO and ttft_s is not None and math.isfinite(ttft_s):
        expected = str(max(1, math.ceil(ttft_s - 30.0)))
    else:
        expected = "1"
    assert (error.status, error.headers.get("Retry-After")) == (status, expected)
    after = outcome is Outcome.REJECTED_AFTER_PREFILL
    assert error.message.startswith("the decode engine refused" if after else "rejected (")


# ---------------------------------------------------------------------------------------------- bytes to JSON


def _encode(raw: bytes, coding: str) -> bytes:
    if coding in ("gzip", "x-gzip"):
        return gzip.compress(raw)
    if coding == "deflate":
        return zlib.compress(raw)
    if coding == "deflate-raw":
        packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
        return packer.compress(raw) + packer.flush()
    return raw


json_objects = st.dictionaries(
    st.text(max_size=6), st.none() | st.booleans() | st.integers() | st.text(max_size=20), max_size=4
)


@example(body={"prompt": "hi"}, codings=["deflate", "x-gzip"], upper=True)
@example(body={"prompt": "hi"}, codings=["deflate-raw", "gzip"], upper=False)
@given(
    body=json_objects,
    codings=st.lists(st.sampled_from(["gzip", "x-gzip", "deflate", "deflate-raw", "identity"]), max_size=2),
    upper=st.booleans(),
)
def test_content_encodings_are_undone_in_reverse_of_the_order_listed(
    body: dict[str, Any], codings: list[str], upper: bool
) -> None:
    """RFC 9110: Content-Encoding lists the codings in the order they were applied; decoding undoes the last
    first, whatever their case and spacing, and gives back the object."""
    raw = json.dumps(body).encode()
    for coding in codings:
        raw = _encode(raw, coding)
    header = " ,  ".join(c.replace("deflate-raw", "deflate") for c in codings)
    assert decode_body(raw, content_encoding=header.upper() if upper else header) == body


@example(body={"prompt": "h\u00e9"}, charset="UTF-16", key="Charset", quoted=True)
@given(
    body=json_objects,
    charset=st.sampled_from(["utf-8", "UTF-16", "utf-16-le", "utf-16-be", "utf-32", "UTF-32-BE", "us-ascii"]),
    key=st.sampled_from(["charset", "Charset", "CHARSET"]),
    quoted=st.booleans(),
)
def test_a_declared_unicode_charset_decodes(body: dict[str, Any], charset: str, key: str, quoted: bool) -> None:
    """A body in any Unicode charset (or ASCII), declared by a Content-Type parameter whose name is any case and
    whose value may be quoted (RFC 9110), decodes to the object."""
    raw = json.dumps(body).encode(charset)  # json.dumps escapes all but ASCII: us-ascii holds it
    declared = f'"{charset}"' if quoted else charset
    assert decode_body(raw, content_type=f"application/json ; {key}={declared}") == body


@example(size=100, slack=0)
@example(size=100, slack=-1)
@given(size=st.integers(min_value=40, max_value=200), slack=st.integers(min_value=-3, max_value=3))
def test_the_decompression_cap_admits_exactly_max_bytes(size: int, slack: int) -> None:
    """A compressed body inflating to exactly `max_bytes` is decoded; one byte more is a 413."""
    raw = b'{"prompt": "' + b"x" * (size - 14) + b'"}'
    assert len(raw) == size
    for coding in ("gzip", "deflate"):
        max_bytes = size + slack
        if slack >= 0:
            assert decode_body(_encode(raw, coding), content_encoding=coding, max_bytes=max_bytes) == json.loads(raw)
        else:
            assert (
                refused(decode_body, _encode(raw, coding), content_encoding=coding, max_bytes=max_bytes).status == 413
            )


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
def test_bytes_after_the_compressed_stream_are_a_400(coding: str) -> None:
    """Data after the end of the compressed stream is not valid gzip / deflate: a 400, not the first part's JSON."""
    error = refused(decode_body, _encode(b'{"prompt": "hi"}', coding) + b"junk", content_encoding=coding)
    assert error.status == 400 and coding in error.message


# ---------------------------------------------------------------------------------------------- fields


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "hi", "stop": "x" * 256},  # the longest stop string
        {"prompt": "hi", "stop": ["a", "b", "c", "d"]},  # the most stop strings
        {"prompt": "hi", "response_format": {"type": "text"}},
        {"prompt": "hi", "tool_choice": "auto", "function_call": "none", "priority": -3},
        {"prompt": "hi", "modalities": ["text"], "suffix": "", "top_k": 0, "stop_token_ids": []},
    ],
)
def test_boundary_values_are_accepted(body: dict[str, Any]) -> None:
    """The limits are inclusive and the neutral values of unimplemented parameters change nothing."""
    assert parse_completion(body, SERVED).prompt == "hi"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # would oblige a tool call this server cannot make
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"priority": "high"}, "priority"),
        ({"priority": 1.5}, "priority"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"top_k": -5}, "top_k"),
        ({"stop_token_ids": [-2]}, "stop_token_ids"),
    ],
)
def test_values_past_the_boundaries_are_refused_naming_the_parameter(body: dict[str, Any], param: str) -> None:
    """A value an unimplemented parameter would act on (a required tool call, JSON mode), one out of its range (a
    top-k below -1, a negative stop token id) or one of the wrong type is a 400 naming that parameter, not silently served as if
    neutral."""
    error = refused(parse_chat, {"messages": USER, **body}, SERVED)
    assert (error.status, error.param) == (400, param)


def test_a_chat_messages_keys_are_checked_as_documented() -> None:
    """`tool_calls: []` is the neutral value an SDK dump sends (accepted, kept with the message's other keys for
    the chat's reader); a `name` must be a string (a 400 naming `messages[i].name`); a content may be null, and its
    parts any of vLLM's text kinds (`input_text`...), as vLLM reads them; a part without text (an image) is a 400
    naming the message's content."""
    message = {"role": "assistant", "content": "ok", "tool_calls": [], "name": "bot"}
    assert parse_chat({"messages": [message]}, SERVED).messages == (
        ChatMessage(role="assistant", content="ok", fields={"tool_calls": [], "name": "bot"}),
    )
    error = refused(parse_chat, {"messages": [{**USER[0], "name": 5}]}, SERVED)
    assert (error.status, error.param) == (400, "messages[0].name")
    parse_chat({"messages": [{"role": "tool", "tool_call_id": "c", "content": None}]}, SERVED)
    parse_chat({"messages": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}, SERVED)
    error = refused(parse_chat, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, SERVED)
    assert (error.status, error.param) == (400, "messages[0].content")


def test_an_openai_stream_option_this_server_does_not_know_is_ignored_as_vllm_ignores_it() -> None:
    """`stream_options.include_obfuscation` (OpenAI's; there is nothing to obfuscate here) changes nothing; the
    usage options beside it are read as usual."""
    options = {"include_usage": True, "include_obfuscation": False}
    parsed = parse_completion({"prompt": "hi", "stream": True, "stream_options": options}, SERVED)
    assert (parsed.include_usage, parsed.continuous_usage) == (True, False)


@pytest.mark.parametrize("taken", ["messages", "tools"])
def test_template_variables_may_not_set_the_requests_own_inputs(taken: str) -> None:
    """`messages` and `tools` are refused in chat_template_kwargs, naming them (the request's own flags are
    overridden instead: tests/serving/test_api_text_rules.py)."""
    error = refused(parse_chat, {"messages": USER, "chat_template_kwargs": {taken: None, "x": 1}}, SERVED)
    assert (error.param, taken in error.message) == ("chat_template_kwargs", True)


@example([0, SERVED.vocab_size - 1], False)
@example([0], True)
@example([1, True], False)
@example([SERVED.vocab_size], True)
@given(
    st.lists(st.integers(min_value=-3, max_value=SERVED.vocab_size + 3) | st.booleans(), min_size=1, max_size=8),
    st.booleans(),
)
def test_a_token_prompt_is_taken_iff_every_id_lies_in_the_vocabulary(ids: list[Any], batch_of_one: bool) -> None:
    """Ids 0 to vocab_size - 1 are the prompt as they are (also as a batch of one); a negative id, one past the
    vocabulary or a boolean (JSON's true is no id) is a 400 naming the prompt."""
    prompt = [ids] if batch_of_one else ids
    if all(type(t) is int and 0 <= t < SERVED.vocab_size for t in ids):
        assert parse_completion({"prompt": prompt}, SERVED).prompt == tuple(ids)
    else:
        assert refused(parse_completion, {"prompt": prompt}, SERVED).param == "prompt"


@example(num_tokens=SERVED.max_prompt_tokens, max_tokens=None)  # the limits are inclusive
@example(num_tokens=SERVED.max_prompt_tokens, max_tokens=SERVED.max_context_tokens - SERVED.max_prompt_tokens)
@example(num_tokens=1, max_tokens=SERVED.max_context_tokens)  # the whole context: trimmed, not refused
@example(num_tokens=1, max_tokens=SERVED.max_context_tokens + 1)  # over it: refused, whatever the prompt
@given(
    num_tokens=st.integers(min_value=1, max_value=SERVED.max_prompt_tokens + 6),
    max_tokens=st.none() | st.integers(min_value=1, max_value=SERVED.max_context_tokens + 3),
)
def test_a_prompt_is_served_iff_it_fits_its_limit_and_max_tokens_is_trimmed_to_the_context(
    num_tokens: int, max_tokens: int | None
) -> None:
    """A completion's max_tokens over the whole context is refused when the body is parsed, naming max_tokens, as
    vLLM 0.32 refuses it (before the prompt); else its prompt of n tokens is served iff n <= max_prompt_tokens (a
    refusal is `context_length_exceeded` naming the prompt); its max_tokens (16 when unset) is then trimmed to what
    the context leaves, as vLLM 0.32 trims it."""
    body: dict[str, Any] = {"prompt": "x" * num_tokens} | ({} if max_tokens is None else {"max_tokens": max_tokens})
    asked = SERVED.default_max_tokens if max_tokens is None else max_tokens
    if asked > SERVED.max_context_tokens:
        assert refused(parse_completion, body, SERVED).param == "max_tokens"
        return
    request = parse_completion(body, SERVED)
    if num_tokens > SERVED.max_prompt_tokens:
        error = refused(prompt_tokens, request, TOKENIZER, SERVED)
        assert (error.code, error.param) == ("context_length_exceeded", "prompt")
    else:
        assert len(prompt_tokens(request, TOKENIZER, SERVED)) == num_tokens
        planned = generation_limit(request.sampling, num_tokens, SERVED).max_tokens
        assert planned == min(asked, SERVED.max_context_tokens - num_tokens) >= 1


@pytest.mark.parametrize("count", [SERVED.max_prompt_tokens - 1, SERVED.max_prompt_tokens])
def test_as_many_messages_as_the_prompt_limit_are_parsed(count: int) -> None:
    """The shortcut on the number of messages refuses only more than `max_prompt_tokens` of them (test_api checks
    one more): up to it, the messages are checked and the tokenized prompt decides."""
    assert len(parse_chat({"messages": USER * count}, SERVED).messages) == count


def test_a_chat_template_refusal_is_a_400_naming_the_messages() -> None:
    """The checkpoint's template raising (`InvalidRequestError`) is a 400 naming `messages`, with its reason, from
    both the prompt check and /tokenize."""

    class Refusing(ByteTokenizer):
        def render_chat(self, messages: Any, **_: Any) -> str:
            raise InvalidRequestError("roles must alternate user/assistant")

    chat = parse_chat({"messages": USER}, SERVED)
    for call in (prompt_tokens, tokenize_body):
        error = refused(call, chat, Refusing(), SERVED)
        assert (error.status, error.param) == (400, "messages") and "alternate" in error.message


@pytest.mark.parametrize(
    ("body", "param", "shown"),
    [
        ({"prompt": "hi", "stop": ["a", ""]}, "stop", "got stop[1] = '' (0 characters)"),
        ({"prompt": "hi", "stop": 5}, "stop", "got 5"),
        ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop", "got a list of 5"),
        ({"prompt": "hi", "stop": ["a", 3]}, "stop", "got stop[1] = 3"),
        ({"prompt": "hi", "stop_token_ids": [1, 99999]}, "stop_token_ids", "got stop_token_ids[1] = 99999"),
        ({"prompt": "hi", "allowed_token_ids": "x"}, "allowed_token_ids", "got 'x'"),
        ({"prompt": [1, 2, 70000]}, "prompt", "got 70000 at index 2"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0]", "got role 'robot'"),
        ({"messages": [5]}, "messages[0]", "got 5"),
    ],
)
def test_a_refusal_shows_the_value_it_refused(body: dict[str, Any], param: str, shown: str) -> None:
    """A refused value is named with its field and shown (the first offending element and where it is)."""
    parse = parse_chat if "messages" in body else parse_completion
    error = refused(parse, body, SERVED)
    assert (error.status, error.param) == (400, param) and error.message.endswith(shown), error.message


def test_an_output_over_what_the_prompt_leaves_is_trimmed_whichever_field_asked_for_it() -> None:
    """A prompt and its output over the context, the output within it: the output is trimmed to what the context
    leaves, as vLLM 0.32 trims it (`get_max_tokens`), whether `max_tokens` or `max_completion_tokens` asked for it."""
    for field in ("max_tokens", "max_completion_tokens"):
        chat = parse_chat({"messages": USER, field: SERVED.max_context_tokens}, SERVED)
        n = len(prompt_tokens(chat, TOKENIZER, SERVED))
        assert generation_limit(chat.sampling, n, SERVED).max_tokens == SERVED.max_context_tokens - n


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": "hi", "max_tokens": 5000}, "max_tokens"),
        ({"prompt": "x" * 65, "max_tokens": 130}, "max_tokens"),  # before the prompt's own 400, as vLLM checks
        ({"prompt": "hi", "max_tokens": 130, "echo": True, "logprobs": 1}, "max_tokens"),
        ({"messages": USER, "max_tokens": 130}, "max_tokens"),
        ({"messages": USER, "max_completion_tokens": 130, "max_tokens": 5}, "max_completion_tokens"),
        ({"messages": USER, "max_completion_tokens": None, "max_tokens": 130}, "max_tokens"),
    ],
)
def test_an_output_over_the_whole_context_is_refused_naming_its_field_as_vllm_refuses_it(
    body: dict[str, Any], field: str
) -> None:
    """vLLM 0.32's `TokenizeParams`: an output longer than the context (`max_context_tokens`, 129 here, the bound of
    a prompt and its output as vLLM's `max_model_len` is) fits beside no prompt and is a 400 with vLLM's words
    (the bound named for what it is, never `max_model_len`: /v1/models advertises the prompt limit, 64, by that
    name), naming the field that asked for it (a chat's `max_completion_tokens` where it is set), when the body is
    parsed: before the prompt is tokenized, as vLLM checks it before it renders the prompt."""
    parse = parse_chat if "messages" in body else parse_completion
    error = refused(parse, body, SERVED)
    asked = body[field]
    assert (error.status, error.param) == (400, field)
    assert error.message == (
        f"{field}={asked} cannot be greater than the context: [decode] max_context_tokens=129. "
        "Please request fewer output tokens."
    )


def test_a_body_request_id_is_read_as_a_string_as_vllm_reads_it() -> None:
    """vLLM's `request_id` (the answer's id: the gateway's test_gateway_request_id) travels in the parsed request,
    a chat's and each prompt's of a batch; vLLM's pydantic takes a string only (null and numbers are its 400)."""
    assert parse_completion({"prompt": "hi"}, SERVED).request_id is None
    batch = parse_completion({"prompt": ["a", "b"], "request_id": "mine"}, SERVED)
    assert [one.request_id for one in batch.split()] == ["mine", "mine"]
    assert parse_chat({"messages": USER, "request_id": ""}, SERVED).request_id == ""
    for bad in (None, 7, True, ["x"]):
        for parse, body in ((parse_completion, {"prompt": "hi"}), (parse_chat, {"messages": USER})):
            error = refused(parse, {**body, "request_id": bad}, SERVED)
            assert (error.status, error.param) == (400, "request_id")


@pytest.mark.parametrize("seed", [-1, "-1", -1.0])
def test_a_seed_of_minus_one_is_no_seed_as_vllm_reads_it(seed: Any) -> None:
    """vLLM's `SamplingParams` reads seed -1 as none: each request draws a fresh stream at admission (two sampled
    requests are not forced to the same text, as the fixed seed 2**64 - 1 forced them); any other negative seed is
    its 64-bit pattern."""
    for parse, body in ((parse_completion, {"prompt": "hi"}), (parse_chat, {"messages": USER})):
        assert parse({**body, "temperature": 1.0, "seed": seed}, SERVED).sampling.seed is None
    assert parse_completion({"prompt": "hi", "seed": -3}, SERVED).sampling.seed == 2**64 - 3


def test_detokenize_decodes_every_id_as_vllm_does() -> None:
    """vLLM's /detokenize is the tokenizer's `decode` of every id (test_prompt_text checks a checkpoint's stop ids
    and special tokens); the byte tokenizer's ids past the bytes decode to nothing. Ids out of the vocabulary are a
    400 naming the first and where it is."""
    larger = attrs.evolve(SERVED, vocab_size=512)  # a model that may generate ids past the bytes
    assert detokenize_body({"tokens": [104, 105, 300]}, ByteTokenizer(), larger) == {"prompt": "hi"}
    error = refused(detokenize_body, {"tokens": [104, -1]}, ByteTokenizer(), SERVED)
    assert (error.status, error.param) == (400, "tokens") and "tokens[1] = -1" in error.message


# ---------------------------------------------------------------------------------------------- answers


def test_models_lists_the_one_model_as_vllm_does() -> None:
    """`/v1/models`: a list of the served model, its own root, no parent, the time given, the length advertised."""
    assert models_body(SERVED, created=5) == {
        "object": "list",
        "data": [
            {
                "id": "tiny",
                "object": "model",
                "created": 5,
                "owned_by": "mooncake",
                "root": "tiny",
                "parent": None,
                "max_model_len": 64,
                "permission": [],
            }
        ],
    }


def _header(reply: Reply, *, chunk: bool) -> dict[str, Any]:
    # vLLM's completion chunks are text_completion objects too.
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if reply.chat else "text_completion"
    return {"id": reply.name, "object": kind, "created": reply.created, "model": reply.model}


usages = st.builds(
    Usage,
    prompt_tokens=st.integers(min_value=0, max_value=10**6),
    completion_tokens=st.integers(min_value=0, max_value=10**6),
    cached_tokens=st.integers(min_value=0, max_value=10**6),
)
replies = st.builds(
    Reply,
    name=st.text(max_size=10),
    created=st.integers(min_value=0, max_value=2**40),
    model=st.text(max_size=10),
    chat=st.booleans(),
)
finish_reasons = st.sampled_from(["stop", "length"])
stop_reasons = st.none() | st.text(min_size=1, max_size=5)


def _usage(usage: Usage) -> dict[str, Any]:
    total = usage.prompt_tokens + usage.completion_tokens
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": total,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


@given(reply=replies, text=st.text(max_size=10), finish=finish_reasons, stop=stop_reasons, usage=usages)
def test_a_whole_answer_has_openais_shape(reply: Reply, text: str, finish: str, stop: str | None, usage: Usage) -> None:
    """A completion's choice holds its text, a chat's an assistant message; both say the finish reason and the
    stop string that ended it (vLLM's `stop_reason`), no logprobs, and the usage with its total; vLLM's
    `prompt_logprobs` is null, in a completion's choice and beside a chat's choices."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "stop_reason": stop, "logprobs": None}
    choice |= {"message": {"role": "assistant", "content": text}} if reply.chat else {"text": text}
    choice |= {} if reply.chat else {"prompt_logprobs": None}
    expected = {**_header(reply, chunk=False), "choices": [choice], "usage": _usage(usage)}
    expected |= {"prompt_logprobs": None} if reply.chat else {}
    assert reply.completion(text, finish, usage, stop_reason=stop).to_json() == expected


@given(
    reply=replies,
    text=st.none() | st.text(max_size=10),
    finish=st.none() | finish_reasons,
    stop=stop_reasons,
    role=st.booleans(),
    usage=st.none() | usages,
)
def test_a_stream_chunk_has_openais_shape(
    reply: Reply, text: str | None, finish: str | None, stop: str | None, role: bool, usage: Usage | None
) -> None:
    """A chat chunk's delta holds the text it has and the role where asked; a completion chunk always has a text
    ("" for the last, finishing one); the usage so far only where given; a usage chunk has no choices. Each is
    one SSE event of that JSON."""
    if reply.chat:
        delta = ({} if text is None else {"content": text}) | ({"role": "assistant"} if role else {})
        choice: dict[str, Any] = {"index": 0, "delta": delta}
    else:
        choice = {"index": 0, "text": text or ""}
    choice |= {"finish_reason": finish, "stop_reason": stop, "logprobs": None}
    expected = {**_header(reply, chunk=True), "choices": [choice]} | ({} if usage is None else {"usage": _usage(usage)})
    chunk = reply.chunk(text, finish, stop_reason=stop, role=role, usage=usage)
    assert chunk.to_json() == expected
    assert chunk.to_sse() == b"data: " + json.dumps(expected).encode() + b"\n\n"
    if usage is not None:
        only = reply.usage_chunk(usage).to_json()
        assert only == {**_header(reply, chunk=True), "choices": [], "usage": _usage(usage)}


# ---------------------------------------------------------------------------------------------- protocol


@pytest.mark.parametrize(("status", "phrase"), [(429, "Too Many Requests"), (503, "Service Unavailable")])
def test_a_refusal_is_one_whole_http_answer(status: int, phrase: str) -> None:
    """The bytes written to a refused connection: the status line with its reason phrase, JSON, a Content-Length
    that is the body's, `Connection: close`, the error's own headers, and the OpenAI error body."""
    error = ApiError(status, "full \u00e9", headers={"Retry-After": "1"})
    head, _, body = refusal_bytes(error).partition(b"\r\n\r\n")
    lines = head.decode("ascii").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    assert lines[0] == f"HTTP/1.1 {status} {phrase}"
    assert int(headers["content-length"]) == len(body) and json.loads(body) == error.body()
    assert (headers["connection"], headers["retry-after"], headers["content-type"]) == (
        "close",
        "1",
        "application/json",
    )


class FakeTransport(asyncio.Transport):
    """A transport that records what a protocol does to it."""

    def __init__(self, peer: str) -> None:
        super().__init__()
        self.peer, self.written, self.eof, self.aborted, self.closed = peer, b"", False, False, False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return (self.peer, 40000) if name == "peername" else default

    def write(self, data: Any) -> None:
        self.written += bytes(data)

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        self.closed = True


class Inner(asyncio.Protocol):
    """What an admitted connection is handed to (aiohttp's handler in the gateway)."""

    def __init__(self) -> None:
        self.made = self.lost = 0
        self.data = b""
        self.eofs = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.made += 1

    def data_received(self, data: bytes) -> None:
        self.data += data

    def eof_received(self) -> bool:
        self.eofs += 1
        return True  # aiohttp's handler keeps a half-closed connection to answer it

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost += 1


MAX_LINGERING_HERE = 2


class GuardedConnections(RuleBasedStateMachine):
    """`_Guarded` connections against a model: a connection within both caps goes to the inner protocol and is
    counted until lost; one over a cap is answered (429 / 503) and lingers, counted in `lingering`, unless
    `MAX_LINGERING` already linger: then it is reset at once, answered nothing; what a refused one sends is
    dropped and its end closes it; losing a connection forgets whichever it was. `MAX_LINGERING` is lowered to 2
    to reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.saved = protocol.MAX_LINGERING
        protocol.MAX_LINGERING = MAX_LINGERING_HERE
        self.loop = asyncio.new_event_loop()
        self.guard = ConnectionGuard(EdgeLimits(max_connections=3, max_connections_per_client=2))
        self.open: list[tuple[Any, FakeTransport, Any, str]] = []  # (protocol, transport, inner or kind, client)
        self.admitted: dict[str, int] = {}
        self.lingering = 0

    def teardown(self) -> None:
        protocol.MAX_LINGERING = self.saved
        self.loop.close()

    @rule(client=st.sampled_from(["10.0.0.1", "10.0.0.2", "10.0.0.3"]))
    def connect(self, client: str) -> None:
        inner = Inner()
        guarded = protocol._Guarded(self.guard, lambda: inner)
        transport = FakeTransport(client)

        async def made() -> None:
            guarded.connection_made(transport)

        total, held = sum(self.admitted.values()), self.admitted.get(client, 0)
        self.loop.run_until_complete(made())
        if total < 3 and held < 2:
            assert inner.made == 1 and transport.written == b"" and not transport.aborted
            self.admitted[client] = held + 1
            self.open.append((guarded, transport, inner, client))
        elif self.lingering < MAX_LINGERING_HERE:
            status = 503 if total >= 3 else 429
            assert inner.made == 0 and transport.written.startswith(f"HTTP/1.1 {status} ".encode())
            assert transport.eof and not transport.aborted
            self.lingering += 1
            self.open.append((guarded, transport, "lingering", client))
        else:
            assert inner.made == 0 and transport.aborted and transport.written == b""
            self.open.append((guarded, transport, "reset", client))

    @precondition(lambda self: bool(self.open))
    @rule(data=st.data(), eof=st.booleans())
    def send(self, data: st.DataObject, eof: bool) -> None:
        self.send_on(data.draw(st.integers(0, len(self.open) - 1)), eof)

    def send_on(self, index: int, eof: bool) -> None:
        """What a connection sends reaches the inner protocol; a refused one's is dropped and the refusal keeps
        lingering (a close now could reset the answer away), and its end closes it."""
        guarded, transport, what, _client = self.open[index]
        closed = (transport.closed, transport.aborted)  # the linger timer may have closed it: no loop runs below
        guarded.data_received(b"POST /v1/completions HTTP/1.1\r\n")
        assert (transport.closed, transport.aborted) == closed
        kept = guarded.eof_received() if eof else None
        if isinstance(what, Inner):
            assert what.data.endswith(b"HTTP/1.1\r\n") and kept is (True if eof else None)
        else:
            assert not kept

    @precondition(lambda self: bool(self.open))
    @rule(data=st.data())
    def lose(self, data: st.DataObject) -> None:
        self.lose_at(data.draw(st.integers(0, len(self.open) - 1)))

    def lose_at(self, index: int) -> None:
        guarded, _transport, what, client = self.open.pop(index)
        guarded.connection_lost(None)
        if isinstance(what, Inner):
            assert what.lost == 1
            self.admitted[client] -= 1
            if not self.admitted[client]:
                del self.admitted[client]
        elif what == "lingering":
            self.lingering -= 1

    @invariant()
    def counts_match(self) -> None:
        self.guard.check_invariants()
        assert (self.guard.per_client, self.guard.lingering) == (self.admitted, self.lingering)


TestGuardedConnections = GuardedConnections.TestCase
TestGuardedConnections.settings = settings(max_examples=40, stateful_step_count=25)


def test_guarded_connections_through_every_cap() -> None:
    """One run of the machine that surely reaches each case: a client's share full (429), the total full (503),
    the lingering bound full (a reset), data and ends on each kind, and every connection lost."""
    machine = GuardedConnections()
    try:
        for client in ["10.0.0.1"] * 3 + ["10.0.0.2", "10.0.0.3", "10.0.0.3"]:  # 2 admitted, 429, 1 admitted, 503s
            machine.connect(client)
            machine.counts_match()
        assert [what if isinstance(what, str) else "in" for _g, _t, what, _c in machine.open] == [
            *("in", "in", "lingering", "in", "lingering", "reset")
        ]
        for index in range(len(machine.open)):
            machine.send_on(index, eof=index % 2 == 0)
            machine.send_on(index, eof=True)
        while machine.open:
            machine.lose_at(len(machine.open) - 1)
            machine.counts_match()
    finally:
        machine.teardown()


def _record(name: str, template: str, level: int, kind: str | None, error: type[Exception] | None) -> Any:
    info = (error, error("boom"), None) if error else None
    record = logging.LogRecord(name, level, __file__, 1, template, ("arg",), info)
    if kind is not None:
        record.kind = kind
    return record


log_events = st.lists(
    st.tuples(
        st.sampled_from(["serving.gateway", "aiohttp.server"]),
        st.sampled_from(["refused %s", "failed %s"]),
        st.sampled_from([logging.WARNING, logging.ERROR]),
        st.sampled_from([None, "accept", "read"]),
        st.sampled_from([None, OSError, ValueError]),
        st.sampled_from([0, 3, 10]),
    ),
    max_size=30,
)


@example(
    [
        ("serving.gateway", "refused %s", logging.ERROR, None, OSError, 0),  # at ERROR the traceback stays
        ("serving.gateway", "refused %s", logging.WARNING, "accept", None, 0),  # another kind: passes
        ("serving.gateway", "refused %s", logging.WARNING, "read", None, 0),
        ("serving.gateway", "refused %s", logging.WARNING, "read", None, 3),  # dropped
        ("serving.gateway", "refused %s", logging.WARNING, "read", None, 7),  # 10 s on: passes, says 1 dropped
        ("serving.gateway", "failed %s", logging.WARNING, None, ValueError, 0),  # the exception as the line's end
    ]
)
@given(log_events)
def test_the_log_limiter_passes_and_counts_as_a_dict_of_kinds(events: list[tuple[Any, ...]]) -> None:
    """A kind (logger, template, `kind` extra, exception type; not the level) passes once per 10 s and then says
    how many alike it dropped; below ERROR an exception becomes the line's end, at ERROR its traceback stays."""
    now = [0]
    limiter = LogLimiter(10.0, clock=lambda: now[0])
    model: dict[tuple[Any, ...], list[int]] = {}
    for name, template, level, kind, error, dt in events:
        now[0] += dt
        record = _record(name, template, level, kind, error)
        key = (name, template, kind, error)
        entry = model.get(key)
        passes = entry is None or now[0] - entry[0] >= 10
        assert limiter.filter(record) == passes
        if not passes:
            assert entry is not None
            entry[1] += 1
            continue
        dropped = entry[1] if entry else 0
        model[key] = [now[0], 0]
        message = template % "arg"
        if error is not None and level < logging.ERROR:
            message += f" ({error.__name__}: boom)"
        assert record.getMessage() == message + (f" [{dropped} alike dropped]" if dropped else "")
        assert (record.exc_info is not None) == (error is not None and level >= logging.ERROR)


def test_log_limits_come_off_as_they_went_on() -> None:
    """`install_log_limits` puts one limiter on each of the gateway's loggers; what it returns takes it off."""
    loggers = [logging.getLogger(name) for name in protocol.LOGGERS]
    before = [list(logger.filters) for logger in loggers]
    uninstall = install_log_limits(5.0)
    try:
        added = [[f for f in logger.filters if f not in was] for logger, was in zip(loggers, before, strict=True)]
        assert all(len(new) == 1 and isinstance(new[0], LogLimiter) for new in added)
        assert len({id(new[0]) for new in added}) == 1 and added[0][0].interval_s == 5.0
    finally:
        uninstall()
    assert [list(logger.filters) for logger in loggers] == before


def test_edge_limits_take_the_config_keys_and_bound_the_linger() -> None:
    """`from_config` reads all four connection keys (overrides win); the linger after an unread body is at most
    1 s and never past the body deadline; bodies reach the API compressed."""
    section = types.SimpleNamespace(
        header_timeout_s=3.0, body_timeout_s=0.5, max_connections=7, max_connections_per_client=5
    )
    edge = EdgeLimits.from_config(section, max_body_bytes=99)
    assert (edge.header_timeout_s, edge.body_timeout_s, edge.max_connections) == (3.0, 0.5, 7)
    assert (edge.max_connections_per_client, edge.max_body_bytes) == (5, 99)
    args = edge.handler_args()
    assert (args["lingering_time"], args["keepalive_timeout"], args["auto_decompress"]) == (0.5, 3.0, False)
    assert EdgeLimits(body_timeout_s=30.0).handler_args()["lingering_time"] == 1.0


@pytest.mark.parametrize(
    ("status", "shown", "hidden"),
    [
        (400, "the request could not be read: Invalid header value char", "^"),
        (500, "internal error", "secret"),
    ],
)
def test_aiohttps_own_errors_say_the_first_line_of_a_4xx_and_nothing_of_a_5xx(
    status: int, shown: str, hidden: str
) -> None:
    """A parser's error is its first line (not the raw line and caret it appends); a server error's cause (a path,
    a value) never reaches the client; an answer already begun cannot be followed by an error."""
    request = types.SimpleNamespace(remote="127.0.0.1", writer=types.SimpleNamespace(output_size=0))
    error: Exception = BadHttpMessage("Invalid header value char:\n\n  b'x'\n     ^")
    if status >= 500:
        error = RuntimeError("secret /etc/x")
    response = JsonRequestHandler.handle_error(None, request, status, error)  # type: ignore[arg-type]
    assert response.status == status
    body = json.loads(response.body)  # type: ignore[arg-type]
    assert body["error"]["message"] == shown and hidden not in body["error"]["message"]
    request.writer.output_size = 10
    with pytest.raises(ConnectionError):
        JsonRequestHandler.handle_error(None, request, status, error)  # type: ignore[arg-type]


def test_each_kind_of_event_loop_error_has_its_line(caplog: pytest.LogCaptureFixture) -> None:
    """The loop's errors share one template; their message is their kind, so a storm of one (accept() out of
    descriptors) does not silence another (a callback's failure)."""
    caplog.set_level(logging.DEBUG, logger="serving.protocol")
    limiter = LogLimiter(60.0)
    logger = logging.getLogger("serving.protocol")
    logger.addFilter(limiter)
    loop = asyncio.new_event_loop()
    try:
        for message in ["socket.accept() out of system resource"] * 50 + ["Exception in callback"] * 50:
            loop_exception_handler(loop, {"message": message, "exception": OSError(24, "Too many open files")})
    finally:
        loop.close()
        logger.removeFilter(limiter)
    lines = [r.getMessage() for r in caplog.records if r.name == "serving.protocol"]
    assert len(lines) == 2 and "accept()" in lines[0] and "callback" in lines[1]
