"""A model's shape and the presets, without torch: what the cost models and a gateway need.

`ModelConfig` is the shape of a LLaMA-architecture decoder (the real engines
build `mooncake.engine.model.LlamaModel` from it); `shape(dtype)` gives the
`mooncake.sched.cost.ModelShape` the cost models take, so a process that only
schedules never imports torch. `PRESETS` are the shapes the project ships:
tiny (tests), small (CPU demos), llama3-8b and llama3-70b (GPU shapes).

The relatives of LLaMA that a checkpoint may hold differ from it only in
what the config says: biases on the q/k/v projections (Qwen2) or on every
attention projection (LLaMA's `attention_bias`), a RoPE frequency scaling
(`RopeScaling`: Llama 3's and linear), and an LM head tied to the token
embedding. Their defaults are LLaMA's, which is the random model's shape.
A checkpoint also bounds the context (`max_context_tokens`), as vLLM derives
`max_model_len`: its `max_position_embeddings` (times a linear RoPE factor).
Mistral's and Qwen2's sliding window is computed as full attention, which is
exact only while the window never slides, so a window is accepted only when it
is no shorter than `max_position_embeddings`, which then bounds every context;
the engines refuse longer prompts and decode slots (`check_context_tokens`).

The engines' shared argument checks live here too, so that an argument reads
and fails alike in each engine that takes it: `check_instance` (a config, a
cache, a request's `SamplingParams`), `check_callback` (a flag, a callback)
and the `switch` validator. A request's argument fails with
InvalidRequestError, an engine's option with ConfigError, each naming the
argument and the value (a dict for a config, say, is else a bare
AttributeError at its first use, mid-prefill).

Invariants: `num_heads` divides `hidden_size`, `num_kv_heads` divides
`num_heads`, and the head dimension is even (RoPE rotates pairs); every size
(vocabulary, hidden, layers, heads, MLP) is below `SIZE_LIMIT`, so the
parameter count (`num_parameters`) is an int a float holds.
"""

from __future__ import annotations

from typing import Any

import attrs

from mooncake._checks import int_at_least, non_negative, positive, require_bool, shown
from mooncake.errors import ConfigError, InvalidRequestError, MooncakeError
from mooncake.sched.cost import ModelShape

__all__ = [
    "DTYPE_BYTES",
    "ModelConfig",
    "PRESETS",
    "ROPE_SCALING_KINDS",
    "RopeScaling",
    "SIZE_LIMIT",
    "check_callback",
    "check_dtype",
    "check_instance",
    "switch",
]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # the dtypes the engines run in, by name
ROPE_SCALING_KINDS = ("linear", "llama3")  # the RoPE scalings the model implements (transformers' rope_type)
SIZE_LIMIT = 2**31
"""Every size of a `ModelConfig` is below this: a tensor dimension past int32 is past what the kernels index (and
no model has one); without a bound, 4 * 2**1100 passed and `shape()` failed converting the parameter count to a
float."""


def check_dtype(name: object) -> str:
    """`name` as the name of a dtype the engines run in (a key of `DTYPE_BYTES`): the one rule of `ModelConfig.shape`,
    `model.dtype_of` and `KvLayout`.

    Raises:
        ConfigError: anything else (a list, which no dict lookup may take, or another dtype's name), naming it.
    """
    if not isinstance(name, str) or name not in DTYPE_BYTES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {shown(name)}")
    return name


@attrs.frozen(kw_only=True)
class RopeScaling:
    """A rescaling of RoPE's inverse frequencies, as transformers' `rope_type` of that name computes it.

    `linear` divides every frequency by `factor`. `llama3` (Llama 3.1) divides the
    low frequencies (wavelength above `original_max_position_embeddings / low_freq_factor`)
    by `factor`, keeps the high ones (wavelength below `original / high_freq_factor`) and
    interpolates smoothly between. Neither changes the attention's scale.

    Attributes:
        kind: one of `ROPE_SCALING_KINDS`.
        factor: the context extension factor.
        low_freq_factor, high_freq_factor, original_max_position_embeddings: llama3's band edges.
    """

    kind: str = attrs.field()
    factor: float = attrs.field(validator=positive)
    low_freq_factor: float = attrs.field(default=1.0, validator=positive)
    high_freq_factor: float = attrs.field(default=4.0, validator=positive)
    original_max_position_embeddings: int = attrs.field(default=8192, validator=int_at_least(1))

    @kind.validator
    def _check_kind(self, _attribute: object, value: object) -> None:
        if value not in ROPE_SCALING_KINDS:  # a ConfigError, as every validator's (attrs' in_ raises ValueError)
            raise ConfigError(f"kind must be one of {', '.join(ROPE_SCALING_KINDS)}, got {shown(value)}")

    def __attrs_post_init__(self) -> None:
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ConfigError(
                f"llama3 RoPE scaling needs high_freq_factor > low_freq_factor, "
                f"got {self.high_freq_factor} and {self.low_freq_factor}"
            )


def switch(_instance: object, attribute: Any, value: Any) -> None:
    """An attrs validator: the field is True or False (`require_bool`: "no" would read as true)."""
    require_bool(attribute.name, value)


def check_instance(name: str, value: object, kind: type, *, error: type[MooncakeError], optional: bool = True) -> None:
    """Refuse `value` unless it is a `kind` (or None, where `optional`), with `error` naming `name`, the kind and
    the value: InvalidRequestError for a request's argument, ConfigError for an engine's option.

    A `kind` that is a `typing.runtime_checkable` protocol (`KvSink`) takes any object with its methods.
    """
    if not isinstance(value, kind) and not (optional and value is None):
        either = " or None" if optional else ""
        raise error(f"{name} must be a {kind.__name__}{either}, got {shown(value)}")


def check_callback(name: str, value: object, *, error: type[MooncakeError]) -> None:
    """Refuse `value` unless it can be called (or is None), with `error` naming `name` and the value: checked where
    it is given, not found out as a bare TypeError at its first call, mid-job."""
    if value is not None and not callable(value):
        raise error(f"{name} must be callable or None, got {shown(value)}")


_size = int_at_least(1, below=SIZE_LIMIT)


@attrs.frozen(kw_only=True)
class ModelConfig:
    """The shape of a LLaMA-architecture model.

    Attributes:
        name: the preset's name (part of the block-key namespace).
        vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size: the shape, each an
            integer in [1, `SIZE_LIMIT`); `num_heads` must divide `hidden_size` and be a multiple of `num_kv_heads`.
        rope_theta: RoPE base.
        norm_eps: RMSNorm epsilon.
        rope_scaling: a rescaling of RoPE's frequencies (None: plain RoPE).
        qkv_bias: the q, k and v projections have biases (Qwen2).
        out_bias: the attention's output projection has a bias (LLaMA's `attention_bias` sets both).
        tie_word_embeddings: the LM head is the token embedding matrix.
        max_context_tokens: the longest context (prompt + output tokens) the model runs (None: no bound, as for
            the presets, which no checkpoint trained). A checkpoint's (`checkpoint.model_config_from_hf`) is
            vLLM's `max_model_len`: its `max_position_embeddings`, times a linear RoPE scaling's factor; with a
            Mistral or Qwen2 sliding window (accepted only when no shorter) `max_position_embeddings` itself,
            since past it the window would slide and this model computes full attention. The engines refuse a
            longer prompt (`check_context_tokens`) and a decode slot longer than it, as vLLM refuses a
            `max_model_len` above what the positions allow.
    """

    name: str
    vocab_size: int = attrs.field(validator=_size)
    hidden_size: int = attrs.field(validator=_size)
    num_layers: int = attrs.field(validator=_size)
    num_heads: int = attrs.field(validator=_size)
    num_kv_heads: int = attrs.field(validator=_size)
    intermediate_size: int = attrs.field(validator=_size)
    rope_theta: float = attrs.field(default=500_000.0, validator=positive)  # a base <= 0 gives NaN angles
    norm_eps: float = attrs.field(default=1e-5, validator=non_negative)  # < 0 can take a root of a negative
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = attrs.field(default=False, validator=switch)
    out_bias: bool = attrs.field(default=False, validator=switch)
    tie_word_embeddings: bool = attrs.field(default=False, validator=switch)
    max_context_tokens: int | None = attrs.field(default=None, validator=attrs.validators.optional(int_at_least(1)))

    def __attrs_post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"num_heads={self.num_heads} must divide hidden_size={self.hidden_size}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ConfigError(f"head_dim={self.hidden_size // self.num_heads} must be even for RoPE")

    def check_context_tokens(self, num_tokens: int) -> None:
        """Refuse a prompt longer than `max_context_tokens` (no bound: nothing is refused).

        Raises:
            InvalidRequestError: `num_tokens` > `max_context_tokens`, naming both and where the bound comes from.
        """
        if self.max_context_tokens is not None and num_tokens > self.max_context_tokens:
            raise InvalidRequestError(
                f"a prompt of {shown(num_tokens)} tokens is longer than model {shown(self.name)} computes: its "
                f"max_context_tokens={shown(self.max_context_tokens)} (from a checkpoint, its max_position_embeddings, as "
                "vLLM's max_model_len)"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_width(self) -> int:
        """Elements of K (or V) per token per layer."""
        return self.num_kv_heads * self.head_dim

    @property
    def layer_weights(self) -> tuple[str, ...]:
        """The weights of each layer, in build order (`layers.{i}.<weight>`): a bias only where the config has it."""
        return (
            "attn_norm",
            "qkv",
            *(("qkv_bias",) if self.qkv_bias else ()),
            "out",
            *(("out_bias",) if self.out_bias else ()),
            "mlp_norm",
            "gate_up",
            "down",
        )

    @property
    def num_parameters(self) -> int:
        per_layer = (
            2 * self.hidden_size  # the two norms
            + self.hidden_size * (self.hidden_size + 2 * self.kv_width)  # qkv
            + self.hidden_size * self.hidden_size  # o
            + 3 * self.hidden_size * self.intermediate_size  # gate, up, down
            + (self.hidden_size + 2 * self.kv_width if self.qkv_bias else 0)
            + (self.hidden_size if self.out_bias else 0)
        )
        matrices = 1 if self.tie_word_embeddings else 2  # the embedding and the LM head
        return self.num_layers * per_layer + matrices * self.vocab_size * self.hidden_size + self.hidden_size

    def shape(self, dtype: str = "bfloat16") -> ModelShape:
        """The cost models' view of this model with its weights and KV in `dtype`.

        Raises:
            ConfigError: an unknown dtype name (`check_dtype`).
        """
        return ModelShape(
            name=self.name,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            gqa=self.num_heads // self.num_kv_heads,
            bytes_per_element=DTYPE_BYTES[check_dtype(dtype)],
            num_params=float(self.num_parameters),
            # The embedding is a lookup; a tied one is also the LM head, a product.
            lookup_params=0.0 if self.tie_word_embeddings else float(self.vocab_size * self.hidden_size),
        )

    def flops_per_token(self, context_tokens: int = 0) -> float:
        """Forward FLOPs of one token attending to `context_tokens` (`ModelShape.flops_per_token`)."""
        return self.shape().flops_per_token(context_tokens)


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
