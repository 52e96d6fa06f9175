"""Admission: accept a scheduled request, or reject it (HTTP 429 upstream) with a reason.

Every policy needs an estimated TTFT within its SLO and a decode instance the
decode rule (`sched.join`) lets the request into, against the load the policy
asks about (`load_at`); the refusal names the bound (context, batch slots, KV,
TBT). Every policy checks in one order, so that the reason does not depend on
what else is short: a refusal no wait lifts first (no decode instance up that
could hold the request, a context none holds: like a missing prefill
instance, it is the cluster's or the request's, whatever the load), then the
TTFT estimate (TTFT_SLO), then the decode side's room (`WAITS_FOR_ROOM`: a
batch, KV or TBT refusal). A request that misses its TTFT objective is
rejected as TTFT_SLO however full the decode side is, as the Conductor
rejects one whose wait used up what its TTFT objective left.

- `baseline`: asks about no decode load: only a request that could never fit
  an instance is refused. The decode instance checks for itself when the
  prefilled request reaches it; a refusal there wastes the prefill.
- `early_rejection`: the decode rule, TBT included, before any prefill,
  against what the chosen instance is committed to *now*: its decoding batch
  (with the tokens it has generated so far, estimated: `sched.decode`) and the
  requests already accepted for it and still in prefill, as if they all
  decoded together (no departure is foreseen).
- `predictive_early_rejection`: the same against the batch *predicted* for
  when the request will reach decoding (now + estimated TTFT): requests that
  will have finished by then no longer count, those whose prefill ends before
  then do.

A rejection for room the decode side frees as its own requests end (a full
batch, no KV room, the TBT objective: `WAITS_FOR_ROOM`) need not be final: a
caller may hold the request before any prefill and schedule it again when a
request ends, until `room_wait_deadline` (vLLM's scheduler queues such a
request; the paper's Conductor rejects it at once, a wait of 0). The line such
requests wait in is `sched.waiting.AdmissionQueue`, which the example cluster's
gateway and the simulator (`ClusterSpec.admission_wait_s`) both drive.
"""

from __future__ import annotations

import math
import typing
from typing import Literal, Protocol

import attrs

from mooncake._checks import require_number, shown
from mooncake.errors import InvalidRequestError
from mooncake.sched.decode import DecodeChoice
from mooncake.sched.outcome import Reason
from mooncake.sched.router import RouteDecision
from mooncake.types import Slo, require_slo

__all__ = [
    "AdmissionDecision",
    "AdmissionPolicy",
    "BaselineAdmission",
    "EarlyRejection",
    "LOAD_AT",
    "WAITS_FOR_ROOM",
    "predictive_early_rejection",
    "room_wait_deadline",
]


@attrs.frozen
class AdmissionDecision:
    """Admit, or reject with the `reason`."""

    accepted: bool
    reason: Reason | None = None


LoadAt = Literal["none", "now", "arrival"]
LOAD_AT: tuple[LoadAt, ...] = typing.get_args(LoadAt)

WAITS_FOR_ROOM = frozenset({Reason.BATCH_FULL, Reason.KV_BUDGET, Reason.TBT_SLO})
"""The rejections that the decode side's requests ending can lift: batch slots, KV room, a step within the TBT
objective. The others cannot (no instance up, a context no instance holds) or grow worse with waiting (TTFT)."""


class AdmissionPolicy(Protocol):
    """Decides on a routed request."""

    @property
    def name(self) -> str: ...

    @property
    def load_at(self) -> LoadAt:
        """Which decode load the decode rule is checked on: "none", "now" or "arrival" (predicted)."""

    def admit(self, route: RouteDecision, decode: DecodeChoice, slo: Slo) -> AdmissionDecision:
        """Accept or reject, given the routes chosen and the SLOs."""


def _ttft_and_room(route: RouteDecision, decode: DecodeChoice, slo: Slo) -> AdmissionDecision:
    """The checks every policy makes, in the module's order: a refusal no wait lifts, then TTFT, then room."""
    room = None  # the decode selection's refusal, where a wait could lift it
    if decode.decode_instance is None:
        reason = decode.verdict.reason or Reason.NO_DECODE_INSTANCE
        if reason not in WAITS_FOR_ROOM:
            return AdmissionDecision(False, reason)
        room = reason
    if route.ttft_s > slo.ttft_s:
        return AdmissionDecision(False, Reason.TTFT_SLO)
    if room is not None:
        return AdmissionDecision(False, room)
    return AdmissionDecision(True)


@attrs.frozen
class BaselineAdmission:
    """Admit when the decode selection found an instance and the TTFT estimate meets its SLO; no decode load is checked."""

    name: str = "baseline"
    load_at: LoadAt = "none"

    def admit(self, route: RouteDecision, decode: DecodeChoice, slo: Slo) -> AdmissionDecision:
        return _ttft_and_room(route, decode, slo)


@attrs.frozen
class EarlyRejection:
    """Early rejection; with `predictive`, against the decode load predicted at arrival."""

    predictive: bool = False

    @property
    def name(self) -> str:
        return "predictive_early_rejection" if self.predictive else "early_rejection"

    @property
    def load_at(self) -> LoadAt:
        return "arrival" if self.predictive else "now"

    def admit(self, route: RouteDecision, decode: DecodeChoice, slo: Slo) -> AdmissionDecision:
        decision = _ttft_and_room(route, decode, slo)
        if decision.accepted and not decode.verdict.accepted:
            return AdmissionDecision(False, decode.verdict.reason)
        return decision


def predictive_early_rejection() -> EarlyRejection:
    """The predictive variant of `EarlyRejection`."""
    return EarlyRejection(predictive=True)


def room_wait_deadline(
    reason: Reason, *, estimated_ttft_s: float | None, arrival_s: float, slo: Slo, max_wait_s: float
) -> float:
    """Until when a request rejected for `reason` may wait for room and be scheduled again (-inf: not at all).

    Only a rejection in `WAITS_FOR_ROOM` waits, and only while the request could still meet its TTFT objective
    with the time waited counted (`arrival_s` + the objective - the TTFT the rejection estimated), and at most
    `max_wait_s` after its arrival (0: never, the paper's early rejection). The request is never prefilled
    while it waits, so a wait that ends in a rejection wastes nothing.

    Raises:
        InvalidRequestError: a `reason` that is no `Reason` (a string would never wait), an `estimated_ttft_s` that
            is neither None nor a finite number >= 0, or an `arrival_s` that is not a finite number (checked
            whatever the reason).
        ConfigError: an `slo` that is no `Slo`, or a `max_wait_s` that is not a finite number >= 0 (a bool is none).
    """
    if not isinstance(reason, Reason):
        raise InvalidRequestError(f"reason must be a mooncake.sched.Reason, got {shown(reason)}")
    require_slo(slo)
    if estimated_ttft_s is not None:
        require_number("estimated_ttft_s", estimated_ttft_s, minimum=0.0, error=InvalidRequestError)
    require_number("arrival_s", arrival_s, minimum=-math.inf, error=InvalidRequestError)
    require_number("max_wait_s", max_wait_s, minimum=0.0)
    if reason not in WAITS_FOR_ROOM or estimated_ttft_s is None or not max_wait_s > 0:
        return -math.inf
    return min(arrival_s + max_wait_s, arrival_s + slo.ttft_s - estimated_ttft_s)
