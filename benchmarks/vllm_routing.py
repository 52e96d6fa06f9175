"""The vLLM router against round-robin and least-loaded routing, on two real vLLM servers of this machine.

    python benchmarks/vllm_routing.py [--json] [--requests 120] [--rate 3] [--vllm-python .venv-vllm/bin/python]

One generated workload with shared prefixes that fits the model's 2,048-token
context (`--documents` system prompts of 600–1,000 tokens, popular by a Zipf
law, each request one of them plus a question of its own), arriving as a
Poisson process at `--rate` requests/s, is replayed over HTTP (streamed, so
that TTFT is the first token's) through the router with each policy in turn.
Each server's KV cache (`--kv-cache-mib`, 64 MiB: about 16 k tokens) holds
about half the documents: where a request goes decides whether its document
is still cached there, as in a fleet whose prompts outgrow one server's cache.
The policies:
`round_robin`, `load_balancing` (least loaded: the shortest queue) and
`kvcache_centric` (Algorithm 1 over the servers' KV events), with the TTFT
objective out of the way. The same two servers (prefix caching, 32-token
blocks, `make test-vllm`'s environment) serve every policy; their prefix
caches are emptied between policies (`/reset_prefix_cache`).

Per policy: vLLM's own prefix-cache hit ratio (the servers' hit and query
counters over the run), mean and p90 TTFT as the client saw it, requests/s
(completed over the span from the first arrival to the last answer), and the
router's overhead per request (from receiving it to sending it on: reading the
body, tokenizing, hashing, scheduling), and the requests refused (429: the
Conductor's decode rule finds a server's KV promised to the requests it
already holds). Ratios against both peers are printed, and against a bound
computed here: the hit ratio of one LRU cache as large as both servers' caches
together, fed every prompt's blocks in arrival order (what two caches could
hold if routing partitioned the documents between them perfectly and never
copied one to both; LRU, as vLLM evicts; not a strict bound: two LRU caches
holding different documents can keep what one LRU of their size would evict).
Goal: hit ratio >= 1.4x round-robin's, mean TTFT below both.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from vllm_fleet.background import BackgroundRouter
from vllm_fleet.config import parse_router_config
from vllm_fleet.model import make_model, words
from vllm_fleet.servers import SERVED_DTYPE, VllmFleet

from mooncake.cache import BlockHasher
from mooncake.cache.hashing import reusable_prefix_tokens
from mooncake.engine.checkpoint import read_model_config
from mooncake.engine.tokenizer import load_tokenizer

POLICIES = ("round_robin", "load_balancing", "kvcache_centric")
BLOCK = 32  # tokens per block: the servers' and the router's, and the LRU bound's


def lru_bound(requests: list[tuple[float, str]], model: Path, capacity_blocks: int) -> float:
    """The hit ratio (cached prompt tokens / prompt tokens, as vLLM counts it) of one LRU cache of
    `capacity_blocks` blocks fed each prompt's whole blocks in turn: a prompt finds its leading blocks
    held, as far as a prefill reuses them (`reusable_prefix_tokens`: whole blocks, never the one holding the
    last token, as vLLM counts), then holds all of them."""
    tokenizer, hasher = load_tokenizer(model), BlockHasher(model="bound", block_size_tokens=BLOCK)
    cache: collections.OrderedDict[int, None] = collections.OrderedDict()
    hits = total = 0
    for _at, prompt in requests:
        tokens = tokenizer.encode(prompt)
        keys = hasher.block_keys(tokens)[: len(tokens) // BLOCK]
        held = 0
        while held < len(keys) and keys[held] in cache:
            held += 1
        hits += reusable_prefix_tokens(len(tokens), held, BLOCK)
        total += len(tokens)
        for key in keys:
            cache[key] = None
            cache.move_to_end(key)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return hits / max(total, 1)


def workload(num_requests: int, num_documents: int, rate: float, seed: int) -> list[tuple[float, str]]:
    """(arrival s, prompt) per request: a Zipf-popular document and a question of its own."""
    rng = np.random.default_rng(seed)
    documents = [words(int(rng.integers(250, 420)), seed=seed * 1000 + d) for d in range(num_documents)]
    weights = 1.0 / np.arange(1, num_documents + 1)
    picks = rng.choice(num_documents, size=num_requests, p=weights / weights.sum())
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=num_requests))
    return [
        (float(at), documents[int(d)] + " " + words(int(rng.integers(8, 30)), seed=seed * 100_000 + i))
        for i, (at, d) in enumerate(zip(arrivals, picks, strict=True))
    ]


def counters(url: str) -> tuple[float, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as answer:
        text = answer.read().decode()

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^vllm:{name}\{{[^}}]*\}} (\S+)$", text, re.M))

    return total("prefix_cache_hits_total"), total("prefix_cache_queries_total")


def reset_caches(fleet: VllmFleet) -> None:
    for server in fleet:
        request = urllib.request.Request(f"{server.url}/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=30):
            pass


async def replay(url: str, model: str, requests: list[tuple[float, str]], max_tokens: int) -> list[dict[str, Any]]:
    import aiohttp

    async def one(session: aiohttp.ClientSession, at: float, prompt: str, start: float) -> dict[str, Any]:
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        sent = time.monotonic()
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
        async with session.post(f"{url}/v1/completions", json=body) as answer:
            first = None
            async for line in answer.content:
                if first is None and line.startswith(b"data:"):
                    first = time.monotonic()
            return {
                "status": answer.status,
                "ttft_s": (first - sent) if first is not None else None,
                "end_s": time.monotonic() - start,
                "overhead_us": int(answer.headers.get("X-Mooncake-Router-Overhead-Us", "0")),
                "instance": answer.headers.get("X-Mooncake-Prefill-Instance"),
            }

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        start = time.monotonic()
        return await asyncio.gather(*(one(session, at, prompt, start) for at, prompt in requests))


def run_policy(
    fleet: VllmFleet, model: Path, policy: str, requests: list[tuple[float, str]], max_tokens: int
) -> dict[str, Any]:
    reset_caches(fleet)
    time.sleep(0.5)
    text = (
        f'[router]\nport = 0\npolicy = "{policy}"\nblock_size = {BLOCK}\ntokenizer = "{model}"\n'
        f"ttft_slo_s = 600.0\n" + fleet.instances_toml()
    )
    import tomllib

    config = parse_router_config(tomllib.loads(text), f"<{policy}>")
    with BackgroundRouter(config) as router:
        before = [counters(server.url) for server in fleet]  # after the router's calibration prefills
        answers = asyncio.run(replay(router.url, router.router.model, requests, max_tokens))
    after = [counters(server.url) for server in fleet]
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return summarize(answers, requests[0][0], hits, queries)


def summarize(answers: list[dict[str, Any]], first_arrival_s: float, hits: float, queries: float) -> dict[str, Any]:
    """One policy's figures from its replay's answers (at least one) and the servers' prefix-cache counters.

    The TTFTs and the router's overhead are over the completed requests: where none completed (the router may
    refuse every one with 429) they are None beside `completed` 0, as is `hit_ratio` where the servers were asked
    nothing. Before, such a policy ended the whole run in `statistics.fmean` of nothing.
    """
    done = [a for a in answers if a["status"] == 200 and a["ttft_s"] is not None]
    ttfts = sorted(a["ttft_s"] for a in done)
    span = max(a["end_s"] for a in answers) - first_arrival_s
    per_instance: dict[str, int] = {}
    for answer in done:
        per_instance[answer["instance"]] = per_instance.get(answer["instance"], 0) + 1
    return {
        "completed": len(done),
        "rejected": sum(1 for a in answers if a["status"] == 429),
        "failed": sum(1 for a in answers if a["status"] != 429) - len(done),
        "hit_ratio": hits / queries if queries else None,
        "mean_ttft_s": statistics.fmean(ttfts) if ttfts else None,
        "median_ttft_s": ttfts[len(ttfts) // 2] if ttfts else None,
        "p90_ttft_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))] if ttfts else None,
        "max_ttft_s": ttfts[-1] if ttfts else None,
        "requests_per_s": len(done) / span,
        "router_overhead_us": statistics.fmean(a["overhead_us"] for a in done) if done else None,
        "per_instance": per_instance,
    }


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours ÷ theirs where both sides have a figure (a policy that completed nothing has no TTFT) and theirs is
    not 0 (no hit at all: no finite ratio); None otherwise."""
    return None if ours is None or not theirs else ours / theirs


def ratios(results: dict[str, Any], bound: float) -> dict[str, float | None]:
    """kvcache_centric's hit ratio against the LRU bound and both peers', its mean TTFT against theirs."""
    ours, round_robin, least_loaded = (results[p] for p in ("kvcache_centric", "round_robin", "load_balancing"))
    return {
        "hit_ratio_vs_lru_bound": ratio(ours["hit_ratio"], bound),
        "hit_ratio_vs_round_robin": ratio(ours["hit_ratio"], round_robin["hit_ratio"]),
        "hit_ratio_vs_least_loaded": ratio(ours["hit_ratio"], least_loaded["hit_ratio"]),
        "mean_ttft_vs_round_robin": ratio(ours["mean_ttft_s"], round_robin["mean_ttft_s"]),
        "mean_ttft_vs_least_loaded": ratio(ours["mean_ttft_s"], least_loaded["mean_ttft_s"]),
    }


def shown(value: float | None, spec: str, unit: str = "") -> str:
    """`value` formatted by `spec`, or "-" (as wide) where there is none."""
    text = "-" if value is None else f"{value:{spec}}{unit}"
    return f"{text:>{len(f'{0.0:{spec}}{unit}')}}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--documents", type=int, default=48)
    parser.add_argument("--rate", type=float, default=3.0)
    parser.add_argument("--kv-cache-mib", type=int, default=64, help="each server's KV cache (4 KiB a token)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-python", default=str(Path(__file__).resolve().parents[1] / ".venv-vllm/bin/python"))
    args = parser.parse_args()
    for option in ("requests", "documents", "kv_cache_mib", "max_tokens"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1, got {getattr(args, option)}")
    if not 0 < args.rate < math.inf:  # the arrivals' mean gap is 1 / rate
        parser.error(f"--rate must be a finite number > 0, got {args.rate:g}")
    if args.seed < 0:
        parser.error(f"--seed must be at least 0, got {args.seed}")
    if not Path(args.vllm_python).exists():
        sys.exit(f"error: no vLLM environment at {args.vllm_python}: `make vllm-env` builds it")
    requests = workload(args.requests, args.documents, args.rate, args.seed)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        model = make_model(Path(folder) / "tiny")
        with VllmFleet.start(
            python=args.vllm_python,
            model=model,
            count=2,
            block_size=BLOCK,
            log_dir=Path(folder) / "logs",
            kv_cache_bytes=args.kv_cache_mib << 20,
        ) as fleet:
            # A first pass warms both servers (compiled shapes, allocator) so that no policy pays for it.
            run_policy(fleet, model, "round_robin", requests[: min(20, len(requests))], args.max_tokens)
            for policy in POLICIES:
                results[policy] = run_policy(fleet, model, policy, requests, args.max_tokens)
        kv_bytes_per_token = read_model_config(model).shape(dtype=SERVED_DTYPE).kv_bytes_per_token
        bound = lru_bound(requests, model, 2 * (args.kv_cache_mib << 20) // (kv_bytes_per_token * BLOCK))
    results["lru_bound_hit_ratio"] = bound
    results["ratios"] = ratios(results, bound)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{args.requests} requests at {args.rate:g}/s, {args.documents} shared documents, 2 vLLM servers (CPU)")
    print(
        f"{'policy':<16}{'hit ratio':>10}{'mean TTFT':>11}{'p50':>9}{'p90':>9}{'max':>9}{'req/s':>7}{'429':>5}"
        f"{'overhead':>10}  per server"
    )
    for policy in POLICIES:
        r = results[policy]
        print(
            f"{policy:<16}{shown(r['hit_ratio'], '>10.3f')}{shown(r['mean_ttft_s'], '>10.3f', 's')}"
            f"{shown(r['median_ttft_s'], '>8.3f', 's')}{shown(r['p90_ttft_s'], '>8.3f', 's')}"
            f"{shown(r['max_ttft_s'], '>8.2f', 's')}{r['requests_per_s']:>7.2f}{r['rejected']:>5}"
            f"{shown(None if r['router_overhead_us'] is None else r['router_overhead_us'] / 1e3, '>8.2f', 'ms')}"
            f"  {r['per_instance']}"
        )
    print(f"{'LRU bound':<16}{bound:>10.3f}  (one LRU cache of both servers' size, perfectly partitioned)")
    for name, value in results["ratios"].items():
        print(f"{name}: {shown(value, '.2f', 'x')}")


if __name__ == "__main__":
    main()
