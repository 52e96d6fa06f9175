"""Tests for the context bound of a checkpoint whose sliding window was accepted as never sliding.

A Mistral (or Qwen2 with `use_sliding_window`) checkpoint whose `sliding_window`
is no shorter than its `max_position_embeddings` loads, and the model computes
full attention: transformers' within the positions, not past them (there
transformers slides the window). So the loaded model carries the bound
(`ModelConfig.max_context_tokens`) and every engine holds a context to it: the
prefill engine (whole, batched, chunked) and a pipeline group refuse a longer
prompt, a decode engine refuses a longer slot, and the decode rule refuses a
request whose prompt + output would pass it. Transformers is the reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("transformers")

import torch
import transformers

from mooncake.cache.hashing import BlockHasher
from mooncake.cache.pool import DramPagePool
from mooncake.cache.tiered import TieredCache
from mooncake.engine.checkpoint import load_model, read_model_config
from mooncake.engine.decode import DecodeConfig, DecodeEngine
from mooncake.engine.kv import KvLayout
from mooncake.engine.model import LlamaModel
from mooncake.engine.pipeline import PipelineGroup
from mooncake.engine.prefill import PrefillConfig, PrefillEngine
from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.sched.outcome import Reason
from mooncake.types import RequestId
from tests.engine.checkpoints import SHAPE, VOCAB, hf_greedy, hf_logits, save

POSITIONS = 64  # max_position_embeddings = sliding_window: the window never slides within the positions
BLOCK = 8
FP32_TOLERANCE = 1e-4
PROMPT = [(7 * i + 3) % VOCAB for i in range(POSITIONS + 1)]
# transformers' classes with a window as long as the positions (Qwen2's applies from layer max_window_layers on).
WINDOWED = {
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {}),
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        {"use_sliding_window": True, "max_window_layers": 0},
    ),
}


def windowed_model(kind: str) -> Any:
    """A random transformers model of `kind` whose sliding window equals its positions, weights at a trained scale."""
    config_class, model_class, extra = WINDOWED[kind]
    shape = {**SHAPE, "max_position_embeddings": POSITIONS}
    config = config_class(**shape, sliding_window=POSITIONS, **extra)
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(1 + 0.2 * torch.randn_like(parameter))
            elif name.endswith("bias") or "embed_tokens" in name:
                parameter.copy_(0.1 * torch.randn_like(parameter))
            else:
                parameter.copy_(torch.randn_like(parameter) / parameter.shape[1] ** 0.5)
    return model


@pytest.fixture(scope="module", params=sorted(WINDOWED))
def windowed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """The checkpoint directory of a model whose window equals its positions, and transformers' model."""
    model = windowed_model(request.param)
    return save(model, tmp_path_factory.mktemp(request.param) / request.param), model


def cache_for(model: LlamaModel, pages: int = 32) -> TieredCache:
    return TieredCache([DramPagePool(KvLayout(config=model.config, block_tokens=BLOCK).page_bytes, pages)])


def test_the_loaded_model_carries_the_positions_as_its_bound(windowed: tuple[Path, Any]) -> None:
    """The window is accepted, and the context it relies on (the positions) is the model's max_context_tokens."""
    assert read_model_config(windowed[0]).max_context_tokens == POSITIONS


@pytest.mark.parametrize(("chunk", "layerwise"), [(4096, True), (16, True), (16, False)])
def test_a_prompt_within_the_bound_is_transformers_and_one_past_it_is_refused(
    windowed: tuple[Path, Any], chunk: int, layerwise: bool
) -> None:
    """64 tokens (whole or chunked) give transformers' logits within 1e-4; 65 — alone or in a batch with a short
    prompt — are an InvalidRequestError naming the limit and where it comes from, and nothing is held or stored."""
    directory, reference = windowed
    model = load_model(directory)
    cache = cache_for(model)
    hasher = BlockHasher(model=model.config.name, block_size_tokens=BLOCK)
    with PrefillEngine(model, cache, hasher, PrefillConfig(chunk_tokens=chunk, layerwise=layerwise)) as prefill:
        within = prefill.prefill(PROMPT[:POSITIONS])
        assert float((within.logits - hf_logits(reference, PROMPT[:POSITIONS])[-1]).abs().max()) <= FP32_TOLERANCE
        stored = len(cache)
        for refused in ([PROMPT], [PROMPT[:3], PROMPT]):
            with pytest.raises(InvalidRequestError) as error:
                prefill.prefill_batch(refused)
            message = str(error.value)
            assert "65 tokens" in message and "max_context_tokens=64" in message
            assert "max_position_embeddings" in message
        assert len(cache) == stored  # nothing of a refused batch was stored


@pytest.mark.serial  # a stage process
def test_a_pipeline_group_refuses_a_prompt_past_the_bound(windowed: tuple[Path, Any]) -> None:
    """A pipelined prefill over the checkpoint: 64 tokens give transformers' logits, 65 are refused before any
    stage hears of them (the group stays usable)."""
    directory, reference = windowed
    config = read_model_config(directory)
    with PipelineGroup(
        config, num_stages=2, chunk_tokens=16, checkpoint=str(directory), threads_per_stage=1, timeout_s=60.0
    ) as group:
        with pytest.raises(InvalidRequestError, match="max_context_tokens=64"):
            group.prefill(PROMPT)
        logits = group.prefill(PROMPT[:POSITIONS])
        assert group.failure is None
    assert float((logits - hf_logits(reference, PROMPT[:POSITIONS])[-1]).abs().max()) <= FP32_TOLERANCE


def test_a_decode_slot_past_the_bound_is_refused(windowed: tuple[Path, Any]) -> None:
    """A DecodeConfig whose max_context_tokens exceeds the model's bound is a ConfigError naming both; one at the
    bound is taken, and with no config the slot is the bound (the default 2048 would pass it)."""
    model = load_model(windowed[0])
    cache = cache_for(model)
    with pytest.raises(ConfigError) as error:
        DecodeEngine(model, cache, block_tokens=BLOCK, config=DecodeConfig(max_context_tokens=POSITIONS + 1))
    assert "max_context_tokens=65" in str(error.value) and "max_context_tokens=64" in str(error.value)
    at_bound = DecodeEngine(model, cache, block_tokens=BLOCK, config=DecodeConfig(max_context_tokens=POSITIONS))
    assert at_bound.limits.max_context_tokens == POSITIONS
    assert DecodeEngine(model, cache, block_tokens=BLOCK).limits.max_context_tokens == POSITIONS


def test_the_decode_rule_holds_a_request_to_the_bound(windowed: tuple[Path, Any]) -> None:
    """Joining a 60-token prompt: 5 output tokens (65 in all) is refused as a context too long, by the decode rule;
    4 (64) are taken and are transformers' greedy tokens."""
    directory, reference = windowed
    model = load_model(directory)
    cache = cache_for(model)
    hasher = BlockHasher(model=model.config.name, block_size_tokens=BLOCK)
    prompt = PROMPT[:60]
    decode = DecodeEngine(model, cache, block_tokens=BLOCK)
    with PrefillEngine(model, cache, hasher) as prefill:
        done = prefill.prefill(prompt)
    common = {"prompt_tokens": len(prompt), "first_token": done.first_token}
    refused = decode.try_join(RequestId("long"), done.keys, max_new_tokens=5, **common)
    assert not refused.accepted and refused.reason is Reason.CONTEXT_TOO_LONG
    got: list[int] = []
    taken = decode.try_join(
        RequestId("fits"), done.keys, max_new_tokens=4, on_token=lambda e: got.append(e.token), **common
    )
    assert taken.accepted
    while decode.num_active:
        decode.step()
        decode.check_invariants()
    assert got == hf_greedy(reference, prompt, 4)
