"""Summary statistics of a workload, computed in one streaming pass.

`prefix_reuse_ratio` is the fraction of all block keys whose whole prefix chain
was already seen in an earlier request: per request, the leading keys present
in the set of keys of all earlier requests, summed, over all keys. It is the
prefix hit ratio of an infinite cache.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs

from mooncake._checks import require_iterable, shown
from mooncake.errors import InvalidRequestError
from mooncake.types import BlockKey, Request

__all__ = ["TraceStats", "trace_stats"]


@attrs.frozen(kw_only=True)
class TraceStats:
    """What a workload looks like (all zero for an empty one).

    Attributes:
        num_requests: requests in the workload.
        mean_input_length, mean_output_length: tokens per request.
        max_input_length: the longest prompt, in tokens.
        num_blocks, num_unique_blocks: block keys in all, and distinct ones.
        prefix_reuse_ratio: see the module docstring.
        duration_s: the span of the arrivals, latest minus earliest (in any order).
        mean_rate_per_s: arrivals per second over that span.
    """

    num_requests: int
    mean_input_length: float
    mean_output_length: float
    max_input_length: int
    num_blocks: int
    num_unique_blocks: int
    prefix_reuse_ratio: float
    duration_s: float
    mean_rate_per_s: float


def trace_stats(requests: Iterable[Request]) -> TraceStats:
    """Statistics of `requests` (consumed once, in order)."""
    seen: set[BlockKey] = set()
    count = total_input = total_output = max_input = num_blocks = reused = 0
    earliest, latest = math.inf, -math.inf
    for request in require_iterable("requests", requests, error=InvalidRequestError):
        if not isinstance(request, Request):
            raise InvalidRequestError(f"request {count}: expected a mooncake.types.Request, got {shown(request)}")
        earliest = min(earliest, request.arrival_s)
        latest = max(latest, request.arrival_s)
        count += 1
        total_input += request.input_length
        total_output += request.output_length
        max_input = max(max_input, request.input_length)
        keys = request.block_keys
        num_blocks += len(keys)
        hit = 0
        for key in keys:
            if key not in seen:
                break
            hit += 1
        reused += hit
        seen.update(keys)
    # To the nanosecond: arrivals are milliseconds / 1000, whose difference would print 42.74199999999996.
    duration = round(latest - earliest, 9) if count else 0.0
    return TraceStats(
        num_requests=count,
        mean_input_length=total_input / count if count else 0.0,
        mean_output_length=total_output / count if count else 0.0,
        max_input_length=max_input,
        num_blocks=num_blocks,
        num_unique_blocks=len(seen),
        prefix_reuse_ratio=reused / num_blocks if num_blocks else 0.0,
        duration_s=duration,
        mean_rate_per_s=(count - 1) / duration if duration > 0 else 0.0,
    )
