"""Tests for `mooncake.engine.attention`: the prefill and decode kernels against brute force.

Properties over random shapes, grouped-query head ratios and prefix lengths:
prefill attention equals an einsum reference in float64 with the causal mask
aligned bottom-right; attending over a cached prefix gives the last rows of the
full causal attention; `decode_attention` equals `sdpa_decode_attention`, the
reference per slot and prefill's last row, and ignores whatever lies beyond a
slot's length.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("torch")

import torch

from mooncake.engine.attention import (
    decode_attention,
    flash_attention_available,
    prefill_attention,
    prefill_attention_into,
    sdpa_decode_attention,
)
from tests.engine.support import TOLERANCE


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """T queries at the end of S keys, query i seeing keys 0..S-T+i, in float64; query head h reads kv head h // G."""
    t, heads, dim = q.shape
    s, kv_heads, _ = k.shape
    group = heads // kv_heads
    k64 = k.double().repeat_interleave(group, dim=1)
    v64 = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q.double(), k64) / math.sqrt(dim)
    visible = torch.arange(s)[None, :] <= torch.arange(t)[:, None] + (s - t)
    weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hts,shd->thd", weights, v64)


@st.composite
def head_shapes(draw: st.DrawFn) -> tuple[int, int, int]:
    """(heads, kv_heads, head_dim) with kv_heads dividing heads: MHA, GQA and MQA."""
    kv_heads = draw(st.integers(min_value=1, max_value=3))
    return kv_heads * draw(st.integers(min_value=1, max_value=4)), kv_heads, draw(st.sampled_from([1, 2, 4, 8, 16]))


def randn(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator)


@st.composite
def prefill_cases(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, heads, d] and k, v [S, kv_heads, d] with S = prefix + T."""
    heads, kv_heads, dim = draw(head_shapes())
    t = draw(st.integers(min_value=1, max_value=12))
    s = t + draw(st.integers(min_value=0, max_value=12))
    g = torch.Generator().manual_seed(draw(st.integers(min_value=0, max_value=2**32)))
    return randn(g, t, heads, dim), randn(g, s, kv_heads, dim), randn(g, s, kv_heads, dim)


@st.composite
def decode_cases(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator]:
    """q [B, heads, d], k, v [B, kv_heads, L, d] padded beyond ragged lengths [B] >= 1."""
    heads, kv_heads, dim = draw(head_shapes())
    lengths = draw(st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=5))
    width = max(lengths) + draw(st.integers(min_value=0, max_value=3))
    g = torch.Generator().manual_seed(draw(st.integers(min_value=0, max_value=2**32)))
    b = len(lengths)
    q, k, v = randn(g, b, heads, dim), randn(g, b, kv_heads, width, dim), randn(g, b, kv_heads, width, dim)
    return q, k, v, torch.tensor(lengths), g


# --------------------------------------------------------------------------- properties


@given(prefill_cases())
def test_prefill_attention_equals_the_brute_force_reference(case: tuple[torch.Tensor, ...]) -> None:
    """SDPA with the bottom-right causal mask (or plain causal when S = T) is the einsum reference."""
    q, k, v = case
    out = prefill_attention(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.allclose(out.double(), reference_attention(q, k, v), **TOLERANCE)


def with_earlier_queries(q: torch.Tensor, s: int) -> torch.Tensor:
    """`q` [T, ...] preceded by S - T more random queries: the full prompt's queries."""
    earlier = randn(torch.Generator().manual_seed(s), s - q.shape[0], *q.shape[1:])
    return torch.cat([earlier, q])


@given(prefill_cases())
def test_attending_over_a_cached_prefix_gives_the_last_rows_of_full_attention(case: tuple[torch.Tensor, ...]) -> None:
    """The last T of S queries over all S keys are the last T rows of causal attention over S queries:
    what prefix reuse and chunked prefill rely on."""
    q, k, v = case
    full = prefill_attention(with_earlier_queries(q, k.shape[0]), k, v)
    assert torch.allclose(prefill_attention(q, k, v), full[-q.shape[0] :], **TOLERANCE)


@given(prefill_cases(), st.integers(min_value=1, max_value=5))
def test_attend_into_buffers_chunk_by_chunk_equals_one_pass(case: tuple[torch.Tensor, ...], chunk: int) -> None:
    """`prefill_attention_into` fills the KV buffers chunk by chunk and gives one pass's attention."""
    q, k, v = case
    s = k.shape[0]
    q_all = with_earlier_queries(q, s)
    k_buffer, v_buffer = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    rows = []
    for lo in range(0, s, chunk):
        hi = min(s, lo + chunk)
        rows.append(prefill_attention_into(k_buffer, v_buffer, lo, hi)(q_all[lo:hi], k[lo:hi], v[lo:hi]))
    assert torch.equal(k_buffer, k) and torch.equal(v_buffer, v)
    assert torch.allclose(torch.cat(rows), prefill_attention(q_all, k, v), **TOLERANCE)


@given(decode_cases())
def test_decode_attention_equals_sdpa_and_the_per_slot_reference(case: tuple[torch.Tensor, ...]) -> None:
    """The grouped matmul equals SDPA with a length mask and, slot by slot, the reference over that slot's keys."""
    q, k, v, lengths, _g = case
    out = decode_attention(q, k, v, lengths)
    assert out.shape == q.shape
    assert torch.allclose(out, sdpa_decode_attention(q, k, v, lengths), **TOLERANCE)
    for b, length in enumerate(lengths.tolist()):
        keys, values = k[b, :, :length].transpose(0, 1), v[b, :, :length].transpose(0, 1)
        assert torch.allclose(out[b].double(), reference_attention(q[b : b + 1], keys, values)[0], **TOLERANCE)
        # One decode query is prefill's last row over the same keys.
        assert torch.allclose(out[b], prefill_attention(q[b : b + 1], keys, values)[0], **TOLERANCE)


@given(decode_cases())
def test_decode_attention_ignores_positions_beyond_each_length(case: tuple[torch.Tensor, ...]) -> None:
    """Whatever a slot holds at or beyond its length (a retired request's leftovers) changes nothing, bit for bit."""
    q, k, v, lengths, g = case
    beyond = torch.arange(k.shape[2])[None, None, :, None] >= lengths[:, None, None, None]
    k2 = torch.where(beyond, 1e3 * randn(g, *k.shape), k)
    v2 = torch.where(beyond, 1e3 * randn(g, *v.shape), v)
    assert torch.equal(decode_attention(q, k2, v2, lengths), decode_attention(q, k, v, lengths))


# --------------------------------------------------------------------------- examples


def test_first_query_sees_only_the_first_key() -> None:
    """Without a prefix, query 0 attends to key 0 alone: its output is value 0 (per kv group)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = randn(g, 3, 4, 8), randn(g, 3, 2, 8), randn(g, 3, 2, 8)
    out = prefill_attention(q, k, v)
    assert torch.allclose(out[0], v[0].repeat_interleave(2, dim=0), **TOLERANCE)


def test_flash_attention_needs_cuda() -> None:
    """flash-attn is never chosen without CUDA; CPU fp32 always goes through SDPA."""
    if not torch.cuda.is_available():
        assert not flash_attention_available()
