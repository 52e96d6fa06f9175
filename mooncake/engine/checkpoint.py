"""Checkpoints in Hugging Face layout, loaded into `LlamaModel`.

A checkpoint is a directory: `config.json` (transformers' config of a
`LlamaForCausalLM`, `MistralForCausalLM` or `Qwen2ForCausalLM`: LLaMA and the
relatives that differ from it only in config) and the weights in one
`*.safetensors` file or several shards named by `model.safetensors.index.json`.

Loading is three steps:
1. `model_config_from_hf` turns the config into a `ModelConfig`, refusing what
   the model does not compute (another architecture or activation, a RoPE
   scaling other than linear and llama3, a sliding window in effect, a
   quantized checkpoint): each a one-line `ConfigError` naming the key and file.
   Every checkpoint bounds the model's context (`max_context_tokens`, which the
   engines enforce) as vLLM derives `max_model_len`: `max_position_embeddings`
   (2048 where it is null), times a linear RoPE scaling's factor. A window no
   shorter than `max_position_embeddings` is accepted, and then bounds the
   context to `max_position_embeddings` itself: within it the window never slides.
   This step needs neither torch nor safetensors, so a process that only
   schedules can read a checkpoint's shape.
2. `SafetensorsWeights` is the model's `WeightSource`: each model weight is
   one checkpoint tensor, or a few concatenated along the rows (q, k, v into
   the fused QKV; gate and up into the fused MLP input). Shards are opened
   with `safe_open` (memory-mapped: only the tensors asked for are read) and
   only the shards that hold what is asked for are opened. With no index,
   `model.safetensors` alone is the model's where it exists (as transformers
   reads it); else every `*.safetensors` file is, and a tensor in two of them
   is refused rather than taken from whichever sorts last.
3. `LlamaModel(config, weights=...)` builds the modules exactly as the random
   model does, so a loaded model runs the one forward pass there is.

Invariants: the tensors read are exactly `checkpoint_tensors` of the model's
`weight_names` (a pipeline stage reads its own layers and nothing else); each
has the shape the config implies; the loaded model's logits are transformers'
(the tests hold it to 1e-4 in float32).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mooncake import _json
from mooncake._checks import is_finite_number, shown
from mooncake._extras import needs_extra
from mooncake.engine.config import ModelConfig, RopeScaling
from mooncake.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from mooncake.engine.model import LlamaModel

__all__ = [
    "ARCHITECTURES",
    "CLASS_DEFAULTS",
    "SafetensorsWeights",
    "checkpoint_tensors",
    "load_model",
    "model_config_from_hf",
    "read_model_config",
]

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048},
    "MistralForCausalLM": {"num_key_value_heads": 8, "max_position_embeddings": 131_072, "sliding_window": 4096},
    "Qwen2ForCausalLM": {"num_key_value_heads": 32, "max_position_embeddings": 32_768, "sliding_window": 4096},
}
"""What transformers' `LlamaConfig`, `MistralConfig` and `Qwen2Config` give a key `config.json` leaves out, where it
changes what the model computes or refuses (a missing `sliding_window` is Mistral's 4096, not none); a key given
as null keeps its null (transformers: `num_key_value_heads` null is `num_attention_heads`)."""
CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"  # the one file transformers reads where there is no index
DEFAULT_MAX_CONTEXT_TOKENS = 2048  # vLLM's max_model_len where config.json names no context length

# A model weight of layer i → the checkpoint tensors (under model.layers.{i}.) it concatenates, in row order.
_LAYER_INDEX = re.compile(r"0|[1-9][0-9]*")  # as `weight_names` writes it: ASCII digits, no leading zero
_LAYER_TENSORS = {
    "attn_norm": ("input_layernorm.weight",),
    "qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "qkv_bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "out": ("self_attn.o_proj.weight",),
    "out_bias": ("self_attn.o_proj.bias",),
    "mlp_norm": ("post_attention_layernorm.weight",),
    "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down": ("mlp.down_proj.weight",),
}


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def read_json(path: Path) -> Any:
    """The JSON value in the file at `path` (a checkpoint's config and index, a tokenizer's files).

    Raises:
        ConfigError: the file is missing, unreadable, no UTF-8, or no JSON Python reads, naming it.
    """
    try:
        return _json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist") from None
    # ValueError: no JSON (a JSONDecodeError), an integer past Python's 4,300 digits, nested too deep.
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ConfigError(f"{path} is not readable JSON: {_one_line(error)}") from error


# --------------------------------------------------------------------------- config


def _number(raw: Mapping[str, Any], key: str, source: str, default: Any = None) -> Any:
    value = raw.get(key, default)
    if not is_finite_number(value):  # 10**400 would overflow float() below it
        raise ConfigError(f"{source}: {key} must be a finite number, got {shown(value)}")
    return value


def _count(raw: Mapping[str, Any], key: str, source: str, default: Any = None, *, minimum: int = 1) -> int:
    """A size (heads, layers, a window): an integer >= `minimum` (`default` when absent or null)."""
    value = raw.get(key)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f"{source}: {key} must be {what}, got {shown(value)}")
    return value


def _optional_count(raw: Mapping[str, Any], key: str, source: str) -> int | None:
    return None if raw.get(key) is None else _count(raw, key, source)


def _flag(raw: Mapping[str, Any], key: str, source: str) -> bool:
    """A switch, false when absent or null; a string is refused ("false" would read as true), as transformers does."""
    value = raw.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConfigError(f"{source}: {key} must be true or false, got {shown(value)}")
    return value


def _rope(raw: Mapping[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """RoPE's base and scaling from transformers' v5 `rope_parameters` or v4 `rope_theta` + `rope_scaling`; a non-empty
    `rope_scaling` wins over `rope_parameters`, as transformers v5 reads a config that has both."""
    key = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    params = raw.get(key) or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"{source}: {key} must be an object, got {shown(params)}")
    theta = _number(params, "rope_theta", source, raw.get("rope_theta", 10_000.0))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(
            f"{source}: {key}.partial_rotary_factor={shown(params['partial_rotary_factor'])} is not supported"
        )
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), None
    where = f"{source}: {key}"
    if kind == "linear":
        fields = {"factor": _number(params, "factor", where)}
    elif kind == "llama3":
        fields = {
            "factor": _number(params, "factor", where),
            "low_freq_factor": _number(params, "low_freq_factor", where),
            "high_freq_factor": _number(params, "high_freq_factor", where),
            # as transformers: a top-level value first (Phi3's place), then the parameters', then the model's context
            "original_max_position_embeddings": _count(
                raw,
                "original_max_position_embeddings",
                source,
                params.get("original_max_position_embeddings") or raw.get("max_position_embeddings"),
            ),
        }
    else:
        raise ConfigError(f"{where}.rope_type={shown(kind)} is not supported (supported: default, linear, llama3)")
    try:  # how the values fit together (a factor > 0, high above low) is RopeScaling's check: named with the file
        return float(theta), RopeScaling(kind=kind, **fields)
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None


def _check_supported(raw: Mapping[str, Any], architecture: str, source: str) -> int | None:
    """Refuse the config values that would make this model compute something else than transformers'; the context
    bound an accepted sliding window relies on (None: no window, so none beyond `_max_context_tokens`'s).

    Only what the architecture reads counts: LLaMA has no sliding window (a `sliding_window` key is ignored, as
    transformers ignores it), Mistral and Qwen2 have no `attention_bias` or `mlp_bias` switch. A window no shorter
    than `max_position_embeddings` is accepted because it never slides within that many tokens: so that many is
    the bound, and the model's `max_context_tokens`."""
    activation = raw.get("hidden_act", "silu")
    if activation not in ("silu", "swish"):  # transformers' ACT2FN maps both to SiLU
        raise ConfigError(f"{source}: hidden_act={shown(activation)} is not supported (only 'silu')")
    if architecture == "LlamaForCausalLM" and _flag(raw, "mlp_bias", source):
        raise ConfigError(f"{source}: mlp_bias=true is not supported")
    if raw.get("quantization_config") is not None:
        raise ConfigError(f"{source}: quantization_config is not supported (load unquantized weights)")
    if raw.get("partial_rotary_factor", 1.0) != 1.0:  # transformers v4's place for it (v5: in rope_parameters)
        raise ConfigError(f"{source}: partial_rotary_factor={shown(raw['partial_rotary_factor'])} is not supported")
    head_dim = _optional_count(raw, "head_dim", source)
    implied = _count(raw, "hidden_size", source) // _count(raw, "num_attention_heads", source)
    if head_dim is not None and head_dim != implied:
        raise ConfigError(
            f"{source}: head_dim={shown(head_dim)} is not hidden_size / num_attention_heads = {shown(implied)} (not supported)"
        )
    if architecture == "LlamaForCausalLM":
        return None
    # A sliding window changes attention only for contexts longer than the window.
    window = _optional_count(raw, "sliding_window", source)
    max_positions = _optional_count(raw, "max_position_embeddings", source)
    if architecture == "Qwen2ForCausalLM":  # transformers' Qwen2Config, step for step
        layer_types = raw.get("layer_types")
        if layer_types is not None and not (
            isinstance(layer_types, list) and all(isinstance(kind, str) for kind in layer_types)
        ):
            raise ConfigError(f"{source}: layer_types must be a list of strings, got {shown(layer_types)}")
        if not _flag(raw, "use_sliding_window", source):
            window = None  # the window is nulled: full attention in every layer, whatever layer_types say
        if layer_types is None:  # derived: a window from layer max_window_layers on
            sliding = _count(raw, "max_window_layers", source, 28, minimum=0) < _count(raw, "num_hidden_layers", source)
        else:
            sliding = any(kind != "full_attention" for kind in layer_types)
        window = window if sliding else None
    window_in_effect = window is not None and (max_positions is None or window < max_positions)
    if window_in_effect:
        raise ConfigError(
            f"{source}: sliding_window={shown(window)} is in effect below max_position_embeddings={shown(max_positions)} "
            "(sliding-window attention is not supported)"
        )
    # Full attention equals the window's only while a context is no longer than the window: the accepted window
    # holds the model to max_position_embeddings (<= the window), which the engines then enforce.
    return None if window is None else max_positions


def _max_context_tokens(
    raw: Mapping[str, Any], source: str, scaling: RopeScaling | None, window_bound: int | None
) -> int:
    """The model's context bound, as vLLM 0.32 derives `max_model_len` for these architectures (and refuses a longer
    one it is asked for): `max_position_embeddings` (`DEFAULT_MAX_CONTEXT_TOKENS` where null), times the factor of a
    linear RoPE scaling (llama3's leaves the positions as they are); no more than an accepted window's bound.

    Raises:
        ConfigError: a bound under one token (a linear factor below 1 / max_position_embeddings), or one past a
            float's range, naming both.
    """
    positions = _optional_count(raw, "max_position_embeddings", source)
    bound = DEFAULT_MAX_CONTEXT_TOKENS if positions is None else positions
    if scaling is not None and scaling.kind == "linear":
        product = f"{source}: max_position_embeddings={shown(positions)} times the linear RoPE factor={scaling.factor}"
        try:  # vLLM scales the positions as a float and truncates
            bound = int(bound * scaling.factor)
        except OverflowError:  # positions or their product past a float's range (int() of inf)
            raise ConfigError(f"{product} is past a float's range") from None
        if bound < 1:
            raise ConfigError(f"{product} leaves no context")
    return bound if window_bound is None else min(bound, window_bound)


def model_config_from_hf(raw: Mapping[str, Any], *, name: str, source: str = CONFIG_FILE) -> ModelConfig:
    """The `ModelConfig` of a transformers config (the parsed `config.json`).

    Args:
        raw: the config's JSON object.
        name: the model's name (its block-key namespace).
        source: the file it came from, for messages.

    Raises:
        ConfigError: an architecture other than `ARCHITECTURES`, a missing or malformed
            key, or a value the model does not compute (see the module's docstring).
    """
    architectures = raw.get("architectures")
    if not isinstance(architectures, list) or len(architectures) != 1 or architectures[0] not in ARCHITECTURES:
        raise ConfigError(
            f"{source}: architectures={shown(architectures)} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    architecture = architectures[0]
    # A key the file leaves out has the value of the architecture's transformers config class.
    raw = {**CLASS_DEFAULTS[architecture], **raw}
    window_bound = _check_supported(raw, architecture, source)
    theta, scaling = _rope(raw, source)
    max_context_tokens = _max_context_tokens(raw, source, scaling, window_bound)
    num_heads = _count(raw, "num_attention_heads", source)
    # LLaMA's switch for every attention projection; Mistral has none; Qwen2: q, k and v always, the output never.
    attention_bias = architecture == "LlamaForCausalLM" and _flag(raw, "attention_bias", source)
    qwen2 = architecture == "Qwen2ForCausalLM"
    # Each read (and its error named with the file) before the config checks how they fit together.
    vocab_size, hidden_size = _count(raw, "vocab_size", source), _count(raw, "hidden_size", source)
    num_layers, intermediate_size = _count(raw, "num_hidden_layers", source), _count(raw, "intermediate_size", source)
    num_kv_heads = _count(raw, "num_key_value_heads", source, num_heads)
    norm_eps = float(_number(raw, "rms_norm_eps", source, 1e-6))
    tie_word_embeddings = _flag(raw, "tie_word_embeddings", source)
    try:
        return ModelConfig(
            name=name,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            intermediate_size=intermediate_size,
            rope_theta=theta,
            norm_eps=norm_eps,
            rope_scaling=scaling,
            qkv_bias=qwen2 or attention_bias,
            out_bias=not qwen2 and attention_bias,
            tie_word_embeddings=tie_word_embeddings,
            max_context_tokens=max_context_tokens,
        )
    except ConfigError as error:  # named as the file names them
        raise ConfigError(f"{source}: {_HF_KEY.sub(lambda name: _HF_KEYS[name[0]], str(error))}") from None


# ModelConfig's fields under the names transformers' config.json gives them, for its messages.
_HF_KEYS = {
    "num_kv_heads": "num_key_value_heads",
    "num_heads": "num_attention_heads",
    "num_layers": "num_hidden_layers",
    "norm_eps": "rms_norm_eps",
}
_HF_KEY = re.compile(r"\b(" + "|".join(_HF_KEYS) + r")\b")


def read_model_config(directory: str | Path) -> ModelConfig:
    """The `ModelConfig` of the checkpoint in `directory`, named by the directory (no torch needed).

    Raises:
        ConfigError: no readable `config.json`, or one `model_config_from_hf` refuses.
    """
    path = Path(directory).resolve()
    raw = read_json(path / CONFIG_FILE)
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path / CONFIG_FILE}: expected a JSON object, got {type(raw).__name__}")
    return model_config_from_hf(raw, name=path.name, source=str(path / CONFIG_FILE))


# --------------------------------------------------------------------------- weights


def checkpoint_tensors(config: ModelConfig, name: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The checkpoint tensors (transformers' names and shapes) whose row-wise concatenation is model weight `name`.

    Raises:
        ConfigError: `name` is not one of the model's weight names.
    """
    h, kv, i, v = config.hidden_size, config.kv_width, config.intermediate_size, config.vocab_size
    if name == "embedding":
        return (("model.embed_tokens.weight", (v, h)),)
    if name == "final_norm":
        return (("model.norm.weight", (h,)),)
    if name == "head":
        return (("model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight", (v, h)),)
    parts = name.split(".") if isinstance(name, str) else []
    if (
        len(parts) != 3
        or parts[0] != "layers"
        or _LAYER_INDEX.fullmatch(parts[1]) is None
        # more digits than the layer count's is past it, and int() refuses past 4,300 of them
        or len(parts[1]) > len(str(config.num_layers))
        or int(parts[1]) >= config.num_layers
        or parts[2] not in config.layer_weights
    ):
        raise ConfigError(f"{shown(name)} is not a weight of the model")
    shapes: dict[str, list[tuple[int, ...]]] = {
        "attn_norm": [(h,)],
        "qkv": [(h, h), (kv, h), (kv, h)],
        "qkv_bias": [(h,), (kv,), (kv,)],
        "out": [(h, h)],
        "out_bias": [(h,)],
        "mlp_norm": [(h,)],
        "gate_up": [(i, h), (i, h)],
        "down": [(h, i)],
    }
    rows = shapes[parts[2]]
    names = (f"model.layers.{parts[1]}.{tensor}" for tensor in _LAYER_TENSORS[parts[2]])
    return tuple(zip(names, rows, strict=True))


class SafetensorsWeights:
    """The weights of a checkpoint directory's safetensors files, as a model's `WeightSource`.

    Args:
        directory: the checkpoint.
        config: the model's config (`read_model_config(directory)`), which fixes the shapes.

    The files are those the index names; with no index, `model.safetensors` alone where it exists (as
    transformers reads it), else every `*.safetensors` file of the directory, each tensor in exactly one.
    `tensors_read` records every checkpoint tensor read, in order.

    Raises:
        ConfigError: no safetensors files, an index naming a file outside the directory, or (no index, no
            `model.safetensors`) a tensor in two files, naming it and both.
    """

    def __init__(self, directory: str | Path, config: ModelConfig) -> None:
        self.directory, self.config = Path(directory).resolve(), config
        self.tensors_read: list[str] = []
        self._open: dict[Path, Any] = {}
        index = self.directory / INDEX_FILE
        if index.exists():
            raw = read_json(index)
            weight_map = raw.get("weight_map") if isinstance(raw, Mapping) else None
            if not isinstance(weight_map, Mapping):
                raise ConfigError(f"{index}: has no weight_map object")
            self._files = {str(tensor): self._shard(str(file), index) for tensor, file in weight_map.items()}
        elif (self.directory / WEIGHTS_FILE).exists():
            # transformers reads only this file where there is no index: another *.safetensors beside it (an older
            # export, a second copy) is not the model's, whatever tensors it holds.
            single = self.directory / WEIGHTS_FILE
            self._files = dict.fromkeys(self._file(single).keys(), single)
        else:
            shards = sorted(self.directory.glob("*.safetensors"))
            if not shards:
                raise ConfigError(f"{self.directory} holds no *.safetensors file")
            self._files = {}
            for shard in shards:
                for tensor in self._file(shard).keys():  # noqa: SIM118 (safe_open's handle is no mapping)
                    other = self._files.setdefault(tensor, shard)
                    if other != shard:  # no index says which copy is the model's: neither is taken
                        raise ConfigError(
                            f"tensor {tensor} is in two shards of {self.directory} with no {INDEX_FILE}: "
                            f"{other.name} and {shard.name}"
                        )

    def _shard(self, file: str, index: Path) -> Path:
        path = (self.directory / file).resolve()
        if path.parent != self.directory:
            raise ConfigError(f"{index}: shard {shown(file)} is not a file of {self.directory}")
        return path

    def _file(self, path: Path) -> Any:
        handle = self._open.get(path)
        if handle is None:
            with needs_extra("a safetensors checkpoint"):
                from safetensors import SafetensorError, safe_open

            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except FileNotFoundError:
                raise ConfigError(f"shard {path} does not exist") from None
            except (SafetensorError, OSError) as error:
                raise ConfigError(f"shard {path} is not a readable safetensors file: {_one_line(error)}") from error
            self._open[path] = handle
        return handle

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Model weight `name`: its checkpoint tensors, each checked against its shape, concatenated along rows.

        Raises:
            ConfigError: a tensor missing from the checkpoint, of another shape, or unreadable.
        """
        import torch

        parts = []
        for tensor, expected in checkpoint_tensors(self.config, name):
            file = self._files.get(tensor)
            if file is None:
                raise ConfigError(f"checkpoint {self.directory} lacks tensor {tensor} (model weight {name})")
            handle = self._file(file)
            try:
                found = tuple(handle.get_slice(tensor).get_shape())
                if found != expected:
                    raise ConfigError(f"tensor {tensor} in {file} has shape {found}, the config implies {expected}")
                parts.append(handle.get_tensor(tensor))
            except ConfigError:
                raise
            except Exception as error:  # safetensors reports a missing key or bad data as its own error types
                raise ConfigError(f"tensor {tensor} in {file} is unreadable: {_one_line(error)}") from error
            self.tensors_read.append(tensor)
        joined = parts[0] if len(parts) == 1 else torch.cat(parts)
        if tuple(joined.shape) != shape:
            raise ConfigError(f"model weight {name} from {self.directory} has shape {tuple(joined.shape)}, not {shape}")
        return joined

    def tensors_of(self, layers: Iterable[int] | None = None) -> set[str]:
        """The checkpoint tensors a model holding `layers` (default: all) reads."""
        from mooncake.engine.model import weight_names

        return {t for name in weight_names(self.config, layers) for t, _ in checkpoint_tensors(self.config, name)}


def load_model(
    directory: str | Path,
    *,
    dtype: str = "float32",
    device: torch.device | str = "cpu",
    layers: Iterable[int] | None = None,
) -> LlamaModel:
    """The checkpoint in `directory` as a `LlamaModel` (or the pipeline stage holding `layers`).

    Args:
        directory: a Hugging Face checkpoint directory.
        dtype: the model's dtype ("float32", "bfloat16", "float16"); tensors are converted as read.
        device: where the weights go.
        layers: the contiguous layers this stage holds (default: all); it reads only their tensors.

    Raises:
        ConfigError: what `read_model_config` and `SafetensorsWeights` refuse, each naming the key or
            tensor and the file; a missing torch or safetensors, naming the extra that installs it.
    """
    with needs_extra("load_model"):
        from mooncake.engine.model import LlamaModel

    config = read_model_config(directory)
    weights = SafetensorsWeights(directory, config)
    return LlamaModel(config, dtype=dtype, device=device, layers=layers, weights=weights)
