"""Admission: accept a scheduled request, or reject it (HTTP 429 upstream) with a reason.

- `baseline`: the prefill side's check only: the estimated TTFT is within its SLO
  and some decode instance has room for the request's KV. The decode instance's
  own TBT check happens when the request reaches it, after its prefill; a
  rejection there wastes that prefill.
- `early_rejection`: also checks, before any prefill, that the chosen decode
  instance's TBT with the request added to its *current* batch is within SLO.
- `predictive_early_rejection`: the same check against the batch *predicted*
  for when the request will reach decoding (now + estimated TTFT), so that
  load which will have drained by then does not cause rejections, and load
  that is about to arrive does.

Each policy says which decode load the Conductor must evaluate (`load_at`).
"""

from __future__ import annotations

import enum
from typing import Literal, Protocol

import attrs

from mooncake.sched.decode import DecodeChoice
from mooncake.sched.router import RouteDecision
from mooncake.types import Slo

__all__ = [
    "AdmissionDecision",
    "AdmissionPolicy",
    "BaselineAdmission",
    "EarlyRejection",
    "Rejection",
    "predictive_early_rejection",
]


class Rejection(enum.Enum):
    """Why a request was refused."""

    NO_PREFILL_INSTANCE = "no_prefill_instance"
    NO_DECODE_INSTANCE = "no_decode_instance"
    TTFT_SLO = "ttft_slo"
    TBT_SLO = "tbt_slo"
    INSTANCE_DOWN = "instance_down"
    DECODE_REJECTED = "decode_rejected"


@attrs.frozen
class AdmissionDecision:
    accepted: bool
    reason: Rejection | None = None


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


def _ttft_check(route: RouteDecision, slo: Slo) -> AdmissionDecision:
    if route.ttft_s > slo.ttft_s:
        return AdmissionDecision(False, Rejection.TTFT_SLO)
    return AdmissionDecision(True)


@attrs.frozen
class BaselineAdmission:
    name: str = "baseline"
    load_at: LoadAt = "now"

    def admit(self, route: RouteDecision, decode: DecodeChoice, slo: Slo) -> AdmissionDecision:
        return _ttft_check(route, slo)


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
        decision = _ttft_check(route, slo)
        if decision.accepted and decode.tbt_s > slo.tbt_s:
            return AdmissionDecision(False, Rejection.TBT_SLO)
        return decision


def predictive_early_rejection() -> EarlyRejection:
    """The predictive variant of `EarlyRejection`."""
    return EarlyRejection(predictive=True)
