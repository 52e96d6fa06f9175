"""Chained block keys: definition, prefix property, namespaces, determinism, batch path, numba and plain paths."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from mooncake.cache._compiled import compiled_path, numba_available
from mooncake.cache.hashing import BlockHasher, reusable_prefix_tokens
from mooncake.errors import ConfigError, InvalidRequestError
from tests.strategies import small_token_ids, token_arrays

ALGORITHMS = ["xxh3_64", "xxh3_128", "sha256"]
block_sizes = st.integers(min_value=1, max_value=9)
requires_numba = pytest.mark.skipif(
    not numba_available(), reason="numba (the accel extra) is not installed: there is no compiled path to compare"
)


def hasher(**overrides: object) -> BlockHasher:
    options: dict[str, object] = {"model": "llama3-70b", "block_size_tokens": 4}
    options.update(overrides)
    return BlockHasher(**options)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- definition


@given(num_tokens=st.integers(1, 5000), cached_blocks=st.integers(0, 20), block_size=st.integers(1, 600))
def test_a_cached_prefix_saves_whole_blocks_short_of_the_last_token(
    num_tokens: int, cached_blocks: int, block_size: int
) -> None:
    """The reused tokens are whole cached blocks, none holding the last prompt token, and as many as that
    allows; one block more would reach past the cache or onto the last token."""
    reused = reusable_prefix_tokens(num_tokens, cached_blocks, block_size)
    assert reused % block_size == 0
    assert 0 <= reused <= min(cached_blocks * block_size, num_tokens - 1)
    assert reused + block_size > min(cached_blocks * block_size, num_tokens - 1)
    assert reusable_prefix_tokens(num_tokens, cached_blocks + 1, block_size) >= reused  # more cached, never less


@pytest.mark.parametrize(("num_tokens", "cached_blocks", "block_size"), [(-1, 0, 16), (100, -1, 16), (100, 1, 0)])
def test_reusable_prefix_refuses_negative_counts_and_empty_blocks(
    num_tokens: int, cached_blocks: int, block_size: int
) -> None:
    """A negative count or a block of no tokens is a clear error naming the values, not 0 or a ZeroDivisionError."""
    with pytest.raises(InvalidRequestError, match=f"got {num_tokens}, {cached_blocks} and {block_size}"):
        reusable_prefix_tokens(num_tokens, cached_blocks, block_size)


def test_keys_follow_the_documented_xxh3_chain() -> None:
    """key_i = XXH3-64(le64(key_{i-1}) || le32 tokens, seed), root = XXH3-64(namespace JSON, seed)."""
    h = hasher(seed=7)
    namespace = json.dumps(["mooncake.block/1", "xxh3_64", "llama3-70b", 4, ""], separators=(",", ":")).encode()
    root = xxhash.xxh3_64_intdigest(namespace, seed=7)
    first = xxhash.xxh3_64_intdigest(root.to_bytes(8, "little") + np.arange(4, dtype="<i4").tobytes(), seed=7)
    second = xxhash.xxh3_64_intdigest(first.to_bytes(8, "little") + np.array([4, 5], dtype="<i4").tobytes(), seed=7)
    assert h.root_key == root
    assert h.block_keys(list(range(6))) == (first, second)


def test_sha256_keys_follow_the_documented_chain() -> None:
    """sha256 mode: key_i = SHA-256(le256(key_{i-1}) || le32 tokens) read big-endian; seed joins the root."""
    h = hasher(algorithm="sha256", seed=3)
    namespace = json.dumps(["mooncake.block/1", "sha256", "llama3-70b", 4, ""], separators=(",", ":")).encode()
    root = int.from_bytes(hashlib.sha256(namespace + (3).to_bytes(8, "little")).digest(), "big")
    first = int.from_bytes(
        hashlib.sha256(root.to_bytes(32, "little") + np.arange(3, dtype="<i4").tobytes()).digest(), "big"
    )
    assert h.root_key == root
    assert h.block_keys([0, 1, 2]) == (first,)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_key_widths(algorithm: str) -> None:
    """Keys fit the algorithm's width and the last partial block is keyed."""
    h = hasher(algorithm=algorithm)
    keys = h.block_keys(np.arange(9))
    assert len(keys) == 3 == h.num_blocks(9)
    assert all(0 <= k < 2 ** (8 * h.key_bytes) for k in keys)
    assert h.block_keys([]) == ()


@given(tokens=token_arrays(max_size=40), split_blocks=st.integers(0, 10), block_size=block_sizes)
def test_parent_continues_a_chain(tokens: np.ndarray, split_blocks: int, block_size: int) -> None:
    """Hashing a prefix of whole blocks, then the rest from its last key, gives the whole chain."""
    h = hasher(block_size_tokens=block_size)
    cut = min(split_blocks * block_size, tokens.size)
    cut -= cut % block_size
    head = h.block_keys(tokens[:cut])
    tail = h.block_keys(tokens[cut:], parent=head[-1] if head else None)
    assert head + tail == h.block_keys(tokens)


# --------------------------------------------------------------------------- prefix property


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(
    a=token_arrays(max_size=30, elements=small_token_ids),
    b=token_arrays(max_size=30, elements=small_token_ids),
    block_size=block_sizes,
)
def test_equal_keys_iff_equal_prefixes(algorithm: str, a: np.ndarray, b: np.ndarray, block_size: int) -> None:
    """Keys agree exactly for the blocks before the first differing block, and differ from there on."""
    h = hasher(algorithm=algorithm, block_size_tokens=block_size)
    keys_a, keys_b = h.block_keys(a), h.block_keys(b)
    for i in range(min(len(keys_a), len(keys_b))):
        same_prefix = np.array_equal(a[: (i + 1) * block_size], b[: (i + 1) * block_size])
        assert (keys_a[i] == keys_b[i]) == same_prefix, f"block {i}"


@given(tokens=token_arrays(max_size=40), block_size=block_sizes)
def test_a_request_chain_has_distinct_keys(tokens: np.ndarray, block_size: int) -> None:
    """Keys of one chain are pairwise distinct, repeated block contents included."""
    h = hasher(block_size_tokens=block_size)
    repeated = np.concatenate([tokens[:block_size]] * 4) if tokens.size >= block_size else tokens
    keys = h.block_keys(repeated)
    assert len(set(keys)) == len(keys)


# --------------------------------------------------------------------------- namespaces


@pytest.mark.parametrize(
    "other",
    [
        {"model": "llama2-70b"},
        {"salt": "tenant-b"},
        {"seed": 1},
        {"algorithm": "xxh3_128"},
        {"algorithm": "sha256"},
    ],
)
@given(tokens=token_arrays(max_size=24))
def test_namespaces_separate_tenants(other: dict[str, object], tokens: np.ndarray) -> None:
    """Hashers differing in model, salt, seed or algorithm share no key for the same tokens."""
    base = hasher(salt="tenant-a")
    different = hasher(**{"salt": "tenant-a", **other})
    assert base.root_key != different.root_key
    assert not set(base.block_keys(tokens)) & set(different.block_keys(tokens))


def test_block_size_is_part_of_the_namespace() -> None:
    """The same tokens under two block sizes share no key, not even where blocks coincide."""
    tokens = np.arange(16)
    four = hasher(block_size_tokens=4).block_keys(tokens)
    eight = hasher(block_size_tokens=8).block_keys(tokens)
    assert not set(four) & set(eight)


def test_namespace_encoding_is_unambiguous() -> None:
    """Moving characters between model and salt changes the root (length-safe encoding)."""
    assert hasher(model="a\x00b", salt="c").root_key != hasher(model="a", salt="b\x00c").root_key


# --------------------------------------------------------------------------- determinism


def test_keys_are_identical_in_another_process() -> None:
    """A fresh interpreter with another PYTHONHASHSEED computes the same keys, for every algorithm."""
    script = (
        "import json, numpy as np\n"
        "from mooncake.cache.hashing import BlockHasher\n"
        "out = {}\n"
        "for a in ['xxh3_64', 'xxh3_128', 'sha256']:\n"
        "    h = BlockHasher(model='m', block_size_tokens=16, salt='s', seed=11, algorithm=a)\n"
        "    out[a] = [str(k) for k in h.block_keys(np.arange(1000) * 7919 % 50021)]\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    child = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120, check=True
    )
    theirs = json.loads(child.stdout)
    for algorithm in ALGORITHMS:
        h = BlockHasher(model="m", block_size_tokens=16, salt="s", seed=11, algorithm=algorithm)  # type: ignore[arg-type]
        assert theirs[algorithm] == [str(k) for k in h.block_keys(np.arange(1000) * 7919 % 50021)]


def test_token_types_do_not_change_keys() -> None:
    """Lists, int64 and int32 arrays of the same ids give the same keys."""
    h = hasher()
    ids = [5, 0, 2**31 - 1, 17, 3]
    assert (
        h.block_keys(ids) == h.block_keys(np.array(ids, dtype=np.int64)) == h.block_keys(np.array(ids, dtype=np.int32))
    )


# --------------------------------------------------------------------------- batch path


@requires_numba
def test_compiled_batch_path_is_available() -> None:
    """The numba path over xxhash's C routine is active here, so the tests below exercise it."""
    assert hasher().is_compiled
    assert not hasher(algorithm="sha256").is_compiled
    with compiled_path(False):
        assert not hasher().is_compiled
    assert hasher().is_compiled


@requires_numba
@given(
    requests=st.lists(token_arrays(max_size=1100), max_size=5),
    block_size=st.sampled_from([1, 2, 3, 7, 16, 61, 64, 512]),
    seed=st.integers(0, 2**64 - 1),
    parent=st.none() | st.integers(0, 2**64 - 1),
)
def test_keys_are_equal_with_and_without_numba(
    requests: list[np.ndarray], block_size: int, seed: int, parent: int | None
) -> None:
    """The plain path (xxhash's Python API, taken without numba) gives exactly the compiled path's keys."""
    h = hasher(block_size_tokens=block_size, seed=seed)
    flat = np.concatenate(requests) if requests else np.empty(0, np.int32)
    offsets = np.cumsum([0, *(r.size for r in requests)])

    def everything() -> tuple[object, ...]:
        batch = h.hash_batch(flat, offsets)
        chained = [h.block_keys(r, parent=parent) for r in requests]
        return batch.keys.dtype, batch.keys.tolist(), batch.offsets.tolist(), h.block_keys_many(requests), chained

    compiled = everything()
    with compiled_path(False):
        assert not h.is_compiled
        plain = everything()
    assert compiled == plain
    assert compiled[3] == [h._chain_python(r, h.root_key) for r in requests]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(
    requests=st.lists(token_arrays(max_size=70), max_size=6),
    block_size=st.sampled_from([1, 2, 3, 7, 16, 61, 64]),
)
def test_batch_equals_per_request(algorithm: str, requests: list[np.ndarray], block_size: int) -> None:
    """hash_batch / block_keys_many give exactly the per-request keys (and the pure-Python chain)."""
    h = hasher(algorithm=algorithm, block_size_tokens=block_size)
    expected = [h._chain_python(r, h.root_key) for r in requests]
    assert [h.block_keys(r) for r in requests] == expected
    assert h.block_keys_many(requests) == expected


def test_batch_handles_long_blocks() -> None:
    """Blocks past XXH3's 240-byte short path (512 tokens) agree between the paths."""
    rng = np.random.default_rng(0)
    h = hasher(block_size_tokens=512)
    requests = [rng.integers(0, 128_000, size=n, dtype=np.int32) for n in (1, 511, 512, 513, 5000)]
    assert h.block_keys_many(requests) == [h._chain_python(r, h.root_key) for r in requests]


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("block_size_tokens", 0),
        ("block_size_tokens", True),
        ("seed", -1),
        ("seed", 2**64),
        ("algorithm", "md5"),
        ("algorithm", ["xxh3_64"]),  # unhashable: no bare TypeError from the lookup
        ("algorithm", None),
    ],
)
def test_invalid_config_names_the_field(field: str, value: object) -> None:
    """Each invalid option (an algorithm that is no name of one too) raises ConfigError naming the field and
    value."""
    with pytest.raises(ConfigError, match=field) as caught:
        hasher(**{field: value})
    assert repr(value) in str(caught.value)


@pytest.mark.parametrize("tokens", [[[1, 2]], [2**31], [-(2**31) - 1], ["a"], [1.5], [-1, 2], np.array([3, -1])])
def test_invalid_tokens_are_rejected(tokens: object) -> None:
    """Tokens must be a 1-D integer sequence of token ids: in [0, 2**31), as a `Request`'s are."""
    with pytest.raises(InvalidRequestError):
        hasher().block_keys(tokens)


@pytest.mark.parametrize("offsets", [[1, 4], [0, 3], [0, 3, 2, 4], []])
def test_batch_rejects_bad_offsets(offsets: list[int]) -> None:
    """Offsets must rise from 0 to len(tokens)."""
    with pytest.raises(InvalidRequestError, match="offsets"):
        hasher().hash_batch(np.arange(4), offsets)


@pytest.mark.parametrize(
    "call",
    [
        lambda hasher: hasher.block_keys_many(None),
        lambda hasher: hasher.block_keys_many(5),
        lambda hasher: hasher.num_blocks("a"),
        lambda hasher: hasher.num_blocks(-5),
        lambda hasher: hasher.num_blocks(1.5),
        lambda hasher: hasher.num_blocks(True),
        lambda hasher: reusable_prefix_tokens("a", 1, 1),
        lambda hasher: reusable_prefix_tokens(None, 1, 1),
        lambda hasher: reusable_prefix_tokens(10, 1.5, 4),
        lambda hasher: reusable_prefix_tokens(10.5, 2, 4),
        lambda hasher: reusable_prefix_tokens(10, 2, 4.0),
        lambda hasher: reusable_prefix_tokens(10, True, 4),
        lambda hasher: reusable_prefix_tokens(np.int64(-1), 1, 4),
    ],
    ids=[
        "many-None", "many-int", "num_blocks-str", "num_blocks-negative", "num_blocks-float", "num_blocks-bool",
        "reusable-str", "reusable-None", "reusable-float-blocks", "reusable-float-tokens", "reusable-float-size",
        "reusable-bool", "reusable-numpy-negative",
    ],
)  # fmt: skip
def test_counts_that_are_no_integers_are_refused_by_name(call: Any) -> None:
    """A count that is not an integer (or is negative) is an InvalidRequestError, not a bare TypeError, a negative
    block count (-5 tokens made -1 blocks) or a fractional token count (1.5 cached blocks reused 6.0 tokens)."""
    with pytest.raises(InvalidRequestError):
        call(BlockHasher(model="m", block_size_tokens=4))


@given(st.integers(0, 10_000), st.integers(0, 100), st.integers(1, 64))
def test_reusable_prefix_tokens_takes_numpy_counts_as_the_ints_they_equal(tokens: int, blocks: int, size: int) -> None:
    """Counts read from numpy arrays (an index's prefix lengths) give the same int as Python ints."""
    expected = reusable_prefix_tokens(tokens, blocks, size)
    got = reusable_prefix_tokens(np.int64(tokens), np.int32(blocks), np.uint16(size))  # type: ignore[arg-type]
    assert type(got) is int and got == expected
    assert BlockHasher(model="m", block_size_tokens=size).num_blocks(np.int64(tokens)) == -(-tokens // size)  # type: ignore[arg-type]


@given(st.text(max_size=20), st.text(max_size=20), st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40))
def test_a_salted_hasher_shares_keys_with_its_own_salt_only(one: str, other: str, tokens: list[int]) -> None:
    """`salted(s)` keys the same tokens alike for the same s, apart from the plain hasher's and from another salt's
    (every block: the root differs); None or "" is the hasher itself; a salt that is no string is refused."""
    hasher = BlockHasher(model="m", block_size_tokens=4)
    plain = hasher.block_keys(tokens)
    assert hasher.salted(None) is hasher and hasher.salted("") is hasher  # vLLM salts with a non-empty salt only
    assert hasher.salted(one).block_keys(tokens) == hasher.salted(one).block_keys(tokens)
    if one:
        assert not set(hasher.salted(one).block_keys(tokens)) & set(plain)
    if one and other and one != other:
        assert not set(hasher.salted(one).block_keys(tokens)) & set(hasher.salted(other).block_keys(tokens))
    with pytest.raises(InvalidRequestError, match=r"^cache_salt must be a string, got 5$"):
        hasher.salted(5)  # type: ignore[arg-type]
