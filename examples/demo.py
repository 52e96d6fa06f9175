"""A tour of the workload tools: the built-in workload, its statistics, and its cache capacity curve.

(`make demo` is another tour: `examples/experiments.py scheduling`, the workload
replayed through a simulated cluster under each router.)

1. Generate the default workload (the `synthetic` preset, 4,000 requests,
   Poisson arrivals at 4 req/s) as a Mooncake-format trace.
2. Print its statistics (the same as `mooncake trace stats`).
3. Replay it through a cache of growing capacity under each eviction policy
   (prefix-aware, the serving default) and print the prefix hit ratios.
4. Plot hit ratio against capacity.

    python examples/demo.py [--out build/demo] [--preset synthetic] [--num-requests 4000] [--seed 0]

The trace and the plot go to --out as one set (`simulation.output_set`: the
plot last, there only beside the trace of its run); --out and matplotlib are
checked before any work. An error (an option out of range, an --out that is a
file or cannot be written, no matplotlib) is one line on stderr and exit status
2; Ctrl-C exits with 130.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import simulation

from mooncake.cli import (
    POLICIES,
    OneLineParser,
    capacity_sweep,
    error_message,
    folder_path,
    one_line,
    plot_capacity,
    request_count,
    run_interruptible,
)
from mooncake.errors import ConfigError, MooncakeError
from mooncake.sim.report import require_pyplot
from mooncake.workload import (
    DEFAULT_WORKLOAD,
    PRESETS,
    ArrivalProcess,
    generate_requests,
    load_trace,
    preset,
    trace_stats,
    write_trace,
)

CAPACITIES_BLOCKS = [1_000, 2_000, 5_000, 10_000, 20_000, 50_000]
PLOT = "capacity.png"  # the last of the --out set: its marker


def main(argv: list[str] | None = None) -> int:
    """Run the demo: 0, or 2 and one line on stderr for an error, 130 after Ctrl-C, 141 when stdout's reader left
    (`run_interruptible`)."""
    return run_interruptible("demo", lambda: demo(argv))


def demo(argv: list[str] | None) -> int:
    parser = OneLineParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=folder_path, default=Path("build/demo"), help="output folder")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=DEFAULT_WORKLOAD.preset)
    # `mooncake trace generate`'s rule (this tour runs it): 0 to MAX_REQUESTS, an empty workload included.
    parser.add_argument("--num-requests", type=request_count(0), default=DEFAULT_WORKLOAD.num_requests)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        if args.seed < 0:
            raise ConfigError(f"--seed must be >= 0, got {args.seed}")
        require_pyplot()  # the plot comes last: without matplotlib the whole tour would be for nothing
        with simulation.output_set(args.out, (f"{args.preset}.jsonl", PLOT)) as staging:  # --out checked now
            tour(args, staging)
        print(f"\nplot written to {args.out / PLOT}")
    except BrokenPipeError:  # stdout's reader left: run_interruptible ends quietly
        raise
    except (MooncakeError, OSError) as error:
        print(one_line(f"demo: {error_message(error)}"), file=sys.stderr)
        return 2
    return 0


def tour(args: argparse.Namespace, out: Path) -> None:
    """The tour, its files written in the folder `out` (`output_set`'s, put into --out when it ends)."""
    trace = out / f"{args.preset}.jsonl"
    requests = generate_requests(
        preset(args.preset),
        num_requests=args.num_requests,
        arrivals=ArrivalProcess(rate_per_s=DEFAULT_WORKLOAD.rate_per_s),
        seed=args.seed,
    )
    write_trace(trace, requests)
    workload = load_trace(trace)
    stats = trace_stats(workload)
    print(f"== workload: preset '{args.preset}', seed {args.seed} -> {args.out / trace.name}")
    print(
        f"requests {stats.num_requests:,}   mean input {stats.mean_input_length:,.0f} tokens   "
        f"mean output {stats.mean_output_length:,.0f} tokens   max input {stats.max_input_length:,}"
    )
    print(
        f"blocks {stats.num_blocks:,} ({stats.num_unique_blocks:,} unique)   "
        f"prefix reuse ratio {stats.prefix_reuse_ratio:.4f}   {stats.mean_rate_per_s:.2f} req/s over {stats.duration_s:,.0f} s"
    )

    print("\n== prefix hit ratio against cache capacity (prefix-aware eviction)")
    print(f"{'policy':<14}" + "".join(f"{c:>10,}" for c in CAPACITIES_BLOCKS) + "   seconds")
    keys = [request.block_keys for request in workload]
    curves = {}
    for name in POLICIES:
        start = time.perf_counter()
        points = capacity_sweep(
            keys, name, prefix_aware=True, capacities_blocks=CAPACITIES_BLOCKS, jobs=os.cpu_count() or 1
        )
        curves[name] = points
        row = "".join(f"{p.hit_ratio:>10.4f}" for p in points)
        print(f"{name:<14}{row}   {time.perf_counter() - start:7.2f}")
    print(f"{'(infinite)':<14}" + f"{stats.prefix_reuse_ratio:>10.4f}" * len(CAPACITIES_BLOCKS))

    plot_capacity(curves, out / PLOT, title=f"{args.preset} workload, {stats.num_requests:,} requests")


if __name__ == "__main__":
    sys.exit(main())
