"""Replay a workload through a simulated cluster running the real Conductor.

    python examples/replay.py --trace ../shared/traces/synthetic_trace.jsonl --prefill 8 --decode 8
    python examples/replay.py --preset conversation --router load_balancing --json
    python examples/replay.py --preset synthetic --engine coupled-chunked --decode 8 --out build/replay

`--engine disaggregated` (default) is Mooncake: prefill and decode pools, the
Conductor's router and admission policy, KV caches per prefill node.
`--engine coupled` / `coupled-chunked` is the vLLM-style baseline on
`--prefill + --decode` instances (chunked prefill with the second).

`--config CLUSTER.toml` simulates the example cluster that config describes
instead (`simulation.config_spec`): its nodes, block size, caches, policies and
SLOs, its own Conductor, and as the engines' truth the cost models that
Conductor uses, the profile `examples/profile_engine.py` fitted to the real
engines when the config (or `--profile FILE`) names one. The workload is scaled
as `examples/load.py` sends it to the real cluster (`examples/scaling.py`:
`--length-scale`, `--output-scale`, `--max-prompt-tokens`,
`--max-output-tokens`), tokenized by the cluster's tokenizer and keyed by its
hasher, so both see the same blocks; the cluster options and `--router`,
`--admission`, `--threshold`, `--ttft-slo`, `--tbt-slo` are then the config's.
Without `--config` nothing is scaled, and the scaling options are refused.

Prints a summary table (or, with --json, the summary as JSON). With --out DIR it
writes requests.csv (one row per request), summary.json, ttft_cdf.png,
tbt_cdf.png and load.png (prefill and decode load over time), as one set
(`simulation.output_set`: summary.json last, there only beside the rest of its
run); DIR and matplotlib are checked before the run. Should the files still
fail to be written after it, the summary is printed all the same, then the
error, with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path

import attrs
import simulation
from paper.common import policy_conductor
from scaling import Scaling, add_scaling_options, scaling_of

from mooncake.cli import OneLineParser, error_message, file_path, folder_path, one_line, run_interruptible
from mooncake.errors import ConfigError, MooncakeError
from mooncake.sched.outcome import Outcome
from mooncake.sim.coupled import CoupledCluster
from mooncake.sim.disaggregated import DisaggregatedCluster
from mooncake.sim.metrics import ReplayResult, has_tbt
from mooncake.sim.report import plot_cdfs, plot_load, require_pyplot, summary_table, write_json, write_records_csv

ENGINES = ("disaggregated", "coupled", "coupled-chunked")
# The --out set (`write_outputs`), its marker last.
OUT_FILES = ("requests.csv", "ttft_cdf.png", "tbt_cdf.png", "load.png", "summary.json")


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__.split("\n")[0])  # an error is one line
    simulation.add_workload_options(p)
    simulation.add_cluster_options(p)
    simulation.add_policy_options(p)
    p.add_argument("--engine", choices=ENGINES, default="disaggregated")
    p.add_argument("--config", type=file_path, help="simulate this example cluster config (its shape, policies, SLOs)")
    p.add_argument(
        "--profile",
        type=file_path,
        help="with --config: the fitted cost models (the config's [prefill] profile)",
    )
    add_scaling_options(p)
    p.add_argument("--out", type=folder_path, help="write requests.csv, summary.json and plots here")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    return p


COUPLED_UNUSED = (
    "router",
    "admission",
    "threshold",
    "predictor",
    "cache_blocks",
    "global_pool",
    "cpp",
    "inline_prefill",
    "admission_wait",
)
SCALING = tuple(attrs.fields_dict(Scaling))  # the options of add_scaling_options, by dest
CONFIG_UNUSED = ("prefill", "decode", "model", "hardware", "ttft_slo", "tbt_slo", *COUPLED_UNUSED)


def run(args: argparse.Namespace, given: Mapping[str, str]) -> tuple[ReplayResult, str]:
    """The replay the options describe: (its result, a title naming the cluster and policies).

    Args:
        given: the options the command line gave (`simulation.given_options`): one the run would not use is
            refused even at its default value.
    """
    if args.config is not None:
        simulation.refuse_unused(parser(), args, CONFIG_UNUSED, "with --config (the config sets it)", given=given)
        return run_config(args)
    if args.engine != "disaggregated":
        simulation.refuse_unused(parser(), args, COUPLED_UNUSED, f"to --engine {args.engine}", given=given)
    simulation.refuse_unpredicted(parser(), args, given=given)
    simulation.refuse_unthresholded(parser(), args, given=given)
    if args.profile is not None:
        raise ConfigError("--profile needs --config (the cluster whose engines it was fitted to)")
    why = "without --config (it scales a workload to the example cluster)"
    simulation.refuse_unused(parser(), args, SCALING, why, given=given)
    requests, spec = simulation.sized_cluster(args)  # sized at speed 1: --speedup loads it
    progress = simulation.progress(args, len(requests), f"replay ({args.engine})")
    if args.engine == "disaggregated":
        conductor = policy_conductor(spec, requests, args, simulation.slo(args))  # the experiments' Conductor
        result = DisaggregatedCluster(spec, conductor).run(requests, progress=progress)
        return result, f"{simulation.describe(spec)}; router {args.router}, admission {args.admission}"
    instances = spec.num_prefill + spec.num_decode
    coupled = simulation.coupled_spec(args, instances, chunked=args.engine == "coupled-chunked")
    result = CoupledCluster(coupled, slo=simulation.slo(args)).run(requests, progress=progress)
    return result, f"{coupled.num_instances} coupled {args.model} instances on {args.hardware} ({args.engine})"


def run_config(args: argparse.Namespace) -> tuple[ReplayResult, str]:
    """The workload through the simulated twin of the example cluster `--config` describes."""
    from serving.config import load_config
    from serving.machine import Machine

    if args.engine != "disaggregated":
        raise ConfigError(f"--config simulates the disaggregated example cluster, not --engine {args.engine}")
    config = load_config(args.config, machine=Machine())  # simulated: it need not fit this machine
    if args.profile is not None:
        simulation.check_profile(args.profile)  # named by its option, not blamed on the config's [prefill] profile
        config = config.with_overrides("prefill", profile=str(args.profile))
    spec = simulation.config_spec(config)
    conductor = simulation.config_conductor(config, spec)
    requests = simulation.cluster_requests(config, simulation.load_workload(args), scaling_of(args))
    progress = simulation.progress(args, len(requests), "replay (--config)")
    result = DisaggregatedCluster(spec, conductor).run(requests, progress=progress)
    policy = config.policy
    profile = config.prefill.profile or "analytic CPU cost models"
    title = (
        f"{args.config}: {simulation.describe(spec)}; router {policy.router}, admission {policy.admission}; {profile}"
    )
    return result, title


def print_results(result: ReplayResult, title: str, *, as_json: bool) -> None:
    """The summary on stdout: a table under `title`, or with `as_json` the summary as JSON."""
    s = result.summary
    if as_json:
        print(json.dumps(s.to_json(), indent=2, sort_keys=True))
        return
    print(title)
    print("\n".join(summary_table(s)))
    print(
        f"SLO attainment {s.slo_attainment:.3f}   goodput {s.goodput_rps:.3f} req/s   "
        f"cache hit ratio {s.cache_hit_ratio:.3f}   mean prefill {s.mean_prefill_s:.3f} s   "
        f"simulated in {s.sim_wall_s:.2f} s"
    )


def write_outputs(result: ReplayResult, title: str, out: Path) -> None:
    """The --out set (`OUT_FILES`) into the folder `out`."""
    write_records_csv(result.records, out / "requests.csv")
    write_json(result.summary.to_json(), out / "summary.json")
    completed = [r for r in result.records if r.outcome == Outcome.COMPLETED]
    plot_cdfs({"TTFT": [r.ttft_s or 0.0 for r in completed]}, out / "ttft_cdf.png", xlabel="TTFT (s)", title=title)
    paced = [r.tbt_s * 1000 for r in completed if has_tbt(r)]  # as the summary's TBT: one token has no pace
    plot_cdfs({"TBT": paced}, out / "tbt_cdf.png", xlabel="TBT (ms)", title=title)
    plot_load({title: result.load}, out / "load.png")


def main(argv: list[str] | None = None) -> int:
    """Run the command line: 0, 2 and one line on stderr for an error, 130 after Ctrl-C (`run_interruptible`)."""
    return run_interruptible("replay", lambda: replay(argv))


def replay(argv: list[str] | None) -> int:
    args = parser().parse_args(argv)
    done: tuple[ReplayResult, str] | None = None
    try:
        given = simulation.given_options(parser, argv)
        if args.out is None:
            done = run(args, given)
        else:
            # The plots are drawn after the run: without matplotlib it would be lost, so that is found now.
            require_pyplot()
            with simulation.output_set(args.out, OUT_FILES) as staging:  # --out checked before the run
                done = run(args, given)
                write_outputs(*done, staging)
    except (MooncakeError, OSError) as error:
        if done is not None:  # the run is done and its files could not be written: its summary is not lost
            print_results(*done, as_json=args.json)
        print(one_line(f"replay: {error_message(error)}"), file=sys.stderr)
        return 2
    print_results(*done, as_json=args.json)
    if args.out is not None and not args.json:
        print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
