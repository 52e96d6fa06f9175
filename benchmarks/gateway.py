"""Gateway and Conductor overhead of the example cluster, and the request rate it sustains.

    python benchmarks/gateway.py [--json] [--requests 200] [--concurrency 8] [--seconds 10] [--prompt-tokens 64]

A 1 prefill + 1 decode cluster of the tiny model on 127.0.0.1. Requests ask for
one token (so decode does no step), with prompts of `--prompt-tokens` bytes that
share nothing (each one computes its whole prompt).

- `engine_ms`: the peer, in this process: the same prefill (tiny model, its own
  cache) plus the decode join, with no HTTP, no Conductor and no processes;
- `request_ms_p50` / `p90`: a client's latency for one request, sequentially;
- `overhead_ms`: request_ms_p50 − engine_ms: what the gateway, the Conductor,
  the control calls and the KV stream to the decode node add per request;
- `sustained_rps`: requests per second with `--concurrency` clients for `--seconds`;
- `gateway_cpu_ms`: CPU time of the gateway's process (its event loop and its
  call pool) per request while sustaining that rate; the clients run in a child
  process and the engines in their own, so neither is in it.

`--profile N` profiles the gateway's event-loop thread (cProfile) during the
sustained phase and prints its N most expensive functions by own time.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import math
import multiprocessing
import pstats
import statistics
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from serving.config import load_config
from serving.launch import RunningCluster, start_cluster

from mooncake.cache import DramPagePool, TieredCache
from mooncake.cache.hashing import BlockHasher
from mooncake.engine.config import PRESETS
from mooncake.engine.decode import DecodeEngine
from mooncake.engine.kv import KvLayout
from mooncake.engine.model import LlamaModel
from mooncake.engine.prefill import PrefillEngine
from mooncake.types import RequestId

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny.toml"


def prompts(count: int, size: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["".join(chr(c) for c in rng.integers(97, 123, size=size)) for _ in range(count)]


def engine_ms(size: int, repeats: int = 30) -> float:
    import torch

    torch.set_num_threads(1)  # as the cluster's workers run
    config = PRESETS["tiny"]
    model = LlamaModel(config, seed=0)
    layout = KvLayout(config=config, block_tokens=16)
    cache = TieredCache([DramPagePool(layout.page_bytes, 4096)])
    decode = DecodeEngine(model, cache, block_tokens=16)
    times = []
    with PrefillEngine(model, cache, BlockHasher(model="tiny", block_size_tokens=16)) as prefill:
        for i, text in enumerate(prompts(repeats, size, seed=1)):
            started = time.perf_counter()
            done = prefill.prefill(list(text.encode()))
            decode.try_join(RequestId(i), done.keys, prompt_tokens=size, first_token=done.first_token, max_new_tokens=1)
            times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times[3:])


async def post(session: aiohttp.ClientSession, url: str, prompt: str) -> int:
    body = {"prompt": prompt, "max_tokens": 1}
    async with session.post(f"{url}/v1/completions", json=body) as answer:
        await answer.read()
        return answer.status


async def measure(url: str, args: argparse.Namespace, marks: Connection) -> dict[str, float]:
    latencies = []
    async with aiohttp.ClientSession() as session:
        for prompt in prompts(10, args.prompt_tokens, seed=2):  # warm-up
            await post(session, url, prompt)
        for prompt in prompts(args.requests, args.prompt_tokens, seed=3):
            started = time.perf_counter()
            status = await post(session, url, prompt)
            if status != 200:
                raise SystemExit(f"a sequential request got HTTP {status}")
            latencies.append(time.perf_counter() - started)
        pool = iter(prompts(100_000, args.prompt_tokens, seed=4))
        done = 0
        rejected = 0
        deadline = time.perf_counter() + args.seconds

        async def client() -> None:
            nonlocal done, rejected
            while time.perf_counter() < deadline:
                if await post(session, url, next(pool)) == 200:
                    done += 1
                else:
                    rejected += 1

        marks.send("start")
        marks.recv()  # the gateway's process has read its CPU time
        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - started
        marks.send("end")
    return {
        "request_ms_p50": 1e3 * float(np.percentile(latencies, 50)),
        "request_ms_p90": 1e3 * float(np.percentile(latencies, 90)),
        "sustained_rps": done / elapsed,
        "sustained_rejected": float(rejected),
        "sustained_requests": float(done + rejected),
    }


def client_main(url: str, args: argparse.Namespace, marks: Connection) -> None:
    """The clients, in their own process (so they share no interpreter lock with the gateway)."""
    marks.send(asyncio.run(measure(url, args, marks)))


def run_clients(url: str, args: argparse.Namespace) -> dict[str, float]:
    """Run `measure` in a child process; add the gateway process's CPU time per sustained request.

    Raises:
        SystemExit: the clients' process ended (an error of theirs, on their stderr) or went silent for 600 s,
            named with the phase it did not reach.
    """
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    child = context.Process(target=client_main, args=(url, args, theirs), daemon=True)
    child.start()
    # The child has its own copy of its end now. Ours, held open, kept the pipe open after the child died, and
    # each wait below ran out its 600 s; closed, the child's death is an EOF at once.
    theirs.close()

    def receive(phase: str) -> Any:
        try:
            if ours.poll(600.0):
                return ours.recv()
        except EOFError:
            child.join(10.0)
            raise SystemExit(f"the clients' process ended with exit code {child.exitcode} before {phase}") from None
        raise SystemExit(f"the clients sent nothing for 600 s before {phase}")

    try:
        if receive("the sustained phase") != "start":
            raise SystemExit("the clients did not reach the sustained phase")
        cpu = time.process_time()  # every thread of this process: the gateway's loop and its call pool
        ours.send("go")
        if receive("the end of the sustained phase") != "end":
            raise SystemExit("the clients did not finish the sustained phase")
        cpu = time.process_time() - cpu
        result: dict[str, float] = receive("their result")
    finally:
        ours.close()
        child.join(10.0)
        if child.is_alive():
            child.kill()
    result["gateway_cpu_ms"] = 1e3 * cpu / max(1.0, result.pop("sustained_requests"))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print the gateway's N costliest functions")
    args = parser.parse_args()
    for option in ("requests", "concurrency", "prompt_tokens"):
        if getattr(args, option) < 1:  # no request: the clients' percentiles of nothing; no client: 0 requests/s
            parser.error(f"--{option.replace('_', '-')} must be at least 1, got {getattr(args, option)}")
    if not 0 < args.seconds < math.inf:
        parser.error(f"--seconds must be a finite number > 0, got {args.seconds:g}")
    if args.profile < 0:
        parser.error(f"--profile must be at least 0 (0: no profile), got {args.profile}")
    config = load_config(CONFIG).with_overrides("cluster", port=0, num_prefill=1, num_decode=1)
    result: dict[str, float] = {"engine_ms": engine_ms(args.prompt_tokens)}
    profiler = cProfile.Profile()
    with start_cluster(config) as cluster:
        if args.profile:  # cProfile profiles the thread that enables it: the gateway's event loop
            on_loop(cluster, profiler.enable)
        result.update(run_clients(cluster.url, args))
        if args.profile:
            on_loop(cluster, profiler.disable)
    result["overhead_ms"] = result["request_ms_p50"] - result["engine_ms"]
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"1P+1D tiny cluster, {args.prompt_tokens}-token prompts, 1-token outputs")
    print(f"engine alone (peer)   {result['engine_ms']:8.2f} ms")
    print(f"request p50 / p90     {result['request_ms_p50']:8.2f} / {result['request_ms_p90']:.2f} ms")
    print(f"gateway overhead      {result['overhead_ms']:8.2f} ms per request")
    print(
        f"sustained             {result['sustained_rps']:8.1f} requests/s with {args.concurrency} clients "
        f"({result['sustained_rejected']:.0f} rejected)"
    )
    print(f"gateway CPU           {result['gateway_cpu_ms']:8.2f} ms per request (its threads, sustained)")
    if args.profile:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)


def on_loop(cluster: RunningCluster, call: Callable[[], object]) -> None:
    """Run `call` on the gateway's event-loop thread and wait for it."""
    done = threading.Event()

    def run() -> None:
        call()
        done.set()

    cluster.loop.call_soon_threadsafe(run)
    if not done.wait(10.0):
        raise SystemExit("the gateway's event loop did not answer within 10 s")


if __name__ == "__main__":
    main()
