"""The real engines (the only torch users): model, checkpoints and tokenizers, attention, KV pages, prefill, decode, pipeline.

Every public name is listed here, but loaded on first use (`from
mooncake.engine import PrefillEngine` imports torch then): `import
mooncake.engine` imports nothing heavy, and `mooncake.engine.config` (the
model presets) needs no torch at all. A name whose module needs a missing
extra's package raises a `ConfigError` naming the package and the extra
(`from mooncake.engine import LlamaModel` without torch: the engine extra).
"""

from __future__ import annotations

import importlib
from typing import Any

from mooncake._checks import shown
from mooncake._extras import needs_extra

_HOMES = {
    "DTYPE_BYTES": "config",
    "DecodeConfig": "decode",
    "DecodeEngine": "decode",
    "KvLayout": "kv",
    "ForwardPass": "prefill",
    "KvSink": "prefill",
    "LayerwiseKvIo": "layerwise",
    "LlamaModel": "model",
    "MessengerSink": "prefill",
    "ModelForward": "prefill",
    "ModelConfig": "config",
    "PRESETS": "config",
    "PipelineGroup": "pipeline",
    "PrefillConfig": "prefill",
    "PrefillEngine": "prefill",
    "PrefillResult": "prefill",
    "Sampler": "sampling",
    "SamplingParams": "sampling",
    "TokenLogprobs": "logprobs",
    "TokenEvent": "decode",
    "TokenStream": "decode",
    "RopeScaling": "config",
    "SafetensorsWeights": "checkpoint",
    "WeightSource": "model",
    "load_model": "checkpoint",
    "read_model_config": "checkpoint",
    "Detokenizer": "tokenizer",
    "SpecialTokens": "tokenizer",
    "Tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'mooncake.engine' has no attribute {shown(name)}")
    with needs_extra(f"mooncake.engine.{name}"):
        module = importlib.import_module(f"mooncake.engine.{home}")
    return getattr(module, name)


def __dir__() -> list[str]:
    """The module's names with the lazy ones (`__all__`), for completion and `dir()`: they are attributes too."""
    return sorted({*globals(), *__all__})
