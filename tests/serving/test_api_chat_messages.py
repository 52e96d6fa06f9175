"""A chat's messages through the gateway (examples/serving/api.py) read as the vLLM router reads them.

What each test proves: the gateway and the vLLM router (examples/vllm_fleet/prompt.py) hand one chat to the one
reader of messages (`mooncake.engine.chat.chat_conversation`, through `Tokenizer.render_chat`), so any chat the
gateway accepts renders to the same prompt text and ids in both (`name`, a tool's `tool_call_id`, an assistant's
`reasoning`, a content of text parts or null kept as vLLM 0.32 keeps them); the gateway's other checks read as
vLLM reads them: a flag the server does not implement is neutral at any value pydantic reads as false, a
completion's `top_logprobs` (no field of vLLM's `CompletionRequest`) is ignored as unknown, and the 400 for an
output longer than the context never calls a number `max_model_len` that /v1/models does not advertise.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from serving.api import (
    ROLES,
    ApiError,
    ChatRequest,
    ServedModel,
    encoded,
    models_body,
    parse_chat,
    parse_completion,
)
from serving.tokenizer import ByteTokenizer, CheckpointTokenizer
from vllm_fleet.prompt import prompt_of

from mooncake.engine.tokenizer import Tokenizer, load_tokenizer

pytest.importorskip("transformers")

from tests.engine.test_tokenizer import save_tokenizer

SERVED = ServedModel(name="m", max_prompt_tokens=4096, default_max_tokens=16, max_context_tokens=8192, vocab_size=400)
NAMES = (
    "{% if message.name is defined %} name={{ message.name }}{% endif %}"
    "{% if message.tool_call_id is defined %} id={{ message.tool_call_id }}{% endif %}"
    "{% if message.reasoning_content is defined %} think={{ message.reasoning_content }}{% endif %}|>"
)
# A template that loops over content parts (vLLM hands it lists of parts) and one that takes strings; both read
# the keys vLLM keeps. Neither names the developer role: developer messages merge into the system one.
TEMPLATES = {
    "parts": (
        "{% for message in messages %}<|{{ message['role'] }}" + NAMES + "{% if message.content is string %}"
        "{{ message.content }}{% else %}{% for part in message.content %}[{{ part.text }}]{% endfor %}{% endif %}\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    ),
    "string": (
        "{% for message in messages %}<|{{ message['role'] }}" + NAMES + "{{ message['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    ),
}


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory: Path = tmp_path_factory.mktemp(f"chat-{request.param}")
    save_tokenizer(directory, TEMPLATES[request.param])
    return load_tokenizer(directory)


class Recording(CheckpointTokenizer):
    """The gateway's tokenizer, keeping the text it was asked to encode (the rendered prompt)."""

    texts: list[str]

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self.texts.append(text)
        return super().encode(text, add_special_tokens=add_special_tokens)


def gateway_prompt(tokenizer: Tokenizer, body: dict[str, Any]) -> tuple[str, list[int]]:
    """The prompt text and ids the gateway renders for a chat body (`parse_chat`, then `encoded`)."""
    serving = Recording(tokenizer)
    serving.texts = []
    request = parse_chat(body, SERVED)
    assert isinstance(request, ChatRequest)
    ids, param = encoded(request, serving)
    assert param == "messages" and len(serving.texts) == 1
    return serving.texts[0], ids


def router_prompt(tokenizer: Tokenizer, body: dict[str, Any]) -> tuple[str, list[int]]:
    """The prompt text (what vllm_fleet/prompt.py renders) and ids the vLLM router routes a chat body by."""
    text = tokenizer.render_chat(body["messages"], add_generation_prompt=body.get("add_generation_prompt", True))
    prompt = prompt_of(tokenizer, body, chat=True)
    assert not prompt.approximate  # rendered, not guessed from the texts
    return text, prompt.tokens


texts = st.text(max_size=6)
text_parts = st.one_of(
    texts,
    st.builds(lambda kind, text: {"type": kind, "text": text}, st.sampled_from(["input_text", "output_text"]), texts),
    st.builds(lambda text: {"type": "text", "text": text}, texts | st.none()),  # vLLM drops a null text part
    st.builds(lambda text: {"type": "refusal", "refusal": text}, texts | st.none()),
    st.builds(lambda text: {"type": "thinking", "thinking": text}, texts),
    st.builds(lambda text: {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}, texts),
)  # fmt: skip
contents = st.none() | texts | st.lists(text_parts, max_size=3)


@st.composite
def messages(draw: st.DrawFn) -> dict[str, Any]:
    """A message the gateway accepts: a role it knows, a content of text, and the keys vLLM hands a template (or
    drops: an SDK dump's nulls)."""
    role = draw(st.sampled_from(ROLES))
    message: dict[str, Any] = {"role": role}
    if draw(st.booleans()) or role != "assistant":
        message["content"] = draw(contents)
    optional: dict[str, st.SearchStrategy[Any]] = {
        "name": texts,
        "tool_call_id": texts,
        "reasoning": texts,
        "tool_calls": st.sampled_from([None, []]),
        "refusal": st.none(),
        "annotations": st.none(),
    }
    for key, values in optional.items():
        if draw(st.booleans()):
            message[key] = draw(values)
    return message


@given(chat=st.lists(messages(), min_size=1, max_size=4), generation=st.booleans())
def test_a_chat_renders_in_the_gateway_as_the_vllm_router_renders_it(
    tokenizer: Tokenizer, chat: list[dict[str, Any]], generation: bool
) -> None:
    """Any chat the gateway takes renders to the router's prompt text and ids, whatever its contents' parts, names,
    tool call ids, reasoning and ignored keys."""
    body = {"messages": chat, "add_generation_prompt": generation}
    assert gateway_prompt(tokenizer, body) == router_prompt(tokenizer, body)


def test_the_reviewers_chat_keeps_its_name_tool_call_id_and_parts(tokenizer: Tokenizer) -> None:
    """The chat whose `name`, `tool_call_id` and two text parts the gateway dropped (it joined the parts into one
    and rendered `(role, content)` pairs), against the prompt vLLM 0.32 renders."""
    chat = [
        {"role": "user", "name": "alice", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    text, _ = gateway_prompt(tokenizer, {"messages": chat})
    if tokenizer.content_parts:  # (the newline after a block tag is trimmed, as transformers renders)
        assert text == "<|user name=alice|>[a][b]<|assistant|>[ok]<|tool id=call_1|>sunny<|assistant|>"
    else:
        assert text == "<|user name=alice|>a\nb\n<|assistant|>ok\n<|tool id=call_1|>sunny\n<|assistant|>"


@pytest.mark.parametrize(
    "content",
    [[{"type": "input_text", "text": "hi"}], ["hi"], [{"type": "text", "text": None}, {"type": "text", "text": "hi"}]],
)
def test_vllms_text_parts_are_a_messages_text(content: list[Any]) -> None:
    """Parts vLLM reads as text (its other text kinds, bare strings, a null text part dropped) are accepted and
    rendered as vLLM renders them; a null content is an empty one for any role."""
    tokenizer = ByteTokenizer()
    for chat in ([{"role": "user", "content": content}], [{"role": "user", "content": None}]):
        request = parse_chat({"messages": chat}, SERVED)
        ids, _ = encoded(request, tokenizer)
        expected = "hi" if chat[0]["content"] else ""
        assert tokenizer.decode(ids) == f"<|user|>\n{expected}\n<|assistant|>\n"


def test_a_part_without_text_is_a_400_naming_the_messages_content() -> None:
    """An image (this server renders text only) or a content that is no string or list: vLLM's reader refuses
    it, and the gateway answers 400 naming the message's content."""
    for content in ([{"type": "image_url", "image_url": {"url": "x"}}], 5, [{"type": "text", "text": 5}]):
        with pytest.raises(ApiError) as raised:
            parse_chat({"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": content}]}, SERVED)
        assert (raised.value.status, raised.value.param) == (400, "messages[1].content")
    with pytest.raises(ApiError) as raised:
        parse_chat({"messages": [{"role": "user", "content": ["a\udfff"]}]}, SERVED)
    assert (raised.value.status, raised.value.param) == (400, "messages[0].content")  # a lone surrogate


def test_a_lone_surrogate_in_a_rendered_key_is_a_400_not_a_crash() -> None:
    """A `tool_call_id` reaches the template unchecked (vLLM's rule), so the rendered prompt is checked: UTF-8
    cannot encode a lone surrogate."""
    template = "{% for message in messages %}{{ message.tool_call_id }}{{ message.content }}{% endfor %}"

    class Keyed(ByteTokenizer):
        def render_chat(self, messages: Any, **_: Any) -> str:
            from jinja2 import Template

            return str(Template(template).render(messages=messages))

    request = parse_chat({"messages": [{"role": "tool", "tool_call_id": "\udfff", "content": "x"}]}, SERVED)
    with pytest.raises(ApiError) as raised:
        encoded(request, Keyed())
    assert (raised.value.status, raised.value.param) == (400, "messages")


@pytest.mark.parametrize("name", ["echo", "use_beam_search", "watermarking", "return_prompt_text"])
def test_an_unimplemented_flag_is_neutral_at_any_value_vllm_reads_as_false(name: str) -> None:
    """vLLM's pydantic reads 0, "false", "no", "off" as false (`lax_flag`, the module's rule for every boolean):
    such a value asks for nothing this server lacks; true in any spelling, or no boolean at all, is the 400."""
    body = {"messages": [{"role": "user", "content": "x"}]}
    neutral: tuple[Any, ...] = (None, False, 0, 0.0, "false", "No", "off", "0")
    for value in neutral:
        parse_chat({**body, name: value}, SERVED)
    asking: tuple[Any, ...] = (True, 1, "true", "yes", "maybe", 2, [0])
    for value in asking:
        with pytest.raises(ApiError, match=f"^{name} = .* is not supported by this server$"):
            parse_chat({**body, name: value}, SERVED)


def test_a_completions_top_logprobs_is_an_unknown_field_as_in_vllm(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM 0.32's `CompletionRequest` has no `top_logprobs` (a completion's is `logprobs: k`): any value is ignored
    with the warning every unknown field gets; a chat's `top_logprobs` is still read and checked."""
    plain = parse_completion({"prompt": "x"}, SERVED)
    with caplog.at_level(logging.WARNING):
        for value in (2, 99, "many"):
            assert parse_completion({"prompt": "x", "top_logprobs": value}, SERVED) == plain
    assert "top_logprobs" in caplog.text
    with pytest.raises(ApiError) as raised:
        parse_chat({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, SERVED)
    assert raised.value.param == "top_logprobs"


@pytest.mark.parametrize(("max_prompt_tokens", "max_context_tokens"), [(1024, 2048), (4096, 2048), (2048, 2048)])
def test_the_output_limits_400_never_names_another_max_model_len_than_the_models_route(
    max_prompt_tokens: int, max_context_tokens: int
) -> None:
    """A `max_tokens` over `[decode] max_context_tokens` is refused naming that bound for what it is; where the
    message says `max_model_len`, it is the number /v1/models advertises (the smaller of the two limits), the one
    `truncate_prompt_tokens`' 400 names too."""
    served = ServedModel(
        name="m",
        max_prompt_tokens=max_prompt_tokens,
        default_max_tokens=16,
        max_context_tokens=max_context_tokens,
        vocab_size=256,
    )
    advertised = models_body(served)["data"][0]["max_model_len"]
    for parse, body in (
        (parse_completion, {"prompt": "x", "max_tokens": max_context_tokens + 1}),
        (parse_chat, {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": max_context_tokens + 1}),
        (parse_completion, {"prompt": "x", "truncate_prompt_tokens": advertised + 1}),
    ):
        with pytest.raises(ApiError) as raised:
            parse(body, served)
        message = raised.value.message
        assert raised.value.status == 400
        named = message.split("max_model_len", 1)[1] if "max_model_len" in message else None
        assert named is None or named.lstrip(" =").startswith(f"{advertised}."), message
        if "truncate" not in message:
            assert f"max_context_tokens={max_context_tokens}" in message
