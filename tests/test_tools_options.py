"""The options of the real-cluster tools (examples/validate.py, load.py, profile_engine.py, cluster.py): bad input
is refused in one line, exit 2, before any cluster starts or any profiling runs (--rate as replay.py and
`mooncake trace generate` refuse it); and validate.py's comparison plots, counts and exits on the figures it
compares.

Every run here exits before a cluster starts, or replaces the clusters with records of its own (in-process).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

pytest.importorskip("aiohttp")

from mooncake.cli import main as cli_main  # noqa: E402
from mooncake.sched.outcome import Outcome  # noqa: E402
from mooncake.sim.metrics import RequestRecord  # noqa: E402
from mooncake.types import RequestId, Slo  # noqa: E402
from mooncake.workload import ARRIVAL_RANGE  # noqa: E402

PROFILE = {
    "prefill": {"coefficients": [0.0014, 4.9e-06, 7.5e-09], "mean_relative_error": 0.1, "max_relative_error": 0.5},
    "decode": {"coefficients": [0.00039, 1.2e-05, 7.3e-08]},
}


def run(script: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def refused(done: subprocess.CompletedProcess[str], message: str) -> None:
    """One line naming the problem, exit 2, no traceback."""
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr  # argparse's own errors too (its usage block was 20 lines)


def profile_file(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(PROFILE))
    return path


@pytest.mark.parametrize("script", ["load.py", "validate.py"])
@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_timeout_that_is_no_timeout_is_refused(script: str, value: str) -> None:
    """aiohttp takes a total of 0, a negative one or nan as no timeout at all: a stalled stream held the run for
    ever. Refused by its option's name before any work."""
    done = run(script, "--timeout", value)
    refused(done, f"--timeout must be a finite number > 0, got {float(value)}")
    assert done.stderr.count("\n") == 1


@pytest.mark.parametrize("script", ["load.py", "validate.py", "replay.py"])
@pytest.mark.parametrize("value", ["1e7", "1e-9"])
def test_a_rate_out_of_the_generators_range_is_refused_as_trace_generate_refuses_it(
    script: str, value: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """--rate beyond ARRIVAL_RANGE, which all three read through simulation.load_workload, was refused naming
    rate_per_s, ArrivalProcess's field, where `mooncake trace generate` names --rate: both now say one thing,
    the option, the range and the value."""
    low, high = ARRIVAL_RANGE
    problem = f"must be a number in [{low:g}, {high:g}], got "
    done = run(script, "--rate", value)
    refused(done, f"--rate {problem}{float(value):g}")
    assert done.stderr.count("\n") == 1 and "rate_per_s" not in done.stderr
    with pytest.raises(SystemExit) as exit:
        cli_main(["trace", "generate", "--rate", value, "--out", str(tmp_path / "t.jsonl")])
    assert exit.value.code == 2
    assert f"argument --rate: {problem}{value!r}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("script", "message"),
    [
        # named by its option, not blamed on the config's [prefill] profile (`simulation.check_profile`)
        ("load.py", "load: --profile /nonexistent/profile.json: No such file or directory\n"),
        ("validate.py", "validate: --profile /nonexistent/profile.json: No such file or directory\n"),
    ],
)
def test_an_unreadable_profile_is_refused_before_a_cluster_starts(script: str, message: str) -> None:
    """--profile was checked by a worker only (a worker's traceback, then "worker died while starting")."""
    done = run(script, "--num-requests", "2", "--profile", "/nonexistent/profile.json")
    refused(done, message)
    assert "died" not in done.stderr and "Process " not in done.stderr


@pytest.mark.parametrize("option", ["--config", "--profile"])
def test_validate_refuses_an_empty_file_name_by_its_option(option: str) -> None:
    """`--config ""` read the current folder (`validate: .: cannot read the config: Is a directory`)."""
    refused(run("validate.py", option, ""), f"argument {option}: expected a file name, got ''")


def test_validate_reads_its_trace_once(tmp_path: Path) -> None:
    """The serviceable and the overload workloads were each read from the trace: --skip-invalid named its skipped
    line twice. Read once now, the overload sped up from it (`simulation.sped_up`)."""
    lines = [
        json.dumps({"timestamp": 500 * i, "input_length": 64, "output_length": 4, "hash_ids": [i]}) for i in range(9)
    ]
    lines[4] = "not json"
    trace = tmp_path / "bad.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    done = run("validate.py", "--trace", str(trace), "--skip-invalid", "--profile", "/nonexistent/profile.json")
    assert done.returncode == 2 and done.stderr.count("skipped") == 1, done.stderr
    assert "--profile /nonexistent/profile.json" in done.stderr.splitlines()[-1]


def test_validate_checks_the_overload_cluster_before_the_serviceable_run(tmp_path: Path) -> None:
    """An overload decode batch this machine cannot hold was found only when the overload cluster's worker died,
    after profiling and the whole serviceable run."""
    done = run(
        "validate.py", "--overload-batch", "100000", "--num-requests", "2", "--profile", str(profile_file(tmp_path))
    )
    refused(done, "[decode] max_batch_size = 100000")


def test_validate_refuses_prompts_its_cluster_would_refuse(tmp_path: Path) -> None:
    """Prompts over the config's limit got a 400 in the real run (failed, in no figure) while the simulated twin
    served them: the two runs compared different requests."""
    done = run("validate.py", "--max-prompt-tokens", "5000", "--profile", str(profile_file(tmp_path)))
    refused(done, "--max-prompt-tokens 5000 is over")


def test_validate_checks_out_before_profiling(tmp_path: Path) -> None:
    """--out naming a file was found after the profile and both runs (or as the profiler's traceback)."""
    afile = tmp_path / "afile"
    afile.write_text("mine")
    done = run("validate.py", "--no-overload", "--num-requests", "2", "--out", str(afile))
    refused(done, f"--out {afile} is a file")
    assert afile.read_text() == "mine"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--no-overload", "--overload-batch", "1"], "--overload-batch does not apply with --no-overload"),
        (["--no-overload", "--overload-speedup", "nan"], "--overload-speedup does not apply with --no-overload"),
        (["--no-progress"], "--no-progress does not apply to validate.py"),
    ],
)
def test_validate_refuses_options_it_would_ignore(argv: list[str], message: str) -> None:
    refused(run("validate.py", *argv), message)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--no-progress"], "--no-progress does not apply to load.py"),
        (["--ttft-slo", "-1"], "--ttft-slo must be a finite number > 0, got -1.0"),  # named ttft_s, the field
        (["--url", "http://127.0.0.1:9", "--profile", "p.json"], "--profile does not apply with --url"),
    ],
)
def test_load_refuses_options_it_would_ignore_or_misname(argv: list[str], message: str) -> None:
    refused(run("load.py", *argv), message)


def test_load_with_url_does_not_fit_the_config_to_this_machine(tmp_path: Path) -> None:
    """With --url the config gives the objectives alone: a cluster too large for this machine is no error (it
    was refused for this machine's /dev/shm). Nothing listens at the URL, which is the error then."""
    config = tmp_path / "huge.toml"
    config.write_text(
        (EXAMPLES / "configs" / "tiny.toml").read_text().replace("dram_blocks = 512", "dram_blocks = 100000000")
    )
    done = run("load.py", "--url", "http://127.0.0.1:9", "--config", str(config), "--num-requests", "2")
    refused(done, "cannot reach http://127.0.0.1:9/v1/models")


def test_workload_seed_help_names_only_the_workload() -> None:
    """The Conductors keep their own seed: --seed's help said it seeded them too."""
    for script in ("load.py", "validate.py"):
        assert "Conductor" not in run(script, "--help").stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lengths", "abc"], "argument --lengths: must be a comma-separated list of integers >= 1"),
        (["--lengths", "0,16,32"], "argument --lengths: must be a comma-separated list of integers >= 1"),
        (["--prefix-fractions", "x"], "argument --prefix-fractions: must be a comma-separated list of fractions"),
        (["--prefix-fractions", "0,1"], "argument --prefix-fractions: must be a comma-separated list of fractions"),
        (["--repeats", "0"], "argument --repeats: must be an integer >= 1"),
        (["--batches", "0"], "argument --batches: must be a comma-separated list of integers >= 1"),
        (["--lengths", "64", "--batches", "1"], "fitting needs at least 3 samples, got 1"),
        (["--dtype", "foo"], "dtype must be one of"),
    ],
)
def test_profile_engine_refuses_bad_grids_before_profiling(argv: list[str], message: str, tmp_path: Path) -> None:
    """Tracebacks (ValueError, UnboundLocalError, a fit's ConfigError after the profiling) became one line."""
    pytest.importorskip("torch")
    refused(run("profile_engine.py", *argv, "--out", str(tmp_path / "p.json")), message)
    assert not (tmp_path / "p.json").exists()


def test_profile_engine_checks_out_before_profiling(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    afile = tmp_path / "afile"
    afile.write_text("")
    refused(run("profile_engine.py", "--out", str(afile / "p.json")), f"--out {afile} is a file")


def test_profile_engine_keeps_every_prompt_cached_for_the_decoders(tmp_path: Path) -> None:
    """Lengths near the largest evicted each other's prompts from a cache sized for the largest alone, and the
    decode phase failed (UnknownBlockError) after the whole prefill phase."""
    pytest.importorskip("torch")
    out = tmp_path / "p.json"
    argv = ["--lengths", "64,128,192,256", "--prefix-fractions", "0,0.5", "--batches", "1,2", "--repeats", "1"]
    done = run("profile_engine.py", *argv, "--out", str(out), timeout=120)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(out.read_text())["decode_samples"]) == 8  # every batch at every length


@pytest.mark.parametrize("option", ["--ray-address=10.255.255.1:6379", "--ray-dashboard"])
def test_cluster_refuses_ray_options_without_the_ray_backend(option: str) -> None:
    """The local backend ignored them (and --ray-address skipped the machine check of a local launch)."""
    refused(run("cluster.py", option, "--port", "0", timeout=30), f"{option.split('=')[0]} needs --backend ray")


# validate.py in-process, its clusters replaced by records of the test's own.


def _record(request_id: str, outcome: Outcome | None, intervals_ms: list[float]) -> RequestRecord:
    done = RequestRecord(request_id=RequestId(request_id), arrival_s=0.0, input_tokens=10, output_tokens=1)
    done.outcome = outcome
    if outcome is Outcome.COMPLETED:
        done.first_token_s = 0.05
        for interval in intervals_ms:
            done.intervals.add(interval / 1000, 0.0, 1)
        done.output_tokens = len(intervals_ms) + 1
        done.tbt_s = max(intervals_ms, default=0.0) / 1000
    return done


def test_validate_plots_the_simulated_tbts_it_compares(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The TBT plot drew the engine-paced simulated TBTs while the table and JSON compared those a client would
    see (with the calibration's jitter): the plot showed the simulator 3x faster where the table said 27 %. And a
    one-token answer (TBT 0) is left out, as the table's TBT leaves it out."""
    validate = pytest.importorskip("validate")
    calibration = validate.Calibration(first_token_s=0.0, prefill_scale=1.0, step_s=0.0, jitter_s=(0.002, 0.004))
    real = [_record(str(i), Outcome.COMPLETED, [3.0] * 9) for i in range(4)] + [_record("one", Outcome.COMPLETED, [])]
    sim = [_record(str(i), Outcome.COMPLETED, [1.0] * 9) for i in range(4)] + [_record("one", Outcome.COMPLETED, [])]
    result = validate.compare(real, sim, Slo(), 8, calibration)
    drawn: dict[str, dict[str, list[float]]] = {}
    monkeypatch.setattr(validate, "plot_cdfs", lambda data, path, **_: drawn.__setitem__(path.name, data))
    validate.plot("serviceable", real, result.sim_records, tmp_path)
    simulated = drawn["tbt_cdf_serviceable.png"]["simulated"]
    assert len(simulated) == 4 and len(drawn["tbt_cdf_serviceable.png"]["real"]) == 4  # "one" left out
    assert sum(simulated) / 4 == pytest.approx(result.sim.tbt_s["mean"] * 1000)
    assert min(simulated) > 1.0 + 1.5  # jitter added: not the engine-paced 1 ms


def _fake_runs(monkeypatch: pytest.MonkeyPatch, validate: Any, real_outcome: Outcome | None) -> None:
    calibration = validate.Calibration(first_token_s=0.0, prefill_scale=1.0, step_s=0.0)

    def run_real(config: Any, requests: list[Any], args: Any) -> tuple[list[RequestRecord], Any]:
        return [_record(r.request_id, real_outcome, [2.0] * 3) for r in requests], calibration

    def run_sim(config: Any, requests: list[Any], args: Any, calibration: Any) -> list[RequestRecord]:
        return [_record(r.request_id, Outcome.COMPLETED, [2.0] * 3) for r in requests]

    monkeypatch.setattr(validate, "run_real", run_real)
    monkeypatch.setattr(validate, "run_sim", run_sim)


def test_validate_counts_failures_and_exits_1_when_nothing_was_compared(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Real requests that got no answer appeared in no figure (rejected_real 0), and a run that compared nothing
    exited 0 with a table of zeros."""
    validate = pytest.importorskip("validate")
    _fake_runs(monkeypatch, validate, None)
    argv = ["--profile", str(profile_file(tmp_path)), "--num-requests", "3", "--no-overload", "--json"]
    assert validate.validate(argv) == 1
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert (summary["failed_real"], summary["compared_requests"]) == (3, 0)
    assert "no request completed in both runs of serviceable: nothing compared" in captured.err


def test_validate_repeats_the_real_run_on_a_second_cluster_when_asked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--repeat-real runs the serviceable workload on a real cluster twice (not the overload one) and compares the
    two runs under `real_repeat`, the errors alone (the slow end-to-end test runs real clusters without it)."""
    validate = pytest.importorskip("validate")
    _fake_runs(monkeypatch, validate, Outcome.COMPLETED)
    real_runs: list[int] = []
    fake_real = validate.run_real
    monkeypatch.setattr(validate, "run_real", lambda *a: real_runs.append(len(a[1])) or fake_real(*a))
    argv = ["--profile", str(profile_file(tmp_path)), "--num-requests", "3", "--repeat-real", "--json"]
    assert validate.validate(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert real_runs == [3, 3, 3]  # serviceable, its repeat, overload
    assert set(summary["real_repeat"]) == {"ttft_median_rel_error", "ttft_p90_rel_error", "tbt_mean_rel_error"}
    assert summary["real_repeat"]["ttft_median_rel_error"] == 0.0  # the fake's two runs are equal
    assert "real_repeat" not in summary["overload"]


def test_validate_writes_its_files_as_one_set(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--out's files are put in place together at the end (a previous run's overload plots, which this run does
    not draw, are removed, not left beside the new validate.json); a profile given is named as given."""
    pytest.importorskip("matplotlib")
    validate = pytest.importorskip("validate")
    _fake_runs(monkeypatch, validate, Outcome.COMPLETED)
    out = tmp_path / "out"
    out.mkdir()
    (out / "tbt_cdf_overload.png").write_text("an older run's")
    profile = profile_file(tmp_path)
    argv = ["--profile", str(profile), "--num-requests", "3", "--no-overload", "--json", "--out", str(out)]
    assert validate.validate(argv) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "tbt_cdf_serviceable.png",
        "ttft_cdf_serviceable.png",
        "validate.json",
    ]
    summary = json.loads((out / "validate.json").read_text())
    assert summary["profile"] == str(profile) and summary["failed_real"] == 0 and summary["compared_requests"] == 3


def test_calibration_refits_the_other_coefficient_when_one_is_bounded() -> None:
    """A slope below 1 was clamped to 1 while the intercept kept the value fitted with the lower slope: every
    simulated TTFT came out too long by (1 - slope) · prefill. With the slope fixed at 1 the intercept is the
    median excess; with the intercept fixed at 0 the slope is fitted through the origin."""
    np = pytest.importorskip("numpy")
    validate = pytest.importorskip("validate")
    profiled = np.array([0.01, 0.02, 0.04, 0.08])
    scale, fixed = validate.fit_overheads(profiled, 0.5 * profiled + 0.02)  # slope 0.5: bounded at 1
    assert scale == 1.0 and fixed == pytest.approx(float(np.median(0.02 - 0.5 * profiled)))
    scale, fixed = validate.fit_overheads(profiled, 2.0 * profiled - 0.001)  # intercept < 0: bounded at 0
    assert fixed == 0.0 and scale == pytest.approx(
        float(np.dot(profiled, 2.0 * profiled - 0.001) / np.dot(profiled, profiled))
    )
    assert validate.fit_overheads(profiled, 1.5 * profiled + 0.01) == pytest.approx((1.5, 0.01))  # unbounded


def test_validate_does_not_name_a_temporary_profile_as_kept(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --out or --profile the profile is fitted into a scratch folder removed after the run: the output
    named that path as if it were there to rerun with."""
    validate = pytest.importorskip("validate")
    _fake_runs(monkeypatch, validate, Outcome.COMPLETED)
    fitted: list[Path] = []

    def profile(config_path: Path, config: Any, out: Path) -> Path:
        out.write_text(json.dumps(PROFILE))
        fitted.append(out)
        return out

    monkeypatch.setattr(validate, "profile", profile)
    assert validate.validate(["--num-requests", "3", "--no-overload"]) == 0
    assert "profile fitted now (temporary, removed: --out keeps it)" in capsys.readouterr().out
    assert not fitted[0].exists()
    assert validate.validate(["--num-requests", "3", "--no-overload", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["profile"] is None


@pytest.mark.parametrize("argv", [["--num-requests", "abc"], ["--engine", "nope"], ["--no-such-option"]])
def test_replay_refuses_a_bad_option_in_one_line(argv: list[str]) -> None:
    """argparse's own errors printed replay.py's whole usage block where its main promises one line on stderr."""
    done = run("replay.py", *argv)
    refused(done, "replay.py: error: ")


@pytest.mark.parametrize("level", ["LOUD", "", "10"])
def test_vllm_router_refuses_an_unknown_log_level_in_one_line(level: str) -> None:
    """logging.basicConfig's ValueError was a traceback, where the router's OneLineParser promises one line."""
    done = run("vllm_router.py", "--config", "/nonexistent/router.toml", "--log-level", level, timeout=30)
    refused(done, f"argument --log-level: invalid choice: {level.upper()!r}")


def test_vllm_router_takes_a_log_level_in_any_case() -> None:
    """`--log-level debug` is DEBUG: the run goes on to read its config (absent here: one line, status 1)."""
    done = run("vllm_router.py", "--config", "/nonexistent/router.toml", "--log-level", "debug", timeout=30)
    assert done.returncode == 1 and "/nonexistent/router.toml" in done.stderr, done.stderr
    assert "--log-level" not in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["demo.py", "--num-requests", "10"],
        ["replay.py", "--num-requests", "10"],
        ["experiments.py", "cache"],
        ["validate.py"],
        ["load.py"],
    ],
    ids=lambda argv: argv[0],
)
def test_an_empty_out_folder_is_refused(tmp_path: Path, argv: list[str]) -> None:
    """`--out ''` was Path(''), the current folder, where the demo's trace and plot were written: every example's
    output folder is refused empty (`mooncake.cli.folder_path`), as `mooncake trace` refuses an empty path."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / argv[0]), *argv[1:], "--out", ""],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    refused(done, "argument --out: expected a folder name, got ''")
    assert list(tmp_path.iterdir()) == []
