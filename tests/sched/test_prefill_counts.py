"""The prefill models refuse token counts that are no counts, naming the count and its value.

A NaN, a float or a negative prompt was timed silently (at NaN, at 0 s, or at the fitted model's c0), and the
router then found no instance, or a free prefill. `num_tokens` is a token count as a request's
(`types.check_token_count`: an integer in [1, MAX_TOKENS]) or 0 (nothing to compute, 0 s); `prefix_tokens` an
integer (fewer than none cached is none, as `prefill_flops` reads it).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.errors import InvalidRequestError
from mooncake.sched.cost import (
    HARDWARE,
    MODELS,
    ChunkedPipelineCost,
    FittedPrefillModel,
    PrefillCostModel,
    occupancy_s,
)
from mooncake.types import MAX_TOKENS

ANALYTIC = PrefillCostModel(model=MODELS["llama3-70b"], hardware=HARDWARE["8xA800"])
PREFILL_MODELS = [
    ANALYTIC,
    FittedPrefillModel(coefficients=(0.01, 1e-3, 1e-7)),
    ChunkedPipelineCost(base=ANALYTIC, group_size=2, chunk_tokens=1024),
]
MODEL_IDS = ["analytic", "fitted", "chunked_pipeline"]
BAD_PROMPTS = [math.nan, math.inf, -5, -1, 1000.5, 1000.0, "1000", None, True, MAX_TOKENS + 1]
BAD_PREFIXES = [math.nan, -math.inf, 10.0, "10", None, False]


@pytest.mark.parametrize("model", PREFILL_MODELS, ids=MODEL_IDS)
@pytest.mark.parametrize("num_tokens", BAD_PROMPTS, ids=repr)
def test_a_prompt_that_is_no_token_count_is_refused(model: Any, num_tokens: Any) -> None:
    """`num_tokens` outside [0, MAX_TOKENS], or no integer: an InvalidRequestError naming it and its value."""
    with pytest.raises(InvalidRequestError, match=rf"num_tokens must be an integer .*got {num_tokens!r}"):
        model.prefill_s(num_tokens, 0)


@pytest.mark.parametrize("model", PREFILL_MODELS, ids=MODEL_IDS)
@pytest.mark.parametrize("prefix_tokens", BAD_PREFIXES, ids=repr)
def test_a_prefix_that_is_no_integer_is_refused(model: Any, prefix_tokens: Any) -> None:
    """A `prefix_tokens` that is no integer: an InvalidRequestError naming it and its value."""
    with pytest.raises(InvalidRequestError, match=rf"prefix_tokens must be an integer, got {prefix_tokens!r}"):
        model.prefill_s(1000, prefix_tokens)
    with pytest.raises(InvalidRequestError, match="prefix_tokens"):
        occupancy_s(model, 1000, prefix_tokens)


@pytest.mark.parametrize("model", PREFILL_MODELS, ids=MODEL_IDS)
@given(st.integers(1, 2**20), st.integers(-(2**21), 2**21))
def test_numpy_counts_time_as_python_ints(model: Any, num_tokens: int, prefix_tokens: int) -> None:
    """numpy integers are counts too, timed as the same Python ints."""
    expected = model.prefill_s(num_tokens, prefix_tokens)
    assert model.prefill_s(np.int64(num_tokens), np.int64(prefix_tokens)) == expected
    assert math.isfinite(expected) and expected >= 0.0


@pytest.mark.parametrize("model", PREFILL_MODELS[:2], ids=MODEL_IDS[:2])
def test_the_longest_numpy_prompt_does_not_wrap(model: Any) -> None:
    """MAX_TOKENS as numpy's int64 squared would wrap (2**80): it is timed as the Python int is."""
    assert model.prefill_s(np.int64(MAX_TOKENS), np.int64(1)) == model.prefill_s(MAX_TOKENS, 1) > 0.0


@pytest.mark.parametrize("model", PREFILL_MODELS, ids=MODEL_IDS)
@pytest.mark.parametrize("zero", [0, np.int64(0)], ids=["int", "numpy"])
def test_an_empty_prompt_takes_no_time(model: Any, zero: Any) -> None:
    """0 tokens is nothing to compute: 0 s, as a prefix covering the prompt."""
    assert model.prefill_s(zero, 0) == 0.0
