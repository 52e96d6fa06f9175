"""The benchmarks' options: a count or rate that makes no run is argparse's usage error, status 2, naming the option
and its value, before any work (as tests/test_benchmarks.py checks the others'); and the gateway benchmark ends at
once, naming its clients' exit, when their process dies.

Each run here parses options and stops, or runs a benchmark at a size of seconds; none starts a server.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def bench(script: str, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *argv], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    ("script", "argv", "shown"),
    [
        ("gateway.py", ["--requests", "0"], "0"),  # the clients' np.percentile of nothing, then a 10-minute wait
        ("gateway.py", ["--concurrency", "0"], "0"),  # "succeeded" at 0 requests/s
        ("gateway.py", ["--seconds", "0"], "0"),
        ("gateway.py", ["--seconds", "nan"], "nan"),
        ("gateway.py", ["--prompt-tokens", "0"], "0"),
        ("gateway.py", ["--profile", "-1"], "-1"),
        ("index.py", ["--instances", "0"], "0"),  # numpy's ValueError
        ("tiered_cache.py", ["--small-ops", "-3"], "-3"),  # numpy's ValueError
        ("tiered_cache.py", ["--small-ops", "0"], "0"),  # printed 0 put/s
        ("replay_speed.py", ["--large-instances", "0"], "0"),  # ArrivalProcess's ConfigError
        ("replay_speed.py", ["--large-instances", "1"], "1"),  # reported 2 instances, loaded as 1
        ("replay_speed.py", ["--large-instances", "7"], "7"),  # reported 6, loaded as 7
        ("replay_speed.py", ["--large-requests", "-1"], "-1"),  # skipped as 0 is
        ("replay_speed.py", ["--requests", "0"], "0"),  # an IndexError on the empty generated workload
        ("vllm_routing.py", ["--rate", "0"], "0"),  # ZeroDivisionError
        ("vllm_routing.py", ["--rate", "-1"], "-1"),  # numpy's ValueError
        ("vllm_routing.py", ["--rate", "inf"], "inf"),
        ("vllm_routing.py", ["--documents", "0"], "0"),  # ZeroDivisionError
        ("vllm_routing.py", ["--requests", "0"], "0"),
        ("vllm_routing.py", ["--kv-cache-mib", "0"], "0"),
        ("vllm_routing.py", ["--max-tokens", "0"], "0"),
        ("vllm_routing.py", ["--seed", "-1"], "-1"),
        ("sampling.py", ["--prompt-tokens", "-5"], "-5"),  # ran with an empty prompt
        ("sampling.py", ["--prompt-tokens", "0"], "0"),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else value,
)
def test_benchmark_option_out_of_range_is_a_usage_error(script: str, argv: list[str], shown: str) -> None:
    """Each was a traceback, a hang or a run of figures that mean nothing (see each case's comment)."""
    option = argv[0]
    done = bench(script, *argv)
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert f"error: {option} " in done.stderr and f"got {shown}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("instances", [1, 2, 2000])
def test_index_benchmark_runs_on_any_number_of_instances(instances: int) -> None:
    """Fewer than 3 instances was numpy's ValueError (a chain's 3 holders drawn without replacement from 2), more
    than 1024 an IndexError (a hidden cap on the instances' sequence numbers)."""
    done = bench(
        "index.py", "--json", "--keys", "640", "--instances", str(instances), "--queries", "4", "--plain-queries", "1"
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["instances"] == instances and result["keys"] > 0


def test_gateway_benchmark_ends_at_once_when_its_clients_die() -> None:
    """The parent kept its copy of the clients' pipe end, so their process dying gave no EOF: it waited 600 s
    three times over for a result that could not come. Here the clients fail at their first request (nothing
    listens at port 9): the parent ends within seconds, naming their exit code."""
    code = (
        "import argparse, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
        "import gateway\n"
        "options = argparse.Namespace(requests=1, concurrency=1, seconds=1.0, prompt_tokens=8)\n"
        "gateway.run_clients('http://127.0.0.1:9', options)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 1, done.stderr
    assert done.stderr.endswith("the clients' process ended with exit code 1 before the sustained phase\n"), done.stderr
