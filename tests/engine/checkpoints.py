"""Small random checkpoints made with transformers, for the loader's and the tokenizer's tests.

Import it after `pytest.importorskip("transformers")`. Nothing is downloaded:
the models are built from configs and saved with `save_pretrained`, the
tokenizer is trained on local text.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a test never reaches the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import transformers

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

VOCAB = 320
SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10_000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # short, so the tests' prompts run past it
}

# The kinds of checkpoint the tests make: transformers' class and its config beyond SHAPE.
KINDS: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "llama3": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {"rope_parameters": LLAMA3_ROPE, "attention_bias": True},
    ),
    "tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"tie_word_embeddings": True}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": None}),
}


def hf_model(kind: str, *, seed: int = 0) -> Any:
    """A random transformers model of `kind`, fp32, eval mode.

    transformers initialises with std 0.02, zero biases and unit norms, which leaves
    little to compare; every parameter is redrawn at the scale of a trained model.
    """
    config_class, model_class, extra = KINDS[kind]
    config = config_class(**SHAPE, **extra)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(1 + 0.2 * torch.randn_like(parameter))
            elif name.endswith("bias"):
                parameter.copy_(0.2 * torch.randn_like(parameter))
            elif "embed_tokens" in name:  # small: a tied head at 0.5 keeps answering the last token
                parameter.copy_(0.1 * torch.randn_like(parameter))
            else:
                parameter.copy_(torch.randn_like(parameter) / parameter.shape[1] ** 0.5)
    return model


def save(model: Any, directory: Path, *, max_shard_size: str | None = None) -> Path:
    """`save_pretrained` in safetensors (sharded with an index when `max_shard_size` is small)."""
    if max_shard_size is None:
        model.save_pretrained(directory)
    else:
        model.save_pretrained(directory, max_shard_size=max_shard_size)
    return directory


def hf_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    """transformers' float32 logits [T, vocab] of one prompt."""
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float()


def hf_greedy(model: Any, tokens: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt: exactly `new_tokens` tokens (no EOS stop)."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([tokens]),
            attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(tokens) :]]
