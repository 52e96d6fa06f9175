"""Tests for the text vLLM (0.32) shows of tokens: beside a log-probability (`Tokenizer.token_text`) and at the
end of a generation (`Detokenizer.finish`).

vLLM's rules, from its `LogprobsProcessor` and its detokenizer: a token whose lone decode ends in U+FFFD (a byte
of a character) is decoded again after the 1 to 4 tokens sampled before it; the first decode that ends on a
whole character gives its text (less the text of the context before its run of byte tokens), else it reads ""
(`mooncake.engine.logprobs.completed_text`). A "▁" of a SentencePiece piece becomes a leading space only where
the pre-tokenizer is (or holds) a Metaspace (`get_leading_space_marker`): a Mistral file that marks spaces by
its normalizer shows the lone decode. A generation cut inside a character ends with the character before it:
its stream never emits the incomplete bytes, and nothing is flushed at the end. The tokenizers are built by
hand, so every id is written out; the expected texts are those vLLM 0.32 gives for the same files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("tokenizers")

from tokenizers import AddedToken, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from mooncake.engine.tokenizer import REPLACEMENT, Tokenizer, load_tokenizer
from tests.engine.test_tokenizer_specials import byte_alphabet, write_byte_level

# "Hello 龘 world": "He" "llo" from merges, " " then the three bytes of 龘 (E9 BE 98), " w" "orld".
MERGES = (("H", "e"), ("l", "l"), ("ll", "o"), ("Ġ", "w"), ("o", "r"), ("or", "l"), ("orl", "d"))
HELLO_IDS = [256, 258, 32, 0xE9, 0xBE, 0x98, 259, 262]
HELLO_TEXTS = ["He", "llo", " ", "", "", "龘", " w", "orld"]  # vLLM 0.32's, sampled in this order


def save_dir(directory: Path, backend: Any, config: dict[str, Any] | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A byte-level BPE: the bytes as ids 0-255, MERGES' pieces from 256 (special "<s>", "</s>", "<|im_end|>"
    after them)."""
    directory = tmp_path_factory.mktemp("byte-level")
    write_byte_level(directory, merges=MERGES)
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return load_tokenizer(directory)


def test_a_character_split_across_byte_tokens_shows_at_its_last_byte(byte_level: Tokenizer) -> None:
    """Each sampled token's text after the tokens sampled before it is vLLM's: the first two bytes of 龘 read ""
    and the third the whole character; without context a byte reads "" (never U+FFFD)."""
    ids = byte_level.encode("Hello 龘 world", add_special_tokens=False)
    assert ids == HELLO_IDS
    assert [byte_level.token_text(t, context=ids[:i]) for i, t in enumerate(ids)] == HELLO_TEXTS
    assert byte_level.token_text(0x98) == ""  # nothing before it: no character to complete
    assert byte_level.decode([0x98]) == REPLACEMENT


def test_an_alternative_is_read_after_the_sampled_tokens_before_it(byte_level: Tokenizer) -> None:
    """The tokens beside a sampled one at its place are read after the same sampled tokens: another last byte
    completes another character, a byte that completes nothing reads "", a whole token its own text."""
    context = byte_level.encode("Hi 龘", add_special_tokens=False)[:-1]  # ... E9 BE: the character's first bytes
    assert byte_level.token_text(0x99, context=context) == bytes([0xE9, 0xBE, 0x99]).decode()
    assert byte_level.token_text(0xE9, context=context) == ""
    assert byte_level.token_text(256, context=context) == "He"
    apart = [0xE9, 0xBE, *byte_level.encode("orld", add_special_tokens=False)]
    assert byte_level.token_text(0x98, context=apart) == ""  # its first bytes are not right before it


@given(st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=24))
def test_the_texts_of_sampled_tokens_join_to_the_text(byte_level: Tokenizer, text: str) -> None:
    """For the tokens of any text, each read after the tokens before it, the texts join to the text and none
    holds U+FFFD: a character shows once, whole, at its last byte."""
    ids = byte_level.encode(text, add_special_tokens=False)
    texts = [byte_level.token_text(t, context=ids[:i]) for i, t in enumerate(ids)]
    assert "".join(texts) == text
    assert not any(REPLACEMENT in piece for piece in texts) or REPLACEMENT in text


def test_a_generation_cut_inside_a_character_ends_before_it(byte_level: Tokenizer) -> None:
    """ " ok 龘" cut (max_tokens) after the first two bytes of 龘 streams " ok " and `finish` adds nothing (vLLM
    ends its output with what its stream emitted, where a decode would end with U+FFFD)."""
    prompt = byte_level.encode("Hi", add_special_tokens=False)
    ids = byte_level.encode(" ok 龘", add_special_tokens=False)[:-1]
    detokenizer = byte_level.detokenizer(prompt=prompt)
    pieces = [detokenizer.push(t) for t in ids]
    assert "".join(pieces) == " ok " and detokenizer.finish() == ""
    detokenizer.check_invariants()
    assert byte_level.decode(ids).endswith(REPLACEMENT)


@given(
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters="<"), max_size=16), st.data()
)
def test_a_stream_cut_anywhere_is_the_whole_characters_before_the_cut(
    byte_level: Tokenizer, text: str, data: st.DataObject
) -> None:
    """The tokens of any text (no special token in it), cut after any token: the stream's text (pieces, then
    `finish`) is the bytes of the tokens up to the cut with an incomplete character at their end dropped
    (Python's UTF-8 decoder as the reference)."""
    alphabet = byte_alphabet()
    ids = byte_level.encode(text, add_special_tokens=False)
    cut = data.draw(st.integers(0, len(ids)))
    detokenizer = byte_level.detokenizer()
    streamed = "".join(detokenizer.push(t) for t in ids[:cut]) + detokenizer.finish()
    head = bytes(alphabet.index(c) for t in ids[:cut] for c in byte_level.piece(t))
    assert streamed == head.decode("utf-8", errors="ignore")
    assert text.startswith(streamed)


def sentencepiece_backend(*, metaspace: str | None) -> Any:
    """A SentencePiece-style BPE (byte fallback, "▁" for spaces, SentencePiece's decoder that strips the first
    space): `metaspace` "alone" or "in-sequence" marks spaces by a Metaspace pre-tokenizer (Llama), None by the
    normalizer (Mistral's files: Prepend and Replace)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("▁", "▁Hello", "▁▁", "world"):
        vocab[piece] = len(vocab)
    backend = Backend(BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    meta = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    if metaspace == "alone":
        backend.pre_tokenizer = meta
    elif metaspace == "in-sequence":
        backend.pre_tokenizer = pre_tokenizers.Sequence([meta])
    else:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    return backend


# "▁", "▁Hello", "▁▁", "world", then "▁" and 龘 in fallback bytes: vLLM 0.32's texts of the sequence.
PIECES = [259, 260, 261, 262, 259, 3 + 0xE9, 3 + 0xBE, 3 + 0x98]
METASPACE_TEXTS = [" ", " Hello", "  ", "world", " ", "", "", "龘"]
NORMALIZER_TEXTS = ["", "Hello", " ", "world", "", "", "", "龘"]


@pytest.mark.parametrize(
    ("metaspace", "config", "expected"),
    [
        ("alone", None, METASPACE_TEXTS),
        ("in-sequence", None, METASPACE_TEXTS),
        (None, {"model_type": "mistral"}, NORMALIZER_TEXTS),
    ],
)
def test_a_pieces_leading_space_shows_where_a_metaspace_marks_it(
    tmp_path: Path, metaspace: str | None, config: dict[str, Any] | None, expected: list[str]
) -> None:
    """A piece's "▁" reads as the leading space a lone decode strips where the pre-tokenizer is a Metaspace, or a
    Sequence holding one (Llama); a Mistral file whose normalizer marks the spaces shows the lone decode, as
    vLLM's `get_leading_space_marker` finds no marker there. Fallback bytes complete after the context either
    way."""
    tokenizer = load_tokenizer(save_dir(tmp_path / "sp", sentencepiece_backend(metaspace=metaspace), config))
    assert [tokenizer.piece(t) for t in PIECES[:4]] == ["▁", "▁Hello", "▁▁", "world"]
    assert [tokenizer.token_text(t) for t in PIECES[:4]] == expected[:4]  # whole pieces: no context needed
    assert [tokenizer.token_text(t, context=PIECES[:i]) for i, t in enumerate(PIECES)] == expected
