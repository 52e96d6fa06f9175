"""How a request ends, and why: the one vocabulary of the Conductor, the engines, the simulator and the gateway.

An `Outcome` says how a request left the system; a `Reason` says why one did
not complete. Rejections come from three places, all named here: the
Conductor before any prefill (no instance, the TTFT objective, or the decode
rule applied to the load it knows or predicts), and the decode instance's own
check when the prefilled request reaches it (the same rule, `sched.join`:
context too long, batch full, KV budget, TBT objective), after which the
prefill was wasted. A request can also be aborted by a failure or its client.

`RequestEnd` is what the Conductor reports when a request ends; every request
ends exactly once. `reason_named` reads a reason another process sent by its
value; `http_status` is what a gateway answers a rejection with.
"""

from __future__ import annotations

import enum

import attrs

from mooncake._checks import shown
from mooncake.errors import InvalidRequestError
from mooncake.types import RequestId, check_request_id

__all__ = [
    "ABORT_REASONS",
    "DECODE_REFUSALS",
    "Outcome",
    "Reason",
    "RequestEnd",
    "http_status",
    "reason_named",
    "refusal_named",
]


class Outcome(enum.Enum):
    """How a request left the system."""

    COMPLETED = "completed"
    REJECTED_BEFORE_PREFILL = "rejected_before_prefill"
    REJECTED_AFTER_PREFILL = "rejected_after_prefill"  # its prefill ran for nothing
    ABORTED = "aborted"  # a failure or its client ended it, not a scheduling decision


class Reason(enum.Enum):
    """Why a request did not complete."""

    # The Conductor's, before any prefill.
    NO_PREFILL_INSTANCE = "no_prefill_instance"
    NO_DECODE_INSTANCE = "no_decode_instance"
    TTFT_SLO = "ttft_slo"
    # The decode rule's (`sched.join.check_join`): predicted before prefill, or checked by the decode instance.
    CONTEXT_TOO_LONG = "context_too_long"
    BATCH_FULL = "batch_full"
    KV_BUDGET = "kv_budget"
    TBT_SLO = "tbt_slo"
    DECODE_REJECTED = "decode_rejected"  # a decode instance refused without saying why
    # Aborts.
    INSTANCE_DOWN = "instance_down"
    CLIENT_GONE = "client_gone"
    TIMEOUT = "timeout"
    FAILED = "failed"


DECODE_REFUSALS = frozenset(
    {Reason.CONTEXT_TOO_LONG, Reason.BATCH_FULL, Reason.KV_BUDGET, Reason.TBT_SLO, Reason.DECODE_REJECTED}
)
"""Why a decode instance refuses a prefilled request (`sched.view.RequestRejected`): the decode rule's reasons, or
none said."""

ABORT_REASONS = frozenset({Reason.INSTANCE_DOWN, Reason.CLIENT_GONE, Reason.TIMEOUT, Reason.FAILED})
"""Why a request is aborted (`sched.view.RequestAborted`): a failure or its client, never a scheduling decision."""


@attrs.frozen
class RequestEnd:
    """A request left the system: how, and why when it did not complete.

    Raises:
        InvalidRequestError: a request id that is none (`types.check_request_id`), an `outcome` that is no
            `Outcome` or a `reason` that is neither None nor a `Reason` (their values as text included: a string
            reason would reach every reader of the end as it is), or a reason given a completed request, or none
            given any other.
    """

    request_id: RequestId
    outcome: Outcome
    reason: Reason | None = None

    def __attrs_post_init__(self) -> None:
        check_request_id("request_id", self.request_id)
        if not isinstance(self.outcome, Outcome):
            raise InvalidRequestError(f"outcome must be a mooncake.sched.Outcome, got {shown(self.outcome)}")
        if self.reason is not None and not isinstance(self.reason, Reason):
            raise InvalidRequestError(f"reason must be None or a mooncake.sched.Reason, got {shown(self.reason)}")
        if (self.outcome is Outcome.COMPLETED) != (self.reason is None):
            raise InvalidRequestError(
                f"a {self.outcome.value} request has reason {self.reason}: every outcome but completed has one"
            )


def reason_named(value: object) -> Reason:
    """The `Reason` whose value is `value` (as a worker's refusal or a gateway's error code carries it); one
    this version does not know (a peer of another version) is DECODE_REJECTED: a refusal without a known why."""
    try:
        return Reason(value)
    except ValueError:
        return Reason.DECODE_REJECTED


def refusal_named(value: object) -> Reason:
    """`reason_named` for a decode instance's refusal (as its worker sends it): one naming no reason of
    `DECODE_REFUSALS` (a peer of another version) is DECODE_REJECTED, a refusal without a known why, so that the
    request still ends as one (`sched.view.RequestRejected` takes no other)."""
    reason = reason_named(value)
    return reason if reason in DECODE_REFUSALS else Reason.DECODE_REJECTED


_UNAVAILABLE = frozenset({Reason.NO_PREFILL_INSTANCE, Reason.NO_DECODE_INSTANCE})


def http_status(reason: Reason | str) -> int:
    """The HTTP status a gateway answers a rejection for `reason` with: 503 when no instance of a role is up
    (the service is unavailable), 400 when the request cannot fit any instance however idle (its prompt and
    max_tokens exceed the context or an empty instance's KV: vLLM's own answer), 429 for the rest (at capacity
    now: retry later). A reason's value, as a peer sends it, is read by `reason_named` (one not known here: a
    429), so a reason and its wire name answer alike.

    Raises:
        InvalidRequestError: `reason` that is neither a `Reason` nor a string (None, a number: answering those 429
            would hide the caller's mistake).
    """
    if not isinstance(reason, Reason):
        if not isinstance(reason, str):
            raise InvalidRequestError(f"reason must be a mooncake.sched.Reason or its value, got {shown(reason)}")
        reason = reason_named(reason)
    if reason in _UNAVAILABLE:
        return 503
    if reason is Reason.CONTEXT_TOO_LONG:
        return 400
    return 429
