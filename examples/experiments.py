"""The paper's experiments on the simulated cluster, one subcommand each (table + JSON + plot).

    python examples/experiments.py scheduling  [--trace PATH | --preset NAME]   # FAST'25 Fig. 5
    python examples/experiments.py rejection   --speedup 2                      # arXiv Table 3, Fig. 9
    python examples/experiments.py cache                                        # FAST'25 Fig. 10
    python examples/experiments.py throughput                                   # arXiv Fig. 12; FAST'25 Figs. 6-7
    python examples/experiments.py threshold | overload | predictors

Every subcommand takes the workload and cluster options of replay.py, writes
<out>/<name>.json and its plots (`PLOTS`; default out: build/experiments) as one
set (`simulation.output_set`: the JSON last, there only beside the rest of its
run; --no-plots removes an older run's plots of the subcommand) and prints its
table; --json prints the JSON instead. --out and matplotlib are checked before
the run; should the files still fail to be written after it, the table is
printed all the same, then the error, with status 2. Nothing is tuned toward the paper's
numbers: clusters are sized by fixed rules (see simulation.py) before any run.
The experiments themselves live in `paper/`, a module each.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import simulation
from paper.cache import cache
from paper.common import Report
from paper.overload import DECODE_BOUND_TBT_SLO_S, overload, rejection
from paper.predictors import predictors
from paper.scheduling import scheduling
from paper.threshold import threshold
from paper.throughput import throughput
from serving.registry import ROUTERS

from mooncake.cli import (
    OneLineParser,
    comma_separated,
    error_message,
    folder_path,
    one_line,
    request_count,
    run_interruptible,
)
from mooncake.errors import MooncakeError
from mooncake.sched.router import is_threshold
from mooncake.sim.report import json_safe, require_pyplot, write_json
from mooncake.workload.trace_record import MAX_ARRIVAL_S

PAPER_ROUTERS = ("random", "load_balancing", "local_cache_aware", "kvcache_centric")  # the paper's Fig. 5

EXPERIMENTS: dict[str, Callable[[argparse.Namespace], tuple[Report, str]]] = {
    "scheduling": scheduling,
    "rejection": rejection,
    "cache": cache,
    "throughput": throughput,
    "threshold": threshold,
    "overload": overload,
    "predictors": predictors,
}


# The plots each experiment can draw (paper/), by file name: with its JSON, the set it writes to --out.
PLOTS: dict[str, tuple[str, ...]] = {
    "scheduling": ("scheduling_ttft_cdf.png", "scheduling_load.png"),
    "rejection": ("rejection_load.png",),
    "cache": ("cache_hit_ratio.png",),
    "throughput": ("throughput.png",),
    "threshold": ("threshold.png",),
    "overload": ("overload_rejected.png", "overload_wasted_prefill_s.png", "overload_oscillation.png"),
    "predictors": ("predictors.png",),
}


def _threshold(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not is_threshold(value):
        raise argparse.ArgumentTypeError(f"must be a number >= 1 (inf: never transfer), got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__.split("\n")[0])  # its subcommands' too: an error is one line
    sub = p.add_subparsers(dest="experiment", required=True)
    for name, function in EXPERIMENTS.items():
        q = sub.add_parser(name, help=(function.__doc__ or "").split("\n")[0])
        simulation.add_workload_options(q)
        simulation.add_cluster_options(q)
        simulation.add_policy_options(q)
        q.add_argument("--out", type=folder_path, default=Path("build/experiments"), help="JSON and plots go here")
        q.add_argument("--no-plots", action="store_true")
        q.add_argument("--json", action="store_true", help="print the JSON instead of the table")
        if name == "scheduling":
            q.add_argument(
                "--routers",
                type=comma_separated(simulation.router_name),  # each resolved now, before any replay
                default=list(PAPER_ROUTERS),
                help=f"comma-separated, of {', '.join(ROUTERS)}; FILE.py:FACTORY too",
            )
        if name in ("rejection", "overload"):
            q.set_defaults(tbt_slo=DECODE_BOUND_TBT_SLO_S)  # the decode-bound regime (paper/overload.py)
        if name == "rejection":
            q.set_defaults(speedup=2.0)
        if name == "throughput":
            # A highest rate within the SLOs, against coupled instances that admit everything: Mooncake admits
            # everything too, unless --admission says otherwise (a rejection counts as a miss of both SLOs).
            q.set_defaults(admission="baseline")
        if name == "cache":
            q.add_argument(
                "--capacities",
                type=comma_separated(simulation.number(int, least=0)),
                help="blocks per node, comma-separated",
            )
            q.add_argument(
                "--nodes",
                type=comma_separated(simulation.number(int, least=1, most=simulation.MAX_NODES)),
                help="prefill node counts, comma-separated",
            )
        if name == "throughput":
            q.add_argument(
                "--lengths",
                type=comma_separated(simulation.number(int, least=1)),
                help="prompt lengths, comma-separated",
            )
            q.add_argument(
                "--throughput-requests",
                type=request_count(1),
                default=300,
                help=f"requests per rate tried (at most {simulation.MAX_REQUESTS:,})",
            )
            q.add_argument(
                "--ttft-slo-factor",
                type=simulation.number(float, least=0),
                default=10.0,
                help="TTFT SLO = factor x a lone request's (0: --ttft-slo for every length)",
            )
            q.add_argument(
                "--tbt-thresholds", type=comma_separated(simulation.number(float, above=0)), default=[0.1, 0.2, 0.3]
            )
        if name == "threshold":
            q.add_argument("--thresholds", type=comma_separated(_threshold))
        if name == "overload":
            q.add_argument("--speedups", type=comma_separated(simulation.number(float, above=0)))
        if name == "predictors":
            q.add_argument(
                "--horizons",
                # a snapshot is settled this far past its time: no later than the latest arrival a replay times
                type=comma_separated(simulation.number(float, least=0, most=MAX_ARRIVAL_S)),
                help=f"seconds ahead each prediction is scored, comma-separated (at most {MAX_ARRIVAL_S:.4g}: 2**43 ms)",
            )
            q.add_argument(
                "--sample-every", type=simulation.number(float, above=0), default=5.0, help="seconds between snapshots"
            )
    return p


# Options an experiment sets itself (it compares or sweeps them): given anyway, even at their default values, they
# are an error, not ignored.
UNUSED: dict[str, tuple[tuple[tuple[str, ...], str], ...]] = {
    "scheduling": ((("router",), "to scheduling: it compares --routers"),),
    "rejection": ((("admission",), "to rejection: it compares every admission policy"),),
    "overload": (
        (("admission",), "to overload: it compares every admission policy"),
        (("speedup",), "to overload: it replays at each of --speedups"),
    ),
    "threshold": ((("router", "threshold"), "to threshold: it replays kvcache_centric at each of --thresholds"),),
    "cache": (
        (("cache_blocks",), "to cache: it replays each of --capacities"),
        (("global_pool",), "to cache: it replays both the global pool and local caches"),
    ),
}


def _subparser(name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]  # type: ignore[no-any-return]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line: 0, 2 and one line on stderr for an error, 130 after Ctrl-C (`run_interruptible`)."""
    return run_interruptible("experiments", lambda: experiment(argv))


def experiment(argv: Sequence[str] | None) -> int:
    args = parser().parse_args(argv)
    name, out_dir = args.experiment, args.out
    started = time.perf_counter()
    done: tuple[Report, str] | None = None
    try:
        if not args.no_plots:
            # The plots are drawn after every replay, and before the JSON is written: without matplotlib a run
            # would be lost whole, so its absence is found now, by the check (and message) the plots would meet.
            require_pyplot()
        given = simulation.given_options(parser, argv)
        for dests, why in UNUSED.get(name, ()):
            simulation.refuse_unused(_subparser(name), args, dests, why, given=given)
        simulation.refuse_unthresholded(_subparser(name), args, given=given)
        # rejection and overload run every admission policy, predictive too; predictors scores --predictor itself
        if name not in ("rejection", "overload", "predictors"):
            simulation.refuse_unpredicted(_subparser(name), args, given=given)
        with simulation.output_set(out_dir, (*PLOTS[name], f"{name}.json")) as staging:  # --out checked now
            args.out = None if args.no_plots else staging  # where the experiment draws its plots
            report, table = EXPERIMENTS[name](args)
            report["wall_s"] = time.perf_counter() - started
            done = report, table
            write_json(report, staging / f"{name}.json")
    except (MooncakeError, OSError) as error:
        if done is not None:  # the run is done and its files could not be written: its results are not lost
            print_results(*done, as_json=args.json)
        print(one_line(f"experiments: {error_message(error)}"), file=sys.stderr)
        return 2
    print_results(report, table, as_json=args.json)
    if not args.json:
        print(f"\n{name}: {report['wall_s']:.1f} s; JSON{'' if args.no_plots else ' and plots'} in {out_dir}")
    return 0


def print_results(report: Report, table: str, *, as_json: bool) -> None:
    """An experiment's results on stdout: its table, or with `as_json` its report as JSON."""
    print(json.dumps(json_safe(report), indent=2, sort_keys=True, allow_nan=False) if as_json else table)


if __name__ == "__main__":
    sys.exit(main())
