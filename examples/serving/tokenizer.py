"""The gateway's tokenizers, one `ServingTokenizer` protocol, and text that stops at stop strings and stop ids.

`ByteTokenizer` is what the random preset model speaks: token ids 0–255 are
the bytes of the UTF-8 text (a model with a larger vocabulary may generate
ids ≥ 256, which decode to nothing), its chat template `chat_prompt`.
`CheckpointTokenizer` is a checkpoint's (`mooncake.engine.tokenizer`): its
`tokenizer.json`, its chat template and its stop ids (EOS and the generation
config's). The gateway holds the one `serving_tokenizer(config)` gives and never
asks which.

`fewest_tokens(text)` is a lower bound of a text's tokens that costs no
tokenizing (a BPE takes seconds over megabytes): the gateway refuses a prompt
that certainly exceeds its limit before tokenizing it. Bytes: the count itself.
A checkpoint's: a token stands for at most its vocabulary string's characters of
the text, so a text of c characters has at least c / (the longest string)
tokens, where its `tokenizer.json` proves that no character is dropped or
merged away (`_text_floor` states the conditions); 0 (no bound) otherwise.

`TextStream` turns a request's tokens into the text its client may see,
decoded incrementally (whole characters only): the text ends just before the
stop string that completes first (as generation would stop there; of several
completing at the same character, the first the request lists, as vLLM's
`check_stop_strings` takes them), or at a stop id (the token is not shown; what
was held back goes out). It holds back the longest tail of the text that could
still begin a stop string, so nothing of a stop string is ever sent. A
generation that ends inside a character ends with the character before it: the
incomplete bytes are dropped, never shown as U+FFFD (vLLM's output is what its
stream emitted). Invariant: what it gives out depends on the text only, never
on how the text is split into pieces: it is the text cut at the first completed
stop string or stop id, less an incomplete character at its end. Both end a
generation the one way: `stopped` turns True and the gateway cancels the
decode (finish reason "stop"); `max_tokens` ends it on the decode engine
("length").
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from mooncake.engine.chat import chat_conversation
from mooncake.engine.logprobs import completed_text
from mooncake.engine.tokenizer import can_stop_at, load_tokenizer, sampling_defaults

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
    """An incremental decoder of one generation's tokens: each push gives the text now whole; `finish` what is
    left at the end ("" where all that is left is an incomplete character, which is dropped)."""

    def push(self, token: int) -> str: ...

    def finish(self) -> str: ...


class ServingTokenizer(Protocol):
    """What the gateway asks of a tokenizer: a prompt's ids, a chat's prompt text (of its messages as the client sent
    them, read as vLLM reads them: `chat_conversation`; its ids are that text's), a
    lower bound of a text's tokens, a generation's text stream (after its prompt's ids), a lone token's text
    (shown beside its log-probability), the text of ids (an echoed prompt, /detokenize), and the token ids that
    end a generation (the decode engine stops at them too)."""

    @property
    def stop_token_ids(self) -> frozenset[int]: ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        variables: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str: ...

    def fewest_tokens(self, text: str) -> int: ...

    def token_text(self, token: int, *, context: Sequence[int] = ()) -> str: ...

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
        prompt: Sequence[int] = (),
    ) -> TextStream: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids; `chat_prompt` as the chat template; no stop ids."""

    vocab_size = 256
    stop_token_ids: frozenset[int] = frozenset()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The text's bytes (there are no special tokens to add)."""
        return list(text.encode("utf-8"))

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        variables: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """`chat_prompt`'s text (a fixed template: it has no variables to set) of the messages as vLLM reads them
        (`chat_conversation`: a content's text parts joined by newlines, null as "").

        Raises:
            InvalidRequestError: `chat_conversation` refused the messages (a content that is no text).
        """
        chat = chat_conversation(messages)
        return chat_prompt(
            [(m["role"], m["content"]) for m in chat],
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )

    def fewest_tokens(self, text: str) -> int:
        """The tokens `encode(text)` gives, exactly (one a byte), counted without making them."""
        return len(text.encode("utf-8"))

    def decode(self, tokens: Sequence[int]) -> str:
        return bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", errors="replace")

    def token_text(self, token: int, *, context: Sequence[int] = ()) -> str:
        """The lone byte's text; a byte of a character completed after `context` (the tokens sampled before it), as
        vLLM completes one (`completed_text`: "" until the character's last byte, which shows it whole)."""
        return completed_text(self.decode([token]), token, context, self.decode)

    def piece(self, token: int) -> str:
        """The vocabulary's string for the byte: its text (a byte has no piece of its own; U+FFFD for one that
        only begins or continues a character)."""
        return self.decode([token])

    def stream(
        self,
        stop: Sequence[str] = (),
        *,
        skip_special_tokens: bool = True,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        stop_token_ids: Sequence[int] = (),
        include_stop: bool = False,
        prompt: Sequence[int] = (),
    ) -> TextStream:
        """A `TextStream` decoding this tokenizer's tokens (bytes: none is special; only the request's ids stop; a
        byte's text needs no `prompt` before it)."""
        return TextStream(
            stop, min_tokens=min_tokens, stop_token_ids=frozenset(stop_token_ids), include_stop=include_stop
        )


class CheckpointTokenizer:
    """A checkpoint's tokenizer: prompts encoded as transformers' `tokenizer(prompt)` (BOS and all), chats
    through the checkpoint's template, text decoded without special tokens, ended at its stop ids."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        try:
            spec = json.loads(tokenizer.backend.to_str())
        except Exception:  # a component tokenizers cannot write out (a custom one): no bound, nothing refused early
            spec = {}
        normalizer = tokenizer.backend.normalizer
        self._floor = _text_floor(spec, normalizer.normalize_str if normalizer is not None else None)

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self.tokenizer.special.stop_token_ids

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`, with the tokenizer's special tokens (a BOS, say) unless `add_special_tokens` is false
        (`Tokenizer.encode`, which lets go of the GIL: the seconds a long prompt takes do not stall the gateway's
        event loop while a thread of its own tokenizes)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        variables: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """The chat template rendered with the request's `variables` for it: the prompt text, whose ids `encode`
        gives (with `add_special_tokens` false by vLLM's chat default: the template writes its own). `messages` are
        the objects the client sent; `Tokenizer.render_chat` reads them as vLLM does (`chat_conversation`), as the
        vLLM router renders them.

        Raises:
            InvalidRequestError: the template refused the messages.
        """
        return self.tokenizer.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **(variables or {}),
        )

    def fewest_tokens(self, text: str) -> int:
        """A lower bound of `len(encode(text, add_special_tokens=False))`, computed without tokenizing (`_text_floor`:
        the characters that count over the longest vocabulary string); 0 where the tokenizer's pipeline proves
        none."""
        if self._floor is None:
            return 0
        longest, ascii_only = self._floor
        counted = len(text) if not ascii_only or text.isascii() else len(text.encode("ascii", "ignore"))
        return -(-counted // longest)

    def token_text(self, token: int, *, context: Sequence[int] = ()) -> str:
        """The lone token's text as vLLM shows it, after `context` (the tokens sampled before it: a byte of a
        character shows "" until the last, `Tokenizer.token_text`)."""
        return self.tokenizer.token_text(token, context=context)

    def piece(self, token: int) -> str:
        """The vocabulary's string for the token (`Tokenizer.piece`: transformers' `convert_ids_to_tokens`)."""
        return self.tokenizer.piece(token)

    def decode(self, tokens: Sequence[int]) -> str:
        """The text of `tokens`, special tokens included (transformers' `decode` default, as vLLM echoes a prompt
        given as ids; `Tokenizer.decode`, which lets go of the GIL as `encode` does)."""
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
        prompt: Sequence[int] = (),
    ) -> TextStream:
        """A `TextStream` of this tokenizer's streamed detokenization after `prompt` (the request's ids: its
        tail is the context of the first token's text, as vLLM's stream starts from the prompt: a SentencePiece
        "▁Hello" streams as " Hello"), ended at the checkpoint's stop ids (none with `ignore_eos`) and the
        request's."""
        return TextStream(
            stop,
            decoder=self.tokenizer.detokenizer(skip_special_tokens=skip_special_tokens, prompt=prompt),
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
        """Nothing: an incomplete character at the end is dropped, as a checkpoint's stream drops one (vLLM's)."""
        self._decoder.reset()
        return ""


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
    what was held back, at the end. A stop id ends the text from token `min_tokens` on (`can_stop_at`, the decode
    engine's rule, vLLM's `check_stop`: the sampler holds stop ids back before that unless nothing else may be
    drawn, and one drawn earlier is text); a stop string from token `min_tokens` + 1 on (vLLM's detokenizer
    checks strings only past `min_tokens` tokens: one found earlier is text). A stop string counts as vLLM's
    `check_stop_strings` counts one: only where it ends in the text a token (or piece) just added, so one
    completed within the first `min_tokens` tokens never ends the text later, even inside a longer stop string;
    of several ending in the same new text, the first to end, and of those the first listed.
    The text ends before the stop string or the stop token's text, or after it with `include_stop` (vLLM's
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
        """The text token `token` completes that may be sent; at a stop id, the rest of the text (less an
        incomplete character, `finish`)."""
        if self.stopped:
            return ""
        self.tokens += 1
        if (token in self.stop_ids or token in self.stop_token_ids) and can_stop_at(self.tokens, self.min_tokens):
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
        """The rest of the text at the end of the generation: what was held back for a stop string; an incomplete
        character at the end is dropped (the decoder's `finish` gives nothing of it), as vLLM's output ends with
        the last whole character its stream emitted."""
        if self.stopped:
            return ""
        text = self._push(self._decoder.finish())
        if self.stopped:
            return text
        text, self._held = text + self._held, ""
        return text

    @property
    def _may_stop(self) -> bool:
        """Whether a stop string may end the text: past `min_tokens` (vLLM's detokenizer checks strings once the
        tokens generated exceed it)."""
        return self.tokens > self.min_tokens or not self.min_tokens

    def _push(self, piece: str) -> str:
        if not self.stop:
            return piece
        held = self._held + piece
        # Only an occurrence ending in `piece`: the held tail may hold one completed before `min_tokens` had passed,
        # which stays text (vLLM searches from where the new text's first character could close a stop string).
        found = []
        for rank, stop in enumerate(self.stop):
            start = held.find(stop, max(0, len(self._held) - len(stop) + 1))
            if start >= 0:
                found.append((start + len(stop), rank, start, stop))
        if found and self._may_stop:
            end, _rank, start, self.stop_reason = min(found)
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


# The normalizers and pre-tokenizers of a tokenizer.json that keep every character of the text: each maps a character
# to one or more and adds, never drops one or merges two.
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation"})


def _text_floor(spec: Mapping[str, Any], normalize: Callable[[str], str] | None = None) -> tuple[int, bool] | None:
    """How a text's tokens are bounded below, from its tokenizer.json (`spec`): (the longest vocabulary string's
    characters, whether only the text's ASCII characters count), or None where the pipeline proves no bound.

    The bound: every character that counts becomes at least one character of the pieces the model covers with
    tokens, and a token covers at most its own string's characters (a byte-level token one character a byte, a
    byte-fallback token `<0x41>` one byte); so a text has at least (characters that count) / (longest string)
    tokens. It holds where:
    - no normalizer, or only `Prepend` and `Replace` of one character by a non-empty string (each character stays
      one or more), or `NFC` before any `Replace`: NFC may merge a letter and its combining marks into one
      character (a text's length may shrink), but never an ASCII character into another one, so then only the
      ASCII characters count;
    - pre-tokenizers that split but never remove (`_KEEPING_PRE_TOKENIZERS`, `Split` and `Punctuation` unless
      their behaviour is `Removed`: `Whitespace`, `BertPreTokenizer` and the like drop spaces);
    - a BPE model that never drops a character nor covers a run of them with one token: byte-level (the last
      pre-tokenizer, every byte's character in the vocabulary), byte fallback (every `<0xNN>` in it), or an
      unknown token per unknown character (`fuse_unk` false);
    - no added token that strips the spaces beside it (`lstrip`, `rstrip`: a run of any length), no truncation.
    An added token marked `normalized` is matched in the normalized text, as its content normalized (`normalize`,
    the tokenizer's normalizer: a `Prepend` or a lengthening `Replace` makes it longer), so it counts at that
    length.
    """
    if spec.get("truncation") is not None:
        return None
    ascii_only = False
    normalizer = spec.get("normalizer")
    steps = (
        []
        if normalizer is None
        else normalizer.get("normalizers", [])
        if normalizer.get("type") == "Sequence"
        else [normalizer]
    )
    replaced = False
    for step in steps:
        kind = step.get("type")
        if kind == "NFC" and not replaced:
            ascii_only = True
        elif kind == "Replace" and len(step.get("pattern", {}).get("String") or "") == 1 and step.get("content"):
            replaced = True
        elif kind != "Prepend":
            return None
    pre = spec.get("pre_tokenizer")
    pres = [] if pre is None else pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if any(p.get("type") not in _KEEPING_PRE_TOKENIZERS or p.get("behavior") == "Removed" for p in pres):
        return None
    model = spec.get("model") or {}
    vocab = model.get("vocab")
    if model.get("type") != "BPE" or not isinstance(vocab, Mapping):
        return None
    from tokenizers.pre_tokenizers import ByteLevel

    byte_level = bool(pres) and pres[-1].get("type") == "ByteLevel" and all(c in vocab for c in ByteLevel.alphabet())
    fallback = bool(model.get("byte_fallback")) and all(f"<0x{b:02X}>" in vocab for b in range(256))
    unknown = model.get("unk_token") in vocab and not model.get("fuse_unk")
    if not (byte_level or fallback or unknown):
        return None
    added = spec.get("added_tokens") or []
    if any(token.get("lstrip") or token.get("rstrip") for token in added):
        return None
    longest = max([*map(len, vocab), *(_added_length(token, normalize) for token in added)], default=0)
    return (longest, ascii_only) if longest > 0 else None


def _added_length(token: Mapping[str, Any], normalize: Callable[[str], str] | None) -> int:
    """The most characters of the text an added token covers: its content's, or a normalized one's normalized."""
    content = str(token.get("content", ""))
    if token.get("normalized") and normalize is not None:
        return max(len(content), len(normalize(content)))
    return len(content)


def generation_defaults(config: ClusterConfig) -> dict[str, float]:
    """The sampling defaults of the checkpoint's `generation_config.json` (temperature, top_p, top_k, min_p,
    repetition_penalty, max_tokens), {} for the random preset: what a request without them gets, as from vLLM
    (`mooncake.engine.tokenizer.sampling_defaults`)."""
    if config.model.checkpoint is None:
        return {}
    return sampling_defaults(config.model.checkpoint)


def serving_tokenizer(config: ClusterConfig) -> ServingTokenizer:
    """The checkpoint's tokenizer (`tokenizer.json`, its chat template and stop ids), or the random preset's bytes.

    Raises:
        ConfigError: the checkpoint's tokenizer files cannot be read (see `load_tokenizer`).
    """
    if config.model.checkpoint is None:
        return ByteTokenizer()
    return CheckpointTokenizer(load_tokenizer(config.model.checkpoint))
