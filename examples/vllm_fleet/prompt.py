"""A request's prompt as the vLLM servers will see it: the token ids the router keys and plans it by.

A completion's prompt is its text through the servers' tokenizer, or its token
ids (a batch: its first prompt). A chat's goes through the chat template with
the inputs vLLM's server (0.32) gives it (`ChatCompletionRequest.build_chat_params`
and the renderer's defaults): the messages as vLLM reads them
(`Tokenizer.render_chat`: text parts joined, developer messages as system ones
where the template lacks that role), `add_generation_prompt` (true unless the
body says), `continue_final_message`, `documents`, `reasoning_effort` (and
`enable_thinking` from it, unless the body's `chat_template_kwargs` sets it),
`tools` as vLLM's request model writes them back (`type` and `function` with
its `name`, `description`, `parameters`, and `strict` / `defer_loading` where
given; other keys dropped), and the body's `chat_template_kwargs` over the
tools but under the body's own fields. So the router's block keys are the
server's, and its prefix-cache matches real.

`add_special_tokens` is read as vLLM reads it (a BOS and the like around the
prompt: true by default for a completion, false for a chat, whose template
writes its own), and `truncate_prompt_tokens` keeps k of the prompt's tokens,
the last ones, or the first with `truncation_side: "right"` (-1: vLLM's
`max_truncation_tokens`, `max_model_len` less the one token it keeps back for
a request that asks for output); a text truncated so is `approximate` (vLLM's
tokenizer truncates around the special tokens it adds, which a cut of the ids
here need not match), token ids, or any prompt with a side, are cut exactly.

Where the router cannot render a chat the server may accept (a part that is no
text, for a multimodal model; a template variable the renderer here refuses; a
template this renderer fails on), the prompt is `approximate`: the messages'
texts alone. The request is still routed and forwarded, and the server answers
it (its own 400 where it refuses it too); the router's estimates for it are
rough and it teaches the prefill model nothing.
"""

from __future__ import annotations

from typing import Any

import attrs
from serving.api import ApiError, lax_flag, lax_integer, output_limit_field, prompt_truncation

from mooncake.engine.tokenizer import Tokenizer
from mooncake.errors import MooncakeError

__all__ = ["Prompt", "chat_variables", "prompt_of", "tool_dicts"]


@attrs.frozen
class Prompt:
    """The prompt's token ids, and whether they are only `approximate` (the chat template could not be applied
    here)."""

    tokens: list[int]
    approximate: bool = False


def tool_dicts(tools: Any) -> Any:
    """The body's `tools` as vLLM's request model dumps them for the template (`ChatCompletionToolsParam`):
    `{"type": "function", "function": {"name", "description", "parameters"[, "strict"][, "defer_loading"]}
    [, "defer_loading"]}`, nulls where the client left a field out; a malformed list as given (the server refuses
    it)."""
    if not isinstance(tools, list) or not all(
        isinstance(tool, dict) and isinstance(tool.get("function"), dict) for tool in tools
    ):
        return tools
    dumped = []
    for tool in tools:
        given = tool["function"]
        function = {key: given.get(key) for key in ("name", "description", "parameters")}
        defer = tool.get("defer_loading")
        for key in ("strict", "defer_loading"):
            value = given.get(key, defer if key == "defer_loading" else None)
            if value is not None:
                function[key] = value
        dumped.append(
            {"type": "function", "function": function, **({"defer_loading": defer} if defer is not None else {})}
        )
    return dumped


def _merged(defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `merge_kwargs`: the overrides that are set (neither null nor "auto") over the defaults."""
    return defaults | {key: value for key, value in overrides.items() if value is not None and value != "auto"}


def chat_variables(body: dict[str, Any]) -> dict[str, Any]:
    """The chat template's inputs for a chat body, as vLLM's server merges them (see the module docstring)."""
    given = body.get("chat_template_kwargs")
    kwargs = dict(given) if isinstance(given, dict) else {}
    fields = {
        "add_generation_prompt": body.get("add_generation_prompt", True),
        "continue_final_message": body.get("continue_final_message", False),
        "documents": body.get("documents"),
        "reasoning_effort": body.get("reasoning_effort"),
    }
    if fields["reasoning_effort"] is not None and "enable_thinking" not in kwargs:
        fields["enable_thinking"] = fields["reasoning_effort"] != "none"
    tools = tool_dicts(body.get("tools"))
    return _merged({"tools": tools} if tools is not None else {}, _merged(kwargs, fields))


def _texts(messages: list[Any]) -> str:
    """The text the messages hold, however their parts are shaped (an approximate prompt's)."""
    texts = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        parts = content if isinstance(content, list) else [content]
        for part in parts:
            text = part.get("text") if isinstance(part, dict) else part
            if isinstance(text, str):
                texts.append(text)
    return "\n".join(texts)


def prompt_of(tokenizer: Tokenizer, body: dict[str, Any], *, chat: bool, max_model_len: int | None = None) -> Prompt:
    """The prompt of a completion or chat body as the servers will see it (see the module docstring):
    `max_model_len` bounds `truncate_prompt_tokens` and is what -1 truncates to (less one where the request asks
    for output tokens; None: no bound, and no truncation for -1).

    Raises:
        ApiError: 400, no prompt (a completion's `prompt` neither a non-empty string nor token ids) or no messages
            (a chat's `messages` not a non-empty list), an `add_special_tokens` that is no boolean, or a truncation
            vLLM refuses (`prompt_truncation`, the gateway's reading): vLLM's 400 too.
    """
    limit, side = prompt_truncation(body, max_model_len)
    whole = _whole_prompt(tokenizer, body, chat=chat)
    if limit == -1:  # vLLM's `max_truncation_tokens`
        limit = None if max_model_len is None else max_model_len - _asks_for_output(body, chat=chat)
    if limit is None or len(whole.tokens) <= limit:
        return whole
    ids = not chat and isinstance(body.get("prompt"), list) and all(type(t) is int for t in body["prompt"])
    kept = whole.tokens[:limit] if side == "right" else whole.tokens[len(whole.tokens) - limit :]
    # With a side vLLM cuts the whole prompt's tokens as here; without, its tokenizer cuts a text around its specials.
    return Prompt(kept, approximate=whole.approximate or (side is None and not ids))


def _asks_for_output(body: dict[str, Any], *, chat: bool) -> bool:
    """Whether vLLM counts the request as asking for output tokens when it truncates (its `max_output_tokens`,
    nonzero): a chat's `max_completion_tokens` or else `max_tokens`, a completion's `max_tokens` (16 where absent
    or null);
    null or 0 asks for none. A value it cannot read counts as none: vLLM refuses the request anyway."""
    name = output_limit_field(body, completion=not chat)
    if not chat and body.get(name) is None:  # vLLM 0.32 reads a completion's null as unset: its 16
        return True
    return bool(lax_integer(body.get(name)))


def _whole_prompt(tokenizer: Tokenizer, body: dict[str, Any], *, chat: bool) -> Prompt:
    """`prompt_of` before any truncation."""
    special = lax_flag(body, "add_special_tokens")  # vLLM's defaults: true for a completion, false for a chat
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list", param="messages")
        variables = chat_variables(body)
        try:
            text = tokenizer.render_chat(
                messages,
                add_generation_prompt=variables.pop("add_generation_prompt"),
                continue_final_message=variables.pop("continue_final_message"),
                **variables,
            )
            return Prompt(tokenizer.encode(text, add_special_tokens=bool(special)))
        except (MooncakeError, TypeError):  # not rendered here; the server may render it (a multimodal model)
            tokens = tokenizer.encode(_texts(messages), add_special_tokens=False)
            return Prompt(tokens or [0], approximate=True)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt):
        prompt = prompt[0]  # a batch: routed by its first prompt
    if isinstance(prompt, str) and prompt:
        return Prompt(tokenizer.encode(prompt, add_special_tokens=special is not False))
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return Prompt([int(p) for p in prompt])
    raise ApiError(400, "prompt must be a non-empty string or list of token ids", param="prompt")
