"""Tests for `mooncake.engine.model`: the LLaMA-architecture dummy model.

Properties: a pipeline stage built for layers [a, b) holds exactly the whole
model's weights of those layers, and stages run back to back give the whole
model's forward pass; the forward pass is causal; parameter counts match the
built modules; weights are a function of the seed and differ across seeds,
layers and dtypes only as documented. Examples pin the model's own checks
(stage layers, dtypes, token ids), RMSNorm and the RoPE tables; the config's
validation is tested in test_config.
"""

from __future__ import annotations

import itertools
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

import torch

from mooncake.engine.attention import prefill_attention
from mooncake.engine.config import DTYPE_BYTES, ModelConfig
from mooncake.engine.model import LlamaModel, dtype_of, rms_norm, rope_tables, token_ids
from mooncake.errors import ConfigError, InvalidRequestError
from tests.engine.strategies import model_configs
from tests.engine.support import TINY, TOLERANCE, prompts, reference_logits, tiny_model

MODEL_SETTINGS = settings(max_examples=25, deadline=None)  # each example builds one or two models


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


@st.composite
def stage_splits(draw: st.DrawFn) -> tuple[ModelConfig, int, int, int]:
    """A config, a seed and a contiguous layer range [start, stop) of it."""
    config = draw(model_configs())
    start = draw(st.integers(min_value=0, max_value=config.num_layers - 1))
    stop = draw(st.integers(min_value=start + 1, max_value=config.num_layers))
    return config, draw(st.integers(min_value=0, max_value=2**32)), start, stop


# --------------------------------------------------------------------------- properties


@MODEL_SETTINGS
@given(stage_splits())
def test_a_stage_holds_the_whole_models_weights_of_its_layers(split: tuple[ModelConfig, int, int, int]) -> None:
    """Layer i of a stage equals layer i of the whole model; the embedding and head go with the end layers."""
    config, seed, start, stop = split
    whole = LlamaModel(config, seed=seed)
    stage = LlamaModel(config, seed=seed, layers=range(start, stop))
    assert stage.first_layer == start and len(stage.layers) == stop - start
    for offset, layer in enumerate(stage.layers):
        mine, theirs = parameters(layer), parameters(whole.layers[start + offset])
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[name], theirs[name]) for name in mine)
    assert stage.has_embedding == (start == 0) and stage.has_head == (stop == config.num_layers)
    if stage.has_embedding:
        assert torch.equal(stage.embedding, whole.embedding)
    if stage.has_head:
        assert torch.equal(stage.head, whole.head) and torch.equal(stage.final_norm, whole.final_norm)


@MODEL_SETTINGS
@given(stage_splits(), st.lists(st.integers(min_value=0, max_value=10**6), min_size=1, max_size=12))
def test_stages_run_back_to_back_give_the_whole_forward_pass(
    split: tuple[ModelConfig, int, int, int], raw_tokens: list[int]
) -> None:
    """Embedding, then the stages [0, a), [a, b), [b, L) in turn, then the head: bit-identical logits."""
    config, seed, a, b = split
    tokens = torch.tensor([t % config.vocab_size for t in raw_tokens])
    whole = LlamaModel(config, seed=seed)
    bounds = sorted({0, a, b, config.num_layers})
    stages = [LlamaModel(config, seed=seed, layers=range(lo, hi)) for lo, hi in itertools.pairwise(bounds)]
    with torch.inference_mode():
        x = stages[0].embed(tokens)
        cos, sin = stages[0].rope(torch.arange(tokens.shape[0]))
        for stage in stages:
            for layer in stage.layers:
                x = layer(x, cos, sin, prefill_attention)
        assert torch.equal(stages[-1].logits(x), whole(tokens))


@settings(max_examples=30, deadline=None)
@given(prompts, st.integers(min_value=1, max_value=24))
def test_the_forward_pass_is_causal(tokens: list[int], cut: int) -> None:
    """Logits at position i depend only on tokens 0..i: a prompt's prefix gives the prefix of its logits."""
    cut = min(cut, len(tokens))
    full = reference_logits(tokens)
    assert full.shape == (len(tokens), TINY.vocab_size) and full.dtype == torch.float32
    assert torch.allclose(reference_logits(tokens[:cut]), full[:cut], **TOLERANCE)


@MODEL_SETTINGS
@given(model_configs())
def test_num_parameters_counts_the_built_weights(config: ModelConfig) -> None:
    """`num_parameters` equals the parameters of the whole model as built; FLOPs follow from it."""
    model = LlamaModel(config)
    assert config.num_parameters == sum(p.numel() for p in model.parameters())
    assert not any(p.requires_grad for p in model.parameters())
    dense = 2.0 * (config.num_parameters - config.vocab_size * config.hidden_size)
    assert config.flops_per_token() == dense
    assert config.flops_per_token(10) == dense + 40 * config.num_layers * config.hidden_size


# --------------------------------------------------------------------------- examples


def test_weights_are_a_function_of_the_seed() -> None:
    """Same seed, same weights; another seed, or another layer, different ones."""
    again, other = LlamaModel(TINY, seed=0), LlamaModel(TINY, seed=1)
    model = tiny_model()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters(), strict=True))
    assert not torch.equal(model.layers[0].qkv, other.layers[0].qkv)
    assert not torch.equal(model.layers[0].qkv, model.layers[1].qkv)
    assert not torch.equal(model.embedding, other.embedding)


def test_a_lower_precision_model_holds_the_rounded_fp32_weights() -> None:
    """A bfloat16 model's weights are the fp32 model's rounded: a dtype changes values only by rounding."""
    half = LlamaModel(TINY, seed=0, dtype="bfloat16")
    for (name, p), q in zip(tiny_model().named_parameters(), half.parameters(), strict=True):
        assert q.dtype == torch.bfloat16
        assert torch.equal(p.to(torch.bfloat16), q), name
    assert half(torch.tensor([1, 2, 3])).dtype == torch.float32  # logits are float32 whatever the weights


@pytest.mark.parametrize("layers", [[], [1, 0], [0, 2], [1, 2], [-1, 0]])
def test_a_stage_needs_a_contiguous_range_of_existing_layers(layers: list[int]) -> None:
    """Empty, unordered, gapped or out-of-range layer lists are refused."""
    with pytest.raises(ConfigError, match="contiguous"):
        LlamaModel(TINY, layers=layers)


def test_dtypes_and_vocabulary_are_checked() -> None:
    """Unknown dtypes are ConfigErrors; token ids outside the vocabulary, a request's input, are
    InvalidRequestErrors (as `token_ids` says) from `embed` and the forward pass alike, not index errors."""
    assert dtype_of("float16") == torch.float16
    with pytest.raises(ConfigError, match="dtype"):
        dtype_of("int8")
    with pytest.raises(ConfigError, match="dtype"):
        LlamaModel(TINY, dtype="float64")
    for unhashable in ([], {}, ["float32"]):  # once a bare TypeError from the dict lookup
        with pytest.raises(ConfigError, match=re.escape(f"dtype must be one of {sorted(DTYPE_BYTES)}")):
            dtype_of(unhashable)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="dtype"):
            LlamaModel(TINY, dtype=unhashable)  # type: ignore[arg-type]
    for bad in ([0, TINY.vocab_size], [-1]):
        with pytest.raises(InvalidRequestError, match=r"token ids must lie in \[0, 256\)") as raised:
            tiny_model().embed(torch.tensor(bad))
        assert not isinstance(raised.value, ConfigError)
        with pytest.raises(InvalidRequestError, match="token ids"):
            tiny_model()(torch.tensor(bad))


def test_the_seed_is_an_integer_at_least_0() -> None:
    """A seed that is no integer >= 0 (1.5, -1, True) is a ConfigError naming it, where torch's `manual_seed` would
    raise a bare RuntimeError (or take -1 as a seed); a numpy integer is its value."""
    for seed in (1.5, -1, True):
        with pytest.raises(ConfigError, match="seed"):
            LlamaModel(TINY, seed=seed)  # type: ignore[arg-type]
    assert torch.equal(LlamaModel(TINY, seed=np.int64(3)).embedding, LlamaModel(TINY, seed=3).embedding)


@given(
    st.lists(st.integers(min_value=-(2**31), max_value=2**31 - 1), min_size=1, max_size=12),
    st.integers(min_value=1, max_value=64),
    st.booleans(),
)
def test_a_prompts_token_ids_are_checked_and_the_first_bad_one_named(
    tokens: list[int], vocab: int, as_int32: bool
) -> None:
    """`token_ids` of ids all in [0, vocab) is them as int64; else an InvalidRequestError naming the first id
    outside and its position (an int32 array included, which `as_token_array` passes on unread). The message named
    only the range before, leaving a long prompt's bad id to be searched for."""
    given_tokens = np.array(tokens, dtype=np.int32) if as_int32 else tokens
    bad = [i for i, token in enumerate(tokens) if not 0 <= token < vocab]
    if not bad:
        assert token_ids(given_tokens, vocab).tolist() == tokens
        return
    negative_list = not as_int32 and any(token < 0 for token in tokens)  # refused by `as_token_array` first
    with pytest.raises(InvalidRequestError) as raised:
        token_ids(given_tokens, vocab)
    if not negative_list:
        assert str(raised.value) == f"token ids must lie in [0, {vocab}), got {tokens[bad[0]]} at position {bad[0]}"


def test_rms_norm_matches_its_formula() -> None:
    """x / sqrt(mean(x^2) + eps) * weight, in float32 for a lower-precision input."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(5, 16, generator=generator)
    weight = torch.randn(16, generator=generator)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight
    assert torch.allclose(rms_norm(x, weight, 1e-5), expected, **TOLERANCE)
    low = rms_norm(x.to(torch.bfloat16), weight.to(torch.bfloat16), 1e-5)
    assert low.dtype == torch.bfloat16
    assert torch.allclose(low.float(), expected, rtol=0.05, atol=0.05)


def test_rope_tables_rotate_half_layout() -> None:
    """Position 0 is the identity; cos^2 + sin^2 = 1; both halves share frequencies; the slowest angle is base^(-1+2/d)."""
    positions = torch.arange(7)
    cos, sin = rope_tables(TINY, positions, torch.float32)
    half = TINY.head_dim // 2
    assert cos.shape == sin.shape == (7, 1, TINY.head_dim)
    assert torch.equal(cos[0], torch.ones_like(cos[0])) and torch.equal(sin[0], torch.zeros_like(sin[0]))
    assert torch.allclose(cos**2 + sin**2, torch.ones_like(cos), **TOLERANCE)
    assert torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(sin[..., :half], sin[..., half:])
    assert sin[1, 0, 0].item() == pytest.approx(math.sin(1.0))
    slowest = TINY.rope_theta ** (-(half - 1) / half)
    assert sin[6, 0, half - 1].item() == pytest.approx(math.sin(6 * slowest), rel=1e-4)
