"""Simulator speed: how fast a trace replays through the simulated cluster.

    python benchmarks/replay_speed.py [--json] [--trace PATH] [--repeats 3] [--large-requests 1000000]
        [--large-instances 512]

1. The trace (default: ../shared/traces/synthetic_trace.jsonl, or a generated
   workload of the same size when that default is absent; a `--trace` given
   must exist) on 8 prefill + 8 decode instances, KV-cache-centric routing and
   early rejection, replayed `--repeats` times: `sim_wall_s` is the fastest
   replay (the goal's figure: the machine's noise only ever adds time),
   `sim_wall_s_median` the median,
   `requests_per_s` from the fastest. Goal: under 1 s. The peer in the same run
   is the same replay stepping decode iteration by iteration (`analytic_decode=
   False`), its replays alternating with ours: `stepwise_sim_wall_s` (fastest)
   and `stepwise_sim_wall_s_median`, and `analytic_speedup`, the median over
   the alternating pairs of stepwise / analytic time, is what advancing whole
   stretches buys.
2. `--large-requests` generated requests (synthetic preset) on
   `--large-instances` instances (half prefill, half decode), arriving at the
   per-instance rate of (1), streamed into the replay as they are generated
   (the time spent inside the generator, clocked per request, is subtracted):
   `large_sim_wall_s`, `large_requests_per_s` and the process's peak resident
   memory `peak_rss_gb` (10^9 bytes). The replay's decode-time prediction,
   which it would otherwise take from a list of the whole workload (mean output
   × TBT objective), is computed first, untimed, in a pass over the same
   generated requests, so the replay never holds them all (the generator keeps
   the blocks of shared prefixes and of live sessions only). Goal: under 10
   minutes and 4 GB for 1 M requests on 512 instances. `--large-requests 0`
   skips it.

Interpreter start-up, imports and the first (JIT-loading) replay are outside
the timings: a small warm-up replay runs first. The large replay runs once.

JSON keys: source, num_requests, repeats, sim_wall_s, sim_wall_s_median,
requests_per_s, stepwise_sim_wall_s, stepwise_sim_wall_s_median,
analytic_speedup; with the large replay also large_num_requests,
large_instances, large_generate_s, large_sim_wall_s, large_requests_per_s and
peak_rss_gb. Times in seconds.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from mooncake.errors import TraceFormatError
from mooncake.sched.cost import HARDWARE, MODELS
from mooncake.sched.predictor import uniform_decode_s
from mooncake.sim.disaggregated import replay
from mooncake.sim.spec import ClusterSpec
from mooncake.types import Request, Slo
from mooncake.workload import ArrivalProcess, generate_requests, load_trace, preset

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "synthetic_trace.jsonl"


def spec(num_prefill: int, num_decode: int, **options: object) -> ClusterSpec:
    return ClusterSpec(
        num_prefill=num_prefill,
        num_decode=num_decode,
        model=MODELS["llama3-70b"],
        prefill_hardware=HARDWARE["8xA800"],
        decode_hardware=HARDWARE["8xA800"],
        sample_interval_s=10.0,
        **options,  # type: ignore[arg-type]
    )


def timed(
    cluster: ClusterSpec, requests: Iterable[Request], *, keep_intervals: bool = True, decode_s: float | None = None
) -> float:
    started = time.perf_counter()
    # The KV-cache-centric router, early rejection. Without `decode_s`, replay() lists `requests` to take it.
    replay(cluster, requests, keep_intervals=keep_intervals, decode_s=decode_s)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--trace", type=Path, help=f"a Mooncake-format trace (default: {TRACE.name} in ../shared)")
    parser.add_argument(
        "--requests",
        type=int,
        default=3993,
        help="generated requests when no --trace is given and the default is absent",
    )
    parser.add_argument("--large-requests", type=int, default=1_000_000)
    parser.add_argument("--large-instances", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3, help="replays of the trace, ours alternating with the peer's")
    args = parser.parse_args()
    for option in ("requests", "repeats"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} must be at least 1, got {getattr(args, option)}")
    if args.large_requests < 0:
        parser.error(f"--large-requests must be at least 0 (0: no large replay), got {args.large_requests}")
    # Half prefill, half decode: an odd count was reported as the even one below it while the rate was sized for
    # the count given.
    if args.large_instances < 2 or args.large_instances % 2:
        parser.error(
            f"--large-instances must be an even number >= 2 (half prefill, half decode), got {args.large_instances}"
        )

    # Only the default trace may be absent (a checkout without ../shared): a trace named on the command line that is
    # missing or malformed is the caller's mistake, not a reason to time something else.
    if args.trace is None and not TRACE.exists():
        workload = list(
            generate_requests(preset("synthetic"), num_requests=args.requests, arrivals=ArrivalProcess(rate_per_s=3.9))
        )
        source = f"generated synthetic preset ({args.requests} requests; {TRACE} absent)"
    else:
        trace = args.trace or TRACE
        try:
            workload, source = load_trace(trace), str(trace)
        except TraceFormatError as error:  # it names the file and the line
            parser.error(f"--trace must be a Mooncake-format trace, got {error}")
        except OSError as error:
            parser.error(f"--trace must be a readable trace file, got {trace}: {error.strerror}")
        if not workload:
            parser.error(f"--trace must hold at least one request, got {trace}: none")
    timed(spec(2, 2), workload[:200])  # warm-up: imports, numba kernels
    # Ours and the peer alternate, so that a shared machine's slow moments hit both alike.
    pairs = [
        (timed(spec(8, 8), workload), timed(spec(8, 8, analytic_decode=False), workload)) for _ in range(args.repeats)
    ]
    walls, steps = [p[0] for p in pairs], [p[1] for p in pairs]
    wall, stepped = min(walls), min(steps)
    result: dict[str, object] = {
        "source": source,
        "num_requests": len(workload),
        "repeats": args.repeats,
        "sim_wall_s": wall,  # the fastest replay
        "sim_wall_s_median": statistics.median(walls),
        "requests_per_s": len(workload) / wall,
        "stepwise_sim_wall_s": stepped,
        "stepwise_sim_wall_s_median": statistics.median(steps),
        "analytic_speedup": statistics.median(s / w for w, s in pairs),
    }
    if args.large_requests > 0:
        duration = max(workload[-1].arrival_s - workload[0].arrival_s, 1.0)
        rate = len(workload) / duration / 16 * args.large_instances  # the same load per instance

        def draw(count: int) -> Iterator[Request]:  # the same requests at every call (seed 1)
            return generate_requests(
                preset("synthetic"), num_requests=count, arrivals=ArrivalProcess(rate_per_s=rate), seed=1
            )

        # The replay's t_d, as replay() would take it from the listed workload (the default TBT objective), from a
        # first pass over the same requests, untimed: given it, the replay streams them.
        decode_s = uniform_decode_s((r.output_length for r in draw(args.large_requests)), Slo().tbt_s)

        # The requests are generated as the replay consumes them (a million never sit in memory at once);
        # the time spent inside the generator is clocked as each request is drawn, and subtracted.
        generate_s = 0.0

        def large_workload(count: int) -> Iterator[Request]:
            nonlocal generate_s
            requests = draw(count)
            while True:
                started = time.perf_counter()
                request = next(requests, None)
                generate_s += time.perf_counter() - started
                if request is None:
                    return
                yield request

        half = args.large_instances // 2
        large = large_workload(args.large_requests)
        large_wall = timed(spec(half, half), large, keep_intervals=False, decode_s=decode_s) - generate_s
        result.update(
            {
                "large_num_requests": args.large_requests,
                "large_instances": 2 * half,
                "large_generate_s": generate_s,
                "large_sim_wall_s": large_wall,
                "large_requests_per_s": args.large_requests / large_wall,
                "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,  # KiB on Linux
            }
        )
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return
    print(f"{source}: {len(workload):,} requests on 8P+8D, fastest of {args.repeats} replays (median)")
    print(
        f"  analytic decode   {wall:7.3f} s ({result['sim_wall_s_median']:.3f})  "
        f"{len(workload) / wall:>10,.0f} requests/s   (goal: < 1 s)"
    )
    print(
        f"  step by step      {stepped:7.3f} s ({result['stepwise_sim_wall_s_median']:.3f})  "
        f"{len(workload) / stepped:>10,.0f} requests/s"
    )
    print(f"  analytic_speedup  {result['analytic_speedup']:7.2f}x   (median of paired replays)")
    if "large_sim_wall_s" in result:
        print(
            f"{result['large_num_requests']:,} generated requests on {result['large_instances']} instances "
            f"(their generation, about {result['large_generate_s']:.0f} s, excluded)"
        )
        print(
            f"  simulated in {result['large_sim_wall_s']:.1f} s, {result['large_requests_per_s']:,.0f} requests/s, "
            f"peak RSS {result['peak_rss_gb']:.2f} GB   (goal: < 600 s, < 4 GB)"
        )


if __name__ == "__main__":
    main()
