"""Tests for `mooncake.sched.view`: the boards that lay views side by side.

Examples for the contracts (a board is its views in the order given, ranks
order ids, `refresh` follows a view's changes); a property that a board built
from random views holds what each view says; a state machine of decode views on
a board against the requests each holds.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mooncake.errors import InvalidRequestError
from mooncake.sched.join import UNLIMITED, DecodeLimits, DecodeLoad
from mooncake.sched.outcome import ABORT_REASONS, DECODE_REFUSALS, Reason
from mooncake.sched.view import (
    ActiveDecode,
    DecodeBoard,
    DecodeView,
    PrefillBoard,
    PrefillView,
    QueuedPrefill,
    RequestAborted,
    RequestRejected,
)
from mooncake.types import InstanceId, RequestId
from tests.strategies import prefill_views


def queued(name: str, finish_s: float) -> QueuedPrefill:
    return QueuedPrefill(request_id=RequestId(name), start_s=0.0, finish_s=finish_s)


def test_a_board_is_its_views_in_order_with_slots_in_id_order() -> None:
    """The sequence keeps the order given; array slots go in id order (so ties go to the smaller id)."""
    ids = [InstanceId(name) for name in ("prefill-2", "prefill-10", "prefill-1")]
    board = PrefillBoard([PrefillView(i) for i in ids])
    assert [v.instance_id for v in board] == ids and len(board) == 3 and board[1].instance_id == ids[1]
    assert board.instance_ids == (ids[2], ids[1], ids[0])  # "prefill-1" < "prefill-10" < "prefill-2"
    assert [v.instance_id for v in board.slot_views] == list(board.instance_ids)
    assert board.slot == {ids[2]: 0, ids[1]: 1, ids[0]: 2}
    assert board.busy_until_s.tolist() == [-math.inf] * 3 and board.all_up


def test_prefill_board_follows_queues_and_state_on_refresh() -> None:
    """After a view's queue or up state changes, `refresh` makes the board say so."""
    view = PrefillView(InstanceId("prefill-1"))
    board = PrefillBoard([view, PrefillView(InstanceId("prefill-0"))])
    view.queue.append(queued("a", 3.0))
    view.queue.append(queued("b", 5.0))
    view.is_up = False
    board.refresh(board.slot[view.instance_id])
    assert board.busy_until_s.tolist() == [-math.inf, 5.0]
    assert board.is_up.tolist() == [True, False] and not board.all_up
    board.check_invariants()
    view.is_up = True
    board.refresh(1)
    assert board.all_up


def test_decode_board_follows_reservations_and_batches_on_refresh() -> None:
    """An instance's committed load counts what decodes and what is reserved: batch, context read
    by a step (prompts), KV (prompt + output each); its limits sit beside it."""
    view = DecodeView(InstanceId("decode-0"), DecodeLimits(kv_capacity_tokens=10_000, max_batch_size=8))
    board = DecodeBoard([view])
    view.reserve(RequestId("a"), 600, 100)
    view.join(ActiveDecode(request_id=RequestId("b"), start_s=0.0, context_tokens=1000, output_tokens=200))
    board.refresh(0)
    assert view.load() == DecodeLoad(2, 1600, 1900) and view.free_tokens() == 10_000 - 1900
    assert board.committed.at(0) == DecodeLoad(2, 1600, 1900)
    assert (board.max_batch_size.tolist(), board.kv_capacity_tokens.tolist()) == ([8], [10_000])
    assert board.max_context_tokens.tolist() == [UNLIMITED]
    view.release(RequestId("a"))
    board.refresh(0)
    assert view.load() == DecodeLoad(1, 1000, 1200)
    board.check_invariants()


@given(prefill_views())
def test_prefill_board_holds_what_its_views_say(views: list[PrefillView]) -> None:
    """Built from views, a board's arrays equal the views' last finish times and states."""
    board = PrefillBoard(views)
    board.check_invariants()
    by_id = sorted(views, key=lambda v: v.instance_id)
    assert board.busy_until_s.tolist() == [v.busy_until_s(-math.inf) for v in by_id]


class DecodeBoardMachine(RuleBasedStateMachine):
    """Three decode views on a board, driven by reservations, joins, leaves, releases, limit changes and up/down,
    each followed by the board's refresh as the Conductor makes it, against a reference: per view, the requests
    reserved (prompt, output) and decoding (start, context, output). The committed load is counted from scratch
    (a request that ends at its first token takes no slot and no KV), and the board says what the views say."""

    def __init__(self) -> None:
        super().__init__()
        self.ids = [InstanceId(f"decode-{i}") for i in (2, 0, 1)]  # given out of id order: slots sort them
        self.views = {i: DecodeView(i, DecodeLimits(kv_capacity_tokens=10**6)) for i in self.ids}
        self.board = DecodeBoard(list(self.views.values()))
        self.reserved: dict[InstanceId, dict[RequestId, tuple[int, int]]] = {i: {} for i in self.ids}
        self.limits = {i: (UNLIMITED, UNLIMITED) for i in self.ids}  # (batch slots, a request's context) set last
        self.active: dict[InstanceId, dict[RequestId, tuple[float, int, int]]] = {i: {} for i in self.ids}
        self.numbers = iter(range(10**6))

    def _pick(self, data: st.DataObject, table: dict[InstanceId, dict[RequestId, Any]]) -> tuple[InstanceId, RequestId]:
        pairs = sorted((i, r) for i, requests in table.items() for r in requests)
        return data.draw(st.sampled_from(pairs))

    @rule(index=st.integers(0, 2), prompt=st.integers(1, 5000), output=st.integers(1, 500))
    def reserve(self, index: int, prompt: int, output: int) -> None:
        instance, request = self.ids[index], RequestId(f"r{next(self.numbers)}")
        self.views[instance].reserve(request, prompt, output)
        self.board.refresh_load(self.board.slot[instance])
        self.reserved[instance][request] = (prompt, output)

    @precondition(lambda self: any(self.reserved.values()))
    @rule(data=st.data(), start=st.floats(0, 1e6, allow_nan=False), grown=st.integers(0, 100))
    def join(self, data: st.DataObject, start: float, grown: int) -> None:
        instance, request = self._pick(data, self.reserved)
        prompt, output = self.reserved[instance].pop(request)
        context = prompt + min(grown, output)
        self.views[instance].join(
            ActiveDecode(
                request_id=request, start_s=start, context_tokens=context, output_tokens=prompt + output - context
            )
        )
        self.board.refresh_load(self.board.slot[instance])
        self.active[instance][request] = (start, context, prompt + output - context)

    @precondition(lambda self: any(self.reserved.values()))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        instance, request = self._pick(data, self.reserved)
        self.views[instance].release(request)
        self.board.refresh_load(self.board.slot[instance])
        del self.reserved[instance][request]

    @precondition(lambda self: any(self.active.values()))
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        instance, request = self._pick(data, self.active)
        self.views[instance].leave(request)
        self.board.refresh_load(self.board.slot[instance])
        del self.active[instance][request]

    @rule(
        index=st.integers(0, 2),
        up=st.booleans(),
        capacity=st.integers(1, 10**7),
        batch=st.none() | st.integers(1, 64),
        context=st.none() | st.integers(1, 10**6),
    )
    def set_state(self, index: int, up: bool, capacity: int, batch: int | None, context: int | None) -> None:
        view = self.views[self.ids[index]]
        limits = DecodeLimits(kv_capacity_tokens=capacity, max_batch_size=batch, max_context_tokens=context)
        view.is_up, view.limits = up, limits
        self.board.refresh(self.board.slot[view.instance_id])
        self.limits[view.instance_id] = (
            UNLIMITED if batch is None else batch,
            UNLIMITED if context is None else context,
        )

    @invariant()
    def loads_are_what_the_reference_counts(self) -> None:
        for instance, view in self.views.items():
            slots = [(p, o) for p, o in self.reserved[instance].values() if o > 1]
            active = self.active[instance].values()
            expected = DecodeLoad(
                len(active) + len(slots),
                sum(c for _, c, _ in active) + sum(p for p, _ in slots),
                sum(c + o for _, c, o in active) + sum(p + o for p, o in slots),
            )
            assert view.load() == expected == self.board.committed.at(self.board.slot[instance])
            assert view.started_s_sum == pytest.approx(sum(s for s, _, _ in active), abs=1e-6)
            slot = self.board.slot[instance]  # the limits the decode selection decides on: those set last
            assert (int(self.board.max_batch_size[slot]), int(self.board.max_context_tokens[slot])) == self.limits[
                instance
            ]
        assert list(self.board.instance_ids) == sorted(self.ids) and list(self.board) == list(self.views.values())
        self.board.check_invariants()
        for view in self.views.values():
            view.check_invariants()


TestDecodeBoardMachine = DecodeBoardMachine.TestCase


@pytest.mark.parametrize(
    ("limits", "named"),
    [
        (DecodeLimits(kv_capacity_tokens=10**6), "batch limits"),  # both unset now: the batch limit is checked first
        (DecodeLimits(kv_capacity_tokens=10**6, max_batch_size=1), "context limits"),
        (DecodeLimits(kv_capacity_tokens=10**6, max_batch_size=1, max_context_tokens=101), "context limits"),
    ],
)
def test_a_board_whose_limits_are_stale_fails_its_check(limits: DecodeLimits, named: str) -> None:
    """A view's batch or context limit changed without the board's refresh: the decode selection would decide
    on the old one (and fail in its own consistency check), so the board's check says which is out of sync."""
    view = DecodeView(
        InstanceId("decode-0"), DecodeLimits(kv_capacity_tokens=10**6, max_batch_size=1, max_context_tokens=100)
    )
    board = DecodeBoard([view])
    board.check_invariants()
    view.limits = limits
    with pytest.raises(AssertionError, match=named):
        board.check_invariants()
    board.refresh(0)
    board.check_invariants()


def test_a_decoding_batch_is_its_prompts_outputs_and_start_times_summed() -> None:
    """The decoding batch's arrays: prompts (the KV a step reads), expected outputs (the most they generate,
    which caps the tokens decode selection counts as grown) and start times, each summed, reservations apart."""
    view = DecodeView(InstanceId("decode-0"), DecodeLimits(kv_capacity_tokens=10_000))
    board = DecodeBoard([view])
    view.reserve(RequestId("r"), 600, 100)
    view.join(ActiveDecode(request_id=RequestId("a"), start_s=1.0, context_tokens=1000, output_tokens=200))
    view.join(ActiveDecode(request_id=RequestId("b"), start_s=2.5, context_tokens=50, output_tokens=7))
    board.refresh(0)
    assert (view.context_tokens, view.output_tokens, view.started_s_sum) == (1050, 207, 3.5)
    assert board.active_batch.tolist() == [2] and board.active_context.tolist() == [1050]
    assert board.active_output.tolist() == [207] and board.started_s_sum.tolist() == [3.5]
    view.leave(RequestId("a"))
    board.refresh(0)
    assert (view.context_tokens, view.output_tokens, board.active_output.tolist()) == (50, 7, [7])


def test_events_default_to_the_documented_reasons() -> None:
    """A decode instance's refusal without a why is DECODE_REJECTED; an abort without one is FAILED."""
    assert (
        RequestRejected(request_id=RequestId("r"), instance_id=InstanceId("d"), now=0.0).reason
        is Reason.DECODE_REJECTED
    )
    assert RequestAborted(request_id=RequestId("r"), now=0.0).reason is Reason.FAILED


@given(reason=st.sampled_from(list(Reason)))
def test_a_refusal_or_an_abort_takes_only_a_reason_of_its_kind(reason: Reason) -> None:
    """A decode instance refuses for one of `DECODE_REFUSALS` (the decode rule's, or none said) and a request is
    aborted for one of `ABORT_REASONS` (a failure or its client): anything else (an abort "for the TTFT
    objective") is an InvalidRequestError naming the reason, never a request ended as what it was not. The two
    sets do not meet, and neither holds the Conductor's own rejections before prefill."""
    assert not DECODE_REFUSALS & ABORT_REASONS
    assert not {Reason.NO_PREFILL_INSTANCE, Reason.NO_DECODE_INSTANCE, Reason.TTFT_SLO} & (
        DECODE_REFUSALS | ABORT_REASONS
    )
    ids = {"request_id": RequestId("r"), "now": 0.0, "reason": reason}
    if reason in DECODE_REFUSALS:
        assert RequestRejected(instance_id=InstanceId("d"), **ids).reason is reason
    else:
        with pytest.raises(InvalidRequestError, match=f"reason {reason} is no reason for a decode instance's refusal"):
            RequestRejected(instance_id=InstanceId("d"), **ids)
    if reason in ABORT_REASONS:
        assert RequestAborted(**ids).reason is reason
    else:
        with pytest.raises(InvalidRequestError, match=f"reason {reason} is no reason for an abort: one of CLIENT_GONE"):
            RequestAborted(**ids)
