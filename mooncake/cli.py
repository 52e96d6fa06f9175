"""The `mooncake` command line.

    mooncake trace stats PATH [--json] [--block-size N] [--time-unit ms|s|us] [--skip-invalid] [--sort]
    mooncake trace generate --preset NAME --num-requests N --out PATH [--rate R] [--cv C] [--seed S]
    mooncake trace capacity PATH --policy lru --capacity-blocks 1000,10000,50000 [--prefix-aware] [--json]
                            [--plot out.png] [--no-progress] [--skip-invalid] [--sort]
    mooncake trace convert IN OUT [--to mooncake|aiperf] [--skip-invalid] [--sort]

Traces may be plain or gzip (`.jsonl.gz`), in the Mooncake form or aiperf's
(see `mooncake.workload.trace`); an output whose name ends in `.gz` is
compressed. An output of `-` is stdout; there, as into a FIFO or /dev/stdout,
the trace is written as it goes, and the line saying what was written goes to
stderr. An output that is a symbolic link stays one: the file it leads to is
replaced. Errors in the input print one line naming the problem and exit
with status 2, nothing written: a malformed trace line (`file:line: reason`), a
file that cannot be read or written (`file: reason`), an option out of its range
(`argument --seed: ...`; `--rate` and `--cv` lie in `ARRIVAL_RANGE`, [1e-6, 1e6], `--plot` names
an image: .png, .pdf, .svg, ...). No input makes it print a traceback.
With `--skip-invalid` a malformed line is left out instead and named on stderr,
except that a line which the 10 lines after it all arrive before is an error
naming it (its timestamp is likely wrong: skipping on would lose the rest).
With `--sort` a trace slightly out of order (logs merged with jitter) is read
whole and its lines sorted by timestamp first (`convert --sort` writes a sorted
copy); lines are still named by their place in the file, and a trace with
sessions or a line without a timestamp is refused, naming the line.
`--time-unit` says what a trace's timestamps count (ms, the Mooncake format's,
by default; `s` for Alibaba's Qwen-Bailian traces); a millisecond trace with
fractions of a millisecond gets one `PROG: warning: ...` line on stderr saying so.
Ctrl-C ends a command with status 130 and one line on stderr; SIGTERM with
status 143, SIGHUP (its terminal or ssh session closed) with 129 and SIGQUIT
(Ctrl-\\) with 131, silently. Either way an output being written is left as it
was, no temporary file behind. A signal the command was started ignoring
(`nohup`'s SIGHUP) stays ignored. Output piped into a reader that exits early
(`| head`) ends the command quietly with status 141, as SIGPIPE would.
A capacity sweep draws a progress bar on stderr when stdout and stderr are both
terminals (not when the output is piped or redirected) unless `--no-progress`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import io
import json
import math
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import attrs

from mooncake._checks import range_problem, shown
from mooncake._files import names_a_file
from mooncake.cache.capacity import CapacityPoint, simulate_prefix_hits
from mooncake.cache.policy import EvictionPolicy, LengthAwarePolicy, LfuPolicy, LruPolicy, SievePolicy
from mooncake.errors import ConfigError, MooncakeError
from mooncake.sim.report import ProgressBar, plot_lines, require_pyplot, shows_progress
from mooncake.types import BlockKey
from mooncake.workload import (
    ARRIVAL_RANGE,
    DEFAULT_WORKLOAD,
    PRESETS,
    TIME_UNITS,
    TRACE_BLOCK_SIZE_TOKENS,
    TRACE_FORMS,
    ArrivalProcess,
    Request,
    SkippedLine,
    TimeUnit,
    generate_requests,
    iter_trace,
    preset,
    trace_stats,
    write_trace,
)

__all__ = [
    "MAX_REQUESTS",
    "OneLineParser",
    "PLOT_FORMATS",
    "POLICIES",
    "capacity_sweep",
    "comma_separated",
    "error_message",
    "file_path",
    "folder_path",
    "integer",
    "main",
    "one_line",
    "plot_capacity",
    "port",
    "read_trace",
    "request_count",
    "run_interruptible",
]

POLICIES: dict[str, Callable[..., EvictionPolicy]] = {
    "lru": LruPolicy,
    "lfu": LfuPolicy,
    "length_aware": LengthAwarePolicy,
    "sieve": SievePolicy,
}
"""Eviction policies by command-line name."""


T = TypeVar("T")

MAX_REQUESTS = 10**6
"""The most requests a command generates or replays (`trace generate --num-requests`, the demo's, the simulation
examples' --num-requests and experiments.py's --throughput-requests): the generator makes about 3,000 a second
(fixed-length long prompts 6,000), so this many take it about five minutes, and a replay longer; past it a count is
a slip (an extra zero or three), which spun in the generator for hours, or past sys.maxsize failed in a traceback."""

PLOT_FORMATS = ("eps", "jpeg", "jpg", "pdf", "png", "ps", "svg", "svgz", "tif", "tiff", "webp")
"""Suffixes `--plot` accepts: the image formats matplotlib writes with its own backends and Pillow."""


def integer(minimum: int, *, most: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer >= `minimum` (and <= `most`, if given)."""
    bound = f">= {minimum}" if most is None else f">= {minimum} and <= {most}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # also beyond Python's 4300 digits: the rule in full, as for a value out of range
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {shown(text)}") from None
        if value < minimum or (most is not None and value > most):
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {shown(text)}")
        return value

    return parse


_MAX_PORT = 65_535


def port(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535. A server's `--port` is refused as the option's:
    checked as its config file's port, the error would name the file, which says something else.

    Raises:
        argparse.ArgumentTypeError: not an integer in that range.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not an integer") from None
    if not 0 <= value <= _MAX_PORT:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0 to {_MAX_PORT})")
    return value


def request_count(least: int) -> Callable[[str], int]:
    """An argparse type: a number of requests, an integer in [`least`, `MAX_REQUESTS`]: every --num-requests's rule,
    refused by its option before anything runs. `least` is 0 where an empty workload is one (`trace generate` writes
    an empty trace, a fixture for tools that read traces), 1 where the requests are replayed (a replay of nothing
    has no figures to show)."""
    return integer(least, most=MAX_REQUESTS)


def _ranged(text: str) -> float:
    """An argparse type: a number within `ARRIVAL_RANGE` (what `ArrivalProcess` accepts)."""
    low, high = ARRIVAL_RANGE
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {shown(text)}") from None
    if (problem := range_problem(value, low, high)) is not None:  # as examples/simulation.py words --rate's
        raise argparse.ArgumentTypeError(f"{problem}, got {shown(text)}")
    return value


def _path_text(text: str, kind: str) -> str:
    """`text` as a path that names something (open() refuses NUL, and "" names nothing; Path("") is "."), else an
    argparse error expecting `kind`."""
    if not text or "\0" in text:
        raise argparse.ArgumentTypeError(f"expected {kind}, got {shown(text)}")
    return text


def _input_path(text: str) -> str:
    """An argparse type: a path to read."""
    return _path_text(text, "a file name")


def file_path(text: str) -> Path:
    """An argparse type: a file to read (an example's --trace, --config, --profile). "" is refused, as NUL is:
    Path("") is the current folder, whose read failed as `.: Is a directory`, naming neither option nor value."""
    return Path(_input_path(text))


def folder_path(text: str) -> Path:
    """An argparse type: an output folder (an example's `--out`). "" is refused (Path("") is the current folder,
    where a set would be written unasked), as NUL is; "." is a folder and is taken."""
    return Path(_path_text(text, "a folder name"))


def _output_path(text: str) -> str:
    """An argparse type: a file to write, which needs a name (not "", "." or "..")."""
    _input_path(text)
    if not names_a_file(text):
        raise argparse.ArgumentTypeError(f"expected a file name, got {shown(text)}")
    return text


def _plot_path(text: str) -> str:
    """An argparse type: an image file name, by suffix (checked before a sweep, not after it)."""
    _output_path(text)
    suffix = Path(text).suffix.lower().lstrip(".")
    if suffix not in PLOT_FORMATS:
        raise argparse.ArgumentTypeError(
            f"expected an image file name ending in .{', .'.join(PLOT_FORMATS)}, got {shown(text)}"
        )
    return text


def one_line(text: str) -> str:
    """`text` with every character that is not printable (a line break, a tab, U+2028) escaped as Python writes
    it: a message naming a file whose name holds one stays on one line, as every command line's errors promise."""
    return text if text.isprintable() else "".join(char if char.isprintable() else ascii(char)[1:-1] for char in text)


def comma_separated(kind: Callable[[str], T], *, noun: str = "") -> Callable[[str], list[T]]:
    """An argparse type: a comma-separated list of `kind` (an argparse type, which refuses a bad item), each
    value once, refusing an empty item (`1,,2`, `100,`) rather than skipping it. Every command line's lists are
    read by this one rule.

    A value given twice is refused, named (as `NOUN VALUE`): outputs are keyed by value, so a repeat would be a
    row of a table and no key of its JSON.
    """

    def parse(text: str) -> list[T]:
        parts = text.split(",")
        if not all(parts):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list with no empty item, got {shown(text)}")
        values = [kind(part) for part in parts]
        seen: set[T] = set()
        for value in values:
            if value in seen:
                named = f"{noun} {shown(value)}" if noun else repr(value)
                raise argparse.ArgumentTypeError(f"{named} is given twice in {shown(text)}")
            seen.add(value)
        return values

    return parse


def plot_capacity(curves: dict[str, Sequence[CapacityPoint]], path: str | Path, *, title: str = "") -> None:
    """Write a hit-ratio-against-capacity plot, one line per curve (needs matplotlib)."""
    lines = {
        label: ([p.capacity_blocks for p in points], [p.hit_ratio for p in points]) for label, points in curves.items()
    }
    plot_lines(
        lines,
        path,
        xlabel="cache capacity (blocks)",
        ylabel="prefix hit ratio",
        title=title,
        logx=True,
        ylim=(0, 1),
        legend=True,
    )


def _check_plot(path: str) -> None:
    """The plot can be written: matplotlib is installed (`require_pyplot`, every command's check) and the folder
    exists."""
    try:
        require_pyplot()
    except ConfigError as error:
        raise ConfigError(f"--plot: {error}") from error
    folder = Path(path).parent
    if not folder.is_dir():
        raise ConfigError(f"--plot {path}: there is no folder {folder}")


def read_trace(
    path: str | os.PathLike[str],
    *,
    block_size_tokens: int = TRACE_BLOCK_SIZE_TOKENS,
    speedup: float = 1.0,
    skip_invalid: bool = False,
    prog: str = "mooncake",
    time_unit: TimeUnit = "ms",
    sort: bool = False,
) -> Iterator[Request]:
    """A trace as the command lines read it (`--block-size`, `--skip-invalid`, `--time-unit`, `--sort`): `iter_trace`,
    strict, or with `skip_invalid` each malformed line left out and named on stderr as `PROG: skipped FILE:LINE:
    reason`; its caution about the time unit as `PROG: warning: ...`.

    Raises:
        TraceFormatError: at the first malformed line unless `skip_invalid`, at a broken gzip stream, and with
            `skip_invalid` at a line the 10 lines after it all arrive before (see `iter_trace`); with `sort`, at a line
            that names a session or has no timestamp.
        ConfigError: for invalid options.
    """

    def report(skipped: SkippedLine) -> None:
        print(one_line(f"{prog}: skipped {skipped}"), file=sys.stderr)

    def caution(message: str) -> None:
        print(one_line(f"{prog}: warning: {message}"), file=sys.stderr)

    return iter_trace(
        path,
        block_size_tokens=block_size_tokens,
        speedup=speedup,
        strict=not skip_invalid,
        on_skip=report,
        time_unit=time_unit,
        on_caution=caution,
        sort=sort,
    )


def _read(args: argparse.Namespace, path: str) -> Iterator[Request]:
    """The trace at `path` with the command's block size and time unit, strict unless --skip-invalid, sorted with
    --sort."""
    return read_trace(
        path,
        block_size_tokens=args.block_size,
        skip_invalid=args.skip_invalid,
        time_unit=args.time_unit,
        sort=args.sort,
    )


def _stats(args: argparse.Namespace) -> None:
    stats = trace_stats(_read(args, args.path))
    if args.json:
        print(json.dumps(attrs.asdict(stats), indent=2))
        return
    print(f"trace                {args.path}")
    print(f"requests             {stats.num_requests:,}")
    print(f"mean input tokens    {stats.mean_input_length:,.1f}")
    print(f"mean output tokens   {stats.mean_output_length:,.1f}")
    print(f"max input tokens     {stats.max_input_length:,}")
    print(f"blocks (unique)      {stats.num_blocks:,} ({stats.num_unique_blocks:,})")
    print(f"prefix reuse ratio   {stats.prefix_reuse_ratio:.4f}")
    print(f"duration             {_figures(stats.duration_s)} s ({_figures(stats.mean_rate_per_s)} req/s)")


def _figures(value: float) -> str:
    """`value` to three significant figures at least (a 10 ms trace's 0.0100 s, not 0.0, beside its 100.0 req/s;
    an hour-long trace's 0.00413 req/s, not 0.00), to a tenth past 100 (1,800.0), never in exponent form."""
    decimals = 1 if value <= 0 else max(1, 2 - math.floor(math.log10(value)))
    return f"{value:,.{decimals}f}"


def _generate(args: argparse.Namespace) -> None:
    spec = attrs.evolve(preset(args.preset), block_size_tokens=args.block_size)
    requests = generate_requests(
        spec, num_requests=args.num_requests, arrivals=ArrivalProcess(rate_per_s=args.rate, cv=args.cv), seed=args.seed
    )
    count = write_trace(_destination(args.out), requests, block_size_tokens=args.block_size)
    _wrote(args.out, f"wrote {count:,} requests ({args.preset}, seed {args.seed}) to {args.out}")


def _destination(text: str) -> str:
    """The path an output option names: `-` is stdout, by its name /dev/stdout (written as it goes)."""
    return "/dev/stdout" if text == "-" else text


def _wrote(text: str, message: str) -> None:
    """Say what a command wrote to output `text`: on stderr when that is stdout (`-`, /dev/stdout, or the file
    stdout is redirected to), where the line would otherwise end up inside the trace."""
    try:
        is_stdout = os.path.samestat(os.stat(_destination(text)), os.fstat(sys.stdout.fileno()))
    except (OSError, ValueError):  # gone since, or stdout has no descriptor (replaced, closed): not the same
        is_stdout = False
    print(message, file=sys.stderr if is_stdout else sys.stdout)


# The workload of a parallel capacity sweep: forked workers inherit it instead of unpickling it.
_SWEEP: tuple[list[tuple[BlockKey, ...]], str, bool] | None = None


def _sweep_point(capacity: int) -> CapacityPoint:
    assert _SWEEP is not None
    keys, policy, prefix_aware = _SWEEP
    return simulate_prefix_hits(keys, POLICIES[policy](prefix_aware=prefix_aware), capacity_blocks=capacity)


def capacity_sweep(
    keys: list[tuple[BlockKey, ...]],
    policy: str,
    *,
    prefix_aware: bool,
    capacities_blocks: Sequence[int],
    jobs: int,
    progress: Callable[[int], object] | None = None,
) -> tuple[CapacityPoint, ...]:
    """`hit_ratio_curve` with one forked worker process per capacity, `jobs` at a time.

    Capacities are independent replays, so a sweep parallelises perfectly;
    with one job (or one capacity, or no fork) it runs in this process.
    `progress` is told how many capacities are done each time one finishes.
    Stopped (Ctrl-C, SIGTERM, a worker's error), it kills the workers at
    once instead of waiting for the capacities they are replaying.
    """
    global _SWEEP
    if jobs <= 1 or len(capacities_blocks) <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        make = POLICIES[policy]
        points: list[CapacityPoint] = []
        for capacity in capacities_blocks:  # hit_ratio_curve, a point at a time for the progress
            points.append(simulate_prefix_hits(keys, make(prefix_aware=prefix_aware), capacity_blocks=capacity))
            if progress is not None:
                progress(len(points))
        return tuple(points)
    _SWEEP = (keys, policy, prefix_aware)
    try:
        context = multiprocessing.get_context("fork")
        # A stop signal taken while the first submit forks the workers can land in an at-fork callback (logging's
        # lock release), where Python prints its SystemExit or KeyboardInterrupt as "Exception ignored" and goes
        # on: held back until the workers are up, it lands in this loop instead. The workers start unblocked.
        unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, {*STOP_SIGNALS, signal.SIGINT})
        pool = concurrent.futures.ProcessPoolExecutor(
            min(jobs, len(capacities_blocks)),
            mp_context=context,
            initializer=signal.pthread_sigmask,
            initargs=(signal.SIG_SETMASK, unblocked),
        )
        try:  # from the first submit, which forks the workers
            try:
                futures = [pool.submit(_sweep_point, capacity) for capacity in capacities_blocks]
                _KILL_ON_STOP[:] = list((getattr(pool, "_processes", None) or {}).values())
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
            for done, _ in enumerate(concurrent.futures.as_completed(futures), start=1):
                if progress is not None:
                    progress(done)
            points = [future.result() for future in futures]
        except BaseException:  # Ctrl-C, SIGTERM, a worker's error: stop now, the capacities running too
            # shutdown() alone waits for the running capacities, minutes each on a big trace. The workers hold
            # nothing to clean up, so they are killed first; not terminated: a forked worker inherits the handler
            # that makes SIGTERM a SystemExit, which the executor's worker loop catches (and may print a traceback
            # for). The executor names its workers only privately before Python 3.14's kill_workers().
            for process in list((getattr(pool, "_processes", None) or {}).values()):
                process.kill()
            pool.shutdown(wait=False, cancel_futures=True)
            _check_stopped()  # a broken pool after a stop signal killed its workers: the signal's status
            raise
        pool.shutdown()
        return tuple(points)
    finally:
        _SWEEP = None
        _KILL_ON_STOP.clear()


def _capacity(args: argparse.Namespace) -> None:
    if args.plot:  # before the sweep, which may take minutes
        _check_plot(args.plot)
    keys = [request.block_keys for request in _read(args, args.path)]
    bar = ProgressBar(len(args.capacity_blocks), label="capacities", enabled=not args.no_progress and shows_progress())
    points = capacity_sweep(
        keys,
        args.policy,
        prefix_aware=args.prefix_aware,
        capacities_blocks=args.capacity_blocks,
        jobs=args.jobs,
        progress=bar,
    )
    if args.plot:
        label = f"{args.policy}{' (prefix-aware)' if args.prefix_aware else ''}"
        plot_capacity({label: points}, args.plot, title=Path(args.path).name)
    if args.json:
        result = {
            "policy": args.policy,
            "prefix_aware": args.prefix_aware,
            "hit_ratio": {str(p.capacity_blocks): round(p.hit_ratio, 6) for p in points},
        }
        print(json.dumps(result))
        return
    print(f"policy {args.policy}{' prefix-aware' if args.prefix_aware else ''} on {args.path}")
    print(f"{'capacity (blocks)':>18}  {'hit ratio':>9}")
    for point in points:
        print(f"{point.capacity_blocks:>18,}  {point.hit_ratio:>9.4f}")


def _convert(args: argparse.Namespace) -> None:
    requests = _read(args, args.source)
    count = write_trace(_destination(args.target), requests, block_size_tokens=args.block_size, form=args.to)
    _wrote(args.target, f"wrote {count:,} requests from {args.source} to {args.target} ({args.to} form)")


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its errors on one line and status 2 (the usage is one `--help` away): the `mooncake`
    command's parser, and every example command line's that promises one line on stderr. Its subcommands'
    parsers are of its class too (`add_subparsers` passes it on as `parser_class`)."""

    def error(self, message: str) -> NoReturn:
        # An argument may hold line breaks or other control characters: shown escaped, the message stays one line.
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="mooncake", description=__doc__.split("\n")[0] if __doc__ else None)
    # Named for the user ("required: COMMAND"), not by its dest ("required: group"); --help lists the commands.
    commands = parser.add_subparsers(dest="group", metavar="COMMAND", required=True)
    trace = commands.add_parser("trace", help="inspect, generate and analyse Mooncake-format traces")
    sub = trace.add_subparsers(dest="command", metavar="COMMAND", required=True)

    stats = sub.add_parser("stats", help="requests, mean lengths and prefix reuse of a trace")
    stats.add_argument("path", type=_input_path)
    stats.add_argument("--json", action="store_true", help="print JSON")
    stats.set_defaults(run=_stats)

    generate = sub.add_parser("generate", help="write a synthetic workload as a trace")
    generate.add_argument("--preset", choices=sorted(PRESETS), default=DEFAULT_WORKLOAD.preset)
    generate.add_argument(
        "--num-requests",
        type=request_count(0),
        default=DEFAULT_WORKLOAD.num_requests,
        help=f"requests to generate (0 writes an empty trace); at most {MAX_REQUESTS:,}",
    )
    generate.add_argument("--rate", type=_ranged, default=DEFAULT_WORKLOAD.rate_per_s, help="mean arrivals per second")
    generate.add_argument(
        "--cv", type=_ranged, default=1.0, help="inter-arrival coefficient of variation (1 = Poisson, >1 bursty)"
    )
    generate.add_argument("--seed", type=integer(0), default=0)
    generate.add_argument(
        "--out",
        type=_output_path,
        required=True,
        help="the trace to write (gzip when the name ends in .gz; - for stdout)",
    )
    generate.set_defaults(run=_generate)

    capacity = sub.add_parser("capacity", help="prefix hit ratio against cache capacity")
    capacity.add_argument("path", type=_input_path)
    capacity.add_argument("--policy", choices=sorted(POLICIES), default="lru")
    capacity.add_argument(
        "--capacity-blocks", type=comma_separated(integer(1), noun="capacity"), default=[1000, 10000, 50000]
    )
    capacity.add_argument(
        "--prefix-aware",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="evict leaf blocks first (default: off, each block ranked alone as in the paper's Table 1; the "
        "library's policies default to on)",
    )
    capacity.add_argument("--json", action="store_true", help="print JSON")
    capacity.add_argument("--plot", type=_plot_path, help="write a plot here (.png, .pdf, .svg, ...)")
    capacity.add_argument(
        "--jobs", type=integer(1), default=os.cpu_count() or 1, help="capacities replayed in parallel (default: CPUs)"
    )
    capacity.add_argument("--no-progress", action="store_true", help="no progress bar, even on a terminal")
    capacity.set_defaults(run=_capacity)

    convert = sub.add_parser("convert", help="rewrite a trace in the Mooncake form or aiperf's, plain or gzip")
    convert.add_argument("source", metavar="IN", type=_input_path, help="a trace in either form, plain or gzip")
    convert.add_argument(
        "target",
        metavar="OUT",
        type=_output_path,
        help="the trace to write (gzip when the name ends in .gz; - for stdout)",
    )
    convert.add_argument(
        "--to", choices=TRACE_FORMS, default="mooncake", help="the form to write (default mooncake; aiperf keeps text)"
    )
    convert.set_defaults(run=_convert)

    for command in (stats, generate, capacity, convert):
        command.add_argument(
            "--block-size",
            type=integer(1),
            default=TRACE_BLOCK_SIZE_TOKENS,
            help=f"tokens per block / hash id (default {TRACE_BLOCK_SIZE_TOKENS})",
        )
    for command in (stats, capacity, convert):
        command.add_argument(
            "--skip-invalid",
            action="store_true",
            help="leave out malformed lines (named on stderr) instead of failing; a line that the 10 after it all "
            "arrive before still fails, named",
        )
        command.add_argument(
            "--time-unit",
            choices=TIME_UNITS,
            default="ms",
            help="what the trace's timestamps count (default ms, the Mooncake format's; s for Qwen-Bailian's traces)",
        )
        command.add_argument(
            "--sort",
            action="store_true",
            help="read the whole trace and sort its lines by timestamp first, for one slightly out of order (merged "
            "logs); not for a trace with sessions",
        )
    return parser


def error_message(error: Exception) -> str:
    """What a command line prints for an error it reports: a failed read or write as `file: reason` (its errno
    and repr left out); any other error as its own text, a MooncakeError too where it is also an OSError (its
    message names the file). Every command line words a file's errors through this: `mooncake` and the examples.
    """
    if isinstance(error, OSError) and not isinstance(error, MooncakeError):
        if error.filename is not None and error.strerror:
            return f"{os.fsdecode(error.filename)}: {error.strerror}"
        return " ".join(str(error).split())
    return str(error)


_STOPPED: int | None = None  # the stop signal `_terminate` took during the current `run_interruptible`, if any
_KILL_ON_STOP: list[Any] = []  # processes a stop signal kills at once (a parallel sweep's workers)


def _terminate(signum: int, frame: object) -> NoReturn:
    # Recorded as well as raised: Python swallows an exception raised while the main thread runs a finalizer or a
    # weakref callback ("Exception ignored in ..."), and the command would then run on to its end:
    # `run_interruptible` looks at the record, and a sweep's workers are killed here, so that its wait ends at once
    # (a broken pool) whatever became of the SystemExit.
    global _STOPPED
    _STOPPED = signum
    for process in _KILL_ON_STOP:
        with contextlib.suppress(Exception):
            process.kill()
    raise SystemExit(128 + signum)


def _check_stopped() -> None:
    """Raise the SystemExit of a stop signal taken but swallowed where it landed (see `_terminate`)."""
    if _STOPPED is not None:
        raise SystemExit(128 + _STOPPED)


# Signals that stop a command as SIGTERM does: its terminal or ssh session closed (SIGHUP), Ctrl-\ (SIGQUIT).
# Their default actions end the process at once, leaving a half-written temporary file behind.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, name))


EXIT_READER_LEFT = 141  # 128 + SIGPIPE (13): the status of a program the signal ends, as `yes | head` leaves it


def _reader_left() -> int:
    """stdout's reader has gone (`| head`, `| true`): as Python's signal docs advise for SIGPIPE, point stdout at
    /dev/null, so that the flush at exit writes nowhere (instead of a second BrokenPipeError, reported as
    "Exception ignored"), and end quietly: the output was not wanted."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):  # stdout replaced by something with no file descriptor
        pass
    return EXIT_READER_LEFT


def run_interruptible(prog: str, command: Callable[[], int]) -> int:
    """Run a command line's body so that stopping it cleans up and says so in one line.

    SIGTERM raises SystemExit(143) inside `command`, so `finally` blocks run
    and an atomic write (`write_trace`, the simulator's reports) removes its
    temporary file instead of leaving it behind; so do the other
    `STOP_SIGNALS`, SIGHUP (129) and SIGQUIT (131), unless the process ignores
    one (`nohup` ignores SIGHUP, which must stay so). Ctrl-C (KeyboardInterrupt)
    ends it with status 130 and `PROG: interrupted` on stderr, not a traceback.
    A reader of stdout that exits early (`| head`) ends it quietly with status
    141 (`EXIT_READER_LEFT`), as SIGPIPE would: stdout is flushed here, so
    that the broken pipe shows here and not at the interpreter's exit. The
    handlers are installed for the call only, and only from the main thread
    (the one Python runs signal handlers in).

    Returns:
        `command()`'s exit status, 130 after Ctrl-C, or 141 when stdout's reader left.

    Raises:
        SystemExit: 128 + the signal on one of `STOP_SIGNALS` (143 on SIGTERM).
    """
    global _STOPPED
    previous: dict[int, Any] = {}
    _STOPPED = None
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) is not signal.SIG_IGN:
                previous[signum] = signal.signal(signum, _terminate)
    try:
        status = command()
        _check_stopped()  # a stop signal whose SystemExit was swallowed where it landed: still the signal's status
        sys.stdout.flush()
        return status
    except BrokenPipeError:  # from a print, or the flush (a command's own I/O errors are its to report)
        return _reader_left()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    finally:
        for signum, handler in previous.items():  # None: a handler not installed from Python, which cannot be put back
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0, 2 for a usage or input error, 130 after Ctrl-C, 141 when
    stdout's reader left; SIGTERM exits with 143, SIGHUP 129, SIGQUIT 131, removing what was half written: see
    `run_interruptible`)."""
    return run_interruptible("mooncake", lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    if isinstance(sys.stdout, io.TextIOWrapper):
        # A file name from argv may hold undecodable bytes (as surrogates): print them escaped, never fail.
        sys.stdout.reconfigure(errors="backslashreplace")
    args = _parser().parse_args(argv)
    try:
        args.run(args)
    except MooncakeError as error:
        print(one_line(f"mooncake: error: {error}"), file=sys.stderr)
        return 2
    except BrokenPipeError:  # stdout's reader left: no error of the input (run_interruptible ends quietly)
        raise
    except OSError as error:
        print(one_line(f"mooncake: error: {error_message(error)}"), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
