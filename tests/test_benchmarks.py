"""Benchmarks and the demo still run (tiny sizes; speed is never asserted here)."""

from __future__ import annotations

import errno
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from mooncake.workload import ArrivalProcess, generate_requests, preset, write_trace

ROOT = Path(__file__).resolve().parents[1]


def run_json(script: str, *args: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, str(ROOT / script), "--json", *args], capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(done.stdout)  # type: ignore[no-any-return]


SIGNED = {"hit_path_share"}  # 1 - (decisions/s with the index) / (without it)


@pytest.mark.parametrize(
    ("script", "args", "keys"),
    [
        (
            "benchmarks/hashing.py",
            ["--requests", "4", "--blocks-per-request", "2", "--repeats", "1"],
            [
                "batch_blocks_per_s",
                "per_request_blocks_per_s",
                "sha256_chain_blocks_per_s",
                "speedup_vs_sha256",
                "plain_batch_blocks_per_s",
            ],
        ),
        (  # one request: the warm-up hashed two
            "benchmarks/hashing.py",
            ["--requests", "1", "--blocks-per-request", "2", "--repeats", "1"],
            ["batch_blocks_per_s", "sha256_chain_blocks_per_s", "plain_batch_blocks_per_s"],
        ),
        (
            "benchmarks/conductor.py",
            ["--keys", "6400", "--decisions", "200"],
            [
                *(
                    key
                    for suffix in ("", "_without_index", "_without_ttft_objective", "_512_instances")
                    for key in (
                        f"decisions_per_s{suffix}",
                        f"decisions_per_s{suffix}_fastest_round",
                        f"accepted_fraction{suffix}",
                    )
                ),
                "match_share",
                "hit_path_share",
            ],
        ),
        (
            "benchmarks/index.py",
            ["--keys", "6400", "--queries", "200"],
            ["matches_per_s", "bytes_per_key", "naive_matches_per_s", "speedup_vs_naive", "plain_matches_per_s"],
        ),
        (
            "benchmarks/tiered_cache.py",
            ["--total-mib", "32", "--small-ops", "2000", "--repeats", "1"],
            [
                "dram_put_gbps",
                "dram_get_gbps",
                "memcpy_gbps",
                "dram_vs_memcpy",
                "ssd_write_gbps",
                "ssd_read_gbps",
                "raw_file_write_gbps",
                "raw_file_read_gbps",
                "ssd_vs_raw",
                "small_put_ops_per_s",
                "small_get_ops_per_s",
                "small_ops_per_s",
            ],
        ),
    ],
    ids=["hashing", "hashing one request", "conductor", "index", "tiered_cache"],
)
def test_benchmark_prints_its_figures(script: str, args: list[str], keys: list[str], tmp_path: Path) -> None:
    """Each benchmark runs with --json and prints every figure its docstring names, all positive."""
    if script.endswith("tiered_cache.py"):
        args = [*args, "--dir", str(tmp_path)]
    result = run_json(script, *args)
    for key in keys:
        assert isinstance(result[key], float) and math.isfinite(result[key]), key
        # A share of one timed run in another is a difference of two timings: on a busy machine it may come out
        # below zero, and speed is measured here, not asserted. Every other figure is a rate, size or ratio.
        assert key in SIGNED or result[key] > 0, key
    if script.endswith("tiered_cache.py"):
        per_size = keys[:9]  # the DRAM and SSD figures, at each page size
        assert set(result["by_page_size"]) == {"1MiB", "16MiB"}  # type: ignore[arg-type]
        for figures in result["by_page_size"].values():  # type: ignore[attr-defined]
            assert set(figures) == set(per_size) and all(figures[k] > 0 for k in per_size), figures


def test_conductor_benchmark_counts_what_it_indexed_and_alternates_rounds() -> None:
    """`keys` is what the index holds (whole 64-block chains: 6,500 asked, 6,464 indexed), every configuration
    is timed over several alternating rounds (the 512-instance one over at least 4), and the match's share, timed
    on its own, is a part of a decision. Before, `keys` echoed the 6,500 asked, each configuration ran once, and
    the 512-instance figure rested on one timed round."""
    result = run_json("benchmarks/conductor.py", "--keys", "6500", "--decisions", "200")
    assert result["keys"] == 6464 and result["blocks_per_request"] == 64
    assert result["decisions_per_round"] == 50 and result["timed_rounds"] == 3  # 200 in rounds of 50, one warm-up
    assert result["timed_rounds_512_instances"] == 4 and result["decisions_512_instances"] == 5 * 50
    for suffix in ("", "_without_index", "_without_ttft_objective", "_512_instances"):
        median, fastest = result[f"decisions_per_s{suffix}"], result[f"decisions_per_s{suffix}_fastest_round"]
        assert 0 < median <= fastest, suffix  # type: ignore[operator]
        assert 0 < result[f"accepted_fraction{suffix}"] <= 1, suffix  # type: ignore[operator]
    assert 0 < result["match_share"] < 1  # type: ignore[operator]
    assert "index_share" not in result  # renamed: it was never the match alone


def test_transfer_benchmark_prints_its_figures() -> None:
    """The transfer benchmark (without the upstream engine, which it would download) prints its figures."""
    result = run_json(
        "benchmarks/transfer.py", "--no-upstream", "--rounds", "1", "--repeats", "1", "--latency-samples", "20"
    )
    for key in ("tcp_gbps", "shm_gbps", "raw_socket_gbps", "memcpy_gbps"):
        assert set(result[key]) == {"1MiB_gbps", "16MiB_gbps", "64MiB_gbps"}, key  # type: ignore[arg-type]
    for key in (
        "tcp_vs_raw_socket",
        "shm_vs_memcpy",
        "tcp_4kib_median_us",
        "shm_4kib_median_us",
        "tcp_batch_32x1mib_gbps",
        "shm_batch_32x1mib_gbps",
    ):
        assert isinstance(result[key], float) and result[key] > 0, key
    checksum_sizes = {"4KiB_gbps", "64KiB_gbps", "1MiB_gbps", "4MiB_gbps", "64MiB_gbps"}
    for key in ("checksummed_write_staged_gbps", "checksummed_write_in_place_gbps", "staged_vs_in_place"):
        figures = result[key]
        assert isinstance(figures, dict) and set(figures) == checksum_sizes, key
        assert all(isinstance(v, float) and v > 0 for v in figures.values()), key
    # The single-stream peers are compared where ours does the same work (1 MiB: one slice), not at the sizes ours
    # spreads over several streams or threads; before, each ratio was the lowest over all three sizes.
    assert result["peer_ratios_at"] == "1MiB"
    for ours, peer, ratio in (
        ("tcp_gbps", "raw_socket_gbps", "tcp_vs_raw_socket"),
        ("shm_gbps", "memcpy_gbps", "shm_vs_memcpy"),
    ):
        assert result[ratio] == pytest.approx(result[ours]["1MiB_gbps"] / result[peer]["1MiB_gbps"]), ratio  # type: ignore[index]
    assert "skipped" in str(result["upstream_te"])


def test_sampling_benchmark_prints_its_figures() -> None:
    """The sampling benchmark (a small vocabulary) prints each case's cost per token and its ratio to the plain
    draw, all positive."""
    result = run_json("benchmarks/sampling.py", "--vocab", "2000", "--prompt-tokens", "100", "--tokens", "3")
    cases = {
        "greedy",
        "plain",
        "top_k_min_p",
        "penalties",
        "plain_previous_peer",
        "logprobs_5",
        "logprobs_5_sorted_peer",
    }
    for key in ("ms_per_token", "ratio_to_plain"):
        figures = result[key]
        assert isinstance(figures, dict) and set(figures) == cases, key
        assert all(isinstance(v, float) and v > 0 for v in figures.values()), key
    assert isinstance(result["logprobs_speedup_over_sorted_peer"], float)
    assert isinstance(result["plain_speedup_over_previous_peer"], float)


def test_demo_runs(tmp_path: Path) -> None:
    """The workload demo writes its workload and plot and prints the capacity table."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples/demo.py"), "--out", str(tmp_path), "--num-requests", "300"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "prefix hit ratio" in done.stdout and "sieve" in done.stdout
    assert (tmp_path / "synthetic.jsonl").stat().st_size > 0
    assert (tmp_path / "capacity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--num-requests", "-3"],
            "demo.py: error: argument --num-requests: must be an integer >= 0 and <= 1000000, got '-3' (see demo.py"
            " --help)\n",
        ),
        (["--seed", "-1"], "demo: --seed must be >= 0, got -1\n"),
        (["--out", "FILE"], "demo: --out FILE is a file, not a directory\n"),
        (["--out", "FILE/demo"], "demo: --out FILE/demo: FILE is a file, not a directory\n"),
    ],
    ids=["--num-requests -3", "--seed -1", "--out a file", "--out beneath a file"],
)
def test_demo_errors_are_one_line_and_status_2(tmp_path: Path, argv: list[str], message: str) -> None:
    """A bad option or an --out that is a file was a ConfigError or FileExistsError traceback."""
    (tmp_path / "FILE").write_text("mine")
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples/demo.py"), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert (done.returncode, done.stdout, done.stderr) == (2, "", message)
    assert [path.name for path in tmp_path.iterdir()] == ["FILE"]


def test_replay_speed_benchmark_prints_its_figures(tmp_path: Path) -> None:
    """The simulator benchmark prints the trace replay's and the large replay's figures."""
    trace = tmp_path / "trace.jsonl"
    write_trace(
        trace, generate_requests(preset("synthetic"), num_requests=150, arrivals=ArrivalProcess(rate_per_s=3.9))
    )
    result = run_json(
        "benchmarks/replay_speed.py",
        "--trace",
        str(trace),
        "--large-requests",
        "300",
        "--large-instances",
        "8",
        "--repeats",
        "1",
    )
    for key in (
        "sim_wall_s",
        "sim_wall_s_median",
        "requests_per_s",
        "stepwise_sim_wall_s",
        "stepwise_sim_wall_s_median",
        "analytic_speedup",
        "large_generate_s",
        "large_sim_wall_s",
        "large_requests_per_s",
        "peak_rss_gb",
    ):
        assert isinstance(result[key], float) and result[key] > 0, key
    assert result["num_requests"] == 150 and result["large_num_requests"] == 300 and result["large_instances"] == 8
    # One replay each: the fastest is the median, and the speedup is that pair's ratio.
    assert result["repeats"] == 1 and result["sim_wall_s"] == result["sim_wall_s_median"]
    assert result["analytic_speedup"] == pytest.approx(result["stepwise_sim_wall_s"] / result["sim_wall_s"])  # type: ignore[operator]


def test_engine_benchmark_prints_its_figures() -> None:
    """The real-engine benchmark prints prefill vs roofline, decode steps (ours and SDPA), layer-wise and CPP figures."""
    pytest.importorskip("torch")
    result = run_json(
        "benchmarks/engine.py",
        "--model",
        "tiny",
        "--prefill-tokens",
        "64",
        "--decode-context",
        "40",
        "--decode-batches",
        "1,2",
        "--layerwise-tokens",
        "64",
        "--cpp-tokens",
        "64",
        "--peer-batches",
        "1",
        "--peer-prompt-tokens",
        "32",
        "--peer-new-tokens",
        "4",
        "--repeats",
        "1",
    )
    for key in ("prefill_tokens_per_s", "roofline_tokens_per_s", "prefill_vs_roofline", "cpp_speedup"):
        assert isinstance(result[key], float) and result[key] > 0, key
    for key in ("decode_step_ms", "decode_step_ms_sdpa"):
        values = result[key]
        assert isinstance(values, dict) and values and all(v > 0 for v in values.values()), key
    # The waits and a ratio at every length; a lower bound (to 1 ms) where the layer-wise wait is under 1 ms.
    waits = result["layerwise_exposed_store_s"]["64"]
    assert waits["serialized"] > 0 and waits["layerwise"] >= 0
    assert set(result["layerwise_speedup"]) == {"64"} and result["layerwise_speedup"]["64"] > 0
    assert result["layerwise_speedup_bounds"] == (["64"] if waits["layerwise"] < 1e-3 else [])
    assert result["cpp_threads_per_stage"] == max(1, result["threads"] // 2)
    peers = result["peers"]
    assert peers["prefill_vs_transformers"]["1"] > 0 and peers["decode_vs_transformers"]["1"] > 0


def test_gateway_benchmark_prints_its_figures() -> None:
    """The gateway benchmark starts a tiny cluster and prints overhead, latency and sustained rate."""
    pytest.importorskip("torch")
    pytest.importorskip("aiohttp")
    result = run_json("benchmarks/gateway.py", "--requests", "5", "--seconds", "1", "--concurrency", "2")
    for key in ("engine_ms", "request_ms_p50", "request_ms_p90", "sustained_rps"):
        assert isinstance(result[key], float) and result[key] > 0, key
    assert result["overhead_ms"] == pytest.approx(result["request_ms_p50"] - result["engine_ms"])


@pytest.mark.parametrize(
    ("script", "argv"),
    [
        ("conductor.py", ["--keys", "10"]),  # fewer than one 64-block chain
        ("conductor.py", ["--decisions", "1"]),
        ("index.py", ["--keys", "10"]),
        ("index.py", ["--blocks-per-request", "0"]),
        ("index.py", ["--queries", "0"]),
        ("index.py", ["--plain-queries", "0"]),
        ("hashing.py", ["--requests", "0"]),
        ("hashing.py", ["--blocks-per-request", "0"]),
        ("hashing.py", ["--block-size", "0"]),
        ("hashing.py", ["--repeats", "0"]),
        ("replay_speed.py", ["--repeats", "0"]),
        ("transfer.py", ["--rounds", "0"]),
        ("transfer.py", ["--repeats", "0"]),
        ("transfer.py", ["--latency-samples", "0"]),
        ("sampling.py", ["--vocab", "0"]),
        ("sampling.py", ["--tokens", "0"]),
        ("sampling.py", ["--repeats", "0"]),
        ("tiered_cache.py", ["--total-mib", "8"]),  # under one 16 MiB page
        ("tiered_cache.py", ["--total-mib", "24"]),  # one 16 MiB page moved, 24 MiB counted
        ("tiered_cache.py", ["--repeats", "0"]),
        # engine.py: --threads 0 was torch's RuntimeError, --peer-batches 1,x a ValueError, --repeats 0 NaN in the
        # JSON; the lists were read only once the sections before them had run.
        ("engine.py", ["--threads", "0"]),
        ("engine.py", ["--peer-batches", "1,x"]),
        ("engine.py", ["--repeats", "0"]),
        ("engine.py", ["--decode-batches", "0"]),
        ("engine.py", ["--layerwise-tokens", "64,x"]),
        ("engine.py", ["--layerwise-tokens", "64,64"]),  # the results are keyed by length: one would be lost
        ("engine.py", ["--prefill-tokens", "0"]),
        ("engine.py", ["--decode-context", "0"]),
        ("engine.py", ["--cpp-tokens", "0"]),
        ("engine.py", ["--peer-prompt-tokens", "0"]),
        ("engine.py", ["--peer-new-tokens", "0"]),
        ("engine.py", ["--checkpoint", "no-such-checkpoint"]),
        # gpu.py: checked before CUDA is asked for (so here too) and the model is built on it.
        ("gpu.py", ["--lengths", "8192,x"]),
        ("gpu.py", ["--decode-batches", "0"]),
        ("gpu.py", ["--decode-context", "0"]),
        ("gpu.py", ["--peak-tflops", "0"]),
        ("replay_speed.py", ["--trace", "no-such-trace.jsonl"]),  # a generated workload was timed instead
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else value,
)
def test_benchmark_bad_option_is_a_usage_error(script: str, argv: list[str]) -> None:
    """A bad option ends in argparse's usage error, status 2, naming the option and its value, before any work.
    Most were tracebacks; hashing's zero counts printed zero rates, and --total-mib 24 rates over 24 MiB of which
    16 moved."""
    option, value = argv
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *argv], capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert f"error: {option} " in done.stderr and f"got {value}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def benchmark(name: str) -> ModuleType:
    """benchmarks/NAME.py as a module (the folder is no package), for its pure parts."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiered_cache_ssd_failure_is_the_error_raised_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure of the first raw-file setup (here ENOSPC from posix_fallocate), before the cache was ever made:
    the `finally` closed a cache that did not exist, so a KeyError masked the error, and bench.raw stayed."""
    tiered = benchmark("tiered_cache")

    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tiered.os, "posix_fallocate", no_space)
    with pytest.raises(OSError) as raised:
        tiered.ssd(tiered.MIB, tiered.MIB, 1, tmp_path)
    assert raised.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("given", "shown"), [("FILE", "FILE: a file"), ("FILE/ssd", "FILE/ssd: Not a directory")])
def test_tiered_cache_dir_that_is_no_directory_is_a_usage_error(tmp_path: Path, given: str, shown: str) -> None:
    """--dir naming a file (or a folder beneath one) was a FileExistsError (NotADirectoryError) traceback."""
    (tmp_path / "FILE").write_text("mine")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tiered_cache.py"), "--dir", given],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert "error: --dir must name a directory" in done.stderr and f"got {shown}" in done.stderr, done.stderr
    assert (tmp_path / "FILE").read_text() == "mine"


def test_vllm_routing_policy_that_completes_nothing_is_reported() -> None:
    """A policy whose every request the router refused (429) or that failed ended the whole run in
    statistics.fmean of no TTFT. Now it reports completed 0 and no TTFT, and a ratio only where both sides have
    a figure."""
    routing = benchmark("vllm_routing")
    refused = [{"status": 429, "ttft_s": None, "end_s": 1.0, "overhead_us": 0, "instance": None}] * 2
    nothing = routing.summarize(refused, 0.0, 0.0, 0.0)
    assert nothing["completed"] == 0 and nothing["rejected"] == 2 and nothing["failed"] == 0
    assert nothing["requests_per_s"] == 0.0 and nothing["per_instance"] == {}
    for key in ("hit_ratio", "mean_ttft_s", "median_ttft_s", "p90_ttft_s", "max_ttft_s", "router_overhead_us"):
        assert nothing[key] is None, key
    served = [
        {"status": 200, "ttft_s": ttft, "end_s": 2.0, "overhead_us": 100, "instance": "vllm-0"} for ttft in (0.1, 0.3)
    ]
    some = routing.summarize([*served, refused[0]], 0.0, 30.0, 60.0)
    assert (some["completed"], some["rejected"], some["hit_ratio"]) == (2, 1, 0.5)
    assert some["mean_ttft_s"] == pytest.approx(0.2) and some["max_ttft_s"] == 0.3
    assert some["requests_per_s"] == 1.0 and some["per_instance"] == {"vllm-0": 2}
    ratios = routing.ratios({"kvcache_centric": some, "round_robin": nothing, "load_balancing": some}, 0.25)
    assert ratios == {
        "hit_ratio_vs_lru_bound": 2.0,
        "hit_ratio_vs_round_robin": None,
        "hit_ratio_vs_least_loaded": 1.0,
        "mean_ttft_vs_round_robin": None,
        "mean_ttft_vs_least_loaded": 1.0,
    }
    json.dumps(ratios, allow_nan=False)  # valid JSON: null, never NaN


def test_sampling_benchmark_runs_on_a_small_vocabulary() -> None:
    """--vocab needs only >= 1, but the logprobs case asked for token 7: under 8 tokens, the library's
    InvalidRequestError traceback. The token is now one the vocabulary holds (the one a draw picks)."""
    result = run_json(
        "benchmarks/sampling.py", "--vocab", "5", "--prompt-tokens", "3", "--tokens", "1", "--repeats", "1"
    )
    assert result["vocab"] == 5 and result["ms_per_token"]["logprobs_5"] > 0  # type: ignore[index]


def test_replay_speed_malformed_trace_is_a_usage_error(tmp_path: Path) -> None:
    """A --trace with a malformed line was a TraceFormatError traceback; the usage error names the file and line."""
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 5\n')
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "replay_speed.py"), "--trace", str(trace)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert f"error: --trace must be a Mooncake-format trace, got {trace}:1: " in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
