"""Tests for the chat reading of `mooncake.engine.tokenizer`: a chat's messages as vLLM's server (0.32) reads them
before its template (`chat_conversation`, `content_text`, and `render_chat`, which applies them).

The expected values are what vLLM's `parse_chat_messages` and `_detect_content_format` give for the same input
(checked against vLLM itself when these were written; the suite does not import vLLM): text parts joined by
"\\n" for a template that takes a string content, kept as parts for one that loops over it; developer messages
as one system message where the template never names the role; the message keys vLLM keeps, a tool call's
arguments as an object. Then what transformers adds before rendering (a message's reasoning also as `thinking`),
checked against transformers' own functions where it is installed.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("jinja2")

from mooncake.engine.chat import _alias_reasoning, chat_conversation, content_text
from mooncake.engine.tokenizer import SpecialTokens, Tokenizer
from mooncake.errors import InvalidRequestError

STRING = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
PARTS = (
    "{% for m in messages %}<{{ m.role }}>{% for c in m.content %}[{{ c.type }}:{{ c.text }}]{% endfor %}{% endfor %}"
)
DUMP = "{{ messages | tojson }}"


def chat_tokenizer(template: str) -> Tokenizer:
    """A tokenizer with only a chat template (rendering needs no vocabulary)."""
    return Tokenizer(None, special=SpecialTokens(), chat_template=template)


def test_text_parts_render_as_their_joined_string() -> None:
    """The OpenAI SDK's `[{"type": "text", "text": ...}]` renders as vLLM renders it for a template that takes a
    string: the texts joined by "\\n" (string parts and vLLM's other text kinds too; a null text part skipped);
    the template failed on the list before ("can only concatenate str (not "list") to str")."""
    tokenizer = chat_tokenizer("{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] }}{% endfor %}")
    parts = [
        {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
        "b",
        {"type": "input_text", "text": "c"},
        {"type": "text", "text": None},
        {"type": "refusal", "refusal": "d"},
    ]
    assert tokenizer.render_chat([{"role": "user", "content": parts}]) == "<user>a\nb\nc\nd"
    assert content_text(parts) == "a\nb\nc\nd" and content_text("as is") == "as is" and content_text(None) == ""
    image = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}}]
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.content\[1\] is no text part"):
        tokenizer.render_chat([{"role": "user", "content": image}])
    with pytest.raises(InvalidRequestError, match=r"messages\[0\] needs a role"):
        tokenizer.render_chat([{"content": "x"}])


def test_a_template_that_loops_over_content_gets_parts() -> None:
    """A template that loops over a message's content gets every content as a list of text parts (a string one
    too: vLLM's "openai" format), a part's unknown keys kept; a tool's content is still joined."""
    tokenizer = chat_tokenizer(PARTS)
    assert tokenizer.content_parts and not chat_tokenizer(STRING).content_parts
    assert tokenizer.render_chat([{"role": "user", "content": "hi"}], add_generation_prompt=False) == "<user>[text:hi]"
    chat = chat_conversation(
        [
            {"role": "user", "content": [{"type": "text", "text": "a", "cache_control": 1}, "b"]},
            {"role": "tool", "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]},
        ],
        content_parts=True,
    )
    assert chat == [
        {"role": "user", "content": [{"type": "text", "text": "a", "cache_control": 1}, {"type": "text", "text": "b"}]},
        {"role": "tool", "content": "r1\nr2"},
    ]


def test_a_final_message_of_parts_is_continued_in_its_last_text_part() -> None:
    """`continue_final_message` with a content of parts (a template that loops over them): the prompt ends right
    after the last part's text, as transformers continues it."""
    tokenizer = chat_tokenizer(PARTS)
    messages = [{"role": "assistant", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    rendered = tokenizer.render_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert rendered == "<assistant>[text:one][text:two"


@pytest.mark.parametrize(
    ("template", "developer"),
    [(STRING, False), (STRING + "{% if m is defined and m['role'] == 'developer' %}{% endif %}", True)],
    ids=["no-developer-role", "developer-role"],
)
def test_developer_messages_are_system_ones_where_the_template_lacks_the_role(template: str, developer: bool) -> None:
    """A template that never names "developer" gets developer messages as system ones, all system messages merged
    into one at the start ("\\n\\n" between their texts, empty ones left out); one that names it gets them as
    given."""
    tokenizer = chat_tokenizer(template)
    assert tokenizer.developer_role is developer
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "q"},
        {"role": "developer", "content": [{"type": "text", "text": "D"}], "tools": [1]},
        {"role": "system", "content": ""},
    ]
    rendered = tokenizer.render_chat(messages, add_generation_prompt=False)
    assert rendered == ("<system>S\n<user>q\n<developer>D\n<system>\n" if developer else "<system>S\n\nD\n<user>q\n")
    alone = chat_conversation(
        [{"role": "developer", "content": "D"}, {"role": "user", "content": "q"}], developer_role=False
    )
    assert alone == [{"role": "system", "content": "D"}, {"role": "user", "content": "q"}]


def test_messages_keep_the_keys_vllm_keeps() -> None:
    """Each message keeps its role, content, name; an assistant its tool calls (each function's `arguments` an
    object: JSON text parsed, anything else `{}`; an empty list dropped) and `reasoning` (also as
    `reasoning_content`, and as `thinking` as transformers adds it); a tool its `tool_call_id`; a developer its `tools`; nothing else. The messages given are
    not changed."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "q", "name": "bob", "extra": 1},
        {
            "role": "assistant",
            "content": None,
            "reasoning": "because",
            "refusal": None,
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
                {"id": "2", "function": {"name": "g", "arguments": "not JSON"}},
                {"id": "3", "function": {"name": "h", "arguments": "[1]"}},
            ],
        },
        {"role": "tool", "content": "r", "tool_call_id": "1"},
        {"role": "assistant", "content": "done", "tool_calls": []},
    ]
    given = copy.deepcopy(messages)
    rendered = json.loads(chat_tokenizer(DUMP).render_chat(messages))
    assert messages == given
    assert rendered == [
        {"role": "user", "content": "q", "name": "bob"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
                {"id": "2", "function": {"name": "g", "arguments": {}}},
                {"id": "3", "function": {"name": "h", "arguments": {}}},
            ],
            "reasoning": "because",
            "reasoning_content": "because",
            "thinking": "because",
        },
        {"role": "tool", "content": "r", "tool_call_id": "1"},
        {"role": "assistant", "content": "done"},
    ]
    with pytest.raises(InvalidRequestError, match="tool_calls"):
        chat_conversation([{"role": "assistant", "content": "", "tool_calls": ["f"]}])


def test_a_system_messages_billing_header_line_is_dropped() -> None:
    """Claude Code's `x-anthropic-billing-header` line (new on every request) leaves a system message, and a part
    that held nothing else leaves it whole, as vLLM drops them so that the prompt's prefix stays cacheable."""
    header = "x-anthropic-billing-header: cch=1"
    chat = chat_conversation(
        [
            {"role": "system", "content": f"{header}\nBe brief."},
            {"role": "system", "content": [{"type": "text", "text": header}, {"type": "text", "text": "S"}]},
            {"role": "user", "content": f"{header}\nkept"},
        ]
    )
    assert [m["content"] for m in chat] == ["Be brief.", "S", f"{header}\nkept"]


@pytest.mark.parametrize(
    ("template", "loops"),
    [
        (STRING, False),
        ("{% for m in messages %}{% for c in m['content'] %}{{ c.text }}{% endfor %}{% endfor %}", True),
        ("{% for m in messages %}{% for c in m.content | list %}{{ c.text }}{% endfor %}{% endfor %}", True),
        (
            "{% set rest = messages[1:] %}{% for m in rest %}{% for c in m['content'] %}{{ c }}{% endfor %}{% endfor %}",
            True,
        ),
        (
            "{% for m in messages %}{% set content = m.content %}{% for c in content %}{{ c }}{% endfor %}{% endfor %}",
            True,
        ),
        (
            "{% macro r(x) %}{% for c in x %}{{ c.text }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ r(m.content) }}{% endfor %}",
            True,
        ),
        (
            "{% macro r(x) %}{% for c in x %}{{ c.text }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ r(x=m.content) }}{% endfor %}",
            True,
        ),
        (
            "{% macro r(content) %}{% for c in content %}{{ c }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ r(m.role) }}{% endfor %}",
            False,
        ),
        (
            "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}"
            "{% for c in m.content %}{{ c.text }}{% endfor %}{% endif %}{% endfor %}",
            True,
        ),
        ("{% for m in messages %}{% for k in m.items() %}{{ k }}{% endfor %}{% endfor %}", False),
        ("{% for m, n in messages %}{% for c in m.content %}{{ c }}{% endfor %}{% endfor %}", False),
        ("{% for m in messages %}{% for a, b in m.content %}{{ a }}{% endfor %}{% endfor %}", False),
    ],
)
def test_the_content_format_is_found_as_vllm_finds_it(template: str, loops: bool) -> None:
    """A template loops over a message's content where vLLM's `_detect_content_format` says "openai": a `for`
    over a `messages` loop variable's content (filtered, sliced, through an assignment or a macro's parameter),
    over a variable named `content`; an unpacking loop makes vLLM give up and take the string, as here."""
    assert chat_tokenizer(template).content_parts is loops


# A gpt-oss-style template (it reads `thinking`), then each message's keys and values in their order.
THINKING = (
    "{% for m in messages %}<|{{ m.role }}|>{% if m.thinking %}<|channel|>analysis {{ m.thinking }}<|end|>{% endif %}"
    "{{ m.content }}|{% for key, value in m.items() %}{{ key }}={{ value }};{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
REASONED = [
    {"role": "user", "content": "2+2?", "reasoning": "not kept"},
    {"role": "assistant", "content": "4", "reasoning": "add them"},
    {"role": "assistant", "content": "", "reasoning": "", "tool_calls": [{"function": {"name": "f"}}]},
    {"role": "assistant", "content": "ok", "reasoning": None, "reasoning_content": "dropped by vLLM"},
    {"role": "user", "content": "ok"},
]
# vLLM 0.32's conversation of REASONED (`_parse_chat_message_content`: an assistant's `reasoning` kept, also as
# `reasoning_content`; a user's dropped; a client's `reasoning_content` dropped), as it hands it to transformers.
VLLM_REASONED = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning": "add them", "reasoning_content": "add them"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "f", "arguments": {}}}],
        "reasoning": "",
        "reasoning_content": "",
    },
    {"role": "assistant", "content": "ok"},
    {"role": "user", "content": "ok"},
]


def test_reasoning_renders_under_every_name_transformers_gives_it() -> None:
    """transformers (5.25, which vLLM renders through) gives an assistant's reasoning to the template as
    `thinking` too (gpt-oss's templates read that name), first among its keys; `render_chat` renders what
    transformers renders from vLLM's conversation: the thinking channel and the keys, in order. It rendered no
    channel before."""
    pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template

    expected = render_jinja_template([VLLM_REASONED], chat_template=THINKING, add_generation_prompt=True)[0][0]
    rendered = chat_tokenizer(THINKING).render_chat(REASONED)
    assert rendered == expected
    assert "<|channel|>analysis add them<|end|>4|thinking=add them;role=assistant;" in rendered


reasoning_values = st.none() | st.text(max_size=3)


@given(
    st.dictionaries(
        st.sampled_from(["reasoning_content", "thinking", "reasoning", "role", "content", "name"]),
        reasoning_values,
    )
)
def test_reasoning_is_aliased_as_transformers_aliases_it(message: dict[str, Any]) -> None:
    """Any message, with any of `reasoning_content`, `thinking` and `reasoning` (None, empty or text, in any
    order): `_alias_reasoning` gives what transformers' `_alias_reasoning_fields` gives, keys in the same order
    (precedence: the first not None of reasoning_content, thinking, reasoning; `thinking` added first unless
    present; `reasoning_content` overwritten in place)."""
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    theirs = utils._alias_reasoning_fields([copy.deepcopy(message)])[0]
    ours = _alias_reasoning(copy.deepcopy(message))
    assert list(ours.items()) == list(theirs.items())
