"""mooncake: composable scheduling and caching primitives for KVCache-centric,
prefill/decode-disaggregated LLM serving, after the Mooncake paper.

The values every part shares are here (`Request`, `Slo`, `Tier`, the ids, the
errors); the parts are subpackages imported on demand (`mooncake.cache`,
`mooncake.sched`, `mooncake.sim`, `mooncake.transfer`, `mooncake.engine`,
`mooncake.workload`). docs/architecture.md is the map, docs/api.md the index.
"""

from __future__ import annotations

from mooncake.errors import (
    ConfigError,
    InvalidRequestError,
    MooncakeError,
    SequenceGapError,
    TraceFormatError,
    UnknownBlockError,
    UnknownInstanceError,
)
from mooncake.types import BlockKey, InstanceId, Request, RequestId, Slo, Tier

__all__ = [
    "BlockKey",
    "ConfigError",
    "InstanceId",
    "InvalidRequestError",
    "MooncakeError",
    "Request",
    "RequestId",
    "SequenceGapError",
    "Slo",
    "Tier",
    "TraceFormatError",
    "UnknownBlockError",
    "UnknownInstanceError",
    "__version__",
]

__version__ = "0.1.0"
