"""Admission: accept a scheduled request, or reject it (HTTP 429 upstream) with a reason.

Every policy first needs a decode instance that can take the request (the
decode rule's structural checks: context, batch slots, KV; otherwise the
reason names the bound) and an estimated TTFT within its SLO.

- `baseline`: nothing more. The decode instance's own TBT check happens when
  the request reaches it, after its prefill; a rejection there wastes that
  prefill.
- `early_rejection`: also the decode rule's TBT check, before any prefill,
  against the chosen instance's committed batch (decoding and reserved).
- `predictive_early_rejection`: the decode rule, structural checks and TBT,
  against the batch *predicted* for when the request will reach decoding
  (now + estimated TTFT), so that load which will have drained by then does
  not cause rejections, and load that is about to arrive does.

Each policy says which decode load the Conductor must evaluate (`load_at`).
"""

from __future__ import annotations

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
    "predictive_early_rejection",
]


@attrs.frozen
class AdmissionDecision:
    accepted: bool
    reason: Reason | None = None


LoadAt = Literal["now", "arrival"]


class AdmissionPolicy(Protocol):
    """Decides on a routed request."""

    @property
    def name(self) -> str: ...

    @property
    def load_at(self) -> LoadAt:
        """Which decode load the TBT check needs: "now" or "arrival" (predicted)."""

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
    name: str = "baseline"
    load_at: LoadAt = "now"

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
