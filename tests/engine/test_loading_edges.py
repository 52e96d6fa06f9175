"""Edge contracts of the engine's loading path: tokenizer files, sampling parameters, checkpoint and model configs.

What a Hugging Face / vLLM user relies on and the module tests leave open.
Tokenizer (`mooncake.engine.tokenizer`): streaming a Llama (SentencePiece-style,
byte-fallback) tokenizer's tokens joins to their decode, "▁" spaces and split
characters included; the default stream skips special tokens, as vLLM's does;
the stop ids always hold the EOS and fall back to config.json; the chat
template file wins over the config field; added tokens keep their ids; every
malformed file is a ConfigError naming it. Sampling: an unseeded request gets
a fresh stream; a sampler never writes into the caller's logits; every invalid
parameter is a ConfigError naming the field and the value. Config and
checkpoint: `num_parameters` counts what `LlamaModel` builds; RoPE scaling and
the defaults transformers fills in (theta, Qwen2's window layers) are honoured;
a malformed config.json, index or weight request is refused naming the file.
A stray fallback byte after a streamed character keeps what was emitted (as
tokenizers' DecodeStream); the nucleus sums the mass above a token exactly; an
integer past float's range and an unknown RoPE kind are ConfigErrors.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

import attrs
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from mooncake.engine.checkpoint import INDEX_FILE, SafetensorsWeights, model_config_from_hf, read_model_config
from mooncake.engine.config import ModelConfig, RopeScaling
from mooncake.engine.model import LlamaModel
from mooncake.engine.sampling import Sampler, SamplingParams, nucleus
from mooncake.engine.tokenizer import REPLACEMENT, Tokenizer, load_tokenizer, sampling_defaults
from mooncake.errors import ConfigError, MooncakeError
from tests.engine.test_checkpoint_errors import hf_config, relatives
from tests.engine.test_tokenizer import stream, write_llama_files

torch.set_num_threads(1)  # tiny tensors on a busy 2-core box

TEXT = [
    "Hello world! The quick brown fox jumps over the lazy dog. Héllo wörld, naïve café.",
    "<|user|>\nHi there</s>\n<|assistant|>\nHello!</s>  two  spaces, \n a newline",
    "def main():\n    return {'key': [1, 2, 3]}",
] * 10
# Characters the tiny vocabularies never learn: byte fallback (Llama) or split byte tokens (byte-level).
RARE = "日本語 🙂🚀 Ελληνικά ß"


# --------------------------------------------------------------------------- tokenizer helpers


def write_llama(directory: Path, *, drop_added: tuple[str, ...] = (), **config: Any) -> Path:
    """A Llama 2 style tokenizer (test_tokenizer's files) trained on this file's text."""
    return write_llama_files(directory, texts=TEXT, vocab_size=400, drop_added=drop_added, **config)


def write_byte_level(directory: Path, *, config: dict[str, Any] | None = None, extra_special: str = "") -> Path:
    """A byte-level BPE tokenizer.json (GPT-2 / Llama 3 style) with BOS, EOS and an end-of-turn token, and a
    tokenizer_config.json naming BOS and EOS (or `config`); `extra_special`: one more special token added past
    the trained vocabulary."""
    backend = Backend(BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>", "<|eot|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(TEXT, trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", backend.token_to_id("<s>"))]
    )
    if extra_special:
        backend.add_special_tokens([AddedToken(extra_special, special=True, normalized=False)])
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    fields = {"bos_token": "<s>", "eos_token": "</s>"} if config is None else config
    (directory / "tokenizer_config.json").write_text(json.dumps(fields))
    return directory


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The Llama-style tokenizer, loaded (rebuilt as transformers v5 rebuilds a LlamaTokenizer)."""
    return load_tokenizer(write_llama(tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def byte_level_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_byte_level(tmp_path_factory.mktemp("bytes"))


llama_texts = st.lists(
    st.sampled_from(["Hello", " world", "  ", "\n", "</s>", "<s>", "日", "🙂", "é", "ß", "x", ",", " "]), max_size=12
).map("".join) | st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20)


# --------------------------------------------------------------------------- tokenizer


@settings(max_examples=60, deadline=None)
@given(llama_texts, st.booleans())
def test_a_llama_tokenizers_stream_joins_to_its_decode(llama: Tokenizer, text: str, skip: bool) -> None:
    """SentencePiece-style tokens ("▁" for a space, stripped at the very start; byte-fallback tokens for
    characters outside the vocabulary; specials among them): the streamed pieces join to `decode` of all the
    tokens, and for the tokens of a text (specials kept) to the text itself with no piece holding U+FFFD. A
    piece decoded without the tokens before it as context would lose its leading space."""
    ids = llama.encode(text, add_special_tokens=False)
    pieces = stream(llama, ids, skip=skip)
    assert "".join(pieces) == llama.decode(ids, skip_special_tokens=skip)
    if not skip:
        assert "".join(pieces) == text.removeprefix(" ")  # the decoder strips one leading space, as HF's does
        assert not any(REPLACEMENT in piece for piece in pieces)


def byte_tokens(tokenizer: Tokenizer, character: str) -> list[int]:
    """The byte-fallback tokens (`<0xE6>`, ...) spelling `character`'s UTF-8 bytes."""
    ids = [tokenizer.backend.token_to_id(f"<0x{byte:02X}>") for byte in character.encode()]
    assert None not in ids
    return ids


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_llama_stream_of_any_ids_joins_to_their_decode(llama: Tokenizer, data: st.DataObject) -> None:
    """Any ids that are not fallback bytes ("▁" pieces, specials, the unknown token anywhere) mixed with whole
    characters spelled in fallback bytes, one after another: the pieces join to the decode, skipping specials
    or not, and no piece holds U+FFFD (each character waits for its last byte)."""
    plain = [i for i in range(llama.vocab_size) if not llama.backend.id_to_token(i).startswith("<0x")]
    unit = st.sampled_from(plain).map(lambda i: [i]) | st.sampled_from(RARE).map(lambda c: byte_tokens(llama, c))
    ids = [token for part in data.draw(st.lists(unit, max_size=16)) for token in part]
    skip = data.draw(st.booleans())
    pieces = stream(llama, ids, skip=skip)
    assert "".join(pieces) == llama.decode(ids, skip_special_tokens=skip)
    assert not any(REPLACEMENT in piece for piece in pieces)


def test_a_stray_fallback_byte_after_a_streamed_character_keeps_what_was_emitted(llama: Tokenizer) -> None:
    """The documented exception to the join: "日" spelled in three byte tokens is emitted whole, then a stray
    continuation byte <0x80> comes. tokenizers' ByteFallback decodes the whole run as one U+FFFD per byte, but the
    stream keeps the "日" it emitted, as tokenizers' own DecodeStream does; `finish` adds nothing: the stray byte
    never became text, and a stream ends with what it emitted, as vLLM's (no flush of a held tail)."""
    from tokenizers.decoders import DecodeStream

    ids = [*byte_tokens(llama, "日"), llama.backend.token_to_id("<0x80>")]
    pieces = stream(llama, ids, skip=True)
    peer = DecodeStream(skip_special_tokens=True)
    assert pieces[:-1] == [peer.step(llama.backend, token) or "" for token in ids] == ["", "", "日", ""]
    assert pieces[-1] == "" and llama.decode(ids) == REPLACEMENT * 4


def test_the_default_stream_skips_special_tokens(byte_level_dir: Path) -> None:
    """`detokenizer()` without arguments is vLLM's default (`skip_special_tokens=True`): a generated EOS or
    end-of-turn token adds no text, while a multi-byte character split over byte tokens still comes out whole."""
    tokenizer = load_tokenizer(byte_level_dir)
    ids = tokenizer.encode("Hi 🙂", add_special_tokens=False)
    eot = tokenizer.backend.token_to_id("<|eot|>")
    ids = [*ids, eot, tokenizer.special.eos_token_id]
    detokenizer = tokenizer.detokenizer()
    pieces = [detokenizer.push(token) for token in ids] + [detokenizer.finish()]
    assert "".join(pieces) == "Hi 🙂" == tokenizer.decode(ids, skip_special_tokens=True)
    assert REPLACEMENT not in "".join(pieces)
    kept = tokenizer.detokenizer(skip_special_tokens=False)
    assert "".join([kept.push(token) for token in ids] + [kept.finish()]) == "Hi 🙂<|eot|></s>"


def test_an_added_token_past_the_vocabulary_counts_in_vocab_size(tmp_path: Path) -> None:
    """`vocab_size` bounds every id, added tokens included (transformers' `len(tokenizer)`): a special token
    added after training gets the id past the trained vocabulary, encodes as one token and decodes back."""
    tokenizer = load_tokenizer(write_byte_level(tmp_path, extra_special="<|tool|>"))
    added = tokenizer.backend.token_to_id("<|tool|>")
    assert added == tokenizer.backend.get_vocab_size(with_added_tokens=False)
    assert tokenizer.vocab_size == added + 1
    assert all(i < tokenizer.vocab_size for i in tokenizer.backend.get_vocab(with_added_tokens=True).values())
    assert tokenizer.encode("a<|tool|>", add_special_tokens=False)[-1] == added
    assert tokenizer.decode([added]) == "<|tool|>" and tokenizer.decode([added], skip_special_tokens=True) == ""


def test_stop_ids_hold_the_eos_and_fall_back_to_config_json(tmp_path: Path) -> None:
    """As vLLM's: the EOS always stops, with generation_config.json's `eos_token_id` (an id or a list), and
    without that key config.json's; generation_config.json wins when both have it."""
    directory = write_byte_level(tmp_path)
    eos = load_tokenizer(directory).special.eos_token_id
    assert eos is not None
    eot = load_tokenizer(directory).backend.token_to_id("<|eot|>")
    assert load_tokenizer(directory).special.stop_token_ids == {eos}
    (directory / "config.json").write_text(json.dumps({"eos_token_id": [eot]}))
    assert load_tokenizer(directory).special.stop_token_ids == {eos, eot}
    (directory / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))  # no eos_token_id key
    assert load_tokenizer(directory).special.stop_token_ids == {eos, eot}
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    stops = load_tokenizer(directory).special.stop_token_ids
    assert stops == {eos, 0} and not load_tokenizer(directory).is_stop(eot)


@pytest.mark.parametrize("value", [-1, True, [2, -3], [1, False], 1.0, [2, "3"], {"id": 2}])
def test_a_stop_id_that_is_no_token_id_is_refused_naming_it(tmp_path: Path, value: Any) -> None:
    """`eos_token_id` must be a non-negative integer or a list of them: a negative id, a bool (JSON's true is
    no id 1), a float or a string is a ConfigError naming the key and the value."""
    directory = write_byte_level(tmp_path)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
    with pytest.raises(ConfigError, match="eos_token_id must be a token id") as caught:
        load_tokenizer(directory)
    assert repr(value) in str(caught.value)


@pytest.mark.parametrize(
    ("content", "named"),
    [
        ("[1, 2]", "expected a JSON object, got list"),
        ('"text"', "got str"),
        ("{nope", "not readable JSON"),
        ('{"x": ' + "9" * 5000 + "}", "not readable JSON"),  # past Python's 4,300 digits: a ValueError
        ('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}", "not readable JSON"),  # a RecursionError
    ],
)
@pytest.mark.parametrize("file", ["tokenizer_config.json", "special_tokens_map.json", "generation_config.json"])
def test_a_json_file_beside_the_tokenizer_that_is_no_object_is_refused_naming_it(
    tmp_path: Path, file: str, content: str, named: str
) -> None:
    """A file beside tokenizer.json that is not JSON, or JSON but not an object, is one ConfigError naming the
    file (never a bare JSONDecodeError or AttributeError from deep inside)."""
    directory = write_byte_level(tmp_path)
    (directory / file).write_text(content)
    with pytest.raises(ConfigError) as caught:
        load_tokenizer(directory)
    message = str(caught.value)
    assert str(directory.resolve() / file) in message and named in message and len(message.splitlines()) == 1


def test_special_tokens_may_come_from_special_tokens_map(tmp_path: Path) -> None:
    """An older checkpoint names its special tokens only in special_tokens_map.json (as a string or an AddedToken
    object): they are read from there. As transformers reads that legacy file only for a tokenizer_config.json
    without `added_tokens_decoder`, and then lets it win (Vicuna's `pad_token: null` beside a map naming
    "<unk>"), a config with `added_tokens_decoder` keeps its own (and a null) and ignores the map."""
    directory = write_byte_level(tmp_path, config={})
    legacy = {"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "<|eot|>"}
    (directory / "special_tokens_map.json").write_text(json.dumps(legacy))
    special = load_tokenizer(directory).special
    backend = load_tokenizer(directory).backend
    assert special.tokens == {"bos_token": "<s>", "eos_token": "<|eot|>"}
    assert special.eos_token_id == backend.token_to_id("<|eot|>") and special.bos_token_id == backend.token_to_id("<s>")
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": None}))
    (directory / "special_tokens_map.json").write_text(json.dumps({**legacy, "pad_token": "</s>"}))
    assert load_tokenizer(directory).special.tokens == {"bos_token": "<s>", "eos_token": "<|eot|>", "pad_token": "</s>"}
    decoder = {"0": {"content": "<s>", "special": True}}
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "added_tokens_decoder": decoder}))
    assert load_tokenizer(directory).special.tokens == {"eos_token": "</s>"}


CHAT = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"


def test_the_chat_template_is_found_where_transformers_looks(tmp_path: Path) -> None:
    """chat_template.jinja wins over tokenizer_config.json's field; a list of named templates gives the one
    named "default" wherever it stands; a template that is not a string is a ConfigError naming the field."""
    directory = write_byte_level(tmp_path)
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": CHAT}]
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": named}))
    assert load_tokenizer(directory).render_chat([{"role": "user", "content": "hi"}]) == "[user]hi"
    (directory / "chat_template.jinja").write_text("FILE{{ messages | length }}")
    assert load_tokenizer(directory).render_chat([{"role": "user", "content": "hi"}]) == "FILE1"
    (directory / "chat_template.jinja").unlink()
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": 5}))
    with pytest.raises(ConfigError, match="chat_template must be a string, got 5"):
        load_tokenizer(directory)


def test_the_template_sees_tools_and_documents_as_none(byte_level_dir: Path) -> None:
    """transformers renders every template with `tools` and `documents` set (None when the request has none),
    so a template may test `tools is none`; a request's tools reach it."""
    tokenizer = load_tokenizer(byte_level_dir)
    tokenizer = Tokenizer(
        tokenizer.backend,
        special=tokenizer.special,
        chat_template="{{ tools is none }}/{{ documents is none }}/{{ bos_token }}",
    )
    assert tokenizer.render_chat([]) == "True/True/<s>"
    assert tokenizer.render_chat([], tools=[{"name": "f"}]) == "False/True/<s>"


def test_tojson_keeps_non_ascii_as_transformers_does(byte_level_dir: Path) -> None:
    """transformers' `tojson` filter writes non-ASCII text as is (`ensure_ascii=False`), so a tool call's or a
    message's "日本" reaches the prompt as those characters, not as "\\u65e5\\u672c" escapes the model never
    saw in training; `indent` passes through."""
    tokenizer = load_tokenizer(byte_level_dir)
    tokenizer = Tokenizer(tokenizer.backend, special=tokenizer.special, chat_template="{{ messages | tojson }}")
    messages = [{"role": "user", "content": "日本 café 🙂"}]
    assert tokenizer.render_chat(messages) == json.dumps(messages, ensure_ascii=False)
    indented = Tokenizer(tokenizer.backend, special=tokenizer.special, chat_template="{{ tools | tojson(indent=2) }}")
    assert indented.render_chat([], tools=[{"name": "ß"}]) == json.dumps([{"name": "ß"}], ensure_ascii=False, indent=2)


def test_a_llama_tokenizers_added_tokens_keep_their_ids(tmp_path: Path) -> None:
    """`added_tokens_decoder` (keys are ids as strings) is applied in id order, not string order: tokens added
    past the vocabulary get the ids their keys say, though "100" sorts before "99" as text."""
    directory = write_llama(tmp_path / "llama")
    size = Backend.from_file(str(directory / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    assert size < 1000
    contents = [f"<|extra_{i}|>" for i in range(1000 - size + 2)]  # ids size .. 1001: past 999 the text sorts first
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {
        str(size + i): {"content": content, "special": True} for i, content in enumerate(contents)
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(directory)
    for key, entry in config["added_tokens_decoder"].items():
        assert tokenizer.backend.token_to_id(entry["content"]) == int(key), entry


def test_a_llama_special_token_left_out_of_the_added_tokens_is_still_special(tmp_path: Path) -> None:
    """A named special token (`eos_token` "</s>") that the vocabulary holds but tokenizer.json's added tokens
    leave out is made special, as transformers' LlamaTokenizer makes it: "</s>" in a chat template's text is the
    EOS id, not the pieces of "<", "/s", ">", and a decode skipping specials drops it."""
    directory = write_llama(tmp_path / "llama", drop_added=("</s>",))
    tokenizer = load_tokenizer(directory)
    eos = tokenizer.special.eos_token_id
    ids = tokenizer.encode("Hi</s>there", add_special_tokens=False)
    assert eos in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Hithere"
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    assert ids == theirs.encode("Hi</s>there", add_special_tokens=False)


def test_a_llama_tokenizer_that_is_no_bpe_or_is_malformed_is_refused_naming_the_file(tmp_path: Path) -> None:
    """transformers rebuilds a `LlamaTokenizer` as BPE: a tokenizer.json with another model (Unigram), a merge
    that is not two pieces (tokenizers itself refuses it), an `added_tokens_decoder` key that is no id or an entry that is no object: each a
    one-line ConfigError naming the file, never a tokenizers panic or a bare ValueError."""
    from tokenizers.models import Unigram

    unigram = tmp_path / "unigram"
    unigram.mkdir()
    Backend(Unigram([("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0), ("a", -1.0)], 0)).save(
        str(unigram / "tokenizer.json")
    )
    (unigram / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizerFast"}))
    with pytest.raises(ConfigError, match="LlamaTokenizerFast with a 'Unigram' model is not supported") as caught:
        load_tokenizer(unigram)
    assert str(unigram.resolve() / "tokenizer.json") in str(caught.value)
    directory = write_llama(tmp_path / "llama")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    for decoder in ({"x": {"content": "<x>"}}, {"5": "<x>"}, {"5": {"content": 5}}):
        (directory / "tokenizer_config.json").write_text(json.dumps({**config, "added_tokens_decoder": decoder}))
        with pytest.raises(ConfigError, match="added token") as caught:
            load_tokenizer(directory)
        assert str(directory.resolve()) in str(caught.value) and len(str(caught.value).splitlines()) == 1
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    data = json.loads((directory / "tokenizer.json").read_text())
    data["model"]["merges"] = [*data["model"]["merges"], "nospace"]
    (directory / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"tokenizer\.json is not a readable tokenizer"):
        load_tokenizer(directory)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_sampling_defaults_refuse_non_finite_values_and_accept_the_edges(tmp_path: Path, bad: float) -> None:
    """generation_config.json's `temperature: 0` (greedy) and `top_p: 1` (no nucleus) are valid edges; an
    Infinity or NaN (Python's json writes and reads them) is refused naming the file and the key."""
    generation = tmp_path / "generation_config.json"
    generation.write_text(json.dumps({"temperature": 0, "top_p": 1}))
    assert sampling_defaults(tmp_path) == {"temperature": 0.0, "top_p": 1.0}
    for key in ("temperature", "top_p"):
        generation.write_text(json.dumps({key: bad}))
        with pytest.raises(ConfigError, match=f"generation_config.json: {key} must be"):
            sampling_defaults(tmp_path)


# --------------------------------------------------------------------------- sampling


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": "0.7"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.0000001}, "top_p"),
        ({"top_p": True}, "top_p"),
        ({"seed": -3}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"stop_token_ids": {-1}}, "stop_token_ids"),
        ({"stop_token_ids": {2, "3"}}, "stop_token_ids"),
        ({"stop_token_ids": {1.5}}, "stop_token_ids"),
        ({"min_tokens": True}, "min_tokens"),
        ({"min_tokens": -2}, "min_tokens"),
    ],
)
def test_an_invalid_sampling_parameter_is_an_error_naming_the_field_and_value(
    fields: dict[str, Any], named: str
) -> None:
    """Each invalid request parameter (a stop id among them) is a ConfigError, a MooncakeError and a
    ValueError (what vLLM's server turns into a 400), whose message names the field and the value given."""
    with pytest.raises(ConfigError) as caught:
        SamplingParams(**fields)
    message = str(caught.value)
    assert isinstance(caught.value, MooncakeError) and isinstance(caught.value, ValueError)
    value = next(iter(fields.values()))
    shown = [repr(v) for v in value] if isinstance(value, set) else [repr(value)]
    assert message.startswith(named) and any(text in message for text in shown), message


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(-20, 20, allow_nan=False), min_size=2, max_size=16),
    st.sampled_from([0.0, 0.8]),
    st.sets(st.integers(0, 20), min_size=1, max_size=4),
    st.integers(0, 3),
    st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
)
def test_a_sampler_never_writes_into_the_callers_logits(
    values: list[float], temperature: float, stop: set[int], min_tokens: int, dtype: torch.dtype
) -> None:
    """The logits row belongs to the caller (a batch's row of the model's output, reused for the other requests
    or for logprobs): drawing, with stop tokens held back by `min_tokens` or not, leaves it bit for bit."""
    logits = torch.tensor(values).to(dtype)
    before = logits.clone()
    sampler = Sampler(SamplingParams(temperature=temperature, seed=1, stop_token_ids=stop, min_tokens=min_tokens))
    for _ in range(min_tokens + 2):
        sampler.next_token(logits)
        assert torch.equal(logits, before)


def test_requests_without_a_seed_get_independent_streams() -> None:
    """As vLLM: an unseeded request is sampled from fresh randomness, so two identical unseeded requests give
    different text (over uniform logits of 4,096 tokens, eight equal draws in a row happen with probability
    4096**-8), while two seeded alike still agree."""
    uniform = torch.zeros(4096)
    params = SamplingParams(temperature=1.0)
    first, second = Sampler(params), Sampler(params)
    assert [first.next_token(uniform) for _ in range(8)] != [second.next_token(uniform) for _ in range(8)]
    seeded = SamplingParams(temperature=1.0, seed=3)
    one, two = Sampler(seeded), Sampler(seeded)
    assert [one.next_token(uniform) for _ in range(8)] == [two.next_token(uniform) for _ in range(8)]


def boundary_nucleus(gap: float) -> tuple[list[bool], set[int]]:
    """The nucleus at top_p 0.5 of probabilities (0.5, 0.5 - gap, gap), whose second token has exactly 0.5 of
    mass above it, and the tokens drawn there by 50 seeds."""
    probabilities = torch.tensor([0.5, 0.5 - gap, gap], dtype=torch.float64)
    logits = probabilities.log()
    drawn = {Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=s)).next_token(logits) for s in range(50)}
    return nucleus(probabilities, 0.5).tolist(), drawn


@pytest.mark.parametrize("gap", [1e-13, 2.0**-40, 1e-3])
def test_a_token_just_less_probable_than_the_boundary_is_dropped(gap: float) -> None:
    """The nucleus keeps a token iff the mass strictly above it is below top_p, with no tolerance: with exactly
    0.5 of mass above it and top_p 0.5, a token a hair less probable than the first is out, however close, and
    every draw is the first token; a top_p a hair above 0.5 takes it in."""
    assert boundary_nucleus(gap) == ([True, False, False], {0})
    probabilities = torch.tensor([0.5, 0.5 - gap, gap], dtype=torch.float64)
    assert nucleus(probabilities, 0.5 + 1e-12).tolist() == [True, True, False]


def test_the_mass_above_a_token_is_summed_without_its_own_rounding() -> None:
    """The same boundary with a gap of 1e-9: the mass above the second token is exactly 0.5 (the first token's
    probability), but `cumsum - p` gives 0.49999999999999994 < top_p, so the token is kept against the
    definition (an exclusive prefix sum is exact here)."""
    assert boundary_nucleus(1e-9) == ([True, False, False], {0})


# --------------------------------------------------------------------------- config


@settings(max_examples=30, deadline=None)
@given(relatives())
def test_num_parameters_counts_what_the_model_builds(config: ModelConfig) -> None:
    """`num_parameters` (the cost models' weight bytes) is the element count of the parameters `LlamaModel`
    builds, whatever the biases (Qwen2's q/k/v, LLaMA's attention_bias) and with a tied head counted once."""
    model = LlamaModel(config)
    assert config.num_parameters == sum(parameter.numel() for parameter in model.parameters())


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"kind": "linear", "factor": 0.0}, "factor"),
        ({"kind": "linear", "factor": -2.0}, "factor"),
        ({"kind": "llama3", "factor": 8.0, "original_max_position_embeddings": 0}, "original_max_position_embeddings"),
        ({"kind": "llama3", "factor": 8.0, "low_freq_factor": 0.0}, "low_freq_factor"),
        ({"kind": "llama3", "factor": 8.0, "high_freq_factor": math.nan}, "high_freq_factor"),
        ({"kind": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0}, "high_freq_factor"),
        ({"kind": "llama3", "factor": 8.0, "low_freq_factor": 5.0}, "high_freq_factor > low_freq_factor"),
    ],
)
def test_an_impossible_rope_scaling_is_refused_naming_it(fields: dict[str, Any], named: str) -> None:
    """A factor that is not a positive number, llama3 band edges that are not positive or not ordered (equal
    edges divide by zero in the smooth band), an original context of 0: a ConfigError naming the field."""
    with pytest.raises(ConfigError, match=named):
        RopeScaling(**fields)


def test_the_band_edges_are_checked_only_for_llama3() -> None:
    """`linear` reads no band edges (transformers' linear scaling ignores them), so their order is not checked
    for it; valid boundary values (norm_eps 0) are accepted; an unknown kind is refused."""
    assert RopeScaling(kind="linear", factor=2.0, low_freq_factor=4.0, high_freq_factor=1.0).factor == 2.0
    with pytest.raises(ValueError, match="kind"):  # a kind the model does not implement is refused (see below)
        RopeScaling(kind="yarn", factor=4.0)
    config = ModelConfig(
        name="x", vocab_size=8, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=8
    )
    assert attrs.evolve(config, norm_eps=0.0).norm_eps == 0.0


def test_an_unknown_rope_kind_is_a_config_error_naming_it() -> None:
    """Every value object refuses bad input with a ConfigError (STYLE.md: validation raises ConfigError): a RoPE
    scaling kind the model does not implement names the field and the value."""
    with pytest.raises(ConfigError, match=r"kind.*yarn"):
        RopeScaling(kind="yarn", factor=4.0)


HUGE = 10**400  # an integer JSON (and Python) carries exactly, past float's range: float(HUGE) overflows


def load_huge(where: str, tmp_path: Path) -> object:
    """Give HUGE to one of the loading path's number fields, as a request or a checkpoint's JSON would."""
    if where == "SamplingParams.temperature":
        return SamplingParams(temperature=HUGE)
    if where == "SamplingParams.top_p":
        return SamplingParams(top_p=HUGE)
    if where == "generation_config.json temperature":
        (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": HUGE}))
        return sampling_defaults(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(small_hf(rope_parameters={"rope_theta": HUGE})))
    return read_model_config(tmp_path)


@pytest.mark.parametrize(
    "where",
    [
        "SamplingParams.temperature",
        "SamplingParams.top_p",
        "generation_config.json temperature",
        "config.json rope_theta",
    ],
)
def test_an_integer_beyond_floats_range_is_a_config_error(tmp_path: Path, where: str) -> None:
    """A number field given an integer too large for a float (a request's `"temperature": 1000...0`, a JSON
    file's) is refused like any out-of-range value, a ConfigError naming the field, not an OverflowError from
    `math.isfinite` (which a server maps to a 500, not a 400)."""
    field = where.rsplit(" ", 1)[-1].rsplit(".", 1)[-1]
    with pytest.raises(ConfigError, match=field):
        load_huge(where, tmp_path)


# --------------------------------------------------------------------------- checkpoint


def small_hf(**changes: Any) -> dict[str, Any]:
    """A valid LLaMA config.json of a tiny model, with `changes`."""
    config = ModelConfig(
        name="t", vocab_size=20, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=8
    )
    return {**hf_config(attrs.evolve(config, rope_theta=10_000.0)), **changes}


def test_rope_theta_defaults_to_transformers_ten_thousand() -> None:
    """A config.json with no RoPE keys at all (old LLaMA and Mistral files) has transformers' default base,
    10,000, not the preset's 500,000; a v4 top-level `rope_theta` is read when `rope_parameters` lacks it, and
    loses to the parameters' own when both have one."""
    bare = {key: value for key, value in small_hf().items() if key != "rope_parameters"}
    assert model_config_from_hf(bare, name="m").rope_theta == 10_000.0
    assert model_config_from_hf({**bare, "rope_theta": 1e6}, name="m").rope_theta == 1e6
    partial = {**bare, "rope_theta": 1e6, "rope_parameters": {"rope_type": "default"}}
    assert model_config_from_hf(partial, name="m").rope_theta == 1e6
    both = {**bare, "rope_theta": 1e6, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    assert model_config_from_hf(both, name="m").rope_theta == 5e5  # transformers v5: the parameters' theta wins


def test_llama3_rope_without_an_original_context_takes_llamas_default_context() -> None:
    """A llama3 RoPE scaling that names no `original_max_position_embeddings`, in a LLaMA config.json without
    `max_position_embeddings`, takes LlamaConfig's default context, 2048 (transformers fills the key in first)."""
    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    raw = {k: v for k, v in small_hf(rope_parameters=llama3).items() if k != "max_position_embeddings"}
    scaling = model_config_from_hf(raw, name="m").rope_scaling
    assert scaling is not None and scaling.original_max_position_embeddings == 2048


def test_qwen2_slides_only_from_its_default_window_layer_on() -> None:
    """Qwen2Config's `max_window_layers` defaults to 28: a 2-layer model with `use_sliding_window` and a short
    window is full attention in every layer, as transformers builds it; `layer_types` with one sliding layer
    among full ones puts the window in effect, which is refused."""
    qwen = {
        **small_hf(),
        "architectures": ["Qwen2ForCausalLM"],
        "use_sliding_window": True,
        "sliding_window": 8,
        "max_position_embeddings": 4096,
    }
    assert model_config_from_hf(qwen, name="q").qkv_bias
    mixed = {**qwen, "layer_types": ["full_attention", "sliding_attention"]}
    with pytest.raises(ConfigError, match="sliding_window=8"):
        model_config_from_hf(mixed, name="q")


def test_a_window_with_no_context_bound_is_in_effect() -> None:
    """A Mistral sliding window with `max_position_embeddings` null bounds nothing, so the window slides for
    long contexts: refused naming the window."""
    raw = {**small_hf(), "architectures": ["MistralForCausalLM"], "sliding_window": 64, "max_position_embeddings": None}
    with pytest.raises(ConfigError, match="sliding_window=64"):
        model_config_from_hf(raw, name="m")


@pytest.mark.parametrize("content", ["[1, 2]", "null", '"LlamaForCausalLM"'])
def test_a_config_json_that_is_no_object_is_refused_naming_it(tmp_path: Path, content: str) -> None:
    """config.json holding JSON that is not an object is a ConfigError naming the file, not an AttributeError."""
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ConfigError, match="expected a JSON object") as caught:
        read_model_config(tmp_path)
    assert str(tmp_path.resolve() / "config.json") in str(caught.value)


def tiny_weights(directory: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A 1-layer model's tensors under transformers' names, its config.json written to `directory`."""
    config = ModelConfig(
        name="w", vocab_size=6, hidden_size=4, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=4
    )
    from mooncake.engine.checkpoint import checkpoint_tensors
    from mooncake.engine.model import weight_names

    tensors = {
        tensor: torch.randn(shape, generator=torch.Generator().manual_seed(len(tensor)))
        for name in weight_names(config)
        for tensor, shape in checkpoint_tensors(config, name)
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config(config)))
    return config, tensors


@pytest.mark.parametrize("weight_map", [None, [], "model.safetensors", 5])
def test_an_index_without_a_weight_map_object_is_refused_naming_it(tmp_path: Path, weight_map: Any) -> None:
    """model.safetensors.index.json whose `weight_map` is missing or not an object (a list, a string) is a
    ConfigError naming the index, never an AttributeError."""
    config, tensors = tiny_weights(tmp_path)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    index = {"metadata": {}} if weight_map is None else {"metadata": {}, "weight_map": weight_map}
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="has no weight_map object") as caught:
        SafetensorsWeights(tmp_path, config)
    assert INDEX_FILE in str(caught.value)


def test_any_safetensors_file_name_loads_and_a_wrong_request_shape_is_refused(tmp_path: Path) -> None:
    """Without an index every `*.safetensors` file is read, whatever its name (`consolidated.safetensors`);
    a weight asked for with a shape other than its tensors' is a ConfigError naming the weight and both shapes."""
    config, tensors = tiny_weights(tmp_path)
    save_file(tensors, str(tmp_path / "consolidated.safetensors"))
    weights = SafetensorsWeights(tmp_path, config)
    assert torch.equal(weights.get("embedding", (6, 4)), tensors["model.embed_tokens.weight"])
    with pytest.raises(ConfigError, match=r"model weight final_norm .* has shape \(4,\), not \(5,\)"):
        weights.get("final_norm", (5,))
