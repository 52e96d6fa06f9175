"""A continuous decode batch, advanced a stretch at a time instead of a step at a time.

A decode step produces one token for every member. Its time is a roofline
(`RooflineStep`, which every `AnalyticStepModel` gives): an overhead o plus
the slowest of a few affine branches, `f_j + s_j · B + c_j · C` for a batch of
B members holding C tokens (HBM reads, compute, ...). Each step adds one token
per member, so while membership is constant, step i of a stretch (from 0)
takes

    o + max_j (α_j + β_j · i),    α_j = f_j + s_j · B + c_j · C,  β_j = c_j · B:

the upper envelope of one arithmetic progression per branch, convex and
piecewise arithmetic with at most (branches − 1) breakpoints (`_envelope`).
Over a piece of n steps from step i0, whose first step takes v and each next
one r more,

    the piece takes     n · v + r · n (n − 1) / 2,
    k steps take        S(k), the sum over the pieces the first k steps cover,
    steps done by t     the largest k with S(k) <= t (within the piece where t
                        falls, a quadratic's root, then corrected by one step
                        either way against rounding),

and every member's token intervals over the stretch are one arithmetic run per
piece, recorded as (first, step, count) without materialising them. A piece's
first step is the roofline's own step at that context, to the bit.

The batch works the stretch's shape out whenever B or C changes (a join, a
departure, an advance), so the queries in between read it. Usually it needs no
envelope: when the steepest branch is already the slowest at the first step,
it stays the slowest, and the stretch is one progression, as it always is with
one branch (branches that never bind for B >= 1 are dropped up front, as the
zero branch of a fitted model). Joining, leaving and stalls (a prefill sharing
the GPU) happen only at step boundaries, which is where the owner of the batch
changes membership.

Invariants: `context` is the sum of the members' contexts; `start_s` is a step
boundary; a member's `gap_s` is the time since its last token that its next
interval will include on top of the step itself; the stretch's shape is that of
the current members and contexts; every step takes at least the roofline's step
of one member with no context, which is positive.
"""

from __future__ import annotations

import math

import attrs

from mooncake._checks import shown
from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.sched.step import RooflineStep
from mooncake.sim.metrics import RequestRecord

__all__ = ["ContinuousBatch", "Member"]

_Line = tuple[float, float, float]  # a branch: (fixed_s, per_sequence_s, per_context_token_s)
_Piece = tuple[int, float, float]  # (first step index, that step's seconds, rise per step)

# A crossover this many steps away is never reached (nor could its index be a float's ceiling).
_NEVER = 2.0**62


@attrs.define(eq=False)
class Member:
    """A request in a decode batch."""

    record: RequestRecord
    remaining: int  # tokens still to generate
    context: int  # tokens of KV it holds
    gap_s: float = 0.0


def _live_lines(step: RooflineStep) -> tuple[_Line, ...]:
    """The branches that can be the slowest for some batch (B >= 1, C >= 0), in their order.

    Raises:
        ConfigError: a branch that gets faster as the batch or its context grows, or a
            first step (one member, no context) that takes no time: steps_within would have
            no largest k.
    """
    lines = [(b.fixed_s, b.per_sequence_s, b.per_context_token_s) for b in step.branches]
    if any(s < 0 or c < 0 for _, s, c in lines) or step.step_s(1, 0) <= 0:
        raise ConfigError(
            f"a simulated decode batch needs steps that take time and never get faster as the batch grows; "
            f"{shown(step)} takes {step.step_s(1, 0)} s for one member with no context"
        )
    # Branch k never exceeds branch j for B >= 1, C >= 0 when j is no lower at B = 1, C = 0 and no flatter.
    live: list[_Line] = []
    for k, (fk, sk, ck) in enumerate(lines):
        dominated = any(
            (fj + sj >= fk + sk and sj >= sk and cj >= ck) and ((fj, sj, cj) != (fk, sk, ck) or j < k)
            for j, (fj, sj, cj) in enumerate(lines)
            if j != k
        )
        if not dominated:
            live.append((fk, sk, ck))
    return tuple(live)


def _envelope(alphas: list[float], betas: list[float]) -> list[tuple[int, int]]:
    """The upper envelope of the lines alpha_j + beta_j · i over the steps i = 0, 1, ...: its pieces
    as (first step, line), in order.

    From the highest line at step 0 (ties: the steeper), the next piece is the steeper line that
    crosses the current one first (ties: the steepest); it starts at the first step at or past the
    crossing.
    """
    current = max(range(len(alphas)), key=lambda j: (alphas[j], betas[j]))
    pieces = [(0, current)]
    while True:
        best, best_x = -1, _NEVER
        for j, beta in enumerate(betas):
            rise = beta - betas[current]
            if rise > 0:
                x = (alphas[current] - alphas[j]) / rise
                if x < best_x or (x == best_x and best >= 0 and beta > betas[best]):
                    best, best_x = j, x
        if best < 0:
            return pieces
        start = max(pieces[-1][0], math.ceil(best_x))
        if start == pieces[-1][0]:  # it overtakes at once (a crossing rounded below the piece's start)
            pieces[-1] = (start, best)
        else:
            pieces.append((start, best))
        current = best


class ContinuousBatch:
    """Members decoding together; `start_s` is when the current stretch starts.

    Members join (`join`) and leave (`take_finished`) and their contexts grow
    (`advance`) only through the batch, which recomputes the current stretch's
    shape then (`_reshape`): one progression (`_first`, `_rise`), or the pieces
    of an envelope that changes branch (`_pieces`).

    Args:
        step: the roofline of a step (an `AnalyticStepModel`'s `roofline()`).

    Raises:
        ConfigError: a roofline whose steps could take no time or get faster with more work.
    """

    def __init__(self, step: RooflineStep) -> None:
        self.roofline = step
        self.overhead_s = step.overhead_s
        self._all_lines: tuple[_Line, ...] = tuple(
            (b.fixed_s, b.per_sequence_s, b.per_context_token_s) for b in step.branches
        )
        self._lines = _live_lines(step)
        steepest = max(range(len(self._lines)), key=lambda j: self._lines[j][2])
        self._steepest = self._lines[steepest]
        self._flatter = self._lines[:steepest] + self._lines[steepest + 1 :]
        self.members: list[Member] = []
        self.context = 0
        self.start_s = 0.0
        self._first = self._rise = 0.0
        self._pieces: list[_Piece] | None = None  # None: the stretch is one progression
        self._reshape()

    def __len__(self) -> int:
        return len(self.members)

    def check_invariants(self) -> None:
        """Raise AssertionError if the context or the stretch's shape is out of sync with the members."""
        assert self.context == sum(member.context for member in self.members), "context out of sync"
        shape = (self._first, self._rise, self._pieces)
        self._reshape()
        assert (self._first, self._rise, self._pieces) == shape, "stale stretch shape"

    def _reshape(self) -> None:
        """The current stretch's shape, for the members and contexts as they are now."""
        size, context = len(self.members), self.context
        f, s, c = self._steepest
        top = f + s * size + c * context
        # When the steepest branch is the slowest at the first step, it stays the slowest: one
        # regime for the whole stretch (always, with one branch; usually, with several).
        for other_f, other_s, other_c in self._flatter:
            if other_f + other_s * size + other_c * context > top:
                pieces = self._envelope_pieces(size, context)
                if len(pieces) > 1:
                    self._pieces = pieces
                    return
                _, self._first, self._rise = pieces[0]
                self._pieces = None
                return
        self._first, self._rise, self._pieces = self.overhead_s + top, c * size, None

    def _envelope_pieces(self, size: int, context: int) -> list[_Piece]:
        """The stretch's pieces: (first step, its seconds, rise per step)."""
        lines = self._lines
        alphas = [f + s * size + c * context for f, s, c in lines]
        betas = [c * size for _, _, c in lines]
        pieces: list[_Piece] = []
        for start, j in _envelope(alphas, betas):
            f, s, c = lines[j]
            # The roofline's own step at the piece's first step, not alpha + beta · start.
            pieces.append((start, self.overhead_s + (f + s * size + c * (context + start * size)), betas[j]))
        return pieces

    def step_s(self, extra_context: int = 0, *, extra_members: int = 0) -> float:
        """The next step's time with `extra_members` more members and `extra_context` more tokens.

        The roofline's formula as it stands (the same operations as `RooflineStep.step_s`, so a
        batch of B members holding C tokens gives its step to the bit), evaluated even for no
        members at all: the fixed costs of a step with nobody in it.
        """
        size = len(self.members) + extra_members
        context = self.context + extra_context
        # All the branches, in order (a branch that never binds for B >= 1 may for B = 0), and the
        # first of the slowest, as max() takes it.
        slowest = -math.inf
        for f, s, c in self._all_lines:
            seconds = f + s * size + c * context
            if seconds > slowest:
                slowest = seconds
        return self.overhead_s + slowest

    def stretch_s(self, steps: int) -> float:
        """Seconds for the next `steps` steps at constant membership."""
        pieces = self._pieces
        if pieces is None:
            return steps * self._first + self._rise * (steps * (steps - 1) // 2)
        total = 0.0
        for first, rise, n in _runs(pieces, steps):
            total += n * first + rise * (n * (n - 1) // 2)
        return total

    def steps_within(self, elapsed_s: float) -> int:
        """Whole steps of the current stretch done within `elapsed_s` of its start.

        Raises:
            InvalidRequestError: `elapsed_s` is NaN or +inf while the batch has members (no whole count of
                steps answers it; an empty batch, or a time <= 0, does none).
        """
        if not self.members or elapsed_s <= 0:
            return 0
        if not elapsed_s < math.inf:  # NaN too; math.floor would raise a bare ValueError or OverflowError
            raise InvalidRequestError(f"elapsed_s must be a finite number of seconds, got {shown(elapsed_s)}")
        pieces = self._pieces
        if pieces is None:  # _steps_in_piece, inlined: the hot path
            quad = self._rise / 2
            lin = self._first - quad
            if quad == 0:
                k = math.floor(elapsed_s / lin)
            else:
                k = math.floor((-lin + math.sqrt(lin * lin + 4 * quad * elapsed_s)) / (2 * quad))
        else:
            k, spent = 0, 0.0
            for p, (start, first, rise) in enumerate(pieces):
                k = start + _steps_in_piece(first, rise, elapsed_s - spent)
                if p + 1 == len(pieces) or k < pieces[p + 1][0]:
                    break
                n = pieces[p + 1][0] - start
                spent += n * first + rise * (n * (n - 1) // 2)
        if k < 0:
            k = 0
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
            if self._pieces is None:
                first, rise = self._first, self._rise
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
            else:
                self._advance_pieces(self._pieces, steps)
            self.context += steps * len(self.members)
            self._reshape()
        self.start_s = end
        return end

    def _advance_pieces(self, pieces: list[_Piece], steps: int) -> None:
        """advance's recording when the stretch changes branch: a run per piece it covers."""
        runs = _runs(pieces, steps)
        head_first, head_rise, head_count = runs[0]
        for member in self.members:
            intervals = member.record.intervals
            if member.gap_s:
                intervals.add(member.gap_s + head_first, 0.0, 1)
                intervals.add(head_first + head_rise, head_rise, head_count - 1)
                intervals.runs.extend(runs[1:])
                member.gap_s = 0.0
            else:
                intervals.runs.extend(runs)
            member.remaining -= steps
            member.context += steps

    def stall(self, seconds: float) -> None:
        """The GPU does something else for `seconds` (a prefill): every member's next token waits."""
        for member in self.members:
            member.gap_s += seconds
        self.start_s += seconds

    def join(self, member: Member) -> None:
        self.members.append(member)
        self.context += member.context
        self._reshape()

    def take_finished(self) -> list[Member]:
        """Remove and return the members with nothing left to generate."""
        finished = [member for member in self.members if member.remaining <= 0]
        if finished:
            self.members = [member for member in self.members if member.remaining > 0]
            self.context -= sum(member.context for member in finished)
            self._reshape()
        return finished


def _runs(pieces: list[_Piece], steps: int) -> list[tuple[float, float, int]]:
    """The first `steps` steps as (first, rise, count) runs, one per piece they reach."""
    runs = []
    for p, (start, first, rise) in enumerate(pieces):
        if start >= steps:
            break
        end = min(pieces[p + 1][0], steps) if p + 1 < len(pieces) else steps
        runs.append((first, rise, end - start))
    return runs


def _steps_in_piece(first: float, rise: float, elapsed_s: float) -> int:
    """About the largest n with n · first + rise · n (n − 1) / 2 <= elapsed_s (first > 0, rise >= 0):
    the quadratic's root, which the caller corrects against rounding."""
    if elapsed_s <= 0:
        return 0
    quad = rise / 2
    lin = first - quad
    if quad == 0:
        return math.floor(elapsed_s / lin)
    return math.floor((-lin + math.sqrt(lin * lin + 4 * quad * elapsed_s)) / (2 * quad))
