"""The router's reading of a request's prompt (`vllm_fleet.prompt`), without a server.

A chat is rendered with the template inputs vLLM's server gives it (the body's `add_generation_prompt`,
`continue_final_message`, `chat_template_kwargs`, `tools` as vLLM's request model dumps them, `documents`,
`reasoning_effort`), so the router's block keys are the server's; a chat the router cannot render (a part with
no text) is routed by its texts, `approximate`. The expected merges and tool dumps are what vLLM 0.32's
`ChatCompletionRequest.build_chat_params` and `ChatCompletionToolsParam.model_dump` give (checked against vLLM
when these were written).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("transformers")

from serving.api import ApiError
from vllm_fleet.model import CHATML
from vllm_fleet.prompt import Prompt, chat_variables, prompt_of, tool_dicts

from mooncake.engine.tokenizer import Tokenizer, load_tokenizer

MESSAGES = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "bada"}]


def test_a_chats_prompt_follows_the_bodys_generation_prompt_and_continuation(tokenizer_dir: Path) -> None:
    """`add_generation_prompt: false` with `continue_final_message: true` ends the prompt inside the final
    message, as the server renders it (the router rendered every chat with a generation prompt)."""
    tokenizer = load_tokenizer(tokenizer_dir)
    body = {"messages": MESSAGES, "add_generation_prompt": False, "continue_final_message": True}
    expected = tokenizer.encode_chat(MESSAGES, add_generation_prompt=False, continue_final_message=True)
    assert prompt_of(tokenizer, body, chat=True) == Prompt(expected)
    assert tokenizer.decode(expected).endswith("<|im_start|>assistant\nbada")
    assert prompt_of(tokenizer, {"messages": MESSAGES}, chat=True) == Prompt(tokenizer.encode_chat(MESSAGES))


def test_the_template_gets_the_bodys_kwargs_tools_and_documents(tokenizer_dir: Path) -> None:
    """`chat_template_kwargs`, `tools` (as vLLM dumps them) and `documents` reach the template: a prompt that
    renders them is the server's."""
    loaded = load_tokenizer(tokenizer_dir)
    template = "{% if enable_thinking %}think {% endif %}{{ tools | tojson }} {{ documents | tojson }}\n" + CHATML
    tokenizer = Tokenizer(loaded.backend, special=loaded.special, chat_template=template)
    tools = [{"type": "function", "function": {"name": "f", "x": 1}}]
    documents = [{"title": "t", "text": "x"}]
    body = {
        "messages": MESSAGES,
        "tools": tools,
        "documents": documents,
        "chat_template_kwargs": {"enable_thinking": 1},
    }
    rendered = tokenizer.decode(prompt_of(tokenizer, body, chat=True).tokens)
    dumped = [{"type": "function", "function": {"name": "f", "description": None, "parameters": None}}]
    assert rendered.startswith(f"think {json.dumps(dumped)} {json.dumps(documents)}\n<|im_start|>user")


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({}, {"add_generation_prompt": True, "continue_final_message": False}),
        (  # the body's fields over its kwargs; reasoning_effort sets enable_thinking unless the kwargs do
            {"chat_template_kwargs": {"add_generation_prompt": False, "x": 1}, "reasoning_effort": "none"},
            {"add_generation_prompt": True, "continue_final_message": False, "x": 1}
            | {"reasoning_effort": "none", "enable_thinking": False},
        ),
        (
            {"chat_template_kwargs": {"enable_thinking": True}, "reasoning_effort": "low"},
            {"add_generation_prompt": True, "continue_final_message": False}
            | {"enable_thinking": True, "reasoning_effort": "low"},
        ),
        (  # the kwargs' tools and documents over the body's tools
            {"chat_template_kwargs": {"tools": [1], "documents": [2]}, "tools": [{"function": {"name": "f"}}]},
            {"tools": [1], "documents": [2], "add_generation_prompt": True, "continue_final_message": False},
        ),
        (  # null and "auto" are unset
            {"chat_template_kwargs": {"tools": None, "y": "auto"}, "tools": [{"function": {"name": "f"}}]},
            {"tools": tool_dicts([{"function": {"name": "f"}}])}
            | {"add_generation_prompt": True, "continue_final_message": False},
        ),
    ],
)
def test_the_template_inputs_merge_as_vllm_merges_them(body: dict[str, Any], expected: dict[str, Any]) -> None:
    """The body's chat_template_kwargs over the tools, under the body's own fields; null and "auto" unset."""
    assert chat_variables(body) == expected


def test_tools_are_dumped_as_vllms_request_model_dumps_them() -> None:
    """Each tool: type and function (name, description, parameters; strict and defer_loading where set, a
    tool's defer_loading given to its function too); other keys dropped; a malformed list passes as given."""
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "x": 1}, "y": 2},
        {"type": "function", "function": {"name": "g", "description": "d", "strict": True}, "defer_loading": True},
        {"function": {"name": "h", "defer_loading": False}},
    ]
    assert tool_dicts(tools) == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": {"type": "object"}}},
        {
            "type": "function",
            "function": {"name": "g", "description": "d", "parameters": None, "strict": True, "defer_loading": True},
            "defer_loading": True,
        },
        {
            "type": "function",
            "function": {"name": "h", "description": None, "parameters": None, "defer_loading": False},
        },
    ]
    assert tool_dicts([5]) == [5] and tool_dicts(None) is None


def test_a_chat_not_rendered_here_is_routed_by_its_texts(tokenizer_dir: Path) -> None:
    """A part that is no text (an image, for a multimodal model), or a variable the renderer here refuses: an
    approximate prompt of the messages' texts, for the server to answer; no messages, or no prompt, is a 400."""
    tokenizer = load_tokenizer(tokenizer_dir)
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, image]}]}
    assert prompt_of(tokenizer, body, chat=True) == Prompt(tokenizer.encode("look", add_special_tokens=False), True)
    own = {"messages": MESSAGES, "chat_template_kwargs": {"eos_token": "x"}}
    assert prompt_of(tokenizer, own, chat=True).approximate
    for bad, chat in (({"messages": []}, True), ({"prompt": ""}, False), ({"prompt": [True]}, False)):
        with pytest.raises(ApiError):
            prompt_of(tokenizer, bad, chat=chat)


def test_add_special_tokens_and_truncation_are_read_as_vllm_reads_them(tokenizer_dir: Path) -> None:
    """A completion's `add_special_tokens` (default true) and a chat's (default false) decide the BOS and the like
    the server adds, so the router's block keys are the server's; `truncate_prompt_tokens` keeps the last k
    tokens (-1: `max_model_len - 1`, or all of it for a request that asks for no output), the first k with
    `truncation_side: "right"`; exactly for token ids or with a side, `approximate` for a text without one; k read
    as vLLM reads an integer ("5" is 5)."""
    loaded = load_tokenizer(tokenizer_dir)
    tokenizer = Tokenizer(loaded.backend, special=loaded.special, chat_template=CHATML)
    for special in (True, False):
        text = tokenizer.encode("bada keli sunu", add_special_tokens=special)
        body = {"prompt": "bada keli sunu", "add_special_tokens": special}
        assert prompt_of(tokenizer, body, chat=False) == Prompt(text)
        rendered = tokenizer.render_chat(MESSAGES, add_generation_prompt=True)
        chat = {"messages": MESSAGES, "add_special_tokens": special}
        assert prompt_of(tokenizer, chat, chat=True) == Prompt(tokenizer.encode(rendered, add_special_tokens=special))
    assert prompt_of(tokenizer, {"prompt": "x", "add_special_tokens": "no"}, chat=False) == Prompt(
        tokenizer.encode("x", add_special_tokens=False)
    )
    ids = list(range(10, 30))
    assert prompt_of(tokenizer, {"prompt": ids, "truncate_prompt_tokens": 5}, chat=False) == Prompt(ids[-5:])
    assert prompt_of(tokenizer, {"prompt": ids, "truncate_prompt_tokens": -1}, chat=False, max_model_len=8) == Prompt(
        ids[-7:]
    )
    body = {"prompt": ids, "truncate_prompt_tokens": -1, "max_tokens": 0}  # vLLM keeps no token back for no output
    assert prompt_of(tokenizer, body, chat=False, max_model_len=8) == Prompt(ids[-8:])
    body = {"prompt": ids, "truncate_prompt_tokens": -1, "max_tokens": None}  # vLLM's 16: one token kept back
    assert prompt_of(tokenizer, body, chat=False, max_model_len=8) == Prompt(ids[-7:])
    chat = {"messages": [{"role": "user", "content": "bada keli sunu " * 5}], "truncate_prompt_tokens": -1}
    assert len(prompt_of(tokenizer, chat, chat=True, max_model_len=8).tokens) == 8
    assert len(prompt_of(tokenizer, {**chat, "max_completion_tokens": 3}, chat=True, max_model_len=8).tokens) == 7
    assert prompt_of(tokenizer, {"prompt": ids, "truncate_prompt_tokens": 50}, chat=False) == Prompt(ids)
    right = {"prompt": ids, "truncate_prompt_tokens": "5", "truncation_side": "right"}
    assert prompt_of(tokenizer, right, chat=False) == Prompt(ids[:5])
    text = "bada keli sunu " * 10
    cut = prompt_of(tokenizer, {"prompt": text, "truncate_prompt_tokens": 4}, chat=False)
    assert len(cut.tokens) == 4 and cut.approximate
    whole = tokenizer.encode(text, add_special_tokens=True)
    for side, kept in (("left", whole[-4:]), ("right", whole[:4])):
        body = {"prompt": text, "truncate_prompt_tokens": 4.0, "truncation_side": side}
        assert prompt_of(tokenizer, body, chat=False) == Prompt(kept), side
    for k in (-2, 0, "x"):
        with pytest.raises(ApiError, match=r"^truncate_prompt_tokens must be") as refused:
            prompt_of(tokenizer, {"prompt": ids, "truncate_prompt_tokens": k}, chat=False)
        assert refused.value.param == "truncate_prompt_tokens"
    with pytest.raises(ApiError, match=r"^truncate_prompt_tokens=9 cannot be greater than max_model_len = 8\."):
        prompt_of(tokenizer, {"prompt": ids, "truncate_prompt_tokens": 9}, chat=False, max_model_len=8)
    with pytest.raises(ApiError, match=r"^truncation_side must be 'left' or 'right', got 'up'$"):
        prompt_of(tokenizer, {"prompt": ids, "truncation_side": "up"}, chat=False)
    with pytest.raises(ApiError, match="add_special_tokens must be a boolean, got 'maybe'"):
        prompt_of(tokenizer, {"prompt": "x", "add_special_tokens": "maybe"}, chat=False)
