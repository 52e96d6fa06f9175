"""Tests for `mooncake.sched._kernels`: the Conductor's per-instance scans, compiled and plain.

Each kernel is checked on both paths (numba's compiled one where it imports,
the same functions as plain Python otherwise) against the rule it stands for
written out in plain Python: `roofline_step` against `RooflineStep.step_s` to
the bit, `best_decode_slot` against `check_join` and `step_s` instance by
instance, `shortest_by_length` against a sort of the instances by (prefix,
queue, weight, slot), `rendezvous_weights` against splitmix64 in Python integers.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.cache._compiled import compiled_path, kernels, numba_available
from mooncake.errors import ConfigError
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


QUARTER = sys.float_info.max / 4  # what each term of a branch may reach
FEATURE = 2**63 - 1  # the largest batch size or context an int64 array holds
extreme = st.floats(-2.0, 2.0) | st.sampled_from([-1.0, 1.0, 1.0 - 2**-52, 1.0 + 2**-52])  # of the largest allowed


@given(
    st.lists(st.tuples(extreme, extreme, extreme), min_size=1, max_size=3),
    st.integers(1, FEATURE) | st.just(FEATURE),
    st.integers(0, FEATURE) | st.just(FEATURE),
)
def test_a_branch_that_could_overflow_is_refused_and_any_other_steps_finitely_and_alike(
    scans: Any, scales: list[tuple[float, float, float]], batch: int, context: int
) -> None:
    """A branch whose terms could leave a quarter of a float's range (for a batch or context up to 2**63) is
    refused, naming the coefficient; with every other, a step is finite, and the scan's equals `step_s` (a NaN
    step, where an inf term met a -inf one, is what Python's max and the scan's comparison disagreed on)."""
    rows = [(QUARTER * a, QUARTER / 2.0**63 * b, QUARTER / 2.0**63 * c) for a, b, c in scales]
    fits = all(abs(a) <= 1 and abs(b) <= 1 and abs(c) <= 1 for a, b, c in scales)
    if not fits:
        with pytest.raises(ConfigError, match="is too large"):
            RooflineStep([StepBranch(*row) for row in rows])
        return
    roofline = RooflineStep([StepBranch(*row) for row in rows])
    step = roofline.step_s(batch, context)
    assert math.isfinite(step)
    assert scans.roofline_step(roofline.coefficients, roofline.overhead_s, batch, context) == step


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
    # decoding (batch, prompts, outputs, starts)
    st.tuples(st.integers(0, 6), st.integers(0, 50_000), st.integers(0, 20_000), st.floats(0.0, 60.0)),
)


def grown(roofline: RooflineStep, batch: int, context: int, output: int, started_s_sum: float, now: float) -> float:
    """The reference: the decoding seconds sum(now - start) over the step the batch runs now, rounded down, at most
    the batch's outputs (none for an empty batch, a NaN now, or a step that takes no time)."""
    if batch <= 0 or math.isnan(now):
        return 0.0
    decoded_s, step_s = batch * now - started_s_sum, roofline.step_s(batch, context)
    # min before floor: a subnormal step makes the quotient infinite, which has no integer floor
    return float(math.floor(min(decoded_s / step_s, output))) if decoded_s > 0 and step_s > 0 else 0.0


@given(
    rooflines,
    st.integers(0, 8),
    st.integers(0, 10**6),
    st.integers(0, 10**6),
    st.floats(0.0, 100.0),
    st.floats(0.0, 100.0),
)
def test_grown_tokens_is_the_decoding_seconds_over_the_step(
    scans: Any, roofline: RooflineStep, batch: int, context: int, output: int, started_s_sum: float, now: float
) -> None:
    coefficients, overhead_s = roofline.coefficients, roofline.overhead_s
    got = scans.grown_tokens(coefficients, overhead_s, batch, context, output, started_s_sum, now)
    assert got == grown(roofline, batch, context, output, started_s_sum, now) <= output
    assert scans.grown_tokens(coefficients, overhead_s, batch, context, output, started_s_sum, math.nan) == 0


@given(
    st.lists(instances, max_size=8),
    st.integers(1, 8000),
    st.integers(1, 4000) | st.just(1),
    rooflines,
    st.just(math.nan) | st.floats(0.0, 100.0),
    st.booleans(),
    st.sampled_from([0.0, 0.01, math.inf]) | st.floats(0.0, 0.1),
)
def test_best_decode_slot_is_the_rule_instance_by_instance(
    scans: Any,
    board: list[Any],
    prompt: int,
    output: int,
    roofline: RooflineStep,
    now: float,
    grow_checked: bool,
    tbt_slo_s: float,
) -> None:
    """Among the slots up that `check_join`'s structural checks let in on the checked load, those its TBT check
    (`check_join` with the roofline and the objective) passes on that load first, then the lowest `step_s` on the
    ranked load, its context grown by what its decoding requests generated by now, plus the request (the first of
    equal steps; -1 when none); with it the `step_s` there on the checked load plus the request (its context grown
    too with grow_checked), what `check_join` predicts, and whether its TBT check passed."""
    options = []
    for slot, (limit, up, (batch, context, kv), (rank_batch, rank_context), decoding) in enumerate(board):
        if (
            not up
            or not check_join(limit, DecodeLoad(batch, 0, kv), prompt_tokens=prompt, output_tokens=output).accepted
        ):
            continue
        extra = grown(roofline, *decoding, now)
        checked = DecodeLoad(batch, context + (extra if grow_checked else 0.0), kv)
        verdict = check_join(
            limit, checked, prompt_tokens=prompt, output_tokens=output, step_model=roofline, tbt_slo_s=tbt_slo_s
        )
        # The grown tokens are a whole float (rounded down): a count, as step_s takes it.
        step = roofline.step_s(rank_batch + 1, rank_context + int(extra) + prompt)
        predicted = roofline.step_s(batch + 1, context + (int(extra) if grow_checked else 0) + prompt)
        options.append((not verdict.accepted, step, slot, predicted, verdict.accepted))

    def column(values: list[int]) -> np.ndarray:
        return np.array(values, dtype=np.int64)

    got = scans.best_decode_slot(
        prompt,
        output,
        np.array([up for _, up, *_ in board], dtype=bool),
        column([batch for _, _, (batch, _, _), *_ in board]),
        column([context for _, _, (_, context, _), *_ in board]),
        column([kv for _, _, (_, _, kv), *_ in board]),
        column([UNLIMITED if lim.max_batch_size is None else lim.max_batch_size for lim, *_ in board]),
        column([lim.kv_capacity_tokens for lim, *_ in board]),
        column([UNLIMITED if lim.max_context_tokens is None else lim.max_context_tokens for lim, *_ in board]),
        column([rank_batch for *_, (rank_batch, _), _ in board]),
        column([rank_context for *_, (_, rank_context), _ in board]),
        roofline.coefficients,
        roofline.overhead_s,
        now,
        column([batch for *_, (batch, _, _, _) in board]),
        column([context for *_, (_, context, _, _) in board]),
        column([output for *_, (_, _, output, _) in board]),
        np.array([started for *_, (_, _, _, started) in board], dtype=np.float64),
        grow_checked,
        tbt_slo_s,
    )
    if not options:
        assert got[0] == -1
        return
    _, _, want, predicted, passes = min(options, key=lambda option: option[:3])
    assert (got[0], got[1], bool(got[2])) == (want, predicted, passes)


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


def _splitmix64_weight(key: int, seed: int) -> float:
    """The rendezvous weight written out in Python integers: splitmix64's finalizer of (key xor seed) plus the
    golden gamma, its top 53 bits as a fraction of 1."""
    mask = 2**64 - 1
    x = ((key ^ seed) + 0x9E3779B97F4A7C15) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return ((x ^ (x >> 31)) >> 11) / 2**53


@given(
    st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=6),
    st.lists(st.tuples(st.integers(0, 8), st.integers(0, 2**64 - 1)), max_size=5),
)
def test_rendezvous_weights_are_splitmix64_of_the_first_missing_key_xor_the_seed(
    scans: Any, keys: list[int], instances: list[tuple[int, int]]
) -> None:
    """Each instance weighs the key of the first block it lacks (the last key when it holds them all) xor its seed,
    bit for bit on both paths (the integers wrap at 64 bits as splitmix64's do)."""
    own = np.array([held for held, _ in instances], dtype=np.int64)
    seeds = np.array([seed for _, seed in instances], dtype=np.uint64)
    got = scans.rendezvous_weights(np.array(keys, dtype=np.uint64), own, seeds).tolist()
    assert got == [_splitmix64_weight(keys[min(held, len(keys) - 1)], seed) for held, seed in instances]


@pytest.mark.skipif(not numba_available(), reason="numba is not installed: nothing to compile")
def test_warm_up_compiles_every_scan() -> None:
    """`python -m mooncake.sched.warm_up` (what make runs after installing) leaves each scan the
    Conductor calls compiled (their callees compile into them)."""
    from mooncake.sched import _kernels, warm_up

    with compiled_path(True):
        warm_up.main()
    called = ("best_decode_slot", "shortest_by_length", "rendezvous_weights", "pending_add", "pending_remove")
    called += ("pending_rehash",)
    for name in (*called, "pending_find", "pending_walk"):
        assert getattr(_kernels, name).signatures, f"{name} was not compiled"
