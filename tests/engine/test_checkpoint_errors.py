"""Tests for `mooncake.engine.checkpoint` without transformers: the name mapping, round trips and refusals.

Checkpoints here are written by `export`, the loader's inverse (the model's
fused weights cut into transformers' tensors, a transformers-style
config.json), so no reference implementation is needed. Properties: a model
exported and loaded back holds the same weights bit for bit and computes the
same logits, whatever its shape, biases, tying and RoPE scaling; the name
mapping covers exactly the model's parameters, and a pipeline's stages
together read every tensor once (a tied embedding twice: the first stage's
embedding, the last stage's head). Examples: every refusal is a one-line
`ConfigError` naming the tensor or key and the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")
pytest.importorskip("safetensors")

import torch
from safetensors.torch import save_file

from mooncake.engine.checkpoint import (
    checkpoint_tensors,
    load_model,
    model_config_from_hf,
    read_model_config,
)
from mooncake.engine.config import ModelConfig, RopeScaling
from mooncake.engine.model import LlamaModel, weight_names
from mooncake.errors import ConfigError
from tests.engine.strategies import model_configs

ROUND_TRIP = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


POSITIONS = 4096  # the max_position_embeddings `hf_config` writes


@st.composite
def relatives(draw: st.DrawFn) -> ModelConfig:
    """Small shapes of every relative: LLaMA with or without attention biases, Qwen2's q/k/v biases, tied heads,
    linear and llama3 RoPE scaling; each with the context bound its `hf_config` gives (vLLM's max_model_len: the
    positions, twice them under the linear factor 2, llama3's leaving them as they are)."""
    base = draw(model_configs())
    variant = draw(st.sampled_from(["llama", "llama-bias", "qwen2"]))
    scaling, bound = draw(
        st.sampled_from(
            [
                (None, POSITIONS),
                (RopeScaling(kind="linear", factor=2.0), 2 * POSITIONS),
                (RopeScaling(kind="llama3", factor=8.0, original_max_position_embeddings=16), POSITIONS),
            ]
        )
    )
    return ModelConfig(
        name="drawn",
        vocab_size=base.vocab_size,
        hidden_size=base.hidden_size,
        num_layers=base.num_layers,
        num_heads=base.num_heads,
        num_kv_heads=base.num_kv_heads,
        intermediate_size=base.intermediate_size,
        rope_theta=10_000.0,
        norm_eps=1e-6,
        rope_scaling=scaling,
        qkv_bias=variant != "llama",
        out_bias=variant == "llama-bias",
        tie_word_embeddings=draw(st.booleans()),
        max_context_tokens=bound,
    )


def hf_config(config: ModelConfig) -> dict[str, Any]:
    """The transformers config.json of `config` (Qwen2 when only q/k/v have biases, else LLaMA), with `POSITIONS`
    positions: a `relatives` config is read back from it as itself."""
    qwen2 = config.qkv_bias and not config.out_bias
    rope: dict[str, Any] = {"rope_theta": config.rope_theta, "rope_type": "default"}
    if config.rope_scaling is not None:
        rope = {**rope, **{k: v for k, v in vars_of(config.rope_scaling).items() if k != "kind"}}
        rope["rope_type"] = config.rope_scaling.kind
    raw = {
        "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen2 else "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "rms_norm_eps": config.norm_eps,
        "hidden_act": "silu",
        "max_position_embeddings": POSITIONS,
        "tie_word_embeddings": config.tie_word_embeddings,
        "rope_parameters": rope,
    }
    if not qwen2:
        raw["attention_bias"] = config.out_bias
    return raw


def vars_of(scaling: RopeScaling) -> dict[str, Any]:
    import attrs

    return attrs.asdict(scaling)


def export(model: LlamaModel, directory: Path, *, num_shards: int = 1) -> Path:
    """Write a whole `model` as a transformers checkpoint: its weights cut into transformers' tensors."""
    config = model.config
    tensors: dict[str, torch.Tensor] = {}
    for name in weight_names(config):
        if name.startswith("layers."):
            _, index, attribute = name.split(".")
            value = getattr(model.layers[int(index)], attribute)
        else:
            value = getattr(model, name)
        parts = checkpoint_tensors(config, name)
        for (tensor, shape), piece in zip(parts, value.split([s[0] for _, s in parts]), strict=True):
            assert tuple(piece.shape) == shape
            tensors[tensor] = piece.detach().contiguous().clone()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config(config)))
    names = sorted(tensors)
    if num_shards == 1:
        save_file(tensors, str(directory / "model.safetensors"))
        return directory
    weight_map = {}
    for shard in range(num_shards):
        file = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        mine = names[shard::num_shards]
        save_file({n: tensors[n] for n in mine}, str(directory / file))
        weight_map.update(dict.fromkeys(mine, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def global_names(model: LlamaModel) -> set[str]:
    """The model's parameter names with whole-model layer indices."""
    names = set()
    for name, _ in model.named_parameters():
        if name.startswith("layers."):
            _, index, attribute = name.split(".")
            name = f"layers.{int(index) + model.first_layer}.{attribute}"
        names.add(name)
    return names


# --------------------------------------------------------------------------- properties


@settings(max_examples=40, deadline=None)
@given(relatives(), st.data())
def test_the_mapping_covers_exactly_the_models_parameters(config: ModelConfig, data: st.DataObject) -> None:
    """A stage asks its source for exactly its own parameters; the stages of a split together ask for every
    checkpoint tensor once, except a tied embedding, which the first stage reads as its embedding and the last as
    its head."""
    cut = data.draw(st.integers(min_value=0, max_value=config.num_layers - 1), label="cut")
    stages = [range(0, cut), range(cut, config.num_layers)] if cut else [range(config.num_layers)]
    counts: dict[str, int] = {}
    for layers in stages:
        names = weight_names(config, layers)
        assert set(names) == global_names(LlamaModel(config, layers=layers)) - (
            {"head"} if config.tie_word_embeddings and 0 in layers else set()
        )
        for name in names:
            for tensor, _ in checkpoint_tensors(config, name):
                counts[tensor] = counts.get(tensor, 0) + 1
    whole = {t for name in weight_names(config) for t, _ in checkpoint_tensors(config, name)}
    assert set(counts) == whole
    tied_twice = config.tie_word_embeddings and len(stages) == 2
    assert counts == {t: 2 if tied_twice and t == "model.embed_tokens.weight" else 1 for t in whole}


@ROUND_TRIP
@given(relatives(), st.sampled_from([1, 3]), st.sampled_from(["float32", "bfloat16"]))
def test_an_exported_model_loads_back_bit_for_bit(
    tmp_path_factory: pytest.TempPathFactory, config: ModelConfig, num_shards: int, dtype: str
) -> None:
    """Export a random model (one file or shards with an index), load it: the same config, bit-equal weights,
    and logits equal to rounding."""
    model = LlamaModel(config, seed=3)
    with torch.no_grad():  # non-zero biases and norms, so a misplaced one shows
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.copy_(torch.randn_like(parameter))
    directory = export(model, tmp_path_factory.mktemp("drawn"), num_shards=num_shards)
    loaded = load_model(directory, dtype=dtype)
    assert attrs_equal_but_name(loaded.config, config)
    for (name, mine), theirs in zip(model.named_parameters(), loaded.parameters(), strict=True):
        assert torch.equal(mine.to(loaded.dtype), theirs), name
    if dtype == "float32":
        tokens = torch.arange(min(config.vocab_size, 20)) % config.vocab_size
        with torch.inference_mode():
            # Bit-equal weights, but not always the same kernels: a memory-mapped or tied tensor may take another
            # path through oneDNN (seen once in CI), so the logits agree to float32 rounding.
            torch.testing.assert_close(model(tokens), loaded(tokens), rtol=1e-5, atol=1e-6)


def attrs_equal_but_name(loaded: ModelConfig, config: ModelConfig) -> bool:
    import attrs

    return attrs.evolve(loaded, name=config.name) == config


# --------------------------------------------------------------------------- refusals


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A tiny random LLaMA checkpoint in two shards with an index."""
    config = ModelConfig(
        name="t",
        vocab_size=50,
        hidden_size=16,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=24,
        rope_theta=10_000.0,
    )
    return export(LlamaModel(config), tmp_path / "ckpt", num_shards=2)


def refusal(directory: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        load_model(directory)
    message = str(caught.value)
    assert "\n" not in message and message == " ".join(message.split()), message
    return message


def edit_config(directory: Path, **changes: Any) -> None:
    raw = json.loads((directory / "config.json").read_text())
    raw.update(changes)
    (directory / "config.json").write_text(json.dumps(raw))


def test_a_truncated_shard_is_refused_naming_it(checkpoint: Path) -> None:
    """A shard cut short (an interrupted download) is one line naming the file."""
    shard = checkpoint / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    message = refusal(checkpoint)
    assert str(shard) in message and "safetensors" in message


@pytest.mark.parametrize("content", [b"", b"garbage" * 20, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}"])
def test_a_shard_with_a_garbage_header_is_refused_naming_it(checkpoint: Path, content: bytes) -> None:
    """An empty file, a header length beyond the file, or a header that is not JSON: one line naming the file."""
    shard = checkpoint / "model-00001-of-00002.safetensors"
    shard.write_bytes(content)
    assert str(shard) in refusal(checkpoint)


def test_a_missing_shard_is_refused_naming_it(checkpoint: Path) -> None:
    (checkpoint / "model-00001-of-00002.safetensors").unlink()
    assert "model-00001-of-00002.safetensors does not exist" in refusal(checkpoint)


def test_a_missing_tensor_is_refused_naming_it(tmp_path: Path, checkpoint: Path) -> None:
    """A tensor absent from the files (and the index) is named, with the model weight it belongs to."""
    index_path = checkpoint / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["model.layers.1.self_attn.k_proj.weight"]
    index_path.write_text(json.dumps(index))
    message = refusal(checkpoint)
    assert "model.layers.1.self_attn.k_proj.weight" in message and "layers.1.qkv" in message


def test_a_tensor_the_index_names_but_the_shard_lacks_is_refused(checkpoint: Path) -> None:
    index_path = checkpoint / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.norm.weight"] = "model-00002-of-00002.safetensors"
    index["weight_map"]["model.embed_tokens.weight"] = "model-00002-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    message = refusal(checkpoint)
    assert "model-00002-of-00002.safetensors" in message and ("embed_tokens" in message or "model.norm" in message)


def test_a_shape_mismatch_is_refused_naming_the_tensor_and_both_shapes(checkpoint: Path) -> None:
    edit_config(checkpoint, intermediate_size=32)
    message = refusal(checkpoint)
    assert "mlp.gate_proj.weight" in message and "(24, 16)" in message and "(32, 16)" in message


def test_an_index_pointing_outside_the_directory_is_refused(checkpoint: Path) -> None:
    index_path = checkpoint / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"
    index_path.write_text(json.dumps(index))
    assert "elsewhere.safetensors" in refusal(checkpoint)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
        ({"architectures": None}, "architectures"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"head_dim": 8}, "head_dim=8"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type='yarn'"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}, "low_freq_factor"),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 64}, "sliding_window=64"),
        ({"vocab_size": "many"}, "vocab_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3"),  # the file's key, not ModelConfig's field
        ({"rms_norm_eps": -1e-6}, "rms_norm_eps must be"),
        # RoPE values that fit no scaling (RopeScaling's own checks), named with the key they sit under
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 0}}, "rope_parameters: factor"),
        (
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 1e4,
                    "factor": 8.0,
                    "low_freq_factor": 4.0,
                    "high_freq_factor": 2.0,
                }
            },
            "rope_parameters: llama3 RoPE scaling needs high_freq_factor > low_freq_factor",
        ),
        # strings where transformers wants a bool or a size (it refuses them too): "false" read as true
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
        ({"attention_bias": "false"}, "attention_bias must be true or false"),
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
        ({"num_hidden_layers": 2.5}, "num_hidden_layers must be a positive integer"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": "8"}, "sliding_window must be a positive"),
        (
            {"architectures": ["MistralForCausalLM"], "sliding_window": 8, "max_position_embeddings": "4096"},
            "max_position_embeddings must be a positive integer",
        ),
        ({"architectures": ["Qwen2ForCausalLM"], "layer_types": "full_attention"}, "layer_types must be a list"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),  # transformers v4's place for it
    ],
)
def test_unsupported_config_keys_are_refused_naming_the_key_and_file(
    checkpoint: Path, changes: dict[str, Any], named: str
) -> None:
    """Another architecture, activation, head size, RoPE type, a sliding window in effect, a quantized checkpoint
    or a malformed value: one line naming the key (and its value) and config.json."""
    edit_config(checkpoint, **changes)
    message = refusal(checkpoint)
    assert named in message and str(checkpoint / "config.json") in message


def test_a_window_that_never_slides_and_the_v4_rope_keys_are_accepted(checkpoint: Path) -> None:
    """A sliding window as long as the positions changes nothing; transformers v4's rope_theta + rope_scaling
    (with `type` for `rope_type`) reads as v5's rope_parameters."""
    raw = json.loads((checkpoint / "config.json").read_text())
    del raw["rope_parameters"]
    raw.update(
        architectures=["MistralForCausalLM"],
        sliding_window=4096,
        max_position_embeddings=4096,
        rope_theta=500_000.0,
        rope_scaling={"type": "linear", "factor": 4.0},
    )
    config = model_config_from_hf(raw, name="m")
    assert config.rope_theta == 500_000.0 and config.rope_scaling == RopeScaling(kind="linear", factor=4.0)
    qwen = {**raw, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 64, "use_sliding_window": False}
    assert model_config_from_hf(qwen, name="q").qkv_bias
    with pytest.raises(ConfigError, match="sliding_window=64"):
        model_config_from_hf({**qwen, "use_sliding_window": True, "max_window_layers": 0}, name="q")


def test_a_malformed_value_names_the_file_once(checkpoint: Path) -> None:
    edit_config(checkpoint, intermediate_size=None)
    message = refusal(checkpoint)
    assert message.count(str(checkpoint / "config.json")) == 1 and "intermediate_size" in message


def test_configs_transformers_runs_as_this_model_are_accepted(checkpoint: Path) -> None:
    """What the architecture ignores is ignored, and what transformers fills in is filled in the same way: LLaMA
    has no sliding window and Mistral no attention bias; "swish" is SiLU; Qwen2's window applies only from layer
    `max_window_layers` on; a llama3 RoPE without `original_max_position_embeddings` takes the model's context."""
    raw = json.loads((checkpoint / "config.json").read_text())
    layers = raw["num_hidden_layers"]
    plain = model_config_from_hf(raw, name="m")
    assert model_config_from_hf({**raw, "sliding_window": 64, "hidden_act": "swish"}, name="m") == plain
    mistral = {**raw, "architectures": ["MistralForCausalLM"]}
    assert not model_config_from_hf({**mistral, "attention_bias": True}, name="m").qkv_bias
    qwen = {**raw, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 64, "use_sliding_window": True}
    assert model_config_from_hf({**qwen, "max_window_layers": layers}, name="q").qkv_bias
    with pytest.raises(ConfigError, match="sliding_window=64"):
        model_config_from_hf({**qwen, "max_window_layers": layers - 1}, name="q")
    sliding_types = ["sliding_attention"] * layers
    assert model_config_from_hf({**qwen, "use_sliding_window": False, "layer_types": sliding_types}, name="q")
    no_window_key = {key: value for key, value in qwen.items() if key != "sliding_window"}
    with pytest.raises(ConfigError, match="sliding_window=4096"):  # Qwen2Config's default window
        model_config_from_hf({**no_window_key, "max_window_layers": 0, "max_position_embeddings": 32768}, name="q")
    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    scaled = model_config_from_hf({**raw, "rope_parameters": llama3, "max_position_embeddings": 4096}, name="m")
    assert scaled.rope_scaling is not None and scaled.rope_scaling.original_max_position_embeddings == 4096
    given = {**llama3, "original_max_position_embeddings": 2048}
    phi3_style = {**raw, "rope_parameters": given, "original_max_position_embeddings": 1024}  # the top level wins
    scaling = model_config_from_hf(phi3_style, name="m").rope_scaling
    assert scaling is not None and scaling.original_max_position_embeddings == 1024


def test_a_directory_without_weights_or_config_is_refused(tmp_path: Path, checkpoint: Path) -> None:
    assert "config.json does not exist" in refusal(tmp_path)
    for file in checkpoint.glob("*.safetensors*"):
        file.unlink()
    assert "holds no *.safetensors file" in refusal(checkpoint)
    (checkpoint / "config.json").write_text("{nope")
    assert "not readable JSON" in refusal(checkpoint)


@pytest.mark.parametrize(
    "value",
    ["9" * 5000, "-" + "9" * 5000, "[" * 100_000 + "]" * 100_000],
    ids=["5000-digit integer", "-5000-digit integer", "nested 100000 deep"],
)
@pytest.mark.parametrize("file", ["config.json", "model.safetensors.index.json"])
def test_json_python_cannot_read_is_refused_naming_the_file(checkpoint: Path, file: str, value: str) -> None:
    """A number past Python's 4,300 digits (a ValueError from `json`, no JSONDecodeError) or arrays nested past the
    interpreter's stack (a RecursionError) in config.json or the index: one ConfigError naming the file."""
    text = (checkpoint / file).read_text()
    (checkpoint / file).write_text(text[: text.rindex("}")] + f', "extra": {value}}}')
    message = refusal(checkpoint)
    assert message.startswith(f"{checkpoint / file} is not readable JSON: "), message
    assert len(message) - len(str(checkpoint / file)) < 250, message


def test_reading_the_config_needs_no_weights(checkpoint: Path) -> None:
    """`read_model_config` reads config.json alone: the shape a scheduler needs, named by the directory."""
    for file in checkpoint.glob("*.safetensors"):
        file.unlink()
    config = read_model_config(checkpoint)
    assert config.name == "ckpt" and config.num_layers == 2
    with pytest.raises(ConfigError, match="not a weight"):
        checkpoint_tensors(config, "layers.0.nothing")


def test_what_a_config_leaves_out_or_gives_twice_reads_as_transformers_reads_it(checkpoint: Path) -> None:
    """A key `config.json` leaves out has the value of the architecture's transformers config class (Mistral's
    window is 4096 and its key-value heads 8, not none and all heads), and a config with both v5's
    `rope_parameters` and v4's `rope_scaling` scales RoPE by `rope_scaling`, as transformers reads it."""
    transformers = pytest.importorskip("transformers")
    raw = json.loads((checkpoint / "config.json").read_text())
    bare = {k: v for k, v in raw.items() if k not in ("sliding_window", "num_key_value_heads")}
    mistral = {**bare, "architectures": ["MistralForCausalLM"], "num_attention_heads": 8, "hidden_size": 64}
    reference = transformers.MistralConfig(**mistral)
    assert reference.sliding_window == 4096 and reference.num_key_value_heads == 8
    with pytest.raises(ConfigError, match="sliding_window=4096"):
        model_config_from_hf({**mistral, "max_position_embeddings": 8192}, name="m")
    short = {**mistral, "max_position_embeddings": 4096}  # a window as long as the positions never slides
    assert model_config_from_hf(short, name="m").num_kv_heads == transformers.MistralConfig(**short).num_key_value_heads
    both = {
        **raw,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    }
    assert transformers.LlamaConfig(**both).rope_parameters["rope_type"] == "linear"
    assert model_config_from_hf(both, name="m").rope_scaling == RopeScaling(kind="linear", factor=4.0)
