"""A checkpoint's tokenizer: `tokenizer.json`, its special tokens, streamed detokenization and its chat template.

`load_tokenizer(directory)` reads what transformers reads from a Hugging Face
checkpoint: `tokenizer.json` (through `tokenizers`), the special tokens of
`tokenizer_config.json` (BOS, EOS, UNK, SEP, PAD, CLS and MASK, transformers' named special tokens; a string or
an AddedToken object),
the stop ids of `generation_config.json` (or `config.json`) and the chat
template (`chat_template.jinja`, else the `chat_template` field). `encode` and
`decode` are transformers' (v5) for the same files; the example cluster's byte
tokenizer stays what the random model speaks.

transformers v5 does not always take a `tokenizer.json` as written. Its
`AutoTokenizer` picks a class by config.json's `model_type` and the declared
`tokenizer_class` (`_transformers_class` states the rule: a Qwen2 model's is
always `Qwen2Tokenizer`, a Mistral model's the file as written, a byte-level
file declared `LlamaTokenizer` as written), and three classes keep only the
file's vocabulary, merges and post-processor and rebuild the rest, with their
own default special tokens:
- `LlamaTokenizer` (Llama 2, TinyLlama): BPE with byte fallback, no normalizer,
  a Metaspace pre-tokenizer that prepends "▁" to the first piece only (to every
  piece with `legacy: true`, to none with `add_prefix_space: false`) and the
  SentencePiece decoder; without it, text after a special token (a chat
  template's `</s>\n<|assistant|>`) would get an extra "▁" token;
- `Qwen2Tokenizer` (Qwen2, DeepSeek-R1-Distill-Qwen): NFC, Qwen's split
  pattern, then byte-level;
- `GPT2Tokenizer` (SmolLM2): byte-level with GPT-2's split;
- `CodeLlamaTokenizer`: Llama's, "▁" before the first piece whatever `legacy`
  says, and its infilling tokens (`▁<PRE>`, ..., `<FILL_ME>`) made special.
Then the added tokens of `added_tokens_decoder`. Whatever the class, the named
special tokens missing from the added tokens become special ones, in transformers' order (BOS, EOS, UNK, SEP,
PAD, CLS, MASK), then those of `extra_special_tokens` (`additional_special_tokens`, its older name), as
transformers adds every one of its `all_special_tokens` (`_extra_special` states which lists count), so a new
one gets the id transformers gives it (an added token that is not special stays so). The BOS and EOS an
encoding gets are the file's post-processor's: transformers (5.25) does not apply `add_bos_token` or
`add_eos_token`, with or without one. So does `load_tokenizer`.

Streaming (`Detokenizer`): a generated token may be half a UTF-8 character
(byte-level BPE), and some decoders change a token's text by what precedes it
(a leading space stripped only at the start). So each step decodes a window:
the tokens since `prefix` (already emitted, kept as context) and the tokens
since `read` (not yet emitted); the new text is the window's decode minus the
decode of its context, and it is emitted only when it grew and does not end in
U+FFFD (an incomplete character). `finish()` emits nothing: what is still held
at the end is an incomplete character (with any text of its tokens before it),
dropped as vLLM drops it (its output is what its stream emitted). A stream
starts with the prompt's tail as its context (`detokenizer(prompt=...)`), never
emitted, as vLLM seeds its stream with the prompt's ids: so the first generated
piece decodes as it does after the prompt (a SentencePiece "▁Hello" as
" Hello", where a decode that starts with it strips the space). The tail is the
prompt from its last `CONTEXT_TOKENS` tokens that are not special (those a
decode may skip), so a stream's first step costs the same whatever the
prompt's length; the whole prompt where the tail's decode ends in U+FFFD (a
run of fallback bytes the tail cuts), and no context where the whole prompt's
does too (the prompt ends inside a character: vLLM's stream would emit the
prompt's text then).

Invariants: the pieces a `Detokenizer` emits join to `decode` of its context and
its tokens up to `read`, less `decode` of its context; the tokens after `read`
(an incomplete character) are never emitted; while every token completes what
came before, no piece holds U+FFFD. One exception: a byte-fallback decoder
(`<0xE6>` tokens) shows a run of byte tokens that is not valid UTF-8 as one
U+FFFD per byte, also the bytes of characters in it that were already emitted
whole. The stream keeps what it emitted and goes on following `decode`: a stray
byte after "日", then " He", streams as "日" and then 3 × U+FFFD + " He" (where
`decode` gives 4 × U+FFFD). tokenizers' `DecodeStream` raises there instead, and
vLLM starts a fresh stream at the token that raised ("日" then "He": the run's
U+FFFD and the space are lost); this does not follow it.

The chat template is rendered the way transformers renders it: jinja2's
immutable sandbox with `trim_blocks` and `lstrip_blocks`, loop controls, a
`tojson` that keeps non-ASCII, `raise_exception`, `strftime_now` and a no-op
`{% generation %}` block, given `messages`, `add_generation_prompt`, `tools`,
`documents` and the special tokens it has by name (`bos_token`, `eos_token`, `unk_token`, `sep_token`,
`pad_token`, `cls_token`, `mask_token`).
The messages are first read as vLLM's server reads them (`engine.chat`), so
that a prompt is the one a vLLM server builds, and a message's keys whose value
is null dropped, as transformers (5.x) drops them before rendering.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from mooncake._checks import is_finite_number, is_int, shown
from mooncake._extras import needs_extra
from mooncake.engine.chat import chat_conversation, loops_over_content
from mooncake.engine.checkpoint import read_json
from mooncake.engine.logprobs import REPLACEMENT, completed_text
from mooncake.errors import ConfigError, InvalidRequestError

__all__ = [
    "CHAT_INPUTS",
    "Detokenizer",
    "SpecialTokens",
    "Tokenizer",
    "can_stop_at",
    "load_tokenizer",
    "sampling_defaults",
]

_CONTINUE_MARK = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for the end of a message to continue
# The prompt's tokens (not special) a stream starts from as context, as vLLM's slow detokenizer's window
# (`INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET`): a decoder changes a token's text by what precedes it only at the
# text's start (a stripped space), which any token of text before it rules out.
CONTEXT_TOKENS = 5
SPACE_MARK = "▁"  # SentencePiece's mark for a space within a piece
# transformers' `SPECIAL_TOKENS_ATTRIBUTES`, in its order: the names a chat template is given, and the order in which
# those missing from the vocabulary are added (so the ids they get are transformers').
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# The template inputs `render_chat` sets from its own parameters: no variable of its `extra` may name one (a caller
# that takes variables from a request refuses or overrides these names before: the gateway's `chat_template_kwargs`).
CHAT_INPUTS = ("messages", "add_generation_prompt", "continue_final_message")
# The ids tokenizers takes (a u32): one outside is no token id at all. An id inside but past the vocabulary decodes
# as "" and has no piece, as tokenizers (and so transformers' `decode` and `convert_ids_to_tokens`) gives it.
_ID_LIMIT = 2**32


def can_stop_at(num_output_tokens: int, min_tokens: int) -> bool:
    """Whether a stop token drawn as a generation's `num_output_tokens`-th output token (counting it) ends the
    generation: from `min_tokens` on, as vLLM's `check_stop` (which returns early while `num_output_tokens <
    min_tokens`). The sampler holds stop tokens back before that unless nothing else may be drawn
    (`SamplingParams.min_tokens`), so one drawn earlier is generated text. The one rule both the decode engine
    (which ends the request) and the gateway's text stream (which reports `finish_reason`) apply; a stop string
    counts one token later (vLLM's detokenizer checks strings only past `min_tokens` tokens)."""
    return num_output_tokens >= min_tokens


def _no_token_id(ids: Sequence[int]) -> InvalidRequestError:
    """The error for ids tokenizers refused as no u32 (named: the first such id)."""
    bad = next((token for token in ids if not 0 <= token < _ID_LIMIT), None)
    return InvalidRequestError(f"{shown(bad)} is not a token id: ids lie in [0, 2**32)")


@attrs.frozen(kw_only=True)
class SpecialTokens:
    """A tokenizer's special tokens.

    Attributes:
        tokens: the named special tokens' text (those of `bos_token`, `eos_token`, `unk_token`, `sep_token`,
            `pad_token`, `cls_token` and `mask_token` that the tokenizer has), as a chat template sees them.
        bos_token_id, eos_token_id: their ids (None: the tokenizer has none).
        stop_token_ids: the ids that end a generation: the EOS and every `eos_token_id` of the generation config.
    """

    tokens: Mapping[str, str] = attrs.field(factory=dict)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    stop_token_ids: frozenset[int] = frozenset()


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def sampling_defaults(directory: str | Path) -> dict[str, float]:
    """The sampling settings a checkpoint's `generation_config.json` sets, which vLLM's server applies to a request
    that leaves them out (its `--generation-config auto`, `ModelConfig.get_diff_sampling_param`): `temperature`,
    `top_p`, `top_k` (-1, all tokens, as 0), `min_p`, `repetition_penalty`, and `max_new_tokens` as `max_tokens`
    (the most a request that sets none generates, within what the context leaves); {} without the file. Only
    these: vLLM reads no other key of the file (a `presence_penalty` or `frequency_penalty` there is ignored, and
    a request without one gets 0, OpenAI's default). Every value the file sets counts, a `top_k` of 50 too: vLLM
    takes the file's difference from transformers' defaults, which since transformers 5 are unset (4 had top_k 50,
    so that value was dropped).

    Raises:
        ConfigError: the file is not JSON, or a setting is out of its range (named with the file).
    """
    path = Path(directory) / "generation_config.json"
    raw = _read_json(path)
    found: dict[str, float] = {}
    ranges: dict[str, tuple[Callable[[float], bool], str]] = {
        "temperature": (lambda v: v >= 0, "a finite number >= 0"),
        "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
        "min_p": (lambda v: 0 <= v <= 1, "in [0, 1]"),
        "repetition_penalty": (lambda v: v > 0, "a finite number > 0"),
    }
    for name, (ok, bound) in ranges.items():
        value = raw.get(name)
        if value is None:
            continue
        if not is_finite_number(value) or not ok(value):
            raise ConfigError(f"{path}: {name} must be {bound}, got {shown(value)}")
        found[name] = float(value)
    top_k = raw.get("top_k")
    if top_k is not None:
        if not is_int(top_k) or top_k < -1:
            raise ConfigError(f"{path}: top_k must be an integer >= -1, got {shown(top_k)}")
        found["top_k"] = max(0, int(top_k))  # -1 is all tokens, as 0 (vLLM's and a request's reading)
    max_new_tokens = raw.get("max_new_tokens")
    if max_new_tokens is not None:
        if not is_int(max_new_tokens) or max_new_tokens < 1:
            raise ConfigError(f"{path}: max_new_tokens must be an integer >= 1, got {shown(max_new_tokens)}")
        found["max_tokens"] = int(max_new_tokens)
    return found


def _ids(value: Any, where: str) -> set[int]:
    if value is None:
        return set()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ConfigError(f"{where} must be a token id or a list of them, got {shown(value)}")
    return set(values)


def _template(directory: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    """The chat template, found where transformers looks: its own file first, then the config's field."""
    file = directory / "chat_template.jinja"
    if file.exists():
        return file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: the one called "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ConfigError(
            f"{directory / 'tokenizer_config.json'}: chat_template must be a string, got {shown(template)}"
        )
    return template


def _environment() -> Any:
    """transformers' chat-template environment, built on first use so that importing this module needs no jinja2."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        # transformers' `{% generation %}` marks assistant text for its masks; rendering keeps the body as is.
        tags = {"generation"}  # noqa: RUF012 (jinja2 declares it an instance attribute)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


class Tokenizer:
    """A checkpoint's tokenizer (`load_tokenizer` makes one).

    Args:
        backend: the `tokenizers.Tokenizer` of `tokenizer.json`.
        special: its special tokens and stop ids.
        chat_template: the Jinja chat template (None: the checkpoint has none).
        source: where it came from, for messages.

    Raises:
        ConfigError: a chat template that does not compile, or jinja2 (the hf extra) is not installed.
    """

    def __init__(self, backend: Any, *, special: SpecialTokens, chat_template: str | None, source: str = "") -> None:
        self.backend, self.special, self.chat_template, self.source = backend, special, chat_template, source
        self._compiled: Any = None
        self._special_ids: frozenset[int] | None = None  # the added tokens marked special, read on first use
        self._marker: str | None = None  # the pre-tokenizer's Metaspace replacement ("": none), read on first use
        # How vLLM reads a chat for this template (`chat_conversation`): contents as lists of parts where it
        # loops over them, developer messages as system ones where it never names the role.
        self.content_parts, self.developer_role = False, True
        if chat_template is not None:
            with needs_extra(f"{source}: the chat template" if source else "a chat template"):
                import jinja2

            try:
                environment = _environment()
                self._compiled = environment.from_string(chat_template)
            except jinja2.TemplateError as error:
                raise ConfigError(f"{source}: the chat template does not compile: {error}") from error
            self.content_parts = loops_over_content(environment.parse(chat_template))
            self.developer_role = '"developer"' in chat_template or "'developer'" in chat_template

    @property
    def vocab_size(self) -> int:
        """Ids are below this (added tokens included)."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`; with `add_special_tokens` the post-processor's (a BOS, say), as transformers' `encode`.

        Through the backend's `encode_batch`, whose ids are `encode`'s: it lets go of the GIL while it works, where
        `encode` holds it, and a long prompt takes seconds (a server's other threads and its event loop run on)."""
        return list(self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of `ids`, as transformers' `decode`.

        `clean_up_tokenization_spaces` is never applied (vLLM's detokenizer does not either): transformers 5
        ignores it for BPE tokenizers, every LLaMA-family one among them, because it strips real spaces.
        Through `decode_batch`, which lets go of the GIL (as `encode`). An id past the vocabulary decodes as ""
        (transformers' too).

        Raises:
            InvalidRequestError: an id outside [0, 2**32), which tokenizers cannot take (named).
        """
        try:
            return str(self.backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0])
        except OverflowError:  # checked only when tokenizers refused: the common call pays nothing
            raise _no_token_id(ids) from None

    def piece(self, token_id: int) -> str:
        """The vocabulary's string for `token_id` (transformers' `convert_ids_to_tokens`: "▁Hello", "Ġhello",
        "<0x0A>"), as vLLM's /tokenize lists with `return_token_strs`; "" for an id past the vocabulary.

        Raises:
            InvalidRequestError: an id outside [0, 2**32) (named), as `decode`.
        """
        try:
            return str(self.backend.id_to_token(token_id) or "")
        except OverflowError:
            raise _no_token_id([token_id]) from None

    def token_text(self, token_id: int, *, context: Sequence[int] = ()) -> str:
        """One token's text as vLLM shows it beside its log-probability: `decode([token_id])`, special tokens
        included, with the leading spaces a piece's Metaspace marks ("▁") stand for where the pre-tokenizer is (or
        holds) a Metaspace (decoding a lone piece strips them, so " Hello" would read "Hello"; vLLM's
        `get_leading_space_marker`: a Mistral file that marks spaces by its normalizer keeps the decode as is).
        A text that ends in U+FFFD (a byte of a character) is completed after `context`, the tokens sampled
        before it (`mooncake.engine.logprobs.completed_text`: "" until the character is whole)."""
        text = self.decode([token_id])
        marker = self._space_marker()
        if marker:
            piece = self.piece(token_id)
            missing = (len(piece) - len(piece.lstrip(marker))) - (len(text) - len(text.lstrip(" ")))
            text = " " * missing + text if missing > 0 else text
        return completed_text(text, token_id, context, self.decode)

    def _space_marker(self) -> str:
        """The Metaspace replacement of the pre-tokenizer ("▁"), or "" where it has no Metaspace (read once)."""
        if self._marker is None:
            try:
                pre = json.loads(self.backend.to_str()).get("pre_tokenizer") or {}
            except Exception:  # a component tokenizers cannot write out: no marker, as vLLM reads it then
                pre = {}
            steps = (pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else [pre]
            metaspace = next((step for step in steps if step.get("type") == "Metaspace"), None)
            self._marker = "" if metaspace is None else str(metaspace.get("replacement", SPACE_MARK))
        return self._marker

    def is_stop(self, token_id: int) -> bool:
        """Whether `token_id` ends a generation."""
        return token_id in self.special.stop_token_ids

    def detokenizer(self, *, skip_special_tokens: bool = True, prompt: Sequence[int] = ()) -> Detokenizer:
        """A fresh streaming decoder of one generation's tokens, after `prompt` (the ids the generation continues).

        The prompt's tail is the stream's context, never emitted (the module's docstring says which tail): vLLM's
        stream starts from the prompt's ids, so the first generated token decodes as it does after the prompt.

        Raises:
            InvalidRequestError: an id of the prompt's tail is no token id (`decode`).
        """
        context = self._context(prompt, skip_special_tokens)
        return Detokenizer(
            self, skip_special_tokens=skip_special_tokens, ids=context, read=len(context), start=len(context)
        )

    def _context(self, prompt: Sequence[int], skip_special_tokens: bool) -> list[int]:
        """The ids a stream after `prompt` starts from: from the last `CONTEXT_TOKENS` non-special ones on, else
        the whole prompt where that tail's decode ends in U+FFFD, else none where the prompt's does too."""
        if self._special_ids is None:
            added = self.backend.get_added_tokens_decoder()
            self._special_ids = frozenset(i for i, token in added.items() if token.special)
        start, found = len(prompt), 0
        while start > 0 and found < CONTEXT_TOKENS:
            start -= 1
            found += prompt[start] not in self._special_ids
        for context in ([int(i) for i in prompt[start:]], [int(i) for i in prompt] if start else []):
            if not self.decode(context, skip_special_tokens=skip_special_tokens).endswith(REPLACEMENT):
                return context
        return []

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        /,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> str:
        """The chat template applied to `messages`: the prompt text of a chat completion, as vLLM's server renders
        it: the messages read as vLLM reads them (`chat_conversation`: a content of text parts joined, developer
        messages as system ones where the template never names that role), then rendered as transformers does
        (which first drops each message's keys whose value is null: a tool's `tool_call_id: null` is left out, not
        rendered "None").

        Args:
            messages: `{"role": ..., "content": ...}` objects, in order (a content: a string, text parts or null).
            add_generation_prompt: end with the template's opening of an assistant turn.
            continue_final_message: end inside the final message, right after its text, so the model goes on
                with it (a reply begun by the client). As transformers does it: the text gets a marker, the
                template renders, and the prompt is cut at the marker (and its trailing space, where the
                template trimmed the text).
            extra: more variables for the template (`tools`, `documents`, ...); none may name one of
                `CHAT_INPUTS` (`messages` is positional-only so that a variable of that name lands here).

        Raises:
            ConfigError: the checkpoint has no chat template.
            InvalidRequestError: `chat_conversation` refused the messages (a part without text: an image); the
                template refused them (its `raise_exception`), failed on them or on a
                variable of `extra` (a value of the wrong kind), or `extra` sets one of the template's own inputs
                (`CHAT_INPUTS`, `raise_exception`, the special tokens: named); `continue_final_message` with
                `add_generation_prompt`, or with a final message whose text the rendered prompt does not hold.
        """
        if self._compiled is None:
            raise ConfigError(f"{self.source}: the tokenizer has no chat template")
        import jinja2

        own = sorted({*CHAT_INPUTS, "raise_exception", *self.special.tokens} & set(extra))
        if own:
            raise InvalidRequestError(f"chat template variables may not set {', '.join(own)} (the template's own)")
        variables = {"tools": None, "documents": None, **self.special.tokens, **extra}
        read = chat_conversation(messages, content_parts=self.content_parts, developer_role=self.developer_role)
        # transformers' `_normalize_chat_messages`: a null value is a missing key (templates test `is defined`).
        chat = [{key: value for key, value in message.items() if value is not None} for message in read]
        final = None
        if continue_final_message:
            if add_generation_prompt:
                raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true")
            content = chat[-1]["content"] if chat else None
            # A content of parts: transformers continues its last text part.
            holder = next((p for p in reversed(content) if "text" in p), None) if isinstance(content, list) else None
            final = holder["text"] if holder is not None else content
            if not isinstance(final, str) or "content" not in (self.chat_template or ""):
                raise InvalidRequestError("continue_final_message needs a final message with text to continue")
            if holder is not None:
                holder["text"] = final + _CONTINUE_MARK
            else:
                chat[-1]["content"] = final + _CONTINUE_MARK
        try:
            rendered = str(
                self._compiled.render(messages=chat, add_generation_prompt=add_generation_prompt, **variables)
            )
        except jinja2.TemplateError as error:
            raise InvalidRequestError(f"the chat template refused the messages: {error}") from error
        except (TypeError, ValueError, AttributeError, LookupError) as error:  # a value of the wrong kind in them
            raise InvalidRequestError(f"the chat template failed on the messages or variables: {error}") from error
        if final is None:
            return rendered
        mark = _CONTINUE_MARK.strip()
        if final.strip() not in rendered or mark not in rendered:
            raise InvalidRequestError("continue_final_message: the chat template does not render the final message")
        at = rendered.rindex(mark)
        # The template kept the text as given: cut at the mark; it trimmed the text's end: cut and trim.
        return rendered[:at] if rendered[at : at + len(_CONTINUE_MARK)] == _CONTINUE_MARK else rendered[:at].rstrip()

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        /,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> list[int]:
        """The ids of the rendered chat (`render_chat`, `extra` its variables); no special tokens are added (the
        template writes them), as transformers."""
        text = self.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **extra,
        )
        return self.encode(text, add_special_tokens=False)


@attrs.define(eq=False)
class Detokenizer:
    """Streams one generation's text as whole characters (the algorithm is in the module's docstring).

    Invariants (`check_invariants`): prefix ≤ read ≤ the tokens held, start ≤ read; `text` (everything
    emitted) is the decode of the tokens before `read` less the decode of the context (those before `start`).
    """

    tokenizer: Tokenizer
    skip_special_tokens: bool = True
    ids: list[int] = attrs.field(factory=list)
    text: str = ""
    prefix: int = 0  # tokens before this are context no longer needed
    read: int = 0  # tokens before this are emitted (or the prompt's context)
    start: int = 0  # tokens before this are the prompt's context, never emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; the new text that is now whole (often "", for half a character).

        Raises:
            InvalidRequestError: `token_id` is no token id (`Tokenizer.decode`); the stream is as before.
        """
        self.ids.append(int(token_id))
        try:
            context = self._decode(self.ids[self.prefix : self.read])
            window = self._decode(self.ids[self.prefix :])
        except InvalidRequestError:
            self.ids.pop()
            raise
        if len(window) <= len(context) or window.endswith(REPLACEMENT):
            return ""
        piece = window[len(context) :]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += piece
        return piece

    def finish(self) -> str:
        """The text that ends the stream: "", always. The tokens still held are an incomplete character (their
        decode ends in U+FFFD, or adds nothing): dropped, with any text of the same tokens before it, as vLLM's
        stream (tokenizers' `DecodeStream`) emits only the whole characters its steps gave and flushes nothing."""
        return ""

    def check_invariants(self) -> None:
        assert 0 <= self.prefix <= self.read <= len(self.ids) and 0 <= self.start <= self.read
        decoded = self._decode(self.ids[: self.read])
        context = self._decode(self.ids[: self.start])
        # (invalid fallback bytes: the module's exception)
        assert context + self.text == decoded or REPLACEMENT in decoded


# The classes of transformers (v5) that rebuild a tokenizer.json's pipeline around its vocabulary and merges; any
# other class (PreTrainedTokenizerFast, TokenizersBackend, an unknown name) takes the file as written.
_LLAMA, _CODE_LLAMA, _QWEN2, _GPT2 = "LlamaTokenizer", "CodeLlamaTokenizer", "Qwen2Tokenizer", "GPT2Tokenizer"
_AS_WRITTEN = "TokenizersBackend"
# Their special tokens where tokenizer_config.json leaves a name out (an explicit null keeps none).
_CLASS_DEFAULTS: Mapping[str, Mapping[str, str]] = {
    _LLAMA: {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},
    _CODE_LLAMA: {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},
    _QWEN2: {"unk_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    _GPT2: {"unk_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
}
# CodeLlamaTokenizer's infilling tokens, special tokens it adds whether or not the file lists them.
_INFILLING = ("▁<PRE>", "▁<MID>", "▁<SUF>", "▁<EOT>", "<FILL_ME>")
# Qwen2Tokenizer's split of text into pieces before the byte-level mapping (GPT-2's, with runs of digits split).
_QWEN2_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def _transformers_class(model_type: str | None, declared: str | None, byte_level: bool) -> str:
    """The class transformers' (v5) `AutoTokenizer` loads a checkpoint's tokenizer with, for the model types this
    package runs: `model_type` of config.json (None: no config), `declared` the `tokenizer_class` of
    tokenizer_config.json (else of config.json), `byte_level`: the tokenizer.json names a ByteLevel step.

    A Qwen2 model's tokenizer is always a `Qwen2Tokenizer` (transformers lists qwen2 among the models whose Hub class
    is wrong: DeepSeek-R1-Distill-Qwen declares `LlamaTokenizerFast`); a Mistral model's is the file as written (its
    registered class is the generic one, whatever the Hub says); otherwise the declared class, except that a
    `LlamaTokenizer` whose file is byte-level (Llama 3 style, DeepSeek-R1-Distill-Llama) is taken as written, as
    transformers' `LlamaTokenizer` would impose SentencePiece's Metaspace on it. For other model types the
    declared class decides (transformers registers classes for some of them, which this does not follow:
    a checkpoint this package cannot run anyway)."""
    if model_type == "qwen2":
        return _QWEN2
    declared = (declared or "").removesuffix("Fast")
    if model_type == "mistral" or (declared == _LLAMA and byte_level):
        return _AS_WRITTEN
    return declared if declared in _CLASS_DEFAULTS else _AS_WRITTEN


def _rebuilt(
    backend: Any, data: Mapping[str, Any], klass: str, config: Mapping[str, Any], named: Mapping[str, Any], path: Path
) -> Any:
    """The backend transformers v5's `klass` (Llama, Code Llama, Qwen2 or GPT-2) builds from the vocabulary and
    merges of `data` (the tokenizer.json `backend` was loaded from): the class's own model options, normalizer, pre-tokenizer and decoder (the module's docstring says
    Llama's; Code Llama's prepends "▁" to the first piece whatever `legacy` says, and adds its infilling tokens),
    the file's post-processor, and the added tokens of `added_tokens_decoder` (else the file's).

    Raises:
        ConfigError: the file's model is not BPE (each of these classes is), or a merge or added token is malformed.
    """
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import BPE

    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise ConfigError(
            f"{path / 'tokenizer.json'}: a {config.get('tokenizer_class') or klass} with a {shown(model.get('type'))} "
            f"model is not supported (transformers rebuilds it as BPE)"
        )
    merges: list[tuple[str, str]] = []
    try:
        for merge in model.get("merges", []):  # "a b", or ["a", "b"] in newer files
            first, second = merge.split(" ", 1) if isinstance(merge, str) else merge
            merges.append((first, second))
        listed = config.get("added_tokens_decoder")
        order = sorted(listed, key=int) if isinstance(listed, Mapping) else []
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{path}: a merge of tokenizer.json or an added token's id is malformed: {error}") from None
    vocab = model.get("vocab", {})
    prefix = config.get("add_prefix_space")
    if klass in (_LLAMA, _CODE_LLAMA):
        code = klass == _CODE_LLAMA
        unknown = named.get("unk_token") if code and isinstance(named.get("unk_token"), str) else None
        rebuilt = Backend(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, unk_token=unknown))
        prefix = True if prefix is None else bool(prefix)
        rebuilt.normalizer = None
        scheme = ("always" if config.get("legacy", False) and not code else "first") if prefix else "never"
        rebuilt.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE_MARK, prepend_scheme=scheme, split=False)
        steps = [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
        rebuilt.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix or code else steps)
    else:  # Qwen2 and GPT-2: byte-level BPE, no unknown token, no byte fallback
        rebuilt = Backend(BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix=""))
        rebuilt.decoder = decoders.ByteLevel()
        if klass == _QWEN2:
            rebuilt.normalizer = normalizers.NFC()
            rebuilt.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=bool(prefix), use_regex=False),
                ]
            )
        else:
            rebuilt.normalizer = None
            rebuilt.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=bool(prefix))
    entries = [listed[k] for k in order] if isinstance(listed, Mapping) else data.get("added_tokens", [])
    for entry in entries:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("content"), str):
            raise ConfigError(f"{path}: an added token must be an object with a content, got {shown(entry)}")
        special = bool(entry.get("special", False))
        token = AddedToken(
            entry["content"],
            single_word=bool(entry.get("single_word", False)),
            lstrip=bool(entry.get("lstrip", False)),
            rstrip=bool(entry.get("rstrip", False)),
            normalized=bool(entry.get("normalized", not special)),
            special=special,
        )
        (rebuilt.add_special_tokens if special else rebuilt.add_tokens)([token])
    if klass == _CODE_LLAMA:
        _add_special(rebuilt, _INFILLING)
    # The file's post-processor, whatever `add_bos_token` / `add_eos_token` say (transformers v5 does not apply
    # them); none: no BOS or EOS added.
    rebuilt.post_processor = backend.post_processor
    return rebuilt


def _add_special(backend: Any, tokens: Sequence[str]) -> None:
    """Add those of `tokens` that are not added tokens yet as special tokens (new ones get the next ids), as
    transformers adds a tokenizer's named special tokens."""
    from tokenizers import AddedToken

    added = {token.content for token in backend.get_added_tokens_decoder().values()}
    for token in dict.fromkeys(tokens):
        if token not in added:
            backend.add_special_tokens([AddedToken(token, special=True, normalized=False)])


def _extra_special(config: Mapping[str, Any], legacy: Mapping[str, Any], path: Path) -> list[str]:
    """The special tokens beyond the named seven, in transformers' (v5) order (its `all_special_tokens`): the values
    of an `extra_special_tokens` object (named, model-specific ones), then the entries of an `extra_special_tokens`
    list, else of `additional_special_tokens` (its older name, read where `extra_special_tokens` is empty or
    missing), of tokenizer_config.json. Where the config has no `added_tokens_decoder`, special_tokens_map.json's
    `extra_special_tokens` follow (those not listed yet), and its `additional_special_tokens` count where the
    config names neither list. An entry is a string or a serialized AddedToken.

    Raises:
        ConfigError: an entry that is not a token, or a list that is not one (named with its file).
    """
    extra = config.get("extra_special_tokens")
    if not extra and "additional_special_tokens" in config:
        extra = config["additional_special_tokens"]
    found = _token_list(extra, path / "tokenizer_config.json")
    # A list named (even empty) keeps the legacy map's older name out, as transformers' constructor only renames
    # `additional_special_tokens` where no `extra_special_tokens` came.
    listed = not isinstance(extra, Mapping) and (
        "extra_special_tokens" in config or "additional_special_tokens" in config
    )
    if "added_tokens_decoder" not in config:  # transformers reads the legacy map only then
        where = path / "special_tokens_map.json"
        more = legacy.get("extra_special_tokens")
        if more is not None:
            found += [token for token in _token_list(more, where) if token not in found]
        elif not listed and "additional_special_tokens" in legacy:
            found += _token_list(legacy["additional_special_tokens"], where)
    return found


def _token_list(value: Any, where: Path) -> list[str]:
    """The tokens of a list (or the values of an object) of strings and serialized AddedTokens; [] for None."""
    if value is None:
        return []
    entries = list(value.values()) if isinstance(value, Mapping) else value
    if not isinstance(entries, list):
        raise ConfigError(f"{where}: extra_special_tokens={shown(value)} is not a list of tokens")
    tokens: list[str] = []
    for entry in entries:
        token = entry.get("content") if isinstance(entry, Mapping) else entry  # a serialized AddedToken
        if not isinstance(token, str):
            raise ConfigError(f"{where}: extra_special_tokens holds {shown(entry)}, which is not a token")
        tokens.append(token)
    return tokens


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """The tokenizer of the checkpoint in `directory`.

    The special tokens by name are tokenizer_config.json's, overridden by special_tokens_map.json's where the
    config has no `added_tokens_decoder` (transformers reads that legacy file then only), else the class's
    defaults; any of them, and of the extra special tokens (`extra_special_tokens`, `additional_special_tokens`:
    `_extra_special`), that the file does not list as an added token becomes one, special (a new id where the
    vocabulary lacks it), as transformers adds them. The file's own truncation and padding are off (transformers
    turns them off for each encoding).

    Raises:
        ConfigError: no readable `tokenizer.json`; unreadable JSON beside it; a special token (named or extra)
            that is not a string; stop ids that are not ids; a chat template that does not compile; tokenizers (or, for a
            chat template, jinja2) is not installed: the hf extra.
    """
    with needs_extra("load_tokenizer"):
        from tokenizers import Tokenizer as Backend

    path = Path(directory).resolve()
    try:  # read once: the backend, the class choice and a rebuild all take this text
        text = (path / "tokenizer.json").read_text(encoding="utf-8")
        backend = Backend.from_str(text)
    except Exception as error:  # tokenizers raises a bare Exception for a malformed file; OSError: none there
        raise ConfigError(
            f"{path / 'tokenizer.json'} is not a readable tokenizer: {' '.join(str(error).split())}"
        ) from error
    backend.no_truncation()  # a file saved after a truncating or padding call keeps them: never applied here
    backend.no_padding()
    config = _read_json(path / "tokenizer_config.json")
    legacy = _read_json(path / "special_tokens_map.json")
    model = _read_json(path / "config.json")
    declared = config.get("tokenizer_class") or model.get("tokenizer_class")
    klass = _transformers_class(
        model.get("model_type"), declared if isinstance(declared, str) else None, '"ByteLevel"' in text
    )
    defaults = _CLASS_DEFAULTS.get(klass, {})
    given = config if "added_tokens_decoder" in config else {**config, **legacy}
    named: dict[str, Any] = {}
    for name in _SPECIAL_NAMES:
        value = given[name] if name in given else defaults.get(name)
        named[name] = value.get("content") if isinstance(value, Mapping) else value  # a serialized AddedToken
        if named[name] is not None and not isinstance(named[name], str):
            raise ConfigError(f"{path / 'tokenizer_config.json'}: {name}={shown(value)} is not a token")
    if klass != _AS_WRITTEN:
        backend = _rebuilt(backend, json.loads(text), klass, config, named, path)
    tokens = {name: value for name, value in named.items() if value is not None}
    _add_special(backend, [*tokens.values(), *_extra_special(config, legacy, path)])
    bos = backend.token_to_id(tokens["bos_token"]) if "bos_token" in tokens else None
    eos = backend.token_to_id(tokens["eos_token"]) if "eos_token" in tokens else None
    generation = _read_json(path / "generation_config.json")
    source = generation if "eos_token_id" in generation else model
    stops = _ids(source.get("eos_token_id"), f"{path}: eos_token_id") | ({eos} if eos is not None else set())
    special = SpecialTokens(tokens=tokens, bos_token_id=bos, eos_token_id=eos, stop_token_ids=frozenset(stops))
    return Tokenizer(backend, special=special, chat_template=_template(path, config), source=str(path))
