"""A model's shape and the presets, without torch: what the cost models and a gateway need.

`ModelConfig` is the shape of a LLaMA-architecture decoder (the real engines
build `mooncake.engine.model.LlamaModel` from it); `shape(dtype)` gives the
`mooncake.sched.cost.ModelShape` the cost models take, so a process that only
schedules never imports torch. `PRESETS` are the shapes the project ships:
tiny (tests), small (CPU demos), llama3-8b and llama3-70b (GPU shapes).

Invariants: `num_heads` divides `hidden_size`, `num_kv_heads` divides
`num_heads`, and the head dimension is even (RoPE rotates pairs).
"""

from __future__ import annotations

import attrs

from mooncake._checks import int_at_least
from mooncake.errors import ConfigError
from mooncake.sched.cost import ModelShape

__all__ = ["DTYPE_BYTES", "ModelConfig", "PRESETS"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # the dtypes the engines run in, by name


@attrs.frozen(kw_only=True)
class ModelConfig:
    """The shape of a LLaMA-architecture model.

    Attributes:
        name: the preset's name (part of the block-key namespace).
        vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size: the shape;
            `num_heads` must divide `hidden_size` and be a multiple of `num_kv_heads`.
        rope_theta: RoPE base.
        norm_eps: RMSNorm epsilon.
    """

    name: str
    vocab_size: int = attrs.field(validator=int_at_least(1))
    hidden_size: int = attrs.field(validator=int_at_least(1))
    num_layers: int = attrs.field(validator=int_at_least(1))
    num_heads: int = attrs.field(validator=int_at_least(1))
    num_kv_heads: int = attrs.field(validator=int_at_least(1))
    intermediate_size: int = attrs.field(validator=int_at_least(1))
    rope_theta: float = 500_000.0
    norm_eps: float = 1e-5

    def __attrs_post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"num_heads={self.num_heads} must divide hidden_size={self.hidden_size}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ConfigError(f"head_dim={self.hidden_size // self.num_heads} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_width(self) -> int:
        """Elements of K (or V) per token per layer."""
        return self.num_kv_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        per_layer = (
            2 * self.hidden_size  # the two norms
            + self.hidden_size * (self.hidden_size + 2 * self.kv_width)  # qkv
            + self.hidden_size * self.hidden_size  # o
            + 3 * self.hidden_size * self.intermediate_size  # gate, up, down
        )
        return self.num_layers * per_layer + 2 * self.vocab_size * self.hidden_size + self.hidden_size

    def shape(self, dtype: str = "bfloat16") -> ModelShape:
        """The cost models' view of this model with its weights and KV in `dtype`.

        Raises:
            ConfigError: an unknown dtype name.
        """
        if dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
        return ModelShape(
            name=self.name,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            gqa=self.num_heads // self.num_kv_heads,
            bytes_per_element=DTYPE_BYTES[dtype],
            num_params=float(self.num_parameters),
        )

    def flops_per_token(self, context_tokens: int = 0) -> float:
        """Forward FLOPs of one token: 2 per weight of the layers and LM head, plus attention over `context_tokens`."""
        weights = self.num_parameters - self.vocab_size * self.hidden_size  # the embedding is a lookup
        attention = 4 * self.num_layers * self.hidden_size * context_tokens  # q·k and p·v
        return 2.0 * weights + attention


PRESETS: dict[str, ModelConfig] = {
    config.name: config
    for config in (
        # Tests: a forward pass in microseconds; 256 tokens so bytes are tokens.
        ModelConfig(
            name="tiny",
            vocab_size=256,
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=128,
        ),
        # CPU demos: ~150 M parameters.
        ModelConfig(
            name="small",
            vocab_size=32_000,
            hidden_size=768,
            num_layers=16,
            num_heads=12,
            num_kv_heads=4,
            intermediate_size=2_048,
        ),
        # GPU shapes of LLaMA3-8B and LLaMA3-70B.
        ModelConfig(
            name="llama3-8b",
            vocab_size=128_256,
            hidden_size=4_096,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            intermediate_size=14_336,
        ),
        ModelConfig(
            name="llama3-70b",
            vocab_size=128_256,
            hidden_size=8_192,
            num_layers=80,
            num_heads=64,
            num_kv_heads=8,
            intermediate_size=28_672,
        ),
    )
}
