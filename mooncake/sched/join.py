"""The decode rule: can this decode instance take this request? One answer for every caller.

The Conductor asks it of each decode instance when it chooses one and when it
admits a request (against the load it knows now, or predicts for when the
request will arrive); the simulated decode nodes and the real `DecodeEngine`
ask it of their own batch when a prefilled request reaches them. The checks,
in order (the first that fails is the reason):

    CONTEXT_TOO_LONG  prompt + output > max_context_tokens (a request's own room),
                      or > kv_capacity_tokens (its KV would not fit the instance
                      alone: no wait makes room for it)
    BATCH_FULL        batch_size + 1 > max_batch_size
    KV_BUDGET         kv_tokens + prompt + output > kv_capacity_tokens
    TBT_SLO           step_s(batch_size + 1, context_tokens + prompt) > tbt_slo_s,
                      checked only when the batch is not empty (a lone request
                      decodes as fast as the instance can: refusing it would
                      refuse it forever)

`kv_tokens` counts every member's whole reservation (prompt + output: the KV it
will hold at its end), `context_tokens` the KV a step reads now. A request whose
only token is its prefill's (output 1) never takes a slot: only its context is
checked. With a step model the verdict carries the predicted step time with the
request added, whether or not it was checked. `refusal` is the structural checks
(all but TBT) on plain numbers, written so that numba compiles the same
definition for the decode selection's scan over a board of instances.
"""

from __future__ import annotations

import math
import numbers

import attrs
import numpy as np

from mooncake._checks import int_at_least, shown
from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.sched.outcome import Reason
from mooncake.sched.step import StepModel
from mooncake.types import check_token_count

__all__ = [
    "DecodeLimits",
    "DecodeLoad",
    "JoinVerdict",
    "REFUSALS",
    "UNLIMITED",
    "check_join",
    "check_tbt_slo",
    "check_tokens",
    "load_problem",
    "refusal",
    "takes_slot",
    "tbt_refused",
    "tbt_verdict",
]

UNLIMITED = np.iinfo(np.int64).max // 4  # a limit nothing reaches (room for sums without overflow)
_LIMIT_BOUND = UNLIMITED + 1  # 2**61: a limit may be as large as UNLIMITED, no larger


def takes_slot(output_tokens: int) -> bool:
    """Whether a request with `output_tokens` (the prefill's first token included) joins a decode batch:
    one that ends at its first token never does, and holds no KV there. (`refusal` writes the same test
    inline, for numba.)"""
    return output_tokens > 1


def _limit(value: int | None) -> int:
    return UNLIMITED if value is None else value


@attrs.frozen(kw_only=True)
class DecodeLimits:
    """What one decode instance can hold.

    Attributes:
        kv_capacity_tokens: KV tokens its memory holds beside the weights.
        max_batch_size: requests decoding at once (None: as many as fit).
        max_context_tokens: prompt + output tokens one request may take (None: as many as fit).

    Each is below 2**61 (`UNLIMITED` and under: what the compiled scan's int64 arrays hold with room for sums).
    """

    kv_capacity_tokens: int = attrs.field(validator=int_at_least(0, below=_LIMIT_BOUND))
    max_batch_size: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(int_at_least(1, below=_LIMIT_BOUND))
    )
    max_context_tokens: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(int_at_least(1, below=_LIMIT_BOUND))
    )


@attrs.frozen
class DecodeLoad:
    """A decode batch, now or as predicted (predictions may be fractional).

    Attributes:
        batch_size: requests in it.
        context_tokens: the KV tokens a step reads.
        kv_tokens: the KV tokens its members hold or have been promised (prompt + output each).
    """

    batch_size: float
    context_tokens: float
    kv_tokens: float = 0.0

    def rounded(self) -> DecodeLoad:
        """The load in whole requests and tokens, as the rule checks it: a prediction's fractions rounded to
        the nearest (half to even, Python's `round`), by `check_join` and the decode selection's scan alike."""
        return DecodeLoad(round(self.batch_size), round(self.context_tokens), round(self.kv_tokens))


@attrs.frozen(kw_only=True)
class JoinVerdict:
    """Whether a request may join a decode batch; `reason` names the first check it failed.

    `predicted_tbt_s` is the step time with the request added (when a step model was given).
    """

    accepted: bool
    reason: Reason | None = None
    predicted_tbt_s: float | None = None


# A load below what an unset limit stands for (`UNLIMITED`): with the request added it never passes a limit
# that was not set (and the compiled scan's int64 arrays hold it with room for sums).
MAX_LOAD = UNLIMITED


def _is_count(value: object) -> bool:
    # The exact-type test first: the Conductor asks this per decode instance per predictive decision, and
    # isinstance against an ABC is slow. NaN fails the comparison.
    real = type(value) in (int, float) or (isinstance(value, numbers.Real) and not isinstance(value, bool))
    return real and 0 <= value < MAX_LOAD  # type: ignore[operator]


def load_problem(load: object) -> str | None:
    """What is wrong with `load` as the rule takes it (None: nothing): it must be a `DecodeLoad` whose batch
    size and token counts are numbers in [0, 2**61 - 1) (fractions allowed: predictions are expectations)."""
    if not isinstance(load, DecodeLoad):
        return f"a load must be a DecodeLoad, got {shown(load)}"
    for name in ("batch_size", "context_tokens", "kv_tokens"):
        value = getattr(load, name)
        if not _is_count(value):
            return f"a load's {name} must be a number in [0, 2**61 - 1), got {shown(value)}"
    return None


# `refusal`'s codes: the reason each names (0: none).
REFUSALS: tuple[Reason | None, ...] = (None, Reason.CONTEXT_TOO_LONG, Reason.BATCH_FULL, Reason.KV_BUDGET)


def refusal(
    prompt_tokens: int,
    output_tokens: int,
    batch_size: float,
    kv_tokens: float,
    max_batch_size: int,
    kv_capacity_tokens: int,
    max_context_tokens: int,
) -> int:
    """The structural checks (all but TBT), in order: 0 if the request fits, else the code in
    `REFUSALS` of the first that fails. Written in the subset numba compiles: `sched._kernels`
    compiles this one definition for the decode selection's scan over many instances."""
    need = prompt_tokens + output_tokens
    if need > max_context_tokens:
        return 1
    if output_tokens <= 1:  # not `takes_slot`: it finishes at its first token, no slot, no KV kept
        return 0
    if need > kv_capacity_tokens:  # more than the instance holds empty: a context too long for it, not a wait
        return 1
    if batch_size + 1 > max_batch_size:
        return 2
    if kv_tokens + need > kv_capacity_tokens:
        return 3
    return 0


def check_tokens(prompt_tokens: int, output_tokens: int) -> None:
    """A request's token counts as the rule takes them.

    Raises:
        InvalidRequestError: a count that is not an integer in [1, MAX_TOKENS] (the compiled scan takes int64).
    """
    check_token_count("prompt_tokens", prompt_tokens)
    check_token_count("output_tokens", output_tokens)


def check_join(
    limits: DecodeLimits,
    load: DecodeLoad,
    *,
    prompt_tokens: int,
    output_tokens: int,
    step_model: StepModel | None = None,
    tbt_slo_s: float | None = None,
) -> JoinVerdict:
    """The decode rule for one request and one instance (see the module docstring).

    Args:
        limits: the instance's.
        load: its batch as the caller sees it (now, or predicted for the request's arrival).
        prompt_tokens, output_tokens: the request's (output includes the prefill's first token).
        step_model, tbt_slo_s: the TBT check needs both; without them it is skipped.

    Raises:
        InvalidRequestError: a token count that is not an integer in [1, MAX_TOKENS], a `load` that
            `load_problem` finds wrong (a negative or NaN count, say), or a `tbt_slo_s` that is neither None nor
            a number (`check_tbt_slo`: a NaN would pass every step).
        ConfigError: `limits` that are no `DecodeLimits`, or a step model with no `step_s` method or that predicts
            no number for the step (None, text, NaN).
    """
    check_tokens(prompt_tokens, output_tokens)
    if not isinstance(limits, DecodeLimits):
        raise ConfigError(f"decode limits must be DecodeLimits, got {shown(limits)}")
    problem = load_problem(load)
    if problem is not None:
        raise InvalidRequestError(problem)
    if tbt_slo_s is not None:
        check_tbt_slo(tbt_slo_s)
    load = load.rounded()
    code = refusal(
        prompt_tokens,
        output_tokens,
        load.batch_size,
        load.kv_tokens,
        _limit(limits.max_batch_size),
        limits.kv_capacity_tokens,
        _limit(limits.max_context_tokens),
    )
    if code:
        return JoinVerdict(accepted=False, reason=REFUSALS[code])
    if step_model is None:
        return JoinVerdict(accepted=True)
    step_s = getattr(step_model, "step_s", None)
    if not callable(step_s):
        raise ConfigError(f"step model must have a step_s(batch_size, context_tokens) method, got {shown(step_model)}")
    predicted = step_s(int(load.batch_size) + 1, int(load.context_tokens) + prompt_tokens)
    # The common case, a float that is no NaN, in one test. A NaN fails every comparison, so the TBT check would
    # pass it; None or text fail it bare.
    if (type(predicted) is not float or predicted != predicted) and not _is_comparable(predicted):
        raise ConfigError(
            f"step model {shown(step_model)} predicted {'NaN' if predicted != predicted else shown(predicted)}"
            f" seconds for a step of {int(load.batch_size) + 1} requests holding"
            f" {int(load.context_tokens) + prompt_tokens} tokens: a step time is a number, not NaN"
        )
    return tbt_verdict(load.batch_size, output_tokens, predicted, tbt_slo_s)


def _is_comparable(value: object) -> bool:
    """Whether `value` is what the TBT check compares, an objective or a predicted step: a real number (no bool) a
    float holds, infinities included, that is no NaN (which would pass every comparison, silently)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return not math.isnan(value)
    except OverflowError:  # an int past a float's range
        return False


def check_tbt_slo(tbt_slo_s: float) -> None:
    """A TBT objective as the rule takes it: a number a float holds, infinities included (inf bounds nothing; a
    negative one, a budget already spent, refuses every step with a batch to slow).

    Raises:
        InvalidRequestError: anything else, naming tbt_slo_s (a NaN would pass every step, silently).
    """
    if type(tbt_slo_s) is float and tbt_slo_s == tbt_slo_s:  # the common case, a float that is no NaN: one test
        return
    if not _is_comparable(tbt_slo_s):
        raise InvalidRequestError(f"tbt_slo_s must be a number (not NaN), got {shown(tbt_slo_s)}")


def tbt_refused(batch_size: float, output_tokens: int, predicted_tbt_s: float, tbt_slo_s: float) -> bool:
    """The TBT check: refused when the step predicted with the request in the batch (`predicted_tbt_s`) exceeds
    the objective, unless the batch is empty or the request takes no slot. Written in the subset numba
    compiles: `sched._kernels` compiles this one definition for the decode selection's scan, which ranks the
    instances it does not refuse first."""
    return output_tokens > 1 and batch_size > 0 and predicted_tbt_s > tbt_slo_s  # output > 1: `takes_slot`


def tbt_verdict(batch_size: float, output_tokens: int, predicted_tbt_s: float, tbt_slo_s: float | None) -> JoinVerdict:
    """The last check of the rule, for a request the structural checks let in: `tbt_refused` (no objective:
    never)."""
    if tbt_slo_s is not None and tbt_refused(batch_size, output_tokens, predicted_tbt_s, tbt_slo_s):
        return JoinVerdict(accepted=False, reason=Reason.TBT_SLO, predicted_tbt_s=predicted_tbt_s)
    return JoinVerdict(accepted=True, predicted_tbt_s=predicted_tbt_s)
