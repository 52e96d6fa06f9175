"""The `mooncake` command line: trace stats, generate and capacity, errors and exit statuses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mooncake.cli import main
from mooncake.workload import load_trace

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SYNTHETIC_STATS = {"num_requests": 3993, "mean_input_length": 15325.5, "mean_output_length": 149.1}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """main(argv) in-process: (exit status, stdout, stderr)."""
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    status, out, err = run(capsys, *argv)
    assert (status, err) == (0, "")
    return json.loads(out)


@pytest.fixture
def small_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """A 200-request synthetic trace written by `trace generate`."""
    path = tmp_path / "small.jsonl"
    assert (
        run(capsys, "trace", "generate", "--preset", "synthetic", "--num-requests", "200", "--out", str(path))[0] == 0
    )
    return path


# --------------------------------------------------------------------------- trace stats


def test_console_script_runs_trace_stats(synthetic_trace: Path) -> None:
    """The installed `mooncake` console script exists next to the interpreter and prints stats JSON."""
    script = Path(sys.executable).with_name("mooncake")
    assert script.exists(), f"console script missing at {script}"
    result = subprocess.run(
        [str(script), "trace", "stats", str(synthetic_trace), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (result.returncode, result.stderr) == (0, "")
    assert json.loads(result.stdout)["num_requests"] == 3993


def test_trace_stats_json_on_the_synthetic_trace(synthetic_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`trace stats --json`: 3,993 requests, mean input 15,325.5, output 149.1, prefix reuse 0.6396."""
    stats = run_json(capsys, "trace", "stats", str(synthetic_trace), "--json")
    assert stats["num_requests"] == SYNTHETIC_STATS["num_requests"]
    assert round(stats["mean_input_length"], 1) == SYNTHETIC_STATS["mean_input_length"]
    assert round(stats["mean_output_length"], 1) == SYNTHETIC_STATS["mean_output_length"]
    assert round(stats["prefix_reuse_ratio"], 4) == 0.6396
    assert set(stats) >= {"max_input_length", "num_blocks", "num_unique_blocks", "duration_s", "mean_rate_per_s"}


def test_trace_stats_text(synthetic_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without --json, stats print as aligned text with the same figures."""
    status, out, err = run(capsys, "trace", "stats", str(synthetic_trace))
    assert (status, err) == (0, "")
    assert "requests             3,993" in out
    assert "mean input tokens    15,325.5" in out
    assert "mean output tokens   149.1" in out
    assert "prefix reuse ratio   0.6396" in out


# --------------------------------------------------------------------------- trace capacity


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ((), {"1000": 0.0825, "10000": 0.4235, "50000": 0.6396}),
        (("--prefix-aware",), {"1000": 0.0841, "10000": 0.4239, "50000": 0.6396}),
    ],
    ids=["lru", "lru-prefix-aware"],
)
def test_trace_capacity_on_the_synthetic_trace(
    synthetic_trace: Path, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], expected: dict[str, float]
) -> None:
    """LRU hit ratios at 1k/10k/50k blocks (to 4 decimals); at 50k (all blocks fit) they equal the reuse ratio."""
    result = run_json(
        capsys,
        "trace",
        "capacity",
        str(synthetic_trace),
        "--policy",
        "lru",
        "--capacity-blocks",
        "1000,10000,50000",
        "--json",
        *flags,
    )
    assert result["policy"] == "lru"
    assert result["prefix_aware"] is bool(flags)
    assert {capacity: round(ratio, 4) for capacity, ratio in result["hit_ratio"].items()} == expected
    assert list(result["hit_ratio"]) == ["1000", "10000", "50000"]
    reuse = run_json(capsys, "trace", "stats", str(synthetic_trace), "--json")["prefix_reuse_ratio"]
    assert result["hit_ratio"]["50000"] == pytest.approx(reuse, abs=1e-6)


def test_capacity_plot_writes_a_png(small_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--plot writes a PNG file (checked by its signature) and the text table still prints."""
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the dev extra)")
    plot = tmp_path / "out.png"
    status, out, err = run(
        capsys, "trace", "capacity", str(small_trace), "--capacity-blocks", "10,100,1000", "--plot", str(plot)
    )
    assert (status, err) == (0, "")
    assert plot.read_bytes()[:8] == PNG_SIGNATURE
    assert "capacity (blocks)" in out and "1,000" in out


@pytest.mark.parametrize("policy", ["lfu", "length_aware", "sieve"])
def test_capacity_other_policies(small_trace: Path, capsys: pytest.CaptureFixture[str], policy: str) -> None:
    """Every listed policy runs; hit ratios lie in [0, 1] and the largest cache reaches the reuse ratio."""
    result = run_json(
        capsys, "trace", "capacity", str(small_trace), "--policy", policy, "--capacity-blocks", "5,100000", "--json"
    )
    assert result["policy"] == policy
    assert all(0.0 <= ratio <= 1.0 for ratio in result["hit_ratio"].values())
    reuse = run_json(capsys, "trace", "stats", str(small_trace), "--json")["prefix_reuse_ratio"]
    assert result["hit_ratio"]["100000"] == pytest.approx(reuse, abs=1e-6)


@pytest.mark.parametrize("blocks", ["0", "-5", "abc", "", ",", "1,x", "1.5", "100,0"])
def test_bad_capacity_blocks_is_an_argparse_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], blocks: str
) -> None:
    """--capacity-blocks must be comma-separated positive integers; otherwise argparse exits with 2."""
    with pytest.raises(SystemExit) as caught:
        main(["trace", "capacity", str(tmp_path / "t.jsonl"), "--capacity-blocks", blocks])
    assert caught.value.code == 2
    assert "--capacity-blocks" in capsys.readouterr().err


def test_unknown_policy_is_an_argparse_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown --policy exits with 2 and lists the choices."""
    with pytest.raises(SystemExit) as caught:
        main(["trace", "capacity", str(tmp_path / "t.jsonl"), "--policy", "fifo"])
    assert caught.value.code == 2
    assert "lru" in capsys.readouterr().err


# --------------------------------------------------------------------------- trace generate


def test_generate_then_stats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`trace generate --num-requests 200 --out X` writes a loadable trace; `trace stats X` reads it."""
    out = tmp_path / "gen.jsonl"
    status, text, err = run(
        capsys, "trace", "generate", "--preset", "synthetic", "--num-requests", "200", "--out", str(out)
    )
    assert (status, err) == (0, "")
    assert f"wrote 200 requests (synthetic, seed 0) to {out}" in text
    assert len(load_trace(out)) == 200
    stats = run_json(capsys, "trace", "stats", str(out), "--json")
    assert stats["num_requests"] == 200
    assert 0 < stats["prefix_reuse_ratio"] < 1


def test_generate_is_deterministic_per_seed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same options write the same bytes; another seed writes different ones."""
    paths = [tmp_path / f"{name}.jsonl" for name in ("a", "b", "c")]
    for path, seed in zip(paths, ["7", "7", "8"], strict=True):
        argv = [
            "trace",
            "generate",
            "--preset",
            "toolagent",
            "--num-requests",
            "50",
            "--seed",
            seed,
            "--out",
            str(path),
        ]
        assert run(capsys, *argv)[0] == 0
    assert paths[0].read_bytes() == paths[1].read_bytes() != paths[2].read_bytes()


def test_generate_block_size_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--block-size sets the tokens per hash id of the written trace."""
    out = tmp_path / "b64.jsonl"
    argv = ["trace", "generate", "--num-requests", "20", "--block-size", "64", "--out", str(out)]
    assert run(capsys, *argv)[0] == 0
    assert len(load_trace(out, block_size_tokens=64)) == 20
    assert run_json(capsys, "trace", "stats", str(out), "--json", "--block-size", "64")["num_requests"] == 20


@pytest.mark.parametrize(
    ("option", "value", "field"),
    [
        ("--rate", "0", "rate_per_s"),
        ("--cv", "-1", "cv"),
        ("--num-requests", "-3", "num_requests"),
        ("--block-size", "0", "block_size_tokens"),
    ],
)
def test_generate_with_bad_values_exits_2_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, value: str, field: str
) -> None:
    """An invalid option value prints one error line naming the field, returns 2 and writes no file."""
    out = tmp_path / "gen.jsonl"
    status, text, err = run(capsys, "trace", "generate", "--num-requests", "5", option, value, "--out", str(out))
    assert status == 2 and text == ""
    assert err.startswith("mooncake: error: ") and field in err
    assert err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_generate_unknown_preset_is_an_argparse_error(tmp_path: Path) -> None:
    """--preset accepts only the named presets."""
    with pytest.raises(SystemExit) as caught:
        main(["trace", "generate", "--preset", "chat", "--out", str(tmp_path / "x.jsonl")])
    assert caught.value.code == 2


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("command", [["stats"], ["capacity"], ["stats", "--json"]])
def test_malformed_trace_exits_2_naming_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    """A malformed line makes main return 2 with `file:line: reason` on stderr and nothing on stdout."""
    path = tmp_path / "bad.jsonl"
    good = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}'
    path.write_text(f"{good}\n\n{good.replace('[1]', '[1, 2]')}\n", encoding="utf-8")
    status, out, err = run(capsys, "trace", command[0], str(path), *command[1:])
    assert status == 2
    assert out == ""
    assert f"{path}:3: " in err
    assert "hash_ids" in err


def test_missing_trace_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A trace that does not exist is reported on stderr with status 2."""
    status, out, err = run(capsys, "trace", "stats", str(tmp_path / "absent.jsonl"))
    assert status == 2 and out == ""
    assert "absent.jsonl" in err


def test_non_utf8_trace_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A trace with bytes that are not UTF-8 is an input error: status 2 and one line on stderr."""
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1], "note": "\xe9"}\n')
    status, _, err = run(capsys, "trace", "stats", str(path))
    assert status == 2 and str(path) in err


@pytest.mark.parametrize("argv", [[], ["trace"], ["trace", "stats"], ["trace", "bogus"], ["cache"]])
def test_incomplete_commands_are_argparse_errors(argv: list[str]) -> None:
    """A missing command or argument exits with argparse's status 2."""
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2


def test_parallel_capacity_sweep_equals_the_sequential_one() -> None:
    """Forked workers give exactly the points of the in-process sweep, in the given order."""
    from mooncake.cli import capacity_sweep
    from mooncake.workload import generate_requests, preset

    keys = [r.block_keys for r in generate_requests(preset("toolagent"), num_requests=300, seed=2)]
    capacities = [50, 400, 10, 2000]
    for policy in ("lru", "sieve"):
        sequential = capacity_sweep(keys, policy, prefix_aware=True, capacities_blocks=capacities, jobs=1)
        parallel = capacity_sweep(keys, policy, prefix_aware=True, capacities_blocks=capacities, jobs=2)
        assert parallel == sequential
        assert [p.capacity_blocks for p in parallel] == capacities
