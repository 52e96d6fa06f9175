"""Edge contracts of the block index, its key table and the block hasher that `test_index.py`,
`test_key_table.py` and `test_hashing.py` leave open (found by a mutation round; the eviction policies had no
survivor that was not equivalent, so none are tested here).

Key conversion: `key_array` (what `match`, `prefix_lengths` and `resync` take) refuses what it would otherwise
truncate or wrap, and folds wide keys as documented. Slots: a departed instance's slot is reused, so churn does
not grow the table. Sequencing: a gap from an unknown source records "nothing applied yet". Key table: at most
3/4 full. Hasher: the parent key's width, the namespace fields' types, the seed of every algorithm, the batch
offsets. Four were defects of the product: nested or 0-D keys crashed the key table with numba's or numpy's own
errors, `prefix_lengths` answered a list changed in place from its old lookup, `KeyBatch[-1]` was empty, a numpy
block size failed the hasher with a TypeError. Runs on the default path (numba-compiled kernels where numba
imports); nothing here depends on which.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from mooncake.cache._key_table import KeyTable
from mooncake.cache.events import BlockStored
from mooncake.cache.hashing import BlockHasher
from mooncake.cache.index import BlockIndex, SourceSnapshot, key_array
from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.types import BlockKey, InstanceId, Tier

A, B = InstanceId("node-a"), InstanceId("node-b")


def stored(source: InstanceId, seq: int, keys: list[int], tier: Tier = Tier.VRAM, epoch: int = 0) -> BlockStored:
    return BlockStored(source=source, seq=seq, keys=tuple(BlockKey(k) for k in keys), tier=tier, epoch=epoch)


def folded(key: int) -> int:
    """The documented fold: a key below 2**64 is itself, a wider one its XXH3-64 (little-endian, minimal bytes)."""
    if key < 2**64:
        return key
    return xxhash.xxh3_64_intdigest(key.to_bytes((key.bit_length() + 7) // 8, "little"))


# ---------------------------------------------------------------------------- key conversion


@pytest.mark.parametrize(
    "keys",
    [
        *(pytest.param(np.array([3, -1], dtype=dtype), id=f"negative-{dtype}") for dtype in ("i1", "i2", "i4", "i8")),
        pytest.param([1.5], id="float-list"),
        pytest.param([2, np.float64(2.5)], id="numpy-float-in-list"),
        pytest.param(np.array([0.5, 1.0]), id="float-array"),
        pytest.param([1, -(2**70)], id="wide-negative"),
    ],
)
def test_keys_that_would_be_truncated_or_wrapped_are_refused(keys: object) -> None:
    """A negative signed array, a fractional float or a wide negative key is an InvalidRequestError in `key_array`,
    `match`, `prefix_lengths` and `resync`, never silently wrapped to 2**64 - 1 or truncated to an integer (which
    could match a key that is held)."""
    index = BlockIndex()
    index.apply(stored(A, 0, [0, 1, 2, 3, 2**64 - 1]))
    with pytest.raises(InvalidRequestError, match="non-negative integers"):
        key_array(keys)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="non-negative integers"):
        index.match(keys)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="non-negative integers"):
        index.prefix_lengths(keys, [A])  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="non-negative integers"):
        index.resync(B, {Tier.DRAM: keys}, epoch=0, seq=-1)  # type: ignore[dict-item]
    assert index.instances == (A,)  # the refused resync installed nothing
    index.check_invariants()


@given(
    keys=st.lists(st.integers(0, 2**64 - 1) | st.integers(2**64, 2**256 - 1), max_size=12),
    container=st.sampled_from(["list", "tuple", "iterator"]),
)
def test_key_array_equals_the_documented_fold(keys: list[int], container: str) -> None:
    """`key_array` gives, per key, the key itself below 2**64 and its XXH3-64 otherwise, from any iterable."""
    given_keys = {"list": list, "tuple": tuple, "iterator": iter}[container](keys)
    array = key_array(given_keys)
    assert array.dtype == np.uint64 and array.ndim == 1
    assert array.tolist() == [folded(k) for k in keys]


@given(st.lists(st.integers(0, 2**63 - 1), max_size=12), st.sampled_from(["u1", "u4", "u8", "i2", "i8"]))
def test_integer_arrays_convert_value_for_value(values: list[int], dtype: str) -> None:
    """A non-negative integer array of any width gives the same uint64 keys as the list of its values."""
    info = np.iinfo(dtype)
    array = np.array([v % (int(info.max) + 1) for v in values], dtype=dtype)
    assert key_array(array).tolist() == array.tolist()
    assert key_array(array).dtype == np.uint64


@pytest.mark.parametrize(
    "keys",
    [
        pytest.param([[1, 2]], id="list-of-lists"),
        pytest.param(np.array([[1, 2]], dtype=np.uint64), id="2d-uint64"),
        pytest.param(np.array([[1], [2]], dtype=np.int64), id="2d-int64"),
        pytest.param(np.array(1, dtype=np.uint64), id="0d-uint64"),
        pytest.param([1.0, 2], id="whole-float"),  # numpy read it as key 1, which the tiered cache refuses
        pytest.param([True], id="bool"),
        pytest.param(["1"], id="numeric-string"),
    ],
)
def test_keys_that_are_not_a_flat_sequence_are_an_invalid_request(keys: object) -> None:
    """A key list whose items are themselves lists (or a 2-D / 0-D array) has keys that are not integers: `match`
    says so with an InvalidRequestError, as it does for any other non-integer key (a whole float, a bool or a
    numeric string, which numpy would read as an integer key, as the tiered cache refuses them)."""
    index = BlockIndex()
    index.apply(stored(A, 0, [1, 2]))
    with pytest.raises(InvalidRequestError):
        index.match(keys)  # type: ignore[arg-type]


@pytest.mark.parametrize("probe", ["x", -1, 1.5, None, b"\x01"], ids=repr)
def test_membership_of_a_non_key_is_false_not_an_error(probe: object) -> None:
    """`x in index` answers False for anything that is not a block key (a str, a negative int, a float, None, a
    bool), as `in` on any container does, while the same values are refused by `holders`."""
    index = BlockIndex()
    index.apply(stored(A, 0, [0, 1]))
    assert (probe in index) is False
    assert BlockKey(1) in index


# ---------------------------------------------------------------------------- slots and sequencing


def test_a_departed_instance_slot_is_reused_so_churn_does_not_grow_the_table() -> None:
    """Sixteen instances fill one word of holder bits; each later one joins after another left and takes the freed
    slot (the lowest free one), so `nbytes` never grows however many instances come and go."""
    index = BlockIndex()
    live = [InstanceId(f"node-{i:03d}") for i in range(16)]
    for instance in live:
        index.apply(stored(instance, 0, [1, 2]))
    baseline = index.nbytes()
    for n in range(16, 60):
        gone = live.pop(n % len(live))
        index.remove_instance(gone)
        newcomer = InstanceId(f"node-{n:03d}")
        index.apply(stored(newcomer, 0, [1, 2, 3]))
        live.append(newcomer)
        assert index.nbytes() == baseline, f"after instance {newcomer} joined"
        assert dict(index.match([1, 2, 3]).lengths) == {i: (3 if i >= "node-016" else 2) for i in live}
    index.check_invariants()


def test_prefix_lengths_follows_a_list_changed_in_place() -> None:
    """`prefix_lengths(keys, instances)` answers for the instances the list holds now, in its order: a caller
    that reuses one list object and appends or reorders it gets one length per instance, as `match` says."""
    index = BlockIndex()
    index.apply(stored(A, 0, [1, 2]))
    index.apply(stored(B, 0, [1]))
    instances = [A]
    assert index.prefix_lengths([1, 2], instances).tolist() == [2]
    instances.append(B)
    assert index.prefix_lengths([1, 2], instances).tolist() == [2, 1]
    instances.reverse()
    assert index.prefix_lengths([1, 2], instances).tolist() == [1, 2]


def test_a_gap_from_an_unknown_source_records_that_nothing_was_applied() -> None:
    """A never-seen source whose first event is past seq 0 is known as stale with seq -1 (nothing applied yet) in
    the epoch it announced, and holds nothing; a snapshot and its restore say the same."""
    index = BlockIndex()
    assert index.apply(stored(A, 4, [1], epoch=3), strict=False) is not None
    want = SourceSnapshot(source=A, epoch=3, seq=-1, is_stale=True, keys_by_tier=())
    assert index.snapshot().sources == (want,)
    assert BlockIndex.restore(index.snapshot()).snapshot().sources == (want,)


@given(batches=st.lists(st.lists(st.integers(0, 2**64 - 1), max_size=40), max_size=8))
def test_the_key_table_doubles_before_passing_three_quarters_load(batches: list[list[int]]) -> None:
    """After every add the table is a power of two of at least 16 entries, at most 3/4 full (so a probe run always
    ends at an empty entry), and every key added is found."""
    table = KeyTable(capacity=16, num_slots=1)
    added: set[int] = set()
    for batch in batches:
        table.add(np.array(batch, dtype=np.uint64), 0, 1)
        added.update(batch)
        capacity = table.keys.size
        assert capacity >= 16 and capacity & (capacity - 1) == 0
        assert table.size == len(added) <= capacity * 3 // 4, (table.size, capacity)
    assert all(table.find(key) >= 0 for key in added)


# ---------------------------------------------------------------------------- hasher arguments


@pytest.mark.parametrize("algorithm", ["xxh3_64", "xxh3_128", "sha256"])
def test_a_parent_key_must_fit_the_algorithm_width(algorithm: str) -> None:
    """`parent` is a key of the algorithm's width: 2**bits - 1 continues a chain (as `_chain_python` computes it),
    while 2**bits, a negative key, a bool, a float or a string is an InvalidRequestError naming the width."""
    h = BlockHasher(model="m", block_size_tokens=2, algorithm=algorithm)  # type: ignore[arg-type]
    bits = 8 * h.key_bytes
    top = 2**bits - 1
    tokens = np.array([5, 6, 7], dtype=np.int32)
    assert h.block_keys(tokens, parent=BlockKey(top)) == h._chain_python(tokens, top)
    for parent in (2**bits, -1, True, 1.0, "5"):
        with pytest.raises(InvalidRequestError, match=f"parent must be a {bits}-bit key"):
            h.block_keys(tokens, parent=parent)  # type: ignore[arg-type]


def test_xxh3_128_keys_follow_the_documented_seeded_chain() -> None:
    """XXH3-128 mode: root = XXH3-128(namespace JSON, seed), key_i = XXH3-128(le128(key_{i-1}) || le32 tokens,
    seed); the seed is the hash seed, as for XXH3-64 (the existing documented-chain tests cover XXH3-64 and
    SHA-256 only)."""
    h = BlockHasher(model="m", block_size_tokens=2, seed=9, algorithm="xxh3_128")
    namespace = json.dumps(["mooncake.block/1", "xxh3_128", "m", 2, ""], separators=(",", ":")).encode()
    root = xxhash.xxh3_128_intdigest(namespace, seed=9)
    first = xxhash.xxh3_128_intdigest(root.to_bytes(16, "little") + np.array([7, 8], "<i4").tobytes(), seed=9)
    second = xxhash.xxh3_128_intdigest(first.to_bytes(16, "little") + np.array([9], "<i4").tobytes(), seed=9)
    assert h.root_key == root
    assert h.block_keys([7, 8, 9]) == (first, second)


@pytest.mark.parametrize("algorithm", ["xxh3_64", "xxh3_128", "sha256"])
@given(
    tokens=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=12),
    seeds=st.sets(st.integers(0, 2**64 - 1), min_size=2, max_size=2),
)
def test_hashers_differing_only_in_seed_share_no_key(algorithm: str, tokens: list[int], seeds: set[int]) -> None:
    """The seed is part of every algorithm's namespace: two seeds never share a root or a key for the same tokens."""
    one, other = (BlockHasher(model="m", block_size_tokens=3, seed=s, algorithm=algorithm) for s in seeds)  # type: ignore[arg-type]
    assert one.root_key != other.root_key
    assert not set(one.block_keys(tokens)) & set(other.block_keys(tokens))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("model", "", "model must be a non-empty string"),
        ("model", None, "model must be a non-empty string"),
        ("model", 5, "model must be a non-empty string"),
        ("salt", None, "salt must be a string"),
        ("salt", 5, "salt must be a string"),
    ],
)
def test_namespace_text_fields_must_be_strings(field: str, value: object, message: str) -> None:
    """Model and salt join every key's namespace as JSON text: None or a number would key another namespace
    than its text (5 and "5"), so they are a ConfigError naming the field; an empty salt is the default."""
    with pytest.raises(ConfigError, match=message):
        BlockHasher(**{"model": "m", "block_size_tokens": 2, field: value})  # type: ignore[arg-type]
    assert (
        BlockHasher(model="m", block_size_tokens=2, salt="").root_key
        == BlockHasher(model="m", block_size_tokens=2).root_key
    )


@pytest.mark.parametrize("algorithm", ["xxh3_64", "xxh3_128", "sha256"])
def test_a_numpy_seed_keys_as_the_same_python_int(algorithm: str) -> None:
    """A numpy integer seed is the Python int of its value: same root, same keys, equal hashers (SHA-256 puts the
    seed's bytes in the namespace, so a numpy scalar left unconverted would not even build one)."""
    plain = BlockHasher(model="m", block_size_tokens=2, seed=3, algorithm=algorithm)  # type: ignore[arg-type]
    numpy_seed = BlockHasher(model="m", block_size_tokens=2, seed=np.uint64(3), algorithm=algorithm)  # type: ignore[arg-type]
    assert type(numpy_seed.seed) is int
    assert numpy_seed == plain
    assert numpy_seed.block_keys([1, 2, 3]) == plain.block_keys([1, 2, 3])


@pytest.mark.parametrize("size", [np.int64(4), np.int32(4), np.uint16(4)], ids=repr)
def test_a_numpy_block_size_is_the_python_int(size: object) -> None:
    """A block size given as a numpy integer (read from an array or a numpy config) makes the same hasher as the
    Python int, as a numpy seed does, rather than failing inside the namespace encoding."""
    hasher = BlockHasher(model="m", block_size_tokens=size)  # type: ignore[arg-type]
    assert hasher == BlockHasher(model="m", block_size_tokens=4)
    assert hasher.block_keys(list(range(9))) == BlockHasher(model="m", block_size_tokens=4).block_keys(list(range(9)))


@pytest.mark.parametrize(
    "offsets",
    [
        pytest.param([0.0, 4.0], id="floats"),
        pytest.param(np.array([0.0, 2.5, 4.0]), id="fractional"),
        pytest.param([[0, 4]], id="2d-row"),
        pytest.param(np.array([[0], [2], [4]]), id="2d-column"),
    ],
)
def test_batch_offsets_must_be_one_flat_run_of_integers(offsets: object) -> None:
    """Offsets that are floats (even whole ones) or not one-dimensional are an InvalidRequestError about the
    offsets, not a numpy error from inside or a silent rounding."""
    h = BlockHasher(model="m", block_size_tokens=2)
    with pytest.raises(InvalidRequestError, match="offsets"):
        h.hash_batch(np.arange(4), offsets)


def test_a_key_batch_indexes_from_the_end_like_a_sequence() -> None:
    """`KeyBatch` has a length and an item per request: `batch[-1]` is the last request's keys (as for a list of
    them), `batch[-len(batch)]` the first, and an index past either end is an IndexError."""
    h = BlockHasher(model="m", block_size_tokens=2)
    batch = h.hash_batch(np.arange(6), [0, 2, 6])
    requests = [batch[0], batch[1]]
    assert requests == [h.block_keys([0, 1]), h.block_keys([2, 3, 4, 5])]
    assert [batch[-1], batch[-2]] == [requests[1], requests[0]]
    for outside in (2, -3):
        with pytest.raises(IndexError):
            batch[outside]


@pytest.mark.parametrize(
    "call",
    [
        lambda index: index.match(b"abc"),
        lambda index: index.match(bytearray(b"abc")),
        lambda index: index.match(memoryview(b"abc")),
        lambda index: index.match({1: 2}),
        lambda index: index.prefix_lengths([1], None),
        lambda index: index.prefix_lengths([1], "p0"),
        lambda index: index.prefix_lengths([1], [["p0"]]),
        lambda index: index.prefix_lengths([1], 3),
        lambda index: index.num_blocks([1]),
        lambda index: index.num_blocks(None),
        lambda index: index.remove_instance([1]),
        lambda index: index.remove_instance(None),
    ],
    ids=[
        "match-bytes", "match-bytearray", "match-memoryview", "match-dict", "lengths-None", "lengths-str",
        "lengths-nested", "lengths-int", "num_blocks-list", "num_blocks-None", "remove-list", "remove-None",
    ],
)  # fmt: skip
def test_queries_refuse_what_is_no_key_sequence_or_instance_by_name(call: Any) -> None:
    """Bytes (read as their small ints: block 97...) and a mapping (read as its keys) are no key sequence; None, a
    string or a nested list is no sequence of instances; a list is no instance id: each an InvalidRequestError,
    not an answer about other keys nor a bare TypeError. The index is unchanged."""
    index = BlockIndex()
    index.apply(BlockStored(source=InstanceId("p0"), seq=0, keys=(97, 98, 99, 1), tier=Tier.DRAM))
    with pytest.raises(InvalidRequestError):
        call(index)
    assert index.match([97, 98, 99]).lengths == {"p0": 3} and index.num_blocks(InstanceId("p0")) == 4
    index.check_invariants()


def test_prefix_lengths_still_answers_for_a_tuple_or_a_list_of_instances() -> None:
    """The check on `instances` refuses only what is none: a tuple (kept) and a list (looked up anew) answer."""
    index = BlockIndex()
    index.apply(BlockStored(source=InstanceId("p0"), seq=0, keys=(1, 2), tier=Tier.DRAM))
    for instances in (("p1", "p0"), ["p0", "p1"]):
        lengths = index.prefix_lengths([1, 2, 3], instances)  # type: ignore[arg-type]
        assert lengths.tolist() == [2 if name == "p0" else 0 for name in instances]
