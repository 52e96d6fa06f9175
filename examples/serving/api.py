"""The OpenAI API's shapes: what a request body may hold, and the bodies of the answers.

`parse_request` checks a `/v1/completions` or `/v1/chat/completions` body and
tokenizes its prompt (chat messages through `chat_prompt`); any violation is an
`HttpError` naming the field: 400 for a bad value, 413 for a prompt over
`[limits] max_prompt_tokens`. A `Reply` shapes the answers of one request: the
whole completion, the server-sent-event chunks of a stream (the first carrying
the assistant's role), and the final usage chunk of `stream_options.include_usage`.
Errors are OpenAI's `{"error": {message, type, param, code}}`.

Nothing here touches the Conductor, the workers or the event loop.
"""

from __future__ import annotations

import json
import math
from typing import Any

import attrs
from aiohttp import web

from serving.config import LimitsSection
from serving.tokenizer import ByteTokenizer, chat_prompt

__all__ = ["CompletionRequest", "HttpError", "Reply", "parse_request", "usage"]


class HttpError(Exception):
    """An error answer: status, OpenAI-style type, message, the offending field."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


@attrs.frozen(kw_only=True)
class CompletionRequest:
    """A checked request body: the prompt's tokens and the sampling and streaming options."""

    tokens: list[int]
    max_tokens: int
    temperature: float
    seed: int
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with no choices and the usage


def parse_request(
    body: Any, *, chat: bool, tokenizer: ByteTokenizer, limits: LimitsSection, max_context_tokens: int
) -> CompletionRequest:
    """Check a request body (parsed JSON) and tokenize its prompt.

    Args:
        body: the parsed JSON body.
        chat: a chat completion (`messages`) rather than a completion (`prompt`).
        tokenizer: turns the prompt's text into tokens.
        limits: the prompt limit and the default `max_tokens`.
        max_context_tokens: a request's whole context on a decode engine; `max_tokens` may use what the
            longest prompt leaves of it.

    Raises:
        HttpError: 400 naming the field, or 413 for a prompt over `limits.max_prompt_tokens`.
    """
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise HttpError(400, "messages must be a non-empty list", param="messages")
        for i, message in enumerate(messages):
            if (
                not isinstance(message, dict)
                or not isinstance(message.get("content"), str)
                or message.get("role") not in ("system", "user", "assistant")
            ):
                raise HttpError(
                    400,
                    f"messages[{i}] needs a role (system, user, assistant) and a string content",
                    param=f"messages[{i}]",
                )
        text = chat_prompt(messages)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise HttpError(400, "prompt must be a string", param="prompt")
        text = prompt
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", limits.default_max_tokens))
    ceiling = max_context_tokens - limits.max_prompt_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= ceiling:
        raise HttpError(400, f"max_tokens must be an integer in [1, {ceiling}], got {max_tokens!r}", param="max_tokens")
    temperature = body.get("temperature", 0.0)
    if temperature is None:
        temperature = 0.0
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, int | float)
        or not 0 <= temperature <= 2
        or not math.isfinite(temperature)
    ):
        raise HttpError(400, f"temperature must be a number in [0, 2], got {temperature!r}", param="temperature")
    seed = body.get("seed", 0)
    if seed is None:
        seed = 0
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise HttpError(400, f"seed must be an integer >= 0, got {seed!r}", param="seed")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise HttpError(400, f"stream must be a boolean, got {stream!r}", param="stream")
    tokens = tokenizer.encode(text)
    if not tokens:
        raise HttpError(400, "the prompt is empty", param="messages" if chat else "prompt")
    if len(tokens) > limits.max_prompt_tokens:
        raise HttpError(
            413,
            f"the prompt has {len(tokens)} tokens, over the limit of {limits.max_prompt_tokens}",
            param="messages" if chat else "prompt",
        )
    options = body.get("stream_options") or {}
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    return CompletionRequest(
        tokens=tokens,
        max_tokens=max_tokens,
        temperature=float(temperature),
        seed=seed,
        stream=stream,
        include_usage=include_usage,
    )


def usage(*, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage record; `cached_tokens`: the prompt tokens whose KV came from a cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@attrs.frozen(kw_only=True)
class Reply:
    """The answer bodies of one request: `name` (its id), `created` (Unix seconds), the model, chat or not."""

    name: str
    created: int
    model: str
    chat: bool

    def whole(self, text: str, usage: dict[str, Any]) -> dict[str, Any]:
        """The completion answered at once (every answer ends by length: there is no stop sequence)."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": self.name,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        }

    def chunk(self, text: str | None, finish: str | None, *, first: bool) -> bytes:
        """One server-sent event of a stream; a chat's `first` chunk with text carries the role."""
        if self.chat:
            delta: dict[str, Any] = {"content": text} if text is not None else {}
            if text is not None and first:
                delta["role"] = "assistant"
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        return self._event({"choices": [choice]})

    def usage_chunk(self, usage: dict[str, Any]) -> bytes:
        """The last event of a stream with `include_usage`: no choices, the usage."""
        return self._event({"choices": [], "usage": usage})

    def _event(self, fields: dict[str, Any]) -> bytes:
        data = {
            "id": self.name,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            **fields,
        }
        return f"data: {json.dumps(data)}\n\n".encode()
