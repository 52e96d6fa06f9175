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
        tbt_slo_s: the TBT objective (the score is TBT / SLO).
        loads: each instance's batch when the request would join it (default: its batch now).
    """
    needed = context_tokens + output_tokens
    best_key: tuple[float, InstanceId] | None = None
    best_tbt = 0.0
    for view in views:
        if not view.is_up or view.free_tokens() < needed:
            continue
        if loads is None:
            batch, tokens = view.batch_size, view.context_tokens
        else:
            load = loads[view.instance_id]
            batch, tokens = round(load.batch_size), int(load.context_tokens)
        tbt = cost.step_s(batch + 1, tokens + context_tokens)
        key = (tbt / tbt_slo_s, view.instance_id)
        if best_key is None or key < best_key:
            best_key, best_tbt = key, tbt
    if best_key is None:
        return None
    return DecodeChoice(decode_instance=best_key[1], tbt_s=best_tbt)
