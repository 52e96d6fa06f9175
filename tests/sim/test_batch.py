"""Tests for `mooncake.sim.batch.ContinuousBatch`: the closed forms against stepping one by one.

The per-step truth is the roofline itself: step i of a stretch takes
`model.step_s(B, C + i · B)`. Properties check `stretch_s` against summing those
steps, `steps_within` against the brute-force largest k with stretch_s(k) <= t,
and the intervals `advance` records against the per-step times, on rooflines of
one, two and three branches, some built so that the slowest branch changes
inside the stretch (`hypothesis.event` labels those); a state machine joins,
advances, stalls and retires members of a batch and of a naive reference that
steps one token at a time and keeps every interval.
"""

from __future__ import annotations

import math

import attrs
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.sched.cost import HARDWARE, MODELS
from mooncake.sched.step import DecodeCostModel, RooflineStep, StepBranch
from mooncake.sim.batch import ContinuousBatch, Member
from mooncake.sim.metrics import RequestRecord
from mooncake.types import RequestId

A800 = DecodeCostModel(model=MODELS["llama3-70b"], hardware=HARDWARE["8xA800"]).roofline()
H800 = DecodeCostModel(model=MODELS["llama3-70b"], hardware=HARDWARE["8xH800"]).roofline()
CROSSING = "the slowest branch changes inside the stretch"

overheads = st.sampled_from([0.0, 0.005]) | st.floats(min_value=0.0, max_value=0.01)
memory_branches = st.builds(
    StepBranch,
    st.floats(min_value=1e-4, max_value=0.05),
    st.just(0.0),
    st.sampled_from([0.0, 1e-6]) | st.floats(min_value=0.0, max_value=1e-5),
)


@st.composite
def rooflines(draw: st.DrawFn) -> RooflineStep:
    """One to three branches: a memory-like one (a fixed cost, a cost per token), then flatter
    compute-like ones (a cost per sequence) or a zero branch, which never binds; or a preset."""
    preset = draw(st.sampled_from([None, None, None, A800, H800]))
    if preset is not None:
        return preset
    memory = draw(memory_branches)
    branches = [memory]
    for _ in range(draw(st.integers(0, 2))):
        if draw(st.booleans()):
            branches.append(StepBranch(0.0, 0.0, 0.0))
            continue
        # per_sequence_s / per_context_token_s about a member's context: crossings for contexts near it
        ratio = draw(st.floats(min_value=0.0, max_value=30_000.0))
        scale = memory.per_context_token_s or 1e-6
        branches.append(StepBranch(0.0, ratio * scale, draw(st.floats(0.0, 0.9)) * memory.per_context_token_s))
    return RooflineStep(draw(st.permutations(branches)), overhead_s=draw(overheads))


@st.composite
def crossing_rooflines(draw: st.DrawFn, batch_size: int, context: int, steps: int) -> RooflineStep:
    """Two or three branches whose envelope, for this batch, changes branch at drawn steps within `steps`:
    a flat branch binds first, a steeper one from a step x on, the memory branch last."""
    f0, c0 = draw(st.floats(min_value=1e-4, max_value=0.05)), draw(st.floats(min_value=1e-9, max_value=1e-5))
    memory = StepBranch(f0, 0.0, c0)
    # Between two steps, so that each branch is the slowest at some step (given two steps or more).
    x = draw(st.floats(min_value=0.25, max_value=max(steps - 1.25, 0.25)))
    c1 = c0 * draw(st.floats(0.0, 0.9))
    # Branch 1 meets the memory branch at step x: s1·B + c1·(C + B·x) = f0 + c0·(C + B·x).
    s1 = (f0 + (c0 - c1) * (context + batch_size * x)) / batch_size
    branches = [memory, StepBranch(0.0, s1, c1)]
    if draw(st.booleans()):
        # Branch 2, between the two in slope, meets branch 1 at a step before x: three pieces.
        c2 = c1 + (c0 - c1) * draw(st.floats(0.1, 0.9))
        x2 = x * draw(st.floats(0.0, 1.0))
        alpha2 = s1 * batch_size + c1 * context - (c2 - c1) * batch_size * x2
        branches.append(StepBranch(alpha2 - c2 * context, 0.0, c2))
    return RooflineStep(draw(st.permutations(branches)), overhead_s=draw(overheads))


contexts = st.lists(st.integers(min_value=1, max_value=20_000), min_size=1, max_size=6) | st.builds(
    lambda n, context: [context] * n, st.integers(50, 400), st.integers(1, 4000)
)


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def make_member(name: str, *, remaining: int, context: int, gap_s: float = 0.0) -> Member:
    record = RequestRecord(RequestId(name), 0.0, context, remaining + 1)
    return Member(record, remaining, context, gap_s)


def make_batch(model: RooflineStep, member_contexts: list[int], *, remaining: int = 10**6) -> ContinuousBatch:
    batch = ContinuousBatch(model)
    for i, context in enumerate(member_contexts):
        batch.join(make_member(str(i), remaining=remaining, context=context))
    return batch


def stepped_times(model: RooflineStep, context: int, batch_size: int, steps: int) -> list[float]:
    """Each step's time, stepping one by one: every step adds a token per member."""
    return [model.step_s(batch_size, context + i * batch_size) for i in range(steps)]


def slowest_branches(model: RooflineStep, context: int, batch_size: int, steps: int) -> set[int]:
    """The branches that are the slowest at some step of the stretch (ties: the first)."""
    winners = set()
    for i in range(steps):
        tokens = context + i * batch_size
        times = [b.fixed_s + b.per_sequence_s * batch_size + b.per_context_token_s * tokens for b in model.branches]
        winners.add(times.index(max(times)))
    return winners


def label(model: RooflineStep, member_contexts: list[int], steps: int) -> None:
    event(f"{len(model.branches)} branches")
    if len(slowest_branches(model, sum(member_contexts), len(member_contexts), steps)) > 1:
        event(CROSSING)


@st.composite
def stretches(draw: st.DrawFn, *, max_steps: int = 300) -> tuple[RooflineStep, list[int], int]:
    """A roofline, the members' contexts and a stretch length; half the rooflines cross inside it."""
    member_contexts = draw(contexts)
    steps = draw(st.integers(min_value=0, max_value=max_steps))
    if draw(st.booleans()):
        model = draw(crossing_rooflines(len(member_contexts), sum(member_contexts), steps))
    else:
        model = draw(rooflines())
    label(model, member_contexts, steps)
    return model, member_contexts, steps


@given(stretches())
def test_stretch_is_the_sum_of_the_steps(stretch: tuple[RooflineStep, list[int], int]) -> None:
    """stretch_s(k) equals Σ model.step_s over k steps, each with the contexts grown by the steps before;
    the next step is the model's step to the bit."""
    model, member_contexts, steps = stretch
    batch = make_batch(model, member_contexts)
    expected = math.fsum(stepped_times(model, sum(member_contexts), len(member_contexts), steps))
    assert close(batch.stretch_s(steps), expected)
    assert batch.stretch_s(0) == 0.0
    size, context = len(member_contexts), sum(member_contexts)
    assert batch.step_s() == model.step_s(size, context)
    assert batch.step_s(7) == batch.step_s(extra_context=7) == model.step_s(size, context + 7)
    assert batch.step_s(7, extra_members=3) == model.step_s(size + 3, context + 7)


@given(stretches(max_steps=50), st.floats(min_value=-1.0, max_value=10.0))
def test_steps_within_is_the_largest_k_that_fits(stretch: tuple[RooflineStep, list[int], int], scale: float) -> None:
    """steps_within(t) is the largest k with stretch_s(k) <= t (0 for t <= 0), t drawn around the stretch."""
    model, member_contexts, steps = stretch
    batch = make_batch(model, member_contexts)
    elapsed_s = scale * batch.stretch_s(max(steps, 1))
    k = batch.steps_within(elapsed_s)
    if elapsed_s <= 0:
        assert k == 0
        return
    assert batch.stretch_s(k) <= elapsed_s < batch.stretch_s(k + 1)
    brute = 0
    while batch.stretch_s(brute + 1) <= elapsed_s:
        brute += 1
    assert k == brute


@given(stretches(max_steps=400), st.data())
def test_steps_within_is_exact_at_step_boundaries(
    stretch: tuple[RooflineStep, list[int], int], data: st.DataObject
) -> None:
    """At exactly stretch_s(k) the k-th step is done; just before it, it is not."""
    model, member_contexts, steps = stretch
    batch = make_batch(model, member_contexts)
    k = data.draw(st.integers(min_value=1, max_value=max(steps, 1)))
    boundary = batch.stretch_s(k)
    assert batch.steps_within(boundary) == k
    assert batch.steps_within(math.nextafter(boundary, 0.0)) == k - 1


@pytest.mark.parametrize("elapsed_s", [math.inf, math.nan])
def test_steps_within_refuses_a_time_no_count_of_steps_answers(elapsed_s: float) -> None:
    """An infinite or NaN elapsed time is an InvalidRequestError naming it, not OverflowError or ValueError."""
    batch = make_batch(A800, [100, 200])
    with pytest.raises(InvalidRequestError, match="elapsed_s"):
        batch.steps_within(elapsed_s)


def test_an_empty_batch_does_no_steps() -> None:
    """Without members nothing advances: no steps within any time; its next step is the roofline's fixed costs."""
    batch = ContinuousBatch(A800)
    assert batch.steps_within(10.0) == 0
    assert len(batch) == 0 and batch.context == 0
    assert batch.step_s(100, extra_members=1) == A800.step_s(1, 100)


@given(stretches(max_steps=200), st.floats(0.0, 10.0))
def test_advance_records_the_per_step_intervals(stretch: tuple[RooflineStep, list[int], int], start_s: float) -> None:
    """advance(k) records, for every member, exactly the k per-step times and ends at start + Σ."""
    model, member_contexts, steps = stretch
    batch = make_batch(model, member_contexts, remaining=steps + 3)
    batch.start_s = start_s
    end = batch.advance(steps)
    times = stepped_times(model, sum(member_contexts), len(member_contexts), steps)
    assert close(end, start_s + math.fsum(times))
    assert batch.start_s == end
    for member, context in zip(batch.members, member_contexts, strict=True):
        assert member.record.intervals.count == steps
        np.testing.assert_allclose(member.record.intervals.values(), times, rtol=1e-9, atol=1e-12)
        assert member.remaining == 3
        assert member.context == context + steps
    assert batch.context == sum(member_contexts) + steps * len(member_contexts)


@given(stretches(max_steps=120), st.data())
def test_one_stretch_equals_many_single_steps(
    stretch: tuple[RooflineStep, list[int], int], data: st.DataObject
) -> None:
    """Advancing in stretches of any lengths records the same intervals as advancing one step at a time."""
    model, member_contexts, total = stretch
    chunks: list[int] = []
    while sum(chunks) < total:
        chunks.append(data.draw(st.integers(0, total - sum(chunks))))
    stretched = make_batch(model, member_contexts, remaining=total)
    single = make_batch(model, member_contexts, remaining=total)
    for chunk in chunks:
        stretched.advance(chunk)
    for _ in range(total):
        single.advance(1)
    assert close(stretched.start_s, single.start_s)
    for x, y in zip(stretched.members, single.members, strict=True):
        np.testing.assert_allclose(x.record.intervals.values(), y.record.intervals.values(), rtol=1e-9, atol=1e-12)
    assert len(stretched.take_finished()) == len(single.take_finished()) == len(member_contexts)


def test_a_stretch_crosses_from_compute_to_memory_bound() -> None:
    """LLaMA3-70B on 8×A800, 200 members of 10 tokens: compute-bound first, memory-bound once their
    KV has grown (from step 2,516 on): one run per branch, each step the roofline's, intervals and
    steps_within across the crossover as stepping one by one gives them."""
    batch = make_batch(A800, [10] * 200, remaining=10_000)
    steps = 3000
    times = stepped_times(A800, 2000, 200, steps)
    assert slowest_branches(A800, 2000, 200, 2516) == {1}
    assert slowest_branches(A800, 2000 + 2516 * 200, 200, steps - 2516) == {0}
    assert close(batch.stretch_s(steps), math.fsum(times))
    for t in (times[0], math.fsum(times[:2516]), math.fsum(times[:2517]), math.fsum(times) * 0.999):
        brute = 0
        while batch.stretch_s(brute + 1) <= t:
            brute += 1
        assert batch.steps_within(t) == brute
    member = batch.members[0]
    member.gap_s = 0.5
    batch.advance(steps)
    runs = member.record.intervals.runs
    assert len(runs) == 3 and runs[0] == (0.5 + times[0], 0.0, 1) and runs[2][0] == times[2516]
    np.testing.assert_allclose(member.record.intervals.values(), [0.5 + times[0], *times[1:]], rtol=1e-12)
    assert [count for _, _, count in batch.members[1].record.intervals.runs] == [2516, steps - 2516]


def test_stall_adds_to_the_next_interval_only() -> None:
    """A stall of s seconds lengthens every member's next interval by s, and moves the stretch's start."""
    batch = make_batch(A800, [1000, 3000], remaining=10)
    batch.start_s = 2.0
    batch.stall(0.25)
    assert batch.start_s == 2.25
    batch.advance(3)
    times = stepped_times(A800, 4000, 2, 3)
    for member in batch.members:
        np.testing.assert_allclose(member.record.intervals.values(), [times[0] + 0.25, *times[1:]], rtol=1e-12)
        assert member.gap_s == 0.0
    assert close(batch.start_s, 2.25 + sum(times))


def test_a_joining_member_carries_its_gap_into_its_first_interval() -> None:
    """A member that joins with gap g (time since its first token) has g + step as its first interval."""
    batch = make_batch(A800, [2000], remaining=10)
    batch.join(make_member("late", remaining=4, context=500, gap_s=0.125))
    assert batch.context == 2500
    batch.advance(2)
    times = stepped_times(A800, 2500, 2, 2)
    late = batch.members[1]
    np.testing.assert_allclose(late.record.intervals.values(), [0.125 + times[0], times[1]], rtol=1e-12)
    np.testing.assert_allclose(batch.members[0].record.intervals.values(), times, rtol=1e-12)


def test_advance_zero_steps_records_nothing() -> None:
    """advance(0) keeps every interval and the start (a pure stall iteration of the coupled engine)."""
    batch = make_batch(A800, [100], remaining=5)
    batch.start_s = 1.5
    assert batch.advance(0) == 1.5
    assert batch.members[0].record.intervals.count == 0
    assert batch.members[0].remaining == 5 and batch.context == 100


def test_take_finished_removes_exactly_the_done_members() -> None:
    """Members with nothing left leave, taking their context with them; min_remaining follows."""
    batch = ContinuousBatch(A800)
    for name, remaining, context in (("a", 2, 100), ("b", 5, 200), ("c", 2, 300)):
        batch.join(make_member(name, remaining=remaining, context=context))
    assert batch.min_remaining() == 2
    batch.advance(2)
    finished = batch.take_finished()
    assert sorted(m.record.request_id for m in finished) == ["a", "c"]
    assert [m.record.request_id for m in batch.members] == ["b"]
    assert batch.context == 202 and batch.min_remaining() == 3
    assert batch.take_finished() == []


@pytest.mark.parametrize(
    "branches",
    [
        (StepBranch(0.01, 0.0, -1e-9),),  # faster with more context
        (StepBranch(0.01, -1e-6, 0.0), StepBranch(0.0, 1e-3, 0.0)),  # faster with more members
        (StepBranch(0.0, 0.0, 1e-6),),  # a lone member with no context takes no time
    ],
)
def test_a_roofline_it_cannot_run_is_refused(branches: tuple[StepBranch, ...]) -> None:
    """Steps that take no time or get faster with more work have no largest k within a time: ConfigError."""
    with pytest.raises(ConfigError, match="take time"):
        ContinuousBatch(RooflineStep(branches))


# --------------------------------------------------------------------------- state machine


@attrs.define
class _RefMember:
    remaining: int
    context: int
    gap_s: float
    intervals: list[float] = attrs.field(factory=list)


@st.composite
def mean_context_crossings(draw: st.DrawFn) -> RooflineStep:
    """A memory branch (f, 0, c0) and a flatter compute one (f, (c0 − c1) · a, c1): with the same fixed
    cost they cross where the members' mean context reaches a, whatever the batch size, so a batch of
    short members crosses within a stretch of a few dozen steps."""
    fixed, c0 = draw(st.floats(1e-4, 0.05)), draw(st.floats(1e-7, 1e-4))
    c1, mean_context = c0 * draw(st.floats(0.0, 0.9)), draw(st.floats(10.0, 60.0))
    branches = (StepBranch(fixed, 0.0, c0), StepBranch(fixed, (c0 - c1) * mean_context, c1))
    return RooflineStep(draw(st.permutations(branches)), overhead_s=draw(overheads))


class BatchMachine(RuleBasedStateMachine):
    """The batch against a reference that steps one token at a time, each step the roofline's, and keeps
    every interval."""

    def __init__(self) -> None:
        super().__init__()
        self.batch: ContinuousBatch | None = None
        self.model = A800
        self.reference: dict[str, _RefMember] = {}
        self.time_s = 0.0
        self.names = iter(range(10**6))

    @precondition(lambda self: self.batch is None)
    @rule(model=rooflines() | mean_context_crossings())
    def create(self, model: RooflineStep) -> None:
        self.batch = ContinuousBatch(model)
        self.model = model
        event(f"{len(model.branches)} branches")

    @precondition(lambda self: self.batch is not None)
    @rule(
        remaining=st.integers(1, 120),
        context=st.integers(1, 60) | st.integers(1, 60) | st.integers(1, 5000),
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
        # The simulator runs whole stretches (to the first member's end) unless an arrival cuts one short.
        longest = self.batch.min_remaining()
        steps = data.draw(st.just(longest) | st.integers(0, longest))
        if len(slowest_branches(self.model, self.batch.context, len(self.batch), steps)) > 1:
            event(CROSSING)
        end = self.batch.advance(steps)
        for _ in range(steps):
            step = self.model.step_s(len(self.reference), sum(m.context for m in self.reference.values()))
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
        batch.check_invariants()
        assert close(batch.start_s, self.time_s)
        assert {m.record.request_id for m in batch.members} == set(self.reference)
        assert batch.step_s(extra_members=1) == self.model.step_s(len(batch) + 1, batch.context)
        for member in batch.members:
            ref = self.reference[member.record.request_id]
            assert (member.remaining, member.context) == (ref.remaining, ref.context)
            assert close(member.gap_s, ref.gap_s)
            np.testing.assert_allclose(member.record.intervals.values(), ref.intervals, rtol=1e-9, atol=1e-12)


BatchMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestBatchMachine = BatchMachine.TestCase


def test_a_stretch_that_ends_where_the_next_branch_starts_records_no_empty_run() -> None:
    """200 members of 10 tokens on A800 turn memory-bound at step 2,516: advancing exactly that far covers
    only the compute-bound piece, one run of 2,516 intervals, and no run of none (IntervalRuns keeps counts
    positive)."""
    batch = make_batch(A800, [10] * 200, remaining=10_000)
    batch.advance(2516)
    for member in batch.members:
        assert [count for _, _, count in member.record.intervals.runs] == [2516]
