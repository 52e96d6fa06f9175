"""TTFT against the KV-cache-centric router's kvcache_balancing_threshold.

Algorithm 1 moves a prefix to an instance when best_len / its own prefix_len
exceeds the threshold. The table shows mean TTFT, the cache hit ratio and the
outcomes per threshold. Where mean TTFT hardly moves (within 1 %) between two
finite thresholds or more, a note says so, and why only where the replays show
it: if every request was routed alike (the same instance, the same prefix) at
each of them, no decision turned on a ratio between them (as where an instance
holds a request's whole matched prefix, ratio 1, or none of it, ratio
infinite); otherwise the thresholds did change decisions, which moved TTFT
little. Local caches (`--local-cache`) are refused, since without a global
pool nothing is transferred and no threshold decides anything.
"""

from __future__ import annotations

import argparse
import math

import simulation

from mooncake.errors import ConfigError
from mooncake.sim.metrics import ReplayResult
from mooncake.sim.report import plot_lines
from paper.common import OUTCOME_COLUMNS, Report, header, outcome_cells, replay, what_stops_transfers

__all__ = ["threshold"]


def threshold(args: argparse.Namespace) -> tuple[Report, str]:
    """TTFT and outcomes against kvcache_balancing_threshold (the KV-cache-centric router)."""
    # The router and its (finite) thresholds are the experiment's own: only the options' pool can stop transfers.
    stopped = what_stops_transfers(router="kvcache_centric", threshold=1.0, global_pool=args.global_pool)
    if stopped is not None:
        option, why = stopped
        raise ConfigError(f"{option} does not apply to threshold: {why}, so no threshold decides anything")
    requests, spec = simulation.sized_cluster(args)
    values = args.thresholds or [1.0, 1.25, 1.5, 2.0, 3.0, 5.0, math.inf]
    results = {t: replay(spec, requests, args, router="kvcache_centric", threshold=t) for t in values}
    lines = [header(args, requests, spec), ""]
    lines.append(f"{'threshold':>10}{'mean TTFT':>10}{'p90':>8}{'p99':>8}{'hit ratio':>10}{OUTCOME_COLUMNS}")
    for t, r in results.items():
        s = r.summary
        lines.append(
            f"{t:>10}{s.ttft_s['mean']:>10.3f}{s.ttft_s['p90']:>8.2f}{s.ttft_s['p99']:>8.2f}{s.cache_hit_ratio:>10.3f}"
            f"{outcome_cells(s)}"
        )
    finite = [t for t in values if math.isfinite(t)]
    means = [results[t].summary.ttft_s["mean"] for t in finite]
    if len(means) > 1 and max(means) - min(means) <= 0.01 * max(means):  # one threshold is flat on its own
        lines.append("")
        # A cause is stated only where the replays show it: a flat mean may hide decisions that did change.
        if len({_routes(results[t]) for t in finite}) == 1:
            lines.append(
                "flat across the finite thresholds (within 1 %): every request was routed alike at each (the same "
                f"instance, the same prefix), so no decision turned on a best_len / prefix_len between {min(finite):g} "
                f"and {max(finite):g}"
            )
        else:
            lines.append(
                "flat across the finite thresholds (within 1 %), though they routed requests differently: the "
                "decisions they changed moved mean TTFT little"
            )
    if args.out and finite:
        plot_lines(
            {"mean TTFT": (finite, means)},
            args.out / "threshold.png",
            xlabel="kvcache_balancing_threshold",
            ylabel="mean TTFT (s)",
            title="threshold sensitivity",
        )
    report: Report = {
        "mean_ttft_s": {str(t): r.summary.ttft_s["mean"] for t, r in results.items()},
        "cache_hit_ratio": {str(t): r.summary.cache_hit_ratio for t, r in results.items()},
        "slo_attainment": {str(t): r.summary.slo_attainment for t, r in results.items()},
        "goodput_rps": {str(t): r.summary.goodput_rps for t, r in results.items()},
    }
    return report, "\n".join(lines)


def _routes(result: ReplayResult) -> tuple[tuple[str | None, int], ...]:
    """Where each request was prefilled and from how long a prefix: what a threshold decides (a transfer puts the
    best holder's prefix at the instance, which it would otherwise prefill from its own)."""
    return tuple((record.prefill_instance, record.prefix_tokens) for record in result.records)
