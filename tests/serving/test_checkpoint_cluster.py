"""The example cluster serving a checkpoint: `[model] path` against transformers on the same files.

A small random `LlamaForCausalLM` is saved with a byte-level BPE trained here on local text (BOS, EOS, a
ChatML template); its head's EOS row is made a copy, a little larger, of the row of a token greedy decoding
reaches early, so generations end at EOS. One cluster (1 prefill + 1 decode) serves it. Each test proves:
the `openai` client's greedy text, its token counts and its finish reason equal transformers' `generate`
decoded without special tokens, less a character the generation left incomplete at its end (vLLM's output
never shows one: `vllm_text`; EOS ends a generation with "stop", as transformers stops there); a stream
joins to the same text; a chat's prompt is the checkpoint's template as `apply_chat_template` renders it;
`/v1/models` lists the served name; another checkpoint gets another block-key namespace; and the config
refuses a missing directory, one without config.json and an unsupported architecture in one line naming
`[model] path`. A pipeline group of two stages, each loading its own layers, prefills as the whole model.
Nothing is downloaded; every wait is bounded; the cluster is closed by its context manager.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("aiohttp")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a test never reaches the network

import torch  # noqa: E402
import transformers  # noqa: E402
from serving.config import ClusterConfig, load_config  # noqa: E402
from serving.launch import RunningCluster, start_cluster  # noqa: E402
from vllm_fleet.model import make_tokenizer  # noqa: E402

from mooncake.cache.hashing import BlockHasher  # noqa: E402
from mooncake.engine.logprobs import CONTEXT_TOKENS, completed_text  # noqa: E402
from mooncake.errors import ConfigError  # noqa: E402
from tests.engine.checkpoints import VOCAB, hf_model, save  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny.toml"
TIMEOUT_S = 60.0
MAX_TOKENS = 24
TEXT = [
    "Hello world! The quick brown fox jumps over the lazy dog. Héllo wörld, naïve café — déjà vu.",
    "Serving a model: prefill, then decode, token by token. 日本語 and 🙂 too.",
] * 20
PROMPTS = ["Hello world", "The quick brown fox", "naïve café — déjà vu", "Serving a model"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


def save_tokenizer(directory: Path) -> Any:
    """A byte-level BPE of at most VOCAB ids (the model's vocabulary) trained on TEXT, with BOS, EOS and ChatML,
    saved as transformers saves it (`vllm_fleet.model.make_tokenizer`); transformers' tokenizer of the files."""
    make_tokenizer(directory, corpus=TEXT, vocab_size=VOCAB)
    return transformers.AutoTokenizer.from_pretrained(directory)


def make_checkpoint(directory: Path, *, seed: int) -> tuple[Any, Any]:
    """The checkpoint in `directory` (made there); transformers' model and tokenizer of its files."""
    directory.mkdir(parents=True)
    tokenizer = save_tokenizer(directory)
    assert len(tokenizer) <= VOCAB
    model = hf_model("llama", seed=seed)
    eos = tokenizer.eos_token_id
    for settings in (model.config, model.generation_config):
        settings.bos_token_id, settings.eos_token_id, settings.pad_token_id = (
            tokenizer.bos_token_id,
            eos,
            tokenizer.pad_token_id,
        )
    # EOS takes over where greedy decoding of the first prompt reaches its 6th token: generations end early.
    ids = tokenizer(PROMPTS[0]).input_ids
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None)
        head = model.lm_head.weight
        head[eos] = 1.05 * head[int(out[0, -1])]
    save(model, directory)
    return transformers.AutoModelForCausalLM.from_pretrained(directory).eval(), tokenizer


def hf_generate(model: Any, ids: list[int], **options: Any) -> list[int]:
    """transformers' greedy `generate` of at most MAX_TOKENS after `ids` (with `options`): the new tokens."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            **options,
        )
    return [int(t) for t in out[0, len(ids) :]]


def vllm_text(tokenizer: Any, ids: list[int]) -> str:
    """transformers' decode of generated `ids` without special tokens as vLLM's output ends it: less a character
    left incomplete at the end (its stream emits whole characters only, and flushes nothing): the decode of the
    longest head of `ids` whose decode does not end in U+FFFD."""
    for count in range(len(ids), 0, -1):
        text = str(tokenizer.decode(ids[:count], skip_special_tokens=True))
        if not text.endswith("\ufffd"):
            return text
    return ""


def vllm_token_text(tokenizer: Any, token: int, sampled: list[int]) -> str:
    """vLLM's text beside a log-probability, with transformers' decode: the lone decode, or where that ends in
    U+FFFD the text the token completes after the tokens `sampled` before it ("" while none)."""
    decode = tokenizer.decode
    return completed_text(str(decode([token])), token, sampled[-CONTEXT_TOKENS:], lambda ids: str(decode(list(ids))))


def vllm_prompt_texts(tokenizer: Any, ids: list[int]) -> list[str]:
    """vLLM's texts of an echoed prompt's tokens beside their log-probabilities: the first token's lone decode (it
    has none), each later one's after the prompt's tokens before it from the second (`vllm_token_text`)."""
    return [str(tokenizer.decode(ids[:1])), *(vllm_token_text(tokenizer, ids[j], ids[1:j]) for j in range(1, len(ids)))]


def hf_answer(model: Any, tokenizer: Any, prompt: str) -> tuple[str, int, int, str]:
    """transformers' greedy answer: (text as vLLM shows it, prompt tokens, completion tokens, finish)."""
    ids = tokenizer(prompt).input_ids
    new = hf_generate(model, ids)
    finish = "stop" if new[-1] == tokenizer.eos_token_id else "length"
    return vllm_text(tokenizer, new), len(ids), len(new), finish


def cluster_config(directory: Path, **model: Any) -> ClusterConfig:
    base = load_config(TINY).with_overrides("cluster", port=0, num_prefill=1, num_decode=1)
    base = base.with_overrides("limits", max_prompt_tokens=256, default_max_tokens=16)
    return base.with_overrides("model", path=str(directory), **model)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    directory = tmp_path_factory.mktemp("checkpoints") / "tiny-llama"
    model, tokenizer = make_checkpoint(directory, seed=0)
    return directory, model, tokenizer


@pytest.fixture(scope="module")
def cluster(checkpoint: tuple[Path, Any, Any]) -> Iterator[RunningCluster]:
    with start_cluster(cluster_config(checkpoint[0])) as running:
        yield running


def client(cluster: RunningCluster) -> Any:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)


def test_greedy_completions_equal_transformers_generate(
    cluster: RunningCluster, checkpoint: tuple[Path, Any, Any]
) -> None:
    """For each prompt: the text, the prompt and completion token counts and the finish reason equal
    transformers' greedy `generate` on the same files; EOS ends at least one of them with "stop"; the decode
    engine generates exactly the answer's tokens (it stops at EOS itself, not when the gateway's cancel lands);
    /metrics counts each finish under the reason the answer gave, as vLLM's `request_success` does."""
    _, model, tokenizer = checkpoint
    api = client(cluster)
    registry = cluster.gateway.dispatcher.metrics.registry

    def successes(reason: str) -> float:
        labels = {"model_name": "tiny-llama", "engine": "decode-0", "finished_reason": reason}
        return registry.get_sample_value("mooncake:request_success_total", labels) or 0.0

    counted = {reason: successes(reason) for reason in ("stop", "length")}
    finishes = []
    for prompt in PROMPTS:
        text, prompt_tokens, completion_tokens, finish = hf_answer(model, tokenizer, prompt)
        before = cluster.gateway.dispatcher.health("decode-0").generated_tokens
        answer = api.completions.create(model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        choice = answer.choices[0]
        assert (choice.text, choice.finish_reason) == (text, finish), prompt
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (prompt_tokens, completion_tokens)
        generated = cluster.gateway.dispatcher.health("decode-0").generated_tokens - before
        assert generated == completion_tokens, (prompt, finish)
        finishes.append(finish)
    assert "stop" in finishes and "length" in finishes, finishes
    for reason, before in counted.items():
        assert successes(reason) - before == finishes.count(reason), reason


def test_eos_as_the_first_token_ends_the_request_at_once(
    cluster: RunningCluster, checkpoint: tuple[Path, Any, Any]
) -> None:
    """A prompt whose greedy first token (the prefill's) is EOS: an empty text with "stop" after one
    completion token, as transformers gives, and the decode worker holds nothing of it afterwards."""
    _, model, tokenizer = checkpoint
    ids = tokenizer(PROMPTS[0]).input_ids
    with torch.inference_mode():  # make_checkpoint put EOS at the 6th greedy token of PROMPTS[0]
        out = model.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False, eos_token_id=None)
    prompt = PROMPTS[0] + tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    text, prompt_tokens, completion_tokens, finish = hf_answer(model, tokenizer, prompt)
    assert (text, completion_tokens, finish) == ("", 1, "stop")  # the case this test is about
    before = cluster.gateway.dispatcher.health("decode-0").generated_tokens
    answer = client(cluster).completions.create(model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == ("", "stop")
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (prompt_tokens, 1)
    health = cluster.gateway.dispatcher.health("decode-0")
    assert health.generated_tokens - before == 1 and health.active == ()


def test_a_stream_joins_to_the_whole_text(cluster: RunningCluster, checkpoint: tuple[Path, Any, Any]) -> None:
    """Streamed pieces join to transformers' text (a random model's bytes that are no character are U+FFFD in
    both), and the last chunk says why it ended."""
    _, model, tokenizer = checkpoint
    api = client(cluster)
    for prompt in PROMPTS[:2]:
        text, _, _, finish = hf_answer(model, tokenizer, prompt)
        chunks = list(
            api.completions.create(model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True)
        )
        assert "".join(c.choices[0].text for c in chunks) == text
        assert chunks[-1].choices[0].finish_reason == finish


def test_a_chat_renders_the_checkpoints_template(cluster: RunningCluster, checkpoint: tuple[Path, Any, Any]) -> None:
    """A chat's prompt is the checkpoint's template as transformers' `apply_chat_template` renders it (its
    token count), and its greedy reply is `generate`'s for those tokens."""
    _, model, tokenizer = checkpoint
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert rendered.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    ids = tokenizer(rendered, add_special_tokens=False).input_ids
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    reply = vllm_text(tokenizer, [int(t) for t in out[0, len(ids) :]])
    answer = client(cluster).chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0
    )
    assert answer.usage.prompt_tokens == len(ids)
    assert answer.choices[0].message.content == reply


def test_ignore_eos_min_tokens_and_add_special_tokens_generate_as_transformers(
    cluster: RunningCluster, checkpoint: tuple[Path, Any, Any]
) -> None:
    """The vLLM parameters benchmarks send, on the prompt whose greedy 6th token is EOS: `ignore_eos` runs to
    `max_tokens` past EOS ("length", transformers' `generate` without an EOS); `min_tokens` 8 holds EOS off for
    8 tokens (transformers' `min_new_tokens`); `add_special_tokens: false` leaves out the BOS (the prompt one
    token shorter). Each answer's text and counts equal transformers' on the same files."""
    _, model, tokenizer = checkpoint
    api = client(cluster)
    ids = tokenizer(PROMPTS[0]).input_ids

    def hf(prompt_ids: list[int], **options: Any) -> tuple[str, int]:
        new = hf_generate(model, prompt_ids, **options)
        return vllm_text(tokenizer, new), len(new)

    def ours(**extra: Any) -> tuple[str, int, int, str]:
        answer = api.completions.create(
            model="tiny-llama", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
        )
        choice = answer.choices[0]
        return choice.text, answer.usage.prompt_tokens, answer.usage.completion_tokens, choice.finish_reason

    assert hf(ids)[1] == 6  # make_checkpoint's EOS: the case this test is about
    text, count = hf(ids, eos_token_id=None)
    assert ours(ignore_eos=True) == (text, len(ids), MAX_TOKENS, "length") and count == MAX_TOKENS
    text, count = hf(ids, min_new_tokens=8)
    assert count > 8 and ours(min_tokens=8) == (text, len(ids), count, "stop" if count < MAX_TOKENS else "length")
    bare = tokenizer(PROMPTS[0], add_special_tokens=False).input_ids
    assert len(bare) == len(ids) - 1
    text, count = hf(bare)
    answer = ours(add_special_tokens=False)
    assert answer[:3] == (text, len(bare), count)


def test_penalties_and_top_k_generate_as_transformers_and_vllm_define_them(
    cluster: RunningCluster, checkpoint: tuple[Path, Any, Any]
) -> None:
    """vLLM's sampling extras through the cluster (the penalties count the prefill's first token on the decode
    node too, and the prompt travels with the hand-off for the repetition penalty): a greedy request with
    `repetition_penalty` 1.3 (or 0.7) generates what transformers' `generate(repetition_penalty=...)` does over
    the same prompt, in a completion and a stream; `top_k: 1` sampling at temperature 1 is greedy; presence and
    frequency penalties generate what transformers does with OpenAI's definitions as its logits processor."""
    _, model, tokenizer = checkpoint
    api = client(cluster)
    common = {"model": "tiny-llama", "max_tokens": MAX_TOKENS, "temperature": 0}
    start = 0

    def output_only(penalty: float) -> Any:
        """transformers' repetition penalty over the generated tokens alone (the prompt's left out)."""

        def process(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            seen = input_ids[0, start:]
            picked = scores[0, seen]
            scores[0, seen] = torch.where(picked < 0, picked * penalty, picked / penalty)
            return scores

        return transformers.LogitsProcessorList([process])

    # A prompt whose penalized generation depends on its prompt's tokens, not only on those generated: ours must
    # then have counted the prompt, which the decode node knows only from the hand-off.
    prompt_counted = False
    for prompt in [*PROMPTS, *TEXT[:2]]:
        ids = tokenizer(prompt).input_ids
        start = len(ids)
        for penalty in (1.3, 0.7):
            new = hf_generate(model, ids, eos_token_id=None, repetition_penalty=penalty)
            extra = {"repetition_penalty": penalty, "ignore_eos": True}
            answer = api.completions.create(prompt=prompt, extra_body=extra, **common)
            assert answer.choices[0].text == vllm_text(tokenizer, new), (prompt, penalty)
            streamed = api.completions.create(prompt=prompt, extra_body=extra, stream=True, **common)
            assert "".join(c.choices[0].text for c in streamed) == answer.choices[0].text
            prompt_counted |= new != hf_generate(model, ids, eos_token_id=None, logits_processor=output_only(penalty))
        if prompt_counted:
            break
    assert prompt_counted, "no prompt's penalized generation depends on its prompt: the test proves nothing"
    sampled = {**common, "temperature": 1.0, "seed": 5}
    for prompt in PROMPTS:
        greedy = api.completions.create(prompt=prompt, **common).choices[0].text
        assert api.completions.create(prompt=prompt, extra_body={"top_k": 1}, **sampled).choices[0].text == greedy
    ids = tokenizer(PROMPTS[0]).input_ids

    def openai_penalties(presence: float, frequency: float) -> Any:
        """OpenAI's presence and frequency penalties over the generated tokens, as a transformers logits processor."""

        def process(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            counts = torch.bincount(input_ids[0, len(ids) :], minlength=scores.shape[-1]).to(scores.dtype)
            return scores - frequency * counts - presence * (counts > 0).to(scores.dtype)

        return transformers.LogitsProcessorList([process])

    changed = False
    for presence, frequency in ((2.0, 0.0), (0.0, 1.5), (-1.0, 0.5)):
        new = hf_generate(model, ids, eos_token_id=None, logits_processor=openai_penalties(presence, frequency))
        extra = {"presence_penalty": presence, "frequency_penalty": frequency, "ignore_eos": True}
        answer = api.completions.create(prompt=PROMPTS[0], extra_body=extra, **common)
        assert answer.choices[0].text == vllm_text(tokenizer, new), (presence, frequency)
        changed |= new != hf_generate(model, ids, eos_token_id=None)
    assert changed, "no penalty changed the greedy generation: the test proves nothing"


def test_logit_bias_stop_token_ids_and_include_stop_str_act_as_vllm_defines_them(
    cluster: RunningCluster, checkpoint: tuple[Path, Any, Any]
) -> None:
    """`logit_bias` generates what transformers does with the biases added by a logits processor (greedy: two
    tokens of the plain answer lifted, one banned), on the prefill's first token and the decode's; a greedy
    token chosen as `stop_token_ids` ends the answer there ("stop", the id as `stop_reason`, its text cut, or
    kept with `include_stop_str_in_output`, the tokens counted up to it); a stop string is kept the same way."""
    _, model, tokenizer = checkpoint
    api = client(cluster)
    common = {"model": "tiny-llama", "max_tokens": MAX_TOKENS, "temperature": 0}
    ids = tokenizer(PROMPTS[1]).input_ids
    plain = hf_generate(model, ids, eos_token_id=None)
    bias = {plain[0]: -100.0, plain[3]: 7.5, plain[5]: 3.0}

    def biased(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for token, value in bias.items():
            scores[:, token] += value
        return scores

    expected = hf_generate(model, ids, eos_token_id=None, logits_processor=transformers.LogitsProcessorList([biased]))
    assert expected != plain  # the case this test is about
    extra = {"logit_bias": {str(t): b for t, b in bias.items()}, "ignore_eos": True}
    answer = api.completions.create(prompt=PROMPTS[1], extra_body=extra, **common)
    assert answer.choices[0].text == vllm_text(tokenizer, expected)
    stop = plain[4]
    cut = plain.index(stop)  # the first time greedy decoding draws it
    for include in (False, True):
        extra = {"stop_token_ids": [stop], "ignore_eos": True, "include_stop_str_in_output": include}
        choice = api.completions.create(prompt=PROMPTS[1], extra_body=extra, logprobs=0, **common).choices[0]
        shown = plain[: cut + 1] if include else plain[:cut]
        assert (choice.finish_reason, choice.stop_reason) == ("stop", stop)
        assert choice.text == vllm_text(tokenizer, shown)
        assert len(choice.logprobs.tokens) == cut + 1  # the stop token was generated, and is counted
    text = api.completions.create(prompt=PROMPTS[1], **common).choices[0].text
    word = text[len(text) // 2 : len(text) // 2 + 2]
    extra = {"include_stop_str_in_output": True}
    kept = api.completions.create(prompt=PROMPTS[1], stop=[word], extra_body=extra, **common).choices[0]
    assert kept.text == text[: text.index(word) + len(word)] and kept.stop_reason == word


def hf_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """transformers' float32 log-probabilities [vocab] of the token after `ids`."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)


def test_logprobs_equal_transformers_for_greedy_and_sampled_tokens(
    cluster: RunningCluster, checkpoint: tuple[Path, Any, Any]
) -> None:
    """A completion's `logprobs: 5` answer, greedy and sampled (temperature 1.3, seeded): each token's text is
    vLLM's for it (`vllm_token_text`: transformers' `decode([id])`, or for a byte of a character the character
    at its last byte and "" before, after the tokens sampled before it) of the token (`return_token_ids`) whose
    log-probability under transformers' forward pass over the prompt and the tokens before it is the one listed,
    within 1e-4 (the model's own, not the temperature's); its top object holds the token's own and the 5 most
    probable tokens' log-probabilities, by their texts after the same tokens; `text_offset` sums the token texts
    before it; there are as many as the usage counts. Greedy tokens are each the most probable. A chat's
    `top_logprobs: 3` lists the 3 most probable, most probable first, with each text's UTF-8 bytes."""
    _, model, tokenizer = checkpoint
    api = client(cluster)
    ids = tokenizer(PROMPTS[1]).input_ids
    completed = 0  # tokens whose text is not their lone decode: the bytes of a character
    for options in ({"temperature": 0}, {"temperature": 1.3, "seed": 11}):
        answer = api.completions.create(
            model="tiny-llama",
            prompt=PROMPTS[1],
            max_tokens=MAX_TOKENS,
            logprobs=5,
            extra_body={"return_token_ids": True},
            **options,
        )
        got = answer.choices[0].logprobs
        sampled = answer.choices[0].model_extra["token_ids"]
        assert len(got.tokens) == len(sampled) == answer.usage.completion_tokens
        context, offset = list(ids), 0
        for i, (text, logprob, top) in enumerate(zip(got.tokens, got.token_logprobs, got.top_logprobs, strict=True)):
            reference = hf_logprobs(model, context)
            token = sampled[i]
            assert text == vllm_token_text(tokenizer, token, sampled[:i]), (options, i)
            completed += text != tokenizer.decode([token])
            assert abs(float(reference[token]) - logprob) < 1e-4, (options, i, text)
            best = torch.sort(reference, descending=True, stable=True).indices[:5].tolist()
            wanted = {vllm_token_text(tokenizer, t, sampled[:i]): float(reference[t]) for t in [token, *best]}
            assert top.keys() == wanted.keys() and all(abs(top[k] - v) < 1e-4 for k, v in wanted.items()), i
            assert got.text_offset[i] == offset
            if options["temperature"] == 0:
                assert token == best[0]
            offset += len(text)
            context.append(token)
    assert completed > 0  # the case the context is for
    chat = api.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for item in content:
        assert item.bytes == list(item.token.encode("utf-8")) and len(item.top_logprobs) == 3
        assert [t.logprob for t in item.top_logprobs] == sorted((t.logprob for t in item.top_logprobs), reverse=True)
        assert (item.top_logprobs[0].token, item.top_logprobs[0].logprob) == (item.token, item.logprob)  # greedy


def test_streamed_logprobs_join_to_the_whole_answers(cluster: RunningCluster) -> None:
    """A stream's chunks carry the log-probabilities of the tokens each is the first to show: joined, they are
    the whole answer's (same tokens, values, top objects and text offsets), and a chat stream's are its
    answer's `content`; no token is listed twice or left out (held-back text included, and with a stop string
    that cuts the text)."""
    api = client(cluster)
    common = {"model": "tiny-llama", "max_tokens": MAX_TOKENS, "temperature": 0}
    for prompt in PROMPTS[:2]:
        whole = api.completions.create(prompt=prompt, logprobs=2, **common).choices[0].logprobs
        chunks = [
            c.choices[0].logprobs for c in api.completions.create(prompt=prompt, logprobs=2, stream=True, **common)
        ]
        joined: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for part in chunks:
            for key in joined:
                joined[key] += [] if part is None else getattr(part, key)
        assert joined == {key: getattr(whole, key) for key in joined}, prompt
    # A stop string from the middle of an answer: the text held back for it, and cut at it, changes no list.
    text = api.completions.create(prompt=PROMPTS[1], **common).choices[0].text
    stop = {"stop": [text[len(text) // 2 : len(text) // 2 + 2]], "logprobs": 1}
    whole = api.completions.create(prompt=PROMPTS[1], **common, **stop).choices[0]
    assert whole.finish_reason == "stop" and len(whole.text) < len(text)
    chunks = [c.choices[0] for c in api.completions.create(prompt=PROMPTS[1], stream=True, **common, **stop)]
    assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == whole.logprobs.tokens
    whole = api.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=2, **common)
    stream = api.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=2, stream=True, **common)
    streamed = [item for c in stream if c.choices and c.choices[0].logprobs for item in c.choices[0].logprobs.content]
    assert streamed == whole.choices[0].logprobs.content


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(
    cluster: RunningCluster, checkpoint: tuple[Path, Any, Any]
) -> None:
    """lm-evaluation-harness's loglikelihood request (a prompt of token ids in a batch of one, `echo`, `logprobs:
    1`, `max_tokens: 1`, greedy): the answer opens with the prompt's text and tokens, the first token's
    log-probability null, each later one transformers' log-softmax at the position before it (1e-4), the
    sampled token last; a second time, with the prompt's blocks now cached, the same figures (the prompt is
    scored whole, not from the cache: no cached tokens reported); a text prompt's echo is its text; a stream joins to the whole answer."""
    _, model, tokenizer = checkpoint
    api = client(cluster)
    ids = tokenizer(TEXT[0]).input_ids  # over two blocks: a prefix to cache
    with torch.inference_mode():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = [float(reference[j - 1, ids[j]]) for j in range(1, len(ids))]
    body = {"model": "tiny-llama", "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    answers = [api.completions.create(prompt=[ids], **body) for _ in range(2)]
    for answer in answers:
        got = answer.choices[0].logprobs
        assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
        assert len(got.tokens) == len(ids) + 1 == answer.usage.prompt_tokens + answer.usage.completion_tokens
        assert got.tokens[: len(ids)] == vllm_prompt_texts(tokenizer, ids)
        assert max(abs(a - b) for a, b in zip(got.token_logprobs[1 : len(ids)], expected, strict=True)) < 1e-4
        greedy = int(reference[-1].argmax())
        assert got.tokens[-1] == vllm_token_text(tokenizer, greedy, [])  # the generation's first: no context
        assert answer.choices[0].text.startswith(tokenizer.decode(ids))  # special tokens kept, as vLLM echoes ids
    cached = api.completions.create(prompt=[ids], model="tiny-llama", max_tokens=1, temperature=0)
    assert cached.usage.prompt_tokens_details.cached_tokens > 0  # its blocks are cached ...
    assert answers[1].usage.prompt_tokens_details.cached_tokens == 0  # ... and a scored prompt reuses none
    assert answers[0].choices[0].logprobs == answers[1].choices[0].logprobs
    text_body = {**body, "max_tokens": 6}
    whole = api.completions.create(prompt=PROMPTS[2], **text_body).choices[0]
    plain = api.completions.create(prompt=PROMPTS[2], **{**text_body, "echo": False}).choices[0]
    assert whole.text == PROMPTS[2] + plain.text
    assert whole.logprobs.tokens[len(tokenizer(PROMPTS[2]).input_ids) :] == plain.logprobs.tokens
    chunks = [c.choices[0] for c in api.completions.create(prompt=PROMPTS[2], stream=True, **text_body)]
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == whole.logprobs.tokens
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == whole.logprobs.text_offset
    # A prompt of ids with the model's EOS and a request stop id inside: echoed whole, as vLLM decodes it.
    inner = [*ids[:4], tokenizer.eos_token_id, *ids[4:]]
    extra = {"stop_token_ids": [ids[2]]}
    echoed = api.completions.create(prompt=[inner], extra_body=extra, **{**body, "logprobs": None}).choices[0]
    assert echoed.text.startswith(tokenizer.decode(inner)) and tokenizer.eos_token in echoed.text


def test_prompt_logprobs_list_the_prompts_scores_as_transformers_gives_them(
    cluster: RunningCluster, checkpoint: tuple[Path, Any, Any]
) -> None:
    """vLLM's `prompt_logprobs: 3`: each choice of a completion (both of `n: 2`) lists null for the first prompt
    token, then per token an object keyed by token ids: the token's own log-probability (transformers'
    log-softmax at the position before it, 1e-4) with its rank in the vocabulary, then the 3 most probable with
    ranks 1 to 3, each with its decoded text; a chat's answer lists its rendered prompt's beside its choices;
    without the field, null; a stream asking for a count is a 400."""
    _, model, tokenizer = checkpoint
    api = client(cluster)
    ids = tokenizer(PROMPTS[1]).input_ids
    with torch.inference_mode():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    common = {"model": "tiny-llama", "max_tokens": 2, "temperature": 0}
    answer = api.completions.create(prompt=PROMPTS[1], n=2, extra_body={"prompt_logprobs": 3}, **common)
    listed = [choice.model_extra["prompt_logprobs"] for choice in answer.choices]
    assert listed[0] == listed[1] and len(listed[0]) == len(ids) and listed[0][0] is None
    for position, (token, one) in enumerate(zip(ids[1:], listed[0][1:], strict=True)):
        row = reference[position]
        best = torch.sort(row, descending=True, stable=True).indices[:3].tolist()
        assert list(one) == list(dict.fromkeys([str(token), *map(str, best)]))
        own = one[str(token)]
        assert abs(own["logprob"] - float(row[token])) < 1e-4
        assert own["decoded_token"] == vllm_prompt_texts(tokenizer, ids)[position + 1]
        if token not in best:
            assert own["rank"] == int((row >= row[token]).sum())
        for rank, other in enumerate(best, start=1):
            entry = one[str(other)]
            assert entry["rank"] == rank and abs(entry["logprob"] - float(row[other])) < 1e-4
    plain = api.completions.create(prompt=PROMPTS[1], **common)
    assert plain.choices[0].model_extra["prompt_logprobs"] is None
    chat = api.chat.completions.create(messages=MESSAGES, extra_body={"prompt_logprobs": 0}, **common)
    scores = chat.model_extra["prompt_logprobs"]
    assert len(scores) == chat.usage.prompt_tokens and scores[0] is None
    assert all(len(one) == 1 and next(iter(one.values()))["rank"] >= 1 for one in scores[1:])
    with pytest.raises(openai.BadRequestError, match="not available when stream"):
        api.completions.create(prompt=PROMPTS[1], stream=True, extra_body={"prompt_logprobs": 1}, **common)


def test_vllms_output_options_answer_as_vllm_answers(
    cluster: RunningCluster, checkpoint: tuple[Path, Any, Any]
) -> None:
    """`return_token_ids`: a completion's choice has the prompt's ids (`prompt_token_ids`, the tokenizer's) and its
    own (`token_ids`, as many as the usage counts, decoding to its text), a chat's answer the prompt's beside its
    choices; streamed, the first chunk carries the prompt's and the chunks' `token_ids` join to the whole
    answer's. `return_tokens_as_token_ids`: each log-probability's token reads "token_id:{id}" (text offsets
    summing those). `allowed_token_ids`: greedy draws the most probable allowed token at each step (transformers'
    logits). `truncate_prompt_tokens: k`: the prompt is its last k tokens, so the answer is that of those ids."""
    _, model, tokenizer = checkpoint
    api = client(cluster)
    common = {"model": "tiny-llama", "max_tokens": 4, "temperature": 0}
    ids = tokenizer(PROMPTS[1]).input_ids
    whole = api.completions.create(prompt=PROMPTS[1], extra_body={"return_token_ids": True}, **common)
    choice = whole.choices[0].model_extra
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == whole.usage.completion_tokens
    assert vllm_text(tokenizer, choice["token_ids"]) == whole.choices[0].text
    stream = list(
        api.completions.create(prompt=PROMPTS[1], stream=True, extra_body={"return_token_ids": True}, **common)
    )
    firsts = [c.choices[0].model_extra.get("prompt_token_ids") for c in stream]
    assert firsts[0] == ids and not any(firsts[1:])
    assert [t for c in stream for t in c.choices[0].model_extra["token_ids"]] == choice["token_ids"]
    chat = api.chat.completions.create(messages=MESSAGES, extra_body={"return_token_ids": True}, **common)
    assert len(chat.model_extra["prompt_token_ids"]) == chat.usage.prompt_tokens
    assert len(chat.choices[0].model_extra["token_ids"]) == chat.usage.completion_tokens
    chunks = list(
        api.chat.completions.create(messages=MESSAGES, stream=True, extra_body={"return_token_ids": True}, **common)
    )
    assert chunks[0].model_extra["prompt_token_ids"] == chat.model_extra["prompt_token_ids"]
    streamed = [t for c in chunks if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert streamed == chat.choices[0].model_extra["token_ids"]
    named = api.completions.create(
        prompt=PROMPTS[1],
        logprobs=2,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
        **common,
    ).choices[0]
    generated = named.model_extra["token_ids"]
    assert named.logprobs.tokens == [f"token_id:{t}" for t in generated]
    assert all(key.startswith("token_id:") for top in named.logprobs.top_logprobs for key in top)
    assert named.logprobs.text_offset == [
        sum(len(f"token_id:{t}") for t in generated[:i]) for i in range(len(generated))
    ]
    allowed = sorted({5, 17, 42, 99, 123})
    answer = api.completions.create(
        prompt=[ids], extra_body={"allowed_token_ids": allowed, "return_token_ids": True}, **{**common, "max_tokens": 3}
    )
    context = list(ids)
    for token in answer.choices[0].model_extra["token_ids"]:
        with torch.inference_mode():
            last = model(torch.tensor([context])).logits[0, -1].float()
        assert token == max(allowed, key=lambda t: float(last[t]))
        context.append(token)
    long = tokenizer(TEXT[0]).input_ids
    cut = api.completions.create(
        prompt=[long], extra_body={"truncate_prompt_tokens": 7, "return_token_ids": True}, **common
    )
    alone = api.completions.create(prompt=[long[-7:]], **common)
    assert cut.usage.prompt_tokens == 7 and cut.choices[0].model_extra["prompt_token_ids"] == long[-7:]
    assert cut.choices[0].text == alone.choices[0].text
    # A text prompt is cut as the tokenizer's left truncation cuts it (vLLM's): the BOS stays.
    tokenizer.truncation_side = "left"
    expected = tokenizer(TEXT[0], truncation=True, max_length=7).input_ids
    assert expected[0] == tokenizer.bos_token_id
    extra = {"truncate_prompt_tokens": 7, "return_token_ids": True}
    text_cut = api.completions.create(prompt=TEXT[0], extra_body=extra, **common).choices[0]
    assert text_cut.model_extra["prompt_token_ids"] == expected
    echoed = api.completions.create(prompt=[long], echo=True, extra_body=extra, **common).choices[0]
    assert echoed.text.startswith(tokenizer.decode(long[-7:]))  # the ids the engines got, not the whole prompt


def test_a_chats_final_message_is_continued_as_vllm_continues_it(
    cluster: RunningCluster, checkpoint: tuple[Path, Any, Any]
) -> None:
    """vLLM's `continue_final_message` (with `add_generation_prompt: false`): the prompt is transformers'
    `apply_chat_template(continue_final_message=True)`, ending inside the assistant's begun reply, and greedy
    goes on from there as transformers' model does."""
    _, model, tokenizer = checkpoint
    api = client(cluster)
    messages = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    extra = {"add_generation_prompt": False, "continue_final_message": True, "return_token_ids": True}
    answer = api.chat.completions.create(
        model="tiny-llama", messages=messages, max_tokens=3, temperature=0, extra_body=extra
    )
    expected = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=False, continue_final_message=True
    )
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert answer.model_extra["prompt_token_ids"] == expected
    context = list(expected)
    for token in answer.choices[0].model_extra["token_ids"]:
        with torch.inference_mode():
            assert token == int(model(torch.tensor([context])).logits[0, -1].argmax())
        context.append(token)


def test_a_batch_of_prompts_answers_each_as_its_own_request(
    cluster: RunningCluster, checkpoint: tuple[Path, Any, Any]
) -> None:
    """OpenAI's array `prompt` (texts and token ids): prompt i's choice j is index i * n + j and answers what
    a request of that prompt alone answers with the same seed (its choice j), echo and `return_token_ids` each
    its own prompt's, the usage every prompt once plus every choice's tokens; a stream's chunks carry those
    indexes and join to the whole answer; one bad prompt refuses the batch with a 400."""
    _, _, tokenizer = checkpoint
    api = client(cluster)
    batch = [PROMPTS[0], tokenizer(PROMPTS[2]).input_ids, PROMPTS[3]]
    common = {"model": "tiny-llama", "max_tokens": 5, "temperature": 0.8, "seed": 7, "n": 2, "echo": True}
    extra = {"return_token_ids": True}
    whole = api.completions.create(prompt=batch, extra_body=extra, **common)
    assert [c.index for c in whole.choices] == list(range(6))
    alone = [
        api.completions.create(prompt=[p] if isinstance(p, list) else p, extra_body=extra, **common) for p in batch
    ]
    for i, answer in enumerate(alone):
        for j in range(2):
            got, wanted = whole.choices[2 * i + j], answer.choices[j]
            assert (got.text, got.finish_reason) == (wanted.text, wanted.finish_reason), (i, j)
            assert got.model_extra["prompt_token_ids"] == wanted.model_extra["prompt_token_ids"]
    assert whole.choices[2].text.startswith(tokenizer.decode(batch[1]))  # ids echoed as decoded
    assert whole.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert whole.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    texts = [""] * 6
    for chunk in api.completions.create(prompt=batch, stream=True, extra_body=extra, **common):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in whole.choices]
    with pytest.raises(openai.BadRequestError):
        api.completions.create(prompt=[PROMPTS[0], [VOCAB]], **common)


def test_echo_with_max_tokens_0_is_the_scored_prompt_alone(
    cluster: RunningCluster, checkpoint: tuple[Path, Any, Any]
) -> None:
    """OpenAI's way to score a prompt, `echo` with `max_tokens: 0`: the answer is the prompt's text and its
    tokens' log-probabilities only (no token generated is shown or counted), whole or streamed; without echo,
    0 stays a 400."""
    _, _, tokenizer = checkpoint
    api = client(cluster)
    ids = tokenizer(PROMPTS[3]).input_ids
    body = {"model": "tiny-llama", "prompt": PROMPTS[3], "max_tokens": 0, "echo": True, "logprobs": 1}
    whole = api.completions.create(**body)
    choice = whole.choices[0]
    assert (choice.text, choice.finish_reason, whole.usage.completion_tokens) == (PROMPTS[3], "length", 0)
    assert choice.logprobs.tokens == vllm_prompt_texts(tokenizer, ids) and choice.logprobs.token_logprobs[0] is None
    chunks = [c.choices[0] for c in api.completions.create(stream=True, **body)]
    assert "".join(c.text for c in chunks) == PROMPTS[3]
    assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == choice.logprobs.tokens
    with pytest.raises(openai.BadRequestError):
        api.completions.create(**{**body, "echo": False})


def test_n_choices_are_the_seeded_requests_of_each_choice(cluster: RunningCluster) -> None:
    """`n: 3` with a seed: choice i is what one request seeded seed + i answers (vLLM's rule), text, finish reason
    and log-probabilities (to a batch's float rounding), whole or streamed (chunks carry their choice's index; a chat stream opens each choice
    with its role); the usage counts the prompt once and every choice's tokens; the route headers name each
    choice's instances; with continuous usage each chunk counts its own choice's tokens; greedy choices are
    equal. `n: 12`, more than the decode engine's batch of 8 at once,
    is served too (the choices past the batch wait for room while the first ones run)."""
    api = client(cluster)
    body = {"model": "tiny-llama", "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 1.0, "logprobs": 1}
    alone = [api.completions.create(seed=40 + i, **body) for i in range(3)]
    raw = api.completions.with_raw_response.create(seed=40, n=3, **body)
    both = raw.parse()
    assert [c.index for c in both.choices] == [0, 1, 2]
    for choice, single in zip(both.choices, alone, strict=True):
        expected = single.choices[0]
        assert (choice.text, choice.finish_reason, choice.logprobs.tokens) == (
            expected.text,
            expected.finish_reason,
            expected.logprobs.tokens,
        )
        # Batched with its siblings rather than alone: the same tokens, the floats within a batch's rounding.
        pairs = zip(choice.logprobs.token_logprobs, expected.logprobs.token_logprobs, strict=True)
        assert max(abs(a - b) for a, b in pairs) < 1e-4
    assert both.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert both.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert len(raw.headers["X-Mooncake-Decode-Instance"].split(",")) == 3
    streamed: dict[int, str] = {0: "", 1: "", 2: ""}
    finishes = {}
    for chunk in api.completions.create(seed=40, n=3, stream=True, **body):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert streamed == {i: a.choices[0].text for i, a in enumerate(alone)}
    assert finishes == {i: a.choices[0].finish_reason for i, a in enumerate(alone)}
    chat = {"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "n": 2}
    greedy = api.chat.completions.create(**chat)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    roles, texts = [], {0: "", 1: ""}
    for chunk in api.chat.completions.create(stream=True, **chat):
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.index)
            texts[choice.index] += choice.delta.content or ""
    assert sorted(roles) == [0, 1] and texts == {i: c.message.content for i, c in enumerate(greedy.choices)}
    # continuous_usage_stats: each chunk's usage counts its own choice's tokens (vLLM's), the last chunk all.
    options = {"include_usage": True, "continuous_usage_stats": True}
    last_usage: dict[int, int] = {}
    chunks = list(
        api.completions.create(
            seed=1,
            n=2,
            stream=True,
            stream_options=options,
            **{**body, "max_tokens": 3},
            extra_body={"ignore_eos": True},
        )
    )
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            last_usage[choice.index] = chunk.usage.completion_tokens
    assert last_usage == {0: 3, 1: 3} and chunks[-1].usage.completion_tokens == 6
    many = api.completions.create(**{**body, "n": 12, "max_tokens": 4, "logprobs": 0})
    assert [c.index for c in many.choices] == list(range(12))
    assert many.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in many.choices)
    assert not cluster.gateway.dispatcher.live  # every choice ended


def test_skip_special_tokens_false_shows_them_as_transformers_decodes_them(checkpoint: tuple[Path, Any, Any]) -> None:
    """The stream of a request with skip_special_tokens false writes a special token's text where transformers'
    decode(skip_special_tokens=False) does; by default it leaves it out, as decode(skip_special_tokens=True)."""
    from serving.tokenizer import CheckpointTokenizer

    from mooncake.engine.tokenizer import load_tokenizer

    directory, _, tokenizer = checkpoint
    ours = CheckpointTokenizer(load_tokenizer(directory))
    ids = [
        *tokenizer("Hello").input_ids,
        tokenizer.convert_tokens_to_ids("<|im_start|>"),
        *tokenizer("there").input_ids,
    ]
    texts = []
    for skip in (True, False):
        stream = ours.stream(skip_special_tokens=skip)
        texts.append("".join(stream.feed(token) for token in ids) + stream.finish())
        assert texts[-1] == tokenizer.decode(ids, skip_special_tokens=skip), skip  # whole characters: all of it
    assert "<|im_start|>" in texts[1] and "<|im_start|>" not in texts[0]


def test_models_lists_the_served_name(cluster: RunningCluster) -> None:
    """/v1/models lists the checkpoint's directory name; another name is OpenAI's 404."""
    api = client(cluster)
    assert [m.id for m in api.models.list().data] == ["tiny-llama"]
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="tiny", prompt="Hello", max_tokens=2)


def test_each_checkpoint_has_its_own_block_key_namespace(checkpoint: tuple[Path, Any, Any], tmp_path: Path) -> None:
    """Two checkpoints (other weights), or one under another served name, never share block keys; a config's
    namespace is the same however often it is asked (the gateway and every worker ask it)."""
    other = tmp_path / "tiny-llama"
    make_checkpoint(other, seed=1)
    first, second = cluster_config(checkpoint[0]), cluster_config(other)
    renamed = cluster_config(checkpoint[0], served_model_name="chat")
    assert first.model.served_name == second.model.served_name == "tiny-llama"
    assert renamed.model.served_name == "chat"
    namespaces = {c.model.namespace for c in (first, second, renamed)}
    assert len(namespaces) == 3 and "tiny" not in namespaces
    assert cluster_config(checkpoint[0]).model.namespace == first.model.namespace
    tokens = list(range(64))
    keys = [BlockHasher(model=c.model.namespace, block_size_tokens=16).block_keys(tokens) for c in (first, second)]
    assert not set(keys[0]) & set(keys[1])


def test_the_config_refuses_what_is_not_a_checkpoint(checkpoint: tuple[Path, Any, Any], tmp_path: Path) -> None:
    """A missing directory, one without config.json and an unsupported architecture: one line naming the key."""
    base = load_config(TINY)
    unsupported = tmp_path / "gpt2"
    unsupported.mkdir()
    raw = json.loads((checkpoint[0] / "config.json").read_text())
    (unsupported / "config.json").write_text(json.dumps({**raw, "architectures": ["GPT2LMHeadModel"]}))
    cases = {
        tmp_path / "missing": "is not a directory",
        tmp_path: "holds no config.json",
        unsupported: "GPT2LMHeadModel",
    }
    for path, reason in cases.items():
        with pytest.raises(ConfigError) as caught:
            base.with_overrides("model", path=str(path))
        message = str(caught.value)
        assert "[model] path = " in message and reason in message and "\n" not in message, message


def test_a_pipeline_group_loads_each_stages_layers(checkpoint: tuple[Path, Any, Any]) -> None:
    """`[prefill] pipeline_size = 2` on a checkpoint: the group's two stages each read their own layers, and its
    prefill's logits are transformers' (float32 tolerance)."""
    from mooncake.engine.pipeline import PipelineGroup

    directory, model, tokenizer = checkpoint
    config = cluster_config(directory).with_overrides("prefill", pipeline_size=2)
    ids = tokenizer(PROMPTS[1]).input_ids
    with torch.inference_mode():
        expected = model(torch.tensor([ids])).logits[0, -1].float()
    group = PipelineGroup(
        config.model.config, num_stages=2, chunk_tokens=4, checkpoint=config.model.checkpoint, threads_per_stage=1
    )
    try:
        assert torch.allclose(group.prefill(ids), expected, atol=1e-4, rtol=0)
    finally:
        group.close()


def test_the_example_checkpoint_config_loads_once_its_path_is_edited(
    checkpoint: tuple[Path, Any, Any], tmp_path: Path
) -> None:
    """examples/configs/checkpoint.toml, its placeholder path replaced by a checkpoint, is a valid config."""
    from serving.machine import Machine

    example = TINY.with_name("checkpoint.toml").read_text()
    placeholder = next(line for line in example.splitlines() if line.startswith("path = "))
    edited = tmp_path / "checkpoint.toml"
    edited.write_text(example.replace(placeholder, f'path = "{checkpoint[0]}"'))
    config = load_config(edited, machine=Machine())
    assert config.model.checkpoint == str(checkpoint[0].resolve())
    assert config.model.served_name == "tiny-llama"
