"""Tests for `mooncake.sched.decode.choose_decode`.

Example tests for the contracts (lowest TBT wins, room and liveness required,
ties by id, the load given is the one used); a property against the brute-force
choice of `tests/reference/sched.py` over random decode views and loads.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.sched.cost import HARDWARE, MODELS, DecodeCostModel
from mooncake.sched.decode import DecodeChoice, choose_decode
from mooncake.sched.predictor import DecodeLoad
from mooncake.sched.view import ActiveDecode, DecodeBoard, DecodeView
from mooncake.types import InstanceId, RequestId
from tests.reference.sched import reference_decode

COST = DecodeCostModel(model=MODELS["llama3-70b"], hardware=HARDWARE["8xA800"])
D0, D1, D2 = InstanceId("decode-0"), InstanceId("decode-1"), InstanceId("decode-2")
DECODE_IDS = tuple(InstanceId(f"decode-{i}") for i in range(6))


def view(
    instance: InstanceId, *, capacity: int = 100_000, used: int = 0, reserved: int = 0, up: bool = True
) -> DecodeView:
    """A decode view with `used` tokens held by one active request and `reserved` by one incoming."""
    decode = DecodeView(instance, capacity, is_up=up)
    if used:
        decode.join(ActiveDecode(request_id=RequestId("active"), start_s=0.0, context_tokens=used, output_tokens=0))
    if reserved:
        decode.reserve(RequestId("incoming"), reserved)
    return decode


def idle_loads(views: list[DecodeView]) -> dict[InstanceId, DecodeLoad]:
    return {v.instance_id: DecodeLoad(0, 0) for v in views}


def choose(
    views: list[DecodeView], loads: dict[InstanceId, DecodeLoad], *, context: int = 1000, output: int = 100
) -> DecodeChoice | None:
    return choose_decode(views, context_tokens=context, output_tokens=output, cost=COST, tbt_slo_s=0.1, loads=loads)


def test_lowest_predicted_tbt_wins() -> None:
    """The instance whose batch (with the request) steps fastest is chosen, with that TBT."""
    views = [view(D0), view(D1), view(D2)]
    loads = {D0: DecodeLoad(4, 90_000), D1: DecodeLoad(2, 10_000), D2: DecodeLoad(8, 50_000)}
    choice = choose(views, loads)
    assert choice == DecodeChoice(decode_instance=D1, tbt_s=COST.step_s(3, 11_000))


def test_down_instances_are_skipped() -> None:
    """An instance that is down is never chosen, however idle."""
    views = [view(D0, up=False), view(D1)]
    choice = choose(views, {D0: DecodeLoad(0, 0), D1: DecodeLoad(10, 80_000)})
    assert choice is not None and choice.decode_instance == D1


def test_instances_without_room_are_skipped() -> None:
    """Room counts what is used and what is reserved; prompt plus expected output must fit."""
    views = [view(D0, capacity=2000, used=500, reserved=401), view(D1, capacity=2000, used=900), view(D2)]
    loads = {D0: DecodeLoad(0, 0), D1: DecodeLoad(0, 0), D2: DecodeLoad(30, 90_000)}
    assert choose(views, loads, context=1000, output=100) == DecodeChoice(  # 1,100 fits D1 exactly
        decode_instance=D1, tbt_s=COST.step_s(1, 1000)
    )
    assert choose(views, loads, context=1000, output=101) == DecodeChoice(
        decode_instance=D2, tbt_s=COST.step_s(31, 91_000)
    )


def test_none_when_no_instance_has_room() -> None:
    """None when every instance is full or down."""
    views = [view(D0, capacity=1000, used=999), view(D1, up=False), view(D2, capacity=500)]
    assert choose(views, idle_loads(views), context=400, output=200) is None
    assert choose([], {}) is None


def test_ties_break_by_id() -> None:
    """Equal predicted TBT: the smallest id."""
    views = [view(D2), view(D0), view(D1)]
    choice = choose(views, {i: DecodeLoad(3, 3000) for i in (D0, D1, D2)})
    assert choice is not None and choice.decode_instance == D0


def test_uses_the_load_given_not_the_view() -> None:
    """The TBT comes from `loads` (current or predicted), not from the view's own batch."""
    views = [view(D0, used=90_000), view(D1)]
    choice = choose(views, {D0: DecodeLoad(0, 0), D1: DecodeLoad(5, 50_000)})
    assert choice == DecodeChoice(decode_instance=D0, tbt_s=COST.step_s(1, 1000))


def test_fractional_predicted_loads_are_rounded() -> None:
    """An expected batch of 2.6 counts as 3 (plus the request)."""
    choice = choose([view(D0)], {D0: DecodeLoad(2.6, 1234.9)})
    assert choice is not None
    assert choice.tbt_s == pytest.approx(COST.step_s(4, 1234 + 1000))


@st.composite
def decode_cases(draw: st.DrawFn) -> tuple[list[DecodeView], dict[InstanceId, DecodeLoad], int, int]:
    count = draw(st.integers(min_value=0, max_value=len(DECODE_IDS)))
    views, loads = [], {}
    for instance in DECODE_IDS[:count]:
        capacity = draw(st.integers(min_value=0, max_value=20_000))
        used = draw(st.integers(min_value=0, max_value=capacity))
        reserved = draw(st.integers(min_value=0, max_value=capacity - used))
        views.append(view(instance, capacity=capacity, used=used, reserved=reserved, up=draw(st.booleans())))
        loads[instance] = DecodeLoad(
            draw(st.sampled_from([0, 1, 2, 8]) | st.floats(0, 64)), draw(st.sampled_from([0, 5000]) | st.floats(0, 1e5))
        )
    return views, loads, draw(st.integers(min_value=1, max_value=8000)), draw(st.integers(min_value=1, max_value=4000))


@given(decode_cases(), st.sampled_from([0.02, 0.1, 0.3]))
def test_choice_is_the_brute_force_minimum(
    case: tuple[list[DecodeView], dict[InstanceId, DecodeLoad], int, int], slo: float
) -> None:
    """The choice is the minimum TBT / SLO (ties: id) among instances up with room; None iff there are none."""
    views, loads, context, output = case
    got = choose_decode(views, context_tokens=context, output_tokens=output, cost=COST, tbt_slo_s=slo, loads=loads)
    want = reference_decode(views, context_tokens=context, output_tokens=output, cost=COST, tbt_slo_s=slo, loads=loads)
    assert got == want
    if got is not None:
        chosen = next(v for v in views if v.instance_id == got.decode_instance)
        assert chosen.is_up and chosen.free_tokens() >= context + output


@given(decode_cases(), st.sampled_from([0.02, 0.1, 0.3]))
def test_without_loads_the_batches_now_count(
    case: tuple[list[DecodeView], dict[InstanceId, DecodeLoad], int, int], slo: float
) -> None:
    """Without `loads`, each instance's batch now is its load; a `DecodeBoard` of the views chooses alike."""
    views, _, context, output = case
    now = {v.instance_id: DecodeLoad(v.batch_size, v.context_tokens) for v in views}
    want = reference_decode(views, context_tokens=context, output_tokens=output, cost=COST, tbt_slo_s=slo, loads=now)
    for given_views in (views, DecodeBoard(views)):
        got = choose_decode(given_views, context_tokens=context, output_tokens=output, cost=COST, tbt_slo_s=slo)
        assert got == want
