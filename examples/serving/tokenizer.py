"""A deterministic byte-level tokenizer and a simple chat template (no model hub).

Token ids 0–255 are the bytes of the UTF-8 text; a model with a larger
vocabulary may generate ids ≥ 256, which decode to nothing. Decoding is
incremental, so a multi-byte character split across tokens streams whole.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any

__all__ = ["ByteTokenizer", "chat_prompt"]


class ByteTokenizer:
    """UTF-8 bytes as token ids."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: Sequence[int]) -> str:
        return bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", errors="replace")

    def stream_decoder(self) -> Any:
        """An incremental decoder: `.decode(bytes([t]))` returns the text completed by token t."""
        return codecs.getincrementaldecoder("utf-8")(errors="replace")


def chat_prompt(messages: Sequence[dict[str, str]]) -> str:
    """`<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n` for the reply."""
    parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    return "".join(parts) + "<|assistant|>\n"
