"""A checkpoint's text stream after its prompt (examples/serving/tokenizer.py: `CheckpointTokenizer.stream`).

What each test proves: the stream a request gets decodes its first generated token as it reads after the prompt,
as vLLM's stream (seeded with the prompt's ids) does: a SentencePiece "▁Hello" streams as " Hello", not "Hello",
so a stop string that begins with that space ends the text there, and an echo (the prompt's text, then the
completion's) reads as the whole sequence decoded. A byte-level tokenizer streams the same text either way.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from serving.tokenizer import CheckpointTokenizer, TextStream

from mooncake.engine.tokenizer import load_tokenizer
from tests.engine.test_tokenizer import CHATML, ZEPHYR, save_tokenizer, write_llama_files


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> CheckpointTokenizer:
    """A Llama 2 style checkpoint's tokenizer ("▁" spaces, stripped at a decode's start), Zephyr's template."""
    return CheckpointTokenizer(
        load_tokenizer(write_llama_files(tmp_path_factory.mktemp("llama"), chat_template=ZEPHYR))
    )


def text_of(stream: TextStream, ids: list[int]) -> str:
    """What a client gets of `ids` through `stream`: each token's text, then what was held back."""
    text = ""
    for token in ids:
        text += stream.feed(token)
        if stream.stopped:
            break
    return text + stream.finish()


def test_the_first_token_keeps_the_space_it_has_after_the_prompt(llama: CheckpointTokenizer) -> None:
    """After a chat's prompt, "Hello there!" (its first piece "▁Hello") streams as " Hello there!", vLLM's text;
    the prompt's decode and that text make the decode of the whole sequence (what an echo of the prompt's ids and
    the completion read as). Without the prompt the stream cannot know the space is not the text's start."""
    prompt = llama.encode(llama.render_chat([{"role": "user", "content": "Hi there"}]), add_special_tokens=False)
    ids = llama.encode("Hello there!", add_special_tokens=False)
    assert llama.piece(ids[0]).startswith("▁")
    assert text_of(llama.stream(prompt=prompt), ids) == " Hello there!"
    assert llama.decode(prompt) + text_of(llama.stream(skip_special_tokens=False, prompt=prompt), ids) == llama.decode(
        prompt + ids
    )
    assert text_of(llama.stream(), ids) == "Hello there!"  # no prompt: nothing before the text


def test_stop_strings_see_the_space(llama: CheckpointTokenizer) -> None:
    """Stop strings match the text vLLM matches them in, leading space included: " " ends the text before its
    first character; " Hello" at once (kept with `include_stop`); the model's EOS still ends it, its text unshown."""
    prompt = llama.encode("Say hi:")
    ids = llama.encode("Hello there!", add_special_tokens=False)
    stream = llama.stream([" "], prompt=prompt)
    assert text_of(stream, ids) == "" and stream.stop_reason == " "
    stream = llama.stream([" Hello"], include_stop=True, prompt=prompt)
    assert text_of(stream, ids) == " Hello" and stream.stop_reason == " Hello"
    eos = llama.tokenizer.special.eos_token_id
    assert eos is not None
    stream = llama.stream(prompt=prompt)
    assert text_of(stream, [*ids, eos, *ids]) == " Hello there!" and stream.stopped


def test_a_byte_level_stream_is_the_same_with_or_without_the_prompt(tmp_path: Path) -> None:
    """A byte-level BPE's decoder keeps every space: the prompt changes nothing in its stream."""
    save_tokenizer(tmp_path, CHATML)
    tokenizer = CheckpointTokenizer(load_tokenizer(tmp_path))
    prompt = tokenizer.encode(
        tokenizer.render_chat([{"role": "user", "content": "Hi there"}]), add_special_tokens=False
    )
    ids = tokenizer.encode(" Hello there! 日本語 🙂", add_special_tokens=False)
    assert (
        text_of(tokenizer.stream(prompt=prompt), ids) == text_of(tokenizer.stream(), ids) == " Hello there! 日本語 🙂"
    )
