"""Tests of the gateway's side of the text rules `mooncake.engine.tokenizer` states once: `chat_template_kwargs`
merged under the request's own flags (as vLLM merges them), the generation config's keys that are request defaults,
and when a stop token or a stop string ends a generation's text (`can_stop_at`, the decode engine's rule too).
No servers.
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
pytest.importorskip("torch")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a test never reaches the network

from serving import api
from serving.tokenizer import CheckpointTokenizer, TextStream

from mooncake.engine.decode import _Active
from mooncake.engine.sampling import Sampler, SamplingParams
from mooncake.engine.tokenizer import load_tokenizer, sampling_defaults
from tests.engine.test_tokenizer import CHATML, save_tokenizer

STOP = 2
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[CheckpointTokenizer, api.ServedModel]:
    directory = tmp_path_factory.mktemp("chatml")
    save_tokenizer(directory, CHATML)
    tokenizer = CheckpointTokenizer(load_tokenizer(directory))
    served = api.ServedModel(
        name="m",
        max_prompt_tokens=1000,
        default_max_tokens=16,
        max_context_tokens=2048,
        vocab_size=tokenizer.tokenizer.backend.get_vocab_size(),
    )
    return tokenizer, served


def prompt(checkpoint: tuple[CheckpointTokenizer, api.ServedModel], **fields: Any) -> list[int]:
    tokenizer, served = checkpoint
    tokens, _param = api.encoded(api.parse_chat({"model": "m", "messages": USER, **fields}, served), tokenizer)
    return tokens


@pytest.mark.parametrize("kwargs", [{"continue_final_message": True}, {"add_generation_prompt": False}])
def test_the_requests_own_flags_win_over_chat_template_kwargs(
    checkpoint: tuple[CheckpointTokenizer, api.ServedModel], kwargs: dict[str, Any]
) -> None:
    """A chat_template_kwargs `continue_final_message` or `add_generation_prompt` is overridden by the request's
    own field (set or default), as vLLM 0.32 merges them (`merge_kwargs`: the request's non-null fields over the
    kwargs): the prompt is the one without it, not a 500 or a 400."""
    assert prompt(checkpoint, chat_template_kwargs={**kwargs, "x": 1}) == prompt(checkpoint)
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    flipped = {"add_generation_prompt": True, "continue_final_message": False}
    assert prompt(checkpoint, **continued, chat_template_kwargs=flipped) == prompt(checkpoint, **continued)
    assert prompt(checkpoint, **continued) != prompt(checkpoint)


def test_the_generation_configs_penalties_are_no_request_defaults(tmp_path: Path) -> None:
    """A served model built from a generation_config.json with presence and frequency penalties (as the gateway
    builds it from `sampling_defaults`) gives a request without them 0, as vLLM (which reads neither key)."""
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.7, "presence_penalty": 1.5, "frequency_penalty": 0.5})
    )
    defaults = {f"default_{name}": value for name, value in sampling_defaults(tmp_path).items()}
    served = api.ServedModel(
        name="m", max_prompt_tokens=100, default_max_tokens=16, max_context_tokens=2048, vocab_size=256, **defaults
    )
    sampling = api.parse_chat({"model": "m", "messages": USER}, served).sampling
    assert (sampling.temperature, sampling.presence_penalty, sampling.frequency_penalty) == (0.7, 0.0, 0.0)


@given(min_tokens=st.integers(0, 6), at=st.integers(1, 8), allowed_only_stop=st.booleans())
def test_the_text_stream_and_the_engine_end_at_the_same_stop_token(
    min_tokens: int, at: int, allowed_only_stop: bool
) -> None:
    """A stop token emitted as the `at`-th output token ends the gateway's text (`finish_reason` "stop", its id
    the `stop_reason`) iff the decode engine ends the request at it: both from token `min_tokens` on (vLLM's
    `check_stop`), also where the sampler could not hold it back (every allowed token a stop token)."""
    params = SamplingParams(
        stop_token_ids=[STOP], min_tokens=min_tokens, allowed_token_ids=[STOP] if allowed_only_stop else None
    )
    active = _Active(
        request_id="r", prompt_tokens=3, max_new_tokens=64, sampler=Sampler(params), on_token=None, last_token=0
    )
    active.emitted = at
    text = TextStream(min_tokens=min_tokens, stop_token_ids=frozenset({STOP}))
    for _ in range(at - 1):
        text.feed(ord("a"))
    text.feed(STOP)
    assert text.stopped == active.ends_with(STOP) == (at >= min_tokens)
    assert text.stop_reason == (STOP if text.stopped else None)


def test_a_stop_string_counts_one_token_later_than_a_stop_token() -> None:
    """vLLM's detokenizer checks stop strings only once the output holds more than min_tokens tokens: one that the
    min_tokens-th token completes is text, where a stop id there ends the generation."""
    text = TextStream(["b"], min_tokens=2)
    assert text.feed(ord("a")) + text.feed(ord("b")) + text.feed(ord("c")) == "abc" and not text.stopped
    assert text.feed(ord("b")) == "" and text.stop_reason == "b"
    ids = TextStream(min_tokens=2, stop_token_ids=frozenset({STOP}))
    assert ids.feed(ord("a")) == "a" and ids.feed(STOP) == "" and ids.stopped
