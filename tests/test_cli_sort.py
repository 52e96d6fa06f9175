"""`--sort` on the command lines: `mooncake trace stats/capacity/convert`, and the examples that read a --trace
(replay.py, experiments.py, through examples/simulation.py's workload options).

A trace slightly out of order (logs merged with jitter) failed every command, `trace convert` included, so not
even a sorted copy could be written; `--skip-invalid` left out each line out of order. `--sort` reads it sorted by
timestamp (`iter_trace(sort=True)`, tested in tests/workload/test_trace_sort.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake.workload import load_trace
from tests.test_cli import run

ROOT = Path(__file__).resolve().parents[1]
BLOCK = "4"


def jittered_trace(path: Path, count: int = 40) -> Path:
    """`count` lines about 100 ms apart, every third one 150 ms early: out of order there."""
    lines = []
    for index in range(count):
        stamp = 100 * index - (150 if index % 3 == 2 else 0)
        line = {"timestamp": stamp, "input_length": 5, "output_length": 3, "hash_ids": [index % 5, 100 + index]}
        lines.append(json.dumps(line) + "\n")
    path.write_text("".join(lines))
    return path


@pytest.mark.parametrize("command", ["stats", "capacity"])
def test_stats_and_capacity_read_a_jittered_trace_with_sort(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """Without --sort the command fails naming the first line out of order and --sort; with it, every line is
    read, and the result is that of the trace written sorted."""
    source = jittered_trace(tmp_path / "jittered.jsonl")
    status, out, err = run(capsys, "trace", command, str(source), "--json", "--block-size", BLOCK)
    assert (status, out) == (2, "")
    assert err.startswith(f"mooncake: error: {source}:3: timestamp 50 is earlier than") and "--sort" in err, err
    status, sorted_out, err = run(capsys, "trace", command, str(source), "--json", "--block-size", BLOCK, "--sort")
    assert (status, err) == (0, ""), err
    ordered = tmp_path / "ordered.jsonl"
    lines = source.read_text().splitlines(keepends=True)
    ordered.write_text("".join(sorted(lines, key=lambda line: json.loads(line)["timestamp"])))
    status, out, err = run(capsys, "trace", command, str(ordered), "--json", "--block-size", BLOCK)
    assert (status, err) == (0, "") and json.loads(sorted_out) == json.loads(out)
    if command == "stats":
        assert json.loads(out)["num_requests"] == 40


def test_convert_with_sort_writes_a_sorted_copy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`convert --sort` writes a copy that reads strictly, every request of the trace in timestamp order."""
    source, target = jittered_trace(tmp_path / "jittered.jsonl"), tmp_path / "sorted.jsonl.gz"
    status, out, err = run(capsys, "trace", "convert", str(source), str(target), "--block-size", BLOCK)
    assert status == 2 and not target.exists() and "--sort" in err
    status, out, err = run(capsys, "trace", "convert", str(source), str(target), "--block-size", BLOCK, "--sort")
    assert (status, err) == (0, "") and "wrote 40 requests" in out
    copy = load_trace(target, block_size_tokens=4)
    assert copy == load_trace(source, block_size_tokens=4, sort=True)
    assert sorted(r.block_keys[1] for r in copy) == list(range(100, 140))


def test_sort_refuses_a_trace_with_sessions_naming_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A session's turns are decided by the order of its lines: --sort is refused at the first line naming one,
    status 2, nothing written."""
    source, target = tmp_path / "sessions.jsonl", tmp_path / "out.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 5, "output_length": 3},
        {"timestamp": 10, "session_id": "a", "input_length": 5, "output_length": 3},
        {"timestamp": 20, "session_id": "a", "input_length": 5, "output_length": 3},
    ]
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    status, out, err = run(capsys, "trace", "convert", str(source), str(target), "--block-size", BLOCK, "--sort")
    assert (status, out) == (2, "") and not target.exists()
    assert err.startswith(f"mooncake: error: {source}:2: the line names session 'a': a trace with sessions cannot")
    assert len(err.splitlines()) == 1


def example(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_replay_reads_a_jittered_trace_with_sort(tmp_path: Path) -> None:
    """replay.py --trace fails on a jittered trace naming --sort; with --sort it replays every line."""
    trace = jittered_trace(tmp_path / "jittered.jsonl")
    argv = ["--trace", str(trace), "--block-size", BLOCK, "--prefill", "1", "--decode", "1", "--json"]
    refused = example("replay.py", *argv)
    assert refused.returncode == 2 and f"{trace}:3:" in refused.stderr and "--sort" in refused.stderr
    done = example("replay.py", *argv, "--sort")
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert json.loads(done.stdout)["num_requests"] == 40


@pytest.mark.parametrize("script", [("replay.py",), ("experiments.py", "scheduling")])
def test_sort_without_a_trace_is_refused_by_name(script: tuple[str, ...], tmp_path: Path) -> None:
    """--sort with a generated workload would look like a setting the results were made with: one line, status 2."""
    done = example(*script, "--preset", "synthetic", "--num-requests", "20", "--out", str(tmp_path), "--sort")
    assert done.returncode == 2, done.stderr
    assert "--sort puts a --trace's lines in timestamp order; a generated workload comes in order" in done.stderr
