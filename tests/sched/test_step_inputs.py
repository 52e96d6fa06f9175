"""Bad input to the step models of `mooncake.sched.step`: refused by name, as `prefill_s` refuses its counts.

`step_s` timed a NaN batch or context at NaN (where the compiled `roofline_step` gave -inf: the two disagreed), a
negative context at less than an empty one, a fractional batch as if it were one, and raised a bare TypeError on
"2" or None. Every step model times through `RooflineStep.step_s`, whose one check now refuses them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from mooncake.errors import InvalidRequestError
from mooncake.sched.cost import HARDWARE, MODELS
from mooncake.sched.step import DecodeCostModel, FittedStepModel, RooflineStep, StepBranch

MODELS_UNDER_TEST = {
    "DecodeCostModel": DecodeCostModel(model=MODELS["llama3-70b"], hardware=HARDWARE["8xA800"]),
    "FittedStepModel": FittedStepModel(coefficients=(0.01, 1e-4, 0.0)),
    "RooflineStep": RooflineStep([StepBranch(0.01, 1e-4, 1e-7)], overhead_s=0.001),
}
BAD = [math.nan, math.inf, -math.inf, 1.5, 2.0, "2", None, True, 2**63, np.float64(1.0)]


@pytest.mark.parametrize("name", sorted(MODELS_UNDER_TEST))
@pytest.mark.parametrize("value", BAD, ids=repr)
def test_a_batch_or_context_that_is_no_count_is_refused_by_name(name: str, value: Any) -> None:
    """Either feature given anything but an integer below 2**63 (a context, one in [0, 2**63)): InvalidRequestError
    naming it and the value, from every step model alike."""
    model = MODELS_UNDER_TEST[name]
    with pytest.raises(InvalidRequestError, match=r"batch_size must be an integer below 2\*\*63 .*, got"):
        model.step_s(value, 100)
    with pytest.raises(InvalidRequestError, match=r"context_tokens must be an integer in \[0, 2\*\*63\), got"):
        model.step_s(1, value)


@pytest.mark.parametrize("name", sorted(MODELS_UNDER_TEST))
@pytest.mark.parametrize("context", [-1, -5, -(2**70)])
def test_a_negative_context_is_refused_while_a_batch_below_1_is_empty(name: str, context: int) -> None:
    """A negative context was timed faster than none; a batch below 1 is empty and takes no time, as documented."""
    model = MODELS_UNDER_TEST[name]
    with pytest.raises(
        InvalidRequestError, match=rf"context_tokens must be an integer in \[0, 2\*\*63\), got {context}"
    ):
        model.step_s(1, context)
    assert model.step_s(-1, 100) == model.step_s(0, 100) == 0.0


@pytest.mark.parametrize("name", sorted(MODELS_UNDER_TEST))
def test_counts_in_range_are_timed_as_before(name: str) -> None:
    """numpy integers time as Python ints; an empty batch takes no time; the largest int64 counts are timed."""
    model = MODELS_UNDER_TEST[name]
    assert model.step_s(np.int64(4), np.int32(200)) == model.step_s(4, 200) > 0
    assert model.step_s(0, 10_000) == 0.0
    assert math.isfinite(model.step_s(2**63 - 1, 2**63 - 1))


def test_step_times_refuses_what_step_s_refuses() -> None:
    """`step_times` is `step_s` element by element: the same rule, naming the first bad element's feature."""
    roofline = MODELS_UNDER_TEST["RooflineStep"]
    times = roofline.step_times(np.array([0, -1, 2]), np.array([5, 5, 7]))
    assert times.tolist() == [0.0, 0.0, roofline.step_s(2, 7)]
    with pytest.raises(InvalidRequestError, match=r"context_tokens .* got -1"):
        roofline.step_times(np.array([1, 1]), np.array([5, -1]))
    with pytest.raises(InvalidRequestError, match=r"batch_size .* got 1.0"):
        roofline.step_times(np.array([1.0, 2.0]), np.array([5, 7]))
    with pytest.raises(InvalidRequestError, match=r"context_tokens .* got 5.0"):
        roofline.step_times(np.array([1, 1]), np.array([5.0, math.nan]))
