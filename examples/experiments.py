"""The paper's experiments on the simulated cluster, one subcommand each (table + JSON + plot).

    python examples/experiments.py scheduling  [--trace PATH | --preset NAME]   # FAST'25 Fig. 5
    python examples/experiments.py rejection   --speedup 2                      # arXiv Table 3, Fig. 9
    python examples/experiments.py cache                                        # FAST'25 Fig. 10
    python examples/experiments.py throughput                                   # arXiv Fig. 12; FAST'25 Figs. 6-7
    python examples/experiments.py threshold | overload | predictors

Every subcommand takes the workload and cluster options of replay.py, writes
<out>/<name>.json and <name>*.png (default out: build/experiments) and prints
its table; --json prints the JSON instead. Nothing is tuned toward the paper's
numbers: clusters are sized by one rule (see simulation.py) before any run.

It is one script of several short experiments rather than a package of them:
each subcommand is a few dozen lines over the same replay, header and report
helpers, and a reader compares them side by side.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import simulation

from mooncake.errors import MooncakeError
from mooncake.sched.cost import HARDWARE, MODELS, PrefillCostModel
from mooncake.sched.join import DecodeLoad
from mooncake.sched.outcome import Outcome
from mooncake.sched.predictor import (
    LoadPredictor,
    LoadSnapshot,
    OutputLengthPredictor,
    UniformDecodePredictor,
    score_predictor,
)
from mooncake.sched.step import DecodeCostModel
from mooncake.sched.view import ActiveDecode, QueuedPrefill
from mooncake.sim.coupled import CoupledCluster, CoupledSpec
from mooncake.sim.disaggregated import DisaggregatedCluster
from mooncake.sim.metrics import LoadSample, ReplayResult
from mooncake.sim.report import plot_cdfs, plot_lines, plot_load, write_json
from mooncake.sim.spec import ADMISSIONS, ROUTERS, ClusterSpec, build_conductor
from mooncake.types import Request, Slo
from mooncake.workload import ArrivalProcess, fixed_length_requests

Report = dict[str, Any]


def _replay(
    spec: ClusterSpec, requests: Sequence[Request], args: argparse.Namespace, *, slo: Slo | None = None, **policy: Any
) -> ReplayResult:
    """Replay on a fresh cluster with the options' policies, `policy` overriding them."""
    options = {"router": args.router, "admission": args.admission, "threshold": args.threshold}
    options.update(policy)
    options["router"] = simulation.router_option(options["router"])
    conductor = build_conductor(spec, slo=slo or simulation.slo(args), seed=args.seed, **options)
    return DisaggregatedCluster(spec, conductor).run(requests)


def _header(args: argparse.Namespace, requests: Sequence[Request], spec: ClusterSpec) -> str:
    return (
        f"workload: {simulation.workload_name(args)}, {len(requests):,} requests\ncluster: {simulation.describe(spec)}"
    )


# ---------------------------------------------------------------------------------------------- scheduling


def scheduling(args: argparse.Namespace) -> tuple[Report, str]:
    """Mean TTFT per router (FAST'25 Fig. 5: 19.65 / 5.27 / 3.58 / 3.07 s)."""
    requests = simulation.load_workload(args)
    spec = simulation.cluster_spec(requests, args)
    results = {router: _replay(spec, requests, args, router=router) for router in args.routers}
    lines = [_header(args, requests, spec), f"admission {args.admission}", ""]
    width = max(20, *(len(r) + 2 for r in results))
    lines.append(
        f"{'router':<{width}}{'mean TTFT':>10}{'p90':>9}{'p99':>9}{'hit ratio':>10}{'rejected':>9}{'sim s':>7}"
    )
    for router, result in results.items():
        s = result.summary
        rejected = s.rejected_before_prefill + s.rejected_after_prefill
        lines.append(
            f"{router:<{width}}{s.ttft_s['mean']:>10.2f}{s.ttft_s['p90']:>9.2f}{s.ttft_s['p99']:>9.2f}"
            f"{s.cache_hit_ratio:>10.3f}{rejected:>9}{s.sim_wall_s:>7.2f}"
        )
    if args.out:
        ttfts = {
            router: [r.ttft_s or 0.0 for r in result.records if r.outcome == Outcome.COMPLETED]
            for router, result in results.items()
        }
        plot_cdfs(ttfts, args.out / "scheduling_ttft_cdf.png", xlabel="TTFT (s)", title="TTFT by router")
        plot_load({router: r.load for router, r in results.items()}, args.out / "scheduling_load.png")
    report = {
        "mean_ttft_s": {router: r.summary.ttft_s["mean"] for router, r in results.items()},
        "p90_ttft_s": {router: r.summary.ttft_s["p90"] for router, r in results.items()},
        "cache_hit_ratio": {router: r.summary.cache_hit_ratio for router, r in results.items()},
        "cluster": simulation.describe(spec),
    }
    return report, "\n".join(lines)


# ---------------------------------------------------------------------------------------------- rejection


def _oscillation(load: Sequence[LoadSample], start_s: float, end_s: float) -> float:
    """Peak-to-trough of the decode load while requests arrive: its 95th minus 5th percentile."""
    values = [s.decode_requests for s in load if start_s <= s.time_s <= end_s]
    if not values:
        return 0.0
    high, low = np.percentile(values, [95, 5])
    return float(high - low)


def rejection(args: argparse.Namespace) -> tuple[Report, str]:
    """Rejections and wasted prefill per admission policy (arXiv Table 3: 4,183 / 3,771 / 3,589 of 23,000)."""
    base = simulation.load_workload(args, speedup=1.0)
    spec = simulation.cluster_spec(base, args)  # sized for the workload at its own pace, then sped up
    requests = simulation.load_workload(args)
    results = {policy: _replay(spec, requests, args, admission=policy) for policy in ADMISSIONS}
    span = (requests[0].arrival_s, requests[-1].arrival_s) if requests else (0.0, 0.0)
    lines = [_header(args, requests, spec), f"speed-up {args.speedup}, router {args.router}", ""]
    lines.append(f"{'admission':<28}{'rejected':>9}{'before':>8}{'after':>7}{'wasted s':>10}{'osc.':>6}{'TTFT':>7}")
    for policy, result in results.items():
        s = result.summary
        lines.append(
            f"{policy:<28}{s.rejected_before_prefill + s.rejected_after_prefill:>9}{s.rejected_before_prefill:>8}"
            f"{s.rejected_after_prefill:>7}{s.wasted_prefill_s:>10.1f}{_oscillation(result.load, *span):>6.1f}"
            f"{s.ttft_s['mean']:>7.2f}"
        )
    if args.out:
        plot_load(
            {p: r.load for p, r in results.items()}, args.out / "rejection_load.png", title=f"speed-up {args.speedup}"
        )
    report = {
        "rejected": {
            p: r.summary.rejected_before_prefill + r.summary.rejected_after_prefill for p, r in results.items()
        },
        "rejected_after_prefill": {p: r.summary.rejected_after_prefill for p, r in results.items()},
        "wasted_prefill_s": {p: r.summary.wasted_prefill_s for p, r in results.items()},
        "oscillation": {p: _oscillation(r.load, *span) for p, r in results.items()},
        "num_requests": len(requests),
    }
    return report, "\n".join(lines)


# ---------------------------------------------------------------------------------------------- cache


def cache(args: argparse.Namespace) -> tuple[Report, str]:
    """Global pool vs local caches at equal per-node capacity (FAST'25 Fig. 10: up to 2.36× hit rate)."""
    requests = simulation.load_workload(args)
    capacities = args.capacities or [500, 1000, 2000, 5000, 10000, 20000]
    spec = simulation.cluster_spec(requests, args)
    rows: dict[str, dict[int, ReplayResult]] = {"global": {}, "local": {}}
    for blocks in capacities:
        for mode in rows:
            sized = attrs.evolve(spec, cache_capacity_tokens=blocks * 512, global_pool=mode == "global")
            rows[mode][blocks] = _replay(sized, requests, args)
    lines = [_header(args, requests, spec), f"router {args.router} (local caches: local_cache_aware)", ""]
    lines.append(
        f"{'blocks/node':>12}{'global hit':>11}{'local hit':>10}{'ratio':>7}{'global prefill':>15}{'local prefill':>14}"
    )
    for blocks in capacities:
        g, loc = rows["global"][blocks].summary, rows["local"][blocks].summary
        ratio = g.cache_hit_ratio / loc.cache_hit_ratio if loc.cache_hit_ratio else math.inf
        lines.append(
            f"{blocks:>12,}{g.cache_hit_ratio:>11.3f}{loc.cache_hit_ratio:>10.3f}{ratio:>7.2f}"
            f"{g.mean_prefill_s:>14.3f}s{loc.mean_prefill_s:>13.3f}s"
        )
    if args.out:
        plot_lines(
            {m: (capacities, [rows[m][b].summary.cache_hit_ratio for b in capacities]) for m in rows},
            args.out / "cache_hit_ratio.png",
            xlabel="cache blocks per prefill node",
            ylabel="prefix cache hit ratio",
            title="global pool vs local caches",
            logx=True,
        )
    report = {
        "hit_ratio": {m: {str(b): rows[m][b].summary.cache_hit_ratio for b in capacities} for m in rows},
        "mean_prefill_s": {m: {str(b): rows[m][b].summary.mean_prefill_s for b in capacities} for m in rows},
        "cluster": simulation.describe(spec),
    }
    return report, "\n".join(lines)


# ---------------------------------------------------------------------------------------------- throughput

THROUGHPUT_CONFIGS = ("3P+1D", "2P+2D", "vllm-4", "vllm-4-chunked")


def _p90_within(result: ReplayResult, slo: Slo) -> bool:
    """P90 TTFT and P90 TBT within the SLO, a rejected request counting as a violation of both."""
    ttft = [r.ttft_s if r.outcome == Outcome.COMPLETED and r.ttft_s is not None else math.inf for r in result.records]
    tbt = [r.tbt_s if r.outcome == Outcome.COMPLETED else math.inf for r in result.records]
    p90 = {"method": "higher"}  # an order statistic: no interpolation between infinities
    return bool(np.percentile(ttft, 90, **p90) <= slo.ttft_s and np.percentile(tbt, 90, **p90) <= slo.tbt_s)


def _run_config(config: str, requests: Sequence[Request], args: argparse.Namespace, slo: Slo) -> ReplayResult:
    model, hardware = MODELS[args.model], HARDWARE[args.hardware]
    if config.startswith("vllm"):
        spec = CoupledSpec(num_instances=4, model=model, hardware=hardware, chunked_prefill=config.endswith("chunked"))
        return CoupledCluster(spec, slo=slo).run(requests)
    prefill, decode = int(config[0]), int(config[3])
    cluster = ClusterSpec(
        num_prefill=prefill,
        num_decode=decode,
        model=model,
        prefill_hardware=hardware,
        decode_hardware=hardware,
        cache_capacity_tokens=args.cache_blocks * 512,
    )
    conductor = build_conductor(cluster, router="kvcache_centric", admission="baseline", slo=slo, seed=args.seed)
    return DisaggregatedCluster(cluster, conductor).run(requests)


def _max_rate(meets: Callable[[float], bool], *, low: float = 1e-3, high: float = 64.0, steps: int = 12) -> float:
    """The highest rate that meets the objective, by bisection on a log scale (0 if even `low` fails;
    a lower bound, the largest rate tried, if even 4⁶ · `high` meets it)."""
    if not meets(low):
        return 0.0
    for _ in range(6):
        if not meets(high):
            break
        low, high = high, high * 4
    else:
        return low
    for _ in range(steps):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if meets(middle) else (low, middle)
    return low


def throughput(args: argparse.Namespace) -> tuple[Report, str]:
    """Max Poisson rate within the P90 SLOs (arXiv Fig. 12) and effective capacity vs the TBT SLO (FAST'25)."""
    lengths = args.lengths or [16384, 32768, 65536, 131072]
    model, hardware = MODELS[args.model], HARDWARE[args.hardware]
    lone = PrefillCostModel(model=model, hardware=hardware)
    max_rps: dict[str, dict[str, float]] = {config: {} for config in THROUGHPUT_CONFIGS}
    slos: dict[str, dict[str, float]] = {}
    for length in lengths:
        # The TTFT SLO scales with the prompt: a multiple of a lone request's (half of it cached).
        ttft_slo = (
            args.ttft_slo_factor * lone.prefill_s(length, length // 2) if args.ttft_slo_factor > 0 else args.ttft_slo
        )
        slo = Slo(ttft_s=ttft_slo, tbt_s=args.tbt_slo)
        slos[str(length)] = {"ttft_s": slo.ttft_s, "tbt_s": slo.tbt_s}

        def meets(rate: float, config: str, length: int = length, slo: Slo = slo) -> bool:
            requests = fixed_length_requests(
                input_tokens=length,
                output_tokens=512,
                num_requests=args.throughput_requests,
                cache_ratio=0.5,
                arrivals=ArrivalProcess(rate_per_s=rate),
                seed=args.seed,
            )
            return _p90_within(_run_config(config, requests, args, slo), slo)

        for config in THROUGHPUT_CONFIGS:
            max_rps[config][str(length)] = _max_rate(lambda rate, c=config: meets(rate, c))

    # Effective request capacity on the workload: requests within both SLOs, Mooncake vs coupled.
    requests = simulation.load_workload(args)
    spec = simulation.cluster_spec(requests, args)
    effective: dict[str, dict[str, int]] = {}
    for tbt in args.tbt_thresholds:
        slo = Slo(ttft_s=args.ttft_slo, tbt_s=tbt)
        disaggregated = _replay(spec, requests, args, slo=slo)
        coupled = CoupledCluster(
            CoupledSpec(num_instances=spec.num_prefill + spec.num_decode, model=model, hardware=hardware), slo=slo
        ).run(requests)
        effective[str(tbt)] = {
            "mooncake": round(disaggregated.summary.slo_attainment * len(requests)),
            "coupled": round(coupled.summary.slo_attainment * len(requests)),
        }

    lines = [f"long-context: {args.throughput_requests} requests per point, 512 output tokens, 50 % cache ratio"]
    lines.append(
        f"{'config':<16}" + "".join(f"{f'{n // 1024}K':>10}" for n in lengths) + "   (max req/s within P90 SLOs)"
    )
    for config in THROUGHPUT_CONFIGS:
        lines.append(f"{config:<16}" + "".join(f"{max_rps[config][str(n)]:>10.4f}" for n in lengths))
    lines.append(f"{'TTFT SLO (s)':<16}" + "".join(f"{slos[str(n)]['ttft_s']:>10.1f}" for n in lengths))
    best_vllm = {str(n): max(max_rps["vllm-4"][str(n)], max_rps["vllm-4-chunked"][str(n)]) for n in lengths}
    lines.append(
        f"{'gain vs vLLM':<16}"
        + "".join(
            f"{(max(max_rps['3P+1D'][str(n)], max_rps['2P+2D'][str(n)]) / best_vllm[str(n)] - 1) * 100:>9.0f}%"
            if best_vllm[str(n)]
            else f"{'n/a':>10}"
            for n in lengths
        )
    )
    lines.append("")
    lines.append(_header(args, requests, spec))
    lines.append(f"{'TBT SLO':>8}{'mooncake':>10}{'coupled':>9}{'gain':>8}   (requests within TTFT and TBT SLOs)")
    for tbt, row in effective.items():
        gain = (row["mooncake"] / row["coupled"] - 1) * 100 if row["coupled"] else math.inf
        lines.append(f"{float(tbt) * 1000:>6.0f}ms{row['mooncake']:>10}{row['coupled']:>9}{gain:>7.0f}%")
    if args.out:
        plot_lines(
            {c: (lengths, [max_rps[c][str(n)] for n in lengths]) for c in THROUGHPUT_CONFIGS},
            args.out / "throughput.png",
            xlabel="prompt tokens",
            ylabel="max req/s within P90 SLOs",
            title="long-context throughput",
            logx=True,
        )
    return {"max_rps": max_rps, "slo": slos, "effective_requests": effective}, "\n".join(lines)


# ---------------------------------------------------------------------------------------------- threshold


def threshold(args: argparse.Namespace) -> tuple[Report, str]:
    """TTFT against kvcache_balancing_threshold (the KV-cache-centric router)."""
    requests = simulation.load_workload(args)
    spec = simulation.cluster_spec(requests, args)
    values = args.thresholds or [1.0, 1.25, 1.5, 2.0, 3.0, 5.0, math.inf]
    results = {t: _replay(spec, requests, args, router="kvcache_centric", threshold=t) for t in values}
    lines = [_header(args, requests, spec), ""]
    lines.append(f"{'threshold':>10}{'mean TTFT':>10}{'p90':>8}{'p99':>8}{'hit ratio':>10}")
    for t, r in results.items():
        s = r.summary
        lines.append(
            f"{t:>10}{s.ttft_s['mean']:>10.3f}{s.ttft_s['p90']:>8.2f}{s.ttft_s['p99']:>8.2f}{s.cache_hit_ratio:>10.3f}"
        )
    finite = [t for t in values if math.isfinite(t)]
    if args.out and finite:
        plot_lines(
            {"mean TTFT": (finite, [results[t].summary.ttft_s["mean"] for t in finite])},
            args.out / "threshold.png",
            xlabel="kvcache_balancing_threshold",
            ylabel="mean TTFT (s)",
            title="threshold sensitivity",
        )
    return {"mean_ttft_s": {str(t): r.summary.ttft_s["mean"] for t, r in results.items()}}, "\n".join(lines)


# ---------------------------------------------------------------------------------------------- overload


def overload(args: argparse.Namespace) -> tuple[Report, str]:
    """Rejections and decode-load oscillation per admission policy as the workload speeds up."""
    base = simulation.load_workload(args, speedup=1.0)
    spec = simulation.cluster_spec(base, args)
    speedups = args.speedups or [1.2, 2.0, 3.0, 4.0, 5.0]
    rejected: dict[str, dict[str, int]] = {p: {} for p in ADMISSIONS}
    wasted: dict[str, dict[str, float]] = {p: {} for p in ADMISSIONS}
    oscillation: dict[str, dict[str, float]] = {p: {} for p in ADMISSIONS}
    for speedup in speedups:
        requests = simulation.load_workload(args, speedup=speedup)
        span = (requests[0].arrival_s, requests[-1].arrival_s)
        for policy in ADMISSIONS:
            s = _replay(spec, requests, args, admission=policy)
            rejected[policy][str(speedup)] = s.summary.rejected_before_prefill + s.summary.rejected_after_prefill
            wasted[policy][str(speedup)] = s.summary.wasted_prefill_s
            oscillation[policy][str(speedup)] = _oscillation(s.load, *span)
    lines = [_header(args, base, spec), ""]
    lines.append(
        f"{'admission':<28}" + "".join(f"{f'x{v}':>14}" for v in speedups) + "   rejected (wasted s) / oscillation"
    )
    for policy in ADMISSIONS:
        lines.append(
            f"{policy:<28}"
            + "".join(
                f"{rejected[policy][str(v)]:>6}({wasted[policy][str(v)]:>5.0f})/{oscillation[policy][str(v)]:<3.0f}"
                for v in speedups
            )
        )
    if args.out:
        plot_lines(
            {p: (speedups, [rejected[p][str(v)] for v in speedups]) for p in ADMISSIONS},
            args.out / "overload_rejected.png",
            xlabel="speed-up",
            ylabel="rejected requests",
            title="rejections under overload",
        )
        plot_lines(
            {p: (speedups, [oscillation[p][str(v)] for v in speedups]) for p in ADMISSIONS},
            args.out / "overload_oscillation.png",
            xlabel="speed-up",
            ylabel="decode load peak-to-trough (requests)",
            title="load oscillation",
        )
    return {"rejected": rejected, "wasted_prefill_s": wasted, "oscillation": oscillation}, "\n".join(lines)


# ---------------------------------------------------------------------------------------------- predictors


@attrs.frozen
class CurrentLoad:
    """No prediction: the load at `at_s` is the load now (the baseline every predictor must beat)."""

    def predict(
        self, active: Sequence[ActiveDecode], incoming: Sequence[QueuedPrefill], now: float, at_s: float
    ) -> DecodeLoad:
        return DecodeLoad(
            len(active),
            sum(a.context_tokens for a in active),
            sum(a.context_tokens + a.output_tokens for a in active),
        )

    def observe(self, output_tokens: int) -> None:
        """Nothing to learn."""


def predictors(args: argparse.Namespace) -> tuple[Report, str]:
    """Mean absolute error of each decode-load predictor against what the replay really did."""
    requests = simulation.load_workload(args)
    spec = simulation.cluster_spec(requests, args)
    conductor = build_conductor(
        spec,
        router=args.router,
        admission=args.admission,
        threshold=args.threshold,
        slo=simulation.slo(args),
        seed=args.seed,
    )
    cluster = DisaggregatedCluster(spec, conductor)
    horizons = args.horizons or [1.0, 5.0, 10.0, 30.0]
    snapshots: dict[float, list[LoadSnapshot]] = {h: [] for h in horizons}

    def observe(now: float) -> None:
        for view in conductor.decode_views:
            active, incoming = tuple(view.active.values()), conductor.incoming(view.instance_id)
            for horizon in horizons:
                cluster.loop.at(now + horizon, settle, horizon, view.instance_id, active, incoming, now)

    def settle(at_s: float, horizon: float, instance: Any, active: Any, incoming: Any, now: float) -> None:
        actual = cluster.decode_load(instance, at_s)
        snapshots[horizon].append(LoadSnapshot(active=active, incoming=incoming, now=now, at_s=at_s, actual=actual))

    warm_up = len(requests) // 5  # the output-length predictor learns from the first fifth
    if not requests:
        raise MooncakeError("the workload is empty")
    start, end = requests[warm_up].arrival_s, requests[-1].arrival_s
    t = start
    while t <= end:
        cluster.loop.at(t, observe)
        t += args.sample_every
    cluster.run(requests)
    step = DecodeCostModel(model=spec.model, hardware=spec.decode_hardware).step_s(1, 0)
    learnt = OutputLengthPredictor(step_s=step, lengths=[r.output_length for r in requests[:warm_up]])
    candidates: dict[str, LoadPredictor] = {
        "current_load": CurrentLoad(),
        "uniform_td_10s": UniformDecodePredictor(decode_s=10.0),
        "uniform_td_5s": UniformDecodePredictor(decode_s=5.0),
        "output_length": learnt,
    }
    mae = {
        name: {str(h): attrs.asdict(score_predictor(p, snapshots[h])) for h in horizons}
        for name, p in candidates.items()
    }
    lines = [_header(args, requests, spec), f"snapshots every {args.sample_every} s per decode instance", ""]
    lines.append(f"{'predictor':<18}" + "".join(f"{f'+{h:g}s':>10}" for h in horizons) + "   (MAE of batch size)")
    for name in candidates:
        lines.append(f"{name:<18}" + "".join(f"{mae[name][str(h)]['batch_size_mae']:>10.2f}" for h in horizons))
    if args.out:
        plot_lines(
            {n: (horizons, [mae[n][str(h)]["batch_size_mae"] for h in horizons]) for n in candidates},
            args.out / "predictors.png",
            xlabel="horizon (s)",
            ylabel="batch-size MAE",
            title="decode load prediction error",
        )
    return {"mae": mae}, "\n".join(lines)


# ---------------------------------------------------------------------------------------------- main

EXPERIMENTS: dict[str, Callable[[argparse.Namespace], tuple[Report, str]]] = {
    "scheduling": scheduling,
    "rejection": rejection,
    "cache": cache,
    "throughput": throughput,
    "threshold": threshold,
    "overload": overload,
    "predictors": predictors,
}


def _numbers(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    return lambda text: [kind(part) for part in text.split(",") if part]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="experiment", required=True)
    for name, function in EXPERIMENTS.items():
        q = sub.add_parser(name, help=(function.__doc__ or "").split("\n")[0])
        simulation.add_workload_options(q)
        simulation.add_cluster_options(q)
        simulation.add_policy_options(q)
        q.add_argument("--out", type=Path, default=Path("build/experiments"), help="JSON and plots go here")
        q.add_argument("--no-plots", action="store_true")
        q.add_argument("--json", action="store_true", help="print the JSON instead of the table")
        if name == "scheduling":
            q.add_argument(
                "--routers", type=_numbers(str), default=list(ROUTERS), help="comma-separated; FILE.py:FACTORY too"
            )
        if name == "rejection":
            q.set_defaults(speedup=2.0)
        if name == "cache":
            q.add_argument("--capacities", type=_numbers(int), help="blocks per node, comma-separated")
        if name == "throughput":
            q.add_argument("--lengths", type=_numbers(int), help="prompt lengths, comma-separated")
            q.add_argument("--throughput-requests", type=int, default=300, help="requests per rate tried")
            q.add_argument("--ttft-slo-factor", type=float, default=10.0, help="TTFT SLO = factor x a lone request's")
            q.add_argument("--tbt-thresholds", type=_numbers(float), default=[0.1, 0.2, 0.3])
        if name == "threshold":
            q.add_argument("--thresholds", type=_numbers(float))
        if name == "overload":
            q.add_argument("--speedups", type=_numbers(float))
        if name == "predictors":
            q.add_argument("--horizons", type=_numbers(float))
            q.add_argument("--sample-every", type=float, default=5.0, help="seconds between snapshots")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    plots_dir = None if args.no_plots else args.out
    out_dir: Path = args.out
    args.out = plots_dir
    started = time.perf_counter()
    try:
        report, table = EXPERIMENTS[args.experiment](args)
    except (MooncakeError, OSError) as error:
        print(f"experiments: {error}", file=sys.stderr)
        return 2
    report["wall_s"] = time.perf_counter() - started
    write_json(report, out_dir / f"{args.experiment}.json")
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        print(table)
        print(f"\n{args.experiment}: {report['wall_s']:.1f} s; JSON and plots in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
