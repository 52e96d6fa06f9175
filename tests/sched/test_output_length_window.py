"""`OutputLengthPredictor` keeps a bounded window of the most recent output lengths: a long replay's every
finished request no longer grows its memory and the cost of each `observe` without end."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.errors import ConfigError
from mooncake.sched.predictor import DEFAULT_LENGTH_WINDOW, OutputLengthPredictor


def test_the_default_window_keeps_the_last_10_000_lengths() -> None:
    """Past `DEFAULT_LENGTH_WINDOW` (10,000) observations the oldest is dropped for each new one: the kept lengths
    are the last 10,000, sorted, however many were observed."""
    assert DEFAULT_LENGTH_WINDOW == 10_000
    rng = random.Random(0)
    told = [rng.randint(1, 2_000) for _ in range(25_000)]
    predictor = OutputLengthPredictor(step_s=0.05)
    for length in told:
        predictor.observe(length)
    assert predictor.lengths == sorted(told[-10_000:])
    predictor.check_invariants()


@given(
    st.lists(st.integers(0, 60), max_size=40),
    st.lists(st.integers(0, 60), max_size=40),
    st.integers(1, 30),
    st.floats(0, 70),
    st.floats(0, 70),
)
def test_a_window_answers_as_its_last_lengths_alone_and_as_all_while_not_full(
    given_lengths: list[int], observed: list[int], window: int, produced: float, horizon: float
) -> None:
    """A windowed predictor's survival is an unbounded one's over the last `window` lengths given then observed;
    with no more than `window` of them, it is the unbounded one's over all of them (today's answers)."""
    windowed = OutputLengthPredictor(step_s=1.0, lengths=given_lengths, window=window)
    for length in observed:
        windowed.observe(length)
    told = given_lengths + observed
    recent = OutputLengthPredictor(step_s=1.0, lengths=told[-window:], window=10**9)
    assert windowed.lengths == recent.lengths
    for cap in (math.inf, 40):
        assert windowed.survival(produced, horizon, cap) == recent.survival(produced, horizon, cap)
    if len(told) <= window:
        assert windowed.lengths == sorted(told)


@pytest.mark.parametrize("window", [0, -3, 2.5, True, None, "100"])
def test_a_bad_window_is_a_config_error_naming_it(window: object) -> None:
    """The window is an integer >= 1: anything else is refused naming the field and the value."""
    with pytest.raises(ConfigError, match=rf"OutputLengthPredictor\.window must be an integer >= 1, got {window!r}"):
        OutputLengthPredictor(step_s=1.0, window=window)  # type: ignore[arg-type]
