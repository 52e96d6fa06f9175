"""The global KV pool against local caches, over cluster sizes and cache capacities (FAST'25 Fig. 10).

For each number of prefill nodes and each per-node capacity, the same
workload runs once with a global pool (any node fetches any block) and once
with local caches (no fetches), both under `--router`, and the hit ratios are
compared. Without fetches the KV-cache-centric router (the default) is the
local-cache-aware one. A global pool gains most where the
workload's reusable prefixes outgrow one node's cache but fit the cluster's:
many nodes with small caches. The table marks where the ratio is largest, if
it is above 1 anywhere.

The global pool matters only through the transfers the router plans, so a
router that never plans one (`what_stops_transfers`: random, round_robin,
load_balancing, local_cache_aware, kvcache_centric at --threshold inf) is
refused: both modes would replay alike. In the JSON, a cell's `ratio` is null
where it is not a number: infinite where only the global pool hit (such cells
are listed in `infinite_ratio`), none where neither did; its `cluster` names
what the rows ran: the header's cluster and the prefill nodes and capacities
swept, each in both modes.
"""

from __future__ import annotations

import argparse
import math

import attrs
import simulation

from mooncake.errors import ConfigError
from mooncake.sim.metrics import ReplayResult
from mooncake.sim.report import plot_lines
from mooncake.workload import trace_stats
from paper.common import Report, header, replay, what_stops_transfers

__all__ = ["cache"]


def cache(args: argparse.Namespace) -> tuple[Report, str]:
    """Global pool vs local caches at equal per-node capacity, over node counts (FAST'25 Fig. 10: up to 2.36×)."""
    stopped = what_stops_transfers(router=args.router, threshold=args.threshold, global_pool=True)
    if stopped is not None:
        option, why = stopped
        raise ConfigError(
            f"{option} does not apply to cache: {why}, so the global pool and the local caches would replay alike"
        )
    requests, spec = simulation.sized_cluster(args)
    capacities = args.capacities or [500, 1000, 2000, 5000, 10000, 20000]
    cpp = spec.cpp_group_size
    for nodes in args.nodes or ():
        simulation.check_cpp_divides(cpp, nodes, f"--nodes {nodes}")
    # Half, as many and twice the sized pool, each rounded down to whole CPP groups (half of 6 nodes in groups of 2,
    # 3, would be no cluster: it becomes 2), at least one group.
    pool = spec.num_prefill
    node_counts = args.nodes or sorted({max(cpp, n - n % cpp) for n in (pool // 2, pool, pool * 2)})
    rows: dict[tuple[int, int, str], ReplayResult] = {}
    for nodes in node_counts:
        for blocks in capacities:
            for mode in ("global", "local"):
                sized = attrs.evolve(
                    spec,
                    num_prefill=nodes,
                    cache_capacity_tokens=blocks * spec.block_size_tokens,
                    global_pool=mode == "global",
                )
                rows[nodes, blocks, mode] = replay(sized, requests, args)

    def ratio(nodes: int, blocks: int) -> float:
        local = rows[nodes, blocks, "local"].summary.cache_hit_ratio
        shared = rows[nodes, blocks, "global"].summary.cache_hit_ratio
        if local:
            return shared / local
        return math.inf if shared else math.nan  # no local hit: infinite gain, or none to compare

    # The largest gain among the cells where both caches hit (an infinite one says only that local caches missed);
    # none where no cell has both (a workload that shares no prefix hits in neither), and none where no ratio is
    # above 1: a tie marked "largest" would read as a finding (a router file's router that transfers nothing).
    finite = [(n, b) for n in node_counts for b in capacities if math.isfinite(ratio(n, b))]
    best = max(finite, key=lambda nb: ratio(*nb)) if finite else None
    largest = best if best is not None and ratio(*best) > 1 else None
    # The local caches' runs are the same router's with transfers off (build_conductor): say what that makes it.
    local = "local_cache_aware" if args.router == "kvcache_centric" else f"{args.router}, no transfers"
    groups = f", CPP groups of {spec.cpp_group_size}" if spec.cpp_group_size > 1 else ""
    cluster = f"{spec.num_decode} decode nodes, {spec.model.name} on {spec.prefill_hardware.name}{groups}"
    # The JSON's cluster is the one the rows ran, not the options' (`simulation.describe`): what its keys sweep.
    swept = (
        f"prefill nodes {', '.join(map(str, node_counts))} x cache blocks per node {', '.join(map(str, capacities))}"
        ", each with a global pool and with local caches"
    )
    lines = [
        header(args, requests, spec, cluster=f"{cluster}, prefill nodes and cache blocks per node as below"),
        f"router {args.router} (local caches: {local})",
        "",
    ]
    lines.append(
        f"{'nodes':>6}{'blocks/node':>12}{'global hit':>11}{'local hit':>10}{'ratio':>7}"
        f"{'global prefill':>15}{'local prefill':>14}"
    )
    for nodes in node_counts:
        for blocks in capacities:
            g, loc = rows[nodes, blocks, "global"].summary, rows[nodes, blocks, "local"].summary
            mark = "  <- largest" if (nodes, blocks) == largest else ""
            gain = ratio(nodes, blocks)
            shown = "-" if math.isnan(gain) else f"{gain:.2f}"  # no hit in either: nothing to compare
            lines.append(
                f"{nodes:>6}{blocks:>12,}{g.cache_hit_ratio:>11.3f}{loc.cache_hit_ratio:>10.3f}{shown:>7}"
                f"{g.mean_prefill_s:>14.3f}s{loc.mean_prefill_s:>13.3f}s{mark}"
            )
    lines.append("")
    if largest is not None:
        lines.append(
            f"the global pool's gain is largest at {largest[0]} nodes of {largest[1]:,} blocks: "
            f"{ratio(*largest):.2f}x the local caches' hit ratio"
        )
    elif best is not None:
        lines.append(
            "the global pool gained nothing: wherever both hit, its hit ratio is at most the local caches' "
            f"(a router that plans no transfer, as --router {args.router} may, gains nothing from it)"
        )
    elif any(math.isinf(ratio(n, b)) for n in node_counts for b in capacities):
        lines.append("the local caches never hit where the global pool did: there is no finite ratio to compare")
    elif not any(capacities):  # no cache holds a block: the workload is not to blame
        lines.append("neither the global pool nor the local caches hit (every capacity is 0 blocks): no comparison")
    elif trace_stats(requests).prefix_reuse_ratio > 0:  # a prefix to hit, which no capacity swept kept
        lines.append(
            "neither the global pool nor the local caches hit, though the workload reuses prefixes (the capacities "
            "may be too small to hold a prefix): no comparison"
        )
    else:
        lines.append("neither the global pool nor the local caches hit (the workload shares no prefix): no comparison")
    if args.out:
        plot_lines(
            {f"{n} nodes": (capacities, [ratio(n, b) for b in capacities]) for n in node_counts},
            args.out / "cache_hit_ratio.png",
            xlabel="cache blocks per prefill node",
            ylabel="global / local hit ratio",
            title="global pool vs local caches",
            logx=True,
        )
    report: Report = {
        "hit_ratio": {
            mode: {f"{n}x{b}": rows[n, b, mode].summary.cache_hit_ratio for n in node_counts for b in capacities}
            for mode in ("global", "local")
        },
        "ratio": {f"{n}x{b}": ratio(n, b) for n in node_counts for b in capacities},
        # JSON has no infinity: an infinite ratio (null in "ratio") is told from none to compare (null as well).
        "infinite_ratio": [f"{n}x{b}" for n in node_counts for b in capacities if math.isinf(ratio(n, b))],
        "mean_prefill_s": {
            mode: {f"{n}x{b}": rows[n, b, mode].summary.mean_prefill_s for n in node_counts for b in capacities}
            for mode in ("global", "local")
        },
        "largest_ratio": None
        if largest is None
        else {"nodes": largest[0], "blocks": largest[1], "ratio": ratio(*largest)},
        "cluster": f"{cluster}; {swept}",
    }
    return report, "\n".join(lines)
