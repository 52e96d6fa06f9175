"""Hypothesis strategies of the engine tests that need no torch (test_config runs without it)."""

from __future__ import annotations

from hypothesis import strategies as st

from mooncake.engine.config import ModelConfig


@st.composite
def model_configs(draw: st.DrawFn) -> ModelConfig:
    """Small valid shapes, grouped-query attention included."""
    num_kv_heads = draw(st.integers(min_value=1, max_value=3))
    num_heads = num_kv_heads * draw(st.integers(min_value=1, max_value=3))
    head_dim = draw(st.sampled_from([2, 4, 8]))
    return ModelConfig(
        name="drawn",
        vocab_size=draw(st.integers(min_value=1, max_value=40)),
        hidden_size=num_heads * head_dim,
        num_layers=draw(st.integers(min_value=1, max_value=4)),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=draw(st.integers(min_value=1, max_value=24)),
    )
