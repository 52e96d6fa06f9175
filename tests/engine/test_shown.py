"""The engine's public entry points quote what they were given through `_checks.shown`: however large or long.

As `tests/test_shown_everywhere.py` holds the torch-free modules to it: Python refuses to repr (or str) an integer
past 4,300 digits, so a message that quoted one with `!r` or an f-string escaped as a bare ValueError ("Exceeds the
limit (4300 digits) ..."), not the named error; a 500-character string was printed whole. Each entry below, given
such a value, raises its own `MooncakeError` with a message of at most `BOUND` characters. No entry builds a model
but the one shared tiny model a decode engine needs, so the file stays fast.
"""

from __future__ import annotations

import functools
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from mooncake.engine.checkpoint import checkpoint_tensors, model_config_from_hf
from mooncake.engine.config import ModelConfig, RopeScaling, check_dtype
from mooncake.engine.decode import DecodeEngine
from mooncake.engine.kv import KvLayout
from mooncake.engine.model import LlamaModel, dtype_of, token_ids
from mooncake.engine.pipeline import PipelineGroup
from mooncake.engine.sampling import SamplingParams
from mooncake.engine.tokenizer import sampling_defaults
from mooncake.errors import ConfigError, InvalidRequestError, MooncakeError
from mooncake.types import RequestId, as_token_array
from tests.engine.support import TINY, dram_cache, tiny_model
from tests.shown_cases import ALL, HUGE, NEGATIVE, TEXT, entry_params, refused_briefly

HF = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


def hf(**changes: Any) -> ModelConfig:
    return model_config_from_hf({**HF, **changes}, name="m")


def model_config(**changes: Any) -> ModelConfig:
    fields = {"vocab_size": 8, "hidden_size": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}
    return ModelConfig(name="x", **{**fields, "intermediate_size": 8, **changes})


def generation_defaults(**values: Any) -> dict[str, float]:
    """`sampling_defaults` of a directory whose generation_config.json holds `values` (JSON holds no 10**5000)."""
    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "generation_config.json").write_text(json.dumps(values))
        return sampling_defaults(directory)


@functools.cache
def decode_engine() -> DecodeEngine:
    """One engine over the shared tiny model: every entry below is refused before it changes anything."""
    return DecodeEngine(tiny_model(), dram_cache(4), block_tokens=4)


def join(**changes: Any) -> object:
    given = {"request_id": RequestId("r"), "keys": (1,), "prompt_tokens": 4, "first_token": 1, "max_new_tokens": 2}
    fields = given | changes
    return decode_engine().try_join(fields.pop("request_id"), fields.pop("keys"), **fields)


# (id, call, the error it names, the values it refuses)
ENTRIES: list[tuple[str, Callable[[Any], object], type[MooncakeError], tuple[Any, ...]]] = [
    # config
    ("RopeScaling.kind", lambda v: RopeScaling(kind=v, factor=2.0), ConfigError, ALL),
    ("ModelConfig.hidden_size", lambda v: model_config(hidden_size=v), ConfigError, ALL),
    ("ModelConfig.num_heads", lambda v: model_config(num_heads=v), ConfigError, ALL),
    ("ModelConfig.num_kv_heads", lambda v: model_config(num_kv_heads=v), ConfigError, ALL),
    ("ModelConfig.vocab_size", lambda v: model_config(vocab_size=v), ConfigError, ALL),
    ("ModelConfig.shape", TINY.shape, ConfigError, ALL),
    ("check_dtype", check_dtype, ConfigError, ALL),
    (
        "ModelConfig.check_context_tokens",
        lambda v: model_config(max_context_tokens=5).check_context_tokens(v),
        InvalidRequestError,
        (HUGE,),
    ),
    # checkpoint: each config.json key the reader quotes
    *(
        (f"model_config_from_hf {key}", functools.partial(lambda key, v: hf(**{key: v}), key), ConfigError, ALL)
        for key in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "vocab_size",
            "rms_norm_eps",
            "rope_theta",
            "hidden_act",
            "attention_bias",
            "mlp_bias",
            "tie_word_embeddings",
            "rope_scaling",
            "partial_rotary_factor",
            "head_dim",
        )
    ),
    (  # no upper bound: only the context it allows is compared against
        "model_config_from_hf max_position_embeddings",
        lambda v: hf(max_position_embeddings=v),
        ConfigError,
        (NEGATIVE, TEXT),
    ),
    ("model_config_from_hf architectures", lambda v: hf(architectures=[v]), ConfigError, ALL),
    ("model_config_from_hf rope_type", lambda v: hf(rope_scaling={"rope_type": v}), ConfigError, ALL),
    (
        "model_config_from_hf linear factor",
        lambda v: hf(rope_scaling={"rope_type": "linear", "factor": v}),
        ConfigError,
        ALL,
    ),
    (
        "model_config_from_hf rope_parameters partial_rotary_factor",
        lambda v: hf(rope_parameters={"partial_rotary_factor": v}),
        ConfigError,
        ALL,
    ),
    (
        "model_config_from_hf qwen2 layer_types",
        lambda v: hf(architectures=["Qwen2ForCausalLM"], layer_types=v),
        ConfigError,
        ALL,
    ),
    (
        "model_config_from_hf qwen2 max_window_layers",
        lambda v: hf(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, max_window_layers=v),
        ConfigError,
        (NEGATIVE, TEXT),
    ),
    (
        "model_config_from_hf mistral sliding_window",
        lambda v: hf(architectures=["MistralForCausalLM"], sliding_window=v),
        ConfigError,
        (NEGATIVE, TEXT),
    ),
    ("checkpoint_tensors", functools.partial(checkpoint_tensors, TINY), ConfigError, ALL),
    (
        "checkpoint_tensors layer index",
        lambda v: checkpoint_tensors(TINY, f"layers.{'1' * 5000 if v is HUGE else v}.qkv"),
        ConfigError,
        (HUGE, TEXT),
    ),
    # model
    ("dtype_of", dtype_of, ConfigError, ALL),
    ("LlamaModel dtype", lambda v: LlamaModel(TINY, dtype=v), ConfigError, ALL),
    ("LlamaModel layers", lambda v: LlamaModel(TINY, layers=[v]), ConfigError, ALL),
    ("LlamaModel seed", lambda v: LlamaModel(TINY, seed=v), ConfigError, (NEGATIVE, TEXT)),
    ("token_ids", lambda v: token_ids([v], TINY.vocab_size), InvalidRequestError, ALL),
    ("as_token_array", lambda v: as_token_array([0, v]), InvalidRequestError, ALL),
    # kv
    ("KvLayout.config", lambda v: KvLayout(config=v, block_tokens=4), ConfigError, ALL),
    ("KvLayout.block_tokens", lambda v: KvLayout(config=TINY, block_tokens=v), ConfigError, (NEGATIVE, TEXT)),
    ("KvLayout.dtype", lambda v: KvLayout(config=TINY, block_tokens=4, dtype=v), ConfigError, ALL),
    ("KvLayout.tokens_in", lambda v: KvLayout(config=TINY, block_tokens=4).tokens_in(v), ConfigError, ALL),
    # sampling
    *(
        (
            f"SamplingParams.{field}",
            functools.partial(lambda field, v: SamplingParams(**{field: v}), field),
            ConfigError,
            values,
        )
        for field, values in (
            ("temperature", ALL),
            ("top_p", ALL),
            ("seed", ALL),
            ("min_p", ALL),
            ("repetition_penalty", ALL),
            ("presence_penalty", ALL),
            ("frequency_penalty", ALL),
            # counts with no upper bound: 10**5000 is taken
            ("min_tokens", (NEGATIVE, TEXT)),
            ("logprobs", (NEGATIVE, TEXT)),
            ("top_k", (NEGATIVE, TEXT)),
            ("prompt_logprobs", (NEGATIVE, TEXT)),
        )
    ),
    ("SamplingParams.stop_token_ids", lambda v: SamplingParams(stop_token_ids=[v]), ConfigError, (NEGATIVE, TEXT)),
    ("SamplingParams.logit_bias", lambda v: SamplingParams(logit_bias={v: 1.0}), ConfigError, (NEGATIVE, TEXT)),
    # tokenizer (a JSON file holds no 10**5000: a long string stands for every value)
    *(
        (
            f"sampling_defaults {key}",
            functools.partial(lambda key, v: generation_defaults(**{key: v}), key),
            ConfigError,
            (TEXT,),
        )
        for key in ("temperature", "top_k", "max_new_tokens")
    ),
    # decode
    ("DecodeEngine.try_join first_token", lambda v: join(first_token=v), InvalidRequestError, ALL),
    ("DecodeEngine.try_join keys", lambda v: join(keys=v), InvalidRequestError, ALL),
    ("DecodeEngine.try_join sampling", lambda v: join(sampling=v), InvalidRequestError, ALL),
    ("DecodeEngine.try_join on_token", lambda v: join(on_token=v), InvalidRequestError, ALL),
    ("DecodeEngine.try_join first_logprobs", lambda v: join(first_logprobs=v), InvalidRequestError, ALL),
    # pipeline (refused before any stage process starts)
    ("PipelineGroup device", lambda v: PipelineGroup(TINY, num_stages=1, device=v), ConfigError, ALL),
]


@pytest.mark.parametrize(("call", "error", "value"), entry_params(ENTRIES))
def test_a_huge_or_long_value_is_the_named_error_in_a_short_message(
    call: Callable[[Any], object], error: type[MooncakeError], value: Any
) -> None:
    """10**5000 and -10**5000 (whose repr and str Python refuses) and a 500-character string: each is the entry's
    own error (a `MooncakeError`), its message at most `BOUND` characters, the value shown cut or named by size."""
    refused_briefly(lambda: call(value), error)
