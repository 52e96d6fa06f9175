"""Tests for `mooncake.engine.checkpoint` against transformers: the loaded model computes what transformers does.

Each checkpoint kind (LLaMA with GQA; Qwen2 with q/k/v biases and a tied
head; Llama 3 RoPE scaling with LLaMA's attention biases; a tied LLaMA;
Mistral) is a small random transformers model saved with `save_pretrained`,
in one file and sharded with an index. Required: prefill logits equal to
transformers' within 1e-4 in float32; the prefill engine (cached prefix,
chunks, layer-wise or not) and pipeline stages equal the plain forward pass;
64 greedy tokens through the continuous-batching decode engine, with joins
and leaves, equal `model.generate`'s; bfloat16 within the documented
tolerance. The loader's refusals (corrupt shards, missing tensors, other
architectures, unsupported keys) are tested in test_checkpoint_errors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("transformers")

import torch

from mooncake.cache.hashing import BlockHasher
from mooncake.cache.pool import DramPagePool
from mooncake.cache.tiered import TieredCache
from mooncake.engine.attention import prefill_attention
from mooncake.engine.checkpoint import SafetensorsWeights, load_model, read_model_config
from mooncake.engine.decode import DecodeConfig, DecodeEngine
from mooncake.engine.kv import KvLayout
from mooncake.engine.model import LlamaModel
from mooncake.engine.prefill import PrefillConfig, PrefillEngine
from mooncake.types import RequestId
from tests.engine.checkpoints import KINDS, VOCAB, hf_greedy, hf_logits, hf_model, save
from tests.engine.support import TOLERANCE

FP32_TOLERANCE = 1e-4  # max abs difference of float32 logits from transformers'
BF16_FRACTION = 0.03  # bfloat16: max abs difference at most 3 % of the largest fp32 logit (docs/engines.md)
PROMPT = [(7 * i + 3) % VOCAB for i in range(70)]  # past the llama3 kind's original 32 positions


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Every kind saved whole, plus the LLaMA kind sharded (the model and its directory by name)."""
    made = {}
    root = tmp_path_factory.mktemp("checkpoints")
    for kind in KINDS:
        model = hf_model(kind)
        made[kind] = (save(model, root / kind), model)
    made["sharded"] = (save(made["llama3"][1], root / "sharded", max_shard_size="40KB"), made["llama3"][1])
    return made


def test_the_sharded_save_is_sharded(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    """The sharded checkpoint really is several files with an index (so the sharded path is what is tested)."""
    directory = checkpoints["sharded"][0]
    assert len(list(directory.glob("*.safetensors"))) > 2
    assert (directory / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("kind", [*KINDS, "sharded"])
def test_prefill_logits_equal_transformers(checkpoints: dict[str, tuple[Path, Any]], kind: str) -> None:
    """Every position's float32 logits are transformers' within 1e-4."""
    directory, reference = checkpoints[kind]
    model = load_model(directory)
    with torch.inference_mode():
        ours = model(torch.tensor(PROMPT))
    theirs = hf_logits(reference, PROMPT)
    assert ours.shape == theirs.shape == (len(PROMPT), VOCAB)
    assert float((ours - theirs).abs().max()) <= FP32_TOLERANCE


def test_the_config_carries_what_the_relatives_differ_in(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    """Qwen2 has q/k/v biases and a tied head, LLaMA's attention_bias biases every projection, llama3 scales RoPE."""
    qwen2, llama3, tied = (read_model_config(checkpoints[k][0]) for k in ("qwen2", "llama3", "tied"))
    assert (qwen2.qkv_bias, qwen2.out_bias, qwen2.tie_word_embeddings) == (True, False, True)
    assert (llama3.qkv_bias, llama3.out_bias, llama3.tie_word_embeddings) == (True, True, False)
    assert llama3.rope_scaling is not None and llama3.rope_scaling.kind == "llama3"
    assert tied.tie_word_embeddings and not tied.qkv_bias
    assert read_model_config(checkpoints["llama"][0]).name == "llama"  # the directory names the model
    tied_model = load_model(checkpoints["tied"][0])
    assert tied_model.head is tied_model.embedding  # one tensor, as transformers ties them


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 500000.0},
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
    ids=["default-500k", "default-10k", "linear", "llama3"],
)
def test_rope_frequencies_are_transformers_bit_for_bit(rope: dict[str, Any]) -> None:
    """The inverse frequencies equal transformers' exactly, so the rotation stays exact at long positions
    (θ^(−i/half), one ulp off in a third of them, drifted to 5e-3 in cos/sin at 128 k tokens)."""
    import transformers

    from mooncake.engine.checkpoint import model_config_from_hf
    from mooncake.engine.model import inverse_frequencies, rope_tables

    fields = {
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
    }
    hf = transformers.LlamaConfig(**fields, rope_parameters=rope)
    ours = model_config_from_hf(
        {**fields, "architectures": ["LlamaForCausalLM"], "vocab_size": 16, "num_hidden_layers": 1,
         "intermediate_size": 16, "rope_parameters": rope},
        name="rope",
    )  # fmt: skip
    reference = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf)
    assert torch.equal(inverse_frequencies(ours), reference.inv_freq)
    positions = torch.tensor([0, 1000, 32000, 131000])
    cos, sin = rope_tables(ours, positions, torch.float32)
    expected_cos, expected_sin = reference(torch.zeros(1, 1, 128), positions[None])
    assert torch.equal(cos[:, 0], expected_cos[0]) and torch.equal(sin[:, 0], expected_sin[0])


@pytest.mark.parametrize("kind", ["qwen2", "sharded"])
def test_every_tensor_of_the_checkpoint_is_read_once(checkpoints: dict[str, tuple[Path, Any]], kind: str) -> None:
    """Loading the whole model reads each tensor transformers saved exactly once, and nothing else."""
    from safetensors import safe_open

    directory = checkpoints[kind][0]
    saved = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            saved |= set(handle.keys())
    config = read_model_config(directory)
    weights = SafetensorsWeights(directory, config)
    LlamaModel(config, weights=weights)
    assert sorted(weights.tensors_read) == sorted(saved) == sorted(weights.tensors_of())


def test_a_stage_reads_only_its_own_layers(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    """A pipeline stage reads exactly its layers' tensors (and the shards holding them); stages run back to back
    give the whole model's logits bit for bit."""
    directory = checkpoints["sharded"][0]
    config = read_model_config(directory)
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    stages = []
    for layers in (range(0, 1), range(1, 2)):
        weights = SafetensorsWeights(directory, config)
        stages.append(LlamaModel(config, weights=weights, layers=layers))
        assert set(weights.tensors_read) == weights.tensors_of(layers)
        assert all(f"layers.{1 - layers[0]}." not in name for name in weights.tensors_read)
        assert {path.name for path in weights._open} == {index[name] for name in weights.tensors_read}
    tokens = torch.tensor(PROMPT)
    with torch.inference_mode():
        cos, sin = stages[0].rope(torch.arange(len(PROMPT)))
        x = stages[0].embed(tokens)
        for stage in stages:
            for layer in stage.layers:
                x = layer(x, cos, sin, prefill_attention)
        assert torch.equal(stages[1].logits(x), load_model(directory)(tokens))


@pytest.mark.parametrize("kind", ["qwen2", "llama3"])
@pytest.mark.parametrize(("chunk", "layerwise"), [(4096, True), (5, True), (7, False)])
def test_the_prefill_engine_equals_the_plain_forward(
    checkpoints: dict[str, tuple[Path, Any]], kind: str, chunk: int, layerwise: bool
) -> None:
    """From scratch and again with the prompt's blocks cached, in chunks or not: the last logits of the plain pass."""
    model = load_model(checkpoints[kind][0])
    block = 8
    layout = KvLayout(config=model.config, block_tokens=block)
    cache = TieredCache([DramPagePool(layout.page_bytes, 32)])
    hasher = BlockHasher(model=model.config.name, block_size_tokens=block)
    with torch.inference_mode():
        plain = model(torch.tensor(PROMPT))
    with PrefillEngine(model, cache, hasher, PrefillConfig(chunk_tokens=chunk, layerwise=layerwise)) as prefill:
        first = prefill.prefill(PROMPT[:40])
        whole = prefill.prefill(PROMPT)  # its first 40 tokens' whole blocks come from the cache
    assert first.prefix_tokens == 0 and whole.prefix_tokens == 40
    assert torch.allclose(first.logits, plain[39], **TOLERANCE)
    assert torch.allclose(whole.logits, plain[-1], **TOLERANCE)


def decode_batch(
    model: LlamaModel, prompts: list[list[int]], budgets: list[int], joins_at: list[int]
) -> list[list[int]]:
    """Greedy tokens of each prompt through one continuous batch: request i joins before step `joins_at[i]` and
    leaves after `budgets[i]` tokens."""
    block = 8
    layout = KvLayout(config=model.config, block_tokens=block)
    cache = TieredCache([DramPagePool(layout.page_bytes, 128)])
    hasher = BlockHasher(model=model.config.name, block_size_tokens=block)
    got: list[list[int]] = [[] for _ in prompts]
    decode = DecodeEngine(model, cache, block_tokens=block, config=DecodeConfig(max_batch_size=len(prompts)))
    with PrefillEngine(model, cache, hasher) as prefill:
        step = 0
        while step == 0 or decode.num_active:
            for i in (i for i, when in enumerate(joins_at) if when == step):
                done = prefill.prefill(prompts[i])
                verdict = decode.try_join(
                    RequestId(f"r{i}"),
                    done.keys,
                    prompt_tokens=len(prompts[i]),
                    first_token=done.first_token,
                    max_new_tokens=budgets[i],
                    on_token=lambda event, out=got[i]: out.append(event.token),
                )
                assert verdict.accepted, verdict.reason
            decode.step()
            decode.check_invariants()
            step += 1
    return got


@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_greedy_generation_through_the_decode_engine_equals_generate(
    checkpoints: dict[str, tuple[Path, Any]], kind: str
) -> None:
    """Four prompts of different lengths decode in one continuous batch — two join at once, two later, two
    leave early — and each request's tokens are `model.generate`'s greedy tokens, all 64 for the full ones."""
    directory, reference = checkpoints[kind]
    prompts = [PROMPT[:13], PROMPT[5:50], PROMPT[20:23], PROMPT[1:31]]
    budgets = [64, 40, 64, 23]
    expected = [hf_greedy(reference, prompt, 64)[:budget] for prompt, budget in zip(prompts, budgets, strict=True)]
    assert decode_batch(load_model(directory), prompts, budgets, joins_at=[0, 0, 5, 17]) == expected


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama3"])
def test_bfloat16_is_within_the_documented_tolerance(checkpoints: dict[str, tuple[Path, Any]], kind: str) -> None:
    """A bfloat16 load's logits are within 3 % of the largest fp32 logit of transformers' fp32 ones, and no further
    off than twice transformers' own bfloat16 model."""
    directory, reference = checkpoints[kind]
    model = load_model(directory, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    with torch.inference_mode():
        ours = model(torch.tensor(PROMPT))
    exact = hf_logits(reference, PROMPT)
    theirs = hf_logits(hf_model(kind).to(torch.bfloat16), PROMPT)
    error = float((ours - exact).abs().max())
    assert error <= BF16_FRACTION * float(exact.abs().max())
    assert error <= 2 * float((theirs - exact).abs().max())
