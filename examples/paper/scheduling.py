"""Routers compared on one workload and cluster (FAST'25 Fig. 5: 19.65 / 5.27 / 3.58 / 3.07 s mean TTFT).

Mean TTFT averages the completed requests only, so each router is also ranked
by goodput and by SLO attainment over all arrivals.
"""

from __future__ import annotations

import argparse
import math

import simulation

from mooncake.sched.outcome import Outcome
from mooncake.sim.report import plot_cdfs, plot_load
from paper.common import OUTCOME_COLUMNS, Report, header, outcome_cells, outcomes_json, replay

__all__ = ["scheduling"]


def tiers(order: list[str], values: dict[str, float]) -> list[list[str]]:
    """Routers in `order` (best first) grouped where their figures tie: the JSON's ranking, so that a consumer
    reading its first entry gets every router that tied for first, not whichever `--routers` named first."""
    groups: list[list[str]] = []
    for router in order:
        if groups and math.isclose(values[groups[-1][-1]], values[router], rel_tol=1e-9, abs_tol=1e-12):
            groups[-1].append(router)
        else:
            groups.append([router])
    return groups


def ranked(order: list[str], values: dict[str, float], better: str) -> str:
    """Routers in `order` joined by `better` (" < ", " > "), and by " = " where their figures tie (`tiers`), so that
    a tie never reads as an order."""
    return better.join(" = ".join(group) for group in tiers(order, values))


def scheduling(args: argparse.Namespace) -> tuple[Report, str]:
    """Mean TTFT, outcomes, goodput and SLO attainment per router (FAST'25 Fig. 5)."""
    requests, spec = simulation.sized_cluster(args)
    results = {router: replay(spec, requests, args, router=router) for router in args.routers}
    lines = [header(args, requests, spec), f"admission {args.admission}", ""]
    width = max(20, *(len(r) + 2 for r in results))
    lines.append(f"{'router':<{width}}{'mean TTFT':>10}{'p90':>8}{'p99':>8}{'hit ratio':>10}{OUTCOME_COLUMNS}")
    for router, result in results.items():
        s = result.summary
        lines.append(
            f"{router:<{width}}{s.ttft_s['mean']:>10.2f}{s.ttft_s['p90']:>8.2f}{s.ttft_s['p99']:>8.2f}"
            f"{s.cache_hit_ratio:>10.3f}{outcome_cells(s)}"
        )
    # A router that completed nothing has no mean TTFT (its 0 would rank it fastest): it is left out of that ranking.
    timed = [r for r in results if results[r].summary.completed]
    figures = {  # what each ranking orders by, and the sign that makes smaller better
        "mean_ttft": ({r: results[r].summary.ttft_s["mean"] for r in timed}, 1.0, " < "),
        "goodput": ({r: results[r].summary.goodput_rps for r in results}, -1.0, " > "),
        "slo_attainment": ({r: results[r].summary.slo_attainment for r in results}, -1.0, " > "),
    }
    order = {by: sorted(values, key=lambda r: sign * values[r]) for by, (values, sign, _) in figures.items()}
    lines.append("")
    for by, (values, _sign, better) in figures.items():
        lines.append(f"ranked by {by.replace('_', ' ')}: {ranked(order[by], values, better)}")
    if len(timed) < len(results):
        lines.append(f"not ranked by mean TTFT (completed nothing): {', '.join(r for r in results if r not in timed)}")
    if args.out:
        ttfts = {
            router: [r.ttft_s or 0.0 for r in result.records if r.outcome == Outcome.COMPLETED]
            for router, result in results.items()
        }
        plot_cdfs(ttfts, args.out / "scheduling_ttft_cdf.png", xlabel="TTFT (s)", title="TTFT by router")
        plot_load({router: r.load for router, r in results.items()}, args.out / "scheduling_load.png")
    report: Report = {
        "mean_ttft_s": {router: r.summary.ttft_s["mean"] for router, r in results.items()},
        "p90_ttft_s": {router: r.summary.ttft_s["p90"] for router, r in results.items()},
        "p99_ttft_s": {router: r.summary.ttft_s["p99"] for router, r in results.items()},
        "cache_hit_ratio": {router: r.summary.cache_hit_ratio for router, r in results.items()},
        **outcomes_json(results),
        # Best first, each entry the routers tied there: [["a", "b"], ["c"]] is a = b > c.
        "ranking": {by: tiers(order[by], values) for by, (values, _sign, _better) in figures.items()},
        "cluster": simulation.describe(spec),
    }
    return report, "\n".join(lines)
