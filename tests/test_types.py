"""Request value object and token arrays: validation, read-only tokens, equality and hashing."""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake._checks import positive, shown
from mooncake.cache.hashing import BlockHasher
from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.types import (
    MAX_TOKENS,
    BlockKey,
    Request,
    RequestId,
    Slo,
    Tier,
    as_token_array,
    block_count,
    check_block_key,
    key_tuple,
    repeated_key,
)
from mooncake.workload.trace_record import check_block_count, check_distinct_ids
from tests.strategies import key_chains, token_arrays, token_ids


def make_request(**overrides: Any) -> Request:
    options: dict[str, Any] = {
        "request_id": RequestId("r1"),
        "arrival_s": 1.5,
        "input_length": 3,
        "output_length": 7,
        "block_keys": (BlockKey(10), BlockKey(11)),
    }
    options.update(overrides)
    return Request(**options)


# --------------------------------------------------------------------------- validation


def test_valid_request_keeps_its_fields() -> None:
    """A valid request stores its fields as given, block keys as a tuple and no tokens."""
    request = make_request(block_keys=[BlockKey(1), BlockKey(2)])
    assert request.request_id == "r1"
    assert request.arrival_s == 1.5
    assert (request.input_length, request.output_length) == (3, 7)
    assert request.block_keys == (1, 2)
    assert request.tokens is None


@pytest.mark.parametrize("field", ["input_length", "output_length"])
@pytest.mark.parametrize("value", [0, -1, -512, 2.0, 1.5, True, "3", None])
def test_non_positive_or_non_integer_lengths_are_rejected(field: str, value: object) -> None:
    """input_length and output_length must be positive ints (not bool, float or str); the error names both."""
    with pytest.raises(InvalidRequestError, match=field) as caught:
        make_request(**{field: value})
    assert repr(value) in str(caught.value)


@pytest.mark.parametrize("value", [None, "", b"r", 1.5, True])
def test_a_request_id_must_be_a_non_empty_string(value: object) -> None:
    """Ids key every table of in-flight requests and name requests in errors: a string, never empty."""
    with pytest.raises(InvalidRequestError, match="request_id must be a non-empty string"):
        Request(request_id=value, arrival_s=0.0, input_length=1, output_length=1, block_keys=[1])  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [-1, -0.001, math.inf, -math.inf, math.nan, True, False, "0", None, 10**400])
def test_invalid_arrival_is_rejected(value: object) -> None:
    """arrival_s must be a finite number >= 0 (bools, inf, NaN and an int past float's range rejected); the
    error names the value."""
    with pytest.raises(InvalidRequestError, match="arrival_s") as caught:
        make_request(arrival_s=value)
    assert shown(value) in str(caught.value)  # 10**400 by its size in bits, as `shown` names a long integer


@pytest.mark.parametrize("value", [0, 0.0, 3, 2.5, np.float64(7.25), 1e9])
def test_finite_non_negative_arrivals_are_accepted(value: float) -> None:
    """Any finite non-negative int or float arrival (numpy floats included) is accepted unchanged."""
    assert make_request(arrival_s=value).arrival_s == value


@pytest.mark.parametrize("count", [0, 2, 4])
def test_token_count_must_equal_input_length(count: int) -> None:
    """Giving a number of tokens other than input_length is rejected, naming both numbers."""
    with pytest.raises(InvalidRequestError, match=rf"\b{count} tokens given for input_length 3\b"):
        make_request(tokens=list(range(count)))


@pytest.mark.parametrize("bad", [-1, -(2**31)])
def test_negative_tokens_are_rejected(bad: int) -> None:
    """Negative token ids are rejected, naming the value."""
    with pytest.raises(InvalidRequestError, match=str(bad)):
        make_request(tokens=[0, bad, 2])


@pytest.mark.parametrize("bad", [2**31, 2**32 - 1, 2**63 - 1])
def test_tokens_beyond_int32_are_rejected(bad: int) -> None:
    """Token ids above int32's range are rejected, naming the value, whatever the input dtype."""
    for tokens in ([0, bad, 2], np.array([0, bad, 2], dtype=np.int64)):
        with pytest.raises(InvalidRequestError, match=str(bad)):
            make_request(tokens=tokens)


@pytest.mark.parametrize("tokens", [[[0, 1, 2]], [0.0, 1.0, 2.0], [True, False, True], ["a", "b", "c"], [0, 1, 2**64]])
def test_tokens_that_are_not_a_flat_integer_sequence_are_rejected(tokens: object) -> None:
    """2-D, float, bool, string and unrepresentable token sequences are rejected."""
    with pytest.raises(InvalidRequestError, match="token"):
        make_request(tokens=tokens)


# --------------------------------------------------------------------------- tokens


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint16])
def test_tokens_become_a_read_only_int32_copy(dtype: type) -> None:
    """Tokens are stored as a private read-only int32 array; later changes to the source do not leak in."""
    source = np.array([5, 6, 7], dtype=dtype)
    request = make_request(tokens=source)
    assert request.tokens is not None
    assert request.tokens.dtype == np.int32
    assert not request.tokens.flags.writeable
    assert not np.shares_memory(source, request.tokens)
    source[0] = 99
    assert request.tokens.tolist() == [5, 6, 7]
    with pytest.raises(ValueError):
        request.tokens[0] = 1


def test_tokens_from_a_list_are_read_only() -> None:
    """A plain list of token ids becomes a read-only int32 array too."""
    request = make_request(tokens=[0, 1, 2**31 - 1])
    assert request.tokens is not None
    assert request.tokens.dtype == np.int32 and not request.tokens.flags.writeable
    assert request.tokens.tolist() == [0, 1, 2**31 - 1]


def test_request_is_frozen() -> None:
    """Fields cannot be reassigned; attrs.evolve makes a validated copy."""
    request = make_request()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        request.input_length = 4  # type: ignore[misc]
    assert attrs.evolve(request, output_length=1).output_length == 1
    with pytest.raises(InvalidRequestError):
        attrs.evolve(request, output_length=0)


def test_as_token_array_does_not_copy_int32() -> None:
    """as_token_array returns a contiguous int32 array as it is, and converts other integer arrays."""
    tokens = np.arange(4, dtype=np.int32)
    assert np.shares_memory(as_token_array(tokens), tokens)
    converted = as_token_array(np.arange(4, dtype=np.int64)[::2])
    assert converted.dtype == np.int32 and converted.flags.c_contiguous
    assert converted.tolist() == [0, 2]
    assert as_token_array([]).dtype == np.int32


@pytest.mark.parametrize("tokens", [[2**31], [-(2**31) - 1], np.zeros((2, 2), dtype=np.int32), [0.5], 7])
def test_as_token_array_rejects_what_int32_cannot_hold(tokens: object) -> None:
    """as_token_array rejects out-of-range ids, non-1-D inputs and non-integers."""
    with pytest.raises(InvalidRequestError):
        as_token_array(tokens)


@given(tokens=st.lists(token_ids, max_size=50))
def test_as_token_array_preserves_values(tokens: list[int]) -> None:
    """Every int32-representable sequence converts to an int32 array with the same values."""
    array = as_token_array(tokens)
    assert array.dtype == np.int32 and array.ndim == 1
    assert array.tolist() == tokens


def test_tiers_are_ordered_fastest_first() -> None:
    """VRAM < DRAM < SSD."""
    assert Tier.VRAM < Tier.DRAM < Tier.SSD


# --------------------------------------------------------------------------- equality and hashing


def test_equality_and_hash_without_tokens() -> None:
    """Requests with equal fields are equal and hash equal; any differing field makes them unequal."""
    a, b = make_request(), make_request(block_keys=[BlockKey(10), BlockKey(11)])
    assert a == b and hash(a) == hash(b)
    assert len({a, b}) == 1
    assert a != make_request(request_id=RequestId("r2"))
    assert a != make_request(block_keys=(BlockKey(10),))
    assert a != make_request(arrival_s=1.0)


def test_equality_and_hash_with_tokens() -> None:
    """Tokens take part in equality by value (not identity); requests with tokens stay hashable."""
    a = make_request(tokens=[1, 2, 3])
    b = make_request(tokens=np.array([1, 2, 3], dtype=np.int64))
    assert a == b and hash(a) == hash(b)
    assert {a: "x"}[b] == "x"
    assert a != make_request(tokens=[1, 2, 4])
    assert a != make_request()  # tokens known vs unknown
    assert make_request() != a


@given(
    keys=key_chains(),
    tokens=token_arrays(max_size=20).filter(lambda t: t.size > 0),
    arrival_ms=st.integers(0, 10**9),
    output_length=st.integers(1, 10**6),
)
def test_equal_construction_gives_equal_hashable_requests(
    keys: tuple[BlockKey, ...], tokens: np.ndarray, arrival_ms: int, output_length: int
) -> None:
    """Two requests built from the same values are equal, hash equal, and equal their evolve copies."""
    fields: dict[str, Any] = {
        "request_id": RequestId("q"),
        "arrival_s": arrival_ms / 1000,
        "input_length": int(tokens.size),
        "output_length": output_length,
        "block_keys": keys,
    }
    a = Request(**fields, tokens=tokens)
    b = Request(**fields, tokens=tokens.tolist())
    assert a == b and hash(a) == hash(b)
    assert attrs.evolve(a) == a
    assert Request(**fields) == Request(**fields)
    assert hash(Request(**fields)) == hash(a)  # tokens do not enter the hash
    assert Request(**fields) != a


@pytest.mark.parametrize("keys", [(1, -1), (1.5,), ("a",), (None,)])
def test_block_keys_must_be_non_negative_integers(keys: tuple[object, ...]) -> None:
    """Negative, float, string and None keys are rejected when the request is made."""
    with pytest.raises(InvalidRequestError, match="block keys"):
        Request(request_id=RequestId("r"), arrival_s=0.0, input_length=1, output_length=1, block_keys=keys)


def test_numpy_integer_keys_become_python_ints() -> None:
    """Keys given as a numpy array are stored as plain ints (so traces can be written from them)."""
    request = Request(
        request_id=RequestId("r"),
        arrival_s=0.0,
        input_length=3,
        output_length=1,
        block_keys=np.arange(3, dtype=np.uint64),
    )
    assert request.block_keys == (0, 1, 2)
    assert all(type(k) is int for k in request.block_keys)


@given(
    input_length=st.integers(1, 5_000),
    block=st.integers(1, 1_024),
    delta=st.integers(-3, 3),
)
def test_a_keyed_request_has_exactly_one_key_per_block(input_length: int, block: int, delta: int) -> None:
    """With its block size given, a Request is valid iff it has ⌈input / block⌉ keys (the partial last block
    keyed); a wrong count is an InvalidRequestError naming both counts and the block size."""
    count = -(-input_length // block) + delta
    if count < 0:
        return
    keys = tuple(BlockKey(k) for k in range(count))

    def make() -> Request:
        return Request(
            request_id=RequestId("r"),
            arrival_s=0.0,
            input_length=input_length,
            output_length=1,
            block_keys=keys,
            block_size_tokens=block,
        )

    if delta == 0:
        assert len(make().block_keys) == math.ceil(input_length / block)
    else:
        with pytest.raises(
            InvalidRequestError, match=rf"has {count} block keys, but {input_length} tokens in {block}-token"
        ):
            make()


@pytest.mark.parametrize("keys", [[1, True], [1.0], ["1"], [-1], (k for k in (1, -2))])
def test_block_keys_that_are_no_non_negative_integers_are_refused(keys: Any) -> None:
    """One rule for a block key, for one (`check_block_key`) or many (`key_tuple`): a bool, a float or a string is
    refused, not coerced into another block's key (the messenger fetched block 1 for 1.5, "1" or True)."""
    with pytest.raises(InvalidRequestError, match="block key"):
        key_tuple(keys)
    for key in [1.5, "1", True, -1]:
        with pytest.raises(InvalidRequestError, match="block key"):
            check_block_key(key)


def test_block_keys_may_be_numpy_integers_or_a_generator_and_become_python_ints() -> None:
    """numpy integers (a key array's items) and a one-shot iterator are keys; each comes back a Python int."""
    assert key_tuple(np.array([3, 2**63], dtype=np.uint64)) == (3, 2**63)
    assert key_tuple(k for k in (4, 5)) == (4, 5)
    assert type(check_block_key(np.uint64(7))) is int and check_block_key(np.uint64(7)) == 7


@pytest.mark.parametrize("value", [np.int64(3), np.float32(2.5), np.float64(7.25), np.uint8(0)])
def test_a_numpy_arrival_is_a_number_as_everywhere_else(value: Any) -> None:
    """arrival_s takes what every other number field takes (`numbers.Real`, numpy's included), stored as a float: a
    numpy int64 or float32 was refused as "must be a finite number", which it is."""
    arrival = make_request(arrival_s=value).arrival_s
    assert type(arrival) is float and arrival == float(value)


@pytest.mark.parametrize("block", [0, -1, None, "16", True, 16.0])
def test_check_block_size_refuses_a_block_size_that_is_none(block: Any) -> None:
    """A block size is an integer >= 1, said so by name: 0 was a bare ZeroDivisionError, None or "16" a bare
    TypeError, -1 and True a count of -10 or 10 keys."""
    with pytest.raises(InvalidRequestError, match=rf"block_size_tokens must be an integer >= 1, got {shown(block)}"):
        make_request().check_block_size(block)


def test_the_key_count_rule_is_checked_in_one_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """Construction with a known block size applies `check_block_size` itself (architecture.md's "the one check"),
    so the rule and its message are the same whichever side finds a request keyed wrong."""
    seen: list[int] = []
    original = Request.check_block_size

    def spy(self: Request, block_size_tokens: int) -> None:
        seen.append(block_size_tokens)
        original(self, block_size_tokens)

    monkeypatch.setattr(Request, "check_block_size", spy)
    make_request(input_length=3, block_size_tokens=2)
    assert seen == [2]
    messages = []
    for build in (
        lambda: make_request(input_length=5, block_size_tokens=2),
        lambda: make_request(input_length=5).check_block_size(2),
    ):
        with pytest.raises(InvalidRequestError) as caught:
            build()
        messages.append(str(caught.value))
    assert (
        messages[0]
        == messages[1]
        == (
            "request r1 has 2 block keys, but 5 tokens in 2-token blocks make 3 (one key per block, the partial last one "
            "included)"
        )
    )


@pytest.mark.parametrize(
    "tokens", [np.array([1, 2], dtype=object), np.array([np.int64(1), 2], dtype=object), [0, 2**31 - 1]]
)
def test_as_token_array_converts_integers_that_fit_whatever_their_dtype(tokens: Any) -> None:
    """An object array of small ints (a list numpy kept as objects) holds token ids int32 holds: converted, not
    refused as "must fit in int32"."""
    array = as_token_array(tokens)
    assert array.dtype == np.int32 and array.tolist() == [int(t) for t in tokens]


@pytest.mark.parametrize(
    ("tokens", "low", "high"),
    [([1, 2**63], 1, 2**63), ([1, 2**63, -1], -1, 2**63), (np.array([5, 2**40], dtype=object), 5, 2**40)],
)
def test_as_token_array_names_the_real_range_of_integers_out_of_int32(tokens: Any, low: int, high: int) -> None:
    """[1, 2**63] (which numpy reads as float64) is refused for its range, named as given, not as "dtype float64"."""
    with pytest.raises(InvalidRequestError, match=rf"must lie in \[0, 2\*\*31\), got range \[{low}, {high}\]"):
        as_token_array(tokens)


@pytest.mark.parametrize(
    "keys", [{3, 1, 2}, frozenset({1}), {1: "a"}, {1: "a"}.keys(), b"\x01\x02", bytearray(b"\x01")]
)
def test_block_keys_must_come_in_an_order(keys: Any) -> None:
    """A chain of keys is ordered (its order is the prefix): a set, a dict (or its keys) and bytes, whose items are
    ints in an order of their own or none, are refused rather than taken as some other prefix."""
    with pytest.raises(InvalidRequestError, match="block keys must be an ordered sequence of integers, got"):
        key_tuple(keys)
    with pytest.raises(InvalidRequestError, match="block keys must be an ordered sequence"):
        make_request(block_keys=keys)


@pytest.mark.parametrize(("keys", "named"), [([1, 2, "3"], "'3' at position 2"), ((1.5,), "1.5 at position 0")])
def test_a_key_that_is_no_integer_is_named_with_its_position(keys: Any, named: str) -> None:
    """Which key is wrong, and where: not the TypeError's own text ("'str' object cannot be interpreted...")."""
    with pytest.raises(InvalidRequestError, match=rf"block keys must be integers, got {named}$"):
        key_tuple(keys)


def test_slo_seconds_are_checked_by_the_shared_validator() -> None:
    """Slo's objectives are `_checks.positive` itself, not a copy of it in types (one rule, one wording)."""
    assert all(field.validator is positive for field in attrs.fields(Slo))
    with pytest.raises(ConfigError, match=r"^ttft_s must be a finite number > 0, got 0$"):
        Slo(ttft_s=0)


@given(tokens=st.integers(0, 5_000), block=st.integers(1, 1_024))
def test_every_key_count_is_block_count(tokens: int, block: int) -> None:
    """One rule for how many keys a prompt has (`block_count`: the partial last block keyed), whoever counts: a
    `BlockHasher` (counted and made), a trace line's hash_ids check, a keyed `Request`."""
    count = block_count(tokens, block)
    assert (count - 1) * block < tokens <= count * block or tokens == count == 0
    hasher = BlockHasher(model="m", block_size_tokens=block)
    assert hasher.num_blocks(tokens) == len(hasher.block_keys(np.zeros(tokens, dtype=np.int32))) == count
    if tokens:
        check_block_count(count, tokens, block)
        with pytest.raises(ValueError, match="hash_ids for input_length"):
            check_block_count(count + 1, tokens, block)
        keys = tuple(BlockKey(k) for k in range(count))
        assert make_request(input_length=tokens, block_keys=keys, block_size_tokens=block).block_keys == keys


@given(
    bad=st.one_of(st.integers(-10, -1), st.floats(allow_nan=True), st.booleans(), st.text(max_size=3), st.none()),
    which=st.sampled_from(["tokens", "block_size_tokens"]),
)
def test_block_count_refuses_what_is_no_count_naming_it(bad: Any, which: str) -> None:
    """A token count below 0 or a block size below 1, or either not an integer, is an InvalidRequestError naming
    the argument and the value (it was a bare ZeroDivisionError, or a negative, fractional or NaN count)."""
    args = {"tokens": 5, "block_size_tokens": 16, which: bad}
    with pytest.raises(InvalidRequestError, match=f"^{which} must be an integer >= "):
        block_count(args["tokens"], args["block_size_tokens"])
    with pytest.raises(InvalidRequestError, match=r"^block_size_tokens must be an integer >= 1, got 0"):
        block_count(5, 0)
    with pytest.raises(InvalidRequestError, match=r"^tokens must be at most 2\*\*40"):
        block_count(MAX_TOKENS + 1, 16)
    assert block_count(np.int64(33), np.int32(16)) == block_count(MAX_TOKENS, MAX_TOKENS) + 2 == 3


@given(st.lists(st.integers(0, 6), max_size=10))
def test_a_request_whose_keys_repeat_is_refused_naming_the_first_repeat(keys: list[int]) -> None:
    """One rule for a chain's keys (`repeated_key`, the trace reader's too): all differ, or the first repeat is
    named with both its blocks; a `Request` refuses such a chain (a trace line repeating an id is refused, and a
    request made in code repeating one was accepted, then counted its own block as a cache hit)."""
    seen: dict[int, int] = {}
    expected = None
    for block, key in enumerate(keys):
        if key in seen:
            expected = (seen[key], block, key)
            break
        seen[key] = block
    assert repeated_key(keys) == expected
    if expected is None:
        assert make_request(block_keys=keys).block_keys == tuple(keys)
    else:
        first, repeat, key = expected
        with pytest.raises(
            InvalidRequestError, match=rf"request r1 repeats block key {key} \(blocks {first} and {repeat}\)"
        ):
            make_request(block_keys=keys)
        with pytest.raises(ValueError, match=rf"field 'hash_ids' repeats id {key} \(blocks {first} and {repeat}\)"):
            check_distinct_ids(keys)
