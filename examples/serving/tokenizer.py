"""The gateway's tokenizers, one `ServingTokenizer` protocol, and text that stops at stop strings and stop ids.

`ByteTokenizer` is what the random preset model speaks: token ids 0–255 are
the bytes of the UTF-8 text (a model with a larger vocabulary may generate
ids ≥ 256, which decode to nothing), its chat template `chat_prompt`.
`CheckpointTokenizer` is a checkpoint's (`mooncake.engine.tokenizer`): its
`tokenizer.json`, its chat template and its stop ids (EOS and the generation
config's). The gateway holds the one `serving_tokenizer(config)` gives and never
asks which.

`TextStream` turns a request's tokens into the text its client may see,
decoded incrementally (whole characters only): the text ends just before the
stop string that completes first (as generation would stop there; of several
completing at the same character, the longest), or at a stop id (the token is
not shown; what was held back goes out). It holds back the longest tail of the
text that could still begin a stop string, so nothing of a stop string is ever
sent. Invariant: what it gives out depends on the text only, never on how the
text is split into pieces: it is the text cut at the first completed stop
string or stop id. Both end a generation the one way: `stopped` turns True
and the gateway cancels the decode (finish reason "stop"); `max_tokens` ends
it on the decode engine ("length").
"""

from __future__ import annotations

import codecs
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from mooncake.engine.tokenizer import Tokenizer
    from serving.config import ClusterConfig

__all__ = [
    "ByteTokenizer",
    "CheckpointTokenizer",
    "ServingTokenizer",
    "TextStream",
    "chat_prompt",
    "generation_defaults",
    "serving_tokenizer",
]


class Decoder(Protocol):
    """An incremental decoder of one generation's tokens: each push gives the text now whole."""

    def push(self, token: int) -> str: ...

    def finish(self) -> str: ...


class ServingTokenizer(Protocol):
    """What the gateway asks of a tokenizer: a prompt's ids, a chat's ids, a generation's text stream, a lone
    token's text (shown beside its log-probability), the text of ids (an echoed prompt), and the token ids that
    end a generation (the decode engine stops at them too)."""

    @property
    def stop_token_ids(self) -> frozenset[int]: ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def encode_chat(
        self,
        messages: Sequence[tuple[str, str]],
        *,
        variables: Mapping[str, Any] | None = None,
        add_special_tokens: bool = False,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]: ...

    def token_text(self, token: int) -> str: ...

    def piece(self, token: int) -> str: ...

    def decode(self, tokens: Sequence[int]) -> str: ...

    def stream(
        self,
        stop: Sequence[str] = (),
        *,
        skip_special_tokens: bool = True,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        stop_token_ids: Sequence[int] = (),
        include_stop: bool = False,
    ) -> TextStream: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids; `chat_prompt` as the chat template; no stop ids."""

    vocab_size = 256
    stop_token_ids: frozenset[int] = frozenset()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The text's bytes (there are no special tokens to add)."""
        return list(text.encode("utf-8"))

    def encode_chat(
        self,
        messages: Sequence[tuple[str, str]],
        *,
        variables: Mapping[str, Any] | None = None,
        add_special_tokens: bool = False,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """`chat_prompt`'s text as bytes (a fixed template: it has no variables to set)."""
        return self.encode(
            chat_prompt(
                messages, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message
            )
        )

    def decode(self, tokens: Sequence[int]) -> str:
        return bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", errors="replace")

    def token_text(self, token: int) -> str:
        """The lone byte's text (U+FFFD for a byte that only begins or continues a character)."""
        return self.decode([token])

    def piece(self, token: int) -> str:
        """The vocabulary's string for the byte: its text (a byte has no piece of its own)."""
        return self.token_text(token)

    def stream(
        self,
        stop: Sequence[str] = (),
        *,
        skip_special_tokens: bool = True,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        stop_token_ids: Sequence[int] = (),
        include_stop: bool = False,
    ) -> TextStream:
        """A `TextStream` decoding this tokenizer's tokens (bytes: none is special; only the request's ids stop)."""
        return TextStream(
            stop, min_tokens=min_tokens, stop_token_ids=frozenset(stop_token_ids), include_stop=include_stop
        )


class CheckpointTokenizer:
    """A checkpoint's tokenizer: prompts encoded as transformers' `tokenizer(prompt)` (BOS and all), chats
    through the checkpoint's template, text decoded without special tokens, ended at its stop ids."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self.tokenizer.special.stop_token_ids

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`, with the tokenizer's special tokens (a BOS, say) unless `add_special_tokens` is false."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode_chat(
        self,
        messages: Sequence[tuple[str, str]],
        *,
        variables: Mapping[str, Any] | None = None,
        add_special_tokens: bool = False,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """The ids of the rendered chat template, with the request's `variables` for it; the special tokens the
        tokenizer adds only with `add_special_tokens` (the template writes its own: vLLM's chat default).

        Raises:
            InvalidRequestError: the template refused the messages.
        """
        text = self.tokenizer.render_chat(
            [{"role": role, "content": content} for role, content in messages],
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **(variables or {}),
        )
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def token_text(self, token: int) -> str:
        """The lone token's text as vLLM shows it (`Tokenizer.token_text`)."""
        return self.tokenizer.token_text(token)

    def piece(self, token: int) -> str:
        """The vocabulary's string for the token (`Tokenizer.piece`: transformers' `convert_ids_to_tokens`)."""
        return self.tokenizer.piece(token)

    def decode(self, tokens: Sequence[int]) -> str:
        """The text of `tokens`, special tokens included (transformers' `decode` default, as vLLM echoes a prompt
        given as ids)."""
        return self.tokenizer.decode(tokens)

    def stream(
        self,
        stop: Sequence[str] = (),
        *,
        skip_special_tokens: bool = True,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        stop_token_ids: Sequence[int] = (),
        include_stop: bool = False,
    ) -> TextStream:
        """A `TextStream` of this tokenizer's streamed detokenization, ended at the checkpoint's stop ids (none
        with `ignore_eos`) and the request's."""
        return TextStream(
            stop,
            decoder=self.tokenizer.detokenizer(skip_special_tokens=skip_special_tokens),
            stop_ids=frozenset() if ignore_eos else self.stop_token_ids,
            min_tokens=min_tokens,
            stop_token_ids=frozenset(stop_token_ids),
            include_stop=include_stop,
        )


class _Utf8Decoder:
    """Byte tokens as UTF-8 text (ids ≥ 256 decode to nothing)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return str(self._decoder.decode(bytes((token,)) if 0 <= token < 256 else b""))

    def finish(self) -> str:
        return str(self._decoder.decode(b"", final=True))


def chat_prompt(
    messages: Sequence[tuple[str, str]], *, add_generation_prompt: bool = True, continue_final_message: bool = False
) -> str:
    """`<|role|>\\ncontent\\n` per (role, content) message, then `<|assistant|>\\n` for the reply (with
    `add_generation_prompt`); `continue_final_message`: ending right after the final message's text instead."""
    parts = [f"<|{role}|>\n{content}\n" for role, content in messages]
    if continue_final_message and parts:
        return "".join(parts)[:-1]
    return "".join(parts) + ("<|assistant|>\n" if add_generation_prompt else "")


class TextStream:
    """A request's text as its tokens arrive, ended before the first stop string to complete or at a stop id.

    `feed(token)` returns the text that may go out now; `stopped` turns True when a stop string
    appeared or a stop id came (later tokens are ignored), and `stop_reason` names the stop string, or the
    request's stop token id (None at one of the model's: vLLM's `stop_reason` for its EOS); `finish()` returns
    what was held back, at the end. Neither ends the text before its token `min_tokens` + 1 (vLLM's
    `min_tokens`: a stop string found earlier is text; the engine's sampler never draws a stop id there). The
    text ends before the stop string or the stop token's text, or after it with `include_stop` (vLLM's
    `include_stop_str_in_output`).

    Args:
        stop: the request's stop strings.
        decoder: the tokens' incremental decoder (default: UTF-8 bytes).
        stop_ids: the token ids that end the generation (the model's EOS and the like).
        min_tokens: the tokens generated before a stop may end the text.
        stop_token_ids: the request's own ids that end it (vLLM's `stop_token_ids`).
        include_stop: the stop string or stop token's text ends the text instead of being cut.
    """

    def __init__(
        self,
        stop: Sequence[str] = (),
        *,
        decoder: Decoder | None = None,
        stop_ids: frozenset[int] = frozenset(),
        min_tokens: int = 0,
        stop_token_ids: frozenset[int] = frozenset(),
        include_stop: bool = False,
    ) -> None:
        self.stop = tuple(stop)
        self.stop_ids = stop_ids
        self.min_tokens = min_tokens
        self.stop_token_ids = stop_token_ids
        self.include_stop = include_stop
        self.tokens = 0  # fed so far
        self.stopped = False
        self.stop_reason: str | int | None = None
        self._decoder: Decoder = decoder if decoder is not None else _Utf8Decoder()
        self._held = ""  # text not given out yet: a tail that may begin a stop string

    def feed(self, token: int) -> str:
        """The text token `token` completes that may be sent; at a stop id, the rest of the text."""
        if self.stopped:
            return ""
        self.tokens += 1
        if (token in self.stop_ids or token in self.stop_token_ids) and self._may_stop:
            if self.include_stop:
                self._held += self._decoder.push(token)  # the stop token's text ends the text
            text = self.finish()
            self.stopped = True
            self.stop_reason = None if token in self.stop_ids else token  # the model's EOS first, as vLLM checks
            return text
        return self._push(self._decoder.push(token))

    def feed_text(self, text: str) -> str:
        """As `feed`, for a piece of text."""
        return "" if self.stopped else self._push(text)

    def finish(self) -> str:
        """The rest of the text at the end of the generation (an incomplete character as U+FFFD)."""
        if self.stopped:
            return ""
        text = self._push(self._decoder.finish())
        if self.stopped:
            return text
        text, self._held = text + self._held, ""
        return text

    @property
    def _may_stop(self) -> bool:
        """Past `min_tokens` (vLLM checks once the tokens generated exceed it)."""
        return self.tokens > self.min_tokens or not self.min_tokens

    def _push(self, piece: str) -> str:
        if not self.stop:
            return piece
        held = self._held + piece
        # Every occurrence here ends in `piece` (the held tail holds none, or only one found before `min_tokens`
        # had passed, which stays text): the first to end stops the text.
        found = [(i + len(s), i, s) for s in self.stop if (i := held.find(s)) >= 0]
        if found and self._may_stop:
            end, start, self.stop_reason = min(found)
            self.stopped, self._held = True, ""
            return held[:end] if self.include_stop else held[:start]
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


def generation_defaults(config: ClusterConfig) -> dict[str, float]:
    """The sampling defaults of the checkpoint's `generation_config.json` (temperature, top_p, top_k, min_p, the
    penalties, max_tokens), {} for the random preset: what a request without them gets, as from vLLM
    (`mooncake.engine.tokenizer.sampling_defaults`)."""
    if config.model.checkpoint is None:
        return {}
    from mooncake.engine.tokenizer import sampling_defaults

    return sampling_defaults(config.model.checkpoint)


def serving_tokenizer(config: ClusterConfig) -> ServingTokenizer:
    """The checkpoint's tokenizer (`tokenizer.json`, its chat template and stop ids), or the random preset's bytes.

    Raises:
        ConfigError: the checkpoint's tokenizer files cannot be read (see `load_tokenizer`).
    """
    if config.model.checkpoint is None:
        return ByteTokenizer()
    from mooncake.engine.tokenizer import load_tokenizer

    return CheckpointTokenizer(load_tokenizer(config.model.checkpoint))
