"""Long-context throughput within the SLOs (arXiv Fig. 12) and effective capacity on the workload (FAST'25 Figs. 6-7).

For each prompt length, the highest Poisson rate at which P90 TTFT and P90 TBT
stay within the SLOs (a rejected request violating both), for two
disaggregated clusters (3P+1D, 2P+2D) and four coupled vLLM-style instances
with and without chunked prefill. On the workload itself, the requests served
within both SLOs by Mooncake and by the stronger coupled baseline on as many
GPUs, for each TBT objective.

Both parts run Mooncake with the options' policies (`--router`, `--threshold`,
`--admission`, `--predictor`) and cluster options (`--cache-blocks`,
`--local-cache`, `--cpp`, `--inline-prefill`, `--admission-wait`, `--model`,
`--hardware`, `--block-size`); the long-context clusters keep their own node
counts (3P+1D, 2P+2D: any `--cpp` above 1 divides one of them not, and is
refused), and their prompts must fit a decode node with their output. Every
option is checked, against the workload too, before the long-context search.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import attrs
import numpy as np
import simulation
from serving import registry

from mooncake.errors import ConfigError
from mooncake.sched.cost import HARDWARE, MODELS, PrefillCostModel
from mooncake.sched.join import DecodeLoad, check_join
from mooncake.sched.outcome import Outcome
from mooncake.sim.coupled import CoupledCluster
from mooncake.sim.disaggregated import DisaggregatedCluster
from mooncake.sim.metrics import ReplayResult
from mooncake.sim.report import plot_lines
from mooncake.sim.spec import ClusterSpec
from mooncake.types import MAX_TOKENS, Request, Slo
from mooncake.workload import ArrivalProcess, fixed_length_requests
from paper.common import Report, header, policy_conductor, replay

__all__ = ["THROUGHPUT_CONFIGS", "throughput"]

THROUGHPUT_CONFIGS = ("3P+1D", "2P+2D", "vllm-4", "vllm-4-chunked")
VLLM = ("vllm-4", "vllm-4-chunked")
# The chunked baselines' token budget, tuned to the TBT objectives as vLLM's own tuning guide advises (a smaller
# max_num_batched_tokens for a lower inter-token latency) rather than its server default (2048, `CoupledSpec`'s):
# at 16 K prompts 2048 puts the P90 TBT near 174 ms, over a 100 ms objective, where 512 keeps it near 95 ms. The
# comparison is against a baseline an operator holding these objectives would run.
TUNED_TOKEN_BUDGET = 512
DISAGGREGATED = {"3P+1D": (3, 1), "2P+2D": (2, 2)}  # (prefill, decode) nodes
OUTPUT_TOKENS = 512  # of every long-context request


def _p90_within(result: ReplayResult, slo: Slo) -> bool:
    """P90 TTFT and P90 TBT within the SLO, a rejected request counting as a violation of both."""
    ttft = [r.ttft_s if r.outcome == Outcome.COMPLETED and r.ttft_s is not None else math.inf for r in result.records]
    tbt = [r.tbt_s if r.outcome == Outcome.COMPLETED else math.inf for r in result.records]
    p90 = {"method": "higher"}  # an order statistic: no interpolation between infinities
    return bool(np.percentile(ttft, 90, **p90) <= slo.ttft_s and np.percentile(tbt, 90, **p90) <= slo.tbt_s)


def _run_config(
    config: str, requests: Sequence[Request], args: argparse.Namespace, slo: Slo, clusters: Mapping[str, ClusterSpec]
) -> ReplayResult:
    """One replay of `config`: a coupled one, or Mooncake on `clusters[config]` with the options' policies."""
    if config in VLLM:
        spec = simulation.coupled_spec(args, 4, chunked=config.endswith("chunked"), token_budget=TUNED_TOKEN_BUDGET)
        return CoupledCluster(spec, slo=slo).run(requests)
    cluster = clusters[config]
    return DisaggregatedCluster(cluster, policy_conductor(cluster, requests, args, slo)).run(requests)


def _long_context_clusters(spec: ClusterSpec, lengths: Sequence[int]) -> dict[str, ClusterSpec]:
    """The workload's cluster `spec` (every cluster option) at each long-context configuration's node counts.

    Raises:
        ConfigError: a --cpp that divides a configuration's prefill nodes not, or one of `lengths` that no decode
            node holds with its output (every request of it would be refused: no rate to find, and its block keys
            could fill the memory).
    """
    limits = spec.decode_limits
    holds = min(limits.kv_capacity_tokens, limits.max_context_tokens or limits.kv_capacity_tokens)  # for the message
    for length in lengths:
        # the decode rule's structural checks on an idle node (its TBT check is the sweep's to find); a length past
        # any request's (MAX_TOKENS) fits none
        fits = (
            length <= MAX_TOKENS
            and check_join(limits, DecodeLoad(0, 0, 0), prompt_tokens=length, output_tokens=OUTPUT_TOKENS).accepted
        )
        if not fits:
            raise ConfigError(
                f"--lengths must be at most {holds - OUTPUT_TOKENS:,} tokens (with the {OUTPUT_TOKENS} output "
                f"tokens, what one decode node of {spec.model.name} on {spec.decode_hardware.name} holds), got {length}"
            )
    clusters = {}
    for config, (prefill, decode) in DISAGGREGATED.items():
        simulation.check_cpp_divides(spec.cpp_group_size, prefill, f"{config}'s {prefill} prefill nodes")
        clusters[config] = attrs.evolve(spec, num_prefill=prefill, num_decode=decode)
    return clusters


def _policies(args: argparse.Namespace) -> dict[str, object]:
    """The Mooncake policies both parts run (`policy_conductor`'s), as the header and the JSON state them."""
    policies: dict[str, object] = {"router": args.router, "admission": args.admission}
    if registry.reads_threshold(args.router, global_pool=args.global_pool):
        policies["threshold"] = args.threshold
    if args.admission == "predictive_early_rejection":
        policies["predictor"] = args.predictor
    return policies


def _max_rate(
    meets: Callable[[float], bool], *, low: float = 1e-3, high: float = 64.0, steps: int = 12
) -> tuple[float, bool]:
    """The highest rate that meets the objective, by bisection on a log scale (0 if even `low` fails), and
    whether it is only a lower bound: the largest rate tried, 4⁵ · `high`, met it (the search's cap)."""
    if not meets(low):
        return 0.0, False
    for _ in range(6):
        if not meets(high):
            break
        low, high = high, high * 4
    else:
        return low, True
    for _ in range(steps):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if meets(middle) else (low, middle)
    return low, False


CELL = 12  # a column's width: the widest rate below the cap, 65535.9999, and a space or two


def _cells(texts: Iterable[str]) -> str:
    """`texts` right-aligned in columns of `CELL`, each after a space however wide (once they ran together)."""
    return "".join(f" {text:>{CELL - 1}}" for text in texts)


def _length_label(tokens: int) -> str:
    """A prompt length as a column label, exact: in K (1024 tokens) where that takes at most three decimals
    (16K, 1.5K), else in tokens (1000)."""
    return f"{tokens / 1024:g}K" if tokens % 128 == 0 else str(tokens)


def _effective_line(tbt_s: float, row: Mapping[str, int]) -> str:
    """One TBT SLO's line of the effective-capacity table: each cluster's requests within the SLOs and Mooncake's
    gain over the stronger coupled baseline; "n/a" where that baseline served none (as the vLLM row's: no gain
    over nothing, never an infinite percentage)."""
    best = max(row["coupled"], row["coupled_chunked"])
    gain = f"{(row['mooncake'] / best - 1) * 100:.0f}%" if best else "n/a"
    return f"{tbt_s * 1000:>6.0f}ms{row['mooncake']:>10}{row['coupled']:>9}{row['coupled_chunked']:>9}{gain:>8}"


def throughput(args: argparse.Namespace) -> tuple[Report, str]:
    """Max Poisson rate within the P90 SLOs (arXiv Fig. 12) and effective capacity vs the TBT SLO (FAST'25)."""
    # Every option, the workload's too, is checked before the long-context search: it takes minutes.
    requests, spec = simulation.sized_cluster(args)
    simulation.slo(args)
    lengths = args.lengths or [16384, 32768, 65536, 131072]
    clusters = _long_context_clusters(spec, lengths)
    lone = PrefillCostModel(model=MODELS[args.model], hardware=HARDWARE[args.hardware])
    max_rps: dict[str, dict[str, float]] = {config: {} for config in THROUGHPUT_CONFIGS}
    capped: set[tuple[str, int]] = set()  # (config, length) whose rate is the search's cap, a lower bound
    slos: dict[str, dict[str, float]] = {}
    for length in lengths:
        # The TTFT SLO scales with the prompt: a multiple of a lone request's (half of it cached).
        ttft_slo = (
            args.ttft_slo_factor * lone.prefill_s(length, length // 2) if args.ttft_slo_factor > 0 else args.ttft_slo
        )
        slo = Slo(ttft_s=ttft_slo, tbt_s=args.tbt_slo)
        slos[str(length)] = {"ttft_s": slo.ttft_s, "tbt_s": slo.tbt_s}

        def meets(rate: float, config: str, length: int = length, slo: Slo = slo) -> bool:
            fixed = fixed_length_requests(
                input_tokens=length,
                output_tokens=OUTPUT_TOKENS,
                num_requests=args.throughput_requests,
                cache_ratio=0.5,
                arrivals=ArrivalProcess(rate_per_s=rate),
                seed=args.seed,
                block_size_tokens=args.block_size,
            )
            return _p90_within(_run_config(config, fixed, args, slo, clusters), slo)

        for config in THROUGHPUT_CONFIGS:
            max_rps[config][str(length)], at_cap = _max_rate(lambda rate, c=config: meets(rate, c))
            if at_cap:
                capped.add((config, length))

    # Effective request capacity on the workload: requests within both SLOs, Mooncake vs the stronger
    # coupled baseline (with or without chunked prefill, whichever serves more) on as many GPUs.
    effective: dict[str, dict[str, int]] = {}
    for tbt in args.tbt_thresholds:
        slo = Slo(ttft_s=args.ttft_slo, tbt_s=tbt)
        disaggregated = replay(spec, requests, args, slo=slo)
        coupled = {
            chunked: CoupledCluster(
                simulation.coupled_spec(
                    args, spec.num_prefill + spec.num_decode, chunked=chunked, token_budget=TUNED_TOKEN_BUDGET
                ),
                slo=slo,
            ).run(
                requests, progress=simulation.progress(args, len(requests), f"coupled{', chunked' if chunked else ''}")
            )
            for chunked in (False, True)
        }
        effective[str(tbt)] = {
            "mooncake": round(disaggregated.summary.slo_attainment * len(requests)),
            "coupled": round(coupled[False].summary.slo_attainment * len(requests)),
            "coupled_chunked": round(coupled[True].summary.slo_attainment * len(requests)),
        }

    policies = _policies(args)
    lines = [
        f"long-context: {args.throughput_requests} requests per point, {OUTPUT_TOKENS} output tokens, 50 % cache "
        f"ratio; {simulation.describe(clusters['3P+1D'])}, and 2P+2D alike; Mooncake's policies (both parts): "
        + ", ".join(f"{key} {value}" for key, value in policies.items())
    ]
    lines.append(
        f"{'config':<16}{_cells(_length_label(n) for n in lengths)}   (max req/s within P90 SLOs; prompt tokens, K = 1024)"
    )
    for config in THROUGHPUT_CONFIGS:
        rates = ((n, max_rps[config][str(n)]) for n in lengths)
        lines.append(f"{config:<16}" + _cells(f">={r:.0f}" if (config, n) in capped else f"{r:.4f}" for n, r in rates))
    lines.append(f"{'TTFT SLO (s)':<16}" + _cells(f"{slos[str(n)]['ttft_s']:.1f}" for n in lengths))

    def fastest(configs: tuple[str, ...], length: int) -> tuple[float, bool]:
        """The highest rate of `configs` at `length`, and whether it is the cap (a lower bound)."""
        config = max(configs, key=lambda c: max_rps[c][str(length)])
        return max_rps[config][str(length)], (config, length) in capped

    def gain_cell(length: int) -> str:
        (ours, ours_capped), (vllm, vllm_capped) = fastest(("3P+1D", "2P+2D"), length), fastest(VLLM, length)
        if not vllm or vllm_capped:  # no rate to compare with, or only a lower bound of it
            return "n/a"
        return f"{'>=' if ours_capped else ''}{(ours / vllm - 1) * 100:.0f}%"

    lines.append(f"{'gain vs vLLM':<16}" + _cells(gain_cell(n) for n in lengths))
    if capped:
        cap = max(max_rps[config][str(n)] for config, n in capped)  # every capped cell's, the search's cap
        lines.append(f"(>=: the SLOs held even at the highest rate tried, {cap:g} req/s; n/a: no vLLM rate to compare)")
    lines.append("")
    lines.append(header(args, requests, spec))
    lines.append(
        f"{'TBT SLO':>8}{'mooncake':>10}{'coupled':>9}{'chunked':>9}{'gain':>8}   "
        "(requests within TTFT and TBT SLOs; gain over the stronger coupled)"
    )
    lines += [_effective_line(float(tbt), row) for tbt, row in effective.items()]
    if args.out:
        plot_lines(
            {c: (lengths, [max_rps[c][str(n)] for n in lengths]) for c in THROUGHPUT_CONFIGS},
            args.out / "throughput.png",
            xlabel="prompt tokens",
            ylabel="max req/s within P90 SLOs",
            title="long-context throughput",
            logx=True,
        )
    report: Report = {
        "max_rps": max_rps,
        "slo": slos,
        "effective_requests": effective,
        "policies": policies,
        "clusters": {config: simulation.describe(cluster) for config, cluster in clusters.items()}
        | {"workload": simulation.describe(spec)},
    }
    return report, "\n".join(lines)
