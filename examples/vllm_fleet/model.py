"""A small model directory vLLM can serve on a CPU, made locally (nothing downloaded).

    python examples/vllm_fleet/model.py DIR

A `LlamaForCausalLM` with random weights (2 layers, hidden 256, 4 heads of 64: vLLM's CPU attention
needs a head size it has kernels for) saved by transformers in safetensors, and a byte-level BPE
tokenizer trained with `tokenizers` on words drawn from a seeded generator, wrapped as
`PreTrainedTokenizerFast` with BOS, EOS and a ChatML `chat_template` (`/v1/chat/completions` needs
one). The same seed gives the same files. `words(n, seed=...)` draws text from the same vocabulary,
so prompts tokenize into a few tokens per word.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["CHATML", "make_model", "make_tokenizer", "words"]

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
VOCAB_SIZE = 1024
MAX_CONTEXT = 2048


def words(count: int, *, seed: int) -> str:
    """`count` words of two or three syllables, space-separated, drawn from a generator seeded `seed`."""
    rng = random.Random(seed)
    return " ".join("".join(rng.choices(SYLLABLES, k=rng.choice((2, 3)))) for _ in range(count))


def make_tokenizer(
    directory: Path, *, seed: int = 0, corpus: Sequence[str] | None = None, vocab_size: int = VOCAB_SIZE
) -> Any:
    """Write the tokenizer files into `directory` (created); returns transformers' tokenizer of them.

    The BPE is trained on `corpus` (default: words drawn with `seed`) up to `vocab_size` ids."""
    import transformers
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors, trainers
    from tokenizers.models import BPE

    directory.mkdir(parents=True, exist_ok=True)
    backend = Tokenizer(BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    texts = corpus if corpus is not None else [words(200, seed=seed + i) for i in range(200)]
    backend.train_from_iterator(texts, trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", backend.token_to_id("<s>"))]
    )
    tokenizer: Any = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=CHATML,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.save_pretrained(directory)
    return tokenizer


def make_model(directory: Path, *, seed: int = 0) -> Path:
    """Write the model and its tokenizer into `directory` (created); returns it."""
    import torch
    import transformers

    tokenizer = make_tokenizer(directory, seed=seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=MAX_CONTEXT,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make_model(args.directory, seed=args.seed))


if __name__ == "__main__":
    main()
