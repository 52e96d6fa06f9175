"""Admission under overload: rejections, wasted prefill and the prefill/decode load swing per policy.

The paper's claim (arXiv §6, Table 3, Figs. 9-10) is about a cluster whose
decode side binds under overload, so both experiments default to one: the
prefill pool sized by its demand as everywhere (`simulation.paper_sized`), the
decode pool by its own (`simulation.decode_sized`), both at the workload's own
pace (`simulation.sized_cluster`), and a TBT objective of 25 ms. For LLaMA3-70B
on 8×A800 a decode step takes 16 ms at batch 1 and ~50 ms with the HBM full of
KV, so a 100 ms objective never binds and only the HBM would stop a decode
node; at 25 ms a node of the synthetic trace's requests (15 k tokens in, 150
out) holds about 24 of them, and the TBT check decides.
Any workload, cluster or SLO can be given instead (`--trace`, `--prefill`,
`--decode`, `--tbt-slo`).

`rejection` replays the workload at `--speedup` (2×) under each admission
policy; `overload` sweeps the speed-up. Each reports the outcomes of all
arrivals, the prefill wasted on requests the decode side refused after it,
and the swing of the decode load while requests arrive (its 95th minus 5th
percentile); `rejection` plots both loads over time per policy.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import simulation
from serving.registry import ADMISSIONS

from mooncake.sim.metrics import ReplayResult
from mooncake.sim.report import plot_lines, plot_load
from mooncake.types import Request
from paper.common import OUTCOME_COLUMNS, Report, header, oscillation, outcome_cells, outcomes_json, replay

__all__ = ["overload", "rejection"]

DECODE_BOUND_TBT_SLO_S = 0.025


def _span(requests: Sequence[Request]) -> tuple[float, float]:
    return (requests[0].arrival_s, requests[-1].arrival_s) if requests else (0.0, 0.0)


def rejection(args: argparse.Namespace) -> tuple[Report, str]:
    """Rejections and wasted prefill per admission policy at --speedup (arXiv Table 3, Fig. 9)."""
    requests, spec = simulation.sized_cluster(args, decode_bound=True)  # sized at speed 1, run at --speedup
    results = {policy: replay(spec, requests, args, admission=policy) for policy in ADMISSIONS}
    span = _span(requests)
    lines = [header(args, requests, spec), f"speed-up {args.speedup}, router {args.router}", ""]
    lines.append(f"{'admission':<28}{'mean TTFT':>10}{'osc.':>6}{OUTCOME_COLUMNS}")
    for policy, result in results.items():
        s = result.summary
        lines.append(f"{policy:<28}{s.ttft_s['mean']:>10.2f}{oscillation(result.load, *span):>6.1f}{outcome_cells(s)}")
    if args.out:
        plot_load(
            {p: r.load for p, r in results.items()}, args.out / "rejection_load.png", title=f"speed-up {args.speedup}"
        )
    report: Report = {
        **outcomes_json(results),
        "oscillation": {p: oscillation(r.load, *span) for p, r in results.items()},
        "num_requests": len(requests),
        "cluster": simulation.describe(spec),
    }
    return report, "\n".join(lines)


def overload(args: argparse.Namespace) -> tuple[Report, str]:
    """Rejections, wasted prefill and decode-load swing per admission policy as the workload speeds up."""
    base, spec = simulation.sized_cluster(args, decode_bound=True)  # --speedup is refused: 1, its own pace
    speedups = args.speedups or [1.2, 2.0, 3.0, 4.0, 5.0]
    # Every speed-up's workload before any replay, each of the one read (its skipped lines named once).
    workloads = {speedup: simulation.sped_up(args, base, speedup, option="--speedups") for speedup in speedups}
    runs: dict[str, dict[str, ReplayResult]] = {p: {} for p in ADMISSIONS}
    swing: dict[str, dict[str, float]] = {p: {} for p in ADMISSIONS}
    for speedup, requests in workloads.items():
        for policy in ADMISSIONS:
            result = replay(spec, requests, args, admission=policy)
            runs[policy][str(speedup)] = result
            swing[policy][str(speedup)] = oscillation(result.load, *_span(requests))
    lines = [header(args, base, spec), ""]
    lines.append(f"{'speed-up':>8}  {'admission':<28}{'rejected':>9}{'osc.':>6}{OUTCOME_COLUMNS}")
    for v in speedups:
        for policy in ADMISSIONS:
            s = runs[policy][str(v)].summary
            lines.append(f"{f'x{v}':>8}  {policy:<28}{s.rejected:>9,}{swing[policy][str(v)]:>6.1f}{outcome_cells(s)}")
    per_speedup = {policy: outcomes_json(runs[policy]) for policy in ADMISSIONS}
    if args.out:
        for key, label in (("rejected", "rejected requests"), ("wasted_prefill_s", "wasted prefill (s)")):
            plot_lines(
                {p: (speedups, [per_speedup[p][key][str(v)] for v in speedups]) for p in ADMISSIONS},
                args.out / f"overload_{key}.png",
                xlabel="speed-up",
                ylabel=label,
                title="admission under overload",
            )
        plot_lines(
            {p: (speedups, [swing[p][str(v)] for v in speedups]) for p in ADMISSIONS},
            args.out / "overload_oscillation.png",
            xlabel="speed-up",
            ylabel="decode load peak-to-trough (requests)",
            title="load oscillation",
        )
    report: Report = {
        key: {p: per_speedup[p][key] for p in ADMISSIONS}
        for key in ("rejected", "rejected_after_prefill", "wasted_prefill_s", "slo_attainment", "goodput_rps")
    }
    report["oscillation"] = swing
    report["cluster"] = simulation.describe(spec)
    return report, "\n".join(lines)
