"""The simulator: a disaggregated cluster and a coupled baseline on a virtual clock (no torch).

`replay(spec, requests)` runs a workload through a `ClusterSpec` with the
library's defaults; `DisaggregatedCluster` and `CoupledCluster` take a
Conductor or a spec of your own.
"""

from __future__ import annotations

from mooncake.sim.coupled import CoupledCluster, CoupledSpec
from mooncake.sim.disaggregated import DisaggregatedCluster, replay
from mooncake.sim.metrics import LoadSample, RecordTable, ReplayResult, RequestRecord, Summary, summarize
from mooncake.sim.replayer import ReplayContext
from mooncake.sim.spec import DEFAULT_CACHE_BLOCKS, ClusterSpec, build_conductor

__all__ = [
    "ClusterSpec",
    "CoupledCluster",
    "CoupledSpec",
    "DEFAULT_CACHE_BLOCKS",
    "DisaggregatedCluster",
    "LoadSample",
    "RecordTable",
    "ReplayContext",
    "ReplayResult",
    "RequestRecord",
    "Summary",
    "build_conductor",
    "replay",
    "summarize",
]
