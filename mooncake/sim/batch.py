"""A continuous decode batch, advanced a stretch at a time instead of a step at a time.

A decode step produces one token for every member and takes `a + b · C`
seconds, C being the tokens the batch holds: the batch is built from a
`LinearStepModel` (a = `fixed_s`, the weights' read and overheads; b =
`per_context_token_s`, the KV read per token), which `LinearStepModel.of`
reads off the same `StepModel` protocol the real decode engine checks its TBT
with. Each step adds one token per member, so while membership is constant
the step times form an arithmetic progression: step i of a stretch (from 0)
takes `a + b · (C + i · B)` for a batch of B. Hence

    k steps take        S(k) = k · a + b · (k · C + B · k (k − 1) / 2),
    steps done by t     the largest k with S(k) <= t (a quadratic's root, then
                        corrected by one step either way against rounding),

and every member's token intervals over the stretch are one arithmetic run,
recorded as (first, step, count) without materialising them. Joining, leaving
and stalls (a prefill sharing the GPU) happen only at step boundaries, which
is where the owner of the batch changes membership.

Invariants: `context` is the sum of the members' contexts; `start_s` is a step
boundary; a member's `gap_s` is the time since its last token that its next
interval will include on top of the step itself.
"""

from __future__ import annotations

import math

import attrs

from mooncake.sched.cost import LinearStepModel
from mooncake.sim.metrics import RequestRecord

__all__ = ["ContinuousBatch", "Member"]


@attrs.define(eq=False)
class Member:
    """A request in a decode batch."""

    record: RequestRecord
    remaining: int  # tokens still to generate
    context: int  # tokens of KV it holds
    gap_s: float = 0.0


class ContinuousBatch:
    """Members decoding together; `start_s` is when the current stretch starts."""

    def __init__(self, step: LinearStepModel) -> None:
        self.fixed_s = step.fixed_s  # a
        self.per_token_s = step.per_context_token_s  # b
        self.members: list[Member] = []
        self.context = 0
        self.start_s = 0.0

    def __len__(self) -> int:
        return len(self.members)

    def step_s(self, extra_context: int = 0) -> float:
        """The next step's time, with `extra_context` more tokens in the batch."""
        return self.fixed_s + self.per_token_s * (self.context + extra_context)

    def stretch_s(self, steps: int) -> float:
        """Seconds for the next `steps` steps at constant membership."""
        return steps * self.fixed_s + self.per_token_s * (
            steps * self.context + len(self.members) * steps * (steps - 1) / 2
        )

    def steps_within(self, elapsed_s: float) -> int:
        """Whole steps of the current stretch done within `elapsed_s` of its start."""
        if not self.members or elapsed_s <= 0:
            return 0
        quad = self.per_token_s * len(self.members) / 2
        lin = self.fixed_s + self.per_token_s * self.context - quad
        if quad == 0:
            k = math.floor(elapsed_s / lin)
        else:
            k = math.floor((-lin + math.sqrt(lin * lin + 4 * quad * elapsed_s)) / (2 * quad))
        k = max(0, k)
        while k > 0 and self.stretch_s(k) > elapsed_s:
            k -= 1
        while self.stretch_s(k + 1) <= elapsed_s:
            k += 1
        return k

    def min_remaining(self) -> int:
        return min(member.remaining for member in self.members)

    def advance(self, steps: int) -> float:
        """Run `steps` steps: record every member's intervals; returns (and starts there) their end."""
        end = self.start_s + self.stretch_s(steps)
        if steps > 0:
            first = self.fixed_s + self.per_token_s * self.context
            rise = self.per_token_s * len(self.members)
            run = (first, rise, steps)  # IntervalRuns.add, inlined: steps > 0
            for member in self.members:
                if member.gap_s:
                    intervals = member.record.intervals
                    intervals.add(member.gap_s + first, 0.0, 1)
                    intervals.add(first + rise, rise, steps - 1)
                    member.gap_s = 0.0
                else:
                    member.record.intervals.runs.append(run)
                member.remaining -= steps
                member.context += steps
            self.context += steps * len(self.members)
        self.start_s = end
        return end

    def stall(self, seconds: float) -> None:
        """The GPU does something else for `seconds` (a prefill): every member's next token waits."""
        for member in self.members:
            member.gap_s += seconds
        self.start_s += seconds

    def join(self, member: Member) -> None:
        self.members.append(member)
        self.context += member.context

    def take_finished(self) -> list[Member]:
        """Remove and return the members with nothing left to generate."""
        finished = [member for member in self.members if member.remaining <= 0]
        if finished:
            self.members = [member for member in self.members if member.remaining > 0]
            self.context -= sum(member.context for member in finished)
        return finished
