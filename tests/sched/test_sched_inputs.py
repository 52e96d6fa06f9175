"""Tests for what the decode side's public calls take: every value they refuse is a named error, raised before
anything changed.

`choose_decode`'s loads (a board's length, whole counts the rule takes), a decode view's reservations and joins
(once each, counts and times checked first), the predictors' times and arguments, a step model that is none or
predicts no number, the pending-block table's owners and keys, and how a request's end and its HTTP status are
named.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from mooncake.cache._compiled import compiled_path
from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.sched.decode import choose_decode, generated_tokens
from mooncake.sched.join import DecodeLimits, DecodeLoad, check_join
from mooncake.sched.outcome import Outcome, Reason, RequestEnd, http_status, reason_named
from mooncake.sched.pending import PendingBlocks
from mooncake.sched.predictor import (
    ExpectedOutputPredictor,
    LoadSnapshot,
    OutputLengthPredictor,
    UniformDecodePredictor,
    score_predictor,
)
from mooncake.sched.step import FittedStepModel
from mooncake.sched.view import ActiveDecode, BoardLoads, DecodeBoard, DecodeView, QueuedPrefill

STEP = FittedStepModel(coefficients=(0.01, 0.001, 1e-6))
LIMITS = DecodeLimits(kv_capacity_tokens=1000, max_batch_size=4)


def board(count: int) -> DecodeBoard:
    return DecodeBoard([DecodeView(f"d{slot}", LIMITS) for slot in range(count)])


def choose(views: Any, loads: Any = None, **overrides: Any) -> Any:
    arguments: dict[str, Any] = {
        "prompt_tokens": 100,
        "output_tokens": 100,
        "step_model": STEP,
        "tbt_slo_s": 1.0,
        "loads": loads,
    }
    return choose_decode(views, **(arguments | overrides))


def ints(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


# ------------------------------------------------------------------ choose_decode's loads


@pytest.mark.parametrize(
    "loads",
    [
        pytest.param(DecodeLoad(0, 0, 0), id="a DecodeLoad, not one per slot"),
        pytest.param(BoardLoads(ints(4), ints(0), ints(0)), id="one slot for a board of two"),
        pytest.param(BoardLoads(ints(0, 0, 0), ints(0, 0, 0), ints(0, 0, 0)), id="three slots for a board of two"),
        pytest.param(BoardLoads(np.array([1.0, 0.0]), ints(0, 0), np.array([math.nan, 0.0])), id="NaN KV"),
        pytest.param(BoardLoads([0, 0], [0, 0], [0, 0]), id="lists, not arrays"),  # type: ignore[arg-type]
        pytest.param(BoardLoads(ints(0, 0), ints(0, 0), np.zeros((2, 1), dtype=np.int64)), id="2-D"),
    ],
)
def test_choose_decode_refuses_loads_that_are_not_one_whole_load_per_slot(loads: Any) -> None:
    """Loads the compiled scan would read out of bounds, compare as NaN (passing the KV budget: float arrays are
    refused, int64 holds no NaN) or fail to type are an InvalidRequestError naming `loads`, not a bare or numba
    error, or a choice made on memory past them."""
    with pytest.raises(InvalidRequestError, match="loads"):
        choose(board(2), loads)


def test_choose_decode_takes_what_board_loads_of_makes_and_hand_built_whole_loads() -> None:
    """Loads `BoardLoads.of` makes from checked loads, and int64 arrays of the board's length in the rule's range,
    are taken: a full first slot sends the request to the second."""
    full = [DecodeLoad(4, 0, 0), DecodeLoad(0.4, 0.0, 0.0)]
    assert choose(board(2), BoardLoads.of(full)).decode_instance == "d1"
    assert choose(board(2), BoardLoads(ints(4, 0), ints(0, 0), ints(0, 0))).decode_instance == "d1"


def test_board_loads_of_refuses_a_load_the_rule_would_not_take() -> None:
    """`BoardLoads.of` names a NaN, a negative count, one past the scan's range or no load at all (what
    `load_problem` says), where the rounding failed bare or the count reached the scan."""
    for bad in (
        DecodeLoad(math.nan, 0, 0),
        DecodeLoad(0, 0, -5),
        DecodeLoad(0, 2**62, 0),
        DecodeLoad(0, 0, 2**70),
        "load",
    ):
        with pytest.raises(InvalidRequestError, match="slot 1"):
            BoardLoads.of([DecodeLoad(0, 0, 0), bad])  # type: ignore[list-item]


def test_choose_decode_refuses_a_step_model_with_no_roofline() -> None:
    """A step model without `roofline()` is a ConfigError naming it, not an AttributeError from inside."""
    with pytest.raises(ConfigError, match="step model"):
        choose(board(1), step_model=object())
    with pytest.raises(ConfigError, match="step model"):
        generated_tokens(object(), [ActiveDecode(request_id="a", start_s=0.0, context_tokens=1, output_tokens=2)], 1.0)  # type: ignore[arg-type]


# ------------------------------------------------------------------ DecodeView


def view() -> DecodeView:
    return DecodeView("d", DecodeLimits(kv_capacity_tokens=10_000))


def counters(decode: DecodeView) -> tuple[Any, ...]:
    return (
        dict(decode.active),
        decode.used_tokens,
        decode.context_tokens,
        decode.started_ns_sum,
        dict(decode.reserved),
        decode.reserved_tokens,
        decode.reserved_context_tokens,
        decode.reserved_slots,
    )


def test_a_request_is_reserved_once() -> None:
    """Reserving a request already reserved (or decoding) there is refused, nothing changed: counted twice, its
    release left one reservation's tokens and slot with no request behind them."""
    decode = view()
    decode.reserve("r1", 100, 10)
    before = counters(decode)
    with pytest.raises(InvalidRequestError, match="r1"):
        decode.reserve("r1", 100, 10)
    assert counters(decode) == before
    decode.join(ActiveDecode(request_id="a", start_s=1.0, context_tokens=5, output_tokens=5))
    with pytest.raises(InvalidRequestError, match="'a'"):
        decode.reserve("a", 1, 2)
    decode.release("r1")
    decode.check_invariants()
    assert decode.reserved_tokens == decode.reserved_slots == 0


def test_a_request_joins_once() -> None:
    """Joining a request already decoding there is refused, nothing changed (counted twice, its leave left its
    tokens behind)."""
    decode = view()
    request = ActiveDecode(request_id="x", start_s=1.0, context_tokens=100, output_tokens=10)
    decode.join(request)
    before = counters(decode)
    with pytest.raises(InvalidRequestError, match="'x'"):
        decode.join(request)
    assert counters(decode) == before
    decode.leave("x")
    decode.check_invariants()
    assert decode.used_tokens == decode.context_tokens == decode.started_ns_sum == 0


@pytest.mark.parametrize(
    ("prompt", "output", "field"),
    [("100", 10, "prompt_tokens"), (-500, 10, "prompt_tokens"), (10, -1, "output_tokens"), (10, 2.5, "output_tokens")],
)
def test_reserve_refuses_counts_that_are_not_counts(prompt: Any, output: Any, field: str) -> None:
    """A prompt or output that is no integer >= 0 is refused naming it, nothing changed (a negative one made a
    negative load; a string, a bare TypeError)."""
    decode = view()
    before = counters(decode)
    with pytest.raises(InvalidRequestError, match=field):
        decode.reserve("r", prompt, output)
    assert counters(decode) == before


def test_join_refuses_what_is_no_decoding_request_before_changing_anything() -> None:
    """`join` takes an `ActiveDecode`; a start whose nanoseconds no integer holds is refused before the view
    changed (it was added to `active` first, then failed converting)."""
    decode = view()
    with pytest.raises(InvalidRequestError, match="request"):
        decode.join("x")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="start_s"):
        decode.join(ActiveDecode(request_id="i", start_s=1e300, context_tokens=1, output_tokens=2))
    assert counters(decode) == counters(view())
    decode.check_invariants()


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"start_s": math.nan}, "start_s"),
        ({"start_s": math.inf}, "start_s"),
        ({"start_s": "1"}, "start_s"),
        ({"context_tokens": -5}, "context_tokens"),
        ({"output_tokens": 1.5}, "output_tokens"),
        ({"request_id": None}, "request_id"),
    ],
)
def test_an_active_decode_is_checked(fields: dict[str, Any], named: str) -> None:
    """An `ActiveDecode` with a time that is no finite number, a count that is no integer >= 0 or no request id
    is refused naming the field (a NaN start reached the view and failed there, after it changed)."""
    values: dict[str, Any] = {"request_id": "a", "start_s": 1.0, "context_tokens": 5, "output_tokens": 5} | fields
    with pytest.raises(InvalidRequestError, match=named):
        ActiveDecode(**values)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"finish_s": math.nan}, "finish_s"),
        ({"start_s": -math.inf}, "start_s"),
        ({"joins_after_s": math.nan}, "joins_after_s"),
        ({"earliest_s": "0"}, "earliest_s"),
        ({"transfer_finish_s": math.inf}, "transfer_finish_s"),
        ({"input_tokens": -1}, "input_tokens"),
        ({"output_tokens": True}, "output_tokens"),
    ],
)
def test_a_queued_prefill_is_checked(fields: dict[str, Any], named: str) -> None:
    """A `QueuedPrefill` with a time that is no finite number (a NaN finish made every time derived from it NaN) or a
    count that is no integer >= 0 is refused naming the field."""
    values: dict[str, Any] = {"request_id": "q", "start_s": 0.0, "finish_s": 1.0} | fields
    with pytest.raises(InvalidRequestError, match=named):
        QueuedPrefill(**values)


def test_records_built_as_the_conductor_builds_them_pass() -> None:
    """Numpy numbers and ints where floats are usual pass (the checks look past a fast path, they do not narrow)."""
    queued = QueuedPrefill(
        request_id=7, start_s=np.float64(0.5), finish_s=2, input_tokens=np.int64(3), output_tokens=4, started=True
    )
    assert queued.joins_s == 2
    assert ActiveDecode(request_id="a", start_s=3, context_tokens=np.int64(0), output_tokens=0).start_s == 3


# ------------------------------------------------------------------ predictors

ACTIVE = (ActiveDecode(request_id="a", start_s=0.0, context_tokens=1000, output_tokens=100),)
INCOMING = (QueuedPrefill(request_id="b", start_s=0.0, finish_s=1.0, input_tokens=500, output_tokens=50),)
PREDICTORS = [UniformDecodePredictor(decode_s=10.0), ExpectedOutputPredictor(step_s=0.1), OutputLengthPredictor(0.1)]


@pytest.mark.parametrize("predictor", PREDICTORS, ids=lambda p: type(p).__name__)
@pytest.mark.parametrize(
    ("now", "at_s", "named"),
    [
        (1.0, math.nan, "at_s"),
        (math.nan, 2.0, "now"),
        (1.0, math.inf, "at_s"),
        (-math.inf, 2.0, "now"),
        ("1", 2.0, "now"),
    ],
)
def test_predictors_refuse_times_that_are_not_finite(predictor: Any, now: Any, at_s: Any, named: str) -> None:
    """A `now` or `at_s` that is no finite number is an InvalidRequestError naming it, not an empty (or NaN) batch
    predicted quietly."""
    with pytest.raises(InvalidRequestError, match=named):
        predictor.predict(ACTIVE, INCOMING, now, at_s)


@pytest.mark.parametrize("predictor", PREDICTORS, ids=lambda p: type(p).__name__)
def test_predictors_refuse_what_is_no_collection_of_requests(predictor: Any) -> None:
    """`active` and `incoming` must be collections of requests: None is named, not a bare TypeError."""
    with pytest.raises(InvalidRequestError, match="active"):
        predictor.predict(None, INCOMING, 1.0, 2.0)
    with pytest.raises(InvalidRequestError, match="incoming"):
        predictor.predict(ACTIVE, 5, 1.0, 2.0)
    assert predictor.predict(list(ACTIVE), list(INCOMING), 1, 2) == predictor.predict(ACTIVE, INCOMING, 1.0, 2.0)


@pytest.mark.parametrize(
    ("produced", "horizon", "cap", "named"),
    [(math.nan, 1.0, math.inf, "produced"), (1.0, math.nan, math.inf, "horizon"), (1.0, 1.0, math.nan, "cap")],
)
def test_survival_refuses_times_that_are_no_numbers(produced: float, horizon: float, cap: float, named: str) -> None:
    """`survival(nan, 1)` answered 0.0: a NaN is named instead."""
    with pytest.raises(InvalidRequestError, match=named):
        OutputLengthPredictor(0.1, lengths=[1, 2, 3]).survival(produced, horizon, cap)


def test_a_load_snapshot_and_a_score_are_checked() -> None:
    """A snapshot at a NaN time, or with no load recorded, is refused; `score_predictor` takes snapshots (None was an
    empty score)."""
    actual = DecodeLoad(2, 1500, 1650)
    with pytest.raises(InvalidRequestError, match="now"):
        LoadSnapshot(active=ACTIVE, incoming=INCOMING, now=math.nan, at_s=1.0, actual=actual)
    with pytest.raises(InvalidRequestError, match="at_s"):
        LoadSnapshot(active=ACTIVE, incoming=INCOMING, now=0.0, at_s=math.inf, actual=actual)
    with pytest.raises(InvalidRequestError, match="load"):
        LoadSnapshot(active=ACTIVE, incoming=INCOMING, now=0.0, at_s=1.0, actual=None)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="snapshots"):
        score_predictor(UniformDecodePredictor(decode_s=1.0), None)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="snapshots"):
        score_predictor(UniformDecodePredictor(decode_s=1.0), [actual])  # type: ignore[list-item]


# ------------------------------------------------------------------ step models in the rule


class _Returns:
    def __init__(self, value: object) -> None:
        self.value = value

    def step_s(self, batch_size: int, context_tokens: int) -> object:
        return self.value


@pytest.mark.parametrize("step_model", [_Returns(None), _Returns("0.1"), _Returns(math.nan), object()])
def test_check_join_names_a_step_model_that_predicts_no_number(step_model: Any) -> None:
    """A step model with no `step_s`, or one that answers None, text or NaN, is a ConfigError naming it (the
    comparison failed bare, or AttributeError)."""
    with pytest.raises(ConfigError, match="step model"):
        check_join(
            LIMITS, DecodeLoad(1, 10, 10), prompt_tokens=5, output_tokens=5, step_model=step_model, tbt_slo_s=0.1
        )


def test_check_join_takes_any_real_step() -> None:
    """Ints, numpy floats and infinity are steps (an infinite one fails every objective)."""
    for step in (0, np.float64(0.05), math.inf):
        verdict = check_join(
            LIMITS, DecodeLoad(1, 10, 10), prompt_tokens=5, output_tokens=5, step_model=_Returns(step), tbt_slo_s=0.1
        )
        assert verdict.accepted == (step != math.inf)


# ------------------------------------------------------------------ pending blocks


@pytest.mark.parametrize("compiled", [True, False])
def test_pending_blocks_refuse_owners_and_keys_they_cannot_count(compiled: bool) -> None:
    """An owner that is no integer >= 0 and keys that are no 1-D uint64 array are named, nothing counted."""
    with compiled_path(compiled):
        pending = PendingBlocks()
    keys = np.array([1, 2], dtype=np.uint64)
    for owner in (None, "0", -1, 1.0):
        with pytest.raises(InvalidRequestError, match="owner"):
            pending.add(owner, keys)  # type: ignore[arg-type]
    for bad in ([1, 2], np.array([1, 2], dtype=np.int64), np.zeros((1, 2), dtype=np.uint64), None):
        with pytest.raises(InvalidRequestError, match="keys"):
            pending.add(0, bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="keys"):
            pending.remove(0, bad)  # type: ignore[arg-type]
    assert len(pending) == 0
    pending.add(np.int64(0), keys)  # type: ignore[arg-type]
    assert pending.count(0, 1) == 1


@pytest.mark.parametrize("capacity", ["x", -1, 1.5, None])
def test_pending_blocks_refuse_a_capacity_that_is_no_count(capacity: Any) -> None:
    with pytest.raises(ConfigError, match="capacity"):
        PendingBlocks(capacity)


# ------------------------------------------------------------------ outcome


def test_request_end_takes_an_outcome_and_a_reason() -> None:
    """An outcome or reason given as its text is refused naming it (a string outcome failed with AttributeError,
    a string reason reached the request's end as it was)."""
    with pytest.raises(InvalidRequestError, match="outcome"):
        RequestEnd("r", "completed")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="reason"):
        RequestEnd("r", Outcome.REJECTED_AFTER_PREFILL, "kv_budget")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="request_id"):
        RequestEnd(None, Outcome.COMPLETED)  # type: ignore[arg-type]
    assert RequestEnd("r", Outcome.REJECTED_AFTER_PREFILL, Reason.KV_BUDGET).reason is Reason.KV_BUDGET


@pytest.mark.parametrize("reason", list(Reason))
def test_http_status_reads_a_reason_and_its_wire_name_alike(reason: Reason) -> None:
    """A reason's value (as a peer sends it) has its reason's status: "context_too_long" was a 429 where the reason
    is a 400."""
    assert http_status(reason.value) == http_status(reason) == http_status(reason_named(reason.value))
    assert http_status("context_too_long") == 400 and http_status("no_decode_instance") == 503


def test_http_status_refuses_what_is_no_reason() -> None:
    """None or a number is no reason: named, not a 429. A name this version does not know is a refusal without a
    known why (`reason_named`), a 429."""
    for bad in (None, 42, Outcome.ABORTED):
        with pytest.raises(InvalidRequestError, match="reason"):
            http_status(bad)  # type: ignore[arg-type]
    assert http_status("from_a_newer_peer") == 429
