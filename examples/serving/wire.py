"""The messages between the gateway and the workers: typed records with one encode/decode pair (no torch).

Each message is a frozen record whose `METHOD` names the transfer engine's
control call that carries it; its fields travel as the call's JSON object:

    gateway → worker   worker.connect  Connect {gateway, peers}
                       worker.health   HealthCheck {}   answered by a Health {ok, pid, queued, active, kv_usage, ...}
                       worker.stop     Stop {}
                       worker.peer_gone PeerGone {address}   (a worker's process is gone: end its leases here)
    gateway → prefill  prefill.submit  PrefillJob {request_id, attempt, tokens, decode, fetch, sampling}
                       prefill.cancel  CancelPrefill {request_id, attempt}   (its client left, or it was rerouted)
    gateway → decode   decode.cancel   CancelDecode {request_id}   (its client left, it stopped, it timed out)
    prefill → decode   decode.join     DecodeJob {request_id, attempt, keys, prompt_tokens, first_token, ...}
                                       (and `prompt_ids`, the prompt itself, only for a repetition penalty)
    prefill → gateway  prefill.started / prefill.done {prefix_tokens, ..., events} / prefill.failed {error, peer}
                       (also for a job stopped by its cancel: the gateway has forgotten it, and takes its events)
    decode  → gateway  decode.joined / decode.rejected {reason} / decode.failed {error}
                       decode.tokens  DecodeTokens {instance_id,
                                                    tokens: [[request_id, attempt, token, index, finished]…]}

A token whose request asked for log-probabilities carries them as a sixth item,
`[logprob, rank, [[token, logprob]…]]` (`TokenLogprobs`); a job's first token's
ride in `DecodeJob.first_logprobs` the same way. A token whose step ended at another
time (`Token.at_s`) than the token before it carries that time as a seventh item
(its sixth then null where it has no log-probabilities): once per step of a
report, not once per token.

Reports name the worker that sends them and the request's `attempt` (a
request rescheduled after its prefill engine went down is sent again with the
next attempt), so the gateway can ignore what a worker that was presumed dead
still reports about a request it no longer serves.

`encode(message)` gives (method, args); `decode(method, args)` the record.
Decoding checks every field: an unknown method, a missing or extra field, or a
value of the wrong type (every integer is an id or a count: in [0, 2**64)) is a
`MessageError` naming the method and the field,
never a silent drop (raised in a control call's handler, it goes back to the
caller as the call's error). Cache events travel inside the prefill reports as
JSON lists, in order:

    ["stored" | "removed", source, seq, epoch, tier, [key, ...]]
    ["cleared", source, seq, epoch]

Invariants: `decode(*encode(m)) == m` for every message;
`event_from_wire(event_to_wire(e)) == e` for every cache event.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar, cast

import attrs

from mooncake.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent
from mooncake.engine.logprobs import TokenLogprobs
from mooncake.errors import MooncakeError
from mooncake.types import InstanceId, Tier

__all__ = [
    "CancelDecode",
    "CancelPrefill",
    "Connect",
    "DecodeFailed",
    "DecodeJob",
    "DecodeJoined",
    "DecodeRejected",
    "DecodeTokens",
    "Fetch",
    "Health",
    "HealthCheck",
    "Message",
    "MessageError",
    "PeerGone",
    "PrefillDone",
    "PrefillFailed",
    "PrefillJob",
    "PrefillStarted",
    "Sampling",
    "Stop",
    "Token",
    "decode",
    "decode_as",
    "encode",
    "event_from_wire",
    "event_to_wire",
    "handlers",
]


class MessageError(MooncakeError, ValueError):
    """A control message that is not one of `wire`'s, or breaks its record's shape; the message names both."""


# ---------------------------------------------------------------------------------------------- field codecs


@attrs.frozen
class _Codec:
    """How one field travels: `load` checks a JSON value into the field's value (raising MessageError), `dump`
    makes it JSON again."""

    load: Callable[[Any, str], Any]
    dump: Callable[[Any], Any] = lambda value: value


def _bad(where: str, expected: str, value: Any) -> MessageError:
    shown = repr(value)
    return MessageError(f"{where}: expected {expected}, got {shown if len(shown) < 80 else shown[:77] + '...'}")


_U64_END = 1 << 64  # every integer on the wire is an id (token, request, block key) or a count: in [0, 2**64)


def _is_id(item: Any) -> bool:
    return type(item) is int and 0 <= item < _U64_END


def _load_int(value: Any, where: str) -> int:
    """An id or a count: never negative (a fetch of -2 blocks would take all but the last two of a list)."""
    if not _is_id(value):
        raise _bad(where, "an integer" if type(value) is not int else "an integer in [0, 2**64)", value)
    return value


def _load_float(value: Any, where: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise _bad(where, "a finite number", value)
    return float(value)


def _load_str(value: Any, where: str) -> str:
    if type(value) is not str:
        raise _bad(where, "a string", value)
    return value


def _load_bool(value: Any, where: str) -> bool:
    if type(value) is not bool:
        raise _bad(where, "a boolean", value)
    return value


def _load_ints(value: Any, where: str) -> tuple[int, ...]:
    if type(value) is not list or not all(_is_id(item) for item in value):
        raise _bad(where, "a list of integers in [0, 2**64)", value)
    return tuple(value)


def _load_str_map(value: Any, where: str) -> dict[str, str]:
    if type(value) is not dict or not all(type(item) is str for item in value.values()):
        raise _bad(where, "an object of strings", value)
    return dict(value)


def _load_events(value: Any, where: str) -> tuple[CacheEvent, ...]:
    if type(value) is not list:
        raise _bad(where, "a list of cache events", value)
    return tuple(event_from_wire(item, where=f"{where}[{i}]") for i, item in enumerate(value))


def _load_logprob(value: Any, where: str) -> float:
    """A log-probability: a number <= 0, -inf included (JSON's -Infinity), never NaN."""
    if type(value) not in (int, float) or not value <= 0:
        raise _bad(where, "a log-probability (a number <= 0)", value)
    return float(value)


def _load_logprobs(value: Any, where: str) -> TokenLogprobs:
    shape = "[logprob, rank, [[token, logprob], ...]]"
    if type(value) is not list or len(value) != 3 or type(value[1]) is not int or value[1] < 1:
        raise _bad(where, shape, value)
    if type(value[2]) is not list:
        raise _bad(f"{where}[2]", "a list of [token, logprob]", value[2])
    top = []
    for i, pair in enumerate(value[2]):
        if type(pair) is not list or len(pair) != 2 or type(pair[0]) is not int or pair[0] < 0:
            raise _bad(f"{where}[2][{i}]", "[token, logprob]", pair)
        top.append((pair[0], _load_logprob(pair[1], f"{where}[2][{i}][1]")))
    return TokenLogprobs(logprob=_load_logprob(value[0], f"{where}[0]"), rank=value[1], top=tuple(top))


def _load_biases(value: Any, where: str) -> tuple[tuple[int, float], ...]:
    if type(value) is not list:
        raise _bad(where, "a list of [token, bias]", value)
    biases = []
    for i, pair in enumerate(value):
        if type(pair) is not list or len(pair) != 2 or type(pair[0]) is not int or pair[0] < 0:
            raise _bad(f"{where}[{i}]", "[token, bias]", pair)
        biases.append((pair[0], _load_float(pair[1], f"{where}[{i}][1]")))
    return tuple(biases)


def _load_logprobs_list(value: Any, where: str) -> tuple[TokenLogprobs, ...]:
    if type(value) is not list:
        raise _bad(where, "a list of log-probabilities", value)
    return tuple(_load_logprobs(item, f"{where}[{i}]") for i, item in enumerate(value))


def _dump_logprobs(logprobs: TokenLogprobs) -> list[Any]:
    return [logprobs.logprob, logprobs.rank, [list(pair) for pair in logprobs.top]]


def _load_tokens(value: Any, where: str) -> tuple[Token, ...]:
    """Tokens from `[request_id, attempt, token, index, finished(, logprobs(, at_s))]` items; an item without
    `at_s` (a number; its `logprobs` then null where it has none) has its predecessor's (0.0 for the first),
    and the times given never decrease along the list (a report carries its steps in order, on one clock)."""
    if type(value) is not list:
        raise _bad(where, "a list of tokens", value)
    tokens = []
    at_s, is_stamped = 0.0, False  # is_stamped: a time was given (the order holds from the first one given)
    for i, item in enumerate(value):
        if (
            type(item) is not list
            or len(item) not in (5, 6, 7)
            or not all(_is_id(x) for x in item[:4])
            or type(item[4]) is not bool
        ):
            raise _bad(
                f"{where}[{i}]",
                "[request_id, attempt, token, index (integers in [0, 2**64)), finished(, logprobs(, at_s))]",
                item,
            )
        logprobs = None
        if len(item) > 5 and not (len(item) == 7 and item[5] is None):
            logprobs = _load_logprobs(item[5], f"{where}[{i}][5]")
        if len(item) == 7:
            stepped_s = _load_float(item[6], f"{where}[{i}][6]")
            if is_stamped and stepped_s < at_s:
                raise _bad(f"{where}[{i}][6]", f"a step time at or after the token before's ({at_s!r})", item[6])
            at_s, is_stamped = stepped_s, True
        tokens.append(Token(item[0], item[1], item[2], item[3], item[4], logprobs, at_s))
    return tuple(tokens)


def _dump_tokens(tokens: tuple[Token, ...]) -> list[list[Any]]:
    """The items `_load_tokens` reads: `at_s` only where it changes (once per step, not once per token)."""
    items = []
    at_s = 0.0
    for t in tokens:
        item: list[Any] = [t.request_id, t.attempt, t.token, t.index, t.finished]
        logprobs = None if t.logprobs is None else _dump_logprobs(t.logprobs)
        if t.at_s != at_s:
            item += [logprobs, t.at_s]
            at_s = t.at_s
        elif logprobs is not None:
            item.append(logprobs)
        items.append(item)
    return items


INT, FLOAT, STR, BOOL = _Codec(_load_int), _Codec(_load_float), _Codec(_load_str), _Codec(_load_bool)
INTS = _Codec(_load_ints, list)
STR_MAP = _Codec(_load_str_map)
EVENTS = _Codec(_load_events, lambda events: [event_to_wire(e) for e in events])
TOKENS = _Codec(_load_tokens, _dump_tokens)
LOGPROBS = _Codec(_load_logprobs, _dump_logprobs)
BIASES = _Codec(_load_biases, lambda biases: [list(pair) for pair in biases])


def _record(cls: type[Any]) -> _Codec:
    return _Codec(lambda value, where: _load_fields(cls, value, where), lambda value: _dump_fields(value))


def _optional(codec: _Codec) -> _Codec:
    return _Codec(
        lambda value, where: None if value is None else codec.load(value, where),
        lambda value: None if value is None else codec.dump(value),
    )


OPTIONAL_INT, OPTIONAL_LOGPROBS, OPTIONAL_STR = _optional(INT), _optional(LOGPROBS), _optional(STR)
OPTIONAL_LOGPROBS_LIST = _optional(_Codec(_load_logprobs_list, lambda entries: [_dump_logprobs(e) for e in entries]))


def _field(codec: _Codec, **options: Any) -> Any:
    return attrs.field(metadata={"codec": codec}, **options)


# ---------------------------------------------------------------------------------------------- the records


@attrs.frozen
class Token:
    """One generated token of a request's attempt: its `index`-th output token, the last when `finished`; its
    log-probabilities where the request asked for them; `at_s`, when the decode step that made it ended on its
    worker's monotonic clock (`time.monotonic()`): only differences of one worker's `at_s` mean anything (the
    gateway times a request's tokens by them, as vLLM does by its engine core's step times; 0.0 where the sender
    gives none: the tokens of a report then count as one step's)."""

    request_id: int
    attempt: int
    token: int
    index: int
    finished: bool
    logprobs: TokenLogprobs | None = None
    at_s: float = 0.0


@attrs.frozen(kw_only=True)
class Fetch:
    """The transfer plan: bring the prompt's first `blocks` blocks from `source` before prefilling."""

    source: str = _field(STR)
    blocks: int = _field(INT)


@attrs.frozen(kw_only=True)
class Sampling:
    """How a request's tokens are chosen and when it ends, as the gateway set it: one record the prefill job
    carries and the prefill worker hands on to the decode node unchanged (`stop_ids`: the tokens that end the
    generation, the model's EOS and the like; `min_tokens`: the tokens before one may be drawn; `logprobs`: the
    most probable tokens' log-probabilities to report with each token, None for none; `prompt_logprobs`: the
    same for the prompt's tokens, which the prefill reports; the rest as `mooncake.engine.sampling.SamplingParams`'s).
    Each field is the gateway's `SamplingOptions` field and the engines' `SamplingParams` field of its name (but
    `stop_ids`: `stop_token_ids` there; `max_tokens`: the decode engine's `max_new_tokens`), copied by name."""

    max_tokens: int = _field(INT)
    temperature: float = _field(FLOAT)
    top_p: float = _field(FLOAT)
    seed: int = _field(INT)
    stop_ids: tuple[int, ...] = _field(INTS)
    min_tokens: int = _field(INT, default=0)
    logprobs: int | None = _field(OPTIONAL_INT, default=None)
    top_k: int = _field(INT, default=0)
    min_p: float = _field(FLOAT, default=0.0)
    repetition_penalty: float = _field(FLOAT, default=1.0)
    presence_penalty: float = _field(FLOAT, default=0.0)
    frequency_penalty: float = _field(FLOAT, default=0.0)
    prompt_logprobs: int | None = _field(OPTIONAL_INT, default=None)
    logit_bias: tuple[tuple[int, float], ...] = _field(BIASES, default=())
    allowed_token_ids: tuple[int, ...] = _field(INTS, default=())


@attrs.frozen(kw_only=True)
class Connect:
    """The gateway's engine address and every worker's, by instance id."""

    METHOD: ClassVar[str] = "worker.connect"
    gateway: str = _field(STR)
    peers: dict[str, str] = _field(STR_MAP)  # noqa: RUF009 (an attrs field)


@attrs.frozen(kw_only=True)
class HealthCheck:
    """Are you there? Answered by a `Health`."""

    METHOD: ClassVar[str] = "worker.health"


@attrs.frozen(kw_only=True)
class Health:
    """A worker's answer to a `HealthCheck`: its process, its queue, the requests it decodes (by id), the
    tokens it generated since it started and the share of its KV memory in use (0..1: a decode engine's KV
    budget its batch reserves, a prefill engine's cache pages holding blocks)."""

    METHOD: ClassVar[str] = "worker.health.reply"
    ok: bool = _field(BOOL)
    pid: int = _field(INT)
    queued: int = _field(INT)
    active: tuple[int, ...] = _field(INTS)
    generated_tokens: int = _field(INT)
    kv_usage: float = _field(FLOAT)


@attrs.frozen(kw_only=True)
class Stop:
    """Stop serving (the worker's process then closes its engine, cache and shared memory)."""

    METHOD: ClassVar[str] = "worker.stop"


@attrs.frozen(kw_only=True)
class Announce:
    """Announce everything your cache holds: start a new epoch of its events (`TieredCache.announce_all`), which
    the next report carrying events brings. The gateway's index lost track of this worker's cache (a gap in its
    events: it was marked down, which forgets its cache, and came back, or a report was lost)."""

    METHOD: ClassVar[str] = "worker.announce"


@attrs.frozen(kw_only=True)
class PeerGone:
    """The worker at `address` (its engine's) is gone, its process dead: end every lease it holds here, its pins
    and its reservations (`Messenger.release_owner`), since nothing of it can still write into them."""

    METHOD: ClassVar[str] = "worker.peer_gone"
    address: str = _field(STR)


@attrs.frozen(kw_only=True)
class PrefillJob:
    """Prefill `tokens` for `decode`, after fetching the planned prefix; sampling decides the first token."""

    METHOD: ClassVar[str] = "prefill.submit"
    request_id: int = _field(INT)
    attempt: int = _field(INT)
    tokens: tuple[int, ...] = _field(INTS)
    decode: str = _field(STR)
    fetch: Fetch | None = _field(_optional(_record(Fetch)))  # noqa: RUF009 (an attrs field)
    sampling: Sampling = _field(_record(Sampling))  # noqa: RUF009 (an attrs field)
    cache_salt: str | None = _field(OPTIONAL_STR, default=None)  # the blocks' namespace (`BlockHasher.salted`)


@attrs.frozen(kw_only=True)
class CancelPrefill:
    """Drop this attempt of the request if it is still queued; if it is being prefilled, finish the prefill (its
    KV stays in the node's cache) but hand nothing to the decode node. An attempt the worker does not hold (done,
    or never sent) is ignored."""

    METHOD: ClassVar[str] = "prefill.cancel"
    request_id: int = _field(INT)
    attempt: int = _field(INT)


@attrs.frozen(kw_only=True)
class CancelDecode:
    """Drop the request from the decode batch (whatever its attempt held there). `every_attempt`: the gateway ended
    the request (its client left, it timed out, its text ended), so no attempt of it may join that node from now on,
    a later one whose hand-off is still on its way included; else (a health probe's cancel of a request served
    elsewhere now) the attempt held there ends, and a request held nowhere is noted as ended in every attempt unless
    an attempt of it ended there already (the decode node's `_EndedAttempts`)."""

    METHOD: ClassVar[str] = "decode.cancel"
    request_id: int = _field(INT)
    every_attempt: bool = _field(BOOL, default=False)


@attrs.frozen(kw_only=True)
class DecodeJob:
    """A prefilled request handed to its decode node: its KV blocks, its first token and its sampling."""

    METHOD: ClassVar[str] = "decode.join"
    request_id: int = _field(INT)
    attempt: int = _field(INT)
    keys: tuple[int, ...] = _field(INTS)
    prompt_tokens: int = _field(INT)
    first_token: int = _field(INT)
    sampling: Sampling = _field(_record(Sampling))  # noqa: RUF009 (an attrs field)
    first_logprobs: TokenLogprobs | None = _field(OPTIONAL_LOGPROBS, default=None)  # noqa: RUF009 (an attrs field)
    prompt_ids: tuple[int, ...] = _field(INTS, default=())  # the prompt, where a repetition penalty counts it


@attrs.frozen(kw_only=True)
class PrefillStarted:
    METHOD: ClassVar[str] = "prefill.started"
    instance_id: str = _field(STR)
    request_id: int = _field(INT)
    attempt: int = _field(INT)


@attrs.frozen(kw_only=True)
class PrefillDone:
    """A prefill's figures and its node's cache events since the last report, in order."""

    METHOD: ClassVar[str] = "prefill.done"
    instance_id: str = _field(STR)
    request_id: int = _field(INT)
    attempt: int = _field(INT)
    prefix_tokens: int = _field(INT)
    computed_tokens: int = _field(INT)
    fetched_blocks: int = _field(INT)
    streamed_blocks: int = _field(INT)
    events: tuple[CacheEvent, ...] = _field(EVENTS)
    # The log-probabilities of prompt tokens 1..n-1, where the job's sampling asked for them (`prompt_logprobs`).
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = _field(OPTIONAL_LOGPROBS_LIST, default=None)


@attrs.frozen(kw_only=True)
class PrefillFailed:
    """A prefill job failed: `peer` names that decode instance when it did not answer (the KV
    stream or the hand-off timed out or found no connection, or its slices did not settle); empty when the prefill
    itself failed."""

    METHOD: ClassVar[str] = "prefill.failed"
    instance_id: str = _field(STR)
    request_id: int = _field(INT)
    attempt: int = _field(INT)
    error: str = _field(STR)
    peer: str = _field(STR)
    events: tuple[CacheEvent, ...] = _field(EVENTS)


@attrs.frozen(kw_only=True)
class DecodeJoined:
    METHOD: ClassVar[str] = "decode.joined"
    instance_id: str = _field(STR)
    request_id: int = _field(INT)
    attempt: int = _field(INT)
    context_tokens: int = _field(INT)
    output_tokens: int = _field(INT)


@attrs.frozen(kw_only=True)
class DecodeRejected:
    """The decode rule refused the request; `reason` is a `sched.outcome.Reason` value."""

    METHOD: ClassVar[str] = "decode.rejected"
    instance_id: str = _field(STR)
    request_id: int = _field(INT)
    attempt: int = _field(INT)
    reason: str = _field(STR)


@attrs.frozen(kw_only=True)
class DecodeFailed:
    """The join failed (its KV is missing or does not match the prompt): a failure, not a decision."""

    METHOD: ClassVar[str] = "decode.failed"
    instance_id: str = _field(STR)
    request_id: int = _field(INT)
    attempt: int = _field(INT)
    error: str = _field(STR)


@attrs.frozen(kw_only=True)
class DecodeTokens:
    """The tokens of one decode step (the joins' first tokens included); or, merged by the worker's `Reporter`
    while the gateway was behind, of several consecutive steps, in order, each token with its own step's time
    (`Token.at_s`)."""

    METHOD: ClassVar[str] = "decode.tokens"
    instance_id: str = _field(STR)
    tokens: tuple[Token, ...] = _field(TOKENS)


Message = (
    Connect
    | HealthCheck
    | Health
    | Stop
    | Announce
    | PeerGone
    | PrefillJob
    | CancelPrefill
    | CancelDecode
    | DecodeJob
    | PrefillStarted
    | PrefillDone
    | PrefillFailed
    | DecodeJoined
    | DecodeRejected
    | DecodeFailed
    | DecodeTokens
)
MESSAGES: dict[str, type[Any]] = {
    cls.METHOD: cls
    for cls in (
        Connect,
        HealthCheck,
        Health,
        Stop,
        Announce,
        PeerGone,
        PrefillJob,
        CancelPrefill,
        CancelDecode,
        DecodeJob,
        PrefillStarted,
        PrefillDone,
        PrefillFailed,
        DecodeJoined,
        DecodeRejected,
        DecodeFailed,
        DecodeTokens,
    )
}
M = TypeVar("M")


# ---------------------------------------------------------------------------------------------- encode / decode


def _dump_fields(record: Any) -> dict[str, Any]:
    return {f.name: f.metadata["codec"].dump(getattr(record, f.name)) for f in attrs.fields(type(record))}


def _load_fields(cls: type[M], args: Any, where: str) -> M:
    if type(args) is not dict:
        raise _bad(where, "a JSON object", args)
    fields = attrs.fields(cast(Any, cls))
    names = {f.name for f in fields}
    if extra := sorted(set(args) - names):
        raise MessageError(f"{where}: unknown field {extra[0]!r} (fields: {', '.join(sorted(names)) or 'none'})")
    values = {}
    for f in fields:
        if f.name not in args:
            raise MessageError(f"{where}: missing field {f.name!r}")
        values[f.name] = f.metadata["codec"].load(args[f.name], f"{where}.{f.name}")
    return cls(**values)


def encode(message: Message) -> tuple[str, dict[str, Any]]:
    """The control call that carries `message`: its method and JSON args."""
    return message.METHOD, _dump_fields(message)


def decode(method: str, args: Any) -> Message:
    """The message a control call carries.

    Raises:
        MessageError: an unknown method, or args that are not its record's fields (naming the field).
    """
    cls = MESSAGES.get(method)
    if cls is None:
        raise MessageError(f"unknown message {method!r} (known: {', '.join(sorted(MESSAGES))})")
    message: Message = _load_fields(cls, args, method)
    return message


def decode_as(cls: type[M], args: Any) -> M:
    """`args` decoded as a `cls` message (a call's reply, whose method is known from the call).

    Raises:
        MessageError: `args` is not a `cls`.
    """
    return _load_fields(cls, args, getattr(cls, "METHOD", cls.__name__))


def handlers(serve: Mapping[type[Any], Callable[[Any], Message | None]]) -> dict[str, Callable[[Any], Any]]:
    """Control-call handlers (method → handler of JSON args) that decode each call into its record, run
    `serve[record type]` on it and encode its answer (a message, or None for a bare acknowledgement).
    A malformed call raises MessageError, which the transfer engine returns to the caller as the call's error."""

    def make(cls: type[Any], handler: Callable[[Any], Message | None]) -> Callable[[Any], Any]:
        def handle(args: Any) -> Any:
            answer = handler(_load_fields(cls, args, cls.METHOD))
            return None if answer is None else _dump_fields(answer)

        return handle

    return {cls.METHOD: make(cls, handler) for cls, handler in serve.items()}


# ---------------------------------------------------------------------------------------------- cache events


def event_to_wire(event: CacheEvent) -> list[Any]:
    """`event` as a JSON list."""
    if isinstance(event, AllBlocksCleared):
        return ["cleared", event.source, event.seq, event.epoch]
    kind = "stored" if isinstance(event, BlockStored) else "removed"
    return [kind, event.source, event.seq, event.epoch, int(event.tier), [int(k) for k in event.keys]]


def event_from_wire(data: Any, *, where: str = "event") -> CacheEvent:
    """The event `event_to_wire` made `data` from.

    Raises:
        MessageError: `data` is not such a list (naming `where`).
    """
    shape = "['stored' | 'removed', source, seq, epoch, tier, [key, ...]] or ['cleared', source, seq, epoch]"
    if type(data) is not list or not data or data[0] not in ("stored", "removed", "cleared"):
        raise _bad(where, shape, data)
    try:
        if data[0] == "cleared":
            (_, source, seq, epoch) = data
            return AllBlocksCleared(source=InstanceId(_load_str(source, where)), seq=seq, epoch=epoch)
        (kind, source, seq, epoch, tier, keys) = data
        change = BlockStored if kind == "stored" else BlockRemoved
        return change(
            source=InstanceId(_load_str(source, where)),
            seq=seq,
            epoch=epoch,
            tier=Tier(_load_int(tier, where)),
            keys=_load_ints(keys, where),
        )
    except MessageError:
        raise
    except (ValueError, TypeError, MooncakeError) as error:  # a wrong count, tier or key: the record's own checks
        raise _bad(where, shape, data) from error
