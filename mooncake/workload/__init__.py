"""Workloads: requests, Mooncake-format traces (aiperf's form and gzip too), synthetic generators and statistics."""

from mooncake.types import Request
from mooncake.workload.generator import (
    ARRIVAL_RANGE,
    DEFAULT_WORKLOAD,
    PRESETS,
    ArrivalProcess,
    DefaultWorkload,
    LengthDistribution,
    WorkloadSpec,
    fixed_length_requests,
    generate_requests,
    preset,
)
from mooncake.workload.stats import TraceStats, trace_stats
from mooncake.workload.trace import (
    TIME_UNITS,
    TRACE_BLOCK_SIZE_TOKENS,
    TRACE_FORMS,
    SkippedLine,
    TimeUnit,
    TraceForm,
    iter_trace,
    load_trace,
    text_request,
    write_trace,
)

__all__ = [
    "ARRIVAL_RANGE",
    "ArrivalProcess",
    "DEFAULT_WORKLOAD",
    "DefaultWorkload",
    "LengthDistribution",
    "PRESETS",
    "Request",
    "SkippedLine",
    "TIME_UNITS",
    "TRACE_BLOCK_SIZE_TOKENS",
    "TRACE_FORMS",
    "TimeUnit",
    "TraceForm",
    "TraceStats",
    "WorkloadSpec",
    "fixed_length_requests",
    "generate_requests",
    "iter_trace",
    "load_trace",
    "preset",
    "text_request",
    "trace_stats",
    "write_trace",
]
