"""Tests for `mooncake.sched.decode.choose_decode`.

Example tests for the contracts (lowest step time wins, reservations count,
limits and liveness required, ties by id, the load given is the one used, the
reason when no instance can take the request); properties against the
brute-force choice of `tests/reference/sched.py` over random decode views,
limits and loads, with and without a board.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.errors import InvalidRequestError
from mooncake.sched.cost import HARDWARE, MODELS
from mooncake.sched.decode import DecodeChoice, choose_decode, generated_tokens, lasting_decode_refusal
from mooncake.sched.join import DecodeLimits, DecodeLoad, JoinVerdict
from mooncake.sched.outcome import Reason
from mooncake.sched.step import DecodeCostModel
from mooncake.sched.view import ActiveDecode, BoardLoads, DecodeBoard, DecodeView
from mooncake.types import InstanceId, RequestId
from tests.reference.sched import reference_decode

COST = DecodeCostModel(model=MODELS["llama3-70b"], hardware=HARDWARE["8xA800"])
D0, D1, D2 = InstanceId("decode-0"), InstanceId("decode-1"), InstanceId("decode-2")
DECODE_IDS = tuple(InstanceId(f"decode-{i}") for i in range(6))


def view(
    instance: InstanceId,
    *,
    capacity: int = 100_000,
    used: int = 0,
    reserved: int = 0,
    up: bool = True,
    max_batch: int | None = None,
    max_context: int | None = None,
    started_s: float = 0.0,
    output: int = 0,
) -> DecodeView:
    """A decode view with `used` tokens held by one active request (`output` <= `used` of them its expected
    output, decoding since `started_s`) and `reserved` (>= 3) by one on its way."""
    limits = DecodeLimits(kv_capacity_tokens=capacity, max_batch_size=max_batch, max_context_tokens=max_context)
    decode = DecodeView(instance, limits, is_up=up)
    if used:
        decode.join(
            ActiveDecode(
                request_id=RequestId("active"), start_s=started_s, context_tokens=used - output, output_tokens=output
            )
        )
    if reserved >= 3:  # a request on its way: `reserved` tokens, two of them output
        decode.reserve(RequestId("incoming"), reserved - 2, 2)
    return decode


def choose(
    views: Sequence[DecodeView],
    loads: dict[InstanceId, DecodeLoad] | None = None,
    *,
    prompt: int = 1000,
    output: int = 100,
    slo: float = 0.1,
) -> DecodeChoice:
    """`choose_decode` on a board of `views`, the rule checked on `loads` (by instance) when given."""
    board = DecodeBoard(views)
    return choose_decode(
        board,
        prompt_tokens=prompt,
        output_tokens=output,
        step_model=COST,
        tbt_slo_s=slo,
        loads=None if loads is None else BoardLoads.of([loads[i] for i in board.instance_ids]),
    )


def chosen(instance: InstanceId, batch: int, context: int) -> DecodeChoice:
    return DecodeChoice(
        decode_instance=instance, verdict=JoinVerdict(accepted=True, predicted_tbt_s=COST.step_s(batch, context))
    )


def committed(instance: InstanceId, *, decoding: int = 0, reserved: int = 0, context: int = 0) -> DecodeView:
    """A view committed to `decoding` requests decoding and `reserved` on their way, `context`
    prompt tokens in all (spread over them)."""
    decode = view(instance, capacity=10**7)
    members = decoding + reserved
    for i in range(members):
        share = context // members + (1 if i < context % members else 0)
        if i < decoding:
            decode.join(
                ActiveDecode(request_id=RequestId(f"a{i}"), start_s=0.0, context_tokens=share, output_tokens=10)
            )
        else:
            decode.reserve(RequestId(f"r{i}"), share, 10)
    return decode


def test_lowest_predicted_tbt_wins() -> None:
    """The instance whose committed batch (with the request) steps fastest is chosen, with that TBT."""
    views = [committed(D0, decoding=4, context=90_000), committed(D1, decoding=2, context=10_000)]
    views.append(committed(D2, decoding=4, reserved=4, context=50_000))
    assert choose(views) == chosen(D1, 3, 11_000)


def test_reservations_count_toward_the_batch_and_its_context() -> None:
    """A request accepted for D0 and still in prefill makes D0's batch one longer and its step
    read that prompt: the next request goes to the idle D1, not onto D0 again."""
    busy, idle = view(D0), view(D1)
    busy.reserve(RequestId("in-prefill"), 1000, 100)
    assert busy.load() == DecodeLoad(1, 1000, 1100)
    assert choose([busy, idle]) == chosen(D1, 1, 1000)


def test_down_instances_are_skipped() -> None:
    """An instance that is down is never chosen, however idle."""
    views = [view(D0, up=False), committed(D1, decoding=10, context=80_000)]
    assert choose(views).decode_instance == D1


def test_instances_without_room_are_skipped() -> None:
    """KV room counts what is used and what is reserved; prompt plus expected output must fit."""
    views = [view(D0, capacity=2000, used=500, reserved=401), view(D1, capacity=2000, used=900)]
    views.append(committed(D2, decoding=30, context=90_000))
    assert choose(views, prompt=1000, output=100) == chosen(D1, 2, 1900)  # 1,100 fits D1 exactly
    assert choose(views, prompt=1000, output=101) == chosen(D2, 31, 91_000)


def test_full_batches_are_skipped() -> None:
    """An instance at its batch-size limit (decoding plus reserved) is passed over."""
    full = view(D0, max_batch=1)
    full.reserve(RequestId("in-prefill"), 10, 10)
    assert choose([full, view(D1, used=50_000)]).decode_instance == D1


def test_no_instance_names_the_bound_that_stopped_it() -> None:
    """No instance can take the request: no instance at all, or all down, is NO_DECODE_INSTANCE;
    otherwise the reason most instances give (ties: the earlier check) among those that could take it once
    room frees; when none up could, NO_DECODE_INSTANCE while one that could is down (a 503: it may return),
    CONTEXT_TOO_LONG only when none ever could (a 400)."""
    nobody = DecodeChoice(decode_instance=None, verdict=JoinVerdict(accepted=False, reason=Reason.NO_DECODE_INSTANCE))
    assert choose([]) == nobody
    assert choose([view(D0, up=False)]) == nobody
    small, large_down = view(D0, capacity=500), view(D1, up=False)
    assert choose([small, large_down], prompt=450) == nobody
    assert choose([small, view(D1, capacity=500, up=False)], prompt=450).verdict.reason is Reason.CONTEXT_TOO_LONG
    kv = [view(D0, capacity=1000, used=999), view(D1, capacity=500), view(D2, max_context=10)]
    assert choose(kv, prompt=400, output=200).verdict.reason is Reason.KV_BUDGET  # D1, D2: never; D0: room
    full = view(D0, max_batch=1, used=5)
    assert choose([full, view(D1, max_context=10)]).verdict.reason is Reason.BATCH_FULL
    assert choose([view(D0, max_context=10), view(D1, capacity=500)], prompt=450).verdict.reason is (
        Reason.CONTEXT_TOO_LONG
    )
    # As many refuse for the batch as for KV: the batch, checked first, in either order of the instances.
    batch_full, kv_full = view(D0, max_batch=1, used=5), view(D1, capacity=1000, used=999)
    for views in ([batch_full, kv_full], [kv_full, batch_full]):
        assert choose(views, prompt=400, output=200).verdict.reason is Reason.BATCH_FULL


def test_ties_break_by_id() -> None:
    """Equal predicted TBT: the smallest id."""
    views = [committed(instance, decoding=3, context=3000) for instance in (D2, D0, D1)]
    assert choose(views).decode_instance == D0


def test_ranks_on_the_committed_load_and_checks_on_the_load_asked_about() -> None:
    """Selection compares what each instance is committed to; the decode rule and the verdict's TBT
    use the load the policy asks about (here: nothing decodes yet, the reserved ones are in prefill)."""
    views = [committed(D0, reserved=8, context=8000), committed(D1, decoding=1, context=1000)]
    now = {D0: DecodeLoad(0, 0, 0), D1: DecodeLoad(1, 1000, 1010)}
    assert choose(views, now) == chosen(D1, 2, 2000)


def test_fractional_predicted_loads_are_rounded() -> None:
    """An expected batch of 2.6 counts as 3 (plus the request)."""
    views = [committed(D0, reserved=4, context=4000)]
    assert choose(views, {D0: DecodeLoad(2.6, 1234.4, 0)}) == chosen(D0, 4, 1234 + 1000)


def test_the_verdict_carries_the_tbt_check() -> None:
    """The chosen instance's verdict refuses the request when its step would pass the SLO."""
    choice = choose([committed(D0, decoding=8, context=900_000)], slo=0.01)
    assert choice.decode_instance == D0
    assert choice.verdict == JoinVerdict(accepted=False, reason=Reason.TBT_SLO, predicted_tbt_s=COST.step_s(9, 901_000))


def test_a_predicted_load_is_refused_for_tbt_only_where_no_instance_passes() -> None:
    """Predictive admission: D0, committed to less, ranks first, but is predicted to still hold its batch when the
    request arrives, where its step would exceed the TBT objective; D1, committed to more, is predicted empty by
    then and passes. The request goes to D1 (it was refused for TBT on D0's load while D1 would take it). Only
    when every instance fails does the choice carry the TBT refusal, on the one ranked first."""
    views = [committed(D0, decoding=2, context=200_000), committed(D1, decoding=8, context=800_000)]
    emptied = {D0: DecodeLoad(2, 200_000, 200_020), D1: DecodeLoad(0, 0, 0)}
    assert COST.step_s(3, 204_000) > 0.02 > COST.step_s(1, 4000)  # D0 fails with its predicted batch, D1 passes
    assert COST.step_s(3, 204_000) < COST.step_s(9, 804_000)  # D0 ranks first on what it is committed to
    assert choose(views, emptied, prompt=4000, slo=0.02) == chosen(D1, 1, 4000)
    both_busy = {**emptied, D1: DecodeLoad(2, 300_000, 300_020)}
    refused = choose(views, both_busy, prompt=4000, slo=0.02)
    assert refused.decode_instance == D0
    assert refused.verdict == JoinVerdict(
        accepted=False, reason=Reason.TBT_SLO, predicted_tbt_s=COST.step_s(3, 204_000)
    )


def test_instances_that_pass_the_tbt_check_spread_by_their_committed_load() -> None:
    """Among the instances whose predicted load passes the TBT check, what each is committed to still ranks them:
    of two predicted empty, the one with less on its way wins (arrivals do not pile onto one)."""
    views = [committed(D0, reserved=3, context=3000), committed(D1, reserved=1, context=1000)]
    views.append(committed(D2, decoding=1, context=100))
    empty = DecodeLoad(0, 0, 0)
    loads = {D0: empty, D1: empty, D2: DecodeLoad(1, 900_000, 900_010)}  # D2 ranks first but fails TBT
    assert choose(views, loads, slo=0.02) == chosen(D1, 1, 1000)


_loads = st.builds(
    DecodeLoad,
    st.sampled_from([0, 1, 2, 8]) | st.floats(0, 64),
    st.sampled_from([0, 5000]) | st.floats(0, 1e5),
    st.sampled_from([0, 5000]) | st.floats(0, 2e4),
)


@st.composite
def decode_cases(draw: st.DrawFn) -> tuple[list[DecodeView], dict[InstanceId, DecodeLoad], int, int]:
    count = draw(st.integers(min_value=0, max_value=len(DECODE_IDS)))
    views, loads = [], {}
    for instance in DECODE_IDS[:count]:
        capacity = draw(st.integers(min_value=0, max_value=20_000))
        used = draw(st.integers(min_value=0, max_value=capacity))
        reserved = draw(st.integers(min_value=0, max_value=capacity - used))
        views.append(
            view(
                instance,
                capacity=capacity,
                used=used,
                reserved=reserved,
                up=draw(st.booleans()),
                max_batch=draw(st.none() | st.integers(1, 3)),
                max_context=draw(st.none() | st.integers(1, 12_000)),
                started_s=draw(st.sampled_from([0.0, 30.0]) | st.floats(0.0, 60.0)),
                output=draw(st.integers(min_value=0, max_value=used)),
            )
        )
        loads[instance] = draw(_loads)
    return views, loads, draw(st.integers(min_value=1, max_value=8000)), draw(st.integers(min_value=1, max_value=4000))


@given(decode_cases(), st.sampled_from([0.02, 0.1, 0.3]))
def test_choice_is_the_brute_force_minimum(
    case: tuple[list[DecodeView], dict[InstanceId, DecodeLoad], int, int], slo: float
) -> None:
    """With loads asked about: the lowest committed step time among the instances up that the decode
    rule lets in on those loads, TBT included (ties: id); where its TBT check refuses it on every instance its
    other checks let it into, the lowest among those, with the rule's verdict there; none: the reason most give."""
    views, loads, prompt, output = case
    got = choose(views, loads, prompt=prompt, output=output, slo=slo)
    assert got == reference_decode(
        views, prompt_tokens=prompt, output_tokens=output, step_model=COST, tbt_slo_s=slo, loads=loads
    )


@given(decode_cases(), st.sampled_from([0.02, 0.1, 0.3]), st.none() | st.sampled_from([60.0]) | st.floats(0.0, 120.0))
def test_without_loads_what_is_committed_counts(
    case: tuple[list[DecodeView], dict[InstanceId, DecodeLoad], int, int], slo: float, now: float | None
) -> None:
    """Without `loads`, each instance's committed load (decoding and reserved) is used, with `now` its decoding
    requests' context grown by the tokens generated since they joined, ranked and checked; a `DecodeBoard`
    of the views chooses alike."""
    views, _, prompt, output = case
    want = reference_decode(views, prompt_tokens=prompt, output_tokens=output, step_model=COST, tbt_slo_s=slo, now=now)
    for given_views in (views, DecodeBoard(views)):
        got = choose_decode(
            given_views, prompt_tokens=prompt, output_tokens=output, step_model=COST, tbt_slo_s=slo, now=now
        )
        assert got == want


@given(decode_cases(), st.sampled_from([0.02, 0.1, 0.3]), st.floats(0.0, 120.0))
def test_loads_asked_about_do_not_grow(
    case: tuple[list[DecodeView], dict[InstanceId, DecodeLoad], int, int], slo: float, now: float
) -> None:
    """A load the policy asks about (a prediction) is checked as given: only the ranking grows with `now`."""
    views, loads, prompt, output = case
    want = reference_decode(
        views, prompt_tokens=prompt, output_tokens=output, step_model=COST, tbt_slo_s=slo, loads=loads, now=now
    )
    board = DecodeBoard(views)
    asked = BoardLoads.of([loads[i] for i in board.instance_ids])
    got = choose_decode(
        board, prompt_tokens=prompt, output_tokens=output, step_model=COST, tbt_slo_s=slo, loads=asked, now=now
    )
    assert got == want


def test_a_time_that_is_not_a_finite_number_is_an_invalid_request() -> None:
    for bad in (math.nan, math.inf, "1.0"):
        with pytest.raises(InvalidRequestError, match="now"):
            choose_decode([view(D0)], prompt_tokens=10, output_tokens=10, step_model=COST, tbt_slo_s=0.1, now=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("views", [None, 7, "decode-0", [1], [None], (view(D0), "decode-1")])
def test_views_that_are_no_decode_views_are_an_invalid_request(views: object) -> None:
    """What is no collection of decode views is an InvalidRequestError naming `views` and the value, from
    `choose_decode` and `lasting_decode_refusal` alike, never a TypeError or AttributeError from inside."""
    with pytest.raises(InvalidRequestError, match="views must"):
        choose_decode(views, prompt_tokens=10, output_tokens=10, step_model=COST, tbt_slo_s=0.1)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="views must"):
        lasting_decode_refusal(views, prompt_tokens=10, output_tokens=10)  # type: ignore[arg-type]


def test_a_board_or_any_sequence_of_views_is_taken() -> None:
    """A board, a list, a tuple or a generator of views: the same answers."""
    views = [view(D0, capacity=500), view(D1)]
    for given_views in (DecodeBoard(views), views, tuple(views), (v for v in views)):
        choice = choose_decode(given_views, prompt_tokens=1000, output_tokens=100, step_model=COST, tbt_slo_s=0.1)
        assert choice.decode_instance == D1
    for given_views in (DecodeBoard(views), views, tuple(views), (v for v in views)):
        assert lasting_decode_refusal(given_views, prompt_tokens=1000, output_tokens=100) is None


@given(
    st.lists(st.tuples(st.floats(0.0, 50.0), st.integers(1, 8000), st.integers(1, 2000)), max_size=6),
    st.floats(0.0, 100.0),
    st.floats(0.0, 10.0),
)
def test_generated_tokens_are_the_decoding_seconds_over_the_batch_step(
    members: list[tuple[float, int, int]], now: float, later: float
) -> None:
    """What decode selection counts a batch to have generated: its members' decoding seconds over the step the
    whole batch runs at, rounded down, at most their outputs, and never fewer at a later `now`."""
    active = [
        ActiveDecode(request_id=RequestId(f"r{i}"), start_s=start, context_tokens=context, output_tokens=output)
        for i, (start, context, output) in enumerate(members)
    ]
    got = generated_tokens(COST, active, now)
    outputs = sum(a.output_tokens for a in active)
    if not active:
        assert got == 0
        return
    step_s = COST.step_s(len(active), sum(a.context_tokens for a in active))
    decoded_s = len(active) * now - sum(a.start_s for a in active)  # sum(now - start_s), summed as the scan sums it
    expected = min(math.floor(decoded_s / step_s), outputs) if decoded_s > 0 else 0
    assert got == expected
    assert 0 <= got <= outputs
    assert generated_tokens(COST, active, now + later) >= got
