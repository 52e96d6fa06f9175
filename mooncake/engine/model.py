"""The dummy model: a LLaMA-architecture decoder with seeded random weights.

The paper evaluates Mooncake with a dummy LLaMA model (its architecture, random
weights); so do the real engines. The forward pass is the real thing: token
embedding, then per layer RMSNorm → fused QKV projection → RoPE on q and k →
attention (grouped-query: `num_heads` query heads share `num_kv_heads` K/V
heads) → output projection and residual → RMSNorm → SwiGLU MLP and residual;
a final RMSNorm and the LM head.

Where the weights come from is the one difference between the dummy model and
a checkpoint: without a `WeightSource` each parameter is drawn from a seeded
generator, with one (`mooncake.engine.checkpoint`) each is read by its name in
`weight_names` (whole-model layer indices); both build the same modules and
run the same forward pass. A config's optional parts (q/k/v and output biases,
RoPE scaling, a head tied to the embedding) default to off, which is exactly
the random model as it always was.

The model does not own attention: `DecoderLayer.forward` hands the layer's new
q, k, v (after RoPE) to an `attend` callback and continues with what it
returns. The prefill engine's callback joins the cached prefix KV and stores the
new KV; the decode engine's writes the batch's KV into its slots. So one model
serves plain, prefix-reusing, chunked, pipelined and batched forward passes.

Invariants: the weights of layer `i` depend only on (seed, i, config, dtype,
device type) — or on the source's tensors of layer `i` — so a pipeline stage
that builds only its own layers holds exactly the weights of the whole model's
same layers, and reads no other layer's tensors.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import Protocol

import numpy as np
import torch
from torch import nn
from torch.nn import functional

from mooncake._checks import is_int, require_int, require_iterable, shown
from mooncake.engine.config import ModelConfig, check_dtype
from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.types import as_token_array

__all__ = [
    "Attend",
    "DecoderLayer",
    "LlamaModel",
    "WeightSource",
    "dtype_of",
    "inverse_frequencies",
    "rms_norm",
    "rope_tables",
    "token_ids",
    "weight_names",
]

# q [T, num_heads, head_dim], k and v [T, num_kv_heads, head_dim] → out [T, num_heads, head_dim]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # config.DTYPE_BYTES's names


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype called `name` ("float32", "bfloat16", "float16").

    Raises:
        ConfigError: any other name, or no string (`config.check_dtype`).
    """
    return _DTYPES[check_dtype(name)]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm, computed in float32 whatever the input's dtype (as LLaMA does)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def inverse_frequencies(config: ModelConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """RoPE's float32 inverse frequencies [head_dim / 2]: θ^(−2i/d), rescaled by `config.rope_scaling`.

    The llama3 rescaling is transformers' `_compute_llama3_parameters` step for step,
    on the plain frequencies computed as this model always has.
    """
    # transformers' expression, operation for operation: θ^(−2i/d) computed otherwise (θ ** (−i/half)) differs by
    # an ulp in some frequencies, which grows with the position (5e-3 in cos/sin at 128 k tokens).
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(dtype=torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(config: ModelConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, 1, head_dim] of `positions` [T] (rotate-half layout), computed in float32."""
    inv_freq = inverse_frequencies(config, positions.device)
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


class WeightSource(Protocol):
    """Where a model's weights come from instead of the seeded generator (a checkpoint)."""

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor called `name` (one of `weight_names`), of exactly `shape`, in any dtype, on the CPU.

        Raises:
            ConfigError: the source lacks it or holds another shape.
        """
        ...


def weight_names(config: ModelConfig, layers: Iterable[int] | None = None) -> list[str]:
    """The names a model holding `layers` (default: all) asks its `WeightSource` for, in build order.

    Layer names carry whole-model indices (`layers.{i}.qkv`); the embedding is
    held with layer 0, the final norm and head with the last layer. A tied head
    held beside the embedding is the same tensor and is not asked for twice.
    """
    indices = list(range(config.num_layers) if layers is None else layers)
    names: list[str] = []
    for i in indices:
        names += [f"layers.{i}.{weight}" for weight in config.layer_weights]
    has_embedding = bool(indices) and indices[0] == 0
    names += ["embedding"] if has_embedding else []
    if indices and indices[-1] == config.num_layers - 1:
        names += ["final_norm"]
        names += [] if config.tie_word_embeddings and has_embedding else ["head"]
    return names


def _loaded(
    source: WeightSource, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> nn.Parameter:
    tensor = source.get(name, shape)
    if tuple(tensor.shape) != shape:  # the source's contract, checked here once for every source
        raise ConfigError(f"weight {name} has shape {tuple(tensor.shape)}, the model needs {shape}")
    return nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False)


def _generator(seed: int, stream: int, device: torch.device | str) -> torch.Generator:
    kind = torch.device(device).type
    generator = torch.Generator(device=kind if kind == "cuda" else "cpu")
    generator.manual_seed((seed * 1_000_003 + stream) % (1 << 63))
    return generator


class DecoderLayer(nn.Module):
    """One transformer block; its attention is the caller's `attend`."""

    qkv_bias: nn.Parameter | None
    out_bias: nn.Parameter | None

    def __init__(
        self,
        config: ModelConfig,
        *,
        seed: int,
        index: int,
        dtype: torch.dtype,
        device: torch.device | str,
        weights: WeightSource | None = None,
    ) -> None:
        super().__init__()
        self.config, self.index = config, index
        h, i, qkv_rows = config.hidden_size, config.intermediate_size, config.hidden_size + 2 * config.kv_width
        if weights is not None:
            prefix = f"layers.{index}."
            self.attn_norm = _loaded(weights, prefix + "attn_norm", (h,), dtype, device)
            self.qkv = _loaded(weights, prefix + "qkv", (qkv_rows, h), dtype, device)
            self.qkv_bias = (
                _loaded(weights, prefix + "qkv_bias", (qkv_rows,), dtype, device) if config.qkv_bias else None
            )
            self.out = _loaded(weights, prefix + "out", (h, h), dtype, device)
            self.out_bias = _loaded(weights, prefix + "out_bias", (h,), dtype, device) if config.out_bias else None
            self.mlp_norm = _loaded(weights, prefix + "mlp_norm", (h,), dtype, device)
            self.gate_up = _loaded(weights, prefix + "gate_up", (2 * i, h), dtype, device)
            self.down = _loaded(weights, prefix + "down", (h, i), dtype, device)
            return
        g = _generator(seed, index + 1, device)
        # Random biases are zero: they draw nothing, so the matrices are those of a bias-free model.
        zeros = functools.partial(torch.zeros, dtype=dtype, device=device)
        self.attn_norm = nn.Parameter(torch.ones(h, dtype=dtype, device=device), requires_grad=False)
        self.qkv = _random((qkv_rows, h), h**-0.5, g, dtype, device)
        self.qkv_bias = nn.Parameter(zeros(qkv_rows), requires_grad=False) if config.qkv_bias else None
        self.out = _random((h, h), h**-0.5, g, dtype, device)
        self.out_bias = nn.Parameter(zeros(h), requires_grad=False) if config.out_bias else None
        self.mlp_norm = nn.Parameter(torch.ones(h, dtype=dtype, device=device), requires_grad=False)
        self.gate_up = _random((2 * i, h), h**-0.5, g, dtype, device)
        self.down = _random((h, i), i**-0.5, g, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        """x [T, hidden] at the positions of `cos`/`sin` → the layer's output [T, hidden]."""
        c = self.config
        t = x.shape[0]
        qkv = functional.linear(rms_norm(x, self.attn_norm, c.norm_eps), self.qkv, self.qkv_bias)
        q, k, v = qkv[:, : c.hidden_size], qkv[:, c.hidden_size : c.hidden_size + c.kv_width], qkv[:, -c.kv_width :]
        q = _rotate(q.view(t, c.num_heads, c.head_dim), cos, sin)
        k = _rotate(k.view(t, c.num_kv_heads, c.head_dim), cos, sin)
        attended = attend(q, k, v.reshape(t, c.num_kv_heads, c.head_dim))
        x = x + functional.linear(attended.reshape(t, c.hidden_size), self.out, self.out_bias)
        gate, up = functional.linear(rms_norm(x, self.mlp_norm, c.norm_eps), self.gate_up).chunk(2, dim=-1)
        return x + functional.linear(functional.silu(gate) * up, self.down)


class LlamaModel(nn.Module):
    """The model, or the contiguous slice `layers` of it (a pipeline stage).

    Args:
        config: its shape.
        seed: the weights' seed, an integer >= 0.
        dtype: "float32", "bfloat16" or "float16".
        device: where the weights live.
        layers: the layer indices this instance holds (default: all). The embedding
            is built when it holds layer 0, the final norm and LM head when it holds the last.
        weights: read the weights from here (`weight_names(config, layers)`, nothing else)
            instead of drawing them from `seed`.

    Raises:
        ConfigError: bad layers, seed or dtype; a weight the source lacks or holds in another shape.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        seed: int = 0,
        dtype: str = "float32",
        device: torch.device | str = "cpu",
        layers: Iterable[int] | None = None,
        weights: WeightSource | None = None,
    ) -> None:
        super().__init__()
        seed = require_int("seed", seed, minimum=0)  # torch's manual_seed would fail on 1.5 with a bare error
        self.config, self.dtype, self.device = config, dtype_of(dtype), torch.device(device)
        indices = list(range(config.num_layers) if layers is None else require_iterable("layers", layers))
        if (
            not indices
            or not all(is_int(i) for i in indices)  # else range() below fails with a bare TypeError
            or indices != list(range(indices[0], indices[0] + len(indices)))
            or not 0 <= indices[0] <= indices[-1] < config.num_layers
        ):
            raise ConfigError(
                f"layers must be a contiguous range within 0..{config.num_layers - 1}, got {shown(indices)}"
            )
        self.first_layer = indices[0]
        self.layers = nn.ModuleList(
            DecoderLayer(config, seed=seed, index=i, dtype=self.dtype, device=device, weights=weights) for i in indices
        )
        self.has_embedding = indices[0] == 0
        self.has_head = indices[-1] == config.num_layers - 1
        h, matrix = config.hidden_size, (config.vocab_size, config.hidden_size)
        if self.has_embedding:
            if weights is not None:
                self.embedding = _loaded(weights, "embedding", matrix, self.dtype, device)
            else:
                self.embedding = _random(matrix, 1.0, _generator(seed, 0, device), self.dtype, device)
        if self.has_head:
            if weights is not None:
                self.final_norm = _loaded(weights, "final_norm", (h,), self.dtype, device)
            else:
                self.final_norm = nn.Parameter(torch.ones(h, dtype=self.dtype, device=device), requires_grad=False)
            if config.tie_word_embeddings and self.has_embedding:
                self.head = self.embedding  # one tensor, as transformers ties them
            elif weights is not None:
                self.head = _loaded(weights, "head", matrix, self.dtype, device)
            elif config.tie_word_embeddings:  # a last stage without the embedding draws the embedding's values
                self.head = _random(matrix, 1.0, _generator(seed, 0, device), self.dtype, device)
            else:
                g = _generator(seed, config.num_layers + 1, device)
                self.head = _random(matrix, h**-0.5, g, self.dtype, device)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids [T] → hidden states [T, hidden].

        Raises:
            InvalidRequestError: an id outside [0, vocab_size) (a request's input, as `token_ids` refuses it).
        """
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size):
            raise InvalidRequestError(
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
        """The plain causal forward pass of a whole prompt: float32 logits [T, vocab] (the reference).

        Raises:
            InvalidRequestError: a token id outside the vocabulary (`embed`).
        """
        from mooncake.engine.attention import prefill_attention

        positions = torch.arange(tokens.shape[0], device=self.device)
        cos, sin = self.rope(positions)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, prefill_attention)
        return self.logits(x)


def token_ids(tokens: Iterable[int], vocab_size: int) -> torch.Tensor:
    """A prompt's token ids as the model's int64 input, checked as the hasher checks them (`types.as_token_array`:
    a 1-D integer sequence, no floats or bools truncated) and against the vocabulary. The prefill engine and the
    pipeline group take their prompts through this one check.

    Raises:
        InvalidRequestError: no tokens, not integers, or an id outside [0, vocab_size) (the first such id and its
            position named).
    """
    array = as_token_array(tokens)
    if not array.size:
        raise InvalidRequestError("a prompt needs at least one token")
    if int(array.min()) < 0 or int(array.max()) >= vocab_size:
        position = int(np.flatnonzero((array < 0) | (array >= vocab_size))[0])  # the error path only: a second pass
        raise InvalidRequestError(
            f"token ids must lie in [0, {vocab_size}), got {int(array[position])} at position {position}"
        )
    return torch.from_numpy(array.astype("int64"))
