"""Properties of `mooncake.engine.chat`, the chat as vLLM's server reads it before its template.

- `content_text`: a string is itself, a list of text parts their texts joined by "\\n" (strings and text dicts
  alike), whatever the texts hold (newlines, empty strings);
- `chat_conversation`: one entry per message, in order, with its role; with string contents and no developer
  message it changes nothing of role and content, and reading its own output again gives the same chat; the
  given messages are never changed; developer messages folded into system ones leave exactly one system message,
  first, holding every system and developer text in order;
- the part list a template that loops over content gets holds the same texts as the string one.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("jinja2")

from mooncake.engine.chat import chat_conversation, content_text

texts = st.text(max_size=12)
parts = st.lists(texts.map(lambda t: {"type": "text", "text": t}) | texts, max_size=5)
roles = st.sampled_from(["system", "user", "assistant", "developer"])
messages = st.lists(st.fixed_dictionaries({"role": roles, "content": texts | parts}), max_size=6)


def text_of(part: Any) -> str:
    return part if isinstance(part, str) else part["text"]


@given(parts)
def test_content_text_joins_the_parts_texts(content: list[Any]) -> None:
    assert content_text(content) == "\n".join(text_of(p) for p in content)


@given(texts)
def test_a_string_content_is_itself(text: str) -> None:
    assert content_text(text) == text


@given(messages, st.booleans())
def test_one_entry_per_message_and_nothing_given_changes(chat: list[dict[str, Any]], as_parts: bool) -> None:
    given_chat = copy.deepcopy(chat)
    read = chat_conversation(chat, content_parts=as_parts)
    assert chat == given_chat
    assert [m["role"] for m in read] == [m["role"] for m in chat]
    for message, entry in zip(chat, read, strict=True):
        if as_parts:
            assert [p["text"] for p in entry["content"]] == [text_of(p) for p in _as_list(message["content"])]
        else:
            assert entry["content"] == content_text(message["content"])


@given(messages)
def test_string_chats_read_as_themselves_and_reading_is_idempotent(chat: list[dict[str, Any]]) -> None:
    read = chat_conversation(chat)
    again = chat_conversation(read)
    assert again == read
    strings = [{"role": m["role"], "content": m["content"]} for m in chat if isinstance(m["content"], str)]
    assert [{"role": m["role"], "content": m["content"]} for m in chat_conversation(strings)] == strings


@given(messages)
def test_developer_messages_fold_into_one_system_message_first(chat: list[dict[str, Any]]) -> None:
    read = chat_conversation(chat, developer_role=False)
    systems = [m for m in chat if m["role"] in ("system", "developer")]
    others = [m for m in chat if m["role"] not in ("system", "developer")]
    assert all(m["role"] != "developer" for m in read)
    assert [m["role"] for m in read if m["role"] != "system"] == [m["role"] for m in others]
    if any(m["role"] == "developer" for m in chat):
        assert [m["role"] for m in read].count("system") == 1 and read[0]["role"] == "system"
        expected = "\n\n".join(filter(None, (content_text(m["content"]) for m in systems)))
        assert read[0]["content"] == expected


def _as_list(content: Any) -> list[Any]:
    return [content] if isinstance(content, str) else content
