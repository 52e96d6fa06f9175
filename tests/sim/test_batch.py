"""Tests for `mooncake.sim.batch.ContinuousBatch`: the closed forms against stepping one by one.

Properties check `stretch_s` against summing `step_s` step by step, `steps_within`
against the brute-force largest k with stretch_s(k) <= t, and the intervals
`advance` records against per-step times; a state machine joins, advances,
stalls and retires members of a batch and of a naive reference that steps one
token at a time and keeps every interval.
"""

from __future__ import annotations

import math

import attrs
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mooncake.sched.cost import HARDWARE, MODELS, DecodeCostModel, LinearStepModel
from mooncake.sim.batch import ContinuousBatch, Member
from mooncake.sim.metrics import RequestRecord
from mooncake.types import RequestId

DECODE = DecodeCostModel(model=MODELS["llama3-70b"], hardware=HARDWARE["8xA800"])
A800_FIXED_S = DECODE.step_s(1, 0)
A800_PER_TOKEN_S = DECODE.step_s(1, 1) - A800_FIXED_S

step_fixed = st.sampled_from([A800_FIXED_S, 1e-3, 0.05]) | st.floats(min_value=1e-4, max_value=0.1)
step_per_token = st.sampled_from([0.0, A800_PER_TOKEN_S, 1e-6]) | st.floats(min_value=0.0, max_value=1e-5)
contexts = st.lists(st.integers(min_value=1, max_value=20_000), min_size=1, max_size=6)


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def make_member(name: str, *, remaining: int, context: int, gap_s: float = 0.0) -> Member:
    record = RequestRecord(RequestId(name), 0.0, context, remaining + 1)
    return Member(record, remaining, context, gap_s)


def make_batch(a: float, b: float, member_contexts: list[int], *, remaining: int = 10**6) -> ContinuousBatch:
    batch = ContinuousBatch(LinearStepModel(a, b))
    for i, context in enumerate(member_contexts):
        batch.join(make_member(str(i), remaining=remaining, context=context))
    return batch


def stepped_times(a: float, b: float, context: int, batch_size: int, steps: int) -> list[float]:
    """Each step's time, stepping one by one: every step adds a token per member."""
    times = []
    for _ in range(steps):
        times.append(a + b * context)
        context += batch_size
    return times


@given(step_fixed, step_per_token, contexts, st.integers(min_value=0, max_value=300))
def test_stretch_is_the_sum_of_the_steps(a: float, b: float, member_contexts: list[int], steps: int) -> None:
    """stretch_s(k) equals Σ step_s over k steps, each with the contexts grown by the steps before."""
    batch = make_batch(a, b, member_contexts)
    expected = math.fsum(stepped_times(a, b, sum(member_contexts), len(member_contexts), steps))
    assert close(batch.stretch_s(steps), expected)
    assert batch.stretch_s(0) == 0.0
    assert close(batch.step_s(), a + b * sum(member_contexts))
    assert close(batch.step_s(extra_context=7), a + b * (sum(member_contexts) + 7))


@given(step_fixed, step_per_token, contexts, st.floats(min_value=-1.0, max_value=5.0))
def test_steps_within_is_the_largest_k_that_fits(
    a: float, b: float, member_contexts: list[int], elapsed_s: float
) -> None:
    """steps_within(t) is the largest k with stretch_s(k) <= t (0 for t <= 0)."""
    batch = make_batch(a, b, member_contexts)
    k = batch.steps_within(elapsed_s)
    if elapsed_s <= 0:
        assert k == 0
        return
    assert batch.stretch_s(k) <= elapsed_s
    assert batch.stretch_s(k + 1) > elapsed_s
    brute = 0
    while batch.stretch_s(brute + 1) <= elapsed_s:
        brute += 1
    assert k == brute


@given(step_fixed, step_per_token, contexts, st.integers(min_value=1, max_value=50))
def test_steps_within_is_exact_at_step_boundaries(a: float, b: float, member_contexts: list[int], k: int) -> None:
    """At exactly stretch_s(k) the k-th step is done; just before it, it is not."""
    batch = make_batch(a, b, member_contexts)
    boundary = batch.stretch_s(k)
    assert batch.steps_within(boundary) == k
    assert batch.steps_within(math.nextafter(boundary, 0.0)) == k - 1


def test_an_empty_batch_does_no_steps() -> None:
    """Without members nothing advances: no steps within any time, no step time."""
    batch = ContinuousBatch(LinearStepModel(A800_FIXED_S, A800_PER_TOKEN_S))
    assert batch.steps_within(10.0) == 0
    assert len(batch) == 0 and batch.context == 0


@given(step_fixed, step_per_token, contexts, st.integers(min_value=1, max_value=200), st.floats(0.0, 10.0))
def test_advance_records_the_per_step_intervals(
    a: float, b: float, member_contexts: list[int], steps: int, start_s: float
) -> None:
    """advance(k) records, for every member, exactly the k per-step times and ends at start + Σ."""
    batch = make_batch(a, b, member_contexts, remaining=steps + 3)
    batch.start_s = start_s
    end = batch.advance(steps)
    times = stepped_times(a, b, sum(member_contexts), len(member_contexts), steps)
    assert close(end, start_s + math.fsum(times))
    assert batch.start_s == end
    for member, context in zip(batch.members, member_contexts, strict=True):
        assert member.record.intervals.count == steps
        np.testing.assert_allclose(member.record.intervals.values(), times, rtol=1e-9, atol=1e-12)
        assert member.remaining == 3
        assert member.context == context + steps
    assert batch.context == sum(member_contexts) + steps * len(member_contexts)


@given(step_fixed, step_per_token, contexts, st.lists(st.integers(0, 30), min_size=1, max_size=6))
def test_one_stretch_equals_many_single_steps(
    a: float, b: float, member_contexts: list[int], chunks: list[int]
) -> None:
    """Advancing in stretches of any lengths records the same intervals as advancing one step at a time."""
    total = sum(chunks)
    stretched = make_batch(a, b, member_contexts, remaining=total)
    single = make_batch(a, b, member_contexts, remaining=total)
    for chunk in chunks:
        stretched.advance(chunk)
    for _ in range(total):
        single.advance(1)
    assert close(stretched.start_s, single.start_s)
    for x, y in zip(stretched.members, single.members, strict=True):
        np.testing.assert_allclose(x.record.intervals.values(), y.record.intervals.values(), rtol=1e-9, atol=1e-12)
    assert len(stretched.take_finished()) == len(single.take_finished()) == len(member_contexts)


def test_stall_adds_to_the_next_interval_only() -> None:
    """A stall of s seconds lengthens every member's next interval by s, and moves the stretch's start."""
    a, b = A800_FIXED_S, A800_PER_TOKEN_S
    batch = make_batch(a, b, [1000, 3000], remaining=10)
    batch.start_s = 2.0
    batch.stall(0.25)
    assert batch.start_s == 2.25
    batch.advance(3)
    times = stepped_times(a, b, 4000, 2, 3)
    for member in batch.members:
        np.testing.assert_allclose(member.record.intervals.values(), [times[0] + 0.25, *times[1:]], rtol=1e-12)
        assert member.gap_s == 0.0
    assert close(batch.start_s, 2.25 + sum(times))


def test_a_joining_member_carries_its_gap_into_its_first_interval() -> None:
    """A member that joins with gap g (time since its first token) has g + step as its first interval."""
    a, b = A800_FIXED_S, A800_PER_TOKEN_S
    batch = make_batch(a, b, [2000], remaining=10)
    batch.join(make_member("late", remaining=4, context=500, gap_s=0.125))
    assert batch.context == 2500
    batch.advance(2)
    times = stepped_times(a, b, 2500, 2, 2)
    late = batch.members[1]
    np.testing.assert_allclose(late.record.intervals.values(), [0.125 + times[0], times[1]], rtol=1e-12)
    np.testing.assert_allclose(batch.members[0].record.intervals.values(), times, rtol=1e-12)


def test_advance_zero_steps_records_nothing() -> None:
    """advance(0) keeps every interval and the start (a pure stall iteration of the coupled engine)."""
    batch = make_batch(A800_FIXED_S, A800_PER_TOKEN_S, [100], remaining=5)
    batch.start_s = 1.5
    assert batch.advance(0) == 1.5
    assert batch.members[0].record.intervals.count == 0
    assert batch.members[0].remaining == 5 and batch.context == 100


def test_take_finished_removes_exactly_the_done_members() -> None:
    """Members with nothing left leave, taking their context with them; min_remaining follows."""
    batch = ContinuousBatch(LinearStepModel(A800_FIXED_S, A800_PER_TOKEN_S))
    for name, remaining, context in (("a", 2, 100), ("b", 5, 200), ("c", 2, 300)):
        batch.join(make_member(name, remaining=remaining, context=context))
    assert batch.min_remaining() == 2
    batch.advance(2)
    finished = batch.take_finished()
    assert sorted(m.record.request_id for m in finished) == ["a", "c"]
    assert [m.record.request_id for m in batch.members] == ["b"]
    assert batch.context == 202 and batch.min_remaining() == 3
    assert batch.take_finished() == []


# --------------------------------------------------------------------------- state machine


@attrs.define
class _RefMember:
    remaining: int
    context: int
    gap_s: float
    intervals: list[float] = attrs.field(factory=list)


class BatchMachine(RuleBasedStateMachine):
    """The batch against a reference that steps one token at a time and keeps every interval."""

    def __init__(self) -> None:
        super().__init__()
        self.batch: ContinuousBatch | None = None
        self.a = self.b = 0.0
        self.reference: dict[str, _RefMember] = {}
        self.time_s = 0.0
        self.names = iter(range(10**6))

    @precondition(lambda self: self.batch is None)
    @rule(a=step_fixed, b=step_per_token)
    def create(self, a: float, b: float) -> None:
        self.batch = ContinuousBatch(LinearStepModel(a, b))
        self.a, self.b = a, b

    @precondition(lambda self: self.batch is not None)
    @rule(
        remaining=st.integers(1, 40),
        context=st.integers(1, 5000),
        gap_s=st.sampled_from([0.0, 0.0, 0.01, 1.5]),
    )
    def join(self, remaining: int, context: int, gap_s: float) -> None:
        assert self.batch is not None
        name = str(next(self.names))
        self.batch.join(make_member(name, remaining=remaining, context=context, gap_s=gap_s))
        self.reference[name] = _RefMember(remaining, context, gap_s)

    @precondition(lambda self: self.batch is not None and len(self.batch) > 0)
    @rule(data=st.data())
    def advance(self, data: st.DataObject) -> None:
        assert self.batch is not None
        steps = data.draw(st.integers(0, self.batch.min_remaining()))
        end = self.batch.advance(steps)
        for _ in range(steps):
            step = self.a + self.b * sum(m.context for m in self.reference.values())
            for member in self.reference.values():
                member.intervals.append(member.gap_s + step)
                member.gap_s = 0.0
                member.remaining -= 1
                member.context += 1
            self.time_s += step
        assert close(end, self.time_s)

    @precondition(lambda self: self.batch is not None)
    @rule(seconds=st.sampled_from([0.0, 0.003, 0.2]))
    def stall(self, seconds: float) -> None:
        assert self.batch is not None
        self.batch.stall(seconds)
        for member in self.reference.values():
            member.gap_s += seconds
        self.time_s += seconds

    @precondition(lambda self: self.batch is not None)
    @rule()
    def take_finished(self) -> None:
        assert self.batch is not None
        finished = {m.record.request_id for m in self.batch.take_finished()}
        expected = {name for name, m in self.reference.items() if m.remaining <= 0}
        assert finished == expected
        for name in expected:
            del self.reference[name]

    @precondition(lambda self: self.batch is not None and len(self.batch) > 0)
    @rule(elapsed_s=st.floats(min_value=0.0, max_value=2.0))
    def steps_within(self, elapsed_s: float) -> None:
        assert self.batch is not None
        k = self.batch.steps_within(elapsed_s)
        brute = 0
        while self.batch.stretch_s(brute + 1) <= elapsed_s:
            brute += 1
        assert k == brute

    @invariant()
    def matches_the_reference(self) -> None:
        if self.batch is None:
            return
        batch = self.batch
        assert batch.context == sum(m.context for m in batch.members)
        assert close(batch.start_s, self.time_s)
        assert {m.record.request_id for m in batch.members} == set(self.reference)
        for member in batch.members:
            ref = self.reference[member.record.request_id]
            assert (member.remaining, member.context) == (ref.remaining, ref.context)
            assert close(member.gap_s, ref.gap_s)
            np.testing.assert_allclose(member.record.intervals.values(), ref.intervals, rtol=1e-9, atol=1e-12)


BatchMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestBatchMachine = BatchMachine.TestCase
