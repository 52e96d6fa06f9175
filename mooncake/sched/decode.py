"""Decode selection: the decode instance with the lowest predicted TBT among those that can take the request.

A candidate is up and passes the decode rule's structural checks
(`sched.join`: context, batch slots, KV) against the load it is committed to:
its decoding requests and those reserved there (accepted, still in prefill),
or the load predicted for when the request will arrive (`loads`). Among the
candidates the lowest step time with the request added wins, ties by instance
id; the choice carries the rule's verdict for it, TBT included, which the
admission policy may act on. When no instance can take the request, the
choice names no instance and its verdict says which bound stopped it (the
reason most instances that are up give; no instance up: NO_DECODE_INSTANCE).

The step model is an `AnalyticStepModel`: its roofline gives the step times
of all candidates as one array expression.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence

import attrs
import numpy as np

from mooncake.sched.join import DecodeLoad, JoinVerdict, blocked, check_join
from mooncake.sched.outcome import Reason
from mooncake.sched.step import AnalyticStepModel
from mooncake.sched.view import DecodeBoard, DecodeView
from mooncake.types import InstanceId

__all__ = ["DecodeChoice", "choose_decode"]


@attrs.frozen(kw_only=True)
class DecodeChoice:
    """The chosen decode instance (None: none can take the request) and the decode rule's verdict
    there, with the TBT predicted with the request in its batch."""

    decode_instance: InstanceId | None
    verdict: JoinVerdict

    @property
    def tbt_s(self) -> float | None:
        return self.verdict.predicted_tbt_s


def choose_decode(
    views: Sequence[DecodeView],
    *,
    prompt_tokens: int,
    output_tokens: int,
    step_model: AnalyticStepModel,
    tbt_slo_s: float,
    loads: Mapping[InstanceId, DecodeLoad] | None = None,
) -> DecodeChoice:
    """The best decode instance for a request (see the module docstring).

    Args:
        views: every decode instance (a `DecodeBoard` of them is read without a loop).
        prompt_tokens, output_tokens: the request's prompt and expected output.
        step_model: the decode step model; tbt_slo_s: the TBT objective of the verdict.
        loads: each instance's load when the request would join it (default: what it is committed to now).

    Raises:
        InvalidRequestError: a token count that is not an integer >= 1.
    """
    board = views if isinstance(views, DecodeBoard) else DecodeBoard(views)
    if loads is None:
        batch, context, kv = board.batch_size, board.context_tokens, board.kv_tokens
    else:
        ids = board.instance_ids
        predicted = [loads.get(instance, DecodeLoad(0, 0, 0)) for instance in ids]
        batch = np.array([round(p.batch_size) for p in predicted], dtype=np.int64)
        context = np.array([round(p.context_tokens) for p in predicted], dtype=np.int64)
        kv = np.array([round(p.kv_tokens) for p in predicted], dtype=np.int64)
    refused = blocked(
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        batch_size=batch,
        kv_tokens=kv,
        max_batch_size=board.max_batch_size,
        kv_capacity_tokens=board.kv_capacity_tokens,
        max_context_tokens=board.max_context_tokens,
    )
    up = board.is_up if not board.all_up else np.ones(len(board), dtype=bool)
    candidates = np.flatnonzero(up & ~refused)
    if not candidates.size:
        return _nobody(board, up, batch, context, kv, prompt_tokens, output_tokens)
    steps = step_model.roofline().step_times(batch[candidates] + 1, context[candidates] + prompt_tokens)
    slot = int(candidates[int(np.argmin(steps))])  # slots go in id order: the first minimum is the smallest id
    load = DecodeLoad(int(batch[slot]), int(context[slot]), int(kv[slot]))
    verdict = check_join(
        board.slot_views[slot].limits,
        load,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        step_model=step_model,
        tbt_slo_s=tbt_slo_s,
    )
    return DecodeChoice(decode_instance=board.instance_ids[slot], verdict=verdict)


def _nobody(
    board: DecodeBoard,
    up: np.ndarray,
    batch: np.ndarray,
    context: np.ndarray,
    kv: np.ndarray,
    prompt_tokens: int,
    output_tokens: int,
) -> DecodeChoice:
    """No instance can take the request: the reason most of those up give (ties: the earlier check)."""
    reasons: collections.Counter[Reason] = collections.Counter()
    for slot in np.flatnonzero(up).tolist():
        load = DecodeLoad(int(batch[slot]), int(context[slot]), int(kv[slot]))
        verdict = check_join(
            board.slot_views[slot].limits, load, prompt_tokens=prompt_tokens, output_tokens=output_tokens
        )
        assert verdict.reason is not None  # the structural checks refused it: so must the rule
        reasons[verdict.reason] += 1
    order = list(Reason)
    reason = min(reasons, key=lambda r: (-reasons[r], order.index(r))) if reasons else Reason.NO_DECODE_INSTANCE
    return DecodeChoice(decode_instance=None, verdict=JoinVerdict(accepted=False, reason=reason))
