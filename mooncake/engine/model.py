"""The dummy model: a LLaMA-architecture decoder with seeded random weights.

The paper evaluates Mooncake with a dummy LLaMA model (its architecture, random
weights); so do the real engines. The forward pass is the real thing: token
embedding, then per layer RMSNorm → fused QKV projection → RoPE on q and k →
attention (grouped-query: `num_heads` query heads share `num_kv_heads` K/V
heads) → output projection and residual → RMSNorm → SwiGLU MLP and residual;
a final RMSNorm and the LM head.

The model does not own attention: `DecoderLayer.forward` hands the layer's new
q, k, v (after RoPE) to an `attend` callback and continues with what it
returns. The prefill engine's callback joins the cached prefix KV and stores the
new KV; the decode engine's writes the batch's KV into its slots. So one model
serves plain, prefix-reusing, chunked, pipelined and batched forward passes.

Invariants: the weights of layer `i` depend only on (seed, i, config, dtype,
device type), so a pipeline stage that builds only its own layers holds exactly
the weights of the whole model's same layers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.nn import functional

from mooncake.engine.config import ModelConfig
from mooncake.errors import ConfigError

__all__ = ["Attend", "DecoderLayer", "LlamaModel", "dtype_of", "rms_norm", "rope_tables"]

# q [T, num_heads, head_dim], k and v [T, num_kv_heads, head_dim] → out [T, num_heads, head_dim]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # config.DTYPE_BYTES's names


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype called `name` ("float32", "bfloat16", "float16")."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}") from None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm, computed in float32 whatever the input's dtype (as LLaMA does)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rope_tables(config: ModelConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, 1, head_dim] of `positions` [T] (rotate-half layout), computed in float32."""
    half = config.head_dim // 2
    inv_freq = config.rope_theta ** (-torch.arange(half, dtype=torch.float32, device=positions.device) / half)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _random(
    shape: tuple[int, ...], std: float, generator: torch.Generator, dtype: torch.dtype, device: torch.device | str
) -> nn.Parameter:
    # Drawn in float32 on the generator's device so a dtype changes values only by rounding.
    values = torch.randn(shape, generator=generator, dtype=torch.float32, device=generator.device) * std
    return nn.Parameter(values.to(device=device, dtype=dtype), requires_grad=False)


def _generator(seed: int, stream: int, device: torch.device | str) -> torch.Generator:
    kind = torch.device(device).type
    generator = torch.Generator(device=kind if kind == "cuda" else "cpu")
    generator.manual_seed((seed * 1_000_003 + stream) % (1 << 63))
    return generator


class DecoderLayer(nn.Module):
    """One transformer block; its attention is the caller's `attend`."""

    def __init__(
        self, config: ModelConfig, *, seed: int, index: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.config, self.index = config, index
        g = _generator(seed, index + 1, device)
        h, i = config.hidden_size, config.intermediate_size
        self.attn_norm = nn.Parameter(torch.ones(h, dtype=dtype, device=device), requires_grad=False)
        self.qkv = _random((h + 2 * config.kv_width, h), h**-0.5, g, dtype, device)
        self.out = _random((h, h), h**-0.5, g, dtype, device)
        self.mlp_norm = nn.Parameter(torch.ones(h, dtype=dtype, device=device), requires_grad=False)
        self.gate_up = _random((2 * i, h), h**-0.5, g, dtype, device)
        self.down = _random((h, i), i**-0.5, g, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        """x [T, hidden] at the positions of `cos`/`sin` → the layer's output [T, hidden]."""
        c = self.config
        t = x.shape[0]
        qkv = functional.linear(rms_norm(x, self.attn_norm, c.norm_eps), self.qkv)
        q, k, v = qkv[:, : c.hidden_size], qkv[:, c.hidden_size : c.hidden_size + c.kv_width], qkv[:, -c.kv_width :]
        q = _rotate(q.view(t, c.num_heads, c.head_dim), cos, sin)
        k = _rotate(k.view(t, c.num_kv_heads, c.head_dim), cos, sin)
        attended = attend(q, k, v.reshape(t, c.num_kv_heads, c.head_dim))
        x = x + functional.linear(attended.reshape(t, c.hidden_size), self.out)
        gate, up = functional.linear(rms_norm(x, self.mlp_norm, c.norm_eps), self.gate_up).chunk(2, dim=-1)
        return x + functional.linear(functional.silu(gate) * up, self.down)


class LlamaModel(nn.Module):
    """The model, or the contiguous slice `layers` of it (a pipeline stage).

    Args:
        config: its shape.
        seed: the weights' seed.
        dtype: "float32", "bfloat16" or "float16".
        device: where the weights live.
        layers: the layer indices this instance holds (default: all). The embedding
            is built when it holds layer 0, the final norm and LM head when it holds the last.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        seed: int = 0,
        dtype: str = "float32",
        device: torch.device | str = "cpu",
        layers: Iterable[int] | None = None,
    ) -> None:
        super().__init__()
        self.config, self.dtype, self.device = config, dtype_of(dtype), torch.device(device)
        indices = list(range(config.num_layers) if layers is None else layers)
        if (
            not indices
            or indices != list(range(indices[0], indices[0] + len(indices)))
            or not 0 <= indices[0] <= indices[-1] < config.num_layers
        ):
            raise ConfigError(f"layers must be a contiguous range within 0..{config.num_layers - 1}, got {indices}")
        self.first_layer = indices[0]
        self.layers = nn.ModuleList(
            DecoderLayer(config, seed=seed, index=i, dtype=self.dtype, device=device) for i in indices
        )
        self.has_embedding = indices[0] == 0
        self.has_head = indices[-1] == config.num_layers - 1
        h = config.hidden_size
        if self.has_embedding:
            self.embedding = _random((config.vocab_size, h), 1.0, _generator(seed, 0, device), self.dtype, device)
        if self.has_head:
            g = _generator(seed, config.num_layers + 1, device)
            self.final_norm = nn.Parameter(torch.ones(h, dtype=self.dtype, device=device), requires_grad=False)
            self.head = _random((config.vocab_size, h), h**-0.5, g, self.dtype, device)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids [T] → hidden states [T, hidden]."""
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size):
            raise ConfigError(
                f"token ids must lie in [0, {self.config.vocab_size}), got {int(tokens.min())}..{int(tokens.max())}"
            )
        return functional.embedding(tokens.to(self.device), self.embedding)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for `positions` [T] in this model's dtype and device."""
        return rope_tables(self.config, positions.to(self.device), self.dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] → float32 logits [T, vocab]."""
        return functional.linear(rms_norm(x, self.final_norm, self.config.norm_eps), self.head).float()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The plain causal forward pass of a whole prompt: float32 logits [T, vocab] (the reference)."""
        from mooncake.engine.attention import prefill_attention

        positions = torch.arange(tokens.shape[0], device=self.device)
        cos, sin = self.rope(positions)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, prefill_attention)
        return self.logits(x)
