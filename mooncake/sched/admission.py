"""Admission: accept a scheduled request, or reject it (HTTP 429 upstream) with a reason.

Every policy needs an estimated TTFT within its SLO and a decode instance the
decode rule (`sched.join`) lets the request into, against the load the policy
asks about (`load_at`); the refusal names the bound (context, batch slots, KV,
TBT).

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

from mooncake.sched.decode import DecodeChoice
from mooncake.sched.outcome import Reason
from mooncake.sched.router import RouteDecision
from mooncake.types import Slo

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


class AdmissionPolicy(Protocol):
    """Decides on a routed request."""

    @property
    def name(self) -> str: ...

    @property
    def load_at(self) -> LoadAt:
        """Which decode load the decode rule is checked on: "none", "now" or "arrival" (predicted)."""

    def admit(self, route: RouteDecision, decode: DecodeChoice, slo: Slo) -> AdmissionDecision:
        """Accept or reject, given the routes chosen and the SLOs."""


def _room_and_ttft(route: RouteDecision, decode: DecodeChoice, slo: Slo) -> AdmissionDecision:
    if decode.decode_instance is None:
        return AdmissionDecision(False, decode.verdict.reason or Reason.NO_DECODE_INSTANCE)
    if route.ttft_s > slo.ttft_s:
        return AdmissionDecision(False, Reason.TTFT_SLO)
    return AdmissionDecision(True)


@attrs.frozen
class BaselineAdmission:
    """Admit when the decode selection found an instance and the TTFT estimate meets its SLO; no decode load is checked."""

    name: str = "baseline"
    load_at: LoadAt = "none"

    def admit(self, route: RouteDecision, decode: DecodeChoice, slo: Slo) -> AdmissionDecision:
        return _room_and_ttft(route, decode, slo)


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
        decision = _room_and_ttft(route, decode, slo)
        if decision.accepted and not decode.verdict.accepted:
            return AdmissionDecision(False, decode.verdict.reason)
        return decision


def predictive_early_rejection() -> EarlyRejection:
    """The predictive variant of `EarlyRejection`."""
    return EarlyRejection(predictive=True)


WAITS_FOR_ROOM = frozenset({Reason.BATCH_FULL, Reason.KV_BUDGET, Reason.TBT_SLO})
"""The rejections that the decode side's requests ending can lift: batch slots, KV room, a step within the TBT
objective. The others cannot (no instance up, a context no instance holds) or grow worse with waiting (TTFT)."""


def room_wait_deadline(
    reason: Reason, *, estimated_ttft_s: float | None, arrival_s: float, slo: Slo, max_wait_s: float
) -> float:
    """Until when a request rejected for `reason` may wait for room and be scheduled again (-inf: not at all).

    Only a rejection in `WAITS_FOR_ROOM` waits, and only while the request could still meet its TTFT objective
    with the time waited counted (`arrival_s` + the objective - the TTFT the rejection estimated), and at most
    `max_wait_s` after its arrival (0: never, the paper's early rejection). The request is never prefilled
    while it waits, so a wait that ends in a rejection wastes nothing.
    """
    if reason not in WAITS_FOR_ROOM or estimated_ttft_s is None or not max_wait_s > 0:
        return -math.inf
    return min(arrival_s + max_wait_s, arrival_s + slo.ttft_s - estimated_ttft_s)
