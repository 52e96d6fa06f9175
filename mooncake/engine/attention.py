"""Attention kernels: prefill over a cached prefix, and batched decode over ragged contexts.

Prefill: the T new queries sit at the end of S ≥ T keys (the first S − T are
the cached prefix and earlier chunks), so query i sees keys 0 … S − T + i
(causal, aligned bottom-right). Backends: flash-attn on CUDA where it imports
(its causal mask is bottom-right aligned), torch SDPA elsewhere (plain causal
when S = T, an explicit [T, S] mask otherwise).

Decode: one query per request against that request's context, contexts of
different lengths held in slots of a padded [B, kv_heads, L, head_dim] tensor
with a length per slot. `decode_attention` is a grouped matmul: the G = heads /
kv_heads query heads of a group are stacked into one [G, head_dim] matrix that
multiplies the group's keys once, so K and V are read once per group and never
expanded per head. (Older torch SDPA expanded them, ~10× slower for one token on
CPU; torch 2.13's `enable_gqa` path does not, and benchmarks/engine.py measures the
two within a few percent of each other here.) Positions at or beyond a slot's
length are masked out.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional

__all__ = [
    "decode_attention",
    "flash_attention_available",
    "prefill_attention",
    "prefill_attention_into",
    "sdpa_decode_attention",
]

_flash: Any = None


def flash_attention_available() -> bool:
    """Whether flash-attn imports here (it needs CUDA)."""
    global _flash
    if _flash is None:
        try:
            from flash_attn import flash_attn_func  # type: ignore[import-not-found,unused-ignore]

            _flash = flash_attn_func
        except ImportError:
            _flash = False
    return bool(_flash) and torch.cuda.is_available()


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of T queries at the end of S keys.

    Args:
        q: [T, heads, head_dim].
        k, v: [S, kv_heads, head_dim], S >= T; kv_heads divides heads.

    Returns:
        [T, heads, head_dim].
    """
    t, s = q.shape[0], k.shape[0]
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and flash_attention_available():
        return _flash(q[None], k[None], v[None], causal=True)[0]  # type: ignore[no-any-return]
    # [1, heads, T|S, head_dim]: with a batch dimension torch's CPU SDPA takes its flash kernel;
    # 3-D inputs fall back to the math path, 3-8x slower from 1 K tokens on (benchmarks/engine.py).
    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))
    if s == t:
        out = functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    else:
        rows = torch.arange(t, device=q.device)[:, None] + (s - t)
        mask = torch.arange(s, device=q.device)[None, :] <= rows
        out = functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


def prefill_attention_into(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, start: int, end: int
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """An `attend` for tokens [start, end): writes their K and V into rows [start, end)
    of the layer's buffers, then attends over rows [0, end) (the cached prefix and earlier chunks)."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_buffer[start:end] = k
        v_buffer[start:end] = v
        return prefill_attention(q, k_buffer[:end], v_buffer[:end])

    return attend


def _length_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[B, 1, 1, width]: True where a position lies beyond its slot's length."""
    return (torch.arange(width, device=lengths.device)[None, :] >= lengths[:, None])[:, None, None, :]


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """One query per slot against its first `lengths[b]` keys.

    Args:
        q: [B, heads, head_dim].
        k, v: [B, kv_heads, L, head_dim] (L >= max(lengths); only the first lengths[b] positions count).
        lengths: [B] integers >= 1.

    Returns:
        [B, heads, head_dim].
    """
    b, heads, dim = q.shape
    kv_heads, width = k.shape[1], k.shape[2]
    grouped = q.view(b, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(grouped, k.transpose(-1, -2)).float() * (1.0 / math.sqrt(dim))  # [B, kv, G, L]
    scores.masked_fill_(_length_mask(lengths, width), float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(weights, v).view(b, heads, dim)


def sdpa_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """`decode_attention` through torch SDPA (the benchmark's peer); same arguments and result."""
    b, heads, dim = q.shape
    mask = ~_length_mask(lengths, k.shape[2])
    out = functional.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask, enable_gqa=True)
    return out.view(b, heads, dim)
