"""Workloads: requests, Mooncake-format traces, synthetic generators and statistics."""

from mooncake.types import Request
from mooncake.workload.generator import (
    PRESETS,
    ArrivalProcess,
    LengthDistribution,
    WorkloadSpec,
    fixed_length_requests,
    generate_requests,
    preset,
)
from mooncake.workload.stats import TraceStats, trace_stats
from mooncake.workload.trace import TRACE_BLOCK_SIZE_TOKENS, iter_trace, load_trace, write_trace

__all__ = [
    "ArrivalProcess",
    "LengthDistribution",
    "PRESETS",
    "Request",
    "TRACE_BLOCK_SIZE_TOKENS",
    "TraceStats",
    "WorkloadSpec",
    "fixed_length_requests",
    "generate_requests",
    "iter_trace",
    "load_trace",
    "preset",
    "trace_stats",
    "write_trace",
]
