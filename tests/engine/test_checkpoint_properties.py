"""Properties of `mooncake.engine.checkpoint` over generated checkpoints, configs and names.

test_checkpoint_errors holds an exported model to a bit-exact round trip and
each refusal to an example; here the pieces are held to their contracts
directly. `SafetensorsWeights`: any tensors written with the safetensors
package (float32, bfloat16, float16; one file, shards found by glob, or shards
named by an index) read back bit for bit in their own dtype, each model
weight the row-wise concatenation of its parts in order, `tensors_read`
exactly what was asked; a shard holding nothing asked for is never opened; a
tensor missing or of another shape is refused naming it, and only the weight
it belongs to. `checkpoint_tensors`: the parts of every weight concatenate to
the parameter `LlamaModel` builds; a name of no weight is refused naming it.
`model_config_from_hf`: the config.json forms transformers reads as one
model (v4 and v5 RoPE keys, keys left to the class defaults or given as null,
Mistral for LLaMA without biases, windows that never slide, keys the model
does not read) all give that `ModelConfig`; a malformed value of a key it
reads is refused in one line naming the key, the value and the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")
pytest.importorskip("safetensors")

import attrs
import torch
from safetensors.torch import save_file

from mooncake._checks import shown
from mooncake.engine.checkpoint import (
    CLASS_DEFAULTS,
    INDEX_FILE,
    SafetensorsWeights,
    checkpoint_tensors,
    model_config_from_hf,
)
from mooncake.engine.config import ModelConfig
from mooncake.engine.model import LlamaModel, weight_names
from mooncake.errors import ConfigError
from tests.engine.strategies import model_configs
from tests.engine.test_checkpoint_errors import hf_config, relatives

torch.set_num_threads(1)  # tiny tensors on a busy 2-core box (see tests/engine/support.py)

IO = settings(max_examples=25, deadline=None)
PURE = settings(max_examples=50, deadline=None)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# A tensor old transformers checkpoints hold and no model weight reads: it stands for everything not asked for.
DECOY = "model.layers.0.self_attn.rotary_emb.inv_freq"

Parts = dict[str, tuple[tuple[str, torch.Tensor], ...]]  # model weight → its checkpoint tensors, in row order


def all_weight_names(config: ModelConfig) -> list[str]:
    """Every name some stage of the model asks for: the whole model's, and a tied head (the last stage's)."""
    return [*weight_names(config), *(["head"] if config.tie_word_embeddings else [])]


def draw_parts(data: st.DataObject, config: ModelConfig) -> Parts:
    """Random tensors of the shapes the config implies, one dtype per model weight (its parts share it)."""
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    parts: Parts = {}
    made: dict[str, torch.Tensor] = {}  # a tied head's tensor is the embedding's
    for name in all_weight_names(config):
        dtype = data.draw(st.sampled_from(DTYPES), label=f"dtype of {name}")
        tensors = []
        for tensor, shape in checkpoint_tensors(config, name):
            if tensor not in made:
                made[tensor] = torch.randn(shape, generator=generator).to(dtype)
            tensors.append((tensor, made[tensor]))
        parts[name] = tuple(tensors)
    return parts


def tensors_of(parts: Parts) -> dict[str, torch.Tensor]:
    return {tensor: value for pieces in parts.values() for tensor, value in pieces}


def write(directory: Path, shards: list[dict[str, torch.Tensor]], *, index: bool) -> list[Path]:
    """Write `shards` with the safetensors package, each one file (named as transformers names them)."""
    directory.mkdir(parents=True, exist_ok=True)
    files = [directory / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file, shard in zip(files, shards, strict=True):
        save_file({name: value.contiguous() for name, value in shard.items()}, str(file))
    if index:
        weight_map = {name: file.name for file, shard in zip(files, shards, strict=True) for name in shard}
        (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return files


def split(data: st.DataObject, tensors: dict[str, torch.Tensor], num_shards: int) -> list[dict[str, torch.Tensor]]:
    """Each tensor in a drawn shard of `num_shards` (some may end up empty: safetensors writes those too)."""
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(num_shards)]
    for name, value in tensors.items():
        shards[data.draw(st.integers(0, num_shards - 1), label=f"shard of {name}")][name] = value
    return shards


def expected_weight(pieces: tuple[tuple[str, torch.Tensor], ...]) -> torch.Tensor:
    values = [value for _, value in pieces]
    return values[0] if len(values) == 1 else torch.cat(values)


def one_line(message: str) -> bool:
    return len(message.splitlines()) == 1


# --------------------------------------------------------------------------- SafetensorsWeights


@IO
@given(relatives(), st.sampled_from(["single", "glob", "index"]), st.data())
def test_tensors_written_with_safetensors_read_back_exactly(
    tmp_path_factory: pytest.TempPathFactory, config: ModelConfig, layout: str, data: st.DataObject
) -> None:
    """Whatever the dtypes and the sharding, each model weight asked for (in any order, any subset) is the
    row-wise concatenation of its checkpoint tensors, bit for bit and in their dtype, and `tensors_read` lists
    exactly the tensors of the weights asked for, in the order asked: the loader neither reorders q/k/v or
    gate/up, converts, nor reads anything else (the decoy beside them is never read)."""
    parts = draw_parts(data, config)
    tensors = {**tensors_of(parts), DECOY: torch.arange(4.0)}
    directory = tmp_path_factory.mktemp("weights")
    if layout == "single":
        write(directory, [tensors], index=False)
    else:
        write(directory, split(data, tensors, data.draw(st.integers(2, 4), label="shards")), index=layout == "index")
    asked = data.draw(st.permutations(list(parts)), label="order")
    asked = asked[: data.draw(st.integers(1, len(asked)), label="how many")]
    weights = SafetensorsWeights(directory, config)
    for name in asked:
        expected = expected_weight(parts[name])
        got = weights.get(name, tuple(expected.shape))
        assert got.dtype == expected.dtype, name
        assert torch.equal(got, expected), name
    assert weights.tensors_read == [tensor for name in asked for tensor, _ in parts[name]]


@IO
@given(relatives(), st.data())
def test_a_shard_holding_nothing_asked_for_is_never_opened(
    tmp_path_factory: pytest.TempPathFactory, config: ModelConfig, data: st.DataObject
) -> None:
    """With an index, only the shards holding what is asked for are opened (the module's promise: a pipeline
    stage reads its own shards): the shards holding only the other weights' tensors are garbage on disk, and
    reading a drawn stage's weights still succeeds, bit for bit."""
    parts = draw_parts(data, config)
    first = data.draw(st.integers(0, config.num_layers - 1), label="first layer")
    last = data.draw(st.integers(first, config.num_layers - 1), label="last layer")
    asked = weight_names(config, range(first, last + 1))
    wanted = {tensor for name in asked for tensor, _ in parts[name]}
    everything = tensors_of(parts)
    mine = {name: value for name, value in everything.items() if name in wanted}
    others = {name: value for name, value in everything.items() if name not in wanted}
    num_mine = data.draw(st.integers(1, 3), label="shards asked for")
    shards = [*split(data, mine, num_mine), {**others, DECOY: torch.arange(4.0)}]
    files = write(tmp_path_factory.mktemp("stage"), shards, index=True)
    files[-1].write_bytes(b"not a safetensors file")
    weights = SafetensorsWeights(files[-1].parent, config)
    for name in asked:
        expected = expected_weight(parts[name])
        assert torch.equal(weights.get(name, tuple(expected.shape)), expected), name
    assert set(weights.tensors_read) == wanted


@IO
@given(relatives(), st.sampled_from(["missing", "rows", "transposed"]), st.booleans(), st.data())
def test_a_damaged_tensor_is_refused_naming_it_and_only_its_weight(
    tmp_path_factory: pytest.TempPathFactory, config: ModelConfig, damage: str, indexed: bool, data: st.DataObject
) -> None:
    """One checkpoint tensor missing, with a row too many, or transposed: asking for its model weight is a
    one-line `ConfigError` naming the tensor (a missing one with its weight, a misshapen one with the shape
    found and the one the config implies); every other weight still reads exactly."""
    parts = draw_parts(data, config)
    victim_weight = data.draw(st.sampled_from(list(parts)), label="weight")
    victim, value = data.draw(st.sampled_from(parts[victim_weight]), label="tensor")
    tensors = tensors_of(parts)
    if damage == "missing":
        del tensors[victim]
    elif damage == "rows":
        tensors[victim] = torch.cat([value, value[:1]])
    else:
        tensors[victim] = value.t() if value.ndim == 2 and value.shape[0] != value.shape[1] else value[:0]
    directory = tmp_path_factory.mktemp("damaged")
    write(directory, split(data, tensors, 2), index=indexed)
    weights = SafetensorsWeights(directory, config)
    with pytest.raises(ConfigError) as caught:
        weights.get(victim_weight, tuple(expected_weight(parts[victim_weight]).shape))
    message = str(caught.value)
    assert one_line(message) and victim in message, message
    if damage == "missing":
        assert victim_weight in message
    else:
        assert str(tuple(tensors[victim].shape)) in message and str(tuple(value.shape)) in message
    sharing = {name for name, pieces in parts.items() if victim in dict(pieces)}  # a tied head shares the embedding
    for name, pieces in parts.items():
        if name not in sharing:
            expected = expected_weight(pieces)
            assert torch.equal(weights.get(name, tuple(expected.shape)), expected), name


# --------------------------------------------------------------------------- checkpoint_tensors


@PURE
@given(relatives())
def test_the_parts_of_each_weight_concatenate_to_the_models_parameter(config: ModelConfig) -> None:
    """For every weight a stage may ask for, the checkpoint tensors' shapes share their trailing dimensions
    and their rows add up to the parameter `LlamaModel` builds: the shapes the loader checks are the model's,
    so a checkpoint that passes the check fills the model (q + k + v rows into QKV, gate + up into the MLP)."""
    model = LlamaModel(config)
    parameters = dict(model.named_parameters())
    for name in all_weight_names(config):
        parameter = parameters["embedding" if name == "head" and config.tie_word_embeddings else name]
        shapes = [shape for _, shape in checkpoint_tensors(config, name)]
        assert all(shape[1:] == tuple(parameter.shape[1:]) for shape in shapes), name
        assert sum(shape[0] for shape in shapes) == parameter.shape[0], name


weight_attributes = ("attn_norm", "qkv", "qkv_bias", "out", "out_bias", "mlp_norm", "gate_up", "down")
# One name of each family a loader could mistake for a weight (each example checks one of every family).
not_weight_names = st.tuples(
    st.text(max_size=20).filter(lambda name: name not in ("embedding", "final_norm", "head") and "." not in name),
    st.builds(
        "layers.{}.{}".format, st.integers(0, 3), st.text(max_size=8).filter(lambda a: a not in weight_attributes)
    ),
    st.builds("layers.{}.{}".format, st.sampled_from(["", "x", "-1", " 1", "1 "]), st.sampled_from(weight_attributes)),
    st.builds(
        "{}.0.{}".format, st.sampled_from(["layer", "model.layers", "Layers"]), st.sampled_from(weight_attributes)
    ),
    st.builds("layers.0.{}.weight".format, st.sampled_from(weight_attributes)),
    st.sampled_from(["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "Embedding", "head "]),
)


@PURE
@given(model_configs(), not_weight_names)
def test_a_name_of_no_weight_is_refused_naming_it(config: ModelConfig, names: tuple[str, ...]) -> None:
    """A name not of the `weight_names` form (another attribute, a layer that is no number, a different
    number of parts, transformers' own tensor names, a stray space) is a `ConfigError` naming it, not a guess
    at some tensor."""
    for name in names:
        with pytest.raises(ConfigError) as caught:
            checkpoint_tensors(config, name)
        assert shown(name) in str(caught.value)


@PURE
@given(model_configs())
def test_the_weights_named_are_exactly_those_the_model_asks_for(config: ModelConfig) -> None:
    """`checkpoint_tensors` answers for exactly the names `weight_names` gives the whole model (and "head", which
    a stage holding the last layer asks for even when it is tied) and refuses every other layer name: a layer
    past the last, an index written with a leading zero or other digits than ASCII, a bias the config has not."""
    asked = set(all_weight_names(config))
    last = config.num_layers - 1
    for index in ("0", str(last), str(config.num_layers), "00", f"0{last}", "²", "١"):
        for attribute in weight_attributes:
            name = f"layers.{index}.{attribute}"
            if name in asked:
                assert checkpoint_tensors(config, name), name
            else:
                with pytest.raises(ConfigError, match="is not a weight of the model"):
                    checkpoint_tensors(config, name)


# --------------------------------------------------------------------------- model_config_from_hf

IGNORED_KEYS = {
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
    "transformers_version": "4.44.0",
    "use_cache": True,
    "initializer_range": 0.02,
    "pretraining_tp": 1,
}


def rope_variants(raw: dict[str, Any], bound: int | None) -> list[tuple[dict[str, Any], int | None]]:
    """`raw` (whose context bound is `bound`) with its v5 `rope_parameters` written every way transformers reads as
    the same RoPE, each with its context bound: as they are, or as v4's top-level `rope_theta` and a `rope_scaling`
    (`type` or `rope_type`; none, null or empty for plain RoPE; beside a stale plain `rope_parameters`, which it
    wins over); llama3's original positions in the parameters, at the top level (Phi3's place) or left to the
    model's context (whose positions, llama3's original ones then, are its bound: llama3 scales no context)."""
    rope = raw["rope_parameters"]
    base = {key: value for key, value in raw.items() if key != "rope_parameters"}
    placements: list[tuple[dict[str, Any], dict[str, Any], int | None]] = [({}, rope, bound)]
    if rope["rope_type"] == "llama3":
        positions = rope["original_max_position_embeddings"]
        original = {"original_max_position_embeddings": positions}
        bare = {key: value for key, value in rope.items() if key not in original}
        placements += [(original, bare, bound), ({"max_position_embeddings": positions}, bare, positions)]
    variants: list[tuple[dict[str, Any], int | None]] = []
    for top, params, context in placements:
        v4 = {**base, **top, "rope_theta": params["rope_theta"]}
        scaling = {key: value for key, value in params.items() if key not in ("rope_theta", "rope_type")}
        forms = [{**base, **top, "rope_parameters": params}]
        if params["rope_type"] == "default":
            forms += [v4, {**v4, "rope_scaling": None}, {**v4, "rope_scaling": {}}]
        else:
            forms += [{**v4, "rope_scaling": {key: params["rope_type"], **scaling}} for key in ("type", "rope_type")]
            stale = {"rope_type": "default", "rope_theta": params["rope_theta"]}  # v5 reads rope_scaling over it
            forms.append({**forms[-1], "rope_parameters": stale})
        variants += [(form, context) for form in forms]
    return variants


def unread_variants(architecture: str, num_layers: int, raw: dict[str, Any]) -> list[tuple[dict[str, Any], int | None]]:
    """Keys `architecture` does not read, or reads to nothing but a context bound, each with the bound it gives
    (`ModelConfig.max_context_tokens`; None: the one the config has without it): windows that never slide (Qwen2's
    only with `use_sliding_window` and from layer `max_window_layers` on), bounding a model to its positions even
    under a linear RoPE factor; LLaMA's window, Mistral's attention_bias."""
    positions = raw["max_position_embeddings"]
    if architecture == "MistralForCausalLM":  # a window as long as the positions never slides within them
        return [
            ({"sliding_window": window, "attention_bias": bias}, None if window is None else positions)
            for window in (None, positions, positions + 1)
            for bias in (True, False, None)
        ]
    if architecture == "Qwen2ForCausalLM":
        assert num_layers <= 28  # so the class default max_window_layers (28) nulls the last variant's window
        return [
            ({}, None),  # the class default window, but use_sliding_window defaults to false
            ({"use_sliding_window": False, "sliding_window": 8, "max_window_layers": 0}, None),
            ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": num_layers}, None),
            ({"use_sliding_window": True, "sliding_window": 8, "layer_types": ["full_attention"] * num_layers}, None),
            ({"use_sliding_window": True, "sliding_window": positions}, None),
            ({"use_sliding_window": True, "sliding_window": positions, "max_window_layers": 0}, positions),
            ({"attention_bias": True, "mlp_bias": True}, None),  # Qwen2 has no such switches
        ]
    return [({"sliding_window": window}, None) for window in (None, 1, 8)]  # LLaMA has no window


@st.composite
def hf_forms(draw: st.DrawFn) -> tuple[ModelConfig, dict[str, Any]]:
    """A config and one of the many config.json forms transformers reads as that model."""
    config = draw(relatives())
    raw = hf_config(config)
    architecture = raw["architectures"][0]
    if architecture == "LlamaForCausalLM" and not config.qkv_bias and draw(st.booleans(), label="as Mistral"):
        architecture = "MistralForCausalLM"  # LLaMA without biases; Mistral reads no attention_bias
        raw.update(architectures=[architecture], model_type="mistral")
    raw, bound = draw(st.sampled_from(rope_variants(raw, config.max_context_tokens)), label="rope keys")
    config = attrs.evolve(config, max_context_tokens=bound)
    defaults = CLASS_DEFAULTS[architecture]
    if config.num_kv_heads == config.num_heads:
        choice = draw(st.sampled_from(["given", "null", "absent"]))
        if choice == "null":  # null is all heads, whatever the class default
            raw["num_key_value_heads"] = None
        if choice == "absent" and "num_key_value_heads" not in defaults:
            del raw["num_key_value_heads"]
    for key in ("tie_word_embeddings", "attention_bias"):
        if raw.get(key) is False:
            choice = draw(st.sampled_from(["false", "null", "absent"]), label=key)
            if choice != "false":
                raw[key] = None
            if choice == "absent":
                del raw[key]
    choice = draw(st.sampled_from(["silu", "swish", "absent"]), label="hidden_act")
    raw["hidden_act"] = choice
    if choice == "absent":
        del raw["hidden_act"]
    head_dim = draw(st.sampled_from(["absent", "null", "implied"]), label="head_dim")
    if head_dim != "absent":
        raw["head_dim"] = None if head_dim == "null" else config.hidden_size // config.num_heads
    if config.norm_eps == 1e-6 and draw(st.booleans(), label="default eps"):
        del raw["rms_norm_eps"]
    unread, bound = draw(st.sampled_from(unread_variants(architecture, config.num_layers, raw)), label="unread keys")
    raw.update(unread)
    if bound is not None:
        config = attrs.evolve(config, max_context_tokens=bound)
    raw.update(
        {key: IGNORED_KEYS[key] for key in draw(st.sets(st.sampled_from(sorted(IGNORED_KEYS))), label="ignored")}
    )
    order = draw(st.permutations(sorted(raw)), label="key order")
    return config, json.loads(json.dumps({key: raw[key] for key in order}))


@PURE
@given(hf_forms(), st.text(min_size=1, max_size=10))
def test_every_form_transformers_reads_as_the_model_gives_its_config(
    form: tuple[ModelConfig, dict[str, Any]], name: str
) -> None:
    """v4 or v5 RoPE keys (`type` or `rope_type`), llama3's original positions in its parameters, at the top
    level or taken from the context, keys left to the class defaults or given as null, "swish" for SiLU, a
    consistent head_dim, Mistral for LLaMA without biases, windows that never slide, keys no model reads, any
    key order: all read as the one `ModelConfig` (named as asked; its context bounded as vLLM bounds it, by the
    positions, twice them under the linear factor 2, and by the positions under a window that never slides)."""
    config, raw = form
    assert model_config_from_hf(raw, name=name) == attrs.evolve(config, name=name)


@PURE
@given(relatives())
def test_every_way_of_writing_rope_gives_the_configs_rope(config: ModelConfig) -> None:
    """Each way transformers (v4 or v5) writes the config's RoPE, every one every example, reads as the config:
    theta and the scaling with its factors and llama3's original positions wherever they are, and the context
    bound of the positions the form gives."""
    for raw, bound in rope_variants(hf_config(config), config.max_context_tokens):
        assert model_config_from_hf(raw, name=config.name) == attrs.evolve(config, max_context_tokens=bound), raw


@PURE
@given(relatives())
def test_keys_an_architecture_does_not_read_change_nothing(config: ModelConfig) -> None:
    """Each of the keys the config's architectures ignore or read to nothing (every variant, every example:
    LLaMA's window, Qwen2's windows that never slide and its absent bias switches, and for a LLaMA without
    biases, Mistral with any attention_bias and a window at least as long as the positions) gives the config
    itself, but for the context bound such a window gives (the positions): reading one would refuse or change a
    model transformers runs as this one."""
    raw = hf_config(config)
    architectures = [raw["architectures"][0]]
    if architectures == ["LlamaForCausalLM"] and not config.qkv_bias:
        architectures.append("MistralForCausalLM")
    for architecture in architectures:
        as_it = {**raw, "architectures": [architecture]}
        for variant, bound in unread_variants(architecture, config.num_layers, raw):
            expected = config if bound is None else attrs.evolve(config, max_context_tokens=bound)
            assert model_config_from_hf({**as_it, **variant}, name=config.name) == expected, (architecture, variant)


not_counts = st.one_of(
    st.just(0),  # the edge: sizes start at 1
    st.integers(max_value=-1),
    st.floats(),  # 4.0 too: a size is an integer
    st.text(max_size=6),
    st.booleans(),
    st.lists(st.integers(1, 4), max_size=2),
)
not_numbers = st.one_of(st.text(max_size=6), st.booleans(), st.lists(st.floats(0, 1), max_size=2))
not_flags = st.one_of(
    st.text(max_size=6), st.integers(), st.floats(allow_nan=False), st.lists(st.booleans(), max_size=1)
)
CORRUPTIONS: dict[str, st.SearchStrategy[Any]] = {
    "vocab_size": not_counts | st.none(),
    "hidden_size": not_counts | st.none(),
    "num_hidden_layers": not_counts | st.none(),
    "intermediate_size": not_counts | st.none(),
    "num_attention_heads": not_counts | st.none(),
    "num_key_value_heads": not_counts,  # null is all heads
    "rms_norm_eps": not_numbers,
    "tie_word_embeddings": not_flags,
    "hidden_act": st.one_of(st.text(max_size=8), st.integers()).filter(lambda x: x not in ("silu", "swish")),
    "architectures": st.one_of(
        st.none(),
        st.text(max_size=20),
        st.lists(st.sampled_from(["LlamaForCausalLM", "GPT2LMHeadModel", "Qwen2Model", "llama"]), max_size=3).filter(
            lambda a: a not in (["LlamaForCausalLM"],)
        ),
    ),
}


@PURE
@given(relatives(), st.fixed_dictionaries(CORRUPTIONS), st.sampled_from(["config.json", "/ckpt/x.json"]))
def test_a_malformed_value_is_refused_naming_the_key_the_value_and_the_file(
    config: ModelConfig, corruptions: dict[str, Any], source: str
) -> None:
    """Any malformed value of a key every architecture reads (a size that is no positive integer, a number or
    switch of another type, another activation or architecture list), put alone in an otherwise valid config
    (one key at a time, each key every example), is one `ConfigError` line naming the file, that key and the
    value: what to fix, without guessing."""
    for key, value in corruptions.items():
        raw = {**hf_config(config), key: value}
        with pytest.raises(ConfigError) as caught:
            model_config_from_hf(raw, name="drawn", source=source)
        message = str(caught.value)
        assert one_line(message), message
        assert message.startswith(f"{source}: ") and key in message and repr(value) in message, message


@PURE
@given(relatives(), st.one_of(st.text(max_size=6), st.integers(0, 1), st.lists(st.booleans(), max_size=1)))
def test_llamas_attention_bias_switch_is_refused_unless_a_bool(config: ModelConfig, value: Any) -> None:
    """LLaMA reads `attention_bias` as a switch: anything but true, false or null (a string "false" would
    read as true) is refused naming the key and value; Mistral, which has no such switch, ignores it."""
    raw = {**hf_config(config), "architectures": ["LlamaForCausalLM"], "attention_bias": value}
    with pytest.raises(ConfigError, match="attention_bias") as caught:
        model_config_from_hf(raw, name="drawn")
    assert repr(value) in str(caught.value)
    mistral = {**raw, "architectures": ["MistralForCausalLM"], "sliding_window": None}
    assert not model_config_from_hf(mistral, name="drawn").out_bias
