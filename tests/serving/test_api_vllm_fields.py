"""The gateway's reading of every request field vLLM 0.32 defines.

`vllm_0_32_request_fields.json` records vLLM 0.32's `CompletionRequest` and `ChatCompletionRequest` fields with
their defaults (`tests/vllm_fleet/test_with_vllm.py` checks the record against the real vLLM). Each field must be
read (`COMPLETION_FIELDS`, `CHAT_FIELDS`), refused but at its neutral value (`UNSUPPORTED`) or checked for its
type only (`NEUTRAL`): one that is merely unknown is ignored with a warning, so a client would get an answer
computed on another request than the one it sent. Then vLLM's `cache_salt` and a chat's `documents`, read here
as vLLM reads them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("aiohttp")

from serving.api import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    NEUTRAL,
    UNSUPPORTED,
    ApiError,
    ServedModel,
    cache_salt,
    parse_chat,
    parse_completion,
)

RECORD = json.loads((Path(__file__).parent / "vllm_0_32_request_fields.json").read_text())
SERVED = ServedModel(name="tiny", max_prompt_tokens=64, default_max_tokens=16, max_context_tokens=129, vocab_size=256)
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("kind", "known"), [("completion", COMPLETION_FIELDS), ("chat", CHAT_FIELDS)])
def test_every_vllm_field_is_read_refused_or_neutral(kind: str, known: frozenset[str]) -> None:
    """No vLLM 0.32 field falls through to "unknown"; a field refused or type-checked here takes vLLM's default."""
    fields: dict[str, Any] = RECORD[kind]
    assert not set(fields) - known - set(UNSUPPORTED) - set(NEUTRAL)
    for name, default in fields.items():
        if name in known or default in ("<required>", "<generated>"):
            continue
        checker = NEUTRAL.get(name) or UNSUPPORTED[name]
        assert checker(default), (name, default)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("kv_transfer_params", {"do_remote_prefill": True}),
        ("vllm_xargs", {"processor": 1}),
        ("thinking_token_budget", 10),
        ("logprob_token_ids", [3]),
        ("watermarking", True),
        ("mm_processor_kwargs", {"fps": 1}),
        ("prompt_embeds", "AAAA"),
    ],
)
def test_a_vllm_field_this_server_does_not_implement_is_refused_by_name(name: str, value: Any) -> None:
    """A value that would change the answer is a 400 naming the field, for a completion and a chat alike."""
    for parse, body in ((parse_completion, {"prompt": "hi"}), (parse_chat, {"messages": MESSAGES})):
        with pytest.raises(ApiError, match=f"^{name} = .* is not supported by this server$") as refused:
            parse({**body, name: value}, SERVED)
        assert refused.value.param == name and refused.value.status == 400


def test_neutral_vllm_fields_are_accepted_at_any_value_of_their_type() -> None:
    """`session_id`, `stream_interval` (each token is a chunk of its own here, which any interval allows),
    `include_reasoning` (no reasoning parser), the render endpoints' options (vLLM's generation endpoints ignore
    them) and `watermarking: false` (an opt-out) change nothing here; a wrong type is still a 400."""
    neutral = (
        {"session_id": "s-1"},
        {"stream_interval": "4"},
        {"include_reasoning": "false"},
        {"return_token_offsets": True},
        {"mm_payload": "none"},
        {"return_mm_kwargs": True},
        {"watermarking": False},
    )
    for body in neutral:
        parse_chat({"messages": MESSAGES, **body}, SERVED)
    with pytest.raises(ApiError, match=r"^stream_interval = 0 has the wrong type$"):
        parse_chat({"messages": MESSAGES, "stream_interval": 0}, SERVED)


@given(st.text(min_size=1, max_size=128).filter(lambda s: not set(s) & set("@/\\\0")))
def test_a_cache_salt_is_read_as_vllm_reads_it(salt: str) -> None:
    """A non-empty string of at most 128 characters without '@', '/', '\\' or NUL is the request's salt, for a
    completion and a chat; absent or null, none."""
    assert parse_completion({"prompt": "hi", "cache_salt": salt}, SERVED).cache_salt == salt
    assert parse_chat({"messages": MESSAGES, "cache_salt": salt}, SERVED).cache_salt == salt
    assert parse_completion({"prompt": "hi", "cache_salt": None}, SERVED).cache_salt is None
    assert cache_salt({}) is None


@pytest.mark.parametrize(
    ("salt", "message"),
    [
        ("", "must be a non-empty string"),
        (7, "must be a non-empty string"),
        (["a"], "must be a non-empty string"),
        ("x" * 129, "must be at most 128 characters"),
        ("a/b", "must be at most 128 characters"),
        ("a@b", "must be at most 128 characters"),
        ("a\\b", "must be at most 128 characters"),
        ("a\0b", "must be at most 128 characters"),
    ],
)
def test_a_bad_cache_salt_is_vllms_400(salt: Any, message: str) -> None:
    with pytest.raises(ApiError, match=rf"^Parameter 'cache_salt' {message}") as refused:
        parse_completion({"prompt": "hi", "cache_salt": salt}, SERVED)
    assert refused.value.param == "cache_salt" and refused.value.status == 400


def test_a_chats_documents_reach_its_template() -> None:
    """vLLM's `documents` become the template's `documents` variable, over one in `chat_template_kwargs` (which may
    set it, as vLLM merges them); anything but a list of objects of strings is a 400 naming it."""
    documents = [{"title": "a", "text": "b"}]
    parsed = parse_chat({"messages": MESSAGES, "documents": documents}, SERVED)
    assert parsed.template_variables == {"documents": documents}
    through = parse_chat({"messages": MESSAGES, "chat_template_kwargs": {"documents": documents}}, SERVED)
    assert through.template_variables == {"documents": documents}
    both = {"messages": MESSAGES, "documents": documents, "chat_template_kwargs": {"documents": [], "x": 1}}
    assert parse_chat(both, SERVED).template_variables == {"documents": documents, "x": 1}
    assert parse_chat({"messages": MESSAGES, "documents": None}, SERVED).template_variables == {}
    for bad in ("doc", [1], [{"title": 2}]):
        with pytest.raises(ApiError, match=r"^documents must be a list of objects of strings") as refused:
            parse_chat({"messages": MESSAGES, "documents": bad}, SERVED)
        assert refused.value.param == "documents"
