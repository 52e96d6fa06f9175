"""The OpenAI API as typed records: request bodies in, answer bodies out. Pure: no sockets, no event loop.

In: `decode_body` turns a POST's bytes into a JSON object (its Content-Encoding
undone within a size cap, its charset one of the Unicode ones, JSON without
NaN, its depth and numbers bounded by the parser); `parse_completion` and
`parse_chat` check every field into a `CompletionRequest` or `ChatRequest`
with its `SamplingOptions` and `Output` (vLLM's options of what the answer
shows); `prompt_tokens` tokenizes one (cut to `truncate_prompt_tokens`, as
vLLM cuts it) under the prompt limit. Numbers and booleans are read as vLLM's
pydantic models read them, in lax mode (`lax_integer`, `lax_number`,
`lax_flag`: "7" is 7, true is 1); `parse_tokenize` reads /tokenize's own
fields only, as vLLM's tokenize requests hold them. A parameter this server does not implement (a chat's `echo`,
tools, `response_format`, ...) is refused unless it
has the value that changes nothing (a flag: any value `lax_flag` reads as false); one it does not know is ignored
with a warning, as vLLM does (its clients send extras other servers do not know;
`best_of` and a completion's `top_logprobs` are such: vLLM 0.32's requests have no such field). A chat's
messages are kept as given and read by `mooncake.engine.chat.chat_conversation` when rendered, the vLLM
router's reader too, so both render one chat to one prompt.

Out: a `Reply` (one request's id, time, model, kind) makes its `Completion`
(the whole answer) or its `Chunk`s (server-sent events; a chat's first text
chunk carries the role; `stream_options.include_usage` adds a last chunk with
the `Usage` and no choices, and with `continuous_usage_stats` as well every chunk
carries the usage so far, as vLLM's do). Log-probabilities, where asked
(`logprobs: k` for a completion, `logprobs: true` and `top_logprobs: k` for a
chat, k <= `MAX_LOGPROBS`), come in OpenAI's two shapes (`Logprobs`): a
completion's four parallel lists, a chat's `content` list; each chunk carries
those of the tokens that came since the choice's last chunk. A completion's `echo` opens the
answer with the prompt, and its log-probabilities with the prompt's (the first
token's null), as vLLM's. vLLM's `prompt_logprobs: k` adds the prompt's own
(`prompt_logprobs_json`: per token, null for the first, an object of token ids
to `{logprob, rank, decoded_token}`) to each choice of a completion and to a
chat's answer; a field every answer carries, null when not asked, as vLLM's.

Every failure is an `ApiError`: a status and OpenAI's body
`{"error": {"message", "type", "param", "code"}}`; `code` is a string for the
errors OpenAI names (`model_not_found`) and the status otherwise.

Invariant: for any bytes and any JSON value, decoding and parsing either
return a request or raise an `ApiError` with a 4xx status (the property tests
check it).
"""

from __future__ import annotations

import codecs
import hashlib
import hmac
import json
import logging
import math
import re
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from mooncake import _json
from mooncake._checks import shown
from mooncake.engine.chat import content_text
from mooncake.engine.logprobs import TokenLogprobs
from mooncake.engine.tokenizer import CHAT_INPUTS
from mooncake.errors import InvalidRequestError, MooncakeError
from mooncake.sched.outcome import Outcome, Reason, http_status
from serving.tokenizer import ServingTokenizer

__all__ = [
    "DECODE_HEADER",
    "PREFILL_HEADER",
    "ApiError",
    "ChatMessage",
    "ChatRequest",
    "Choice",
    "Chunk",
    "Completion",
    "CompletionRequest",
    "Logprobs",
    "Output",
    "Reply",
    "SamplingOptions",
    "ServedModel",
    "Usage",
    "authorized",
    "cache_salt",
    "check_output_limit",
    "decode_body",
    "detokenize_body",
    "echo_only",
    "encoded",
    "error_body",
    "generation_limit",
    "lax_flag",
    "lax_integer",
    "lax_number",
    "max_tokens_within",
    "models_body",
    "output_limit_field",
    "parse_chat",
    "parse_completion",
    "parse_tokenize",
    "prompt_logprobs_json",
    "prompt_truncation",
    "prompt_tokens",
    "rejection_error",
    "requested_max_tokens",
    "stream_flag",
    "stream_usage",
    "tokenize_body",
    "vllm_prompt_logprobs",
]

LOG = logging.getLogger(__name__)

# Response headers naming the instances that prefilled and decoded a request (for clients comparing a run with
# its simulation, as examples/validate.py does).
PREFILL_HEADER = "X-Mooncake-Prefill-Instance"
DECODE_HEADER = "X-Mooncake-Decode-Instance"
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256
MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # vLLM's default `--max-logprobs`, OpenAI's chat limit
MAX_CHOICES = 16  # a request's `n`: each choice is a request of the cluster's (its own prefill and decode)
MAX_PROMPTS = 64  # a completion's batch of prompts (OpenAI's array `prompt`): each prompt's `n` choices
MAX_ANSWER_CHOICES = 64  # prompts x n: the cluster requests one body may make (and route headers list)
LOGPROB_FLOOR = -9999.0  # a log-probability of -inf as OpenAI and vLLM write it (JSON has no infinity)
CHARSETS = frozenset({"utf-8", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be", "ascii"})
ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI's error types by status; any other 4xx is an invalid_request_error, any 5xx a server_error.
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 408: "timeout_error", 429: "rate_limit_error"}
ERROR_TYPES[504] = "timeout_error"


class ApiError(MooncakeError):
    """An error answer: the status, OpenAI's type, the message, the offending parameter, extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        kind: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
        outcome: Outcome | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.code: str | int = code or status
        self.headers = dict(headers or {})
        self.outcome = outcome

    def body(self) -> dict[str, Any]:
        """OpenAI's error body; a rejection's also says whether its prefill ran (`outcome`: the value of
        `sched.outcome.Outcome`), for clients that count wasted prefills."""
        body = error_body(self.message, kind=self.kind, param=self.param, code=self.code)
        if self.outcome is not None:
            body["error"]["outcome"] = self.outcome.value
        return body


def rejection_error(
    reason: Reason,
    outcome: Outcome,
    *,
    detail: str | None = None,
    ttft_s: float | None = None,
    ttft_slo_s: float | None = None,
    waited_s: float = 0.0,
    param: str | None = None,
    failure: str | None = None,
) -> ApiError:
    """The answer to a request the scheduler refused, one for every server here: the status `http_status` gives
    the reason, the reason as the error's code, whether the prefill ran (`outcome`), and `Retry-After` (none
    with a 400: no retry can help). A TTFT refusal with its estimate waits what the estimate overshot the
    objective by (the queue ahead drains about that much meanwhile), at least 1 s; any other wait 1 s.
    `detail` (default: the TTFT estimate against its objective for a TTFT refusal, with `waited_s` the request
    waited for room before it, else a word of advice) follows the reason in the message. `failure`: the request
    had been accepted, and this refusal is of scheduling it again after that failure (an engine of its went down),
    which the message says first (`waited_s` then counts from its arrival)."""
    status = http_status(reason)
    where = "the decode engine refused the request" if outcome is Outcome.REJECTED_AFTER_PREFILL else "rejected"
    if failure is not None:
        where = f"{failure}; scheduling the request again was rejected"
    advice = {503: "no engine of a role is up", 400: "no engine could ever take it", 429: "retry later"}[status]
    wait = 1
    if reason is Reason.TTFT_SLO and ttft_s is not None and ttft_slo_s is not None and math.isfinite(ttft_s):
        wait = max(1, math.ceil(ttft_s - ttft_slo_s))
        waited = f" after {waited_s:.3f} s waited for room" if waited_s > 0 else ""
        if failure is not None:
            waited = f" {waited_s:.3f} s after its arrival"
        advice = f"estimated TTFT {ttft_s:.3f} s{waited}, objective {ttft_slo_s:g} s"
    return ApiError(
        status,
        f"{where} ({reason.value}): {detail or advice}",
        code=reason.value,
        param=param,
        headers={} if status == 400 else {"Retry-After": str(wait)},
        outcome=outcome,
    )


def error_body(message: str, *, kind: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def authorized(authorization: str | None, api_key: str) -> bool:
    """Whether an `Authorization` header carries `api_key` (always, where the key is ""): the scheme `Bearer`
    in any case (RFC 9110 makes schemes case-insensitive; vLLM and the openai client agree), one space, the key.
    The comparison is of SHA-256 digests, so its time tells nothing of the key, its length included."""
    if not api_key:
        return True
    scheme, _, given = (authorization or "").partition(" ")
    digest = hashlib.sha256(given.encode("utf-8", "surrogateescape")).digest()
    matches = hmac.compare_digest(digest, hashlib.sha256(api_key.encode()).digest())
    return scheme.lower() == "bearer" and matches


# ---------------------------------------------------------------------------------------------- bytes to JSON


def _media_params(content_type: str | None) -> dict[str, str]:
    params = {}
    for part in (content_type or "").split(";")[1:]:
        key, _, value = part.partition("=")
        params[key.strip().lower()] = value.strip().strip('"')
    return params


def _inflate(data: bytes, coding: str, max_bytes: int) -> bytes:
    if coding in ("gzip", "x-gzip"):
        candidates = [16 + zlib.MAX_WBITS]
    elif coding == "deflate":
        candidates = [zlib.MAX_WBITS, -zlib.MAX_WBITS]  # zlib-wrapped, as the RFC says, or raw as some clients send
    else:
        raise ApiError(415, f"unsupported Content-Encoding {shown(coding, quote=ascii)} (gzip, deflate or identity)")
    for wbits in candidates:
        inflater = zlib.decompressobj(wbits)
        try:
            out = inflater.decompress(data, max_bytes + 1)
        except zlib.error:
            continue
        if len(out) > max_bytes:
            raise ApiError(413, f"the decompressed body exceeds {max_bytes} bytes")
        if inflater.eof and not inflater.unused_data:
            return out
    raise ApiError(400, f"the body is not valid {coding} data")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def decode_body(
    raw: bytes, *, content_type: str | None = None, content_encoding: str | None = None, max_bytes: int = 8 << 20
) -> dict[str, Any]:
    """The JSON object a POST body holds.

    Args:
        raw: the body's bytes, as received.
        content_type: the Content-Type header (only its charset counts: UTF-8 when absent).
        content_encoding: the Content-Encoding header (gzip, deflate, identity; applied in order).
        max_bytes: the largest body once decompressed.

    Raises:
        ApiError: 400 for anything but a JSON object in a known charset, 413 over `max_bytes`, 415 for an
            unsupported Content-Encoding.
    """
    codings = [c.strip().lower() for c in (content_encoding or "").split(",") if c.strip()]
    if len(codings) > 2:
        raise ApiError(415, f"too many Content-Encodings: {shown(content_encoding, quote=ascii)}")
    for coding in reversed(codings):
        if coding != "identity":
            raw = _inflate(raw, coding, max_bytes)
    charset = _media_params(content_type).get("charset", "utf-8")
    try:
        name = codecs.lookup(charset).name
    except (LookupError, ValueError):
        name = ""
    if name not in CHARSETS:
        raise ApiError(400, f"unsupported charset {shown(charset, quote=ascii)} (use utf-8)")
    try:
        text = raw.decode("utf-8-sig" if name == "utf-8" else name)
    except UnicodeDecodeError as error:
        raise ApiError(400, f"the body is not JSON text in {name}: {error.reason} at byte {error.start}") from None
    if not text.strip():
        raise ApiError(400, "the body is empty: expected a JSON object")
    try:
        body = _json.loads(text, parse_constant=_no_constant)
    except ValueError as error:  # JSONDecodeError, NaN, an integer past Python's digit limit, nested too deep
        raise ApiError(400, f"the body is not valid JSON: {shown(str(error), limit=120, quote=ascii)}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, not a JSON {type(body).__name__}")
    return body


# ---------------------------------------------------------------------------------------------- requests


@attrs.frozen(kw_only=True)
class ServedModel:
    """What the API serves: the model's name and the token limits a request is checked against.

    A request's prompt and `max_tokens` together fit a decode engine's context (`max_context_tokens`), as in
    vLLM, where they fit the model's `max_model_len`; `vocab_size` bounds the ids of a prompt given as tokens.
    A request without `temperature`, `top_p`, `top_k`, `min_p` or `repetition_penalty` gets its `default_...`: as in
    vLLM, the checkpoint's `generation_config.json` where it sets them, else 1.0, 1.0, 0 (all), 0 and 1 (OpenAI's
    defaults: sampling from the whole distribution); one without `presence_penalty` or `frequency_penalty` gets 0,
    whatever the file says (vLLM takes neither from it: `sampling_defaults`). A chat
    without `max_tokens` generates what the context leaves after its prompt, at most `default_chat_max_tokens`
    where the file sets one (its `max_new_tokens`, as vLLM applies it; a completion's default is
    `default_max_tokens`, as vLLM's is its request's 16).
    """

    name: str
    max_prompt_tokens: int
    default_max_tokens: int
    max_context_tokens: int
    vocab_size: int
    default_temperature: float = 1.0
    default_top_p: float = 1.0
    default_top_k: int = 0
    default_min_p: float = 0.0
    default_repetition_penalty: float = 1.0
    default_chat_max_tokens: int | None = None


@attrs.frozen(kw_only=True)
class SamplingOptions:
    """How a request's tokens are chosen and when its text ends.

    Attributes:
        max_tokens: the most tokens generated; None, a chat that set none until its prompt is tokenized
            (`generation_limit`): then what the context leaves after the prompt, as vLLM's chat default.
        temperature: 0 is greedy.
        top_p: the nucleus' probability mass, in (0, 1].
        seed: the random stream of a sampled request; None (no seed in the body): a fresh one per request, drawn
            when it is admitted (`Dispatcher.admit`), as vLLM and OpenAI sample (a fixed default would repeat).
        stop: up to four strings; the text ends before the first that appears (finish reason "stop").
        skip_special_tokens: leave the tokenizer's special tokens out of the text (vLLM's default).
        ignore_eos: the model's stop ids (its EOS and the like) do not end the generation; only `max_tokens` or a
            stop string does (vLLM's, which benchmarks send to fix each output's length).
        min_tokens: no stop id is drawn and no stop string ends the text before this many tokens (vLLM's).
        add_special_tokens: the tokenizer adds its special tokens (a BOS) to the prompt; vLLM's defaults, true
            for a completion and false for a chat, whose template writes its own.
        logprobs: None, no log-probabilities; k, each token's and the k most probable tokens' (a completion's
            `logprobs`, a chat's `top_logprobs` with `logprobs: true`).
        top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty: vLLM's, as
            `mooncake.engine.sampling.SamplingParams` applies them (top_k 0: all tokens).
        prompt_logprobs: the prompt's log-probabilities too, k most probable beside each token, computed by the
            prefill (vLLM's `prompt_logprobs`; else a completion's `echo` with `logprobs`, as vLLM asks its engine
            for them then); None: none.
        stop_token_ids: the request's own ids that end the generation (vLLM's), beside the model's; the
            answer's `stop_reason` is the id.
        include_stop_str_in_output: the stop string (or stop token's text) ends the text instead of being cut.
        logit_bias: (token id, bias) pairs added to those logits before drawing (OpenAI's, within [-100, 100]).
        allowed_token_ids: the only tokens that may be drawn (vLLM's), sorted; empty: every token.
    """

    max_tokens: int | None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    min_tokens: int = 0
    add_special_tokens: bool = True
    logprobs: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    prompt_logprobs: int | None = None  # what the prefill computes; `Output.prompt_logprobs`: what is listed
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()


@attrs.frozen(kw_only=True)
class Output:
    """vLLM's options of what an answer shows beside its text (its request fields of the same names).

    Attributes:
        prompt_logprobs: list the prompt's log-probabilities, k most probable beside each token (None: not).
        return_token_ids: add the prompt's token ids (`prompt_token_ids`) and each choice's (`token_ids`; a
            stream's chunks, those of the tokens since the choice's last chunk, the prompt's in the first).
        tokens_as_ids: `return_tokens_as_token_ids`: a log-probability's token is written "token_id:{id}".
        truncate_prompt_tokens: keep only k of the prompt's tokens (None: all of it).
        truncation_side: which k (`prompt_truncation`): "left" the last, "right" the first; None the last, as the
            tokenizer's own truncation keeps them (the special tokens it adds stay).
    """

    prompt_logprobs: int | None = None
    return_token_ids: bool = False
    tokens_as_ids: bool = False
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None


@attrs.frozen(kw_only=True)
class CompletionRequest:
    """A checked `/v1/completions` body."""

    model: str
    prompt: str | tuple[int, ...]  # text, or token ids (a batch's first)
    sampling: SamplingOptions
    n: int = 1  # choices, each drawn independently (a seed: choice i samples with seed + i, as vLLM's)
    output: Output = Output()
    echo: bool = False  # the answer opens with the prompt (and its log-probabilities, with `logprobs`)
    # `echo` with `max_tokens: 0` (OpenAI's way to score a prompt): the answer is the prompt alone; the engines
    # still draw one token (`sampling.max_tokens` 1), which the answer leaves out.
    echo_only: bool = False
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage and no choices
    continuous_usage: bool = False  # ... and continuous_usage_stats: the usage so far in every chunk
    batch: tuple[str | tuple[int, ...], ...] = ()  # a batch of prompts (OpenAI's array `prompt`); () for one
    cache_salt: str | None = None  # vLLM's: the prefix cache's namespace for this request (`cache_salt`)
    # vLLM's `request_id`: the answer's id is `cmpl-` and it, unless the `X-Request-Id` header gives one (the
    # gateway's `_answer_id`); None: none given. Only the answer shows it: the cluster's own ids stay unique.
    request_id: str | None = None

    def split(self) -> list[CompletionRequest]:
        """One request per prompt of a batch (itself alone when it has one prompt): their choices are the
        answer's, prompt after prompt, as vLLM numbers them (prompt i's choice j is index i * n + j)."""
        return [attrs.evolve(self, prompt=one, batch=()) for one in self.batch] or [self]


@attrs.frozen(kw_only=True)
class ChatMessage:
    """One message of a chat as the client gave it: its role, its content (a string, a list of text parts, or null)
    and its other keys. What its chat template sees of it (the text of its parts, `name`, a tool's `tool_call_id`,
    an assistant's `reasoning` and `tool_calls`) is `mooncake.engine.chat.chat_conversation`'s choice, the vLLM
    router's too, so that the two render one chat alike (`as_message` is what it reads)."""

    role: str
    content: Any  # str | list of text parts | None, as given (JSON values)
    fields: Mapping[str, Any] = attrs.field(factory=dict)  # the message's keys beside role and content

    def as_message(self) -> dict[str, Any]:
        """The message as a chat template's reader (`chat_conversation`) takes it: the object the client sent."""
        return {**self.fields, "role": self.role, "content": self.content}


@attrs.frozen(kw_only=True)
class ChatRequest:
    """A checked `/v1/chat/completions` body."""

    model: str
    messages: tuple[ChatMessage, ...]
    sampling: SamplingOptions
    n: int = 1  # choices, as a completion's
    output: Output = Output()
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    cache_salt: str | None = None  # as a completion's
    request_id: str | None = None  # as a completion's (the answer's id is `chatcmpl-` and it)
    # vLLM's `chat_template_kwargs`: more variables for the chat template (`enable_thinking`, say), and its
    # `documents`.
    template_variables: Mapping[str, Any] = attrs.field(factory=dict)
    add_generation_prompt: bool = True  # vLLM's: the prompt opens the assistant's turn
    continue_final_message: bool = False  # vLLM's: the prompt ends inside the final message, which the model continues


def _absent(value: Any) -> bool:
    return value is None


def _off(value: Any) -> bool:
    """Null, or a boolean that vLLM's pydantic reads as false (`lax_flag`: false, 0, "false", "no"...)."""
    return _reads_flag(value) and lax_flag({"value": value}, "value") is not True


def _zero(value: Any) -> bool:
    return value is None or lax_number(value) == 0


def _one(value: Any) -> bool:
    return value is None or lax_number(value) == 1


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == {}


# Parameters OpenAI defines that this server does not implement: accepted only at their neutral value.
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "echo": _off,  # a chat's (a completion's is served): vLLM's chat echo repeats the last message
    "suffix": lambda v: v is None or v == "",
    "tools": _empty,
    "functions": _empty,
    "tool_choice": lambda v: v in (None, "none", "auto"),
    "function_call": lambda v: v in (None, "none", "auto"),
    "response_format": lambda v: v is None or v == {"type": "text"},
    "reasoning_effort": _absent,
    "modalities": lambda v: v is None or v == ["text"],
    "audio": _absent,
    "prediction": _absent,
    # vLLM's own sampling and output parameters (its clients send them), at the value that changes nothing.
    "length_penalty": _one,
    "use_beam_search": _off,
    "bad_words": _empty,
    "guided_json": _absent,
    "guided_regex": _absent,
    "guided_choice": _absent,
    "guided_grammar": _absent,
    "structured_outputs": _absent,
    "logits_processors": _absent,
    "chat_template": _absent,
    # vLLM 0.32's request fields beside those: multimodal and disaggregation plumbing, watermarks, reasoning budgets,
    # at their defaults (`test_every_vllm_field_is_read_refused_or_neutral` checks the list against vLLM's models).
    "watermarking": _off,  # false opts out: what a server without watermarks does
    "logprob_token_ids": _empty,
    "prompt_embeds": _absent,
    "routed_experts_prompt_start": _zero,
    "kv_transfer_params": _empty,
    "ec_transfer_params": _empty,
    "vllm_xargs": _empty,
    "repetition_detection": _absent,
    "thinking_token_budget": _absent,
    "media_io_kwargs": _empty,
    "mm_processor_kwargs": _empty,
    "return_prompt_text": _off,
}
# Parameters that change nothing here (bookkeeping for the client), checked for their type only.
NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "user": lambda v: v is None or isinstance(v, str),
    "store": lambda v: v is None or isinstance(v, bool),
    "metadata": lambda v: v is None or isinstance(v, dict),
    "parallel_tool_calls": lambda v: v is None or isinstance(v, bool),
    "service_tier": lambda v: v is None or isinstance(v, str),
    "priority": lambda v: v is None or _reads_int64(v),
    "spaces_between_special_tokens": lambda v: _reads_flag(v),  # read as vLLM reads a boolean
    "include_reasoning": lambda v: _reads_flag(v),  # no reasoning parser here: nothing to include or leave out
    # vLLM's render endpoints' options, which its generation endpoints ignore.
    "return_token_offsets": lambda v: _reads_flag(v),
    "mm_payload": lambda v: v in (None, "tensors", "none"),
    "return_mm_kwargs": lambda v: _reads_flag(v),
    "session_id": lambda v: v is None or isinstance(v, str),
    # How many tokens a stream's chunk gathers at most (vLLM's): each token is its own chunk here, which it allows.
    "stream_interval": lambda v: v is None or ((n := lax_integer(v)) is not None and n >= 1),
}
SHARED = (
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "skip_special_tokens",
    "ignore_eos",
    "min_tokens",
    "add_special_tokens",
    "logprobs",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "logit_bias",
    "n",
    "prompt_logprobs",
    "allowed_token_ids",
    "truncate_prompt_tokens",
    "truncation_side",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "cache_salt",
    "request_id",
)
# A completion has no `max_completion_tokens` nor `top_logprobs` (vLLM's `CompletionRequest` has neither: each is
# ignored, as any unknown field).
COMPLETION_FIELDS = frozenset({*SHARED, "prompt", "echo"})
CHAT_FIELDS = frozenset(
    {
        *SHARED,
        "max_completion_tokens",
        "messages",
        "chat_template_kwargs",
        "top_logprobs",
        "add_generation_prompt",
        "continue_final_message",
        "documents",
    }
)


def _param(name: str) -> str:
    """A parameter's name as an error names it: as given when short printable ASCII, else escaped and cut."""
    return name if len(name) <= 40 and name.isascii() and name.isprintable() else shown(name, limit=40, quote=ascii)


def _text(value: Any, param: str) -> str:
    """A string that UTF-8 can encode (JSON's \\ud800 escapes make lone surrogates, which it cannot)."""
    if not isinstance(value, str):
        raise ApiError(400, f"{param} must be a string, got {shown(value, quote=ascii)}", param=param)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{param} is not valid Unicode (a lone surrogate)", param=param) from None
    return value


def _integer(body: Mapping[str, Any], name: str, default: int, low: int, high: int) -> int:
    """An integer field as vLLM reads it (`lax_integer`) within [low, high], `default` where absent or null."""
    value = body.get(name)
    if value is None:
        return default
    number = lax_integer(value)
    if number is None or not low <= number <= high:
        raise ApiError(
            400, f"{name} must be an integer in [{low}, {high}], got {shown(value, quote=ascii)}", param=name
        )
    return number


def _number(body: Mapping[str, Any], name: str, default: float, low: float, high: float, *, open_low: bool) -> float:
    """A number field as vLLM reads it (`lax_number`) within its bounds and finite (pydantic reads "inf" and
    "nan"; no sampling option here takes them), `default` where absent or null."""
    value = body.get(name)
    if value is None:
        return default
    number = lax_number(value)
    if (
        number is None
        or not math.isfinite(number)
        or not (low < number if open_low else low <= number)
        or number > high
    ):
        bounds = f"{'(' if open_low else '['}{low}, {high}]"
        raise ApiError(400, f"{name} must be a number in {bounds}, got {shown(value, quote=ascii)}", param=name)
    return number


# pydantic's lax reading of numbers (vLLM's request models validate a body in lax mode), as pydantic-core reads a
# string: an int field's is a JSON integer, or else is cleaned (`_cleaned_integer`) into one; a float field's is Rust's
# `f64::from_str` of it cut of whitespace (an exponent, "inf", "infinity", "nan" in any case), or else of it with
# its underscores removed where it has none leading, trailing or doubled. The whitespace cut is Rust's `str::trim`
# (Unicode White_Space: not Python's `str.strip`, which cuts \x1c-\x1f too).
_RUST_WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000" + "".join(
    map(chr, range(0x2000, 0x200B))
)
_JSON_INT = re.compile(r"-?(?:0|[1-9][0-9]*)")
_RUST_FLOAT = re.compile(r"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?|inf|infinity|nan)", re.IGNORECASE)
_MAX_INT_DIGITS = 4300  # the most digits pydantic reads in an int (Python's default `int_max_str_digits`)
_I64 = 2.0**63  # a whole float strictly within (-2**63, 2**63) is an int field's value; pydantic refuses the rest


def vllm_prompt_logprobs(body: Mapping[str, Any], *, chat: bool) -> Any:
    """The `prompt_logprobs` vLLM's engine is asked for by `body` (its `to_sampling_params`): the body's own, else,
    with `echo`, a completion's `logprobs` (None unless given) or a chat's `top_logprobs` (0 unless given). The
    vLLM router plans a request by it (`types.prefix_reusable`: a scored prompt reads no cached prefix there)."""
    given = body.get("prompt_logprobs")
    if given is None:
        try:
            echo = _flag(body, "echo", default=False)  # vLLM's reading: "false" and "off" are False
        except ApiError:  # vLLM refuses the request (its 400), whatever the router plans
            echo = False
        if echo:
            return body.get("top_logprobs", 0) if chat else body.get("logprobs")
    return given


def echo_only(body: Mapping[str, Any]) -> bool:
    """Whether a completion asks for its prompt back and nothing generated (`echo` with `max_tokens` 0, as vLLM
    reads both: lm-eval-harness's loglikelihood request).

    Raises:
        ApiError: 400, an `echo` that is no boolean as vLLM reads one.
    """
    return _flag(body, "echo", default=False) and _generates_nothing(body)


def _generates_nothing(body: Mapping[str, Any]) -> bool:
    return lax_integer(body.get("max_tokens")) == 0  # "0", 0.0 and false too


def lax_integer(value: Any) -> int | None:
    """An `int` field's value as vLLM's pydantic models read a JSON value (lax mode): an integer; a boolean (1 or
    0); a whole float within (-2**63, 2**63); a string pydantic reads (" 7 ", "+7", "007", "1_000", "7.0"; never
    "7.", "7.5", "1e3", "0x10", "٣"), of at most 4300 digits. None for anything else, which vLLM refuses. No
    range is checked here."""
    if type(value) is int or type(value) is bool:
        return int(value)
    if type(value) is float:
        return int(value) if value.is_integer() and -_I64 < value < _I64 else None
    if not isinstance(value, str):
        return None
    text = value if _JSON_INT.fullmatch(value) else _cleaned_integer(value)
    if text is None or not _JSON_INT.fullmatch(text) or len(text.lstrip("-")) > _MAX_INT_DIGITS:
        return None
    return int(text)


def _cleaned_integer(text: str) -> str | None:
    """pydantic-core's `clean_int_str`: `text` cut of whitespace, of a "+" (not before "-"), of leading zeros
    (underscores among them too; one zero is kept before a "." or alone), of a "." and zeros ending it, and of
    underscores (where none leads, trails or is doubled); None where nothing was cut (`text` was no JSON integer,
    and this makes none of it)."""
    length = len(text)
    text = text.strip(_RUST_WHITESPACE)
    if text.startswith("+"):
        if text.startswith("+-"):
            return None
        text = text[1:]
    negative = text.startswith("-")
    if negative:
        if text.startswith(("--", "-+")):
            return None
        text = text[1:]
    digits = _without_leading_zeros(text)
    if digits is None:
        return None
    dot = digits.find(".")
    if dot >= 0 and digits[dot + 1 :] and not digits[dot + 1 :].strip("0"):
        digits = digits[:dot]
    sign = "-" if negative else ""
    if "_" in digits and not digits.startswith("_") and not digits.endswith("_") and "__" not in digits:
        return sign + digits.replace("_", "")
    return None if len(digits) == length else sign + digits


def _without_leading_zeros(text: str) -> str | None:
    """pydantic-core's `strip_leading_zeros`: `text` from its first digit 1-9 or "-" after its leading zeros and
    underscores (from the last of them before a "."; the last of them where nothing follows); None where it opens
    with neither a digit nor "-", or a character but those follows the zeros."""
    if not text or text[0] not in "0123456789-":
        return None
    if text[0] != "0":
        return text
    for i, char in enumerate(text[1:], start=1):
        if char in "123456789-":
            return text[i:]
        if char == ".":
            return text[i - 1 :]
        if char not in "0_":
            return None
    return text[-1]


def lax_number(value: Any) -> float | None:
    """A `float` field's value as vLLM's pydantic models read a JSON value (lax mode): a number (an int past float's
    range is none); a boolean (1.0 or 0.0); a string as pydantic reads one ("0.5", " 1e3 ", ".5", "1_0.5", "inf",
    "NaN"; never "0x10", "1,5"). None for anything else, which vLLM refuses. No range is checked here: the value
    may be infinite or NaN."""
    if type(value) in (int, bool, float):
        try:
            return float(value)
        except OverflowError:
            return None
    if not isinstance(value, str):
        return None
    trimmed = value.strip(_RUST_WHITESPACE)
    if _RUST_FLOAT.fullmatch(trimmed):
        return float(trimmed)
    if "_" not in value or value.startswith("_") or value.endswith("_") or "__" in value:
        return None
    bare = value.replace("_", "")
    return float(bare) if _RUST_FLOAT.fullmatch(bare) else None


def _reads_int64(value: Any) -> bool:
    """Whether `value` is a 64-bit signed integer as vLLM reads one (`lax_integer`)."""
    number = lax_integer(value)
    return number is not None and -MAX_SEED - 1 <= number <= MAX_SEED


def _reads_flag(value: Any) -> bool:
    """Whether `value` is a boolean as vLLM reads one (`lax_flag`), or null."""
    try:
        lax_flag({"value": value}, "value")
    except ApiError:
        return False
    return True


def _flag(body: Mapping[str, Any], name: str, *, default: bool) -> bool:
    """A boolean field as vLLM reads it (`lax_flag`), `default` where absent or null."""
    value = lax_flag(body, name)
    return default if value is None else value


# pydantic's lax reading of a bool field from JSON (vLLM's request models): these strings, any case.
_LAX_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_LAX_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def lax_flag(body: Mapping[str, Any], name: str) -> bool | None:
    """A `bool | None` field as vLLM's pydantic models read it (lax mode): a boolean; 0 or 1 (int or float); one of
    the strings "true"/"false", "yes"/"no", "on"/"off", "t"/"f", "y"/"n", "1"/"0" in any case; None where absent
    or null.

    Raises:
        ApiError: 400 naming the field and the value, for anything else (vLLM's validation error).
    """
    value = body.get(name)
    if value is None or isinstance(value, bool):
        return value
    if type(value) in (int, float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _LAX_TRUE | _LAX_FALSE:
        return value.lower() in _LAX_TRUE
    raise ApiError(400, f"{name} must be a boolean, got {shown(value, quote=ascii)}", param=name)


def stream_flag(body: Mapping[str, Any]) -> bool:
    """Whether a body asks for a stream, as vLLM 0.32 reads `stream` (`lax_flag`: `"false"` is false, a null is
    the default, false).

    Raises:
        ApiError: 400 naming `stream` and the value, where it is no boolean pydantic reads.
    """
    return _flag(body, "stream", default=False)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOP_SEQUENCES:
        got = f"a list of {len(stops)}" if isinstance(stops, list) else shown(value, quote=ascii)
        raise ApiError(
            400, f"stop must be a string or a list of at most {MAX_STOP_SEQUENCES} strings, got {got}", param="stop"
        )
    for i, stop in enumerate(stops):
        where = "stop" if isinstance(value, str) else f"stop[{i}]"
        if not isinstance(stop, str):
            raise ApiError(400, f"stop must hold strings, got {where} = {shown(stop, quote=ascii)}", param="stop")
        if not 0 < len(_text(stop, "stop")) <= MAX_STOP_CHARS:
            raise ApiError(
                400,
                f"each stop string must have 1 to {MAX_STOP_CHARS} characters, got {where} = {shown(stop, quote=ascii)} "
                f"({len(stop)} characters)",
                param="stop",
            )
    return tuple(stops)


def _check_model(body: Mapping[str, Any], served: ServedModel) -> None:
    """A `model` given must be the served one's name (404 `model_not_found` otherwise, as OpenAI answers)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, f"model must be a string, got {shown(model, quote=ascii)}", param="model")
    if model is not None and model != served.name:
        raise ApiError(
            404, f"the model {shown(model, quote=ascii)} does not exist (this server serves {served.name!r})",
            param="model", code="model_not_found",
        )  # fmt: skip


def _common(body: dict[str, Any], known: frozenset[str], served: ServedModel, *, chat: bool) -> dict[str, Any]:
    """Check the parameters both APIs share, refusing unimplemented ones at any but their neutral value and
    ignoring unknown ones with a warning, as vLLM does (its clients send extras other servers do not know).
    Without `max_tokens` a completion gets `served.default_max_tokens` (vLLM's 16) and a chat the rest of the
    context (`generation_limit`, once the prompt's length is known), as vLLM's server defaults them."""
    ignored = []
    for name, value in body.items():
        if name in known:
            continue
        if name in NEUTRAL:
            if NEUTRAL[name](value):
                continue
            raise ApiError(400, f"{name} = {shown(value, quote=ascii)} has the wrong type", param=name)
        if name in UNSUPPORTED:
            if UNSUPPORTED[name](value):
                continue
            raise ApiError(400, f"{name} = {shown(value, quote=ascii)} is not supported by this server", param=name)
        ignored.append(_param(name))
    if ignored:
        LOG.warning("ignored request fields this server does not know: %s", ", ".join(ignored))
    _check_model(body, served)
    # A max_tokens over the whole context is refused here, before the prompt is tokenized, as vLLM refuses it; one
    # within it is trimmed to what the prompt leaves once the prompt is tokenized (`generation_limit`).
    max_tokens = requested_max_tokens(body, default=None if chat else served.default_max_tokens, completion=not chat)
    min_tokens = _integer(body, "min_tokens", 0, 0, MAX_SEED)
    if max_tokens is not None:
        check_output_limit(
            max_tokens,
            served.max_context_tokens,
            output_limit_field(body, completion=not chat),
            limit_name="the context: [decode] max_context_tokens",
        )
    if max_tokens is not None and min_tokens > max_tokens:
        raise ApiError(400, _min_over_max(min_tokens, max_tokens), param="min_tokens")
    sampling = SamplingOptions(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", served.default_temperature, 0.0, 2.0, open_low=False),
        top_p=_number(body, "top_p", served.default_top_p, 0.0, 1.0, open_low=True),
        seed=_seed(body),
        stop=_stop(body.get("stop")),
        skip_special_tokens=_flag(body, "skip_special_tokens", default=True),
        ignore_eos=_flag(body, "ignore_eos", default=False),
        min_tokens=min_tokens,
        add_special_tokens=_flag(body, "add_special_tokens", default=not chat),
        logprobs=_chat_logprobs(body) if chat else _completion_logprobs(body),
        top_k=max(0, _integer(body, "top_k", served.default_top_k, -1, MAX_SEED)),  # -1 is vLLM's "all" too
        min_p=_number(body, "min_p", served.default_min_p, 0.0, 1.0, open_low=False),
        repetition_penalty=_number(
            body, "repetition_penalty", served.default_repetition_penalty, 0.0, math.inf, open_low=True
        ),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0, open_low=False),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0, open_low=False),
        stop_token_ids=_token_ids(body.get("stop_token_ids"), "stop_token_ids", served),
        include_stop_str_in_output=_flag(body, "include_stop_str_in_output", default=False),
        logit_bias=_logit_bias(body.get("logit_bias"), served),
        allowed_token_ids=_token_ids(body.get("allowed_token_ids"), "allowed_token_ids", served, empty=False),
    )
    stream = stream_flag(body)
    include_usage, continuous_usage = stream_usage(body)
    prompt_logprobs = _prompt_logprobs(body, served, stream=stream)
    if prompt_logprobs is not None:  # the prefill computes them
        sampling = attrs.evolve(sampling, prompt_logprobs=prompt_logprobs)
    bound = min(served.max_prompt_tokens, served.max_context_tokens)  # the max_model_len `models_body` advertises
    k, side = prompt_truncation(body, bound)
    output = Output(
        prompt_logprobs=prompt_logprobs,
        return_token_ids=_flag(body, "return_token_ids", default=False),
        tokens_as_ids=_flag(body, "return_tokens_as_token_ids", default=False),
        # -1: the longest prompt served, which leaves room for output already (max_prompt_tokens + default_max_tokens
        # fit the context), where vLLM's -1 keeps one token of its max_model_len back.
        truncate_prompt_tokens=bound if k == -1 else k,
        truncation_side=side,
    )
    return {
        "model": served.name,
        "sampling": sampling,
        "output": output,
        "n": _choices(body),
        "stream": stream,
        "include_usage": include_usage,
        "continuous_usage": continuous_usage,
        "cache_salt": cache_salt(body),
        "request_id": None if "request_id" not in body else _text(body["request_id"], "request_id"),
    }


def _seed(body: Mapping[str, Any]) -> int | None:
    """A body's `seed` as the sampler's unsigned 64-bit stream: vLLM takes any signed 64-bit seed (the same bits
    here) and reads -1 as none (`SamplingParams`), as null or no seed: a fresh stream per request."""
    if body.get("seed") is None:
        return None
    seed = _integer(body, "seed", 0, -MAX_SEED - 1, MAX_SEED)
    return None if seed == -1 else seed % (1 << 64)


def cache_salt(body: Mapping[str, Any]) -> str | None:
    """vLLM 0.32's `cache_salt`: the request's blocks are keyed in a namespace of their own (`BlockHasher.salted`),
    so that only requests of the same salt share cached prefixes (a tenant cannot learn from a cache hit that
    another sent a prompt); None where absent or null. The one reading of the gateway and the vLLM router.

    Raises:
        ApiError: 400 naming `cache_salt` (vLLM's message): no string, empty, over 128 characters, or holding '@',
            '/', '\\' or NUL.
    """
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise ApiError(400, "Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
    if len(salt) > 128 or any(char in "@/\\\0" for char in salt):
        raise ApiError(
            400,
            "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL.",
            param="cache_salt",
        )
    return salt


def _token_ids(value: Any, param: str, served: ServedModel, *, empty: bool = True) -> tuple[int, ...]:
    """A list of token ids of the vocabulary (null: none), sorted and without repeats; `empty` false: an empty
    list is refused (vLLM's `allowed_token_ids`: one that allows nothing)."""
    if value is None:
        return ()
    value = _check_ids(value, param, served)
    if not value and not empty:
        raise ApiError(400, f"{param} must name at least one token", param=param)
    return tuple(sorted(set(value)))


def _check_ids(value: Any, param: str, served: ServedModel) -> list[int]:
    """`value`, a list of token ids of the vocabulary.

    Raises:
        ApiError: 400 naming `param` and what it got: not a list, or the first element that is no such id (its
            index and value).
    """
    expected = f"{param} must be a list of token ids in [0, {served.vocab_size})"
    if type(value) is not list:
        raise ApiError(400, f"{expected}, got {shown(value, quote=ascii)}", param=param)
    ids = []
    for i, token in enumerate(value):
        read = lax_integer(token)  # a list of ints as vLLM reads one: "5" is 5
        if read is None or not 0 <= read < served.vocab_size:
            raise ApiError(400, f"{expected}, got {param}[{i}] = {shown(token, quote=ascii)}", param=param)
        ids.append(read)
    return ids


def prompt_truncation(body: Mapping[str, Any], max_model_len: int | None) -> tuple[int | None, str | None]:
    """vLLM 0.32's `truncate_prompt_tokens` and `truncation_side`, as its request models read them: k, an integer
    (`lax_integer`) >= 1 and at most `max_model_len` (None: no bound), or -1 (as long as the server allows: its
    caller says how long), None where absent or null; and the side, "left" (keep the last k), "right" (keep the
    first k) or None (the tokenizer's own truncation: the last k, the special tokens it adds kept). The one
    reading of the example cluster's gateway and the vLLM router.

    Raises:
        ApiError: 400 naming the field: k no integer, below -1, 0 (vLLM truncates to an empty prompt and refuses
            that) or over `max_model_len` (vLLM's message); a side other than "left" or "right".
    """
    side = body.get("truncation_side")
    if side is not None and side not in ("left", "right"):
        raise ApiError(
            400, f"truncation_side must be 'left' or 'right', got {shown(side, quote=ascii)}", param="truncation_side"
        )
    if body.get("truncate_prompt_tokens") is None:
        return None, side
    k = _integer(body, "truncate_prompt_tokens", 0, -1, MAX_SEED)
    if k == 0:
        raise ApiError(
            400, "truncate_prompt_tokens must be -1 or an integer >= 1, got 0", param="truncate_prompt_tokens"
        )
    if max_model_len is not None and k > max_model_len:
        raise ApiError(
            400,
            f"truncate_prompt_tokens={k} cannot be greater than max_model_len = {max_model_len}. Please request a "
            "smaller truncation size.",
            param="truncate_prompt_tokens",
        )
    return k, side


def _logit_bias(value: Any, served: ServedModel) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`: an object of token ids (as strings) to a bias added to its logit, each clamped to
    [-100, 100] as vLLM clamps it; sorted by id."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ApiError(
            400,
            f"logit_bias must be an object of token ids to numbers, got {shown(value, quote=ascii)}",
            param="logit_bias",
        )
    biases = {}
    for key, bias in value.items():
        try:
            token = int(key)  # as vLLM reads a key: " 12", "+12", "012" too; "12.0" not
        except ValueError:  # not an integer, or past int()'s 4,300 digits
            token = -1
        if not 0 <= token < served.vocab_size:
            raise ApiError(
                400,
                f"logit_bias keys must be token ids in [0, {served.vocab_size}), got {shown(key, quote=ascii)}",
                param="logit_bias",
            )
        number = lax_number(bias)  # as vLLM reads its values (floats)
        if number is None or not math.isfinite(number):
            raise ApiError(
                400, f"logit_bias[{key!r}] must be a number, got {shown(bias, quote=ascii)}", param="logit_bias"
            )
        biases[token] = min(100.0, max(-100.0, number))
    return tuple(sorted(biases.items()))


def _choices(body: Mapping[str, Any]) -> int:
    """`n`, 1 to `MAX_CHOICES` (a `best_of` is ignored as any unknown field, as vLLM 0.32's request models have
    none: they draw `n` choices whatever it says)."""
    return _integer(body, "n", 1, 1, MAX_CHOICES)


def _completion_logprobs(body: Mapping[str, Any]) -> int | None:
    """A completion's `logprobs`: the most probable tokens to list beside each token (0: only its own), None for
    none. A number read as vLLM's int field reads it (`lax_integer`: true is 1, and false 0, each token's own, as
    vLLM answers it); a string is refused, as vLLM's own check refuses it (`_no_string`)."""
    if body.get("logprobs") is None:
        return None
    _no_string(body, "logprobs")
    return _integer(body, "logprobs", 0, 0, MAX_LOGPROBS)


def _no_string(body: Mapping[str, Any], name: str) -> None:
    """vLLM's own check of its log-probability counts (`logprobs`, `top_logprobs`, `prompt_logprobs`), before its
    int fields read them: a string is refused (a number, true and 5.0 too, is then read as an int field).

    Raises:
        ApiError: 400 naming the field, for a string.
    """
    if isinstance(body.get(name), str):
        raise ApiError(400, f"{name} must be an integer, got {shown(body[name], quote=ascii)}", param=name)


def _prompt_logprobs(body: Mapping[str, Any], served: ServedModel, *, stream: bool) -> int | None:
    """vLLM's `prompt_logprobs`: how many of the most probable tokens to list beside each prompt token (0: only its
    own), None for none. vLLM's refusals: a negative count but -1 (the whole vocabulary, over the most this server
    lists, as over vLLM's default `--max-logprobs`), and a count with `stream` (a stream carries no prompt
    log-probabilities: 0 with it is taken, and lists nothing)."""
    given = body.get("prompt_logprobs")
    if given is None:
        return None
    _no_string(body, "prompt_logprobs")
    value = lax_integer(given)
    if value is None:
        raise ApiError(
            400, f"prompt_logprobs must be an integer, got {shown(given, quote=ascii)}", param="prompt_logprobs"
        )
    if value < -1:
        raise ApiError(400, f"prompt_logprobs must be a positive value or -1, got {value}", param="prompt_logprobs")
    if stream and value != 0:
        raise ApiError(400, "prompt_logprobs are not available when stream is true", param="prompt_logprobs")
    if value == -1:
        raise ApiError(
            400,
            f"prompt_logprobs = -1 asks for the whole vocabulary ({served.vocab_size} tokens), more than the most "
            f"this server lists ({MAX_LOGPROBS})",
            param="prompt_logprobs",
        )
    count = _integer(body, "prompt_logprobs", 0, 0, MAX_LOGPROBS)
    return None if stream else count


def prompt_logprobs_json(
    tokens: Sequence[int], scored: Sequence[TokenLogprobs], k: int, token_text: Callable[[int], str]
) -> list[dict[str, dict[str, Any]] | None]:
    """The prompt's log-probabilities as vLLM's answer lists them: null for the first token (nothing before it),
    then per token an object of token ids to `{"logprob", "rank", "decoded_token"}`: the token's own first (its
    rank in the vocabulary), then the `k` most probable (ranks 1 to k; the token among them is listed once).
    -inf is written -9999.0."""
    listed: list[dict[str, dict[str, Any]] | None] = [None]
    for token, entry in zip(tokens[1:], scored, strict=True):
        one = {str(token): _logprob_entry(entry.logprob, entry.rank, token_text(token))}
        for rank, (other, logprob) in enumerate(entry.top[:k], start=1):
            one[str(other)] = _logprob_entry(logprob, rank, token_text(other))
        listed.append(one)
    return listed


def _logprob_entry(logprob: float, rank: int, text: str) -> dict[str, Any]:
    return {"logprob": _floored(logprob), "rank": rank, "decoded_token": text}


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """A chat's `logprobs` (a flag) and `top_logprobs` (how many of the most probable tokens beside each one), as
    one count; vLLM's 400 for a `top_logprobs` above 0 without `logprobs: true`."""
    wanted = _flag(body, "logprobs", default=False)
    _no_string(body, "top_logprobs")
    top = _integer(body, "top_logprobs", 0, 0, MAX_LOGPROBS)
    if top and not wanted:
        raise ApiError(400, "when using top_logprobs, logprobs must be set to true", param="top_logprobs")
    return top if wanted else None


def requested_max_tokens(body: Mapping[str, Any], *, default: int | None, completion: bool) -> int | None:
    """The output a body asks for, as vLLM reads it: a chat's `max_completion_tokens` (OpenAI's newer name) where it
    is not null, else `max_tokens`; a `completion`'s `max_tokens` only (vLLM's `CompletionRequest` has no
    `max_completion_tokens` and ignores one); `default` where none is set (None: the context decides, vLLM's rule
    for a chat; a completion's default is 16 in vLLM). A chat's `max_tokens` beside a `max_completion_tokens` sets
    nothing, but is still typed (vLLM's model declares it `int | None`): any integer, no range.

    Raises:
        ApiError: 400, a limit that is not an integer >= 1 as vLLM reads one (`lax_integer`); a chat's `max_tokens`
            beside `max_completion_tokens` that is no integer.
    """
    limit = output_limit_field(body, completion=completion)
    shadowed = body.get("max_tokens")
    if limit != "max_tokens" and shadowed is not None and lax_integer(shadowed) is None:
        raise ApiError(400, f"max_tokens must be an integer, got {shown(shadowed, quote=ascii)}", param="max_tokens")
    if body.get(limit) is None:
        return default
    return _integer(body, limit, 0, 1, MAX_SEED)


def output_limit_field(body: Mapping[str, Any], *, completion: bool) -> str:
    """The field holding a body's output limit, as vLLM reads it: a chat's `max_completion_tokens` where it is not
    null, else `max_tokens` (a completion's only)."""
    return "max_completion_tokens" if not completion and body.get("max_completion_tokens") is not None else "max_tokens"


def stream_usage(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """What a body's `stream_options` asks for, by vLLM's rules: (a last chunk with the usage, the usage so far
    in every chunk). Both default to false, given `stream_options` or not (vLLM 0.32's `StreamOptions`, read by
    its `should_include_usage`: `{}` asks for no usage; an explicit null is false); the usage in every chunk
    comes only with the last chunk's. Other keys (OpenAI's `include_obfuscation`) are ignored, as vLLM ignores them; an empty
    object is taken without `stream` too (vLLM refuses only options that say something).

    Raises:
        ApiError: 400, stream_options that is not an object, that sets anything without `stream: true`, or
            a flag that is not a boolean.
    """
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not isinstance(options, dict):
        raise ApiError(
            400,
            f'stream_options must be an object such as {{"include_usage": <bool>}}, got {shown(options, quote=ascii)}',
            param="stream_options",
        )
    if not stream_flag(body):
        if options:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        return False, False
    flags = {"include_usage": False, "continuous_usage_stats": False}
    for name in flags.keys() & options.keys():
        try:
            flags[name] = bool(lax_flag(options, name))
        except ApiError:
            raise ApiError(
                400,
                f"stream_options.{name} must be a boolean, got {shown(options[name], quote=ascii)}",
                param="stream_options",
            ) from None
    return flags["include_usage"], flags["include_usage"] and flags["continuous_usage_stats"]


def parse_completion(body: dict[str, Any], served: ServedModel) -> CompletionRequest:
    """Check a `/v1/completions` body (a JSON object).

    Raises:
        ApiError: 400 naming the parameter; 404 `model_not_found` for another model than `served.name`.
    """
    prompt = body.get("prompt")
    batch: tuple[str | tuple[int, ...], ...] = ()
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):  # a batch
        if len(prompt) > MAX_PROMPTS:
            raise ApiError(400, f"a batch holds at most {MAX_PROMPTS} prompts, got {len(prompt)}", param="prompt")
        batch = tuple(_one_prompt(one, served) for one in prompt)
        checked = batch[0]
        batch = batch if len(batch) > 1 else ()  # a batch of one is that prompt
    else:
        checked = _one_prompt(prompt, served)
    echo = _flag(body, "echo", default=False)
    echo_only = echo and _generates_nothing(body)
    if echo_only:
        body = {**body, "max_tokens": 1}
    common = _common(body, COMPLETION_FIELDS, served, chat=False)
    sampling = common["sampling"]
    if echo and sampling.logprobs is not None and sampling.prompt_logprobs is None:
        # The engine scores the prompt then, as vLLM's does (an explicit `prompt_logprobs` count wins).
        common["sampling"] = attrs.evolve(sampling, prompt_logprobs=sampling.logprobs)
    if len(batch or [checked]) * common["n"] > MAX_ANSWER_CHOICES:
        raise ApiError(
            400,
            f"{len(batch)} prompts with n = {common['n']} ask for {len(batch) * common['n']} choices, over this "
            f"server's {MAX_ANSWER_CHOICES} per request",
            param="n",
        )
    return CompletionRequest(prompt=checked, echo=echo, echo_only=echo_only, batch=batch, **common)


def _one_prompt(prompt: Any, served: ServedModel) -> str | tuple[int, ...]:
    """A prompt: a string, or a non-empty list of token ids of the vocabulary."""
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        for i, token in enumerate(prompt):
            if not 0 <= token < served.vocab_size:
                raise ApiError(
                    400,
                    f"prompt token ids must lie in [0, {served.vocab_size}), got {shown(token, quote=ascii)} at index {i}",
                    param="prompt",
                )
        return tuple(prompt)
    if isinstance(prompt, str):
        return _text(prompt, "prompt")
    raise ApiError(400, "prompt must be a string, a list of token ids, or a list of those", param="prompt")


# A chat message's keys that ask for what this server cannot render (tools, audio): refused but at their neutral
# value, which clients send when they append an answer's message to the conversation as the SDK dumps it
# (`function_call: null`, `audio: null`). Every other key goes to the chat template's reader (`chat_conversation`),
# which keeps those vLLM hands a template (`name`, a tool's `tool_call_id`, an assistant's `reasoning`) and drops
# the rest (OpenAI's `refusal`, `annotations`, a client's own), as vLLM's message types do.
MESSAGE_UNRENDERED: dict[str, Callable[[Any], bool]] = {
    "tool_calls": _empty,
    "function_call": _absent,
    "audio": _absent,
}


def parse_chat(body: dict[str, Any], served: ServedModel) -> ChatRequest:
    """Check a `/v1/chat/completions` body (a JSON object).

    Raises:
        ApiError: 400 naming the parameter (`messages[i]`...; `context_length_exceeded` for more messages than
            the prompt limit could hold); 404 `model_not_found`.
    """
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > served.max_prompt_tokens:
        # Each message adds tokens: checking them all would be wasted.
        raise ApiError(
            400,
            f"{len(messages)} messages exceed the prompt limit of {served.max_prompt_tokens} tokens",
            param="messages",
            code="context_length_exceeded",
        )
    rendering = _chat_rendering(body)
    documents = _documents(body.get("documents"))
    if documents is not None:  # over a `chat_template_kwargs` one, as vLLM merges them
        rendering["template_variables"] = {**rendering["template_variables"], "documents": documents}
    return ChatRequest(**rendering, **_common(body, CHAT_FIELDS, served, chat=True))


def _documents(value: Any) -> list[dict[str, str]] | None:
    """vLLM's `documents` (a chat's, for retrieval-augmented templates): a list of objects of strings, handed to
    the chat template as its `documents` variable; None where absent or null."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(one, dict) and all(isinstance(v, str) for v in one.values()) for one in value
    ):
        raise ApiError(
            400, f"documents must be a list of objects of strings, got {shown(value, quote=ascii)}", param="documents"
        )
    return [dict(one) for one in value]


def _chat_rendering(body: Mapping[str, Any]) -> dict[str, Any]:
    """What renders a chat's prompt, checked: its `messages` and vLLM's `chat_template_kwargs`,
    `add_generation_prompt` and `continue_final_message` (a generation's and /tokenize's alike)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    checked = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            got = (
                f"role {shown(message.get('role'), quote=ascii)}"
                if isinstance(message, dict)
                else shown(message, quote=ascii)
            )
            raise ApiError(400, f"{where} needs a role ({', '.join(ROLES)}), got {got}", param=where)
        if message.get("name") is not None:
            _text(message["name"], f"{where}.name")
        for key, neutral in MESSAGE_UNRENDERED.items():  # tools are not served (`tools` is refused), nor audio
            if not neutral(message.get(key)):
                raise ApiError(
                    400,
                    f"{where}.{key} = {shown(message[key], quote=ascii)} is not supported by this server",
                    param=where,
                )
        content = message.get("content")
        try:  # what counts as a message's text is the reader's (vLLM's) rule, the vLLM router's too
            text = content_text(content)
        except InvalidRequestError as error:  # a content that is no text (an image part, a number)
            raise ApiError(400, f"{where}.{error}", param=f"{where}.content") from None
        _text(text, f"{where}.content")  # text UTF-8 can encode (no lone surrogate)
        fields = {key: value for key, value in message.items() if key not in ("role", "content")}
        checked.append(ChatMessage(role=message["role"], content=content, fields=fields))
    add_generation_prompt = _flag(body, "add_generation_prompt", default=True)
    continue_final_message = _flag(body, "continue_final_message", default=False)
    if add_generation_prompt and continue_final_message:  # vLLM's 400
        raise ApiError(
            400,
            "Cannot set both continue_final_message and add_generation_prompt to true",
            param="continue_final_message",
        )
    return {
        "messages": tuple(checked),
        "template_variables": _template_variables(body.get("chat_template_kwargs")),
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
    }


def _template_variables(value: Any) -> dict[str, Any]:
    """`chat_template_kwargs`: an object of variables for the template, merged as vLLM merges them: under the
    request's own `add_generation_prompt` and `continue_final_message`, so a variable of either name is dropped;
    `messages` (the rest of `CHAT_INPUTS`, what `Tokenizer.render_chat` sets itself) and `tools` are refused (the
    template's own, `raise_exception` and the special tokens, are refused when it renders)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ApiError(
            400,
            f"chat_template_kwargs must be an object, got {shown(value, quote=ascii)}",
            param="chat_template_kwargs",
        )
    # vLLM 0.32 renders with `merge_kwargs(chat_template_kwargs, {add_generation_prompt, continue_final_message,
    # documents, ...})` (`ChatCompletionRequest.build_chat_params`): a request field that is set wins over a variable
    # of its name, and these two flags are never null, so they always win. `documents` may come this way (a
    # top-level one wins: `parse_chat`). Tools are refused here as at the top level (rendered but never called).
    flags = ("add_generation_prompt", "continue_final_message")
    taken = sorted(({*CHAT_INPUTS, "tools"} - set(flags)) & set(value))
    if taken:
        raise ApiError(
            400,
            f"chat_template_kwargs may not set {', '.join(taken)} (the request's own)",
            param="chat_template_kwargs",
        )
    return {name: variable for name, variable in value.items() if name not in flags}


def encoded(
    request: CompletionRequest | ChatRequest, tokenizer: ServingTokenizer, *, max_prompt_tokens: int | None = None
) -> tuple[list[int], str]:
    """The request's prompt as tokens and the field it came from (a chat's text rendered by the chat template, then
    tokenized; token ids as they are). With `max_prompt_tokens`, a text that certainly has more tokens
    (`ServingTokenizer.fewest_tokens`) is refused before it is tokenized, which takes seconds for megabytes; else no
    limit is checked.

    Raises:
        ApiError: 400 for messages the chat template refuses; 400 `context_length_exceeded` for a text over
            `max_prompt_tokens`.
    """
    if isinstance(request, ChatRequest):
        try:
            text = tokenizer.render_chat(
                [m.as_message() for m in request.messages],
                variables=request.template_variables,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
            )
        except InvalidRequestError as error:  # the checkpoint's chat template refused the messages
            raise ApiError(400, str(error), param="messages") from error
        param = "messages"
        _text(text, param)  # a message's `name` or `tool_call_id` may hold a lone surrogate, which cannot be encoded
    elif isinstance(request.prompt, tuple):
        return list(request.prompt), "prompt"
    else:
        text, param = request.prompt, "prompt"
    if max_prompt_tokens is not None and (fewest := tokenizer.fewest_tokens(text)) > max_prompt_tokens:
        raise _over_prompt_limit(fewest, max_prompt_tokens, param, at_least=True)
    return tokenizer.encode(text, add_special_tokens=request.sampling.add_special_tokens), param


def _over_prompt_limit(num_tokens: int, max_prompt_tokens: int, param: str, *, at_least: bool = False) -> ApiError:
    """The answer to a prompt of `num_tokens` tokens (`at_least`: or more) over the limit."""
    has = f"at least {num_tokens}" if at_least else str(num_tokens)
    return ApiError(
        400,
        f"the prompt has {has} tokens, over this server's limit of {max_prompt_tokens}",
        param=param,
        code="context_length_exceeded",
    )


def _truncated(
    request: CompletionRequest | ChatRequest, tokenizer: ServingTokenizer, tokens: list[int], k: int
) -> list[int]:
    """`k` of the prompt's tokens, as vLLM truncates it. With a `truncation_side` the tokens are cut plainly: the
    last k ("left") or the first k ("right"). Without one the tokenizer truncates (vLLM's tokenizers truncate on the
    left for generation): a text the tokenizer added special tokens to (a BOS) keeps them and loses its own tokens
    from the left; token ids, or a text whose specials leave no room, are cut plainly."""
    side = request.output.truncation_side
    if side == "right":
        return tokens[:k]
    ids = isinstance(request, CompletionRequest) and isinstance(request.prompt, tuple)
    if side is None and request.sampling.add_special_tokens and not ids:
        bare = attrs.evolve(request, sampling=attrs.evolve(request.sampling, add_special_tokens=False))
        text, _ = encoded(bare, tokenizer)
        added = len(tokens) - len(text)
        for start in range(added + 1):  # where the text's tokens sit among the specials
            if tokens[start : start + len(text)] == text:
                if k > added:
                    return tokens[:start] + text[len(text) - (k - added) :] + tokens[start + len(text) :]
                break
    return tokens[-k:]


# /tokenize's fields beside `model`, `add_special_tokens` and `return_token_strs` (vLLM's `TokenizeCompletionRequest`
# and `TokenizeChatRequest`); a chat's that this server does not render are refused but at their neutral value.
TOKENIZE_UNRENDERED = ("tools", "chat_template")


def parse_tokenize(body: Mapping[str, Any], served: ServedModel) -> tuple[CompletionRequest | ChatRequest, bool]:
    """`POST /tokenize`'s body as vLLM's `TokenizeCompletionRequest` (`prompt`, a string) or, with `messages`, its
    `TokenizeChatRequest` reads it (the messages and what renders them, as a chat's: `_chat_rendering`), each with
    `model`, `add_special_tokens` (vLLM's defaults: true for a prompt, false for a chat) and `return_token_strs`.
    Only those fields are read: a generation's (`max_tokens`...) are ignored, and no prompt limit applies (a client
    asks in order to measure its prompt). The request is returned with its sampling options at their defaults.

    Raises:
        ApiError: 400 naming the field, for a `prompt` that is no string, messages a chat refuses, a boolean field
            that is no boolean, `tools` or `chat_template` set; 404 `model_not_found`.
    """
    _check_model(body, served)
    token_strs = _flag(body, "return_token_strs", default=False)
    chat = "messages" in body
    sampling = SamplingOptions(max_tokens=None, add_special_tokens=_flag(body, "add_special_tokens", default=not chat))
    if not chat:
        prompt = _text(body.get("prompt"), "prompt")
        return CompletionRequest(model=served.name, prompt=prompt, sampling=sampling), token_strs
    for name in TOKENIZE_UNRENDERED:
        if not UNSUPPORTED[name](body.get(name)):
            raise ApiError(
                400, f"{name} = {shown(body[name], quote=ascii)} is not supported by this server", param=name
            )
    return ChatRequest(model=served.name, sampling=sampling, **_chat_rendering(body)), token_strs


def tokenize_body(
    request: CompletionRequest | ChatRequest,
    tokenizer: ServingTokenizer,
    served: ServedModel,
    *,
    token_strs: bool = False,
) -> dict[str, Any]:
    """`POST /tokenize`, as vLLM answers it: the prompt's (or the templated chat's) tokens, their count and the
    length a prompt plus its `max_tokens` may take (`/v1/models`' `max_model_len`); with `token_strs` (vLLM's
    `return_token_strs`) each token's vocabulary string too, else null. A prompt over the limits is tokenized
    all the same: a client asks in order to measure it. A batch of prompts is a 400 (one at a time, as vLLM's)."""
    if isinstance(request, CompletionRequest) and request.batch:
        raise ApiError(400, "/tokenize takes one prompt, not a batch", param="prompt")
    tokens, _param = encoded(request, tokenizer)
    max_model_len = models_body(served)["data"][0]["max_model_len"]
    pieces = [tokenizer.piece(token) for token in tokens] if token_strs else None
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens, "token_strs": pieces}


def detokenize_body(body: Mapping[str, Any], tokenizer: ServingTokenizer, served: ServedModel) -> dict[str, Any]:
    """`POST /detokenize`, as vLLM answers it: `{"prompt": text}` of every id of `body["tokens"]`, special ones
    and stop ids (a checkpoint's EOS) included, as the tokenizer's `decode` renders them (vLLM's
    `tokenizer.decode(tokens)`). Not a generation's `TextStream`: that one ends at the first stop id.

    Raises:
        ApiError: 400 when `tokens` is not a list of ids of the vocabulary (naming the first that is not); 404 for
            another model.
    """
    _check_model(body, served)
    return {"prompt": tokenizer.decode(_check_ids(body.get("tokens"), "tokens", served))}


def prompt_tokens(
    request: CompletionRequest | ChatRequest, tokenizer: ServingTokenizer, served: ServedModel
) -> list[int]:
    """The request's prompt as tokens (a chat through the chat template; token ids as they are).

    Raises:
        ApiError: 400 for an empty prompt or messages the chat template refuses; 400 `context_length_exceeded`
            over `max_prompt_tokens` (a text certainly over it before it is tokenized: `encoded`). A `max_tokens`
            within the context but past what the prompt leaves of it is trimmed, not refused (`generation_limit`,
            as vLLM 0.32); one over the whole context was refused when the body was parsed (`check_output_limit`).
    """
    k = request.output.truncate_prompt_tokens
    # A truncated prompt may be any length: only its last k tokens count, which needs them all.
    tokens, param = encoded(request, tokenizer, max_prompt_tokens=served.max_prompt_tokens if k is None else None)
    if not tokens:
        raise ApiError(400, "the prompt is empty", param=param)
    if k is not None and len(tokens) > k:  # before any bound, as vLLM truncates
        tokens = _truncated(request, tokenizer, tokens, k)
    if len(tokens) > served.max_prompt_tokens:
        raise _over_prompt_limit(len(tokens), served.max_prompt_tokens, param)
    return tokens


def check_output_limit(max_tokens: int, max_model_len: int, param: str, *, limit_name: str | None = None) -> None:
    """vLLM 0.32's refusal of an output longer than the whole context (`TokenizeParams`, checked before the prompt is
    rendered): a `max_tokens` over `max_model_len` fits beside no prompt, so it is a 400 naming the field that asked
    for it (`output_limit_field`), never trimmed; one at most `max_model_len` is trimmed to what the prompt leaves
    (`max_tokens_within`). The vLLM router's bound is its servers' longest `max_model_len`, named so in vLLM's words.
    The gateway's is `[decode] max_context_tokens`, the bound of a prompt and its output together (the prompt's own
    bound, `max_prompt_tokens`, is checked apart, as vLLM checks a prompt against its context), which it names by
    `limit_name`: the `max_model_len` it advertises (`models_body`) is the smaller of the two, and no error may call
    another number by that name.

    Raises:
        ApiError: 400, `max_tokens > max_model_len`, with vLLM's message (naming the bound `limit_name`, where given,
            and its value).
    """
    if max_tokens > max_model_len:
        bound = f"max_model_len={max_model_len}" if limit_name is None else f"{limit_name}={max_model_len}"
        raise ApiError(
            400,
            f"{param}={max_tokens} cannot be greater than {bound}. Please request fewer output tokens.",
            param=param,
        )


def max_tokens_within(max_tokens: int, num_prompt_tokens: int, max_context_tokens: int) -> int:
    """`max_tokens` trimmed to what a prompt of `num_prompt_tokens` leaves of the context, as vLLM 0.32 trims it
    (`get_max_tokens`: a prompt that fits is served, its output cut at the context's end with finish_reason
    "length"), rather than refused: the one rule of the example cluster's gateway and the vLLM router. A
    `max_tokens` over the whole context is vLLM's 400 before this (`check_output_limit`).

    Raises:
        ApiError: 400 where the prompt leaves no room for a token (vLLM's `SamplingParams` answer to the
            `max_tokens` 0 it then computes).
    """
    room = max_context_tokens - num_prompt_tokens
    if room <= 0:
        raise ApiError(400, "max_tokens must be at least 1, got 0.", param="max_tokens")
    return min(max_tokens, room)


def generation_limit(sampling: SamplingOptions, num_prompt_tokens: int, served: ServedModel) -> SamplingOptions:
    """`sampling` with its `max_tokens` settled: one given (at most the context: parsing refused more,
    `check_output_limit`) is trimmed to what the context leaves after the prompt of `num_prompt_tokens`
    (`max_tokens_within`); a chat that set none may generate what the context leaves (vLLM's
    chat default: `max_model_len` minus the prompt), at most `served.default_chat_max_tokens` where the
    checkpoint's generation config sets one (vLLM's `get_max_tokens`). What the context leaves is at least
    `default_max_tokens`, since the config keeps the longest prompt and that default within it.

    Raises:
        ApiError: 400, a `min_tokens` over what the context leaves (vLLM's answer).
    """
    if sampling.max_tokens is not None:
        trimmed = max_tokens_within(sampling.max_tokens, num_prompt_tokens, served.max_context_tokens)
        if trimmed == sampling.max_tokens:
            return sampling
        if sampling.min_tokens > trimmed:  # vLLM's SamplingParams check, on the trimmed value
            raise ApiError(400, _min_over_max(sampling.min_tokens, trimmed), param="min_tokens")
        return attrs.evolve(sampling, max_tokens=trimmed)
    left = served.max_context_tokens - num_prompt_tokens
    if served.default_chat_max_tokens is not None:
        left = min(left, served.default_chat_max_tokens)
    if sampling.min_tokens > left:
        raise ApiError(400, _min_over_max(sampling.min_tokens, left), param="min_tokens")
    return attrs.evolve(sampling, max_tokens=left)


def _min_over_max(min_tokens: int, max_tokens: int) -> str:
    return f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}"


# ---------------------------------------------------------------------------------------------- answers


@attrs.frozen(kw_only=True)
class Usage:
    """OpenAI's usage record; `cached_tokens`: the prompt tokens whose KV came from a cache."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class Logprobs:
    """A request's tokens' log-probabilities in OpenAI's shape, a part at a time (each call to `take` gives those
    of the tokens it is given, for one answer or one chunk).

    A completion's (`chat` false) are four parallel lists, as vLLM writes them: `tokens` (each token's text),
    `token_logprobs`, `top_logprobs` (per token, an object of the token's own and the `k` most probable tokens'
    log-probabilities by text: k + 1 entries at most) and `text_offset` (where each token's text starts, summing
    the texts before it, across the parts). A chat's are `{"content": [{"token", "logprob", "bytes",
    "top_logprobs": [{"token", "logprob", "bytes"}: the k most probable, most probable first]}]}`.

    A token's text is `token_text`'s (the tokenizer's text of the lone token, as vLLM shows it); a log-probability
    of -inf is written -9999.0, as OpenAI and vLLM write it.
    """

    def __init__(self, *, chat: bool, k: int, token_text: Callable[[int], str]) -> None:
        self.chat, self.k, self.token_text = chat, k, token_text
        self._offset = 0  # a completion's next text offset

    def take(self, tokens: Sequence[tuple[int, TokenLogprobs | None]]) -> dict[str, Any]:
        """The log-probabilities of (token, its log-probabilities) pairs, in order (None where the engine sent
        none: a null log-probability, as vLLM writes a token without them)."""
        return self._chat(tokens) if self.chat else self._completion(tokens)

    def _completion(self, tokens: Sequence[tuple[int, TokenLogprobs | None]]) -> dict[str, Any]:
        texts, logprobs, tops, offsets = [], [], [], []
        for token, entry in tokens:
            text = self.token_text(token)
            texts.append(text)
            offsets.append(self._offset)
            self._offset += len(text)
            if entry is None:
                logprobs.append(None)
                tops.append(None)
                continue
            logprobs.append(_floored(entry.logprob))
            top = {text: _floored(entry.logprob)}  # the token's own first, as vLLM lists it
            for other, logprob in entry.top[: self.k]:
                top[self.token_text(other)] = _floored(logprob)
            tops.append(top)
        return {"text_offset": offsets, "token_logprobs": logprobs, "tokens": texts, "top_logprobs": tops}

    def _chat(self, tokens: Sequence[tuple[int, TokenLogprobs | None]]) -> dict[str, Any]:
        content = []
        for token, entry in tokens:
            item = self._chat_item(token, None if entry is None else entry.logprob)
            item["top_logprobs"] = [] if entry is None else [self._chat_item(t, lp) for t, lp in entry.top[: self.k]]
            content.append(item)
        return {"content": content}

    def _chat_item(self, token: int, logprob: float | None) -> dict[str, Any]:
        text = self.token_text(token)
        return {
            "token": text,
            "logprob": None if logprob is None else _floored(logprob),
            "bytes": list(text.encode("utf-8", errors="replace")),
        }


def _floored(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


@attrs.frozen(kw_only=True)
class Choice:
    """One choice of a whole answer: its text, why it ended ("length" or "stop"; `stop_reason`: the stop string or
    the request's stop token id that ended it, as vLLM names it) and its log-probabilities (`Logprobs`' JSON;
    None where none were asked)."""

    text: str
    finish_reason: str
    stop_reason: str | int | None = None
    logprobs: dict[str, Any] | None = None
    token_ids: tuple[int, ...] | None = None  # the tokens generated, where `return_token_ids` asked for them
    # What vLLM shows of the choice's prompt: its log-probabilities (`prompt_logprobs_json`; null where not
    # asked) and token ids (where `return_token_ids` asked).
    prompt_logprobs: list[Any] | None = None
    prompt_token_ids: tuple[int, ...] | None = None

    def prompt_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"prompt_logprobs": self.prompt_logprobs}
        if self.prompt_token_ids is not None:
            fields["prompt_token_ids"] = list(self.prompt_token_ids)
        return fields


@attrs.frozen(kw_only=True)
class Completion:
    """A whole answer: its choices (a request's `n` for each of its prompts, in index order) and the usage of
    them all. What vLLM shows of the prompt goes in each choice of a completion (each its own prompt's) and once
    in a chat's answer."""

    reply: Reply
    choices: tuple[Choice, ...]
    usage: Usage

    def to_json(self) -> dict[str, Any]:
        choices = []
        for index, one in enumerate(self.choices):
            choice: dict[str, Any] = {
                "index": index,
                "finish_reason": one.finish_reason,
                "stop_reason": one.stop_reason,
                "logprobs": one.logprobs,
            }
            if self.reply.chat:
                choice["message"] = {"role": "assistant", "content": one.text}
            else:
                choice["text"] = one.text
                choice.update(one.prompt_fields())
            if one.token_ids is not None:
                choice["token_ids"] = list(one.token_ids)
            choices.append(choice)
        body = {**self.reply.header(chunk=False), "choices": choices, "usage": self.usage.to_json()}
        return {**body, **self.choices[0].prompt_fields()} if self.reply.chat else body


@attrs.frozen(kw_only=True)
class Chunk:
    """One server-sent event of a stream: some text, the finish reason of the last, or only the usage
    (`usage_only`); `usage` beside a choice is the usage so far (`continuous_usage_stats`); `logprobs` those of
    the tokens that came since the choice's last chunk."""

    reply: Reply
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    role: bool = False  # a chat's first text chunk carries the assistant's role
    usage: Usage | None = None
    usage_only: bool = False
    logprobs: dict[str, Any] | None = None
    index: int = 0  # the choice it belongs to (a request's `n`)
    # `return_token_ids`: the tokens since the choice's last chunk, and the prompt's in a choice's first chunk.
    token_ids: tuple[int, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        usage = {} if self.usage is None else {"usage": self.usage.to_json()}
        if self.usage_only:
            return {**self.reply.header(chunk=True), "choices": [], **usage}
        prompt = {} if self.prompt_token_ids is None else {"prompt_token_ids": list(self.prompt_token_ids)}
        if self.reply.chat:
            delta: dict[str, Any] = {} if self.text is None else {"content": self.text}
            if self.role:
                delta["role"] = "assistant"
            choice: dict[str, Any] = {"index": self.index, "delta": delta}
        else:
            choice = {"index": self.index, "text": self.text or "", **prompt}
        choice.update(finish_reason=self.finish_reason, stop_reason=self.stop_reason, logprobs=self.logprobs)
        if self.token_ids is not None:
            choice["token_ids"] = list(self.token_ids)
        header = self.reply.header(chunk=True)
        return (
            {**header, **prompt, "choices": [choice], **usage}
            if self.reply.chat
            else {**header, "choices": [choice], **usage}
        )

    def to_sse(self) -> bytes:
        return b"data: " + json.dumps(self.to_json()).encode() + b"\n\n"


@attrs.frozen(kw_only=True)
class Reply:
    """One request's answer header: `name` (its id), `created` (Unix seconds), the model, chat or not."""

    name: str
    created: int
    model: str
    chat: bool

    def header(self, *, chunk: bool) -> dict[str, Any]:
        """The fields every answer body opens with."""
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.name, "object": kind, "created": self.created, "model": self.model}

    def completion(
        self,
        text: str,
        finish_reason: str,
        usage: Usage,
        stop_reason: str | int | None = None,
        logprobs: dict[str, Any] | None = None,
    ) -> Completion:
        """A one-choice answer."""
        choice = Choice(text=text, finish_reason=finish_reason, stop_reason=stop_reason, logprobs=logprobs)
        return Completion(reply=self, choices=(choice,), usage=usage)

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        *,
        stop_reason: str | int | None = None,
        role: bool = False,
        usage: Usage | None = None,
        logprobs: dict[str, Any] | None = None,
        index: int = 0,
        token_ids: tuple[int, ...] | None = None,
        prompt_token_ids: tuple[int, ...] | None = None,
    ) -> Chunk:
        return Chunk(
            reply=self,
            text=text,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            role=role,
            usage=usage,
            logprobs=logprobs,
            index=index,
            token_ids=token_ids,
            prompt_token_ids=prompt_token_ids,
        )

    def usage_chunk(self, usage: Usage) -> Chunk:
        return Chunk(reply=self, usage=usage, usage_only=True)


def models_body(served: ServedModel, *, created: int = 0) -> dict[str, Any]:
    """`GET /v1/models`: the one served model, with the fields vLLM adds (`max_model_len`, `root`, `parent`,
    `permission`) for the tools that read them. A vLLM client takes `max_model_len` as the bound of a prompt plus
    its `max_tokens`; here the prompt alone has a lower one (`max_prompt_tokens`), so the length advertised is the
    longest that every such split fits: the smaller of the two (a request within it is never refused for length)."""
    model = {
        "id": served.name,
        "object": "model",
        "created": created,  # Unix seconds: vLLM's answer's time
        "owned_by": "mooncake",
        "root": served.name,
        "parent": None,
        "max_model_len": min(served.max_prompt_tokens, served.max_context_tokens),
        "permission": [],
    }
    return {"object": "list", "data": [model]}
