"""Real engines on this machine: prefill against the roofline, decode steps, layer-wise I/O, CPP.

    python benchmarks/engine.py [--json] [--model small] [--prefill-tokens 1024]
        [--decode-context 2048] [--decode-batches 1,8,32] [--layerwise-tokens 2048,8192,32768]
        [--cpp-tokens 2048]

All in fp32 on the CPU (the GPU figures come from benchmarks/gpu.sh).

1. `prefill_tokens_per_s`: the prefill engine on a `--prefill-tokens` prompt of
   the `--model` preset (no cached prefix, KV stored layer-wise). The peer is the
   roofline: the model's FLOPs per token (mean context n/2) against the FLOP/s
   of a plain matmul of the model's MLP shape measured in the same run
   (`roofline_tokens_per_s`); `prefill_vs_roofline` is their ratio (goal ≥ 0.6).
2. `decode_step_ms` at each batch size with `--decode-context` tokens of context
   per request, ours (grouped matmul) and torch SDPA (`decode_step_ms_sdpa`); and
   one layer's attention alone (`decode_attention_ms`, `decode_attention_ms_sdpa`)
   over slot tensors shaped as the engine's.
3. `layerwise_speedup`: the store time exposed to the compute (the prefill's
   wait for its KV stores) when storing after the forward pass ÷ the same with
   layer-wise stores, at each `--layerwise-tokens` length (goal ≥ 3 at the
   longest). This runs the `tiny` preset (its prefill at 32 K tokens takes
   seconds here; `small` would take minutes) with 4 K-token chunks.
4. `cpp_speedup`: one prefill of `--cpp-tokens` in one process (all CPU threads)
   ÷ the same prompt through a 2-stage chunked pipeline (threads split between
   the stages). On 2 cores the pipeline has no spare hardware to win with:
   the figure says what 2 cores allow.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import numpy as np
import torch

from mooncake.cache import DramPagePool, TieredCache
from mooncake.cache.hashing import BlockHasher
from mooncake.engine.attention import decode_attention, sdpa_decode_attention
from mooncake.engine.config import PRESETS, ModelConfig
from mooncake.engine.decode import DecodeConfig, DecodeEngine
from mooncake.engine.kv import KvLayout
from mooncake.engine.model import LlamaModel
from mooncake.engine.pipeline import PipelineGroup
from mooncake.engine.prefill import PrefillConfig, PrefillEngine
from mooncake.types import BlockKey, RequestId

BLOCK_TOKENS = 16


def prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()  # type: ignore[no-any-return]


def cache_for(layout: KvLayout, tokens: int) -> TieredCache:
    return TieredCache([DramPagePool(layout.page_bytes, -(-tokens // layout.block_tokens) + 1)])


def matmul_flops_per_s(config: ModelConfig, rows: int) -> float:
    a = torch.randn(rows, config.hidden_size)
    b = torch.randn(config.hidden_size, 2 * config.intermediate_size)
    torch.mm(a, b)
    runs, started = 0, time.perf_counter()
    while runs < 3 or time.perf_counter() - started < 1.0:
        torch.mm(a, b)
        runs += 1
    return 2.0 * rows * config.hidden_size * 2 * config.intermediate_size * runs / (time.perf_counter() - started)


def bench_prefill(config: ModelConfig, n: int) -> dict[str, float]:
    model = LlamaModel(config, seed=0)
    hasher = BlockHasher(model=config.name, block_size_tokens=BLOCK_TOKENS)
    layout = KvLayout(config=config, block_tokens=BLOCK_TOKENS)
    tokens = prompt(n, config.vocab_size)
    with PrefillEngine(model, cache_for(layout, 2 * n), hasher) as engine:
        engine.prefill(tokens[:64])  # warm-up
        result = engine.prefill(tokens)
    measured = n / result.seconds
    roofline = matmul_flops_per_s(config, min(n, 4096)) / config.flops_per_token(n // 2)
    return {
        "prefill_tokens_per_s": measured,
        "roofline_tokens_per_s": roofline,
        "prefill_vs_roofline": measured / roofline,
    }


def bench_decode(config: ModelConfig, context: int, batches: list[int], steps: int = 5) -> dict[str, Any]:
    """Step times with every request holding `context` tokens of (random) KV loaded from the cache."""
    model = LlamaModel(config, seed=0)
    layout = KvLayout(config=config, block_tokens=BLOCK_TOKENS)
    cache = cache_for(layout, context)
    keys = [BlockKey(i + 1) for i in range(-(-context // BLOCK_TOKENS))]
    rng = np.random.default_rng(0)
    for b, key in enumerate(keys):
        tokens = min(BLOCK_TOKENS, context - b * BLOCK_TOKENS)
        cache.put(key, (rng.standard_normal(layout.block_bytes(tokens) // 4) * 0.5).astype(np.float32))
    ours: dict[str, float] = {}
    sdpa: dict[str, float] = {}
    for batch in batches:
        for attention, into in ((None, ours), (sdpa_decode_attention, sdpa)):
            options: dict[str, Any] = {"max_batch_size": batch, "max_context_tokens": context + steps + 2}
            if attention is not None:
                options["attention"] = attention
            engine = DecodeEngine(model, cache, block_tokens=BLOCK_TOKENS, config=DecodeConfig(**options))
            for r in range(batch):
                engine.try_join(RequestId(r), keys, prompt_tokens=context, first_token=r, max_new_tokens=steps + 2)
            engine.step()  # warm-up
            times = []
            for _ in range(steps):
                engine.step()
                times.append(engine.last_step_s)
            into[str(batch)] = 1e3 * float(np.median(times))
            del engine
    kernel = {str(b): attention_ms(config, context, b) for b in batches}
    return {
        "decode_step_ms": ours,
        "decode_step_ms_sdpa": sdpa,
        "decode_sdpa_over_ours": {b: sdpa[b] / ours[b] for b in ours},
        "decode_attention_ms": {b: k[0] for b, k in kernel.items()},
        "decode_attention_ms_sdpa": {b: k[1] for b, k in kernel.items()},
    }


def attention_ms(config: ModelConfig, context: int, batch: int, repeats: int = 20) -> tuple[float, float]:
    """One layer's decode attention alone, ours and SDPA, over slots shaped as the decode engine's."""
    q = torch.randn(batch, config.num_heads, config.head_dim)
    k = torch.randn(batch, config.num_kv_heads, context + 64, config.head_dim)[:, :, :context]
    v = torch.randn_like(k)
    lengths = torch.full((batch,), context)
    times = []
    for kernel in (decode_attention, sdpa_decode_attention):
        kernel(q, k, v, lengths)
        started = time.perf_counter()
        for _ in range(repeats):
            kernel(q, k, v, lengths)
        times.append(1e3 * (time.perf_counter() - started) / repeats)
    return times[0], times[1]


def bench_layerwise(lengths: list[int]) -> dict[str, Any]:
    config = PRESETS["tiny"]
    model = LlamaModel(config, seed=0)
    hasher = BlockHasher(model=config.name, block_size_tokens=BLOCK_TOKENS)
    layout = KvLayout(config=config, block_tokens=BLOCK_TOKENS)
    exposed: dict[str, dict[str, float]] = {}
    speedup: dict[str, float] = {}
    for n in lengths:
        tokens = prompt(n, config.vocab_size, seed=n)
        waits = {}
        for layerwise in (False, True):
            options = PrefillConfig(chunk_tokens=4096, layerwise=layerwise)
            with PrefillEngine(model, cache_for(layout, n), hasher, options) as engine:
                result = engine.prefill(tokens)
            waits["layerwise" if layerwise else "serialized"] = result.store_wait_s
        exposed[str(n)] = waits
        speedup[str(n)] = waits["serialized"] / max(waits["layerwise"], 1e-6)
    return {"layerwise_exposed_store_s": exposed, "layerwise_speedup": speedup}


def bench_cpp(config: ModelConfig, n: int, chunk: int = 256) -> dict[str, float]:
    tokens = prompt(n, config.vocab_size)
    model = LlamaModel(config, seed=0)
    hasher = BlockHasher(model=config.name, block_size_tokens=BLOCK_TOKENS)
    layout = KvLayout(config=config, block_tokens=BLOCK_TOKENS)
    with PrefillEngine(model, cache_for(layout, n), hasher, PrefillConfig(chunk_tokens=chunk, store=False)) as engine:
        engine.prefill(tokens[:64])
        single = engine.prefill(tokens).seconds
    del model
    with PipelineGroup(config, num_stages=2, chunk_tokens=chunk, seed=0) as group:
        group.prefill(tokens[:64])
        started = time.perf_counter()
        group.prefill(tokens)
        piped = time.perf_counter() - started
    return {"cpp_single_s": single, "cpp_pipeline_s": piped, "cpp_speedup": single / piped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--model", default="small", choices=sorted(PRESETS))
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--decode-context", type=int, default=2048)
    parser.add_argument("--decode-batches", default="1,8,32")
    parser.add_argument("--layerwise-tokens", default="2048,8192,32768")
    parser.add_argument("--cpp-tokens", type=int, default=2048)
    args = parser.parse_args()
    config = PRESETS[args.model]
    torch.manual_seed(0)
    result: dict[str, Any] = {
        "model": config.name,
        "parameters": config.num_parameters,
        "threads": torch.get_num_threads(),
    }
    result["cpus"] = os.cpu_count()
    result.update(bench_prefill(config, args.prefill_tokens))
    result.update(bench_decode(config, args.decode_context, [int(b) for b in args.decode_batches.split(",")]))
    result.update(bench_layerwise([int(n) for n in args.layerwise_tokens.split(",")]))
    result.update(bench_cpp(config, args.cpp_tokens))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{config.name} ({config.num_parameters / 1e6:.0f} M parameters), fp32, {result['threads']} threads")
    print(
        f"prefill   {result['prefill_tokens_per_s']:10.0f} tokens/s  roofline {result['roofline_tokens_per_s']:.0f}  "
        f"ratio {result['prefill_vs_roofline']:.2f} (goal >= 0.6)"
    )
    for batch, ms in result["decode_step_ms"].items():
        print(
            f"decode    batch {batch:>3}  ours {ms:8.2f} ms  sdpa {result['decode_step_ms_sdpa'][batch]:8.2f} ms  "
            f"sdpa/ours {result['decode_sdpa_over_ours'][batch]:.2f}   attention alone (one layer): ours "
            f"{result['decode_attention_ms'][batch]:.2f} ms, sdpa {result['decode_attention_ms_sdpa'][batch]:.2f} ms"
        )
    for n, ratio in result["layerwise_speedup"].items():
        waits = result["layerwise_exposed_store_s"][n]
        print(
            f"layerwise {int(n):>6} tokens  exposed store {waits['serialized'] * 1e3:8.1f} ms serialized, "
            f"{waits['layerwise'] * 1e3:6.1f} ms layer-wise  speedup {ratio:.1f} (goal >= 3 at the longest)"
        )
    print(
        f"cpp       X=2  single {result['cpp_single_s']:.2f} s  pipeline {result['cpp_pipeline_s']:.2f} s  "
        f"speedup {result['cpp_speedup']:.2f}"
    )


if __name__ == "__main__":
    main()
