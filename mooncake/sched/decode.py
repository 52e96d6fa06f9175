"""Decode selection: the decode instance with the lowest predicted TBT relative to its SLO.

A candidate must be up and have KV room for the request (its prompt plus its
expected output). Its predicted TBT is the decode step time of its batch with
the request added, the batch taken from `loads` (current, or predicted for the
time the request will arrive); the lowest TBT / SLO wins, ties by instance id.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import numpy as np

from mooncake.sched.cost import DecodeCostModel
from mooncake.sched.predictor import DecodeLoad
from mooncake.sched.view import DecodeBoard, DecodeView
from mooncake.types import InstanceId

__all__ = ["DecodeChoice", "choose_decode"]


@attrs.frozen(kw_only=True)
class DecodeChoice:
    """The chosen decode instance and the TBT predicted with the request in its batch."""

    decode_instance: InstanceId
    tbt_s: float


def choose_decode(
    views: Sequence[DecodeView],
    *,
    context_tokens: int,
    output_tokens: int,
    cost: DecodeCostModel,
    tbt_slo_s: float,
    loads: Mapping[InstanceId, DecodeLoad] | None = None,
) -> DecodeChoice | None:
    """The best decode instance for a request, or None if none is up with room for it.

    Args:
        views: every decode instance (a `DecodeBoard` of them is read without a loop).
        context_tokens, output_tokens: the request's prompt and expected output.
        cost: the decode step model.
        tbt_slo_s: the TBT objective (the score is TBT / SLO, which ranks as TBT does).
        loads: each instance's batch when the request would join it (default: its batch now).
    """
    board = views if isinstance(views, DecodeBoard) else DecodeBoard(views)
    if not len(board):
        return None
    # step_s(batch, tokens) = fixed + tokens · per_token for any batch > 0, so the
    # lowest TBT is the fewest tokens: compare those; slots go in id order, so the
    # first of the fewest is the smallest id.
    fits = board.free_tokens >= context_tokens + output_tokens
    if not board.all_up:
        fits &= board.is_up
    if loads is None:
        best = int(np.where(fits, board.context_tokens, _NO_ROOM).argmin())
        if not fits[best]:
            return None
        view = board.slot_views[best]
        batch, best_tokens = view.batch_size, view.context_tokens
    else:
        candidates = np.flatnonzero(fits).tolist()
        if not candidates:
            return None
        ids = board.instance_ids
        tokens = [int(loads[ids[slot]].context_tokens) for slot in candidates]
        best_tokens = min(tokens)
        view = board.slot_views[candidates[tokens.index(best_tokens)]]
        batch = round(loads[view.instance_id].batch_size)
    tbt = cost.step_s(batch + 1, best_tokens + context_tokens)
    return DecodeChoice(decode_instance=view.instance_id, tbt_s=tbt)


_NO_ROOM = np.iinfo(np.int64).max  # in place of the tokens of an instance the request does not fit
