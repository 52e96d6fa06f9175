"""A prompt's text and its tokens at the gateway (examples/serving/tokenizer.py and api.py) with real tokenizers.

What each test proves: /detokenize decodes every id, a checkpoint's EOS and special tokens included, as vLLM's
(`tokenizer.decode`), where a generation's text stream would end at the EOS. `fewest_tokens` is a lower bound of a
text's tokens, for any text, on the pipelines real checkpoints use (GPT-2's byte-level BPE, Qwen2's NFC and split,
Llama's SentencePiece BPE with byte fallback and its legacy normalizer), and no bound (0) on the pipelines that drop
characters or cover a run of them with one token, where a bound would refuse prompts that fit. A prompt certainly
over the limit is refused with the limit check's 400 before it is tokenized; any prompt that fits gets exactly the
tokens it got before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

pytest.importorskip("aiohttp")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from serving.api import ApiError, ServedModel, detokenize_body, parse_chat, parse_completion, prompt_tokens
from serving.tokenizer import ByteTokenizer, CheckpointTokenizer
from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE, WordPiece

from mooncake.engine.tokenizer import SpecialTokens, Tokenizer, load_tokenizer

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog. Héllo wörld, naïve café — déjà vu.",
    "Serving a model: prefill, then decode, token by token. 日本語 and 🙂 too. 한국어 글자.",
    "    indented code = [1, 2, 3]  # spaces and digits 0123456789",
] * 20
SPECIALS = ["<s>", "</s>", "<|im_end|>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def trained(
    *, normalizer: Any = None, pre_tokenizer: Any = None, byte_fallback: bool = False, added: tuple[str, ...] = ()
) -> CheckpointTokenizer:
    """A BPE trained on CORPUS with the given pipeline (byte-level ones get every byte's character, byte-fallback
    ones every `<0xNN>` piece), and `added` tokens as transformers' `add_tokens` adds them (normalized: matched in
    the normalized text), wrapped as the gateway wraps a checkpoint's."""
    backend = Backend(BPE(byte_fallback=byte_fallback, fuse_unk=byte_fallback, unk_token=None))
    backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    alphabet = pre_tokenizers.ByteLevel.alphabet() if byte_fallback is False else []
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS + (BYTES if byte_fallback else []), initial_alphabet=alphabet
    )
    backend.train_from_iterator(CORPUS, trainer)
    backend.add_tokens([AddedToken(token, normalized=True) for token in added])
    return wrapped(backend)


def wrapped(backend: Any) -> CheckpointTokenizer:
    return CheckpointTokenizer(Tokenizer(backend, special=SpecialTokens(), chat_template=None))


def count(tokenizer: CheckpointTokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


PIPELINES = {
    "gpt2 byte-level": lambda: trained(pre_tokenizer=pre_tokenizers.ByteLevel(add_prefix_space=False)),
    "qwen2 nfc + split + byte-level": lambda: trained(
        normalizer=normalizers.NFC(),
        pre_tokenizer=pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        ),
    ),
    "llama metaspace + byte fallback": lambda: trained(
        pre_tokenizer=pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False),
        byte_fallback=True,
    ),
    "llama legacy normalizer + byte fallback": lambda: trained(
        normalizer=normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
        byte_fallback=True,
    ),
    # An added token longer than every piece, which the normalizer lengthens (the legacy Prepend; a Replace of
    # one character by several): it covers its normalized content's characters, more than its own.
    "llama legacy normalizer + a normalized added token": lambda: trained(
        normalizer=normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
        byte_fallback=True,
        added=("<|start_header_id|>",),
    ),
    "lengthening replace + a normalized added token": lambda: trained(
        normalizer=normalizers.Replace("x", "abcdefghijklmnopqrstuvwxyz"),
        byte_fallback=True,
        added=("x",),
    ),
}
TOKENIZERS = {name: make() for name, make in PIPELINES.items()}

# Text that stresses a bound: long runs a token may cover, combining marks NFC merges, Hangul jamo NFC composes
# three to one, characters outside the corpus (byte fallback, byte-level), the special tokens' own text.
PIECES = ["a", " ", "  ", "e\u0301", "\u1100\u1161\u11a8", "日", "🙂", "\n", "0", "The", *SPECIALS]
ADDED_TEXTS = [" <|start_header_id|>", "abcdefghijklmnopqrstuvwxyz", "x"]  # the added tokens' pipelines'
texts = st.lists(
    st.sampled_from([*PIECES, *ADDED_TEXTS]) | st.text(max_size=8),
    max_size=60,
).map("".join)


@pytest.mark.parametrize("name", sorted(PIPELINES))
@settings(max_examples=150, deadline=None)
@given(text=texts)
@example(text=" " * 200)
@example(text="e\u0301" * 100)
@example(text="\u1100\u1161\u11a8" * 50)
@example(text="<|im_end|>" * 20)
@example(text=" <|start_header_id|>" * 24)
@example(text="abcdefghijklmnopqrstuvwxyz" * 20)
def test_fewest_tokens_bounds_a_texts_tokens_from_below(name: str, text: str) -> None:
    """On every pipeline of PIPELINES, for any text: `fewest_tokens` never exceeds the tokens `encode` gives (a
    prompt that fits is never refused by it), and it is a bound that bites: a long ASCII text's is positive."""
    tokenizer = TOKENIZERS[name]
    assert tokenizer.fewest_tokens(text) <= count(tokenizer, text)
    assert tokenizer.fewest_tokens("a" * 10_000) > 0


def unbounded() -> dict[str, tuple[CheckpointTokenizer, str]]:
    """Pipelines where a text's characters bound nothing, each with a text of fewer tokens than its characters over
    the longest vocabulary string (the bound a character count would claim). The unknown token is "?", one character,
    so that each case breaks the bound by the one feature it names."""
    vocab = {"a": 0, "?": 1}
    whitespace = Backend(BPE(vocab=vocab, merges=[], unk_token="?"))
    whitespace.pre_tokenizer = pre_tokenizers.Whitespace()  # drops spaces
    stripping = Backend(BPE(vocab={" ": 0, "a": 1}, merges=[]))
    stripping.add_special_tokens([AddedToken("<x>", rstrip=True)])  # takes the spaces after it
    fused = Backend(BPE(vocab=vocab, merges=[], unk_token="?", fuse_unk=True))  # a run of unknowns: one token
    words = Backend(WordPiece(vocab=vocab, unk_token="?", max_input_chars_per_word=100))  # a long word: one token
    nfkc = Backend(BPE(vocab={"ガ": 0, "?": 1}, merges=[], unk_token="?"))
    nfkc.normalizer = normalizers.NFKC()  # halfwidth "ｶﾞ" is one "ガ"
    shrinking = Backend(BPE(vocab=vocab, merges=[], unk_token="?"))
    shrinking.normalizer = normalizers.Replace("aaaa", "a")
    truncating = Backend(BPE(vocab=vocab, merges=[], unk_token="?"))
    truncating.enable_truncation(4)
    return {
        "whitespace pre-tokenizer": (wrapped(whitespace), " " * 500 + "a"),
        "rstrip added token": (wrapped(stripping), "<x>" + " " * 500),
        "fused unknown token": (wrapped(fused), "Ω" * 500),
        "wordpiece": (wrapped(words), "Ω" * 500),
        "nfkc": (wrapped(nfkc), "ｶﾞ" * 250),
        "replace of more than one character": (wrapped(shrinking), "a" * 500),
        "truncation": (wrapped(truncating), "a" * 500),
    }


@pytest.mark.parametrize("name", sorted(unbounded()))
def test_no_bound_where_the_pipeline_may_drop_or_merge_text(name: str) -> None:
    """Where the tokenizer may drop characters, merge them, cover a run of them with one token or cut the encoding,
    a text has fewer tokens than its characters over the longest vocabulary string: `fewest_tokens` claims nothing
    (0), so nothing that fits is refused early."""
    tokenizer, text = unbounded()[name]
    backend = tokenizer.tokenizer.backend
    longest = max(len(piece) for piece in backend.get_vocab(with_added_tokens=True))
    assert count(tokenizer, text) < -(-len(text) // longest)  # what a character bound would have refused
    assert tokenizer.fewest_tokens(text) == 0


def test_the_byte_tokenizers_bound_is_its_count() -> None:
    """Bytes: one token a byte, so the bound is the count itself, for any text."""
    for text in ("", "hi", "日本語 🙂", "e\u0301"):
        assert ByteTokenizer().fewest_tokens(text) == len(ByteTokenizer().encode(text))


SERVED = ServedModel(name="m", max_prompt_tokens=20, default_max_tokens=4, max_context_tokens=64, vocab_size=512)


@pytest.mark.parametrize("name", sorted(PIPELINES))
@settings(max_examples=80, deadline=None)
@given(text=texts)
def test_a_prompt_that_fits_gets_exactly_its_tokens_and_one_over_is_refused_by_the_limit_check(
    name: str, text: str
) -> None:
    """With the early refusal: a completion's prompt of at most `max_prompt_tokens` tokens gets exactly the ids of
    the checkpoint tokenizer's `encode`, as before (the gateway's goes through `encode_batch`, which lets go of the
    GIL); one over it gets the 400 `context_length_exceeded` naming the prompt, whether the bound or the count
    refused it."""
    tokenizer = TOKENIZERS[name]
    request = parse_completion({"prompt": text, "max_tokens": 4}, SERVED)
    expected = tokenizer.tokenizer.encode(text, add_special_tokens=True)  # the checkpoint tokenizer's own `encode`
    if not expected:
        return  # the empty prompt's own 400
    if len(expected) <= SERVED.max_prompt_tokens:
        assert prompt_tokens(request, tokenizer, SERVED) == expected
        return
    with pytest.raises(ApiError) as refused:
        prompt_tokens(request, tokenizer, SERVED)
    assert (refused.value.status, refused.value.code, refused.value.param) == (400, "context_length_exceeded", "prompt")


class Recording(ByteTokenizer):
    """Bytes, recording the length of each text it tokenizes."""

    def __init__(self) -> None:
        self.encoded: list[int] = []

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self.encoded.append(len(text))
        return super().encode(text, add_special_tokens=add_special_tokens)


def test_a_prompt_certainly_over_the_limit_is_refused_before_it_is_tokenized() -> None:
    """A completion's prompt, or a chat's rendered text, of more bytes than the limit's tokens is the limit check's
    400 `context_length_exceeded` (naming `prompt` or `messages`, the bound in the message) and is never
    tokenized; one at the limit is tokenized and served; with `truncate_prompt_tokens` every prompt is tokenized,
    then cut (only its last tokens count)."""
    limit = SERVED.max_prompt_tokens
    over = {"prompt": "x" * (limit + 1), "max_tokens": 4}
    tokenizer = Recording()
    with pytest.raises(ApiError) as refused:
        prompt_tokens(parse_completion(over, SERVED), tokenizer, SERVED)
    error = refused.value
    assert (error.status, error.code, error.param) == (400, "context_length_exceeded", "prompt")
    assert error.message == f"the prompt has at least {limit + 1} tokens, over this server's limit of {limit}"
    chat = parse_chat({"messages": [{"role": "user", "content": "x" * limit}]}, SERVED)
    with pytest.raises(ApiError) as refused:
        prompt_tokens(chat, tokenizer, SERVED)
    assert (refused.value.code, refused.value.param) == ("context_length_exceeded", "messages")
    assert tokenizer.encoded == []
    at_limit = parse_completion({"prompt": "x" * limit, "max_tokens": 4}, SERVED)
    assert prompt_tokens(at_limit, tokenizer, SERVED) == [ord("x")] * limit and tokenizer.encoded == [limit]
    cut = parse_completion({**over, "prompt": "y" + "x" * 100, "truncate_prompt_tokens": 5}, SERVED)
    assert prompt_tokens(cut, tokenizer, SERVED) == [ord("x")] * 5 and tokenizer.encoded[-1] == 101


# ---------------------------------------------------------------------------------------------- /detokenize


@pytest.fixture(scope="module")
def checkpoint_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[CheckpointTokenizer, Any]:
    """A checkpoint's tokenizer files (byte-level BPE with BOS, EOS = `</s>` and ChatML), as the gateway loads
    them, and transformers' tokenizer of the same files."""
    pytest.importorskip("transformers")
    from vllm_fleet.model import make_tokenizer

    directory: Path = tmp_path_factory.mktemp("tokenizer")
    reference = make_tokenizer(directory, corpus=CORPUS, vocab_size=300)
    return CheckpointTokenizer(load_tokenizer(directory)), reference


def test_detokenize_decodes_the_eos_and_what_follows_as_vllm_does(
    checkpoint_tokenizer: tuple[CheckpointTokenizer, Any],
) -> None:
    """/detokenize of ids with the checkpoint's EOS (a stop id) and a ChatML token in the middle: the whole text,
    special tokens written, as transformers' `decode` (vLLM's answer); a generation's text would end at the EOS."""
    ours, reference = checkpoint_tokenizer
    eos = reference.eos_token_id
    assert eos in ours.stop_token_ids
    ids = [
        *ours.encode("Hello world", add_special_tokens=True),
        eos,
        reference.convert_tokens_to_ids("<|im_end|>"),
        *ours.encode(" The quick fox", add_special_tokens=False),
    ]
    served = ServedModel(name="m", max_prompt_tokens=64, default_max_tokens=4, max_context_tokens=128, vocab_size=300)
    answer = detokenize_body({"tokens": ids}, ours, served)
    assert answer == {"prompt": reference.decode(ids)}
    assert answer["prompt"] == "<s>Hello world</s><|im_end|> The quick fox"


def test_a_text_is_truncated_on_the_side_asked_as_vllm_truncates_it(
    checkpoint_tokenizer: tuple[CheckpointTokenizer, Any],
) -> None:
    """`truncate_prompt_tokens: k` on a text the tokenizer adds a BOS to. Without `truncation_side` the tokenizer
    truncates (vLLM's generation tokenizers truncate on the left): the BOS stays, the text loses its first tokens,
    as transformers' left truncation. With a side vLLM cuts the whole prompt's tokens: "left" keeps the last k (the
    BOS goes), "right" the first k. A side that is neither is a 400 naming it."""
    ours, reference = checkpoint_tokenizer
    served = ServedModel(name="m", max_prompt_tokens=64, default_max_tokens=4, max_context_tokens=128, vocab_size=300)
    text = "The quick brown fox jumps over the lazy dog"
    whole = reference(text)["input_ids"]
    assert whole[0] == reference.bos_token_id and len(whole) > 6
    reference.truncation_side = "left"
    cases = [
        ({}, reference(text, truncation=True, max_length=5)["input_ids"]),
        ({"truncation_side": "left"}, whole[-5:]),
        ({"truncation_side": "right"}, whole[:5]),
    ]
    for side, expected in cases:
        request = parse_completion({"prompt": text, "truncate_prompt_tokens": "5", **side}, served)
        assert prompt_tokens(request, ours, served) == expected, side
    assert cases[0][1][0] == reference.bos_token_id and cases[0][1] != whole[-5:]
    for side in ("middle", "LEFT", 1):
        with pytest.raises(ApiError, match=r"^truncation_side must be 'left' or 'right', got ") as refused:
            parse_completion({"prompt": text, "truncation_side": side}, served)
        assert refused.value.param == "truncation_side"
