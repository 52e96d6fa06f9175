"""Scheduling: the Conductor and its parts, as pure logic (no I/O, no threads, no clock reads).

Time comes in as `now`, randomness from seeded generators. Build a Conductor
with `build_conductor` (documented defaults) or from its parts; everything a
server needs is exported here.
"""

from __future__ import annotations

from mooncake.sched.admission import (
    AdmissionDecision,
    AdmissionPolicy,
    BaselineAdmission,
    EarlyRejection,
    predictive_early_rejection,
)
from mooncake.sched.build import RouterFactory, build_conductor, ttft_estimator
from mooncake.sched.conductor import Conductor, ScheduleDecision
from mooncake.sched.cost import (
    HARDWARE,
    MODELS,
    ChunkedPipelineCost,
    FittedPrefillModel,
    Hardware,
    ModelShape,
    PrefillCostModel,
    PrefillModel,
    PrefillSample,
    TransferCostModel,
)
from mooncake.sched.decode import DecodeChoice, choose_decode
from mooncake.sched.join import DecodeLimits, DecodeLoad, JoinVerdict, check_join
from mooncake.sched.outcome import Outcome, Reason, RequestEnd, http_status, reason_named
from mooncake.sched.predictor import (
    LoadPredictor,
    LoadSnapshot,
    OutputLengthPredictor,
    PredictorScore,
    UniformDecodePredictor,
    score_predictor,
)
from mooncake.sched.router import (
    AdaptiveThreshold,
    KvCacheCentricRouter,
    LoadBalancingRouter,
    RandomRouter,
    RoundRobinRouter,
    RouteDecision,
    RouteQuery,
    Router,
    TransferPlan,
    TtftEstimator,
    local_cache_aware_router,
)
from mooncake.sched.step import AnalyticStepModel, DecodeCostModel, FittedStepModel, RooflineStep, StepBranch, StepModel
from mooncake.sched.view import (
    DecodeFinished,
    DecodeJoined,
    DecodeView,
    InstanceDown,
    InstanceUp,
    PrefillBacklog,
    PrefilledInline,
    PrefillFinished,
    PrefillStarted,
    PrefillView,
    RequestAborted,
    RequestRejected,
    SchedulerEvent,
)

__all__ = [
    "AdaptiveThreshold",
    "AdmissionDecision",
    "AdmissionPolicy",
    "AnalyticStepModel",
    "BaselineAdmission",
    "ChunkedPipelineCost",
    "Conductor",
    "DecodeChoice",
    "DecodeCostModel",
    "DecodeFinished",
    "DecodeJoined",
    "DecodeLimits",
    "DecodeLoad",
    "DecodeView",
    "EarlyRejection",
    "FittedPrefillModel",
    "FittedStepModel",
    "HARDWARE",
    "Hardware",
    "InstanceDown",
    "InstanceUp",
    "JoinVerdict",
    "KvCacheCentricRouter",
    "LoadBalancingRouter",
    "LoadPredictor",
    "LoadSnapshot",
    "MODELS",
    "ModelShape",
    "Outcome",
    "OutputLengthPredictor",
    "PredictorScore",
    "PrefillBacklog",
    "PrefillCostModel",
    "PrefillFinished",
    "PrefillModel",
    "PrefillSample",
    "PrefillStarted",
    "PrefillView",
    "PrefilledInline",
    "RandomRouter",
    "Reason",
    "RequestAborted",
    "RequestEnd",
    "RequestRejected",
    "RooflineStep",
    "RoundRobinRouter",
    "RouteDecision",
    "RouteQuery",
    "Router",
    "RouterFactory",
    "ScheduleDecision",
    "SchedulerEvent",
    "StepBranch",
    "StepModel",
    "TransferCostModel",
    "TransferPlan",
    "TtftEstimator",
    "UniformDecodePredictor",
    "build_conductor",
    "check_join",
    "choose_decode",
    "http_status",
    "local_cache_aware_router",
    "predictive_early_rejection",
    "reason_named",
    "score_predictor",
    "ttft_estimator",
]
