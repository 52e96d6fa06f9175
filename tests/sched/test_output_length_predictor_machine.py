"""`OutputLengthPredictor` as a state machine, against a plain list of the lengths it was told.

The machine builds a predictor (a step time, a window of kept lengths, often
small enough to bind, and some first lengths), then
observes finished requests' lengths (good ones, numpy integers among them, and
bad ones it must refuse), replaces its lengths wholesale, and asks it for
survival probabilities, load predictions and a predictor score. The reference
keeps every length told, in order, and recomputes every answer by counting over
the last `window` of them (all of them while no more were told):
survival is (lengths > produced + horizon) / (lengths > produced), a load is
the survival-weighted sum over the requests, a score the mean absolute error of
those loads. Times are whole quarter seconds and lengths small, so a request
has often produced exactly an observed length: the boundary of "still
generating" is hit.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import attrs
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.sched.join import DecodeLoad
from mooncake.sched.predictor import (
    DEFAULT_LENGTH_WINDOW,
    LoadPredictor,
    LoadSnapshot,
    OutputLengthPredictor,
    score_predictor,
)
from mooncake.sched.view import ActiveDecode, QueuedPrefill
from mooncake.types import RequestId

MAX_LENGTH = 80

quarters = st.integers(min_value=0, max_value=200).map(lambda q: q / 4)  # whole quarter seconds: ties are likely
step_times = st.sampled_from([1.0, 0.5, 0.25]) | st.floats(min_value=0.01, max_value=2.0)
lengths = st.integers(min_value=0, max_value=MAX_LENGTH)
good_lengths = st.sampled_from([0, 1]) | lengths | lengths.map(np.int64)  # numpy integers are integers too
bad_lengths = (
    st.integers(max_value=-1)
    | st.just(np.int64(-1))
    | st.floats(allow_nan=True)
    | st.sampled_from([1.0, 2.5])
    | st.booleans()
    | st.none()
    | st.text(max_size=3)
)
bad_windows = st.sampled_from([0, -1, 2.0, True, None, "3", np.int64(0)]) | st.integers(max_value=0)
bad_step_times = st.sampled_from([0.0, -0.25, math.nan, math.inf, -math.inf, True]) | st.floats(max_value=0.0)
output_tokens = st.sampled_from([0, 1, 2]) | st.integers(min_value=0, max_value=200)  # around takes_slot's 1


@st.composite
def actives(draw: st.DrawFn, now: float) -> ActiveDecode:
    """A request decoding since at most 50 s before `now` (sometimes since exactly now)."""
    return ActiveDecode(
        request_id=RequestId("a"),
        start_s=now - draw(st.integers(min_value=0, max_value=200)) / 4,
        context_tokens=draw(st.integers(min_value=0, max_value=1000)),
        output_tokens=draw(output_tokens),
    )


@st.composite
def incomings(draw: st.DrawFn, at_s: float) -> QueuedPrefill:
    """A prefill whose first token comes up to 50 s before `at_s` or up to 25 s after it (often right at it)."""
    finish_s = at_s + draw(st.sampled_from([0, -1, 1]) | st.integers(min_value=-200, max_value=100)) / 4
    return QueuedPrefill(
        request_id=RequestId("q"),
        start_s=finish_s - 1.0,
        finish_s=finish_s,
        input_tokens=draw(st.integers(min_value=0, max_value=1000)),
        output_tokens=draw(output_tokens),
    )


State = tuple[list[ActiveDecode], list[QueuedPrefill], float, float]


@st.composite
def states(draw: st.DrawFn) -> State:
    """(active, incoming, now, at_s) with at_s at or after now."""
    now = draw(quarters)
    at_s = now + draw(quarters)
    active = draw(st.lists(actives(now), max_size=4))
    incoming = draw(st.lists(incomings(at_s), max_size=4))
    return active, incoming, now, at_s


def reference_survival(observed: list[int], produced: float, horizon: float, cap: float) -> float:
    """1 at horizon 0 (it is running); 0 once the request's cap is reached; 1 with nothing observed; of the
    observed requests that were longer than `produced`, the share longer than `produced + horizon`, and when none
    was that long, 1 below a cap (0 with none)."""
    if horizon <= 0:
        return 1.0
    if produced + horizon >= cap:
        return 0.0
    if not observed:
        return 1.0
    longer_now = [length for length in observed if length > produced]
    if not longer_now:
        return 1.0 if cap < math.inf else 0.0
    return len([length for length in longer_now if length > produced + horizon]) / len(longer_now)


def joins_by(queued: QueuedPrefill, at_s: float) -> bool:
    """A prefill is in the batch at `at_s` if its first token came by then and it has a second one to decode."""
    return queued.finish_s <= at_s and queued.output_tokens > 1


def reference_predict(
    observed: list[int],
    step_s: float,
    active: Sequence[ActiveDecode],
    incoming: Sequence[QueuedPrefill],
    now: float,
    at_s: float,
) -> tuple[float, float, float]:
    """The expected (batch, context, KV) at `at_s`: each request weighted by its chance to be generating then, its
    output so far counted with the prefill's first token (as observed lengths and caps count it): 1 + the tokens
    decoded since it joined."""
    terms: list[tuple[float, float, float]] = []
    for request in active:
        decoded = max(0.0, (now - request.start_s) / step_s)
        horizon = max(0.0, (at_s - now) / step_s)
        alive = reference_survival(observed, 1.0 + decoded, horizon, request.output_tokens)
        terms.append(
            (
                alive,
                alive * (request.context_tokens + decoded + horizon),
                alive * (request.context_tokens + request.output_tokens),
            )
        )
    for queued in incoming:
        if joins_by(queued, at_s):
            decoded = (at_s - queued.finish_s) / step_s
            alive = reference_survival(observed, 1.0, decoded, queued.output_tokens)
            terms.append(
                (alive, alive * (queued.input_tokens + decoded), alive * (queued.input_tokens + queued.output_tokens))
            )
    return sum(t[0] for t in terms), sum(t[1] for t in terms), sum(t[2] for t in terms)


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def assert_load(load: DecodeLoad, want: tuple[float, float, float]) -> None:
    got = (load.batch_size, load.context_tokens, load.kv_tokens)
    assert all(close(g, w) for g, w in zip(got, want, strict=True)), f"{got} != {want}"


class OutputLengthPredictorMachine(RuleBasedStateMachine):
    """Observations, replacements and queries on one predictor, against the list of lengths it was told.

    Invariants: its lengths are the last `window` told (all of them while no more were told), sorted, as plain
    ints; survival is the counted share, in [0, 1],
    1 at horizon 0 for a request some observed one outlived, never rising with the horizon; a prediction is the
    reference's, the sum of its one-request predictions, with a batch between 0 and the requests present (all
    of them with nothing observed) and a KV at most their reservations; a score is the reference's mean absolute
    error; a bad length, step time or window is refused (InvalidRequestError, ConfigError) and changes nothing.
    """

    def __init__(self) -> None:
        super().__init__()
        self.predictor = OutputLengthPredictor(step_s=1.0)
        self.told: list[int] = []  # every length told, oldest first
        self.window = DEFAULT_LENGTH_WINDOW

    @property
    def observed(self) -> list[int]:
        """The lengths the predictor is to answer from: the last `window` told."""
        return self.told[-self.window :]

    @initialize(step_s=step_times, window=st.none() | st.integers(1, 12), first=st.lists(lengths, max_size=10))
    def build(self, step_s: float, window: int | None, first: list[int]) -> None:
        given = list(first)
        if window is None:  # the default window: far more than any run here observes
            self.predictor = OutputLengthPredictor(step_s=step_s, lengths=given)
        else:
            self.predictor = OutputLengthPredictor(step_s=step_s, lengths=given, window=window)
            self.window = window
        self.told = list(first)
        given.append(MAX_LENGTH + 1)  # the predictor keeps its own sorted copy: the caller's list is not it
        assert self.predictor.lengths == sorted(first[-self.window :])

    @rule(length=good_lengths)
    def observe(self, length: int) -> None:
        self.predictor.observe(length)
        self.told.append(int(length))

    @rule(length=bad_lengths)
    def observe_bad(self, length: object) -> None:
        with pytest.raises(InvalidRequestError):
            self.predictor.observe(length)  # type: ignore[arg-type]

    @rule(replacement=st.lists(lengths, max_size=10))
    def replace_lengths(self, replacement: list[int]) -> None:
        """The field converts on assignment as at construction."""
        self.predictor.lengths = replacement
        self.told = list(replacement)

    @rule(step_s=bad_step_times)
    def build_bad(self, step_s: float) -> None:
        with pytest.raises(ConfigError):
            OutputLengthPredictor(step_s=step_s, lengths=list(self.observed))
        with pytest.raises(ConfigError, match="step_s"):
            self.predictor.step_s = step_s

    @rule(window=bad_windows)
    def build_bad_window(self, window: object) -> None:
        """A window that is not an integer >= 1 is refused naming the field and the value; a built predictor's
        window is fixed (its kept lengths would no longer be the last `window`)."""
        with pytest.raises(ConfigError, match=rf"OutputLengthPredictor\.window .*got {re.escape(repr(window))}"):
            OutputLengthPredictor(step_s=1.0, lengths=list(self.observed), window=window)  # type: ignore[arg-type]
        with pytest.raises(attrs.exceptions.FrozenAttributeError):
            self.predictor.window = 5

    @rule(good=st.lists(lengths, max_size=4), bad=bad_lengths)
    def give_bad_lengths(self, good: list[int], bad: object) -> None:
        """Lengths given at construction or by assignment are checked as `observe` checks one (a negative or
        fractional length would poison every later prediction)."""
        with pytest.raises(ConfigError, match="output length"):
            OutputLengthPredictor(step_s=1.0, lengths=[*good, bad])  # type: ignore[list-item]
        with pytest.raises(ConfigError, match="output length"):
            self.predictor.lengths = [*good, bad]  # type: ignore[list-item]

    @rule(
        produced=st.integers(0, MAX_LENGTH + 2) | st.floats(0, 100),
        horizon=st.integers(0, 40) | st.floats(0, 100),
        cap=st.integers(1, MAX_LENGTH + 50) | st.just(math.inf),
    )
    def survival(self, produced: float, horizon: float, cap: float) -> None:
        got = self.predictor.survival(produced, horizon, cap)
        assert got == reference_survival(self.observed, produced, horizon, cap)
        assert 0.0 <= got <= 1.0
        assert self.predictor.survival(produced, horizon + 1.0, cap) <= got
        assert self.predictor.survival(produced, 0.0, cap) == 1.0  # a running request is there now

    @rule(state=states())
    def predict(self, state: State) -> None:
        active, incoming, now, at_s = state
        load = self.predictor.predict(active, incoming, now, at_s)
        assert_load(load, reference_predict(self.observed, self.predictor.step_s, active, incoming, now, at_s))
        singles = [self.predictor.predict([a], [], now, at_s) for a in active]
        singles += [self.predictor.predict([], [q], now, at_s) for q in incoming]
        assert_load(
            load,
            (
                sum(s.batch_size for s in singles),
                sum(s.context_tokens for s in singles),
                sum(s.kv_tokens for s in singles),
            ),
        )
        present = len(active) + sum(joins_by(q, at_s) for q in incoming)
        reserved = sum(a.context_tokens + a.output_tokens for a in active)
        reserved += sum(q.input_tokens + q.output_tokens for q in incoming if joins_by(q, at_s))
        assert 0.0 <= load.batch_size <= present + 1e-9
        assert load.context_tokens >= 0.0 and 0.0 <= load.kv_tokens <= reserved * (1 + 1e-9)
        if not self.observed:  # nothing observed: each is there unless it ran past its own cap by then
            step = self.predictor.step_s
            gone = sum(
                at_s > now and 1.0 + max(0.0, (now - a.start_s) / step) + (at_s - now) / step >= a.output_tokens
                for a in active
            )
            gone += sum(joins_by(q, at_s) and 1.0 + (at_s - q.finish_s) / step >= q.output_tokens for q in incoming)
            assert load.batch_size == present - gone

    @rule(
        snapshots=st.lists(
            st.tuples(states(), st.integers(0, 8), st.integers(0, 5000), st.integers(0, 9000)), max_size=3
        )
    )
    def score(self, snapshots: list[tuple[State, int, int, int]]) -> None:
        """`score_predictor` on recorded moments: the mean absolute error of the reference's predictions
        (all 0 over none)."""
        recorded = [
            LoadSnapshot(
                active=tuple(active),
                incoming=tuple(incoming),
                now=now,
                at_s=at_s,
                actual=DecodeLoad(batch, context, kv),
            )
            for (active, incoming, now, at_s), batch, context, kv in snapshots
        ]
        predictor: LoadPredictor = self.predictor  # it is one
        got = score_predictor(predictor, recorded)
        errors: list[list[float]] = [[], [], []]
        for (active, incoming, now, at_s), *actual in snapshots:
            want = reference_predict(self.observed, self.predictor.step_s, active, incoming, now, at_s)
            for kind in range(3):
                errors[kind].append(abs(want[kind] - actual[kind]))
        means = [sum(kind) / len(kind) if kind else 0.0 for kind in errors]
        assert got.samples == len(recorded)
        assert close(got.batch_size_mae, means[0]), (got, means)
        assert close(got.context_tokens_mae, means[1]), (got, means)
        assert close(got.kv_tokens_mae, means[2]), (got, means)

    @invariant()
    def lengths_are_the_last_window_told_sorted(self) -> None:
        assert self.predictor.lengths == sorted(self.observed)
        assert len(self.predictor.lengths) <= self.predictor.window == self.window
        self.predictor.check_invariants()
        assert all(type(length) is int for length in self.predictor.lengths)


OutputLengthPredictorMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestOutputLengthPredictorMachine = OutputLengthPredictorMachine.TestCase
