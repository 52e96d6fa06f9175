"""The replay and experiment scripts run end to end on small generated workloads (no speed asserted)."""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import pty
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from mooncake.cli import main as mooncake_main
from mooncake.sched.cost import HARDWARE, MODELS
from mooncake.sim.coupled import CoupledCluster, CoupledSpec
from mooncake.types import Slo
from mooncake.workload import ArrivalProcess, generate_requests, preset

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--preset", "synthetic", "--num-requests", "150", "--rate", "2"]


def run(script: str, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=check,
    )


def test_replay_json_summary_and_outputs(tmp_path: Path) -> None:
    """--json prints every summary field the issue names; --out writes the CSV, JSON and plots."""
    done = run("replay.py", *SMALL, "--prefill", "2", "--decode", "2", "--out", str(tmp_path), "--json")
    summary = json.loads(done.stdout)
    for key in (
        "num_requests",
        "completed",
        "rejected_before_prefill",
        "rejected_after_prefill",
        "wasted_prefill_s",
        "ttft_s",
        "tbt_s",
        "slo_attainment",
        "goodput_rps",
        "cache_hit_ratio",
        "mean_prefill_s",
        "sim_wall_s",
    ):
        assert key in summary, key
    assert set(summary["ttft_s"]) == {"mean", "p50", "p90", "p99"}
    assert summary["num_requests"] == 150
    assert summary["completed"] + summary["rejected_before_prefill"] + summary["rejected_after_prefill"] == 150
    rows = (tmp_path / "requests.csv").read_text().splitlines()
    assert len(rows) == 151 and rows[0].startswith("request_id,")
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    for plot in ("ttft_cdf.png", "tbt_cdf.png", "load.png"):
        assert (tmp_path / plot).read_bytes()[:4] == b"\x89PNG", plot


@pytest.mark.parametrize("engine", ["coupled", "coupled-chunked"])
def test_replay_coupled_engines(engine: str) -> None:
    """The vLLM-style baseline runs on --prefill + --decode instances and serves every request that
    fits (none is rejected after a prefill); its summary is the library's own replay of the same
    workload, and the table names the cluster it ran."""
    table = run("replay.py", *SMALL, "--prefill", "1", "--decode", "1", "--engine", engine)
    assert f"2 coupled llama3-70b instances on 8xA800 ({engine})" in table.stdout
    assert "TTFT" in table.stdout and "TBT" in table.stdout
    summary = json.loads(
        run("replay.py", *SMALL, "--prefill", "1", "--decode", "1", "--engine", engine, "--json").stdout
    )
    assert summary["num_requests"] == 150 and summary["rejected_after_prefill"] == 0
    assert summary["completed"] + summary["rejected_before_prefill"] == 150 and summary["completed"] > 0
    requests = generate_requests(preset("synthetic"), num_requests=150, arrivals=ArrivalProcess(rate_per_s=2), seed=0)
    spec = CoupledSpec(
        num_instances=2, model=MODELS["llama3-70b"], hardware=HARDWARE["8xA800"], chunked_prefill=engine != "coupled"
    )
    expected = CoupledCluster(spec, slo=Slo(ttft_s=30.0, tbt_s=0.1)).run(requests).summary.to_json()
    for drop in (summary, expected):
        drop.pop("sim_wall_s")
    assert summary == json.loads(json.dumps(expected))


@pytest.mark.parametrize("name", ["bad.jsonl", "bad\nname.jsonl"])
def test_replay_reports_a_bad_trace_by_name(tmp_path: Path, name: str) -> None:
    """The file and line, in one line on stderr even when the file's name holds a line break (shown escaped)."""
    trace = tmp_path / name
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{oops\n')
    done = run("replay.py", "--trace", str(trace), check=False)
    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1 and f"{ascii(name)[1:-1]}:2:" in done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trace", "EMPTY"], "has no requests"),
        ([*SMALL, "--seed", "-1"], "--seed must be >= 0"),
        ([*SMALL, "--cpp", "0"], "--cpp must be >= 1"),
        ([*SMALL, "--prefill", "-3"], "--prefill must be >= 0"),
        ([*SMALL, "--speedup", "inf"], "--speedup must be a finite number > 0"),
        ([*SMALL, "--cache-blocks", "-3"], "--cache-blocks must be >= 0, got -3"),
        ([*SMALL, "--ttft-slo", "-1"], "--ttft-slo must be a finite number > 0, got -1.0"),
        ([*SMALL[:-1], "-5"], "--rate must be a number in [1e-06, 1e+06], got -5"),
        (["--trace", "ONE", "--rate", "2"], "--rate sets a generated workload's arrivals"),  # it was ignored
        ([*SMALL, "--cpp", "4", "--prefill", "6"], "--cpp 4 must divide --prefill 6"),
        ([*SMALL, "--threshold", "0.5"], "--threshold must be a number >= 1"),
        ([*SMALL, "--block-size", "0"], "--block-size must be >= 1, got 0"),
        ([*SMALL, "--skip-invalid"], "--skip-invalid reads around a --trace's malformed lines"),
        ([*SMALL, "--time-unit", "s"], "--time-unit s says what a --trace's timestamps count"),
        (["--trace", "AT_ONCE"], "its 3 arrivals span 0 s; give --prefill and --decode"),  # sized 1.7e11 nodes
        # Arrivals past 2**43 ms, the bound on a trace's timestamps: the replay once hung in its load sampling.
        ([*SMALL, "--speedup", "1e-100"], "--speedup 1e-100 puts the last of 150 arrivals (--rate 2) at 8.26e+101 s"),
        (["--trace", "LATER", "--speedup", "1e-100"], "later.jsonl:2: arrival 3000 ms at speedup 1e-100 is 3e+100 s"),
    ],
)
def test_replay_refuses_bad_options_by_name(args: list[str], message: str, tmp_path: Path) -> None:
    """One line naming the option, exit status 2, and nothing run (an empty trace once printed a table of zeros)."""
    traces = {name: tmp_path / f"{name.lower()}.jsonl" for name in ("EMPTY", "ONE", "AT_ONCE", "LATER")}
    traces["EMPTY"].write_text("")
    line = '{"timestamp": 0, "input_length": 600, "output_length": 8, "hash_ids": [1, 2]}\n'
    traces["ONE"].write_text(line)
    traces["AT_ONCE"].write_text(line * 3)
    traces["LATER"].write_text(line + line.replace('"timestamp": 0', '"timestamp": 3000'))
    done = run("replay.py", *[str(traces[arg]) if arg in traces else arg for arg in args], check=False, timeout=60)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ("replay.py", *SMALL, "--prefill", "2", "--decode", "2", "--no-progress"),
        ("experiments.py", "threshold", *SMALL, "--thresholds", "1.5", "--no-plots", "--no-progress", "--out", "OUT"),
        ("demo.py", "--num-requests", "50", "--out", "OUT"),
    ],
    ids=["replay", "experiments", "demo"],
)
def test_output_into_a_reader_that_left_ends_quietly_with_141(argv: tuple[str, ...], tmp_path: Path) -> None:
    """stdout a pipe whose reader has exited (`| head`): status 141, as SIGPIPE gives, and nothing on stderr
    (replay.py and experiments.py printed a BrokenPipeError traceback, demo.py an error line with status 2). The
    read end is closed before the program starts, so its first write fails, whenever that comes."""
    script, *rest = (str(tmp_path) if arg == "OUT" else arg for arg in argv)
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, str(ROOT / "examples" / script), *rest], stdout=write, stderr=subprocess.PIPE, timeout=300
        )
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, b"")


def test_experiments_refuse_an_output_path_that_is_a_file_before_running(tmp_path: Path) -> None:
    out = tmp_path / "taken"
    out.write_text("mine")
    done = run("experiments.py", "scheduling", *SMALL, "--out", str(out), check=False)
    assert done.returncode == 2 and "is a file, not a directory" in done.stderr and out.read_text() == "mine"
    done = run("experiments.py", "scheduling", *SMALL, "--routers", ",", check=False)
    assert done.returncode == 2 and "comma-separated list" in done.stderr


def test_replay_refuses_an_output_path_that_is_a_file_before_running(tmp_path: Path) -> None:
    """--out naming a file, or a path beneath one, is one line and status 2 before the replay (it was
    `[Errno 17] File exists` after it): the trace's bad line, which the run would read first, is never reached."""
    taken = tmp_path / "taken"
    taken.write_text("mine")
    trace = tmp_path / "bad.jsonl"
    trace.write_text("{oops\n")
    for out, message in ((taken, f"--out {taken} is"), (taken / "out", f"--out {taken / 'out'}: {taken} is")):
        done = run("replay.py", "--trace", str(trace), "--out", str(out), check=False)
        assert (done.returncode, done.stdout) == (2, "")
        assert done.stderr == f"replay: {message} a file, not a directory\n"
    assert taken.read_text() == "mine"


def generated_trace(path: Path, *options: str) -> Path:
    """`mooncake trace generate` of SMALL's workload, with `options`."""
    argv = ["trace", "generate", "--num-requests", "150", "--rate", "2", *options, "--out", str(path)]
    assert mooncake_main(argv) == 0
    return path


@pytest.mark.parametrize(
    "command",
    [
        ("replay.py", "--prefill", "1", "--decode", "1"),
        ("experiments.py", "scheduling", "--routers", "random", "--prefill", "1", "--decode", "1", "--no-plots"),
    ],
    ids=["replay", "experiments"],
)
def test_a_trace_generated_in_other_blocks_replays_with_its_block_size(
    tmp_path: Path, command: tuple[str, ...]
) -> None:
    """`mooncake trace generate --block-size 64` wrote a trace these tools could not read (the error's hint
    named a --block-size they did not have); with it, they replay it."""
    trace = generated_trace(tmp_path / "b64.jsonl", "--block-size", "64")
    script, *rest = command
    argv = [*rest, "--trace", str(trace), "--json", *(["--out", str(tmp_path)] if script == "experiments.py" else [])]
    refused = run(script, *argv, check=False)
    assert refused.returncode == 2 and "--block-size" in refused.stderr
    done = run(script, *argv, "--block-size", "64")
    assert done.stderr == "" and json.loads(done.stdout)


def test_skip_invalid_replays_around_a_bad_line_naming_it(tmp_path: Path) -> None:
    """--skip-invalid leaves a malformed line out and names it on stderr, as `mooncake trace` does."""
    trace = generated_trace(tmp_path / "t.jsonl")
    lines = trace.read_text().splitlines(keepends=True)
    trace.write_text("".join([*lines[:2], "{oops\n", *lines[2:]]))
    assert run("replay.py", "--trace", str(trace), check=False).returncode == 2
    done = run("replay.py", "--trace", str(trace), "--prefill", "1", "--decode", "1", "--json", "--skip-invalid")
    assert done.stderr.startswith(f"replay: skipped {trace}:3: invalid JSON") and done.stderr.count("\n") == 1
    assert json.loads(done.stdout)["num_requests"] == 150


def test_a_sped_up_replay_names_a_skipped_line_once(tmp_path: Path) -> None:
    """At a --speedup other than 1 the trace was read twice (at its speed, and at speed 1 to size the cluster), and
    each skipped line was named twice. It is read once: the replay at --speedup is the one read at speed 1, sped up,
    and its summary what it was."""
    trace = generated_trace(tmp_path / "t.jsonl")
    lines = trace.read_text().splitlines(keepends=True)
    trace.write_text("".join([*lines[:2], "{oops\n", *lines[2:]]))
    done = run("replay.py", "--trace", str(trace), "--speedup", "2", "--json", "--skip-invalid")
    assert done.stderr.startswith(f"replay: skipped {trace}:3: invalid JSON") and done.stderr.count("\n") == 1
    assert json.loads(done.stdout)["num_requests"] == 150


def test_num_requests_reads_only_the_first_lines_of_a_trace(tmp_path: Path) -> None:
    """--num-requests N replays the trace's first N requests, reading (and checking) no line past them: a bad
    line after them does not fail the run."""
    trace = generated_trace(tmp_path / "t.jsonl")
    trace.write_text(trace.read_text() + "{oops\n")
    done = run("replay.py", "--trace", str(trace), "--num-requests", "40", "--prefill", "1", "--decode", "1", "--json")
    assert done.stderr == "" and json.loads(done.stdout)["num_requests"] == 40


def test_a_trace_timed_in_seconds_replays_with_time_unit(tmp_path: Path) -> None:
    """A trace in seconds (Qwen-Bailian's timing), replayed with --time-unit s, gives the summary of the same trace
    in milliseconds; without it the replay warns on stderr once, naming --time-unit s."""
    trace = generated_trace(tmp_path / "ms.jsonl")
    rows = [json.loads(row) for row in trace.read_text().splitlines()]
    seconds = tmp_path / "s.jsonl"
    seconds.write_text("".join(json.dumps({**row, "timestamp": row["timestamp"] / 1000}) + "\n" for row in rows))
    cluster = ("--prefill", "1", "--decode", "1", "--json")

    def summary(stdout: str) -> dict[str, object]:
        return {k: v for k, v in json.loads(stdout).items() if k != "sim_wall_s"}  # all but the run's own time

    as_ms = summary(run("replay.py", "--trace", str(trace), *cluster).stdout)
    done = run("replay.py", "--trace", str(seconds), "--time-unit", "s", *cluster)
    assert done.stderr == "" and summary(done.stdout) == as_ms
    misread = run("replay.py", "--trace", str(seconds), *cluster)
    assert misread.stderr.startswith(f"replay: warning: {seconds}:") and "--time-unit s" in misread.stderr


def example(name: str) -> ModuleType:
    """The example script `name` as a module (examples/ is its folder's imports' root)."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "examples"))


def test_the_block_size_keys_the_workload_and_sizes_the_clusters_blocks(tmp_path: Path) -> None:
    """--block-size applies to a generated workload as `mooncake trace generate --block-size` generates it (the
    same keys as the trace it writes), each request says its block size, and the simulated cluster caches
    --cache-blocks blocks of that size."""
    simulation = example("simulation")
    parser = argparse.ArgumentParser()
    simulation.add_workload_options(parser)
    simulation.add_cluster_options(parser)
    trace = generated_trace(tmp_path / "b64.jsonl", "--preset", "conversation", "--block-size", "64")
    small = ["--num-requests", "150", "--rate", "2", "--block-size", "64", "--cache-blocks", "1000"]
    generated = simulation.load_workload(parser.parse_args(["--preset", "conversation", *small]))
    args = parser.parse_args(["--trace", str(trace), "--block-size", "64", "--cache-blocks", "1000"])
    read = simulation.load_workload(args)
    assert [(r.input_length, r.output_length, r.block_keys) for r in read] == [
        (r.input_length, r.output_length, r.block_keys) for r in generated
    ]
    assert {r.block_size_tokens for r in [*read, *generated]} == {64}
    spec = simulation.cluster_spec(read, args)
    assert (spec.block_size_tokens, spec.cache_capacity_tokens) == (64, 64_000)


def interrupt() -> None:
    raise KeyboardInterrupt


def terminate() -> None:
    signal.raise_signal(signal.SIGTERM)


@pytest.mark.parametrize(
    ("name", "argv", "body"),
    [
        ("replay", [*SMALL], "run"),
        ("experiments", ["scheduling", *SMALL], "EXPERIMENTS"),
        ("demo", ["--num-requests", "5"], "tour"),
    ],
    ids=["replay", "experiments", "demo"],
)
@pytest.mark.parametrize("stop", [interrupt, terminate], ids=["Ctrl-C", "SIGTERM"])
@pytest.mark.usefixtures("sigterm_fails_the_test")
def test_the_examples_stop_on_a_signal_in_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    name: str,
    argv: list[str],
    body: str,
    stop: Callable[[], None],
) -> None:
    """Stopped mid-run, an example ends as the `mooncake` command does: Ctrl-C with status 130 and one line
    (it was a KeyboardInterrupt traceback), SIGTERM as SystemExit(143), which unwinds its atomic writes."""
    module = example(name)

    def stopped(*_: object) -> object:
        stop()
        return None

    if body == "EXPERIMENTS":
        monkeypatch.setitem(module.EXPERIMENTS, "scheduling", stopped)
    else:
        monkeypatch.setattr(module, body, stopped)
    argv = [*argv, "--out", str(tmp_path / "out")]
    if stop is interrupt:
        try:
            status = module.main(argv)
        except KeyboardInterrupt:  # let out, it would end the test run
            pytest.fail(f"{name} let KeyboardInterrupt out: a traceback")
        assert status == 130
        assert capsys.readouterr().err == f"{name}: interrupted\n"
    else:
        with pytest.raises(SystemExit) as caught:
            module.main(argv)
        assert caught.value.code == 143
    assert list(tmp_path.iterdir()) == []  # the --out folder made to write the set in is gone with it


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("predictors", "--sample-every", "0"), "argument --sample-every: must be a finite number > 0, got '0'"),
        (("predictors", "--horizons=1,-1"), "argument --horizons: must be a finite number >= 0 and <= 8.796e+09"),
        # Past 2**43 ms, the latest arrival a replay times: the replay once hung in its load sampling.
        (("predictors", "--horizons=1e300"), "argument --horizons: must be a finite number >= 0 and <= 8.796e+09"),
        (("predictors", "--sample-every", "1e-9"), "snapshots of the"),
        (("cache", "--nodes", "2,0"), "argument --nodes: must be an integer >= 1 and <= 1024, got '0'"),
        (("cache", "--nodes", "1" + "0" * 400), "argument --nodes: must be an integer >= 1 and <= 1024, got '1000"),
        (("throughput", "--ttft-slo-factor", "-1"), "argument --ttft-slo-factor: must be a finite number >= 0"),
        (("threshold", "--thresholds", "0.5"), "argument --thresholds: must be a number >= 1"),
        (("overload", "--speedups=2,nan"), "argument --speedups: must be a finite number > 0, got 'nan'"),
        # The JSON is keyed by value: a repeat was a row of the table and no key of the JSON.
        (("overload", "--speedups=2,3,2.0"), "argument --speedups: 2.0 is given twice in '2,3,2.0'"),
        (("cache", "--capacities", "0,100,0"), "argument --capacities: 0 is given twice in '0,100,0'"),
    ],
)
def test_experiments_refuse_out_of_range_values_by_name(argv: tuple[str, ...], message: str, tmp_path: Path) -> None:
    """An experiment's own options are bounded before anything runs: --sample-every 0 once sampled until the
    kernel killed the process, a negative horizon was a traceback, a negative factor silently meant another SLO."""
    done = run("experiments.py", *argv, *SMALL, "--out", str(tmp_path), "--no-progress", check=False, timeout=60)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not any(tmp_path.iterdir())


def test_predictors_samples_a_span_below_the_clocks_resolution_once(tmp_path: Path) -> None:
    """Arrivals all at 10^6 s and a sampling step that adding to that clock leaves it unchanged: one snapshot
    time (the sampling loop once added the step for ever)."""
    trace = tmp_path / "trace.jsonl"
    lines = [
        json.dumps({"timestamp": 1e9, "input_length": 600, "output_length": 20, "hash_ids": [2 * i, 2 * i + 1]})
        for i in range(10)
    ]
    trace.write_text("\n".join(lines) + "\n")
    done = run(
        "experiments.py",
        "predictors",
        "--trace",
        str(trace),
        "--sample-every",
        "1e-11",
        "--horizons",
        "1",
        "--prefill",
        "1",
        "--decode",
        "1",
        "--out",
        str(tmp_path / "out"),
        "--no-plots",
        "--json",
        "--no-progress",
        timeout=60,  # it takes a second; the old loop never ended
    )
    assert "mae" in json.loads(done.stdout)


@pytest.mark.parametrize(
    ("experiment", "extra", "key"),
    [
        (
            "scheduling",
            ["--routers", "random,kvcache_centric,examples/policies/two_choices.py:TwoChoices"],
            "mean_ttft_s",
        ),
        ("rejection", [], "rejected"),
        ("cache", ["--capacities", "100,1000"], "hit_ratio"),
        ("throughput", ["--lengths", "16384", "--throughput-requests", "20", "--tbt-thresholds", "0.1"], "max_rps"),
        ("threshold", ["--thresholds", "1.5,inf"], "mean_ttft_s"),
        ("overload", ["--speedups", "1.5,3"], "oscillation"),
        ("predictors", ["--horizons", "1,5"], "mae"),
    ],
)
def test_experiment_prints_json_and_writes_plots(experiment: str, extra: list[str], key: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "examples/experiments.py", experiment, *SMALL, *extra, "--out", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        cwd=ROOT,
    )
    report = json.loads(done.stdout)
    assert key in report
    assert json.loads((tmp_path / f"{experiment}.json").read_text())[key] == report[key]
    # The set experiments.py puts in place, and removes an older run's files of: the names it declares (PLOTS).
    written = {path.name for path in tmp_path.iterdir()}
    assert written == {f"{experiment}.json", *example("experiments").PLOTS[experiment]}


def test_cache_says_so_when_no_cell_has_a_hit_to_compare(tmp_path: Path) -> None:
    """A workload that shares no prefix (every hash id its own) hits in neither mode: the experiment says there is
    nothing to compare, marks no cell the largest, and its JSON's `largest_ratio` is null."""
    lines = [
        json.dumps({"timestamp": 500 * i, "input_length": 1024, "output_length": 8, "hash_ids": [2 * i, 2 * i + 1]})
        for i in range(60)
    ]
    trace = tmp_path / "unique.jsonl"
    trace.write_text("".join(f"{line}\n" for line in lines))
    argv = ["cache", "--trace", str(trace), "--capacities", "100,1000", "--no-plots", "--out", str(tmp_path)]
    done = run("experiments.py", *argv)
    assert "no comparison" in done.stdout and "<- largest" not in done.stdout and "nan" not in done.stdout
    assert json.loads(run("experiments.py", *argv, "--json").stdout)["largest_ratio"] is None


@pytest.mark.parametrize(
    ("router", "named"),
    [
        ("kvcache_centric", "(local caches: local_cache_aware)"),
        # a named router that never transfers is refused (tests/test_experiment_options.py); a file's is run
        (
            "examples/policies/two_choices.py:TwoChoices",
            "(local caches: examples/policies/two_choices.py:TwoChoices, no transfers)",
        ),
    ],
)
def test_cache_names_the_router_its_local_caches_run(router: str, named: str, tmp_path: Path) -> None:
    """Both modes run --router, the local caches with no transfers, which makes the default router the
    local-cache-aware one; the header says so (it said local_cache_aware whatever --router was), and its
    cluster line leaves the swept prefill nodes and capacities to the rows."""
    argv = ["cache", *SMALL, "--router", router, "--nodes", "1", "--capacities", "100", "--no-plots"]
    done = subprocess.run(
        [sys.executable, "examples/experiments.py", *argv, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        cwd=ROOT,
    )
    lines = done.stdout.splitlines()
    assert lines[2] == f"router {router} {named}"
    assert "decode nodes" in lines[1] and "cache blocks per node as below" in lines[1] and "10,000" not in lines[1]


def test_throughput_labels_each_length_exactly_and_marks_the_rates_at_the_searchs_cap(tmp_path: Path) -> None:
    """Column labels are exact (1000 was "0K", 1536 "1K"); every cell stands apart however wide (65536.0000 ran
    into its neighbour); a rate that is the search's cap is marked a lower bound (>=), its JSON left a number."""
    lengths = (1000, 1536, 16384)
    argv = ["throughput", *SMALL, "--lengths", ",".join(map(str, lengths)), "--throughput-requests", "5"]
    done = run("experiments.py", *argv, "--tbt-thresholds", "0.1", "--no-plots", "--out", str(tmp_path))
    lines = done.stdout.splitlines()
    assert lines[1].split()[1:4] == ["1000", "1.5K", "16K"], lines[1]
    report = json.loads((tmp_path / "throughput.json").read_text())["max_rps"]
    for config, row in zip(("3P+1D", "2P+2D", "vllm-4", "vllm-4-chunked"), lines[2:6], strict=True):
        name, *cells = row.split()
        assert name == config and len(cells) == len(lengths), row
        for cell, length in zip(cells, lengths, strict=True):
            rate = report[config][str(length)]
            assert cell == (">=65536" if rate == 65536 else f"{rate:.4f}"), (row, rate)
    assert any(">=65536" in row for row in lines[2:6])  # 5 requests: some configuration meets the SLOs at any rate
    assert "(>=: the SLOs held even at the highest rate tried, 65536 req/s" in done.stdout


def test_scheduling_json_has_one_entry_per_router(tmp_path: Path) -> None:
    done = run("experiments.py", "scheduling", *SMALL, "--out", str(tmp_path), "--no-plots", "--json")
    assert set(json.loads(done.stdout)["mean_ttft_s"]) == {
        "random",
        "load_balancing",
        "local_cache_aware",
        "kvcache_centric",
    }
    assert not list(tmp_path.glob("*.png"))
    assert "\r" not in done.stderr  # piped: no progress bar


def reject_all_router(folder: Path) -> str:
    """A router file in `folder` whose router routes nothing (every request rejected), as --router names it."""
    router = folder / "reject_all.py"
    router.write_text(
        "class RejectAll:\n"
        "    def __init__(self, estimator):\n"
        "        pass\n"
        "    def route(self, candidates, query, now, rng):\n"
        "        return None\n"
        "    def observe(self, *, had_transfer, estimated_ttft_s, observed_ttft_s):\n"
        "        pass\n"
    )
    return f"{router}:RejectAll"


def test_a_router_that_completes_nothing_is_not_ranked_fastest(tmp_path: Path) -> None:
    """Its mean TTFT over no request (0) ranked a router that rejected everything first."""
    reject_all = reject_all_router(tmp_path)
    routers = f"kvcache_centric,{reject_all}"
    done = run("experiments.py", "scheduling", *SMALL, "--routers", routers, "--no-plots", "--no-progress")
    ranking = next(line for line in done.stdout.splitlines() if line.startswith("ranked by mean ttft"))
    assert "RejectAll" not in ranking
    assert f"not ranked by mean TTFT (completed nothing): {reject_all}" in done.stdout


def test_a_ranking_shows_ties_as_ties(monkeypatch: pytest.MonkeyPatch) -> None:
    """Routers with equal figures are joined by '=', so that a tie never reads as an order."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    from paper.scheduling import ranked

    values = {"a": 0.9972451790633609, "b": 0.9972451790633609, "c": 0.5, "d": 0.1}
    assert ranked(["a", "b", "c", "d"], values, " > ") == "a = b > c > d"
    assert ranked(["d", "c"], values, " < ") == "d < c"
    assert ranked([], {}, " < ") == ""


def run_on_terminal(script: str, *args: str) -> tuple[int, str, str]:
    """Run an example with stdout and stderr each on a pseudo-terminal: (exit status, stdout, stderr)."""
    masters, slaves = zip(*(pty.openpty() for _ in range(2)), strict=True)
    captured: list[bytearray] = [bytearray(), bytearray()]

    def drain(fd: int, into: bytearray) -> None:
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the terminal's other side closed
                return
            if not chunk:
                return
            into.extend(chunk)

    readers = [threading.Thread(target=drain, args=pair, daemon=True) for pair in zip(masters, captured, strict=True)]
    for reader in readers:
        reader.start()
    try:
        done = subprocess.run(
            [sys.executable, str(ROOT / "examples" / script), *args],
            stdout=slaves[0],
            stderr=slaves[1],
            timeout=300,
            check=False,
        )
    finally:
        for fd in slaves:
            os.close(fd)
        for reader in readers:
            reader.join(timeout=10)
        for fd in masters:
            os.close(fd)
    out, err = (bytes(c).decode().replace("\r\n", "\n") for c in captured)
    return done.returncode, out, err


def test_replays_draw_progress_bars_on_a_terminal_unless_asked_not_to(tmp_path: Path) -> None:
    """On a terminal each replay of an experiment draws a bar on stderr, named after its policy, that ends full;
    --no-progress silences them (the piped case is checked above)."""
    argv = ("experiments.py", "scheduling", *SMALL, "--routers", "random,kvcache_centric", "--no-plots")
    status, out, err = run_on_terminal(*argv, "--out", str(tmp_path / "bars"))
    assert status == 0, err
    assert "\rrouter kvcache_centric [" in err and "] 150/150\n" in err
    assert "kvcache_centric" in out and "[#" not in out
    status, out, err = run_on_terminal(*argv, "--out", str(tmp_path / "quiet"), "--no-progress")
    assert (status, err) == (0, "")
    status, _out, err = run_on_terminal("replay.py", *SMALL, "--prefill", "1", "--decode", "1")
    assert status == 0 and err.endswith("] 150/150\n") and "\rreplay (disaggregated) [" in err


def test_unknown_router_file_is_a_clear_error(tmp_path: Path) -> None:
    done = run("replay.py", *SMALL, "--router", str(tmp_path / "missing.py:Router"), check=False)
    assert done.returncode == 2 and "missing.py" in done.stderr


def test_a_router_module_that_is_not_there_or_a_factory_that_takes_other_arguments_is_a_clear_error(
    tmp_path: Path,
) -> None:
    """A package.module:FACTORY whose module does not import, and a factory whose constructor does not take the
    estimator alone, end with an error naming them, not a traceback."""
    done = run("replay.py", *SMALL, "--router", "no_such_package.routers:Router", check=False)
    assert done.returncode == 2 and "router module no_such_package.routers not found" in done.stderr
    assert "Traceback" not in done.stderr
    factory = tmp_path / "mine.py"
    factory.write_text("class Mine:\n    def __init__(self, estimator, depth):\n        pass\n")
    done = run("replay.py", *SMALL, "--router", f"{factory}:Mine", check=False)
    assert done.returncode == 2 and "router factory Mine(estimator, depth) cannot be called" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (("replay.py", "--engine", "coupled", "--router", "random"), "--router does not apply to --engine coupled"),
        (("replay.py", "--engine", "coupled-chunked", "--local-cache"), "--local-cache does not apply"),
        (("replay.py", "--config", "examples/configs/tiny.toml", "--tbt-slo", "0.5"), "--tbt-slo does not apply"),
        (("experiments.py", "scheduling", "--router", "random"), "--router does not apply to scheduling"),
        (("experiments.py", "rejection", "--admission", "baseline"), "--admission does not apply to rejection"),
        (("experiments.py", "overload", "--speedup", "-5"), "--speedup does not apply to overload"),
        (
            ("replay.py", "--predictor", "expected_output"),
            "--predictor does not apply to --admission early_rejection",
        ),
        (("experiments.py", "cache", "--predictor", "expected_output"), "--predictor does not apply"),
        (("replay.py", "--engine", "coupled", "--predictor", "expected_output"), "--predictor does not apply"),
        (("replay.py", "--engine", "coupled", "--admission-wait", "5"), "--admission-wait does not apply"),
        (("replay.py", "--config", "examples/configs/tiny.toml", "--admission-wait", "5"), "--admission-wait does"),
        (("replay.py", "--admission-wait", "-1"), "--admission-wait must be a finite number of seconds >= 0, got -1"),
        (("experiments.py", "cache", "--admission-wait", "nan"), "--admission-wait must be a finite number"),
        # Swept by the experiment, so accepted and ignored (the cache header even printed the blocks given).
        # Only a --config cluster's workload is scaled: without one they were accepted, even invalid, and ignored.
        (("replay.py", "--length-scale", "nan"), "--length-scale does not apply without --config"),
        (("replay.py", "--max-output-tokens", "-3"), "--max-output-tokens does not apply without --config"),
        (("experiments.py", "threshold", "--router", "random"), "--router does not apply to threshold"),
        (("experiments.py", "threshold", "--threshold", "7"), "--threshold does not apply to threshold"),
        (("experiments.py", "cache", "--cache-blocks", "7"), "--cache-blocks does not apply to cache"),
        (("experiments.py", "cache", "--local-cache"), "--local-cache does not apply to cache"),
        # Only kvcache_centric reads the threshold, and only with a global pool; a file router is not passed it.
        (("replay.py", "--router", "random", "--threshold", "3"), "--threshold does not apply to --router random"),
        (("replay.py", "--local-cache", "--threshold", "3"), "--threshold does not apply with --local-cache"),
        (
            ("replay.py", "--router", "examples/policies/two_choices.py:TwoChoices", "--threshold", "3"),
            "--threshold does not apply to --router examples/policies/two_choices.py:TwoChoices",
        ),
        (("experiments.py", "rejection", "--router", "random", "--threshold", "2"), "--threshold does not apply to"),
        (("experiments.py", "throughput", "--local-cache", "--threshold", "2"), "--threshold does not apply with"),
        (
            ("experiments.py", "scheduling", "--routers", "random,load_balancing", "--threshold", "2"),
            "--threshold does not apply to --routers random,load_balancing",
        ),
    ],
)
def test_an_option_the_run_would_not_use_is_an_error(argv: tuple[str, ...], named: str) -> None:
    """Options an engine, a config or an experiment sets itself were accepted and ignored, so results looked made
    with a setting they were not; they are a one-line error naming the option."""
    script, *rest = argv
    done = run(script, *rest, *SMALL, "--no-progress", check=False)
    assert done.returncode == 2 and named in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (("--engine", "coupled", "--router", "kvcache_centric"), "--router does not apply to --engine coupled"),
        (("--engine", "coupled-chunked", "--global-pool"), "--global-pool does not apply to --engine coupled-chunked"),
        (("--engine", "coupled", "--admission-wait", "0"), "--admission-wait does not apply to --engine coupled"),
        (("--config", "examples/configs/tiny.toml", "--prefill", "0"), "--prefill does not apply with --config"),
        (("--predictor", "uniform"), "--predictor does not apply to --admission early_rejection"),
        (("--length-scale", "0.03125"), "--length-scale does not apply without --config"),  # 1/32
    ],
)
def test_replay_refuses_an_option_it_would_not_use_at_its_default_value_too(argv: tuple[str, ...], named: str) -> None:
    """replay.py compared values with the defaults, so an option given with its default value passed and was
    ignored; it is refused as experiments.py refuses it (`simulation.given_options`)."""
    done = run("replay.py", *argv, *SMALL, "--no-progress", check=False, timeout=60)
    assert done.returncode == 2 and named in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_replay_waits_for_decode_room_when_told() -> None:
    """A decode side that binds (one decode node, 20 requests/s): with --admission-wait the requests refused for
    decode room wait for it, before any prefill, and more complete within their SLOs; with none (the default,
    the paper's), they are rejected at once."""
    # 8 prefill nodes: the synthetic preset, refitted to the public trace, hits the cache less in its first seconds,
    # so with 4 the prefill side binds first and every refusal is for TTFT, which waiting does not help.
    load = ("--preset", "synthetic", "--num-requests", "300", "--rate", "20", "--prefill", "8", "--decode", "1")
    at_once, waiting = (
        json.loads(run("replay.py", *load, "--admission-wait", wait, "--json", "--no-progress").stdout)
        for wait in ("0", "30")
    )
    assert at_once["rejected_before_prefill"] > waiting["rejected_before_prefill"]
    assert waiting["completed"] > at_once["completed"] and waiting["slo_attainment"] > at_once["slo_attainment"]
    assert at_once["wasted_prefill_s"] == waiting["wasted_prefill_s"] == 0


def test_a_router_file_loads_as_a_script_would(tmp_path: Path) -> None:
    """A router file with a dataclass under `from __future__ import annotations` (dataclasses look the module up
    in sys.modules) that imports a sibling module runs; one with a syntax error is a one-line error naming the
    line."""
    (tmp_path / "helper.py").write_text(
        "from mooncake.sched.router import LoadBalancingRouter\n\n\ndef base(estimator):\n"
        "    return LoadBalancingRouter(estimator)\n"
    )
    (tmp_path / "mine.py").write_text(
        "from __future__ import annotations\n\nimport dataclasses\n\nfrom helper import base\n\n\n"
        "@dataclasses.dataclass\nclass Options:\n    depth: int = 1\n\n\n"
        "def Router(estimator):\n    return base(estimator)\n"
    )
    done = run("replay.py", *SMALL, "--router", f"{tmp_path / 'mine.py'}:Router", check=False)
    assert done.returncode == 0, done.stderr
    (tmp_path / "broken.py").write_text("def Router(estimator):\n    return (\n")
    done = run("replay.py", *SMALL, "--router", f"{tmp_path / 'broken.py'}:Router", check=False)
    assert done.returncode == 2 and "broken.py, line" in done.stderr and "Traceback" not in done.stderr


def test_profile_engine_fits_and_writes_cost_models(tmp_path: Path) -> None:
    """profile_engine.py measures the tiny model and writes fits that the cost-model readers accept."""
    pytest.importorskip("torch")
    from mooncake.sched.cost import FittedPrefillModel
    from mooncake.sched.step import FittedStepModel

    out = tmp_path / "tiny.json"
    run(
        "profile_engine.py",
        "--lengths",
        "32,64,96",
        "--prefix-fractions",
        "0,0.5",
        "--batches",
        "1,2",
        "--repeats",
        "1",
        "--out",
        str(out),
    )
    data = json.loads(out.read_text())
    prefill = FittedPrefillModel.from_json(json.dumps(data["prefill"]))
    assert len(data["prefill_samples"]) == 6 and prefill.prefill_s(64) >= 0
    # Without --config, the engines a cluster of the preset runs by default (tiny.toml's too): the cluster takes it.
    assert (data["model"], data["block_tokens"], data["chunk_tokens"]) == ("tiny", 16, 512)
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from serving.config import load_config
        from serving.models import cost_models
    finally:
        sys.path.remove(str(ROOT / "examples"))
    cluster = load_config(ROOT / "examples" / "configs" / "tiny.toml").with_overrides("prefill", profile=str(out))
    assert cost_models(cluster)[0] == prefill
    step = FittedStepModel(coefficients=tuple(data["decode"]["coefficients"]))
    assert len(data["decode_samples"]) == 6 and step.step_s(2, 100) >= 0


def test_profile_engine_profiles_a_cluster_configs_engines(tmp_path: Path) -> None:
    """--config: the cluster's model, block size and limits (lengths above max_prompt_tokens left out)."""
    pytest.importorskip("torch")
    config = tmp_path / "tiny.toml"
    text = (ROOT / "examples" / "configs" / "tiny.toml").read_text()
    config.write_text(text.replace("block_tokens = 16", "block_tokens = 8"))
    out = tmp_path / "profile.json"
    args = ["--lengths", "32,64,96,5000", "--prefix-fractions", "0,0.5", "--batches", "1,2,64", "--repeats", "1"]
    run("profile_engine.py", "--config", str(config), *args, "--out", str(out))
    data = json.loads(out.read_text())
    assert data["block_tokens"] == 8 and data["chunk_tokens"] == 512 and data["model"].startswith("tiny")
    assert {n for n, _, _ in data["prefill_samples"]} == {32, 64, 96}  # 5000 > max_prompt_tokens
    assert {b for b, _, _ in data["decode_samples"]} == {1, 2}  # 64 > max_batch_size


@pytest.mark.serial  # a stage process, with timeouts
def test_profile_engine_profiles_a_cpp_clusters_prefill_through_its_group(tmp_path: Path) -> None:
    """--config with `[prefill] pipeline_size = 2`: the prefill instance is a chunked pipeline group, and so is
    the profiled engine (this process and one stage process), so the prefill fit is the group's time; the
    JSON says on how many processes its prefills ran."""
    pytest.importorskip("torch")
    config = tmp_path / "cpp.toml"
    text = (ROOT / "examples" / "configs" / "tiny.toml").read_text()
    assert "pipeline_size = 1" in text
    config.write_text(text.replace("pipeline_size = 1", "pipeline_size = 2"))
    out = tmp_path / "profile.json"
    args = ["--lengths", "32,64", "--prefix-fractions", "0,0.5", "--batches", "1,2", "--repeats", "1"]
    done = run("profile_engine.py", "--config", str(config), *args, "--out", str(out))
    assert "chunked pipeline group of 2 processes" in done.stdout
    data = json.loads(out.read_text())
    assert data["pipeline_size"] == 2 and len(data["prefill_samples"]) == 4


def test_replay_simulates_a_cluster_config_on_its_profile(tmp_path: Path) -> None:
    """replay.py --config: the example cluster's twin replays the scaled workload on the profile's models."""
    pytest.importorskip("aiohttp")  # the cluster's config reader lives beside its gateway
    from mooncake.sched.cost import FittedPrefillModel
    from mooncake.sched.step import FittedStepModel

    profile = tmp_path / "profile.json"
    prefill = FittedPrefillModel(coefficients=(0.004, 1e-5, 0.0))
    step = FittedStepModel(coefficients=(0.002, 1e-4, 0.0))
    profile.write_text(json.dumps({"prefill": json.loads(prefill.to_json()), "decode": json.loads(step.to_json())}))
    config = str(ROOT / "examples" / "configs" / "tiny.toml")
    done = run("replay.py", "--config", config, "--profile", str(profile), *SMALL, "--json")
    summary = json.loads(done.stdout)
    assert summary["num_requests"] == 150 and summary["completed"] == 150
    assert summary["tbt_s"]["p50"] >= step.step_s(1, 0) and 0 < summary["cache_hit_ratio"] < 1
    table = run("replay.py", "--config", config, *SMALL).stdout
    assert "tiny.toml: 2P+1D" in table and "analytic CPU cost models" in table
    alone = run("replay.py", "--profile", str(profile), *SMALL, check=False)
    assert alone.returncode == 2 and "--profile needs --config" in alone.stderr
    coupled = run("replay.py", "--config", config, "--engine", "coupled", *SMALL, check=False)
    assert coupled.returncode == 2 and "--engine coupled" in coupled.stderr


@pytest.mark.serial  # two real clusters over HTTP
def test_validate_compares_the_real_cluster_with_its_simulation(tmp_path: Path) -> None:
    """A shortened validate.py: profiling, the real cluster over HTTP and its simulated twin, the keys the
    issue names for the serviceable and the overload run, the calibration's jitter (the figures themselves are
    not asserted here)."""
    pytest.importorskip("torch")
    pytest.importorskip("aiohttp")
    out = tmp_path / "out"
    # --repeat-real (a third real cluster) is left to test_tools_options, with the runs faked: CI's time.
    options = ["--num-requests", "12", "--rate", "4", "--overload-speedup", "4", "--json"]
    options += ["--out", str(out)]
    summary = json.loads(run("validate.py", *options).stdout)
    keys = (
        "ttft_median_rel_error",
        "ttft_p90_rel_error",
        "tbt_mean_rel_error",
        "same_route_fraction",
        "hit_ratio_real",
        "hit_ratio_sim",
        "rejected_real",
        "rejected_sim",
    )
    for run_summary in (summary, summary["overload"]):
        assert all(key in run_summary for key in keys), run_summary
        assert run_summary["real"]["num_requests"] == run_summary["sim"]["num_requests"] == 12
        assert 0 <= run_summary["same_route_fraction"] <= 1
    assert summary["compared_requests"] > 0 and summary["ttft_median_rel_error"] >= 0
    for by in ("by_output_tokens", "by_prompt_tokens"):  # every request compared falls in one band
        assert sum(band["count"] for band in summary[by]) == summary["compared_requests"]
    # The overload run's decode batch: one sequence (the config's is 8), with what that limit refuses at the
    # serviceable pace alongside; the objectives are the config's.
    assert summary["decode_max_batch"] == 8 and summary["overload"]["decode_max_batch"] == 1
    assert summary["ttft_slo_s"] == summary["overload"]["ttft_slo_s"] == 30.0
    assert 0 <= summary["overload"]["rejected_sim_unloaded"] <= 12 and "rejected_sim_unloaded" not in summary
    assert 0 < summary["calibration"]["events_per_token"] <= 1
    assert summary["calibration"]["jitter_s"]["intervals"] > 0
    assert json.loads((out / "validate.json").read_text()) == summary
    for name in ("ttft_cdf_serviceable.png", "tbt_cdf_overload.png", "profile.json"):
        assert (out / name).exists(), name


def test_validate_refuses_an_overload_batch_that_is_not_one() -> None:
    """--overload-batch is a decode batch size (0: the config's): a negative one is named, before any work."""
    done = run("validate.py", "--overload-batch", "-2", check=False)
    assert (
        done.returncode == 2 and "--overload-batch must be a batch size, or 0 for the config's, got -2" in done.stderr
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "validate: --overload-speedup must be a finite number > 0, got 0.0"),
        ("nan", "validate: --overload-speedup must be a finite number > 0, got nan"),
        ("1e-100", "validate: --speedup × --overload-speedup 1e-100 puts the last of 5 arrivals (--rate 10) at"),
    ],
)
def test_validate_refuses_an_overload_speedup_before_any_work(value: str, message: str) -> None:
    """--overload-speedup is checked, by its name, before profiling and the real serviceable run (minutes): it
    was checked after them, as a --speedup of the product the user never gave."""
    done = run(
        "validate.py", "--overload-speedup", value, "--num-requests", "5", "--rate", "10", check=False, timeout=60
    )
    assert done.returncode == 2 and done.stderr.startswith(message) and done.stderr.count("\n") == 1, done.stderr


@pytest.mark.serial  # a real cluster over HTTP
def test_load_replays_a_trace_over_http_with_the_replay_summary(tmp_path: Path) -> None:
    """load.py starts a tiny cluster, replays trace lines over HTTP and prints replay.py's summary fields."""
    pytest.importorskip("torch")
    pytest.importorskip("aiohttp")
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 1500, "output_length": 40, "hash_ids": [1, 2, 3]},
        # Three seconds later: the first has long been prefilled and its blocks indexed, even on a busy machine.
        {"timestamp": 3000, "input_length": 1600, "output_length": 40, "hash_ids": [1, 2, 3, 4]},
        {"timestamp": 3100, "input_length": 600, "output_length": 20, "hash_ids": [9, 10]},
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = run("load.py", "--trace", str(trace), "--speedup", "1", "--json", "--out", str(tmp_path / "out"))
    summary = json.loads(done.stdout)
    assert summary["num_requests"] == 3 and summary["completed"] + summary["failed"] <= 3
    assert summary["completed"] == 3, summary
    assert summary["cache_hit_ratio"] > 0  # the second request shares the first's three blocks
    for key in (
        "ttft_s",
        "tbt_s",
        "slo_attainment",
        "goodput_rps",
        "rejected_before_prefill",
        "rejected_after_prefill",
    ):
        assert key in summary
    assert json.loads((tmp_path / "out" / "summary.json").read_text()) == summary


class _NotFound(http.server.SimpleHTTPRequestHandler):
    """Serves an empty folder: 404 to every GET, 501 to a POST; quiet."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def no_gateway(tmp_path: Path) -> Iterator[dict[str, str]]:
    """URLs load.py cannot use: one nothing listens at (a port just freed), one without a scheme, and an HTTP
    server answering 404 (stopped after the test)."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_NotFound, directory=str(tmp_path / "empty"))
    )
    (tmp_path / "empty").mkdir()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield {
            "refused": f"http://127.0.0.1:{port}",
            "no scheme": f"127.0.0.1:{port}",
            "404": f"http://127.0.0.1:{server.server_address[1]}",
        }
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


LOAD_FEW = ("--num-requests", "3", "--rate", "1000", "--timeout", "20")


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("refused", "load: cannot reach http://127.0.0.1:"),
        ("no scheme", "load: --url must be an http:// or https:// URL, such as http://127.0.0.1:8000, got '127.0.0.1:"),
        ("404", "/v1/models answered 404 File not found: is it a gateway?"),
    ],
)
def test_load_says_in_one_line_that_its_url_is_no_gateway(no_gateway: dict[str, str], url: str, message: str) -> None:
    """A --url nothing listens at, one without a scheme, and one answering 404 for the model list: one line naming
    the URL and status 2 (each was an aiohttp traceback)."""
    done = run("load.py", "--url", no_gateway[url], *LOAD_FEW, check=False, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr


def test_load_refuses_an_output_path_that_is_a_file_before_sending(no_gateway: dict[str, str], tmp_path: Path) -> None:
    """--out naming a file is found before any request is sent (it was a FileExistsError after the whole run)."""
    out = tmp_path / "taken"
    out.write_text("mine")
    done = run("load.py", "--url", no_gateway["refused"], "--model", "m", *LOAD_FEW, "--out", str(out), check=False)
    assert done.returncode == 2 and done.stderr == f"load: --out {out} is a file, not a directory\n"
    assert out.read_text() == "mine"


@pytest.mark.parametrize("form", ["table", "--json"])
def test_load_counts_failed_requests_and_exits_1_when_none_completed(no_gateway: dict[str, str], form: str) -> None:
    """Requests that get no answer are counted in the outcomes (the table's line once added up to fewer than the
    arrivals), and a run that completed none exits 1, saying so (it exited 0)."""
    extra = ["--json"] if form == "--json" else []
    done = run("load.py", "--url", no_gateway["refused"], "--model", "m", *LOAD_FEW, *extra, check=False, timeout=60)
    assert done.returncode == 1 and "load: no request completed (3 of 3 failed)" in done.stderr, done.stderr
    if extra:
        summary = json.loads(done.stdout)
        assert (summary["num_requests"], summary["completed"], summary["failed"]) == (3, 0, 3)
    else:
        assert "requests 3: completed 0, rejected before prefill 0, after prefill 0 " in done.stdout
        assert "failed 3 (no answer)" in done.stdout


def test_the_predictor_option_chooses_the_predictive_policys_predictor() -> None:
    """--predictor names the decode load predictor of predictive_early_rejection: the paper's uniform t_d by
    default (the workload's mean output x TBT objective), each request's own output with expected_output."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from serving import registry
    finally:
        sys.path.remove(str(ROOT / "examples"))
    from mooncake.errors import ConfigError
    from mooncake.sched.predictor import ExpectedOutputPredictor, UniformDecodePredictor
    from mooncake.types import Request, Slo

    requests = [
        Request(request_id=f"r{n}", arrival_s=0.0, input_length=10, output_length=n, block_keys=(n,))
        for n in (100, 300)
    ]
    slo = Slo(tbt_s=0.05)
    assert registry.predictor("uniform", requests, slo) == UniformDecodePredictor(decode_s=200 * 0.05, step_s=0.05)
    assert registry.predictor("expected_output", requests, slo) == ExpectedOutputPredictor(step_s=0.05)
    with pytest.raises(ConfigError, match="predictor must be one of uniform, expected_output"):
        registry.predictor("oracle", requests, slo)
    done = run("replay.py", *SMALL, "--admission", "predictive_early_rejection", "--predictor", "expected_output")
    assert done.returncode == 0 and "SLO attainment" in done.stdout


@pytest.mark.parametrize(
    ("argv", "stated"),
    [
        (
            ("replay.py",),
            ["(default: synthetic)", "(default 4000), or the first of a trace (default: all", "(default 4)"],
        ),
        (("load.py",), ["(default: synthetic)", "or the first of a trace (default 100)", "(default 4)"]),
        (("validate.py",), ["(default: conversation)", "or the first of a trace (default 200)", "(default 2)"]),
        (("experiments.py", "rejection"), ["every timestamp (default 2.0)", "TBT_SLO     seconds (default 0.025)"]),
        (("experiments.py", "scheduling"), ["every timestamp (default 1.0)", "TBT_SLO     seconds (default 0.1)"]),
    ],
)
def test_help_states_the_defaults_each_program_runs_with(argv: tuple[str, ...], stated: list[str]) -> None:
    """A program whose workload or objective defaults differ from replay.py's says its own in --help (load.py
    generated 100 requests and validate.py 200 of the conversation preset while their help said 4000 synthetic)."""
    text = " ".join(run(*argv, "--help").stdout.split())  # argparse wraps help lines at the terminal's width
    for phrase in stated:
        assert " ".join(phrase.split()) in text, phrase


@pytest.mark.parametrize(
    ("script", "argv"),
    [
        ("replay.py", ["--trace", "MISSING"]),
        ("experiments.py", ["threshold", "--trace", "MISSING", "--no-plots", "--out", "OUT"]),
        ("load.py", ["--trace", "MISSING"]),
        # demo.py reads no file of the user's: its plot's name taken by a folder fails the write
        ("demo.py", ["--num-requests", "2", "--out", "OUT"]),
    ],
    ids=["replay", "experiments", "load", "demo"],
)
def test_a_file_error_is_worded_as_the_mooncake_command_words_it(
    script: str, argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`file: reason`, as `mooncake` prints it (`mooncake.cli.error_message`): the examples printed Python's
    `[Errno 2] No such file or directory: 'MISSING'` for the same error. A file an option names is named by it
    (`--trace FILE: reason`)."""
    missing, out = tmp_path / "missing.jsonl", tmp_path / "out"
    (out / "capacity.png").mkdir(parents=True)
    argv = [str(missing) if arg == "MISSING" else str(out) if arg == "OUT" else arg for arg in argv]
    done = run(script, *argv, check=False, timeout=120)
    if "--trace" in argv:
        reason = f"--trace {missing}: No such file or directory"
    else:
        reason = f"{out / 'capacity.png'}: Is a directory"
    assert (done.returncode, done.stderr) == (2, f"{Path(script).stem}: {reason}\n")
    status = mooncake_main(["trace", "stats", str(missing)])
    assert (status, capsys.readouterr().err) == (2, f"mooncake: error: {missing}: No such file or directory\n")
