"""Tests for the special tokens `load_tokenizer` adds beyond the named seven (`extra_special_tokens`).

transformers (v5) adds every token of its `all_special_tokens` that the file's added tokens lack: the named ones
(BOS, EOS, ...), then those of `extra_special_tokens` (or its older name `additional_special_tokens`), from
tokenizer_config.json, or from special_tokens_map.json where the config has no `added_tokens_decoder`. vLLM
(0.32) loads through transformers, so a chat's `<tool_call>` is one token there. The tokenizer here is built by
hand (a byte-level BPE over the 256 bytes, no merges; "<s>", "</s>" and "<|im_end|>" added at 256, 257, 258), so
each case's ids are written out and checked without transformers; where transformers is installed, its
`AutoTokenizer` over the same files must give the same ids and size (so the written ids are transformers').
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tokenizers")

from tokenizers import AddedToken, decoders, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from mooncake.engine.tokenizer import load_tokenizer
from mooncake.errors import ConfigError

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a test never reaches the network

TEXT = "a<tool_call>b<|im_end|><think>"
A, B = 97, 98  # the byte tokens of "a" and "b"
IM_END = 258


def byte_alphabet() -> list[str]:
    """GPT-2's characters for the bytes 0-255, in byte order (a byte-level vocabulary's base)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def write_byte_level(
    directory: Path, *, merges: tuple[tuple[str, str], ...] = (), added: tuple[tuple[str, bool], ...] = ()
) -> Any:
    """A byte-level BPE's tokenizer.json in `directory`: the bytes as ids 0-255, `merges` (each new piece the next
    id), then "<s>", "</s>", "<|im_end|>" (special) and `added` (content, special)."""
    vocab = {c: i for i, c in enumerate(byte_alphabet())}
    for first, second in merges:
        vocab.setdefault(first + second, len(vocab))
    backend = Backend(BPE(vocab=vocab, merges=list(merges)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<s>", "</s>", "<|im_end|>")])
    for content, special in added:
        token = AddedToken(content, special=special, normalized=False)
        (backend.add_special_tokens if special else backend.add_tokens)([token])
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    return backend


def autotokenizer(directory: Path) -> Any:
    """transformers' `AutoTokenizer` of the files, or None where transformers is not installed (the written ids
    are then checked alone)."""
    try:
        import transformers
    except ImportError:
        return None
    return transformers.AutoTokenizer.from_pretrained(directory)


def write_case(directory: Path, config: dict[str, Any], legacy: dict[str, Any] | None = None, **options: Any) -> Path:
    write_byte_level(directory, **options)
    base = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    (directory / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
    if legacy is not None:
        (directory / "special_tokens_map.json").write_text(json.dumps(legacy))
    return directory


def decoder_entries(directory: Path) -> dict[str, Any]:
    """tokenizer_config.json's `added_tokens_decoder` for the file's added tokens (as transformers saves one)."""
    data = json.loads((directory / "tokenizer.json").read_text())
    keys = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
    return {str(t["id"]): {k: t[k] for k in keys} for t in data["added_tokens"]}


TOOL = {
    "__type": "AddedToken",
    "content": "<tool_call>",
    "lstrip": False,
    "rstrip": False,
    "normalized": False,
    "special": True,
}
TOOL_BYTES = [60, 116, 111, 111, 108, 95, 99, 97, 108, 108, 62]  # "<tool_call>" as bytes, where it is no token
THINK_BYTES = [60, 116, 104, 105, 110, 107, 62]  # "<think>" as bytes
# (config, special_tokens_map.json or None, the ids of TEXT, the vocabulary's size)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any] | None, list[int], int]] = {
    # The older name: <tool_call> is new (259); <|im_end|> is an added token already.
    "additional": (
        {"additional_special_tokens": ["<tool_call>", "<|im_end|>"]},
        None,
        [A, 259, B, IM_END, *THINK_BYTES],
        260,
    ),
    "extra": ({"extra_special_tokens": ["<tool_call>", "<|im_end|>"]}, None, [A, 259, B, IM_END, *THINK_BYTES], 260),
    # Serialized AddedTokens (as transformers writes one) count by their content.
    "added-token-object": ({"extra_special_tokens": [TOOL]}, None, [A, 259, B, IM_END, *THINK_BYTES], 260),
    # The named ones first (transformers' order), so a missing PAD takes 259 and <tool_call> 260.
    "named-first": (
        {"pad_token": "<pad>", "extra_special_tokens": ["<tool_call>"]},
        None,
        [A, 260, B, IM_END, *THINK_BYTES],
        261,
    ),
    # Both names: the newer one's list wins where it is not empty ...
    "both": (
        {"extra_special_tokens": ["<think>"], "additional_special_tokens": ["<tool_call>"]},
        None,
        [A, *TOOL_BYTES, B, IM_END, 259],
        260,
    ),
    # ... and the older one counts where it is empty.
    "empty-extra": (
        {"extra_special_tokens": [], "additional_special_tokens": ["<tool_call>"]},
        None,
        [A, 259, B, IM_END, *THINK_BYTES],
        260,
    ),
    # Without an added_tokens_decoder the legacy map is read: its list, in its order.
    "legacy-map": ({}, {"additional_special_tokens": ["<think>", "<tool_call>"]}, [A, 260, B, IM_END, 259], 261),
    # The map's extra_special_tokens are appended to the config's (those not listed yet).
    "legacy-merge": (
        {"extra_special_tokens": ["<tool_call>"]},
        {"extra_special_tokens": ["<think>", "<tool_call>"]},
        [A, 259, B, IM_END, 260],
        261,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_extra_special_tokens_are_added_as_transformers_adds_them(tmp_path: Path, name: str) -> None:
    """Each case's ids and vocabulary size are the written ones (transformers', checked where it is installed);
    a token listed twice or already added gets no second id; the extra ones are special (a decode that skips
    special tokens leaves them out)."""
    config, legacy, expected, size = CASES[name]
    directory = write_case(tmp_path / name, config, legacy)
    ours = load_tokenizer(directory)
    ids = ours.encode(TEXT, add_special_tokens=False)
    assert (ids, ours.vocab_size) == (expected, size)
    added = ours.backend.get_added_tokens_decoder()
    assert all(added[i].special for i in range(259, size))
    theirs = autotokenizer(directory)
    if theirs is not None:
        assert theirs.encode(TEXT, add_special_tokens=False) == ids and len(theirs) == ours.vocab_size


def test_the_legacy_map_is_not_read_beside_an_added_tokens_decoder(tmp_path: Path) -> None:
    """A config with `added_tokens_decoder` is the whole record (transformers reads special_tokens_map.json only
    without one): the map's extra tokens are not added."""
    directory = tmp_path / "decoder"
    write_byte_level(directory)
    config = {"added_tokens_decoder": decoder_entries(directory)}
    write_case(directory, config, {"additional_special_tokens": ["<tool_call>"]})
    ours = load_tokenizer(directory)
    assert ours.vocab_size == 259 and len(ours.encode("<tool_call>", add_special_tokens=False)) == 11
    theirs = autotokenizer(directory)
    assert theirs is None or len(theirs) == 259


def test_a_listed_token_already_added_as_text_stays_text(tmp_path: Path) -> None:
    """An extra special token the file adds as a plain (not special) token keeps its id and stays plain: a
    decode that skips special tokens keeps it, as transformers' does."""
    directory = write_case(tmp_path / "plain", {"additional_special_tokens": ["<think>"]}, added=(("<think>", False),))
    ours = load_tokenizer(directory)
    ids = ours.encode("a<think>b", add_special_tokens=False)
    assert ids == [A, 259, B] and ours.vocab_size == 260
    assert ours.decode(ids, skip_special_tokens=True) == "a<think>b"
    theirs = autotokenizer(directory)
    assert theirs is None or theirs.decode(ids, skip_special_tokens=True) == "a<think>b"


@pytest.mark.parametrize(
    ("config", "legacy", "file"),
    [
        ({"extra_special_tokens": ["<ok>", 5]}, None, "tokenizer_config.json"),
        ({"additional_special_tokens": "<tool_call>"}, None, "tokenizer_config.json"),
        ({}, {"extra_special_tokens": [{"lstrip": True}]}, "special_tokens_map.json"),
    ],
)
def test_an_extra_special_token_that_is_no_token_is_refused(
    tmp_path: Path, config: dict[str, Any], legacy: dict[str, Any] | None, file: str
) -> None:
    """An entry that is not a string (nor an AddedToken with a content), or a list that is not one, is a
    ConfigError naming the file it came from."""
    directory = write_case(tmp_path / "bad", config, legacy)
    with pytest.raises(ConfigError, match=file):
        load_tokenizer(directory)
