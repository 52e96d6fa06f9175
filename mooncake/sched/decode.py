"""Decode selection: the decode instance with the lowest predicted TBT relative to its SLO.

A candidate must be up and have KV room for the request (its prompt plus its
expected output). Its predicted TBT is the decode step time of its batch with
the request added, the batch taken from `loads` (current, or predicted for the
time the request will arrive); the lowest TBT / SLO wins, ties by instance id.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from mooncake.sched.cost import DecodeCostModel
from mooncake.sched.predictor import DecodeLoad
from mooncake.sched.view import DecodeView
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
        views: every decode instance.
        context_tokens, output_tokens: the request's prompt and expected output.
        cost: the decode step model.
        tbt_slo_s: the TBT objective (the score is TBT / SLO, which ranks as TBT does).
        loads: each instance's batch when the request would join it (default: its batch now).
    """
    needed = context_tokens + output_tokens
    # step_s(batch, tokens) = fixed + tokens · per_token for any batch > 0, so the
    # lowest TBT is the fewest tokens: compare those (cheap, as this loop runs over
    # every decode instance for every request), ties by instance id.
    best_view: DecodeView | None = None
    best_tokens = 0
    for view in views:
        if not view.is_up or view.capacity_tokens - view.used_tokens - view.reserved_tokens < needed:
            continue
        tokens = view.context_tokens if loads is None else int(loads[view.instance_id].context_tokens)
        if (
            best_view is None
            or tokens < best_tokens
            or (tokens == best_tokens and view.instance_id < best_view.instance_id)
        ):
            best_view, best_tokens = view, tokens
    if best_view is None:
        return None
    batch = best_view.batch_size if loads is None else round(loads[best_view.instance_id].batch_size)
    tbt = cost.step_s(batch + 1, best_tokens + context_tokens)
    return DecodeChoice(decode_instance=best_view.instance_id, tbt_s=tbt)
