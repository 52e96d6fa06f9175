"""Tests for `mooncake.engine.config`: the model's shape, its presets and the cost models' view, without torch.

Examples: every preset and dtype gives the `ModelShape` the cost models expect
(layers, hidden size, query heads per KV head, bytes per element, parameters);
an unknown dtype, and every impossible shape, is a ConfigError naming it; the
presets are valid LLaMA shapes. Property over valid configs: the shape's KV
bytes per token are a K and a V of `kv_width` elements per layer. And importing
the module does not load torch (a scheduler or gateway process never pays for it).
"""

from __future__ import annotations

import math
import re
import subprocess
import sys

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.engine.config import DTYPE_BYTES, PRESETS, SIZE_LIMIT, ModelConfig, check_dtype
from mooncake.errors import ConfigError
from mooncake.sched.cost import MODELS, ModelShape
from tests.engine.strategies import model_configs

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # written out: DTYPE_BYTES is what is tested


@pytest.mark.parametrize("dtype", sorted(ELEMENT_BYTES))
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_preset_and_dtype_gives_the_cost_models_shape(name: str, dtype: str) -> None:
    """`shape(dtype)` carries the preset's layers, hidden size, heads per KV head, element bytes and parameters."""
    config = PRESETS[name]
    shape = config.shape(dtype)
    assert isinstance(shape, ModelShape)
    assert shape == ModelShape(
        name=name,
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        gqa=config.num_heads // config.num_kv_heads,
        bytes_per_element=ELEMENT_BYTES[dtype],
        num_params=float(config.num_parameters),
        lookup_params=float(config.vocab_size * config.hidden_size),  # no preset ties its embedding
    )
    assert shape.weight_bytes == config.num_parameters * ELEMENT_BYTES[dtype]


def test_a_tied_embedding_is_multiplied_as_the_lm_head() -> None:
    """Tied, the one matrix is the LM head's product: no weight is a lookup, and every one costs 2 FLOPs a token."""
    tied = attrs.evolve(PRESETS["tiny"], tie_word_embeddings=True)
    assert tied.shape().lookup_params == 0.0
    assert tied.flops_per_token() == 2.0 * tied.num_parameters


def test_the_cost_models_70b_shapes_are_the_engines() -> None:
    """`MODELS` (the simulator's shapes) count LLaMA3-70B's parameters as the engine's preset does, and
    LLaMA2-70B's as the same architecture with its 32,000-token vocabulary (one count, not a rounded copy)."""
    llama3 = PRESETS["llama3-70b"]
    assert MODELS["llama3-70b"] == llama3.shape()
    assert MODELS["llama2-70b"] == attrs.evolve(llama3, name="llama2-70b", vocab_size=32_000).shape()


def test_the_engines_dtypes_are_the_shapes_dtypes() -> None:
    """The dtypes a shape can be asked for are exactly those the engines run in; bfloat16 is the default."""
    assert DTYPE_BYTES == ELEMENT_BYTES
    assert PRESETS["tiny"].shape() == PRESETS["tiny"].shape("bfloat16")


@pytest.mark.parametrize("dtype", ["float64", "int8", "bf16", "", ["float32"], {}])
def test_an_unknown_dtype_is_a_config_error_naming_it(dtype: object) -> None:
    """A dtype the engines do not run in is refused with its name in the message; a list or a dict (which no
    dict lookup takes: a bare TypeError once) is no dtype's name, refused alike."""
    with pytest.raises(ConfigError, match=re.escape(f"got {dtype!r}")):
        PRESETS["tiny"].shape(dtype)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=re.escape(f"got {dtype!r}")):
        check_dtype(dtype)


@given(model_configs(), st.sampled_from(sorted(ELEMENT_BYTES)))
def test_kv_bytes_per_token_are_a_k_and_a_v_per_layer(config: ModelConfig, dtype: str) -> None:
    """For any valid config: the shape's KV bytes per token = 2 · layers · kv_width · bytes per element."""
    shape = config.shape(dtype)
    assert shape.kv_bytes_per_token == 2 * config.num_layers * config.kv_width * ELEMENT_BYTES[dtype]
    assert shape.hidden_size // shape.gqa == config.kv_width


def test_presets_are_valid_llama_shapes() -> None:
    """Every preset has an even head dimension and grouped-query heads; tiny's vocabulary is the bytes."""
    for name, config in PRESETS.items():
        assert config.name == name
        assert config.num_heads % config.num_kv_heads == 0 and config.head_dim % 2 == 0
        assert config.kv_width == config.num_kv_heads * config.head_dim
    tiny = PRESETS["tiny"]
    assert tiny.vocab_size == 256 and tiny.num_kv_heads < tiny.num_heads
    assert PRESETS["llama3-8b"].num_parameters == pytest.approx(8.0e9, rel=0.05)
    assert PRESETS["llama3-70b"].num_parameters == 70_553_706_496  # Meta's model card: 70.6 B


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"hidden_size": 60, "num_heads": 8}, "hidden_size=60"),  # heads do not divide hidden
        ({"num_heads": 4, "num_kv_heads": 3}, "num_kv_heads=3"),  # kv heads do not divide heads
        ({"hidden_size": 12, "num_heads": 4, "num_kv_heads": 2}, "head_dim=3"),  # head_dim 3 is odd
        ({"num_layers": 0}, "num_layers"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"num_kv_heads": True}, "num_kv_heads"),
        ({"rope_theta": -5.0}, "rope_theta must be a finite number > 0"),  # NaN angles
        ({"rope_theta": 0}, "rope_theta"),
        ({"norm_eps": -1.0}, "norm_eps must be a finite number >= 0"),
        ({"norm_eps": math.nan}, "norm_eps"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be True or False"),
        ({"qkv_bias": 1}, "qkv_bias"),
        ({"max_context_tokens": 0}, "max_context_tokens"),
    ],
)
def test_config_rejects_invalid_shapes(fields: dict[str, object], named: str) -> None:
    """An impossible shape is a ConfigError naming it."""
    base = {"name": "x", "vocab_size": 8, "hidden_size": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}
    with pytest.raises(ConfigError, match=named):
        ModelConfig(intermediate_size=8, **{**base, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "field", ["vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"]
)
def test_a_size_from_the_size_limit_on_is_refused_naming_it(field: str) -> None:
    """Each size is below `SIZE_LIMIT` (2**31): 4 * 2**1100 used to pass (only a lower bound) and then fail
    `shape()` with a bare OverflowError converting the parameter count to a float."""
    base = {"vocab_size": 8, "hidden_size": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}
    for value in (SIZE_LIMIT, 4 * 2**1100):
        with pytest.raises(ConfigError, match=rf"{field} must be an integer in \[1, 2\*\*31\)"):
            ModelConfig(name="x", **{**base, "intermediate_size": 8, field: value})  # type: ignore[arg-type]


def test_the_largest_sizes_give_a_shape() -> None:
    """Every size just below the limit: the parameter count is an int a float holds, and `shape()` gives it."""
    below = SIZE_LIMIT // 2  # an even head_dim with one head
    config = ModelConfig(
        name="x",
        vocab_size=SIZE_LIMIT - 1,
        hidden_size=below,
        num_layers=SIZE_LIMIT - 1,
        num_heads=1,
        num_kv_heads=1,
        intermediate_size=SIZE_LIMIT - 1,
    )
    assert config.shape().num_params == float(config.num_parameters) < math.inf


def test_importing_the_config_does_not_load_torch() -> None:
    """`import mooncake.engine.config` (presets and shapes) leaves torch unloaded."""
    script = "import sys, mooncake.engine.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"
