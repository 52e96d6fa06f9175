"""The options replay.py, experiments.py and validate.py share (examples/simulation.py): counts bounded as the
generator can make them, routers resolved before any replay, files named by their option, a trace read once.

Runs that must not replay use experiments.py's guard (`tests.test_experiment_options.guarded`): an option checked
only after a replay shows as the guard's exit instead of the option's one-line error.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.test_examples import SMALL, run
from tests.test_experiment_options import REPLAYED, guarded

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

import simulation  # noqa: E402

HUGE = "99999999999999999999999"  # past sys.maxsize: itertools.islice's bare ValueError
MAX_REQUESTS = 10**6  # `simulation.MAX_REQUESTS`: about five minutes of the generator's (0.3 ms a request)
OVER = str(MAX_REQUESTS + 1)


def one_line_error(done: subprocess.CompletedProcess[str], message: str) -> bool:
    """Status 2, one line on stderr holding `message`, no traceback."""
    return done.returncode == 2 and message in done.stderr and done.stderr.count("\n") == 1


def trace(path: Path, *, bad_line: bool = False, lines: int = 40) -> Path:
    """A small Mooncake-format trace at `path` (with `bad_line`, its fifth line not JSON)."""
    records = [
        json.dumps({"timestamp": 500 * i, "input_length": 1024, "output_length": 8, "hash_ids": [i, i + 1]})
        for i in range(lines)
    ]
    if bad_line:
        records[4] = "not json"
    path.write_text("\n".join(records) + "\n")
    return path


@pytest.mark.parametrize(
    ("argv", "option", "value"),
    [
        (("replay.py", "--trace", "TRACE", "--num-requests", HUGE), "--num-requests", HUGE),
        # generated: the value reached generate_requests, which drew arrivals for minutes
        (("replay.py", "--num-requests", OVER), "--num-requests", OVER),
        (("experiments.py", "scheduling", "--trace", "TRACE", "--num-requests", HUGE), "--num-requests", HUGE),
        (("experiments.py", "throughput", *SMALL, "--throughput-requests", OVER), "--throughput-requests", OVER),
    ],
)
def test_a_count_past_what_the_generator_makes_is_refused_by_name(
    argv: tuple[str, ...], option: str, value: str, tmp_path: Path
) -> None:
    """A count past sys.maxsize was a ValueError traceback (exit 1) with --trace; without, or as
    --throughput-requests, it spun in the generator for minutes. One bound (`simulation.MAX_REQUESTS`), one line."""
    script, *rest = (str(trace(tmp_path / "t.jsonl")) if arg == "TRACE" else arg for arg in argv)
    quiet = "--no-plots" if script == "experiments.py" else "--json"
    done = run(script, *rest, "--no-progress", quiet, check=False, timeout=30)
    bound = f"must be an integer >= 1 and <= {MAX_REQUESTS}, got '{value}'"
    assert one_line_error(done, f"argument {option}: {bound}"), done.stderr
    assert simulation_args(["--num-requests", str(MAX_REQUESTS)]).num_requests == MAX_REQUESTS  # the bound itself


@pytest.mark.parametrize("routers", ["nope", "random,load_balancing,nope"])
def test_every_router_of_routers_is_resolved_before_the_first_replay(routers: str, tmp_path: Path) -> None:
    """A bad --routers item was found when its replay started, after the replays of the routers before it, and
    the error said `router`, not the option."""
    done = guarded("scheduling", *SMALL, "--routers", routers, "--no-plots", out=tmp_path)
    assert done.returncode != REPLAYED, done.stderr
    assert one_line_error(done, "argument --routers: router must be one of random"), done.stderr
    assert "got 'nope'" in done.stderr


@pytest.mark.parametrize("argv", [("replay.py",), ("experiments.py", "rejection", "--no-plots")])
def test_an_unknown_router_is_named_by_its_option(argv: tuple[str, ...], tmp_path: Path) -> None:
    script, *rest = argv
    out = ["--out", str(tmp_path / "out")] if script == "experiments.py" else []
    done = run(script, *rest, *SMALL, *out, "--router", "nope", "--no-progress", check=False, timeout=60)
    assert one_line_error(done, "argument --router: router must be one of random"), done.stderr


def test_overload_reads_the_trace_once(tmp_path: Path) -> None:
    """Each --speedups value read the trace again after the sizing had read it: --skip-invalid named its skipped
    line once per read (N+1 times). Read once now, sped up as `simulation.at_speed` does."""
    bad = trace(tmp_path / "bad.jsonl", bad_line=True)
    done = guarded("overload", "--trace", str(bad), "--skip-invalid", "--speedups", "2,3", "--no-plots", out=tmp_path)
    assert done.returncode == REPLAYED, done.stderr  # the guard: everything before the first replay ran
    assert done.stderr.count("skipped") == 1, done.stderr


def test_sped_up_is_the_workload_read_at_that_speed(tmp_path: Path) -> None:
    """`simulation.sped_up` gives the very floats a read at the speed-up gives (the trace read once instead)."""
    args: Any = simulation_args(["--trace", str(trace(tmp_path / "t.jsonl"))])
    base = simulation.load_workload(args, speedup=1.0)
    assert simulation.sped_up(args, base, 3.0) == simulation.load_workload(args, speedup=3.0)


def simulation_args(argv: list[str]) -> Any:
    import replay

    return replay.parser().parse_args(argv)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--trace", ""), "argument --trace: expected a file name, got ''"),
        (("--config", ""), "argument --config: expected a file name, got ''"),
        (("--config", "examples/configs/tiny.toml", "--profile", ""), "argument --profile: expected a file name"),
        (("--trace", "FOLDER"), "replay: --trace FOLDER: Is a directory"),
        (
            ("--config", "examples/configs/tiny.toml", "--profile", "/nonexistent/profile.json"),
            "replay: --profile /nonexistent/profile.json: No such file or directory",
        ),
    ],
)
def test_a_file_that_cannot_be_read_is_named_by_its_option(argv: tuple[str, ...], message: str, tmp_path: Path) -> None:
    """`--trace ""` and `--config ""` read the current folder (`replay: .: Is a directory`); a folder as --trace
    was named without its option; a missing --profile was blamed on the config's `[prefill] profile`."""
    argv = tuple(str(tmp_path) if arg == "FOLDER" else arg for arg in argv)
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "replay.py"), *argv, "--no-progress"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert one_line_error(done, message.replace("FOLDER", str(tmp_path))), done.stderr


def test_replay_builds_its_conductor_and_coupled_cluster_as_the_experiments_do(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """replay.py rebuilt the Conductor `paper.common.policy_conductor` builds, and the coupled baseline
    `paper.throughput` builds twice: one builder of each now, which every program calls."""
    import replay

    made: list[str] = []
    conductor, coupled = replay.policy_conductor, simulation.coupled_spec
    monkeypatch.setattr(replay, "policy_conductor", lambda *a, **k: made.append("conductor") or conductor(*a, **k))
    monkeypatch.setattr(simulation, "coupled_spec", lambda *a, **k: made.append("coupled") or coupled(*a, **k))
    for engine in ("disaggregated", "coupled-chunked"):
        assert replay.main([*SMALL, "--engine", engine, "--no-progress", "--json"]) == 0
    assert made == ["conductor", "coupled"]
    capsys.readouterr()


@pytest.mark.parametrize("script", ["cluster", "load"])
def test_an_example_client_or_cluster_without_aiohttp_names_the_extra(script: str) -> None:
    """Without the cluster extra (aiohttp), examples/cluster.py and load.py say which extra to install, in one line
    with status 1 (a bare ModuleNotFoundError traceback before), as the library's own imports do."""
    blocked = (
        "import runpy, sys; sys.modules['aiohttp'] = None; sys.argv = [sys.argv[1], '--help']; "
        "sys.path.insert(0, 'examples'); runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    done = subprocess.run(
        [sys.executable, "-c", blocked, f"examples/{script}.py"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == (
        f"{script}: examples/{script}.py needs aiohttp: the cluster extra (pip install -e '.[cluster]' in the checkout)\n"
    )
