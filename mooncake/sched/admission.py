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
"""

from __future__ import annotations

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
    "predictive_early_rejection",
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
