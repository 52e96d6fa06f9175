"""Bad arguments to the cache's public entry points: each a `MooncakeError` naming the argument and its value.

Where a bare TypeError or AttributeError came from deep inside (an unhashable key in a policy's dict, None
where a payload or batch goes, a generator read twice), or a wrong value passed silently (numpy 1.x
wrapping -1 to a held key, a layout name read as "map", a one-shot iterable of requests replayed once for
the first capacity only), the entry point now checks, once per call: no per-block work is added to the
paths the benchmarks measure.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.cache import index as index_module
from mooncake.cache.capacity import hit_ratio_curve, simulate_prefix_hits
from mooncake.cache.events import BlockRemoved, BlockStored
from mooncake.cache.index import BlockIndex, key_array
from mooncake.cache.policy import LengthAwarePolicy, LfuPolicy, LruPolicy, SievePolicy
from mooncake.cache.vllm_events import VllmEventDecoder, VllmEventEncoder
from mooncake.cache.vllm_wire import VllmEventBatch, decode_batch, encode_batch
from mooncake.errors import ConfigError, InvalidRequestError, MooncakeError, VllmEventError
from mooncake.types import InstanceId, Tier
from tests.cache.test_vllm_events import HASHER, SOURCE

POLICIES = [LruPolicy, LfuPolicy, LengthAwarePolicy, SievePolicy]

# ---------------------------------------------------------------------- negative keys under numpy 1.x


class Numpy126:
    """numpy as 1.26 (which pyproject allows) converts a negative Python int to uint64: wrapped to 2**64 - n
    (with a DeprecationWarning), where numpy 2 raises OverflowError. Everything else is numpy itself."""

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    @staticmethod
    def array(values: Any, dtype: Any = None, **options: Any) -> Any:
        if dtype is np.uint64 and isinstance(values, list | tuple) and all(type(v) is int for v in values):
            values = [v % 2**64 for v in values]
        return np.array(values, dtype=dtype, **options)


@pytest.mark.parametrize("keys", [[-1], [5, -1], (3, -(2**63)), [2**64 - 1, -1]])
def test_a_negative_key_is_refused_on_numpy_1(monkeypatch: pytest.MonkeyPatch, keys: list[int]) -> None:
    """The list branch of `key_array` checks for negatives itself, so -1 never becomes 2**64 - 1 (a real key an
    instance may hold): InvalidRequestError under numpy 1.x's conversion as under numpy 2's, and `match` never
    answers a prefix for it."""
    index = BlockIndex()
    index.apply(BlockStored(source=SOURCE, seq=0, keys=[2**64 - 1, 5], tier=Tier.VRAM))
    monkeypatch.setattr(index_module, "np", Numpy126())
    assert index_module.np.array([-1], dtype=np.uint64).tolist() == [2**64 - 1]  # the emulation wraps
    with pytest.raises(InvalidRequestError, match="non-negative"):
        key_array(keys)
    with pytest.raises(InvalidRequestError, match="non-negative"):
        index.match(keys)
    assert key_array([2**64 - 1, 0]).tolist() == [2**64 - 1, 0]  # the largest key is still a key


# ---------------------------------------------------------------------- a generator of requests


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=6).map(tuple), max_size=12),
    st.lists(st.integers(1, 8), min_size=1, max_size=4),
)
def test_a_curve_over_a_generator_equals_the_curve_over_its_list(
    requests: list[tuple[int, ...]], capacities: list[int]
) -> None:
    """`hit_ratio_curve` replays the requests once per capacity: a generator (or any one-shot iterable) gives the
    points its list gives, every one replaying every request (it was used up by the first capacity, the rest
    reporting 0 of 0 blocks)."""
    expected = hit_ratio_curve(requests, LruPolicy, capacities_blocks=capacities)
    assert hit_ratio_curve((r for r in requests), LruPolicy, capacities_blocks=iter(capacities)) == expected
    assert [p.total_blocks for p in expected] == [sum(map(len, requests))] * len(capacities)


# ---------------------------------------------------------------------- bad arguments, named


def generator() -> Iterator[int]:
    yield from (1, 2, 3)


CASES: dict[str, tuple[Callable[[], object], type[MooncakeError], str]] = {
    "event keys None": (
        lambda: BlockStored(source=SOURCE, seq=0, keys=None, tier=0),  # type: ignore[arg-type]
        InvalidRequestError,
        "None",
    ),
    "removed keys 5": (
        lambda: BlockRemoved(source=SOURCE, seq=0, keys=5, tier=0),  # type: ignore[arg-type]
        InvalidRequestError,
        "5",
    ),
    "a request that is an iterator": (
        lambda: simulate_prefix_hits([iter([1, 2, 3])], LruPolicy(), capacity_blocks=1),  # type: ignore[list-item]
        InvalidRequestError,
        "request",
    ),
    "a request that is a generator": (
        lambda: simulate_prefix_hits([generator()], LruPolicy(), capacity_blocks=1),  # type: ignore[list-item]
        InvalidRequestError,
        "request",
    ),
    "a request that is None": (
        lambda: simulate_prefix_hits([None], LruPolicy(), capacity_blocks=2),  # type: ignore[list-item]
        InvalidRequestError,
        "None",
    ),
    "capacities None": (
        lambda: hit_ratio_curve([[1]], LruPolicy, capacities_blocks=None),  # type: ignore[arg-type]
        ConfigError,
        "capacities_blocks.*None",
    ),
    "capacities [0]": (lambda: hit_ratio_curve([[1]], LruPolicy, capacities_blocks=[2, 0]), ConfigError, "0"),
    "curve requests None": (
        lambda: hit_ratio_curve(None, LruPolicy, capacities_blocks=[1]),  # type: ignore[arg-type]
        InvalidRequestError,
        "requests",
    ),
    "curve make_policy": (
        lambda: hit_ratio_curve([[1]], LruPolicy(), capacities_blocks=[1]),  # type: ignore[arg-type]
        ConfigError,
        "make_policy",
    ),
    "num_copies 'x'": (lambda: VllmEventDecoder(HASHER, SOURCE).num_copies("x", 0), VllmEventError, "block_hash.*'x'"),  # type: ignore[arg-type]
    "num_copies None": (lambda: VllmEventDecoder(HASHER, SOURCE).num_copies(None, 0), VllmEventError, "None"),  # type: ignore[arg-type]
    "translate None": (lambda: VllmEventDecoder(HASHER, SOURCE).translate(None, seq=0), VllmEventError, "batch.*None"),  # type: ignore[arg-type]
    "decode None": (lambda: VllmEventDecoder(HASHER, SOURCE).decode(None, seq=0), VllmEventError, "payload.*None"),  # type: ignore[arg-type]
    "decode_batch str": (lambda: decode_batch("abc"), VllmEventError, "payload.*'abc'"),  # type: ignore[arg-type]
    "to_vllm None": (lambda: VllmEventEncoder(HASHER).to_vllm(None), VllmEventError, "None"),  # type: ignore[arg-type]
    "forget None": (lambda: VllmEventEncoder(HASHER).forget(None), InvalidRequestError, "keys.*None"),  # type: ignore[arg-type]
    "encode ts 'now'": (lambda: VllmEventEncoder(HASHER).encode([], ts="now"), VllmEventError, "ts.*'now'"),  # type: ignore[arg-type]
    "encode_batch ts nan": (
        lambda: encode_batch(VllmEventBatch(ts=float("nan"), events=())),
        VllmEventError,
        "ts.*nan",
    ),
    "encode_batch None": (lambda: encode_batch(None), VllmEventError, "batch.*None"),  # type: ignore[arg-type]
    "encode_batch event 5": (
        lambda: encode_batch(VllmEventBatch(ts=1.0, events=(5,))),  # type: ignore[arg-type]
        VllmEventError,
        "5",
    ),
    "encode_batch rank 'r'": (
        lambda: encode_batch(VllmEventBatch(ts=1.0, events=(), data_parallel_rank="r")),  # type: ignore[arg-type]
        VllmEventError,
        "data_parallel_rank.*'r'",
    ),
    **{
        f"{policy.__name__}.{method} [1]": (
            (lambda policy=policy, method=method: getattr(policy(), method)([1])),
            InvalidRequestError,
            r"hashable.*\[1\]",
        )
        for policy in POLICIES
        for method in ("access", "remove", "pin", "unpin")
    },
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_argument_is_a_mooncake_error_naming_it(case: str) -> None:
    """Each raises the library's error (no bare TypeError, ValueError or AttributeError), naming the argument or
    its value."""
    call, error, pattern = CASES[case]
    with pytest.raises(error, match=pattern):
        call()


@pytest.mark.parametrize("name", ["event_layout", "batch_layout"])
@pytest.mark.parametrize("layout", ["xml", "ARRAY", "", None, 0])
def test_encode_batch_refuses_a_layout_it_does_not_know(name: str, layout: Any) -> None:
    """Only "array" and "map" are layouts: anything else was silently written as a map."""
    with pytest.raises(ConfigError, match=f"{name}.*{re.escape(repr(layout))}"):
        encode_batch(VllmEventBatch(ts=1.0, events=()), **{name: layout})
    assert encode_batch(VllmEventBatch(ts=1.0, events=()), **{name: "array"})  # the two are still taken
    assert encode_batch(VllmEventBatch(ts=1.0, events=()), **{name: "map"})


@pytest.mark.parametrize("policy_type", POLICIES)
def test_an_unhashable_key_leaves_a_policy_as_it_was(policy_type: type[LruPolicy]) -> None:
    """A refused access inserts nothing and does not move the clock: the policy evicts as if it never came."""
    refused, clean = policy_type(), policy_type()
    for policy in (refused, clean):
        for position, key in enumerate((1, 2, 3)):
            policy.access(key, parent=key - 1 if key > 1 else None, position=position)
    with pytest.raises(InvalidRequestError):
        refused.access([4])  # type: ignore[arg-type]
    refused.check_invariants()
    assert len(refused) == 3
    refused.access(1)
    clean.access(1)
    assert [refused.evict() for _ in range(4)] == [clean.evict() for _ in range(4)]


def test_a_decoder_refusing_a_bad_batch_argument_changes_nothing() -> None:
    """`translate(None)` is refused before a restart or a sequence check could move anything."""
    d = VllmEventDecoder(HASHER, InstanceId("v"))
    with pytest.raises(VllmEventError):
        d.translate(None, seq=0)  # type: ignore[arg-type]
    with pytest.raises(VllmEventError):
        d.translate(None, seq=5)  # type: ignore[arg-type]
    assert (d.epoch, d.expected_seq) == (0, 0)
