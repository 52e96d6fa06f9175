"""Tests for what a checkpoint bounds and which of its files it is: the context every architecture allows, and
the safetensors files read where there is no index.

Every loaded model carries vLLM 0.32's `max_model_len` as `ModelConfig.max_context_tokens`: the
checkpoint's `max_position_embeddings` (2048 where null), times a linear RoPE factor; a LLaMA, a Mistral
with no window and a Qwen2 whose window is off are bounded as a windowed one is. With no index,
`model.safetensors` alone is the model's where it exists (transformers loads only it); otherwise a tensor
in two files is refused, naming both, not taken from whichever sorts last.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.engine.checkpoint import model_config_from_hf
from mooncake.errors import ConfigError, InvalidRequestError

SHAPE = {
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
# One config.json per architecture with no window in effect: LLaMA has none, Mistral's is null, Qwen2's is off
# (use_sliding_window false) or applies from a layer past the last (max_window_layers).
UNWINDOWED = {
    "llama": {"architectures": ["LlamaForCausalLM"], "sliding_window": 4},  # LLaMA reads no window
    "mistral": {"architectures": ["MistralForCausalLM"], "sliding_window": None},
    "qwen2 off": {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False, "sliding_window": 4},
    "qwen2 late": {
        "architectures": ["Qwen2ForCausalLM"],
        "use_sliding_window": True,
        "sliding_window": 4,
        "max_window_layers": 2,
    },
}


def config_of(kind: str, **changes: Any) -> dict[str, Any]:
    return {**SHAPE, **UNWINDOWED[kind], **changes}


@pytest.mark.parametrize("kind", sorted(UNWINDOWED))
@given(positions=st.integers(min_value=1, max_value=10**7))
def test_every_architecture_is_bounded_by_its_positions(kind: str, positions: int) -> None:
    """With no window in effect, the bound is still the positions (as vLLM's max_model_len): a prompt of that
    many tokens is taken, one more is an InvalidRequestError naming both numbers and max_position_embeddings."""
    config = model_config_from_hf(config_of(kind, max_position_embeddings=positions), name="m")
    assert config.max_context_tokens == positions
    config.check_context_tokens(positions)
    with pytest.raises(InvalidRequestError) as error:
        config.check_context_tokens(positions + 1)
    message = str(error.value)
    assert f"{positions + 1} tokens" in message and f"max_context_tokens={positions}" in message
    assert "max_position_embeddings" in message


ABSENT = object()  # a key left out of config.json


@pytest.mark.parametrize(
    ("changes", "bound"),
    [
        ({"max_position_embeddings": ABSENT}, 2048),  # LlamaConfig's default positions where the key is left out
        ({"max_position_embeddings": None}, 2048),  # vLLM's assumption where no key names a context
        ({"rope_parameters": {"rope_type": "linear", "factor": 4.0}}, 4 * 512),  # vLLM scales the positions
        ({"rope_scaling": {"type": "linear", "factor": 2.5}}, 1280),  # v4's spelling; 512 x 2.5
        ({"rope_parameters": {"rope_type": "linear", "factor": 0.5}}, 256),
        ({"max_position_embeddings": None, "rope_scaling": {"type": "linear", "factor": 2.0}}, 4096),
        (
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
            512,  # llama3 stretches frequencies within the given positions: vLLM does not scale them
        ),
    ],
)
def test_the_bound_is_vllms_max_model_len(changes: dict[str, Any], bound: int) -> None:
    """The positions, 2048 where none are named, times a linear RoPE factor (v4 or v5 spelling), llama3's left
    as they are: vLLM 0.32's `_get_and_verify_max_len` for these configs."""
    raw = {**config_of("llama", max_position_embeddings=512), **changes}
    raw = {key: value for key, value in raw.items() if value is not ABSENT}
    assert model_config_from_hf(raw, name="m").max_context_tokens == bound


def test_a_window_bounds_the_context_to_the_positions_under_a_linear_factor() -> None:
    """A Mistral window no shorter than the positions slides past them whatever the RoPE: a linear factor that
    would allow twice the positions still leaves the bound at the positions, where full attention is exact."""
    linear = {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}
    for window in (512, 600, 1024):
        raw = {**config_of("mistral", max_position_embeddings=512, sliding_window=window), **linear}
        assert model_config_from_hf(raw, name="m").max_context_tokens == 512, window


def test_a_linear_factor_that_leaves_no_context_is_refused() -> None:
    """A factor so small that the positions it scales round to no token is a ConfigError naming the positions,
    the factor and the file, not a model that refuses every prompt."""
    raw = {**config_of("llama", max_position_embeddings=16), "rope_scaling": {"type": "linear", "factor": 0.01}}
    with pytest.raises(ConfigError) as error:
        model_config_from_hf(raw, name="m", source="/ckpt/config.json")
    message = str(error.value)
    assert "/ckpt/config.json" in message and "max_position_embeddings=16" in message and "0.01" in message


@pytest.mark.parametrize(("positions", "factor"), [(10**400, 2.0), (2**31, 1e300)])
def test_linear_scaled_positions_past_a_floats_range_are_refused(positions: int, factor: float) -> None:
    """Positions a float cannot hold (10**400, which JSON reads), or a product past its range (int() of inf):
    a ConfigError naming the file, not a bare OverflowError."""
    raw = {
        **config_of("llama", max_position_embeddings=positions),
        "rope_scaling": {"type": "linear", "factor": factor},
    }
    with pytest.raises(ConfigError, match=r"^/ckpt/config\.json: max_position_embeddings=.* past a float's range$"):
        model_config_from_hf(raw, name="m", source="/ckpt/config.json")


# --------------------------------------------------------------------------- with torch: engines and files

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from mooncake.cache.hashing import BlockHasher  # noqa: E402
from mooncake.cache.pool import DramPagePool  # noqa: E402
from mooncake.cache.tiered import TieredCache  # noqa: E402
from mooncake.engine.checkpoint import SafetensorsWeights, load_model, read_model_config  # noqa: E402
from mooncake.engine.decode import DecodeConfig, DecodeEngine  # noqa: E402
from mooncake.engine.kv import KvLayout  # noqa: E402
from mooncake.engine.prefill import PrefillConfig, PrefillEngine  # noqa: E402
from tests.engine.checkpoints import VOCAB, hf_logits, hf_model, save  # noqa: E402

POSITIONS = 48
BLOCK = 8
FP32_TOLERANCE = 1e-4
PROMPT = [(5 * i + 1) % VOCAB for i in range(POSITIONS + 1)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A transformers LLaMA checkpoint (one model.safetensors, no index) and its model."""
    model = hf_model("llama")
    return save(model, tmp_path_factory.mktemp("llama") / "llama"), model


def short_copy(source: Path, directory: Path) -> Path:
    """`source`'s checkpoint with `POSITIONS` positions (the weights do not depend on them)."""
    directory.mkdir()
    raw = json.loads((source / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, "max_position_embeddings": POSITIONS}))
    (directory / "model.safetensors").write_bytes((source / "model.safetensors").read_bytes())
    return directory


def test_the_engines_hold_a_llama_checkpoint_to_its_positions(llama: tuple[Path, Any], tmp_path: Path) -> None:
    """A LLaMA checkpoint of 48 positions: prefill takes 48 tokens (transformers' logits) and refuses 49 naming
    the bound; a decode slot of 49 is a ConfigError naming both, and with no config the slot is the 48."""
    directory = short_copy(llama[0], tmp_path / "short")
    assert read_model_config(directory).max_context_tokens == POSITIONS
    model = load_model(directory)
    cache = TieredCache([DramPagePool(KvLayout(config=model.config, block_tokens=BLOCK).page_bytes, 32)])
    hasher = BlockHasher(model=model.config.name, block_size_tokens=BLOCK)
    with PrefillEngine(model, cache, hasher, PrefillConfig(chunk_tokens=16)) as prefill:
        within = prefill.prefill(PROMPT[:POSITIONS])
        assert float((within.logits - hf_logits(llama[1], PROMPT[:POSITIONS])[-1]).abs().max()) <= FP32_TOLERANCE
        with pytest.raises(InvalidRequestError, match=f"{POSITIONS + 1} tokens.*max_context_tokens={POSITIONS}"):
            prefill.prefill(PROMPT)
    with pytest.raises(ConfigError) as error:
        DecodeEngine(model, cache, block_tokens=BLOCK, config=DecodeConfig(max_context_tokens=POSITIONS + 1))
    assert f"max_context_tokens={POSITIONS + 1}" in str(error.value)
    assert f"max_context_tokens={POSITIONS}" in str(error.value)
    assert DecodeEngine(model, cache, block_tokens=BLOCK).limits.max_context_tokens == POSITIONS


def test_a_stray_file_beside_model_safetensors_is_not_read(llama: tuple[Path, Any], tmp_path: Path) -> None:
    """With no index, an older export beside `model.safetensors` holding the same tensor names (zeros here, and
    sorting after it) is not the model's: the loaded weights are `model.safetensors`' and the logits
    transformers' (before, its zero final norm was taken and every logit was 0)."""
    source, reference = llama
    directory = tmp_path / "ckpt"
    directory.mkdir()
    for file in ("config.json", "model.safetensors"):
        (directory / file).write_bytes((source / file).read_bytes())
    tensors = load_file(str(directory / "model.safetensors"))
    stale = {name: torch.zeros_like(value) for name, value in tensors.items() if "norm" in name}
    save_file(stale, str(directory / "model_old.safetensors"), metadata={"format": "pt"})
    model = load_model(directory)
    assert torch.equal(model.final_norm, tensors["model.norm.weight"])
    tokens = [1, 2, 3, 4, 5]
    with torch.inference_mode():
        ours = model(torch.tensor(tokens))
    assert float((ours - hf_logits(reference, tokens)).abs().max()) <= FP32_TOLERANCE
    (directory / "zz.safetensors").write_bytes(b"not a safetensors file")  # never opened, so never refused
    assert torch.equal(load_model(directory).final_norm, tensors["model.norm.weight"])


def test_a_tensor_in_two_shards_without_an_index_is_refused(llama: tuple[Path, Any], tmp_path: Path) -> None:
    """No index and no `model.safetensors`: shards that hold every tensor once load; one tensor in two of them is
    a ConfigError naming it and both files, whichever it is and however the files sort."""
    tensors = load_file(str(llama[0] / "model.safetensors"))
    names = sorted(tensors)
    directory = tmp_path / "shards"
    directory.mkdir()
    (directory / "config.json").write_bytes((llama[0] / "config.json").read_bytes())
    halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, mine in halves.items():
        save_file({name: tensors[name] for name in mine}, str(directory / file))
    config = read_model_config(directory)
    assert torch.equal(load_model(directory).final_norm, tensors["model.norm.weight"])
    for doubled in ("model.norm.weight", names[0], names[-1]):
        other = next(file for file, mine in halves.items() if doubled not in mine)  # the shard it is not in
        copy = {name: tensors[name] for name in halves[other]} | {doubled: torch.zeros_like(tensors[doubled])}
        save_file(copy, str(directory / other))
        with pytest.raises(ConfigError) as error:
            SafetensorsWeights(directory, config)
        message = str(error.value)
        assert doubled in message and "a.safetensors" in message and "b.safetensors" in message, message
        save_file({name: tensors[name] for name in halves[other]}, str(directory / other))
