"""What replay.py and experiments.py share: workload and cluster options, the paper-like sizing, the --out set.

A workload is a Mooncake-format trace (`--trace`) or a generated preset
(`--preset`, so nothing needs a data file), in blocks of `--block-size` tokens
(512 by default, the published traces'), the blocks the cluster caches. A
cluster is a `ClusterSpec` from the options; `--prefill/--decode 0` (the
default) sizes it the paper's way:

    prefill instances = max(1, round(0.8 · D)),  decode instances = the same,

D being the trace's cache-less prefill demand (Σ prefill time with nothing
cached / the trace's duration, in busy instances). A cache-blind router then
runs the prefill pool near saturation and cache reuse is what relieves it, the
regime of the paper's experiment (TTFTs of seconds). The rule is fixed
independently of any router's result. It reads the workload at its own pace
(speed 1), whatever `--speedup` (`sized_cluster`, every program's): a speed-up
loads the cluster sized for the workload instead of sizing a bigger one.

The overload experiments size the decode pool by its own demand instead
(`decode_sized`): decode nodes = max(1, round(0.8 · R / N)), R being the
requests decoding at once (arrival rate × mean output × the TBT objective: the
slowest an accepted request is meant to go) and N the requests of the mean
lengths one decode node holds within the TBT objective and its HBM
(`decode_capacity`). Both pools then run near saturation at the workload's own
pace, and overload finds whichever binds first.

A run's files in `--out` (replay.py's requests.csv, summary.json and plots, an
experiment's JSON and plots, demo.py's trace and plot) are one set: checked
writable before the run, written aside, and put in place together after it,
the marker (summary.json, the JSON) last (`output_set`).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import itertools
import math
import os
import shutil
import stat
import statistics
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
from scaling import Scaling, scale
from serving import registry
from serving.registry import ADMISSIONS, PREDICTORS, ROUTERS

from mooncake._checks import range_problem
from mooncake._files import atomic_path
from mooncake.cli import MAX_REQUESTS, file_path, integer, read_trace, request_count
from mooncake.errors import ConfigError
from mooncake.sched.conductor import Conductor
from mooncake.sched.cost import HARDWARE, MODELS, PrefillCostModel
from mooncake.sched.join import DecodeLoad, check_join
from mooncake.sched.router import DEFAULT_THRESHOLD, is_threshold
from mooncake.sim.coupled import CoupledSpec
from mooncake.sim.report import ProgressBar, shows_progress
from mooncake.sim.spec import DEFAULT_CACHE_BLOCKS, ClusterSpec
from mooncake.types import Request, Slo
from mooncake.workload import (
    ARRIVAL_RANGE,
    DEFAULT_WORKLOAD,
    PRESETS,
    TIME_UNITS,
    TRACE_BLOCK_SIZE_TOKENS,
    ArrivalProcess,
    generate_requests,
    preset,
)
from mooncake.workload.trace_record import arrival_problem

if TYPE_CHECKING:  # the example cluster's config, read only for --config (it needs the cluster's modules)
    from serving.config import ClusterConfig

# Generated without --preset, --num-requests, --rate.
DEFAULT_PRESET, DEFAULT_REQUESTS, DEFAULT_RATE = attrs.astuple(DEFAULT_WORKLOAD)
SIZING_LOAD = 0.8
# Nodes of a role, given or sized: past it a trace's rate is no basis for sizing (arrivals nearly at once), and a
# given count (an extra zero, say) would build a list of instance names that takes every byte of memory.
MAX_NODES = 1024
# Requests of a workload (--num-requests; experiments.py's --throughput-requests, per rate tried) are at most
# `mooncake.cli.MAX_REQUESTS`, `mooncake trace generate`'s bound too. A whole trace, read without --num-requests, is
# bounded by its lines instead.


def number(
    kind: Callable[[str], Any], *, least: float = -math.inf, above: float = -math.inf, most: float = math.inf
) -> Callable[[str], Any]:
    """An argparse type: an option's value as `kind`, finite, >= `least`, > `above` and <= `most`: argparse then
    names the option and the value it refuses, before anything runs (an unbounded value could loop for ever:
    --sample-every 0, --num-requests 10**20): the workload's counts and experiments.py's sweeps. An integer is
    `mooncake.cli.integer`'s (one rule and wording for every integer option)."""
    if kind is int and above == -math.inf and least > -math.inf:
        return integer(int(least), most=None if most == math.inf else int(most))
    bound = f">= {least:g}" if least > -math.inf else f"> {above:g}"
    if most < math.inf:
        bound += f" and <= {most:d}" if kind is int else f" and <= {most:.4g}"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
            finite = math.isfinite(value)
        except (ValueError, OverflowError):  # not a number, or an integer past any float
            value, finite = math.nan, False
        if not (finite and least <= value <= most and value > above):
            noun = "an integer" if kind is int else "a finite number"
            raise argparse.ArgumentTypeError(f"must be {noun} {bound}, got {text!r}")
        return value

    return parse


def router_name(text: str) -> str:
    """An argparse type: a router's name (`serving.registry.router`: one of `ROUTERS`, or FILE.py:FACTORY, loaded
    now), resolved when the command line is read, so that a typo is refused by its option (--router, each of
    experiments.py's --routers) before any replay, not when its replay starts, after those of the routers before
    it. The name itself is the value: each replay resolves it again, with its threshold."""
    try:
        registry.router(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return text


def add_workload_options(
    parser: argparse.ArgumentParser,
    *,
    preset: str = DEFAULT_PRESET,
    num_requests: int | None = None,
    rate: float = DEFAULT_RATE,
) -> None:
    """The workload options; a program whose generated workload differs from the default gives its own
    `preset`, `num_requests` (then also the first of a trace taken) and `rate`, which its --help states."""
    if (preset, num_requests, rate) != (DEFAULT_PRESET, None, DEFAULT_RATE):
        parser.set_defaults(preset=preset, num_requests=num_requests, default_rate=rate)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--trace", type=file_path, help="a Mooncake-format JSONL trace")
    source.add_argument("--preset", choices=sorted(PRESETS), help=f"generate this workload (default: {preset})")
    parser.add_argument(
        "--block-size",
        type=int,
        default=TRACE_BLOCK_SIZE_TOKENS,
        help=f"tokens per block (default {TRACE_BLOCK_SIZE_TOKENS}, the published traces'): a --trace's tokens per "
        "hash id (`mooncake trace generate --block-size` writes others); a --preset is generated in blocks of this "
        "size, as that command generates it, so the two replay alike; the simulated cluster caches blocks of this "
        "size (a --config cluster keeps its own)",
    )
    parser.add_argument(
        "--skip-invalid",
        action="store_true",
        help="leave out the trace's malformed lines (each named on stderr) instead of failing",
    )
    parser.add_argument(
        "--time-unit",
        choices=TIME_UNITS,
        default="ms",
        help="what a --trace's timestamps count (default ms, the Mooncake format's; s for Qwen-Bailian's traces)",
    )
    parser.add_argument(
        "--sort",
        action="store_true",
        help="read the whole --trace and sort its lines by timestamp first, for one slightly out of order (merged "
        "logs); not for a trace with sessions",
    )
    parser.add_argument(
        "--num-requests",
        type=request_count(1),  # a replay of nothing has no figures
        help=f"requests generated (default {DEFAULT_REQUESTS}), or the first of a trace (default: all of it); at "
        f"most {MAX_REQUESTS:,}"
        if num_requests is None
        else f"requests generated, or the first of a trace (default {num_requests}); at most {MAX_REQUESTS:,}",
    )
    parser.add_argument("--rate", type=float, help=f"generated arrivals per second (default {rate:g})")
    parser.add_argument(
        "--speedup", type=float, default=1.0, help="replay speed: 2 halves every timestamp (default %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload generator and the Conductor")
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bars (there are none when the output is piped)"
    )


def progress(args: argparse.Namespace, total: int, label: str) -> ProgressBar:
    """A progress bar over `total` requests on stderr, drawn on a terminal unless `--no-progress`."""
    return ProgressBar(total, label=label, enabled=not args.no_progress and shows_progress())


def load_workload(
    args: argparse.Namespace, *, speedup: float | None = None, option: str = "--speedup"
) -> list[Request]:
    """The requests the options describe, at `speedup` (default: `--speedup`; `option` names the one it is).

    Raises:
        ConfigError: an option out of its range, or arrivals a replay cannot time (past `MAX_ARRIVAL_S`).
        TraceFormatError: a malformed --trace line, or one that `speedup` puts past `MAX_ARRIVAL_S`.
        OSError: the --trace cannot be read, named as `--trace PATH`.
    """
    speed = args.speedup if speedup is None else speedup
    check_positive(option, speed)
    count = args.num_requests  # within [1, MAX_REQUESTS], or None: the parser's type (`request_count`) decides
    if args.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")
    block = args.block_size
    if block < 1:
        raise ConfigError(f"--block-size must be >= 1, got {block}")
    rate = args.rate
    # The range `ArrivalProcess` takes, named as `mooncake trace generate` names it: not as its field, rate_per_s.
    if rate is not None and (problem := range_problem(rate, *ARRIVAL_RANGE)) is not None:
        raise ConfigError(f"--rate {problem}, got {rate:g}")
    if args.trace is not None:
        if rate is not None:  # a trace's own timestamps are its arrivals
            raise ConfigError("--rate sets a generated workload's arrivals; a --trace keeps its own (see --speedup)")
        # As `mooncake trace` reads it (--skip-invalid names each line it leaves out), named by this program.
        lines = read_trace(
            args.trace,
            block_size_tokens=block,
            speedup=speed,
            skip_invalid=args.skip_invalid,
            prog=_program(),
            time_unit=args.time_unit,
            sort=args.sort,
        )
        try:
            # Only the first `count` are read (and checked), the lines coming in arrival order; --sort reads them all.
            requests = list(itertools.islice(lines, count))
        except OSError as error:  # named by its option too: `FILE: Is a directory` did not say which one
            if not error.strerror:
                raise
            raise type(error)(error.errno, error.strerror, f"--trace {args.trace}") from error
        if not requests:  # a valid trace, but nothing to replay: every figure would be a zero
            raise ConfigError(f"--trace {args.trace} has no requests")
        return requests
    if args.skip_invalid:  # given anyway, it would look like a setting the results were made with
        raise ConfigError("--skip-invalid reads around a --trace's malformed lines; a generated workload has none")
    if args.time_unit != "ms":
        raise ConfigError(
            f"--time-unit {args.time_unit} says what a --trace's timestamps count; a generated workload has none"
        )
    if args.sort:
        raise ConfigError("--sort puts a --trace's lines in timestamp order; a generated workload comes in order")
    spec = attrs.evolve(preset(args.preset or DEFAULT_PRESET), block_size_tokens=block)  # as `trace generate` does
    rate = getattr(args, "default_rate", DEFAULT_RATE) if rate is None else rate
    requests = generate_requests(
        spec,
        num_requests=DEFAULT_REQUESTS if count is None else count,
        arrivals=ArrivalProcess(rate_per_s=rate),
        seed=args.seed,
    )
    requests = at_speed(requests, speed)
    if (problem := arrival_problem(requests[-1].arrival_s)) is not None:  # they come in order
        raise ConfigError(
            f"{option} {speed:g} puts the last of {len(requests):,} arrivals (--rate {rate:g}) at "
            f"{requests[-1].arrival_s:.3g} s, {problem}"
        )
    return requests


def sped_up(
    args: argparse.Namespace, base: Sequence[Request], speedup: float, *, option: str = "--speedup"
) -> list[Request]:
    """`base`, the options' workload read at speed 1 (`load_workload(args, speedup=1.0)`), at `speedup` (`option`
    names it): the same requests as a read at `speedup` gives (`at_speed`), so that every speed of a run comes of
    one read (a trace's skipped lines and cautions said once, not once a speed).

    Raises:
        ConfigError, TraceFormatError: as `load_workload` at `speedup` raises them: a speed-up that is no finite
            number > 0, or arrivals it puts past what a replay can time (a trace's named by its line).
    """
    check_positive(option, speedup)
    requests = at_speed(base, speedup)
    if requests and arrival_problem(requests[-1].arrival_s) is not None:  # they come in order
        load_workload(args, speedup=speedup, option=option)  # raises, naming the arrival as a read names it
    return requests


def at_speed(requests: Sequence[Request], speed: float) -> list[Request]:
    """`requests`, given at speed 1, replayed `speed` times faster: each arrival divided by it, as the trace reader
    and `load_workload` divide theirs (x / 1.0 is x), so the times are the same floats as read at `speed`."""
    return [attrs.evolve(request, arrival_s=request.arrival_s / speed) for request in requests]


def _program() -> str:
    """This script's name (`replay`, `experiments`, ...), as its error lines begin."""
    return Path(sys.argv[0]).stem or "simulation"


def check_out_dir(out: Path) -> None:
    """`--out` names a folder, or one that can be made, in which files can be written: checked before a run, not
    found wrong after it. It leaves nothing behind: the folders it makes to check, and its probe, are removed.

    Raises:
        ConfigError: `out`, or the nearest of its parents that exists, is no folder; or `out` cannot be made or
            written in (no permission, a read-only file system, /proc), with the reason.
    """
    with _scratch_folder(out):
        pass


@contextlib.contextmanager
def output_set(out: Path, names: Sequence[str]) -> Iterator[Path]:
    """The folder to write one run's output files in (its set), put into `out` as a whole when the block ends.

    Entered before the run: `out` is checked as `check_out_dir` checks it, and made. The block writes the set into
    the folder yielded, a hidden one inside `out` (`.PROGRAM.PID.UUID.tmp`: a rename within one file system).
    When the block ends without an error the set is put in place, by name, in this order: `out`'s old file of the
    set's marker, the last of `names` (summary.json), is removed; each file written but the marker replaces its
    namesake; the files of `names` the run did not write (plots with --no-plots) are removed, so nothing of an
    older run passes for this one's; the marker comes last. The marker is there only when every file of the set
    beside it is from its run. A file of another name in `out` (the user's own, another command's) is never
    touched, and a link or stream at a set's name is written through, as every writer here does
    (`mooncake._files.atomic_path`); only regular files are removed. When the block raises (an error, Ctrl-C,
    SIGTERM's SystemExit) nothing in `out` is changed: the hidden folder is removed, and so is a folder made for
    the set that is still empty. Only a kill (SIGKILL) leaves the hidden folder behind.

    Why a folder to stage in and renames at the end: the files take the run's time to write (the plots of a long
    replay take seconds, an experiment draws its plots as it goes), the renames microseconds, so an interruption
    almost always falls where nothing in `out` has changed yet. One that falls among the renames (or a failed
    rename: a full disk, a folder at a set's name) leaves a set without its marker, plainly not whole, never one
    that passes for a single run. Deferring SIGINT over the renames would close that gap, but a set's name may be
    a FIFO with no reader, which no Ctrl-C could then leave.

    Args:
        out: the `--out` folder.
        names: every file the set can hold, the marker last.

    Yields:
        The folder to write the set's files in.

    Raises:
        ConfigError: `out` is no folder or cannot be written (`check_out_dir`), before the block runs.
        OSError: a file could not be put in place, named by its path in `out`; the block's own errors pass as raised.
    """
    with _scratch_folder(out) as staging:
        yield staging
        _publish(staging, out, names)


@contextlib.contextmanager
def _scratch_folder(out: Path) -> Iterator[Path]:
    """A new hidden folder inside `out` (made with its missing parents), removed with whatever it holds when the
    block ends, however it ends, and so are the folders made for it that are still empty. Making it is the probe
    of `out`: an entry that can be made there is one a file can be written to (the same permission, file system
    and space), and it is the entry the writes need anyway.

    Raises:
        ConfigError: as `check_out_dir`.
    """
    missing: list[Path] = []  # `out`, then its parents, up to the nearest that exists
    made: list[Path] = []
    scratch = out / f".{_program()}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
    try:
        for folder in (out, *out.parents):
            if folder.exists():
                if not folder.is_dir():
                    where = "" if folder == out else f": {folder}"
                    raise ConfigError(f"--out {out}{where} is a file, not a directory")
                break
            missing.append(folder)
        for folder in reversed(missing):
            with contextlib.suppress(FileExistsError):  # made by another run meanwhile: not this one's to remove
                folder.mkdir()
                made.append(folder)
        scratch.mkdir()
    except OSError as error:  # the name itself (too long), no permission, a read-only file system, /proc
        where = "" if error.filename in (None, os.fspath(out), os.fspath(scratch)) else f" (making {error.filename})"
        _remove_folders(made)
        raise ConfigError(f"--out {out} cannot be written: {error.strerror}{where}") from error
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        _remove_folders(made)


def _remove_folders(made: Sequence[Path]) -> None:
    """Remove the folders of `made` (parents first in it) that are empty, deepest first: one a set was put in stays."""
    for folder in reversed(made):
        with contextlib.suppress(OSError):
            folder.rmdir()


def _publish(staging: Path, out: Path, names: Sequence[str]) -> None:
    """Put the files written in `staging` into `out`, in `output_set`'s order (its docstring)."""
    marker = names[-1]
    written = sorted(path.name for path in staging.iterdir())
    _remove_file(out / marker)
    for name in written:
        if name != marker:
            _place(staging / name, out / name)
    for name in names:
        if name not in written:
            _remove_file(out / name)
    if marker in written:
        _place(staging / marker, out / marker)


def _remove_file(path: Path) -> None:
    """Remove `path` if it is a regular file: a link, a stream or a folder there is the user's arrangement."""
    try:
        if stat.S_ISREG(os.lstat(path).st_mode):
            path.unlink()
    except FileNotFoundError:
        pass


def _place(staged: Path, target: Path) -> None:
    """Move `staged` onto `target` whole: by a rename onto `atomic_path`'s temporary, or, where that yields a stream
    to write as it goes or a link's file lies on another file system, by copying its bytes.

    Raises:
        OSError: named by `target` (the staged file's hidden name means nothing to the user).
    """
    try:
        with atomic_path(target) as place:
            if place != target:
                try:
                    os.replace(staged, place)
                    return
                except OSError as error:
                    if error.errno != errno.EXDEV:
                        raise
            with staged.open("rb") as source, place.open("wb") as sink:
                shutil.copyfileobj(source, sink)
    except OSError as error:
        if error.filename == os.fspath(target):
            raise
        raise type(error)(error.errno, error.strerror, os.fspath(target)) from error


def workload_name(args: argparse.Namespace) -> str:
    return str(args.trace) if args.trace is not None else f"preset {args.preset or 'synthetic'} (seed {args.seed})"


def add_cluster_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", type=int, default=0, help="prefill nodes (0: sized from the workload)")
    parser.add_argument("--decode", type=int, default=0, help="decode nodes (0: as many as prefill)")
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3-70b")
    parser.add_argument("--hardware", choices=sorted(HARDWARE), default="8xA800", help="one node's GPUs")
    parser.add_argument(
        "--cache-blocks",
        type=int,
        default=DEFAULT_CACHE_BLOCKS,
        help="KV cache per prefill node, in blocks of --block-size tokens",
    )
    pool = parser.add_mutually_exclusive_group()
    pool.add_argument("--global-pool", dest="global_pool", action="store_true", default=True, help="(default)")
    pool.add_argument("--local-cache", dest="global_pool", action="store_false", help="no cross-node fetches")
    parser.add_argument("--cpp", type=int, default=1, help="prefill nodes per chunked-pipeline group")
    parser.add_argument("--inline-prefill", type=int, default=0, help="inline prompts up to this many tokens")
    parser.add_argument("--ttft-slo", type=float, default=Slo().ttft_s, help="seconds (default %(default)s)")
    parser.add_argument("--tbt-slo", type=float, default=Slo().tbt_s, help="seconds (default %(default)s)")
    parser.add_argument(
        "--admission-wait",
        type=float,
        default=0.0,
        help="seconds a request refused for decode room may wait for it, first come first served, before its "
        "prefill (0: rejected at once, the paper's; the example cluster's gateway waits 30)",
    )


def add_policy_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--router",
        type=router_name,
        default="kvcache_centric",
        help=f"one of {', '.join(ROUTERS)}, or FILE.py:FACTORY (your own)",
    )
    parser.add_argument("--admission", choices=list(ADMISSIONS), default="early_rejection")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, help="kvcache_balancing_threshold")
    parser.add_argument(
        "--predictor",
        choices=list(PREDICTORS),
        default="uniform",
        help="decode load predictor of predictive_early_rejection: uniform (the paper's t_d = mean output x TBT "
        "objective) or expected_output (each request's own output x TBT objective)",
    )


def given_options(make_parser: Callable[[], argparse.ArgumentParser], argv: Sequence[str] | None) -> dict[str, str]:
    """The options `argv` gives (a subcommand's too), each dest mapped to the option as the parser names it:
    `refuse_unused` then refuses an option given with its default value, which comparing values cannot see.

    `make_parser` builds a fresh parser: it is parsed again with every default suppressed and every option's dest
    its own name (--global-pool and --local-cache share one dest; the one given is the one to name). `argv` has
    been parsed by a parser from `make_parser` already, so this parse cannot fail.
    """
    probe = make_parser()
    dests: dict[str, str] = {}  # option name -> its real dest
    parsers = [probe]
    while parsers:
        parser = parsers.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
            elif action.option_strings:
                name = action.option_strings[-1]
                dests[name] = action.dest
                action.dest, action.default = name, argparse.SUPPRESS
    given = vars(probe.parse_args(argv))
    return {dests[name]: name for name in given if name in dests}


def refuse_unused(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    dests: Sequence[str],
    why: str,
    *,
    given: Mapping[str, str] | None = None,
) -> None:
    """Options the run will not use, given anyway: each would look like a setting the results were made with.

    Args:
        given: the options the command line gave (`given_options`): each of `dests` among them is refused, its
            default value too. Without it, an option set to other than its default is.

    Raises:
        ConfigError: the first of `dests` given (without `given`: set to other than its default), naming its option
            and `why`.
    """
    options = {action.dest: action.option_strings[-1] for action in parser._actions if action.option_strings}
    for dest in dests:
        if given is not None:
            if dest in given:
                raise ConfigError(f"{given[dest]} does not apply {why}")
        elif getattr(args, dest) != parser.get_default(dest):
            raise ConfigError(f"{options.get(dest, dest)} does not apply {why}")


def refuse_unpredicted(
    parser: argparse.ArgumentParser, args: argparse.Namespace, *, given: Mapping[str, str] | None = None
) -> None:
    """--predictor given to a run whose admission policy predicts nothing (all but predictive_early_rejection).

    Raises:
        ConfigError: naming --predictor and the admission policy.
    """
    if args.admission != "predictive_early_rejection":
        why = f"to --admission {args.admission}: only predictive_early_rejection predicts the decode load"
        refuse_unused(parser, args, ("predictor",), why, given=given)


def refuse_unthresholded(
    parser: argparse.ArgumentParser, args: argparse.Namespace, *, given: Mapping[str, str] | None = None
) -> None:
    """--threshold given to a run that never reads it (`registry.reads_threshold` for none of its routers:
    `--router`, or the scheduling experiment's `--routers`): none of `registry.THRESHOLD_ROUTERS` among them (the
    routers `registry.router` gives it to), or local caches (nothing is transferred).

    Raises:
        ConfigError: naming --threshold and what keeps it unread.
    """
    routers = getattr(args, "routers", None)
    option, named = ("--router", [args.router]) if routers is None else ("--routers", list(routers))
    if any(registry.reads_threshold(name, global_pool=args.global_pool) for name in named):
        return
    if registry.THRESHOLD_ROUTERS.isdisjoint(named):
        why = f"to {option} {','.join(named)}: only {', '.join(sorted(registry.THRESHOLD_ROUTERS))} reads it"
    else:
        why = "with --local-cache: without a global pool nothing is transferred"
    refuse_unused(parser, args, ("threshold",), why, given=given)


def arrival_span_s(requests: Sequence[Request]) -> float:
    """Seconds from the first arrival to the last: what the sizing rates are per."""
    return requests[-1].arrival_s - requests[0].arrival_s


def sized(role: str, nodes: float, requests: Sequence[Request]) -> int:
    """`nodes` of `role` as a count, or a ConfigError where the trace's arrival rate is no basis for sizing."""
    if not nodes <= MAX_NODES:  # inf (all at once) too
        raise ConfigError(
            f"sizing the {role} pool by this workload's demand asks for {nodes:,.0f} nodes: its "
            f"{len(requests):,} arrivals span {arrival_span_s(requests):.3g} s; give --prefill and --decode"
        )
    return max(1, round(nodes))


def prefill_demand(requests: Sequence[Request], cost: PrefillCostModel) -> float:
    """Busy prefill instances the workload needs with nothing cached (inf when every request arrives at once)."""
    if len(requests) < 2:
        return 1.0
    span = arrival_span_s(requests)
    work = sum(cost.prefill_s(r.input_length) for r in requests)
    return work / span if span > 0 else math.inf


def paper_sized(requests: Sequence[Request], args: argparse.Namespace) -> tuple[int, int]:
    """(prefill, decode) nodes: the options', or sized the paper's way (module docstring) for `requests` as they
    arrive, which every program gives at speed 1 (`sized_cluster`), whatever its --speedup."""
    options = (
        ("--prefill", args.prefill, 0),
        ("--decode", args.decode, 0),
        ("--cpp", args.cpp, 1),
        ("--cache-blocks", args.cache_blocks, 0),
        ("--inline-prefill", args.inline_prefill, 0),
    )
    for option, value, least in options:
        if value < least:
            raise ConfigError(f"{option} must be >= {least}, got {value}")
    for option, value in (("--prefill", args.prefill), ("--decode", args.decode), ("--cpp", args.cpp)):
        if value > MAX_NODES:
            raise ConfigError(f"{option} must be <= {MAX_NODES} (nodes of a role), got {value}")
    if args.prefill > 0:
        check_cpp_divides(args.cpp, args.prefill, f"--prefill {args.prefill}")
    threshold = getattr(args, "threshold", None)
    if threshold is not None and not is_threshold(threshold):
        raise ConfigError(f"--threshold must be a number >= 1 (inf: never transfer), got {threshold}")
    prefill = args.prefill
    if prefill <= 0:
        cost = PrefillCostModel(model=MODELS[args.model], hardware=HARDWARE[args.hardware])
        prefill = sized("prefill", SIZING_LOAD * prefill_demand(requests, cost), requests)
        prefill = max(args.cpp, prefill - prefill % args.cpp)  # whole CPP groups
    decode = args.decode if args.decode > 0 else prefill
    return prefill, decode


def check_cpp_divides(cpp: int, nodes: int, what: str) -> None:
    """`nodes` prefill nodes (`what` names where the count comes from) form whole CPP groups of `cpp`.

    Raises:
        ConfigError: naming --cpp and `what`, before a `ClusterSpec` names its own fields.
    """
    if nodes % cpp:
        raise ConfigError(f"--cpp {cpp} must divide {what} (whole groups of prefill nodes)")


def decode_capacity(spec: ClusterSpec, requests: Sequence[Request], tbt_slo_s: float) -> int:
    """Requests of the workload's mean lengths one decode node holds: the most the decode rule
    (`sched.join.check_join`, every caller's) lets join, with the TBT objective, the others each at half
    its output on average."""
    if not requests:
        return 1
    prompt = round(statistics.mean(r.input_length for r in requests))
    output = max(2, round(statistics.mean(r.output_length for r in requests)))
    half = output // 2

    def holds(n: int) -> bool:
        # `+ half`: the joining request is counted at half its output too (check_join adds its prompt alone), so
        # that the step reads n x (prompt + half), every member at its average context.
        others = DecodeLoad(n - 1, (n - 1) * (prompt + half) + half, (n - 1) * (prompt + output))
        return check_join(
            spec.decode_limits,
            others,
            prompt_tokens=prompt,
            output_tokens=output,
            step_model=spec.decode_cost,
            tbt_slo_s=tbt_slo_s,
        ).accepted

    low, high = 1, 2
    while holds(high) and high < 10**6:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if holds(middle) else (low, middle)
    return low


def decode_sized(requests: Sequence[Request], args: argparse.Namespace, spec: ClusterSpec) -> int:
    """Decode nodes: the options', or sized by the decode side's own demand (module docstring)."""
    if args.decode > 0:
        return int(args.decode)
    if len(requests) < 2:
        return 1
    span = arrival_span_s(requests)
    output = statistics.mean(r.output_length for r in requests)
    # requests decoding at once, at the SLO's pace
    decoding = len(requests) / span * output * args.tbt_slo if span > 0 else math.inf
    return sized("decode", SIZING_LOAD * decoding / decode_capacity(spec, requests, args.tbt_slo), requests)


def sized_cluster(args: argparse.Namespace, *, decode_bound: bool = False) -> tuple[list[Request], ClusterSpec]:
    """The workload the options describe, at --speedup, and the cluster they describe, sized (`paper_sized`; with
    `decode_bound`, its decode pool by `decode_sized`) for the same workload at its own pace, speed 1: the one
    sizing rule of replay.py and every experiment. --speedup then loads the cluster sized for the workload, as
    `rejection` and `overload` do, rather than sizing a bigger one (which would keep the load at `SIZING_LOAD`).

    Raises:
        ConfigError, TraceFormatError: as `load_workload`, `cluster_spec` and (with `decode_bound`) `slo` raise
            them.
    """
    if decode_bound:
        slo(args)  # the decode sizing divides by --tbt-slo: a bad one is named here, not blamed on the workload
    if args.speedup == 1:
        requests = base = load_workload(args)
    else:  # read once (a trace's skipped lines and cautions said once), then sped up
        check_positive("--speedup", args.speedup)
        base = load_workload(args, speedup=1.0)
        requests = sped_up(args, base, args.speedup)
    spec = cluster_spec(base, args)
    if decode_bound:
        spec = attrs.evolve(spec, num_decode=decode_sized(base, args, spec))
    return requests, spec


def cluster_spec(requests: Sequence[Request], args: argparse.Namespace, **overrides: object) -> ClusterSpec:
    """The simulated cluster the options describe (`overrides` replace its fields), sized for `requests` (at
    the pace they arrive: `sized_cluster` gives them at speed 1).

    Raises:
        ConfigError: an --admission-wait that is not a finite number of seconds >= 0.
    """
    if not (math.isfinite(args.admission_wait) and args.admission_wait >= 0):
        raise ConfigError(f"--admission-wait must be a finite number of seconds >= 0, got {args.admission_wait:g}")
    prefill, decode = paper_sized(requests, args)
    options: dict[str, object] = {
        "num_prefill": prefill,
        "num_decode": decode,
        "model": MODELS[args.model],
        "prefill_hardware": HARDWARE[args.hardware],
        "decode_hardware": HARDWARE[args.hardware],
        "cache_capacity_tokens": args.cache_blocks * args.block_size,
        "block_size_tokens": args.block_size,
        "global_pool": args.global_pool,
        "cpp_group_size": args.cpp,
        "inline_prefill_tokens": args.inline_prefill,
        "admission_wait_s": args.admission_wait,
    }
    options.update(overrides)
    return ClusterSpec(**options)  # type: ignore[arg-type]


def coupled_spec(
    args: argparse.Namespace, num_instances: int, *, chunked: bool, token_budget: int | None = None
) -> CoupledSpec:
    """The coupled (vLLM-style) baseline the options describe, every program's (replay.py's --engine coupled,
    throughput's): `num_instances` instances of --model on --hardware caching blocks of --block-size, with chunked
    prefill if `chunked`, under `token_budget` tokens an iteration (default: `CoupledSpec`'s, vLLM's server
    default; throughput gives its tuned one)."""
    budget = {} if token_budget is None else {"token_budget": token_budget}
    return CoupledSpec(
        num_instances=num_instances,
        model=MODELS[args.model],
        hardware=HARDWARE[args.hardware],
        chunked_prefill=chunked,
        block_size_tokens=args.block_size,
        **budget,
    )


def check_profile(profile: Path) -> None:
    """`--profile`, the fitted cost models a --config cluster is to take (`serving.models.read_profile`), can be
    read: refused by its option and value, before the config it goes into (`[prefill] profile`) is blamed for it.

    Raises:
        ConfigError: naming --profile, the file and why it cannot be read.
    """
    from serving.models import read_profile

    try:
        read_profile(os.fspath(profile))
    except ConfigError as error:
        cause = error.__cause__
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(error)
        raise ConfigError(f"--profile {profile}: {reason}") from error


def config_spec(config: ClusterConfig) -> ClusterSpec:
    """The simulated twin of the example cluster `config` describes: its nodes (a CPP group's stages
    counted as nodes), block size, cache per prefill instance (DRAM and SSD blocks), how long a request
    waits for decode room (`[limits] admission_wait_s`), and the cost models and decode limits its Conductor uses (`serving.models`: the fitted profile when it names one), which
    the simulator then takes as the engines' truth. Its Conductor is `serving.models.build_conductor`'s
    (see `config_conductor`)."""
    from serving.models import CPU, cost_models, decode_limits, model_shape, prefill_cache_blocks

    prefill, step = cost_models(config)
    stages, block = config.prefill.pipeline_size, config.model.block_tokens
    spec = ClusterSpec(
        num_prefill=config.cluster.num_prefill * stages,
        num_decode=config.cluster.num_decode,
        model=model_shape(config),
        prefill_hardware=CPU,
        decode_hardware=CPU,
        block_size_tokens=block,
        # The simulator pools a CPP group's caches (the real group caches on its first stage only): its stages'
        # share, rounded up so that the group holds the instance's blocks (`ClusterSpec.prefill_cache_blocks`).
        cache_capacity_tokens=-(-prefill_cache_blocks(config) * block // stages),
        cpp_group_size=stages,
        cpp_chunk_tokens=config.prefill.chunk_tokens,
        prefill_model=prefill,
        step_model=step,
        decode_node_limits=decode_limits(config),
        admission_wait_s=config.limits.admission_wait_s,  # it waits for decode room as the gateway does
    )
    if spec.prefill_cache_blocks != prefill_cache_blocks(config):  # the nodes hold what the Conductor counts
        raise ConfigError(
            f"{config.source}: [prefill] pipeline_size = {stages} is more than [model] block_tokens = {block}: the "
            f"simulated group's {stages} nodes cannot share {prefill_cache_blocks(config)} cached blocks exactly"
        )
    return spec


def config_conductor(config: ClusterConfig, spec: ClusterSpec) -> Conductor:
    """The cluster's own Conductor (`serving.models.build_conductor`, its seed too) with `spec`'s instances,
    named as the launcher names the workers (`prefill-0`, ..., `decode-0`, ...)."""
    from serving.models import build_conductor

    return build_conductor(
        config,
        prefill_instances=[f"prefill-{i}" for i in range(spec.num_prefill_instances)],
        decode_instances=[f"decode-{i}" for i in range(spec.num_decode)],
    )


def cluster_requests(config: ClusterConfig, requests: Sequence[Request], scaling: Scaling) -> list[Request]:
    """`requests` as the example cluster of `config` sees them when load.py sends them scaled by `scaling`:
    its tokenizer's ids of each prompt and its hasher's keys of them (`scaling.scale`)."""
    from serving.tokenizer import serving_tokenizer

    hasher = config.model.hasher()
    return [s.request for s in scale(requests, scaling, encode=serving_tokenizer(config).encode, hasher=hasher)]


def slo(args: argparse.Namespace) -> Slo:
    """The `--ttft-slo` / `--tbt-slo` objectives (named by their options when they are not positive)."""
    for option, value in (("--ttft-slo", args.ttft_slo), ("--tbt-slo", args.tbt_slo)):
        check_positive(option, value)
    return Slo(ttft_s=args.ttft_slo, tbt_s=args.tbt_slo)


def describe(spec: ClusterSpec) -> str:
    groups = f", CPP groups of {spec.cpp_group_size}" if spec.cpp_group_size > 1 else ""
    pool = "global pool" if spec.global_pool else "local caches"
    blocks = spec.cache_capacity_tokens // spec.block_size_tokens
    return (
        f"{spec.num_prefill}P+{spec.num_decode}D {spec.model.name} on {spec.prefill_hardware.name}{groups}, "
        f"{blocks:,} cache blocks per prefill node ({pool})"
    )


def check_positive(name: str, value: float) -> None:
    """`value`, the option `name`, is a finite number > 0 (a speed-up, a rate, an objective).

    Raises:
        ConfigError: naming the option and the value.
    """
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{name} must be a finite number > 0, got {value}")
