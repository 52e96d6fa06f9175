"""Tests for `mooncake.engine.tokenizer` against transformers' tokenizer for the same files.

The tokenizer is a byte-level BPE trained here on local text (accents, CJK,
emoji: characters of two to four UTF-8 bytes, so tokens split characters),
wrapped as transformers' `PreTrainedTokenizerFast` with BOS, EOS and a chat
template, and saved. Properties: encode and decode equal transformers'; the
streamed pieces of any token sequence join to its decode, and for the tokens of
any text no piece holds U+FFFD; the chat template renders exactly what
`apply_chat_template` renders. Examples: special tokens and stop ids, and the
refusals.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a test never reaches the network

import transformers
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, pre_tokenizers, processors, trainers
from tokenizers.models import BPE

from mooncake.engine.tokenizer import _SPECIAL_NAMES, REPLACEMENT, Tokenizer, load_tokenizer, sampling_defaults
from mooncake.errors import ConfigError, InvalidRequestError

TEXT = [
    "Hello world! The quick brown fox jumps over the lazy dog. Héllo wörld, naïve café — déjà vu.",
    "日本語のテキストと中文文本。한국어 텍스트. Ελληνικά και русский текст. 🙂🚀🎉 emoji 👩‍💻.",
    "def main():\n    return {'key': [1, 2, 3]}  # code, too\n\ttabs and  double  spaces",
] * 20

# ChatML with a default system turn, loops, conditionals, loop controls and raise_exception: the constructs
# real templates use.
CHATML = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Llama 3's shape: BOS from the variable, whitespace control, a generation block.
LLAMA3 = """{{- bos_token }}
{%- for message in messages %}
    {%- if loop.index0 > 5 %}{% break %}{% endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {%- if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}{% endgeneration %}
    {%- else %}{{ message['content'] | trim }}{% endif %}
    {{- eos_token }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
MESSAGES = [
    {"role": "system", "content": "Be brief. Ünïcödé too: 日本"},
    {"role": "user", "content": "  What is 2 + 2?  "},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": 'And {"json": true}? 🙂'},
]


def save_tokenizer(directory: Path, template: str, *, clean_up: bool = False) -> Any:
    """Train a byte-level BPE on TEXT, wrap it as transformers does, save it; transformers' tokenizer of the files."""
    backend = Backend(BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(TEXT, trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", backend.token_to_id("<s>"))]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=template,
        clean_up_tokenization_spaces=clean_up,
    )
    fast.save_pretrained(directory)
    stop = backend.token_to_id("<|im_end|>")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [fast.eos_token_id, stop]}))
    return transformers.AutoTokenizer.from_pretrained(directory)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Any]:
    """Ours and transformers' tokenizer of the same saved files (ChatML template)."""
    directory = tmp_path_factory.mktemp("tokenizer")
    theirs = save_tokenizer(directory, CHATML)
    return load_tokenizer(directory), theirs


texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40) | st.sampled_from(TEXT)


@settings(max_examples=100, deadline=None)
@given(texts)
def test_encode_equals_transformers(pair: tuple[Tokenizer, Any], text: str) -> None:
    """The ids of any text, with and without the BOS, are transformers'."""
    ours, theirs = pair
    assert ours.encode(text) == theirs.encode(text)
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_decode_equals_transformers(pair: tuple[Tokenizer, Any], data: st.DataObject) -> None:
    """The text of any ids (special ones and split characters included) is transformers', skipping specials or not."""
    ours, theirs = pair
    ids = data.draw(st.lists(st.integers(min_value=0, max_value=ours.vocab_size - 1), max_size=30))
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
            ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
        )


def test_clean_up_tokenization_spaces_is_not_applied_to_a_bpe_tokenizer(tmp_path: Path) -> None:
    """Llama 2's and Llama 3's tokenizer_config.json say `clean_up_tokenization_spaces: true`; transformers 5
    ignores it for BPE tokenizers (it strips real spaces before punctuation), and so does this decode:
    the default decode of both is the same text, spaces before "." and "," kept."""
    theirs = save_tokenizer(tmp_path, CHATML, clean_up=True)
    ours = load_tokenizer(tmp_path)
    text = "hello , world . is n't it ? yes !"
    ids = theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == theirs.decode(ids) == text


def stream(tokenizer: Tokenizer, ids: list[int], *, skip: bool, prompt: list[int] | None = None) -> list[str]:
    """The pieces a fresh detokenizer (started after `prompt`, if given) emits for `ids` (one per push, then
    `finish`), invariants checked."""
    detokenizer = tokenizer.detokenizer(skip_special_tokens=skip, prompt=prompt or ())
    detokenizer.check_invariants()
    pieces = []
    for token in ids:
        pieces.append(detokenizer.push(token))
        detokenizer.check_invariants()
    pieces.append(detokenizer.finish())
    detokenizer.check_invariants()
    return pieces


@settings(max_examples=200, deadline=None)
@given(st.data(), st.booleans())
def test_streamed_pieces_join_to_the_decode_of_any_tokens(
    pair: tuple[Tokenizer, Any], data: st.DataObject, skip: bool
) -> None:
    """Whatever the tokens (bytes that never make a character, specials anywhere), the pieces join to the decode,
    less an incomplete character at the end (dropped, as vLLM's stream drops it): a prefix of the decode, all of
    it where the decode ends on a whole character."""
    ours, _ = pair
    ids = data.draw(st.lists(st.integers(min_value=0, max_value=ours.vocab_size - 1), max_size=40))
    joined, whole = "".join(stream(ours, ids, skip=skip)), ours.decode(ids, skip_special_tokens=skip)
    assert whole.startswith(joined)
    assert joined == whole or whole.endswith(REPLACEMENT)


@settings(max_examples=200, deadline=None)
@given(texts)
def test_the_tokens_of_a_text_stream_whole_characters(pair: tuple[Tokenizer, Any], text: str) -> None:
    """Streaming the tokens of any text never emits U+FFFD (half a character waits) and joins to the text."""
    ours, _ = pair
    ids = ours.encode(text, add_special_tokens=False)
    pieces = stream(ours, ids, skip=False)
    assert "".join(pieces) == text
    assert not any(REPLACEMENT in piece for piece in pieces) or REPLACEMENT in text


def test_a_split_character_waits_for_its_last_byte(pair: tuple[Tokenizer, Any]) -> None:
    """An emoji whose bytes are separate tokens comes out whole, at its last byte."""
    ours, _ = pair
    byte_tokens = [ours.backend.token_to_id(c) for c in "ðŁĺĢ"]  # byte-level BPE's characters for F0 9F 98 80
    assert None not in byte_tokens
    detokenizer = ours.detokenizer()
    assert [detokenizer.push(t) for t in byte_tokens] == ["", "", "", "😀"]
    assert detokenizer.finish() == ""
    half = ours.detokenizer()
    assert [half.push(t) for t in byte_tokens[:2]] == ["", ""]
    assert ours.decode(byte_tokens[:2]) == REPLACEMENT
    assert half.finish() == ""  # the unfinished character is dropped at the end, as vLLM's stream drops it


def test_special_tokens_and_stop_ids(pair: tuple[Tokenizer, Any]) -> None:
    """BOS and EOS come from tokenizer_config.json; the stop ids are the EOS and generation_config's list."""
    ours, theirs = pair
    special = ours.special
    assert special.bos_token_id == theirs.bos_token_id and special.eos_token_id == theirs.eos_token_id
    assert special.tokens == {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    end = ours.backend.token_to_id("<|im_end|>")
    assert special.stop_token_ids == {theirs.eos_token_id, end}
    assert ours.is_stop(end) and not ours.is_stop(special.bos_token_id)
    assert ours.encode("hi")[0] == special.bos_token_id


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A Llama 2 style tokenizer ("▁" spaces, stripped at the very start; byte fallback), Zephyr's template."""
    return load_tokenizer(write_llama_files(tmp_path_factory.mktemp("llama"), chat_template=ZEPHYR))


def test_a_sentencepiece_streams_first_piece_keeps_the_space_it_has_after_the_prompt(
    sentencepiece: Tokenizer, pair: tuple[Tokenizer, Any]
) -> None:
    """vLLM starts its stream from the prompt's ids (tokenizers' `DecodeStream(ids=prompt)`), so the first
    generated "▁Hello" streams as " Hello", as it reads after the prompt: the prompt's decode and the stream's text
    make the decode of the whole sequence (an echo of the prompt's ids and the completion read as one text). A
    decode that starts with "▁Hello" strips its space; a byte-level BPE, whose decoder strips nothing, streams
    the same text with or without the prompt."""
    from tokenizers.decoders import DecodeStream

    prompt = sentencepiece.encode_chat([{"role": "user", "content": "Hi there"}])
    ids = sentencepiece.encode("Hello there! 日本語 🙂", add_special_tokens=False)
    assert sentencepiece.piece(ids[0]).startswith("▁")
    for skip in (True, False):
        pieces = stream(sentencepiece, ids, skip=skip, prompt=prompt)
        peer = DecodeStream(ids=prompt, skip_special_tokens=skip)
        assert pieces[:-1] == [peer.step(sentencepiece.backend, token) or "" for token in ids]
        assert "".join(pieces) == " Hello there! 日本語 🙂"
        whole = sentencepiece.decode(prompt + ids, skip_special_tokens=skip)
        assert sentencepiece.decode(prompt, skip_special_tokens=skip) + "".join(pieces) == whole
    assert "".join(stream(sentencepiece, ids, skip=True)) == "Hello there! 日本語 🙂"  # no prompt: none before it
    assert sentencepiece.detokenizer(prompt=prompt * 20).start < len(prompt)  # a tail of the prompt, not all of it
    byte_level, _ = pair
    prompt = byte_level.encode_chat([{"role": "user", "content": "Hi there"}])
    ids = byte_level.encode(" Hello there! 日本語 🙂", add_special_tokens=False)
    assert "".join(stream(byte_level, ids, skip=True, prompt=prompt)) == "".join(stream(byte_level, ids, skip=True))
    assert "".join(stream(byte_level, ids, skip=True)) == " Hello there! 日本語 🙂"


# Prompt and generated texts: words and spaces, specials, characters the vocabularies lack (byte fallback or split
# byte tokens), and runs of them at a prompt's end (the context's tail may cut a run of fallback bytes).
stream_texts = st.lists(
    st.sampled_from(["Hello", " world", "  ", " ", "\n", "</s>", "<s>", "<|im_end|>", "日", "🦀", "龘", "é", "x", "!"]),
    max_size=12,
).map("".join) | st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)


@settings(max_examples=150, deadline=None)
@given(st.data(), st.booleans(), st.booleans(), stream_texts, stream_texts)
def test_a_stream_after_a_prompt_steps_as_vllms_stream_seeded_with_it(
    sentencepiece: Tokenizer,
    pair: tuple[Tokenizer, Any],
    data: st.DataObject,
    use_sentencepiece: bool,
    skip: bool,
    prompt_text: str,
    text: str,
) -> None:
    """For any prompt and generated text (specials anywhere, characters spelled in fallback bytes or split byte
    tokens, a prompt of specials alone or of none), each push emits what tokenizers' `DecodeStream` seeded with
    the whole prompt (vLLM's fast detokenizer) emits at that step, though the stream holds only the prompt's
    tail: the text never depends on how far back the prompt's context reaches."""
    from tokenizers.decoders import DecodeStream

    tokenizer = sentencepiece if use_sentencepiece else pair[0]
    prompt = tokenizer.encode(prompt_text, add_special_tokens=data.draw(st.booleans()))
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = stream(tokenizer, ids, skip=skip, prompt=prompt)
    peer = DecodeStream(ids=prompt, skip_special_tokens=skip)
    assert pieces[:-1] == [peer.step(tokenizer.backend, token) or "" for token in ids]
    assert pieces[-1] == ""  # the tokens of a text end on a whole character
    whole = tokenizer.decode(prompt + ids, skip_special_tokens=skip)
    assert tokenizer.decode(prompt, skip_special_tokens=skip) + "".join(pieces) == whole


def test_a_prompt_that_ends_inside_a_character_is_no_context(sentencepiece: Tokenizer) -> None:
    """A prompt (ids) cut inside a character decodes to U+FFFD at its end, which no stream could strip off the
    text after it: the stream starts without context and emits the generated text alone (vLLM's stream would
    emit the prompt's text too, as its own prefix then is empty). A prompt whose tail cuts a run of fallback
    bytes decodes whole, so the first piece still keeps its space."""
    fallback = [sentencepiece.backend.token_to_id(f"<0x{byte:02X}>") for byte in "龘".encode()]
    cut = [*sentencepiece.encode("x"), *fallback[:2]]
    ids = sentencepiece.encode("Hello", add_special_tokens=False)
    assert "".join(stream(sentencepiece, ids, skip=True, prompt=cut)) == "Hello"
    run = sentencepiece.encode("x") + fallback * 3  # the last five tokens cut the first character of the run
    assert "".join(stream(sentencepiece, ids, skip=True, prompt=run)) == " Hello"


# transformers' named special tokens (its reference list, not ours), each with the text a config gives it.
NAMED = {
    name: f"<{name.removesuffix('_token')}>" for name in transformers.PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES
}
NAMING = (  # prints every named token the template is given, and says which are defined
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ sep_token }}{% endfor %}"
    "[{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ sep_token }}|{{ pad_token }}|{{ cls_token }}|{{ mask_token }}]"
    "{% if cls_token is defined %}cls{% endif %}{% if mask_token is defined %}mask{% endif %}"
)


@pytest.fixture(scope="module")
def named_backend() -> Any:
    """A byte-level BPE whose vocabulary holds `<s>`, `</s>` and `<sep>` as special tokens, none of the others."""
    backend = Backend(BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>", "<sep>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(TEXT, trainer)
    return backend


@settings(max_examples=25, deadline=None)
@given(st.sets(st.sampled_from(sorted(NAMED))), st.permutations(sorted(NAMED)))
def test_every_named_special_token_is_read_added_and_given_to_the_template_as_transformers_does(
    named_backend: Any, names: set[str], order: list[str]
) -> None:
    """Whichever of transformers' seven named special tokens (bos, eos, unk, sep, pad, cls, mask) the config
    names, in whatever order it lists them: ours has the same ones, adds those the vocabulary lacks as special
    tokens with the same ids (transformers' order, whatever the file's), encodes a text holding them to the same
    ids, and the chat template sees the same variables. A sep, cls or mask token was once neither added (its
    text split into pieces) nor given to the template."""
    with tempfile.TemporaryDirectory() as folder:
        directory = Path(folder)
        named_backend.save(str(directory / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": NAMING}
        config |= {name: NAMED[name] for name in order if name in names}
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
        theirs = transformers.AutoTokenizer.from_pretrained(directory)
        ours = load_tokenizer(directory)
        assert ours.special.tokens == theirs.special_tokens_map
        assert ours.vocab_size == len(theirs)
        for name in names:
            assert ours.backend.token_to_id(NAMED[name]) == theirs.convert_tokens_to_ids(NAMED[name]), name
        text = "Hello " + " world ".join(NAMED.values())
        assert ours.encode(text) == theirs(text)["input_ids"]
        for skip in (True, False):
            ids = ours.encode(text)
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
        messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "world"}]
        assert ours.render_chat(messages) == theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )


@pytest.mark.parametrize("template", [CHATML, LLAMA3], ids=["chatml", "llama3"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_the_chat_template_renders_what_transformers_renders(
    tmp_path: Path, template: str, generation_prompt: bool
) -> None:
    """`render_chat` is `apply_chat_template(..., tokenize=False)`, and `encode_chat` its ids."""
    theirs = save_tokenizer(tmp_path, template)
    ours = load_tokenizer(tmp_path)
    for messages in (MESSAGES, MESSAGES[1:2], MESSAGES * 3):
        expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        assert ours.render_chat(messages, add_generation_prompt=generation_prompt) == expected
        ids = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
        ids = ids["input_ids"] if isinstance(ids, Mapping) else ids
        assert ours.encode_chat(messages, add_generation_prompt=generation_prompt) == list(ids)


@pytest.mark.parametrize("template", [CHATML, LLAMA3], ids=["chatml", "llama3"])
def test_a_final_message_is_continued_as_transformers_continues_it(tmp_path: Path, template: str) -> None:
    """`continue_final_message`: the prompt ends right after the final message's text, as
    `apply_chat_template(continue_final_message=True)` renders it, a text with trailing spaces too (LLAMA3 trims
    it: the cut is then trimmed); with `add_generation_prompt` too, or a template that renders no final message
    text, an `InvalidRequestError`."""
    theirs = save_tokenizer(tmp_path, template)
    ours = load_tokenizer(tmp_path)
    for final in ("The answer is", "The answer is  ", "4."):
        messages = [*MESSAGES[:2], {"role": "assistant", "content": final}]
        options = {"add_generation_prompt": False, "continue_final_message": True}
        expected = theirs.apply_chat_template(messages, tokenize=False, **options)
        assert ours.render_chat(messages, **options) == expected, final
        ids = theirs.apply_chat_template(messages, tokenize=True, **options)
        assert ours.encode_chat(messages, **options) == list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
    with pytest.raises(InvalidRequestError, match="cannot both be true"):
        ours.render_chat(MESSAGES, continue_final_message=True)
    silent = save_tokenizer(tmp_path / "silent", "{% for m in messages %}[{{ m['role'] }}]{% endfor %}")
    assert silent is not None
    with pytest.raises(InvalidRequestError, match="final message"):
        load_tokenizer(tmp_path / "silent").render_chat(
            MESSAGES, add_generation_prompt=False, continue_final_message=True
        )


def test_a_requests_template_variables_render_as_transformers_renders_them(tmp_path: Path) -> None:
    """Extra variables (vLLM's chat_template_kwargs) reach the template as apply_chat_template's keyword arguments
    do; one setting the template's own inputs, or of a kind the template fails on, is an InvalidRequestError."""
    template = "{% if greet %}hello {% for word in greet %}{{ word | upper }}{% endfor %}\n{% endif %}" + CHATML
    theirs = save_tokenizer(tmp_path, template)
    ours = load_tokenizer(tmp_path)
    expected = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, greet="there")
    assert ours.render_chat(MESSAGES, greet=["there"]) == theirs.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True, greet=["there"]
    )
    assert expected.startswith("hello THERE")
    assert ours.render_chat(MESSAGES) == theirs.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    for own in ({"eos_token": 5}, {"raise_exception": "x"}):
        with pytest.raises(InvalidRequestError, match=f"may not set {next(iter(own))}"):
            ours.render_chat(MESSAGES, **own)
    with pytest.raises(InvalidRequestError, match="failed on the messages or variables"):
        ours.render_chat(MESSAGES, greet=5)  # a loop over an int


def test_the_template_field_of_the_config_is_read_too(tmp_path: Path) -> None:
    """A checkpoint saved before chat_template.jinja existed keeps its template in tokenizer_config.json."""
    save_tokenizer(tmp_path, CHATML)
    (tmp_path / "chat_template.jinja").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": CHATML}, {"name": "tool_use", "template": "x"}]
    config["bos_token"] = {"content": "<s>", "lstrip": False, "normalized": False}  # an AddedToken object
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = load_tokenizer(tmp_path)
    assert ours.chat_template == CHATML and ours.special.tokens["bos_token"] == "<s>"


ZEPHYR = (  # TinyLlama-Chat's template: text right after each special token
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
SENTENCEPIECE_TEXT = [*TEXT, "<|user|>\nHi there</s>\n<|assistant|>\nHello!</s>", "  two  spaces, \n a newline"]


def write_llama_files(
    directory: Path,
    *,
    texts: list[str] = SENTENCEPIECE_TEXT,
    vocab_size: int = 700,
    drop_added: tuple[str, ...] = (),
    **config: Any,
) -> Path:
    """A Llama 2 style tokenizer.json (BPE with byte fallback, SentencePiece's normalizer and decoder, a BOS
    post-processor) trained on `texts`, and a `LlamaTokenizer` tokenizer_config.json (plus `config`);
    `drop_added`: special tokens kept in the vocabulary but left out of the file's added tokens (as some converted
    checkpoints ship them)."""
    from tokenizers import normalizers

    specials = ["<unk>", "<s>", "</s>"]
    backend = Backend(BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]  # given ids first, as in Llama 2's vocabulary
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[*specials, *bytes_])
    backend.train_from_iterator(texts, trainer)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", backend.token_to_id("<s>"))]
    )
    directory.mkdir(parents=True, exist_ok=True)
    data = json.loads(backend.to_str())
    # The fallback bytes are vocabulary, not added tokens (as in Llama 2's file): a decode skipping specials keeps them.
    kept = [token for token in data["added_tokens"] if not token["content"].startswith("<0x")]
    data["added_tokens"] = [token for token in kept if token["content"] not in drop_added]
    (directory / "tokenizer.json").write_text(json.dumps(data))
    fields = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (directory / "tokenizer_config.json").write_text(json.dumps({**fields, **config}))
    return directory


def save_llama_tokenizer(directory: Path, **config: Any) -> Any:
    """`write_llama_files` with the Zephyr template (plus `config`); transformers' tokenizer of the files."""
    return transformers.AutoTokenizer.from_pretrained(write_llama_files(directory, chat_template=ZEPHYR, **config))


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"legacy": False},
        {"legacy": True},
        {"add_prefix_space": False},
        {"add_bos_token": True, "add_eos_token": True},
    ],
    ids=["plain", "legacy-false", "legacy-true", "no-prefix-space", "bos-eos-flags"],
)
def test_a_llama_tokenizer_is_rebuilt_as_transformers_rebuilds_it(tmp_path: Path, config: dict[str, Any]) -> None:
    """transformers v5 rebuilds a `LlamaTokenizer`'s tokenizer.json (TinyLlama, Llama 2, Mistral v0.x): encode,
    decode and the chat template's ids equal its, at text after a special token and at leading or doubled spaces
    too (where the file's own normalizer would add a "▁")."""
    theirs = save_llama_tokenizer(tmp_path / "llama", **config)
    ours = load_tokenizer(tmp_path / "llama")
    for text in [*SENTENCEPIECE_TEXT[-3:], " Hello  world", "Hi</s>there", "\nHello", "日本 🙂", ""]:
        ids = ours.encode(text)
        assert ids == theirs(text).input_ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
    chat = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
    expected = theirs.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    expected = list(expected["input_ids"]) if hasattr(expected, "keys") else list(expected)
    assert ours.encode_chat(chat) == expected


ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# (model_type of config.json or None for none, tokenizer.json's style, tokenizer_config.json's fields): the checkpoints
# whose tokenizer transformers v5 builds by model type and file, not by the declared class alone.
CHECKPOINTS = {
    # Mistral v0.x declares a LlamaTokenizer; transformers takes the file as written (its normalizer adds a "▁" after
    # a special token, which the LlamaTokenizer rebuild would not).
    "mistral-v0": ("mistral", "sentencepiece", {"tokenizer_class": "LlamaTokenizer"}),
    # DeepSeek-R1-Distill-Llama: a byte-level file declared as LlamaTokenizerFast: as written.
    "r1-distill-llama": ("llama", "byte-level", {"tokenizer_class": "LlamaTokenizerFast", "add_bos_token": True}),
    # DeepSeek-R1-Distill-Qwen declares LlamaTokenizerFast; every qwen2 model's tokenizer is a Qwen2Tokenizer.
    "r1-distill-qwen": ("qwen2", "byte-level", {"tokenizer_class": "LlamaTokenizerFast", "legacy": True}),
    # Qwen2.5: Qwen2Tokenizer, EOS left to the class's default (<|endoftext|>, added to the vocabulary here).
    "qwen2.5": ("qwen2", "byte-level", {"tokenizer_class": "Qwen2Tokenizer", "eos_token": None, "bos_token": None}),
    "qwen2-prefix-space": ("qwen2", "byte-level", {"tokenizer_class": "Qwen2Tokenizer", "add_prefix_space": True}),
    "qwen2-tokenizer-alone": (None, "byte-level", {"tokenizer_class": "Qwen2TokenizerFast"}),
    # SmolLM2: a Llama model with a GPT2Tokenizer (BOS and EOS default to <|endoftext|>).
    "smollm2": ("llama", "byte-level", {"tokenizer_class": "GPT2Tokenizer", "bos_token": None, "eos_token": None}),
    "gpt2-prefix-space": ("llama", "byte-level", {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": True}),
    "llama-3": ("llama", "byte-level", {"tokenizer_class": "PreTrainedTokenizerFast"}),
    "tinyllama": ("llama", "sentencepiece", {"tokenizer_class": "LlamaTokenizer"}),
    "mistral-declaring-qwen2": ("mistral", "byte-level", {"tokenizer_class": "Qwen2Tokenizer"}),
    # Code Llama: a LlamaTokenizer whose "▁" goes before the first piece whatever `legacy` says, and whose
    # infilling tokens (<FILL_ME> new to this vocabulary) are special.
    "codellama": ("llama", "sentencepiece", {"tokenizer_class": "CodeLlamaTokenizer", "legacy": True}),
}
CHECKPOINT_TEXT = [
    *SENTENCEPIECE_TEXT[-3:],
    " Hello  world",
    "Hi</s>there",
    "a<|endoftext|>b",
    "e\u0301 cafe\u0301",
    "",
]


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_a_checkpoints_tokenizer_is_the_one_autotokenizer_loads(tmp_path: Path, name: str) -> None:
    """transformers' AutoTokenizer chooses the class by config.json's model type as well as the declared class,
    and a Llama, Qwen2 or GPT-2 class rebuilds the file's pipeline (each case's comment says which); encode, decode,
    the named special tokens, their ids and the vocabulary's size equal its. The files of each case differ from
    the class's rebuild, so taking the wrong one shows."""
    model_type, style, fields = CHECKPOINTS[name]
    directory = tmp_path / name
    if style == "sentencepiece":
        write_llama_files(directory)
    else:
        save_tokenizer(directory, CHATML)  # GPT-2's split and no NFC: unlike Qwen2Tokenizer's rebuild
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for key, value in fields.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    config_path.write_text(json.dumps(config))
    if model_type is not None:
        (directory / "config.json").write_text(
            json.dumps({"model_type": model_type, "architectures": [ARCHITECTURES[model_type]], "vocab_size": 1000})
        )
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    ours = load_tokenizer(directory)
    for text in CHECKPOINT_TEXT:
        ids = ours.encode(text)
        assert ids == theirs(text).input_ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
        assert [ours.piece(t) for t in ids] == theirs.convert_ids_to_tokens(ids), text
    for key in _SPECIAL_NAMES:
        assert ours.special.tokens.get(key) == getattr(theirs, key), key
    assert (ours.special.bos_token_id, ours.special.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert ours.vocab_size == len(theirs)


@pytest.mark.parametrize("model_type", ["mistral", "llama"])
def test_what_a_file_carries_beside_its_pipeline_is_read_as_autotokenizer_reads_it(
    tmp_path: Path, model_type: str
) -> None:
    """A tokenizer.json saved after a truncating, padding call keeps both settings: transformers turns them off
    for every encoding, and so does this (a long prompt is never cut). A named special token the file does not
    list among its added tokens (some converted checkpoints drop "</s>") becomes one, matched whole in text; one
    the vocabulary lacks altogether (a `pad_token` of its own) gets the next id. Taken as written (Mistral) or
    rebuilt (Llama), encode, decode, the special tokens and the size equal AutoTokenizer's."""
    directory = write_llama_files(tmp_path / model_type, drop_added=("</s>",), pad_token="<pad>")
    data = json.loads((directory / "tokenizer.json").read_text())
    data["truncation"] = {"direction": "Right", "max_length": 6, "strategy": "LongestFirst", "stride": 0}
    data["padding"] = {
        "strategy": {"Fixed": 40},
        "direction": "Left",
        "pad_to_multiple_of": None,
        "pad_id": 0,
        "pad_type_id": 0,
        "pad_token": "<unk>",
    }
    (directory / "tokenizer.json").write_text(json.dumps(data))
    (directory / "config.json").write_text(json.dumps({"model_type": model_type}))
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    ours = load_tokenizer(directory)
    long = "jumps over naïve dogs, déjà vu: a quick fox"
    for text in [*CHECKPOINT_TEXT, "a <pad> b", long]:
        ids = ours.encode(text)
        assert ids == theirs(text).input_ids, text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True), text
    assert 6 < len(ours.encode(long)) < 40  # neither cut at 6 nor padded to 40
    assert ours.special.tokens["pad_token"] == "<pad>" and ours.vocab_size == len(theirs)
    assert (ours.special.eos_token_id, ours.backend.token_to_id("<pad>")) == (theirs.eos_token_id, theirs.pad_token_id)


def test_a_lone_tokens_text_is_vllms(pair: tuple[Tokenizer, Any], tmp_path: Path) -> None:
    """`token_text` (a token's text beside its log-probability) is transformers' `decode([id])` with the leading
    spaces its piece's "▁" marks stand for, which decoding a lone SentencePiece piece strips (vLLM's
    rule): for a byte-level BPE, whose decoder keeps them, it is `decode([id])` itself; for a Llama tokenizer, a
    word piece keeps its space (" Hello", not "Hello"), special tokens read as decoded. A byte of a character
    with nothing sampled before it (no context) reads "" (vLLM's, where the decode ends in U+FFFD)."""

    def lone(text: str) -> str:
        return "" if text.endswith(REPLACEMENT) else text

    ours, theirs = pair
    every = range(ours.vocab_size)
    assert [ours.token_text(t) for t in every] == [lone(theirs.decode([t])) for t in every]
    llama = load_tokenizer(write_llama_files(tmp_path / "llama"))
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path / "llama")
    for tokenizer, transformers_one in ((ours, theirs), (llama, reference)):  # the pieces /tokenize lists
        every = list(range(tokenizer.vocab_size))
        assert [tokenizer.piece(t) for t in every] == transformers_one.convert_ids_to_tokens(every)
    restored = 0
    for t in range(llama.vocab_size):
        piece, text = reference.convert_ids_to_tokens(t), reference.decode([t])
        marks = len(piece) - len(piece.lstrip("▁"))
        expected = lone(" " * max(0, marks - (len(text) - len(text.lstrip(" ")))) + text)
        assert llama.token_text(t) == expected, (t, piece)
        restored += expected != text
    assert restored > 20  # word pieces whose lone decode lost its space: the case this is about
    assert llama.token_text(reference.convert_tokens_to_ids("</s>")) == "</s>"


def test_sampling_defaults_are_the_generation_configs(tmp_path: Path) -> None:
    """temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (as max_tokens) of
    generation_config.json, as vLLM's server defaults a request to them (Qwen2.5's file sets all but min_p and
    the last one); a top_k of 50 counts too (transformers 5 has no default of its own that vLLM would leave
    out); nothing without the file or the keys; a value out of range names the file and the key."""
    assert sampling_defaults(tmp_path) == {}
    generation = tmp_path / "generation_config.json"
    generation.write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.9, "eos_token_id": 2}))
    assert sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.9}
    qwen = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "min_p": 0.05}
    generation.write_text(json.dumps(qwen))
    assert sampling_defaults(tmp_path) == qwen
    generation.write_text(json.dumps({"top_k": 50, "temperature": 0.6, "top_p": 0.9, "eos_token_id": 2}))
    assert sampling_defaults(tmp_path) == {"top_k": 50, "temperature": 0.6, "top_p": 0.9}
    generation.write_text(json.dumps({"max_new_tokens": 64}))
    assert sampling_defaults(tmp_path) == {"max_tokens": 64}
    generation.write_text(json.dumps({"top_k": -1}))
    assert sampling_defaults(tmp_path) == {"top_k": 0}
    bad_values = [{"temperature": -1}, {"temperature": "0.7"}, {"top_p": 0}, {"top_p": 1.5}, {"temperature": True}]
    bad_values += [{"top_k": -2}, {"top_k": 2.5}, {"min_p": 1.5}, {"repetition_penalty": 0}]
    bad_values += [{"max_new_tokens": 0}, {"max_new_tokens": 8.5}]
    for bad in bad_values:
        generation.write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=f"generation_config.json: {next(iter(bad))} must be"):
            sampling_defaults(tmp_path)


def test_refusals(tmp_path: Path) -> None:
    """No tokenizer.json, a special token that is not a string, a template that does not compile, no template,
    and a template's raise_exception: each a one-line error."""
    with pytest.raises(ConfigError, match=r"tokenizer\.json is not a readable tokenizer"):
        load_tokenizer(tmp_path)
    save_tokenizer(tmp_path, CHATML)
    with pytest.raises(InvalidRequestError, match="bad role tool"):
        load_tokenizer(tmp_path).render_chat([{"role": "tool", "content": "x"}])
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "eos_token": ["</s>"]}))
    with pytest.raises(ConfigError, match=r"eos_token=\['</s>'\] is not a token"):
        load_tokenizer(tmp_path)
    config_path.write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match="does not compile"):
        load_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(ConfigError, match="has no chat template"):
        load_tokenizer(tmp_path).render_chat(MESSAGES)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(ConfigError, match="eos_token_id must be a token id"):
        load_tokenizer(tmp_path)


# The packages of the hf extra (and torch): absent from a plain install.
BLOCKED = {"jinja2", "safetensors", "tokenizers", "torch", "transformers"}

WITHOUT_HF = textwrap.dedent(
    """
    import importlib.abc, json, sys

    class NotInstalled(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
            return None

    sys.meta_path.insert(0, NotInstalled())
    import mooncake, mooncake.engine
    from mooncake.engine import read_model_config
    from mooncake.engine.checkpoint import model_config_from_hf
    from mooncake.engine.tokenizer import load_tokenizer
    from mooncake.errors import ConfigError

    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 2, "intermediate_size": 4}
    try:
        load_tokenizer(".")
        missing = None
    except ConfigError as error:  # naming the hf extra, caused by the failed import
        missing = error.__cause__.name
    print(json.dumps({
        "layers": model_config_from_hf(raw, name="m").num_layers,
        "missing": missing,
        "loaded": sorted(name for name in sys.modules if name.split(".")[0] in BLOCKED),
    }))
    """
)


def test_the_modules_import_without_the_hf_extra() -> None:
    """Without safetensors, tokenizers, jinja2 or torch, the checkpoint and tokenizer modules import and a
    config reads; loading a tokenizer then says which package is missing."""
    script = f"BLOCKED = {BLOCKED!r}\n{WITHOUT_HF}"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"layers": 1, "missing": "tokenizers", "loaded": []}
