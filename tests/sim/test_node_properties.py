"""`DecodeNode` against a step-by-step reference: plans, their versions, stretches, and the tokens grown.

The reference keeps each member's remaining tokens and context, the stretch's start and the plan
outstanding, and times a stretch by summing the roofline's own step one at a time (step i of a
stretch of B members holding C tokens takes `step_s(B, C + i·B)`). The rooflines have dyadic
coefficients, so every sum is exact and the node's closed forms must agree to the bit.

A state machine joins members at boundaries, plans stretches with and without a stall, cuts a
stretch at the next step boundary after an arrival (`steps_to_next_boundary`, as the disaggregated
cluster does), ends stretches at their planned time, wakes an idle node, and probes `grown(now)`;
the invariants: only the latest plan's version is current, and the batch's members, contexts and
start equal the reference's.
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mooncake.sched.step import RooflineStep, StepBranch
from mooncake.sim.batch import ContinuousBatch, Member
from mooncake.sim.metrics import RequestRecord
from mooncake.sim.node import DecodeNode
from mooncake.types import InstanceId, RequestId

# Dyadic coefficients: every step time, and every sum of them here, is exact in float64.
ROOFLINES = {
    "one branch": RooflineStep([StepBranch(0.5, 0.0625, 0.0078125)], overhead_s=0.25),
    # For a couple of members with short contexts the per-sequence branch binds first, and the
    # steeper per-token branch overtakes it within a few steps: the stretch changes branch.
    "crossing": RooflineStep([StepBranch(0.5, 0.0, 0.125), StepBranch(0.0, 1.0, 0.03125)], overhead_s=0.0),
    "with a zero branch": RooflineStep([StepBranch(0.0, 0.0, 0.0), StepBranch(1.0, 0.0, 0.015625)], overhead_s=0.5),
}
TINY_S = 2.0**-20  # less than any step here: a time just before a boundary


def reference_stretch_s(roofline: RooflineStep, contexts: list[int], steps: int) -> float:
    """Seconds for `steps` steps of members holding `contexts`, one step at a time."""
    size, context = len(contexts), sum(contexts)
    total = 0.0
    for i in range(steps):
        total += roofline.step_s(size, context + i * size)
    return total


class RefMember:
    """The reference's view of a member: what it has left and holds, and the tokens it produced."""

    def __init__(self, member: Member) -> None:
        self.member = member
        self.remaining = member.remaining
        self.context = member.context
        self.produced = 0


class DecodeNodeMachine(RuleBasedStateMachine):
    """A `DecodeNode` and a reference that steps one token at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.names = itertools.count()

    @initialize(name=st.sampled_from(sorted(ROOFLINES)))
    def start(self, name: str) -> None:
        self.roofline = ROOFLINES[name]
        self.node = DecodeNode(InstanceId("decode-0"), ContinuousBatch(self.roofline))
        self.members: list[RefMember] = []
        self.start_s = 0.0
        self.plan: tuple[int, float] | None = None  # (steps, stall_s) of the plan outstanding
        self.versions = [self.node.version]

    # ------------------------------------------------------------------ helpers

    def contexts(self) -> list[int]:
        return [member.context for member in self.members]

    def stretch_s(self, steps: int) -> float:
        return reference_stretch_s(self.roofline, self.contexts(), steps)

    def new_version(self) -> None:
        """The node's version after a plan or a void: one never issued before."""
        assert self.node.version not in self.versions, "a plan reused an earlier version"
        self.versions.append(self.node.version)

    def planned(self, steps: int, stall_s: float) -> None:
        boundary = self.node.plan(steps, stall_s)
        self.new_version()
        assert boundary == self.start_s + stall_s + self.stretch_s(steps)
        self.plan = (steps, stall_s)

    # ------------------------------------------------------------------ rules

    @precondition(lambda self: self.plan is None and len(self.members) < 6)
    @rule(remaining=st.integers(1, 12), context=st.integers(0, 64))
    def join(self, remaining: int, context: int) -> None:
        """A member joins at a step boundary (no stretch is planned)."""
        record = RequestRecord(RequestId(str(next(self.names))), 0.0, max(context, 1), remaining + 1)
        member = Member(record, remaining, context)
        self.node.batch.join(member)
        self.members.append(RefMember(member))

    @rule(data=st.data(), stall_s=st.sampled_from([0.0, 0.0, 0.125, 3.0]))
    def plan_stretch(self, data: st.DataObject, stall_s: float) -> None:
        """Plan a stall and up to the fewest remaining steps (none for an idle batch); it voids any earlier plan."""
        most = min(member.remaining for member in self.members) if self.members else 0
        steps = data.draw(st.integers(0, most), label="steps")
        self.planned(steps, stall_s)

    @precondition(lambda self: self.plan is not None and self.plan[1] == 0.0 and self.plan[0] > 0)
    @rule(data=st.data(), just_after=st.booleans())
    def cut_at_arrival(self, data: st.DataObject, just_after: bool) -> None:
        """An arrival at (or just after) the end of step k of the stretch: the plan is cut to the first boundary
        after it, k + 1 steps, and the earlier plan's boundary is void."""
        assert self.plan is not None
        planned_steps = self.plan[0]
        k = data.draw(st.integers(0, planned_steps - 1), label="k")
        now = self.start_s + self.stretch_s(k) + (TINY_S if just_after else 0.0)
        assert self.node.steps_to_next_boundary(now) == k + 1
        steps = min(planned_steps, self.node.steps_to_next_boundary(now))
        if steps < planned_steps:
            old = self.node.version
            self.planned(steps, 0.0)
            assert not self.node.is_current(old)

    @precondition(lambda self: self.plan is not None)
    @rule()
    def end_stretch(self) -> None:
        """At the planned boundary the stall and steps happen; the finished members leave, in batch order."""
        assert self.plan is not None
        steps, stall_s = self.plan
        now = self.start_s + stall_s + self.stretch_s(steps)
        finished = self.node.end_stretch(now)
        self.start_s = now
        for member in self.members:
            member.remaining -= steps
            member.context += steps
            member.produced += steps
        expected = [member.member for member in self.members if member.remaining <= 0]
        self.members = [member for member in self.members if member.remaining > 0]
        assert [id(member) for member in finished] == [id(member) for member in expected]
        assert all(member not in self.node.batch.members for member in finished)
        self.plan = None

    @precondition(lambda self: not self.members)
    @rule(idle_s=st.sampled_from([0.0, 0.25, 7.5]))
    def wake(self, idle_s: float) -> None:
        """An idle node woken at once (`void_plans`, then a boundary now): its stretch starts now."""
        self.node.void_plans()
        self.new_version()
        self.plan = None
        now = self.start_s + idle_s
        assert self.node.end_stretch(now) == []
        self.start_s = now

    @precondition(lambda self: self.plan is None or self.plan[1] == 0.0)
    @rule(k=st.integers(0, 14), just_before=st.booleans())
    def probe(self, k: int, just_before: bool) -> None:
        """At the end of step k of the stretch, k steps are done; just before it, k − 1; the next boundary
        after either is k + 1 steps or k steps away."""
        size = len(self.members)
        now = self.start_s + self.stretch_s(k) - (TINY_S if just_before and k else 0.0)
        done = k - 1 if just_before and k else k
        assert self.node.grown(now) == done * size
        assert self.node.steps_to_next_boundary(now) == (done + 1 if size else 1)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def only_the_latest_plan_is_current(self) -> None:
        assert [self.node.is_current(version) for version in self.versions] == [False] * (len(self.versions) - 1) + [
            True
        ]

    @invariant()
    def the_batch_matches_the_reference(self) -> None:
        batch = self.node.batch
        assert [id(member) for member in batch.members] == [id(member.member) for member in self.members]
        assert [(m.remaining, m.context) for m in batch.members] == [(m.remaining, m.context) for m in self.members]
        assert all(m.member.record.intervals.count == m.produced for m in self.members)
        assert batch.start_s == self.start_s
        assert self.node.grown(self.start_s) == 0
        batch.check_invariants()


DecodeNodeMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
TestDecodeNodeMachine = DecodeNodeMachine.TestCase


@given(
    name=st.sampled_from(sorted(ROOFLINES)),
    contexts=st.lists(st.integers(0, 64), min_size=1, max_size=4),
    steps=st.integers(1, 8),
)
def test_no_token_grows_during_a_planned_stall(name: str, contexts: list[int], steps: int) -> None:
    """Planned after a stall (a prefill holding the GPU), the stretch's steps start when the stall ends: before
    then the members have gained nothing, and the next boundary is the plan's first step after the stall."""
    roofline = ROOFLINES[name]
    node = DecodeNode(InstanceId("decode-0"), ContinuousBatch(roofline))
    for i, context in enumerate(contexts):
        node.batch.join(Member(RequestRecord(RequestId(str(i)), 0.0, max(context, 1), 100), 99, context))
    stall_s = reference_stretch_s(roofline, contexts, steps) + 1.0  # longer than the steps planned after it
    node.plan(steps, stall_s)
    during = node.batch.start_s + stall_s - TINY_S
    assert node.grown(during) == 0
    assert node.steps_to_next_boundary(during) == 1
