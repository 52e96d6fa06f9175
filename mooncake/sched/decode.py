"""Decode selection: the decode instance with the lowest step time among those that can take the request.

Two loads of each instance are in play. What it is committed to (its decoding
requests and those reserved there: accepted, still in prefill or transfer)
ranks the instances: among the candidates, the lowest step time with the
request added to that batch wins, ties by instance id, so requests on their
way count and arrivals spread over equally good instances instead of piling
onto one. The load the admission policy asks about (`loads`: none at all for
a policy that leaves the decode side's check to the instance, the committed
one, or the batch predicted for the request's arrival; by default the
committed one) decides: a candidate is an instance that is up and that the
decode rule (`sched.join`: context, batch slots, KV) lets the request into
against that load, and the choice carries the rule's verdict there, its TBT
check included, for the policy to act on. When no instance can take the
request, the choice names no instance and its verdict says which bound stopped
it (the reason most instances that are up give; none up: NO_DECODE_INSTANCE).

The step model is an `AnalyticStepModel`: its roofline is what the scan over
the instances (`sched._kernels.best_decode_slot`, one compiled loop where numba
imports) evaluates per instance, to the bit as `step_s` would.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import attrs
import numpy as np

from mooncake.cache._compiled import kernels
from mooncake.sched.join import JoinVerdict, check_join, check_tokens, tbt_verdict
from mooncake.sched.outcome import Reason
from mooncake.sched.step import AnalyticStepModel
from mooncake.sched.view import BoardLoads, DecodeBoard, DecodeView
from mooncake.types import InstanceId

__all__ = ["DecodeChoice", "choose_decode"]

_KERNELS = "mooncake.sched._kernels"


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
    loads: BoardLoads | None = None,
) -> DecodeChoice:
    """The best decode instance for a request (see the module docstring).

    Args:
        views: every decode instance (a `DecodeBoard` of them is read without a loop).
        prompt_tokens, output_tokens: the request's prompt and expected output.
        step_model: the decode step model; tbt_slo_s: the TBT objective of the verdict.
        loads: the load the decode rule checks, slot by slot in the board's order (default: the committed one).

    Raises:
        InvalidRequestError: a token count that is not an integer >= 1.
    """
    check_tokens(prompt_tokens, output_tokens)
    board = views if isinstance(views, DecodeBoard) else DecodeBoard(views)
    checked = board.committed if loads is None else loads
    committed, roofline = board.committed, step_model.roofline()
    slot, predicted = kernels(_KERNELS).best_decode_slot(
        prompt_tokens,
        output_tokens,
        board.is_up,
        checked.batch_size,
        checked.context_tokens,
        checked.kv_tokens,
        board.max_batch_size,
        board.kv_capacity_tokens,
        board.max_context_tokens,
        committed.batch_size,
        committed.context_tokens,
        roofline.coefficients,
        roofline.overhead_s,
    )
    if slot < 0:
        return _nobody(board, checked, prompt_tokens, output_tokens)
    # The rule's verdict there (`check_join`): its structural checks passed in the scan, which also
    # predicted the step on the checked load (the roofline's is the step model's own, to the bit).
    verdict = tbt_verdict(int(checked.batch_size[slot]), output_tokens, float(predicted), tbt_slo_s)
    return DecodeChoice(decode_instance=board.instance_ids[slot], verdict=verdict)


def _nobody(board: DecodeBoard, checked: BoardLoads, prompt_tokens: int, output_tokens: int) -> DecodeChoice:
    """No instance can take the request: the reason most of those up give (ties: the earlier check)."""
    reasons: collections.Counter[Reason] = collections.Counter()
    for slot in np.flatnonzero(board.is_up).tolist():
        verdict = check_join(
            board.slot_views[slot].limits, checked.at(slot), prompt_tokens=prompt_tokens, output_tokens=output_tokens
        )
        assert verdict.reason is not None  # the structural checks refused it: so must the rule
        reasons[verdict.reason] += 1
    order = list(Reason)
    reason = min(reasons, key=lambda r: (-reasons[r], order.index(r))) if reasons else Reason.NO_DECODE_INSTANCE
    return DecodeChoice(decode_instance=None, verdict=JoinVerdict(accepted=False, reason=reason))
