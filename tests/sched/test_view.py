"""Tests for `mooncake.sched.view`: the boards that lay views side by side.

Examples for the contracts (a board is its views in the order given, ranks
order ids, `refresh` follows a view's changes); a property that a board built
from random views holds what each view says.
"""

from __future__ import annotations

import math

from hypothesis import given

from mooncake.sched.join import UNLIMITED, DecodeLimits, DecodeLoad
from mooncake.sched.view import ActiveDecode, DecodeBoard, DecodeView, PrefillBoard, PrefillView, QueuedPrefill
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
