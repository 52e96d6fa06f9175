"""Tests for `mooncake.sched.join`: the decode rule every caller asks.

Examples pin each check and their order; a property compares `check_join`
with the rule written out check by check (`tests/reference/sched.py`); the
compiled scan over many instances is checked against it in `test_kernels.py`.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.sched.cost import HARDWARE, MODELS
from mooncake.sched.decode import choose_decode
from mooncake.sched.join import UNLIMITED, DecodeLimits, DecodeLoad, JoinVerdict, check_join
from mooncake.sched.outcome import Reason
from mooncake.sched.step import DecodeCostModel
from mooncake.sched.view import BoardLoads, DecodeBoard, DecodeView
from mooncake.types import InstanceId
from tests.reference.sched import reference_verdict

COST = DecodeCostModel(model=MODELS["llama3-70b"], hardware=HARDWARE["8xA800"])
LIMITS = DecodeLimits(kv_capacity_tokens=10_000, max_batch_size=4, max_context_tokens=4096)


def verdict(load: DecodeLoad, prompt: int, output: int, *, slo: float | None = 0.1) -> JoinVerdict:
    return check_join(LIMITS, load, prompt_tokens=prompt, output_tokens=output, step_model=COST, tbt_slo_s=slo)


def test_each_check_in_order() -> None:
    """Context first, then batch slots, then KV, then TBT; the first failing check names the reason."""
    assert verdict(DecodeLoad(4, 9000, 9990), 4000, 97).reason is Reason.CONTEXT_TOO_LONG
    assert verdict(DecodeLoad(4, 9000, 9990), 100, 100).reason is Reason.BATCH_FULL
    assert verdict(DecodeLoad(3, 100, 9990), 100, 100).reason is Reason.KV_BUDGET
    tbt = verdict(DecodeLoad(3, 100, 0), 100, 100, slo=0.001)
    assert tbt == JoinVerdict(accepted=False, reason=Reason.TBT_SLO, predicted_tbt_s=COST.step_s(4, 200))
    assert verdict(DecodeLoad(3, 100, 9800), 100, 100) == JoinVerdict(
        accepted=True, predicted_tbt_s=COST.step_s(4, 200)
    )


def test_a_lone_request_is_never_refused_for_tbt() -> None:
    """An empty batch takes the request whatever its step time: it could never go faster."""
    assert verdict(DecodeLoad(0, 0, 0), 4000, 96, slo=1e-9).accepted


def test_a_single_token_request_takes_no_slot() -> None:
    """Output 1: the prefill's token was the only one; only the context bound applies."""
    assert verdict(DecodeLoad(4, 10**6, 10**6), 100, 1, slo=1e-9) == JoinVerdict(
        accepted=True, predicted_tbt_s=COST.step_s(5, 10**6 + 100)
    )
    assert verdict(DecodeLoad(0, 0, 0), 4096, 1).reason is Reason.CONTEXT_TOO_LONG


def test_no_step_model_no_tbt_check() -> None:
    """Without a step model (or an SLO) the TBT check is skipped."""
    got = check_join(LIMITS, DecodeLoad(3, 10**6, 0), prompt_tokens=10, output_tokens=10)
    assert got == JoinVerdict(accepted=True)
    unlimited = DecodeLimits(kv_capacity_tokens=100)
    assert check_join(unlimited, DecodeLoad(10**6, 0, 0), prompt_tokens=10, output_tokens=10).accepted


@pytest.mark.parametrize(("prompt", "output"), [(0, 10), (10, 0), (-1, 5), (True, 5), (2.5, 5), (5, "6")])
def test_bad_token_counts_are_invalid_requests(prompt: object, output: object) -> None:
    """Counts that are not integers >= 1 are an InvalidRequestError naming the field and value."""
    with pytest.raises(InvalidRequestError, match="tokens"):
        check_join(LIMITS, DecodeLoad(0, 0, 0), prompt_tokens=prompt, output_tokens=output)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("load", "field"),
    [
        (DecodeLoad(-1, 0, 0), "batch_size"),
        (DecodeLoad(0, -10, 0), "context_tokens"),
        (DecodeLoad(0, 0, float("nan")), "kv_tokens"),
        (DecodeLoad(0, float("inf"), 0), "context_tokens"),
        (DecodeLoad(True, 0, 0), "batch_size"),
        (DecodeLoad(0, 0, UNLIMITED), "kv_tokens"),  # MAX_LOAD: what an unset limit stands for
        ((0, 0, 0), "DecodeLoad"),
    ],
)
def test_bad_loads_are_invalid_requests(load: object, field: str) -> None:
    """A negative, NaN, infinite or too large count (or no DecodeLoad at all) is refused by name, not decided on;
    the largest count allowed is decided on."""
    assert (
        check_join(LIMITS, DecodeLoad(0, 0, UNLIMITED - 1), prompt_tokens=1, output_tokens=2).reason is Reason.KV_BUDGET
    )
    with pytest.raises(InvalidRequestError, match=field):
        check_join(LIMITS, load, prompt_tokens=10, output_tokens=10)  # type: ignore[arg-type]


limits = st.builds(
    DecodeLimits,
    kv_capacity_tokens=st.integers(0, 20_000),
    max_batch_size=st.none() | st.integers(1, 8),
    max_context_tokens=st.none() | st.integers(1, 12_000),
)
loads = st.builds(DecodeLoad, st.integers(0, 10), st.integers(0, 100_000), st.integers(0, 25_000))
requests = st.tuples(st.integers(1, 8000), st.integers(1, 4000) | st.just(1))


@given(limits, loads, requests, st.none() | st.sampled_from([0.015, 0.03, 0.1]))
def test_the_rule_as_written(
    limit: DecodeLimits, load: DecodeLoad, request: tuple[int, int], slo: float | None
) -> None:
    """`check_join` refuses exactly when the rule written out check by check does, for the same reason."""
    prompt, output = request
    got = check_join(limit, load, prompt_tokens=prompt, output_tokens=output, step_model=COST, tbt_slo_s=slo)
    want = reference_verdict(limit, load, prompt_tokens=prompt, output_tokens=output, step_model=COST, tbt_slo_s=slo)
    assert got.reason is want and got.accepted == (want is None)


fractional_loads = st.builds(DecodeLoad, st.floats(0, 10), st.floats(0, 100_000), st.floats(0, 25_000))


@given(limits, fractional_loads, requests, st.sampled_from([0.015, 0.03, 0.1]))
def test_a_predicted_load_is_checked_as_its_rounding_by_the_rule_and_the_scan_alike(
    limit: DecodeLimits, load: DecodeLoad, request: tuple[int, int], slo: float
) -> None:
    """A prediction's fractional counts are rounded once (`DecodeLoad.rounded`) before every check: `check_join`
    gives the verdict of the rounded load, and the decode selection's compiled scan, given the same load, lets the
    request in exactly then, with that verdict."""
    prompt, output = request
    ask = {"prompt_tokens": prompt, "output_tokens": output, "step_model": COST, "tbt_slo_s": slo}
    got = check_join(limit, load, **ask)  # type: ignore[arg-type]
    assert got == check_join(limit, load.rounded(), **ask)  # type: ignore[arg-type]
    board = DecodeBoard([DecodeView(InstanceId("decode-0"), limit)])
    choice = choose_decode(board, loads=BoardLoads.of([load]), **ask)  # type: ignore[arg-type]
    structural = check_join(limit, load, prompt_tokens=prompt, output_tokens=output)
    assert (choice.decode_instance is not None) == structural.accepted
    if structural.accepted:
        assert choice.verdict == got


def test_a_predicted_load_rounds_to_the_nearest_whole_half_to_even() -> None:
    """The rule counts a prediction's fractions rounded to the nearest whole request and token (Python's `round`,
    half to even), written out here (the other tests compare the rule with itself rounded): 2.6 requests are 3,
    a batch full at 3 slots, and 2.4 are 2; 9.5 KV tokens are 10, 8.5 are 8."""
    assert DecodeLoad(2.5, 0.5, 9.5).rounded() == DecodeLoad(2, 0, 10)
    assert DecodeLoad(2.6, 1.4, 8.5).rounded() == DecodeLoad(3, 1, 8)
    three = DecodeLimits(kv_capacity_tokens=10_000, max_batch_size=3)
    full = check_join(three, DecodeLoad(2.6, 0, 0), prompt_tokens=10, output_tokens=10)
    assert full == JoinVerdict(accepted=False, reason=Reason.BATCH_FULL)
    assert check_join(three, DecodeLoad(2.4, 0, 0), prompt_tokens=10, output_tokens=10).accepted


def test_a_step_exactly_at_the_objective_is_in_time() -> None:
    """The TBT check refuses a step past the objective, not one at it."""
    load = DecodeLoad(3, 200, 400)
    at = COST.step_s(4, 200 + 100)
    verdict = check_join(LIMITS, load, prompt_tokens=100, output_tokens=50, step_model=COST, tbt_slo_s=at)
    assert verdict.accepted and verdict.predicted_tbt_s == at
    past = check_join(LIMITS, load, prompt_tokens=100, output_tokens=50, step_model=COST, tbt_slo_s=at * (1 - 1e-12))
    assert past.reason is Reason.TBT_SLO


@pytest.mark.parametrize("slo", [math.nan, "0.1", None, True, 10**400], ids=["nan", "str", "none", "bool", "huge"])
def test_a_tbt_objective_that_is_no_number_is_named(slo: object) -> None:
    """A NaN objective would pass every step (no comparison with it holds) and a string failed as a bare
    ValueError: both the rule and the decode selection refuse it naming tbt_slo_s (None is no objective to
    `check_join` alone, which may skip the TBT check; the decode selection always makes it)."""
    with pytest.raises(InvalidRequestError, match="tbt_slo_s"):
        choose_decode(
            [DecodeView(InstanceId("d"), LIMITS)], prompt_tokens=1, output_tokens=2, step_model=COST, tbt_slo_s=slo
        )  # type: ignore[arg-type]
    if slo is not None:
        with pytest.raises(InvalidRequestError, match="tbt_slo_s"):
            check_join(LIMITS, DecodeLoad(1, 1, 1), prompt_tokens=1, output_tokens=2, step_model=COST, tbt_slo_s=slo)  # type: ignore[arg-type]


def test_any_other_tbt_objective_is_one() -> None:
    """An infinite objective bounds nothing; a negative one (a budget already spent) refuses every step with a
    batch to slow."""
    load = DecodeLoad(1, 1, 1)
    assert check_join(LIMITS, load, prompt_tokens=1, output_tokens=2, step_model=COST, tbt_slo_s=math.inf).accepted
    spent = check_join(LIMITS, load, prompt_tokens=1, output_tokens=2, step_model=COST, tbt_slo_s=-0.01)
    assert spent.reason is Reason.TBT_SLO
    assert check_join(LIMITS, load, prompt_tokens=1, output_tokens=2, step_model=COST, tbt_slo_s=1).accepted


def test_limits_that_are_none_are_named() -> None:
    """Limits that are no `DecodeLimits` are a ConfigError naming them, not an AttributeError from inside."""
    with pytest.raises(ConfigError, match="DecodeLimits, got None"):
        check_join(None, DecodeLoad(0, 0, 0), prompt_tokens=1, output_tokens=2)  # type: ignore[arg-type]


class NotANumber:
    """A step model (a plugged-in one) whose step comes out NaN."""

    def step_s(self, batch_size: int, context_tokens: int) -> float:
        return math.nan


def test_a_step_model_predicting_nan_is_named() -> None:
    """A NaN step fails every comparison, so the TBT check passed it: the rule refuses to answer, naming the
    model, rather than accept a request whose TBT it does not know."""
    with pytest.raises(ConfigError, match="predicted NaN seconds"):
        check_join(
            LIMITS, DecodeLoad(1, 1, 1), prompt_tokens=1, output_tokens=2, step_model=NotANumber(), tbt_slo_s=0.1
        )
