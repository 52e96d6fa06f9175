"""The gateway's texts of tokens as vLLM (0.32) writes them: beside log-probabilities and at a generation's end.

What each test proves: a completion's and a chat's log-probabilities name each token by vLLM's text for it after
the tokens sampled before it (`examples/serving/gateway.py`: `_SequenceLogprobs`), so a character split across
byte tokens reads "", "", then the character, never U+FFFD, whether the answer is taken whole or in chunks; the
alternatives at a place read after the same tokens; an echoed prompt's tokens read after the prompt's tokens
before them (its first, which has no log-probabilities, as its lone decode), and the generation's first after
none. `prompt_logprobs` reads each place after the prompt's tokens before it (`_prompt_logprobs`). A text stream
(`TextStream`) that ends inside a character, by `max_tokens` or at a stop id, ends with the character before it,
as vLLM's output does; a tail held back for a stop string still goes out. The tokenizer is the hand-built
byte-level BPE of tests/engine/test_tokenizer_vllm_text.py ("Hello 龘 world" in 8 tokens, ids written out).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("aiohttp")

from serving.gateway import _prompt_logprobs, _SequenceLogprobs
from serving.tokenizer import ByteTokenizer, CheckpointTokenizer, TextStream

from mooncake.engine.logprobs import TokenLogprobs
from mooncake.engine.tokenizer import REPLACEMENT, load_tokenizer
from tests.engine.test_tokenizer_specials import write_byte_level
from tests.engine.test_tokenizer_vllm_text import HELLO_IDS, HELLO_TEXTS, MERGES

RYU = bytes([0xE9, 0xBE, 0x99]).decode()  # the character E9 BE 99: another last byte after 龘's first two


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> CheckpointTokenizer:
    directory = tmp_path_factory.mktemp("byte-level")
    write_byte_level(directory, merges=MERGES)
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"})
    )
    return CheckpointTokenizer(load_tokenizer(directory))


def scored(token: int, *alternatives: int) -> TokenLogprobs:
    """A token's log-probabilities with `alternatives` as the most probable (values of no matter here)."""
    return TokenLogprobs(logprob=-0.5, rank=1, top=tuple((t, -1.0 - i) for i, t in enumerate(alternatives)))


def test_a_completions_tokens_read_as_vllms_after_the_tokens_before_them(tokenizer: CheckpointTokenizer) -> None:
    """ "Hello 龘 world" generated: the tokens are vLLM's texts; at 龘's last byte the alternative E9 BE 99's last
    byte reads as its character too, and a first byte ""; the offsets sum the texts; taken in chunks (the
    stream's), the same lists."""
    pairs = [(t, scored(t, 0x99, 0xE9) if t == 0x98 else scored(t)) for t in HELLO_IDS]
    whole = _SequenceLogprobs(chat=False, k=2, tokenizer=tokenizer).take(pairs)
    assert whole["tokens"] == HELLO_TEXTS
    assert whole["top_logprobs"][5] == {"龘": -0.5, RYU: -1.0, "": -2.0}
    assert whole["text_offset"] == [0, 2, 5, 6, 6, 6, 7, 9]
    assert not any(REPLACEMENT in text for top in whole["top_logprobs"] for text in top)
    chunked = _SequenceLogprobs(chat=False, k=2, tokenizer=tokenizer)
    parts = [chunked.take(pairs[:4]), chunked.take(pairs[4:5]), chunked.take(pairs[5:])]
    assert {key: [v for part in parts for v in part[key]] for key in whole} == whole


def test_a_chats_tokens_and_their_bytes_read_as_vllms(tokenizer: CheckpointTokenizer) -> None:
    """A chat's content items: vLLM's texts, each with its UTF-8 bytes (none for a byte that shows "")."""
    pairs = [(t, scored(t, 0x99) if t == 0x98 else scored(t)) for t in HELLO_IDS]
    content = _SequenceLogprobs(chat=True, k=1, tokenizer=tokenizer).take(pairs)["content"]
    assert [item["token"] for item in content] == HELLO_TEXTS
    assert content[3]["bytes"] == [] and content[5]["bytes"] == list("龘".encode())
    assert [alt["token"] for alt in content[5]["top_logprobs"]] == [RYU]


def test_an_echoed_prompt_reads_after_its_own_tokens_and_the_generation_after_none(
    tokenizer: CheckpointTokenizer,
) -> None:
    """An echo: the prompt's first token (no log-probabilities) reads as its lone decode, U+FFFD for a byte, as
    vLLM writes one; its later tokens after the prompt's tokens from the second; the generation starts afresh:
    a last byte right after the prompt completes nothing."""
    prompt = [0xE9, 0xBE, 0x98, 0xE9, 0xBE]  # 龘 and the first two bytes of another
    generated = [0x98, 256]
    pairs = [(prompt[0], None), *((t, scored(t)) for t in prompt[1:]), *((t, scored(t)) for t in generated)]
    taken = _SequenceLogprobs(chat=False, k=0, tokenizer=tokenizer, echoed=len(prompt)).take(pairs)
    # 龘's second and third bytes read after the second alone (the first, unscored, is no context): no character.
    assert taken["tokens"] == [REPLACEMENT, "", "", "", "", "", "He"]
    plain = _SequenceLogprobs(chat=False, k=0, tokenizer=tokenizer).take([(t, scored(t)) for t in prompt[:3]])
    assert plain["tokens"] == ["", "", "龘"]


def test_prompt_logprobs_read_each_place_after_the_prompt_before_it(tokenizer: CheckpointTokenizer) -> None:
    """`prompt_logprobs` of "Hello 龘 world": null first, then each token's (and its alternatives') decoded
    text after the prompt's tokens before it from the second, as vLLM: 龘 at its last byte."""
    ids = HELLO_IDS
    scores = [scored(t, 0x99) if t == 0x98 else scored(t) for t in ids[1:]]
    listed = _prompt_logprobs(tokenizer, ids, scores, 1)
    assert listed[0] is None
    decoded = [next(iter(one.values()))["decoded_token"] for one in listed[1:] if one is not None]
    assert decoded == HELLO_TEXTS[1:]
    assert listed[5] is not None and listed[5][str(0x99)]["decoded_token"] == RYU


def text_of(stream: TextStream, ids: list[int]) -> str:
    return "".join(stream.feed(t) for t in ids) + stream.finish()


def test_a_generation_ending_inside_a_character_ends_before_it(tokenizer: CheckpointTokenizer) -> None:
    """ " ok 龘" cut after 龘's second byte (max_tokens) reads " ok ", as vLLM's output, where a decode ends in
    U+FFFD; so at a stop id after those bytes (with or without its text); the byte tokenizer's stream too. A
    tail held back for a stop string that never completed still goes out."""
    prompt = tokenizer.encode("Hi", add_special_tokens=False)
    ids = tokenizer.encode(" ok 龘", add_special_tokens=False)[:-1]
    assert tokenizer.decode(ids).endswith(REPLACEMENT)
    assert text_of(tokenizer.stream(prompt=prompt), ids) == " ok "
    eos = next(iter(tokenizer.stop_token_ids))
    for include in (False, True):
        stream = tokenizer.stream(prompt=prompt, include_stop=include, skip_special_tokens=True)
        assert text_of(stream, [*ids, eos]) == " ok " and stream.stopped
    assert text_of(tokenizer.stream(["k 龘!"], prompt=prompt), ids) == " ok "  # "k " was held for the stop string
    raw = ByteTokenizer()
    assert text_of(raw.stream(), list(" ok 龘".encode())[:-1]) == " ok "


def test_the_byte_tokenizers_token_text_completes_a_character(tokenizer: CheckpointTokenizer) -> None:
    """The random preset's bytes read as a checkpoint's: a byte of a character "" until its last, which shows it;
    its piece stays the lone byte's decode (U+FFFD)."""
    raw = ByteTokenizer()
    ids = list("a龘".encode())
    assert [raw.token_text(t, context=ids[:i]) for i, t in enumerate(ids)] == ["a", "", "", "龘"]
    assert raw.piece(0xE9) == REPLACEMENT


def test_the_test_tokenizer_is_the_one_written_out(tokenizer: CheckpointTokenizer) -> None:
    """The ids written out above are this tokenizer's (the case the other tests are about)."""
    assert tokenizer.encode("Hello 龘 world", add_special_tokens=False) == HELLO_IDS
