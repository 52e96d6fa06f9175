"""Tests for `mooncake.sched._kernels`: the Conductor's per-instance scans, compiled and plain.

Each kernel is checked on both paths (numba's compiled one where it imports,
the same functions as plain Python otherwise) against the rule it stands for
written out in plain Python: `roofline_step` against `RooflineStep.step_s` to
the bit, `best_decode_slot` against `check_join` and `step_s` instance by
instance, `shortest_by_length` against a sort of the instances by (prefix,
queue, weight, slot).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.cache._compiled import compiled_path, kernels, numba_available
from mooncake.sched.join import UNLIMITED, DecodeLimits, DecodeLoad, check_join
from mooncake.sched.step import RooflineStep, StepBranch

PATHS = [False, pytest.param(True, marks=pytest.mark.skipif(not numba_available(), reason="numba is not installed"))]


@pytest.fixture(scope="module", params=PATHS, ids=["plain", "compiled"])
def scans(request: pytest.FixtureRequest) -> Any:
    """The kernels of one path (the namespace keeps its path's functions once the switch is back)."""
    with compiled_path(request.param):
        return kernels("mooncake.sched._kernels")


coefficient = st.floats(-1.0, 1.0, allow_nan=False) | st.sampled_from([0.0, 1e-9, 3e-5])
branches = st.lists(st.builds(StepBranch, coefficient, coefficient, coefficient), min_size=1, max_size=3)
rooflines = st.builds(RooflineStep, branches, overhead_s=st.floats(0, 0.01))


@given(rooflines, st.integers(1, 10_000), st.integers(0, 10**9))
def test_roofline_step_is_step_s_to_the_bit(scans: Any, roofline: RooflineStep, batch: int, context: int) -> None:
    assert scans.roofline_step(roofline.coefficients, roofline.overhead_s, batch, context) == roofline.step_s(
        batch, context
    )


limits = st.builds(
    DecodeLimits,
    kv_capacity_tokens=st.integers(0, 20_000),
    max_batch_size=st.none() | st.integers(1, 4),
    max_context_tokens=st.none() | st.integers(1, 12_000),
)
instances = st.tuples(
    limits,
    st.booleans(),  # up
    st.tuples(st.integers(0, 6), st.integers(0, 50_000), st.integers(0, 20_000)),  # checked (batch, context, KV)
    st.tuples(st.integers(0, 6), st.integers(0, 50_000)),  # ranked (batch, context)
)


@given(
    st.lists(instances, max_size=8),
    st.integers(1, 8000),
    st.integers(1, 4000) | st.just(1),
    rooflines,
)
def test_best_decode_slot_is_the_rule_instance_by_instance(
    scans: Any, board: list[Any], prompt: int, output: int, roofline: RooflineStep
) -> None:
    """The slot up that `check_join` (without its TBT check) lets in on the checked load, with the lowest
    `step_s` on the ranked load plus the request (the first of equal steps; -1 when none), and the
    `step_s` there on the checked load plus the request: what `check_join` predicts."""
    want, best = -1, math.inf
    for slot, (limit, up, (batch, _, kv), (rank_batch, rank_context)) in enumerate(board):
        load = DecodeLoad(batch, 0, kv)
        if up and check_join(limit, load, prompt_tokens=prompt, output_tokens=output).accepted:
            step = roofline.step_s(rank_batch + 1, rank_context + prompt)
            if step < best:
                want, best = slot, step

    def column(values: list[int]) -> np.ndarray:
        return np.array(values, dtype=np.int64)

    got, predicted = scans.best_decode_slot(
        prompt,
        output,
        np.array([up for _, up, _, _ in board], dtype=bool),
        column([batch for _, _, (batch, _, _), _ in board]),
        column([context for _, _, (_, context, _), _ in board]),
        column([kv for _, _, (_, _, kv), _ in board]),
        column([UNLIMITED if lim.max_batch_size is None else lim.max_batch_size for lim, *_ in board]),
        column([lim.kv_capacity_tokens for lim, *_ in board]),
        column([UNLIMITED if lim.max_context_tokens is None else lim.max_context_tokens for lim, *_ in board]),
        column([rank_batch for *_, (rank_batch, _) in board]),
        column([rank_context for *_, (_, rank_context) in board]),
        roofline.coefficients,
        roofline.overhead_s,
    )
    assert got == want
    if want >= 0:
        _, _, (batch, context, _), _ = board[want]
        assert predicted == roofline.step_s(batch + 1, context + prompt)


@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from([-math.inf, 0.0, 1.0, 2.5]), st.sampled_from([0.0, 0.25, 0.5])),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from([0.0, 1.0, 3.0]),
    st.booleans(),
)
def test_shortest_by_length_is_the_first_of_each_length_in_sorted_order(
    scans: Any, board: list[tuple[int, float, float]], now: float, weighed: bool
) -> None:
    """Per prefix length (in order of first appearance), the slot first in the order (queue, -weight,
    slot), the queue being max(busy - now, 0); tied: some length's shortest queue is shared."""
    own = np.array([length for length, _, _ in board], dtype=np.int64)
    busy = np.array([until for _, until, _ in board])
    weight = np.array([w for _, _, w in board]) if weighed else np.zeros(0)
    queue = [max(until - now, 0.0) for _, until, _ in board]
    lengths = list(dict.fromkeys(own.tolist()))
    want = []
    tied = False
    for length in lengths:
        members = [slot for slot in range(len(board)) if own[slot] == length]
        shortest = min(queue[slot] for slot in members)
        at_shortest = [slot for slot in members if queue[slot] == shortest]
        tied = tied or len(at_shortest) > 1
        want.append(min(at_shortest, key=lambda slot: (-weight[slot] if weighed else 0.0, slot)))
    got, got_tied = scans.shortest_by_length(own, busy, now, weight)
    assert got.tolist() == want
    assert got_tied == tied


@pytest.mark.skipif(not numba_available(), reason="numba is not installed: nothing to compile")
def test_warm_up_compiles_every_scan() -> None:
    """`python -m mooncake.sched.warm_up` (what make runs after installing) leaves each scan the
    Conductor calls compiled (their callees compile into them)."""
    from mooncake.sched import _kernels, warm_up

    with compiled_path(True):
        warm_up.main()
    called = ("best_decode_slot", "shortest_by_length", "pending_add", "pending_remove", "pending_rehash")
    for name in (*called, "pending_find", "pending_walk"):
        assert getattr(_kernels, name).signatures, f"{name} was not compiled"
