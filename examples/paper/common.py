"""What the paper's experiments share: the replay, the table header, the outcome columns, the load swing, and
what keeps a run from transferring.

Every table that reports TTFT or TBT also reports what happened to all
arrivals (`OUTCOME_COLUMNS`): completed, rejected before and after prefill,
the prefill time wasted on the latter, SLO attainment over all arrivals and
goodput, so that a policy that rejects more never looks faster for it.

The predictive policy's predictor is `--predictor`'s (`serving.registry.PREDICTORS`): by default the
paper's uniform decode time t_d, the workload's mean output times the TBT objective (how long an
average request decodes when its batch runs at the SLO, the slowest an accepted request is meant to
go); `expected_output` keeps each request for its own output at that pace.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import simulation
from serving import registry

from mooncake.sched.conductor import Conductor
from mooncake.sim.disaggregated import DisaggregatedCluster
from mooncake.sim.metrics import LoadSample, ReplayResult, Summary
from mooncake.sim.spec import ClusterSpec, build_conductor
from mooncake.types import Request, Slo

__all__ = [
    "OUTCOME_COLUMNS",
    "Report",
    "header",
    "oscillation",
    "outcome_cells",
    "outcomes_json",
    "policy_conductor",
    "replay",
    "what_stops_transfers",
]

Report = dict[str, Any]

OUTCOME_COLUMNS = f"{'completed':>10}{'rej. before':>12}{'after':>7}{'wasted s':>10}{'SLO att.':>9}{'goodput':>9}"


def what_stops_transfers(*, router: str, threshold: float, global_pool: bool) -> tuple[str, str] | None:
    """The option (with its value) that keeps every replay from transferring a block, and why; None if none does.
    An experiment that varies what only a transfer makes matter (the global pool, the threshold) refuses it:
    its replays would all be alike."""
    if not global_pool:
        return "--local-cache", "without a global pool nothing is transferred"
    if router in registry.NO_TRANSFER_ROUTERS:
        return f"--router {router}", "it never plans a transfer"
    if router in registry.THRESHOLD_ROUTERS and math.isinf(threshold):
        return "--threshold inf", f"{router} then never plans a transfer"
    return None


def policy_conductor(
    spec: ClusterSpec, requests: Sequence[Request], args: argparse.Namespace, slo: Slo, **policy: Any
) -> Conductor:
    """A fresh Conductor for `spec` with the options' policies (router, threshold, admission, predictor),
    `policy` overriding the first three by name."""
    names = {"router": args.router, "admission": args.admission, "threshold": args.threshold, **policy}
    return build_conductor(
        spec,
        router=registry.router(names["router"], threshold=names["threshold"]),
        admission=registry.admission(names["admission"]),
        slo=slo,
        seed=args.seed,
        predictor=registry.predictor(args.predictor, requests, slo),
    )


def replay(
    spec: ClusterSpec, requests: Sequence[Request], args: argparse.Namespace, *, slo: Slo | None = None, **policy: Any
) -> ReplayResult:
    """Replay on a fresh cluster with the options' policies, `policy` overriding them (a progress bar names them)."""
    slo = slo or simulation.slo(args)
    label = ", ".join(f"{key} {value}" for key, value in policy.items()) or "replay"
    return DisaggregatedCluster(spec, policy_conductor(spec, requests, args, slo, **policy)).run(
        requests, progress=simulation.progress(args, len(requests), label)
    )


def header(
    args: argparse.Namespace, requests: Sequence[Request], spec: ClusterSpec, *, cluster: str | None = None
) -> str:
    """The workload, the cluster (`cluster`, where the experiment sweeps what `simulation.describe` says) and SLOs."""
    slo = simulation.slo(args)
    return (
        f"workload: {simulation.workload_name(args)}, {len(requests):,} requests\n"
        f"cluster: {cluster or simulation.describe(spec)}; SLOs: TTFT {slo.ttft_s:g} s, TBT {slo.tbt_s * 1000:g} ms"
    )


def outcome_cells(summary: Summary) -> str:
    """The `OUTCOME_COLUMNS` of one replay."""
    s = summary
    return (
        f"{s.completed:>10,}{s.rejected_before_prefill:>12,}{s.rejected_after_prefill:>7,}"
        f"{s.wasted_prefill_s:>10.1f}{s.slo_attainment:>9.3f}{s.goodput_rps:>9.3f}"
    )


def outcomes_json(results: Mapping[str, ReplayResult]) -> Report:
    """Per key: completed, rejected (in all, before and after prefill), wasted prefill, SLO attainment, goodput."""
    summaries = {key: result.summary for key, result in results.items()}
    return {
        "completed": {k: s.completed for k, s in summaries.items()},
        "rejected": {k: s.rejected for k, s in summaries.items()},
        "rejected_before_prefill": {k: s.rejected_before_prefill for k, s in summaries.items()},
        "rejected_after_prefill": {k: s.rejected_after_prefill for k, s in summaries.items()},
        "wasted_prefill_s": {k: s.wasted_prefill_s for k, s in summaries.items()},
        "slo_attainment": {k: s.slo_attainment for k, s in summaries.items()},
        "goodput_rps": {k: s.goodput_rps for k, s in summaries.items()},
    }


def oscillation(load: Sequence[LoadSample], start_s: float, end_s: float) -> float:
    """Peak-to-trough of the decode load while requests arrive: its 95th minus 5th percentile."""
    values = [s.decode_requests for s in load if start_s <= s.time_s <= end_s]
    if not values:
        return 0.0
    high, low = np.percentile(values, [95, 5])
    return float(high - low)
