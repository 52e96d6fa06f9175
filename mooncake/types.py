"""Identifiers and value objects shared by every layer.

`BlockKey` is the chained hash of a block of tokens (see `mooncake.cache.hashing`)
or, for Mooncake-format traces, a trace `hash_id`; either way equal keys mean
equal token prefixes. `Request` is what a workload is made of; it is immutable
and validated on construction, so every later layer may trust it.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, NewType, cast

import attrs
import numpy as np
import numpy.typing as npt

from mooncake._checks import (
    ceil_div,
    int_at_least,
    is_finite_number,
    is_int,
    plain_int,
    positive,
    require_int,
    require_number,
    shown,
)
from mooncake.errors import ConfigError, InvalidRequestError

__all__ = [
    "BLOCK_KEY_LIMIT",
    "BlockKey",
    "InstanceId",
    "MAX_TOKENS",
    "Request",
    "RequestId",
    "Slo",
    "Tier",
    "as_token_array",
    "block_count",
    "check_block_key",
    "check_request_id",
    "check_token_count",
    "key_tuple",
    "prefix_reusable",
    "repeated_key",
    "require_slo",
]

_INT32 = np.iinfo(np.int32)

BlockKey = NewType("BlockKey", int)
"""Chained key of one block; equal keys imply equal token prefixes."""

BLOCK_KEY_LIMIT = 2**256
"""Block keys lie in [0, BLOCK_KEY_LIMIT): the widest key a `BlockHasher` makes (SHA-256's) and the widest an SSD
page's header labels; a wider key would be cached in memory and then fail every demotion to SSD."""

InstanceId = NewType("InstanceId", str)
"""Identifies an engine instance (a holder of blocks, a prefill or decode node)."""

RequestId = NewType("RequestId", str)
"""Identifies a request for its whole life."""

MAX_TOKENS = 2**40
"""The most tokens a request's prompt or output may count: far beyond any context, and small enough that
sums of them stay exact in the int64 and float64 arithmetic of the schedulers' compiled kernels."""


def block_count(tokens: int, block_size_tokens: int) -> int:
    """How many blocks, each one key, `tokens` tokens make in `block_size_tokens`-token blocks: the partial last
    block counts, as the Mooncake trace's hash_ids count it (vLLM hashes full blocks only; a request here is keyed
    whole, so that its last block can be cached and matched too). The one rule: a `Request`'s keys, a trace line's
    hash_ids, a `BlockHasher`'s keys and a decode engine's joining request are all counted by it.

    Raises:
        InvalidRequestError: `tokens` is not an integer in [0, MAX_TOKENS], or `block_size_tokens` not a positive
            integer; naming the value.
    """
    if type(tokens) is int and type(block_size_tokens) is int and 0 <= tokens <= MAX_TOKENS and block_size_tokens > 0:
        return ceil_div(tokens, block_size_tokens)  # the common case, one test
    for name, value, low in (("tokens", tokens, 0), ("block_size_tokens", block_size_tokens, 1)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
            raise InvalidRequestError(f"{name} must be an integer >= {low}, got {shown(value)}")
    if tokens > MAX_TOKENS:
        raise InvalidRequestError(f"tokens must be at most 2**40, got {shown(tokens)}")
    return ceil_div(int(tokens), int(block_size_tokens))


def prefix_reusable(prompt_logprobs: int | None) -> bool:
    """Whether a prefill asked for `prompt_logprobs` may start from a cached prefix: only when it lists none
    (None). A scored prompt is computed whole, since every position's logits are needed, not only its KV; vLLM
    skips reading its prefix cache for one too (`SamplingParams.skip_reading_prefix_cache`). The one rule: the
    prefill engine follows it, and the gateway and the vLLM router plan a request by it (`Request.reuses_prefix`)."""
    return prompt_logprobs is None


def check_token_count(name: str, value: Any) -> int:
    """`value` as a token count, an integer in [1, MAX_TOKENS].

    Raises:
        InvalidRequestError: anything else, naming `name` and the value.
    """
    if type(value) is int and 1 <= value <= MAX_TOKENS:  # the common case, one test (schedulers call this per request)
        return value
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or not 1 <= value <= MAX_TOKENS:
        raise InvalidRequestError(f"{name} must be an integer in [1, 2**40], got {shown(value)}")
    return int(value)


def _token_count(_instance: object, attribute: Any, value: Any) -> None:
    check_token_count(attribute.name, value)


class Tier(enum.IntEnum):
    """Storage tiers, ordered from fastest (smallest value) to slowest."""

    VRAM = 0
    DRAM = 1
    SSD = 2


def as_token_array(tokens: Any) -> npt.NDArray[np.int32]:
    """Tokens as a contiguous int32 array (no copy when they already are one): token ids, so non-negative. An
    int32 array is taken as it is, unread (the hashers' hot path: a pass over it would cost as much as hashing
    it); anything else is checked.

    Raises:
        InvalidRequestError: not a 1-D integer sequence, or a value outside [0, 2**31) (int32 arrays aside), naming
            the range of the values given.
    """
    if isinstance(tokens, Iterator):  # a generator or iterator: its items, not a 0-d object
        tokens = list(tokens)
    array = np.asarray(tokens)
    if array.ndim == 1 and array.dtype.kind in "fO":
        # Integers numpy holds in no integer dtype: an object array, or Python ints of mixed widths that numpy reads
        # as float64 ([1, 2**63], rounding them). Their own values decide, not the dtype numpy picked.
        items = array if array.dtype == object else tokens
        if array.size and all(is_int(t) for t in items):
            low, high = min(items), max(items)
            if low < 0 or high > _INT32.max:
                raise InvalidRequestError(f"token ids must lie in [0, 2**31), got range [{shown(low)}, {shown(high)}]")
            array = np.array(items, dtype=np.int32)
    if array.ndim != 1 or not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
        raise InvalidRequestError(f"tokens must be a 1-D integer sequence, got shape {array.shape} dtype {array.dtype}")
    if array.dtype != np.int32 and array.size:
        low, high = array.min(), array.max()
        if low < 0 or high > _INT32.max:
            raise InvalidRequestError(f"token ids must lie in [0, 2**31), got range [{low}, {high}]")
    return np.ascontiguousarray(array, dtype=np.int32)


def check_request_id(name: str, value: object) -> None:
    """A request id: a non-empty string; an integer passes too (the example gateway numbers its requests as its
    wire does). A `Request` and every scheduler event naming one check it so.

    Raises:
        InvalidRequestError: naming `name` and the value.
    """
    ok = bool(value) if isinstance(value, str) else isinstance(value, int) and not isinstance(value, bool)
    if not ok:
        raise InvalidRequestError(f"{name} must be a non-empty string, got {shown(value)}")


def check_block_key(key: object) -> BlockKey:
    """`key` as a block key: a Python int in [0, 2**256) (`BLOCK_KEY_LIMIT`; a numpy integer is one, converted; a
    bool, a float or a string is none, rather than coerced into another block's key).

    Raises:
        InvalidRequestError: anything else, naming the value.
    """
    try:
        value = operator.index(key)  # type: ignore[arg-type]
    except TypeError:
        value = -1
    if not 0 <= value < BLOCK_KEY_LIMIT or isinstance(key, bool):
        raise InvalidRequestError(f"a block key must be a non-negative integer below 2**256, got {shown(key)}")
    return BlockKey(value)


def key_tuple(keys: Iterable[int]) -> tuple[BlockKey, ...]:
    """`keys` as a tuple of block keys (`check_block_key`'s rule, in one pass: the converter of key fields).

    Raises:
        InvalidRequestError: a key is not an integer (numpy integers are; bools are not), is negative, or is not
            below 2**256.
    """
    try:
        is_iterator = iter(keys) is keys
    except TypeError:  # None, a number: no keys at all
        raise InvalidRequestError(f"block keys must be an iterable of integers, got {shown(keys)}") from None
    if type(keys) not in (tuple, list) and isinstance(keys, _NOT_KEYS):  # the common types, one test
        # A set or a dict has no order of its own to give (the chain's order is the prefix); bytes' items are ints,
        # but a prompt's bytes are no keys.
        raise InvalidRequestError(f"block keys must be an ordered sequence of integers, got {shown(keys)}")
    if is_iterator:  # a one-shot iterator: read twice below
        keys = tuple(keys)
    try:
        converted = tuple(map(operator.index, keys))
    except TypeError:
        position, key = next((i, k) for i, k in enumerate(keys) if not _is_index(k))
        raise InvalidRequestError(f"block keys must be integers, got {shown(key)} at position {position}") from None
    least = min(converted, default=2)
    if least < 0:
        raise InvalidRequestError(f"block keys must be non-negative integers, got {shown(least)}")
    if converted and max(converted) >= BLOCK_KEY_LIMIT:
        raise InvalidRequestError(f"block keys must be below 2**256, got {shown(max(converted))}")
    if least <= 1 and bool in map(type, keys):  # a bool reads as 0 or 1: only then can one be there
        raise InvalidRequestError("block keys must be integers, not bools")
    return cast("tuple[BlockKey, ...]", converted)


_NOT_KEYS = (AbstractSet, Mapping, bytes, bytearray, memoryview)


def repeated_key(keys: Sequence[int]) -> tuple[int, int, int] | None:
    """The first key a prompt's chain repeats, as (its first block, the repeat's block, the key); None when all
    differ, as a chain's must: block i's key names its whole prefix, blocks 0 to i, so no two blocks of one prompt
    share one, and a repeat would count as a hit on the prompt's own earlier block (an index's match, a cache's,
    a trace's reuse). The one rule: a `Request`'s keys and a trace line's hash_ids are checked by it."""
    if len(set(keys)) == len(keys):  # one set per prompt: every valid one passes here
        return None
    first: dict[int, int] = {}
    for block, key in enumerate(keys):
        if key in first:
            return first[key], block, key
        first[key] = block
    raise AssertionError("unreachable: the set was smaller")


def _is_index(value: object) -> bool:
    try:
        operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def _request_tokens(value: Any) -> npt.NDArray[np.int32] | None:
    if value is None:
        return None
    tokens = np.array(as_token_array(value))  # a private copy, so freezing it cannot surprise the caller
    if tokens.size and tokens.min() < 0:  # an int32 array is not read by as_token_array
        raise InvalidRequestError(f"token ids must be >= 0, got {tokens.min()}")
    tokens.flags.writeable = False
    return tokens


def _seconds(value: Any) -> Any:
    """An attrs converter: a finite real number (numpy's too) becomes a float; anything else is left for the
    validator."""
    return float(value) if is_finite_number(value) else value


def _tokens_eq(a: npt.NDArray[np.int32] | None, b: npt.NDArray[np.int32] | None) -> bool:
    if a is None or b is None:
        return a is b
    return bool(np.array_equal(a, b))


@attrs.frozen(kw_only=True)
class Request:
    """One inference request of a workload.

    Attributes:
        request_id: unique within its workload.
        arrival_s: arrival time in seconds from the start of the workload.
        input_length: prompt length in tokens (> 0).
        output_length: tokens to generate (> 0).
        block_keys: chained keys of the prompt's blocks, the last (partial) block included.
        tokens: the prompt's token ids when known (read-only int32 array of
            `input_length` entries); traces carry only keys.
        block_size_tokens: the tokens per block its keys were made with, when known (a
            `BlockHasher`'s; 512 for the published traces): then there is one key per block,
            ⌈input_length / block_size_tokens⌉, the partial last block included.
        reuses_prefix: whether its prefill may start from a cached prefix (the default); False for a prompt
            whose every position's logits are wanted (prompt log-probabilities, as vLLM scores them): the
            Conductor then routes and estimates it as computed whole, planning no prefix transfer, and the
            simulated instances compute it whole.
    """

    request_id: RequestId = attrs.field()
    arrival_s: float = attrs.field(converter=_seconds)
    input_length: int = attrs.field(converter=plain_int, validator=_token_count)
    output_length: int = attrs.field(converter=plain_int, validator=_token_count)
    block_keys: tuple[BlockKey, ...] = attrs.field(converter=key_tuple)
    tokens: npt.NDArray[np.int32] | None = attrs.field(
        default=None, converter=_request_tokens, eq=attrs.cmp_using(eq=_tokens_eq), hash=False, repr=False
    )
    block_size_tokens: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(int_at_least(1, error=InvalidRequestError))
    )
    reuses_prefix: bool = attrs.field(default=True)

    @request_id.validator
    def _check_id(self, _attribute: object, value: RequestId) -> None:
        check_request_id("request_id", value)

    @block_keys.validator
    def _check_keys(self, _attribute: object, value: tuple[BlockKey, ...]) -> None:
        repeat = repeated_key(value)
        if repeat is not None:
            raise InvalidRequestError(
                f"request {shown(self.request_id, quote=str)} repeats block key {shown(repeat[2])} (blocks {repeat[0]} "
                f"and {repeat[1]}): a chained key names its block's whole prefix, so no key repeats within one prompt"
            )

    @reuses_prefix.validator
    def _check_reuses_prefix(self, _attribute: object, value: bool) -> None:
        if type(value) is not bool:
            raise InvalidRequestError(f"reuses_prefix must be a bool, got {shown(value)}")

    @arrival_s.validator
    def _check_arrival(self, _attribute: object, value: float) -> None:
        require_number("arrival_s", value, minimum=0, error=InvalidRequestError)

    def __attrs_post_init__(self) -> None:
        if self.block_size_tokens is not None:  # keys made with a known block size: one per block of it
            self.check_block_size(self.block_size_tokens)

    def check_block_size(self, block_size_tokens: int) -> None:
        """Check that the request's keys are blocks of `block_size_tokens` (a scheduler's or a simulated cluster's):
        one key per block, the partial last one included, and made with that block size where it is known. The one
        check of the rule: construction calls it with the request's own block size.

        Raises:
            InvalidRequestError: a block size that is no integer >= 1; naming both block sizes, or the key count
                against the one expected.
        """
        require_int("block_size_tokens", block_size_tokens, minimum=1, error=InvalidRequestError)
        if self.block_size_tokens is not None and self.block_size_tokens != block_size_tokens:
            raise InvalidRequestError(
                f"request {shown(self.request_id, quote=str)} was keyed in {self.block_size_tokens}-token blocks, "
                f"this cluster's blocks are {shown(block_size_tokens)} tokens: key requests with the hasher whose "
                "block size it has"
            )
        expected = block_count(self.input_length, block_size_tokens)
        if len(self.block_keys) != expected:
            raise InvalidRequestError(
                f"request {shown(self.request_id, quote=str)} has {len(self.block_keys)} block keys, but "
                f"{self.input_length} tokens in {shown(block_size_tokens)}-token blocks make {expected} (one key per "
                "block, the partial last one included)"
            )

    @tokens.validator
    def _check_tokens(self, _attribute: object, value: npt.NDArray[np.int32] | None) -> None:
        if value is not None and value.size != self.input_length:
            raise InvalidRequestError(
                f"request {shown(self.request_id, quote=str)}: {value.size} tokens given for input_length "
                f"{self.input_length}"
            )


@attrs.frozen(kw_only=True)
class Slo:
    """Service-level objectives: time to first token and time between tokens, in seconds.

    The paper's experiments use TTFT 30 s and TBT 100, 200 or 300 ms; a request's
    TBT is the mean of its longest 10 % token intervals.
    """

    ttft_s: float = attrs.field(default=30.0, validator=positive)
    tbt_s: float = attrs.field(default=0.1, validator=positive)


def require_slo(slo: object) -> Slo:
    """`slo`, checked at the door of whatever takes objectives (the Conductor, admission's wait, a replay's clusters
    and context, `summarize`): the one check, worded alike everywhere.

    Raises:
        ConfigError: an `slo` that is no `Slo` (a misplaced argument, an SLO given as 30, would otherwise fail at
            the first request or after a whole replay, as a bare AttributeError).
    """
    if not isinstance(slo, Slo):
        raise ConfigError(f"slo must be a mooncake.types.Slo, got {shown(slo)}")
    return slo
