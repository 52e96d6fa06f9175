"""Bad input to `mooncake.sched.router`: every router refuses it alike, by name, before any kernel reads it.

A negative prefix count reached the compiled rendezvous kernel (`sched._kernels.rendezvous_weights`), which indexed
a prompt's keys by it with no lower bound: garbage weights, or a segfault, where the plain path raised IndexError; a
float count was truncated. A NaN `now` timed every instance at NaN, which admission's `ttft > slo` then let through;
None for the candidates, the query or the prefix counts raised TypeError in one router, AttributeError in another
and returned None in a third. Each is now an InvalidRequestError naming the field and the value, on both paths.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest

from mooncake.cache._compiled import compiled_path, numba_available
from mooncake.errors import InvalidRequestError
from mooncake.sched.cost import HARDWARE, MODELS, PrefillCostModel, TransferCostModel
from mooncake.sched.router import (
    KvCacheCentricRouter,
    LoadBalancingRouter,
    PrefixBlocks,
    RandomRouter,
    RoundRobinRouter,
    RouteQuery,
    TtftEstimator,
    spread_weights,
)
from mooncake.sched.view import PrefillBoard, PrefillView
from mooncake.types import InstanceId

PATHS = [False, pytest.param(True, marks=pytest.mark.skipif(not numba_available(), reason="numba is not installed"))]
LLAMA3 = MODELS["llama3-70b"]
ESTIMATOR = TtftEstimator(
    prefill=PrefillCostModel(model=LLAMA3, hardware=HARDWARE["8xA800"]),
    transfer=TransferCostModel(bandwidth_bytes_per_s=100e9),
    kv_bytes_per_token=LLAMA3.kv_bytes_per_token,
)
ROUTERS = [KvCacheCentricRouter, LoadBalancingRouter, RandomRouter, RoundRobinRouter]
A, B = InstanceId("a"), InstanceId("b")
KEYS = np.arange(1, 33, dtype=np.uint64)


@pytest.fixture(params=PATHS, ids=["plain", "compiled"])
def path(request: pytest.FixtureRequest) -> Any:
    with compiled_path(request.param):
        yield request.param


def query(**fields: Any) -> RouteQuery:
    return RouteQuery(input_tokens=8192, block_size_tokens=256, **{"prefix_blocks": {}, "block_keys": KEYS, **fields})


BAD_COUNTS = [-1, -40, -(10**7), 2.9, 2.0, np.float64(3.0), math.nan, "3", None, True]


@pytest.mark.parametrize("count", BAD_COUNTS, ids=repr)
def test_a_prefix_count_that_is_no_block_count_is_refused_by_name(count: Any) -> None:
    """A count below 0 (which the compiled kernel read keys before the first by), a float (truncated: 2.9 blocks
    counted as 2), NaN, text, None or a bool: InvalidRequestError naming `prefix_blocks[instance]` and the value,
    from a plain mapping and from a `PrefixBlocks` array alike."""
    with pytest.raises(InvalidRequestError, match=r"prefix_blocks\['b'\] must be an integer"):
        query(prefix_blocks={A: 3, B: count})
    if isinstance(count, int | float) and not isinstance(count, bool) and not math.isnan(count):
        with pytest.raises(InvalidRequestError, match=rf"prefix_blocks\['a'\] must be an integer .*got {count}"):
            PrefixBlocks((A, B), np.array([count, 0]))


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("count", [-40, -(10**7)])
def test_a_negative_prefix_count_never_reaches_a_router(path: bool, router: Any, count: int) -> None:
    """The reviewer's crash: a query holding a negative count cannot be built, so no router (on either path) indexes
    by it; a uint64 count past int64's range (which would wrap negative in the kernel's int64) neither."""
    with pytest.raises(InvalidRequestError, match=rf"prefix_blocks\['a'\].*got {count}"):
        router(estimator=ESTIMATOR).route(
            [PrefillView(A), PrefillView(B)], query(prefix_blocks={A: count, B: count}), 0.0, random.Random(0)
        )
    with pytest.raises(InvalidRequestError, match=r"prefix_blocks\['a'\]"):
        PrefixBlocks((A, B), np.array([2**64 - 1, 0], dtype=np.uint64))


def test_prefix_blocks_must_be_a_mapping_with_a_count_per_instance() -> None:
    """None (an AttributeError in the load-balancing routers, nothing at all in the KV-centric one) or a list is no
    mapping; a `PrefixBlocks` array whose length is not its instances' is refused (the kernels would read past the
    board's arrays)."""
    for value in (None, [1, 2], 3):
        with pytest.raises(InvalidRequestError, match="prefix_blocks must be a mapping"):
            query(prefix_blocks=value)
    with pytest.raises(InvalidRequestError, match=r"prefix_blocks must hold one block count per instance \(2\), got 3"):
        PrefixBlocks((A, B), np.array([1, 2, 3]))
    with pytest.raises(InvalidRequestError, match=r"prefix_blocks\['a'\] must be an integer"):
        PrefixBlocks((A, B), np.array([[1, 2], [3, 4]]))


def test_good_prefix_counts_are_taken_as_int64() -> None:
    """numpy integers in a mapping, and a `PrefixBlocks` array of another integer type, are block counts: the
    array is held as int64 (what the kernels are compiled for)."""
    assert query(prefix_blocks={A: np.int32(3), B: 0}).prefix_blocks[A] == 3
    held = PrefixBlocks((A, B), np.array([3, 0], dtype=np.uint16))
    assert held.blocks.dtype == np.int64 and dict(held) == {A: 3}


@pytest.mark.parametrize("field", ["best_blocks", "best_holders", "best_transfers_in_flight"])
@pytest.mark.parametrize("value", [-1, 3.5, None, "2", True])
def test_the_best_holders_counts_are_integers_of_at_least_0(field: str, value: Any) -> None:
    """best_blocks 3.5 was refused only at route, as a prefix of 896.0 tokens; -1 transfers in flight as a
    ConfigError of the transfer model's. Each is an InvalidRequestError naming the field, at the query."""
    with pytest.raises(InvalidRequestError, match=rf"{field} must be an integer >= 0, got {value!r}"):
        query(prefix_blocks={A: 3}, best_instance=A, **{field: value})


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("now", [math.nan, math.inf, -math.inf, "0", None, True])
def test_every_router_refuses_a_now_that_is_no_finite_time(path: bool, router: Any, now: Any) -> None:
    """A NaN now timed every instance at a NaN TTFT (which `ttft > slo` lets through); "0" was a numba typing
    dump on one path and a TypeError on the other. Every router: InvalidRequestError naming now."""
    with pytest.raises(InvalidRequestError, match=r"now must be a finite number, got"):
        router(estimator=ESTIMATOR).route([PrefillView(A), PrefillView(B)], query(), now, random.Random(0))


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("candidates", [None, 3, "ab", [PrefillView(A), "b"], (A, B)], ids=repr)
def test_every_router_refuses_candidates_that_are_no_views(path: bool, router: Any, candidates: Any) -> None:
    """None was a TypeError in the KV-centric router and "no instance" (None) in the others; each router now
    refuses it, and anything else that is not a sequence of `PrefillView`, by name."""
    with pytest.raises(InvalidRequestError, match=r"candidates must be a sequence of PrefillView"):
        router(estimator=ESTIMATOR).route(candidates, query(), 0.0, random.Random(0))


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("bad", [None, {}, "q"], ids=repr)
def test_every_router_refuses_a_query_that_is_no_route_query(router: Any, bad: Any) -> None:
    with pytest.raises(InvalidRequestError, match=r"query must be a RouteQuery"):
        router(estimator=ESTIMATOR).route([PrefillView(A)], bad, 0.0, random.Random(0))


@pytest.mark.parametrize("router", ROUTERS)
def test_no_candidates_is_still_no_decision(router: Any) -> None:
    """An empty sequence or board is no instance up: None, as before (not an error)."""
    for empty in ([], (), PrefillBoard([])):
        assert router(estimator=ESTIMATOR).route(empty, query(), 0.0, random.Random(0)) is None


@pytest.mark.parametrize("own", [[-1, 0], [-(10**7), -(10**7)], [2.9, 1.0], [1, 2, 3]], ids=repr)
def test_spread_weights_refuses_counts_it_would_index_keys_by_wrongly(path: bool, own: list[Any]) -> None:
    """`spread_weights` is public: a negative count read before the keys on the compiled path (garbage, or a
    segfault at -10**7) and raised IndexError on the plain one; a float was truncated; a count per instance
    too many read past the ids' hashes. Each: InvalidRequestError naming `own`, before the kernel."""
    with pytest.raises(InvalidRequestError, match=r"own"):
        spread_weights(KEYS, np.array(own), [A, B])


def test_spread_weights_takes_any_integer_counts_alike(path: bool) -> None:
    """Counts as a list, an int32 or int64 array weigh the same (and past the last key weigh the last)."""
    expected = spread_weights(KEYS, np.array([3, 99], dtype=np.int64), [A, B]).tolist()
    assert spread_weights(KEYS, [3, 99], [A, B]).tolist() == expected
    assert spread_weights(KEYS, np.array([3, 99], dtype=np.int32), [A, B]).tolist() == expected


@pytest.mark.parametrize("router", ROUTERS)
def test_every_router_refuses_two_views_of_one_instance(router: Any) -> None:
    """A board keeps one slot per id: the second view of an id took a slot no id named, so its queue was never
    read (or one instance was chosen for another's load). Refused by name, as any board built from them is."""
    views = [PrefillView(A), PrefillView(B), PrefillView(A)]
    with pytest.raises(InvalidRequestError, match=r"views must name each instance once, got 'a' twice"):
        router(estimator=ESTIMATOR).route(views, query(), 0.0, random.Random(0))
    with pytest.raises(InvalidRequestError, match=r"got 'a' twice"):
        PrefillBoard(views)


@pytest.mark.parametrize("best", [3, b"a", "", ("a",)], ids=repr)
def test_the_best_instance_is_none_or_an_instance_id(best: Any) -> None:
    """Any other value matched no candidate, so the query's best prefix silently counted for nothing."""
    with pytest.raises(InvalidRequestError, match=r"best_instance must be None or an instance id string, got"):
        query(prefix_blocks={A: 3}, best_instance=best, best_blocks=3)
