"""A deterministic byte-level tokenizer, a simple chat template (no model hub) and text that stops at stop strings.

Token ids 0–255 are the bytes of the UTF-8 text; a model with a larger
vocabulary may generate ids ≥ 256, which decode to nothing. Decoding is
incremental, so a multi-byte character split across tokens streams whole.

`TextStream` turns a request's tokens into the text its client may see: the
text ends just before the stop string that completes first (as generation
would stop there; of several completing at the same character, the longest).
It holds back the longest tail of the text that could still begin a stop
string, so nothing of a stop string is ever sent. Invariant: what it gives out
depends on the text only, never on how the text is split into pieces: it is the
text cut at the first completed stop string.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

__all__ = ["ByteTokenizer", "TextStream", "chat_prompt"]


class ByteTokenizer:
    """UTF-8 bytes as token ids."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: Sequence[int]) -> str:
        return bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", errors="replace")

    def stream(self, stop: Sequence[str] = ()) -> TextStream:
        """A `TextStream` decoding this tokenizer's tokens."""
        return TextStream(stop)


def chat_prompt(messages: Sequence[tuple[str, str]]) -> str:
    """`<|role|>\\ncontent\\n` per (role, content) message, then `<|assistant|>\\n` for the reply."""
    parts = [f"<|{role}|>\n{content}\n" for role, content in messages]
    return "".join(parts) + "<|assistant|>\n"


class TextStream:
    """A request's text as its tokens arrive, ended before the first stop string to complete.

    `feed(token)` returns the text that may go out now; `stopped` turns True when a stop string
    appeared (later tokens are ignored); `finish()` returns what was held back, at the end.
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self.stop = tuple(stop)
        self.stopped = False
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""  # text not given out yet: a tail that may begin a stop string

    def feed(self, token: int) -> str:
        """The text token `token` completes that may be sent (tokens ≥ 256 decode to nothing)."""
        if self.stopped:
            return ""
        return self._push(self._decoder.decode(bytes((token,)) if 0 <= token < 256 else b""))

    def feed_text(self, text: str) -> str:
        """As `feed`, for a piece of text."""
        return "" if self.stopped else self._push(text)

    def finish(self) -> str:
        """The rest of the text at the end of the generation (an incomplete character as U+FFFD)."""
        if self.stopped:
            return ""
        text = self._push(self._decoder.decode(b"", final=True))
        if self.stopped:
            return text
        text, self._held = text + self._held, ""
        return text

    def _push(self, piece: str) -> str:
        if not self.stop:
            return piece
        held = self._held + piece
        # Every occurrence here ends in `piece` (the held tail holds none): the first to end stops the text.
        found = [(i + len(s), i) for s in self.stop if (i := held.find(s)) >= 0]
        if found:
            self.stopped, self._held = True, ""
            return held[: min(found)[1]]
        keep = self._open_tail(held)
        self._held = held[len(held) - keep :]
        return held[: len(held) - keep]

    def _open_tail(self, text: str) -> int:
        """The length of the longest tail of `text` that is a proper prefix of a stop string."""
        for length in range(min(len(text), max(map(len, self.stop)) - 1), 0, -1):
            tail = text[-length:]
            if any(s.startswith(tail) for s in self.stop):
                return length
        return 0
