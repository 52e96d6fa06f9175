"""Tests of the text rules `mooncake.engine.tokenizer` states once for the engine and the gateway: which template
variables `render_chat` refuses, which generation_config.json keys are server defaults, which ids a decode refuses,
that null message keys are dropped before a template renders (as transformers drops them), and when a stop token
ends a generation (`can_stop_at`, which the decode engine applies; the gateway's text stream's side is in
tests/serving/test_api_text_rules.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a test never reaches the network

from mooncake.engine.decode import _Active
from mooncake.engine.sampling import Sampler, SamplingParams
from mooncake.engine.tokenizer import CHAT_INPUTS, Tokenizer, can_stop_at, load_tokenizer, sampling_defaults
from mooncake.errors import InvalidRequestError
from tests.engine.test_tokenizer import CHATML, MESSAGES, save_tokenizer

STOP = 2


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Any]:
    directory = tmp_path_factory.mktemp("chatml")
    theirs = save_tokenizer(directory, CHATML)
    return load_tokenizer(directory), theirs


def test_a_variable_naming_one_of_render_chats_own_inputs_is_refused_naming_it(pair: tuple[Tokenizer, Any]) -> None:
    """A variable named `messages` (one of `CHAT_INPUTS`; the parameter is positional-only, so a spread mapping's
    key of that name lands among the variables) is an InvalidRequestError naming it, from `render_chat` and
    `encode_chat` alike, never a bare TypeError. (The two flags Python binds itself: a caller merging a request's
    variables drops them, as the gateway does.)"""
    ours, _theirs = pair
    variables: dict[str, Any] = {"messages": [], "greet": 1}
    assert "messages" in CHAT_INPUTS
    with pytest.raises(InvalidRequestError, match="may not set messages"):
        ours.render_chat(MESSAGES, **variables)
    with pytest.raises(InvalidRequestError, match="may not set messages"):
        ours.encode_chat(MESSAGES, **variables)


def test_null_message_keys_are_dropped_before_rendering_as_transformers_drops_them(pair: tuple[Tokenizer, Any]) -> None:
    """transformers (5.x, `_normalize_chat_messages`) drops a message's keys whose value is null, so a tool's
    `tool_call_id: null` is undefined to the template (its `is defined` test false), not the text "None"."""
    ours, theirs = pair
    template = (
        "{% for m in messages %}[{{ m['role'] }}|{{ m['tool_call_id'] }}|"
        "{% if m['tool_call_id'] is defined %}set{% else %}unset{% endif %}]{% endfor %}"
    )
    tokenizer = Tokenizer(ours.backend, special=ours.special, chat_template=template, source=ours.source)
    chat = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42", "tool_call_id": None}]
    expected = theirs.apply_chat_template(chat, chat_template=template, tokenize=False, add_generation_prompt=False)
    assert tokenizer.render_chat(chat, add_generation_prompt=False) == expected == "[user||unset][tool||unset]"


def test_only_the_keys_vllm_reads_of_generation_config_are_defaults(tmp_path: Path) -> None:
    """vLLM's `get_diff_sampling_param` reads repetition_penalty, temperature, top_k, top_p, min_p and
    max_new_tokens only: a presence or frequency penalty in the file is no default (and not checked)."""
    generation = {"temperature": 0.7, "presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    assert sampling_defaults(tmp_path) == {"temperature": 0.7, "repetition_penalty": 1.1}
    (tmp_path / "generation_config.json").write_text(json.dumps({"presence_penalty": 9}))
    assert sampling_defaults(tmp_path) == {}


@pytest.mark.parametrize("bad", [-1, -(2**63), 2**32, 2**63, 2**64])
def test_an_id_no_tokenizer_takes_is_an_invalid_request_naming_it(pair: tuple[Tokenizer, Any], bad: int) -> None:
    """An id outside [0, 2**32) (tokenizers' u32; transformers raises a bare OverflowError for it) is an
    InvalidRequestError naming it, from `decode`, `piece`, `token_text`, a stream's `push` (which leaves the stream
    as it was: the next token decodes as if the bad one never came) and `detokenizer(prompt=...)`."""
    ours, _theirs = pair
    calls = [
        lambda: ours.decode([5, bad]),
        lambda: ours.piece(bad),
        lambda: ours.token_text(bad),
        lambda: ours.detokenizer(prompt=[5, bad]),
    ]
    for call in calls:
        with pytest.raises(InvalidRequestError, match=f"^{bad} is not a token id"):
            call()
    ids = ours.encode("Hello world", add_special_tokens=False)
    stream = ours.detokenizer()
    first = stream.push(ids[0])
    with pytest.raises(InvalidRequestError, match=f"^{bad} is not a token id"):
        stream.push(bad)
    rest = "".join(stream.push(token) for token in ids[1:])
    assert first + rest == "Hello world"
    stream.check_invariants()


def test_an_id_past_the_vocabulary_decodes_as_transformers_decodes_it(pair: tuple[Tokenizer, Any]) -> None:
    """An id in [0, 2**32) past the vocabulary is no error for transformers (tokenizers skips it: "" and no
    piece), nor here."""
    ours, theirs = pair
    for past in (len(theirs), 10**6, 2**32 - 1):
        assert ours.decode([past]) == theirs.decode([past]) == ""
        assert ours.piece(past) == "" and theirs.convert_ids_to_tokens(past) is None


@given(min_tokens=st.integers(0, 6), at=st.integers(1, 8), allowed_only_stop=st.booleans())
def test_the_engine_ends_a_request_at_a_stop_token_from_min_tokens_on(
    min_tokens: int, at: int, allowed_only_stop: bool
) -> None:
    """A stop token emitted as the `at`-th output token ends the request (`_Active.ends_with`) iff `can_stop_at`:
    from token `min_tokens` on, as vLLM's `check_stop` (the token just drawn counted), also where the sampler could
    not hold it back (every allowed token a stop token)."""
    params = SamplingParams(
        stop_token_ids=[STOP], min_tokens=min_tokens, allowed_token_ids=[STOP] if allowed_only_stop else None
    )
    active = _Active(
        request_id="r", prompt_tokens=3, max_new_tokens=64, sampler=Sampler(params), on_token=None, last_token=0
    )
    active.emitted = at
    assert active.ends_with(STOP) == can_stop_at(at, min_tokens) == (at >= min_tokens)
